"""The training engine's optimizer: AdamW, its learning-rate schedule and float32 master weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.enginekit.checkpoint import verify_step_count, verify_tensors
from verl_core.enginekit.precision import MasterWeights
from verl_core.kernel.engine import OptimConfig
from verl_core.kernel.errors import CheckpointError
from verl_core.kernel.training import StepMetrics
from verl_core.kernel.weights import TensorInfo
from verl_hf.distributed import DataParallel

__all__ = ["HFOptimizer", "verify_masters"]


class HFOptimizer:
    """AdamW with linear warmup and constant or cosine decay, stepping float32 masters when asked.

    Weight decay applies to every parameter. With ``master_weights`` and a model not in float32
    (and no FSDP), AdamW updates float32 copies and rounds them into the model after each step.

    Args:
        model: The model whose trainable parameters are optimised (FSDP2-wrapped under ``fsdp``).
        optim: Learning rate, schedule, betas, eps, weight decay and clipping.
        device: The engine's device (fused AdamW on CUDA without FSDP).
        dp: The data-parallel group (ranks agree on skipping a non-finite step).
        fsdp: The model is sharded with FSDP2.
        master_weights: Keep float32 master copies of lower-precision parameters.
    """

    def __init__(
        self, model: Any, optim: OptimConfig, device: torch.device, dp: DataParallel, *, fsdp: bool,
        master_weights: bool,
    ) -> None:
        self._model = model
        self._optim = optim
        self._device = device
        self._dp = dp
        self._fsdp = fsdp
        params = [p for p in model.parameters() if p.requires_grad]
        self.master: MasterWeights | None = None
        if master_weights and not fsdp and any(p.dtype != torch.float32 for p in params):
            self.master = MasterWeights(params)
            params = list(self.master.masters)
        self.optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
            fused=device.type == "cuda" and not fsdp,
        )
        lr = optim.lr
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: optim.lr_at(step) / lr)

    def step(self, *, learn: bool = True) -> StepMetrics:
        """Clip, step AdamW and the schedule, zero the gradients; skip on a non-finite grad norm.

        ``learn=False`` (the mini-batch had no loss token) drops the gradients and steps the schedule
        only: no weight or Adam state changes, grad norm 0.
        """
        if not learn:
            lr = float(self.optimizer.param_groups[0]["lr"])
            self.zero_grad()
            self.scheduler.step()
            return StepMetrics(grad_norm=0.0, lr=lr, skipped=False)
        if self.master is not None:
            self.master.load_grads()
            params: list[Tensor] = list(self.master.masters)
        else:
            params = [p for p in self._model.parameters() if p.requires_grad]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self._device)
        full = getattr(norm, "full_tensor", None)
        if full is not None:
            norm = full()
        norm = norm.float()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not self._dp.all_finite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=float(norm), lr=lr, skipped=True)
        clip = self._optim.grad_clip
        if clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        self.optimizer.step()
        if self.master is not None:
            self.master.store()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepMetrics(grad_norm=float(norm), lr=lr, skipped=False)

    def zero_grad(self) -> None:
        """Drop every gradient: the optimizer's parameters' and, under float32 masters, those the
        model's own (bfloat16) parameters accumulate until the next step moves them to the masters."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            for p in self.master.params:
                p.grad = None

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """Optimizer (full, on CPU), float32 masters and schedule state, as a checkpoint stores them."""
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
            )

            optimizer: dict[str, Any] = dict(get_optimizer_state_dict(
                self._model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ))
        else:
            optimizer = _to_cpu(self.optimizer.state_dict())
        return {
            "optimizer": optimizer,
            "master_weights": self.master.state() if self.master is not None else None,
            "scheduler": self.scheduler.state_dict(),
        }

    def load(self, trainer: dict[str, Any]) -> None:
        """Restore what :meth:`state` saved (checked first by :meth:`verify`); the model is already loaded."""
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            if trainer["optimizer"] is not None:
                opts = StateDictOptions(full_state_dict=True, strict=False)
                set_optimizer_state_dict(self._model, self.optimizer, trainer["optimizer"], options=opts)
        else:
            if self.master is not None:
                masters = trainer.get("master_weights")
                if masters is not None:
                    self.master.load_state(masters)
                else:  # a checkpoint of a pure-precision engine: start the masters from its weights
                    self.master.reload()
            if trainer["optimizer"] is not None:
                self.optimizer.load_state_dict(trainer["optimizer"])
        if trainer["scheduler"] is not None:
            self.scheduler.load_state_dict(trainer["scheduler"])
        self.zero_grad()

    def verify(self, folder: Path, trainer: dict[str, Any], names: list[str]) -> None:
        """Refuse saved Adam state or schedule that do not fit this optimizer; copies nothing.

        Args:
            folder: The checkpoint (named in errors).
            trainer: The saved trainer state.
            names: Names of the trainable parameters, in the optimizer's order.
        """
        if trainer.get("optimizer") is not None:
            self._verify_adam(folder, trainer["optimizer"], names)
        if trainer.get("scheduler") is not None:
            sched = trainer["scheduler"]
            verify_step_count(
                sched.get("last_epoch") if isinstance(sched, dict) else sched, name="scheduler last_epoch",
                checkpoint=folder,
            )

    def _verify_adam(self, folder: Path, saved: Any, names: list[str]) -> None:
        """Adam's state against the live optimizer: the same groups, moments shaped like their parameter."""
        live_groups = self.optimizer.param_groups
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        state = saved.get("state") if isinstance(saved, dict) else None
        if (
            not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(live_groups)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        ):
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: the optimizer state is not a torch optimizer state with "
                f"{len(live_groups)} parameter group(s); load a checkpoint of an engine with the same model"
            )
        expected: dict[str, TensorInfo] = {}
        got: dict[str, Any] = {}
        listed: set[Any] = set()
        order = iter(names)
        for g, (sg, lg) in enumerate(zip(groups, live_groups, strict=True)):
            if len(sg["params"]) != len(lg["params"]):
                raise CheckpointError(
                    f"checkpoint {str(folder)!r}: optimizer parameter group {g} holds {len(sg['params'])} "
                    f"parameters, this engine's {len(lg['params'])}; load a checkpoint of the same model"
                )
            for key, param in zip(sg["params"], lg["params"], strict=True):
                name = next(order)
                listed.add(key)
                entry = state.get(key)
                if entry is None:
                    continue  # a parameter the optimizer has not stepped yet
                if not isinstance(entry, dict):
                    entry = {}  # reported below as missing moments
                verify_step_count(entry.get("step"), name=f"{name} Adam step", checkpoint=folder)
                info = TensorInfo(tuple(param.shape), param.dtype)
                expected |= {f"{name}.exp_avg": info, f"{name}.exp_avg_sq": info}
                got |= {f"{name}.{k}": v for k, v in entry.items() if k != "step"}
        stray = set(state) - listed
        if stray:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: the optimizer state holds entries for {len(stray)} parameters "
                "this engine's optimizer does not have; load a checkpoint of the same model"
            )
        verify_tensors(got, expected, checkpoint=folder, what="optimizer state", exact_dtype=False)

    # ------------------------------------------------------------------ memory
    def to(self, device: torch.device) -> None:
        """Move the masters and Adam's moments to ``device``."""
        if self.master is not None:
            self.master.to(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, Tensor) and k != "step":
                    state[k] = v.to(device, non_blocking=True)


def verify_masters(folder: Path, masters: Any, trainable: list[tuple[str, nn.Parameter]]) -> None:
    """Refuse saved float32 masters (None: none saved) that do not match the trainable parameters."""
    if masters is None:
        return
    if not isinstance(masters, list | tuple):
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: the float32 masters are a {type(masters).__name__}, not a "
            "list of tensors; the file is corrupted or foreign"
        )
    labels = [n for n, _ in trainable] + [f"#{i}" for i in range(len(trainable), len(masters))]
    verify_tensors(
        dict(zip(labels, masters, strict=False)),
        {n: TensorInfo(tuple(p.shape), torch.float32) for n, p in trainable},
        checkpoint=folder, what="float32 master",
    )


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
