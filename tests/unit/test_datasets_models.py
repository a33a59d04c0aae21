"""Prompt datasets (JSONL, the arith generator) and init-model's checks and output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from common.datasets import DatasetSpecError, iter_tasks, take
from common.models import MODEL_SIZES, ModelSize, init_model


def test_arith_is_seeded_and_splits_differ() -> None:
    train = take(iter_tasks({"generator": "arith", "seed": 3}), 50)
    again = take(iter_tasks({"generator": "arith", "seed": 3}), 50)
    held_out = take(iter_tasks({"generator": "arith", "seed": 3}, split="eval"), 50)
    assert [t.prompt for t in train] == [t.prompt for t in again]
    assert [t.prompt for t in train] != [t.prompt for t in held_out]
    for task in train:
        a, op, b = re.fullmatch(r"Q: (\d+)([+-])(\d+)=\?\nA:", task.prompt).groups()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert task.extra == {"answer": str(value)}
        assert task.solution == f" <answer>{value}</answer>"


def test_dataset_spec_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DatasetSpecError, match="unknown dataset generator 'arit'"):
        iter_tasks({"generator": "arit"})
    with pytest.raises(DatasetSpecError, match="digits must be in"):
        next(iter_tasks({"generator": "arith", "digits": 9}))
    with pytest.raises(DatasetSpecError, match="does not exist"):
        next(iter_tasks({"jsonl": str(tmp_path / "missing.jsonl")}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "answer": "1"}\n{"answer": "2"}\n')
    tasks = iter_tasks({"jsonl": str(bad)})
    assert next(tasks).extra == {"answer": "1"}
    with pytest.raises(DatasetSpecError, match=r"bad.jsonl:2: set exactly one of prompt, messages"):
        next(tasks)
    bad.write_text("not json\n")
    with pytest.raises(DatasetSpecError, match=r"bad.jsonl:1: not JSON"):
        next(iter_tasks({"jsonl": str(bad)}))


def test_jsonl_chat_rows(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    row = {"id": "q1", "messages": [{"role": "user", "content": "2+2?"}], "solution": "4"}
    path.write_text(json.dumps(row) + "\n")
    (task,) = list(iter_tasks({"jsonl": str(path)}))
    assert task.prompt_id == "q1" and task.messages[0]["content"] == "2+2?"
    assert task.solution == "4" and task.extra == {}


def test_head_size_must_suit_vllm_cpu_attention() -> None:
    with pytest.raises(
        ValueError, match=r"head size 48 .* is not one vLLM's CPU attention accepts"
    ):
        ModelSize(96, 2, 2, 1, 128).check()
    for size in MODEL_SIZES.values():
        size.check()


def test_init_model_loads_through_from_pretrained(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.head_dim == 32 and not model.config.tie_word_embeddings
    ids = tokenizer("Q: 12+34=?\nA:", add_special_tokens=False)["input_ids"]
    digits = [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).isdigit()]
    assert digits == ["1", "2", "3", "4"]  # one token per digit
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    meta = json.loads((tiny_model_dir / "rlfleet_model.json").read_text())
    assert meta["parameters"] == sum(p.numel() for p in model.parameters())


def test_init_model_refuses_a_size_vllm_cannot_serve(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head size"):
        init_model(tmp_path / "m", size=ModelSize(96, 1, 2, 1, 64))
    assert not (tmp_path / "m" / "config.json").exists()
