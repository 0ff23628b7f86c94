"""Invariances: results do not change with micro-batching, padding, batch order; sampling is seeded."""

from __future__ import annotations

from functools import partial
from typing import Any, Final

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.numerics import PERTURBED_FAMILIES, _folder, one_update
from verl_conformance.harness import Harness, exported_weights, recover_grads, weights_moved
from verl_conformance.losses import role_loss, role_output
from verl_core import (
    GlobalBatchStats,
    ModelOutput,
    Role,
    SamplingParams,
    TensorBatch,
    TrainingEngine,
)


def pad_more(batch: TensorBatch, prompt_cols: int, response_cols: int) -> TensorBatch:
    """The same samples with extra padding columns: prompts on the left, responses on the right."""
    pad = batch.meta.pad_token_id
    b = batch.batch_size
    fields: dict[str, torch.Tensor] = {}
    for name, t in batch.items():
        if name in ("prompt_ids", "prompt_mask"):
            fill = torch.full((b, prompt_cols), pad if name == "prompt_ids" else False, dtype=t.dtype)
            fields[name] = torch.cat([fill, t], 1)
        elif t.dim() == 2:
            fill_value = pad if name == "response_ids" else (False if t.dtype == torch.bool else 0)
            fields[name] = torch.cat([t, torch.full((b, response_cols), fill_value, dtype=t.dtype)], 1)
    return batch.update(fields)


@check("invariance", gates=("training.micro_batch_tokens", "training.packed_sequences", "training.values"))
def check_micro_batch_invariance(h: Harness) -> None:
    """log-probs, loss and gradients do not depend on micro_batch_size, micro_batch_tokens or a per-call budget, each of which the engine applies (its count of micro-batches is the kernel partitioner's); the same for the critic's values and value loss where the backend provides a critic declaring values (a critic-only backend: the critic alone)."""
    batch = h.batch(seed=20, rl_fields=True)
    for role in h.trained_roles():
        _micro_batch_invariance(h, role, batch)
        h.close_fresh()  # the role's engines, before the next role's are built


def _micro_batch_invariance(h: Harness, role: Role, batch: TensorBatch) -> None:
    """:func:`check_micro_batch_invariance` on the engines of ``role`` (an actor's messages unprefixed)."""
    variants = [{}, {"micro_batch_size": 1}, {"micro_batch_size": 4}]
    out, loss = role_output(role), role_loss(role)
    who = "" if role == "actor" else f"the {role}: "
    caps = h.training(role).capabilities
    if caps.micro_batch_tokens:
        variants.append({"micro_batch_tokens": 24})
    if caps.packed_sequences:  # the smallest budget a packing engine takes: it packs short samples together
        variants.append({"micro_batch_tokens": int(batch.seq_lengths().max())})
    base_lp = None
    for kw in variants:
        lp = h.training(role, **kw).forward(batch, [out])[out]  # type: ignore[arg-type]
        if base_lp is None:
            base_lp = lp
        else:
            h.close_to(lp, base_lp, out, f"{role} {out} with {kw} vs one micro-batch", mask=batch["response_mask"])
    base = None
    # the spec's micro-batching, and (forward_backward's max_tokens) the budget a trainer passes per call
    calls: list[tuple[dict[str, int], int | None]] = [(kw, None) for kw in variants]
    if caps.micro_batch_tokens:
        calls.append(({}, 24))
    for kw, budget in calls:
        engine = h.training(role, fresh=True, **kw)  # type: ignore[arg-type]
        metrics, norm, grads = one_update(h, engine, batch, loss, max_tokens=budget)
        tokens = budget or kw.get("micro_batch_tokens")
        parts = (batch.micro_batches(max_tokens=tokens, packed=caps.packed_sequences) if tokens
                 else batch.micro_batches(size=kw.get("micro_batch_size") or batch.batch_size))
        setting = f"max_tokens={budget}" if budget is not None else str(kw or "one micro-batch")
        h.expect(metrics["num_micro_batches"] == len(parts),
                 f"{who}forward_backward with {setting} ran {metrics['num_micro_batches']:g} micro-batches; the "
                 f"kernel's partitioner (batch.micro_batches) makes {len(parts)}: a budget or size that is not "
                 "applied leaves the memory it bounds unbounded (the trainer halves max_tokens after an out-of-memory "
                 "error)")
        if base is None:
            base = (metrics, norm, grads)
            continue
        label = f"with {kw} vs one micro-batch" if budget is None else f"with max_tokens={budget} vs one micro-batch"
        h.scalar_close(metrics["loss"], base[0]["loss"], "loss",
                       f"{who}loss {label} (the loss is normalised by global counts: an engine that averages "
                       "per micro-batch or over micro-batches changes it)")
        h.scalar_close(norm, base[1], "loss", f"{who}grad norm {label}")
        for name, g in base[2].items():
            h.close_to(grads[name], g, "grad", f"{who}gradient of {name} {label}")  # type: ignore[arg-type]


