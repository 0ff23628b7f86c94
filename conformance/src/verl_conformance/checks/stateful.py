"""Stateful: checkpoints, offload/onload and sleep/wake keep weights, optimizer state and schedule.

Each check drives an engine into a state that only a faithful round trip restores: two updates
under a warmup schedule (so Adam's moments and the step counter matter), then compares the
restored engine with one that never left that state: the same exported weights and forward, and
the same *next three* updates (loss, grad norm, learning rate and the weights after each). State
that decides only a later update (a learning-rate scheduler whose position was not saved, while
the optimizer's saved learning rate serves the first update) shows from the second one on. The
round trips of training engines hold the actor and, beside it, a critic that declares values (under
the suite's value loss): a checkpoint without the value head or its optimizer state fails as the
actor's would. The same roles are held to offload's release of device memory (on CUDA).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.weight_sync import _serves as serves
from verl_conformance.checks.weight_sync import folder_stream, folder_weights, synced_to_alt
from verl_conformance.harness import SUITE_OPTIM, Harness, exported_weights
from verl_conformance.losses import role_loss, role_output
from verl_core import (
    CheckpointError,
    EngineAsleepError,
    GlobalBatchStats,
    Role,
    RolloutEngine,
    SamplingParams,
    StaleWeightsError,
    StepMetrics,
    TensorBatch,
    TrainingEngine,
    WeightMessage,
)

STATE_OPTIM = replace(SUITE_OPTIM, warmup_steps=4)
"""The suite's optimizer under a 4-step warmup: the learning rate of each step depends on the step
counter, and every step after the first on Adam's moments, so losing either changes the next update."""

_WARM_SEEDS = (60, 61)
_NEXT_SEEDS = (62, 66, 67)
_STRAY_SEED = 68  # a forward_backward whose gradients a load must drop
"""Batches of the updates compared after a round trip: the warmup's third and fourth steps and one past it."""
_FORWARD_SEED = 63


def _update(engine: TrainingEngine, batch: TensorBatch) -> tuple[float, StepMetrics]:
    """One update with the suite's loss of the engine's role (a critic's value loss, else the policy gradient)."""
    metrics = engine.forward_backward(batch, role_loss(engine.spec.role), GlobalBatchStats.of(batch))
    return metrics["loss"], engine.optimizer_step()


def _warm(h: Harness, engine: TrainingEngine) -> None:
    """Two updates, so the optimizer has moments and the schedule has advanced."""
    for seed in _WARM_SEEDS:
        _update(engine, h.batch(seed=seed, rl_fields=True))


