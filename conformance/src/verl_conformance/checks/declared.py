"""Declared capabilities the other areas leave alone: dtypes and devices (and refusing the
undeclared ones), bfloat16's float32 norms, gradient checkpointing, top-k/top-p sampling, and
tensor/pipeline parallel rollout.

A backend that declares one of these is held to it here; one that does not is skipped with the reason.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.numerics import one_update
from verl_conformance.checks.rope import greedy_tokens_match
from verl_conformance.harness import Harness
from verl_conformance.losses import TOKEN_MEAN_PG
from verl_conformance.reference import cached_outputs
from verl_conformance.testkit import near_tie_margin
from verl_core import ConfigError, ParallelSizes, RewardEngine, Role, SamplingParams, TensorBatch


def device_available(device: str) -> bool:
    """Whether this machine has a device of type ``device`` (cpu, or cuda with a GPU visible)."""
    if device == "cpu":
        return True
    if device.startswith("cuda"):
        return torch.cuda.is_available()
    return False


def _role_caps(h: Harness, role: Role) -> Any:
    return h.rollout().capabilities if role == "rollout" else h.training(role).capabilities


@check("numerics", gates=("training.dtypes", "training.devices", "rollout.dtypes", "rollout.devices"))
def check_declared_dtypes_and_devices(h: Harness) -> None:
    """Each declared dtype on each declared device present here builds, and one actor forward's log-probs and one rollout generate's rollout_log_probs match the float64 reference in its tier (no update runs: --verl-dtype runs the whole suite in a dtype). An actor or rollout engine that declares float32 and another dtype computes in that other dtype: built in it (the suite's dtype included) on a device, its forward log-probs (the actor's) or its seeded samples' tokens and rollout_log_probs (the rollout's) are not bit-equal to those of the same role built in float32 on that device, as the reward role's scores are not (an engine that upcasts its model or weight stream to float32 stays within every dtype's tier)."""
    suite_device = torch.device(h.device).type
    tried: list[str] = []
    compared: list[str] = []
    roles: tuple[Role, ...] = ("actor", "rollout")
    for role in roles:
        if not h.provides(h.subject, role):
            continue
        caps = _role_caps(h, role)
        dtypes = sorted(caps.dtypes)
        compare = "float32" in dtypes and len(dtypes) > 1
        for device in sorted(d for d in caps.devices if device_available(d)):
            outputs: dict[str, dict[str, Tensor]] = {}
            for dtype in dtypes:
                if (dtype, device) == (h.dtype, suite_device):
                    if compare:  # the rest of the suite checks its tier; only its outputs are compared here
                        outputs[dtype] = _declared_combination(h, role, suite=True)
                    continue
                tried.append(f"{role} {dtype} on {device}")
                outputs[dtype] = _declared_combination(replace(h, dtype=dtype, device=device), role)
                h.close_fresh()
            if compare:
                for dtype in dtypes:
                    if dtype != "float32":
                        _computes_in_its_dtype(h, role, f"dtype={dtype!r} on device {device}", outputs[dtype],
                                               outputs["float32"])
                        compared.append(f"{role} {dtype} on {device}")
    if not tried:
        h.skip(f"the backend declares no dtype and device present here besides the suite's own ({h.dtype} on "
               f"{h.device})")
    h.note(f"this run's engines are {h.dtype} on {h.device}; built besides them and compared with the float64 "
           f"reference: {', '.join(tried)}; computing otherwise than the same role in float32 (outputs not "
           f"bit-equal): {', '.join(compared) or 'none compared'}")


_ROLLOUT_PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=9)


def _declared_combination(h: Harness, role: str, *, suite: bool = False) -> dict[str, Tensor]:
    """One role built in ``h.dtype`` on ``h.device`` (``suite``: the suite's cached engine, whose tier the rest of
    the suite checks): its log-probs against the float64 reference in that tier, and the outputs (on the CPU,
    zero past each response) that :func:`_computes_in_its_dtype` compares."""
    where = f"dtype {h.dtype} on device {h.device}"
    try:
        engine: Any = ((h.rollout() if suite else h.rollout(fresh=True)) if role == "rollout"
                       else h.training() if suite else h.training(fresh=True))
    except Exception as e:
        h.fail(f"the {role} engine declares {where} but building it raised {type(e).__name__}: {e}")
    if role == "rollout":
        prompts = h.batch(seed=65, batch_size=3).select("prompt_ids", "prompt_mask", "group_ids")
        batch: TensorBatch = engine.generate(prompts, _ROLLOUT_PARAMS)
        got = batch["rollout_log_probs"]
        exact = engine.log_probs_exact(_ROLLOUT_PARAMS)
    else:
        batch = h.batch(seed=65)
        got = engine.forward(batch)["log_probs"]
        exact = True
    mask = batch["response_mask"].cpu()
    outputs = {"response_ids": batch["response_ids"].cpu(), "response_mask": mask,
               "log_probs": got.detach().float().cpu().masked_fill(~mask, 0.0)}
    if exact and not suite:
        ref = cached_outputs(h.model_path("llama"), batch)["log_probs"]
        h.close_to(got, ref, "log_probs", f"{role} log-probs with {where} vs float64 reference",
                   mask=batch["response_mask"])
    return outputs


def _computes_in_its_dtype(h: Harness, role: str, where: str, got: dict[str, Tensor], f32: dict[str, Tensor]) -> None:
    """Fail where ``role``'s outputs built with ``where`` are bit-equal to its outputs built in float32."""
    if not all(torch.equal(got[k], f32[k]) for k in f32):
        return
    mask = f32["response_mask"]
    what = ("forward log_probs of 6 samples" if role == "actor"
            else f"tokens and rollout_log_probs of {mask.shape[0]} seeded samples (T=1, seed 9)")
    h.fail(f"the {role} engine built with {where} gives {what} bit-equal to the same role built in float32 "
           f"(log-probs {[round(v, 6) for v in f32['log_probs'][mask][:4].tolist()]}, ...): it computes in float32 "
           "(an upcast model or weight stream), not in the dtype it declares; compute in the dtype the spec asks "
           "for, or leave it out of capabilities.dtypes and refuse it with verl_core.ConfigError")


