"""Checkpoints of the Megatron training engine: whole tensors under Megatron's global names.

Tensors are stored whole (TP shards joined, PP stages gathered), so a checkpoint loads at any
TP/PP layout. Global rank 0 writes into a temporary folder and swaps it into place, so a crash
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import CheckpointError, ConfigError, TensorInfo
from verl_core.enginekit.checkpoint import verify_step_count, verify_tensors
from verl_megatron.core_optimizer import adam_step_tensor
from verl_megatron.stage import Stage
from verl_megatron.stage_optimizer import StageOptimizer
from verl_megatron.weight_export import StageWeights

__all__ = ["CKPT_META", "CKPT_STATE", "StageCheckpoint"]

CKPT_META = "verl_megatron_checkpoint.json"
CKPT_STATE = "state.pt"


class StageCheckpoint:
    """Saves and restores weights, float32 masters, Adam moments, step and RNG of one engine.

    Args:
        stage: The model stage.
        weights: Gathers the full tensors.
        optimizer: The stage's optimizer (None for a frozen reference).
        role: The engine's role (stored for information).
    """

    def __init__(self, stage: Stage, weights: StageWeights, optimizer: StageOptimizer | None, role: str) -> None:
        self._s = stage
        self._weights = weights
        self._opt = optimizer
        self._role = role

    def save(self, path: str | os.PathLike[str], step: int) -> None:
        """Save the state of optimizer step ``step`` to ``path`` (a collective: every rank calls it)."""
        s = self._s
        opt = self._opt
        core = opt.core if opt is not None else None
        dest = Path(path)
        rank0 = dist.get_rank() == 0
        model: dict[str, Tensor] = {}
        moments: dict[str, dict[str, Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        masters: dict[str, Tensor] = {}
        has_optimizer = opt is not None
        keep_masters = opt is not None and (opt.master is not None or (core is not None and s.dtype != torch.float32))
        for name in s.adapter.megatron_names():
            t = self._weights.full_tensor(name)
            if rank0:
                model[name] = t.detach().cpu().clone()
            if keep_masters:
                m = self._weights.full_tensor(name, what="master")
                if rank0:
                    masters[name] = m.detach().cpu().clone()
            if has_optimizer:
                for key, store in moments.items():
                    m = self._weights.full_tensor(name, what=key)  # type: ignore[arg-type]
                    if rank0:
                        store[name] = m.detach().cpu().clone()
        adam_step = opt.adam_step() if opt is not None else 0.0
        if rank0:
            tmp = dest.with_name(f".{dest.name}.incomplete")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            payload = {
                "model": model,
                "optimizer": moments if has_optimizer else None,
                "master_weights": masters if keep_masters else None,
                "adam_step": adam_step,
                "step": step,
                "rng": torch.get_rng_state(),
            }
            torch.save(payload, tmp / CKPT_STATE)
            meta = {"format": "verl_megatron/1", "tp": s.tp, "pp": s.pp, "step": step,
                    "role": self._role, "names": s.adapter.megatron_names()}
            (tmp / CKPT_META).write_text(json.dumps(meta))
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if dest.exists():
                os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def read(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and check the checkpoint at ``path`` (see :meth:`verify`); restores nothing.

        Raises:
            ConfigError: the folder is not a verl-megatron checkpoint.
            CheckpointError: the checkpoint does not fit this engine.
        """
        folder = Path(path)
        if not (folder / CKPT_META).exists() or not (folder / CKPT_STATE).exists():
            raise ConfigError(f"{folder} is not a verl-megatron checkpoint (expected {CKPT_META} and {CKPT_STATE})")
        payload = torch.load(folder / CKPT_STATE, map_location="cpu", weights_only=True)
        self.verify(folder, payload)
        return dict(payload)

    def restore(self, payload: dict[str, Any]) -> int:
        """Restore a payload :meth:`read` returned into this rank's shards; returns its step."""
        s = self._s
        opt = self._opt
        core = opt.core if opt is not None else None
        optimizer = opt.optimizer if opt is not None else None
        params = dict(s.model.named_parameters())
        moments = payload["optimizer"]
        saved_masters = payload.get("master_weights")
        with torch.no_grad():
            for global_name, local in s.adapter.stage_names(s.pp_rank, s.pp):
                p = params[local]
                stepped = opt.stepped(p) if opt is not None else p

                def piece(t: Tensor, *, _g: str = global_name, _like: Tensor = p) -> Tensor:
                    return s.adapter.shard(_g, t, s.tp_rank, s.tp).to(device=_like.device, dtype=_like.dtype)

                p.copy_(piece(payload["model"][global_name]))
                if core is not None:
                    source = saved_masters if saved_masters is not None else payload["model"]
                    master = s.adapter.shard(global_name, source[global_name], s.tp_rank, s.tp).to(
                        device=p.device, dtype=torch.float32)
                    if p.dtype != torch.float32:
                        p.copy_(master)  # the model computes with the masters' rounding
                    state = None
                    if moments is not None and payload["adam_step"] > 0:
                        state = {k: s.adapter.shard(global_name, moments[k][global_name], s.tp_rank, s.tp)
                                 for k in ("exp_avg", "exp_avg_sq")}
                    core.load_local_state(p, master, state, float(payload["adam_step"]))
                    continue
                if stepped is not p:
                    source = saved_masters if saved_masters is not None else payload["model"]
                    stepped.copy_(piece(source[global_name], _like=stepped))
                    p.copy_(stepped)
                if optimizer is not None:
                    optimizer.state.pop(stepped, None)
                    if moments is not None and payload["adam_step"] > 0:
                        optimizer.state[stepped] = {
                            "step": adam_step_tensor(optimizer, payload["adam_step"], stepped),
                            "exp_avg": piece(moments["exp_avg"][global_name], _like=stepped).clone(),
                            "exp_avg_sq": piece(moments["exp_avg_sq"][global_name], _like=stepped).clone(),
                        }
        torch.set_rng_state(payload["rng"])
        return int(payload["step"])

    def verify(self, folder: Path, payload: Any) -> None:
        """Refuse a checkpoint that does not fit this engine; copies nothing.

        The file holds whole tensors under Megatron's global names: weights must have the full
        shape of this model and its dtype, float32 masters the full shape in float32, Adam
        moments the full shape in a floating dtype (cast to the optimizer's on load), the step
        counters must be whole numbers >= 0. Then the shard this rank would take of each tensor
        of its stage must have the local parameter's shape.
        """
        s = self._s
        where = f"checkpoint {str(folder)!r}"
        if not isinstance(payload, dict) or not isinstance(payload.get("model"), dict):
            raise CheckpointError(f"{where}: {CKPT_STATE} is not a verl-megatron state; the file is corrupted or foreign")
        full = {n: s.adapter.megatron_shape(n) for n in s.adapter.megatron_names()}
        verify_tensors(payload["model"], {n: TensorInfo(shape, s.dtype) for n, shape in full.items()}, checkpoint=folder)
        fp32 = {n: TensorInfo(shape, torch.float32) for n, shape in full.items()}
        masters = payload.get("master_weights")
        if masters is not None:
            verify_tensors(masters if isinstance(masters, dict) else {}, fp32, checkpoint=folder,
                           what="float32 master")
        moments = payload.get("optimizer")
        if moments is not None:
            for key in ("exp_avg", "exp_avg_sq"):
                saved = moments.get(key) if isinstance(moments, dict) else None
                verify_tensors(saved if isinstance(saved, dict) else {}, fp32, checkpoint=folder,
                               what=f"optimizer state ({key})", exact_dtype=False)
        verify_step_count(payload.get("adam_step"), name="adam_step", checkpoint=folder)
        verify_step_count(payload.get("step"), name="step", checkpoint=folder)
        live_rng = torch.get_rng_state()
        verify_tensors({"rng": payload.get("rng")}, {"rng": TensorInfo(tuple(live_rng.shape), live_rng.dtype)},
                       checkpoint=folder, what="RNG state")
        params = dict(s.model.named_parameters())
        for global_name, local in s.adapter.stage_names(s.pp_rank, s.pp):
            # the shard of a tensor of the (verified) full shape, computed without data
            shard = s.adapter.shard(global_name, torch.empty(full[global_name], device="meta"), s.tp_rank, s.tp)
            if tuple(shard.shape) != tuple(params[local].shape):
                raise CheckpointError(
                    f"{where}: tensor {global_name!r} of shape {full[global_name]} gives tensor-parallel rank "
                    f"{s.tp_rank} of {s.tp} a shard of shape {tuple(shard.shape)}, but its parameter "
                    f"{local!r} has shape {tuple(params[local].shape)}; load it into an engine of the same model"
                )
