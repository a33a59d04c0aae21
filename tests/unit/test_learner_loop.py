"""learner.loop and learner.consumer without a bus: the triage rules (lag dropping, the
idempotence window), the checkpointed counters, and one gather -> train pass of the shared loop
over a stand-in workload (what is dropped, held, ledgered and counted)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from learner.consumer import AppliedWindow, TakenSequences, triage
from learner.engine import NonfiniteUpdate
from learner.loop import LearnerLoop
from learner.workload import Envelope, Progress
from services.errors import InvalidArgument

# ---------------------------------------------------------------------------- bookkeeping


def test_triage_drops_stale_fragments_beyond_the_lag_limit() -> None:
    window = AppliedWindow(10)
    assert triage("a", policy_version=5, version=5, max_policy_lag=0, applied=window) == "apply"
    assert triage("a", policy_version=4, version=5, max_policy_lag=0, applied=window) == "stale"
    assert triage("a", policy_version=3, version=5, max_policy_lag=2, applied=window) == "apply"
    assert triage("a", policy_version=2, version=5, max_policy_lag=2, applied=window) == "stale"
    # A fragment from a newer version than ours (possible right after a restart) is fresh.
    assert triage("a", policy_version=9, version=5, max_policy_lag=0, applied=window) == "apply"


def test_triage_skips_applied_and_pending_ids_before_judging_lag() -> None:
    window = AppliedWindow(10, ["done"])
    assert triage("done", 0, 100, 0, window) == "duplicate"
    assert triage("pending", 5, 5, 0, window, pending={"pending"}) == "duplicate"
    assert triage("new", 5, 5, 0, window, pending={"pending"}) == "apply"


def test_applied_window_forgets_the_oldest_ids_and_round_trips() -> None:
    window = AppliedWindow(3)
    for fid in ["a", "b", "c", "b", "d"]:  # "b" twice is one entry
        window.add(fid)
    assert "a" not in window and all(f in window for f in "bcd")
    assert window.to_list() == ["b", "c", "d"] and len(window) == 3
    again = AppliedWindow(3, window.to_list())
    again.add("e")
    assert again.to_list() == ["c", "d", "e"]


def test_taken_sequences_keep_each_producers_highest_for_the_latest_producers() -> None:
    taken = TakenSequences(limit=2)
    taken.note("run/a/1", 3)
    taken.note("run/a/1", 1)  # a redelivery, out of order: no step back
    taken.note(None, 5)  # a message whose producer does not pace on it
    taken.note("run/b/1", -1)  # nor one without a sequence
    taken.note("run/b/1", 0)
    assert taken.snapshot() == {"run/a/1": 3, "run/b/1": 0}
    taken.note("run/c/1", 7)  # over the limit: the producer taken from longest ago goes
    assert taken.snapshot() == {"run/b/1": 0, "run/c/1": 7}


def test_progress_round_trips_and_reads_earlier_counter_names() -> None:
    progress = Progress(updates=3, version=4, samples=96, messages=6, duplicates_dropped=1)
    progress.applied = AppliedWindow(10, ["a", "b"])
    again = Progress.from_state(json.loads(json.dumps(progress.to_state())), window=10)
    assert again.to_state() == progress.to_state()
    # Checkpoints of the game and LM learners before they shared the loop.
    game = Progress.from_state({"updates": 2, "global_step": 64, "stale_dropped": 1}, window=10)
    assert (game.updates, game.samples, game.stale_dropped) == (2, 64, 1)
    lm = Progress.from_state({"updates": 2, "groups": 4, "samples": 16, "duplicates": 1}, 10)
    assert (lm.messages, lm.samples, lm.duplicates_dropped) == (4, 16, 1)


# ---------------------------------------------------------------------------- the loop


class Message(SimpleNamespace):
    id: str
    version: int
    payload: str  # "ok", "bad" (decode fails), "empty" (filtered out)


class Settled:
    def __init__(self, message: Message) -> None:
        self.message, self.how = message, None

    async def _set(self, how: str) -> None:
        self.how = how

    def ack(self) -> Any:
        return self._set("ack")

    def term(self) -> Any:
        return self._set("term")


class Inbox:
    """The TrajectoryConsumer surface the loop's gather and train use."""

    def __init__(self, deliveries: list[Settled]) -> None:
        self.queue, self.gathering, self.unacked = list(deliveries), [], []

    async def next(self) -> Settled | None:
        return self.queue.pop(0) if self.queue else None

    def hold(self, delivery: Settled) -> None:
        self.gathering.append(delivery)

    def applied(self) -> None:
        self.unacked += self.gathering
        self.gathering = []

    async def drop_gathered(self) -> None:
        for delivery in self.gathering:
            await delivery.term()
        self.gathering = []


