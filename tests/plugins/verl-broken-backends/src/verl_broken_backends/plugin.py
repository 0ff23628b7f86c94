"""Entry points of the broken backends: one plugin object per fault, each a full backend (the
example backend, or the hf backend for faults in its reward engine or on GPT-2 folders)."""

from __future__ import annotations

from dataclasses import replace

from verl_example_backend.plugin import ROLLOUT_CAPABILITIES, TRAINING_CAPABILITIES

from verl_broken_backends.capabilities import (
    BFLOAT16_ROLLOUT,
    BFLOAT16_TRAINING,
    CHECKPOINTING_TRAINING,
    OFFLOAD_TRAINING,
    TENSOR_PARALLEL_ROLLOUT,
    VALUES_TRAINING,
)
from verl_core import (
    PROTOCOL_VERSION,
    BackendSpec,
    Role,
    RolloutCapabilities,
    TrainingCapabilities,
    hookimpl,
)

__all__ = [
    "arange_positions",
    "bfloat16",
    "bfloat16_norm",
    "checkpoint_optimizer",
    "close_not_idempotent",
    "close_thread_left",
    "close_worker_left",
    "checkpointing_grads",
    "constant_schedule_decays",
    "cosine_past_total",
    "critic_checkpoint_head",
    "critic_checkpoint_optimizer",
    "critic_grad_clip",
    "critic_grads_not_reduced",
    "critic_head_bias",
    "critic_nonfinite",
    "critic_offload_tensor",
    "critic_temperature",
    "critic_token_budget",
    "drop_rotary",
    "drop_unmarked",
    "entropy_temperature",
    "eos_out_of_mask",
    "exports_masters",
    "folder_eos_list_stops",
    "generation_config_defaults",
    "last_chunk_dropped",
    "long_rope_prefix_cache",
    "loss_scale",
    "micro_batch_grad_clip",
    "micro_batch_loss",
    "norms_not_decayed",
    "offload_tensor",
    "only_rank_zero_loads",
    "optimizer_state",
    "other_layout_drops_optimizer",
    "padding_idx",
    "padding_side",
    "qkv_biases",
    "reference_norm_weights",
    "reference_qk_norm_weights",
    "reference_qkv_biases",
    "reference_temperature",
    "response_mask",
    "reward_batch_centered",
    "reward_bos_tokenizer",
    "reward_dtype_ignored",
    "reward_last_column",
    "reward_nan_zeroed",
    "reward_noisy",
    "reward_one_token_early",
    "reward_order",
    "reward_parallel_ignored",
    "reward_qk_norms",
    "reward_qkv_biases",
    "reward_random_head",
    "reward_scores_missing",
    "reward_special_tokens_text",
    "reward_token_scores_last_column",
    "reward_unknown_device",
    "rollout_llama_norm_weights",
    "rollout_norm_weights",
    "rollout_qk_norms",
    "rollout_qkv_biases",
    "rollout_tp",
    "rotary_arange_positions",
    "schedule_ignored",
    "shifted_log_probs",
    "special_ids_unchecked",
    "temperature",
    "tokenizer_ids_unchecked",
    "top_k",
    "tp_qk_norm_grads",
    "truncated_at_limit",
    "truncated_log_probs",
    "unseeded",
    "wake_reload",
    "warmup_from_zero",
    "weight_sync",
    "zero_rows",
]

_ENGINES = "verl_broken_backends.engines"


class BrokenBackend:
    """A plugin declaring the example backend with one engine class replaced by a faulty one."""

    def __init__(self, name: str, fault: str, training: str = "", rollout: str = "",
                 training_caps: TrainingCapabilities = TRAINING_CAPABILITIES,
                 rollout_caps: RolloutCapabilities = ROLLOUT_CAPABILITIES, reference: str = "") -> None:
        self.name = name
        self.fault = fault
        self.training = training or "verl_example_backend.training:build_training_engine"
        self.rollout = rollout or "verl_example_backend.rollout:build_rollout_engine"
        self.reference = reference  # a reference role of its own (none unless given)
        self.training_caps = training_caps
        self.rollout_caps = rollout_caps

    @hookimpl
    def verl_backend(self) -> BackendSpec:
        """The backend with its fault."""
        extra: dict[Role, str] = {"reference": self.reference} if self.reference else {}
        return BackendSpec(
            name=self.name,
            roles={"actor": self.training, "critic": self.training, "rollout": self.rollout, **extra},
            capabilities={"actor": self.training_caps,
                          "critic": replace(self.training_caps, log_probs=False, entropy=False, values=True),
                          "rollout": self.rollout_caps,
                          **({"reference": self.training_caps} if self.reference else {})},
            protocol_version=PROTOCOL_VERSION,
            config_class="verl_example_backend.plugin:ExampleOptions",
            description=f"BROKEN on purpose: {self.fault}",
        )


