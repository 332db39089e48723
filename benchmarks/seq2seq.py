"""`python -m benchmarks.seq2seq`: translation-shaped work on encoder-decoder models, beamline
against CTranslate2 and transformers' `generate()` in the same run.

For each model shape (random weights: `benchmarks/translation/models.py`), seeded sources of 10-60
tokens, beam search of width 4, exactly 64 new tokens each (EOS forbidden before: every system
decodes the same lengths). At each concurrency level c, in turns: launched `beamline serve`s with c
clients in a closed loop, one in float32 (its exact mode: `generate()`'s tokens), and two with every
decoder layer an integer GEMM (`--quantization w8a8-all`, as CTranslate2's int8), one with its
decode step compiled (`--torch-compile`) and one eager, each also as copies of one engine per core
(`--data-parallel-size 2`, as CTranslate2's inter_threads); CTranslate2's `translate_batch` on
static batches of c sources in each configuration given (compute type and thread split; its best is
the baseline of the ratios); `generate()` on static batches of c. The servers stay up, idle, while
the others run. Each system runs `--repeats` turns, spread over the level, and keeps its fastest:
on a shared host a neighbour's load slows whichever system runs at that moment (the JSON lists
every turn). Output tokens per second of the best hypotheses, the ratios, and how many requests
give `generate()`'s tokens exactly. Speed is reported, never asserted. JSON under `--out-dir`
(rewritten after every turn).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.launch import first_model_id, launched_beamline
from benchmarks.machine import machine_info
from benchmarks.serving.report import write_json
from benchmarks.translation.models import SHAPES, build_translation_model
from benchmarks.translation.systems import (
    CT2Setting,
    Decode,
    Run,
    run_beamline,
    run_ctranslate2,
    run_generate,
)
from server.docgen.published import reproducing_command

MODEL_ROOT = Path.home() / ".cache" / "beamline" / "bench-seq2seq"
OUT_DIR = Path(__file__).resolve().parent / "results"
# beamline's modes, each a server of its own: float32 (exact: generate()'s tokens), and every
# decoder layer an integer GEMM (w8a8-all, as CTranslate2's int8) with its decode step compiled
# and eager (the compile's own gain, in the same run), against CTranslate2's float32 and int8
BEAMLINE_MODES = {
    "beamline": [],
    "beamline-w8a8-all": ["--quantization", "w8a8-all", "--torch-compile"],
    "beamline-w8a8-all-eager": ["--quantization", "w8a8-all"],
}
SYSTEMS = (*BEAMLINE_MODES, "ctranslate2", "generate")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.seq2seq", description=__doc__)
    p.add_argument("--shapes", default=None, help="comma-separated, of " + ", ".join(SHAPES))
    p.add_argument("--concurrency", default=None, help="levels, e.g. 1,16")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2, help="level c runs max(8, rounds x c)")
    p.add_argument("--source-tokens", default="10,60", help="min,max source length")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument(
        "--ct2",
        default=None,
        help="CTranslate2 settings COMPUTE:INTERxINTRA, comma-separated (inter > 1 only at c > 1)",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--beamline-args", default="", help="extra `beamline serve` flags")
    p.add_argument(
        "--data-parallel",
        default=None,
        help="beamline's data_parallel_size values, comma-separated: each mode runs at each "
        "(above 1 as `beamline-dp2` etc.; default 1,2; 1 with --short)",
    )
    p.add_argument("--threads", type=int, default=2, help="generate()'s torch threads")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="turns of every system at each level, the fastest kept (default 2; 1 with --short)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-root", type=Path, default=MODEL_ROOT)
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--tag", default="seq2seq")
    p.add_argument("--short", action="store_true", help="tiny models, a few requests (tests, CI)")
    args = p.parse_args(argv)
    short = args.short
    args.shapes = (args.shapes or ("tiny-marian,tiny-t5" if short else "marian,t5-base")).split(",")
    args.concurrency = [
        int(c) for c in (args.concurrency or ("1,4" if short else "1,16")).split(",")
    ]
    args.num_requests = args.num_requests or (8 if short else 32)
    args.repeats = args.repeats or (1 if short else 2)
    args.max_tokens = args.max_tokens or (8 if short else 64)
    default_ct2 = "float32:1x2" if short else "float32:1x2,int8:1x2,float32:2x1,int8:2x1"
    args.ct2 = [parse_ct2(s) for s in (args.ct2 or default_ct2).split(",")]
    args.systems = args.systems.split(",")
    args.data_parallel = [
        int(d) for d in (args.data_parallel or ("1" if short else "1,2")).split(",")
    ]
    unknown = set(args.systems) - set(SYSTEMS) or set(args.shapes) - set(SHAPES)
    if unknown:
        p.error(f"unknown: {', '.join(sorted(unknown))}")
    return args


def parse_ct2(text: str) -> CT2Setting:
    compute, threads = text.split(":")
    inter, intra = threads.split("x")
    return CT2Setting(compute, int(inter), int(intra))


def workload(vocab_size: int, num: int, lengths: str, eos: int, seed: int) -> list[list[int]]:
    """Seeded sources of word ids (above the specials, below Marian's last-id pad), each ending
    in EOS as the families' tokenizers end them."""
    low, high = (int(x) for x in lengths.split(","))
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size - 1) for _ in range(rng.randint(low, high) - 1)] + [eos]
        for _ in range(num)
    ]


