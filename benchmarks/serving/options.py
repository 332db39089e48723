"""The serving benchmark's command line: its flags, the presets they default from (full and
`--short`), and what they resolve to: load levels, baselines, `--compare-beamline` variants, the
workload, and whether the recorded peer figures apply."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.serving import vllm_cpu
from benchmarks.workload import (
    Workload,
    grounded_workload,
    prompts_workload,
    synthetic_workload,
    with_shared_prefix,
)
from server.model.devices import DTYPES

DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "results"
ALL_BASELINES = (
    "hf-static",
    "hf-sequential",
    "llama-cpp",
    "llama-server",
    "llama-server-ngram",
    "vllm-cpu",
)
# the HF loops and llama-cpp-python send raw prompts: they have no chat form
RAW_PROMPT_BASELINES = ("hf-static", "hf-sequential", "llama-cpp")

# Mode presets; any flag given explicitly wins. Short mode fits CI: < 2 minutes with model load.
PRESETS = {
    "full": {
        "num_requests": 48,
        "output_tokens": "32,128",
        "concurrency": "1,4,16",
        "baselines": "hf-static,hf-sequential,llama-cpp,llama-server",
        "grounded_baselines": "llama-server,llama-server-ngram",
        "beam_max_tokens": 64,
    },
    "short": {
        "num_requests": 8,
        "output_tokens": "16,32",
        "concurrency": "1,4",
        "baselines": "hf-static,llama-cpp",
        "grounded_baselines": "none",
        "beam_max_tokens": 16,
    },
}

# `--help`'s description
DESCRIPTION = """\
`python -m benchmarks.serve`: serving benchmark of beamline (or any OpenAI-compatible server)
against Hugging Face static batching, sequential `generate()` and llama.cpp, on one workload.

