"""Multi-turn episodes (clients/env/episodes.py) on real parts: the session's vLLM sampler
and an env server's text envs over gRPC. The model's tokens are kept exactly as sampled, the
env's come from the chat template, and every cap ends an episode with its outcome."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from clients.env.episodes import ChatTokens, EpisodeLimits, play_group
from clients.env.text import TextSession
from clients.sampler import SamplerClient
from common import tensor
from env_server.service import EnvServerSettings
from reward_service.service import serve
from reward_service.settings import RewardSettings
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from sampler.rollout.settings import RolloutSettings
from sampler.rollout.turns import sampler_turns
from services.bus import EmbeddedNats
from services.errors import ConfigError, Unavailable
from services.ports import free_port
from services.registry import ServiceContext
from tests.fixtures.env_server import env_server_in_process
from tests.fixtures.lm import MAX_MODEL_LEN, LmStack
from tests.fixtures.rollout import driver_groups

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

GROUP = 4
SAMPLING = sampler_pb2.SamplingParams(temperature=1.0, max_tokens=12)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env_address() -> AsyncIterator[str]:
    async with env_server_in_process("multi-turn", EnvServerSettings()) as address:
        yield address


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Recorded:
    """The sampler's turns, with what each returned (to check nothing was re-tokenized)."""

    def __init__(self, address: str) -> None:
        self.client = SamplerClient(address)
        self.turns = sampler_turns(self.client, SAMPLING)
        self.sampled: dict[int, list[list[int]]] = {}

    async def __call__(self, episode: Any, prompt_ids: list[int], room: int) -> Any:
        result = await self.turns(episode, prompt_ids, room)
        ids = tensor.decode(result.completions[0].token_ids).tolist()
        self.sampled.setdefault(episode.env_index, []).append(ids)
        return result


async def test_a_group_plays_to_its_ends_keeping_the_sampled_tokens(
    lm_stack: LmStack, env_address: str, tokenizer: Any
) -> None:
    generate = Recorded(lm_stack.address)
    limits = EpisodeLimits(max_turns=4, max_total_tokens=MAX_MODEL_LEN)
    async with TextSession(env_address) as session:
        await session.create("GuessNumber-v0", GROUP)
        episodes = await play_group(session, 11, GROUP, ChatTokens(tokenizer), generate, limits)
    await generate.client.close()
    assert len({tuple(e.prompt_ids) for e in episodes}) == 1  # one task for the whole group
    # Turns went both ways: some episode holds the env's tokens between two model turns.
    assert max(e.turns for e in episodes) >= 2
    assert any(not m for e in episodes for m in e.loss_mask)
    assert len({tuple(e.token_ids) for e in episodes}) > 1  # each episode sampled apart
    for episode in episodes:
        assert episode.outcome in {"found", "max_turns", "max_total_tokens"}, episode.outcome
        assert 1 <= episode.turns <= limits.max_turns
        assert episode.length <= limits.max_total_tokens
        n = len(episode.token_ids)
        assert len(episode.logprobs) == len(episode.loss_mask) == n
        # The model's tokens, in order, are exactly what the sampler returned, with logprobs.
        mask = np.asarray(episode.loss_mask)
        model = np.asarray(episode.token_ids)[mask].tolist()
        assert model == [t for turn in generate.sampled[episode.env_index] for t in turn]
        assert all(p < 0 for p in np.asarray(episode.logprobs)[mask])
        assert all(p == 0 for p in np.asarray(episode.logprobs)[~mask])
        # The env's tokens are the template's rendering of its messages (the model's turns are
        # checked token by token above: their text may hold special tokens a decode skips).
        text = tokenizer.decode(episode.prompt_ids + episode.token_ids, skip_special_tokens=False)
        for message in episode.messages:
            if message["role"] != "assistant":
                assert f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>" in text
        # The weights the sampler serves (other tests of the session may have published some).
        assert (
            episode.first_version == episode.last_version == lm_stack.sampler.servicer.gate.version
        )
        assert 0 <= episode.cached_tokens <= episode.prompt_tokens
    # Every turn after an episode's first resends the conversation so far to the same sampler,
    # whose prefix cache holds it: most of those prompts' tokens are not computed again.
    later = [e for e in episodes if e.turns >= 2]
    first_turns = sum(len(e.prompt_ids) for e in later)
    resent = sum(e.prompt_tokens for e in later) - first_turns
    assert sum(e.cached_tokens for e in later) >= 0.5 * resent


async def test_the_sampler_reports_its_prefix_cache_hit_rate(lm_stack: LmStack) -> None:
    """A prompt sent twice is found in the prefix cache the second time; the sampler's Metrics
    events say so under its own name."""
    from rlfleet.bus.v1 import events_pb2
    from services.bus import events_subject

    prompt = sampler_pb2.Prompt(text="12+34=" * 8)
    request = sampler_pb2.GenerateRequest(
        prompts=[prompt], sampling=sampler_pb2.SamplingParams(temperature=0, max_tokens=2)
    )
    sub = await lm_stack.bus.subscribe(events_subject(lm_stack.run, "metrics"), events_pb2.Metrics)
    async with sub, SamplerClient(lm_stack.address) as client:
        await client.generate_request(request)
        again = await client.generate_request(request)
        assert again.results[0].cached_prompt_tokens > 0
        rates: list[float] = []  # until the interval holding the second request is reported
        async with asyncio.timeout(30):
            async for delivery in sub:
                event = delivery.message
                rate = event.scalars.get("sampler/prefix_cache_hit_rate")
                if event.source == "sampler-test" and rate is not None:
                    rates.append(rate)
                    if rate > 0:
                        break
    assert all(0 <= rate <= 1 for rate in rates) and rates[-1] > 0


