"""OpenAI's audio routes on a Whisper model: an upload decoded into log-mel features, then
decoded window by window as `generate()` does (server/audio/windows.py): each 30-second window is
an engine request (its beams, or its `best_of` samples, inside the batch with every other
request, so many uploads' windows decode together), the next window's start read from the
timestamps of the last. The transcript is returned in the asked format or streamed as OpenAI's
`transcript.text.delta` events, a window's text once the window is decoded.

Audio up to one window long decodes with timestamps when its response format reports times
(srt, vtt, verbose_json) and without otherwise, as `generate()` does short audio; longer audio
always decodes with them (they say where the next window starts). Without `language`, a
multilingual model's language is detected on the first window first, as `generate()` does: one
greedy step after `<|startoftranscript|>` restricted to the language tokens, an engine request of
its own (its encoder's blocks are the prefix cache's when the transcription starts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import torch
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from decoding import DecodingParams
from server.api.audio_forms import TranscriptionForm
from server.api.errors import APIError, bad_request
from server.api.responses import run_jobs
from server.api.serving import Job, ServingContext, check_model
from server.api.streaming import sse
from server.api.transcript_formats import Heard, render
from server.audio.decode import SAMPLING_RATE, AudioError, decode_audio
from server.audio.features import audio_features
from server.audio.segments import Segment
from server.audio.speech_model import SpeechModel, window_salt
from server.audio.windows import Span, window_input, window_spans

# the response formats that carry segments' times: short audio decodes with timestamps for them
TIMED_FORMATS = ("srt", "vtt", "verbose_json")


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
    # the decoder prompt's earlier text: `prompt`, and with `condition_on_previous_text` the
    # windows' so far (`condition`)
    previous: list[int]
    params: DecodingParams  # every window's, but its cache salt and its room
    arrived: float
    job: Job = dataclasses.field(init=False)  # the first window's

    def __post_init__(self) -> None:
        self.job = self.window_job(0)[0]

    @property
    def frames(self) -> int:
        return int(self.features.shape[-1])

    def condition(self, kept: list[list[int]]) -> None:
        """Put the text of the segments kept so far (`prompt`'s first) before the next window's
        prompt, as `generate(condition_on_prev_tokens=True)` does: `<|startofprev|>`, then the
        last half of the decoder's positions of their tokens (a segment closed by a timestamp
        pair without its second), at temperatures below 0.5 only."""
        speech = self.speech
        if not (self.form.condition_on_previous_text and self.form.temperature < 0.5):
            return
        if not kept or speech.start_of_previous is None:
            return
        begin = speech.no_timestamps + 1
        tokens = [
            t
            for segment in kept
            for t in (segment[:-1] if len(segment) > 2 and segment[-2] >= begin else segment)
        ]
        room = speech.max_target_positions // 2 - 1
        self.previous = [speech.start_of_previous, *tokens[-room:]]

    def window_job(self, seek: int) -> tuple[Job, int]:
        """The engine job of the window at frame `seek`, and how many of its frames are audio."""
        features, frames = window_input(self.features, seek)
        speech = self.speech
        decoder_prompt = self.previous + speech.decoder_prompt(self.language, self.task, self.timed)
        params = dataclasses.replace(
            self.params,
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


def require_speech(ctx: ServingContext) -> SpeechModel:
    if ctx.speech is None:
        raise bad_request(
            "the audio routes need a speech model (Whisper); this server serves a text model",
            "model",
            "unsupported_model",
        )
    return ctx.speech


async def prepare(
    ctx: ServingContext, form: TranscriptionForm, data: bytes, task: str
) -> Transcription:
    """Check the form, decode the audio and compute its features (off the event loop)."""
    arrived = time.monotonic()
    speech = require_speech(ctx)
    check_model(ctx, form.model)
    check_form(speech, form, task)
    try:
        samples = await asyncio.to_thread(decode_audio, data, ctx.config.max_audio_seconds)
    except AudioError as exc:
        raise bad_request(str(exc), "file", "invalid_audio") from None
    features, long = await asyncio.to_thread(audio_features, speech.extractor, samples)
    sampled = form.temperature > 0
    timed = long or form.response_format in TIMED_FORMATS
    params = DecodingParams(
        **{
            **speech.defaults(),
            "temperature": form.temperature,
            "do_sample": sampled,
            "num_beams": form.num_beams,
            "best_of": form.best_of if sampled else None,
            "length_penalty": form.length_penalty,
            "logprobs": 0 if form.response_format == "verbose_json" else None,
            "timestamp_rules": speech.timestamp_rules() if timed else None,
        }
    )
    previous = speech.previous_text(ctx.tokenizer, form.prompt) if form.prompt else []
    language = form.language or (None if speech.multilingual else "en")
    duration = samples.shape[0] / SAMPLING_RATE
    return Transcription(
        form, task, language, duration, features, speech, timed, previous, params, arrived
    )


def check_form(speech: SpeechModel, form: TranscriptionForm, task: str) -> None:
    """What the form asks that this model or this server cannot give: a 400 naming it."""
    if form.include:
        raise bad_request("include is not available: no field can be added", "include")
    if "word" in form.timestamp_granularities:
        raise bad_request(
            "word timestamps are not available yet; segment timestamps are",
            "timestamp_granularities",
            "unsupported",
        )
    if form.timestamp_granularities and form.response_format != "verbose_json":
        raise bad_request(
            "timestamp_granularities needs response_format verbose_json",
            "timestamp_granularities",
            "invalid_value",
        )
    if form.language is not None and speech.multilingual:
        if form.language not in speech.languages:
            raise bad_request(
                f"language {form.language!r} is not one of this model's: "
                f"{', '.join(sorted(speech.languages))}",
                "language",
                "invalid_value",
            )
    elif form.language not in (None, "en"):
        raise bad_request(
            f"this model is English-only: language {form.language!r} is not available",
            "language",
            "invalid_value",
        )
    if task == "translate" and not speech.multilingual:
        raise bad_request(
            "this model is English-only: it transcribes English and translates nothing",
            "model",
            "unsupported_model",
        )


async def engine_tokens(
    ctx: ServingContext, request_id: str, job: Job
) -> tuple[list[int], list[float]]:
    """A job's first choice: its tokens and (when asked for) their logprobs."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async with aclosing(run_jobs(ctx, request_id, [job])) as outputs:
        async for _, out in outputs:
            if out.error is not None:
                raise APIError(500, out.error, code="engine_error")
            if out.index == 0:
                tokens += out.token_ids
                logprobs += [lp.logprob for lp in out.logprobs or ()]
    return tokens, logprobs


