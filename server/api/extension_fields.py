"""Every request field of /v1/completions and /v1/chat/completions beyond the OpenAI fields this
server implements: vLLM's extensions, beamline's own (Hugging Face `generate()` names), and the
OpenAI fields that change nothing here or are refused. One entry per field says what it does
here; the docs' table (docs/reference/request-fields.md) is generated from this list
(server/api/field_docs.py) and
tests/test_extension_fields.py holds it to the request models and to vLLM's own field names.

The rule: a field is implemented with vLLM's meaning, or accepted because it changes nothing in
what this server returns, or refused (a 400 naming it) because it would change the response and
is not implemented. Refused fields are not declared on the request models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["completions", "chat"]
Status = Literal["implemented", "no effect", "refused"]
Origin = Literal["vLLM", "OpenAI", "beamline"]

COMPLETIONS: tuple[Endpoint, ...] = ("completions",)
CHAT: tuple[Endpoint, ...] = ("chat",)
BOTH: tuple[Endpoint, ...] = ("completions", "chat")

# The OpenAI fields each endpoint implements (docs/reference/request-fields.md explains them);
# `stream_options.include_usage` is one too.
OPENAI_FIELDS: dict[Endpoint, frozenset[str]] = {
    "completions": frozenset(
        {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs"}
        | {"max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options"}
        | {"suffix", "temperature", "top_p", "stream_options.include_usage"}
    ),
    "chat": frozenset(
        {"model", "messages", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs"}
        | {"max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format"}
        | {"seed", "stop", "stream", "stream_options", "temperature", "top_p", "tools"}
        | {"tool_choice", "parallel_tool_calls", "stream_options.include_usage"}
    ),
}


@dataclass(frozen=True)
class ExtensionField:
    name: str  # dotted for a member of an object field (`stream_options.continuous_usage_stats`)
    endpoints: tuple[Endpoint, ...]
    status: Status
    origin: Origin  # vLLM when vLLM has it (main or an older release), else who defines it
    meaning: str  # what it does here, one line
    example: object = True  # a value the request models take (tests send it)


def _f(
    name: str,
    endpoints: tuple[Endpoint, ...],
    status: Status,
    origin: Origin,
    meaning: str,
    example: object = True,
) -> ExtensionField:
    return ExtensionField(name, endpoints, status, origin, meaning, example)


WORKS: Status = "implemented"
NOOP: Status = "no effect"
REFUSED: Status = "refused"
# origins, short for the table below
VL: Origin = "vLLM"
OA: Origin = "OpenAI"
BL: Origin = "beamline"
NO_MODEL = "this model server has no"

# fmt: off
FIELDS: tuple[ExtensionField, ...] = (
    # ---- vLLM's sampling fields ----
    _f("top_k", BOTH, WORKS, VL, "sample among the k likeliest tokens; 0 or -1: off", 40),
    _f("min_p", BOTH, WORKS, VL, "drop tokens below min_p x the top token's probability", 0.05),
    _f("repetition_penalty", BOTH, WORKS, VL, "HF's penalty over prompt + output tokens", 1.1),
    _f("length_penalty", BOTH, WORKS, VL, "beam scores divided by length ** length_penalty", 1.0),
    _f("min_tokens", BOTH, WORKS, VL, "no EOS, stop id or stop string before this many tokens", 2),
    _f("stop_token_ids", BOTH, WORKS, VL, "extra ids that end a choice (in token_ids, not text)",
       [1]),
    _f("ignore_eos", BOTH, WORKS, VL, "keep generating past the model's EOS"),
    _f("bad_words", BOTH, WORKS, VL, "strings never generated (with and without a leading space)",
       ["x"]),
    _f("allowed_token_ids", BOTH, WORKS, VL, "only these ids may be generated (EOS too)", [5, 6]),
    _f("include_stop_str_in_output", BOTH, WORKS, VL, "the stop string (or stop id's text) ends "
       "the text instead of being cut"),
    _f("skip_special_tokens", BOTH, WORKS, VL, "false: special tokens' text is kept in the output",
       False),
    _f("spaces_between_special_tokens", BOTH, WORKS, VL, "slow tokenizers' spacing of kept "
       "special tokens; fast tokenizers have no such option (as in vLLM)", False),
    _f("truncate_prompt_tokens", BOTH, WORKS, VL, "keep the prompt's last k tokens (-1: as many "
       "as fit with max_tokens)", 4),
    _f("truncation_side", BOTH, WORKS, VL, "\"left\" (default) keeps the last k tokens, \"right\" "
       "the first k", "right"),
    _f("use_beam_search", BOTH, WORKS, VL, "beam search of width n (num_beams = n; greedy at n 1)"),
    _f("prompt_logprobs", BOTH, WORKS, VL, "every prompt token's logprob and its top k", 1),
    _f("logprob_token_ids", BOTH, REFUSED, VL, "logprobs of given token ids: not implemented"),
    _f("watermarking", BOTH, REFUSED, VL, "output watermarks: not implemented"),
    _f("thinking_token_budget", BOTH, REFUSED, VL, "reasoning budgets: not implemented"),
    _f("repetition_detection", BOTH, REFUSED, VL, "early stop on repeated n-grams: not "
       "implemented"),
    # ---- vLLM's extra fields ----
    _f("add_special_tokens", BOTH, WORKS, VL, "completions (default true): BOS added; chat "
       "(default false): a BOS before the template's output unless it has one"),
    _f("echo", CHAT, WORKS, VL, "the reply's text starts with the last message's when it "
       "continues it (an assistant message, or add_generation_prompt false)"),
    _f("add_generation_prompt", CHAT, WORKS, VL, "the template's assistant turn opener (default "
       "true)", False),
    _f("continue_final_message", CHAT, WORKS, VL, "the reply continues the last (assistant) "
       "message"),
    _f("documents", CHAT, WORKS, VL, "given to the chat template (RAG templates read them)",
       [{"title": "t", "text": "x"}]),
    _f("chat_template_kwargs", CHAT, WORKS, VL, "extra variables for the chat template, e.g. "
       "enable_thinking", {"enable_thinking": False}),
    _f("chat_template", CHAT, REFUSED, VL, "per-request templates are code run on the server: "
       "only the model's template"),
    _f("reasoning_effort", CHAT, WORKS, OA, "given to the chat template, and enable_thinking = "
       "effort != \"none\" unless chat_template_kwargs sets it (vLLM's meaning)", "low"),
    _f("include_reasoning", CHAT, WORKS, VL, "true only: replies are never split into reasoning "
       "and content here (false is a 400)"),
    _f("response_format", COMPLETIONS, WORKS, VL, "as chat's: text, json_object or json_schema "
       "(structural_tag is a 400)", {"type": "json_object"}),
    _f("structured_outputs", BOTH, WORKS, VL, "exactly one of json, regex, choice, grammar (Lark)",
       {"regex": "[a-z]+"}),
    _f("guided_json", BOTH, WORKS, VL, "older name of structured_outputs.json", {"type": "object"}),
    _f("guided_regex", BOTH, WORKS, VL, "older name of structured_outputs.regex", "[a-z]+"),
    _f("guided_choice", BOTH, WORKS, VL, "older name of structured_outputs.choice", ["a", "b"]),
    _f("guided_grammar", BOTH, WORKS, VL, "older name of structured_outputs.grammar",
       "start: \"a\""),
    _f("guided_decoding_backend", BOTH, NOOP, VL, "llguidance always compiles the constraint",
       "xgrammar"),
    _f("guided_whitespace_pattern", BOTH, REFUSED, VL, "JSON is generated compact; another "
       "whitespace pattern is not implemented"),
    _f("structural_tag", CHAT, REFUSED, VL, "structural tags (also as a response_format type): "
       "not implemented"),
    _f("logits_processors", BOTH, REFUSED, VL, "server-side code named by the client: never"),
    _f("priority", BOTH, WORKS, VL, "waiting requests start lowest value first, then by arrival "
       "(running ones are not preempted for it)", -1),
    _f("request_id", BOTH, WORKS, VL, "the response id becomes cmpl-ID / chatcmpl-ID "
       "(letters, digits, ._:- up to 128)", "my-id.1"),
    _f("return_token_ids", BOTH, WORKS, VL, "token_ids on each choice (chunk: its new tokens) and "
       "prompt_token_ids (completions: on the choice; chat: on the response or first chunk)"),
    _f("return_tokens_as_token_ids", BOTH, REFUSED, VL, "token_id:N strings in logprobs: not "
       "implemented"),
    _f("return_prompt_text", CHAT, REFUSED, VL, "the templated prompt in the response: not "
       "implemented (POST /tokenize returns its tokens)"),
    _f("cache_salt", BOTH, WORKS, VL, "prefix-cache entries are shared only by requests with the "
       "same salt", "salt"),
    _f("session_id", BOTH, NOOP, VL, "a routing hint for multi-replica deployments", "s1"),
    _f("stream_interval", BOTH, NOOP, VL, "chunks are sent as tokens come; the text is the same",
       4),
    _f("routed_experts_prompt_start", BOTH, NOOP, VL, "this model server has no routed-expert "
       "data", 1),
    _f("return_token_offsets", BOTH, NOOP, VL, "only vLLM's /render endpoints use it"),
    _f("return_mm_kwargs", BOTH, NOOP, VL, "only vLLM's /render endpoints use it", False),
    _f("mm_processor_kwargs", CHAT, NOOP, VL, "text-only: no media can be sent", {"k": 1}),
    _f("media_io_kwargs", CHAT, NOOP, VL, "text-only: no media can be sent", {"image": {}}),
    _f("prompt_embeds", COMPLETIONS, REFUSED, VL, "embedding prompts: not implemented"),
    _f("kv_transfer_params", BOTH, REFUSED, VL, "disaggregated prefill: not implemented"),
    _f("ec_transfer_params", BOTH, REFUSED, VL, "encoder-cache transfer: not implemented"),
    _f("vllm_xargs", BOTH, REFUSED, VL, "arguments of custom vLLM extensions: none here"),
    _f("stream_options.continuous_usage_stats", BOTH, WORKS, VL, "with include_usage: every chunk "
       "carries usage so far"),
    _f("best_of", CHAT, WORKS, VL, "sample best_of, return the n likeliest", 2),
    # ---- beamline's own (Hugging Face generate() names) ----
    _f("typical_p", BOTH, WORKS, BL, "locally typical sampling", 0.9),
    _f("no_repeat_ngram_size", BOTH, WORKS, BL, "no n-gram of this size twice", 3),
    _f("bad_words_ids", BOTH, WORKS, BL, "token-id sequences never generated", [[5]]),
    _f("num_beams", BOTH, WORKS, BL, "beam search (with do_sample: beam sampling)", 2),
    _f("num_beam_groups", BOTH, WORKS, BL, "diverse (group) beam search", 1),
    _f("diversity_penalty", BOTH, WORKS, BL, "Hamming diversity between beam groups", 0.0),
    _f("early_stopping", BOTH, WORKS, BL, "beam search stopping: true, false or \"never\"",
       "never"),
    _f("do_sample", BOTH, WORKS, BL, "sample (true) or not; with num_beams: beam sampling", False),
    _f("lm_fusion", BOTH, WORKS, BL, "{model, weight, plausibility}: an extra model's log-probs "
       "times weight added to the model's at every step, for every strategy (LM fusion; a "
       "negative weight with plausibility: contrastive decoding)", {"model": "lm", "weight": 0.3}),
    _f("src_lang", COMPLETIONS, WORKS, BL, "translation models (NLLB, M2M100, mBART): the "
       "source's language code, its token put in the source as the tokenizer does", "fra_Latn"),
    _f("tgt_lang", COMPLETIONS, WORKS, BL, "translation models: the language to write, its "
       "code's token forced first (generate()'s forced_bos_token_id)", "deu_Latn"),
    # ---- OpenAI's ----
    _f("user", BOTH, NOOP, OA, "an end-user id for the provider's abuse monitoring", "u"),
    _f("metadata", BOTH, NOOP, OA, "tags for stored completions; nothing is stored", {"k": "v"}),
    _f("store", BOTH, NOOP, OA, "nothing is stored for later retrieval here"),
    _f("service_tier", BOTH, NOOP, OA, "one tier here", "auto"),
    _f("prompt_cache_key", BOTH, NOOP, OA, "the prefix cache matches tokens, not keys", "k"),
    _f("safety_identifier", BOTH, NOOP, OA, "an end-user id for abuse monitoring", "s"),
    _f("prediction", BOTH, NOOP, OA, "a latency hint; outputs are the same",
       {"type": "content", "content": "x"}),
    _f("stream_options.include_obfuscation", BOTH, NOOP, OA, "chunks carry no padding here", False),
    _f("modalities", CHAT, REFUSED, OA, "text only: audio output is not implemented"),
    _f("audio", CHAT, REFUSED, OA, "audio output: not implemented"),
    _f("web_search_options", CHAT, REFUSED, OA, "web search: not implemented"),
    _f("verbosity", CHAT, REFUSED, OA, "verbosity control: not implemented"),
    _f("functions", CHAT, REFUSED, OA, "deprecated: use tools"),
    _f("function_call", CHAT, REFUSED, OA, "deprecated: use tool_choice"),
)
# fmt: on

BY_NAME: dict[str, ExtensionField] = {f.name: f for f in FIELDS}


def refused(name: str) -> ExtensionField | None:
    """The entry of a field this server refuses (None: a field it does not know at all)."""
    entry = BY_NAME.get(name)
    return entry if entry is not None and entry.status == REFUSED else None
