"""Prompt datasets for language-model RL: JSONL files and procedural generators.

A dataset yields ``Task`` records: a prompt (text or chat messages), the reference values reward
functions read (``extra``, e.g. ``{"answer": "42"}``) and, when known, an expert ``solution``
(the SFT warm-start data and CHORD's expert completions). Chat messages may hold images
(``common.images``: image parts in the messages, their PNG bytes in ``Task.images``). Samplers,
the learner's SFT phase and evaluation all read the same records, so they live here (shared pure
code, no I/O besides files).

Generators are registered by name (``GENERATORS``); a dataset spec is either ``{"jsonl": PATH}`` or
``{"generator": NAME, "seed": S, ...kwargs}``. Held-out evaluation uses the same generator with a
different ``split``: a generator keeps a fixed part of its prompt space out of ``train`` and draws
every other split from it, so eval prompts are never training prompts (the split is also folded
into the seed). A JSONL file has no splits: held-out rows go in a file of their own.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.images import ImageError, image_digest, resolve_parts

__all__ = [
    "ENV_SEED_KEY",
    "GENERATORS",
    "SOLUTION_COLUMN",
    "DatasetSpecError",
    "Task",
    "dataset_columns",
    "iter_tasks",
    "load_jsonl",
    "shared_prompts",
    "take",
]

SOLUTION_COLUMN = "solution"  # Task.solution's column for reward functions (TRL's name)


class DatasetSpecError(ValueError):
    """A dataset spec or file is malformed; the message names the field or line."""


@dataclass(frozen=True)
class Task:
    """One prompt with what is needed to score it."""

    prompt_id: str
    prompt: str = ""  # raw text prompt (used when messages is empty)
    messages: tuple[dict[str, Any], ...] = ()  # chat messages, rendered with the chat template
    extra: dict[str, Any] = field(default_factory=dict)  # reward kwargs, e.g. {"answer": "42"}
    solution: str | None = None  # an expert completion, when the dataset has one
    images: tuple[bytes, ...] = ()  # PNG bytes of the messages' image parts, in their order

    def text(self) -> str:
        """The prompt as reward functions and logs see it (as the rollout drivers give it): the
        raw text, or the last user message's text with ``<image>`` where an image is."""
        if not self.messages:
            return self.prompt
        users = [m for m in self.messages if m.get("role") == "user"] or list(self.messages)
        content = users[-1].get("content")
        if isinstance(content, str):
            return content
        return "".join(
            "<image>" if p.get("type") == "image" else str(p.get("text", "")) for p in content or ()
        )

    def columns(self) -> dict[str, Any]:
        """The columns reward functions get as keywords: ``extra`` and ``solution`` (when set),
        every column but the prompt, as TRL passes a dataset's columns."""
        if self.solution is None:
            return dict(self.extra)
        return {SOLUTION_COLUMN: self.solution, **self.extra}


Generator = Callable[..., Iterator[Task]]
GENERATORS: dict[str, Generator] = {}


def register(name: str) -> Callable[[Generator], Generator]:
    def decorator(fn: Generator) -> Generator:
        if name in GENERATORS:
            raise ValueError(f"dataset generator {name!r} registered twice")
        GENERATORS[name] = fn
        return fn

    return decorator


ARITH_OPS = ("+", "-")
# One prompt in HOLD_OUT_EVERY (by a hash of its text, whatever the seed) belongs to the held-out
# splits and never to train: the 1-digit space has only 200 prompts, so seeds alone overlap.
HOLD_OUT_EVERY = 5


def held_out(prompt: str) -> bool:
    """Whether a generated prompt belongs to the held-out splits (not ``train``)."""
    return zlib.crc32(prompt.encode()) % HOLD_OUT_EVERY == 0


def arith_prompt(a: int, b: int, op: str) -> str:
    return f"Q: {a}{op}{b}=?\nA:"


