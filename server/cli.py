"""`beamline serve [MODEL]`: start the OpenAI-compatible server; `beamline bench serve --url URL`:
measure one (benchmarks/serve.py)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BeforeValidator
from pydantic.fields import FieldInfo

from server.config import ConfigError, ServerConfig, load_config
from server.config_groups import CONFIG_GROUPS
from server.device_defaults import with_device_defaults
from server.logs import setup_logging

# Request limits are set in the config file or by env var only.
CONFIG_ONLY_KEYS = frozenset(
    {
        "max_n",
        "max_best_of",
        "max_num_beams",
        "max_logprobs",
        "max_scored_prompt_tokens",
        "max_stop_sequences",
        "max_prompts_per_request",
        "max_grammar_bytes",
    }
)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """`--config`, then a flag per `ServerConfig` key under its group's heading (CONFIG_GROUPS):
    `--max-num-seqs` sets `max_num_seqs`, with the key's description as help and its type and
    choices. A flag given overrides the config file and env vars; one left out leaves them alone
    (every flag defaults to None)."""
    p.add_argument("--config", type=Path, help="YAML config file (see configs/default.yaml)")
    for title, names in CONFIG_GROUPS.items():
        file_only = [n for n in names if n in CONFIG_ONLY_KEYS]
        note = f"{', '.join(file_only)}: config file or BEAMLINE_<KEY> only" if file_only else None
        group = p.add_argument_group(title, note)
        for name in names:
            if name not in CONFIG_ONLY_KEYS:
                _add_config_flag(group, name, ServerConfig.model_fields[name])


# list keys whose flag takes several values at once (and may repeat), as vLLM's does
SEVERAL_PER_FLAG = frozenset({"lora_modules", "extra_models"})


def _add_config_flag(p: argparse._ActionsContainer, name: str, info: FieldInfo) -> None:
    """One flag for config key `name`; a list key takes a repeatable singular flag (--api-key)."""
    kind = _without_none(info.annotation)
    default = info.get_default(call_default_factory=True)
    flag = "--" + name.replace("_", "-")
    kwargs: dict[str, Any] = {"dest": name, "help": _help(info.description, default)}
    if kind is bool:
        kwargs.update(action=argparse.BooleanOptionalAction, default=None)
    elif name in SEVERAL_PER_FLAG:  # vLLM's spelling: --lora-modules a=x b=y
        kwargs.update(nargs="+", action="extend")
    elif typing.get_origin(kind) is list:
        flag = flag.removesuffix("s")
        kwargs.update(action="append")
    elif typing.get_origin(kind) is typing.Literal:
        kwargs.update(choices=list(typing.get_args(kind)))
    elif kind is not str and not any(isinstance(m, BeforeValidator) for m in info.metadata):
        kwargs.update(type=kind)  # keys with their own parser (sizes like 1GiB) take the text
    p.add_argument(flag, **kwargs)


def _without_none(annotation: Any) -> Any:
    """`int | None` -> int; other annotations unchanged."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _help(description: str | None, default: object) -> str:
    text = (description or "").replace("%", "%%")  # argparse formats help with %
    if isinstance(default, bool):
        return f"{text} (default {'on' if default else 'off'})"
    if isinstance(default, list):
        shown = " ".join(str(x) for x in default)
        return f"{text} (repeatable{'; default ' + shown if shown else ''})"
    return text if default is None else f"{text} (default {default})"


def serve(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in vars(args).items() if k in ServerConfig.model_fields}
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"beamline: {exc}", file=sys.stderr)
        return 2
    from server.model.devices import pick_device, quantization_problem

    device = pick_device(config.device)
    problem = quantization_problem(config.quantization, device)
    if problem is not None:
        print(f"beamline: {problem}", file=sys.stderr)  # at once, not after loading the model
        return 2
    setup_logging(config.log_level, config.log_format)
    # Before the app is built: its admission limits read max_num_seqs too.
    config = with_device_defaults(config, device.type)
    # heavy imports (the model side) only when serving
    from server.bootstrap import ModelLoadFailed, prepare_model
    from server.model.architecture import UnservableModel
    from server.model.hub import ModelNotFound
    from server.parallel.group import Rendezvous

    try:
        if config.nnodes > 1:  # every node needs node 0's address before anything else
            Rendezvous.from_env(required=True)
        config = prepare_model(config)  # before the port opens: a missing model ends it here
    except (ModelNotFound, UnservableModel) as exc:
        print(f"beamline: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a tensor-parallel size this model or machine cannot run
        print(f"beamline: {exc}", file=sys.stderr)
        return 2
    if config.node_rank > 0:  # a node past the first: its tensor-parallel ranks, no port
        from server.parallel.workers import serve_node

        return serve_node(config)
    from server.http_server import run_server

    try:
        run_server(config)
    except ModelLoadFailed:
        return 1  # the reason is in the log already, on one line
    return 0


def bench_serve(args: argparse.Namespace) -> int:
    """benchmarks.serve against `--url`, with no local baselines unless asked for."""
    # by name: benchmarks/ is not part of the package's type checking (pyproject: mypy files)
    serve_benchmark = importlib.import_module("benchmarks.serve").main
    passed_on = list(args.passed_on)
    if not any(a == "--baselines" or a.startswith("--baselines=") for a in passed_on):
        passed_on += ["--baselines", "none"]
    return serve_benchmark(["--base-url", args.url, *passed_on])


BENCH_SERVE_HELP = """Measure any OpenAI-compatible server (beamline, vLLM, SGLang, llama.cpp's
llama-server, ...) with the project's serving benchmark, as `vllm bench serve` does: streamed
/v1/completions requests at each --concurrency (default 1,4,16) or --request-rate; TTFT, TPOT,
ITL, E2E latency and throughput; JSON and a PNG under --out-dir. Every other option is
benchmarks.serve's (python -m benchmarks.serve --help): --concurrency, --request-rate,
--num-requests, --output-tokens, --dataset, --model-name, --api-key, --no-ignore-eos, ..."""


def _version() -> str:
    try:
        return importlib.metadata.version("beamline")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="beamline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"beamline {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        usage="beamline serve [MODEL] [options]",
    )
    serve_parser.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="hub id (org/name, org/name:QUANT), model directory or .gguf file: the same as "
        "--model; empty = default (Gemma 3 270M)",
    )
    _add_serve_args(serve_parser)
    serve_parser.set_defaults(func=serve, parser=serve_parser)
    bench = sub.add_parser("bench", help="benchmark a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve_parser = bench_sub.add_parser(
        "serve", help="serving benchmark of an OpenAI-compatible URL", description=BENCH_SERVE_HELP
    )
    bench_serve_parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server's base URL (default %(default)s)"
    )
    bench_serve_parser.set_defaults(func=bench_serve, parser=bench_serve_parser, passes_on=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown and not getattr(args, "passes_on", False):
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.passed_on = unknown
    if getattr(args, "model_arg", None):
        if args.model is not None:
            args.parser.error("give the model once: as MODEL or as --model, not both")
        args.model = args.model_arg
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
