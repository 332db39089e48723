"""Hugging Face `generate()` baselines: static batching and one request at a time.

Static batching is what a server without continuous batching does: take `batch_size` requests,
left-pad them, and run `generate()` until the longest member is done; nobody joins or leaves in
between. Only each request's own requested tokens count as useful output, so the padding waste of
short members shows up as lost throughput.

Timing (closed loop, like a client at concurrency = batch size that sends the next batch when the
previous one has returned):
- a request is "sent" when its batch starts (tokenization included);
- TTFT = when the batch's first `generate()` step (prefill + first token) is done, measured with a
  streamer that timestamps every step (streaming that token is possible in principle);
- ITL = gaps between the steps that produced the request's own tokens;
- E2EL = when `generate()` returns: a static batch answers everyone at once, so a short request
  waits for the longest one. TPOT = (E2EL - TTFT) / (output_tokens - 1) as for servers.
Batch size 1 is the sequential baseline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.stats import RequestResult
from benchmarks.workload import BenchRequest


@dataclass
class HFModel:
    model: object
    tokenizer: object
    path: Path
    dtype: str
    load_s: float
    eos_ids: tuple[int, ...]


class StepTimer:
    """A `generate()` streamer that only records when each step's tokens arrive (any batch size)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: object) -> None:  # first call: the prompt; then one call per step
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def step_times(self) -> list[float]:
        return self.stamps[1:]


def load_hf_model(
    model: str | None, dtype: str = "float32", cache_dir: Path | None = None, device: str = "cpu"
) -> HFModel:
    """Load the same model beamline serves (GGUF converted once by beamline's own loader)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.model.loader import resolve_model_dir

    start = time.perf_counter()
    path = resolve_model_dir(model, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    net = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    net = net.to(device).eval()  # type: ignore[arg-type]  # transformers' .to() stub loses self
    eos = net.generation_config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return HFModel(net, tokenizer, path, dtype, time.perf_counter() - start, eos_ids)


def own_length(
    new_tokens: Sequence[int], max_tokens: int, eos_ids: Sequence[int], ignore_eos: bool
) -> int:
    """How many of a row's generated tokens are its own output (EOS included, padding not)."""
    if ignore_eos:
        return min(max_tokens, len(new_tokens))
    for i, tok in enumerate(new_tokens[:max_tokens]):
        if tok in eos_ids:
            return i + 1
    return min(max_tokens, len(new_tokens))


def _generate(hf: HFModel, batch: Sequence[BenchRequest], ignore_eos: bool) -> list[RequestResult]:
    import torch
    from transformers import GenerationConfig

    tok = hf.tokenizer
    t0 = time.perf_counter()
    enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True).to(hf.model.device)
    config = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in batch),
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=None if ignore_eos else list(hf.eos_ids),
    )
    timer = StepTimer()
    with torch.inference_mode():
        out = hf.model.generate(**enc, generation_config=config, streamer=timer)
    t_end = time.perf_counter()
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    steps = timer.step_times
    results = []
    for row, req in enumerate(batch):
        n = own_length(new[row], req.max_tokens, hf.eos_ids, ignore_eos)
        own_steps = steps[:n]
        results.append(
            RequestResult(
                index=req.index,
                success=True,
                ttft=(steps[0] if steps else t_end) - t0,
                e2el=t_end - t0,
                itl=[b - a for a, b in zip(own_steps, own_steps[1:])],
                output_tokens=n,
                prompt_tokens=int(enc["attention_mask"][row].sum()),
                expected_output_tokens=req.max_tokens if ignore_eos else None,
                text=tok.decode(new[row][:n], skip_special_tokens=True),
            )
        )
    return results


def run_static_batches(
    hf: HFModel,
    requests: Sequence[BenchRequest],
    batch_size: int,
    ignore_eos: bool = True,
    desc: str = "",
) -> tuple[list[RequestResult], float]:
    """Consecutive batches of `batch_size` requests in workload order; results, wall time."""
    results: list[RequestResult] = []
    bar = tqdm(
        total=len(requests), desc=desc or f"hf static b={batch_size}", unit="req", leave=False
    )
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        results.extend(_generate(hf, batch, ignore_eos))
        bar.update(len(batch))
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def warmup(hf: HFModel, batch: Sequence[BenchRequest] = (BenchRequest(-1, "Hello", 4),)) -> None:
    """One generate() of `batch`, untimed, so one-time costs (allocator growth, kernel choices
    for its shapes) miss the timed ones. On an H200 the first timed batch of 16 took about 12 s
    and the second about 3 s after the tiny default alone: each level warms with its own first
    batch."""
    _generate(hf, batch, ignore_eos=True)
