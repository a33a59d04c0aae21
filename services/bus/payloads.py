"""Messages too large for one NATS message travel by reference (bus.v1.PayloadRef).

`Bus.publish` stores the serialized message as an object in a JetStream object store bucket
(one per subject: ``PAYLOADS_<subject with dots as underscores>``) under its Nats-Msg-Id and
publishes a PayloadRef in its place, with the header ``Rlfleet-Payload: ref`` and the original
type in ``Rlfleet-Type``. A pull consumer resolves it before handing the delivery out: it
fetches the object, checks size and SHA-256, and parses the bytes as the original type, so
consumers see the message as if it had been sent inline. Storing under the message id keeps a
retried publish idempotent (the same object is overwritten, the duplicate message dropped).

Objects are deleted once the message is acknowledged (nothing redelivers it after that); the
bucket's max age removes what a crashed consumer left behind. It must be longer than the time a
message can wait unacknowledged (the learner acks at its checkpoints).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import nats.errors
import nats.js.errors

from rlfleet.bus.v1 import trajectory_pb2
from services.bus.subjects import payload_bucket
from services.errors import InvalidArgument, Unavailable

__all__ = ["PAYLOAD_HEADER", "PayloadStore", "bucket_for"]

log = logging.getLogger("rlfleet.bus")

PAYLOAD_HEADER = "Rlfleet-Payload"  # "ref": the payload is a PayloadRef to resolve
MAX_AGE_S = 6 * 3600.0


def bucket_for(subject: str) -> str:
    """The object store bucket for payloads published on ``subject``."""
    return payload_bucket(subject)


class PayloadStore:
    """Object store buckets of one Bus connection, opened (or created, in ``replicas`` copies)
    on first use."""

    def __init__(self, js: Any, *, replicas: int, max_age_s: float = MAX_AGE_S) -> None:
        self._js = js
        self.replicas = replicas  # the Bus's: a bucket is replicated like the stream it serves
        self.max_age_s = max_age_s
        self._buckets: dict[str, Any] = {}

    async def _bucket(self, name: str, *, create: bool) -> Any:
        if name not in self._buckets:
            try:
                self._buckets[name] = await self._js.object_store(name)
            except nats.js.errors.BucketNotFoundError:
                if not create:
                    raise
                from nats.js.api import ObjectStoreConfig

                config = ObjectStoreConfig(bucket=name, ttl=self.max_age_s, replicas=self.replicas)
                self._buckets[name] = await self._js.create_object_store(name, config=config)
        return self._buckets[name]

    async def ensure(self, subject: str) -> None:
        """Create the bucket of ``subject`` if missing (the launcher does, under NATS auth,
        where publishers may use the bucket but not create it)."""
        await self.ensure_bucket(bucket_for(subject))

    async def ensure_bucket(self, bucket: str) -> None:
        """Create ``bucket`` if missing."""
        await self._bucket(bucket, create=True)

    async def store(self, bucket: str, name: str, data: bytes) -> None:
        """Put ``data`` under ``name`` in ``bucket`` (created on first use)."""
        try:
            store = await self._bucket(bucket, create=True)
            await store.put(name, data)
        except (TimeoutError, nats.errors.Error) as exc:
            what = f"storing {len(data)} bytes of {name!r} in {bucket}"
            raise Unavailable(f"{what}: {exc}") from exc

    async def fetch(self, bucket: str, name: str, where: str) -> bytes:
        """The bytes under ``name``; InvalidArgument when gone (the message naming it can never
        be read), Unavailable when NATS is."""
        try:
            store = await self._bucket(bucket, create=False)
            result = await store.get(name)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError) as exc:
            raise InvalidArgument(
                f"{where}: payload {bucket}/{name} is gone ({type(exc).__name__})",
                field="payload",
            ) from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise Unavailable(f"{where}: fetching payload {name}: {exc}") from exc
        return bytes(result.data or b"")

    async def put(
        self, subject: str, msg_id: str, data: bytes, type_name: str
    ) -> trajectory_pb2.PayloadRef:
        """Store ``data``; the PayloadRef to publish instead."""
        bucket = bucket_for(subject)
        await self.store(bucket, msg_id, data)
        return trajectory_pb2.PayloadRef(
            bucket=bucket,
            object=msg_id,
            message_type=type_name,
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )

    async def get(self, ref: trajectory_pb2.PayloadRef, where: str) -> bytes:
        """The referenced bytes, checked; InvalidArgument when gone or corrupt (the message can
        never be read: the consumer terminates it), Unavailable when NATS is."""
        data = await self.fetch(ref.bucket, ref.object, where)
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise InvalidArgument(
                f"{where}: payload {ref.object} is {len(data)} bytes with another digest than "
                f"its reference ({ref.size} bytes, sha256 {ref.sha256[:12]}...)",
                field="payload",
            )
        return data

    async def delete(self, ref: trajectory_pb2.PayloadRef) -> None:
        """Remove an object after its message was acknowledged (best effort: max age backs it)."""
        try:
            store = await self._bucket(ref.bucket, create=False)
            await store.delete(ref.object)
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("deleting payload %s/%s: %s", ref.bucket, ref.object, exc)
