"""The `lm_learner` service kind: trajectory groups in from JetStream, GRPO-family updates of a
transformers causal LM on a DeepSpeed engine, Hugging Face-named weight versions out.

Same delivery guarantees as the game learner (learner/service.py), through the same pieces
(learner.consumer, learner.weights, learner.engine): a group is acked only once a checkpoint
covers the update that applied it; stale, duplicate, malformed and filtered groups are ledgered.

Order of a fresh run: load the model -> optional SFT warm start -> publish version 0 (samplers
wait for it) -> evaluate it (the warm-started baseline) -> updates, each publishing a version.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import random
import time
from typing import Any

import numpy as np
import torch

from common.datasets import iter_tasks, take
from learner.algos.presets import Preset, resolve_preset
from learner.consumer import (
    Ledger,
    TrajectoryConsumer,
    next_version,
    now,
    publish_version,
    rng_state,
    set_rng_state,
    settle,
)
from learner.engine import Engine, build_engine
from learner.game import AppliedWindow, triage
from learner.lm.batch import Sample, decode_group
from learner.lm.evaluate import generate_greedy, score_accuracy
from learner.lm.model import hf_weights, load_causal_lm, load_tokenizer
from learner.lm.settings import LMLearnerSettings
from learner.lm.sft import sft_phase
from learner.lm.update import group_filter, lm_update
from learner.settings import DeepSpeedSettings, OptimizerSettings
from learner.weights import SERVICE_NAME as WEIGHTS_SERVICE
from learner.weights import WeightServicer, WeightStore, add_weight_service
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from services.bus import Bus, events_subject, stream_name, traj_subject
from services.errors import InvalidArgument, RlfleetError
from services.registry import ServiceContext, ServiceSpec
from services.server import GrpcServer

__all__ = ["SPEC", "LMLearner", "main"]

log = logging.getLogger(__name__)

DURABLE = "lm-learner"
_COUNTERS = (
    "updates",
    "version",
    "samples",
    "groups",
    "stale",
    "duplicates",
    "invalid",
    "filtered",
)


class LMLearner:
    """One learner incarnation; ``run()`` returns when the run is done or the service stopped."""

    def __init__(self, ctx: ServiceContext, settings: LMLearnerSettings) -> None:
        self.ctx, self.settings = ctx, settings
        self.run_name = ctx.run_name
        self.dirs = {
            name: ctx.run_dir / name for name in ("checkpoints", "learner", "final", "tensorboard")
        }
        self.preset: Preset = resolve_preset(settings.preset, **settings.algo)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.sft_done = False
        self.evals: list[dict[str, float]] = []
        self.applied = AppliedWindow(settings.applied_window)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.ledger = Ledger(self.dirs["learner"] / "applied.jsonl")
        self.engine: Engine | None = None
        self.reference: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.store: WeightStore | None = None
        self.bus: Bus | None = None
        self.server: GrpcServer | None = None
        self.consumer: TrajectoryConsumer | None = None
        self.writer: Any = None
        self._checkpointed = 0
        self._started = time.monotonic()
        self._tokens_this_run = 0
        self._eval_tasks: list[Any] | None = None

    # ------------------------------------------------------------------ set-up

    def _build(self) -> None:
        s = self.settings
        random.seed(s.seed)
        np.random.seed(s.seed)
        torch.manual_seed(s.seed)
        self.tokenizer = load_tokenizer(s.model_path)
        model = load_causal_lm(s.model_path, precision=s.precision, lora=s.lora)
        ds = DeepSpeedSettings(
            zero_stage=s.zero_stage,
            precision=s.precision,
            gradient_clipping=s.max_grad_norm,
            train_micro_batch_size=s.minibatch_size,
            device=s.device,
            cache_dir=s.cache_dir,
        )
        self.engine = build_engine(model, OptimizerSettings(lr=s.learning_rate, eps=1e-8), ds)
        state = self.engine.load(self.dirs["checkpoints"])
        if state is not None:
            self.counters.update({k: int(state.get(k, 0)) for k in _COUNTERS})
            self.sft_done = bool(state.get("sft_done"))
            self.evals = list(state.get("evals", []))
            self.applied = AppliedWindow(s.applied_window, state.get("applied", ()))
            set_rng_state(self.generator, state["rng"])
            self._checkpointed = self.counters["updates"]
        counts = self.ledger.restore(self.counters["updates"])
        for status in ("stale", "invalid", "filtered"):
            self.counters[status] = counts.get(status, 0)
        if self.preset.kl_beta > 0:
            # The reference is the model RL starts from: after SFT when there is one.
            self.reference = load_causal_lm(s.model_path, precision=s.precision, frozen=True)
        log.info(
            "lm learner %s at update %d (%s); preset %s",
            self.ctx.name,
            self.counters["updates"],
            "restored" if state is not None else "fresh",
            s.preset,
        )

    def _warm_start(self) -> None:
        """SFT on the dataset's solutions (fresh runs only); refreshes the KL reference."""
        s = self.settings
        assert self.engine is not None
        if s.sft is None or s.sft.steps == 0 or self.sft_done:
            return
        history = sft_phase(
            self.engine,
            self.tokenizer,
            iter_tasks(s.sft.dataset, split="train"),
            steps=s.sft.steps,
            batch_size=s.sft.batch_size,
            learning_rate=s.sft.learning_rate,
        )
        for metrics in history:
            self._scalars(metrics, int(metrics["sft/step"]))
        self.sft_done = True
        if self.reference is not None:
            self.reference.load_state_dict(self.engine.module.state_dict(), strict=False)

    async def _publish_weights(self) -> None:
        assert self.engine and self.store and self.bus and self.server
        named = await asyncio.to_thread(hf_weights, self.engine.module)
        self.counters["version"] = await publish_version(
            self.store, self.bus, self.run_name, named, self.dirs["learner"], self.server.address
        )

    # ------------------------------------------------------------------ the run

    async def run(self) -> None:
        s, ctx = self.settings, self.ctx
        self.dirs["learner"].mkdir(parents=True, exist_ok=True)
        self.server = GrpcServer(ctx.name, host=ctx.host, port=ctx.port)
        try:
            if ctx.nats_url is None:
                raise InvalidArgument("the learner needs the bus: no NATS url given")
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dirs["tensorboard"]))
            await asyncio.to_thread(self._build)
            # Serving before the warm start: samplers start their engines meanwhile and wait for
            # the first announced version (the WeightService has none to give until then).
            self.store = WeightStore(
                self.run_name,
                keep=s.keep_versions,
                start_version=next_version(
                    self.dirs["learner"], self.counters["updates"], self._version
                ),
            )
            self.server.add_service(add_weight_service, WeightServicer(self.store), WEIGHTS_SERVICE)
            await self.server.start()
            self.server.set_serving()
            self.bus = await Bus.connect(ctx.nats_url, name=ctx.name)
            await self.bus.ensure_stream(stream_name(self.run_name), [traj_subject(self.run_name)])
            await asyncio.to_thread(self._warm_start)
            await self._publish_weights()
            log.info("lm learner serving on %s, version %d", self.server.address, self._version)
            if not self.evals:
                await self._evaluate()
            self.consumer = TrajectoryConsumer(
                self.bus,
                stream=stream_name(self.run_name),
                durable=DURABLE,
                subject=traj_subject(self.run_name),
                message_type=trajectory_pb2.TrajectoryGroup,
                batch=s.groups_per_update,
                ack_wait_s=s.ack_wait_s,
                max_ack_pending=s.max_ack_pending,
                stop_event=ctx.stop_event,
                on_invalid=lambda exc: self._drop(None, "invalid", error=str(exc)),
            )
            self.consumer.start()
            self._started = time.monotonic()
            await self._loop()
        finally:
            await self._shutdown()

    @property
    def _version(self) -> int:
        return self.counters["version"]

    def _done(self) -> bool:
        return self.counters["updates"] >= self.settings.total_updates

    async def _loop(self) -> None:
        s, stop = self.settings, self.ctx.stop_event
        while not self._done() and not stop.is_set():
            samples = await self._gather()
            if samples is None:
                break
            await self._train(samples)
            if s.eval is not None and self.counters["updates"] % s.eval.every == 0:
                await self._evaluate()
            if self.counters["updates"] - self._checkpointed >= s.checkpoint_every:
                await self._checkpoint()
        if self._done():
            await self._finish()

    # ------------------------------------------------------------------ consuming

    def _drop(self, msg: Any, status: str, **extra: Any) -> None:
        key = {"stale": "stale", "invalid": "invalid", "filtered": "filtered"}[status]
        self.counters[key] += 1
        self.ledger.write(
            id=getattr(msg, "group_id", None),
            status=status,
            update=self.counters["updates"],
            version=self._version,
            policy_version=getattr(msg, "policy_version", None),
            **extra,
        )

    async def _gather(self) -> list[Sample] | None:
        """``groups_per_update`` trainable groups (DAPO's dynamic sampling keeps pulling until
        the batch is full of groups with signal); None when stopped."""
        s = self.settings
        assert self.consumer is not None and self.engine is not None
        samples: list[Sample] = []
        ids: set[str] = set()
        streak = 0  # groups filtered out in a row
        vocab = self.engine.module.get_input_embeddings().num_embeddings
        while len(ids) < s.groups_per_update:
            delivery = await self.consumer.next()
            if delivery is None:
                return None
            msg = delivery.message
            version = min(
                [c.policy_version for c in msg.completions if not c.expert] or [msg.policy_version]
            )
            verdict = triage(
                msg.group_id, version, self._version, s.max_policy_lag, self.applied, ids
            )
            if verdict == "duplicate":
                self.counters["duplicates"] += 1
                self.consumer.hold(delivery)
                continue
            if verdict == "stale":
                self._drop(msg, "stale")
                await settle(delivery.ack())
                continue
            try:
                group = decode_group(msg, vocab)
            except InvalidArgument as exc:
                self._drop(msg, "invalid", error=str(exc))
                log.warning("dropped group %s: %s", msg.group_id, exc)
                await settle(delivery.term())
                continue
            kept, reason = group_filter(group, self.preset)
            if reason is not None:
                self._drop(msg, "filtered", reason=reason)
                await settle(delivery.ack())
                streak += 1
                if streak % 100 == 0:
                    log.warning(
                        "%d groups in a row filtered out (last: %s): with dynamic sampling a "
                        "group needs rewards that differ; is the task too hard or too easy?",
                        streak,
                        reason,
                    )
                continue
            streak = 0
            samples.extend(kept)
            ids.add(msg.group_id)
            self.consumer.hold(delivery)
        return samples

    # ------------------------------------------------------------------ training

    async def _train(self, samples: list[Sample]) -> None:
        s = self.settings
        assert self.engine is not None and self.consumer is not None
        group_ids = list(dict.fromkeys(x.group_id for x in samples))
        rl = [x for x in samples if not x.expert]
        lags = [self._version - x.policy_version for x in rl]
        started = time.perf_counter()
        metrics = await asyncio.to_thread(
            lm_update,
            self.engine,
            self.reference,
            samples,
            self.preset,
            pad_id=self.tokenizer.pad_token_id,
            lr=s.learning_rate,
            step=self.counters["updates"],
            epochs=s.epochs,
            minibatch_size=s.minibatch_size,
            recompute_old_logp=s.recompute_old_logp,
            generator=self.generator,
        )
        train_s = time.perf_counter() - started
        self.counters["updates"] += 1
        self.counters["groups"] += len(group_ids)
        self.counters["samples"] += len(samples)
        for gid in group_ids:
            self.applied.add(gid)
            self.ledger.write(
                id=gid, status="applied", update=self.counters["updates"], version=self._version
            )
        self.consumer.applied()
        await self._publish_weights()
        self._tokens_this_run += int(metrics.get("rollout/completion_tokens", 0))
        elapsed = max(time.monotonic() - self._started, 1e-9)
        metrics.update(_reward_metrics(rl))
        metrics.update(
            {
                "charts/policy_lag": float(np.mean(lags)) if lags else 0.0,
                "charts/train_tokens_per_s": self._tokens_this_run / elapsed,
                "charts/update_s": train_s,
                "charts/dropped_groups": float(
                    self.counters["stale"] + self.counters["filtered"] + self.counters["invalid"]
                ),
                "charts/filtered_groups": float(self.counters["filtered"]),
            }
        )
        await self._report(metrics)

    def _scalars(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    self.writer.add_scalar(key, value, step)

    async def _report(self, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        step = self.counters["updates"]
        self._scalars(clean, step)
        message = events_pb2.Metrics(
            run=self.run_name,
            source=self.ctx.name,
            step=step,
            time=now(),
            scalars=clean,
            policy_version=self._version,
        )
        assert self.bus is not None
        with contextlib.suppress(RlfleetError):
            await self.bus.publish_event(events_subject(self.run_name, "metrics"), message)
        log.info(
            "update %d v%d: %s",
            step,
            self._version,
            " ".join(f"{k}={v:.4g}" for k, v in sorted(clean.items())),
        )

    async def _evaluate(self) -> None:
        """Held-out greedy accuracy of the current weights (logged as eval/accuracy)."""
        s, cfg = self.settings, self.settings.eval
        if cfg is None or s.reward_service is None:
            return
        from reward_service.client import RewardClient

        assert self.engine is not None
        if self._eval_tasks is None:  # the same held-out prompts at every evaluation
            self._eval_tasks = take(iter_tasks(cfg.dataset, split=cfg.split), cfg.count)
        tasks = self._eval_tasks
        started = time.perf_counter()
        texts = await asyncio.to_thread(
            generate_greedy,
            self.engine.module,
            self.tokenizer,
            tasks,
            max_tokens=cfg.max_tokens,
            batch_size=cfg.batch_size,
        )

        async with RewardClient(self.ctx.resolve(s.reward_service)) as client:

            async def score(items: list[dict[str, Any]]) -> list[float | None]:
                results = await client.score(items, [(cfg.reward, 1.0)])
                return [r.scores[cfg.reward].score for r in results]

            accuracy = await score_accuracy(score, tasks, texts)
        record = {
            "eval/accuracy": accuracy,
            "eval/version": float(self._version),
            "eval/update": float(self.counters["updates"]),
            "eval/s": time.perf_counter() - started,
        }
        self.evals.append(record)
        await self._report(record)
        (self.dirs["learner"] / "eval.jsonl").open("a").write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ checkpoints, the end

    async def _checkpoint(self) -> None:
        assert self.engine is not None
        state = {
            **self.counters,
            "sft_done": self.sft_done,
            "evals": self.evals,
            "applied": self.applied.to_list(),
            "rng": rng_state(self.generator),
        }
        await asyncio.to_thread(
            self.engine.save,
            self.dirs["checkpoints"],
            f"update-{self.counters['updates']:08d}",
            state,
            keep=self.settings.keep_checkpoints,
        )
        self._checkpointed = self.counters["updates"]
        acked = await self.consumer.ack_checkpointed() if self.consumer is not None else 0
        log.info("checkpoint at update %d (%d groups acked)", self._checkpointed, acked)

    async def _finish(self) -> None:
        """Final evaluation, the final Hugging Face folder, last checkpoint, RunStatus DONE."""
        s = self.settings
        if s.eval is not None and (
            not self.evals or self.evals[-1]["eval/version"] != self._version
        ):
            await self._evaluate()
        await asyncio.to_thread(self._save_final)
        await self._checkpoint()
        first, last = (self.evals[0], self.evals[-1]) if self.evals else ({}, {})
        summary = f"{self.counters['updates']} updates, {self.counters['groups']} groups"
        if first:
            summary += (
                f"; eval accuracy {first['eval/accuracy']:.3f} (v{int(first['eval/version'])}) -> "
                f"{last['eval/accuracy']:.3f} (v{int(last['eval/version'])})"
            )
        status = events_pb2.RunStatus(
            run=self.run_name,
            state=events_pb2.RUN_STATE_DONE,
            message=summary,
            source=self.ctx.name,
            time=now(),
        )
        assert self.bus is not None
        await self.bus.publish_event(events_subject(self.run_name, "status"), status)
        log.info("done: %s", summary)

    def _save_final(self) -> None:
        """``final/``: a Hugging Face folder (LoRA merged) that from_pretrained and vLLM load."""
        from transformers import AutoModelForCausalLM

        assert self.engine is not None
        final = self.dirs["final"]
        model = AutoModelForCausalLM.from_pretrained(str(self.settings.model_path))
        model.load_state_dict(hf_weights(self.engine.module, torch.float32), strict=False)
        model.save_pretrained(final)
        self.tokenizer.save_pretrained(final)
        (final / "rlfleet_run.json").write_text(
            json.dumps({**self.counters, "evals": self.evals}, indent=2) + "\n"
        )

    async def _shutdown(self) -> None:
        if self.engine is not None and self.counters["updates"] > self._checkpointed:
            with contextlib.suppress(Exception):
                await self._checkpoint()
        if self.consumer is not None:
            await self.consumer.close()
        self.ledger.close()
        if self.writer is not None:
            self.writer.close()
        if self.bus is not None:
            await self.bus.close()
        if self.server is not None:
            await self.server.stop()
        if self.engine is not None:
            self.engine.close()


def _reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """reward/<function> means over the batch (raw scores), reward/total, reward/std."""
    out: dict[str, float] = {}
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for x in samples:
        for name, value in x.scores.items():
            by_name[name].append(value)
    for name, values in by_name.items():
        out[f"reward/{name}"] = float(np.mean(values))
    totals = [x.reward for x in samples if x.reward is not None]
    if totals:
        out["reward/total"] = float(np.mean(totals))
        out["reward/std"] = float(np.std(totals))
    return out


async def main(ctx: ServiceContext) -> None:
    settings: LMLearnerSettings = ctx.settings  # type: ignore[assignment]
    await LMLearner(ctx, settings).run()


SPEC = ServiceSpec(kind="lm_learner", settings=LMLearnerSettings, main=main, grpc=True)
