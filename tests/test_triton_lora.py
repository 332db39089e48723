"""The batched multi-LoRA kernels (server/model/lora/kernel.py): against the torch reference
through Triton's interpreter on the CPU (random shapes, any feature count, rows on no adapter left
bit for bit), and as a GPU would compile them: every launch serving can make compiles offline for
sm_90 and sm_80 without spills, and a warmed-up server compiles no variant mid-serving.

The offline compile runs in a subprocess without TRITON_INTERPRET (the interpreter compiles
nothing), as this module's `main`:

    python -m tests.test_triton_lora --arch 90 --arch 80     # one JSON line per compiled launch

so nothing at this module's top level imports tests.conftest (which switches the interpreter on).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from server.model.lora import kernel as triton_lora
from server.model.lora.kernel import add_lora_delta, launch_config, lora_delta_reference
from tests.triton_offline import DTYPES, Compiled, cuda_binder, resource_usage

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
KERNELS = ("_lora_shrink_kernel", "_lora_expand_kernel")
RANKS = (8, 16, 32, 64)
# (in, out) features of the LoRA-able projections (q, k / v, o, gate / up, down) of the models
# the tests and serving use: the tiny test models (hidden 64, 4 x 16 query and 2 x 16 KV head
# dims, intermediate 128), Gemma 3 270M, and one large model (the block sizes saturate there).
MODEL_LAYERS: dict[str, tuple[tuple[int, int], ...]] = {
    "tiny": ((64, 64), (64, 32), (64, 64), (64, 128), (128, 64)),
    "gemma-3-270m": ((640, 1024), (640, 256), (1024, 640), (640, 2048), (2048, 640)),
    "llama-3.1-8b": ((4096, 4096), (4096, 1024), (4096, 4096), (4096, 14336), (14336, 4096)),
}


def _device() -> torch.device:
    from tests.conftest import TEST_DEVICE  # under pytest only: it switches the interpreter on

    return TEST_DEVICE


def _case(
    rng: random.Random,
    dtype: torch.dtype,
    tokens: int,
    in_features: int,
    out_features: int,
    rank: int,
    num_slots: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, out, lora_a (slot 1 an adapter of half the rank, padded with zeros), lora_b, slots
    (every slot and -1 present when there are rows enough). Values of order one."""
    torch.manual_seed(rng.randrange(1 << 30))
    x = torch.randn(tokens, in_features).to(dtype)
    out = torch.randn(tokens, out_features).to(dtype)
    lora_a = torch.randn(num_slots, rank, in_features) / in_features**0.5
    lora_a[1, rank // 2 :] = 0.0  # an adapter of half the rank, padded
    lora_b = torch.randn(num_slots, out_features, rank) / rank**0.5
    lora_b[1, :, rank // 2 :] = 0.0
    choices = [*range(num_slots), -1]  # a step of one row: that row on slot 0
    slots = [choices[i % len(choices)] for i in range(tokens)]
    rng.shuffle(slots)
    return x, out, lora_a.to(dtype), lora_b.to(dtype), torch.tensor(slots, dtype=torch.int32)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_kernels_match_the_reference_on_random_shapes(dtype: torch.dtype) -> None:
    rng = random.Random(str(dtype))
    device = _device()
    features = [64, 96, 100, 640, 1024, 2048]
    cases = [(1, 640, 1024, 16), (33, 2048, 640, 8), (5, 96, 100, 16), (33, 100, 96, 8)]
    cases += [
        (rng.choice([1, 5, 33]), rng.choice(features), rng.choice(features), rng.choice([8, 16]))
        for _ in range(4)
    ]
    for trial, (tokens, in_features, out_features, rank) in enumerate(cases):
        x, out, lora_a, lora_b, slots = _case(rng, dtype, tokens, in_features, out_features, rank)
        want = out.clone()
        lora_delta_reference(x, want, lora_a, lora_b, slots)
        idle = slots < 0
        assert torch.equal(want[idle], out[idle])
        got = out.to(device, copy=True)  # `out` stays as it was: the rows to compare with
        add_lora_delta(x.to(device), got, lora_a.to(device), lora_b.to(device), slots.to(device))
        got = got.cpu()
        case = (trial, tokens, in_features, out_features, rank, slots.tolist())
        assert got.dtype == dtype
        torch.testing.assert_close(
            got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype], msg=str(case)
        )
        assert torch.equal(got[idle], out[idle]), case  # bit for bit: never read or written
        assert (~idle).any() and not torch.equal(got[~idle], out[~idle]), case  # deltas landed


def test_strided_rows_all_idle_rows_and_no_tokens() -> None:
    """`out` a column slice of a wider tensor (the kernels take row strides); a step with no row
    on an adapter changes nothing; an empty step launches nothing."""
    device = _device()
    rng = random.Random(1)
    x, out, lora_a, lora_b, slots = _case(rng, torch.float32, 7, 640, 256, 16)
    wide = torch.randn(7, 1024)
    want = wide.clone()
    want[:, 128:384] = out
    lora_delta_reference(x, want[:, 128:384], lora_a, lora_b, slots)
    got = wide.to(device, copy=True)
    got[:, 128:384] = out.to(device)
    on = [t.to(device) for t in (lora_a, lora_b, slots)]
    add_lora_delta(x.to(device), got[:, 128:384], *on)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, :128].cpu(), wide[:, :128])
    assert torch.equal(got[:, 384:].cpu(), wide[:, 384:])

    before = got.clone()
    add_lora_delta(x.to(device), got[:, 128:384], on[0], on[1], torch.full_like(on[2], -1))
    assert torch.equal(got, before)
    empty = torch.empty(0, 640, device=device)
    add_lora_delta(empty, torch.empty(0, 256, device=device), on[0], on[1], on[2][:0])


