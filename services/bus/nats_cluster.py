"""The embedded bus of a run: one nats-server, or a JetStream cluster of several on loopback.

A cluster of ``size`` nodes is ``size`` `EmbeddedNats` processes, each with its own client port,
route port and store (``<store_dir>/nats-<i>``), routed to each other under one cluster name.
Every port is chosen before the first node starts (each node's routes name all the others), so
a port taken meanwhile fails that start: the whole set is then chosen afresh and the cluster
started again. A node that dies is restarted by its owner on the same ports and store
(`EmbeddedNats.start`), and rejoins the cluster with its JetStream state.

Size 1 is today's single server, in ``store_dir`` itself and without routes, so a run file that
does not ask for a cluster gets exactly what it got before.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from pathlib import Path

from services.bus.nats_server import ClusterNode, EmbeddedNats, NatsUser
from services.errors import InvalidArgument, Unavailable
from services.ports import free_ports
from services.security import TlsFiles

__all__ = ["CLUSTER_NAME", "MAX_REPLICAS", "NatsCluster", "check_cluster_size", "stream_replicas"]

CLUSTER_NAME = "rlfleet"
# Copies JetStream keeps of each stream: 3 survive the loss of any one node; more cost writes
# and buy nothing a run needs.
MAX_REPLICAS = 3
_ADDR_IN_USE = "address already in use"
_START_ATTEMPTS = 3  # fresh port sets tried when one was taken between choosing and binding


def check_cluster_size(size: int) -> int:
    """``size`` when it is a usable node count: 1, or an odd number from 3 (a raft majority
    survives losing a minority only with an odd count); else InvalidArgument."""
    if size == 1 or (size >= 3 and size % 2 == 1):
        return size
    raise InvalidArgument(
        f"a NATS cluster has 1 node or an odd number of 3 or more, got {size}",
        field="nats.cluster",
    )


def stream_replicas(size: int) -> int:
    """How many copies of each stream, KV and object store bucket a bus of ``size`` nodes keeps."""
    return min(MAX_REPLICAS, check_cluster_size(size))


class NatsCluster:
    """``size`` supervised nats-servers forming one JetStream cluster (or one plain server).

    ``nodes`` are the servers (empty until started); ``urls`` their client URLs and ``url``
    those joined by commas, the form ``RLFLEET_NATS_URL`` and `Bus.connect` take. Server
    options are those of `EmbeddedNats`, the same on every node; with ``users`` (NATS auth) the
    routes authenticate too, with a password made for this cluster's lifetime.
    """

    def __init__(
        self,
        store_dir: Path | str,
        size: int = 1,
        *,
        host: str = "127.0.0.1",
        max_payload: int | None = None,
        binary: Path | str | None = None,
        ready_timeout_s: float = 10.0,
        die_with_parent: bool = False,
        tls: TlsFiles | None = None,
        users: Sequence[NatsUser] = (),
    ) -> None:
        self.size = check_cluster_size(size)
        self.store_dir = Path(store_dir)
        self.host = host
        self.max_payload, self.binary = max_payload, binary
        self.ready_timeout_s, self.die_with_parent = ready_timeout_s, die_with_parent
        self.tls, self.users = tls, tuple(users)
        self._route_auth = (
            ("route", secrets.token_urlsafe(24)) if users and size > 1 else (None, None)
        )
        self.nodes: list[EmbeddedNats] = []

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def node(self, server_name: str) -> EmbeddedNats:
        """The node JetStream calls ``server_name`` (a stream's ``cluster.leader``)."""
        for node in self.nodes:
            if node.cluster is not None and node.cluster.server_name == server_name:
                return node
        raise InvalidArgument(f"no node {server_name!r} in this cluster", field="server_name")

    def _server(self, store_dir: Path, port: int, cluster: ClusterNode | None) -> EmbeddedNats:
        return EmbeddedNats(
            store_dir,
            self.host,
            port,
            max_payload=self.max_payload,
            binary=self.binary,
            ready_timeout_s=self.ready_timeout_s,
            die_with_parent=self.die_with_parent,
            tls=self.tls,
            users=self.users,
            cluster=cluster,
        )

    def _make_nodes(self) -> list[EmbeddedNats]:
        if self.size == 1:
            return [self._server(self.store_dir, 0, None)]
        ports = free_ports(2 * self.size, self.host)
        clients, routes = ports[: self.size], ports[self.size :]
        user, password = self._route_auth
        nodes = []
        for i in range(self.size):
            name = f"nats-{i}"
            node = ClusterNode(CLUSTER_NAME, name, routes[i], routes, user, password)
            nodes.append(self._server(self.store_dir / name, clients[i], node))
        return nodes

    def _retry(self, exc: Unavailable, attempt: int) -> bool:
        """Stop what started; True when a port was taken and another set may be tried."""
        self.stop()
        return attempt + 1 < _START_ATTEMPTS and _ADDR_IN_USE in str(exc)

    def start(self) -> NatsCluster:
        """Start every node and wait until each accepts clients (not for the JetStream meta
        leader: `Bus.wait_for_jetstream` waits for that); Unavailable when one cannot start."""
        if self.nodes:
            for node in self.nodes:
                node.start()
            return self
        for attempt in range(_START_ATTEMPTS):
            self.nodes = self._make_nodes()
            try:
                for node in self.nodes:
                    node.start()
            except Unavailable as exc:
                if not self._retry(exc, attempt):
                    raise
                continue
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    async def start_async(self) -> NatsCluster:
        """``start()`` for an event loop: each node is spawned from the calling thread (see
        `EmbeddedNats.start_async`)."""
        if self.nodes:
            for node in self.nodes:
                await node.start_async()
            return self
        for attempt in range(_START_ATTEMPTS):
            self.nodes = self._make_nodes()
            try:
                for node in self.nodes:
                    await node.start_async()
            except Unavailable as exc:
                if not self._retry(exc, attempt):
                    raise
                continue
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every node (`EmbeddedNats.stop`); the nodes are kept for their logs."""
        for node in self.nodes:
            node.stop(timeout_s)

    def describe(self) -> str:
        """Each node's state, for an error that has to say which node is missing."""
        return "; ".join(
            f"{node.label} at {node.url}: "
            + ("running" if node.running else f"not running (exit {node.returncode})")
            for node in self.nodes
        )

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> NatsCluster:
        return await self.start_async()

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)
