"""What each request field does here, for the fields that server/api/extension_fields.py does not
describe: OpenAI's fields and the Responses API's own. A key is a field name, or
`<endpoint>:<name>` where one endpoint differs (endpoints: completions, chat, responses).

tests/test_docs_reference.py holds this list to the request models: every field of every model
has a note (here or in extension_fields.py) and every note names a field that exists.
"""

from __future__ import annotations

NOTES: dict[str, str] = {
    "model": "optional: the served model's id, an extra model's or a LoRA adapter's (another "
    "is a 404)",
    "prompt": "a string, a list of strings, token ids, or a list of token-id lists (one choice "
    "per prompt, at most `max_prompts_per_request`). A text prompt that already begins with the "
    "model's BOS token gets no second one; token ids run exactly as sent",
    "messages": "system, developer, user, assistant and tool messages; every message needs "
    '`content` (`""` counts) except an assistant message that carries `tool_calls`; otherwise a '
    "400 naming `messages.<i>.content` (`missing_required_parameter`)",
    "completions:max_tokens": "default 16 (OpenAI's); 0 scores the prompt (with `echo` + "
    "`logprobs` or `prompt_logprobs`) and generates nothing (needs `n` 1, no beams); above "
    "`max_tokens_limit` (when set) a 400 `above_limit`",
    "chat:max_tokens": "default `default_max_tokens` (4096) within the rest of the context; "
    "above `max_tokens_limit` (when set) a 400 `above_limit`",
    "responses:max_tokens": "a 400: use `max_output_tokens`",
    "max_completion_tokens": "chat's newer name of `max_tokens` (same default and limit)",
    "max_output_tokens": "the longest reply (default `default_max_tokens` within the rest of the "
    'context); a reply cut there is `status: "incomplete"`, reason `"max_output_tokens"`',
    "temperature": "0 = greedy; when unset, the model's generation_config.json value if it has "
    "one (see Configuration), else 1",
    "top_p": "nucleus sampling (1 = off); when unset, the model's generation_config.json value "
    "if it has one",
    "n": "independent samples that share the prompt's KV blocks (at most `max_n`); with beams, "
    "how many hypotheses come back (HF's `num_return_sequences`)",
    "responses:n": "1 only (a 400 otherwise): a response has one output; beams and `best_of` "
    "return their best",
    "seed": "a random stream per row, keyed by the seed: the same seed gives the same text "
    "whatever else is in the batch",
    "presence_penalty": "OpenAI's penalty over generated tokens, in [-2, 2]",
    "frequency_penalty": "OpenAI's penalty over generated tokens, in [-2, 2], per occurrence",
    "logit_bias": '`{"token id": bias}`, bias in [-100, 100]',
    "stop": "stop strings (at most `max_stop_sequences`), cut from the text unless "
    "`include_stop_str_in_output`; none is looked for before `min_tokens` tokens (as in vLLM)",
    "stream": "server-sent events `data: {json}`, ending in `data: [DONE]`; beams and `best_of` "
    "send each final choice whole",
    "responses:stream": "OpenAI's typed events, ending in `response.completed` or "
    "`response.incomplete` (or `error` + `response.failed`)",
    "stream_options": "`include_usage`: a last chunk with the usage and empty `choices`; vLLM's "
    "`continuous_usage_stats`: usage so far in every chunk",
    "responses:stream_options": "accepted, no effect: the final event's response carries the usage",
    "completions:logprobs": "integer k: OpenAI's legacy shape (`tokens`, `token_logprobs`, "
    "`top_logprobs`, `text_offset`), raw model log-probabilities, k at most `max_logprobs`",
    "chat:logprobs": "true: each output token's raw model log-probability, with `top_logprobs` "
    "alternatives",
    "top_logprobs": "the k likeliest alternatives of each output token (with `logprobs: true`; "
    "at most `max_logprobs`)",
    "completions:echo": "the prompt text precedes each choice; with `logprobs` k the choice's "
    "logprobs start with the prompt's tokens (the first one null), as lm-evaluation-harness "
    "reads them",
    "best_of": "sample-and-rank: draw `best_of` samples, return the `n` with the highest "
    "log-likelihood (at most `max_best_of`)",
    "response_format": '`{"type": "text"}`, `{"type": "json_object"}` or `{"type": '
    '"json_schema", "json_schema": {"name", "schema", "strict"}}`: the output is constrained, '
    "for every strategy",
    "responses:response_format": "a 400: use `text.format`",
    "responses:prompt_logprobs": "a 400: a response has no prompt logprobs",
    "suffix": "only null or empty: no fill-in-the-middle here (a 400 otherwise)",
    "tools": "function tools: `{type: function, function: {name, description, parameters}}`",
    "responses:tools": "flat function tools: `{type: function, name, description, parameters}`",
    "tool_choice": '`"none"`, `"auto"` (the default with tools), `"required"` or a named '
    "function; required and named calls are enforced by constrained decoding",
    "parallel_tool_calls": "false: at most one call; true: up to 8 calls in one reply",
    "input": "a string (one user message) or a list of `message`, `function_call` and "
    "`function_call_output` items",
    "instructions": "a system message before everything else (not carried over by "
    "`previous_response_id`)",
    "text": "`format`: `text`, `json_object` or `json_schema`, as chat's `response_format`; "
    '`verbosity`: only `"medium"`',
    "previous_response_id": "continue a stored response: its input and output come before the "
    "new input; an id no longer stored is a 400 `previous_response_not_found`",
    "responses:store": "keep the response (the last `responses_store_size`, in memory) for "
    "`previous_response_id` and `GET /v1/responses/{id}`",
    "truncation": '`"disabled"` only: input that does not fit is a 400',
    "reasoning": '`effort` null or `"none"` only, no `summary`: this server runs no reasoning',
    "background": "false only: a response runs while its request is open",
    "include": "empty only: no extra output data is produced here",
}
