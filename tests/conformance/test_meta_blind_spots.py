"""Meta-tests of the checks that close blind spots: each planted fault (faulty_engines.py) fails its check.

The faulty engines are the tiny backend with one fault each, given to ``check_backend`` as
factories (the route of a backend that is not installed). Each row runs the checks the fault
targets plus checks it passes or skips (which shows the gap the new check closes) and asserts
that only the new check fails, with a message that points at the fault. The unbroken tiny backend
passing the same checks is the last test here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import faulty_engines as faulty
import pytest
import torch
from verl_tiny_backend.rollout import build_rollout_engine
from verl_tiny_backend.training import build_training_engine

from verl_conformance import ConformanceError, check_backend
from verl_conformance.api import run_conformance
from verl_conformance.checks import CHECKS
from verl_conformance.harness import Harness, Subject
from verl_conformance.runner import run_one
from verl_core import (
    PROTOCOL_VERSION,
    BackendSpec,
    ConfigError,
    EngineSpec,
    RolloutCapabilities,
    SamplingParams,
    TrainingCapabilities,
    hookimpl,
)
from verl_core.kernel.registry import get_registry, reset_registry

Factory = Callable[[EngineSpec], Any]

BLIND_SPOTS: list[tuple[str, Factory | None, Factory | None, list[str], str, list[str]]] = [
    # (label, training factory, rollout factory, checks to run, the check that must fail, message fragments)
    ("rope-scaling-ignored", faulty.RopeScalingIgnoredTraining, faulty.RopeScalingIgnoredRollout,
     ["invariance::rotary_positions_under_left_padding", "numerics::rope_scaling_matches_reference"],
     "numerics::rope_scaling_matches_reference",
     ["forward log_probs on llama-rope-linear", "rope_type 'linear', factor 4.0", "or refuse the folder"]),
    # a backend that reads no rope_theta passes on folders that all use the usual 10000
    ("rope-theta-hard-coded", faulty.HardCodedThetaTraining, faulty.HardCodedThetaRollout,
     ["numerics::log_probs_match_reference", "numerics::config_constants_match_reference"],
     "numerics::config_constants_match_reference",
     ["forward log_probs on llama-constants", "rope_theta 500.0"]),
    # and one that reads it for Llama only: every Qwen folder but the constants ones uses 10000 too
    ("qwen-theta-hard-coded", faulty.QwenThetaHardCodedTraining, faulty.QwenThetaHardCodedRollout,
     ["numerics::log_probs_match_reference", "numerics::config_constants_match_reference"],
     "numerics::config_constants_match_reference",
     ["forward log_probs on qwen2-constants", "rope_theta 500.0"]),
    # an lm_head of its own on a tied Qwen2 (tie_word_embeddings read for Llama and Qwen3 only): the other
    # Qwen2 folders are untied, so only the update on the tied Qwen2 folder sees it
    ("qwen2-tie-ignored", faulty.Qwen2TiedSplitTraining, None,
     ["numerics::log_probs_match_reference", "numerics::loss_and_grads_match_reference"],
     "numerics::loss_and_grads_match_reference",
     ["on qwen2-tied-perturbed", "model.embed_tokens.weight"]),
    # every folder of the test kit set every config key, so a backend's own defaults for omitted keys were never read
    ("omitted-keys-old-defaults", faulty.OmittedKeysOldDefaultsTraining, faulty.OmittedKeysOldDefaultsRollout,
     ["numerics::log_probs_match_reference", "numerics::config_constants_match_reference",
      "numerics::omitted_config_keys_take_family_defaults"],
     "numerics::omitted_config_keys_take_family_defaults",
     ["forward log_probs on llama-omitted-keys", "leaves out head_dim"]),
    # "read every *.safetensors file" had no check: every test-kit folder holds one model.safetensors
    ("sharded-folder-refused", faulty.SingleFileOnlyTraining, faulty.SingleFileOnlyRollout,
     ["numerics::log_probs_match_reference", "numerics::rollout_log_probs_match_reference",
      "numerics::sharded_folder_loads"],
     "numerics::sharded_folder_loads",
     ["the actor engine refused llama-sharded", "read every *.safetensors file of the folder"]),
    # "keep the protocol's signatures and defaults" was a rule without a check (an example backend broke it)
    ("export-default-changed", faulty.BucketDefaultChangedTraining, None,
     ["weight_sync::export_matches_folder", "schema::protocol_signatures_kept"],
     "schema::protocol_signatures_kept",
     ["BucketDefaultChangedTraining.export_weights", "the default of 'bucket_bytes' is 268435456, the protocol's is "
      "536870912"]),
    # the pad-id update compared the actor only: a critic without padding_idx trained the pad row
    ("critic-pad-row-trained", faulty.CriticPadRowTrained, None,
     ["numerics::value_loss_matches_reference", "numerics::pad_token_as_real_token_update"],
     "numerics::pad_token_as_real_token_update",
     ["critic value_mse with the pad id as a real response token grad norm"]),
    # no critic check built on a Qwen folder: the critic's q/k norms could be left at one
    ("critic-qk-norms-unit", faulty.CriticQKNormsUnit, None,
     ["numerics::value_loss_matches_reference", "numerics::values_match_reference"],
     "numerics::values_match_reference", ["critic values on value-qwen3-perturbed"]),
    # the all-empty step was checked on a fresh engine without weight decay, where zero gradients move nothing
    ("empty-step-applied", faulty.EmptyStepApplied, None,
     ["robustness::edge_lengths", "robustness::empty_responses_train"],
     "robustness::empty_responses_train",
     ["the step after an all-empty mini-batch (no loss token) must change no weight", "weight_decay=0.1"]),
    # the undeclared-settings check tried dtypes and gradient checkpointing only
    ("rollout-parallel-ignored", None, faulty.ParallelIgnoredRollout,
     ["schema::generate_layout", "robustness::undeclared_settings_refused"],
     "robustness::undeclared_settings_refused", ["the rollout engine built with parallel tp=2"]),
    # no folder marked sliding layers without a window: the hf and megatron actors and the vllm rollout built
    # on one (transformers' forward then fails at the first call)
    ("windowless-sliding-built", faulty.WindowlessSlidingBuilt, None,
     ["numerics::log_probs_match_reference", "numerics::sliding_window_honoured_or_refused"],
     "numerics::sliding_window_honoured_or_refused", ["the actor engine built on qwen2-sliding-windowless"]),
    # the example and tiny backends hard-coded SiLU: every other folder runs silu
    ("silu-hard-coded", faulty.SiluHardCodedTraining, faulty.SiluHardCodedRollout,
     ["numerics::log_probs_match_reference", "numerics::hidden_act_honoured_or_refused"],
     "numerics::hidden_act_honoured_or_refused",
     ["forward log_probs on llama-gelu", "hidden_act 'gelu_pytorch_tanh'"]),
    # the example backend ignored the sliding-window keys: no other folder declares a window
    ("sliding-window-ignored", faulty.SlidingWindowIgnoredTraining, faulty.SlidingWindowIgnoredRollout,
     ["numerics::log_probs_match_reference", "numerics::sliding_window_honoured_or_refused"],
     "numerics::sliding_window_honoured_or_refused",
     ["forward log_probs on qwen2-sliding", "sliding_window 8 on every layer"]),
    ("sampled-at-t1", None, faulty.SampledAtTemperatureOne,
     ["numerics::rollout_log_probs_match_reference", "invariance::seeded_sampling_reproducible",
      "numerics::sampled_tokens_follow_log_probs"],
     "numerics::sampled_tokens_follow_log_probs",
     ["sampling at T=0.5: the first tokens of 2048 samples", "do not follow the distribution of its rollout_log_probs"]),
    ("greedy-sampling", None, faulty.GreedyWhileReportingSoftmax,
     ["numerics::rollout_log_probs_match_reference", "numerics::sampled_tokens_follow_log_probs"],
     "numerics::sampled_tokens_follow_log_probs", ["sampled 1.000 vs 0.195"]),
    ("top-p-before-temperature", None, faulty.TopPBeforeTemperature,
     ["numerics::rollout_log_probs_match_reference", "invariance::truncated_sampling_keeps_top_token",
      "numerics::sampled_tokens_follow_log_probs"],
     "numerics::sampled_tokens_follow_log_probs", ["sampling at T=0.5, top_p=0.42", "other tokens: sampled"]),
    # the check accepts a tie at the top broken another way (bfloat16): the most likely token must still stay
    ("top-token-dropped", None, faulty.TopTokenDropped,
     ["numerics::rollout_log_probs_match_reference", "invariance::truncated_sampling_keeps_top_token"],
     "invariance::truncated_sampling_keeps_top_token",
     ["top_k=1: sample 0 (prompt 0)", "is below the most likely token's", "float32 near-tie margin 0.0001"]),
    ("scheduler-not-checkpointed", faulty.SchedulerNotCheckpointed, None,
     ["schema::train_step_metrics", "differential::trajectory_matches_reference", "stateful::checkpoint_round_trip"],
     "stateful::checkpoint_round_trip",
     ["the second update after it ran at lr 0.5", "kept its state at 1 (the schedule's position was not restored)"]),
    ("same-stream-for-every-sample", None, faulty.SameStreamForEverySample,
     ["schema::generate_layout", "numerics::rollout_log_probs_match_reference",
      "numerics::sampled_tokens_follow_log_probs"],
     "numerics::sampled_tokens_follow_log_probs", ["do not follow the distribution"]),
    ("greedy-log-probs-at-t1", None, faulty.GreedyLogProbsAtTemperatureOne,
     ["differential::greedy_matches_reference", "numerics::rollout_log_probs_match_reference"],
     "numerics::rollout_log_probs_match_reference", ["rollout_log_probs of greedy decoding at temperature 0.7"]),
    # a direct generate that forgets the output's meta: the layout check names it, the log-probs (right,
    # at the temperature asked for) pass
    ("meta-not-stamped", None, faulty.MetaNotStamped,
     ["schema::generate_layout", "numerics::rollout_log_probs_match_reference"],
     "schema::generate_layout", ["meta must carry the sampling params"]),
    ("unseeded-is-seed-zero", None, faulty.UnseededIsSeedZero, ["invariance::seeded_sampling_reproducible"],
     "invariance::seeded_sampling_reproducible", ["two generate() calls with seed=None gave identical samples"]),
    # the optimizer as OptimConfig describes it (the other checks train without decay, clipping or schedule)
    ("weight-decay-ignored", faulty.WeightDecayIgnored, None,
     ["differential::trajectory_matches_reference", "numerics::optimizer_matches_reference"],
     "numerics::optimizer_matches_reference", ["under AdamW (lr 0.5", "weight_decay 0.1"]),
    ("default-betas", faulty.DefaultBetas, None,
     ["differential::trajectory_matches_reference", "numerics::optimizer_matches_reference"],
     "numerics::optimizer_matches_reference", ["betas (0.8, 0.95)"]),
    ("clip-ignored", faulty.ClipIgnored, None,
     ["differential::trajectory_matches_reference", "numerics::optimizer_matches_reference"],
     "numerics::optimizer_matches_reference", ["under AdamW (lr 0.5", "grad_clip"]),
    ("norm-after-clipping", faulty.NormAfterClipping, None,
     ["schema::train_step_metrics", "numerics::optimizer_matches_reference"],
     "numerics::optimizer_matches_reference", ["update 0 under AdamW", "grad norm vs float64 reference (the global "
                                               "norm before clipping, clipped to"]),
    ("constant-learning-rate", faulty.ConstantLearningRate, None,
     ["schema::train_step_metrics", "stateful::checkpoint_round_trip", "numerics::optimizer_matches_reference"],
     "numerics::optimizer_matches_reference", ["update 0 under AdamW", "ran at lr 0.5, OptimConfig.lr_at(0) is 0.25"]),
    ("coupled-weight-decay", faulty.CoupledWeightDecay, None,
     ["differential::trajectory_matches_reference", "numerics::optimizer_matches_reference"],
     "numerics::optimizer_matches_reference", ["under AdamW (lr 0.5", "weight_decay 0.1"]),
    ("non-finite-step-applied", faulty.NonFiniteStepApplied, None,
     ["robustness::empty_responses_train", "robustness::nonfinite_update_skipped"],
     "robustness::nonfinite_update_skipped", ["optimizer_step after a NaN loss returned skipped=False"]),
    ("skipped-step-counted", faulty.SkippedStepCounted, None,
     ["robustness::empty_responses_train", "robustness::nonfinite_update_skipped"],
     "robustness::nonfinite_update_skipped",
     ["whose loss is NaN and its optimizer_step: export_weights streams version 1"]),
    ("version-counts-skipped-steps", faulty.VersionCountsSkippedSteps, build_rollout_engine,
     ["weight_sync::trainer_to_rollout_sync", "robustness::nonfinite_update_skipped"],
     "robustness::nonfinite_update_skipped", ["export_weights streams version 1", "a skipped one is not applied"]),
    ("budget-ignored", faulty.BudgetIgnored, None, ["invariance::micro_batch_invariance"],
     "invariance::micro_batch_invariance", ["forward_backward with max_tokens=24 ran 1 micro-batches"]),
    ("export-dtype-ignored", faulty.ExportDtypeIgnored, build_rollout_engine,
     ["weight_sync::trainer_to_rollout_sync", "weight_sync::export_matches_folder"],
     "weight_sync::export_matches_folder", ["export_weights(dtype=torch.bfloat16) sent 21 tensors in another dtype"]),
    ("undeclared-settings-ignored", faulty.UndeclaredSettingsIgnored, build_rollout_engine,
     ["numerics::declared_dtypes_and_devices", "robustness::undeclared_settings_refused"],
     "robustness::undeclared_settings_refused",
     ["the actor engine built with dtype='bfloat16' (declared dtypes: ['float32'])"]),
    # the long prompt of this check was also wrongly left-padded, so an engine that never compared a
    # prompt with max_prompt_len passed it for the padding alone
    ("length-limits-ignored", faulty.LengthLimitsIgnored, None, ["robustness::bad_training_input_rejected"],
     "robustness::bad_training_input_rejected", ["forward(prompt longer than max_prompt_len) was accepted"]),
    # state lost on load that the first update after it already shows (caught before three updates too)
    ("moments-reset-on-load", faulty.MomentsResetOnLoad, None, ["stateful::checkpoint_round_trip"],
     "stateful::checkpoint_round_trip", ["the first update after it: weights differ"]),
    ("step-count-not-checkpointed", faulty.StepCountNotCheckpointed, None, ["stateful::checkpoint_round_trip"],
     "stateful::checkpoint_round_trip", ["the first update after it: weights differ"]),
    ("gradients-kept-on-load", faulty.GradientsKeptOnLoad, None,
     ["stateful::checkpoint_round_trip", "stateful::load_drops_pending_gradients"],
     "stateful::load_drops_pending_gradients", ["the first update after it", "load_checkpoint must clear the gradients"]),
    # weight updates on another thread while generate calls run (the other sync checks call one at a time)
    ("weights-written-during-generate", None, faulty.WeightsWrittenDuringGenerate,
     ["weight_sync::rollout_applies_stream", "weight_sync::every_tensor_applied",
      "weight_sync::update_during_generate"],
     "weight_sync::update_during_generate",
     ["matches the output of no complete version", "a half-applied weight version was served"]),
    ("version-taken-at-manifest", None, faulty.VersionTakenAtManifest,
     ["weight_sync::rollout_applies_stream", "weight_sync::every_tensor_applied",
      "weight_sync::update_during_generate"],
     "weight_sync::update_during_generate",
     ["the version reported is not the one that sampled"]),
    ("sleeping-but-taking-weights", None, faulty.SleepingButTakingWeights,
     ["stateful::sleep_wake_round_trip", "weight_sync::rollout_applies_stream", "stateful::update_while_asleep_refused"],
     "stateful::update_while_asleep_refused", ["update_weights while asleep was accepted", "EngineAsleepError"]),
    ("eos-ignored-with-stop-tokens", None, faulty.EosIgnoredWithStopTokens,
     ["schema::generate_layout", "schema::eos_ends_response", "robustness::generate_edge_cases",
      "schema::stop_tokens_end_response"],
     "schema::stop_tokens_end_response",
     ["stop_token_ids=(11, 46)", "continues its prompt with [1]", "response_ids [1, 1, 1, 1, 1, 1]"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("label", "training", "rollout", "checks", "target", "fragments"), BLIND_SPOTS,
                         ids=[row[0] for row in BLIND_SPOTS])
def test_planted_fault_fails_only_its_check(label: str, training: Factory | None, rollout: Factory | None,
                                            checks: list[str], target: str, fragments: list[str]) -> None:
    with pytest.raises(ConformanceError) as info:
        check_backend(label, make_training_engine=training, make_rollout_engine=rollout, checks=checks)
    report = info.value.report
    assert report is not None
    assert [r.id for r in report.failures] == [target], f"{label}: failed {[r.id for r in report.failures]}"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{label}: the error does not point at the fault ({fragment!r}):\n{message}"


def test_a_refusal_naming_only_the_folder_does_not_pass_for_one_naming_the_setting() -> None:
    """The test kit's folder names hold the words the refusal checks look for (``crafted-rope-yarn-...``,
    ``crafted-sliding-window-...``, ``crafted-oov-causal_lm-pad_token_id-...``): a ConfigError that
    names only the folder must fail each check that wants the setting named."""
    targets = ["numerics::rope_scaling_matches_reference", "numerics::sliding_window_honoured_or_refused",
               "robustness::special_token_ids_outside_vocab_refused"]
    with pytest.raises(ConformanceError) as info:
        check_backend("bland-refusal", make_training_engine=faulty.BlandRefusalTraining,
                      make_rollout_engine=faulty.BlandRefusalRollout, checks=targets)
    report = info.value.report
    assert report is not None
    assert sorted(r.id for r in report.failures) == sorted(targets), report.table()
    message = str(info.value)
    assert "could not load" in message and "internal error" in message, message


@pytest.mark.parametrize(("label", "reward", "target", "fragment"), [
    # no reward check sent a bad batch: a reward model without check_model_inputs scored over-long prompts
    ("reward-input-unchecked", faulty.UncheckedReward, "reward::bad_input_rejected",
     "score(token id beyond the vocabulary) raised"),
    # no sample's last real token was the pad id
    ("reward-last-token-from-pad", faulty.LastTokenFromPadReward, "reward::scores_match_reference",
     "whose last real response token is the pad id"),
    # no folder's score head had several labels: row 0 of a classifier was read as the reward
    ("reward-first-label-read", faulty.FirstLabelReward, "reward::unsupported_settings_refused",
     "the reward engine built on a reward folder whose score head has two labels"),
    # the bfloat16 norm check built the actor and rollout alone: a reward model's norms computed in bfloat16
    # passed, as its bfloat16 scores on the random reward folder stay in the tier (unsupported_settings_refused)
    ("reward-bfloat16-norm", faulty.Bfloat16NormReward, "numerics::bfloat16_rms_norm_in_float32",
     "scores in bfloat16 on reward-bf16-norm"),
])
def test_a_reward_model_fault_fails_its_check(label: str, reward: Factory, target: str, fragment: str) -> None:
    checks = ["reward::scores_match_reference", "reward::bad_input_rejected", "reward::score_layout",
              "reward::unsupported_settings_refused"]
    if target not in checks:
        checks.append(target)
    with pytest.raises(ConformanceError) as info:
        check_backend(label, make_reward_engine=reward, checks=checks)
    report = info.value.report
    assert report is not None
    assert [r.id for r in report.failures] == [target], report.table()
    assert fragment in str(info.value), str(info.value)


@pytest.mark.slow
def test_the_tiny_backend_passes_the_new_checks() -> None:
    """The unbroken engines the faults start from pass every check the faults fail (the tiny rollout's
    sleep keeps it serving, so the asleep check is the sleeping variant's: the next test)."""
    targets = sorted({row[4] for row in BLIND_SPOTS} - {"stateful::update_while_asleep_refused"})
    report = check_backend("tiny", make_training_engine=build_training_engine,
                           make_rollout_engine=build_rollout_engine, checks=targets)
    assert {r.id: r.status for r in report.results} == dict.fromkeys(targets, "passed")


def test_a_sync_to_a_sleeping_engine_is_refused_by_the_facade() -> None:
    """A facade engine whose sleep marks it asleep refuses update_weights (the facade's write turn
    checks it) and passes; an engine whose sleep keeps it serving skips the check, saying why."""
    check = ["stateful::update_while_asleep_refused"]
    report = check_backend("sleeping", make_rollout_engine=faulty.SleepingRollout, checks=check)
    assert [r.status for r in report.results] == ["passed"]
    report = check_backend("tiny", make_rollout_engine=build_rollout_engine, checks=check)
    assert [(r.status, r.message) for r in report.results] == [
        ("skipped", "sleep() leaves this engine serving (generate ran while asleep), so there is no asleep state to "
                    "refuse in")]


@pytest.mark.slow
def test_a_tie_at_the_top_broken_to_another_id_passes_in_bfloat16() -> None:
    """bfloat16 logits tie exactly at the top; a backend may break such a tie its own way (vLLM keeps every
    token tied with the k-th), so top_k=1 leaves the greedy path there and the check still passes."""
    h = Harness(Subject.from_factories("ties-to-the-highest-id", make_rollout=faulty.TiesToTheHighestId),
                dtype="bfloat16")
    try:
        engine = h.rollout()
        prompts = h.batch(seed=66, batch_size=2).select("prompt_ids", "prompt_mask", "group_ids")  # the check's
        greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=5))["response_ids"]
        for params in (SamplingParams(top_k=1, max_new_tokens=5), SamplingParams(top_p=1e-6, max_new_tokens=5)):
            # the tie is there: the samples leave the greedy path, which the check used to require
            assert not torch.equal(engine.generate(prompts, params)["response_ids"], greedy), params
        assert run_one(CHECKS["invariance::truncated_sampling_keeps_top_token"], h) == ("passed", "")
    finally:
        h.cache.close()


