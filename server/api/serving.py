"""What a request needs from the server (ServingContext) and the engine jobs an API request becomes.

Responses and streams are built in server/api/responses.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from decoding import DecodingParams
from decoding.grammar import Grammar
from server.api import tools
from server.api.context import ServingContext
from server.api.errors import APIError, bad_request
from server.api.protocol import ChatCompletionRequest, CompletionRequest, new_id
from server.api.request_params import decoding_params
from server.api.structured import Constraint, compile_constraint, request_constraint


# ---- request -> engine inputs ------------------------------------------------------------------
def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )


def tokenize_prompt(ctx: ServingContext, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        try:
            ids = ctx.tokenizer(prompt, add_special_tokens=True).input_ids
        except Exception as exc:  # e.g. lone surrogates that cannot be encoded
            raise bad_request(
                f"prompt cannot be tokenized: {exc}", param, "invalid_prompt"
            ) from exc
    else:
        ids = list(prompt)
        bad = [t for t in ids if t >= ctx.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is out of the vocabulary (size {ctx.vocab_size})",
                param,
                "invalid_token",
            )
    if not ids or (isinstance(prompt, str) and not prompt):
        raise bad_request("prompt must not be empty", param, "empty_prompt")
    return ids


def chat_prompt_ids(
    ctx: ServingContext, req: ChatCompletionRequest, plan: tools.ToolPlan
) -> list[int]:
    if ctx.tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    if req.continue_final_message:
        if req.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
                "invalid_value",
            )
        if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
                "conflicting_fields",
            )
    try:
        ids = ctx.tokenizer.apply_chat_template(
            tools.template_messages(req, plan),
            tools=tools.template_tools(plan),
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            tokenize=True,
            return_dict=False,
        )
    except Exception as exc:  # template errors (e.g. role order) are the client's to fix
        raise bad_request(
            f"messages cannot be formatted by the chat template: {exc}", "messages"
        ) from exc
    if isinstance(ids, Mapping):  # a BatchEncoding, from versions that ignore return_dict
        ids = ids["input_ids"]
    return list(ids)


@dataclass
class Job:
    """One engine request: a prompt of the API request and the choice offset of its outputs."""

    prompt_ids: list[int]
    params: DecodingParams
    choice_offset: int
    echo_text: str = ""  # completions with echo: the prompt text, sent before each choice
    constraint: Constraint | None = None  # structured outputs / forced tool calls
    grammar: Grammar | None = None  # its compiled form (`compile_constraints`)
    tool_plan: tools.ToolPlan | None = None  # chat with tools: how calls are read from replies


def completion_jobs(ctx: ServingContext, req: CompletionRequest) -> list[Job]:
    check_model(ctx, req.model)
    if req.suffix:
        raise bad_request(
            "suffix is not supported (no fill-in-the-middle)", "suffix", "unsupported"
        )
    if req.echo and req.logprobs is not None:
        raise bad_request(
            "echo together with logprobs is not supported (no prompt logprobs)",
            "echo",
            "unsupported",
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
    constraint = request_constraint(req)
    jobs = []
    for i, prompt in enumerate(prompts):
        ids = tokenize_prompt(ctx, prompt, "prompt")
        params = decoding_params(ctx, req, len(ids), req.max_tokens or 16, req.logprobs)
        echo = _echo_text(ctx, prompt, ids) if req.echo else ""
        jobs.append(Job(ids, params, i * req.n, echo, constraint))
    return jobs


def _echo_text(ctx: ServingContext, prompt: str | list[int], ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    text = ctx.tokenizer.decode(ids)
    assert isinstance(text, str)  # one id list decodes to one string
    return text


def chat_job(ctx: ServingContext, req: ChatCompletionRequest) -> Job:
    check_model(ctx, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    plan = tools.plan_tools(req, ctx.tokenizer.chat_template)
    constraint = (
        Constraint(plan.forced_spec, "tools") if plan.forced_spec else request_constraint(req)
    )
    ids = chat_prompt_ids(ctx, req, plan)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = decoding_params(
        ctx,
        req,
        len(ids),
        req.max_completion_tokens or req.max_tokens,
        logprobs,
        "top_logprobs",
        "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
    )
    return Job(ids, params, 0, constraint=constraint, tool_plan=plan if plan.tools else None)


async def compile_constraints(ctx: ServingContext, jobs: list[Job]) -> None:
    """Compile each job's constraint (jobs of one request share it) before any job runs."""
    for job in jobs:
        if job.constraint is not None:
            job.grammar = await compile_constraint(ctx, job.constraint)


def new_request_id(kind: str) -> str:
    return new_id("chatcmpl" if kind == "chat" else "cmpl")
