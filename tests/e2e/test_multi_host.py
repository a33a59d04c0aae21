"""Runs spread over 3 hosts (network namespaces on a bridge, tests/fixtures/hosts.py), every
service started as a deployment starts it (tests/fixtures/spread.py), mutual TLS on.

1. The harness removes every namespace, link and process it made, also when the test body
   raises, and a later invocation removes what a killed one left behind.
2. CartPole PPO: nats-server and the learner on host 1, env-0 on host 2, the actor and env-1 on
   host 3. The run reaches the example's target return; the actor steps env-0 over gRPC (the
   co-located ring declined: another host) and env-1 through shared memory; each service ran
   in its host's namespace, its certificate naming that host's address only; plaintext calls
   are refused.
3. GRPO: the reward service on host 2, the LM learner on host 1, the sampler and the rollout
   driver on host 3, for a few updates, every group applied once.
4. Scaling across hosts: the actor on host 3 names env-0, served by one replica on host 2; a
   second replica of env-0 starts on host 3 mid-run and the actor spreads its envs over both
   (membership, no address wired), through shared memory beside it and over gRPC across hosts;
   stopped, the replica drains and exits 0; every fragment is applied exactly once.
5. No single bus node across hosts: a JetStream cluster of one nats-server per host, routed
   over the hosts' addresses with TLS and route auth; the node leading the run's stream is
   SIGKILLed mid-run, a survivor takes over, the node restarts on its host and catches up;
   every fragment is applied exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from services.bus import stream_name
from services.server import wait_for_health
from tests.fixtures import hosts as harness
from tests.fixtures.hosts import Hosts, cleanup_stale, hosts_or_skip, signal_group
from tests.fixtures.nats import stream_state
from tests.fixtures.runs import applied_updates, audit_ledger
from tests.fixtures.spread import Placed, SpreadRun

three_hosts = harness.three_hosts  # the harness's fixture: 3 hosts, removed after each test

REPO = Path(__file__).resolve().parents[2]
CARTPOLE = REPO / "examples" / "cartpole_ppo.yaml"
GRPO = REPO / "examples" / "grpo_arith.yaml"
TARGET = 475.0  # the example's target_return, as tests/e2e/test_cartpole_ppo.py
MAX_STEPS = 60_000  # the budget the run must reach TARGET within
RUN_TIMEOUT_S = 420.0
GRPO_UPDATES = 3
GRPO_GROUPS = 4
GRPO_TIMEOUT_S = 420.0
STEPS_PER_UPDATE = 256  # the example's one fragment of 8 envs x 32 steps
# Fixed-length runs (no target return) for the scaling and bus-node tests: long enough that
# what happens mid-run happens well before the end.
SCALE_UPDATES = 200
SCALE_TIMEOUT_S = 170.0
CLUSTER_UPDATES = 150
CLUSTER_TIMEOUT_S = 170.0
KILL_AT = 5  # updates applied before the leader node is killed: the stream is busy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux's"),
]


# --- the harness ---------------------------------------------------------------------------------


def _listener(address: str) -> list[str]:
    """A process that accepts one connection on ``address``:5000, then ignores SIGTERM (so
    teardown must escalate) and sleeps."""
    code = textwrap.dedent(f"""
        import signal, socket, time
        s = socket.socket(); s.bind(("{address}", 5000)); s.listen()
        print("listening", flush=True)
        c, peer = s.accept(); print("from", peer[0], flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    """)
    return [sys.executable, "-c", code]


def test_teardown_removes_everything_when_the_body_raises(tmp_path: Path) -> None:
    hosts = hosts_or_skip(2)
    with pytest.raises(RuntimeError, match="the body failed"), hosts:
        h1, h2 = hosts
        assert h1.address != h2.address and h1.netns != h2.netns
        log = tmp_path / "listener.log"
        server = h2.spawn(_listener(h2.address), log=log)
        deadline = time.monotonic() + 30
        while "listening" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        # One host reaches another by address; each has its own hostname.
        dial = f"import socket; socket.create_connection(('{h2.address}', 5000), timeout=5)"
        assert h1.run([sys.executable, "-c", dial]).returncode == 0
        assert h1.run(["hostname"]).stdout.strip() == h1.hostname
        while "from" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert f"from {h1.address}" in log.read_text()
        assert hosts.processes_inside() == [server.pid]
        assert hosts.leftovers(), "nothing to remove?"
        raise RuntimeError("the body failed")
    assert hosts.wait_gone() == []
    assert server.poll() is not None


def test_a_later_invocation_removes_what_a_killed_one_left(tmp_path: Path) -> None:
    hosts_or_skip(1)  # skips (or fails under CI) where namespaces cannot be made
    script = textwrap.dedent("""
        import sys, time
        from tests.fixtures.hosts import Hosts
        hosts = Hosts(2).__enter__()
        hosts[0].spawn([sys.executable, "-c", "import time; time.sleep(600)"])
        print(hosts.prefix, hosts[0].netns, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        prefix, netns = owner.stdout.readline().split()
    finally:
        owner.kill()  # no teardown, no atexit: what a crash leaves
        owner.wait()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netns in names, "the killed owner left nothing to clean?"
    assert prefix in cleanup_stale()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert prefix not in names and prefix not in links
    assert not Path(f"/etc/netns/{netns}").exists()


# --- runs --------------------------------------------------------------------------------------


def _run_file(tmp_path: Path, example: Path, name: str, **job: Any) -> Path:
    config = yaml.safe_load(example.read_text())
    config["run"] = {"name": f"{name}-{uuid.uuid4().hex[:8]}", "dir": str(tmp_path / "run")}
    config["job"].update(job)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _assert_in_their_hosts(run: SpreadRun) -> None:
    """Each service process lives in its host's network namespace."""
    for p in run.placed.values():
        assert p.process is not None and p.process.poll() is None, f"{p.name} not running"
        inside = os.stat(f"/proc/{p.process.pid}/ns/net").st_ino
        assert inside == os.stat(f"/run/netns/{p.host.netns}").st_ino, f"{p.name} not in its host"


def _assert_certificates_name_their_host(run: SpreadRun, hosts: Hosts) -> None:
    for p in run.placed.values():
        cert = x509.load_pem_x509_certificate(
            (run.run_dir / "certs" / f"{p.name}.pem").read_bytes()
        )
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        addresses = {str(a) for a in names.get_values_for_type(x509.IPAddress)}
        assert p.host.address in addresses, f"{p.name}: {addresses}"
        assert not addresses & (set(hosts.addresses) - {p.host.address}), f"{p.name}: {addresses}"


def _assert_plaintext_refused(address: str) -> None:
    """A client without a certificate (this process has no TLS environment) never gets an
    answer: the handshake fails."""
    with pytest.raises(TimeoutError, match="UNAVAILABLE"):
        wait_for_health(address, 3.0)


def _episodic_returns(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("charts/episodic_return")]


def _teardown_leaves_nothing(hosts: Hosts) -> None:
    hosts.teardown()
    assert hosts.wait_gone() == []


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_cartpole_ppo_trains_across_three_hosts(three_hosts: Hosts, tmp_path: Path) -> None:
    hosts = three_hosts
    # Two env servers, the actor's envs split over both: env-0 on host 2, env-1 beside the actor.
    run_file = _run_file(
        tmp_path, CARTPOLE, "hosts-ppo", env_servers=2, seed=1, total_timesteps=MAX_STEPS
    )
    started = time.monotonic()
    with SpreadRun(hosts, run_file, placement={"env-1": 2}) as run:
        try:
            run.start()
            _assert_in_their_hosts(run)
            _assert_plaintext_refused(run.placed["env-0"].address)
            _assert_plaintext_refused(run.placed["learner"].address)
            assert run.wait(RUN_TIMEOUT_S - (time.monotonic() - started)) == 0
        except BaseException:
            print(run.diagnostics())
            raise
    _assert_certificates_name_their_host(run, hosts)
    env_0, env_1 = run.placed["env-0"], run.placed["env-1"]
    assert env_0.host.index == 2 and env_1.host.index == 3 == run.placed["actor-0"].host.index

    points = _episodic_returns(run.run_dir)
    reached = [(step, value) for step, value in points if value >= TARGET]
    best = max(points, key=lambda p: p[1], default=None)
    assert reached, f"episodic_return never reached {TARGET:g} (best: {best})"
    final = json.loads((run.run_dir / "final" / "policy.json").read_text())
    assert final["global_step"] < MAX_STEPS, "ended by the step budget, not the target"

    # The co-located ring: declined for env-0 (another host, reason logged), taken for env-1.
    actor = run.placed["actor-0"].log.read_text()
    declined = rf"env server {re.escape(env_0.address)}: gRPC steps \(the client is on another host"
    assert re.search(declined, actor), actor[-3000:]
    assert f"env server {env_1.address}: gRPC steps" not in actor
    assert re.search(r"steps via grpc,shm\)", actor), actor[-3000:]

    _teardown_leaves_nothing(hosts)
    print(
        f"reached {reached[0][1]:g} at step {reached[0][0]}; ended at step "
        f"{final['global_step']} in {time.monotonic() - started:.0f}s"
    )


@pytest.mark.timeout(GRPO_TIMEOUT_S + 120)
def test_grpo_runs_across_three_hosts(
    three_hosts: Hosts, tiny_model_dir: Path, tmp_path: Path
) -> None:
    hosts = three_hosts
    run_file = _run_file(
        tmp_path,
        GRPO,
        "hosts-grpo",
        model_path=str(tiny_model_dir),
        engine="hf",
        sft_steps=5,
        groups_per_update=GRPO_GROUPS,
        group_size=4,
        prompts_per_call=4,
        minibatch_size=GRPO_GROUPS * 4,
        total_updates=GRPO_UPDATES,
        eval_count=8,
        eval_every=GRPO_UPDATES,
        learner_threads=1,
    )
    started = time.monotonic()
    with SpreadRun(hosts, run_file) as run:
        try:
            run.start()
            _assert_in_their_hosts(run)
            _assert_plaintext_refused(run.placed["reward"].address)
            assert run.wait(GRPO_TIMEOUT_S - (time.monotonic() - started)) == 0
        except BaseException:
            print(run.diagnostics())
            raise
    _assert_certificates_name_their_host(run, hosts)
    where = {name: p.host.index for name, p in run.placed.items()}
    assert where == {"reward": 2, "learner": 1, "sampler-0": 3, "rollout-0": 3}

    ledger = [
        json.loads(line)
        for line in (run.run_dir / "learner" / "applied.jsonl").read_text().splitlines()
    ]
    applied = collections.Counter(e["id"] for e in ledger if e["status"] == "applied")
    assert sum(applied.values()) == GRPO_GROUPS * GRPO_UPDATES and max(applied.values()) == 1
    summary = json.loads((run.run_dir / "final" / "rlfleet_run.json").read_text())
    assert summary["updates"] == GRPO_UPDATES
    # The sampler on host 3 followed the learner on host 1: it fetched the versions it served.
    sampler_log = run.placed["sampler-0"].log.read_text()
    learner = re.escape(run.placed["learner"].address)
    fetched = [int(v) for v in re.findall(rf"fetched weights v(\d+) from {learner}", sampler_log)]
    assert fetched and max(fetched) >= GRPO_UPDATES - 1, sampler_log[-3000:]

    _teardown_leaves_nothing(hosts)
    print(f"{GRPO_UPDATES} updates across hosts in {time.monotonic() - started:.0f}s")


# --- scaling and bus nodes across hosts ----------------------------------------------------------


def _fixed_length_run(tmp_path: Path, name: str, updates: int) -> Path:
    """The CartPole example for exactly ``updates`` updates (no target return), with cheaper
    updates so that the run's length is set by its env steps."""
    total = updates * STEPS_PER_UPDATE
    return _run_file(
        tmp_path, CARTPOLE, name, seed=1, total_timesteps=total, target_return=None, update_epochs=4
    )


def _layouts(actor_log: Path) -> list[str]:
    """The actor's env layouts, in order: "envs a-b on ADDRESS (n), ADDRESS (n)"."""
    text = actor_log.read_text(errors="replace") if actor_log.exists() else ""
    return re.findall(r"envs \d+-\d+ on (.*)$", text, re.M)


def _links(actor: Placed) -> dict[str, float]:
    """The actor's env server sessions by transport (shm, grpc), from its metrics endpoint."""
    url = f"http://{actor.host.address}:{actor.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    found = re.findall(r'^\w*actor_env_links\{[^}]*transport="(\w+)"[^}]*\} (\S+)$', text, re.M)
    return {transport: float(value) for transport, value in found}


def _assert_exact(run: SpreadRun) -> None:
    """Every fragment the learner saw applied exactly once, by one actor incarnation."""
    audit = audit_ledger(run.run_dir)
    print(audit)
    assert audit.lost == [] and audit.doubled == [], audit
    assert audit.incarnations == 1, audit  # the actor was never restarted
    assert audit.applied == applied_updates(run.run_dir), audit  # one fragment per update


@pytest.mark.timeout(SCALE_TIMEOUT_S + 60)
def test_an_env_server_replica_joins_on_another_host_and_drains(
    three_hosts: Hosts, tmp_path: Path
) -> None:
    hosts = three_hosts
    run_file = _fixed_length_run(tmp_path, "hosts-scale", SCALE_UPDATES)
    started = time.monotonic()
    with SpreadRun(hosts, run_file) as run:
        try:
            run.start()
            env_0, actor = run.placed["env-0"], run.placed["actor-0"]
            assert (env_0.host.index, actor.host.index) == (2, 3)
            actor_settings = actor.entry.settings
            assert actor_settings.env_servers == ["env-0"]  # type: ignore[attr-defined]
            run.wait_until("update 3", lambda: applied_updates(run.run_dir) >= 3, 90)
            assert _links(actor) == {"shm": 0.0, "grpc": 1.0}  # env-0 is on another host

            # Scale out: a second process of env-0, on the actor's host, found by membership.
            replica = run.start_replica("env-0", 2)
            assert replica.host.index == 3 and replica.address != env_0.address
            run.wait_until(
                "envs on both replicas",
                lambda: any(
                    env_0.address in line and replica.address in line
                    for line in _layouts(actor.log)
                ),
                60,
            )
            # Beside the actor the co-located ring is taken; across hosts it is declined.
            assert _links(actor) == {"shm": 1.0, "grpc": 1.0}
            text = actor.log.read_text(errors="replace")
            assert f"env server {replica.address}: gRPC steps" not in text, text[-3000:]
            declined = f"env server {env_0.address}: gRPC steps (the client is on another host"
            assert declined in text, text[-3000:]
            at_join = applied_updates(run.run_dir)
            run.wait_until(
                "updates on both", lambda: applied_updates(run.run_dir) >= at_join + 3, 60
            )

            # Scale in: the replica drains (the actor moves off it) and exits 0.
            assert replica.process is not None
            signal_group(replica.process, signal.SIGTERM)
            assert replica.process.wait(30) == 0
            assert "draining:" in replica.log.read_text(errors="replace"), _tail_of(replica.log)
            assert _layouts(actor.log)[-1] == f"{env_0.address} (8)", _layouts(actor.log)
            assert "steps via grpc)" in text  # one gRPC link at the start: env-0's only
            assert _links(actor) == {"shm": 0.0, "grpc": 1.0}
            at_drain = applied_updates(run.run_dir)
            assert at_drain < SCALE_UPDATES, "the run ended before the replica drained"

            assert run.wait(SCALE_TIMEOUT_S - (time.monotonic() - started)) == 0
        except BaseException:
            print(run.diagnostics())
            raise
    _assert_certificates_name_their_host(run, hosts)
    cert = x509.load_pem_x509_certificate((run.run_dir / "certs" / "env-0@h3.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} & set(hosts.addresses) == {
        hosts[2].address
    }
    _assert_exact(run)
    _teardown_leaves_nothing(hosts)
    print(
        f"joined at update {at_join}, drained at {at_drain} of {SCALE_UPDATES}, "
        f"in {time.monotonic() - started:.0f}s"
    )


def _tail_of(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _stream_state(run: SpreadRun) -> tuple[str, int, dict[str, bool]]:
    return asyncio.run(stream_state(run.nats_url, stream_name(run.run_name)))


def _new_leader(run: SpreadRun, old: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (leader := _stream_state(run)[0]) == old:
        assert time.monotonic() < deadline, f"{old} still leads after {timeout_s:g}s"
        time.sleep(0.5)
    return leader


@pytest.mark.timeout(CLUSTER_TIMEOUT_S + 60)
def test_a_run_survives_sigkill_of_its_stream_leader_node_across_hosts(
    three_hosts: Hosts, tmp_path: Path
) -> None:
    hosts = three_hosts
    run_file = _fixed_length_run(tmp_path, "hosts-cluster", CLUSTER_UPDATES)
    started = time.monotonic()
    with SpreadRun(hosts, run_file, nats_nodes=3) as run:
        try:
            run.start()
            urls = run.nats_url.split(",")
            assert urls == [f"nats://{h.address}:4222" for h in hosts]
            for host, server in zip(hosts, run.nats_servers, strict=True):
                assert server is not None and host.holds(server.pid)
            # The nodes found each other over the hosts' addresses.
            conf = json.loads((run.run_dir / "nats" / "nats-1" / "nats-server.conf").read_text())
            assert conf["cluster"]["listen"] == f"{hosts[1].address}:6222"
            assert all("route:" in r for r in conf["cluster"]["routes"])  # routes authenticate
            run.wait_until(f"update {KILL_AT}", lambda: applied_updates(run.run_dir) >= KILL_AT, 90)
            with run.as_launcher():
                leader, replicas, _ = _stream_state(run)
                assert replicas == 3  # the run's stream is kept on every host
                index = run.nats_names.index(leader)
                killed = run.nats_servers[index]
                assert killed is not None
                signal_group(killed, signal.SIGKILL)
                assert killed.wait(10) == -signal.SIGKILL
                killed_at = applied_updates(run.run_dir)
                # A survivor on another host takes the stream over while the node is away.
                successor = _new_leader(run, leader, 30)
                run.start_nats_node(index)  # on its host, ports and store
                restarted = run.nats_servers[index]
                assert restarted is not None and restarted.pid != killed.pid
                assert hosts[index].holds(restarted.pid)
                run.wait_until(
                    "training past the kill",
                    lambda: applied_updates(run.run_dir) >= killed_at + 3,
                    60,
                )
                # The restarted node is a current copy again.
                deadline = time.monotonic() + 30
                while not _stream_state(run)[2].get(leader):
                    assert time.monotonic() < deadline, f"{leader} never caught up"
                    time.sleep(0.5)
            assert applied_updates(run.run_dir) < CLUSTER_UPDATES, "the run ended too soon"
            assert run.wait(CLUSTER_TIMEOUT_S - (time.monotonic() - started)) == 0
        except BaseException:
            print(run.diagnostics())
            raise
    for i, host in enumerate(hosts):
        cert = x509.load_pem_x509_certificate(
            (run.run_dir / "certs" / f"nats-{i}.pem").read_bytes()
        )
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        addresses = {str(a) for a in names.get_values_for_type(x509.IPAddress)}
        assert addresses & set(hosts.addresses) == {host.address}, addresses
    _assert_exact(run)
    _teardown_leaves_nothing(hosts)
    print(
        f"killed {leader} on {hosts[index].name} at update {killed_at}, {successor} took over; "
        f"{CLUSTER_UPDATES} updates in {time.monotonic() - started:.0f}s"
    )
