"""Position ids under left padding, on a model where a wrong position id shows.

Rotary embeddings see only relative positions, so on the suite's Llama/Qwen models position ids
built with ``arange`` over a left-padded row (counting padding) give the right answer. A GPT-2 with
learned absolute position embeddings (:func:`verl_conformance.testkit.absolute_position_model`) does
not forgive them: every output moves. Backends that do not load GPT-2 folders (an architecture
they refuse with a ConfigError) skip this check with the reason.
"""

from __future__ import annotations

from typing import Any

from verl_conformance.checks._registry import check
from verl_conformance.harness import Harness
from verl_conformance.reference import cached_outputs, greedy_reference
from verl_conformance.testkit import random_batch, tolerance
from verl_core import ConfigError, SamplingParams

_PROMPT = 40  # padded prompt width: offsets up to 39 columns
_RESPONSE = 6


def _batch(seed: int) -> Any:
    """Six samples whose prompts have 40 (no padding) down to 1 real tokens: left-padding offsets 0 to 39."""
    b = random_batch(batch_size=6, max_prompt=_PROMPT, max_response=_RESPONSE, seed=seed)
    lengths = [40, 1, 13, 27, 4, 33]
    mask = b["prompt_mask"].clone()
    for i, n in enumerate(lengths):
        mask[i] = False
        mask[i, _PROMPT - n:] = True
    return b.update(prompt_mask=mask, prompt_ids=b["prompt_ids"].masked_fill(~mask, b.meta.pad_token_id))


def _build(h: Harness, role: str) -> Any:
    """The subject's engine of ``role`` on the GPT-2 folder; None when the role is missing, skip-worthy text when refused."""
    if not h.provides(h.subject, role):  # type: ignore[arg-type]
        return None
    limit = _PROMPT + 8
    try:
        if role == "actor":
            return h.training(model="gpt2", max_prompt_len=limit)
        return h.rollout("gpt2", max_prompt_len=limit)
    except ConfigError as e:
        return f"{role}: {e}"


@check("invariance")
def check_positions_under_left_padding(h: Harness) -> None:
    """On a model with absolute position embeddings, log-probs (forward) and generated tokens and log-probs (generate) under left-padding offsets of 0 to 39 equal the float64 reference: position ids count real tokens only."""
    actor, rollout = _build(h, "actor"), _build(h, "rollout")
    if actor is None and rollout is None:
        h.skip(f"backend {h.subject.name!r} provides neither a training nor a rollout engine")
    refused = [e for e in (actor, rollout) if isinstance(e, str)]
    if len(refused) == sum(e is not None for e in (actor, rollout)):
        h.skip("the backend does not load GPT-2 folders (learned absolute positions), which this check needs: "
               + "; ".join(refused))
    path = h.model_path("gpt2")
    if actor is not None and not isinstance(actor, str):
        batch = _batch(seed=90)
        got = actor.forward(batch, ["log_probs"])["log_probs"]
        ref = cached_outputs(path, batch)["log_probs"]
        h.close_to(got, ref, "log_probs",
                   "forward log_probs of the absolute-position model, prompts left-padded by 0 to 39 columns, vs "
                   "the float64 reference (position ids must be cumsum(mask) - 1, not arange over the padded row)",
                   mask=batch["response_mask"])
    if rollout is not None and not isinstance(rollout, str):
        prompts = _batch(seed=91).select("prompt_ids", "prompt_mask", "group_ids")
        params = SamplingParams(temperature=1.0, max_new_tokens=_RESPONSE, seed=5)
        if rollout.log_probs_exact(params):
            out = rollout.generate(prompts, params)
            ref = cached_outputs(path, out)["log_probs"]
            h.close_to(out["rollout_log_probs"], ref, "log_probs",
                       "rollout_log_probs of the absolute-position model, prompts left-padded by 0 to 39 columns, "
                       "vs the float64 reference (prefill and decode positions must count real tokens only)",
                       mask=out["response_mask"])
        out = rollout.generate(prompts, SamplingParams(greedy=True, max_new_tokens=_RESPONSE))
        margin = max(1e-4, 2 * tolerance(h.dtype, "log_probs").atol)
        eos = rollout.tokenizer.eos_token_id
        for b in range(out.batch_size):
            prompt = out["prompt_ids"][b][out["prompt_mask"][b]]
            toks = out["response_ids"][b][out["response_mask"][b]].tolist()
            want, decided = greedy_reference(path, prompt, _RESPONSE, {eos}, margin=margin)
            n = min(decided, len(want))
            h.expect(toks[:n] == want[:n],
                     f"greedy sample {b} of the absolute-position model (left padding "
                     f"{int((~out['prompt_mask'][b]).sum())}): got {toks}, the float64 reference gives {want}")
