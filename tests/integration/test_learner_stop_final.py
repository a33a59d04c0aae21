"""Every game run leaves a playable policy, and a finished run says so when started again: the
`learner` service (as `rlfleet serve learner` runs it, on a real NATS) stopped with SIGTERM
writes ``final/`` marked incomplete, `load_policy` reads it; run to its end, ``final/`` is
complete; started once more, the learner logs that the run is already finished and how to start
afresh or continue, and its DONE RunStatus says the same."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from common.artifacts import load_policy
from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, stream_name, traj_subject
from services.ports import free_port
from tests.integration.test_learner_service import (
    Watcher,
    fragment,
    learner_run,
    start_learner,
    until,
)

pytestmark = [
    pytest.mark.slow,  # DeepSpeed learner services: not in `make test-fast`
    pytest.mark.timeout(300),
    pytest.mark.asyncio(loop_scope="session"),
]


async def test_stopped_run_leaves_final_and_a_finished_run_says_so(
    nats_url: str, tmp_path: Path
) -> None:
    run, run_dir, config = learner_run(tmp_path, "itest-stop", 4, policy={"hidden_sizes": [16]})
    port = free_port()
    watcher = Watcher()
    async with Bus.connect(nats_url, name="test-learner-stop") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        tasks = await watcher.watch(bus, run)
        learner = await start_learner(config, run, run_dir, nats_url, port)
        try:
            await until(lambda: watcher.weights)
            for seq in range(2):
                await bus.publish(traj_subject(run), fragment(run, seq, 0), msg_id=f"{run}/{seq}")
            await until(lambda: any(m.step == 1 for m in watcher.metrics))
            learner.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(learner.wait(), 60) == 0
            stopped = json.loads((run_dir / "final/policy.json").read_text())
            assert stopped["complete"] is False and stopped["stopped_at_update"] == 1
            policy = load_policy(run_dir)
            assert policy.directory == run_dir / "final" and not policy.complete
            assert policy.predict([0.0, 0.0, 0.0, 0.0], deterministic=True) in (0, 1)

            learner = await start_learner(config, run, run_dir, nats_url, port)
            for seq in range(2, 4):
                await bus.publish(traj_subject(run), fragment(run, seq, 0), msg_id=f"{run}/{seq}")
            assert await asyncio.wait_for(learner.wait(), 120) == 0
            final = json.loads((run_dir / "final/policy.json").read_text())
            assert final["complete"] is True and final["updates"] == 2
            assert "stopped_at_update" not in final

            watcher.status.clear()
            learner = await start_learner(config, run, run_dir, nats_url, port)
            assert await asyncio.wait_for(learner.wait(), 120) == 0
            await until(lambda: watcher.status)
        finally:
            if learner.returncode is None:
                learner.kill()
                await learner.wait()
            for task in tasks:
                task.cancel()

    status = watcher.status[-1]
    assert status.state == events_pb2.RUN_STATE_DONE
    assert f"run '{run}' is already finished" in status.message
    assert "total_timesteps" in status.message and f"rm -r {run_dir}" in status.message
    log = (run_dir / "learner.log").read_text()
    lines = [line for line in log.splitlines() if "is already finished" in line]
    assert lines and "To start afresh" in lines[0] and "raise total_timesteps" in lines[0]
    assert json.loads((run_dir / "final/policy.json").read_text())["complete"] is True
