"""``<run dir>/state.json``: how a run launched by ``rlfleet up`` stands, for whoever watches runs
without being their parent (``rlfleet studio``, scripts).

The launcher writes it when the run starts (``running``, its pid), with the progress line's
figures as they change, and when it ends (``finished``: exit 0; ``stopped``: Ctrl-C or SIGTERM
before the main service finished, exit 130; ``failed``: any other exit, with the reason). Each
write replaces the file whole (write, then rename), so a reader never sees half of it. A file
that still says ``running`` while its pid is gone, or belongs to another program, is a launcher
that died without a word (SIGKILL, the machine): `read_state` reports it as failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "STATE_FILE",
    "RunState",
    "StateWriter",
    "launcher_alive",
    "process_start",
    "read_state",
    "state_of_exit",
]

STATE_FILE = "state.json"
State = Literal["running", "finished", "stopped", "failed"]
EXIT_STOPPED = 130  # the launcher's exit code when stopped by a signal (launch.launcher)


@dataclass
class RunState:
    """What ``state.json`` holds."""

    state: State
    pid: int
    started: float  # Unix seconds
    pid_start: int | None = None  # the launcher's process_start: its pid cannot be mistaken
    ended: float | None = None
    exit: int | None = None
    message: str = ""  # why it ended (a failure's reason; "main service learner finished")
    # The progress line's figures per source: unit, done, total, version, headline
    # ([label, value] pairs), eta_s; and the line itself.
    progress: list[dict[str, Any]] = field(default_factory=list)
    line: str = ""
    # Each service as the dashboard's table shows it: name, kind, state, restarts, pid,
    # address, last_exit.
    services: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, raw: Any) -> RunState | None:
        """From the file's JSON; None when it is not a state record."""
        if not isinstance(raw, dict) or raw.get("state") not in ("running", *_ENDED):
            return None
        try:
            return cls(
                state=raw["state"],
                pid=int(raw["pid"]),
                started=float(raw["started"]),
                pid_start=None if raw.get("pid_start") is None else int(raw["pid_start"]),
                ended=None if raw.get("ended") is None else float(raw["ended"]),
                exit=None if raw.get("exit") is None else int(raw["exit"]),
                message=str(raw.get("message") or ""),
                progress=[p for p in raw.get("progress") or () if isinstance(p, dict)],
                line=str(raw.get("line") or ""),
                services=[v for v in raw.get("services") or () if isinstance(v, dict)],
            )
        except (KeyError, TypeError, ValueError):
            return None


_ENDED = ("finished", "stopped", "failed")


def state_of_exit(code: int) -> State:
    return "finished" if code == 0 else "stopped" if code == EXIT_STOPPED else "failed"


class StateWriter:
    """The launcher's side: ``started``, then ``progress`` as often as it likes, then ``ended``."""

    def __init__(self, run_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = run_dir / STATE_FILE
        self.clock = clock
        self.state: RunState | None = None

    def started(self) -> None:
        pid = os.getpid()
        self.state = RunState("running", pid, self.clock(), process_start(pid))
        self._write()

    def update(
        self,
        *,
        figures: Iterable[dict[str, Any]] | None = None,
        line: str | None = None,
        services: Iterable[dict[str, Any]] | None = None,
    ) -> None:
        """New progress figures and line, or services' states (None: unchanged); the file is
        written only when something changed."""
        if self.state is None:
            return
        before = (self.state.progress, self.state.line, self.state.services)
        if figures is not None:
            self.state.progress = list(figures)
        if line is not None:
            self.state.line = line
        if services is not None:
            self.state.services = list(services)
        if (self.state.progress, self.state.line, self.state.services) != before:
            self._write()

    def ended(self, code: int, message: str) -> None:
        if self.state is None:
            return
        self.state.state, self.state.exit = state_of_exit(code), code
        self.state.ended, self.state.message = self.clock(), message
        self._write()

    def _write(self) -> None:
        assert self.state is not None
        tmp = self.path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(asdict(self.state)), encoding="utf-8")
            tmp.replace(self.path)
        except OSError:  # a full disk must not fail the run: the file is a courtesy
            with contextlib.suppress(OSError):
                tmp.unlink()


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22): with the pid it
    names one process, since a pid is reused only by a process started later. None when no
    such process runs (or it exited and waits to be reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] == "Z":
        return None
    return int(fields[19])


def launcher_alive(state: RunState) -> bool:
    """Whether the launcher that wrote ``state`` still runs (not a reused pid)."""
    start = process_start(state.pid)
    return start is not None and (state.pid_start is None or start == state.pid_start)


def read_state(run_dir: Path) -> RunState | None:
    """The run's state (None: never launched with a state file, or unreadable); a ``running``
    state whose launcher is gone reads as ``failed``."""
    try:
        raw = json.loads((run_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    state = RunState.from_json(raw)
    if state is not None and state.state == "running" and not launcher_alive(state):
        state.state = "failed"
        state.message = f"the launcher (pid {state.pid}) ended without saying how (killed?)"
    return state