@register("arith")
def arith(
    *,
    seed: int = 0,
    split: str = "train",
    digits: int = 2,
    ops: tuple[str, ...] | list[str] = ARITH_OPS,
    count: int | None = None,
) -> Iterator[Task]:
    """Integer arithmetic: ``a op b`` with operands of up to ``digits`` digits.

    Completions are expected as ``<answer>N</answer>``; ``solution`` is exactly that, so the SFT
    phase teaches the format and the RL phase the arithmetic. Infinite unless ``count`` is set.
    ``train`` never draws a ``held_out`` prompt and every other split draws only those.
    """
    for op in ops:
        if op not in ("+", "-", "*"):
            raise DatasetSpecError(f"arith: unknown op {op!r}; known: +, -, *")
    if not 1 <= digits <= 6:
        raise DatasetSpecError(f"arith: digits must be in [1, 6], got {digits}")
    rng = random.Random(seed * 1_000_003 + zlib.crc32(split.encode()))
    high = 10**digits - 1
    keep_held_out = split != "train"
    index = 0
    while count is None or index < count:
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(list(ops))
        prompt = arith_prompt(a, b, op)
        if held_out(prompt) != keep_held_out:
            continue
        value = a + b if op == "+" else a - b if op == "-" else a * b
        yield Task(
            prompt_id=f"arith-{split}-{seed}-{index}",
            prompt=prompt,
            extra={"answer": str(value)},
            solution=f" <answer>{value}</answer>",
        )
        index += 1


ENV_SEED_KEY = "env_seed"  # the episode seed an env_seeds task carries in `extra`


@register("env_seeds")
def env_seeds(
    *, env_id: str, seed: int = 0, split: str = "train", count: int | None = None
) -> Iterator[Task]:
    """Episodes of a text environment (multi-turn rollouts): each task is an episode seed for
    ``env_id``; the env draws the task from it (its ``split`` kwarg keeps train and eval apart).
    Infinite unless ``count`` is set."""
    if not env_id:
        raise DatasetSpecError("env_seeds: env_id is required")
    rng = random.Random(seed * 1_000_003 + zlib.crc32(f"{env_id}:{split}".encode()))
    index = 0
    while count is None or index < count:
        episode_seed = rng.randrange(2**31)
        yield Task(
            prompt_id=f"{env_id}-{split}-{seed}-{index}",
            prompt=f"{env_id} episode {episode_seed}",
            extra={ENV_SEED_KEY: episode_seed},
        )
        index += 1


@register("shapes")
def shapes(
    *,
    seed: int = 0,
    split: str = "train",
    question: str = "mixed",
    size: int = 64,
    count: int | None = None,
) -> Iterator[Task]:
    """Visual questions about scenes of coloured shapes (common/shapes.py) on a ``size`` x
    ``size`` image: the question's text never changes, only the image answers it. ``solution``
    is ``<answer>WORD</answer>``. Held out like ``arith``, by the scene. Infinite unless
    ``count`` is set."""
    from common.images import IMAGE_PART, png_bytes
    from common.shapes import QUESTIONS, describe, draw, scene

    if question != "mixed" and question not in QUESTIONS:
        raise DatasetSpecError(
            f"shapes: unknown question {question!r}; known: mixed, {', '.join(QUESTIONS)}"
        )
    if not 32 <= size <= 512:
        raise DatasetSpecError(f"shapes: size must be in [32, 512], got {size}")
    rng = random.Random(seed * 1_000_003 + zlib.crc32(f"shapes:{split}".encode()))
    keep_held_out = split != "train"
    index = 0
    while count is None or index < count:
        kind = rng.choice(list(QUESTIONS)) if question == "mixed" else question
        drawn, answer = scene(rng, kind, size)
        if held_out(f"{kind};{describe(drawn)}") != keep_held_out:
            continue
        text = QUESTIONS[kind] + " Answer with one word."
        content = [dict(IMAGE_PART), {"type": "text", "text": text}]
        yield Task(
            prompt_id=f"shapes-{split}-{seed}-{index}",
            messages=({"role": "user", "content": content},),
            extra={"answer": answer, "question": kind},
            solution=f"<answer>{answer}</answer>",
            images=(png_bytes(draw(drawn, size)),),
        )
        index += 1


