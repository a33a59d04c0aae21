"""GenerateRequest -> (prompt token ids, SamplingOptions), validating the whole request first.

Every rule of sampler.proto's Generate comment is checked here, before anything is generated,
and the first problem found is an InvalidArgument naming the field ("prompts[3].token_ids",
"sampling.top_p"). Sampling parameters are checked before prompts (cheap before tokenizing).
Tokenization and chat templates happen here, once, so every engine sees the same token ids.
A chat prompt's images (ContentPart.image, inline bytes) are decoded and checked here; the
model's processor expands each image token into the image's tokens, and those ids are the
prompt's (what the learner scores).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from clients.env.episodes import ChatTokens
from common import tensor
from common.images import IMAGE_PART, ImageError, open_image
from common.models import canonical_tools
from rlfleet.common.v1 import tensor_pb2
from rlfleet.sampler.v1 import sampler_pb2
from sampler.engines.base import PromptImages, SamplingOptions
from services.errors import InvalidArgument

__all__ = ["Limits", "PromptRenderer", "Rendered", "parse_request", "parse_stream_request"]

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Limits:
    max_n: int
    max_prompts: int
    max_context: int  # prompt + completion tokens
    vocab_size: int
    max_images: int = 0  # per prompt; 0: the model reads text only


@dataclass(frozen=True)
class Rendered:
    """A prompt's token ids as the model sees them, and its images (None: text only)."""

    ids: list[int]
    images: PromptImages | None = None


