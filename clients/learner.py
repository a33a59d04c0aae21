"""The learner's client module: what other services import to talk to the learner.

``fetch_weights`` pulls one weight version from ``WeightService`` (manifest first, then the
chunked byte stream, verified chunk by chunk and tensor by tensor, resumed from the first
unverified byte when a stream drops). ``WeightFollower`` is the consumer side of the learner's
versions (WeightService + ``WeightsPublished`` events), shared by game actors, game links and the
LM sampler. The format itself (manifest, digest, chunk wire bytes) is
shared with the serving side in ``common.weights``. Only the contracts, ``common`` and the
runtime are imported here, never the learner's own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from common.weights.format import (
    INLINE_BYTES,
    MAX_CHUNK_BYTES,
    POPULATE_BYTES,
    WeightsCorrupted,
    check_manifest,
    new_buffer,
    tensors_from_buffer,
)
from common.weights.wire import Chunk, parse_chunk
from rlfleet.bus.v1 import events_pb2
from rlfleet.learner.v1 import weights_pb2
from services.bus import Bus, events_subject
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    RlfleetError,
    Unavailable,
    from_rpc_error,
)
from services.grpc_names import method_path
from services.server import channel as make_channel

if TYPE_CHECKING:
    import torch

FETCH_METHOD = method_path(weights_pb2, "WeightService", "FetchWeights")
_MANIFEST_METHOD = method_path(weights_pb2, "WeightService", "GetManifest")


# --------------------------------------------------------------------------- client


class _Retry(Exception):
    """A stream attempt failed in a way that resuming (or restarting) may fix."""

    def __init__(self, error: RlfleetError) -> None:
        super().__init__(str(error))
        self.error = error


class _Receiver:
    """Puts one version's chunks in place and verifies them.

    ``verified`` is the resume point: every byte before it is in ``buffer`` and passed its chunk
    CRC; every tensor ending at or before it also passed its SHA-256. ``expected`` runs ahead of
    ``verified`` by the chunk being checked in the worker thread.
    """

    def __init__(self, manifest: weights_pb2.WeightManifest) -> None:
        self.manifest = manifest
        self.buffer: torch.Tensor | None = None  # see allocate()
        self.array: np.ndarray | None = None  # numpy's copy releases the GIL, memoryview's not
        self.verified = 0
        self.expected = 0
        self._hashers: dict[int, Any] = {}  # SHA-256 state of tensors in progress
        self._hash_thread = ThreadPoolExecutor(1, thread_name_prefix="weights-sha")

    async def allocate(self) -> None:
        """Make the buffer; a big one in a thread (pre-faulting takes a while) while the first
        stream is already starting, so the allocation overlaps the first chunks' transfer."""
        if self.buffer is not None:
            return
        total = self.manifest.total_bytes
        if total < POPULATE_BYTES:
            buffer = new_buffer(total)
        else:
            buffer = await asyncio.to_thread(new_buffer, total)
        self.array = buffer.numpy()
        self.buffer = buffer

    def restart(self, offset: int) -> None:
        """Continue from ``offset`` (``verified`` to resume, 0 to start over)."""
        if offset == 0:
            self._hashers.clear()
        self.verified = self.expected = offset

    def check_order(self, chunk: Chunk) -> None:
        """Structural checks, on the loop thread before the chunk is handed to the worker."""
        t = (
            self.manifest.tensors[chunk.tensor_index]
            if chunk.tensor_index < len(self.manifest.tensors)
            else None
        )
        size = len(chunk.data)
        problem = None
        if chunk.offset != self.expected:
            problem = f"chunk at offset {chunk.offset}, expected {self.expected}"
        elif t is None or t.name != chunk.tensor_name:
            problem = f"chunk names tensor {chunk.tensor_index} {chunk.tensor_name!r}"
        elif not 0 < size <= MAX_CHUNK_BYTES or chunk.offset + size > t.offset + t.nbytes:
            problem = f"{size}-byte chunk at {chunk.offset} does not fit tensor {t.name!r}"
        if problem:
            raise _Retry(WeightsCorrupted(f"{self.where}: {problem}"))
        self.expected += size

    def accept(self, chunk: Chunk) -> None:
        """CRC and copy here, SHA-256 at the same time in the hash thread, then commit.

        Runs in a worker thread for big chunks (zlib, numpy and hashlib release the GIL). The
        hash thread extends a copy of the tensor's hasher, which is kept only if the CRC holds,
        so a bad chunk leaves the hash state as it was for the resumed stream.
        """
        big = len(chunk.data) >= INLINE_BYTES
        hashed = self._hash_thread.submit(self._hashed, chunk) if big else None
        crc = zlib.crc32(chunk.data)
        stop = chunk.offset + len(chunk.data)
        assert self.array is not None
        np.copyto(self.array[chunk.offset : stop], np.frombuffer(chunk.data, dtype=np.uint8))
        hasher = hashed.result() if hashed is not None else self._hashed(chunk)
        t = self.manifest.tensors[chunk.tensor_index]
        if crc != chunk.crc32:
            raise _Retry(
                WeightsCorrupted(
                    f"{self.where}: CRC-32 mismatch in tensor {t.name!r} at stream offset "
                    f"{chunk.offset} ({len(chunk.data)} bytes): got {crc:08x}, chunk says "
                    f"{chunk.crc32:08x}"
                )
            )
        self._hashers[chunk.tensor_index] = hasher
        if stop == t.offset + t.nbytes:
            self._finish_tensor(chunk.tensor_index, hasher.hexdigest())
        self.verified = stop

    def _hashed(self, chunk: Chunk) -> Any:
        """The tensor's hash state extended by ``chunk`` (a copy: committed by accept)."""
        base = self._hashers.get(chunk.tensor_index)
        hasher = base.copy() if base is not None else hashlib.sha256()
        hasher.update(chunk.data)
        return hasher

    def close(self) -> None:
        self._hash_thread.shutdown(wait=True)

    def _finish_tensor(self, index: int, digest: str) -> None:
        t = self.manifest.tensors[index]
        if digest != t.sha256:
            raise WeightsCorrupted(
                f"{self.where}: SHA-256 mismatch for tensor {t.name!r} (bytes "
                f"[{t.offset}, {t.offset + t.nbytes})): got {digest}, manifest says {t.sha256}"
            )
        self._hashers.pop(index, None)

    def finish(self) -> None:
        """After the last chunk: every byte arrived; zero-size tensors hash the empty string."""
        if self.verified != self.manifest.total_bytes:
            raise _Retry(
                Unavailable(
                    f"{self.where}: stream ended at byte {self.verified} of "
                    f"{self.manifest.total_bytes}"
                )
            )
        empty = hashlib.sha256(b"").hexdigest()
        for i, t in enumerate(self.manifest.tensors):
            if t.nbytes == 0:
                self._finish_tensor(i, empty)

    @property
    def where(self) -> str:
        return f"weights {self.manifest.run!r} version {self.manifest.version}"


