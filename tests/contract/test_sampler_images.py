"""Image prompts through SamplerService over real gRPC, on a real vLLM engine serving the tiny
vision-language model (tests/fixtures/lm.py `vision_sampler`): the prompt's ids are what the
model's processor makes of the chat and its images, the log-probabilities are the transformers
model's on the same pixels, and every bad image request is INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from clients.sampler import SamplerClient, to_prompt
from common import tensor
from common.datasets import iter_tasks, take
from common.images import open_image
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument
from tests.fixtures.lm import LmStack, ServingSampler

pytestmark = pytest.mark.slow  # a vLLM engine

LOGPROB_TOLERANCE = 1e-4  # float32 on both sides


@pytest.fixture
async def client(vision_sampler: ServingSampler) -> AsyncIterator[SamplerClient]:
    async with SamplerClient(vision_sampler.address, timeout_s=300) as c:
        yield c


def shapes(count: int) -> list[Any]:
    return take(iter_tasks({"generator": "shapes", "split": "eval"}), count)


def image_messages(task: Any) -> list[dict[str, Any]]:
    """The task's messages with its image bytes in the image part (clients.sampler's form)."""
    images = iter(task.images)
    return [
        {
            **m,
            "content": [
                {**part, "image": next(images)} if part.get("type") == "image" else part
                for part in m["content"]
            ]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in task.messages
    ]


def ids(t: Any) -> list[int]:
    return tensor.decode(t).tolist()


async def test_info_says_how_many_images_a_prompt_may_hold(client: SamplerClient) -> None:
    info = await client.info()
    assert info.max_images_per_prompt == 2


async def test_an_image_prompt_is_what_the_processor_makes_and_scores_as_the_learner(
    client: SamplerClient, vision_model_dir: Path
) -> None:
    """The learner's model (its image tokens biased as the sampler biases them) gives the
    sampler's log-probabilities on the sampler's prompt ids and the same pixels."""
    from transformers import AutoProcessor

    from learner.lm.model import load_causal_lm

    tasks = shapes(2)
    reply = await client.generate(
        [image_messages(t) for t in tasks], max_tokens=6, temperature=0.0, logprobs=True
    )
    processor = AutoProcessor.from_pretrained(vision_model_dir)
    model = load_causal_lm(vision_model_dir, frozen=True)
    for task, result in zip(tasks, reply.results, strict=True):
        text = processor.apply_chat_template(list(task.messages), add_generation_prompt=True)
        inputs = processor(text=[text], images=[[open_image(task.images[0])]], return_tensors="pt")
        prompt = ids(result.prompt_token_ids)
        assert prompt == inputs["input_ids"][0].tolist()  # the image expanded, as transformers
        completion = result.completions[0]
        tokens = ids(completion.token_ids)
        full = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(
                input_ids=full,
                attention_mask=torch.ones_like(full),
                pixel_values=inputs["pixel_values"],
                pixel_attention_mask=inputs["pixel_attention_mask"],
            ).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])
        got = tensor.decode(completion.logprobs)
        assert max(abs(g - w) for g, w in zip(got, want[:, 0].tolist(), strict=True)) < (
            LOGPROB_TOLERANCE
        )


async def test_image_tokens_are_never_sampled(
    client: SamplerClient, vision_model_dir: Path
) -> None:
    """A random model puts some probability on its image markers; the sampler never writes
    them (they would be text standing for pixels), and says so in the logprobs."""
    from transformers import AutoProcessor

    from common.images import IMAGE_TOKEN_BIAS, image_token_ids

    banned = set(image_token_ids(AutoProcessor.from_pretrained(vision_model_dir)))
    reply = await client.generate(
        [image_messages(t) for t in shapes(2)],
        n=4, max_tokens=48, temperature=1.5, seed=3, logprobs=True, top_logprobs=20,
        ignore_eos=True,
    )  # fmt: skip
    for result in reply.results:
        for completion in result.completions:
            assert not banned & set(ids(completion.token_ids))
            top = tensor.decode(completion.top_token_ids)
            listed = tensor.decode(completion.top_logprobs)
            for row_ids, row_logprobs in zip(top.tolist(), listed.tolist(), strict=True):
                for token, logprob in zip(row_ids, row_logprobs, strict=True):
                    assert token not in banned or logprob < IMAGE_TOKEN_BIAS / 2


async def test_a_streamed_image_prompt_gives_generates_tokens(client: SamplerClient) -> None:
    task = shapes(1)[0]
    prompt = to_prompt(image_messages(task))
    reply = await client.generate([prompt], max_tokens=6, temperature=0.0)
    request = sampler_pb2.GenerateStreamRequest(
        prompt=prompt, sampling=sampler_pb2.SamplingParams(max_tokens=6, temperature=0.0)
    )
    streamed: list[int] = []
    async with contextlib.aclosing(client.stream(request)) as messages:
        async for message in messages:
            if message.HasField("start"):
                assert ids(message.start.prompt_token_ids) == ids(reply.results[0].prompt_token_ids)
            else:
                streamed += ids(message.delta.token_ids)
    assert streamed == ids(reply.results[0].completions[0].token_ids)


def _with_parts(*parts: sampler_pb2.ContentPart, content: str = "") -> sampler_pb2.Prompt:
    message = sampler_pb2.ChatMessage(role="user", content=content, parts=list(parts))
    return sampler_pb2.Prompt(chat=sampler_pb2.ChatPrompt(messages=[message]))


def _image(**source: Any) -> sampler_pb2.ContentPart:
    return sampler_pb2.ContentPart(image=sampler_pb2.Image(**source))


@pytest.mark.parametrize(
    ("case", "field", "words"),
    [
        ("three images", "prompts[0].chat", "at most 2 per prompt"),
        ("by digest", "prompts[0].chat.messages[0].parts[0].image", "bytes"),
        ("not an image", "prompts[0].chat.messages[0].parts[0].image.data", "image"),
        ("content and parts", "prompts[0].chat.messages[0].parts", "not both"),
    ],
)
async def test_bad_image_requests_name_their_field(
    client: SamplerClient, case: str, field: str, words: str
) -> None:
    png = shapes(1)[0].images[0]
    text = sampler_pb2.ContentPart(text="Which colour?")
    prompt = {
        "three images": _with_parts(*[_image(data=png)] * 3, text),
        "by digest": _with_parts(_image(sha256="ab" * 32), text),
        "not an image": _with_parts(_image(data=b"GIF89a not really"), text),
        "content and parts": _with_parts(_image(data=png), content="Which colour?"),
    }[case]
    with pytest.raises(InvalidArgument) as caught:
        await client.generate([prompt], max_tokens=2)
    assert caught.value.field == field and words in str(caught.value)
    # The sampler still answers the next request.
    assert (await client.generate(["Hello"], max_tokens=1)).results[0].completions


async def test_a_text_model_refuses_images(lm_stack: LmStack) -> None:
    png = shapes(1)[0].images[0]
    async with SamplerClient(lm_stack.address, timeout_s=120) as text_client:
        assert (await text_client.info()).max_images_per_prompt == 0
        with pytest.raises(InvalidArgument, match="reads text only"):
            await text_client.generate(
                [_with_parts(_image(data=png), sampler_pb2.ContentPart(text="Hi"))], max_tokens=2
            )
