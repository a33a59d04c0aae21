"""Loading the causal LM the learner trains (and its frozen reference), optionally with LoRA.

Everything goes through ``from_pretrained`` on a local folder (``rlfleet init-model`` makes one).
A folder whose config.json has a ``vision_config`` is a vision-language model (an image-text to
text model: a vision encoder, an aligner projecting its features into the text model, the text
model): it trains on token ids plus the prompt's pixels, and its vision parts may be frozen.
Published weights are always the full Hugging Face checkpoint names of the base model, LoRA merged
in, so samplers load them with ``reload_weights`` whatever the learner trains; a vision part that
never trains is left out of every version after the first (``static_prefixes``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from common.images import IMAGE_TOKEN_BIAS, image_token_ids
from learner.lm.batch import Batch, image_inputs
from learner.lm.settings import LoraSettings, is_vision_model

__all__ = [
    "LoraSettings",
    "batch_logprobs",
    "bias_image_tokens",
    "context_length",
    "hf_weights",
    "image_pixels",
    "is_vision_model",
    "load_causal_lm",
    "load_policy",
    "load_processor",
    "load_tokenizer",
    "model_class",
    "sequence_logprobs",
    "static_prefixes",
    "token_logprobs",
    "vision_parts",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Attribute names transformers' vision-language models give their parts: the vision encoder
# (Idefics3, SigLIP-based: vision_model; LLaVA: vision_tower; Qwen-VL: visual), the aligner
# (Idefics3: connector; LLaVA: multi_modal_projector) and the text model the adapters go on.
_VISION_ENCODERS = ("vision_model", "vision_tower", "visual")
_ALIGNERS = ("connector", "multi_modal_projector", "mm_projector")
_TEXT_MODELS = ("text_model", "language_model")


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_processor(path: str | Path) -> Any:
    """The vision-language model's processor (image processor, tokenizer, chat template)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(path))


