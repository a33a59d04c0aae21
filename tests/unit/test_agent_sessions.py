"""Agent sessions of the gateway's training mode (gateway/training/sessions.py): calls laid out as
one episode token in, token out; groups of a task's sessions; rewards once; drops counted."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.training.sessions import (
    Call,
    SessionBook,
    SessionEnded,
    SessionError,
    SessionLimits,
)

OPENING = [{"role": "system", "content": "calc"}, {"role": "user", "content": "12*34?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
REPLY = {"role": "assistant", "content": None, "tool_calls": [CALL]}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "408"}


class Task:
    def __init__(self, prompt_id: str) -> None:
        self.message = prompt_id


class Recorder:
    """The book's callables, as the gateway gives them: tasks in order, groups kept."""

    def __init__(self) -> None:
        self.taken = 0
        self.published: list[tuple[Any, list[Any]]] = []

    async def take(self) -> Task:
        self.taken += 1
        return Task(f"task-{self.taken}")

    async def publish(self, group: Any, rewarded: list[Any]) -> None:
        self.published.append((group, rewarded))


def book(limits: SessionLimits | None = None, clock: Any = None) -> tuple[SessionBook, Recorder]:
    recorder = Recorder()
    made = SessionBook(
        2,
        limits or SessionLimits(),
        recorder.take,
        recorder.publish,
        **({"clock": clock} if clock else {}),
    )
    return made, recorder


def call(prompt: list[int], tokens: list[int], version: int = 3) -> Call:
    return Call(prompt, tokens, [-0.5] * len(tokens), version, 1)


async def test_calls_continue_one_episode_token_in_token_out() -> None:
    sessions, _ = book()
    session = await sessions.start()
    assert session.prefix(OPENING, None) is None  # nothing to continue from yet
    session.record(OPENING, None, False, call([1, 2, 3], [7, 8]), REPLY)
    history = [*OPENING, REPLY, TOOL]
    ids, count = session.prefix(history, None)
    assert (ids, count) == ([1, 2, 3, 7, 8], 3)
    # The sampler's prompt: those ids, then the tool's turn; then the answer.
    session.record(
        history,
        None,
        True,
        call([1, 2, 3, 7, 8, 9, 10], [11], version=4),
        {"role": "assistant", "content": "408"},
    )
    episode = session.episode
    assert episode.prompt_ids == [1, 2, 3]
    assert episode.token_ids == [7, 8, 9, 10, 11]
    assert episode.loss_mask == [True, True, False, False, True]
    assert episode.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert (episode.first_version, episode.last_version, episode.turns) == (3, 4, 2)
    assert session.restarts == 0


async def test_a_rewritten_history_starts_the_episode_over() -> None:
    sessions, _ = book()
    session = await sessions.start()
    session.record(OPENING, None, False, call([1, 2, 3], [7, 8]), REPLY)
    edited = [*OPENING, {**REPLY, "content": "I will call calc"}, TOOL]
    assert session.prefix(edited, None) is None
    assert session.prefix([*OPENING, REPLY, TOOL], [{"type": "function"}]) is None  # new tools
    session.record(edited, None, False, call([1, 2, 3, 4, 9], [11]), REPLY)
    assert session.episode.prompt_ids == [1, 2, 3, 4, 9]
    assert session.episode.token_ids == [11]
    assert session.restarts == 1


async def test_a_group_is_its_tasks_sessions_and_goes_out_when_all_are_rewarded() -> None:
    sessions, recorder = book()
    first, second, third = [await sessions.start() for _ in range(3)]
    assert first.group is second.group and third.group is not first.group
    assert first.group.task == "task-1" and third.group.task == "task-2"
    for session in (first, second):
        session.record(OPENING, None, False, call([1, 2], [5]), REPLY)
    await sessions.reward(first.id, 1.0)
    assert recorder.published == []  # the second is still playing
    with pytest.raises(SessionError, match="already rewarded") as twice:
        await sessions.reward(first.id, 0.0)
    assert twice.value.status == 409
    await sessions.reward(second.id, 0.0)
    ((group, rewarded),) = recorder.published
    assert group is first.group and rewarded == [first, second]
    assert [s.episode.reward for s in rewarded] == [1.0, 0.0]
    with pytest.raises(SessionError, match="already rewarded") as late:
        await sessions.reward(first.id, 1.0)  # its group is out: still told so
    assert late.value.status == 409
    with pytest.raises(SessionEnded, match="ended \\(rewarded\\)"):
        sessions.get(second.id)
    with pytest.raises(SessionError, match="no session") as unknown:
        sessions.get("sess-unknown")
    assert unknown.value.status == 404
    assert sessions.counts["groups"] == 1 and sessions.counts["rewarded"] == 2


