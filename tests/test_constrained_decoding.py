"""Constrained decoding (decoding/constraints.py, decoding/grammar.py) against Hugging Face
`generate(prefix_allowed_tokens_fn=...)` driven by the same grammar, and inside the engine.

The reference's allowed-token function replays a fresh constraint over each row's generated
tokens and answers the tokens our mask allows, so both sides see the same sets; HF applies them
as its `PrefixConstrainedLogitsProcessor` does (after `log_softmax` for beams).
"""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoding import DecodingParams, SamplingTensors, make_beam_search, process_logits
from decoding.constraints import (
    NO_LEGAL_TOKEN,
    ForcedPrefix,
    TokenConstraint,
    banned_on_device,
    build_constraint_mask,
    unpack_bitmask,
)
from decoding.grammar import Grammar, GrammarCompiler, GrammarConstraint, GrammarSpec
from server.engine.engine import Engine
from server.engine.request import EngineRequest
from tests.conftest import make_engine
from tests.engine_driver import Collected, run_to_completion

EOS = 2
EOS_IDS = frozenset({EOS})
PROMPTS = ["Hello world! How are you", "The quick brown fox", "Once upon a time there was"]
# A grammar the random tiny model can finish in a few tokens, with real choices on the way.
ANSWER_REGEX = r"(yes|no|maybe)(, (fox|dog|bird)){0,3}!"
SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["fox", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["animal", "count"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's matmuls are too small to split
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: object) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), EOS_IDS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(llama_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def allowed_ids(constraint: TokenConstraint, params: DecodingParams, vocab: int) -> list[int]:
    mask = build_constraint_mask(
        [constraint], [params.finishing_ids(EOS_IDS)], EOS_IDS, vocab, "cpu"
    )
    assert mask is not None
    return (~mask.banned[0]).nonzero().flatten().tolist()


def prefix_fn(
    new_constraint: Callable[[], TokenConstraint],
    params: DecodingParams,
    prompt_len: int,
    vocab: int,
) -> Callable[[int, torch.Tensor], list[int]]:
    """HF's prefix_allowed_tokens_fn: replay the row's generated tokens, answer our mask."""

    def allowed(_batch_id: int, input_ids: torch.Tensor) -> list[int]:
        constraint = new_constraint()
        for token in input_ids[prompt_len:].tolist():
            assert constraint.advance(token)
        return allowed_ids(constraint, params, vocab)

    return allowed


@torch.no_grad()
def hf_generate(model: torch.nn.Module, prompt: list[int], **kw: object) -> object:
    ids = torch.tensor([prompt])
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        return_dict_in_generate=True,
        output_scores=True,
        **kw,
    )


def cut_at_eos(row: list[int]) -> list[int]:
    return row[: row.index(EOS) + 1] if EOS in row else row


def ours_beams(
    model: torch.nn.Module,
    params: DecodingParams,
    prompt: list[int],
    constraint: TokenConstraint,
) -> list[tuple[list[int], float]]:
    """The engine's beam loop in miniature: one constraint state per row, forked with it."""
    vocab = model.config.vocab_size
    search = make_beam_search(params, EOS_IDS)
    rows: list[list[int]] = [[]]
    states = [constraint]
    finishing = params.finishing_ids(EOS_IDS)
    while not search.done:
        n = len(rows)
        mask = build_constraint_mask(states, [finishing] * n, EOS_IDS, vocab, "cpu")
        t = SamplingTensors.from_rows(
            [params] * n, [prompt] * n, rows, EOS_IDS, vocab, "cpu", constraint=mask
        )
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + r for r in rows])).logits[:, -1]
        step = search.step(process_logits(logits, t))
        rows = [rows[p] + [tok] for p, tok in zip(step.parents, step.tokens)]
        states = [states[p].fork() for p in step.parents]
        for state, token in zip(states, step.tokens):
            assert state.advance(token)
    return [(h.token_ids, h.score) for h in search.finalize()]


# ---- the mask itself ----------------------------------------------------------------------------
def test_unpack_bitmask_reads_llguidance_bit_order() -> None:
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[0, 1] = -(1 << 31)  # bit 31 of word 1: token 63
    bitmask[1] = -1
    allowed = unpack_bitmask(bitmask, 60)
    assert allowed[0].nonzero().flatten().tolist() == [3]  # token 63 is past the vocabulary
    assert allowed[1].all()


