"""What every learner workload (game fragments, LM trajectory groups) shares around the bus:
the durable-consumer inbox with at-least-once bookkeeping, the applied/dropped ledger, the
dedupe window and triage rule, and small helpers for seeding, checkpoints and time stamps.

Delivery states: pulled (``inbox``) -> held for the batch being gathered (``gathering``) ->
applied, waiting for the checkpoint that covers it (``unacked``) -> acked. Every held delivery
gets ``in_progress()`` every ack_wait/3 so it is not redelivered while held; on shutdown the
ones not applied are nak'ed back to the stream at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import random
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from google.protobuf import timestamp_pb2

from learner.weights import announce
from services.bus import Bus, Delivery
from services.errors import InvalidArgument, RlfleetError

__all__ = [
    "AppliedWindow",
    "Ledger",
    "TakenSequences",
    "TrajectoryConsumer",
    "Verdict",
    "next_version",
    "now",
    "publish_version",
    "rng_state",
    "seed_everything",
    "set_rng_state",
    "settle",
    "triage",
    "write_atomic",
]

log = logging.getLogger(__name__)


def now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def seed_everything(seed: int) -> None:
    """Seed every RNG an update may draw from, so every rank builds the same initial model."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    return {
        "shuffle": generator.get_state(),
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(generator: torch.Generator, state: dict[str, Any]) -> None:
    generator.set_state(state["shuffle"])
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def next_version(learner_dir: Path, updates: int, version: int) -> int:
    """First version an incarnation publishes: after the checkpoint's (``version`` at
    ``updates``) and after any the previous incarnation published past it, which
    ``learner_dir/state.json`` remembers (samplers holding a newer version would otherwise ignore
    repeated numbers). A fresh run starts at 0."""
    last = -1
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        last = int(json.loads((learner_dir / "state.json").read_text())["version"])
    if last < 0 and updates == 0:
        return 0
    return max(version, last) + 1


async def publish_version(
    store: Any,
    bus: Bus,
    run: str,
    named: dict[str, Any],
    learner_dir: Path,
    address: str,
    taken: Mapping[str, int] | None = None,
) -> int:
    """Store ``named`` tensors as the next version, remember it in ``state.json``, announce it
    on the bus (WeightsPublished, with the WeightService ``address`` and the ``taken``
    sequences per producer); returns the version."""
    manifest = await asyncio.to_thread(store.publish, named)
    write_atomic(learner_dir / "state.json", json.dumps({"version": manifest.version}) + "\n")
    await announce(bus, run, manifest, address, taken_sequences=taken)
    return int(manifest.version)


class TakenSequences:
    """Per producer, the highest sequence the learner has taken off the stream (applied or
    dropped), announced with every version: actors keep a bounded number of fragments
    outstanding against it (sampler/actors/actor.py, ``Actor._pace``). A credit counted from
    the version an actor started at is not enough: the learner takes fragments in stream order,
    so an actor that starts a version late leaves the other actors' extra credit spent and the
    pipeline one fragment short for the whole run.

    Not checkpointed: after a restart a producer is absent until its next fragment is taken
    (its actor paces on versions meanwhile). Holds the ``limit`` producers taken from last.
    """

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._sequences: collections.OrderedDict[str, int] = collections.OrderedDict()

    def note(self, producer: str | None, sequence: int) -> None:
        if producer is None or sequence < 0:
            return
        previous = self._sequences.pop(producer, -1)
        self._sequences[producer] = max(previous, sequence)  # redeliveries come out of order
        while len(self._sequences) > self.limit:
            self._sequences.popitem(last=False)

    def snapshot(self) -> dict[str, int]:
        return dict(self._sequences)


async def settle(call: Any) -> None:
    """ack/nak/term, tolerating a lost connection (the message is then redelivered and skipped)."""
    try:
        await call
    except RlfleetError as exc:
        log.warning("could not settle a delivery: %s", exc)


class AppliedWindow:
    """The ids of the last ``maxlen`` applied messages: a redelivered id found here is skipped.

    Redeliveries only come for messages not yet acked, and messages are acked right after the
    checkpoint that covers them, so a window a few checkpoints long is enough; it is stored in
    every checkpoint.
    """

    def __init__(self, maxlen: int, ids: Iterable[str] = ()) -> None:
        self.maxlen = maxlen
        self._order: collections.deque[str] = collections.deque()
        self._ids: set[str] = set()
        for message_id in ids:
            self.add(message_id)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._ids

    def __len__(self) -> int:
        return len(self._order)

    def add(self, message_id: str) -> None:
        if message_id in self._ids:
            return
        self._order.append(message_id)
        self._ids.add(message_id)
        while len(self._order) > self.maxlen:
            self._ids.discard(self._order.popleft())

    def to_list(self) -> list[str]:
        return list(self._order)


Verdict = Literal["apply", "duplicate", "stale"]


def triage(
    message_id: str,
    policy_version: int,
    version: int,
    max_policy_lag: int,
    applied: AppliedWindow,
    pending: Collection[str] = (),
) -> Verdict:
    """What to do with a message when the learner is at ``version``: ``duplicate`` when its id
    was applied (or is already in the batch being gathered, ``pending``), ``stale`` when its
    policy lag ``version - policy_version`` exceeds ``max_policy_lag``, else ``apply``."""
    if message_id in applied or message_id in pending:
        return "duplicate"
    if version - policy_version > max_policy_lag:
        return "stale"
    return "apply"


