"""Schema: every protocol output is a valid TensorBatch in the canonical layout."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from verl_conformance.checks._registry import check
from verl_conformance.checks.weight_sync import folder_weights
from verl_conformance.harness import Harness, exported_weights
from verl_conformance.losses import TOKEN_MEAN_PG, VALUE_MSE
from verl_core import (
    BatchValidationError,
    GlobalBatchStats,
    Role,
    SamplingParams,
    StepMetrics,
    TensorBatch,
)
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine
from verl_core.kernel.training import TrainingEngine

_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _valid(h: Harness, batch: TensorBatch, where: str) -> None:
    try:
        TensorBatch(dict(batch.items()), batch.extras, batch.meta, batch_size=batch.batch_size).check(where=where)
    except BatchValidationError as e:
        h.fail(f"{where} returned a batch outside the canonical layout: {e}")


def _float_outputs(h: Harness, out: TensorBatch, inp: TensorBatch, names: tuple[str, ...], where: str) -> None:
    for name in names:
        h.expect(name in out, f"{where}: requested output {name!r} is missing; got fields {list(out)}")
        t = out[name]
        h.expect(t.dtype == torch.float32, f"{where}: {name} has dtype {t.dtype}, expected torch.float32")
        h.expect(tuple(t.shape) == tuple(inp["response_mask"].shape),
                 f"{where}: {name} has shape {tuple(t.shape)}, expected [batch, response] = "
                 f"{tuple(inp['response_mask'].shape)} (same width as the input responses)")
        masked = t[~inp["response_mask"]]
        if masked.numel() and bool((masked != 0).any()):
            h.fail(f"{where}: {name} is not 0 where response_mask is False (found "
                   f"{int((masked != 0).sum())} nonzero masked values, e.g. {float(masked[masked != 0][0]):.4g}); "
                   "the engine must ignore padding (response_mask)")
    for name in _INPUTS:
        h.expect(bool(torch.equal(out[name], inp[name])), f"{where}: input field {name} was changed")
    _valid(h, out, where)


@check("schema", gates=("training.entropy",))
def check_forward_layout(h: Harness) -> None:
    """forward returns the input batch plus float32 [batch, response] outputs, 0 where masked."""
    engine = h.training()
    batch = h.batch(seed=1)
    out = engine.forward(batch, ["log_probs"])
    _float_outputs(h, out, batch, ("log_probs",), "forward(log_probs)")
    h.expect(out.batch_size == batch.batch_size, "forward changed the batch size")
    lp = out["log_probs"][batch["response_mask"]]
    h.expect(bool((lp <= 1e-6).all()), f"forward: log_probs must be <= 0, max is {float(lp.max()):.4g}")
    if engine.capabilities.entropy:
        out = engine.forward(batch, ["log_probs", "entropy"])
        _float_outputs(h, out, batch, ("log_probs", "entropy"), "forward(log_probs, entropy)")
        ent = out["entropy"][batch["response_mask"]]
        h.expect(bool((ent >= -1e-6).all()), f"forward: entropy must be >= 0, min is {float(ent.min()):.4g}")


@check("schema")
def check_declared_outputs_served(h: Harness) -> None:
    """Each training role serves the outputs its capabilities declare: forward(log_probs), forward(entropy) and forward(values) each return the output where log_probs, entropy or values is True (an actor or reference on a causal-LM folder has no value head, so it declares values=False; a critic declares values)."""
    trained: tuple[Role, ...] = ("actor", "reference", "critic")
    roles = [r for r in trained if h.provides(h.subject, r)]
    if not roles:
        h.skip("the backend provides no training role")
    batch = h.batch(seed=3)
    for role in roles:
        engine = h.training(role)
        caps = engine.capabilities
        for name in ("log_probs", "entropy", "values"):
            if not getattr(caps, name):
                continue
            where = f"the {role} (capabilities.{name}=True) forward({name})"
            try:
                out = engine.forward(batch, [name])
            except Exception as e:  # any refusal of a declared output is the finding
                h.fail(f"{where} raised {type(e).__name__}: {e}. Declare only what the role serves: "
                       f"{name}=False for a role without it (values is declared by the critic alone, whose "
                       "folder or seeded head gives it one)")
            _float_outputs(h, out, batch, (name,), where)


@check("schema")
def check_protocol_signatures_kept(h: Harness) -> None:
    """Each engine the backend provides (actor, reference, critic, rollout, reward) keeps the signature of every protocol method its class has (TrainingEngine, RolloutEngine, RewardEngine): the same parameters, in order, of the same kind and with the same defaults (export_weights' bucket_bytes is DEFAULT_BUCKET_BYTES, forward's outputs log_probs only); a parameter of its own comes after them and has a default. Callers (the trainer, weight syncs, users) pass the protocol's arguments by keyword or leave them out."""
    protocols: dict[Role, type] = {"actor": TrainingEngine, "reference": TrainingEngine, "critic": TrainingEngine,
                                   "rollout": RolloutEngine, "reward": RewardEngine}
    roles = [role for role in protocols if h.provides(h.subject, role)]
    if not roles:
        h.skip("the backend provides no engine")
    compared = []
    for role in roles:
        engine: Any = (h.training(role) if role in ("actor", "reference", "critic")
                       else h.rollout() if role == "rollout" else h.reward())
        protocol = protocols[role]
        for name in _protocol_methods(protocol):
            if not callable(getattr(type(engine), name, None)):
                continue  # a method the class does not have is a schema check of its own (the protocol's)
            problems = signature_differences(inspect.signature(getattr(protocol, name)),
                                             inspect.signature(getattr(type(engine), name)))
            if problems:
                h.fail(f"the {role} engine's {type(engine).__name__}.{name} does not keep "
                       f"{protocol.__name__}.{name}{inspect.signature(getattr(protocol, name))}: "
                       f"{'; '.join(problems)}. Keep the protocol's parameters and defaults (a caller that leaves "
                       "an argument out gets the protocol's default), and give any parameter of your own a default")
            compared.append(f"{role}.{name}")
    h.note(f"{len(compared)} methods compared")


