"""Typed registries (one protocol per family, checked at registration; unknown and wrong-family
names explained at lookup), lazy loading of the built-in functions and of ``rlfleet.algos``
entry-point plugins, and a game ``algo`` checked without torch."""

import subprocess
import sys
import types
import uuid
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import learner.algos as algos
import learner.algos.registry as registry
from learner.algos import (
    AGGREGATIONS,
    GAME_ADVANTAGES,
    GAME_PRESETS,
    GROUP_ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    SCHEDULES,
    DuplicateNameError,
    GroupAdvantageFn,
    PluginLoadError,
    PolicyLossFn,
    Registry,
    SignatureError,
    UnknownNameError,
    WrongFamilyError,
    gae,
    grpo,
    load_plugins,
    ppo_clip,
)
from learner.algos.presets import builtin_game_preset, builtin_preset
from learner.algos.registry import FAMILIES
from learner.game.settings import check_game_algo
from learner.lm.settings import check_preset, check_preset_name


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


def test_unknown_name_suggests_a_close_one_and_prefixes_the_field():
    reg: Registry = Registry("policy loss")
    reg.add("ppo", 1)
    with pytest.raises(UnknownNameError, match=r"^loss: unknown policy loss 'ppo2'; known: ppo; "
                       r"did you mean 'ppo'\?$"):  # fmt: skip
        reg.get("ppo2", field="loss")


