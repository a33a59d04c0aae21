"""Running one reward function over a batch, within its time budget, item by item if need be.

- Sync functions run in a thread of their own, async ones are awaited on the loop.
- If the batch call raises, the function is called again on each item alone, so one bad item
  costs only its own score (INTERNAL, naming the exception type).
- A result that is not one finite number or None per item is an error for the items concerned,
  with a message saying what was wrong (NaN, an infinity, a non-number, the wrong length).
- When the budget runs out, items not yet scored get DEADLINE_EXCEEDED.

Python cannot stop a thread: a sync function that overruns its budget keeps running in its
thread until it returns on its own, and its result is dropped. That is why every call gets a
fresh daemon thread rather than a slot in asyncio's default executor (a few workers per core):
abandoned calls there would starve every later request and the rest of the process. A function
that never returns leaks one thread per call; the per-request timeout and the concurrency cap
keep that visible (``reward_scores_total{status="error"}`` and the log) rather than fatal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import status_pb2

from reward_service.validation import Batch, Call
from rlfleet.reward.v1 import reward_pb2
from services.telemetry import metrics

__all__ = ["Outcome", "run_call"]

log = logging.getLogger(__name__)

_CALLS = metrics.counter(
    "reward_scores_total", "Item scores produced, by reward and status.", ("reward", "status")
)
_SECONDS = metrics.histogram(
    "reward_function_seconds", "Wall time of one reward function over one request.", ("reward",)
)
_STATUS_NAMES = {
    reward_pb2.SCORE_STATUS_OK: "ok",
    reward_pb2.SCORE_STATUS_ABSTAINED: "abstained",
    reward_pb2.SCORE_STATUS_ERROR: "error",
}


@dataclass(frozen=True)
class Outcome:
    """One function's result on one item."""

    status: reward_pb2.ScoreStatus
    score: float = 0.0
    error: status_pb2.Status | None = None


def _error(code: grpc.StatusCode, message: str) -> Outcome:
    return Outcome(
        reward_pb2.SCORE_STATUS_ERROR, error=status_pb2.Status(code=code.value[0], message=message)
    )


def _raised(name: str, exc: BaseException) -> Outcome:
    text = str(exc)
    detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return _error(grpc.StatusCode.INTERNAL, f"reward '{name}' raised {detail}")


def _one_score(name: str, value: Any) -> Outcome:
    if value is None:
        return Outcome(reward_pb2.SCORE_STATUS_ABSTAINED)
    if isinstance(value, numbers.Real):
        score = float(value)
        if math.isfinite(score):
            return Outcome(reward_pb2.SCORE_STATUS_OK, score=score)
        what = "NaN" if math.isnan(score) else ("+inf" if score > 0 else "-inf")
        return _error(grpc.StatusCode.INTERNAL, f"reward '{name}' returned {what}")
    return _error(
        grpc.StatusCode.INTERNAL,
        f"reward '{name}' returned a non-number ({type(value).__name__}: {value!r:.60})",
    )


def check_scores(name: str, result: Any, n: int) -> list[Outcome]:
    """Per-item outcomes of a function's return value for ``n`` items."""
    if hasattr(result, "tolist") and not isinstance(result, list | tuple):
        result = result.tolist()  # numpy array or torch tensor
    if not isinstance(result, list | tuple):
        return [
            _error(
                grpc.StatusCode.INTERNAL,
                f"reward '{name}' returned {type(result).__name__}, not a list of scores",
            )
        ] * n
    if len(result) != n:
        return [
            _error(
                grpc.StatusCode.INTERNAL,
                f"reward '{name}' returned a list of the wrong length: {len(result)} scores "
                f"for {n} items",
            )
        ] * n
    return [_one_score(name, v) for v in result]


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


async def _in_thread(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a new daemon thread (the module docstring says why no pool)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()  # the request id reaches the function's log lines

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():  # abandoned after a timeout or a cancelled call
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, exc = context.run(fn, *args, **kwargs), None
        except BaseException as raised:
            result, exc = None, raised
        # RuntimeError: the loop is gone (the server stopped while this call overran).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=work, name=f"reward-{name}", daemon=True).start()
    return await future


async def _invoke(call: Call, batch: Batch) -> Any:
    reward = call.reward
    kwargs = reward.call_kwargs({**batch.columns(), **call.kwargs})
    # Completions go first and positionally, as in ``f(completions, **kwargs)``, whatever the
    # function calls its first parameter.
    if _is_async(reward.fn):
        return await reward.fn(batch.completions, **kwargs)
    result = await _in_thread(reward.name, reward.fn, batch.completions, **kwargs)
    if inspect.isawaitable(result):  # e.g. a partial of an async function
        result = await result
    return result


async def _score_batch(call: Call, batch: Batch, outcomes: list[Outcome | None]) -> None:
    """Fill ``outcomes`` in place, so the items scored before a timeout keep their scores."""
    name = call.reward.name
    try:
        outcomes[:] = check_scores(name, await _invoke(call, batch), len(batch))
        return
    except Exception as exc:
        if len(batch) == 1:
            outcomes[0] = _raised(name, exc)
            return
        log.warning("reward %s failed on a batch; scoring item by item", name, exc_info=exc)
    for i in range(len(batch)):
        try:
            outcomes[i] = check_scores(name, await _invoke(call, batch.item(i)), 1)[0]
        except Exception as exc:
            outcomes[i] = _raised(name, exc)


async def run_call(call: Call, batch: Batch) -> list[Outcome]:
    """One outcome per item for ``call`` over ``batch``; never raises (except cancellation)."""
    name = call.reward.name
    outcomes: list[Outcome | None] = [None] * len(batch)
    started = time.monotonic()
    try:
        async with asyncio.timeout(call.timeout_s):
            await _score_batch(call, batch, outcomes)
    except TimeoutError:
        log.warning("reward %s ran out of its %gs budget", name, call.timeout_s)
    late = _error(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"reward '{name}' ran out of its {call.timeout_s:g}s budget before scoring this item",
    )
    final = [o if o is not None else late for o in outcomes]
    _SECONDS.labels(name).observe(time.monotonic() - started)
    for status, count in collections.Counter(o.status for o in final).items():
        _CALLS.labels(name, _STATUS_NAMES[status]).inc(count)
    return final
