"""At most one device-to-host read per engine step (the chosen tokens), counted.

On a GPU every read of a tensor's values into Python (`.tolist()`, `.item()`, `int()`, `bool()`,
...) waits for the device to finish all queued work; the engine's host work can only overlap the
forward when a step reads once. A torch function mode counts those calls during steps; on the CPU
they cost nothing, but the same code runs on CUDA."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from decoding import DecodingParams, SamplingTensors, choose_tokens, process_logits, sample
from decoding.random_streams import RandomStreams, stream_key
from decoding.warpers import TIE_ROOM
from server.model.kv_pool import paged_kernel
from tests.conftest import make_engine
from tests.engine_driver import submit

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
READS |= {"nonzero", "unique", "masked_select"}  # output sizes that depend on device values


class ReadCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in READS:
            caller = traceback.extract_stack(limit=2)[0]
            self.reads[f"{name} at {Path(caller.filename).name}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


ROOT = Path(__file__).resolve().parents[1]
OUR_CODE = (str(ROOT / "server"), str(ROOT / "decoding"))


class CopyCounter(TorchFunctionMode):
    """Host-to-device copies our code (server/, decoding/) asks for during a step: their
    elements, and the blocking ones: `torch.tensor(..., device=...)` and a `.to(device)` or
    `.copy_(host)` without `non_blocking` wait for all queued work on CUDA (a pageable copy is a
    full sync, and the read counter above does not see it). On the CPU every tensor is a host
    one, so intent is what is counted: `.to(...)` naming a device, `.copy_(..., non_blocking=...)`
    (a `.copy_` without it is taken as a copy between device buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, bool]] = []  # (where, elements, blocking)

    @property
    def elements(self) -> int:
        return sum(n for _, n, _ in self.calls)

    @property
    def blocking(self) -> list[str]:
        return [where for where, _, blocking in self.calls if blocking]

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        caller = traceback.extract_stack(limit=2)[0]
        if name in ("tensor", "as_tensor", "to", "copy_") and caller.filename.startswith(OUR_CODE):
            where = f"{name} at {Path(caller.filename).name}:{caller.lineno}"
            async_ = kwargs.get("non_blocking", False)
            if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
                self.calls.append((where, out.numel(), True))
            elif name == "to" and _names_device(args[1:], kwargs):
                self.calls.append((where, args[0].numel(), not async_))
            elif name == "copy_" and "non_blocking" in kwargs:
                self.calls.append((where, args[1].numel(), not async_))
        return out


