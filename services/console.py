"""What ``rlfleet up`` shows while a run trains: one compact progress line per interval, from the
progress records the run publishes, instead of one long line per metrics event.

The runtime knows no domain: whoever trains publishes, beside its Metrics, a *progress record*
(``progress_record``: a ``google.protobuf.Struct`` on ``rlfleet.v1.events.<run>.progress``) that
says what the line needs: the unit counted (``step``, ``update``), how many are done of how many,
the policy version and a short ordered list of headline values with their display labels::

    cartpole-ppo  step 21.5k/300k  7%  EpRewMean 475.0  EpLenMean 475.0  FPS 1.29k  v84  ETA 3m10s

``Console`` keeps the latest record of each source and prints one line per interval (default
5 s) when a newer record arrived, with the ETA from the rate of ``done`` over the last minute.
On a terminal the line is a rich live line updated in place (other lines print above it); off a
terminal (pipes, CI, tests) it is a plain line. Every metrics event of every service goes to
``<run dir>/metrics.jsonl`` (one JSON object a line: time, service, kind, step, version,
values). Verbose (``rlfleet up --verbose``, ``RLFLEET_VERBOSE=1``) prints every metrics and
episode event as well, as the caller formats it. A ``RunStatus`` with a message
(a learner that resumed from a checkpoint, the run's end) prints as ``<source>: <message>``.
"""

from __future__ import annotations

import collections
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from google.protobuf import json_format, struct_pb2

__all__ = [
    "DEFAULT_INTERVAL_S",
    "PROGRESS_EVENTS",
    "Console",
    "Progress",
    "compact",
    "duration",
    "format_progress",
    "metric_value",
    "progress_record",
]

PROGRESS_EVENTS = "progress"  # the event kind of progress records
DEFAULT_INTERVAL_S = 5.0
RATE_WINDOW_S = 60.0  # the ETA follows the rate of the last minute
_SUFFIXES = ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T"))

# --- the record the publisher sends ------------------------------------------------------------


def progress_record(
    source: str,
    *,
    unit: str,
    done: float,
    total: float,
    version: int | None,
    headline: Iterable[tuple[str, float]] = (),
) -> struct_pb2.Struct:
    """A progress record: ``source`` has done ``done`` of ``total`` ``unit``s at policy
    ``version`` (None: no policy versions, e.g. offline DPO, or a warm start before the first);
    ``headline``: (label, value) pairs in display order (non-finite ones left out)."""
    record = struct_pb2.Struct()
    fields: dict[str, Any] = {
        "source": source,
        "unit": unit,
        "done": float(done),
        "total": float(total),
        "headline": [[label, float(v)] for label, v in headline if math.isfinite(v)],
    }
    if version is not None:
        fields["version"] = int(version)
    record.update(fields)
    return record


@dataclass(frozen=True)
class Progress:
    """A decoded progress record."""

    source: str
    unit: str
    done: float
    total: float
    version: int | None = None
    headline: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Progress | None:
        """From a record's fields (``progress_record``); None when it is not one."""
        try:
            done, total = float(fields["done"]), float(fields["total"])
        except (KeyError, TypeError, ValueError):
            return None
        headline = []
        for pair in fields.get("headline") or ():
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int | float):
                headline.append((str(pair[0]), float(pair[1])))
        version = fields.get("version")
        return cls(
            source=str(fields.get("source", "")),
            unit=str(fields.get("unit", "")),
            done=done,
            total=total,
            version=int(version) if isinstance(version, int | float) else None,
            headline=tuple(headline),
        )


# --- formatting --------------------------------------------------------------------------------


def compact(n: float) -> str:
    """A count, short: 840, 21.5k, 300k, 1.29M (three significant digits past 1000)."""
    if not math.isfinite(n):
        return str(n)
    if abs(n) < 999.5:
        return f"{n:.0f}" if float(n).is_integer() else f"{n:.3g}"
    for scale, suffix in _SUFFIXES:  # the first whose value rounds below 1000
        v = n / scale
        if abs(v) < 999.5 or suffix == _SUFFIXES[-1][1]:
            return (f"{v:.3g}" if abs(v) < 999.5 else f"{v:.0f}") + suffix
    raise AssertionError("unreachable")


