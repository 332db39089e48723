"""The paged-attention kernel (server/model/triton_attention.py) against the gather + SDPA
reference, on the CPU through Triton's interpreter: random shapes, mixed prefill / decode
steps, GQA, sliding windows, softcapping, any block size, three dtypes; then whole engines on the
kernel against engines on the reference, token for token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from decoding import DecodingParams
from server.engine.engine import Engine
from server.model.attention import _attend
from server.model.devices import pick_attention_backend
from server.model.paged_step import PagedStep
from server.model.runner import ModelRunner
from server.model.triton_attention import paged_attention
from tests.conftest import TEST_DEVICE
from tests.engine_driver import generate

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def reference(q, k_pool, v_pool, tables, starts, num_new, block_size, scale, softcap, window):
    """Each sequence's history gathered out of the pools, then attention in float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    t = 0
    for table, start, n in zip(tables, starts, num_new):
        pos = torch.arange(start + n)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = k_pool[slots].permute(1, 0, 2)[None].float()
        v = v_pool[slots].permute(1, 0, 2)[None].float()
        q_pos = torch.arange(start, start + n)[:, None]
        mask = pos[None] <= q_pos
        if window:
            mask &= pos[None] > q_pos - window
        qs = q[t : t + n].transpose(0, 1)[None].float()
        out[t : t + n] = _attend(qs, k, v, mask[None, None], scale, softcap)[0].transpose(0, 1)
        t += n
    return out


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_kernel_matches_the_gather_reference_on_random_steps(dtype: torch.dtype) -> None:
    rng = random.Random(str(dtype))
    for trial in range(12):
        block_size = rng.choice([1, 3, 4, 16])
        heads, kv_heads = rng.choice([(4, 4), (4, 2), (8, 2), (8, 1)])
        head_dim = rng.choice([16, 24, 64])
        num_seqs = rng.randrange(1, 5)
        starts = [rng.choice([0, rng.randrange(0, 70)]) for _ in range(num_seqs)]
        num_new = [rng.choice([1, 1, 2, 17, 40]) for _ in range(num_seqs)]
        num_blocks = sum(-(-(s + n) // block_size) for s, n in zip(starts, num_new)) + 8
        free = list(range(num_blocks))
        rng.shuffle(free)  # tables point anywhere in the pool, in any order
        tables = [
            [free.pop() for _ in range(-(-(s + n) // block_size))] for s, n in zip(starts, num_new)
        ]
        k_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
        v_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
        # the model hands queries over as a transposed view: strides, not a contiguous copy
        q = torch.randn(1, heads, sum(num_new), head_dim).to(dtype)[0].transpose(0, 1)
        softcap = rng.choice([None, 5.0])
        window = rng.choice([None, 1, 7, 30])
        scale = head_dim**-0.5
        step = PagedStep.build(tables, starts, num_new, block_size, TEST_DEVICE)
        on = [t.to(TEST_DEVICE) for t in (q, k_pool, v_pool)]
        got = paged_attention(*on, step, scale=scale, softcap=softcap, window=window).cpu()
        want = reference(
            q, k_pool, v_pool, tables, starts, num_new, block_size, scale, softcap, window
        )
        case = (trial, block_size, heads, kv_heads, head_dim, starts, num_new, softcap, window)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=0, msg=str(case))
        slots = [
            table[p // block_size] * block_size + p % block_size
            for table, s, n in zip(tables, starts, num_new)
            for p in range(s, s + n)
        ]
        assert step.slot_mapping.tolist() == slots


def backend_engine(model_dir: Path, backend: str, **limits: int) -> Engine:
    runner = ModelRunner(
        model_dir,
        device=TEST_DEVICE,
        dtype=torch.float32,
        block_size=4,
        num_blocks=192,
        attention_backend=backend,
    )
    return Engine(runner, AutoTokenizer.from_pretrained(model_dir), **limits)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_engine_on_the_kernel_generates_what_the_reference_path_does(
    tiny_model_dirs: dict[str, Path], arch: str
) -> None:
    """Chunked prefill (a 16-token budget cuts the prompts), decode, prefix-cache hits (two
    prompts share a prefix), and beams on forked, copied-on-write blocks: same tokens."""
    model_dir = tiny_model_dirs[arch]
    prompts = [
        [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73, 2 + i]
        for i in range(3)
    ]
    prompts.append([7, 11, 19])
    runs = {}
    for backend in ("gather", "triton"):
        engine = backend_engine(model_dir, backend, max_num_seqs=8, max_num_batched_tokens=16)
        greedy = generate(
            engine, prompts, DecodingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        )
        beams = generate(
            engine, prompts[:2], DecodingParams(max_tokens=8, num_beams=3, n=3, temperature=0.0)
        )
        runs[backend] = [r.choices() for r in greedy + beams]
        assert engine.pool.num_free == engine.pool.num_blocks  # every block back (some cached)
    assert runs["triton"] == runs["gather"]


@pytest.mark.cpu_only  # the interpreted kernel on a CPU device needs TRITON_INTERPRET (conftest)
def test_backend_choice() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_attention_backend("auto", cpu, False) == "gather"
    assert pick_attention_backend("auto", cuda, False) == "triton"
    assert pick_attention_backend("auto", cuda, True) == "gather"  # compiled: the gather path
    assert pick_attention_backend("triton", cpu, False) == "triton"  # interpreted, for tests
    with pytest.raises(ValueError, match="torch_compile"):
        pick_attention_backend("triton", cuda, True)
    with pytest.raises(ValueError, match="must be auto, gather or triton"):
        pick_attention_backend("flash", cuda, False)
