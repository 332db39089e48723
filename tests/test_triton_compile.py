"""The paged-attention kernel as a GPU would compile and launch it, checked on the CPU.

The CPU tests run the kernel through Triton's interpreter, which executes Python and so accepts
what Triton's compiler refuses: the first CUDA start would have crashed on a non-constexpr global
the interpreter read happily. Here, with no GPU: every launch serving can produce compiles for
sm_90 (H100 / H200) and sm_80 (A100) with Triton's offline compiler, without spills; the
launch parameters follow the head dimension; queries split across programs give the same
attention; and after the engine's warm-up, serving launches no variant Triton would compile
again (a compile inside the engine thread stalls every request for 0.4-1.6 s).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoding import DecodingParams
from server.model import triton_attention
from server.model.paged_step import PagedStep
from server.model.triton_attention import launch_config, paged_attention
from tests.conftest import TEST_DEVICE
from tests.engine_driver import generate
from tests.test_triton_attention import backend_engine, reference
from tests.triton_offline import DTYPES, MODEL_SHAPES, cuda_binder

ROOT = Path(__file__).resolve().parents[1]
# Largest shared memory a block may use: sm_90 227 KiB, sm_80 163 KiB (CUDA's programming guide).
SHARED_LIMIT = {90: 232_448, 80: 166_912}
MAX_STACK_BYTES = 64  # a few spilled registers tolerated; 255 registers + KiB of spills are not


TRITON36_PYTHON = os.environ.get("BEAMLINE_TRITON36_PYTHON")


def triton_python(name: str) -> str:
    """The interpreter whose Triton compiles: this one (CI's pin), or the scratch venv with the
    GPU machines' Triton 3.6 (tests/triton36_venv.sh; under CI=true its absence fails)."""
    if name == "this":
        return sys.executable
    if not TRITON36_PYTHON:
        message = "BEAMLINE_TRITON36_PYTHON is not set: build it with tests/triton36_venv.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return TRITON36_PYTHON


@pytest.mark.parametrize(
    ("triton", "archs"), [("this", ("90", "80")), ("3.6", ("90",))], ids=["ci-triton", "triton36"]
)
def test_every_launch_compiles_for_sm90_and_sm80_without_spills(
    triton: str, archs: tuple[str, ...]
) -> None:
    """With CI's Triton for H100 / H200 and A100; with the GPU machines' Triton 3.6 for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arch_flags = [flag for arch in archs for flag in ("--arch", arch)]
    run = subprocess.run(
        [triton_python(triton), "-m", "tests.triton_offline", *arch_flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    failed = [(r["name"], r["arch"], r["error"]) for r in results if not r["ok"]]
    assert not failed, failed[:3]
    for arch in map(int, archs):
        names = {r["name"] for r in results if r["arch"] == arch}
        for shape in MODEL_SHAPES:  # decode and prefill launches of every shape and dtype
            for dtype in DTYPES:
                assert {f"{shape} {dtype} decode", f"{shape} {dtype} prefill"} <= {
                    n.rsplit(" ", 1)[0] for n in names
                }
    spilled = [r for r in results if r["stack_bytes"] > MAX_STACK_BYTES]
    assert not spilled, [(r["name"], r["arch"], r["registers"], r["stack_bytes"]) for r in spilled]
    too_big = [r["name"] for r in results if r["shared_bytes"] > SHARED_LIMIT[r["arch"]]]
    assert not too_big


def test_launch_parameters_follow_the_head_dimension(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wider heads get more warps, fewer keys per block and fewer queries per program: at head
    dim 256 Triton's defaults (4 warps, 64 keys) needed 255 registers and spilled."""
    monkeypatch.setattr(triton_attention, "INTERPRET", False)  # the compiled kernel's choices
    small = launch_config(torch.bfloat16, 64, 4, 1, 16, window=False, softcap=False)
    wide = launch_config(torch.bfloat16, 256, 4, 1, 16, window=False, softcap=False)
    assert (small.num_warps, small.constexprs["BLOCK_N"]) == (4, 64)
    assert (wide.num_warps, wide.constexprs["BLOCK_N"]) == (8, 32)
    chunk = launch_config(torch.bfloat16, 256, 8, 16, 16, window=True, softcap=True)
    assert chunk.constexprs["BLOCK_M"] == 64 and chunk.parts == 2  # 16 queries x 8 heads: split
    assert chunk.constexprs["SUB_Q"] * chunk.parts == 16


def test_queries_split_across_programs_match_the_reference() -> None:
    """A tile of 16 queries with a GQA group of 8 at head dim 256 is cut into programs of a
    few queries each (`launch_config`'s parts): same attention as one program would give."""
    rng = random.Random(0)
    block_size, heads, kv_heads, head_dim = 4, 8, 1, 256
    starts, num_new = [3, 0], [21, 1]
    tables = [list(range(7)), [9]]
    launch = launch_config(
        torch.float32, head_dim, heads, 16, block_size, window=True, softcap=True
    )
    assert launch.parts > 1  # the split is what this test is about
    torch.manual_seed(rng.randrange(1000))
    k_pool = torch.randn(12 * block_size, kv_heads, head_dim)
    v_pool = torch.randn(12 * block_size, kv_heads, head_dim)
    q = torch.randn(1, heads, sum(num_new), head_dim)[0].transpose(0, 1)
    step = PagedStep.build(tables, starts, num_new, block_size, TEST_DEVICE)
    on = [t.to(TEST_DEVICE) for t in (q, k_pool, v_pool)]
    got = paged_attention(*on, step, scale=0.06, softcap=5.0, window=9).cpu()
    want = reference(q, k_pool, v_pool, tables, starts, num_new, block_size, 0.06, 5.0, 9)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_serving_after_warm_up_compiles_no_new_kernel_variant(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton compiles a kernel per specialisation of its arguments (ints equal to 1 or
    divisible by 16, pointers 16-byte aligned, constexprs, options). Each launch's is computed
    by Triton's own binder for sm_90; after the runner's warm-up (what the engine thread runs
    before serving), chunked prefills, decode steps of 1 to 7 rows with growing block tables,
    beams and prefix-cache hits launch none that the warm-up did not (Gemma 3: sliding-window
    and global layers)."""
    model_dir = tiny_model_dirs["gemma3"]
    real = triton_attention._paged_attention_kernel
    _, _, binder = cuda_binder(real)
    seen: list[str] = []

    class Keyed:
        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: object, **kwargs: object) -> object:
                _, specialization, options = binder(*args, **kwargs)
                seen.append(repr((specialization, sorted(options.items()))))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Keyed())
    engine = backend_engine(model_dir, "triton", max_num_seqs=8, max_num_batched_tokens=16)
    engine.runner.warm_up()
    warmed = set(seen)
    assert len(warmed) == 4  # decode and chunk tiles, window and global layers
    seen.clear()
    shared = [5, 9, 13, 17, 21, 25, 29, 33, 37]
    prompts = [shared + [41 + i] * (1 + 3 * i) for i in range(5)] + [[7, 11, 19], [3]]
    generate(engine, prompts, DecodingParams(max_tokens=14, ignore_eos=True, temperature=0.0))
    generate(engine, prompts[:2], DecodingParams(max_tokens=6, num_beams=3, temperature=0.0))
    assert seen and set(seen) <= warmed, set(seen) - warmed
