"""common/weights.py without a network: manifest digest, chunk rules, wire codec, round trips."""

from __future__ import annotations

import hashlib
import zlib

import pytest
import torch

from common.weights import (
    MAX_CHUNK_BYTES,
    WeightsCorrupted,
    build_manifest,
    canonical_text,
    check_manifest,
    encode_chunk,
    iter_chunk_bytes,
    iter_chunks,
    manifest_digest,
    parse_chunk,
    tensors_from_buffer,
)
from rlfleet.common.v1 import tensor_pb2
from rlfleet.learner.v1 import weights_pb2
from services.errors import InvalidArgument

MiB = 1 << 20
DType = tensor_pb2.DType


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's row-major element bytes, as the stream holds them."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def mixed() -> dict[str, torch.Tensor]:
    """Every layout case: > 2 MiB, zero-size, scalar, odd-length bf16 (misaligns what follows)."""
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randint(0, 256, ((5 * MiB) + 3,), generator=g).to(torch.uint8),
        "model.empty": torch.empty(0, 4),
        "model.scale": torch.tensor(0.5),
        "model.norm.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(10, generator=g),
        "lm_head.steps": torch.tensor(7, dtype=torch.int64),
    }


# --------------------------------------------------------------------------- manifest


def test_canonical_text_is_the_proto_form() -> None:
    """The example of weights.proto, byte for byte."""
    manifest = weights_pb2.WeightManifest(
        run="demo",
        version=7,
        total_bytes=4608,
        tensors=[
            weights_pb2.WeightTensor(
                name="model.norm.weight",
                dtype=DType.D_TYPE_FLOAT32,
                shape=[128],
                offset=0,
                nbytes=512,
                sha256="9f86d08",
            ),
            weights_pb2.WeightTensor(
                name="lm_head.weight",
                dtype=DType.D_TYPE_FLOAT32,
                shape=[8, 128],
                offset=512,
                nbytes=4096,
                sha256="2c26b46",
            ),
        ],
    )
    expected = (
        "rlfleet-weights/1 demo 7 4608 2\n"
        "model.norm.weight float32 [128] 0 512 9f86d08\n"
        "lm_head.weight float32 [8,128] 512 4096 2c26b46\n"
    )
    assert canonical_text(manifest) == expected
    assert manifest_digest(manifest) == hashlib.sha256(expected.encode()).hexdigest()


def test_build_manifest_layout_and_hashes() -> None:
    tensors = mixed()
    manifest, payload = build_manifest("demo", 3, tensors, base_model="tiny-mlp")
    check_manifest(manifest)  # layout and digest consistent
    assert manifest.run == "demo" and manifest.version == 3 and manifest.base_model == "tiny-mlp"
    assert manifest.HasField("create_time")
    assert len(manifest.digest) == 64 and manifest.digest == manifest_digest(manifest)
    offset = 0
    for spec, (name, t) in zip(manifest.tensors, tensors.items(), strict=True):
        data = raw_bytes(t)
        assert (spec.name, list(spec.shape), spec.offset, spec.nbytes) == (
            name,
            list(t.shape),
            offset,
            len(data),
        )
        assert spec.sha256 == hashlib.sha256(data).hexdigest()
        assert bytes(payload[spec.offset : spec.offset + spec.nbytes]) == data
        offset += len(data)
    assert manifest.total_bytes == offset == len(payload)
    assert "model.scale float32 [] " in canonical_text(manifest)
    assert "model.norm.weight bfloat16 [3,5] " in canonical_text(manifest)
    assert payload.readonly


def test_digest_is_stable() -> None:
    tensors = mixed()
    first, _ = build_manifest("demo", 1, tensors)
    again, _ = build_manifest("demo", 1, list(tensors.items()), hash_workers=1)
    assert again.digest == first.digest  # create_time differs; not part of the digest


def _variants() -> dict[str, tuple[str, int, dict[str, torch.Tensor]]]:
    base = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    flipped = {k: v.clone() for k, v in base.items()}
    flipped["b"].view(torch.uint8)[5] ^= 1  # one bit of one byte
    return {
        "base": ("demo", 1, base),
        "byte": ("demo", 1, flipped),
        "name": ("demo", 1, {"a.weights": base["a.weight"], "b": base["b"]}),
        "shape": ("demo", 1, {"a.weight": base["a.weight"].reshape(3, 2), "b": base["b"]}),
        "dtype": ("demo", 1, {"a.weight": base["a.weight"].view(torch.int32), "b": base["b"]}),
        "order": ("demo", 1, {"b": base["b"], "a.weight": base["a.weight"]}),
        "run": ("other", 1, base),
        "version": ("demo", 2, base),
    }


def test_digest_changes_with_any_byte_name_shape_dtype_order_run_version() -> None:
    digests = {k: build_manifest(*v)[0].digest for k, v in _variants().items()}
    assert len(set(digests.values())) == len(digests), digests


