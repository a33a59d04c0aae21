"""The run's prompt work queue on JetStream: one feeder, many rollout drivers.

Queue: a stream with work-queue retention, ``RLFLEET_<RUN>-WQ-<QUEUE>`` on
``rlfleet.v1.work.<run>.<queue>`` (services/bus/subjects.py), holding PromptTask messages. Every
driver pulls from the ONE durable consumer ``DURABLE``, so JetStream hands each prompt to exactly
one driver (a work-queue stream even refuses a second consumer on the same subject). A driver
acks a prompt once its TrajectoryGroup is published; acked prompts leave the stream. A prompt
that is not acked within ``ack_wait`` (its driver died) is delivered again to another driver,
so live drivers heartbeat (``in_progress``) the prompts they hold while generating.

Feeder: exactly one per run, the driver with ``feed: true`` (the job expansion sets it on
driver 0; two feeders would only publish each prompt twice under the same Nats-Msg-Id, which
the stream drops inside its dedupe window, but they would race for the cursor). It publishes
the dataset's tasks in order with Nats-Msg-Id ``<dataset>/<epoch>/<prompt_id>`` and keeps at
most ``depth`` prompts in the stream (waiting plus taken-but-unacked), so an infinite
generator does not flood it. Its position (epoch, index) is saved in a KV bucket after every
batch: a restarted feeder resumes there instead of starting the dataset over, and the prompts
of a batch it published but did not record are dropped as duplicates within the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from clients.sampler import chat_message
from common.datasets import SOLUTION_COLUMN, DatasetSpecError, Task, iter_tasks
from common.images import image_digest
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.bus import Bus, Delivery, work_queue_stream, work_queue_subject
from services.bus.images import ImageStore
from services.bus.subjects import QUEUE_DURABLE
from services.errors import Unavailable

__all__ = [
    "DURABLE",
    "SOLUTION_KEY",
    "PromptFeeder",
    "PromptQueue",
    "dataset_name",
    "ensure_queue",
    "image_digests",
    "prompt_key",
    "prompt_task",
    "with_image_bytes",
]

log = logging.getLogger(__name__)

DURABLE = QUEUE_DURABLE  # the one consumer every driver of a run shares
SOLUTION_KEY = SOLUTION_COLUMN  # Task.solution travels in PromptTask.extra under this key
CURSOR_KEY = "cursor"


def dataset_name(spec: dict[str, Any]) -> str:
    """A dataset's name in PromptTask.dataset and message ids: the JSONL path as given, or
    ``<generator>:<split>:<seed>`` (a different split or seed gives different prompts)."""
    if "jsonl" in spec:
        return str(spec["jsonl"])
    return f"{spec.get('generator')}:{spec.get('split', 'train')}:{spec.get('seed', 0)}"


def image_digests(task: trajectory_pb2.PromptTask) -> list[str]:
    """The SHA-256 of each image of a task's messages, in order."""
    if task.WhichOneof("prompt") != "chat":
        return []
    return [
        part.image.sha256
        for message in task.chat.messages
        for part in message.parts
        if part.WhichOneof("part") == "image"
    ]


async def with_image_bytes(
    task: trajectory_pb2.PromptTask, images: ImageStore
) -> trajectory_pb2.PromptTask:
    """A copy of ``task`` whose images hold their bytes (fetched from the run's image store),
    as a sampler takes them; ``task`` itself when it has none."""
    if not image_digests(task):
        return task
    inlined = trajectory_pb2.PromptTask()
    inlined.CopyFrom(task)
    for i, message in enumerate(inlined.chat.messages):
        for j, part in enumerate(message.parts):
            if part.WhichOneof("part") == "image" and part.image.sha256:
                where = f"prompt {prompt_key(task)} messages[{i}].parts[{j}]"
                data = await images.get(part.image.sha256, where)
                part.image.data = data  # the oneof: the digest gives way to the bytes
    return inlined


def prompt_task(run: str, dataset: str, epoch: int, task: Task) -> trajectory_pb2.PromptTask:
    """The queue message of one dataset task (its solution goes into extra, see SOLUTION_KEY)."""
    message = trajectory_pb2.PromptTask(
        run=run, prompt_id=task.prompt_id, dataset=dataset, epoch=epoch
    )
    if task.messages:
        # Images by digest: their bytes go to the run's image store (PromptFeeder).
        refs = iter(sampler_pb2.Image(sha256=image_digest(data)) for data in task.images)
        message.chat.messages.extend(chat_message(m, refs) for m in task.messages)
    elif task.images:
        raise DatasetSpecError(f"task {task.prompt_id} has images but no chat messages")
    else:
        message.text = task.prompt
    extra = task.columns()  # every column reaches the reward functions, as in TRL
    if extra:
        message.extra.update(extra)
    return message


