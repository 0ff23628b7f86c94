"""The typed step state and the declared stages: a stage that reads what its producer has not added,
or adds a wrong type, fails clearly, naming the stage that produces it."""

from __future__ import annotations

import pytest
import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.batching.replay import HybridReplayBuffer
from verl_core.trainer.config import load_config
from verl_core.trainer.rl.algorithm_setup import build_algorithm
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.stages import GENERATION, STAGES, producer, stage_backend
from verl_core.trainer.rl.step_state import RunProgress, StepState, StepStateError
from verl_core.trainer.rl.update import UpdateStage


def _state(step: int = 4) -> StepState:
    prompts = TensorBatch({"prompt_ids": torch.ones(2, 3, dtype=torch.int64),
                           "prompt_mask": torch.ones(2, 3, dtype=torch.bool)})
    return StepState(step, prompts, SamplingParams(max_new_tokens=4, n=2))


def test_a_value_read_before_its_stage_ran_names_the_value_and_the_stage() -> None:
    state = _state()
    with pytest.raises(StepStateError, match=r"step 5: field 'batch' .* before stage 'select'"):
        _ = state.batch
    with pytest.raises(StepStateError, match=r"field 'samples' .* before stage 'reward'"):
        _ = state.samples
    assert not state.has("batch")
    state.batch = state.prompts
    assert state.has("batch") and state.batch is state.prompts


def test_a_value_of_the_wrong_type_is_refused() -> None:
    state = _state()
    with pytest.raises(StepStateError, match=r"stage 'select' set field 'batch' .*list.*expected TensorBatch"):
        state.batch = [1.0, 0.0]  # type: ignore[assignment]
    assert not state.has("batch")
    state.batch = state.prompts
    with pytest.raises(StepStateError, match=r"stage 'reference' gave 'ref_log_probs' as .*float.*expected a tensor"):
        state.add_fields({"ref_log_probs": 0.5})  # type: ignore[dict-item]
    assert "ref_log_probs" not in state.batch


def test_add_fields_adds_tensors_in_one_update_and_skips_none() -> None:
    state = _state()
    state.batch = state.prompts
    state.add_fields({"scores": torch.tensor([1.0, 0.0]), "values": None})
    assert torch.equal(state.batch["scores"], torch.tensor([1.0, 0.0])) and "values" not in state.batch


def test_the_advantages_before_the_forwards_name_the_missing_field_and_its_stage() -> None:
    config = load_config(None, ["logging.progress=false"])
    updater = UpdateStage(config, RLEngines(), build_algorithm("grpo", {}), {}, HybridReplayBuffer(),
                          RunProgress(), dynamic_sampling=False)
    state = _state(0)
    with pytest.raises(StepStateError, match=r"field 'batch' .* before stage 'select'"):
        updater.advantages(state)
    state.batch = state.prompts
    with pytest.raises(StepStateError, match=r"stage 'advantages' needs the batch field 'old_log_probs', which stage "
                                             r"'actor_forward' adds, but the batch of 2 samples has none"):
        updater.advantages(state)
    with pytest.raises(StepStateError, match=r"stage 'actor_update' needs the batch field 'advantages', which stage "
                                             r"'advantages' adds"):
        updater.run(state)


def test_stages_are_declared_once_and_their_graph_is_closed() -> None:
    names = [s.name for s in STAGES]
    assert len(names) == len(set(names))
    produced = {"prompts"}
    for spec in GENERATION:  # in graph order: everything a stage reads was added before it
        assert set(spec.reads) <= produced, (spec.name, spec.reads)
        assert set(spec.fields) <= set(spec.adds)
        produced |= set(spec.adds)
    assert producer("old_log_probs") == "actor_forward" and producer("nothing") == ""


def test_a_failed_stage_names_the_backend_of_its_role() -> None:
    config = load_config(None, ["backends.actor=hf", "backends.rollout=vllm", "backends.critic=megatron",
                                "logging.progress=false"])
    assert stage_backend(config, "rollout") == "vllm" and stage_backend(config, "baseline") == "vllm"
    assert stage_backend(config, "actor_forward") == "hf" and stage_backend(config, "actor_update") == "hf"
    assert stage_backend(config, "critic_update") == "megatron"
    assert stage_backend(config, "weight_sync") == "hf -> vllm"
    assert stage_backend(config, "select") == "trainer" and stage_backend(config, "logging") == "trainer"
