"""Tools and structured output through the gateway on a real vLLM sampler (the session's), with
the official `openai` client: a named or required tool_choice and a json_schema or json_object
response_format constrain what the model writes (vLLM's structured outputs), and what it wrote
comes back as tool calls or JSON content, whole and streamed; the transformers engine, which
cannot constrain its output, is a 400 naming the field. The sampler's own tool-call reader
(vLLM's hermes parser) is checked on the model format's text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from gateway.settings import GatewaySettings
from sampler.lm.tool_calls import ToolCallReader
from tests.fixtures.lm import LmStack, serving_sampler
from tests.unit.test_gateway_fakes import ThreadedGateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "1+2=?"}]


def gateway_over(address: str) -> ThreadedGateway:
    settings = GatewaySettings.model_validate(
        {"samplers": [address], "health_interval_s": 0.5, "http_port": 0}
    )
    return ThreadedGateway(settings, addresses=[address])


@pytest.fixture(scope="module")
def client(lm_stack: LmStack) -> Iterator[openai.AsyncOpenAI]:
    gateway = gateway_over(lm_stack.address)
    yield openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    gateway.close()


def valid_add(arguments: str) -> None:
    values = json.loads(arguments)
    assert set(values) == {"a", "b"} and all(isinstance(v, int) for v in values.values())


async def test_a_named_function_is_called_with_valid_arguments(client: openai.AsyncOpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, tools=[ADD], tool_choice=named, max_tokens=48, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and call.id.startswith("call_")
    valid_add(call.function.arguments)
    streamed = ""
    stream = await client.chat.completions.create(
        model="tiny", messages=ASK, tools=[ADD], tool_choice=named, max_tokens=48,
        temperature=0, stream=True,
    )  # fmt: skip
    async for chunk in stream:
        pieces = (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []
        streamed += "".join(piece.function.arguments or "" for piece in pieces)
    assert streamed == call.function.arguments  # greedy: the same call, piece by piece


async def test_required_tools_are_called_and_json_outputs_validate(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, tools=[ADD], tool_choice="required", max_tokens=64,
        temperature=0,
    )  # fmt: skip
    calls = answer.choices[0].message.tool_calls
    assert calls and all(c.function.name == "add" for c in calls)
    for call in calls:
        valid_add(call.function.arguments)
    schema = {"name": "sum", "schema": ADD["function"]["parameters"]}
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    valid_add(answer.choices[0].message.content or "")
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=48, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    if answer.choices[0].finish_reason == "stop":  # a whole object (not cut by max_tokens)
        assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hf_gateway(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ThreadedGateway]:
    run_dir = tmp_path_factory.mktemp("hf-tools")
    async with serving_sampler(tiny_model_dir, run_dir, engine="hf") as sampler:
        gateway = gateway_over(sampler.address)
        yield gateway
        gateway.close()


async def test_an_engine_that_cannot_constrain_its_output_is_a_400_naming_the_field(
    hf_gateway: ThreadedGateway,
) -> None:
    client = openai.AsyncOpenAI(base_url=hf_gateway.url + "/v1", api_key="none", max_retries=0)
    for fields, param in (
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [ADD], "tool_choice": "required"}, "tool_choice"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="tiny-served", messages=ASK, max_tokens=8, **fields
            )
        body: Any = caught.value.body
        assert body["param"] == param and "cannot constrain" in body["message"]


def test_the_sampler_reads_calls_in_the_models_format(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    reader = ToolCallReader(AutoTokenizer.from_pretrained(tiny_model_dir))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = reader.parse("Let me add. " + call, [ADD])
    assert content == "Let me add. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert reader.parse("no call here", [ADD]) == ("no call here", [])
    stream = reader.stream([ADD])
    said, pieces = "", []
    text = "Sure. " + call
    for start in range(0, len(text), 5):
        piece, fragments = stream.feed(text[start : start + 5], [])
        said += piece
        pieces += fragments
    assert said.startswith("Sure.") and pieces[0].name == "add" and pieces[0].id
    assert json.loads("".join(p.arguments for p in pieces)) == {"a": 1, "b": 2}
