"""`rlfleet export RUN_OR_CHECKPOINT OUT`: a trained policy in the form something else runs.

- Language-model runs: a Hugging Face folder (``model.safetensors``, ``config.json``,
  ``generation_config.json``, tokenizer files, ``chat_template.jinja``; a vision-language model's
  ``processor_config.json`` too), LoRA merged, from the
  run's ``final/`` folder or any DeepSpeed checkpoint (ZeRO 0-3) (`learner.export.lm`);
  optionally quantized by llmcompressor into a compressed-tensors checkpoint vLLM loads
  (``--quantize w8a8|w4a16|w4a16-awq``, calibrated on the run's own prompts;
  `learner.export.quantize`, which runs the quantizer in its own environment).
- Game runs: ``policy.onnx`` + ``policy.onnx.json``, checked against the torch policy with
  onnxruntime (`learner.export.game`).

Every export ends with ``rlfleet_export.json`` (`learner.export.manifest`): run, weight version,
source, quantization, library versions and the sha256 of every file. Nothing heavy (torch,
transformers, onnx) loads before an export needs it, so `rlfleet` starts fast
(`learner.export.commands` holds the command).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from learner.export import manifest, sources
from learner.export import quantize as quantizer
from learner.export.manifest import MANIFEST_FILE, library_versions, verify
from learner.export.sources import Source, resolve_source
from services.errors import ConfigError

__all__ = ["CALIBRATION_SAMPLES", "MANIFEST_FILE", "calibration_texts", "export", "verify"]

CALIBRATION_SAMPLES = 256


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"{out}: exists and is not a folder")
        if any(out.iterdir()):
            if not force:
                raise ConfigError(f"{out}: exists and is not empty (pass --force to replace it)")
            if not (out / MANIFEST_FILE).is_file():
                raise ConfigError(
                    f"{out}: not empty and not an earlier export (no {MANIFEST_FILE}); refusing "
                    "to delete it, even with --force"
                )
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _umask() -> int:
    try:  # Linux tells the umask without setting it (os.umask sets it for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _readable(folder: Path) -> None:
    """Give everything in the export the modes a plain open() or mkdir() would (0644 and 0755,
    less the umask): writers that save through a temporary file (safetensors via mkstemp) leave
    0600, which a container running as another user cannot read, and copies keep it."""
    umask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def calibration_texts(
    source: Source, tokenizer_dir: Path, count: int, dataset: dict[str, Any] | None = None
) -> tuple[list[str], dict[str, Any]]:
    """The run's own prompts (train split) rendered as the sampler sends them (chat messages
    through the chat template), each followed by its expert solution when the dataset has one
    (what the trained model's completions look like). Returns (texts, dataset spec)."""
    from common.datasets import DatasetSpecError, iter_tasks, take

    if dataset is None:
        if source.config_path is None:
            raise ConfigError(
                f"quantization calibrates on the run's prompts, and no run config was found for "
                f"{source.path}; pass --config RUN.yaml or --calibration-dataset SPEC"
            )
        dataset = sources.calibration_dataset(source.config_path)
        if dataset is None:
            raise ConfigError(f"{source.config_path}: no prompt dataset to calibrate on")
    try:
        tasks = take(iter_tasks(dataset, split="train"), count)
    except (DatasetSpecError, OSError) as exc:
        raise ConfigError(f"calibration dataset {dataset}: {exc}") from exc
    tokenizer = None
    texts = []
    for task in tasks:
        if task.messages:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
            prompt: Any = tokenizer.apply_chat_template(
                _without_images(task.messages), tokenize=False, add_generation_prompt=True
            )
        else:
            prompt = task.prompt
        texts.append(str(prompt) + (task.solution or ""))
    return texts, dataset


def _without_images(messages: Any) -> list[dict[str, Any]]:
    """Chat messages with their image parts left out: calibration runs the text model on
    token ids alone, and an image token without its pixels is a token the model never saw
    there."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [p for p in content if p.get("type") == "text"]
        out.append({**message, "content": content})
    return out


def export(
    source_text: str | Path,
    out: str | Path,
    *,
    quantize: str | None = None,
    config: str | Path | None = None,
    calibration_dataset: dict[str, Any] | None = None,
    calibration_samples: int = CALIBRATION_SAMPLES,
    force: bool = False,
    runs_root: Path = Path("runs"),
    progress: bool = True,
) -> dict[str, Any]:
    """Export what ``source_text`` names into ``out``; returns the manifest."""
    console = _console()

    def say(message: str) -> None:
        console.print(f"[bold cyan]export[/] {message}")

    source = resolve_source(
        source_text, runs_root=runs_root, config=Path(config) if config else None
    )
    out = Path(out)
    if quantize is not None:
        if source.kind == "game":
            raise ConfigError("--quantize applies to language-model runs, not game policies")
        if quantize not in quantizer.SCHEMES:
            known = ", ".join(quantizer.SCHEMES)
            raise ConfigError(f"--quantize {quantize!r}: unknown; known: {known}")
    if out.resolve() == source.path.resolve() or source.path.resolve() in out.resolve().parents:
        raise ConfigError(f"{out}: must not be inside the source {source.path}")
    _prepare_out(out, force)
    say(f"source: {source.describe()}")
    fields: dict[str, Any] = {
        "kind": "game-policy" if source.kind == "game" else "language-model",
        "run": _run_name(source),
        "run_dir": str(source.run_dir) if source.run_dir else None,
        "run_config": str(source.config_path) if source.config_path else None,
    }
    try:
        if source.kind == "game":
            from common.artifacts import load_policy

            policy = load_policy(source.path)
            fields |= _game(policy, out, say)
            fields["quantization"] = None
            fields["libraries"] = library_versions("torch", "onnx", "onnxruntime", "rlfleet")
        else:
            fields |= _lm(source, out, say, quantize, calibration_dataset, calibration_samples)
        _readable(out)
        say("writing the manifest (sha256 of every file)")
        result = manifest.write(out, fields, progress=progress)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # never leave a half export behind
        raise
    size = sum(e["bytes"] for e in result["files"].values())
    say(f"done: {out} ({len(result['files'])} files, {size / 1e6:.1f} MB)")
    return result


def _game(policy: Any, out: Path, say: Any) -> dict[str, Any]:
    from learner.export.game import export_game

    return export_game(policy, out, say)


def _lm(
    source: Source,
    out: Path,
    say: Any,
    scheme: str | None,
    dataset: dict[str, Any] | None,
    samples: int,
) -> dict[str, Any]:
    import tempfile

    from learner.export.lm import export_lm

    libraries = library_versions(
        "torch", "transformers", "safetensors", "deepspeed", "peft", "rlfleet"
    )
    if scheme is None:
        fields = export_lm(source, out, say)
        return {**fields, "quantization": None, "libraries": libraries}
    with tempfile.TemporaryDirectory(prefix=".rlfleet-export-fp-", dir=out.parent) as tmp:
        fp = Path(tmp)
        fields = export_lm(source, fp, say)
        texts, spec = calibration_texts(source, fp, samples, dataset)
        say(f"calibrating on {len(texts)} prompts of {spec}")
        shutil.rmtree(out)
        report = quantizer.quantize(fp, out, scheme, texts, say=say)
        fp_digest = _weights_digest(fp)
    quantization = {**report, "calibration": {"dataset": spec, "samples": len(texts)},
                    "unquantized_sha256": fp_digest}  # fmt: skip
    return {**fields, "quantization": quantization, "libraries": libraries}


def _weights_digest(folder: Path) -> str | None:
    """sha256 of the unquantized weights file the quantized folder was made from."""
    weights = folder / "model.safetensors"
    return manifest.sha256(weights) if weights.is_file() else None


def _run_name(source: Source) -> str | None:
    if source.config_path is not None:
        try:
            return str(sources.load_config(source.config_path).run.name)
        except ConfigError:
            pass
    return source.run_dir.name if source.run_dir is not None else None