See benchmarks/README.md for the commands, the metric definitions and how to read the output.
"""


def _int_pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None
    return lo, hi


def _number_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_argument_group("system under test")
    where = target.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--launch-beamline", action="store_true", help="start `beamline serve` on a free port"
    )
    where.add_argument(
        "--base-url", help="an already running OpenAI-compatible server, e.g. http://127.0.0.1:8080"
    )
    target.add_argument(
        "--model",
        help="model for the launched server and the baselines "
        "(HF directory or .gguf; default: the bundled Gemma 3 270M GGUF)",
    )
    target.add_argument(
        "--model-name", help="`model` field of requests (default: first id of GET /v1/models)"
    )
    target.add_argument(
        "--label", help="name of the system under test (default: beamline if launched, else server)"
    )
    target.add_argument(
        "--beamline-args", default="", help='extra `beamline serve` flags, e.g. "--max-num-seqs 16"'
    )
    target.add_argument(
        "--compare-beamline",
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="also launch beamline with these extra flags, same load, after the main run "
        "(repeatable), e.g. 'fp32-native=--quantization none'; ratios are main / this",
    )
    target.add_argument(
        "--launch-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    target.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="don't send ignore_eos (for servers without it); output lengths then vary",
    )
    target.add_argument("--request-timeout", type=float, default=600.0)
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="Bearer key for the server (default: $OPENAI_API_KEY; a launched beamline needs none)",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency", type=_number_list, help="closed-loop sweep, e.g. 1,4,16 (default)"
    )
    load.add_argument(
        "--request-rate", type=_number_list, help="Poisson arrivals at these rates (req/s) instead"
    )
    load.add_argument(
        "--max-concurrency", type=int, help="cap on requests in flight with --request-rate"
    )
    load.add_argument(
        "--rounds",
        type=int,
        help="each concurrency level c runs only the workload's first rounds x c requests "
        "(at least 8), every system alike (default: all of them at every level)",
    )
    load.add_argument(
        "--warmup", type=int, default=1, help="unmeasured short requests before measuring"
    )

    wl = p.add_argument_group("workload")
    wl.add_argument(
        "--dataset",
        choices=["synthetic", "prompts", "grounded"],
        default="synthetic",
        help="seeded random word prompts, the prompt set of --prompts-file, or input-grounded "
        "chat requests (a passage to repeat, edit or copy and continue: n-gram speculation's "
        "case; baselines llama-server with and without its own n-gram speculation)",
    )
    wl.add_argument(
        "--prompts-file",
        type=Path,
        help='JSON lines {"prompt": ...} (default: benchmarks/prompts.jsonl)',
    )
    wl.add_argument("--num-requests", type=int)
    wl.add_argument(
        "--prompt-words", type=_int_pair, default=(8, 48), help="MIN,MAX words (synthetic)"
    )
    wl.add_argument(
        "--output-tokens", type=_int_pair, help="MIN,MAX output tokens (default 32,128)"
    )
    wl.add_argument(
        "--shared-prefix-words",
        type=int,
        default=0,
        metavar="N",
        help="prepend the same seeded N-word system prompt to every prompt (prefix caching)",
    )
    wl.add_argument("--seed", type=int, default=0)

    base = p.add_argument_group("baselines (run after the server is stopped, on the same workload)")
    base.add_argument("--baselines", help=f"comma list of {', '.join(ALL_BASELINES)}, or none")
    base.add_argument(
        "--dtype",
        choices=[d for d in DTYPES if d != "auto"],  # HF's from_pretrained takes the names
        help="HF baselines' dtype (default float32), also passed to a launched beamline when "
        "given (left out, beamline serves its own default)",
    )
    base.add_argument(
        "--device",
        default="cpu",
        help="where HF baselines run, also passed to a launched beamline (default cpu)",
    )
    base.add_argument(
        "--gguf", type=Path, help="GGUF for llama-cpp (default: --model if .gguf, else bundled)"
    )
    base.add_argument("--llama-threads", type=int, default=2)
    base.add_argument("--llama-n-ctx", type=int, default=2048)
    base.add_argument(
        "--vllm-threads-bind",
        default=vllm_cpu.DEFAULT_THREADS_BIND,
        help="vllm-cpu's VLLM_CPU_OMP_THREADS_BIND: all (every core), auto (its default: all "
        f"but one, left to its front end) or a core list (default {vllm_cpu.DEFAULT_THREADS_BIND})",
    )
    base.add_argument(
        "--vllm-kv-cache-gib",
        type=int,
        default=vllm_cpu.DEFAULT_KV_CACHE_GIB,
        help=f"vllm-cpu's VLLM_CPU_KVCACHE_SPACE (default {vllm_cpu.DEFAULT_KV_CACHE_GIB})",
    )

    run = p.add_argument_group("run")
    run.add_argument(
        "--short", action="store_true", help="CI size: 8 requests, outputs 16-32, c=1,4"
    )
    run.add_argument(
        "--beam-case",
        action="store_true",
        help="only the beam-search case: one greedy and one num_beams=4 request, sequentially",
    )
    run.add_argument("--beam-max-tokens", type=int)
    run.add_argument(
        "--structured",
        action="store_true",
        help="only the structured workload: 52 JSON-schema chat requests against the same "
        "requests unconstrained (same output lengths), at each --concurrency",
    )
    run.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    run.add_argument(
        "--tag", help="file name stem of the results (default: serve[-short]-TIMESTAMP)"
    )
    return p


def resolve_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS["short" if args.short else "full"]
    args.num_requests = args.num_requests or preset["num_requests"]
    args.output_tokens = args.output_tokens or _int_pair(preset["output_tokens"])
    args.beam_max_tokens = args.beam_max_tokens or preset["beam_max_tokens"]
    if args.request_rate and args.concurrency:
        parser.error("give --concurrency or --request-rate, not both")
    if args.shared_prefix_words < 0:
        parser.error("--shared-prefix-words must be >= 0")
    args.mode = "poisson" if args.request_rate else "concurrency"
    args.levels = args.request_rate or args.concurrency or _number_list(preset["concurrency"])
    if args.mode == "concurrency" and any(c != int(c) for c in args.levels):
        parser.error("--concurrency takes whole numbers")
    default_names = preset["grounded_baselines" if args.dataset == "grounded" else "baselines"]
    names = [b.strip() for b in (args.baselines or default_names).split(",") if b.strip()]
    names = [] if names == ["none"] else names
    unknown = set(names) - set(ALL_BASELINES)
    if unknown:
        parser.error(
            f"unknown baseline(s) {sorted(unknown)}; choose from {', '.join(ALL_BASELINES)} or none"
        )
    if args.dataset == "grounded" and set(names) & set(RAW_PROMPT_BASELINES):
        parser.error(
            "--dataset grounded sends chat requests; the baselines "
            f"{', '.join(RAW_PROMPT_BASELINES)} send raw prompts: choose llama-server(-ngram)"
        )
    args.baseline_names = names
    args.hf_dtype = args.dtype or "float32"
    args.variants = []
    for spec in args.compare_beamline:
        label, sep, extra = spec.partition("=")
        if not sep or not label.strip():
            parser.error(f"--compare-beamline takes LABEL=ARGS, got {spec!r}")
        args.variants.append((label.strip(), extra))
    if args.variants and not args.launch_beamline:
        parser.error("--compare-beamline needs --launch-beamline")
    args.label = args.label or ("beamline" if args.launch_beamline else "server")
    return args


def peers_comparable(args: argparse.Namespace) -> bool:
    """Whether this run uses the setting of the recorded peer figures (design notes §3)."""
    return (
        args.model is None
        and args.dataset == "synthetic"
        and args.num_requests == 48
        and tuple(args.prompt_words) == (8, 48)
        and tuple(args.output_tokens) == (32, 128)
        and args.shared_prefix_words == 0
        and args.ignore_eos
    )


def build_workload(args: argparse.Namespace) -> Workload:
    if args.dataset == "grounded":
        workload = grounded_workload(args.num_requests, args.output_tokens, args.seed)
    elif args.dataset == "prompts":
        kwargs = {"path": args.prompts_file} if args.prompts_file else {}
        workload = prompts_workload(args.num_requests, args.output_tokens, args.seed, **kwargs)
    else:
        workload = synthetic_workload(
            args.num_requests, args.prompt_words, args.output_tokens, args.seed
        )
    return with_shared_prefix(workload, args.shared_prefix_words, args.seed)