@pytest.mark.slow
def test_samples_that_part_after_the_first_token_pass_in_bfloat16_and_a_stream_by_batch_position_fails() -> None:
    """Alone and in a batch a prompt runs at other shapes; in bfloat16 the samples may part after the
    first token (other roundings move a draw across a boundary of the sampler), not before."""
    check = CHECKS["invariance::rollout_continues_multi_turn_prefix"]
    for name, make, want in (("tiny", faulty.TinyInBfloat16, "passed"),
                             ("seeded-by-batch-position", faulty.SeededByBatchPosition, "failed")):
        h = Harness(Subject.from_factories(name, make_rollout=make), dtype="bfloat16")
        try:
            status, message = run_one(check, h)
        finally:
            h.cache.close()
        assert status == want, (name, message)
        if want == "failed":
            assert "in bfloat16 they may part after the first token" in message and "alone" in message


# ------------------------------------------------------------------------------ roles on the factory route
_CRITIC_CHECKS = ["schema::critic_layout", "numerics::values_match_reference",
                  "numerics::value_loss_matches_reference"]


def no_critic(spec: EngineSpec) -> Any:
    """The tiny backend's training factory for a backend without a critic: a value-head folder is refused."""
    if spec.role == "critic":
        raise ConfigError("this backend has no critic (no value head)")
    return build_training_engine(spec)


