"""Reward: a reward engine's scores (reward model or reward functions) belong to their samples.

A score must depend on its sample only: not on the order of the batch, its size, how the engine
splits it into micro-batches, how much padding surrounds the sample or where it sits; scoring is
deterministic; samples in another tokenizer's ids score as their text; non-finite scores are refused.
A reward model (``sequence_classifier``) scores as the float64 reference on the Llama, Qwen2 and Qwen3
reward folders, and refuses what it does not compute: a folder without a trained head, parallel
sizes, a dtype it would ignore.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Final

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.declared import device_available
from verl_conformance.checks.invariance import pad_more
from verl_conformance.harness import Harness
from verl_conformance.testkit import ShuffledTokenizer, load_tokenizer
from verl_conformance.testkit.models import SPECIAL_TOKENS
from verl_core import (
    BatchMeta,
    BatchValidationError,
    ConfigError,
    NonFiniteError,
    ParallelSizes,
    RewardEngine,
    RewardError,
    TensorBatch,
    Tokenizer,
)
from verl_core.enginekit.retokenize import CrossTokenizerReward

SCORER_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _batch(h: Harness, seed: int = 70) -> TensorBatch:
    """Six ragged samples (one empty response) with the fields a scorer reads."""
    return h.batch(seed=seed).select(*SCORER_INPUTS, "group_ids")


def _valid_scores(h: Harness, out: TensorBatch, batch: TensorBatch, where: str) -> Tensor:
    """``out["scores"]``, failing unless it is one finite float32 per sample."""
    h.expect("scores" in out, f"{where}: score() returned no 'scores' although the engine declares scores=True; "
             f"got fields {list(out)}")
    s = out["scores"]
    h.expect(tuple(s.shape) == (batch.batch_size,),
             f"{where}: scores has shape {tuple(s.shape)}, expected ({batch.batch_size},): one score per sample")
    h.expect(s.dtype == torch.float32, f"{where}: scores has dtype {s.dtype}, expected torch.float32")
    bad = (~torch.isfinite(s)).nonzero().flatten().tolist()
    h.expect(not bad, f"{where}: scores of samples {bad} are not finite ({s.tolist()}); an engine must raise "
             "instead of returning NaN or inf")
    return s.detach().cpu()


def _valid_token_scores(h: Harness, out: TensorBatch, batch: TensorBatch, where: str) -> list[Tensor]:
    """``out["token_scores"]`` on each sample's real response tokens, failing unless it is finite float32
    [batch, response] and 0 where ``response_mask`` is False."""
    h.expect("token_scores" in out, f"{where}: token_scores declared but missing; got fields {list(out)}")
    t = out["token_scores"]
    mask = batch["response_mask"]
    h.expect(tuple(t.shape) == tuple(mask.shape) and t.dtype == torch.float32,
             f"{where}: token_scores is {t.dtype} {tuple(t.shape)}, expected float32 {tuple(mask.shape)}")
    h.expect(bool(torch.isfinite(t).all()), f"{where}: token_scores holds NaN or inf")
    t, mask = t.detach().cpu(), mask.cpu()
    stray = (t != 0) & ~mask
    h.expect(not bool(stray.any()), f"{where}: token_scores is not 0 where response_mask is False (samples "
             f"{stray.any(1).nonzero().flatten().tolist()}): a token score belongs to a real response token")
    return [t[i][mask[i]] for i in range(batch.batch_size)]


def _scores(h: Harness, engine: RewardEngine, batch: TensorBatch, where: str) -> Tensor:
    """``engine.score(batch)["scores"]``, failing unless it is one finite float32 per sample."""
    if not engine.capabilities.scores:
        h.skip("the engine declares scores=False (token scores only)")
    return _valid_scores(h, engine.score(batch), batch, where)


@dataclass(frozen=True)
class _Scored:
    """What an engine declares it gives for a batch: scores and/or each sample's real token scores."""

    scores: Tensor | None
    tokens: list[Tensor] | None

    def rows(self, rows: Sequence[int]) -> _Scored:
        """The outputs of ``rows``, in that order."""
        return _Scored(None if self.scores is None else self.scores[list(rows)],
                       None if self.tokens is None else [self.tokens[i] for i in rows])

    @staticmethod
    def stack(parts: Sequence[_Scored]) -> _Scored:
        """The outputs of single-sample batches, as one batch's."""
        first = parts[0]
        return _Scored(None if first.scores is None else torch.cat([p.scores for p in parts]),  # type: ignore[misc]
                       None if first.tokens is None else [t for p in parts for t in p.tokens])  # type: ignore[union-attr]


