"""Registry behaviour and lazy loading of ``rlfleet.algos`` entry-point plugins."""

import sys
import uuid
from importlib.metadata import EntryPoint

import pytest

import learner.algos.registry as registry
from learner.algos import (
    ADVANTAGES,
    AGGREGATIONS,
    POLICY_LOSSES,
    SCHEDULES,
    VALUE_LOSSES,
    DuplicateNameError,
    PluginLoadError,
    Registry,
    UnknownNameError,
    ppo_clip,
)


def test_register_and_get():
    reg: Registry = Registry("thing")

    @reg.register("double")
    def double(x):
        return 2 * x

    assert reg.get("double") is double
    assert reg.get("double")(3) == 6
    assert "double" in reg
    assert reg.names() == ["double"]


def test_duplicate_name_is_an_error():
    reg: Registry = Registry("thing")
    reg.add("a", 1)
    with pytest.raises(DuplicateNameError, match="thing 'a' is already registered"):
        reg.add("a", 2)
    assert reg.get("a") == 1


def test_unknown_name_lists_known_names():
    reg: Registry = Registry("policy loss")
    reg.add("b", 1)
    reg.add("a", 2)
    with pytest.raises(UnknownNameError, match=r"unknown policy loss 'zzz'; known: a, b"):
        reg.get("zzz")


def test_builtins_are_registered():
    assert {"gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(
        ADVANTAGES.names()
    )
    assert {"ppo", "a2c"} <= set(POLICY_LOSSES.names())
    assert "mse" in VALUE_LOSSES
    assert {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"} <= set(
        AGGREGATIONS.names()
    )
    assert {"constant", "linear"} <= set(SCHEDULES.names())
    assert POLICY_LOSSES.get("ppo") is ppo_clip
    with pytest.raises(DuplicateNameError):
        POLICY_LOSSES.register("ppo")(lambda: None)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Write a plugin module and expose it as the only ``rlfleet.algos`` entry point."""
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(POLICY_LOSSES, "_items", dict(POLICY_LOSSES._items))
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(body: str) -> str:
        name = f"rlfleet_test_plugin_{uuid.uuid4().hex}"
        (tmp_path / f"{name}.py").write_text(body)
        names.append(name)
        eps = [EntryPoint(name="demo", value=name, group=registry.ENTRY_POINT_GROUP)]
        monkeypatch.setattr(registry, "entry_points", lambda group: eps)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


def test_plugin_loads_lazily_on_first_lookup(plugin):
    module = plugin(
        "from learner.algos.registry import POLICY_LOSSES\n"
        "LOADS = [1]\n"
        "@POLICY_LOSSES.register('plugin_loss')\n"
        "def plugin_loss(logp, adv):\n"
        "    return -adv * logp, {}\n"
    )
    assert module not in sys.modules
    fn = POLICY_LOSSES.get("plugin_loss")
    assert module in sys.modules
    assert fn(2.0, 3.0) == (-6.0, {})
    POLICY_LOSSES.get("ppo")  # a second lookup does not import again
    assert sys.modules[module].LOADS == [1]


def test_plugin_clashing_with_builtin_is_an_error(plugin):
    plugin(
        "from learner.algos.registry import POLICY_LOSSES\n"
        "POLICY_LOSSES.register('ppo')(lambda: None)\n"
    )
    with pytest.raises(DuplicateNameError, match=r"plugin 'demo'.*'ppo' is already registered"):
        POLICY_LOSSES.get("ppo")


def test_broken_plugin_names_the_entry_point(plugin):
    plugin("raise RuntimeError('boom')\n")
    with pytest.raises(PluginLoadError, match=r"plugin 'demo' \(rlfleet_test_plugin_.*boom"):
        POLICY_LOSSES.names()
