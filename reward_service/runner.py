"""Running reward functions over a batch, each within its time budget, isolated from the server.

A reward function is user code (an entry-point plugin, a reward model), so nothing it does may
stop or stall the server that runs it:

- Sync functions (and reward models) run on a bounded pool of daemon worker threads
  (``worker_threads``, at most ``max_threads_per_function`` of them for one function; a call
  beyond that waits, within its budget, for a free one). Async functions run on an event loop
  of their own in a thread of their own (one per async function, started on its first call),
  never on the server's loop: a coroutine that blocks (``time.sleep``, a CPU loop) freezes its
  own function only. A sync function returning an awaitable has it awaited there too.
- Whatever a function raises, BaseException included (SystemExit, KeyboardInterrupt,
  GeneratorExit, a CancelledError of its own), is caught where it runs and comes back as a
  value: INTERNAL on the items concerned, naming the exception type. Only the server's own
  cancellation (the caller went away, the server stops) propagates. Its return value is checked
  there as well: one finite number or None per item, else an error for the items concerned
  saying what was wrong (NaN, an infinity, a non-number, the wrong length).
- If the batch call raises, the function is called again on each item alone, so one bad item
  costs only its own score.
- Each call has a hard deadline, the function's budget over the request. When it runs out, the
  call is abandoned and the items not yet scored get DEADLINE_EXCEEDED; nothing waits for it.
  Python cannot stop a thread: an abandoned sync call keeps its worker until it returns, and its
  result is dropped; an abandoned async call is cancelled, which lands when its loop next gets
  control. Until then the call is *stuck*. A function with ``max_stuck_calls`` stuck calls is
  unavailable: its items get UNAVAILABLE at once, without calling it, until one of them returns.
  So a function that keeps hanging holds a few threads, never the whole pool.
- A misbehaviour (an exception type raised, a timeout, a refusal as unavailable) is logged once
  per function, with its name and what it did (a traceback for an exception); repeats go to the
  debug log and ``reward_misbehaviour_total{reward,what}``, and every one is in the reply.

Beyond what threads can guard against: a function calling ``os._exit``, crashing the
interpreter, or holding the GIL in C code for long. Only a separate process would contain those.
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
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import status_pb2

from reward_service.validation import Batch, Call
from rlfleet.reward.v1 import reward_pb2
from services.telemetry import metrics

__all__ = ["Outcome", "RewardRunner", "check_scores"]

log = logging.getLogger(__name__)

_CALLS = metrics.counter(
    "reward_scores_total", "Item scores produced, by reward and status.", ("reward", "status")
)
_SECONDS = metrics.histogram(
    "reward_function_seconds", "Wall time of one reward function over one request.", ("reward",)
)
_MISBEHAVIOUR = metrics.counter(
    "reward_misbehaviour_total",
    "Reward function calls that raised (what=raised), overran their budget (timeout) or were "
    "refused because earlier calls are stuck (unavailable).",
    ("reward", "what"),
)
_STUCK = metrics.gauge(
    "reward_stuck_calls", "Abandoned calls of a reward function still running.", ("reward",)
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


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _raised(name: str, exc: BaseException) -> Outcome:
    return _error(grpc.StatusCode.INTERNAL, f"reward '{name}' raised {_describe(exc)}")


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


# What a call gives back from the thread or loop it ran on: never an exception in flight.
@dataclass(frozen=True)
class _Scored:
    outcomes: list[Outcome]


@dataclass(frozen=True)
class _Raised:
    exc: BaseException


@dataclass(frozen=True)
class _Pending:
    """A sync function returned an awaitable (a partial of an async function, say)."""

    awaitable: Awaitable[Any]


_Result = _Scored | _Raised | _Pending


class _PluginRaised(Exception):
    """The function raised ``exc`` (any BaseException), carried as an ordinary exception."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(_describe(exc))
        self.exc = exc


class _Unavailable(Exception):
    """The function is refused without being called (too many stuck calls, or shutting down)."""


def _drop(result: _Result) -> None:
    """Forget the result of an abandoned call (closing an unawaited coroutine quietly)."""
    if isinstance(result, _Pending) and inspect.iscoroutine(result.awaitable):
        with contextlib.suppress(BaseException):
            result.awaitable.close()


