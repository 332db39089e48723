"""Encoder-decoder models in the continuous batch (engine level): every family beamline serves,
token-exact against transformers' `generate()` of the same model, with the source's blocks shared
by beams and freed after, a source split over steps, cached under its whole source only, and rows
preempted and recomputed."""

from __future__ import annotations

import copy
import weakref
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from decoding import DecodingParams, top_k
from server.api.encoder_decoder import SourceModel
from server.engine.engine import Engine
from server.model.seq2seq import t5
from server.model.seq2seq.decoder import UnusedProjection
from server.model.seq2seq.runner import Seq2SeqRunner
from server.model.step_context import CrossStep
from server.step_plan import SourceEncode
from tests.conftest import TEST_DEVICE
from tests.engine_driver import Collected, run_to_completion, submit
from tests.tiny_seq2seq import FAMILIES, build_tiny_seq2seq

SOURCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today?",
    "Beam",
    "Once upon a time there was a little model that served many clients at once.",
]


# what the front end knows of each test engine's model (its decoder's start)
SOURCE_MODELS: weakref.WeakKeyDictionary[Engine, SourceModel] = weakref.WeakKeyDictionary()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    return {family: build_tiny_seq2seq(root / family, family) for family in FAMILIES}


def seq2seq_engine(model_dir: Path, **options: object) -> Engine:
    settings: dict = dict(num_blocks=256, block_size=4, max_num_seqs=32, batched=64)
    settings.update(options)
    runner = Seq2SeqRunner(
        model_dir,
        device=TEST_DEVICE,
        dtype=torch.float32,
        block_size=settings["block_size"],
        num_blocks=settings["num_blocks"],
        linear_layout=settings.get("linear_layout", "auto"),
        quantization=settings.get("quantization", "none"),
        compile_decode=settings.get("compile_decode", False),
        compile_cache=settings.get("compile_cache"),
    )
    runner.warm_up()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(
        runner,
        tokenizer,
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["batched"],
        enable_prefix_caching=settings.get("prefix_caching", True),
        speculative_tokens=settings.get("speculative_tokens", 0),
    )
    model = SourceModel.read(model_dir, tokenizer)
    assert model is not None
    SOURCE_MODELS[engine] = model
    return engine


def encoder_calls(engine: Engine) -> list[int]:
    """The number of sources of each encoder call the engine's runner makes from now on."""
    calls: list[int] = []
    runner = engine.runner
    assert isinstance(runner, Seq2SeqRunner)
    runner.parts.encoder.register_forward_hook(
        lambda _module, _args, kwargs, _out: calls.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    return calls


def submit_source(engine: Engine, request_id: str, source: list[int], params: DecodingParams):
    """What the front end submits: the source, then the decoder's start (encoder_decoder.py)."""
    prompt = SOURCE_MODELS[engine].job_prompt(source)
    return submit(engine, request_id, prompt, params, source_len=len(source))


def reference(model_dir: Path, source: list[int], **kwargs: object) -> list[list[int]]:
    """`generate()`'s outputs: the decoder's start taken off, each cut after its first EOS
    (what follows a finished hypothesis is padding)."""
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([source]), do_sample=False, **kwargs)
    rows = [row[1:].tolist() for row in out]
    if kwargs.get("eos_token_id", eos) is None:
        return rows
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def decode_in_one_batch(
    engine: Engine, ids: list[list[int]], params: DecodingParams
) -> list[Collected]:
    """Every source submitted, then the engine stepped until all are done (they share its
    steps)."""
    got = [submit_source(engine, str(i), s, params) for i, s in enumerate(ids)]
    run_to_completion(engine)
    return got


def assert_each_equals_generate(
    model_dir: Path, ids: list[list[int]], got: list[Collected], **kwargs: object
) -> None:
    for source, result in zip(ids, got):
        assert tokens(result) == reference(model_dir, source, **kwargs)


def sources(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(text).input_ids for text in SOURCES]


