"""What each service waits for before `rlfleet up` starts it, and the order services stop in
(services/start_order.py): the run file's `after`, the kind's `needs`, else everything earlier."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from launch.console import describe_start
from services.config import RunConfig, load_run_config
from services.errors import ConfigError
from services.start_order import named_services, start_needs, stop_waves

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, services: str) -> RunConfig:
    path = tmp_path / "run.yaml"
    text = "run: {name: order}\nservices:\n" + textwrap.indent(textwrap.dedent(services), "  ")
    path.write_text(text)
    return load_run_config(path, {})


def test_undeclared_kinds_wait_for_every_earlier_service(tmp_path: Path) -> None:
    run = config(
        tmp_path,
        """\
        - {name: a, service: heartbeat}
        - {name: b, service: heartbeat}
        - {name: c, service: heartbeat}
        """,
    )
    needs = start_needs(run)
    assert needs == {"a": (), "b": ("a",), "c": ("a", "b")}
    assert describe_start(list(needs), needs) == "a; b after a; c after b"
    assert stop_waves(run, needs) == [["c"], ["b"], ["a"]]  # the reverse, one at a time


def test_after_declares_needs_and_independent_services_start_and_stop_together(
    tmp_path: Path,
) -> None:
    run = config(
        tmp_path,
        """\
        - {name: a, service: heartbeat, after: []}
        - {name: b, service: heartbeat, after: []}
        - {name: c, service: heartbeat, after: [a]}
        - {name: d, service: heartbeat, after: [b, c]}
        """,
    )
    needs = start_needs(run)
    assert needs == {"a": (), "b": (), "c": ("a",), "d": ("b", "c")}
    assert describe_start(list(needs), needs) == "a, b at once; c after a; d after b, c"
    assert stop_waves(run, needs) == [["d"], ["c", "b"], ["a"]]


def test_a_service_may_wait_for_one_listed_after_it(tmp_path: Path) -> None:
    run = config(
        tmp_path,
        """\
        - {name: late, service: heartbeat, after: [early]}
        - {name: early, service: heartbeat, after: []}
        """,
    )
    needs = start_needs(run)
    assert needs == {"late": ("early",), "early": ()}
    assert stop_waves(run, needs) == [["late"], ["early"]]


def test_names_in_settings_order_the_stop_even_when_not_waited_for(tmp_path: Path) -> None:
    # b talks to a (peers) but starts at once: it still stops before a.
    run = config(
        tmp_path,
        """\
        - {name: a, service: heartbeat, after: []}
        - {name: b, service: heartbeat, after: [], settings: {peers: [a]}}
        - {name: c, service: heartbeat, after: []}
        """,
    )
    needs = start_needs(run)
    assert describe_start(list(needs), needs) == "a, b, c at once"
    assert stop_waves(run, needs) == [["c", "b"], ["a"]]


def test_peers_naming_each_other_stop_in_reverse_config_order(tmp_path: Path) -> None:
    run = config(
        tmp_path,
        """\
        - {name: a, service: heartbeat, after: [], settings: {peers: [b]}}
        - {name: b, service: heartbeat, after: [], settings: {peers: [a]}}
        """,
    )
    assert stop_waves(run, start_needs(run)) == [["b"], ["a"]]


@pytest.mark.parametrize(
    ("services", "message"),
    [
        (
            """\
            - {name: a, service: heartbeat, after: [nope]}
            """,
            "services[0].after[0]: unknown service 'nope'",
        ),
        (
            """\
            - {name: a, service: heartbeat, after: [a]}
            """,
            "services[0].after[0]: a service cannot wait for itself",
        ),
        (
            # b waits for every earlier service (a), a waits for b.
            """\
            - {name: a, service: heartbeat, after: [b]}
            - {name: b, service: heartbeat}
            """,
            "services wait for each other, none could start (a -> b -> a;",
        ),
    ],
)
def test_impossible_orders_are_config_errors(tmp_path: Path, services: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        config(tmp_path, services)
    assert message in str(raised.value)


def test_the_lm_job_starts_its_sampler_at_once() -> None:
    # The vLLM sampler, the slowest to start, does not wait for the learner (it fetches the
    # first weights itself), the drivers wait for their peers themselves; the learner needs
    # its reward service (the evaluation of version 0 calls it at once).
    run = load_run_config(REPO / "examples" / "grpo_arith.yaml", {})
    needs = start_needs(run)
    assert needs == {"reward": (), "learner": ("reward",), "sampler-0": (), "rollout-0": ()}
    assert describe_start(list(needs), needs) == (
        "reward, sampler-0, rollout-0 at once; learner after reward"
    )
    # Each service stops before the services it talks to: the driver first, the reward last.
    assert stop_waves(run, needs) == [["rollout-0"], ["sampler-0"], ["learner"], ["reward"]]


def test_named_services_sees_optional_and_list_references() -> None:
    run = load_run_config(REPO / "examples" / "grpo_arith.yaml", {})
    settings = {entry.name: entry.settings for entry in run.services}
    assert named_services(settings["learner"]) == ["reward"]  # `ServiceRef | None`
    assert named_services(settings["sampler-0"]) == ["learner"]  # weights_from
    assert named_services(settings["rollout-0"]) == ["sampler-0", "reward"]
    assert named_services(settings["reward"]) == []
