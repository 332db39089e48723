"""Grammar constraints on llguidance: JSON schemas, regexes, choices and Lark grammars.

`GrammarCompiler` holds llguidance's view of the tokenizer (built once: 1.4 s for a 262k
vocabulary from its tokens' bytes, 4.8 s from `tokenizer.json`, on a 2-core Xeon) and compiles a
`GrammarSpec` into a `Grammar`, an immutable compiled template. Each constrained row gets its own
`GrammarConstraint` (a `TokenConstraint`, see constraints.py) from `Grammar.new_constraint()`: a
copy of the template's matcher, so one compiled grammar serves any number of rows and requests.

Why llguidance: its masks take ~50 us per token at a 128k vocabulary, compiles take milliseconds
and are bounded by its parser limits (lexer fuel, grammar size), regexes run on derivatives (no
backtracking, so no catastrophic patterns), and it takes Lark grammars as vLLM's guidance backend
does. benchmarks/grammar_backends.py measures it against xgrammar on our tokenizer.

JSON is compiled compact by default: `", "` between items, `": "` after keys and no other
whitespace, so a small model cannot wander into endless newlines; a schema may override that with
llguidance's `x-guidance` options (e.g. `{"whitespace_flexible": true}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from decoding.json_schemas import as_clients_mean

if TYPE_CHECKING:  # a TypedDict of the type stubs only
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json", "json_object", "regex", "choice", "lark"]
JSON_DEFAULTS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """The spec cannot be compiled (invalid, unsupported, or over the parser's limits)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to. `source`: the JSON schema (as JSON text), the regex, the choices (a
    JSON list of strings) or the Lark grammar; unused for json_object."""

    kind: GrammarKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        """A schema as clients mean it (json_schemas.py: objects closed unless they say
        otherwise, numbers bounded), as compact JSON text (its key order kept: properties are
        generated in the order the schema lists them)."""
        meant = as_clients_mean(schema)
        return cls("json", json.dumps(meant, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(choices, ensure_ascii=False))


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text of a spec (nothing is checked before compiling)."""
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_DEFAULTS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_DEFAULTS
        )
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        choices = json.loads(spec.source)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice needs a non-empty list of non-empty strings")
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def fill_mask_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, index: int) -> None:
    """The allowed-token bits of `matcher`'s position into row `index` of an int32 CPU bitmask.

    What `llguidance.torch.fill_next_token_bitmask` does; that module is not imported because it
    compiles a torch function at import time (torch._dynamo and inductor: seconds of every
    process's start-up, for a function beamline does not use)."""
    row = bitmask[index]
    if bitmask.dtype != torch.int32 or not row.is_cpu or not row.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


class GrammarConstraint:
    """One row's position in a grammar (an llguidance matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def fill_allowed(self, bitmask: torch.Tensor, index: int) -> None:
        fill_mask_row(self.matcher, bitmask, index)

    def advance(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token))

    def fork(self) -> GrammarConstraint:
        return GrammarConstraint(self.matcher.deep_copy())


class Grammar:
    """A compiled grammar: the template every constrained row starts from."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher) -> None:
        self.spec = spec
        self._matcher = matcher

    def new_constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self._matcher.deep_copy())


@dataclass(frozen=True)
class TokenBytes:
    """llguidance's view of a vocabulary: each token's bytes, and which tokens are special.

    llguidance reads it from `tokenizer.json` in 3-4 s for a 262k vocabulary (the whole
    tokenizer rebuilt in Rust); given these bytes it builds its token trie in about a second. A
    server keeps them between starts (tokenizer_cache.py)."""

    tokens: list[bytes]
    special_ids: list[int]


class _Encoder:
    """What llguidance's TokenizerWrapper reads: the vocabulary's bytes, and a text encoder for
    the rare grammar that asks for a tokenization (the fast tokenizer's own, as when llguidance
    reads `tokenizer.json` itself)."""

    def __init__(self, backend: Any, token_bytes: TokenBytes, eos: int, bos: int | None) -> None:
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.tokens = token_bytes.tokens
        self.special_token_ids = token_bytes.special_ids
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper asks once; it then passes text
            raise TypeError("text, not bytes")
        return list(self._backend.encode(text, add_special_tokens=False).ids)


class GrammarCompiler:
    """Compiles specs against one tokenizer. Thread-safe: `compile` may run in worker threads
    (llguidance drops the GIL while it builds a grammar). `token_bytes`, when given, is the
    vocabulary's view a previous compiler returned from `token_bytes()` for this tokenizer."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_ids: frozenset[int] | set[int] | tuple[int, ...],
        limits: llguidance.LLParserLimits | None = None,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        eos = sorted(eos_ids)
        self.vocab_size = vocab_size
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.padding is not None or backend.truncation is not None:
            # llguidance's own reading, which clears padding and truncation on a copy
            self.ll_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer,  # type: ignore[arg-type]  # a fast tokenizer; llguidance checks
                n_vocab=vocab_size,
                eos_token=eos or None,
            )
        elif token_bytes is not None and len(token_bytes.tokens) == vocab_size:
            first_eos = eos[0] if eos else tokenizer.eos_token_id
            encoder = _Encoder(backend, token_bytes, first_eos, tokenizer.bos_token_id)
            self.ll_tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(encoder), n_vocab=vocab_size, eos_token=eos or None
            )
        else:
            # what llguidance.hf.from_tokenizer does, without its copy of the tokenizer (to clear
            # padding and truncation, unset here): a second of pickling for a 262k vocabulary
            self.ll_tokenizer = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=vocab_size, eos_token=eos or tokenizer.eos_token_id
            )

    def token_bytes(self) -> TokenBytes:
        """The vocabulary as llguidance sees it, for a later compiler of the same tokenizer."""
        ll = self.ll_tokenizer
        ids = range(ll.vocab_size)
        return TokenBytes(
            tokens=[ll.decode_bytes([i]) for i in ids],
            special_ids=[i for i in ids if ll.is_special_token(i)],
        )

    def compile(self, spec: GrammarSpec) -> Grammar:
        """Compile `spec`, and compute its first mask (which builds the lexer) so that a grammar
        over the parser's limits fails here, not in the engine. Raises GrammarError."""
        try:
            text = llguidance_grammar(spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from exc
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0, limits=self.limits)
        if not matcher.is_error():
            bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
            fill_mask_row(matcher, bitmask, 0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Grammar(spec, matcher)
