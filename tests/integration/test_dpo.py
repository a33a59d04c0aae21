"""Offline DPO (learner/lm/dpo.py) on the tiny local Qwen2 model with a real DeepSpeed engine:

- on 64 generated arithmetic pairs a few seconds of training lowers the loss and raises the
  reward accuracy and margin against the first step (where policy == reference: loss log 2);
  the saved folder loads with AutoModelForCausalLM and holds the trained weights;
- a run stopped between steps checkpoints; a new trainer resumes after it and takes exactly the
  steps the uninterrupted run took (same losses), and a finished one trains nothing;
- LoRA trains the adapters only (base weights untouched in the module, merged export differs);
- `rlfleet up` of a `job: {kind: dpo}` run file: start-up phases and the progress line on the
  console, metrics.jsonl, checkpoints, final/, `rlfleet export` of the run, and a second
  `rlfleet up` saying the run is finished;
- bad data lines and bad config keys are errors naming file:line (and key), also via the CLI;
- the pair encoding scores completion tokens only (text and chat-style prompts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.datasets import DatasetSpecError
from launch.cli import main as cli_main
from learner.lm.dpo import DPOSettings, DPOTrainer, Reporter
from learner.lm.dpo_data import PreferencePair, arith_pairs, encode_pair, load_pairs, write_pairs
from learner.lm.model import LoraSettings, hf_weights, load_tokenizer
from services.config import load_run_config
from tests.fixtures.launch import Up, assert_nothing_left

pytestmark = pytest.mark.slow  # DeepSpeed training: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from common.models import init_model

    return init_model(tmp_path_factory.mktemp("dpo") / "model", size="tiny")


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    write_pairs(path, arith_pairs(64, seed=0))
    return path


def settings(model: Path, data: Path, **overrides: object) -> DPOSettings:
    # Measured on this model and data: 24 steps, about 5 s on 2 CPU cores; eval loss
    # 0.693 -> 0.24, accuracy 0 -> 1.0 (memorising the training pairs, the point here).
    values: dict[str, object] = dict(
        model_path=model,
        data=data,
        eval_data=data,
        epochs=6,
        batch_size=16,
        learning_rate=1e-3,
        beta=0.5,
        device="cpu",
        log_every=6,
    )
    values.update(overrides)
    return DPOSettings.model_validate(values)


def test_dpo_learns_preferences_and_saves_hf_folder(
    tiny_model: Path, pairs_file: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    trainer = DPOTrainer(settings(tiny_model, pairs_file), tmp_path)
    try:
        result = trainer.run()
        trained = hf_weights(trainer.engine.module)
    finally:
        trainer.close()

    first, late = result.history[0], result.history[-4:]
    assert len(result.history) == 24
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert sum(row["loss"] for row in late) / 4 < first["loss"] - 0.1
    assert sum(row["rewards/accuracies"] for row in late) / 4 > first["rewards/accuracies"] + 0.3
    assert sum(row["rewards/margins"] for row in late) / 4 > 0.3
    before, after = result.eval_before, result.eval_after
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert after["loss"] < before["loss"] - 0.2
    assert after["rewards/accuracies"] >= 0.8 > before["rewards/accuracies"] + 0.3
    assert after["rewards/margins"] > before["rewards/margins"] + 0.5
    assert all(row["lr"] == 1e-3 and row["tokens/s"] > 0 for row in result.history)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    assert result.output == tmp_path / "final"
    loaded = AutoModelForCausalLM.from_pretrained(result.output)
    state = loaded.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    original = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert not torch.equal(state[Q_PROJ], original[Q_PROJ])
    assert load_tokenizer(result.output).eos_token == "<|endoftext|>"


def test_dpo_lora_trains_adapters_only(tiny_model: Path, pairs_file: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    lora = LoraSettings(r=8)
    trainer = DPOTrainer(
        settings(tiny_model, pairs_file, eval_data=None, epochs=1, lora=lora), tmp_path
    )
    try:
        base = trainer.engine.module.get_base_model()
        base_before = base.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
        result = trainer.run()
        base_after = base.model.layers[0].self_attn.q_proj.base_layer.weight.detach()
        lora_b = base.model.layers[0].self_attn.q_proj.lora_B["default"].weight.detach()
    finally:
        trainer.close()

    assert len(result.history) == 4 and not result.eval_after
    assert torch.equal(base_after, base_before)  # the frozen base weight did not move
    assert lora_b.abs().sum() > 0  # B starts at zero: the adapter trained
    exported = AutoModelForCausalLM.from_pretrained(result.output).state_dict()
    assert not any("lora" in name for name in exported)
    assert not torch.equal(exported[Q_PROJ], base_before)  # the adapter is merged in


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not JSON: Expecting property name enclosed in double quotes"),
        ('["a", "b"]', "expected a JSON object with keys prompt, chosen, rejected"),
        ('{"prompt": "Q", "chosen": " 1"}', "missing key 'rejected'"),
        ('{"prompt": "Q", "chosen": "", "rejected": " 2"}', "'chosen' is an empty string"),
        ('{"prompt": "  ", "chosen": " 1", "rejected": " 2"}', "'prompt' is an empty string"),
        ('{"prompt": "Q", "chosen": 1, "rejected": " 2"}', "'chosen' must be a string, got int"),
        ('{"prompt": "Q", "chosen": " 1", "rejected": " 1"}', "'chosen' and 'rejected' are"),
        (
            '{"prompt": [{"role": "user"}], "chosen": " 1", "rejected": " 2"}',
            "'prompt' as a list must be non-empty {role, content} messages",
        ),
    ],
)
def test_bad_data_line_is_named(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "pairs.jsonl"
    good = json.dumps({"prompt": "Q: 1+1=?\nA:", "chosen": " 2", "rejected": " 3"})
    path.write_text(f"{good}\n\n{line}\n")  # the blank line 2 is skipped, the bad one is line 3
    with pytest.raises(DatasetSpecError) as info:
        load_pairs(path)
    assert str(info.value).startswith(f"{path}:3: {problem}")


def _job_file(tmp_path: Path, model: Path, data: Path, extra: str = "", run: str = "") -> Path:
    path = tmp_path / "dpo.yaml"
    path.write_text(
        f"run: {{name: dpo-itest, dir: {tmp_path / 'run'}{run}}}\n"
        f"job:\n  kind: dpo\n  model_path: {model}\n  data: {data}\n  device: cpu\n{extra}"
    )
    return path


def test_cli_reports_bad_data_and_config(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "Q", "chosen": " 1"}\n')
    config = _job_file(tmp_path, tiny_model, data)
    assert cli_main(["up", str(config)]) == 2  # prepare reads every line before any service
    assert f"job.data: {data}:1: missing key 'rejected'" in capsys.readouterr().err

    config = _job_file(tmp_path, tiny_model, data, "  betta: 0.2\n  epochs: many\n")
    assert cli_main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}:7: job.betta: unknown key 'betta' (did you mean 'beta'?)" in err
    assert f"{config}:8: job.epochs: Input should be a valid integer" in err

    config = _job_file(tmp_path, tiny_model, data, "  output_dir: out\n")
    assert cli_main(["validate", str(config)]) == 2
    assert "a run writes into its run directory" in capsys.readouterr().err


def test_example_config_validates() -> None:
    config = load_run_config(ROOT / "examples" / "dpo_arith.yaml", environ={})
    (entry,) = config.services
    assert entry.service == "dpo_learner" and entry.main
    assert isinstance(entry.settings, DPOSettings) and entry.settings.data.name.endswith(".jsonl")


class StopAfter(Reporter):
    """Stops the run once ``steps`` steps are done; records what the trainer reported."""

    def __init__(self, steps: int | None = None) -> None:
        self.steps, self.seen = steps, 0
        self.statuses: list[str] = []

    def status(self, message: str, *, running: bool = False) -> None:
        self.statuses.append(message)

    def progress(self, step: int, total: int, row: dict[str, float]) -> None:
        self.seen = step

    def stopping(self) -> bool:
        return self.steps is not None and self.seen >= self.steps


def test_stopped_run_resumes_where_it_stopped(
    tiny_model: Path, pairs_file: Path, tmp_path: Path
) -> None:
    knobs = settings(tiny_model, pairs_file, eval_data=None, epochs=2, log_every=1)  # 8 steps
    trainer = DPOTrainer(knobs, tmp_path / "whole")
    try:
        whole = trainer.run()
    finally:
        trainer.close()

    out = tmp_path / "stopped"
    trainer = DPOTrainer(knobs, out, StopAfter(3))
    try:
        first = trainer.run()
    finally:
        trainer.close()
    assert first.stopped and first.steps == 3 and first.output is None
    assert (out / "checkpoints" / "update-00000003").is_dir() and not (out / "final").exists()

    reporter = StopAfter()
    trainer = DPOTrainer(knobs, out, reporter)
    try:
        rest = trainer.run()
    finally:
        trainer.close()
    assert rest.resumed_from == 3 and rest.steps == 8 and len(rest.history) == 5
    assert "resumed from checkpoint update-00000003 (step 3 of 8)" in reporter.statuses
    for resumed, straight in zip(rest.history, whole.history[3:], strict=True):
        assert resumed["loss"] == pytest.approx(straight["loss"], abs=1e-5)
    assert rest.output == out / "final" and (out / "final" / "config.json").is_file()

    reporter = StopAfter()
    trainer = DPOTrainer(knobs, out, reporter)
    try:
        again = trainer.run()
    finally:
        trainer.close()
    assert again.already_finished and not again.history
    assert reporter.statuses[-1].startswith("already finished: checkpoint update-00000008")


def test_dpo_job_runs_under_rlfleet_up(
    tiny_model: Path, pairs_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole user path: up (tracked by MLflow), watch, export, up again."""
    monkeypatch.setenv("RLFLEET_PROGRESS_INTERVAL_S", "0")  # every record a line, in order
    config = _job_file(
        tmp_path,
        tiny_model,
        pairs_file,
        f"  eval_data: {pairs_file}\n  epochs: 2\n  batch_size: 16\n  learning_rate: 0.001\n"
        "  beta: 0.5\n  log_every: 2\n  checkpoint_every: 4\n",
        run=", tracking: {mlflow: true}",
    )
    run_dir = tmp_path / "run"
    up = Up(config, run_dir, services=["dpo"], budget_s=240)
    try:
        assert up.wait() == 0, up.diagnostics()
    finally:
        up.stop()
    assert_nothing_left(run_dir)
    lines = up.lines
    phases = [
        "dpo: importing torch, transformers and DeepSpeed",
        "dpo: loading model",
        "dpo: model on cpu in",
        "dpo: scoring 128 pairs under the reference model",
        "dpo: reference scored in",
        "dpo-itest  step 0/8  0%",
        "dpo-itest  step 8/8  100%",
        "dpo: 8/8 steps, last loss",
        "rlfleet: run 'dpo-itest' ok (exit 0)",
    ]
    at = [next((i for i, line in enumerate(lines) if line.startswith(p)), -1) for p in phases]
    assert -1 not in at and at == sorted(at), up.diagnostics()
    assert "eval loss 0.693 ->" in lines[at[7]]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "metrics" and r["service"] == "dpo"]
    assert steps == [0, 2, 4, 6, 8, 8]  # eval before, every log_every steps, eval after
    assert {"loss", "rewards/accuracies", "lr"} <= set(records[2]["values"])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "update-00000008"
    assert (run_dir / "final" / "model.safetensors").is_file()
    # MLflow holds TensorBoard's scalars (names, steps, values) and the final model.
    from mlflow.tracking import MlflowClient

    from tests.integration.test_learner_tracking import tensorboard_points

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    board = tensorboard_points(run_dir / "tensorboard")
    assert {"train/loss", "eval/loss", "train/rewards/accuracies"} <= set(board)
    run_id = json.loads((run_dir / "learner" / "tracking.json").read_text())["mlflow"]
    client = MlflowClient((run_dir / "mlruns").as_uri())
    assert client.get_run(run_id).info.status == "FINISHED"
    for tag, points in board.items():
        history = client.get_metric_history(run_id, tag)
        assert [(m.step, pytest.approx(m.value)) for m in history] == points, tag
    logged = {a.path for a in client.list_artifacts(run_id, "final")}
    assert {"final/model.safetensors", "final/config.json"} <= logged

    exported = tmp_path / "exported"
    assert cli_main(["export", str(run_dir), str(exported)]) == 0
    assert (exported / "model.safetensors").is_file() and (exported / "config.json").is_file()
    # A stopped run has no final/: its latest checkpoint exports too, to the same weights.
    from_checkpoint = tmp_path / "from-checkpoint"
    assert cli_main(["export", str(run_dir / "checkpoints"), str(from_checkpoint)]) == 0
    final = load_file(exported / "model.safetensors")
    rebuilt = load_file(from_checkpoint / "model.safetensors")
    assert final.keys() == rebuilt.keys()
    assert all(torch.equal(final[k], rebuilt[k]) for k in final)

    up = Up(config, run_dir, services=["dpo"], budget_s=120)
    try:
        assert up.wait() == 0, up.diagnostics()
    finally:
        up.stop()
    assert "dpo: already finished: checkpoint update-00000008 is step 8 of 8" in up.output


