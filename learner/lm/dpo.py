"""Offline DPO (Rafailov et al. 2023, arXiv:2305.18290) on (prompt, chosen, rejected) JSONL.

A run file's ``job: {kind: dpo, ...}`` (learner/lm/dpo_job.py: the knobs) runs this as the
``dpo_learner`` service (learner/lm/dpo_service.py) under ``rlfleet up``; in Python,
``train(settings, output_dir)`` or ``DPOTrainer(settings, output_dir).run()``:

1. pairs are read and validated (learner/lm/dpo_data.py) and tokenized; only completion tokens
   are scored, a sequence's log-prob being the sum of its completion tokens' log-probs;
2. the reference log-probs are computed once, before any update: with LoRA by running the policy
   with its adapter disabled (no second model is held), else with a frozen copy that is freed
   right after. Every later step then costs one forward/backward of the policy alone;
3. each step runs chosen and rejected in one batch through the DeepSpeed engine
   (learner.engine, client AdamW) and applies learner.algos' ``dpo_loss``;
4. every ``checkpoint_every`` steps a DeepSpeed checkpoint goes to ``output_dir/checkpoints``
   (tag ``update-NNNNNNNN``, the step); a new trainer on the same folder resumes after it (the
   shuffles are seeded per epoch, so it sees the pairs it would have seen);
5. metrics go to the ``Reporter`` (the service's publishes them on the bus), stdout and
   TensorBoard (``output_dir/tensorboard``); the final model is saved as a Hugging Face folder
   (``output_dir/final``, LoRA merged, tokenizer included) that ``from_pretrained``, vLLM and
   ``rlfleet export`` load.

Under ``torchrun`` each rank trains on its slice of every global batch (rank 0 logs and saves).
One file for one trainer, read top to bottom, CleanRL-style; data preparation
is in learner/lm/dpo_data.py and the loss in learner.algos.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor

from common.images import open_image
from learner.algos import dpo_loss
from learner.engine import build_engine
from learner.lm.batch import image_inputs, pad_images
from learner.lm.dpo_data import EncodedPair, encode_pair, load_pairs
from learner.lm.dpo_job import DPOSettings
from learner.lm.model import (
    context_length,
    hf_weights,
    image_pixels,
    is_vision_model,
    load_causal_lm,
    load_policy,
    load_processor,
    load_tokenizer,
    sequence_logprobs,
    token_logprobs,
)
from learner.settings import DeepSpeedSettings, OptimizerSettings
from learner.tracking import NO_TRACKERS, Trackers

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["DPOResult", "DPOSettings", "DPOTrainer", "Reporter", "train"]

log = logging.getLogger(__name__)

CHECKPOINT_TAG = "update-{:08d}"  # the LM learner's tag format: rlfleet export reads both


class Reporter(Protocol):
    """Where a run's news goes besides stdout and TensorBoard. Subclasses inherit these
    defaults: report nothing, never stop (library use); the service's publishes on the bus
    (learner/lm/dpo_service.py)."""

    def status(self, message: str, *, running: bool = False) -> None:
        """A start-up phase (``running``: training is under way, e.g. a resume)."""
        return None

    def progress(self, step: int, total: int, row: dict[str, float]) -> None:
        """``step`` of ``total`` done; ``row``: that step's metrics (eval/... included)."""
        return None

    def stopping(self) -> bool:
        """True once the run should stop (checked between steps)."""
        return False


class _Silent(Reporter):
    """The default Reporter."""


@dataclass
class DPOResult:
    """What a run did: per-step metrics of this incarnation (every step, whatever
    ``log_every``), the evaluations before and after training (empty without eval_data), the
    saved folder (None when stopped early) and the steps done in all, resumed ones included."""

    history: list[dict[str, float]] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_after: dict[str, float] = field(default_factory=dict)
    output: Path | None = None
    seconds: float = 0.0
    steps: int = 0
    total: int = 0
    resumed_from: int = 0  # the checkpoint's step (0: a fresh run)
    stopped: bool = False  # stopped before the end (a checkpoint covers the steps done)
    already_finished: bool = False  # a finished run started again: nothing was trained

    def summary(self) -> str:
        """One line for the console: what was done, how it ended and the held-out change."""
        if self.already_finished:
            return f"already finished ({self.total} steps); final model in {self.output}"
        text = f"{self.steps}/{self.total} steps"
        if self.history:
            text += f", last loss {self.history[-1]['loss']:.4f}"
        before, after = self.eval_before, self.eval_after
        if before and after:
            text += (
                f"; eval loss {before['loss']:.3f} -> {after['loss']:.3f}, accuracy "
                f"{before['rewards/accuracies']:.2f} -> {after['rewards/accuracies']:.2f}"
            )
        if self.stopped:
            return text + "; stopped (resumes from the latest checkpoint)"
        return text + f"; final model in {self.output}"


