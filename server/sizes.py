"""Sizes in config values: a byte count, or text such as 512MiB, 2GiB (binary) or 2G (decimal)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


def parse_size(value: int | str) -> int:
    """'1GiB', '512MiB', '2G' or a plain byte count -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):  # a ValueError, so that pydantic reports it with the key
        raise ValueError(f"not a size: {value!r} (use e.g. 512MiB, 2GiB or a byte count)")
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. 512MiB, 2GiB or a byte count)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


ByteSize = Annotated[int, BeforeValidator(parse_size)]  # a byte count or a size such as 1GiB


def parse_kv_size(value: int | str) -> int | str:
    """A KV pool size (as `parse_size`, > 0) or "auto" (sized from the device: kv_budget.py)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        size = parse_size(value)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"not a size > 0 or auto: {value!r} (use e.g. auto, 8GiB or a byte count)")
    return size


KVSize = Annotated[int | Literal["auto"], BeforeValidator(parse_kv_size)]
