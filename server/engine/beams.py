"""Beam requests inside the batch: step their searches, keep the logprobs of the chosen tokens.

Which hypothesis wins is known only at the end, so every step keeps the logprob of each (input
row, token) pair the search chose: the continuing beams and the hypotheses finished at that step.
A hypothesis lists, per step, the input row its token came from (`Hypothesis.rows`), which finds
its path through those records: memory is linear in the output length (beams x steps entries).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decoding import (
    BeamSearch,
    BeamStep,
    GroupBeamSearch,
    Hypothesis,
    step_beam_searches,
    token_logprobs,
)
from server.engine.output_processor import FinalChoice
from server.engine.request import EngineRequest, TokenLogprob

StepLogprobs = dict[tuple[int, int], TokenLogprob]  # (input row, token) -> logprob, one step


def step_searches(
    reqs: list[EngineRequest], scores: torch.Tensor, logits: torch.Tensor, spans: list[slice]
) -> list[BeamStep]:
    """Step each request's search on its rows (`spans`) of the processed `scores`, and record
    the raw logprobs of what it chose where asked. Plain beam searches share one batched top-k;
    group beam searches step on their own."""
    steps = _step_searches(reqs, [scores[span] for span in spans])
    for req, span, beam_step in zip(reqs, spans, steps):
        if req.params.logprobs is not None:
            record_logprobs(req, logits[span], beam_step)
    return steps


def advance(
    req: EngineRequest,
    beam_step: BeamStep,
    fork: Callable[[EngineRequest, list[int], list[int]], None],
    max_model_len: int,
) -> bool:
    """Replace the request's rows by the step's beams (`fork`: the scheduler's) and advance their
    constraints; True when the search is over (done, or its beams filled max_model_len)."""
    if beam_step.done:
        return True
    fork(req, beam_step.parents, beam_step.tokens)
    for row, token in zip(req.rows, beam_step.tokens):
        if row.constraint is not None:
            row.constraint.advance(token)  # a failure leaves the beam no candidates
    return bool(req.rows) and len(req.rows[0].token_ids) >= max_model_len


def _step_searches(reqs: list[EngineRequest], scores: list[torch.Tensor]) -> list[BeamStep]:
    plain = [i for i, r in enumerate(reqs) if isinstance(r.search, BeamSearch)]
    steps: dict[int, BeamStep] = dict(
        zip(
            plain,
            step_beam_searches([search_of(reqs[i]) for i in plain], [scores[i] for i in plain]),
        )
    )
    return [steps[i] if i in steps else search_of(r).step(scores[i]) for i, r in enumerate(reqs)]


def record_logprobs(req: EngineRequest, logits: torch.Tensor, beam_step: BeamStep) -> None:
    """Keep the raw logprobs (and top alternatives) of the pairs `beam_step` chose from `logits`,
    this request's rows of the step."""
    k = req.params.logprobs or 0
    pairs = [*zip(beam_step.parents, beam_step.tokens), *beam_step.finished]
    step: StepLogprobs = {}
    if pairs:
        lp = token_logprobs(logits, [t for _, t in pairs], rows=[r for r, _ in pairs], num_top=k)
        for (row, token), (chosen, alternatives) in zip(pairs, lp.to_host()):
            step[(row, token)] = TokenLogprob(token, chosen, alternatives)
    req.beam_logprobs.append(step)


def hypothesis_logprobs(req: EngineRequest, hyp: Hypothesis) -> list[TokenLogprob] | None:
    """The logprob of each token of `hyp`, from the records of the steps that chose them."""
    if req.params.logprobs is None:
        return None
    path = zip(req.beam_logprobs, hyp.rows, hyp.token_ids)
    entries = [step.get((row, token)) for step, row, token in path]
    if len(entries) != len(hyp.token_ids) or any(e is None for e in entries):
        raise RuntimeError(f"beam logprobs lost for request {req.request_id}")
    return [e for e in entries if e is not None]


def choices(req: EngineRequest, hypotheses: list[Hypothesis]) -> list[FinalChoice]:
    """The final choices of a beam request: each hypothesis with its tokens' logprobs, its score
    and (diverse beams) its group."""
    grouped = req.params.num_beam_groups > 1
    return [
        FinalChoice(
            h.token_ids,
            h.finish_reason,
            hypothesis_logprobs(req, h),
            score=h.score,
            group=h.group if grouped else None,
        )
        for h in hypotheses
    ]


def search_of(req: EngineRequest) -> BeamSearch | GroupBeamSearch:
    if req.search is None:
        raise RuntimeError(f"request {req.request_id} has no beam search")
    return req.search
