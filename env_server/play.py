"""A trained game policy on disk, and `rlfleet play`: run it locally, report, record.

The learner finishes a run by writing ``<run dir>/final/`` with `save_policy`:

- ``policy.pt``: the network's ``state_dict`` by name (float32 CPU tensors, ``torch.save``);
- ``policy.json``: what rebuilds it without the run config: ``env_id``, ``env_kwargs``, both
  spaces (``rlfleet.common.v1.Space`` as protobuf JSON), ``policy`` (`PolicyConfig` fields) and
  provenance (``algo``, ``version``, ``global_step``, ``updates``). Written last: its presence
  means the pair is complete.

`load_policy` reads that back into a module built by `common.policies.build_policy` (the same
constructor actors and learner use), and `play` runs evaluation episodes on an environment made
locally by the env server's registry (``env_server.registry.make_env``, so gymnasium ids, plugin
packages such as flappy_bird_gymnasium and ``rlfleet.envs`` entry points all work), optionally
recording frames (``render_mode="rgb_array"`` only then) to a PNG folder, a GIF (Pillow) or an
MP4 (imageio with ffmpeg, when installed).

Why in ``services`` and not ``learner``: nothing here is learner-specific (policies and spaces
are shared runtime code), the learner imports `save_policy` from here, and a service package may
not import another (``env_server`` is reached by name at call time, as ``rlfleet envs`` does).
Module import is cheap (stdlib only): `rlfleet` builds every subcommand's parser at start.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import math
import os
import struct
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound

__all__ = [
    "DESCRIPTION_FILE",
    "WEIGHTS_FILE",
    "Episode",
    "LoadedPolicy",
    "PlayResult",
    "add_arguments",
    "load_policy",
    "main",
    "play",
    "resolve_policy_dir",
    "save_policy",
    "write_png",
]

FINAL_DIR = "final"
WEIGHTS_FILE = "policy.pt"
DESCRIPTION_FILE = "policy.json"
RUNS_ROOT = Path("runs")
DEFAULT_MAX_STEPS = 10_000  # per episode, on top of the env's own time limit (FlappyBird has none)
DEFAULT_INFO_KEYS = ("score",)  # final-info values reported per episode when the env gives them
GIF_MAX_FRAMES = 3_000  # a GIF is assembled in memory (~150 kB a 288x512 frame)
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov")


# ---------------------------------------------------------------------------------- the layout


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
        raise ConfigError(f"{json_path}: {_one_line(exc)}") from exc
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{weights_path}: cannot load: {_one_line(exc)}") from exc
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{weights_path}: expected a state_dict, got {type(weights).__name__}")
    try:
        net = build_policy(spaces[0], spaces[1], config)
        net.load_state_dict(weights)
    except (InvalidArgument, RuntimeError) as exc:
        raise ConfigError(
            f"{weights_path} does not fit the policy described in {json_path}: {_one_line(exc)}"
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


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines[:4]) or type(exc).__name__


# --------------------------------------------------------------------------------- recording


def write_png(path: str | os.PathLike[str], frame: Any) -> None:
    """A uint8 frame ([H, W], [H, W, 3] or [H, W, 4]) as a PNG, with zlib only."""
    import numpy as np

    image = np.ascontiguousarray(frame, dtype=np.uint8)
    if image.ndim == 2:
        image = image[:, :, None]
    height, width, channels = image.shape
    color_type = {1: 0, 3: 2, 4: 6}.get(channels)
    if color_type is None:
        raise InvalidArgument(f"frame: expected 1, 3 or 4 channels, got shape {frame.shape}")
    rows = np.zeros((height, 1 + width * channels), np.uint8)  # filter byte 0 (None) per row
    rows[:, 1:] = image.reshape(height, -1)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    Path(path).write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + chunk(b"IEND", b"")
    )


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


class _FrameDir:
    """PNG files ``ep<episode>_<step>.png`` (Pillow when installed, else `write_png`)."""

    def __init__(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--frames {directory}: {exc}") from exc
        self.directory, self.count, self.image = directory, 0, _pillow()

    def add(self, frame: Any, episode: int, step: int) -> None:
        path = self.directory / f"ep{episode:03d}_{step:06d}.png"
        if self.image is not None:
            self.image.fromarray(frame).save(path, compress_level=1)
        else:
            write_png(path, frame)
        self.count += 1

    def close(self) -> str:
        return f"{self.count} frames in {self.directory}/"


class _Gif:
    """An animated GIF through Pillow; frames are palettised as they come and kept in memory,
    so recording stops at GIF_MAX_FRAMES."""

    def __init__(self, path: Path, fps: float) -> None:
        self.image = _pillow()
        if self.image is None:
            raise ConfigError(f"--video {path}: writing a GIF needs Pillow; use --frames DIR")
        self.path, self.fps, self.frames, self.dropped = path, fps, [], 0
        _writable(path)

    def add(self, frame: Any, episode: int, step: int) -> None:
        if len(self.frames) >= GIF_MAX_FRAMES:
            self.dropped += 1
            return
        self.frames.append(self.image.fromarray(frame).convert("P", palette=1, colors=256))

    def close(self) -> str:
        if not self.frames:
            return f"no frames for {self.path}"
        first, *rest = self.frames
        duration = max(20, round(1000 / self.fps))
        first.save(self.path, save_all=True, append_images=rest, duration=duration, loop=0)
        note = f" (stopped at {GIF_MAX_FRAMES}; use --frames DIR)" if self.dropped else ""
        return f"{len(self.frames)} frames in {self.path}{note}"


class _Imageio:
    """MP4 and other ffmpeg formats through imageio (streamed, nothing held in memory)."""

    def __init__(self, path: Path, fps: float) -> None:
        try:
            import imageio.v2 as imageio
        except ImportError as exc:
            raise ConfigError(
                f"--video {path}: writing {path.suffix} needs imageio with ffmpeg "
                "(pip install 'imageio[ffmpeg]'), which is not installed; use a .gif path or "
                "--frames DIR"
            ) from exc
        _writable(path)
        try:
            self.writer = imageio.get_writer(path, fps=fps, macro_block_size=1)
        except Exception as exc:
            raise ConfigError(f"--video {path}: {_one_line(exc)}") from exc
        self.path, self.count = path, 0

    def add(self, frame: Any, episode: int, step: int) -> None:
        self.writer.append_data(frame)
        self.count += 1

    def close(self) -> str:
        self.writer.close()
        return f"{self.count} frames in {self.path}"


def _writable(path: Path) -> None:
    if not path.parent.is_dir():
        raise ConfigError(f"--video {path}: folder {path.parent} does not exist")


def _open_recorder(video: Path | None, frames: Path | None, fps: float) -> Any:
    if frames is not None:
        return _FrameDir(frames)
    if video is None:
        return None
    suffix = video.suffix.lower()
    if suffix == ".gif":
        return _Gif(video, fps)
    if suffix in VIDEO_SUFFIXES:
        return _Imageio(video, fps)
    raise ConfigError(
        f"--video {video}: unknown format '{suffix}'; use .gif, {', '.join(VIDEO_SUFFIXES)}"
    )


# ------------------------------------------------------------------------------------ playing


@dataclass
class Episode:
    index: int
    seed: int
    ret: float
    length: int
    capped: bool  # stopped at max_steps (neither terminated nor truncated by the env)
    info: dict[str, float] = field(default_factory=dict)  # final-info values of the report keys


@dataclass
class PlayResult:
    env_id: str
    policy_dir: Path
    deterministic: bool
    episodes: list[Episode]
    wall_s: float
    recording: str | None = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "env_id": self.env_id,
            "policy_dir": str(self.policy_dir),
            "deterministic": self.deterministic,
            "episodes": len(self.episodes),
            "wall_s": round(self.wall_s, 3),
        }
        columns = {"return": [e.ret for e in self.episodes]}
        columns["length"] = [float(e.length) for e in self.episodes]
        for key in dict.fromkeys(k for e in self.episodes for k in e.info):
            columns[key] = [e.info[key] for e in self.episodes if key in e.info]
        for name, values in columns.items():
            mean, std = _mean_std(values)
            out[f"mean_{name}"], out[f"std_{name}"] = mean, std
            out[f"min_{name}"], out[f"max_{name}"] = min(values), max(values)
        return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _make_env(env_id: str, env_kwargs: dict[str, Any], render: bool) -> Any:
    registry = importlib.import_module("env_server.registry")
    try:
        return registry.make_env(
            env_id, kwargs=env_kwargs, render_mode="rgb_array" if render else None
        )
    except (NotFound, FailedPrecondition, InvalidArgument) as exc:
        raise ConfigError(f"cannot create the policy's env: {exc}") from exc


def _check_spaces(policy: LoadedPolicy, env: Any) -> None:
    for name, saved, actual in (
        ("observation", policy.observation_space, env.observation_space),
        ("action", policy.action_space, env.action_space),
    ):
        if type(saved) is not type(actual) or saved.shape != actual.shape:
            raise ConfigError(
                f"{policy.env_id}{policy.env_kwargs or ''}: the env's {name} space {actual} "
                f"differs from the policy's {saved} ({policy.directory / DESCRIPTION_FILE})"
            )


def play(
    run_or_path: str | os.PathLike[str],
    *,
    episodes: int = 10,
    seed: int = 0,
    deterministic: bool = False,
    max_steps: int = DEFAULT_MAX_STEPS,
    video: str | os.PathLike[str] | None = None,
    frames: str | os.PathLike[str] | None = None,
    record_episodes: int = 1,
    info_keys: Sequence[str] = DEFAULT_INFO_KEYS,
    runs_root: Path = RUNS_ROOT,
    on_episode: Any = None,
) -> PlayResult:
    """Run ``episodes`` episodes of a saved policy (episode i reset with seed + i; sampling
    seeded with ``seed`` without touching torch's global generator) and record the first
    ``record_episodes`` of them when ``video`` or ``frames`` is given."""
    import numpy as np
    import torch

    if episodes < 1 or max_steps < 1:
        raise ConfigError("episodes and max_steps must be >= 1")
    if video is not None and frames is not None:
        raise ConfigError("give --video or --frames, not both")
    policy = load_policy(run_or_path, runs_root)
    recording = video is not None or frames is not None
    env = _make_env(policy.env_id, policy.env_kwargs, render=recording)
    recorder = None
    try:
        _check_spaces(policy, env)
        fps = float((getattr(env, "metadata", None) or {}).get("render_fps") or 30)
        recorder = _open_recorder(
            Path(video) if video is not None else None,
            Path(frames) if frames is not None else None,
            fps,
        )
        results: list[Episode] = []
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        for index in range(episodes):
            record = recorder is not None and index < record_episodes
            obs, info = env.reset(seed=seed + index)
            total, steps, done = 0.0, 0, False
            while not done and steps < max_steps:
                if record:
                    recorder.add(np.asarray(env.render()), index, steps)
                action = policy.act(obs, deterministic=deterministic, generator=generator)
                obs, reward, terminated, truncated, info = env.step(action)
                total += float(reward)
                steps += 1
                done = bool(terminated or truncated)
            if record:
                recorder.add(np.asarray(env.render()), index, steps)
            values = {
                k: float(info[k])
                for k in info_keys
                if isinstance(info.get(k), int | float | np.number)
            }
            episode = Episode(index, seed + index, total, steps, not done, values)
            results.append(episode)
            if on_episode is not None:
                on_episode(episode)
        wall_s = time.perf_counter() - start
        written = recorder.close() if recorder is not None else None
        recorder = None
    finally:
        if recorder is not None:
            with contextlib.suppress(Exception):
                recorder.close()
        with contextlib.suppress(Exception):
            env.close()
    return PlayResult(policy.env_id, policy.directory, deterministic, results, wall_s, written)


# ---------------------------------------------------------------------------------- rlfleet play


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN_OR_PATH",
        help="run directory, run name (under ./runs/), run config, or a final/ folder",
    )  # fmt: skip
    parser.add_argument("--episodes", type=int, default=10, help="episodes to run (default 10)")
    parser.add_argument(
        "--seed", type=int, default=0, help="episode i resets with seed+i; seeds sampling too"
    )
    parser.add_argument(
        "--deterministic", action="store_true",
        help="greedy actions (argmax / Gaussian mean) instead of sampling",
    )  # fmt: skip
    out = parser.add_mutually_exclusive_group()
    out.add_argument(
        "--video", type=Path, metavar="PATH",
        help="record to PATH: .gif (Pillow) or .mp4 (needs imageio[ffmpeg])",
    )  # fmt: skip
    out.add_argument("--frames", type=Path, metavar="DIR", help="record PNG frames into DIR")
    parser.add_argument(
        "--record-episodes", type=int, default=1, metavar="N",
        help="how many of the episodes to record (default 1, the first)",
    )  # fmt: skip
    parser.add_argument(
        "--max-steps", type=int, default=DEFAULT_MAX_STEPS,
        help=f"stop an episode after this many steps (default {DEFAULT_MAX_STEPS})",
    )  # fmt: skip
    parser.add_argument(
        "--info", action="append", metavar="KEY",
        help="report this final-info value per episode (repeatable; default: score)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the summary here")


def main(args: argparse.Namespace) -> int:
    """The `rlfleet play` handler. ConfigError (exit 2) for anything wrong with the inputs."""

    def report(e: Episode) -> None:
        extra = "".join(f"  {k} {v:g}" for k, v in e.info.items())
        capped = f"  (stopped at --max-steps {args.max_steps})" if e.capped else ""
        print(f"episode {e.index + 1:3d}: return {e.ret:9.2f}  length {e.length:6d}{extra}{capped}")

    result = play(
        args.run,
        episodes=args.episodes,
        seed=args.seed,
        deterministic=args.deterministic,
        max_steps=args.max_steps,
        video=args.video,
        frames=args.frames,
        record_episodes=args.record_episodes,
        info_keys=tuple(args.info or DEFAULT_INFO_KEYS),
        on_episode=report,
    )
    summary = result.summary()
    mode = "greedy" if args.deterministic else "sampled"
    names = ["return", "length", *dict.fromkeys(k for e in result.episodes for k in e.info)]
    means = "  ".join(f"{n} {summary[f'mean_{n}']:.2f} ± {summary[f'std_{n}']:.2f}" for n in names)
    print(
        f"mean over {len(result.episodes)} episodes of {result.env_id} ({mode} actions, "
        f"{result.wall_s:.1f} s): {means}"
    )
    if result.recording:
        print(f"recorded {result.recording}")
    if args.json is not None:
        summary["episodes_detail"] = [vars(e) for e in result.episodes]
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    sys.stdout.flush()
    return 0