def _same_weights(h: Harness, got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    h.expect(set(got) == set(want), f"{what}: exported names differ: missing {sorted(set(want) - set(got))[:4]}, "
             f"unexpected {sorted(set(got) - set(want))[:4]}")
    for name, w in want.items():
        h.close_to(got[name].float(), w.float(), "weights", f"{what}: {name}")


def _same_step(h: Harness, got: tuple[float, float, float], kept: tuple[float, float, float], label: str) -> None:
    """The loss, grad norm and learning rate of one update equal those of the engine that kept its state."""
    h.scalar_close(got[0], kept[0], "loss", f"{label}: loss")
    h.scalar_close(got[1], kept[1], "loss", f"{label}: grad norm")
    h.expect(abs(got[2] - kept[2]) <= 1e-9 * max(abs(kept[2]), 1.0),
             f"{label} ran at lr {got[2]:.6g}, the engine that kept its state at {kept[2]:.6g} (the schedule's "
             "position was not restored)")


def compare_next_update(h: Harness, restored: TrainingEngine, kept: TrainingEngine, what: str, cause: str) -> None:
    """The same forward, then the same next updates (loss, grad norm, lr, weights after each) on both engines."""
    batch = h.batch(seed=_FORWARD_SEED)
    out = role_output(kept.spec.role)
    h.close_to(restored.forward(batch, [out])[out], kept.forward(batch, [out])[out], out,
               f"{what}: {out} vs the engine that kept its state", mask=batch["response_mask"])
    for i, seed in enumerate(_NEXT_SEEDS):
        nth = ("first", "second", "third")[i] if i < 3 else f"#{i + 1}"
        label = f"{what}: the {nth} update after it"
        batch = h.batch(seed=seed, rl_fields=True)
        loss_r, step_r = _update(restored, batch)
        loss_k, step_k = _update(kept, batch)
        _same_step(h, (loss_r, step_r.grad_norm, step_r.lr), (loss_k, step_k.grad_norm, step_k.lr), label)
        _same_weights(h, exported_weights(restored), exported_weights(kept),
                      f"{label}: weights differ from the engine that kept its state ({cause})")


def _roles(h: Harness, capability: str) -> list[Role]:
    """:meth:`Harness.trained_roles` whose engines declare ``capability`` (``checkpoint``, ``offload``):
    the actor, and beside it a critic that declares values (its value head and the optimizer state of
    it are state a round trip must keep too); skip when none declares it."""
    roles: list[Role] = []
    refused: list[Role] = []
    for role in h.trained_roles():
        (roles if getattr(h.training(role).capabilities, capability) else refused).append(role)
    if not roles:
        h.skip(f"backend declares {capability}=False for the {' and the '.join(refused)}")
    if refused:
        h.note(f"the {' and the '.join(refused)} declares {capability}=False: not checked")
    return roles


def _of(role: Role, what: str) -> str:
    """``what`` of the role's engine: the actor's messages unprefixed, another role's named."""
    return what if role == "actor" else f"the {role}: {what}"


@contextlib.contextmanager
def _saved(h: Harness, role: Role) -> Iterator[tuple[TrainingEngine, Path]]:
    """A warmed engine of ``role`` and the checkpoint it saved (in a folder removed afterwards)."""
    engine = h.training(role, fresh=True, optim=STATE_OPTIM, micro_batch_size=2)
    _warm(h, engine)
    with tempfile.TemporaryDirectory(prefix="verl-conformance-") as tmp:
        path = Path(tmp) / "checkpoint"
        engine.save_checkpoint(path)
        h.expect(path.exists(), _of(role, f"save_checkpoint({str(path)!r}) wrote nothing at that path"))
        yield engine, path


@check("stateful", gates=("training.checkpoint", "training.values"))
def check_checkpoint_round_trip(h: Harness) -> None:
    """save_checkpoint, then load_checkpoint into a fresh engine: the same weights, forward and next three updates, for the actor and for the critic where the backend provides one declaring values (under the value loss: its value head and the optimizer state of it are restored too); a critic-only backend: the critic."""
    for role in _roles(h, "checkpoint"):
        with _saved(h, role) as (engine, path):
            fresh = h.training(role, fresh=True, optim=STATE_OPTIM, micro_batch_size=2)
            fresh.load_checkpoint(path)
            what = _of(role, "after save_checkpoint and load_checkpoint into a fresh engine")
            _same_weights(h, exported_weights(fresh), exported_weights(engine), f"{what}: weights")
            compare_next_update(h, fresh, engine, what,
                                "the optimizer's moments, its step or the schedule were not restored")
        h.close_fresh()  # the role's engines, before the next role's are built


@check("stateful", gates=("training.checkpoint", "training.tensor_parallel", "training.pipeline_parallel",
                           "training.data_parallel"))
def check_multi_rank_checkpoint_round_trip(h: Harness) -> None:
    """Under torchrun with two ranks (tp=2 where the actor declares tensor_parallel, else pp=2 where it declares pipeline_parallel, else dp=2), every rank calls save_checkpoint with the same folder after two updates, runs two more; a fresh engine per rank loads the folder and runs the same two: each rank's losses, grad norms and learning rates and its exported weights after them equal the engine's that kept its state (ranks that overwrite each other's files, or save one rank's shard as the whole, fail). Then one process loads the same folder (another layout): the same two updates and weights as the ranks that kept their state, or a CheckpointError refusing the layout (a load that drops state it cannot reshard fails). Skipped unless the actor declares checkpoint and one of those layouts."""
    caps = h.training().capabilities
    if not caps.checkpoint:
        h.skip("backend declares checkpoint=False for the actor")
    layouts = (("tensor_parallel", {"tp": 2}), ("pipeline_parallel", {"pp": 2}), ("data_parallel", {"dp": 2}))
    layout = next((lay for name, lay in layouts if getattr(caps, name)), None)
    if layout is None:
        h.skip("the actor declares none of tensor_parallel, pipeline_parallel and data_parallel")
    if not h.subject.registered:
        h.skip("multi-rank checks build engines through the registry; install the backend as a plugin")
    if h.device.startswith("cuda") and torch.cuda.device_count() < 2:
        h.skip(f"2 ranks on {h.device} need 2 GPUs; {torch.cuda.device_count()} visible")
    import json

    from verl_conformance import multirank
    from verl_conformance.testkit import LaunchError, launch_torchrun

    label = ", ".join(f"{k}={v}" for k, v in layout.items())
    with tempfile.TemporaryDirectory(prefix="verl-conformance-") as tmp:
        folder = Path(tmp) / "checkpoint"
        spec = {"parallel": layout, "micro_batch_size": 2, "dtype": h.dtype, "device": h.device,
                "checkpoint": str(folder)}
        try:
            ranks = launch_torchrun(multirank.__file__, 2, [h.subject.name, h.model_path(), json.dumps(spec)],
                                    timeout=400)
        except LaunchError as e:
            h.fail(f"the backend failed a checkpoint round trip under torchrun with {label}: {str(e)[-2500:]}")
        for rank, r in enumerate(ranks):
            what = f"rank {rank} of {label}, after every rank's save_checkpoint and a fresh engine's load_checkpoint"
            _same_steps(h, r["loaded"]["steps"], r["kept"]["steps"], what)
            _same_weights(h, r["loaded"]["weights"], r["kept"]["weights"],
                          f"{what}: weights after two updates differ from the engine that kept its state")
        refusal = _one_process_load(h, folder, ranks, label)
    h.note(f"under {label}; one process {refusal or 'loaded it'}")


def _same_steps(h: Harness, got: list[dict[str, float]], kept: list[dict[str, float]], what: str) -> None:
    """:func:`_same_step` on each of the updates after a load (``{"loss", "grad_norm", "lr"}`` each)."""
    for i, (g, k) in enumerate(zip(got, kept, strict=True)):
        _same_step(h, (g["loss"], g["grad_norm"], g["lr"]), (k["loss"], k["grad_norm"], k["lr"]),
                   f"{what}: the {('first', 'second')[i]} update after it")


def _one_process_load(h: Harness, folder: Path, ranks: list[dict[str, Any]], label: str) -> str | None:
    """A fresh single-process actor loads the checkpoint the ranks of ``label`` saved and runs their two
    updates on the whole batch: the same global loss, grad norm, lr and weights as the ranks that kept
    their state. Returns how the engine refused the layout (a CheckpointError), or None when it loaded."""
    from verl_conformance import multirank

    engine = h.training(fresh=True, optim=STATE_OPTIM, micro_batch_size=2)
    what = f"one process, after load_checkpoint of the checkpoint saved under {label}"
    try:
        engine.load_checkpoint(folder)
    except CheckpointError as e:
        h.close_fresh()
        return f"refused it with a CheckpointError ({str(e)[:160]})"
    steps = []
    for seed in multirank.CHECKPOINT_SEEDS:
        batch = multirank.dp_batch(seed)
        loss, step = _update(engine, batch)
        steps.append({"loss": loss, "grad_norm": step.grad_norm, "lr": step.lr})
    kept = ranks[0]["kept"]
    _same_steps(h, steps, kept["steps"], f"{what} (vs rank 0 of {label}, which kept its state; its metrics are "
                "global)")
    whole = max((r["kept"]["weights"] for r in ranks), key=len)  # the rank whose stream holds every tensor
    _same_weights(h, exported_weights(engine), whole, f"{what}: weights after two updates differ from the ranks "
                  "that kept their state (a load at another layout must restore all of it, or refuse with a "
                  "CheckpointError)")
    h.close_fresh()
    return None


@check("stateful", gates=("training.checkpoint", "training.values"))
def check_load_drops_pending_gradients(h: Harness) -> None:
    """forward_backward, then load_checkpoint: the gradients of the call before the load add nothing afterwards (the actor, and the critic where the backend provides one declaring values; a critic-only backend: the critic)."""
    for role in _roles(h, "checkpoint"):
        with _saved(h, role) as (engine, path):
            other = h.training(role, fresh=True, optim=STATE_OPTIM, micro_batch_size=2)
            stray = h.batch(seed=_STRAY_SEED, rl_fields=True)
            other.forward_backward(stray, role_loss(role), GlobalBatchStats.of(stray))  # never followed by a step
            other.load_checkpoint(path)
            compare_next_update(h, other, engine, _of(role, "after forward_backward, then load_checkpoint with no "
                                "optimizer_step between (load_checkpoint must clear the gradients of the call before "
                                "it)"), "the gradients of the forward_backward before the load were kept and added to "
                                "the next update's")
        h.close_fresh()


@check("stateful", gates=("training.offload", "training.values"))
def check_offload_round_trip(h: Harness) -> None:
    """offload() then onload() keeps weights and optimizer state: the same forward and next three updates as an engine never offloaded (the actor, and the critic where the backend provides one declaring values; a critic-only backend: the critic)."""
    for role in _roles(h, "offload"):
        engine = h.training(role, fresh=True, optim=STATE_OPTIM, micro_batch_size=2)
        kept = h.training(role, fresh=True, optim=STATE_OPTIM, micro_batch_size=2)
        _warm(h, engine)
        _warm(h, kept)
        before = exported_weights(engine)
        engine.offload()
        engine.onload()
        what = _of(role, "after offload() and onload()")
        _same_weights(h, exported_weights(engine), before, f"{what}: weights")
        compare_next_update(h, engine, kept, what, "optimizer state was lost or changed by the offload")
        h.close_fresh()


def _device_memory(device: str) -> tuple[int, int]:
    """Bytes torch has allocated on a CUDA device, and bytes in use on the whole device."""
    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    return int(torch.cuda.memory_allocated(dev)), int(total - free)


def _memory_measurable(h: Harness, what: str) -> None:
    if not (h.device.startswith("cuda") and torch.cuda.is_available()):
        h.skip(f"device memory is measured on CUDA only; the suite runs on {h.device}, where {what} has no "
               "device memory to release")


def _freed(h: Harness, before: tuple[int, int], weight_bytes: int, what: str) -> None:
    """Fail unless torch's allocations or the device's used memory dropped by half the weights or more."""
    after = _device_memory(h.device)
    freed = max(before[0] - after[0], before[1] - after[1])
    h.expect(freed >= weight_bytes // 2,
             f"{what} released {freed} bytes of {h.device} memory (torch allocations {before[0]} -> {after[0]}, "
             f"device in use {before[1]} -> {after[1]}); the weights alone take {weight_bytes} bytes")


@check("stateful", gates=("training.offload", "training.values"))
def check_offload_frees_memory(h: Harness) -> None:
    """offload() releases the device memory of the weights and optimizer state (measured on CUDA), and onload() brings the same weights back; for the actor, and for the critic where the backend provides one declaring values (its value head and the optimizer state of it too; a critic-only backend: the critic)."""
    roles = _roles(h, "offload")
    _memory_measurable(h, "offload()")
    for role in roles:
        engine = h.training(role, fresh=True, optim=STATE_OPTIM)
        _warm(h, engine)
        weights = exported_weights(engine)
        weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        memory = _device_memory(h.device)
        engine.offload()
        _freed(h, memory, weight_bytes, _of(role, "offload()"))
        engine.onload()
        _same_weights(h, exported_weights(engine), weights, _of(role, "after offload() and onload()"))
        h.close_fresh()  # the role's engine, before the next role's is built


def _generations(h: Harness, engine: RolloutEngine) -> list[tuple[str, TensorBatch]]:
    # greedy tokens show which weights serve; seeded sampling (where seeded) its sampling state too
    prompts = h.batch(seed=64, batch_size=2).select("prompt_ids", "prompt_mask", "group_ids")
    cases = [("greedy", SamplingParams(greedy=True, max_new_tokens=5))]
    if engine.capabilities.seeding != "none":
        cases.append(("seeded sampling", SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=21)))
    return [(label, engine.generate(prompts, params)) for label, params in cases]


