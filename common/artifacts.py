"""A trained game policy on disk: the artifact the learner writes and everything that reads it.

The learner finishes a run by writing ``<run dir>/final/`` with `save_policy`:

- ``policy.pt``: the network's ``state_dict`` by name (float32 CPU tensors, ``torch.save``);
- ``policy.json``: what rebuilds it without the run config: ``env_id``, ``env_kwargs``, both
  spaces (``rlfleet.common.v1.Space`` as protobuf JSON), ``policy`` (`PolicyConfig` fields) and
  provenance (``algo``, ``version``, ``global_step``, ``updates``, ``complete``: false with
  ``stopped_at_update`` when the run was stopped before its end). Written last: its presence
  means the pair is complete.

A stopped learner writes ``final/`` too (marked incomplete). A run without ``final/`` (one
killed, or written before that) is read from its latest DeepSpeed checkpoint,
``<run>/checkpoints/<tag>/mp_rank_00_model_states.pt``: the module weights (``module``; ZeRO-3
shards through DeepSpeed's ``zero_to_fp32``) and, for the spaces and policy config, the
description the game learner stores in every checkpoint's client state (``POLICY_STATE_KEY``),
else the run's ``config.yaml`` with the spaces of a local ``gymnasium.make``.

`load_policy` reads either back into a module built by `common.policies.build_policy` (the same
constructor actors and learner use); ``LoadedPolicy.predict(obs)`` (one observation or a batch)
is the way to use a trained policy from Python. `rlfleet play` (env_server/play.py) runs it in
local envs. Module import is cheap (stdlib only); torch loads when a policy is saved or loaded.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.errors import ConfigError, InvalidArgument
from services.run_layout import CHECKPOINTS_DIR, FINAL_DIR, RUN_CONFIG_FILE

__all__ = [
    "CHECKPOINTS_DIR",
    "DESCRIPTION_FILE",
    "FINAL_DIR",
    "POLICY_STATE_KEY",
    "RUNS_ROOT",
    "WEIGHTS_FILE",
    "LoadedPolicy",
    "load_policy",
    "one_line",
    "policy_description",
    "resolve_policy_dir",
    "save_policy",
]

WEIGHTS_FILE = "policy.pt"
DESCRIPTION_FILE = "policy.json"
RUNS_ROOT = Path("runs")
POLICY_STATE_KEY = "policy_description"  # the game learner's checkpoint client state key
# The rank-0 model-states file of a DeepSpeed checkpoint tag (ZeRO 0-2; ZeRO-3 names).
MODEL_STATES_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def save_policy(
    directory: str | os.PathLike[str],
    weights: Mapping[str, Any],
    *,
    env_id: str,
    env_kwargs: Mapping[str, Any] | None,
    observation_space: Any,
    action_space: Any,
    policy: Any,
    **provenance: Any,
) -> Path:
    """Write ``policy.pt`` and ``policy.json`` into ``directory`` (created); returns it.

    ``weights`` is the state_dict by name; ``policy`` a `PolicyConfig` (or its fields as a
    mapping); ``provenance`` (algo, version, global_step, updates, ...) goes into the JSON as is.
    Each file is written to a temporary name and renamed, the JSON last."""
    import torch

    final = Path(directory)
    final.mkdir(parents=True, exist_ok=True)
    description = policy_description(
        env_id=env_id,
        env_kwargs=env_kwargs,
        observation_space=observation_space,
        action_space=action_space,
        policy=policy,
        **provenance,
    )
    tmp = final / (WEIGHTS_FILE + ".tmp")
    torch.save(dict(weights), tmp)
    os.replace(tmp, final / WEIGHTS_FILE)
    tmp = final / (DESCRIPTION_FILE + ".tmp")
    tmp.write_text(json.dumps(description, indent=2) + "\n")
    os.replace(tmp, final / DESCRIPTION_FILE)
    return final


def policy_description(
    *,
    env_id: str,
    env_kwargs: Mapping[str, Any] | None,
    observation_space: Any,
    action_space: Any,
    policy: Any,
    **provenance: Any,
) -> dict[str, Any]:
    """What ``policy.json`` holds (and a game checkpoint's client state under
    ``POLICY_STATE_KEY``): JSON-ready, enough to rebuild the policy without the run config."""
    from google.protobuf import json_format

    from common import spaces as space_codec

    if hasattr(policy, "model_dump"):
        policy = policy.model_dump(mode="json")
    return {
        "env_id": env_id,
        "env_kwargs": dict(env_kwargs or {}),
        "observation_space": json_format.MessageToDict(space_codec.to_proto(observation_space)),
        "action_space": json_format.MessageToDict(space_codec.to_proto(action_space)),
        "policy": dict(policy),
        **provenance,
    }


def resolve_policy_dir(run_or_path: str | os.PathLike[str], runs_root: Path = RUNS_ROOT) -> Path:
    """The folder a policy is read from, for a run directory, a run name (looked up under
    ``runs_root``), a run config file (its run directory), a ``final/`` folder, one of its two
    files, a run's ``checkpoints/`` folder or one checkpoint tag folder in it.

    A run's ``final/`` when it is complete, else its latest checkpoint's tag folder (see
    `load_policy`). ConfigError, saying what was found instead, otherwise."""
    text = os.fspath(run_or_path)
    path = Path(text)
    if path.is_file():
        if path.name in (WEIGHTS_FILE, DESCRIPTION_FILE):
            return _check_complete(path.parent)
        if path.name in MODEL_STATES_FILES:
            return path.parent
        if path.suffix in (".yaml", ".yml"):
            from services.config import load_run_config

            return resolve_policy_dir(load_run_config(path).run_dir, runs_root)
        raise ConfigError(
            f"{text}: not a run directory, a final/ folder, a {DESCRIPTION_FILE}, a checkpoint "
            "or a run config"
        )
    if path.is_dir():
        if (path / DESCRIPTION_FILE).exists() or (path / WEIGHTS_FILE).exists():
            return _check_complete(path)
        if _is_checkpoint_tag(path):
            return path
        if (path / "latest").is_file() or path.name == CHECKPOINTS_DIR:
            return _latest_checkpoint(path, text)
        final = path / FINAL_DIR
        checkpoints = path / CHECKPOINTS_DIR
        if (final / DESCRIPTION_FILE).is_file():
            if checkpoints.is_dir() and _stale_stop(final, checkpoints):
                return _latest_checkpoint(checkpoints, text)
            return _check_complete(final)
        if checkpoints.is_dir():
            return _latest_checkpoint(checkpoints, text)
        if final.is_dir():
            return _check_complete(final)
        if any((path / marker).exists() for marker in (RUN_CONFIG_FILE, "logs")):
            raise ConfigError(
                f"{text}: run has no final policy ({FINAL_DIR}/{DESCRIPTION_FILE}) and no "
                f"checkpoint ({CHECKPOINTS_DIR}/): the learner writes them once it has trained"
            )
        raise ConfigError(
            f"{text}: not a run directory (no {FINAL_DIR}/ nor {CHECKPOINTS_DIR}/) nor a policy "
            f"folder (no {DESCRIPTION_FILE})"
        )
    named = runs_root / text
    if os.sep not in text and named.exists():
        return resolve_policy_dir(named, runs_root)
    runs = sorted(p.name for p in runs_root.iterdir() if p.is_dir()) if runs_root.is_dir() else []
    close = difflib.get_close_matches(text, runs, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    where = "" if os.sep in text else f" (nor at {named})"
    raise ConfigError(f"no run or policy at '{text}'{where}{hint}")


def _check_complete(final: Path) -> Path:
    missing = [name for name in (DESCRIPTION_FILE, WEIGHTS_FILE) if not (final / name).is_file()]
    if missing:
        raise ConfigError(f"{final}: missing {' and '.join(missing)}")
    return final


def _is_checkpoint_tag(path: Path) -> bool:
    return any((path / name).is_file() for name in MODEL_STATES_FILES)


def _stale_stop(final: Path, checkpoints: Path) -> bool:
    """``final/`` is a stopped run's and a later incarnation checkpointed past it (then was
    killed): the checkpoint is the newer policy. Judged by the learner's tag names."""
    try:
        description = json.loads((final / DESCRIPTION_FILE).read_text())
        if description.get("complete", True):
            return False
        latest = (checkpoints / "latest").read_text().strip()
        return int(latest.removeprefix("update-")) > int(description.get("updates", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _latest_checkpoint(checkpoints: Path, text: str) -> Path:
    """The tag ``checkpoints/latest`` names, else the newest tag folder."""
    latest = checkpoints / "latest"
    if latest.is_file():
        tag = checkpoints / latest.read_text().strip()
        if _is_checkpoint_tag(tag):
            return tag
    tags = sorted(p for p in checkpoints.glob("*") if p.is_dir() and _is_checkpoint_tag(p))
    if not tags:
        raise ConfigError(
            f"{text}: run has no final policy ({FINAL_DIR}/{DESCRIPTION_FILE}) and {checkpoints} "
            "holds no checkpoint"
        )
    return max(tags, key=lambda p: (p.stat().st_mtime, p.name))


@dataclass
class LoadedPolicy:
    """A saved policy, rebuilt: ``net`` is a `common.policies.ActorCritic` in eval mode.

    ``directory`` is the ``final/`` folder or the checkpoint tag folder it was read from;
    ``description`` the policy.json fields (for a checkpoint: the same fields, with
    ``"source": "checkpoint"`` and ``"complete": false``)."""

    directory: Path
    description: dict[str, Any]
    env_id: str
    env_kwargs: dict[str, Any]
    observation_space: Any
    action_space: Any
    net: Any

    @property
    def complete(self) -> bool:
        """False for the policy of a run stopped before its end (or read from a checkpoint)."""
        return bool(self.description.get("complete", True))

    def predict(self, obs: Any, *, deterministic: bool = False, generator: Any = None) -> Any:
        """The env action for one observation, or an array of actions for a batch of them
        (leading batch axis), like Stable-Baselines3's ``model.predict`` (which also returns a
        recurrent state; this returns the action alone). Sampled from the policy's distribution
        (with ``generator``, a torch.Generator, when given), or greedy with ``deterministic``
        (argmax of each categorical, the Gaussian mean)."""
        import numpy as np

        x = np.asarray(obs)
        shape = tuple(self.observation_space.shape or ())
        if x.shape == shape:
            return self._actions(x[None], deterministic, generator)[0]
        if x.ndim == len(shape) + 1 and x.shape[1:] == shape:
            return self._actions(x, deterministic, generator)
        raise InvalidArgument(
            f"observation of shape {x.shape}: the policy takes {shape} or a batch (N, "
            f"{', '.join(map(str, shape))})"
        )

    def act(self, obs: Any, *, deterministic: bool = False, generator: Any = None) -> Any:
        """One observation in, the env action out (see `predict`, which also takes a batch)."""
        import numpy as np

        return self._actions(np.asarray(obs)[None], deterministic, generator)[0]

    def _actions(self, batch: Any, deterministic: bool, generator: Any) -> Any:
        import torch

        x = torch.as_tensor(batch)
        with torch.no_grad():
            action = _action(self.net, x, deterministic, generator)
        return self.net.to_env_action(action)


def _action(net: Any, x: Any, deterministic: bool, generator: Any) -> Any:
    """``ActorCritic.evaluate``'s action without its log-prob, entropy and value (work a
    policy being played does not need): the actor head read as the same distributions,
    Categorical logits per action dimension or Normal(mean, exp(log_std))."""
    import torch

    out = net.actor(net.trunk(x if x.dtype == torch.uint8 else x.float()))
    if not net.action_dims:
        if not deterministic:
            noise = torch.randn(out.shape, generator=generator, dtype=out.dtype)
            out = out + net.log_std.expand_as(out).exp() * noise
        return out.reshape(-1, *net.continuous_shape)
    picks = []
    for logits in torch.split(out, net.action_dims, dim=-1):
        if deterministic:
            picks.append(logits.argmax(-1))
        else:
            probs = torch.softmax(logits, dim=-1)
            picks.append(torch.multinomial(probs, 1, generator=generator).squeeze(-1))
    action = torch.stack(picks, dim=-1) + net.action_offset  # [B, K]
    return action.reshape(-1) if len(net.action_dims) == 1 else action


def load_policy(run_or_path: str | os.PathLike[str], runs_root: Path = RUNS_ROOT) -> LoadedPolicy:
    """Resolve (see `resolve_policy_dir`), read the policy and build the module: from
    ``final/`` (policy.json + policy.pt), else from the latest checkpoint.

    ``policy = load_policy("runs/cartpole-ppo"); action = policy.predict(obs)``. Every problem
    with the files is a ConfigError naming the file and what is wrong."""
    import torch

    folder = resolve_policy_dir(run_or_path, runs_root)
    if not (folder / DESCRIPTION_FILE).is_file():
        return _from_checkpoint(folder)
    json_path, weights_path = folder / DESCRIPTION_FILE, folder / WEIGHTS_FILE
    try:
        description = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{json_path}: cannot read: {exc}") from exc
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{weights_path}: cannot load: {one_line(exc)}") from exc
    return _build(folder, description, weights, str(json_path), str(weights_path))


def _build(
    folder: Path, description: Any, weights: Any, described_in: str, weights_in: str
) -> LoadedPolicy:
    from google.protobuf import json_format
    from pydantic import ValidationError

    from common import spaces as space_codec
    from common.policies import build_policy
    from common.policy_config import PolicyConfig
    from rlfleet.common.v1 import space_pb2

    if not isinstance(description, dict):
        raise ConfigError(f"{described_in}: expected a JSON object")
    missing = [k for k in ("env_id", "observation_space", "action_space") if k not in description]
    if missing:
        raise ConfigError(f"{described_in}: missing key(s) {', '.join(missing)}")
    try:
        spaces = [
            space_codec.from_proto(
                json_format.ParseDict(description[key], space_pb2.Space()), name=key
            )
            for key in ("observation_space", "action_space")
        ]
        config = PolicyConfig(**description.get("policy", {}))
    except (json_format.ParseError, InvalidArgument, ValidationError, TypeError) as exc:
        raise ConfigError(f"{described_in}: {one_line(exc)}") from exc
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{weights_in}: expected a state_dict, got {type(weights).__name__}")
    try:
        net = build_policy(spaces[0], spaces[1], config)
        net.load_state_dict(weights)
    except (InvalidArgument, RuntimeError) as exc:
        raise ConfigError(
            f"{weights_in} does not fit the policy described in {described_in}: {one_line(exc)}"
        ) from exc
    return LoadedPolicy(
        directory=folder,
        description=description,
        env_id=str(description["env_id"]),
        env_kwargs=dict(description.get("env_kwargs") or {}),
        observation_space=spaces[0],
        action_space=spaces[1],
        net=net.eval(),
    )


def _from_checkpoint(tag_dir: Path) -> LoadedPolicy:
    """A policy from a DeepSpeed checkpoint tag folder (see the module docstring)."""
    import torch

    states = next(tag_dir / n for n in MODEL_STATES_FILES if (tag_dir / n).is_file())
    try:
        saved = torch.load(states, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{states}: cannot load: {one_line(exc)}") from exc
    if not isinstance(saved, Mapping):
        raise ConfigError(f"{states}: not a DeepSpeed model-states file")
    stored = saved.get(POLICY_STATE_KEY)
    if isinstance(stored, Mapping):
        description, described_in = dict(stored), f"{states} ({POLICY_STATE_KEY})"
    else:
        config = tag_dir.parent.parent / RUN_CONFIG_FILE
        if tag_dir.parent.name != CHECKPOINTS_DIR or not config.is_file():
            raise ConfigError(
                f"{tag_dir}: the checkpoint does not describe its policy (no {POLICY_STATE_KEY} "
                f"in its client state: a language-model run, or written by an older learner) "
                f"and there is no run config ({RUN_CONFIG_FILE} in the run directory, "
                f"{config}) to rebuild it from"
            )
        description, described_in = _description_from_config(config), str(config)
    description.update(
        source="checkpoint",
        checkpoint=str(tag_dir),
        global_step=int(saved.get("samples", 0)),
        updates=int(saved.get("updates", 0)),
        version=int(saved.get("version", 0)),
        complete=False,
    )
    return _build(
        tag_dir, description, _checkpoint_weights(tag_dir, saved), described_in, str(states)
    )


def _checkpoint_weights(tag_dir: Path, saved: Mapping[str, Any]) -> Any:
    """The module state_dict: ``module`` for ZeRO 0-2; gathered from the shards for ZeRO-3
    (whose ``module`` holds empty placeholders)."""
    module = saved.get("module")
    stage = ((saved.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
    if module and stage != 3:
        return module
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise ConfigError(
            f"{tag_dir}: a ZeRO-3 checkpoint needs deepspeed to gather its shards; it is not "
            "installed"
        ) from exc
    try:
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    except Exception as exc:
        raise ConfigError(f"{tag_dir}: cannot gather the ZeRO shards: {one_line(exc)}") from exc


def _description_from_config(config: Path) -> dict[str, Any]:
    """The policy description from the run's learner settings; the spaces from a local
    ``gymnasium.make(env_id, **env_kwargs)``."""
    from services.config import load_service_settings

    try:
        settings: Any = load_service_settings("learner", config, None, environ={})
    except ConfigError as exc:
        raise ConfigError(
            f"{config}: no game learner settings to rebuild the policy: {exc}"
        ) from exc
    try:
        import gymnasium

        env = gymnasium.make(settings.env_id, **settings.env_kwargs)
    except Exception as exc:
        raise ConfigError(
            f"{config}: cannot make {settings.env_id} here for the policy's spaces: {one_line(exc)}"
        ) from exc
    try:
        return policy_description(
            env_id=settings.env_id,
            env_kwargs=settings.env_kwargs,
            observation_space=env.observation_space,
            action_space=env.action_space,
            policy=settings.policy,
            algo=settings.algo,
        )
    finally:
        env.close()


def one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines[:4]) or type(exc).__name__
