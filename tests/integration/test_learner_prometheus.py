"""A real `rlfleet serve learner` on a real NATS exports its training curves on /metrics
(learner/prometheus.py): after a few real updates on published fragments and episodes, every
game-learner gauge the Grafana dashboard and the alert rules in deploy/ read has a value."""

from __future__ import annotations

import asyncio
import math
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject, stream_name, traj_subject
from services.ports import free_port
from tests.integration.test_learner_service import (
    Watcher,
    fragment,
    learner_run,
    start_learner,
    until,
)

pytestmark = [
    pytest.mark.slow,  # a DeepSpeed learner service
    pytest.mark.timeout(300),
    pytest.mark.asyncio(loop_scope="session"),
]

UPDATES = 2
# What a game learner exports once it has trained and seen episodes (a subset of EXPORTED: the
# LM and DPO gauges stay unset here).
GAME_GAUGES = (
    "rlfleet_learner_episodic_return",
    "rlfleet_learner_episodic_length",
    "rlfleet_learner_env_steps_per_second",
    "rlfleet_learner_policy_loss",
    "rlfleet_learner_value_loss",
    "rlfleet_learner_loss",
    "rlfleet_learner_entropy",
    "rlfleet_learner_approx_kl",
    "rlfleet_learner_policy_lag",
    "rlfleet_learner_nonfinite_updates",
    "rlfleet_learner_updates",
    "rlfleet_learner_policy_version",
)


def scrape(port: int, run: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("run") == run
    }


async def test_learner_exports_its_training_curves_after_real_updates(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, run_dir, config = learner_run(tmp_path, "itest-prom", 100)
    metrics_port = free_port()
    monkeypatch.setenv("RLFLEET_METRICS_PORT", str(metrics_port))  # start_learner passes it on
    watcher = Watcher()
    async with Bus.connect(nats_url, name="test-learner-prometheus") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        tasks = await watcher.watch(bus, run)
        learner = await start_learner(config, run, run_dir, nats_url, free_port())
        try:
            await until(lambda: watcher.weights)  # version 0 is out: the learner is ready
            for update in range(1, UPDATES + 1):
                for seq in (2 * update - 2, 2 * update - 1):
                    message = fragment(run, seq, 0)
                    await bus.publish(traj_subject(run), message, msg_id=f"{run}/{seq}")
                await until(lambda u=update: any(m.step == u for m in watcher.metrics))
                if update == 1:  # it watches episodes by now: the next report has their stats
                    for length in (20, 30):
                        episode = events_pb2.EpisodeStats(
                            run=run, source="actor-0", episode_return=length, length=length
                        )
                        await bus.publish_event(events_subject(run, "episodes"), episode)
                    await asyncio.sleep(1.0)
            got = await asyncio.to_thread(scrape, metrics_port, run)
        finally:
            learner.terminate()
            await asyncio.wait_for(learner.wait(), 60)
            for task in tasks:
                task.cancel()
    missing = [name for name in GAME_GAUGES if name not in got]
    assert not missing, f"not exported after {UPDATES} updates: {missing}"
    assert all(math.isfinite(got[name]) for name in GAME_GAUGES), got
    assert (got["rlfleet_learner_updates"], got["rlfleet_learner_policy_version"]) == (2, 2)
    assert got["rlfleet_learner_episodic_return"] == 25.0
    assert got["rlfleet_learner_env_steps_per_second"] > 0
    assert got["rlfleet_learner_nonfinite_updates"] == 0
