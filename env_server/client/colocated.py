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
import socket
import struct
import uuid
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from google.rpc import status_pb2

from env_server.client.shm_ring import (
    DONE,
    STEP,
    RingLayout,
    SlotViews,
    close_quietly,
    host_id,
)
from env_server.client.types import EpisodeStats, StepResult
from rlfleet.env.v1 import env_pb2
from services.errors import InvalidArgument, RlfleetError, Unavailable, from_status

__all__ = ["SEGMENT_PREFIX", "ClientRing"]

SEGMENT_PREFIX = "rlfleet-env-"  # /dev/shm names, so a leak would be easy to spot
_PEERCRED = struct.Struct("3i")  # pid, uid, gid (Linux struct ucred)


class ClientRing:
    """A ring of `layout.slots` step buffers shared with one env server session."""

    def __init__(self, layout: RingLayout, shm: shared_memory.SharedMemory, listener: Any) -> None:
        self.layout = layout
        self._shm: shared_memory.SharedMemory | None = shm
        self._listener: socket.socket | None = listener
        self._doorbell_name = listener.getsockname()[1:].decode()  # abstract: b"\0name"
        self._conn: socket.socket | None = None
        self._slots: list[SlotViews] = layout.views(shm.buf)
        self._seq = itertools.count(1)

    @classmethod
    def create(cls, layout: RingLayout) -> ClientRing:
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
        return cls(layout, shm, listener)

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
        self._listener.close()
        self._listener = None
        self._shm.unlink()  # both sides have it mapped: the name is no longer needed

    async def step(self, actions: Any, timeout_s: float) -> StepResult:
        """One step through the ring; the arrays returned are read-only views of the slot,
        valid until `slots` more steps have been taken."""
        conn = self._conn
        if conn is None:
            raise Unavailable("the co-located ring is closed")
        seq = next(self._seq)
        slot = self._slots[seq % self.layout.slots]
        _put_actions(slot.actions, actions)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                await loop.sock_sendall(conn, STEP.pack(seq, seq % self.layout.slots))
                packet = await loop.sock_recv(conn, DONE.size + (64 << 10))
        except TimeoutError:
            self.close()
            raise Unavailable(f"no co-located step answer within {timeout_s:g}s") from None
        except OSError as exc:
            self.close()
            raise Unavailable(f"the env server's doorbell failed: {exc}") from None
        if len(packet) < DONE.size:
            self.close()
            raise Unavailable("the env server closed the co-located ring (it ended or restarted)")
        got_seq, _, episodes, has_final, error_bytes = DONE.unpack_from(packet)
        if got_seq != seq:
            self.close()
            raise Unavailable(f"doorbell answered step {got_seq}, expected {seq}")
        if error_bytes:
            raise _error(packet[DONE.size : DONE.size + error_bytes])
        return _result(slot, episodes, bool(has_final))

    def close(self) -> None:
        """Idempotent: the server sees the doorbell close and detaches its side."""
        for sock in (self._conn, self._listener):
            if sock is not None:
                sock.close()
        self._conn = self._listener = None
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


def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _result(slot: SlotViews, episodes: int, has_final: bool) -> StepResult:
    return StepResult(
        observations=_readonly(slot.observations),
        rewards=_readonly(slot.rewards),
        terminated=_readonly(slot.terminated),
        truncated=_readonly(slot.truncated),
        infos={},  # not carried by the ring (docs/colocated.md)
        final_observations=_readonly(slot.final_observations) if has_final else None,
        episodes=[
            EpisodeStats(
                int(slot.episode_index[k]),
                float(slot.episode_return[k]),
                int(slot.episode_length[k]),
                bool(slot.episode_truncated[k]),
            )
            for k in range(episodes)
        ],
    )


def _error(payload: bytes) -> RlfleetError:
    status = status_pb2.Status()
    try:
        status.ParseFromString(payload)
    except Exception:
        return Unavailable("the env server sent an unreadable error for a co-located step")
    return from_status(status)
