"""What `rlfleet export` was pointed at: a run directory, a run name under runs/, a run config
file, a DeepSpeed checkpoint folder (``checkpoints/`` or one tag in it), a language model's
``final/`` Hugging Face folder, or a game run's ``final/`` policy folder.

A language-model run directory holds ``config.yaml`` (the launcher's copy of the run file),
``checkpoints/`` (DeepSpeed: ``latest`` names the newest tag ``update-NNNNNNNN``; ZeRO 0 writes
``mp_rank_00_model_states.pt``, ZeRO 1-3 also ``zero_pp_rank_*_optim_states.pt`` with the fp32
weights), ``final/`` when the run finished (Hugging Face folder + ``rlfleet_run.json``),
``learner/``, ``logs/``, ``tensorboard/``. A game run's ``final/`` holds ``policy.pt`` +
``policy.json`` (common.artifacts).

Resolution never imports torch; everything that is not one of those is a ConfigError saying what
was found.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.errors import ConfigError
from services.run_layout import RUN_CONFIG_FILE

__all__ = ["Source", "find_run_config", "resolve_source"]

LATEST = "latest"
RANK0_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class Source:
    kind: Literal["lm-final", "lm-checkpoint", "game"]
    path: Path  # the final/ folder, or the checkpoint tag folder
    run_dir: Path | None  # the run directory, when known
    config_path: Path | None  # the run config, when found
    tag: str | None = None  # checkpoint tag

    @property
    def checkpoints_dir(self) -> Path:
        return self.path.parent

    def describe(self) -> str:
        if self.kind == "lm-checkpoint":
            return f"DeepSpeed checkpoint {self.path}"
        return f"{'policy' if self.kind == 'game' else 'Hugging Face'} folder {self.path}"


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / n).is_file() for n in HF_WEIGHTS)


def _is_policy_folder(path: Path) -> bool:
    return (path / "policy.json").is_file() or (path / "policy.pt").is_file()


def _is_tag(path: Path) -> bool:
    return any((path / name).is_file() for name in RANK0_FILES)


def _latest_tag(checkpoints: Path) -> Path:
    latest = checkpoints / LATEST
    if latest.is_file():
        tag = checkpoints / latest.read_text().strip()
        if _is_tag(tag):
            return tag
        raise ConfigError(
            f"{latest} names '{tag.name}', which is not a checkpoint in {checkpoints}"
        )
    tags = sorted(p for p in checkpoints.iterdir() if p.is_dir() and _is_tag(p))
    if not tags:
        raise ConfigError(f"{checkpoints}: no DeepSpeed checkpoint in it (no {LATEST}, no tags)")
    return tags[-1]


def find_run_config(run_dir: Path | None, explicit: Path | None = None) -> Path | None:
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"--config {explicit}: no such file")
        return explicit
    if run_dir is not None and (run_dir / RUN_CONFIG_FILE).is_file():
        return run_dir / RUN_CONFIG_FILE
    return None


def _run_dir_of(folder: Path) -> Path | None:
    """The run directory above a final/ or checkpoints/ folder, if it looks like one."""
    parent = folder.parent
    markers = ("checkpoints", "learner", "logs", RUN_CONFIG_FILE, "final")
    return parent if any((parent / m).exists() for m in markers) else None


def resolve_source(
    text: str | os.PathLike[str],
    *,
    runs_root: Path = Path("runs"),
    config: Path | None = None,
) -> Source:
    """Classify what ``text`` points at (see the module docstring); ``config`` overrides the
    run config found next to it."""
    raw = os.fspath(text)
    path = Path(raw)
    if path.is_file():
        if path.suffix in (".yaml", ".yml"):
            from services.config import load_run_config

            run_dir = Path(load_run_config(path).run_dir)
            if not run_dir.is_dir():
                raise ConfigError(
                    f"{raw}: its run directory {run_dir} does not exist (has the run been started?)"
                )
            return _from_run_dir(run_dir, config or path, raw)
        raise ConfigError(
            f"{raw}: not a run directory, a run config (.yaml), a checkpoint folder or a final/ "
            "folder"
        )
    if path.is_dir():
        return _from_dir(path, config, raw)
    named = runs_root / raw
    if os.sep not in raw and named.is_dir():
        return _from_dir(named, config, raw)
    runs = sorted(p.name for p in runs_root.iterdir() if p.is_dir()) if runs_root.is_dir() else []
    close = difflib.get_close_matches(raw, runs, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    where = "" if os.sep in raw else f" (nor a run at {named})"
    raise ConfigError(f"nothing to export at '{raw}'{where}{hint}")


def _from_dir(path: Path, config: Path | None, raw: str) -> Source:
    if _is_policy_folder(path):
        return Source("game", path, _run_dir_of(path), find_run_config(_run_dir_of(path), config))
    if _is_hf_folder(path):
        run_dir = _run_dir_of(path)
        return Source("lm-final", path, run_dir, find_run_config(run_dir, config))
    if _is_tag(path):
        run_dir = _run_dir_of(path.parent)
        return Source(
            "lm-checkpoint", path, run_dir, find_run_config(run_dir, config), tag=path.name
        )
    if (path / LATEST).is_file() or (path.name == "checkpoints" and path.is_dir()):
        tag = _latest_tag(path)
        run_dir = _run_dir_of(path)
        return Source("lm-checkpoint", tag, run_dir, find_run_config(run_dir, config), tag=tag.name)
    return _from_run_dir(path, config, raw)


def _from_run_dir(run_dir: Path, config: Path | None, raw: str) -> Source:
    final = run_dir / "final"
    config_path = find_run_config(run_dir, config)
    if final.is_dir() and _is_policy_folder(final):
        return Source("game", final, run_dir, config_path)
    if final.is_dir() and _is_hf_folder(final):
        return Source("lm-final", final, run_dir, config_path)
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        if _looks_like_game_run(config_path):
            raise ConfigError(
                f"{raw}: game run without a final policy (final/policy.json); the learner writes "
                "it when the run finishes"
            )
        tag = _latest_tag(checkpoints)
        return Source("lm-checkpoint", tag, run_dir, config_path, tag=tag.name)
    found = sorted(p.name for p in run_dir.iterdir())[:8]
    raise ConfigError(
        f"{raw}: not a run directory with final/ or checkpoints/, a checkpoint folder, a Hugging "
        f"Face folder (config.json + model.safetensors) or a policy folder (policy.json); "
        f"found: {', '.join(found) or 'nothing'}"
    )


def _looks_like_game_run(config_path: Path | None) -> bool:
    if config_path is None:
        return False
    try:
        return lm_learner_settings(config_path) is None
    except ConfigError:
        return False


def load_config(config_path: Path) -> Any:
    from services.config import load_run_config

    return load_run_config(config_path)


# Service kinds training a causal LM: their settings name the base model (model_path) and lora.
LM_LEARNER_KINDS = ("lm_learner", "dpo_learner")


def lm_learner_settings(config_path: Path) -> Any:
    """The run's LM learner settings (learner.lm.settings.LMLearnerSettings, or a DPO run's
    learner.lm.dpo_job.DPOSettings), or None."""
    config = load_config(config_path)
    for entry in config.services:
        if entry.service in LM_LEARNER_KINDS:
            return entry.settings
    return None


def calibration_dataset(config_path: Path) -> dict[str, Any] | None:
    """The run's prompt dataset: the rollout drivers' ``dataset``, else the learner's SFT or
    evaluation dataset."""
    config = load_config(config_path)
    for entry in config.services:
        if entry.service == "rollout":
            return dict(entry.settings.dataset)
    learner = lm_learner_settings(config_path)
    if learner is not None:
        for part in (getattr(learner, "sft", None), getattr(learner, "eval", None)):
            if part is not None:
                return dict(part.dataset)
        if getattr(learner, "data", None) is not None:  # DPO: the pairs' prompts
            return {"jsonl": str(learner.data)}
    return None


def run_summary(final: Path) -> dict[str, Any]:
    path = final / "rlfleet_run.json"
    return json.loads(path.read_text()) if path.is_file() else {}
