"""LoRA (``EngineSpec.lora``): the adapted model's numbers, the frozen base, syncs and checkpoints.

Every check is gated by ``training.lora`` and starts the engine from the test kit's crafted PEFT
adapter (:func:`~verl_conformance.testkit.lora.lora_adapter`: rank 4, alpha 8, nonzero ``A`` and
``B`` on every projection), so a wrong scale, a swapped factor or a disabled adapter shows in
every output. The sync, two-thread and checkpoint checks start from that adapter plus a fully trained
``model.norm`` (``LoraSpec.full``) far from the base's; the sync check also samples from an adapter
rollout built from that folder, and the two-thread check calls ``forward`` and ``base_forward`` at
once, as the trainer does. The float64 references are the suite's own: the base
folder with ``W + alpha / rank * B A`` merged in float64, and a float64 base model with the suite's
LoRA layers for the gradients of ``A`` and ``B``.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from verl_conformance.checks._registry import check
from verl_conformance.checks.stateful import STATE_OPTIM
from verl_conformance.checks.weight_sync import folder_weights
from verl_conformance.harness import (
    SUITE_OPTIM,
    Harness,
    collect_stream,
    exported_weights,
    recover_grads,
)
from verl_conformance.losses import TOKEN_MEAN_PG
from verl_conformance.reference import ReferenceModel, cached_outputs
from verl_conformance.testkit import tolerance
from verl_conformance.testkit.crafted import _copy_with_weights
from verl_conformance.testkit.lora import (
    LORA_ALPHA,
    LORA_RANK,
    lora_adapter,
    lora_spec,
    merged_model,
    target_weights,
)
from verl_core import (
    GlobalBatchStats,
    LoraSpec,
    RolloutEngine,
    SamplingParams,
    StepMetrics,
    StreamWeightSync,
    TensorBatch,
    TrainingEngine,
    WeightCommit,
    WeightManifest,
    WeightSync,
)
from verl_core.enginekit.lora import LORA_A, LORA_B, read_adapter_folder, write_adapter_folder
from verl_core.kernel.engine import DEFAULT_LORA_TARGETS

_SCALE = LORA_ALPHA / LORA_RANK
_TEMPERATURES = (1.0, 0.7)
_FULL = "model.norm"  # trained fully by the sync, base and checkpoint checks


def _lora(h: Harness) -> LoraSpec:
    """The suite's LoRA spec (starting from the crafted adapter); skips a backend that declares no LoRA."""
    if not h.training().capabilities.lora:
        h.skip("backend declares lora=False (it trains no LoRA adapters)")
    return lora_spec()


def _adapter(engine: TrainingEngine) -> dict[str, Tensor]:
    return collect_stream(engine.export_adapter())[1]


