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
    "DEFAULT_RIGHTS",
    "KIND_RIGHTS",
    "PREFIX",
    "QUEUE_DURABLE",
    "events_subject",
    "events_wildcard",
    "images_bucket",
    "inbox_prefix",
    "payload_bucket",
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


def members_bucket(run: str) -> str:
    """Key-value bucket of a run's membership (services/membership.py): ``<stream>-MEMBERS``."""
    return f"{stream_name(run)}-MEMBERS"


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


# What each service kind may do on NATS, one declaration per kind: names of the capabilities
# below. A kind not listed gets DEFAULT_RIGHTS. The launcher alone creates the run's streams,
# work queues, feeder bucket and payload bucket (launch/run_security.py); the learner may also
# create and update the run's stream (it does at start-up), nobody else may change one, and no
# one may delete or purge a stream or delete a consumer.
KIND_RIGHTS: dict[str, tuple[str, ...]] = {
    "learner": ("events", "publish_all_events", "manage_run_stream", "consume_trajectories"),
    "lm_learner": ("events", "publish_all_events", "manage_run_stream", "consume_trajectories"),
    "dpo_learner": ("events", "publish_all_events", "manage_run_stream", "consume_trajectories"),
    # publish_status: long waits say what they wait for (services/waits.py); publish_producers:
    # an env server's live game links (services/producers.py).
    # register: its own record in the run's membership bucket; follow_members: watch it.
    "game_actor": (
        "events",
        "publish_episodes",
        "publish_trajectories",
        "publish_status",
        "follow_members",
    ),
    "env_server": (  # its game links
        "events",
        "register",
        "publish_episodes",
        "publish_trajectories",
        "publish_status",
        "publish_producers",
    ),
    "rollout": (
        "events",
        "publish_metrics",
        "publish_trajectories",
        "feed_queue",
        "take_queue",
        "publish_status",
        "follow_members",
    ),
    "sampler": ("events", "publish_status", "publish_metrics", "register"),
    "reward_service": ("events", "publish_metrics", "register"),
    "gateway": ("events", "publish_metrics", "follow_members"),
    "heartbeat": ("events", "publish_metrics"),
}
DEFAULT_RIGHTS = ("events", "publish_metrics")
QUEUE_DURABLE = "rollout"  # the one consumer the drivers of a run share on a work queue

_API = "$JS.API"


def inbox_prefix(user: str) -> str:
    """Reply inbox prefix of NATS user ``user``: each user subscribes only to its own replies
    (JetStream answers, fetched messages), never to another service's."""
    return "_INBOX." + re.sub(r"[^A-Za-z0-9_-]", "_", user)


def payload_bucket(subject: str) -> str:
    """The object store bucket of messages published on ``subject`` by reference."""
    return "PAYLOADS_" + re.sub(r"[^A-Za-z0-9_-]", "_", subject.replace(".", "_"))


def images_bucket(run: str) -> str:
    """The object store bucket of a run's prompt images, named by their SHA-256
    (services/bus/images.py)."""
    return "IMAGES_" + re.sub(r"[^A-Za-z0-9_-]", "_", run)


def _stream_api(stream: str, *calls: str) -> tuple[str, ...]:
    return tuple(f"{_API}.{call}.{stream}" for call in calls)


