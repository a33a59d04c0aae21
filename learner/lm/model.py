"""Loading the causal LM the learner trains (and its frozen reference), optionally with LoRA.

Everything goes through ``from_pretrained`` on a local folder (``rlfleet init-model`` makes one).
Published weights are always the full Hugging Face checkpoint names of the base model, LoRA merged
in, so samplers load them with ``reload_weights`` whatever the learner trains.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from learner.lm.settings import LoraSettings

__all__ = [
    "LoraSettings",
    "hf_weights",
    "load_causal_lm",
    "load_tokenizer",
    "sequence_logprobs",
    "token_logprobs",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | Path,
    *,
    precision: str = "fp32",
    lora: LoraSettings | None = None,
    frozen: bool = False,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)``; with ``lora`` only the adapters train;
    ``frozen`` returns an eval-mode model without gradients (the KL reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_DTYPES[precision])
    model.config.use_cache = False
    if frozen:
        model.eval()
        model.requires_grad_(False)
        return model
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora.r,
            # peft annotates lora_alpha as int, but only ever divides it (by r or sqrt(r)).
            lora_alpha=lora.alpha,  # type: ignore[arg-type]
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)
    return model


def hf_weights(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Full-model tensors by Hugging Face checkpoint name (a LoRA model is merged into a copy of
    its base weights; the trained module is left untouched)."""
    from peft import PeftModel

    with torch.no_grad():
        if isinstance(module, PeftModel):
            state = _merged_lora_state(module)
        else:
            state = dict(module.state_dict())
        out = {}
        for name, tensor in state.items():
            value = tensor.detach()
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            out[name] = value.to("cpu", copy=True).contiguous()
    tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    if tied:  # vLLM ties lm_head to the embeddings itself and has no separate tensor to load
        out.pop("lm_head.weight", None)
    return out


def _merged_lora_state(model: Any) -> dict[str, Tensor]:
    """base weight + scale * B @ A for every LoRA layer, under the base model's names."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {}
    # LoraLayer is a mixin; get_delta_weight is defined by the layers built on it (Linear, ...).
    lora_layers: dict[str, Any] = {
        name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)
    }
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        owner = clean.rsplit(".", 1)[0]
        layer = lora_layers.get(owner)
        if layer is not None and clean.endswith(".weight") and not layer.merged:
            tensor = tensor + layer.get_delta_weight("default").to(tensor.dtype)
        state[clean] = tensor
    return state


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[targets] without materialising the full log-softmax twice.

    logits [B, T, V], targets [B, T] -> [B, T] (fp32)."""
    logits = logits.float()  # [B, T, V]
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)  # [B, T]


def sequence_logprobs(
    model: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    entropy_grad: bool = False,
    entropy: bool = True,
    pack_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-position log-probability of each next token and the logits' entropy, under ``model``:
    a causal LM, or an engine around one (``model(input_ids=, attention_mask=).logits``).

    input_ids, attention_mask [B, L] -> (logp [B, L-1], entropy [B, L-1]); position t scores
    token t+1 given tokens 0..t. ``entropy_grad`` keeps the entropy in the graph (for an entropy
    bonus); otherwise it is a detached metric. ``entropy=False`` skips it (None): the no-grad
    passes that only need log-probs (reference, recomputed pi_old) save that vocabulary-wide work.
    One log-softmax serves both: the picked log-probs and the entropy read the same tensor.
    ``pack_tokens``: one packed forward of rows of at most that many tokens instead (the same
    values: learner/lm/packing.py)."""
    if pack_tokens is not None:
        from learner.lm.packing import packed_logprobs

        return packed_logprobs(
            model,
            input_ids,
            attention_mask,
            pack_tokens,
            entropy_grad=entropy_grad,
            entropy=entropy,
        )
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # [B, L-1, V]
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [B, L-1, V]
    logp = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]
    if not entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        lp = log_probs if entropy_grad else log_probs.detach()
        ent = -(lp.exp() * lp).sum(-1)  # [B, L-1]
    return logp, ent