async def fetch_weights(
    channel_or_address: grpc.aio.Channel | str,
    version: int | None = None,
    *,
    expected_digest: str | None = None,
    resume: bool = True,
    max_retries: int = 3,
    timeout_s: float = 600.0,
    backoff_s: float = 0.1,
) -> tuple[weights_pb2.WeightManifest, dict[str, torch.Tensor]]:
    """Fetch one weight version (``None``: the latest) from a WeightService.

    Reads the manifest, checks it (and ``expected_digest``, the digest a WeightsPublished event
    announced), then streams the bytes. Each chunk's CRC-32 and each tensor's SHA-256 is
    verified. When a stream drops (UNAVAILABLE, a connection reset, a corrupted chunk) the
    fetch continues from the first unverified byte (``resume=True``) or starts over, up to
    ``max_retries`` times in a row without getting further than before.

    Returns the manifest and name -> tensor in manifest order; the tensors view one buffer
    holding the whole version (no copy per tensor). Raises NotFound for a version the learner
    does not keep, FailedPrecondition when the digest differs from ``expected_digest``,
    WeightsCorrupted for checksum failures (naming the tensor), Unavailable once retries are
    spent, and DEADLINE_EXCEEDED after ``timeout_s`` in all.
    """
    deadline = time.monotonic() + timeout_s
    if isinstance(channel_or_address, str):
        async with make_channel(channel_or_address) as chan:
            return await _fetch(
                chan, version, expected_digest, resume, max_retries, deadline, backoff_s
            )
    return await _fetch(
        channel_or_address, version, expected_digest, resume, max_retries, deadline, backoff_s
    )


async def _fetch(
    chan: grpc.aio.Channel,
    version: int | None,
    expected_digest: str | None,
    resume: bool,
    max_retries: int,
    deadline: float,
    backoff_s: float,
) -> tuple[weights_pb2.WeightManifest, dict[str, torch.Tensor]]:
    manifest = await _get_manifest(chan, version, deadline)
    check_manifest(manifest)
    if expected_digest and manifest.digest != expected_digest:
        raise FailedPrecondition(
            f"weights {manifest.run!r} version {manifest.version}: digest {manifest.digest} "
            f"differs from the expected {expected_digest}",
            field="expected_digest",
        )
    receiver = _Receiver(manifest)
    try:
        await _receive(chan, receiver, resume, max_retries, deadline, backoff_s)
    finally:
        receiver.close()
    await receiver.allocate()  # an empty version streams nothing
    assert receiver.buffer is not None
    return manifest, tensors_from_buffer(manifest, receiver.buffer)