class PromptRenderer:
    """Turns the three prompt forms into token ids with the model's own tokenizer (and, for a
    vision-language model, its processor, which expands images)."""

    def __init__(self, tokenizer: Any, processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.processor = processor

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def turn_end(self) -> tuple[int, ...]:
        """The token the chat template ends an assistant turn with: a chat prompt's
        completion stops there, as chat servers stop a model's turn."""
        return tuple(ChatTokens(self.tokenizer).turn_end) if self.has_chat_template else ()

    def stop_ids(
        self, prompts: Sequence[sampler_pb2.Prompt], stop: tuple[int, ...]
    ) -> tuple[int, ...]:
        """``stop`` plus the end of turn when a prompt is a chat."""
        if not any(p.WhichOneof("input") == "chat" for p in prompts):
            return stop
        return stop + tuple(t for t in self.turn_end if t not in stop)

    def token_ids(self, prompt: sampler_pb2.Prompt, field: str, limits: Limits) -> list[int]:
        """The prompt's token ids (a prompt with images: as the model sees them)."""
        return self.render(prompt, field, limits).ids

    def render(self, prompt: sampler_pb2.Prompt, field: str, limits: Limits) -> Rendered:
        kind = prompt.WhichOneof("input")
        images = None
        if kind is None:
            raise InvalidArgument(f"{field}: set one of text, token_ids, chat", field=field)
        field = f"{field}.{kind}"
        if kind == "text":
            if not prompt.text:
                raise InvalidArgument(f"{field} is empty", field=field)
            # As vLLM's completion API tokenizes: the tokenizer's own special tokens (a BOS
            # for models that have one) are added; special tokens in the text are parsed.
            ids = list(self.tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
        elif kind == "token_ids":
            ids = _token_ids(prompt.token_ids, field, limits.vocab_size)
        elif prompt.chat.HasField("prefix_token_ids"):
            ids = self._continued_chat(prompt.chat, field, limits)
        else:
            ids, images = self._chat(prompt.chat, field, limits)
        if not ids:
            raise InvalidArgument(f"{field}: the prompt has no tokens", field=field)
        if len(ids) >= limits.max_context:
            raise InvalidArgument(
                f"{field}: the prompt has {len(ids)} tokens, leaving no room to generate in the "
                f"context of {limits.max_context} tokens",
                field=field,
            )
        return Rendered(ids, images)

    def _chat_inputs(
        self, chat: sampler_pb2.ChatPrompt, field: str, images: list[Any] | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
        """The checked messages, template keywords and tools of a chat prompt; ``images``
        collects the decoded images of its content parts (None: images are refused)."""
        if not self.has_chat_template:
            raise InvalidArgument(
                f"{field}: the model has no chat template; send text or token_ids", field=field
            )
        if not chat.messages:
            raise InvalidArgument(f"{field}.messages is empty", field=f"{field}.messages")
        if chat.continue_final_message and chat.messages[-1].role != "assistant":
            raise InvalidArgument(
                f"{field}.continue_final_message needs an assistant message last, not "
                f"{chat.messages[-1].role!r}",
                field=f"{field}.continue_final_message",
            )
        kwargs = json_format.MessageToDict(chat.chat_template_kwargs)
        messages = [
            _message(m, f"{field}.messages[{i}]", images) for i, m in enumerate(chat.messages)
        ]
        return messages, kwargs, self.tools(chat, field)

    def _chat(
        self, chat: sampler_pb2.ChatPrompt, field: str, limits: Limits
    ) -> tuple[list[int], PromptImages | None]:
        images: list[Any] = []
        messages, kwargs, tools = self._chat_inputs(chat, field, images)
        if len(images) > limits.max_images:
            why = (
                "the model reads text only"
                if limits.max_images == 0
                else f"at most {limits.max_images} per prompt (the sampler's max_images)"
            )
            raise InvalidArgument(
                f"{field}: the prompt holds {len(images)} images; {why}", field=field
            )
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not chat.continue_final_message,
                continue_final_message=chat.continue_final_message,
                **kwargs,
            )
        except Exception as exc:  # a template's own checks (raise_exception), bad kwargs
            raise InvalidArgument(f"{field}: chat template failed: {exc}", field=field) from None
        # The template wrote any special tokens itself.
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not images:
            return ids, None
        try:
            expanded = self.processor(text=[text], images=[images])["input_ids"][0]
        except Exception as exc:  # the processor's own checks (an image token count mismatch)
            raise InvalidArgument(f"{field}: the processor failed: {exc}", field=field) from None
        placeholders = PromptImages(tuple(images), tuple(ids))
        return [int(i) for i in expanded], placeholders

    def _continued_chat(
        self, chat: sampler_pb2.ChatPrompt, field: str, limits: Limits
    ) -> list[int]:
        """A session's prompt: its earlier tokens as sampled, then only the new messages."""
        messages, kwargs, tools = self._chat_inputs(chat, field)
        count = chat.prefix_messages
        if not 1 <= count <= len(messages):
            where = f"{field}.prefix_messages"
            raise InvalidArgument(
                f"{where} must be in [1, {len(messages)}] (the messages given), got {count}",
                field=where,
            )
        if chat.continue_final_message:
            where = f"{field}.continue_final_message"
            raise InvalidArgument(f"{where} cannot go with prefix_token_ids", field=where)
        where = f"{field}.prefix_token_ids"
        prefix = _token_ids(chat.prefix_token_ids, where, limits.vocab_size)
        if not prefix:
            raise InvalidArgument(f"{where} is empty", field=where)
        tokens = ChatTokens(self.tokenizer, tools, kwargs)
        try:
            after = tokens.continuation(prefix, messages[:count], messages[count:])
        except Exception as exc:  # as _chat: the template's own checks, bad kwargs
            raise InvalidArgument(f"{field}: chat template failed: {exc}", field=field) from None
        return prefix + after

    @staticmethod
    def tools(chat: sampler_pb2.ChatPrompt, field: str = "prompt.chat") -> list[dict[str, Any]]:
        """The chat prompt's tools as plain dicts (keys sorted: canonical_tools), each checked
        to name its function."""
        tools = canonical_tools([json_format.MessageToDict(tool) for tool in chat.tools]) or []
        for i, tool in enumerate(tools):
            function = tool.get("function")
            if not isinstance(function, dict) or not function.get("name"):
                where = f"{field}.tools[{i}]"
                raise InvalidArgument(f"{where}: a tool needs function.name", field=where)
        return tools


def _message(
    m: sampler_pb2.ChatMessage, field: str, images: list[Any] | None = None
) -> dict[str, Any]:
    """A ChatMessage as the template reads it (OpenAI's shape). Its image parts become
    ``{"type": "image"}`` parts, their decoded images (RGB) appended to ``images`` (None:
    images are refused, e.g. in a continued session)."""
    content: str | list[dict[str, Any]] = m.content
    if m.parts:
        if m.content:
            raise InvalidArgument(
                f"{field}: set content or parts, not both", field=f"{field}.parts"
            )
        content = [_part(part, f"{field}.parts[{j}]", images) for j, part in enumerate(m.parts)]
    message: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in m.tool_calls
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


def _part(part: sampler_pb2.ContentPart, field: str, images: list[Any] | None) -> dict[str, Any]:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind is None:
        raise InvalidArgument(f"{field}: set text or image", field=field)
    field = f"{field}.image"
    if images is None:
        raise InvalidArgument(f"{field}: images are not accepted here", field=field)
    if part.image.WhichOneof("source") != "data":
        raise InvalidArgument(
            f"{field}: send the image's bytes (data); a sampler cannot fetch it by sha256",
            field=field,
        )
    try:
        images.append(open_image(part.image.data, name=field).convert("RGB"))
    except ImageError as exc:
        raise InvalidArgument(str(exc), field=f"{field}.data") from None
    return dict(IMAGE_PART)


def _arguments(text: str) -> Any:
    """A call's arguments for the template: templates render a mapping (``| tojson``), so
    JSON text is parsed; text that is not JSON is passed as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _token_ids(msg: tensor_pb2.Tensor, field: str, vocab_size: int) -> list[int]:
    if msg.dtype != tensor_pb2.D_TYPE_INT32 or len(msg.shape) != 1:
        raise InvalidArgument(
            f"{field}: expected int32 [L], got {tensor.dtype_name(msg.dtype)} {list(msg.shape)}",
            field=field,
        )
    ids = tensor.decode(msg, name=field)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise InvalidArgument(f"{field}: token id {bad} is outside [0, {vocab_size})", field=field)
    return ids.tolist()


def _sampling(s: sampler_pb2.SamplingParams, limits: Limits) -> dict[str, Any]:
    """Checked and defaulted sampling parameters (SamplingOptions fields but max_tokens)."""

    def bad(name: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"sampling.{name} {why}", field=f"sampling.{name}")

    def opt(name: str, default: Any) -> Any:
        return getattr(s, name) if s.HasField(name) else default

    n = s.n or 1
    if n > limits.max_n:
        raise bad("n", f"must be in [1, {limits.max_n}], got {n}")
    out: dict[str, Any] = {
        "n": n,
        "temperature": opt("temperature", 1.0),
        "top_p": opt("top_p", 1.0),
        "top_k": opt("top_k", 0),
        "min_p": opt("min_p", 0.0),
        "presence_penalty": opt("presence_penalty", 0.0),
        "frequency_penalty": opt("frequency_penalty", 0.0),
        "repetition_penalty": opt("repetition_penalty", 1.0),
    }
    checks = {
        "temperature": (lambda v: v >= 0, "must be >= 0"),
        "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
        "top_k": (lambda v: v >= -1, "must be >= -1 (-1 or 0: off)"),
        "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        "presence_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
        "frequency_penalty": (lambda v: -2 <= v <= 2, "must be in [-2, 2]"),
        "repetition_penalty": (lambda v: v > 0, "must be > 0"),
    }
    for name, (ok, why) in checks.items():
        value = out[name]
        if not math.isfinite(value) or not ok(value):
            raise bad(name, f"{why}, got {value}")
    out["top_k"] = max(out["top_k"], 0)  # -1 and 0 both mean off; engines take 0
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"has {len(s.stop)} strings, at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(s.stop):
        if not text:
            raise bad(f"stop[{i}]", "is empty")
    for i, token in enumerate(s.stop_token_ids):
        if not 0 <= token < limits.vocab_size:
            raise bad(f"stop_token_ids[{i}]", f"{token} is outside [0, {limits.vocab_size})")
    out.update(
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        seed=opt("seed", None),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        structured_output=_structured_output(s),
    )
    return out


def _structured_output(s: sampler_pb2.SamplingParams) -> tuple[str, str] | None:
    """SamplingOptions.structured_output; a schema that is not a JSON object is refused."""
    if not s.HasField("structured_output"):
        return None
    wanted = s.structured_output
    kind = wanted.WhichOneof("format")
    if kind == "json_schema":
        field = "sampling.structured_output.json_schema"
        try:
            schema = json.loads(wanted.json_schema)
        except ValueError as exc:
            raise InvalidArgument(f"{field} is not JSON: {exc}", field=field) from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{field} must be a JSON object (a schema)", field=field)
        return "json_schema", wanted.json_schema
    if kind == "json_object" and wanted.json_object:
        return "json_object", ""
    return None


def parse_request(
    request: sampler_pb2.GenerateRequest,
    limits: Limits,
    renderer: PromptRenderer,
    received: float | None = None,
) -> tuple[list[Rendered], SamplingOptions]:
    """Validate the whole request; returns each prompt rendered and the engine's options.

    `received` is the time.monotonic() the request arrived: `timeout` counts from it.
    """
    received = time.monotonic() if received is None else received
    count = len(request.prompts)
    if count == 0:
        raise InvalidArgument("prompts is empty: send at least one prompt", field="prompts")
    if count > limits.max_prompts:
        raise InvalidArgument(
            f"prompts has {count} entries, more than max_prompts_per_request="
            f"{limits.max_prompts}; split the batch",
            field="prompts",
        )
    deadline = None
    if request.HasField("timeout"):
        seconds = request.timeout.seconds + request.timeout.nanos / 1e9
        if seconds < 0:
            raise InvalidArgument(f"timeout must be >= 0, got {seconds}s", field="timeout")
        deadline = received + seconds
    sampling = _sampling(request.sampling, limits)
    prompts = [renderer.render(p, f"prompts[{i}]", limits) for i, p in enumerate(request.prompts)]
    sampling["stop_token_ids"] = renderer.stop_ids(request.prompts, sampling["stop_token_ids"])
    # 0 = until the context runs out; more than the room left is cut to it (finish: length).
    wanted = request.sampling.max_tokens
    rooms = [limits.max_context - len(p.ids) for p in prompts]
    max_tokens = [min(wanted, room) if wanted else room for room in rooms]
    return prompts, SamplingOptions(max_tokens=max_tokens, deadline=deadline, **sampling)


def parse_stream_request(
    request: sampler_pb2.GenerateStreamRequest,
    limits: Limits,
    renderer: PromptRenderer,
    received: float | None = None,
) -> tuple[Rendered, SamplingOptions]:
    """GenerateStream's request by Generate's rules, the fields named "prompt.*"; returns the
    prompt rendered and the options (max_tokens with one entry)."""
    received = time.monotonic() if received is None else received
    if not request.HasField("prompt"):
        raise InvalidArgument("prompt is missing", field="prompt")
    deadline = None
    if request.HasField("timeout"):
        seconds = request.timeout.seconds + request.timeout.nanos / 1e9
        if seconds < 0:
            raise InvalidArgument(f"timeout must be >= 0, got {seconds}s", field="timeout")
        deadline = received + seconds
    sampling = _sampling(request.sampling, limits)
    prompt = renderer.render(request.prompt, "prompt", limits)
    sampling["stop_token_ids"] = renderer.stop_ids([request.prompt], sampling["stop_token_ids"])
    room = limits.max_context - len(prompt.ids)
    wanted = request.sampling.max_tokens
    max_tokens = [min(wanted, room) if wanted else room]
    return prompt, SamplingOptions(
        max_tokens=max_tokens,
        deadline=deadline,
        stream_interval=max(1, request.stream_interval),
        **sampling,
    )
