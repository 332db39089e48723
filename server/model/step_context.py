"""What a step's attention reads: each row's slots in the KV pool, as one padded batch of one-token
rows (`DecodeStep`, with an encoder-decoder step's sources as a `CrossStep`) and a slice per
prefill chunk (`SeqSlice`), together a `StepContext`. packing.py builds them from a plan's block
tables; attention.py attends through them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.transfer import to_device
from server.model.kv_cache import PagedKVCache
from server.model.paged_step import padded_tables


@dataclass
class SeqSlice:
    """Where one sequence's new tokens sit in the packed step and what history they see."""

    start: int  # first packed index of this sequence's tokens
    num_new: int  # tokens computed this step
    context_len: int  # tokens in cache after this step (history + new)
    gather: torch.Tensor  # [context_len] flat slot ids of the whole history, in order
    source_len: int = 0  # an encoder-decoder row's source positions (at the front)
    # its cross-attention scores at the alignment heads are kept (StepContext.cross_scores)
    aligned: bool = False


@dataclass
class DecodeStep:
    """Rows of one new token each, as one padded batch. Passed alone as a step's context, row b is
    packed token b; inside a `StepContext`, `decode_index` maps rows to packed tokens.

    An encoder-decoder row's self-attention reads its decoder positions only, so its `gather`
    starts at the row's source length and `lengths` count from there; its cross-attention reads
    `cross`, each distinct source once (each part gathered once per step, not the whole row
    twice)."""

    slot_mapping: torch.Tensor  # [B] flat slot of each new token
    gather: torch.Tensor  # [B, L] flat slots of each row's history (and the new token), padded
    lengths: torch.Tensor  # [B, 1] tokens each row attends over
    positions: torch.Tensor  # [1, L] 0..L-1, to mask padding and out-of-window keys
    # the pools to attend over, passed in rather than found through the registered attention
    # function: an ahead-of-time compiled decoder reads them from its inputs (compiled_decode.py)
    kv: PagedKVCache | None = None
    cross: CrossStep | None = None  # encoder-decoder rows: their sources

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        lengths: list[int],
        block_size: int,
        device: torch.device,
        first: list[int] | None = None,
    ) -> DecodeStep:
        """From each row's block table and context length (history + the new token); with
        `first`, each row's history starts at that position (an encoder-decoder row's source
        length), and its length counts from there."""
        lens = torch.tensor(lengths, dtype=torch.long).unsqueeze(1)
        if first is None:
            width = max(lengths)
            table = padded_tables(tables, -(-width // block_size)).long()
            positions = torch.arange(width)
            gather = table[:, positions // block_size] * block_size + positions % block_size
        else:
            offsets = torch.tensor(first, dtype=torch.long).unsqueeze(1)
            lens = lens - offsets
            width = max(1, int(lens.max()))
            end = -(-(max(first) + width) // block_size)
            table = padded_tables(tables, end).long()
            positions = torch.arange(width)
            absolute = (offsets + positions).clamp(max=end * block_size - 1)  # padding: any slot
            gather = table.gather(1, absolute // block_size) * block_size + absolute % block_size
        slot_mapping = gather.gather(1, (lens - 1).clamp(min=0)).squeeze(1)
        return cls(
            to_device(slot_mapping, device),
            to_device(gather, device),
            to_device(lens, device),
            to_device(positions.unsqueeze(0), device),
        )

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L]: the keys each row sees (a few element-wise ops, recomputed per layer)."""
        visible = self.positions < self.lengths
        if window is not None:
            visible &= self.positions > self.lengths - 1 - window
        return visible[:, None, None, :]


@dataclass
class CrossStep:
    """The cross-attention of a step's one-token rows of encoder-decoder models. Rows whose
    source is one (a request's beams and `n` samples, and identical sources whose blocks the
    prefix cache shares) attend over one gather of it: each distinct source is a row
    of `sources`, and its rows' queries sit side by side, `per_source` slots for each, so that
    attention reads a source's keys once for all of its rows.

    Every size is a tensor's, none a Python int, so that a compiled step (compiled_decode.py)
    takes any number of sources and rows per source as the same graph."""

    sources: DecodeStep  # [G, L]: each distinct source's positions
    query_slots: torch.Tensor  # [B] where row b's query sits among the G x per_source slots
    slot_rows: torch.Tensor  # [G, per_source] the row whose query fills each slot (B: none)

    @property
    def per_source(self) -> int:
        """Query slots per source: the most rows one source has (or two, `padded`)."""
        return self.slot_rows.shape[1]

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        sources: list[int],
        block_size: int,
        device: torch.device,
        groups: list[int] | None = None,
        padded: bool = False,
    ) -> CrossStep:
        """From each row's block table and source length, and its request (`groups`, as
        StepPlan.source_groups): a source that ends inside a block shares that block with the
        decoder's first tokens, so each beam forked from its row holds a copy of it, another
        block with the same source positions; the request tells those rows' source is one.
        `padded`: at least two sources (the first one twice) and two slots per source where
        there are several rows: the compiled step's graph for several rows takes neither
        dimension of size one (dynamo specializes those)."""
        distinct: dict[tuple[int, ...], int] = {}
        firsts: list[int] = []  # the first row of each distinct source
        members: list[list[int]] = []  # the rows of each distinct source, in order
        where: list[tuple[int, int]] = []  # (source, rank among its rows) of each row
        for row, (table, source) in enumerate(zip(tables, sources)):
            whole, tail = divmod(source, block_size)
            if tail and groups is not None:  # the last block: a copy in each forked row
                key = (source, *table[:whole], -1, groups[row])
            else:
                key = (source, *table[: whole + (tail > 0)])
            index = distinct.setdefault(key, len(firsts))
            if index == len(firsts):
                firsts.append(row)
                members.append([])
            where.append((index, len(members[index])))
            members[index].append(row)
        width = max(len(rows) for rows in members)
        if padded and len(tables) > 1:
            width = max(width, 2)
            if len(firsts) == 1:  # a second copy of the one source, its slots empty
                firsts.append(firsts[0])
                members.append([])
        step = DecodeStep.build(
            [tables[r] for r in firsts], [sources[r] for r in firsts], block_size, device
        )
        none = len(tables)  # a slot no row fills reads a zero query
        filled = [rows + [none] * (width - len(rows)) for rows in members]
        return cls(
            step,
            to_device([index * width + rank for index, rank in where], device, torch.long),
            torch.tensor(filled, dtype=torch.long).to(device),
        )


@dataclass
class StepContext:
    """Context of a step with prefill chunks; its one-token rows, if any, form a `DecodeStep`."""

    slot_mapping: torch.Tensor  # [T] flat slot for every packed token
    decode: DecodeStep | None  # the sequences with one new token, as one padded batch
    decode_index: torch.Tensor | None  # [B] packed index of each of those tokens
    prefill: list[SeqSlice]  # sequences with a chunk of several tokens
    device: torch.device
    source_lens: torch.Tensor | None = None  # [T] encoder-decoder: each token's row's source
    # aligned slices' cross-attention scores, by the slice's `start`, then by layer: [alignment
    # heads of the layer, new tokens, source positions] (attention.py); None: none aligned
    cross_scores: dict[int, dict[int, torch.Tensor]] | None = None
    _cache: dict = field(default_factory=dict)

    def prefill_mask(self, s: SeqSlice, window: int | None, cross: bool = False) -> torch.Tensor:
        """[1, 1, num_new, context_len] causal (and windowed) mask for one prefill chunk; `cross`:
        every query sees the row's source positions (an encoder-decoder row's)."""
        key = ("prefill", s.start, window, cross)
        if key not in self._cache:
            first = s.context_len - s.num_new
            q_pos = torch.arange(first, s.context_len, device=self.device).unsqueeze(1)
            k_pos = torch.arange(s.context_len, device=self.device).unsqueeze(0)
            if cross:
                mask = (k_pos < s.source_len).expand(s.num_new, -1)
            else:
                mask = (k_pos <= q_pos) & (k_pos >= s.source_len)
            if window is not None:
                mask &= k_pos > q_pos - window
            self._cache[key] = mask[None, None]
        return self._cache[key]
