"""Plugin discovery through real installed distributions, the typed facade and its errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_core import (
    PROTOCOL_VERSION,
    AlgorithmComponent,
    BackendSpec,
    ConfigError,
    EngineSpec,
    PluginError,
    RewardCapabilities,
    StreamWeightSync,
    TensorBatch,
    UnknownNameError,
    hookimpl,
)
from verl_core.kernel.algorithm import Preset
from verl_core.kernel.registry import PLUGINS_ENV, Registry, get_reward_engine, reset_registry


@pytest.fixture(autouse=True)
def _fresh_registry() -> None:
    reset_registry()


def test_installed_test_plugin_is_discovered_through_its_entry_point() -> None:
    backends = Registry().backends()
    toy = backends["toy"]
    assert toy.distribution == "verl-toy-plugin"
    assert toy.version == "0.0.1"
    assert toy.spec.protocol_version == PROTOCOL_VERSION
    assert isinstance(toy.capabilities("reward"), RewardCapabilities)


def test_engine_is_built_through_the_registry_with_validated_options() -> None:
    spec = EngineSpec(model_path="unused", role="reward", options={"bonus": 0.5})
    engine = get_reward_engine("toy", spec)
    batch = TensorBatch({"response_mask": torch.tensor([[True, True], [True, False]])})
    assert engine.score(batch)["scores"].tolist() == [2.5, 1.5]
    with pytest.raises(ConfigError, match=r"unknown key\(s\) bogus; valid keys: bonus"):
        get_reward_engine("toy", EngineSpec(model_path="x", role="reward", options={"bogus": 1}))


def test_unknown_backend_lists_installed_and_the_install_command() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown verl backend 'megatrom'; installed: .*toy.*pip install verl-megatrom"):
        Registry().backend("megatrom")
    reg = Registry(autoload=False)
    with pytest.raises(UnknownNameError, match="pip install 'verl-vllm\\[cuda\\]'.*autoload is off"):
        reg.backend("vllm")


def test_role_not_provided() -> None:
    with pytest.raises(UnknownNameError, match="does not provide role 'actor'; it provides: reward"):
        Registry().build("toy", EngineSpec(model_path="x", role="actor"))


def test_third_party_algorithm_registered_through_the_same_hook() -> None:
    reg = Registry()
    assert "toy_zero" in reg.components("advantage")
    with pytest.raises(UnknownNameError, match="unknown advantage 'nope'; registered: .*toy_zero"):
        reg.component("advantage", "nope")


def test_autoload_off_keeps_builtin_algorithms_and_drops_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = Registry()
    assert "toy" not in reg.backends()
    assert "toy_zero" not in reg.components("advantage")
    builtin = Registry(autoload=False).components("advantage")
    assert builtin == reg.components("advantage")


def test_two_distributions_claiming_one_name_is_an_error_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second real distribution (metadata on sys.path) claiming the name "toy".
    info = tmp_path / "verl_toy_clone-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verl-toy-clone\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\ntoy = verl_toy_plugin.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"two distributions claim the verl backend name 'toy': .*verl-toy-clone.*verl-toy-plugin|verl-toy-plugin.*verl-toy-clone"):
        Registry().backends()


def test_incompatible_protocol_version_is_refused_with_a_clear_message() -> None:
    class Future:
        @hookimpl
        def verl_backend(self) -> BackendSpec:
            return BackendSpec("future", {"reward": "x:y"}, {}, protocol_version="2.0")

    with pytest.raises(PluginError, match=r"implements verl protocol 2.0, but this verl-core speaks 1.0"):
        Registry(autoload=False).register(Future(), "future")


def test_a_misspelt_hook_fails_loudly_and_the_plugin_is_not_registered() -> None:
    class Misspelt:
        @hookimpl
        def verl_backnd(self) -> BackendSpec:  # the hook is verl_backend
            return BackendSpec("misspelt", {"reward": "x:y"}, {}, protocol_version=PROTOCOL_VERSION)

    registry = Registry(autoload=False)
    with pytest.raises(PluginError, match=r"unknown hook 'verl_backnd'.*the hooks are: .*verl_backend"):
        registry.register(Misspelt(), "misspelt")
    assert "misspelt" not in registry.backends()
    assert not registry.pm.has_plugin("misspelt")


def test_hooks_are_called_through_pluggy_per_plugin() -> None:
    class Two:
        @hookimpl
        def verl_backend(self) -> BackendSpec:
            return BackendSpec("two", {"reward": "x:y"}, {}, protocol_version=PROTOCOL_VERSION)

        def verl_weight_sync(self, source: str, target: str) -> None:  # not marked: never called
            raise AssertionError("an unmarked function is not a hook")

    registry = Registry(autoload=False)
    registry.register(Two(), "two")
    assert registry.backend("two").spec.name == "two"
    assert type(registry.weight_sync("two", "two")).__name__ == "StreamWeightSync"


def test_spec_name_must_match_entry_name_and_capabilities_match_role() -> None:
    class Wrong:
        @hookimpl
        def verl_backend(self) -> BackendSpec:
            return BackendSpec("other", {"reward": "x:y"}, {}, protocol_version=PROTOCOL_VERSION)

    with pytest.raises(PluginError, match="spec name must equal the entry-point name"):
        Registry(autoload=False).register(Wrong(), "wrong")
    with pytest.raises(PluginError, match="capabilities must be TrainingCapabilities"):
        BackendSpec("b", {"actor": "x:y"}, {"actor": RewardCapabilities()}, protocol_version="1.0")


def test_weight_sync_falls_back_to_the_canonical_stream() -> None:
    assert isinstance(Registry(autoload=False).weight_sync("a", "b"), StreamWeightSync)


def test_importing_core_and_listing_backends_imports_no_engine_library() -> None:
    code = (
        "import sys, io, contextlib, verl_core\n"
        "from verl_core.cli import main\n"
        "verl_core.available_backends()\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['backends'])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'megatron', 'vllm'})\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_cli_version_and_backends_json() -> None:
    version = subprocess.run([sys.executable, "-m", "verl_core.cli", "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"verl-core 0.1.0 (protocol {PROTOCOL_VERSION})"
    out = subprocess.run([sys.executable, "-m", "verl_core.cli", "backends", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["toy"]["distribution"] == "verl-toy-plugin"
    assert data["toy"]["roles"]["reward"]["scores"] is True


def test_cli_backends_lists_no_conformance_meta_test_backend() -> None:
    """The meta-tests' broken backends are registered by those tests only, never installed."""
    env = {k: v for k, v in os.environ.items() if k != PLUGINS_ENV}
    out = subprocess.run([sys.executable, "-m", "verl_core.cli", "backends", "--json"],
                         capture_output=True, text=True, check=True, env=env)
    data = json.loads(out.stdout)
    assert {"example", "hf", "megatron", "vllm"} <= set(data), sorted(data)
    test_only = sorted(n for n, b in data.items() if n.startswith("broken-") or "broken" in b["distribution"])
    assert test_only == [], f"`verl backends` lists test-only backends: {test_only}"


