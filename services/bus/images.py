"""A run's prompt images, by content: JetStream object store bucket ``IMAGES_<run>``.

Bus messages never carry image bytes (a prompt of a few images would fill a NATS message): the
prompt feeder stores each image under its SHA-256 and the messages name it (``Image.sha256``,
``TrajectoryGroup.image_sha256``). Rollout drivers fetch the bytes to send them inline to a
sampler over gRPC; the learner fetches the same bytes to recompute log-probabilities on exactly
the pixels the sampler saw. Every fetch is checked against its digest.

Objects expire with the bucket's max age; the feeder stores an image again when it queues a task
that names it after half that age, so an image outlives every task queued with it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

from services.bus.payloads import PayloadStore
from services.bus.subjects import images_bucket
from services.errors import InvalidArgument

__all__ = ["ImageStore"]


class ImageStore:
    """Put and fetch one run's images by digest, with a small cache of fetched bytes."""

    def __init__(self, payloads: PayloadStore, run: str, *, cache_size: int = 512) -> None:
        self.payloads = payloads
        self.bucket = images_bucket(run)
        self.cache_size = cache_size
        self._stored: dict[str, float] = {}  # digest -> when this process last stored it
        self._cache: OrderedDict[str, bytes] = OrderedDict()

    async def ensure(self) -> None:
        """Create the bucket (the launcher does: under NATS auth services may not)."""
        await self.payloads.ensure_bucket(self.bucket)

    async def put(self, data: bytes) -> str:
        """Store ``data`` (once per half max age); its digest."""
        digest = hashlib.sha256(data).hexdigest()
        now = time.monotonic()
        if now - self._stored.get(digest, -1e18) > self.payloads.max_age_s / 2:
            await self.payloads.store(self.bucket, digest, data)
            self._stored[digest] = now
        return digest

    async def get(self, digest: str, where: str) -> bytes:
        """The bytes of ``digest``, checked; InvalidArgument when gone or not matching,
        Unavailable when NATS is."""
        data = self._cache.get(digest)
        if data is not None:
            self._cache.move_to_end(digest)
            return data
        data = await self.payloads.fetch(self.bucket, digest, where)
        if hashlib.sha256(data).hexdigest() != digest:
            raise InvalidArgument(
                f"{where}: image {digest[:12]}... in {self.bucket} has another digest",
                field="image_sha256",
            )
        self._cache[digest] = data
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return data
