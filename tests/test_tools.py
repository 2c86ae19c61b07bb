"""Tool calling on /v1/chat/completions: `tools` to the chat template, the model's
`<tool_call>` text parsed into OpenAI `tool_calls` (whole and streamed), `required` and
named choices enforced by structured outputs, and a follow-up turn with the tool's
result. The parser and the stream on their own first; then a real server on SmolLM2."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from conftest import serving

from minivllm.server.protocol import BadField
from minivllm.server.tools import TOOL_PARSERS, HermesToolParser, ToolStream, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


# -- parser, plans and streams: no model ----------------------------------------------------


def test_hermes_parser_reads_calls_and_leaves_plain_text_alone():
    parser = TOOL_PARSERS["hermes"]()
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}'
            "</tool_call>")
    content, calls = parser.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Rome"})]
    assert calls[0].id != calls[1].id
    assert parser.parse("It is sunny.") == ("It is sunny.", [])
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": '
    assert parser.parse(broken) == (broken, [])


@pytest.mark.parametrize("tools, choice, field", [
    ("x", None, "tools"),
    ([{"type": "function"}], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, choice, field):
    with pytest.raises(BadField) as err:
        plan_tools(tools, choice)
    assert err.value.param == field and str(err.value).startswith(field)


def test_plans_constrain_required_and_named_choices():
    assert plan_tools(None, None) is None and plan_tools([WEATHER], "none") is None
    assert plan_tools([WEATHER], None).constraint is None  # auto
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.constraint.json == TIME["function"]["parameters"]
    required = plan_tools([WEATHER, TIME], "required")
    schema = required.constraint.json
    jsonschema.validate([{"name": "get_time", "arguments": {"city": "Rome"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_rain", "arguments": {}}], schema)


def reassemble(deltas: list[dict]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = d.get("id", call["id"])
        fn = d.get("function", {})
        call["name"] += fn.get("name", "")
        call["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("pieces", [
    ["Sure", ". <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
     "</tool_call>"],
    ["Sure. <tool_call>", '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'],
])
def test_auto_stream_sends_text_then_the_call(pieces):
    stream = ToolStream(plan_tools([WEATHER], "auto"))
    content, deltas = "", []
    for n, piece in enumerate(pieces):
        text, calls = stream.feed(piece, n == len(pieces) - 1)
        assert "<" not in text  # a possible marker is held back
        content += text
        deltas += calls
    assert content.strip() == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in reassemble(deltas)] == [
        ("get_weather", {"city": "Oslo"})]


def test_auto_stream_of_plain_text_is_all_content():
    stream = ToolStream(plan_tools([WEATHER], "auto"))
    pieces = ["It is ", "sunny <", "3"]
    out = "".join(stream.feed(p, i == 2)[0] for i, p in enumerate(pieces))
    assert out == "It is sunny <3" and not stream.calls


def test_named_stream_sends_the_arguments_as_they_come():
    plan = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    stream = ToolStream(plan)
    deltas = []
    for n, piece in enumerate(['{"city": ', '"Oslo"', "}"]):
        text, calls = stream.feed(piece, n == 2)
        assert text == ""
        deltas += calls
    assert len(deltas) == 3 and deltas[0]["id"].startswith("call_")
    assert reassemble(deltas) == [{"id": deltas[0]["id"], "name": "get_weather",
                                   "arguments": '{"city": "Oslo"}'}]


def test_tool_messages_reach_the_template_with_arguments_as_objects():
    from minivllm.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    msgs = body.template_messages()
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["content"] == ""
    assert msgs[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


def test_hermes_is_a_parser_class_in_the_registry():
    assert TOOL_PARSERS["hermes"] is HermesToolParser


# -- a real server ----------------------------------------------------------------------------

SERVER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
                "--block-size", "16", "--num-gpu-blocks-override", "128", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("tools"),
                 [str(smollm2_path), *SERVER_FLAGS, "--served-model-name", "smol"],
                 clean_exit=True) as url:
        yield url


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


@pytest.mark.slow
def test_named_tool_choice_returns_a_call_whose_arguments_parse(client):
    r = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER],
                                       tool_choice=NAMED, max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    check_weather_call(choice.message.tool_calls[0])


@pytest.mark.slow
def test_required_tool_choice_returns_calls_of_the_given_tools(client):
    r = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.slow
def test_auto_tool_choice_is_text_or_a_valid_call(client):
    r = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER],
                                       max_tokens=40, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            check_weather_call(call)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_streamed_tool_call_deltas_reassemble_into_the_same_call(client):
    kwargs = dict(model="smol", messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                  max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            for d in choice.delta.tool_calls or ():
                deltas.append({"index": d.index, **({"id": d.id} if d.id else {}),
                               "function": {k: v for k, v in
                                            (("name", d.function.name),
                                             ("arguments", d.function.arguments)) if v}})
            finish = choice.finish_reason or finish
    calls = reassemble(deltas)
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)


@pytest.mark.slow
def test_follow_up_turn_with_the_tool_result_is_accepted(client, server):
    first = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=40, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # tool_choice "none": plain text, no tools in the prompt.
    r = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    bad = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": "smol", "messages": ASK, "tools": [WEATHER], "max_tokens": 4,
        "tool_choice": {"type": "function", "function": {"name": "get_rain"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
