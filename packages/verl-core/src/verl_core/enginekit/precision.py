"""Mixed precision for training engines: float32 master copies of low-precision parameters.

A model kept in bfloat16 and stepped by an optimizer over those same bfloat16 tensors loses every
update smaller than half the spacing of bfloat16 around the weight: with a learning rate of
1e-6 and Adam's normalised steps, almost every weight stays where it started (a norm weight of 1.0
needs a step of 2**-8 to move at all). :class:`MasterWeights` keeps a float32 copy of each
parameter for the optimizer to update, and rounds it back into the model after each step, so small
updates accumulate and the model still computes with the low-precision weights the rollout engine
receives (training and rollout forward passes see identical weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["MasterWeights"]


class MasterWeights:
    """Float32 master copies of a model's trainable low-precision parameters.

    Build the optimizer over :attr:`masters`; around each optimizer step call :meth:`load_grads`
    (moves the model's gradients onto the masters, as float32) and, after the step,
    :meth:`store` (rounds the masters into the model's parameters).

    Args:
        params: The model's trainable parameters, in a fixed order (the order of the state).
        dtype: The masters' dtype (float32).
    """

    def __init__(self, params: Iterable[Tensor], dtype: torch.dtype = torch.float32) -> None:
        self.params: list[Tensor] = list(params)
        self.masters: list[torch.nn.Parameter] = [
            torch.nn.Parameter(p.detach().to(dtype).clone(), requires_grad=True) for p in self.params
        ]

    def load_grads(self) -> None:
        """Move each parameter's gradient onto its master (as the master's dtype); clear the model's."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().to(m.dtype)
            p.grad = None

    @torch.no_grad()
    def store(self) -> None:
        """Round the masters into the model's parameters (round to nearest)."""
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)

    @torch.no_grad()
    def reload(self) -> None:
        """Reset the masters from the model's parameters (after weights were loaded into the model)."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.copy_(p)

    def state(self) -> list[Tensor]:
        """The masters as CPU tensors, for a checkpoint."""
        return [m.detach().cpu().clone() for m in self.masters]

    @torch.no_grad()
    def load_state(self, state: Sequence[Tensor]) -> None:
        """Restore what :meth:`state` returned and round it into the model.

        Raises:
            ValueError: ``state`` does not match the parameters in number or shapes.
        """
        if len(state) != len(self.masters):
            raise ValueError(
                f"master weights: the state holds {len(state)} tensors, the model {len(self.masters)} "
                "trainable parameters; load a checkpoint of the same model"
            )
        for i, (m, s) in enumerate(zip(self.masters, state, strict=True)):
            if tuple(s.shape) != tuple(m.shape):
                raise ValueError(
                    f"master weights: tensor {i} has shape {tuple(s.shape)}, the parameter "
                    f"{tuple(m.shape)}; load a checkpoint of the same model"
                )
            m.copy_(s.to(m.device))
        self.store()

    def to(self, device: torch.device) -> None:
        """Move the masters (and any gradients they hold) to ``device``."""
        for m in self.masters:
            m.data = m.data.to(device)
            if m.grad is not None:
                m.grad = m.grad.to(device)