@dataclass(frozen=True)
class _Batch:
    """Chosen rows first, then rejected rows, right-padded."""

    input_ids: Tensor  # [2B, L]
    attention_mask: Tensor  # [2B, L]
    completion_mask: Tensor  # [2B, L] 1 on completion tokens (the ones scored)
    pixel_values: Tensor | None = None  # [2B, I, 3, H, W]: each pair's images, on both rows
    pixel_attention_mask: Tensor | None = None  # [2B, I, H, W]


def _collate(
    pairs: Sequence[EncodedPair],
    pad_id: int,
    device: torch.device,
    pixels: Sequence[tuple[np.ndarray, np.ndarray] | None] = (),
) -> _Batch:
    """``pixels``: each pair's prompt images (None: none), shown to both its rows."""
    rows = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    prompts = [len(p.prompt) for p in pairs] * 2
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)  # [2B, L]
    attention = torch.zeros_like(ids)  # [2B, L]
    completion = torch.zeros_like(ids)  # [2B, L]
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        completion[i, prompt : len(row)] = 1
    values, mask = pad_images(list(pixels) * 2) if pixels else (None, None)
    if values is not None and mask is not None:
        values, mask = values.to(device), mask.to(device)
    return _Batch(ids.to(device), attention.to(device), completion.to(device), values, mask)


