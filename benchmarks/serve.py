"""`python -m benchmarks.serve`: serving benchmark of beamline (or any OpenAI-compatible server)
against Hugging Face static batching, sequential `generate()` and llama.cpp, on one workload.

See benchmarks/README.md for the commands, the metric definitions and how to read the output.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.client import (
    CompletionTarget,
    make_client,
    run_concurrency,
    run_poisson,
    stream_completion,
)
from benchmarks.launch import LaunchError, first_model_id, launched_beamline
from benchmarks.machine import machine_info
from benchmarks.serving import hf_baseline, llama_server, llamacpp_baseline
from benchmarks.serving.beam_case import engine_stats, format_beam_case, run_beam_case
from benchmarks.serving.plot import plot_results
from benchmarks.serving.report import (
    RECORDED_NOTE,
    Run,
    SystemResult,
    format_report,
    peer_rows,
    ratio_rows,
    write_json,
)
from benchmarks.serving.structured import format_structured, run_structured
from benchmarks.stats import summarize
from benchmarks.workload import (
    BenchRequest,
    Workload,
    grounded_workload,
    prompts_workload,
    synthetic_workload,
    with_shared_prefix,
)
from server.model.devices import DTYPES

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"
ALL_BASELINES = ("hf-static", "hf-sequential", "llama-cpp", "llama-server", "llama-server-ngram")
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
        description=__doc__,
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
        default="float32",
        choices=[d for d in DTYPES if d != "auto"],  # HF's from_pretrained takes the names
        help="HF baselines' dtype, also passed to a launched beamline (default float32)",
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


# ---- the system under test -----------------------------------------------------------------------
async def bench_server(
    args: argparse.Namespace,
    target: CompletionTarget,
    workload: Workload,
    label: str | None = None,
    on_run: Callable[[SystemResult], None] = lambda result: None,
) -> SystemResult:
    """The load at every level; `on_run` gets the result after each level (it writes the JSON)."""
    label = label or args.label
    async with make_client(1, target.request_timeout_s, target.api_key) as client:
        for i in range(args.warmup):
            await stream_completion(
                client, target, BenchRequest(-1 - i, workload.requests[0].prompt, 4)
            )
    result = SystemResult(
        label, label, "server", info={"base_url": target.base_url, "model": target.model}
    )
    for level in args.levels:
        if args.mode == "concurrency":
            res, dur = await run_concurrency(
                target, workload.requests, int(level), f"{label} c={level:g}"
            )
        else:
            res, dur = await run_poisson(
                target,
                workload.requests,
                level,
                args.seed,
                args.max_concurrency,
                f"{label} rate={level:g}",
            )
        result.runs.append(Run(level, summarize(res, dur)))
        on_run(result)
        m = result.runs[-1].metrics
        tqdm.write(
            f"{label} {'c' if args.mode == 'concurrency' else 'rate'}={level:g}: "
            f"{m['output_throughput']:.1f} out tok/s, {m['errors']} errors",
            file=sys.stderr,
        )
    async with make_client(1, 30.0, target.api_key) as client:
        stats = await engine_stats(client, target.base_url.rstrip("/"))
    if stats:
        result.info["engine_stats_after"] = stats
    return result


# ---- baselines -----------------------------------------------------------------------------------
def run_baselines(args: argparse.Namespace, workload: Workload, progress: Progress) -> None:
    """Run the chosen baselines one after the other into `progress` (written after each point);
    its phases get each one's wall time (load included)."""
    phases, skipped = progress.phases, progress.skipped
    reqs = list(workload.requests)
    wants_hf = {"hf-static", "hf-sequential"} & set(args.baseline_names)
    if wants_hf:
        t0 = time.perf_counter()
        if "hf-static" in wants_hf and args.mode != "concurrency":
            skipped["hf-static"] = "static batching has no open-loop form; use --concurrency"
        print("loading the HF model for the baselines ...", file=sys.stderr)
        hf = hf_baseline.load_hf_model(args.model, args.dtype, device=args.device)
        hf_baseline.warmup(hf)
        info = {"model_dir": str(hf.path), "dtype": hf.dtype, "load_s": hf.load_s}
        seq = None
        if "hf-sequential" in wants_hf:
            res, dur = hf_baseline.run_static_batches(hf, reqs, 1, args.ignore_eos, "hf sequential")
            seq = Run(1, summarize(res, dur))
            progress.add(
                SystemResult(
                    "hf-sequential",
                    f"HF generate() sequential ({args.dtype})",
                    "sequential",
                    [seq],
                    dict(info),
                )
            )
        if "hf-static" in wants_hf and args.mode == "concurrency":
            static = SystemResult(
                "hf-static",
                f"HF generate() static batching ({args.dtype})",
                "static-batching",
                info={**info, "note": "batch = concurrency; E2EL = batch end; TTFT = first step"},
            )
            for c in [int(c) for c in args.levels]:
                if c == 1:  # a static batch of one is the sequential baseline: run it only once
                    if seq is not None:
                        static.runs.append(
                            Run(1, seq.metrics, "same run as hf-sequential (batch of 1)")
                        )
                        progress.add(static)
                    continue
                res, dur = hf_baseline.run_static_batches(
                    hf, reqs, c, args.ignore_eos, f"hf static b={c}"
                )
                static.runs.append(Run(c, summarize(res, dur)))
                progress.add(static)
        del hf
        phases["hf_baselines"] = time.perf_counter() - t0
    if "llama-cpp" in args.baseline_names:
        t0 = time.perf_counter()
        why = llamacpp_baseline.available()
        gguf = args.gguf or llamacpp_baseline.default_gguf(args.model)
        if why is None and gguf is None:
            why = "no GGUF file for --model; pass --gguf"
        if why:
            skipped["llama-cpp"] = why
        else:
            runner = llamacpp_baseline.LlamaCppRunner(gguf, args.llama_threads, args.llama_n_ctx)
            res, dur = runner.run_sequential(reqs, args.ignore_eos)
            phases["llama_cpp"] = time.perf_counter() - t0
            progress.add(
                SystemResult(
                    "llama-cpp",
                    llamacpp_baseline.LABEL,
                    "sequential",
                    [Run(1, summarize(res, dur))],
                    {
                        "gguf": str(gguf),
                        "n_threads": args.llama_threads,
                        "load_s": runner.load_s,
                        "version": runner.version,
                        "note": "llama-cpp-python, one request at a time: "
                        "a weaker peer than llama-server",
                    },
                )
            )
    for name in ("llama-server", "llama-server-ngram"):
        if name not in args.baseline_names:
            continue
        t0 = time.perf_counter()
        gguf = args.gguf or llamacpp_baseline.default_gguf(args.model)
        if gguf is None:
            skipped[name] = "no GGUF file for --model; pass --gguf"
        elif args.mode != "concurrency":
            skipped[name] = "one slot per client needs --concurrency levels"
        else:
            log_path = server_log_path(args).with_name(f"{name}.log")
            levels = [int(c) for c in args.levels]
            result = llama_server.measure(
                gguf,
                reqs,
                levels,
                log_path,
                args.ignore_eos,
                args.llama_threads,
                chat=workload.chat,
                ngram=name == "llama-server-ngram",
            )
            phases[name.replace("-", "_")] = time.perf_counter() - t0
            progress.add(result)


