"""Facts about a Hugging Face model folder that every engine reports the same way."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

__all__ = ["ModelFacts", "model_facts"]


@dataclass(frozen=True)
class ModelFacts:
    eos_token_ids: tuple[int, ...]  # generation_config's, else config's, else the tokenizer's
    vocab_size: int
    max_position_embeddings: int | None
    quantization: str | None = None  # config.json's quantization_config.quant_method
    vision: bool = False  # a vision-language model (config.json has a vision_config)


@functools.cache
def model_facts(model_path: str) -> ModelFacts:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    eos = None
    with contextlib.suppress(OSError):  # no generation_config.json
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    if eos is None:
        eos = getattr(text_config, "eos_token_id", None)
    if eos is None:
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
    ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    quant = getattr(config, "quantization_config", None)
    if isinstance(quant, dict):
        method = quant.get("quant_method")
    else:
        method = getattr(quant, "quant_method", None)
    return ModelFacts(
        eos_token_ids=tuple(int(i) for i in ids),
        vocab_size=int(text_config.vocab_size),
        max_position_embeddings=getattr(text_config, "max_position_embeddings", None),
        quantization=str(method.value if hasattr(method, "value") else method) if method else None,
        vision=getattr(config, "vision_config", None) is not None,
    )