async def test_each_cap_ends_an_episode_with_its_outcome(
    lm_stack: LmStack, env_address: str, tokenizer: Any
) -> None:
    generate = Recorded(lm_stack.address)
    tokens = ChatTokens(tokenizer)
    async with TextSession(env_address) as session:
        await session.create("Innkeeper-v0", 2, kwargs={"min_chat": 3, "max_chat": 3})
        one_turn = await play_group(session, 1, 2, tokens, generate, EpisodeLimits(max_turns=1))
        assert [e.outcome for e in one_turn] == ["max_turns"] * 2
        assert all(e.turns == 1 and e.loss_mask[-1] for e in one_turn)  # no env reply after
        short = EpisodeLimits(max_turns=10, max_total_tokens=one_turn[0].length + 4)
        capped = await play_group(session, 1, 2, tokens, generate, short)
        assert [e.outcome for e in capped] == ["max_total_tokens"] * 2
        assert all(e.length <= short.max_total_tokens for e in capped)
        with pytest.raises(ConfigError, match="leaves no room for a model turn"):
            await play_group(session, 1, 2, tokens, generate, EpisodeLimits(max_total_tokens=16))
        timed = await play_group(
            session, 1, 2, tokens, generate, EpisodeLimits(max_turns=10, wall_clock_s=0.0)
        )
        assert [e.outcome for e in timed] == ["wall_clock"] * 2
    await generate.client.close()


async def test_an_env_server_gone_mid_episode_fails_the_group_not_hangs(
    lm_stack: LmStack, tokenizer: Any
) -> None:
    generate = Recorded(lm_stack.address)
    async with env_server_in_process("multi-turn-doomed", EnvServerSettings()) as address:
        session = TextSession(address, request_timeout_s=20)
        await session.create("GuessNumber-v0", 2)
        await session.reset()
    with pytest.raises(Unavailable):  # the server stopped: its stream and episodes are gone
        await play_group(session, 3, 2, ChatTokens(tokenizer), generate, EpisodeLimits())
    await session.close()
    await generate.client.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rewards() -> AsyncIterator[str]:
    ctx = ServiceContext(name="rewards", kind="reward_service", settings=RewardSettings())
    ctx.port = free_port()
    serving = asyncio.create_task(serve(ctx, entry_points=[]))
    yield f"127.0.0.1:{ctx.port}"
    ctx.stop_event.set()
    await asyncio.wait_for(serving, 30)


def uuid_run() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def episode_driver(
    lm_stack: LmStack,
    env_address: str,
    reward_service: str,
    *,
    seed: int,
    max_turns: int,
    group_size: int,
    **settings: Any,
) -> RolloutSettings:
    """A rollout driver feeding and playing GuessNumber-v0 groups, one at a time."""
    return RolloutSettings(
        sampler=[lm_stack.address],
        reward_service=reward_service,
        model_path=str(lm_stack.model_dir),
        dataset={"generator": "env_seeds", "env_id": "GuessNumber-v0", "seed": seed},
        env={
            "env_id": "GuessNumber-v0",
            "env_server": env_address,
            "max_turns": max_turns,
            "max_total_tokens": MAX_MODEL_LEN,
        },
        sampling={"max_tokens": 8},
        feed=True,
        group_size=group_size,
        prompts_per_call=2,
        concurrency=1,
        startup_timeout_s=60,
        **settings,
    )


async def test_the_rollout_driver_publishes_groups_of_episodes(
    lm_stack: LmStack, env_address: str, rewards: str, nats_server: EmbeddedNats
) -> None:
    settings = episode_driver(lm_stack, env_address, rewards, seed=1, max_turns=3, group_size=3)
    groups = await driver_groups(settings, uuid_run(), nats_server.url, 3, timeout_s=120)
    assert len({g.group_id for g in groups}) == 3
    for group in groups:
        assert len(group.completions) == 3
        prompt = tensor.decode(group.prompt_token_ids)
        assert len(prompt) > 0
        for completion in group.completions:
            ids = tensor.decode(completion.token_ids)
            mask = tensor.decode(completion.loss_mask)
            logprobs = tensor.decode(completion.logprobs)
            assert ids.shape == mask.shape == logprobs.shape
            assert mask.any() and (logprobs[mask] < 0).all() and (logprobs[~mask] == 0).all()
            assert len(prompt) + len(ids) <= MAX_MODEL_LEN
            assert [r.name for r in completion.rewards] == ["env"]
            assert completion.reward in (0.0, 1.0)


async def test_reward_functions_score_the_transcripts_beside_the_env(
    lm_stack: LmStack, env_address: str, rewards: str, nats_server: EmbeddedNats
) -> None:
    """With `rewards`, each episode's final message is scored by the reward service, and the
    weighted total adds to the env's reward."""
    settings = episode_driver(
        lm_stack,
        env_address,
        rewards,
        seed=2,
        max_turns=2,
        group_size=2,
        rewards=[{"name": "format", "weight": 0.5, "kwargs": {"tags": ["answer"]}}],
    )
    groups = await driver_groups(settings, uuid_run(), nats_server.url, 2, timeout_s=120)
    for group in groups:
        for completion in group.completions:
            names = [r.name for r in completion.rewards]
            assert names == ["env", "format"], names
            env, fmt = (r.score for r in completion.rewards)
            assert all(r.status == reward_pb2.SCORE_STATUS_OK for r in completion.rewards)
            assert completion.reward == pytest.approx(env + 0.5 * fmt)
            assert completion.text.startswith("[user] ")  # the transcript, question first
