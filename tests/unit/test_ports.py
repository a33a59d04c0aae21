"""Ports picked for a run's services: free, distinct, and outside the kernel's ephemeral range,
where anything binding port 0 meanwhile (and every outgoing connection's local end) lands."""

import socket

from services import ports
from services.ports import _random_port_outside, ephemeral_range, free_port, free_ports


def test_ports_are_free_distinct_and_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    picked = free_ports(64)
    assert len(set(picked)) == 64
    for port in picked:
        assert port >= 10000 and not low <= port <= high, port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: nothing holds it after the pick


def test_a_port_in_use_is_never_picked(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        tries = iter([taken, taken])
        monkeypatch.setattr(ports, "_random_port_outside", lambda low, high: next(tries, 0))
        assert free_port() != taken


def test_the_kernel_picks_when_the_range_leaves_no_port(monkeypatch):
    assert _random_port_outside(1024, 65535) == 0
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    assert len(set(free_ports(3))) == 3


def test_the_range_is_linux_setting_or_the_iana_one(monkeypatch, tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("20000\t30000\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", setting)
    assert ephemeral_range() == (20000, 30000)
    assert all(not 20000 <= _random_port_outside(20000, 30000) <= 30000 for _ in range(1000))
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ephemeral_range() == (49152, 65535)


def test_a_port_picked_lately_is_not_picked_again(monkeypatch):
    # The launcher picks its services' ports, then NATS's and TensorBoard's: none of the first
    # are bound yet when the later ones are picked.
    first = free_port()
    tries = iter([first, first])
    monkeypatch.setattr(ports, "_random_port_outside", lambda low, high: next(tries, 0))
    assert free_port() != first
