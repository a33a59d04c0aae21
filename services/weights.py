"""Weight versions as one checksummed byte stream (rlfleet.learner.v1.WeightService).

Shared by both ends: the learner builds manifests and chunks (learner/weights.py), samplers and
actors fetch (``fetch_weights``). The layout, digest and chunk rules are those of
protos/rlfleet/learner/v1/weights.proto:

- a version's stream is its tensors' raw little-endian bytes concatenated in manifest order;
- the manifest digest is the SHA-256 of a canonical text (``canonical_text``), so the digest
  alone names a version's bytes;
- chunks are at most 2 MiB, never span two tensors, and carry a CRC-32; each tensor's SHA-256 is
  in the manifest; a dropped stream resumes from the first byte not yet verified.

Hot path (bench/weight_sync.py): protobuf costs extra copies per 2 MiB chunk (building a
message copies ``data``, serializing copies it again, reading ``.data`` once more); building and
serializing alone took about 3 ms per chunk on the build machine, as long as gRPC took to carry
it. Chunks therefore travel as hand-encoded wire bytes (``encode_chunk``, byte-identical to
``SerializeToString``) and are read back as memoryview slices (``parse_chunk``); other clients
see ordinary FetchWeightsResponse messages. CRC-32 and the copy into place run in one worker
thread while a second one hashes the same chunk (zlib, numpy and hashlib release the GIL), all
overlapping the next chunk's arrival.
Buffers come from ``new_buffer``, never bytearray(n), whose zero-fill is a whole extra pass.

torch is imported lazily: services/ is installed on hosts without it (env servers).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import math
import mmap
import re
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.protobuf import timestamp_pb2

from rlfleet.common.v1 import tensor_pb2
from rlfleet.learner.v1 import weights_pb2
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    RlfleetError,
    Unavailable,
    from_rpc_error,
)
from services.server import channel as make_channel
from services.tensor import dtype_name, numpy_dtype

if TYPE_CHECKING:
    import torch

__all__ = [
    "FETCH_METHOD",
    "FORMAT",
    "MAX_CHUNK_BYTES",
    "Chunk",
    "WeightsCorrupted",
    "build_manifest",
    "canonical_text",
    "check_manifest",
    "chunk_spans",
    "encode_chunk",
    "fetch_weights",
    "iter_chunk_bytes",
    "iter_chunks",
    "manifest_digest",
    "new_buffer",
    "parse_chunk",
    "tensors_from_buffer",
]

MAX_CHUNK_BYTES = 2 << 20  # 2 MiB: the proto's limit and default
FORMAT = "rlfleet-weights/1"  # first token of the canonical manifest text
FETCH_METHOD = "/rlfleet.learner.v1.WeightService/FetchWeights"
_MANIFEST_METHOD = "/rlfleet.learner.v1.WeightService/GetManifest"

# Below this, malloc's free lists usually hold the memory already: no faults to save.
_POPULATE_BYTES = 16 << 20
# Below this many bytes a thread hand-off (about 50-100 us) costs more than hashing inline.
_INLINE_BYTES = 256 << 10

if sys.byteorder != "little":  # the stream is little-endian and tensors are copied as raw bytes
    raise ImportError("services.weights supports little-endian hosts only")

DType = tensor_pb2.DType
_WHITESPACE = re.compile(r"\s")


class WeightsCorrupted(RlfleetError):
    """Weight bytes or a manifest failed a checksum (or broke the stream's layout rules).

    DATA_LOSS: the bytes cannot be trusted; the message names the tensor and the offset.
    """

    code = grpc.StatusCode.DATA_LOSS


# --------------------------------------------------------------------------- dtypes


def _torch_dtypes() -> dict[Any, int]:
    import torch

    return {
        torch.float32: DType.D_TYPE_FLOAT32,
        torch.float64: DType.D_TYPE_FLOAT64,
        torch.float16: DType.D_TYPE_FLOAT16,
        torch.bfloat16: DType.D_TYPE_BFLOAT16,
        torch.int8: DType.D_TYPE_INT8,
        torch.int16: DType.D_TYPE_INT16,
        torch.int32: DType.D_TYPE_INT32,
        torch.int64: DType.D_TYPE_INT64,
        torch.uint8: DType.D_TYPE_UINT8,
        torch.uint16: DType.D_TYPE_UINT16,
        torch.uint32: DType.D_TYPE_UINT32,
        torch.uint64: DType.D_TYPE_UINT64,
        torch.bool: DType.D_TYPE_BOOL,
    }


def new_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` for a version's stream.

    Big ones are pre-faulted by one mmap(MAP_POPULATE) call (Linux): faulting a fresh buffer in
    4 KiB pages while copying into it costs several times the copy itself. For 400 MB on the
    build machine, allocating and copying took 0.24-0.28 s of CPU this way against 0.28-0.34 s
    with torch.empty (the copy alone into touched memory: 0.07 s).
    """
    import torch

    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < _POPULATE_BYTES or not populate:
        return torch.empty(nbytes, dtype=torch.uint8)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps the mapping alive


def _itemsize(code: int) -> int:
    return numpy_dtype(code).itemsize  # InvalidArgument for UNSPECIFIED / unknown codes


# --------------------------------------------------------------------------- manifest


def canonical_text(manifest: weights_pb2.WeightManifest) -> str:
    """The text whose SHA-256 is the manifest digest (weights.proto, WeightManifest)."""
    m = manifest
    lines = [f"{FORMAT} {m.run} {m.version} {m.total_bytes} {len(m.tensors)}\n"]
    for t in m.tensors:
        shape = "[" + ",".join(str(d) for d in t.shape) + "]"
        lines.append(f"{t.name} {dtype_name(t.dtype)} {shape} {t.offset} {t.nbytes} {t.sha256}\n")
    return "".join(lines)


def manifest_digest(manifest: weights_pb2.WeightManifest) -> str:
    """Lowercase hex SHA-256 of ``canonical_text(manifest)``."""
    return hashlib.sha256(canonical_text(manifest).encode("utf-8")).hexdigest()


def _check_name(name: object, what: str) -> str:
    # A space or line break would make the canonical text ambiguous (two manifests, one digest).
    if not isinstance(name, str) or not name or _WHITESPACE.search(name):
        raise InvalidArgument(f"{what} {name!r}: must be a non-empty string without whitespace")
    return name


def check_manifest(manifest: weights_pb2.WeightManifest) -> None:
    """Check a manifest's layout (contiguous, sizes match shapes) and its digest.

    Raises InvalidArgument for a broken layout and WeightsCorrupted when the digest does not
    match the manifest's own contents: both mean the manifest cannot describe the stream.
    """
    where = f"manifest of {manifest.run!r} version {manifest.version}"
    offset = 0
    names: set[str] = set()
    for i, t in enumerate(manifest.tensors):
        _check_name(t.name, f"{where}: tensor {i} name")
        if t.name in names:
            raise InvalidArgument(f"{where}: tensor name {t.name!r} appears twice")
        names.add(t.name)
        if any(d < 0 for d in t.shape):
            raise InvalidArgument(f"{where}: {t.name}: negative extent in {list(t.shape)}")
        expected = math.prod(t.shape) * _itemsize(t.dtype)
        if t.nbytes != expected or t.offset != offset:
            raise InvalidArgument(
                f"{where}: {t.name}: offset {t.offset}, nbytes {t.nbytes}; expected offset "
                f"{offset}, nbytes {expected} ({dtype_name(t.dtype)} {list(t.shape)})"
            )
        offset += t.nbytes
    if manifest.total_bytes != offset:
        raise InvalidArgument(f"{where}: total_bytes {manifest.total_bytes}, tensors sum {offset}")
    digest = manifest_digest(manifest)
    if manifest.digest != digest:
        raise WeightsCorrupted(
            f"{where}: digest {manifest.digest!r} does not match its contents ({digest})"
        )


def build_manifest(
    run: str,
    version: int,
    named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
    *,
    base_model: str = "",
    create_time: timestamp_pb2.Timestamp | None = None,
    hash_workers: int = 2,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> tuple[weights_pb2.WeightManifest, memoryview]:
    """Snapshot tensors into one contiguous stream and describe it.

    Returns the manifest and the stream: a read-only memoryview over a buffer of
    ``total_bytes`` that this call owns, so the caller may keep training (mutating the tensors)
    as soon as it returns. Tensors may live on any device and be non-contiguous; each is copied
    exactly once, straight into its place. SHA-256s are computed in ``hash_workers`` threads
    while later tensors are still being copied (hashlib and torch's copy both release the GIL).

    ``allocate(nbytes)`` supplies the buffer (a CPU uint8 tensor of ``nbytes``), e.g. one an
    evicted version no longer needs: touching fresh memory costs page faults that measured
    several times the copy itself (0.4 s versus 0.07 s for 400 MB on the build machine).
    """
    import torch

    _check_name(run, "run name")
    if version < 0:
        raise InvalidArgument(f"version must be >= 0, got {version}", field="version")
    codes = _torch_dtypes()
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors: list[weights_pb2.WeightTensor] = []
    sources: list[Any] = []
    seen: set[str] = set()
    offset = 0
    for name, value in items:
        _check_name(name, "tensor name")
        if name in seen:
            raise InvalidArgument(f"tensor name {name!r} appears twice", field=name)
        seen.add(name)
        t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        code = codes.get(t.dtype)
        if code is None:
            raise InvalidArgument(f"{name}: dtype {t.dtype} has no rlfleet DType", field=name)
        nbytes = t.numel() * t.element_size()
        tensors.append(
            weights_pb2.WeightTensor(
                name=name, dtype=code, shape=list(t.shape), offset=offset, nbytes=nbytes
            )
        )
        sources.append(t)
        offset += nbytes

    flat = (allocate or new_buffer)(offset)
    if flat.dtype != torch.uint8 or flat.numel() != offset or not flat.is_contiguous():
        raise InvalidArgument(f"allocate({offset}) must return a contiguous uint8 tensor")
    view = memoryview(flat.numpy())  # the numpy array keeps `flat` alive
    digests: list[str | Future[str]] = []
    with ThreadPoolExecutor(max(1, hash_workers), thread_name_prefix="weights-sha") as pool:
        for spec, t in zip(tensors, sources, strict=True):
            if spec.nbytes:
                dst = flat[spec.offset : spec.offset + spec.nbytes]
                dst.copy_(t.reshape(-1).view(torch.uint8))  # reshape copies only if strided
            region = view[spec.offset : spec.offset + spec.nbytes]
            if spec.nbytes < _INLINE_BYTES:
                digests.append(hashlib.sha256(region).hexdigest())
            else:
                digests.append(pool.submit(_sha256_hex, region))
        for spec, digest in zip(tensors, digests, strict=True):
            spec.sha256 = digest if isinstance(digest, str) else digest.result()

    if create_time is None:
        create_time = timestamp_pb2.Timestamp()
        create_time.GetCurrentTime()
    manifest = weights_pb2.WeightManifest(
        run=run,
        version=version,
        tensors=tensors,
        total_bytes=offset,
        base_model=base_model,
        create_time=create_time,
    )
    manifest.digest = manifest_digest(manifest)
    return manifest, view.toreadonly()


def _sha256_hex(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def tensors_from_buffer(
    manifest: weights_pb2.WeightManifest, buffer: torch.Tensor | bytearray | memoryview
) -> dict[str, torch.Tensor]:
    """Tensors (name -> tensor, manifest order) viewing a version's stream without copying.

    ``buffer`` is the stream as a uint8 tensor or any bytes-like object; the tensors share its
    memory (read-only ones too: clone before writing) and keep it alive. A tensor whose offset
    is not a multiple of its element size (after an odd-length bfloat16 tensor, say) is copied
    into an aligned one instead: unaligned views are slow and rejected by some kernels.
    """
    import torch

    if not isinstance(buffer, torch.Tensor):
        with warnings.catch_warnings():  # torch warns about read-only buffers; documented above
            warnings.simplefilter("ignore", UserWarning)
            buffer = (
                torch.frombuffer(buffer, dtype=torch.uint8)
                if len(buffer)
                else torch.empty(0, dtype=torch.uint8)
            )
    dtypes = {code: dt for dt, code in _torch_dtypes().items()}
    out: dict[str, torch.Tensor] = {}
    for t in manifest.tensors:
        dtype, shape = dtypes[t.dtype], tuple(t.shape)
        region = buffer[t.offset : t.offset + t.nbytes]
        if t.offset % _itemsize(t.dtype):
            region = region.clone()
        out[t.name] = region.view(dtype).view(shape)
    return out


# --------------------------------------------------------------------------- chunks


@dataclass(frozen=True, slots=True)
class Chunk:
    """One FetchWeightsResponse, with ``data`` as a view into the received message."""

    offset: int
    data: memoryview
    tensor_index: int
    tensor_name: str
    crc32: int
    last: bool


def chunk_spans(
    manifest: weights_pb2.WeightManifest,
    start_offset: int = 0,
    end_offset: int = 0,
    max_chunk_bytes: int = 0,
) -> Iterator[tuple[int, int, int]]:
    """``(tensor_index, start, stop)`` of each chunk of ``[start_offset, end_offset)``.

    Validates the range as FetchWeights does (InvalidArgument). Inside a tensor, chunk
    boundaries sit on a fixed grid (tensor offset + k * max_chunk_bytes), so a resumed stream
    realigns after its first chunk and the server's CRC cache keeps hitting.
    """
    total = manifest.total_bytes
    end = end_offset or total
    size = max_chunk_bytes or MAX_CHUNK_BYTES
    if not 0 < size <= MAX_CHUNK_BYTES:
        raise InvalidArgument(
            f"max_chunk_bytes {max_chunk_bytes} above the limit of {MAX_CHUNK_BYTES}",
            field="max_chunk_bytes",
        )
    if not 0 <= start_offset <= total or not start_offset <= end <= total:
        raise InvalidArgument(
            f"byte range [{start_offset}, {end_offset}) outside the {total}-byte stream of "
            f"version {manifest.version} (0 <= start <= end <= total_bytes; end 0 = the end)",
            field="start_offset" if not 0 <= start_offset <= total else "end_offset",
        )
    ends = [t.offset + t.nbytes for t in manifest.tensors]
    index = bisect.bisect_right(ends, start_offset)  # first tensor ending after start
    pos = start_offset
    while pos < end:
        t = manifest.tensors[index]
        tensor_end = ends[index]
        if pos >= tensor_end:  # zero-size tensors and the tensor just finished get nothing
            index += 1
            continue
        grid = t.offset + ((pos - t.offset) // size + 1) * size
        stop = min(grid, tensor_end, end)
        yield index, pos, stop
        pos = stop


def _crc(payload: memoryview, start: int, stop: int, cache: MutableMapping | None) -> int:
    if cache is None:
        return zlib.crc32(payload[start:stop])
    crc = cache.get((start, stop))
    if crc is None:
        crc = cache[(start, stop)] = zlib.crc32(payload[start:stop])
    return crc


def iter_chunks(
    manifest: weights_pb2.WeightManifest,
    payload: memoryview,
    start_offset: int = 0,
    end_offset: int = 0,
    max_chunk_bytes: int = 0,
    *,
    crc_cache: MutableMapping[tuple[int, int], int] | None = None,
) -> Iterator[weights_pb2.FetchWeightsResponse]:
    """The FetchWeightsResponse messages of a byte range (see ``chunk_spans``)."""
    end = end_offset or manifest.total_bytes
    for index, start, stop in chunk_spans(manifest, start_offset, end_offset, max_chunk_bytes):
        yield weights_pb2.FetchWeightsResponse(
            offset=start,
            data=bytes(payload[start:stop]),
            tensor_index=index,
            tensor_name=manifest.tensors[index].name,
            crc32=_crc(payload, start, stop, crc_cache),
            last=stop == end,
        )


def iter_chunk_bytes(
    manifest: weights_pb2.WeightManifest,
    payload: memoryview,
    start_offset: int = 0,
    end_offset: int = 0,
    max_chunk_bytes: int = 0,
    *,
    crc_cache: MutableMapping[tuple[int, int], int] | None = None,
) -> Iterator[bytes]:
    """``iter_chunks`` already serialized: one copy of the data per chunk instead of three."""
    end = end_offset or manifest.total_bytes
    for index, start, stop in chunk_spans(manifest, start_offset, end_offset, max_chunk_bytes):
        yield encode_chunk(
            start,
            payload[start:stop],
            index,
            manifest.tensors[index].name,
            _crc(payload, start, stop, crc_cache),
            stop == end,
        )


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(
    offset: int,
    data: memoryview | bytes,
    tensor_index: int,
    tensor_name: str,
    crc32: int,
    last: bool,
) -> bytes:
    """Wire bytes of a FetchWeightsResponse, identical to protobuf's own serialization.

    Fields in number order, proto3 defaults omitted, as protobuf writes them; tested against
    ``SerializeToString`` in tests/unit/test_weights_manifest.py.
    """
    head = bytearray()
    if offset:
        head += b"\x08" + _varint(offset)
    if len(data):
        head += b"\x12" + _varint(len(data))
    tail = bytearray()
    if tensor_index:
        tail += b"\x18" + _varint(tensor_index)
    if tensor_name:
        name = tensor_name.encode("utf-8")
        tail += b"\x22" + _varint(len(name)) + name
    if crc32:
        tail += b"\x2d" + crc32.to_bytes(4, "little")
    if last:
        tail += b"\x30\x01"
    return b"".join((head, data, tail))


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise InvalidArgument("truncated or overlong varint in FetchWeightsResponse")
        byte = raw[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


_FIELD_WIRE_TYPES = {1: 0, 2: 2, 3: 0, 4: 2, 5: 5, 6: 0}


def parse_chunk(raw: bytes) -> Chunk:
    """Decode FetchWeightsResponse wire bytes; ``data`` is a view of ``raw`` (no copy).

    Accepts any field order and skips unknown fields, as a protobuf parser would.
    """
    view = memoryview(raw)
    fields: dict[int, Any] = {}
    pos, size = 0, len(raw)
    while pos < size:
        key, pos = _read_varint(raw, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(raw, pos)
        elif wire == 2:
            length, pos = _read_varint(raw, pos)
            value, pos = view[pos : pos + length], pos + length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, pos = int.from_bytes(raw[pos : pos + width], "little"), pos + width
        else:
            raise InvalidArgument(f"FetchWeightsResponse: unsupported wire type {wire}")
        if pos > size:
            raise InvalidArgument("FetchWeightsResponse: truncated message")
        if number in _FIELD_WIRE_TYPES:
            if wire != _FIELD_WIRE_TYPES[number]:
                raise InvalidArgument(f"FetchWeightsResponse: field {number} has wire type {wire}")
            fields[number] = value
    return Chunk(
        offset=fields.get(1, 0),
        data=fields.get(2, view[0:0]),
        tensor_index=fields.get(3, 0) & 0xFFFFFFFF,
        tensor_name=bytes(fields.get(4, b"")).decode("utf-8"),
        crc32=fields.get(5, 0),
        last=bool(fields.get(6, 0)),
    )


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
        if total < _POPULATE_BYTES:
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
        big = len(chunk.data) >= _INLINE_BYTES
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
            if len(chunk.data) < _INLINE_BYTES:
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
