"""Warpers (temperature, top-k, top-p, min-p, typical-p), per row, in HF `generate()` order.

They only run on rows that sample (plain sampling, best_of and beam sampling); greedy and
deterministic beam rows skip them as HF does with `do_sample=False`. Each warper reproduces HF's
rule exactly (ties at the top-k threshold are kept, top-p cuts on the ascending cumulative sum,
...), so the kept support is token-for-token HF's. Each warper runs only on the rows that use it
(a sort of 32 x 262k scores costs what it costs; a batch where one row asks for top-p should pay
for one row); the other rows are left bit-identical, and a warper no row uses costs nothing.

`min_keep` is HF's `min_tokens_to_keep`: 1 when sampling, (number of EOS ids + 1) for beam
sampling, so that a beam can always continue with a non-EOS token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decoding.params import DecodingParams
from decoding.transfer import to_device

NEG_INF = float("-inf")
# Entries past the k-th that the one-read top-k keeps for ties with it: bfloat16 logits (8 bits of
# mantissa) tie at the k-th value in most rows (up to ~14 extra entries at k = 64 over a 262k
# vocabulary, bf16-rounded Gaussian logits), and a row with more ties than this room costs an
# exact redo after a read (`WarperTensors.unsure`).
TIE_ROOM = 32


@dataclass
class RowParams:
    """The rows a warper acts on and their parameter values (one per listed row)."""

    rows: torch.Tensor  # [M] long
    values: torch.Tensor  # [M, 1] float, or [M] long for top-k
    min_keep: torch.Tensor  # [M] long
    every_row: bool = False  # all R rows, in order: no gather / scatter of the rows needed
    largest: float = 0.0  # max(values) and max(min_keep), known on the host: reading them back
    max_keep: int = 1  # from the device would cost a sync
    row_list: tuple[int, ...] = ()  # `rows` on the host

    def rows_of(self, scores: torch.Tensor) -> torch.Tensor:
        return scores if self.every_row else scores[self.rows]

    def put(self, scores: torch.Tensor, rows: torch.Tensor) -> None:
        """scores[rows] = rows, in place."""
        if self.every_row:
            scores.copy_(rows)
        else:
            scores[self.rows] = rows

    def apply(self, scores: torch.Tensor, warp: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """scores[rows] = warp(scores[rows]), in place."""
        self.put(scores, warp(self.rows_of(scores)))


@dataclass
class WarperTensors:
    temperature: RowParams | None = None
    top_k: RowParams | None = None  # values: effective k = max(top_k, min_keep), <= V
    top_p: RowParams | None = None
    min_p: RowParams | None = None
    typical_p: RowParams | None = None
    # Set by a non-exact `apply_warpers_`: True (on the device) when some row kept more than
    # k + TIE_ROOM entries after top-k (ties at the k-th value) and the sorting warpers saw fewer.
    unsure: torch.Tensor | None = None


WarperValues = tuple[float | None, int | None, float | None, float | None, float | None]
_OFF: WarperValues = (None, None, None, None, None)  # a row no warper acts on


def warper_values(p: DecodingParams, min_keep: int, vocab_size: int) -> WarperValues:
    """One warped row's value for each warper, in `WarperTensors`' field order (None: that warper
    is off for the row). A request's rows share them: callers compute them once per request."""
    return (
        p.temperature if p.temperature != 1.0 else None,
        min(max(p.top_k, min_keep), vocab_size) if 0 < p.top_k < vocab_size else None,
        p.top_p if p.top_p < 1.0 else None,
        p.min_p if p.min_p > 0.0 else None,
        p.typical_p if p.typical_p < 1.0 else None,
    )