def test_plugins_named_in_the_environment_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLUGINS_ENV, f" toy2 = {__name__}:_TOY2 ")
    b = Registry(autoload=False).backend("toy2")
    assert (b.distribution, b.version, b.spec.roles["reward"]) == (PLUGINS_ENV, f"{__name__}:_TOY2", "m:f")
    monkeypatch.setenv(PLUGINS_ENV, "toy2")
    with pytest.raises(PluginError, match=r"VERL_PLUGINS entries must be 'name=module:attr', got 'toy2'"):
        Registry(autoload=False).backends()
    monkeypatch.setenv(PLUGINS_ENV, "toy2=no_such_module_xyz:plugin")
    with pytest.raises(PluginError, match=r"cannot import 'no_such_module_xyz'"):
        Registry(autoload=False).backends()



def test_cli_backends_table_aligns_long_values(tmp_path: Path) -> None:
    """A VERL_PLUGINS backend's version is its module path: the columns widen, every role stays aligned."""
    (tmp_path / "verl_long_version_toy.py").write_text(
        "from verl_core import PROTOCOL_VERSION, BackendSpec, hookimpl\n\n\n@hookimpl\ndef verl_backend():\n"
        "    return BackendSpec(name='longtoy', roles={'reward': 'm:f'}, capabilities={},\n"
        "                       protocol_version=PROTOCOL_VERSION)\n")
    env = {**os.environ, PLUGINS_ENV: "longtoy=verl_long_version_toy",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "verl_core.cli", "backends"], capture_output=True, text=True,
                         check=True, env=env)
    lines = out.stdout.splitlines()
    assert any(line.startswith("longtoy ") and " verl_long_version_toy " in line for line in lines), out.stdout
    role_column = lines[0].index("role: capabilities")
    for line in lines[2:]:
        assert re.match(r"(actor|reference|critic|rollout|reward|broken): ", line[role_column:]), out.stdout

class _Toy2:
    @hookimpl
    def verl_backend(self) -> BackendSpec:
        return BackendSpec(name="toy2", roles={"reward": "m:f"}, capabilities={}, protocol_version=PROTOCOL_VERSION)


_TOY2 = _Toy2()


