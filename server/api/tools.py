"""Chat tool calling: how tools, calls and results reach the prompt, the constraint `tool_choice`
puts on the reply, and reading calls back out of the model's text.

Templates with a tool format (their source renders `tool_calls`) get the messages as they are:
`tools=`, assistant `tool_calls` (arguments as objects) and `role: "tool"` messages. Templates
without one (the default model's) get beamline's fallback rendering, in plain text:
- the tools go into a system message (`FALLBACK_TOOLS_PROMPT`) that asks for
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- an assistant message's calls become such blocks after its text;
- a tool result becomes a user turn holding `<tool_response>{"tool_call_id", "name",
  "content"}</tool_response>` (those templates have no tool role).

`tool_choice`:
- "none": the tools are shown, the reply is text;
- "auto": the reply is free; calls are read from it in the template's format: Hermes
  `<tool_call>{...}</tool_call>` blocks (also the fallback's), or Llama-3 JSON (a reply that is a
  `{"name", "parameters"}` object, several separated by ";");
- "required" / a named function: the reply is constrained to a JSON array of
  `{"name", "arguments"}` calls (one call for a named function or `parallel_tool_calls: false`),
  each call's arguments to its function's parameter schema, so any model calls tools.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from decoding.grammar import GrammarSpec
from server.api.errors import bad_request
from server.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallOut,
    NamedToolChoice,
    Tool,
    ToolCallOut,
)

ToolFormat = Literal["hermes", "llama3_json"]
Mode = Literal["none", "auto", "forced"]

FALLBACK_TOOLS_PROMPT = (
    "You can call the following tools (JSON schema of each tool's arguments given):\n"
    "{tools}\n"
    "To call tools, reply with one block per call and nothing else:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments>}}}}</tool_call>'
)
# Calls one forced reply may hold with parallel_tool_calls: a small model otherwise lists the same
# call again and again until max_tokens (a forced reply ends only where its array may end).
MAX_PARALLEL_CALLS = 8
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its reply."""

    tools: list[Tool]
    mode: Mode
    native: ToolFormat | None  # the template's own format; None: beamline's fallback rendering
    forced_spec: GrammarSpec | None = None  # mode "forced": the reply's constraint

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    @property
    def reply_format(self) -> ToolFormat:
        return self.native or "hermes"


def template_tool_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template renders, or None when it renders no tool calls."""
    if not template or "tool_calls" not in template:
        return None
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def plan_tools(req: ChatCompletionRequest, template: str | None) -> ToolPlan:
    """Check `tools` / `tool_choice` and decide how the request runs."""
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools", "invalid_value")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice", "invalid_value")
    native = template_tool_format(template)
    if choice in ("none", "auto"):
        mode: Mode = "none" if choice == "none" else "auto"
        if (
            mode == "auto"
            and req.response_format is not None
            and req.response_format.type != "text"
        ):
            raise bad_request(
                'response_format cannot be combined with tool_choice "auto" (a reply may be '
                'a call or text); use tool_choice "none" or "required"',
                "response_format",
                "conflicting_fields",
            )
        return ToolPlan(tools, mode, native)
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(
            "a reply that must call a tool cannot also follow response_format",
            "response_format",
            "conflicting_fields",
        )
    if req.structured_outputs is not None:
        raise bad_request(
            "a reply that must call a tool cannot also follow structured_outputs",
            "structured_outputs",
            "conflicting_fields",
        )
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                "tool_choice",
                "invalid_value",
            )
    single = isinstance(choice, NamedToolChoice) or not req.parallel_tool_calls
    return ToolPlan(tools, "forced", native, GrammarSpec.json_schema(calls_schema(chosen, single)))


def calls_schema(tools: list[Tool], single: bool) -> dict[str, Any]:
    """A JSON array of calls of `tools`, each with arguments valid for its function."""
    call_schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object", "properties": {}},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    items = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    most = 1 if single else MAX_PARALLEL_CALLS
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


# ---- the prompt ---------------------------------------------------------------------------------
def template_messages(req: ChatCompletionRequest, plan: ToolPlan) -> list[dict[str, Any]]:
    """The messages as the chat template gets them (see the module docstring)."""
    if plan.native is not None:
        return [_native_message(m) for m in req.messages]
    messages: list[dict[str, Any]] = []
    names = {c.id: c.function.name for m in req.messages for c in m.tool_calls or ()}
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        if m.role == "tool":
            body = {"tool_call_id": m.tool_call_id, "name": names.get(m.tool_call_id or "")}
            body["content"] = m.text()
            messages.append(
                {"role": "user", "content": f"<tool_response>{_dumps(body)}</tool_response>"}
            )
        elif m.tool_calls:
            calls = "".join(
                f"<tool_call>{_dumps(_call_object(c.function.name, c.function.arguments))}"
                "</tool_call>"
                for c in m.tool_calls
            )
            text = m.text()
            messages.append({"role": role, "content": f"{text}\n{calls}" if text else calls})
        else:
            messages.append({"role": role, "content": m.text()})
    if plan.tools:
        described = "\n".join(_dumps(t.function.model_dump(exclude_none=True)) for t in plan.tools)
        prompt = FALLBACK_TOOLS_PROMPT.format(tools=described)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def template_tools(plan: ToolPlan) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """`tools=` for a template with a tool format (the fallback puts them in a message)."""
    if plan.native is None or not plan.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in plan.tools]


def _native_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = m.text() if m.content is not None or not m.tool_calls else None
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _call_object(name: str, arguments: str) -> dict[str, Any]:
    return {"name": name, "arguments": _arguments(arguments)}


def _arguments(text: str) -> Any:
    """Templates render arguments as objects; text that is not JSON stays text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- the reply ----------------------------------------------------------------------------------
