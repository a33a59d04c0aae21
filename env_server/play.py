"""`rlfleet play`: run a trained game policy locally, report its returns, record it.

`play` loads a policy saved by the learner (`common.artifacts.load_policy`: a run's ``final/``, or
its latest checkpoint when it has none, or a checkpoint folder) and runs evaluation
episodes on an environment made by this package's registry (`env_server.registry.make_env`, so
gymnasium ids, plugin packages such as flappy_bird_gymnasium, ``rlfleet.envs`` entry points and
references as run files name them, ``module:Name`` or ``path/to/file.py:Name``, all work). With
``--frames DIR`` or ``--video [PATH]`` it renders (``render_mode="rgb_array"`` only then), draws
the score and return on each frame (Pillow; ``--no-overlay`` leaves frames as rendered) and
writes through imageio: MP4 by default (and the other ffmpeg formats) via imageio-ffmpeg, whose
wheel ships its own ffmpeg; PNG frames and GIFs via Pillow (the ``play`` extra installs all
three). A GIF keeps every frame whole, so it is cut at GIF_MAX_SECONDS: a long episode belongs in
an MP4.

It lives in env_server because it needs the env registry; it needs torch only when it runs.
Module import is cheap (stdlib only): `rlfleet` builds every subcommand's parser at start.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.artifacts import DESCRIPTION_FILE, RUNS_ROOT, LoadedPolicy, load_policy, one_line
from services.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound

__all__ = ["Episode", "PlayResult", "add_arguments", "main", "play"]

DEFAULT_MAX_STEPS = 10_000  # per episode, on top of the env's own time limit (FlappyBird has none)
DEFAULT_INFO_KEYS = ("score",)  # final-info values reported per episode when the env gives them
# A GIF is assembled in memory and compresses nothing across frames: a long episode makes a file
# many times its MP4's size. Longer recordings go to MP4.
GIF_MAX_SECONDS = 20.0
DEFAULT_VIDEO = Path("play.mp4")  # `--video` without a PATH
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov")
# Encoders where imageio's default (H.264) does not fit the container: WebM holds VP8/VP9/AV1
# only (VP9 plays in every browser, H.264 not in all builds).
VIDEO_CODECS = {".webm": "libvpx-vp9"}


# --------------------------------------------------------------------------------- recording


def _imageio(what: str) -> Any:
    try:
        import imageio.v3 as iio
    except ImportError as exc:
        raise ConfigError(
            f"{what}: recording needs imageio (pip install 'rlfleet[play]'); it is not installed"
        ) from exc
    return iio


class _FrameDir:
    """PNG files ``ep<episode>_<step>.png``."""

    def __init__(self, directory: Path) -> None:
        self.iio = _imageio(f"--frames {directory}")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--frames {directory}: {exc}") from exc
        self.directory, self.count = directory, 0

    def add(self, frame: Any, episode: int, step: int) -> None:
        path = self.directory / f"ep{episode:03d}_{step:06d}.png"
        self.iio.imwrite(path, frame, extension=".png", compress_level=1)
        self.count += 1

    def close(self) -> str:
        return f"{self.count} frames in {self.directory}/"


class _Gif:
    """An animated GIF; frames are kept in memory until the end, so recording stops after
    GIF_MAX_SECONDS of play."""

    def __init__(self, path: Path, fps: float) -> None:
        self.iio = _imageio(f"--video {path}")
        _writable(path)
        self.path, self.fps, self.dropped = path, fps, 0
        self.max_frames = max(1, round(GIF_MAX_SECONDS * fps))
        self.frames: list[Any] = []

    def add(self, frame: Any, episode: int, step: int) -> None:
        if len(self.frames) >= self.max_frames:
            self.dropped += 1
            return
        self.frames.append(frame)

    def close(self) -> str:
        if not self.frames:
            return f"no frames for {self.path}"
        import numpy as np

        duration = max(20, round(1000 / self.fps))  # ms per frame
        self.iio.imwrite(
            self.path, np.stack(self.frames), extension=".gif", duration=duration, loop=0
        )
        written = f"{len(self.frames)} frames in {self.path}"
        if not self.dropped:
            return written
        return (
            f"{written}: the GIF stops after {GIF_MAX_SECONDS:g} s ({self.max_frames} frames at "
            f"{self.fps:g} fps), {self.dropped} later frames left out; record to "
            f"{self.path.with_suffix('.mp4')} for all of them"
        )


class _Video:
    """MP4 and other ffmpeg formats, streamed to disk (nothing held in memory)."""

    def __init__(self, path: Path, fps: float) -> None:
        _imageio(f"--video {path}")
        _writable(path)
        if importlib.util.find_spec("imageio_ffmpeg") is None:  # it ships its own ffmpeg binary
            raise ConfigError(
                f"--video {path}: video formats need imageio-ffmpeg (pip install "
                "'rlfleet[play]'); or record a short .gif"
            )
        try:
            import imageio.v2 as imageio

            self.writer = imageio.get_writer(
                path, fps=fps, macro_block_size=1, codec=VIDEO_CODECS.get(path.suffix.lower())
            )
        except Exception as exc:  # a format ffmpeg cannot write
            raise ConfigError(f"--video {path}: {one_line(exc)}") from exc
        self.path, self.count = path, 0

    def add(self, frame: Any, episode: int, step: int) -> None:
        # H.264 in yuv420p (what players take) needs even sides: pad odd ones by a pixel.
        h, w = frame.shape[:2]
        if h % 2 or w % 2:
            import numpy as np

            pad = [(0, h % 2), (0, w % 2)] + [(0, 0)] * (frame.ndim - 2)
            frame = np.pad(frame, pad, mode="edge")
        self.writer.append_data(frame)
        self.count += 1

    def close(self) -> str:
        self.writer.close()
        return f"{self.count} frames in {self.path}"


def _writable(path: Path) -> None:
    if not path.parent.is_dir():
        raise ConfigError(f"--video {path}: folder {path.parent} does not exist")


class _Overlay:
    """Draws text lines (the score, the return) in the top left corner of a frame (Pillow)."""

    def __init__(self) -> None:
        from PIL import Image, ImageDraw, ImageFont

        self.image, self.draw, self.font_module = Image, ImageDraw, ImageFont
        self.fonts: dict[int, Any] = {}

    def _font(self, size: int) -> Any:
        if size not in self.fonts:
            try:
                self.fonts[size] = self.font_module.load_default(size=size)
            except (TypeError, OSError):  # an old Pillow, or one without FreeType: fixed size
                self.fonts[size] = self.font_module.load_default()
        return self.fonts[size]

    def __call__(self, frame: Any, lines: Sequence[str]) -> Any:
        import numpy as np

        if frame.ndim != 3 or frame.shape[-1] not in (3, 4) or frame.dtype != np.uint8:
            return frame
        size = max(10, min(frame.shape[:2]) // 16)
        font, margin = self._font(size), max(2, size // 3)
        image = self.image.fromarray(np.ascontiguousarray(frame))
        draw = self.draw.Draw(image)
        for i, line in enumerate(lines):
            draw.text(
                (margin, margin + i * (size + margin)), line, font=font, fill="white",
                stroke_width=max(1, size // 8), stroke_fill="black",
            )  # fmt: skip
        return np.asarray(image)


def _overlay() -> _Overlay | None:
    try:
        return _Overlay()
    except ImportError:  # Pillow is optional here: record the frames as rendered
        return None


def _numbers(info: dict[str, Any], keys: Sequence[str]) -> dict[str, float]:
    """The numeric values of ``keys`` in an env's info dict."""
    import numpy as np

    return {k: float(info[k]) for k in keys if isinstance(info.get(k), int | float | np.number)}