def test_the_device_unpacks_the_bits_as_the_host_does() -> None:
    """On a GPU the packed words cross and the device unpacks them: the same bans, bit 31 (a
    negative int32) and a vocabulary that ends inside a word included."""
    words = torch.randint(
        -(2**31), 2**31, (5, 9), dtype=torch.int64, generator=torch.Generator().manual_seed(3)
    )
    bitmask = words.to(torch.int32)
    bitmask[1] = -1
    bitmask[2] = 0
    bitmask[3, 4] = -(2**31)
    for vocab in (9 * 32, 9 * 32 - 5):
        assert torch.equal(banned_on_device(bitmask, vocab), ~unpack_bitmask(bitmask, vocab))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_step_s_mask_goes_to_its_device_as_packed_words(device: str) -> None:
    """The bans of a forced prefix, an accepting one and `allowed_token_ids` rows, each with its
    endings: the same on the host's path and the device's, and what the device gets is the
    int32 words (V / 8 bytes a row), not a bool per token ("meta" stands in for a GPU)."""
    vocab = 200
    constraints = [ForcedPrefix([70]), ForcedPrefix([5], position=1), None, None]
    finishing = [frozenset({EOS, 9}), frozenset({EOS, 9}), frozenset({EOS}), frozenset({EOS})]
    allowed = [None, None, (3, 4, 63, 199, 500), None]
    copies: list[tuple[torch.dtype, tuple[int, ...]]] = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket == torch.ops.aten._to_copy and (kwargs or {}).get("device"):
                copies.append((args[0].dtype, tuple(args[0].shape)))
            return func(*args, **(kwargs or {}))

    with Copies():
        mask = build_constraint_mask(constraints, finishing, EOS_IDS, vocab, device, allowed)
    assert mask is not None and mask.runs == [(0, 3)] and mask.banned.shape == (3, vocab)
    if device == "meta":
        assert copies == [(torch.int32, (3, 7))]  # ceil(200 / 32) words a row
        return
    allowed_rows = [(~row).nonzero().flatten().tolist() for row in mask.banned]
    assert allowed_rows[0] == [70]  # the prefix's token; no ending before it is complete
    assert set(allowed_rows[1]) == set(range(vocab))  # complete: anything, the endings too
    assert allowed_rows[2] == [3, 4, 63, 199]  # only its listed ids (an EOS it does not list: no)


def test_endings_are_allowed_exactly_where_the_grammar_is_complete(
    compiler: GrammarCompiler, tokenizer: object
) -> None:
    grammar = compiler.compile(GrammarSpec("regex", "ab?"))
    params = DecodingParams(stop_token_ids=(7,))
    vocab = compiler.vocab_size
    state = grammar.new_constraint()
    first = allowed_ids(state, params, vocab)
    assert EOS not in first and 7 not in first and first
    (a,) = tokenizer("a", add_special_tokens=False).input_ids  # type: ignore[operator]
    assert state.advance(a) and state.accepting
    assert {EOS, 7} <= set(allowed_ids(state, params, vocab))
    ignoring = DecodingParams(ignore_eos=True)  # EOS is not an ending: never allowed
    assert EOS not in allowed_ids(state, ignoring, vocab)


# ---- parity with HF generate(prefix_allowed_tokens_fn) ------------------------------------------
def run_constrained(
    llama_dir: Path, tokenizer: object, grammar: Grammar, params: DecodingParams
) -> tuple[list[list[int]], list[Collected], Engine]:
    """Every prompt of PROMPTS under `grammar`, all in the same engine steps."""
    engine = make_engine(llama_dir)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]  # type: ignore[operator]
    got = [submit(engine, str(i), p, params, grammar) for i, p in enumerate(prompts)]
    run_to_completion(engine)
    return prompts, got, engine


