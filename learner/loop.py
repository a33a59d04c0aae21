"""The learner's run, written once: bus in, updates, versions out, for any ``Workload``
(learner.workload: the protocol, the ``RunHandle`` a workload gets instead of the loop, and the
``Progress`` counters the loop keeps).

A workload (``learner.game.workload``: PPO/A2C over rollout fragments; ``learner.lm.workload``:
GRPO-family updates over trajectory groups) holds what is particular to its data and model, in
the spirit of torchtune's recipe interface (setup / train / checkpoint / cleanup). The loop owns
the rest: the gRPC server (WeightService, LearnerService.GetStatus), the bus, the durable
consumer and the ledger, checkpoint-then-ack, the RunStatus and the version numbering.

Delivery guarantees (docs/design.md, "at-least-once delivery plus idempotent consumers"):

- a message is acked only after a checkpoint that includes its update is on disk; the checkpoint
  stores the ids of applied messages, so after a crash the unacked messages come back and those
  already in the restored weights are skipped, the others applied once;
- stale messages (lag > max_policy_lag), malformed ones and ones the workload filters out (no
  training signal) are counted, written to the ledger and acked (terminated) at once: they will
  never be applied;
- ``<run_dir>/learner/applied.jsonl`` is the ledger of every message applied (and dropped); on a
  restart its "applied" lines past the restored checkpoint are removed, so at any time it says
  exactly which messages the weights contain;
- versions never repeat: ``<run_dir>/learner/state.json`` remembers the last one published, and a
  restarted learner continues after it (clients holding a newer version than the checkpoint's
  would otherwise ignore the repeated numbers).

Every step that touches the ledger, the acks and the versions is in this one file, so the
guarantees above can be checked in one place; workloads reach the run only through a
``RunHandle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any

import torch
from google.protobuf import timestamp_pb2

from learner.consumer import (
    AppliedWindow,
    Ledger,
    TakenSequences,
    TrajectoryConsumer,
    next_version,
    now,
    publish_version,
    rng_state,
    seed_everything,
    set_rng_state,
    settle,
    triage,
)
from learner.engine import Engine, NonfiniteUpdate
from learner.ranks import Ranks, write_digest
from learner.tracking import NO_TRACKERS, Trackers, trackers_of
from learner.weights import SERVICE_NAME as WEIGHTS_SERVICE
from learner.weights import WeightServicer, WeightStore, add_weight_service
from learner.workload import Envelope, Progress, RunDirs, RunHandle, Workload
from rlfleet.bus.v1 import events_pb2
from rlfleet.learner.v1 import learner_pb2, learner_pb2_grpc
from services.bus import Bus, events_subject, stream_name, traj_subject
from services.errors import InvalidArgument
from services.grpc_names import service_name
from services.registry import ServiceContext
from services.server import GrpcServer
from services.waits import bus_say, waiting

__all__ = ["LearnerLoop"]

log = logging.getLogger(__name__)

LEARNER_SERVICE = service_name(learner_pb2, "LearnerService")
SHUTDOWN_STEP_S = 20.0  # the most one step of the shutdown may take (see _bounded)
_SOURCES_SHOWN = 5  # sources of a non-finite update named in its line; the rest are counted


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """GetStatus over a running LearnerLoop."""

    # Who may call, by certificate kind (services/security.py; the launcher may call all):
    # the learner's control surface is for the launcher and learners, not actors or samplers.
    CALLERS = {"GetStatus": frozenset({"learner", "lm_learner", "dpo_learner"})}

    def __init__(self, loop: LearnerLoop) -> None:
        self.loop = loop

    async def GetStatus(
        self, request: learner_pb2.GetStatusRequest, context: Any
    ) -> learner_pb2.GetStatusResponse:
        return self.loop.status()


class LearnerLoop:
    """One learner incarnation; ``run()`` returns when the run is done or the service stopped."""

    def __init__(
        self, ctx: ServiceContext[Any], workload: Workload, ranks: Ranks | None = None
    ) -> None:
        self.ctx, self.workload, self.settings = ctx, workload, workload.settings
        self.ranks = ranks  # rank 0 of several (learner.ranks): each step below tells the others
        self.run_name = ctx.run_name
        self.dirs = RunDirs.of(ctx.run_dir)
        self.progress = Progress(applied=AppliedWindow(self.settings.applied_window))
        self.checkpointed_updates = 0  # the updates the latest checkpoint on disk includes
        self.generator = torch.Generator().manual_seed(self.settings.seed)  # minibatch order
        self.ledger = Ledger(self.dirs.learner / "applied.jsonl")
        self.taken = TakenSequences()  # announced with each version: the actors' flow control
        self.engine: Engine | None = None
        self.store: WeightStore | None = None
        self.bus: Bus | None = None
        self.server: GrpcServer | None = None
        self.consumer: TrajectoryConsumer | None = None
        self.writer: Any = None
        self.trackers: Trackers = NO_TRACKERS  # W&B, MLflow, as the run file says
        self.handle: RunHandle | None = None  # the workload's view of the run, once the bus is up
        self.metrics: dict[str, float] = {}  # the last update's, for GetStatus
        # Updates skipped for a NaN/inf loss or gradients since this learner started, and in a
        # row (max_nonfinite_updates of those fail the run).
        self.nonfinite_updates = 0
        self.nonfinite_in_a_row = 0
        self.last_update_time: timestamp_pb2.Timestamp | None = None
        self._started = time.monotonic()  # when consuming began: throughput

    # ------------------------------------------------------------------ set-up

    def _build(self) -> None:
        """Seed, build, restore the latest checkpoint and cut the ledger to it (blocking)."""
        s, w = self.settings, self.workload
        seed_everything(s.seed)
        self.engine = w.build()
        state = self.engine.load(self.dirs.checkpoints)
        if state is not None:
            self.progress = Progress.from_state(state, s.applied_window)
            w.restore(state)
            set_rng_state(self.generator, state["rng"])
            self.checkpointed_updates = self.progress.updates
        if self.ranks is not None:
            self.ranks.connect()
        # Drops are acked at once, never redelivered: the ledger is their only count.
        counts = self.ledger.restore(self.progress.updates)
        self.progress.stale_dropped = counts.get("stale", 0)
        self.progress.invalid_dropped = counts.get("invalid", 0)
        self.progress.filtered_dropped = counts.get("filtered", 0)
        p = self.progress
        log.info(
            "learner %s at update %d, version %d, %d samples (%s)",
            self.ctx.name,
            p.updates,
            p.version,
            p.samples,
            "restored" if state is not None else "fresh",
        )

    async def _publish_weights(self) -> None:
        assert self.store is not None and self.bus is not None and self.server is not None
        named = await asyncio.to_thread(self.workload.weights)
        self.progress.version = await publish_version(
            self.store,
            self.bus,
            self.run_name,
            named,
            self.dirs.learner,
            self.server.address,
            self.taken.snapshot(),
        )

    # ------------------------------------------------------------------ the run

    async def run(self) -> None:
        ctx, s, w = self.ctx, self.settings, self.workload
        self.dirs.learner.mkdir(parents=True, exist_ok=True)
        self.server = GrpcServer(ctx.name, host=ctx.host, port=ctx.port)
        try:
            if ctx.nats_url is None:
                raise InvalidArgument("the learner needs the bus: no NATS url given")
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dirs.tensorboard))
            self.trackers = trackers_of(ctx)
            await w.setup()
            await asyncio.to_thread(self._build)
            p = self.progress
            self.store = WeightStore(
                self.run_name,
                keep=s.keep_versions,
                start_version=next_version(self.dirs.learner, p.updates, p.version),
            )
            self.server.add_service(add_weight_service, WeightServicer(self.store), WEIGHTS_SERVICE)
            self.server.add_service(
                learner_pb2_grpc.add_LearnerServiceServicer_to_server,
                LearnerServicer(self),
                LEARNER_SERVICE,
            )
            await self.server.start()
            if w.serve_before_first_version:
                self.server.set_serving()
            self.bus = await Bus.connect(ctx.nats_url, name=ctx.name)
            await self.bus.ensure_stream(stream_name(self.run_name), [traj_subject(self.run_name)])
            self.handle = RunHandle(
                run_name=self.run_name,
                source=ctx.name,
                progress=p,
                bus=self.bus,
                dirs=self.dirs,
                writer=self.writer,
                tensorboard_step=w.step,
                trackers=self.trackers,
            )
            await asyncio.to_thread(w.warm_start, self.handle)
            await self._publish_weights()
            self.server.set_serving()
            log.info("learner serving on %s, version %d", self.server.address, p.version)
            await w.begin(self.handle)
            self.consumer = TrajectoryConsumer(
                self.bus,
                stream=stream_name(self.run_name),
                durable=w.durable,
                subject=traj_subject(self.run_name),
                message_type=w.message_type,
                batch=w.messages_per_update,
                ack_wait_s=s.ack_wait_s,
                max_ack_pending=s.max_ack_pending,
                stop_event=ctx.stop_event,
                on_invalid=self._on_undecodable,
            )
            self.consumer.start()
            self._started = time.monotonic()
            await self._loop()
        finally:
            await self._shutdown()

    async def _loop(self) -> None:
        s, w, p = self.settings, self.workload, self.progress
        assert self.handle is not None
        while not w.done(p):  # done at once: restarted after the end
            if self.ctx.stop_event.is_set():
                return
            gathering = waiting(
                lambda: f"{w.noun} for update {p.updates + 1}",  # says so on the console
                self._gather(),
                say=bus_say(self.bus, self.run_name, self.ctx.name),
            )
            items = await (self.ranks.while_waiting(gathering) if self.ranks else gathering)
            if items is None:
                return
            if not await self._train(items):
                continue  # skipped (non-finite): nothing published, nothing to save
            await w.after_update(self.handle, self.metrics)
            # The end checkpoints anyway (_finish): no need for a periodic one first.
            if not w.done(p) and p.updates - self.checkpointed_updates >= s.checkpoint_every:
                await self._checkpoint()
        await self._finish()

    # ------------------------------------------------------------------ consuming

    async def _gather(self) -> tuple[list[Any], list[Envelope]] | None:
        """The items of ``messages_per_update`` accepted messages (their deliveries held) and
        the messages' envelopes; drops stale, duplicate, malformed and filtered ones on the way.
        None when stopped."""
        s, w, p = self.settings, self.workload, self.progress
        assert self.consumer is not None
        items: list[Any] = []
        accepted: list[Envelope] = []
        ids: set[str] = set()
        while len(accepted) < w.messages_per_update:
            delivery = await self.consumer.next()
            if delivery is None:
                return None
            envelope = w.envelope(delivery.message)
            self.taken.note(envelope.producer, envelope.sequence)
            verdict = triage(
                envelope.id, envelope.policy_version, p.version, s.max_policy_lag, p.applied, ids
            )
            if verdict == "duplicate":
                p.duplicates_dropped += 1
                self.consumer.hold(delivery)  # acked with the next checkpoint
                continue
            if verdict == "stale":
                await self._drop(envelope, "stale", delivery.ack())
                continue
            try:
                kept, reason = w.accept(await w.decode(delivery.message))
            except InvalidArgument as exc:
                log.warning("dropped %s %s: %s", w.noun, envelope.id, exc)
                await self._drop(envelope, "invalid", delivery.term(), error=str(exc))
                continue
            if reason is not None:
                await self._drop(envelope, "filtered", delivery.ack(), reason=reason)
                continue
            items.extend(kept)
            accepted.append(envelope)
            ids.add(envelope.id)
            self.consumer.hold(delivery)
        return items, accepted

    async def _drop(self, envelope: Envelope, status: str, settle_call: Any, **extra: Any) -> None:
        """Count and ledger a message that will never be applied, then settle it at once."""
        self.progress.count_drop(status)
        fields = {"policy_version": envelope.policy_version, **envelope.fields, **extra}
        self._ledger_drop(envelope.id, status, **fields)
        await settle(settle_call)

    def _ledger_drop(self, message_id: str | None, status: str, **fields: Any) -> None:
        p = self.progress
        self.ledger.write(
            id=message_id, status=status, update=p.updates, version=p.version, **fields
        )

    def _on_undecodable(self, exc: InvalidArgument) -> None:
        """The bus client could not even parse the message (it terminated it)."""
        self.progress.invalid_dropped += 1
        self._ledger_drop(None, "invalid", error=str(exc))
        log.warning("dropped a malformed message: %s", exc)

    # ------------------------------------------------------------------ training

    async def _train(self, gathered: tuple[list[Any], list[Envelope]]) -> bool:
        """One update on the gathered batch, published; False when it was skipped because its
        loss or gradients were not finite (see ``_skip_nonfinite``)."""
        w, p = self.workload, self.progress
        assert self.consumer is not None and self.handle is not None
        items, envelopes = gathered
        trained_at = p.version  # what lags are measured against
        started = time.perf_counter()
        if self.ranks is not None:
            await self.ranks.send_train(items, p, self.generator)
        try:
            metrics = await asyncio.to_thread(w.train, items, p, self.generator)
        except NonfiniteUpdate as exc:
            await self._skip_nonfinite(exc, envelopes)
            return False
        self.nonfinite_in_a_row = 0
        train_s = time.perf_counter() - started
        p.updates += 1
        p.samples += w.samples(items)
        p.messages += len(envelopes)
        for envelope in envelopes:
            p.applied.add(envelope.id)
            self.ledger.write(
                id=envelope.id,
                status="applied",
                update=p.updates,
                version=trained_at,
                policy_version=envelope.policy_version,
                lag=trained_at - envelope.policy_version,
                **envelope.fields,
            )
        self.consumer.applied()
        await self._publish_weights()
        self.last_update_time = now()
        elapsed_s = max(time.monotonic() - self._started, 1e-9)
        metrics.update(w.report(items, metrics, p, elapsed_s))
        metrics["charts/update_s"] = train_s
        metrics["losses/nonfinite_updates"] = float(self.nonfinite_updates)
        # NaN/inf values are kept: metrics.jsonl shows them (null, flagged), TensorBoard skips them.
        self.metrics = {k: float(v) for k, v in metrics.items()}
        await self.handle.report(self.metrics)
        return True

    async def _skip_nonfinite(self, exc: NonfiniteUpdate, envelopes: list[Envelope]) -> None:
        """An update the engine stopped before a NaN/inf step: no weights of it are published,
        its messages are dropped (ledger status "nonfinite", terminated: they would do the same
        again), it is counted and reported; ``max_nonfinite_updates`` in a row fail the run
        (permanently: a restart would train on the same data) in one line naming the data's
        source: the fragments holding NaN/inf when the workload found them, else every
        producer of the batch."""
        assert self.consumer is not None and self.handle is not None
        p, limit = self.progress, self.settings.max_nonfinite_updates
        self.nonfinite_updates += 1
        self.nonfinite_in_a_row += 1
        sources = exc.sources or sorted({e.producer or e.id for e in envelopes})
        for envelope in envelopes:
            fields = {"policy_version": envelope.policy_version, **envelope.fields}
            self._ledger_drop(envelope.id, "nonfinite", **fields, error=str(exc))
        await self.consumer.drop_gathered()
        where = "; ".join(sources[:_SOURCES_SHOWN])
        if len(sources) > _SOURCES_SHOWN:
            where += f"; and {len(sources) - _SOURCES_SHOWN} more"
        log.warning(
            "update %d skipped, not applied (%d in a row, at most %d): %s; data from %s",
            p.updates + 1,
            self.nonfinite_in_a_row,
            limit,
            exc,
            where,
        )
        self.metrics = {**exc.metrics, "losses/nonfinite_updates": float(self.nonfinite_updates)}
        await self.handle.report(self.metrics)
        if self.nonfinite_in_a_row >= limit:
            raise NonfiniteUpdate(
                f"{self.nonfinite_in_a_row} updates in a row stopped before a NaN/inf step "
                f"(max_nonfinite_updates={limit}), none applied; last: {exc}; data from {where}"
            )

    # ------------------------------------------------------------------ checkpoints and the end

    async def _checkpoint(self) -> None:
        """Save, then ack every message the checkpoint covers."""
        assert self.engine is not None
        p = self.progress
        state = {**p.to_state(), **self.workload.state(), "rng": rng_state(self.generator)}
        tag = f"update-{p.updates:08d}"
        if self.ranks is not None:  # DeepSpeed checkpoints are collective
            await self.ranks.send("save", tag, p.updates)
        await asyncio.to_thread(
            self.engine.save,
            self.dirs.checkpoints,
            tag,
            state,
            keep=self.settings.keep_checkpoints,
        )
        if self.ranks is not None:
            await asyncio.to_thread(
                write_digest, self.ranks, self.engine, self.dirs.learner, p.updates
            )
        self.checkpointed_updates = p.updates
        acked = await self.consumer.ack_checkpointed() if self.consumer is not None else 0
        log.info("checkpoint at update %d (%d %s acked)", p.updates, acked, self.workload.noun)

    async def _finish(self) -> None:
        """The workload's last words, ``final/`` (to the trackers too), a last checkpoint,
        RunStatus DONE."""
        w = self.workload
        assert self.handle is not None
        await w.finish(self.handle)
        await asyncio.to_thread(w.save_final, self.dirs.final, self.progress)
        self.trackers.log_final(self.dirs.final)
        await self._checkpoint()
        status = events_pb2.RunStatus(
            run=self.run_name,
            state=events_pb2.RUN_STATE_DONE,
            message=w.summary(self.progress),
            source=self.ctx.name,
            time=now(),
        )
        assert self.bus is not None
        await self.bus.publish_event(events_subject(self.run_name, "status"), status)
        log.info("done: %s", status.message)

    async def _shutdown(self) -> None:
        await _bounded(self.workload.close(), "closing the workload")
        # Stopped between checkpoints: save what was applied so its messages can be acked.
        if self.engine is not None and self.progress.updates > self.checkpointed_updates:
            with contextlib.suppress(Exception):
                await self._checkpoint()
        if self.consumer is not None:  # what was not applied goes back to the stream at once
            await _bounded(self.consumer.close(), "closing the consumer")
        self.ledger.close()
        if self.writer is not None:
            self.writer.close()
        await asyncio.to_thread(self.trackers.close)  # bounded itself (learner.tracking)
        if self.bus is not None:
            await _bounded(self.bus.close(), "closing the bus connection")
        if self.server is not None:
            await _bounded(self.server.stop(), "stopping the gRPC server")
        if self.ranks is not None:
            await _bounded(self.ranks.stop(), "stopping the other ranks")
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------------ status

    def status(self) -> learner_pb2.GetStatusResponse:
        p = self.progress
        response = learner_pb2.GetStatusResponse(
            run=self.run_name,
            policy_version=p.version,
            updates=p.updates,
            samples_consumed=p.samples,
            messages_consumed=p.messages,
            stale_dropped=p.stale_dropped,
            duplicates_dropped=p.duplicates_dropped,
            invalid_dropped=p.invalid_dropped,
            max_policy_lag=self.settings.max_policy_lag,
            metrics=self.metrics,
        )
        if self.last_update_time is not None:
            response.last_update_time.CopyFrom(self.last_update_time)
        return response


async def _bounded(step: Awaitable[Any], what: str, timeout_s: float = SHUTDOWN_STEP_S) -> None:
    """One step of the shutdown, given up (and logged) after ``timeout_s``: a client that
    hangs while closing must not keep a finished learner, and so the whole run, from ending.
    The step is cancelled but not waited for: asyncio.wait_for would wait for the cancellation
    to land, forever when the step swallows it."""
    task = asyncio.ensure_future(step)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        log.error("%s took over %gs: going on without it", what, timeout_s)
        return
    if task.cancelled():
        log.warning("%s was cancelled", what)
        return
    exc = task.exception()
    if isinstance(exc, Exception):
        log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)
    elif exc is not None:
        raise exc