def _same_generations(h: Harness, got: list[tuple[str, TensorBatch]], want: list[tuple[str, TensorBatch]],
                     what: str) -> None:
    for (label, a), (_, b) in zip(got, want, strict=True):
        h.expect(bool(torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["response_mask"], b["response_mask"])),
                 f"{what}: {label} gave other tokens than before (the engine does not serve the weights it had)")
        h.close_to(a["rollout_log_probs"], b["rollout_log_probs"], "log_probs",
                   f"{what}: {label} rollout_log_probs vs before", mask=b["response_mask"])


@check("stateful", gates=("rollout.weight_update",))
def check_sleep_wake_round_trip(h: Harness) -> None:
    """sleep() then wake() serves the weights synced before it (same samples), and a later sync still applies."""
    engine = h.rollout(fresh=True)
    alt, base = h.model_path("llama-alt"), h.model_path("llama")
    syncs = engine.capabilities.weight_update
    if syncs:  # serve weights that are not the folder's, so reloading the folder on wake shows
        engine.update_weights(folder_stream(alt, 3, dtype=engine.weight_dtype))
    before = _generations(h, engine)
    engine.sleep()
    engine.wake()
    what = "after sleep() and wake()"
    _same_generations(h, _generations(h, engine), before, what)
    if not syncs:
        return
    serves(h, engine, "llama-alt", f"{what} (llama-alt synced before sleep)")
    engine.sleep()
    engine.wake()
    engine.update_weights(folder_stream(base, 4, dtype=engine.weight_dtype))
    h.expect(engine.weight_version == 4, f"weight_version is {engine.weight_version} after a sync to version 4 "
             f"that followed sleep() and wake()")
    serves(h, engine, "llama", "after sleep(), wake() and a sync back to llama")


