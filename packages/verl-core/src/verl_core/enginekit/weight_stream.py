"""Writing and applying weight streams (the contract is :mod:`verl_core.kernel.weights`).

``stream_weights`` buckets named tensors into chunks that never split a fusion group;
``apply_weight_stream`` checks a received stream against the receiver's tensors and copies it;
the finiteness helpers check many tensors with one device synchronisation.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from verl_core.kernel.errors import WeightSyncError
from verl_core.kernel.weights import (
    TensorInfo,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
)

__all__ = [
    "all_finite_flag",
    "apply_weight_stream",
    "contiguous_span",
    "copy_checked",
    "first_non_finite",
    "fusion_group",
    "stream_weights",
    "tensor_norms",
]


_LAYER_PART = re.compile(r"^(.*\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def fusion_group(name: str) -> str:
    """Key of the fusion group a tensor belongs to; tensors with one key travel in one chunk.

    q/k/v projections of a layer share a key, as do gate/up; every other tensor is its own group.
    """
    return _fusion_group(name)


@functools.lru_cache(maxsize=1 << 16)
def _fusion_group(name: str) -> str:
    # Cached: every sync asks again for the same few hundred names.
    m = _LAYER_PART.match(name)
    if m is None:
        return name
    prefix, part, _ = m.groups()
    return prefix + ("qkv" if part in ("q_proj", "k_proj", "v_proj") else "gate_up")


def stream_weights(
    named_tensors: Iterable[tuple[str, Tensor]],
    manifest: WeightManifest,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[WeightMessage]:
    """Yield ``manifest``, then buckets of at most ``bucket_bytes``, then the commit.

    A fusion group (see :func:`fusion_group`) is held back until all of its manifest tensors have
    arrived and then travels in one chunk; a group larger than a bucket travels alone. Tensors are
    cast to ``dtype`` when given; the manifest is sent as it is, so it must already describe them
    as sent (each ``TensorInfo`` of ``dtype`` when given: receivers check it against their own).
    ``named_tensors`` must yield exactly the manifest's names.
    """
    if bucket_bytes < 1:
        raise WeightSyncError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    group_size: dict[str, int] = {}
    for name in manifest.tensors:
        key = fusion_group(name)
        group_size[key] = group_size.get(key, 0) + 1
    yield manifest
    pending: dict[str, list[tuple[str, Tensor]]] = {}
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if name not in manifest.tensors:
            raise WeightSyncError(f"sender produced {name!r}, which its manifest does not list")
        t = tensor.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        key = fusion_group(name)
        group = pending.setdefault(key, [])
        group.append((name, t))
        if len(group) < group_size[key]:
            continue
        del pending[key]
        nbytes = sum(x.numel() * x.element_size() for _, x in group)
        if bucket and size + nbytes > bucket_bytes:
            yield WeightChunk(tuple(bucket))
            bucket, size = [], 0
        bucket.extend(group)
        size += nbytes
    if pending:
        raise WeightSyncError(f"sender ended with incomplete fusion groups: {sorted(pending)[:3]}")
    if bucket:
        yield WeightChunk(tuple(bucket))
    yield WeightCommit(manifest.version)


def _finite_groups(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """Floating tensors grouped by (device, dtype): what one fused reduction can take."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def all_finite_flag(tensors: Iterable[Tensor]) -> Tensor | None:
    """A 0-dim bool tensor, True when every floating tensor's 2-norm is finite; no host sync.

    One fused reduction per (device, dtype). NaN and inf propagate through the norm, so True
    proves every element finite; False means a non-finite element or finite elements whose norm
    overflows (tell them apart with :func:`first_non_finite`). None when no tensor is floating.
    """
    groups = _finite_groups(tensors)
    if not groups:
        return None
    with torch.no_grad():
        # float16 norms are returned in float32 (a float16 norm overflows at 65504); bfloat16 has
        # float32's range, and asking for float32 there would cost a conversion on the CPU.
        flags = [
            torch.stack(torch._foreach_norm(g, 2, dtype=torch.float32 if g[0].dtype == torch.float16 else None))
            .isfinite()
            .all()
            for g in groups
        ]
        if len(flags) == 1:
            return flags[0]
        return torch.stack([f.to(flags[0].device) for f in flags]).all()


