"""52 JSON schemas for structured outputs on the default model (tests/test_schema_suite.py, the
structured workload of benchmarks.serve, benchmarks/grammar_backends.py): nesting, bounded arrays,
enums, ranged numbers, patterns, anyOf, const, nullable fields, additionalProperties false.

Strings and numbers are bounded (maxLength, ranges, patterns) so a 270M model can finish them;
each entry is (what to ask for, schema).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(props: dict[str, Schema], required: list[str] | None = None, **extra: Any) -> Schema:
    """An object with these properties, all required unless told, no other keys."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def text(max_length: int = 24, **extra: Any) -> Schema:
    return {"type": "string", "maxLength": max_length, **extra}


def integer(low: int, high: int) -> Schema:
    return {"type": "integer", "minimum": low, "maximum": high}


def array(items: Schema, low: int = 0, high: int = 3) -> Schema:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


def enum(*values: Any) -> Schema:
    return {"enum": list(values)}


PERSON = obj({"name": text(20), "age": integer(0, 120)})
ADDRESS = obj({"street": text(30), "city": text(20), "zip": text(pattern=r"^[0-9]{5}$")})

SCHEMAS: list[tuple[str, Schema]] = [
    ("a person", PERSON),
    ("a person with hobbies", obj({**PERSON["properties"], "hobbies": array(text(15))})),
    ("an address", ADDRESS),
    ("a person and their address", obj({"person": PERSON, "address": ADDRESS})),
    ("a colour", obj({"colour": enum("red", "green", "blue")})),
    ("a yes or no answer", obj({"answer": {"type": "boolean"}})),
    ("a temperature reading", obj({"celsius": integer(-50, 60), "unit": {"const": "C"}})),
    ("a book", obj({"title": text(40), "author": text(30), "year": integer(1450, 2026)})),
    ("a list of three numbers", array(integer(0, 100), 3, 3)),
    ("a list of up to five words", array(text(12), 1, 5)),
    ("a to-do list", obj({"items": array(obj({"task": text(30), "done": {"type": "boolean"}}))})),
    ("a point", obj({"x": integer(-100, 100), "y": integer(-100, 100)})),
    (
        "a rectangle",
        obj(
            {
                "top_left": obj({"x": integer(0, 99), "y": integer(0, 99)}),
                "size": obj({"w": integer(1, 99), "h": integer(1, 99)}),
            }
        ),
    ),
    (
        "a product",
        obj(
            {
                "sku": text(pattern=r"^[A-Z]{3}-[0-9]{3}$"),
                "price_cents": integer(0, 99999),
                "in_stock": {"type": "boolean"},
            }
        ),
    ),
    ("a date", obj({"year": integer(1900, 2100), "month": integer(1, 12), "day": integer(1, 31)})),
    ("a time of day", obj({"time": text(pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")})),
    (
        "an email contact",
        obj({"name": text(20), "email": text(40, pattern=r"^[a-z]{1,10}@[a-z]{1,10}\.(com|org)$")}),
    ),
    ("a country and its capital", obj({"country": text(20), "capital": text(20)})),
    (
        "a weather report",
        obj(
            {
                "city": text(20),
                "sky": enum("sunny", "cloudy", "rain", "snow"),
                "wind_kmh": integer(0, 200),
            }
        ),
    ),
    (
        "a pet",
        obj({"species": enum("cat", "dog", "fish"), "name": text(15), "age": integer(0, 30)}),
    ),
    (
        "a nullable middle name",
        obj(
            {"first": text(15), "middle": {"anyOf": [text(15), {"type": "null"}]}, "last": text(15)}
        ),
    ),
    (
        "a shape",
        {
            "anyOf": [
                obj({"kind": {"const": "circle"}, "radius": integer(1, 50)}),
                obj({"kind": {"const": "square"}, "side": integer(1, 50)}),
            ]
        },
    ),
    ("an id that is a number or a string", obj({"id": {"anyOf": [integer(0, 9999), text(8)]}})),
    ("a matrix of 2 by 2 numbers", array(array(integer(0, 9), 2, 2), 2, 2)),
    ("a team", obj({"name": text(20), "members": array(PERSON, 1, 3)})),
    (
        "a recipe",
        obj(
            {
                "dish": text(30),
                "servings": integer(1, 12),
                "ingredients": array(obj({"item": text(20), "grams": integer(1, 1000)}), 1, 4),
            }
        ),
    ),
    ("a movie rating", obj({"movie": text(30), "stars": integer(1, 5)})),
    (
        "a flight",
        obj(
            {
                "from": text(pattern=r"^[A-Z]{3}$"),
                "to": text(pattern=r"^[A-Z]{3}$"),
                "seats": integer(1, 9),
            }
        ),
    ),
    ("a traffic light state", enum("red", "amber", "green")),
    ("a single word", text(12, pattern=r"^[a-z]+$")),
    ("a percentage", integer(0, 100)),
    ("a boolean", {"type": "boolean"}),
    ("a log line", obj({"level": enum("debug", "info", "warning", "error"), "message": text(40)})),
    (
        "an HTTP response",
        obj({"status": integer(100, 599), "headers": obj({"content_type": text(30)})}),
    ),
    ("a key and value", obj({"key": text(10), "value": text(20)})),
    (
        "a user with optional nickname",
        obj({"user": text(15), "nickname": text(15)}, required=["user"]),
    ),
    (
        "a version number",
        obj({"major": integer(0, 20), "minor": integer(0, 50), "patch": integer(0, 99)}),
    ),
    (
        "a chess move",
        obj({"from": text(pattern=r"^[a-h][1-8]$"), "to": text(pattern=r"^[a-h][1-8]$")}),
    ),
    (
        "a playing card",
        obj(
            {
                "rank": enum("A", "2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K"),
                "suit": enum("hearts", "spades", "clubs", "diamonds"),
            }
        ),
    ),
    ("a list of tags", obj({"tags": array(text(10, pattern=r"^[a-z]+$"), 1, 4)})),
    (
        "a bank transfer",
        obj(
            {
                "from_account": text(pattern=r"^[0-9]{8}$"),
                "to_account": text(pattern=r"^[0-9]{8}$"),
                "amount": integer(1, 100000),
            }
        ),
    ),
    (
        "a tree node",
        obj({"value": integer(0, 99), "children": array(obj({"value": integer(0, 99)}), 0, 2)}),
    ),
    ("a language and its greeting", obj({"language": text(15), "hello": text(15)})),
    ("an RGB colour", obj({"r": integer(0, 255), "g": integer(0, 255), "b": integer(0, 255)})),
    (
        "a planet",
        obj(
            {
                "name": enum(
                    "Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"
                ),
                "moons": integer(0, 200),
            }
        ),
    ),
    (
        "a student grade",
        obj(
            {
                "student": text(20),
                "grade": enum("A", "B", "C", "D", "F"),
                "passed": {"type": "boolean"},
            }
        ),
    ),
    ("a poll with options", obj({"question": text(40), "options": array(text(15), 2, 4)})),
    (
        "a server config",
        obj(
            {
                "host": text(20),
                "port": integer(1, 65535),
                "tls": {"type": "boolean"},
                "workers": integer(1, 64),
            }
        ),
    ),
    (
        "coordinates as a pair",
        {
            "type": "array",
            "prefixItems": [integer(-90, 90), integer(-180, 180)],
            "items": False,
            "minItems": 2,
        },
    ),
    (
        "an event",
        obj(
            {
                "name": text(30),
                "date": obj({"month": integer(1, 12), "day": integer(1, 31)}),
                "attendees": array(text(15), 0, 3),
            }
        ),
    ),
    (
        "an empty-or-small inventory",
        obj({"items": array(obj({"name": text(15), "qty": integer(0, 99)}), 0, 2)}),
    ),
    (
        "a sentiment label with confidence",
        obj({"label": enum("positive", "negative", "neutral"), "confidence": integer(0, 100)}),
    ),
]

assert len(SCHEMAS) >= 50