def warper_tensors(
    values: Sequence[WarperValues | None],
    min_keep: Sequence[int],
    device: torch.device | str,
) -> WarperTensors | None:
    """The tensors of rows' `warper_values` (None: a row no warper acts on); None when no row
    needs any warper."""
    if not any(row is not None for row in values):
        return None
    columns = list(zip(*(row or _OFF for row in values)))  # each warper's value per row

    def select(field: int, dtype: torch.dtype) -> RowParams | None:
        """Rows whose value for warper `field` is not None."""
        column = columns[field]
        if column.count(None) == len(column):  # off on every row
            return None
        if None not in column:  # every row (the common batch): no per-row work in Python
            rows: Sequence[int] = range(len(column))
            picked: Sequence[float | int] = column
            keep: Sequence[int] = min_keep
        else:
            rows = [r for r, v in enumerate(column) if v is not None]
            picked, keep = [column[r] for r in rows], [min_keep[r] for r in rows]
        every_row = len(rows) == len(values)
        tensor = to_device(picked, device, dtype)
        return RowParams(
            rows=(
                torch.arange(len(rows), device=device)
                if every_row
                else to_device(rows, device, torch.long)
            ),
            values=tensor if dtype == torch.long else tensor.unsqueeze(1),
            min_keep=to_device(keep, device, torch.long),
            every_row=every_row,
            largest=max(picked),
            max_keep=max(keep),
            row_list=tuple(rows),
        )

    f32 = torch.float32
    t = WarperTensors(
        temperature=select(0, f32),
        top_k=select(1, torch.long),
        top_p=select(2, f32),
        min_p=select(3, f32),
        typical_p=select(4, f32),
    )
    return None if all(v is None for v in vars(t).values()) else t


def apply_warpers_(
    scores: torch.Tensor, t: WarperTensors | None, exact: bool = True
) -> torch.Tensor:
    """Warp the listed rows of `scores` in place (the caller owns it); others stay bit-identical.

    `exact` False never reads a value back from the device: the sorting warpers after top-k run on
    the k + TIE_ROOM largest entries of each row (k known on the host), and `t.unsure` says on
    the device whether ties at the k-th value made a row's support larger still (then warp again,
    exactly)."""
    if t is None:
        return scores
    if (temp := t.temperature) is not None:
        if temp.every_row:
            scores.div_(temp.values)
        else:
            scores[temp.rows] = scores[temp.rows] / temp.values
    bound = None  # entries a row can keep, known on the host (None: unknown)
    top = None  # top-k's rows, their `bound` largest entries once warped, and where those are
    if (rp := t.top_k) is not None:
        kmax = int(rp.largest)
        bound = min(kmax + TIE_ROOM, scores.shape[-1])
        if exact:
            rp.apply(scores, lambda s: top_k_warp(s, rp.values, rp.min_keep, kmax))
        else:  # one topk serves top-k and the first sorting warper after it (on_support)
            rows = rp.rows_of(scores)
            largest, where = rows.topk(bound, dim=-1)
            kth = largest.gather(1, (rp.values - 1).unsqueeze(1))
            rp.put(scores, rows.masked_fill(rows < kth, NEG_INF))
            top = (rp, largest.masked_fill(largest < kth, NEG_INF), where)
    t.unsure = None
    for warp, sorted_rp in (
        (top_p_warp, t.top_p),
        (min_p_warp, t.min_p),
        (typical_warp, t.typical_p),
    ):
        if sorted_rp is None:
            continue
        size = bound  # without top-k and not exact: unknown (None), the whole row is warped
        if exact or bound is not None:
            rows = scores if sorted_rp.every_row else scores[sorted_rp.rows]
            if exact or bound is None:  # the support's size read back (one sync)
                size = support_size(rows)
            else:
                over = ((rows > NEG_INF).sum(dim=-1) > bound).any()
                t.unsure = over if t.unsure is None else t.unsure | over
        same = top is not None and (top[0].every_row, top[0].row_list) == (
            sorted_rp.every_row,
            sorted_rp.row_list,
        )
        kept = (top[1], top[2]) if same and top is not None else None
        top = None  # the warpers after this one see what it kept
        sorted_rp.apply(
            scores,
            lambda s, w=warp, p=sorted_rp, n=size, k=kept: on_support(
                w, s, p.values, p.min_keep, n, p.max_keep, k
            ),  # type: ignore[misc]
        )
    return scores