def _update(engine: TrainingEngine, batch: TensorBatch) -> tuple[float, StepMetrics]:
    metrics = engine.forward_backward(batch, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
    return metrics["loss"], engine.optimizer_step()


def _starts_from_init(h: Harness, engine: TrainingEngine) -> dict[str, Tensor]:
    """The engine's adapter, which must be the crafted adapter it was built from."""
    got = _adapter(engine)
    want = {n.removeprefix("base_model.model."): t for n, t in
            load_file(f"{lora_adapter()}/adapter_model.safetensors").items()}
    h.expect(set(got) == set(want), f"export_adapter names differ from the adapter's (LoraSpec.init_path): missing "
             f"{sorted(set(want) - set(got))[:3]}, unexpected {sorted(set(got) - set(want))[:3]}")
    for name, t in want.items():
        h.close_to(got[name].float(), t, "weights", f"export_adapter of an engine built from LoraSpec.init_path: {name}")
    return got


class _LoraLinear(nn.Module):
    """A float64 reference LoRA layer: ``base(x) + scale * lora_B(lora_A(x))``, the base frozen."""

    def __init__(self, base: nn.Linear, a: Tensor, b: Tensor) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.Linear(a.shape[1], a.shape[0], bias=False, dtype=torch.float64)
        self.lora_B = nn.Linear(b.shape[1], b.shape[0], bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base_layer(x) + _SCALE * self.lora_B(self.lora_A(x))
        return out


def _lora_reference(base: str, adapter: dict[str, Tensor]) -> ReferenceModel:
    """The float64 reference of the base folder with the suite's LoRA layers holding ``adapter``."""
    ref = ReferenceModel(base, SUITE_OPTIM)
    ref.model.requires_grad_(False)
    for module in target_weights(Path(base)):
        parent, _, attr = module.rpartition(".")
        owner = ref.model.get_submodule(parent)
        setattr(owner, attr, _LoraLinear(getattr(owner, attr), adapter[module + LORA_A].double(),
                                         adapter[module + LORA_B].double()))
    return ref


@check("numerics", gates=("training.lora",))
def check_lora_forward_and_grads_match_reference(h: Harness) -> None:
    """With a nonzero adapter, log_probs and entropy equal the float64 reference of W + alpha/rank * B A, and one update's loss, grad norm and A and B gradients equal the float64 LoRA reference."""
    spec = _lora(h)
    engine = h.training(fresh=True, lora=spec)
    before = _starts_from_init(h, engine)
    merged = str(merged_model())
    for temp in _TEMPERATURES:
        batch = h.batch(seed=80, temperature=temp)
        got = engine.forward(batch, ["log_probs", "entropy"])
        ref = cached_outputs(merged, batch, ("log_probs", "entropy"))
        for key in ("log_probs", "entropy"):
            h.close_to(got[key], ref[key], key, f"LoRA {key} at temperature {temp} vs the float64 reference of "
                       "W + alpha/rank * B A (rank 4, alpha 8, nonzero A and B)", mask=batch["response_mask"])
    batch = h.batch(seed=81, rl_fields=True)
    loss, step = _update(engine, batch)
    grads = recover_grads(before, _adapter(engine), engine.spec.optim)
    ref_step = _lora_reference(h.model_path("llama"), before).loss_and_grads(
        batch, TOKEN_MEAN_PG, GlobalBatchStats.of(batch))
    h.scalar_close(loss, ref_step.loss, "loss", "LoRA loss of one update vs the float64 LoRA reference")
    h.scalar_close(step.grad_norm, ref_step.grad_norm, "loss",
                   "LoRA grad norm of one update vs the float64 LoRA reference (only A and B get gradients)")
    for name in before:
        h.close_to(grads[name], ref_step.grads[name], "grad",
                   f"LoRA gradient of {name} vs the float64 LoRA reference (recovered from the first AdamW step)")


@check("numerics", gates=("training.lora",))
def check_lora_base_forward_is_base_model(h: Harness) -> None:
    """base_forward of an engine with a nonzero adapter equals the float64 reference of the base folder (the adapter disabled), while forward does not."""
    engine = h.training(fresh=True, lora=_lora(h))
    for temp in _TEMPERATURES:
        batch = h.batch(seed=82, temperature=temp)
        got = engine.base_forward(batch, ["log_probs", "entropy"])
        ref = cached_outputs(h.model_path("llama"), batch, ("log_probs", "entropy"))
        for key in ("log_probs", "entropy"):
            h.close_to(got[key], ref[key], key, f"base_forward {key} at temperature {temp} vs the float64 reference "
                       "of the base folder (the adapter must be disabled)", mask=batch["response_mask"])
        adapted = engine.forward(batch)["log_probs"]
        m = batch["response_mask"]
        h.expect(float((adapted.double() - ref["log_probs"]).abs()[m].max()) > 1e-2,
                 "forward of an engine with a nonzero adapter equals the base model: the adapter is not applied")


@check("stateful", gates=("training.lora",))
def check_lora_base_unchanged(h: Harness) -> None:
    """After two updates the base is bit-unchanged: base_forward gives the same bits, also with a module trained fully (LoraSpec.full), and the merged export is the folder's tensors (plus alpha/rank * B A on the targets)."""
    engine = h.training(fresh=True, lora=_lora(h))
    batch = h.batch(seed=83)
    base_before = engine.base_forward(batch, ["log_probs"])["log_probs"]
    for seed in (84, 85):
        _update(engine, h.batch(seed=seed, rl_fields=True))
    base_after = engine.base_forward(batch, ["log_probs"])["log_probs"]
    h.expect(torch.equal(base_after, base_before),
             "base_forward changed after two updates: the base weights were trained (only the adapter may be)")
    folder = folder_weights(h.model_path("llama"))
    # a fully trained module is part of what base_forward leaves out: its base values serve there
    full = h.training(fresh=True, lora=LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, full=(_FULL,)))
    full_before = full.base_forward(batch, ["log_probs"])["log_probs"]
    for seed in (84, 85):
        _update(full, h.batch(seed=seed, rl_fields=True))
    trained = _adapter(full).get(_FULL + ".weight")
    h.expect(trained is not None and not torch.equal(trained.float(), folder[_FULL + ".weight"].float()), f"with LoraSpec(full=({_FULL!r},)) export_adapter holds no trained "
             f"{_FULL}.weight after two updates: a fully trained module must train and be streamed under its name")
    h.expect(torch.equal(full.base_forward(batch, ["log_probs"])["log_probs"], full_before),
             f"base_forward of an engine that trains {_FULL} fully (LoraSpec.full) changed after two updates: "
             "the trained values of a full module must be left out of base_forward like the adapter")
    merged = exported_weights(engine)
    adapter = _adapter(engine)
    for name, w in folder.items():
        if name not in merged:
            continue  # a tied lm_head is not streamed
        module = name.removesuffix(".weight")
        got = merged[name]
        if module + LORA_A in adapter:
            want = w.double() + _SCALE * adapter[module + LORA_B].double() @ adapter[module + LORA_A].double()
            h.close_to(got.float(), want, "weights", f"merged export of {name} vs the folder's W + alpha/rank * B A "
                       "of the exported adapter (the base must stay the folder's)")
        else:
            h.expect(torch.equal(got, w.to(got.dtype)),
                     f"merged export of {name} (no adapter) differs from the folder's tensor: the base was trained")


_THREAD_CALLS = 12  # forward calls of each of the two threads
_THREADS_DEADLINE_S = 180.0  # both threads' calls; past it the engine is taken to hang


def _forwards_on_two_threads(engine: TrainingEngine, batch: TensorBatch) -> tuple[dict[str, list[Tensor]], list[str], bool]:
    """``forward`` on one thread and ``base_forward`` on another, :data:`_THREAD_CALLS` times each,
    started together; every call's log_probs by method, the errors raised, and whether both ended."""
    got: dict[str, list[Tensor]] = {"forward": [], "base_forward": []}
    errors: list[str] = []
    start = threading.Barrier(2)

    def calls(method: str) -> None:
        run = engine.forward if method == "forward" else engine.base_forward
        try:
            start.wait(timeout=_THREADS_DEADLINE_S)
            for _ in range(_THREAD_CALLS):
                got[method].append(run(batch, ["log_probs"])["log_probs"])
        except Exception as e:
            other = "base_forward" if method == "forward" else "forward"
            errors.append(f"{method} raised {type(e).__name__}: {e} while {other} ran on another thread")
            start.abort()

    threads = [threading.Thread(target=calls, args=(m,), daemon=True, name=f"verl-conformance-{m}") for m in got]
    for t in threads:
        t.start()
    deadline = time.monotonic() + _THREADS_DEADLINE_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return got, errors, not any(t.is_alive() for t in threads)


@check("stateful", gates=("training.lora",))
def check_lora_forwards_on_two_threads(h: Harness) -> None:
    """forward and base_forward of a LoRA engine that also trains model.norm fully (LoraSpec.full, started far from the folder's values) called at once from two threads (as the trainer does for the actor and the reference) each give what they give alone: the adapter on or off and the fully trained module's trained or base values per call, not per engine."""
    with tempfile.TemporaryDirectory(prefix="verl-conformance-lora-") as tmp:
        # the full module far from the base's: a swap of its values that another thread sees shows too
        engine = h.training(fresh=True, lora=_adapter_with_full(h, Path(tmp) / "adapter"))
        batch = h.batch(seed=91)
        mask = batch["response_mask"].cpu()
        alone = {"forward": engine.forward(batch, ["log_probs"])["log_probs"],
                 "base_forward": engine.base_forward(batch, ["log_probs"])["log_probs"]}
        apart = float((alone["forward"].double() - alone["base_forward"].double()).abs().cpu()[mask].max())
        h.expect(apart > 1e-2, f"forward and base_forward of an engine with a nonzero adapter agree (max log-prob "
                 f"difference {apart:.3g}): the adapter and the fully trained {_FULL} are not applied, so a "
                 "mix-up between them cannot show")
        got, errors, ended = _forwards_on_two_threads(engine, batch)
        h.expect(ended, f"forward and base_forward, called at once from two threads, did not return within "
                 f"{_THREADS_DEADLINE_S:g} s: they wait for each other (a deadlock)")
        h.expect(not errors, errors[0] if errors else "")
        tol = tolerance(h.dtype, "log_probs")
        for method, other in (("forward", "base_forward"), ("base_forward", "forward")):
            want, wrong = alone[method].double().cpu(), alone[other].double().cpu()
            bad = []
            for i, out in enumerate(got[method]):
                lp = out.double().cpu()
                off = (lp - want).abs()[mask]
                if not bool((off <= tol.atol + tol.rtol * want.abs()[mask]).all()) or \
                        float(off.max()) >= float((lp - wrong).abs()[mask].max()):
                    bad.append((i, float(off.max()), float((lp - wrong).abs()[mask].max())))
            if bad:
                i, off_max, wrong_max = bad[0]
                h.fail(f"{method} called while {other} ran on another thread (LoraSpec.full=({_FULL!r},)): "
                       f"{len(bad)} of {len(got[method])} calls give other log_probs than {method} alone (call {i}: "
                       f"max difference {off_max:.3g} from {method} alone, {wrong_max:.3g} from {other} alone; "
                       f"{h.dtype} tier atol={tol.atol:g}). The adapter was switched on or off, or the fully trained "
                       f"{_FULL}'s values swapped between trained and base, for the whole engine by the other "
                       "thread: pass the choice down the call, or hold one lock over the switch (or the swap and "
                       "the swap back) and the forward")


def _sync(h: Harness) -> WeightSync:
    if h.subject.registered:
        from verl_core import get_weight_sync

        return get_weight_sync(h.subject.name, h.subject.name)
    return StreamWeightSync()


def _adapter_with_full(h: Harness, out: Path) -> LoraSpec:
    """The suite's LoRA spec that also trains :data:`_FULL` fully, starting from an adapter folder written
    to ``out``: the crafted ``A`` and ``B`` and a :data:`_FULL` far from the base folder's (seeded), so a
    rollout serving the base's values of the fully trained module samples visibly otherwise."""
    spec = _lora(h)
    tensors = {n.removeprefix("base_model.model."): t
               for n, t in load_file(f"{lora_adapter()}/adapter_model.safetensors").items()}
    norm = folder_weights(h.model_path("llama"))[_FULL + ".weight"].float()
    g = torch.Generator().manual_seed(17)
    tensors[_FULL + ".weight"] = norm * (1.0 + 0.5 * torch.randn(norm.shape, generator=g))
    out.mkdir()
    write_adapter_folder(out, spec, tensors, base_model=h.model_path("llama"))
    return dataclasses.replace(spec, full=(_FULL,), init_path=str(out))


def _merged_folder(h: Harness, adapter: dict[str, Tensor], out: Path) -> Path:
    """The base folder with ``adapter`` merged in, written to ``out``: each target's W + alpha/rank * B A
    (float64) and the adapter's fully trained tensors in place of the base's."""
    folder = dict(folder_weights(h.model_path("llama")))
    for module in target_weights(Path(h.model_path("llama"))):
        w = folder[module + ".weight"]
        folder[module + ".weight"] = (w.double() + _SCALE * adapter[module + LORA_B].double()
                                      @ adapter[module + LORA_A].double())
    for name, t in adapter.items():
        if name in folder and not name.endswith((LORA_A, LORA_B)):
            folder[name] = t  # a fully trained module's values, as the engine exports them
    out.mkdir()
    _copy_with_weights(Path(h.model_path("llama")), out, folder)
    return out


def _samples_as_loaded(h: Harness, got: TensorBatch, want: TensorBatch, merged: Path, what: str, served: str) -> None:
    """``got`` (a rollout's samples) are ``want``'s (a rollout loaded with the ``merged`` folder): in float32
    the same tokens and close rollout_log_probs; in every dtype rollout_log_probs close to the folder's
    float64 reference."""
    if h.dtype == "float32":
        h.expect(torch.equal(got["response_ids"], want["response_ids"]),
                 f"{what}: the rollout samples other tokens than a rollout loaded with {served} (first rows "
                 f"{got['response_ids'][:2].tolist()} vs {want['response_ids'][:2].tolist()})")
        h.close_to(got["rollout_log_probs"], want["rollout_log_probs"], "log_probs",
                   f"{what}: rollout_log_probs vs a rollout loaded with {served}", mask=want["response_mask"])
    ref = ReferenceModel(str(merged)).outputs(got)["log_probs"]
    h.close_to(got["rollout_log_probs"], ref, "log_probs", f"{what}: rollout_log_probs vs the float64 reference of "
               f"{served}", mask=got["response_mask"])


@check("weight_sync", gates=("training.lora", "rollout.lora_adapters"))
def check_lora_sync_serves_merged_weights(h: Harness) -> None:
    """After a LoRA update (an adapter and a fully trained module, LoraSpec.full) and a sync (merged weights; the adapter where the rollout declares lora_adapters) the rollout samples exactly as a rollout loaded with W + alpha/rank * B A and the trained module; a rollout declaring lora_adapters built from LoraSpec.init_path samples, before any sync, exactly as a rollout loaded with that folder's adapter and module merged in."""
    with tempfile.TemporaryDirectory(prefix="verl-conformance-lora-") as tmp:
        spec = _adapter_with_full(h, Path(tmp) / "adapter")
        prompts = h.batch(seed=87, batch_size=4).select("prompt_ids", "prompt_mask", "group_ids")
        params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=13)
        modes = ["merged weights"]
        probe = h.rollout()
        if probe.capabilities.lora_adapters:
            modes.append("the adapter")
            # built from the folder, as the actor is: it serves the folder's adapter and full module until a sync
            merged_init = _merged_folder(h, read_adapter_folder(spec.init_path, spec), Path(tmp) / "merged-init")
            want = h.rollout(fresh=True, model_path=str(merged_init)).generate(prompts, params)
            got = h.rollout(fresh=True, lora=spec).generate(prompts, params)
            _samples_as_loaded(
                h, got, want, merged_init, f"a rollout declaring lora_adapters built with LoraSpec.init_path (the "
                f"crafted adapter and a {_FULL} far from the base's, LoraSpec.full=({_FULL!r},)), before any sync",
                f"the folder's W + alpha/rank * B A and {_FULL} merged in; an adapter rollout starts from "
                "init_path like the actor (read_adapter_folder), not from B = 0 and the base")
        engine = h.training(fresh=True, lora=spec)
        _update(engine, h.batch(seed=86, rl_fields=True))
        adapter = _adapter(engine)
        h.expect(_FULL + ".weight" in adapter, f"with LoraSpec(full=({_FULL!r},)) export_adapter streams no "
                 f"{_FULL}.weight: a fully trained module must be streamed under its name")
        merged = _merged_folder(h, adapter, Path(tmp) / "merged")
        loaded = h.rollout(fresh=True, model_path=str(merged))
        want = loaded.generate(prompts, params)
        ref = ReferenceModel(str(merged)).outputs(want)["log_probs"]
        h.close_to(want["rollout_log_probs"], ref, "log_probs",
                   "a rollout loaded with the merged folder vs its float64 reference", mask=want["response_mask"])
        for mode in modes:
            # the adapter rollout starts from B = 0 and the base's values of the full module: the sync
            # must bring every tensor of the adapter stream, the fully trained ones too
            rollout: RolloutEngine = (h.rollout(fresh=True, lora=dataclasses.replace(spec, init_path=""))
                                      if mode == "the adapter" else h.rollout(fresh=True))
            _sync(h).sync(engine, rollout, version=1)
            got = rollout.generate(prompts, params)
            _samples_as_loaded(
                h, got, want, merged, f"after a LoRA sync of {mode} (LoraSpec.full=({_FULL!r},))",
                f"the merged weights W + alpha/rank * B A and the trained {_FULL}; the sync must apply every "
                "tensor of the stream, the fully trained modules' too")


