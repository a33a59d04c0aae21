"""Text environments over EnvService against a real env server on a loopback socket: built-ins
and a user's TextEnv from a plain .py file, episodes moving at their own pace, in-band errors
that leave the stream serving, and an env that hangs or raises ending its episode, not the
session."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from gymnasium.vector import AutoresetMode

from clients.env import EnvSession, list_envs
from clients.env.text import TextSession
from env_server.service import EnvServerSettings
from services.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.fixtures.env_server import env_server_in_process

pytestmark = pytest.mark.asyncio(loop_scope="session")

STEP_TIMEOUT_S = 1.0
USER_ENV = '''
import threading

from env_server.text import TextEnv


class Echo(TextEnv):
    """Echoes the model's turn; "hang" and "raise" misbehave as a buggy env would."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [{"role": "user", "content": f"say something ({self.rng.randint(0, 9)})"}], {}

    def step(self, message):
        if message["content"] == "hang":
            threading.Event().wait(60)
        if message["content"] == "raise":
            raise RuntimeError("the user env broke")
        done = message["content"] == "bye"
        return [{"role": "user", "content": message["content"]}], 0.5, done, False, {"n": 1}
'''


@pytest.fixture(scope="module")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("text-env") / "echo_env.py"
    path.write_text(textwrap.dedent(USER_ENV))
    return f"{path}:Echo"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def address(user_env: str) -> AsyncIterator[str]:
    settings = EnvServerSettings(
        preload=["Calculator-v0", user_env], text_step_timeout_s=STEP_TIMEOUT_S, max_sessions=8
    )
    async with env_server_in_process("text-env", settings) as address:
        yield address


async def test_list_envs_says_which_are_text(address: str, user_env: str) -> None:
    kinds = {e.env_id: e.kind for e in await list_envs(address)}
    assert kinds["Calculator-v0"] == kinds["GuessNumber-v0"] == kinds[user_env] == "text"
    assert kinds["CartPole-v1"] == "tensor"


async def test_a_calculator_episode_over_grpc(address: str) -> None:
    async with TextSession(address) as session:
        info = await session.create("Calculator-v0", 2, seed=5, kwargs={"split": "eval"})
        assert info.tools[0]["function"]["name"] == "calculator"
        turns = await session.reset()
        assert [t.env_index for t in turns] == [0, 1]
        question = turns[1].messages[-1]["content"]
        expression = question.removeprefix("What is ").removesuffix("?")
        call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        # Only env 1 moves: episodes go at their own pace.
        result = await session.step([{"role": "assistant", "content": call + "</tool_call>"}], [1])
        (tool,) = result.turns[0].messages
        assert result.env_indices == [1] and tool["role"] == "tool"
        value = tool["content"].split(":")[1].strip(" }")
        answer = {"role": "assistant", "content": f"<answer>{value}</answer>"}
        result = await session.step([answer], [1])
        assert result.rewards == [1.0] and result.terminated == [True]
        assert result.turns[0].info["outcome"] == "correct"
        (episode,) = result.episodes
        assert (episode.env_index, episode.episode_return, episode.length) == (1, 1.0, 2)
        # The same seed gives the same question again (env i gets seed + i).
        again = await session.reset(seed=5, env_indices=[1])
        assert again[0].env_index == 1 and again[0].messages == turns[1].messages


async def test_bad_requests_are_answered_in_band_and_the_stream_serves_on(address: str) -> None:
    async with TextSession(address) as session:
        await session.create("Calculator-v0", 2)
        with pytest.raises(FailedPrecondition, match="before its first reset"):
            await session.step([{"role": "assistant", "content": "1"}], [0])
        await session.reset()
        with pytest.raises(InvalidArgument, match="role 'user'") as bad:
            await session.step([{"role": "user", "content": "1"}], [0])
        assert bad.value.field == "step.text_actions[0].role"
        with pytest.raises(InvalidArgument, match="out of range"):
            await session.step([{"role": "assistant", "content": "1"}], [7])
        with pytest.raises(InvalidArgument, match="max_message_chars"):
            await session.step([{"role": "assistant", "content": "9" * 70000}], [0])
        with pytest.raises(InvalidArgument, match="3 text actions for a pool of 2"):
            await session.step([{"role": "assistant", "content": "1"}] * 3)
        result = await session.step([{"role": "assistant", "content": "12"}] * 2)
        assert result.terminated == [True, True]  # answered (wrongly): both episodes ended


async def test_text_pools_refuse_what_only_tensor_pools_do(address: str) -> None:
    async with EnvSession(address) as session:
        with pytest.raises(InvalidArgument, match="reset by the client"):
            await session.create("Calculator-v0", 1, autoreset_mode=AutoresetMode.SAME_STEP)
    async with EnvSession(address) as session:
        with pytest.raises(InvalidArgument) as bad:
            await session.create(
                "Calculator-v0", 1, kwargs={"digits": 99}, autoreset_mode=AutoresetMode.DISABLED
            )
        assert bad.value.field == "create.kwargs.digits" and "digits must be 1 to 9" in str(
            bad.value
        )
    async with TextSession(address) as session:
        with pytest.raises(InvalidArgument, match="not a text one"):
            await session.create("CartPole-v1", 1)
    async with TextSession(address) as session:
        with pytest.raises(NotFound, match="Calculator-v0"):
            await session.create("Calculater-v0", 1)
    async with TextSession(address) as session:
        await session.create("GuessNumber-v0", 1)
        with pytest.raises(FailedPrecondition, match="no frames"):
            await session._session.render()


async def test_a_user_env_that_hangs_or_raises_ends_its_episode_not_the_session(
    address: str, user_env: str
) -> None:
    async with TextSession(address) as session:
        await session.create(user_env, 3, seed=1)
        await session.reset()
        say = [{"role": "assistant", "content": c} for c in ("hang", "raise", "hello")]
        result = await session.step(say)
        outcomes = [t.info.get("outcome") for t in result.turns]
        assert outcomes == ["step_timeout", "env_error", None]
        assert result.truncated == [True, True, False]
        assert "the user env broke" in result.turns[1].info["error"]
        assert result.turns[2].messages == [{"role": "user", "content": "hello"}]
        assert result.turns[2].info == {"n": 1}
        await session.reset(env_indices=[0, 1])  # fresh envs in place of the broken ones
        result = await session.step([{"role": "assistant", "content": "bye"}] * 3)
        assert result.terminated == [True, True, True] and result.rewards == [0.5] * 3
