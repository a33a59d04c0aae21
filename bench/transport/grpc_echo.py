"""The floor of a lock-step Python gRPC stream on this machine: a bidi echo of raw bytes.

A `grpc.aio` server in its own process answers each request on one stream with a reply of the
size the request asks for (its first 8 bytes, little-endian), through identity serializers: no
protobuf, no interceptors, no work. `round_trip_us` is what one request/reply costs then, which
is what no EnvService step over gRPC can undercut (bench/transport/env_throughput.py reports the
ceiling it puts on the remote/local ratio).

    python -m bench.transport.grpc_echo serve --port P   # what env_throughput starts
    python -m bench.transport.grpc_echo shapes           # every API shape: is any one faster?

`shapes` asks whether another way of using Python gRPC would lift that floor: a `grpc.aio` and
a synchronous (thread pool) server, each called with a bidi stream and with unary calls from
`grpc.aio` and from the synchronous API (blocking, the stream fed from a queue), interleaved
rounds, the message sizes of a 64-env CartPole step by default. It also counts the CPU time each
end spends per round trip of the `grpc.aio` stream (both processes, all their threads): what
overlapping messages (double-buffering) could at best hide is the wait, never that CPU. It
prints the median round trip of each and writes bench/results/grpc_echo_shapes.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from bench._shared.results import RESULTS_DIR, ROOT, results_json

_METHOD = "/rlfleet.bench.Echo/Stream"
_UNARY = "/rlfleet.bench.Echo/Call"
_SIZE = struct.Struct("<Q")
SHAPES_RESULT = RESULTS_DIR / "grpc_echo_shapes.json"


def _identity(data: bytes) -> bytes:
    return data


async def _echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
    while (request := await context.read()) is not grpc.aio.EOF:
        (size,) = _SIZE.unpack_from(request)
        await context.write(bytes(size))


def _reply(request: bytes, context: object = None) -> bytes:
    (size,) = _SIZE.unpack_from(request)
    return bytes(size)


async def _aio_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return _reply(request)


def _sync_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    for request in requests:
        yield _reply(request)


def _handlers(stream: object, unary: object) -> list[grpc.GenericRpcHandler]:
    service = _METHOD.rsplit("/", 1)[0].lstrip("/")
    return [
        grpc.method_handlers_generic_handler(
            service,
            {
                _METHOD.rsplit("/", 1)[1]: grpc.stream_stream_rpc_method_handler(
                    stream, request_deserializer=_identity, response_serializer=_identity
                ),
                _UNARY.rsplit("/", 1)[1]: grpc.unary_unary_rpc_method_handler(
                    unary, request_deserializer=_identity, response_serializer=_identity
                ),
            },
        )
    ]


async def serve(port: int) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(_handlers(_echo, _aio_unary))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int) -> None:
    """The same echo on grpcio's synchronous server (a thread pool)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(_handlers(_sync_stream, _reply))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


async def round_trip_us(
    address: str, request_bytes: int, reply_bytes: int, count: int = 1000, warmup: int = 100
) -> float:
    """Median microseconds of one request/reply of these sizes on one stream."""
    times = await _stream_round_trips(address, request_bytes, reply_bytes, count, warmup)
    return float(np.median(times) * 1e6)