@check("invariance", gates=("training.entropy",))
def check_padding_invariance(h: Harness) -> None:
    """Extra left padding of prompts and right padding of responses changes no output on real tokens."""
    engine = h.training()
    outputs: tuple[ModelOutput, ...] = ("log_probs", "entropy") if engine.capabilities.entropy else ("log_probs",)
    batch = h.batch(seed=21)
    base = engine.forward(batch, outputs)
    padded = pad_more(batch, 5, 3)
    out = engine.forward(padded, outputs)
    r = batch.response_len
    for name in outputs:
        h.close_to(out[name][:, :r], base[name], name,
                   f"{name} with 5 more left-pad prompt columns and 3 more right-pad response columns "
                   "(position ids must be cumsum(mask) - 1, padding must be masked)",
                   mask=batch["response_mask"])
        h.expect(bool((out[name][:, r:] == 0).all()), f"{name} is not 0 in the added response padding")


@check("invariance")
def check_batch_order_invariance(h: Harness) -> None:
    """Permuting the samples of a batch permutes the outputs and changes nothing else."""
    engine = h.training()
    batch = h.batch(seed=22)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    base = engine.forward(batch)["log_probs"]
    out = engine.forward(batch.index(perm))["log_probs"]
    h.close_to(out, base[perm], "log_probs", "log_probs of a permuted batch vs the permuted log_probs",
               mask=batch["response_mask"][perm])


@check("invariance", gates=("rollout.seeding",))
def check_seeded_sampling_reproducible(h: Harness) -> None:
    """The same seed gives the same samples; per-sample seeding does not depend on batch order; seeds differ, and so do two unseeded calls."""
    engine = h.rollout()
    seeding = engine.capabilities.seeding
    if seeding == "none":
        h.skip("backend declares seeding='none' (sampling is not reproducible)")
    prompts = h.batch(seed=23, batch_size=4).select("prompt_ids", "prompt_mask", "group_ids")
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1234)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    for name in ("response_ids", "response_mask"):
        h.expect(bool(torch.equal(a[name], b[name])),
                 f"two generate() calls with seed={params.seed} gave different {name}: sampling is not "
                 "reproducible under a fixed seed")
    c = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=99))
    h.expect(not bool(torch.equal(a["response_ids"], c["response_ids"])),
             "seeds 1234 and 99 gave identical samples: the seed is ignored")
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    e, f = engine.generate(prompts, unseeded), engine.generate(prompts, unseeded)
    h.expect(not bool(torch.equal(e["response_ids"], f["response_ids"])),
             "two generate() calls with seed=None gave identical samples: seed=None means unseeded (a fresh "
             "random seed per call), not a fixed default seed")
    if seeding != "per_sample":
        return
    rev = torch.arange(prompts.batch_size - 1, -1, -1)
    d = engine.generate(prompts.index(rev), params)
    order = torch.arange(a.batch_size).view(-1, 2)[rev].flatten()
    w = min(a.response_len, d.response_len)
    same = torch.equal(d["response_ids"][:, :w], a["response_ids"][order][:, :w]) and torch.equal(
        d["response_mask"].sum(1), a["response_mask"][order].sum(1))
    h.expect(bool(same), "with seeding='per_sample', reversing the prompt order changed the samples of "
             "(group_id, sample_index); each sample's stream must depend only on (seed, group id, index)")


MODEL_PARALLEL_FOLDERS: Final = ("llama", *(m for m, t, _ in PERTURBED_FAMILIES if t != "llama"))
"""Folders of :func:`check_tensor_parallel_invariance` and :func:`check_pipeline_parallel_invariance`: the
Llama, and the Qwen2 and tied Qwen3 folders with every tensor moved. Under tp the heads are split across
ranks, and with them Qwen2's q/k/v biases; Qwen3's q/k norm weights are replicated but act on each rank's
heads only, so their gradients are partial sums until the tensor-parallel ranks add them up. Under pp the
tied Qwen3's embedding lives on the first and the last stage, whose two gradients must be added up. The
Llama folder (untied) has none of these. The data-parallel check keeps the Llama only: every parameter is
replicated and summed over the replicas alike, whatever the family."""