def spec_of(kind: str) -> GrammarSpec:
    return (
        GrammarSpec("regex", ANSWER_REGEX) if kind == "regex" else GrammarSpec.json_schema(SCHEMA)
    )


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_constrained_greedy_equals_hf(
    model: torch.nn.Module, compiler: GrammarCompiler, tokenizer: object, llama_dir: Path, kind: str
) -> None:
    grammar = compiler.compile(spec_of(kind))
    params = DecodingParams(max_tokens=40, temperature=0)
    prompts, got, engine = run_constrained(llama_dir, tokenizer, grammar, params)
    vocab = model.config.vocab_size
    for prompt, result in zip(prompts, got):
        out = hf_generate(
            model,
            prompt,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            prefix_allowed_tokens_fn=prefix_fn(grammar.new_constraint, params, len(prompt), vocab),
        )
        assert result.token_ids == cut_at_eos(out.sequences[0, len(prompt) :].tolist())
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_constrained_beam_search_equals_hf_tokens_and_scores(
    model: torch.nn.Module, compiler: GrammarCompiler, tokenizer: object, llama_dir: Path, kind: str
) -> None:
    grammar = compiler.compile(spec_of(kind))
    params = DecodingParams(max_tokens=40, num_beams=4, n=3, length_penalty=0.5)
    vocab = model.config.vocab_size
    prompts, got, engine = run_constrained(llama_dir, tokenizer, grammar, params)
    for prompt, result in zip(prompts, got):
        out = hf_generate(
            model,
            prompt,
            do_sample=False,
            num_beams=params.num_beams,
            num_return_sequences=params.n,
            length_penalty=params.length_penalty,
            max_new_tokens=params.max_tokens,
            prefix_allowed_tokens_fn=prefix_fn(grammar.new_constraint, params, len(prompt), vocab),
        )
        expected = [cut_at_eos(r) for r in out.sequences[:, len(prompt) :].tolist()]
        assert [c[1] for c in result.choices().values()] == expected
        ours = ours_beams(model, params, prompt, grammar.new_constraint())
        assert [tokens for tokens, _ in ours] == expected
        torch.testing.assert_close(
            torch.tensor([s for _, s in ours]), out.sequences_scores, rtol=1e-5, atol=1e-5
        )
        if kind == "regex":  # every hypothesis is a complete answer
            for tokens in expected:
                text = tokenizer.decode(tokens, skip_special_tokens=True)  # type: ignore[attr-defined]
                assert tokens[-1] == EOS and re.fullmatch(ANSWER_REGEX, text)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_forced_prefix_beam_search_scores_the_prefix_as_output(
    model: torch.nn.Module, tokenizer: object
) -> None:
    """fairseq's prefix_tokens: every hypothesis begins with the given tokens, which count in
    its length and score, equal to HF with an allowed-token function that forces them."""
    prompt = tokenizer(PROMPTS[1]).input_ids  # type: ignore[operator]
    prefix = tokenizer(" jumps over", add_special_tokens=False).input_ids  # type: ignore[operator]
    params = DecodingParams(max_tokens=8, num_beams=4, n=4, length_penalty=1.0)
    vocab = model.config.vocab_size

    def forced(_batch_id: int, input_ids: torch.Tensor) -> list[int]:
        done = len(input_ids) - len(prompt)
        return [prefix[done]] if done < len(prefix) else list(range(vocab))

    out = hf_generate(
        model,
        prompt,
        do_sample=False,
        num_beams=4,
        num_return_sequences=4,
        max_new_tokens=8,
        prefix_allowed_tokens_fn=forced,
    )
    ours = ours_beams(model, params, prompt, ForcedPrefix(prefix))
    expected = [cut_at_eos(r) for r in out.sequences[:, len(prompt) :].tolist()]
    assert [tokens for tokens, _ in ours] == expected
    assert all(tokens[: len(prefix)] == prefix for tokens in expected)
    torch.testing.assert_close(
        torch.tensor([s for _, s in ours]), out.sequences_scores, rtol=1e-5, atol=1e-5
    )


# ---- inside the engine --------------------------------------------------------------------------
def submit(
    engine: Engine,
    request_id: str,
    prompt: list[int],
    params: DecodingParams,
    grammar: Grammar | None = None,
) -> Collected:
    got = Collected()
    constraint = grammar.new_constraint() if grammar is not None else None
    engine.submit(
        EngineRequest(request_id, list(prompt), params, got.outputs.append, constraint=constraint)
    )
    return got


STRATEGY_PARAMS = {
    "greedy": DecodingParams(max_tokens=40, temperature=0),
    "sample": DecodingParams(max_tokens=40, temperature=1.0, seed=3),
    "n": DecodingParams(max_tokens=40, temperature=1.0, n=3, seed=4),
    "best_of": DecodingParams(max_tokens=40, temperature=1.0, n=2, best_of=4, seed=5),
    "beam": DecodingParams(max_tokens=40, num_beams=3, n=3),
    "beam_sample": DecodingParams(max_tokens=40, num_beams=3, n=2, do_sample=True, seed=6),
    "group_beam": DecodingParams(
        max_tokens=40, num_beams=4, num_beam_groups=2, diversity_penalty=1.0, n=4
    ),
}