class Ledger:
    """``applied.jsonl``: one JSON line per message applied or dropped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None

    def restore(self, updates: int) -> dict[str, int]:
        """Keep the lines the restored state includes: "applied" ones up to update ``updates``
        and every drop (drops are acked at once, never redelivered). Returns counts by status."""
        kept: list[str] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if entry["status"] != "applied" or entry["update"] <= updates:
                        kept.append(line)
        write_atomic(self.path, "".join(f"{line}\n" for line in kept))
        return collections.Counter(json.loads(line)["status"] for line in kept)

    def write(self, **entry: Any) -> None:
        if self._file is None:
            self._file = self.path.open("a", buffering=1)
        self._file.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TrajectoryConsumer:
    """The learner's side of the run's trajectory stream (one durable pull consumer)."""

    def __init__(
        self,
        bus: Bus,
        *,
        stream: str,
        durable: str,
        subject: str,
        message_type: type,
        batch: int,
        ack_wait_s: float,
        max_ack_pending: int,
        stop_event: asyncio.Event,
        on_invalid: Callable[[InvalidArgument], None],
    ) -> None:
        self.bus, self.stop_event = bus, stop_event
        self.stream, self.durable, self.subject = stream, durable, subject
        self.message_type, self.batch = message_type, batch
        self.max_ack_pending = max_ack_pending
        self.ack_wait_s = ack_wait_s
        self.on_invalid = on_invalid
        self.unacked: list[Delivery[Any]] = []  # applied, waiting for the next checkpoint
        self.gathering: list[Delivery[Any]] = []  # held for the batch being gathered
        self.inbox: collections.deque[Delivery[Any]] = collections.deque()  # pulled, not taken
        self._arrived = asyncio.Event()
        # Ends the pull between fetches (the service's stop, or close): a cancellation that a
        # fetch swallows (asyncio.wait_for racing a message on Python 3.11) cannot keep it alive.
        self._halted = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._pull(), name="pull"),
            asyncio.create_task(self._keep_alive(), name="in-progress"),
            asyncio.create_task(self._halt_on_stop(), name="halt-on-stop"),
        ]

    async def _halt_on_stop(self) -> None:
        await self.stop_event.wait()
        self._halted.set()

    async def _pull(self) -> None:
        """Move deliveries from the durable consumer into the inbox until stopped."""
        while not self._halted.is_set():
            deliveries: AsyncIterator[Delivery[Any]] = self.bus.pull(
                self.stream,
                self.durable,
                self.subject,
                self.message_type,
                batch=self.batch,
                ack_wait_s=self.ack_wait_s,
                max_ack_pending=self.max_ack_pending,
                stop_event=self._halted,
            )
            try:
                async for delivery in deliveries:
                    self.inbox.append(delivery)
                    self._arrived.set()
            except InvalidArgument as exc:  # undecodable: the bus client terminated it
                self.on_invalid(exc)

    async def _keep_alive(self) -> None:
        """in_progress() on every held delivery so none is redelivered while we hold it."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for delivery in [*self.unacked, *self.gathering, *self.inbox]:
                with contextlib.suppress(RlfleetError):
                    await delivery.in_progress()

    async def next(self) -> Delivery[Any] | None:
        """The next delivery, or None once the service is stopping; re-raises why the
        consumer failed if it did."""
        puller = self._tasks[0]
        while not self.inbox:
            self._arrived.clear()
            waits = [
                asyncio.ensure_future(self._arrived.wait()),
                asyncio.ensure_future(self.stop_event.wait()),
            ]
            await asyncio.wait([*waits, puller], return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            if puller.done() and not self.inbox:
                puller.result()  # raises the consumer's error
                return None
            if self.stop_event.is_set():
                return None
        return self.inbox.popleft()

    def hold(self, delivery: Delivery[Any]) -> None:
        """Keep ``delivery`` for the batch being gathered (acked after its checkpoint)."""
        self.gathering.append(delivery)

    def applied(self) -> None:
        """The gathered batch was applied: its deliveries wait for the next checkpoint."""
        self.unacked.extend(self.gathering)
        self.gathering = []

    async def drop_gathered(self) -> None:
        """The gathered batch will never be applied (a non-finite update): terminate its
        deliveries now, as every drop is, so they do not come back."""
        dropped, self.gathering = self.gathering, []
        await asyncio.gather(*(settle(d.term()) for d in dropped))

    async def ack_checkpointed(self) -> int:
        """Ack everything applied so far (call right after a checkpoint is on disk)."""
        acks, self.unacked = self.unacked, []
        await asyncio.gather(*(settle(d.ack()) for d in acks))
        return len(acks)

    async def close(self) -> None:
        """Stop pulling; nak what was not applied so it comes back at once."""
        self._halted.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for delivery in [*self.gathering, *self.inbox]:
            with contextlib.suppress(Exception):
                await delivery.nak()