def test_build_snapshots_the_tensors() -> None:
    weight = torch.zeros(1000)
    manifest, payload = build_manifest("demo", 0, {"w": weight})
    weight.add_(1.0)  # training goes on
    assert bytes(payload) == raw_bytes(torch.zeros(1000))
    check_manifest(manifest)


def test_build_accepts_strided_and_grad_tensors() -> None:
    base = torch.arange(12, dtype=torch.float32, requires_grad=True).reshape(3, 4)
    strided = base.t()  # not contiguous
    manifest, payload = build_manifest("demo", 0, {"t": strided})
    assert bytes(payload) == raw_bytes(strided.detach())
    assert list(manifest.tensors[0].shape) == [4, 3]


@pytest.mark.parametrize(
    "named, message",
    [
        ([("a", torch.ones(1)), ("a", torch.ones(1))], "appears twice"),
        ([("has space", torch.ones(1))], "without whitespace"),
        ([("", torch.ones(1))], "non-empty"),
        ([("c", torch.ones(2, dtype=torch.complex64))], "complex64"),
    ],
)
def test_build_rejects_bad_input(named: list, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        build_manifest("demo", 0, named)


def test_build_rejects_bad_run_and_version() -> None:
    with pytest.raises(InvalidArgument, match="run name"):
        build_manifest("two words", 0, {"a": torch.ones(1)})
    with pytest.raises(InvalidArgument, match="version"):
        build_manifest("demo", -1, {"a": torch.ones(1)})


def test_check_manifest_catches_tampering() -> None:
    manifest, _ = build_manifest("demo", 0, mixed())
    changed = weights_pb2.WeightManifest()
    changed.CopyFrom(manifest)
    changed.tensors[0].sha256 = "0" * 64
    with pytest.raises(WeightsCorrupted, match="does not match its contents"):
        check_manifest(changed)
    changed.CopyFrom(manifest)
    changed.tensors[1].offset += 1
    with pytest.raises(InvalidArgument, match=r"model\.empty"):
        check_manifest(changed)
    changed.CopyFrom(manifest)
    changed.total_bytes += 1
    with pytest.raises(InvalidArgument, match="total_bytes"):
        check_manifest(changed)


# --------------------------------------------------------------------------- chunks


def _check_chunks(
    manifest: weights_pb2.WeightManifest,
    payload: memoryview,
    chunks: list[weights_pb2.FetchWeightsResponse],
    start: int,
    end: int,
    limit: int,
) -> None:
    """The proto's rules: contiguous, ordered, <= limit, one tensor each, CRC, `last` at the end."""
    pos = start
    for i, c in enumerate(chunks):
        t = manifest.tensors[c.tensor_index]
        assert c.offset == pos and 0 < len(c.data) <= limit
        assert t.name == c.tensor_name and t.nbytes > 0
        assert t.offset <= c.offset and c.offset + len(c.data) <= t.offset + t.nbytes
        assert c.data == bytes(payload[c.offset : c.offset + len(c.data)])
        assert c.crc32 == zlib.crc32(c.data)
        assert c.last == (i == len(chunks) - 1)
        pos += len(c.data)
    assert pos == end


def test_chunks_never_span_tensors_and_cover_the_stream() -> None:
    manifest, payload = build_manifest("demo", 0, mixed())
    chunks = list(iter_chunks(manifest, payload))
    _check_chunks(manifest, payload, chunks, 0, manifest.total_bytes, MAX_CHUNK_BYTES)
    sizes = [len(c.data) for c in chunks]
    # 5 MiB + 3 bytes -> 2 MiB, 2 MiB, 1 MiB + 3; then one chunk per non-empty small tensor.
    assert sizes == [2 * MiB, 2 * MiB, MiB + 3, 4, 30, 40, 8]
    assert "model.empty" not in {c.tensor_name for c in chunks}


@pytest.mark.parametrize(
    "start, end, limit",
    [
        (0, 0, 1000),  # small chunks
        (MiB + 17, 0, 0),  # resume inside the big tensor: realign to the 2 MiB grid
        (5 * MiB + 3, 0, 0),  # resume at a tensor boundary (after the big tensor)
        (100, 3 * MiB, 0),  # a middle range, for parallel fetches
        (5 * MiB + 9, 5 * MiB + 20, 0),  # inside the odd bf16 tensor
        (7, 7, 0),  # empty range: no chunk at all
    ],
)
def test_chunk_ranges(start: int, end: int, limit: int) -> None:
    manifest, payload = build_manifest("demo", 0, mixed())
    chunks = list(iter_chunks(manifest, payload, start, end, limit))
    stop = end or manifest.total_bytes
    _check_chunks(manifest, payload, chunks, start, stop, limit or MAX_CHUNK_BYTES)
    if start == MiB + 17:
        assert [c.offset for c in chunks[:3]] == [MiB + 17, 2 * MiB, 4 * MiB]


def test_resumed_stream_hits_the_same_crc_cache_entries() -> None:
    manifest, payload = build_manifest("demo", 0, mixed())
    cache: dict[tuple[int, int], int] = {}
    list(iter_chunk_bytes(manifest, payload, crc_cache=cache))
    seen = dict(cache)
    list(iter_chunk_bytes(manifest, payload, MiB + 17, crc_cache=cache))
    assert len(cache) == len(seen) + 1  # only the partial first chunk is new


@pytest.mark.parametrize(
    "start, end, limit, field",
    [
        (-1, 0, 0, "start_offset"),
        (10**9, 0, 0, "start_offset"),
        (10, 5, 0, "end_offset"),
        (0, 10**9, 0, "end_offset"),
        (0, 0, MAX_CHUNK_BYTES + 1, "max_chunk_bytes"),
    ],
)
def test_chunk_range_errors(start: int, end: int, limit: int, field: str) -> None:
    manifest, payload = build_manifest("demo", 0, mixed())
    with pytest.raises(InvalidArgument) as info:
        list(iter_chunks(manifest, payload, start, end, limit))
    assert info.value.field == field


def test_empty_version_has_no_chunks() -> None:
    manifest, payload = build_manifest("demo", 0, {"nothing": torch.empty(0)})
    assert manifest.total_bytes == 0 and list(iter_chunks(manifest, payload)) == []
    assert tensors_from_buffer(manifest, payload)["nothing"].shape == (0,)


# --------------------------------------------------------------------------- wire codec


def test_encoded_chunks_are_protobufs_own_bytes() -> None:
    """encode_chunk must equal SerializeToString, default (zero) fields included."""
    manifest, payload = build_manifest("demo", 0, mixed())
    messages = list(iter_chunks(manifest, payload, 0, 0, 700_000))
    encoded = list(iter_chunk_bytes(manifest, payload, 0, 0, 700_000))
    assert encoded == [m.SerializeToString() for m in messages]
    assert messages[0].offset == 0 and messages[0].tensor_index == 0  # the omitted defaults
    for m, raw in zip(messages, encoded, strict=True):
        c = parse_chunk(raw)
        assert (c.offset, bytes(c.data), c.tensor_index, c.tensor_name, c.crc32, c.last) == (
            m.offset,
            m.data,
            m.tensor_index,
            m.tensor_name,
            m.crc32,
            m.last,
        )


def test_parse_chunk_skips_unknown_fields_and_any_order() -> None:
    reference = encode_chunk(2**40, b"abc", 3, "x.weight", 0xDEADBEEF, True)
    shuffled = (
        b"\x30\x01"  # last
        + b"\x22\x08x.weight"  # tensor_name
        + b"\x98\x06\x2a"  # unknown field 99, varint
        + b"\x12\x03abc"  # data
        + b"\x2d" + (0xDEADBEEF).to_bytes(4, "little")  # crc32
        + b"\x18\x03"  # tensor_index
        + b"\x08" + reference[1:7]  # offset, the same varint
    )  # fmt: skip
    a, b = parse_chunk(reference), parse_chunk(shuffled)
    assert (a.offset, bytes(a.data), a.tensor_index, a.tensor_name, a.crc32, a.last) == (
        2**40,
        b"abc",
        3,
        "x.weight",
        0xDEADBEEF,
        True,
    )
    assert (b.offset, bytes(b.data), b.tensor_index, b.tensor_name, b.crc32, b.last) == (
        a.offset,
        bytes(a.data),
        a.tensor_index,
        a.tensor_name,
        a.crc32,
        a.last,
    )
    parsed = weights_pb2.FetchWeightsResponse.FromString(shuffled)  # protobuf agrees
    assert parsed.offset == 2**40 and parsed.data == b"abc"


@pytest.mark.parametrize("raw", [b"\x12\x05abc", b"\x08", b"\x0b", b"\x10\x01", b"\x2d\x01"])
def test_parse_chunk_rejects_garbage(raw: bytes) -> None:
    with pytest.raises(InvalidArgument):
        parse_chunk(raw)


# --------------------------------------------------------------------------- round trips


def test_bf16_round_trip_is_bitwise() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "odd": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: misaligns the next
        "scalar": torch.tensor(-0.0, dtype=torch.bfloat16),
        "special": torch.tensor([float("nan"), float("inf"), -1e-40], dtype=torch.bfloat16),
        "after": torch.randn(4, 4, generator=g),
    }
    manifest, payload = build_manifest("demo", 0, tensors)
    for source in (
        payload,
        bytearray(payload),
        torch.frombuffer(bytearray(payload), dtype=torch.uint8),
    ):
        back = tensors_from_buffer(manifest, source)
        assert list(back) == list(tensors)
        for name, t in tensors.items():
            assert back[name].dtype == t.dtype and back[name].shape == t.shape
            assert raw_bytes(back[name]) == raw_bytes(t), name


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    ],
)  # fmt: skip
def test_every_dtype_round_trips(dtype: torch.dtype) -> None:
    source = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    manifest, payload = build_manifest("demo", 0, {"t": source, "s": source[0, 0, 0]})
    back = tensors_from_buffer(manifest, payload)
    assert back["t"].dtype == dtype and torch.equal(back["t"], source)
    assert back["s"].shape == () and torch.equal(back["s"], source[0, 0, 0])
