"""Crafted test-kit models: tiny folders whose weights are edited so that a fault cannot hide.

Random tiny models rarely emit EOS, are blind to shifted position ids (rotary embeddings depend only
on relative positions) and keep some tensors equal across seeds (norm weights are ones). These
folders close those gaps; each is built once per machine next to the :func:`tiny_model` cache and
loads with transformers, vLLM and the Megatron converter like any test-kit folder:

* :func:`eos_model`: a Llama whose next token is a fixed function of the current one (see
  :func:`eos_model_continuation`), so chosen prompts end with EOS at a chosen step, at the first
  step, or never, with a logit margin of ~30 (greedy and sampling at T=1 agree).
* :func:`absolute_position_model`: a GPT-2 with learned absolute position embeddings: a wrong
  position id changes every output.
* :func:`long_rope_model`: the tiny Llama with LongRoPE scaling whose frequencies change past
  position :data:`LONG_ROPE_TRAINED`: rotary, yet position ids that count padding show.
* :func:`rope_scaled_model`: the tiny Llama under a RoPE scaling (linear, also in the
  transformers 4 format, YaRN, Llama 3, LongRoPE): positions past :data:`LONG_ROPE_TRAINED` move
  every output by nats when the scaling is ignored.
* :func:`perturbed_model`: a folder's weights with every tensor moved by its own known delta.
* :func:`omitted_keys_model`: a Llama and a Qwen3 whose ``config.json`` leaves out the keys transformers
  fills from the family's defaults (Qwen3's ``head_dim`` is 128, not ``hidden_size / heads``).
* :func:`sharded_model`: the tiny Llama (tensors moved) in three safetensors files with an index, as
  every real checkpoint past a few GB is saved.
* :func:`bfloat16_norm_model`: a Llama whose normalised rows sit just beside bfloat16 rounding
  points: an RMSNorm computed in bfloat16 (no float32 upcast) moves its log-probs by nats.
* :func:`bfloat16_norm_reward_model`: its reward-model variant (a score head), whose scores such a norm
  moves far past the bfloat16 tier.
* :func:`value_bias_model`: the value-head folder with a nonzero ``score.bias`` (a random folder's is 0).
* :func:`nan_reward_model`: a reward model whose score head outputs NaN.
* :func:`headless_reward_model`: a reward model's folder without the score head's weights.
* :func:`two_label_reward_model`: a reward model's folder whose score head has two labels.
* :func:`out_of_vocab_model`: the tiny Llama (or reward model) whose ``config.json`` sets one special
  token id outside the vocabulary (:data:`OUT_OF_VOCAB_IDS`), which an engine must refuse.
* :func:`out_of_vocab_file_model`: the same folders with the config right but the tokenizer's EOS or
  ``generation_config.json``'s EOS outside the vocabulary (:data:`OUT_OF_VOCAB_FILES`).
* :func:`folder_defaults_model`: the EOS model or the tiny Llama whose ``config.json`` and
  ``generation_config.json`` list further EOS ids (:data:`FOLDER_EOS_LISTS`) that its greedy
  continuations emit, and whose ``generation_config.json`` sets sampling defaults
  (:data:`GENERATION_DEFAULTS`): a rollout follows the tokenizer's EOS and ``SamplingParams`` alone.
* :class:`ShuffledTokenizer`: the same characters under other ids (a policy whose tokenizer
  differs from the reward model's).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final, Literal

import torch

from verl_core.trainer.inputs.tiny_model import (
    CharTokenizer,
    ModelHead,
    TinyModelSpec,
    load_tokenizer,
    no_progress_bars,
    tiny_model,
)

__all__ = [
    "BFLOAT16_NORM_ROPE_THETA",
    "CONFIG_CONSTANTS",
    "EOS_AFTER_3",
    "EOS_FIRST",
    "EOS_LADDER_END",
    "EOS_LADDER_START",
    "FOLDER_EOS_LISTS",
    "GENERATION_DEFAULTS",
    "LONG_ROPE_TRAINED",
    "NEVER_EOS",
    "OMITTED_KEYS",
    "OMITTED_KEYS_EMBED_SCALE",
    "OTHER_ACTIVATION",
    "OUT_OF_VOCAB_FILES",
    "OUT_OF_VOCAB_IDS",
    "OUT_OF_VOCAB_TOKEN",
    "ROPE_SCALED_MAX_POSITIONS",
    "ROPE_SCALINGS",
    "SHARDS",
    "SLIDING_WINDOW",
    "VALUE_HEAD_BIAS",
    "ShuffledTokenizer",
    "absolute_position_model",
    "bfloat16_norm_model",
    "bfloat16_norm_reward_model",
    "config_constants_model",
    "eos_model",
    "eos_model_continuation",
    "folder_defaults_model",
    "headless_reward_model",
    "long_rope_model",
    "nan_reward_model",
    "omitted_keys_model",
    "other_activation_model",
    "out_of_vocab_file_model",
    "out_of_vocab_model",
    "perturbed_absolute_position_model",
    "perturbed_model",
    "rope_scaled_model",
    "sharded_model",
    "sliding_window_model",
    "two_label_reward_model",
    "value_bias_model",
    "windowless_sliding_model",
    "without_folders",
]

_RECIPE: Final = 1  # bump when a recipe changes: the cache key includes it
_EOS: Final = 1
EOS_AFTER_3: Final = 10
"""A prompt ending in this token continues 11, 12, EOS."""
EOS_FIRST: Final = 20
"""A prompt ending in this token continues with EOS at once."""
NEVER_EOS: Final = 30
"""A prompt ending in this token continues 31, 30, 31, ... and never emits EOS."""
EOS_LADDER_END: Final = 60
"""A prompt ending in t, 40 <= t <= 60, continues t + 1, ..., 60, EOS: EOS is token number 61 - t."""
EOS_LADDER_START: Final = 40
"""The first token of the EOS ladder (see :data:`EOS_LADDER_END`)."""
LONG_ROPE_TRAINED: Final = 24
"""Positions of :func:`long_rope_model` below this use the model's own rotary frequencies."""


