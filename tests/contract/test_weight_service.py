"""WeightService (learner/weights.py) and fetch_weights (clients/learner.py) over real gRPC.

Each test starts a GrpcServer on a loopback port in this process. Faults are injected by a
wrapper servicer in front of the real one: it drops a stream with UNAVAILABLE after N chunks, or
flips a byte in a chunk (with or without fixing the chunk's CRC), and counts the bytes it served
so the tests can tell a resume from a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import zlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import torch

from clients.learner import fetch_weights
from common.weights import Chunk, WeightsCorrupted, encode_chunk, parse_chunk
from learner.weights import (
    MIN_CHUNK_BYTES,
    SERVICE_NAME,
    WeightServicer,
    WeightStore,
    add_weight_service,
    announce,
)
from rlfleet.bus.v1 import events_pb2
from rlfleet.learner.v1 import weights_pb2, weights_pb2_grpc
from services.bus import MSG_ID_HEADER, Bus, events_subject
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    from_rpc_error,
)
from services.server import GrpcServer, channel

MiB = 1 << 20


def policy() -> torch.nn.Module:
    """A small model with every kind of state: fp32 and bf16 weights, int64 scalar buffers."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 64),
        torch.nn.BatchNorm1d(64),  # running stats + num_batches_tracked (int64 scalar)
        torch.nn.Tanh(),
        torch.nn.Linear(64, 2).to(torch.bfloat16),
    )


def big_state() -> dict[str, torch.Tensor]:
    """Several 2 MiB chunks, a tensor above 2 MiB, a zero-size one: about 5 MiB in all."""
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(640, 1024, generator=g),  # 2.5 MiB
        "model.layers.0.mlp.weight": torch.randn(512, 1024, generator=g).to(torch.bfloat16),
        "model.empty": torch.empty(0),
        "lm_head.weight": torch.randn(512, 1024, generator=g),  # 2 MiB: one chunk exactly
        "model.norm.weight": torch.ones(1024),
    }


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        if t.numel():
            assert torch.equal(
                g.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)
            ), name


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


@contextlib.asynccontextmanager
async def serving(servicer: object) -> AsyncIterator[str]:
    server = GrpcServer("weights-test", grace_s=0.5)
    server.add_service(add_weight_service, servicer, SERVICE_NAME)
    async with server:
        server.set_serving()
        yield server.address