class TwoPerUpdate:
    """A workload of two messages per update, each one sample per character of its payload."""

    durable, message_type, noun, messages_per_update = "test", object, "messages", 2
    settings = SimpleNamespace(
        max_policy_lag=1, checkpoint_every=10, keep_checkpoints=1, keep_versions=1,
        ack_wait_s=1.0, applied_window=100, seed=1, max_ack_pending=10,
    )  # fmt: skip

    def envelope(self, message: Message) -> Envelope:
        return Envelope(message.id, message.version, {"size": len(message.payload)})

    async def decode(self, message: Message) -> str:
        if message.payload == "bad":
            raise InvalidArgument("bad payload")
        return message.payload

    def accept(self, decoded: str) -> tuple[list[str], str | None]:
        return ([decoded], None) if decoded != "empty" else ([], "no signal")

    def samples(self, items: list[str]) -> int:
        return sum(len(x) for x in items)

    def train(self, items: list[str], progress: Progress, generator: Any) -> dict[str, float]:
        return {"losses/loss": 1.0, "charts/version_trained": float(progress.version)}

    def report(self, items, metrics, progress, elapsed_s) -> dict[str, float]:
        return {"charts/samples": float(progress.samples)}


async def test_gather_drops_stale_invalid_filtered_and_duplicates_then_train_ledgers(
    tmp_path: Path,
) -> None:
    ctx = SimpleNamespace(
        run_name="t", run_dir=tmp_path, name="learner", stop_event=asyncio.Event()
    )
    loop = LearnerLoop(ctx, TwoPerUpdate())  # type: ignore[arg-type]
    loop.progress.version = 5
    loop.progress.applied.add("old")
    messages = [
        Message(id="old", version=5, payload="ok"),  # applied before: duplicate, held
        Message(id="stale", version=3, payload="ok"),  # lag 2 > 1: acked at once
        Message(id="bad", version=5, payload="bad"),  # terminated
        Message(id="empty", version=5, payload="empty"),  # filtered: acked at once
        Message(id="a", version=4, payload="ok"),
        Message(id="a", version=4, payload="ok"),  # already in this batch: duplicate
        Message(id="b", version=5, payload="okay"),
    ]
    deliveries = [Settled(m) for m in messages]
    loop.consumer = Inbox(deliveries)  # type: ignore[assignment]
    gathered = await loop._gather()
    assert gathered is not None and gathered[0] == ["ok", "okay"]
    assert [d.how for d in deliveries] == [None, "ack", "term", "ack", None, None, None]
    p = loop.progress
    assert (p.duplicates_dropped, p.stale_dropped, p.invalid_dropped, p.filtered_dropped) == (
        2, 1, 1, 1,
    )  # fmt: skip

    published: list[dict[str, float]] = []

    async def publish() -> None:
        p.version += 1

    async def report(metrics: dict[str, float]) -> None:
        published.append(metrics)

    loop._publish_weights = publish  # type: ignore[method-assign]
    loop.handle = SimpleNamespace(report=report)  # type: ignore[assignment]
    await loop._train(gathered)
    loop.ledger.close()
    assert (p.updates, p.version, p.samples, p.messages) == (1, 6, 6, 2)
    assert "a" in p.applied and "b" in p.applied
    assert published[0]["charts/version_trained"] == 5 and published[0]["charts/samples"] == 6
    assert "charts/update_s" in published[0] and loop.metrics == published[0]
    assert len(loop.consumer.unacked) == 4  # type: ignore[union-attr]  # 2 applied, 2 duplicates
    ledger = [
        json.loads(line) for line in (tmp_path / "learner/applied.jsonl").read_text().splitlines()
    ]
    assert [(e["id"], e["status"]) for e in ledger] == [
        ("stale", "stale"), ("bad", "invalid"), ("empty", "filtered"),
        ("a", "applied"), ("b", "applied"),
    ]  # fmt: skip
    assert ledger[1]["error"] == "bad payload" and ledger[2]["reason"] == "no signal"
    applied = ledger[3]
    assert (applied["update"], applied["version"], applied["lag"], applied["size"]) == (1, 5, 1, 2)


class Sequenced(TwoPerUpdate):
    """Messages of one producer whose ids are their sequence numbers."""

    def envelope(self, message: Message) -> Envelope:
        sequence = int(message.id)
        return Envelope(message.id, message.version, producer="run/actor-0/x", sequence=sequence)


