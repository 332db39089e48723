"""Prompt logprobs: which prompt positions each step scores, the results kept per request, and
the requests that only score their prompt (max_tokens 0), and the cross-attention scores an
encoder-decoder prompt of those asks for (`cross_attention`: Whisper's word times).

A request that asks (`prompt_logprobs`, or echo + logprobs) scores its prompt during prefill: each
chunk of its prompt asks the model runner for the logprobs of the tokens that follow its positions
(`WorkItem.score`), reduced to the requested top-k there. A position scored before a preemption is
not scored again; the prefix cache serves only the positions before the first unscored one
(`EngineRequest.unscored_from`), since cached blocks hold keys and values but no logits. A
`cross_attention` prompt computes its decoder positions for the same reason (its source's blocks
may be cached): each step returns the scores of the positions it ran, kept by position, so a
chunked or preempted prompt ends with each position's once.
"""

from __future__ import annotations

import torch

from decoding.logprobs import TokenLogprobs
from server.engine.request import EngineRequest, Sequence, TokenLogprob
from server.engine.sampling_step import select_items
from server.engine.work import ScoreSpan, WorkItem


class PromptScoring:
    def __init__(self) -> None:
        self.pending: set[EngineRequest] = set()  # requests whose prompt is not fully scored
        self.prompt_only: set[EngineRequest] = set()  # max_tokens 0: they end at their prompt

    def admit(self, req: EngineRequest) -> None:
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first token has nothing before it
            self.pending.add(req)
        if req.params.max_tokens == 0:
            self.prompt_only.add(req)

    def discard(self, req: EngineRequest) -> None:
        self.pending.discard(req)
        self.prompt_only.discard(req)

    def split_prompt_only(
        self, sampling: list[WorkItem], logits: torch.Tensor
    ) -> tuple[list[WorkItem], torch.Tensor, list[Sequence]]:
        """The rows that sample now, less those of max_tokens 0 requests (returned apart: their
        prompt is computed and scored, nothing is to be generated), with their logits."""
        keep = [i for i, item in enumerate(sampling) if item.seq.request not in self.prompt_only]
        if len(keep) == len(sampling):
            return sampling, logits, []
        done = [item.seq for item in sampling if item.seq.request in self.prompt_only]
        return *select_items(sampling, logits, keep), done

    def plan(self, items: list[WorkItem]) -> list[WorkItem]:
        """The step's items, those with unscored prompt positions in their chunk asking for
        them (nothing to do, and no loop over the items, while no request is pending)."""
        if not self.pending:
            return items
        return [self._with_span(item) for item in items]

    @staticmethod
    def _with_span(item: WorkItem) -> WorkItem:
        req = item.seq.request
        start, top = req.unscored_from, req.params.prompt_logprobs
        if start is None or top is None:
            return item
        begin = max(item.seq.num_computed, start)
        end = min(item.seq.num_computed + item.num_new, len(req.prompt_ids) - 1)
        if begin >= end:
            return item
        return WorkItem(item.seq, item.num_new, ScoreSpan(begin, end, top))

    def record(
        self,
        items: list[WorkItem],
        scores: dict[int, TokenLogprobs],
        cross_attention: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Append each scored span to its request's prompt logprobs, in prompt order, and keep
        the step's cross-attention scores (`record_cross_attention`)."""
        if cross_attention:
            record_cross_attention(items, cross_attention)
        for i, scored in scores.items():
            span, req = items[i].score, items[i].seq.request
            assert span is not None and req.prompt_logprobs is not None
            targets = req.prompt_ids[span.start + 1 : span.stop + 1]
            chosen = scored.chosen.tolist()
            ranks = scored.ranks.tolist() if scored.ranks is not None else [None] * len(chosen)
            top_ids, top_lps = scored.top_ids.tolist(), scored.top_logprobs.tolist()
            req.prompt_logprobs.extend(
                TokenLogprob(t, lp, list(zip(ids, lps)), rank)
                for t, lp, ids, lps, rank in zip(targets, chosen, top_ids, top_lps, ranks)
            )
            if req.unscored_from is None:
                self.pending.discard(req)


def record_cross_attention(items: list[WorkItem], rows: dict[int, torch.Tensor]) -> None:
    """Put each aligned row's scores [heads, new decoder tokens, source] (StepOutput) at their
    decoder positions of its request's, over the source positions it asks for (what crosses
    the process pipe: a short window's audio is a fraction of its source)."""
    for r, scores in rows.items():
        seq = items[r].seq
        req = seq.request
        decoder = len(req.prompt_ids) - req.source_len
        kept = min(req.params.cross_attention, scores.shape[2])  # the source positions asked
        if req.cross_attention is None:
            shape = (scores.shape[0], decoder, kept)
            req.cross_attention = scores.new_zeros(shape, device="cpu")
        stop = seq.num_computed + items[r].num_new - req.source_len
        req.cross_attention[:, stop - scores.shape[1] : stop] = scores[:, :, :kept].cpu()
