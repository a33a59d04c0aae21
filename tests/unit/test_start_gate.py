"""services/start_gate.py: the launcher's gate and a service process waiting at it, over a real
pipe into a real child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from services.start_gate import ENV_START_GATE, StartGate, wait_at_gate

# The child waits at its gate, then prints whether it may start and whether the gate is still
# in its environment (it must not be: a process it starts has no such descriptor).
_CHILD = (
    "import os; from services.start_gate import wait_at_gate; "
    "opened = wait_at_gate(os.environ); "
    f"print(opened, {ENV_START_GATE!r} in os.environ, flush=True)"
)


def _spawn(gate: StartGate) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        env={**os.environ, **gate.env()},
        pass_fds=(gate.child_fd,),
        stdout=subprocess.PIPE,
        text=True,
    )
    gate.spawned()
    return process


def test_a_process_waits_at_its_gate_until_it_is_opened() -> None:
    gate = StartGate()
    process = _spawn(gate)
    try:
        time.sleep(1.0)
        assert process.poll() is None  # still at its gate
        gate.open()
        out, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert out.split() == ["True", "False"]
    assert gate.opened_or_closed


def test_a_gate_closed_unopened_tells_the_process_not_to_start() -> None:
    gate = StartGate()
    process = _spawn(gate)
    try:
        gate.close()
        out, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert out.split() == ["False", "False"]


def test_opening_the_gate_of_a_process_that_died_is_no_error() -> None:
    gate = StartGate()
    process = subprocess.Popen([sys.executable, "-c", "pass"], pass_fds=(gate.child_fd,))
    gate.spawned()
    process.wait(30)
    gate.open()  # the read end is gone: EPIPE, swallowed
    gate.close()  # idempotent


def test_without_a_gate_a_process_starts_at_once() -> None:
    environ = {"OTHER": "1"}
    assert wait_at_gate(environ) is True
    assert environ == {"OTHER": "1"}


@pytest.mark.parametrize("opened", [True, False])
def test_the_gate_leaves_the_environment(opened: bool) -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"\x01" if opened else b"")
    os.close(write_fd)
    environ = {ENV_START_GATE: str(read_fd)}
    assert wait_at_gate(environ) is opened
    assert ENV_START_GATE not in environ
    with pytest.raises(OSError):
        os.fstat(read_fd)  # closed by the wait
