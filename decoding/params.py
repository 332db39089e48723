"""One validated object per request holding every decoding parameter."""

from __future__ import annotations

from dataclasses import dataclass


class DecodingParamsError(ValueError):
    """An invalid decoding parameter; `field` names it so the API can point the client at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class DecodingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1")
        _check(self.temperature >= 0.0, "temperature", "temperature must be >= 0")
        _check(self.top_k >= 0, "top_k", "top_k must be >= 0 (0 disables it)")
        _check(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _check(self.n >= 1, "n", "n must be at least 1")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        """Greedy when the distribution collapses to its argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise DecodingParamsError(field, message)
