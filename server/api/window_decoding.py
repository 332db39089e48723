"""An upload decoded window by window as `generate()` does (server/audio/windows.py): each
30-second window is an engine request (its beams, or its `best_of` samples, inside the batch with
every other request, so many uploads' windows decode together), decoded again hotter while it
fails the fallback's thresholds (server/audio/fallback.py), the next window's start read from the
timestamps of the last.

Without `language`, a multilingual model's language is detected on the first window first, as
`generate()` does: one greedy step after `<|startoftranscript|>` restricted to the language tokens,
an engine request of its own (its encoder's blocks are the prefix cache's when the transcription
starts). The probability of `<|nospeech|>` at the same place is one such step too, asked for only
where it is needed: an attempt below the log-probability threshold, or a response that reports it.
Word timestamps read each decoded window's text once more, a request of its own that returns the
decoder's cross-attention scores (`with_words`; server/audio/alignment.py aligns them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import torch

from decoding import DecodingParams
from server.api.audio_forms import TranscriptionForm
from server.api.errors import APIError
from server.api.responses import run_jobs
from server.api.serving import Job, ServingContext
from server.audio.alignment import place_words, window_words
from server.audio.fallback import Attempt, FallbackRules, fails, silent, unlikely
from server.audio.segments import Segment
from server.audio.speech_model import SpeechModel, window_salt
from server.audio.windows import (
    FRAME_SECONDS,
    INPUT_STRIDE,
    Span,
    window_input,
    window_spans,
)


@dataclass
class Transcription:
    """A prepared request of an audio route: its audio's features and how its windows decode."""

    form: TranscriptionForm
    task: str  # transcribe | translate
    language: str | None  # None until detected
    duration: float  # seconds of audio
    features: torch.Tensor  # [mel bins, frames]: the whole audio's (one padded window if short)
    speech: SpeechModel
    timed: bool  # decoded with timestamps
    prompt: list[int]  # `prompt`'s decoder tokens (`<|startofprev|>` first), or none
    params: DecodingParams  # every window's, but its temperature, cache salt and room
    rules: FallbackRules
    arrived: float
    previous: list[int] = dataclasses.field(init=False)  # the next window's earlier text
    job: Job = dataclasses.field(init=False)  # the first window's first attempt

    def __post_init__(self) -> None:
        self.previous = self.prompt
        self.job = self.window_job(0, self.rules.temperatures[0])[0]

    @property
    def words(self) -> bool:
        """Its words' times are asked for (alignment.py)."""
        return "word" in self.form.timestamp_granularities

    @property
    def frames(self) -> int:
        return int(self.features.shape[-1])

    def condition(self, kept: list[list[int]], conditioned: bool) -> None:
        """The next window's earlier text, as `generate()` builds it: with
        `condition_on_previous_text` and the last window decoded below temperature 0.5,
        `<|startofprev|>` and the last half of the decoder's positions of the segments kept so far
        (`prompt`'s first; a segment closed by a timestamp pair without its second); else
        `prompt` alone."""
        speech = self.speech
        if not (conditioned and kept and speech.start_of_previous is not None):
            self.previous = self.prompt
            return
        begin = speech.no_timestamps + 1
        tokens = [
            t
            for segment in kept
            for t in (segment[:-1] if len(segment) > 2 and segment[-2] >= begin else segment)
        ]
        room = speech.max_target_positions // 2 - 1
        self.previous = [speech.start_of_previous, *tokens[-room:]]

    def window_job(self, seek: int, temperature: float) -> tuple[Job, int]:
        """The engine job of the window at frame `seek` at `temperature` (above 0: one sample, or
        the likeliest of `best_of`, as the fallback decodes), and how many of its frames are
        audio."""
        features, frames = window_input(self.features, seek)
        speech = self.speech
        decoder_prompt = self.previous + speech.decoder_prompt(self.language, self.task, self.timed)
        sampled = temperature > 0
        params = dataclasses.replace(
            self.params,
            temperature=temperature,
            do_sample=sampled,
            num_beams=1 if sampled else self.form.num_beams,
            best_of=self.form.best_of if sampled else None,
            max_tokens=speech.max_target_positions - len(decoder_prompt),
            cache_salt=window_salt(features),
        )
        job = Job(speech.engine_prompt(decoder_prompt), params, 0)
        job.source_len, job.source_features = speech.source_positions, features
        return job, frames

    def record(self, ctx: ServingContext) -> None:
        """Its audio's seconds and real-time factor into the metrics, once it is done."""
        if ctx.metrics is not None:
            elapsed = time.monotonic() - self.arrived
            ctx.metrics.record_audio(task=self.task, audio_s=self.duration, elapsed_s=elapsed)