async def _receive(
    chan: grpc.aio.Channel,
    receiver: _Receiver,
    resume: bool,
    max_retries: int,
    deadline: float,
    backoff_s: float,
) -> None:
    """Stream until every byte is in place, resuming (or restarting) after recoverable faults."""
    failures = 0
    best = 0  # furthest verified offset reached by any attempt
    while True:
        try:
            await _stream_once(chan, receiver, deadline)
            receiver.finish()
            break
        except _Retry as retry:
            if receiver.verified > best:
                best, failures = receiver.verified, 0
            failures += 1
            if failures > max_retries:
                raise retry.error from None
            await asyncio.sleep(min(backoff_s * 2 ** (failures - 1), 2.0))
            receiver.restart(receiver.verified if resume else 0)


async def _get_manifest(
    chan: grpc.aio.Channel, version: int | None, deadline: float
) -> weights_pb2.WeightManifest:
    call = chan.unary_unary(
        _MANIFEST_METHOD,
        request_serializer=weights_pb2.GetManifestRequest.SerializeToString,
        response_deserializer=weights_pb2.GetManifestResponse.FromString,
    )
    request = weights_pb2.GetManifestRequest(version=version)
    try:
        reply = await call(request, timeout=_remaining(deadline, cap=30.0))
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    return reply.manifest


async def _stream_once(chan: grpc.aio.Channel, receiver: _Receiver, deadline: float) -> None:
    """One FetchWeights call from ``receiver.verified``; raises _Retry for recoverable faults."""
    manifest = receiver.manifest
    if receiver.verified == manifest.total_bytes:
        return  # nothing left (also: an empty version)
    request = weights_pb2.FetchWeightsRequest(
        version=manifest.version,
        start_offset=receiver.verified,
        expected_digest=manifest.digest,
    )
    # No response deserializer: grpc hands over the raw bytes and parse_chunk views into them.
    stream: grpc.aio.UnaryStreamMultiCallable[weights_pb2.FetchWeightsRequest, bytes]
    stream = chan.unary_stream(
        FETCH_METHOD, request_serializer=weights_pb2.FetchWeightsRequest.SerializeToString
    )
    call = stream(request, timeout=_remaining(deadline))
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[None] | None = None
    try:
        await receiver.allocate()  # the call is on its way meanwhile
        async for raw in call:
            try:
                chunk = parse_chunk(raw)
            except InvalidArgument as exc:
                raise _Retry(WeightsCorrupted(f"{receiver.where}: {exc}")) from None
            receiver.check_order(chunk)
            if pending is not None:
                await pending  # at most one chunk in the worker: keeps the hashes in order
                pending = None
            if len(chunk.data) < INLINE_BYTES:
                receiver.accept(chunk)
            else:
                pending = loop.run_in_executor(None, receiver.accept, chunk)
            if chunk.last:
                break
        if pending is not None:
            await pending
            pending = None
    except grpc.RpcError as exc:
        error = from_rpc_error(exc)
        if error.code == grpc.StatusCode.UNAVAILABLE:
            raise _Retry(error) from None
        raise error from None
    finally:
        call.cancel()
        if pending is not None:  # the stream failed: let the worker finish its chunk first
            await asyncio.wait([pending])
            failure = None if pending.cancelled() else pending.exception()
            if isinstance(failure, WeightsCorrupted):
                raise failure  # a tensor failed its SHA-256: retrying cannot fix that


def _remaining(deadline: float, cap: float | None = None) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        error = RlfleetError("weight fetch ran out of time (timeout_s)")
        error.code = grpc.StatusCode.DEADLINE_EXCEEDED
        raise error
    return min(left, cap) if cap is not None else left


# --------------------------------------------------------------------------- following versions
#
# Following the learner's weight versions without stalling generation. A consumer needs a
# version before it starts (`first`), then takes newer ones when it can apply them: an actor
# between fragments, so that every fragment has one policy version; a game link or the LM sampler
# as soon as one arrives (`wait_newer`, then `take`). Fetching (a gRPC stream, checksums) runs in
# a background task as soon as a `WeightsPublished` event announces a version. Several
# announcements while one fetch runs collapse into fetching the newest.

log = logging.getLogger(__name__)


async def _fetch_version(
    address: str, version: int | None, digest: str | None = None
) -> tuple[int, dict[str, Any]]:
    """(version, state dict) of `version` (None: the latest) from the learner's WeightService;
    `digest` is the manifest digest the announcement named (checked by fetch_weights)."""
    manifest, tensors = await fetch_weights(address, version, expected_digest=digest or None)
    return int(manifest.version), tensors


