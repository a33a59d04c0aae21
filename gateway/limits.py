"""Per-key rate limits: token buckets for requests and tokens per minute.

Requests are charged one at admission. Tokens are post-paid, as the real count is only known
once the sampler has tokenized the prompt and generated: admission needs the token bucket out of
debt, and the prompt and completion tokens are charged as they become known (the bucket may go
negative; a key in debt waits until it has refilled, which ``retry_after_s`` says).

``FailedAuthThrottle`` counts wrong API keys per client address and locks an address out for a
while once it has sent too many.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["FailedAuthThrottle", "KeyLimiter", "TokenBucket"]


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


@dataclass
class FailedAuthThrottle:
    """``max_failures`` wrong keys from one address within ``window_s`` lock it out for
    ``window_s``. While locked, the caller refuses the address's requests without checking
    their key: a right guess must look the same as a wrong one, or the lock would not slow
    guessing down. Tracks at most ``max_addresses`` addresses (the least recent are dropped)."""

    max_failures: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    max_addresses: int = 65_536
    _failures: OrderedDict[str, deque[float]] = field(init=False, default_factory=OrderedDict)
    _locked: OrderedDict[str, float] = field(init=False, default_factory=OrderedDict)

    def locked_for(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: not locked)."""
        until = self._locked.get(address)
        if until is None:
            return 0.0
        left = until - self.clock()
        if left <= 0:
            del self._locked[address]
            return 0.0
        return left

    def fail(self, address: str) -> None:
        """One wrong key from ``address``; the one that reaches ``max_failures`` locks it."""
        now = self.clock()
        times = self._failures.pop(address, None) or deque()
        while times and now - times[0] >= self.window_s:
            times.popleft()
        times.append(now)
        if len(times) >= self.max_failures:
            self._locked[address] = now + self.window_s
            self._locked.move_to_end(address)
            _trim(self._locked, self.max_addresses)
            return
        self._failures[address] = times  # re-inserted last: the dict is in recency order
        _trim(self._failures, self.max_addresses)


V = TypeVar("V")


def _trim(table: OrderedDict[str, V], size: int) -> None:
    while len(table) > size:
        table.popitem(last=False)
