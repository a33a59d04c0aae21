"""Authentication and encryption (issue 13): mutual TLS on gRPC, credentials, TLS and subject
permissions on NATS, and a whole PPO run with both on.

Real parts throughout: certificates from `rlfleet certs` (launch/certs.py, the cryptography
library), grpc.aio servers on loopback ports, the real nats-server with the configuration the
launcher writes, and `rlfleet up` in a subprocess for the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launch.certs import ensure_certs
from services.bus import Bus, EmbeddedNats, NatsUser, service_permissions, stream_name
from services.errors import ConfigError, Unavailable
from services.security import TlsFiles, tls_files
from services.server import GrpcServer, channel
from tests.fixtures.launch import Up, assert_nothing_left, two_actor_cartpole

SECURE_ENV = ("RLFLEET_TLS_CA", "RLFLEET_TLS_CERT", "RLFLEET_TLS_KEY", "RLFLEET_NATS_USER",
              "RLFLEET_NATS_PASSWORD")  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SECURE_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def use(monkeypatch: pytest.MonkeyPatch, files: TlsFiles | None) -> None:
    for name, value in (files.env() if files else {}).items():
        monkeypatch.setenv(name, value)
    if files is None:
        for name in SECURE_ENV[:3]:
            monkeypatch.delenv(name, raising=False)


async def health(address: str, creds: grpc.ChannelCredentials | None) -> int:
    ch = grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
    async with ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return int(reply.status)


def test_half_configured_tls_is_an_error_naming_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="RLFLEET_TLS_KEY not set"):
        tls_files({"RLFLEET_TLS_CA": "a", "RLFLEET_TLS_CERT": "b"})
    assert tls_files({}) is None


async def test_grpc_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    certs = ensure_certs(tmp_path / "certs", ["server", "client"])
    stranger = ensure_certs(tmp_path / "other-ca", ["client"])["client"]
    use(clean_env, certs["server"])
    server = GrpcServer("secure", port=0)
    await server.start()
    server.set_serving()
    try:
        address = server.address
        use(clean_env, certs["client"])
        async with channel(address) as ch:  # rlfleet's own channel picks the certificate up
            stub = health_pb2_grpc.HealthStub(ch)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await health(address, None)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        ca, _, _ = certs["client"].read()
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:  # trusts the server, no cert
            await health(address, grpc.ssl_channel_credentials(root_certificates=ca))
        assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
        _, cert, key = stranger.read()
        foreign = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
        with pytest.raises(grpc.aio.AioRpcError) as other_ca:
            await health(address, foreign)
        assert other_ca.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()


async def test_nats_credentials_tls_and_subject_permissions(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    certs = ensure_certs(tmp_path / "certs", ["nats", "svc"])
    rights = service_permissions("sec-a", "game_actor", "svc")
    users = [NatsUser("svc", "s3cret", **rights), NatsUser("admin", "adm")]
    server = EmbeddedNats(tmp_path / "nats", tls=certs["nats"], users=users)
    await server.start_async()
    try:
        use(clean_env, certs["svc"])
        clean_env.setenv("RLFLEET_NATS_USER", "admin")  # the launcher makes the run's stream
        clean_env.setenv("RLFLEET_NATS_PASSWORD", "adm")
        async with Bus.connect(server.url, name="launcher") as bus:
            await bus.ensure_stream(stream_name("sec-a"), ["rlfleet.v1.traj.sec-a"])
        clean_env.setenv("RLFLEET_NATS_USER", "svc")
        clean_env.setenv("RLFLEET_NATS_PASSWORD", "s3cret")
        async with Bus.connect(server.url, name="svc") as bus:
            await bus.ensure_stream(stream_name("sec-a"), ["rlfleet.v1.traj.sec-a"])
            ack = await bus.publish("rlfleet.v1.traj.sec-a", Duration(seconds=1), msg_id="m1")
            assert ack.seq == 1
            with pytest.raises(Exception):  # noqa: B017 - nats-py times out a refused request
                await bus.js.purge_stream(stream_name("sec-a"))
            await bus.nc.publish("rlfleet.v1.traj.sec-b", b"into another run")
            await bus.nc.flush()
            await asyncio.sleep(0.3)
            assert "permissions violation" in str(bus.nc.last_error)
            info = await bus.js.stream_info(stream_name("sec-a"))
            assert info.state.messages == 1  # the purge did not happen
        clean_env.setenv("RLFLEET_NATS_PASSWORD", "wrong")
        with pytest.raises(Unavailable):
            await Bus.connect(server.url, name="bad", connect_attempts=1)
        for name in SECURE_ENV:
            clean_env.delenv(name, raising=False)
        with pytest.raises(Unavailable):
            await Bus.connect(server.url, name="anon", connect_attempts=1)
    finally:
        server.stop()


def test_rlfleet_certs_command(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "certs", str(tmp_path / "c"), "--name", "env-0",
         "--name", "learner", "--host", "env-0.rlfleet.svc"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "env-0: RLFLEET_TLS_CA=" in out.stdout
    for name in ("ca.pem", "env-0.pem", "env-0-key.pem", "learner.pem"):
        assert (tmp_path / "c" / name).is_file()
    assert oct((tmp_path / "c" / "env-0-key.pem").stat().st_mode & 0o777) == "0o600"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ppo_run_with_mutual_tls_and_nats_auth(tmp_path: Path) -> None:
    config = two_actor_cartpole()
    run_dir = tmp_path / "run"
    config["run"] = {"name": f"sec-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)}
    config["security"] = {"tls": True, "nats_auth": True}
    config["job"].update(total_timesteps=6000, target_return=None, update_epochs=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in SECURE_ENV}
    os.environ.clear()
    os.environ.update(env)  # the launcher must not inherit certificates from elsewhere
    up = Up(path, run_dir, services=("env-0", "learner", "actor-0", "actor-1"), budget_s=420)
    try:
        up.wait_for(r"env-0 \(env_server\) healthy at ", 120)
        address = next(
            line.rsplit(" at ", 1)[1] for line in up.lines if "env-0 (env_server) healthy" in line
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(health(address, None))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        nats_url = next(line.split("NATS at ")[1] for line in up.lines if "NATS at " in line)
        with pytest.raises(Unavailable):
            asyncio.run(_connect_anonymously(nats_url))
        assert up.wait() == 0, "the run failed"
        assert "main service learner finished" in up.output
        assert "callers checked by kind" in (run_dir / "logs" / "env-0.log").read_text()
        for name in ("learner", "actor-0", "actor-1", "env-0"):  # each had every right it used
            assert "permissions violation" not in (run_dir / "logs" / f"{name}.log").read_text()
        conf = (run_dir / "nats" / "nats-server.conf").read_text()
        assert '"verify": true' in conf and '"authorization"' in conf
        users = {u["user"] for u in json.loads(conf)["authorization"]["users"]}
        # env-0's only use: its record in the run's membership bucket.
        assert users == {"learner", "actor-0", "actor-1", "env-0", "launcher"}
        assert oct((run_dir / "nats" / "nats-server.conf").stat().st_mode & 0o777) == "0o600"
        assert_nothing_left(run_dir)
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()


async def _connect_anonymously(url: str) -> None:
    bus = await Bus.connect(url, name="intruder", connect_attempts=1)
    await bus.close()


async def test_caller_kinds_from_certificates_gate_each_method(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """An actor's certificate fetches weights but may not call the learner's control surface;
    a certificate of another run, or one naming no identity, is refused everything."""
    import torch

    from learner.loop import LearnerServicer
    from learner.weights import SERVICE_NAME, WeightServicer, WeightStore, add_weight_service
    from rlfleet.learner.v1 import learner_pb2, learner_pb2_grpc
    from services.grpc_names import service_name
    from services.security import Identity

    folder = tmp_path / "certs"
    kinds = {"learner": "learner", "actor-0": "game_actor", "launcher": "launcher"}
    ours = {n: Identity("sec-k", k, n) for n, k in kinds.items()}
    theirs = {"actor-9": Identity("sec-other", "game_actor", "actor-9")}
    certs = ensure_certs(folder, [*ours, *theirs, "anonymous"], (), {**ours, **theirs})
    status = learner_pb2.GetStatusResponse(run="sec-k", updates=3)
    store = WeightStore("sec-k", keep=2)
    store.publish({"w": torch.arange(6, dtype=torch.float32)})
    use(clean_env, certs["learner"])
    server = GrpcServer("learner", port=0)
    server.add_service(add_weight_service, WeightServicer(store), SERVICE_NAME)
    learner_service = service_name(learner_pb2, "LearnerService")
    loop = type("Loop", (), {"status": lambda self: status})()
    server.add_service(
        learner_pb2_grpc.add_LearnerServiceServicer_to_server,
        LearnerServicer(loop),
        learner_service,
    )
    await server.start()
    server.set_serving()

    async def get_status(who: str) -> learner_pb2.GetStatusResponse:
        use(clean_env, certs[who])
        async with channel(server.address) as ch:
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            return await stub.GetStatus(learner_pb2.GetStatusRequest(), timeout=5)

    async def fetch(who: str) -> torch.Tensor:
        from clients.learner import fetch_weights

        use(clean_env, certs[who])
        async with channel(server.address) as ch:
            _, tensors = await fetch_weights(ch, timeout_s=10, max_retries=0)
            return tensors["w"]

    try:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await get_status("actor-0")
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "LearnerService/GetStatus" in str(denied.value.details())
        assert "'game_actor'" in str(denied.value.details())
        assert torch.equal(await fetch("actor-0"), torch.arange(6, dtype=torch.float32))
        assert (await get_status("launcher")).updates == 3
        assert (await get_status("learner")).updates == 3
        for stranger in ("actor-9", "anonymous"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await get_status(stranger)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "not a service of run 'sec-k'" in str(refused.value.details())
            with pytest.raises(Exception, match=r"(?i)permission|not a service"):
                await fetch(stranger)
    finally:
        await server.stop()


def test_a_certificate_is_reissued_when_its_holder_changes_kind(tmp_path: Path) -> None:
    from services.security import Identity, cert_identity

    first = ensure_certs(tmp_path, ["svc"], (), {"svc": Identity("r", "game_actor", "svc")})
    again = ensure_certs(tmp_path, ["svc"], (), {"svc": Identity("r", "game_actor", "svc")})
    pem = first["svc"].cert.read_bytes()
    assert again["svc"].cert.read_bytes() == pem  # reused while the identity holds
    ensure_certs(tmp_path, ["svc"], (), {"svc": Identity("r", "learner", "svc")})
    assert cert_identity(first["svc"].cert.read_bytes()) == Identity("r", "learner", "svc")
