"""A trained game policy on disk: the artifact the learner writes and everything that reads it.

The learner finishes a run by writing ``<run dir>/final/`` with `save_policy`:

- ``policy.pt``: the network's ``state_dict`` by name (float32 CPU tensors, ``torch.save``);
- ``policy.json``: what rebuilds it without the run config: ``env_id``, ``env_kwargs``, both
  spaces (``rlfleet.common.v1.Space`` as protobuf JSON), ``policy`` (`PolicyConfig` fields) and
  provenance (``algo``, ``version``, ``global_step``, ``updates``). Written last: its presence
  means the pair is complete.

`load_policy` reads that back into a module built by `common.policies.build_policy` (the same
constructor actors and learner use); ``LoadedPolicy.act(obs)`` is the one-line way to use a
trained policy from Python. `rlfleet play` (env_server/play.py) runs it in local envs.
Module import is cheap (stdlib only); torch loads when a policy is saved or loaded.
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

__all__ = [
    "DESCRIPTION_FILE",
    "FINAL_DIR",
    "RUNS_ROOT",
    "WEIGHTS_FILE",
    "LoadedPolicy",
    "load_policy",
    "one_line",
    "resolve_policy_dir",
    "save_policy",
]

FINAL_DIR = "final"
WEIGHTS_FILE = "policy.pt"
DESCRIPTION_FILE = "policy.json"
RUNS_ROOT = Path("runs")


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
    from google.protobuf import json_format

    from common import spaces as space_codec

    final = Path(directory)
    final.mkdir(parents=True, exist_ok=True)
    if hasattr(policy, "model_dump"):
        policy = policy.model_dump(mode="json")
    description = {
        "env_id": env_id,
        "env_kwargs": dict(env_kwargs or {}),
        "observation_space": json_format.MessageToDict(space_codec.to_proto(observation_space)),
        "action_space": json_format.MessageToDict(space_codec.to_proto(action_space)),
        "policy": dict(policy),
        **provenance,
    }
    tmp = final / (WEIGHTS_FILE + ".tmp")
    torch.save(dict(weights), tmp)
    os.replace(tmp, final / WEIGHTS_FILE)
    tmp = final / (DESCRIPTION_FILE + ".tmp")
    tmp.write_text(json.dumps(description, indent=2) + "\n")
    os.replace(tmp, final / DESCRIPTION_FILE)
    return final


def resolve_policy_dir(run_or_path: str | os.PathLike[str], runs_root: Path = RUNS_ROOT) -> Path:
    """The folder holding policy.json + policy.pt for a run directory, a run name (looked up
    under ``runs_root``), a run config file (its run directory), a ``final/`` folder or one of
    the two files. ConfigError, saying what was found instead, otherwise."""
    text = os.fspath(run_or_path)
    path = Path(text)
    if path.is_file():
        if path.name in (WEIGHTS_FILE, DESCRIPTION_FILE):
            return _check_complete(path.parent)
        if path.suffix in (".yaml", ".yml"):
            from services.config import load_run_config

            return resolve_policy_dir(load_run_config(path).run_dir, runs_root)
        raise ConfigError(
            f"{text}: not a run directory, a final/ folder, a {DESCRIPTION_FILE} or a run config"
        )
    if path.is_dir():
        if (path / DESCRIPTION_FILE).exists() or (path / WEIGHTS_FILE).exists():
            return _check_complete(path)
        if (path / FINAL_DIR).is_dir():
            return _check_complete(path / FINAL_DIR)
        if any((path / marker).exists() for marker in ("config.yaml", "checkpoints", "logs")):
            raise ConfigError(
                f"{text}: run has no final policy ({FINAL_DIR}/{DESCRIPTION_FILE}); the learner "
                "writes it when the run finishes"
            )
        raise ConfigError(
            f"{text}: not a run directory (no {FINAL_DIR}/) nor a policy folder "
            f"(no {DESCRIPTION_FILE})"
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


@dataclass
class LoadedPolicy:
    """A saved policy, rebuilt: ``net`` is a `common.policies.ActorCritic` in eval mode."""

    directory: Path
    description: dict[str, Any]
    env_id: str
    env_kwargs: dict[str, Any]
    observation_space: Any
    action_space: Any
    net: Any

    def act(self, obs: Any, *, deterministic: bool = False, generator: Any = None) -> Any:
        """One observation in, the env action out: sampled from the policy's distribution
        (with ``generator``, a torch.Generator, when given), or greedy with ``deterministic``
        (argmax of each categorical, the Gaussian mean)."""
        import numpy as np
        import torch

        x = torch.as_tensor(np.asarray(obs)[None])
        with torch.no_grad():
            action = _action(self.net, x, deterministic, generator)
        return self.net.to_env_action(action)[0]


def _action(net: Any, x: Any, deterministic: bool, generator: Any) -> Any:
    """``ActorCritic.evaluate``'s action without its log-prob, entropy and value (three times
    faster at batch 1): the actor head read as the same distributions, Categorical logits per
    action dimension or Normal(mean, exp(log_std))."""
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
    """Resolve (see `resolve_policy_dir`), read both files and build the module.

    Every problem with the files is a ConfigError naming the file and what is wrong."""
    import torch
    from google.protobuf import json_format
    from pydantic import ValidationError

    from common import spaces as space_codec
    from common.policies import build_policy
    from common.policy_config import PolicyConfig
    from rlfleet.common.v1 import space_pb2

    final = resolve_policy_dir(run_or_path, runs_root)
    json_path, weights_path = final / DESCRIPTION_FILE, final / WEIGHTS_FILE
    try:
        description = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{json_path}: cannot read: {exc}") from exc
    if not isinstance(description, dict):
        raise ConfigError(f"{json_path}: expected a JSON object")
    missing = [k for k in ("env_id", "observation_space", "action_space") if k not in description]
    if missing:
        raise ConfigError(f"{json_path}: missing key(s) {', '.join(missing)}")
    try:
        spaces = [
            space_codec.from_proto(
                json_format.ParseDict(description[key], space_pb2.Space()), name=key
            )
            for key in ("observation_space", "action_space")
        ]
        config = PolicyConfig(**description.get("policy", {}))
    except (json_format.ParseError, InvalidArgument, ValidationError, TypeError) as exc:
        raise ConfigError(f"{json_path}: {one_line(exc)}") from exc
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{weights_path}: cannot load: {one_line(exc)}") from exc
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{weights_path}: expected a state_dict, got {type(weights).__name__}")
    try:
        net = build_policy(spaces[0], spaces[1], config)
        net.load_state_dict(weights)
    except (InvalidArgument, RuntimeError) as exc:
        raise ConfigError(
            f"{weights_path} does not fit the policy described in {json_path}: {one_line(exc)}"
        ) from exc
    return LoadedPolicy(
        directory=final,
        description=description,
        env_id=str(description["env_id"]),
        env_kwargs=dict(description.get("env_kwargs") or {}),
        observation_space=spaces[0],
        action_space=spaces[1],
        net=net.eval(),
    )


def one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines[:4]) or type(exc).__name__
