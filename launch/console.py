"""What ``rlfleet up`` shows while a run trains: one compact progress line per interval, from the
progress records the run publishes (services/progress.py), instead of one long line per metrics
event; the event lines of ``--verbose``; the start plan and the run's summary.

    cartpole-ppo  step 21.5k/300k  7%  EpRewMean 475.0  EpLenMean 475.0  FPS 1.29k  v84  ETA 3m10s

``Console`` keeps the latest record of each source and prints one line per interval (default
5 s) when a newer record arrived, with the ETA from the rate of ``done`` over the last minute.
On a terminal the line is a rich live line updated in place (other lines print above it); off a
terminal (pipes, CI, tests) it is a plain line. Every metrics event of every service goes to
``<run dir>/metrics.jsonl`` (one JSON object a line: time, service, kind, step, version,
values; a NaN/inf value is null there, its name listed in ``nonfinite``). Verbose
(``rlfleet up --verbose``, ``RLFLEET_VERBOSE=1``) prints every metrics and episode event as
well, one line each from the formatter registered for its message type (`register_formatter`).
A ``RunStatus`` with a message (a learner that resumed from a checkpoint, the run's end) prints
as ``<source>: <message>``.
"""

from __future__ import annotations

import collections
import functools
import importlib
import json
import math
import pkgutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from google.protobuf import descriptor_pool, json_format, message_factory, struct_pb2

from services.bus import TYPE_HEADER
from services.progress import PROGRESS_EVENTS, Progress
from services.start_order import Needs

__all__ = [
    "DEFAULT_INTERVAL_S",
    "ENV_PROGRESS_INTERVAL",
    "ENV_VERBOSE",
    "FORMATTERS",
    "MONITORED_EVENTS",
    "VERBOSE_EVENTS",
    "Console",
    "ServiceLine",
    "compact",
    "describe_start",
    "direct_needs",
    "duration",
    "format_event",
    "format_progress",
    "metric_value",
    "progress_interval_from_env",
    "register_formatter",
    "verbose_from_env",
]

DEFAULT_INTERVAL_S = 5.0
RATE_WINDOW_S = 60.0  # the ETA follows the rate of the last minute
_SUFFIXES = ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T"))
# Episodes are summarised by the metrics events (mean return of the last ones): one line per
# episode would flood the terminal at thousands of episodes per minute (--verbose shows them).
MONITORED_EVENTS = frozenset({"metrics"})
VERBOSE_EVENTS = frozenset({"metrics", "episodes"})
ENV_VERBOSE = "RLFLEET_VERBOSE"  # 1: every metrics and episode event, one line each
ENV_PROGRESS_INTERVAL = "RLFLEET_PROGRESS_INTERVAL_S"  # seconds between progress lines


def verbose_from_env(environ: Mapping[str, str]) -> bool:
    return environ.get(ENV_VERBOSE, "").strip().lower() in ("1", "true", "yes", "on")


def progress_interval_from_env(environ: Mapping[str, str]) -> float:
    """``$RLFLEET_PROGRESS_INTERVAL_S``, else (unset or not a number) the default interval."""
    try:
        return float(environ.get(ENV_PROGRESS_INTERVAL, "") or DEFAULT_INTERVAL_S)
    except ValueError:
        return DEFAULT_INTERVAL_S


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


# --- event printing: a formatter per message type ----------------------------------------------

Formatter = Callable[[Any], str]
FORMATTERS: dict[str, Formatter] = {}


def register_formatter(full_name: str) -> Callable[[Formatter], Formatter]:
    """Register how the monitor prints a message type (by protobuf full name)."""

    def add(fn: Formatter) -> Formatter:
        FORMATTERS[full_name] = fn
        return fn

    return add


def _value(value: Any) -> str:
    if isinstance(value, float):
        # Struct numbers are all doubles: show counters as integers, measurements short.
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    return str(value)


@register_formatter("google.protobuf.Struct")
def _format_struct(message: Any) -> str:
    fields = json_format.MessageToDict(message)
    first = [k for k in ("service", "name") if k in fields]  # who sent it leads the line
    keys = first + sorted(k for k in fields if k not in first)
    return " ".join(f"{k}={_value(fields[k])}" for k in keys)


@register_formatter("rlfleet.bus.v1.Metrics")
def _format_metrics(m: Any) -> str:
    scalars = " ".join(f"{k}={_value(v)}" for k, v in sorted(m.scalars.items()))
    return f"{m.source} step={m.step} version={m.policy_version} {scalars}".rstrip()


@register_formatter("rlfleet.bus.v1.EpisodeStats")
def _format_episode(m: Any) -> str:
    end = " (truncated)" if m.truncated else ""
    return (
        f"{m.source} {m.env_id} return={_value(m.episode_return)} length={m.length}{end} "
        f"env_steps={m.env_steps} version={m.policy_version}"
    )


def _format_fields(message: Any) -> str:
    """Any message: its set scalar fields as key=value (bytes and nested messages skipped)."""
    parts = []
    for desc, value in message.ListFields():
        if desc.message_type is None and desc.type != desc.TYPE_BYTES and not _repeated(desc):
            parts.append(f"{desc.name}={_value(value)}")
    return " ".join(parts)


def _repeated(desc: Any) -> bool:
    return bool(getattr(desc, "is_repeated", None) or desc.label == desc.LABEL_REPEATED)


