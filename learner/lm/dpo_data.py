"""Preference pairs for DPO: reading and validating (prompt, chosen, rejected) JSONL, turning pairs
into token ids, and writing pairs for the arithmetic task.

A line is ``{"prompt": str, "chosen": str, "rejected": str}`` or chat-style, with ``prompt`` a list
of ``{role, content}`` messages that the tokenizer's chat template renders (chosen and rejected
are then the assistant's reply). A message's content may be OpenAI-style parts with images, as
in prompt datasets (common/images.py: files relative to the JSONL file, or data URLs); the
vision-language model's processor then expands them. Other keys (an ``id``, a source) are
allowed and ignored.

``rlfleet dpo-data OUT.jsonl --count N`` (learner/lm/commands.py) writes pairs for the "arith"
generator of common/datasets.py: chosen is the correct `` <answer>N</answer>``, rejected a near
miss in the same format, so the pair differs only in the number (what DPO has to learn, not the
format). ``--task shapes`` writes pairs about the ``shapes`` generator's images (the PNG files
beside the JSONL file): the right word chosen, another answer of the same question rejected.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.datasets import DatasetSpecError, arith, shapes
from common.images import ImageError, resolve_parts

__all__ = [
    "EncodedPair",
    "PreferencePair",
    "arith_pairs",
    "encode_pair",
    "generate_pairs",
    "load_pairs",
    "shapes_pairs",
    "write_pairs",
]

_KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One validated line: ``prompt`` is text or chat messages; ``where`` is "file:line".
    ``images``: the PNG bytes of the messages' image parts, in order (each part is then an
    ``{"type": "image"}`` placeholder)."""

    prompt: str | tuple[dict[str, Any], ...]
    chosen: str
    rejected: str
    where: str
    images: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class EncodedPair:
    """Token ids of one pair: the shared prompt and each completion (end-of-turn included)."""

    prompt: tuple[int, ...]  # images expanded into their tokens
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    truncated: bool  # prompt or a completion was cut to fit max_length
    images: tuple[bytes, ...] = ()  # the prompt's, in order (the model needs their pixels)


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
                pairs.append(_parse_line(line, f"{path}:{number}", path.parent))
    if not pairs:
        raise DatasetSpecError(f"{path}: no preference pairs")
    return pairs


def _parse_line(line: str, where: str, base: Path) -> PreferencePair:
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
    images: list[bytes] = []
    if isinstance(prompt, list):
        if not prompt or not all(_is_message(m) for m in prompt):
            raise DatasetSpecError(
                f"{where}: 'prompt' as a list must be non-empty {{role, content}} messages"
            )
        messages = []
        for i, m in enumerate(prompt):
            try:
                content = resolve_parts(m["content"], base, images)
            except ImageError as exc:
                raise DatasetSpecError(f"{where}: prompt[{i}]: {exc}") from None
            messages.append({"role": m["role"], "content": content})
        prompt = tuple(messages)
    else:
        _check_text(row, "prompt", where)
    _check_text(row, "chosen", where)
    _check_text(row, "rejected", where)
    if row["chosen"] == row["rejected"]:
        # Such a pair carries no preference (zero gradient): in real data it is a labelling bug.
        raise DatasetSpecError(f"{where}: 'chosen' and 'rejected' are the same text")
    return PreferencePair(prompt, row["chosen"], row["rejected"], where, tuple(images))


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
        and isinstance(message.get("content"), str | list)
    )


def encode_pair(
    pair: PreferencePair, tokenizer: Any, max_length: int, processor: Any = None
) -> EncodedPair:
    """Token ids for ``pair``, prompt and completions tokenized separately (so the completion's
    tokens, the ones scored, are the same whatever the prompt), each at most ``max_length``
    tokens together.

    Text completions get the tokenizer's eos appended: the model should learn where the answer
    ends. Chat completions end with the chat template's own end-of-turn marker instead.
    Over-long completions are cut at the end; a prompt that leaves no room for at least
    one completion token keeps its last tokens (the part next to the answer). A prompt with
    images needs the vision-language model's ``processor`` (it expands them) and is never cut:
    cutting could split an image's tokens."""
    if pair.images and processor is None:
        raise DatasetSpecError(f"{pair.where}: the prompt has images; the model reads text only")
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
    if pair.images:
        from common.images import open_image

        decoded = [open_image(data) for data in pair.images]
        expanded = processor(text=[prompt_text], images=[decoded], add_special_tokens=False)
        prompt = [int(i) for i in expanded["input_ids"][0]]
        if len(prompt) > max_length - 1:
            raise DatasetSpecError(
                f"{pair.where}: the prompt with its images is {len(prompt)} tokens; max_length "
                f"{max_length} leaves no room for the answer (images are never cut)"
            )
    chosen, rejected = (_ids(tokenizer, text) + eos for text in completions)
    truncated = False
    if len(prompt) > max_length - 1:
        prompt, truncated = prompt[-(max_length - 1) :], True
    room = max_length - len(prompt)
    if max(len(chosen), len(rejected)) > room:
        chosen, rejected, truncated = chosen[:room], rejected[:room], True
    return EncodedPair(tuple(prompt), tuple(chosen), tuple(rejected), truncated, pair.images)


def _chat_reply(
    tokenizer: Any, messages: list[dict[str, Any]], prompt_text: str, reply: str
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


def shapes_pairs(
    count: int, images_dir: Path, *, seed: int = 0, split: str = "train", question: str = "mixed"
) -> Iterator[dict[str, Any]]:
    """``count`` pairs about the "shapes" generator's scenes: the right word against another
    answer of the same question. Each image is written to ``images_dir`` as a PNG file, named
    in the pair relative to ``images_dir``'s parent (where the JSONL file goes)."""
    from common.shapes import ANSWERS

    rng = random.Random(f"dpo-shapes-{seed}-{split}")
    images_dir.mkdir(parents=True, exist_ok=True)
    for index, task in enumerate(shapes(seed=seed, split=split, question=question, count=count)):
        answer, kind = task.extra["answer"], task.extra["question"]
        wrong = rng.choice([a for a in ANSWERS[kind] if a != answer])
        name = f"{split}-{seed}-{index}.png"
        (images_dir / name).write_bytes(task.images[0])
        parts = [
            {"type": "image", "image": f"{images_dir.name}/{name}"}
            if p.get("type") == "image"
            else p
            for p in task.messages[0]["content"]
        ]
        yield {
            "prompt": [{"role": "user", "content": parts}],
            "chosen": f"<answer>{answer}</answer>",
            "rejected": f"<answer>{wrong}</answer>",
        }


def generate_pairs(
    path: str | Path,
    task: str,
    count: int,
    *,
    split: str = "train",
    seed: int = 0,
    digits: int = 2,
    question: str = "mixed",
) -> int:
    """Write ``count`` generated pairs of ``task`` ("arith", or "shapes" with its PNG files in
    ``<path's stem>-images/`` beside it) to ``path``; returns how many."""
    path = Path(path)
    if task == "shapes":
        images = path.parent / f"{path.stem}-images"
        pairs = shapes_pairs(count, images, seed=seed, split=split, question=question)
    elif task == "arith":
        pairs = arith_pairs(count, seed=seed, split=split, digits=digits)
    else:
        raise DatasetSpecError(f"unknown pair task {task!r}: arith or shapes")
    return write_pairs(path, pairs)


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