def _scored(h: Harness, engine: RewardEngine, batch: TensorBatch, where: str,
            out: TensorBatch | None = None) -> _Scored:
    """Every output the engine declares (``scores``, ``token_scores``) of ``engine.score(batch)`` (or of
    ``out``, its result), validated."""
    caps = engine.capabilities
    h.expect(caps.scores or caps.token_scores, "the engine declares neither scores nor token_scores")
    if out is None:
        out = engine.score(batch)
    return _Scored(_valid_scores(h, out, batch, where) if caps.scores else None,
                   _valid_token_scores(h, out, batch, where) if caps.token_scores else None)


def _same(h: Harness, got: _Scored, want: _Scored, what: str) -> None:
    """``got`` equals ``want`` in the scores tier: scores, and token scores on real tokens."""
    if want.scores is not None and got.scores is not None:
        h.close_to(got.scores, want.scores, "scores", f"scores {what}")
    if want.tokens is not None and got.tokens is not None:
        for i, (g, w) in enumerate(zip(got.tokens, want.tokens, strict=True)):
            h.close_to(g, w, "scores", f"token_scores of sample {i} {what}")


@check("reward", gates=("reward.scores", "reward.token_scores"))
def check_score_layout(h: Harness) -> None:
    """score returns the input batch plus one finite float32 score per sample where scores are declared, token_scores [batch, response] (0 where masked) where declared; a model that outputs NaN makes score raise."""
    engine = h.reward()
    batch = _batch(h)
    where = "score"
    out = engine.score(batch)
    h.expect(out.batch_size == batch.batch_size, f"{where} changed the batch size to {out.batch_size}")
    for name in SCORER_INPUTS:
        h.expect(name in out and bool(torch.equal(out[name], batch[name])), f"{where}: input field {name} was changed")
    caps = engine.capabilities
    h.expect(caps.scores or caps.token_scores, "the engine declares neither scores nor token_scores")
    if caps.token_scores:
        _valid_token_scores(h, out, batch, where)
    if not caps.scores:
        return
    normal = _valid_scores(h, out, batch, where)
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


@check("reward", gates=("reward.scores", "reward.token_scores"))
def check_scores_follow_input_order(h: Harness) -> None:
    """Permuting the samples permutes the scores (and token scores) the same way."""
    engine = h.reward()
    batch = _batch(h, seed=71)
    base = _scored(h, engine, batch, "score")
    for perm in (torch.tensor([3, 0, 5, 1, 4, 2]), torch.arange(batch.batch_size - 1, -1, -1)):
        got = _scored(h, engine, batch.index(perm), "score of a permuted batch")
        _same(h, got, base.rows(perm.tolist()),
              f"of the batch permuted by {perm.tolist()} vs the scores permuted the same way "
              "(score i must belong to sample i)")


@check("reward", gates=("reward.scores", "reward.token_scores"))
def check_scores_independent_of_batch(h: Harness) -> None:
    """A sample's score (and token scores) does not depend on its batch: alone, at another position, with more or less padding, or in micro-batches of 1 and 4."""
    engine = h.reward()
    batch = _batch(h, seed=72)
    base = _scored(h, engine, batch, "score")
    for prompt_cols, response_cols in ((4, 0), (0, 3), (3, 4)):
        padded = pad_more(batch, prompt_cols, response_cols)
        _same(h, _scored(h, engine, padded, "score of a padded batch"), base,
              f"with {prompt_cols} more left-pad prompt columns and {response_cols} more right-pad "
              "response columns (the last real token must come from the masks, not the width or the pad id)")
    _same(h, _scored(h, engine, batch.trim(), "score of a trimmed batch"), base,
          "of the batch with its padding columns trimmed")
    alone = _Scored.stack([_scored(h, engine, batch.index([i]).trim(), f"score of sample {i} alone")
                           for i in range(batch.batch_size)])
    _same(h, base, alone, "in a batch of 6 vs each sample scored alone (batch of one, no padding)")
    # sample 0 at every position, between the others
    rows = [0, 1, 0, 2, 3, 0]
    moved = _scored(h, engine, batch.index(torch.tensor(rows)), "score of a batch repeating sample 0")
    _same(h, moved.rows([0, 2, 5]), base.rows([0, 0, 0]), "of sample 0 at positions 0, 2 and 5 vs its score")
    for size in (1, 4):
        got = _scored(h, h.reward(micro_batch_size=size), batch, f"score with micro_batch_size={size}")
        _same(h, got, base, f"with micro_batch_size={size} vs one micro-batch")


