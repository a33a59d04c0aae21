"""Multi-turn episodes: generation and text-environment steps alternating, token in, token out.

The client side of an env server's text envs: rollout drivers play training episodes with a
sampler's turns (sampler/rollout/turns.py), the learner evaluates with greedy turns of its own.

One group is G episodes of the same task (G envs of a `TextSession` reset with one seed), as a
GRPO group is G completions of one prompt. Each turn, every live episode's whole token sequence
so far goes to the sampler as a pre-tokenized prompt, n=1; the model's tokens and their logprobs
are kept exactly as sampled, the text is stepped in its env, and the env's answer is appended as
the tokens the chat template writes for it. What the model said is never re-tokenized: the
learner sees the very tokens (and the versions) that were sampled, and `loss_mask` marks them
among the env's.

An episode ends when its env ends it (terminated or truncated) or a cap does: `max_turns`,
`max_total_tokens` (prompt and every turn; a generation never gets more room than is left),
`wall_clock_s` for the whole group, or its env failing (its outcome says which). A sampler
that cannot finish a turn (aborted, no tokens) ends that episode too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clients.env.text import TextSession
from clients.env.types import Message, TextTurn
from common import tensor
from common.models import canonical_tools
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import ConfigError

__all__ = [
    "ChatTokens",
    "Episode",
    "EpisodeLimits",
    "Generate",
    "demonstration_episode",
    "play_episodes",
    "play_group",
]

# Outcomes of an episode besides the env's own ("terminated", "truncated").
MAX_TURNS, MAX_TOTAL_TOKENS, WALL_CLOCK = "max_turns", "max_total_tokens", "wall_clock"
NO_TOKENS = "no_tokens"  # the sampler gave nothing (aborted before the first token)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8  # model turns per episode
    max_total_tokens: int = 1024  # prompt and every turn after it, model's and env's
    wall_clock_s: float = 600.0  # for the whole group


@dataclass
class Episode:
    """One episode as the learner will see it, and its transcript."""

    env_index: int
    prompt_ids: list[int]  # the opening, rendered by the chat template
    messages: list[Message]  # every message, the opening's included
    token_ids: list[int] = field(default_factory=list)  # everything after the prompt
    logprobs: list[float] = field(default_factory=list)  # 0 for the env's tokens
    loss_mask: list[bool] = field(default_factory=list)  # the model's tokens
    rewards: list[float] = field(default_factory=list)  # the env's, one per step
    turns: int = 0
    outcome: str = ""  # "" while it runs
    finish_reason: Any = sampler_pb2.FINISH_REASON_UNSPECIFIED  # the last model turn's
    first_version: int | None = None  # weights that sampled its first token
    last_version: int | None = None  # and its last
    info: dict[str, Any] = field(default_factory=dict)  # the env's infos merged, latest wins
    # Prompt tokens sent over all its turns, and how many the sampler had in its prefix cache.
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return bool(self.outcome)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Append the model's tokens (with their logprobs) or, without logprobs, the env's."""
        self.token_ids.extend(int(i) for i in ids)
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else map(float, logprobs))
        self.loss_mask.extend([logprobs is not None] * len(ids))


class ChatTokens:
    """The chat template's tokens for what is not the model's: the opening and the env's turns.

    The env's answer is rendered by the template after the conversation so far, and only the
    text past what the tokens already hold is tokenized: the model's own tokens stay as sampled
    (the template's end-of-turn after them included, when the model stopped without it).
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = canonical_tools(tools)
        self.template_kwargs = template_kwargs or {}
        self.turn_end = _turn_end(tokenizer)

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        )

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def opening(self, messages: list[Message]) -> list[int]:
        return self._ids(self._render(messages, True))

    def said(self, text: str) -> list[int]:
        """A model turn's tokens, as a model that stopped at the template's end of turn sampled
        them (demonstrations)."""
        return self._ids(text) + self.turn_end

    def answer(self, episode: Episode, env_messages: list[Message]) -> list[int]:
        """Tokens after the model's last one: the rest of its turn as the template ends it, the
        env's messages and the next generation prompt."""
        return self.continuation(
            episode.prompt_ids + episode.token_ids, episode.messages, env_messages
        )

    def continuation(
        self, ids: Sequence[int], before: list[Message], new: list[Message]
    ) -> list[int]:
        """The tokens that follow ``ids`` (the conversation ``before``, its last model turn as
        sampled) when the ``new`` messages come, up to the next generation prompt: the rest of
        the model's turn as the template ends it, then ``new`` as the template writes them.
        ``ids`` themselves are never re-tokenized."""
        said = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        after = self._render([*before, *new], True)
        if after.startswith(said):
            return self._ids(after[len(said) :])
        # The template writes the model's turn otherwise than it was sampled (it strips or
        # reformats it, or the turn came back parsed, as tool calls): end the turn as the
        # template does, with what the template writes after its end of turn (a newline), then
        # the new part alone.
        ended = len(ids) >= len(self.turn_end) and list(ids[-len(self.turn_end) :]) == self.turn_end
        rendered = self._render(before, False)
        marker = self.tokenizer.decode(self.turn_end, skip_special_tokens=False)
        at = rendered.rfind(marker)
        tail = rendered[at + len(marker) :] if at >= 0 else ""
        return ([] if ended else list(self.turn_end)) + self._ids(tail + after[len(rendered) :])


# One model turn for each episode given: (episode, prompt token ids, room in tokens) -> the
# sampler's result: one completion (token ids, logprobs, text, finish reason, versions) and the
# prompt tokens it found cached.
Generate = Callable[[Episode, list[int], int], Awaitable[sampler_pb2.PromptResult]]


