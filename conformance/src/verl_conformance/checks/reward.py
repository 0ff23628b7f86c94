"""Reward: a reward engine's scores (reward model or reward functions) belong to their samples.

A score must depend on its sample only: not on the order of the batch, its size, how the engine
splits it into micro-batches, how much padding surrounds the sample or where it sits; scoring is
deterministic; samples in another tokenizer's ids score as their text; non-finite scores are refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.invariance import pad_more
from verl_conformance.harness import Harness
from verl_conformance.testkit import ShuffledTokenizer, load_tokenizer
from verl_core import (
    BatchMeta,
    ConfigError,
    NonFiniteError,
    RewardEngine,
    RewardError,
    TensorBatch,
    Tokenizer,
)
from verl_core.enginekit.retokenize import CrossTokenizerReward

_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _batch(h: Harness, seed: int = 70) -> TensorBatch:
    """Six ragged samples (one empty response) with the fields a scorer reads."""
    return h.batch(seed=seed).select(*_INPUTS, "group_ids")


def _scores(h: Harness, engine: RewardEngine, batch: TensorBatch, where: str) -> Tensor:
    """``engine.score(batch)["scores"]``, failing unless it is one finite float32 per sample."""
    if not engine.capabilities.scores:
        h.skip("the engine declares scores=False (token scores only)")
    out = engine.score(batch)
    h.expect("scores" in out, f"{where}: score() returned no 'scores'; got fields {list(out)}")
    s = out["scores"]
    h.expect(tuple(s.shape) == (batch.batch_size,),
             f"{where}: scores has shape {tuple(s.shape)}, expected ({batch.batch_size},): one score per sample")
    h.expect(s.dtype == torch.float32, f"{where}: scores has dtype {s.dtype}, expected torch.float32")
    bad = (~torch.isfinite(s)).nonzero().flatten().tolist()
    h.expect(not bad, f"{where}: scores of samples {bad} are not finite ({s.tolist()}); an engine must raise "
             "instead of returning NaN or inf")
    return s.detach().cpu()


@check("reward")
def check_score_layout(h: Harness) -> None:
    """score returns the input batch plus one finite float32 score per sample (token_scores [batch, response], 0 where masked, where declared); a model that outputs NaN makes score raise."""
    engine = h.reward()
    batch = _batch(h)
    out = engine.score(batch)
    where = "score"
    h.expect(out.batch_size == batch.batch_size, f"{where} changed the batch size to {out.batch_size}")
    for name in _INPUTS:
        h.expect(name in out and bool(torch.equal(out[name], batch[name])), f"{where}: input field {name} was changed")
    caps = engine.capabilities
    h.expect(caps.scores or caps.token_scores, "the engine declares neither scores nor token_scores")
    if caps.token_scores:
        h.expect("token_scores" in out, f"{where}: token_scores declared but missing; got fields {list(out)}")
        t = out["token_scores"]
        h.expect(tuple(t.shape) == tuple(batch["response_mask"].shape) and t.dtype == torch.float32,
                 f"{where}: token_scores is {t.dtype} {tuple(t.shape)}, expected float32 "
                 f"{tuple(batch['response_mask'].shape)}")
        h.expect(bool(torch.isfinite(t).all()), f"{where}: token_scores holds NaN or inf")
        h.expect(bool((t[~batch["response_mask"]] == 0).all()), f"{where}: token_scores is not 0 where response_mask is False")
    if not caps.scores:
        return
    normal = _scores(h, engine, batch, where)
    # The same engine on a folder whose score head outputs NaN: a model must refuse, not score.
    broken = h.reward("reward-nan", fresh=True)
    try:
        out = broken.score(batch)
    except (NonFiniteError, RewardError) as e:
        h.expect(any(w in str(e).lower() for w in ("nan", "finite", "inf")),
                 f"score of a NaN-producing model raised an unclear error: {e}")
        return
    except Exception as e:
        h.fail(f"score of a model whose head outputs NaN raised {type(e).__name__}: {e}; expected NonFiniteError "
               "or RewardError")
    s = out["scores"].detach().float().cpu() if "scores" in out else None
    if s is not None and bool(torch.isfinite(s).all()) and bool(torch.equal(s, normal)):
        return  # the scores do not read the folder's weights (rules, reward functions): nothing to corrupt
    shown = "no scores" if s is None else f"{s.flatten()[:4].tolist()}..."
    h.fail(f"a reward model whose head outputs NaN was scored {shown}; score must raise NonFiniteError or "
           "RewardError naming the samples instead of returning (or masking) non-finite scores")


@check("reward")
def check_scores_follow_input_order(h: Harness) -> None:
    """Permuting the samples permutes the scores the same way."""
    engine = h.reward()
    batch = _batch(h, seed=71)
    base = _scores(h, engine, batch, "score")
    for perm in (torch.tensor([3, 0, 5, 1, 4, 2]), torch.arange(batch.batch_size - 1, -1, -1)):
        got = _scores(h, engine, batch.index(perm), "score of a permuted batch")
        h.close_to(got, base[perm], "values",
                   f"scores of the batch permuted by {perm.tolist()} vs the scores permuted the same way "
                   "(score i must belong to sample i)")


@check("reward")
def check_scores_independent_of_batch(h: Harness) -> None:
    """A sample's score does not depend on its batch: alone, at another position, with more or less padding, or in micro-batches of 1 and 4."""
    engine = h.reward()
    batch = _batch(h, seed=72)
    base = _scores(h, engine, batch, "score")
    for prompt_cols, response_cols in ((4, 0), (0, 3), (3, 4)):
        padded = pad_more(batch, prompt_cols, response_cols)
        got = _scores(h, engine, padded, "score of a padded batch")
        h.close_to(got, base, "values",
                   f"scores with {prompt_cols} more left-pad prompt columns and {response_cols} more right-pad "
                   "response columns (the last real token must come from the masks, not the width or the pad id)")
    h.close_to(_scores(h, engine, batch.trim(), "score of a trimmed batch"), base, "values",
               "scores of the batch with its padding columns trimmed")
    alone = torch.stack([_scores(h, engine, batch.index([i]).trim(), f"score of sample {i} alone")[0]
                         for i in range(batch.batch_size)])
    h.close_to(base, alone, "values", "scores in a batch of 6 vs each sample scored alone (batch of one, no padding)")
    # sample 0 at every position, between the others
    rows = torch.tensor([0, 1, 0, 2, 3, 0])
    moved = _scores(h, engine, batch.index(rows), "score of a batch repeating sample 0")
    h.close_to(moved[rows == 0], base[0].expand(3), "values", "scores of sample 0 at positions 0, 2 and 5 vs its score")
    for size in (1, 4):
        got = _scores(h, h.reward(micro_batch_size=size), batch, f"score with micro_batch_size={size}")
        h.close_to(got, base, "values", f"scores with micro_batch_size={size} vs one micro-batch")


