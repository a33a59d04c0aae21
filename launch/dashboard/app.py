"""The dashboard's web app: the page, its static files and three JSON endpoints.

- ``GET /api/runs``: the runs in ``runs/`` (the current one first) — ``{"runs": [{"id",
  "current", "modified", "size"}]}``.
- ``GET /api/runs/{id}/metrics?since=N&generation=G``: the run's series from record ``N`` on
  (see launch.dashboard.metrics: ``cursor`` and ``generation`` to send next time, ``reset``
  when the client must drop what it has).
- ``GET /api/services``: the live state of every service of the current run, as the launcher
  tracks it (``state``: waiting, starting, healthy, running, restarting, finished, failed,
  stopped; ``restarts``; ``pid``; ``address``; ``last_exit``).

Errors are ``{"detail": "..."}``: 404 for an unknown run, 422 for a bad query value. The page
polls (a second apart): with a cursor each poll carries only new points, and polling needs
nothing held open when the launcher stops. Starlette rather than FastAPI: the launcher imports
it at every start, and it loads in a fifth of the time. Handlers are ``async`` so they run one
at a time on the server's loop, and the incremental readers need no lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from launch.dashboard.metrics import Runs, UnknownRun

__all__ = ["STATIC", "ServiceStatus", "create_app", "dashboard_routes"]

STATIC = Path(__file__).parent / "static"

# The launcher's read-only view of its services: one dict per service (see the module doc).
ServiceStatus = Callable[[], list[dict[str, Any]]]


class BadQuery(ValueError):
    pass


def _count(request: Request, name: str) -> int | None:
    """The query parameter ``name`` as an integer >= 0 (None when absent); BadQuery if not."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise BadQuery(f"query parameter '{name}' must be an integer >= 0, not {raw!r}")
    return int(raw)


def create_app(runs: Runs, status: ServiceStatus | None = None) -> Starlette:
    """The app over ``runs``; ``status`` gives the current run's services (none without it)."""
    return Starlette(routes=dashboard_routes(runs, status))


def dashboard_routes(runs: Runs, status: ServiceStatus | None = None) -> list[BaseRoute]:
    """The page, its static files and the endpoints above (the studio serves them too)."""

    async def list_runs(request: Request) -> Response:
        return JSONResponse({"runs": [asdict(r) for r in runs.list()]})

    async def run_metrics(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            since, generation = _count(request, "since") or 0, _count(request, "generation")
            file = runs.metrics(run_id)
        except BadQuery as exc:
            return JSONResponse({"detail": str(exc)}, status_code=422)
        except UnknownRun as exc:
            return JSONResponse({"detail": str(exc)}, status_code=404)
        return JSONResponse({"run": run_id, **file.since(since, generation)})

    async def services(request: Request) -> Response:
        current = runs.current.name if runs.current is not None else None
        return JSONResponse({"run": current, "services": status() if status else []})

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    return [
        Route("/", index),
        Route("/api/runs", list_runs),
        Route("/api/runs/{run_id}/metrics", run_metrics),
        Route("/api/services", services),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
