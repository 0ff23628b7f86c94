"""Asynchronous training with ``async_training.partial_rollouts``: its config rules, the capability it
needs, episodes that continue across a weight update with each turn's version recorded, and episodes
restarted on the new weights instead."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core import ConfigError
from verl_core.agent.loop import EPISODE_KEY
from verl_core.kernel.schema import TURNS_EXTRA
from verl_core.trainer import Trainer, load_config
from verl_core.trainer.rl.step_state import StepState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import partial_rollout_env
from agent_helpers import chat_model_path


@pytest.mark.parametrize("partial", ["continue", "restart"])
@pytest.mark.parametrize("overrides", [
    [],
    ["async_training.mode=async", "async_training.max_staleness=0"],
])
def test_partial_rollouts_need_async_with_staleness(partial: str, overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match=f"partial_rollouts='{partial}'.*max_staleness >= 1"):
        load_config(None, [*overrides, f"async_training.partial_rollouts={partial}"])


def test_restarts_are_bounded_by_the_staleness() -> None:
    restart = ["async_training.mode=async", "async_training.max_staleness=3", "async_training.partial_rollouts=restart"]
    assert load_config(None, restart).async_training.max_restarts == 3
    assert load_config(None, restart[:2]).async_training.max_restarts == 0  # finish
    assert load_config(None, [*restart[:2], "async_training.partial_rollouts=continue"]).async_training.max_restarts == 0


@pytest.mark.parametrize("partial", ["continue", "restart"])
def test_partial_rollouts_are_refused_before_any_step_by_a_rollout_without_concurrent_weight_updates(
        tmp_path: Path, partial: str) -> None:
    cfg = load_config(None, [f"output_dir={json.dumps(str(tmp_path / 'run'))}", "steps=1", "logging.progress=false",
                             "async_training.mode=async", f"async_training.partial_rollouts={partial}",
                             "backends.rollout=example", "model.hidden_size=32",
                             "model.intermediate_size=64", "model.num_heads=1", "model.num_kv_heads=1"])
    with Trainer(cfg) as trainer, pytest.raises(ConfigError, match=f"'{partial}'.*concurrent_weight_update"):
        trainer.setup()


Episodes = list[list[dict[str, Any]]]
"""Per step taken, its episodes' :class:`~verl_core.agent.loop.EpisodeInfo`."""


def _train(tmp_path: Path, partial: str,
           infos: Episodes | None = None) -> tuple[list[dict[str, float]], list[list[list[int]]]]:
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": "q"}], "answer": str(i)}) + "\n" for i in range(6)))
    cfg = load_config(None, [
        f"model.path={json.dumps(chat_model_path())}", f"data.train={json.dumps(str(tmp_path / 'train.jsonl'))}",
        f"output_dir={json.dumps(str(tmp_path / partial))}", "steps=2", "rollout.n=2", "rollout.max_new_tokens=4",
        "batch.prompts_per_step=3", "data.shuffle=false", "agent.max_turns=3", "agent.max_total_tokens=40",
        f"agent.environment={json.dumps('partial_rollout_env:make')}", "algorithm.options={kl_loss_coef=0.0}",
        "async_training.mode=async", "async_training.max_staleness=1",
        f"async_training.partial_rollouts={partial}", "logging.progress=false", "logging.plot=false",
        "checkpoint.final=false",
    ])
    versions: list[list[list[int]]] = []
    with Trainer(cfg) as trainer:
        trainer.setup()
        partial_rollout_env.reset(trainer)
        take = trainer._produced_state

        def recorded() -> StepState:  # each step's turns and their weight versions, as the trainer takes them
            state = take()
            versions.append([[v for t in ep for v in t["weight_versions"]] for ep in state.samples.extras[TURNS_EXTRA]])
            if infos is not None:
                infos.append(list(state.samples.extras[EPISODE_KEY]))
            return state

        trainer._produced_state = recorded  # type: ignore[method-assign]
        sync = trainer.weights.sync

        def after_the_second_step_started(state: StepState) -> None:  # the race this test is not about:
            # the first update lands only once the second step's episodes are under way
            assert partial_rollout_env.reached.wait(60), "the second step's episodes never reached their first step"
            sync(state)

        trainer.weights.sync = after_the_second_step_started  # type: ignore[method-assign]
        history = trainer.train()
    return history, versions


