"""`rlfleet export`: what it writes from what the learners leave behind, and that the outputs
run where they are meant to.

- game runs: the learner's own `save_final` (GameWorkload, on a stand-in learner) -> ONNX; the
  graph matches the torch policy (onnxruntime) for discrete, continuous and image policies;
- language models (slow): a real GRPO run (every service's real `main`, DeepSpeed ZeRO 0, the
  transformers sampler engine) leaves final/, checkpoints/ and config.yaml; its final/ and its
  last checkpoint export to the same weights; checkpoints written by the learner's save path at
  ZeRO 3 and with LoRA (ZeRO 2 and 3) export to the engine's own merged weights; exported
  folders load with transformers and give the source's logits and greedy output;
- quantization (slow): w8a8 and w4a16-awq exports (llmcompressor in .venv-quant, created once per
  checkout on first use) are compressed-tensors folders; the AWQ one loads in vLLM (a subprocess)
  and answers (w4a16: tests/e2e/test_serve_workflow.py);
- bad inputs are ConfigErrors naming what was wrong (exit 2 from the CLI).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from common.artifacts import load_policy, save_policy
from common.policies import build_policy
from common.policy_config import PolicyConfig
from learner.export import MANIFEST_FILE, export, verify
from learner.export.game import ONNX_FILE, ONNX_JSON
from services.errors import ConfigError
from tests.fixtures.lm import write_run_config

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Q: 3+4=?\nA:", "Q: 9-2=?\nA:", "Q: 5+5=?\nA:", "Q: 8-6=?\nA:"]


# ---------------------------------------------------------------------------- game policies


def _game_run(root: Path) -> Path:
    """A finished CartPole PPO run's final/, written by the learner's writer (save_policy) with
    the fields GameWorkload.save_final gives it."""
    spaces = (gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2))
    config = PolicyConfig(hidden_sizes=(16, 16))
    torch.manual_seed(0)
    net = build_policy(*spaces, config)
    run = root / "runs" / "cartpole-ppo"
    save_policy(
        run / "final", net.state_dict(), env_id="CartPole-v1", env_kwargs={},
        observation_space=spaces[0], action_space=spaces[1], policy=config, algo="ppo",
        version=7, global_step=4096, updates=7, complete=True,
    )  # fmt: skip
    (run / "checkpoints").mkdir()
    return run


def _onnx_outputs(folder: Path, obs: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / ONNX_FILE), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"obs": obs}), strict=True))


def test_game_run_exports_onnx_matching_torch(tmp_path: Path, monkeypatch) -> None:
    run = _game_run(tmp_path)
    monkeypatch.chdir(tmp_path)  # "cartpole-ppo" is a run name under runs/
    manifest = export("cartpole-ppo", tmp_path / "out")
    out = tmp_path / "out"
    assert manifest["kind"] == "game-policy" and manifest["weight_version"] == 7
    assert manifest["run"] == "cartpole-ppo" and manifest["parity"]["ok"]
    assert set(manifest["files"]) == {ONNX_FILE, ONNX_JSON}
    assert verify(out) == []
    description = json.loads((out / ONNX_JSON).read_text())
    assert description["env_id"] == "CartPole-v1"
    assert [i["name"] for i in description["inputs"]] == ["obs"]
    assert [o["name"] for o in description["outputs"]] == ["logits", "action", "value"]
    assert description["action_space"]["discrete"]["n"] == "2"

    # Independently of the export's own check: fresh observations, batch sizes 1 and 33.
    policy = load_policy(run)
    rng = np.random.default_rng(1)
    for batch in (1, 33):
        obs = rng.normal(size=(batch, 4)).astype(np.float32) * 2
        got = _onnx_outputs(out, obs)
        with torch.no_grad():
            x = torch.as_tensor(obs)
            features = policy.net.trunk(x)
            logits = policy.net.actor(features).numpy()
            value = policy.net.critic(features).squeeze(-1).numpy()
        np.testing.assert_allclose(got["logits"], logits, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got["value"], value, atol=1e-5, rtol=1e-5)
        greedy = [policy.act(o, deterministic=True) for o in obs]
        assert got["action"].tolist() == [int(a) for a in greedy]


@pytest.mark.parametrize("kind", ["continuous", "image", "multidiscrete"])
def test_other_policies_export_with_parity(tmp_path: Path, kind: str) -> None:
    if kind == "continuous":
        spaces = (gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Box(-2, 2, (2,), np.float32))
    elif kind == "image":
        spaces = (gym.spaces.Box(0, 255, (84, 84, 3), np.uint8), gym.spaces.Discrete(4))
    else:
        spaces = (gym.spaces.Box(-1, 1, (5,), np.float32), gym.spaces.MultiDiscrete([3, 2]))
    config = PolicyConfig(hidden_sizes=(8,))
    net = build_policy(*spaces, config)
    save_policy(
        tmp_path / "final", net.state_dict(), env_id="Test-v0", env_kwargs={},
        observation_space=spaces[0], action_space=spaces[1], policy=config, version=3,
    )  # fmt: skip
    manifest = export(tmp_path / "final", tmp_path / "out")
    assert manifest["parity"]["ok"], manifest["parity"]
    description = json.loads((tmp_path / "out" / ONNX_JSON).read_text())
    names = [o["name"] for o in description["outputs"]]
    if kind == "continuous":
        assert names == ["mean", "log_std", "action", "value"]
        obs = np.random.default_rng(0).uniform(-1, 1, (16, 3)).astype(np.float32)
        got = _onnx_outputs(tmp_path / "out", obs)
        assert np.all(got["action"] <= 2) and np.all(got["action"] >= -2)
    elif kind == "image":
        assert description["inputs"][0]["dtype"] == "uint8"
    else:
        assert description["outputs"][1]["shape"] == ["batch", 2]


def test_bad_inputs_are_clear_errors(tmp_path: Path, monkeypatch) -> None:
    run = _game_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"did you mean cartpole-ppo"):
        export("cartpole-ppp", tmp_path / "o1")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"not a run directory .*found: notes.txt"):
        export(tmp_path / "junk", tmp_path / "o2")
    with pytest.raises(ConfigError, match=r"not a run directory, a run config"):
        export(tmp_path / "junk" / "notes.txt", tmp_path / "o3")
    with pytest.raises(ConfigError, match=r"--quantize applies to language-model runs"):
        export(run, tmp_path / "o4", quantize="w4a16")
    with pytest.raises(ConfigError, match=r"not empty \(pass --force"):
        export(run, tmp_path / "junk")
    with pytest.raises(ConfigError, match=r"refusing to delete it"):
        export(run, tmp_path / "junk", force=True)
    assert (tmp_path / "junk" / "notes.txt").is_file()  # untouched
    export(run, tmp_path / "o5")
    export(run, tmp_path / "o5", force=True)  # an earlier export may be replaced
    # A checkpoint without the run's config cannot know its base model.
    tag = tmp_path / "ck" / "update-00000001"
    tag.mkdir(parents=True)
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(ConfigError, match=r"needs the run's config"):
        export(tag, tmp_path / "o6")
    assert not (tmp_path / "o6").exists()  # no half export left behind
    # The command: exit 2, one line naming the problem, no traceback.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "export", "no-such-run", str(tmp_path / "o7")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "nothing to export at 'no-such-run'" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------- language models


def _logits_and_greedy(model: Any, tokenizer: Any) -> tuple[torch.Tensor, list[list[int]]]:
    model.eval()
    logits, greedy = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            logits.append(model(input_ids=ids).logits[0])
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            greedy.append(out[0, ids.shape[1] :].tolist())
    return torch.cat(logits), greedy


def _check_same_model(export_dir: Path, weights: dict[str, torch.Tensor], base: Path) -> None:
    """The exported folder, loaded by transformers, is the model ``weights`` describe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(export_dir)
    source = AutoModelForCausalLM.from_pretrained(base)
    source.load_state_dict(weights, strict=False)
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    assert tokenizer.chat_template  # the chat template travelled
    for name, tensor in source.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    got_logits, got_greedy = _logits_and_greedy(exported, tokenizer)
    want_logits, want_greedy = _logits_and_greedy(source, tokenizer)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert got_greedy == want_greedy