def _open_recorder(video: Path | None, frames: Path | None, fps: float) -> Any:
    if frames is not None:
        return _FrameDir(frames)
    if video is None:
        return None
    if not video.suffix:
        video = video.with_suffix(".mp4")  # MP4 unless the name says otherwise
    suffix = video.suffix.lower()
    if suffix == ".gif":
        return _Gif(video, fps)
    if suffix in VIDEO_SUFFIXES:
        return _Video(video, fps)
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
    policy_note: str | None = None  # the policy is not a finished run's: where it stopped

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
    # here, not at import: the registry loads protobuf
    from env_server.registry import is_reference, make_env, register

    if is_reference(env_id):  # module:Name or path/to/file.py:Name, as a run file names an env
        register(env_id)  # ConfigError saying what is wrong with the reference
    try:
        return make_env(env_id, kwargs=env_kwargs, render_mode="rgb_array" if render else None)
    except (NotFound, FailedPrecondition, InvalidArgument) as exc:
        # A policy trained through GameLink names its game's env id, which no local env has.
        hint = "; to play it in a local env with the same spaces, give --env ID"
        raise ConfigError(f"cannot create the policy's env: {exc}{hint}") from exc


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
    env_id: str | None = None,
    overlay: bool = True,
) -> PlayResult:
    """Run ``episodes`` episodes of a saved policy (episode i reset with seed + i; sampling
    seeded with ``seed`` without touching torch's global generator) and record the first
    ``record_episodes`` of them when ``video`` or ``frames`` is given, with the ``info_keys``
    values and the return so far drawn on each frame unless ``overlay`` is False. ``env_id``
    plays in that env instead of the policy's own (e.g. Snake-v0 for a GameLink game's
    SnakeTS-v0; a reference ``path/to/file.py:Name`` as in run files)."""
    import numpy as np
    import torch

    if episodes < 1 or max_steps < 1:
        raise ConfigError("episodes and max_steps must be >= 1")
    if video is not None and frames is not None:
        raise ConfigError("give --video or --frames, not both")
    policy = load_policy(run_or_path, runs_root)
    recording = video is not None or frames is not None
    env_id = env_id or policy.env_id
    env_kwargs = policy.env_kwargs if env_id == policy.env_id else {}
    env = _make_env(env_id, env_kwargs, render=recording)
    recorder = None
    try:
        _check_spaces(policy, env)
        fps = float((getattr(env, "metadata", None) or {}).get("render_fps") or 30)
        recorder = _open_recorder(
            Path(video) if video is not None else None,
            Path(frames) if frames is not None else None,
            fps,
        )
        draw = _overlay() if recorder is not None and overlay else None
        results: list[Episode] = []
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)

        def frame(info: dict[str, Any], total: float) -> Any:
            image = np.asarray(env.render())
            if draw is None:
                return image
            lines = [f"{k} {v:g}" for k, v in _numbers(info, info_keys).items()]
            return draw(image, [*lines, f"return {total:.1f}"])

        for index in range(episodes):
            record = recorder is not None and index < record_episodes
            obs, info = env.reset(seed=seed + index)
            total, steps, done = 0.0, 0, False
            while not done and steps < max_steps:
                if record:
                    recorder.add(frame(info, total), index, steps)
                action = policy.act(obs, deterministic=deterministic, generator=generator)
                obs, reward, terminated, truncated, info = env.step(action)
                total += float(reward)
                steps += 1
                done = bool(terminated or truncated)
            if record:
                recorder.add(frame(info, total), index, steps)
            values = _numbers(info, info_keys)
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
    return PlayResult(
        env_id, policy.directory, deterministic, results, wall_s, written, _note(policy)
    )


