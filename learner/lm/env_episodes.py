"""The learner's own episodes of a multi-turn run's text env (LMLearnerSettings.env).

- SFT warm start: the env server's expert plays episodes of the train split (the reset option
  ``demonstrate``); each becomes a sample laid out exactly as rollouts lay out an episode (the
  opening rendered by the chat template as the prompt, the expert's turns as model tokens under
  the loss mask, the env's turns as the template writes them, outside the mask).
- Evaluation: greedy episodes of the eval split with the learner's current weights, played by
  the same loop as rollouts (clients.env.episodes.play_episodes); the turns of all live episodes
  are generated as one left-padded batch.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from clients.env import SERVICE_NAME as ENV_SERVICE
from clients.env.episodes import (
    ChatTokens,
    Episode,
    EpisodeLimits,
    demonstration_episode,
    play_episodes,
)
from clients.env.text import DEMONSTRATE, TextSession
from common import tensor
from common.datasets import ENV_SEED_KEY, env_seeds
from learner.lm.batch import Sample
from learner.lm.settings import LEARNER_SESSION_ENVS, LearnerTextEnv
from rlfleet.sampler.v1 import sampler_pb2
from services.calls import wait_healthy
from services.errors import Unavailable

__all__ = ["EnvEpisodes", "GreedyTurns", "demonstration_sample"]


def demonstration_sample(episode: Episode) -> Sample:
    """An expert-played episode as an expert completion for SFT."""
    return Sample(
        group_id="sft",
        prompt_ids=np.asarray(episode.prompt_ids, dtype=np.int64),
        completion_ids=np.asarray(episode.token_ids, dtype=np.int64),
        rollout_logp=None,
        loss_mask=np.asarray(episode.loss_mask, dtype=bool),
        reward=None,
        truncated=False,
        expert=True,
        policy_version=0,
        scores={},
    )


@dataclass
class EnvEpisodes:
    """The env server side of the learner's episodes (one session per call)."""

    cfg: LearnerTextEnv
    address: str
    tokenizer: Any

    async def ready(self, stop: asyncio.Event) -> None:
        """Wait until the env server answers (it may start after the learner)."""
        healthy = await wait_healthy(
            "env server", self.address, ENV_SERVICE, stop, self.cfg.startup_timeout_s
        )
        if not healthy:
            raise Unavailable(
                f"env server {self.address} not healthy within {self.cfg.startup_timeout_s:g}s"
            )

    def _kwargs(self, split: str) -> dict[str, Any]:
        return {**self.cfg.kwargs, "split": split}

    async def demonstrations(self, count: int, seed: int) -> list[Sample]:
        """``count`` expert episodes of the train split as SFT samples."""
        seeds = _seeds(self.cfg.env_id, seed, "train", count)
        samples: list[Sample] = []
        async with TextSession(self.address) as session:
            info = await session.create(
                self.cfg.env_id, LEARNER_SESSION_ENVS, kwargs=self._kwargs("train")
            )
            tokens = ChatTokens(self.tokenizer, info.tools)
            for start in range(0, len(seeds), LEARNER_SESSION_ENVS):
                chunk = seeds[start : start + LEARNER_SESSION_ENVS]
                turns = await session.reset(
                    seed=chunk, env_indices=range(len(chunk)), options={DEMONSTRATE: True}
                )
                samples += [demonstration_sample(demonstration_episode(tokens, t)) for t in turns]
        return samples

    async def evaluate(
        self, model: Any, count: int, seed: int, version: int
    ) -> tuple[float, dict[str, float], list[Episode]]:
        """Mean return of ``count`` greedy episodes of the eval split, the outcomes'
        fractions (``eval/<outcome>_frac``) and the episodes."""
        seeds = _seeds(self.cfg.env_id, seed, "eval", count)
        limits = EpisodeLimits(self.cfg.max_turns, self.cfg.max_total_tokens)
        episodes: list[Episode] = []
        async with TextSession(self.address) as session:
            info = await session.create(
                self.cfg.env_id, LEARNER_SESSION_ENVS, kwargs=self._kwargs("eval")
            )
            tokens = ChatTokens(self.tokenizer, info.tools)
            turns = GreedyTurns(model, self.tokenizer, tokens.turn_end, version)
            for start in range(0, len(seeds), LEARNER_SESSION_ENVS):
                chunk = seeds[start : start + LEARNER_SESSION_ENVS]
                episodes += await play_episodes(session, chunk, tokens, turns, limits)
        outcomes: dict[str, float] = {}
        for episode in episodes:
            key = f"eval/{episode.outcome}_frac"
            outcomes[key] = outcomes.get(key, 0.0) + 1 / len(episodes)
        return sum(e.reward for e in episodes) / max(len(episodes), 1), outcomes, episodes


