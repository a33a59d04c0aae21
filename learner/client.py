"""The learner's client module: what other services import to talk to the learner.

``fetch_weights`` pulls one weight version from ``WeightService`` (manifest first, then the
chunked byte stream, verified chunk by chunk and tensor by tensor, resumed from the first
unverified byte when a stream drops). The format itself (manifest, digest, chunk wire bytes) is
shared with the serving side in ``common.weights``. Only the contracts, ``common`` and the
runtime are imported here, never the learner's own modules.
"""

from __future__ import annotations

import asyncio
import hashlib
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
from rlfleet.learner.v1 import weights_pb2
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
