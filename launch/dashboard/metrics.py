"""The dashboard's data: every run directory's ``metrics.jsonl``, read incrementally.

``rlfleet up`` appends one JSON object a line to ``<run dir>/metrics.jsonl`` for every metrics
event of every service (launch.console): ``time`` (Unix seconds), ``service``, ``kind``,
``step``, ``version`` and ``values`` (name -> number; CleanRL-style names such as
``charts/episodic_return`` or ``losses/entropy``; a NaN/inf value is null, its name listed in
``nonfinite``, and shows as a mark on its chart). A `MetricsFile` remembers how far it has
read, so each poll of the page parses only the lines appended since the last one; a line still
being written (no newline yet) waits for the next poll. A file that shrank or was replaced is read
again from the start under a new ``generation``, so a client holding a cursor of the old file
starts over instead of mixing two files. Lines that are not such records are skipped and counted,
with the first few reasons kept for the page to show.

Every point also carries the run's env steps when it was recorded (``steps``, beside
``points``), so the page can draw curves against env steps: the latest ``charts/global_step``
(the learner's env steps trained on, CleanRL's ``global_step``) read at or before that record,
null before the first one (and in runs that report none, such as LM runs). A series' ``role``
says what its service is, from what it reports: ``learner`` (it reports ``charts/global_step``),
``actor`` (it reports its own ``charts/episodes``: an actor or a game link), else empty.

Earlier runs are the sibling directories of the current run (``runs/*``) that hold a
``metrics.jsonl``; a run is named by its directory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "MetricsFile", "Record", "RunInfo", "Runs", "UnknownRun"]

METRICS_FILE = "metrics.jsonl"
MAX_PROBLEMS = 5  # reasons kept for skipped lines; the count goes on
STEP_KEY = "charts/global_step"  # the run's env steps, reported by the learner
EPISODES_KEY = "charts/episodes"  # an episode producer's own count (common.stats.ActorStats)


class UnknownRun(LookupError):
    """No run of that name in the runs directory."""


@dataclass(frozen=True)
class Record:
    """One metrics event: when, who sent it, at which step, and its numeric values."""

    time: float
    service: str
    step: int | None
    values: dict[str, float]
    nonfinite: tuple[str, ...] = ()  # names whose value was NaN/inf (null in the file)


def parse_record(line: str) -> Record:
    """A ``metrics.jsonl`` line as a Record; ValueError saying what is wrong with it."""
    try:
        raw = json.loads(line)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    t = raw.get("time")
    if not isinstance(t, int | float) or isinstance(t, bool):
        raise ValueError("no numeric 'time'")
    values = raw.get("values")
    if not isinstance(values, dict):
        raise ValueError("no 'values' object")
    step = raw.get("step")
    flagged = raw.get("nonfinite")
    nonfinite = tuple(str(k) for k in flagged) if isinstance(flagged, list) else ()
    return Record(
        time=float(t),
        service=str(raw.get("service") or ""),
        step=int(step) if isinstance(step, int | float) and not isinstance(step, bool) else None,
        # Only finite numbers make points: a string, a bool or a NaN has no place on a curve.
        values={str(k): float(v) for k, v in values.items() if _number(v) and math.isfinite(v)},
        nonfinite=nonfinite,
    )


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class MetricsFile:
    """One run's ``metrics.jsonl``: the records read so far, and where reading goes on."""

    path: Path
    records: list[Record] = field(default_factory=list)
    generation: int = 0  # a new one whenever the file is read again from the start
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    steps: list[float | None] = field(default_factory=list)  # the run's env steps per record
    roles: dict[str, str] = field(default_factory=dict)  # service -> learner / actor
    _step: float | None = None  # the latest charts/global_step read
    _offset: int = 0
    _partial: bytes = b""
    _lines: int = 0
    _identity: tuple[int, int] | None = None

    def refresh(self) -> int:
        """Read what was appended since the last call; the number of new records."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return 0  # not written yet (a run before its first metrics): nothing new
        identity = (stat.st_dev, stat.st_ino)
        if self._identity is not None and (
            identity != self._identity or stat.st_size < self._offset
        ):
            self._start_over()
        self._identity = identity
        if stat.st_size == self._offset:
            return 0
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        before = len(self.records)
        for line in lines:
            self._lines += 1
            self._add(line)
        return len(self.records) - before

    def _add(self, line: bytes) -> None:
        text = line.decode("utf-8", errors="replace").strip()
        if not text:
            return
        try:
            record = parse_record(text)
        except ValueError as exc:
            self.skipped += 1
            if len(self.problems) < MAX_PROBLEMS:
                self.problems.append(f"{self.path.name} line {self._lines}: {exc}")
            return
        if STEP_KEY in record.values:
            self._step = record.values[STEP_KEY]
            self.roles[record.service] = "learner"
        elif EPISODES_KEY in record.values:
            self.roles.setdefault(record.service, "actor")
        self.records.append(record)
        self.steps.append(self._step)

    def _start_over(self) -> None:
        self.records.clear()
        self.steps.clear()
        self.roles.clear()
        self._step = None
        self.problems.clear()
        self.skipped = self._offset = self._lines = 0
        self._partial = b""
        self.generation += 1

    def since(self, cursor: int, generation: int | None) -> dict[str, Any]:
        """The series of the records from ``cursor`` on (all of them when ``generation`` is not
        this file's), with the cursor to send next time."""
        reset = generation != self.generation or cursor > len(self.records)
        start = 0 if reset else cursor
        return {
            "generation": self.generation,
            "cursor": len(self.records),
            "reset": reset,
            "skipped": self.skipped,
            "problems": list(self.problems),
            "series": series(self.records[start:], self.steps[start:], self.roles),
        }


def series(
    records: list[Record],
    steps: list[float | None] | None = None,
    roles: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One series per (metric name, service): ``points`` are ``[time, value]`` pairs, ``steps``
    the run's env steps at each point (null: not known yet), ``nonfinite`` the times its value
    was NaN/inf (no point there), ``role`` its service's (see the module doc)."""
    if steps is None:
        steps = [None] * len(records)
    roles = roles or {}
    out: dict[tuple[str, str], list[list[float]]] = {}
    at: dict[tuple[str, str], list[float | None]] = {}
    bad: dict[tuple[str, str], list[float]] = {}
    for r, step in zip(records, steps, strict=True):
        for key, value in r.values.items():
            out.setdefault((key, r.service), []).append([r.time, value])
            at.setdefault((key, r.service), []).append(step)
        for key in r.nonfinite:
            out.setdefault((key, r.service), [])
            bad.setdefault((key, r.service), []).append(r.time)
    return [
        {
            "key": key,
            "service": service,
            "role": roles.get(service, ""),
            "points": points,
            "steps": at.get((key, service), []),
            "nonfinite": bad.get((key, service), []),
        }
        for (key, service), points in sorted(out.items())
    ]


@dataclass(frozen=True)
class RunInfo:
    id: str
    current: bool
    modified: float | None  # the metrics file's mtime (None before its first line)
    size: int


class Runs:
    """The runs under ``root`` (``runs/``): the current one and every earlier one with a
    ``metrics.jsonl``; each run's file is read incrementally and kept between requests."""

    def __init__(self, root: Path, current: Path | None = None) -> None:
        self.root = root
        self.current = current
        self._files: dict[str, MetricsFile] = {}

    def _dirs(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError:  # no runs/ yet
            entries = []
        for entry in entries:
            if entry.is_dir() and (Path(entry.path) / METRICS_FILE).is_file():
                found[entry.name] = Path(entry.path)
        if self.current is not None:
            found.setdefault(self.current.name, self.current)
        return found

    def list(self) -> list[RunInfo]:
        """The current run first, then the others, most recently written first."""
        runs = []
        for name, path in self._dirs().items():
            try:
                stat = (path / METRICS_FILE).stat()
                modified, size = stat.st_mtime, stat.st_size
            except OSError:
                modified, size = None, 0
            runs.append(RunInfo(name, path == self.current, modified, size))
        return sorted(runs, key=lambda r: (not r.current, -(r.modified or 0.0), r.id))

    def metrics(self, run_id: str) -> MetricsFile:
        """The run's metrics file, brought up to date; UnknownRun for a name not listed (so a
        request can never name a path outside ``root``)."""
        file = self._files.get(run_id)
        if file is None:
            path = self._dirs().get(run_id)
            if path is None:
                raise UnknownRun(f"no run '{run_id}' in {self.root}")
            file = self._files[run_id] = MetricsFile(path / METRICS_FILE)
        file.refresh()
        return file
