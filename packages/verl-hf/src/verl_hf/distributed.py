"""Data parallelism of the training engine over torch.distributed (torchrun), FSDP2 or all-reduce.

Loss functions return contributions already normalised by the global counts, so the gradient of
the global loss is the SUM of the ranks' gradients: FSDP2's mean over ranks is undone by scaling
with the world size, and the all-reduce mode sums.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_core.kernel.errors import ConfigError

__all__ = [
    "DataParallel",
    "init_data_parallel",
]


class DataParallel:
    """The data-parallel group of an engine (a single rank when ``world == 1``)."""

    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        self.world = world
        self.rank = rank
        self.device = device

    @property
    def active(self) -> bool:
        """True when there is more than one rank."""
        return self.world > 1

    def max_int(self, value: int) -> int:
        """The maximum of ``value`` over ranks."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_finite(self, value: Tensor) -> bool:
        """Whether ``value`` is finite on every rank."""
        ok = torch.isfinite(value.detach().float()).all().to(torch.int64).reshape(1).to(self.device)
        if self.active:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def sum_tensor(self, t: Tensor) -> Tensor:
        """Sum ``t`` over ranks (a new tensor)."""
        out = t.detach().clone().to(self.device)
        if self.active:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def union_keys(self, keys: Sequence[str]) -> list[str]:
        """The sorted union of every rank's ``keys``."""
        if not self.active:
            return sorted(set(keys))
        gathered: list[list[str] | None] = [None] * self.world
        dist.all_gather_object(gathered, sorted(set(keys)))
        return sorted({k for part in gathered for k in (part or [])})

    def broadcast_str(self, value: str) -> str:
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return value
        box: list[str | None] = [value]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.active:
            dist.barrier()

    def sum_grads(self, params: Sequence[nn.Parameter], bucket_bytes: int) -> None:
        """All-reduce (sum) the gradients of ``params`` in buckets of about ``bucket_bytes``."""
        if not self.active:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[Tensor] = []
        size = 0
        for p in params:
            g = p.grad
            assert g is not None
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes:
                _reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket)


def _reduce_bucket(grads: list[Tensor]) -> None:
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in group:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


def init_data_parallel(dp: int, device: str) -> DataParallel:
    """Join (or start, from torchrun's environment) the process group of ``dp`` ranks.

    Returns the group and this rank's device (``cuda:LOCAL_RANK`` under CUDA).

    Raises:
        ConfigError: dp > 1 outside torchrun, or the world size differs from ``dp``.
    """
    if dp == 1:
        return DataParallel(1, 0, torch.device(device))
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                f"parallel.dp={dp} needs torch.distributed: launch with "
                f"`torchrun --nproc_per_node {dp} ...` (RANK/WORLD_SIZE are not set)"
            )
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if world != dp:
        raise ConfigError(
            f"parallel.dp={dp} but torch.distributed has {world} ranks; the hf backend is pure data "
            "parallel, so launch exactly dp processes"
        )
    rank = dist.get_rank()
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device)
    return DataParallel(world, rank, dev)
