"""Tolerance tiers per dtype and quantity, declared once and used by every check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

__all__ = ["TOLERANCES", "Tolerance", "assert_close", "near_tie_margin", "tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise, and for gradients the
    relative L2 error ``||actual - expected|| / ||expected|| <= rel_l2``."""

    atol: float
    rtol: float
    rel_l2: float


TOLERANCES: Final[dict[str, dict[str, Tolerance]]] = {
    # float32 engines against the float64 reference on tiny models (seen: ~1e-6 on log-probs).
    "float32": {
        "log_probs": Tolerance(atol=5e-5, rtol=1e-5, rel_l2=1e-5),
        "entropy": Tolerance(atol=5e-5, rtol=1e-5, rel_l2=1e-5),
        "values": Tolerance(atol=5e-5, rtol=1e-5, rel_l2=1e-5),
        "scores": Tolerance(atol=5e-5, rtol=1e-5, rel_l2=1e-5),
        "loss": Tolerance(atol=5e-5, rtol=1e-4, rel_l2=1e-4),
        "grad": Tolerance(atol=1e-5, rtol=1e-3, rel_l2=1e-3),
        "weights": Tolerance(atol=1e-6, rtol=1e-5, rel_l2=1e-5),
    },
    # bfloat16 has 8 mantissa bits: logits carry ~1e-2 relative error.
    "bfloat16": {
        "log_probs": Tolerance(atol=1e-1, rtol=5e-2, rel_l2=5e-2),
        "entropy": Tolerance(atol=1e-1, rtol=5e-2, rel_l2=5e-2),
        "values": Tolerance(atol=5e-2, rtol=5e-2, rel_l2=5e-2),
        # A reward model's score is one value read after the whole network: the hf engine's bfloat16
        # scores of 256 random samples per perturbed reward folder were off the float64 reference by
        # up to 0.116 (Qwen2; 99th percentile 0.104), and 7, 1 and 5 of 256 (Qwen2, Qwen3, Llama)
        # fell outside the values tier, so a faithful engine failed a 6-sample check by rounding luck.
        "scores": Tolerance(atol=1.5e-1, rtol=5e-2, rel_l2=5e-2),
        "loss": Tolerance(atol=5e-2, rtol=5e-2, rel_l2=5e-2),
        "grad": Tolerance(atol=1e-2, rtol=1e-1, rel_l2=1e-1),
        "weights": Tolerance(atol=1e-2, rtol=1e-2, rel_l2=1e-2),
    },
    "float16": {
        "log_probs": Tolerance(atol=2e-2, rtol=1e-2, rel_l2=1e-2),
        "entropy": Tolerance(atol=2e-2, rtol=1e-2, rel_l2=1e-2),
        "values": Tolerance(atol=1e-2, rtol=1e-2, rel_l2=1e-2),
        "scores": Tolerance(atol=3e-2, rtol=1e-2, rel_l2=1e-2),
        "loss": Tolerance(atol=1e-2, rtol=1e-2, rel_l2=1e-2),
        "grad": Tolerance(atol=5e-3, rtol=5e-2, rel_l2=5e-2),
        "weights": Tolerance(atol=5e-3, rtol=5e-3, rel_l2=5e-3),
    },
}


def tolerance(dtype: str | torch.dtype, quantity: str) -> Tolerance:
    """The tier for ``quantity`` (log_probs, entropy, values, scores, loss, grad, weights) in ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    try:
        return TOLERANCES[name][quantity]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {name!r} / quantity {quantity!r}; tiers: "
                       f"{ {k: sorted(v) for k, v in TOLERANCES.items()} }") from None


def near_tie_margin(dtype: str | torch.dtype) -> float:
    """The log-prob gap under which two tokens are a near tie that an engine in ``dtype`` may break either way.

    Twice the dtype's log-prob ``atol`` (each of the two log-probs may be off by it), at least 1e-4:
    bfloat16 logits carry ~1e-2 error and tie exactly where they round to one value, float32
    ~1e-6. A token whose float64 reference log-prob is within this margin of the most likely
    token's is a most likely token for the checks that compare chosen tokens with the reference.
    """
    return max(1e-4, 2 * tolerance(dtype, "log_probs").atol)


def assert_close(
    actual: Tensor, expected: Tensor, *, dtype: str | torch.dtype, quantity: str, what: str = ""
) -> None:
    """Raise AssertionError naming the worst element when ``actual`` is outside the tier.

    Gradients (``quantity="grad"``) are compared by relative L2 error; everything else elementwise.
    """
    tol = tolerance(dtype, quantity)
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    label = what or quantity
    if a.shape != e.shape:
        raise AssertionError(f"{label}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    if not bool(torch.isfinite(a).all()):
        raise AssertionError(f"{label}: non-finite values in the result")
    if not bool(torch.isfinite(e).all()):
        raise AssertionError(f"{label}: non-finite values in the expected tensor (a broken reference)")
    if quantity == "grad":
        denom = float(e.norm())
        err = float((a - e).norm()) / max(denom, 1e-30)
        if err > tol.rel_l2 and float((a - e).abs().max()) > tol.atol:
            raise AssertionError(f"{label}: relative L2 error {err:.3g} > {tol.rel_l2:g} ({dtype} tier)")
        return
    diff = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    bad = diff > bound
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.unravel_index((diff - bound).flatten().argmax(), diff.shape))
        raise AssertionError(
            f"{label}: {int(bad.sum())} of {bad.numel()} elements outside the {dtype} tier "
            f"(atol={tol.atol:g}, rtol={tol.rtol:g}); worst at {idx}: got {float(a[idx]):.8g}, "
            f"expected {float(e[idx]):.8g} (|diff| {float(diff[idx]):.3g})"
        )