def prompt_key(task: trajectory_pb2.PromptTask) -> str:
    """``<dataset>/<epoch>/<prompt_id>``: the prompt's Nats-Msg-Id, unique within a run."""
    return f"{task.dataset}/{task.epoch}/{task.prompt_id}"


async def ensure_queue(bus: Bus, run: str, queue: str) -> tuple[str, str]:
    """Create the queue's stream if missing; returns (stream, subject). Feeder and drivers both
    call it, with the same settings, so whichever starts first creates it."""
    stream, subject = work_queue_stream(run, queue), work_queue_subject(run, queue)
    await bus.ensure_stream(stream, [subject], retention="workqueue")
    return stream, subject


class PromptFeeder:
    """Publishes a dataset's tasks into the queue, at most ``depth`` ahead of the drivers."""

    def __init__(
        self,
        bus: Bus,
        run: str,
        queue: str,
        dataset: dict[str, Any],
        *,
        depth: int,
        epochs: int | None = None,
        poll_s: float = 0.2,
    ) -> None:
        self.bus = bus
        self.run = run
        self.queue = queue
        self.spec = dict(dataset)
        self.dataset = dataset_name(dataset)
        self.depth = depth
        self.epochs = epochs
        self.poll_s = poll_s
        self.published = 0  # by this feeder (duplicates the stream dropped not counted)
        self.images = ImageStore(bus.payloads, run)

    async def run_until(self, stop: asyncio.Event) -> None:
        """Feed until the last epoch is queued or ``stop`` is set."""
        stream, subject = await ensure_queue(self.bus, self.run, self.queue)
        store = await self.bus.kv(f"{stream}-FEED")
        epoch, start = await self._load_cursor(store)
        log.info(
            "feeding %s into %s (depth %d) from epoch %d, task %d",
            self.dataset,
            subject,
            self.depth,
            epoch,
            start,
        )
        while self.epochs is None or epoch < self.epochs:
            tasks = self._tasks(start)
            index, upcoming = start, next(tasks, None)  # one ahead: an epoch's end is seen
            if upcoming is None and start == 0:
                raise DatasetSpecError(f"dataset {self.dataset} has no tasks")
            while upcoming is not None:
                room = await self._room(stream, stop)
                if stop.is_set():
                    return
                for _ in range(room):
                    for data in upcoming.images:
                        await self.images.put(data)
                    message = prompt_task(self.run, self.dataset, epoch, upcoming)
                    ack = await self.bus.publish(subject, message, msg_id=prompt_key(message))
                    self.published += not ack.duplicate
                    index, upcoming = index + 1, next(tasks, None)
                    if upcoming is None:
                        break
                await self._save_cursor(store, epoch, index)
            log.info("queued epoch %d of %s (%d tasks)", epoch, self.dataset, index)
            epoch, start = epoch + 1, 0
            await self._save_cursor(store, epoch, 0)
        log.info("dataset %s: all %d epochs queued; the feeder is done", self.dataset, epoch)

    def _tasks(self, start: int) -> Iterator[Task]:
        tasks = iter_tasks(self.spec)
        for _ in zip(range(start), tasks, strict=False):  # resume: skip what was queued
            pass
        return tasks

    async def _room(self, stream: str, stop: asyncio.Event) -> int:
        """Wait until the stream holds fewer than ``depth`` prompts; how many more fit."""
        while True:
            try:
                info = await self.bus.js.stream_info(stream)
                room = self.depth - int(info.state.messages)
                if room > 0:
                    return room
            except Exception as exc:  # a NATS hiccup: the feeder must outlive it
                log.warning("prompt queue %s: stream info failed: %s", stream, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_s)
            if stop.is_set():
                return 0

    async def _load_cursor(self, store: Any) -> tuple[int, int]:
        try:
            entry = await store.get(CURSOR_KEY)
        except Exception:  # no key yet (nats-py raises KeyNotFoundError, or its deleted form)
            return 0, 0
        cursor = json.loads(entry.value or b"{}")
        if cursor.get("dataset") != self.dataset:
            log.info("feeder cursor is for dataset %r: starting %s over", cursor, self.dataset)
            return 0, 0
        return int(cursor["epoch"]), int(cursor["index"])

    async def _save_cursor(self, store: Any, epoch: int, index: int) -> None:
        value = {"dataset": self.dataset, "epoch": epoch, "index": index}
        await store.put(CURSOR_KEY, json.dumps(value).encode())