def level_sources(sources: list[list[int]], concurrency: int, rounds: int) -> list[list[int]]:
    return sources[: max(8, rounds * concurrency)]


def record(run: Run) -> dict:
    latencies = sorted(run.latencies_s)
    return {
        "output_tokens_per_s": run.tokens_per_s(),
        "wall_s": run.wall_s,
        "requests": len(run.outputs),
        "p50_latency_s": latencies[len(latencies) // 2] if latencies else None,
    }


def exact(run: Run, reference: Run) -> str:
    same = sum(a == b for a, b in zip(run.outputs, reference.outputs))
    return f"{same}/{len(reference.outputs)}"


def measure_shape(args: argparse.Namespace, shape: str, doc: dict, path: Path) -> None:
    model_dir = build_translation_model(shape, args.model_root)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    decode = Decode(args.beams, args.max_tokens)
    vocab = int(SHAPES[shape]["vocab_size"])
    sources = workload(
        vocab, args.num_requests, args.source_tokens, tokenizer.eos_token_id, args.seed
    )
    levels: dict[str, dict] = doc["results"].setdefault(shape, {})
    best: dict[tuple[int, str], Run] = {}

    def keep(level: int, system: str, run: Run) -> None:
        """Keep the system's fastest turn at the level, with every turn's speed."""
        if (level, system) not in best or run.tokens_per_s() > best[level, system].tokens_per_s():
            best[level, system] = run
        row = levels.setdefault(f"c={level}", {})
        turns = row.get(system, {}).get("turns_tokens_per_s", [])
        row[system] = record(best[level, system])
        row[system]["turns_tokens_per_s"] = [*turns, run.tokens_per_s()]
        print(f"{shape} c={level} {system}: {run.tokens_per_s():.1f} tok/s", file=sys.stderr)
        write_json(doc, path)

    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[str, str]] = {}
        for mode, flags in beamline_modes(args).items():  # up for the shape, idle meanwhile
            log = args.out_dir / f"{args.tag}-{shape}-{mode}-server.log"
            extra = ["--dtype", "float32", *flags, *args.beamline_args.split()]
            base_url, _ready = stack.enter_context(launched_beamline(str(model_dir), log, extra))
            servers[mode] = base_url, first_model_id(base_url)
            run_beamline(*servers[mode], sources[:1], decode, 1)  # warm-up
        for c in args.concurrency:
            part = level_sources(sources, c, args.rounds)
            turn: list[tuple[str, Callable[[], Run]]] = [
                (mode, functools.partial(run_beamline, *served, part, decode, c))
                for mode, served in servers.items()
            ]
            if "ctranslate2" in args.systems:
                turn += [
                    (
                        s.label,
                        functools.partial(
                            run_ctranslate2, model_dir, tokenizer, part, decode, c, s
                        ),
                    )
                    for s in args.ct2
                    if s.inter == 1 or c > 1
                ]
            if "generate" in args.systems:
                turn.append(
                    (
                        "generate",
                        functools.partial(run_generate, model_dir, part, decode, c, args.threads),
                    )
                )
            for _ in range(args.repeats):
                for system, run in turn:
                    keep(c, system, run())
    for c in args.concurrency:
        runs = {s: r for (lv, s), r in best.items() if lv == c}
        summarize_level(levels[f"c={c}"], runs, list(beamline_modes(args)))
    write_json(doc, path)


