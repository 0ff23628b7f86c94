"""The run's memory plan: bytes per engine from the model's config.json, the choice it makes and the refusal.

The device's total is faked (the memory probe is replaced), so a CPU machine plans for an H200
(141 GB) or an 80 GB device. The model folders hold only a config.json: the plan reads no weights.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from verl_core.kernel.errors import ConfigError
from verl_core.trainer.batching.budget import ModelShape
from verl_core.trainer.config import RunConfig, load_config
from verl_core.trainer.run import memory_plan
from verl_core.trainer.run.memory_plan import (
    FILL_LIMIT,
    REFUSE_ABOVE,
    MemoryPlan,
    lora_parameters,
    plan_memory,
    plan_run_memory,
)

GB = 10**9
H200 = 141 * GB

# Llama-shaped configs (vocab 32000, untied): the benchmark presets of bench_grpo_vs_trl.py.
SHAPES: dict[str, dict[str, Any]] = {
    "0.9b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 5632},
    "6.7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "head_dim": 128, "intermediate_size": 11008},
    "13.5b": {"hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 13824},
}


def folder(tmp: Path, name: str) -> str:
    path = tmp / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32000, "tie_word_embeddings": False, **SHAPES[name]}))
    return str(path)


def config(path: str, *extra: str, batch: str = "8x8x128") -> RunConfig:
    prompts, n, new = batch.split("x")
    return load_config(None, [
        f"model.path={json.dumps(path)}", "model.dtype=bfloat16", "model.device=cuda",
        f"batch.prompts_per_step={prompts}", f"rollout.n={n}", f"rollout.max_new_tokens={new}", *extra])


def plan(path: str, *extra: str, total: int = H200, reference: bool = False, batch: str = "8x8x128") -> MemoryPlan:
    got = plan_memory(config(path, *extra, batch=batch), path, max_prompt_len=32, use_reference=reference,
                      use_critic=False, total_bytes=total)
    assert got is not None
    return got


def term(p: MemoryPlan, what: str) -> int:
    return next(t.nbytes for t in p.terms if t.what == what)


def test_parameter_counts_of_the_shapes() -> None:
    counts = {name: ModelShape.from_config({"vocab_size": 32000, **s}) for name, s in SHAPES.items()}
    assert {k: round(v.parameters / 1e9, 2) for k, v in counts.items() if v} == {
        "0.9b": 0.89, "6.7b": 6.74, "13.5b": 13.54}


def test_the_0_9b_model_fits_with_float32_masters(tmp_path: Path) -> None:
    p = plan(folder(tmp_path, "0.9b"), batch="16x8x2048")
    shape = ModelShape.from_config({"vocab_size": 32000, **SHAPES["0.9b"]})
    assert shape is not None
    n = shape.parameters
    assert p.master_weights and not p.dropped_masters and p.options == {} and p.notes == ()
    assert term(p, "actor weights") == 2 * n and term(p, "actor float32 masters") == 4 * n
    assert term(p, "actor gradients") == 4 * n and term(p, "actor AdamW moments") == 8 * n
    assert term(p, "rollout weights") == 2 * n
    # 128 rows x (32 + 2048) tokens x 16 layers x keys and values of 8 x 128 x 2 bytes
    assert term(p, "rollout KV cache") == 128 * 2080 * 16 * 2 * 1024 * 2
    # the rollout sleeps in the update: its copy and cache count in the rollout phase only
    assert p.phase_bytes("update") == sum(t.nbytes for t in p.terms if "update" in t.phases)
    assert p.phase_bytes("rollout") - p.phase_bytes("update") == (
        term(p, "rollout weights") + term(p, "rollout KV cache") + term(p, "rollout sampling")
        - term(p, "actor gradients") - term(p, "update activations"))
    assert p.fits and p.share < FILL_LIMIT
    table = p.table()
    for what in ("actor float32 masters", "rollout KV cache", "update activations", "= update phase", "141.0 GB"):
        assert what in table
    assert p.metrics()["memory_plan/master_weights"] == 1.0
    assert p.metrics()["memory_plan/master_weights_dropped"] == 0.0
    # asynchronous: the rollout samples the next step during the update, so its copy counts there too
    ahead = plan(folder(tmp_path, "0.9b"), "async_training.mode=async", batch="16x8x2048")
    awake = term(p, "rollout weights") + term(p, "rollout KV cache") + term(p, "rollout sampling")
    assert ahead.phase_bytes("update") == p.phase_bytes("update") + awake
    same = plan(folder(tmp_path, "0.9b"), "async_training.mode=async", "async_training.max_staleness=0",
                batch="16x8x2048")
    assert same.phase_bytes("update") == p.phase_bytes("update")


def test_the_reward_model_counts_with_reward_model_s_shape(tmp_path: Path) -> None:
    """A 6.7B reward model behind a 0.9B policy weighs 6.7B parameters; without reward_model, the policy's shape."""
    policy, rm = folder(tmp_path, "0.9b"), folder(tmp_path, "6.7b")
    shapes = {k: ModelShape.from_config({"vocab_size": 32000, **SHAPES[k]}) for k in ("0.9b", "6.7b")}
    assert shapes["0.9b"] is not None and shapes["6.7b"] is not None
    own = plan(policy, "backends.reward=hf", f"reward_model={json.dumps(rm)}")
    assert term(own, "reward model weights") == 2 * shapes["6.7b"].parameters
    assert "(reward_model's shape)" in own.table()
    assert term(plan(policy, "backends.reward=hf"), "reward model weights") == 2 * shapes["0.9b"].parameters
    assert not any(t.what == "reward model weights" for t in plan(policy).terms)