@functools.cache
def _message_class(full_name: str) -> Any | None:
    """The generated class for ``full_name``; imports ``rlfleet.bus.v1`` (if it exists yet)."""
    if full_name == "google.protobuf.Struct":
        return struct_pb2.Struct
    try:
        package = importlib.import_module("rlfleet.bus.v1")
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.endswith("_pb2"):
                importlib.import_module(f"rlfleet.bus.v1.{info.name}")
    except ImportError:
        pass
    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(full_name)
    except KeyError:
        return None
    return message_factory.GetMessageClass(descriptor)


def _decode(full_name: str, data: bytes) -> tuple[Any, str | None]:
    """(the message, None), or (None, why it cannot be shown)."""
    cls = _message_class(full_name)
    if cls is None:
        return None, f"<{full_name}: {len(data)} bytes>"
    try:
        return cls.FromString(data), None
    except Exception:
        return None, f"<undecodable {full_name}: {len(data)} bytes>"


def _event_line(kind: str, full_name: str, message: Any) -> str:
    return f"[{kind}] " + FORMATTERS.get(full_name, _format_fields)(message)


def format_event(
    subject: str,
    data: bytes,
    headers: Mapping[str, str] | None,
    kinds: frozenset[str] = MONITORED_EVENTS,
) -> str | None:
    """One printable line for an event of one of ``kinds``, or None for events not shown."""
    kind = subject.rsplit(".", 1)[-1]
    if kind not in kinds:
        return None
    full_name = (headers or {}).get(TYPE_HEADER, "google.protobuf.Struct")
    message, error = _decode(full_name, data)
    if message is None:
        return f"[{kind}] {error}"
    return _event_line(kind, full_name, message)


# --- the start plan -----------------------------------------------------------------------------


def direct_needs(needs: Needs, name: str) -> list[str]:
    """The needs of ``name`` not already implied by another of its needs (the console shows
    ``c after b``, not ``c after a, b`` when b itself waits for a)."""
    own = needs.get(name, ())

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            current = todo.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                todo.extend(needs.get(current, ()))
        return False

    return [n for n in own if not any(m != n and reaches(m, n) for m in own)]


def describe_start(order: Sequence[str], needs: Needs) -> str:
    """One console line of the start order: ``reward, sampler-0 at once; learner after reward``."""
    now = [name for name in order if not needs.get(name)]
    later = [
        f"{name} after {', '.join(direct_needs(needs, name))}" for name in order if needs.get(name)
    ]
    first = ", ".join(now) + (" at once" if len(now) > 1 else "")
    return "; ".join(part for part in (first, *later) if part)


class ServiceLine(NamedTuple):
    """One service in the run's summary."""

    name: str
    kind: str
    last_exit: str  # "exit 0", "SIGKILL", "not started"
    restarts: int
    log_path: Path


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

    def say(self, text: str) -> None:
        """One line of the launcher's own (``rlfleet: ...``)."""
        self.line(f"rlfleet: {text}")

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

    def summary(self, code: int, run_dir: Path, services: Iterable[ServiceLine]) -> None:
        """The run's last lines: how it ended, then one line per service."""
        status = "ok" if code == 0 else ("interrupted" if code == 130 else "FAILED")
        self.say(f"run '{self.run}' {status} (exit {code}); run dir {run_dir}")
        for s in services:
            self.line(
                f"  {s.name:<20} {s.kind:<16} {s.last_exit:<12} "
                f"restarts {s.restarts}  log {s.log_path}"
            )

    # --- events ------------------------------------------------------------------------------

    def bus_message(self, subject: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        """One raw message on the run's events subjects: decoded (any payload type, known or
        not) and handed to `event` when its kind is shown or followed."""
        kind = subject.rsplit(".", 1)[-1]
        if kind not in VERBOSE_EVENTS | {PROGRESS_EVENTS, "status"}:
            return
        full_name = (headers or {}).get(TYPE_HEADER, "google.protobuf.Struct")
        message, error = _decode(full_name, data)
        if message is None:
            if kind in (VERBOSE_EVENTS if self.verbose else MONITORED_EVENTS):
                self.line(f"  [{kind}] {error}")
            return
        self.event(kind, full_name, message, lambda: _event_line(kind, full_name, message))

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

    def _etas(self, final: bool) -> dict[str, float | None]:
        return {
            source: None if final else self.rates[source].eta_s(p.total - p.done)
            for source, p in self.latest.items()
        }

    def progress_lines(self, *, final: bool = False) -> list[str]:
        """The progress line of each source (the run's name leads the first); ``final``: the
        run is over, so no ETA."""
        lines = []
        for source, eta in self._etas(final).items():
            name = self.run if len(self.latest) == 1 else f"{self.run}/{source}"
            lines.append(format_progress(name, self.latest[source], eta))
        return lines

    def figures(self, *, final: bool = False) -> list[dict[str, Any]]:
        """What the progress lines show, as data (launch/run_state.py keeps it)."""
        out = []
        for source, eta in self._etas(final).items():
            p = self.latest[source]
            out.append({
                "source": source,
                "unit": p.unit,
                "done": p.done,
                "total": p.total,
                "version": p.version,
                "headline": [[label, value] for label, value in p.headline],
                "eta_s": eta if eta is not None and math.isfinite(eta) else None,
            })  # fmt: skip
        return out

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
            values = dict(message.scalars)
            # JSON has no NaN/inf: such a value is written as null and named under "nonfinite",
            # so a diverged loss stays visible instead of vanishing from the file.
            nonfinite = sorted(k for k, v in values.items() if not math.isfinite(v))
            record: dict[str, Any] = {
                "service": message.source,
                "step": message.step,
                "version": message.policy_version,
                "values": {k: None if k in nonfinite else v for k, v in values.items()},
            }
            if nonfinite:
                record["nonfinite"] = nonfinite
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
