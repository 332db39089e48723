"""A transcript in each of OpenAI's response formats: json, text, verbose_json (segments or
words or both, the task, language and duration), srt and vtt (subtitles of the segments). A
window decoded without timestamps is one segment spanning the audio."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse

from server.audio.segments import Segment


@dataclass(frozen=True)
class Heard:
    """What a response reports besides the text: the task, the language's name, the audio's
    seconds."""

    task: str
    language: str
    duration: float


def render(
    response_format: str,
    call: Heard,
    text: str,
    heard: list[Segment],
    granularities: Sequence[str] = ("segment",),
) -> JSONResponse | PlainTextResponse:
    """The response; verbose_json reports the segments, the words, or both (`granularities`)."""
    text = text.strip()
    form = response_format
    if form == "text":
        return PlainTextResponse(text + "\n")
    segments = [segment(call, i, part) for i, part in enumerate(heard)]
    if form == "srt":
        return PlainTextResponse(subtitles(segments, ",", numbered=True), media_type="text/plain")
    if form == "vtt":
        cues = subtitles(segments, ".", numbered=False)
        return PlainTextResponse("WEBVTT\n\n" + cues, media_type="text/vtt")
    usage = {"type": "duration", "seconds": math.ceil(call.duration)}
    if form == "json":
        return JSONResponse({"text": text, "usage": usage})
    body: dict[str, Any] = {
        "task": call.task,
        "language": call.language,
        "duration": round(call.duration, 3),
        "text": text,
        "usage": usage,
    }
    if "word" in granularities:
        body["words"] = [
            {"word": w.word, "start": min(w.start, call.duration), "end": min(w.end, call.duration)}
            for part in heard
            for w in part.words
        ]
    if "segment" in granularities:
        body["segments"] = segments
    return JSONResponse(body)


def segment(call: Heard, index: int, part: Segment) -> dict[str, Any]:
    """verbose_json's segment."""
    text = part.text.strip()
    data = text.encode()
    logprobs = part.logprobs
    return {
        "id": index,
        "seek": part.seek,
        "start": round(min(part.start, call.duration), 3),  # a window is 30 s, its audio less
        "end": round(min(part.end, call.duration), 3),
        "text": text,
        "tokens": part.tokens,
        "temperature": part.temperature,
        "avg_logprob": sum(logprobs) / len(logprobs) if logprobs else 0.0,
        "compression_ratio": len(data) / len(zlib.compress(data)) if data else 0.0,
        "no_speech_prob": part.no_speech_prob,
    }


def subtitles(segments: list[dict[str, Any]], decimal: str, numbered: bool) -> str:
    cues = []
    for i, seg in enumerate(segments, 1):
        span = f"{stamp(seg['start'], decimal)} --> {stamp(seg['end'], decimal)}"
        cues.append(f"{i}\n{span}\n{seg['text']}\n" if numbered else f"{span}\n{seg['text']}\n")
    return "\n".join(cues)


def stamp(seconds: float, decimal: str) -> str:
    """hh:mm:ss,mmm (srt) or hh:mm:ss.mmm (vtt)."""
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"