@check("stateful", gates=("training.lora", "training.checkpoint"))
def check_lora_checkpoint_round_trip(h: Harness) -> None:
    """save_checkpoint of a LoRA engine that also trains model.norm fully (LoraSpec.full, started far from the folder's values), load_checkpoint into a fresh one built from the base (no init_path): the next two updates give the same loss, grad norm, adapter and trained module as the engine that kept its state (in bfloat16 the module's float32 masters must be restored too)."""
    _lora(h)
    if not h.training().capabilities.checkpoint:
        h.skip("backend declares checkpoint=False")
    with tempfile.TemporaryDirectory(prefix="verl-conformance-") as tmp:
        spec = _adapter_with_full(h, Path(tmp) / "adapter")
        kept = h.training(fresh=True, lora=spec, optim=STATE_OPTIM)
        _update(kept, h.batch(seed=88, rl_fields=True))
        path = Path(tmp) / "checkpoint"
        kept.save_checkpoint(path)
        # from the base: everything the kept engine trains must come from the checkpoint
        restored = h.training(fresh=True, lora=dataclasses.replace(spec, init_path=""), optim=STATE_OPTIM)
        restored.load_checkpoint(path)
    what = "after save_checkpoint and load_checkpoint of a LoRA engine into a fresh one"
    for i, seed in enumerate((89, 90), start=1):
        batch = h.batch(seed=seed, rl_fields=True)
        loss_r, step_r = _update(restored, batch)
        loss_k, step_k = _update(kept, batch)
        h.scalar_close(loss_r, loss_k, "loss", f"{what}: loss of update {i}")
        h.scalar_close(step_r.grad_norm, step_k.grad_norm, "loss", f"{what}: grad norm of update {i}")
        got, want = _adapter(restored), _adapter(kept)
        h.expect(set(got) == set(want), f"{what}: adapter names differ after update {i}")
        for name, t in want.items():
            h.close_to(got[name].float(), t.float(), "weights",
                       f"{what}: {name} after update {i} differs from the engine that kept its state "
                       "(the adapter, the fully trained module, their Adam moments, float32 masters or the step "
                       "were not restored)")


