"""The sampling tensors that depend on the rows' params alone, per decode step, when requests join
and leave.

R rows of one kind (`benchmarks.overhead.measure.KINDS`: greedy, sampled with temperature,
top-k, top-p and a repetition penalty), step after step; at every step one request leaves and a
new one joins, as in a busy server where requests finish at different steps. Three ways,
alternated in one process:

- `rebuild`: `RowTensors.of` from every row's params (what a step did whenever its rows changed);
- `records`: `KeptRowTensors` as the engine keeps them: a changed step builds its tensors from
  each request's `RowRecord`, worked out once while the request runs;
- `steady`: `KeptRowTensors` when no request joins or leaves (the kept tensors are reused).

Each way's tensors are checked against `rebuild`'s on the first step; the median ms per step of
each is reported, with rebuild / records.

    python -m benchmarks.row_tensors                        # 64 and 256 rows, greedy and sampled
    python -m benchmarks.row_tensors --rows 256 --kinds sampled --ways rebuild
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.overhead.measure import KINDS
from decoding.params import DecodingParams
from decoding.row_tensors import KeptRowTensors, RowTensors

WAYS = ("rebuild", "records", "steady")
EOS = frozenset({1})


@dataclass
class Result:
    kind: str
    rows: int
    vocab: int
    steps: int
    ms: dict[str, float]  # median per step, by way
    rebuild_per_records: float | None


def measure(kind: str, rows: int, vocab: int, steps: int, ways: tuple[str, ...]) -> Result:
    make: Callable[[int], DecodingParams] = KINDS[kind]
    joined = rows
    batch = [make(i) for i in range(rows)]
    kept = {way: KeptRowTensors() for way in ways if way != "rebuild"}
    for k in kept.values():
        k.tensors(batch, EOS, vocab, "cpu")  # the rows' records and tensors from a first step
    times: dict[str, list[float]] = {way: [] for way in ways}
    for step in range(steps):
        batch = batch[1:] + [make(joined)]  # the oldest request leaves, a new one joins
        joined += 1
        built = {}
        for way in ways if step % 2 else ways[::-1]:
            rows_now = batch if way != "steady" else list(batch)
            if way == "steady":  # the same rows as its last step: reused
                kept[way].tensors(batch, EOS, vocab, "cpu")
            start = time.perf_counter()
            if way == "rebuild":
                built[way] = RowTensors.of(rows_now, EOS, vocab, "cpu")
            else:
                built[way] = kept[way].tensors(rows_now, EOS, vocab, "cpu")
            times[way].append((time.perf_counter() - start) * 1e3)
        if step == 0 and "rebuild" in built:
            for way, tensors in built.items():
                if not _equal(tensors, built["rebuild"]):
                    raise AssertionError(f"{way}'s tensors differ from a rebuild's")
    ms = {way: statistics.median(t) for way, t in times.items()}
    ratio = ms["rebuild"] / ms["records"] if {"rebuild", "records"} <= ms.keys() else None
    return Result(kind, rows, vocab, steps, ms, ratio)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        fields = a.__dataclass_fields__
        return type(a) is type(b) and all(_equal(getattr(a, f), getattr(b, f)) for f in fields)
    return a == b


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--kinds", default="greedy,sampled")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ways = tuple(w for w in WAYS if w in args.ways.split(","))
    print(f"{'kind':>8} {'rows':>5} " + " ".join(f"{w + ' ms':>11}" for w in ways))
    results = []
    for kind in args.kinds.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            r = measure(kind, rows, args.vocab, args.steps, ways)
            results.append(r)
            ratio = (
                f"  rebuild/records {r.rebuild_per_records:.2f}x" if r.rebuild_per_records else ""
            )
            figures = " ".join(f"{r.ms[w]:>11.3f}" for w in ways)
            print(f"{kind:>8} {rows:>5} {figures}{ratio}", flush=True)
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main()
