"""Weight sync coverage: after a sync, every tensor of the stream serves, the last one included.

A receiver that skips a tensor can hide behind weights that did not change: the suite's other
models share their norm weights (all ones), and the last tensor of a stream in fusion-group order
is ``model.norm.weight``. Here every tensor of the weights sent differs from what the engine
serves before the sync (:func:`verl_conformance.testkit.perturbed_model`), the float64 reference
proves that leaving out any single tensor would move the log-probs beyond the tolerance, and the
stream is sent in three orders: fusion-group order, reversed, and the order and chunking of the
backend's own training engine's export.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from verl_conformance.checks._registry import check
from verl_conformance.checks.weight_sync import folder_weights
from verl_conformance.harness import Harness
from verl_conformance.reference import ReferenceModel
from verl_conformance.testkit import tolerance
from verl_core import (
    RolloutEngine,
    SamplingParams,
    TensorBatch,
    TensorInfo,
    TrainingEngine,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    stream_weights,
)
from verl_core.enginekit.weight_stream import fusion_group

_BUCKET = 64 * 1024  # several chunks per stream for the suite's models


def _ordered(tensors: dict[str, Tensor], order: list[str], version: int, dtype: torch.dtype
             ) -> Iterator[WeightMessage]:
    manifest = WeightManifest(version, {n: TensorInfo(tuple(tensors[n].shape), dtype) for n in order})
    return stream_weights(((n, tensors[n]) for n in order), manifest, bucket_bytes=_BUCKET, dtype=dtype)


def _like_trainer(trainer: TrainingEngine, tensors: dict[str, Tensor], version: int, dtype: torch.dtype
                  ) -> Iterator[WeightMessage]:
    """``tensors`` in the names, order and chunks of ``trainer``'s own export stream."""
    for msg in trainer.export_weights(dtype=dtype, bucket_bytes=_BUCKET):
        if isinstance(msg, WeightManifest):
            yield WeightManifest(version, msg.tensors, msg.tied_embeddings)
        elif isinstance(msg, WeightChunk):
            yield WeightChunk(tuple((n, tensors[n].to(dtype)) for n, _ in msg.tensors))
        else:
            yield WeightCommit(version)


def _recorded(stream: Iterable[WeightMessage], names: list[list[str]]) -> Iterator[WeightMessage]:
    """Pass ``stream`` through, appending each chunk's names to ``names``."""
    for msg in stream:
        if isinstance(msg, WeightChunk):
            names.append([n for n, _ in msg.tensors])
        yield msg


def _prompts(h: Harness) -> TensorBatch:
    return h.batch(seed=95, batch_size=3).select("prompt_ids", "prompt_mask", "group_ids")