def test_every_strategy_keeps_the_constraint_and_a_busy_batch_changes_nothing(
    compiler: GrammarCompiler, tokenizer: object, llama_dir: Path
) -> None:
    """Each strategy under a grammar gives only complete answers, and the same ones alone as
    inside a batch that mixes constrained and unconstrained rows of every strategy."""
    grammar = compiler.compile(GrammarSpec("regex", ANSWER_REGEX))
    prompt = tokenizer(PROMPTS[2]).input_ids  # type: ignore[operator]
    solo = {}
    for name, params in STRATEGY_PARAMS.items():
        engine = make_engine(llama_dir)
        got = submit(engine, name, prompt, params, grammar)
        run_to_completion(engine)
        solo[name] = got.choices()
    engine = make_engine(llama_dir, max_num_seqs=64)
    mixed = {
        name: submit(engine, name, prompt, params, grammar)
        for name, params in STRATEGY_PARAMS.items()
    }
    free = {  # the same strategies unconstrained, in the same steps
        name: submit(engine, f"free-{name}", prompt, params)
        for name, params in STRATEGY_PARAMS.items()
    }
    run_to_completion(engine)
    for name, params in STRATEGY_PARAMS.items():
        choices = mixed[name].choices()
        assert choices == solo[name], name
        assert len(choices) == params.n
        for text, _, reason in choices.values():
            assert reason == "stop" and re.fullmatch(ANSWER_REGEX, text), (name, text, reason)
        assert all(c[2] in ("stop", "length") for c in free[name].choices().values())
    assert engine.pool.num_free == engine.pool.num_blocks


def test_no_legal_token_ends_the_row_with_its_own_reason(
    compiler: GrammarCompiler, tokenizer: object, llama_dir: Path
) -> None:
    grammar = compiler.compile(GrammarSpec("regex", "(yes|no)!"))
    prompt = tokenizer(PROMPTS[0]).input_ids  # type: ignore[operator]
    vocab = compiler.vocab_size
    state = grammar.new_constraint()
    firsts = allowed_ids(state, DecodingParams(), vocab)
    bias = {t: -100.0 for t in firsts}  # finite: not a ban
    ban_all = DecodingParams(max_tokens=8, temperature=0, bad_words_ids=tuple((t,) for t in firsts))
    engine = make_engine(llama_dir)
    dead = submit(engine, "dead", prompt, ban_all, grammar)
    beam_ban = DecodingParams(max_tokens=8, num_beams=2, bad_words_ids=ban_all.bad_words_ids)
    beams = submit(engine, "beams", prompt, beam_ban, grammar)
    bias_all = DecodingParams(max_tokens=8, temperature=0, logit_bias=bias)
    biased = submit(engine, "biased", prompt, bias_all, grammar)
    no_eos = DecodingParams(max_tokens=8, temperature=0, ignore_eos=True)
    complete = submit(engine, "complete", prompt, no_eos, grammar)  # done, and EOS is ignored
    run_to_completion(engine)
    assert dead.choices() == {0: ("", [], NO_LEGAL_TOKEN)}
    assert [c[2] for c in beams.choices().values()] == [NO_LEGAL_TOKEN]
    assert biased.finish_reason == "stop" and re.fullmatch("(yes|no)!", biased.text)
    assert complete.finish_reason == "stop" and re.fullmatch("(yes|no)!", complete.text)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_aborts_free_blocks_and_matchers(
    compiler: GrammarCompiler, tokenizer: object, llama_dir: Path
) -> None:
    grammar = compiler.compile(GrammarSpec("regex", "[a-z ]{1,200}"))
    prompt = tokenizer(PROMPTS[1]).input_ids  # type: ignore[operator]
    engine = make_engine(llama_dir)
    live: list[weakref.ref[GrammarConstraint]] = []
    for name, params in STRATEGY_PARAMS.items():
        state = grammar.new_constraint()
        live.append(weakref.ref(state))
        got = Collected()
        engine.submit(
            EngineRequest(name, list(prompt), params, got.outputs.append, constraint=state)
        )
        del state
    for _ in range(4):
        engine.step()
    for name in STRATEGY_PARAMS:
        engine.abort(name)
    engine.step()
    gc.collect()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.num_running == engine.num_waiting == 0
    assert [ref() for ref in live] == [None] * len(live)  # every row's matcher is gone


