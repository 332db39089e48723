"""What a request needs from the server (ServingContext) and the engine jobs an API request becomes.

Responses and streams are built in server/api/responses.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from decoding import DecodingParams
from decoding.grammar import Grammar
from server.api import tools
from server.api.context import ServingContext
from server.api.encoder_decoder import no_languages, refuse_chat, refuse_text
from server.api.errors import APIError, bad_request
from server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StructuredOutputs,
    new_id,
)
from server.api.request_params import Request, decoding_params
from server.api.structured import Constraint, compile_constraint, request_constraint
from server.api.tokenization import chat_prompt_ids, check_ids, encode_text

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# vLLM's older names of structured_outputs' members
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


# ---- request -> engine inputs ------------------------------------------------------------------
def check_model(ctx: ServingContext, model: str | None) -> str | None:
    """The name the engine runs the request with: a LoRA adapter or an extra model `model` names
    (None: the served model, or no model given); 404 when it names none of them, 400 when it
    names an extra model that cannot serve requests (named_models.py)."""
    if model is None or model == ctx.model_name:
        return None
    named = ctx.named_models.get(model)
    if named is not None and named.refusal is not None:
        raise APIError(
            400,
            f"model {model!r} is loaded on this server but cannot serve requests: {named.refusal}",
            param="model",
            code="model_not_supported",
        )
    adapters = ctx.engine.adapter_names()
    if named is not None or model in adapters:
        return model
    servable = [name for name, m in ctx.named_models.items() if m.refusal is None]
    served = ", ".join(repr(m) for m in [ctx.model_name, *servable, *sorted(adapters)])
    raise APIError(
        404,
        f"model {model!r} does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def reported_model(ctx: ServingContext, job: Job) -> str:
    """The `model` a response names: the adapter or extra model the request ran with, else the
    served model."""
    return job.model or ctx.model_name


def tokenize_prompt(
    ctx: ServingContext, prompt: str | list[int], param: str, add_special_tokens: bool = True
) -> list[int]:
    if isinstance(prompt, str):
        ids = encode_text(ctx.tokenizer, prompt, param, add_special_tokens)
    else:
        ids = list(prompt)
        check_ids(ctx, ids, param)
    if not ids or (isinstance(prompt, str) and not prompt):
        raise bad_request("prompt must not be empty", param, "empty_prompt")
    return ids


@dataclass
class Job:
    """One engine request: a prompt of the API request and the choice offset of its outputs."""

    prompt_ids: list[int]
    params: DecodingParams
    choice_offset: int
    echo_text: str = ""  # echo: the prompt (chat: the message continued), before each choice
    constraint: Constraint | None = None  # structured outputs / forced tool calls
    grammar: Grammar | None = None  # its compiled form (`compile_constraints`)
    tool_plan: tools.ToolPlan | None = None  # chat with tools: how calls are read from replies
    echo_logprobs: int | None = None  # completions with echo + logprobs k: the prompt's, top k
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs k, sent as its own field
    return_token_ids: bool = False  # vLLM's: prompt and output token ids in the response
    model: str | None = None  # the LoRA adapter or extra model it runs with (its `model`)
    source_len: int = 0  # an encoder-decoder model's source: the prompt's first ids
    source_features: torch.Tensor | None = None  # a speech model's window (server/audio/)

    @property
    def num_prompt_tokens(self) -> int:
        """What usage counts: the prompt (an encoder-decoder model's source)."""
        return self.source_len or len(self.prompt_ids)


def completion_jobs(ctx: ServingContext, req: CompletionRequest) -> list[Job]:
    model = check_model(ctx, req.model)
    if ctx.speech is not None:
        refuse_text()
    if req.suffix:
        raise bad_request(
            "suffix is not supported (no fill-in-the-middle)", "suffix", "unsupported"
        )
    prompts = req.prompts()
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt", "empty_prompt")
    if len(prompts) > ctx.config.max_prompts_per_request:
        raise bad_request(
            f"at most {ctx.config.max_prompts_per_request} prompts per request",
            "prompt",
            "too_many_prompts",
        )
    constraint = _constraint(req)
    source = ctx.encoder_decoder
    max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if source is not None and req.max_tokens is None and ctx.config.generation_config_defaults:
        max_tokens = source.default_max_tokens  # generate()'s max_length, as new tokens
    jobs = []
    if source is not None:
        scored = _prompt_logprobs(req.prompt_logprobs, req.logprobs, req.echo) is not None
        source.check_completion(max_tokens, req.echo, scored)
    for param in ("src_lang", "tgt_lang"):
        if getattr(req, param) is not None and source is None:
            raise bad_request(no_languages(param), param, "unsupported")
    forced = source.target_token(req.tgt_lang) if source is not None else None
    for i, prompt in enumerate(prompts):
        with source_language(ctx, req.src_lang, isinstance(prompt, str)):
            whole = tokenize_prompt(ctx, prompt, "prompt", req.add_special_tokens)
        ids = truncate_prompt(ctx, req, whole, max_tokens)
        source_len = 0
        if source is not None:
            source_len, ids = len(ids), source.job_prompt(ids)
        params = decoding_params(
            ctx,
            req,
            len(ids),
            max_tokens,
            req.logprobs,
            prompt_logprobs=_prompt_logprobs(req.prompt_logprobs, req.logprobs, req.echo),
        )
        if forced is not None:  # tgt_lang: generate()'s forced_bos_token_id
            params = dataclasses.replace(params, forced_bos_token_id=forced)
        echo = _echo_text(ctx, prompt if ids is whole else ids, ids) if req.echo else ""
        job = Job(ids, params, i * req.n, echo, constraint)
        job.echo_logprobs = req.logprobs if req.echo else None
        job.prompt_logprobs = req.prompt_logprobs
        job.return_token_ids = req.return_token_ids
        job.model = model
        job.source_len = source_len
        jobs.append(job)
    return jobs


def source_language(
    ctx: ServingContext, code: str | None, text: bool
) -> contextlib.AbstractContextManager[None]:
    """An encoder-decoder model's tokenizer set to the request's `src_lang` (nothing else)."""
    if ctx.encoder_decoder is None:
        return contextlib.nullcontext()
    return ctx.encoder_decoder.source_language(ctx.tokenizer, code, text)


def truncate_prompt(
    ctx: ServingContext, req: Request, ids: list[int], max_tokens: int | None
) -> list[int]:
    """vLLM's `truncate_prompt_tokens` k: the prompt's last k tokens (`truncation_side` "right":
    its first k); -1: as many as leave room for max_tokens (when unset, the server's default)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == 0 or k > ctx.max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or between 1 and this model's maximum context "
            f"length, {ctx.max_model_len} (got {k})",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    if k == -1:
        reserve = max_tokens if max_tokens is not None else ctx.config.default_max_tokens
        k = max(1, ctx.max_model_len - max(reserve, 1))
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[len(ids) - k :]


def _constraint(req: Request) -> Constraint | None:
    """The request's constraint; vLLM's older `guided_*` fields stand for `structured_outputs`
    (one of them at most, and not with structured_outputs or response_format)."""
    guided = [name for name in GUIDED_FIELDS if getattr(req, name) is not None]
    if not guided:
        return request_constraint(req)
    name = guided[0]
    other = guided[1:] or [
        field
        for field, given in (
            ("structured_outputs", req.structured_outputs is not None),
            (
                "response_format",
                req.response_format is not None and req.response_format.type != "text",
            ),
        )
        if given
    ]
    if other:
        raise bad_request(
            f"give one constraint: {name} and {other[0]} cannot both be set",
            other[0],
            "conflicting_fields",
        )
    member = StructuredOutputs.model_validate({GUIDED_FIELDS[name]: getattr(req, name)})
    constraint = request_constraint(req.model_copy(update={"structured_outputs": member}))
    return dataclasses.replace(constraint, param=name) if constraint is not None else None


def _prompt_logprobs(asked: int | None, logprobs: int | None, echo: bool) -> int | None:
    """Top alternatives each prompt token needs: `prompt_logprobs`, and with echo the legacy
    `logprobs` too (an echoed prompt carries its tokens' logprobs)."""
    needs = [k for k in (asked, logprobs if echo else None) if k is not None]
    return max(needs) if needs else None


def _echo_text(ctx: ServingContext, prompt: str | list[int], ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    text = ctx.tokenizer.decode(ids)
    assert isinstance(text, str)  # one id list decodes to one string
    return text


def chat_job(ctx: ServingContext, req: ChatCompletionRequest) -> Job:
    model = check_model(ctx, req.model)
    if ctx.speech is not None:
        refuse_text()
    if ctx.encoder_decoder is not None:
        refuse_chat()
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    plan = tools.plan_tools(req, ctx.tokenizer.chat_template)
    constraint = Constraint(plan.forced_spec, "tools") if plan.forced_spec else _constraint(req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    ids = truncate_prompt(ctx, req, chat_prompt_ids(ctx, req, plan), max_tokens)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = decoding_params(
        ctx,
        req,
        len(ids),
        max_tokens,
        logprobs,
        "top_logprobs",
        "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        prompt_logprobs=req.prompt_logprobs,
        prompt_param="messages",
    )
    return Job(
        ids,
        params,
        0,
        echo_text=_chat_echo(req),
        constraint=constraint,
        tool_plan=plan if plan.tools else None,
        prompt_logprobs=req.prompt_logprobs,
        return_token_ids=req.return_token_ids,
        model=model,
    )


def _chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message's text when it continues that
    message (the assistant's, or any with add_generation_prompt false)."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    continues = last.role == "assistant" or not req.add_generation_prompt
    return last.text() if continues else ""


async def compile_constraints(ctx: ServingContext, jobs: list[Job]) -> None:
    """Compile each job's constraint (jobs of one request share it) before any job runs."""
    for job in jobs:
        if job.constraint is not None:
            job.grammar = await compile_constraint(ctx, job.constraint)


def new_request_id(kind: str, client_id: str | None = None) -> str:
    """The response's id: vLLM's `request_id` after the prefix when the client gives one (the
    engine's own ids stay unique: responses.run_jobs)."""
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{client_id}" if client_id else new_id(prefix)
