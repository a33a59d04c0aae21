"""Children spawned with a `preexec_fn` while the parent has gRPC calls in flight: with gRPC's
fork support on, grpcio >= 1.80 aborts some of them before their exec (grpc/grpc#43055), which
is how a launcher health-checking one service lost another it was starting. The runtime turns
fork support off (services/__init__.py); this runs the race in a fresh interpreter, both ways."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Four tasks keep health checks in flight on an in-process server while the loop's thread
# spawns children with a preexec_fn (the launcher's parent-death signal); prints the failures.
RACE = textwrap.dedent(
    """
    import asyncio, signal, subprocess, sys
    import services  # first, as every rlfleet entry point: it sets gRPC's environment
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from services.bus.nats_server import parent_death_signal

    async def main(children):
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)
        done = False

        async def check():
            while not done:
                await stub.Check(health_pb2.HealthCheckRequest())

        checks = [asyncio.create_task(check()) for _ in range(4)]
        failed = 0
        for _ in range(children):
            child = subprocess.Popen(
                ["/bin/true"], preexec_fn=parent_death_signal(signal.SIGTERM),
                stderr=subprocess.PIPE,
            )
            failed += bool(child.communicate()[1] or child.returncode)
            await asyncio.sleep(0.002)
        done = True
        await asyncio.gather(*checks)
        await channel.close()
        await server.stop(None)
        print(failed)

    asyncio.run(main(int(sys.argv[1])))
    """
)


def _failed_children(children: int, **env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run(
        [sys.executable, "-c", RACE, str(children)],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_spawned_during_grpc_calls_all_reach_exec() -> None:
    assert _failed_children(300) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_race_is_real_with_fork_support_on() -> None:
    """The control: the same race with fork support on loses children (about 1 in 10 here), so
    the test above passes because of the setting, not because the race never happens. A grpcio
    that fixed the bug loses none: then the setting is no longer needed, which this reports."""
    import grpc

    try:
        failed = _failed_children(300, GRPC_ENABLE_FORK_SUPPORT="true")
    except subprocess.TimeoutExpired:
        # A child stuck between fork and exec blocks the script's wait for it: the same race,
        # hanging instead of aborting (seen beside a CPU hog), where fork support off never did.
        return
    if failed == 0:
        pytest.skip(f"grpcio {grpc.__version__} lost no child with fork support on (fixed?)")
