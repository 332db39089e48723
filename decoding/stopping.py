"""Stop-string handling on generated text, shared by streaming and non-streaming paths."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], search_from: int = 0) -> int | None:
    """Index where the earliest stop string starts in `text[search_from:]` onwards, or None.

    `search_from` lets callers skip text already checked; a stop string may straddle the boundary,
    so they pass (previous length - longest stop + 1).
    """
    found = [i for s in stops if (i := text.find(s, max(0, search_from))) >= 0]
    return min(found) if found else None


def holdback(stops: Sequence[str]) -> int:
    """Characters to hold back while streaming so no prefix of a stop string is ever sent."""
    return max((len(s) - 1 for s in stops), default=0)
