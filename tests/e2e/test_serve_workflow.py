"""The serving workflow as the README gives it, on real parts: a (short) GRPO run, then
`rlfleet export RUN OUT --quantize w4a16`, then `rlfleet up` of a `serve` job, and the official
`openai` client gets completions and streamed chat completions from the trained model."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

from services.ports import free_port
from tests.integration.test_export import check_quantized

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-e2e"


def serve_config(
    tmp_path: Path, name: str, model: Path, served: str, port: int, **job: Any
) -> Path:
    """A `serve` run file under ``tmp_path``: one replica of ``model`` as ``served`` on ``port``
    with the test's API key (``job``: more knobs)."""
    config = tmp_path / "serve.yaml"
    body = {
        "run": {"name": name, "dir": str(tmp_path / "runs" / name)},
        "job": {
            "kind": "serve", "model": str(model), "served_model_name": served, "replicas": 1,
            "port": port, "max_model_len": 256, "api_keys": [{"key": KEY}], **job,
        },
    }  # fmt: skip
    config.write_text(yaml.safe_dump(body))
    return config


def stop_up(up: subprocess.Popen[str], log: IO[str], log_path: Path) -> None:
    """SIGINT to `rlfleet up` (killed if it does not end), then its exit must be clean."""
    with contextlib.suppress(ProcessLookupError):  # it ended already: its log says why
        os.killpg(up.pid, signal.SIGINT)
    try:
        code = up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        raise
    finally:
        log.close()
    assert code in (0, 130), _tail(log_path)


def _cli(*args: str, cwd: Path, **kwargs) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=cwd, env=env, text=True, start_new_session=True, **kwargs,
    )  # fmt: skip


def _tail(path: Path) -> str:
    return path.read_text()[-3000:]


def _wait_healthy(url: str, proc: subprocess.Popen[str], log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"rlfleet up exited with {proc.returncode}: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"{url} not healthy after {timeout_s:g}s")


@pytest.mark.timeout(1800)  # export and a vLLM start, each minutes under load
def test_train_export_quantized_serve_openai(lm_run: Path, tmp_path: Path) -> None:
    import openai

    export_dir = tmp_path / "exports" / "arith-w4a16"
    done = _cli("export", str(lm_run), str(export_dir), "--quantize", "w4a16",
                "--calibration-samples", "64", cwd=tmp_path)  # fmt: skip
    assert done.wait(timeout=900) == 0
    check_quantized(export_dir, "w4a16", samples=64)

    port = free_port()
    config = serve_config(tmp_path, "serve-e2e", export_dir, "arith", port)
    log = (tmp_path / "up.log").open("w")
    up = _cli("up", str(config), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        # the run's own health deadline (run.health_timeout_s) fails it first
        _wait_healthy(f"http://127.0.0.1:{port}/health", up, tmp_path / "up.log", timeout_s=900)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
        assert [m.id for m in client.models.list().data] == ["arith"]
        completion = client.completions.create(
            model="arith", prompt="Q: 3+4=?\nA:", max_tokens=12, temperature=0
        )
        assert completion.choices[0].text and completion.usage.completion_tokens > 0
        chunks = list(
            client.chat.completions.create(
                model="arith",
                messages=[{"role": "user", "content": "Q: 2+2=?"}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong").models.list()
    finally:
        stop_up(up, log, tmp_path / "up.log")
