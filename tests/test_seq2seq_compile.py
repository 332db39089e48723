"""The compiled decode step of encoder-decoder models (`--torch-compile`): `generate()`'s tokens
with every steady step through its graphs (one row; many rows on one source or on several), no
recompile after warm-up, and the graphs loaded from the cache at a later start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding import DecodingParams
from server.engine.engine import Engine
from server.model.attention import _attend_decode
from server.model.seq2seq.runner import Seq2SeqRunner
from server.model.step_context import CrossStep, DecodeStep
from tests.engine_driver import Counted
from tests.test_seq2seq_engine import (
    assert_each_equals_generate,
    decode_in_one_batch,
    family_dirs,  # noqa: F401  (a fixture)
    seq2seq_engine,
    sources,
)

BLOCK = 4


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("seq2seq-compiled")


def counting(runner: Seq2SeqRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each step that runs through the compiled graphs."""
    compiled = runner.compiled
    assert compiled is not None
    rows: list[int] = []

    def counted(input_ids: torch.Tensor, *rest: object) -> torch.Tensor:
        rows.append(input_ids.shape[1])
        return compiled(input_ids, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "compiled", counted)
    return rows


@pytest.mark.parametrize("family", ["marian", "t5"])
def test_compiled_steps_give_generates_tokens_alone_and_in_a_batch(
    family_dirs: dict[str, Path],  # noqa: F811
    compile_cache: Path,
    family: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = family_dirs[family]
    engine = seq2seq_engine(model_dir, compile_decode=True, compile_cache=compile_cache)
    runner = engine.runner
    assert isinstance(runner, Seq2SeqRunner) and runner.compiled is not None
    compiled = runner.compiled
    assert compiled.source == "compiled"
    rows = counting(runner, monkeypatch)
    ids = sources(model_dir)
    greedy = DecodingParams(max_tokens=8, min_tokens=8, temperature=0)
    beams = DecodingParams(max_tokens=8, min_tokens=8, temperature=0, num_beams=4)
    with torch._dynamo.config.patch(error_on_recompile=True):
        alone = decode_in_one_batch(engine, ids[:1], greedy)  # one row
        several = decode_in_one_batch(engine, ids, greedy)  # a row per source
        one_source = decode_in_one_batch(engine, ids[1:2], beams)  # four rows on one source
        beamed = decode_in_one_batch(engine, ids, beams)
    assert_each_equals_generate(model_dir, ids[:1], alone, max_new_tokens=8, min_new_tokens=8)
    assert_each_equals_generate(model_dir, ids, several, max_new_tokens=8, min_new_tokens=8)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, num_beams=4)
    assert_each_equals_generate(model_dir, ids[1:2], one_source, **kwargs)
    assert_each_equals_generate(model_dir, ids, beamed, **kwargs)
    # every step past each row's first decoder token: 7 of 8, in each of the four runs
    assert len(rows) == 4 * 7 and {1, len(ids), 4, 4 * len(ids)} <= set(rows)
    assert compiled.fallbacks == 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_later_start_loads_the_compiled_step(
    family_dirs: dict[str, Path],  # noqa: F811
    compile_cache: Path,
) -> None:
    model_dir = family_dirs["marian"]
    first = seq2seq_engine(model_dir, compile_decode=True, compile_cache=compile_cache)
    later = seq2seq_engine(model_dir, compile_decode=True, compile_cache=compile_cache)
    assert isinstance(first.runner, Seq2SeqRunner) and first.runner.compiled is not None
    assert isinstance(later.runner, Seq2SeqRunner) and later.runner.compiled is not None
    assert first.runner.compiled.source in ("compiled", "loaded")
    assert later.runner.compiled.source == "loaded"
    ids = sources(model_dir)
    params = DecodingParams(max_tokens=6, min_tokens=6, temperature=0, num_beams=2)
    got = decode_in_one_batch(later, ids, params)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, num_beams=2)
    assert_each_equals_generate(model_dir, ids, got, **kwargs)
    assert later.runner.compiled.fallbacks == 0


@pytest.mark.parametrize(
    ("tables", "lengths"),
    [
        ([[3, 7, 2]], [6]),  # one row
        ([[3, 7, 2], [3, 7, 9], [3, 7, 4]], [6, 6, 6]),  # one source, three rows
        ([[3, 7, 2], [5, 1], [0, 6]], [6, 5, 3]),  # a row per source
    ],
)
def test_padded_cross_attention_equals_the_unpadded(
    tables: list[list[int]], lengths: list[int]
) -> None:
    """Padding (a second copy of a lone source, a second slot for sources of one row) changes
    no row's attention beyond float rounding (attention runs over more queries), and leaves no
    dimension of size one where there are several rows."""
    torch.manual_seed(0)
    heads, dim = 2, 8
    k_pool, v_pool = torch.randn(2, 10 * BLOCK, heads, dim).unbind(0)
    q = torch.randn(len(tables), heads, dim)
    results = []
    for padded in (False, True):
        step = DecodeStep.build(tables, lengths, BLOCK, torch.device("cpu"))
        step.cross = CrossStep.build(tables, lengths, BLOCK, torch.device("cpu"), padded=padded)
        if padded and len(tables) > 1:
            assert min(step.cross.slot_rows.shape) >= 2
        results.append(_attend_decode(q, k_pool, v_pool, step, None, 0.3, None, cross=True))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_steps_the_graphs_do_not_take_run_eagerly(
    family_dirs: dict[str, Path],  # noqa: F811
    compile_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step with a row at its decoder's first token (a context of one position) or a chunk
    of a source runs eagerly, next to compiled steps, with generate()'s tokens."""
    model_dir = family_dirs["marian"]
    engine: Engine = seq2seq_engine(
        model_dir, compile_decode=True, compile_cache=compile_cache, batched=8
    )
    assert isinstance(engine.runner, Seq2SeqRunner)
    rows = counting(engine.runner, monkeypatch)
    every_step = Counted(engine.runner._run_decoder)
    monkeypatch.setattr(engine.runner, "_run_decoder", every_step)
    ids = sources(model_dir)
    params = DecodingParams(max_tokens=6, min_tokens=6, temperature=0, num_beams=2)
    got = decode_in_one_batch(engine, ids, params)  # 8 tokens a step: sources over steps
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, num_beams=2)
    assert_each_equals_generate(model_dir, ids, got, **kwargs)
    assert 0 < len(rows) < every_step.calls  # some steps compiled, the others not