def _reference_scores(folder: str, batch: TensorBatch) -> Tensor:
    """The float64 scores of the sequence-classification folder: each sample's real prompt and response
    tokens alone, through the backbone, the head read at the last of them (never located by the pad id)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float64, trust_remote_code=False).eval()
    scores = []
    with torch.no_grad():
        for i in range(batch.batch_size):
            ids = torch.cat([batch["prompt_ids"][i][batch["prompt_mask"][i].bool()],
                             batch["response_ids"][i][batch["response_mask"][i].bool()]]).cpu()
            hidden = model.base_model(input_ids=ids[None]).last_hidden_state
            scores.append(model.score(hidden[0, -1])[0])
    return torch.stack(scores)


_FAMILIES: Final = (  # (suite folder, model_type, what the family adds to Llama's layers)
    ("reward", "llama", "the Llama layers"),
    ("reward-qwen2", "qwen2", "biases on q, k and v"),
    ("reward-qwen3", "qwen3", "an RMSNorm on each head of q and k before RoPE"),
)


@check("reward", gates=("reward.sequence_classifier",))
def check_scores_match_reference(h: Harness) -> None:
    """An engine that declares sequence_classifier scores each sample as the float64 reference of the folder's sequence-classification model (the head read at the last real token of prompt + response, EOS included, an empty response at the prompt's last token; a last response token equal to the pad id included) on the Llama, Qwen2 and Qwen3 reward folders (the Qwen ones with every tensor perturbed, so q/k/v biases and norm weights count); a Qwen folder refused with a ConfigError naming its model_type is listed as refused."""
    engine = h.reward()
    if not engine.capabilities.sequence_classifier:
        h.skip("the engine declares sequence_classifier=False (its scores are not a folder's classification head)")
    batch = _batch(h, seed=74)
    lengths = (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()
    compared, refused = [], []
    for model, model_type, layers in _FAMILIES:
        if model != "reward":
            built = h.unless_refused(partial(h.reward, model, fresh=True), kind="reward",
                                     what=f"{model} ({model_type}: {layers} over the Llama layers)", model_type=model_type)
            if built is None:
                refused.append(model_type)
                continue
            engine = built
        got = _scores(h, engine, batch, f"score on {model}")
        want = _reference_scores(h.model_path(model), batch)
        h.close_to(got, want, "scores",
                   f"scores on {model} ({model_type}: {layers}) of {batch.batch_size} samples of {lengths} real tokens "
                   "vs the float64 reference of the reward folder (the head at the last real token of prompt + "
                   "response)")
        compared.append(model_type)
        h.close_fresh()
    # the pad id as a real token, last of its response (a pad id equal to EOS): the last real token must
    # come from the masks, not from the ids
    padded = _batch(h, seed=76)
    ids, mask = padded["response_ids"].clone(), padded["response_mask"]
    rows = (mask.sum(1) >= 1).nonzero().flatten()
    ids[rows, mask[rows].sum(1) - 1] = padded.meta.pad_token_id
    padded = padded.update(response_ids=ids)
    h.close_to(_scores(h, h.reward(), padded, "score with the pad id as the last response token"),
               _reference_scores(h.model_path("reward"), padded), "scores",
               f"scores on reward of {len(rows)} samples whose last real response token is the pad id "
               f"({padded.meta.pad_token_id}, a real token where pad equals EOS) vs the float64 reference: find "
               "the last real token from the masks, never from the pad id")
    h.note(f"compared: {', '.join(compared)}"
           + (f"; refused (ConfigError naming the model_type): {', '.join(refused)}" if refused else ""))


@check("reward", gates=("reward.scores",))
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


def _encode(tok: Tokenizer, texts: tuple[tuple[str, str, bool], ...], prompt_prefix: Sequence[int] = ()) -> TensorBatch:
    """Left-padded prompts (each after ``prompt_prefix``) and right-padded responses of ``texts`` in ``tok``'s ids."""
    prompts = [[*prompt_prefix, *tok.encode(p)] for p, _, _ in texts]
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


@check("reward", gates=("reward.scores",))
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