def _cache_root() -> Path:
    # the folder tiny_model() caches in, so one cleanup removes both
    return Path(os.environ.get("VERL_TESTKIT_CACHE") or Path(tempfile.gettempdir()) / "verl-testkit")


_FOLDER_NAME: Final = re.compile(r"[\w.-]*-[0-9a-f]{16}[\w.-]*")
"""A cached folder's name (``crafted-rope-yarn-<16 hex>``, ``qwen2-causal_lm-untied-<16 hex>``)."""


def without_folders(message: str) -> str:
    """``message`` with every test-kit folder (a path under the cache, or a cached folder's name)
    replaced by ``<folder>``.

    Checks that want a refusal to name a setting (``sliding_window``, a rope type, a config key, a
    model_type) read the message through this: the folders' names hold those words, and a message
    that names only the folder must not pass for one that names the setting.
    """
    for root in {str(_cache_root()), str(_cache_root().resolve())}:
        message = re.sub(re.escape(root) + r"[^\s'\"`,;)]*", "<folder>", message)
    return _FOLDER_NAME.sub("<folder>", message)


def _crafted(name: str, recipe: dict[str, object], build: Callable[[Path], None]) -> Path:
    """The cached folder ``name`` built by ``build`` (once per machine; safe under concurrent processes)."""
    key = hashlib.sha256(json.dumps({"recipe": _RECIPE, **recipe}, sort_keys=True).encode()).hexdigest()[:16]
    root = _cache_root()
    dest = root / f"crafted-{name}-{key}"
    marker = "verl_crafted_model.json"
    if (dest / marker).exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        build(tmp)
        (tmp / marker).write_text(json.dumps({"name": name, **recipe}, indent=1, default=str))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _copy_with_weights(base: Path, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``base``'s config and tokenizer files in ``out``, with ``tensors`` as its weights."""
    from safetensors.torch import save_file

    for f in base.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "verl_tiny_model.json"):
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _successor(token: int) -> int:
    """The next token the EOS model emits after ``token``."""
    if token in (EOS_AFTER_3, EOS_AFTER_3 + 1):
        return token + 1
    if token in (EOS_AFTER_3 + 2, EOS_FIRST, EOS_LADDER_END):
        return _EOS
    if token in (NEVER_EOS, NEVER_EOS + 1):
        return NEVER_EOS + 1 if token == NEVER_EOS else NEVER_EOS
    if EOS_LADDER_START <= token < EOS_LADDER_END:
        return token + 1
    return token


def eos_model_continuation(last_token: int, max_new_tokens: int,
                           stop_token_ids: Sequence[int] = ()) -> tuple[list[int], bool]:
    """What the EOS model generates after a prompt ending in ``last_token``: the tokens (EOS, or
    a token of ``stop_token_ids``, included when reached) and whether the response is truncated
    (the limit hit without EOS or a stop token)."""
    out: list[int] = []
    token = last_token
    while len(out) < max_new_tokens:
        token = _successor(token)
        out.append(token)
        if token == _EOS or token in stop_token_ids:
            return out, False
    return out, True


def eos_model() -> Path:
    """A Llama folder whose next token depends only on the current token (see :func:`eos_model_continuation`).

    The input embedding is ``100 * I`` (vocabulary = width = 128), so the residual stream is the
    current token's axis plus the layers' small contributions; the lm_head maps that axis to the
    successor's logit (``3 * sqrt(128)`` after the final norm, ~30 above any other).
    """
    spec = TinyModelSpec()

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _weights(base)
        vocab, hidden = w["model.embed_tokens.weight"].shape
        w["model.embed_tokens.weight"] = 100.0 * torch.eye(vocab, hidden)
        head = torch.zeros(vocab, hidden)
        for x in range(vocab):
            head[_successor(x), x] = 3.0
        w["lm_head.weight"] = head
        _copy_with_weights(base, out, w)

    return _crafted("eos", {"base": asdict(spec)}, build)


def absolute_position_model() -> Path:
    """A tiny GPT-2 folder (learned absolute position embeddings, tied lm_head) with the test kit's tokenizer.

    Its position embeddings are as large as its token embeddings, so position ids that count
    padding (``arange`` under left padding) change every output.
    """
    import transformers

    def build(out: Path) -> None:
        config = transformers.GPT2Config(
            vocab_size=128, n_positions=512, n_embd=128, n_layer=2, n_head=4, n_inner=256,
            initializer_range=0.1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        with no_progress_bars():  # one bar per tiny save is noise
            model.save_pretrained(out, safe_serialization=True)
        # the test kit's tokenizer files (the same character vocabulary as every other folder)
        base = tiny_model(TinyModelSpec())
        for f in base.iterdir():
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, out / f.name)

    return _crafted("gpt2", {"arch": "gpt2", "width": 128, "layers": 2}, build)


def long_rope_model() -> Path:
    """The test kit's tiny Llama with LongRoPE scaling: plain RoPE within the trained range, other frequencies past it.

    Rotary embeddings see only relative positions, so position ids shifted by a constant (``arange``
    over a left-padded row) give the same outputs, and a rotary model cannot see them. LongRoPE
    picks its frequencies by the largest position id of the forward (transformers), or of the
    batch (vLLM): up to :data:`LONG_ROPE_TRAINED` the short factors (all 1: this is the tiny Llama
    exactly), past it long factors of 1 to 64 that move every output by nats. Sequences that stay
    within the trained range but are left-padded beyond it therefore give the tiny Llama's outputs
    only when position ids count real tokens. The attention factor is 1 (no temperature change).
    """
    spec = TinyModelSpec()

    def build(out: Path) -> None:
        base = tiny_model(spec)
        _copy_with_weights(base, out, _weights(base))
        config = json.loads((base / "config.json").read_text())
        half = spec.head_dim // 2
        config["rope_parameters"] = {
            "rope_type": "longrope", "rope_theta": 10000.0, "attention_factor": 1.0,
            "original_max_position_embeddings": LONG_ROPE_TRAINED,
            "short_factor": [1.0] * half,
            "long_factor": [1.0 + 63.0 * i / (half - 1) for i in range(half)],
        }
        (out / "config.json").write_text(json.dumps(config, indent=1))

    return _crafted("long-rope", {"base": asdict(spec), "trained": LONG_ROPE_TRAINED}, build)