def metric_value(v: float) -> str:
    """A headline value: 475.0, 21.4, 4.56, 0.41, 0.0031, 1.29k."""
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1000:
        return compact(v)
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01 or a == 0:
        return f"{v:.2f}"
    return f"{v:.2g}"


def duration(seconds: float) -> str:
    """An ETA: 45s, 3m10s, 9m, 1h05m, 2d3h."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        m, rest = divmod(s, 60)
        return f"{m}m{rest:02d}s" if rest else f"{m}m"
    if s < 86400:
        h, rest = divmod(s, 3600)
        return f"{h}h{rest // 60:02d}m"
    d, rest = divmod(s, 86400)
    return f"{d}d{rest // 3600}h"


def format_progress(run: str, p: Progress, eta_s: float | None = None) -> str:
    """``<run>  <unit> <done>/<total>  <pct>%  <label> <value>...  v<version>  ETA <eta>``."""
    parts = [run, f"{p.unit} {compact(p.done)}/{compact(p.total)}".strip()]
    if p.total > 0:
        parts.append(f"{min(int(100 * p.done / p.total), 100)}%")
    parts += [f"{label} {metric_value(v)}" for label, v in p.headline]
    if p.version is not None:
        parts.append(f"v{p.version}")
    if eta_s is not None and math.isfinite(eta_s):
        parts.append(f"ETA {duration(eta_s)}")
    return "  ".join(parts)


class Rate:
    """The rate of a growing counter over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.points: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, t: float, value: float) -> None:
        if self.points and value < self.points[-1][1]:
            self.points.clear()  # the counter went back (another run, a reset): start again
        self.points.append((t, value))
        while len(self.points) > 2 and t - self.points[1][0] >= self.window_s:
            self.points.popleft()

    def per_s(self) -> float | None:
        if len(self.points) < 2:
            return None
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        if t1 <= t0 or v1 <= v0:
            return None
        return (v1 - v0) / (t1 - t0)

    def eta_s(self, remaining: float) -> float | None:
        rate = self.per_s()
        if remaining <= 0:
            return 0.0
        return remaining / rate if rate else None


# --- the console -------------------------------------------------------------------------------


