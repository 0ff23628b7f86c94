"""Meta-tests: deliberately broken backends, registered for each test (``broken_backends``), fail the suite.

Each broken backend (tests/plugins/verl-broken-backends) is the example backend (or, for reward
engines and GPT-2 folders, the hf backend) with one fault; each test runs only the checks that
fault targets (plus checks it passes, where that shows a gap the new check closes) and asserts the
failure message points at it. The unbroken backends passing those same checks is proven by
test_suite_example.py and test_suite_hf.py.
"""

from __future__ import annotations

import pytest

from verl_conformance import ConformanceError, check_backend

pytestmark = pytest.mark.usefixtures("broken_backends")

FAULTS = [
    # (backend, checks to run, checks that must fail, fragments the message must contain)
    ("broken-shifted-log-probs", ["numerics::log_probs_match_reference"],
     ["numerics::log_probs_match_reference"], ["log_probs of llama at temperature 1.0", "float64 reference"]),
    ("broken-temperature", ["numerics::log_probs_match_reference", "numerics::entropy_matches_reference"],
     ["numerics::log_probs_match_reference", "numerics::entropy_matches_reference"], ["temperature 0.7"]),
    ("broken-reference-temperature", ["numerics::log_probs_match_reference",
                                      "numerics::reference_role_log_probs_match_reference"],
     ["numerics::reference_role_log_probs_match_reference"], ["the reference role's log_probs", "temperature 0.7"]),
    # a reference engine of its own that leaves out what a random folder holds at its default (Qwen2's q/k/v biases)
    ("broken-reference-qwen2-biases", ["numerics::log_probs_match_reference",
                                       "numerics::reference_role_log_probs_match_reference"],
     ["numerics::reference_role_log_probs_match_reference"],
     ["the reference role's log_probs of qwen2-perturbed (qwen2 with every tensor moved: its q/k/v biases no longer "
      "zeros", "vs the float64 reference"]),
    # and one that loads every tensor but sets the norm weights a random folder holds at one back to ones: all of
    # them (the Llama folder passes, qwen2-perturbed fails), or Qwen3's q/k norms only (qwen2-perturbed passes too)
    ("broken-reference-norms", ["numerics::log_probs_match_reference",
                                "numerics::reference_role_log_probs_match_reference"],
     ["numerics::reference_role_log_probs_match_reference"],
     ["the reference role's log_probs of qwen2-perturbed (qwen2 with every tensor moved:", "its RMSNorm weights no "
      "longer ones) at temperature 1.0 vs the float64 reference"]),
    ("broken-reference-qk-norms", ["numerics::log_probs_match_reference",
                                   "numerics::reference_role_log_probs_match_reference"],
     ["numerics::reference_role_log_probs_match_reference"],
     ["the reference role's log_probs of qwen3-tied-perturbed (qwen3 with every tensor moved: its RMSNorm weights, "
      "the q/k norms' too, no longer ones) at temperature 1.0 vs the float64 reference"]),
    ("broken-padding-idx", ["numerics::loss_and_grads_match_reference", "numerics::pad_token_as_real_token_update"],
     ["numerics::pad_token_as_real_token_update"], ["gradient of model.embed_tokens.weight", "float64 reference"]),
    ("broken-response-mask", ["schema::forward_layout"], ["schema::forward_layout"],
     ["not 0 where response_mask is False"]),
    ("broken-padding-side", ["schema::generate_layout"], ["schema::generate_layout"],
     ["response_mask", "not right-padded"]),
    ("broken-micro-batch-loss", ["invariance::micro_batch_invariance", "numerics::loss_and_grads_match_reference"],
     ["invariance::micro_batch_invariance", "numerics::loss_and_grads_match_reference"],
     ["micro_batch_size", "loss"]),
    ("broken-weight-sync", ["weight_sync::rollout_applies_stream", "weight_sync::trainer_to_rollout_sync"],
     ["weight_sync::rollout_applies_stream", "weight_sync::trainer_to_rollout_sync"],
     ["a sync that does not apply the weights"]),
    ("broken-optimizer-state", ["numerics::loss_and_grads_match_reference", "differential::trajectory_matches_reference"],
     ["differential::trajectory_matches_reference"], ["3-step GRPO trajectory", "grad norm at step"]),
    ("broken-unseeded", ["invariance::seeded_sampling_reproducible"], ["invariance::seeded_sampling_reproducible"],
     ["not reproducible under a fixed seed"]),
    ("broken-checkpoint-optimizer", ["stateful::checkpoint_round_trip"], ["stateful::checkpoint_round_trip"],
     ["after save_checkpoint and load_checkpoint into a fresh engine", "its step or the schedule were not restored"]),
    ("broken-offload-tensor", ["stateful::offload_round_trip", "stateful::offload_frees_memory"],
     ["stateful::offload_round_trip"], ["after offload() and onload()", "optimizer state was lost"]),
    # the critic beside a right actor: its checkpoint, offload, temperature, token budget, clipping and folder
    ("broken-critic-checkpoint-head", ["stateful::checkpoint_round_trip"], ["stateful::checkpoint_round_trip"],
     ["the critic: after save_checkpoint and load_checkpoint into a fresh engine: weights", "score.weight"]),
    ("broken-critic-checkpoint-optimizer", ["stateful::checkpoint_round_trip", "stateful::load_drops_pending_gradients"],
     ["stateful::checkpoint_round_trip", "stateful::load_drops_pending_gradients"],
     ["the critic: after save_checkpoint and load_checkpoint into a fresh engine: the first update after it",
      "its step or the schedule were not restored"]),
    ("broken-critic-offload-tensor", ["stateful::offload_round_trip"], ["stateful::offload_round_trip"],
     ["the critic: after offload() and onload()", "optimizer state was lost"]),
    ("broken-critic-temperature", ["numerics::values_match_reference"], ["numerics::values_match_reference"],
     ["critic values vs float64 reference", "at temperature 0.7", "do not depend on the sampling temperature"]),
    ("broken-critic-token-budget", ["invariance::micro_batch_invariance"], ["invariance::micro_batch_invariance"],
     ["the critic: forward_backward with {'micro_batch_tokens': 24} ran 1 micro-batches"]),
    ("broken-critic-grad-clip", ["numerics::optimizer_matches_reference"], ["numerics::optimizer_matches_reference"],
     ["the critic: update 1 under AdamW", "grad_clip"]),
    ("broken-critic-nonfinite", ["robustness::nonfinite_update_skipped"], ["robustness::nonfinite_update_skipped"],
     ["the critic: optimizer_step after a NaN loss returned skipped=False"]),
    # the value-head folder's score.bias is 0: the critic's numerics pass on it, and fail on value-biased
    ("broken-critic-head-bias", ["numerics::values_match_reference", "numerics::value_loss_matches_reference"],
     ["numerics::values_match_reference"], ["critic values vs float64 reference of value-biased", "temperature 1.0"]),
    # a direct engine whose forward folds with reshape(batch, seq, -1): the batch of one passes, 0 rows raise bare
    ("broken-zero-rows", ["robustness::batch_of_one", "robustness::batch_of_zero"], ["robustness::batch_of_zero"],
     ["the actor engine's forward of a batch of 0 rows (response width 8)", "raised RuntimeError",
      "expected each output shaped [0, 8]"]),
    ("broken-wake-reload", ["stateful::sleep_wake_round_trip"], ["stateful::sleep_wake_round_trip"],
     ["after sleep() and wake()", "gave other tokens than before"]),
    # a sleep free to drop the weights (sleep_until_sync): refuse until the sync, and lose nothing it does not restore
    ("broken-sleep-drop-unmarked", ["stateful::sleep_until_sync_then_sync"], ["stateful::sleep_until_sync_then_sync"],
     ["after sleep_until_sync() and wake() with no StaleWeightsError", "gave other tokens than before"]),
    ("broken-sleep-drop-rotary", ["stateful::sleep_until_sync_then_sync"], ["stateful::sleep_until_sync_then_sync"],
     ["after sleep_until_sync() and wake() and a complete sync to llama", "float64 reference"]),
    ("broken-actor-values", ["schema::declared_outputs_served", "schema::forward_layout"],
     ["schema::declared_outputs_served"], ["the actor (capabilities.values=True) forward(values) raised",
                                           "values is declared by the critic alone"]),
    ("broken-bfloat16", ["numerics::declared_dtypes_and_devices"], ["numerics::declared_dtypes_and_devices"],
     ["declares dtype bfloat16 on device cpu but building it raised"]),
    # a bfloat16 RMSNorm without the float32 upcast stays within the tier on the tiny Llama (declared_dtypes passes)
    ("broken-bfloat16-norm", ["numerics::declared_dtypes_and_devices", "numerics::bfloat16_rms_norm_in_float32"],
     ["numerics::bfloat16_rms_norm_in_float32"], ["forward log_probs in bfloat16 on llama-bf16-norm",
                                                   "as transformers' LlamaRMSNorm does"]),
    ("broken-checkpointing-grads", ["invariance::gradient_checkpointing_invariance"],
     ["invariance::gradient_checkpointing_invariance"], ["with gradient_checkpointing=True vs without"]),
    ("broken-top-k", ["invariance::truncated_sampling_keeps_top_token"],
     ["invariance::truncated_sampling_keeps_top_token"], ["top_k=1: sample"]),
    ("broken-rollout-tp", ["invariance::rollout_tensor_parallel_invariance"],
     ["invariance::rollout_tensor_parallel_invariance"], ["rank 1: seeded generation with tp=2 vs one process"]),
    # the megatron backend with Qwen3's replicated q/k-norm gradients left as each tp rank's partial sum: the Llama
    # folder has no q/k norms, so only the perturbed Qwen3 folder of the tp check shows it
    ("broken-tp-qk-norm-grads", ["invariance::tensor_parallel_invariance"], ["invariance::tensor_parallel_invariance"],
     ["grad norm with tp=2 on qwen3-tied-perturbed", "vs one process"]),
    # EOS and truncation, on the test kit's EOS model
    ("broken-eos-mask", ["schema::generate_layout", "robustness::generate_edge_cases", "schema::eos_ends_response"],
     ["schema::eos_ends_response"], ["the EOS that ends the response is left out", "[11, 12, 1]"]),
    ("broken-truncated", ["schema::eos_ends_response", "schema::truncated_flag"], ["schema::truncated_flag"],
     ["truncated=True, expected False", "its last allowed token is EOS"]),
    # a folder's further EOS ids and generation_config.json's sampling defaults: not stops, not sampling settings
    ("broken-folder-eos-list-stops", ["schema::eos_ends_response", "schema::truncated_flag",
                                      "schema::stop_tokens_end_response",
                                      "robustness::folder_eos_list_and_generation_defaults_ignored"],
     ["robustness::folder_eos_list_and_generation_defaults_ignored"],
     ["on eos-folder-defaults (config.json eos_token_id [1, 31]", "the response ended at token 31, an EOS id the "
      "folder lists but not the tokenizer's EOS (1)"]),
    ("broken-generation-config-defaults", ["numerics::rollout_log_probs_match_reference",
                                           "invariance::seeded_sampling_reproducible",
                                           "invariance::truncated_sampling_keeps_top_token",
                                           "robustness::folder_eos_list_and_generation_defaults_ignored"],
     ["robustness::folder_eos_list_and_generation_defaults_ignored"],
     ["generate (sampling at T=1, n=2, seed 5, max_new_tokens 8) on llama-folder-defaults (generation_config.json "
      "sets do_sample True, temperature 0.05, top_k 1", "other response_ids"]),
    # position ids, on a GPT-2 with absolute position embeddings
    ("broken-positions", ["invariance::padding_invariance", "invariance::positions_under_left_padding"],
     ["invariance::positions_under_left_padding"], ["absolute-position model", "not arange over the padded row"]),
    # a GPT-2 folder trained and synced: faults in what only its layout has
    ("broken-gpt2-position-grad", ["numerics::loss_and_grads_match_reference", "numerics::absolute_position_model_update"],
     ["numerics::absolute_position_model_update"], ["gradient of transformer.wpe.weight", "on gpt2"]),
    ("broken-gpt2-sync", ["weight_sync::rollout_applies_stream", "weight_sync::absolute_position_model_sync"],
     ["weight_sync::absolute_position_model_sync"], ["GPT-2 folder with every tensor changed"]),
    ("broken-gpt2-position-limit", ["robustness::position_table_limit_refused"],
     ["robustness::position_table_limit_refused"], ["the actor engine built on the GPT-2 folder (n_positions=512)"]),
    # the same fault in a rotary-only backend (it refuses GPT-2), on a Llama with LongRoPE
    ("broken-rotary-positions", ["invariance::positions_under_left_padding",
                                 "invariance::rotary_positions_under_left_padding"],
     ["invariance::rotary_positions_under_left_padding"], ["rotary LongRoPE model", "not arange over the padded row"]),
    # a prefix cache (hf rollout, KV per row), right under plain RoPE, reused across the LongRoPE threshold
    ("broken-long-rope-prefix-cache", ["invariance::prefix_continuation_matches_rerun",
                                       "invariance::rotary_positions_under_left_padding",
                                       "invariance::long_rope_continuation_across_threshold"],
     ["invariance::long_rope_continuation_across_threshold"],
     ["continuing an earlier call's prompt and turn", "keys cached while the sequence was short"]),
    # a folder whose special token ids lie outside the vocabulary, built without checking config.json
    ("broken-special-ids", ["robustness::special_token_ids_outside_vocab_refused"],
     ["robustness::special_token_ids_outside_vocab_refused"],
     ["the actor engine on the folder llama-oov-pad_token_id (config.json pad_token_id = 128, vocab_size 128) "
      "raised AssertionError", "the rollout engine on the folder llama-oov-eos_token_id", "built"]),
    # config.json's ids checked, the tokenizer's EOS and generation_config.json's EOS not
    ("broken-tokenizer-eos", ["robustness::special_token_ids_outside_vocab_refused"],
     ["robustness::special_token_ids_outside_vocab_refused"],
     ["the rollout engine on the folder llama-oov-tokenizer-eos (tokenizer_config.json eos_token = '<|end|>', "
      "vocab_size 128) built (no ConfigError)", "the actor engine on the folder llama-oov-generation-eos "
      "(generation_config.json eos_token_id = [1, 131], vocab_size 128) built"]),
    # every tensor of a weight stream applied
    ("broken-last-chunk", ["weight_sync::rollout_applies_stream", "weight_sync::trainer_to_rollout_sync",
                           "weight_sync::every_tensor_applied"],
     ["weight_sync::every_tensor_applied"], ["model.norm.weight", "in the last chunk", "it was not applied"]),
    # reward engines
    ("broken-reward-nan", ["reward::score_layout"], ["reward::score_layout"], ["head outputs NaN", "must raise"]),
    ("broken-reward-order", ["reward::scores_follow_input_order", "reward::scores_independent_of_batch"],
     ["reward::scores_follow_input_order", "reward::scores_independent_of_batch"],
     ["score i must belong to sample i"]),
    ("broken-reward-centered", ["reward::scores_follow_input_order", "reward::scores_independent_of_batch"],
     ["reward::scores_independent_of_batch"], ["each sample scored alone"]),
    ("broken-reward-last-column", ["reward::scores_follow_input_order", "reward::scores_independent_of_batch"],
     ["reward::scores_independent_of_batch"], ["each sample scored alone"]),
    ("broken-reward-one-token-early", ["reward::scores_independent_of_batch", "reward::scores_match_reference"],
     ["reward::scores_match_reference"], ["vs the float64 reference of the reward folder", "last real token"]),
    ("broken-reward-noisy", ["reward::scores_deterministic"], ["reward::scores_deterministic"],
     ["two score() calls on one batch differ"]),
    ("broken-reward-tokenizer", ["reward::scores_independent_of_batch", "reward::cross_tokenizer_scores"],
     ["reward::cross_tokenizer_scores"], ["another tokenizer's ids", "no extra BOS"]),
    # declared reward capabilities: scores, token_scores, needs_text, devices
    ("broken-reward-no-scores", ["reward::score_layout", "reward::scores_deterministic"],
     ["reward::score_layout", "reward::scores_deterministic"], ["returned no 'scores'", "declares scores=True"]),
    ("broken-reward-token-scores", ["reward::score_layout", "reward::scores_follow_input_order",
                                    "reward::scores_independent_of_batch", "reward::scores_deterministic"],
     ["reward::score_layout", "reward::scores_follow_input_order", "reward::scores_independent_of_batch"],
     ["token_scores is not 0 where response_mask is False"]),
    ("broken-reward-special-tokens", ["reward::score_layout", "reward::scores_independent_of_batch",
                                      "reward::text_scores_ignore_special_tokens"],
     ["reward::text_scores_ignore_special_tokens"], ["BOS (id 2) before each prompt", "skip_special_tokens=True"]),
    ("broken-reward-devices", ["reward::score_layout", "reward::declared_devices"], ["reward::declared_devices"],
     ["declares devices ['cpu', 'gpu']", "name no torch device type"]),
    # a reward model on the Qwen families (every tensor perturbed), and what it must refuse
    ("broken-reward-qwen2-biases", ["reward::scores_match_reference"], ["reward::scores_match_reference"],
     ["scores on reward-qwen2 (qwen2: biases on q, k and v)", "vs the float64 reference"]),
    ("broken-reward-qwen3-qk-norms", ["reward::scores_match_reference"], ["reward::scores_match_reference"],
     ["scores on reward-qwen3 (qwen3: an RMSNorm on each head of q and k before RoPE)", "vs the float64 reference"]),
    # a forward that leaves out what a random folder holds at its initial value (q/k/v biases zeros, norm weights
    # ones), on the folder of each family with every tensor moved; the training one passes the gradient checks
    ("broken-rollout-qwen2-biases", ["numerics::rollout_log_probs_match_reference",
                                     "differential::greedy_matches_reference"],
     ["numerics::rollout_log_probs_match_reference", "differential::greedy_matches_reference"],
     ["rollout_log_probs on qwen2-perturbed (qwen2 with every tensor moved: its q/k/v biases no longer zeros",
      "greedy tokens on qwen2-perturbed"]),
    ("broken-rollout-norm-weights", ["numerics::rollout_log_probs_match_reference",
                                     "differential::greedy_matches_reference"],
     ["numerics::rollout_log_probs_match_reference", "differential::greedy_matches_reference"],
     ["rollout_log_probs on qwen2-perturbed", "its RMSNorm weights no longer ones", "greedy tokens on qwen2-perturbed"]),
    # the same in a rollout that refuses both Qwen families: the perturbed Llama is compared instead
    ("broken-rollout-llama-norm-weights", ["numerics::rollout_log_probs_match_reference",
                                           "differential::greedy_matches_reference"],
     ["numerics::rollout_log_probs_match_reference", "differential::greedy_matches_reference"],
     ["rollout_log_probs on llama-perturbed-a (llama with every tensor moved: its RMSNorm weights no longer ones)",
      "greedy tokens on llama-perturbed-a"]),
    ("broken-rollout-qwen3-qk-norms", ["numerics::rollout_log_probs_match_reference",
                                       "differential::greedy_matches_reference"],
     ["numerics::rollout_log_probs_match_reference", "differential::greedy_matches_reference"],
     ["rollout_log_probs on qwen3-tied-perturbed (qwen3 with every tensor moved: its RMSNorm weights, the q/k "
      "norms' too, no longer ones)", "greedy tokens on qwen3-tied-perturbed"]),
    ("broken-qwen2-biases", ["numerics::log_probs_match_reference", "numerics::loss_and_grads_match_reference"],
     ["numerics::log_probs_match_reference", "numerics::loss_and_grads_match_reference"],  # its tied Qwen2 folder
     ["log_probs of qwen2-perturbed (qwen2 with every tensor moved: its q/k/v biases no longer zeros"]),
    ("broken-reward-dtype-ignored", ["reward::unsupported_settings_refused"], ["reward::unsupported_settings_refused"],
     ["built with dtype='bfloat16' scores 6 samples exactly as in float32", "it ignored the dtype"]),
    ("broken-reward-parallel-ignored", ["reward::unsupported_settings_refused"],
     ["reward::unsupported_settings_refused"], ["built with parallel=ParallelSizes(tp=2, pp=1, dp=1)"]),
    ("broken-reward-random-head", ["reward::unsupported_settings_refused"], ["reward::unsupported_settings_refused"],
     ["the reward engine built on the causal-LM Llama folder", "a head initialised at random scores noise"]),
    # the optimizer as OptimConfig says: clipping of the accumulated gradient, weight decay on every parameter
    ("broken-micro-batch-grad-clip", ["numerics::optimizer_matches_reference"],
     ["numerics::optimizer_matches_reference"], ["update 0 under AdamW", "grad norm vs float64 reference"]),
    ("broken-norms-not-decayed", ["numerics::optimizer_matches_reference"], ["numerics::optimizer_matches_reference"],
     ["weight_decay 0.1", "vs float64 reference"]),
    ("broken-warmup-from-zero", ["numerics::optimizer_matches_reference"], ["numerics::optimizer_matches_reference"],
     ["optimizer_step ran at lr 0, OptimConfig.lr_at(0) is 0.25"]),
    # the schedule past the four steps optimizer_matches_reference runs (a cosine over exactly them): both pass it
    ("broken-cosine-past-total", ["numerics::optimizer_matches_reference",
                                  "numerics::lr_schedule_past_warmup_and_decay"],
     ["numerics::lr_schedule_past_warmup_and_decay"],
     ["update 3 (schedule='cosine'", "optimizer_step ran at lr 0.5, OptimConfig.lr_at(3) is 0.05",
      "a cosine stays at its floor past total_steps"]),
    ("broken-constant-schedule-decays", ["numerics::optimizer_matches_reference",
                                         "numerics::lr_schedule_past_warmup_and_decay"],
     ["numerics::lr_schedule_past_warmup_and_decay"],
     ["update 2 (schedule='constant'", "optimizer_step ran at lr 0.05, OptimConfig.lr_at(2) is 0.5"]),
    # the lr reported right, the peak applied: the weights show it
    ("broken-schedule-ignored", ["numerics::lr_schedule_past_warmup_and_decay"],
     ["numerics::lr_schedule_past_warmup_and_decay"],
     ["moved by 4 updates (schedule='cosine'", "the lr applied, not only the one reported"]),
    # entropy at the batch's temperature; rollout_log_probs before truncation where declared exact
    ("broken-entropy-temperature", ["numerics::log_probs_match_reference", "numerics::entropy_matches_reference"],
     ["numerics::entropy_matches_reference"], ["entropy at temperature 0.7 vs float64 reference"]),
    ("broken-truncated-log-probs", ["numerics::rollout_log_probs_match_reference"],
     ["numerics::rollout_log_probs_match_reference"],
     ["rollout_log_probs at temperature 0.8, top_k 20, top_p 0.9 vs float64 reference of log softmax(logits/T)"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "checks", "must_fail", "fragments"), FAULTS, ids=[f[0] for f in FAULTS])
def test_broken_backend_fails_targeted_checks(
    backend: str, checks: list[str], must_fail: list[str], fragments: list[str]
) -> None:
    with pytest.raises(ConformanceError) as info:
        check_backend(backend, checks=checks)
    report = info.value.report
    assert report is not None
    failed = sorted(r.id for r in report.failures)
    assert failed == sorted(must_fail), f"{backend}: failed {failed}, expected {must_fail}"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{backend}: the error does not point at the fault ({fragment!r}):\n{message}"
    assert "reproduce:" in message and f"--verl-backend {backend}" in message


def test_unknown_backend_is_a_clear_error() -> None:
    from verl_core import UnknownNameError

    with pytest.raises(UnknownNameError, match="installed:.*example"):
        check_backend("no-such-backend", checks=["schema::forward_layout"])


@pytest.mark.slow
def test_check_backends_match_points_at_the_differing_backend() -> None:
    from verl_conformance import check_backends_match

    with pytest.raises(ConformanceError) as info:
        check_backends_match("broken-temperature", "example", checks=["differential::against_log_probs"])
    assert "log_probs of llama: broken-temperature vs example" in str(info.value)
    report = check_backends_match("broken-unseeded", "example", checks=["differential::against_log_probs"])
    assert [r.status for r in report.results] == ["passed"]


@pytest.mark.slow
def test_check_backend_with_own_factories() -> None:
    """Engines that are not installed as a plugin are checked through factories."""
    from verl_broken_backends.engines import IgnoredWeightSync
    from verl_example_backend.training import ExampleTrainingEngine

    report = check_backend("mine", make_training_engine=ExampleTrainingEngine,
                           checks=["schema::forward_layout", "schema::generate_layout"])
    assert [(r.id, r.status) for r in report.results] == [
        ("schema::forward_layout", "passed"), ("schema::generate_layout", "skipped")]
    assert "provides no rollout engine" in report.results[1].message
    with pytest.raises(ConformanceError, match="a sync that does not apply the weights") as info:
        check_backend("mine", make_rollout_engine=IgnoredWeightSync, checks=["weight_sync::rollout_applies_stream"])
    # the snippet re-runs the factories that were checked, not a backend called "mine"
    message = str(info.value)
    assert "--verl-backend mine" not in message and "check_backend('mine')" not in message, message
    assert ("from verl_broken_backends.engines import IgnoredWeightSync; check_backend('mine', "
            "make_rollout_engine=IgnoredWeightSync, checks=['weight_sync::rollout_applies_stream'])") in message


@pytest.mark.slow
def test_reward_checks_pass_on_reward_functions() -> None:
    """Reward functions (FunctionReward, RewardFunctions) are checked through a reward-engine factory."""
    from verl_conformance.testkit import load_tokenizer
    from verl_core import EngineSpec, FunctionReward
    from verl_core.trainer.inputs.reward_functions import regex_reward
    from verl_core.trainer.inputs.rewards import RewardFunctions

    def text_score(completions: list[str], prompts: list[str]) -> list[float]:
        return [len(c) / 4 + sum(map(ord, c + p)) % 7 for c, p in zip(completions, prompts, strict=True)]

    def function_reward(spec: EngineSpec) -> FunctionReward:
        return FunctionReward(lambda p, r, _: text_score([r], [p])[0], load_tokenizer(spec.model_path))

    def reward_functions(spec: EngineSpec) -> RewardFunctions:
        return RewardFunctions([text_score, regex_reward(r".*\d.*", name="digit")], load_tokenizer(spec.model_path),
                               weights=[1.0, 0.5])

    for make in (function_reward, reward_functions):
        report = check_backend("reward-functions", make_reward_engine=make, areas=["reward"])
        status = {r.id: (r.status, r.message) for r in report.results}
        assert status.pop("reward::cross_tokenizer_scores")[0] == "skipped"  # they expose no `tokenizer`
        assert status.pop("reward::declared_devices")[0] == "skipped"  # they declare only the CPU
        assert status.pop("reward::scores_match_reference")[0] == "skipped"  # not a classification head
        assert status.pop("reward::unsupported_settings_refused")[0] == "skipped"  # no folder or head to refuse
        assert {s for s, _ in status.values()} == {"passed"}, status


@pytest.mark.slow
def test_reward_checks_pass_on_a_token_scoring_engine() -> None:
    """A correct engine declaring token_scores (the score at the last real response token) passes the reward area."""
    from verl_broken_backends.engines import LastTokenScores

    report = check_backend("last-token-scores", make_reward_engine=LastTokenScores, areas=["reward"])
    status = {r.id: r.status for r in report.results}
    assert status.pop("reward::text_scores_ignore_special_tokens") == "skipped"  # it scores ids
    assert status.pop("reward::declared_devices") == "skipped"  # no GPU here
    assert set(status.values()) == {"passed"}, status


@pytest.mark.slow
def test_grpo_run_finds_the_step_where_a_backend_parts() -> None:
    """A loss scaled by 1.01 from the third step on fails the 5-step run at step 3, not before."""
    with pytest.raises(ConformanceError) as info:
        check_backend("broken-loss-scale", against="example", checks=["differential::against_grpo_run"])
    message = str(info.value)
    assert "step 3 of 5" in message and ": loss:" in message, message
    assert "--verl-against example" in message


BUFFER_FAULTS = [
    # (faulty buffer of verl_broken_backends.buffers, the check it fails, fragments of the message)
    ("DropOldestBuffer", "buffer::buffer_capacity", ["adding 4 samples to a buffer holding 5 of capacity=5"]),
    ("ReorderingBuffer", "buffer::buffer_order", ["drain(): sample ids [5, 6, 7, 8, 3, 4, 0, 1, 2]"]),
    ("LossySpillBuffer", "buffer::buffer_spill", ["across memory and disk", "is not bit-identical"]),
    ("SeedIgnoredBuffer", "buffer::buffer_seeded_sampling", ["sample(6, seed=11) twice"]),
    ("EpochOrderRepeatedBuffer", "buffer::buffer_seeded_sampling", ["the same order in both epochs",
                                                                      "each epoch must be reshuffled"]),
]


@pytest.mark.parametrize(("name", "target", "fragments"), BUFFER_FAULTS, ids=[f[0] for f in BUFFER_FAULTS])
def test_broken_buffer_fails_its_check(name: str, target: str, fragments: list[str]) -> None:
    from verl_broken_backends import buffers

    from verl_conformance import check_buffer

    with pytest.raises(ConformanceError) as info:
        check_buffer(getattr(buffers, name), checks=[target])
    report = info.value.report
    assert report is not None and [r.id for r in report.failures] == [target]
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{name}: the error does not point at the fault ({fragment!r}):\n{message}"
    assert f"--verl-buffer verl_broken_backends.buffers:{name}" in message
    assert message.startswith("replay buffer "), message.splitlines()[0]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "status"), [("broken-export-masters", "failed"), ("hf", "passed")])
def test_a_bfloat16_engine_that_exports_its_float32_masters_fails_the_export_check(backend: str, status: str) -> None:
    """The rollout serves what the actor exports: a bfloat16 engine must stream its bfloat16 weights, not the
    optimizer's float32 masters (which differ from them after an update). float32 has no masters, so the
    check runs in bfloat16 only."""
    from verl_conformance.harness import EngineCache, Harness, Subject
    from verl_conformance.runner import run_checks, select_checks

    harness = Harness(Subject.from_registry(backend), None, EngineCache(), dtype="bfloat16")
    try:
        report = run_checks(harness, select_checks(
            ["weight_sync::bfloat16_export_after_update_is_the_rounded_model"], None), None)
    finally:
        harness.cache.close()
    (result,) = report.results
    assert result.status == status, result.message
    if status == "failed":
        assert "not in bfloat16" in result.message and "float32 masters" in result.message, result.message
