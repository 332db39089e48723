"""`python -m benchmarks.lm_fusion`: what fusing a second language model into beam search costs.

One `beamline serve MODEL --extra-models lm=COMPANION` runs the same closed-loop load of beam
searches (`--num-beams`, ignore_eos) twice per round, rounds interleaved: plain, then every
request with `lm_fusion: {model: lm, weight}`. The issue's goal for the ratio of the two times is
at most 1.1 x (1 + the companion's forward cost / the main model's). The companion's cost is
measured, not assumed: unless it is the served model itself (the default: the same weights, the
same code path, a cost ratio of exactly 1), a second server serves the companion alone and runs
the plain load, and the ratio of the two plain times is its cost.

Speculation and prefix caching are off in every server (`--num-speculative-tokens 0
--no-enable-prefix-caching`): fused rows never draft, and rounds would reuse each other's blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.client import CompletionTarget
from benchmarks.launch import first_model_id, launched_beamline
from benchmarks.load_runs import load_parser, run_and_write, timed
from benchmarks.machine import machine_info
from benchmarks.workload import synthetic_workload
from server.docgen.published import reproducing_command

FIXED_ARGS = ["--num-speculative-tokens", "0", "--no-enable-prefix-caching"]


def beam_target(url: str, model: str, beams: int, fusion: dict | None = None) -> CompletionTarget:
    extra: dict = {"num_beams": beams}
    if fusion is not None:
        extra["lm_fusion"] = fusion
    return CompletionTarget(url, model, extra=tuple(extra.items()))


async def run(args: argparse.Namespace) -> dict:
    workload = synthetic_workload(args.num_requests, output_tokens=(32, 64), seed=0)
    fusion = {"model": "lm", "weight": args.weight}
    companion = args.companion or args.model
    server_args = [*FIXED_ARGS, *args.beamline_args.split()]
    rounds: list[dict] = []
    log = args.out_dir / "lm-fusion-server.log"
    launch = [*server_args, "--extra-models", f"lm={companion or 'the default model'}"]
    if companion is None:  # the default model as its own companion: its GGUF file
        from server.model.loader import default_gguf_path

        launch[-1] = f"lm={default_gguf_path()}"
    with launched_beamline(args.model, log, launch, args.launch_timeout) as (url, _):
        name = first_model_id(url)
        plain, fused = (
            beam_target(url, name, args.num_beams),
            beam_target(url, name, args.num_beams, fusion),
        )
        for c in args.concurrency:
            await timed(plain, workload.requests[:2], min(c, 2), "warm-up")
            await timed(fused, workload.requests[:2], min(c, 2), "warm-up")
            for r in range(args.rounds):
                rounds.append(
                    {
                        "concurrency": c,
                        "plain": await timed(plain, workload.requests, c, f"c={c} round {r} plain"),
                        "fused": await timed(fused, workload.requests, c, f"c={c} round {r} fused"),
                    }
                )
    cost: dict[int, float] = {c: 1.0 for c in args.concurrency}  # the served model itself
    alone: dict[int, dict] = {}
    if args.companion is not None and args.companion != args.model:
        with launched_beamline(
            args.companion, args.out_dir / "companion-server.log", server_args, args.launch_timeout
        ) as (url, _):
            target = beam_target(url, first_model_id(url), args.num_beams)
            for c in args.concurrency:
                await timed(target, workload.requests[:2], min(c, 2), "warm-up")
                alone[c] = await timed(target, workload.requests, c, f"c={c} companion alone")
        for c in args.concurrency:
            main_s = statistics.median(
                r["plain"]["seconds"] for r in rounds if r["concurrency"] == c
            )
            cost[c] = alone[c]["seconds"] / main_s
    summary = {}
    for c in args.concurrency:
        mine = [r for r in rounds if r["concurrency"] == c]
        ratio = statistics.median(r["fused"]["seconds"] / r["plain"]["seconds"] for r in mine)
        goal = 1.1 * (1 + cost[c])
        summary[f"c{c}"] = {
            "fused_over_plain_time": ratio,
            "companion_cost_ratio": cost[c],
            "goal_at_most": goal,
            "met": ratio <= goal,
        }
    return {
        "benchmark": "lm_fusion",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "command": reproducing_command("benchmarks.lm_fusion", args.argv, ("--out", "--out-dir")),
        "model": args.model or "default",
        "companion": companion or "default (the served model itself)",
        "server_args": launch,
        "num_beams": args.num_beams,
        "weight": args.weight,
        "workload": workload.describe(),
        "rounds": rounds,
        "companion_alone": alone or None,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    p = load_parser(__doc__, "lm-fusion")
    p.add_argument("--companion", help="the fused LM (default: the served model itself)")
    p.add_argument("--weight", type=float, default=0.3)
    p.add_argument("--num-beams", type=int, default=4)
    args, result, out = run_and_write(p, argv, run, "lm-fusion")
    for key, s in result["summary"].items():
        print(
            f"{key}: fused / plain beam-{args.num_beams} time {s['fused_over_plain_time']:.2f}x "
            f"(goal <= {s['goal_at_most']:.2f}x, companion cost {s['companion_cost_ratio']:.2f})"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
