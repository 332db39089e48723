"""OpenAI's audio routes on a Whisper model: an upload decoded into log-mel features, then
decoded window by window (window_decoding.py), the transcript returned in the asked format or
streamed as OpenAI's `transcript.text.delta` events, a window's text once the window is decoded.

Audio up to one window long decodes with timestamps when its response format reports times
(srt, vtt, verbose_json) and without otherwise, as `generate()` does short audio; longer audio
always decodes with them (they say where the next window starts). As OpenAI's `temperature` 0
does, a window is decoded hotter while its attempt looks wrong (the fallback's thresholds,
server/audio/fallback.py); the form says how.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from transformers.models.whisper.tokenization_whisper import LANGUAGES

from decoding import DecodingParams
from server.api.audio_forms import TranscriptionForm
from server.api.errors import APIError, bad_request
from server.api.fusion_models import lm_fusion_params
from server.api.request_params import check_rows_fit
from server.api.serving import ServingContext, check_model
from server.api.streaming import sse
from server.api.transcript_formats import Heard, render
from server.api.window_decoding import Transcription, windows
from server.audio.decode import SAMPLING_RATE, AudioError, decode_audio
from server.audio.fallback import FallbackRules
from server.audio.features import audio_features
from server.audio.segments import Segment
from server.audio.speech_model import SpeechModel

# the response formats that carry segments' times: short audio decodes with timestamps for them
TIMED_FORMATS = ("srt", "vtt", "verbose_json")


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
    check_fits_kv_pool(ctx, speech, form)
    try:
        samples = await asyncio.to_thread(decode_audio, data, ctx.config.max_audio_seconds)
    except AudioError as exc:
        raise bad_request(str(exc), "file", "invalid_audio") from None
    features, long = await asyncio.to_thread(audio_features, speech.extractor, samples)
    timed = long or form.response_format in TIMED_FORMATS
    params = DecodingParams(  # each attempt sets its temperature and strategy (window_decoding.py)
        **speech.defaults(),
        length_penalty=form.length_penalty,
        logprobs=0,  # the fallback averages them (and verbose_json reports them)
        logprobs_mode="processed",
        timestamp_rules=speech.timestamp_rules() if timed else None,
        lm_fusion=lm_fusion_params(ctx.fusion_models, form.lm_fusion),
    )
    rules = FallbackRules.of(
        form.temperature,
        form.temperature_increment_on_fallback,
        form.compression_ratio_threshold,
        form.logprob_threshold,
        form.no_speech_threshold,
    )
    prompt = speech.previous_text(ctx.tokenizer, form.prompt) if form.prompt else []
    language = form.language or (None if speech.multilingual else "en")
    duration = samples.shape[0] / SAMPLING_RATE
    return Transcription(
        form, task, language, duration, features, speech, timed, prompt, params, rules, arrived
    )


def check_fits_kv_pool(ctx: ServingContext, speech: SpeechModel, form: TranscriptionForm) -> None:
    """Refuse beams or samples the KV pool cannot hold, each row a whole window (its source and
    the decoder's positions): after a preemption every row recomputes its own."""
    for param, width in (("num_beams", form.num_beams), ("best_of", form.best_of or 1)):
        check_rows_fit(ctx, width, speech.window_tokens, param)


def check_form(speech: SpeechModel, form: TranscriptionForm, task: str) -> None:
    """What the form asks that this model or this server cannot give: a 400 naming it."""
    if form.include:
        raise bad_request("include is not available: no field can be added", "include")
    if "word" in form.timestamp_granularities and form.stream:
        raise bad_request(
            "word timestamps are not streamed: a stream's events carry text only",
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
    info = Heard(call.task, language, call.duration)
    granularities = call.form.timestamp_granularities or ["segment"]
    return render(call.form.response_format, info, text, heard, granularities)


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