class WeightFollower:
    """Fetches each newer announced version in the background; hands it over on request."""

    def __init__(self, bus: Bus, run: str, address: str, *, retry_s: float = 1.0) -> None:
        self.bus = bus
        self.run = run
        self.address = address
        self.retry_s = retry_s
        self.version = -1  # newest version fetched (handed over or pending)
        self._announced = -1
        self._digests: dict[int, str] = {}  # announced version -> manifest digest
        # WeightsPublished.taken_sequences of the newest fetched version (what `taken` tells),
        # and of the newest announced one, which becomes it once that version is fetched.
        self._taken: dict[str, int] = {}
        self._announced_taken: tuple[int, dict[str, int]] = (-1, {})
        self._wake = asyncio.Event()
        self._arrived = asyncio.Event()  # a newer version was fetched
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Set when the run says it is done (RunStatus DONE): no newer version will come, so
        # nothing should wait for one.
        self.run_done = asyncio.Event()

    async def start(self) -> None:
        """Subscribe before the first fetch, so no announcement falls between the two."""
        sub = await self.bus.subscribe(
            events_subject(self.run, "weights"), events_pb2.WeightsPublished
        )
        status = await self.bus.subscribe(events_subject(self.run, "status"), events_pb2.RunStatus)
        self._tasks = [
            asyncio.create_task(self._watch(sub), name="weights-watch"),
            asyncio.create_task(self._fetcher(), name="weights-fetch"),
            asyncio.create_task(self._watch_status(status), name="run-status-watch"),
        ]

    async def first(
        self, stop: asyncio.Event, timeout_s: float
    ) -> tuple[int, dict[str, Any]] | None:
        """The learner's latest version, retrying while it is not up or has none yet; None
        when told to stop meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                version, state = await _fetch_version(self.address, None)
                self.version = max(self.version, version)
                return version, state
            except Unavailable as exc:
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"learner {self.address}: no weights within {timeout_s:g}s: {exc}"
                    ) from exc
                log.info("waiting for the learner's weights at %s: %s", self.address, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.retry_s)
            if stop.is_set():
                return None

    def take(self) -> tuple[int, dict[str, Any]] | None:
        """The newest fetched version not handed over yet, or None."""
        pending, self._pending = self._pending, None
        return pending

    async def wait_newer(self, version: int, stop: asyncio.Event, timeout_s: float) -> bool:
        """Wait until a version newer than `version` has been fetched (True), or until stopped
        or `timeout_s` passed (False). Bounds how far an actor runs ahead of the learner."""
        deadline = time.monotonic() + timeout_s
        while self.version <= version and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._arrived.clear()
            waiters = [
                asyncio.ensure_future(self._arrived.wait()),
                asyncio.ensure_future(stop.wait()),
            ]
            _, pending = await asyncio.wait(
                waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for waiter in pending:
                waiter.cancel()
        return self.version > version

    def taken(self, producer: str) -> int | None:
        """The highest sequence of ``producer``'s fragments the learner had taken off the
        stream when it published the newest fetched version, or None when it said none.

        Told with the fetched version rather than the announced one: an actor that goes on as
        soon as the learner has taken its fragments should go on with the weights that came
        of them, not with the previous ones while those are still on their way."""
        return self._taken.get(producer)

    async def _watch(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                version = int(delivery.message.version)
                if version > self._announced_taken[0]:
                    self._announced_taken = (version, dict(delivery.message.taken_sequences))
                if version > max(self._announced, self.version):
                    self._announced = version
                    self._digests = {version: delivery.message.manifest_digest}
                    self._wake.set()

    async def _watch_status(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                if delivery.message.state == events_pb2.RUN_STATE_DONE:
                    self.run_done.set()
                    return

    async def _fetcher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            wanted = self._announced
            if wanted <= self.version:
                continue
            try:
                version, state = await _fetch_version(
                    self.address, wanted, self._digests.get(wanted)
                )
            except RlfleetError as exc:
                log.warning("fetching weights v%d from %s failed: %s", wanted, self.address, exc)
                if isinstance(exc, Unavailable):  # else (no longer kept): wait for a newer one
                    await asyncio.sleep(self.retry_s)
                    if self._announced == wanted:
                        self._wake.set()  # again, unless something newer came meanwhile
                continue
            if version > self.version:
                self.version = version
                self._pending = (version, state)
                if self._announced_taken[0] == version:
                    self._taken = self._announced_taken[1]
                self._arrived.set()
                log.info("fetched weights v%d from %s", version, self.address)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
