"""The training engine's micro-batch loop: forward without gradients, forward and backward with them.

A call's batch is cut by the kernel partitioner (``TensorBatch.micro_batches``) under a token
budget (counting real tokens when the loop packs, padded tokens otherwise), or into fixed-size
pieces. Every data-parallel rank runs the same number of micro-batches
(padding with one-sample micro-batches whose empty response contributes exactly zero), so FSDP's
collectives match across ranks. Gradients are summed over micro-batches and, once at the end of
a training call, over ranks; a call that raises clears the gradients it left.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.training import GlobalBatchStats, LossFn, Metrics
from verl_hf.distributed import DataParallel
from verl_hf.modeling import ModelKind, token_outputs

__all__ = ["MicroBatchLoop"]


class MicroBatchLoop:
    """Runs a model over the micro-batches of one call.

    Args:
        model: The transformers model (FSDP2-wrapped under ``fsdp``).
        kind: ``causal_lm`` or ``value``.
        device: Where the micro-batches run.
        dp: The data-parallel group.
        fsdp: The model is sharded with FSDP2 (it averages gradients over ranks).
        allreduce_bucket_bytes: Bucket size of the gradient all-reduce without FSDP.
        packed: Run each micro-batch without padding (``token_outputs(packed=True)``; the model
            is set to the packed attention); a token budget then counts the real tokens.
    """

    def __init__(
        self, model: Any, kind: ModelKind, device: torch.device, dp: DataParallel, *, fsdp: bool,
        allreduce_bucket_bytes: int, packed: bool = False,
    ) -> None:
        self._model = model
        self._kind: ModelKind = kind
        self._device = device
        self._dp = dp
        self._fsdp = fsdp
        self._bucket_bytes = allreduce_bucket_bytes
        self._packed = packed
        # Factor that turns the gradients a backward leaves into the SUM over ranks: FSDP averages
        # over ranks, and scaling by the world size gives the sum (exact for power-of-two worlds).
        # A divide factor of 1 would need PREMUL_SUM, which gloo lacks.
        self._grad_scale = float(dp.world) if fsdp else 1.0

    def plan(self, batch: TensorBatch, max_tokens: int | None, size: int | None) -> list[tuple[Tensor, TensorBatch]]:
        """Micro-batches of ``batch`` with the original sample indices of each."""
        if batch.batch_size == 0:
            return []
        if max_tokens is not None:
            mbs = batch.micro_batches(max_tokens=max_tokens, packed=self._packed)
        else:
            mbs = batch.micro_batches(size=size or batch.batch_size)
        out: list[tuple[Tensor, TensorBatch]] = []
        start = 0
        for mb in mbs.batches:
            out.append((mbs.order[start : start + mb.batch_size], mb))
            start += mb.batch_size
        return out

    def _padding(self, meta: BatchMeta) -> TensorBatch:
        """A one-sample micro-batch with an empty response: it contributes exactly zero."""
        pad = meta.pad_token_id
        dev = self._device
        return TensorBatch(
            {
                "prompt_ids": torch.full((1, 1), pad, dtype=torch.int64, device=dev),
                "prompt_mask": torch.ones(1, 1, dtype=torch.bool, device=dev),
                "response_ids": torch.full((1, 1), pad, dtype=torch.int64, device=dev),
                "response_mask": torch.zeros(1, 1, dtype=torch.bool, device=dev),
            },
            meta=meta,
        )

    def forward(
        self, batch: TensorBatch, wanted: Set[str], max_tokens: int | None, size: int | None
    ) -> dict[str, Tensor]:
        """``wanted`` outputs of ``batch`` (on the device) without gradients, ``[batch, response]`` each."""
        plan = self.plan(batch, max_tokens, size)
        n = self._dp.max_int(len(plan)) if self._fsdp else len(plan)
        results: dict[str, Tensor] = {
            name: torch.zeros(batch.batch_size, batch.response_len, dtype=torch.float32, device=self._device)
            for name in wanted
        }
        self._model.eval()
        temperature = batch.meta.temperature
        with torch.no_grad():
            for i in range(n):
                if i < len(plan):
                    idx, mb = plan[i]
                    out = token_outputs(
                        self._model, mb, wanted, kind=self._kind, temperature=temperature,
                        always_run=self._fsdp, packed=self._packed,
                    )
                    width = mb.response_len
                    for name, value in out.items():
                        results[name][idx, :width] = value
                else:
                    token_outputs(
                        self._model, self._padding(batch.meta), wanted,
                        kind=self._kind, temperature=temperature, always_run=True,
                    )
        return results

    def forward_backward(
        self, batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None,
        size: int | None, where: str,
    ) -> Metrics:
        """Backpropagate ``loss_fn`` over the micro-batches of ``batch`` (on the device); see the module docstring."""
        needs = set(loss_fn.needs)
        plan = self.plan(batch, max_tokens, size)
        n = self._dp.max_int(len(plan))
        temperature = batch.meta.temperature
        loss_sum = torch.zeros((), dtype=torch.float32, device=self._device)
        metric_sums: dict[str, Tensor] = {}
        params = [p for p in self._model.parameters() if p.requires_grad]
        self._model.train()
        try:
            for i in range(n):
                if self._fsdp:
                    self._set_grad_sync(i == n - 1)
                if i < len(plan):
                    mb = plan[i][1]
                    out = token_outputs(
                        self._model, mb, needs, kind=self._kind, temperature=temperature,
                        always_run=self._fsdp, packed=self._packed,
                    )
                    result = loss_fn(mb.update(out), stats)
                    loss = result.loss
                    if loss.dim() != 0:
                        raise ConfigError(f"{where}: the loss function returned shape {tuple(loss.shape)}, expected a scalar")
                    for k, v in result.metrics.items():
                        v = v.detach().float().to(self._device).reshape(())
                        metric_sums[k] = metric_sums[k] + v if k in metric_sums else v
                    loss_sum += loss.detach().float()
                    if self._fsdp or not loss.requires_grad:
                        # A loss that ignores the model (e.g. only empty responses) still runs
                        # backward through the whole forward, so FSDP's collectives match across ranks.
                        loss = loss + _zero_link(out, self._device)
                else:
                    pad = self._padding(batch.meta)
                    out = token_outputs(
                        self._model, pad, needs, kind=self._kind, temperature=temperature,
                        always_run=True,
                    )
                    loss = _zero_link(out, self._device)
                if loss.requires_grad:
                    loss.backward()  # type: ignore[no-untyped-call]
        except BaseException:
            for p in params:  # the call started without gradients: it leaves none
                p.grad = None
            raise
        finally:
            self._model.eval()
            if self._fsdp:
                self._set_grad_sync(True)
        self._reduce_grads(params)
        keys = self._dp.union_keys(list(metric_sums))
        packed = torch.stack(
            [loss_sum] + [metric_sums.get(k, torch.zeros((), device=self._device)) for k in keys]
        )
        packed = self._dp.sum_tensor(packed).cpu()
        metrics: Metrics = {"loss": float(packed[0])}
        metrics.update({k: float(packed[j + 1]) for j, k in enumerate(keys)})
        metrics["num_micro_batches"] = float(n)
        return metrics

    def _reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Turn this rank's gradients of the call into the sum over ranks (once per call)."""
        if not self._dp.active:
            return
        if not self._fsdp:
            self._dp.sum_grads(params, self._bucket_bytes)
        elif self._grad_scale != 1.0:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(self._grad_scale)

    def _set_grad_sync(self, sync: bool) -> None:
        fn = getattr(self._model, "set_requires_gradient_sync", None)
        if fn is not None:
            fn(sync)


def _zero_link(outputs: dict[str, Tensor], device: torch.device) -> Tensor:
    """Zero that depends on every output: backward through it touches every parameter, adding 0."""
    total = torch.zeros((), device=device)
    for v in outputs.values():
        total = total + v.sum()
    return total * 0.0
