"""The checks and conversions decoding parameters are built from: the error that names the
offending field, the value checks `DecodingParams` runs on its fields, the parsing of the fields
that arrive as JSON (logit bias, bad words).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values


class DecodingParamsError(ValueError):
    """An invalid decoding parameter; `field` names it so the API can point the client at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def parse_logit_bias(raw: object) -> dict[int, float]:
    """A JSON logit_bias (string keys, or None) -> {token id: bias}; DecodingParamsError if not."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise DecodingParamsError("logit_bias", "logit_bias must be a map of token id to bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)  # JSON object keys arrive as strings
            bias = float(value)
        except (TypeError, ValueError):
            raise DecodingParamsError(
                "logit_bias", "logit_bias must map token ids to numbers"
            ) from None
        if isinstance(key, (float, bool)) or (isinstance(key, str) and not key.strip().isdigit()):
            raise DecodingParamsError(
                "logit_bias", "logit_bias keys must be token ids (integers >= 0)"
            )
        out[token] = bias
    return out


def normalise_bad_words(raw: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    try:  # the annotation is the contract; callers may still pass anything
        return tuple(tuple(seq) for seq in raw)
    except TypeError:
        raise DecodingParamsError(
            "bad_words_ids", "bad_words_ids must be a list of token id lists"
        ) from None


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def check_int(value: object, name: str, low: int, hint: str | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    check(ok, name, hint or f"{name} must be an integer >= {low}")


def check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise DecodingParamsError(field, message)


def check_token_fields(
    stop_token_ids: Iterable[object],
    logit_bias: Mapping[Any, float],
    bad_words_ids: Iterable[Iterable[object]],
    allowed_token_ids: Iterable[object] | None,
) -> None:
    """The fields of token ids: ids are integers >= 0, biases in OpenAI's range."""
    check(
        all(is_token_id(t) for t in stop_token_ids),
        "stop_token_ids",
        "token ids must be integers >= 0",
    )
    check(
        all(is_token_id(t) for t in logit_bias),
        "logit_bias",
        "logit_bias keys must be token ids (integers >= 0)",
    )
    check(
        all(finite(b) and -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT for b in logit_bias.values()),
        "logit_bias",
        "logit_bias values must be in [-100, 100]",
    )
    check(
        all(seq and all(is_token_id(t) for t in seq) for seq in bad_words_ids),
        "bad_words_ids",
        "bad_words_ids must be non-empty sequences of token ids (integers >= 0)",
    )
    allowed = None if allowed_token_ids is None else tuple(allowed_token_ids)
    check(
        allowed is None or (bool(allowed) and all(map(is_token_id, allowed))),
        "allowed_token_ids",
        "allowed_token_ids must be a non-empty list of token ids (integers >= 0)",
    )
