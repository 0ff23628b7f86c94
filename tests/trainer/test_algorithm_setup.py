"""Algorithm presets come from one table: names, options, defaults and the trainer's flags."""

from __future__ import annotations

import pytest

from verl_core.algorithms import PRESET_TABLE, PRESETS, Algorithm, preset_options
from verl_core.kernel.errors import ConfigError
from verl_core.trainer.config import load_config
from verl_core.trainer.rl.algorithm_setup import AlgorithmSetup, build_algorithm


def test_presets_are_the_rows_that_are_a_constructor_as_it_is() -> None:
    assert PRESETS == ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                       "remax", "gspo", "cispo")
    assert {"dapo", "grpo_token"} == set(PRESET_TABLE) - set(PRESETS)


@pytest.mark.parametrize("name", list(PRESET_TABLE))
def test_every_row_builds_with_its_defaults(name: str) -> None:
    preset = PRESET_TABLE[name]
    algo = build_algorithm(name, {})
    assert algo.estimator == (preset.estimator or Algorithm.from_name(preset.constructor, **preset.fixed).estimator)
    for key, value in preset.defaults.items():
        assert preset_options(preset)[key] == value
    assert not set(preset.fixed) & set(preset_options(preset))


def test_a_recipe_changes_only_its_defaults() -> None:
    dapo = build_algorithm("dapo", {})
    assert dapo.actor_loss.config.policy.clip_high == 0.28 and dapo.actor_loss.config.kl_loss_coef == 0.0
    assert build_algorithm("dapo", {"clip_high": 0.3}).actor_loss.config.policy.clip_high == 0.3
    baseline = build_algorithm("reinforce_pp_baseline", {})
    assert baseline.estimator == "reinforce_pp_baseline"


def test_unknown_names_and_options_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'algorithm.name': unknown algorithm 'ppg'; choices: ppo, grpo, .*dapo"):
        build_algorithm("ppg", {})
    with pytest.raises(ConfigError, match=r"'algorithm.options.baseline' is not an option of algorithm "
                                          r"'reinforce_pp_baseline'"):
        build_algorithm("reinforce_pp_baseline", {"baseline": False})


@pytest.mark.parametrize(("name", "dynamic"), [("dapo", True), ("grpo", False)])
def test_dynamic_sampling_comes_from_the_table(name: str, dynamic: bool) -> None:
    setup = AlgorithmSetup.from_config(load_config(None, [f"algorithm.name={name}"]))
    assert setup.dynamic_sampling is dynamic


def test_from_name_builds_every_registered_preset_as_the_trainer_does() -> None:
    from verl_core.algorithms import OffPolicyConfig

    for name in PRESET_TABLE:
        assert repr(Algorithm.from_name(name)) == repr(build_algorithm(name, {}))
    dapo = Algorithm.from_name("dapo", clip_high=0.3, offpolicy=OffPolicyConfig("tis"))
    assert dapo.actor_loss.config.policy.clip_high == 0.3 and dapo.actor_loss.config.offpolicy.mode == "tis"
    with pytest.raises(ConfigError, match=r"'algorithm.options.lam' is not an option of algorithm 'grpo'"):
        Algorithm.from_name("grpo", lam=0.9)
