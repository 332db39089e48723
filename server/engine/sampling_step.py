"""One call into decoding/ for every row that samples in a step, whatever its strategy.

Per-row parameters become tensors once per step (`SamplingTensors`), constrained rows get their
allowed-token mask (`build_constraint_mask`), the logits are processed (mask, penalties, bans,
warpers) and a token is chosen per row; rows whose request asked for logprobs (beams excepted:
beams.py keeps theirs) get the raw model's logprob of that token and its top alternatives (in the
processed mode, of the scores it was chosen from: `logprob_source`). All of it is queued on the
device (`choose_on_device`) and read back in one go (`read`), at once or, with async scheduling,
once the next step's forward is queued (in_flight.py). Penalized rows keep their penalty state
between steps (`Sequence.penalties`, a row of the engine's `PenaltyTable`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Rows
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decoding import SamplingTensors, TokenLogprobs, token_logprobs
from decoding.constraints import (
    ConstraintMask,
    TokenConstraint,
    build_constraint_mask,
    dead_rows,
    read_dead_rows,
)
from decoding.params import DecodingParams
from decoding.penalty_table import PenaltyRow, PenaltyTable
from decoding.processors import uses_penalties
from decoding.random_streams import RandomStreams
from decoding.row_tensors import KeptRowTensors
from decoding.sampling import Draw, draw, draw_values, settle
from decoding.transfer import to_device
from server.engine.request import EngineRequest, Sequence, TokenLogprob
from server.engine.work import WorkItem


@dataclass
class Choices:
    scores: torch.Tensor  # [R, V] processed log-probs (beam searches step on these)
    tokens: list[int]  # the chosen token of each row (unused by beam rows)
    logprobs: dict[int, TokenLogprob]  # by row, for the rows that asked for logprobs
    no_token: set[int] = field(default_factory=set)  # constrained rows left nothing to choose
    mask_seconds: float | None = None  # time spent building constraint masks (None: no rows)
    refined: bool = False  # a top-k tie made the tokens first chosen on the device wrong


class ChoosingRow(Protocol):
    """What choosing reads of a row (a `Sequence`, or a position after some of its drafts)."""

    request: EngineRequest
    constraint: TokenConstraint | None
    penalties: PenaltyRow | None

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def num_output(self) -> int: ...

    @property
    def stream_key(self) -> int: ...


class HostRead:
    """Values of some device tensors, read in one go. Started early (`start`, non-blocking into
    pinned memory, then a CUDA event) the read waits only for the work queued before it, not for
    a forward queued after it (async scheduling, engine.py); elsewhere it is one plain read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.event: torch.cuda.Event | None = None

    def start(self) -> None:
        if self.tensor.device.type == "cuda":
            self.tensor = self.tensor.to("cpu", non_blocking=True)  # pinned by torch
            self.event = torch.cuda.Event()
            self.event.record()

    def values(self) -> list:  # type: ignore[type-arg]
        if self.event is not None:
            self.event.synchronize()
        return self.tensor.tolist()


@dataclass
class PendingChoices:
    """A step's choices computed on the device and not read yet (`choose_on_device`); `read`
    returns the `Choices`. The tokens, the warpers' tie flag and the constrained rows left
    without a token travel in one read; logprobs, when asked for, in a second."""

    rows: Rows[ChoosingRow]
    logits: torch.Tensor
    tensors: SamplingTensors
    drawn: Draw
    mask: ConstraintMask | None
    mask_seconds: float | None
    values: HostRead | None  # tokens (+ tie flag) + dead constrained rows
    logprob_rows: list[int]
    logprobs: HostRead | None

    def keep_logits(self) -> None:
        """Copy the logits when the read may process them again (`settle` after a top-k tie
        past the room kept for ties): read late, they may have been overwritten by then (a CUDA
        graph's output buffer, replayed by the next step)."""
        if self.drawn.unsure is not None:
            self.logits = self.logits.clone()

    def start_reads(self) -> None:
        for read in (self.values, self.logprobs):
            if read is not None:
                read.start()

    def read(self) -> Choices:
        """The choices as Python values; `refined` says a tie made the device's tokens wrong."""
        t, drawn = self.tensors, self.drawn
        read = self.values.values() if self.values is not None else []
        dead = read[len(read) - len(self.mask.row_list) :] if self.mask is not None else []
        read = read[: len(read) - len(dead)]  # the tokens, then the tie flag if there is one
        on_device = read[:-1] if drawn.unsure is not None else read  # the device's tokens
        scores, tokens = settle(drawn, read, self.logits, t) if read else (drawn.scores, [])
        refined = tokens != on_device
        logprobs: dict[int, TokenLogprob] = {}
        if self.logprob_rows:
            wanted = self.logprob_rows
            if refined or self.logprobs is None:
                source = logprob_source(self.logits, scores, wanted, self.rows)
                pairs = _logprobs(source, tokens, wanted, self.rows).to_host()
            else:
                pairs = TokenLogprobs.unpack(self.logprobs.values())
            for r, (chosen, alternatives) in zip(wanted, pairs):
                k = self.rows[r].request.params.logprobs or 0
                logprobs[r] = TokenLogprob(tokens[r], chosen, alternatives[:k])
        no_token = read_dead_rows(dead, self.mask)
        return Choices(scores, tokens, logprobs, no_token, self.mask_seconds, refined)


def random_streams(
    rows: Rows[ChoosingRow], t: SamplingTensors, device: torch.device
) -> RandomStreams | None:
    """The sampling rows' random streams: each row draws the number of the output token it
    chooses (its count of output tokens so far), so a token's number never depends on the
    batch, on speculation or on a preemption."""
    if t.sample_rows is None:
        return None
    sampling = [rows[r] for r in t.sample_row_list]
    return RandomStreams.of(
        [s.stream_key for s in sampling], [s.num_output for s in sampling], device
    )