# ---- the run -------------------------------------------------------------------------------------
def result_paths(args: argparse.Namespace, kind: str) -> tuple[Path, Path]:
    stem = args.tag or f"{kind}{'-short' if args.short else ''}-{time.strftime('%Y%m%d-%H%M%S')}"
    return args.out_dir / f"{stem}.json", args.out_dir / f"{stem}.png"


def server_log_path(args: argparse.Namespace) -> Path:
    return args.out_dir / "beamline-server.log"


async def _measure(
    args: argparse.Namespace,
    base_url: str,
    workload: Workload,
    label: str | None = None,
    on_run: Callable[[SystemResult], None] = lambda result: None,
) -> tuple[SystemResult | dict, str]:
    model = args.model_name or first_model_id(base_url, args.api_key)
    if args.structured:
        levels = [int(c) for c in args.levels]
        return await run_structured(base_url, model, levels, args.api_key), model
    if args.beam_case:
        res = await run_beam_case(
            base_url, model, args.beam_max_tokens, args.ignore_eos, api_key=args.api_key
        )
        return res, model
    target = CompletionTarget(
        base_url,
        model,
        args.ignore_eos,
        args.request_timeout,
        api_key=args.api_key,
        chat=workload.chat,
    )
    return await bench_server(args, target, workload, label, on_run), model