def tokens(got: Collected) -> list[list[int]]:
    return [choice[1] for choice in got.choices().values()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_in_the_batch_equals_generate(family_dirs: dict[str, Path], family: str) -> None:
    model_dir = family_dirs[family]
    engine = seq2seq_engine(model_dir)
    params = DecodingParams(max_tokens=12, temperature=0)
    ids = sources(model_dir)
    calls = encoder_calls(engine)
    got = decode_in_one_batch(engine, ids, params)  # the four requests decode in the same steps
    outputs = [tokens(g) for g in got]
    for source, output in zip(ids, outputs):  # each source's encoding unchanged by padding
        assert output == reference(model_dir, source, max_new_tokens=12)
    assert calls == [len(ids)]  # one encoder call for the four sources of different lengths
    assert len({tuple(o[0]) for o in outputs}) > 1  # the source matters
    assert engine.stats.max_seqs_in_step == len(ids)
    assert got[0].outputs[-1].prompt_tokens == len(ids[0])  # usage counts the source
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(
    ("family", "num_beams", "length_penalty", "early_stopping", "n"),
    [
        ("bart", 2, 1.0, False, 1),
        ("marian", 4, 0.0, True, 2),
        ("m2m_100", 4, -1.0, "never", 3),
        ("pegasus", 8, 2.0, False, 2),
        ("t5", 4, 1.0, True, 2),
        ("mt5", 3, 0.5, False, 1),
    ],
)
def test_beam_search_in_the_batch_equals_generate(
    family_dirs: dict[str, Path],
    family: str,
    num_beams: int,
    length_penalty: float,
    early_stopping: bool | str,
    n: int,
) -> None:
    model_dir = family_dirs[family]
    engine = seq2seq_engine(model_dir)
    params = DecodingParams(
        max_tokens=10,
        temperature=0,
        num_beams=num_beams,
        n=n,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    ids = sources(model_dir)[:3]
    got = decode_in_one_batch(engine, ids, params)
    assert_each_equals_generate(
        model_dir,
        ids,
        got,
        max_new_tokens=10,
        num_beams=num_beams,
        num_return_sequences=n,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    assert engine.stats.max_seqs_in_step == 3 * num_beams
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(("family", "num_beams"), [("marian", 4), ("t5", 8)])
def test_beam_search_with_the_two_pass_top_k_equals_generate(
    family_dirs: dict[str, Path], family: str, num_beams: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The beam step's selection over beams x vocabulary in two passes (decoding/top_k.py), which
    a real vocabulary takes, forced on the tiny one: the same beams as generate()'s."""
    monkeypatch.setattr(top_k, "MIN_LENGTH", 0)
    monkeypatch.setattr(top_k, "CANDIDATES", 64)
    monkeypatch.setattr(top_k, "MIN_CHUNK", 2)
    chunks: list[int | None] = []
    chunk_size = top_k.chunk_size
    monkeypatch.setattr(
        top_k, "chunk_size", lambda n, k: chunks.append(chunk_size(n, k)) or chunks[-1]
    )
    model_dir = family_dirs[family]
    params = DecodingParams(max_tokens=10, temperature=0, num_beams=num_beams, n=2)
    ids = sources(model_dir)[:3]
    got = decode_in_one_batch(seq2seq_engine(model_dir), ids, params)
    assert_each_equals_generate(
        model_dir, ids, got, max_new_tokens=10, num_beams=num_beams, num_return_sequences=2
    )
    assert any(chunk in (4, 8) for chunk in chunks)  # the beam steps took the two passes


@pytest.mark.cpu_only  # a CPU layout / int8 kernel
@pytest.mark.parametrize("family", ["bart", "t5", "mt5"])
@pytest.mark.parametrize("layout", ["onednn", "transposed", "measured"])
def test_the_cpu_linear_layouts_decode_as_generate(
    family_dirs: dict[str, Path], family: str, layout: str
) -> None:
    """The encoder's and the decoder's layers and the LM head in each CPU layout (T5's
    feed-forward reads the dtype of a weight these layouts keep under another name)."""
    model_dir = family_dirs[family]
    engine = seq2seq_engine(model_dir, linear_layout=layout)
    assert engine.runner.linear_layout == layout
    model = engine.runner.model
    for part in (model.get_encoder(), model.get_decoder()):
        assert not [m for m in part.modules() if type(m) is torch.nn.Linear]
    # the step projects no stand-in: each cross-attention's key and value layers are set aside
    # for the sources (in the chosen layout), zeros in their place
    parts = engine.runner.parts
    for layer, projections in zip(parts.layers, parts.source_projections, strict=True):
        attn = parts.cross_attention(layer)
        names = parts.PROJECTIONS[:2]
        assert [type(getattr(attn, name)) for name in names] == [UnusedProjection] * 2
        assert not [p for p in projections if isinstance(p, (UnusedProjection, torch.nn.Linear))]
    params = DecodingParams(max_tokens=10, temperature=0, num_beams=3, n=2)
    ids = sources(model_dir)[:2]
    got = decode_in_one_batch(engine, ids, params)
    assert_each_equals_generate(
        model_dir, ids, got, max_new_tokens=10, num_beams=3, num_return_sequences=2
    )


@pytest.mark.cpu_only  # a CPU layout / int8 kernel
@pytest.mark.parametrize("family", ["marian", "t5"])
def test_int8_formats_run_the_decoder_and_the_head_in_int8(
    family_dirs: dict[str, Path], family: str
) -> None:
    """int8 (the head, its top candidates re-scored exactly) keeps greedy's tokens; w8a8 also
    runs the decoder's layers as int8 GEMMs (q/k/v weight-only), w8a8-all every one of them,
    close enough to keep these sources' first tokens. The encoder's layers stay float, in the
    CPU layout auto takes for them, but under w8a8-all, where every layer of the model is an int8
    GEMM (as CTranslate2's int8)."""
    from server.model.quantization import (
        Int8DynamicLinear,
        Int8WeightOnlyLinear,
        RescoredInt8Head,
    )

    model_dir = family_dirs[family]
    params = DecodingParams(max_tokens=12, temperature=0)
    ids = sources(model_dir)
    outputs = {}
    encoded: dict[str, torch.Tensor] = {}
    for quantization in ("none", "int8", "w8a8", "w8a8-all"):
        engine = seq2seq_engine(model_dir, quantization=quantization)
        runner = engine.runner
        assert isinstance(runner, Seq2SeqRunner)
        assert isinstance(runner.lm_head, RescoredInt8Head) == (quantization != "none")
        decoder = list(runner.parts.decoder.modules())
        layers = [m for m in decoder if isinstance(m, Int8DynamicLinear)]
        assert bool(layers) == quantization.startswith("w8a8")
        kept = [m for m in decoder if isinstance(m, Int8WeightOnlyLinear)]
        # w8a8 keeps Marian's q_proj / k_proj / v_proj weight-only; T5 names them q, k, v
        assert bool(kept) == (quantization == "w8a8" and family == "marian")
        # the encoder float, in a CPU layout of its own choosing (auto), but under w8a8-all
        encoder = list(runner.parts.encoder.modules())
        assert not [m for m in encoder if type(m) is torch.nn.Linear]
        int8_encoder = [m for m in encoder if isinstance(m, Int8DynamicLinear)]
        assert bool(int8_encoder) == (quantization == "w8a8-all")
        if int8_encoder:  # every projection and feed-forward layer of every encoder layer
            layers = len(
                cast(Any, runner.parts.encoder).layers
                if family != "t5"
                else cast(Any, runner.parts.encoder).block
            )
            assert len(int8_encoder) == layers * 6
        with torch.inference_mode():
            encodes = [SourceEncode(r, source) for r, source in enumerate(ids)]
            encoded[quantization] = torch.cat(runner.parts.encode(encodes, torch.device("cpu")))
        got = decode_in_one_batch(engine, ids, params)
        outputs[quantization] = [tokens(g)[0] for g in got]
        assert engine.pool.num_free == engine.pool.num_blocks
    assert outputs["int8"] == outputs["none"]
    assert torch.equal(encoded["w8a8"], encoded["none"])
    # the int8 encoder's states point where the float one's do (cosine per position: above
    # 0.9996 everywhere on the benchmarks' Marian and T5-base shapes; these tiny models' few
    # channels quantize coarsely, T5's down to 0.78 at a position)
    cosine = torch.nn.functional.cosine_similarity(encoded["w8a8-all"], encoded["none"], dim=-1)
    assert float(cosine.mean()) > 0.95
    # a decoder in int8 keeps these sources' first tokens; the tiny random T5's with its encoder
    # in int8 too do not all stay (they did with its decoder alone)
    for quantization in ("w8a8", "w8a8-all") if family != "t5" else ("w8a8",):
        assert [o[0] for o in outputs[quantization]] == [o[0] for o in outputs["none"]]


@pytest.mark.cpu_only  # a CPU layout / int8 kernel
def test_an_int8_head_rescores_what_beam_steps_rank(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three beams rank each request's best 6 candidates: every step of theirs that computes
    logits asks the int8 head for RANKED_MARGIN x 6 re-scored ones (the plan's `ranked`)."""
    from server.model.quantization import RANKED_MARGIN, RescoredInt8Head

    asked: list[int] = []
    rescored = RescoredInt8Head.rescored

    def spy(head: RescoredInt8Head, ranked: int = 0) -> int:
        asked.append(ranked)
        return rescored(head, ranked)

    monkeypatch.setattr(RescoredInt8Head, "rescored", spy)
    model_dir = family_dirs["marian"]
    engine = seq2seq_engine(model_dir, quantization="int8")
    asked.clear()  # the warm-up's steps
    params = DecodingParams(max_tokens=6, num_beams=3, temperature=0)
    decode_in_one_batch(engine, sources(model_dir), params)
    assert asked and set(asked) == {6}
    assert RescoredInt8Head.rescored(cast(RescoredInt8Head, engine.runner.lm_head), 6) == (
        RANKED_MARGIN * 6
    )


@pytest.mark.parametrize("family", ["bart", "marian", "t5"])
def test_penalties_and_ngram_bans_look_at_the_decoder_tokens_as_generate_does(
    family_dirs: dict[str, Path], family: str
) -> None:
    model_dir = family_dirs[family]
    engine = seq2seq_engine(model_dir)
    params = DecodingParams(
        max_tokens=12, temperature=0, repetition_penalty=1.5, no_repeat_ngram_size=2
    )
    ids = sources(model_dir)
    got = decode_in_one_batch(engine, ids, params)
    assert_each_equals_generate(
        model_dir, ids, got, max_new_tokens=12, repetition_penalty=1.5, no_repeat_ngram_size=2
    )


@pytest.mark.parametrize(("family", "beams"), [("bart", 1), ("marian", 3)])
def test_forced_first_and_last_tokens_as_generate_forces_them(
    family_dirs: dict[str, Path], family: str, beams: int
) -> None:
    model_dir = family_dirs[family]
    engine = seq2seq_engine(model_dir)
    eos = engine.tokenizer.eos_token_id
    forced = dict(forced_bos_token_id=42, forced_eos_token_ids=(eos,))
    params = DecodingParams(max_tokens=8, temperature=0, num_beams=beams, **forced)  # type: ignore[arg-type]
    ids = sources(model_dir)
    got = decode_in_one_batch(engine, ids, params)
    assert_each_equals_generate(
        model_dir,
        ids,
        got,
        max_new_tokens=8,
        num_beams=beams,
        forced_bos_token_id=42,
        forced_eos_token_id=eos,
    )
    for result in got:
        assert all(choice[0] == 42 for choice in tokens(result))


def test_beams_share_the_source_blocks_and_give_them_all_back(
    family_dirs: dict[str, Path],
) -> None:
    model_dir = family_dirs["bart"]
    source = sources(model_dir)[3]
    peaks = {}
    for beams in (1, 4):
        engine = seq2seq_engine(model_dir, prefix_caching=False)
        params = DecodingParams(max_tokens=8, temperature=0, num_beams=beams, ignore_eos=True)
        submit_source(engine, "r", source, params)
        run_to_completion(engine)
        peaks[beams] = engine.stats.peak_blocks_used
        assert engine.pool.num_free == engine.pool.num_blocks
    source_blocks = len(source) // 4  # full blocks of the source: written once, never copied
    assert peaks[4] <= peaks[1] + 3 * (peaks[1] - source_blocks)


def test_cross_attention_reads_each_request_source_once_after_forks(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sources that end inside a block: every beam holds its own copy of that block, and still
    the step's cross-attention gathers each request's source once, its beams' queries side by
    side (CrossStep), with generate()'s beams."""
    model_dir = family_dirs["t5"]
    ids = [s for s in sources(model_dir) if len(s) % 4][:2]
    assert len(ids) == 2
    gathered: list[tuple[int, int]] = []  # (sources, queries per source) of each decode step
    build = CrossStep.build

    def spy(*args: object, **kwargs: object) -> CrossStep:
        step = build(*args, **kwargs)  # type: ignore[arg-type]
        gathered.append((step.sources.gather.shape[0], step.per_source))
        return step

    monkeypatch.setattr(CrossStep, "build", spy)
    params = DecodingParams(max_tokens=8, temperature=0, num_beams=4, ignore_eos=True)
    got = decode_in_one_batch(seq2seq_engine(model_dir, prefix_caching=False), ids, params)
    assert_each_equals_generate(
        model_dir, ids, got, max_new_tokens=8, min_new_tokens=8, num_beams=4
    )
    assert gathered[0] == (2, 1)  # the first step: one row per request, then its 4 beams
    assert len(gathered) >= 7 and set(gathered[1:]) == {(2, 4)}


def test_t5_relative_bias_is_computed_once_a_step(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5's decoder layers share one relative position bias: a decode step computes it for its
    first layer and the others reuse it, with generate()'s tokens."""
    calls: list[int] = []
    relative_bias = t5.relative_bias
    monkeypatch.setattr(
        t5,
        "relative_bias",
        lambda attention, distances: calls.append(1) or relative_bias(attention, distances),
    )
    model_dir = family_dirs["t5"]
    engine = seq2seq_engine(model_dir)
    assert len(cast(Seq2SeqRunner, engine.runner).parts.layers) == 2
    params = DecodingParams(max_tokens=6, temperature=0, num_beams=2, ignore_eos=True)
    ids = sources(model_dir)[:2]
    got = decode_in_one_batch(engine, ids, params)
    assert_each_equals_generate(
        model_dir, ids, got, max_new_tokens=6, min_new_tokens=6, num_beams=2
    )
    assert len(calls) == 6  # one a step, not one a layer


@pytest.mark.parametrize("family", ["marian", "t5"])
def test_a_source_longer_than_a_step_is_encoded_once_and_decodes_the_same(
    family_dirs: dict[str, Path], family: str
) -> None:
    """Its positions are written over several steps from one encoder output; a short source
    admitted beside it is encoded in the same call."""
    model_dir = family_dirs[family]
    long, short = sources(model_dir)[3], sources(model_dir)[2]
    assert len(long) > 12 and len(short) < 5
    engine = seq2seq_engine(model_dir, batched=8)  # the long source spans several steps
    calls = encoder_calls(engine)
    params = DecodingParams(max_tokens=10, temperature=0)
    got = [submit_source(engine, str(i), s, params) for i, s in enumerate((long, short))]
    run_to_completion(engine)
    assert tokens(got[0]) == reference(model_dir, long, max_new_tokens=10)
    assert tokens(got[1]) == reference(model_dir, short, max_new_tokens=10)
    assert calls == [1, 1] or calls == [2]  # never once per chunk
    assert engine.stats.tokens_computed == len(long) + len(short) + 2 * (1 + 9)
    runner = engine.runner
    assert isinstance(runner, Seq2SeqRunner) and not runner._encoded  # nothing kept after


def test_the_prefix_cache_shares_a_source_only_whole(family_dirs: dict[str, Path]) -> None:
    """An identical source's blocks are reused; a source that only begins the same is encoded
    anew (the encoder reads it both ways: its first positions' keys and values differ)."""
    model_dir = family_dirs["bart"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = tokenizer("The quick brown fox jumps over the lazy dog. Hello").input_ids
    other = tokenizer("The quick brown fox jumps over the lazy dog. Once").input_ids
    assert first[:8] == other[:8] and first != other
    engine = seq2seq_engine(model_dir)
    params = DecodingParams(max_tokens=6, temperature=0)
    results = []
    for i, source in enumerate([first, first, other]):
        results.append(submit_source(engine, str(i), source, params))
        run_to_completion(engine)
    cached = [r.outputs[-1].cached_tokens for r in results]
    assert cached[0] == 0 and cached[1] >= 8 and cached[2] == 0
    for source, result in zip([first, first, other], results):
        assert tokens(result) == reference(model_dir, source, max_new_tokens=6)


@pytest.mark.parametrize("family", ["m2m_100", "t5"])
def test_preempted_rows_are_encoded_again_and_decode_the_same(
    family_dirs: dict[str, Path], family: str
) -> None:
    """A preempted row resumes as a chunk of its decoder tokens (T5: its relative bias over
    several queries at once)."""
    model_dir = family_dirs[family]
    ids = sources(model_dir)
    engine = seq2seq_engine(model_dir, num_blocks=24, prefix_caching=False)
    calls = encoder_calls(engine)
    params = DecodingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = decode_in_one_batch(engine, ids, params)
    assert engine.stats.preemptions > 0
    assert sum(calls) > len(ids)  # a preempted row's source is encoded again
    assert_each_equals_generate(
        model_dir, ids, got, max_new_tokens=16, min_new_tokens=16, eos_token_id=None
    )
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_mixed_batch_gives_each_request_its_solo_tokens(family_dirs: dict[str, Path]) -> None:
    """Greedy, seeded sampling, beams, best_of, group beams and beam sampling in one batch."""
    model_dir = family_dirs["mbart"]
    ids = sources(model_dir) + sources(model_dir)[:2]  # six requests, one per strategy
    strategies = [
        DecodingParams(max_tokens=8, temperature=0),
        DecodingParams(max_tokens=8, temperature=0.9, seed=3, n=2),
        DecodingParams(max_tokens=8, temperature=0, num_beams=3, n=2),
        DecodingParams(max_tokens=8, temperature=0.7, top_k=20, seed=5, best_of=3, n=2),
        DecodingParams(
            max_tokens=8, temperature=0, num_beams=4, num_beam_groups=2, diversity_penalty=1.0
        ),
        DecodingParams(max_tokens=8, num_beams=3, do_sample=True, seed=7, n=2),
    ]
    solo = []
    for i, (source, params) in enumerate(zip(ids, strategies)):
        engine = seq2seq_engine(model_dir)
        solo.append(submit_source(engine, str(i), source, params))
        run_to_completion(engine)
    engine = seq2seq_engine(model_dir)
    mixed = [submit_source(engine, str(i), s, p) for i, (s, p) in enumerate(zip(ids, strategies))]
    run_to_completion(engine)
    assert [tokens(m) for m in mixed] == [tokens(s) for s in solo]
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("family", ["marian", "t5"])
def test_logprobs_are_the_models_own(family_dirs: dict[str, Path], family: str) -> None:
    """Each output token's logprob and top alternatives: the log-softmax of `generate()`'s raw
    logits at that step."""
    model_dir = family_dirs[family]
    source = sources(model_dir)[0]
    engine = seq2seq_engine(model_dir)
    params = DecodingParams(max_tokens=6, temperature=0, logprobs=2)
    got = submit_source(engine, "r", source, params)
    run_to_completion(engine)
    logprobs = [lp for out in got.outputs for lp in out.logprobs or []]
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([source]),
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert [lp.token_id for lp in logprobs] == out.sequences[0, 1:].tolist()
    for lp, logits in zip(logprobs, out.logits):
        expected = logits[0].float().log_softmax(-1)
        assert lp.logprob == pytest.approx(expected[lp.token_id].item(), abs=1e-4)
        top = expected.topk(2)
        assert [t for t, _ in lp.top] == top.indices.tolist()


def test_a_decode_step_gathers_each_rows_source_and_decoder_positions_apart() -> None:
    """Self-attention reads a row's decoder positions only, cross-attention its source only:
    each gathered once, as wide as its longest part (not the whole row twice)."""
    from server.model.packing import slots
    from server.model.step_context import DecodeStep

    tables, lengths, sources = [[3, 7, 2], [5, 1]], [11, 6], [7, 2]  # blocks of 4 positions
    own = DecodeStep.build(tables, lengths, 4, torch.device("cpu"), first=sources)
    cross = DecodeStep.build(tables, sources, 4, torch.device("cpu"))
    assert own.lengths.view(-1).tolist() == [4, 4] and own.gather.shape == (2, 4)
    assert cross.lengths.view(-1).tolist() == [7, 2] and cross.gather.shape == (2, 7)
    for row, (table, length, source) in enumerate(zip(tables, lengths, sources)):
        assert (
            own.gather[row, : length - source].tolist() == slots(table, source, length, 4).tolist()
        )
        assert cross.gather[row, :source].tolist() == slots(table, 0, source, 4).tolist()
        assert int(own.slot_mapping[row]) == int(slots(table, length - 1, length, 4))


@pytest.mark.parametrize("family", ["t5", "marian", "m2m_100"])
def test_n_gram_drafts_leave_greedy_and_seeded_tokens_unchanged(
    family_dirs: dict[str, Path], family: str
) -> None:
    """Drafts come from the row's own tokens, its source's included (prompt lookup); the tiny
    models repeat themselves, so drafts are accepted. Greedy rows give generate()'s tokens,
    seeded ones the tokens they give without drafts, beams run beside them undrafted."""
    model_dir = family_dirs[family]
    ids = sources(model_dir)
    greedy = DecodingParams(max_tokens=24, temperature=0)
    seeded = DecodingParams(max_tokens=24, temperature=0.8, seed=3)
    beams = DecodingParams(max_tokens=8, num_beams=3, temperature=0)

    def run(speculative_tokens: int) -> tuple[Engine, list[Collected]]:
        engine = seq2seq_engine(model_dir, speculative_tokens=speculative_tokens)
        got = [submit_source(engine, f"g{i}", s, greedy) for i, s in enumerate(ids)]
        got.append(submit_source(engine, "s", ids[0], seeded))
        got.append(submit_source(engine, "b", ids[1], beams))
        run_to_completion(engine)
        return engine, got

    drafting, drafted = run(4)
    _, plain = run(0)
    for source, result in zip(ids, drafted):
        assert tokens(result) == reference(model_dir, source, max_new_tokens=24)
    assert [tokens(g) for g in drafted] == [tokens(g) for g in plain]
    assert drafting.stats.spec_accepted_tokens > 0
    assert drafting.pool.num_free == drafting.pool.num_blocks


def test_a_stack_with_its_own_config_copy_attends_over_the_pool_too(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.17 (the GPU image's) gives T5's decoder stack a copy of the config, which
    its `set_attn_implementation` does not reach: the layers attended with SDPA over the step's
    own tokens. Binding the pool sets every copy (5.17's behaviour stood in for here)."""
    model_dir = family_dirs["mt5"]
    engine = seq2seq_engine(model_dir)
    runner = engine.runner
    model = runner.model
    copied = copy.deepcopy(model.config)
    copied._attn_implementation = "sdpa"
    for module in model.get_decoder().modules():
        if hasattr(module, "config"):
            module.config = copied

    def top_config_only(name: str) -> None:
        model.config._attn_implementation = name

    monkeypatch.setattr(model, "set_attn_implementation", top_config_only)
    runner.attention.bind(model, runner.kv_cache)
    assert copied._attn_implementation == runner.attention.name
    ids = sources(model_dir)[:2]
    got = decode_in_one_batch(engine, ids, DecodingParams(max_tokens=8, temperature=0))
    assert_each_equals_generate(model_dir, ids, got, max_new_tokens=8)