class GreedyTurns:
    """Greedy model turns from a transformers model, as the episode loop's ``Generate``: the
    calls made together (one per live episode) are generated as one left-padded batch."""

    def __init__(self, model: Any, tokenizer: Any, turn_end: list[int], version: int) -> None:
        self.model, self.tokenizer, self.version = model, tokenizer, version
        self.stop_ids = {*turn_end, int(tokenizer.eos_token_id)}
        self._pending: list[tuple[list[int], int, asyncio.Future[sampler_pb2.PromptResult]]] = []
        self._lock = threading.Lock()  # the model runs one batch at a time

    async def __call__(
        self, episode: Episode, prompt_ids: list[int], room: int
    ) -> sampler_pb2.PromptResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[sampler_pb2.PromptResult] = loop.create_future()
        if not self._pending:
            # After the other episodes of this turn have queued theirs (they run first).
            loop.call_soon(lambda: asyncio.ensure_future(self._flush()))
        self._pending.append((prompt_ids, room, future))
        return await future

    async def _flush(self) -> None:
        batch, self._pending = self._pending, []
        try:
            outputs = await asyncio.to_thread(self._generate, [(p, r) for p, r, _ in batch])
        except Exception as exc:  # each waiting episode's call fails with it
            for _, _, future in batch:
                future.set_exception(exc)
            return
        for (_, _, future), ids in zip(batch, outputs, strict=True):
            future.set_result(self._result(ids))

    @torch.no_grad()
    def _generate(self, prompts: Sequence[tuple[list[int], int]]) -> list[list[int]]:
        pad = self.tokenizer.pad_token_id or 0
        width = max(len(p) for p, _ in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with self._lock:
            was_training = self.model.training
            self.model.eval()
            try:
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max(room for _, room in prompts),
                    do_sample=False,
                    pad_token_id=pad,
                    eos_token_id=sorted(self.stop_ids),
                )
            finally:
                self.model.train(was_training)
        new = out[:, width:].tolist()
        results = []
        for row, (_, room) in enumerate(prompts):
            tokens = new[row][:room]
            stop = next((k for k, t in enumerate(tokens) if t in self.stop_ids), None)
            results.append(tokens if stop is None else tokens[: stop + 1])
        return results

    def _result(self, ids: list[int]) -> sampler_pb2.PromptResult:
        stopped = bool(ids) and ids[-1] in self.stop_ids
        completion = sampler_pb2.Completion(
            token_ids=tensor.encode(np.asarray(ids, np.int32)),
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            finish_reason=sampler_pb2.FINISH_REASON_STOP
            if stopped
            else sampler_pb2.FINISH_REASON_LENGTH,
            policy_version=self.version,
            end_policy_version=self.version,
        )
        return sampler_pb2.PromptResult(completions=[completion])


def _seeds(env_id: str, seed: int, split: str, count: int) -> list[int]:
    """Episode seeds as the rollout drivers draw them (the env_seeds dataset)."""
    tasks = env_seeds(env_id=env_id, seed=seed, split=split, count=count)
    return [int(t.extra[ENV_SEED_KEY]) for t in tasks]