def _check_manifest(folder: Path) -> dict[str, Any]:
    import hashlib

    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
        assert len(data) == entry["bytes"]
    assert verify(folder) == []
    for required in ("model.safetensors", "config.json", "generation_config.json",
                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # fmt: skip
        assert required in manifest["files"], required
    return manifest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lm_run_exports_final_and_checkpoint_alike(lm_run: Path, tiny_model_dir, tmp_path) -> None:
    from safetensors.torch import load_file

    manifest = export(lm_run, tmp_path / "final-export")
    assert manifest["source"]["kind"] == "final" and manifest["weight_version"] == 2
    assert manifest["run"] == "export-grpo" and manifest["quantization"] is None
    _check_manifest(tmp_path / "final-export")
    # The last checkpoint holds the same weights final/ was written from.
    manifest = export(lm_run / "checkpoints", tmp_path / "ckpt-export")
    assert manifest["source"]["kind"] == "checkpoint" and manifest["source"]["zero_stage"] == 0
    assert manifest["weight_version"] == 2 and manifest["source"]["tag"] == "update-00000002"
    _check_manifest(tmp_path / "ckpt-export")
    final = load_file(lm_run / "final" / "model.safetensors")
    _check_same_model(tmp_path / "ckpt-export", final, tiny_model_dir)
    _check_same_model(tmp_path / "final-export", final, tiny_model_dir)
    base = load_file(tiny_model_dir / "model.safetensors")
    assert not torch.equal(final["model.layers.0.mlp.up_proj.weight"],
                           base["model.layers.0.mlp.up_proj.weight"])  # fmt: skip
    # An earlier checkpoint is addressable too.
    older = export(lm_run / "checkpoints" / "update-00000001", tmp_path / "v1")
    assert older["weight_version"] == 1
    # So is the run by its config file, and its final/ folder directly.
    by_config = export(lm_run / "config.yaml", tmp_path / "by-config")
    assert by_config["source"]["path"] == str(lm_run / "final")
    direct = export(lm_run / "final", tmp_path / "direct")
    assert direct["files"] == by_config["files"]


def _train_and_save(model_dir: Path, run_dir: Path, zero: int, lora: dict[str, Any] | None):
    """The LM learner's save path on a DeepSpeed engine trained 3 steps: the checkpoint under
    run_dir/checkpoints and the engine's own full weights (gathered, LoRA merged)."""
    from learner.engine import build_engine
    from learner.lm.model import hf_weights, load_causal_lm
    from learner.lm.settings import LoraSettings
    from learner.settings import DeepSpeedSettings, OptimizerSettings

    torch.manual_seed(0)
    module = load_causal_lm(model_dir, lora=LoraSettings(**lora) if lora else None)
    engine = build_engine(
        module,
        OptimizerSettings(lr=1e-2, eps=1e-8),
        DeepSpeedSettings(zero_stage=zero, device="cpu"),
    )
    try:
        ids = torch.randint(3, 100, (4, 12))
        for _ in range(3):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        engine.save(run_dir / "checkpoints", "update-00000003", {"updates": 3, "version": 3})
        gather: Any = contextlib.nullcontext()
        if zero == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(
                list(engine.module.parameters()), modifier_rank=None
            )
        with gather:
            weights = hf_weights(engine.module, torch.float32)
    finally:
        engine.close()
    return weights


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("zero", "lora"), [(3, None), (2, {"r": 4, "alpha": 8}), (3, {"r": 4, "alpha": 16})]
)
def test_checkpoints_of_any_zero_stage_and_lora_export(tiny_model_dir, tmp_path, zero, lora):
    run_dir = tmp_path / "run"
    knobs: dict[str, Any] = {"model_path": str(tiny_model_dir), "zero_stage": zero,
                             "device": "cpu", "lora": lora}  # fmt: skip
    run_dir.mkdir()
    write_run_config(run_dir, "export-zero", knobs)
    weights = _train_and_save(tiny_model_dir, run_dir, zero, lora)
    assert not any("lora" in k for k in weights)
    manifest = export(run_dir, tmp_path / "out")  # no final/: the latest checkpoint
    assert manifest["source"]["zero_stage"] == zero and manifest["weight_version"] == 3
    assert (manifest["source"]["lora"] is not None) == (lora is not None)
    _check_manifest(tmp_path / "out")
    _check_same_model(tmp_path / "out", weights, tiny_model_dir)


