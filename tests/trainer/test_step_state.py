"""The typed step state: a stage that reads a field before its stage ran, or sets a wrong type, fails clearly."""

from __future__ import annotations

import pytest
import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.batching.replay import HybridReplayBuffer
from verl_core.trainer.config import load_config
from verl_core.trainer.rl.algorithm_setup import build_algorithm
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.step_state import RunProgress, StepState, StepStateError
from verl_core.trainer.rl.update import UpdateStage


def _state(step: int = 4) -> StepState:
    prompts = TensorBatch({"prompt_ids": torch.ones(2, 3, dtype=torch.int64),
                           "prompt_mask": torch.ones(2, 3, dtype=torch.bool)})
    return StepState(step, prompts, SamplingParams(max_new_tokens=4, n=2))


def test_a_field_read_before_its_stage_ran_names_the_field_and_the_stage() -> None:
    state = _state()
    with pytest.raises(StepStateError, match=r"step 5: field 'old_log_probs' .* before stage 'actor_forward'"):
        _ = state.old_log_probs
    assert not state.has("old_log_probs")
    state.old_log_probs = None  # an optional output: None is a value (the batch was empty)
    assert state.has("old_log_probs") and state.old_log_probs is None


def test_a_field_of_the_wrong_type_is_refused() -> None:
    state = _state()
    with pytest.raises(StepStateError, match=r"stage 'reward' set field 'scores' .*list.*expected Tensor"):
        state.scores = [1.0, 0.0]  # type: ignore[assignment]
    with pytest.raises(StepStateError, match=r"expected Tensor or None"):
        state.fill({"ref_log_probs": 0.5})
    assert not state.has("scores") and not state.has("ref_log_probs")


def test_fill_refuses_a_name_that_is_no_field() -> None:
    with pytest.raises(StepStateError, match=r"'sample' is not a field of the step state"):
        _state().fill({"sample": None})


def test_the_advantages_before_the_forwards_raise_a_step_state_error() -> None:
    config = load_config(None, ["logging.progress=false"])
    updater = UpdateStage(config, RLEngines(), build_algorithm("grpo", {}), {}, HybridReplayBuffer(),
                          RunProgress(), dynamic_sampling=False)
    state = _state(0)
    with pytest.raises(StepStateError, match=r"step 1: field 'old_log_probs' .* before stage 'actor_forward'"):
        updater.advantages(state)
    state.fill({"old_log_probs": None, "entropy": None})
    with pytest.raises(StepStateError, match=r"field 'batch' .* before stage 'select'"):
        updater.advantages(state)
    state.batch = state.prompts
    with pytest.raises(StepStateError, match=r"'actor_forward' gave none \(the batch has 2 samples\)"):
        updater.advantages(state)
    with pytest.raises(StepStateError, match=r"field 'train_batch' .* before stage 'advantages'"):
        updater.run(state)
