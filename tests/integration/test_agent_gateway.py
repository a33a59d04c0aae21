"""The gateway's training mode on real parts: the session's vLLM sampler, a real nats-server and
the official `openai` client as the agent. Sessions start with a task from the run's prompt
queue, their calls (streamed or not) are recorded token in, token out, their rewards are taken
once, and each task's group reaches the run's trajectory stream exactly once; sessions that are
never rewarded are dropped and counted."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from common import tensor
from gateway.settings import GatewaySettings
from rlfleet.bus.v1 import trajectory_pb2
from services.bus import Bus, stream_name, traj_subject
from tests.fixtures.lm import LmStack
from tests.unit.test_gateway_fakes import ThreadedGateway

pytestmark = pytest.mark.slow

# A short tool: the tiny model's context (512) holds the template's tool prompt and little more.
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
}
TIMEOUT_S = 20.0  # long beside a few sampled calls; the never-rewarded session is waited for


class Agent:
    """What an agent program does, over HTTP: sessions, calls, rewards."""

    def __init__(self, url: str) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=60)
        self.model = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def start(self) -> dict[str, Any]:
        response = await self.http.post("/rlfleet/v1/sessions", json={})
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    async def reward(self, session_id: str, value: Any) -> httpx.Response:
        return await self.http.post(
            f"/rlfleet/v1/sessions/{session_id}/reward", json={"reward": value}
        )

    async def call(
        self, session_id: str, messages: list[Any], *, stream: bool = False, **kw: Any
    ) -> Any:
        """One call of the session; the assistant message as the agent sends it back."""
        args = dict(
            model="tiny", messages=messages, tools=[ADD], max_tokens=12, temperature=1.0,
            extra_headers={"X-Rlfleet-Session": session_id}, **kw,
        )  # fmt: skip
        if not stream:
            reply = (await self.model.chat.completions.create(**args)).choices[0].message
            return reply.model_dump(exclude_none=True)
        content, calls = "", {}
        async for chunk in await self.model.chat.completions.create(stream=True, **args):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(
                    piece.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                call["id"] = call["id"] or piece.id or ""
                if piece.function is not None:
                    call["function"]["name"] += piece.function.name or ""
                    call["function"]["arguments"] += piece.function.arguments or ""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        return message


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def training(lm_stack: LmStack, nats_url: str) -> AsyncIterator[tuple[Agent, str]]:
    run = f"agent-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings.model_validate(
        {
            "samplers": [lm_stack.address],
            "health_interval_s": 0.5,
            "http_port": 0,
            "training": {
                "group_size": 2,
                "dataset": {"generator": "arith", "digits": 1, "seed": 3},
                "session_timeout_s": TIMEOUT_S,
                "max_calls_per_session": 3,
                "metrics_interval_s": 1.0,
            },
        }
    )
    gateway = await asyncio.to_thread(
        ThreadedGateway, settings, addresses=[lm_stack.address], nats_url=nats_url, run=run
    )
    agent = Agent(gateway.url)
    yield agent, run
    await agent.http.aclose()
    await asyncio.to_thread(gateway.close)


async def next_group(nats_url: str, run: str, durable: str) -> trajectory_pb2.TrajectoryGroup:
    bus = await Bus.connect(nats_url, name=f"{durable}-reader")
    try:
        pulled = bus.pull(
            stream_name(run), durable, traj_subject(run), trajectory_pb2.TrajectoryGroup,
            timeout_s=60,
        )  # fmt: skip
        delivery = await anext(pulled)
        await delivery.ack()
        await pulled.aclose()
        return delivery.message
    finally:
        await bus.close()


def ids(t: Any) -> list[int]:
    return tensor.decode(t).tolist()  # type: ignore[no-any-return]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_tasks_sessions_are_recorded_and_reach_the_learner_once(
    training: tuple[Agent, str], nats_url: str
) -> None:
    agent, run = training
    first, second = await agent.start(), await agent.start()
    task = first["task"]
    assert second["task"] == task and task["prompt"].startswith("Q: ")  # one task per group
    assert first["session_id"] != second["session_id"]
    ask = [{"role": "user", "content": task["prompt"]}]
    for session, stream in ((first, False), (second, True)):
        sid = session["session_id"]
        said = await agent.call(sid, ask, stream=stream)
        # The agent sends its conversation back with a new turn: the call is continued from
        # the session's tokens.
        again = [*ask, said, {"role": "user", "content": "Once more?"}]
        await agent.call(sid, again, stream=stream)
    assert (await agent.reward(first["session_id"], 1.0)).status_code == 200
    twice = await agent.reward(first["session_id"], 0.0)
    assert twice.status_code == 409 and "already rewarded" in twice.json()["error"]["message"]
    assert (await agent.reward(second["session_id"], 0.0)).status_code == 200

    group = await next_group(nats_url, run, "learner-a")
    assert group.group_id.startswith(f"{run}/") and group.prompt_id == task["prompt_id"]
    assert [c.reward for c in group.completions] == [1.0, 0.0]
    assert [r.name for r in group.completions[0].rewards] == ["agent"]
    prompt = ids(group.prompt_token_ids)
    for completion in group.completions:
        tokens, mask = ids(completion.token_ids), ids(completion.loss_mask)
        logprobs = ids(completion.logprobs)
        assert len(tokens) == len(mask) == len(logprobs) and prompt
        # Two model turns with the agent's turn between: masked in, out, in.
        runs = [mask[0]] + [b for a, b in itertools.pairwise(mask) if a != b]
        assert runs == [True, False, True], mask
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
        assert all(lp <= 0.0 for lp in logprobs)
        assert completion.policy_version == completion.end_policy_version >= 0


@pytest.mark.asyncio(loop_scope="session")
async def test_bad_session_requests_name_what_was_wrong(training: tuple[Agent, str]) -> None:
    agent, _ = training
    ask = [{"role": "user", "content": "Q: 1+1=?\nA:"}]
    with pytest.raises(openai.NotFoundError, match="no session"):
        await agent.call("sess-unknown", ask)
    assert (await agent.reward("sess-unknown", 1.0)).status_code == 404
    session = await agent.start()
    sid = session["session_id"]
    bad = await agent.http.post(f"/rlfleet/v1/sessions/{sid}/reward", json={"reward": "high"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
    no_call = await agent.reward(sid, 1.0)
    assert no_call.status_code == 409 and "no model call" in no_call.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="one completion") as many:
        await agent.call(sid, ask, n=2)
    assert many.value.body["param"] == "n"  # type: ignore[index]
    await agent.call(sid, ask)
    assert (await agent.reward(sid, 1.0)).status_code == 200
    with pytest.raises(openai.APIStatusError, match="was rewarded") as ended:
        await agent.call(sid, ask)
    assert ended.value.status_code == 410
    # Without a session a call is served, not recorded.
    reply = await agent.model.chat.completions.create(model="tiny", messages=ask, max_tokens=4)
    assert reply.choices[0].message is not None


@pytest.mark.asyncio(loop_scope="session")
async def test_sessions_never_rewarded_are_dropped_and_their_group_goes_out(
    training: tuple[Agent, str], nats_url: str
) -> None:
    agent, run = training
    kept, lost = await agent.start(), await agent.start()
    if kept["task"] != lost["task"]:  # the previous test left a group half handed out
        kept, lost = lost, await agent.start()
    ask = [{"role": "user", "content": kept["task"]["prompt"]}]
    await agent.call(kept["session_id"], ask)
    await agent.call(lost["session_id"], ask)
    assert (await agent.reward(kept["session_id"], 1.0)).status_code == 200
    group = None
    for _ in range(3):  # earlier groups of this module's run come first
        group = await next_group(nats_url, run, "learner-c")
        if group.prompt_id == kept["task"]["prompt_id"]:
            break
    assert group is not None and group.prompt_id == kept["task"]["prompt_id"]
    assert [c.reward for c in group.completions] == [1.0]  # the lost one was dropped
    late = await agent.reward(lost["session_id"], 1.0)
    assert late.status_code == 410 and "dropped: timeout" in late.json()["error"]["message"]
