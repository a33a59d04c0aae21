"""The co-located fast path's shared pieces: the ring layout, its numpy views, the doorbell
packets and the host identity. Both sides compute the layout from the same inputs (the pool's
spaces, N, the slot count, the reward dtype), so the segment carries data only, no header.

One slot holds one step, at offsets aligned to 64 bytes (a cache line):
``actions [N, *act]``, ``observations [N, *obs]``, ``final_observations [N, *obs]``,
``rewards [N]`` (float32, or float64), ``terminated [N]``, ``truncated [N]``, and the ended
episodes ``episode_index [N] u4``, ``episode_return [N] f8``, ``episode_length [N] i8``,
``episode_truncated [N]``, ``episode_score [N] f8`` (NaN: the env reported no score) (the first
`count` rows, `count` in the reply packet).

Doorbells (SOCK_SEQPACKET, so one send is one packet): the client sends ``STEP`` =
(sequence, slot); the server answers ``DONE`` = (sequence, slot, episodes, has_final, error
bytes) followed by that many bytes of a serialized google.rpc.Status when the step failed.

Busy polling (`busy_poll_us`, off by default): a side that expects the next packet soon polls the
doorbell with non-blocking reads for up to that long before it goes back to sleeping in the
event loop. Waking a sleeping process costs each side a scheduler wake-up, a sizeable part of a
cheap step; a peer that is already running needs none. It trades a core's idle time for
latency: use it only where cores are spare.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DONE",
    "MAX_ERROR_BYTES",
    "MAX_SLOTS",
    "STEP",
    "RingLayout",
    "SlotViews",
    "Unsupported",
    "busy_recv",
    "close_quietly",
    "host_id",
    "layout_for",
]

STEP = struct.Struct("<QI")  # sequence, slot
DONE = struct.Struct("<QIIII")  # sequence, slot, episodes ended, final obs present, error bytes
MAX_SLOTS = 8
MAX_ERROR_BYTES = 16 << 10  # a Status larger than this is cut (its message is for humans)
_ALIGN = 64
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class Unsupported(Exception):
    """The pool's spaces (or the platform) cannot use the ring; the message says why."""


def host_id() -> str | None:
    """ "<boot id>/<hostname>": equal only for two processes of one running kernel on one host
    (a hostname alone repeats across machines, a boot id across containers). None off Linux."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return f"{boot}/{socket.gethostname()}" if boot else None


@dataclass(frozen=True)
class _Field:
    name: str
    offset: int  # within a slot
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


@dataclass(frozen=True)
class RingLayout:
    """Where each array of each slot lives in the segment."""

    num_envs: int
    slots: int
    slot_bytes: int
    fields: tuple[_Field, ...]

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def views(self, buffer: Any) -> list[SlotViews]:
        """Numpy views of every slot over `buffer` (the segment's memoryview): no copies."""
        out = []
        for k in range(self.slots):
            base = k * self.slot_bytes
            arrays = {
                f.name: np.ndarray(f.shape, f.dtype, buffer=buffer, offset=base + f.offset)
                for f in self.fields
            }
            out.append(SlotViews(**arrays))
        return out


@dataclass
class SlotViews:
    """One slot's arrays (views into shared memory)."""

    actions: np.ndarray
    observations: np.ndarray
    final_observations: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    episode_index: np.ndarray
    episode_return: np.ndarray
    episode_length: np.ndarray
    episode_truncated: np.ndarray
    episode_score: np.ndarray


def layout_for(
    observation_space: Any,
    action_space: Any,
    num_envs: int,
    slots: int,
    *,
    float64_rewards: bool = False,
) -> RingLayout:
    """The ring for a pool of `num_envs` envs with these (single-env) spaces.

    Raises Unsupported for spaces that are not one fixed-size numeric array each (Dict, Tuple,
    Text, Graph...): those go over gRPC, whose tensor trees carry any space.
    """
    from gymnasium import spaces

    if not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be 1 to {MAX_SLOTS}, got {slots}")
    if not isinstance(observation_space, spaces.Box):
        raise Unsupported(f"observation space {observation_space} is not a Box")
    fixed = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
    if not isinstance(action_space, fixed):
        raise Unsupported(f"action space {action_space} is not one fixed-size array")
    n = num_envs
    act_shape: tuple[int, ...] = tuple(action_space.shape or ())
    obs_shape, obs_dtype = tuple(observation_space.shape), np.dtype(observation_space.dtype)
    columns = [
        ("actions", (n, *act_shape), np.dtype(action_space.dtype)),
        ("observations", (n, *obs_shape), obs_dtype),
        ("final_observations", (n, *obs_shape), obs_dtype),
        ("rewards", (n,), np.dtype(np.float64 if float64_rewards else np.float32)),
        ("terminated", (n,), np.dtype(bool)),
        ("truncated", (n,), np.dtype(bool)),
        ("episode_index", (n,), np.dtype(np.uint32)),
        ("episode_return", (n,), np.dtype(np.float64)),
        ("episode_length", (n,), np.dtype(np.int64)),
        ("episode_truncated", (n,), np.dtype(bool)),
        ("episode_score", (n,), np.dtype(np.float64)),
    ]
    fields, offset = [], 0
    for name, shape, dtype in columns:
        fields.append(_Field(name, offset, shape, dtype))
        offset += _aligned(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return RingLayout(n, slots, offset, tuple(fields))


def busy_recv(sock: socket.socket, size: int, poll_s: float) -> bytes | None:
    """The next packet of `sock`, polling for up to `poll_s` without sleeping (non-blocking
    reads, whatever the socket's mode); None when none came (b"" at end of file). OSError as
    `recv` raises it."""
    deadline = time.perf_counter() + poll_s
    while True:
        try:
            return sock.recv(size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            if time.perf_counter() >= deadline:
                return None


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def close_quietly(shm: Any) -> None:
    """Unmap a SharedMemory (or an mmap). While a caller still holds a view of it, unmapping
    is impossible (BufferError): the mapping then goes with the last view, which is fine as the
    name is already unlinked and nothing is left in /dev/shm."""
    with contextlib.suppress(BufferError, OSError):
        shm.close()
