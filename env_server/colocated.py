"""The server's half of the co-located fast path (docs/colocated.md): steps through a ring the
client made, one doorbell packet each way per step, instead of StepRequest messages.

A doorbell is handled in an event-loop reader callback, stepping inline as the gRPC path does
(env_server/servicer.py says why), so a pool is never stepped by two requests at once. The pool
stacks its observations straight into the slot. Whatever goes wrong on the doorbell (the client
died mid-step, sent a malformed packet, closed the socket) ends the ring only, never the server;
a step's own errors (bad actions) are answered in-band like a StepResponse's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import socket
import time
from collections.abc import Callable

from common import spaces
from env_server.client.shm_ring import (
    DONE,
    MAX_ERROR_BYTES,
    MAX_SLOTS,
    STEP,
    SlotViews,
    Unsupported,
    close_quietly,
    host_id,
    layout_for,
)
from env_server.pool import EnvPool
from rlfleet.env.v1 import env_pb2
from services.errors import InvalidArgument, ResourceExhausted, RlfleetError, to_status

__all__ = ["Declined", "RingPoller", "ServerRing"]

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"  # where POSIX shm_open names live on Linux (multiprocessing.shared_memory)


class Declined(Exception):
    """The offer cannot be used here (another host or namespace, spaces); not the client's
    fault: the session goes on over gRPC."""


class RingPoller:
    """Busy polling of one server's rings (env_server/client/shm_ring.py): after a ring's step
    is answered, every ring's doorbell is polled until `busy_poll_us` passes with no packet, so
    a client that answers fast (or another session's half of a double-buffered actor) finds
    this server awake. Back to the event loop after `_MAX_POLL_S` at the latest, so gRPC
    requests and timers are served however busy the rings are."""

    _MAX_POLL_S = 0.01

    def __init__(self, busy_poll_us: int) -> None:
        self.poll_s = busy_poll_us / 1e6
        self.rings: set[ServerRing] = set()

    def poll(self) -> None:
        started = last_answer = time.perf_counter()
        while (now := time.perf_counter()) - last_answer < self.poll_s:
            if now - started > self._MAX_POLL_S:
                return
            for ring in list(self.rings):
                if ring.answer_waiting():
                    last_answer = time.perf_counter()


class ServerRing:
    """One session's attached ring and doorbell connection."""

    def __init__(
        self,
        pool: EnvPool,
        request: env_pb2.ColocateRequest,
        *,
        max_bytes: int,
        on_steps: Callable[[int], None],
        on_close: Callable[[], None],
        poller: RingPoller | None = None,
    ) -> None:
        """Check the offer, attach the segment and connect the doorbell; Declined when this
        server cannot, InvalidArgument/ResourceExhausted when the offer is wrong. With a
        `poller`, answers are followed by busy polling of the server's rings."""
        if not request.segment_name or not request.doorbell:
            raise InvalidArgument("colocate: segment_name and doorbell must be set")
        if not 1 <= request.slots <= MAX_SLOTS:
            raise InvalidArgument(
                f"colocate: slots must be 1 to {MAX_SLOTS}, got {request.slots}",
                field="colocate.slots",
            )
        own = host_id()
        if own is None or request.host_id != own:
            raise Declined(f"the client is on another host ({request.host_id or 'unknown'})")
        try:
            layout = layout_for(
                pool.observation_space,
                pool.action_space,
                pool.num_envs,
                request.slots,
                float64_rewards=pool.float64_rewards,
            )
        except Unsupported as exc:
            raise Declined(str(exc)) from None
        if request.segment_bytes != layout.total_bytes:
            raise InvalidArgument(
                f"colocate: segment_bytes {request.segment_bytes} is not this pool's ring "
                f"({layout.total_bytes} bytes for {request.slots} slots)",
                field="colocate.segment_bytes",
            )
        if layout.total_bytes > max_bytes:
            raise ResourceExhausted(
                f"colocate: a ring of {layout.total_bytes} bytes is over this server's "
                f"colocated_max_bytes={max_bytes}",
                field="colocate.segment_bytes",
            )
        self.pool = pool
        self.on_steps = on_steps
        self._poller = poller
        self._on_close: Callable[[], None] | None = None  # set once attached and connected
        self.last_used = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._shm = _attach(request.segment_name, layout.total_bytes)
        self._slots: list[SlotViews] = layout.views(self._shm)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(b"\0" + request.doorbell.encode())
        except OSError as exc:
            self.close()
            raise Declined(
                f"cannot reach the client's doorbell ({exc}): another network namespace"
            ) from None
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._on_doorbell)
        self._on_close = on_close
        if poller is not None:
            poller.rings.add(self)

    @property
    def open(self) -> bool:
        return self._sock.fileno() >= 0

    def _on_doorbell(self) -> None:
        """The doorbell's reader: answer the step it rings for, then let the poller go on."""
        if self.answer_waiting() and self._poller is not None:
            self._poller.poll()

    def answer_waiting(self) -> bool:
        """Answer the doorbell's next packet if one is there; True when a step was answered."""
        try:
            packet = self._sock.recv(STEP.size + 1)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            packet = b""
        if not packet:  # the client closed the ring, or died
            self.close()
            return False
        self.last_used = time.monotonic()
        reply = self._answer(packet)
        try:
            self._sock.send(reply)
        except OSError as exc:  # gone while we stepped; a full buffer cannot happen in order
            log.info("co-located client left mid-step (%s): ring closed", exc)
            self.close()
            return False
        return True

    def _answer(self, packet: bytes) -> bytes:
        seq, slot_index = 0, 0
        try:
            if len(packet) != STEP.size:
                raise InvalidArgument(f"doorbell packet of {len(packet)} bytes, not {STEP.size}")
            seq, slot_index = STEP.unpack(packet)
            if slot_index >= len(self._slots):
                raise InvalidArgument(f"doorbell slot {slot_index} not in [0, {len(self._slots)})")
            return self._step(seq, slot_index, self._slots[slot_index])
        except Exception as exc:
            if not isinstance(exc, RlfleetError):
                log.exception("co-located step %d failed", seq)
            error = to_status(exc).SerializeToString()[:MAX_ERROR_BYTES]
            return DONE.pack(seq, slot_index, 0, 0, len(error)) + error

    def _step(self, seq: int, slot_index: int, slot: SlotViews) -> bytes:
        pool = self.pool
        actions = spaces.validate_actions(pool.action_space, slot.actions, pool.num_envs)
        before = pool.total_steps
        result = pool.step(actions, observations_out=slot.observations)
        self.on_steps(pool.total_steps - before)
        slot.rewards[:] = result.rewards
        slot.terminated[:] = result.terminated
        slot.truncated[:] = result.truncated
        has_final = result.final_observations is not None
        if has_final:
            slot.final_observations[:] = result.final_observations
        for k, ep in enumerate(result.episodes):
            slot.episode_index[k] = ep.env_index
            slot.episode_return[k] = ep.episode_return
            slot.episode_length[k] = ep.length
            slot.episode_truncated[k] = ep.truncated
        return DONE.pack(seq, slot_index, len(result.episodes), has_final, 0)

    def close(self) -> None:
        """Idempotent; the client sees its doorbell close (and reconnects over gRPC)."""
        if self._sock.fileno() >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self._slots = []
        if self._poller is not None:
            self._poller.rings.discard(self)
        close_quietly(self._shm)
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


def _attach(name: str, size: int) -> mmap.mmap:
    """Map the client's segment; Declined when this server cannot see it (another IPC
    namespace or /dev/shm) or it is smaller than the ring.

    Mapped from its /dev/shm file rather than through SharedMemory: before Python 3.13,
    attaching a SharedMemory registers the name with this process's resource tracker, which
    would start one more process here and unlink the client's segment when the server exits.
    """
    if "/" in name or name.startswith("."):
        raise InvalidArgument(
            f"colocate: {name!r} is not a segment name", field="colocate.segment_name"
        )
    try:
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
    except (FileNotFoundError, PermissionError) as exc:
        raise Declined(f"cannot open the shared-memory segment {name!r}: {exc}") from None
    try:
        found = os.fstat(fd).st_size
        if found < size:
            raise InvalidArgument(
                f"colocate: segment {name!r} has {found} bytes, the ring needs {size}",
                field="colocate.segment_name",
            )
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
