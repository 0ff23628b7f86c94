"""Position ids under left padding, on models where a wrong position id shows.

Rotary embeddings see only relative positions, so on the suite's Llama/Qwen models position ids
built with ``arange`` over a left-padded row (counting padding) give the right answer. Two crafted
folders do not forgive them:

* a GPT-2 with learned absolute position embeddings
  (:func:`verl_conformance.testkit.absolute_position_model`): every output moves;
* for rotary-only backends, the tiny Llama with LongRoPE scaling
  (:func:`verl_conformance.testkit.long_rope_model`), whose frequencies change past position 24:
  sequences of at most 24 real tokens, left-padded beyond it, stay in the trained range only when
  position ids count real tokens.

A backend that does not load a folder (an architecture or RoPE type it refuses with a ConfigError)
skips that check with the reason. So does a backend that computes LongRoPE otherwise than
transformers even on one unpadded sample, where positions cannot be wrong (vLLM applies the long
factors to every position once its max_model_len exceeds the trained range, which makes the model
shift-invariant again; its positions are its own, built from real tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_conformance.checks._registry import check
from verl_conformance.harness import Harness
from verl_conformance.reference import cached_outputs, greedy_reference
from verl_conformance.testkit import LONG_ROPE_TRAINED, near_tie_margin, random_batch, tolerance
from verl_core import ConfigError, SamplingParams, TensorBatch

_RESPONSE = 6


def left_padded_batch(seed: int, width: int, lengths: Sequence[int], responses: Sequence[int] | None = None) -> TensorBatch:
    """Samples whose prompts, left-padded to ``width`` columns, have ``lengths`` real tokens (and
    whose responses have ``responses`` real tokens, when given)."""
    b = random_batch(batch_size=len(lengths), max_prompt=width, max_response=max(responses or [_RESPONSE]), seed=seed)
    mask = b["prompt_mask"].clone()
    for i, n in enumerate(lengths):
        mask[i] = False
        mask[i, width - n:] = True
    b = b.update(prompt_mask=mask, prompt_ids=b["prompt_ids"].masked_fill(~mask, b.meta.pad_token_id))
    if responses is None:
        return b
    rmask = b["response_mask"].clone()
    for i, n in enumerate(responses):
        rmask[i] = False
        rmask[i, :n] = True
    return b.update(response_mask=rmask, response_ids=b["response_ids"].masked_fill(~rmask, b.meta.pad_token_id))


def _build(h: Harness, role: str, model: str, width: int) -> Any:
    """The subject's engine of ``role`` on ``model``; None when the role is missing, skip-worthy text when refused."""
    if not h.provides(h.subject, role):  # type: ignore[arg-type]
        return None
    limit = width + 8
    try:
        if role == "actor":
            return h.training(model=model, max_prompt_len=limit)
        return h.rollout(model, max_prompt_len=limit)
    except ConfigError as e:
        return f"{role}: {e}"


def _offsets(width: int, lengths: Sequence[int]) -> str:
    return f"prompts left-padded by {width - max(lengths)} to {width - min(lengths)} columns"


def _unpadded_disagreement(h: Harness, engine: Any, role: str, path: str, length: int) -> str | None:
    """How ``engine`` departs from the float64 reference on one unpadded sample (None: it agrees).

    Without padding, position ids are ``arange`` whichever way an engine builds them, so a
    difference here is the model's arithmetic (another reading of the folder's RoPE scaling), not
    its positions.
    """
    prompts = left_padded_batch(93, length, (length,), (_RESPONSE,))
    if role == "actor":
        got, mask = engine.forward(prompts, ["log_probs"])["log_probs"], prompts["response_mask"]
        ref = cached_outputs(path, prompts)["log_probs"]
    else:
        params = SamplingParams(temperature=1.0, max_new_tokens=_RESPONSE, seed=5)
        if not engine.log_probs_exact(params):
            return None
        out = engine.generate(prompts.select("prompt_ids", "prompt_mask", "group_ids"), params)
        got, mask = out["rollout_log_probs"], out["response_mask"]
        ref = cached_outputs(path, out)["log_probs"]
    tol = tolerance(h.dtype, "log_probs")
    keep = mask.cpu().bool()
    err = (got.detach().double().cpu() - ref.double()).abs()[keep]
    if not bool((err > tol.atol + tol.rtol * ref.double().abs()[keep]).any()):
        return None
    return f"{role}: log-probs off by up to {float(err.max()):.3g} on one unpadded sample ({h.dtype} tier: atol={tol.atol:g})"


