"""Services under fuzz: each one a real `rlfleet serve KIND` process on a loopback port.

A separate process per service, as in production, so that "the service kept serving" means
what it says: the process is alive, its health check answers SERVING, and a valid request still
gets a valid answer after every bad one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.ports import free_port

__all__ = ["Served", "serve"]


class Served:
    """A running service: its address, a channel to it and the process."""

    def __init__(self, kind: str, address: str, process: subprocess.Popen[bytes], log: Path):
        self.kind, self.address, self.process, self.log = kind, address, process, log
        self.channel = grpc.insecure_channel(address)

    def assert_serving(self) -> None:
        """The process is alive and its health check says SERVING."""
        assert self.process.poll() is None, f"{self.kind} died:\n{self.log.read_text()[-3000:]}"
        stub = health_pb2_grpc.HealthStub(self.channel)
        status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"{self.kind}: {status}"


@contextlib.contextmanager
def serve(kind: str, settings: dict[str, Any], tmp: Path) -> Iterator[Served]:
    """Start `rlfleet serve kind` with `settings`; stop it (and its process group) after."""
    config = tmp / f"{kind}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "fuzz-" + kind.replace("_", "-"), "dir": str(tmp / "runs")},
                "services": [{"name": kind, "service": kind, "settings": settings}],
            }
        )
    )
    port = free_port()
    log = tmp / f"{kind}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.serve", kind, "--config", str(config),
             "--name", kind, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    served = Served(kind, f"127.0.0.1:{port}", process, log)
    try:
        _wait_serving(served, timeout_s=120)
        yield served
    finally:
        served.channel.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _wait_serving(served: Served, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            served.assert_serving()
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
