"""`beamline serve`: start the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from server.config import ConfigError, load_config
from server.logs import setup_logging


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML config file (see configs/default.yaml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--model", help="HF model directory or .gguf file (default: Gemma 3 270M)")
    p.add_argument("--served-model-name", help="model id reported by the API")
    p.add_argument("--cache-dir", type=Path, help="where converted GGUF models are kept")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization",
        choices=["none", "int8", "int8-weights", "w8a8"],
        help="CPU only. int8: int8 LM head; int8-weights: also weight-only int8 decoder layers; "
        "w8a8: int8 LM head, decoder layers as int8 x int8 GEMMs (per-token activation scales)",
    )
    p.add_argument(
        "--linear-layout",
        choices=["auto", "transposed", "native"],
        help="linear weights stored [in, out] (transposed: faster small-batch GEMMs on CPU) or as loaded",
    )
    p.add_argument(
        "--num-threads", type=int, help="CPU threads of a model step (default: one per core)"
    )
    p.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the decode step at start-up (default off)",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --torch-compile on CUDA, replay decode steps as CUDA graphs (default on)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-memory", help="KV pool size, e.g. 1GiB")
    p.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (overrides memory)")
    p.add_argument("--max-num-seqs", type=int, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    p.add_argument("--max-model-len", type=int, help="context length cap")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV blocks of prompt prefixes seen before (default on)",
    )
    p.add_argument(
        "--max-waiting-requests", type=int, help="queued requests beyond running; then 503"
    )
    p.add_argument("--drain-timeout", type=float, help="seconds in-flight requests get on SIGTERM")
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        help="require this Bearer key (repeatable; env BEAMLINE_API_KEYS=a,b)",
    )
    p.add_argument("--api-key-file", type=Path, help="file with one API key per line")
    p.add_argument(
        "--public-path",
        dest="public_paths",
        action="append",
        help="path served without a key (repeatable; default /health /ready /metrics)",
    )
    p.add_argument(
        "--cors-allow-origin",
        dest="cors_allow_origins",
        action="append",
        help="enable CORS for this origin (repeatable)",
    )
    p.add_argument("--max-body-bytes", help="request body limit, e.g. 4MiB (413 beyond)")
    p.add_argument("--max-header-bytes", type=int, help="request header limit")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["text", "json"])


def serve(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "func")}
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"beamline: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    from server.http_server import run_server  # heavy imports (torch) only when serving

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