_NORM_MODEL = "llama-bf16-norm"
_NORM_REWARD_MODEL = "reward-bf16-norm"
_NORM_ADVICE = ("on this folder the normalised rows sit just beside bfloat16 rounding points: compute RMSNorm's mean "
                "of squares, rsqrt and x * rsqrt in float32 and round once to bfloat16, as transformers' LlamaRMSNorm "
                "does (hidden_states.to(torch.float32)); a norm computed in bfloat16 tips them and moves this "
                "folder's attention by nats")


def _declared_dtypes(h: Harness, role: Role) -> frozenset[str]:
    """The dtypes the subject's ``role`` declares: its BackendSpec's, else those of an engine built in the suite's dtype."""
    declared = None if h.subject.dtypes is None else h.subject.dtypes.get(role)
    return frozenset(declared) if declared is not None else frozenset(_role_caps(h, role).dtypes)


@check("numerics", gates=("training.dtypes", "rollout.dtypes", "reward.sequence_classifier"))
def check_bfloat16_rms_norm_in_float32(h: Harness) -> None:
    """In bfloat16, RMSNorm normalises in float32 and rounds once, as transformers does: on a Llama whose normalised rows sit just beside bfloat16 rounding points (the test kit's llama-bf16-norm), forward log-probs, greedy tokens and their rollout log-probs equal the float64 reference in the bfloat16 tier, and so do a reward model's scores on its reward-model variant (reward-bf16-norm: the same layers under a score head); a norm computed in bfloat16 misses the log-probs by nats and the scores by several times the tier. Runs the actor and rollout engines that declare bfloat16, and a reward engine that declares sequence_classifier and builds in bfloat16 (RewardCapabilities declares no dtypes: one that refuses bfloat16 with a ConfigError is left out), whatever --verl-dtype says."""
    roles: list[Role] = [role for role in ("actor", "rollout")
                         if h.provides(h.subject, role) and "bfloat16" in _declared_dtypes(h, role)]
    bf = replace(h, dtype="bfloat16")
    path = bf.model_path(_NORM_MODEL)
    for role in roles:
        if role == "actor":
            batch = bf.batch(seed=67, batch_size=6, max_prompt=12, max_response=12, empty=0)
            got = bf.training(model=_NORM_MODEL, fresh=True).forward(batch, ["log_probs"])["log_probs"]
            ref = cached_outputs(path, batch)["log_probs"]
            bf.close_to(got, ref, "log_probs", f"forward log_probs in bfloat16 on {_NORM_MODEL} vs the float64 "
                        f"reference ({_NORM_ADVICE})", mask=batch["response_mask"])
        else:
            prompts = bf.batch(seed=68, batch_size=4, max_prompt=12).select("prompt_ids", "prompt_mask", "group_ids")
            params = SamplingParams(greedy=True, temperature=1.0, max_new_tokens=8)
            engine = bf.rollout(_NORM_MODEL, fresh=True)
            out = engine.generate(prompts, params)
            expected = cached_outputs(path, out, ("log_probs", "max_log_probs"))
            greedy_tokens_match(bf, out, expected, f"greedy tokens in bfloat16 on {_NORM_MODEL} ({_NORM_ADVICE})")
            if engine.log_probs_exact(params):
                bf.close_to(out["rollout_log_probs"], expected["log_probs"], "log_probs",
                            f"rollout_log_probs of greedy samples in bfloat16 on {_NORM_MODEL} vs the float64 "
                            f"reference ({_NORM_ADVICE})", mask=out["response_mask"])
        bf.close_fresh()
    reward, reward_note = _bfloat16_reward(bf)  # after the others: close_fresh() above would close it
    if not roles and reward is None:
        h.skip(f"backend {h.subject.name!r} declares no actor or rollout engine in bfloat16 (capabilities.dtypes) "
               f"and {reward_note}: the float32 norms of a bfloat16 engine are what this check proves")
    if reward is not None:
        from verl_conformance.checks.reward import SCORER_INPUTS, _reference_scores, _valid_scores

        batch = bf.batch(seed=69, batch_size=6, max_prompt=12, max_response=12).select(*SCORER_INPUTS, "group_ids")
        got = _valid_scores(bf, reward.score(batch), batch, f"score in bfloat16 on {_NORM_REWARD_MODEL}")
        bf.close_to(got, _reference_scores(bf.model_path(_NORM_REWARD_MODEL), batch), "scores",
                    f"scores in bfloat16 on {_NORM_REWARD_MODEL} (the layers of {_NORM_MODEL} under a score head) "
                    f"vs the float64 reference of its sequence-classification model ({_NORM_ADVICE})")
        bf.close_fresh()
    ran = ([f"{' and '.join(roles)} on {_NORM_MODEL}"] if roles else []) + (
        [f"the reward model on {_NORM_REWARD_MODEL}"] if reward is not None else [f"no reward model ({reward_note})"])
    h.note(f"in bfloat16: {'; '.join(ran)}")