def test_encoding_scores_completion_tokens_only(tiny_model: Path) -> None:
    tokenizer = load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    pair = PreferencePair("Q: 12+34=?\nA:", " <answer>46</answer>", " <answer>47</answer>", "x:1")
    encoded = encode_pair(pair, tokenizer, max_length=64)
    assert tokenizer.decode(encoded.prompt) == pair.prompt
    assert encoded.chosen[-1] == eos and tokenizer.decode(encoded.chosen[:-1]) == pair.chosen
    assert not encoded.truncated

    short = encode_pair(pair, tokenizer, max_length=len(encoded.prompt) + 3)
    assert short.prompt == encoded.prompt and short.chosen == encoded.chosen[:3]
    assert short.truncated

    chat = PreferencePair(({"role": "user", "content": "hi"},), "yes", "no", "x:2")
    encoded = encode_pair(chat, tokenizer, max_length=64)
    assert tokenizer.decode(encoded.prompt).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(encoded.chosen) == "yes<|im_end|>\n"  # the template ends the turn


def test_data_generator_writes_valid_pairs(tmp_path: Path) -> None:
    out = tmp_path / "arith.jsonl"
    assert cli_main(["dpo-data", str(out), "--count", "5", "--seed", "3"]) == 0
    pairs = load_pairs(out)
    assert len(pairs) == 5
    for pair in pairs:
        a, op, b = pair.prompt[3:].partition("=")[0].partition("+")
        assert pair.chosen.startswith(" <answer>") and pair.rejected.startswith(" <answer>")
        assert pair.chosen != pair.rejected
        if op:  # "a+b": the chosen answer is the sum
            assert pair.chosen == f" <answer>{int(a) + int(b)}</answer>"


def test_packed_dpo_trains_as_padded(tiny_model: Path, pairs_file: Path, tmp_path: Path) -> None:
    """`packing: true`: the reference scores and every step's loss and rewards are the padded
    run's (the forward passes only pack the pairs' sequences: learner/lm/packing.py)."""
    runs = {}
    for packing in (False, True):
        trainer = DPOTrainer(
            settings(tiny_model, pairs_file, epochs=1, log_every=1, packing=packing),
            tmp_path / str(packing),
        )
        try:
            runs[packing] = (trainer.ref_train.clone(), trainer.run().history)
        finally:
            trainer.close()
    (ref_padded, padded), (ref_packed, packed) = runs[False], runs[True]
    # sequence sums of log-probs (tens of nats): float32 rounding, relative
    torch.testing.assert_close(ref_packed, ref_padded, rtol=1e-6, atol=1e-5)
    assert len(packed) == len(padded) > 1
    for row_packed, row_padded in zip(packed, padded, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert row_packed[key] == pytest.approx(row_padded[key], rel=1e-4, abs=1e-5), key
