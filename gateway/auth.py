"""API keys: ``Authorization: Bearer <key>``, each with its own rate limits.

With no keys configured the gateway is open and every request shares one unlimited
``anonymous`` limiter. Keys are compared in constant time. Wrong keys are counted per client
address (``FailedAuthThrottle``): past ``auth_max_failures`` in ``auth_failure_window_s`` the
address gets 429 for every request until the window has passed.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping, Sequence

from gateway import metrics
from gateway.errors import ApiError, RateLimited
from gateway.limits import FailedAuthThrottle, KeyLimiter
from gateway.settings import ApiKey

__all__ = ["Authenticator"]


class Authenticator:
    def __init__(
        self,
        keys: Sequence[ApiKey],
        environ: Mapping[str, str] | None = None,
        *,
        max_failures: int | None = None,
        failure_window_s: float = 60.0,
    ) -> None:
        self._keys: list[tuple[bytes, KeyLimiter]] = []
        for i, key in enumerate(keys):
            name = key.name or key.key_env or f"key-{i}"
            secret = key.secret(environ).encode()
            self._keys.append((secret, KeyLimiter(name, key.rpm, key.tpm)))
        self.anonymous = KeyLimiter("anonymous")
        self.throttle = FailedAuthThrottle(max_failures, failure_window_s) if max_failures else None

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None, address: str | None = None) -> KeyLimiter:
        """The key's limiter; 401 for a missing or unknown key (when keys are configured), 429
        while ``address`` (the client's) is locked out for sending too many wrong keys."""
        if not self._keys:
            return self.anonymous
        if self.throttle is not None and address is not None:
            wait = self.throttle.locked_for(address)
            if wait > 0:
                metrics.RATE_LIMITED.labels("unauthenticated", "failed_auth").inc()
                raise RateLimited(
                    "Too many requests with an incorrect API key from your address. "
                    f"Please try again in {max(1, math.ceil(wait))}s.",
                    kind="requests",
                    retry_after_s=wait,
                    code="too_many_failed_auth_attempts",
                )
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
            if self.throttle is not None and address is not None:
                self.throttle.fail(address)
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