def load_jsonl(path: str | Path) -> Iterator[Task]:
    """Tasks from a JSONL file: one object per line with ``prompt`` (text) or ``messages``
    (chat), optional ``id``, ``solution`` and any other keys (they become ``extra``)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetSpecError(f"dataset file {path} does not exist")
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetSpecError(f"{path}:{number}: not JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise DatasetSpecError(f"{path}:{number}: expected an object")
            prompt, messages = row.pop("prompt", None), row.pop("messages", None)
            if (prompt is None) == (messages is None):
                raise DatasetSpecError(f"{path}:{number}: set exactly one of prompt, messages")
            if prompt is not None and (not isinstance(prompt, str) or not prompt):
                raise DatasetSpecError(f"{path}:{number}: prompt must be a non-empty string")
            images: list[bytes] = []
            if messages is not None:
                messages = _chat_messages(messages, path, number, images)
            yield Task(
                prompt_id=str(row.pop("id", f"{path.stem}-{number}")),
                prompt=prompt or "",
                messages=tuple(messages or ()),
                solution=row.pop("solution", None),
                extra=row,
                images=tuple(images),
            )


def _chat_messages(
    messages: Any, path: Path, number: int, images: list[bytes]
) -> list[dict[str, Any]]:
    """A row's messages with image parts resolved (files relative to the dataset's folder)."""
    shape = f"{path}:{number}: messages must be a non-empty list of {{role, content}}"
    if not isinstance(messages, list) or not messages:
        raise DatasetSpecError(shape)
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DatasetSpecError(shape)
        try:
            content = resolve_parts(message.get("content"), path.parent, images)
        except ImageError as exc:
            raise DatasetSpecError(f"{path}:{number}: messages[{index}]: {exc}") from None
        out.append({**message, "content": content})
    return out


def iter_tasks(spec: dict[str, Any], *, split: str | None = None) -> Iterator[Task]:
    """Tasks of a dataset spec: ``{"jsonl": PATH}`` or ``{"generator": NAME, **kwargs}``;
    ``split`` overrides the generator's split (JSONL files have none)."""
    spec = dict(spec)
    if "jsonl" in spec:
        if len(spec) > 1:
            raise DatasetSpecError(f"a jsonl dataset takes no other keys, got {sorted(spec)}")
        return load_jsonl(spec["jsonl"])
    name = spec.pop("generator", None)
    if name is None:
        raise DatasetSpecError("a dataset needs 'jsonl: PATH' or 'generator: NAME'")
    if name not in GENERATORS:
        raise DatasetSpecError(f"unknown dataset generator {name!r}; known: {sorted(GENERATORS)}")
    if split is not None:
        spec["split"] = split
    try:
        return GENERATORS[name](**spec)
    except TypeError as exc:
        raise DatasetSpecError(f"dataset generator {name!r}: {exc}") from None


def take(tasks: Iterator[Task], count: int) -> list[Task]:
    return [task for _, task in zip(range(count), tasks, strict=False)]


def dataset_columns(spec: dict[str, Any], *, rows: int = 100) -> frozenset[str] | None:
    """The columns (``Task.columns``) of a dataset's first ``rows`` tasks, or None when the spec
    or file cannot be read (its own check reports that)."""
    try:
        return frozenset(key for task in take(iter_tasks(spec), rows) for key in task.columns())
    except (DatasetSpecError, OSError):
        return None


def shared_prompts(
    train: Iterable[Task], held_out: Iterable[Task], *, limit: int
) -> tuple[int, int]:
    """``(shared, distinct)``: how many of the ``distinct`` prompts of ``held_out`` are among the
    first ``limit`` prompts of ``train`` (a prompt: its text, or its chat messages)."""
    wanted = {_prompt_of(task) for task in held_out}
    seen = {_prompt_of(task) for _, task in zip(range(limit), train, strict=False)}
    return len(wanted & seen), len(wanted)


def _prompt_of(task: Task) -> str:
    """What makes two prompts the same: the text or messages, and the images' pixels."""
    text = task.prompt or json.dumps(task.messages, sort_keys=True)
    return " ".join([text, *map(image_digest, task.images)])