async def _stream_round_trips(
    address: str,
    request_bytes: int,
    reply_bytes: int,
    count: int,
    warmup: int,
    measured: Callable[[], object] = lambda: None,
) -> list[float]:
    """Seconds of each of `count` request/reply round trips on one `grpc.aio` stream, after
    `warmup` ones; `measured()` is called right before the first timed one and right after
    the last."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stream = channel.stream_stream(
            _METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        call = stream()
        request = _SIZE.pack(reply_bytes) + bytes(max(request_bytes - _SIZE.size, 0))
        times = []
        for i in range(count + warmup):
            if i == warmup:
                measured()
            started = time.perf_counter()
            await call.write(request)
            await call.read()
            times.append(time.perf_counter() - started)
        measured()
        await call.done_writing()
    return times[warmup:]


async def stream_cpu_us(
    address: str, server_pid: int, request_bytes: int, reply_bytes: int, count: int
) -> dict[str, float]:
    """CPU microseconds that this process and the server (all threads, user + system) spend
    per round trip of one `grpc.aio` stream, and the wall time per round trip."""
    import psutil

    server = psutil.Process(server_pid)
    marks: list[tuple[float, float, float]] = []

    def mark() -> None:
        mine, theirs = psutil.Process().cpu_times(), server.cpu_times()
        marks.append((mine.user + mine.system, theirs.user + theirs.system, time.perf_counter()))

    await _stream_round_trips(address, request_bytes, reply_bytes, count, 100, mark)
    (client_0, server_0, wall_0), (client_1, server_1, wall_1) = marks
    return {
        "client_cpu_us": (client_1 - client_0) / count * 1e6,
        "server_cpu_us": (server_1 - server_0) / count * 1e6,
        "wall_us": (wall_1 - wall_0) / count * 1e6,
    }


def _median_us(times: list[float], warmup: int) -> float:
    return float(np.median(times[warmup:]) * 1e6)


async def _aio_unary_us(address: str, request: bytes, count: int, warmup: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        call = channel.unary_unary(
            _UNARY, request_serializer=_identity, response_deserializer=_identity
        )
        times = []
        for _ in range(count + warmup):
            started = time.perf_counter()
            await call(request)
            times.append(time.perf_counter() - started)
    return _median_us(times, warmup)


def _sync_us(address: str, request: bytes, count: int, warmup: int) -> dict[str, float]:
    """Synchronous client: unary calls, and a stream whose requests a queue feeds."""
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.unary_unary(
            _UNARY, request_serializer=_identity, response_deserializer=_identity
        )
        times = []
        for _ in range(count + warmup):
            started = time.perf_counter()
            call(request)
            times.append(time.perf_counter() - started)
        unary = _median_us(times, warmup)
        requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        stream = channel.stream_stream(
            _METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        replies = stream(iter(requests.get, None))
        times = []
        for _ in range(count + warmup):
            started = time.perf_counter()
            requests.put(request)
            next(replies)
            times.append(time.perf_counter() - started)
        requests.put(None)
    return {"sync unary": unary, "sync stream": _median_us(times, warmup)}


def shapes(request_bytes: int, reply_bytes: int, rounds: int, count: int) -> dict[str, object]:
    """Median round trips (us) of each client shape against each server, over `rounds`
    interleaved rounds (the median of the rounds' medians)."""
    from services.ports import free_ports

    ports = free_ports(2)
    self_cmd = [sys.executable, "-m", __spec__.name]
    servers = {
        "aio": subprocess.Popen([*self_cmd, "serve", "--port", str(ports[0])], cwd=ROOT),
        "sync": subprocess.Popen([*self_cmd, "serve-sync", "--port", str(ports[1])], cwd=ROOT),
    }
    request = _SIZE.pack(reply_bytes) + bytes(max(request_bytes - _SIZE.size, 0))
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # the aio stream's CPU per round trip, each end
    try:
        for _ in range(rounds):
            for (server, _process), port in zip(servers.items(), ports, strict=True):
                address = f"127.0.0.1:{port}"
                got = {
                    "aio stream": asyncio.run(
                        round_trip_us(address, request_bytes, reply_bytes, count, 100)
                    ),
                    "aio unary": asyncio.run(_aio_unary_us(address, request, count, 100)),
                    **_sync_us(address, request, count, 100),
                }
                for client, us in got.items():
                    samples.setdefault(f"{server} server, {client}", []).append(us)
            aio_cpu = stream_cpu_us(
                f"127.0.0.1:{ports[0]}", servers["aio"].pid, request_bytes, reply_bytes, count
            )
            for key, us in asyncio.run(aio_cpu).items():
                cpu.setdefault(key, []).append(us)
    finally:
        for process in servers.values():
            process.terminate()
            process.wait(timeout=30)
    medians = {k: float(np.median(v)) for k, v in samples.items()}
    return {
        "request_bytes": request_bytes,
        "reply_bytes": reply_bytes,
        "rounds": rounds,
        "calls_per_round": count,
        "median_round_trip_us": medians,
        "samples_us": samples,
        "fastest": min(medians, key=lambda k: medians[k]),
        # CPU time per round trip of the aio stream on the aio server (medians of the rounds):
        # the client's and the server's, each process with all its threads.
        "aio_stream_cpu_us": {k: float(np.median(v)) for k, v in cpu.items()},
        "aio_stream_cpu_samples_us": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve", "serve-sync", "shapes"])
    parser.add_argument("--port", type=int, help="serve, serve-sync: the port")
    # 64 CartPole envs' step (env_throughput._message_bytes): actions in, observations out.
    parser.add_argument("--request-bytes", type=int, default=64 * 8 + 64)
    parser.add_argument("--reply-bytes", type=int, default=64 * (16 + 4 + 2) + 128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=1000, help="calls per shape and round")
    parser.add_argument("--out", type=Path, default=SHAPES_RESULT)
    args = parser.parse_args(argv)
    if args.command == "serve":
        asyncio.run(serve(args.port))
    elif args.command == "serve-sync":
        serve_sync(args.port)
    else:
        result = shapes(args.request_bytes, args.reply_bytes, args.rounds, args.count)
        medians: dict[str, float] = result["median_round_trip_us"]  # type: ignore[assignment]
        print(f"round trip of a {args.request_bytes} B request / {args.reply_bytes} B reply:")
        for name, us in sorted(medians.items(), key=lambda kv: kv[1]):
            print(f"  {name:<28} {us:8.0f} us")
        cpu: dict[str, float] = result["aio_stream_cpu_us"]  # type: ignore[assignment]
        print(
            f"CPU per round trip of the aio stream: client {cpu['client_cpu_us']:.0f} us, "
            f"server {cpu['server_cpu_us']:.0f} us (wall {cpu['wall_us']:.0f} us)"
        )
        result.update(time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), cpus=os.cpu_count())
        result["grpcio"] = grpc.__version__
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(results_json(result))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
