"""JSON schemas read as clients mean them, before they become grammars (grammar.py).

Two gaps between what a schema says and what a client expects made constrained replies run
until `max_tokens`:
- **Objects close unless they say otherwise.** A schema that does not mention
  `additionalProperties` allows any other key, so a grammar built from it lets a small model
  invent keys forever (`"population_per_capita": ..., "population_per_city": ...`). pydantic
  schemas never mention it; OpenAI's strict mode reads a missing one as false (its SDK writes
  `additionalProperties: false` into every object before sending) and so does xgrammar by
  default. So an object schema without it gets `false`; one that says `true` (pydantic's
  `dict[str, Any]`) or gives a schema for extra keys keeps that.
- **Numbers end.** A number the schema does not bound lets a model write `1000000000...` until
  the context is full. JSON consumers hold integers of int64 and doubles of 15-17 significant
  digits (I-JSON, RFC 7493), so an integer the schema leaves unbounded gets the bounds
  +-(10**18 - 1) (at most 19 digits: every one fits an int64), and a number gets +-10**15 and
  `multipleOf` 1e-10: at most 10 digits after the point, no exponent. Bounds the schema gives
  are kept, one side or both; `const` and `enum` values are already bounded.

Only subschemas that stand alone are closed: the branches of an `allOf` (and `then` / `else`)
are intersected with their siblings, and an object that composes (`allOf`, `anyOf`, `oneOf`,
`$ref`, `if`) takes keys from its parts, so neither is closed (closing them would forbid the
keys the others add). `not` and `if` are conditions, not values: they are left as they are.
"""

from __future__ import annotations

from typing import Any

INTEGER_BOUND = 10**18 - 1  # llguidance reads bounds as doubles: 10**18, 19 digits, < 2**63
NUMBER_BOUND = 10**15
NUMBER_STEP = 1e-10  # the smallest step llguidance's multipleOf takes exactly (1e-11 is not)
COMPOSING = ("allOf", "anyOf", "oneOf", "$ref", "if")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "contains")
INTERSECTED = ("then", "else")  # applied with their parent, as allOf branches are


def as_clients_mean(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """A copy of `schema` with closed objects and bounded numbers (see the module docstring).
    Iterative, never recursive: a request may nest a schema thousands of levels deep, and the
    grammar compiler, not a RecursionError here, is what refuses it."""
    out = _copy(schema)
    todo: list[tuple[object, bool]] = [(out, False)]  # (subschema, inside an allOf branch)
    while todo:
        node, in_all_of = todo.pop()
        if isinstance(node, dict):
            _read(node, in_all_of)
            todo.extend(_children(node))
    return out


def _read(node: dict[str, Any], in_all_of: bool) -> None:
    """Close the object and bound the number that `node` describes, where it leaves them open."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    is_object = "object" in types or "properties" in node
    stands_alone = not in_all_of and not any(k in node for k in COMPOSING)
    if is_object and stands_alone and "additionalProperties" not in node:
        if "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
    if "const" not in node and "enum" not in node:
        if "number" in types:
            _bound(node, NUMBER_BOUND)
            node.setdefault("multipleOf", NUMBER_STEP)
        elif "integer" in types:
            _bound(node, INTEGER_BOUND)


def _children(node: dict[str, Any]) -> list[tuple[object, bool]]:
    """`node`'s subschemas, each with whether it is intersected with its siblings."""
    found: list[tuple[object, bool]] = []
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            found += [(child, False) for child in node[key].values()]
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            found += [(child, False) for child in node[key]]
    if isinstance(node.get("allOf"), list):
        found += [(child, True) for child in node["allOf"]]
    found += [(node.get(key), True) for key in INTERSECTED]
    for key in SCHEMA_VALUES:
        child = node.get(key)
        found += [(item, False) for item in (child if isinstance(child, list) else [child])]
    return found


def _copy(value: object) -> Any:
    """A deep copy of JSON data (dicts, lists, scalars), without recursion; keys keep their
    order (properties are generated in the order a schema lists them)."""
    root: dict[int, object] = {0: None}
    todo: list[tuple[object, Any, object]] = [(value, root, 0)]
    while todo:
        item, parent, key = todo.pop()
        copied: object = item  # a scalar is its own copy
        if isinstance(item, dict):
            copied = dict.fromkeys(item)  # the order first, the values as they come
            todo += [(v, copied, k) for k, v in item.items()]
        elif isinstance(item, list):
            copied = [None] * len(item)
            todo += [(v, copied, i) for i, v in enumerate(item)]
        parent[key] = copied
    return root[0]


def _bound(node: dict[str, Any], bound: int) -> None:
    """Fill in the sides of a numeric range the schema leaves open."""
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = -bound
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = bound
