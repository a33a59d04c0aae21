"""Reward models: a Hugging Face sequence classifier scoring prompt + completion.

A model loads with ``AutoModelForSequenceClassification.from_pretrained(path)`` and its tokenizer
with ``AutoTokenizer``, from a local folder (nothing is downloaded at serve time). The score of
an item is the logit of label 0 of ``prompt + completion`` (truncated from the left to
``max_length`` tokens, so the completion's end is kept); for the usual single-output reward head
that is its regression value. Items go through the model ``batch_size`` at a time.

Calls come from the servicer's worker threads. One lock per model serialises forward passes:
concurrent requests would otherwise multiply activation memory, and torch already spreads one
forward over the CPU cores (or the GPU).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from reward_service.rewards.registry import Kind, RewardFunction

__all__ = ["ModelReward", "model_reward_function"]

log = logging.getLogger(__name__)


class ModelReward:
    """A TRL-style callable over one sequence-classification model; load() before calling."""

    def __init__(
        self,
        name: str,
        path: str | Path,
        *,
        max_length: int = 2048,
        batch_size: int = 8,
        device: str = "cpu",
    ) -> None:
        self.name = name
        self.path = Path(path)
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = device
        self.ready = False  # read by RewardFunction.ready: UNAVAILABLE until loaded
        self._model: Any = None
        self._tokenizer: Any = None
        self._torch: Any = None  # imported by load(): the service starts without torch loaded
        self._lock = threading.Lock()

    def load(self) -> None:
        """Load weights and tokenizer (blocking; seconds to minutes)."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not self.path.is_dir():
            raise FileNotFoundError(f"reward model '{self.name}': no folder at {self.path}")
        started = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = AutoModelForSequenceClassification.from_pretrained(self.path)
        if tokenizer.pad_token is None:
            # Batches need padding; reusing EOS is the usual choice for decoder-only models.
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.pad_token is None:
            raise ValueError(f"reward model '{self.name}': tokenizer has no pad or eos token")
        # Decoder classifiers pick the last non-pad token per row via config.pad_token_id.
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.truncation_side = "left"
        self._tokenizer = tokenizer
        self._model = model.to(self.device).eval()
        self._torch = torch
        self.ready = True
        log.info(
            "reward model %s loaded from %s in %.1fs",
            self.name,
            self.path,
            time.monotonic() - started,
        )

    def __call__(
        self, completions: list[str], prompts: list[str] | None = None, **kwargs: Any
    ) -> list[float | None]:
        if not self.ready:
            raise RuntimeError(f"reward model '{self.name}' is not loaded")
        prompts = prompts or [""] * len(completions)
        texts = [(p or "") + c for p, c in zip(prompts, completions, strict=True)]
        scores: list[float | None] = []
        with self._lock, self._torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self._model(**batch).logits  # [B, num_labels]
                scores.extend(float(v) for v in logits[:, 0].float().cpu())
        return scores


def model_reward_function(
    model: ModelReward, *, timeout_s: float, description: str = ""
) -> RewardFunction:
    """The registry record of a reward model (kind MODEL, no hyperparameters)."""
    return RewardFunction(
        name=model.name,
        fn=model,
        kind=Kind.MODEL,
        description=description
        or (
            f"Reward model {model.path.name}: logit of label 0 of a sequence classifier over "
            f"prompt + completion (at most {model.max_length} tokens, left-truncated); "
            "unbounded real. Never abstains."
        ),
        default_timeout_s=timeout_s,
        kwargs=frozenset(),
        source=f"reward model {model.path}",
        params=frozenset({"completions", "prompts"}),
    )