@check("stateful", gates=("rollout.weight_update",))
def check_update_while_asleep_refused(h: Harness) -> None:
    """A sleeping engine (one whose generate refuses with EngineAsleepError) refuses update_weights with EngineAsleepError before reading the stream, keeping its version and serving its weights after wake(); skipped where sleep() leaves the engine serving."""
    engine = synced_to_alt(h, 3)
    prompts = h.batch(seed=64, batch_size=2).select("prompt_ids", "prompt_mask", "group_ids")
    engine.sleep()
    try:
        engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=2))
    except EngineAsleepError:
        pass
    else:
        engine.wake()
        h.skip("sleep() leaves this engine serving (generate ran while asleep), so there is no asleep state to refuse in")
    read = []

    def stream() -> Iterator[WeightMessage]:
        for msg in folder_stream(h.model_path("llama"), 4, dtype=engine.weight_dtype):
            read.append(msg)
            yield msg

    try:
        engine.update_weights(stream())
    except EngineAsleepError:
        pass
    except Exception as e:
        h.fail(f"update_weights while asleep raised {type(e).__name__}: {e}; expected EngineAsleepError (the trainer "
               "wakes an engine before it sends weights: a sync to a sleeping one is the caller's error)")
    else:
        h.fail("update_weights while asleep was accepted; it must raise EngineAsleepError (a sleeping engine holds "
               "no weights to write into, and the caller must wake() it first)")
    h.expect(not read, f"update_weights while asleep read {len(read)} messages of the stream before refusing; "
             "refuse before reading it")
    engine.wake()
    h.expect(engine.weight_version == 3, f"weight_version is {engine.weight_version} after a refused sync to version 4; "
             "the refusal must keep the version of the weights served (3)")
    serves(h, engine, "llama-alt", "after a sync refused while asleep, then wake()")