_DROPOUT = 0.5  # LoraSpec.dropout of the dropout check


def _squared_drift(batch: TensorBatch, stats: GlobalBatchStats) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean over response tokens of (log_probs - old_log_probs)^2: 0 exactly when the update's
    forward gives the log-probs of ``old_log_probs``."""
    mask = batch["response_mask"].to(batch["log_probs"].dtype)
    drift = (batch["log_probs"] - batch["old_log_probs"]).pow(2) * mask
    loss = drift.sum() / max(stats.num_tokens, 1)
    return loss, {"drift": loss.detach()}


@check("numerics", gates=("training.lora",))
def check_lora_dropout_only_while_training(h: Harness) -> None:
    """With LoraSpec.dropout=0.5 and a nonzero adapter, forward is the float64 reference of W + alpha/rank * B A and gives the same bits twice (no dropout outside an update), while the update's own forward drops adapter inputs (its log-probs move away from forward's)."""
    from verl_conformance.losses import SuiteLoss

    engine = h.training(fresh=True, lora=dataclasses.replace(_lora(h), dropout=_DROPOUT))
    batch = h.batch(seed=92, rl_fields=True)
    first = engine.forward(batch, ["log_probs"])["log_probs"]
    again = engine.forward(batch, ["log_probs"])["log_probs"]
    what = f"forward of an engine with LoraSpec.dropout={_DROPOUT}"
    h.expect(torch.equal(first, again), f"{what} gave different log_probs on two calls of the same batch: dropout "
             "(or other randomness) runs outside an update, where log-probs must be a function of the weights")
    ref = cached_outputs(str(merged_model()), batch, ("log_probs",))
    h.close_to(first, ref["log_probs"], "log_probs", f"{what} vs the float64 reference of W + alpha/rank * B A "
               "(dropout applies to the update's forward only)", mask=batch["response_mask"])
    drift = SuiteLoss("lora_dropout_drift", _squared_drift)
    probe = batch.update({"old_log_probs": first})
    metrics = engine.forward_backward(probe, drift, GlobalBatchStats.of(probe))
    h.expect(metrics["loss"] > 1e-6,
             f"the update's forward of an engine with LoraSpec.dropout={_DROPOUT} gave forward's log-probs (mean "
             f"squared difference {metrics['loss']:.2e} over response tokens): the adapter's dropout is not applied "
             "while training")


@check("numerics", gates=("training.lora",))
def check_lora_fresh_adapter_is_seeded(h: Harness) -> None:
    """An adapter started without LoraSpec.init_path has B = 0 and a nonzero A that is a deterministic function of EngineSpec.seed: two engines built from the same spec export the same adapter, bit for bit, and one update of each gives the same loss and adapter (two runs with one seed train alike)."""
    spec = dataclasses.replace(_lora(h), init_path="")
    engines = [h.training(fresh=True, lora=spec, seed=7) for _ in range(2)]
    first, second = (_adapter(e) for e in engines)
    what = "export_adapter of a fresh LoRA engine (LoraSpec.init_path empty, EngineSpec.seed=7)"
    h.expect(bool(first) and set(first) == set(second), f"{what}: two engines built from one spec stream different "
             f"names ({sorted(set(first) ^ set(second))[:3]})")
    for name, t in first.items():
        if name.endswith(LORA_B):
            h.expect(not t.any(), f"{what}: {name} is not zero; B starts at zero so step 0 is the base model")
        if name.endswith(LORA_A):
            h.expect(bool(t.any()), f"{what}: {name} is all zeros; with B = 0 too no gradient would reach the adapter")
        h.expect(torch.equal(t, second[name]), f"{what}: {name} differs between two engines built from the same spec: "
                 "A must be a deterministic function of spec.seed (draw it from a generator seeded with it, not the "
                 "global generator's state or the clock), or two runs with one seed train differently")
    batch = h.batch(seed=93, rl_fields=True)
    (loss_a, _), (loss_b, _) = (_update(e, batch) for e in engines)
    h.scalar_close(loss_a, loss_b, "loss", f"{what}: the loss of the first update of two engines built from one spec")
    updated = _adapter(engines[1])
    for name, t in _adapter(engines[0]).items():
        h.close_to(t.float(), updated[name].float(), "weights",
                   f"{what}: {name} after one update of two engines built from one spec")


@check("weight_sync", gates=("training.lora",))
def check_lora_adapter_stream_version(h: Harness) -> None:
    """export_adapter streams manifest, chunks, commit, whose version (manifest and commit) is the count of applied optimizer steps: 0 as built, then 1 and 2 after two updates, as export_weights'."""
    engine = h.training(fresh=True, lora=_lora(h))
    for steps in range(3):
        if steps:
            _update(engine, h.batch(seed=93 + steps, rl_fields=True))
        msgs, _ = collect_stream(engine.export_adapter())
        manifest, commit = msgs[0], msgs[-1]
        h.expect(isinstance(manifest, WeightManifest) and isinstance(commit, WeightCommit),
                 f"export_adapter must stream manifest, chunks, commit; got {type(manifest).__name__} first and "
                 f"{type(commit).__name__} last")
        assert isinstance(manifest, WeightManifest) and isinstance(commit, WeightCommit)
        h.expect(manifest.version == commit.version == steps,
                 f"export_adapter after {steps} optimizer step(s) streams version {manifest.version} (commit "
                 f"{commit.version}); the version is the count of applied optimizer steps ({steps}), as in "
                 "export_weights: a rollout served the adapter reports it as its weight_version")