def test_block_sizes_follow_the_rank_and_the_feature_counts() -> None:
    """The weight tile (rank block x feature block) stays within 8192 elements and the expand's
    feature block within 512 (at 1024 it spilled); small layers get blocks no wider than their
    (padded) features; shapes that disagree are refused."""
    assert launch_config(640, 2048, 8) == triton_lora.LoraLaunch(8, 1024, 512, 4)
    assert launch_config(2048, 640, 16) == triton_lora.LoraLaunch(16, 512, 512, 4)
    assert launch_config(640, 1024, 64) == triton_lora.LoraLaunch(64, 128, 128, 4)
    assert launch_config(96, 32, 12) == triton_lora.LoraLaunch(16, 128, 32, 4)
    assert launch_config(100, 16384, 32) == triton_lora.LoraLaunch(32, 128, 256, 4)
    with pytest.raises(ValueError, match="rank"):
        launch_config(64, 64, 65)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="disagree"):
        add_lora_delta(
            x,
            torch.zeros(2, 32),
            torch.zeros(1, 8, 64),
            torch.zeros(1, 16, 8),
            torch.zeros(2, dtype=torch.int32),
        )


def _specialization_keys(tokens: int, slot_offset: int) -> set[str]:
    """What Triton would compile for the two launches of a Gemma 3 270M q projection step of
    `tokens` rows whose slots tensor starts `slot_offset` int32s into a buffer: the keys of its
    cache, by Triton's own binder for sm_90."""
    keys: set[str] = set()
    binders = {name: cuda_binder(getattr(triton_lora, name))[2] for name in KERNELS}

    class Keyed:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple) -> Any:
            def launch(*args: object, **kwargs: object) -> None:
                _, specialization, options = binders[self.name](*args, **kwargs)
                keys.add(repr((self.name, specialization, sorted(options.items()))))

            return launch

    x = torch.zeros(tokens, 640, dtype=torch.bfloat16)
    out = torch.zeros(tokens, 1024, dtype=torch.bfloat16)
    lora_a = torch.zeros(4, 16, 640, dtype=torch.bfloat16)
    lora_b = torch.zeros(4, 1024, 16, dtype=torch.bfloat16)
    slots = torch.zeros(tokens + slot_offset, dtype=torch.int32)[slot_offset:]
    real = {name: getattr(triton_lora, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(triton_lora, name, Keyed(name))
        add_lora_delta(x, out, lora_a, lora_b, slots)
    finally:
        for name, kernel in real.items():
            setattr(triton_lora, name, kernel)
    return keys


def test_step_size_and_slot_offsets_compile_no_new_variant() -> None:
    """The number of rows and where the slots tensor starts change every step: neither is
    specialised on, so after one step of each layer a server compiles nothing more."""
    warmed = _specialization_keys(1, 0)
    assert len(warmed) == 2
    for tokens, offset in ((2, 0), (7, 1), (33, 3), (512, 2)):
        assert _specialization_keys(tokens, offset) == warmed, (tokens, offset)


# --- offline compilation (a subprocess runs `main` without the interpreter) -----------------


def recorded_launches() -> list[tuple[str, str, tuple, dict]]:
    """(kernel, name, args, kwargs) of every distinct launch `add_lora_delta` makes for the
    layers of MODEL_LAYERS in DTYPES at RANKS; distinct by Triton's specialisation for sm_90."""
    calls: list[tuple[str, tuple, dict]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple) -> Any:
            return lambda *args, **kwargs: calls.append((self.name, args, kwargs))

    binders = {name: cuda_binder(getattr(triton_lora, name))[2] for name in KERNELS}
    launches, seen = [], set()
    real = {name: getattr(triton_lora, name) for name in KERNELS}
    interpret = triton_lora.INTERPRET
    try:
        triton_lora.INTERPRET = True  # CPU tensors: only recorded, never run
        for name in KERNELS:
            setattr(triton_lora, name, Recorder(name))
        for dtype_name, dtype in DTYPES.items():
            for model, layers in MODEL_LAYERS.items():
                for in_features, out_features in set(layers):
                    for rank in RANKS:
                        calls.clear()
                        add_lora_delta(
                            torch.zeros(3, in_features, dtype=dtype),
                            torch.zeros(3, out_features, dtype=dtype),
                            torch.zeros(2, rank, in_features, dtype=dtype),
                            torch.zeros(2, out_features, rank, dtype=dtype),
                            torch.tensor([0, -1, 1], dtype=torch.int32),
                        )
                        assert [c[0] for c in calls] == list(KERNELS)
                        for kernel, args, kwargs in calls:
                            _, spec, options = binders[kernel](*args, **kwargs)
                            key = repr((kernel, spec, sorted(options.items())))
                            if key not in seen:
                                seen.add(key)
                                shape = f"{in_features}x{out_features} r{rank}"
                                name = f"{kernel} {dtype_name} {model} {shape}"
                                launches.append((kernel, name, args, kwargs))
    finally:
        triton_lora.INTERPRET = interpret
        for name, kernel in real.items():
            setattr(triton_lora, name, kernel)
    return launches


def compile_launch(job: tuple[str, str, tuple, dict, int]) -> Compiled:
    """Bind, specialise and compile one launch for `sm_<arch>` as Triton's launcher would
    (tests/triton_offline.py's `compile_launch`, for these kernels)."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    kernel_name, name, args, kwargs, arch = job
    try:
        kernel, backend, binder = cuda_binder(getattr(triton_lora, kernel_name), arch)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options
        )
        source = ASTSource(kernel, signature, constexprs, attrs)
        compiled = triton.compile(source, target=backend.target, options=options.__dict__)
    except Exception as exc:  # a compile error is the finding
        return Compiled(name, arch, False, f"{type(exc).__name__}: {exc}"[:2000])
    registers, stack = resource_usage(compiled.asm["cubin"], knobs.nvidia.cuobjdump.path)
    return Compiled(name, arch, True, "", registers, stack, compiled.metadata.shared)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, action="append", required=True, help="90: sm_90 (H100)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    jobs = [(*launch, arch) for arch in args.arch for launch in recorded_launches()]
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for result in pool.map(compile_launch, jobs):
            print(json.dumps(asdict(result)), flush=True)
    return 0


@pytest.mark.parametrize(
    ("triton", "archs"), [("this", ("90", "80")), ("3.6", ("90",))], ids=["ci-triton", "triton36"]
)
def test_every_launch_compiles_for_sm90_and_sm80_without_spills(
    triton: str, archs: tuple[str, ...]
) -> None:
    """With CI's Triton for H100 / H200 and A100; with the GPU machines' Triton 3.6 for sm_90
    (tests/test_triton_compile.py's rule: skipped without its venv, failed under CI=true)."""
    from tests.test_triton_compile import MAX_STACK_BYTES, SHARED_LIMIT, triton_python

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arch_flags = [flag for arch in archs for flag in ("--arch", arch)]
    run = subprocess.run(
        [triton_python(triton), "-m", "tests.test_triton_lora", *arch_flags],
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
    launches = {name for _, name, _, _ in recorded_launches()}  # as this process binds them
    assert {r["name"].split()[0] for r in results} == set(KERNELS)
    for arch in map(int, archs):  # every distinct launch, each once
        names = [r["name"] for r in results if r["arch"] == arch]
        assert len(names) == len(set(names)) and set(names) == launches, arch
    spilled = [r for r in results if r["stack_bytes"] > MAX_STACK_BYTES]
    assert not spilled, [(r["name"], r["arch"], r["registers"], r["stack_bytes"]) for r in spilled]
    too_big = [r["name"] for r in results if r["shared_bytes"] > SHARED_LIMIT[r["arch"]]]
    assert not too_big


if __name__ == "__main__":
    sys.exit(main())
