"""Advantage estimation over the loss tokens of a multi-turn batch.

A multi-turn response holds observation and tool tokens (``loss_mask`` False) between the model's
turns. The estimators are written for the canonical right-padded response; on a multi-turn batch
they run on its *compacted* form: each row's loss tokens moved, in order, to the front of the row
(a right-padded response of only the sampled tokens), every other per-token position filled with
its padding value. The results (``advantages``, ``returns``, ``token_rewards``) are moved back to
the original positions and are 0 at observation tokens. So observation tokens are skipped, as if
the environment's reply took no time step:

* the score is placed on the last sampled token; per-token scores, values and log-probs at
  observation tokens are not read;
* GAE: ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next`` where
  "next" is the next sampled token (verl's multi-turn GAE, which carries the value and the advantage
  across observation tokens); returns and whitening are over the sampled tokens;
* REINFORCE++ and ReMax discount and sum over the sampled tokens only;
* the outcome estimators (GRPO, RLOO, REINFORCE++ with baseline) broadcast each sample's
  advantage over its sampled tokens (whitening weights each sample by its count of sampled tokens).

A batch without ``loss_mask``, or whose ``loss_mask`` equals ``response_mask``, is single-turn and
runs the estimators unchanged (bit for bit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch
from torch import Tensor

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.schema import FIELDS

__all__ = ["LossTokenLayout", "over_loss_tokens"]

_P = ParamSpec("_P")
_R = TypeVar("_R", TensorBatch, tuple[TensorBatch, dict[str, float]])

_TOKEN = ("batch", "response")


@dataclass(frozen=True)
class LossTokenLayout:
    """Where each row's loss tokens go in the compacted response, and back.

    Attributes:
        order: ``[batch, response]`` int64; compacted column ``j`` of row ``b`` holds the original
            column ``order[b, j]`` (the loss tokens first, in order, then the rest).
        mask: ``[batch, response]`` bool, the loss mask in the compacted layout (right-padded).
    """

    order: Tensor
    mask: Tensor

    @staticmethod
    def of(batch: TensorBatch) -> LossTokenLayout | None:
        """The layout of a multi-turn batch; None when it is single-turn (no ``loss_mask``, or one
        equal to ``response_mask``), where the estimators run on the batch as it is."""
        if "loss_mask" not in batch or torch.equal(batch["loss_mask"], batch["response_mask"]):
            return None
        loss = batch["loss_mask"]
        order = torch.argsort((~loss).view(torch.uint8), dim=-1, stable=True)
        return LossTokenLayout(order, loss.gather(-1, order))

    def compact(self, batch: TensorBatch) -> TensorBatch:
        """``batch`` with every per-token field compacted: ``response_mask`` becomes the compacted
        loss mask, ``loss_mask`` is dropped and the positions after each row's loss tokens hold the
        field's padding value (the pad id, False, or 0)."""
        out: dict[str, Tensor] = {}
        for name, t in batch.items():
            spec = FIELDS[name]
            if spec.dims != _TOKEN or name in ("loss_mask", "response_mask"):
                continue
            fill = batch.meta.pad_token_id if spec.pad_value is None else spec.pad_value
            out[name] = torch.where(self.mask, t.gather(-1, self.order), fill)
        return batch.drop("loss_mask").update(out, response_mask=self.mask)

    def expand(self, compacted: Tensor) -> Tensor:
        """A per-token tensor of the compacted layout moved back to the original positions; every
        other position (observation tokens, padding) holds 0 (False for a mask)."""
        return torch.zeros_like(compacted).scatter_(-1, self.order, compacted.masked_fill(~self.mask, 0))

    def restore(self, batch: TensorBatch, compacted: TensorBatch, result: TensorBatch) -> TensorBatch:
        """``batch`` with what the estimator added to ``compacted`` (its new or replaced fields and
        extras, its meta), per-token fields moved back to the original positions."""
        changed = {
            name: self.expand(t) if FIELDS[name].dims == _TOKEN else t
            for name, t in result.items()
            if name != "response_mask" and (name not in compacted or t is not compacted[name])
        }
        return batch.update(changed, extras=result.extras, meta=result.meta)


def over_loss_tokens(
    fn: Callable[Concatenate[TensorBatch, _P], _R],
) -> Callable[Concatenate[TensorBatch, _P], _R]:
    """``fn`` (an estimator or reward step taking the batch first) run over the loss tokens.

    A single-turn batch goes to ``fn`` as it is; a multi-turn one is compacted
    (:class:`LossTokenLayout`), and ``fn``'s result is moved back. ``fn`` returns a batch, or a
    batch and metrics.
    """

    def run(batch: TensorBatch, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        layout = LossTokenLayout.of(batch)
        if layout is None:
            return fn(batch, *args, **kwargs)
        compacted = layout.compact(batch)
        result: Any = fn(compacted, *args, **kwargs)
        if isinstance(result, TensorBatch):
            out: Any = layout.restore(batch, compacted, result)
        else:
            out = (layout.restore(batch, compacted, result[0]), result[1])
        return cast(_R, out)

    functools.update_wrapper(run, fn)
    return run
