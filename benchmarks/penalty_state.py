"""The penalties' host and tensor work per decode step, by history length, in isolation.

R rows, each with a prompt and an output of `--history` tokens in all, step after step: every row
outputs one token, then the repetition, presence and frequency penalties are built for the step
and applied to [R, V] scores. Two ways, alternated in one process:

- `lists`: from each row's token lists at every step (`build_processor_tensors` without kept
  state: what a row without kept state, such as a speculative draft position, still does);
- `table`: from the rows' slots in a `PenaltyTable` (decoding/penalty_table.py), which each
  output token updates; the step gathers the slots and applies them.

Both must give the same scores (checked on the first step), and the median ms per step of each
is reported with their ratio. The tokens are random over the vocabulary, so a history of H
tokens has nearly H distinct ones (the costly case for both).

    python -m benchmarks.penalty_state                      # 256 rows, 100 / 1,000 / 4,000 tokens
    python -m benchmarks.penalty_state --rows 64 --history 500 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from decoding.params import DecodingParams
from decoding.penalty_table import PenaltyRow, PenaltyTable
from decoding.processors import apply_processors_, build_processor_tensors

PARAMS = DecodingParams(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)


@dataclass
class Result:
    rows: int
    history: int
    vocab: int
    steps: int
    lists_ms: float  # medians per step
    table_ms: float
    lists_per_table: float


def measure(rows: int, history: int, vocab: int, steps: int, seed: int = 0) -> Result:
    g = torch.Generator().manual_seed(seed)
    prompt_len = history // 2
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    outputs = [
        torch.randint(0, vocab, (history - prompt_len,), generator=g).tolist() for _ in range(rows)
    ]
    params = [PARAMS] * rows
    table = PenaltyTable("cpu")
    kept: list[PenaltyRow | None] = [table.add(p, o) for p, o in zip(prompts, outputs)]
    scores = torch.randn(rows, vocab, generator=g)
    times: dict[str, list[float]] = {"lists": [], "table": []}
    for step in range(steps):
        new = torch.randint(0, vocab, (rows,), generator=g).tolist()
        for r, token in enumerate(new):
            outputs[r].append(token)
        results = {}
        for way in ("lists", "table") if step % 2 else ("table", "lists"):
            work = scores.clone()
            start = time.perf_counter()
            if way == "table":
                for state, token in zip(kept, new):
                    assert state is not None
                    state.append(token)
            t = build_processor_tensors(
                params, prompts, outputs, (), vocab, "cpu", kept if way == "table" else None
            )
            results[way] = apply_processors_(work, t)
            times[way].append((time.perf_counter() - start) * 1e3)
        if step == 0 and not torch.equal(results["lists"], results["table"]):
            raise AssertionError("the table's penalties differ from the lists'")
    lists, kept_ms = statistics.median(times["lists"]), statistics.median(times["table"])
    return Result(rows, history, vocab, steps, lists, kept_ms, lists / kept_ms)


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--history", default="100,1000,4000", help="tokens per row (prompt + output)")
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'rows':>5} {'history':>8} {'lists ms':>9} {'table ms':>9} {'lists/table':>11}")
    results = []
    for history in (int(h) for h in args.history.split(",")):
        r = measure(args.rows, history, args.vocab, args.steps)
        results.append(r)
        print(
            f"{r.rows:>5} {r.history:>8} {r.lists_ms:>9.2f} {r.table_ms:>9.2f} "
            f"{r.lists_per_table:>10.1f}x",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main()
