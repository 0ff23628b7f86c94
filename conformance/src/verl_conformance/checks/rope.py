"""RoPE scaling and other config keys: a backend honours what its folder's config declares, or refuses the folder.

A backend that reads ``rope_theta`` but not the scaling (``rope_parameters.rope_type`` in
transformers 5 configs, ``rope_scaling`` in transformers 4 ones) computes the model of another
config, and nothing else in the suite shows it: the other folders use plain RoPE. The test kit's
:func:`~verl_conformance.testkit.rope_scaled_model` folders are the tiny Llama under each common
scaling (linear, linear in the transformers 4 format, YaRN, Llama 3, LongRoPE with its default
attention factor); each moves the log-probs by nats past position
:data:`~verl_conformance.testkit.LONG_ROPE_TRAINED` (24) when ignored.

Every sequence here is longer than 24 tokens from its prompt on, so the scalings whose
frequencies depend on the length (LongRoPE) use the long factors everywhere, whether an engine
decides per sequence, per batch, at prefill or from its maximum model length.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.positions import left_padded_batch
from verl_conformance.harness import Harness
from verl_conformance.reference import cached_outputs
from verl_conformance.testkit import (
    CONFIG_CONSTANTS,
    LONG_ROPE_TRAINED,
    OMITTED_KEYS,
    OTHER_ACTIVATION,
    ROPE_SCALINGS,
    SLIDING_WINDOW,
    near_tie_margin,
    without_folders,
)
from verl_core import ConfigError, SamplingParams, TensorBatch

_PROMPTS = (30, 26, 33)
"""Real prompt tokens of each sample: every prompt is already past position 24."""
_RESPONSES = (6, 1, 9)
"""Real response tokens of each sample of the forward batch."""
_NEW_TOKENS = 6
_WIDTH = max(_PROMPTS)
_MAX_PROMPT = 48
assert min(_PROMPTS) > LONG_ROPE_TRAINED and _WIDTH <= _MAX_PROMPT


def _scaling(kind: str) -> str:
    """What the folder of ``kind`` declares, for messages (``rope_type 'yarn', factor 4.0, ...``)."""
    entries = ROPE_SCALINGS[kind]
    raw = entries.get("rope_parameters") or entries.get("rope_scaling")
    assert isinstance(raw, dict)
    key = "rope_parameters" if "rope_parameters" in entries else "rope_scaling"
    parts = [f"{k} {v!r}" for k, v in raw.items() if k in ("rope_type", "type", "factor")]
    return f"{key}: {', '.join(parts)}"


def _names_scaling(message: str, kind: str) -> bool:
    """Whether a refusal names RoPE or the rope type it refuses (the folder's path and name aside)."""
    text = without_folders(message).lower()
    rope_type = kind.removesuffix("-legacy")
    return "rope" in text or rope_type in text


def _build(h: Harness, role: str, model: str, kind: str) -> Any:
    """The subject's fresh engine of ``role`` on ``model``, or the refusal's text (a ConfigError)."""
    try:
        return _fresh_engine(h, role, model)
    except ConfigError as e:
        if not _names_scaling(str(e), kind):
            h.fail(f"the {role} engine refused the folder {model} ({_scaling(kind)}) with a ConfigError that names "
                   f"neither RoPE nor {kind.removesuffix('-legacy')!r}: {e}; say which rope scaling is not supported")
        return str(e)
    except Exception as e:
        h.fail(f"building the {role} engine on the folder {model} ({_scaling(kind)}) raised {type(e).__name__}: {e}; "
               "a backend that does not implement a folder's RoPE scaling must refuse it with verl_core.ConfigError "
               "naming the rope type")


def _advice(kind: str) -> str:
    return (f"the folder declares {_scaling(kind)}: apply it as transformers does, or refuse the folder with a "
            "ConfigError when the engine is built")


def _forward(h: Harness, engine: Any, model: str, advice: str, seed: int = 95) -> None:
    """Forward log-probs of a left-padded batch past position 24 against the float64 reference."""
    batch = left_padded_batch(seed, _WIDTH, _PROMPTS, _RESPONSES)
    got = engine.forward(batch, ["log_probs"])["log_probs"]
    ref = cached_outputs(h.model_path(model), batch)["log_probs"]
    h.close_to(got, ref, "log_probs",
               f"forward log_probs on {model}, sequences of {min(_PROMPTS)} to {_WIDTH + max(_RESPONSES)} tokens, vs "
               f"the float64 reference ({advice})", mask=batch["response_mask"])


def _generate(h: Harness, engine: Any, model: str, advice: str, seed: int = 96) -> None:
    """Greedy tokens that are the reference's argmax after their own prefix, and (where exact) their log-probs."""
    prompts = left_padded_batch(seed, _WIDTH, _PROMPTS).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(greedy=True, temperature=1.0, max_new_tokens=_NEW_TOKENS)
    out = engine.generate(prompts, params)
    ref = cached_outputs(h.model_path(model), out, ("log_probs", "max_log_probs"))
    greedy_tokens_match(h, out, ref, f"greedy tokens on {model}, prompts of {min(_PROMPTS)} to {_WIDTH} tokens "
                        f"({advice})")
    if engine.log_probs_exact(params):
        h.close_to(out["rollout_log_probs"], ref["log_probs"], "log_probs",
                   f"rollout_log_probs of greedy samples on {model}, prompts of {min(_PROMPTS)} to {_WIDTH} tokens, "
                   f"vs the float64 reference ({advice})", mask=out["response_mask"])


def greedy_tokens_match(h: Harness, out: TensorBatch, ref: dict[str, Tensor], what: str) -> None:
    """Fail unless each greedy token is the reference's most likely token after the same prefix.

    ``ref`` holds the reference's ``log_probs`` and ``max_log_probs`` of ``out``'s samples. A token
    whose log-prob is within the dtype's margin of the maximum is a near tie either choice passes.
    """
    margin = near_tie_margin(h.dtype)
    mask = out["response_mask"].cpu()
    short = (ref["max_log_probs"] - ref["log_probs"]) > margin
    bad = (short & mask).nonzero()
    if bad.numel():
        b, t = (int(i) for i in bad[0])
        toks = out["response_ids"][b][mask[b]].tolist()
        h.fail(f"{what}: sample {b} took token {toks[t]} at step {t} (response {toks}), whose reference log-prob "
               f"{float(ref['log_probs'][b, t]):.5g} is below the most likely token's {float(ref['max_log_probs'][b, t]):.5g}")


@check("numerics")
def check_rope_scaling_matches_reference(h: Harness) -> None:
    """On Llamas whose config declares a RoPE scaling (linear, also in the transformers 4 format, YaRN, Llama 3, LongRoPE), forward log-probs, greedy tokens and their rollout log-probs past position 24 equal the float64 reference; a scaling the backend does not implement is refused with a ConfigError naming it."""
    roles = [role for role in ("actor", "rollout") if h.provides(h.subject, role)]
    if not roles:
        h.skip(f"backend {h.subject.name!r} provides neither a training nor a rollout engine")
    refused: dict[str, list[str]] = {}  # refusal -> "role on folder" (one line per folder and message)
    outcome: dict[str, dict[str, list[str]]] = {role: {"compared": [], "refused": []} for role in roles}
    for kind in ROPE_SCALINGS:
        model = f"llama-rope-{kind}"
        for role in roles:
            engine = _build(h, role, model, kind)
            if isinstance(engine, str):
                refused.setdefault(engine, []).append(f"{role} on {model}")
                outcome[role]["refused"].append(kind)
                continue
            if role == "actor":
                _forward(h, engine, model, _advice(kind))
            else:
                _generate(h, engine, model, _advice(kind))
            outcome[role]["compared"].append(kind)
            h.close_fresh()  # one engine at a time (a rollout engine may hold a KV cache)
    if sum(map(len, refused.values())) == len(roles) * len(ROPE_SCALINGS):
        h.skip("the backend refuses every RoPE-scaled folder (with a ConfigError naming the scaling): "
               + "; ".join(f"{' and '.join(where)}: {why}" for why, where in refused.items()))
    h.note(_summary(outcome))


def _summary(outcome: dict[str, dict[str, list[str]]]) -> str:
    """What a pass compared with the reference and what it refused, by scaling (and role where they differ):
    ``compared: linear, longrope; refused (ConfigError naming RoPE): yarn, llama3``."""

    def line(kinds: dict[str, list[str]]) -> str:
        parts = [f"compared: {', '.join(kinds['compared']) or 'none'}"]
        if kinds["refused"]:
            parts.append(f"refused (ConfigError naming RoPE): {', '.join(kinds['refused'])}")
        return "; ".join(parts)

    lines = {role: line(kinds) for role, kinds in outcome.items()}
    if len(set(lines.values())) == 1:
        return f"{' and '.join(lines)}: {next(iter(lines.values()))}"
    return "; ".join(f"{role}: {text}" for role, text in lines.items())


@check("numerics")
def check_config_constants_match_reference(h: Harness) -> None:
    """On a Llama, a Qwen2 and a Qwen3 folder whose configs set rope_theta 500 and rms_norm_eps 0.05 (every other folder has the usual 10000 and 1e-6), forward log-probs and greedy tokens with their rollout log-probs equal the float64 reference: the engine reads both from each family's config, never a hard-coded default. A rollout engine may refuse a Qwen family with a ConfigError naming its model_type (listed in the pass); the actor may not."""
    roles = [role for role in ("actor", "rollout") if h.provides(h.subject, role)]
    if not roles:
        h.skip(f"backend {h.subject.name!r} provides neither a training nor a rollout engine")
    advice = (f"the folder's config sets {', '.join(f'{k} {v}' for k, v in CONFIG_CONSTANTS.items())}: read them "
              "from the config (rope_theta inside rope_parameters in transformers 5 configs), not the usual defaults")
    refused: list[str] = []
    for role in roles:
        for model, model_type in _CONSTANTS_FOLDERS:
            if role == "actor":
                _forward(h, h.training(model=model, fresh=True, max_prompt_len=_MAX_PROMPT), model, advice, seed=97)
            else:
                build = partial(h.rollout, model, fresh=True, max_prompt_len=_MAX_PROMPT)
                engine = build() if model_type == "llama" else h.unless_refused(
                    build, kind="rollout", what=model, model_type=model_type)
                if engine is None:
                    refused.append(f"the rollout engine refused {model_type}")
                else:
                    _generate(h, engine, model, advice, seed=98)
            h.close_fresh()
    if refused:
        h.note("; ".join(refused))


_CONSTANTS_FOLDERS = (("llama-constants", "llama"), ("qwen2-constants", "qwen2"), ("qwen3-constants", "qwen3"))
"""The folders of :func:`check_config_constants_match_reference` and their model types."""


def _policy_roles(h: Harness) -> list[str]:
    """The actor and rollout roles the subject provides (skips the check when it provides neither)."""
    roles = [role for role in ("actor", "rollout") if h.provides(h.subject, role)]
    if not roles:
        h.skip(f"backend {h.subject.name!r} provides neither a training nor a rollout engine")
    return roles


def _fresh_engine(h: Harness, role: str, model: str) -> Any:
    """A fresh actor or rollout engine of the subject on ``model``."""
    if role == "actor":
        return h.training(model=model, fresh=True, max_prompt_len=_MAX_PROMPT)
    return h.rollout(model, fresh=True, max_prompt_len=_MAX_PROMPT)


def _matches_reference(h: Harness, role: str, engine: Any, model: str, advice: str, seed: int) -> None:
    """The actor's forward (``seed``) or the rollout's greedy tokens (``seed + 1``) against the float64
    reference, then the engine closed."""
    if role == "actor":
        _forward(h, engine, model, advice, seed=seed)
    else:
        _generate(h, engine, model, advice, seed=seed + 1)
    h.close_fresh()


_FAMILY_HINT = ("; this refusal names the model family: the actor, the reference and the rollout must load every "
                "llama, qwen2 and qwen3 folder (writing-a-backend.md, Model types), refusing only the setting they "
                "do not implement")


def _family_hint(message: str) -> str:
    """:data:`_FAMILY_HINT` where a refusal names a model family or ``model_type`` rather than a setting."""
    text = without_folders(message).lower()
    return _FAMILY_HINT if any(word in text for word in ("model_type", "qwen2", "qwen3", "llama")) else ""


def _honoured_or_refused(h: Harness, model: str, names: tuple[str, ...], advice: str, seed: int) -> None:
    """The actor's forward and the rollout's greedy tokens on ``model`` equal the float64 reference, or the
    engine refuses the folder with a ConfigError whose message holds one of ``names`` (lower case; noted);
    each role provided decides."""
    refused = []
    for role in _policy_roles(h):
        try:
            engine = _fresh_engine(h, role, model)
        except ConfigError as e:
            h.expect(any(word in without_folders(str(e)).lower() for word in names), f"the {role} engine refused {model} with a "
                     f"ConfigError that names none of {list(names)}: {str(e)[:300]}; {advice}{_family_hint(str(e))}")
            refused.append(role)
            continue
        _matches_reference(h, role, engine, model, advice, seed)
    if refused:
        h.note(f"refused by the {' and the '.join(refused)} (ConfigError naming {names[0]})")


@check("numerics")
def check_omitted_config_keys_take_family_defaults(h: Harness) -> None:
    """On a Llama and a Qwen3 folder whose config.json leaves out the keys transformers fills from the family's defaults (head_dim, num_key_value_heads, rms_norm_eps, the RoPE entry, tie_word_embeddings, attention_bias, hidden_act, and Qwen3's sliding-window keys; the Qwen3's heads are 128 wide, its head_dim default, not hidden_size / heads = 32; the embedding scaled so that an rms_norm_eps other than 1e-6 moves the outputs by nats), forward log-probs and greedy tokens with their rollout log-probs equal the float64 reference, or the engine refuses the folder with a ConfigError naming an omitted key (a rollout engine may instead name qwen3, as in config_constants_match_reference; listed in the pass). The actor and the rollout engine, where provided, each decide."""
    roles = _policy_roles(h)
    refused: list[str] = []
    for model, arch in _OMITTED_FOLDERS:
        keys = OMITTED_KEYS[arch]
        advice = (f"the folder's config.json leaves out {', '.join(keys)}: read it as transformers 5 does (the "
                  f"{arch} config class's defaults: see 'Keys a config may omit' in the backend guide), or refuse "
                  "the folder with a ConfigError naming the key")
        for role in roles:
            try:
                engine = _fresh_engine(h, role, model)
            except ConfigError as e:
                said = without_folders(str(e)).lower()
                names = keys + ((arch,) if role == "rollout" and arch != "llama" else ())
                h.expect(any(word in said for word in names), f"the {role} engine refused {model} with a "
                         f"ConfigError that names none of {list(names)}: {str(e)[:300]}; {advice}"
                         f"{_family_hint(str(e))}")
                refused.append(f"the {role} engine refused {model}")
                continue
            _matches_reference(h, role, engine, model, advice, seed=103)
    if refused:
        h.note("; ".join(refused))


_OMITTED_FOLDERS = (("llama-omitted-keys", "llama"), ("qwen3-omitted-keys", "qwen3"))
"""The folders of :func:`check_omitted_config_keys_take_family_defaults` and their families."""


@check("numerics")
def check_sharded_folder_loads(h: Harness) -> None:
    """On the tiny Llama saved as a sharded folder (three model-0000k-of-00003.safetensors files and a model.safetensors.index.json naming each tensor's file, no model.safetensors; every tensor moved, the embedding in the first file and the lm_head in the last), forward log-probs and greedy tokens with their rollout log-probs equal the float64 reference: an engine reads every safetensors file of a folder (real checkpoints past a few GB are sharded). The actor and the rollout engine, where provided; a refusal fails."""
    roles = _policy_roles(h)
    model = "llama-sharded"
    advice = ("the folder holds its weights in three model-0000k-of-00003.safetensors files listed by "
              "model.safetensors.index.json: read every *.safetensors file of the folder (or the index's weight_map), "
              "as transformers does")
    for role in roles:
        try:
            engine = _fresh_engine(h, role, model)
        except ConfigError as e:
            h.fail(f"the {role} engine refused {model}: {str(e)[:300]}; {advice}")
        _matches_reference(h, role, engine, model, advice, seed=105)


@check("numerics")
def check_hidden_act_honoured_or_refused(h: Harness) -> None:
    """On the tiny Llama with hidden_act gelu_pytorch_tanh instead of silu (same weights; transformers applies the activation the config names), forward log-probs and greedy tokens with their rollout log-probs equal the float64 reference, or the engine refuses the folder with a ConfigError naming hidden_act (listed in the pass): never SiLU hard-coded. The actor and the rollout engine, where provided, each decide."""
    _honoured_or_refused(h, "llama-gelu", ("hidden_act",),
                         f"the folder's config sets hidden_act {OTHER_ACTIVATION!r}: apply the activation the config "
                         "names (transformers.activations.ACT2FN), or refuse the folder with a ConfigError naming "
                         "hidden_act", seed=99)


@check("numerics")
def check_sliding_window_honoured_or_refused(h: Harness) -> None:
    """On the tiny Qwen2 with sliding-window attention on every layer (use_sliding_window, sliding_window 8, layer_types all sliding_attention; same weights), forward log-probs of left-padded sequences of 26 to 42 tokens and greedy tokens with their rollout log-probs equal the float64 reference, or the engine refuses the folder with a ConfigError naming sliding_window or sliding(-)window attention (listed in the pass): never full attention over a folder that declares a window. The actor and the rollout engine, where provided, each decide; each refuses with a ConfigError naming layer_types (or sliding-window attention, where it has none) the folder whose layer_types marks sliding_attention layers while use_sliding_window is false."""
    _honoured_or_refused(h, "qwen2-sliding", ("sliding_window", "sliding window", "sliding-window"),
                         f"the folder's config sets use_sliding_window with sliding_window {SLIDING_WINDOW} on every "
                         "layer (layer_types sliding_attention): attend to the last sliding_window positions only, "
                         "or refuse the folder with a ConfigError naming sliding_window", seed=101)
    advice = ("its layer_types marks every layer sliding_attention while use_sliding_window is false: transformers "
              "sets sliding_window to None and its forward fails, so no computation is the folder's; refuse it "
              "with a ConfigError naming layer_types (verl_core.enginekit.model_folder.check_layer_types)")
    for role in _policy_roles(h):
        try:
            _fresh_engine(h, role, "qwen2-sliding-windowless")
        except ConfigError as e:
            said = without_folders(str(e)).lower()  # an engine without sliding windows may say so instead
            h.expect(any(word in said for word in ("layer_types", "sliding_window", "sliding window", "sliding-window")),
                     f"the {role} engine refused qwen2-sliding-windowless with a ConfigError that names neither "
                     f"layer_types nor sliding-window attention: {str(e)[:300]}; {advice}{_family_hint(str(e))}")
            continue
        h.fail(f"the {role} engine built on qwen2-sliding-windowless: {advice}")
