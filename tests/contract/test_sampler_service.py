"""SamplerService (sampler/lm) over real gRPC with a real vLLM engine: the Generate and GetInfo
contract of protos/rlfleet/sampler/v1/sampler.proto.

All tests share the session's one sampler (tests/fixtures/lm.py). Whatever weight version it
serves, these tests compare the sampler with itself or with the proto's rules, never with fixed
token ids.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.sampler import SamplerClient, to_prompt
from common import tensor
from rlfleet.common.v1 import tensor_pb2
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from services.errors import InvalidArgument, ResourceExhausted, from_rpc_error
from services.server import channel
from tests.fixtures.lm import MAX_MODEL_LEN, LmStack

pytestmark = pytest.mark.slow  # a vLLM engine (about 90 s to start on CPU): not in `make test-fast`

PROMPT = "Q: 12+34=?\nA:"
FINISH = sampler_pb2.FinishReason


@pytest.fixture
async def client(lm_stack: LmStack) -> AsyncIterator[SamplerClient]:
    async with SamplerClient(lm_stack.address, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids(t: tensor_pb2.Tensor) -> list[int]:
    assert t.dtype == tensor_pb2.D_TYPE_INT32 and len(t.shape) == 1
    return tensor.decode(t).tolist()


def greedy(**kw: Any) -> dict[str, Any]:
    return {"temperature": 0.0, **kw}


# --------------------------------------------------------------------------- prompts


async def test_text_prompt_n_completions(client: SamplerClient, tokenizer: Any) -> None:
    reply = await client.generate([PROMPT, "Q: 5+6=?\nA:"], n=3, max_tokens=6, seed=1)
    info = await client.info()
    assert len(reply.results) == 2
    first = reply.results[0]
    assert ids(first.prompt_token_ids) == tokenizer(PROMPT)["input_ids"]
    assert len(first.completions) == 3
    for c in first.completions:
        tokens = ids(c.token_ids)
        assert 1 <= len(tokens) <= 6
        assert c.finish_reason in (FINISH.FINISH_REASON_LENGTH, FINISH.FINISH_REASON_STOP)
        assert c.policy_version == c.end_policy_version == info.policy_version
        assert c.text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert not c.HasField("logprobs") and not c.HasField("top_token_ids")


async def test_token_ids_prompt_equals_text_prompt(client: SamplerClient, tokenizer: Any) -> None:
    prompt_ids = np.asarray(tokenizer(PROMPT)["input_ids"], np.int32)
    reply = await client.generate([PROMPT, prompt_ids], **greedy(max_tokens=8))
    text, token = reply.results
    assert ids(text.prompt_token_ids) == ids(token.prompt_token_ids) == prompt_ids.tolist()
    assert ids(text.completions[0].token_ids) == ids(token.completions[0].token_ids)


async def test_chat_prompt_uses_the_template(client: SamplerClient, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2=?"}]
    continued = [*messages, {"role": "assistant", "content": "The answer"}]
    cont = to_prompt(continued)
    cont.chat.continue_final_message = True
    reply = await client.generate([messages, cont], **greedy(max_tokens=4))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    want = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids(reply.results[0].prompt_token_ids) == want
    text = tokenizer.decode(ids(reply.results[1].prompt_token_ids))
    assert text.endswith("<|im_start|>assistant\nThe answer")  # no end-of-turn, no new turn


# --------------------------------------------------------------------------- sampling


async def test_seed_reproduces_completions(client: SamplerClient) -> None:
    kw = {"n": 3, "max_tokens": 12, "seed": 1234, "temperature": 1.0, "logprobs": True}
    a, b = await asyncio.gather(client.generate([PROMPT], **kw), client.generate([PROMPT], **kw))
    other = await client.generate([PROMPT], **{**kw, "seed": 99})

    def tokens(reply: sampler_pb2.GenerateResponse) -> list[list[int]]:
        return [ids(c.token_ids) for c in reply.results[0].completions]

    assert tokens(a) == tokens(b)
    assert len({tuple(t) for t in tokens(a)}) > 1  # n samples differ from each other
    assert tokens(other) != tokens(a)
    for x, y in zip(a.results[0].completions, b.results[0].completions, strict=True):
        assert tensor.decode(x.logprobs).tolist() == tensor.decode(y.logprobs).tolist()


async def test_max_tokens_and_context_room(client: SamplerClient) -> None:
    reply = await client.generate([PROMPT], **greedy(max_tokens=5, ignore_eos=True))
    c = reply.results[0].completions[0]
    assert len(ids(c.token_ids)) == 5 and c.finish_reason == FINISH.FINISH_REASON_LENGTH
    room = MAX_MODEL_LEN - len(ids(reply.results[0].prompt_token_ids))
    # 0 = until the context runs out; more than the room is cut to it.
    for max_tokens in (0, 10_000):
        reply = await client.generate([PROMPT], **greedy(max_tokens=max_tokens, ignore_eos=True))
        c = reply.results[0].completions[0]
        assert len(ids(c.token_ids)) == room and c.finish_reason == FINISH.FINISH_REASON_LENGTH


async def test_stop_strings_and_stop_token_ids(client: SamplerClient, tokenizer: Any) -> None:
    base = (await client.generate([PROMPT], **greedy(max_tokens=24, ignore_eos=True))).results[0]
    full, full_text = ids(base.completions[0].token_ids), base.completions[0].text
    # Stop at a printable ASCII character of the greedy text (the random model's text is mostly
    # odd bytes): the completion is the greedy one up to the token whose text completes the
    # match, and the text ends just before the match.
    stop = next(ch for ch in full_text[1:] if ch.isascii() and ch.isprintable() and ch != " ")
    cut = next(t for t in range(1, len(full) + 1) if stop in tokenizer.decode(full[:t]))
    reply = await client.generate([PROMPT], **greedy(max_tokens=24, ignore_eos=True, stop=[stop]))
    c = reply.results[0].completions[0]
    assert c.finish_reason == FINISH.FINISH_REASON_STOP
    assert ids(c.token_ids) == full[:cut]
    assert c.text == full_text[: full_text.find(stop)]  # the matched string is removed
    # A stop token id ends the completion and is included.
    target = full[4]
    reply = await client.generate(
        [PROMPT], **greedy(max_tokens=24, ignore_eos=True, stop_token_ids=[target])
    )
    c = reply.results[0].completions[0]
    assert ids(c.token_ids) == full[: full.index(target) + 1]
    assert c.finish_reason == FINISH.FINISH_REASON_STOP


async def test_logprobs_and_top_logprobs_shapes(client: SamplerClient) -> None:
    reply = await client.generate(
        [PROMPT], **greedy(n=1, max_tokens=7, logprobs=True, top_logprobs=3, ignore_eos=True)
    )
    c = reply.results[0].completions[0]
    tokens = ids(c.token_ids)
    logprobs = tensor.decode(c.logprobs)
    top_ids, top_lp = tensor.decode(c.top_token_ids), tensor.decode(c.top_logprobs)
    assert logprobs.dtype == np.float32 and logprobs.shape == (7,)
    assert top_ids.dtype == np.int32 and top_ids.shape == (7, 3)
    assert top_lp.dtype == np.float32 and top_lp.shape == (7, 3)
    assert np.all(np.diff(top_lp, axis=1) <= 0)  # most likely first
    assert np.all(logprobs <= 0)
    # Greedy: the sampled token is the most likely one.
    assert top_ids[:, 0].tolist() == tokens
    np.testing.assert_allclose(top_lp[:, 0], logprobs, atol=1e-6)


async def test_timeout_aborts_with_partial_tokens(client: SamplerClient) -> None:
    reply = await client.generate(
        [PROMPT, PROMPT], n=2, max_tokens=0, ignore_eos=True, logprobs=True, timeout=0.2
    )
    room = MAX_MODEL_LEN - len(ids(reply.results[0].prompt_token_ids))
    for result in reply.results:
        for c in result.completions:
            assert c.finish_reason == FINISH.FINISH_REASON_ABORT
            tokens = ids(c.token_ids)
            assert len(tokens) < room
            assert tensor.decode(c.logprobs).shape == (len(tokens),)


async def test_get_info(client: SamplerClient, lm_stack: LmStack, tokenizer: Any) -> None:
    info = await client.info()
    assert info.model_name == "tiny"
    assert info.model_path == str(lm_stack.model_dir)
    assert info.max_context_length == MAX_MODEL_LEN
    assert info.engine_kind == sampler_pb2.ENGINE_KIND_VLLM
    assert info.engine_version == "vllm 0.32.0"
    assert (info.max_n, info.max_prompts_per_request) == (8, 8)
    assert info.has_chat_template
    assert info.prefix_caching  # vLLM keeps one, on CPU too
    assert list(info.eos_token_ids) == [tokenizer.eos_token_id]
    assert info.vocab_size == len(tokenizer)
    assert info.policy_version == lm_stack.sampler.servicer.gate.version


def test_the_engines_worker_threads_run_on_its_assigned_cpus(lm_stack: LmStack) -> None:
    """The CPUs the fixture assigned (RLFLEET_CPUS, as `rlfleet up` places replicas) bind every
    thread of the engine's worker process (VLLM_CPU_OMP_THREADS_BIND)."""
    from services.placement import _descendants

    workers = [p for p in _descendants(os.getpid()) if _comm(f"/proc/{p}") == "VLLM::Worker"]
    assert workers, "no VLLM::Worker process below this one"
    for pid in workers:
        allowed = {
            tid: _cpus_allowed(f"/proc/{pid}/task/{tid}") for tid in os.listdir(f"/proc/{pid}/task")
        }
        assert set(allowed.values()) == {frozenset(lm_stack.cpus)}, allowed