def _protocol_methods(protocol: type) -> list[str]:
    """The public methods of ``protocol`` (properties aside)."""
    return [name for name in dir(protocol) if not name.startswith("_") and callable(getattr(protocol, name))
            and not isinstance(inspect.getattr_static(protocol, name), property)]


def signature_differences(want: inspect.Signature, got: inspect.Signature) -> list[str]:
    """How ``got`` differs from the protocol's ``want`` (``self`` included in both): a parameter of
    ``want`` missing, renamed, of another kind (positional, keyword-only) or with another default, or
    a parameter of ``got``'s own without a default. Annotations are not compared."""
    problems = []
    mine = list(got.parameters.values())
    by_name = got.parameters
    for i, p in enumerate(want.parameters.values()):
        q = by_name.get(p.name)
        if q is None:
            problems.append(f"parameter {p.name!r} is missing")
            continue
        if q.kind != p.kind and not (q.kind == q.POSITIONAL_OR_KEYWORD and p.kind == p.KEYWORD_ONLY):
            problems.append(f"{p.name!r} is {q.kind.description}, the protocol's is {p.kind.description}")
        if p.kind != p.KEYWORD_ONLY and (i >= len(mine) or mine[i].name != p.name):
            problems.append(f"{p.name!r} is not parameter {i + 1} as in the protocol")
        if q.default is not q.empty or p.default is not p.empty:
            same = q.default is p.default or (q.default is not q.empty and p.default is not p.empty
                                               and _same_default(q.default, p.default))
            if not same:
                problems.append(f"the default of {p.name!r} is {q.default!r}, the protocol's is {p.default!r}")
    for q in mine:
        if q.name not in want.parameters and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            problems.append(f"parameter {q.name!r} of its own has no default")
    return problems


def _same_default(a: object, b: object) -> bool:
    """Equal defaults of one type (a set and a frozenset of the same names count as one)."""
    sets = (set, frozenset)
    try:
        return bool(a == b) and (type(a) is type(b) or (isinstance(a, sets) and isinstance(b, sets)))
    except Exception:  # a default whose == is not a truth value
        return False


