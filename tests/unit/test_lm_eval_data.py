"""Held-out evaluation data of LM jobs: `eval_dataset`, the expansion into the learner's `eval:`
settings, the start-up overlap warning and the columns its scoring passes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from common.datasets import Task
from learner.lm.evaluate import held_out_tasks, score_accuracy
from learner.lm.settings import EvalSettings
from services.registry import get_job


def _learner_eval(**knobs: Any) -> dict[str, Any]:
    spec = get_job("grpo")
    job = spec.settings.model_validate({"model_path": "m", **knobs})
    return next(e for e in spec.expand(job, "r") if e["name"] == "learner")["settings"]["eval"]


def test_eval_dataset_expands_into_the_learners_eval_settings(tmp_path: Path) -> None:
    rows = tmp_path / "eval.jsonl"
    arith = {"generator": "arith", "digits": 1}
    default = _learner_eval(dataset=arith)
    assert default["dataset"] == default["train_dataset"] == arith
    assert default["split"] == "eval"
    given = _learner_eval(dataset=arith, eval_dataset={"jsonl": str(rows)}, eval_split="test")
    assert given["dataset"] == {"jsonl": str(rows)}
    assert (given["split"], given["train_dataset"]) == ("test", arith)
    EvalSettings.model_validate(given)
    with pytest.raises(ValueError, match="unknown dataset generator 'arit'"):
        _learner_eval(eval_dataset={"generator": "arit"})


def test_eval_prompts_among_training_prompts_are_counted_in_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(f'{{"prompt": "Q{i}", "answer": "{i}"}}\n' for i in range(10)))
    data = {"jsonl": str(rows)}
    caplog.set_level(logging.WARNING, logger="learner.lm.evaluate")
    # A JSONL dataset without eval_dataset: evaluated on its own rows, and told so.
    tasks = held_out_tasks(EvalSettings(dataset=data, count=4, train_dataset=data), 100)
    assert [t.prompt for t in tasks] == ["Q0", "Q1", "Q2", "Q3"]
    (record,) = caplog.records
    assert "eval is not held out: 4 of its 4 distinct prompts" in record.getMessage()
    caplog.clear()
    held_out_tasks(EvalSettings(dataset=data, count=4, train_dataset=data), 2)  # Q0, Q1 trained
    assert "2 of its 4 distinct prompts" in caplog.records[0].getMessage()
    caplog.clear()
    arith = {"generator": "arith", "digits": 1}
    held_out_tasks(EvalSettings(dataset=arith, count=200, train_dataset=arith), 100_000)
    assert not caplog.records  # the generator's eval split is never trained on


def test_evaluation_scores_with_every_column_as_the_rollout_does() -> None:
    seen: list[dict[str, Any]] = []

    async def score(items: list[dict[str, Any]]) -> list[float | None]:
        seen.extend(items)
        return [1.0, None]

    tasks = [
        Task("a", prompt="Q: 1+1=?", extra={"answer": "2"}, solution=" <answer>2</answer>"),
        Task("b", prompt="Q: 2+2=?", extra={"answer": "4", "level": 1}),
    ]
    assert asyncio.run(score_accuracy(score, tasks, ["x", "y"]))[0] == 0.5
    assert [item["extra"] for item in seen] == [
        {"answer": "2", "solution": " <answer>2</answer>"},
        {"answer": "4", "level": 1},
    ]
