"""llama.cpp's own `llama-server` as a baseline in the same run as beamline.

Built once from the llama.cpp source that the `llama-cpp-python` sdist on PyPI ships (cmake, cached
under ~/.cache/beamline), then started per concurrency level with one slot per client (`-np c`),
continuous batching and a thread per core, the way its README serves many clients.

The build names its CPU extensions: `GGML_NATIVE=ON` (llama.cpp's default) probes the build host
and on these VMs produced a binary that died with SIGILL (an Intel host advertised AMX the VM does
not allow), and its default web UI is downloaded at build time (`LLAMA_USE_PREBUILT_UI=OFF`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.client import CompletionTarget, level_requests, run_concurrency
from benchmarks.launch import LaunchError, first_model_id, free_port, launched_command
from benchmarks.serving.report import Run, SystemResult
from benchmarks.stats import summarize
from benchmarks.workload import BenchRequest

VERSION = "0.3.36"  # llama-cpp-python's sdist, which vendors llama.cpp's source
LABEL = "llama.cpp llama-server (Q4_K_M GGUF, -np c, continuous batching)"
# its own n-gram speculation (prompt lookup over the slot's context), for input-grounded work.
# Lookup n-grams of 3 tokens, its best setting on the grounded workload: one run each at c = 1
# on 2026-11-24 gave 118-122 out tok/s against 89 with its default of 12 (README: Performance).
NGRAM_ARGS = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3")
NGRAM_LABEL = "llama.cpp llama-server + n-gram speculation (ngram-simple, lookup n-gram 3)"
CPU_FLAGS = (  # explicit, never GGML_NATIVE (see the module docstring)
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON",
    "-DGGML_AVX512_VNNI=ON",
    "-DGGML_AVX512_BF16=ON",
)
BUILD_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    *CPU_FLAGS,
)


def cache_dir() -> Path:
    root = Path(os.environ.get("BEAMLINE_CACHE_DIR", Path.home() / ".cache" / "beamline"))
    return root / f"llama-server-{VERSION}"


def missing_tools() -> list[str]:
    return [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]


def build(cache: Path | None = None, jobs: int | None = None) -> Path:
    """The llama-server binary: the cached one, else built now (about 15 minutes on 2 cores)."""
    cache = cache or cache_dir()
    binary = cache / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if missing := missing_tools():
        raise LaunchError(f"building llama-server needs {', '.join(missing)} on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
            + ["--quiet", f"llama-cpp-python=={VERSION}", "-d", tmp],
            check=True,
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = Path(tmp) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(cache / "build"), *generator, *BUILD_FLAGS],
            check=True,
        )
        subprocess.run(
            ["cmake", "--build", str(cache / "build"), "--target", "llama-server"]
            + ["-j", str(jobs or os.cpu_count() or 1)],
            check=True,
        )
    return binary


def server_command(
    binary: Path,
    gguf: Path,
    port: int,
    slots: int,
    threads: int,
    ctx_per_slot: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """One slot per concurrent client, each with `ctx_per_slot` tokens of context; `threads` for
    decode and for prompt batches alike; `extra` flags last."""
    return [
        str(binary),
        "--model", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(slots),
        "--cont-batching",
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--ctx-size", str(ctx_per_slot * slots),
        "--no-webui",
        *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def launched(
    binary: Path,
    gguf: Path,
    slots: int,
    log_path: Path,
    threads: int | None = None,
    ctx_per_slot: int = 1024,
    timeout_s: float = 300.0,
    extra: Sequence[str] = (),
) -> Iterator[str]:
    """Yield the base URL of a llama-server with `slots` slots; stopped on exit."""
    port = free_port()
    threads = threads or os.cpu_count() or 1
    cmd = server_command(binary, gguf, port, slots, threads, ctx_per_slot, extra)
    with launched_command(cmd, port, log_path, timeout_s) as url:
        yield url


def measure(
    gguf: Path,
    requests: Sequence[BenchRequest],
    levels: Sequence[int],
    log_path: Path,
    ignore_eos: bool = True,
    threads: int | None = None,
    chat: bool = False,
    ngram: bool = False,
    rounds: int | None = None,
) -> SystemResult:
    """The closed-loop load at each concurrency level, each against a fresh llama-server with one
    slot per client (`chat`: the prompts as user messages; `ngram`: its n-gram speculation on)."""
    binary = build()
    threads = threads or os.cpu_count() or 1
    extra = NGRAM_ARGS if ngram else ()
    name = "llama-server-ngram" if ngram else "llama-server"
    result = SystemResult(
        name,
        NGRAM_LABEL if ngram else LABEL,
        "server",
        info={"binary": str(binary), "version": f"llama-cpp-python {VERSION} sdist",
              "gguf": str(gguf), "threads": threads, "cmake_flags": list(BUILD_FLAGS),
              "extra_args": list(extra)},
    )  # fmt: skip
    for c in levels:
        with launched(binary, gguf, c, log_path, threads, extra=extra) as url:
            model = first_model_id(url)
            target = CompletionTarget(url, model, ignore_eos=ignore_eos, chat=chat)
            reqs = level_requests(requests, c, rounds)
            res, dur = asyncio.run(run_concurrency(target, reqs, c, f"{name} c={c}"))
        result.runs.append(Run(c, summarize(res, dur)))
    return result