def model_class(path: str | Path) -> Any:
    """The transformers auto class that loads the folder: image-text to text for a
    vision-language model, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(Path(path)) else AutoModelForCausalLM


def _part(model: nn.Module, names: Sequence[str]) -> str | None:
    """The module name of the first (outermost) submodule called one of ``names``."""
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            return name
    return None


def vision_parts(model: nn.Module) -> dict[str, str]:
    """The vision parts ``model`` has, by knob: ``freeze_vision_encoder`` and
    ``freeze_aligner`` -> module name (a text model: empty)."""
    parts = {
        "freeze_vision_encoder": _part(model, _VISION_ENCODERS),
        "freeze_aligner": _part(model, _ALIGNERS),
    }
    return {knob: name for knob, name in parts.items() if name is not None}


def _freeze(model: nn.Module, path: str | Path, flags: dict[str, bool]) -> None:
    """requires_grad False on the parts whose knob is set; ValueError naming a knob set for a
    part the model lacks."""
    parts = vision_parts(model)
    for knob, value in flags.items():
        if not value:
            continue
        if knob not in parts:
            raise ValueError(f"{knob}: {path} has no such vision part (a text model?)")
        model.get_submodule(parts[knob]).requires_grad_(False)


def _lora_targets(model: nn.Module, lora: LoraSettings) -> list[str] | str:
    """``lora.target_modules``; on a vision-language model a pattern matching them inside the
    text model only (the vision encoder has projections of the same names)."""
    if not vision_parts(model):
        return lora.target_modules
    text = _part(model, _TEXT_MODELS)
    if text is None:
        raise ValueError(
            f"lora: no text model ({', '.join(_TEXT_MODELS)}) found in "
            f"{type(model).__name__} to put the adapters on"
        )
    names = "|".join(re.escape(name) for name in lora.target_modules)
    return rf"{re.escape(text)}\..*\.({names})"


def load_causal_lm(
    path: str | Path,
    *,
    precision: str = "fp32",
    lora: LoraSettings | None = None,
    frozen: bool = False,
    freeze_vision_encoder: bool = False,
    freeze_aligner: bool = False,
) -> nn.Module:
    """``from_pretrained(path)`` of a causal LM, or of an image-text to text model when the
    folder's config has a ``vision_config``; with ``lora`` only the adapters train (on a
    vision-language model: in its text model); ``frozen`` returns an eval-mode model without
    gradients (the KL reference); ``freeze_*`` keep those vision parts from training."""
    model = model_class(path).from_pretrained(str(path), dtype=_DTYPES[precision])
    model.config.use_cache = False
    if is_vision_model(Path(path)):
        bias_image_tokens(model, image_token_ids(load_processor(path)))
    if frozen:
        model.eval()
        model.requires_grad_(False)
        return model
    flags = {"freeze_vision_encoder": freeze_vision_encoder, "freeze_aligner": freeze_aligner}
    _freeze(model, path, flags)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora.r,
            # peft annotates lora_alpha as int, but only ever divides it (by r or sqrt(r)).
            lora_alpha=lora.alpha,  # type: ignore[arg-type]
            lora_dropout=lora.dropout,
            target_modules=_lora_targets(model, lora),
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)
    return model


def bias_image_tokens(model: nn.Module, token_ids: Sequence[int]) -> None:
    """Every forward of ``model`` adds IMAGE_TOKEN_BIAS to the logits of ``token_ids``, as
    the samplers do when they sample a vision-language model: the learner scores (and its
    evaluation generates from) the distribution that was sampled."""
    ids = torch.tensor(sorted(token_ids), dtype=torch.int64)

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        logits = output.logits
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[ids.to(logits.device)] = IMAGE_TOKEN_BIAS
        output.logits = logits + bias  # out of place: the graph keeps the model's logits
        return output

    model.register_forward_hook(hook)


def context_length(module: nn.Module) -> int:
    """The most tokens a sequence of ``module`` may hold (a vision-language model: its text
    model's)."""
    config: Any = (
        module.get_base_model().config  # type: ignore[operator]
        if hasattr(module, "get_base_model")
        else module.config
    )
    if getattr(config, "max_position_embeddings", None) is None:
        config = config.text_config
    return int(config.max_position_embeddings)


def static_prefixes(module: nn.Module) -> list[str]:
    """Hugging Face name prefixes of the vision parts of ``module`` none of whose parameters
    train (frozen by a knob, or left out of LoRA): their tensors never change, so a weight
    version after the first need not carry them."""
    from peft import PeftModel

    base = module.get_base_model() if isinstance(module, PeftModel) else module
    prefixes = []
    for name in vision_parts(base).values():
        if not any(p.requires_grad for p in base.get_submodule(name).parameters()):
            prefixes.append(f"{name}.")
    return prefixes


def image_pixels(processor: Any, images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The image processor's pixels of one prompt's PIL ``images``, exactly what
    ``processor(text=..., images=...)`` gives the model: pixel_values float32 [I, 3, H, W] and
    pixel_attention_mask bool [I, H, W] (I: image slots; one per image unless it splits
    images into tiles)."""
    out = processor.image_processor(images=[list(images)], return_tensors="np")
    values = np.asarray(out["pixel_values"][0], dtype=np.float32)
    mask = out.get("pixel_attention_mask")
    if mask is None:
        mask = np.ones((values.shape[0], *values.shape[2:]), dtype=bool)
    return values, np.asarray(mask[0], dtype=bool)


def hf_weights(
    module: nn.Module, dtype: torch.dtype | None = None, *, skip: Sequence[str] = ()
) -> dict[str, Tensor]:
    """Full-model tensors by Hugging Face checkpoint name (a LoRA model is merged into a copy of
    its base weights; the trained module is left untouched), but those whose name starts with
    one of the ``skip`` prefixes."""
    from peft import PeftModel

    with torch.no_grad():
        if isinstance(module, PeftModel):
            state = _merged_lora_state(module)
        else:
            state = dict(module.state_dict())
        out = {}
        for name, tensor in state.items():
            if name.startswith(tuple(skip)):
                continue
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


def batch_logprobs(
    model: Callable[..., Any], batch: Batch, **options: Any
) -> tuple[Tensor, Tensor | None]:
    """``sequence_logprobs`` of a collated batch: its token ids, attention and images."""
    return sequence_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        pixel_values=batch.pixel_values,
        pixel_attention_mask=batch.pixel_attention_mask,
        **options,
    )


def load_policy(settings: Any) -> nn.Module:
    """The model a learner trains, as its settings say: ``model_path``, ``precision``, ``lora``
    and the freeze knobs (LMLearnerSettings and DPOSettings both have them)."""
    return load_causal_lm(
        settings.model_path,
        precision=settings.precision,
        lora=settings.lora,
        freeze_vision_encoder=settings.freeze_vision_encoder,
        freeze_aligner=settings.freeze_aligner,
    )


def sequence_logprobs(
    model: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    entropy_grad: bool = False,
    entropy: bool = True,
    pack_tokens: int | None = None,
    pixel_values: Tensor | None = None,
    pixel_attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-position log-probability of each next token and the logits' entropy, under ``model``:
    a causal LM, or an engine around one (``model(input_ids=, attention_mask=).logits``).

    input_ids, attention_mask [B, L] -> (logp [B, L-1], entropy [B, L-1]); position t scores
    token t+1 given tokens 0..t. ``entropy_grad`` keeps the entropy in the graph (for an entropy
    bonus); otherwise it is a detached metric. ``entropy=False`` skips it (None): the no-grad
    passes that only need log-probs (reference, recomputed pi_old) save that vocabulary-wide work.
    One log-softmax serves both: the picked log-probs and the entropy read the same tensor.
    ``pack_tokens``: one packed forward of rows of at most that many tokens instead (the same
    values: learner/lm/packing.py). ``pixel_values`` [B, I, 3, H, W] and
    ``pixel_attention_mask`` [B, I, H, W]: a vision-language model's images of each row (all-zero
    padding images where a row has fewer: the model skips them)."""
    if pack_tokens is not None:
        from learner.lm.packing import packed_logprobs

        return packed_logprobs(
            model,
            input_ids,
            attention_mask,
            pack_tokens,
            entropy_grad=entropy_grad,
            entropy=entropy,
            pixel_values=pixel_values,
            pixel_attention_mask=pixel_attention_mask,
        )
    images = image_inputs(pixel_values, pixel_attention_mask, input_ids.device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, **images)
    logits = out.logits[:, :-1]  # [B, L-1, V]
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [B, L-1, V]
    logp = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]
    if not entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        lp = log_probs if entropy_grad else log_probs.detach()
        ent = -(lp.exp() * lp).sum(-1)  # [B, L-1]
    return logp, ent