@check("stateful", gates=("rollout.weight_update",))
def check_sleep_until_sync_then_sync(h: Harness) -> None:
    """sleep_until_sync() then wake(): the engine either refuses generate with StaleWeightsError or serves the weights synced before it (same samples), and the complete sync that follows serves what it sent, its version included (nothing outside the stream, such as rotary frequencies, may be lost)."""
    engine = synced_to_alt(h, 3)
    before = _generations(h, engine)
    engine.sleep_until_sync()
    engine.wake()
    what = "after sleep_until_sync() and wake()"
    try:
        got = _generations(h, engine)
    except StaleWeightsError:
        pass  # it dropped its weights and says so: the sync below must restore them
    else:
        _same_generations(h, got, before, f"{what} with no StaleWeightsError (an engine that drops its weights "
                          "must refuse generate until the next complete sync)")
    engine.update_weights(folder_stream(h.model_path("llama"), 4, dtype=engine.weight_dtype))
    h.expect(engine.weight_version == 4, f"weight_version is {engine.weight_version} after a sync to version 4 "
             "that followed sleep_until_sync() and wake()")
    serves(h, engine, "llama", f"{what} and a complete sync to llama")


@check("stateful", gates=("rollout.sleep_frees_memory",))
def check_sleep_frees_memory(h: Harness) -> None:
    """sleep() releases device memory (measured on CUDA) and wake() serves the same samples again."""
    if not h.rollout().capabilities.sleep_frees_memory:
        h.skip("backend declares sleep_frees_memory=False (its sleep frees no device memory to measure)")
    _memory_measurable(h, "sleep()")
    engine = h.rollout(fresh=True)
    before = _generations(h, engine)
    weights = folder_weights(h.model_path("llama"))
    weight_bytes = sum(t.numel() for t in weights.values()) * torch.empty((), dtype=engine.weight_dtype).element_size()
    memory = _device_memory(h.device)
    engine.sleep()
    _freed(h, memory, weight_bytes, "sleep()")
    engine.wake()
    if engine.capabilities.weight_update:  # a sleep that discards the weights is followed by a sync
        engine.update_weights(folder_stream(h.model_path("llama"), 1, dtype=engine.weight_dtype))
    _same_generations(h, _generations(h, engine), before, "after sleep() and wake()")
