"""Whisper in the continuous batch (engine level): a tiny random Whisper's windows decoded with
other windows in the same steps, token-exact against transformers' `generate()` of the same
model: greedy and beams, the generation config's suppressed tokens applied, the audio's
encoder run once per window and every block freed after."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import WhisperForConditionalGeneration

from server.engine.engine import Engine
from server.model.seq2seq.runner import Seq2SeqRunner
from tests.conftest import TEST_DEVICE
from tests.engine_driver import Collected, run_to_completion
from tests.tiny_whisper import build_tiny_whisper
from tests.whisper_jobs import submit_window, window_params


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny")


def whisper_engine(model_dir: Path) -> Engine:
    from transformers import AutoTokenizer

    runner = Seq2SeqRunner(
        model_dir, device=TEST_DEVICE, dtype=torch.float32, block_size=16, num_blocks=1024
    )
    runner.warm_up()
    return Engine(
        runner,
        AutoTokenizer.from_pretrained(model_dir),
        max_num_seqs=32,
        max_num_batched_tokens=4096,
    )


def windows(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(80, 3000, generator=generator) for _ in range(count)]


def reference(model_dir: Path, features: torch.Tensor, **kwargs: object) -> list[list[int]]:
    """`generate()`'s tokens after the decoder's prompt, each cut after its first EOS."""
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(features[None], **kwargs)
    rows = [row.tolist() for row in out]
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def first_pass(model_dir: Path, features: torch.Tensor, **kwargs: object) -> list[int]:
    """`generate()`'s tokens of the window's first pass with timestamps. Where a window's output
    ends inside a segment (at max_new_tokens), transformers keeps its closed segments and decodes
    again from the last timestamp (long-form's seeking); the first pass is one window's decode."""
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(
            features[None],
            return_timestamps=True,
            return_segments=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    sequence = out["segments"][0][0]["result"]["sequences"].tolist()
    return sequence[1:]  # after <|startoftranscript|>, an English-only model's whole prompt


def tokens(got: Collected) -> list[list[int]]:
    return [choice[1] for choice in got.choices().values()]


def test_greedy_windows_in_one_batch_equal_generate(whisper_dir: Path) -> None:
    engine = whisper_engine(whisper_dir)
    runner = engine.runner
    assert isinstance(runner, Seq2SeqRunner)
    calls: list[int] = []
    runner.parts.encoder.register_forward_hook(
        lambda _m, _a, kwargs, _o: calls.append(kwargs["input_features"].shape[0]),
        with_kwargs=True,
    )
    features = windows(3)
    params = window_params(whisper_dir, max_tokens=12)
    got = [submit_window(engine, whisper_dir, str(i), f, params) for i, f in enumerate(features)]
    run_to_completion(engine)
    outputs = [tokens(g) for g in got]
    for window, output in zip(features, outputs):
        assert output == reference(whisper_dir, window, max_new_tokens=12)
    assert calls == [3]  # the three windows encoded in one call
    assert len({tuple(o[0]) for o in outputs}) == 3  # the audio matters
    assert engine.stats.max_seqs_in_step == 3
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(("num_beams", "length_penalty"), [(5, 1.0), (3, 0.5)])
def test_beam_search_windows_equal_generate(
    whisper_dir: Path, num_beams: int, length_penalty: float
) -> None:
    engine = whisper_engine(whisper_dir)
    features = windows(2)
    params = window_params(
        whisper_dir, max_tokens=10, num_beams=num_beams, length_penalty=length_penalty
    )
    got = [submit_window(engine, whisper_dir, str(i), f, params) for i, f in enumerate(features)]
    run_to_completion(engine)
    for window, result in zip(features, got):
        assert tokens(result) == reference(
            whisper_dir,
            window,
            max_new_tokens=10,
            num_beams=num_beams,
            length_penalty=length_penalty,
        )
    assert engine.stats.max_seqs_in_step == 2 * num_beams
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("num_beams", [1, 4])
def test_timestamped_windows_equal_generate(whisper_dir: Path, num_beams: int) -> None:
    """With timestamps (generate()'s return_timestamps), the rules decide every choice."""
    engine = whisper_engine(whisper_dir)
    features = windows(3)
    params = window_params(whisper_dir, max_tokens=24, num_beams=num_beams)
    got = [
        submit_window(engine, whisper_dir, str(i), f, params, timestamps=True)
        for i, f in enumerate(features)
    ]
    run_to_completion(engine)
    outputs = [tokens(g)[0] for g in got]
    for window, output in zip(features, outputs):
        assert output == first_pass(whisper_dir, window, max_new_tokens=24, num_beams=num_beams)
    stamps = [t for output in outputs for t in output if t > 50362]
    assert stamps and all(o[0] > 50362 for o in outputs)  # each starts with a timestamp
    assert engine.pool.num_free == engine.pool.num_blocks