def _bfloat16_reward(bf: Harness) -> tuple[RewardEngine | None, str]:
    """A fresh reward model of the subject built in bfloat16 on :data:`_NORM_REWARD_MODEL`, or None and why
    not: no reward engine, one that does not declare sequence_classifier, or one that refuses bfloat16 (a
    ConfigError, as ``reward::unsupported_settings_refused`` allows)."""
    subject = bf.subject
    if not bf.provides(subject, "reward"):
        return None, "it provides no reward engine"
    declared = None if subject.dtypes is None else subject.dtypes.get("reward")
    if declared is not None and "bfloat16" not in declared:
        return None, f"its reward engine declares dtypes {sorted(declared)}"
    try:
        engine = bf.reward(_NORM_REWARD_MODEL, fresh=True)
    except ConfigError:
        bf.close_fresh()
        return None, "its reward engine refuses bfloat16 (a ConfigError)"
    if not engine.capabilities.sequence_classifier:
        bf.close_fresh()
        return None, "its reward engine declares sequence_classifier=False (its scores read no folder's head)"
    return engine, ""


@check("invariance", gates=("training.gradient_checkpointing",))
def check_gradient_checkpointing_invariance(h: Harness) -> None:
    """gradient_checkpointing=True gives the same loss, grad norm and gradients as without it."""
    if not h.training().capabilities.gradient_checkpointing:
        h.skip("backend declares gradient_checkpointing=False")
    batch = h.batch(seed=24, rl_fields=True)
    m0, n0, g0 = one_update(h, h.training(fresh=True, micro_batch_size=2), batch, TOKEN_MEAN_PG)
    m1, n1, g1 = one_update(h, h.training(fresh=True, micro_batch_size=2, gradient_checkpointing=True), batch,
                            TOKEN_MEAN_PG)
    label = "with gradient_checkpointing=True vs without"
    h.scalar_close(m1["loss"], m0["loss"], "loss", f"loss {label}")
    h.scalar_close(n1, n0, "loss", f"grad norm {label} (recomputed activations must give the same gradients)")
    for name, g in g0.items():
        h.close_to(g1[name], g, "grad", f"gradient of {name} {label}")  # type: ignore[arg-type]


