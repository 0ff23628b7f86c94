"""The Megatron training engine's optimizer: torch AdamW (with float32 masters) or megatron-core's own.

With ``MegatronOptions.optimizer="torch"`` AdamW steps the parameters, or float32 master copies of
them (:class:`verl_core.enginekit.precision.MasterWeights`) rounded into the model after each step;
the Adam moments are keyed by the tensors stepped. With ``"megatron"`` megatron-core's
DistributedDataParallel and optimizer do (:class:`verl_megatron.core_optimizer.CoreOptimizer`).
Either way the global gradient norm is computed over every rank, a non-finite norm skips the step
on every rank, and gradients are clipped by ``grad_clip``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import EngineSpec, StepMetrics
from verl_core.enginekit.precision import MasterWeights
from verl_megatron.core_optimizer import CoreOptimizer
from verl_megatron.options import MegatronOptions
from verl_megatron.stage import Stage

__all__ = ["StageOptimizer"]


class StageOptimizer:
    """The optimizer of one model stage, its float32 masters and where each gradient lives.

    Args:
        stage: The model stage.
        spec: The engine spec (its ``optim`` settings).
        options: The backend options (``optimizer``, ``master_weights``, ``distributed_optimizer``).
    """

    def __init__(self, stage: Stage, spec: EngineSpec, options: MegatronOptions) -> None:
        self._stage = stage
        self._optim = spec.optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.master: MasterWeights | None = None
        self.master_of: dict[Tensor, torch.nn.Parameter] = {}
        self.core: CoreOptimizer | None = None
        model = stage.model
        if options.optimizer == "megatron":
            self.core = CoreOptimizer(model, spec.optim, stage.dtype, distributed=options.distributed_optimizer)
            return
        o = spec.optim
        params = [p for p in model.parameters() if p.requires_grad]
        stepped: list[Tensor] = list(params)
        if options.master_weights and any(p.dtype != torch.float32 for p in params):
            self.master = MasterWeights(params)
            self.master_of = dict(zip(params, self.master.masters, strict=True))
            stepped = list(self.master.masters)
        self.optimizer = torch.optim.AdamW(
            stepped, lr=o.lr_at(0), betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
            fused=stage.device.type == "cuda",
        )

    # ------------------------------------------------------------------ gradients
    def stepped(self, param: Tensor) -> Tensor:
        """The tensor the optimizer steps for ``param``: its float32 master, or the parameter itself."""
        return self.master_of.get(param, param)

    def grad(self, param: Tensor) -> Tensor | None:
        """The gradient of ``param`` wherever it is (on its master between ``load_grads`` and the step)."""
        if self.core is not None:
            return self.core.grad(param)
        master = self.master_of.get(param)
        if master is not None and master.grad is not None:
            return master.grad
        return param.grad

    def clear_grads(self) -> None:
        """Drop every gradient (the torch ``.grad`` of each parameter, or megatron's buffers)."""
        if self.core is not None:
            self.core.zero_grad()
        else:
            for p in self._stage.model.parameters():
                p.grad = None

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradients (each parameter counted once over all ranks)."""
        s = self._stage
        sq = torch.zeros((), dtype=torch.float64, device=s.device)
        for name, p in s.model.named_parameters():
            grad = self.grad(p)
            if grad is None or getattr(p, "shared", False):
                continue  # the last stage's copy of a tied embedding is counted on the first
            if s.adapter.partition(name) == "replicated" and s.tp_rank != 0:
                continue  # identical on every TP rank: count it once
            sq += grad.detach().double().pow(2).sum()
        if s.tp * s.pp > 1:
            dist.all_reduce(sq, group=s.ps.get_model_parallel_group())
        return float(sq.sqrt())

    # ------------------------------------------------------------------ step
    def step(self, step: int, *, learn: bool = True) -> StepMetrics:
        """Clip and step at the learning rate of optimizer step ``step``; all ranks skip together on a non-finite norm.

        ``learn=False`` (the mini-batch had no loss token) drops the gradients and changes no weight or
        Adam state: grad norm 0, not skipped.
        """
        lr = self._optim.lr_at(step)
        if not learn:
            self.clear_grads()
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=0.0, lr=lr, skipped=False)
        if self.core is not None:
            norm, skipped = self.core.step(lr, self._optim.grad_clip)
            return StepMetrics(grad_norm=norm, lr=lr, skipped=skipped)
        assert self.optimizer is not None
        if self.master is not None:
            self.master.load_grads()  # after every reduction of forward_backward
        norm = self.grad_norm()
        bad = torch.tensor([0.0 if torch.isfinite(torch.tensor(norm)) else 1.0], device=self._stage.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        skipped = bool(bad.item() > 0)
        if not skipped:
            clip = self._optim.grad_clip
            if clip > 0 and norm > clip:
                coef = clip / (norm + 1e-6)
                for p in self._stage.model.parameters():
                    grad = self.grad(p)
                    if grad is not None:
                        grad.mul_(coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self.master is not None:
                self.master.store()
        self.optimizer.zero_grad(set_to_none=True)
        return StepMetrics(grad_norm=norm, lr=lr, skipped=skipped)

    def adam_step(self) -> float:
        """Adam's step counter (0 before the first step)."""
        if self.core is not None:
            return self.core.adam_step()
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                return float(state["step"])
        return 0.0

    def local_state(self, param: torch.nn.Parameter, what: str) -> Tensor:
        """This rank's float32 master (``master``) or Adam moment of ``param`` (zeros before the first step)."""
        if self.core is not None:
            return self.core.local_state(param, what)  # type: ignore[arg-type]
        if what == "master":
            return self.stepped(param).detach()
        stepped = self.stepped(param)
        state = self.optimizer.state.get(stepped, {}) if self.optimizer is not None else {}
        return state[what].detach() if what in state else torch.zeros_like(stepped.detach())

    # ------------------------------------------------------------------ memory
    def move_state(self, device: torch.device) -> int:
        """Move gradients, float32 masters and Adam's moments to ``device``; returns the bytes moved."""
        moved = 0
        for p in self._stage.model.parameters():
            if p.grad is not None:
                moved += p.grad.numel() * p.grad.element_size()
                p.grad = p.grad.to(device)
        if self.master is not None:
            for m in self.master.masters:
                moved += m.numel() * m.element_size()
                if m.grad is not None:
                    moved += m.grad.numel() * m.grad.element_size()
            self.master.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, Tensor) and key != "step":
                        moved += value.numel() * value.element_size()
                        state[key] = value.to(device)
        return moved

    def close(self) -> None:
        """Release megatron's buffers and drop the optimizer state."""
        self.optimizer = None
        if self.core is not None:
            self.core.close()
        self.core = None
        self.master = None
        self.master_of = {}

