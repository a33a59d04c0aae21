"""The language-model workload of the learner loop (learner.loop): trajectory groups in,
GRPO-family updates (learner.lm.update) of a transformers causal LM on a DeepSpeed engine,
Hugging Face-named weight versions and a Hugging Face ``final/`` folder out.

What is particular to it: the optional SFT warm start before version 0, the KL reference model,
DAPO's dynamic sampling (groups without signal are filtered), and held-out greedy evaluations
(at version 0, every ``eval.every`` updates and at the end; ``learner/eval.jsonl``).

Groups filtered out or invalid are announced (``bus.v1.GroupsDropped`` on
``rlfleet.v1.events.<run>.dropped``, per producing driver, coalesced): rollout drivers pace on
the groups they published (clients/trajectories/pacing.py) and take each such group as credit for
another, or they would wait for a version that cannot come. Stale and duplicate groups are not
announced (see pacing.py for why).

Order of a fresh run: load the model -> optional SFT warm start -> publish version 0 (samplers
wait for it) -> evaluate it (the warm-started baseline) -> updates, each publishing a version.

A vision-language model: decoding a group fetches the images it names (``image_sha256``) from the
run's image store and runs the model's image processor on them, so updates score exactly the
pixels the sampler saw. Its vision parts that never train (``freeze_*``, or left out of LoRA) go
out in the first version only (``weights/sync_bytes`` counts what each version sends).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clients.reward import RewardClient
from common.datasets import Task, iter_tasks
from common.images import ImageError, open_image
from learner.algos.presets import Preset, resolve_preset
from learner.consumer import now
from learner.engine import Engine, build_engine
from learner.lm.batch import PromptPixels, Sample, decode_group
from learner.lm.env_episodes import EnvEpisodes
from learner.lm.evaluate import generate_greedy, held_out_tasks, score_accuracy
from learner.lm.model import (
    context_length,
    hf_weights,
    image_pixels,
    is_vision_model,
    load_causal_lm,
    load_policy,
    load_processor,
    load_tokenizer,
    model_class,
    static_prefixes,
)
from learner.lm.phases import Announcer
from learner.lm.settings import LMLearnerSettings
from learner.lm.sft import expert_samples, sft_phase
from learner.lm.update import group_filter, lm_update
from learner.settings import DeepSpeedSettings, OptimizerSettings
from learner.workload import Envelope, Progress, RunHandle
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from services.bus import events_subject
from services.bus.images import ImageStore
from services.calls import call_with_retry
from services.errors import InvalidArgument, RlfleetError, Unavailable
from services.registry import ServiceContext
from services.run_layout import EVAL_SAMPLES_FILE

__all__ = ["LMWorkload", "reward_metrics"]

log = logging.getLogger(__name__)

# SFT progress records at most this often: the console shows one per interval, more are noise.
EVAL_SAMPLES = 8  # answers kept per evaluation (learner/eval_samples.jsonl)
SFT_PROGRESS_EVERY_S = 1.0
DROPPED_EVENTS = (
    "dropped"  # GroupsDropped's event kind (the drivers' clients/trajectories/pacing.py)
)
# The progress line `rlfleet up` shows (services.progress): (label, metric) in display order.
HEADLINE = (
    ("reward", "reward/total"),
    ("eval", "eval/accuracy"),
    ("tok/s", "charts/train_tokens_per_s"),
)


class LMWorkload:
    """GRPO-family RL over TrajectoryGroups (see learner.workload.Workload for the protocol)."""

    durable = "lm-learner"
    message_type = trajectory_pb2.TrajectoryGroup
    noun = "groups"
    # Samplers start their engines during the warm start and wait for version 0 meanwhile.
    serve_before_first_version = True

    def __init__(self, ctx: ServiceContext[LMLearnerSettings], settings: LMLearnerSettings) -> None:
        self.ctx, self.settings = ctx, settings
        self.messages_per_update = settings.groups_per_update
        self.preset: Preset = resolve_preset(settings.preset, **settings.algo)
        self.engine: Engine | None = None
        self.reference: torch.nn.Module | None = None  # frozen, for the KL term
        self.tokenizer: Any = None
        self.processor: Any = None  # a vision-language model's (images -> pixels); else None
        self._images: ImageStore | None = None  # the run's images, once the bus is up
        self.vocab_size = 0
        # Vision parts that never change: left out of every version after the first.
        self._static: list[str] = []
        self._static_bytes = 0
        self._published_full = False
        self._sync: dict[str, float] = {}  # the last version's weights/* metrics
        self.sft_done = False
        self.evals: list[dict[str, float]] = []
        self._eval_tasks: list[Task] | None = None  # the same held-out prompts every time
        self._filtered_streak = 0  # groups filtered out in a row
        self._decoding: Any = None  # the message being decoded and accepted (its drop's source)
        self._run: RunHandle | None = None  # the bus for GroupsDropped, counters; from `begin`
        self._last_update: Mapping[str, float] = {}  # its metrics stay on the progress line
        # Drops not announced yet: (producer, reason) -> group ids; one task sends them.
        self._dropped: dict[tuple[str, str], list[str]] = {}
        self._announcing: asyncio.Task[None] | None = None
        self._tokens_this_run = 0  # completion tokens since consuming began: tokens/s
        self._resumed = False  # restored from a checkpoint: announced by begin
        # Start-up phases on the console (model, SFT, baseline eval, first rollout).
        self.phases = Announcer(ctx)
        self._first_group_in = False

    # ------------------------------------------------------------------ set-up and state

    async def setup(self) -> None:
        """The phases' bus client (the model is a local folder: nothing else to await)."""
        await self.phases.open()

    def build(self) -> Engine:
        s = self.settings
        started = time.perf_counter()
        self.phases.say(f"loading model {s.model_path} onto a DeepSpeed engine ({s.device})")
        self.tokenizer = load_tokenizer(s.model_path)
        if is_vision_model(s.model_path):
            self.processor = load_processor(s.model_path)
        model = load_policy(s)
        self._static = static_prefixes(model)
        ds = engine_settings(s)
        self.engine = build_engine(model, OptimizerSettings(lr=s.learning_rate, eps=1e-8), ds)
        module: Any = self.engine.module  # a transformers model
        self.vocab_size = module.get_input_embeddings().num_embeddings
        if self.preset.kl_beta > 0:
            # The reference is the model RL starts from: refreshed after SFT when there is one.
            self.reference = load_causal_lm(s.model_path, precision=s.precision, frozen=True)
        log.info("lm workload: preset %s", s.preset)
        params = sum(p.numel() for p in module.parameters())
        self.phases.say(
            f"model ready in {time.perf_counter() - started:.1f} s ({params:,} parameters, "
            f"{self.engine.device}, preset {s.preset})"
        )
        return self.engine

    def restore(self, state: dict[str, Any]) -> None:
        self.sft_done = bool(state.get("sft_done"))
        self.evals = list(state.get("evals", []))
        self._resumed = True

    def state(self) -> dict[str, Any]:
        return {"sft_done": self.sft_done, "evals": self.evals}

    def warm_start(self, run: RunHandle) -> None:
        """SFT on the dataset's solutions (fresh runs only); refreshes the KL reference."""
        s = self.settings
        assert self.engine is not None
        if s.sft is None or s.sft.steps == 0 or self.sft_done:
            return
        steps, started = s.sft.steps, time.perf_counter()
        self.phases.say(f"SFT warm start: {steps} steps of {s.sft.batch_size} examples")
        shown = [0.0]  # when the last progress record went out

        def on_step(step: int, loss: float) -> None:
            now_s = time.perf_counter()
            if step == steps or now_s - shown[0] >= SFT_PROGRESS_EVERY_S:
                shown[0] = now_s
                self.phases.count("sft step", step, steps, [("sft_loss", loss)])

        if s.env is not None:  # the env's expert demonstrations, fetched before training
            count = steps * s.sft.batch_size
            self.phases.say(f"fetching {count} demonstrations of {s.env.env_id}")
            assert self.phases.loop is not None  # opened by setup
            fetching = asyncio.run_coroutine_threadsafe(
                self._demonstrations(count), self.phases.loop
            )
            samples = iter(fetching.result())
        else:
            samples = expert_samples(
                iter_tasks(s.sft.dataset, split="train"), self.tokenizer, self.processor
            )
        history = sft_phase(
            self.engine,
            self.tokenizer,
            samples,
            steps=s.sft.steps,
            batch_size=s.sft.batch_size,
            learning_rate=s.sft.learning_rate,
            on_step=on_step,
            pack_tokens=self.pack_tokens(),
        )
        for metrics in history:
            run.write_scalars(metrics, int(metrics["sft/step"]))
        self.sft_done = True
        if self.reference is not None:
            self.reference.load_state_dict(self.engine.module.state_dict(), strict=False)
        loss = f" (loss {history[-1]['sft/loss']:.3f})" if history else ""
        self.phases.say(
            f"SFT done in {time.perf_counter() - started:.1f} s{loss}; publishing version 0"
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """The full model the first time, then all but the vision parts that never change
        (samplers replace the tensors a version names and keep the others)."""
        assert self.engine is not None
        skip = self._static if self._published_full else []
        weights = hf_weights(self.engine.module, skip=skip)
        if not self._published_full:  # what later versions leave out, as published
            static = tuple(self._static)
            self._static_bytes = _tensor_bytes(
                t for n, t in weights.items() if n.startswith(static)
            )
            self._published_full = True
        sent = _tensor_bytes(weights.values())
        saved = self._static_bytes if skip else 0
        self._sync = {"weights/sync_bytes": float(sent), "weights/sync_saved_bytes": float(saved)}
        if saved:
            log.info(
                "weights: %.1f MB sent, %.1f MB of frozen vision parts (%s) not sent again",
                sent / 1e6,
                saved / 1e6,
                ", ".join(p.rstrip(".") for p in skip),
            )
        return weights

    async def begin(self, run: RunHandle) -> None:
        """Evaluate version 0 (the warm-started baseline) unless a restored run already did."""
        self._run = run
        if self.processor is not None:
            self._images = ImageStore(run.bus.payloads, run.run_name)
        p, total = run.progress, self.settings.total_updates
        if self._resumed:
            finished = ": the run is finished" if p.updates >= total else ""
            self.phases.say(
                f"resumed from checkpoint update-{p.updates:08d} (update {p.updates} of {total}"
                f"{finished})",
                running=True,
            )
        cfg, s = self.settings.eval, self.settings
        if not self.evals and cfg is not None and (s.reward_service or s.env) is not None:
            self.phases.say(f"evaluating version {p.version} on {cfg.count} held-out prompts")
            await self.evaluate(run)
            last = self.evals[-1]
            self.phases.say(
                f"version {p.version}: eval accuracy {last['eval/accuracy']:.3f} "
                f"({last['eval/s']:.1f} s)"
            )
        if p.updates < total:
            self.phases.say(
                "waiting for the first rollout groups (the samplers start their engines and "
                "warm up)"
            )

    # ------------------------------------------------------------------ messages

    def envelope(self, message: Any) -> Envelope:
        # Expert completions (CHORD) carry no sampling policy: the oldest sampled one counts.
        sampled = [c.policy_version for c in message.completions if not c.expert]
        return Envelope(message.group_id, int(min(sampled or [message.policy_version])))

    async def decode(self, message: Any) -> list[Sample]:
        # The loop accepts (or drops as invalid) what it decodes at once: remember whose it is.
        self._decoding = message
        if not self._first_group_in and self._run is not None:
            self._first_group_in = True
            self.phases.say(
                f"first rollout group in from {message.source or 'a driver'} "
                f"(policy v{message.policy_version}); training update "
                f"{self._run.progress.updates + 1} of {self.settings.total_updates}"
            )
        try:
            pixels = await self._pixels(message)
            return decode_group(message, self.vocab_size, pixels)
        except InvalidArgument:
            self._announce_drop("invalid")
            raise

    async def _pixels(self, message: Any) -> PromptPixels | None:
        """The images the group names (none for a text prompt), fetched and processed for a
        vision-language model; None for a text model (``decode_group`` refuses images)."""
        if self.processor is None:
            return None
        digests = list(message.image_sha256)
        tokens = (int(self.processor.image_token_id), int(self.processor.image_seq_len))
        if not digests:
            return PromptPixels(np.zeros(0, np.float32), np.zeros(0, bool), *tokens)
        assert self._images is not None  # made by begin, before anything is consumed
        images = []
        store = self._images
        for i, digest in enumerate(digests):
            where = f"image_sha256[{i}]"
            # NATS away for a moment (a restart, a failover) is waited out, not a crash.
            data = await call_with_retry(
                functools.partial(store.get, digest, where),
                f"fetching {where} of {message.group_id}",
                self.ctx.stop_event,
            )
            if data is None:  # stopping: the group is not applied, and comes again
                raise Unavailable(f"stopped while fetching {where} of {message.group_id}")
            try:
                images.append(open_image(data, name=where))
            except ImageError as exc:
                raise InvalidArgument(str(exc), field="image_sha256") from None
        # Resizing and normalising is CPU work: off the event loop, which serves the bus.
        values, mask = await asyncio.to_thread(image_pixels, self.processor, images)
        return PromptPixels(values, mask, *tokens)

    def accept(self, decoded: list[Sample]) -> tuple[list[Sample], str | None]:
        kept, reason = group_filter(decoded, self.preset)
        if reason is None:
            self._filtered_streak = 0
            self._decoding = None
            return kept, None
        self._announce_drop(reason)
        self._filtered_streak += 1
        if self._filtered_streak % 100 == 0:
            log.warning(
                "%d groups in a row filtered out (last: %s): with dynamic sampling a group needs "
                "rewards that differ; is the task too hard or too easy?",
                self._filtered_streak,
                reason,
            )
        return [], reason

    def samples(self, items: list[Sample]) -> int:
        return len(items)

    # ------------------------------------------------------------------ credit for drops

    def _announce_drop(self, reason: str) -> None:
        """Queue a GroupsDropped for the group being decoded (sent by a task, coalesced with
        the other drops of the same moment: the loop drops many in a row at times)."""
        message, self._decoding = self._decoding, None
        if message is None or self._run is None or not message.source or not message.group_id:
            return
        self._dropped.setdefault((message.source, reason), []).append(message.group_id)
        if self._announcing is None or self._announcing.done():
            self._announcing = asyncio.get_running_loop().create_task(
                self._announce(), name="groups-dropped"
            )

    async def _announce(self) -> None:
        run, subject = self._run, events_subject(self.ctx.run_name, DROPPED_EVENTS)
        assert run is not None
        while self._dropped:  # drops queued while publishing go out in the next round
            await asyncio.sleep(0)  # let the loop drop what else is at hand first
            (producer, reason), ids = self._dropped.popitem()
            event = events_pb2.GroupsDropped(
                run=self.ctx.run_name,
                source=self.ctx.name,
                producer=producer,
                count=len(ids),
                reason=reason,
                group_ids=ids,
                version=run.progress.version,
                time=now(),
            )
            try:
                await run.bus.publish_event(subject, event)
            except RlfleetError as exc:  # best effort: the driver's version_wait_s backs it up
                log.warning("could not announce %d dropped groups: %s", len(ids), exc)

    # ------------------------------------------------------------------ training

    def pack_tokens(self) -> int | None:
        """Tokens per packed row with ``packing`` (the model's context length), else None."""
        if not self.settings.packing:
            return None
        assert self.engine is not None
        return context_length(self.engine.module)

    def train(
        self, items: list[Sample], progress: Progress, generator: torch.Generator
    ) -> dict[str, float]:
        s = self.settings
        assert self.engine is not None
        lags = [progress.version - x.policy_version for x in items if not x.expert]
        metrics = lm_update(
            self.engine,
            self.reference,
            items,
            self.preset,
            pad_id=self.tokenizer.pad_token_id,
            lr=s.learning_rate,
            step=progress.updates,
            epochs=s.epochs,
            minibatch_size=s.minibatch_size,
            micro_batch_size=s.micro_batch_size,
            version=progress.version,  # older samples are stale: preset.old_logp
            generator=generator,
            pack_tokens=self.pack_tokens(),
        )
        metrics["charts/policy_lag"] = float(np.mean(lags)) if lags else 0.0
        return metrics

    def report(
        self, items: list[Sample], metrics: dict[str, float], progress: Progress, elapsed_s: float
    ) -> dict[str, float]:
        p = progress
        self._tokens_this_run += int(metrics.get("rollout/completion_tokens", 0))
        dropped = p.stale_dropped + p.filtered_dropped + p.invalid_dropped
        return {
            **reward_metrics([x for x in items if not x.expert]),
            "charts/train_tokens_per_s": self._tokens_this_run / elapsed_s,
            "charts/dropped_groups": float(dropped),
            "charts/filtered_groups": float(p.filtered_dropped),
            **self._sync,
        }

    def step(self, progress: Progress) -> int:
        return progress.updates

    async def after_update(self, run: RunHandle, metrics: Mapping[str, float]) -> None:
        self._last_update = metrics
        cfg = self.settings.eval
        if cfg is not None and run.progress.updates % cfg.every == 0:
            await self.evaluate(run)
        await self._publish_progress(run)

    async def _publish_progress(self, run: RunHandle) -> None:
        """The progress record of `rlfleet up`'s progress line (updates of total_updates)."""
        values = {**(self.evals[-1] if self.evals else {}), **self._last_update}
        total = self.settings.total_updates
        await run.publish_progress("update", run.progress.updates, total, HEADLINE, values)

    async def _env_episodes(self) -> EnvEpisodes:
        """The learner's own episodes of the run's text env, once its env server answers."""
        cfg = self.settings.env
        assert cfg is not None
        episodes = EnvEpisodes(cfg, self.ctx.resolve(cfg.env_server), self.tokenizer)
        await episodes.ready(self.ctx.stop_event)
        return episodes

    async def _demonstrations(self, count: int) -> list[Sample]:
        episodes = await self._env_episodes()
        return await episodes.demonstrations(count, self.settings.seed)

    async def evaluate(self, run: RunHandle) -> None:
        """Held-out greedy accuracy of the current weights (logged as eval/accuracy)."""
        s, cfg = self.settings, self.settings.eval
        if cfg is None or (s.reward_service is None and s.env is None):
            return
        assert self.engine is not None
        if s.env is not None:
            started = time.perf_counter()
            episodes = await self._env_episodes()
            accuracy, outcomes, played = await episodes.evaluate(
                self.engine.module, cfg.count, s.seed, run.progress.version
            )
            samples = [
                {"messages": e.messages, "reward": e.reward, "outcome": e.outcome}
                for e in played[:EVAL_SAMPLES]
            ]
            await self._record_eval(run, {"eval/accuracy": accuracy, **outcomes}, started, samples)
            return
        if self._eval_tasks is None:
            self._eval_tasks = held_out_tasks(cfg, s.total_updates * s.groups_per_update)
        tasks = self._eval_tasks
        started = time.perf_counter()
        texts = await asyncio.to_thread(
            generate_greedy,
            self.engine.module,
            self.tokenizer,
            tasks,
            max_tokens=cfg.max_tokens,
            batch_size=cfg.batch_size,
            processor=self.processor,
        )

        assert s.reward_service is not None  # checked above: no env, so a reward service
        async with RewardClient(self.ctx.resolve(s.reward_service)) as client:

            async def score(items: list[dict[str, Any]]) -> list[float | None]:
                results = await client.score(items, [(cfg.reward, 1.0)])
                return [r.scores[cfg.reward].score for r in results]

            accuracy, scores = await score_accuracy(score, tasks, texts)
        samples = [
            {"prompt": t.text(), "completion": c, "score": sc}
            for t, c, sc in list(zip(tasks, texts, scores, strict=True))[:EVAL_SAMPLES]
        ]
        await self._record_eval(run, {"eval/accuracy": accuracy}, started, samples)

    async def _record_eval(
        self,
        run: RunHandle,
        values: dict[str, float],
        started: float,
        samples: list[dict[str, Any]],
    ) -> None:
        record = {
            **values,
            "eval/version": float(run.progress.version),
            "eval/update": float(run.progress.updates),
            "eval/s": time.perf_counter() - started,
        }
        self.evals.append(record)
        await run.report(record)
        with (run.dirs.learner / "eval.jsonl").open("a") as out:
            out.write(json.dumps(record) + "\n")
        # The first few answers of each evaluation, to read what the numbers mean.
        with (run.dirs.learner / EVAL_SAMPLES_FILE).open("a") as out:
            version, update = run.progress.version, run.progress.updates
            out.write(json.dumps({"version": version, "update": update, "samples": samples}))
            out.write("\n")

    # ------------------------------------------------------------------ the end

    def done(self, progress: Progress) -> bool:
        return progress.updates >= self.settings.total_updates

    async def finish(self, run: RunHandle) -> None:
        """The final evaluation, unless the last one was of this very version."""
        version = run.progress.version
        if self.settings.eval is not None and (
            not self.evals or self.evals[-1]["eval/version"] != version
        ):
            await self.evaluate(run)
            await self._publish_progress(run)  # the line ends on the final evaluation

    def save_final(self, final_dir: Path, progress: Progress) -> None:
        """``final/``: a Hugging Face folder (LoRA merged) that from_pretrained and vLLM load,
        and ``rlfleet_run.json`` (counters, eval curve)."""
        assert self.engine is not None
        p = progress
        path = self.settings.model_path
        model = model_class(path).from_pretrained(str(path))
        model.load_state_dict(hf_weights(self.engine.module, torch.float32), strict=False)
        model.save_pretrained(final_dir)
        # A vision-language model's processor holds the tokenizer and the image processor.
        (self.processor or self.tokenizer).save_pretrained(final_dir)
        summary = {  # the names this file has always used
            "updates": p.updates,
            "version": p.version,
            "samples": p.samples,
            "groups": p.messages,
            "stale": p.stale_dropped,
            "duplicates": p.duplicates_dropped,
            "invalid": p.invalid_dropped,
            "filtered": p.filtered_dropped,
            "evals": self.evals,
        }
        (final_dir / "rlfleet_run.json").write_text(json.dumps(summary, indent=2) + "\n")

    def summary(self, progress: Progress) -> str:
        text = f"{progress.updates} updates, {progress.messages} groups"
        if self.evals:
            first, last = self.evals[0], self.evals[-1]
            text += (
                f"; eval accuracy {first['eval/accuracy']:.3f} (v{int(first['eval/version'])}) -> "
                f"{last['eval/accuracy']:.3f} (v{int(last['eval/version'])})"
            )
        return text

    async def close(self) -> None:
        """Send the drops and phases not announced yet (the bus closes after this)."""
        if self._announcing is not None:
            await asyncio.gather(self._announcing, return_exceptions=True)
        await self.phases.close()


def reward_metrics(samples: list[Sample]) -> dict[str, float]:
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


def _tensor_bytes(tensors: Any) -> int:
    """The bytes of ``tensors`` (an iterable of tensors)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def engine_settings(s: LMLearnerSettings) -> DeepSpeedSettings:
    """The DeepSpeed settings of the LM learner's engine."""
    return DeepSpeedSettings(
        zero_stage=s.zero_stage,
        precision=s.precision,
        gradient_clipping=s.max_grad_norm,
        train_micro_batch_size=s.micro_batch_size or s.minibatch_size,
        device=s.device,
        cache_dir=s.cache_dir,
    )
