"""JSON schemas as clients mean them (decoding/json_schemas.py): objects close unless they say
otherwise, numbers end; checked on the schemas and on the grammars compiled from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from decoding.grammar import GrammarCompiler, GrammarSpec
from decoding.json_schemas import INTEGER_BOUND, NUMBER_BOUND, NUMBER_STEP, as_clients_mean


class City(BaseModel):  # what instructor and `parse()` send: pydantic's own schema
    city: str
    population: int
    area_km2: float
    districts: dict[str, int]
    extra: dict


def test_a_pydantic_model_is_closed_and_its_numbers_bounded() -> None:
    schema = City.model_json_schema()
    meant = as_clients_mean(schema)
    assert isinstance(meant, dict)
    assert "additionalProperties" not in schema  # the input is left as it was
    assert meant["additionalProperties"] is False
    props = meant["properties"]
    assert (props["population"]["minimum"], props["population"]["maximum"]) == (
        -INTEGER_BOUND,
        INTEGER_BOUND,
    )
    assert props["area_km2"]["multipleOf"] == NUMBER_STEP
    assert props["area_km2"]["maximum"] == NUMBER_BOUND
    assert props["districts"]["additionalProperties"]["maximum"] == INTEGER_BOUND  # values too
    assert props["extra"]["additionalProperties"] is True  # dict[str, Any]: stays open


def test_what_a_schema_says_is_kept() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0},
            "x": {"type": "number", "exclusiveMaximum": 1, "multipleOf": 0.5},
            "e": {"type": "integer", "enum": [10**30]},
            "c": {"const": 3},
            "open": {"type": "object", "additionalProperties": {"type": "string"}},
            "patterned": {"type": "object", "unevaluatedProperties": False},
        },
        "additionalProperties": True,
    }
    meant = as_clients_mean(schema)
    assert isinstance(meant, dict)
    props = meant["properties"]
    assert meant["additionalProperties"] is True
    assert props["n"] == {"type": "integer", "minimum": 0, "maximum": INTEGER_BOUND}
    assert props["x"] == {
        "type": "number",
        "exclusiveMaximum": 1,
        "multipleOf": 0.5,
        "minimum": -NUMBER_BOUND,
    }
    assert props["e"] == schema["properties"]["e"] and props["c"] == {"const": 3}
    assert props["open"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in props["patterned"]


def test_composed_objects_and_conditions_are_not_closed() -> None:
    """Closing an allOf branch (or an object that takes keys from its parts) would forbid the
    keys its siblings add; `not` and `if` are conditions, not values."""
    part = {"type": "object", "properties": {"a": {"type": "string"}}}
    schema = {
        "$defs": {"Part": dict(part)},  # a request's JSON shares no objects
        "allOf": [part, {"type": "object", "properties": {"b": {"type": "integer"}}}],
        "type": "object",
        "anyOf": [{"$ref": "#/$defs/Part"}, {"type": "object", "properties": {}}],
        "not": {"type": "object", "properties": {"z": {"type": "integer"}}},
        "if": {"properties": {"a": {"const": "x"}}},
        "then": {"properties": {"c": {"type": "number"}}},
    }
    meant = as_clients_mean(schema)
    assert isinstance(meant, dict)
    assert "additionalProperties" not in meant  # composes
    assert all("additionalProperties" not in branch for branch in meant["allOf"])
    assert meant["allOf"][1]["properties"]["b"]["maximum"] == INTEGER_BOUND  # bounds intersect
    assert meant["$defs"]["Part"]["additionalProperties"] is False  # stands alone
    assert meant["anyOf"][1]["additionalProperties"] is False
    assert meant["not"] == schema["not"] and meant["if"] == schema["if"]
    assert "additionalProperties" not in meant["then"]
    assert meant["then"]["properties"]["c"]["multipleOf"] == NUMBER_STEP


@pytest.fixture(scope="module")
def compiler(llama_dir: Path) -> GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


def accepts(compiler: GrammarCompiler, schema: dict, value: object) -> bool:
    """Whether the grammar of `schema` takes `value`, written compactly, as a whole."""
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    constraint = grammar.new_constraint()
    text = json.dumps(value, separators=(", ", ": "))
    ids = compiler.ll_tokenizer.tokenize_str(text)
    return all(constraint.advance(t) for t in ids) and constraint.accepting


def test_grammars_refuse_invented_keys_and_endless_numbers(compiler: GrammarCompiler) -> None:
    schema = City.model_json_schema()
    good = {"city": "Paris", "population": 2102650, "area_km2": 105.4, "districts": {}, "extra": {}}
    assert accepts(compiler, schema, good)
    assert accepts(compiler, schema, {**good, "extra": {"anything": [1, "two"]}})
    assert not accepts(compiler, schema, {**good, "population_per_capita": 1})
    assert accepts(compiler, schema, {**good, "population": 10**18})
    assert not accepts(compiler, schema, {**good, "population": 10**19})
    assert accepts(compiler, schema, {**good, "area_km2": 0.1234567891})
    assert not accepts(compiler, schema, {**good, "area_km2": 0.12345678912})
    open_schema = {**schema, "additionalProperties": True}
    assert accepts(compiler, open_schema, {**good, "population_per_capita": 1})
