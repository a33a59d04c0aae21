"""Chunks of a version's byte stream: spans, CRC-32 and the hand-encoded FetchWeightsResponse
wire bytes (see the package docstring for why they are hand-encoded)."""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlfleet.learner.v1 import weights_pb2
from services.errors import (
    InvalidArgument,
)

if TYPE_CHECKING:
    pass

from common.weights.format import MAX_CHUNK_BYTES

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
    value: int | memoryview
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
