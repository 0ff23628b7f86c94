"""One matmul for a layer's q/k/v projections and one for its gate/up projections, in the rollout.

A decode step multiplies every layer's input by q, k and v (and later gate and up) separately:
small matrix products that each pay for reading the input and launching a kernel. Where the
weights of such a group lie back to back in the rollout's weight buffer
(:class:`~verl_hf.modeling.FlatParameters`, in export order), the group's weights *are* one
matrix: the first projection's forward multiplies by that matrix (a view, so weight syncs write
it) and hands each other projection its slice of the output, which their forwards return.
transformers' modules, parameter names and state dict are unchanged; only the forwards of the
projection modules are replaced on this instance, and :meth:`FusedProjections.remove` restores them.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["FusedProjections"]

# the projections fused, in the order their weights are exported (see ``export_order``)
_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _lead_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """The first projection of a group: one matmul over the group's weights (a view from its own)."""
    rows: list[int] = self._verl_rows  # type: ignore[assignment]
    weight = torch.as_strided(self.weight, (sum(rows), self.in_features), (self.in_features, 1))
    parts: tuple[Tensor, ...] = torch.split(F.linear(x, weight), rows, dim=-1)
    stash: dict[int, tuple[Tensor, Tensor]] = self._verl_stash  # type: ignore[assignment]
    for i in range(1, len(rows)):
        stash[i] = (x, parts[i])
    return parts[0]


def _follower_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """A later projection of a group: its slice of the lead's product when called on the same input."""
    stash: dict[int, tuple[Tensor, Tensor]] = self._verl_stash  # type: ignore[assignment]
    index: int = self._verl_index  # type: ignore[assignment]
    held = stash.pop(index, None)
    if held is None or held[0] is not x:
        return F.linear(x, self.weight, self.bias)
    return held[1]


@dataclass
class _Group:
    modules: tuple[nn.Linear, ...]

    def adjacent(self) -> bool:
        """Whether the weights still lie back to back, in order, in one storage."""
        first = self.modules[0].weight
        end = first.data_ptr()
        for m in self.modules:
            w = m.weight
            if (w.data_ptr() != end or not w.is_contiguous() or w.dtype != first.dtype
                    or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
                return False
            end += w.numel() * w.element_size()
        return True


class FusedProjections:
    """The fused groups installed on one model (see the module docstring)."""

    def __init__(self, groups: list[_Group]) -> None:
        self._groups = groups

    @classmethod
    def install(cls, model: nn.Module, state: Mapping[str, Tensor]) -> FusedProjections:
        """Fuse every group of ``model`` whose projections are bias-free ``nn.Linear`` modules over
        one input width with weights back to back in memory (``state``: name -> live tensor, to
        find them); other groups keep their own forwards."""
        groups: list[_Group] = []
        for prefix, module in model.named_modules():
            for names in _GROUPS:
                linears = [getattr(module, n, None) for n in names]
                if not all(type(m) is nn.Linear and m.bias is None for m in linears):
                    continue
                mods = tuple(m for m in linears if isinstance(m, nn.Linear))
                if len({m.in_features for m in mods}) != 1 or any(
                        state.get(f"{prefix}.{n}.weight" if prefix else f"{n}.weight") is not m.weight
                        for n, m in zip(names, mods)):
                    continue
                group = _Group(mods)
                if group.adjacent():
                    groups.append(group)
        for group in groups:
            lead, *followers = group.modules
            stash: dict[int, tuple[Tensor, Tensor]] = {}
            lead._verl_rows = [m.out_features for m in group.modules]  # type: ignore[assignment]
            lead._verl_stash = stash  # type: ignore[assignment]
            lead.forward = types.MethodType(_lead_forward, lead)  # type: ignore[method-assign]
            for i, m in enumerate(followers, start=1):
                m._verl_stash, m._verl_index = stash, i  # type: ignore[assignment]
                m.forward = types.MethodType(_follower_forward, m)  # type: ignore[method-assign]
        return cls(groups)

    @property
    def groups(self) -> int:
        """How many groups are fused."""
        return len(self._groups)

    def intact(self) -> bool:
        """Whether every fused group's weights still lie back to back (a moved buffer keeps them so;
        a rebuilt model may not)."""
        return all(g.adjacent() for g in self._groups)

    def remove(self) -> None:
        """Give every projection its own forward back."""
        for group in self._groups:
            for m in group.modules:
                for attr in ("forward", "_verl_rows", "_verl_stash", "_verl_index"):
                    m.__dict__.pop(attr, None)
        self._groups = []