ROPE_SCALED_MAX_POSITIONS: Final = 96
"""``max_position_embeddings`` of every :func:`rope_scaled_model` folder: 4 times the trained range."""
_HALF_HEAD: Final = TinyModelSpec().head_dim // 2

ROPE_SCALINGS: Final[dict[str, dict[str, object]]] = {
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    # the same scaling as written by transformers 4 (a top-level rope_scaling and rope_theta)
    "linear-legacy": {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 10000.0},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": LONG_ROPE_TRAINED}},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": LONG_ROPE_TRAINED}},
    # no attention_factor: the default sqrt(1 + ln(factor) / ln(24)) = 1.198 scales cos and sin everywhere
    "longrope": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": LONG_ROPE_TRAINED,
                                     "short_factor": [1.0] * _HALF_HEAD,
                                     "long_factor": [1.0 + 63.0 * i / (_HALF_HEAD - 1)
                                                     for i in range(_HALF_HEAD)]}},
}
"""The RoPE scalings of :func:`rope_scaled_model`, as the ``config.json`` entries that declare them."""


def _config_variant(name: str, spec: TinyModelSpec, recipe: dict[str, object],
                    edit: Callable[[dict[str, Any]], None]) -> Path:
    """``tiny_model(spec)``'s weights and files under a ``config.json`` that ``edit`` changed in place
    (cached as ``name`` with ``recipe``)."""

    def build(out: Path) -> None:
        base = tiny_model(spec)
        _copy_with_weights(base, out, _weights(base))
        config = json.loads((base / "config.json").read_text())
        edit(config)
        (out / "config.json").write_text(json.dumps(config, indent=1))

    return _crafted(name, {"base": asdict(spec), **recipe}, build)


CONFIG_CONSTANTS: Final = {"rope_theta": 500.0, "rms_norm_eps": 0.05}
"""What :func:`config_constants_model` sets, far from the values engines tend to hard-code (10000, 1e-6)."""


def config_constants_model(spec: TinyModelSpec | None = None) -> Path:
    """The test kit's tiny model of ``spec`` (the Llama by default) whose ``config.json`` sets ``rope_theta``
    500 (in ``rope_parameters``, as transformers 5 writes it) and ``rms_norm_eps`` 0.05: every other folder
    uses the usual 10000 and 1e-6, so a backend that hard-codes them computes those folders right and
    real checkpoints (Llama 3's 5e5, Qwen2's 1e6) wrong. Either change moves the log-probs well past the
    float32 tier."""
    spec = spec or TinyModelSpec()

    def edit(config: dict[str, Any]) -> None:
        config["rms_norm_eps"] = CONFIG_CONSTANTS["rms_norm_eps"]
        rope = config.get("rope_parameters")
        if isinstance(rope, dict):
            rope["rope_theta"] = CONFIG_CONSTANTS["rope_theta"]
        else:
            config["rope_theta"] = CONFIG_CONSTANTS["rope_theta"]

    return _config_variant("config-constants", spec, {"config": CONFIG_CONSTANTS}, edit)


OMITTED_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "llama": ("head_dim", "num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_parameters",
              "rope_scaling", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act"),
    "qwen3": ("head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
              "tie_word_embeddings", "attention_bias", "hidden_act", "use_sliding_window", "sliding_window",
              "max_window_layers", "layer_types"),
}
"""The ``config.json`` keys :func:`omitted_keys_model` leaves out, by family (transformers 5 fills each
from its config class: see the table "Keys a config may omit" of the backend guide)."""

OMITTED_KEYS_EMBED_SCALE: Final = 0.01
"""How :func:`omitted_keys_model` scales the embedding: its rows' mean square falls to about 1e-6, the
``rms_norm_eps`` default, so the first norm's output depends on the eps by tens of percent."""


def omitted_keys_model(arch: Literal["llama", "qwen3"]) -> Path:
    """A tiny Llama or Qwen3 whose ``config.json`` leaves out every key of :data:`OMITTED_KEYS` that
    transformers 5 fills from the family's defaults (the test kit's other folders set them all).

    The weights are those the defaults describe: the Llama's 4 key/value heads (``num_key_value_heads``
    defaults to ``num_attention_heads``) and untied ``lm_head``; the Qwen3's heads 128 wide (its
    ``head_dim`` default, not ``hidden_size / num_attention_heads`` = 32) and untied ``lm_head``. The
    embedding is scaled by :data:`OMITTED_KEYS_EMBED_SCALE` so that an ``rms_norm_eps`` other than 1e-6
    moves the outputs, and every tensor is moved as in :func:`perturbed_model` (no norm weight at one).
    A backend that guesses another family's default (``head_dim`` 32 for Qwen3, tied embeddings,
    ``rms_norm_eps`` 1e-5) computes another model or fails to load the weights.
    """
    spec = (TinyModelSpec(num_kv_heads=4) if arch == "llama"
            else TinyModelSpec(arch="qwen3", head_dim=128))

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _perturbed_weights(base, 3)
        w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * OMITTED_KEYS_EMBED_SCALE
        _copy_with_weights(base, out, w)
        config = json.loads((base / "config.json").read_text())
        for key in OMITTED_KEYS[arch]:
            config.pop(key, None)
        (out / "config.json").write_text(json.dumps(config, indent=1))

    return _crafted(f"omitted-keys-{arch}", {"base": asdict(spec), "omitted": OMITTED_KEYS[arch],
                                             "embed_scale": OMITTED_KEYS_EMBED_SCALE, "seed": 3}, build)


SHARDS: Final = 3
"""How many ``model-0000k-of-00003.safetensors`` files :func:`sharded_model` splits the weights into."""


