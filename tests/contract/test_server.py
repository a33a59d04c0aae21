"""GrpcServer and channel() against a real grpc.aio server on a loopback socket.

The test service is built from generic handlers on raw bytes, so no generated code is needed:
each request names what the handler should do ("ok", "invalid", "value-error", ...).
"""

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from prometheus_client import REGISTRY

from services.errors import (
    InvalidArgument,
    NotFound,
    Unavailable,
    current_request_id,
    from_rpc_error,
    request_id_var,
)
from services.server import GrpcServer, channel, wait_for_health

REPO = Path(__file__).resolve().parents[2]
SERVICE = "rlfleet.test.v1.Probe"
LIMIT = 1 << 20  # server message limit for these tests: 1 MiB

_attempts: dict[bytes, int] = {}


def act(command: bytes) -> bytes:
    """What every handler does with one request: answer, or raise what the request names."""
    if command == b"invalid":
        raise InvalidArgument("num_envs must be > 0", field="num_envs")
    if command == b"not-found":
        raise NotFound("no session 7")
    if command == b"value-error":
        raise ValueError("negative length")
    if command == b"request-id":
        return (current_request_id() or "").encode()
    if command.startswith(b"flaky-"):  # UNAVAILABLE twice, then fine
        _attempts[command] = _attempts.get(command, 0) + 1
        if _attempts[command] <= 2:
            raise Unavailable("warming up")
        return b"attempt %d" % _attempts[command]
    return command


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request.startswith(b"sleep:"):
        await asyncio.sleep(float(request[6:]))
        return b"slept"
    if request == b"abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler aborted itself")
    return act(request)


async def count(request: bytes, context: grpc.aio.ServicerContext):
    """unary-stream, async generator: two good answers, then the request's fate."""
    yield b"1"
    yield b"2"
    yield act(request)


async def count_writer(request: bytes, context: grpc.aio.ServicerContext) -> None:
    """unary-stream in the reader/writer style: a coroutine that writes and returns None."""
    await context.write(b"1")
    await context.write(act(request))


async def join(requests, context: grpc.aio.ServicerContext) -> bytes:
    """stream-unary: the requests joined, after each has been acted on."""
    return b"+".join([act(r) async for r in requests])


async def chat(requests, context: grpc.aio.ServicerContext):
    """stream-stream: one answer per request."""
    async for request in requests:
        yield act(request)


async def decoded(request: health_pb2.HealthCheckRequest, context) -> bytes:
    return request.service.encode()


async def decoded_count(request: health_pb2.HealthCheckRequest, context):
    yield request.service.encode()


async def decoded_chat(requests, context):
    async for request in requests:
        yield request.service.encode()


PROBE = grpc.method_handlers_generic_handler(
    SERVICE,
    {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "CountWriter": grpc.unary_stream_rpc_method_handler(count_writer),
        "Join": grpc.stream_unary_rpc_method_handler(join),
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
        # Protobuf requests, to send undecodable bytes to.
        "Decode": grpc.unary_unary_rpc_method_handler(
            decoded, request_deserializer=health_pb2.HealthCheckRequest.FromString
        ),
        "DecodeCount": grpc.unary_stream_rpc_method_handler(
            decoded_count, request_deserializer=health_pb2.HealthCheckRequest.FromString
        ),
        "DecodeChat": grpc.stream_stream_rpc_method_handler(
            decoded_chat, request_deserializer=health_pb2.HealthCheckRequest.FromString
        ),
    },
)


def add_probe(servicer, server) -> None:
    server.add_generic_rpc_handlers((servicer,))


def new_server(**kwargs) -> GrpcServer:
    server = GrpcServer("probe", max_message_bytes=LIMIT, **kwargs)
    server.add_service(add_probe, PROBE, SERVICE)
    return server


@pytest_asyncio.fixture(scope="module")
async def served():
    server = new_server()
    await server.start()
    server.set_serving()
    yield server
    await server.stop(0)


@pytest_asyncio.fixture
async def chan(served):
    async with channel(served.address, max_message_bytes=8 * LIMIT) as ch:
        yield ch


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def bad_request_fields(status) -> list[str]:
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return [v.field for v in bad.field_violations]
    return []


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return reply.status


