"""Subject and stream names: one token per run name, upper-case stream names, clear errors."""

from __future__ import annotations

import pytest

from services.bus import subjects
from services.errors import InvalidArgument


def test_run_subjects_and_stream_name() -> None:
    assert subjects.traj_subject("demo-1") == "rlfleet.v1.traj.demo-1"
    assert subjects.events_subject("demo-1", "metrics") == "rlfleet.v1.events.demo-1.metrics"
    assert subjects.events_wildcard("demo-1") == "rlfleet.v1.events.demo-1.>"
    assert subjects.stream_name("demo-1") == "RLFLEET_DEMO_1"
    assert subjects.work_queue_subject("demo", "prompts") == "rlfleet.v1.work.demo.prompts"
    assert subjects.work_queue_stream("demo", "math-easy") == "RLFLEET_DEMO-WQ-MATH_EASY"


def test_work_queue_streams_never_collide_with_run_streams() -> None:
    # A run named like "<run>-wq-<queue>" must not land on a work queue's stream.
    assert subjects.stream_name("a-wq-b") != subjects.work_queue_stream("a", "b")
    assert subjects.work_queue_stream("a-b", "c") != subjects.work_queue_stream("a", "b-c")


@pytest.mark.parametrize("name", ["a", "0", "run-1", "x" * 63])
def test_valid_run_names(name: str) -> None:
    assert subjects.validate_run_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "-a", "Run", "a.b", "a b", "a*", "a>", "a_b", "x" * 64, "é", None, 3]
)
def test_invalid_run_names_are_refused_with_the_rule(name: object) -> None:
    with pytest.raises(InvalidArgument, match=r"invalid run name .*\[a-z0-9\]") as info:
        subjects.validate_run_name(name)  # type: ignore[arg-type]
    assert info.value.field == "run.name"


def test_every_builder_validates_the_run_name() -> None:
    for build in (subjects.traj_subject, subjects.events_wildcard, subjects.stream_name):
        with pytest.raises(InvalidArgument):
            build("Bad.Run")


@pytest.mark.parametrize("kind", ["", "a.b", "*", ">", "Metrics"])
def test_invalid_event_kinds(kind: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid event kind"):
        subjects.events_subject("demo", kind)


def test_event_kinds_may_use_underscores_but_queue_names_may_not() -> None:
    assert subjects.events_subject("demo", "weights_published").endswith(".weights_published")
    with pytest.raises(InvalidArgument, match="invalid queue name"):
        subjects.work_queue_subject("demo", "math_easy")


def test_per_kind_nats_permissions_stay_inside_the_run() -> None:
    from services.bus.subjects import KIND_RIGHTS, service_permissions

    run, stream = "perm-u", "RLFLEET_PERM_U"
    for kind in [*KIND_RIGHTS, "some_plugin"]:
        rights = service_permissions(run, kind, "svc-0", queues=("prompts",))
        publish, subscribe = rights["publish_allow"], rights["subscribe_allow"]
        for subject in publish:  # each names this run (or is the learner's stream lookup)
            assert run in subject or stream in subject or subject == "$JS.API.STREAM.NAMES"
            assert ".DELETE." not in subject and "STREAM.PURGE." + stream not in subject
        assert set(subscribe) <= {"_INBOX.svc-0.>", f"rlfleet.v1.events.{run}.>"}
        may_update = f"$JS.API.STREAM.UPDATE.{stream}" in publish
        assert may_update == (kind in ("learner", "lm_learner", "dpo_learner")), kind
    actor = service_permissions(run, "game_actor", "a")["publish_allow"]
    assert "rlfleet.v1.traj.perm-u" in actor
    # Its only consumers: watches of the run's membership bucket.
    members = f"KV_{stream}-MEMBERS"
    assert not any("STREAM.CREATE" in s for s in actor)
    assert all(members in s for s in actor if "CONSUMER" in s)
    assert not any(s.startswith("$KV.") for s in actor)  # it registers nothing
    # A registering kind writes its own kind's records only.
    env = service_permissions(run, "env_server", "e")["publish_allow"]
    assert [s for s in env if s.startswith("$KV.")] == [f"$KV.{stream}-MEMBERS.env_server.>"]
