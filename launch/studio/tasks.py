"""Long commands the studio runs on a run: record an episode video (``rlfleet play --video``),
export (``rlfleet export``, optionally quantized), ask a language model (``rlfleet ask``).

Each is the ``rlfleet`` command a user would type, run as a child of the studio (it dies with
the studio: PR_SET_PDEATHSIG), with its output kept for the page. What it writes goes under
``<run dir>/studio/`` (videos, exports), served back by name. ``POST
/api/studio/runs/{id}/tasks`` ``{"kind", ...}`` starts one (202 with its id); ``GET
/api/studio/tasks/{task}`` is how it stands: ``state`` (running, done, failed), ``stage`` (the
latest line it said), ``stages`` done of ``stages_total`` where the command's kind knows them
(an export's steps), ``result`` (the command's JSON answer) and ``files`` (what it wrote).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from launch.studio.book import RunBook
from launch.studio.http import handled, json_body
from services.bus.nats_server import parent_death_signal
from services.errors import ConfigError, FailedPrecondition, NotFound

__all__ = ["OUTPUT_DIR", "TASK_KINDS", "Task", "TaskBoard", "task_routes"]

OUTPUT_DIR = "studio"  # under the run dir: what the studio's tasks wrote
LOG_LINES = 200  # a task's output kept for the page
MAX_RUNNING = 2  # tasks at once (each is a process loading torch)
QUANTIZE = ("w8a8", "w4a16", "w4a16-awq")
MAX_PROMPT_CHARS = 4000
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Plan:
    """What one task runs: the command's arguments (after ``rlfleet``), the files it will
    write (relative to the run dir) and how many steps it announces (None: unknown)."""

    args: list[str]
    files: list[str] = field(default_factory=list)
    stages_total: int | None = None
    stage_prefix: str = ""  # lines starting so are its steps


def _video(run_dir: Path, params: dict[str, Any], n: int) -> Plan:
    name = f"{OUTPUT_DIR}/episode-{n}.webm"  # VP9: plays in every browser build
    args = ["play", str(run_dir), "--episodes", "1", "--video", str(run_dir / name)]
    if params.get("deterministic", True):
        args.append("--deterministic")
    args += ["--json", str(run_dir / f"{OUTPUT_DIR}/episode-{n}.json")]
    return Plan(args, [name, f"{OUTPUT_DIR}/episode-{n}.json"])


def _export(run_dir: Path, params: dict[str, Any], n: int) -> Plan:
    scheme = params.get("quantize") or None
    if scheme is not None and scheme not in QUANTIZE:
        raise ConfigError(f"quantize {scheme!r}: unknown; known: {', '.join(QUANTIZE)}")
    name = f"{OUTPUT_DIR}/export-{scheme or 'full'}"
    args = ["export", str(run_dir), str(run_dir / name), "--force", "--json"]
    if scheme is not None:
        args += ["--quantize", scheme]
    # source, what it wrote (a game: ONNX and its parity check; an LM: the HF folder, plus
    # calibration and quantization), the manifest, done
    total = 5 if scheme else 4
    return Plan(args, [name], stages_total=total, stage_prefix="export ")


def _ask(run_dir: Path, params: dict[str, Any], n: int) -> Plan:
    prompt = params.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("prompt: a non-empty string is required")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ConfigError(f"prompt: {len(prompt)} characters, over {MAX_PROMPT_CHARS}")
    return Plan(["ask", str(run_dir), prompt, "--json"])


# kind -> (the plan for a run dir, params and the task's number)
TASK_KINDS: dict[str, Callable[[Path, dict[str, Any], int], Plan]] = {
    "video": _video,
    "export": _export,
    "ask": _ask,
}


@dataclass
class Task:
    id: str
    run: str
    kind: str
    plan: Plan
    state: str = "running"
    started: float = field(default_factory=time.time)
    ended: float | None = None
    exit: int | None = None
    stage: str = ""
    stages: int = 0
    output: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    result: Any = None
    process: asyncio.subprocess.Process | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "run": self.run,
            "kind": self.kind,
            "state": self.state,
            "started": self.started,
            "ended": self.ended,
            "exit": self.exit,
            "stage": self.stage,
            "stages": self.stages,
            "stages_total": self.plan.stages_total,
            "output": list(self.output),
            "result": self.result,
            "files": self.plan.files if self.state == "done" else [],
        }


class TaskBoard:
    """The studio's tasks; ``python`` runs the commands (this interpreter)."""

    def __init__(self, book: RunBook, python: str = sys.executable) -> None:
        self.book, self.python = book, python
        self.tasks: dict[str, Task] = {}
        self._numbers = itertools.count(1)
        self._watchers: set[asyncio.Task[None]] = set()

    async def start(self, run_id: str, kind: str, params: dict[str, Any]) -> Task:
        run_dir = self.book.run_dir(run_id)
        make = TASK_KINDS.get(kind)
        if make is None:
            raise NotFound(f"no task kind '{kind}' ({', '.join(TASK_KINDS)})")
        if sum(t.state == "running" for t in self.tasks.values()) >= MAX_RUNNING:
            raise FailedPrecondition(f"{MAX_RUNNING} tasks are running: wait for one to end")
        n = next(self._numbers)
        plan = make(run_dir, params, n)
        (run_dir / OUTPUT_DIR).mkdir(exist_ok=True)
        task = Task(f"t{n}", run_id, kind, plan)
        task.process = await asyncio.create_subprocess_exec(
            self.python,
            "-m",
            "launch",
            *plan.args,
            cwd=self.book.workdir,
            env={**self.book.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGTERM),
        )
        self.tasks[task.id] = task
        watcher = asyncio.create_task(self._follow(task))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return task

    def get(self, task_id: str) -> Task:
        task = self.tasks.get(task_id)
        if task is None:
            raise NotFound(f"no task '{task_id}'")
        return task

    async def _follow(self, task: Task) -> None:
        process = task.process
        assert process is not None and process.stdout is not None
        lines: list[str] = []
        async for raw in process.stdout:
            line = _ANSI.sub("", raw.decode("utf-8", errors="replace")).rstrip()
            if not line:
                continue
            lines.append(line)
            task.output.append(line)
            if not task.plan.stage_prefix or line.startswith(task.plan.stage_prefix):
                task.stage = line.removeprefix(task.plan.stage_prefix)
                task.stages += 1
        task.exit = await process.wait()
        task.ended = time.time()
        task.result = _json_answer(lines)
        task.state = "done" if task.exit == 0 else "failed"

    async def close(self) -> None:
        for task in self.tasks.values():
            if task.process is not None and task.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(task.process.pid, signal.SIGTERM)
        await asyncio.gather(*self._watchers, return_exceptions=True)