def _names_device(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` call names a device (else it only converts the dtype)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


PARAMS = {
    "greedy": DecodingParams(max_tokens=40, ignore_eos=True, temperature=0.0),
    "sampled": DecodingParams(
        max_tokens=40,
        ignore_eos=True,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        seed=1,
    ),
    "beam": DecodingParams(max_tokens=40, ignore_eos=True, temperature=0.0, num_beams=4),
    "n": DecodingParams(max_tokens=40, ignore_eos=True, temperature=0.8, n=3, seed=2),
}
WITH_LOGPROBS = {  # the logprobs of every row (or beam pair) come back in one more read
    "sampled_logprobs": DecodingParams(
        max_tokens=40, ignore_eos=True, temperature=0.7, seed=3, logprobs=5
    ),
    "beam16_logprobs": DecodingParams(
        max_tokens=40, ignore_eos=True, temperature=0.0, num_beams=16, logprobs=3
    ),
}


@pytest.mark.parametrize(
    ("kinds", "reads"),
    [
        (["greedy"], 1),
        (["sampled"], 1),
        (["beam"], 1),
        (["n"], 1),
        (list(PARAMS), 2),
        (["sampled_logprobs"], 2),
        (["beam16_logprobs"], 2),
    ],
)
def test_a_decode_step_reads_from_the_device_once(
    llama_dir: Path, kinds: list[str], reads: int
) -> None:
    """Once per step; twice when beam searches share the step with other requests (their
    candidates are read after the other rows' tokens, not yet with them) or when rows ask for
    logprobs (computed from the chosen tokens, read in one go for every row or beam pair)."""
    engine = make_engine(llama_dir)
    for i, kind in enumerate(kinds):
        submit(engine, str(i), [5, 9, 13, 17 + i], {**PARAMS, **WITH_LOGPROBS}[kind])
    for _ in range(3):  # prefill, first samples, forks
        engine.step()
    for _ in range(5):
        counter = ReadCounter()
        with counter:
            assert engine.step()
        assert sum(counter.reads.values()) <= reads, dict(counter.reads)


@pytest.mark.parametrize("backend", ["gather", "triton"])
def test_a_step_copies_to_the_device_without_blocking(llama_dir: Path, backend: str) -> None:
    """Every host-to-device copy of a step (inputs, block tables, sampling tensors) is queued
    without blocking the host: prefill chunks, decode steps (the gather path's own fast path and
    the kernel's packed path), every strategy."""
    engine = make_engine(llama_dir)
    engine.runner.attention_backend = backend
    engine.runner.attention.kernel = paged_kernel(backend)
    engine.runner.attention.bind(engine.runner.model, engine.runner.kv_cache)
    for i, kind in enumerate(PARAMS):
        submit(engine, str(i), [5, 9, 13, 17 + i], PARAMS[kind])
    for _ in range(8):
        copies = CopyCounter()
        with copies:
            assert engine.step()
        assert copies.calls and not copies.blocking, copies.blocking


def test_sample_reads_once_and_still_keeps_top_k_ties_exactly() -> None:
    """Ties at the k-th value make the support larger than k; past the room kept for them
    (TIE_ROOM) the one-read path notices (on the device) and processes that step again exactly,
    with the same draws: HF's support."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    tie = 8 + TIE_ROOM + 2  # top-k 8 keeps all of them, more than the room holds
    logits[:, 10 : 10 + tie] = logits[:, 10:11] + 5.0
    params = [DecodingParams(temperature=0.9, top_k=8, top_p=0.99, seed=r) for r in range(6)]
    t = SamplingTensors.from_rows(params, [[1]] * 6, [[]] * 6, frozenset(), 300, "cpu")

    def streams() -> RandomStreams:
        return RandomStreams.of([stream_key(r) for r in range(6)], [0] * 6, "cpu")

    want = process_logits(logits, t)
    assert ((want > float("-inf")).sum(dim=-1) >= tie).all()  # more than k: HF keeps ties
    counter = ReadCounter()
    with counter:
        scores, tokens = sample(logits, t, streams())
    torch.testing.assert_close(scores, want)
    assert tokens == choose_tokens(want, t, streams()).tolist()
    # the flag rode along with the tokens; the exact redo read once more, only because of ties
    assert sum(counter.reads.values()) <= 3, dict(counter.reads)
    untied = torch.randn(6, 300)
    t = SamplingTensors.from_rows(params, [[1]] * 6, [[]] * 6, frozenset(), 300, "cpu")
    counter = ReadCounter()
    with counter:
        _, tokens = sample(untied, t, streams())
    assert sum(counter.reads.values()) == 1, dict(counter.reads)
    assert tokens == choose_tokens(process_logits(untied, t), t, streams()).tolist()


def test_bfloat16_ties_at_the_kth_value_cost_no_second_read() -> None:
    """bf16 logits tie at top-k's k-th value in most rows (8 bits of mantissa over a large
    vocabulary); the room kept past k holds those ties, so a step still reads once and keeps the
    exact path's support (HF's: ties at the k-th value kept). Which of two tied entries top-p
    keeps at its cut is the sort's choice, in HF as here: the kept values are compared."""
    torch.manual_seed(0)
    rows, vocab = 64, 32_000
    logits = (torch.randn(rows, vocab) * 2 + 5).to(torch.bfloat16).float()
    params = [DecodingParams(temperature=0.8, top_k=50, top_p=0.95, seed=r) for r in range(rows)]
    t = SamplingTensors.from_rows(params, [[1]] * rows, [[]] * rows, frozenset(), vocab, "cpu")
    kth = logits.topk(50, dim=-1).values[:, -1:]
    assert ((logits >= kth).sum(dim=-1) > 50).float().mean() > 0.3  # ties are the norm

    streams = RandomStreams.of([stream_key(r) for r in range(rows)], [0] * rows, "cpu")
    counter = ReadCounter()
    with counter:
        scores, tokens = sample(logits, t, streams)
    assert sum(counter.reads.values()) == 1, dict(counter.reads)
    want = process_logits(logits, t)
    torch.testing.assert_close(scores.sort(dim=-1).values, want.sort(dim=-1).values)
    assert (scores[torch.arange(rows), tokens] > float("-inf")).all()


def test_overlapped_text_is_rendered_before_the_step_reads_the_device(llama_dir: Path) -> None:
    """With overlap_outputs the previous step's text is rendered after this step's forward is
    queued and before anything waits for it: on a GPU it runs while the device computes."""
    engine = make_engine(llama_dir, overlap_outputs=True)
    for i, kind in enumerate(["greedy", "sampled", "n"]):
        submit(engine, str(i), [5, 9, 13, 17 + i], PARAMS[kind])
    for _ in range(3):
        engine.step()
    counter = ReadCounter()
    reads_before_render: list[int] = []
    render = engine.output.render_pending

    def recording():  # type: ignore[no-untyped-def]
        reads_before_render.append(sum(counter.reads.values()))
        return render()

    engine.output.render_pending = recording  # type: ignore[method-assign]
    for _ in range(5):
        counter.reads.clear()
        with counter:
            assert engine.step()
        assert sum(counter.reads.values()) <= 1, dict(counter.reads)
    assert reads_before_render == [0] * 5
