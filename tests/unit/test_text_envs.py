"""Text environments (env_server/text) in process: the built-ins' tasks, splits and rewards, tool
calls read from either form, and the pool's checks, timeouts and outcomes."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from env_server import registry
from env_server.text import (
    BUILTIN_TEXT_ENVS,
    TextEnv,
    TextPool,
    calculate,
    run_tool,
    tool_calls,
)
from services.errors import FailedPrecondition, InvalidArgument, Unavailable


def say(content: str, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def hermes(name: str, **arguments: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# An environment written for OpenEnv (openenv-core), by file reference.
OPENENV_SUMS = f"{Path(__file__).parents[2] / 'examples' / 'openenv_sums.py'}:SumsEnvironment"
# What each built-in needs besides its defaults.
KWARGS: dict[str, dict[str, Any]] = {
    "GymnasiumText-v0": {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}},
    "OpenEnvText-v0": {"env": OPENENV_SUMS},
}


@pytest.mark.parametrize("env_id", sorted(BUILTIN_TEXT_ENVS))
def test_train_and_eval_splits_never_share_a_task(env_id: str) -> None:
    def tasks(split: str) -> set[str]:
        env = registry.make_text_env(env_id, kwargs={"split": split, **KWARGS.get(env_id, {})})
        seen = set()
        for seed in range(300):
            env.reset(seed=seed)
            seen.add(repr(env.task))
        return seen

    train, held_out = tasks("train"), tasks("eval")
    assert len(train) > 100 and len(held_out) > 100  # varied tasks in both
    assert not train & held_out


@pytest.mark.parametrize("env_id", sorted(BUILTIN_TEXT_ENVS))
def test_a_seed_gives_the_same_episode(env_id: str) -> None:
    a, b = (registry.make_text_env(env_id, kwargs=KWARGS.get(env_id)) for _ in range(2))
    assert a.reset(seed=7) == b.reset(seed=7) and a.task == b.task
    a.reset(seed=8)
    assert a.task != b.task


def test_calculator_answers_tool_calls_in_either_form_and_rewards_the_right_answer() -> None:
    env = registry.make_text_env("Calculator-v0", kwargs={"digits": 3, "terms": 3})
    messages, info = env.reset(seed=3)
    task, answer = info["task"], info["answer"]
    assert f"What is {task}?" in messages[-1]["content"]
    assert env.tools[0]["function"]["name"] == "calculator"
    # Hermes-style text, as a model with Qwen2's chat template writes it.
    replies, reward, terminated, truncated, info = env.step(
        say(hermes("calculator", expression=task))
    )
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert replies[0]["role"] == "tool" and str(answer) in replies[0]["content"]
    # An OpenAI tool_calls list, as a server that parsed the calls sends it.
    call = {"id": "c1", "function": {"name": "calculator", "arguments": '{"expression": "2*21"}'}}
    replies, *_ = env.step(say("", tool_calls=[call]))
    assert replies[0]["tool_call_id"] == "c1" and '"result": 42' in replies[0]["content"]
    _, reward, terminated, _, info = env.step(say(f"So it is <answer>{answer}</answer>."))
    assert (reward, terminated, info["outcome"]) == (1.0, True, "correct")
    env.reset(seed=3)
    _, reward, terminated, _, info = env.step(say(f"{answer + 1}"))
    assert (reward, terminated, info["outcome"]) == (0.0, True, "wrong")


def test_calculator_answers_bad_calls_with_errors_the_model_can_read() -> None:
    env = registry.make_text_env("Calculator-v0", kwargs={"max_turns": 3})
    env.reset(seed=0)
    bad = say("<tool_call>{not json</tool_call>" + hermes("abacus", x=1) + hermes("calculator"))
    replies, reward, terminated, truncated, _ = env.step(bad)
    errors = [r["content"] for r in replies]
    assert "not JSON" in errors[0]
    assert "no tool 'abacus'" in errors[1]
    assert "expression" in errors[2]  # the missing argument, from the TypeError
    assert (reward, terminated, truncated) == (0.0, False, False)
    env.step(say(hermes("calculator", expression="9**9**9")))
    replies, _, _, truncated, info = env.step(say(hermes("calculator", expression="1/0")))
    assert "division by zero" in replies[0]["content"]
    assert truncated and info["outcome"] == "max_turns"  # the third turn was the last


def test_calculate_is_exact_and_bounded() -> None:
    assert calculate("(123 + 7) * 456 - 3") == 59277
    assert calculate("7 / 2") == 3.5 and calculate("2 ^ 10") == 1024
    for bad in ("9**9**9", "__import__('os')", "1 if 1 else 2", "x", "1e400 * 10", "2" * 300):
        with pytest.raises(ValueError):
            calculate(bad)


def test_guess_number_rewards_using_the_feedback() -> None:
    def play(strategy: str, seed: int) -> float:
        env = registry.make_text_env("GuessNumber-v0")
        _, info = env.reset(seed=seed)
        low, high = info["low"], info["high"]
        while True:
            guess = (low + high) // 2 if strategy == "bisect" else low
            replies, reward, terminated, truncated, _ = env.step(say(str(guess)))
            if terminated or truncated:
                return reward
            if strategy == "bisect":
                if replies[0]["content"].startswith("Higher"):
                    low = guess + 1
                else:
                    high = guess - 1
            else:
                low += 1  # counts up, ignoring the feedback

    bisect = [play("bisect", s) for s in range(100)]
    linear = [play("linear", s) for s in range(100)]
    assert min(bisect) == 1.0  # binary search always finds it within the turns given
    assert sum(linear) / len(linear) < 0.2


def test_guess_number_says_what_is_wrong_with_a_guess() -> None:
    env = registry.make_text_env("GuessNumber-v0")
    _, info = env.reset(seed=1)
    assert "one integer" in env.step(say("no idea"))[0][0]["content"]
    assert "out of range" in env.step(say(str(info["high"] + 5)))[0][0]["content"]


def test_innkeeper_rewards_remembering_a_fact_told_turns_earlier() -> None:
    for seed in range(20):
        for remember in (True, False):
            env = registry.make_text_env("Innkeeper-v0", kwargs={"min_chat": 2})
            messages, info = env.reset(seed=seed)
            opening = messages[-1]["content"]
            turns = 0
            while True:
                reply = opening if remember else "Welcome, friend."
                _, reward, terminated, _, step_info = env.step(say(reply))
                turns += 1
                if terminated:
                    break
            assert turns == info["chat_turns"] + 2  # the chat, the question, the answer
            assert reward == (1.0 if remember else 0.0), (seed, step_info)


def test_tool_calls_take_an_unterminated_last_call_and_run_tool_bounds_time() -> None:
    (call,) = tool_calls(say('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'))
    assert call.name == "calculator" and call.arguments == {"expression": "1"}
    assert tool_calls(say("just text")) == []
    began = time.monotonic()
    assert "within 0.2s" in run_tool(lambda secs: time.sleep(secs), {"secs": 5}, 0.2)["error"]
    assert time.monotonic() - began < 2
    assert run_tool(lambda x: math.sqrt(x), {"x": 4.0}, 1) == {"result": 2.0}
    assert run_tool(lambda x: math.sqrt(x), {"x": -1.0}, 1)["error"].startswith("ValueError")


class Flaky(TextEnv):
    """Steps by what it is told: "hang", "raise", "garbage" or anything (a normal turn)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def reset(self, *, seed=None, options=None):
        if options and options.get("bad"):
            raise ValueError("unknown option 'bad'")
        return [{"role": "user", "content": "go"}], {"seed": seed}

    def step(self, message):
        content = message["content"]
        if content == "hang":
            self.release.wait(30)
        if content == "raise":
            raise RuntimeError("the env broke")
        if content == "garbage":
            return "not a step"
        return [{"role": "user", "content": "again"}], 1.0, content == "done", False, {}


