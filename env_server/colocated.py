"""The server's half of the co-located fast path (docs/colocated.md): steps through a ring the
client made, one doorbell packet each way per step, instead of StepRequest messages.

The rings of a server are served by one thread of their own, which sleeps in `epoll` on their
doorbells and steps a pool when a packet comes, rather than by event-loop readers: a ring step
then never waits behind the loop's other work. One thread for all rings, not one each: two
threads serving a double-buffered actor's two rings would hand the GIL back and forth across
CPUs at every step. A session's pool lock keeps the thread and the session's gRPC requests
(reset, render) from using the pool at once. The pool stacks its observations straight into the
slot.
Whatever goes wrong on the doorbell (the client died mid-step, sent a malformed packet, closed
the socket) ends the ring only, never the server; a step's own errors (bad actions) are
answered in-band like a StepResponse's.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from clients.env.shm_ring import (
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
from common import spaces
from env_server.pool import EnvPool
from rlfleet.env.v1 import env_pb2
from services.errors import InvalidArgument, ResourceExhausted, RlfleetError, to_status

__all__ = ["Declined", "RingServer", "ServerRing"]

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"  # where POSIX shm_open names live on Linux (multiprocessing.shared_memory)


class Declined(Exception):
    """The offer cannot be used here (another host or namespace, spaces); not the client's
    fault: the session goes on over gRPC."""


class RingServer:
    """The thread that serves every ring of one env server: it sleeps in `epoll` on their
    doorbells and answers each packet in turn. With `busy_poll_us`, after an answer it polls
    every doorbell until that long passes with no packet, so a client that answers fast (or
    another session's half of a double-buffered actor) finds it awake. The thread starts with
    the first ring and ends with the last."""

    def __init__(self, busy_poll_us: int = 0) -> None:
        self.poll_s = busy_poll_us / 1e6
        self._epoll = select.epoll()
        self._rings: dict[int, ServerRing] = {}  # by doorbell fd
        self._lock = threading.Lock()  # the rings and the thread's start and end
        self._thread: threading.Thread | None = None

    def add(self, ring: ServerRing) -> None:
        with self._lock:
            self._rings[ring.fileno] = ring
            self._epoll.register(ring.fileno, select.EPOLLIN)
            if self._thread is None:
                # Daemon: a server stopping with rings attached ends with them.
                self._thread = threading.Thread(target=self._serve, name="rings", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            for fd, _ in self._epoll.poll():
                self._answer(fd)
            if self.poll_s:
                self._busy_poll()
            with self._lock:
                if not self._rings:
                    self._thread = None
                    return

    def _busy_poll(self) -> None:
        last_answer = time.perf_counter()
        while time.perf_counter() - last_answer < self.poll_s:
            for fd, _ in self._epoll.poll(0):
                if self._answer(fd):
                    last_answer = time.perf_counter()

    def _answer(self, fd: int) -> bool:
        """Answer the ring's waiting packet, if any; let it go once it is closed. A ring that
        fails here (a bug: steps answer their own errors) is closed, the others served on."""
        ring = self._rings.get(fd)
        if ring is None:
            return False
        try:
            answered = ring.answer_waiting()
        except Exception:
            log.exception("co-located ring failed: closed")
            ring.close()
            answered = False
        if not ring.open:
            with self._lock:
                self._epoll.unregister(fd)  # before its socket closes: fds are reused
                del self._rings[fd]
            ring.release()
        return answered


class ServerRing:
    """One session's attached ring and doorbell connection, served by a RingServer."""

    def __init__(
        self,
        pool: EnvPool,
        request: env_pb2.ColocateRequest,
        *,
        pool_lock: threading.Lock,
        server: RingServer,
        max_bytes: int,
        on_steps: Callable[[int], None],
        on_close: Callable[[], None],
    ) -> None:
        """Check the offer, attach the segment, connect the doorbell and hand it to `server`;
        Declined when this server cannot, InvalidArgument/ResourceExhausted when the offer is
        wrong. `pool_lock` is held while a step uses the pool."""
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
        self._pool_lock = pool_lock
        self._on_close: Callable[[], None] | None = None  # set once attached and connected
        self._closing = False
        self.last_used = time.monotonic()
        self._shm = _attach(request.segment_name, layout.total_bytes)
        self._slots: list[SlotViews] = layout.views(self._shm)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(b"\0" + request.doorbell.encode())
        except OSError as exc:
            self.release()
            raise Declined(
                f"cannot reach the client's doorbell ({exc}): another network namespace"
            ) from None
        self._on_close = on_close
        self.fileno = self._sock.fileno()
        server.add(self)

    @property
    def open(self) -> bool:
        return not self._closing

    def answer_waiting(self) -> bool:
        """Answer the doorbell's next packet if one is there; True when a step was answered.
        Marks the ring closed when the client closed it or died, or `close` was called."""
        if self._closing:
            return False
        try:
            packet = self._sock.recv(STEP.size + 1, socket.MSG_DONTWAIT)  # +1: longer shows
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            packet = b""
        if not packet:  # the client closed the ring, or died
            self._closing = True
            return False
        self.last_used = time.monotonic()
        with self._pool_lock:
            reply = self._answer(packet)
        try:
            self._sock.send(reply)
        except OSError as exc:  # gone while we stepped; a full buffer cannot happen in order
            if not self._closing:
                log.info("co-located client left mid-step (%s): ring closed", exc)
            self._closing = True
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
            slot.episode_score[k] = float("nan") if ep.score is None else ep.score  # NaN: no score
        return DONE.pack(seq, slot_index, len(result.episodes), has_final, 0)

    def close(self) -> None:
        """Idempotent, from any thread: the ring server's thread wakes, finishes the step it
        may be taking and lets go of the ring; the client sees its doorbell close (and goes on
        over gRPC). Once it returns no new step starts, but one under way may still hold the
        pool lock: take the lock before closing the pool."""
        self._closing = True
        with contextlib.suppress(OSError):  # a blocked recv returns at once (close would not)
            self._sock.shutdown(socket.SHUT_RDWR)

    def release(self) -> None:
        """The ring server's (or a failed start's) last act: the socket, the mapping, on_close."""
        self._sock.close()
        self._slots = []
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
