"""Tool calling on chat completions: OpenAI's `tools` and `tool_choice`.

The tools go to the chat template (`tools=`), which tells the model how to call them.
What the model writes back is read by a tool parser (a registry by model family;
`hermes`, the `<tool_call>{"name": ..., "arguments": ...}</tool_call>` format of Qwen
and Hermes models, first). `tool_choice` decides how free the model is:

- `none`: no tools in the prompt, plain text back;
- `auto`: the model chooses; a reply whose tool-call blocks all parse becomes
  `tool_calls`, anything else stays text;
- `required`: the output is constrained (structured outputs) to a JSON array of
  `{"name", "arguments"}` objects over the given tools, at least one;
- a named function: the output is constrained to that function's parameters schema,
  and is the call's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import StructuredOutputsParams
from .errors import BadField


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(obj: Any) -> ToolCall | None:
    """A `{"name": str, "arguments": object or JSON text}` object as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen, Hermes)."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text before the first call, or None if empty; the calls). Text whose
        blocks do not all parse as calls is returned whole, with no calls."""
        first = text.find(self.start)
        if first == -1:
            return text, []
        calls = []
        for block in self._block.findall(text, first):
            try:
                call = _call_of(json.loads(block))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:first].strip() or None, calls


# Tool parsers by name: a model family with its own call format adds its parser here.
TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
DEFAULT_TOOL_PARSER = "hermes"


@dataclass
class ToolPlan:
    """How a chat request uses its tools."""

    mode: str  # "auto", "required" or "named"
    tools: list[dict[str, Any]]  # as the chat template takes them
    constraint: StructuredOutputsParams | None = None
    name: str | None = None  # the named function
    parser: HermesToolParser = field(default_factory=HermesToolParser)

    def reply(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply as (content, tool calls)."""
        if self.mode == "named":
            return None, [ToolCall(self.name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short by max_tokens: the text as it is
            calls = [_call_of(item) for item in items] if isinstance(items, list) else []
            if not calls or None in calls:
                return text, []
            return None, calls  # type: ignore[return-value]
        return self.parser.parse(text)

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """A streamed reply as content deltas and `tool_calls` deltas.

    A named call streams its arguments as they come. `required` output is read whole at
    the end (a JSON array). Under `auto` the text streams as content until the parser's
    start marker shows up (the characters that could begin it are held back); from
    there it is kept and parsed at the end.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything not yet sent as content
        self.calls: list[ToolCall] = []
        self._named: ToolCall | None = None

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """Take the new text; return (content to send, tool-call deltas to send)."""
        plan = self.plan
        if plan.mode == "named":
            if self._named is None:
                self._named = ToolCall(plan.name or "", "")
                self.calls = [self._named]
                first = self._named.as_openai()
                first["function"]["arguments"] = text
                self._named.arguments += text
                return "", [{"index": 0, **first}]
            self._named.arguments += text
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self.text += text
        if plan.mode == "auto":
            marker = plan.parser.start
            at = self.text.find(marker)
            if at == -1 and not finished:
                keep = _partial_suffix(self.text, marker)
                cut = len(self.text) - keep
                out, self.text = self.text[:cut], self.text[cut:]
                return out, []
        if not finished:
            return "", []
        content, calls = plan.reply(self.text)
        if not calls:
            out, self.text = self.text, ""
            return out, []
        self.calls = calls
        # `text` holds only what was not sent: its content is the unsent text before the
        # first call.
        return content or "", [{"index": i, **c.as_openai()} for i, c in enumerate(calls)]


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _function(tool: Any, n: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise BadField("tools", f"tools[{n}]={tool!r:.120}: must be "
                       "{'type': 'function', 'function': {...}}")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadField("tools", f"tools[{n}].function: must be an object with a 'name'")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise BadField("tools", f"tools[{n}].function.parameters={params!r:.120}: must be a "
                       "JSON schema (an object)")
    return {**fn, "parameters": params}


def plan_tools(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """The request's tool plan, or None where tools play no part (none given, or
    `tool_choice` "none"); bad values raise BadField naming `tools` or `tool_choice`."""
    if tools is not None and not isinstance(tools, list):
        raise BadField("tools", f"tools={tools!r:.120}: must be a list of tools")
    functions = [_function(t, n) for n, t in enumerate(tools or [])]
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if choice == "none":
        return None
    if not functions:
        raise BadField("tool_choice", f"tool_choice={choice!r}: needs tools")
    template_tools = [{"type": "function", "function": fn} for fn in functions]
    if choice == "auto":
        return ToolPlan("auto", template_tools)
    if choice == "required":
        options = [{"type": "object",
                    "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for fn in functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        return ToolPlan("required", template_tools, StructuredOutputsParams(json=schema))
    name = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise BadField("tool_choice", f"tool_choice={choice!r:.120}: must be 'none', 'auto', "
                       "'required' or {'type': 'function', 'function': {'name': ...}}")
    fn = next((f for f in functions if f["name"] == name), None)
    if fn is None:
        raise BadField("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return ToolPlan("named", template_tools, StructuredOutputsParams(json=fn["parameters"]),
                    name)


def template_fields(message: Any) -> dict[str, Any]:
    """A chat message's tool fields as chat templates take them: an assistant's
    `tool_calls` (their JSON `arguments` as objects) and a tool reply's `tool_call_id`
    and `name`."""
    extra = message.model_extra or {}
    out: dict[str, Any] = {}
    calls = extra.get("tool_calls")
    if isinstance(calls, list) and calls:
        converted = []
        for call in calls:
            fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass  # the template gets the text as it is
            converted.append({**call, "function": fn} if isinstance(call, dict) else call)
        out["tool_calls"] = converted
    for key in ("tool_call_id", "name"):
        if isinstance(extra.get(key), str):
            out[key] = extra[key]
    return out