def measure_server(
    args: argparse.Namespace,
    workload: Workload,
    on_run: Callable[[SystemResult], None] = lambda result: None,
) -> tuple[SystemResult | dict, dict]:
    """Run the load (or the beam case) against the launched or given server."""
    if not args.launch_beamline:
        res, model = asyncio.run(_measure(args, args.base_url, workload, on_run=on_run))
        return res, {"base_url": args.base_url, "model_name": model}
    extra = ["--dtype", args.dtype, "--device", args.device, *shlex.split(args.beamline_args)]
    with launched_beamline(args.model, server_log_path(args), extra, args.launch_timeout) as (
        url,
        ready_s,
    ):
        print(f"beamline healthy after {ready_s:.1f} s at {url}", file=sys.stderr)
        res, model = asyncio.run(_measure(args, url, workload, on_run=on_run))
    return res, {
        "base_url": url,
        "model_name": model,
        "launch_seconds_to_healthy": ready_s,
        "launch_args": extra,
    }


class Progress:
    """The serve JSON, rewritten after every measured point (each level of each system): a run
    cut short (a GPU command's time limit, a crash) keeps what it measured, a beamline that does
    not start is listed under `skipped` with the reason, and `complete` says whether the run
    reached its end."""

    def __init__(
        self, args: argparse.Namespace, workload: Workload, argv: list[str] | None
    ) -> None:
        self.args = args
        self.workload = workload
        self.argv = sys.argv[1:] if argv is None else argv
        self.started = time.time()
        self.machine = machine_info()
        self.server: dict = {}
        self.ours: SystemResult | None = None
        self.others: list[SystemResult] = []  # the --compare-beamline variants, then baselines
        self.skipped: dict[str, str] = {}
        self.phases: dict[str, float] = {}
        self.json_path, self.png_path = result_paths(args, "serve")

    def add(self, result: SystemResult) -> None:
        """Record a point of `result` (a system seen for the first time joins the others)."""
        if result is not self.ours and not any(result is r for r in self.others):
            self.others.append(result)
        self.write()

    def doc(self, complete: bool) -> dict:
        args = self.args
        ours = self.ours or SystemResult(args.label, args.label, "server")  # it never started
        systems = ([self.ours] if self.ours else []) + self.others
        return {
            "benchmark": "serve",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started)),
            "argv": self.argv,
            "machine": self.machine,
            "server": self.server,
            "mode": args.mode,
            "short": args.short,
            "ignore_eos": args.ignore_eos,
            "workload": self.workload.describe(),
            "system_under_test": ours.name,
            "systems": {s.name: s.to_dict() for s in systems},
            "ratios": ratio_rows(ours, self.others),
            "recorded_peers": peer_rows(ours, args.mode, peers_comparable(args)),
            "recorded_note": RECORDED_NOTE,
            "skipped": self.skipped,
            "duration_s": time.time() - self.started,
            "phase_seconds": self.phases,
            "plot": str(self.png_path) if plotting_available() else None,
            "complete": complete,
        }

    def write(self, complete: bool = False) -> dict:
        doc = self.doc(complete)
        write_json(doc, self.json_path)
        return doc