@check("reward", gates=("reward.needs_text",))
def check_text_scores_ignore_special_tokens(h: Harness) -> None:
    """An engine that declares needs_text scores the decoded text: a BOS before each prompt, which decodes to no text, changes no score."""
    engine = h.reward()
    if not engine.capabilities.needs_text:
        h.skip("the engine declares needs_text=False: it scores token ids, where a BOS is part of the input")
    tok = load_tokenizer(h.model_path("reward"))
    bos = SPECIAL_TOKENS.index("<bos>")
    texts = _encode(tok, _TEXTS)
    plain = _scored(h, engine, texts, "score of the texts")
    with_bos = _encode(tok, _TEXTS, prompt_prefix=[bos])
    _same(h, _scored(h, engine, with_bos, "score of the texts with a BOS before each prompt"), plain,
          f"of {[p for p, _, _ in _TEXTS]} with the special token BOS (id {bos}) before each prompt vs without "
          "(a text scorer must decode with skip_special_tokens=True: special tokens are not text)")


def _unknown_devices(devices: frozenset[str]) -> list[str]:
    """Declared devices that are not a torch device type (``cpu``, ``cuda``, ... without an index)."""
    bad = []
    for d in sorted(devices):
        try:
            parsed = torch.device(d)
        except RuntimeError:
            bad.append(d)
            continue
        if parsed.index is not None:
            bad.append(d)
    return bad


@check("reward", gates=("reward.devices",))
def check_declared_devices(h: Harness) -> None:
    """Each declared device is a torch device type; on each one present here besides the suite's, the engine builds and scores as on the suite's device, with its outputs on the batch's device."""
    engine = h.reward()
    devices = engine.capabilities.devices
    bad = _unknown_devices(devices)
    h.expect(not bad, f"the engine declares devices {sorted(devices)}; {bad} name no torch device type "
             "(declare types such as 'cpu' and 'cuda', without an index)")
    suite = torch.device(h.device).type
    others = sorted(d for d in devices if d != suite and device_available(d))
    if not others:
        h.skip(f"the engine declares no device present here besides the suite's own ({h.device}); declared: "
               f"{sorted(devices)}")
    batch = _batch(h, seed=75)
    base = _scored(h, engine, batch, f"score on {h.device}")
    for device in others:
        where = f"score on {device}"
        try:
            other = h.reward(fresh=True, device=device)
        except Exception as e:
            h.fail(f"the reward engine declares device {device} but building it there raised {type(e).__name__}: {e}")
        moved = batch.to(device)
        out = other.score(moved)
        for name in ("scores", "token_scores"):
            if name in out:
                h.expect(out[name].device.type == device,
                         f"{where}: {name} is on {out[name].device}, expected the batch's device ({device})")
        _same(h, _scored(h, other, moved, where, out), base, f"{where} vs on {h.device}")


_NO_TRAINED_HEAD: Final = ("refuse a folder without a trained score head with verl_core.ConfigError naming the folder and "
                           "saying to set reward_model: a head initialised at random scores noise")

_NO_HEAD: Final = (  # (suite folder, what it is, what to do)
    ("llama", "the causal-LM Llama folder (architectures LlamaForCausalLM, an lm_head and no score.* weights)",
     _NO_TRAINED_HEAD),
    ("reward-headless", "a reward folder whose config names LlamaForSequenceClassification but whose weights hold "
                        "no score.weight", _NO_TRAINED_HEAD),
    ("reward-two-labels", "a reward folder whose score head has two labels (score.weight [2, hidden], id2label "
                          "naming two)", "a scalar reward reads one label: refuse a score.weight of other than one "
                                         "row with verl_core.ConfigError naming num_labels (reading row 0 scores with "
                                         "half of a classifier)"),
)


def _refused(h: Harness, setting: str, advice: str, **kw: Any) -> RewardEngine | None:
    """A fresh reward engine built with ``kw``, or None where the build raised ConfigError; fails on
    another exception."""
    try:
        return h.reward(fresh=True, **kw)
    except ConfigError:
        return None
    except Exception as e:
        h.fail(f"the reward engine asked for {setting} raised {type(e).__name__}: {e}; {advice}")