async def play_group(
    session: TextSession,
    seed: int,
    group_size: int,
    tokens: ChatTokens,
    generate: Generate,
    limits: EpisodeLimits,
    *,
    options: dict[str, Any] | None = None,
) -> list[Episode]:
    """Play ``group_size`` episodes of the task ``seed`` picks on ``session`` (created with at
    least that many envs) to their ends; returns them in env order."""
    seeds = [seed] * group_size  # one task for the whole group
    return await play_episodes(session, seeds, tokens, generate, limits, options=options)


def demonstration_episode(tokens: ChatTokens, turn: TextTurn) -> Episode:
    """The episode an env's expert played (a reset with the ``demonstrate`` option), laid out
    as a sampled one: the expert's turns as the model's tokens (ended by the template's end of
    turn, under the loss mask), the env's as the template writes them."""
    episode = Episode(turn.env_index, tokens.opening(turn.messages), list(turn.messages))
    demonstration = list(turn.info["demonstration"])
    k = 0
    while k < len(demonstration):
        message = demonstration[k]
        said = tokens.said(str(message.get("content") or ""))
        episode.add(said, [0.0] * len(said))
        episode.messages.append(message)
        episode.turns += 1
        k += 1
        answer = []
        while k < len(demonstration) and demonstration[k]["role"] != "assistant":
            answer.append(demonstration[k])
            k += 1
        if k < len(demonstration):  # the env's answer and the next generation prompt
            episode.add(tokens.answer(episode, answer))
            episode.messages.extend(answer)
    return episode


async def play_episodes(
    session: TextSession,
    seeds: Sequence[int],
    tokens: ChatTokens,
    generate: Generate,
    limits: EpisodeLimits,
    *,
    options: dict[str, Any] | None = None,
) -> list[Episode]:
    """Play one episode per seed on envs 0.. of ``session`` to their ends; returns them in env
    order. ``limits.wall_clock_s`` bounds them all together."""
    began = time.monotonic()
    turns = await session.reset(seed=list(seeds), env_indices=range(len(seeds)), options=options)
    episodes = [
        Episode(t.env_index, tokens.opening(t.messages), list(t.messages), info=dict(t.info))
        for t in turns
    ]
    for episode in episodes:
        if episode.length >= limits.max_total_tokens:
            # Every episode of this env would end before the model said a word: the run is
            # misconfigured, not unlucky.
            raise ConfigError(
                f"max_total_tokens={limits.max_total_tokens} leaves no room for a model turn: "
                f"an opening of this env renders to {episode.length} tokens (its messages and "
                "tools in the chat template); raise max_total_tokens"
            )
    while live := [e for e in episodes if not e.done]:
        if time.monotonic() - began > limits.wall_clock_s:
            for episode in live:
                episode.outcome = WALL_CLOCK
            break
        results = await asyncio.gather(
            *(
                generate(e, e.prompt_ids + e.token_ids, limits.max_total_tokens - e.length)
                for e in live
            )
        )
        stepping = [e for e, r in zip(live, results, strict=True) if _take_turn(e, r)]
        if not stepping:
            continue
        actions = [e.messages[-1] for e in stepping]
        result = await session.step(actions, [e.env_index for e in stepping])
        by_index = {e.env_index: e for e in stepping}
        for k, turn in enumerate(result.turns):
            episode = by_index[turn.env_index]
            episode.rewards.append(result.rewards[k])
            episode.info.update(turn.info)
            if result.terminated[k] or result.truncated[k]:
                episode.outcome = _env_outcome(turn.info, bool(result.terminated[k]))
            elif episode.turns >= limits.max_turns:
                episode.outcome = MAX_TURNS
            else:
                reply = tokens.answer(episode, turn.messages)
                if episode.length + len(reply) >= limits.max_total_tokens:
                    episode.outcome = MAX_TOTAL_TOKENS  # no room for another model turn
                else:
                    episode.messages.extend(turn.messages)
                    episode.add(reply)
    return episodes


def _take_turn(episode: Episode, result: sampler_pb2.PromptResult) -> bool:
    """Record the model's turn; True when it goes to the env (False: the sampler gave none)."""
    completion = result.completions[0]
    episode.turns += 1
    episode.prompt_tokens += episode.length
    episode.cached_tokens += result.cached_prompt_tokens
    episode.finish_reason = completion.finish_reason
    if not completion.HasField("token_ids") or not completion.token_ids.data:
        episode.outcome = NO_TOKENS
        return False
    ids = tensor.decode(completion.token_ids, name="token_ids")
    if completion.HasField("logprobs"):
        logprobs = tensor.decode(completion.logprobs, name="logprobs").tolist()
    else:
        logprobs = [0.0] * len(ids)
    if episode.first_version is None:
        episode.first_version = int(completion.policy_version)
    episode.last_version = int(completion.end_policy_version or completion.policy_version)
    episode.add(ids.tolist(), logprobs)
    episode.messages.append({"role": "assistant", "content": completion.text})
    return True


def _turn_end(tokenizer: Any) -> list[int]:
    """The token the chat template ends an assistant turn with (Qwen's ``<|im_end|>``): what
    follows the content of a rendered assistant message, when it is one special token; else
    the tokenizer's EOS."""
    marker = "\x00rlfleet\x00"
    text = str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    )
    after = text.partition(marker)[2].strip()
    for token in tokenizer.all_special_tokens:
        if token and after.startswith(token):
            return [int(tokenizer.convert_tokens_to_ids(token))]
    return [int(tokenizer.eos_token_id)]


def _env_outcome(info: dict[str, Any], terminated: bool) -> str:
    outcome = info.get("outcome")
    if isinstance(outcome, str) and outcome:
        return outcome
    return "terminated" if terminated else "truncated"
