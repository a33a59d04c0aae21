"""Preference pairs for DPO: reading and validating (prompt, chosen, rejected) JSONL, turning pairs
into token ids, and writing pairs for the arithmetic task.

A line is ``{"prompt": str, "chosen": str, "rejected": str}`` or chat-style, with ``prompt`` a list
of ``{role, content}`` messages that the tokenizer's chat template renders (chosen and rejected
are then the assistant's reply). Other keys (an ``id``, a source) are allowed and ignored.

``rlfleet dpo-data OUT.jsonl --count N`` (learner/lm/commands.py) writes pairs for the "arith"
generator of common/datasets.py: chosen is the correct `` <answer>N</answer>``, rejected a near
miss in the same format, so the pair differs only in the number (what DPO has to learn, not the
format).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.datasets import DatasetSpecError, arith

__all__ = [
    "EncodedPair",
    "PreferencePair",
    "arith_pairs",
    "encode_pair",
    "load_pairs",
    "write_pairs",
]

_KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One validated line: ``prompt`` is text or chat messages; ``where`` is "file:line"."""

    prompt: str | tuple[dict[str, str], ...]
    chosen: str
    rejected: str
    where: str


@dataclass(frozen=True)
class EncodedPair:
    """Token ids of one pair: the shared prompt and each completion (end-of-turn included)."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    truncated: bool  # prompt or a completion was cut to fit max_length


def load_pairs(path: str | Path) -> list[PreferencePair]:
    """Every pair of a JSONL file, validated; a bad line raises DatasetSpecError
    ``"<file>:<line>: <what is wrong>"`` (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetSpecError(f"{path}: preference data file does not exist")
    pairs = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                pairs.append(_parse_line(line, f"{path}:{number}"))
    if not pairs:
        raise DatasetSpecError(f"{path}: no preference pairs")
    return pairs


def _parse_line(line: str, where: str) -> PreferencePair:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetSpecError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(row, dict):
        raise DatasetSpecError(f"{where}: expected a JSON object with keys {', '.join(_KEYS)}")
    for key in _KEYS:
        if key not in row:
            raise DatasetSpecError(f"{where}: missing key '{key}'")
    prompt = row["prompt"]
    if isinstance(prompt, list):
        if not prompt or not all(_is_message(m) for m in prompt):
            raise DatasetSpecError(
                f"{where}: 'prompt' as a list must be non-empty {{role, content}} messages"
            )
        prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    else:
        _check_text(row, "prompt", where)
    _check_text(row, "chosen", where)
    _check_text(row, "rejected", where)
    if row["chosen"] == row["rejected"]:
        # Such a pair carries no preference (zero gradient): in real data it is a labelling bug.
        raise DatasetSpecError(f"{where}: 'chosen' and 'rejected' are the same text")
    return PreferencePair(prompt, row["chosen"], row["rejected"], where)


def _check_text(row: dict[str, Any], key: str, where: str) -> None:
    value = row[key]
    if not isinstance(value, str):
        raise DatasetSpecError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DatasetSpecError(f"{where}: '{key}' is an empty string")


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def encode_pair(pair: PreferencePair, tokenizer: Any, max_length: int) -> EncodedPair:
    """Token ids for ``pair``, prompt and completions tokenized separately (so the completion's
    tokens, the ones scored, are the same whatever the prompt), each at most ``max_length``
    tokens together.

    Text completions get the tokenizer's eos appended: the model should learn where the answer
    ends. Chat completions end with the chat template's own end-of-turn marker instead.
    Over-long completions are cut at the end; a prompt that leaves no room for at least
    one completion token keeps its last tokens (the part next to the answer)."""
    if isinstance(pair.prompt, str):
        prompt_text = pair.prompt
        completions = [pair.chosen, pair.rejected]
        eos = [tokenizer.eos_token_id]
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetSpecError(f"{pair.where}: chat-style prompt, but the tokenizer has none")
        messages = list(pair.prompt)
        prompt_text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        completions = [
            _chat_reply(tokenizer, messages, prompt_text, reply)
            for reply in (pair.chosen, pair.rejected)
        ]
        eos = []
    prompt = _ids(tokenizer, prompt_text)
    chosen, rejected = (_ids(tokenizer, text) + eos for text in completions)
    truncated = False
    if len(prompt) > max_length - 1:
        prompt, truncated = prompt[-(max_length - 1) :], True
    room = max_length - len(prompt)
    if max(len(chosen), len(rejected)) > room:
        chosen, rejected, truncated = chosen[:room], rejected[:room], True
    return EncodedPair(tuple(prompt), tuple(chosen), tuple(rejected), truncated)


def _chat_reply(
    tokenizer: Any, messages: list[dict[str, str]], prompt_text: str, reply: str
) -> str:
    """The text the template adds for an assistant ``reply`` after the generation prompt."""
    full = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": reply}], tokenize=False
    )
    if not full.startswith(prompt_text):  # a template that rewrites earlier turns
        raise DatasetSpecError("the chat template does not extend the prompt with the reply")
    return full[len(prompt_text) :]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def arith_pairs(
    count: int, *, seed: int = 0, split: str = "train", digits: int = 2
) -> Iterator[dict[str, str]]:
    """``count`` pairs from the "arith" generator: the correct answer against one off by 1-10."""
    rng = random.Random(f"dpo-arith-{seed}-{split}")
    offsets = [d for d in range(-10, 11) if d]
    for task in arith(seed=seed, split=split, digits=digits, count=count):
        wrong = int(task.extra["answer"]) + rng.choice(offsets)
        yield {
            "prompt": task.prompt,
            "chosen": task.solution or f" <answer>{task.extra['answer']}</answer>",
            "rejected": f" <answer>{wrong}</answer>",
        }


def write_pairs(path: str | Path, pairs: Iterable[dict[str, Any]]) -> int:
    """Write ``pairs`` as JSONL; returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with path.open("w", encoding="utf-8") as out:
        for pair in pairs:
            out.write(json.dumps(pair) + "\n")
            written += 1
    return written