class _Reference:
    """A float64 copy of the suite's Llama whose weights are set per comparison.

    It scores a whole batch in one forward: each sample's real prompt and response tokens,
    concatenated and right-padded, so no real position attends to padding and positions are
    0..n-1 (the float64 reference's definition, batched for the many weight variants here).
    """

    def __init__(self, path: str) -> None:
        self.model = ReferenceModel(path).model
        self.params = dict(self.model.named_parameters())

    def set(self, weights: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(weights[name].to(p.dtype))

    def log_probs(self, out: TensorBatch) -> Tensor:
        pm, rm = out["prompt_mask"].cpu(), out["response_mask"].cpu()
        rows = [torch.cat([out["prompt_ids"][b].cpu()[pm[b]], out["response_ids"][b].cpu()[rm[b]]])
                for b in range(out.batch_size)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for b, r in enumerate(rows):
            ids[b, : len(r)], mask[b, : len(r)] = r, 1
        with torch.no_grad():
            logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.double(), -1)
        result = torch.zeros(rm.shape, dtype=torch.float64)
        for b in range(out.batch_size):
            p, n = int(pm[b].sum()), int(rm[b].sum())
            toks = out["response_ids"][b].cpu()[rm[b]]
            result[b, :n] = logp[b, p - 1 : p + n - 1].gather(-1, toks.unsqueeze(-1)).squeeze(-1)
        return result

    def reverted(self, target: dict[str, Tensor], previous: dict[str, Tensor], out: TensorBatch
                 ) -> tuple[Tensor, dict[str, Tensor]]:
        """Log-probs of ``out`` under ``target``, and under ``target`` with each tensor left at ``previous``."""
        self.set(target)
        want = self.log_probs(out)
        reverted: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(previous[name].to(p.dtype))
                reverted[name] = self.log_probs(out)
                p.copy_(target[name].to(p.dtype))
        return want, reverted


def _sync_and_verify(h: Harness, engine: RolloutEngine, ref: _Reference, stream: Iterator[WeightMessage],
                     version: int, target: str, previous: str, label: str) -> None:
    chunks: list[list[str]] = []
    engine.update_weights(_recorded(stream, chunks))
    order = [n for c in chunks for n in c]
    last = chunks[-1] if chunks else []
    h.expect(engine.weight_version == version,
             f"{label}: weight_version is {engine.weight_version} after a sync to version {version}")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=13)
    out = engine.generate(_prompts(h), params)
    mask = out["response_mask"]
    want, reverted = ref.reverted(folder_weights(h.model_path(target)), folder_weights(h.model_path(previous)), out)
    tol = tolerance(h.dtype, "log_probs")

    def excess(a: Tensor, b: Tensor) -> float:
        """How far ``a`` is outside the tier around ``b`` at the worst real token (> 0: visibly different)."""
        d = (a.double() - b).abs() - (tol.atol + tol.rtol * b.abs())
        return float(d[mask].max()) if bool(mask.any()) else float("-inf")

    blind = sorted(n for n, r in reverted.items() if excess(r, want) <= 0)
    h.expect(not blind, f"{label}: leaving {blind[:4]} at their previous values would not move the reference's "
             f"log-probs beyond the {h.dtype} tier, so the check cannot prove them applied (a suite bug)")
    got = out["rollout_log_probs"]
    if excess(got, want) <= 0:
        return
    # Name the tensors whose previous value explains what the engine serves.
    explained = sorted(reverted, key=lambda n: excess(got, reverted[n]))
    best = explained[0]
    where = f"position {order.index(best) + 1} of {len(order)}" if best in order else "not sent"
    hint = (f"; the served log-probs match the reference with {best} ({where} in stream order"
            f"{', in the last chunk' if best in last else ''}) left at its previous value: it was not applied"
            if excess(got, reverted[best]) <= 0 else "")
    h.close_to(got, want, "log_probs",
               f"{label}: rollout_log_probs after the sync vs the float64 reference of the weights sent "
               f"(every tensor differs from the previous weights; last chunk {last}){hint}", mask=mask)


@check("weight_sync")
def check_every_tensor_applied(h: Harness) -> None:
    """After a sync every tensor of the stream serves, the last one included: in fusion-group order, reversed, and in the backend trainer's export order (every tensor changed, float64 reference)."""
    engine = h.rollout(fresh=True)
    if not engine.capabilities.weight_update:
        h.skip("backend declares weight_update=False")
    if not engine.log_probs_exact(SamplingParams(temperature=1.0)):
        h.skip("rollout_log_probs are declared inexact at temperature 1; cannot tell which weights serve")
    a, b = "llama-perturbed-a", "llama-perturbed-b"
    wa, wb = folder_weights(h.model_path(a)), folder_weights(h.model_path(b))
    grouped = sorted(wa, key=fusion_group)
    dtype = engine.weight_dtype
    ref = _Reference(h.model_path("llama"))
    _sync_and_verify(h, engine, ref, _ordered(wa, grouped, 1, dtype), 1, a, "llama",
                     f"sync 1 (fusion-group order, last tensor {grouped[-1]})")
    _sync_and_verify(h, engine, ref, _ordered(wb, grouped[::-1], 2, dtype), 2, b, a,
                     f"sync 2 (reversed order, last tensor {grouped[0]})")
    src = h.subject if h.provides(h.subject, "actor") else h.against
    if src is not None and h.provides(src, "actor"):
        trainer = h.training(subject=src)
        _sync_and_verify(h, engine, ref, _like_trainer(trainer, wa, 3, dtype), 3, a, b,
                         f"sync 3 (the order and chunks of {src.name}'s training engine export)")
