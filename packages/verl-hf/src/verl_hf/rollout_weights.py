"""How the hf rollout engine's weights are written: a weight stream, the direct same-process
copies (tensor by tensor or one buffer), and the weight buffer's moves for sleep and wake.

Every function here only copies and checks; the engine keeps its version and stale flag, and is
stale from before the first byte is written until one of these returns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from verl_core.enginekit.weight_stream import (
    all_finite_flag,
    apply_weight_stream,
    contiguous_span,
    copy_checked,
    first_non_finite,
)
from verl_core.kernel.errors import WeightSyncError
from verl_core.kernel.weights import TensorInfo, WeightMessage
from verl_hf.modeling import FlatParameters, export_order

__all__ = [
    "apply_stream",
    "copy_flat",
    "copy_state",
    "flat_to_device",
    "flat_to_host",
    "live_targets",
    "same_flat_layout",
]


def live_targets(model: Any, tied: bool) -> dict[str, Tensor]:
    """Name -> the live tensor a sync writes (parameters and persistent buffers), in export order;
    a tied lm_head is left out (it is the embedding)."""
    state = model.state_dict(keep_vars=True)
    names = export_order([n for n in state if not (tied and n == "lm_head.weight")])
    return {name: state[name] for name in names}


def apply_stream(stream: Iterable[WeightMessage], targets: dict[str, Tensor], expected: Mapping[str, TensorInfo],
                 flat: FlatParameters | None, *, tied: bool) -> int:
    """Apply a weight stream into ``targets`` (through ``flat`` where a chunk matches its layout).

    Each chunk's names, shapes and dtypes are checked, then it is copied straight into the live
    parameters with one multi-tensor copy (every byte is copied once); the finiteness of every
    chunk is read once, at the commit.

    Returns:
        The version the stream carried.

    Raises:
        WeightSyncError: see :func:`~verl_core.enginekit.weight_stream.apply_weight_stream`.
    """

    def apply(chunk: list[tuple[str, Tensor]]) -> Tensor | None:
        tensors = [t for _, t in chunk]
        with torch.no_grad():
            # A chunk sent back to back (a sender's flat buffer) into a part of this engine's
            # buffer laid out alike: one copy, checked on the way where the device can.
            # Otherwise one multi-tensor copy, checked by the stream.
            src = contiguous_span(tensors) if flat is not None else None
            dst = flat.span([name for name, _ in chunk]) if flat is not None and src is not None else None
            if src is not None and dst is not None and dst.numel() == src.numel():
                return copy_checked(dst, src)
            torch._foreach_copy_([targets[name] for name, _ in chunk], tensors)
            return None

    optional = frozenset({"lm_head.weight"}) if tied else frozenset()
    # The engine is stale until this returns, so the finiteness checks may wait for the commit:
    # one host synchronisation per sync instead of one per chunk.
    manifest = apply_weight_stream(stream, expected, apply, optional=optional, copy=False, defer_checks=True)
    return manifest.version


def copy_state(state: Mapping[str, Tensor], targets: dict[str, Tensor], expected: Mapping[str, TensorInfo],
               *, tied: bool) -> int:
    """Copy same-device, same-dtype tensors by name into ``targets`` (the direct path).

    The same checks as a stream, in one go: every name and shape first (nothing is copied on a
    mismatch), then one multi-tensor copy and one fused finiteness check with a single host
    synchronisation at the end.

    Returns:
        Bytes copied.

    Raises:
        WeightSyncError: a tensor is missing, mis-shaped, of another dtype or not finite.
    """
    src: list[Tensor] = []
    for name, info in expected.items():
        t = state.get(name)
        if t is None or tuple(t.shape) != info.shape or t.dtype != info.dtype:
            got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise WeightSyncError(
                f"direct weight sync: {name!r} is {got} in the actor, the rollout model has "
                f"{info.shape} {info.dtype}; the two engines must load the same architecture and dtype"
            )
        src.append(t.detach())
    extra = sorted(set(state) - set(targets) - ({"lm_head.weight"} if tied else set()))
    if extra:
        raise WeightSyncError(
            f"direct weight sync: the actor has tensors the rollout model lacks, e.g. {extra[:3]}; "
            "the two engines must load the same architecture"
        )
    with torch.no_grad():
        # Check and copy are queued back to back; the one host sync comes last. A non-finite
        # tensor then raises with the engine stale (its weights are not served).
        finite = all_finite_flag(src)
        torch._foreach_copy_(list(targets.values()), src)
        if finite is not None and not bool(finite):
            bad = first_non_finite(list(zip(targets, src)))
            if bad is not None:
                raise WeightSyncError(f"weight {bad!r} holds NaN/inf; refusing to serve it")
    return sum(t.numel() * t.element_size() for t in src)


def same_flat_layout(source: FlatParameters | None, flat: FlatParameters | None) -> bool:
    """Whether both weight buffers exist, share one layout and live on one device (one copy moves them)."""
    return (source is not None and flat is not None and flat.same_layout(source)
            and source.buffer.device == flat.buffer.device)


def copy_flat(source: FlatParameters, flat: FlatParameters, source_state: Mapping[str, Tensor],
              targets: Mapping[str, Tensor]) -> int | None:
    """Copy ``source``'s buffer into ``flat`` with one device copy (see :func:`same_flat_layout`).

    The copy and its finiteness check (one fused pass on CUDA, else a reduction over the source
    buffer) are queued first; the host then checks that every tensor of both sides is still the
    view its layout placed, while the device copies.

    Returns:
        Bytes copied, or None when a tensor left its buffer (the caller then rewrites every weight).

    Raises:
        WeightSyncError: a tensor holds NaN/inf.
    """
    with torch.no_grad():
        finite = copy_checked(flat.buffer, source.buffer)
        if finite is None:
            finite = torch.linalg.vector_norm(source.buffer).isfinite()
    if not (source.intact(source_state) and flat.intact(targets)):
        return None
    if not bool(finite):
        bad = first_non_finite([(name, source_state[name]) for name in source.names])
        if bad is not None:
            raise WeightSyncError(f"weight {bad!r} holds NaN/inf; refusing to serve it")
    return sum(math.prod(shape) for shape in source.shapes) * source.buffer.element_size()


def flat_to_host(flat: FlatParameters | None, targets: Mapping[str, Tensor],
                 host: Tensor | None, *, copy: bool = True) -> tuple[FlatParameters | None, Tensor | None]:
    """Move the weight buffer in one copy into pinned host memory (``host``, reused when it fits).

    With ``copy=False`` the values are dropped instead: the tensors become views of ``host``
    holding whatever it holds (a sleep whose wake is followed by a complete weight sync).

    Returns:
        The moved buffer's layout (None when the weights no longer lie in it) and the host buffer.
    """
    if flat is None or not flat.intact(targets):
        return None, host
    if host is None or host.numel() != flat.buffer.numel() or host.dtype != flat.buffer.dtype:
        host = torch.empty_like(flat.buffer, device="cpu", pin_memory=True)
    return flat.moved(targets, host, copy=copy), host


def flat_to_device(flat: FlatParameters | None, targets: Mapping[str, Tensor],
                   device: torch.device, *, copy: bool = True) -> FlatParameters | None:
    """Move the weight buffer in one copy to ``device`` (None when the weights no longer lie in it);
    with ``copy=False`` only the layout moves (the values are left to a complete weight sync)."""
    if flat is None or not flat.intact(targets):
        return None
    return flat.moved(targets, torch.empty_like(flat.buffer, device=device), copy=copy)
