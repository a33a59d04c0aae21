"""The live dashboard of ``rlfleet up``: a web page on 127.0.0.1 with the run's curves (every
service's metrics from ``<run dir>/metrics.jsonl``, earlier runs in ``runs/`` too) and the
launcher's service table; ``rlfleet up --tensorboard`` starts TensorBoard beside it.

- launch.dashboard.live: `LiveView`, what the launcher starts and stops.
- launch.dashboard.app: the Starlette app (page, static files, JSON endpoints).
- launch.dashboard.metrics: incremental reading of ``metrics.jsonl`` files.
- launch.dashboard.server: uvicorn on a thread of the launcher process.
- static/: the page (plain HTML/JS) and its chart library, uPlot (vendor/, MIT license), served
  from the package: no CDN, so the page works offline.
"""
