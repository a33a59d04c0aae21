"""The reward registry (built-ins, entry-point plugins, functions named by reference, duplicate
names, inferred records), the settings checked against it, and how return values become per-item
outcomes."""

from __future__ import annotations

import re
from importlib import metadata
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from reward_service.rewards import BUILTINS, Kind, from_callable, load_registry
from reward_service.rewards import registry as reward_registry
from reward_service.runner import check_scores
from reward_service.service import RewardSettings, build_registry
from rlfleet.reward.v1 import reward_pb2
from services.errors import ConfigError
from tests.plugins import reference_rewards, rewards_plugin

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


def test_worker_limits_must_nest() -> None:
    """A function's stuck calls fit in its share of the pool, and its share in the pool."""
    RewardSettings(worker_threads=4, max_threads_per_function=4, max_stuck_calls=4)
    for bad in (
        {"worker_threads": 4, "max_threads_per_function": 8},
        {"max_threads_per_function": 2, "max_stuck_calls": 3},
    ):
        with pytest.raises(ValidationError, match="max_stuck_calls <= max_threads_per_function"):
            RewardSettings(**bad)


# --- rewards named by reference in a run file -------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
BREVITY = "examples/custom_reward.py:brevity"
REFS = "tests.plugins.reference_rewards"


def test_a_file_reference_is_registered_and_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # relative paths are from the current directory
    settings = RewardSettings(plugins=[BREVITY], reward_kwargs={BREVITY: {"max_chars": 4}})
    registry, _ = build_registry(settings, entry_points=[])
    reward = registry[BREVITY]
    assert reward.kind is Kind.PLUGIN and reward.name == BREVITY
    assert reward.source.endswith(f"(file {ROOT / 'examples/custom_reward.py'})")
    assert reward.description.startswith("1 for a completion of at most")
    completions = ["1234", "123456", "12345678", "1234567890"]
    kwargs = reward.call_kwargs({"prompts": ["p"] * 4, **settings.reward_kwargs[BREVITY]})
    outcomes = check_scores(BREVITY, reward.fn(completions, **kwargs), len(completions))
    assert [o.score for o in outcomes] == [1.0, 0.5, 0.0, 0.0]
    # Extras the function lists in extra_keys reach it; it abstains without them.
    exact = registry_with("examples/custom_reward.py:exact_answer")
    assert exact.extra_keys == ("answer",)
    assert exact.fn([" <answer>4</answer>", "5"], answer=["4", "4"]) == [1.0, 0.0]


def registry_with(ref: str) -> reward_registry.RewardFunction:
    return build_registry(RewardSettings(rewards={ref: 1.0}), entry_points=[])[0][ref]


def test_module_references_and_references_named_only_in_the_default_set() -> None:
    ref = f"{REFS}:scaled"
    settings = RewardSettings(rewards={ref: 1.0}, timeouts={f"{PLUGIN}:nan_reward": 2.0})
    assert settings.references == [ref, f"{PLUGIN}:nan_reward"]
    registry, _ = build_registry(settings, entry_points=[])
    assert registry[ref].fn is reference_rewards.scaled and registry[ref].kwargs == {"scale"}
    # The settings check a reference's keyword arguments already, before any registry is built.
    with pytest.raises(ValidationError, match=rf"'{ref}' — takes no keyword 'size'"):
        RewardSettings(reward_kwargs={ref: {"size": 1}})


@pytest.mark.parametrize(
    ("ref", "kwargs", "message"),
    [
        (f"{PLUGIN}:lenght_ratio", None, "(did you mean 'length_ratio'?)"),
        (f"{REFS}:NOT_CALLABLE", None, "is a int, not a function"),
        ("no_such_module_xyz:f", None, "cannot import module no_such_module_xyz: ModuleNotFound"),
        ("missing/rewards.py:f", None, "rewards.py not found (relative paths are from the"),
        ("rewards.py:", None, "expected 'module:function' or 'path/to/file.py:function'"),
        (f"{REFS}:misnamed", None, "first parameter is 'texts', not 'completions'"),
        (f"{REFS}:scaled", {"scael": 2}, "takes no keyword 'scael' (takes: scale)"),
        (f"{REFS}:scaled", {"prompts": 2}, "takes no keyword 'prompts'"),
        (f"{REFS}:keyword_only", None, "has no positional first parameter"),
    ],
)
def test_bad_references_fail_the_check_naming_them(
    ref: str, kwargs: dict[str, int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        reward_registry.check_reference(ref, kwargs)
    assert str(err.value).startswith(f"'{ref}' — ")


def test_required_parameters_may_be_batch_keys_extras_or_given_kwargs() -> None:
    check = reward_registry.check_reference
    assert check(f"{REFS}:needs_level", {"level": 1}).kwargs == {"level"}
    check(f"{REFS}:needs_prompts_and_target", {})  # a batch key and a listed extra key


def test_required_parameters_may_be_dataset_columns_as_in_trl() -> None:
    # The items carry every dataset column and the service passes each to a parameter of its
    # name: unknown columns (None) accept any name, known ones only theirs.
    check = reward_registry.check_reference
    check(f"{REFS}:trl_accuracy", {})
    check(f"{REFS}:trl_accuracy", {}, columns=["answer", "solution"])
    check(f"{REFS}:needs_level", {}, columns=["level"])
    message = (
        "parameter 'level' has no default and nothing passes it: set it in kwargs, or give the "
        "dataset a 'level' column (its columns: answer, solution)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check(f"{REFS}:needs_level", {}, columns=["answer", "solution"])


def test_reference_settings_fail_validation_and_a_clash_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError, match=r"'accuracy' is not a reference"):
        RewardSettings(plugins=["accuracy"])
    with pytest.raises(ValidationError, match=r"listed more than once"):
        RewardSettings(plugins=[f"{PLUGIN}:nan_reward"] * 2)
    with pytest.raises(ValidationError, match=rf"module {PLUGIN} has no attribute 'nan'"):
        RewardSettings(rewards={f"{PLUGIN}:nan": 1.0})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(ValidationError, match=r"importing .*broken.py failed: ModuleNotFound"):
        RewardSettings(plugins=["broken.py:f"])
    ref = f"{PLUGIN}:length_ratio"
    with pytest.raises(ConfigError, match=rf"'{ref}' is registered twice: entry point .*run-file"):
        build_registry(RewardSettings(plugins=[ref]), entry_points=[ep(ref, "length_ratio")])


def test_expected_reward_names_are_checked_against_the_registry() -> None:
    RewardSettings(expected=["accuracy", "format"])  # built-ins
    with pytest.raises(ValidationError, match=r"'acuracy' is not registered \(did you mean"):
        RewardSettings(expected=["acuracy"])
    model = {"name": "judge", "path": "/nonexistent"}
    RewardSettings(expected=["judge"], reward_models=[model])  # a reward model's name counts


def test_a_job_naming_an_unknown_reward_fails_at_its_line(tmp_path: Path) -> None:
    from services.config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text(
        "run: {name: badreward}\njob:\n  kind: grpo\n  model_path: m\n  init_model: tiny\n"
        "  dataset: {generator: arith}\n  rewards:\n    - {name: acuracy}\n"
    )
    with pytest.raises(ConfigError, match=r"run.yaml:8: job.rewards\[0\].name: reward 'acuracy'"):
        load_run_config(path)
