"""`rlfleet ask`: a language-model run's answer to one prompt, greedy and sampled, from its
final model or, while it trains, its latest checkpoint (what the studio's prompt box shows).

The source is resolved as `rlfleet export` resolves it (learner/export/sources.py); a DeepSpeed
checkpoint is first written out as a Hugging Face folder (the export's own code) into a
temporary folder. The prompt is rendered by the tokenizer's chat template when it has one, as
the run's sampler renders chat prompts, else given as plain text.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from services.errors import ConfigError

__all__ = ["ask"]


def ask(
    source_text: str,
    prompt: str,
    *,
    max_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    runs_root: Path = Path("runs"),
) -> dict[str, Any]:
    """``{"source", "greedy", "sampled"}``: the model's two answers to ``prompt``."""
    from learner.export.lm import export_lm
    from learner.export.sources import resolve_source

    if max_tokens < 1:
        raise ConfigError(f"--max-tokens {max_tokens}: at least 1")
    if not temperature > 0:
        raise ConfigError(f"--temperature {temperature}: must be > 0")
    source = resolve_source(source_text, runs_root=runs_root)
    if source.kind == "game":
        raise ConfigError(f"{source_text}: a game policy; `rlfleet play` runs it")
    if source.kind == "lm-final":
        return _answers(source.path, source.describe(), prompt, max_tokens, temperature, seed)
    with tempfile.TemporaryDirectory(prefix="rlfleet-ask-") as tmp:
        export_lm(source, Path(tmp), say=lambda message: None)
        return _answers(Path(tmp), source.describe(), prompt, max_tokens, temperature, seed)


def _answers(
    folder: Path, described: str, prompt: str, max_tokens: int, temperature: float, seed: int
) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from learner.lm.model import load_causal_lm

    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    model: Any = load_causal_lm(folder, frozen=True)
    if tokenizer.chat_template:
        rendered: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        # newer transformers answer a BatchEncoding, older ones the ids
        ids = list(rendered if isinstance(rendered, list) else rendered["input_ids"])
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    room = model.config.max_position_embeddings - len(ids)
    if room < 1:
        raise ConfigError(f"the prompt is {len(ids)} tokens: no room left in the model's context")
    input_ids = torch.tensor([ids])
    stops = [t for t in (tokenizer.eos_token_id, _token(tokenizer, "<|im_end|>")) if t is not None]
    common = {
        "max_new_tokens": min(max_tokens, room),
        "eos_token_id": stops or None,
        "pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id,
        "attention_mask": torch.ones_like(input_ids),
    }
    answers: dict[str, str] = {}
    with torch.no_grad():
        greedy = model.generate(input_ids, do_sample=False, **common)
        torch.manual_seed(seed)
        sampled = model.generate(
            input_ids, do_sample=True, temperature=temperature, top_p=1.0, top_k=0, **common
        )
    for name, out in (("greedy", greedy), ("sampled", sampled)):
        answers[name] = str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)).strip()
    return {"source": described, "prompt_tokens": len(ids), **answers}


def _token(tokenizer: Any, text: str) -> int | None:
    """``text``'s id when it is one token of the vocabulary (a chat template's end of turn)."""
    found = tokenizer.convert_tokens_to_ids(text)
    return found if isinstance(found, int) and found != tokenizer.unk_token_id else None