class PromptQueue:
    """A driver's end of the queue: ``take`` prompts, then ``ack`` (or ``nak``) them.

    A background pump pulls one prompt at a time from the shared durable into a local buffer of
    ``prefetch`` (so the next call's prompts are ready, without hoarding prompts other drivers
    could take), and a heartbeat keeps every prompt this driver holds from being redelivered.
    """

    def __init__(self, bus: Bus, run: str, queue: str, *, ack_wait_s: float, prefetch: int) -> None:
        self.bus = bus
        self.run = run
        self.queue = queue
        self.ack_wait_s = ack_wait_s
        self._buffer: asyncio.Queue[Delivery[trajectory_pb2.PromptTask]] = asyncio.Queue(
            maxsize=max(1, prefetch)
        )
        self._held: dict[int, Delivery[trajectory_pb2.PromptTask]] = {}  # by stream seq
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None

    async def start(self) -> None:
        stream, subject = await ensure_queue(self.bus, self.run, self.queue)
        pulled = self.bus.pull(
            stream,
            DURABLE,
            subject,
            trajectory_pb2.PromptTask,
            batch=1,  # nothing fetched sits unseen (and un-heartbeated) in the iterator
            timeout_s=1.0,
            ack_wait_s=self.ack_wait_s,
            stop_event=self._stop,
        )
        self._tasks = [
            asyncio.create_task(self._pump(pulled), name="prompt-pump"),
            asyncio.create_task(self._heartbeat(), name="prompt-heartbeat"),
        ]

    async def _pump(self, pulled: Any) -> None:
        try:
            async for delivery in pulled:
                if delivery.num_delivered > 1:
                    log.info(
                        "prompt %s redelivered (delivery %d)",
                        prompt_key(delivery.message),
                        delivery.num_delivered,
                    )
                self._held[int(delivery.seq or 0)] = delivery
                await self._buffer.put(delivery)
        except Exception as exc:  # surfaced by take(): the driver must not wait forever
            self._failure = exc
            raise

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for delivery in list(self._held.values()):
                if delivery.settled:
                    continue
                try:
                    await delivery.in_progress()
                except (Unavailable, OSError) as exc:  # reconnecting: the next beat may land
                    log.debug("heartbeat of prompt seq %s: %s", delivery.seq, exc)

    async def take(
        self,
        count: int,
        stop: asyncio.Event,
        *,
        linger_s: float = 0.05,
        first_timeout_s: float | None = None,
    ) -> list[Delivery[trajectory_pb2.PromptTask]]:
        """Up to ``count`` prompts: waits for the first (up to ``first_timeout_s``; an empty
        list when ``stop`` is set meanwhile or it times out), then up to ``linger_s`` for each
        further one, so a call is not held back long by a nearly empty queue."""
        taken: list[Delivery[trajectory_pb2.PromptTask]] = []
        while len(taken) < count:
            timeout = first_timeout_s if not taken else linger_s
            item = await self._next(stop, timeout)
            if item is None:
                break
            taken.append(item)
        return taken

    async def _next(
        self, stop: asyncio.Event, timeout: float | None
    ) -> Delivery[trajectory_pb2.PromptTask] | None:
        if not self._buffer.empty():
            return self._buffer.get_nowait()
        if self._failure is not None:
            raise self._failure
        getter = asyncio.ensure_future(self._buffer.get())
        stopped = asyncio.ensure_future(stop.wait())
        waiters = {getter, stopped, *self._tasks[:1]}  # the pump's end wakes us too
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if getter.done():
            return getter.result()
        getter.cancel()  # cancelling Queue.get leaves the item in the queue
        with contextlib.suppress(asyncio.CancelledError):
            await getter
        if self._failure is not None:
            raise self._failure
        return None

    async def ack(self, deliveries: list[Delivery[trajectory_pb2.PromptTask]]) -> None:
        """Done with these prompts: they leave the queue. An unconfirmed ack is only logged: the
        prompt comes back and its group, rebuilt with the same id, is dropped as a duplicate."""
        for delivery in deliveries:
            self._held.pop(int(delivery.seq or 0), None)
            try:
                await delivery.ack()
            except Unavailable as exc:
                log.warning("ack of prompt %s: %s", prompt_key(delivery.message), exc)

    async def nak(self, deliveries: list[Delivery[trajectory_pb2.PromptTask]]) -> None:
        """Give prompts back at once (this driver stops or could not roll them out)."""
        for delivery in deliveries:
            self._held.pop(int(delivery.seq or 0), None)
            if not delivery.settled:
                with contextlib.suppress(Exception):
                    await delivery.nak()

    async def term(self, delivery: Delivery[trajectory_pb2.PromptTask]) -> None:
        """Drop a prompt for good (the sampler refused it, e.g. too long for the context)."""
        self._held.pop(int(delivery.seq or 0), None)
        with contextlib.suppress(Exception):
            await delivery.term()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop pulling and give back every prompt still held (buffered or in work)."""
        self._stop.set()
        pump = self._tasks[0] if self._tasks else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while pump is not None and not pump.done() and loop.time() < deadline:
            while not self._buffer.empty():  # unblock a pump waiting to put
                self._buffer.get_nowait()
            await asyncio.wait({pump}, timeout=0.1)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.nak(list(self._held.values()))
