"""The Go GameLink client (sdk/go), generated from protos/ alone, against a real env server.

`make sdk-go` (a prerequisite of `make test`) installs Debian's Go toolchain when missing
(sdk/go/install-deps.sh) and runs sdk/go/build.sh: protoc with protoc-gen-go and
protoc-gen-go-grpc over protos/ (-I protos -I protos/third_party/googleapis, the recipe of
docs/game_link.md) into sdk/go/build (never committed), then go vet, go test and go build of the
case runner, offline in GOPATH mode. Here the runner plays every case of game_link_cases.json
(the ones tests/contract/test_game_link.py runs with Python) against an env server serving
GameLinkService, then a pipelined link through the package's Link API (Submit/Receive/Close).
Without Go (`go`, `protoc-gen-go`, `protoc-gen-go-grpc`) the test skips, except under CI=true,
where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.contract.test_game_link import Server

pytestmark = [pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "sdk" / "go"
RUNNER = SDK / "build" / "bin" / "gamelink-cases"
CASES_FILE = Path(__file__).parent / "game_link_cases.json"
CASES = json.loads(CASES_FILE.read_text())["cases"]
BUILD_TIMEOUT_S = 600  # a first build compiles grpc-go from /usr/share/gocode (~1 min)
TOOLS = ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")


@pytest.fixture(scope="module")
def runner() -> Path:
    """sdk/go/build.sh (incremental: Go's build cache) and the case runner it builds."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        message = f"no {', '.join(missing)}: run `make sdk-go` (sdk/go/install-deps.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    built = subprocess.run(
        ["bash", str(SDK / "build.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert built.returncode == 0, f"sdk/go/build.sh failed:\n{built.stdout}\n{built.stderr}"
    assert RUNNER.is_file()
    return RUNNER


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(nats_url: str) -> AsyncIterator[Server]:
    srv = Server(nats_url)  # policy: random, max_agents_per_link 8 (what the cases assume)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.mark.asyncio(loop_scope="session")
async def test_go_client_passes_the_contract_cases(runner: Path, server: Server) -> None:
    ticks = 12
    done = await asyncio.to_thread(
        subprocess.run,
        [
            str(runner),
            "-address",
            server.address,
            "-cases",
            str(CASES_FILE),
            "-link-ticks",
            str(ticks),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}"
    for case in CASES:
        assert f"ok {case['name']}\n" in out, out
    assert f"{len(CASES)} cases, 0 failed" in out
    assert re.search(
        r"^link \S+ open: max_in_flight 2, policy_loaded true, policy_version 0$", out, re.M
    ), out
    assert f"link: {ticks} ticks, farewell {ticks} ticks {ticks // 5} episodes" in out


def test_generated_go_code_is_build_output() -> None:
    """The Go code generated from protos/ lives under sdk/go/build/ (git-ignored), not in git."""
    tracked = subprocess.run(
        ["git", "ls-files", "sdk/go"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert not [path for path in tracked if path.endswith(".pb.go")], tracked
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "sdk/go/build/gopath/src/rlfleet/gen/go/x.pb.go"], cwd=REPO
    )
    assert ignored.returncode == 0, "sdk/go/build/ is not git-ignored"