async def test_sessions_without_a_reward_in_time_are_dropped_and_counted() -> None:
    now = [0.0]
    sessions, recorder = book(SessionLimits(session_timeout_s=10), clock=lambda: now[0])
    kept, lost = await sessions.start(), await sessions.start()
    kept.record(OPENING, None, False, call([1, 2], [5]), REPLY)
    lost.record(OPENING, None, False, call([1, 2], [6]), REPLY)
    await sessions.reward(kept.id, 1.0)
    now[0] = 9.0
    await sessions.sweep()
    assert recorder.published == []
    now[0] = 10.0
    lost.busy = True  # a call in flight is let finish
    await sessions.sweep()
    assert recorder.published == []
    lost.busy = False
    await sessions.sweep()
    ((group, rewarded),) = recorder.published
    assert group is kept.group and rewarded == [kept] and sessions.dropped == {"timeout": 1}
    with pytest.raises(SessionEnded, match="dropped \\(timeout\\)"):
        lost.check_open()
    # A group none of whose sessions was rewarded goes out empty (its task is acked).
    a, b = await sessions.start(), await sessions.start()
    await sessions.drop(a, "closed")
    now[0] = 30.0
    await sessions.sweep()
    assert recorder.published[-1] == (b.group, []) and sessions.empty_groups == 1
    assert sessions.dropped == {"timeout": 2, "closed": 1}


async def test_runaway_sessions_are_cut_off_at_their_caps() -> None:
    sessions, recorder = book(SessionLimits(max_calls=2, max_tokens=100))
    session = await sessions.start()
    session.record(OPENING, None, False, call([1, 2], [5]), REPLY)
    await sessions.after_call(session)
    session.check_open()  # one more call allowed
    session.record([*OPENING, REPLY, TOOL], None, True, call([1, 2, 5, 6], [7]), REPLY)
    await sessions.after_call(session)
    with pytest.raises(SessionEnded, match="max_calls cap") as capped:
        session.check_open()  # no third call ...
    assert capped.value.status == 410 and sessions.capped == {"max_calls": 1}
    await sessions.reward(session.id, 1.0)  # ... but its episode still counts
    tokens = await sessions.start()
    tokens.record(OPENING, None, False, call(list(range(90)), list(range(10))), REPLY)
    await sessions.after_call(tokens)
    with pytest.raises(SessionEnded, match="max_tokens cap"):
        tokens.check_open()
    await sessions.reward(tokens.id, 0.0)
    ((_, rewarded),) = recorder.published
    assert rewarded == [session, tokens]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
async def test_a_reward_must_be_finite(value: float) -> None:
    sessions, _ = book()
    session = await sessions.start()
    session.record(OPENING, None, False, call([1], [2]), REPLY)
    with pytest.raises(SessionError, match="finite") as bad:
        await sessions.reward(session.id, value)
    assert bad.value.status == 400


async def test_a_restarted_runner_has_its_old_sessions_dropped_at_once() -> None:
    sessions, recorder = book()
    old = await sessions.start("agent-0", "101")
    other = await sessions.start("agent-1", "202")
    for session in (old, other):
        session.record(OPENING, None, False, call([1, 2], [5]), REPLY)
    assert old.group is other.group
    await sessions.reward(other.id, 1.0)
    assert recorder.published == []
    again = await sessions.start("agent-0", "103")  # the same runner, started again
    assert old.dropped == "runner_restarted" and not again.ended
    ((group, rewarded),) = recorder.published
    assert group is other.group and rewarded == [other]
    await sessions.start("agent-0", "103")  # the same incarnation: nothing dropped
    assert not again.ended and sessions.dropped == {"runner_restarted": 1}
