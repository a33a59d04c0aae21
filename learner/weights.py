"""The learner's weight versions: a bounded in-memory store, the WeightService, announcements.

``WeightStore.publish`` snapshots the model's tensors into one contiguous buffer per version
(common.weights.build_manifest), so training may mutate the model as soon as it returns, and
every chunk a sampler asks for is a slice of that buffer. Chunk CRCs are computed on the first
fetch of a version and cached: all samplers fetch the same chunks, so later fetches only copy.

``WeightServicer`` streams chunks as pre-encoded wire bytes; register it with
``add_weight_service`` (not the generated ``add_WeightServiceServicer_to_server``), whose
FetchWeights serializer passes those bytes through.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import timestamp_pb2

from common.weights import MAX_CHUNK_BYTES, build_manifest, iter_chunk_bytes, new_buffer
from rlfleet.bus.v1 import events_pb2
from rlfleet.learner.v1 import weights_pb2, weights_pb2_grpc
from services.bus import MSG_ID_HEADER, Bus, events_subject, validate_run_name
from services.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.grpc_names import service_name

if TYPE_CHECKING:
    import torch

__all__ = [
    "MIN_CHUNK_BYTES",
    "SERVICE_NAME",
    "StoredVersion",
    "WeightServicer",
    "WeightStore",
    "add_weight_service",
    "announce",
]

SERVICE_NAME = service_name(weights_pb2, "WeightService")
# FetchWeightsRequest.max_chunk_bytes below this (other than 0) is INVALID_ARGUMENT.
MIN_CHUNK_BYTES = 64 << 10


@dataclass(eq=False)
class StoredVersion:
    """One kept version: its manifest, its bytes, and what serving it has learnt."""

    manifest: weights_pb2.WeightManifest
    payload: memoryview  # the stream, read-only; valid while the version is kept or pinned
    buffer: torch.Tensor | None = None  # uint8 tensor under payload, recycled after eviction
    crc_cache: dict[tuple[int, int], int] = field(default_factory=dict)  # (start, stop) -> CRC
    streams: int = 0  # FetchWeights calls reading it; pins it against eviction


class WeightStore:
    """The last ``keep`` published versions, in memory; thread-safe.

    ``start_version`` is the version the first ``publish`` gets (0 for a fresh run, the
    checkpoint's version + 1 for a restarted learner) so versions never repeat within a run.
    A version being streamed stays until its streams end, even past ``keep``. Memory: the kept
    (and streamed) versions plus one spare buffer, an evicted version's, that the next publish
    of the same size reuses.
    """

    def __init__(
        self,
        run: str,
        *,
        keep: int = 2,
        start_version: int = 0,
        base_model: str = "",
        hash_workers: int = 2,
    ) -> None:
        if keep < 1:
            raise InvalidArgument(f"keep must be >= 1, got {keep}", field="keep")
        if start_version < 0:
            raise InvalidArgument(f"start_version must be >= 0, got {start_version}")
        self.run = validate_run_name(run)
        self.keep = keep
        self.base_model = base_model
        self.hash_workers = hash_workers
        self._next_version = start_version
        self._versions: dict[int, StoredVersion] = {}  # insertion order = version order
        self._spare: torch.Tensor | None = None  # an evicted version's buffer, for reuse
        self._lock = threading.Lock()  # guards _versions, _spare and the stream counts
        self._publish_lock = threading.Lock()  # one snapshot at a time; versions in call order

    def publish(
        self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]
    ) -> weights_pb2.WeightManifest:
        """Snapshot ``named_tensors`` (e.g. a state_dict) as the next version; returns its manifest.

        CPU-bound (a copy and a SHA-256 of every byte, the hashing in threads): from async code
        call it through ``asyncio.to_thread`` so the WeightService keeps serving meanwhile.
        """
        with self._publish_lock:
            version = self._next_version
            allocated: list[torch.Tensor] = []

            def allocate(nbytes: int) -> torch.Tensor:
                allocated.append(self._allocate(nbytes))
                return allocated[-1]

            try:
                manifest, payload = build_manifest(
                    self.run,
                    version,
                    named_tensors,
                    base_model=self.base_model,
                    hash_workers=self.hash_workers,
                    allocate=allocate,
                )
            except BaseException:
                if allocated:  # keep the buffer for the next try
                    with self._lock:
                        self._spare = allocated[0]
                raise
            with self._lock:
                self._versions[version] = StoredVersion(manifest, payload, allocated[0])
                self._next_version = version + 1
                self._evict()
        return manifest

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """The spare buffer if it has the right size (the usual case: same model, next version),
        else a new one. Reusing memory already touched saves its page faults (see build_manifest).
        """
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == nbytes:
            return spare
        return new_buffer(nbytes)

    @property
    def next_version(self) -> int:
        """The version the next publish will get."""
        return self._next_version

    def versions(self) -> list[int]:
        """Versions held now, oldest first."""
        with self._lock:
            return list(self._versions)

    def get(self, version: int | None = None) -> StoredVersion:
        """A kept version (``None``: the latest); NotFound names the versions kept."""
        with self._lock:
            if version is None:
                if not self._versions:
                    raise Unavailable(f"run {self.run!r}: no weight version published yet")
                return self._versions[next(reversed(self._versions))]
            if version < 0:
                raise InvalidArgument(f"version must be >= 0, got {version}", field="version")
            entry = self._versions.get(version)
            if entry is None:
                raise NotFound(
                    f"run {self.run!r}: weight version {version} is not kept; kept versions: "
                    f"{list(self._versions) or 'none'} (next: {self._next_version})",
                    field="version",
                )
            return entry

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[StoredVersion]:
        """Hold ``version`` against eviction while a stream reads it."""
        with self._lock:
            entry = self._versions.get(version)
            if entry is not None:
                entry.streams += 1
        if entry is None:
            self.get(version)  # raises the NotFound naming the kept versions
            raise AssertionError("unreachable")  # pragma: no cover
        try:
            yield entry
        finally:
            with self._lock:
                entry.streams -= 1
                self._evict()

    def _evict(self) -> None:
        """Drop versions older than the newest ``keep`` that no stream reads (lock held)."""
        for version in list(self._versions)[: -self.keep]:
            entry = self._versions[version]
            if entry.streams == 0:
                del self._versions[version]
                # Nothing reads the buffer now: FetchWeights only reads a version it pinned.
                self._spare, entry.buffer = entry.buffer, None


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    """rlfleet.learner.v1.WeightService over a WeightStore."""

    # Who may call, by certificate kind (services/security.py; the launcher may call all):
    # whoever follows the learner's weights (actors, game links, samplers) and learners.
    CALLERS = dict.fromkeys(
        ("GetManifest", "FetchWeights", "ListVersions"),
        frozenset({"game_actor", "env_server", "sampler", "learner", "lm_learner", "dpo_learner"}),
    )

    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self._closing = False

    def begin_shutdown(self) -> None:
        """End running streams with UNAVAILABLE at their next chunk, so clients resume elsewhere
        instead of being cut off by the server's stop grace."""
        self._closing = True

    async def GetManifest(
        self, request: weights_pb2.GetManifestRequest, context: grpc.aio.ServicerContext
    ) -> weights_pb2.GetManifestResponse:
        version = request.version if request.HasField("version") else None
        return weights_pb2.GetManifestResponse(manifest=self.store.get(version).manifest)

    async def FetchWeights(
        self, request: weights_pb2.FetchWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Yields FetchWeightsResponse wire bytes (see add_weight_service)."""
        if request.version < 0:
            raise InvalidArgument(f"version must be >= 0, got {request.version}", field="version")
        if 0 < request.max_chunk_bytes < MIN_CHUNK_BYTES:
            # One-byte chunks would turn a fetch into millions of messages (CPU on both ends).
            raise InvalidArgument(
                f"max_chunk_bytes {request.max_chunk_bytes} is below the minimum of "
                f"{MIN_CHUNK_BYTES} (0: the maximum, {MAX_CHUNK_BYTES})",
                field="max_chunk_bytes",
            )
        with self.store.pinned(request.version) as entry:
            manifest = entry.manifest
            if request.expected_digest and request.expected_digest != manifest.digest:
                raise FailedPrecondition(
                    f"run {manifest.run!r} version {manifest.version} has digest "
                    f"{manifest.digest}, not the expected {request.expected_digest}",
                    field="expected_digest",
                )
            chunks = iter_chunk_bytes(
                manifest,
                entry.payload,
                request.start_offset,
                request.end_offset,
                request.max_chunk_bytes,
                crc_cache=entry.crc_cache,
            )
            for raw in chunks:
                if self._closing:
                    raise Unavailable(
                        f"learner shutting down; resume version {manifest.version} from the "
                        "byte after the last chunk received, elsewhere or later"
                    )
                yield raw

    async def ListVersions(
        self, request: weights_pb2.ListVersionsRequest, context: grpc.aio.ServicerContext
    ) -> weights_pb2.ListVersionsResponse:
        infos = []
        for version in self.store.versions():
            with contextlib.suppress(NotFound):  # evicted between the two calls
                m = self.store.get(version).manifest
                infos.append(
                    weights_pb2.WeightVersionInfo(
                        version=m.version,
                        digest=m.digest,
                        total_bytes=m.total_bytes,
                        num_tensors=len(m.tensors),
                        create_time=m.create_time,
                    )
                )
        return weights_pb2.ListVersionsResponse(run=self.store.run, versions=infos)


def _serialize_chunk(message: bytes | weights_pb2.FetchWeightsResponse) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_weight_service(servicer: Any, server: grpc.aio.Server) -> None:
    """Like the generated ``add_WeightServiceServicer_to_server``, but FetchWeights may yield
    pre-encoded bytes (or messages). Pass to ``GrpcServer.add_service(..., SERVICE_NAME)``."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "GetManifest": grpc.unary_unary_rpc_method_handler(
            servicer.GetManifest,
            request_deserializer=weights_pb2.GetManifestRequest.FromString,
            response_serializer=weights_pb2.GetManifestResponse.SerializeToString,
        ),
        "FetchWeights": grpc.unary_stream_rpc_method_handler(
            servicer.FetchWeights,
            request_deserializer=weights_pb2.FetchWeightsRequest.FromString,
            response_serializer=_serialize_chunk,
        ),
        "ListVersions": grpc.unary_unary_rpc_method_handler(
            servicer.ListVersions,
            request_deserializer=weights_pb2.ListVersionsRequest.FromString,
            response_serializer=weights_pb2.ListVersionsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def announce(
    bus: Bus,
    run: str,
    manifest: weights_pb2.WeightManifest,
    endpoint: str,
    *,
    taken_sequences: Mapping[str, int] | None = None,
) -> events_pb2.WeightsPublished:
    """Tell the run that ``manifest``'s version can be fetched from ``endpoint`` (host:port),
    and (game workloads) which fragments of each producer have been taken (TakenSequences).

    A core NATS event on ``rlfleet.v1.events.<run>.weights``: only live subscribers need it, and
    a sampler that missed one asks GetManifest for the latest anyway.
    """
    now = timestamp_pb2.Timestamp()
    now.GetCurrentTime()
    event = events_pb2.WeightsPublished(
        run=run,
        version=manifest.version,
        manifest_digest=manifest.digest,
        total_bytes=manifest.total_bytes,
        endpoint=endpoint,
        time=now,
        num_tensors=len(manifest.tensors),
        taken_sequences=taken_sequences or {},
    )
    msg_id = f"{run}/weights/{manifest.version}/{manifest.digest[:16]}"
    await bus.publish_event(events_subject(run, "weights"), event, headers={MSG_ID_HEADER: msg_id})
    return event
