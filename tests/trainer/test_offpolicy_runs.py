"""Off-policy correction in a run: the ``[algorithm.offpolicy]`` section, its checks, and runs with it.

The section reaches the actor loss through ``AlgorithmSetup``; runs of the tiny default model on the
built-in task report the correction's metrics; with ``mode = "none"`` a run is bit for bit the run
without the section; a rollout whose log-probs are shifted by a known amount gets exactly the
truncation or masking the formulas say.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import TINY_RUN, cli_run, comparable, write

from verl_core.algorithms import OffPolicyConfig
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.config import config_from_dict, config_to_dict, load_config
from verl_core.trainer.rl.algorithm_setup import AlgorithmSetup, check_offpolicy_rollout
from verl_core.trainer.rl.trainer import Trainer

RUN = "steps = 2\n" + TINY_RUN
SECTION = """
[algorithm.offpolicy]
mode = "{mode}"
level = "sequence"
upper = 3.0
"""


# ----------------------------------------------------------------------------- the section
def test_the_section_from_toml_yaml_and_dotted_overrides(tmp_path: Path) -> None:
    toml = write(tmp_path, "run.toml", RUN + SECTION.format(mode="tis"))
    cfg = load_config(toml)
    assert cfg.algorithm.offpolicy == OffPolicyConfig("tis", "sequence", upper=3.0)
    over = load_config(toml, ["algorithm.offpolicy.mode=mis", "algorithm.offpolicy.level=geometric",
                              "algorithm.offpolicy.upper=1.01", "algorithm.offpolicy.lower=0.98"])
    assert over.algorithm.offpolicy == OffPolicyConfig("mis", "geometric", upper=1.01, lower=0.98)
    assert load_config(None).algorithm.offpolicy == OffPolicyConfig()  # off by default
    assert config_from_dict(config_to_dict(over)) == over
    pytest.importorskip("yaml")
    yaml = write(tmp_path, "run.yaml", "algorithm:\n  offpolicy:\n    mode: mis\n    upper: 2.5\n")
    assert load_config(yaml).algorithm.offpolicy == OffPolicyConfig("mis", "token", upper=2.5)


@pytest.mark.parametrize(("overrides", "match"), [
    (["algorithm.offpolicy.mode=is"], r"config key 'algorithm.offpolicy.mode': 'is' is not valid; "
                                      r"choices: 'none', 'tis', 'mis'"),
    (["algorithm.offpolicy.level=batch"], r"'algorithm.offpolicy.level': 'batch' .*'token', 'sequence', 'geometric'"),
    (["algorithm.offpolicy.upper=0.5"], r"config key 'algorithm.offpolicy.upper' = 0.5 is out of range; "
                                        r"allowed: \[1.0, inf\]"),
    (["algorithm.offpolicy.lower=-0.1"], r"'algorithm.offpolicy.lower' = -0.1 is out of range; allowed: \[0.0, 1.0\]"),
    (["algorithm.offpolicy.upper=\"2\""], r"'algorithm.offpolicy.upper': expected a finite number, got '2'"),
    (["algorithm.offpolicy.cap=2.0"], r"unknown config key 'algorithm.offpolicy.cap'; valid keys in "
                                      r"'algorithm.offpolicy': mode, level, upper, lower"),
    (["algorithm.offpolicy.mode=tis", "algorithm.offpolicy.lower=0.5"],
     r"config section 'algorithm.offpolicy': option 'lower' = 0.5 applies only to mode 'mis'"),
])
def test_errors_name_the_key(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_the_preset_options_refuse_it_and_name_the_section() -> None:
    cfg = load_config(None, ['algorithm.options.offpolicy={mode="tis"}'])
    with pytest.raises(ConfigError, match=r"'algorithm.options.offpolicy' is not an option of algorithm 'grpo': "
                                          r"set it in its own section, \[algorithm.offpolicy\]"):
        AlgorithmSetup.from_config(cfg)


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "gspo"])
def test_the_section_reaches_the_actor_loss_and_turns_the_separate_forward_on(name: str) -> None:
    on = AlgorithmSetup.from_config(load_config(None, [f"algorithm.name={name}", "algorithm.offpolicy.mode=mis",
                                                       "algorithm.offpolicy.level=geometric"]))
    assert on.algorithm.actor_loss.config.offpolicy == OffPolicyConfig("mis", "geometric")
    assert "rollout_log_probs" in on.algorithm.actor_loss.batch_fields
    assert not on.on_policy_old_log_probs  # the step's ratio statistics need the old log-probs first
    off = AlgorithmSetup.from_config(load_config(None, [f"algorithm.name={name}"]))
    assert off.algorithm.actor_loss.config.offpolicy == OffPolicyConfig()
    assert "rollout_log_probs" not in off.algorithm.actor_loss.batch_fields
    none = AlgorithmSetup.from_config(load_config(None, [f"algorithm.name={name}", "algorithm.offpolicy.mode=none",
                                                         "algorithm.offpolicy.level=sequence"]))
    assert none.on_policy_old_log_probs == off.on_policy_old_log_probs


# ----------------------------------------------------------------------------- runs
def _finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_verl_train_with_a_correction_reports_its_metrics(tmp_path: Path, mode: str) -> None:
    history = cli_run(tmp_path, mode, RUN + SECTION.format(mode=mode), "checkpoint.final=false")
    share = "actor/offpolicy/truncated_frac" if mode == "tis" else "actor/offpolicy/masked_frac"
    assert len(history) == 2
    for m in history:
        stats = [m["algorithm/offpolicy/ratio_min"], m["algorithm/offpolicy/ratio_mean"],
                 m["algorithm/offpolicy/ratio_max"]]
        assert all(_finite(v) for v in [*stats, m["actor/offpolicy/weight_mean"], m[share]]), m
        assert stats == sorted(stats)
        # the hf rollout's log-probs are exact: the engines differ by float rounding only
        assert stats[0] == pytest.approx(1.0, abs=1e-4) and stats[2] == pytest.approx(1.0, abs=1e-4)
        assert m[share] == 0.0 and m["actor/offpolicy/weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert _finite(m["actor/loss"]) and _finite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
        assert "time/actor_forward" in m  # the old log-probs come from the separate forward


@pytest.mark.slow
def test_mode_none_is_the_run_without_the_section(tmp_path: Path) -> None:
    plain = cli_run(tmp_path, "plain", RUN)
    none = cli_run(tmp_path, "none", RUN + SECTION.format(mode="none"))
    assert [comparable(m) for m in plain] == [comparable(m) for m in none]
    assert not any("offpolicy" in k for m in none for k in m)
    assert plain[-1]["actor/grad_norm"] > 0  # the runs learned something, identically
    ckpt = Path("checkpoints") / "step-000002" / "actor"
    weights = [sorted((tmp_path / run / ckpt).rglob("model.safetensors")) for run in ("plain", "none")]
    assert len(weights[0]) == len(weights[1]) == 1
    assert weights[0][0].read_bytes() == weights[1][0].read_bytes()


SHIFT = 0.7  # the rollout's log-probs are lowered by this: rho = exp(0.7) = 2.01 at every token


def _shifted_run(tmp_path: Path, *overrides: str) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor],
                                                            dict[str, torch.Tensor]]:
    cfg = load_config(write(tmp_path, "run.toml", RUN), [f"output_dir={json.dumps(str(tmp_path / 'out'))}",
                                                           "checkpoint.final=false", "algorithm.options.kl_loss_coef=0.0",
                                                           *overrides])
    with Trainer(cfg) as trainer:
        trainer.setup()
        rollout = trainer.rollout
        generate = rollout.generate

        def shifted(prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
            out = generate(prompts, params)
            return out.update(rollout_log_probs=(out["rollout_log_probs"] - SHIFT) * out["response_mask"])

        rollout.generate = shifted  # type: ignore[method-assign]
        model = trainer.actor.model  # type: ignore[attr-defined]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        history = trainer.train()
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return history, before, after


@pytest.mark.slow
def test_a_known_mismatch_is_truncated_by_tis(tmp_path: Path) -> None:
    history, before, after = _shifted_run(tmp_path, "algorithm.offpolicy.mode=tis", "algorithm.offpolicy.upper=1.5")
    for m in history:
        for key in ("ratio_min", "ratio_mean", "ratio_max"):
            assert m[f"algorithm/offpolicy/{key}"] == pytest.approx(math.exp(SHIFT), rel=1e-4), key
        assert m["actor/offpolicy/truncated_frac"] == 1.0
        assert m["actor/offpolicy/weight_mean"] == pytest.approx(1.5)
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.slow
def test_a_known_mismatch_is_masked_by_mis_and_nothing_is_learned(tmp_path: Path) -> None:
    history, before, after = _shifted_run(tmp_path, "algorithm.offpolicy.mode=mis", "algorithm.offpolicy.upper=1.5")
    for m in history:
        assert m["algorithm/offpolicy/ratio_min"] == pytest.approx(math.exp(SHIFT), rel=1e-4)
        assert m["actor/offpolicy/masked_frac"] == 1.0
        assert m["actor/offpolicy/weight_mean"] == 0.0
        assert m["actor/pg_loss"] == 0.0 and m["actor/grad_norm"] == 0.0
    # every token is dropped and no other term is on: the weights do not move (AdamW, no decay)
    assert all(torch.equal(before[n], after[n]) for n in before)
    kept, start, moved = _shifted_run(tmp_path / "wide", "algorithm.offpolicy.mode=mis",
                                      "algorithm.offpolicy.upper=2.5")  # rho = 2.01 is inside [0.4, 2.5]
    assert all(m["actor/offpolicy/masked_frac"] == 0.0 for m in kept)
    assert any(m["actor/grad_norm"] > 0 for m in kept)
    assert any(not torch.equal(start[n], moved[n]) for n in start)


def test_the_check_passes_an_exact_rollout_and_a_run_without_correction() -> None:
    """The hf rollout's log-probs are exact under any sampling: nothing is refused."""
    from verl_conformance.testkit import tiny_model
    from verl_core import EngineSpec, get_rollout_engine

    engine = get_rollout_engine("hf", EngineSpec(str(tiny_model()), "rollout", max_prompt_len=8, max_response_len=4))
    try:
        for extra in (["rollout.top_k=5", "rollout.top_p=0.9"], []):
            check_offpolicy_rollout(load_config(None, ["algorithm.offpolicy.mode=tis", *extra]), engine)
            check_offpolicy_rollout(load_config(None, extra), engine)
    finally:
        engine.close()
