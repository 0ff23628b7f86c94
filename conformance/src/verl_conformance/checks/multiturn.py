"""Multi-turn episodes: observation tokens in training batches, prompts that hold earlier turns,
turns that end at a stop id, and prefix caches.

A multi-turn response holds the model's turns and, after each, the observation tokens an
environment appended; ``loss_mask`` marks the sampled ones and ``turn_ids`` number the turns
(docs/architecture.md, "Batch layout"). These checks hold a backend to what an episode needs:

* training engines attend to observation tokens (positions continue across turns) but give them no
  log-prob, entropy or value, and a loss over such a batch counts only the sampled tokens;
* rollout engines continue a prompt holding earlier turns and observations (special ids among
  them) as the exact id sequence it is, and end a turn at a stop id, which the turn keeps;
* an engine declaring ``prefix_continuation`` samples from its cache what it would sample without it,
  and drops that cache at the commit of every path that changes the weights it serves (a stream, a
  direct sync, a sync after ``sleep_until_sync``), so neither a ``generate`` call in flight when a
  write is called nor a cache kept through a sleep serves keys of other weights;
* on the LongRoPE folder, whose rotation depends on the whole sequence's length, a turn sampled
  within the trained range and continued past it is continued with the long factors at every
  position: keys a cache kept from the short turn must not serve it.

Each check runs on the test kit's tiny models: a few short sequences, well under a second of
model time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.numerics import one_update
from verl_conformance.checks.rope import greedy_tokens_match
from verl_conformance.checks.weight_sync import folder_stream
from verl_conformance.harness import SUITE_OPTIM, Harness
from verl_conformance.losses import TOKEN_MEAN_PG, SuiteLoss
from verl_conformance.reference import ReferenceModel, cached_outputs, greedy_reference
from verl_conformance.testkit import (
    LONG_ROPE_TRAINED,
    eos_model_continuation,
    load_tokenizer,
    near_tie_margin,
)
from verl_core import (
    BatchMeta,
    ConfigError,
    GlobalBatchStats,
    ModelOutput,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    TensorBatch,
)
from verl_core.agent import EPISODE_KEY, AgentLoop, EpisodeLimits, StepResult, prompts_from_ids

__all__ = ["multi_turn_batch", "with_other_observations"]

_PAD, _EOS, _BOS = 0, 1, 2  # the test kit tokenizer's special ids
_FIRST_ID, _VOCAB = 4, 128  # ordinary ids of the test kit models
_CONTEXT: Final = 192
"""max_prompt_len of the rollout engines these checks build: prompts holding earlier turns are long,
and those of the prefix-continuation check span a whole 128-token KV block (vLLM's on CPU)."""

# Each sample's response: the lengths of its model turns and of the observations after them
# (observation k follows turn k). The widest is 12 tokens, the suite's max_response_len.
_LAYOUT: Final[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = (
    ((3, 2, 2), (2, 3)),  # three turns; turn 0 ends with EOS, observation 0 opens with BOS
    ((2, 3), (4,)),
    ((5,), ()),           # one turn: loss_mask equals response_mask
    ((1, 4), (1,)),
    ((2,), (3,)),         # ends with an observation (an episode that reached its context limit)
    ((), ()),             # an empty response
)
_PROMPT_LENGTHS: Final = (8, 3, 5, 1, 6, 2)

_OBSERVATIONS_HINT: Final = (
    "observation tokens (response_mask True, loss_mask False) must change neither the loss nor the gradients: "
    "hand the loss function each micro-batch with its loss_mask field (losses and counts read "
    "TensorBatch.loss_mask) and give those tokens no outputs"
)


def multi_turn_batch(seed: int, *, temperature: float = 1.0) -> TensorBatch:
    """Ragged multi-turn samples (see ``_LAYOUT``) with ``loss_mask``, ``turn_ids`` and RL fields.

    Log-probs, advantages, returns and old values are random on the sampled tokens and 0 on
    observation tokens and padding, as the batch layout prescribes.
    """
    g = torch.Generator().manual_seed(seed)
    n = len(_LAYOUT)
    p_width = max(_PROMPT_LENGTHS)
    r_width = max(sum(turns) + sum(obs) for turns, obs in _LAYOUT)
    prompt_ids = torch.full((n, p_width), _PAD, dtype=torch.int64)
    prompt_mask = torch.zeros((n, p_width), dtype=torch.bool)
    response_ids = torch.full((n, r_width), _PAD, dtype=torch.int64)
    response_mask = torch.zeros((n, r_width), dtype=torch.bool)
    loss_mask = torch.zeros((n, r_width), dtype=torch.bool)
    turn_ids = torch.zeros((n, r_width), dtype=torch.int64)
    for b, ((turns, observations), p) in enumerate(zip(_LAYOUT, _PROMPT_LENGTHS, strict=True)):
        prompt_ids[b, p_width - p:] = torch.randint(_FIRST_ID, _VOCAB, (p,), generator=g)
        prompt_mask[b, p_width - p:] = True
        col = 0
        for k, length in enumerate(turns):
            ids = torch.randint(_FIRST_ID, _VOCAB, (length,), generator=g)
            if b == 0 and k == 0:
                ids[-1] = _EOS
            response_ids[b, col:col + length] = ids
            loss_mask[b, col:col + length] = True
            turn_ids[b, col:col + length] = k
            col += length
            if k < len(observations):
                obs = torch.randint(_FIRST_ID, _VOCAB, (observations[k],), generator=g)
                if b == 0 and k == 0:
                    obs[0] = _BOS
                response_ids[b, col:col + len(obs)] = obs
                turn_ids[b, col:col + len(obs)] = k
                col += len(obs)
        response_mask[b, :col] = True
    lm = loss_mask.float()

    def tok(scale: float, shift: float = 0.0) -> Tensor:
        return (torch.randn(n, r_width, generator=g) * scale + shift) * lm

    return TensorBatch(
        {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
         "response_mask": response_mask, "loss_mask": loss_mask, "turn_ids": turn_ids,
         "group_ids": torch.arange(n), "truncated": torch.zeros(n, dtype=torch.bool),
         "old_log_probs": tok(0.5, -2.0), "ref_log_probs": tok(0.5, -2.0), "rollout_log_probs": tok(0.5, -2.0),
         "advantages": tok(1.0), "returns": tok(1.0), "old_values": tok(1.0)},
        meta=BatchMeta(temperature=temperature, pad_token_id=_PAD),
    ).check(where="multi-turn test batch")


def with_other_observations(batch: TensorBatch, seed: int) -> TensorBatch:
    """``batch`` with large, other values of every RL field at its observation tokens."""
    g = torch.Generator().manual_seed(seed)
    obs = batch["response_mask"] & ~batch.loss_mask

    def other(scale: float, shift: float) -> Tensor:
        return torch.randn(obs.shape, generator=g) * scale + shift

    noise = {"advantages": other(3.0, 2.0), "old_log_probs": other(0.5, -6.0), "ref_log_probs": other(0.5, -1.0),
             "rollout_log_probs": other(0.5, -6.0), "returns": other(3.0, 4.0), "old_values": other(3.0, -4.0)}
    return batch.update({k: torch.where(obs, v, batch[k]) for k, v in noise.items() if k in batch})


def _actor_loss(batch: TensorBatch, stats: GlobalBatchStats) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean plus sequence-mean of a policy-gradient, k3-KL and (with entropy) entropy term over loss tokens."""
    lp = batch["log_probs"]
    mask = batch.loss_mask.to(lp.dtype)
    to_ref = batch["ref_log_probs"] - lp
    per_token = -batch["advantages"] * torch.exp(lp - batch["old_log_probs"]) + 0.1 * (torch.exp(to_ref) - to_ref - 1)
    if "entropy" in batch:
        per_token = per_token - 0.05 * batch["entropy"]
    per_token = per_token * mask
    token_mean = per_token.sum() / max(stats.num_tokens, 1)
    seq_mean = (per_token.sum(1) / mask.sum(1).clamp_min(1)).sum() / max(stats.num_sequences, 1)
    return token_mean + seq_mean, {"pg_loss": token_mean.detach()}


def _value_loss(batch: TensorBatch, stats: GlobalBatchStats) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean squared error of the values against the returns over loss tokens."""
    mask = batch.loss_mask.to(batch["values"].dtype)
    loss = 0.5 * ((batch["values"] - batch["returns"]) ** 2 * mask).sum() / max(stats.num_tokens, 1)
    return loss, {"vf_loss": loss.detach()}


MULTI_TURN_PG: Final = SuiteLoss("multi_turn_pg", _actor_loss, inputs=("advantages", "old_log_probs", "ref_log_probs"))
MULTI_TURN_PG_ENTROPY: Final = SuiteLoss("multi_turn_pg_entropy", _actor_loss, frozenset({"log_probs", "entropy"}),
                                         inputs=("advantages", "old_log_probs", "ref_log_probs"))
MULTI_TURN_VALUE: Final = SuiteLoss("multi_turn_value_mse", _value_loss, frozenset({"values"}), inputs=("returns",))


def _update_ignores_observations(h: Harness, role: str, model: str, loss: SuiteLoss) -> None:
    """One update of a fresh engine on a batch with other values at its observation tokens equals
    the float64 reference's on the batch without them: loss, grad norm and every gradient."""
    clean = multi_turn_batch(seed=120)
    noisy = with_other_observations(clean, seed=121)
    engine = h.training(role, fresh=True, micro_batch_size=2)  # type: ignore[arg-type]
    metrics, grad_norm, grads = one_update(h, engine, noisy, loss)
    ref = ReferenceModel(h.model_path(model), SUITE_OPTIM).loss_and_grads(clean, loss, GlobalBatchStats.of(clean))
    label = (f"{role} {loss.name} on a multi-turn batch (micro-batches of 2) whose observation tokens hold other "
             "advantages, log-probs and returns, vs the float64 reference of its sampled tokens")
    h.scalar_close(metrics["loss"], ref.loss, "loss", f"loss of {label}; {_OBSERVATIONS_HINT}")
    h.scalar_close(grad_norm, ref.grad_norm, "loss", f"grad norm of {label}; {_OBSERVATIONS_HINT}")
    for name, g in ref.grads.items():
        h.expect(name in grads, f"exported weights lack the reference's parameter {name}")
        h.close_to(grads[name], g, "grad", f"gradient of {name} under {label} (recovered from the first AdamW "  # type: ignore[arg-type]
                   f"step); {_OBSERVATIONS_HINT}")


@check("numerics", gates=("training.log_probs", "training.entropy", "training.values"))
def check_multi_turn_loss_ignores_observations(h: Harness) -> None:
    """On a multi-turn batch, other advantages, log-probs and returns at observation tokens (loss_mask False) change neither the loss nor the gradients: one update (micro-batches of 2) equals the float64 reference of the sampled tokens, for the actor and the critic."""
    caps = h.training().capabilities
    if caps.log_probs:
        _update_ignores_observations(h, "actor", "llama", MULTI_TURN_PG_ENTROPY if caps.entropy else MULTI_TURN_PG)
    if h.provides(h.subject, "critic") and h.training("critic").capabilities.values:
        _update_ignores_observations(h, "critic", "value", MULTI_TURN_VALUE)
    elif not caps.log_probs:
        h.skip("the backend's actor declares log_probs=False and it has no critic with values")


def _zero_at_observations(h: Harness, out: TensorBatch, name: str, where: str) -> None:
    """Fail unless ``out[name]`` is exactly 0 at every observation token."""
    obs = out["response_mask"] & ~out.loss_mask
    bad = (out[name] != 0) & obs
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        h.fail(f"{where}: {name} is not 0 at {int(bad.sum())} of {int(obs.sum())} observation tokens (response_mask "
               f"True, loss_mask False), e.g. sample {b}, response position {t}: {float(out[name][b, t]):.4g}; outputs "
               "are defined only at the sampled tokens: mask them with TensorBatch.loss_mask, not response_mask "
               "(attention still spans every response_mask token)")


@check("numerics", gates=("training.log_probs", "training.entropy", "training.values"))
def check_multi_turn_outputs_match_reference(h: Harness) -> None:
    """On a multi-turn batch, forward gives the model's tokens the float64 reference's log-probs and entropy (critic: values) of the exact id sequence, positions continuing across turns and observation tokens attended to, and gives observation tokens 0."""
    batch = multi_turn_batch(seed=122)
    what = ("of the model's tokens of a multi-turn batch vs the float64 reference of the exact id sequence "
            "(position ids are cumsum over prompt_mask and response_mask: they continue across turns, and the "
            "observation tokens are attended to)")
    actor = h.training()
    caps = actor.capabilities
    outs: list[ModelOutput] = []
    if caps.log_probs:
        outs.append("log_probs")
    if caps.entropy:
        outs.append("entropy")
    if outs:
        got = actor.forward(batch, outs)
        ref = cached_outputs(h.model_path("llama"), batch, outs)
        for name in outs:
            _zero_at_observations(h, got, name, f"forward({name})")
            h.close_to(got[name], ref[name], name, f"forward {name} {what}", mask=batch.loss_mask)
    if h.provides(h.subject, "critic") and h.training("critic").capabilities.values:
        got = h.training("critic").forward(batch, ["values"])
        _zero_at_observations(h, got, "values", "critic forward(values)")
        ref = cached_outputs(h.model_path("value"), batch, ("values",))
        h.close_to(got["values"], ref["values"], "values", f"critic values {what}", mask=batch.loss_mask)
    elif not outs:
        h.skip("the backend's actor declares neither log_probs nor entropy and it has no critic with values")


# --------------------------------------------------------------------------- rollout: long prompts
def _real(batch: TensorBatch, field: str, mask: str, b: int) -> list[int]:
    return batch[field][b][batch[mask][b]].tolist()


def _random_ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(_FIRST_ID, _VOCAB, (n,), generator=g).tolist()


def _episode_prefixes(engine: RolloutEngine, seed: int, prompt_lengths: Sequence[int],
                      observation_lengths: Sequence[int]) -> list[list[int]]:
    """Prompts as an episode's second turn sees them: a prompt, a turn sampled by ``engine``, then
    observation tokens that open with EOS and BOS (the previous message's end, a new message's start)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [_random_ids(g, n) for n in prompt_lengths]
    first = engine.generate(prompts_from_ids(prompts, engine.tokenizer.pad_token_id, group_ids=list(range(len(prompts)))),
                            SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed))
    return [p + _real(first, "response_ids", "response_mask", b) + [_EOS, _BOS] + _random_ids(g, n - 2)
            for b, (p, n) in enumerate(zip(prompts, observation_lengths, strict=True))]


@check("invariance", gates=("rollout.exact_log_probs", "rollout.seeding"))
def check_rollout_continues_multi_turn_prefix(h: Harness) -> None:
    """A prompt holding an earlier turn and observation tokens (EOS and BOS among them, up to 40 ids) is continued as the float64 reference continues that exact id sequence (greedy tokens, sampled log-probs), and a seeded sample of it in an episode's batch equals the same prompt sampled alone (in bfloat16 they may part after the first token, where the batch's roundings move a draw)."""
    engine = h.rollout(max_prompt_len=_CONTEXT)
    prefixes = _episode_prefixes(engine, 130, (5, 24, 2), (9, 12, 4))
    batch = prompts_from_ids(prefixes, engine.tokenizer.pad_token_id, group_ids=[5, 6, 7])
    lengths = [len(p) for p in prefixes]
    what = (f"continuing multi-turn prompts ({lengths} ids: a prompt, a sampled turn, then observation tokens "
            "opening with EOS and BOS)")
    rules = ("a rollout must take prompt ids as they are: no re-tokenizing (special tokens such as the EOS that "
             "ended a turn stay), no dropped or truncated tokens, positions 0..n-1 over the whole prompt")
    path = h.model_path("llama")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=131)
    sampled = engine.generate(batch, params)
    if engine.log_probs_exact(params):
        h.close_to(sampled["rollout_log_probs"], cached_outputs(path, sampled)["log_probs"], "log_probs",
                   f"rollout_log_probs {what} vs the float64 reference of those exact ids; {rules}",
                   mask=sampled["response_mask"])
    greedy = engine.generate(batch, SamplingParams(greedy=True, max_new_tokens=6))
    margin = near_tie_margin(h.dtype)
    for b, prefix in enumerate(prefixes):
        toks = _real(greedy, "response_ids", "response_mask", b)
        want, decided = greedy_reference(path, torch.tensor(prefix), 6, {engine.tokenizer.eos_token_id}, margin=margin)
        n = min(decided, len(want))
        h.expect(toks[:n] == want[:n], f"greedy {what}, prompt {b}: got {toks}, the float64 reference of those "
                                       f"exact ids gives {want}; {rules}")
    if engine.capabilities.seeding != "per_sample":
        return  # samples of other seeding modes depend on the batch they are drawn in
    # Alone, a prompt runs at another batch size and padding width, so in reduced precision its logits
    # carry other roundings, and a sample may cross a boundary of the sampler after the first token:
    # there the samples must agree up to where they part (and from the first token on). In float32
    # they agree in full.
    exact = h.dtype == "float32"
    for b in range(len(prefixes)):
        alone = engine.generate(batch.index([b]), params)
        got, want_ids = _real(alone, "response_ids", "response_mask", 0), _real(sampled, "response_ids", "response_mask", b)
        shared = next((i for i, (x, y) in enumerate(zip(got, want_ids)) if x != y), min(len(got), len(want_ids)))
        same = got == want_ids if exact else shared >= 1
        rule = "the same ids and seed stream must give the same sample" + (
            "" if exact else f" (in {h.dtype} they may part after the first token, where the batch's roundings move "
                             "a draw across a boundary of the sampler)")
        h.expect(same, f"seeded sample (seed {params.seed}, group id {5 + b}) {what}, prompt {b}: "
                       f"in the batch of {len(prefixes)} prompts {want_ids}, alone {got}; {rule} (seeding='per_sample')")
        n = len(got) if exact else shared
        h.close_to(alone["rollout_log_probs"][0, :n], sampled["rollout_log_probs"][b, :n], "log_probs",
                   f"rollout_log_probs of prompt {b} {what} alone vs in the batch"
                   + ("" if exact else f", over the {n} tokens they share"))


# --------------------------------------------------------------------------- episodes: stops and truncation
_END_OF_TURN: Final = 44
"""The stop id that ends a turn on the EOS model ('E' in the test kit's tokenizer): prompts ending
in 'A' to 'D' reach it, a prompt ending in 'q' or 'g' never does."""
_LIMITS: Final = EpisodeLimits(max_turns=3, max_total_tokens=16, step_timeout_s=30.0)


@dataclass(frozen=True)
class _Script:
    """One scripted episode: the prompt text, the observation text after each turn, and the turn
    after which the environment says done (None: never)."""

    prompt: str
    replies: tuple[str, ...]
    done_after: int | None


_SCRIPTS: Final = (
    _Script("xA", ("zzC", "6", ""), done_after=2),  # two stops, then EOS ends the turn the environment closes
    _Script("yB", ("q",), done_after=None),         # a stop, then a turn without end: the budget cuts it
    _Script("g", ("g", "g", "g"), done_after=None),  # EOS at once, every turn: max_turns ends it
)


class _ScriptedEnvironment:
    """Answers turn k with ``script.replies[k]`` as text; says done after ``script.done_after``."""

    def __init__(self, script: _Script) -> None:
        self._script = script
        self._turn = 0

    def step(self, text: str, token_ids: Sequence[int]) -> StepResult:
        k = self._turn
        self._turn += 1
        return StepResult(observation=self._script.replies[k], reward=float(k), done=k == self._script.done_after)


@dataclass(frozen=True)
class _Expected:
    ids: list[int]
    sampled: list[bool]
    turns: list[int]
    truncated: bool
    termination: str


def _expected_episode(script: _Script, encode: Callable[[str], list[int]], stops: set[int]) -> _Expected:
    """What an episode of ``script`` on the EOS model must hold, by the rules of the episode loop.

    A turn ends at EOS or a stop id (kept, sampled); the environment answers a finished turn; its
    text is appended unless it said done, the turn was the last allowed one, or the text leaves no
    room for another token; a turn the budget cuts ends the episode truncated.
    """
    budget = _LIMITS.max_total_tokens
    ids: list[int] = []
    sampled: list[bool] = []
    turns: list[int] = []
    last = encode(script.prompt)[-1]
    for turn in range(_LIMITS.max_turns):
        continuation, _ = eos_model_continuation(last, budget)
        ends = [i for i, t in enumerate(continuation) if t in stops]
        model = continuation[: ends[0] + 1] if ends else continuation
        room = budget - len(ids)
        ids += model[:room]
        sampled += [True] * min(len(model), room)
        turns += [turn] * min(len(model), room)
        if len(model) > room or not ends:
            return _Expected(ids, sampled, turns, True, "max_total_tokens")
        if script.done_after == turn:
            return _Expected(ids, sampled, turns, False, "done")
        if turn + 1 == _LIMITS.max_turns:
            return _Expected(ids, sampled, turns, True, "max_turns")
        obs = encode(script.replies[turn])
        if len(obs) >= budget - len(ids):
            return _Expected(ids, sampled, turns, True, "max_total_tokens")
        ids += obs
        sampled += [False] * len(obs)
        turns += [turn] * len(obs)
        last = ids[-1]
    raise AssertionError("unreachable: the last turn returns")


@check("schema", gates=("rollout.stop_token_ids",))
def check_multi_turn_stop_and_truncation(h: Harness) -> None:
    """AgentLoop episodes with a scripted environment on the EOS model: a turn ends at the end-of-turn stop id (kept, loss_mask True) or EOS, observations are appended with loss_mask False, loss_mask is exactly the sampled tokens, and episodes cut by the token budget or max_turns are marked truncated."""
    engine = h.rollout("eos", max_prompt_len=_CONTEXT)
    caps = engine.capabilities
    stops = (_END_OF_TURN,) if caps.stop_token_ids else ()
    encode = load_tokenizer(h.model_path("eos")).encode
    prompts = prompts_from_ids([encode(s.prompt) for s in _SCRIPTS], engine.tokenizer.pad_token_id,
                               group_ids=list(range(len(_SCRIPTS))))
    out = AgentLoop(engine, _LIMITS).run(prompts, [_ScriptedEnvironment(s) for s in _SCRIPTS],
                                         SamplingParams(temperature=1.0, seed=140, stop_token_ids=stops))
    eos = engine.tokenizer.eos_token_id
    stop_rule = f"a turn ends at EOS ({eos})" + (f" or the stop id {_END_OF_TURN}, which it keeps" if stops else "")
    for b, script in enumerate(_SCRIPTS):
        want = _expected_episode(script, encode, {eos, *stops})
        info = out.extras[EPISODE_KEY][b]
        where = (f"episode {b} (prompt {script.prompt!r}, observations {list(script.replies)}, max_total_tokens "
                 f"{_LIMITS.max_total_tokens}, max_turns {_LIMITS.max_turns}; {stop_rule})")
        ids = _real(out, "response_ids", "response_mask", b)
        n = len(ids)
        if ids != want.ids:
            first_turn = want.ids[: want.turns.count(0)] if want.turns else []
            hint = ""
            if stops and _END_OF_TURN in first_turn and ids[: len(first_turn)] != first_turn:
                hint = (f"; the first turn should end at stop id {_END_OF_TURN} (SamplingParams.stop_token_ids), "
                        f"got {ids[: len(first_turn) + 4]}...")
            h.fail(f"{where}: response_ids {ids}, expected {want.ids}{hint}")
        h.expect(out["loss_mask"][b, :n].tolist() == want.sampled,
                 f"{where}: loss_mask {out['loss_mask'][b, :n].int().tolist()}, expected "
                 f"{[int(s) for s in want.sampled]} (True exactly on the sampled tokens, stop tokens included)")
        h.expect(out["turn_ids"][b, :n].tolist() == want.turns,
                 f"{where}: turn_ids {out['turn_ids'][b, :n].tolist()}, expected {want.turns}")
        h.expect(bool(out["truncated"][b]) == want.truncated and info["termination"] == want.termination,
                 f"{where}: truncated={bool(out['truncated'][b])}, termination {info['termination']!r}, expected "
                 f"truncated={want.truncated}, termination {want.termination!r}")
        lp = out["rollout_log_probs"][b]
        sampled = out["loss_mask"][b]
        h.expect(bool((lp[~sampled] == 0).all()) and bool((lp[sampled] <= 1e-6).all()),
                 f"{where}: rollout_log_probs must be <= 0 on sampled tokens and 0 elsewhere, got {lp[:n].tolist()}")


# --------------------------------------------------------------------------- prefix continuation
@check("invariance", gates=("rollout.prefix_continuation", "rollout.seeding", "rollout.exact_log_probs"))
def check_prefix_continuation_matches_rerun(h: Harness) -> None:
    """An engine declaring prefix_continuation samples prompts that extend an earlier call's prompt and response (two other observations after one turn, then a third turn) exactly as an engine that never saw the earlier calls samples them, with the float64 reference's log-probs of those exact ids where exact."""
    cold = h.rollout(max_prompt_len=_CONTEXT)
    if not cold.capabilities.prefix_continuation:
        h.skip("the rollout engine declares prefix_continuation=False (each prompt runs from scratch; "
               "rollout_continues_multi_turn_prefix covers that)")
    warm = h.rollout(max_prompt_len=_CONTEXT, fresh=True)
    g = torch.Generator().manual_seed(150)
    seeded = cold.capabilities.seeding == "per_sample"
    params = (SamplingParams(temperature=1.0, max_new_tokens=4, seed=151) if seeded
              else SamplingParams(greedy=True, max_new_tokens=4))
    prompts = [_random_ids(g, n) for n in (150, 133)]
    groups = [3, 4]

    def call(engine: RolloutEngine, rows: list[list[int]], group_ids: list[int]) -> TensorBatch:
        return engine.generate(prompts_from_ids(rows, engine.tokenizer.pad_token_id, group_ids=group_ids), params)

    first = call(warm, prompts, groups)
    turn = [p + _real(first, "response_ids", "response_mask", b) for b, p in enumerate(prompts)]
    obs_a, obs_b = [_random_ids(g, 5) for _ in prompts], [_random_ids(g, 5) for _ in prompts]
    a_label, b_label = "then observation A", "then observation B (as long as A)"
    calls = {a_label: [t + o for t, o in zip(turn, obs_a, strict=True)],
             b_label: [t + o for t, o in zip(turn, obs_b, strict=True)]}
    warm_out = {label: call(warm, rows, groups) for label, rows in calls.items()}
    c_label = "then observation A, a second turn and a third observation"
    calls[c_label] = [row + _real(warm_out[a_label], "response_ids", "response_mask", b) + _random_ids(g, 3)
                      for b, row in enumerate(calls[a_label])]
    warm_out[c_label] = call(warm, calls[c_label], groups)
    # every prompt at once, in one call: nothing earlier to continue from
    cold_out = call(cold, [row for rows in calls.values() for row in rows], groups * len(calls))
    for k, (label, rows) in enumerate(calls.items()):
        got = warm_out[label]
        for b in range(len(rows)):
            g_ids = _real(got, "response_ids", "response_mask", b)
            w_ids = _real(cold_out, "response_ids", "response_mask", k * len(groups) + b)
            where = (f"prefix continuation, prompt {b} ({len(rows[b])} ids: a prompt, its sampled turn, {label}), "
                     f"{'seeded sampling' if seeded else 'greedy'}")
            h.expect(g_ids == w_ids, f"{where}: after the earlier calls the engine sampled {g_ids}, the same prompt "
                                     f"sampled without them gives {w_ids}; a cached prefix must be looked up by the "
                                     "whole id sequence (a stale entry serves another prompt's samples)")
            h.close_to(got["rollout_log_probs"][b, :len(g_ids)],
                       cold_out["rollout_log_probs"][k * len(groups) + b, :len(w_ids)],
                       "log_probs", f"{where}: rollout_log_probs after the earlier calls vs without them")
    if not cold.log_probs_exact(params):
        return
    # the engine without the earlier calls caches too (within its one call), so it can share a fault:
    # the float64 reference of the exact ids cannot
    path = h.model_path("llama")
    for label, rows in calls.items():
        got = warm_out[label]
        h.close_to(got["rollout_log_probs"], cached_outputs(path, got)["log_probs"], "log_probs",
                   f"prefix continuation, prompts of {[len(r) for r in rows]} ids (a prompt, its sampled turn, "
                   f"{label}): rollout_log_probs vs the float64 reference of those exact ids; a cached prefix must "
                   "be looked up by the whole id sequence, within a call as across calls (an entry of another "
                   "prompt serves this one)", mask=got["response_mask"])


_WRITE_HINT: Final = (
    "a cached prefix (KV cache) kept across update_weights serves the old weights' keys and values: drop it when "
    "weights are written (inside _writing_weights, before _commit_weights)")


def _continuation_params(seeded: bool, seed: int) -> SamplingParams:
    return (SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed) if seeded
            else SamplingParams(greedy=True, max_new_tokens=4))


def _generate_rows(engine: RolloutEngine, rows: list[list[int]], groups: list[int],
                   params: SamplingParams) -> TensorBatch:
    return engine.generate(prompts_from_ids(rows, engine.tokenizer.pad_token_id, group_ids=groups), params)


def _continued(first: TensorBatch, prompts: list[list[int]], g: torch.Generator) -> list[list[int]]:
    """Each prompt, its turn in ``first`` and a 5-token observation."""
    return [p + _real(first, "response_ids", "response_mask", b) + _random_ids(g, 5) for b, p in enumerate(prompts)]


def _continuation_served(h: Harness, got: TensorBatch, want: TensorBatch, rows: list[list[int]], *, weights: str,
                         before: str, exact: bool, hint: str) -> None:
    """Fail unless ``got`` (the engine that cached the turns) equals ``want`` (an engine loaded with
    ``weights``) and, where ``exact``, the float64 reference of ``weights``."""
    for b, row in enumerate(rows):
        g_ids = _real(got, "response_ids", "response_mask", b)
        w_ids = _real(want, "response_ids", "response_mask", b)
        where = (f"prefix continuation, prompt {b} ({len(row)} ids: a prompt, the turn sampled {before}, an "
                 "observation)")
        h.expect(g_ids == w_ids, f"{where}: the engine sampled {g_ids}, an engine loaded with {weights} samples "
                                 f"{w_ids}; {hint}")
        h.close_to(got["rollout_log_probs"][b, :len(g_ids)], want["rollout_log_probs"][b, :len(w_ids)], "log_probs",
                   f"{where}: rollout_log_probs vs an engine loaded with {weights}; {hint}")
    if exact:
        h.close_to(got["rollout_log_probs"], cached_outputs(h.model_path(weights), got)["log_probs"], "log_probs",
                   f"prefix continuation, prompts of {[len(r) for r in rows]} ids (a prompt, the turn sampled {before}, "
                   f"an observation): rollout_log_probs vs the float64 reference of {weights}; {hint}",
                   mask=got["response_mask"])


def _updatable_prefix_cache(h: Harness) -> RolloutCapabilities:
    """The rollout's capabilities (from the cached engine: no build just to skip); skips unless it
    declares both a prefix cache and weight updates."""
    caps = h.rollout(max_prompt_len=_CONTEXT).capabilities
    if not caps.prefix_continuation:
        h.skip("the rollout engine declares prefix_continuation=False (each prompt runs from scratch)")
    if not caps.weight_update:
        h.skip("backend declares weight_update=False")
    return caps


@check("invariance", gates=("rollout.prefix_continuation", "rollout.weight_update", "rollout.seeding",
                            "rollout.exact_log_probs"))
def check_prefix_continuation_after_weight_update(h: Harness) -> None:
    """An engine declaring prefix_continuation drops its cache whenever the weights it serves change: a prompt that continues a turn sampled before update_weights (the turn and an observation after it), and one that continues a turn sampled before sleep_until_sync(), wake() and the sync after them, samples what an engine loaded with the new weights samples, with the float64 reference's log-probs of the new weights where exact."""
    caps = _updatable_prefix_cache(h)
    warm = h.rollout(max_prompt_len=_CONTEXT, fresh=True)
    g = torch.Generator().manual_seed(160)
    params = _continuation_params(caps.seeding == "per_sample", 161)
    exact = warm.log_probs_exact(params)
    prompts = [_random_ids(g, n) for n in (150, 133)]  # each spans a whole 128-token KV block
    groups = [5, 6]
    first = _generate_rows(warm, prompts, groups, params)
    warm.update_weights(folder_stream(h.model_path("llama-alt"), 7, dtype=warm.weight_dtype))
    rows = _continued(first, prompts, g)
    _continuation_served(h, _generate_rows(warm, rows, groups, params),
                         _generate_rows(h.rollout("llama-alt", max_prompt_len=_CONTEXT, fresh=True), rows, groups,
                                        params),
                         rows, weights="llama-alt", before="before update_weights(stream of llama-alt, version 7)",
                         exact=exact, hint=_WRITE_HINT)
    # the trainer's colocated step: a turn under llama-alt, sleep_until_sync, wake, a sync back to llama
    prompts = [_random_ids(g, n) for n in (141, 137)]
    first = _generate_rows(warm, prompts, groups, params)
    warm.sleep_until_sync()
    warm.wake()
    warm.update_weights(folder_stream(h.model_path("llama"), 8, dtype=warm.weight_dtype))
    rows = _continued(first, prompts, g)
    _continuation_served(h, _generate_rows(warm, rows, groups, params),
                         _generate_rows(h.rollout(max_prompt_len=_CONTEXT), rows, groups, params),
                         rows, weights="llama", before="under llama-alt before sleep_until_sync(), wake() and "
                         "update_weights(stream of llama, version 8)", exact=exact,
                         hint="a cache kept through sleep_until_sync() (on the host, or paged back in on the first "
                         "generate after wake()) serves the weights it had before the sync: drop it when the "
                         "weights are dropped, or at the commit of the sync, whatever copy of it exists")


_OVERLAP_TRIES: Final = 6
"""Attempts at calling update_weights while a generate call is in flight."""


@check("invariance", gates=("rollout.prefix_continuation", "rollout.concurrent_weight_update",
                            "rollout.weight_update", "rollout.seeding", "rollout.exact_log_probs"))
def check_prefix_continuation_across_concurrent_update(h: Harness) -> None:
    """An engine declaring prefix_continuation and concurrent_weight_update drops its cache at the commit of a weight write, not when update_weights is called: a turn whose generate call was in flight when update_weights(other weights) was called on another thread (it reports the old version), continued with an observation after the update returned, samples what an engine loaded with the new weights samples."""
    caps = _updatable_prefix_cache(h)
    if not caps.concurrent_weight_update:
        h.skip("backend declares concurrent_weight_update=False: update_weights never meets a generate call in flight")
    warm = h.rollout(max_prompt_len=_CONTEXT, fresh=True)
    g = torch.Generator().manual_seed(180)
    params = _continuation_params(caps.seeding == "per_sample", 181)
    long_turn = replace(params, max_new_tokens=min(12, warm.spec.max_response_len))  # a call that lasts
    groups = [7, 8]
    names = ("llama-alt", "llama")
    for attempt in range(_OVERLAP_TRIES):
        old_version, version, name = warm.weight_version, 20 + attempt, names[attempt % 2]
        prompts = [_random_ids(g, n) for n in (146, 139)]
        started = threading.Event()
        box: dict[str, Any] = {}

        def turn(prompts: list[list[int]] = prompts, box: dict[str, Any] = box, started: threading.Event = started
                 ) -> None:
            started.set()
            try:
                box["out"] = _generate_rows(warm, prompts, groups, long_turn)
            except Exception as e:  # reported below
                box["error"] = e
            box["returned"] = time.monotonic()

        thread = threading.Thread(target=turn, daemon=True, name="verl-conformance-turn")
        thread.start()
        started.wait()
        time.sleep(0.002 * (attempt + 1))
        called = time.monotonic()
        warm.update_weights(folder_stream(h.model_path(name), version, dtype=warm.weight_dtype))
        thread.join(60.0)
        h.expect(not thread.is_alive(), "a generate call in flight did not return within 60 s of update_weights "
                 "(called on another thread) returning")
        if "error" in box:
            err = box["error"]
            h.fail(f"a generate call in flight when update_weights was called on another thread raised "
                   f"{type(err).__name__}: {err}; an engine declaring concurrent_weight_update completes it")
        first: TensorBatch = box["out"]
        if first.meta.weight_version != old_version or box["returned"] <= called:
            continue  # it ran after the update, or ended before it was called: no overlap, try again
        rows = _continued(first, prompts, g)
        want = h.rollout(name, max_prompt_len=_CONTEXT)
        _continuation_served(
            h, _generate_rows(warm, rows, groups, params), _generate_rows(want, rows, groups, params), rows,
            weights=name, before=(f"by a generate call (version {old_version}) that was in flight when "
                                  f"update_weights(stream of {name}, version {version}) was called on another thread"),
            exact=warm.log_probs_exact(params),
            hint=("the generate call in flight stored its keys and values after the cache was dropped: drop the cache "
                  "inside the write window (after the turn is taken, before _commit_weights), not when "
                  "update_weights is called"))
        return
    h.skip(f"no generate call was still in flight when update_weights was called, in {_OVERLAP_TRIES} attempts "
           "(the machine is too fast or too loaded to overlap them)")


@check("weight_sync", gates=("rollout.prefix_continuation", "rollout.weight_update", "rollout.exact_log_probs"))
def check_prefix_continuation_after_trainer_sync(h: Harness) -> None:
    """An engine declaring prefix_continuation drops its cache on every weight path, the trainer's direct sync (verl_weight_sync) included: a turn sampled before a training step and the sync of its actor, continued with an observation, gets the actor's log-probs of those samples (a rollout-only backend: --verl-against's actor and the pair's sync)."""
    _updatable_prefix_cache(h)
    src, _ = h.sync_pair()
    rollout = h.rollout(max_prompt_len=_CONTEXT, fresh=True)
    actor = h.training(fresh=True, max_prompt_len=_CONTEXT, subject=src)
    g = torch.Generator().manual_seed(190)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=191)
    if not rollout.log_probs_exact(params):
        h.skip("rollout_log_probs are declared inexact at temperature 1")
    prompts = [_random_ids(g, n) for n in (144, 135)]
    groups = [11, 12]
    first = _generate_rows(rollout, prompts, groups, params)
    batch = h.batch(seed=51, rl_fields=True)
    actor.forward_backward(batch, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
    actor.optimizer_step()
    sync = h.trainer_syncs(src, h.subject)[0]
    sync.sync(actor, rollout, version=1)
    rows = _continued(first, prompts, g)
    out = _generate_rows(rollout, rows, groups, params)
    trainer = actor.forward(out)["log_probs"]
    m = out["response_mask"]
    before = cached_outputs(h.model_path("llama"), out)["log_probs"]
    h.expect(float((trainer.double() - before).abs()[m].max()) > 1e-3,
             "the training step did not change the trainer's log-probs; cannot test the sync")
    h.close_to(out["rollout_log_probs"], trainer, "log_probs",
               f"prefix continuation, prompts of {[len(r) for r in rows]} ids (a prompt, the turn sampled before a "
               f"training step and {type(sync).__name__}.sync(actor, rollout, version=1), an observation): "
               "rollout_log_probs vs the actor's log_probs of the same samples; every path that writes weights (a "
               "direct sync that bypasses update_weights too) must drop the prefix cache before _commit_weights",
               mask=m)


# --------------------------------------------------------------------------- LongRoPE: a short turn continued long
_FIRST_TURN: Final = 4
"""Tokens :func:`_episode_prefixes` samples for the first turn."""
_LONG_ROPE_PROMPTS: Final = (20, 12, 17)
"""First-turn prompts on the LongRoPE folder: with their turn, every sequence stays within the trained range."""
_LONG_ROPE_OBSERVATIONS: Final = (9, 14, 8)
"""Observations after each first turn: every continuing prompt is past the trained range, even after a
one-token turn (EOS at once)."""
assert max(_LONG_ROPE_PROMPTS) + _FIRST_TURN <= LONG_ROPE_TRAINED
assert min(p + 1 + o for p, o in zip(_LONG_ROPE_PROMPTS, _LONG_ROPE_OBSERVATIONS, strict=True)) > LONG_ROPE_TRAINED


@check("invariance", gates=("rollout.exact_log_probs",))
def check_long_rope_continuation_across_threshold(h: Harness) -> None:
    """On the LongRoPE Llama (short factors up to 24 tokens, long past them), a prompt that continues an earlier call's prompt and turn (at most 24 tokens) with an observation that takes it past 24 gives the float64 reference's greedy tokens and log-probs of that exact id sequence, with the long factors at every position: keys cached while the sequence was short (a prefix cache) must not serve it; a backend that refuses the folder skips."""
    if not h.provides(h.subject, "rollout"):
        h.skip(f"backend {h.subject.name!r} provides no rollout engine")
    model = "llama-longrope"
    try:
        engine = h.rollout(model, max_prompt_len=_CONTEXT)
    except ConfigError as e:
        h.skip(f"the backend refuses the LongRoPE folder ({model}), which this check needs: {e}")
    # the first turn: each prompt and its sampled turn within the trained range (short factors)
    prefixes = _episode_prefixes(engine, 170, _LONG_ROPE_PROMPTS, _LONG_ROPE_OBSERVATIONS)
    batch = prompts_from_ids(prefixes, engine.tokenizer.pad_token_id, group_ids=[8, 9, 10])
    params = SamplingParams(greedy=True, temperature=1.0, max_new_tokens=6)
    out = engine.generate(batch, params)
    ref = cached_outputs(h.model_path(model), out, ("log_probs", "max_log_probs"))
    what = (f"on the LongRoPE folder ({model}: short factors up to {LONG_ROPE_TRAINED} tokens, long factors past "
            f"them), prompts of {[len(p) for p in prefixes]} ids continuing an earlier call's prompt and turn "
            f"(at most {LONG_ROPE_TRAINED} tokens) with an observation")
    rule = (f"past {LONG_ROPE_TRAINED} tokens every position is rotated with the long factors, the prefix's too, so "
            "keys cached while the sequence was short (a prefix cache of the earlier call) must not serve a "
            "continuation past the threshold: recompute the prefix when the factor set changes, or do not cache on "
            "LongRoPE folders")
    greedy_tokens_match(h, out, ref, f"greedy tokens {what}; {rule}")
    if engine.log_probs_exact(params):
        h.close_to(out["rollout_log_probs"], ref["log_probs"], "log_probs",
                   f"rollout_log_probs of greedy samples {what}, vs the float64 reference of those exact ids; {rule}",
                   mask=out["response_mask"])
