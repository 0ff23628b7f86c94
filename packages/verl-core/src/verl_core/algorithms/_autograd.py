"""Elementwise losses given by their value and analytic gradient (one cheap autograd node).

The policy, value and KL losses are elementwise in the model output ``x`` (log-probs or values).
Computing their value and their derivative ``d loss / d x`` without autograd, then attaching the
derivative to ``x`` with :func:`with_gradient`, gives exactly the loss and gradient of the usual
autograd formulation (up to float rounding; at measure-zero ties between clip branches the
subgradient may differ) at a fraction of the cost: the backward pass is one multiplication
instead of the chain of ``clamp``/``maximum``/``where`` backward kernels. The attached gradient
is constant in ``x`` for the backward pass: second derivatives through these losses are not
supported (no RL loss here needs them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["all_within", "with_gradient"]


class _WithGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor, coef: Tensor) -> Tensor:
        ctx.save_for_backward(coef)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (coef,) = ctx.saved_tensors
        return grad * coef, None, None


def with_gradient(x: Tensor, value: Tensor, coef: Tensor) -> Tensor:
    """``value`` (a function of ``x``) whose gradient w.r.t. ``x`` is ``coef`` elementwise.

    ``value`` and ``coef`` must be computed without autograd and have ``x``'s shape. When ``x`` does
    not require grad, ``value`` is returned as is.
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return value
    out: Tensor = _WithGradient.apply(x, value, coef)  # type: ignore[no-untyped-call]
    return out


def all_within(x: Tensor, lo: float, hi: float) -> bool:
    """True when every element of ``x`` is known to lie in [lo, hi], so a clamp to it is a no-op.

    Checked with one reduction on CPU (skipping the clamp saves a fresh tensor and a comparison);
    on other devices it answers False without looking, to avoid a host synchronisation.
    """
    if x.numel() == 0:
        return True
    if x.device.type != "cpu":
        return False
    mn, mx = torch.aminmax(x)
    return bool(mn >= lo) and bool(mx <= hi)