# ---------------------------------------------------------------------------- quantization


def test_quant_env_is_created_once_and_reused(tmp_path: Path) -> None:
    """The steps creation takes (torch first, then the pinned file), the stamp that marks it
    complete, reuse without any step, and a rebuild when the pinned requirements change."""
    from learner.export import quantize as q

    venv = tmp_path / "venv-quant"
    calls: list[list[str]] = []

    def run(argv: list[str], **kwargs: Any) -> SimpleNamespace:
        calls.append(argv)
        if argv[1:3] == ["-m", "venv"]:
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").write_text("")
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    said: list[str] = []
    assert q.ensure_quant_env(venv, say=said.append, run=run) == venv / "bin" / "python"
    installs = [c[c.index("install") + 1 :] for c in calls if "install" in c]
    assert installs[1] == ["-q", q.TORCH_PIN]  # torch first
    assert installs[2][:3] == ["-q", "-r", str(q.requirements_path())]
    assert "creating the quantizer environment" in said[0]
    assert (venv / q.STAMP).read_text().strip() == q._digest(q.requirements_path())
    calls.clear()
    q.ensure_quant_env(venv, say=said.append, run=run)
    assert calls == []  # cached: nothing run
    (venv / q.STAMP).write_text("outdated\n")
    q.ensure_quant_env(venv, say=said.append, run=run)
    assert calls and any("removing the incomplete or outdated" in m for m in said)

    def failing(argv: list[str], **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(returncode=1, stdout="", stderr="No matching distribution")

    from services.errors import RlfleetError

    with pytest.raises(RlfleetError, match=r"(?s)'python -m venv' failed .*No matching"):
        q.ensure_quant_env(tmp_path / "other", say=said.append, run=failing)


@pytest.fixture(scope="session")
def quant_env() -> Path:
    """The quantizer environment: created on first use (a few minutes, printed), then reused
    from its path (.venv-quant, or $RLFLEET_QUANT_VENV) by every later run on the machine."""
    from learner.export.quantize import ensure_quant_env

    return ensure_quant_env()


def _vllm_answers(folder: Path, tmp_path: Path) -> dict[str, Any]:
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    request.write_text(json.dumps({"model": str(folder), "prompts": PROMPTS, "max_tokens": 8}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "learner.export.vllm_probe", str(request), str(result)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())


def _quantized_export(lm_run: Path, out: Path, scheme: str) -> None:
    export(lm_run, out, quantize=scheme, calibration_samples=64)
    check_quantized(out, scheme, samples=64)


def check_quantized(out: Path, scheme: str, *, samples: int) -> None:
    """``out`` is a complete compressed-tensors export of the lm_run fixture's model."""
    quant = _check_manifest(out)["quantization"]
    assert quant["scheme"] == scheme and quant["format"] == "compressed-tensors"
    assert quant["libraries"]["llmcompressor"] and quant["libraries"]["compressed-tensors"]
    calibration = {"dataset": {"generator": "arith", "digits": 1}, "samples": samples}
    assert quant["calibration"] == calibration
    assert "lm_head" in quant["ignore"]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


# Each scheme is exported and loaded in vLLM once in the suite: w4a16 by `rlfleet export` in
# tests/e2e/test_serve_workflow.py (then served), w8a8 here (quantize() itself, then served, in
# tests/integration/test_sampler_serve_quantized.py), w4a16-awq here.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_w8a8_export_is_compressed_tensors(lm_run: Path, quant_env: Path, tmp_path) -> None:
    _quantized_export(lm_run, tmp_path / "w8a8", "w8a8")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_awq_export_loads_in_vllm(lm_run: Path, quant_env: Path, tmp_path) -> None:
    out = tmp_path / "w4a16-awq"
    _quantized_export(lm_run, out, "w4a16-awq")
    answers = _vllm_answers(out, tmp_path)
    assert answers["quantization"] == "compressed-tensors"
    assert len(answers["greedy"]) == len(PROMPTS)
    assert all(a["token_ids"] for a in answers["greedy"])
