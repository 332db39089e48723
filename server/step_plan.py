"""The contract between scheduling and the model side: one step's plan, as plain data.

The engine turns its scheduler's decision into a `StepPlan` (engine/plan_builder.py); the model
runner, and every other rank of a tensor-parallel group, reads only the plan (never an engine
object) and keeps what lives between steps itself (model/row_tables.py: each row's block table).
So a plan carries a row's whole block table only when the model side has not seen the row, and
otherwise only what changed (vLLM v1's `SchedulerOutput` does the same: new requests in full,
cached ones as deltas).

A plan is columns of ints, one entry per row in packing order, plus a few small lists, and has one
encoding (`encode_plan` / `decode_plan`): a flat int list, the adapters' weights as one float
tensor, the deferred tokens as they are on the device. The tensor-parallel broadcast sends exactly
that (parallel/plan_broadcast.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from decoding.logprobs import TokenLogprobs

NO_ADAPTER = -1  # a row's LoRA slot when it runs the base model


@dataclass(frozen=True)
class TableEdit:
    """Row `row` (an index into the plan's rows) keeps the first `keep` entries of the block table
    the model side holds for it and appends `blocks`: a row new to the model side keeps 0; a row
    that decodes on gains a block now and then; copy-on-write replaces its last block; rejected
    drafts drop blocks at its end."""

    row: int
    keep: int
    blocks: list[int]


@dataclass(frozen=True)
class PlanScore:
    """Row `row` (an index into the plan's rows) asks for the logprobs of `targets`, the tokens
    that follow its positions [start, stop) (prompt logprobs), with the `num_top` likeliest."""

    row: int
    start: int
    stop: int
    num_top: int
    targets: list[int]


@dataclass(frozen=True)
class DeferredTokens:
    """Input tokens a step reads from the device (async scheduling): the first new token of row
    `rows[j]` is `values[sources[j]]`, a token the previous step chose and has not read back."""

    values: torch.Tensor  # [P] long, on the model's device
    rows: list[int]
    sources: list[int]


@dataclass(frozen=True)
class SourceEncode:
    """An encoder-decoder row (`row`, an index into the plan's rows) whose step writes source
    positions: the encoder runs over its whole `source` (it attends both ways) and the step
    keeps the cross-attention keys and values of the positions it covers. An audio source
    (Whisper) is its log-mel `features`; its `source` ids are placeholders that hold its
    positions (server/audio/).
    """

    row: int
    source: list[int]
    features: torch.Tensor | None = None  # [mel bins, frames] of an audio source


@dataclass(frozen=True)
class AdapterInstall:
    """LoRA weights to put into device slot `slot` before the step: (A, B) of each projection the
    adapter changes, whole (a tensor-parallel rank keeps its part)."""

    slot: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepPlan:
    """One step. Row r runs `num_new[r]` tokens from position `starts[r]` (keys and values before
    it are cached): its own tokens, then `num_drafts[r]` speculative ones, all in `tokens` (flat,
    in row order). A row that `samples` returns logits at its last own token and at each draft."""

    row_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    table_edits: list[TableEdit] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # rows the model side forgets (first)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, before
    scores: list[PlanScore] = field(default_factory=list)
    # rows whose new tokens run through the floating-point weights of an int8 model (a prompt
    # that scores: model/exact_weights.py)
    exact: list[int] = field(default_factory=list)
    # the step's logits rows (its sampling rows' positions, drafts included, in order) computed
    # from an int8 LM head's floating-point weight: rows whose logprobs are returned
    exact_logits: list[int] = field(default_factory=list)
    lora_slots: list[int] | None = None  # per row; None: LoRA is off
    installs: list[AdapterInstall] = field(default_factory=list)
    deferred: DeferredTokens | None = None
    # encoder-decoder models: each row's source length (its first positions), and the rows
    # whose step covers source positions
    source_lens: list[int] | None = None
    # with source_lens, each row's request as the plan's first row of it: a request's rows (its
    # beams, its `n` samples) have the same source, also where their copies of the source's last,
    # partly filled block are different blocks (empty: each row on its own)
    source_groups: list[int] = field(default_factory=list)
    encodes: list[SourceEncode] = field(default_factory=list)
    # with source_lens, the rows whose decoder tokens' cross-attention scores at the model's
    # alignment heads the step returns (StepOutput.cross_attention)
    aligns: list[int] = field(default_factory=list)
    # the most likeliest tokens any sampling row's choice reads (0: some row reads them all): an
    # int8 LM head re-scores fewer candidates exactly (model/quantization.py)
    ranked: int = 0

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_starts(self) -> list[int]:
        """Index in `tokens` of each row's first token."""
        return [0, *accumulate(self.num_new)][:-1]

    @property
    def decode_only(self) -> bool:
        """Every row adds its one pending token (and its drafts) and samples: the decode path."""
        return bool(self.row_ids) and all(self.samples) and len(self.tokens) == len(self.row_ids)

    @property
    def verify_only(self) -> bool:
        """Every row adds its pending token and its drafts, and samples (decode rows with drafts
        included)."""
        return (
            bool(self.row_ids)
            and all(self.samples)
            and all(n == 1 + d for n, d in zip(self.num_new, self.num_drafts))
        )


@dataclass
class StepOutput:
    """What a step returns: logits [R, V] of the rows that sample (in order, 1 + drafts rows
    each: its last token and its drafts), and the scored positions (`StepPlan.scores`), by the
    index of the row that asked."""

    logits: torch.Tensor
    scores: dict[int, TokenLogprobs] = field(default_factory=dict)
    # `StepPlan.aligns`' rows: [alignment heads, the row's decoder tokens, its source positions]
    cross_attention: dict[int, torch.Tensor] = field(default_factory=dict)
    reused: bool = False  # the logits live in a buffer the next step overwrites (a CUDA graph's)


# ---- the one encoding ---------------------------------------------------------------------------
# ints: a header of counts and `ranked`, then the per-row columns, the table edits, releases,
# copies, scores, exact rows and logits rows, LoRA slots, installs (slot, then the rank of each
# projection in `adapter_paths` order, 0 when the adapter leaves it alone), the deferred tokens'
# rows and sources, and the sources (-1, or the number of encodes, then each row's source length,
# the source groups, the aligned rows and each encode's row, length and tokens).
# floats: every install's A and B, flattened, in that order.
_HEADER = 12


def encode_plan(
    plan: StepPlan, adapter_paths: list[str] | None = None
) -> tuple[list[int], torch.Tensor | None]:
    """The plan as a flat int list and the adapters' weights as one float tensor (None when it
    installs nothing); the deferred tokens' values travel as they are (`plan.deferred.values`)."""
    n = len(plan.row_ids)
    deferred = plan.deferred
    data = [
        n,
        len(plan.tokens),
        len(plan.table_edits),
        len(plan.released),
        len(plan.copies),
        len(plan.scores),
        len(plan.exact),
        len(plan.exact_logits),
        -1 if plan.lora_slots is None else len(plan.lora_slots),
        len(plan.installs),
        -1 if deferred is None else len(deferred.rows),
        plan.ranked,
    ]
    data += plan.row_ids
    data += plan.starts
    data += plan.num_new
    data += plan.num_drafts
    data += map(int, plan.samples)
    data += plan.tokens
    for edit in plan.table_edits:
        data += (edit.row, edit.keep, len(edit.blocks), *edit.blocks)
    data += plan.released
    for src, dst in plan.copies:
        data += (src, dst)
    for score in plan.scores:
        data += (score.row, score.start, score.stop, score.num_top, len(score.targets))
        data += score.targets
    data += plan.exact
    data += plan.exact_logits
    if plan.lora_slots is not None:
        data += plan.lora_slots
    parts: list[torch.Tensor] = []
    for install in plan.installs:
        data.append(install.slot)
        for path in adapter_paths or []:
            weights = install.weights.get(path)
            data.append(0 if weights is None else weights[0].shape[0])
            if weights is not None:
                parts += (weights[0].reshape(-1).float(), weights[1].reshape(-1).float())
    if deferred is not None:
        data += deferred.rows
        data += deferred.sources
    data.append(-1 if plan.source_lens is None else len(plan.encodes))
    if plan.source_lens is not None:
        data += plan.source_lens
        data += (len(plan.source_groups), *plan.source_groups)
        data += (len(plan.aligns), *plan.aligns)
        for encode in plan.encodes:
            if encode.features is not None:  # start-up refuses tensor parallelism for them
                raise ValueError("an audio source's features have no int encoding")
            data += (encode.row, len(encode.source), *encode.source)
    floats = torch.cat(parts) if parts else (torch.empty(0) if plan.installs else None)
    return data, floats


class _Reader:
    __slots__ = ("data", "at")

    def __init__(self, data: list[int]) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> list[int]:
        part = self.data[self.at : self.at + n]
        self.at += n
        return part

    def one(self) -> int:
        self.at += 1
        return self.data[self.at - 1]


def decode_plan(
    data: list[int],
    floats: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    adapter_shapes: dict[str, tuple[int, int]] | None = None,
) -> StepPlan:
    """The plan `encode_plan` encoded: `floats` its installs' weights, `values` the deferred
    tokens' values (on this rank's device), `adapter_shapes` each projection's (in, out)."""
    read = _Reader(data)
    (
        n,
        n_tokens,
        n_edits,
        n_released,
        n_copies,
        n_scores,
        n_exact,
        n_exact_logits,
        n_slots,
        n_installs,
        n_deferred,
        ranked,
    ) = read.take(_HEADER)
    plan = StepPlan(
        ranked=ranked,
        row_ids=read.take(n),
        starts=read.take(n),
        num_new=read.take(n),
        num_drafts=read.take(n),
        samples=[bool(s) for s in read.take(n)],
        tokens=read.take(n_tokens),
    )
    for _ in range(n_edits):
        row, keep, count = read.take(3)
        plan.table_edits.append(TableEdit(row, keep, read.take(count)))
    plan.released = read.take(n_released)
    plan.copies = [(read.one(), read.one()) for _ in range(n_copies)]
    for _ in range(n_scores):
        row, start, stop, top, count = read.take(5)
        plan.scores.append(PlanScore(row, start, stop, top, read.take(count)))
    plan.exact = read.take(n_exact)
    plan.exact_logits = read.take(n_exact_logits)
    plan.lora_slots = read.take(n_slots) if n_slots >= 0 else None
    at = 0
    for _ in range(n_installs):
        slot = read.one()
        weights = {}
        for path, (in_features, out_features) in (adapter_shapes or {}).items():
            rank = read.one()
            if not rank:
                continue
            assert floats is not None, "an install without its weights"
            a = floats[at : at + rank * in_features].view(rank, in_features)
            at += rank * in_features
            b = floats[at : at + out_features * rank].view(out_features, rank)
            at += out_features * rank
            weights[path] = (a, b)
        plan.installs.append(AdapterInstall(slot, weights))
    if n_deferred >= 0:
        assert values is not None, "deferred tokens without their values"
        plan.deferred = DeferredTokens(values, read.take(n_deferred), read.take(n_deferred))
    n_encodes = read.one()
    if n_encodes >= 0:
        plan.source_lens = read.take(n)
        plan.source_groups = read.take(read.one())
        plan.aligns = read.take(read.one())
        for _ in range(n_encodes):
            row, count = read.take(2)
            plan.encodes.append(SourceEncode(row, read.take(count)))
    return plan