def _comm(path: str) -> str:
    with open(f"{path}/comm") as f:
        return f.read().strip()


def _cpus_allowed(path: str) -> frozenset[int]:
    """Cpus_allowed_list of /proc/<pid>/task/<tid>/status ("0-2,5") as CPU ids."""
    with open(f"{path}/status") as f:
        raw = next(line for line in f if line.startswith("Cpus_allowed_list:")).split()[1]
    cpus: set[int] = set()
    for part in raw.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


async def test_queue_bound_is_resource_exhausted(client: SamplerClient) -> None:
    # max_queued_requests=8: eight prompts in flight fill the queue.
    busy = asyncio.create_task(
        client.generate([PROMPT] * 8, max_tokens=0, ignore_eos=True, timeout=2.0)
    )
    await asyncio.sleep(0.3)
    with pytest.raises(ResourceExhausted, match="max_queued_requests=8"):
        await client.generate([PROMPT], max_tokens=1)
    await busy
    await client.generate([PROMPT], max_tokens=1)  # room again


# --------------------------------------------------------------------------- bad input


def _req(prompts: list[Any] | None = None, **sampling: Any) -> sampler_pb2.GenerateRequest:
    prompts = [PROMPT] if prompts is None else prompts
    return sampler_pb2.GenerateRequest(
        prompts=[to_prompt(p) for p in prompts], sampling=sampler_pb2.SamplingParams(**sampling)
    )