def beamline_modes(args: argparse.Namespace) -> dict[str, list[str]]:
    """The beamline servers to launch: each mode asked for in `--systems`, at each data-parallel
    size (named `<mode>-dp<size>` above 1)."""
    modes = {}
    for size in args.data_parallel:
        for mode, flags in BEAMLINE_MODES.items():
            if mode in args.systems:
                name = mode if size == 1 else f"{mode}-dp{size}"
                modes[name] = [*flags, "--data-parallel-size", str(size)] if size > 1 else flags
    return modes


def summarize_level(level: dict, runs: dict[str, Run], modes: list[str]) -> None:
    """Ratios of beamline to the best CTranslate2 setting and to generate(), and exact matches
    against generate()'s tokens."""
    ct2 = {name: run for name, run in runs.items() if name.startswith("ct2-")}
    best = max(ct2, key=lambda name: ct2[name].tokens_per_s()) if ct2 else None
    reference = runs.get("generate")
    summary: dict = {"best_ctranslate2": best}
    for mode in modes:
        ours, key = runs.get(mode), mode.replace("-", "_")
        if ours and best:
            summary[f"{key}_vs_ctranslate2"] = ours.tokens_per_s() / ct2[best].tokens_per_s()
        if ours and reference:
            summary[f"{key}_vs_generate"] = ours.tokens_per_s() / reference.tokens_per_s()
    if reference:
        summary["exact_vs_generate"] = {
            name: exact(run, reference) for name, run in runs.items() if name != "generate"
        }
    level["summary"] = summary


def table(doc: dict) -> str:
    lines = ["| shape | level | system | output tok/s | p50 latency s | tokens = generate() |"]
    lines.append("|---|---|---|---|---|---|")
    for shape, levels in doc["results"].items():
        for level, systems in levels.items():
            summary = systems.get("summary", {})
            matches = summary.get("exact_vs_generate", {})
            for name, row in systems.items():
                if name == "summary":
                    continue
                lines.append(
                    f"| {shape} | {level} | {name} | {row['output_tokens_per_s']:.1f} | "
                    f"{row['p50_latency_s']:.2f} | {matches.get(name, '-')} |"
                )
            for key in summary:
                if key.startswith("beamline"):
                    lines.append(f"| {shape} | {level} | **{key}** | {summary[key]:.2f}x | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.out_dir / f"{args.tag}.json"
    doc: dict = {
        "complete": False,
        "command": reproducing_command(
            "benchmarks.seq2seq",
            sys.argv[1:] if argv is None else argv,
            ("--out-dir", "--model-root", "--tag"),
        ),
        "machine": machine_info(),
        "settings": {
            "shapes": args.shapes,
            "concurrency": args.concurrency,
            "requests_per_level": {
                c: len(level_sources([[]] * args.num_requests, c, args.rounds))
                for c in args.concurrency
            },
            "source_tokens": args.source_tokens,
            "beams": args.beams,
            "max_tokens": args.max_tokens,
            "ctranslate2": [s.label for s in args.ct2],
            "beamline_args": args.beamline_args,
            "data_parallel": args.data_parallel,
            "repeats": args.repeats,
        },
        "results": {},
    }
    start = time.perf_counter()
    for shape in args.shapes:
        measure_shape(args, shape, doc, path)
    doc["complete"] = True
    doc["wall_s"] = time.perf_counter() - start
    write_json(doc, path)
    print(table(doc))
    print(f"results: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
