"""From chosen tokens to what clients receive: detokenization, stop strings, emission.

A chosen token is first *committed* (`commit`: appended, with the endings a token decides by
itself) and its text *rendered* later (`render_pending`): with overlapped output processing the
engine renders a step's text while the device runs the next step (engine.py).

Rows that stream (greedy, sampling, n) carry their text state (`Sequence.text`): an incremental
detokenizer, how much was sent, how far stop strings were searched. Text that could still turn
into the start of a stop string is held back. Beams and best_of know their answer only at the
end: `emit_choices` sends each whole choice once, stop strings applied to its full text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from decoding import DecodingParams, rank_samples
from decoding.stopping import find_stop, holdback
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.request import (
    EngineRequest,
    RequestOutput,
    Sequence,
    SequenceText,
    TokenLogprob,
)


@dataclass(frozen=True)
class FinalChoice:
    """A whole choice of a beam or best_of request."""

    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    score: float | None = None  # beams: the hypothesis' score (HF `sequences_scores`)
    group: int | None = None  # group beam search: the group it came from


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # committed tokens whose text is not out yet: (row, the token's index in it, the ending
        # the token decided); a speculative step commits several tokens of a row at once
        self._pending: list[tuple[Sequence, int, str | None]] = []

    def commit(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> str | None:
        """Add a chosen token to an independent row: what the next step needs (the token, its
        logprob) and the endings a token decides by itself (a finishing id, a length limit).
        Its text waits for `render_pending`, which may still end the row on a stop string."""
        req, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        if seq.penalties is not None:
            seq.penalties.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if params.logprobs is not None:
                seq.logprobs.append(logprob)
        if token in req.finishing_ids:
            reason: str | None = "stop"
        elif seq.num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        else:
            reason = None
        self._pending.append((seq, len(seq.token_ids) - 1, reason))
        return reason

    def render_pending(self) -> list[tuple[Sequence, str]]:
        """Detokenize the committed tokens, search their stop strings and stream their text;
        returns the rows that end here, with their reasons (the caller then calls `finish_row`).
        Rows of requests that ended meanwhile (aborted) are skipped."""
        pending, self._pending = self._pending, []
        ended: dict[Sequence, str] = {}
        for seq, position, reason in pending:
            if not seq.request.finished and seq not in ended:
                final = self._render(seq, position, reason)
                if final is not None:
                    ended[seq] = final
        return list(ended.items())

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def drop_pending(self) -> set[EngineRequest]:
        """Forget the committed tokens not rendered yet (a failed step); returns their requests."""
        pending, self._pending = self._pending, []
        return {seq.request for seq, _, _ in pending}

    def _render(self, seq: Sequence, position: int, reason: str | None) -> str | None:
        """A stop string ends the row (as "stop") even where the token ended it by length;
        a finishing token is text only with `include_stop_str_in_output` (as in vLLM)."""
        text = self._text(seq)
        if text is None:
            return reason
        req, params, token = seq.request, seq.request.params, seq.token_ids[position]
        if reason == "stop":
            if params.include_stop_str_in_output:
                text.detok.push(token)
            return reason
        text.detok.push(token)
        count = position + 1 - seq.prompt_len
        if params.stop and _hit_stop_string(text, params, count):
            _drop_after(seq, position)
            return "stop"
        if reason is None:
            ready = len(text.detok.text)
            if params.stop:
                ready -= holdback(params.stop)
            delta = ""
            if ready > text.sent:
                delta, text.sent = text.detok.text[text.sent : ready], ready
            logprobs = seq.logprobs[count - 1 : count] or None
            _emit(req, seq.index, delta, [token], None, count, logprobs)
        return reason

    def finish_row(
        self, seq: Sequence, reason: str, request_done: bool, appended: bool = True
    ) -> None:
        """The last output of a streaming row: whatever text it still holds back, and its last
        token unless the row ended without one (`appended` False: nothing left to choose)."""
        text = self._text(seq)
        if text is None:
            return
        if not text.cut:
            text.detok.flush()
        _emit(
            seq.request,
            seq.index,
            text.detok.text[text.sent :],
            seq.token_ids[-1:] if appended else [],
            reason,
            seq.num_output,
            seq.logprobs[-1:] or None,
            request_done=request_done,
        )

    def emit_choices(self, req: EngineRequest, choices: list[FinalChoice]) -> None:
        """Send whole choices at once (beams, best_of), applying stop strings to each."""
        params = req.params
        for index, choice in enumerate(choices):
            token_ids, reason = choice.token_ids, choice.finish_reason
            finished = bool(token_ids) and token_ids[-1] in req.finishing_ids
            cut_last = finished and not params.include_stop_str_in_output
            shown = token_ids[:-1] if cut_last else token_ids
            text = self._decode(params, shown)
            searched = (
                len(self._decode(params, shown[: params.min_tokens])) if params.min_tokens else 0
            )
            stop = find_stop(text, params.stop, searched) if params.stop else None
            if stop is not None:
                text, reason = text[: _stop_end(stop, params)], "stop"
            elif finished:
                reason = "stop"
            done = index == len(choices) - 1
            _emit(
                req,
                index,
                text,
                list(token_ids),
                reason,
                len(token_ids),
                choice.logprobs,
                request_done=done,
                beam=(choice.score, choice.group),
            )

    def _decode(self, params: DecodingParams, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(
            token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        return cast(str, text)  # one sequence of ids decodes to one string

    def emit_best_samples(self, req: EngineRequest) -> None:
        """best_of: every sample is in; send the n most likely (raw cumulative logprob)."""
        ranked = rank_samples([s.cumulative_logprob for s in req.done_rows], req.params.n)
        chosen = [req.done_rows[i] for i in ranked]
        self.emit_choices(
            req,
            [
                FinalChoice(s.output_ids, s.finish_reason or "length", s.logprobs or None)
                for s in chosen
            ],
        )

    @staticmethod
    def emit_end(req: EngineRequest, reason: str, error: str | None = None) -> None:
        """One last, empty output that ends an aborted or failed request's stream."""
        _emit(req, 0, "", [], reason, 0, error=error, request_done=True)

    def _text(self, seq: Sequence) -> SequenceText | None:
        """The row's streaming text state, made at its first token (rows of streaming requests)."""
        if seq.text is None and seq.request.streams:
            params = seq.request.params
            detok = IncrementalDetokenizer(
                self.tokenizer,
                seq.request.decoder_prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            seq.text = SequenceText(detok)
        return seq.text


def _drop_after(seq: Sequence, position: int) -> None:
    """A stop string ended the row at `position`: tokens committed after it in the same step
    (speculation keeps several) are not part of the output."""
    dropped = len(seq.token_ids) - position - 1
    if dropped > 0:
        del seq.token_ids[position + 1 :]
        seq.release_penalties()  # it counted them
        del seq.logprobs[seq.num_output :]
        seq.request.generated_tokens -= dropped  # what its usage and metrics report


def _hit_stop_string(text: SequenceText, params: DecodingParams, count: int) -> bool:
    """True (and the text cut before it, or after it with `include_stop_str_in_output`) once
    a stop string appears in the generated text. Before `min_tokens` tokens none is looked for,
    and what those tokens said is never searched again (as in vLLM)."""
    stop = None
    if count > params.min_tokens:
        stop = find_stop(text.detok.text, params.stop, text.stop_checked)
    text.stop_checked = len(text.detok.text)
    if stop is None:
        return False
    text.detok.text = text.detok.text[: _stop_end(stop, params)]
    text.cut = True
    return True


def _stop_end(stop: tuple[int, str], params: DecodingParams) -> int:
    """Where the text ends at a stop string: before it, or after it when the request keeps it."""
    start, string = stop
    return start + len(string) if params.include_stop_str_in_output else start


def _emit(
    req: EngineRequest,
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    completion_tokens: int,
    logprobs: list[TokenLogprob] | None = None,
    error: str | None = None,
    request_done: bool = False,
    beam: tuple[float | None, int | None] = (None, None),
) -> None:
    prompt_logprobs = None
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and error is None:
        prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True  # first output only
    cross_attention, req.cross_attention = req.cross_attention, None  # a prompt's one output
    req.emit(
        RequestOutput(
            request_id=req.request_id,
            index=index,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=req.cached_tokens,
            completion_tokens=completion_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            beam_score=beam[0],
            beam_group=beam[1],
            cross_attention=cross_attention if error is None else None,
            error=error,
            request_done=request_done,
        )
    )
