"""The studio's web app: the dashboard's page and endpoints over every run of the workdir, plus
the studio's own under ``/api/studio``.

- ``GET /api/studio``: what this studio is (workdir, runs folder); the page shows the studio's
  views when it answers.
- ``GET /api/studio/jobs``, ``GET /api/studio/jobs/{kind}``: the job kinds, and one kind's
  knob tree (launch/knobs.py, what ``rlfleet jobs KIND`` prints) with the ``run:`` section's.
- ``GET /api/studio/free-port``: a free loopback port (for a serve run the page writes).
- ``GET /api/studio/catalogs``: what forms pick from (``envs``, ``rewards``: the
  ``rlfleet.catalogs`` entry points).
- ``POST /api/studio/validate`` ``{"yaml"}``: the run file checked as ``rlfleet validate``
  checks it.
- ``GET|POST /api/studio/runs``: the runs (launch/studio/book.py); a new run from ``{"yaml",
  "start"}``.
- ``GET|DELETE /api/studio/runs/{id}``, ``POST /api/studio/runs/{id}/{stop|resume|restart}``,
  ``GET /api/studio/runs/{id}/config`` (the run file; ``?download=1`` as an attachment),
  ``GET /api/studio/runs/{id}/logs[/{name}?lines=N]``, ``GET
  /api/studio/runs/{id}/eval-samples`` (a language-model run's latest evaluation answers).
- ``/api/studio/runs/{id}/tasks``: long commands on a run (launch/studio/tasks.py).

Errors are ``{"detail": ...}`` (plus ``issues``: ``[{"path", "line", "message"}]`` for an
invalid run file, 422): 400 a malformed request, 403 no or a wrong token, 404 unknown run or
kind, 409 an action the run's state forbids. Requests that change something must be JSON
(``application/json``) and, when the browser says where they come from, come from this page:
another site's page cannot start or delete runs through a visitor's browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import typing
from collections.abc import AsyncIterator, Callable
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from launch.dashboard.app import dashboard_routes
from launch.dashboard.metrics import Runs
from launch.knobs import knob_fields, summary
from launch.studio.book import RunBook
from launch.studio.http import BadRequest, handled, json_body, text_field
from launch.studio.tasks import TaskBoard, task_routes
from services import ports
from services.config import RunSection
from services.errors import ConfigError, NotFound
from services.registry import CATALOGS_GROUP, JOBS_GROUP, entry_point_registry, get_job

__all__ = ["TOKEN_COOKIE", "create_studio_app"]

TOKEN_COOKIE = "rlfleet_studio_token"


def create_studio_app(book: RunBook, *, token: str | None = None) -> ASGIApp:
    """The studio over ``book``'s runs; with ``token``, every request must carry it."""
    lock = asyncio.Lock()  # one action on the runs at a time (a start, a delete)
    tasks = TaskBoard(book)

    async def about(request: Request) -> Response:
        return JSONResponse({"workdir": str(book.workdir), "runs_dir": str(book.root)})

    async def free_port(request: Request) -> Response:
        # For a run file the page writes (a serve run's port): free now, like `port: 0`, but
        # known before the run starts, so the page can show the URL.
        return JSONResponse({"port": ports.free_port()})

    async def jobs(request: Request) -> Response:
        rows = []
        for kind in entry_point_registry(JOBS_GROUP):
            try:
                rows.append({"kind": kind, "description": summary(get_job(kind).settings.__doc__)})
            except ConfigError as exc:  # one broken plugin must not hide the others
                rows.append({"kind": kind, "description": f"(failed to load: {exc})"})
        return JSONResponse({"jobs": rows})

    @handled
    async def job(request: Request) -> Response:
        kind = request.path_params["kind"]
        try:
            spec = get_job(kind)
        except ConfigError as exc:
            raise NotFound(exc.message) from None
        return JSONResponse({
            "kind": spec.kind,
            "description": summary(spec.settings.__doc__, first_sentence=False),
            "run": knob_fields(RunSection),
            "job": knob_fields(spec.settings),
        })  # fmt: skip

    async def catalogs(request: Request) -> Response:
        found: dict[str, Any] = {}
        registry = entry_point_registry(CATALOGS_GROUP)
        for name in registry:
            try:
                rows = typing.cast(Callable[[], list[dict[str, Any]]], registry[name])
                found[name] = await asyncio.to_thread(rows)
            except Exception as exc:  # a broken catalog leaves its list empty, with why
                found[name] = []
                found.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        return JSONResponse(found)

    @handled
    async def validate(request: Request) -> Response:
        text = text_field(await json_body(request), "yaml")
        config = await asyncio.to_thread(book.validate, text)
        services = [e.name for e in config.services]
        return JSONResponse({"ok": True, "run": config.run.name, "services": services})

    async def runs(request: Request) -> Response:
        entries = await asyncio.to_thread(book.entries)
        return JSONResponse({"runs": [e.to_json() for e in entries]})

    @handled
    async def create(request: Request) -> Response:
        data = await json_body(request)
        text, start = text_field(data, "yaml"), data.get("start", True)
        if not isinstance(start, bool):
            raise BadRequest("'start' must be true or false")
        async with lock:
            entry = await asyncio.to_thread(book.create, text, start=start)
        return JSONResponse(entry.to_json(), status_code=201)

    @handled
    async def run(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if request.method == "DELETE":
            async with lock:
                await asyncio.to_thread(book.delete, run_id)
            return Response(status_code=204)
        return JSONResponse((await asyncio.to_thread(book.get, run_id)).to_json())

    @handled
    async def action(request: Request) -> Response:
        run_id, name = request.path_params["run_id"], request.path_params["action"]
        act = {"stop": book.stop, "resume": book.resume, "restart": book.restart}.get(name)
        if act is None:
            raise NotFound(f"no action '{name}' (stop, resume, restart)")
        async with lock:
            entry = await asyncio.to_thread(act, run_id)
        return JSONResponse(entry.to_json())

    @handled
    async def config(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        text = await asyncio.to_thread(book.config_text, run_id)
        headers = {"Cache-Control": "no-cache"}
        if request.query_params.get("download"):
            headers["Content-Disposition"] = f'attachment; filename="{run_id}.yaml"'
        return PlainTextResponse(text, media_type="application/yaml", headers=headers)

    @handled
    async def eval_samples(request: Request) -> Response:
        record = await asyncio.to_thread(book.eval_samples, request.path_params["run_id"])
        return JSONResponse({"eval": record})

    @handled
    async def logs(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        return JSONResponse({"logs": await asyncio.to_thread(book.logs, run_id)})

    @handled
    async def log(request: Request) -> Response:
        run_id, name = request.path_params["run_id"], request.path_params["name"]
        raw = request.query_params.get("lines", "200")
        if not raw.isdigit() or int(raw) < 1:
            raise BadRequest(f"query parameter 'lines' must be an integer >= 1, not {raw!r}")
        lines = await asyncio.to_thread(book.log_tail, run_id, name, int(raw))
        return JSONResponse({"log": name, "lines": lines})

    routes = [
        Route("/api/studio", about),
        Route("/api/studio/jobs", jobs),
        Route("/api/studio/jobs/{kind}", job),
        Route("/api/studio/catalogs", catalogs),
        Route("/api/studio/free-port", free_port),
        Route("/api/studio/validate", validate, methods=["POST"]),
        Route("/api/studio/runs", runs, methods=["GET"]),
        Route("/api/studio/runs", create, methods=["POST"]),
        Route("/api/studio/runs/{run_id}", run, methods=["GET", "DELETE"]),
        Route("/api/studio/runs/{run_id}/config", config),
        Route("/api/studio/runs/{run_id}/eval-samples", eval_samples),
        Route("/api/studio/runs/{run_id}/logs", logs),
        Route("/api/studio/runs/{run_id}/logs/{name}", log),
        *task_routes(tasks),
        Route("/api/studio/runs/{run_id}/{action}", action, methods=["POST"]),
        *dashboard_routes(Runs(book.root)),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await tasks.close()
        book.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    return Guard(app, token)


class Guard:
    """ASGI middleware: the token (when set) on every request, from the ``Authorization:
    Bearer`` header, the studio's cookie, or ``?token=`` (which also sets the cookie, so the
    printed link works once); and for requests that change something, JSON bodies only and no
    other site's origin."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        from_query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])
        if self.token is not None:
            given = _bearer(headers) or _cookie(headers) or from_query[0]
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                await _reply(scope, receive, send, 403, "a valid studio token is required")
                return
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            problem = _foreign(headers, scope["method"])
            if problem is not None:
                await _reply(scope, receive, send, 403, problem)
                return
        if self.token is not None and from_query[0]:
            send = _setting_cookie(send, self.token)
        await self.app(scope, receive, send)


def _bearer(headers: dict[str, str]) -> str:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _cookie(headers: dict[str, str]) -> str:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(headers.get("cookie", ""))
    except Exception:  # a malformed cookie header is no token
        return ""
    morsel = jar.get(TOKEN_COOKIE)
    return morsel.value if morsel is not None else ""


def _foreign(headers: dict[str, str], method: str) -> str | None:
    """Why a state-changing request is refused (another site's page sent it), or None. A
    POST must be JSON: a plain HTML form of another site can post, but not JSON (a browser
    asks this server first, and it says no); other methods need that question anyway."""
    origin = headers.get("origin")
    if origin and urlsplit(origin).netloc != headers.get("host", ""):
        return f"requests from {origin} may not change runs"
    content_type = headers.get("content-type", "").split(";")[0].strip()
    if method == "POST" and content_type != "application/json":
        return "requests that change runs must send application/json"
    return None


def _setting_cookie(send: Send, token: str) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
            message = {
                **message,
                "headers": [*message["headers"], (b"set-cookie", cookie.encode())],
            }
        await send(message)

    return wrapped


async def _reply(scope: Scope, receive: Receive, send: Send, status: int, detail: str) -> None:
    await JSONResponse({"detail": detail}, status_code=status)(scope, receive, send)
