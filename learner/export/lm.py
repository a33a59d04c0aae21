"""Language-model export: a Hugging Face folder (safetensors, config, generation config,
tokenizer, chat template; a vision-language model's processor too), LoRA merged, from a run's
``final/`` folder or from any DeepSpeed checkpoint (ZeRO 0-3).

Checkpoints: ZeRO 1-3 keep the fp32 master weights in the optimizer shards, read with DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint`` (all ranks, all stages that shard); ZeRO 0 has no
shards, its ``mp_rank_00_model_states.pt`` holds the module's state_dict. The state is loaded
into the run's own model (``learner.lm.model.load_causal_lm`` with the run's LoRA settings), and
the weights come out through ``learner.lm.model.hf_weights`` — the code path the learner publishes
versions and writes ``final/`` with, so an export of the last checkpoint equals ``final/``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from learner.export.sources import Source, lm_learner_settings, run_summary
from learner.safe_load import safe_load, verify_checkpoint
from services.errors import ConfigError

__all__ = ["checkpoint_state", "export_lm"]

SKIP_FROM_FINAL = ("rlfleet_run.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# A vision-language model's processor: its image processor's settings (transformers writes
# them into processor_config.json, older versions into preprocessor_config.json) and the chat
# template that places the image tokens. The learner's final/ holds only the tokenizer.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def checkpoint_state(tag_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(module state_dict in fp32 where the checkpoint has it, client state) of one tag."""

    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    rank0 = next((tag_dir / n for n in names if (tag_dir / n).is_file()), None)
    if rank0 is None:
        raise ConfigError(f"{tag_dir}: not a DeepSpeed checkpoint (no model states file)")
    verify_checkpoint(tag_dir)  # before DeepSpeed's own loader below sees the shards
    saved = safe_load(rank0)
    client = {
        k: v
        for k, v in saved.items()
        if k not in ("module", "optimizer", "lr_scheduler", "buffer_names", "param_shapes",
                     "frozen_param_shapes", "shared_params", "frozen_param_fragments")
    }  # fmt: skip
    if any(tag_dir.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    else:
        state = saved.get("module")
        if not state:
            raise ConfigError(f"{rank0}: holds no module weights and there are no ZeRO shards")
    return dict(state), client


def _base_settings(source: Source) -> Any:
    if source.config_path is None:
        raise ConfigError(
            f"{source.path}: exporting a checkpoint needs the run's config (the base model and "
            f"LoRA settings): no config.yaml in {source.run_dir or source.path.parent}; pass "
            "--config RUN.yaml"
        )
    settings = lm_learner_settings(source.config_path)
    if settings is None:
        raise ConfigError(f"{source.config_path}: no lm_learner service (not a language-model run)")
    return settings


def export_lm(source: Source, out: Path, say: Any) -> dict[str, Any]:
    """Write the fp Hugging Face folder into ``out`` (exists, empty); returns manifest fields."""
    if source.kind == "lm-final":
        summary = run_summary(source.path)
        say(f"copying {source.path}")
        for item in sorted(source.path.iterdir()):
            if item.name in SKIP_FROM_FINAL or item.name.startswith("rlfleet_export"):
                continue
            if item.is_dir():
                shutil.copytree(item, out / item.name)
            else:
                shutil.copy2(item, out / item.name)
        fields: dict[str, Any] = {
            "weight_version": summary.get("version"),
            "updates": summary.get("updates"),
            "source": {"kind": "final", "path": str(source.path)},
        }
        base = None
        if source.config_path is not None:
            learner = lm_learner_settings(source.config_path)
            base = str(learner.model_path) if learner is not None else None
            fields["source"]["lora"] = _lora(learner)
    else:
        fields, base = _from_checkpoint(source, out, say)
    _complete(out, base, say)
    fields["base_model"] = base
    return fields


def _lora(settings: Any) -> dict[str, Any] | None:
    lora = getattr(settings, "lora", None)
    return None if lora is None else {**lora.model_dump(mode="json"), "merged": True}


def _from_checkpoint(source: Source, out: Path, say: Any) -> tuple[dict[str, Any], str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from learner.lm.model import (
        hf_weights,
        is_vision_model,
        load_causal_lm,
        load_processor,
        load_tokenizer,
    )

    settings = _base_settings(source)
    base = Path(settings.model_path)
    if not (base / "config.json").is_file():
        raise ConfigError(f"{source.config_path}: base model {base} (model_path) does not exist")
    say(f"reading {source.describe()}")
    state, client = checkpoint_state(source.path)
    say(f"rebuilding the run's model from {base}" + (" with LoRA" if settings.lora else ""))
    module = load_causal_lm(base, precision="fp32", lora=settings.lora)
    missing, unexpected = module.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False
    )
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(
            f"{source.path}: checkpoint does not match the run's model {base}"
            f"{' with LoRA' if settings.lora else ''}: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} (is --config the run's own config?)"
        )
    weights = hf_weights(module, torch.float32)
    say("merging LoRA adapters and saving safetensors" if settings.lora else "saving safetensors")
    vision = bool(is_vision_model(base))
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(str(base), dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.save_pretrained(out)
    # A processor saves its tokenizer, image processor and chat template together.
    (load_processor(base) if vision else load_tokenizer(base)).save_pretrained(out)
    ds_config = client.get("ds_config") or {}
    zero = int(ds_config.get("zero_optimization", {}).get("stage", settings.zero_stage))
    fields = {
        "weight_version": client.get("version"),
        "updates": client.get("updates"),
        "source": {
            "kind": "checkpoint",
            "path": str(source.path),
            "tag": source.tag,
            "zero_stage": zero,
            "deepspeed": client.get("ds_version"),
            "lora": _lora(settings),
        },
    }
    return fields, str(base)


def _complete(out: Path, base: str | None, say: Any) -> None:
    """Every file serving needs: fill in a missing generation config or chat template from the
    base model, and fail when weights, config or tokenizer are missing."""
    missing = [n for n in ("config.json", *TOKENIZER_FILES) if not (out / n).is_file()]
    if not any((out / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        missing.append("model.safetensors")
    if missing:
        raise ConfigError(f"export is missing {', '.join(missing)} (source incomplete?)")
    if not (out / "generation_config.json").is_file():
        from transformers import AutoConfig, GenerationConfig

        say("writing generation_config.json from the model config")
        GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(out))).save_pretrained(
            out
        )
    if not (out / "chat_template.jinja").is_file() and base is not None:
        template = Path(base) / "chat_template.jinja"
        if template.is_file():
            shutil.copy2(template, out / template.name)
    if is_vision_config(out / "config.json"):
        _complete_processor(out, base, say)


def is_vision_config(config: Path) -> bool:
    """Whether a config.json is a vision-language model's (it has a ``vision_config``)."""
    return "vision_config" in json.loads(config.read_text())


def _complete_processor(out: Path, base: str | None, say: Any) -> None:
    """A vision-language model's processor files, from the base model where the source has
    none (a final/ the learner wrote); ConfigError when neither has them, since a server
    cannot turn an image into the model's tokens without them."""
    if not any((out / n).is_file() for n in PROCESSOR_FILES) and base is not None:
        found = [Path(base) / n for n in (*PROCESSOR_FILES, *CHAT_TEMPLATE_FILES)]
        found = [f for f in found if f.is_file() and not (out / f.name).is_file()]
        if found:
            say(f"copying the processor from the base model {base}")
            for path in found:
                shutil.copy2(path, out / path.name)
    missing = []
    if not any((out / n).is_file() for n in PROCESSOR_FILES):
        missing.append(" or ".join(PROCESSOR_FILES))
    if not any((out / n).is_file() for n in CHAT_TEMPLATE_FILES):
        missing.append(" or ".join(CHAT_TEMPLATE_FILES))
    if missing:
        where = f"the source nor the base model {base}" if base else "the source (no base model)"
        raise ConfigError(
            f"export of a vision-language model is missing its processor: {'; '.join(missing)} "
            f"in neither {where}"
        )