def support_size(scores: torch.Tensor) -> int:
    """The most finite entries any row has (a device-to-host read)."""
    return int((scores > NEG_INF).sum(dim=-1).max())


Warp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def on_support(
    warp: Warp,
    scores: torch.Tensor,
    value: torch.Tensor,
    min_keep: torch.Tensor,
    support: int | None = None,
    max_keep: int | None = None,
    largest: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run a sorting warper on the finite entries only when they are few (after top-k, say).

    -inf entries have probability 0 and stay -inf under every warper, so warping the compacted
    finite entries is the same computation (up to the order of exact ties, which HF's unstable
    sort leaves open too); sorting 64 values instead of 262k is what makes Gemma's default
    top_k=64 + top_p=0.95 cheap. `largest`: the rows' `support` largest entries and where they
    are, when the caller has them (top-k just found them: no second pass over the vocabulary).
    """

    def run(part: torch.Tensor, keep: torch.Tensor, most: int | None) -> torch.Tensor:
        if warp is min_p_warp:  # the one warper that needs max(min_keep) as a number
            return min_p_warp(part, value, keep, most)
        return warp(part, value, keep)

    if support is None or support * 4 > scores.shape[-1] or support == 0:
        return run(scores, min_keep, max_keep)
    # rows with fewer finite entries pad with -inf
    kept, index = largest if largest is not None else scores.topk(support, dim=-1)
    most = None if max_keep is None else min(max_keep, support)
    warped = run(kept, min_keep.clamp(max=support), most)
    return torch.full_like(scores, NEG_INF).scatter_(1, index, warped)


def top_k_warp(
    scores: torch.Tensor, k: torch.Tensor, min_keep: torch.Tensor, kmax: int | None = None
) -> torch.Tensor:
    """Drop scores below each row's k-th largest (ties with it stay, as HF). `k` >= min_keep;
    `kmax` = max(k) when the caller knows it (no read back)."""
    kmax = int(k.max()) if kmax is None else kmax
    kth = scores.topk(kmax, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p_warp(scores: torch.Tensor, top_p: torch.Tensor, min_keep: torch.Tensor) -> torch.Tensor:
    """HF nucleus: drop the low tail whose ascending cumulative mass is <= 1 - top_p."""
    sorted_scores, order = scores.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    vocab = scores.shape[-1]
    from_end = vocab - 1 - torch.arange(vocab, device=scores.device)
    drop &= from_end.unsqueeze(0) >= min_keep.unsqueeze(1)  # the last min_keep always stay
    return scores.masked_fill(drop.scatter(1, order, drop), NEG_INF)


def min_p_warp(
    scores: torch.Tensor, min_p: torch.Tensor, min_keep: torch.Tensor, kmax: int | None = None
) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (min_p 0 keeps all);
    `kmax` = max(min_keep) when the caller knows it (no read back)."""
    probs = scores.softmax(dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    kmax = int(min_keep.max()) if kmax is None else kmax
    top = probs.topk(kmax, dim=-1).indices
    rank = torch.arange(kmax, device=scores.device).unsqueeze(0)
    keep = torch.zeros_like(drop).scatter_(1, top, rank < min_keep.unsqueeze(1))
    return scores.masked_fill(drop & ~keep, NEG_INF)


def typical_warp(scores: torch.Tensor, mass: torch.Tensor, min_keep: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022), HF's rule for the cut."""
    logp = scores.log_softmax(dim=-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    sorted_shifted, order = shifted.sort(dim=-1, descending=False)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1).clamp(max=scores.shape[-1] - 1)
    drop = sorted_shifted > sorted_shifted.gather(1, last.unsqueeze(1))
    positions = torch.arange(scores.shape[-1], device=scores.device).unsqueeze(0)
    drop &= positions >= min_keep.unsqueeze(1)
    return scores.masked_fill(drop.scatter(1, order, drop), NEG_INF)
