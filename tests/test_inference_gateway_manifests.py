"""The Gateway API Inference Extension variant (`configs/kubernetes/inference-gateway/`) is valid
and wired together.

Core objects are checked against the Kubernetes schemas (kubernetes-validate), the Gateway,
HTTPRoute and InferencePool against the CRDs vendored in `tests/fixtures/gateway-crds/`; then the
references between the objects, the beamline Deployment (`../deployment.yaml`) and the metric
names that `server/metrics.py` serves. Nothing here touches the network.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from fastapi.routing import APIRoute
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from server.config import ServerConfig
from server.metrics import (
    CACHE_CONFIG_INFO,
    LORA_REQUESTS_INFO,
    PROTOCOL_GAUGES,
    PROTOCOL_PREFIX,
    Metrics,
)
from tests.test_deployment import unavailable

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "configs" / "kubernetes"
IGW = K8S / "inference-gateway"
CRDS = ROOT / "tests" / "fixtures" / "gateway-crds"

GATEWAY_API_RELEASE = "v1.5.1"  # kubernetes-sigs/gateway-api, standard channel
INFERENCE_EXTENSION_RELEASE = "v1.5.0"  # kubernetes-sigs/gateway-api-inference-extension
POOL_GROUP = "inference.networking.k8s.io"
CORE_KINDS = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"}
CRD_KINDS = {"Gateway", "HTTPRoute", "InferencePool"}
# Istio's CRD is not vendored: the one DestinationRule is checked field by field below.
ISTIO_KINDS = {"DestinationRule"}
# ObjectMeta fields one may write in a manifest (a CRD schema has `metadata: {type: object}`).
OBJECT_META = {"name", "namespace", "labels", "annotations", "generateName", "finalizers"}
# EPP v1.5.0 refuses to start with these flags (options.go): metric names go in its config.
REJECTED_EPP_FLAGS = {
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
    "lora-info-metric",
    "cache-info-metric",
}
# EndpointPickerConfig fields (apix/config/v1alpha1 at v1.5.0); the EPP decodes it strictly.
EPP_CONFIG_FIELDS = {
    "apiVersion",
    "kind",
    "featureGates",
    "plugins",
    "schedulingProfiles",
    "saturationDetector",
    "dataLayer",
    "flowControl",
    "parser",
}


# --- loading -----------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in IGW.iterdir() if p.suffix in (".yaml", ".yml"))


def load_objects() -> list[dict[str, Any]]:
    return [
        doc
        for path in manifest_files()
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]


OBJECTS = load_objects()


def objects_of(kind: str) -> list[dict[str, Any]]:
    return [o for o in OBJECTS if o["kind"] == kind]


def the(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects_of(kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def object_id(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def group_of(obj: dict[str, Any]) -> str:
    return obj["apiVersion"].rpartition("/")[0]


def beamline_deployment() -> dict[str, Any]:
    return yaml.safe_load((K8S / "deployment.yaml").read_text())


def flags(args: list[str]) -> dict[str, str]:
    """`--key=value`, `--key value` and bare `--flag` (true) arguments, by key."""
    parsed: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"stray argument {arg!r}"
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"
        assert key not in parsed, f"--{key} given twice"
        parsed[key] = value
        i += 1
    return parsed


def epp_deployment() -> dict[str, Any]:
    """The Deployment whose container runs the EPP image."""
    (found,) = [
        d
        for d in objects_of("Deployment")
        if any("/epp:" in c["image"] for c in d["spec"]["template"]["spec"]["containers"])
    ]
    return found


def epp_container() -> dict[str, Any]:
    (container,) = epp_deployment()["spec"]["template"]["spec"]["containers"]
    return container


def epp_config() -> dict[str, Any]:
    """The EndpointPickerConfig the EPP's --config-file points at, from its ConfigMap."""
    pod = epp_deployment()["spec"]["template"]["spec"]
    config_file = Path(flags(epp_container()["args"])["config-file"])
    (mount,) = [
        m for m in epp_container()["volumeMounts"] if Path(m["mountPath"]) == config_file.parent
    ]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    configmap = the("ConfigMap", volume["configMap"]["name"])
    assert config_file.name in configmap["data"], f"{config_file.name} not in the ConfigMap"
    return yaml.safe_load(configmap["data"][config_file.name])