def _layout_invariance(h: Harness, layout: dict[str, int], capability: str,
                       folders: tuple[str, ...] = ("llama",)) -> None:
    """One process vs ``layout`` under torchrun, on each of ``folders`` (one launch builds their engines in
    turn): log-probs, loss, grad norm and every gradient. A folder of :data:`PERTURBED_FAMILIES` the
    single-process engine refuses with a ConfigError naming its model_type is noted as refused."""
    engine = h.training()
    if not getattr(engine.capabilities, capability):
        h.skip(f"backend declares {capability}=False")
    if not h.subject.registered:
        h.skip("multi-rank checks build engines through the registry; install the backend as a plugin")
    from verl_conformance import multirank

    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    if h.device.startswith("cuda") and torch.cuda.device_count() < world:
        h.skip(f"{world} ranks on {h.device} need {world} GPUs; {torch.cuda.device_count()} visible")
    batch = multirank.dp_batch()
    baselines: dict[str, _Baseline] = {}
    refused: list[str] = []
    for model in folders:
        single = _single_process_actor(h, model, refused)
        if single is None:
            continue
        baselines[model] = _baseline(h, single, batch, "actor")
        h.close_fresh()  # one folder's engine at a time
    label = ", ".join(f"{k}={v}" for k, v in layout.items())
    paths = [h.model_path(m) for m in baselines]
    launched = _launch(h, world, paths, {"parallel": layout}, f"with {label} (folders {', '.join(baselines)})")
    for i, (model, baseline) in enumerate(baselines.items()):
        _compare_ranks(h, [r[i] for r in launched], batch, baseline, layout, "actor", f"with {label} on {_folder(model)}")
    if len(folders) > 1:
        h.note(f"compared on {', '.join(baselines)}"
               + (f"; refused (ConfigError naming the model_type): {', '.join(refused)}" if refused else ""))
    if layout == {"dp": 2}:
        h.note(_critic_data_parallel(h))


_Baseline = tuple[Tensor, dict[str, Tensor], dict[str, float], float, dict[str, object], tuple[float, float]]
"""One process's outputs (log-probs or values), weights before the update, metrics, grad norm and gradients,
then the loss and grad norm of the next update, on the batch's first row alone."""


def _baseline(h: Harness, engine: TrainingEngine, batch: TensorBatch, role: Role) -> _Baseline:
    """What one process computes on ``batch``: the role's outputs, one update of the role's loss, then an
    update on the first row alone (what the ranks run after their all-empty step, which changes nothing)."""
    before = exported_weights(engine)
    output = role_output(role)
    base = engine.forward(batch, [output])[output]
    loss = role_loss(role)
    metrics, norm, grads = one_update(h, engine, batch, loss)
    one = batch.index(slice(0, 1))
    one_loss = engine.forward_backward(one, loss, GlobalBatchStats.of(one))["loss"]
    return base, before, metrics, norm, grads, (one_loss, engine.optimizer_step().grad_norm)


def _launch(h: Harness, world: int, paths: list[str], spec: dict[str, object], what: str) -> list[list[dict[str, Any]]]:
    """Each rank's results of :mod:`verl_conformance.multirank` on ``paths`` (its spec: ``spec`` with the
    suite's micro-batch size, dtype and device); fails naming ``what`` when the launch fails."""
    import json

    from verl_conformance import multirank
    from verl_conformance.testkit import LaunchError, launch_torchrun

    full = {**spec, "micro_batch_size": 2, "dtype": h.dtype, "device": h.device}
    try:
        ranks: list[list[dict[str, Any]]] = launch_torchrun(
            multirank.__file__, world, [h.subject.name, paths[0], json.dumps(full), *paths[1:]], timeout=400)
    except LaunchError as e:
        h.fail(f"the backend failed under torchrun {what}: {str(e)[-2500:]}")
    return ranks


