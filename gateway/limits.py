"""Per-key rate limits: token buckets for requests and tokens per minute.

Requests are charged one at admission. Tokens are post-paid, as the real count is only known
once the sampler has tokenized the prompt and generated: admission needs the token bucket out of
debt, and the prompt and completion tokens are charged as they become known (the bucket may go
negative; a key in debt waits until it has refilled, which ``retry_after_s`` says).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["KeyLimiter", "TokenBucket"]


@dataclass
class TokenBucket:
    """``capacity`` units, refilled at ``rate`` units per second."""

    capacity: float
    rate: float
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    _at: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = self.capacity
        self._at = self.clock()

    @classmethod
    def per_minute(cls, amount: int, clock: Callable[[], float] = time.monotonic) -> TokenBucket:
        return cls(capacity=float(amount), rate=amount / 60.0, clock=clock)

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now

    def try_take(self, amount: float = 1.0) -> float:
        """Take ``amount`` and return 0, or take nothing and return the seconds until it is
        there."""
        self._refill()
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def wait_needed(self, minimum: float = 1.0) -> float:
        """Seconds until the bucket holds ``minimum`` (0 if it does)."""
        self._refill()
        return max(0.0, (minimum - self.level) / self.rate)

    def charge(self, amount: float) -> None:
        """Take ``amount`` even into debt."""
        self._refill()
        self.level -= amount


@dataclass
class KeyLimiter:
    """The limits of one API key (None = unlimited)."""

    name: str
    rpm: int | None = None
    tpm: int | None = None
    clock: Callable[[], float] = time.monotonic
    requests: TokenBucket | None = field(init=False, default=None)
    tokens: TokenBucket | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.rpm:
            self.requests = TokenBucket.per_minute(self.rpm, self.clock)
        if self.tpm:
            self.tokens = TokenBucket.per_minute(self.tpm, self.clock)

    def admit(self) -> tuple[str, float] | None:
        """None when the request may go, else (limit name, seconds to wait)."""
        if self.tokens is not None:
            wait = self.tokens.wait_needed(1.0)
            if wait > 0:
                return "tokens", wait
        if self.requests is not None:
            wait = self.requests.try_take(1.0)
            if wait > 0:
                return "requests", wait
        return None

    def charge_tokens(self, count: int) -> None:
        if self.tokens is not None and count > 0:
            self.tokens.charge(count)