def contiguous_span(tensors: list[Tensor]) -> Tensor | None:
    """One 1-D view over the memory of ``tensors`` when they lie back to back, else None (also for no tensors).

    They must be contiguous, of one dtype and device, each starting where the previous one ends,
    and all inside the first one's storage (as the views of one flat buffer are); the span then
    holds exactly their elements, in order. A receiver copies and checks a span with one kernel
    each instead of one per tensor.
    """
    if not tensors:
        return None
    first = tensors[0]
    dtype, device, size = first.dtype, first.device, first.element_size()
    end = first.data_ptr()
    for t in tensors:
        if t.dtype != dtype or t.device != device or not t.is_contiguous() or t.data_ptr() != end:
            return None
        end += t.numel() * size
    storage = first.untyped_storage()
    if end > storage.data_ptr() + storage.nbytes():
        return None
    total = (end - first.data_ptr()) // size
    return first.detach().as_strided((total,), (1,))


@functools.cache
def _fused_copy() -> Callable[[Tensor, Tensor], Tensor] | None:
    """The Triton copy-and-check kernel's entry point, or None where Triton is not installed."""
    try:
        from verl_core.enginekit import _triton_copy
    except ImportError:
        return None
    return _triton_copy.copy_count_non_finite


_FUSED_OFF: list[str] = []  # why the fused kernel was turned off in this process (empty: it is on)


def _fusable(dst: Tensor, src: Tensor) -> bool:
    """Whether the fused kernel takes the pair: one CUDA device, float32, float16 or bfloat16."""
    return src.is_cuda and dst.device == src.device and src.dtype in (torch.float32, torch.float16, torch.bfloat16)


def copy_checked(dst: Tensor, src: Tensor) -> Tensor | None:
    """Copy ``src`` into ``dst`` (1-D, contiguous, same size and dtype); on CUDA, check it in the same pass.

    The result is a 0-dim bool tensor, True when every value is finite, wherever that costs no
    host synchronisation: on CUDA where a fused kernel applies (float32, float16 or bfloat16,
    Triton installed) the values are read once, copied bit for bit and tested for NaN/inf on the
    way; on the CPU (where reading a value waits for nothing) one reduction follows the copy,
    resolved exactly when it is not finite. Elsewhere this is a plain copy and the result is
    None: the caller checks the values itself (:func:`tensor_norms`, :func:`all_finite_flag`).
    """
    if dst.dim() != 1 or src.shape != dst.shape or src.dtype != dst.dtype or not (
            src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"copy_checked needs two contiguous 1-D tensors of one size and dtype, got "
                         f"{tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype}")
    fused = _fused_copy() if _fusable(dst, src) and not _FUSED_OFF else None
    if fused is not None:
        try:
            return fused(dst, src)[0] == 0
        except Exception as e:  # e.g. a Triton that cannot compile for this GPU: two passes instead
            _FUSED_OFF.append(f"{type(e).__name__}: {e}")
            warnings.warn(f"copy_checked: the fused copy-and-check kernel failed ({_FUSED_OFF[-1]}); weights are "
                          "copied and checked in two passes from now on", RuntimeWarning, stacklevel=2)
    with torch.no_grad():
        dst.copy_(src)
        if src.device.type != "cpu":
            return None
        flag = all_finite_flag([src])
        if flag is None:
            return torch.tensor(True)  # integers
        # a norm can overflow with finite values: then look at the values themselves
        return flag if bool(flag) else torch.isfinite(src).all()


