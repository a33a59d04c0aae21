"""Weight versions as one checksummed byte stream (rlfleet.learner.v1.WeightService).

Shared by both ends: the learner builds manifests and chunks (learner/weights.py), samplers and
actors fetch (``clients.learner.fetch_weights``). The layout, digest and chunk rules are those of
protos/rlfleet/learner/v1/weights.proto:

- a version's stream is its tensors' raw little-endian bytes concatenated in manifest order;
- the manifest digest is the SHA-256 of a canonical text (``canonical_text``), so the digest
  alone names a version's bytes;
- chunks are at most 2 MiB, never span two tensors, and carry a CRC-32; each tensor's SHA-256 is
  in the manifest; a dropped stream resumes from the first byte not yet verified.

Hot path (bench/transport/weight_sync.py): protobuf costs extra copies per chunk (building a
message copies ``data``, serializing copies it again, reading ``.data`` once more), which cost
about as much as gRPC's carrying it. Chunks therefore travel as hand-encoded wire bytes
(``encode_chunk``, byte-identical to ``SerializeToString``) and are read back as memoryview
slices (``parse_chunk``); other clients see ordinary FetchWeightsResponse messages. CRC-32 and
the copy into place run in one worker thread while a second one hashes the same chunk (zlib,
numpy and hashlib release the GIL), all overlapping the next chunk's arrival.
Buffers come from ``new_buffer``, never bytearray(n), whose zero-fill is a whole extra pass.

torch is imported lazily: common/ is installed on hosts without it (env servers).
"""

from common.weights.format import (
    FORMAT,
    MAX_CHUNK_BYTES,
    WeightsCorrupted,
    build_manifest,
    canonical_text,
    check_manifest,
    manifest_digest,
    new_buffer,
    tensors_from_buffer,
)
from common.weights.wire import (
    Chunk,
    chunk_spans,
    encode_chunk,
    iter_chunk_bytes,
    iter_chunks,
    parse_chunk,
)

__all__ = [
    "FORMAT",
    "MAX_CHUNK_BYTES",
    "Chunk",
    "WeightsCorrupted",
    "build_manifest",
    "canonical_text",
    "check_manifest",
    "chunk_spans",
    "encode_chunk",
    "iter_chunk_bytes",
    "iter_chunks",
    "manifest_digest",
    "new_buffer",
    "parse_chunk",
    "tensors_from_buffer",
]
