"""Offline DPO (Rafailov et al. 2023, arXiv:2305.18290) on (prompt, chosen, rejected) JSONL.

``rlfleet dpo CONFIG.yaml`` (top level: ``DPOSettings``) or ``DPOTrainer(settings).run()``:

1. pairs are read and validated (learner/lm/dpo_data.py) and tokenized; only completion tokens
   are scored, a sequence's log-prob being the sum of its completion tokens' log-probs;
2. the reference log-probs are computed once, before any update: with LoRA by running the policy
   with its adapter disabled (no second model is held), else with a frozen copy that is freed
   right after. Every later step then costs one forward/backward of the policy alone;
3. each step runs chosen and rejected in one batch through the DeepSpeed engine
   (learner.engine, client AdamW) and applies learner.algos' ``dpo_loss``;
4. metrics go to stdout and TensorBoard (``output_dir/tensorboard``); the final model is saved as
   a Hugging Face folder (``output_dir/final``, LoRA merged, tokenizer included) that
   ``from_pretrained`` and vLLM load.

Under ``torchrun`` each rank trains on its slice of every global batch (rank 0 logs and saves).
One file (about 400 lines) for one trainer read top to bottom, CleanRL-style; data preparation
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
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from pydantic import Field, model_validator
from torch import Tensor

from learner.engine import build_engine
from learner.lm.dpo_data import EncodedPair, encode_pair, load_pairs
from learner.lm.model import LoraSettings, load_causal_lm, load_tokenizer, token_logprobs
from learner.settings import DeepSpeedSettings, Device, OptimizerSettings, Precision
from services.config import StrictModel

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["DPOResult", "DPOSettings", "DPOTrainer", "load_settings", "run_config", "train"]

log = logging.getLogger(__name__)


class DPOSettings(StrictModel):
    """One offline DPO run (the top level of ``rlfleet dpo CONFIG.yaml``)."""

    # Hugging Face folder to start from (`rlfleet init-model` makes one); also the reference.
    model_path: Path
    # Training pairs, JSONL: {"prompt", "chosen", "rejected"} per line (see dpo_data.py).
    data: Path
    # Pairs scored before and after training (no updates on them); None: no evaluation.
    eval_data: Path | None = None
    # Prompt + completion tokens per sequence; longer completions are cut at the end.
    max_length: int = Field(default=512, ge=2)

    beta: float = Field(default=0.1, gt=0)  # strength of the implicit KL to the reference
    # Conservative DPO: the assumed probability that a pair's labels are flipped (sigmoid only).
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    # sigmoid = DPO; ipo = IPO (on length-averaged log-probs, as TRL); hinge = SLiC.
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"

    epochs: int = Field(default=1, ge=1)  # passes over `data`, reshuffled each time
    batch_size: int = Field(default=8, ge=1)  # pairs per optimizer step on each rank
    learning_rate: float = Field(default=1e-6, gt=0)  # TRL's default for full fine-tuning
    warmup_steps: int = Field(default=0, ge=0)  # linear warm-up, then constant
    weight_decay: float = Field(default=0.0, ge=0)  # AdamW's decoupled weight decay
    gradient_clipping: float | None = Field(default=1.0, gt=0)  # global grad-norm clip; None: off
    lora: LoraSettings | None = None  # train LoRA adapters only (merged into the saved model)

    precision: Precision = "fp32"  # parameter dtype (bf16/fp16: mixed precision via DeepSpeed)
    zero_stage: int = Field(default=0, ge=0, le=3)  # DeepSpeed ZeRO stage
    device: Device = "auto"  # cuda when torch sees a GPU
    cache_dir: Path | None = None  # JIT-built ops cache; see DeepSpeedSettings.cache_dir
    seed: int = 0  # LoRA init and the shuffling order

    output_dir: Path  # tensorboard/ and final/ (the Hugging Face folder) go here
    log_every: int = Field(default=10, ge=1)  # optimizer steps between stdout lines

    @model_validator(mode="after")
    def _consistent(self) -> DPOSettings:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("label_smoothing applies to loss_type 'sigmoid' only")
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError("precision 'fp16' needs device 'cuda' (DeepSpeed has no CPU fp16)")
        return self


@dataclass
class DPOResult:
    """What a run did: per-step metrics (every step, whatever ``log_every``), the evaluations
    before and after training (empty without eval_data) and the saved folder."""

    history: list[dict[str, float]] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_after: dict[str, float] = field(default_factory=dict)
    output: Path | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class _Batch:
    """Chosen rows first, then rejected rows, right-padded."""

    input_ids: Tensor  # [2B, L]
    attention_mask: Tensor  # [2B, L]
    completion_mask: Tensor  # [2B, L] 1 on completion tokens (the ones scored)


def _collate(pairs: Sequence[EncodedPair], pad_id: int, device: torch.device) -> _Batch:
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
    return _Batch(ids.to(device), attention.to(device), completion.to(device))


class DPOTrainer:
    """Loads data and model, builds the engine and computes the reference log-probs on
    construction; ``run()`` trains, evaluates and saves; ``close()`` releases the engine."""

    def __init__(self, settings: DPOSettings) -> None:
        self.settings = s = settings
        torch.manual_seed(s.seed)
        self.tokenizer = load_tokenizer(s.model_path)
        self.train_pairs = self._encode(s.data)
        self.eval_pairs = self._encode(s.eval_data) if s.eval_data else []
        model = load_causal_lm(s.model_path, precision=s.precision, lora=s.lora)
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
        try:
            self.ref_train, self.ref_eval = self._reference_logps()
        except BaseException:
            self.close()
            raise

    def _encode(self, path: Path) -> list[EncodedPair]:
        pairs = [encode_pair(p, self.tokenizer, self.settings.max_length) for p in load_pairs(path)]
        cut = sum(p.truncated for p in pairs)
        if cut:
            log.warning("%s: %d of %d pairs cut to max_length", path, cut, len(pairs))
        return pairs

    # --- log-probs -------------------------------------------------------------------------

    def _logps(
        self, forward: Callable[..., Any], pairs: Sequence[EncodedPair]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(chosen [B], rejected [B], completion tokens in the batch) under ``forward``."""
        batch = _collate(pairs, self.tokenizer.pad_token_id, self.engine.device)
        out = forward(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
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
        from learner.algos import dpo_loss

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
        """Train for ``epochs``, evaluating before and after (with eval_data), then save."""
        s = self.settings
        start = time.perf_counter()
        result = DPOResult()
        total = s.epochs * self.steps_per_epoch()
        if self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(s.output_dir / "tensorboard"))
            print(f"dpo: {len(self.train_pairs)} pairs, {total} steps, {self._trainable()}")
        if self.eval_pairs:
            result.eval_before = self._evaluate(0, "before")
        step = 0
        for epoch in range(s.epochs):
            for indices in self._batches(epoch):
                step += 1
                row = self._step(step, indices)
                row["epoch"] = epoch + 1
                result.history.append(row)
                if step % s.log_every == 0 or step == total:
                    self._log(step, total, "train", row)
        if self.eval_pairs:
            result.eval_after = self._evaluate(step, "after")
        result.output = self.export()
        result.seconds = time.perf_counter() - start
        return result

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
        for name, value in row.items():
            self.writer.add_scalar(prefix + name, value, step)
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
        """Save the full model (LoRA merged) and the tokenizer to ``output_dir/final``."""
        from peft import PeftModel

        from learner.lm.model import hf_weights

        out = self.settings.output_dir / "final"
        module = self.engine.module
        with _gathered(module, self.settings.zero_stage):  # every rank takes part under ZeRO-3
            weights = hf_weights(module)
        if self.rank == 0:
            base = module.get_base_model() if isinstance(module, PeftModel) else module
            model = cast("PreTrainedModel", base)  # a transformers model, LoRA or not
            # An explicit state_dict: the base model's own would be the unmerged weights, and
            # under ZeRO-3 only this rank's partition.
            model.save_pretrained(out, state_dict=weights)
            self.tokenizer.save_pretrained(out)
            print(f"dpo: saved {out}", flush=True)
        return out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
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


def train(settings: DPOSettings) -> DPOResult:
    """A whole run: build, train, evaluate, save, release."""
    trainer = DPOTrainer(settings)
    try:
        return trainer.run()
    finally:
        trainer.close()


def load_settings(path: str | Path) -> DPOSettings:
    """``DPOSettings`` from a YAML file; an unknown or ill-typed key is a ConfigError naming the
    file, line and key (the same rendering as ``rlfleet up``)."""
    from services.config import read_yaml_mapping, validate_model

    source = read_yaml_mapping(path, "a DPO config")
    return validate_model(DPOSettings, source.data, source)


def run_config(path: str | Path) -> int:
    """``rlfleet dpo CONFIG.yaml``: bad config or data lines become ConfigErrors (exit 2)."""
    from common.datasets import DatasetSpecError
    from services.errors import ConfigError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = load_settings(path)
    try:
        result = train(settings)
    except DatasetSpecError as exc:
        raise ConfigError(str(exc)) from None
    last = result.history[-1] if result.history else {}
    print(
        f"dpo: done in {result.seconds:.1f} s, {len(result.history)} steps, "
        f"last loss {last.get('loss', float('nan')):.4f}; model in {result.output}"
    )
    return 0