def sharded_model() -> Path:
    """The test kit's tiny Llama with every tensor moved (as :func:`perturbed_model`'s, seed 4) saved as a
    sharded folder, the layout of every real checkpoint past a few GB: :data:`SHARDS` files
    ``model-0000k-of-00003.safetensors`` and a ``model.safetensors.index.json`` whose ``weight_map``
    names each tensor's file, and no ``model.safetensors``. The embedding and the first layer lie in
    the first file, the last layer, the final norm and the ``lm_head`` in the last: an engine that
    reads one file computes another model or fails to load."""
    spec = TinyModelSpec()

    def build(out: Path) -> None:
        from safetensors.torch import save_file

        base = tiny_model(spec)
        weights = _perturbed_weights(base, 4)
        names = sorted(weights, key=_shard_order)
        size = -(-len(names) // SHARDS)
        weight_map: dict[str, str] = {}
        for k in range(SHARDS):
            part = names[k * size:(k + 1) * size]
            file = f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
            save_file({n: weights[n].contiguous() for n in part}, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        for f in base.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "verl_tiny_model.json"):
                shutil.copy(f, out / f.name)

    return _crafted("sharded", {"base": asdict(spec), "shards": SHARDS, "seed": 4}, build)


def _shard_order(name: str) -> tuple[int, int, str]:
    """Embedding first, then the layers in order, then the final norm and the head."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0, 0, name) if "embed_tokens" in name else (2, 0, name)


OTHER_ACTIVATION: Final = "gelu_pytorch_tanh"
"""The ``hidden_act`` of :func:`other_activation_model` (the MLP activation of Gemma-style configs)."""


def other_activation_model() -> Path:
    """The test kit's tiny Llama with ``hidden_act`` :data:`OTHER_ACTIVATION` instead of ``silu`` (same
    weights): transformers' Llama applies whatever activation the config names, so a backend that
    hard-codes SiLU computes another model; it must apply the activation or refuse the folder."""
    return _config_variant("other-activation", TinyModelSpec(), {"hidden_act": OTHER_ACTIVATION},
                           lambda config: config.update(hidden_act=OTHER_ACTIVATION))


SLIDING_WINDOW: Final = 8
"""The ``sliding_window`` of :func:`sliding_window_model`: far below the suite's sequences (26 to 42 tokens)."""


def sliding_window_model() -> Path:
    """The test kit's tiny Qwen2 with sliding-window attention on every layer (``use_sliding_window``,
    ``sliding_window`` :data:`SLIDING_WINDOW`, ``max_window_layers`` 0, ``layer_types`` all
    ``sliding_attention``; same weights): each token attends to the last 8 positions only, so a
    backend that ignores the keys computes full attention; it must apply the window or refuse."""
    def edit(config: dict[str, Any]) -> None:
        config.update(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=0,
                      layer_types=["sliding_attention"] * int(config["num_hidden_layers"]))

    return _config_variant("sliding-window", TinyModelSpec(arch="qwen2"), {"sliding_window": SLIDING_WINDOW}, edit)


def windowless_sliding_model() -> Path:
    """The test kit's tiny Qwen2 whose ``layer_types`` marks every layer ``sliding_attention`` while
    ``use_sliding_window`` is false (``sliding_window`` :data:`SLIDING_WINDOW` beside it): transformers
    then sets ``sliding_window`` to None and its forward fails, so whether those layers see a window or
    every key is unknowable. An engine refuses the folder with a ConfigError naming ``layer_types``."""
    def edit(config: dict[str, Any]) -> None:
        config.update(use_sliding_window=False, sliding_window=SLIDING_WINDOW, max_window_layers=0,
                      layer_types=["sliding_attention"] * int(config["num_hidden_layers"]))

    return _config_variant("sliding-windowless", TinyModelSpec(arch="qwen2"), {"sliding_window": SLIDING_WINDOW,
                                                                                "use_sliding_window": False}, edit)


BFLOAT16_NORM_ROPE_THETA: Final = 1e8
"""``rope_theta`` of :func:`bfloat16_norm_model`: its attention reads RoPE pairs 10 to 15 only, which
turn by less than 5e-4 rad over 48 positions (1e-5 rad per position at most), far below bfloat16's
resolution, so every key of a correct bfloat16 engine is the same whatever its position."""

# bfloat16_norm_model's layout: every token's embedding row is a_t * _NORM_PATTERN with the value
# columns' signs drawn per token (so every row has the same normalised magnitudes)
_NORM_UP: Final = (0, 1, 2, 3)  # normalise to just below a bfloat16 rounding midpoint
_NORM_DOWN: Final = (4, 5, 6, 7)  # normalise to just above one
_NORM_BALANCE: Final = (8, 9, 10, 11)  # read by the query with a negative weight: keeps scores small
_NORM_VALUES: Final = tuple(range(12, 28))  # the token's signs: what attention averages
_NORM_FILL: Final = (28, 29)  # set the row's RMS that puts the columns above beside the midpoints
_NORM_OUTPUT: Final = tuple(range(32, 48))  # written by o_proj, read by the lm_head
_NORM_PATTERN: Final = {_NORM_UP: 1.5, _NORM_DOWN: 1.375, _NORM_BALANCE: 1.875, _NORM_VALUES: 4.0,
                        (_NORM_FILL[0],): 1.125, (_NORM_FILL[1],): 3.25}
_NORM_SCALES: Final = tuple(1 + i / 8 for i in range(8))  # a_t = _NORM_SCALES[t % 8]
_NORM_MIDPOINT_GAP: Final = (2e-5, 1e-4)  # relative distance of the up/down columns to their midpoint
_NORM_SLOTS: Final = ((10, 11, 12, 13, 14, 15), (26, 27, 28, 29, 30, 31))  # head 0's RoPE pairs (i, i + 16)
_NORM_QK_SCALE: Final = (32.0, 64.0)  # q and k = these times the normalised columns: one tipped column ~5 nats
_NORM_HEAD_STD: Final = 0.15


def _bfloat16_midpoint_gap(x: float) -> float:
    """(x - m) / x for the bfloat16 rounding midpoint m nearest above the grid point below ``x`` (> 0):
    negative below the midpoint (rounds down), positive above it (rounds up)."""
    step = 2.0 ** (math.floor(math.log2(x)) - 7)
    return (x - (math.floor(x / step) * step + step / 2)) / x


