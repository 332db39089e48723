"""Per-request records and the serving metrics computed from them.

Definitions follow vLLM's `bench serve`, so numbers are comparable with what it prints:
- TTFT: request sent -> first chunk carrying output text.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), per request with more than one output token.
- ITL: every gap between two successive chunks carrying text, pooled over all requests. A chunk may
  carry several tokens (then ITL > TPOT); empty chunks (role, usage, a bare finish_reason) don't
  count.
- E2EL: request sent -> end of the response stream.
- Throughputs divide totals of successful requests by the wall time of the whole run.
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one request did. Times in seconds; `itl`: the gaps between token-carrying chunks."""

    index: int = 0
    success: bool = False
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    expected_output_tokens: int | None = None
    error: str = ""
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds; None where there is no data (JSON has no NaN)."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [v * 1000.0 for v in values_s]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict:
    """The metrics block of one run (one system at one concurrency or request rate)."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    mismatches = sum(
        1
        for r in ok
        if r.expected_output_tokens is not None and r.output_tokens != r.expected_output_tokens
    )
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(failed),
        "error_examples": sorted({r.error for r in failed})[:5],
        "output_length_mismatches": mismatches,
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2el_ms": distribution_ms([r.e2el for r in ok]),
    }