class Console:
    """Everything the launcher shows: its own lines (``line``), the progress line (``tick``,
    once per ``interval_s``), the verbose event lines, and metrics.jsonl (``event``)."""

    def __init__(
        self,
        out: IO[str],
        run: str,
        *,
        verbose: bool = False,
        interval_s: float = DEFAULT_INTERVAL_S,
        live: bool = False,
        metrics_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out, self.run, self.verbose, self.interval_s = out, run, verbose, interval_s
        self.metrics_path, self.clock = metrics_path, clock
        self.latest: dict[str, Progress] = {}  # by source
        self.rates: dict[str, Rate] = {}
        self._fresh: set[str] = set()  # sources with a record newer than their last line
        self._last_line_at: float | None = None
        self._jsonl: IO[str] | None = None
        self._live: Any = None  # rich.live.Live on a terminal
        self._rich: Any = None
        if live:
            try:
                from rich.console import Console as RichConsole
                from rich.live import Live
            except ImportError:  # rich not installed: plain lines
                pass
            else:
                self._rich = RichConsole(file=out, force_terminal=True, highlight=False)
                self._live = Live(console=self._rich, auto_refresh=False, transient=False)

    # --- output ------------------------------------------------------------------------------

    def line(self, text: str) -> None:
        """One line of output (above the live line on a terminal)."""
        if self._rich is not None:
            self._rich.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.out, flush=True)

    def start(self) -> None:
        if self._live is not None:
            self._live.start()

    def close(self) -> None:
        """The last progress not shown yet, then the live line and metrics.jsonl closed."""
        self.tick(force=True, final=True)
        if self._live is not None:
            self._live.stop()
            self._live = None
        self._rich = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    # --- events ------------------------------------------------------------------------------

    def event(self, kind: str, full_name: str, message: Any, raw: Callable[[], str | None]) -> None:
        """One decoded bus event of kind ``kind`` (``message`` of type ``full_name``);
        ``raw()`` is its verbose line."""
        if kind == "metrics":
            self._write_jsonl(kind, full_name, message)
        if kind == PROGRESS_EVENTS and isinstance(message, struct_pb2.Struct):
            progress = Progress.from_fields(json_format.MessageToDict(message))
            if progress is not None:
                self.progress(progress)
            return
        if kind == "status" and full_name == "rlfleet.bus.v1.RunStatus":
            if message.message:
                # A finished phase's last progress line, held back by the interval, goes first:
                # "sft step 120/120" before "SFT done", as it happened.
                if any(self.latest[s].done >= self.latest[s].total for s in self._fresh):
                    self.tick(force=True)
                self.line(f"{message.source or 'run'}: {message.message}")
            return
        # Typed metrics are summarised by the progress line; other payloads (a heartbeat's
        # Struct, an unknown type) have no progress record and print as they come.
        shown = self.verbose or (kind == "metrics" and full_name != "rlfleet.bus.v1.Metrics")
        if shown and kind in ("metrics", "episodes"):
            text = raw()
            if text is not None:
                self.line(f"  {text}")

    def progress(self, p: Progress) -> None:
        """Keep ``p`` as its source's latest; the next due ``tick`` shows it."""
        now = self.clock()
        previous = self.latest.get(p.source)
        if previous is not None and previous.unit != p.unit:  # a new phase: "sft step", "update"
            self.rates.pop(p.source, None)
        self.latest[p.source] = p
        self.rates.setdefault(p.source, Rate()).add(now, p.done)
        self._fresh.add(p.source)
        self.tick()

    def progress_lines(self, *, final: bool = False) -> list[str]:
        """The progress line of each source (the run's name leads the first); ``final``: the
        run is over, so no ETA."""
        lines = []
        for source, p in self.latest.items():
            eta = None if final else self.rates[source].eta_s(p.total - p.done)
            name = self.run if len(self.latest) == 1 else f"{self.run}/{source}"
            lines.append(format_progress(name, p, eta))
        return lines

    def tick(self, *, force: bool = False, final: bool = False) -> bool:
        """Show the progress line when one is due: a newer record than the last line and
        ``interval_s`` since it (``force``: now, if there is a newer record; ``final``: the
        last line of the run, without ETA). True if shown."""
        if not self._fresh:
            return False
        now = self.clock()
        due = self._last_line_at is None or now - self._last_line_at >= self.interval_s
        if not (due or force):
            return False
        self._last_line_at = now
        self._fresh.clear()
        lines = self.progress_lines(final=final)
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text("\n".join(lines)), refresh=True)
        else:
            for text in lines:
                self.line(text)
        return True

    def _write_jsonl(self, kind: str, full_name: str, message: Any) -> None:
        if self.metrics_path is None:
            return
        if full_name == "rlfleet.bus.v1.Metrics":
            record: dict[str, Any] = {
                "service": message.source,
                "step": message.step,
                "version": message.policy_version,
                "values": dict(message.scalars),
            }
        elif isinstance(message, struct_pb2.Struct):
            fields = json_format.MessageToDict(message)
            service = fields.pop("service", fields.pop("source", None))
            record = {"service": service, "values": fields}
        else:
            record = {"service": None, "values": json_format.MessageToDict(message)}
        record = {"time": round(time.time(), 3), "kind": kind, "type": full_name, **record}
        if self._jsonl is None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = self.metrics_path.open("a", encoding="utf-8")
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