def test_pool_checks_every_action_before_stepping_any() -> None:
    pool = TextPool(Flaky, 3, seed=10, step_timeout_s=5)
    with pytest.raises(FailedPrecondition, match="before its first reset"):
        pool.step([0], [say("x")])
    turns = pool.reset()
    assert [t.info["seed"] for t in turns] == [10, 11, 12]
    with pytest.raises(InvalidArgument, match="role 'user'") as bad_role:
        pool.step([0, 1], [say("x"), {"role": "user", "content": "x"}])
    assert bad_role.value.field == "step.text_actions[1].role"
    with pytest.raises(InvalidArgument, match="2 text actions for 1 envs"):
        pool.step([0], [say("x"), say("y")])
    with pytest.raises(InvalidArgument, match="max_message_chars"):
        pool.step([2], [say("x" * 70000)])
    with pytest.raises(InvalidArgument, match="repeated"):
        pool.step([1, 1], [say("x"), say("y")])
    assert pool.total_steps == 0  # nothing stepped by any refused request
    result = pool.step([2, 0], [say("done"), say("x")])
    assert result.env_indices == [2, 0] and result.terminated == [True, False]
    assert [e.env_index for e in result.episodes] == [2]
    with pytest.raises(FailedPrecondition, match="after its episode ended"):
        pool.step([2], [say("x")])
    with pytest.raises(InvalidArgument, match="reset options"):
        pool.reset(indices=[0], options={"bad": True})
    pool.close()


