"""Compiling grammars for requests: off the event loop and the engine loop, bounded in time,
cached by content, counted in /metrics.

`GrammarService.compile(spec)` runs the compile in a small thread pool (llguidance releases the
GIL while it builds), so neither the HTTP loop nor the engine thread ever waits for one. A compile
that takes longer than the configured timeout is answered as a client error (the worker finishes
on its own: llguidance's parser limits bound it). Equal specs share one cache entry and one
in-flight compile. The tokenizer view llguidance needs (about a second for a 262k vocabulary from
the bytes kept in the cache dir, 4-5 s at a first start) is built by `prepare()` in a thread at
the first idle second after start-up (bootstrap.after_start_up), or else at the first compile,
which then waits for it. A tokenizer llguidance cannot read (a
WordPiece decoder, a slow tokenizer) turns structured outputs off for the model, not the model
off: every constrained request then gets `StructuredOutputsUnavailable`, which says why.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from decoding.grammar import Grammar, GrammarCompiler, GrammarSpec
from server.metrics import Metrics
from server.tokenizer_cache import keep_token_bytes, read_token_bytes

log = logging.getLogger(__name__)


class GrammarTimeout(Exception):
    """The grammar did not compile within the configured time."""


class StructuredOutputsUnavailable(Exception):
    """The grammar engine cannot read this model's tokenizer: no grammar compiles for it."""


class GrammarService:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_ids: frozenset[int],
        *,
        cache_size: int = 256,
        timeout_s: float = 10.0,
        metrics: Metrics | None = None,
        workers: int = 2,
        token_bytes_path: Path | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_bytes_path = token_bytes_path  # the vocabulary's view kept between starts
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._pending: dict[GrammarSpec, asyncio.Future[Grammar]] = {}
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="beamline-grammar")
        self._compiler: GrammarCompiler | None = None
        self._unavailable: str | None = None  # why no compiler could be built
        self._compiler_lock = threading.Lock()

    async def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of `spec`. Raises GrammarError (invalid), GrammarTimeout or
        StructuredOutputsUnavailable."""
        if self._unavailable is not None:
            raise StructuredOutputsUnavailable(self._unavailable)
        cached = self._cache.get(spec)
        if cached is not None:
            self._cache.move_to_end(spec)
            if self.metrics is not None:
                self.metrics.record_grammar_cache_hit()
            return cached
        pending = self._pending.get(spec)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = asyncio.ensure_future(self._compile_and_store(spec, loop))
            self._pending[spec] = pending
            pending.add_done_callback(lambda _: self._pending.pop(spec, None))
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.timeout_s)
        except TimeoutError:
            raise GrammarTimeout(
                f"the grammar did not compile within {self.timeout_s:g} s"
            ) from None

    async def _compile_and_store(
        self, spec: GrammarSpec, loop: asyncio.AbstractEventLoop
    ) -> Grammar:
        start = time.perf_counter()
        try:
            grammar = await loop.run_in_executor(self._executor, self._compile_blocking, spec)
        except Exception:
            if self.metrics is not None:
                self.metrics.record_grammar_compile(time.perf_counter() - start, ok=False)
            raise
        if self.metrics is not None:
            self.metrics.record_grammar_compile(time.perf_counter() - start, ok=True)
        if self.cache_size > 0:
            self._cache[spec] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile_blocking(self, spec: GrammarSpec) -> Grammar:
        return self._get_compiler().compile(spec)

    def prepare(self) -> bool:
        """Build llguidance's view of the tokenizer now (the server does at start-up); False
        (and a warning that says why) when it cannot read the tokenizer: structured outputs
        are off for this model."""
        try:
            self._get_compiler()
        except StructuredOutputsUnavailable as exc:
            log.warning("structured outputs are off for this model: %s", exc)
            return False
        return True

    def _get_compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._unavailable is not None:
                raise StructuredOutputsUnavailable(self._unavailable)
            if self._compiler is None:
                try:
                    compiler = build_compiler(
                        self.tokenizer, self.vocab_size, self.eos_ids, self.token_bytes_path
                    )
                except Exception as exc:  # llguidance's reasons vary by tokenizer
                    self._unavailable = (
                        "the grammar engine (llguidance) cannot read its tokenizer: "
                        + " ".join(str(exc).split())
                    )
                    raise StructuredOutputsUnavailable(self._unavailable) from exc
                self._compiler = compiler
            return self._compiler


def build_compiler(
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    eos_ids: frozenset[int],
    token_bytes_path: Path | None,
) -> GrammarCompiler:
    """A compiler from the vocabulary kept at `token_bytes_path` if there is one (a second for
    a 262k vocabulary), else from the tokenizer (3-4 s more), then kept there for next time."""
    kept = read_token_bytes(token_bytes_path) if token_bytes_path is not None else None
    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids, token_bytes=kept)
    if kept is not None:
        log.debug("grammar vocabulary read from %s", token_bytes_path)
    elif token_bytes_path is not None:
        keep_token_bytes(compiler.token_bytes(), token_bytes_path)
    return compiler
