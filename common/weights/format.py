"""The weight format: dtypes, the manifest (layout, digest, per-tensor SHA-256) and views of a
version's buffer. See the package docstring for the stream's rules."""

from __future__ import annotations

import hashlib
import math
import mmap
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import timestamp_pb2

from common.tensor import dtype_name, numpy_dtype
from rlfleet.common.v1 import tensor_pb2
from rlfleet.learner.v1 import weights_pb2
from services.errors import (
    InvalidArgument,
    RlfleetError,
)

if TYPE_CHECKING:
    import torch

MAX_CHUNK_BYTES = 2 << 20  # 2 MiB: the proto's limit and default
FORMAT = "rlfleet-weights/1"  # first token of the canonical manifest text

# Below this, malloc's free lists usually hold the memory already: no faults to save.
POPULATE_BYTES = 16 << 20
# Below this many bytes a thread hand-off costs more than hashing inline.
INLINE_BYTES = 256 << 10

if sys.byteorder != "little":  # the stream is little-endian and tensors are copied as raw bytes
    raise ImportError("common.weights supports little-endian hosts only")

DType = tensor_pb2.DType
_WHITESPACE = re.compile(r"\s")


class WeightsCorrupted(RlfleetError):
    """Weight bytes or a manifest failed a checksum (or broke the stream's layout rules).

    DATA_LOSS: the bytes cannot be trusted; the message names the tensor and the offset.
    """

    code = grpc.StatusCode.DATA_LOSS


# --------------------------------------------------------------------------- dtypes


def _torch_dtypes() -> dict[torch.dtype, DType]:
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
    4 KiB pages while copying into it costs several times the copy itself.
    """
    import torch

    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < POPULATE_BYTES or not populate:
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
    evicted version no longer needs: touching fresh memory costs page faults, several times
    the copy itself.
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
    view = flat.numpy().data  # a memoryview; the numpy array in it keeps `flat` alive
    digests: list[str | Future[str]] = []
    with ThreadPoolExecutor(max(1, hash_workers), thread_name_prefix="weights-sha") as pool:
        for spec, t in zip(tensors, sources, strict=True):
            if spec.nbytes:
                dst = flat[spec.offset : spec.offset + spec.nbytes]
                dst.copy_(t.reshape(-1).view(torch.uint8))  # reshape copies only if strided
            region = view[spec.offset : spec.offset + spec.nbytes]
            if spec.nbytes < INLINE_BYTES:
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