def test_a_hanging_or_raising_env_ends_its_episode_not_the_pool() -> None:
    pool = TextPool(Flaky, 4, step_timeout_s=0.5)
    pool.reset()
    hung = pool.envs[0]
    began = time.monotonic()
    result = pool.step([], [say("hang"), say("raise"), say("garbage"), say("fine")])
    assert time.monotonic() - began < 3  # one deadline for all: the steps run at once
    outcomes = [t.info.get("outcome") for t in result.turns]
    assert outcomes == ["step_timeout", "env_error", "env_error", None]
    assert result.truncated == [True, True, True, False] and result.rewards[3] == 1.0
    assert "the env broke" in result.turns[1].info["error"]
    assert len(result.episodes) == 3
    with pytest.raises(FailedPrecondition, match="after it failed"):
        pool.step([0], [say("x")])
    pool.reset(indices=[0, 1, 2])
    assert pool.envs[0] is not hung  # a fresh env for the one that hung
    assert pool.step([0], [say("x")]).rewards == [1.0]
    hung.release.set()
    pool.close()


def test_a_reset_that_hangs_is_unavailable_and_replaced() -> None:
    class SlowReset(Flaky):
        def reset(self, *, seed=None, options=None):
            if options and options.get("hang"):
                self.release.wait(30)
            return super().reset(seed=seed)

    pool = TextPool(SlowReset, 1, step_timeout_s=0.3)
    with pytest.raises(Unavailable, match="did not reset within"):
        pool.reset(options={"hang": True})
    first = pool.envs[0]
    pool.reset()
    assert pool.envs[0] is not first
    first.release.set()


def test_a_gymnasium_env_with_a_text_rendering_plays_in_messages() -> None:
    env = registry.make_text_env(
        "GymnasiumText-v0",
        kwargs={
            "env_id": "FrozenLake-v1",
            "env_kwargs": {"is_slippery": False},
            "action_names": ["left", "down", "right", "up"],
        },
    )
    messages, _ = env.reset(seed=0)
    assert "0 (left), 1 (down), 2 (right), 3 (up)" in messages[0]["content"]
    assert messages[1]["content"].splitlines()[0] == "[S]FFF"  # the agent's cell bracketed
    replies, reward, terminated, _, info = env.step(say("I would go somewhere"))
    assert info["outcome"] == "no_action" and "Choose one of" in replies[0]["content"]
    # The 4x4 map's shortest safe path: down, down, right, right, down, right (by name or number).
    for move in ("down", "down", "right", "2", "1"):
        replies, reward, terminated, _, _ = env.step(say(f"I choose {move}"))
        assert not terminated and reward == 0.0
    assert replies[0]["content"].splitlines()[-1] == "HF[F]G"
    _, reward, terminated, _, _ = env.step(say("right"))
    assert (reward, terminated) == (1.0, True)
    with pytest.raises(InvalidArgument, match="not Discrete"):
        registry.make_text_env("GymnasiumText-v0", kwargs={"env_id": "Pendulum-v1"})


def test_an_openenv_environment_plays_in_messages() -> None:
    env = registry.make_text_env(
        "OpenEnvText-v0",
        kwargs={
            "env": OPENENV_SUMS,
            "env_kwargs": {"rounds": 2},
            "system": "Answer with the sum.",
            "max_turns": 3,
        },
    )
    messages, _ = env.reset(seed=1)
    assert messages[0] == {"role": "system", "content": "Answer with the sum."}
    question = messages[1]["content"]  # the observation's one field, as the user's turn
    a, b = map(int, question.removesuffix("=").split("+"))
    replies, reward, terminated, truncated, _ = env.step(say(f"It is {a + b}"))
    assert (reward, terminated, truncated) == (0.5, False, False)  # OpenEnv's reward, as is
    a, b = map(int, replies[0]["content"].removesuffix("=").split("+"))
    replies, reward, terminated, _, info = env.step(say(str(a + b)))
    assert (replies, reward, terminated, info) == ([], 0.5, True, {"outcome": "all_right"})
    env.reset(seed=2)
    _, reward, terminated, _, info = env.step(say("no idea"))
    assert (reward, terminated, info["outcome"]) == (0.0, True, "wrong")


