import argparse
from pathlib import Path

import pytest
import yaml

from server.cli import CONFIG_ONLY_KEYS, _add_serve_args, main
from server.config import ConfigError, ServerConfig, load_config
from server.sizes import parse_size

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_default_yaml_documents_exactly_the_built_in_defaults() -> None:
    data = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    assert set(data) == set(ServerConfig.model_fields)
    assert load_config(CONFIGS / "default.yaml", {}) == ServerConfig()


def test_gpu_yaml_is_valid_and_flags_override_files() -> None:
    cfg = load_config(CONFIGS / "gpu.yaml", {"port": 9001, "model": None})
    assert cfg.device == "cuda" and cfg.port == 9001


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("max_num_seqs: 0\n", "max_num_seqs"),
        ("blok_size: 8\n", "blok_size"),
        ("kv_cache_memory: lots\n", "kv_cache_memory"),
        ("kv_cache_memory: 0\n", "kv_cache_memory"),
        ("kv_cache_memory: [1]\n", "kv_cache_memory"),
        ("gpu_memory_utilization: 0\n", "gpu_memory_utilization"),
        ("gpu_memory_utilization: 1.5\n", "gpu_memory_utilization"),
        ("- a\n- b\n", "mapping"),
    ],
)
def test_a_wrong_key_or_value_names_it(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=needle):
        load_config(path, {})


def test_sizes() -> None:
    assert parse_size("1GiB") == 1024**3 and parse_size("512MiB") == 512 * 1024**2
    assert parse_size("2G") == 2 * 1000**3 and parse_size(123) == 123


def test_cli_reports_a_bad_config_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("port: 99999\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "port" in capsys.readouterr().err


def test_environment_variables_override_the_file_and_flags_override_both(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("port: 8100\nmax_num_seqs: 4\n")
    env = {"BEAMLINE_PORT": "8200", "BEAMLINE_MAX_NUM_SEQS": "8"}
    cfg = load_config(path, {"port": 8300}, environ=env)
    assert cfg.port == 8300 and cfg.max_num_seqs == 8
    with pytest.raises(ConfigError, match="max_num_seqs"):
        load_config(None, {}, environ={"BEAMLINE_MAX_NUM_SEQS": "many"})


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    return parser


def test_every_config_key_but_the_request_limits_is_a_flag() -> None:
    flags = {o for a in serve_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert flags == {
        "--help", "--config", "--host", "--port", "--model", "--revision",
        "--allow-pickle-weights", "--no-allow-pickle-weights", "--served-model-name",
        "--cache-dir", "--device", "--dtype", "--quantization", "--linear-layout",
        "--attention-backend",
        "--num-threads", "--torch-compile", "--no-torch-compile", "--compile-while-serving",
        "--no-compile-while-serving", "--cuda-graphs",
        "--no-cuda-graphs", "--overlap-outputs", "--async-scheduling", "--num-speculative-tokens",
        "--speculative-model",
        "--engine-process", "--tensor-parallel-size", "--data-parallel-size",
        "--nnodes", "--node-rank",
        "--block-size",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--num-kv-blocks",
        "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
        "--enable-prefix-caching", "--no-enable-prefix-caching", "--max-waiting-requests",
        "--drain-timeout", "--api-key", "--api-key-file", "--public-path",
        "--cors-allow-origin", "--max-body-bytes", "--max-header-bytes", "--max-audio-bytes",
        "--max-audio-seconds", "--log-level",
        "--log-format", "--grammar-cache-size", "--grammar-compile-timeout", "--playground",
        "--no-playground", "--responses-store-size", "--default-max-tokens", "--max-tokens-limit",
        "--generation-config-defaults", "--no-generation-config-defaults",
        "--extra-models", "--lora-modules", "--enable-lora", "--no-enable-lora", "--max-loras",
        "--max-lora-rank",
        "--max-cpu-loras", "--allow-runtime-lora-updating", "--no-allow-runtime-lora-updating",
    }  # fmt: skip
    dests = {a.dest for a in serve_parser()._actions} - {"help", "config"}
    assert dests == set(ServerConfig.model_fields) - CONFIG_ONLY_KEYS


def test_flags_parse_to_the_config_keys() -> None:
    argv = [
        "--port", "9000", "--kv-cache-memory", "2GiB", "--api-key", "a", "--api-key", "b",
        "--no-cuda-graphs", "--quantization", "w8a8", "--drain-timeout", "1.5",
        "--cache-dir", "/tmp/c", "--dtype", "bfloat16",
    ]  # fmt: skip
    cfg = load_config(None, vars(serve_parser().parse_args(argv)), environ={})
    assert (cfg.port, cfg.kv_cache_memory, cfg.api_keys) == (9000, 2 * 1024**3, ["a", "b"])
    assert (cfg.cuda_graphs, cfg.quantization, cfg.drain_timeout) == (False, "w8a8", 1.5)
    assert (cfg.cache_dir, cfg.dtype) == (Path("/tmp/c"), "bfloat16")
    assert load_config(None, vars(serve_parser().parse_args([])), environ={}) == ServerConfig()


@pytest.mark.parametrize("argv", [["--port", "x"], ["--dtype", "float64"], ["--max-n", "4"]])
def test_a_bad_flag_stops_argparse(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        serve_parser().parse_args(argv)


def test_extra_models_take_several_values_per_flag() -> None:
    args = serve_parser().parse_args(
        ["--extra-models", "lm=/x", "b=org/lm", "--extra-models", "c=/z"]
    )
    cfg = load_config(None, {"extra_models": args.extra_models}, environ={})
    assert cfg.extra_model_sources() == {"lm": "/x", "b": "org/lm", "c": "/z"}
    env = load_config(None, {}, environ={"BEAMLINE_EXTRA_MODELS": "a=/x,b=/y"})
    assert env.extra_model_sources() == {"a": "/x", "b": "/y"}


def test_lora_modules_take_several_values_per_flag_and_are_checked() -> None:
    args = serve_parser().parse_args(
        ["--lora-modules", "a=/x", "b=org/adapter", "--lora-modules", "c=/z"]
    )
    assert args.lora_modules == ["a=/x", "b=org/adapter", "c=/z"]
    cfg = load_config(None, {"lora_modules": args.lora_modules}, environ={})
    assert cfg.lora_adapters() == {"a": "/x", "b": "org/adapter", "c": "/z"}
    assert cfg.lora_enabled and not ServerConfig().lora_enabled
    assert ServerConfig(allow_runtime_lora_updating=True).lora_enabled
    assert not ServerConfig(allow_runtime_lora_updating=True, enable_lora=False).lora_enabled
    env = load_config(None, {}, environ={"BEAMLINE_LORA_MODULES": "a=/x,b=/y"})
    assert env.lora_adapters() == {"a": "/x", "b": "/y"}
    for bad, why in (
        (["a"], "NAME=SOURCE"),
        (["a=/x", "a=/y"], "each adapter once"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(None, {"lora_modules": bad}, environ={})
    with pytest.raises(ConfigError, match="enable_lora is false"):
        load_config(None, {"lora_modules": ["a=/x"], "enable_lora": False}, environ={})
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        load_config(None, {"max_loras": 4, "max_cpu_loras": 2}, environ={})