@check("reward", gates=("reward.sequence_classifier",))
def check_unsupported_settings_refused(h: Harness) -> None:
    """An engine that declares sequence_classifier refuses with a ConfigError a folder without a trained one-label score head (the causal-LM Llama, a classifier folder without score.weight, one whose score head has two labels) and parallel sizes above 1; a dtype it builds in it computes in (its scores are not the suite dtype's and match the float64 reference in that dtype's tier), else refuses it with a ConfigError: RewardCapabilities declares no dtypes."""
    engine = h.reward()
    if not engine.capabilities.sequence_classifier:
        h.skip("the engine declares sequence_classifier=False (its scores need not read a folder's head or dtype)")
    for model, what, advice in _NO_HEAD:
        built = _refused(h, f"the folder {model}, {what}", advice, model=model)
        h.expect(built is None, f"the reward engine built on {what}: {advice}")
        h.close_fresh()
    for parallel in (ParallelSizes(tp=2), ParallelSizes(pp=2), ParallelSizes(dp=2)):
        advice = ("RewardCapabilities declares no parallelism and the suite runs one process: refuse parallel sizes "
                  "other than 1 with verl_core.ConfigError naming them")
        built = _refused(h, f"parallel={parallel}", advice, parallel=parallel)
        h.expect(built is None, f"the reward engine built with parallel={parallel}: {advice}")
        h.close_fresh()
    batch = _batch(h, seed=76)
    suite = _scores(h, engine, batch, f"score in {h.dtype}")
    want = _reference_scores(h.model_path("reward"), batch)
    ran, refused = [], []
    for dtype in ("float32", "bfloat16", "float16"):
        if dtype == h.dtype:
            continue
        advice = ("compute in the dtype asked for, or refuse it with verl_core.ConfigError naming it (RewardCapabilities "
                  "declares no dtypes, so nothing upstream compares the spec's dtype with what the engine supports)")
        other = _refused(h, f"dtype={dtype!r}", advice, dtype=dtype)
        if other is None:
            refused.append(dtype)
            continue
        got = _scores(h, other, batch, f"score with dtype={dtype!r}")
        h.expect(not bool(torch.equal(got, suite)),
                 f"the reward engine built with dtype={dtype!r} scores {batch.batch_size} samples exactly as in "
                 f"{h.dtype} ({got.tolist()}): it ignored the dtype; {advice}")
        replace(h, dtype=dtype).close_to(got, want, "scores",
                                         f"scores with dtype={dtype!r} vs the float64 reference of the reward folder "
                                         f"(in the {dtype} tier; {advice})")
        ran.append(dtype)
        h.close_fresh()
    h.note(f"refused: the causal-LM, headless and two-label folders, tp/pp/dp=2; dtypes computed in: {', '.join(ran) or 'none'}; "
           f"dtypes refused: {', '.join(refused) or 'none'}")


@check("reward", gates=("reward.scores", "reward.token_scores", "reward.sequence_classifier"))
def check_bad_input_rejected(h: Harness) -> None:
    """Every reward engine answers a batch of 0 rows with 0 scores; a reward model (sequence_classifier) rejects what a training engine's forward rejects (a token id beyond the vocabulary, right-padded prompts, a missing mask, int32 ids, a mask of another length, a prompt or response over the spec's limits) with BatchValidationError naming the field."""
    from verl_conformance.checks.robustness import _bad_training_inputs

    engine = h.reward(fresh=True)
    empty = _batch(h, seed=75).index(slice(0, 0))
    try:
        out = engine.score(empty)
    except Exception as e:
        h.fail(f"score of a batch of 0 rows raised {type(e).__name__}: {e}; answer it with 0 scores (an async "
               "step or a filter can leave no samples)")
    if engine.capabilities.scores:
        _valid_scores(h, out, empty, "score of a batch of 0 rows")
    if not engine.capabilities.sequence_classifier:
        h.note("0 rows only: the engine declares sequence_classifier=False (reward functions read text)")
        return
    batch = h.batch(seed=75, rl_fields=True)
    for what, (make, names) in _bad_training_inputs(batch).items():
        if what.startswith("NaN in "):
            continue  # a scorer reads no advantages
        bad = make()
        bad = bad.select(*(k for k in (*SCORER_INPUTS, "group_ids") if k in bad))
        try:
            engine.score(bad)
        except BatchValidationError as e:
            h.expect(any(n in str(e) for n in names),
                     f"score({what}) raised an unclear error {str(e)!r}: it should name {' or '.join(names)}")
        except Exception as e:
            h.fail(f"score({what}) raised {type(e).__name__}: {e}; expected a BatchValidationError "
                   "(verl_core.enginekit.gates.check_model_inputs validates a scorer's inputs as a training engine's)")
        else:
            h.fail(f"score({what}) returned scores; expected a BatchValidationError naming {' or '.join(names)} "
                   "(verl_core.enginekit.gates.check_model_inputs)")