class FaultyServicer:
    """The real WeightServicer behind a wire that can drop streams or damage chunks.

    ``fail_after``: end the next stream with UNAVAILABLE after that many chunks (once).
    ``damage``: chunks for which it returns True get one byte flipped; with ``fix_crc`` the CRC
    is recomputed, so only the tensor's SHA-256 can notice. ``damage_times`` bounds how often.
    """

    def __init__(
        self,
        inner: WeightServicer,
        *,
        fail_after: int | None = None,
        damage: Callable[[Chunk], bool] | None = None,
        fix_crc: bool = False,
        damage_times: int = 10**9,
    ) -> None:
        self.inner = inner
        self.fail_after = fail_after
        self.damage = damage
        self.fix_crc = fix_crc
        self.damage_times = damage_times
        self.starts: list[int] = []  # start_offset of every FetchWeights request
        self.bytes_served = 0

    async def GetManifest(self, request, context):
        return await self.inner.GetManifest(request, context)

    async def ListVersions(self, request, context):
        return await self.inner.ListVersions(request, context)

    async def FetchWeights(self, request, context):
        self.starts.append(request.start_offset)
        sent = 0
        async for raw in self.inner.FetchWeights(request, context):
            if self.fail_after is not None and sent == self.fail_after:
                self.fail_after = None
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: connection dropped")
            chunk = parse_chunk(raw)
            if self.damage is not None and self.damage_times > 0 and self.damage(chunk):
                self.damage_times -= 1
                raw = self._flip(chunk)
            self.bytes_served += len(chunk.data)
            sent += 1
            yield raw

    def _flip(self, chunk: Chunk) -> bytes:
        data = bytearray(chunk.data)
        data[len(data) // 2] ^= 0x40
        crc = zlib.crc32(data) if self.fix_crc else chunk.crc32
        return encode_chunk(
            chunk.offset, data, chunk.tensor_index, chunk.tensor_name, crc, chunk.last
        )


# --------------------------------------------------------------------------- happy paths


async def test_publish_then_fetch_is_bitwise_equal() -> None:
    model = policy()
    store = WeightStore("demo", base_model="test/policy")
    manifest = store.publish(model.state_dict())
    assert manifest.version == 0 and manifest.base_model == "test/policy"
    async with serving(WeightServicer(store)) as address:
        got_manifest, tensors = await fetch_weights(address, expected_digest=manifest.digest)
    assert got_manifest == manifest
    assert_bitwise_equal(tensors, dict(model.state_dict()))
    policy().load_state_dict(tensors)  # what an actor does with them


async def test_big_version_and_list_versions() -> None:
    state = big_state()
    store = WeightStore("demo", keep=3)
    for _ in range(2):
        store.publish(state)
    async with serving(WeightServicer(store)) as address:
        manifest, tensors = await fetch_weights(address, 1)
        async with channel(address) as chan:
            listed = await weights_pb2_grpc.WeightServiceStub(chan).ListVersions(
                weights_pb2.ListVersionsRequest(), timeout=5
            )
    assert_bitwise_equal(tensors, state)
    assert listed.run == "demo" and [v.version for v in listed.versions] == [0, 1]
    assert listed.versions[1].digest == manifest.digest
    assert listed.versions[1].total_bytes == manifest.total_bytes
    assert listed.versions[1].num_tensors == len(state)


async def test_older_version_after_newer_published() -> None:
    model = policy()
    store = WeightStore("demo", keep=2, start_version=5)  # a restarted learner goes on at 5
    before = snapshot(model.state_dict())
    first = store.publish(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training mutates the model after publish returned
    second = store.publish(model.state_dict())
    assert (first.version, second.version, store.next_version) == (5, 6, 7)
    async with serving(WeightServicer(store)) as address:
        old_manifest, old = await fetch_weights(address, 5)
        new_manifest, new = await fetch_weights(address)  # latest
    assert (old_manifest.version, new_manifest.version) == (5, 6)
    assert_bitwise_equal(old, before)
    assert_bitwise_equal(new, dict(model.state_dict()))
    assert old_manifest.digest != new_manifest.digest


async def test_raw_protobuf_client_reads_ranges() -> None:
    """A client using plain generated stubs (another language, say) sees normal messages."""
    state = big_state()
    store = WeightStore("demo")
    manifest = store.publish(state)
    payload = store.get(0).payload
    start, end = MiB + 5, 4 * MiB + 7
    async with serving(WeightServicer(store)) as address, channel(address) as chan:
        stub = weights_pb2_grpc.WeightServiceStub(chan)
        request = weights_pb2.FetchWeightsRequest(
            version=0, start_offset=start, end_offset=end, max_chunk_bytes=300_000
        )
        chunks = [c async for c in stub.FetchWeights(request, timeout=10)]
    assert chunks[0].offset == start and chunks[-1].last and not any(c.last for c in chunks[:-1])
    assert b"".join(c.data for c in chunks) == bytes(payload[start:end])
    assert all(len(c.data) <= 300_000 and c.crc32 == zlib.crc32(c.data) for c in chunks)
    names = {c.tensor_name for c in chunks}
    assert names == {t.name for t in manifest.tensors[:4] if t.nbytes}  # 2.5 + 1 + 2 MiB


# --------------------------------------------------------------------------- errors


async def test_evicted_version_is_not_found_naming_the_kept_ones() -> None:
    store = WeightStore("demo", keep=2)
    for _ in range(3):
        store.publish(policy().state_dict())
    async with serving(WeightServicer(store)) as address:
        with pytest.raises(NotFound, match=r"version 0 is not kept; kept versions: \[1, 2\]"):
            await fetch_weights(address, 0)
        async with channel(address) as chan:
            stub = weights_pb2_grpc.WeightServiceStub(chan)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.FetchWeights(weights_pb2.FetchWeightsRequest(version=0)):
                    pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_expected_digest_mismatch_is_failed_precondition() -> None:
    store = WeightStore("demo")
    manifest = store.publish(policy().state_dict())
    async with serving(WeightServicer(store)) as address:
        with pytest.raises(FailedPrecondition, match="differs from the expected"):
            await fetch_weights(address, 0, expected_digest="0" * 64)
        async with channel(address) as chan:  # the server checks too
            stub = weights_pb2_grpc.WeightServiceStub(chan)
            request = weights_pb2.FetchWeightsRequest(version=0, expected_digest="f" * 64)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.FetchWeights(request, timeout=5):
                    pass
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert manifest.digest in info.value.details()


async def test_bad_ranges_are_invalid_argument() -> None:
    store = WeightStore("demo")
    manifest = store.publish(policy().state_dict())
    bad = [
        weights_pb2.FetchWeightsRequest(version=0, start_offset=manifest.total_bytes + 1),
        weights_pb2.FetchWeightsRequest(version=0, start_offset=10, end_offset=5),
        weights_pb2.FetchWeightsRequest(version=0, max_chunk_bytes=(2 * MiB) + 1),
    ]
    async with serving(WeightServicer(store)) as address, channel(address) as chan:
        stub = weights_pb2_grpc.WeightServiceStub(chan)
        for request in bad:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.FetchWeights(request, timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request


@pytest.mark.parametrize("size", [1, 4096, MIN_CHUNK_BYTES - 1])
async def test_tiny_chunks_are_invalid_argument_and_the_minimum_is_served(size: int) -> None:
    """max_chunk_bytes=1 used to stream one message per byte (36,620 for a 36 KB policy)."""
    store = WeightStore("demo")
    store.publish(policy().state_dict())
    payload = bytes(store.get(0).payload)
    async with serving(WeightServicer(store)) as address, channel(address) as chan:
        stub = weights_pb2_grpc.WeightServiceStub(chan)
        request = weights_pb2.FetchWeightsRequest(version=0, max_chunk_bytes=size)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.FetchWeights(request, timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(MIN_CHUNK_BYTES) in info.value.details()
        assert type(from_rpc_error(info.value)) is InvalidArgument
        request = weights_pb2.FetchWeightsRequest(version=0, max_chunk_bytes=MIN_CHUNK_BYTES)
        chunks = [c async for c in stub.FetchWeights(request, timeout=5)]  # still serving
    assert all(len(c.data) <= MIN_CHUNK_BYTES for c in chunks)
    assert b"".join(c.data for c in chunks) == payload


async def test_latest_before_any_publish_is_unavailable() -> None:
    async with serving(WeightServicer(WeightStore("demo"))) as address:
        with pytest.raises(Unavailable, match="no weight version published yet"):
            await fetch_weights(address)


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("resume", [True, False])
async def test_dropped_stream_resumes_from_the_verified_offset(resume: bool) -> None:
    state = big_state()
    store = WeightStore("demo")
    manifest = store.publish(state)
    faulty = FaultyServicer(WeightServicer(store), fail_after=2)
    async with serving(faulty) as address:
        _, tensors = await fetch_weights(address, 0, resume=resume, backoff_s=0.01)
    assert_bitwise_equal(tensors, state)
    first_two = 2 * MiB + MiB // 2  # 2 MiB + the rest of the 2.5 MiB tensor
    if resume:
        assert faulty.starts == [0, first_two]
        assert faulty.bytes_served == manifest.total_bytes  # not one byte twice
    else:
        assert faulty.starts == [0, 0]
        assert faulty.bytes_served == manifest.total_bytes + first_two


async def test_corrupted_chunk_names_the_tensor() -> None:
    state = big_state()
    store = WeightStore("demo")
    store.publish(state)
    target = "model.layers.0.mlp.weight"
    faulty = FaultyServicer(WeightServicer(store), damage=lambda c: c.tensor_name == target)
    async with serving(faulty) as address:
        with pytest.raises(WeightsCorrupted, match=f"CRC-32 mismatch in tensor '{target}'") as info:
            await fetch_weights(address, 0, max_retries=2, backoff_s=0.01)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert len(faulty.starts) == 3  # the first try and two resumes, all from the same offset
    assert len(set(faulty.starts[1:])) == 1 and faulty.starts[1] > 0


async def test_corrupted_chunk_once_is_fetched_again() -> None:
    state = big_state()
    store = WeightStore("demo")
    store.publish(state)
    faulty = FaultyServicer(WeightServicer(store), damage=lambda c: c.offset > 0, damage_times=1)
    async with serving(faulty) as address:
        _, tensors = await fetch_weights(address, 0, backoff_s=0.01)
    assert_bitwise_equal(tensors, state)
    assert len(faulty.starts) == 2


async def test_bad_bytes_with_good_crc_fail_the_tensor_sha256() -> None:
    store = WeightStore("demo")
    store.publish(big_state())
    target = "lm_head.weight"
    faulty = FaultyServicer(
        WeightServicer(store), damage=lambda c: c.tensor_name == target, fix_crc=True
    )
    async with serving(faulty) as address:
        with pytest.raises(WeightsCorrupted, match=f"SHA-256 mismatch for tensor '{target}'"):
            await fetch_weights(address, 0, backoff_s=0.01)
    assert len(faulty.starts) == 1  # the server's bytes are wrong: retrying cannot help


async def test_streamed_version_is_kept_until_its_stream_ends() -> None:
    store = WeightStore("demo", keep=1)
    store.publish(big_state())
    async with serving(WeightServicer(store)) as address, channel(address) as chan:
        stub = weights_pb2_grpc.WeightServiceStub(chan)
        call = stub.FetchWeights(weights_pb2.FetchWeightsRequest(version=0), timeout=10)
        first = await call.read()  # the stream is open and pins version 0
        assert first.offset == 0
        store.publish(big_state())
        assert store.versions() == [0, 1]  # past `keep`, but being streamed
        rest = [c async for c in call]
        assert rest[-1].last
        for _ in range(50):  # the handler's `finally` runs just after the last chunk
            if store.versions() == [1]:
                break
            await asyncio.sleep(0.01)
        assert store.versions() == [1]


async def test_shutdown_ends_streams_with_unavailable() -> None:
    store = WeightStore("demo")
    store.publish(policy().state_dict())
    servicer = WeightServicer(store)
    servicer.begin_shutdown()
    async with serving(servicer) as address:
        with pytest.raises(Unavailable, match="shutting down"):
            await fetch_weights(address, 0, max_retries=0)


async def test_evicted_buffer_is_reused_without_leaking_into_kept_versions() -> None:
    state = big_state()
    store = WeightStore("demo", keep=1)
    store.publish(state)
    first_buffer = store.get(0).buffer
    assert first_buffer is not None
    snapshots = []
    for _ in range(2):
        with torch.no_grad():
            state["lm_head.weight"].add_(1.0)
        snapshots.append(snapshot(state))
        store.publish(state)
    latest = store.get(2)
    assert latest.buffer is not None and latest.buffer.data_ptr() == first_buffer.data_ptr()
    async with serving(WeightServicer(store)) as address:
        _, tensors = await fetch_weights(address, 2)
    assert_bitwise_equal(tensors, snapshots[-1])


async def test_publishing_from_a_thread_while_serving() -> None:
    """The learner publishes from its training thread while the loop serves fetches."""
    model = policy()
    store = WeightStore("demo", keep=2)
    store.publish(model.state_dict())
    published: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}

    def train() -> None:
        for _ in range(8):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            state = snapshot(model.state_dict())
            manifest = store.publish(model.state_dict())
            published[manifest.version] = (manifest.digest, state)

    async with serving(WeightServicer(store)) as address, channel(address) as chan:
        trainer = asyncio.create_task(asyncio.to_thread(train))
        fetched = []
        while not trainer.done() or not fetched:
            with contextlib.suppress(NotFound):  # evicted between GetManifest and the stream
                fetched.append(await fetch_weights(chan))
        await trainer
    for manifest, tensors in fetched:
        if manifest.version in published:  # not the initial version 0
            digest, state = published[manifest.version]
            assert manifest.digest == digest
            assert_bitwise_equal(tensors, state)


# --------------------------------------------------------------------------- announcement


async def test_announce_publishes_weights_published(nats_url: str) -> None:
    run = f"w{uuid.uuid4().hex[:8]}"
    store = WeightStore(run)
    manifest = store.publish(policy().state_dict())
    async with Bus.connect(nats_url, name="weights-test") as bus:
        sub = await bus.subscribe(events_subject(run, "weights"), events_pb2.WeightsPublished)
        async with sub:
            sent = await announce(bus, run, manifest, "127.0.0.1:5001")
            delivery = await asyncio.wait_for(sub.__anext__(), 5)
    event = delivery.message
    assert event == sent
    assert (event.run, event.version, event.manifest_digest, event.endpoint) == (
        run,
        0,
        manifest.digest,
        "127.0.0.1:5001",
    )
    assert event.total_bytes == manifest.total_bytes
    assert event.num_tensors == len(manifest.tensors) and event.HasField("time")
    assert delivery.headers[MSG_ID_HEADER].startswith(f"{run}/weights/0/")