def _settle(future: asyncio.Future[_Result], result: _Result) -> None:
    if not future.done():  # abandoned meanwhile
        future.set_result(result)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class _Ticket:
    """One call's fate; read and written under the runner's lock."""

    finished: bool = False
    abandoned: bool = False
    started: float = field(default_factory=time.monotonic)


class _PluginLoop:
    """An event loop in a daemon thread, running one async function's calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"reward-{name}-loop", daemon=True)
        self._thread.start()

    def call_soon(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # closed: the server is stopping
            self.loop.call_soon_threadsafe(callback)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        while not self._closing:
            try:
                self.loop.run_forever()
            except BaseException as exc:
                # A callback the plugin scheduled itself raised SystemExit or KeyboardInterrupt
                # (the calls themselves are guarded): keep the loop going for the next call.
                log.warning(
                    "reward %s: its event loop stopped on %s; restarting it",
                    self.name,
                    _describe(exc),
                )
        with contextlib.suppress(BaseException):
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        with contextlib.suppress(BaseException):
            self.loop.close()

    def close(self) -> None:
        self._closing = True
        self.call_soon(self.loop.stop)


async def _guarded(make: Callable[[], Awaitable[Any]], name: str, n: int) -> _Scored | _Raised:
    """Run on a plugin loop: the call's awaitable, with whatever it raises as a value."""
    try:
        return _Scored(check_scores(name, await make(), n))
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the runner abandoned this call
        return _Raised(exc)  # a CancelledError of the function's own
    except BaseException as exc:
        return _Raised(exc)


@dataclass
class _Function:
    """What the runner tracks of one reward function; read and written under its lock."""

    name: str
    threads: int = 0  # pool workers it holds, stuck calls included
    stuck: int = 0  # calls abandoned and still running
    loop: _PluginLoop | None = None
    noted: set[str] = field(default_factory=set)


