"""megatron-core's own optimizer for the training engine (``MegatronOptions.optimizer="megatron"``).

The stage is wrapped in megatron-core's ``DistributedDataParallel``: backward adds every
parameter's gradient into one contiguous float32 buffer per dtype (``param.main_grad``), and
:meth:`CoreOptimizer.reduce` all-reduces that buffer over the data-parallel group. The optimizer is
``megatron.core.optimizer.get_megatron_optimizer`` with an ``OptimizerConfig`` mapped from the
spec's :class:`~verl_core.OptimConfig`: Adam with decoupled weight decay on every parameter
(no megatron-style exemption of biases and norms, so it matches the engine's ``torch`` AdamW),
and with a bfloat16 spec megatron's float32 main parameters. With ``distributed=True`` it is
megatron's ``DistributedOptimizer``: each data-parallel rank keeps the float32 main parameters
and Adam moments of its shard of the buffer only, steps that shard and all-gathers the
parameters. Gradients are still all-reduced in full (not reduce-scattered), so every rank can
export them.

:meth:`CoreOptimizer.step` keeps the engine's contract: the global gradient norm is computed
first (megatron's own ``get_grad_norm``), a non-finite norm skips the step on every rank without
touching weights or moments, the gradients are clipped by ``grad_clip`` like the ``torch`` path
(scale ``clip / (norm + 1e-6)`` when the norm exceeds it) and the learning rate is set per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import ConfigError, OptimConfig

__all__ = ["CoreOptimizer", "adam_step_tensor"]


def adam_step_tensor(optimizer: torch.optim.Optimizer, step: float, param: Tensor) -> Tensor:
    """Adam's step counter for restored state, where torch keeps it: on the parameter's device for a
    fused or capturable optimizer (its CUDA kernel refuses a CPU ``step``), else a CPU scalar."""
    on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if on_device else "cpu")

StateKey = Literal["master", "exp_avg", "exp_avg_sq"]


@dataclass
class _Owner:
    """Where the optimizer keeps the float32 main copy of one model parameter (on this rank)."""

    inner: torch.optim.Optimizer  # the torch optimizer that steps ``main``
    main: Tensor  # the whole main tensor, or this rank's flat shard under the distributed optimizer
    start: int = 0  # the shard's range in the flattened parameter (distributed optimizer)
    end: int = 0


class CoreOptimizer:
    """megatron-core's DistributedDataParallel and optimizer over one model stage.

    Args:
        model: The stage (a megatron ``GPTModel``); its trainable parameters get ``main_grad``.
        optim: The spec's optimizer settings.
        dtype: The model's dtype (float32 or bfloat16).
        distributed: Use megatron's distributed optimizer (state sharded over data-parallel ranks).
    """

    def __init__(self, model: Any, optim: OptimConfig, dtype: torch.dtype, *, distributed: bool) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(
                f"optimizer='megatron' trains float32 or bfloat16 models, not {dtype}: megatron-core's "
                "float16 optimizer needs loss scaling, which this engine does not apply; use "
                "optimizer='torch' or dtype='bfloat16'"
            )
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.distributed = distributed
        self.params: list[torch.nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
        self.ddp = DistributedDataParallel(model.config, ddp_config, model)
        self.config = OptimizerConfig(
            optimizer="adam", lr=optim.lr_at(0), weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.grad_clip,
            bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=distributed,
        )
        # An empty override table: one parameter group, weight decay on every parameter as torch's
        # AdamW applies it (megatron's default exempts biases and norms through its LR scheduler,
        # which this engine does not use).
        self.optimizer = get_megatron_optimizer(self.config, [self.ddp], config_overrides={})
        self._parts: list[Any] = list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))
        self._dp_group = ps.get_data_parallel_group()
        self._owners: dict[torch.nn.Parameter, _Owner] = {}
        for part in self._parts:
            inner = part.optimizer
            if inner is None:
                continue
            if distributed:
                for p, (gi, go) in part.model_param_group_index_map.items():
                    rng = part._get_model_param_range_map(p)["param"]
                    self._owners[p] = _Owner(inner, inner.param_groups[gi]["params"][go], rng.start, rng.end)
            else:
                mains = {id(m) for g in inner.param_groups for m in g["params"]}
                for p in self.params:
                    main = getattr(p, "main_param", None)
                    main = p if main is None else main
                    if id(main) in mains:
                        self._owners[p] = _Owner(inner, main)

    # ------------------------------------------------------------------ gradients
    def grad_buffers(self) -> list[Tensor]:
        """The contiguous gradient buffers (each parameter's ``main_grad`` is a view into one)."""
        return [b.grad_data for b in self.ddp.buffers + self.ddp.expert_parallel_buffers]

    @staticmethod
    def grad(param: Tensor) -> Tensor | None:
        """The accumulated (after :meth:`reduce`, data-parallel-summed) gradient of ``param``."""
        grad: Tensor | None = getattr(param, "main_grad", None)
        return grad

    def reduce(self) -> None:
        """Sum the call's gradients over the data-parallel group (all ranks end with all of them)."""
        self.ddp.finish_grad_sync(force_all_reduce=True)

    def zero_grad(self) -> None:
        """Clear the gradient buffers and the optimizer's views of them."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        self.ddp.zero_grad_buffer()

    # ------------------------------------------------------------------ step
    def step(self, lr: float, clip: float) -> tuple[float, bool]:
        """Clip and step at learning rate ``lr``; returns (global grad norm, skipped).

        A non-finite norm skips the step on every rank; the gradients are cleared either way.
        """
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        bad = torch.tensor([0.0 if math.isfinite(norm) else 1.0], device=self.params[0].device if self.params else None)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        skipped = bool(bad.item() > 0)
        if not skipped:
            with torch.no_grad():
                if clip > 0 and norm > clip:
                    coef = clip / (norm + 1e-6)
                    for part in self._parts:
                        for p in part.get_parameters():
                            if p.grad is not None:
                                p.grad.mul_(coef)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step_with_ready_grads()
        self.zero_grad()
        return norm, skipped

    # ------------------------------------------------------------------ state (checkpoints)
    def adam_step(self) -> float:
        """Adam's step count (the same for every parameter), 0 before the first step."""
        for owner in self._owners.values():
            state = owner.inner.state.get(owner.main, {})
            if "step" in state:
                return float(state["step"])
            for group in owner.inner.param_groups:  # fused Adams (TransformerEngine, Apex) count per group
                if "step" in group:
                    return float(group["step"])
        return 0.0

    @torch.no_grad()
    def local_state(self, param: torch.nn.Parameter, what: StateKey) -> Tensor:
        """This rank's whole (tensor-parallel) piece of ``param``'s float32 main copy or Adam moment.

        Zeros for a moment before the first step. Under the distributed optimizer this joins the
        data-parallel shards: a collective of the data-parallel group.
        """
        owner = self._owners.get(param)
        if not self.distributed:
            assert owner is not None, "a trainable parameter the optimizer does not step"
            if what == "master":
                return owner.main.detach().float()
            state = owner.inner.state.get(owner.main, {})
            return state[what].detach() if what in state else torch.zeros_like(owner.main, dtype=torch.float32)
        full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if owner is not None:
            if what == "master":
                piece = owner.main.detach()
            else:
                state = owner.inner.state.get(owner.main, {})
                piece = state[what].detach() if what in state else torch.zeros_like(owner.main)
            full[owner.start : owner.end] = piece.view(-1)
        dist.all_reduce(full, group=self._dp_group)
        return full.view(param.shape)

    @torch.no_grad()
    def load_local_state(
        self, param: torch.nn.Parameter, master: Tensor, moments: dict[str, Tensor] | None, step: float
    ) -> None:
        """Set ``param``'s main copy from ``master`` and its Adam state (``moments`` None: a fresh state).

        ``master`` and the moments are this rank's whole tensor-parallel piece in float32.
        """
        owner = self._owners.get(param)
        if owner is None:
            return  # no shard of this parameter on this rank
        sl = slice(owner.start, owner.end) if self.distributed else slice(None)

        def part(t: Tensor) -> Tensor:
            t = t.to(device=owner.main.device, dtype=torch.float32)
            return t.reshape(-1)[sl].clone() if self.distributed else t.clone()

        if owner.main is not param:
            owner.main.copy_(part(master).view_as(owner.main))
        owner.inner.state.pop(owner.main, None)
        for group in owner.inner.param_groups:
            if "step" in group:
                group["step"] = int(step) if moments is not None else 0
        if moments is not None and step > 0:
            owner.inner.state[owner.main] = {
                "step": adam_step_tensor(owner.inner, step, owner.main),
                "exp_avg": part(moments["exp_avg"]).view_as(owner.main),
                "exp_avg_sq": part(moments["exp_avg_sq"]).view_as(owner.main),
            }

    def close(self) -> None:
        """Drop the optimizer's references (the buffers go with the DDP wrapper)."""
        self._owners.clear()
        self._parts.clear()
