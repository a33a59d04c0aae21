"""The client's half of the co-located fast path (docs/colocated.md): it owns the ring.

Life of a ring: `ClientRing.create` makes the shared-memory segment and listens on an abstract
Unix socket; the offer goes to the server in a ColocateRequest; once accepted, `attach` takes the
server's connection (checking it is the same user) and unlinks the segment's name at once, so
that from then on nothing is left in /dev/shm whichever side dies: the kernel frees the memory
with the last mapping. Before that point, multiprocessing's resource tracker (a separate process
that outlives a killed client) unlinks the name if the client dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import select
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from google.rpc import status_pb2

from clients.env.shm_ring import (
    DONE,
    MAX_ERROR_BYTES,
    STEP,
    RingLayout,
    SlotViews,
    busy_recv,
    close_quietly,
    host_id,
)
from clients.env.types import EpisodeStats, StepResult
from rlfleet.env.v1 import env_pb2
from services.errors import InvalidArgument, RlfleetError, Unavailable, from_status

__all__ = ["SEGMENT_PREFIX", "ClientRing"]

SEGMENT_PREFIX = "rlfleet-env-"  # /dev/shm names, so a leak would be easy to spot
_PEERCRED = struct.Struct("3i")  # pid, uid, gid (Linux struct ucred)
# Steps answered within their busy-poll or blocking time never let the event loop run: after
# this long without, a step yields to it once, so other tasks (publishing, heartbeats, timers)
# wait at most about this long. A yield is cheap next to a step, so this costs little.
_MAX_BLOCKED_S = 0.002


class ClientRing:
    """A ring of `layout.slots` step buffers shared with one env server session."""

    def __init__(
        self,
        layout: RingLayout,
        shm: shared_memory.SharedMemory,
        listener: Any,
        busy_poll_us: int = 0,
        block_us: int = 0,
    ) -> None:
        self.layout = layout
        # Poll for each answer this long before awaiting it (shm_ring.py): the event loop
        # is blocked meanwhile, as the caller would be waiting for this answer anyway.
        self._poll_s = busy_poll_us / 1e6
        # Then sleep in the kernel for it up to this long, the event loop blocked too (see
        # `step`); what is left is awaited in the event loop.
        self._block_ms = block_us / 1e3
        self._blocker: Any = None  # a select.poll on the doorbell, once attached
        self._last_yield = time.perf_counter()  # when a step last let the event loop run
        self._shm: shared_memory.SharedMemory | None = shm
        self._listener: socket.socket | None = listener
        self._doorbell_name = listener.getsockname()[1:].decode()  # abstract: b"\0name"
        self._conn: socket.socket | None = None
        self._slots: list[SlotViews] = layout.views(shm.buf)
        self._answers = [_AnswerViews.of(slot) for slot in self._slots]
        self._seq = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None  # the doorbell's reader runs on it
        self._waiter: asyncio.Future[bytes] | None = None  # the step awaiting its DONE packet
        self._unclaimed: bytes | None = None  # a packet no step was waiting for

    @classmethod
    def create(cls, layout: RingLayout, busy_poll_us: int = 0, block_us: int = 0) -> ClientRing:
        name = SEGMENT_PREFIX + uuid.uuid4().hex[:16]
        shm = shared_memory.SharedMemory(name=name, create=True, size=layout.total_bytes)
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(b"\0" + name.encode())  # abstract namespace: no file to clean up
            listener.listen(1)
            listener.setblocking(False)
        except BaseException:
            close_quietly(shm)
            shm.unlink()
            raise
        return cls(layout, shm, listener, busy_poll_us, block_us)

    def offer(self) -> env_pb2.ColocateRequest:
        assert self._shm is not None
        return env_pb2.ColocateRequest(
            host_id=host_id() or "",
            segment_name=self._shm.name,
            segment_bytes=self.layout.total_bytes,
            slots=self.layout.slots,
            doorbell=self._doorbell_name,
        )

    def attach(self) -> None:
        """After the server accepted: take its connection (queued before it answered)."""
        assert self._listener is not None and self._shm is not None
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            raise Unavailable(
                "the server accepted the ring but never connected its doorbell"
            ) from None
        pid, uid, _ = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid != os.getuid():
            conn.close()
            raise Unavailable(f"doorbell peer (pid {pid}) runs as uid {uid}, not this user")
        conn.setblocking(False)
        self._conn = conn
        # One reader for the ring's life, not one per step (sock_recv registers and removes
        # the fd each time): a step costs two system calls fewer and no asyncio plumbing.
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(conn.fileno(), self._on_readable)
        if self._block_ms:
            self._blocker = select.poll()
            self._blocker.register(conn.fileno(), select.POLLIN)
        self._listener.close()
        self._listener = None
        self._shm.unlink()  # both sides have it mapped: the name is no longer needed

    async def step(self, actions: Any, timeout_s: float) -> StepResult:
        """One step through the ring; the arrays returned are read-only views of the slot,
        valid until `slots` more steps have been taken."""
        conn, loop = self._conn, self._loop
        if conn is None or loop is None:
            raise Unavailable("the co-located ring is closed")
        if self._unclaimed is not None:  # an earlier step's caller gave up before its answer
            self.close()
            raise Unavailable("the co-located ring is out of step (a step was abandoned)")
        seq = next(self._seq)
        index = seq % self.layout.slots
        slot = self._slots[index]
        _put_actions(slot.actions, actions)
        try:
            # One packet in flight on a fresh socket buffer: a send never blocks here.
            conn.send(STEP.pack(seq, index))
        except OSError as exc:
            self.close()
            raise Unavailable(f"the env server's doorbell failed: {exc}") from None
        # The reader runs only once this task awaits: polling first cannot race it.
        packet = self._poll() if self._poll_s else None
        if packet is None and self._blocker is not None:
            packet = self._block()
        if packet is None:
            packet = await self._answer(loop, timeout_s)
            self._last_yield = time.perf_counter()
        elif time.perf_counter() - self._last_yield > _MAX_BLOCKED_S:
            await asyncio.sleep(0)  # answered without the event loop for a while: let it run
            self._last_yield = time.perf_counter()
        if len(packet) < DONE.size:
            self.close()
            raise Unavailable("the env server closed the co-located ring (it ended or restarted)")
        got_seq, _, episodes, has_final, error_bytes = DONE.unpack_from(packet)
        if got_seq != seq:
            self.close()
            raise Unavailable(f"doorbell answered step {got_seq}, expected {seq}")
        if error_bytes:
            raise _error(packet[DONE.size : DONE.size + error_bytes])
        return self._answers[index].result(slot, episodes, bool(has_final))

    def _poll(self) -> bytes | None:
        """The answer if it comes within the busy-poll time (b"" once the ring is closed)."""
        assert self._conn is not None
        try:
            packet = busy_recv(self._conn, DONE.size + MAX_ERROR_BYTES, self._poll_s)
        except OSError:
            return b""
        return self._seen(packet)

    def _block(self) -> bytes | None:
        """The answer if it comes within the blocking time (b"" once the ring is closed),
        waited for in the kernel rather than in the event loop: a lock-step caller has nothing
        else to do meanwhile, and the event loop's round (epoll, the reader, a future, the
        task's wake-up) is a cost on every step (docs/colocated.md)."""
        assert self._conn is not None
        try:
            if not self._blocker.poll(self._block_ms):
                return None
            packet = self._conn.recv(DONE.size + MAX_ERROR_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            packet = b""
        return self._seen(packet)

    def _seen(self, packet: bytes | None) -> bytes | None:
        """A packet read outside the event loop; at end of file (b"") the loop stops watching
        the doorbell, which would otherwise stay readable."""
        if packet == b"" and self._loop is not None and self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
        return packet

    async def _answer(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> bytes:
        """The packet the doorbell's reader hands over next, within `timeout_s`."""
        waiter: asyncio.Future[bytes] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            return await waiter
        except TimeoutError:
            self.close()
            raise Unavailable(f"no co-located step answer within {timeout_s:g}s") from None
        finally:
            timer.cancel()
            if self._waiter is waiter:
                self._waiter = None

    def _on_readable(self) -> None:
        """The doorbell's reader: hand the packet to the waiting step (b"" when closed)."""
        conn = self._conn
        if conn is None:
            return
        try:
            packet = conn.recv(DONE.size + MAX_ERROR_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            packet = b""
        if not packet and self._loop is not None:  # EOF stays readable: stop watching
            self._loop.remove_reader(conn.fileno())
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(packet)
        elif packet:
            self._unclaimed = packet

    def close(self) -> None:
        """Idempotent: the server sees the doorbell close and detaches its side."""
        if self._conn is not None and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):  # e.g. from another thread once the loop ended
                self._loop.remove_reader(self._conn.fileno())
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(b"")  # a step still waiting learns the ring is closed
        for sock in (self._conn, self._listener):
            if sock is not None:
                sock.close()
        self._conn = self._listener = None
        self._blocker = None
        shm, self._shm = self._shm, None
        self._slots = []
        if shm is not None:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()  # declined or never attached: the name is still there
            close_quietly(shm)


def _put_actions(out: np.ndarray, actions: Any) -> None:
    """Copy the actions into the slot, with the checks a StepRequest's decoding would make
    (exact shape, a dtype of the same kind): a silent cast would step with other actions."""
    array = np.asarray(actions)
    if array.shape != out.shape:
        raise InvalidArgument(
            f"actions have shape {list(array.shape)}, expected {list(out.shape)}", field="actions"
        )
    if not np.can_cast(array.dtype, out.dtype, "same_kind"):
        raise InvalidArgument(
            f"actions have dtype {array.dtype}, expected {out.dtype}", field="actions"
        )
    out[...] = array


def _expire(waiter: asyncio.Future[bytes]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class _AnswerViews:
    """Read-only views of one slot's answer arrays, made once per ring rather than per step."""

    observations: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_observations: np.ndarray

    @classmethod
    def of(cls, slot: SlotViews) -> _AnswerViews:
        return cls(
            observations=_readonly(slot.observations),
            rewards=_readonly(slot.rewards),
            terminated=_readonly(slot.terminated),
            truncated=_readonly(slot.truncated),
            final_observations=_readonly(slot.final_observations),
        )

    def result(self, slot: SlotViews, episodes: int, has_final: bool) -> StepResult:
        return StepResult(
            observations=self.observations,
            rewards=self.rewards,
            terminated=self.terminated,
            truncated=self.truncated,
            infos={},  # not carried by the ring (docs/colocated.md)
            final_observations=self.final_observations if has_final else None,
            episodes=[
                EpisodeStats(
                    int(slot.episode_index[k]),
                    float(slot.episode_return[k]),
                    int(slot.episode_length[k]),
                    bool(slot.episode_truncated[k]),
                    _score(float(slot.episode_score[k])),
                )
                for k in range(episodes)
            ],
        )


def _score(value: float) -> float | None:
    """A ring row's episode score: NaN is the server's "the env reported none"."""
    return None if np.isnan(value) else value


def _error(payload: bytes) -> RlfleetError:
    status = status_pb2.Status()
    try:
        status.ParseFromString(payload)
    except Exception:
        return Unavailable("the env server sent an unreadable error for a co-located step")
    return from_status(status)
