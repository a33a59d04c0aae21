"""Offline DPO (learner/lm/dpo.py) on the tiny local Qwen2 model with a real DeepSpeed engine:

- on 64 generated arithmetic pairs a few seconds of training lowers the loss and raises the
  reward accuracy and margin against the first step (where policy == reference: loss log 2);
  the saved folder loads with AutoModelForCausalLM and holds the trained weights;
- LoRA trains the adapters only (base weights untouched in the module, merged export differs);
- bad data lines and bad config keys are errors naming file:line (and key), also via the CLI;
- the pair encoding scores completion tokens only (text and chat-style prompts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from common.datasets import DatasetSpecError
from learner.lm.dpo import DPOSettings, DPOTrainer, load_settings
from learner.lm.dpo_data import PreferencePair, arith_pairs, encode_pair, load_pairs, write_pairs
from learner.lm.dpo_data import main as data_main
from learner.lm.model import LoraSettings, hf_weights, load_tokenizer
from services.cli import main as cli_main

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


def settings(model: Path, data: Path, out: Path, **overrides: object) -> DPOSettings:
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
        output_dir=out,
        log_every=6,
    )
    values.update(overrides)
    return DPOSettings.model_validate(values)


def test_dpo_learns_preferences_and_saves_hf_folder(
    tiny_model: Path, pairs_file: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    trainer = DPOTrainer(settings(tiny_model, pairs_file, tmp_path))
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
        settings(tiny_model, pairs_file, tmp_path, eval_data=None, epochs=1, lora=lora)
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


def test_cli_reports_bad_data_and_config(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "Q", "chosen": " 1"}\n')
    config = tmp_path / "dpo.yaml"
    body = f"model_path: {tiny_model}\ndata: {data}\noutput_dir: {tmp_path / 'out'}\ndevice: cpu\n"
    config.write_text(body)
    assert cli_main(["dpo", str(config)]) == 2
    assert f"rlfleet: error: {data}:1: missing key 'rejected'" in capsys.readouterr().err

    config.write_text(body + "betta: 0.2\nepochs: many\n")
    assert cli_main(["dpo", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}:5: betta: unknown key 'betta' (did you mean 'beta'?)" in err
    assert f"{config}:6: epochs: Input should be a valid integer" in err


def test_example_config_validates() -> None:
    settings = load_settings(ROOT / "examples" / "dpo_arith.yaml")
    assert settings.data.name.endswith(".jsonl")


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
    assert data_main([str(out), "--count", "5", "--seed", "3"]) == 0
    pairs = load_pairs(out)
    assert len(pairs) == 5
    for pair in pairs:
        a, op, b = pair.prompt[3:].partition("=")[0].partition("+")
        assert pair.chosen.startswith(" <answer>") and pair.rejected.startswith(" <answer>")
        assert pair.chosen != pair.rejected
        if op:  # "a+b": the chosen answer is the sum
            assert pair.chosen == f" <answer>{int(a) + int(b)}</answer>"
