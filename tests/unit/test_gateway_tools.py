"""Tools and structured output of the chat API (gateway/openai/tools.py): what each
tool_choice and response_format asks of the sampler, how the sampler's calls become OpenAI
tool_calls (whole and streamed), and the 400s that name what is wrong. The round trip through
real samplers is in tests/contract/test_gateway_tools.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.serving_chat import OpenAIServingChat, _StreamedCalls
from gateway.openai.serving_engine import Choice
from gateway.openai.tools import plan_tools, proto_tool_calls
from rlfleet.sampler.v1 import sampler_pb2

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def bad(**fields: Any) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        plan_tools(request(**fields))
    return caught.value


def test_each_tool_choice_plans_what_the_sampler_is_asked() -> None:
    assert plan_tools(request()).mode == "none" and not plan_tools(request()).listed
    auto = plan_tools(request(tools=[ADD, NOW]))
    assert auto.mode == "auto" and auto.listed == [ADD, NOW] and auto.structured_output is None
    off = plan_tools(request(tools=[ADD], tool_choice="none"))
    assert off.listed == [] and off.structured_output is None  # tools left out of the prompt
    named = plan_tools(
        request(tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "add"}})
    )
    assert (
        named.mode == "named"
        and json.loads(named.structured_output.json_schema) == ADD["function"]["parameters"]
    )
    required = plan_tools(request(tools=[ADD, NOW], tool_choice="required"))
    schema = json.loads(required.structured_output.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["add"], ["now"]]
    single = plan_tools(request(tools=[ADD], tool_choice="required", parallel_tool_calls=False))
    assert json.loads(single.structured_output.json_schema)["maxItems"] == 1


def test_response_formats_become_structured_outputs() -> None:
    assert plan_tools(request(response_format={"type": "text"})).structured_output is None
    assert plan_tools(
        request(response_format={"type": "json_object"})
    ).structured_output.json_object
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    plan = plan_tools(
        request(
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        )
    )
    assert json.loads(plan.structured_output.json_schema) == schema


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [ADD, ADD]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to require
        ({"tools": [ADD], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
            "tool_choice",
        ),
        ({"tools": [ADD], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    assert bad(**fields).param == param


def test_assistant_tool_calls_go_to_the_template_as_sent() -> None:
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ]
    (call,) = proto_tool_calls(calls, "messages[1].tool_calls")
    assert (call.id, call.name, call.arguments) == ("call_1", "add", '{"a": 1}')
    for broken, where in (
        ([{"id": "x"}], "messages[1].tool_calls[0]"),
        (
            [{"function": {"name": "add", "arguments": {"a": 1}}}],
            "messages[1].tool_calls[0].arguments",
        ),
    ):
        with pytest.raises(BadRequest) as caught:
            proto_tool_calls(broken, "messages[1].tool_calls")
        assert caught.value.param == where


def choice(text: str, calls: dict[int, dict[str, str]] | None = None) -> Choice:
    c = Choice(0, text=[text], finish_reason="stop")
    c.calls = calls or {}
    return c


def test_a_finished_choice_carries_the_calls_it_made() -> None:
    auto = plan_tools(request(tools=[ADD]))
    call = {"id": "call_7", "name": "add", "arguments": '{"a": 1, "b": 2}'}
    made = OpenAIServingChat._choice(choice("", {0: call}), auto, "", False)
    assert made.finish_reason == "tool_calls" and made.message.content is None
    assert made.message.tool_calls == [
        {
            "id": "call_7",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
        }
    ]
    talk = OpenAIServingChat._choice(choice("just text"), auto, "", False)
    assert talk.finish_reason == "stop" and talk.message.content == "just text"
    assert talk.message.tool_calls == []
    named = plan_tools(
        request(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    )
    made = OpenAIServingChat._choice(choice('{"a": 3, "b": 4}'), named, "", False)
    assert made.message.content is None
    assert made.message.tool_calls[0]["function"] == {
        "name": "add",
        "arguments": '{"a": 3, "b": 4}',
    }
    required = plan_tools(
        request(tools=[ADD, NOW], tool_choice="required", parallel_tool_calls=False)
    )
    text = json.dumps(
        [{"name": "now", "parameters": {}}, {"name": "add", "parameters": {"a": 1, "b": 1}}]
    )
    made = OpenAIServingChat._choice(choice(text), required, "", False)
    assert [c["function"]["name"] for c in made.message.tool_calls] == ["now"]  # not parallel


def delta(text: str = "", *pieces: sampler_pb2.ToolCallDelta) -> sampler_pb2.CompletionDelta:
    return sampler_pb2.CompletionDelta(text=text, tool_calls=list(pieces))


def test_streamed_calls_follow_openais_chunk_format() -> None:
    auto = _StreamedCalls(plan_tools(request(tools=[ADD], parallel_tool_calls=False)))
    assert auto.feed(delta("Let me add. ")) == ("Let me add. ", [])
    first = sampler_pb2.ToolCallDelta(index=0, id="call_1", name="add", arguments="")
    assert auto.feed(delta("", first))[1] == [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": ""},
        }
    ]
    more = sampler_pb2.ToolCallDelta(index=0, arguments='{"a": 1')
    second = sampler_pb2.ToolCallDelta(index=1, id="call_2", name="add", arguments="{}")
    assert auto.feed(delta("", more, second))[1] == [
        {"index": 0, "function": {"arguments": '{"a": 1'}}
    ]
    assert auto.made and auto.finish() == []

    named = _StreamedCalls(
        plan_tools(
            request(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}})
        )
    )
    (head,) = named.feed(delta('{"a":'))[1]
    assert head["function"] == {"name": "add", "arguments": '{"a":'} and head["id"].startswith(
        "call_"
    )
    assert named.feed(delta(" 2}"))[1] == [{"index": 0, "function": {"arguments": " 2}"}}]

    required = _StreamedCalls(plan_tools(request(tools=[ADD], tool_choice="required")))
    assert required.feed(delta('[{"name": "add", ')) == ("", [])
    required.feed(delta('"parameters": {"a": 1, "b": 2}}]'))
    (call,) = required.finish()
    assert call["index"] == 0 and call["function"] == {
        "name": "add",
        "arguments": '{"a": 1, "b": 2}',
    }
    cut = _StreamedCalls(plan_tools(request(tools=[ADD], tool_choice="required")))
    cut.feed(delta('[{"name": "ad'))  # max_tokens ran out mid-call: no call, not a crash
    assert cut.finish() == [] and not cut.made


@pytest.fixture(scope="module")
def gateway() -> Any:
    from gateway.settings import GatewaySettings
    from tests.unit.test_gateway_fakes import FakeReplica, ThreadedGateway

    settings = GatewaySettings.model_validate(
        {"samplers": ["a:1"], "health_interval_s": 0.05, "http_port": 0}
    )
    g = ThreadedGateway(settings, [FakeReplica("fake:1")])
    yield g
    g.close()


def test_the_official_client_gets_auto_tool_calls_whole_and_streamed(gateway: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    ask = {"model": "fake-model", "messages": [{"role": "user", "content": "add"}]}
    answer = client.chat.completions.create(**ask, tools=[ADD, NOW])
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content == "Sure. "
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_0a", "add", '{"a": 1}'),
        ("call_0b", "now", "{}"),
    ]
    one = client.chat.completions.create(**ask, tools=[ADD, NOW], parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["add"]

    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, tools=[ADD, NOW], stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            call["name"] += (piece.function.name or "") if piece.function else ""
            call["arguments"] += (piece.function.arguments or "") if piece.function else ""
    assert finish == "tool_calls"
    assert calls == {
        0: {"id": "call_0a", "name": "add", "arguments": '{"a": 1}'},
        1: {"id": "call_0b", "name": "now", "arguments": "{}"},
    }
    # The conversation goes on: the assistant's calls and the tool's answer are sent back.
    history = [
        *ask["messages"],
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "call_0a", "content": "2"},
    ]
    client.chat.completions.create(model="fake-model", messages=history)
    sent = gateway.gateway.pool.backends[0].replica.requests[-1].prompt.chat
    assert [m.role for m in sent.messages] == ["user", "assistant", "tool"]
    assert (
        sent.messages[1].tool_calls[0].name == "add" and sent.messages[2].tool_call_id == "call_0a"
    )