async def detect_language(ctx: ServingContext, request_id: str, call: Transcription) -> None:
    """Find a multilingual model's language on the first window."""
    if call.language is not None:
        return
    speech = call.speech
    params = DecodingParams(
        max_tokens=1,
        temperature=0.0,
        allowed_token_ids=tuple(speech.languages.values()),
        ignore_eos=True,
        cache_salt=call.job.params.cache_salt,
    )
    job = Job(speech.engine_prompt([speech.start_of_transcript]), params, 0)
    job.source_len, job.source_features = call.job.source_len, call.job.source_features
    chosen, _ = await engine_tokens(ctx, f"{request_id}-language", job)
    call.language = next(c for c, token in speech.languages.items() if token == chosen[0])


async def windows(
    ctx: ServingContext, request_id: str, call: Transcription
) -> AsyncGenerator[list[Segment], None]:
    """Decode the audio window by window; yield each window's segments as it is done."""
    await detect_language(ctx, request_id, call)
    speech = call.speech
    end_of_text, begin = speech.end_of_text, speech.no_timestamps + 1
    seek, index = 0, 0
    kept = [call.previous[1:]] if call.previous else []  # `prompt`: the first segment's text
    while seek < call.frames:
        call.condition(kept)
        job, frames = call.window_job(seek)
        tokens, logprobs = await engine_tokens(ctx, f"{request_id}-{index}", job)
        if tokens and tokens[-1] == end_of_text:
            tokens = tokens[:-1]
        if not tokens:  # nothing said: the window is done whole
            seek += frames
            continue
        spans, offset = window_spans(tokens, begin, seek, frames)
        kept += [span.tokens for span in spans]
        yield segments_of(ctx, spans, logprobs, begin)
        seek += offset
        index += 1


def segments_of(
    ctx: ServingContext, spans: list[Span], logprobs: list[float], begin: int
) -> list[Segment]:
    """A window's spans (consecutive slices of its tokens) as segments with their text."""
    segments, at = [], 0
    for span in spans:
        text = ctx.tokenizer.decode([t for t in span.tokens if t < begin], skip_special_tokens=True)
        count = len(span.tokens)
        segments.append(
            Segment(span.start, span.end, span.tokens, str(text), logprobs[at : at + count])
        )
        at += count
    return segments


async def respond(ctx: ServingContext, request_id: str, call: Transcription) -> object:
    """The whole transcript, in the form's response format."""
    heard: list[Segment] = []
    async with aclosing(windows(ctx, request_id, call)) as decoded:
        async for segments in decoded:
            heard += segments
    call.record(ctx)
    begin = call.speech.no_timestamps + 1
    tokens = [t for s in heard for t in s.tokens if t < begin]
    text = str(ctx.tokenizer.decode(tokens, skip_special_tokens=True))
    language = LANGUAGES.get(call.language or "", call.language or "")
    info = Heard(call.task, language, call.duration, call.form.temperature)
    return render(call.form.response_format, info, text, heard)


async def stream(
    ctx: ServingContext, request_id: str, call: Transcription
) -> AsyncGenerator[str, None]:
    """OpenAI's transcription events: each window's text as a delta, then the whole text."""
    text = ""
    try:
        async with aclosing(windows(ctx, request_id, call)) as decoded:
            async for segments in decoded:
                delta = "".join(s.text for s in segments)
                delta = delta.lstrip() if not text else delta
                text += delta
                if delta:
                    yield sse({"type": "transcript.text.delta", "delta": delta})
    except APIError as exc:
        yield sse(exc.body())
        return
    call.record(ctx)
    yield sse({"type": "transcript.text.done", "text": text.strip()})