def _positions_match_reference(h: Harness, model: str, what: str, width: int, lengths: Sequence[int], seed: int,
                               forward_lengths: tuple[Sequence[int], Sequence[int]] | None = None,
                               calibrate: bool = False) -> None:
    """Forward log-probs, rollout log-probs and greedy tokens of ``model`` on prompts of ``lengths``
    real tokens left-padded to ``width`` columns equal the float64 reference (each sample alone).

    ``forward_lengths``: the prompt and response lengths of the forward's batch instead (default:
    ``lengths`` and random responses). ``calibrate``: first compare each engine with the reference
    on one unpadded sample, and leave out (as refused) an engine that computes the model otherwise.
    """
    actor, rollout = _build(h, "actor", model, width), _build(h, "rollout", model, width)
    if calibrate:
        path = h.model_path(model)
        if actor is not None and not isinstance(actor, str):
            actor = _unpadded_disagreement(h, actor, "actor", path, max(lengths)) or actor
        if rollout is not None and not isinstance(rollout, str):
            rollout = _unpadded_disagreement(h, rollout, "rollout", path, max(lengths)) or rollout
    if actor is None and rollout is None:
        h.skip(f"backend {h.subject.name!r} provides neither a training nor a rollout engine")
    refused = [e for e in (actor, rollout) if isinstance(e, str)]
    if len(refused) == sum(e is not None for e in (actor, rollout)):
        h.skip(f"the {what} folder ({model}), which this check needs, cannot show this backend's position ids "
               "(refused, or computed otherwise than transformers without any padding): " + "; ".join(refused))
    path = h.model_path(model)
    if actor is not None and not isinstance(actor, str):
        batch = left_padded_batch(seed, width, *(forward_lengths or (lengths, None)))
        got = actor.forward(batch, ["log_probs"])["log_probs"]
        ref = cached_outputs(path, batch)["log_probs"]
        h.close_to(got, ref, "log_probs",
                   f"forward log_probs of the {what} model, {_offsets(width, (forward_lengths or (lengths,))[0])}, vs the float64 reference (position ids "
                   "must be cumsum(mask) - 1, not arange over the padded row)",
                   mask=batch["response_mask"])
    if rollout is not None and not isinstance(rollout, str):
        prompts = left_padded_batch(seed + 1, width, lengths).select("prompt_ids", "prompt_mask", "group_ids")
        params = SamplingParams(temperature=1.0, max_new_tokens=_RESPONSE, seed=5)
        if rollout.log_probs_exact(params):
            out = rollout.generate(prompts, params)
            ref = cached_outputs(path, out)["log_probs"]
            h.close_to(out["rollout_log_probs"], ref, "log_probs",
                       f"rollout_log_probs of the {what} model, {_offsets(width, lengths)}, vs the float64 reference (prefill and "
                       "decode positions must count real tokens only)",
                       mask=out["response_mask"])
        out = rollout.generate(prompts, SamplingParams(greedy=True, max_new_tokens=_RESPONSE))
        margin = near_tie_margin(h.dtype)
        eos = rollout.tokenizer.eos_token_id
        for b in range(out.batch_size):
            prompt = out["prompt_ids"][b][out["prompt_mask"][b]]
            toks = out["response_ids"][b][out["response_mask"][b]].tolist()
            want, decided = greedy_reference(path, prompt, _RESPONSE, {eos}, margin=margin)
            n = min(decided, len(want))
            h.expect(toks[:n] == want[:n],
                     f"greedy sample {b} of the {what} model (left padding "
                     f"{int((~out['prompt_mask'][b]).sum())}): got {toks}, the float64 reference gives {want}")


@check("invariance")
def check_positions_under_left_padding(h: Harness) -> None:
    """On a model with absolute position embeddings, log-probs (forward) and generated tokens and log-probs (generate) under left-padding offsets of 0 to 39 equal the float64 reference: position ids count real tokens only."""
    _positions_match_reference(h, "gpt2", "absolute-position", 40, (40, 1, 13, 27, 4, 33), seed=90)


# Sequences stay within the trained range (at most LONG_ROPE_TRAINED tokens: the model's own
# frequencies, as in the reference, which runs each sample alone) while arange positions leave it,
# even in an engine that first trims the batch's padding columns: the forward batch pairs the
# longest prompt (16) with an empty response and the longest response (12) with a one-token prompt,
# so a trimmed row is 28 wide but no sequence is longer than 18. The rollout's prompts plus their
# 6 new tokens stay within the range too.
_ROTARY_WIDTH = 40
_ROTARY_FORWARD = ((16, 1, 9, 4, 12, 6), (0, 12, 5, 9, 3, 12))
_ROTARY_PROMPTS = (18, 1, 9, 4, 12, 6)
assert max(p + r for p, r in zip(*_ROTARY_FORWARD, strict=True)) <= LONG_ROPE_TRAINED < sum(map(max, _ROTARY_FORWARD))
assert max(_ROTARY_PROMPTS) + _RESPONSE <= LONG_ROPE_TRAINED


