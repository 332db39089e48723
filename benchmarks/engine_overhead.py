"""Engine time per decode step outside the model forward: the host work a GPU would wait for.

In process, one thread, one engine built as `beamline serve` builds it (server/loading.py) with
the device's defaults: on CUDA the paged Triton kernel, CUDA graphs captured by the runner's
warm-up, overlapped outputs and async scheduling; on the CPU the gather path, neither overlap. The
model (a random `--shape`, see random_models.py, or `--model`) loads once; then for each (kind,
rows) pair R rows of requests are submitted and prefilled, their decode steps timed, and the
requests aborted (every KV block must come back) before the next pair. The JSON is rewritten
after each pair, so a run cut short keeps what it measured.

Each step is timed whole; the model's forward is timed inside it (the decoder and LM head called
eagerly, or a CUDA graph's replay: `path` says which the timed steps took, `graph steps` how many
replayed), and host time = step time - forward time. Scheduling, input building (copying inputs
into the graphs' buffers included), sampling, commit, detokenization and emission all count as
host time. On CUDA the forward timer synchronises the device around the forward, so host time is
what the device would idle for without overlap.

With overlapped outputs the engine renders a step's text (detokenization, stop strings, emission)
after queuing the next step's forward (engine.py); that part is reported apart as `render ms`,
and `exposed ms` = host time - render time is what a GPU still waits for (on the CPU the forward
is synchronous, so nothing is actually hidden there).

With async scheduling the engine queues step N+1 before it reads step N's tokens
(server/engine/in_flight.py). The forward timer synchronises the device, which would undo that, so
every timed step is followed by one with nothing timed inside: `free step ms` is their median
step time, and `step/forward` = free step ms / forward ms (the issue's GPU goal: <= 1.2, host time
hidden). On the CPU a free step costs what a timed one does.

    python -m benchmarks.engine_overhead                      # 16, 64, 256 rows; three row kinds
    python -m benchmarks.engine_overhead --rows 256 --kinds greedy --steps 50
    python -m benchmarks.engine_overhead --rows 256 --kinds sampled --prompt-tokens 1000
    python -m benchmarks.engine_overhead --device cuda --shape llama-1b --no-cuda-graphs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.overhead.measure import KINDS, PROMPT_TOKENS, Result, measure, row_count
from benchmarks.overhead.timers import ForwardTimer, RenderTimer
from benchmarks.random_models import build_random_model
from server.config import ServerConfig
from server.loading import load_engine


def engine_config(
    args: argparse.Namespace, model_dir: Path, pairs: list[tuple[str, int]]
) -> ServerConfig:
    """What `beamline serve` would be started with: the device's defaults unless a flag says
    otherwise, every row of the largest pair in one step, a KV pool that holds them."""
    max_rows = max(row_count(kind, rows) for kind, rows in pairs)
    budget = max(512, min(max_rows * args.prompt_tokens, 16384))
    prefill_steps = -(-max_rows * args.prompt_tokens // budget)  # early rows decode meanwhile
    max_len = args.prompt_tokens + 5 + 2 * args.steps + prefill_steps + 16
    block_size = 16
    return ServerConfig(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
        overlap_outputs=args.overlap_outputs,
        async_scheduling=args.async_scheduling,
        num_speculative_tokens=args.speculative_tokens,
        num_threads=args.threads or None,
        block_size=block_size,
        num_kv_blocks=max_rows * (math.ceil(max_len / block_size) + 1) + 8,
        max_num_seqs=max_rows,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
    )


def write_results(results: list[Result], path: Path) -> None:
    """Atomically: a run killed while writing leaves the previous pairs' file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps([asdict(r) for r in results], indent=2))
    os.replace(tmp, path)


HEADER = (
    f"{'kind':>8} {'rows':>5} {'path':>6} {'step ms':>8} {'forward ms':>10} {'host ms':>8} "
    f"{'render ms':>9} {'exposed ms':>10} {'free step ms':>12} {'step/forward':>12}"
)


def row_line(r: Result) -> str:
    return (
        f"{r.kind:>8} {r.rows:>5} {r.path:>6} {r.step_ms:>8.2f} {r.forward_ms:>10.2f} "
        f"{r.host_ms:>8.2f} {r.render_ms:>9.2f} {r.exposed_ms:>10.2f} {r.free_step_ms:>12.2f} "
        f"{r.step_per_forward:>12.2f}"
    )


def setting(text: str) -> str:
    if text not in ("auto", "on", "off"):
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--model", type=Path, help="a model directory (default: a random --shape)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here (after each pair)")
    for name, what in (
        ("--overlap-outputs", "render text during the next forward"),
        ("--async-scheduling", "read a step's tokens during the next"),
    ):
        ap.add_argument(
            name, nargs="?", const="on", default="auto", type=setting,
            help=f"{what}: auto (the device's default: on CUDA), on (the bare flag) or off",
        )  # fmt: skip
    ap.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="decode steps run eagerly on CUDA (default: replay the graphs captured at warm-up)",
    )
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "gather", "triton"])
    ap.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="n-gram drafts per row (default 0: every step adds one token to every row)",
    )
    ap.add_argument(
        "--prompt-tokens", type=int, default=PROMPT_TOKENS, help="prompt length of every row"
    )
    args = ap.parse_args(argv)
    pairs = [(kind, int(rows)) for kind in args.kinds.split(",") for rows in args.rows.split(",")]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_random_model(
            Path(tmp) / args.shape, args.shape, dtype=dtype, device=args.device
        )
        loaded = load_engine(engine_config(args, model_dir, pairs))
        loaded.runner.warm_up()  # as the engine thread does before serving: captures the graphs
        timer = ForwardTimer(loaded.runner)  # only now: nothing synchronises inside a capture
        render = RenderTimer(loaded.engine)
        print(HEADER, flush=True)
        for pair, (kind, rows) in enumerate(pairs):
            result = measure(
                loaded, timer, render, kind, rows, args.steps, pair=pair,
                prompt_tokens=args.prompt_tokens,
            )  # fmt: skip
            results.append(result)
            print(row_line(result), flush=True)
            if args.out:
                write_results(results, args.out)
    return results


if __name__ == "__main__":
    main()