@check("invariance", gates=("rollout.top_k", "rollout.top_p"))
def check_truncated_sampling_keeps_top_token(h: Harness) -> None:
    """top_k=1, and a top_p that keeps one token, sample only a most likely token whatever the seed: the greedy tokens, or, where tokens tie at the top (bfloat16 logits do), any of them (a float64 reference log-prob within the dtype's near-tie margin of the largest)."""
    engine = h.rollout()
    caps = engine.capabilities
    cases = []
    if caps.top_k:
        cases.append(("top_k=1", SamplingParams(temperature=1.0, top_k=1, max_new_tokens=5, n=2, seed=13)))
    if caps.top_p:
        cases.append(("top_p=1e-6", SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=5, n=2, seed=13)))
    if not cases:
        h.skip("backend declares top_k=False and top_p=False")
    prompts = h.batch(seed=66, batch_size=2).select("prompt_ids", "prompt_mask", "group_ids")
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=5))
    margin = near_tie_margin(h.dtype)
    for label, params in cases:
        out = engine.generate(prompts, params)
        off = [i for i in range(out.batch_size) if _response(out, i) != _response(greedy, i // params.n)]
        if not off:
            continue
        # Off the greedy path: only a tie at the top may have led there, which the contract lets an
        # engine break its own way (vLLM keeps every token tied with the k-th). Each token must be a
        # most likely one after the sample's own prefix.
        ref = cached_outputs(h.model_path("llama"), out, ("log_probs", "max_log_probs"))
        for i in off:
            got, want = _response(out, i), _response(greedy, i // params.n)
            short = ((ref["max_log_probs"][i] - ref["log_probs"][i]) > margin) & out["response_mask"][i].cpu()
            if bool(short.any()):
                t = int(short.nonzero()[0])
                h.fail(f"{label}: sample {i} (prompt {i // params.n}) is {got}, the greedy tokens are {want}; at step "
                       f"{t} it took token {got[t]}, whose float64 reference log-prob "
                       f"{float(ref['log_probs'][i, t]):.5g} is below the most likely token's "
                       f"{float(ref['max_log_probs'][i, t]):.5g} by more than the {h.dtype} near-tie margin {margin:g}: "
                       "top-k and the nucleus must keep the most likely token (where tokens tie at the top, one of "
                       "them)")


def _response(batch: TensorBatch, i: int) -> list[int]:
    """Sample ``i``'s response token ids."""
    ids: list[int] = batch["response_ids"][i][batch["response_mask"][i]].tolist()
    return ids


def _rollout_layout(h: Harness, layout: dict[str, int], capability: str) -> None:
    """One process vs ``layout`` under torchrun: the same greedy and seeded samples and rollout log-probs."""
    engine = h.rollout()
    if not getattr(engine.capabilities, capability):
        h.skip(f"backend declares rollout {capability}=False")
    if not h.subject.registered:
        h.skip("multi-rank checks build engines through the registry; install the backend as a plugin")
    from verl_conformance import multirank
    from verl_conformance.testkit import LaunchError, launch_torchrun

    world = layout.get("tp", 1) * layout.get("pp", 1)
    if h.device.startswith("cuda") and torch.cuda.device_count() < world:
        h.skip(f"{world} ranks on {h.device} need {world} GPUs; {torch.cuda.device_count()} visible")
    single = multirank.rollout_generations(engine)
    label = ", ".join(f"{k}={v}" for k, v in layout.items())
    try:
        ranks = launch_torchrun(multirank.__file__, world, [
            h.subject.name, h.model_path("llama"),
            json.dumps({"parallel": layout, "role": "rollout", "dtype": h.dtype, "device": h.device}),
        ], timeout=400)
    except LaunchError as e:
        h.fail(f"the rollout engine failed under torchrun with {label}: {str(e)[-2500:]}")
    for rank, result in enumerate(ranks):
        for case, want in single.items():
            got = result[case]
            what = f"rank {rank}: {case} generation with {label} vs one process"
            h.expect(bool(torch.equal(got["response_ids"], want["response_ids"])
                          and torch.equal(got["response_mask"], want["response_mask"])),
                     f"{what}: tokens {got['response_ids'].tolist()}, one process gives {want['response_ids'].tolist()}")
            h.close_to(got["rollout_log_probs"], want["rollout_log_probs"], "log_probs", f"{what}: rollout_log_probs",
                       mask=want["response_mask"])


@check("invariance", gates=("rollout.tensor_parallel",))
def check_rollout_tensor_parallel_invariance(h: Harness) -> None:
    """A tp=2 rollout under torchrun generates the single-process tokens and rollout log-probs on every rank."""
    _rollout_layout(h, {"tp": 2}, "tensor_parallel")


@check("invariance", gates=("rollout.pipeline_parallel",))
def check_rollout_pipeline_parallel_invariance(h: Harness) -> None:
    """A pp=2 rollout under torchrun generates the single-process tokens and rollout log-probs on every rank."""
    _rollout_layout(h, {"pp": 2}, "pipeline_parallel")


def _undeclared_settings(h: Harness, role: Role) -> list[tuple[str, dict[str, Any]]]:
    """Spec settings the engine of ``role`` does not declare: other dtypes, gradient checkpointing, parallel
    sizes of 2 (tp, pp, and a training engine's dp)."""
    caps = _role_caps(h, role)
    out: list[tuple[str, dict[str, Any]]] = [
        (f"dtype={dtype!r} (declared dtypes: {sorted(caps.dtypes)})", {"dtype": dtype})
        for dtype in ("float32", "bfloat16", "float16") if dtype not in caps.dtypes
    ]
    if role != "rollout" and not caps.gradient_checkpointing:
        out.append(("gradient_checkpointing=True (declared gradient_checkpointing=False)",
                    {"gradient_checkpointing": True}))
    for key, name in (("tp", "tensor_parallel"), ("pp", "pipeline_parallel"), ("dp", "data_parallel")):
        if hasattr(caps, name) and not getattr(caps, name):
            out.append((f"parallel {key}=2 (declared {name}=False)", {"parallel": ParallelSizes(**{key: 2})}))
    return out


@check("robustness", gates=("training.dtypes", "rollout.dtypes", "training.gradient_checkpointing",
                             "training.tensor_parallel", "training.pipeline_parallel", "training.data_parallel",
                             "rollout.tensor_parallel", "rollout.pipeline_parallel"))
def check_undeclared_settings_refused(h: Harness) -> None:
    """An engine (actor, critic, rollout) asked for a dtype, gradient checkpointing or a parallel size of 2 (tp, pp, a training engine's dp) it does not declare refuses to build with a ConfigError, instead of running an unchecked configuration or ignoring the setting."""
    tried = 0
    roles: tuple[Role, ...] = tuple(r for r in ("actor", "critic", "rollout") if h.provides(h.subject, r))
    if not roles:
        h.skip(f"backend {h.subject.name!r} provides no actor, critic or rollout engine")
    for role in roles:
        for setting, kw in _undeclared_settings(h, role):
            tried += 1
            try:
                if role == "rollout":
                    h.rollout(fresh=True, **kw)
                else:
                    h.training(role, fresh=True, **kw)
            except ConfigError:
                continue
            except Exception as e:
                h.fail(f"the {role} engine asked for {setting} raised {type(e).__name__}: {e}; refuse a setting the "
                       "backend does not declare with verl_core.ConfigError naming it")
            else:
                why = ("the trainer's memory budget assumes recomputed activations when it asks for them"
                       if "gradient_checkpointing" in kw else "a process that runs alone while the spec says its "
                       "group has two ranks computes a different update" if "parallel" in kw
                       else "the suite checks an engine in its declared dtypes only")
                h.fail(f"the {role} engine built with {setting}: refuse a setting the backend does not declare with "
                       "a ConfigError naming it, or declare it and be checked in it (nothing upstream compares an "
                       f"EngineSpec with the capabilities; {why})")
            finally:
                h.close_fresh()
    if not tried:
        h.skip(f"the backend's {', '.join(roles)} engine(s) declare every dtype, gradient checkpointing and "
               "parallel layout")
