"""Engine time per decode step outside the model forward: the host work a GPU would wait for.

In process, one thread, a random model (`--shape tiny` by default, see random_models.py): R rows
decode together and each step is timed whole; the model's forward (decoder and LM head) is timed
inside it, and host time = step time - forward time. Scheduling, input building, sampling,
commit, detokenization and emission all count as host time. On CUDA the forward timer
synchronises the device around the forward, so host time is what the device would idle for
without overlap.

With `--overlap-outputs` the engine renders a step's text (detokenization, stop strings,
emission) after queuing the next step's forward (engine.py); that part is reported apart as
`render ms`, and `exposed ms` = host time - render time is what a GPU still waits for (on the CPU
the forward is synchronous, so nothing is actually hidden there).

With `--async-scheduling` the engine queues step N+1 before it reads step N's tokens
(server/engine/in_flight.py). The forward timer synchronises the device, which would undo that, so
every timed step is followed by one with nothing timed inside: `free step ms` is their median
step time, and `step/forward` = free step ms / forward ms (the issue's GPU goal: <= 1.2, host time
hidden). On the CPU a free step costs what a timed one does.

    python -m benchmarks.engine_overhead                      # 16, 64, 256 rows; three row kinds
    python -m benchmarks.engine_overhead --rows 256 --kinds greedy --steps 50
    python -m benchmarks.engine_overhead --rows 256 --kinds sampled --prompt-tokens 1000
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.random_models import build_random_model
from decoding import DecodingParams
from server.engine.engine import Engine
from server.engine.request import EngineRequest
from server.model.runner import ModelRunner

PROMPT_TOKENS = 8
BEAMS = 4
KINDS: dict[str, Callable[[int], DecodingParams]] = {
    "greedy": lambda i: DecodingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0),
    "sampled": lambda i: DecodingParams(
        max_tokens=100_000,
        ignore_eos=True,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        repetition_penalty=1.1,
        seed=i,
    ),
    "beam": lambda i: DecodingParams(
        max_tokens=100_000, ignore_eos=True, temperature=0.0, num_beams=BEAMS
    ),
}


@dataclass
class Result:
    kind: str
    rows: int
    steps: int
    step_ms: float  # medians over the timed steps
    forward_ms: float
    host_ms: float
    host_ms_mean: float
    render_ms: float = 0.0  # with overlap_outputs: the part of host_ms rendered during a forward
    exposed_ms: float = 0.0  # host_ms - render_ms
    free_step_ms: float = 0.0  # median step time with nothing timed inside (no device syncs)
    step_per_forward: float = 0.0  # free_step_ms / forward_ms


class ForwardTimer:
    """Accumulates the seconds spent inside the runner's forward calls (decoder, LM head)."""

    NAMES = ("_run_decode", "_run_decoder", "_logits")

    def __init__(self, runner: ModelRunner) -> None:
        self.seconds = 0.0
        self.cuda = runner.device.type == "cuda"
        self.enabled = True  # False: calls go straight through, no device synchronisation
        for name in self.NAMES:
            setattr(runner, name, self._timed(getattr(runner, name)))

    def _timed(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> object:
            if not self.enabled:
                return fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
            return out

        return wrapper


class RenderTimer:
    """Accumulates the seconds the engine spends rendering text inside the overlap window."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = 0.0
        render = engine._render_outputs

        def timed() -> bool:
            start = time.perf_counter()
            try:
                return render()
            finally:
                self.seconds += time.perf_counter() - start

        if engine.overlap_outputs:
            engine._render_outputs = timed  # type: ignore[method-assign]


def measure(
    model_dir: Path,
    kind: str,
    rows: int,
    steps: int,
    device: torch.device,
    warmup: int = 5,
    overlap_outputs: bool = False,
    async_scheduling: bool = False,
    prompt_tokens: int = PROMPT_TOKENS,
) -> Result:
    per_request = BEAMS if kind == "beam" else 1
    max_len = prompt_tokens + warmup + 2 * steps + 8  # timed and free steps
    block_size = 16
    runner = ModelRunner(
        model_dir,
        device=device,
        dtype=torch.float32 if device.type == "cpu" else torch.bfloat16,
        block_size=block_size,
        num_blocks=rows * (-(-max_len // block_size) + 1) + 8,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(
        runner,
        tokenizer,
        max_num_seqs=rows,
        max_num_batched_tokens=max(512, min(rows * prompt_tokens, 16384)),
        max_model_len=max_len + 8,
        overlap_outputs=overlap_outputs,
        **({"async_scheduling": True} if async_scheduling else {}),  # older engines lack it
    )
    timer = ForwardTimer(runner)
    render = RenderTimer(engine)
    outputs: deque[object] = deque(maxlen=4096)  # emitted outputs, dropped as a client would
    vocab = runner.vocab_size
    for i in range(rows // per_request):
        prompt = [4 + (i * 7 + j * 13) % (vocab - 4) for j in range(prompt_tokens)]
        engine.submit(EngineRequest(str(i), prompt, KINDS[kind](i), outputs.append))
    while engine.num_waiting or engine.scheduler.num_running_rows < rows:
        engine.step()
    for _ in range(warmup):
        engine.step()
    gc.collect()
    gc.freeze()  # as the server does after start-up (bootstrap.py)
    step_ms, forward_ms, render_ms, free_ms = [], [], [], []
    for _ in range(steps):
        timer.seconds = render.seconds = 0.0
        timer.enabled = True
        start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        forward_ms.append(timer.seconds * 1e3)
        render_ms.append(render.seconds * 1e3)
        timer.enabled = False  # then one step with nothing synchronising the device inside
        start = time.perf_counter()
        engine.step()
        free_ms.append((time.perf_counter() - start) * 1e3)
    host = [s - f for s, f in zip(step_ms, forward_ms)]
    free, forward = statistics.median(free_ms), statistics.median(forward_ms)
    return Result(
        kind,
        rows,
        steps,
        statistics.median(step_ms),
        statistics.median(forward_ms),
        statistics.median(host),
        statistics.fmean(host),
        statistics.median(render_ms),
        statistics.median(h - r for h, r in zip(host, render_ms)),
        free,
        free / forward if forward else 0.0,
    )


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--model", type=Path, help="a model directory (default: a random --shape)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument(
        "--overlap-outputs", action="store_true", help="render text during the next forward"
    )
    ap.add_argument(
        "--async-scheduling", action="store_true", help="read a step's tokens during the next"
    )
    ap.add_argument(
        "--prompt-tokens", type=int, default=PROMPT_TOKENS, help="prompt length of every row"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_random_model(Path(tmp) / args.shape, args.shape)
        results = [
            measure(
                model_dir,
                kind,
                int(rows),
                args.steps,
                device,
                overlap_outputs=args.overlap_outputs,
                async_scheduling=args.async_scheduling,
                prompt_tokens=args.prompt_tokens,
            )
            for kind in args.kinds.split(",")
            for rows in args.rows.split(",")
        ]
    print(
        f"{'kind':>8} {'rows':>5} {'step ms':>8} {'forward ms':>10} {'host ms':>8} "
        f"{'render ms':>9} {'exposed ms':>10} {'free step ms':>12} {'step/forward':>12}"
    )
    for r in results:
        print(
            f"{r.kind:>8} {r.rows:>5} {r.step_ms:>8.2f} {r.forward_ms:>10.2f} {r.host_ms:>8.2f} "
            f"{r.render_ms:>9.2f} {r.exposed_ms:>10.2f} {r.free_step_ms:>12.2f} "
            f"{r.step_per_forward:>12.2f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main()
