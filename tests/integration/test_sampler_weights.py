"""The LM sampler's weights: vLLM log-prob parity with the learner's forward, weight versions
published by a real learner WeightService and announced on a real NATS, and the rule for
requests in flight during an update (sampler/lm/gate.py).

Parity tolerance: 1e-3 absolute per token (fp32 weights, temperature 1). vLLM's CPU kernels
and transformers' eager forward sum in different orders; measured differences are ~1e-5.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.sampler import SamplerClient
from common import tensor
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import Unavailable
from services.server import channel
from tests.fixtures.lm import LmStack, disk_weights

pytestmark = pytest.mark.slow  # a vLLM engine: not in `make test-fast`

PARITY_ATOL = 1e-3
PROMPTS = ["Q: 12+34=?\nA:", "Q: 7+8=?\nA:"]


def ids(t: Any) -> list[int]:
    return tensor.decode(t).tolist()


def learner_logprobs(model: Any, prompt: list[int], completion: list[int]) -> np.ndarray:
    """What the learner computes: log_softmax of the logits, gathered at the sampled tokens."""
    from learner.lm.model import token_logprobs

    sequence = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=sequence).logits[:, len(prompt) - 1 : -1]  # [1, T, V]
    return token_logprobs(logits, sequence[:, len(prompt) :])[0].numpy()


def perturbed(state: dict[str, torch.Tensor], seed: int, model_dir: Path) -> dict[str, Any]:
    """A "trained" version: every float tensor moved by noise (sizeable, so greedy changes)."""
    from transformers import AutoConfig

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        noise = torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point() else 0
        out[name] = t + 0.05 * noise
    if AutoConfig.from_pretrained(model_dir).tie_word_embeddings:
        # The learner's export drops a tied lm_head.weight (learner/lm/model.hf_weights).
        out.pop("lm_head.weight", None)
    return out


def reference_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=[],  # ignore_eos, as the request below asks
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def load_version(model: Any, stack: LmStack, version: int) -> Any:
    missing, unexpected = model.load_state_dict(stack.weights[version], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


async def test_vllm_logprobs_match_the_learner_forward(
    lm_stack: LmStack, reference_lm: Any
) -> None:
    async with SamplerClient(lm_stack.address) as client:
        reply = await client.generate(
            PROMPTS, n=4, max_tokens=24, temperature=1.0, seed=3, logprobs=True, ignore_eos=True
        )
    version = reply.results[0].completions[0].policy_version
    model = load_version(reference_lm, lm_stack, version)
    worst = 0.0
    for result in reply.results:
        prompt = ids(result.prompt_token_ids)
        for c in result.completions:
            sampled = tensor.decode(c.logprobs)
            expected = learner_logprobs(model, prompt, ids(c.token_ids))
            worst = max(worst, float(np.abs(sampled - expected).max()))
    print(f"vLLM vs transformers log-prob max abs difference: {worst:.2e}")
    assert worst < PARITY_ATOL


async def test_published_version_is_served(lm_stack: LmStack, reference_lm: Any) -> None:
    base = lm_stack.weights[max(lm_stack.weights)]
    version = await lm_stack.publish(perturbed(base, 1, lm_stack.model_dir))
    async with SamplerClient(lm_stack.address) as client:
        info = await client.info()
        reply = await client.generate(PROMPTS, temperature=0.0, max_tokens=16, ignore_eos=True)
    assert info.policy_version == version
    model = load_version(reference_lm, lm_stack, version)
    for result in reply.results:
        c = result.completions[0]
        assert c.policy_version == c.end_policy_version == version
        assert ids(c.token_ids) == reference_greedy(model, ids(result.prompt_token_ids), 16)


async def test_request_in_flight_during_update_keeps_the_old_version(
    lm_stack: LmStack, reference_lm: Any
) -> None:
    gate = lm_stack.sampler.servicer.gate
    old = gate.version
    async with SamplerClient(lm_stack.address) as client:
        # Long enough (200 tokens x 4) to still run while the new version is fetched.
        long = asyncio.create_task(
            client.generate(PROMPTS[:1], n=4, temperature=0.0, max_tokens=200, ignore_eos=True)
        )
        async with asyncio.timeout(30):
            while gate.readers == 0:
                assert not long.done(), long.exception()
                await asyncio.sleep(0.005)
        update = perturbed(lm_stack.weights[old], 2, lm_stack.model_dir)
        publishing = asyncio.create_task(lm_stack.publish(update))
        async with asyncio.timeout(30):  # the update has arrived and waits for the gate
            while not gate.writers_waiting:
                assert not long.done(), "the long request finished before the update arrived"
                await asyncio.sleep(0.005)
        late = asyncio.create_task(
            client.generate(PROMPTS[:1], temperature=0.0, max_tokens=16, ignore_eos=True)
        )
        new = await publishing
        first, second = await long, await late
    assert new == old + 1
    reference = load_version(reference_lm, lm_stack, old)
    prompt = ids(first.results[0].prompt_token_ids)
    want_old = reference_greedy(reference, prompt, 200)
    for c in first.results[0].completions:  # finished on the old weights, every token
        assert c.policy_version == c.end_policy_version == old
        assert c.finish_reason == sampler_pb2.FINISH_REASON_LENGTH
        assert ids(c.token_ids) == want_old
    c = second.results[0].completions[0]  # arrived during the update: waited, new weights
    assert c.policy_version == c.end_policy_version == new
    reference = load_version(reference_lm, lm_stack, new)
    assert ids(c.token_ids) == reference_greedy(reference, prompt, 16)


async def test_following_sampler_is_unavailable_until_the_first_version(
    tiny_model_dir: Path, nats_url: str, tmp_path: Path
) -> None:
    """A fresh sampler (transformers engine: starts in about a second) of a run whose learner
    has published nothing yet: NOT_SERVING and UNAVAILABLE, then SERVING on the first version."""
    from learner.weights import (
        SERVICE_NAME,
        WeightServicer,
        WeightStore,
        add_weight_service,
        announce,
    )
    from rlfleet.sampler.v1 import sampler_pb2_grpc
    from sampler.lm.service import SERVICE_NAME as SAMPLER
    from sampler.lm.service import LmSampler
    from sampler.lm.settings import SamplerSettings
    from services.bus import Bus
    from services.registry import ServiceContext
    from services.server import GrpcServer

    run = f"lmwait-{uuid.uuid4().hex[:8]}"
    store = WeightStore(run)
    learner = GrpcServer("learner-wait", grace_s=0.2)
    learner.add_service(add_weight_service, WeightServicer(store), SERVICE_NAME)
    settings = SamplerSettings(
        model_path=str(tiny_model_dir), engine="hf", max_model_len=64, weights_from="learner"
    )
    async with learner, Bus.connect(nats_url, name="lmwait") as bus:
        ctx = ServiceContext(
            name="sampler-wait",
            kind="sampler",
            settings=settings,
            run_name=run,
            run_dir=tmp_path,
            nats_url=nats_url,
            endpoints={"learner": learner.address},
        )
        sampler = LmSampler(ctx, settings)
        server = GrpcServer("sampler-wait", grace_s=0.2)
        server.add_service(
            sampler_pb2_grpc.add_SamplerServiceServicer_to_server, sampler.servicer, SAMPLER
        )
        async with server, SamplerClient(server.address, timeout_s=10) as client:
            starting = asyncio.create_task(sampler.start())
            async with asyncio.timeout(60):
                while sampler.servicer.engine is None:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the follower has asked the learner and got nothing
            with pytest.raises(Unavailable, match="first weight version"):
                await client.generate(PROMPTS[:1], max_tokens=2)
            async with channel(server.address) as chan:
                health = await health_pb2_grpc.HealthStub(chan).Check(
                    health_pb2.HealthCheckRequest(service=SAMPLER), timeout=5
                )
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            manifest = store.publish(perturbed(disk_weights(tiny_model_dir), 5, tiny_model_dir))
            await announce(bus, run, manifest, learner.address)
            assert await asyncio.wait_for(starting, 30)
            server.set_serving()
            reply = await client.generate(PROMPTS[:1], max_tokens=2)
            assert reply.results[0].completions[0].policy_version == manifest.version == 0
            assert (await client.info()).engine_kind == sampler_pb2.ENGINE_KIND_HF
        ctx.stop_event.set()
        await sampler.close()


async def test_transformers_engine_matches_vllm(lm_stack: LmStack) -> None:
    """The two engines agree on the same weights: greedy tokens, logprobs, top-k, stops."""
    from sampler.engines.base import EngineConfig, SamplingOptions, build_engine

    async with SamplerClient(lm_stack.address) as client:
        reply = await client.generate(
            PROMPTS, temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=2
        )
    version = reply.results[0].completions[0].policy_version
    engine = await build_engine("hf", EngineConfig(model_path=str(lm_stack.model_dir)))
    await engine.load_weights(lm_stack.weights[version], version)
    prompts = [ids(r.prompt_token_ids) for r in reply.results]
    options = SamplingOptions(
        max_tokens=[20, 20], temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    for result, [mine] in zip(reply.results, await engine.generate(prompts, options), strict=True):
        theirs = result.completions[0]
        assert mine.token_ids == ids(theirs.token_ids)
        assert mine.text == theirs.text and mine.finish_reason == "length"
        np.testing.assert_allclose(mine.logprobs, tensor.decode(theirs.logprobs), atol=PARITY_ATOL)
        assert mine.top_token_ids == tensor.decode(theirs.top_token_ids).tolist()
    # A stop token id (the 5th greedy token) ends both at the same place, token included.
    stop_id = ids(reply.results[0].completions[0].token_ids)[4]
    stopped = SamplingOptions(max_tokens=[20], temperature=0.0, stop_token_ids=[stop_id])
    [[mine]] = await engine.generate(prompts[:1], stopped)
    want = ids(reply.results[0].completions[0].token_ids)
    assert mine.token_ids == want[: want.index(stop_id) + 1] and mine.finish_reason == "stop"
    await engine.close()
