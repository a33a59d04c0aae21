"""The bus on a 3-node JetStream cluster (services/bus/nats_cluster.py): what the run creates is
replicated, publishing and consuming go on across a SIGKILL of the stream's leader with
nothing lost and nothing stored twice, and routes use the run's TLS and authenticate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from google.protobuf.struct_pb2 import Struct

from launch.certs import ensure_certs
from services.bus import REPLICAS_ENV, Bus, NatsCluster, NatsUser
from services.bus.payloads import bucket_for
from services.errors import Unavailable
from tests.fixtures.nats import stream_leader

pytestmark = pytest.mark.timeout(180)

ELECTION_S = 60.0  # a fresh cluster's meta leader, or a stream's new leader after a kill


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"TEST_{tag}", f"test.{tag}.traj"


def _struct(i: int) -> Struct:
    msg = Struct()
    msg.update({"i": i})
    return msg


async def test_streams_kv_and_payload_buckets_get_the_replica_count(
    nats_cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REPLICAS_ENV, "3")  # as the launcher hands it to every service
    async with Bus.connect(nats_cluster.url, name="replicas") as bus:
        assert bus.replicas == 3
        await bus.wait_for_jetstream(ELECTION_S)
        stream, subject = _names()
        info = await bus.ensure_stream(stream, [subject])
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.leader
        bucket = f"kv-{uuid.uuid4().hex[:8]}"
        await bus.kv(bucket)
        assert (await bus.js.stream_info(f"KV_{bucket}")).config.num_replicas == 3
        # Over the max payload: stored in the subject's object store, which is replicated too.
        big = Struct()
        big.update({"blob": "x" * (bus.max_payload + 1)})
        await bus.publish(subject, big, msg_id="big-1")
        objects = await bus.js.stream_info(f"OBJ_{bucket_for(subject)}")
        assert objects.config.num_replicas == 3
        # A stream keeps its count when a service with another setting ensures it.
        other = await Bus.connect(nats_cluster.url, name="single", replicas=1)
        try:
            again = await other.ensure_stream(stream, [subject], max_age_s=3600.0)
            assert again.config.num_replicas == 3
        finally:
            await other.close()


async def test_a_single_node_bus_keeps_one_copy(nats_url: str) -> None:
    async with Bus.connect(nats_url, name="one") as bus:
        assert bus.replicas == 1
        stream, subject = _names()
        assert (await bus.ensure_stream(stream, [subject])).config.num_replicas == 1


async def first_received(consuming: asyncio.Task[None], received: list[int]) -> None:
    """Until the consumer has a message; its own failure, if it failed first."""
    while not received:
        if consuming.done():
            consuming.result()  # raises what stopped it
            raise AssertionError("the consumer ended before taking a message")
        await asyncio.sleep(0.05)


async def test_publish_and_consume_across_a_sigkill_of_the_stream_leader(
    nats_cluster: NatsCluster,
) -> None:
    total, kill_after = 120, 40
    stream, subject = _names()
    admin = await Bus.connect(nats_cluster.url, name="admin", replicas=3)
    try:
        await admin.wait_for_jetstream(ELECTION_S)
        await admin.ensure_stream(stream, [subject])
        leader = nats_cluster.node(await stream_leader(admin, stream))
        # The publisher sits on the leader's node, so the kill also makes it fail over (the
        # client picks a server of the list at random: connect until it is that one).
        for _ in range(50):
            publisher = await Bus.connect(nats_cluster.url, name="publisher", replicas=3)
            connected = publisher.nc.connected_url
            if connected is not None and connected.port == leader.port:
                break
            await publisher.close()
        else:
            pytest.fail(f"no connection landed on the leader {leader.url}")
        # A loaded machine answers JetStream requests slowly: a consumer made under load must
        # not give up on its first one.
        consumer = await Bus.connect(
            nats_cluster.url, name="consumer", replicas=3, request_timeout_s=ELECTION_S / 4
        )
        received: list[int] = []
        stop = asyncio.Event()

        async def consume() -> None:
            async for delivery in consumer.pull(
                stream, "learner", subject, Struct, timeout_s=0.5, ack_wait_s=5.0, stop_event=stop
            ):
                received.append(int(delivery.message["i"]))
                # Not confirmed: it comes back after ack_wait, and counts once in the set below.
                with contextlib.suppress(Unavailable):
                    await delivery.ack()

        consuming = asyncio.create_task(consume())
        killed_pid = None
        for i in range(total):
            if i == kill_after:
                # Mid-stream: the consumer is taking messages when its stream loses the leader.
                await asyncio.wait_for(first_received(consuming, received), ELECTION_S)
                killed_pid = leader.pid
                assert killed_pid is not None
                os.kill(killed_pid, signal.SIGKILL)
            await publisher.publish_with_retry(
                subject, _struct(i), msg_id=f"m-{i}", attempts=8, first_delay_s=0.5
            )
        new_leader = await stream_leader(admin, stream)
        assert new_leader != leader.cluster.server_name  # type: ignore[union-attr]
        assert publisher.nc.connected_url.port != leader.port  # failed over to a survivor
        await asyncio.to_thread(leader.start)  # as the launcher restarts it: same ports, store
        assert leader.pid != killed_pid

        async def all_in() -> None:
            while set(received) != set(range(total)):
                await asyncio.sleep(0.2)

        try:
            await asyncio.wait_for(all_in(), ELECTION_S)
        finally:
            stop.set()
            await consuming
        assert sorted(set(received)) == list(range(total)), "a message was lost"
        state = (await admin.js.stream_info(stream)).state
        assert (state.messages, state.last_seq) == (total, total), "a retry was stored twice"
        await publisher.close()
        await consumer.close()
    finally:
        await admin.close()


async def test_without_a_majority_there_is_no_meta_leader_and_the_error_says_so(
    tmp_path: Path,
) -> None:
    cluster = NatsCluster(tmp_path / "nats", 3)
    cluster.nodes = cluster._make_nodes()
    lone = cluster.nodes[0]
    await lone.start_async()  # one node of three: no quorum, so no meta leader
    try:
        async with Bus.connect(lone.url, name="lonely") as bus:
            with pytest.raises(Unavailable, match=r"not ready after 2 s \(no meta leader"):
                await bus.wait_for_jetstream(2.0)
        described = cluster.describe()
        assert f"nats-server nats-0 at {lone.url}: running" in described
        for other in cluster.nodes[1:]:
            assert f"{other.label} at {other.url}: not running" in described
    finally:
        cluster.stop()


async def test_a_cluster_with_tls_and_nats_auth_routes_and_replicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    certs = ensure_certs(tmp_path / "certs", ["nats", "admin"])
    users = [NatsUser("admin", "adm")]
    for name, value in certs["admin"].env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RLFLEET_NATS_USER", "admin")
    monkeypatch.setenv("RLFLEET_NATS_PASSWORD", "adm")
    async with NatsCluster(tmp_path / "nats", 3, tls=certs["nats"], users=users) as cluster:
        for node in cluster.nodes:
            block = json.loads((node.store_dir / "nats-server.conf").read_text())["cluster"]
            assert block["tls"]["verify"] is True and block["authorization"]["user"] == "route"
        async with Bus.connect(cluster.url, name="admin", replicas=3) as bus:
            await bus.wait_for_jetstream(ELECTION_S)  # a majority routed over TLS, with auth
            stream, subject = _names()
            info = await bus.ensure_stream(stream, [subject])
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2
            assert (await bus.publish(subject, _struct(1), msg_id="s-1")).seq == 1
        monkeypatch.setenv("RLFLEET_NATS_PASSWORD", "wrong")
        with pytest.raises(Unavailable):
            await Bus.connect(cluster.url, name="bad", connect_attempts=1)