async def test_gather_notes_every_message_it_takes_applied_or_dropped(tmp_path: Path) -> None:
    ctx = SimpleNamespace(
        run_name="t", run_dir=tmp_path, name="learner", stop_event=asyncio.Event()
    )
    loop = LearnerLoop(ctx, Sequenced())  # type: ignore[arg-type]
    loop.progress.version = 5
    messages = [
        Message(id="0", version=5, payload="ok"),
        Message(id="1", version=5, payload="bad"),  # terminated: taken all the same
        Message(id="3", version=2, payload="ok"),  # stale: dropped, taken
        Message(id="2", version=5, payload="ok"),  # out of order: the highest stays 3
    ]
    loop.consumer = Inbox([Settled(m) for m in messages])  # type: ignore[assignment]
    gathered = await loop._gather()
    assert gathered is not None and gathered[0] == ["ok", "ok"]
    assert loop.taken.snapshot() == {"run/actor-0/x": 3}
    loop.ledger.close()


class Diverging(TwoPerUpdate):
    """Its update stops before a NaN step whenever a message says "nan" (as check_step does)."""

    settings = SimpleNamespace(**vars(TwoPerUpdate.settings), max_nonfinite_updates=2)

    def envelope(self, message: Message) -> Envelope:
        return Envelope(message.id, message.version, producer=f"run/{message.id[0]}/x")

    def train(self, items: list[str], progress: Progress, generator: Any) -> dict[str, float]:
        if "nan" in items:
            exc = NonfiniteUpdate("loss nan", metrics={"losses/loss": math.nan})
            exc.sources = ["actor-b (fragment b1): NaN/inf in observations"]
            raise exc
        return super().train(items, progress, generator)


async def test_nonfinite_updates_are_skipped_counted_and_fail_the_run_in_a_row(
    tmp_path: Path,
) -> None:
    ctx = SimpleNamespace(
        run_name="t", run_dir=tmp_path, name="learner", stop_event=asyncio.Event()
    )
    loop = LearnerLoop(ctx, Diverging())  # type: ignore[arg-type]
    published: list[int] = []
    reports: list[dict[str, float]] = []

    async def publish() -> None:
        published.append(loop.progress.version)

    async def report(metrics: dict[str, float]) -> None:
        reports.append(metrics)

    loop._publish_weights = publish  # type: ignore[method-assign]
    loop.handle = SimpleNamespace(report=report)  # type: ignore[assignment]

    ids = itertools.count()

    async def update(*payloads: str) -> bool:
        deliveries = [
            Settled(Message(id=f"{p[0]}{next(ids)}", version=0, payload=p)) for p in payloads
        ]
        loop.consumer = Inbox(deliveries)  # type: ignore[assignment]
        gathered = await loop._gather()
        assert gathered is not None
        trained = await loop._train(gathered)
        assert [d.how for d in deliveries] == [None if trained else "term"] * len(deliveries)
        return trained

    assert not await update("ok", "nan")  # skipped: nothing published, nothing applied
    assert (loop.progress.updates, published, loop.nonfinite_updates) == (0, [], 1)
    assert reports[-1]["losses/nonfinite_updates"] == 1 and math.isnan(reports[-1]["losses/loss"])
    assert await update("ok", "ok")  # a good update ends the run of skipped ones
    assert reports[-1]["losses/nonfinite_updates"] == 1 and loop.nonfinite_in_a_row == 0
    assert not await update("nan", "ok")
    with pytest.raises(NonfiniteUpdate) as err:
        await update("ok", "nan")
    loop.ledger.close()
    assert str(err.value) == (
        "2 updates in a row stopped before a NaN/inf step (max_nonfinite_updates=2), none "
        "applied; last: loss nan; data from actor-b (fragment b1): NaN/inf in observations"
    )
    assert (loop.progress.updates, published, loop.nonfinite_updates) == (1, [0], 3)
    ledger = [
        json.loads(line) for line in (tmp_path / "learner/applied.jsonl").read_text().splitlines()
    ]
    assert [e["status"] for e in ledger] == ["nonfinite"] * 2 + ["applied"] * 2 + ["nonfinite"] * 4


async def test_a_shutdown_step_that_swallows_its_cancellation_is_left_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from learner.loop import _bounded

    released = asyncio.Event()

    async def stubborn() -> None:
        while not released.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # as a library that loses a cancellation does

    started = asyncio.get_running_loop().time()
    await _bounded(stubborn(), "closing something", timeout_s=0.2)
    assert asyncio.get_running_loop().time() - started < 2.0
    assert "closing something took over 0.2s" in caplog.text
    released.set()

    async def fails() -> None:
        raise RuntimeError("boom")

    await _bounded(fails(), "closing another", timeout_s=1.0)
    assert "closing another failed: RuntimeError: boom" in caplog.text