def bfloat16_norm_model() -> Path:
    """A Llama on which an RMSNorm computed in bfloat16 (no float32 upcast) moves the log-probs by nats,
    while an engine that normalises in float32 and rounds once, as transformers' ``LlamaRMSNorm`` does,
    stays within about a tenth of the bfloat16 tier.

    A bfloat16 norm rounds the mean of squares and its reciprocal square root to bfloat16 (~1e-3
    relative each): the normalised row comes out scaled by 1 + d with d a function of the row. On
    random weights that is one more bfloat16 rounding and hides in the tier, so here:

    * every token's embedding row is ``a_t`` (1 to 1.875 by eighths, ``t % 8``) times one pattern
      whose 16 value columns carry the token's signs; rows are exact in bfloat16 and all normalise
      to the same magnitudes (float32 normalisation: equal to ~1e-7), but ``d`` differs with ``a_t``;
    * four key columns normalise to 2e-5 to 1e-4 (relative) below a bfloat16 rounding midpoint and
      four to as far above one: float32 normalisation rounds them alike for every token, while a
      bfloat16 norm's ``d`` tips them, up or down by token, to the neighbouring bfloat16 value;
    * layer 0's head 0 reads those columns (and four that keep the score small) as query and key
      through RoPE pairs of negligible frequency (``rope_theta`` 1e8): a correct engine gives every
      key the same score, so attention averages the previous tokens' value columns evenly; one
      tipped column moves a key's score by ~5 nats, and attention then leans to some tokens by e^5;
    * the MLPs and layer 1 are zero; the lm_head reads the attention output.

    Seen with transformers (200 batches of 6 x 24 random ids): bfloat16 with float32 norms at most
    0.1 of the bfloat16 log-prob tolerance, norms in bfloat16 (five ways of writing them) at least
    6.8 times it. The folder loads with transformers, vLLM and the Megatron converter like any test-kit
    folder; its config is the tiny Llama's with ``rope_theta`` :data:`BFLOAT16_NORM_ROPE_THETA`.
    """
    spec = TinyModelSpec()
    recipe: dict[str, object] = {
        "base": asdict(spec), "pattern": {str(k): v for k, v in _NORM_PATTERN.items()}, "scales": _NORM_SCALES,
        "slots": _NORM_SLOTS, "qk": _NORM_QK_SCALE, "head_std": _NORM_HEAD_STD, "theta": BFLOAT16_NORM_ROPE_THETA,
    }

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _weights(base)
        vocab, hidden = w["model.embed_tokens.weight"].shape
        pattern = torch.zeros(hidden)
        for columns, value in _NORM_PATTERN.items():
            pattern[list(columns)] = value
        rms = float(pattern.double().pow(2).mean().sqrt())
        for columns, side in ((_NORM_UP, -1), (_NORM_DOWN, 1)):
            gap = _bfloat16_midpoint_gap(float(pattern[columns[0]]) / rms)
            assert _NORM_MIDPOINT_GAP[0] <= side * gap <= _NORM_MIDPOINT_GAP[1], (columns, gap)
        g = torch.Generator().manual_seed(0)
        emb = torch.zeros(vocab, hidden)  # the pad row stays zero
        values = list(_NORM_VALUES)
        for token in range(1, vocab):
            row = _NORM_SCALES[token % len(_NORM_SCALES)] * pattern
            row[values] *= torch.where(torch.rand(len(values), generator=g) < 0.5, -1.0, 1.0)
            emb[token] = row
        normed = (emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        keyed = list(_NORM_UP + _NORM_DOWN + _NORM_BALANCE)
        assert torch.equal(emb.to(torch.bfloat16).float(), emb) and bool((normed[1:, keyed] == normed[1, keyed]).all())
        q = torch.zeros_like(w["model.layers.0.self_attn.q_proj.weight"])
        k = torch.zeros_like(w["model.layers.0.self_attn.k_proj.weight"])
        v = torch.zeros_like(k)
        o = torch.zeros_like(w["model.layers.0.self_attn.o_proj.weight"])
        up, down, bal = (float(normed[1, c[0]]) for c in (_NORM_UP, _NORM_DOWN, _NORM_BALANCE))
        # the balance columns' query weight: the score of every key near 0, so bfloat16 scores keep a 5-nat step
        balance = float(torch.tensor(-(len(_NORM_UP) * up * up + len(_NORM_DOWN) * down * down)
                                     / (len(_NORM_BALANCE) * bal * bal)).to(torch.bfloat16))
        first, second = _NORM_SLOTS
        read = list(_NORM_UP) + list(_NORM_BALANCE[:2]) + list(_NORM_DOWN) + list(_NORM_BALANCE[2:])
        for slot, col in zip(first + second, read, strict=True):
            q[slot, col] = _NORM_QK_SCALE[0] * (balance if col in _NORM_BALANCE else 1.0)
            k[slot, col] = _NORM_QK_SCALE[1]
        for i, col in enumerate(_NORM_VALUES):
            v[i, col] = 4.0
            o[_NORM_OUTPUT[i], i] = 4.0
        head = torch.zeros(vocab, hidden)
        head[:, list(_NORM_OUTPUT)] = (torch.randn(vocab, len(_NORM_OUTPUT), generator=g) * _NORM_HEAD_STD
                                       ).to(torch.bfloat16).float()
        for name, tensor in w.items():
            w[name] = torch.zeros_like(tensor)
        w["model.embed_tokens.weight"] = emb
        w["lm_head.weight"] = head
        w["model.layers.0.self_attn.q_proj.weight"] = q.to(torch.bfloat16).float()
        w["model.layers.0.self_attn.k_proj.weight"] = k
        w["model.layers.0.self_attn.v_proj.weight"] = v
        w["model.layers.0.self_attn.o_proj.weight"] = o
        for name in w:
            if name.endswith("norm.weight"):
                w[name] = torch.ones(hidden)
        _copy_with_weights(base, out, w)
        _write_bfloat16_norm_config(base, out)

    return _crafted("bfloat16-norm", recipe, build)


def _write_bfloat16_norm_config(base: Path, out: Path) -> None:
    """``base``'s ``config.json`` in ``out`` with ``rope_theta`` :data:`BFLOAT16_NORM_ROPE_THETA`."""
    config = json.loads((base / "config.json").read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        rope["rope_theta"] = BFLOAT16_NORM_ROPE_THETA
    else:
        config["rope_theta"] = BFLOAT16_NORM_ROPE_THETA
    (out / "config.json").write_text(json.dumps(config, indent=1))


_NORM_SCORE_STD: Final = 0.3  # the score head's weights on the attention output's columns


def bfloat16_norm_reward_model() -> Path:
    """The reward-model variant of :func:`bfloat16_norm_model`: the same layers and embedding under the
    test kit's reward config (``LlamaForSequenceClassification``, one label, ``rope_theta``
    :data:`BFLOAT16_NORM_ROPE_THETA`), the lm_head replaced by a ``score.weight`` that reads the
    attention output's 16 columns (seeded normal draws of std 0.3, exact in bfloat16) and zeros elsewhere.

    The score read at the last real token is then a weighted sum of the average of the value columns of
    the tokens up to it, which a correct engine takes evenly and a norm computed in bfloat16 tilts by e^5 to
    some tokens. Seen with the hf reward engine (100 batches of 6 samples of up to 24 random ids, scores
    of |s| <= 8.1): bfloat16 with float32 norms at most 0.12 of the bfloat16 scores tolerance; norms in
    bfloat16 (the whole norm, or the mean of squares in float32 and its product with x in bfloat16) at
    least 4.1 times it in every batch (18 times on ``numerics::bfloat16_rms_norm_in_float32``'s batch).
    """
    spec = TinyModelSpec(head="reward")
    causal = bfloat16_norm_model()
    recipe: dict[str, object] = {"base": asdict(spec), "causal": causal.name, "score_std": _NORM_SCORE_STD, "seed": 1}

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _weights(causal)
        del w["lm_head.weight"]
        hidden = w["model.embed_tokens.weight"].shape[1]
        g = torch.Generator().manual_seed(1)
        score = torch.zeros(1, hidden)
        score[0, list(_NORM_OUTPUT)] = (torch.randn(len(_NORM_OUTPUT), generator=g) * _NORM_SCORE_STD
                                        ).to(torch.bfloat16).float()
        w["score.weight"] = score
        assert set(w) == set(_weights(base)), sorted(set(w) ^ set(_weights(base)))
        _copy_with_weights(base, out, w)
        _write_bfloat16_norm_config(base, out)

    return _crafted("bfloat16-norm-reward", recipe, build)


def rope_scaled_model(kind: str) -> Path:
    """The test kit's tiny Llama whose ``config.json`` declares the RoPE scaling ``ROPE_SCALINGS[kind]``.

    The weights are the tiny Llama's; every scaling moves the log-probs by nats at positions
    past :data:`LONG_ROPE_TRAINED`, so a backend that ignores the scaling its folder declares
    shows. ``linear-legacy`` writes the linear scaling the way transformers 4 did (a top-level
    ``rope_scaling`` with ``type``, and ``rope_theta``), which transformers 5 still reads;
    ``longrope`` leaves ``attention_factor`` out, so its default (from
    ``max_position_embeddings / original_max_position_embeddings``) scales every position.
    ``max_position_embeddings`` is :data:`ROPE_SCALED_MAX_POSITIONS` (the scaled range).

    Raises:
        KeyError: ``kind`` is not a key of :data:`ROPE_SCALINGS`.
    """
    if kind not in ROPE_SCALINGS:
        raise KeyError(f"no RoPE scaling {kind!r}; kinds: {', '.join(ROPE_SCALINGS)}")
    spec = TinyModelSpec()
    entries = ROPE_SCALINGS[kind]

    def build(out: Path) -> None:
        base = tiny_model(spec)
        _copy_with_weights(base, out, _weights(base))
        config = json.loads((base / "config.json").read_text())
        config.pop("rope_parameters", None)
        config.pop("rope_scaling", None)
        config.update(json.loads(json.dumps(entries)))
        config["max_position_embeddings"] = ROPE_SCALED_MAX_POSITIONS
        (out / "config.json").write_text(json.dumps(config, indent=1))

    return _crafted(f"rope-{kind}", {"base": asdict(spec), "config": entries,
                                     "max_positions": ROPE_SCALED_MAX_POSITIONS}, build)


def _perturbed_weights(base: Path, seed: int) -> dict[str, torch.Tensor]:
    """``base``'s tensors, each moved by its own seeded delta (see :func:`perturbed_model`)."""
    w = _weights(base)
    for name, t in w.items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        spread = float(t.float().std()) if t.numel() > 1 else 0.0
        scale = spread if spread > 1e-6 else 0.3
        w[name] = t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
    return w


def _perturb(base: Path, out: Path, seed: int) -> None:
    """``base``'s folder written to ``out`` with every tensor moved by its own seeded delta (see :func:`perturbed_model`)."""
    _copy_with_weights(base, out, _perturbed_weights(base, seed))


def perturbed_model(spec: TinyModelSpec, seed: int) -> Path:
    """``tiny_model(spec)`` with every tensor moved by its own seeded delta.

    Each delta has the tensor's own spread (0.3 for constant tensors such as norm weights), so no
    tensor keeps its value and two seeds differ everywhere: a receiver that leaves any one tensor
    out serves visibly different outputs.
    """
    return _crafted("perturbed", {"base": asdict(spec), "seed": seed},
                    lambda out: _perturb(tiny_model(spec), out, seed))


def perturbed_absolute_position_model(seed: int) -> Path:
    """:func:`absolute_position_model` (the GPT-2 folder) with every tensor moved like :func:`perturbed_model`'s."""
    return _crafted("perturbed-gpt2", {"base": "gpt2", "seed": seed},
                    lambda out: _perturb(absolute_position_model(), out, seed))


VALUE_HEAD_BIAS: Final = 0.5
"""The ``score.bias`` of :func:`value_bias_model` (exact in bfloat16 and float16)."""


def value_bias_model() -> Path:
    """The test kit's value-head folder with ``score.bias`` = :data:`VALUE_HEAD_BIAS`.

    transformers initialises a token-classification head's bias to 0, so on the value-head folder a
    critic that never loads ``score.bias`` computes the folder's values; here every value moves by
    the bias. Nothing else changes, so the values keep the value-head folder's magnitude and each
    dtype's rounding error (a folder with every tensor perturbed gives values whose bfloat16 error
    exceeds that dtype's tier).
    """
    spec = TinyModelSpec(head="value")

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _weights(base)
        w["score.bias"] = torch.full_like(w["score.bias"], VALUE_HEAD_BIAS)
        _copy_with_weights(base, out, w)

    return _crafted("value-bias", {"base": asdict(spec), "bias": VALUE_HEAD_BIAS}, build)


def nan_reward_model() -> Path:
    """The test kit's reward-model folder with a score head of NaN (every score is NaN)."""
    spec = TinyModelSpec(head="reward")

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _weights(base)
        w["score.weight"] = torch.full_like(w["score.weight"], float("nan"))
        _copy_with_weights(base, out, w)

    return _crafted("reward-nan", {"base": asdict(spec)}, build)


def headless_reward_model() -> Path:
    """The test kit's reward-model folder without ``score.weight``: its config still names
    ``LlamaForSequenceClassification``, but transformers would initialise the head at random."""
    spec = TinyModelSpec(head="reward")

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _weights(base)
        del w["score.weight"]
        _copy_with_weights(base, out, w)

    return _crafted("reward-headless", {"base": asdict(spec)}, build)


def two_label_reward_model() -> Path:
    """The test kit's reward-model folder with a score head of two labels: ``score.weight`` [2, hidden] (the
    folder's row, then its negation) and ``config.json``'s ``id2label`` naming two labels, as a two-class
    classifier's folder holds. A scalar reward has one label: an engine refuses it (reading row 0 would
    score with half of a classifier)."""
    spec = TinyModelSpec(head="reward")

    def build(out: Path) -> None:
        base = tiny_model(spec)
        w = _weights(base)
        w["score.weight"] = torch.cat([w["score.weight"], -w["score.weight"]])
        _copy_with_weights(base, out, w)
        config = json.loads((out / "config.json").read_text())
        config["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
        config["label2id"] = {"LABEL_0": 0, "LABEL_1": 1}
        (out / "config.json").write_text(json.dumps(config, indent=2))

    return _crafted("reward-two-labels", {"base": asdict(spec)}, build)


_VOCAB: Final = TinyModelSpec().vocab_size

OUT_OF_VOCAB_IDS: Final[dict[str, object]] = {
    "pad_token_id": _VOCAB,  # the first id past the table: nn.Embedding's padding_idx assertion
    "eos_token_id": [_EOS, _VOCAB + 3],  # a list, the real EOS first: one id the model can never emit
    "bos_token_id": -1,  # negative: no row either (-1 does not mean none)
}
"""What :func:`out_of_vocab_model` sets, by key: each id (or one id of a list) outside ``[0, vocab_size)``."""


def out_of_vocab_model(key: str, head: ModelHead = "causal_lm") -> Path:
    """The test kit's tiny Llama with head ``head`` whose ``config.json`` sets ``key`` to
    ``OUT_OF_VOCAB_IDS[key]`` (every other key, the weights and the tokenizer as in the folder).

    transformers builds ``nn.Embedding(..., padding_idx=pad_token_id)``, which asserts for a pad
    id past the table (a bare ``AssertionError``) and takes a negative one as a row counted from the
    end; an EOS the model cannot emit lets a rollout that stops on the config's EOS run to its
    limit. An engine must refuse each folder when it is built, with a ConfigError naming ``key``.

    Raises:
        KeyError: ``key`` is not a key of :data:`OUT_OF_VOCAB_IDS`.
    """
    if key not in OUT_OF_VOCAB_IDS:
        raise KeyError(f"no out-of-vocabulary folder for {key!r}; keys: {', '.join(OUT_OF_VOCAB_IDS)}")
    spec = TinyModelSpec(head=head)
    value = OUT_OF_VOCAB_IDS[key]

    def build(out: Path) -> None:
        base = tiny_model(spec)
        for f in base.iterdir():
            if f.is_file() and f.name != "verl_tiny_model.json":
                shutil.copy(f, out / f.name)
        config = json.loads((base / "config.json").read_text())
        config[key] = value
        (out / "config.json").write_text(json.dumps(config, indent=1))

    return _crafted(f"oov-{head}-{key}", {"base": asdict(spec), "config": {key: value}}, build)


OUT_OF_VOCAB_TOKEN: Final = "<|end|>"
"""The EOS token of the ``tokenizer-eos`` folder: ``tokenizer.json`` holds it as an added special token
with id ``vocab_size`` (a token added to the tokenizer without resizing the model's embedding)."""

OUT_OF_VOCAB_FILES: Final[dict[str, tuple[str, str, object]]] = {
    # the tokenizer's EOS is an added token past the embedding: transformers gives eos_token_id 128
    "tokenizer-eos": ("tokenizer_config.json", "eos_token", OUT_OF_VOCAB_TOKEN),
    # a list, the real EOS first: generation also stops on one id the model can never emit
    "generation-eos": ("generation_config.json", "eos_token_id", [_EOS, _VOCAB + 3]),
}
"""What :func:`out_of_vocab_file_model` sets, by folder name: ``(file, key, value)``, ``config.json``
untouched (its ids are all rows of the vocabulary)."""


def out_of_vocab_file_model(name: str, head: ModelHead = "causal_lm") -> Path:
    """The test kit's tiny Llama with head ``head`` whose ``config.json`` is right but whose tokenizer
    or ``generation_config.json`` sets a special token outside the vocabulary
    (``OUT_OF_VOCAB_FILES[name]``; the weights and every other file as in the folder).

    ``tokenizer-eos``: ``tokenizer.json`` gains :data:`OUT_OF_VOCAB_TOKEN` as a special token with id
    ``vocab_size`` and ``tokenizer_config.json`` names it ``eos_token`` (transformers loads a
    tokenizer whose ``eos_token_id`` is 128 with a 128-row model). ``generation-eos``:
    ``generation_config.json`` (written when the folder has none, as a reward model's) sets
    ``eos_token_id`` to a list holding an id past the vocabulary. A rollout stopping on either EOS
    never stops; an engine must refuse each folder when it is built, with a ConfigError naming the
    file and the key.

    Raises:
        KeyError: ``name`` is not a key of :data:`OUT_OF_VOCAB_FILES`.
    """
    if name not in OUT_OF_VOCAB_FILES:
        raise KeyError(f"no out-of-vocabulary folder {name!r}; names: {', '.join(OUT_OF_VOCAB_FILES)}")
    spec = TinyModelSpec(head=head)
    file, key, value = OUT_OF_VOCAB_FILES[name]

    def build(out: Path) -> None:
        base = tiny_model(spec)
        for f in base.iterdir():
            if f.is_file() and f.name != "verl_tiny_model.json":
                shutil.copy(f, out / f.name)
        if name == "tokenizer-eos":
            tok = json.loads((out / "tokenizer.json").read_text())
            tok["added_tokens"].append({"id": spec.vocab_size, "content": value, "single_word": False,
                                        "lstrip": False, "rstrip": False, "normalized": False, "special": True})
            (out / "tokenizer.json").write_text(json.dumps(tok, indent=1))
        target = out / file
        data = json.loads(target.read_text()) if target.exists() else {}
        data[key] = value
        target.write_text(json.dumps(data, indent=1))

    return _crafted(f"oov-{head}-{name}", {"base": asdict(spec), "file": [file, key, value]}, build)


FOLDER_EOS_LISTS: Final[dict[str, list[int]]] = {
    # the tokenizer's EOS first (as Llama 3 folders list theirs), then an id the EOS model emits at once
    # after a prompt ending in NEVER_EOS (31, 30, 31, ...)
    "config.json": [_EOS, NEVER_EOS + 1],
    # and one it emits as the third token after a prompt ending in EOS_LADDER_START (41, 42, 43, ...)
    "generation_config.json": [_EOS, EOS_LADDER_START + 3],
}
"""The ``eos_token_id`` lists of :func:`folder_defaults_model`, by file: the tokenizer's EOS (1) and one more
id each, ids the EOS model's greedy continuations emit early. Neither further id is a stop of a rollout."""

GENERATION_DEFAULTS: Final[dict[str, object]] = {
    "do_sample": True, "temperature": 0.05, "top_k": 1, "top_p": 0.5, "repetition_penalty": 1.5,
    "max_new_tokens": 2,
}
"""The sampling defaults :func:`folder_defaults_model` writes in ``generation_config.json``: each changes
what a rollout samples, or how long it runs, when honoured instead of ``SamplingParams``."""


def folder_defaults_model(base: Literal["eos", "llama"]) -> Path:
    """The EOS model (``base="eos"``, :func:`eos_model`) or the test kit's tiny Llama (``"llama"``) whose
    ``config.json`` and ``generation_config.json`` set ``eos_token_id`` to the lists of
    :data:`FOLDER_EOS_LISTS` and whose ``generation_config.json`` also sets :data:`GENERATION_DEFAULTS`;
    the weights, the tokenizer (EOS id 1) and every other key as in the base folder.

    A rollout stops on the tokenizer's EOS and ``SamplingParams.stop_token_ids`` alone and samples as
    ``SamplingParams`` says: on these folders it gives the base folder's tokens and log-probs. On the
    EOS model, a rollout that stops on a folder's EOS list ends the response after a prompt ending in
    :data:`NEVER_EOS` at its first token, and after one ending in :data:`EOS_LADDER_START` at its third;
    one that honours ``max_new_tokens`` 2 cuts every response at 2 tokens. On the tiny Llama (whose
    log-probs are not one-hot), one that honours the temperature, top-k, top-p or repetition penalty
    samples, or reports log-probs, other than on the base folder.

    Raises:
        KeyError: ``base`` is neither ``"eos"`` nor ``"llama"``.
    """
    bases: dict[str, Callable[[], Path]] = {"eos": eos_model, "llama": lambda: tiny_model(TinyModelSpec())}
    if base not in bases:
        raise KeyError(f"no folder-defaults folder on {base!r}; bases: {', '.join(bases)}")

    def build(out: Path) -> None:
        src = bases[base]()
        for f in src.iterdir():
            if f.is_file() and f.name not in ("verl_tiny_model.json", "verl_crafted_model.json"):
                shutil.copy(f, out / f.name)
        for file, eos in FOLDER_EOS_LISTS.items():
            target = out / file
            data = json.loads(target.read_text()) if target.exists() else {}
            data["eos_token_id"] = eos
            if file == "generation_config.json":
                data.pop("_from_model_config", None)  # a checkpoint's own file, as a Llama 3 folder ships it
                data.update(GENERATION_DEFAULTS)
            target.write_text(json.dumps(data, indent=1))

    recipe: dict[str, object] = {"base": base, "spec": asdict(TinyModelSpec()), "eos": FOLDER_EOS_LISTS,
                                 "defaults": GENERATION_DEFAULTS}
    return _crafted(f"folder-defaults-{base}", recipe, build)


class ShuffledTokenizer:
    """A test-kit folder's tokenizer under permuted ids: the same texts, other token ids.

    EOS and pad keep their ids (so only the vocabulary differs); every other id is reversed. It
    implements the verl_core Tokenizer protocol, without a vocabulary table, so
    ``same_vocabulary`` compares it id by id and finds it different.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._base: CharTokenizer = load_tokenizer(path)
        n = self._base.vocab_size
        fixed = {self._base.eos_token_id, self._base.pad_token_id}
        movable = [i for i in range(n) if i not in fixed]
        self._to = list(range(n))
        for a, b in zip(movable, reversed(movable), strict=True):
            self._to[a] = b
        self._from = [0] * n
        for a, b in enumerate(self._to):
            self._from[b] = a

    @property
    def eos_token_id(self) -> int:
        """The base tokenizer's EOS id."""
        return self._base.eos_token_id

    @property
    def pad_token_id(self) -> int:
        """The base tokenizer's pad id."""
        return self._base.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids."""
        return self._base.vocab_size

    def encode(self, text: str) -> list[int]:
        """The base ids of ``text``, permuted."""
        return [self._to[i] for i in self._base.encode(text)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of permuted ``ids``."""
        return self._base.decode([self._from[i] for i in ids], skip_special_tokens=skip_special_tokens)