def test_gradient_checkpointing_shrinks_the_update_s_activations(tmp_path: Path) -> None:
    """The plan's activations per token are the token budget's (each layer's input and one recomputed layer)."""
    path = folder(tmp_path, "0.9b")
    full, checkpointed = term(plan(path), "update activations"), term(plan(path, "model.gradient_checkpointing=true"),
                                                                     "update activations")
    assert 0 < checkpointed < full / 4, (checkpointed, full)


def test_the_6_7b_model_with_masters_is_flagged_and_trains_without_them(tmp_path: Path) -> None:
    path = folder(tmp_path, "6.7b")
    p = plan(path)
    assert p.configured_peak > FILL_LIMIT * H200, "float32 masters: 18 bytes per parameter at the update"
    assert p.dropped_masters and not p.master_weights
    assert p.peak_bytes <= FILL_LIMIT * H200 and "actor float32 masters" not in {t.what for t in p.terms}
    assert term(p, "actor AdamW moments") == 2 * 2 * 6_738_415_616  # bfloat16 moments, as torch's AdamW keeps them
    assert p.options == {"actor": {"master_weights": False}}
    (note,) = p.notes
    assert note.startswith("WARNING: float32 master weights do not fit")
    assert "backends.options.actor.master_weights=false" in note and "141.0 GB" in note
    assert p.metrics()["memory_plan/master_weights_dropped"] == 1.0
    applied = p.apply(config(path, "backends.options.actor.allreduce_bucket_bytes=1024"))
    assert applied.backends.options["actor"] == {"allreduce_bucket_bytes": 1024, "master_weights": False}
    # chosen by the user: no warning, the same plan
    chosen = plan(path, "backends.options.actor.master_weights=false")
    assert not chosen.dropped_masters and chosen.notes == () and chosen.peak_bytes == p.peak_bytes
    # megatron-core's own optimizer always steps float32 main parameters: nothing to drop, a tight warning
    kept = plan(path, "backends.actor=megatron", "backends.options.actor.optimizer=megatron")
    assert kept.master_weights and kept.notes and "above 85%" in kept.notes[0]