class DPOTrainer:
    """Loads data and model, builds the engine, restores the latest checkpoint in
    ``output_dir/checkpoints`` and computes the reference log-probs on construction; ``run()``
    trains, evaluates and saves; ``close()`` releases the engine."""

    def __init__(
        self,
        settings: DPOSettings,
        output_dir: Path,
        reporter: Reporter | None = None,
        trackers: Trackers = NO_TRACKERS,
    ) -> None:
        self.settings = s = settings
        self.output_dir = Path(output_dir)
        self.reporter = reporter or _Silent()
        self.trackers = trackers  # W&B / MLflow beside TensorBoard (rank 0 logs)
        torch.manual_seed(s.seed)
        self.tokenizer = load_tokenizer(s.model_path)
        # A vision-language model's processor expands the pairs' images and makes their pixels.
        self.processor = load_processor(s.model_path) if is_vision_model(s.model_path) else None
        self._pixels: dict[tuple[bytes, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.train_pairs = self._encode(s.data)
        self.eval_pairs = self._encode(s.eval_data) if s.eval_data else []
        self.reporter.status(
            f"loading model {s.model_path} ({len(self.train_pairs)} training pairs, "
            f"{len(self.eval_pairs)} eval pairs)"
        )
        started = time.perf_counter()
        model = load_policy(s)
        # packing: rows of the model's context length (learner/lm/packing.py)
        self.pack_tokens = context_length(model) if s.packing else None
        optimizer = OptimizerSettings(lr=s.learning_rate, eps=1e-8, weight_decay=s.weight_decay)
        ds = DeepSpeedSettings(
            zero_stage=s.zero_stage,
            precision=s.precision,
            gradient_clipping=s.gradient_clipping,
            train_micro_batch_size=s.batch_size,
            device=s.device,
            cache_dir=s.cache_dir,
        )
        self.engine = build_engine(model, optimizer, ds)
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        self.writer: Any = None
        self.reporter.status(
            f"model on {self.engine.device} in {time.perf_counter() - started:.1f} s "
            f"({self._trainable()})"
        )
        try:
            self.restored = self.engine.load(self.output_dir / "checkpoints") or {}
            started = time.perf_counter()
            self.reporter.status(f"scoring {self._pair_count()} pairs under the reference model")
            self.ref_train, self.ref_eval = self._reference_logps()
            self.reporter.status(f"reference scored in {time.perf_counter() - started:.1f} s")
        except BaseException:
            self.close()
            raise

    def _pair_count(self) -> int:
        return len(self.train_pairs) + len(self.eval_pairs)

    def _encode(self, path: Path) -> list[EncodedPair]:
        max_length, processor = self.settings.max_length, self.processor
        pairs = [encode_pair(p, self.tokenizer, max_length, processor) for p in load_pairs(path)]
        for pair in pairs:  # pixels once per distinct image set, not per epoch
            if pair.images and pair.images not in self._pixels:
                decoded = [open_image(data) for data in pair.images]
                self._pixels[pair.images] = image_pixels(processor, decoded)
        cut = sum(p.truncated for p in pairs)
        if cut:
            log.warning("%s: %d of %d pairs cut to max_length", path, cut, len(pairs))
        return pairs

    # --- log-probs -------------------------------------------------------------------------

    def _logps(
        self, forward: Callable[..., Any], pairs: Sequence[EncodedPair]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(chosen [B], rejected [B], completion tokens in the batch) under ``forward``."""
        pixels = [self._pixels.get(p.images) if p.images else None for p in pairs]
        batch = _collate(pairs, self.tokenizer.pad_token_id, self.engine.device, pixels)
        if self.pack_tokens is not None:  # the same log-probs through a packed forward
            logp, _ = sequence_logprobs(
                forward, batch.input_ids, batch.attention_mask, entropy=False,
                pack_tokens=self.pack_tokens, pixel_values=batch.pixel_values,
                pixel_attention_mask=batch.pixel_attention_mask,
            )  # fmt: skip
        else:
            images = image_inputs(
                batch.pixel_values, batch.pixel_attention_mask, self.engine.device
            )
            out = forward(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **images)
            logp = token_logprobs(out.logits[:, :-1], batch.input_ids[:, 1:])  # [2B, L-1]
        mask = batch.completion_mask[:, 1:].to(logp.dtype)  # [2B, L-1] position t scores t+1
        seq = (logp * mask).sum(-1)  # [2B]
        if self.settings.loss_type == "ipo":  # IPO's margin target assumes per-token averages
            seq = seq / mask.sum(-1)
        return seq[: len(pairs)], seq[len(pairs) :], mask.sum()

    def _reference_logps(self) -> tuple[Tensor, Tensor]:
        """(chosen, rejected) reference log-probs per pair, stacked [N, 2], for train and eval."""
        module = self.engine.module
        if self.settings.lora is not None:
            # the base model is the reference
            scope: Any = cast("PeftModel", module).disable_adapter()
            forward: Callable[..., Any] = self.engine
        else:  # a frozen copy of the starting weights, freed when this returns
            s = self.settings
            frozen = load_causal_lm(s.model_path, precision=s.precision, frozen=True)
            frozen.to(self.engine.device)
            scope = self.engine.autocast()  # the same numerics as the policy's forward
            forward = frozen
        with _eval_mode(module), torch.no_grad(), scope:
            return self._score(forward, self.train_pairs), self._score(forward, self.eval_pairs)

    def _score(self, forward: Callable[..., Any], pairs: list[EncodedPair]) -> Tensor:
        rows = []
        for start in range(0, len(pairs), self.settings.batch_size):
            chosen, rejected, _ = self._logps(
                forward, pairs[start : start + self.settings.batch_size]
            )
            rows.append(torch.stack([chosen, rejected], -1).float().cpu())  # [B, 2]
        return torch.cat(rows) if rows else torch.zeros(0, 2)  # [N, 2]

    def _loss(self, chosen: Tensor, rejected: Tensor, ref: Tensor) -> tuple[Tensor, dict]:
        s = self.settings
        ref = ref.to(chosen.device)  # [B, 2]
        return dpo_loss(
            chosen,
            rejected,
            ref[:, 0],
            ref[:, 1],
            beta=s.beta,
            label_smoothing=s.label_smoothing,
            loss_type=s.loss_type,
        )

    # --- training --------------------------------------------------------------------------

    def _batches(self, epoch: int) -> Iterator[Tensor]:
        """This rank's pair indices for each step of ``epoch``: a seeded shuffle cut into global
        batches of batch_size x world pairs (a short last one included), strided over ranks."""
        order = torch.randperm(
            len(self.train_pairs),
            generator=torch.Generator().manual_seed(self.settings.seed + epoch),
        )
        size = self.settings.batch_size * self.world
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            if len(chunk) >= self.world:  # every rank needs a pair, or the collectives hang
                yield chunk[self.rank :: self.world]

    def steps_per_epoch(self) -> int:
        size = self.settings.batch_size * self.world
        full, rest = divmod(len(self.train_pairs), size)
        return full + (rest >= self.world)

    def run(self) -> DPOResult:
        """Train for ``epochs`` (after the restored checkpoint's steps), evaluating before and
        after (with eval_data), then save ``final/``. Returns early, checkpointed, when the
        reporter says stop."""
        s, reporter = self.settings, self.reporter
        start = time.perf_counter()
        total = s.epochs * self.steps_per_epoch()
        done = int(self.restored.get("updates", 0))
        result = DPOResult(total=total, steps=done, resumed_from=done)
        result.eval_before = dict(self.restored.get("eval_before", {}))
        final = self.output_dir / "final"
        if done >= total and (final / "config.json").is_file():
            result.output, result.already_finished = final, True
            reporter.status(
                f"already finished: checkpoint update-{done:08d} is step {total} of {total} and "
                f"{final} exists; nothing to train (to train again, start a new run or delete "
                f"{self.output_dir})",
                running=True,
            )
            return result
        if self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"))
            print(f"dpo: {len(self.train_pairs)} pairs, {total} steps, {self._trainable()}")
        if done:
            reporter.status(
                f"resumed from checkpoint update-{done:08d} (step {done} of {total})", running=True
            )
        elif self.eval_pairs:
            result.eval_before = self._evaluate(0, "before")
        if done < total:
            reporter.progress(done, total, {f"eval/{k}": v for k, v in result.eval_before.items()})
        step, checkpointed = 0, done
        for epoch in range(s.epochs):
            for indices in self._batches(epoch):
                step += 1
                if step <= done:  # in the restored weights already
                    continue
                if reporter.stopping():
                    result.stopped = True
                    break
                row = self._step(step, indices)
                row["epoch"] = epoch + 1
                result.history.append(row)
                result.steps = step
                if step % s.log_every == 0 or step == total:
                    self._log(step, total, "train", row)
                    reporter.progress(step, total, row)
                if step % s.checkpoint_every == 0 and step < total:
                    checkpointed = self.checkpoint(step, result)
            if result.stopped:
                break
        if result.stopped:
            if result.steps > checkpointed:
                self.checkpoint(result.steps, result)
            result.seconds = time.perf_counter() - start
            return result
        if self.eval_pairs:
            result.eval_after = self._evaluate(total, "after")
            reporter.progress(total, total, {f"eval/{k}": v for k, v in result.eval_after.items()})
        result.output = self.export()
        self.checkpoint(total, result)  # after final/: a checkpoint at the end means it exists
        result.seconds = time.perf_counter() - start
        return result

    def checkpoint(self, step: int, result: DPOResult) -> int:
        """A DeepSpeed checkpoint of the policy and optimizer after ``step`` steps."""
        state = {"updates": step, "version": 0, "eval_before": result.eval_before}
        self.engine.save(
            self.output_dir / "checkpoints",
            CHECKPOINT_TAG.format(step),
            state,
            keep=self.settings.keep_checkpoints,
        )
        log.info("checkpoint at step %d", step)
        return step

    def _step(self, step: int, indices: Tensor) -> dict[str, float]:
        s = self.settings
        started = time.perf_counter()
        lr = (
            s.learning_rate * min(1.0, step / s.warmup_steps) if s.warmup_steps else s.learning_rate
        )
        self.engine.set_lr(lr)
        pairs = [self.train_pairs[i] for i in indices.tolist()]
        chosen, rejected, tokens = self._logps(self.engine, pairs)
        losses, metrics = self._loss(chosen, rejected, self.ref_train[indices])
        loss = losses.mean()
        if not math.isfinite(loss.item()):  # a diverged run must not go on to save its weights
            raise RuntimeError(f"DPO loss is {loss.item()} at step {step}; lower learning_rate")
        self.engine.backward(loss)
        self.engine.step()
        seconds = time.perf_counter() - started
        # This rank's batch only: all-reducing metrics every step would cost a collective for
        # numbers that are noisy per batch anyway.
        return {
            "loss": loss.item(),
            **{name: value.item() for name, value in metrics.items()},
            "logps/chosen": chosen.detach().mean().item(),
            "logps/rejected": rejected.detach().mean().item(),
            "lr": lr,
            "tokens/s": tokens.item() / seconds,
        }

    def _evaluate(self, step: int, when: str) -> dict[str, float]:
        """Loss and rewards over every eval pair (each rank scores all: no updates here)."""
        with _eval_mode(self.engine.module), torch.no_grad():
            scores = self._score(self.engine, self.eval_pairs)  # [N, 2]
            losses, metrics = self._loss(scores[:, 0], scores[:, 1], self.ref_eval)
        row = {"loss": losses.mean().item(), **{k: v.item() for k, v in metrics.items()}}
        self._log(step, None, f"eval ({when})", row, prefix="eval/")
        return row

    def _log(
        self, step: int, total: int | None, what: str, row: dict[str, float], prefix: str = "train/"
    ) -> None:
        if self.rank != 0:
            return
        values = {prefix + name: value for name, value in row.items()}
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.trackers.log_scalars(values, step)
        of = f"/{total}" if total else ""
        line = (
            f"dpo {what} step {step}{of}: loss {row['loss']:.4f}"
            f" acc {row['rewards/accuracies']:.3f} margin {row['rewards/margins']:.4f}"
            f" chosen {row['rewards/chosen']:.4f} rejected {row['rewards/rejected']:.4f}"
        )
        if "lr" in row:
            line += f" lr {row['lr']:.3g} tokens/s {row['tokens/s']:.0f}"
        print(line, flush=True)

    def _trainable(self) -> str:
        # ds_numel: under ZeRO-3 a parameter's own tensor is this rank's (often empty) partition.
        sizes = [
            (getattr(p, "ds_numel", p.numel()), p.requires_grad)
            for p in self.engine.module.parameters()
        ]
        trained = sum(n for n, grad in sizes if grad)
        return f"{trained:,} of {sum(n for n, _ in sizes):,} parameters trained"

    # --- output ----------------------------------------------------------------------------

    def export(self) -> Path:
        """Save the full model (LoRA merged) and the tokenizer (a vision-language model's
        processor) to ``output_dir/final``."""
        from peft import PeftModel

        out = self.output_dir / "final"
        module = self.engine.module
        with _gathered(module, self.settings.zero_stage):  # every rank takes part under ZeRO-3
            weights = hf_weights(module)
        if self.rank == 0:
            base = module.get_base_model() if isinstance(module, PeftModel) else module
            model = cast("PreTrainedModel", base)  # a transformers model, LoRA or not
            # An explicit state_dict: the base model's own would be the unmerged weights, and
            # under ZeRO-3 only this rank's partition.
            model.save_pretrained(out, state_dict=weights)
            # The processor holds the tokenizer, and what expands and sizes the images.
            (self.processor or self.tokenizer).save_pretrained(out)
            print(f"dpo: saved {out}", flush=True)
            self.trackers.log_final(out)
        return out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.trackers.close()
        self.engine.close()


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """No dropout while scoring; training mode comes back afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _gathered(module: torch.nn.Module, zero_stage: int) -> Any:
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


def train(
    settings: DPOSettings,
    output_dir: Path,
    reporter: Reporter | None = None,
    trackers: Trackers = NO_TRACKERS,
) -> DPOResult:
    """A whole run (or its rest, after a checkpoint): build, train, evaluate, save, release."""
    trainer = DPOTrainer(settings, output_dir, reporter, trackers)
    try:
        return trainer.run()
    finally:
        trainer.close()
