"""A plugin adds an advantage estimator and a preset built on it through the hooks; a run selects it by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from verl_core import AlgorithmComponent, Preset, TensorBatch, hookimpl
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.registry import PLUGINS_ENV, get_registry, reset_registry
from verl_core.trainer.config import load_config
from verl_core.trainer.rl.algorithm_setup import AlgorithmSetup, build_algorithm

CALLS: list[int] = []
"""Batch sizes the plugin's estimator was called with (the run must reach the plugin's code)."""


def centered(batch: TensorBatch, config: object) -> TensorBatch:
    """Each sample's score minus the batch's mean score, on every loss token."""
    CALLS.append(batch.batch_size)
    scores = batch["scores"]
    adv = batch.loss_mask.float() * (scores - scores.mean())[:, None]
    return batch.update(advantages=adv, returns=adv)


class CenteredPlugin:
    """A plugin that adds one estimator and one preset (GRPO's loss with it, no KL loss)."""

    @hookimpl
    def verl_algorithm_components(self) -> list[AlgorithmComponent]:
        return [AlgorithmComponent.advantage("centered", centered, None, "Score minus the batch mean.",
                                             reads=("scores",), outcome=True)]

    @hookimpl
    def verl_algorithm_presets(self) -> list[Preset]:
        return [Preset("centered_grpo", "grpo", defaults={"kl_loss_coef": 0.0}, estimator="centered",
                       summary="GRPO's loss with batch-centred scores")]


PLUGIN = CenteredPlugin()


@pytest.fixture(autouse=True)
def _plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin named in VERL_PLUGINS (as a plugin that is not installed is), in a fresh registry."""
    monkeypatch.setenv(PLUGINS_ENV, f"centered-plugin={__name__}:PLUGIN")
    reset_registry()
    CALLS.clear()
    yield
    reset_registry()


def test_the_plugin_preset_is_registered_after_the_builtin_ones() -> None:
    names = list(get_registry().presets())
    assert names[-1] == "centered_grpo"
    assert names.index("grpo") < names.index("centered_grpo")


def test_the_plugin_preset_builds_with_its_estimator_and_defaults() -> None:
    algo = build_algorithm("centered_grpo", {"clip_high": 0.3})
    assert (algo.name, algo.estimator) == ("centered_grpo", "centered")
    assert algo.actor_loss.config.kl_loss_coef == 0.0 and not algo.uses_reference
    assert algo.actor_loss.config.policy.clip_high == 0.3
    batch = TensorBatch({
        "response_mask": torch.tensor([[True, True], [True, False], [True, True]]),
        "scores": torch.tensor([1.0, 0.0, 2.0]),
    })
    out = algo.compute_advantages(batch)
    assert out["advantages"].tolist() == [[0.0, 0.0], [-1.0, 0.0], [1.0, 1.0]]
    with pytest.raises(ConfigError, match=r"'algorithm.options.lam' is not an option of algorithm 'centered_grpo'"):
        build_algorithm("centered_grpo", {"lam": 0.9})


def test_a_run_config_selects_the_plugin_preset() -> None:
    setup = AlgorithmSetup.from_config(load_config(None, ["algorithm.name=centered_grpo"]))
    assert setup.algorithm.estimator == "centered"
    assert not setup.use_reference and not setup.use_critic and not setup.dynamic_sampling


def test_the_cli_checks_the_plugin_preset_and_lists_it_among_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from verl_core.cli import main

    assert main(["train", "--check", "algorithm.name=centered_grpo"]) == 0
    assert "config is valid (100 steps, algorithm 'centered_grpo'" in capsys.readouterr().err
    assert main(["train", "--check", "algorithm.name=centred"]) == 2
    err = capsys.readouterr().err
    assert "unknown algorithm 'centred'; choices: ppo, grpo," in err and "centered_grpo" in err


@pytest.mark.slow
def test_a_run_trains_with_the_plugin_preset(tmp_path: Path) -> None:
    from verl_core.trainer.rl.trainer import Trainer

    cfg = load_config(None, [
        "algorithm.name=centered_grpo", "steps=2", "task.name=copy", "task.digits=1", "task.reward=partial",
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=1", "model.num_kv_heads=1",
        "rollout.n=4", "rollout.max_new_tokens=3", "batch.prompts_per_step=4",
        "logging.progress=false", "logging.plot=false", f"output_dir={json.dumps(str(tmp_path))}",
    ])
    with Trainer(cfg) as trainer:
        history = trainer.train()
    assert [m["weight_version"] for m in history] == [1, 2]
    assert CALLS == [16, 16]  # the plugin's estimator ran on each step's whole batch


def test_algorithm_from_name_builds_the_plugin_preset() -> None:
    from verl_core.algorithms import Algorithm

    assert Algorithm.from_name("centered_grpo").estimator == "centered"
