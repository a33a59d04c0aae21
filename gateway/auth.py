"""API keys: ``Authorization: Bearer <key>``, each with its own rate limits.

With no keys configured the gateway is open and every request shares one unlimited
``anonymous`` limiter. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from gateway import metrics
from gateway.errors import ApiError, RateLimited
from gateway.limits import KeyLimiter
from gateway.settings import ApiKey

__all__ = ["Authenticator"]


class Authenticator:
    def __init__(self, keys: Sequence[ApiKey], environ: Mapping[str, str] | None = None) -> None:
        self._keys: list[tuple[bytes, KeyLimiter]] = []
        for i, key in enumerate(keys):
            name = key.name or key.key_env or f"key-{i}"
            secret = key.secret(environ).encode()
            self._keys.append((secret, KeyLimiter(name, key.rpm, key.tpm)))
        self.anonymous = KeyLimiter("anonymous")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> KeyLimiter:
        """The key's limiter; 401 for a missing or unknown key (when keys are configured)."""
        if not self._keys:
            return self.anonymous
        if not authorization:
            raise ApiError(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                status=401,
                type="invalid_request_error",
                code="missing_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode()
        found: KeyLimiter | None = None
        for secret, limiter in self._keys:
            if hmac.compare_digest(secret, given) and scheme.lower() == "bearer":
                found = limiter
        if found is None:
            raise ApiError(
                "Incorrect API key provided.",
                status=401,
                type="invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found

    def admit(self, limiter: KeyLimiter) -> None:
        """429 with Retry-After when the key is over one of its limits."""
        refused = limiter.admit()
        if refused is None:
            return
        kind, wait = refused
        metrics.RATE_LIMITED.labels(limiter.name, kind).inc()
        per = "RPM" if kind == "requests" else "TPM"
        limit = limiter.rpm if kind == "requests" else limiter.tpm
        raise RateLimited(
            f"Rate limit reached for key {limiter.name} on {kind} per minute ({per}): "
            f"limit {limit}. Please try again in {wait:.1f}s.",
            kind=kind,
            retry_after_s=wait,
        )
