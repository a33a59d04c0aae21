"""NATS subject and JetStream stream names for a run, in one place.

Every service builds its subjects here so that a typo cannot split a run across two subjects, and
so that run names are checked once: a run name becomes a subject token and part of a stream name,
where dots, wildcards or spaces would silently change what a subject matches.

Layout (docs/design.md, docs/internals.md):
    rlfleet.v1.traj.<run>                trajectories (JetStream stream ``RLFLEET_<RUN>``)
    rlfleet.v1.events.<run>.<kind>       events: episodes, metrics, weights, status (core NATS)
    rlfleet.v1.work.<run>.<queue>        prompt work queues (stream ``RLFLEET_<RUN>-WQ-<QUEUE>``)
"""

from __future__ import annotations

import re

from services.errors import InvalidArgument

__all__ = [
    "PREFIX",
    "events_subject",
    "events_wildcard",
    "service_permissions",
    "stream_name",
    "traj_subject",
    "validate_run_name",
    "validate_token",
    "work_queue_stream",
    "work_queue_subject",
]

PREFIX = "rlfleet.v1"

# Lower-case so that the upper-cased stream name maps back to exactly one run; no dots, spaces
# or wildcards so a name is always exactly one subject token.
_RUN_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
# Event kinds: one subject token.
_TOKEN_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def validate_run_name(name: str) -> str:
    """Return ``name`` if it is a valid run name, else raise InvalidArgument saying why."""
    if not isinstance(name, str) or not _RUN_RE.fullmatch(name):
        raise InvalidArgument(
            f"invalid run name {name!r}: expected 1-63 characters of lower-case letters, digits "
            "and '-', starting with a letter or digit (pattern [a-z0-9][a-z0-9-]{0,62})",
            field="run.name",
        )
    return name


def validate_token(value: str, what: str, *, underscore: bool = True) -> str:
    """Return ``value`` if it is a valid single subject token (event kind, queue name).

    Queue names (``underscore=False``) follow the run-name rules because they also end up in a
    stream name, where ``-`` and ``_`` would otherwise collide.
    """
    pattern = _TOKEN_RE if underscore else _RUN_RE
    if not isinstance(value, str) or not pattern.fullmatch(value):
        allowed = "'-' and '_'" if underscore else "'-'"
        raise InvalidArgument(
            f"invalid {what} {value!r}: expected 1-63 characters of lower-case letters, digits "
            f"and {allowed}, starting with a letter or digit",
            field=what,
        )
    return value


def traj_subject(run: str) -> str:
    """Subject the samplers publish trajectories (rollout fragments, groups) to."""
    return f"{PREFIX}.traj.{validate_run_name(run)}"


def events_subject(run: str, kind: str) -> str:
    """Subject of one event kind of a run (``episodes``, ``metrics``, ``weights``, ``status``)."""
    return f"{PREFIX}.events.{validate_run_name(run)}.{validate_token(kind, 'event kind')}"


def events_wildcard(run: str) -> str:
    """Subject filter matching every event of a run (the launcher's monitor subscribes to it)."""
    return f"{PREFIX}.events.{validate_run_name(run)}.>"


def stream_name(run: str) -> str:
    """JetStream stream holding a run's trajectories: ``RLFLEET_<RUN>``, ``-`` becomes ``_``.

    Stream names may not contain ``.``, ``*``, ``>`` or spaces; the validated run name has none.
    """
    return "RLFLEET_" + validate_run_name(run).upper().replace("-", "_")


def work_queue_subject(run: str, queue: str) -> str:
    """Subject of a prompt work queue (a stream with work-queue retention)."""
    queue = validate_token(queue, "queue name", underscore=False)
    return f"{PREFIX}.work.{validate_run_name(run)}.{queue}"


def work_queue_stream(run: str, queue: str) -> str:
    """Stream of one work queue: ``RLFLEET_<RUN>-WQ-<QUEUE>`` (upper case, ``-`` becomes ``_``).

    A work queue needs its own stream because retention is per stream: the run stream keeps
    trajectories by limits, a work queue deletes each message once it is acknowledged. The ``-``
    separators cannot occur in a run's stream name, so no (run, queue) pair collides with a run
    stream or with another pair.
    """
    queue = validate_token(queue, "queue name", underscore=False).upper().replace("-", "_")
    return f"{stream_name(run)}-WQ-{queue}"


def service_permissions(run: str) -> dict[str, tuple[str, ...]]:
    """What a service of ``run`` may do on NATS (the launcher's authorization): publish and
    subscribe on the run's own subjects, reply inboxes, and the JetStream API it uses (streams,
    consumers, acks, key-value, the object store of by-reference payloads), but never delete or
    purge a stream or a message, and touch no other run's subjects. Keyword arguments for
    ``NatsUser``."""
    own = (f"{PREFIX}.*.{validate_run_name(run)}", f"{PREFIX}.*.{run}.>")
    return {
        "publish_allow": (*own, "_INBOX.>", "$JS.API.>", "$JS.ACK.>", "$KV.>", "$O.>"),
        "publish_deny": (
            "$JS.API.STREAM.DELETE.>",
            "$JS.API.STREAM.PURGE.>",
            "$JS.API.STREAM.MSG.DELETE.>",
            "$JS.API.ACCOUNT.>",
        ),
        "subscribe_allow": (*own, "_INBOX.>", "$KV.>", "$O.>"),
    }
