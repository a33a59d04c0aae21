"""A session's chat prompt continued from its earlier tokens (ChatPrompt.prefix_token_ids): the
sampler renders only the new messages, the earlier tokens stay as sampled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.env.episodes import ChatTokens
from common import tensor
from rlfleet.sampler.v1 import sampler_pb2
from sampler.lm.requests import Limits, PromptRenderer
from services.errors import InvalidArgument

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
OPENING = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 12 * 34?"},
]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat(messages: list[dict[str, Any]], **fields: Any) -> sampler_pb2.Prompt:
    prompt = sampler_pb2.Prompt(chat=sampler_pb2.ChatPrompt(**fields))
    for message in messages:
        prompt.chat.messages.add(**message)
    for tool in TOOLS:
        prompt.chat.tools.add().update(tool)
    return prompt


def limits(tokenizer: Any) -> Limits:
    return Limits(max_n=8, max_prompts=8, max_context=512, vocab_size=len(tokenizer))


def ids_tensor(ids: list[int]) -> Any:
    return tensor.encode(np.asarray(ids, np.int32))


def test_the_new_messages_follow_the_sampled_tokens_unchanged(tokenizer: Any) -> None:
    renderer = PromptRenderer(tokenizer)
    first = renderer.token_ids(chat(OPENING), "prompt", limits(tokenizer))
    turn_end = ChatTokens(tokenizer).turn_end
    # What the model sampled: a call whose every character is a token of its own, as a model
    # may sample it (the tokenizer merges "<answer>" into one).
    call = CALL.replace("12 * 34", "<answer>")
    sampled = [i for c in call for i in tokenizer(c, add_special_tokens=False)["input_ids"]]
    assert tokenizer.decode(sampled) == call
    assert sampled != tokenizer(call, add_special_tokens=False)["input_ids"]
    prefix = first + sampled + turn_end
    history = [
        *OPENING,
        {"role": "assistant", "content": call},
        {"role": "tool", "content": '{"error": "not arithmetic"}'},
    ]
    second = chat(history, prefix_token_ids=ids_tensor(prefix), prefix_messages=3)
    ids = renderer.token_ids(second, "prompt", limits(tokenizer))
    assert ids[: len(prefix)] == prefix  # never re-tokenized
    tools = PromptRenderer.tools(second.chat)  # as the sampler reads them (Struct key order)
    full = tokenizer.apply_chat_template(
        history, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(ids) == full  # the same text as a whole render
    assert ids != renderer.token_ids(chat(history), "prompt", limits(tokenizer))


def test_a_model_turn_the_template_writes_otherwise_is_ended_as_the_template_ends_it(
    tokenizer: Any,
) -> None:
    renderer = PromptRenderer(tokenizer)
    first = renderer.token_ids(chat(OPENING), "prompt", limits(tokenizer))
    said = tokenizer("  408  ", add_special_tokens=False)["input_ids"]  # no end of turn sampled
    history = [*OPENING, {"role": "assistant", "content": "408"}, {"role": "user", "content": "?"}]
    prompt = chat(history, prefix_token_ids=ids_tensor(first + said), prefix_messages=3)
    ids = renderer.token_ids(prompt, "prompt", limits(tokenizer))
    turn_end = ChatTokens(tokenizer).turn_end
    assert ids[: len(first) + len(said)] == first + said
    assert ids[len(first) + len(said) : len(first) + len(said) + 1] == turn_end
    # ... and what the template writes after its end of turn follows it, as in a whole render.
    after = tokenizer.decode(ids[len(first) + len(said) :])
    assert after == "<|im_end|>\n<|im_start|>user\n?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"prefix_messages": 0}, "prompt.chat.prefix_messages", r"must be in \[1, 2\]"),
        ({"prefix_messages": 3}, "prompt.chat.prefix_messages", r"must be in \[1, 2\]"),
        (
            {"prefix_messages": 1, "continue_final_message": True},
            "prompt.chat.continue_final_message",
            "cannot go with prefix_token_ids",
        ),
        ({"prefix_messages": 1, "bad_id": True}, "prompt.chat.prefix_token_ids", "outside"),
        ({"prefix_messages": 1, "empty": True}, "prompt.chat.prefix_token_ids", "empty"),
    ],
)
def test_bad_prefixes_name_the_field(
    tokenizer: Any, fields: dict[str, Any], field: str, message: str
) -> None:
    ids = [1, 2, 3]
    if fields.pop("bad_id", False):
        ids = [1, len(tokenizer) + 5]
    if fields.pop("empty", False):
        ids = []
    messages = (
        OPENING
        if not fields.get("continue_final_message")
        else [
            *OPENING,
            {"role": "assistant", "content": "4"},
        ]
    )
    prompt = chat(messages, prefix_token_ids=ids_tensor(ids), **fields)
    with pytest.raises(InvalidArgument, match=message) as caught:
        PromptRenderer(tokenizer).token_ids(prompt, "prompt", limits(tokenizer))
    assert caught.value.field == field


def test_a_chat_completion_stops_at_the_templates_end_of_turn(tokenizer: Any) -> None:
    from sampler.lm.requests import parse_stream_request

    renderer = PromptRenderer(tokenizer)
    turn_end = tuple(ChatTokens(tokenizer).turn_end)
    chat_request = sampler_pb2.GenerateStreamRequest(prompt=chat(OPENING))
    chat_request.sampling.stop_token_ids.append(7)
    _, options = parse_stream_request(chat_request, limits(tokenizer), renderer)
    assert options.stop_token_ids == (7, *turn_end)  # as chat servers end a model's turn
    text_request = sampler_pb2.GenerateStreamRequest(prompt=sampler_pb2.Prompt(text="Q: 1+1"))
    _, options = parse_stream_request(text_request, limits(tokenizer), renderer)
    assert options.stop_token_ids == ()  # a raw completion runs to EOS


def test_tools_render_alike_whatever_order_their_keys_come_in(tokenizer: Any) -> None:
    # A Struct is a map: tools that crossed one come back with their keys in no fixed order.
    forward = {"type": "function", "function": {"name": "calc", "description": "d",
                                                "parameters": {"type": "object"}}}  # fmt: skip
    backward = {"function": {"parameters": {"type": "object"}, "description": "d",
                             "name": "calc"}, "type": "function"}  # fmt: skip
    renderer = PromptRenderer(tokenizer)
    ids = []
    for tool in (forward, backward):
        prompt = sampler_pb2.Prompt(chat=sampler_pb2.ChatPrompt())
        for message in OPENING:
            prompt.chat.messages.add(**message)
        prompt.chat.tools.add().update(tool)
        ids.append(renderer.token_ids(prompt, "prompt", limits(tokenizer)))
        # The env episodes' renderer writes the very same prompt.
        assert ChatTokens(tokenizer, [tool]).opening(OPENING) == ids[-1]
    assert ids[0] == ids[1]
