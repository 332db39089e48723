"""`python -m benchmarks.draft_speculation`: speculation with a draft model against n-gram
drafts and against none.

Three `beamline serve MODEL` servers run side by side, one per way of drafting: `none`
(`--num-speculative-tokens 0`), `ngram` (prompt lookup, `--num-speculative-tokens K`) and `draft`
(`--extra-models draft=DRAFT --speculative-model draft`, K tokens). The same closed-loop greedy
load (ignore_eos) runs on each in turn, rounds interleaved so that the machine's drift falls on
all three; an idle server waits for work and takes no core. Each result is the median over
rounds of the load's wall time, reported as ratios to `none` (below 1: faster).

The draft model defaults to the served model itself (its GGUF file for the default model): every
greedy draft is then accepted, so its row shows the most a draft model can gain here, less what
drafting with a model of the served model's size costs. Prefix caching is off in every server:
rounds would reuse each other's blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import httpx

from benchmarks.client import CompletionTarget
from benchmarks.launch import first_model_id, launched_beamline
from benchmarks.load_runs import load_parser, run_and_write, timed
from benchmarks.machine import machine_info
from benchmarks.workload import synthetic_workload
from server.docgen.published import reproducing_command

MODES = ("none", "ngram", "draft")


def mode_args(mode: str, draft: str, tokens: int) -> list[str]:
    """`beamline serve` flags of one way of drafting."""
    if mode == "none":
        return ["--num-speculative-tokens", "0"]
    spec = ["--num-speculative-tokens", str(tokens)]
    if mode == "ngram":
        return spec
    return [*spec, "--extra-models", f"draft={draft}", "--speculative-model", "draft"]


def draft_counts(url: str) -> dict[str, int]:
    """A server's drafted and accepted tokens so far (warm-ups included)."""
    stats = httpx.get(f"{url}/v1/engine/stats", timeout=30).json()
    return {
        "drafted": stats["spec_decode_num_draft_tokens"],
        "accepted": stats["spec_decode_num_accepted_tokens"],
    }


async def run(args: argparse.Namespace) -> dict:
    workload = synthetic_workload(args.num_requests, output_tokens=(64, 128), seed=0)
    draft = args.draft or args.model
    if draft is None:  # the default model drafts for itself: its GGUF file
        from server.model.loader import default_gguf_path

        draft = str(default_gguf_path())
    common = ["--no-enable-prefix-caching", *args.beamline_args.split()]
    launches = {m: [*common, *mode_args(m, draft, args.num_speculative_tokens)] for m in MODES}
    rounds: list[dict] = []
    with contextlib.ExitStack() as stack:
        targets = {}
        for mode in MODES:
            log = args.out_dir / f"draft-speculation-{mode}.log"
            url, _ = stack.enter_context(
                launched_beamline(args.model, log, launches[mode], args.launch_timeout)
            )
            targets[mode] = CompletionTarget(url, first_model_id(url))
        for c in args.concurrency:
            for mode in MODES:
                await timed(targets[mode], workload.requests[:2], min(c, 2), f"warm-up {mode}")
            for r in range(args.rounds):
                runs = {
                    m: await timed(targets[m], workload.requests, c, f"c={c} {m}") for m in MODES
                }
                rounds.append({"concurrency": c, "round": r, **runs})
        drafts = {m: draft_counts(targets[m].base_url) for m in MODES}
    summary = {}
    for c in args.concurrency:
        mine = [r for r in rounds if r["concurrency"] == c]
        seconds = {m: statistics.median(r[m]["seconds"] for r in mine) for m in MODES}
        summary[f"c{c}"] = {
            "seconds": seconds,
            "ngram_over_none_time": seconds["ngram"] / seconds["none"],
            "draft_over_none_time": seconds["draft"] / seconds["none"],
            "draft_over_ngram_time": seconds["draft"] / seconds["ngram"],
        }
    return {
        "benchmark": "draft_speculation",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "command": reproducing_command(
            "benchmarks.draft_speculation", args.argv, ("--out", "--out-dir")
        ),
        "model": args.model or "default",
        "draft": args.draft or "default (the served model itself)",
        "num_speculative_tokens": args.num_speculative_tokens,
        "server_args": launches,
        "workload": workload.describe(),
        "rounds": rounds,
        "drafts": drafts,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    p = load_parser(__doc__, "draft-speculation")
    p.add_argument("--draft", help="the draft model (default: the served model itself)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    args, result, out = run_and_write(p, argv, run, "draft-speculation")
    for key, s in result["summary"].items():
        print(
            f"{key}: time over none: ngram {s['ngram_over_none_time']:.2f}x, "
            f"draft {s['draft_over_none_time']:.2f}x "
            f"(draft / ngram {s['draft_over_ngram_time']:.2f}x)"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
