"""Whisper's timestamp rules over a batch of rows equal transformers'
`WhisperTimeStampLogitsProcessor` row for row, on histories that reach every rule: no output yet,
a timestamp that opens a pair, one that closes it, text after text, timestamps that may not go
back, and rows whose timestamps together outweigh every text token."""

from __future__ import annotations

import random

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

from decoding import DecodingParams
from decoding.processors import apply_processors_, build_processor_tensors
from decoding.timestamps import TimestampRules

VOCAB = 200
NO_TIMESTAMPS = 120
BEGIN = NO_TIMESTAMPS + 1  # <|0.00|>
EOS = 100
PROMPT = [110, 111, NO_TIMESTAMPS - 1]  # begin_index 3


def history(rng: random.Random) -> list[int]:
    """An output of text and timestamps in order (what the rules would have allowed or not)."""
    out: list[int] = []
    stamp = BEGIN + rng.randrange(0, 10)
    for _ in range(rng.randrange(0, 8)):
        if rng.random() < 0.4:
            stamp += rng.randrange(0, 6)
            out.append(min(stamp, VOCAB - 1))
        else:
            out.append(rng.randrange(0, EOS))
    return out


def test_the_rules_equal_transformers_row_for_row() -> None:
    rng = random.Random(0)
    rules = TimestampRules(BEGIN, NO_TIMESTAMPS, EOS, max_initial_index=5)
    config = GenerationConfig(
        no_timestamps_token_id=NO_TIMESTAMPS, eos_token_id=EOS, max_initial_timestamp_index=5
    )
    reference = WhisperTimeStampLogitsProcessor(config, begin_index=len(PROMPT))
    for trial in range(40):
        outputs = [history(rng) for _ in range(6)]
        if trial % 4 == 0:
            outputs = [[] for _ in outputs]  # every row's first token (HF: the whole batch's)
        length = max(len(o) for o in outputs)
        outputs = [o + [rng.randrange(0, EOS)] * (length - len(o)) for o in outputs]
        torch.manual_seed(trial)
        scores = torch.randn(len(outputs), VOCAB) * 3
        scores[:, BEGIN:] += trial % 3 - 1  # timestamps likelier, or less likely, as a whole
        params = [DecodingParams(temperature=0, timestamp_rules=rules)] * len(outputs)
        tensors = build_processor_tensors(params, [PROMPT] * 6, outputs, [EOS], VOCAB, "cpu")
        ours = apply_processors_(scores.clone(), tensors)
        ids = torch.tensor([PROMPT + o for o in outputs])
        theirs = reference(ids, scores.clone())
        assert torch.equal(ours, theirs), trial


def test_rows_without_rules_are_untouched() -> None:
    rules = TimestampRules(BEGIN, NO_TIMESTAMPS, EOS)
    params = [DecodingParams(temperature=0), DecodingParams(temperature=0, timestamp_rules=rules)]
    scores = torch.randn(2, VOCAB)
    tensors = build_processor_tensors(params, [PROMPT] * 2, [[], []], [EOS], VOCAB, "cpu")
    out = apply_processors_(scores.clone(), tensors)
    assert torch.equal(out[0], scores[0])
    assert out[1, :BEGIN].isinf().all() and out[1, NO_TIMESTAMPS].isinf()  # a timestamp first
