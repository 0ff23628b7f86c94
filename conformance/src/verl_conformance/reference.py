"""The float64 transformers reference with gradients: outputs, losses, grads and AdamW steps.

Every sample runs on its own, unpadded (its real prompt and response tokens only, positions
0..n-1), so the reference does not depend on any padding or masking convention: it is the
definition that padded, micro-batched engines must reproduce. (transformers' eager attention
returns NaN for left-padded batches in float64, another reason to avoid padding here.)
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from verl_core import GlobalBatchStats, LossFn, OptimConfig, TensorBatch

__all__ = ["ReferenceModel", "ReferenceStep", "cached_model", "cached_outputs", "greedy_reference", "reference_outputs"]


def _load(path: str, head: str) -> torch.nn.Module:
    import transformers

    auto = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "value": transformers.AutoModelForTokenClassification,
    }[head]
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # a bar per tiny model load only clutters the suite's output
    try:
        model = auto.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager", trust_remote_code=False
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    model.eval()
    return model  # type: ignore[no-any-return]


def _head_of(path: str) -> str:
    import json
    from pathlib import Path

    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    return "value" if any(a.endswith("ForTokenClassification") for a in archs) else "causal_lm"


@dataclass(frozen=True)
class ReferenceStep:
    """What one reference optimizer step computed.

    Attributes:
        loss: The global loss (float64).
        grads: Gradient per transformers parameter name (float64), before clipping.
        grad_norm: Global L2 norm of ``grads``.
        metrics: The loss function's metrics over the whole batch.
    """

    loss: float
    grads: dict[str, Tensor]
    grad_norm: float
    metrics: dict[str, float]


class ReferenceModel:
    """A float64 transformers model of a folder that computes outputs, losses and AdamW steps.

    Args:
        model_path: A test-kit folder (causal LM or value head).
        optim: The optimizer config the engine under test uses (for :meth:`step`).
    """

    def __init__(self, model_path: str | os.PathLike[str], optim: OptimConfig | None = None) -> None:
        self.path = str(model_path)
        self.head = _head_of(self.path)
        self.model = _load(self.path, self.head)
        self.optim = optim or OptimConfig()
        self._opt: torch.optim.Optimizer | None = None
        self.steps = 0

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters in transformers naming (a tied lm_head appears once, as the embedding)."""
        return self.model.named_parameters()

    def outputs(
        self, batch: TensorBatch, outputs: Collection[str] = ("log_probs",), *, grad: bool = False
    ) -> dict[str, Tensor]:
        """Float64 [batch, response] outputs, 0 at masked positions; with autograd when ``grad``.

        ``outputs`` names fields of the schema (``log_probs``, ``entropy``, ``values``) and
        ``max_log_probs``: the largest log-prob of the vocabulary at each position (a greedy token's
        log-prob equals it unless the engine broke a near tie).
        """
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="reference")
        r_width = batch.response_len
        rows: dict[str, list[Tensor]] = {k: [] for k in outputs}
        temp = batch.meta.temperature
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            for b in range(batch.batch_size):
                p_ids = batch["prompt_ids"][b][batch["prompt_mask"][b]].cpu()
                r_mask = batch["response_mask"][b].cpu()
                r_ids = batch["response_ids"][b].cpu()[r_mask]
                n = int(r_ids.numel())
                if n == 0 or p_ids.numel() == 0:
                    for k in outputs:
                        rows[k].append(torch.zeros(r_width, dtype=torch.float64))
                    continue
                # Masked response positions are never attended to, so only real tokens enter.
                pos = r_mask.nonzero().squeeze(1)
                ids = torch.cat([p_ids, r_ids]).unsqueeze(0)
                p = int(p_ids.numel())
                out = self.model(input_ids=ids).logits[0, p - 1 : p + n - 1]
                vals: dict[str, Tensor] = {}
                if self.head == "value":
                    vals["values"] = out[:, 0]
                else:
                    logp = torch.log_softmax(out.double() / temp, -1)
                    vals["log_probs"] = logp.gather(-1, r_ids.unsqueeze(-1)).squeeze(-1)
                    vals["entropy"] = -(logp.exp() * logp).sum(-1)
                    vals["max_log_probs"] = logp.max(-1).values
                for k in outputs:
                    if k not in vals:
                        raise ValueError(f"reference of a {self.head} folder has no output {k!r}")
                    row = torch.zeros(r_width, dtype=torch.float64).index_put((pos,), vals[k])
                    rows[k].append(row)
        return {k: torch.stack(v) if v else torch.zeros(0, r_width, dtype=torch.float64)
                for k, v in rows.items()}

    def next_token_log_probs(self, prompt: Tensor, temperature: float = 1.0) -> Tensor:
        """Float64 log-probs [vocab] of the token after the unpadded ``prompt`` ids, at ``temperature``."""
        with torch.no_grad():
            logits = self.model(input_ids=prompt.cpu().unsqueeze(0)).logits[0, -1]
        return torch.log_softmax(logits.double() / temperature, -1)

    def loss_and_grads(self, batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats) -> ReferenceStep:
        """Global loss of ``loss_fn`` on the whole batch, and its float64 gradients."""
        self.model.zero_grad(set_to_none=True)
        outs = self.outputs(batch, tuple(loss_fn.needs), grad=True)
        # Casting to float32 keeps the autograd graph: the float64 parameters get the gradient.
        filled = batch.update({k: v.float() for k, v in outs.items()})
        result = loss_fn(filled, stats)
        if result.loss.requires_grad:
            result.loss.backward()  # type: ignore[no-untyped-call]
        grads = {
            n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.detach()))
            for n, p in self.model.named_parameters()
        }
        norm = float(torch.sqrt(sum((g.pow(2).sum() for g in grads.values()), torch.zeros((), dtype=torch.float64))))
        return ReferenceStep(
            loss=float(result.loss.detach()),
            grads=grads,
            grad_norm=norm,
            metrics={k: float(v) for k, v in result.metrics.items()},
        )

    def step(self, batch: TensorBatch, loss_fn: LossFn, stats: GlobalBatchStats) -> ReferenceStep:
        """One optimizer step as the OptimConfig describes (AdamW, clipping, schedule)."""
        ref = self.loss_and_grads(batch, loss_fn, stats)
        o = self.optim
        if self._opt is None:
            self._opt = torch.optim.AdamW(
                self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
            )
        if o.grad_clip > 0 and ref.grad_norm > o.grad_clip:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(o.grad_clip / (ref.grad_norm + 1e-6))
        for group in self._opt.param_groups:
            group["lr"] = o.lr_at(self.steps)
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)
        self.steps += 1
        return ref

    def state(self) -> dict[str, Tensor]:
        """Current float64 weights by name."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def reference_outputs(
    model_path: str | os.PathLike[str], batch: TensorBatch, outputs: Collection[str] = ("log_probs",)
) -> dict[str, Tensor]:
    """Float64 outputs of a folder for ``batch`` (see :meth:`ReferenceModel.outputs`)."""
    return ReferenceModel(model_path).outputs(batch, outputs)


def greedy_reference(
    model_path: str | os.PathLike[str], prompt: Tensor, max_new_tokens: int, stop_ids: Collection[int],
    *, margin: float = 1e-4,
) -> tuple[list[int], int]:
    """Greedy continuation of one unpadded ``prompt`` in float64.

    Returns:
        The tokens, and how many of them are decided (the first step whose top-2 logit gap is
        below ``margin`` is a near tie that float32 may break either way; tokens from there on
        are not compared).
    """
    ref = _cached(str(model_path))
    ids = prompt.cpu().clone().unsqueeze(0)
    tokens: list[int] = []
    decided = -1
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = ref.model(input_ids=ids).logits[0, -1]
            top = logits.topk(2).values
            if decided < 0 and float(top[0] - top[1]) < margin:
                decided = len(tokens)
            tok = int(logits.argmax())
            tokens.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
            if tok in stop_ids:
                break
    return tokens, (len(tokens) if decided < 0 else decided)


_CACHE: dict[str, ReferenceModel] = {}


def cached_model(path: str | os.PathLike[str]) -> ReferenceModel:
    """The reference model of a folder, loaded once per process (use it without gradients or steps)."""
    key = str(path)
    if key not in _CACHE:
        _CACHE[key] = ReferenceModel(key)
    return _CACHE[key]


_cached = cached_model


def cached_outputs(
    model_path: str | os.PathLike[str], batch: TensorBatch, outputs: Collection[str] = ("log_probs",)
) -> dict[str, Tensor]:
    """Like :func:`reference_outputs` with the model loaded once per process (no gradients)."""
    return _cached(str(model_path)).outputs(batch, outputs)

