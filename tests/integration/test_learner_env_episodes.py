"""The LM learner's own episodes of a text env (learner/lm/env_episodes.py) on a real env server:
SFT samples from its expert's demonstrations, and greedy evaluations with a transformers model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from clients.env.episodes import ChatTokens
from common import tensor
from env_server.service import EnvServerSettings
from learner.lm.env_episodes import EnvEpisodes, GreedyTurns
from learner.lm.model import load_causal_lm, load_tokenizer
from learner.lm.settings import LearnerTextEnv
from tests.fixtures.env_server import env_server_in_process

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ENV = "GuessNumber-v0"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env_address() -> AsyncIterator[str]:
    async with env_server_in_process("learner-episodes", EnvServerSettings()) as address:
        yield address


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def episodes(address: str, tokenizer: Any, **settings: Any) -> EnvEpisodes:
    cfg = LearnerTextEnv(env_id=ENV, env_server=address, kwargs={"max_range": 16}, **settings)
    return EnvEpisodes(cfg, address, tokenizer)


async def test_demonstrations_become_masked_expert_samples(
    env_address: str, tokenizer: Any
) -> None:
    source = episodes(env_address, tokenizer)
    await source.ready(asyncio.Event())
    samples = await source.demonstrations(40, seed=3)  # more than one session's envs
    assert len(samples) == 40
    turn_end = ChatTokens(tokenizer).turn_end
    for sample in samples:
        assert sample.expert and sample.rollout_logp is None
        assert len(sample.loss_mask) == len(sample.completion_ids)
        said = sample.completion_ids[sample.loss_mask].tolist()
        # The expert's turns are numbers (a binary search), each ended as the template ends one.
        turns = tokenizer.decode(said, skip_special_tokens=False).split("<|im_end|>")
        assert turns[-1] == "" and all(t.strip().isdigit() for t in turns[:-1]), turns
        assert said[-1] == turn_end[0] and sample.loss_mask[-1]
        # The env's turns (feedback and the next generation prompt) sit outside the mask.
        env_text = tokenizer.decode(sample.completion_ids[~sample.loss_mask].tolist())
        assert "guess" in env_text.lower() or len(turns) == 2  # found at once: no feedback
    prompts = {tuple(s.prompt_ids.tolist()) for s in samples}
    assert len(prompts) > 20  # different tasks


async def test_greedy_evaluation_is_held_out_deterministic_and_batched(
    env_address: str, tokenizer: Any, tiny_model_dir: Path
) -> None:
    model = load_causal_lm(tiny_model_dir)
    source = episodes(env_address, tokenizer, max_turns=3, max_total_tokens=400)
    first = await source.evaluate(model, 12, seed=5, version=0)
    again = await source.evaluate(model, 12, seed=5, version=0)
    assert first == again  # greedy: the same episodes
    accuracy, outcomes, played = first
    assert len(played) == 12 and all(e.done and e.messages for e in played)
    assert 0 <= accuracy <= 1
    assert abs(sum(outcomes.values()) - 1) < 1e-9 and all(k.startswith("eval/") for k in outcomes)

    # A batch of turns gives each episode what generating it alone gives.
    turns = GreedyTurns(model, tokenizer, ChatTokens(tokenizer).turn_end, version=7)
    prompts = [tokenizer(f"{n} + {n}", add_special_tokens=False)["input_ids"] for n in (1, 23, 456)]
    together = await asyncio.gather(*(turns(None, p, 6) for p in prompts))  # type: ignore[arg-type]
    for prompt, result in zip(prompts, together, strict=True):
        (alone,) = await asyncio.gather(turns(None, prompt, 6))  # type: ignore[arg-type]
        ids = tensor.decode(result.completions[0].token_ids).tolist()
        assert ids == tensor.decode(alone.completions[0].token_ids).tolist()
        assert 1 <= len(ids) <= 6 and result.completions[0].policy_version == 7