def _compare_ranks(h: Harness, ranks: list[dict[str, Any]], batch: TensorBatch, baseline: _Baseline,
                   layout: dict[str, int], role: Role, where: str) -> None:
    """Each rank's outputs, loss, grad norm, gradients and all-empty step against one process's."""
    base, before, metrics, norm, grads, (one_loss, one_norm) = baseline
    output = role_output(role)
    out = torch.cat([r["outputs"] for r in ranks], 0) if layout.get("dp", 1) > 1 else ranks[0]["outputs"]
    h.close_to(out, base, output, f"{role} {output} {where} (rank 0, dp shards concatenated) vs one process",
               mask=batch["response_mask"])
    for rank, r in enumerate(ranks):
        h.scalar_close(r["loss"], metrics["loss"], "loss",
                       f"rank {rank}: {role} loss {where} vs one process (metrics are global: summed over ranks)")
        h.scalar_close(r["grad_norm"], norm, "loss", f"rank {rank}: {role} grad norm {where} vs one process")
    exported = next((r["weights"] for r in ranks if set(r["weights"]) >= set(grads)), None)
    if exported is None:
        h.fail(f"{where} no rank exported the {role}'s full weights (names per rank: "
               f"{[len(r['weights']) for r in ranks]}, expected {len(grads)})")
    for rank, r in enumerate(ranks):
        moved = weights_moved(r["weights"], r["after_empty"])
        h.expect(not moved, f"rank {rank} {where}: the {role}'s step after an all-empty mini-batch (no loss token) "
                 f"changed {len(moved)} tensors (first: {', '.join(moved[:3])}); it must drop the gradients "
                 "and change no weight, as in one process (TrainingEngine.optimizer_step)")
    zero = " (the second rank's share has 0 rows: it joins the collectives with none)" if layout.get("dp", 1) > 1 else ""
    for rank, r in enumerate(ranks):
        got_loss, got_norm = r["one_row"]
        h.scalar_close(got_loss, one_loss, "loss", f"rank {rank}: {role} loss of a one-row update{zero} {where} "
                       "vs one process")
        h.scalar_close(got_norm, one_norm, "loss", f"rank {rank}: {role} grad norm of a one-row update{zero} "
                       f"{where} vs one process")
    parallel_grads = recover_grads(before, exported)
    for name, g in grads.items():
        h.close_to(parallel_grads[name], g, "grad",  # type: ignore[arg-type]
                   f"{role} gradient of {name} {where} vs one process (framework averaging must be undone)")


def _critic_data_parallel(h: Harness) -> str:
    """The critic's values, value loss, grad norm, gradients and all-empty step under dp=2 against one
    process, on the value-head folder; returns what the pass notes."""
    if not h.provides(h.subject, "critic"):
        return "no critic provided"
    single = h.training("critic", fresh=True, micro_batch_size=2)
    if not single.capabilities.data_parallel:
        return "the critic declares data_parallel=False"
    from verl_conformance import multirank

    batch = multirank.dp_batch()
    baseline = _baseline(h, single, batch, "critic")
    h.close_fresh()
    ranks = _launch(h, 2, [h.model_path("value")], {"parallel": {"dp": 2}, "role": "critic"},
                    "with dp=2 (the critic on the value-head folder)")
    _compare_ranks(h, [r[0] for r in ranks], batch, baseline, {"dp": 2}, "critic", "with dp=2 on the value-head folder")
    return "the critic compared too"


def _single_process_actor(h: Harness, model: str, refused: list[str]) -> TrainingEngine | None:
    """A fresh single-process actor on ``model`` (micro_batch_size 2), or None where the folder is one of
    :data:`PERTURBED_FAMILIES` and the engine refuses it with a ConfigError naming its model_type (appended to
    ``refused``). Fails on another refusal or error (the suite's Llama folder is never refused here)."""
    model_type = next((t for m, t, _ in PERTURBED_FAMILIES if m == model and t != "llama"), None)
    build = partial(h.training, fresh=True, model=model, micro_batch_size=2)
    if model_type is None:
        return build()
    engine = h.unless_refused(build, kind="training", what=_folder(model), model_type=model_type)
    if engine is None:
        refused.append(model_type)
    return engine


@check("invariance", gates=("training.data_parallel",))
def check_data_parallel_invariance(h: Harness) -> None:
    """dp=2 under torchrun gives the single-process log-probs, loss, grad norm and gradients; a following step whose mini-batch has no loss token changes no weight on any rank, and an update on one row (the second rank's share has 0 rows) gives the single-process loss and grad norm. The same for the critic's values and value loss on the value-head folder where the backend provides a critic declaring data_parallel."""
    _layout_invariance(h, {"dp": 2}, "data_parallel")


@check("invariance", gates=("training.tensor_parallel",))
def check_tensor_parallel_invariance(h: Harness) -> None:
    """tp=2 under torchrun gives the single-process log-probs, loss, grad norm and gradients on Llama and on Qwen2 and tied Qwen3 folders with every tensor moved (the q/k/v biases split with the heads, the replicated q/k norm weights whose gradients each rank computes on its own heads only); a following step whose mini-batch has no loss token changes no weight; a Qwen folder refused with a ConfigError naming its model_type is listed as refused."""
    _layout_invariance(h, {"tp": 2}, "tensor_parallel", MODEL_PARALLEL_FOLDERS)


@check("invariance", gates=("training.pipeline_parallel",))
def check_pipeline_parallel_invariance(h: Harness) -> None:
    """pp=2 under torchrun gives the single-process log-probs, loss, grad norm and gradients on Llama and on Qwen2 and tied Qwen3 folders with every tensor moved (the tied embedding on the first and the last stage); a following step whose mini-batch has no loss token changes no weight; a Qwen folder refused with a ConfigError naming its model_type is listed as refused."""
    _layout_invariance(h, {"pp": 2}, "pipeline_parallel", MODEL_PARALLEL_FOLDERS)