def _consumer_api(stream: str, durable: str) -> tuple[str, ...]:
    """Create (with or without a filter subject), look up and fetch from one durable consumer."""
    return (
        f"{_API}.CONSUMER.CREATE.{stream}.{durable}",
        f"{_API}.CONSUMER.CREATE.{stream}.{durable}.>",
        f"{_API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
        f"{_API}.CONSUMER.INFO.{stream}.{durable}",
        f"{_API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    )


def _payload_api(bucket: str, *, read: bool) -> tuple[str, ...]:
    """Put objects in a payload bucket (purging an overwritten object's chunks); ``read`` adds
    fetching them (an ordered ephemeral consumer found by STREAM.NAMES)."""
    stream = f"OBJ_{bucket}"
    out = (
        f"$O.{bucket}.>",
        *_stream_api(stream, "STREAM.INFO", "STREAM.MSG.GET", "STREAM.PURGE"),
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.>",
    )
    if read:  # flow control answers of the ordered consumer too
        out += (f"{_API}.STREAM.NAMES", f"{_API}.CONSUMER.CREATE.{stream}", f"$JS.FC.{stream}.>")
    return out


def _kv_api(bucket: str) -> tuple[str, ...]:
    """Read and write the keys of one key-value bucket."""
    stream = f"KV_{bucket}"
    return (
        f"$KV.{bucket}.>",
        *_stream_api(stream, "STREAM.INFO", "STREAM.MSG.GET", "DIRECT.GET"),
        f"{_API}.DIRECT.GET.{stream}.>",
    )


def _members_api(run: str, kind: str | None) -> tuple[str, ...]:
    """Watch the run's membership bucket (an ordered consumer on its stream); with ``kind``,
    also put and delete records under that kind's own keys, and no other kind's."""
    bucket = members_bucket(run)
    stream = f"KV_{bucket}"
    out = (
        *_stream_api(stream, "STREAM.INFO"),
        f"{_API}.CONSUMER.CREATE.{stream}",
        f"{_API}.CONSUMER.CREATE.{stream}.>",
        f"{_API}.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    )
    return (*out, f"$KV.{bucket}.{kind}.>") if kind else out


def _capability(
    name: str, run: str, queues: tuple[str, ...], kind: str = ""
) -> tuple[tuple[str, ...], ...]:
    """(publish, subscribe) subjects of one capability of a service of ``run``."""
    stream, traj, events = stream_name(run), traj_subject(run), f"{PREFIX}.events.{run}"
    work = [(work_queue_stream(run, q), work_queue_subject(run, q)) for q in queues]
    if name == "events":  # every event of the run, as the console shows them
        return (), (f"{events}.>",)
    if name.startswith("publish_") and name != "publish_trajectories":
        kinds = {
            "publish_all_events": (">",),
            "publish_episodes": ("episodes", "metrics"),
            "publish_metrics": ("metrics", "progress"),
            "publish_status": ("status",),
            "publish_producers": ("producers",),
        }[name]
        return tuple(f"{events}.{kind}" for kind in kinds), ()
    if name == "publish_trajectories":
        bucket = payload_bucket(traj)
        return (traj, *_stream_api(stream, "STREAM.INFO"), *_payload_api(bucket, read=False)), ()
    if name == "manage_run_stream":
        return _stream_api(stream, "STREAM.CREATE", "STREAM.UPDATE", "STREAM.INFO"), ()
    images = images_bucket(run)
    if name == "consume_trajectories":  # its own durables on the run's stream, payloads too
        rights = (
            *_consumer_api(stream, "*"),
            *_payload_api(payload_bucket(traj), read=True),
            *_payload_api(images, read=True),
        )
        return rights, ()
    if name == "feed_queue":  # the feeder: publish tasks and their images, keep its cursor
        feeds = [
            (subject, *_stream_api(s, "STREAM.INFO"), *_kv_api(f"{s}-FEED")) for s, subject in work
        ]
        return (*(x for group in feeds for x in group), *_payload_api(images, read=False)), ()
    if name == "take_queue":  # the drivers' shared durable on each work queue, tasks' images
        takes = [
            (*_stream_api(s, "STREAM.INFO"), *_consumer_api(s, QUEUE_DURABLE)) for s, _ in work
        ]
        return (*(x for group in takes for x in group), *_payload_api(images, read=True)), ()
    if name in ("register", "follow_members"):
        return _members_api(run, kind if name == "register" else None), ()
    raise InvalidArgument(f"unknown NATS capability {name!r}", field="rights")


def service_permissions(
    run: str, kind: str, user: str, *, queues: tuple[str, ...] = ()
) -> dict[str, tuple[str, ...]]:
    """What NATS user ``user``, a service of kind ``kind`` in ``run``, may do (the launcher's
    authorization): the capabilities KIND_RIGHTS gives the kind, on the run's own subjects and
    streams (``queues``: the run's prompt work queues) and its own reply inbox; nothing on
    another run's subjects, no stream or consumer deletes, no purge of a run's stream.
    Keyword arguments for ``NatsUser``."""
    validate_run_name(run)
    publish: list[str] = []
    subscribe: list[str] = [f"{inbox_prefix(user)}.>"]
    for name in KIND_RIGHTS.get(kind, DEFAULT_RIGHTS):
        pub, sub = _capability(name, run, queues, kind)
        publish.extend(pub)
        subscribe.extend(sub)
    return {
        "publish_allow": tuple(dict.fromkeys(publish)),
        "subscribe_allow": tuple(dict.fromkeys(subscribe)),
    }