async def test_health_is_not_serving_until_set_serving():
    server = new_server()
    port = await server.start()
    try:
        assert port > 0 and server.address.endswith(f":{port}")
        for service in ("", SERVICE):
            assert (
                await health_status(server.address, service)
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
        with pytest.raises(TimeoutError, match=server.address):
            await asyncio.to_thread(wait_for_health, server.address, 0.3)
        server.set_serving()
        for service in ("", SERVICE):
            assert (
                await health_status(server.address, service)
                == health_pb2.HealthCheckResponse.SERVING
            )
        await asyncio.to_thread(wait_for_health, server.address, 2.0, SERVICE)
        server.set_serving(False)
        assert await health_status(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop(0)


def test_wait_for_health_names_an_address_nobody_listens_on():
    with pytest.raises(TimeoutError, match=r"127\.0\.0\.1:1\b"):
        wait_for_health("127.0.0.1:1", 0.3)


async def test_add_service_after_start_is_refused(served):
    with pytest.raises(RuntimeError, match="after start"):
        served.add_service(add_probe, PROBE, "rlfleet.test.v1.Late")


async def test_reflection_lists_the_services(chan):
    stub = reflection_pb2_grpc.ServerReflectionStub(chan)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {
        s.name for reply in [r async for r in call] for s in reply.list_services_response.service
    }
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_unary_ok_and_request_id_generated_and_echoed(chan):
    call = chan.unary_unary(method("Echo"))(b"request-id", timeout=2)
    generated = (await call).decode()
    assert len(generated) == 32 and int(generated, 16) >= 0  # uuid4 hex
    assert dict(await call.trailing_metadata())["x-request-id"] == generated

    call = chan.unary_unary(method("Echo"))(
        b"request-id", metadata=(("x-request-id", "job-42"),), timeout=2
    )
    assert await call == b"job-42"
    assert dict(await call.trailing_metadata())["x-request-id"] == "job-42"


async def test_rlfleet_error_arrives_with_code_and_rich_details(chan):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chan.unary_unary(method("Echo"))(
            b"invalid", metadata=(("x-request-id", "rid-1"),), timeout=2
        )
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "num_envs must be > 0"
    status = rpc_status.from_call(err)
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad_request_fields(status) == ["num_envs"]
    assert dict(err.trailing_metadata())["x-request-id"] == "rid-1"
    back = from_rpc_error(err)
    assert (type(back), back.field, back.request_id) == (InvalidArgument, "num_envs", "rid-1")


async def test_plain_exception_arrives_as_internal_naming_the_type(chan):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chan.unary_unary(method("Echo"))(b"value-error", timeout=2)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "ValueError: negative length"
    status = rpc_status.from_call(info.value)
    assert status is not None and bad_request_fields(status) == []


# Field 1 (service, length-delimited) claiming 127 bytes that never come: protobuf cannot parse it.
GARBAGE = b"\x0a\x7fabc"


async def test_undecodable_unary_request_is_invalid_argument_and_the_server_keeps_serving(chan):
    before = health_pb2.HealthCheckRequest(service="cart").SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chan.unary_unary(method("Decode"))(GARBAGE, timeout=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # grpc alone: UNKNOWN
    assert "cannot be decoded" in info.value.details()
    assert type(from_rpc_error(info.value)) is InvalidArgument
    assert len(dict(info.value.trailing_metadata())["x-request-id"]) == 32
    code = {"method": method("Decode"), "code": "INVALID_ARGUMENT"}
    assert REGISTRY.get_sample_value("rlfleet_grpc_server_handled_total", code) >= 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chan.unary_unary("/grpc.health.v1.Health/Check")(GARBAGE, timeout=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # services' own handlers too
    assert await chan.unary_unary(method("Decode"))(before, timeout=2) == b"cart"


async def test_undecodable_streamed_requests_are_invalid_argument(chan):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in chan.unary_stream(method("DecodeCount"))(GARBAGE, timeout=2):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    good = health_pb2.HealthCheckRequest(service="a").SerializeToString()
    call = chan.stream_stream(method("DecodeChat"))(iter([good, GARBAGE]), timeout=2)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in call:
            got.append(response)
    assert got == [b"a"]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be decoded" in info.value.details()
    assert [r async for r in chan.unary_stream(method("DecodeCount"))(good, timeout=2)] == [b"a"]


async def test_handler_abort_is_left_alone(chan):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chan.unary_unary(method("Echo"))(b"abort", timeout=2)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == "handler aborted itself"
    assert len(dict(info.value.trailing_metadata())["x-request-id"]) == 32


@pytest.mark.parametrize("name", ["Count", "CountWriter"])
async def test_unary_stream_ok_and_error(chan, name):
    ok = chan.unary_stream(method(name))(b"3", metadata=(("x-request-id", "s-1"),), timeout=2)
    assert [r async for r in ok][-1] == b"3"
    assert dict(await ok.trailing_metadata())["x-request-id"] == "s-1"
    call = chan.unary_stream(method(name))(b"not-found", timeout=2)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in call:
            got.append(response)
    assert got and got[0] == b"1"  # answers sent before the error still arrive
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert type(from_rpc_error(info.value)) is NotFound


async def test_request_id_of_the_current_call_is_forwarded_on_every_call_kind(chan):
    token = request_id_var.set("outer-7")  # as inside a handler that calls another service
    try:
        assert await chan.unary_unary(method("Echo"))(b"request-id", timeout=2) == b"outer-7"
        unary_stream = chan.unary_stream(method("Count"))(b"request-id", timeout=2)
        assert [r async for r in unary_stream][-1] == b"outer-7"
        joined = await chan.stream_unary(method("Join"))(iter([b"request-id"]), timeout=2)
        assert joined == b"outer-7"
        chat = chan.stream_stream(method("Chat"))(iter([b"request-id"]), timeout=2)
        assert [r async for r in chat] == [b"outer-7"]
    finally:
        request_id_var.reset(token)


async def test_stream_unary_ok_and_error(chan):
    join = chan.stream_unary(method("Join"))
    assert await join(iter([b"a", b"b"]), timeout=2) == b"a+b"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await join(iter([b"a", b"invalid"]), timeout=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(rpc_status.from_call(info.value)) == ["num_envs"]


async def test_stream_stream_ok_and_error(chan):
    call = chan.stream_stream(method("Chat"))(timeout=2)
    await call.write(b"x")
    assert await call.read() == b"x"
    await call.write(b"value-error")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "ValueError: negative length"
    assert rpc_status.from_call(info.value).message == "ValueError: negative length"


async def test_message_over_the_limit_is_resource_exhausted(chan):
    big = b"x" * (LIMIT + 1024)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chan.unary_unary(method("Echo"))(big, timeout=2)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Just under the limit passes both ends (server and channel share the setting).
    ok = b"y" * (LIMIT - 1024)
    assert await chan.unary_unary(method("Echo"))(ok, timeout=2) == ok


async def test_channel_refuses_to_send_over_its_own_limit(served):
    async with channel(served.address, max_message_bytes=1024) as small:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await small.unary_unary(method("Echo"))(b"z" * 4096, timeout=2)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_unavailable_is_retried_by_the_channel(chan):
    key = b"flaky-%d" % time.monotonic_ns()
    assert await chan.unary_unary(method("Echo"))(key, timeout=5) == b"attempt 3"


async def test_server_metrics_count_calls_by_code(chan):
    def handled(code: str) -> float:
        labels = {"method": method("Echo"), "code": code}
        return REGISTRY.get_sample_value("rlfleet_grpc_server_handled_total", labels) or 0.0

    ok, notfound = handled("OK"), handled("NOT_FOUND")
    await chan.unary_unary(method("Echo"))(b"hi", timeout=2)
    with pytest.raises(grpc.aio.AioRpcError):
        await chan.unary_unary(method("Echo"))(b"not-found", timeout=2)
    assert (handled("OK"), handled("NOT_FOUND")) == (ok + 1, notfound + 1)
    count = REGISTRY.get_sample_value(
        "rlfleet_grpc_server_handling_seconds_count", {"method": method("Echo")}
    )
    assert count is not None and count >= 2


async def test_deadline_counts_as_deadline_exceeded_on_the_server(chan):
    labels = {"method": method("Echo"), "code": "DEADLINE_EXCEEDED"}
    before = REGISTRY.get_sample_value("rlfleet_grpc_server_handled_total", labels) or 0.0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chan.unary_unary(method("Echo"))(b"sleep:1", timeout=0.1)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(50):  # the server cancels its handler a moment after the client gave up
        if REGISTRY.get_sample_value("rlfleet_grpc_server_handled_total", labels) == before + 1:
            break
        await asyncio.sleep(0.01)
    assert REGISTRY.get_sample_value("rlfleet_grpc_server_handled_total", labels) == before + 1


async def test_graceful_stop_lets_a_call_in_flight_finish():
    server = new_server(grace_s=3.0)
    await server.start()
    server.set_serving()
    async with channel(server.address) as ch:
        echo_call = ch.unary_unary(method("Echo"))
        in_flight = asyncio.ensure_future(echo_call(b"sleep:0.4", timeout=3))
        await asyncio.sleep(0.1)  # the call has reached the handler
        started = time.monotonic()
        await server.stop()
        assert await in_flight == b"slept"
        assert time.monotonic() - started < 2.5
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await echo_call(b"late", timeout=0.5)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


SERVER_SCRIPT = textwrap.dedent(
    """
    import asyncio
    from services.server import GrpcServer, install_signal_handlers

    async def main():
        stop = asyncio.Event()
        install_signal_handlers(stop)
        server = GrpcServer("sig", grace_s=1.0)
        async with server:
            server.set_serving()
            print(server.port, flush=True)
            await server.serve_until(stop)
        print("stopped", flush=True)

    asyncio.run(main())
    """
)


def test_sigterm_stops_the_server_gracefully(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SERVER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        wait_for_health(f"127.0.0.1:{port}", 5.0)
        proc.send_signal(15)
        out, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.strip() == "stopped"
