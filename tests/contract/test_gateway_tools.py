"""Tools and structured output through the gateway on a real vLLM sampler (the session's), with
the official `openai` client (async, sync and streaming): a named or required tool_choice and a
json_schema or json_object response_format constrain what the model writes (vLLM's structured
outputs), and what it wrote comes back as tool calls or JSON content, whole and streamed; a
call's result goes back as a tool message and the model answers (tool_choice none or auto); the
transformers engine, which cannot constrain its output, is a 400 naming the field. The sampler's
own tool-call reader (vLLM's hermes parser) is checked on the model format's text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from gateway.settings import GatewaySettings
from sampler.lm.tool_calls import ToolCallReader
from tests.fixtures.lm import LmStack, serving_sampler
from tests.unit.test_gateway_fakes import ThreadedGateway

pytestmark = pytest.mark.slow

# Short calls: the tiny model's context (512) holds the template's tool prompt and little more.
PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"op": {"type": "string", "enum": ["add", "sub"]}},
            "required": ["op"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "1+2"}]


async def gateway_over(address: str) -> ThreadedGateway:
    """A gateway over a sampler of this event loop, built from a thread: the loop must go on
    answering the sampler's health checks while the gateway waits for them."""
    settings = GatewaySettings.model_validate(
        {"samplers": [address], "health_interval_s": 0.5, "http_port": 0}
    )
    return await asyncio.to_thread(ThreadedGateway, settings, addresses=[address])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(lm_stack: LmStack) -> AsyncIterator[openai.AsyncOpenAI]:
    gateway = await gateway_over(lm_stack.address)
    yield openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    await asyncio.to_thread(gateway.close)


def valid_pick(arguments: str) -> None:
    assert json.loads(arguments)["op"] in ("add", "sub")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_named_function_is_called_with_valid_arguments(client: openai.AsyncOpenAI) -> None:
    named = {"type": "function", "function": {"name": "pick"}}
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, tools=[PICK], tool_choice=named, max_tokens=48, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "pick" and call.id.startswith("call_")
    valid_pick(call.function.arguments)
    streamed = ""
    stream = await client.chat.completions.create(
        model="tiny", messages=ASK, tools=[PICK], tool_choice=named, max_tokens=48,
        temperature=0, stream=True,
    )  # fmt: skip
    async for chunk in stream:
        pieces = (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []
        streamed += "".join(piece.function.arguments or "" for piece in pieces)
    assert streamed == call.function.arguments  # greedy: the same call, piece by piece


@pytest.mark.asyncio(loop_scope="session")
async def test_required_tools_are_called_and_json_outputs_validate(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, tools=[PICK], tool_choice="required", max_tokens=52,
        temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    calls = answer.choices[0].message.tool_calls
    assert calls and all(c.function.name == "pick" for c in calls)
    for call in calls:
        valid_pick(call.function.arguments)
    schema = {"name": "pick", "schema": PICK["function"]["parameters"]}
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    valid_pick(answer.choices[0].message.content or "")
    answer = await client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=48, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    if answer.choices[0].finish_reason == "stop":  # a whole object (not cut by max_tokens)
        assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_tool_call_round_trips_with_the_sync_client(client: openai.AsyncOpenAI) -> None:
    """The synchronous client: `auto` (text, or calls that parse) and `none` (text); a required
    call whose result goes back as a tool message, after which the model answers in text. (The
    last request offers no tools: the tiny model's context holds the template's tool prompt or
    a conversation, not both.)"""
    sync = openai.OpenAI(base_url=str(client.base_url), api_key="none", max_retries=0)

    def converse() -> list[Any]:
        offered = {"model": "tiny", "messages": ASK, "tools": [PICK], "temperature": 0}
        answers = [
            sync.chat.completions.create(**offered, tool_choice=choice, max_tokens=48)
            for choice in ("auto", "none")
        ]
        answers.append(  # one whole call fits max_tokens (several at once might not)
            sync.chat.completions.create(
                **offered, tool_choice="required", max_tokens=52, parallel_tool_calls=False
            )
        )
        message = answers[-1].choices[0].message
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"}
        history = [*ASK, message.model_dump(exclude_none=True), result]
        last = {"model": "tiny", "messages": history, "max_tokens": 8, "temperature": 0}
        answers.append(sync.chat.completions.create(**last))
        return answers

    # A thread: this loop serves the sampler the gateway calls.
    auto, none, required, after = await asyncio.to_thread(converse)
    chosen = auto.choices[0]
    assert chosen.finish_reason in ("stop", "length", "tool_calls")
    for made in chosen.message.tool_calls or []:
        assert made.function.name == "pick" and made.id.startswith("call_")
        valid_pick(made.function.arguments)
    assert not none.choices[0].message.tool_calls  # [] as vLLM's server answers, or absent
    assert none.choices[0].finish_reason in ("stop", "length")
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "pick"
    valid_pick(call.function.arguments)
    assert not after.choices[0].message.tool_calls
    assert after.choices[0].finish_reason in ("stop", "length")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hf_gateway(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ThreadedGateway]:
    run_dir = tmp_path_factory.mktemp("hf-tools")
    async with serving_sampler(tiny_model_dir, run_dir, engine="hf") as sampler:
        gateway = await gateway_over(sampler.address)
        yield gateway
        await asyncio.to_thread(gateway.close)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_engine_that_cannot_constrain_its_output_is_a_400_naming_the_field(
    hf_gateway: ThreadedGateway,
) -> None:
    client = openai.AsyncOpenAI(base_url=hf_gateway.url + "/v1", api_key="none", max_retries=0)
    for fields, param in (
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [PICK], "tool_choice": "required"}, "tool_choice"),
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
    call = '<tool_call>\n{"name": "pick", "arguments": {"op": "sub"}}\n</tool_call>'
    content, calls = reader.parse("Let me add. " + call, [PICK])
    assert content == "Let me add. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("pick", {"op": "sub"})
    ]
    assert reader.parse("no call here", [PICK]) == ("no call here", [])
    stream = reader.stream([PICK])
    said, pieces = "", []
    text = "Sure. " + call
    for start in range(0, len(text), 5):
        piece, fragments = stream.feed(text[start : start + 5], [])
        said += piece
        pieces += fragments
    assert said.startswith("Sure.") and pieces[0].name == "pick" and pieces[0].id
    assert json.loads("".join(p.arguments for p in pieces)) == {"op": "sub"}