shifted_log_probs = BrokenBackend("broken-shifted-log-probs", "log-probs read one position late",
                                  training=f"{_ENGINES}:ShiftedLogProbs")
padding_side = BrokenBackend("broken-padding-side", "responses come back left-padded",
                             rollout=f"{_ENGINES}:LeftPaddedResponses")
weight_sync = BrokenBackend("broken-weight-sync", "update_weights validates the stream and applies nothing",
                            rollout=f"{_ENGINES}:IgnoredWeightSync")
micro_batch_loss = BrokenBackend("broken-micro-batch-loss", "the loss is averaged over micro-batches",
                                 training=f"{_ENGINES}:MicroBatchAveragedLoss")
optimizer_state = BrokenBackend("broken-optimizer-state", "AdamW's moments are dropped before every step",
                                training=f"{_ENGINES}:OptimizerStateDropped")
temperature = BrokenBackend("broken-temperature", "log-probs ignore the temperature",
                            training=f"{_ENGINES}:TemperatureIgnored")
response_mask = BrokenBackend("broken-response-mask", "outputs are not masked by response_mask",
                              training=f"{_ENGINES}:ResponseMaskIgnored")
unseeded = BrokenBackend("broken-unseeded", "sampling ignores the seed",
                         rollout=f"{_ENGINES}:UnseededSampling")
checkpoint_optimizer = BrokenBackend("broken-checkpoint-optimizer", "save_checkpoint leaves AdamW's moments out",
                                     training=f"{_ENGINES}:CheckpointWithoutOptimizerState")
offload_tensor = BrokenBackend("broken-offload-tensor", "onload() brings one parameter's second moments back as zeros",
                               training=f"{_ENGINES}:OffloadLosesTensor", training_caps=OFFLOAD_TRAINING)
wake_reload = BrokenBackend("broken-wake-reload", "wake() reloads the folder's weights, losing the synced ones",
                            rollout=f"{_ENGINES}:WakeReloadsFolder")
padding_idx = BrokenBackend("broken-padding-idx", "the embedding has no padding_idx (the pad row trains)",
                            training=f"{_ENGINES}:PaddingIdxDropped")
reference_temperature = BrokenBackend("broken-reference-temperature",
                                      "the reference role computes log-probs at temperature 1 (the actor is right)",
                                      reference=f"{_ENGINES}:TemperatureIgnored")
drop_unmarked = BrokenBackend("broken-sleep-drop-unmarked",
                              "sleep_until_sync() zeroes the weights but generate still serves after wake()",
                              rollout=f"{_ENGINES}:DropUnmarked")
drop_rotary = BrokenBackend("broken-sleep-drop-rotary", "sleep_until_sync() zeroes the rotary frequencies too, "
                            "which the weight sync does not restore", rollout=f"{_ENGINES}:DropRotaryFrequencies")
actor_values = BrokenBackend("broken-actor-values", "the actor declares values it cannot serve (no value head)",
                            training=f"{_ENGINES}:ActorDeclaresValues", training_caps=VALUES_TRAINING)
loss_scale = BrokenBackend("broken-loss-scale", "from the third optimizer step the loss is scaled by 1.01",
                           training=f"{_ENGINES}:LossScaledFromStep3")
bfloat16 = BrokenBackend("broken-bfloat16", "declares bfloat16 but refuses to build in it",
                         training=f"{_ENGINES}:Bfloat16Refused", training_caps=BFLOAT16_TRAINING)
bfloat16_norm = BrokenBackend("broken-bfloat16-norm", "in bfloat16 the RMSNorms compute without the float32 upcast",
                              training=f"{_ENGINES}:Bfloat16NormTraining", rollout=f"{_ENGINES}:Bfloat16NormRollout",
                              training_caps=BFLOAT16_TRAINING, rollout_caps=BFLOAT16_ROLLOUT)
checkpointing_grads = BrokenBackend("broken-checkpointing-grads", "gradient checkpointing doubles the gradients",
                                    training=f"{_ENGINES}:CheckpointingDoublesGradients",
                                    training_caps=CHECKPOINTING_TRAINING)
