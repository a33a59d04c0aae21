"""An LM run's start-up phases reach the bus, in order, as the console shows them: the learner
loads the model, counts its SFT steps, publishes version 0 and evaluates it, then waits for the
first rollout; the sampler starts its engine, waits for version 0, warms up and serves; a
restarted learner says it resumed from its checkpoint.

The job's real expansion and each service's real `main`, in this process (as
tests/integration/test_lm_presets.py, with the transformers engine), on the session's real NATS.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_wildcard
from services.ports import free_ports
from services.registry import ServiceContext, get_job, get_service

pytestmark = pytest.mark.slow  # whole (tiny) runs: not in `make test-fast`

RUN_TIMEOUT_S = 240.0


class Events:
    """Every status message and progress record of a run, as (source, text), in arrival order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def on_message(self, msg: Any) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        if kind == "status":
            status = events_pb2.RunStatus.FromString(msg.data)
            self.seen.append((status.source, status.message))
        elif kind == "progress":
            record = struct_pb2.Struct.FromString(msg.data)
            fields = json_format.MessageToDict(record)
            self.seen.append(
                (fields["source"], f"{fields['unit']} {fields['done']:g}/{fields['total']:g}")
            )

    def index(self, source: str, prefix: str) -> int:
        """Where ``source`` first said something starting with ``prefix`` (fails if never)."""
        for i, (who, text) in enumerate(self.seen):
            if who == source and text.startswith(prefix):
                return i
        raise AssertionError(
            f"{source} never said {prefix!r}; seen:\n" + "\n".join(map(str, self.seen))
        )


async def run(entries: list[dict[str, Any]], run_name: str, run_dir: Path, nats_url: str) -> None:
    """Every service of ``entries`` until the main one returns (then the others are stopped)."""
    ports = free_ports(len(entries))
    endpoints = {e["name"]: f"127.0.0.1:{p}" for e, p in zip(entries, ports, strict=True)}
    contexts, tasks = [], {}
    for entry, port in zip(entries, ports, strict=True):
        service = get_service(entry["service"])
        ctx = ServiceContext(
            name=entry["name"],
            kind=entry["service"],
            settings=service.settings.model_validate(entry["settings"]),
            run_name=run_name,
            run_dir=run_dir,
            port=port,
            nats_url=nats_url,
            endpoints=endpoints,
        )
        contexts.append(ctx)
        tasks[entry["name"]] = asyncio.create_task(service.main(ctx), name=entry["name"])
    main = next(e["name"] for e in entries if e.get("main"))
    try:
        pending = set(tasks.values())
        while not tasks[main].done():
            done, pending = await asyncio.wait(
                pending, timeout=RUN_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert done, f"the run did not finish within {RUN_TIMEOUT_S:g}s"
            for task in done:
                task.result()
    finally:
        for ctx in contexts:
            ctx.stop_event.set()
        results = await asyncio.wait_for(
            asyncio.gather(*tasks.values(), return_exceptions=True), 60
        )
        failed = [r for r in results if isinstance(r, Exception)]
        assert not failed, f"services failed: {failed}"


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
async def test_lm_run_announces_its_start_up_phases_in_order(
    tiny_model_dir: Path, nats_server: Any, tmp_path: Path
) -> None:
    spec = get_job("grpo")
    settings = spec.settings.model_validate({
        "model_path": str(tiny_model_dir),
        "dataset": {"generator": "arith", "digits": 1},
        "engine": "hf",
        "group_size": 4,
        "prompts_per_call": 4,
        "groups_per_update": 1,
        "total_updates": 1,
        "minibatch_size": 4,
        "max_tokens": 6,
        "sft_steps": 4,
        "sft_batch_size": 4,
        "eval_count": 4,
        "device": "cpu",
    })  # fmt: skip
    run_name, run_dir = f"phases-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    entries = spec.expand(settings, run_name)
    events = Events()
    bus = await Bus.connect(nats_server.url, name="test-phases")
    try:
        await bus.nc.subscribe(events_wildcard(run_name), cb=events.on_message)
        await run(entries, run_name, run_dir, nats_server.url)
        # Started again, finished: it resumes, evaluates its new version (reward) and ends.
        again = [e for e in entries if e["name"] in ("reward", "learner")]
        await run(again, run_name, run_dir, nats_server.url)
        await asyncio.sleep(0.5)  # the last events in flight
    finally:
        await bus.close()

    learner = [
        "loading model",
        "model ready in",
        "SFT warm start: 4 steps of 4 examples",
        "sft step 4/4",
        "SFT done in",
        "evaluating version 0 on 4 held-out prompts",
        "version 0: eval accuracy",
        "waiting for the first rollout groups",
        "first rollout group in from rollout-0 (policy v0); training update 1 of 1",
        "update 1/1",
        "1 updates, 1 groups",  # the run's end (RunStatus DONE)
        "resumed from checkpoint update-00000001 (update 1 of 1: the run is finished)",
    ]
    at = [events.index("learner", text) for text in learner]
    assert at == sorted(at), events.seen
    sampler = [
        "starting the hf engine",
        "starting the hf engine: done in",
        # The warm-up runs before the first weights are in (while the learner warm-starts).
        "warming up on a first generation",
        "warming up on a first generation: done in",
        "waiting for the first weights from learner",
        "loaded weights v0",
        "ready: serving version 0",
    ]
    on = [events.index("sampler-0", text) for text in sampler]
    assert on == sorted(on), events.seen
    # Across services: version 0 exists after SFT, and the first rollout needs a ready sampler.
    assert at[4] < on[5] and on[6] < at[8]