def _json_answer(lines: list[str]) -> Any:
    """The command's JSON answer (``--json``): the last block of lines that parses."""
    for start in range(len(lines) - 1, -1, -1):
        if lines[start].startswith(("{", "[")):
            with contextlib.suppress(ValueError):
                return json.loads("\n".join(lines[start:]))
    return None


def task_routes(board: TaskBoard) -> list[Route]:
    """The task endpoints (see the module doc)."""

    @handled
    async def start(request: Request) -> Response:
        data = await json_body(request)
        kind = data.pop("kind", None)
        if not isinstance(kind, str):
            raise ConfigError(f"kind: one of {', '.join(TASK_KINDS)}")
        task = await board.start(request.path_params["run_id"], kind, data)
        return JSONResponse(task.to_json(), status_code=202)

    @handled
    async def status(request: Request) -> Response:
        return JSONResponse(board.get(request.path_params["task_id"]).to_json())

    @handled
    async def file(request: Request) -> Response:
        run_dir = board.book.run_dir(request.path_params["run_id"])
        wanted = request.path_params["path"]
        folder = (run_dir / OUTPUT_DIR).resolve()
        path = (folder / wanted).resolve()
        if folder not in path.parents or not path.is_file():
            raise NotFound(f"no file '{wanted}' in the run's {OUTPUT_DIR}/")
        return FileResponse(path)

    return [
        Route("/api/studio/runs/{run_id}/tasks", start, methods=["POST"]),
        Route("/api/studio/tasks/{task_id}", status),
        Route("/api/studio/runs/{run_id}/files/{path:path}", file),
    ]