@check("schema", gates=("training.values",))
def check_critic_layout(h: Harness) -> None:
    """A critic's forward returns float32 values [batch, response], 0 where masked."""
    critic = h.training("critic")
    if not critic.capabilities.values:
        h.skip("backend declares values=False (no value head)")
    batch = h.batch(seed=2)
    _float_outputs(h, critic.forward(batch, ["values"]), batch, ("values",), "critic forward(values)")


@check("schema", gates=("training.values",))
def check_critic_on_a_causal_lm_folder(h: Harness) -> None:
    """A critic builds on a causal-LM folder (the policy's, where PPO names no critic_model): the folder's backbone with a value head made from spec.seed, so the same seed gives the same values and another seed others; its values are laid out as on the value-head folder and a value-loss update runs."""
    if not h.training("critic").capabilities.values:
        h.skip("backend declares values=False (no value head)")
    batch = h.batch(seed=3, rl_fields=True)
    values = []
    for seed in (0, 0, 1):
        critic = h.training("critic", fresh=True, causal_folder=True, seed=seed)
        out = critic.forward(batch, ["values"])
        _float_outputs(h, out, batch, ("values",), f"critic on the causal-LM folder (seed {seed}) forward(values)")
        values.append(out["values"])
    h.expect(bool(torch.isfinite(values[0]).all()), "critic on the causal-LM folder: values are not finite")
    h.expect(bool(torch.equal(values[0], values[1])),
             "critic on the causal-LM folder: two engines of seed 0 give other values; the value head must be a "
             "deterministic function of spec.seed (initialise it under torch.manual_seed(spec.seed) inside "
             "torch.random.fork_rng)")
    h.expect(not bool(torch.equal(values[0], values[2])),
             "critic on the causal-LM folder: seeds 0 and 1 give the same values; the value head must be made from "
             "spec.seed, not read from the folder or fixed")
    got = exported_weights(critic)
    folder = folder_weights(h.model_path("llama"))
    backbone = [n for n in folder if not n.startswith("lm_head")]
    missing = [n for n in backbone if n not in got]
    h.expect(not missing, f"critic on the causal-LM folder exports no {missing[:3]}: the backbone must be the "
             "folder's, under its names")
    for name in backbone:
        h.close_to(got[name].float(), folder[name].float(), "weights",
                   f"critic on the causal-LM folder: exported {name} vs the folder's (the backbone is the folder's)")
    m = critic.forward_backward(batch, VALUE_MSE, GlobalBatchStats.of(batch))
    step = critic.optimizer_step()
    h.expect(math.isfinite(m["loss"]) and math.isfinite(step.grad_norm) and not step.skipped,
             f"critic on the causal-LM folder: a value-loss update gave loss {m['loss']}, grad norm "
             f"{step.grad_norm}, skipped={step.skipped}")