def plotting_available() -> bool:
    """matplotlib may be missing where the wheels are few (a GPU machine): the plot is then drawn
    later from the JSON (`benchmarks.serving.plot.plot_results`)."""
    return importlib.util.find_spec("matplotlib") is not None


def measure_variants(args: argparse.Namespace, workload: Workload, progress: Progress) -> bool:
    """Each --compare-beamline configuration, launched in turn on the same workload and loads;
    False if one could not start (listed under `skipped`, and the next one runs)."""
    started_all = True
    for label, flags in args.variants:
        extra = ["--dtype", args.dtype, "--device", args.device, *shlex.split(flags)]
        log_path = server_log_path(args).with_name(f"beamline-{label}.log")

        def on_run(result: SystemResult, extra: list[str] = extra) -> None:
            result.kind = "server-variant"
            result.info["launch_args"] = extra
            progress.add(result)

        try:
            with launched_beamline(args.model, log_path, extra, args.launch_timeout) as (url, _):
                asyncio.run(_measure(args, url, workload, label, on_run))
        except LaunchError as exc:
            print(f"benchmarks.serve: could not start {label!r}: {exc}", file=sys.stderr)
            progress.skipped[label] = f"could not start beamline {' '.join(extra)}: {exc}"
            progress.write()
            started_all = False
    return started_all


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    workload = build_workload(args)
    if args.structured or args.beam_case:
        return measure_one_case(args, workload, argv)
    progress = Progress(args, workload, argv)
    progress.write()

    def on_ours(result: SystemResult) -> None:
        progress.ours = result
        progress.write()

    started_all = True
    try:
        measured, progress.server = measure_server(args, workload, on_ours)
        assert isinstance(measured, SystemResult)
        progress.ours = measured
    except LaunchError as exc:
        print(f"benchmarks.serve: could not start beamline: {exc}", file=sys.stderr)
        progress.skipped[args.label] = f"could not start beamline: {exc}"
        started_all = False
    progress.phases["system_under_test"] = time.time() - progress.started
    t0 = time.time()
    started_all &= measure_variants(args, workload, progress)
    if args.variants:
        progress.phases["compared_beamlines"] = time.time() - t0
    run_baselines(args, workload, progress)
    doc = progress.write(complete=True)
    if doc["plot"] is not None:
        plot_results(doc, progress.png_path)
    print(format_report(doc))
    print(f"\nwrote {progress.json_path}" + (f"\nwrote {doc['plot']}" if doc["plot"] else ""))
    if not started_all:
        return 2
    servers = ([progress.ours] if progress.ours else []) + [
        s for s in progress.others if s.kind == "server-variant"
    ]
    errors = sum(r.metrics["errors"] for s in servers for r in s.runs)
    return 1 if errors else 0


def measure_one_case(args: argparse.Namespace, workload: Workload, argv: list[str] | None) -> int:
    """--structured or --beam-case: one server, one JSON at the end."""
    started = time.time()
    machine = machine_info()
    try:
        measured, server_info = measure_server(args, workload)
    except LaunchError as exc:
        print(f"benchmarks.serve: could not start beamline: {exc}", file=sys.stderr)
        return 2
    common = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": machine,
        "server": server_info,
    }
    if args.structured:
        json_path, _ = result_paths(args, "structured")
        write_json({"benchmark": "structured", **common, "structured": measured}, json_path)
        print(format_structured(measured))
        print(f"\nwrote {json_path}")
        return 0 if not any(sum(r["errors"]) for r in measured["runs"]) else 1
    json_path, _ = result_paths(args, "beam")
    write_json({"benchmark": "beam-case", **common, "beam_case": measured}, json_path)
    print(format_beam_case(measured))
    print(f"\nwrote {json_path}")
    return 0 if measured["greedy"]["status"] == 200 and measured["beam"]["status"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
