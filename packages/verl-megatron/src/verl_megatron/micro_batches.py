"""The Megatron training engine's micro-batch loop, run by megatron-core's pipeline schedules.

Layout of one forward: Megatron's RoPE takes arange positions, so each row of ``[prompt;
response]`` is shifted left until its first real token sits at column 0. Real tokens are
contiguous (prompts are left-padded, responses right-padded), so their positions become
``0..L-1``, which is exactly ``cumsum(attention_mask) - 1`` of the padded layout, and the padding
now trails every real token, so a causal mask alone keeps it out of every real token's attention.

Packed (``MegatronOptions.pack_sequences``, pipeline parallel size 1): the real tokens of a
micro-batch's samples (an empty sample keeps one pad token) are laid end to end in one row and
run in megatron-core's ``thd`` format with ``PackedSeqParams`` (rotary positions restart per
sequence; the core attention keeps each sequence to itself, :mod:`verl_megatron.packed`), and
the partitioner's budget counts real tokens (``packed=True``).

A call's batch is cut by the kernel partitioner under the call's token budget (else the spec's
budget or size) and handed to ``get_forward_backward_func`` as ``num_microbatches`` (1F1B under
PP). The loss function's scalar is already normalised by the global counts, so the schedules run
with ``calculate_per_token_loss`` (no division by the number of micro-batches). Gradients are
then made global once per call: summed over the tensor-parallel group for the replicated
QK-norm weights, over the embedding group for a tied embedding split across pipeline stages, and
over data-parallel ranks. A call that raises clears the gradients it left.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Set
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import EngineSpec, GlobalBatchStats, LossFn, Metrics, TensorBatch
from verl_megatron.logprobs import vocab_parallel_log_probs
from verl_megatron.stage import Stage
from verl_megatron.stage_optimizer import StageOptimizer

__all__ = ["MicroBatchLoop"]


@dataclass(frozen=True)
class _Prepared:
    """A micro-batch in the model's layout."""

    batch: TensorBatch
    tokens: Tensor  # [b, s] shifted left, padding trailing; packed: [1, total] sequences end to end
    gather_idx: Tensor  # [b, R] column of the logits that predicts response token t
    loss_mask: Tensor  # [b, R] where outputs are kept (TensorBatch.loss_mask: no observation tokens)
    real: int  # samples that are not padding added for uniform pipeline shapes
    cu_seqlens: Tensor | None = None  # packed: int32 [b + 1] sequence boundaries in ``tokens``
    max_seqlen: int = 0  # packed: the longest sequence


