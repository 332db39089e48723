"""Host time of a CUDA-graph decode step's inputs: what `DecodeGraphs.run` does before a replay.

A decode step on the graph path copies its rows' tokens, positions, slots and block tables into
the graphs' static buffers. The buffers are sized for the longest context the server accepts
(`max_model_len / block_size` table columns: 8,192 for a 131k-context Llama at 16-token blocks),
while a step's rows use far fewer. This times `run` on the CPU with a stand-in forward (the
replay itself costs nothing here), so the figure is the host work alone, the part a GPU waits for.

    python -m benchmarks.graph_inputs                  # 16, 64, 256 rows of ~1k-token contexts
    python -m benchmarks.graph_inputs --context 8192 --out results.json

Run it against two checkouts (PYTHONPATH) to compare their code on the same machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from server.model.cuda_graphs import DecodeGraphs


def measure(rows: int, context: int, max_len: int, block_size: int, repeats: int) -> float:
    """Median ms of one `run` of `rows` rows with contexts around `context` tokens."""
    max_blocks = max_len // block_size
    num_blocks = rows * (context // block_size + 2) + 1
    graphs = DecodeGraphs(
        lambda ids, pos, step: torch.zeros(ids.shape[1], 8),
        max_rows=rows,
        max_blocks=max_blocks,
        block_size=block_size,
        scratch_block=num_blocks,
        device=torch.device("cpu"),
    )
    graphs.capture()
    rng = random.Random(rows)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    lengths = [rng.randrange(context // 2, context) for _ in range(rows)]
    tables, start = [], 0
    for n in lengths:
        used = -(-(n + 1) // block_size)
        tables.append(blocks[start : start + used])
        start += used
    tokens = [rng.randrange(1000) for _ in range(rows)]
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        graphs.run(tables, tokens, lengths)
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--context", type=int, default=1024, help="tokens per row (half to all)")
    ap.add_argument("--max-model-len", type=int, default=131_072)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for rows in map(int, args.rows.split(",")):
        ms = measure(rows, args.context, args.max_model_len, args.block_size, args.repeats)
        results.append({"rows": rows, "context": args.context, "ms": round(ms, 3)})
        print(f"{rows:>5} rows, contexts ~{args.context} tokens: {ms:8.3f} ms per step")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