def tensor_norms(tensors: list[Tensor]) -> Tensor | None:
    """Every tensor's 2-norm in order, accumulated in float64, on the first floating tensor's device.

    One fused reduction per (device, dtype) and no host synchronisation; non-floating and empty
    tensors count as 0. An entry is finite exactly when its tensor is: NaN and inf propagate, and
    a float64 sum of squares of float32/16 values cannot overflow. None when no tensor is
    floating and non-empty. For checks whose verdict is read after the tensors are gone (deferred
    stream checks); while they are alive, :func:`all_finite_flag` with :func:`first_non_finite`'s
    exact fallback is cheaper on CPUs (no float64 conversion: 20% of a CPU sync into vLLM).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            groups.setdefault((t.device, t.dtype), []).append(i)
    if not groups:
        return None
    with torch.no_grad():
        device = next(iter(groups))[0]
        out: Tensor | None = None
        for (_, dtype), idx in groups.items():
            wide = None if dtype.is_complex else torch.float64
            picked = tensors if len(idx) == len(tensors) else [tensors[i] for i in idx]
            values = torch.stack(torch._foreach_norm(picked, 2, dtype=wide)).double()
            if len(idx) == len(tensors):
                return values
            if out is None:
                out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
            out[torch.tensor(idx, device=device)] = values.to(device)
        return out


def first_non_finite(named: list[tuple[str, Tensor]]) -> str | None:
    """Name of the first tensor holding a NaN or inf, or None when every tensor is finite.

    One fused reduction per (device, dtype) and one host synchronisation for the whole list (see
    :func:`all_finite_flag`); only when that flag is False are the tensors checked one by one,
    which tells a non-finite element from a norm overflow and names the tensor.
    """
    flag = all_finite_flag(t for _, t in named)
    if flag is None or bool(flag):
        return None
    with torch.no_grad():
        for name, t in named:
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                return name
    return None


def apply_weight_stream(
    stream: Iterable[WeightMessage],
    expected: Mapping[str, TensorInfo],
    apply_chunk: Callable[[list[tuple[str, Tensor]]], Tensor | None],
    *,
    optional: frozenset[str] = frozenset(),
    copy: bool = True,
    defer_checks: bool = False,
) -> WeightManifest:
    """Receive a weight stream: check it against the receiver's model, then apply it chunk by chunk.

    The manifest must come first and name exactly the receiver's tensors (those in ``optional``,
    such as a tied lm_head, may be absent) with the same shapes and dtypes; every chunk may only
    hold manifest names, each once, and only finite values; the commit must come last, after every
    name arrived. A chunk is checked whole (names, shapes, dtypes, then one fused finiteness check
    and one host synchronisation per chunk) before ``apply_chunk`` sees any of it. A malformed
    stream raises before ``apply_chunk`` sees a chunk when the manifest is wrong, or part-way
    otherwise, so receivers must treat any raise as "stale until the next complete sync".

    Args:
        stream: The messages: a manifest, chunks, a commit.
        expected: Name -> shape and dtype of every tensor of the receiving model.
        apply_chunk: Called once per chunk with its (name, tensor) pairs. It may return a 0-dim
            bool tensor, True when every value it copied is finite (a receiver that checks while
            it copies, :func:`copy_checked`): with ``defer_checks`` that flag is the chunk's check.
        optional: Names the stream may leave out (a tied lm_head).
        copy: With True (the default) ``apply_chunk`` gets copies it may keep. With False it gets
            the chunk's own tensors, valid only during the call (the sender may reuse their
            memory for the next chunk): a receiver that copies into its parameters there (one
            copy of each byte) passes False.
        defer_checks: With True, each chunk's finiteness check is queued (no host
            synchronisation) and ``apply_chunk`` runs at once; all checks are read with one
            synchronisation when the commit arrives, which raises naming the first non-finite
            tensor. Non-finite values may then reach the receiver's (stale) weights before the
            raise: only a receiver that serves nothing until this function returns may pass True.

    Returns:
        The manifest of the applied stream.

    Raises:
        WeightSyncError: naming the first mismatch (missing, unexpected, mis-shaped, non-finite or
            repeated tensors, wrong message order, version mismatch).
    """
    it = iter(stream)
    first = next(it, None)
    if not isinstance(first, WeightManifest):
        raise WeightSyncError(
            f"weight stream must start with a WeightManifest, got {type(first).__name__}"
        )
    manifest = first
    names = set(manifest.tensors)
    unexpected = sorted(names - set(expected))
    missing = sorted(set(expected) - names - optional)
    if unexpected or missing:
        raise WeightSyncError(
            "weight manifest does not match the receiving model: "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}, "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
    for name, info in manifest.tensors.items():
        want = expected[name]
        if tuple(info.shape) != tuple(want.shape) or info.dtype != want.dtype:
            raise WeightSyncError(
                f"weight {name!r}: manifest says {tuple(info.shape)} {info.dtype}, "
                f"the receiving model has {tuple(want.shape)} {want.dtype}"
            )
    seen: set[str] = set()
    # (finite flags, names per flag) of the chunks applied unchecked
    deferred: list[tuple[Tensor, list[list[str]]]] = []
    for msg in it:
        if isinstance(msg, WeightCommit):
            if msg.version != manifest.version:
                raise WeightSyncError(
                    f"weight commit version {msg.version} != manifest version {manifest.version}"
                )
            left = sorted(names - seen)
            if left:
                raise WeightSyncError(
                    f"weight stream committed with {len(left)} tensor(s) never sent, e.g. {left[:3]}"
                )
            if next(it, None) is not None:
                raise WeightSyncError("weight stream has messages after the commit")
            _raise_non_finite(deferred)
            return manifest
        if not isinstance(msg, WeightChunk):
            raise WeightSyncError(f"unexpected message {type(msg).__name__} in a weight stream")
        batch: list[tuple[str, Tensor]] = []
        in_chunk: set[str] = set()
        for name, t in msg.tensors:
            if name not in manifest.tensors:
                raise WeightSyncError(f"weight chunk holds {name!r}, which the manifest does not list")
            info = manifest.tensors[name]
            if name in seen or name in in_chunk:
                raise WeightSyncError(f"weight {name!r} was sent twice")
            if tuple(t.shape) != tuple(info.shape) or t.dtype != info.dtype:
                raise WeightSyncError(
                    f"weight {name!r}: chunk tensor is {tuple(t.shape)} {t.dtype}, manifest says "
                    f"{tuple(info.shape)} {info.dtype}"
                )
            in_chunk.add(name)
            batch.append((name, t.detach() if t.requires_grad else t))
        if not defer_checks:
            bad = first_non_finite(batch)
            if bad is not None:
                raise WeightSyncError(f"weight {bad!r} holds NaN/inf; refusing to load it")
        seen |= in_chunk
        chunk_names = [name for name, _ in batch]
        tensors = [t for _, t in batch]
        flag = apply_chunk([(name, t.clone()) for name, t in batch] if copy else batch)
        if defer_checks:
            # Queued after the chunk is applied (the chunk's tensors stay valid until the next
            # message is asked for). A receiver's own check covers the chunk; otherwise a chunk
            # lying back to back in memory is checked with one reduction (a failure then names
            # the chunk), any other tensor by tensor.
            if isinstance(flag, Tensor):
                deferred.append((flag.reshape(1), [chunk_names]))
                continue
            span = contiguous_span(tensors)
            norms = tensor_norms(tensors if span is None else [span])
            if norms is not None:
                groups = [chunk_names] if span is not None else [[n] for n in chunk_names]
                deferred.append((norms.isfinite(), groups))
    raise WeightSyncError("weight stream ended without a WeightCommit (incomplete sync)")


def _raise_non_finite(deferred: list[tuple[Tensor, list[list[str]]]]) -> None:
    """Read the queued flags of :func:`apply_weight_stream` (one synchronisation); raise on NaN/inf."""
    if not deferred:
        return
    device = deferred[0][0].device
    finite = torch.cat([flags.to(device) for flags, _ in deferred])
    if bool(finite.all()):
        return
    groups = [group for _, chunk in deferred for group in chunk]
    bad = groups[int((~finite).nonzero()[0, 0])]
    if len(bad) == 1:
        raise WeightSyncError(f"weight {bad[0]!r} holds NaN/inf; the update is refused")
    shown = ", ".join(repr(n) for n in bad[:4]) + (", ..." if len(bad) > 4 else "")
    raise WeightSyncError(
        f"a weight among {shown} ({len(bad)} tensors sent back to back) holds NaN/inf; the update is refused"
    )
