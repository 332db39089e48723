"""The structured-output suite on the default model (benchmarks/schema_suite.py): every output of
every strategy validates against its schema and none is cut by the length limit.

Each schema runs two of the four strategies, in turn (the pairs rotate through the list), so every
schema and every strategy is checked, each strategy on 26 schemas of every kind, in half the
minutes of the whole product (which took 2.5 of the CI's 20)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from benchmarks.schema_suite import SCHEMAS
from decoding import DecodingParams
from decoding.grammar import GrammarCompiler, GrammarSpec
from server.engine.engine import Engine
from server.model.loader import resolve_model_dir
from tests.conftest import make_engine
from tests.engine_driver import Collected, run_to_completion
from tests.test_constrained_decoding import submit

pytestmark = pytest.mark.default_model

STRATEGIES = {
    "greedy": DecodingParams(max_tokens=200, temperature=0),
    "sampled": DecodingParams(max_tokens=200, temperature=0.8, seed=11),
    "n=2": DecodingParams(max_tokens=200, temperature=0.8, n=2, seed=12),
    "beams": DecodingParams(max_tokens=200, num_beams=2, n=2),  # every beam is returned
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    model_dir: Path = resolve_model_dir(None)
    yield make_engine(
        model_dir, num_blocks=1400, block_size=16, max_num_seqs=64, max_num_batched_tokens=1024
    )


def test_every_output_of_every_strategy_validates(engine: Engine) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids)
    runs: list[tuple[str, str, dict, Collected]] = []
    names = list(STRATEGIES)
    for index, (what, schema) in enumerate(SCHEMAS):
        grammar = compiler.compile(GrammarSpec.json_schema(schema))
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Give an example of {what} as JSON."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for name in (names[index % 4], names[(index + 1) % 4]):
            got = submit(engine, f"{what}/{name}", list(prompt), STRATEGIES[name], grammar)
            runs.append((what, name, schema, got))
    run_to_completion(engine, max_steps=100_000)
    failures = []
    outputs = 0
    for what, name, schema, got in runs:
        choices = got.choices()
        assert len(choices) == STRATEGIES[name].n
        for text, _, reason in choices.values():
            outputs += 1
            try:
                assert reason == "stop", f"finish_reason {reason}"
                jsonschema.validate(json.loads(text), schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                failures.append(f"{what} / {name}: {text!r}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)
    assert outputs == len(SCHEMAS) * sum(p.n for p in STRATEGIES.values()) // 2
    assert {name for _, name, _, _ in runs} == set(STRATEGIES)
    assert engine.pool.num_free == engine.pool.num_blocks