def test_continue_lets_an_episode_finish_on_the_weights_updated_while_it_ran(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    history, versions = _train(tmp_path, "continue")
    # step 2's episodes waited between turns for the update of step 1, which did not wait for them
    assert partial_rollout_env.waited and all(partial_rollout_env.waited)
    first, second = versions
    assert all(v == [0] * len(v) for v in first)  # step 1: sampled before any update
    assert any(v[0] == 0 and v[-1] == 1 for v in second)  # step 2: turns of versions 0 and then 1
    assert all(v == sorted(v) for v in second)
    assert history[1]["agent/mixed_versions"] > 0 and history[0]["agent/mixed_versions"] == 0
    assert [m["async/staleness"] for m in history] == [0, 1]  # from the oldest version that sampled the step


def test_restart_samples_an_episode_that_spans_the_update_again_on_the_new_weights(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    infos: Episodes = []
    history, versions = _train(tmp_path, "restart", infos)
    assert partial_rollout_env.waited and all(partial_rollout_env.waited)
    first, second = versions
    assert all(v == [0] * len(v) for v in first)
    assert all(i["restarts"] == 0 and i["restarted_tokens"] == 0 for i in infos[0])
    restarted = [i["restarts"] for i in infos[1]]
    # every episode of step 2 under way when the update landed was sampled again, wholly on version 1
    assert sum(restarted) > 0 and set(restarted) <= {0, 1}  # max_staleness=1: at most one restart
    for v, info in zip(second, infos[1], strict=True):
        assert len(set(v)) == 1  # no episode mixes versions
        if info["restarts"]:
            assert set(v) == {1} and info["restarted_tokens"] > 0
    # the environment of each restart is a fresh one, built by the factory like a new episode's
    assert partial_rollout_env.made() == 12 + sum(restarted)
    assert history[1]["agent/mixed_versions"] == 0 and history[0]["agent/restarted_episodes"] == 0
    assert history[1]["agent/restarted_episodes"] == pytest.approx(sum(r > 0 for r in restarted) / len(restarted))
    assert history[1]["agent/restarted_tokens"] == pytest.approx(
        sum(i["restarted_tokens"] for i in infos[1]) / len(infos[1]))
    oldest = min(v for ep in second for v in ep)
    assert [m["async/staleness"] for m in history] == [0, 1 - oldest]  # the weights trained at step 2 are version 1


def test_continue_samples_the_released_steps_at_once_in_shared_generate_calls(tmp_path: Path) -> None:
    """Under "continue" the producer samples step t+1 while step t's episodes still run, and their
    turns share generate calls: some call holds more rows than one step has episodes."""
    torch.set_num_threads(1)
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": "q"}], "answer": str(i)}) + "\n" for i in range(12)))
    cfg = load_config(None, [
        f"model.path={json.dumps(chat_model_path())}", f"data.train={json.dumps(str(tmp_path / 'train.jsonl'))}",
        f"output_dir={json.dumps(str(tmp_path / 'run'))}", "steps=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "batch.prompts_per_step=3", "agent.max_turns=3", "agent.max_total_tokens=40",
        f"agent.environment={json.dumps('partial_rollout_env:ragged')}", "algorithm.options={kl_loss_coef=0.0}",
        "async_training.mode=async", "async_training.max_staleness=1", "async_training.partial_rollouts=continue",
        "logging.progress=false", "logging.plot=false", "checkpoint.final=false",
    ])
    calls: list[tuple[int, int]] = []  # (rows, steps in flight) of each generate call
    with Trainer(cfg) as trainer:
        trainer.setup()
        engine = trainer.engines.rollout
        generate = engine.generate

        def recorded(prompts: Any, params: Any) -> Any:
            calls.append((prompts.batch_size, trainer.producer.in_flight if trainer.producer is not None else 0))
            return generate(prompts, params)

        engine.generate = recorded  # type: ignore[method-assign]
        history = trainer.train()
    assert len(history) == 4 and all(m["async/staleness"] <= 1 for m in history)
    assert max(in_flight for _, in_flight in calls) == 2  # max_staleness + 1 steps sampled at once
    assert max(rows for rows, _ in calls) > 6, calls  # one step has 3 prompts x 2 samples
