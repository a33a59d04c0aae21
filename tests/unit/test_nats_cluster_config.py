"""The run file's `nats.cluster` setting and what the embedded cluster's servers are configured
with (services/bus/nats_cluster.py, services/bus/nats_server.py `server_conf`), without starting
any server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bus import REPLICAS_ENV, NatsCluster, NatsUser, stream_replicas
from services.bus.client import _replicas_from_env, server_list
from services.bus.nats_cluster import check_cluster_size
from services.bus.nats_server import ClusterNode, server_conf
from services.config import load_run_config
from services.errors import ConfigError, InvalidArgument
from services.security import TlsFiles

RUN = """\
run:
  name: demo
nats:
{nats}
services:
  - name: hb
    service: heartbeat
    main: true
"""


def load(tmp_path: Path, nats: str):
    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(nats=nats))
    return load_run_config(path, environ={})


@pytest.mark.parametrize("size", [1, 3, 5, 7])
def test_a_cluster_of_one_or_an_odd_number_from_three_is_accepted(
    tmp_path: Path, size: int
) -> None:
    assert load(tmp_path, f"  cluster: {size}").nats.cluster == size


@pytest.mark.parametrize("size", [0, 2, 4, -1])
def test_other_cluster_sizes_are_refused_at_their_line(tmp_path: Path, size: int) -> None:
    with pytest.raises(ConfigError, match=r"run.yaml:4: nats.cluster: .*1 node or an odd number"):
        load(tmp_path, f"  cluster: {size}")


def test_the_default_is_the_single_server_of_before(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(RUN.replace("nats:\n{nats}\n", ""))
    nats = load_run_config(path, environ={}).nats
    assert (nats.cluster, nats.url) == (1, None)


def test_an_external_cluster_is_a_comma_separated_url_list(tmp_path: Path) -> None:
    urls = "nats://10.0.0.1:4222,nats://10.0.0.2:4222,tls://nats-2.nats:4222"
    nats = load(tmp_path, f"  url: {urls}\n  cluster: 3").nats
    assert (nats.url, nats.cluster) == (urls, 3)
    assert server_list(urls) == urls.split(",")
    with pytest.raises(ConfigError, match=r"nats.url: .*'http://x:1' is not a nats://"):
        load(tmp_path, "  url: nats://a:1,http://x:1")
    with pytest.raises(ConfigError, match=r"nats.url: .*port"):
        load(tmp_path, "  url: nats://a:1,nats://b:99999")


def test_replicas_are_min_of_three_and_the_cluster_size() -> None:
    assert [stream_replicas(n) for n in (1, 3, 5, 7)] == [1, 3, 3, 3]
    with pytest.raises(InvalidArgument, match="1 node or an odd number"):
        check_cluster_size(2)
    with pytest.raises(InvalidArgument):
        NatsCluster("/nonexistent", 4)


def test_the_replica_count_a_service_gets_from_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(REPLICAS_ENV, raising=False)
    assert _replicas_from_env() == 1
    monkeypatch.setenv(REPLICAS_ENV, "3")
    assert _replicas_from_env() == 3
    for bad in ("0", "three", "-3"):
        monkeypatch.setenv(REPLICAS_ENV, bad)
        with pytest.raises(ConfigError, match=REPLICAS_ENV):
            _replicas_from_env()
    with pytest.raises(InvalidArgument, match="no NATS url"):
        server_list("nats://a:1,,nats://b:2")


def test_each_node_gets_its_own_ports_store_and_name_with_routes_to_all(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, 3)
    nodes = cluster._make_nodes()
    routes = [node.cluster.port for node in nodes if node.cluster]
    assert [n.store_dir for n in nodes] == [tmp_path / f"nats-{i}" for i in range(3)]
    assert [n.cluster.server_name for n in nodes if n.cluster] == ["nats-0", "nats-1", "nats-2"]
    ports = [n.port for n in nodes] + routes
    assert len(set(ports)) == 6 and None not in ports  # chosen up front, all distinct
    for node in nodes:
        conf = json.loads(
            server_conf(None, None, (), node.cluster, node.host)  # what _spawn writes
        )
        assert conf["server_name"] == node.cluster.server_name  # type: ignore[union-attr]
        block = conf["cluster"]
        assert block["name"] == "rlfleet"
        assert block["listen"] == f"127.0.0.1:{node.cluster.port}"  # type: ignore[union-attr]
        assert block["routes"] == [f"nats-route://127.0.0.1:{p}" for p in routes]
        assert "authorization" not in block and "tls" not in block
    single = NatsCluster(tmp_path, 1)._make_nodes()
    assert len(single) == 1 and single[0].cluster is None and single[0].store_dir == tmp_path


def test_routes_use_the_runs_tls_and_authenticate_under_nats_auth(tmp_path: Path) -> None:
    tls = TlsFiles(tmp_path / "ca.pem", tmp_path / "nats.pem", tmp_path / "nats.key")
    users = [NatsUser("learner", "pw")]
    cluster = NatsCluster(tmp_path, 3, tls=tls, users=users)
    node = cluster._make_nodes()[1]
    assert node.cluster is not None and node.cluster.route_password
    conf = json.loads(server_conf(None, tls, users, node.cluster, node.host))
    block = conf["cluster"]
    assert block["tls"] == conf["tls"] and block["tls"]["verify"] is True
    assert block["authorization"] == {"user": "route", "password": node.cluster.route_password}
    secret = node.cluster.route_password
    assert all(r.startswith(f"nats-route://route:{secret}@127.0.0.1:") for r in block["routes"])
    assert conf["authorization"]["users"][0]["user"] == "learner"
    # Without NATS auth the routes need no password (clients need none either).
    assert NatsCluster(tmp_path, 3, tls=tls)._make_nodes()[0].cluster.route_user is None  # type: ignore[union-attr]


def test_a_route_password_is_quoted_in_the_route_url() -> None:
    node = ClusterNode("c", "n0", 1000, [1000, 1001], "route", "a/b@c:d")
    (first, _) = node.conf("127.0.0.1", None)["routes"]  # type: ignore[misc]
    assert first == "nats-route://route:a%2Fb%40c%3Ad@127.0.0.1:1000"


def test_nodes_on_different_hosts_route_to_each_hosts_address() -> None:
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    node = ClusterNode("c", "n1", 6222, [6222] * 3, route_hosts=hosts)
    block = node.conf("10.0.0.2", None)
    assert block["listen"] == "10.0.0.2:6222"  # its own host's address, the others' in routes
    assert block["routes"] == [f"nats-route://{h}:6222" for h in hosts]
    with pytest.raises(InvalidArgument, match="2 hosts for 3 routes"):
        ClusterNode("c", "n1", 6222, [6222] * 3, route_hosts=hosts[:2])