@check("reward")
def check_scores_deterministic(h: Harness) -> None:
    """Scoring a batch twice, or with a second engine of the same spec, gives identical scores."""
    batch = _batch(h, seed=74)
    engine = h.reward()
    a = _scores(h, engine, batch, "score")
    b = _scores(h, engine, batch, "score (again)")
    h.expect(bool(torch.equal(a, b)), f"two score() calls on one batch differ: {a.tolist()} vs {b.tolist()}")
    c = _scores(h, h.reward(fresh=True), batch, "score of a second engine")
    h.expect(bool(torch.equal(a, c)),
             f"two engines built from one spec score one batch differently: {a.tolist()} vs {c.tolist()} "
             "(an unseeded head or dropout left on)")


_TEXTS = (  # (prompt, response, the response ended with EOS): well within the suite's 12-token limits
    ("Add 3+4:", "7", True),
    ("Spell cat:", "c a t", True),
    ("Q", "", False),
    ("Name hue:", "Blue, sky", False),
)


def _encode(tok: Tokenizer, texts: tuple[tuple[str, str, bool], ...]) -> TensorBatch:
    """Left-padded prompts and right-padded responses of ``texts`` in ``tok``'s ids."""
    prompts = [tok.encode(p) for p, _, _ in texts]
    responses = [tok.encode(r) + ([tok.eos_token_id] if eos else []) for _, r, eos in texts]
    pw, rw = max(map(len, prompts)), max(map(len, responses))
    n, pad = len(texts), tok.pad_token_id
    fields = {
        "prompt_ids": torch.full((n, pw), pad, dtype=torch.int64),
        "prompt_mask": torch.zeros(n, pw, dtype=torch.bool),
        "response_ids": torch.full((n, rw), pad, dtype=torch.int64),
        "response_mask": torch.zeros(n, rw, dtype=torch.bool),
        "group_ids": torch.arange(n),
    }
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        fields["prompt_ids"][i, pw - len(p):] = torch.tensor(p, dtype=torch.int64)
        fields["prompt_mask"][i, pw - len(p):] = True
        fields["response_ids"][i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        fields["response_mask"][i, : len(r)] = True
    return TensorBatch(fields, meta=BatchMeta(pad_token_id=pad))


@check("reward")
def check_cross_tokenizer_scores(h: Harness) -> None:
    """Through CrossTokenizerReward, samples in another tokenizer's ids score as the same text in the model folder's ids (the engine's `tokenizer` is its model's)."""
    engine = h.reward()
    declared = getattr(engine, "tokenizer", None)
    if declared is None:
        h.skip("the engine has no `tokenizer`, which CrossTokenizerReward converts samples into "
               "(it then needs reward_tokenizer=)")
    if not engine.capabilities.scores:
        h.skip("the engine declares scores=False: token scores cannot cross tokenizers")
    path = h.model_path("reward")
    policy = ShuffledTokenizer(path)
    try:
        wrapped = CrossTokenizerReward(engine, policy)
    except ConfigError as e:
        h.fail(f"CrossTokenizerReward refused the engine: {e}")
    h.expect(wrapped.converts, "the engine's `tokenizer` has the vocabulary of a tokenizer with shuffled ids: it is "
             "not its model's tokenizer")
    want = _scores(h, engine, _encode(load_tokenizer(path), _TEXTS), "score of the texts in the folder's ids")
    got = _scores(h, wrapped, _encode(policy, _TEXTS), "CrossTokenizerReward.score of the texts in other ids")
    h.close_to(got, want, "values",
               f"scores of {[r for _, r, _ in _TEXTS]} given in another tokenizer's ids (converted through text "
               "into the engine's `tokenizer`) vs the same texts in the model folder's ids: the engine's "
               "tokenizer must encode text as its model was trained (no extra BOS, same ids)")
