"""KL estimators, the KL controllers, and the step from scores to per-token rewards.

With ``d = log_probs - ref_log_probs`` (log pi - log pi_ref at the sampled token), the estimators of
KL(pi || pi_ref) (J. Schulman, "Approximating KL divergence", 2020) are, as in verl 0.9.1:

* ``k1`` = ``d``; ``abs`` = ``|d|``; ``k2`` = ``d**2 / 2``;
* ``k3`` = ``exp(-d) + d - 1`` with ``-d`` clamped to [-20, 20] and the result clamped to [-10, 10];
* ``k1+``, ``k3+``, ``abs+`` (straight-through): the value of the named estimator with the
  gradient of ``k2`` (whose expected gradient is the gradient of the KL).

verl's names ``kl``, ``mse``, ``low_var_kl`` are accepted for k1, k2, k3. Gradients w.r.t.
``log_probs`` are attached analytically (see :mod:`verl_core.algorithms._autograd`); the
reference log-probs get none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch
from torch import Tensor

from verl_core.algorithms._autograd import all_within, with_gradient
from verl_core.algorithms.aggregation import mask_weights
from verl_core.algorithms.config import RewardConfig
from verl_core.algorithms.loss_tokens import over_loss_tokens
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import BatchValidationError
from verl_core.kernel.training import Metrics

__all__ = [
    "KL_FUNCTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "compute_token_rewards",
    "kl_abs",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "make_kl_controller",
    "straight_through",
]


def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref (unbiased, high variance, can be negative)."""
    with torch.no_grad():
        d = log_probs.detach() - ref_log_probs
    return with_gradient(log_probs, d, torch.ones_like(d))


def kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """|log pi - log pi_ref|."""
    with torch.no_grad():
        d = log_probs.detach() - ref_log_probs
    return with_gradient(log_probs, d.abs(), d.sign())


def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2 (its gradient is an unbiased KL gradient estimate)."""
    with torch.no_grad():
        d = log_probs.detach() - ref_log_probs
    return with_gradient(log_probs, 0.5 * d.square(), d)


def _k3(log_probs: Tensor, ref_log_probs: Tensor) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        log_r = ref_log_probs - log_probs.detach()
        inside: Tensor | None = None
        if not all_within(log_r, -20.0, 20.0):
            clamped = log_r.clamp(-20.0, 20.0)
            inside, log_r = clamped == log_r, clamped
        r = log_r.exp()
        value = (r - log_r).sub_(1.0)
        if not all_within(value, -10.0, 10.0):
            clamped = value.clamp(-10.0, 10.0)
            inside = (clamped == value) if inside is None else inside & (clamped == value)
            value = clamped
        # d value / d log pi = 1 - r where neither clamp binds
        grad = r.neg_().add_(1.0)
        if inside is not None:
            grad.mul_(inside)
    return value, grad


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k3 = r - log r - 1 with r = pi_ref / pi (unbiased, low variance, >= 0); clamped as verl."""
    value, grad = _k3(log_probs, ref_log_probs)
    return with_gradient(log_probs, value, grad)