_LM_HEAD_TARGETS = (*DEFAULT_LORA_TARGETS, "lm_head")  # the seven projections and the untied LM head


@check("numerics", gates=("training.lora",))
def check_lora_lm_head_target(h: Harness) -> None:
    """With lm_head among LoraSpec.targets on the untied Llama (the crafted nonzero adapter on it and on the seven projections), log_probs equal the float64 reference of every W + alpha/rank * B A, the LM head's included, and export_weights streams lm_head.weight merged."""
    spec = lora_spec(targets=_LM_HEAD_TARGETS)
    if not h.training().capabilities.lora:
        h.skip("backend declares lora=False (it trains no LoRA adapters)")
    engine = h.training(fresh=True, lora=spec)
    what = f"an engine with LoraSpec.targets={list(_LM_HEAD_TARGETS)} on the untied Llama"
    adapter = _adapter(engine)
    h.expect("lm_head" + LORA_A in adapter and "lm_head" + LORA_B in adapter,
             f"{what}: export_adapter streams no lm_head.lora_A/B.weight; an untied lm_head is a linear module "
             "a target pattern may name, so it gets an adapter like the projections")
    batch = h.batch(seed=95, rl_fields=True)
    merged = merged_model(targets=_LM_HEAD_TARGETS)
    got = engine.forward(batch, ["log_probs"])["log_probs"]
    ref = cached_outputs(str(merged), batch, ("log_probs",))["log_probs"]
    h.close_to(got, ref, "log_probs", f"{what}: log_probs vs the float64 reference with every target merged, lm_head "
               "included (logits computed from lm_head.weight alone leave its adapter out)", mask=batch["response_mask"])
    exported = exported_weights(engine)
    h.close_to(exported["lm_head.weight"].float(), folder_weights(str(merged))["lm_head.weight"].float(), "weights",
               f"{what}: lm_head.weight of export_weights vs W + alpha/rank * B A")