async def with_words(
    ctx: ServingContext,
    request_id: str,
    call: Transcription,
    decoded: Decoded,
    segments: list[Segment],
    heard: float,
) -> tuple[list[Segment], float]:
    """A window's segments with their words: its text read once more by the decoder after
    `<|notimestamps|>`, a request that generates nothing and returns its cross-attention
    scores (its encoder's blocks are the prefix cache's), then aligned (alignment.py)."""
    speech, window = call.speech, decoded.job
    end = speech.end_of_text
    text = [t for segment in segments for t in segment.tokens if t < end]
    if not text:  # timestamps alone: no word to place
        return segments, heard
    prompt = speech.decoder_prompt(call.language, call.task)
    params = DecodingParams(
        max_tokens=0,
        cross_attention=decoded.frames // INPUT_STRIDE,  # the window's audio
        cache_salt=window.params.cache_salt,
    )
    job = Job(speech.engine_prompt([*prompt, *text, end]), params, 0)
    job.source_len, job.source_features = window.source_len, window.source_features
    scores = None
    async with aclosing(run_jobs(ctx, request_id, [job])) as outputs:
        async for _, out in outputs:
            if out.error is not None:
                raise APIError(500, out.error, code="engine_error")
            scores = out.cross_attention if out.cross_attention is not None else scores
    if scores is None:
        raise APIError(500, "the engine returned no cross-attention scores", code="engine_error")
    timed = await asyncio.to_thread(
        window_words, ctx.tokenizer, scores, decoded.frames, len(prompt), text, end, call.language
    )
    offset = segments[0].seek * FRAME_SECONDS
    return place_words(segments, timed, end, offset, heard)


async def attempt_of(ctx: ServingContext, request_id: str, job: Job) -> Attempt:
    """A job's first choice: its tokens, their logprobs and its beam score."""
    tokens: list[int] = []
    logprobs: list[float] = []
    score = None
    async with aclosing(run_jobs(ctx, request_id, [job])) as outputs:
        async for _, out in outputs:
            if out.error is not None:
                raise APIError(500, out.error, code="engine_error")
            if out.index == 0:
                tokens += out.token_ids
                logprobs += [lp.logprob for lp in out.logprobs or ()]
                score = out.beam_score if out.beam_score is not None else score
    return Attempt(tokens, logprobs, score, job.params.temperature)


async def first_step(
    ctx: ServingContext,
    request_id: str,
    speech: SpeechModel,
    job: Job,
    previous: list[int],
    allowed: tuple[int, ...],
) -> tuple[int, float]:
    """The likeliest token among `allowed` after `previous` and `<|startoftranscript|>` on the
    window of `job`, and its raw log-probability there."""
    params = DecodingParams(
        max_tokens=1,
        temperature=0.0,
        allowed_token_ids=allowed,
        ignore_eos=True,
        logprobs=0,
        cache_salt=job.params.cache_salt,
    )
    step = Job(speech.engine_prompt([*previous, speech.start_of_transcript]), params, 0)
    step.source_len, step.source_features = job.source_len, job.source_features
    chosen = await attempt_of(ctx, request_id, step)
    return chosen.tokens[0], chosen.logprobs[0]


async def detect_language(ctx: ServingContext, request_id: str, call: Transcription) -> None:
    """Find a multilingual model's language on the first window."""
    if call.language is not None:
        return
    languages = call.speech.languages
    allowed = tuple(languages.values())
    # as generate()'s detect_language: `<|startoftranscript|>` alone, no earlier text
    language_id = f"{request_id}-language"
    chosen, _ = await first_step(ctx, language_id, call.speech, call.job, [], allowed)
    call.language = next(code for code, token in languages.items() if token == chosen)


