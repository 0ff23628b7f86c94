"""End-to-end runs of the trainer with the transformers backend on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_core.trainer.config import RunConfig, load_config
from verl_core.trainer.rl.trainer import Trainer, latest_checkpoint

pytestmark = [
    pytest.mark.slow,
]

# copy of 1 digit: "c7=" -> "7" then EOS; partial credit gives a signal from the first step
EASY = [
    "task.name=copy", "task.digits=1", "task.reward=partial",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=1", "model.num_kv_heads=1",
    "rollout.n=8", "rollout.max_new_tokens=3", "batch.prompts_per_step=8",
    "optim.lr=1e-2", "logging.progress=false", "logging.plot=false",
]


def config(tmp: Path, *extra: str) -> RunConfig:
    return load_config(None, [*EASY, f"output_dir={json.dumps(str(tmp))}", *extra])


def run(cfg: RunConfig, *, resume: bool = False) -> list[dict[str, Any]]:
    with Trainer(cfg) as trainer:
        return trainer.train(resume=resume)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_grpo_reward_improves(tmp_path: Path) -> None:
    hist = run(config(tmp_path, "steps=30", "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0",
                      "task.eval_prompts=16", "task.eval_every=15"))
    rewards = [m["reward/mean"] for m in hist]
    assert len(hist) == 30
    assert mean(rewards[-5:]) > mean(rewards[:5]) + 0.15, rewards
    last = hist[-1]
    for key in ("reward/std", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm", "response/length_mean",
                "time/rollout", "time/reward", "time/actor_forward", "time/update", "throughput/tokens_per_s"):
        assert key in last, key
    assert "eval/exact_match" in hist[14]
    assert "eval/exact_match" not in hist[15]
    assert 0.0 <= last["eval/reward_mean"] <= 1.0
    # the hf rollout's log-probs are exact: the mismatch to the actor's forward is a float rounding
    # (one update per batch: the update's own forward gives the old log-probs and the mean mismatch)
    assert isinstance(last["logprob_mismatch/mean"], float)
    assert last["logprob_mismatch/mean"] < 1e-5
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == list(range(1, 31))
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000030"


def test_ppo_with_critic_reward_improves(tmp_path: Path) -> None:
    hist = run(config(tmp_path, "steps=30", "algorithm.name=ppo", "algorithm.options.kl_coef=0.0",
                      "critic_optim.lr=1e-2", "batch.mini_batch_size=32", "batch.epochs=2"))
    rewards = [m["reward/mean"] for m in hist]
    assert mean(rewards[-5:]) > mean(rewards[:5]) + 0.15, rewards
    last = hist[-1]
    assert "critic/vf_loss" in last or "critic/loss" in last, sorted(last)
    assert last["update/optimizer_steps"] == 4  # 64 samples / 32 per mini-batch x 2 epochs


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "remax", "dr_grpo"])
def test_other_algorithms_run(name: str, tmp_path: Path) -> None:
    opts = {"remax": ["algorithm.options.kl_coef=0.0"], "reinforce_pp": ["algorithm.options.kl_coef=0.0"]}
    hist = run(config(tmp_path, "steps=2", f"algorithm.name={name}", *opts.get(name, [])))
    assert len(hist) == 2
    assert hist[-1]["weight_version"] == 2
    if name == "remax":
        assert "time/baseline" in hist[-1]


def _comparable(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}


@pytest.mark.parametrize("algo", [
    ("algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.001"),  # actor + reference
    ("algorithm.name=ppo", "algorithm.options.kl_coef=0.001", "batch.mini_batch_size=32"),  # + critic
], ids=["grpo", "ppo"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, algo: tuple[str, ...]) -> None:
    extra = ("steps=6", *algo, "checkpoint.every=3", "checkpoint.final=false")
    full = run(config(tmp_path / "full", *extra))
    # the interrupted run: stops after step 4 (checkpoint at 3), then resumes from step 3
    cfg = config(tmp_path / "cut", *extra)
    with Trainer(cfg) as trainer:
        trainer.setup()
        (trainer.out / "config.json").write_text("{}")
        for _ in range(4):
            trainer.train_step()
            if trainer.step == 3:
                trainer.save_checkpoint()
    assert latest_checkpoint(tmp_path / "cut") == tmp_path / "cut" / "checkpoints" / "step-000003"
    resumed = run(cfg, resume=True)
    assert len(resumed) == 6
    assert [_comparable(m) for m in resumed] == [_comparable(m) for m in full]


def test_dynamic_sampling_drops_all_equal_groups(tmp_path: Path) -> None:
    hist = run(config(tmp_path, "steps=3", "algorithm.name=dapo", "task.reward=exact"))
    # a random model never answers exactly: every group is all-zero and is dropped
    assert all(m["dynamic_sampling/dropped_groups"] == 8 for m in hist)
    assert all(m.get("update/skipped") == 1 for m in hist)
    assert hist[-1]["weight_version"] == 0


def test_a_step_that_trains_nothing_resends_the_weights_a_sleeping_rollout_dropped(tmp_path: Path) -> None:
    """The trainer sleeps its rollout with sleep_until_sync (what hf does on CUDA: drop the weights,
    stale until the next complete sync); a step whose dynamic sampling keeps no group trains nothing
    and bumps no version, yet the next step's rollout must serve the actor's weights again."""
    import torch

    cfg = config(tmp_path, "steps=2", "algorithm.name=dapo", "task.reward=exact", "rollout.sleep=always")
    with Trainer(cfg) as trainer:
        trainer.setup()
        rollout: Any = trainer.engines.rollout
        drops = []

        def drop() -> None:
            with torch.no_grad():
                for p in rollout.model.parameters():
                    p.zero_()
            rollout._mark_stale("the test dropped the weights")
            drops.append(1)

        rollout.sleep_until_sync = drop
        hist = trainer.train()
        served = dict(rollout.model.named_parameters())
        trained = dict(trainer.actor.model.named_parameters())  # type: ignore[attr-defined]
    assert len(hist) == 2 and len(drops) == 2 and all(m.get("update/skipped") == 1 for m in hist)
    assert not rollout.stale and rollout.weight_version == 0
    assert all(torch.equal(p, trained[n]) for n, p in served.items())


def test_the_actor_budget_is_read_again_once_the_rollout_slept_before_the_first_update(tmp_path: Path) -> None:
    """The budget fixed at setup saw the rollout's weights on the device; the rollout sleeps through
    the update, so the free memory is read again before the first one (and never after)."""
    from verl_core.trainer.batching.scheduler import MemoryInfo

    free = {"bytes": 0}
    cfg = config(tmp_path, "steps=2", "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0",
                 "batch.min_tokens=16", "rollout.sleep=always")
    with Trainer(cfg, memory_probe=lambda: MemoryInfo(free["bytes"], 1 << 34)) as trainer:
        trainer.setup()
        assert trainer.schedulers["actor"].fixed_budget == 16  # no free memory at setup: the minimum
        rollout: Any = trainer.engines.rollout
        sleep = rollout.sleep_until_sync

        def sleep_and_free() -> None:
            sleep()
            free["bytes"] = 1 << 30  # what the sleeping rollout released

        rollout.sleep_until_sync = sleep_and_free
        hist = trainer.train()
    assert hist[0]["scheduler/actor/budget_reread"] > 16
    assert hist[0]["scheduler/actor/budget"] > 16 and "scheduler/actor/budget_reread" not in hist[1]


def test_micro_batching_under_memory_pressure_gives_the_same_update(tmp_path: Path) -> None:
    from verl_core.trainer.batching.scheduler import MemoryInfo

    extra = ("steps=2", "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0", "batch.min_tokens=16")
    base = run(config(tmp_path / "a", *extra))
    # small micro-batches and a replay buffer that spills every batch to disk
    cfg = config(tmp_path / "b", *extra, "batch.buffer_memory_bytes=1")
    with Trainer(cfg, memory_probe=lambda: MemoryInfo(0, 1 << 34)) as trainer:  # no free memory: min_tokens
        squeezed = trainer.train()
    assert squeezed[-1]["scheduler/actor/budget"] == 16
    assert squeezed[-1]["buffer/spilled_samples"] == 64
    assert base[-1]["buffer/spilled_samples"] == 0
    assert squeezed[-1]["actor/num_micro_batches"] > base[-1]["actor/num_micro_batches"]
    for a, b in zip(base, squeezed):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["actor/loss"] == pytest.approx(b["actor/loss"], abs=1e-5)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)


def test_verl_train_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from verl_core.cli import main

    out = tmp_path / "cli"
    args = ["train", "examples/configs/grpo_token_demo.toml", "steps=2", *EASY[:-2], "task.reward=token", "logging.plot=true",
            f"output_dir={json.dumps(str(out))}"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "2/2" in err  # the progress bar reached the last step
    assert "reward" in err
    assert (out / "metrics.jsonl").is_file()
    assert (out / "config.json").is_file()
    assert latest_checkpoint(out) is not None
    pytest.importorskip("matplotlib")
    assert (out / "curves.png").stat().st_size > 1000
    # a bad key is reported with its name and exits 2
    assert main(["train", "rollout.temprature=1"]) == 2
    assert "rollout.temprature" in capsys.readouterr().err


def test_backend_options_reach_each_role_s_engine(tmp_path: Path) -> None:
    from verl_core.kernel.errors import ConfigError

    plain = run(config(tmp_path / "plain", "steps=2"))
    cfg = config(tmp_path / "static", "steps=2", 'backends.options.rollout.rollout_cache="static"')
    with Trainer(cfg) as trainer:
        trainer.setup()
        assert trainer.rollout.decode_mode == "static"  # type: ignore[attr-defined]
        static = trainer.train()
    # the static KV cache samples what the dynamic one samples (float32), so the runs agree
    assert [m["reward/mean"] for m in static] == [m["reward/mean"] for m in plain]
    bad = config(tmp_path / "bad", "steps=1", "backends.options.rollout.rollout_cach=1")
    with Trainer(bad) as trainer, pytest.raises(ConfigError, match="rollout_cach"):
        trainer.setup()
    with pytest.raises(ConfigError, match="choices: actor, rollout"):
        config(tmp_path / "role", "backends.options.policy.lr=1")


def test_a_packing_actor_cuts_rl_steps_by_real_tokens(tmp_path: Path) -> None:
    # the same step with the actor packing or padding under one budget: the actor forward and the
    # update are planned by the engine's packed_sequences, so packing runs fewer micro-batches (sums
    # of 12 and 13 tokens fit a 25-token budget in pairs, padded ones mostly alone), same results
    extra = ("steps=1", "algorithm.name=grpo", "algorithm.options.kl_loss_coef=0.0", "task.name=add", "task.digits=3",
             "rollout.max_new_tokens=5", "batch.micro_batch_tokens=25", 'batch.old_log_probs="recompute"')
    runs = {}
    for pack in (False, True):
        cfg = config(tmp_path / str(pack), *extra, f"backends.options.actor.pack_sequences={str(pack).lower()}")
        with Trainer(cfg) as trainer:
            history = trainer.train()
            assert trainer.actor.capabilities.packed_sequences is pack
            plan = {d.key: len(d.groups) for d in trainer.schedulers["actor"].plan}
        runs[pack] = (history[-1], plan)
    (padded, plan_padded), (packed, plan_packed) = runs[False], runs[True]
    assert sorted(plan_packed) == sorted(plan_padded) == ["step0/actor/forward", "step0/actor/update0"]
    assert all(plan_packed[k] < plan_padded[k] for k in plan_packed), (plan_packed, plan_padded)
    assert packed["actor/num_micro_batches"] == plan_packed["step0/actor/update0"]  # the engine ran the plan
    assert packed["reward/mean"] == padded["reward/mean"]
    assert packed["actor/loss"] == pytest.approx(padded["actor/loss"], abs=1e-5)
    assert packed["actor/grad_norm"] == pytest.approx(padded["actor/grad_norm"], rel=1e-4)
