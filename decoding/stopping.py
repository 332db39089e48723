"""Stop-string handling on generated text, shared by streaming and non-streaming paths."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], searched: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after its first `searched` characters, as
    (where it starts, which one); None if there is none. Of stops starting at the same place,
    the first listed wins (as in vLLM).

    `searched` lets callers skip text already checked (a stop may still straddle it), and start
    looking only after a prefix that may hold none (vLLM's min_tokens: no stop string before).
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, searched - len(stop) + 1))
        if start >= 0 and (best is None or start < best[0]):
            best = (start, stop)
    return best


def holdback(stops: Sequence[str]) -> int:
    """Characters to hold back while streaming so no prefix of a stop string is ever sent."""
    return max((len(s) - 1 for s in stops), default=0)
