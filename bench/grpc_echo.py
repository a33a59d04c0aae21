"""The floor of a lock-step Python gRPC stream on this machine: a bidi echo of raw bytes.

A `grpc.aio` server in its own process answers each request on one stream with a reply of the
size the request asks for (its first 8 bytes, little-endian), through identity serializers: no
protobuf, no interceptors, no work. `round_trip_us` is what one request/reply costs then, which
is what no EnvService step over gRPC can undercut (bench/env_throughput.py reports the ceiling it
puts on the remote/local ratio).

    python bench/grpc_echo.py serve --port P      # what env_throughput.py starts
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

_METHOD = "/rlfleet.bench.Echo/Stream"
_SIZE = struct.Struct("<Q")


def _identity(data: bytes) -> bytes:
    return data


async def _echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
    while (request := await context.read()) is not grpc.aio.EOF:
        (size,) = _SIZE.unpack_from(request)
        await context.write(bytes(size))


async def serve(port: int) -> None:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        _echo, request_deserializer=_identity, response_serializer=_identity
    )
    service, method = _METHOD.rsplit("/", 1)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(service.lstrip("/"), {method: handler})]
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def round_trip_us(
    address: str, request_bytes: int, reply_bytes: int, count: int = 1000, warmup: int = 100
) -> float:
    """Median microseconds of one request/reply of these sizes on one stream."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stream = channel.stream_stream(
            _METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        call = stream()
        request = _SIZE.pack(reply_bytes) + bytes(max(request_bytes - _SIZE.size, 0))
        times = []
        for _ in range(count + warmup):
            started = time.perf_counter()
            await call.write(request)
            await call.read()
            times.append(time.perf_counter() - started)
        await call.done_writing()
    return float(np.median(times[warmup:]) * 1e6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