async def no_speech_prob(
    ctx: ServingContext, request_id: str, call: Transcription, job: Job
) -> float:
    """`generate()`'s no-speech probability of a window's `job`: of `<|nospeech|>` after its
    earlier text and `<|startoftranscript|>`."""
    speech = call.speech
    _, logprob = await first_step(ctx, request_id, speech, job, call.previous, (speech.no_speech,))
    return math.exp(logprob)


@dataclass(frozen=True)
class Decoded:
    """A window's kept attempt, its frames of audio, whether it was skipped as silence, and its
    no-speech probability where it was measured."""

    attempt: Attempt
    frames: int
    skipped: bool
    no_speech_prob: float | None
    job: Job  # the kept attempt's


async def decode_window(
    ctx: ServingContext, request_id: str, call: Transcription, seek: int
) -> Decoded:
    """The window at `seek` decoded at each temperature in turn until an attempt passes."""
    rules, vocab = call.rules, call.speech.vocab_size
    reports = call.form.response_format == "verbose_json"
    no_speech: float | None = None
    for tried, temperature in enumerate(rules.temperatures):
        job, frames = call.window_job(seek, temperature)
        attempt = await attempt_of(ctx, f"{request_id}-t{tried}", job)
        if no_speech is None and (reports or unlikely(attempt, rules)):
            no_speech = await no_speech_prob(ctx, f"{request_id}-nospeech", call, job)
        if no_speech is not None and silent(attempt, rules, no_speech):
            return Decoded(attempt, frames, True, no_speech, job)
        if not fails(attempt, rules, vocab):
            break
    return Decoded(attempt, frames, False, no_speech, job)


async def windows(
    ctx: ServingContext, request_id: str, call: Transcription
) -> AsyncGenerator[list[Segment], None]:
    """Decode the audio window by window; yield each window's segments as it is done."""
    await detect_language(ctx, request_id, call)
    speech = call.speech
    end_of_text, begin = speech.end_of_text, speech.no_timestamps + 1
    seek, index = 0, 0
    heard = 0.0  # where the last speech ended (word timestamps)
    kept = [call.prompt[1:]] if call.prompt else []  # `prompt`: the first segment's text
    conditioned = call.form.condition_on_previous_text
    while seek < call.frames:
        call.condition(kept, conditioned)
        decoded = await decode_window(ctx, f"{request_id}-{index}", call, seek)
        index += 1
        attempt = decoded.attempt
        conditioned = call.form.condition_on_previous_text and attempt.temperature < 0.5
        tokens = attempt.tokens
        if tokens and tokens[-1] == end_of_text:
            tokens = tokens[:-1]
        if decoded.skipped or not tokens:  # silence, or nothing said: the window is done whole
            seek += decoded.frames
            continue
        spans, offset = window_spans(tokens, begin, seek, decoded.frames)
        kept += [span.tokens for span in spans]
        segments = segments_of(ctx, spans, decoded, call, seek)
        if call.words:
            words_id = f"{request_id}-{index - 1}-words"
            segments, heard = await with_words(ctx, words_id, call, decoded, segments, heard)
        yield segments
        seek += offset


def segments_of(
    ctx: ServingContext, spans: list[Span], decoded: Decoded, call: Transcription, seek: int
) -> list[Segment]:
    """A window's spans (consecutive slices of its tokens) as segments with their text."""
    begin = call.speech.no_timestamps + 1
    attempt = decoded.attempt
    segments, at = [], 0
    for span in spans:
        text = ctx.tokenizer.decode([t for t in span.tokens if t < begin], skip_special_tokens=True)
        count = len(span.tokens)
        logprobs = attempt.logprobs[at : at + count]
        segments.append(
            Segment(
                span.start,
                span.end,
                span.tokens,
                str(text),
                logprobs,
                attempt.temperature,
                decoded.no_speech_prob,
                seek,
            )
        )
        at += count
    return segments
