"""The test kit every package's tests use: tiny models, the float64 reference, tolerances, torchrun.

* :func:`tiny_model` / :func:`build_tiny_model`: Llama-, Qwen2- (QKV bias) and Qwen3- (QK norm)
  shaped transformers folders, tied or untied, with an offline character-level tokenizer; sizes
  divide by 2 so TP=2 and PP=2 work; head_dim >= 32 (vLLM's CPU attention needs it).
* :func:`reference_forward`: log-probs, entropy and values in float64 with transformers.
* :data:`TOLERANCES` / :func:`assert_close`: the tolerance tiers per dtype, declared once;
  :func:`near_tie_margin`: the log-prob gap under which two tokens are a near tie in a dtype.
* :func:`random_batch`: ragged, correctly padded TensorBatches for tests.
* :func:`launch_torchrun`: multi-rank runs that return results through files.
* :mod:`~verl_conformance.testkit.crafted`: folders with edited weights (an EOS-biased model, a GPT-2
  with absolute positions, a Llama with LongRoPE, Llamas under other RoPE scalings, perturbed weights, a
  NaN reward model, a reward model without its head's weights, folders whose special token ids (in
  ``config.json``, the tokenizer or ``generation_config.json``) lie outside the vocabulary, a Llama
  and a reward model that show an RMSNorm computed in bfloat16, folders that list further EOS ids and set sampling defaults
  in ``generation_config.json``) and a shuffled tokenizer.
"""

from __future__ import annotations

from verl_conformance.testkit.batches import emptied, random_batch
from verl_conformance.testkit.crafted import (
    BFLOAT16_NORM_ROPE_THETA,
    CONFIG_CONSTANTS,
    FOLDER_EOS_LISTS,
    GENERATION_DEFAULTS,
    LONG_ROPE_TRAINED,
    OMITTED_KEYS,
    OMITTED_KEYS_EMBED_SCALE,
    OTHER_ACTIVATION,
    OUT_OF_VOCAB_FILES,
    OUT_OF_VOCAB_IDS,
    OUT_OF_VOCAB_TOKEN,
    ROPE_SCALINGS,
    SHARDS,
    SLIDING_WINDOW,
    VALUE_HEAD_BIAS,
    ShuffledTokenizer,
    absolute_position_model,
    bfloat16_norm_model,
    bfloat16_norm_reward_model,
    config_constants_model,
    eos_model,
    eos_model_continuation,
    folder_defaults_model,
    headless_reward_model,
    long_rope_model,
    nan_reward_model,
    omitted_keys_model,
    other_activation_model,
    out_of_vocab_file_model,
    out_of_vocab_model,
    perturbed_absolute_position_model,
    perturbed_model,
    rope_scaled_model,
    sharded_model,
    sliding_window_model,
    two_label_reward_model,
    value_bias_model,
    windowless_sliding_model,
    without_folders,
)
from verl_conformance.testkit.launcher import LaunchError, launch_torchrun, write_rank_result
from verl_conformance.testkit.models import (
    ARCHS,
    Arch,
    CharTokenizer,
    ModelHead,
    TinyModelSpec,
    build_tiny_model,
    load_tokenizer,
    tiny_model,
)
from verl_conformance.testkit.reference import reference_forward
from verl_conformance.testkit.tolerances import (
    TOLERANCES,
    Tolerance,
    assert_close,
    near_tie_margin,
    tolerance,
)

__all__ = [
    "ARCHS",
    "BFLOAT16_NORM_ROPE_THETA",
    "LONG_ROPE_TRAINED",
    "CONFIG_CONSTANTS",
    "FOLDER_EOS_LISTS",
    "GENERATION_DEFAULTS",
    "OMITTED_KEYS",
    "OMITTED_KEYS_EMBED_SCALE",
    "OTHER_ACTIVATION",
    "OUT_OF_VOCAB_FILES",
    "OUT_OF_VOCAB_IDS",
    "OUT_OF_VOCAB_TOKEN",
    "ROPE_SCALINGS",
    "SHARDS",
    "SLIDING_WINDOW",
    "TOLERANCES",
    "VALUE_HEAD_BIAS",
    "Arch",
    "CharTokenizer",
    "LaunchError",
    "ModelHead",
    "ShuffledTokenizer",
    "TinyModelSpec",
    "Tolerance",
    "absolute_position_model",
    "assert_close",
    "bfloat16_norm_model",
    "bfloat16_norm_reward_model",
    "build_tiny_model",
    "emptied",
    "eos_model",
    "eos_model_continuation",
    "folder_defaults_model",
    "headless_reward_model",
    "launch_torchrun",
    "load_tokenizer",
    "long_rope_model",
    "nan_reward_model",
    "omitted_keys_model",
    "other_activation_model",
    "near_tie_margin",
    "out_of_vocab_file_model",
    "out_of_vocab_model",
    "perturbed_absolute_position_model",
    "perturbed_model",
    "random_batch",
    "reference_forward",
    "config_constants_model",
    "rope_scaled_model",
    "sharded_model",
    "sliding_window_model",
    "tiny_model",
    "two_label_reward_model",
    "windowless_sliding_model",
    "tolerance",
    "value_bias_model",
    "without_folders",
    "write_rank_result",
]