top_k = BrokenBackend("broken-top-k", "sampling ignores top_k", rollout=f"{_ENGINES}:TopKIgnored")
rollout_tp = BrokenBackend("broken-rollout-tp", "each tensor-parallel rank samples with its own seed",
                           rollout=f"{_ENGINES}:RankSeededRollout", rollout_caps=TENSOR_PARALLEL_ROLLOUT)

eos_out_of_mask = BrokenBackend("broken-eos-mask", "the terminating EOS is left out of response_mask",
                                rollout=f"{_ENGINES}:EosOutOfMask")
folder_eos_list_stops = BrokenBackend("broken-folder-eos-list-stops", "the rollout also stops on every EOS id "
                                      "config.json lists, not only on the tokenizer's EOS",
                                      rollout=f"{_ENGINES}:FolderEosListStops")
generation_config_defaults = BrokenBackend("broken-generation-config-defaults", "sampling follows "
                                           "generation_config.json's temperature and top_k over the request's",
                                           rollout=f"{_ENGINES}:GenerationConfigDefaults")
truncated_at_limit = BrokenBackend("broken-truncated", "truncated is set at max_new_tokens even after EOS",
                                   rollout=f"{_ENGINES}:TruncatedAtLimit")
last_chunk_dropped = BrokenBackend("broken-last-chunk", "the last chunk of a multi-chunk weight stream is not applied",
                                   rollout=f"{_ENGINES}:LastChunkDropped")
special_ids_unchecked = BrokenBackend("broken-special-ids", "builds on a folder whose pad, EOS or BOS id lies "
                                      "outside the vocabulary (config.json never checked: nn.Embedding's padding_idx "
                                      "assertion escapes)", training=f"{_ENGINES}:SpecialIdsUncheckedTraining",
                                      rollout=f"{_ENGINES}:SpecialIdsUncheckedRollout")
tokenizer_ids_unchecked = BrokenBackend("broken-tokenizer-eos", "checks config.json's special ids only: builds on "
                                        "a folder whose tokenizer EOS or generation_config.json EOS lies outside the "
                                        "vocabulary", training=f"{_ENGINES}:TokenizerIdsUncheckedTraining",
                                        rollout=f"{_ENGINES}:TokenizerIdsUncheckedRollout")

# a rollout that computes another model where a random folder's tensors hold their defaults (training is right)
rollout_qkv_biases = BrokenBackend("broken-rollout-qwen2-biases", "the rollout leaves the q, k and v biases out "
                                   "(Qwen2's)", rollout=f"{_ENGINES}:RolloutQKVBiasesIgnored")
rollout_norm_weights = BrokenBackend("broken-rollout-norm-weights", "the rollout computes every RMSNorm as if its "
                                     "weight were ones", rollout=f"{_ENGINES}:RolloutNormWeightsIgnored")
rollout_llama_norm_weights = BrokenBackend("broken-rollout-llama-norm-weights", "a Llama-only rollout (Qwen2 and "
                                           "Qwen3 refused) computes every RMSNorm as if its weight were ones",
                                           rollout=f"{_ENGINES}:LlamaOnlyRolloutNormWeightsIgnored")
rollout_qk_norms = BrokenBackend("broken-rollout-qwen3-qk-norms", "the rollout skips Qwen3's RMSNorm of q and k",
                                 rollout=f"{_ENGINES}:RolloutQKNormsSkipped")
qkv_biases = BrokenBackend("broken-qwen2-biases", "training leaves the q, k and v biases out of the forward (Qwen2's): "
                          "the rollout is right", training=f"{_ENGINES}:TrainingQKVBiasesIgnored")
reference_qkv_biases = BrokenBackend("broken-reference-qwen2-biases", "the reference engine leaves the q, k and v "
                                     "biases out of the forward (Qwen2's): the actor is right",
                                     reference=f"{_ENGINES}:TrainingQKVBiasesIgnored")
reference_norm_weights = BrokenBackend("broken-reference-norms", "the reference engine sets every RMSNorm weight "
                                       "to ones after loading the folder: the actor is right",
                                       reference=f"{_ENGINES}:ReferenceNormWeightsReset")
reference_qk_norm_weights = BrokenBackend("broken-reference-qk-norms", "the reference engine sets Qwen3's q_norm and "
                                          "k_norm weights to ones after loading the folder: the actor is right",
                                          reference=f"{_ENGINES}:ReferenceQKNormWeightsReset")