def test_builtins_are_registered():
    assert set(GAME_ADVANTAGES.names()) == {"gae", "vtrace"}
    assert {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(
        GROUP_ADVANTAGES.names()
    )
    assert {"ppo", "a2c", "gspo", "cispo", "sapo"} <= set(POLICY_LOSSES.names())
    assert {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"} <= set(
        AGGREGATIONS.names()
    )
    assert {"k1", "k2", "k3"} <= set(KL_ESTIMATORS.names())
    assert {"constant", "linear", "cosine", "warmup_cosine"} <= set(SCHEDULES.names())
    assert {"ppo", "a2c", "appo"} <= set(GAME_PRESETS.names())
    assert POLICY_LOSSES.get("ppo") is ppo_clip
    with pytest.raises(DuplicateNameError):
        POLICY_LOSSES.register("ppo")(lambda: None)


def test_registries_nobody_reads_are_gone():
    # value, SFT and preference losses have one implementation each, called directly
    for name in ("VALUE_LOSSES", "SFT_LOSSES", "PREFERENCE_LOSSES"):
        assert not hasattr(algos, name)


def test_every_builtin_matches_its_family_protocol():
    for family in FAMILIES:
        if family.protocol is None:
            continue
        for name in family.names():
            algos.check_signature(family.get(name), family.protocol, f"{family.kind} {name!r}")


def _policy_losses() -> Registry:
    return Registry("policy loss", PolicyLossFn)


def test_a_function_of_another_family_cannot_be_registered():
    reg = _policy_losses()
    with pytest.raises(SignatureError, match=r"policy loss 'g'.*does not match PolicyLossFn"
                       r"\(logp, old_logp, adv, mask=None, \*\*hyperparameters\)"):  # fmt: skip
        reg.add("g", grpo)
    with pytest.raises(SignatureError, match="parameter 2 is 'adv', expected 'old_logp'"):
        reg.add("old_a2c", lambda logp, adv, mask=None, *, old_logp=None: (logp, {}))
    with pytest.raises(SignatureError, match="'mask' needs a default"):
        reg.add("m", lambda logp, old_logp, adv, mask: (logp, {}))
    with pytest.raises(SignatureError, match="hyperparameter 'clip' needs a default"):
        reg.add("h", lambda logp, old_logp, adv, mask=None, *, clip: (logp, {}))
    with pytest.raises(SignatureError, match="'adv' is positional-only"):
        reg.add("p", lambda logp, old_logp, adv, /, mask=None: (logp, {}))
    with pytest.raises(SignatureError, match="must be a function"):
        reg.add("n", 3)
    assert reg.names() == []
    reg.add("ok", ppo_clip)
    assert reg.hyperparameters("ok") == ["clip_low", "clip_high", "clip_ratio_c"]


def test_keyword_only_protocol_parameters_must_be_accepted_by_name():
    reg = Registry("game advantage estimator", algos.GameAdvantageFn)
    reg.add("gae", gae)
    with pytest.raises(SignatureError, match="does not take the keyword 'last_value'"):
        reg.add("x", lambda rewards, values, *, terminated, truncated: (rewards, values))
    reg.add("any", lambda rewards, values, **kw: (rewards, values))  # **kwargs takes them all
    assert reg.hyperparameters("any") is None
    groups = Registry("group advantage estimator", GroupAdvantageFn)
    with pytest.raises(SignatureError, match="parameter 2 is 'values', expected 'group_ids'; no "
                       "parameter 'mask' at position 3"):  # fmt: skip
        groups.add("gae", gae)


def test_a_name_of_another_family_says_which_family_it_is():
    with pytest.raises(WrongFamilyError, match=r"^advantage: 'gae' is a game advantage estimator, "
                       r"not a group advantage estimator; known .*: grpo, "):  # fmt: skip
        GROUP_ADVANTAGES.get("gae", field="advantage")
    with pytest.raises(WrongFamilyError, match="'grpo' is a group advantage estimator and an LM "
                       "algorithm preset, not a game advantage estimator"):  # fmt: skip
        GAME_ADVANTAGES.get("grpo")
    assert issubclass(WrongFamilyError, UnknownNameError)  # callers catching that still work
    assert "grpo" in PRESETS and "ppo" in GAME_PRESETS


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
        registry.plugins_installed.cache_clear()
        return name

    yield make
    registry.plugins_installed.cache_clear()
    for name in names:
        sys.modules.pop(name, None)


def test_plugin_loads_lazily_on_first_lookup(plugin):
    module = plugin(
        "from learner.algos.registry import POLICY_LOSSES\n"
        "LOADS = [1]\n"
        "@POLICY_LOSSES.register('plugin_loss')\n"
        "def plugin_loss(logp, old_logp, adv, mask=None):\n"
        "    return -adv * logp, {}\n"
    )
    assert module not in sys.modules
    fn = POLICY_LOSSES.get("plugin_loss")
    assert module in sys.modules
    assert fn(2.0, 0.0, 3.0) == (-6.0, {})
    POLICY_LOSSES.get("ppo")  # a second lookup does not import again
    assert sys.modules[module].LOADS == [1]


def test_plugin_clashing_with_builtin_is_an_error(plugin):
    plugin(
        "from learner.algos.registry import POLICY_LOSSES\n"
        "POLICY_LOSSES.register('ppo')(lambda: None)\n"
    )
    with pytest.raises(DuplicateNameError, match=r"plugin 'demo'.*'ppo' is already registered"):
        POLICY_LOSSES.get("ppo")


def test_plugin_of_the_wrong_shape_names_the_entry_point(plugin):
    plugin(
        "from learner.algos.registry import POLICY_LOSSES\n"
        "POLICY_LOSSES.register('two_args')(lambda logp, adv: (-adv * logp, {}))\n"
    )
    with pytest.raises(SignatureError, match=r"plugin 'demo'.*'two_args'.*expected 'old_logp'"):
        POLICY_LOSSES.get("ppo")


def test_broken_plugin_names_the_entry_point(plugin):
    plugin("raise RuntimeError('boom')\n")
    with pytest.raises(PluginLoadError, match=r"plugin 'demo' \(rlfleet_test_plugin_.*boom"):
        POLICY_LOSSES.names()


def _python(code: str) -> None:
    """Run ``code`` in a fresh interpreter (what it imports is its own), from the repo root."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_validating_a_run_with_builtin_presets_does_not_import_torch():
    # What `rlfleet up` / `rlfleet validate` do before any service starts: torch (about 1 s,
    # and the launcher's whole validation took 3.7 s with it against 1 s without) stays out.
    _python(
        "import sys\n"
        "from launch.cli import main\n"
        "from learner.game.settings import check_game_algo\n"
        "assert main(['validate', 'examples/cartpole_ppo.yaml']) == 0\n"
        "assert main(['validate', 'examples/cartpole_appo.yaml']) == 0\n"
        "assert main(['validate', 'examples/grpo_arith.yaml']) == 0\n"
        "assert check_game_algo('a2c') == 'a2c'\n"
        "import learner.algos\n"
        "assert 'torch' not in sys.modules, 'validation imported torch'\n"
        "from learner.algos import gae  # a function: now its module, and torch\n"
        "assert 'torch' in sys.modules and gae.__module__ == 'learner.algos.advantages.gae'\n"
    )


def test_the_first_lookup_registers_the_builtins():
    _python(
        "import sys\n"
        "from learner.algos.registry import GAME_PRESETS, POLICY_LOSSES\n"
        "assert 'learner.algos.losses' not in sys.modules\n"
        "assert POLICY_LOSSES.registered('ppo') is None  # registered() loads nothing\n"
        "assert GAME_PRESETS.registered('ppo') is not None  # presets are data, always there\n"
        "from learner.algos.losses import ppo_clip\n"
        "assert POLICY_LOSSES.get('ppo') is ppo_clip\n"
    )


def test_builtin_presets_are_the_registered_ones_unless_plugins_are_installed(plugin):
    assert builtin_game_preset("ppo") is GAME_PRESETS.get("ppo")
    assert builtin_preset("dapo") is PRESETS.get("dapo")
    assert builtin_game_preset("ppx") is None  # unknown: resolve_game_preset explains
    assert builtin_preset("ppo") is None  # a game preset, not an LM one
    plugin("from learner.algos.registry import POLICY_LOSSES\n")
    assert builtin_game_preset("ppo") is None  # a plugin may be broken: load it to see
    assert builtin_preset("dapo") is None
    with pytest.raises(ValueError, match="unknown game algorithm preset 'ppx'; known: a2c"):
        check_game_algo("ppx")
    with pytest.raises(ValueError, match="'ppo' is a policy loss and a game algorithm preset"):
        check_preset_name("ppo")
    with pytest.raises(ValueError, match="policy loss 'ppo' has no hyperparameter 'tau'"):
        check_preset("grpo", {"loss_kwargs": {"tau": 1.0}})


def test_every_public_name_is_what_it_names():
    # A submodule of learner.algos named like one of its functions would shadow the function
    # once imported (the package is lazy: learner.algos.aggregate the module, not the function).
    load_plugins()
    for name in algos.__all__:
        value = getattr(algos, name)
        assert not isinstance(value, types.ModuleType), f"learner.algos.{name} is a module"