@dataclass
class ParsedReply:
    content: str | None  # the text around the calls, None when there is none
    tool_calls: list[ToolCallOut]
    calls_start: int = 0  # where the calls begin in the reply's text (when there are calls)


def parse_reply(text: str, plan: ToolPlan) -> ParsedReply:
    """Split a finished reply into text and calls of the request's tools."""
    names = {t.function.name for t in plan.tools}
    if plan.mode == "forced":
        calls = _calls_from_json(text, names)
        return ParsedReply(None, calls) if calls else ParsedReply(text, [])
    if plan.mode == "none" or not plan.tools:
        return ParsedReply(text, [])
    if plan.reply_format == "llama3_json":
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        calls = [c for part in body.split(";") for c in _calls_from_json(part, names)]
        if calls and body.startswith("{"):
            return ParsedReply(None, calls)
        return ParsedReply(text, [])
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return ParsedReply(text, [])
    calls = [
        c for block in _HERMES_CALL.findall(text[start:]) for c in _calls_from_json(block, names)
    ]
    if not calls:
        return ParsedReply(text, [])
    content = text[:start].strip()
    return ParsedReply(content or None, calls, start)


def _calls_from_json(text: str, names: set[str]) -> list[ToolCallOut]:
    """Calls in a JSON object or array of `{"name", "arguments" | "parameters"}` objects."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(
            ToolCallOut(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCallOut(name=item["name"], arguments=_dumps(arguments)),
            )
        )
    return calls


class ReplyStream:
    """Streams a reply's text while holding back what may turn out to be tool calls.

    `push(delta)` returns the text that is certainly content; `finish()` parses the whole reply.
    Forced calls hold everything back; Hermes replies hold back from the first possible
    `<tool_call>`; Llama-3 JSON replies that open with `{` or the python tag are held whole.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> str:
        self.text += delta
        ready = self._safe_length()
        out = self.text[self.sent : ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return out

    def finish(self) -> tuple[str, ParsedReply]:
        """The content not yet sent, and the parsed reply."""
        parsed = parse_reply(self.text, self.plan)
        end = parsed.calls_start if parsed.tool_calls else len(self.text)
        return self.text[self.sent : end], parsed

    def _safe_length(self) -> int:
        if not self.plan.parses_calls:
            return len(self.text)
        if self.plan.mode == "forced":
            return 0
        if self.plan.reply_format == "llama3_json":
            head = self.text.lstrip()
            if not head or head.startswith("{") or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]):
                return 0
            return len(self.text)
        start = self.text.find(_HERMES_OPEN)
        if start >= 0:
            return start
        for k in range(min(len(_HERMES_OPEN) - 1, len(self.text)), 0, -1):
            if _HERMES_OPEN.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)
