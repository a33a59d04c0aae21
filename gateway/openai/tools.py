"""Tools and structured output of the chat API, as vLLM's OpenAI server handles them.

- ``tool_choice``: ``auto`` (the default with tools) lists the tools in the prompt and reads the
  model's calls back (the sampler's tool parser); ``none`` (the default without) leaves them out;
  ``required`` and a named function constrain the output to the calls' JSON (structured output:
  an array of ``{"name", "parameters"}`` objects, or the named function's parameters), which
  becomes the response's ``tool_calls``.
- ``response_format``: ``json_object`` and ``json_schema`` are structured outputs too; ``text``
  is none.
- ``parallel_tool_calls: false``: at most one call (the first; one array item when required).

Everything is checked before a sampler is asked: a malformed tool, choice or format is a 400
naming it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2

from gateway.errors import BadRequest
from gateway.openai.protocol import ChatCompletionRequest
from rlfleet.sampler.v1 import sampler_pb2

__all__ = [
    "ToolPlan",
    "call_id",
    "plan_tools",
    "proto_tool_calls",
    "response_tool_calls",
    "tools_structs",
]


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools and formats."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # the request's, checked
    name: str | None = None  # the named function
    structured_output: sampler_pb2.StructuredOutput | None = None
    parallel: bool = True

    @property
    def listed(self) -> list[dict[str, Any]]:
        """The tools the prompt lists (none with tool_choice none)."""
        return [] if self.mode == "none" else self.tools

    @property
    def constrained(self) -> bool:
        """The output is the calls' JSON (required or named), not free text."""
        return self.mode in ("required", "named")

    def calls(self, text: str) -> list[dict[str, str]]:
        """The calls a constrained output makes: [{"id", "name", "arguments"}]."""
        if self.mode == "named":
            return [{"id": call_id(), "name": self.name or "", "arguments": text}]
        try:
            items = json.loads(text)
        except ValueError:
            return []  # cut off by max_tokens: no complete call
        calls = [
            {"id": call_id(), "name": item["name"], "arguments": json.dumps(item["parameters"])}
            for item in items
            if isinstance(item, dict) and "name" in item and "parameters" in item
        ]
        return calls if self.parallel else calls[:1]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def plan_tools(request: ChatCompletionRequest) -> ToolPlan:
    """The request's tools, tool_choice, parallel_tool_calls and response_format, checked."""
    if request.functions is not None or request.function_call is not None:
        param = "functions" if request.functions is not None else "function_call"
        raise BadRequest(f"{param} is deprecated and not supported: use tools", param=param)
    tools = _checked_tools(request.tools or [])
    names = [tool["function"]["name"] for tool in tools]
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    name = None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                '"function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in names:
            raise BadRequest(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        mode = "named"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise BadRequest(
            f'tool_choice {choice!r} is not one of "none", "auto", "required" or a function',
            param="tool_choice",
        )
    if mode != "none" and not tools:
        raise BadRequest(f"tool_choice {mode!r} needs tools", param="tool_choice")
    parallel = request.parallel_tool_calls is not False
    structured = _response_format(request)
    if mode in ("required", "named"):
        if structured is not None:
            raise BadRequest(
                "response_format cannot be combined with a required or named tool_choice",
                param="response_format",
            )
        schema = (
            _parameters(next(t for t in tools if t["function"]["name"] == name))
            if mode == "named"
            else _calls_schema(tools, parallel)
        )
        structured = sampler_pb2.StructuredOutput(json_schema=json.dumps(schema))
    return ToolPlan(mode, tools, name, structured, parallel)


def _checked_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise BadRequest(
                'a tool must be {"type": "function", "function": {...}}', param=f"tools[{i}]"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest("a tool's function needs a name", param=f"tools[{i}].function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(
                "a function's parameters must be a JSON schema object",
                param=f"tools[{i}].function.parameters",
            )
    names = [tool["function"]["name"] for tool in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise BadRequest(f"tools name {', '.join(twice)} more than once", param="tools")
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if parameters else {"type": "object", "properties": {}}


def _calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """What a required tool_choice's output must be: calls as [{"name", "parameters"}]."""
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
            }
            for tool in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _response_format(request: ChatCompletionRequest) -> sampler_pb2.StructuredOutput | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return sampler_pb2.StructuredOutput(json_object=True)
    if fmt.type == "json_schema":
        spec = (fmt.model_extra or {}).get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format.json_schema",
            )
        return sampler_pb2.StructuredOutput(json_schema=json.dumps(schema))
    raise BadRequest(
        f'response_format type {fmt.type!r} is not one of "text", "json_object", "json_schema"',
        param="response_format",
    )


def proto_tool_calls(calls: Any, param: str) -> list[sampler_pb2.ToolCall]:
    """An assistant message's OpenAI tool_calls as the sampler's ToolCalls."""
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(
                'a tool call must be {"id", "type": "function", "function": {"name", "arguments"}}',
                param=f"{param}[{j}]",
            )
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise BadRequest(
                "a tool call's arguments must be a JSON string", param=f"{param}[{j}].arguments"
            )
        out.append(
            sampler_pb2.ToolCall(
                id=str(call.get("id") or ""), name=function["name"], arguments=arguments
            )
        )
    return out


def response_tool_calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Calls as OpenAI's message ``tool_calls``."""
    return [
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]},
        }
        for call in calls
    ]


def tools_structs(tools: list[dict[str, Any]]) -> list[struct_pb2.Struct]:
    """Tools as the sampler's ChatPrompt.tools."""
    out = []
    for tool in tools:
        struct = struct_pb2.Struct()
        struct.update(tool)
        out.append(struct)
    return out
