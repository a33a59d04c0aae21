"""`rlfleet up` tells the user where a healthy gateway's OpenAI API is, and with which key.

A real launcher and a real gateway process in front of a fake sampler (a gRPC server in this
process answering health and GetInfo): the printed base URL answers /v1/models with the key.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from clients.sampler import SERVICE_NAME as SAMPLER_SERVICE
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from services.ports import free_port
from tests.fixtures.launch import Up, assert_nothing_left, write_config

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
    pytest.mark.timeout(240),
]

KEY_ENV = "RLFLEET_TEST_ANNOUNCE_KEY"


class _InfoOnly(sampler_pb2_grpc.SamplerServiceServicer):
    def GetInfo(
        self, request: sampler_pb2.GetInfoRequest, context: grpc.ServicerContext
    ) -> sampler_pb2.GetInfoResponse:
        return sampler_pb2.GetInfoResponse(model_name="fake-model", policy_version=0)


@pytest.fixture
def fake_sampler() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sampler_pb2_grpc.add_SamplerServiceServicer_to_server(_InfoOnly(), server)
    checks = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    for name in ("", SAMPLER_SERVICE):
        checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_healthy_gateway_prints_its_openai_base_url(
    tmp_path: Path, fake_sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-announce")  # the launcher's (and so the gateway's) env
    port = free_port()
    config, run_dir = write_config(
        tmp_path,
        f"""\
        - name: gateway
          service: gateway
          main: true
          settings:
            samplers: ["{fake_sampler}"]
            http_port: {port}
            api_keys: [{{key_env: {KEY_ENV}}}]
        """,
    )
    up = Up(config, run_dir, services=["gateway"])
    try:
        up.wait_for(r"rlfleet: OpenAI API at ", timeout_s=180)
        line = next(line for line in up.lines if "OpenAI API at" in line)
        assert line == (
            f"rlfleet: OpenAI API at http://127.0.0.1:{port}/v1 (api key: ${KEY_ENV})"
        ), line
        healthy = next(i for i, text in enumerate(up.lines) if "gateway (gateway) healthy" in text)
        assert up.lines.index(line) > healthy  # said once it can be used
        url = re.search(r"at (\S+) ", line).group(1)  # type: ignore[union-attr]
        request = urllib.request.Request(
            f"{url}/models", headers={"Authorization": "Bearer sk-announce"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            models = json.loads(reply.read())
        assert [m["id"] for m in models["data"]] == ["fake-model"]
        up.proc.send_signal(signal.SIGINT)
        assert up.wait(60) in (0, 130), up.output
        assert sum("OpenAI API at" in text for text in up.lines) == 1
    except BaseException:
        print(up.diagnostics())
        up.stop()
        raise
    assert_nothing_left(run_dir)
