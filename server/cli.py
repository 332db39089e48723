"""`beamline serve`: start the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BeforeValidator
from pydantic.fields import FieldInfo

from server.config import ConfigError, ServerConfig, load_config, with_device_defaults
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
    """`--config`, then a flag per `ServerConfig` key: `--max-num-seqs` sets `max_num_seqs`, with
    the key's description as help and its type and choices. A flag given overrides the config file
    and env vars; one left out leaves them alone (every flag defaults to None)."""
    p.add_argument("--config", type=Path, help="YAML config file (see configs/default.yaml)")
    for name, info in ServerConfig.model_fields.items():
        if name not in CONFIG_ONLY_KEYS:
            _add_config_flag(p, name, info)


def _add_config_flag(p: argparse.ArgumentParser, name: str, info: FieldInfo) -> None:
    """One flag for config key `name`; a list key takes a repeatable singular flag (--api-key)."""
    kind = _without_none(info.annotation)
    default = info.get_default(call_default_factory=True)
    flag = "--" + name.replace("_", "-")
    kwargs: dict[str, Any] = {"dest": name, "help": _help(info.description, default)}
    if kind is bool:
        kwargs.update(action=argparse.BooleanOptionalAction, default=None)
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
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "func")}
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
    from server.http_server import run_server  # heavy imports (the model side) only when serving

    run_server(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="beamline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_serve_args(serve_parser)
    serve_parser.set_defaults(func=serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
