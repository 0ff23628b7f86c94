"""The example configs load, validate, and run a step with the backends they name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_core.trainer.config import load_config
from verl_core.trainer.rl.trainer import Trainer, build_algorithm

CONFIGS = sorted((Path(__file__).parents[2] / "examples" / "configs").glob("*.toml"))
# the two stages of `make demo` (the second starts from the first's model) run in
# tests/examples/test_demo_recipe.py, the LoRA variant of the second in tests/examples/test_demo_lora.py;
# those of the tool demo (a model of its own, then SFT, then GRPO in episodes) in tests/examples/test_agent_demo.py
RECIPE_STAGES = ("sft_demo.toml", "grpo_demo.toml", "grpo_lora_demo.toml", "agent_sft.toml", "agent_grpo.toml")


def test_there_are_example_configs() -> None:
    names = {p.name for p in CONFIGS}
    assert {"grpo_token_demo.toml", "ppo_demo.toml", *RECIPE_STAGES} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_is_valid(path: Path) -> None:
    cfg = load_config(path)
    algo = build_algorithm(cfg.algorithm.name, cfg.algorithm.options)
    if path.name.startswith("ppo"):
        assert algo.uses_critic
    assert cfg.rollout.max_new_tokens > cfg.task.digits


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name not in RECIPE_STAGES], ids=lambda p: p.name)
def test_example_config_runs_a_step(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path, ["steps=2", "batch.prompts_per_step=4", "rollout.n=4", "logging.progress=false",
                             "logging.plot=false", f"output_dir={json.dumps(str(tmp_path))}"])
    with Trainer(cfg) as trainer:
        hist = trainer.train()
    assert [m["step"] for m in hist] == [1, 2]
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in hist)
