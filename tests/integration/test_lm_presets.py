"""Every LM preset runs end to end on the arithmetic example for a few updates: the job's real
expansion (reward service, learner, sampler, rollout driver) with each service's real `main`,
real gRPC on loopback ports and a real NATS server, in this process (no launcher: starting five
interpreters per preset would cost minutes; tests/e2e/test_grpo_arith.py covers the launcher).

The sampler uses the transformers engine here (vLLM's start-up is covered once per session by
the sampler and e2e tests).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from learner.lm.jobs import PRESET_NAMES
from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject
from services.ports import free_ports
from services.registry import ServiceContext, get_job, get_service

pytestmark = pytest.mark.slow  # vLLM and whole runs: not in `make test-fast`

RUN_TIMEOUT_S = 240.0


async def run_job(
    kind: str,
    knobs: dict[str, Any],
    run_dir: Path,
    nats_url: str,
    dropped: list[events_pb2.GroupsDropped] | None = None,
) -> dict[str, Any]:
    """Expand ``kind`` with ``knobs`` and run every service until the main one returns;
    ``dropped`` collects the learner's GroupsDropped events."""
    spec = get_job(kind)
    settings = spec.settings.model_validate(knobs)
    assert spec.prepare is not None
    spec.prepare(settings, run_dir)
    run_name = f"{kind.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    if dropped is not None:
        bus = await Bus.connect(nats_url, name="test-drops")
        sub = await bus.subscribe(events_subject(run_name, "dropped"), events_pb2.GroupsDropped)

        async def collect() -> None:
            async for delivery in sub:
                dropped.append(delivery.message)

        collecting = asyncio.create_task(collect())
    entries = spec.expand(settings, run_name)
    ports = free_ports(len(entries))
    endpoints = {e["name"]: f"127.0.0.1:{p}" for e, p in zip(entries, ports, strict=True)}
    contexts, tasks = {}, {}
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
        contexts[entry["name"]] = ctx
        tasks[entry["name"]] = asyncio.create_task(service.main(ctx), name=entry["name"])
    main = next(e["name"] for e in entries if e.get("main"))
    try:
        # Drivers stop by themselves once the learner announces the run is DONE; any service
        # failing before the learner is done fails the test at once.
        pending = set(tasks.values())
        while not tasks[main].done():
            done, pending = await asyncio.wait(
                pending, timeout=RUN_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert done, f"the run did not finish within {RUN_TIMEOUT_S:g}s"
            for task in done:
                task.result()
    finally:
        for ctx in contexts.values():
            ctx.stop_event.set()
        results = await asyncio.wait_for(
            asyncio.gather(*tasks.values(), return_exceptions=True), 60
        )
        failed = {
            name: r for name, r in zip(tasks, results, strict=True) if isinstance(r, Exception)
        }
        assert not failed, f"services failed: {failed}"
        if dropped is not None:
            await asyncio.sleep(0.5)  # the last events in flight
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
            await sub.aclose()
            await bus.close()
    return json.loads((run_dir / "final" / "rlfleet_run.json").read_text())


def small_job(model_dir: Path, **knobs: Any) -> dict[str, Any]:
    """The example's job shrunk to a few seconds: 2 updates of 2 groups of 4 short completions,
    the transformers engine."""
    return {
        "model_path": str(model_dir),
        "dataset": {"generator": "arith", "digits": 1},
        "engine": "hf",
        "group_size": 4,
        "prompts_per_call": 4,
        "groups_per_update": 2,
        "total_updates": 2,
        "minibatch_size": 8,
        "max_tokens": 8,
        "device": "cpu",
        **knobs,
    }


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
@pytest.mark.parametrize("preset", PRESET_NAMES)
async def test_preset_runs_end_to_end(preset, tiny_model_dir, nats_server, tmp_path):
    knobs = small_job(
        tiny_model_dir,
        # DAPO's dynamic sampling drops groups whose rewards are all equal: warm up enough that
        # some completions are right (an untrained model's groups are all 0 and never fill).
        sft_steps=60 if preset == "dapo" else 2,
        eval_count=8,
        eval_every=1,
        checkpoint_every=1,
    )
    dropped: list[events_pb2.GroupsDropped] = []
    summary = await run_job(preset, knobs, tmp_path / "run", nats_server.url, dropped)
    assert summary["updates"] == 2
    assert summary["groups"] == 4  # groups_per_update x updates, none twice
    assert [e["eval/update"] for e in summary["evals"]] == [0.0, 1.0, 2.0]
    per_group = 4 + (1 if preset == "chord" else 0)  # CHORD adds the expert solution
    assert summary["samples"] == 4 * per_group
    ledger = [
        json.loads(line)
        for line in (tmp_path / "run" / "learner" / "applied.jsonl").read_text().splitlines()
    ]
    applied = [e["id"] for e in ledger if e["status"] == "applied"]
    assert len(applied) == len(set(applied)) == 4
    # Every group filtered out (or invalid) is announced to its driver as credit for another
    # (DAPO's dynamic sampling would stall the drivers otherwise), and only those.
    untrained = sorted(e["id"] for e in ledger if e["status"] in ("filtered", "invalid"))
    announced = sorted(i for event in dropped for i in event.group_ids)
    assert announced == untrained
    assert all(e.producer == "rollout-0" and e.count == len(e.group_ids) for e in dropped)


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
async def test_lora_run_publishes_merged_full_weights(tiny_model_dir, nats_server, tmp_path):
    """With `lora`, only adapters train, yet samplers get (and final/ holds) full HF weights."""
    import torch
    from transformers import AutoModelForCausalLM

    knobs = small_job(
        tiny_model_dir, sft_steps=5, sft_learning_rate=1e-2, eval_count=0, lora={"r": 4, "alpha": 8}
    )
    summary = await run_job("grpo", knobs, tmp_path / "run", nats_server.url)
    assert summary["updates"] == 2
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert set(final) == set(base)  # plain checkpoint names, no lora_ keys
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(final[name], base[name])  # the adapters were merged in
    assert torch.equal(final["model.norm.weight"], base["model.norm.weight"])  # not adapted


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
async def test_a_packed_lora_run_trains_end_to_end(
    tiny_model_dir, nats_server, tmp_path, monkeypatch
):
    """`packing: true` through the real learner (its SFT phase and updates), with LoRA adapters
    around the model: the packed forward goes through the DeepSpeed engine and PEFT."""
    from learner.lm import packing

    budgets: list[int] = []
    original = packing.packed_logprobs

    def counted(model, input_ids, attention_mask, budget, **kwargs):
        budgets.append(budget)
        return original(model, input_ids, attention_mask, budget, **kwargs)

    monkeypatch.setattr(packing, "packed_logprobs", counted)
    knobs = small_job(tiny_model_dir, sft_steps=5, eval_count=0, packing=True, lora={"r": 4})
    summary = await run_job("grpo", knobs, tmp_path / "run", nats_server.url)
    assert summary["updates"] == 2
    assert budgets and set(budgets) == {512}  # the tiny model's context length
    assert (tmp_path / "run" / "final" / "config.json").is_file()