class MicroBatchLoop:
    """Runs one model stage over the micro-batches of a call.

    Args:
        stage: The model stage.
        spec: The engine spec (``micro_batch_tokens``, ``micro_batch_size``).
        optimizer: The stage's optimizer (None for a frozen reference): where gradients live.
        packed: Run each micro-batch without padding (needs pipeline parallel size 1); a token
            budget then counts the real tokens.
    """

    def __init__(self, stage: Stage, spec: EngineSpec, optimizer: StageOptimizer | None, *,
                 packed: bool = False) -> None:
        assert not packed or stage.pp == 1, "packed micro-batches need pipeline parallel size 1"
        self._s = stage
        self._spec = spec
        self._opt = optimizer
        self._packed = packed

    def _prepare(self, mb: TensorBatch, real: int) -> _Prepared:
        prompt_mask, response_mask = mb["prompt_mask"], mb["response_mask"]
        ids = torch.cat([mb["prompt_ids"], mb["response_ids"]], 1)
        mask = torch.cat([prompt_mask, response_mask], 1)
        b, s = ids.shape
        lengths = mask.sum(1)
        left_pad = (~prompt_mask).sum(1)
        cols = torch.arange(s, device=ids.device).unsqueeze(0)
        src = (cols + left_pad.unsqueeze(1)).clamp(max=s - 1)
        tokens = ids.gather(1, src).masked_fill(cols >= lengths.unsqueeze(1), mb.meta.pad_token_id)
        r = response_mask.shape[1]
        prompt_len = prompt_mask.sum(1)
        gather_idx = (prompt_len.unsqueeze(1) + torch.arange(r, device=ids.device) - 1).clamp(0, s - 1)
        if self._packed:
            return self._pack(mb, tokens, lengths, gather_idx, real)
        if self._s.pp == 1 and b:
            # Without pipeline stages shapes may vary per micro-batch: drop trailing padding.
            width = max(int(lengths.max()), 1)
            tokens = tokens[:, :width]
            gather_idx = gather_idx.clamp(max=width - 1)
        dev = self._s.device
        return _Prepared(mb, tokens.to(dev), gather_idx.to(dev), mb.loss_mask.to(dev), real)

    def _pack(self, mb: TensorBatch, tokens: Tensor, lengths: Tensor, gather_idx: Tensor, real: int) -> _Prepared:
        """The left-shifted rows' real tokens end to end in one row (an empty sample keeps one pad token)."""
        n = lengths.clamp(min=1)
        keep = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < n.unsqueeze(1)
        packed = tokens[keep].unsqueeze(0)  # row-major: sample by sample
        cu = torch.zeros(n.numel() + 1, dtype=torch.int32, device=tokens.device)
        cu[1:] = n.cumsum(0)
        # column of sample i's token j in the packed row: cu[i] + j, kept inside the sample
        idx = cu[:-1].unsqueeze(1).long() + torch.minimum(gather_idx, (n - 1).unsqueeze(1))
        dev = self._s.device
        return _Prepared(mb, packed.to(dev), idx.to(dev), mb.loss_mask.to(dev), real, cu.to(dev),
                         int(n.max()) if n.numel() else 0)

    def _micro_batches(self, batch: TensorBatch, max_tokens: int | None = None) -> tuple[list[_Prepared], Any]:
        """Micro-batches by the kernel partitioner: the call's budget, else the spec's budget or size."""
        spec = self._spec
        pp = self._s.pp
        budget = max_tokens if max_tokens is not None else spec.micro_batch_tokens
        if budget is not None:
            mbs = batch.micro_batches(max_tokens=budget, trim=pp == 1, packed=self._packed)
        else:
            mbs = batch.micro_batches(size=spec.micro_batch_size or max(batch.batch_size, 1), trim=pp == 1)
        parts = list(mbs.batches)
        if pp > 1 and parts:
            # Pipeline stages exchange activations of one fixed shape.
            size = max(p.batch_size for p in parts)
            parts = [p.pad_to_multiple(size)[0] if p.batch_size < size else p for p in parts]
        real = [b.batch_size for b in mbs.batches]
        return [self._prepare(p, n) for p, n in zip(parts, real, strict=True)], mbs

    # ------------------------------------------------------------------ model execution
    def _causal_mask(self, s: int) -> Tensor:
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device=self._s.device), 1).view(1, 1, s, s)

    @staticmethod
    def _packed_positions(prep: _Prepared) -> Tensor:
        """Positions restarting at 0 for every packed sequence ([1, total])."""
        cu = prep.cu_seqlens
        assert cu is not None
        total = prep.tokens.shape[1]
        starts = torch.repeat_interleave(cu[:-1].long(), (cu[1:] - cu[:-1]).long(), output_size=total)
        return (torch.arange(total, device=cu.device) - starts).unsqueeze(0)

    @staticmethod
    def _packed_params(prep: _Prepared) -> Any:
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=prep.cu_seqlens, cu_seqlens_kv=prep.cu_seqlens,
                               max_seqlen_q=prep.max_seqlen, max_seqlen_kv=prep.max_seqlen)

    def _outputs(self, out: Tensor, prep: _Prepared, needed: Collection[str], temperature: float) -> dict[str, Tensor]:
        """Model outputs at the response positions ([b, R] float32, 0 where the loss mask is False)."""
        s = self._s
        result: dict[str, Tensor] = {}
        idx = prep.gather_idx
        rmask = prep.loss_mask
        zero = torch.zeros((), dtype=torch.float32, device=out.device)

        def pick(x: Tensor) -> Tensor:
            """``x``'s [b, R, ...] entries at the response positions ([b, s, ...], or packed [1, total, ...])."""
            if prep.cu_seqlens is not None:  # one row of every sample's tokens: index it, never expand it
                return x[0].index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[2:])
            return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))

        if "values" in needed:
            result["values"] = torch.where(rmask, pick(out[..., 0].float()), zero)
        if {"log_probs", "entropy"} & set(needed):
            logits = pick(out)
            n_local = out.shape[-1]
            lp, ent = vocab_parallel_log_probs(
                logits,
                prep.batch["response_ids"].to(out.device),
                vocab_start=s.tp_rank * n_local,
                tp_group=s.ps.get_tensor_model_parallel_group() if s.tp > 1 else None,
                tp_size=s.tp,
                temperature=temperature,
                entropy="entropy" in needed,
            )
            if "log_probs" in needed:
                result["log_probs"] = torch.where(rmask, lp, zero)
            if ent is not None:
                result["entropy"] = torch.where(rmask, ent, zero)
        return result

    def _run(self, preps: list[_Prepared], loss_of: Any, *, forward_only: bool, model: Any = None) -> list[dict[str, Tensor]]:
        """Run Megatron's schedule over ``preps``; returns the last stage's per-micro-batch dicts."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        it = iter(preps)
        device = self._s.device

        def forward_step(data_iterator: Iterator[_Prepared], model: Any) -> tuple[Tensor, Any]:
            prep = next(data_iterator)
            b, s = prep.tokens.shape
            if prep.cu_seqlens is not None:
                return model(prep.tokens, self._packed_positions(prep), None,
                             packed_seq_params=self._packed_params(prep)), partial(loss_of, prep)
            positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
            out = model(prep.tokens, positions, self._causal_mask(s))
            return out, partial(loss_of, prep)

        fb = get_forward_backward_func()
        shape = preps[0].tokens.shape
        out: list[dict[str, Tensor]] = fb(
            forward_step_func=forward_step,
            data_iterator=it,
            model=[self._s.model if model is None else model],
            num_microbatches=len(preps),
            seq_length=int(shape[1]),
            micro_batch_size=int(shape[0]),
            forward_only=forward_only,
        )
        return out

    # ------------------------------------------------------------------ calls
    def forward(self, batch: TensorBatch, needed: Set[str]) -> TensorBatch:
        """``batch`` with the ``needed`` outputs (computed without gradients) added."""
        s = self._s
        preps, mbs = self._micro_batches(batch)
        temperature = batch.meta.temperature

        def loss_of(prep: _Prepared, out: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            res = {k: v[: prep.real].detach().cpu() for k, v in self._outputs(out, prep, needed, temperature).items()}
            zero = torch.zeros((), device=out.device, dtype=torch.float32)
            return zero, torch.ones((), dtype=torch.int, device=out.device), res

        s.model.eval()
        with torch.no_grad():
            stored = self._run(preps, loss_of, forward_only=True)
        fields = sorted(needed)
        per_mb: list[TensorBatch] = []
        for i, prep in enumerate(preps):
            r = prep.batch.response_len
            tensors: dict[str, Tensor] = {}
            for name in fields:
                t = stored[i][name] if s.last else torch.empty(prep.real, r)
                if s.pp > 1:
                    t = t.to(s.device).contiguous()
                    dist.broadcast(t, src=s.pp_last_rank(), group=s.ps.get_pipeline_model_parallel_group())
                tensors[name] = t.to(mbs.batches[i].device)
            per_mb.append(mbs.batches[i].select(*mbs.batches[i].keys()).update(tensors))
        restored: TensorBatch = mbs.restore(per_mb)
        width = batch.response_len
        result: dict[str, Tensor] = {}
        for k in fields:
            t = restored[k]
            if t.shape[1] < width:  # micro-batches were trimmed of all-padding columns
                t = torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], 1)
            result[k] = t.to(batch.device)
        return batch.update(result)

    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, max_tokens: int | None
    ) -> Metrics:
        """Backpropagate ``loss_fn`` over the micro-batches of ``mini_batch`` and make the gradients global."""
        s = self._s
        opt = self._opt
        assert opt is not None
        needed = frozenset(loss_fn.needs)
        # a rank's 0-row share (the global mini-batch has fewer samples than ranks) runs padding only
        preps = self._micro_batches(mini_batch, max_tokens)[0] if mini_batch.batch_size else []
        n_mb = torch.tensor([len(preps)], dtype=torch.int64, device=s.device)
        if s.dp > 1:
            dist.all_reduce(n_mb, op=dist.ReduceOp.MAX, group=s.ps.get_data_parallel_group())
        if int(n_mb) > len(preps):
            # Every data-parallel rank runs the same number of micro-batches: pad with empty ones.
            if preps:
                empty = preps[-1].batch.pad_to_multiple(preps[-1].batch.batch_size + 1)[0]
                empty = empty.index(slice(preps[-1].batch.batch_size, None))
                if s.pp > 1:
                    empty = empty.pad_to_multiple(preps[-1].batch.batch_size)[0]
            else:
                empty = _padding_sample(mini_batch)
            preps += [self._prepare(empty, 0)] * (int(n_mb) - len(preps))
        temperature = mini_batch.meta.temperature

        def loss_of(prep: _Prepared, out: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            outs = self._outputs(out, prep, needed, temperature)
            mb = prep.batch.update({k: v.to(prep.batch.device) for k, v in outs.items()})
            res = loss_fn(mb, stats)
            metrics = {k: v.detach().float().reshape(()).cpu() for k, v in res.metrics.items()}
            metrics["loss"] = res.loss.detach().float().reshape(()).clone().cpu()
            return res.loss, torch.ones((), dtype=torch.int, device=out.device), metrics

        s.model.train()
        try:
            stored = self._run(preps, loss_of, forward_only=False,
                               model=opt.core.ddp if opt.core is not None else None)
        except BaseException:
            opt.clear_grads()  # the call started without gradients: it leaves none
            raise
        self._sync_grads(opt)
        return self._reduce_metrics(stored, len(preps))

    def _reduce_metrics(self, stored: list[dict[str, Tensor]], n_mb: int) -> Metrics:
        s = self._s
        keys: list[str] = sorted({k for d in stored for k in d}) if s.last else []
        if s.pp > 1:
            obj: list[Any] = [keys]
            dist.broadcast_object_list(obj, src=s.pp_last_rank(), group=s.ps.get_pipeline_model_parallel_group())
            keys = obj[0]
        vec = torch.zeros(len(keys), dtype=torch.float64)
        if s.last:
            for d in stored:
                for i, k in enumerate(keys):
                    if k in d:
                        vec[i] += float(d[k])
        vec = vec.to(s.device)
        if s.pp > 1:
            dist.broadcast(vec, src=s.pp_last_rank(), group=s.ps.get_pipeline_model_parallel_group())
        if s.dp > 1:
            dist.all_reduce(vec, group=s.ps.get_data_parallel_group())
        out = {k: float(v) for k, v in zip(keys, vec.cpu().tolist(), strict=True)}
        out["num_micro_batches"] = float(n_mb)
        return out

    def _sync_grads(self, opt: StageOptimizer) -> None:
        s = self._s
        ps = s.ps
        params = dict(s.model.named_parameters())
        if s.tp > 1 and s.dims.qk_norm:
            # QK-norm weights are replicated but each TP rank only saw its own heads.
            for name, p in params.items():
                grad = opt.grad(p)
                if grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        if s.pp > 1 and s.dims.tied and ps.is_rank_in_embedding_group():
            shared = s.model.shared_embedding_or_output_weight()
            if opt.core is None and shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            grad = opt.grad(shared)
            assert grad is not None
            dist.all_reduce(grad, group=ps.get_embedding_group())
        if opt.core is not None:
            opt.core.reduce()  # megatron's DDP: the data-parallel sum of its gradient buffers
        elif s.dp > 1:
            for p in params.values():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())


def _padding_sample(batch: TensorBatch) -> TensorBatch:
    """One sample shaped like ``batch``'s columns that contributes nothing: a prompt of pad ids whose last
    token is real, an empty response, every other field 0 (a 0-row share's stand-in, so its rank joins
    the collectives of the others' micro-batches)."""
    pad = batch.meta.pad_token_id
    fields: dict[str, Tensor] = {}
    for name, t in batch.items():
        one = torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device)
        if name in ("prompt_ids", "response_ids"):
            one.fill_(pad)
        elif name == "prompt_mask":
            one[:, -1] = True
        fields[name] = one
    return TensorBatch(fields, meta=batch.meta)