@check("invariance")
def check_rotary_positions_under_left_padding(h: Harness) -> None:
    """On a rotary (LongRoPE) Llama whose frequencies change past position 24, forward log-probs and generated tokens and log-probs of sequences of at most 24 tokens, left-padded beyond it, equal the float64 reference: position ids count real tokens only."""
    _positions_match_reference(h, "llama-longrope", "rotary LongRoPE", _ROTARY_WIDTH, _ROTARY_PROMPTS, seed=92,
                               forward_lengths=_ROTARY_FORWARD, calibrate=True)


def _absolute_position_engine(h: Harness, role: str, *, fresh: bool = False) -> Any:
    """An engine of ``role`` on the GPT-2 folder; skips where the role is missing or the backend refuses GPT-2."""
    if not h.provides(h.subject, role):  # type: ignore[arg-type]
        h.skip(f"backend {h.subject.name!r} provides no {'training' if role == 'actor' else role} engine")
    try:
        if role == "actor":
            return h.training(model="gpt2", fresh=fresh)
        return h.rollout("gpt2", fresh=fresh)
    except ConfigError as e:
        h.skip(f"the backend refuses the GPT-2 folder (learned absolute positions, Conv1D layout, tied head), "
               f"which this check needs: {e}")


@check("numerics")
def check_absolute_position_model_update(h: Harness) -> None:
    """On the GPT-2 folder (learned absolute positions, fused q/k/v, tied head), one update's loss, grad norm and every gradient (position table included) equal the float64 reference; a backend that refuses GPT-2 skips."""
    from verl_conformance.checks.numerics import compare_update
    from verl_conformance.losses import suite_losses

    _absolute_position_engine(h, "actor")  # the cached engine: does the backend take GPT-2 at all
    compare_update(h, suite_losses()[0], "gpt2", h.batch(seed=94, rl_fields=True))


@check("weight_sync", gates=("rollout.weight_update",))
def check_absolute_position_model_sync(h: Harness) -> None:
    """A rollout engine on the GPT-2 folder, synced with a stream of the same model with every tensor changed, serves the sent weights (rollout_log_probs equal the float64 reference of the sent folder); a backend that refuses GPT-2 skips."""
    from verl_conformance.checks.weight_sync import folder_stream

    engine = _absolute_position_engine(h, "rollout", fresh=True)  # its weights are overwritten
    if not engine.capabilities.weight_update:
        h.skip("backend declares weight_update=False")
    params = SamplingParams(temperature=1.0, max_new_tokens=_RESPONSE, seed=7)
    if not engine.log_probs_exact(params):
        h.skip("rollout_log_probs are declared inexact at temperature 1; cannot tell which weights serve")
    # the folder's head is tied to its token embedding: the stream leaves lm_head out, as a trainer's does
    engine.update_weights(folder_stream(h.model_path("gpt2-perturbed"), 3, dtype=engine.weight_dtype, tied=True))
    prompts = left_padded_batch(95, 10, (10, 3, 7, 1)).select("prompt_ids", "prompt_mask", "group_ids")
    out = engine.generate(prompts, params)
    ref = cached_outputs(h.model_path("gpt2-perturbed"), out)["log_probs"]
    h.close_to(out["rollout_log_probs"], ref, "log_probs",
               "after update_weights(a stream of the GPT-2 folder with every tensor changed): rollout_log_probs vs "
               "the float64 reference of the sent weights (a tensor of the stream not applied leaves the old one "
               "serving)", mask=out["response_mask"])


_TABLE = 512  # n_positions of the test kit's GPT-2 folder


@check("robustness")
def check_position_table_limit_refused(h: Harness) -> None:
    """An engine on the GPT-2 folder (a learned table of 512 positions) asked for max_prompt_len + max_response_len = 600 + 8 refuses at build with ConfigError, instead of indexing past the table on its first long batch; a backend that refuses GPT-2 skips."""
    tested = False
    for role in ("actor", "rollout"):
        if not h.provides(h.subject, role):
            continue
        try:
            h.training(model="gpt2") if role == "actor" else h.rollout("gpt2")
        except ConfigError:
            continue  # GPT-2 refused at any length
        tested = True
        try:
            if role == "actor":
                h.training(model="gpt2", fresh=True, max_prompt_len=600, max_response_len=8)
            else:
                h.rollout("gpt2", fresh=True, max_prompt_len=600, max_response_len=8)
        except ConfigError:
            continue
        h.expect(False, f"the {role} engine built on the GPT-2 folder (n_positions={_TABLE}) with max_prompt_len + "
                 "max_response_len = 608: a spec whose sequences cannot fit the model's learned position table must "
                 "be refused at build with ConfigError")
    if not tested:
        h.skip("the backend refuses the GPT-2 folder (learned absolute positions), or provides neither a training "
               "nor a rollout engine")