class RewardRunner:
    """Runs reward functions for one server: the worker pool, the async functions' loops, the
    stuck-call accounting. `run` never raises but for cancellation; `close` at server stop."""

    def __init__(
        self,
        *,
        worker_threads: int = 64,
        max_threads_per_function: int = 16,
        max_stuck_calls: int = 4,
    ) -> None:
        if not 1 <= max_stuck_calls <= max_threads_per_function <= worker_threads:
            raise ValueError(
                "need 1 <= max_stuck_calls <= max_threads_per_function <= worker_threads, got "
                f"{max_stuck_calls}, {max_threads_per_function}, {worker_threads}"
            )
        self.worker_threads = worker_threads
        self.max_threads_per_function = max_threads_per_function
        self.max_stuck_calls = max_stuck_calls
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = 0  # workers started (they never exit before close)
        self._busy = 0  # jobs handed to the pool and not finished: always <= self._threads
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._functions: dict[str, _Function] = {}
        self._closed = False

    # ------------------------------------------------------------------ one call over a batch

    async def run(self, call: Call, batch: Batch) -> list[Outcome]:
        """One outcome per item for ``call`` over ``batch``; never raises (except cancellation)."""
        name = call.reward.name
        fn = self._function(name)
        outcomes: list[Outcome | None] = [None] * len(batch)
        started = time.monotonic()
        late = _error(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"reward '{name}' ran out of its {call.timeout_s:g}s budget before scoring this item",
        )
        try:
            async with asyncio.timeout(call.timeout_s):
                await self._score_batch(fn, call, batch, outcomes)
        except TimeoutError:
            self._note(
                fn,
                "timeout",
                "timeout",
                f"reward '{name}' overran its {call.timeout_s:g}s budget; the call was abandoned",
            )
        except _Unavailable as exc:
            late = _error(grpc.StatusCode.UNAVAILABLE, str(exc))
            self._note(fn, "unavailable", "unavailable", str(exc))
        final = [o if o is not None else late for o in outcomes]
        _SECONDS.labels(name).observe(time.monotonic() - started)
        for status, count in collections.Counter(o.status for o in final).items():
            _CALLS.labels(name, _STATUS_NAMES[status]).inc(count)
        return final

    async def _score_batch(
        self, fn: _Function, call: Call, batch: Batch, outcomes: list[Outcome | None]
    ) -> None:
        """Fill ``outcomes`` in place, so the items scored before a timeout keep their scores."""
        name = call.reward.name
        try:
            outcomes[:] = await self._invoke(fn, call, batch)
            return
        except _PluginRaised as raised:
            self._note_raised(fn, raised.exc)
            if len(batch) == 1:
                outcomes[0] = _raised(name, raised.exc)
                return
        for i in range(len(batch)):  # the batch call raised: one bad item costs only its own
            try:
                outcomes[i] = (await self._invoke(fn, call, batch.item(i)))[0]
            except _PluginRaised as raised:
                self._note_raised(fn, raised.exc)
                outcomes[i] = _raised(name, raised.exc)

    async def _invoke(self, fn: _Function, call: Call, batch: Batch) -> list[Outcome]:
        reward = call.reward
        n = len(batch)
        kwargs = reward.call_kwargs({**batch.columns(), **call.kwargs})
        # Completions go first and positionally, as in ``f(completions, **kwargs)``, whatever the
        # function calls its first parameter.
        result: _Result
        if _is_async(reward.fn):
            result = await self._on_loop(
                fn, lambda: reward.fn(batch.completions, **kwargs), reward.name, n
            )
        else:
            result = await self._on_worker(
                fn, lambda: reward.fn(batch.completions, **kwargs), reward.name, n
            )
            if isinstance(result, _Pending):
                awaitable = result.awaitable
                result = await self._on_loop(fn, lambda: awaitable, reward.name, n)
        if isinstance(result, _Raised):
            raise _PluginRaised(result.exc)
        assert isinstance(result, _Scored)
        return result.outcomes

    # ------------------------------------------------------------------ sync: the worker pool

    async def _on_worker(
        self, fn: _Function, target: Callable[[], Any], name: str, n: int
    ) -> _Result:
        await self._acquire(fn)  # no await between this and the put: the slot is not lost
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_Result] = loop.create_future()
        ticket = _Ticket()
        context = contextvars.copy_context()  # the request id reaches the function's log lines

        def job() -> None:
            thread = threading.current_thread()
            idle_name, thread.name = thread.name, f"{thread.name}:{name}"
            result: _Result
            try:
                value = context.run(target)
                if inspect.isawaitable(value):
                    result = _Pending(value)
                else:
                    result = _Scored(check_scores(name, value, n))
            except BaseException as exc:
                result = _Raised(exc)
            thread.name = idle_name
            if self._finish(fn, ticket, thread=True):
                _drop(result)
                return
            # RuntimeError: the loop is gone (the server stopped while this call ran).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, done, result)

        self._jobs.put(job)
        return await self._wait(fn, ticket, done)

    async def _acquire(self, fn: _Function) -> None:
        """Take a worker for ``fn``, waiting (cancellably) while the pool or its share is full."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                self._check_available(fn)
                if self._busy < self.worker_threads and fn.threads < self.max_threads_per_function:
                    self._busy += 1
                    fn.threads += 1
                    if self._busy > self._threads:
                        self._threads += 1
                        threading.Thread(
                            target=self._worker, name=f"reward-worker-{self._threads}", daemon=True
                        ).start()
                    return
                waiter: asyncio.Future[None] = loop.create_future()
                entry = (loop, waiter)
                self._waiters.append(entry)
            try:
                await waiter
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._waiters.remove(entry)

    def _worker(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()  # never raises: it catches what the function raises

    # ------------------------------------------------------------------ async: a loop apiece

    async def _on_loop(
        self, fn: _Function, make: Callable[[], Awaitable[Any]], name: str, n: int
    ) -> _Result:
        with self._lock:
            self._check_available(fn)
            if fn.loop is None:
                fn.loop = _PluginLoop(fn.name)
            plugin = fn.loop
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_Result] = loop.create_future()
        ticket = _Ticket()
        context = contextvars.copy_context()
        tasks: list[asyncio.Task[_Scored | _Raised]] = []

        def finished(task: asyncio.Task[_Scored | _Raised]) -> None:
            result: _Result
            result = _Raised(asyncio.CancelledError()) if task.cancelled() else task.result()
            if self._finish(fn, ticket, thread=False):
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, done, result)

        def start() -> None:
            task = plugin.loop.create_task(_guarded(make, name, n), context=context)
            tasks.append(task)
            task.add_done_callback(finished)

        def cancel() -> None:
            for task in tasks:
                task.cancel()

        plugin.call_soon(start)
        try:
            return await self._wait(fn, ticket, done)
        except asyncio.CancelledError:
            if ticket.abandoned:
                plugin.call_soon(cancel)  # queued after start(): the task exists by then
            raise

    # ------------------------------------------------------------------ accounting

    async def _wait(self, fn: _Function, ticket: _Ticket, done: asyncio.Future[_Result]) -> _Result:
        try:
            return await done
        except asyncio.CancelledError:  # the budget ran out, or the server's own cancellation
            with self._lock:
                if not ticket.finished:
                    ticket.abandoned = True
                    fn.stuck += 1
                    _STUCK.labels(fn.name).set(fn.stuck)
            raise

    def _finish(self, fn: _Function, ticket: _Ticket, *, thread: bool) -> bool:
        """Record that a call returned (from its thread or loop); True if it had been abandoned."""
        with self._lock:
            ticket.finished = True
            if thread:
                self._busy -= 1
                fn.threads -= 1
            recovered = False
            if ticket.abandoned:
                recovered = fn.stuck == self.max_stuck_calls
                fn.stuck -= 1
                _STUCK.labels(fn.name).set(fn.stuck)
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake, waiter)
        if ticket.abandoned:
            took = time.monotonic() - ticket.started
            log.debug("reward %s: an abandoned call returned after %.1fs", fn.name, took)
            if recovered:
                self._note(
                    fn, "available", None, f"reward '{fn.name}' is available again", logging.INFO
                )
        return ticket.abandoned

    def _check_available(self, fn: _Function) -> None:
        """Under the lock: refuse a function with too many stuck calls (or a closed runner)."""
        if self._closed:
            raise _Unavailable(f"reward '{fn.name}' is unavailable: the server is stopping")
        if fn.stuck >= self.max_stuck_calls:
            raise _Unavailable(
                f"reward '{fn.name}' is unavailable: {fn.stuck} earlier calls overran their "
                "budget and are still running (it is called again once one returns)"
            )

    def _function(self, name: str) -> _Function:
        with self._lock:
            fn = self._functions.get(name)
            if fn is None:
                fn = self._functions[name] = _Function(name)
            return fn

    def _note_raised(self, fn: _Function, exc: BaseException) -> None:
        self._note(
            fn,
            f"raised {type(exc).__name__}",
            "raised",
            f"reward '{fn.name}' raised {_describe(exc)}",
            exc_info=exc,
        )

    def _note(
        self,
        fn: _Function,
        key: str,
        what: str | None,
        message: str,
        level: int = logging.WARNING,
        exc_info: BaseException | None = None,
    ) -> None:
        """Log a misbehaviour the first time ``fn`` shows it, at debug level after that."""
        if what is not None:
            _MISBEHAVIOUR.labels(fn.name, what).inc()
        with self._lock:
            first = key not in fn.noted
            fn.noted.add(key)
        if first and what is None:
            log.log(level, "%s", message)
        elif first:
            log.log(
                level,
                "%s (logged once per reward and kind; later ones only at debug level and in "
                "reward_misbehaviour_total)",
                message,
                exc_info=exc_info,
            )
        else:
            log.debug("%s", message)

    def close(self) -> None:
        """Stop the idle workers and the async functions' loops (stuck calls are left behind:
        their threads are daemons)."""
        with self._lock:
            self._closed = True
            threads = self._threads
            loops = [fn.loop for fn in self._functions.values() if fn.loop is not None]
        for _ in range(threads):
            self._jobs.put(None)
        for plugin in loops:
            plugin.close()
