"""The Megatron training engine's tensors gathered whole: the weight stream and transformers state dicts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import TensorInfo, WeightManifest, WeightMessage, stream_weights
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_megatron.stage import Stage
from verl_megatron.stage_optimizer import StageOptimizer

__all__ = ["Gatherable", "StageWeights"]

Gatherable = Literal["param", "grad", "master", "exp_avg", "exp_avg_sq"]
"""What :meth:`StageWeights.full_tensor` gathers of a parameter."""


class StageWeights:
    """Gathers the full tensors of a model split over tensor and pipeline ranks.

    Args:
        stage: The model stage.
        optimizer: The stage's optimizer (None for a frozen reference): masters, moments, gradients.
        export_ranks: ``"all"``: every rank's stream carries the tensors; ``"first"``: only global rank 0's.
    """

    def __init__(self, stage: Stage, optimizer: StageOptimizer | None, export_ranks: str) -> None:
        self._s = stage
        self._opt = optimizer
        self._export_ranks = export_ranks

    def full_tensor(self, name: str, *, what: Gatherable = "param") -> Tensor:
        """Gather the full Megatron tensor ``name`` (TP all-gather, PP broadcast) onto every rank.

        ``what`` picks the parameter, its gradient, its float32 master (the parameter itself without
        masters) or one of its Adam moments (zeros when absent); masters and moments come in the
        optimizer's dtype.
        """
        s = self._s
        opt = self._opt
        core = opt.core if opt is not None else None
        ps = s.ps
        owner = s.adapter.stage_of(name, s.pp)
        full: Tensor | None = None
        dtype = s.dtype
        if what not in ("param", "grad") and opt is not None and opt.master is not None:
            dtype = opt.master.masters[0].dtype if opt.master.masters else s.dtype
        if what != "param" and core is not None:
            dtype = torch.float32  # megatron's gradient buffers, main parameters and moments
        if s.pp_rank == owner:
            param = dict(s.model.named_parameters())[s.adapter.local_name(name, s.pp)]
            local = param.detach()
            if what == "grad":
                grad = core.grad(param) if core is not None else param.grad
                local = grad.detach() if grad is not None else torch.zeros_like(local)
            elif what != "param":
                if opt is None:
                    local = param.detach() if what == "master" else torch.zeros_like(local)
                else:
                    local = opt.local_state(param, what)
            if s.tp > 1 and s.adapter.partition(name) != "replicated":
                shards = [torch.empty_like(local) for _ in range(s.tp)]
                dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                full = s.adapter.unshard(name, shards)
            else:
                full = local
        if s.pp > 1:
            group = ps.get_pipeline_model_parallel_group()
            src = int(dist.get_process_group_ranks(group)[owner])
            buf = full.contiguous() if full is not None else torch.empty(
                s.adapter.megatron_shape(name), dtype=dtype, device=s.device
            )
            dist.broadcast(buf, src=src, group=group)
            full = buf
        assert full is not None
        return full

    def hf_tensors(self, *, grad: bool = False, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """Full tensors in transformers naming, one Megatron tensor gathered at a time.

        Each piece is made contiguous and cast to ``dtype`` in one copy (none when it already is);
        nothing of a Megatron tensor outlives its pieces, so besides what the consumer keeps only
        the tensor being gathered and converted is alive.
        """
        adapter = self._s.adapter
        for name in adapter.megatron_names():
            parts = adapter.to_hf_tensor(name, self.full_tensor(name, what="grad" if grad else "param"))
            for hf_name in list(parts):
                t = parts.pop(hf_name)
                assert t is not None
                want = dtype or t.dtype
                if not t.is_contiguous() or t.dtype != want:
                    t = torch.empty(t.shape, dtype=want, device=t.device).copy_(t)
                yield hf_name, t
                del t

    def stream(
        self, version: int, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """The weight stream of weight version ``version`` (every rank must iterate it to the end)."""
        s = self._s
        out_dtype = dtype or s.dtype
        manifest = WeightManifest(
            version=version,
            tensors={n: TensorInfo(shape, out_dtype) for n, shape in s.adapter.hf_shapes().items()},
            tied_embeddings=s.dims.tied,
        )
        if self._export_ranks == "first" and dist.get_rank() != 0:
            def drain() -> Iterator[WeightMessage]:
                yield manifest
                for _ in self.hf_tensors():
                    pass
                from verl_core import WeightCommit

                yield WeightCommit(manifest.version)

            return drain()
        return stream_weights(self.hf_tensors(dtype=dtype), manifest, bucket_bytes=bucket_bytes, dtype=dtype)