def test_importing_core_loads_no_trainer_or_algorithm_module_until_used() -> None:
    """A backend process imports ``verl_core`` and builds engines: the trainer and algorithms stay out."""
    code = (
        "import sys, verl_core\n"
        "verl_core.available_backends()\n"
        "upper = sorted(m for m in sys.modules if m.startswith(('verl_core.trainer', 'verl_core.algorithms')))\n"
        "print(upper)\n"
        "assert verl_core.GRPOConfig().epsilon > 0\n"
        "print(verl_core.get_registry().component('advantage', 'grpo').name)\n"
        "print(verl_core.get_registry().component('advantage', 'grpo_token').name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "grpo", "grpo_token"], out.stdout + out.stderr


def test_kernel_names_no_upper_layer_module_by_string() -> None:
    """The registry's built-ins are handed in from the package facade, not imported by name."""
    import verl_core.kernel as kernel

    for path in Path(kernel.__file__).parent.glob("*.py"):
        text = path.read_text()
        for upper in ("verl_core.algorithms", "verl_core.trainer", "verl_conformance"):
            assert f'"{upper}' not in text, f"{path.name} names {upper} in a string"


def test_conformance_command_is_found_through_its_entry_point() -> None:
    from importlib.metadata import entry_points

    from verl_core import cli

    commands = {ep.name: ep.value for ep in entry_points(group=cli.COMMANDS_GROUP)}
    assert commands.get("conformance") == "verl_conformance.cli:register"
    assert "verl_conformance" not in Path(cli.__file__).read_text()


def test_a_broken_command_plugin_is_listed_and_fails_only_when_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from verl_core import cli

    monkeypatch.setattr(cli, "_plugin_commands", lambda: {"broken": "no_such_module_xyz:register"})
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = capsys.readouterr().out
    assert "broken" in listed and "unavailable" in listed and "no_such_module_xyz" in listed
    assert cli.main(["broken", "x"]) == 2
    err = capsys.readouterr().err
    assert "verl broken: error:" in err and "no_such_module_xyz" in err
    assert cli.main(["backends"]) == 0


def _zero(batch: TensorBatch, config: object) -> TensorBatch:
    return batch


class _PresetPlugin:
    """A plugin declaring the presets it is given and, with ``estimator``, one advantage estimator."""

    def __init__(self, *presets: object, estimator: bool = True) -> None:
        self.presets = list(presets)
        self.estimator = estimator

    @hookimpl
    def verl_algorithm_components(self) -> list[AlgorithmComponent]:
        return [AlgorithmComponent.advantage("zero_adv", _zero, None, "zero")] if self.estimator else []

    @hookimpl
    def verl_algorithm_presets(self) -> list[object]:
        return self.presets


def test_a_plugin_preset_is_listed_after_the_builtin_ones() -> None:
    registry = Registry(autoload=False)
    registry.register(_PresetPlugin(Preset("zero_grpo", "grpo", estimator="zero_adv")), "zeros", distribution="zeros-dist")
    presets = registry.presets()
    assert list(presets)[:2] == ["ppo", "grpo"] and list(presets)[-1] == "zero_grpo"
    assert registry.preset("zero_grpo").estimator == "zero_adv"
    with pytest.raises(UnknownNameError, match=r"unknown algorithm 'zero'; choices: ppo, grpo, .*zero_grpo"):
        registry.preset("zero")


def test_a_preset_name_taken_by_verl_core_or_another_plugin_is_refused_naming_both() -> None:
    registry = Registry(autoload=False)
    registry.presets()  # verl-core's are registered
    with pytest.raises(PluginError, match=r"algorithm preset 'grpo' is registered by both verl-core and clash-dist"):
        registry.register(_PresetPlugin(Preset("grpo", "grpo", estimator="zero_adv")), "clash", distribution="clash-dist")
    # a refused plugin leaves nothing behind: not its estimator either
    assert "zero_adv" not in registry.components("advantage")
    registry.register(_PresetPlugin(Preset("mine", "grpo")), "first", distribution="first-dist")
    with pytest.raises(PluginError, match=r"'mine' is registered by both first-dist and second-dist"):
        registry.register(_PresetPlugin(Preset("mine", "rloo"), estimator=False), "second", distribution="second-dist")
    assert registry.preset("mine").constructor == "grpo"


def test_a_plugin_that_takes_a_builtin_preset_name_before_the_builtins_load_fails_every_lookup() -> None:
    registry = Registry(autoload=False)
    registry.register(_PresetPlugin(Preset("dapo", "grpo")), "early", distribution="early-dist")
    for _ in range(2):
        with pytest.raises(PluginError, match=r"'dapo' is registered by both early-dist and verl-core"):
            registry.presets()


def test_a_preset_that_is_not_a_preset_record_or_names_no_constructor_is_refused() -> None:
    from verl_core.algorithms import build_preset

    with pytest.raises(PluginError, match=r"verl_algorithm_presets\(\) must return Preset records.*got {'name': 'x'} \(dict\)"):
        Registry(autoload=False).register(_PresetPlugin({"name": "x"}), "bad")
    with pytest.raises(PluginError, match=r"Preset.name must be a non-empty string, got ''"):
        Preset("", "grpo")
    with pytest.raises(PluginError, match=r"names the constructor 'grpoo', which Algorithm does not have; "
                                          r"constructors: cispo, dr_grpo, grpo"):
        build_preset(Preset("typo", "grpoo"), {})


def test_python_m_verl_core_is_the_verl_command() -> None:
    """``python -m verl_core`` runs the same command as the ``verl`` script (an environment without it)."""
    proc = subprocess.run([sys.executable, "-m", "verl_core", "backends", "--json"], capture_output=True,
                          text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert "hf" in json.dumps(listed), listed
