"""`python -m benchmarks.tensor_parallel`: what splitting the model across ranks costs per step.

Measured, on this machine: for each tensor-parallel size (1 and 2 by default), decode steps eager
and compiled (`--compile off,on`: torch.compile's decode step on every rank, its all-reduces
inside the graph), the engine is built in this process as `beamline serve` builds it (this process
is the driver, rank 0; the others are the processes it starts), R rows of greedy requests are
prefilled, then their decode steps timed whole; inside each step the driver's broadcast of the
step's inputs is timed on its own (encoding and the broadcasts, as every follower receives them),
and the steps whose forward went through the driver's compiled graph are counted. On a 2-core CPU
two ranks are expected to be slower than one (each rank gets one core, and gloo's sums cross
processes): the point is the cost, in ms, of what tensor parallelism adds per step. On a one-GPU
machine it cannot be measured.

Computed, for a model shape (Llama-3-8B by default) at `--volume-rows` rows and bfloat16
activations: the bytes a decode step moves between N ranks, from the layer shapes alone
(`step_volume`). Speculation and the prefix cache are off; fp32 weights on the CPU (the exact
mode), bf16 on CUDA (`--device cuda`: rank r on cuda:r, over NCCL).

    python -m benchmarks.tensor_parallel                     # default model, 1 and 16 rows
    python -m benchmarks.tensor_parallel --model DIR --rows 1,4 --steps 16
    python -m benchmarks.tensor_parallel --sizes 2 --compile off,on   # compiled against eager
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

from benchmarks.machine import machine_info
from decoding import DecodingParams
from server.config import ServerConfig
from server.engine.request import EngineRequest
from server.loading import LoadedEngine, load_engine

OUT_DIR = Path(__file__).resolve().parent / "results"
PROMPT_TOKENS = 32
BLOCK_SIZE = 16
# (hidden, layers, vocabulary) of the shapes whose volume is computed
SHAPES = {"llama-3-8b": (4096, 32, 128256), "llama-3-70b": (8192, 80, 128256)}


@dataclass(frozen=True)
class StepVolume:
    """Bytes one decode step moves, per rank, between `ranks` ranks."""

    ranks: int
    rows: int
    all_reduce_bytes: int  # the partial sums: 2 per layer + the embedding's, ring all-reduce
    logits_bytes: int  # the sampled rows' bf16 logits the driver gathers (what it receives)
    inputs_bytes: int  # the step's int32 inputs the driver broadcasts

    @property
    def total_mib(self) -> float:
        return (self.all_reduce_bytes + self.logits_bytes + self.inputs_bytes) / 2**20


def step_volume(
    hidden: int, layers: int, vocab: int, ranks: int, rows: int, context: int = 1024
) -> StepVolume:
    """From the shapes alone: each all-reduce of R x h bf16 values sends 2 (N-1)/N of it per
    rank (ring); the driver receives (N-1)/N of R x V bf16 logits; the inputs are 10 counts, a
    token and the block table (context / 16 blocks) per row, int32."""
    reduce_once = rows * hidden * 2
    all_reduce = (2 * layers + 1) * 2 * (ranks - 1) * reduce_once // ranks
    logits = (ranks - 1) * rows * vocab * 2 // ranks
    inputs = 4 * (4 + 2 + rows * (10 + 1 + -(-context // BLOCK_SIZE)))
    return StepVolume(ranks, rows, all_reduce, logits, inputs)


@dataclass
class Measured:
    ranks: int
    compiled: bool  # torch_compile on: the decode step compiled on every rank
    rows: int
    steps: int
    step_ms_p50: float
    broadcast_ms_p50: float
    broadcast_share: float  # of the step
    compiled_steps: int = 0  # timed steps whose forward ran the driver's compiled graph

    @property
    def setup(self) -> str:
        return f"{self.ranks}_ranks_{'compiled' if self.compiled else 'eager'}"


def engine_config(
    model: str | None,
    ranks: int,
    rows: int,
    steps: int,
    device: str = "cpu",
    compiled: bool = False,
) -> ServerConfig:
    max_len = PROMPT_TOKENS + steps + 32
    return ServerConfig(
        model=model,
        device=device,
        dtype="float32" if device == "cpu" else "bfloat16",  # the CPU's exact mode; CUDA's own
        linear_layout="native",  # the same layout on every rank and at every size
        torch_compile=compiled,
        tensor_parallel_size=ranks,
        num_speculative_tokens=0,
        enable_prefix_caching=False,
        block_size=BLOCK_SIZE,
        num_kv_blocks=rows * (-(-max_len // BLOCK_SIZE) + 1) + 8,
        max_num_seqs=max(rows, 1),
        max_num_batched_tokens=max(512, rows * PROMPT_TOKENS),
        max_model_len=max_len,
    )


def timed_broadcast(loaded: LoadedEngine, seconds: list[float]) -> None:
    """Time the driver's broadcast of each step (nothing to time on one rank)."""
    steps = loaded.runner.tp_steps
    if steps is None:
        return
    send = steps.step

    def timed(*args: object) -> None:
        start = time.perf_counter()
        send(*args)  # type: ignore[arg-type]
        seconds.append(time.perf_counter() - start)

    steps.step = timed  # type: ignore[method-assign]


