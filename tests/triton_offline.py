"""Compile the paged-attention kernel with Triton's offline compiler, no GPU needed.

The interpreter (TRITON_INTERPRET=1, how the CPU tests run the kernel) executes Python, so it
accepts code that Triton's compiler refuses (a non-constexpr global read in the kernel crashed
the first CUDA start). Here every launch serving can produce is taken from the launcher itself
(`paged_attention` with the kernel replaced by a recorder), bound and specialised by Triton's own
binder as a launch on that GPU would be, and compiled to a cubin for `sm_<arch>`; the cubin's
registers, stack frame (spills) and shared memory are reported.

    python -m tests.triton_offline --arch 90 --arch 80      # one JSON line per compiled launch

Run without TRITON_INTERPRET (tests/test_triton_compile.py starts it in a subprocess). Uses
Triton internals (`create_function_from_signature`, `JITFunction._pack_args`): they are what a
GPU launch runs, and the test fails loudly if a Triton release moves them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

# (head dim, query heads, KV heads, sliding-window layers, attention softcap) of the model
# families beamline serves; the launches they make, in three dtypes, cover the kernel's variants.
MODEL_SHAPES: dict[str, tuple[int, int, int, bool, bool]] = {
    "llama-3.2-1b": (64, 32, 8, False, False),
    "llama-3.1-8b": (128, 32, 8, False, False),
    "llama-3.1-70b": (128, 64, 8, False, False),
    "qwen2.5-0.5b": (64, 14, 2, False, False),
    "qwen2.5-7b": (128, 28, 4, False, False),
    "mistral-7b": (128, 32, 8, True, False),
    "phi-3-mini": (96, 32, 32, False, False),
    "gemma-3-270m": (256, 4, 1, True, False),
    "gemma-3-4b": (256, 8, 4, True, False),
    "gemma-2-9b": (256, 16, 8, True, True),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCK_SIZE = 16  # the default KV page
OTHER_PAGES = (1, 12, 128)  # block_size may be any of 1..1024: a few others, on one shape


@dataclass
class Compiled:
    name: str  # model shape, dtype, decode / prefill, window / full layer
    arch: int
    ok: bool
    error: str = ""
    registers: int = 0
    stack_bytes: int = 0  # the frame ptxas needed beyond registers: spills
    shared_bytes: int = 0
    key: str = ""  # the launch's constexprs and options, to tell duplicates apart


def recorded_launches() -> list[tuple[str, tuple, dict]]:
    """(name, args, kwargs) of every distinct kernel launch of MODEL_SHAPES x DTYPES (and a few
    other page sizes): decode and prefill steps, sliding-window and full layers, as
    `paged_attention` makes them."""
    from server.model import triton_attention

    calls: list[tuple[tuple, dict]] = []

    class Recorder:
        def __getitem__(self, grid: tuple) -> Any:
            return lambda *args, **kwargs: calls.append((args, kwargs))

    cases = [(shape, dtype, BLOCK_SIZE) for shape in MODEL_SHAPES for dtype in DTYPES]
    cases += [("llama-3.1-8b", "bf16", page) for page in OTHER_PAGES]
    launches, seen = [], set()
    real = triton_attention._paged_attention_kernel
    triton_attention._paged_attention_kernel = Recorder()  # type: ignore[assignment]
    try:
        for shape, dtype, page in cases:
            for kind in ("decode", "prefill"):
                for layer, call in _calls(shape, DTYPES[dtype], page, kind):
                    calls.clear()
                    call()
                    ((args, kwargs),) = calls
                    if (key := launch_key(args, kwargs)) not in seen:
                        seen.add(key)
                        paged = "" if page == BLOCK_SIZE else f" page {page}"
                        launches.append((f"{shape} {dtype} {kind} {layer}{paged}", args, kwargs))
    finally:
        triton_attention._paged_attention_kernel = real
    return launches


def _calls(
    shape: str, dtype: torch.dtype, page: int, kind: str
) -> list[tuple[str, Callable[[], object]]]:
    """(layer kind, a `paged_attention` call) of one step of `shape` in `dtype`: two sequences,
    one token each (decode) or a 3-token chunk after 5 cached tokens and a 40-token prompt."""
    from server.model import triton_attention
    from server.model.paged_step import PagedStep

    head_dim, heads, kv_heads, windowed, capped = MODEL_SHAPES[shape]
    num_new = [1, 1] if kind == "decode" else [3, 40]
    tables = [list(range(-(-(5 + num_new[0]) // page))), list(range(8, 8 + -(-num_new[1] // page)))]
    step = PagedStep.build(tables, [5, 0], num_new, page, torch.device("cpu"))
    pool = torch.zeros(max(map(max, tables)) * page + page, kv_heads, head_dim, dtype=dtype)
    q = torch.zeros(1, sum(num_new), heads, head_dim, dtype=dtype)
    q = q.transpose(1, 2)[0].transpose(0, 1)  # the strided view the model hands over
    return [
        (
            "window" if window else "full",
            functools.partial(
                triton_attention.paged_attention,
                q,
                pool,
                pool,
                step,
                scale=head_dim**-0.5,
                softcap=50.0 if capped else None,
                window=window,
            ),
        )
        for window in ((4096, None) if windowed else (None,))
    ]


def launch_key(args: tuple, kwargs: dict) -> str:
    """What makes two launches compile differently: the query dtype, constexprs and options."""
    return json.dumps({"dtype": str(args[0].dtype), **{k: str(v) for k, v in kwargs.items()}})


def cuda_binder(kernel: Any, arch: int = 90) -> tuple[Any, Any, Any]:
    """(JITFunction, backend, binder) of `kernel` for `sm_<arch>`: the binder maps a launch's
    arguments to what Triton specialises on (its compile cache key), as on that GPU. `kernel`
    may be the interpreter's stand-in (TRITON_INTERPRET=1): a JITFunction is made of its code."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):
        kernel = JITFunction(kernel.fn, **kernel.kwargs)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return kernel, backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def compile_launch(name: str, args: tuple, kwargs: dict, arch: int) -> Compiled:
    """Bind, specialise and compile one launch for `sm_<arch>` as Triton's launcher would."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    from server.model import triton_attention

    key = launch_key(args, kwargs)
    try:
        kernel, backend, binder = cuda_binder(triton_attention._paged_attention_kernel, arch)
        target = backend.target
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options
        )
        source = ASTSource(kernel, signature, constexprs, attrs)
        compiled = triton.compile(source, target=target, options=options.__dict__)
    except Exception as exc:  # a compile error is the finding
        return Compiled(name, arch, False, f"{type(exc).__name__}: {exc}"[:2000], key=key)
    registers, stack = resource_usage(compiled.asm["cubin"], knobs.nvidia.cuobjdump.path)
    return Compiled(name, arch, True, "", registers, stack, compiled.metadata.shared, key)


def resource_usage(cubin: bytes, cuobjdump: str) -> tuple[int, int]:
    """(registers, stack bytes) of the kernel in `cubin`, from cuobjdump's resource report."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(line for line in report.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split())
    return int(fields["REG"]), int(fields["STACK"])


def _compile_one(job: tuple[str, tuple, dict, int]) -> Compiled:
    return compile_launch(*job)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, action="append", required=True, help="90: sm_90 (H100)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of bf16, fp16, fp32")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    wanted = set(args.dtypes.split(","))
    launches = [launch for launch in recorded_launches() if launch[0].split()[1] in wanted]
    jobs = [(name, a, kw, arch) for arch in args.arch for name, a, kw in launches]
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for result in pool.map(_compile_one, jobs):
            print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
