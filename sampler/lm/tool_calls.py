"""Function calls read back from a model's text, by vLLM's tool parsers (`ToolParserManager`:
``hermes`` reads Qwen2.5 / Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks, the format of this project's chat templates).

A completion of a chat prompt with tools is read whole (`parse`) or, streamed, piece by piece
(`StreamReader`: content pieces and call fragments as they are decided). vLLM is imported on the
first use: a sampler that never sees tools never loads its parsers.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from rlfleet.sampler.v1 import sampler_pb2

__all__ = ["StreamReader", "ToolCallReader"]


class ToolCallReader:
    """One tool-call format (a vLLM tool parser name) for one tokenizer."""

    def __init__(self, tokenizer: Any, parser: str = "hermes") -> None:
        self.tokenizer = tokenizer
        self.parser_name = parser
        self._parser_cls: Any = None

    def _new(self, tools: list[dict[str, Any]]) -> tuple[Any, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        if self._parser_cls is None:
            self._parser_cls = ToolParserManager.get_tool_parser(self.parser_name)
        # The parsers read the tools (and tool_choice) off an OpenAI request.
        request = ChatCompletionRequest(
            model="rlfleet", messages=[{"role": "user", "content": ""}], tools=tools
        )
        return self._parser_cls(self.tokenizer, None), request

    def parse(
        self, text: str, tools: list[dict[str, Any]]
    ) -> tuple[str, list[sampler_pb2.ToolCall]]:
        """(the text but its calls, the calls) of a whole completion."""
        parser, request = self._new(tools)
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [
            sampler_pb2.ToolCall(
                id=_call_id(), name=call.function.name, arguments=call.function.arguments or "{}"
            )
            for call in info.tool_calls
        ]
        return info.content or "", calls

    def stream(self, tools: list[dict[str, Any]]) -> StreamReader:
        parser, request = self._new(tools)
        return StreamReader(parser, request)


class StreamReader:
    """One streamed completion's calls: feed the text and tokens decided so far, get what is
    new (a content piece and call fragments)."""

    def __init__(self, parser: Any, request: Any) -> None:
        self.parser, self.request = parser, request
        self.text = ""
        self.token_ids: list[int] = []
        self.ids: dict[int, str] = {}  # call index -> the id sent with its first fragment

    def feed(
        self, text: str, token_ids: Sequence[int]
    ) -> tuple[str, list[sampler_pb2.ToolCallDelta]]:
        previous, previous_ids = self.text, self.token_ids
        self.text, self.token_ids = previous + text, [*previous_ids, *token_ids]
        if not text:
            return "", []
        delta = self.parser.extract_tool_calls_streaming(
            previous,
            self.text,
            text,
            previous_ids,
            self.token_ids,
            list(token_ids),
            self.request,
        )
        if delta is None:
            return "", []
        pieces = []
        for call in delta.tool_calls or []:
            function = call.function
            first = call.index not in self.ids
            if first:
                self.ids[call.index] = _call_id()
            pieces.append(
                sampler_pb2.ToolCallDelta(
                    index=call.index,
                    id=self.ids[call.index] if first else "",
                    name=(function.name or "") if function is not None else "",
                    arguments=(function.arguments or "") if function is not None else "",
                )
            )
        return delta.content or "", pieces


def _call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"
