"""OpenAI's audio routes on a Whisper model: an upload decoded and turned into a 30-second
window's features, the window decoded as an engine request (its beams, or its `best_of` samples,
inside the batch with every other request), the transcript returned in the asked format or
streamed as OpenAI's `transcript.text.delta` events.

Without `language`, a multilingual model's language is detected first, as `generate()` does: one
greedy step after `<|startoftranscript|>` restricted to the language tokens, an engine request of
its own over the same window (its encoder's blocks are the prefix cache's when the transcription
starts). The audio's length is bounded by `max_audio_seconds`; windows of longer audio are not
decoded yet, so a longer file is a 400 that says the limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from transformers.models.whisper.tokenization_whisper import LANGUAGES

from decoding import DecodingParams
from server.api.audio_forms import TranscriptionForm
from server.api.errors import APIError, bad_request
from server.api.responses import run_jobs
from server.api.serving import Job, ServingContext, check_model
from server.api.streaming import sse
from server.api.transcript_formats import Heard, render
from server.audio.decode import SAMPLING_RATE, AudioError, decode_audio
from server.audio.features import window_features, window_seconds
from server.audio.segments import Segment, split_segments
from server.audio.speech_model import SpeechModel, window_salt

# the response formats that carry segments' times: their windows decode with timestamps
TIMED_FORMATS = ("srt", "vtt", "verbose_json")


@dataclass
class Transcription:
    """A prepared request of an audio route: its engine job (its language's token in its
    prompt once known), what the response reports."""

    form: TranscriptionForm
    task: str  # transcribe | translate
    language: str | None  # None until detected
    duration: float  # seconds of audio
    job: Job
    speech: SpeechModel
    timed: bool  # decoded with timestamps: its response has segments' times
    arrived: float = dataclasses.field(default_factory=time.monotonic)

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
    """Check the form, decode the audio (off the event loop) and make the window's job."""
    arrived = time.monotonic()
    speech = require_speech(ctx)
    check_model(ctx, form.model)
    check_form(speech, form, task)
    limit = min(ctx.config.max_audio_seconds, window_seconds(speech.extractor))
    try:
        samples = await asyncio.to_thread(decode_audio, data, limit)
    except AudioError as exc:
        raise bad_request(str(exc), "file", "invalid_audio") from None
    features = await asyncio.to_thread(window_features, speech.extractor, samples)
    sampled = form.temperature > 0
    timed = form.response_format in TIMED_FORMATS
    decoder_prompt = speech.decoder_prompt(form.language, task, timed)
    if form.prompt:
        decoder_prompt = speech.previous_text(ctx.tokenizer, form.prompt) + decoder_prompt
    fields = {
        **speech.defaults(),
        "max_tokens": speech.max_target_positions - len(decoder_prompt),
        "temperature": form.temperature,
        "do_sample": sampled,
        "num_beams": form.num_beams,
        "best_of": form.best_of if sampled else None,
        "length_penalty": form.length_penalty,
        "logprobs": 0 if form.response_format == "verbose_json" else None,
        "cache_salt": window_salt(features),
        "timestamp_rules": speech.timestamp_rules() if timed else None,
    }
    job = Job(speech.engine_prompt(decoder_prompt), DecodingParams(**fields), 0)
    job.source_len, job.source_features = speech.source_positions, features
    language = form.language or (None if speech.multilingual else "en")
    duration = samples.shape[0] / SAMPLING_RATE
    return Transcription(form, task, language, duration, job, speech, timed, arrived)


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


async def detect_language(ctx: ServingContext, request_id: str, call: Transcription) -> None:
    """Find a multilingual model's language for the window and put it into the job's prompt."""
    if call.language is not None:
        return
    speech = call.speech
    tokens = tuple(speech.languages.values())
    params = DecodingParams(
        max_tokens=1,
        temperature=0.0,
        allowed_token_ids=tokens,
        ignore_eos=True,
        cache_salt=call.job.params.cache_salt,
    )
    job = Job(speech.engine_prompt([speech.start_of_transcript]), params, 0)
    job.source_len, job.source_features = call.job.source_len, call.job.source_features
    chosen: list[int] = []
    async with aclosing(run_jobs(ctx, f"{request_id}-language", [job])) as outputs:
        async for _, out in outputs:
            if out.error is not None:
                raise APIError(500, out.error, code="engine_error")
            chosen += out.token_ids
    code = next(c for c, token in speech.languages.items() if token == chosen[0])
    call.language = code
    start = len(call.job.prompt_ids) - len(speech.decoder_prompt(None, call.task, call.timed))
    prompt = speech.decoder_prompt(code, call.task, call.timed)
    call.job.prompt_ids = call.job.prompt_ids[:start] + prompt
    call.job.params = dataclasses.replace(
        call.job.params, max_tokens=call.job.params.max_tokens - 1
    )


async def respond(ctx: ServingContext, request_id: str, call: Transcription) -> object:
    """The whole transcript, in the form's response format."""
    await detect_language(ctx, request_id, call)
    text, tokens, logprobs = "", [], []
    async with aclosing(run_jobs(ctx, request_id, [call.job])) as outputs:
        async for _, out in outputs:
            if out.error is not None:
                raise APIError(500, out.error, code="engine_error")
            if out.index == 0:
                text += out.text
                tokens += out.token_ids
                logprobs += [lp.logprob for lp in out.logprobs or ()]
    call.record(ctx)
    language = LANGUAGES.get(call.language or "", call.language or "")
    heard = Heard(call.task, language, call.duration, call.form.temperature)
    if call.timed:
        speech = call.speech
        segments = split_segments(
            tokens,
            logprobs,
            speech.no_timestamps + 1,
            speech.end_of_text,
            call.duration,
            lambda ids: str(ctx.tokenizer.decode(ids, skip_special_tokens=True)),
        )
    else:
        segments = [Segment(0.0, call.duration, tokens, text, logprobs)]
    return render(call.form.response_format, heard, text, segments)


async def stream(
    ctx: ServingContext, request_id: str, call: Transcription
) -> AsyncGenerator[str, None]:
    """OpenAI's transcription events: a delta per output, then the whole text."""
    await detect_language(ctx, request_id, call)
    text = ""
    async with aclosing(run_jobs(ctx, request_id, [call.job])) as outputs:
        async for _, out in outputs:
            if out.error is not None:
                yield sse(APIError(500, out.error, code="engine_error").body())
                return
            if out.index == 0 and out.text:
                delta = out.text.lstrip() if not text else out.text
                text += out.text
                if delta:
                    yield sse({"type": "transcript.text.delta", "delta": delta})
    call.record(ctx)
    yield sse({"type": "transcript.text.done", "text": text.strip()})