def logprob_source(
    logits: torch.Tensor, scores: torch.Tensor, wanted: list[int], rows: Rows[ChoosingRow]
) -> torch.Tensor:
    """What the wanted rows' logprobs are read from: the raw `logits`, but for the rows in the
    processed mode their processed `scores` times the temperature they were divided by (what
    generate()'s Whisper fallback takes the log_softmax of)."""
    processed = [r for r in wanted if rows[r].request.params.logprobs_mode == "processed"]
    if not processed:
        return logits
    source = logits.float().clone()  # only steps that hold such rows copy
    params = [rows[r].request.params for r in processed]
    undo = [p.temperature if p.sampling else 1.0 for p in params]
    factors = to_device(undo, source.device, torch.float32)
    index = to_device(processed, source.device, torch.long)
    source[index] = scores.index_select(0, index) * factors.unsqueeze(1)
    return source


def _logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor | list[int],
    wanted: list[int],
    rows: Rows[ChoosingRow],
) -> TokenLogprobs:
    top = max(rows[r].request.params.logprobs or 0 for r in wanted)
    chosen = (
        tokens[to_device(wanted, tokens.device, torch.long)]
        if isinstance(tokens, torch.Tensor)
        else [tokens[r] for r in wanted]
    )
    return token_logprobs(logits, chosen, rows=wanted, num_top=top)


def choose_on_device(
    rows: Rows[ChoosingRow],
    logits: torch.Tensor,
    eos_ids: frozenset[int],
    kept: KeptRowTensors | None = None,
    table: PenaltyTable | None = None,
) -> PendingChoices:
    """Process `logits` [R, V] of `rows` and choose each row's next token, on the device;
    `kept`: the params-only tensors of the last step, reused when its rows' params match;
    `table`: where penalized rows keep their tokens between steps (None: rebuilt each step)."""
    params = [s.request.params for s in rows]
    vocab = logits.shape[-1]
    mask, mask_seconds = None, None
    allowed = [p.allowed_token_ids for p in params]
    if any(s.constraint is not None for s in rows) or any(allowed):
        start = time.perf_counter()
        mask = build_constraint_mask(
            [s.constraint for s in rows],
            [s.request.finishing_ids for s in rows],
            eos_ids,
            vocab,
            logits.device,
            allowed,
        )
        mask_seconds = time.perf_counter() - start
    tensors = SamplingTensors.from_rows(
        params,
        [s.request.decoder_prompt_ids for s in rows],
        OutputIds(rows),
        eos_ids,
        vocab,
        logits.device,
        constraint=mask,
        penalty_rows=penalty_rows(rows, params, table),
        kept=kept,
    )
    beam_only = all(p.is_beam for p in params)  # beams take their tokens from their searches
    drawn = draw(logits, tensors, random_streams(rows, tensors, logits.device), not beam_only)
    parts = [v for v in (draw_values(drawn), dead_rows(drawn.scores, mask)) if v is not None]
    values = None
    if parts:  # one tensor, one read (most steps: the tokens alone, no copy)
        values = HostRead(
            parts[0].long() if len(parts) == 1 else torch.cat([p.long() for p in parts])
        )
    wanted = tensors.logprob_rows  # non-beam rows whose request asked for logprobs
    logprobs = None
    if wanted and drawn.tokens is not None:
        source = logprob_source(logits, drawn.scores, wanted, rows)
        logprobs = HostRead(_logprobs(source, drawn.tokens, wanted, rows).packed())
    return PendingChoices(
        rows, logits, tensors, drawn, mask, mask_seconds, values, wanted, logprobs
    )


class OutputIds(Rows[list[int]]):
    """Each row's output token ids, sliced from its tokens only when read (most steps read
    none: a row's penalties keep their own state)."""

    def __init__(self, rows: Rows[ChoosingRow]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> list[int]:  # type: ignore[override]
        return self.rows[r].output_ids


def penalty_rows(
    rows: Rows[ChoosingRow], params: list[DecodingParams], table: PenaltyTable | None
) -> list[PenaltyRow | None] | None:
    """Each penalized row's place in `table`, made at its first penalized step (a `Sequence`;
    a draft position reads its lists)."""
    if table is None or not any(uses_penalties(p) for p in params):
        return None
    out: list[PenaltyRow | None] = []
    for row, p in zip(rows, params):
        if row.penalties is None and isinstance(row, Sequence) and uses_penalties(p):
            row.penalties = table.add(row.request.decoder_prompt_ids, row.output_ids)
        out.append(row.penalties)
    return out


def select_items(
    sampling: list[WorkItem], logits: torch.Tensor, kept: list[int]
) -> tuple[list[WorkItem], torch.Tensor]:
    """Items `kept` of the sampling items, and their logits rows (1 + len(draft) each)."""
    if len(kept) == len(sampling):
        return sampling, logits
    starts, rows = [0], list[int]()
    for item in sampling:
        starts.append(starts[-1] + 1 + len(item.draft))
    for i in kept:
        rows.extend(range(starts[i], starts[i + 1]))
    index = to_device(rows, logits.device, torch.long)
    return [sampling[i] for i in kept], logits.index_select(0, index)


def without_retired(
    sampling: list[WorkItem], logits: torch.Tensor
) -> tuple[list[WorkItem], torch.Tensor]:
    """The items (and their logits) whose rows are still in the batch: with overlapped outputs
    a stop string may end a row after its step was queued; that step's tokens are dropped."""
    return select_items(
        sampling, logits, [i for i, item in enumerate(sampling) if not item.seq.retired]
    )