class _TinyWrapped:
    """The tiny backend's training engine, every member but those a subclass plants passed through."""

    def __init__(self, spec: EngineSpec) -> None:
        self.engine = build_training_engine(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class _ShiftedValues(_TinyWrapped):
    """A critic whose values are the tiny critic's plus 0.5 (a declared critic that is wrong)."""

    def forward(self, batch: Any, outputs: Any = frozenset({"log_probs"})) -> Any:
        out = self.engine.forward(batch, outputs)
        if "values" in outputs:
            out = out.update(values=(out["values"] + 0.5) * batch["response_mask"])
        return out


def shifted_critic(spec: EngineSpec) -> Any:
    """The tiny backend's training factory whose critic's values are off by 0.5."""
    return _ShiftedValues(spec) if spec.role == "critic" else build_training_engine(spec)


def test_factories_without_a_critic_skip_its_checks_when_the_roles_say_so() -> None:
    checks = [*_CRITIC_CHECKS, "schema::forward_layout"]
    # without roles=, the factory is taken to build every training role, and the critic checks fail
    with pytest.raises(ConformanceError) as info:
        check_backend("no-critic", make_training_engine=no_critic, checks=checks)
    assert info.value.report is not None
    assert sorted(r.id for r in info.value.report.failures) == sorted(_CRITIC_CHECKS)
    assert "this backend has no critic" in str(info.value)
    # declared roles: the critic's checks are skipped with the installed route's reason
    report = check_backend("no-critic", make_training_engine=no_critic, make_rollout_engine=build_rollout_engine,
                           roles=["actor", "reference", "rollout"], checks=checks)
    status = {r.id: (r.status, r.message) for r in report.results}
    assert status["schema::forward_layout"] == ("passed", "")
    for cid in _CRITIC_CHECKS:
        assert status[cid] == ("skipped", "backend 'no-critic' provides no training engine for role 'critic'"), cid


def test_a_declared_critic_that_is_wrong_still_fails() -> None:
    with pytest.raises(ConformanceError, match="critic values vs float64 reference") as info:
        check_backend("bad-critic", make_training_engine=shifted_critic, roles=["actor", "reference", "critic"],
                      checks=_CRITIC_CHECKS)
    assert info.value.report is not None
    failed = sorted(r.id for r in info.value.report.failures)
    assert "numerics::values_match_reference" in failed, failed
    # the snippet re-runs the same factories with the same roles
    assert "roles=['actor', 'critic', 'reference']" in str(info.value)


class _CriticFailsOnOne(_TinyWrapped):
    """A critic whose forward refuses a batch of one sample."""

    def forward(self, batch: Any, outputs: Any = frozenset({"log_probs"})) -> Any:
        if batch.batch_size == 1:
            raise RuntimeError("cannot squeeze a batch of one")
        return self.engine.forward(batch, outputs)


def test_batch_of_one_runs_the_engines_a_critic_only_backend_provides() -> None:
    """A backend without actor and rollout used to pass ``robustness::batch_of_one`` without running
    any engine: a critic that fails on one sample now fails it, and a backend providing none of the
    engines it exercises is skipped."""
    check = ["robustness::batch_of_one"]
    report = check_backend("critic-only", make_training_engine=build_training_engine, roles=["critic"], checks=check)
    assert [(r.status, r.message) for r in report.results] == [("passed", "")]
    with pytest.raises(ConformanceError, match="cannot squeeze a batch of one"):
        check_backend("bad-critic-only", make_training_engine=_CriticFailsOnOne, roles=["critic"], checks=check)
    report = check_backend("reference-only", make_training_engine=build_training_engine, roles=["reference"],
                           checks=check)
    assert [(r.status, r.message) for r in report.results] == [
        ("skipped", "backend 'reference-only' provides no actor, critic, reward or rollout engine")]


def _critic_ignoring_dtype(spec: EngineSpec) -> Any:
    """The tiny backend's training factory, building a critic in float32 whatever dtype it is asked for."""
    return build_training_engine(dataclasses.replace(spec, dtype="float32") if spec.role == "critic" else spec)


def test_a_critic_only_backend_is_held_to_its_declared_dtypes() -> None:
    check = ["robustness::undeclared_settings_refused"]
    report = check_backend("critic-only", make_training_engine=build_training_engine, roles=["critic"], checks=check)
    assert [r.status for r in report.results] == ["passed"]
    with pytest.raises(ConformanceError, match="the critic engine built with dtype="):
        check_backend("lax-critic", make_training_engine=_critic_ignoring_dtype, roles=["critic"], checks=check)


class _CriticForgettingItsOptimizer(_TinyWrapped):
    """A critic whose load_checkpoint restores the weights and the step but drops AdamW's moments."""

    def load_checkpoint(self, path: Any) -> None:
        self.engine.load_checkpoint(path)
        self.engine.optimizer.state.clear()


class _CriticIgnoringTheCallBudget(_TinyWrapped):
    """A critic whose forward_backward ignores the per-call token budget (max_tokens) a trainer passes."""

    def forward_backward(self, mini_batch: Any, loss_fn: Any, stats: Any, *, max_tokens: int | None = None) -> Any:
        return self.engine.forward_backward(mini_batch, loss_fn, stats)


_TRAINING_CHECKS = ["stateful::checkpoint_round_trip", "stateful::load_drops_pending_gradients",
                    "invariance::micro_batch_invariance", "robustness::empty_responses_train",
                    "robustness::bad_training_input_rejected", "robustness::failed_call_leaves_no_gradients"]


def test_a_critic_only_backend_is_held_to_the_checkpoint_micro_batch_and_input_checks() -> None:
    """These checks built only an actor, so a backend whose only training role is a critic skipped
    them ("provides no training engine for role 'actor'") whatever its checkpoints and micro-batching
    did. They now build the critic there; its planted faults fail them."""
    report = check_backend("critic-only", make_training_engine=build_training_engine, roles=["critic"],
                           checks=_TRAINING_CHECKS)
    assert {r.id: r.status for r in report.results} == dict.fromkeys(_TRAINING_CHECKS, "passed")
    with pytest.raises(ConformanceError) as info:
        check_backend("forgetful-critic", make_training_engine=_CriticForgettingItsOptimizer, roles=["critic"],
                      checks=["stateful::checkpoint_round_trip"])
    assert "the second update after it" in str(info.value) or "the first update after it" in str(info.value)
    assert "the optimizer's moments, its step or the schedule were not restored" in str(info.value)
    with pytest.raises(ConformanceError, match=r"forward_backward with max_tokens=24 ran 1 micro-batches"):
        check_backend("budgetless-critic", make_training_engine=_CriticIgnoringTheCallBudget, roles=["critic"],
                      checks=["invariance::micro_batch_invariance"])


def test_roles_are_checked_against_the_factories() -> None:
    with pytest.raises(ValueError, match=r"roles \['critic'\] are declared but no factory builds them: pass "
                                         r"make_training_engine"):
        check_backend("x", make_rollout_engine=build_rollout_engine, roles=["rollout", "critic"])
    with pytest.raises(ValueError, match=r"roles \['actr'\] are not verl roles"):
        check_backend("x", make_training_engine=build_training_engine, roles=["actr"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="the installed backend 'tiny' provides the roles of its BackendSpec"):
        check_backend("tiny", roles=["actor"])


def test_a_refusal_of_the_training_factory_says_how_to_declare_the_roles() -> None:
    """Without roles=, a factory that refuses the critic is taken to be wrong; the failure names the fix."""
    with pytest.raises(ConformanceError) as info:
        check_backend("no-critic", make_training_engine=no_critic, make_rollout_engine=build_rollout_engine,
                      checks=["schema::critic_layout"])
    assert info.value.report is not None
    [result] = info.value.report.results
    assert result.status == "failed"
    assert result.message.startswith("ConfigError: this backend has no critic (no value head); "), result.message
    assert ("if backend 'no-critic' has no critic engine, pass roles=['actor', 'reference', 'rollout'] to "
            "check_backend (or a provided_roles fixture under pytest) to skip the roles your backend does not "
            "provide") in result.message, result.message
    assert "pass roles=['actor', 'reference', 'rollout']" in info.value.report.table()


class _Ten:
    """An installed backend without a critic (registered in-process), as a third party's is."""

    @hookimpl
    def verl_backend(self) -> BackendSpec:
        caps = TrainingCapabilities(values=False)
        return BackendSpec(
            name="ten",
            roles={"actor": "verl_tiny_backend.training:build_training_engine",
                   "reference": "verl_tiny_backend.training:build_training_engine",
                   "rollout": "verl_tiny_backend.rollout:build_rollout_engine"},
            capabilities={"actor": caps, "reference": caps, "rollout": RolloutCapabilities()},
            protocol_version=PROTOCOL_VERSION,
        )


@pytest.fixture
def ten() -> Iterator[None]:
    """The backend ``ten`` installed for one test."""
    reset_registry()
    get_registry().register(_Ten(), "ten", distribution="verl-ten")
    yield
    reset_registry()


@pytest.mark.usefixtures("ten")
def test_factories_of_an_installed_backend_provide_the_roles_its_spec_declares() -> None:
    """Factories checked under an installed backend's name take its BackendSpec's roles, as the installed
    route does: the critic's checks are skipped, not failed, without roles=."""
    checks = [*_CRITIC_CHECKS, "schema::forward_layout"]
    report = check_backend("ten", make_training_engine=no_critic, make_rollout_engine=build_rollout_engine,
                           checks=checks)
    status = {r.id: (r.status, r.message) for r in report.results}
    assert status["schema::forward_layout"][0] == "passed"
    installed = run_conformance("ten", checks=checks)  # the installed route: the same outcome
    for cid in _CRITIC_CHECKS:
        assert status[cid] == ("skipped", "backend 'ten' provides no training engine for role 'critic'"), cid
    assert {r.id: (r.status, r.message) for r in installed.results} == status
    # only the roles a factory is given for: a training factory alone provides actor and reference
    subject = Subject.from_factories("ten", no_critic)
    assert subject.roles == frozenset({"actor", "reference"})
    # roles= still wins, and a name that is not installed keeps every role of the factories
    assert Subject.from_factories("ten", no_critic, roles=["actor"]).roles == frozenset({"actor"})
    assert Subject.from_factories("not-installed", no_critic).roles is None


def test_a_pass_reports_the_rope_scalings_it_compared_and_those_refused() -> None:
    """The tiny backend implements default, linear and LongRoPE and refuses YaRN and Llama 3 (naming RoPE):
    the pass says which folders were compared and which were refused, in the table and the JSON."""
    report = check_backend("tiny", checks=["numerics::rope_scaling_matches_reference"])
    [result] = report.results
    expected = ("actor and rollout: compared: linear, linear-legacy, longrope; refused (ConfigError naming RoPE): "
                "yarn, llama3")
    assert (result.status, result.message) == ("passed", expected)
    assert expected in report.table()
    assert json.loads(report.to_json())["results"][0]["message"] == expected


class _CriticHeadUnseeded(_TinyWrapped):
    """A critic whose value head on a causal-LM folder is drawn from an unseeded generator."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        if spec.role == "critic":
            import secrets

            g = torch.Generator().manual_seed(secrets.randbits(32))
            with torch.no_grad():
                w = self.engine.model.score.weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.02)


def test_a_critic_is_held_to_the_policy_s_causal_lm_folder() -> None:
    """PPO builds its critic on the policy's folder when no critic_model is named; the suite built
    critics only on the value-head folder, and the tiny example and the megatron backend could not
    load a causal-LM folder as a critic. A value head that is not a function of the seed fails too."""
    check = ["schema::critic_on_a_causal_lm_folder"]
    report = check_backend("tiny", make_training_engine=build_training_engine, checks=check)
    assert [r.status for r in report.results] == ["passed"]
    with pytest.raises(ConformanceError, match="two engines of seed 0 give other values"):
        check_backend("unseeded-critic", make_training_engine=_CriticHeadUnseeded, checks=check)


def test_a_bfloat16_engine_without_float32_masters_fails_the_small_updates_check() -> None:
    """Every other check passed a bfloat16 engine that steps its bfloat16 parameters directly (no
    float32 masters): its few updates at the suite's lr=1 move the weights anyway. Updates below
    half of bfloat16's spacing show it: the hf engine with its masters passes, without them fails."""
    from verl_conformance.harness import EngineCache

    check = CHECKS["numerics::bfloat16_small_updates_accumulate"]
    results = {}
    for label, options in (("masters", {}), ("pure bfloat16", {"master_weights": False})):
        h = Harness(Subject.from_registry("hf"), None, EngineCache(), dtype="bfloat16", options=options)
        results[label] = run_one(check, h)
    assert results["masters"][0] == "passed", results
    status, message = results["pure bfloat16"]
    assert status == "failed" and "keep float32 master weights" in message, message
    h = Harness(Subject.from_registry("hf"), None, EngineCache(), dtype="float32")
    assert run_one(check, h)[0] == "skipped"


@pytest.mark.slow
def test_a_bfloat16_critic_without_float32_masters_fails_the_small_updates_check() -> None:
    """The small-updates check trained the actor alone: a critic that steps its bfloat16 parameters directly
    (the hf critic with master_weights=False, its actor with masters) passed it, and its value loss passes at
    the suite's lr=1. The check now trains the critic too, under the value loss."""
    checks = ["numerics::value_loss_matches_reference", "numerics::bfloat16_small_updates_accumulate"]
    with pytest.raises(ConformanceError) as info:
        check_backend("critic-without-masters", make_training_engine=faulty.CriticWithoutMasterWeights,
                      roles=["actor", "reference", "critic"], checks=checks, dtype="bfloat16")
    report = info.value.report
    assert report is not None
    assert [r.id for r in report.failures] == ["numerics::bfloat16_small_updates_accumulate"], report.table()
    message = str(info.value)
    assert "the critic: after 32 AdamW steps at lr=1e-05 in bfloat16 under the value loss" in message, message
    assert "keep float32 master weights" in message, message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("role", "training", "rollout", "reference_check"), [
    ("actor", faulty.Float32UnderBfloat16Training, None, "numerics::log_probs_match_reference"),
    ("rollout", None, faulty.Float32UnderBfloat16Rollout, "numerics::rollout_log_probs_match_reference"),
])
def test_a_bfloat16_engine_that_computes_in_float32_fails_the_declared_dtypes_check(
        dtype: str, role: str, training: Factory | None, rollout: Factory | None, reference_check: str) -> None:
    """An engine that declares bfloat16 but computes in float32 (its model or weight stream upcast) is within the
    bfloat16 tier everywhere: a whole --dtype bfloat16 run passed it, and so did the declared-dtypes check of a
    float32 run. Its bfloat16 outputs are now compared with its float32 ones: bit-equal fails, in either run; the
    hf engines it is built on pass."""
    target = "numerics::declared_dtypes_and_devices"
    with pytest.raises(ConformanceError) as info:
        check_backend(f"{role}-float32-under-bfloat16", make_training_engine=training, make_rollout_engine=rollout,
                      checks=[reference_check, target], dtype=dtype)
    report = info.value.report
    assert report is not None
    assert [r.id for r in report.failures] == [target], report.table()
    message = str(info.value)
    what = ("forward log_probs of 6 samples" if role == "actor"
            else "tokens and rollout_log_probs of 6 seeded samples (T=1, seed 9)")
    assert (f"the {role} engine built with dtype='bfloat16' on device cpu gives {what} bit-equal to the same role "
            "built in float32") in message, message
    assert "it computes in float32" in message, message
    report = run_conformance("hf", checks=[target], dtype=dtype)
    assert [r.status for r in report.results] == ["passed"], report.table()
