"""The multipart forms of OpenAI's audio routes, as the openai SDK sends them: the upload in
`file`, every other field a form field (lists as repeated `name[]` fields), checked by pydantic
so that a wrong field is a 400 naming it, as for a JSON body. beamline's decoding fields
(`num_beams`, `best_of`, `length_penalty`, `lm_fusion` as JSON text) ride along as form
fields."""

from __future__ import annotations

from typing import Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, Json, ValidationError
from starlette.datastructures import UploadFile

from server.api.errors import bad_request
from server.api.fusion_models import LMFusionField

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
LIST_FIELDS = ("timestamp_granularities", "include")


class TranscriptionForm(BaseModel):
    """The fields of /v1/audio/transcriptions (translations take all but `language`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the served model's id (another is refused)")
    language: str | None = Field(
        None, description="the audio's language, ISO-639-1 ('en'); detected when absent"
    )
    prompt: str | None = Field(
        None, description="earlier text the transcript continues (Whisper's previous-text prompt)"
    )
    response_format: ResponseFormat = Field(
        "json", description="srt, vtt and verbose_json decode with timestamps and report segments"
    )
    temperature: float = Field(
        0.0, ge=0.0, le=1.0, description="the first attempt's (0: greedy or beams)"
    )
    timestamp_granularities: list[Literal["segment", "word"]] = Field(
        default_factory=list,
        description="sent as timestamp_granularities[], with verbose_json: segment (the default), "
        "word (the words' times, from the decoder's cross-attention), or both",
    )
    include: list[str] = Field(default_factory=list, description="none can be added: a 400")
    stream: bool = Field(
        False, description="transcript.text.delta events, a window's text each, then .done"
    )
    # beamline's decoding fields
    num_beams: int = Field(1, ge=1, le=16, description="beam search over this many beams")
    best_of: int | None = Field(
        None, ge=1, le=16, description="with temperature > 0: samples drawn, the likeliest kept"
    )
    length_penalty: float = Field(1.0, description="beam scores divided by length ** this")
    condition_on_previous_text: bool = Field(
        False, description="each window's prompt holds the text of the windows before it"
    )
    temperature_increment_on_fallback: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="a window that fails a threshold below is decoded again this much hotter, "
        "up to 1 (0: never)",
    )
    compression_ratio_threshold: float = Field(
        1.35, description="fails above it: the zlib ratio of its token ids (generate()'s measure)"
    )
    logprob_threshold: float = Field(
        -1.0, description="fails below it: its average log-probability (beams: their score)"
    )
    lm_fusion: Json[LMFusionField] | None = Field(
        None,
        description="an extra model fused into every step, as on the text routes: its JSON text, "
        'e.g. {"model": "lm", "weight": 0.3} (a language model with the speech model\'s '
        "vocabulary, reading the decoder's tokens)",
    )
    no_speech_threshold: float = Field(
        0.6,
        ge=0.0,
        le=1.0,
        description="below the log-probability threshold and above this <|nospeech|> "
        "probability: the window is silence, skipped",
    )


class TranslationForm(TranscriptionForm):
    language: None = Field(None, description="not a field of translations")


async def read_form(
    request: Request, form_class: type[TranscriptionForm]
) -> tuple[TranscriptionForm, bytes, str]:
    """The form's fields, its upload's bytes and file name; a 400 for a body that is not a
    multipart form, a missing or second file, or a field pydantic refuses."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise bad_request(
            "send the audio as a multipart form (Content-Type: multipart/form-data) with the "
            "file in the field `file`, as OpenAI's audio routes take it",
            None,
            "invalid_content_type",
        )
    form = await request.form()
    uploads = form.getlist("file")
    if len(uploads) != 1 or not isinstance(uploads[0], UploadFile):
        problem = "is missing" if not uploads else "must be one uploaded file"
        raise bad_request(f"file {problem}: the audio to transcribe", "file", "invalid_file")
    fields: dict[str, object] = {}
    for key in {k for k in form.keys() if k != "file"}:
        name = key.removesuffix("[]")
        values = [v for v in form.getlist(key) if isinstance(v, str)]
        if len(values) != len(form.getlist(key)):
            raise bad_request(f"{name} must be a form field, not a file", name, "invalid_value")
        fields[name] = values if name in LIST_FIELDS else values[-1]
    try:
        parsed = form_class.model_validate(fields)
    except ValidationError as exc:
        for error in exc.errors():
            if error["type"] == "json_invalid":  # a field sent as JSON text (lm_fusion)
                name = str(error["loc"][0])
                reason = (error.get("ctx") or {}).get("error", "invalid JSON")
                message = f"{name} is not valid JSON: {reason}"
                raise bad_request(message, name, "invalid_json") from None
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None
    upload = uploads[0]
    return parsed, await upload.read(), upload.filename or "audio"