# the critic's faults (the actor beside it is right): state, temperature, micro-batching, clipping, its folder's head
critic_checkpoint_head = BrokenBackend("broken-critic-checkpoint-head", "the critic's checkpoint leaves the value "
                                       "head (score.*) out; a load keeps the folder's head",
                                       training=f"{_ENGINES}:CriticCheckpointWithoutHead")
critic_checkpoint_optimizer = BrokenBackend("broken-critic-checkpoint-optimizer", "the critic's save_checkpoint "
                                            "leaves AdamW's moments out",
                                            training=f"{_ENGINES}:CriticCheckpointWithoutOptimizerState")
critic_offload_tensor = BrokenBackend("broken-critic-offload-tensor", "the critic's onload() brings one parameter's "
                                      "second moments back as zeros", training=f"{_ENGINES}:CriticOffloadLosesTensor",
                                      training_caps=OFFLOAD_TRAINING)
critic_temperature = BrokenBackend("broken-critic-temperature", "the critic's values are divided by the batch's "
                                   "temperature", training=f"{_ENGINES}:CriticValuesTempered")
critic_token_budget = BrokenBackend("broken-critic-token-budget", "the critic ignores the micro-batch token budget "
                                    "(max_tokens, micro_batch_tokens): one micro-batch",
                                    training=f"{_ENGINES}:CriticTokenBudgetIgnored")
critic_grad_clip = BrokenBackend("broken-critic-grad-clip", "the critic ignores OptimConfig.grad_clip",
                                 training=f"{_ENGINES}:CriticGradClipIgnored")
critic_head_bias = BrokenBackend("broken-critic-head-bias", "the critic never loads the folder's score.bias (0)",
                                 training=f"{_ENGINES}:CriticHeadBiasNotLoaded")

critic_nonfinite = BrokenBackend("broken-critic-nonfinite", "the critic applies a non-finite update (a NaN loss's "
                                 "gradients stepped, skipped=False)", training=f"{_ENGINES}:CriticNonFiniteUpdateApplied")

class BrokenHFBackend:
    """A plugin declaring the hf backend with the engine of one role replaced by a faulty one."""

    def __init__(self, name: str, fault: str, role: Role, factory: str, *, prefix_continuation: bool = False) -> None:
        self.name = name
        self.fault = fault
        self.role = role
        self.factory = factory
        self.prefix_continuation = prefix_continuation  # declared by the rollout engine

    @hookimpl
    def verl_backend(self) -> BackendSpec:
        """The hf backend with its fault."""
        from verl_hf.capabilities import (
            REWARD_CAPABILITIES,
            ROLLOUT_CAPABILITIES,
            training_capabilities,
        )

        training = "verl_hf.training:build_training_engine"
        roles: dict[Role, str] = {
            "actor": training, "reference": training, "critic": training,
            "rollout": "verl_hf.rollout:build_rollout_engine", "reward": "verl_hf.reward:build_reward_engine",
        }
        roles[self.role] = self.factory
        return BackendSpec(
            name=self.name,
            roles=roles,
            capabilities={"actor": training_capabilities("actor"), "reference": training_capabilities("reference"),
                          "critic": training_capabilities("critic"),
                          "rollout": replace(ROLLOUT_CAPABILITIES, prefix_continuation=self.prefix_continuation),
                          "reward": REWARD_CAPABILITIES},
            protocol_version=PROTOCOL_VERSION,
            config_class="verl_hf.config:HFOptions",
            description=f"BROKEN on purpose: {self.fault}",
        )


arange_positions = BrokenHFBackend("broken-positions", "position ids are arange over the left-padded row",
                                   "actor", f"{_ENGINES}:ArangePositions")
only_rank_zero_loads = BrokenHFBackend("broken-only-rank-zero-loads", "load_checkpoint restores the state on "
                                       "data-parallel rank 0 only", "actor", f"{_ENGINES}:OnlyRankZeroLoads")
other_layout_drops_optimizer = BrokenHFBackend(
    "broken-other-layout-drops-optimizer", "a checkpoint loaded under another number of ranks than saved it "
    "restarts the optimizer's moments", "actor", f"{_ENGINES}:OtherLayoutDropsOptimizer")
critic_grads_not_reduced = BrokenHFBackend(
    "broken-critic-dp-unreduced", "under data parallelism the critic's gradients are not summed over the ranks",
    "critic", f"{_ENGINES}:CriticGradsNotReduced")