def test_the_13_5b_model_is_refused_with_the_figures_where_it_cannot_fit(tmp_path: Path) -> None:
    path = folder(tmp_path, "13.5b")
    pure = plan(path)  # masters need 18 bytes per parameter (244 GB); pure bfloat16 needs 8 (108 GB)
    assert pure.dropped_masters and pure.fits and pure.configured_peak > H200
    for total, extra, reference in [(80 * GB, (), False), (H200, (), True), (H200, ("rollout.sleep=never",), True),
                                    (H200, ("async_training.mode=async",), True)]:
        cfg = config(path, *extra)
        with pytest.raises(ConfigError) as err:
            plan_run_memory(cfg, path, max_prompt_len=32, use_reference=reference, use_critic=False,
                            total_bytes=total)
        text = str(err.value)
        assert "the run does not fit on cuda: its engines need" in text and "refused above 95%" in text
        # the smallest plan is reported: pure bfloat16, with the masters' figure beside it
        assert "even without float32 master weights (with them: " in text and "no master weights" in text
        assert f"{total / GB:,.1f} GB" in text and "actor AdamW moments" in text
        assert "more devices: executor='ray' with ray.parallel.actor = {dp = " in text
        if "rollout.sleep=never" in extra:
            assert "rollout.sleep='auto'" in text
        if "async_training.mode=async" in extra:  # it samples the next step during the update
            assert "async_training.max_staleness=0" in text and "rollout.sleep='auto'" not in text
        again = plan(path, *extra, total=total, reference=reference)
        assert again.share > REFUSE_ABOVE
    # megatron-core's optimizer keeps float32 main parameters: the masters are not offered as an option
    with pytest.raises(ConfigError, match="float32 master weights") as err:
        plan_run_memory(config(path, "backends.actor=megatron", "backends.options.actor.optimizer=megatron"), path,
                        max_prompt_len=32, use_reference=False, use_critic=False, total_bytes=H200)
    assert "master_weights=false" not in str(err.value) and "even without" not in str(err.value)


def test_a_lora_run_keeps_the_frozen_base_and_trains_the_adapter_only(tmp_path: Path) -> None:
    path = folder(tmp_path, "13.5b")
    shape = ModelShape.from_config({"vocab_size": 32000, **SHAPES["13.5b"]})
    assert shape is not None
    cfg = config(path, "model.lora.enabled=true")
    h, q, kv, ffn = 5120, 40 * 128, 8 * 128, 13824
    per_layer = 8 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + ffn) + (ffn + h))  # rank 8, the 7 projections
    assert lora_parameters(shape, cfg.model.lora) == 48 * per_layer
    full = config(path, "model.lora.enabled=true", 'model.lora.full=["lm_head"]').model.lora
    assert lora_parameters(shape, full) == 48 * per_layer + 32000 * 5120
    p = plan(path, "model.lora.enabled=true", total=80 * GB, reference=True)
    n, a = shape.parameters, 48 * per_layer
    assert term(p, "actor weights (frozen base)") == 2 * n
    assert term(p, "actor adapter float32 masters") == 4 * a and term(p, "actor adapter AdamW moments") == 8 * a
    assert "reference weights" not in {t.what for t in p.terms}, "the reference is the actor's base"
    assert p.fits and p.master_weights and not p.dropped_masters
    assert term(p, "rollout weights") == 2 * n  # merged sync: the rollout holds merged weights of its own
    # adapter sync between hf engines: the rollout serves the actor's base, only its adapter is its own
    shared = plan(path, "model.lora.enabled=true", "model.lora.sync=adapter", total=80 * GB, reference=True)
    assert "rollout weights" not in {t.what for t in shared.terms}
    assert term(shared, "rollout adapter weights") == 4 * a
    assert shared.peak_bytes < p.peak_bytes - 2 * n + 4 * a + 1
    # refused without LoRA on the same device, the message gives the LoRA figure
    with pytest.raises(ConfigError, match=r"model.lora.enabled=true: train a LoRA adapter of rank 8 .*: "
                                          rf"{p.peak_bytes / GB:,.1f} GB\)"):
        plan_run_memory(config(path), path, max_prompt_len=32, use_reference=True, use_critic=False,
                        total_bytes=80 * GB)