def _raw_ids(values: Any, dtype: str = "int32") -> sampler_pb2.Prompt:
    return sampler_pb2.Prompt(token_ids=tensor.encode(np.asarray(values, dtype)))


def _with_timeout(seconds: int) -> sampler_pb2.GenerateRequest:
    request = _req()
    request.timeout.seconds = seconds
    return request


def _chat_continuing_user() -> sampler_pb2.GenerateRequest:
    prompt = to_prompt([{"role": "user", "content": "hi"}])
    prompt.chat.continue_final_message = True
    return _req([prompt])


BAD: dict[str, tuple[Callable[[], sampler_pb2.GenerateRequest], str]] = {
    "no prompts": (lambda: sampler_pb2.GenerateRequest(), "prompts"),
    "too many prompts": (lambda: _req([PROMPT] * 9), "prompts"),
    "prompt unset": (lambda: _req([PROMPT, sampler_pb2.Prompt()]), "prompts[1]"),
    "empty text": (lambda: _req([PROMPT, ""]), "prompts[1].text"),
    "too long": (lambda: _req([PROMPT, "1" * MAX_MODEL_LEN]), "prompts[1].text"),
    "token ids empty": (lambda: _req([PROMPT, _raw_ids([])]), "prompts[1].token_ids"),
    "token ids int64": (lambda: _req([_raw_ids([1, 2], "int64")]), "prompts[0].token_ids"),
    "token ids 2-d": (lambda: _req([_raw_ids([[1, 2]])]), "prompts[0].token_ids"),
    "token id negative": (lambda: _req([_raw_ids([1, -1])]), "prompts[0].token_ids"),
    "token id >= vocab": (lambda: _req([PROMPT, _raw_ids([5, 10**6])]), "prompts[1].token_ids"),
    "token ids fill context": (
        lambda: _req([_raw_ids([5] * MAX_MODEL_LEN)]),
        "prompts[0].token_ids",
    ),
    "chat without messages": (
        lambda: _req([sampler_pb2.Prompt(chat=sampler_pb2.ChatPrompt())]),
        "prompts[0].chat.messages",
    ),
    "continue a user turn": (_chat_continuing_user, "prompts[0].chat.continue_final_message"),
    "n too large": (lambda: _req(n=9), "sampling.n"),
    "negative temperature": (lambda: _req(temperature=-0.5), "sampling.temperature"),
    "top_p zero": (lambda: _req(top_p=0.0), "sampling.top_p"),
    "top_p above one": (lambda: _req(top_p=1.5), "sampling.top_p"),
    "top_k below -1": (lambda: _req(top_k=-2), "sampling.top_k"),
    "min_p above one": (lambda: _req(min_p=1.5), "sampling.min_p"),
    "top_logprobs above 20": (lambda: _req(top_logprobs=21), "sampling.top_logprobs"),
    "presence penalty": (lambda: _req(presence_penalty=3.0), "sampling.presence_penalty"),
    "frequency penalty": (lambda: _req(frequency_penalty=-2.5), "sampling.frequency_penalty"),
    "repetition penalty": (lambda: _req(repetition_penalty=0.0), "sampling.repetition_penalty"),
    "empty stop string": (lambda: _req(stop=["ok", ""]), "sampling.stop[1]"),
    "too many stop strings": (lambda: _req(stop=[str(i) for i in range(17)]), "sampling.stop"),
    "stop token id": (lambda: _req(stop_token_ids=[1, 10**6]), "sampling.stop_token_ids[1]"),
    "negative timeout": (lambda: _with_timeout(-1), "timeout"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_request_is_invalid_argument_naming_the_field(
    lm_stack: LmStack, case: str
) -> None:
    make, field = BAD[case]
    async with channel(lm_stack.address) as chan:
        stub = sampler_pb2_grpc.SamplerServiceStub(chan)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(make(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    error = from_rpc_error(info.value)
    assert isinstance(error, InvalidArgument) and error.field == field, error


async def test_chat_without_template_is_invalid_argument(lm_stack: LmStack) -> None:
    renderer = lm_stack.sampler.servicer.renderer
    template, renderer.tokenizer.chat_template = renderer.tokenizer.chat_template, None
    try:
        async with SamplerClient(lm_stack.address) as client:
            with pytest.raises(InvalidArgument, match="no chat template") as info:
                await client.generate([PROMPT, [{"role": "user", "content": "hi"}]])
            assert info.value.field == "prompts[1].chat"
            assert not (await client.info()).has_chat_template
    finally:
        renderer.tokenizer.chat_template = template