exports_masters = BrokenHFBackend("broken-export-masters", "a bfloat16 engine exports its float32 masters", "actor",
                                  f"{_ENGINES}:ExportsMasters")
frozen_position_table = BrokenHFBackend("broken-gpt2-position-grad", "on a GPT-2 folder the position table gets no "
                                        "gradient", "actor", f"{_ENGINES}:FrozenPositionTable")
position_table_unchecked = BrokenHFBackend("broken-gpt2-position-limit", "builds on GPT-2 with sequences longer "
                                           "than its position table", "actor", f"{_ENGINES}:PositionTableUnchecked")
final_norm_not_synced = BrokenHFBackend("broken-gpt2-sync", "on a GPT-2 folder a weight sync skips transformer.ln_f",
                                        "rollout", f"{_ENGINES}:FinalNormNotSynced")
reward_nan_zeroed = BrokenHFBackend("broken-reward-nan", "NaN scores are replaced by 0 instead of refused",
                                    "reward", f"{_ENGINES}:NaNScoresZeroed")
reward_order = BrokenHFBackend("broken-reward-order", "scores come back sorted by sample length, not in input order",
                               "reward", f"{_ENGINES}:LengthSortedScores")
reward_batch_centered = BrokenHFBackend("broken-reward-centered", "scores are centred on the batch mean",
                                        "reward", f"{_ENGINES}:BatchCenteredScores")
reward_last_column = BrokenHFBackend("broken-reward-last-column", "the score is read at the last column, not the "
                                     "last real token", "reward", f"{_ENGINES}:LastColumnScores")
reward_one_token_early = BrokenHFBackend("broken-reward-one-token-early", "the score is read one real token "
                                         "early", "reward", f"{_ENGINES}:ScoreOneTokenEarly")
reward_noisy = BrokenHFBackend("broken-reward-noisy", "scores carry unseeded noise", "reward", f"{_ENGINES}:NoisyScores")
reward_bos_tokenizer = BrokenHFBackend("broken-reward-tokenizer", "the engine's tokenizer prepends BOS on encode",
                                       "reward", f"{_ENGINES}:BosAddingRewardTokenizer")
rotary_arange_positions = BrokenHFBackend("broken-rotary-positions", "a rotary-only backend (GPT-2 refused) whose "
                                          "position ids are arange over the left-padded row", "actor",
                                          f"{_ENGINES}:RotaryOnlyArangePositions")
long_rope_prefix_cache = BrokenHFBackend("broken-long-rope-prefix-cache", "a prefix cache (KV) reused when a "
                                         "continuation crosses the LongRoPE threshold: keys rotated with the short "
                                         "factors serve it", "rollout", f"{_ENGINES}:LongRopeStalePrefixCache",
                                         prefix_continuation=True)
reward_token_scores_last_column = BrokenHFBackend("broken-reward-token-scores", "token scores placed at the last "
                                                  "column, not the last real token", "reward",
                                                  f"{_ENGINES}:TokenScoresAtLastColumn")
reward_scores_missing = BrokenHFBackend("broken-reward-no-scores", "declares scores but returns only token_scores",
                                        "reward", f"{_ENGINES}:TokenScoresOnly")
reward_unknown_device = BrokenHFBackend("broken-reward-devices", "declares the device 'gpu', which torch does not know",
                                        "reward", f"{_ENGINES}:UnknownDeviceDeclared")
reward_special_tokens_text = BrokenHFBackend("broken-reward-special-tokens", "a text reward whose decoding keeps "
                                             "special tokens (<bos>) in the text", "reward",
                                             f"{_ENGINES}:SpecialTokensInText")
reward_qkv_biases = BrokenHFBackend("broken-reward-qwen2-biases", "the reward model leaves the q, k and v biases out "
                                    "(Qwen2's)", "reward", f"{_ENGINES}:QKVBiasesDropped")
reward_qk_norms = BrokenHFBackend("broken-reward-qwen3-qk-norms", "the reward model leaves Qwen3's RMSNorm of q and k "
                                  "out", "reward", f"{_ENGINES}:QKNormsDropped")
reward_dtype_ignored = BrokenHFBackend("broken-reward-dtype-ignored", "the reward model builds in float32 whatever "
                                       "dtype it is asked for", "reward", f"{_ENGINES}:DtypeIgnored")
reward_parallel_ignored = BrokenHFBackend("broken-reward-parallel-ignored", "the reward model builds one device's "
                                          "engine whatever parallel sizes it is asked for", "reward",
                                          f"{_ENGINES}:ParallelIgnored")