def test_no_plan_without_a_config_json_or_under_ray(tmp_path: Path) -> None:
    assert plan_memory(config(str(tmp_path)), str(tmp_path), max_prompt_len=8, use_reference=False,
                       use_critic=False, total_bytes=H200) is None
    path = folder(tmp_path, "13.5b")
    assert plan_run_memory(config(path, "executor=ray"), path, max_prompt_len=8, use_reference=False,
                           use_critic=False, total_bytes=GB) is None


TINY = ["task.name=copy", "task.digits=1", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_heads=1", "model.num_kv_heads=1", "rollout.n=2", "rollout.max_new_tokens=3",
        "batch.prompts_per_step=2", "steps=1", "logging.plot=false", "checkpoint.final=false",
        "model.dtype=bfloat16"]


def _fake_total(monkeypatch: pytest.MonkeyPatch, total: int) -> None:
    monkeypatch.setattr(memory_plan, "device_memory", lambda device: (total, total))


def test_a_run_trains_without_masters_when_only_that_fits_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from verl_core.trainer.rl.trainer import Trainer

    def run_config(name: str, *extra: str) -> RunConfig:
        return load_config(None, [*TINY, f"output_dir={json.dumps(str(tmp_path / name))}", *extra])

    with Trainer(run_config("first"), stream=io.StringIO()) as first:  # builds the tiny model; room to spare
        first.setup()
        roomy, path, limit = first.memory_plan, first.engines.actor.spec.model_path, first.source.prompt_limit()
        assert first.engines.actor._optim.master is not None  # type: ignore[attr-defined]
    assert roomy is not None and roomy.master_weights and not roomy.dropped_masters
    pure = plan_memory(run_config("x", "backends.options.actor.master_weights=false"), path, max_prompt_len=limit,
                       use_reference=False, use_critic=False, total_bytes=10**15)
    assert pure is not None and pure.peak_bytes < roomy.peak_bytes
    _fake_total(monkeypatch, int((roomy.peak_bytes + pure.peak_bytes) / 2 / FILL_LIMIT))  # masters over the limit
    stream = io.StringIO()
    with (caplog.at_level(logging.WARNING, logger="verl_core.trainer.run.memory_plan"),
          Trainer(run_config("second", f"model.path={json.dumps(path)}"), stream=stream) as trainer):
        hist = trainer.train()
        assert trainer.memory_plan is not None and trainer.memory_plan.dropped_masters
        assert trainer.engines.actor._optim.master is None  # type: ignore[attr-defined]
    (warning,) = [r for r in caplog.records if r.name == "verl_core.trainer.run.memory_plan"]
    assert warning.levelno == logging.WARNING and warning.getMessage().startswith("float32 master weights do not fit")
    assert "memory plan (pure bfloat16, no master weights):" in stream.getvalue()
    assert hist[0]["memory_plan/master_weights_dropped"] == 1.0 and hist[0]["memory_plan/master_weights"] == 0.0
    # what sleeping, waking and the out-of-memory back-off cost the step
    assert {"time/rollout_sleep", "time/rollout_wake", "time/weight_sync", "scheduler/actor/oom_seconds"} <= set(hist[0])


def test_a_run_that_cannot_fit_is_refused_before_any_model_loads(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_core.trainer.rl.trainer import Trainer

    _fake_total(monkeypatch, 100_000)
    cfg = load_config(None, [*TINY, f"output_dir={json.dumps(str(tmp_path))}"])
    with Trainer(cfg, stream=io.StringIO()) as trainer:
        with pytest.raises(ConfigError, match="the run does not fit on cpu"):
            trainer.setup()
        assert not hasattr(trainer.engines, "actor") and not hasattr(trainer.engines, "rollout")
