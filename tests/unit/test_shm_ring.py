"""The co-located ring's layout and views (clients/env/shm_ring.py), the client ring's
checks that need no server (clients/env/colocated.py) and the server's ring thread
(env_server/colocated.py's RingServer) over socket pairs."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
from gymnasium import spaces

from clients.env.colocated import SEGMENT_PREFIX, ClientRing, _put_actions
from clients.env.shm_ring import MAX_SLOTS, Unsupported, busy_recv, host_id, layout_for
from env_server.colocated import RingServer
from services.errors import InvalidArgument

BOX = spaces.Box(-1.0, 1.0, (3, 2), np.float32)


def test_layout_aligns_every_array_and_sizes_the_slots() -> None:
    layout = layout_for(BOX, spaces.Discrete(4), 5, 3)
    assert layout.total_bytes == 3 * layout.slot_bytes
    assert all(f.offset % 64 == 0 for f in layout.fields)
    shapes = {f.name: (f.shape, f.dtype) for f in layout.fields}
    assert shapes["actions"] == ((5,), np.dtype(np.int64))
    assert shapes["observations"] == ((5, 3, 2), np.dtype(np.float32))
    assert shapes["rewards"] == ((5,), np.dtype(np.float32))
    wide = layout_for(BOX, spaces.Discrete(4), 5, 3, float64_rewards=True)
    assert dict((f.name, f.dtype) for f in wide.fields)["rewards"] == np.dtype(np.float64)


def test_slots_are_disjoint_views_of_one_buffer() -> None:
    layout = layout_for(BOX, spaces.MultiDiscrete([2, 3]), 4, 2)
    buffer = bytearray(layout.total_bytes)
    first, second = layout.views(memoryview(buffer))
    first.observations[:] = 1.5
    first.actions[:] = 1
    second.terminated[:] = True
    assert not second.observations.any() and not second.actions.any()
    assert not first.terminated.any()
    again = layout.views(memoryview(buffer))[0]  # what the other side sees: the same bytes
    np.testing.assert_array_equal(again.observations, 1.5)
    assert again.actions.shape == (4, 2)


@pytest.mark.parametrize(
    ("obs", "act"),
    [
        (spaces.Dict({"a": BOX}), spaces.Discrete(2)),
        (spaces.Discrete(3), spaces.Discrete(2)),
        (BOX, spaces.Tuple((spaces.Discrete(2), spaces.Discrete(2)))),
        (BOX, spaces.Text(5)),
    ],
)
def test_spaces_the_ring_cannot_hold_are_unsupported(obs: spaces.Space, act: spaces.Space) -> None:
    with pytest.raises(Unsupported):
        layout_for(obs, act, 2, 2)


@pytest.mark.parametrize("slots", [0, MAX_SLOTS + 1])
def test_slot_count_is_bounded(slots: int) -> None:
    with pytest.raises(ValueError, match="slots"):
        layout_for(BOX, spaces.Discrete(2), 2, slots)


def test_host_id_is_boot_id_and_hostname() -> None:
    ident = host_id()
    assert ident is not None and ident.count("/") == 1 and ident == host_id()


def test_actions_are_checked_before_they_reach_the_slot() -> None:
    out = np.zeros(4, np.int64)
    _put_actions(out, np.array([1, 0, 1, 1], np.int32))  # same kind: cast, as gRPC does
    np.testing.assert_array_equal(out, [1, 0, 1, 1])
    with pytest.raises(InvalidArgument, match="shape"):
        _put_actions(out, np.zeros(3, np.int64))
    with pytest.raises(InvalidArgument, match="dtype"):
        _put_actions(out, np.zeros(4, np.float32))


def test_a_ring_never_accepted_leaves_nothing_in_dev_shm() -> None:
    ring = ClientRing.create(layout_for(BOX, spaces.Discrete(2), 8, 2))
    offer = ring.offer()
    assert offer.segment_name.startswith(SEGMENT_PREFIX)
    assert offer.segment_bytes == ring.layout.total_bytes and offer.slots == 2
    path = os.path.join("/dev/shm", offer.segment_name)
    assert os.path.exists(path)
    ring.close()
    ring.close()  # idempotent
    assert not os.path.exists(path)


def test_busy_recv_polls_for_a_packet_then_gives_up() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        a.setblocking(False)
        started = time.perf_counter()
        assert busy_recv(a, 64, 0.02) is None  # nothing came: it polled the whole time
        assert time.perf_counter() - started >= 0.02
        sender = threading.Timer(0.01, b.send, (b"ding",))
        sender.start()
        assert busy_recv(a, 64, 5.0) == b"ding"  # a packet mid-poll ends the poll at once
        sender.join()
        b.send(b"first")
        b.send(b"second")
        assert busy_recv(a, 64, 0) == b"first"  # no poll time: one read, packets kept apart
        b.close()
        assert busy_recv(a, 64, 0) == b"second"
        assert busy_recv(a, 64, 1.0) == b""  # the peer closed: end of file, not a timeout


class _EchoRing:
    """What RingServer drives: a doorbell fd, answer_waiting, open, close and release."""

    def __init__(self, fail: bool = False) -> None:
        self.client, self.server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.fileno = self.server.fileno()
        self.fail, self.open, self.released = fail, True, threading.Event()

    def answer_waiting(self) -> bool:
        if self.fail:
            raise RuntimeError("a bug in a ring")
        packet = self.server.recv(64, socket.MSG_DONTWAIT)
        if not packet:
            self.open = False
            return False
        self.server.send(packet)
        return True

    def close(self) -> None:
        self.open = False

    def release(self) -> None:
        self.server.close()
        self.released.set()


def test_the_ring_server_serves_every_ring_from_one_thread_and_survives_a_failing_one() -> None:
    server = RingServer()
    rings = [_EchoRing(), _EchoRing(fail=True), _EchoRing()]
    for ring in rings:
        server.add(ring)  # type: ignore[arg-type]
    rings[0].client.send(b"a")
    rings[1].client.send(b"b")  # its answer_waiting raises: that ring is closed and let go
    rings[2].client.send(b"c")
    for ring, packet in ((rings[0], b"a"), (rings[2], b"c")):
        ring.client.settimeout(10)
        assert ring.client.recv(64) == packet
    assert rings[1].released.wait(10)
    rings[0].client.close()  # end of file: the ring server lets it go
    assert rings[0].released.wait(10)
    rings[2].client.send(b"d")
    assert rings[2].client.recv(64) == b"d"
    rings[2].client.close()
    assert rings[2].released.wait(10)
    for _ in range(200):  # with the last ring gone, its thread ends
        if server._thread is None:
            break
        time.sleep(0.01)
    assert server._thread is None
