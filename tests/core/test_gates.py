"""The engines' shared boundary checks: a spec outside the declared capabilities, and model inputs."""

from __future__ import annotations

import dataclasses

import pytest

from verl_conformance.testkit import random_batch
from verl_core import (
    BatchValidationError,
    ConfigError,
    EngineSpec,
    RolloutCapabilities,
    TrainingCapabilities,
)
from verl_core.enginekit.gates import check_model_inputs, refuse_undeclared

TRAINING = TrainingCapabilities(dtypes=frozenset({"float32", "bfloat16"}), gradient_checkpointing=False)
ROLLOUT = RolloutCapabilities(dtypes=frozenset({"float32", "bfloat16"}))


def spec(**kw: object) -> EngineSpec:
    return dataclasses.replace(EngineSpec(model_path="unused", role="actor"), **kw)  # type: ignore[arg-type]


def test_a_declared_spec_passes() -> None:
    refuse_undeclared(spec(dtype="bfloat16"), TRAINING, engine="the x engine")
    refuse_undeclared(spec(dtype="float32", role="rollout", gradient_checkpointing=True), ROLLOUT,
                      engine="the x rollout")  # a rollout ignores gradient checkpointing


def test_an_undeclared_dtype_is_refused_naming_it_and_the_declared_ones() -> None:
    with pytest.raises(ConfigError, match=r"the x engine runs in bfloat16 or float32 .*dtype='float16' "
                                          r"\(needs loss scaling\); set EngineSpec.dtype to 'float32'"):
        refuse_undeclared(spec(dtype="float16"), TRAINING, engine="the x engine", why="needs loss scaling")
    with pytest.raises(ConfigError, match="float16"):
        refuse_undeclared(spec(dtype="float16", role="rollout"), ROLLOUT, engine="the x rollout")


def test_undeclared_gradient_checkpointing_is_refused() -> None:
    with pytest.raises(ConfigError, match="gradient_checkpointing=False"):
        refuse_undeclared(spec(gradient_checkpointing=True), TRAINING, engine="the x engine")
    declared = dataclasses.replace(TRAINING, gradient_checkpointing=True)
    refuse_undeclared(spec(gradient_checkpointing=True), declared, engine="the x engine")


def test_undeclared_parallel_sizes_and_devices_are_refused_naming_them() -> None:
    from verl_core import ParallelSizes

    for key, name in (("tp", "tensor_parallel"), ("pp", "pipeline_parallel"), ("dp", "data_parallel")):
        with pytest.raises(ConfigError, match=rf"the x engine does not declare EngineSpec.parallel {key}=2 "
                                              rf"\({name}=False\); set those sizes to 1"):
            refuse_undeclared(spec(parallel=ParallelSizes(**{key: 2})), TRAINING, engine="the x engine")
        refuse_undeclared(spec(parallel=ParallelSizes(**{key: 2})), dataclasses.replace(TRAINING, **{name: True}),
                          engine="the x engine")
    # a rollout's dp is its ranks' shares (colocated with the actor): not refused here
    refuse_undeclared(spec(role="rollout", parallel=ParallelSizes(dp=2)), ROLLOUT, engine="the x rollout")
    with pytest.raises(ConfigError, match=r"the x rollout does not declare EngineSpec.parallel pp=2"):
        refuse_undeclared(spec(role="rollout", parallel=ParallelSizes(pp=2)), ROLLOUT, engine="the x rollout")
    refuse_undeclared(spec(role="rollout", parallel=ParallelSizes(tp=2)), dataclasses.replace(ROLLOUT, tensor_parallel=True),
                      engine="the x rollout")
    with pytest.raises(ConfigError, match=r"runs on cpu \(its declared devices\), not EngineSpec.device='cuda:1'"):
        refuse_undeclared(spec(device="cuda:1"), TRAINING, engine="the x engine")
    refuse_undeclared(spec(device="cuda:1"), dataclasses.replace(TRAINING, devices=frozenset({"cpu", "cuda"})),
                      engine="the x engine")


def test_model_inputs_within_the_spec_limits() -> None:
    batch = random_batch(batch_size=3, max_prompt=6, max_response=5, seed=1)
    limits = spec(max_prompt_len=6, max_response_len=5)
    check_model_inputs(batch, limits, where="E.forward (actor)", vocab_size=128)
    for short in (dict(max_prompt_len=int(batch["prompt_mask"].sum(1).max()) - 1),
                  dict(max_response_len=int(batch["response_mask"].sum(1).max()) - 1)):
        with pytest.raises(BatchValidationError, match=r"^E.forward \(actor\): longest prompt .* raise them"):
            check_model_inputs(batch, dataclasses.replace(limits, **short), where="E.forward (actor)",  # type: ignore[arg-type]
                               vocab_size=128)


def test_model_inputs_missing_or_out_of_vocabulary_are_refused() -> None:
    batch = random_batch(batch_size=2, seed=2)
    with pytest.raises(BatchValidationError, match="response_mask"):
        check_model_inputs(batch.select("prompt_ids", "prompt_mask", "response_ids"), spec(), where="E", vocab_size=128)
    with pytest.raises(BatchValidationError):
        check_model_inputs(batch, spec(), where="E", vocab_size=int(batch["response_ids"].max()))