def test_preempted_constrained_rows_resume_where_they_were(
    compiler: GrammarCompiler, tokenizer: object, llama_dir: Path
) -> None:
    grammar = compiler.compile(GrammarSpec("regex", ANSWER_REGEX))
    prompts = [tokenizer(p).input_ids for p in PROMPTS]  # type: ignore[operator]
    params = DecodingParams(max_tokens=40, num_beams=2, n=2)
    roomy = make_engine(llama_dir)
    expected = [submit(roomy, str(i), p, params, grammar) for i, p in enumerate(prompts)]
    run_to_completion(roomy)
    tight = make_engine(llama_dir, num_blocks=24)
    got = [submit(tight, str(i), p, params, grammar) for i, p in enumerate(prompts)]
    run_to_completion(tight)
    assert tight.stats.preemptions > 0
    assert [g.choices() for g in got] == [e.choices() for e in expected]


@pytest.mark.parametrize("padded", [False, True])
def test_the_grammar_tokenizer_is_llguidances_own_view_of_the_tokenizer(
    llama_dir: Path, padded: bool
) -> None:
    """GrammarCompiler reads the tokenizer without llguidance's copy when no padding or
    truncation is set (the copy only clears them): the same tokens, EOS and masks either way."""
    import llguidance.hf

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    if padded:  # llguidance's own path, which clears them on a copy
        tokenizer.backend_tokenizer.enable_padding(length=16)
    ours = GrammarCompiler(tokenizer, len(tokenizer), EOS_IDS).ll_tokenizer
    theirs = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[EOS])
    for text in ("Hello world! How are you", " leading space", '\n\t{"a": [1, 2]}', "日本"):
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert ours.eos_tokens == theirs.eos_tokens == [EOS]
    assert ours.vocab_size == theirs.vocab_size
    assert [ours.decode_bytes([i]) for i in range(len(tokenizer))] == [
        theirs.decode_bytes([i]) for i in range(len(tokenizer))
    ]
    assert (tokenizer.backend_tokenizer.padding is not None) == padded  # ours left it alone


@pytest.mark.parametrize("extra", [0, 61])  # a model whose embedding rows outnumber the tokens
def test_a_compiler_given_the_vocabularys_bytes_sees_and_masks_as_llguidance_does(
    llama_dir: Path, extra: int
) -> None:
    """The bytes a compiler returns build the next one without llguidance reading tokenizer.json:
    the same tokens, specials, tokenizations and masks, with padded vocabularies too."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    size = len(tokenizer) + extra
    read = GrammarCompiler(tokenizer, size, EOS_IDS)
    token_bytes = read.token_bytes()
    assert len(token_bytes.tokens) == size and token_bytes.special_ids  # <s>, </s>, <unk>
    given = GrammarCompiler(tokenizer, size, EOS_IDS, token_bytes=token_bytes)
    ours, theirs = given.ll_tokenizer, read.ll_tokenizer
    assert ours.dbg_tokens(list(range(size))) == theirs.dbg_tokens(list(range(size)))
    special = [i for i in range(size) if ours.is_special_token(i)]
    assert special == [i for i in range(size) if theirs.is_special_token(i)] != []
    assert ours.eos_tokens == theirs.eos_tokens == [EOS]
    assert ours.vocab_size == theirs.vocab_size == size
    for text in ("Hello world! How are you", " leading space", '\n\t{"a": [1]}', "日本</s>"):
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
        assert ours.tokenize_str(text, parse_special=True) == theirs.tokenize_str(
            text, parse_special=True
        )
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    rows = [c.compile(spec).new_constraint() for c in (given, read)]
    for token in [*tokenizer.encode('{"n": 42}', add_special_tokens=False), None]:
        masks = torch.zeros((2, (size + 31) // 32), dtype=torch.int32)
        for index, row in enumerate(rows):
            row.fill_allowed(masks, index)
        assert torch.equal(masks[0], masks[1]) and masks[0].any()
        if token is not None:
            assert all(row.advance(token) for row in rows)
    assert all(row.accepting for row in rows)
    short = type(token_bytes)(token_bytes.tokens[:-1], token_bytes.special_ids)
    # bytes of another vocabulary are not used: llguidance reads the tokenizer again
    fallback = GrammarCompiler(tokenizer, size, EOS_IDS, token_bytes=short).ll_tokenizer
    assert fallback.dbg_tokens(list(range(size))) == theirs.dbg_tokens(list(range(size)))