def plugin(config: dict[str, Any], plugin_type: str) -> dict[str, Any]:
    (found,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return found


def exposed_metrics() -> dict[str, tuple[str, set[str]]]:
    """Sample name -> (family type, label names), with every gauge set once."""
    metrics = Metrics("m")
    metrics.set_cache_config(block_size=16, num_blocks=64, prefix_caching=True)
    metrics.set_scheduler_state(running=1, waiting=2, kv_cache_usage=0.5)
    metrics.set_lora_state(max_lora=4, running=["a"], waiting=[])  # a server with adapters
    body, _ = metrics.render()
    found: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = found.setdefault(sample.name, (family.type, set()))[1]
            labels.update(sample.labels)
    return found


def metric_spec(spec: str) -> tuple[str, set[str]]:
    """An EPP metric spec `name{label=value,...}` as (name, label names)."""
    match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", spec)
    assert match, f"not a metric spec: {spec!r}"
    pairs = [p for p in (match[2] or "").split(",") if p.strip()]
    return match[1], {p.split("=")[0].strip() for p in pairs}


# --- CRD schemas -------------------------------------------------------------------------------


def load_crds() -> dict[tuple[str, str], dict[str, Any]]:
    crds = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        crds[crd["spec"]["group"], crd["spec"]["names"]["kind"]] = crd
    return crds


CRD_SCHEMAS = load_crds()


def crd_schema(obj: dict[str, Any]) -> dict[str, Any]:
    """The openAPIV3Schema of the served CRD version that `obj` is written in."""
    group, _, version = obj["apiVersion"].rpartition("/")
    crd = CRD_SCHEMAS.get((group, obj["kind"]))
    assert crd is not None, f"no vendored CRD for {obj['apiVersion']} {obj['kind']}"
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"], f"{obj['apiVersion']} {obj['kind']} is not served"
    assert not served.get("deprecated"), f"{obj['apiVersion']} {obj['kind']} is deprecated"
    return served["schema"]["openAPIV3Schema"]


def to_json_schema(node: Any) -> Any:
    """A CRD structural schema as JSON Schema (draft 4, which OpenAPI v3.0 follows): the
    `x-kubernetes-*` extensions are dropped (so CEL rules are not checked) and `nullable`
    becomes a null type."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(s) for name, s in value.items()}
        elif key in ("items", "not", "additionalProperties"):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(s) for s in value]
        else:
            out[key] = value
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(to_json_schema(schema))
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would prune: CRD schemas have no `additionalProperties: false`, so
    JSON Schema accepts a misspelt field that Kubernetes silently drops."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            where = f"{path}.{key}"
            if key in properties:
                found += unknown_fields(item, properties[key], where)
            elif isinstance(extra, dict):
                found += unknown_fields(item, extra, where)
            else:
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def crd_problems(obj: dict[str, Any]) -> list[str]:
    schema = crd_schema(obj)
    meta = [f".metadata.{k}" for k in obj.get("metadata", {}) if k not in OBJECT_META]
    body = {k: v for k, v in obj.items() if k != "metadata"}
    unknown = [f"unknown field {f}" for f in meta + unknown_fields(body, schema)]
    return schema_errors(obj, schema) + unknown


# --- every object ------------------------------------------------------------------------------


def test_every_manifest_parses_into_named_objects() -> None:
    files = manifest_files()
    assert {p.name for p in files} >= {"gateway.yaml", "httproute.yaml", "inferencepool.yaml"}
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path.name} holds no object"
        for doc in docs:
            assert isinstance(doc, dict) and {"apiVersion", "kind", "metadata"} <= doc.keys()
            assert doc["metadata"]["name"], path.name
            # No namespace: the files apply to whichever namespace beamline runs in, which the
            # RoleBinding's subject (no namespace) and the EPP's --pool-namespace rely on.
            assert "namespace" not in doc["metadata"], object_id(doc)
    ids = [object_id(o) for o in OBJECTS]
    assert len(ids) == len(set(ids)), f"duplicate objects: {ids}"
    assert {o["kind"] for o in OBJECTS} == CORE_KINDS | CRD_KINDS | ISTIO_KINDS


@pytest.mark.parametrize("obj", [o for o in OBJECTS if o["kind"] in CORE_KINDS], ids=object_id)
def test_core_object_matches_the_kubernetes_schema(obj: dict[str, Any]) -> None:
    try:
        import kubernetes_validate
        from kubernetes_validate.utils import all_versions
    except ImportError:
        unavailable("kubernetes-validate", "pip install kubernetes-validate")
    versions = sorted(set(all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    for version in (versions[0], versions[-1]):  # oldest and newest schemas
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("obj", [o for o in OBJECTS if o["kind"] in CRD_KINDS], ids=object_id)
def test_gateway_object_matches_its_vendored_crd(obj: dict[str, Any]) -> None:
    assert crd_problems(obj) == []


def test_the_crd_check_catches_typos_wrong_types_and_missing_fields() -> None:
    pool = the("InferencePool")
    assert crd_problems(pool) == []
    typo = copy.deepcopy(pool)
    typo["spec"]["targetPort"] = typo["spec"].pop("targetPorts")
    problems = crd_problems(typo)
    assert "unknown field .spec.targetPort" in problems
    assert any("'targetPorts' is a required property" in p for p in problems)
    nested = copy.deepcopy(pool)
    nested["spec"]["endpointPickerRef"]["port"] = {"numbr": 9002}
    assert "unknown field .spec.endpointPickerRef.port.numbr" in crd_problems(nested)
    wrong = copy.deepcopy(pool)
    wrong["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    wrong["metadata"]["labelz"] = {}
    problems = crd_problems(wrong)
    assert any("'FailSometimes' is not one of" in p for p in problems)
    assert "unknown field .metadata.labelz" in problems
    route = copy.deepcopy(the("HTTPRoute"))
    route["spec"]["rules"][0]["backendRefs"][0]["weight"] = "1"
    assert any("is not of type 'integer'" in p for p in crd_problems(route))
    with pytest.raises(AssertionError, match="no vendored CRD"):
        crd_schema({**pool, "apiVersion": "inference.networking.x-k8s.io/v1alpha2"})


def test_the_vendored_crds_and_the_epp_image_are_the_releases_the_readme_names() -> None:
    bundles = {
        group: crd["metadata"]["annotations"][
            f"{group.split('.')[0]}.networking.k8s.io/bundle-version"
        ]
        for (group, _), crd in CRD_SCHEMAS.items()
    }
    assert bundles == {
        "gateway.networking.k8s.io": GATEWAY_API_RELEASE,
        POOL_GROUP: INFERENCE_EXTENSION_RELEASE,
    }
    gateway_crd = CRD_SCHEMAS["gateway.networking.k8s.io", "Gateway"]
    assert gateway_crd["metadata"]["annotations"]["gateway.networking.k8s.io/channel"] == "standard"
    image = epp_container()["image"]
    assert image == (
        f"registry.k8s.io/gateway-api-inference-extension/epp:{INFERENCE_EXTENSION_RELEASE}"
    )
    readme = (IGW / "README.md").read_text()
    for named in (GATEWAY_API_RELEASE, INFERENCE_EXTENSION_RELEASE, image):
        assert named in readme, f"README.md does not name {named}"
    assert the("Gateway")["spec"]["gatewayClassName"] in readme
    assert "inference-gateway/" in (K8S / "README.md").read_text()


# --- references between the objects ------------------------------------------------------------


def test_the_route_attaches_to_the_gateway_and_sends_the_openai_api_to_the_pool() -> None:
    gateway, route, pool = the("Gateway"), the("HTTPRoute"), the("InferencePool")
    (parent,) = route["spec"]["parentRefs"]
    assert parent.get("group", "gateway.networking.k8s.io") == group_of(gateway)
    assert parent.get("kind", "Gateway") == "Gateway"
    assert parent["name"] == gateway["metadata"]["name"]
    listeners = {ln["name"]: ln for ln in gateway["spec"]["listeners"]}
    listener = listeners[parent["sectionName"]] if "sectionName" in parent else None
    assert listener is None or listener["protocol"] in ("HTTP", "HTTPS")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == (group_of(pool), "InferencePool")
    assert group_of(pool) == POOL_GROUP and pool["apiVersion"] == f"{POOL_GROUP}/v1"
    assert backend["name"] == pool["metadata"]["name"]
    prefixes = [m["path"]["value"] for m in rule["matches"] if m["path"]["type"] == "PathPrefix"]
    routes = {r.path for r in create_app().routes if isinstance(r, APIRoute)}
    for path in ("/v1/completions", "/v1/chat/completions"):  # the protocol's two APIs
        assert path in routes
        assert any(path.startswith(p.rstrip("/") + "/") for p in prefixes), path


def test_the_pool_selects_the_beamline_pods_on_their_serving_port() -> None:
    pool = the("InferencePool")["spec"]
    deployment = beamline_deployment()
    template = deployment["spec"]["template"]
    selector = pool["selector"]["matchLabels"]
    assert selector and selector.items() <= template["metadata"]["labels"].items()
    # ...and nothing else in this variant: the EPP's own pods must not join the pool.
    epp_labels = epp_deployment()["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= epp_labels.items()
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (target,) = pool["targetPorts"]
    assert target["number"] == ports["http"]
    # The EPP sends requests only to ready pods: readiness is beamline's /ready on that port.
    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/ready" and ports[readiness["port"]] == target["number"]


def test_the_pool_points_at_the_epp_service_port() -> None:
    ref = the("InferencePool")["spec"]["endpointPickerRef"]
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
    service = the("Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    container = epp_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    target = port["targetPort"]
    container_port = ports[target] if isinstance(target, str) else target
    grpc_port = int(flags(container["args"]).get("grpc-port", "9002"))  # the EPP's default
    assert container_port == grpc_port
    labels = epp_deployment()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] and service["spec"]["selector"].items() <= labels.items()
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_the_epp_runs_as_a_service_account_bound_to_what_it_watches() -> None:
    pod = epp_deployment()["spec"]["template"]["spec"]
    account = the("ServiceAccount", pod["serviceAccountName"])["metadata"]["name"]
    allowed: set[tuple[str, str, str]] = set()
    for binding in objects_of("RoleBinding"):
        subjects = binding["subjects"]
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in subjects):
            continue
        for subject in subjects:  # no namespace: the binding's own, wherever it is applied
            assert "namespace" not in subject, object_id(binding)
        role_ref = binding["roleRef"]
        assert role_ref["apiGroup"] == "rbac.authorization.k8s.io"
        role = the(role_ref["kind"], role_ref["name"])
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    allowed |= {(group, resource, verb) for verb in rule["verbs"]}
    assert not objects_of("ClusterRoleBinding"), "a ClusterRoleBinding needs a namespace"
    needed = [
        ("", "pods"),
        (POOL_GROUP, "inferencepools"),
        ("inference.networking.x-k8s.io", "inferenceobjectives"),
        ("inference.networking.x-k8s.io", "inferencemodelrewrites"),
    ]
    for group, resource in needed:
        for verb in ("get", "list", "watch"):
            assert (group, resource, verb) in allowed, f"{verb} {resource} not granted"


def test_the_epp_serves_the_pool_with_its_mounted_config() -> None:
    deployment, container = epp_deployment(), epp_container()
    args = flags(container["args"])
    pool = the("InferencePool")
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args.get("pool-group", POOL_GROUP) == group_of(pool)
    assert "endpoint-selector" not in args  # standalone mode would ignore the pool
    assert not REJECTED_EPP_FLAGS & args.keys(), "v1.5.0 rejects these: use engineConfigs"
    # --pool-namespace defaults to $NAMESPACE, which must be the pod's own namespace.
    assert "pool-namespace" not in args
    env = {e["name"]: e for e in container["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    replicas = deployment["spec"]["replicas"]
    assert replicas == 1 or args.get("ha-enable-leader-election") == "true"
    assert epp_config()["kind"] == "EndpointPickerConfig"  # --config-file is in the ConfigMap
    # It must outlive the pool pods' drain to keep routing their last requests.
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= beamline_deployment()["spec"]["template"]["spec"].get(
        "terminationGracePeriodSeconds", 30
    )


def test_the_epp_config_scores_queue_kv_cache_and_prefix_cache() -> None:
    config = epp_config()
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config.keys() <= EPP_CONFIG_FIELDS, config.keys() - EPP_CONFIG_FIELDS
    names = [p.get("name", p["type"]) for p in config["plugins"]]
    assert len(names) == len(set(names)), names
    for spec in config["plugins"]:
        assert spec.keys() <= {"name", "type", "parameters"}, spec
    refs = [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    for source in config.get("dataLayer", {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    assert set(refs) <= set(names), set(refs) - set(names)
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight", 1) for p in profile["plugins"]}
    for scorer in (
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
        "lora-affinity-scorer",
    ):
        assert weights[plugin(config, scorer).get("name", scorer)] > 0, scorer
    # The approximate prefix index hashes prompts in blocks of beamline's KV block size.
    prefix = plugin(config, "prefix-cache-scorer")["parameters"]
    defaults = ServerConfig()
    assert defaults.enable_prefix_caching
    assert prefix["blockSizeTokens"] == defaults.block_size
    # ...and scrapes each pod's metrics endpoint, which needs no API key.
    source = plugin(config, "metrics-data-source")["parameters"]
    assert source["scheme"] == "http" and source["path"] in defaults.public_paths
    assert source["path"] in {r.path for r in create_app().routes if isinstance(r, APIRoute)}


def test_every_metric_name_given_to_the_epp_is_one_beamline_exposes() -> None:
    extractor = plugin(epp_config(), "core-metrics-extractor")["parameters"]
    engines = {e["name"]: e for e in extractor["engineConfigs"]}
    engine = engines[extractor["defaultEngine"]]  # the engine of pods without an engine label
    # The protocol's gauges under the names beamline serves them by.
    queue, running, kv = (PROTOCOL_PREFIX + name for name in PROTOCOL_GAUGES)
    assert metric_spec(engine["queuedRequestsSpec"])[0] == queue == "vllm:num_requests_waiting"
    assert metric_spec(engine["runningRequestsSpec"])[0] == running
    assert metric_spec(engine["kvUsageSpec"])[0] == kv
    assert metric_spec(engine["cacheInfoSpec"])[0] == CACHE_CONFIG_INFO
    exposed = exposed_metrics()
    assert metric_spec(engine["loraSpec"])[0] == LORA_REQUESTS_INFO
    given = [v for k, v in engine.items() if k.endswith("Spec") and v]
    assert len(given) == 5, f"an unexpected metric is given to the EPP: {given}"
    for spec in given:
        name, labels = metric_spec(spec)
        assert name in exposed, f"{name} is not exposed by server/metrics.py"
        assert exposed[name][0] == "gauge", f"{name} must be a gauge"
        assert labels <= exposed[name][1], f"{spec}: labels not exposed"
    # The prefix scorer reads the block size and pool size from cache_config_info's labels.
    info_labels = exposed[CACHE_CONFIG_INFO][1]
    assert engine.get("cacheBlockSizeLabelName", "block_size") in info_labels
    assert engine.get("cacheNumBlocksLabelName", "num_gpu_blocks") in info_labels
    # The LoRA scorer reads these labels of the LoRA gauge (the protocol's names).
    lora_labels = {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    assert lora_labels <= exposed[LORA_REQUESTS_INFO][1]


def test_the_istio_destination_rule_originates_tls_to_the_epp_service() -> None:
    rule = the("DestinationRule")
    assert rule["apiVersion"] == "networking.istio.io/v1"
    assert rule["spec"].keys() == {"host", "trafficPolicy"}
    assert rule["spec"]["trafficPolicy"].keys() == {"tls"}
    # A short host is resolved in the rule's namespace, which is the Service's (no namespace set).
    ref = the("InferencePool")["spec"]["endpointPickerRef"]
    assert rule["spec"]["host"] == the("Service", ref["name"])["metadata"]["name"]
    # The EPP serves TLS unless --secure-serving=false; its certificate is self-signed.
    assert flags(epp_container()["args"]).get("secure-serving", "true") == "true"
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}
    assert the("Gateway")["spec"]["gatewayClassName"] == "istio"  # only Istio reads it
