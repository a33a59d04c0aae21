"""The studio's runs: every run directory under ``<workdir>/runs``, how it stands, and the
actions on it (start, stop, resume, start afresh, delete).

A run the studio starts is ``rlfleet up <run dir>/config.yaml --no-dashboard`` in a session of
its own, with ``<workdir>`` as its current directory (so ``runs/<name>`` is that run dir, as
for ``rlfleet up`` typed there) and its output in ``<run dir>/logs/launcher.log``. It is not
the studio's child in any way that matters: it survives the studio's exit and restart (the
launcher supervises its own services and they die with it). How a run stands is read from
the ``state.json`` its launcher keeps (launch/run_state.py), so runs started from a terminal
are listed the same way. Stop sends the launcher SIGINT: the orderly stop of Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launch.run_state import RunState, read_state
from services.config import RunConfig, load_run_config, read_yaml_mapping
from services.errors import ConfigError, ConfigIssue, FailedPrecondition, NotFound
from services.registry import get_job
from services.run_layout import EVAL_SAMPLES_FILE, FINAL_DIR, LEARNER_DIR, RUN_CONFIG_FILE

__all__ = ["CONFIG_FILE", "LAUNCHER_LOG", "RunBook", "RunEntry"]

CONFIG_FILE = RUN_CONFIG_FILE  # the run file, as `rlfleet up` copies it into the run dir
LAUNCHER_LOG = "launcher.log"  # under <run dir>/logs/: what the launcher printed
RUNS = "runs"
NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # a run name (services.config.RunSection)
MAX_LOG_LINES = 2000
# What a fresh start removes: everything of the run dir but the run file.
KEEP_ON_FRESH = frozenset({CONFIG_FILE})


@dataclass(frozen=True)
class _Spawned:
    process: subprocess.Popen[bytes]
    at: float  # when (Unix seconds): a state file older than this is the previous launch's


@dataclass
class RunEntry:
    """One run as the studio lists it."""

    id: str  # the run dir's name (the run's name)
    state: str  # new, starting, running, finished, stopped, failed
    kind: str  # the job kind ("" for a run file without a job)
    job: dict[str, Any] = field(default_factory=dict)  # the run file's job: section, as written
    watch: str = ""  # how it is tried out: episode, prompt, "" (services.registry.JobSpec)
    started: float | None = None
    ended: float | None = None
    exit: int | None = None
    message: str = ""
    line: str = ""  # the progress line
    progress: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)
    has_policy: bool = False  # final/ holds a saved policy or model
    modified: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RunBook:
    """The runs under ``workdir/runs``; ``python`` runs the launchers (this interpreter)."""

    def __init__(
        self,
        workdir: Path,
        *,
        python: str = sys.executable,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = workdir.resolve()
        self.root = self.workdir / RUNS
        self.python = python
        self.environ = dict(os.environ if environ is None else environ)
        # The launcher this studio last spawned per run (a child until the studio ends).
        self._spawned: dict[str, _Spawned] = {}

    # --- reading ----------------------------------------------------------------------------

    def run_dir(self, run_id: str) -> Path:
        """The run's directory; NotFound for a name that is not a run here (never a path
        outside the runs folder)."""
        if not NAME.fullmatch(run_id) or not (self.root / run_id / CONFIG_FILE).is_file():
            raise NotFound(f"no run '{run_id}' in {self.root}")
        return self.root / run_id

    def entries(self) -> list[RunEntry]:
        """Every run (a directory with a run file), running ones first, then newest first."""
        try:
            names = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        except OSError:
            names = []
        runs = [self._entry(n) for n in names if (self.root / n / CONFIG_FILE).is_file()]
        return sorted(
            runs,
            key=lambda r: (r.state not in ("running", "starting"), -(r.modified or 0.0), r.id),
        )

    def get(self, run_id: str) -> RunEntry:
        return self._entry(self.run_dir(run_id).name)

    def _entry(self, name: str) -> RunEntry:
        run_dir = self.root / name
        state = read_state(run_dir)
        job = _job(run_dir / CONFIG_FILE)
        kind = str(job.get("kind", ""))
        entry = RunEntry(id=name, state="new", kind=kind, job=job, watch=_watch(kind))
        if state is not None:
            _fill(entry, state)
        spawned = self._spawned.get(name)
        if spawned is not None and (state is None or state.started < spawned.at):
            # Its launcher has not written its state yet: still importing, or it failed first
            # (a run file that stopped being valid, a finished run's refusal).
            code = spawned.process.poll()
            if code is None:
                entry.state = "starting"
            else:
                entry.state, entry.exit = ("finished" if code == 0 else "failed"), code
                entry.message = _last_line(run_dir / "logs" / LAUNCHER_LOG)
        entry.has_policy = _has_policy(run_dir)
        entry.modified = _modified(run_dir)
        return entry

    def eval_samples(self, run_id: str) -> dict[str, Any] | None:
        """The latest evaluation's sample answers of a language-model run (None: none yet)."""
        path = self.run_dir(run_id) / LEARNER_DIR / EVAL_SAMPLES_FILE
        try:
            with path.open(encoding="utf-8") as f:
                last = deque(f, maxlen=1)
        except OSError:
            return None
        try:
            record = json.loads(last[0]) if last else None
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    def config_text(self, run_id: str) -> str:
        return (self.run_dir(run_id) / CONFIG_FILE).read_text(encoding="utf-8")

    def logs(self, run_id: str) -> list[str]:
        """The run's log files (the launcher's and each service's), by name."""
        folder = self.run_dir(run_id) / "logs"
        try:
            return sorted(p.name for p in folder.iterdir() if p.suffix == ".log")
        except OSError:
            return []

    def log_tail(self, run_id: str, name: str, lines: int = 200) -> list[str]:
        """The last ``lines`` lines of one of the run's logs; NotFound for another name."""
        if name not in self.logs(run_id):
            raise NotFound(f"run '{run_id}' has no log '{name}'")
        path = self.run_dir(run_id) / "logs" / name
        with path.open(encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=min(lines, MAX_LOG_LINES))]

    # --- run files --------------------------------------------------------------------------

    def validate(self, text: str) -> RunConfig:
        """``text`` as a run file, fully validated (as ``rlfleet validate`` would), with the
        studio's own rule: its runs live in this runs folder. ConfigError with its issues."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", suffix=".yaml", prefix=".draft-", dir=self.root, encoding="utf-8", delete=False
        ) as f:
            f.write(text)
        draft = Path(f.name)
        try:
            config = load_run_config(draft, self.environ, check_machine=True)
        except ConfigError as exc:  # name the text as the form shows it, not the draft file
            message = exc.message.replace(str(draft), "run file")
            raise ConfigError(message, issues=exc.issues) from None
        finally:
            draft.unlink(missing_ok=True)
        if config.run.dir is not None and config.run_dir.resolve() != self.root / config.run.name:
            message = f"the studio keeps runs in {self.root}: leave run.dir out"
            raise ConfigError(f"run.dir: {message}", issues=[ConfigIssue("run.dir", None, message)])
        return config

    def create(self, text: str, *, start: bool = True) -> RunEntry:
        """A new run from the run file ``text`` (started unless ``start`` is False);
        FailedPrecondition when a run of that name exists."""
        config = self.validate(text)
        name = config.run.name
        run_dir = self.root / name
        if (run_dir / CONFIG_FILE).exists():
            raise FailedPrecondition(
                f"a run named '{name}' exists: resume it, start it afresh, or pick another run.name"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(text, encoding="utf-8")
        if start:
            self._launch(name)
        return self.get(name)

    # --- actions ----------------------------------------------------------------------------

    def resume(self, run_id: str) -> RunEntry:
        """Start the run again where its checkpoints left it (a finished run says so)."""
        self._not_running(run_id, "resume")
        self._launch(run_id)
        return self.get(run_id)

    def restart(self, run_id: str) -> RunEntry:
        """Start the run afresh: everything in its directory but the run file goes first."""
        run_dir = self._not_running(run_id, "start afresh")
        for path in run_dir.iterdir():
            if path.name in KEEP_ON_FRESH:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        self._launch(run_id)
        return self.get(run_id)

    def stop(self, run_id: str) -> RunEntry:
        """SIGINT to the run's launcher (Ctrl-C's orderly stop); FailedPrecondition when the
        run is not running."""
        entry = self.get(run_id)
        pid = self._launcher_pid(run_id, entry)
        if pid is None:
            raise FailedPrecondition(f"run '{run_id}' is not running ({entry.state})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        return entry

    def delete(self, run_id: str) -> None:
        """Remove the run's directory (not while it runs)."""
        run_dir = self._not_running(run_id, "delete")
        shutil.rmtree(run_dir)
        self._spawned.pop(run_id, None)

    def close(self) -> None:
        """Reap what has exited; running launchers go on (they are not the studio's)."""
        for spawned in self._spawned.values():
            spawned.process.poll()

    # --- internals --------------------------------------------------------------------------

    def _launcher_pid(self, run_id: str, entry: RunEntry) -> int | None:
        spawned = self._spawned.get(run_id)
        if spawned is not None and spawned.process.poll() is None:
            return spawned.process.pid
        if entry.state == "running":
            state = read_state(self.root / run_id)
            return state.pid if state is not None else None
        return None

    def _not_running(self, run_id: str, action: str) -> Path:
        entry = self.get(run_id)
        if entry.state in ("running", "starting"):
            raise FailedPrecondition(f"run '{run_id}' is {entry.state}: stop it to {action} it")
        return self.root / run_id

    def _launch(self, run_id: str) -> None:
        run_dir = self.root / run_id
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        argv = [self.python, "-m", "launch", "up", str(run_dir / CONFIG_FILE), "--no-dashboard"]
        env = {**self.environ, "PYTHONUNBUFFERED": "1"}
        with (run_dir / "logs" / LAUNCHER_LOG).open("ab") as log:
            log.write(f"--- rlfleet studio: {' '.join(argv[1:])}\n".encode())
            log.flush()
            process = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: the studio's end is not its end
            )
        self._spawned[run_id] = _Spawned(process, time.time())


def _fill(entry: RunEntry, state: RunState) -> None:
    entry.state = state.state
    entry.started, entry.ended, entry.exit = state.started, state.ended, state.exit
    entry.message, entry.line = state.message, state.line
    entry.progress, entry.services = state.progress, state.services


def _job(config: Path) -> dict[str, Any]:
    """The run file's ``job:`` section, read without validating (a listing must not fail on
    one broken file)."""
    try:
        data = read_yaml_mapping(config).data
    except ConfigError:
        return {}
    job = data.get("job") if isinstance(data, dict) else None
    return dict(job) if isinstance(job, dict) else {}


def _watch(kind: str) -> str:
    try:
        return (get_job(kind).watch or "") if kind else ""
    except ConfigError:  # a kind not installed here
        return ""


def _has_policy(run_dir: Path) -> bool:
    final = run_dir / FINAL_DIR
    return final.is_dir() and any(final.iterdir())


def _modified(run_dir: Path) -> float | None:
    times = []
    for name in ("state.json", "metrics.jsonl", CONFIG_FILE):
        with contextlib.suppress(OSError):
            times.append((run_dir / name).stat().st_mtime)
    return max(times) if times else None


def _last_line(path: Path) -> str:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in deque(f, maxlen=20) if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""