def straight_through(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """The estimator with ``fn``'s value and k2's gradient (``log pi - log pi_ref``)."""

    def st(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
        with torch.no_grad():
            value = fn(log_probs.detach(), ref_log_probs)
            d = log_probs.detach() - ref_log_probs
        return with_gradient(log_probs, value, d)

    st.__name__ = f"{getattr(fn, '__name__', 'kl')}_straight_through"
    st.__doc__ = f"Value of {getattr(fn, '__name__', 'the estimator')}, gradient of k2."
    return st


KL_FUNCTIONS: Final[dict[str, Callable[[Tensor, Tensor], Tensor]]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
    "k1+": straight_through(kl_k1),
    "k3+": straight_through(kl_k3),
    "abs+": straight_through(kl_abs),
}
"""The built-in estimators by canonical name."""

_ALIASES: Final = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "low_var_kl+": "k3+", "kl+": "k1+",
                   "k2+": "k2", "mse+": "k2"}


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate by estimator name (built-in, verl alias, or a registered plugin's).

    Raises:
        UnknownNameError: the name is not registered (the message lists the registered ones).
    """
    name = _ALIASES.get(estimator, estimator)
    fn = KL_FUNCTIONS.get(name)
    if fn is None:
        from verl_core.kernel.registry import get_registry

        fn = get_registry().component("kl", estimator).impl
    out: Tensor = fn(log_probs, ref_log_probs)
    return out


# ----------------------------------------------------------------------------- controllers
class KLController:
    """Holds the coefficient beta of the KL penalty in the reward."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update beta after a step whose mean KL was ``current_kl`` over ``n_steps`` samples."""

    def state_dict(self) -> dict[str, float]:
        """The controller's state (for checkpoints)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A constant beta."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)


@dataclass
class AdaptiveKLController(KLController):
    """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon (Ziegler et al. 2019).

    Attributes:
        value: Current beta.
        target: Target KL.
        horizon: Horizon in samples.
    """

    value: float
    target: float
    horizon: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards the value that keeps the KL at the target."""
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


def make_kl_controller(config: RewardConfig) -> KLController:
    """The controller ``config.controller`` describes."""
    if config.controller == "adaptive":
        return AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon)
    return FixedKLController(config.kl_coef)


# ----------------------------------------------------------------------------- rewards
@over_loss_tokens
def compute_token_rewards(
    batch: TensorBatch, config: RewardConfig | None = None, controller: KLController | None = None
) -> tuple[TensorBatch, Metrics]:
    """Turn ``scores`` / ``token_scores`` into ``token_rewards``, minus an optional KL penalty.

    ``token_rewards[b, t] = token_scores[b, t] + scores[b] * [t is the last real token of b]
    - beta * kl(old_log_probs, ref_log_probs)[b, t]``, 0 at masked positions. An empty response has
    no token to hold its score, so its ``token_rewards`` row is 0; the outcome estimators read its
    ``scores`` directly (see :func:`verl_core.algorithms.advantages.outcome_rewards`). In a
    multi-turn batch the tokens are the loss tokens: the score goes on the last sampled token,
    and observation tokens get 0 (their ``token_scores`` are not read; see
    :mod:`verl_core.algorithms.loss_tokens`).

    The penalty needs ``old_log_probs`` and ``ref_log_probs`` and is applied when beta > 0 (beta is
    ``controller.value``, else ``config.kl_coef``). The controller is updated with the batch's KL:
    the mean over non-empty sequences of each sequence's token-mean KL (verl averages over all
    samples, empty ones counting as 0).

    Returns:
        The batch with ``token_rewards``, and metrics ``reward_kl`` (that mean KL, when penalised)
        and ``reward_kl_coef`` (the beta used).
    """
    config = config or RewardConfig()
    batch.require("response_mask", where="compute_token_rewards")
    if "scores" not in batch and "token_scores" not in batch:
        raise BatchValidationError(
            "compute_token_rewards needs 'scores' and/or 'token_scores' (from a RewardEngine); "
            f"the batch has only: {', '.join(batch) or 'none'}"
        )
    mask = batch["response_mask"]
    w = mask_weights(mask, torch.float32)
    lengths = w.sum(-1).long()  # exact (rows are far shorter than 2**24); a bool sum is ~100x slower
    if "token_scores" in batch:
        rewards = batch["token_scores"] * w
    else:
        rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if "scores" in batch and mask.shape[-1] > 0:
        last = (lengths - 1).clamp_min(0).unsqueeze(-1)
        placed = batch["scores"].where(lengths > 0, 0.0).unsqueeze(-1).to(rewards.dtype)
        rewards = rewards.scatter_add(-1, last, placed)
    beta = controller.value if controller is not None else config.kl_coef
    metrics: Metrics = {"reward_kl_coef": float(beta)}
    if beta > 0:
        batch.require("old_log_probs", "ref_log_probs", where="the KL penalty in the reward")
        kld = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], config.kl_estimator)
        kld = kld * w
        rewards = rewards - beta * kld
        nonempty = lengths > 0
        per_seq = kld.sum(-1) / lengths.clamp_min(1)
        current = float(per_seq[nonempty].mean()) if bool(nonempty.any()) else 0.0
        metrics["reward_kl"] = current
        if controller is not None:
            controller.update(current, batch.batch_size)
    return batch.update(token_rewards=rewards.to(torch.float32)), metrics