def test_an_openenv_environment_demonstrates_with_the_users_expert() -> None:
    from env_server.text.base import play_expert

    kwargs = {"env": OPENENV_SUMS, "env_kwargs": {"rounds": 3}}
    env = registry.make_text_env("OpenEnvText-v0", kwargs=kwargs)
    env.reset(seed=3)
    assert env.expert_reply() is None  # OpenEnv has none of its own
    expert = OPENENV_SUMS.replace(":SumsEnvironment", ":expert_answer")
    env = registry.make_text_env("OpenEnvText-v0", kwargs={**kwargs, "expert": expert})
    (question,), _ = env.reset(seed=3)
    said, total = play_expert(env)
    a, b = map(int, question["content"].removesuffix("=").split("+"))
    assert said[0] == {"role": "assistant", "content": str(a + b)}
    assert total == pytest.approx(1.0) and len(said) == 5  # three right answers, two questions
    with pytest.raises(InvalidArgument, match=r"expert .*has no nothing_here"):
        registry.make_text_env(
            "OpenEnvText-v0",
            kwargs={**kwargs, "expert": OPENENV_SUMS.replace("SumsEnvironment", "nothing_here")},
        )


def test_the_openenv_adapter_names_what_it_cannot_use() -> None:
    with pytest.raises(InvalidArgument, match="action_field 'nope' is not a field of SumsAction"):
        registry.make_text_env(
            "OpenEnvText-v0", kwargs={"env": OPENENV_SUMS, "action_field": "nope"}
        )
    with pytest.raises(InvalidArgument, match="not an openenv Environment subclass"):
        registry.make_text_env("OpenEnvText-v0", kwargs={"env": "json:dumps"})
    with pytest.raises(InvalidArgument, match="rounds must be >= 1"):  # the env's own refusal
        registry.make_text_env(
            "OpenEnvText-v0", kwargs={"env": OPENENV_SUMS, "env_kwargs": {"rounds": 0}}
        )


@pytest.mark.parametrize("env_id", ["Calculator-v0", "GuessNumber-v0", "Innkeeper-v0"])
def test_the_builtins_experts_demonstrate_winning_episodes(env_id: str) -> None:
    pool = TextPool(lambda: registry.make_text_env(env_id), 4)
    turns = pool.reset(seeds=[10, 11, 12, 13], options={"demonstrate": True})
    for turn in turns:
        said = turn.info["demonstration"]
        assert turn.info["demonstration_return"] == 1.0  # the expert solves every task
        assert said[0]["role"] == "assistant" and said[-1]["role"] == "assistant"
    # A demonstrated episode is over: stepping it is refused like any ended episode.
    with pytest.raises(FailedPrecondition, match="after its episode ended"):
        pool.step([0], [say("more")])
    # The same seed played by a client with the expert's words gets the env's same answers.
    env = registry.make_text_env(env_id)
    env.reset(seed=10)
    said = turns[0].info["demonstration"]
    for k, message in enumerate(said):
        if message["role"] == "assistant":
            replies, *_ = env.step(message)
            following = said[k + 1 : k + 1 + len(replies)]
            assert replies == following


def test_an_env_without_an_expert_refuses_to_demonstrate() -> None:
    pool = TextPool(lambda: registry.make_text_env("Calculator-v0"), 1)
    pool.envs[0].expert_reply = lambda: None  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match="has no expert to demonstrate"):
        pool.reset(seed=1, options={"demonstrate": True})


def test_calculator_without_its_tool_is_one_turn_from_the_head() -> None:
    pool = TextPool(lambda: registry.make_text_env("Calculator-v0", kwargs={"tool": False}), 2)
    assert pool.tools == []
    assert registry.make_text_env("Calculator-v0").tools  # the default still offers it
    (first, _) = pool.reset(seeds=[3, 4], options={"demonstrate": True})
    assert "calculator" not in first.messages[0]["content"]
    assert [m["role"] for m in first.info["demonstration"]] == ["assistant"]
    assert first.info["demonstration_return"] == 1.0
    # A tool call is no call here: it is the answer, and a wrong one.
    env = registry.make_text_env("Calculator-v0", kwargs={"tool": False})
    env.reset(seed=3)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    replies, reward, terminated, truncated, info = env.step(say(call))
    assert (replies, reward, terminated, truncated) == ([], 0.0, True, False)
    assert info["outcome"] == "wrong"
