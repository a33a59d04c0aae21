"""The reward registry (built-ins, entry-point plugins, duplicate names, inferred records), the
settings checked against it, and how return values become per-item outcomes."""

from __future__ import annotations

from importlib import metadata
from importlib.metadata import EntryPoint

import numpy as np
import pytest
from pydantic import ValidationError

from reward_service.rewards import BUILTINS, Kind, from_callable, load_registry
from reward_service.rewards import registry as reward_registry
from reward_service.runner import check_scores
from reward_service.service import RewardSettings, build_registry
from rlfleet.reward.v1 import reward_pb2
from services.errors import ConfigError
from tests.plugins import rewards_plugin

GROUP = reward_registry.REWARDS_GROUP
PLUGIN = "tests.plugins.rewards_plugin"


def ep(name: str, attr: str) -> EntryPoint:
    return EntryPoint(name, f"{PLUGIN}:{attr}", GROUP)


def test_builtins_are_registered_with_their_records() -> None:
    registry = load_registry(entry_points=[])
    assert list(registry) == ["accuracy", "cosine", "format", "repetition", "soft_overlong"]
    assert registry["accuracy"].extra_keys == ("answer",)
    assert registry["accuracy"].kind is Kind.RULE
    assert registry["soft_overlong"].kwargs == {"max_completion_len", "cache_len"}
    assert "arXiv:2503.14476" in registry["soft_overlong"].description
    assert all(r.source.startswith("built-in reward_service.rewards.") for r in BUILTINS)


def test_installed_entry_points_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    seen_groups = []

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        seen_groups.append(group)
        # The same plugin found twice (two sys.path entries) is one plugin, not a clash.
        return [ep("ratio", "length_ratio"), ep("ratio", "length_ratio")]

    monkeypatch.setattr(metadata, "entry_points", fake_entry_points)
    registry = load_registry()
    assert seen_groups == [GROUP]
    ratio = registry["ratio"]
    assert ratio.kind is Kind.PLUGIN
    assert ratio.fn is rewards_plugin.length_ratio
    assert ratio.extra_keys == ("target",)  # from the function's attribute
    assert ratio.kwargs is None  # takes **kwargs: any keyword is accepted
    assert ratio.description.startswith("Length of the completion")


def test_a_name_registered_twice_names_both_sources() -> None:
    with pytest.raises(ConfigError, match=r"'accuracy' is registered twice: built-in .*accuracy"):
        load_registry(entry_points=[ep("accuracy", "nan_reward")])
    with pytest.raises(ConfigError, match=r"'x' is registered twice: .*nan_reward.*short_list"):
        load_registry(
            entry_points=[ep("x", "nan_reward")], extra_entry_points=[ep("x", "short_list")]
        )


def test_broken_plugins_fail_the_load_naming_the_entry_point() -> None:
    with pytest.raises(ConfigError, match=r"'gone' = no_such_module_xyz:f failed to load"):
        load_registry(entry_points=[EntryPoint("gone", "no_such_module_xyz:f", GROUP)])
    with pytest.raises(ConfigError, match=r"'num'.*is not callable: int"):
        load_registry(entry_points=[ep("num", "NOT_CALLABLE")])


def test_records_inferred_from_signatures() -> None:
    strict = from_callable("raise_on_bad", rewards_plugin.raise_on_bad)
    assert strict.kwargs == {"scale"}  # named keywords, minus the batch keys
    assert strict.params == {"completions", "scale"}
    assert strict.call_kwargs({"prompts": ["p"], "scale": 2.0}) == {"scale": 2.0}
    loose = from_callable("async_echo", rewards_plugin.async_echo)
    assert loose.params is None and loose.kwargs is None


def test_settings_are_checked_against_the_registry() -> None:
    with pytest.raises(ConfigError, match=r"settings.rewards: unknown reward 'acc' \(known: acc"):
        build_registry(RewardSettings(rewards={"acc": 1.0}), entry_points=[])
    with pytest.raises(ConfigError, match=r"settings.timeouts: unknown reward 'nope'"):
        build_registry(RewardSettings(timeouts={"nope": 1.0}), entry_points=[])
    with pytest.raises(ConfigError, match=r"'format' takes no keyword 'size'"):
        build_registry(RewardSettings(reward_kwargs={"format": {"size": 1}}), entry_points=[])
    with pytest.raises(ConfigError, match=r"'cache_len' \(11\) must not exceed"):
        build_registry(
            RewardSettings(
                reward_kwargs={"soft_overlong": {"max_completion_len": 10, "cache_len": 11}}
            ),
            entry_points=[],
        )
    with pytest.raises(ValidationError, match="finite"):
        RewardSettings(rewards={"format": float("nan")})
    registry, models = build_registry(RewardSettings(rewards={"format": 1.0}), entry_points=[])
    assert "format" in registry and models == []


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([float("inf")], "returned +inf"),
        ([float("-inf")], "returned -inf"),
        (["0.5"], "returned a non-number (str: '0.5')"),
        (0.5, "returned float, not a list of scores"),
        ([1.0, 2.0], "returned a list of the wrong length: 2 scores for 1 items"),
    ],
)
def test_bad_results_become_per_item_errors(result: object, message: str) -> None:
    [outcome] = check_scores("r", result, 1)
    assert outcome.status == reward_pb2.SCORE_STATUS_ERROR
    assert outcome.error.message == f"reward 'r' {message}"


def test_numpy_results_and_none_are_accepted() -> None:
    outcomes = check_scores("r", np.array([0.5, 1], dtype=np.float32), 2)
    assert [o.score for o in outcomes] == [0.5, 1.0]
    assert check_scores("r", [None], 1)[0].status == reward_pb2.SCORE_STATUS_ABSTAINED


def test_reward_service_is_an_installed_service_kind() -> None:
    from reward_service.service import SPEC
    from services.registry import get_service

    assert get_service("reward_service") is SPEC
    assert SPEC.settings is RewardSettings and SPEC.grpc
