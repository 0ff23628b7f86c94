"""The training engine: forward, forward_backward, AdamW steps, the weight stream, checkpoints."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from torch import Tensor

from verl_core import (
    BatchValidationError,
    CheckpointError,
    EngineSpec,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TensorBatch,
    TensorInfo,
    Tokenizer,
    TrainingCapabilities,
    WeightManifest,
    WeightMessage,
    stream_weights,
)
from verl_core.enginekit.gates import refuse_undeclared
from verl_core.enginekit.hf_tokenizer import load_tokenizer
from verl_core.enginekit.token_stats import token_log_probs
from verl_core.enginekit.training_base import TrainingEngineBase
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_tiny_backend.model import Model
from verl_tiny_backend.plugin import ACTOR_CAPABILITIES, CRITIC_CAPABILITIES

__all__ = ["DTYPES", "TinyTrainingEngine", "build_training_engine", "validate"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SEQ = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def validate(batch: TensorBatch, where: str, needs: tuple[str, ...], vocab_size: int,
             spec: EngineSpec | None = None) -> TensorBatch:
    """Rebuild ``batch`` through the TensorBatch constructor, value-check it, and (given the
    engine's ``spec``) refuse prompts and responses longer than its limits.

    Raises:
        BatchValidationError: naming ``where``, the field and what was expected.
    """
    if not isinstance(batch, TensorBatch):
        raise BatchValidationError(f"{where}: expected a TensorBatch, got {type(batch).__name__}")
    batch.require(*needs, where=where)
    try:
        rebuilt = TensorBatch(dict(batch.items()), batch.extras, batch.meta, batch_size=batch.batch_size)
    except BatchValidationError as e:
        raise BatchValidationError(f"{where}: {e}") from None
    rebuilt = rebuilt.check(where=where, vocab_size=vocab_size)
    if spec is not None and rebuilt.batch_size:
        for field, limit in (("prompt", spec.max_prompt_len), ("response", spec.max_response_len)):
            longest = int(rebuilt[f"{field}_mask"].sum(1).max())
            if longest > limit:
                raise BatchValidationError(f"{where}: a {field} has {longest} tokens, more than "
                                           f"EngineSpec.max_{field}_len={limit}")
    return rebuilt


class TinyTrainingEngine(TrainingEngineBase):
    """Actor, reference or critic (on a value-head folder) in plain torch.

    Args:
        spec: What to build; ``spec.model_path`` is a Llama, Qwen2 or Qwen3 transformers folder.

    Raises:
        ConfigError: the folder's architecture is not supported.
    """

    def __init__(self, spec: EngineSpec) -> None:
        refuse_undeclared(spec, ACTOR_CAPABILITIES, engine="the tiny training engine")
        self._spec = spec
        self.model = Model.from_folder(spec.model_path, DTYPES[spec.dtype], value_head=spec.role == "critic",
                                       seed=spec.seed)
        self._caps = CRITIC_CAPABILITIES if self.model.cfg.value_head else ACTOR_CAPABILITIES
        self._tok = load_tokenizer(spec.model_path, self.model.cfg.vocab_size)
        o = spec.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)
        self._init_training()  # the step counter and the one-call-per-optimizer-step gate

    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        """Values only on a value-head folder (the critic's)."""
        return self._caps

    @property
    def tokenizer(self) -> Tokenizer:
        """The folder's tokenizer; vocab_size is the model's embedding rows."""
        return self._tok

    def _outputs(self, b: TensorBatch, outputs: Collection[str]) -> dict[str, Tensor]:
        ids = torch.cat([b["prompt_ids"], b["response_ids"]], 1)
        mask = torch.cat([b["prompt_mask"], b["response_mask"]], 1)
        p, r = b["prompt_ids"].shape[1], b["response_ids"].shape[1]
        h = self.model.hidden(ids, mask)[:, p - 1: p + r - 1]  # the position before each response token
        rmask = b.loss_mask  # outputs only at sampled tokens; attention over response_mask
        out: dict[str, Tensor] = {}
        if "log_probs" in outputs or "entropy" in outputs:
            lp, ent = token_log_probs(self.model.logits(h), b["response_ids"], temperature=b.meta.temperature,
                                      entropy="entropy" in outputs)
            if "log_probs" in outputs:
                out["log_probs"] = lp.masked_fill(~rmask, 0.0)
            if ent is not None:
                out["entropy"] = ent.masked_fill(~rmask, 0.0)
        if "values" in outputs:
            if not self.model.cfg.value_head:
                raise BatchValidationError("forward: values were asked of a model without a value head")
            out["values"] = self.model.values(h).masked_fill(~rmask, 0.0)
        return out

    def _forward(self, batch: TensorBatch, outputs: Collection[ModelOutput], *, where: str) -> TensorBatch:
        """Log-probs, entropy and values of the response tokens, without gradients (a batch of 0
        rows never comes here: ``TrainingEngineBase.forward`` answers it)."""
        b = validate(batch, where, _SEQ, self.model.cfg.vocab_size, self._spec)
        with torch.no_grad():
            return b.update(self._outputs(b, outputs))

    def _forward_backward(self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *,
                          max_tokens: int | None, where: str) -> Metrics:
        """The gradients of ``loss_fn`` (already normalised by the global counts) over micro-batches
        of the whole mini-batch; a call that raises leaves no gradients."""
        b = validate(mini_batch, where, _SEQ, self.model.cfg.vocab_size, self._spec)
        s = self._spec
        budget = max_tokens or s.micro_batch_tokens
        parts = (b.micro_batches(max_tokens=budget) if budget
                 else b.micro_batches(size=s.micro_batch_size or b.batch_size))
        total = 0.0
        sums: dict[str, float] = {}
        try:
            for mb in parts:
                out = loss_fn(mb.update(self._outputs(mb, loss_fn.needs)), stats)
                out.loss.backward()  # type: ignore[no-untyped-call]
                total += float(out.loss.detach())
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # a failed call leaves no gradients
            raise
        return {**sums, "loss": total, "num_micro_batches": float(len(parts))}

    def _optimizer_step(self, *, where: str) -> StepMetrics:
        """Clip, step AdamW at ``lr_at(step)``; a non-finite grad norm skips (schedule untouched); after a
        mini-batch with no loss token, drop the gradients and change nothing else."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64)
        for g in grads:
            sq = sq + g.double().pow(2).sum()
        norm = float(sq.sqrt())
        lr = self._spec.optim.lr_at(self._step)
        if self._nothing_to_learn:  # no loss token: the step changes no weight and no Adam state
            self.optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=0.0, lr=lr, skipped=False)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=norm, lr=lr, skipped=True)
        clip = self._spec.optim.grad_clip
        if clip > 0 and norm > clip:
            for g in grads:
                g.mul_(clip / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepMetrics(grad_norm=norm, lr=lr, skipped=False)

    def export_weights(self, *, dtype: torch.dtype | None = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        """The weights as a stream whose version is the count of applied steps."""
        named = self.model.named_weights()
        infos = {n: TensorInfo(tuple(t.shape), dtype or t.dtype) for n, t in named}
        manifest = WeightManifest(self._step, infos, tied_embeddings=self.model.cfg.tied)
        return stream_weights(((n, t.detach()) for n, t in named), manifest, bucket_bytes=bucket_bytes, dtype=dtype)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Model, optimizer, step and RNG states, written to a temporary file and renamed."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "state.pt.tmp"
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "step": self._step,
                    "rng": torch.get_rng_state(), "py_rng": random.getstate()}, tmp)
        os.replace(tmp, folder / "state.pt")

    def _load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Restore what :meth:`save_checkpoint` wrote (weights-only loading); returns its step.

        Raises:
            CheckpointError: the folder holds no checkpoint of this backend.
        """
        file = Path(path) / "state.pt"
        if not file.exists():
            raise CheckpointError(f"{path} holds no tiny-backend checkpoint (no state.pt)")
        state = torch.load(file, weights_only=True)
        self.optimizer.zero_grad(set_to_none=True)  # a forward_backward before the load adds nothing after it
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        random.setstate(state["py_rng"])
        return int(state["step"])

    def offload(self) -> None:
        """Nothing to move on a CPU (the backend declares offload=False)."""

    def onload(self) -> None:
        """Nothing to move back."""


def build_training_engine(spec: EngineSpec) -> TinyTrainingEngine:
    """The factory the entry point names for the actor, reference and critic roles."""
    return TinyTrainingEngine(spec)
