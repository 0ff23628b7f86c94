"""Sampling: the tokens a rollout samples follow the distribution whose log-probs it reports.

The other checks compare ``rollout_log_probs`` with the reference and the *seeded* samples with
themselves, but never the sampled tokens with a distribution: an engine that samples at one
temperature and reports log-probs at another, or samples greedily while reporting the softmax,
passes them. Here one prompt is sampled many times for one token and the empirical distribution
is compared with the one the engine reports, by the L1 distance over a few bins.
"""

from __future__ import annotations

import math
from typing import Any, Final

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.harness import Harness
from verl_conformance.reference import cached_model
from verl_conformance.testkit import random_batch, tolerance
from verl_core import SamplingParams, TensorBatch
from verl_core.enginekit.sampling import kept_probs

SAMPLES: Final = 2048
"""Samples of one token per sampling configuration."""
MAX_FALSE_FAILURE: Final = 1e-6
"""Bound on the probability that a correct engine fails a configuration (over the sampler's randomness)."""
_BINS: Final = 6
"""Most likely tokens (of the reference) counted one by one; the other tokens share one more bin."""
_TEMPERATURE: Final = 0.5
_PROMPT_SEED: Final = 2  # a prompt whose next-token distribution at T=0.5 has a clear head (0.20, 0.16, 0.13, ...)
_SEED: Final = 7


def l1_bound(samples: int, bins: int, failure: float = MAX_FALSE_FAILURE) -> float:
    """The L1 distance a correct sampler exceeds with probability below ``failure``.

    For ``samples`` independent draws from a distribution ``p`` over ``bins`` categories, the
    empirical distribution ``q`` satisfies ``P(|q - p|_1 >= e) <= (2**bins - 2) * exp(-samples * e**2 / 2)``
    (Weissman, Ordentlich, Seroussi, Verdu and Weinberger, 2003); solved for ``e`` at ``failure``.
    """
    return math.sqrt(2.0 * math.log((2**bins - 2) / failure) / samples)


def _prompt() -> TensorBatch:
    b = random_batch(batch_size=1, max_prompt=8, seed=_PROMPT_SEED)
    return b.select("prompt_ids", "prompt_mask", "group_ids")


def _reference_probs(h: Harness, prompt: TensorBatch, params: SamplingParams) -> Tensor:
    """The float64 reference's distribution of the first token under ``params`` (kept and renormalised)."""
    ids = prompt["prompt_ids"][0][prompt["prompt_mask"][0]]
    lp = cached_model(h.model_path("llama")).next_token_log_probs(ids, 1.0)
    kept = kept_probs((lp / params.temperature).unsqueeze(0), params.top_k, params.top_p)[0]
    return kept / kept.sum()


def _compare(h: Harness, engine: Any, label: str, params: SamplingParams) -> None:
    prompt = _prompt()
    ref = _reference_probs(h, prompt, params)
    out = engine.generate(prompt, params)
    mask = out["response_mask"][:, 0].cpu()
    h.expect(out.batch_size == SAMPLES and bool(mask.all()),
             f"{label}: expected {SAMPLES} samples of one token each, got {out.batch_size} with "
             f"{int(mask.sum())} first tokens")
    tokens = out["response_ids"][:, 0].cpu()
    reported = out["rollout_log_probs"][:, 0].detach().double().cpu()
    exact = engine.log_probs_exact(params)
    # expected probability of each token: what the engine reports (the distribution it claims to sample
    # from), renormalised over the kept tokens; the reference's for tokens never sampled or when the
    # engine declares its log-probs inexact for these params
    expected = ref.clone()
    if exact:
        raw = torch.softmax(
            cached_model(h.model_path("llama")).next_token_log_probs(
                prompt["prompt_ids"][0][prompt["prompt_mask"][0]], params.temperature), -1)
        engine_p = raw.clone()
        for t in tokens.unique().tolist():
            engine_p[t] = reported[tokens == t].mean().exp()
        kept = ref > 0
        expected = torch.where(kept, engine_p, torch.zeros_like(engine_p))
        expected = expected / expected.sum()
    order = ref.argsort(descending=True)
    head = [int(t) for t in order[: min(_BINS, int((ref > 0).sum()))]]
    counts = torch.bincount(tokens, minlength=ref.numel()).double() / SAMPLES
    bins = [(f"token {t}", float(counts[t]), float(expected[t])) for t in head]
    rest_got = 1.0 - sum(g for _, g, _ in bins)
    rest_want = max(0.0, 1.0 - sum(w for _, _, w in bins))
    bins.append(("other tokens", rest_got, rest_want))
    l1 = sum(abs(g - w) for _, g, w in bins)
    # the dtype's rounding between the distribution sampled and the one expected: each head token's
    # probability within a factor exp(+-delta) of its tier, the other-tokens bin taking the sum
    tol = tolerance(h.dtype, "log_probs")
    slack = 2 * math.expm1(tol.atol + tol.rtol * float(-ref[head].log().max()))
    limit = l1_bound(SAMPLES, len(bins)) + slack
    if l1 > limit:
        table = ", ".join(f"{name}: sampled {g:.3f} vs {w:.3f}" for name, g, w in bins)
        source = "its rollout_log_probs" if exact else "the float64 reference (log-probs declared inexact)"
        h.fail(f"{label}: the first tokens of {SAMPLES} samples of one prompt do not follow the distribution of "
               f"{source}: L1 distance {l1:.3f} > {limit:.3f} (a correct sampler exceeds "
               f"{l1_bound(SAMPLES, len(bins)):.3f} with probability < {MAX_FALSE_FAILURE:g}); {table}. Sample from "
               f"softmax(logits / T) with top-k/top-p applied after the temperature, the distribution whose "
               f"log-probs are reported")


@check("numerics", gates=("rollout.temperature", "rollout.top_k", "rollout.top_p"))
def check_sampled_tokens_follow_log_probs(h: Harness) -> None:
    """2048 sampled first tokens of one prompt follow the distribution the engine reports (its exact rollout_log_probs at T=0.5, renormalised under top-k and top-p): L1 distance over at most 7 bins within a bound a correct sampler exceeds with probability < 1e-6."""
    engine = h.rollout()
    caps = engine.capabilities
    temperature = _TEMPERATURE if caps.temperature else 1.0
    cases = [(f"T={temperature}", SamplingParams(temperature=temperature, max_new_tokens=1, n=SAMPLES, seed=_SEED))]
    if caps.temperature and caps.top_k:
        cases.append((f"T={temperature}, top_k=3", SamplingParams(temperature=temperature, top_k=3, max_new_tokens=1,
                                                                    n=SAMPLES, seed=_SEED + 1)))
    if caps.temperature and caps.top_p:
        # the nucleus at T=0.5 is 3 tokens (0.20 + 0.16 + 0.13 = 0.49 >= 0.42); before the temperature it is 8
        cases.append((f"T={temperature}, top_p=0.42", SamplingParams(temperature=temperature, top_p=0.42,
                                                                       max_new_tokens=1, n=SAMPLES, seed=_SEED + 2)))
    for label, params in cases:
        _compare(h, engine, f"sampling at {label}", params)