def _note(policy: LoadedPolicy) -> str | None:
    d = policy.description
    if d.get("source") == "checkpoint":
        return (
            f"no final policy: playing checkpoint {policy.directory.name} "
            f"(update {d.get('updates')}, {d.get('global_step')} env steps)"
        )
    if not policy.complete:
        return (
            f"the run was stopped at update {d.get('stopped_at_update', d.get('updates'))} "
            f"({d.get('global_step')} env steps), before its end"
        )
    return None


# ---------------------------------------------------------------------------------- rlfleet play


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN_OR_PATH",
        help="run directory, run name (under ./runs/), run config, a final/ folder, or a "
        "checkpoint folder (a run without final/ plays its latest checkpoint)",
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
        "--video", type=Path, metavar="PATH", nargs="?", const=DEFAULT_VIDEO,
        help=f"record to PATH (default {DEFAULT_VIDEO}): MP4 unless its suffix names another "
        f"format ({', '.join(VIDEO_SUFFIXES[1:])}), or .gif (cut after {GIF_MAX_SECONDS:g} s)",
    )  # fmt: skip
    out.add_argument("--frames", type=Path, metavar="DIR", help="record PNG frames into DIR")
    parser.add_argument(
        "--no-overlay", dest="overlay", action="store_false",
        help="record frames as rendered (default: the score and return drawn on them)",
    )  # fmt: skip
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
    parser.add_argument(
        "--env", metavar="ID",
        help="play in this local env instead of the policy's own (same spaces; e.g. Snake-v0 "
        "for a policy trained through GameLink on the TypeScript SnakeTS-v0); an env id, or "
        "module:Name or path/to/file.py:Name as in run files",
    )  # fmt: skip


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
        env_id=args.env,
        overlay=args.overlay,
    )
    summary = result.summary()
    if result.policy_note:
        print(f"note: {result.policy_note}")
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
