"""The example backend's TrainingEngine: log-probs, entropy, values, AdamW training, weight export."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from torch import Tensor

from verl_core import (
    ConfigError,
    EngineSpec,
    GlobalBatchStats,
    LossFn,
    Metrics,
    ModelOutput,
    StepMetrics,
    TensorBatch,
    TensorInfo,
    TrainingCapabilities,
    TrainingEngine,
    WeightManifest,
    WeightMessage,
    parse_options,
    stream_weights,
)
from verl_core.enginekit.token_stats import token_log_probs
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_example_backend.inputs import validate
from verl_example_backend.model import DecoderLM, load_model
from verl_example_backend.plugin import CRITIC_CAPABILITIES, TRAINING_CAPABILITIES, ExampleOptions
from verl_example_backend.tokenizer import FolderTokenizer

__all__ = ["ExampleTrainingEngine", "build_training_engine", "token_outputs"]

_NEEDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def token_outputs(
    model: DecoderLM, batch: TensorBatch, outputs: Collection[ModelOutput]
) -> dict[str, Tensor]:
    """Log-probs, entropy and/or values of the response tokens of ``batch`` (float32, 0 where
    ``batch.loss_mask`` is False).

    Token t of the response is predicted by the logits at the position before it, so the slice
    starts at the last prompt column.
    """
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    p, r = batch.prompt_len, batch.response_len
    rmask = batch.loss_mask  # outputs only at sampled tokens; attention over response_mask
    hidden = model.hidden(ids, mask)[:, p - 1 : p + r - 1]
    out: dict[str, Tensor] = {}
    if "values" in outputs:
        out["values"] = model.values(hidden).float().masked_fill(~rmask, 0.0)
    if "log_probs" in outputs or "entropy" in outputs:
        lp, ent = token_log_probs(
            model.logits(hidden), batch["response_ids"], temperature=batch.meta.temperature,
            entropy="entropy" in outputs,
        )
        if "log_probs" in outputs:
            out["log_probs"] = lp.masked_fill(~rmask, 0.0)
        if ent is not None:
            out["entropy"] = ent.masked_fill(~rmask, 0.0)
    return out


class ExampleTrainingEngine(TrainingEngine):
    """A single-process training engine over :class:`DecoderLM` with torch AdamW.

    Args:
        spec: The engine spec; ``model_path`` is a transformers folder (a token-classification
            folder for the critic role).
    """

    def __init__(self, spec: EngineSpec) -> None:
        options = parse_options(ExampleOptions, spec.options, where="example backend options")
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        if spec.parallel.world_size != 1:
            raise ConfigError(
                f"the example backend runs in one process; got parallel sizes {spec.parallel}"
            )
        if spec.device != "cpu":
            raise ConfigError(f"the example backend runs on cpu only, got device {spec.device!r}")
        # nothing upstream compares a spec with the declared capabilities: refuse what is not declared
        self._caps = CRITIC_CAPABILITIES if spec.role == "critic" else TRAINING_CAPABILITIES
        caps = self.capabilities
        if spec.dtype not in caps.dtypes:
            raise ConfigError(f"the example backend trains in {', '.join(sorted(caps.dtypes))}; "
                              f"got EngineSpec.dtype {spec.dtype!r}")
        if spec.gradient_checkpointing and not caps.gradient_checkpointing:
            raise ConfigError("the example backend does not implement gradient checkpointing; set "
                              "EngineSpec.gradient_checkpointing=False")
        self._spec = spec
        # a critic on a causal-LM folder (PPO's critic on the policy's folder) gets a value head from the seed
        self.model = load_model(spec.model_path, spec.torch_dtype, value_head=spec.role == "critic", seed=spec.seed)
        cfg = self.model.cfg
        self._tokenizer = FolderTokenizer(
            spec.model_path, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
            vocab_size=cfg.vocab_size,
        )
        o = spec.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.step = 0
        self._pending = False  # a forward_backward's gradients wait for optimizer_step
        self._pending_tokens = -1  # the loss tokens of that call's global mini-batch

    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> TrainingCapabilities:
        """Declared capabilities."""
        return self._caps

    @property
    def tokenizer(self) -> FolderTokenizer:
        """The folder's tokenizer."""
        return self._tokenizer

    # ------------------------------------------------------------------ compute
    def _split(self, batch: TensorBatch, max_tokens: int | None = None) -> tuple[list[TensorBatch], object]:
        spec = self._spec
        budget = max_tokens if max_tokens is not None else spec.micro_batch_tokens
        if budget is not None:
            mbs = batch.micro_batches(max_tokens=budget)
        else:
            mbs = batch.micro_batches(size=spec.micro_batch_size or max(batch.batch_size, 1))
        return list(mbs), mbs

    def _check_outputs(self, outputs: Collection[ModelOutput]) -> None:
        unknown = set(outputs) - {"log_probs", "entropy", "values"}
        if unknown:
            raise ConfigError(f"unknown outputs {sorted(unknown)}; valid: log_probs, entropy, values")
        if "values" in outputs and not self.model.cfg.value_head:
            raise ConfigError("values need a critic engine (a folder with a value head)")
        if {"log_probs", "entropy"} & set(outputs) and self.model.cfg.value_head:
            raise ConfigError("a critic engine computes values only, not log_probs or entropy")

    def compute(self, batch: TensorBatch, outputs: Collection[ModelOutput]) -> dict[str, Tensor]:
        """Model outputs of one micro-batch (with autograd when enabled); a hook for subclasses."""
        return token_outputs(self.model, batch, outputs)

    def forward(
        self, batch: TensorBatch, outputs: Collection[ModelOutput] = frozenset({"log_probs"})
    ) -> TensorBatch:
        """Compute ``outputs`` without gradients, micro-batch by micro-batch.

        A batch of 0 rows gets ``[0, width]`` float32 outputs without running the model (the
        rule ``TrainingEngineBase.forward`` keeps for the engines built on it).
        """
        self._check_outputs(outputs)
        batch = validate(batch, where="forward", needs=_NEEDS, vocab_size=self.model.cfg.vocab_size,
                         max_prompt_len=self._spec.max_prompt_len,
                         max_response_len=self._spec.max_response_len, allow_empty=True)
        if batch.batch_size == 0:
            return batch.update({name: torch.zeros(0, batch.response_len, dtype=torch.float32)
                                 for name in outputs})
        parts, mbs = self._split(batch)
        results = []
        with torch.no_grad():
            for mb in parts:
                computed: dict[str, Tensor] = dict(self.compute(mb, outputs))
                results.append(mb.select(*_NEEDS, extras=False).update(computed))
        restored = mbs.restore(results)  # type: ignore[attr-defined]
        width = batch.response_len
        fields: dict[str, Tensor] = {}
        for name in outputs:
            t = restored[name]
            if t.shape[1] < width:  # micro-batches were trimmed: pad back to the input width
                t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
            fields[name] = t
        return batch.update(fields)

    def loss_scale(self, num_micro_batches: int) -> float:
        """Factor applied to each micro-batch's loss before backward (1: the loss is already global)."""
        return 1.0

    def forward_backward(
        self, mini_batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats, *, max_tokens: int | None = None
    ) -> Metrics:
        """The gradients of ``loss_fn`` over micro-batches of ``mini_batch`` (at most ``max_tokens`` each).

        A call that raises leaves no gradients, so the caller can run it again on a smaller budget.
        """
        if self._pending:
            raise ConfigError("forward_backward: the previous call's gradients are not applied yet; "
                              "call optimizer_step() first (one call per optimizer step)")
        needs = loss_fn.needs
        self._check_outputs(needs)
        batch = validate(mini_batch, where="forward_backward", needs=_NEEDS,
                         vocab_size=self.model.cfg.vocab_size,
                         max_prompt_len=self._spec.max_prompt_len,
                         max_response_len=self._spec.max_response_len)
        parts, _ = self._split(batch, max_tokens)
        scale = self.loss_scale(len(parts))
        total = torch.zeros((), dtype=torch.float64)
        sums: dict[str, Tensor] = {}
        self.model.train()
        try:
            for mb in parts:
                filled: dict[str, Tensor] = dict(self.compute(mb, needs))
                out = loss_fn(mb.update(filled), stats)
                loss = out.loss * scale
                loss.backward()  # type: ignore[no-untyped-call]
                total += loss.detach().double()
                for k, v in out.metrics.items():
                    v = v.detach().double()
                    sums[k] = sums[k] + v if k in sums else v
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # a failed call leaves no gradients
            raise
        self._pending = True
        self._pending_tokens = stats.num_tokens
        metrics: Metrics = {k: float(v) for k, v in sums.items()}
        metrics["loss"] = float(total)
        metrics["num_micro_batches"] = float(len(parts))
        return metrics

    def optimizer_step(self) -> StepMetrics:
        """Clip, step AdamW at the scheduled learning rate, zero the gradients; after a mini-batch with no
        loss token, drop the gradients and change nothing else (the step still counts)."""
        self._pending = False
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((p.grad.double().pow(2).sum() for p in params), torch.zeros((), dtype=torch.float64)))  # type: ignore[union-attr]
        grad_norm = float(norm)
        lr = self._spec.optim.lr_at(self.step)
        if self._pending_tokens == 0:  # no loss token: nothing to learn, no decay, no momentum; the step counts
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            return StepMetrics(grad_norm=0.0, lr=lr, skipped=False)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return StepMetrics(grad_norm=grad_norm, lr=lr, skipped=True)
        clip = self._spec.optim.grad_clip
        if clip > 0 and grad_norm > clip:
            for p in params:
                p.grad.mul_(clip / (grad_norm + 1e-6))  # type: ignore[union-attr]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepMetrics(grad_norm=grad_norm, lr=lr, skipped=False)

    # ------------------------------------------------------------------ weights
    def named_weights(self) -> list[tuple[str, Tensor]]:
        """Parameters in transformers naming, fusion groups adjacent, a tied lm_head left out."""
        return [(n, p) for n, p in self.model.named_parameters()]

    def export_weights(
        self, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """Stream the weights: manifest, chunks, commit."""
        named = self.named_weights()
        manifest = WeightManifest(
            version=self.step,
            tensors={n: TensorInfo(tuple(p.shape), dtype or p.dtype) for n, p in named},
            tied_embeddings=self.model.cfg.tied,
        )
        return stream_weights(((n, p.detach()) for n, p in named), manifest,
                              bucket_bytes=bucket_bytes, dtype=dtype)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write model, optimizer, step and RNG state to a temporary folder, then swap it in."""
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
        torch.save({
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "step": self.step, "rng": torch.get_rng_state(),
        }, tmp / "state.pt")
        old = dest.with_name(f".{dest.name}.old")
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        state = torch.load(Path(path) / "state.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = False
        torch.set_rng_state(state["rng"])

    def offload(self) -> None:
        """Nothing to offload on CPU."""

    def onload(self) -> None:
        """Nothing to onload on CPU."""


def build_training_engine(spec: EngineSpec) -> ExampleTrainingEngine:
    """Factory named in the BackendSpec (actor, reference and critic roles)."""
    return ExampleTrainingEngine(spec)