def counted_compiled_steps(loaded: LoadedEngine, calls: list[int]) -> None:
    """Count the driver's decode forwards that ran its compiled graph (its guards accepted the
    step: a refused step runs eagerly and counts as a fallback, not here)."""
    compiled = loaded.runner.compiled_decode
    if compiled is None:
        return
    run = loaded.runner.decode_step.run

    def counted(*args: object) -> object:
        before = compiled.fallbacks
        out = run(*args)  # type: ignore[operator]
        calls.append(int(compiled.fallbacks == before))
        return out

    loaded.runner.decode_step.run = counted  # type: ignore[assignment]


def measure(loaded: LoadedEngine, rows: int, steps: int, warmup: int = 3) -> Measured:
    engine = loaded.engine
    outputs: deque[object] = deque(maxlen=1024)
    params = DecodingParams(max_tokens=steps + warmup + 8, temperature=0.0, ignore_eos=True)
    vocab = loaded.runner.vocab_size
    ids = [f"tp-{rows}-{i}" for i in range(rows)]
    for i, request_id in enumerate(ids):
        prompt = [4 + (i * 7 + j * 13) % (vocab - 4) for j in range(PROMPT_TOKENS)]
        engine.submit(EngineRequest(request_id, prompt, params, outputs.append))
    while engine.num_waiting or engine.scheduler.num_running_rows < rows:
        engine.step()
    for _ in range(warmup):
        engine.step()
    broadcast: list[float] = []
    timed_broadcast(loaded, broadcast)
    compiled_calls: list[int] = []
    counted_compiled_steps(loaded, compiled_calls)
    step_ms = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
    for request_id in ids:
        engine.abort(request_id)
    while engine.step():
        pass
    step = statistics.median(step_ms)
    sent = statistics.median(broadcast) * 1e3 if broadcast else 0.0
    return Measured(
        loaded.runner.tp.size if loaded.runner.tp else 1,
        loaded.runner.compiled_decode is not None,
        rows,
        steps,
        step,
        sent,
        sent / step,
        sum(compiled_calls[:steps]),
    )


def run(args: argparse.Namespace) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    compiles = [c == "on" for c in args.compile.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    measured: list[Measured] = []
    for ranks in sizes:
        for compiled in compiles:
            config = engine_config(args.model, ranks, max(rows), args.steps, args.device, compiled)
            loaded = load_engine(config)
            try:
                loaded.runner.warm_up()
                for r in rows:
                    measured.append(measure(loaded, r, args.steps))
                    print(json.dumps(asdict(measured[-1])), flush=True)
            finally:
                loaded.close()
    by = {(m.setup, m.rows): m for m in measured}
    first = measured[0].setup
    ratios = {
        f"{setup}_{r}_rows": by[(setup, r)].step_ms_p50 / by[(first, r)].step_ms_p50
        for setup in dict.fromkeys(m.setup for m in measured)
        if setup != first
        for r in rows
    }
    compiled_vs_eager = {
        f"{ranks}_ranks_{r}_rows": by[(f"{ranks}_ranks_compiled", r)].step_ms_p50
        / by[(f"{ranks}_ranks_eager", r)].step_ms_p50
        for ranks in sizes
        for r in rows
        if len(compiles) == 2
    }
    hidden, layers, vocab = SHAPES[args.shape]
    volumes = [
        step_volume(hidden, layers, vocab, n, args.volume_rows, args.volume_context)
        for n in (2, 4, 8)
    ]
    return {
        "benchmark": "tensor_parallel",
        "command": shlex.join(["python", "-m", "benchmarks.tensor_parallel", *args.argv]),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "model": args.model or "gemma-3-270m (default)",
        "measured": [asdict(m) for m in measured],
        "step_time_ratio_vs_first_setup": ratios,
        "step_time_compiled_vs_eager": compiled_vs_eager,
        "volume": {
            "shape": args.shape,
            "rows": args.volume_rows,
            "context_tokens": args.volume_context,
            "per_step": [asdict(v) | {"total_mib": round(v.total_mib, 2)} for v in volumes],
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF directory, .gguf or hub id (default: Gemma 3 270M)")
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, the first the baseline")
    p.add_argument(
        "--compile",
        default="off,on",
        choices=["off", "on", "off,on", "on,off"],
        help="decode steps eager (off), compiled (on) or both, at every size",
    )
    p.add_argument("--device", default="cpu", help="cpu (gloo), or cuda: rank r on cuda:r (NCCL)")
    p.add_argument("--rows", default="1,16", help="rows per measured step")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per row count")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--volume-rows", type=int, default=256)
    p.add_argument("--volume-context", type=int, default=1024, help="tokens per row (tables)")
    p.add_argument("--out", type=Path, help="JSON (default: results/tensor-parallel-<date>.json)")
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    out_at = given.index("--out") if "--out" in given else len(given)
    args.argv = given[:out_at] + given[out_at + 2 :]  # the command, but where it wrote
    result = run(args)
    out = args.out or OUT_DIR / f"tensor-parallel-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    first = result["measured"][0]
    baseline = f"{first['ranks']} rank(s), {'compiled' if first['compiled'] else 'eager'}"
    for name, ratio in result["step_time_ratio_vs_first_setup"].items():
        print(f"{name}: {ratio:.2f}x the step time of {baseline}")
    for name, ratio in result["step_time_compiled_vs_eager"].items():
        print(f"{name}: compiled {ratio:.2f}x the step time of eager")
    for v in result["volume"]["per_step"]:
        print(f"{args.shape}, {v['rows']} rows, {v['ranks']} ranks: {v['total_mib']} MiB/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
