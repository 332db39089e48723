"""What a request needs from the server (ServingContext) and the engine jobs an API request becomes.

Responses and streams are built in server/api/responses.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from decoding import DecodingParams
from decoding.grammar import Grammar
from server.api import tools
from server.api.context import ServingContext
from server.api.errors import APIError, bad_request
from server.api.protocol import ChatCompletionRequest, CompletionRequest, new_id
from server.api.request_params import decoding_params
from server.api.structured import Constraint, compile_constraint, request_constraint
from server.api.tokenization import chat_prompt_ids, check_ids, encode_text


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
        ids = encode_text(ctx.tokenizer, prompt, param)
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
    echo_text: str = ""  # completions with echo: the prompt text, sent before each choice
    constraint: Constraint | None = None  # structured outputs / forced tool calls
    grammar: Grammar | None = None  # its compiled form (`compile_constraints`)
    tool_plan: tools.ToolPlan | None = None  # chat with tools: how calls are read from replies
    echo_logprobs: int | None = None  # completions with echo + logprobs k: the prompt's, top k
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs k, sent as its own field


def completion_jobs(ctx: ServingContext, req: CompletionRequest) -> list[Job]:
    check_model(ctx, req.model)
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
    constraint = request_constraint(req)
    jobs = []
    for i, prompt in enumerate(prompts):
        ids = tokenize_prompt(ctx, prompt, "prompt")
        params = decoding_params(
            ctx,
            req,
            len(ids),
            16 if req.max_tokens is None else req.max_tokens,
            req.logprobs,
            prompt_logprobs=_prompt_logprobs(req.prompt_logprobs, req.logprobs, req.echo),
        )
        echo = _echo_text(ctx, prompt, ids) if req.echo else ""
        job = Job(ids, params, i * req.n, echo, constraint)
        job.echo_logprobs = req.logprobs if req.echo else None
        job.prompt_logprobs = req.prompt_logprobs
        jobs.append(job)
    return jobs


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
        prompt_logprobs=req.prompt_logprobs,
    )
    return Job(
        ids,
        params,
        0,
        constraint=constraint,
        tool_plan=plan if plan.tools else None,
        prompt_logprobs=req.prompt_logprobs,
    )


async def compile_constraints(ctx: ServingContext, jobs: list[Job]) -> None:
    """Compile each job's constraint (jobs of one request share it) before any job runs."""
    for job in jobs:
        if job.constraint is not None:
            job.grammar = await compile_constraint(ctx, job.constraint)


def new_request_id(kind: str) -> str:
    return new_id("chatcmpl" if kind == "chat" else "cmpl")