@check("schema")
def check_train_step_metrics(h: Harness) -> None:
    """forward_backward returns global loss, loss metrics and micro-batch count; optimizer_step a finite StepMetrics."""
    engine = h.training(fresh=True, micro_batch_size=2)
    batch = h.batch(seed=3, rl_fields=True)
    m = engine.forward_backward(batch, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
    for key in ("loss", "pg_loss", "num_micro_batches"):
        h.expect(key in m, f"forward_backward metrics lack {key!r}; got {sorted(m)}")
    h.expect(m["num_micro_batches"] >= 3, f"micro_batch_size=2 on 6 samples must run >= 3 micro-batches, "
             f"metrics say {m['num_micro_batches']}")
    h.scalar_close(m["pg_loss"], m["loss"], "loss", "metric pg_loss (summed over micro-batches) vs loss")
    step = engine.optimizer_step()
    h.expect(isinstance(step, StepMetrics), f"optimizer_step returned {type(step).__name__}, expected StepMetrics")
    h.expect(bool(torch.isfinite(torch.tensor(step.grad_norm))) and step.grad_norm > 0,
             f"optimizer_step grad_norm is {step.grad_norm}, expected a finite positive number")
    h.expect(not step.skipped, "optimizer_step skipped a finite-gradient update")
    h.scalar_close(step.lr, engine.spec.optim.lr_at(0), "loss", "optimizer_step lr (OptimConfig.lr_at(0))")


@check("schema", gates=("rollout.stop_token_ids",))
def check_generate_layout(h: Harness) -> None:
    """generate returns n right-padded samples per prompt with group ids, sample index, log-probs, truncated and meta."""
    engine = h.rollout()
    prompts = h.batch(seed=4, batch_size=3).select("prompt_ids", "prompt_mask", "group_ids")
    prompts = prompts.update(group_ids=torch.tensor([7, 3, 11]))
    params = SamplingParams(temperature=0.9, max_new_tokens=6, n=3, seed=5)
    stops: tuple[int, ...] = ()
    if engine.capabilities.stop_token_ids:
        # Stop on tokens seen mid-response in a first run, so lengths vary and padding shows.
        first = engine.generate(prompts, params)
        seen = first["response_ids"]
        stops = tuple(sorted({int(seen[0, min(1, seen.shape[1] - 1)]), int(seen[4, min(3, seen.shape[1] - 1)])}))
        params = SamplingParams(temperature=0.9, max_new_tokens=6, n=3, seed=5, stop_token_ids=stops)
    out = engine.generate(prompts, params)
    where = "generate"
    h.expect(out.batch_size == 9, f"{where}: 3 prompts x n=3 must give 9 samples, got {out.batch_size}")
    for name in ("response_ids", "response_mask", "rollout_log_probs", "truncated", "group_ids", "sample_index"):
        h.expect(name in out, f"{where}: output lacks {name!r}; got {list(out)}")
    _valid(h, out, where)
    h.expect(out["group_ids"].tolist() == [7, 7, 7, 3, 3, 3, 11, 11, 11],
             f"{where}: group_ids must repeat each prompt's id n times in place, got {out['group_ids'].tolist()}")
    h.expect(out["sample_index"].tolist() == [0, 1, 2] * 3,
             f"{where}: sample_index must be 0..n-1 per prompt, got {out['sample_index'].tolist()}")
    rep = prompts.repeat_interleave(3)
    h.expect(bool(torch.equal(out["prompt_ids"], rep["prompt_ids"])) and bool(torch.equal(out["prompt_mask"], rep["prompt_mask"])),
             f"{where}: prompts must be returned unchanged (left-padded), repeated n times in place")
    mask, ids = out["response_mask"], out["response_ids"]
    h.expect(mask.shape[1] <= params.max_new_tokens, f"{where}: response width {mask.shape[1]} > max_new_tokens")
    pad = engine.tokenizer.pad_token_id
    h.expect(bool((ids[~mask] == pad).all()), f"{where}: padding positions of response_ids must hold the pad id {pad}")
    lp = out["rollout_log_probs"]
    h.expect(bool((lp[~mask] == 0).all()), f"{where}: rollout_log_probs must be 0 where response_mask is False")
    h.expect(bool((lp[mask] <= 1e-6).all()), f"{where}: rollout_log_probs must be <= 0")
    eos = {engine.tokenizer.eos_token_id, *stops}
    lengths = mask.sum(1)
    for b in range(out.batch_size):
        toks = ids[b, : int(lengths[b])].tolist()
        at = [i for i, t in enumerate(toks) if t in eos]
        h.expect(not at or at == [len(toks) - 1],
                 f"{where}: sample {b} has EOS/stop tokens at {at} inside its response {toks}; "
                 "a stop token must end it")
        ended = bool(at)
        want_trunc = (not ended) and len(toks) == params.max_new_tokens
        h.expect(bool(out["truncated"][b]) == want_trunc,
                 f"{where}: sample {b} truncated={bool(out['truncated'][b])}, expected {want_trunc} "
                 f"(length {len(toks)}, max_new_tokens {params.max_new_tokens}, ends with EOS: {ended})")
    meta = out.meta
    h.expect(abs(meta.temperature - 0.9) < 1e-9 and meta.top_p == 1.0 and meta.top_k == 0,
             f"{where}: meta must carry the sampling params (temperature 0.9, top_p 1, top_k 0), got {meta}")
    h.expect(meta.pad_token_id == pad, f"{where}: meta.pad_token_id {meta.pad_token_id} != tokenizer pad id {pad}")
    h.expect(meta.weight_version == engine.weight_version,
             f"{where}: meta.weight_version {meta.weight_version} != engine.weight_version {engine.weight_version}")