reward_random_head = BrokenHFBackend("broken-reward-random-head", "the reward model loads a folder without score "
                                     "weights (a causal LM) with a head initialised at random", "reward",
                                     f"{_ENGINES}:RandomHeadAccepted")


class BrokenMegatronBackend:
    """A plugin declaring the ``megatron`` backend (megatron-core on gloo) with its training engine replaced."""

    def __init__(self, name: str, fault: str, training: str) -> None:
        self.name = name
        self.fault = fault
        self.training = training

    @hookimpl
    def verl_backend(self) -> BackendSpec:
        """The backend with its fault (its rollout is megatron's)."""
        from verl_megatron.capabilities import rollout_capabilities, training_capabilities

        return BackendSpec(
            name=self.name,
            roles={"actor": self.training, "critic": self.training,
                   "rollout": "verl_megatron.rollout:build_rollout_engine"},
            capabilities={"actor": training_capabilities("actor"), "critic": training_capabilities("critic"),
                          "rollout": rollout_capabilities()},
            protocol_version=PROTOCOL_VERSION,
            config_class="verl_megatron.options:MegatronOptions",
            description=f"BROKEN on purpose: {self.fault}",
        )


_MEGATRON_ENGINES = "verl_broken_backends.megatron_engines"
tp_qk_norm_grads = BrokenMegatronBackend("broken-tp-qk-norm-grads", "the megatron training engine does not sum "
                                         "the gradients of Qwen3's replicated q/k-norm weights over the tp ranks",
                                         f"{_MEGATRON_ENGINES}:QKNormGradsNotSummedOverTP")

# the optimizer and its schedule as OptimConfig describes them
warmup_from_zero = BrokenBackend("broken-warmup-from-zero", "the warmup counts the first step as 0 (its lr is 0)",
                                 training=f"{_ENGINES}:WarmupFromZero")
schedule_ignored = BrokenBackend("broken-schedule-ignored", "every update runs at the peak lr (no warmup or decay) "
                                 "while lr_at(step) is reported", training=f"{_ENGINES}:ScheduleIgnoredReported")
cosine_past_total = BrokenBackend("broken-cosine-past-total", "after total_steps the cosine climbs back up "
                                  "(torch's CosineAnnealingLR) instead of holding min_lr_ratio * lr",
                                  training=f"{_ENGINES}:CosineClimbsPastTotal")
constant_schedule_decays = BrokenBackend("broken-constant-schedule-decays", "schedule='constant' with total_steps "
                                         "set decays along the cosine", training=f"{_ENGINES}:ConstantScheduleDecays")
norms_not_decayed = BrokenBackend("broken-norms-not-decayed", "no weight decay on 1-D parameters (norm weights, "
                                  "biases)", training=f"{_ENGINES}:NormsAndBiasesNotDecayed")
micro_batch_grad_clip = BrokenBackend("broken-micro-batch-grad-clip", "each micro-batch's gradient clipped as it "
                                      "accumulates", training=f"{_ENGINES}:PerMicroBatchGradClip")
entropy_temperature = BrokenBackend("broken-entropy-temperature", "entropy at temperature 1 (log_probs at the "
                                    "batch's)", training=f"{_ENGINES}:EntropyAtTemperatureOne")
zero_rows = BrokenBackend("broken-zero-rows", "forward folds with reshape(batch, seq, -1): a batch of 0 rows "
                         "raises a bare RuntimeError", training=f"{_ENGINES}:ZeroRowsReshape")
truncated_log_probs = BrokenBackend("broken-truncated-log-probs", "rollout_log_probs of the truncated (top-k/top-p) "
                                    "distribution while declaring exact_log_probs_truncated",
                                    rollout=f"{_ENGINES}:TruncatedRolloutLogProbs")
_LIFETIME = "verl_broken_backends.lifetime"
close_worker_left = BrokenBackend("broken-close-worker-left", "the rollout engine starts a worker process and no close() "
                                  "stops it", rollout=f"{_LIFETIME}:WorkerLeftRunning")
close_thread_left = BrokenBackend("broken-close-thread-left", "the rollout engine starts a non-daemon thread that its "
                                  "close() leaves running", rollout=f"{_LIFETIME}:ThreadLeftRunning")
close_not_idempotent = BrokenBackend("broken-close-twice", "the training engine's close() deletes its model: a second "
                                     "close() raises AttributeError", training=f"{_LIFETIME}:CloseNotIdempotent")
