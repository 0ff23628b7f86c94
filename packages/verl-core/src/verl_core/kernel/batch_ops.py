"""The validation and the ops of :class:`~verl_core.kernel.batch.TensorBatch`, which binds them as its methods."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import Tensor

from verl_core.kernel.errors import (
    BatchValidationError,
    NonFiniteError,
    check_bool,
    check_int,
    describe,
)
from verl_core.kernel.memory import _short, check_fits
from verl_core.kernel.schema import FIELDS, Dim, FieldSpec

if TYPE_CHECKING:
    from verl_core.kernel.batch import MicroBatches, TensorBatch

_PIECE_BYTES: Final = 1024
"""What one TensorBatch object costs besides its tensors (the Python objects), for estimates."""


_SAMPLING_KEYS: Final = ("temperature", "top_p", "top_k", "pad_token_id")


def _describe(spec: FieldSpec) -> str:
    return f"[{', '.join(spec.dims)}] {spec.dtype}"


def _validate_field(
    name: str, value: object, sizes: dict[Dim, tuple[int, str]], device: list[torch.device]
) -> Tensor:
    if not isinstance(name, str):
        raise BatchValidationError(f"field names must be strings, got {describe(name)}")
    spec = FIELDS.get(name)
    if spec is None:
        known = ", ".join(sorted(FIELDS))
        raise BatchValidationError(
            f"unknown field {name!r}; known fields: {known}. "
            "Register a custom field with verl_core.register_field(FieldSpec(...))."
        )
    if not isinstance(value, Tensor):
        raise BatchValidationError(
            f"field {name!r}: expected a torch.Tensor {_describe(spec)}, got {type(value).__name__}"
        )
    if value.dim() != len(spec.dims):
        raise BatchValidationError(
            f"field {name!r}: expected rank {len(spec.dims)} {_describe(spec)}, "
            f"got shape {tuple(value.shape)}"
        )
    if value.dtype != spec.dtype:
        raise BatchValidationError(f"field {name!r}: expected dtype {spec.dtype} {_describe(spec)}, got {value.dtype}")
    if not device:
        device.append(value.device)
    elif value.device != device[0]:
        raise BatchValidationError(f"field {name!r}: on device {value.device}, but other fields are on {device[0]}")
    for dim, size in zip(spec.dims, value.shape, strict=True):
        seen = sizes.get(dim)
        if seen is None:
            sizes[dim] = (size, name)
        elif seen[0] != size:
            raise BatchValidationError(
                f"field {name!r}: dim {dim!r} has size {size}, but field {seen[1]!r} has {seen[0]}"
            )
    return value


def _validate_extras(extras: Mapping[str, Sequence[Any]], size: int | None) -> dict[str, tuple[Any, ...]]:
    _check_mapping(extras, "extras", "keys to one value per sample")
    out: dict[str, tuple[Any, ...]] = {}
    for key, values in extras.items():
        if not isinstance(key, str):
            raise BatchValidationError(f"extras keys must be strings, got {describe(key)}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise BatchValidationError(
                f"extra {key!r}: expected a sequence of one value per sample, got {type(values).__name__}"
            )
        if size is not None and len(values) != size:
            raise BatchValidationError(f"extra {key!r}: expected {size} values (one per sample), got {len(values)}")
        size = len(values)
        out[key] = tuple(values)
    return out


def _is_list(value: object) -> bool:
    """A sequence of items, not a string (whose characters would pass for items)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _check_mapping(value: object, name: str, what: str) -> None:
    if not isinstance(value, Mapping):
        raise BatchValidationError(f"{name} must be a mapping from {what}, got {describe(value)}")


def _check_names(names: Sequence[object], name: str) -> None:
    for n in names:
        if not isinstance(n, str):
            raise BatchValidationError(f"{name} must be strings, got {describe(n)}")


def _out_of_range(lo: int, hi: int, size: int) -> BatchValidationError:
    return BatchValidationError(
        f"index() got indices in [{_short(lo)}, {_short(hi)}] for a batch of {size}; "
        f"expected indices in [-{size}, {size})"
    )


def _index_tensor(indices: object, size: int) -> Tensor:
    """``indices`` as an int64 tensor; bools, floats and anything not a list of integers are refused."""
    if isinstance(indices, (list, tuple)):
        for i in indices:
            check_int(i, "index() indices", error=BatchValidationError)
        if indices and (min(indices) < -size or max(indices) >= size):  # before torch, which overflows past int64
            raise _out_of_range(min(indices), max(indices), size)
        return torch.tensor(list(indices), dtype=torch.int64)
    if isinstance(indices, (str, bytes, Mapping)):
        raise BatchValidationError(f"index() takes integer indices, got {describe(indices)}")
    try:
        t = indices if isinstance(indices, Tensor) else torch.as_tensor(indices)
    except Exception:  # whatever torch cannot read as an array
        raise BatchValidationError(f"index() takes integer indices, got {describe(indices)}") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise BatchValidationError(
            f"index() takes integer indices, got a tensor of dtype {t.dtype} (a bool mask or floats are not "
            "indices; use mask.nonzero().squeeze(1) for a mask)"
        )
    return t.to(torch.int64)


def _pad_cols(t: Tensor, width: int, *, left: bool, value: float | bool) -> Tensor:
    missing = width - t.shape[1]
    if missing == 0:
        return t
    pad = torch.full((t.shape[0], missing), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t] if left else [t, pad], 1)


def _check_padding_side(mask: Tensor | None, name: str, *, left: bool, where: str) -> None:
    if mask is None or mask.numel() == 0:
        return
    m = mask.to(torch.int8)
    step = m[:, 1:] - m[:, :-1]
    # left padding: False* True*  -> never 1 -> 0;  right padding: True* False* -> never 0 -> 1
    bad = (step < 0) if left else (step > 0)
    if bool(bad.any()):
        row = int(bad.any(1).nonzero()[0])
        side = "left" if left else "right"
        raise BatchValidationError(
            f"{where}: {name} of sample {row} is not {side}-padded (expected padding only on the "
            f"{side} and real tokens contiguous)"
        )


def micro_batch_cost(lengths: Sequence[int], *, packed: bool = False) -> int:
    """Tokens a micro-batch of these sample ``lengths`` costs: size x longest, or with ``packed`` (an
    engine without padding, ``TrainingCapabilities.packed_sequences``) the sum; an empty sample counts 1."""
    return sum(max(n, 1) for n in lengths) if packed else len(lengths) * max(max(lengths, default=0), 1)


def partition_by_token_budget(lengths: Sequence[int], max_tokens: int, *, packed: bool = False) -> list[list[int]]:
    """Partition sample indices into groups whose cost (:func:`micro_batch_cost`) stays within ``max_tokens``.

    Samples are sorted by length (longest first, ties in index order), then cut into consecutive
    runs (similar lengths, little padding) or, ``packed``, each put in the first group it fits
    (short samples fill the room beside long ones). Deterministic; every index appears once.

    Raises:
        BatchValidationError: ``max_tokens`` is smaller than the longest sample.
    """
    check_int(max_tokens, "max_tokens", low=1, error=BatchValidationError)
    check_bool(packed, "partition_by_token_budget() packed", error=BatchValidationError)
    if not _is_list(lengths):
        raise BatchValidationError(f"lengths must be a list of token counts, got {describe(lengths)}")
    for n in lengths:
        check_int(n, "lengths", low=0, error=BatchValidationError)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if order and lengths[order[0]] > max_tokens:
        raise BatchValidationError(
            f"sample {order[0]} has {lengths[order[0]]} tokens, more than the micro-batch budget "
            f"max_tokens={max_tokens}; raise the budget to at least the longest sequence"
        )
    groups: list[list[int]] = []
    if packed:
        room: list[int] = []  # budget left in each group
        for i in order:
            g = next((j for j, left in enumerate(room) if left >= max(lengths[i], 1)), len(groups))
            if g == len(groups):
                groups.append([])
                room.append(max_tokens)
            groups[g].append(i)
            room[g] -= max(lengths[i], 1)
        return groups
    i = 0
    while i < len(order):
        take = max(1, max_tokens // max(lengths[order[i]], 1))  # as many as fit beside the longest
        groups.append(order[i : i + take])
        i += take
    return groups


def index(batch: TensorBatch, indices: Tensor | Sequence[int] | slice) -> TensorBatch:
    """The samples at ``indices`` (any order, repeats allowed, negative from the end), or a slice of them.

    ``indices`` is a 1-D integer tensor or array, a sequence of ints, or a slice with a positive
    step; bools and floats are refused (a bool mask is not an index list).
    """
    if isinstance(indices, slice):
        for part in ("start", "stop", "step"):
            value = getattr(indices, part)
            if value is not None:
                check_int(value, f"index(): slice {part}", low=1 if part == "step" else None, error=BatchValidationError)
        start, stop, step = indices.indices(batch._size)
        # In range: torch truncates (with a warning) slice bounds beyond 64 bits, which would
        # disagree with the rows counted here.
        indices = slice(start, stop, min(step, max(batch._size, 1)))
        rows = range(batch._size)[indices]
        tensors = {k: v[indices] for k, v in batch._tensors.items()}
        ext = {k: v[indices] for k, v in batch._extras.items()}
        return batch._trusted(tensors, ext, batch._meta, len(rows))
    idx = _index_tensor(indices, batch._size)
    if idx.dim() != 1:
        raise BatchValidationError(f"index() takes a 1-D index, got shape {tuple(idx.shape)}")
    if idx.numel() and (int(idx.min()) < -batch._size or int(idx.max()) >= batch._size):
        raise _out_of_range(int(idx.min()), int(idx.max()), batch._size)
    idx = idx % max(batch._size, 1)
    tensors = {k: v.index_select(0, idx.to(v.device)) for k, v in batch._tensors.items()}
    picked: list[int] = idx.tolist()
    ext = {k: tuple(v[i] for i in picked) for k, v in batch._extras.items()}
    return batch._trusted(tensors, ext, batch._meta, len(picked))


def split(batch: TensorBatch, sizes: Sequence[int]) -> list[TensorBatch]:
    """Consecutive pieces of the given sizes (must sum to the batch size; zeros allowed)."""
    if not _is_list(sizes):
        raise BatchValidationError(f"split() takes a list of sizes, got {describe(sizes)}")
    for s in sizes:
        check_int(s, "split() sizes", low=0, error=BatchValidationError)
    check_fits(len(sizes) * _PIECE_BYTES, "cpu", f"split() into {len(sizes)} pieces")
    if sum(sizes) != batch._size:
        raise BatchValidationError(f"split() sizes {list(sizes)} must be >= 0 and sum to the batch size {batch._size}")
    starts = itertools.accumulate(sizes, initial=0)
    return [batch.index(slice(start, start + s)) for start, s in zip(starts, sizes)]


def chunk(batch: TensorBatch, n: int) -> list[TensorBatch]:
    """``n`` consecutive pieces whose sizes differ by at most one (the first ones larger)."""
    check_int(n, "chunk() n", low=1, error=BatchValidationError)
    check_fits(n * _PIECE_BYTES, "cpu", f"chunk({_short(n)})")
    base, extra = divmod(batch._size, n)
    return batch.split([base + (1 if i < extra else 0) for i in range(n)])


def repeat_interleave(batch: TensorBatch, n: int) -> TensorBatch:
    """Each sample repeated ``n`` times in place (s0, s0, s1, s1, ...).

    Repeats keep their ``group_ids`` and get ``sample_index`` 0..n-1 when the batch has
    ``group_ids`` (the n samples of one prompt form one group).
    """
    check_int(n, "repeat_interleave() n", low=1, error=BatchValidationError)
    batch._check_rows_fit(batch._size * n, f"repeat_interleave({_short(n)}) of {batch._size} samples")
    out = batch.index(torch.arange(batch._size).repeat_interleave(n))
    if "group_ids" in batch._tensors:
        out = out.update(sample_index=torch.arange(n, device=out.device).repeat(batch._size))
    return out


def concat(batches: Sequence[TensorBatch]) -> TensorBatch:
    """Concatenate along the batch dim, re-padding prompts (left) and responses (right).

    All batches must have the same fields and extras keys, and agree on temperature, top_p,
    top_k and pad id; the result's step and weight version are the oldest of the inputs.
    """
    from verl_core.kernel.batch import TensorBatch
    if not _is_list(batches):
        raise BatchValidationError(f"concat() takes a list of TensorBatch, got {describe(batches)}")
    for i, b in enumerate(batches):
        if not isinstance(b, TensorBatch):
            raise BatchValidationError(f"concat(): item {i} must be a TensorBatch, got {describe(b)}")
    if not batches:
        raise BatchValidationError("concat() needs at least one batch")
    first = batches[0]
    for i, b in enumerate(batches[1:], 1):
        if set(b._tensors) != set(first._tensors):
            raise BatchValidationError(f"concat(): batch {i} has fields {sorted(b._tensors)}, batch 0 has {sorted(first._tensors)}")
        if set(b._extras) != set(first._extras):
            raise BatchValidationError(f"concat(): batch {i} has extras {sorted(b._extras)}, batch 0 has {sorted(first._extras)}")
        for key in _SAMPLING_KEYS:
            if getattr(b.meta, key) != getattr(first.meta, key):
                raise BatchValidationError(
                    f"concat(): batch {i} has meta.{key}={getattr(b.meta, key)!r}, "
                    f"batch 0 has {getattr(first.meta, key)!r}; batches sampled differently "
                    "cannot share one batch"
                )
    oldest = {k: min(getattr(b.meta, k) for b in batches) for k in ("step", "weight_version")}
    meta = dataclasses.replace(first.meta, **oldest)
    pad_id = meta.pad_token_id
    tensors: dict[str, Tensor] = {}
    for name in first._tensors:
        spec = FIELDS[name]
        parts = [b._tensors[name] for b in batches]
        if len(spec.dims) == 2:
            width = max(p.shape[1] for p in parts)
            left = spec.dims[1] == "prompt"
            fill = pad_id if spec.pad_value is None else spec.pad_value
            parts = [_pad_cols(p, width, left=left, value=fill) for p in parts]
        tensors[name] = torch.cat(parts, 0)
    ext = {k: tuple(v for b in batches for v in b._extras[k]) for k in first._extras}
    return first._trusted(tensors, ext, meta, sum(b._size for b in batches))


def trim(batch: TensorBatch) -> TensorBatch:
    """Drop padding columns: all-padding prompt columns on the left, response columns on the right."""
    tensors = dict(batch._tensors)
    for dim in ("prompt", "response") if batch._size else ():
        mask = tensors.get(f"{dim}_mask")
        if mask is not None:
            used = mask.any(0).nonzero()  # prompts: drop columns on the left; responses: on the right
            if dim == "prompt":
                cols = slice(int(used[0]) if used.numel() else mask.shape[1], None)
            else:
                cols = slice(None, int(used[-1]) + 1 if used.numel() else 0)
            tensors.update({n: t[:, cols] for n, t in tensors.items() if FIELDS[n].dims[1:] == (dim,)})
    return batch._trusted(tensors, dict(batch._extras), batch._meta, batch._size)


def pad_prompts(batch: TensorBatch, width: int) -> TensorBatch:
    """Left-pad every prompt field to ``width`` columns (the pad id, a False mask; the inverse of :meth:`trim`).

    An engine that compiles or captures one program per prompt width pads to a few widths
    instead of one per batch.
    """
    check_int(width, "pad_prompts() width", low=0, error=BatchValidationError)
    prompt_fields = [t for n, t in batch._tensors.items() if FIELDS[n].dims[1:] == ("prompt",)]
    current = prompt_fields[0].shape[1] if prompt_fields else None
    if current is None or width <= current:
        if current is not None and width < current:
            raise BatchValidationError(f"pad_prompts({width}): the prompts are already {current} wide")
        return batch
    row_bytes = sum(t.element_size() for t in prompt_fields) * width
    check_fits(batch._size * row_bytes, batch.device, f"pad_prompts({_short(width)}) of {batch._size} samples")
    tensors = dict(batch._tensors)
    for name, t in tensors.items():
        spec = FIELDS[name]
        if spec.dims[1:] == ("prompt",):
            fill = batch._meta.pad_token_id if spec.pad_value is None else spec.pad_value
            tensors[name] = _pad_cols(t, width, left=True, value=fill)
    return batch._trusted(tensors, dict(batch._extras), batch._meta, batch._size)


def pad_to_multiple(batch: TensorBatch, divisor: int) -> tuple[TensorBatch, int]:
    """Append padding samples so the batch size divides by ``divisor``.

    Padding samples copy the last sample with ``response_mask`` (and ``loss_mask``) all False and
    per-token values 0, so every loss and aggregation ignores them. Returns the padded batch and
    the number of samples added, which :meth:`unpad` removes.
    """
    check_int(divisor, "pad_to_multiple() divisor", low=1, error=BatchValidationError)
    n_pad = -batch._size % divisor
    if n_pad == 0:
        return batch, 0
    if batch._size == 0:
        raise BatchValidationError("pad_to_multiple(): an empty batch has no sample to pad with")
    batch._check_rows_fit(n_pad + batch._size, f"pad_to_multiple({_short(divisor)}) of {batch._size} samples")
    pad = batch.index([batch._size - 1] * n_pad)
    if "response_mask" in pad._tensors:  # masks False, floats and turn ids 0 (ids keep the copy)
        per_token = [k for k in pad._tensors if FIELDS[k].kind != "ids" and FIELDS[k].dims == ("batch", "response")]
        pad = pad.update({k: torch.zeros_like(pad._tensors[k]) for k in per_token})
    return concat([batch, pad]), n_pad


def unpad(batch: TensorBatch, n_pad: int) -> TensorBatch:
    """Remove the last ``n_pad`` samples added by :meth:`pad_to_multiple`."""
    check_int(n_pad, f"unpad() n_pad (on a batch of {batch._size})", low=0, high=batch._size, error=BatchValidationError)
    return batch.index(slice(0, batch._size - n_pad))


def micro_batches(
    batch: TensorBatch, *, max_tokens: int | None = None, size: int | None = None, trim: bool = True,
    packed: bool = False,
) -> MicroBatches:
    """Split into micro-batches by a token budget or a fixed size.

    With ``max_tokens``, samples are partitioned (:func:`partition_by_token_budget`, ``packed`` for
    an engine without padding) so each micro-batch's cost (prompt plus response tokens) stays within
    the budget; with ``size``, consecutive samples are taken ``size`` at a time. Each micro-batch is
    trimmed of all-padding columns unless ``trim`` is False; :meth:`MicroBatches.restore` undoes the
    reordering.
    """
    from verl_core.kernel.batch import MicroBatches
    if (max_tokens is None) == (size is None):
        raise BatchValidationError("micro_batches() takes exactly one of max_tokens= or size=")
    check_bool(trim, "micro_batches() trim", error=BatchValidationError)
    check_bool(packed, "micro_batches() packed", error=BatchValidationError)
    lengths = batch.seq_lengths()
    if max_tokens is not None:
        groups = partition_by_token_budget(lengths.tolist(), max_tokens, packed=packed)
    else:
        assert size is not None
        check_int(size, "micro_batches() size", low=1, error=BatchValidationError)
        groups = [list(range(i, min(i + size, batch._size))) for i in range(0, batch._size, size)]
    order = torch.tensor([i for g in groups for i in g], dtype=torch.int64)
    parts = (batch.index(g) for g in groups)
    return MicroBatches(tuple(mb.trim() if trim else mb for mb in parts), order, lengths)


def check(batch: TensorBatch, *, where: str = "input", vocab_size: int | None = None) -> TensorBatch:
    """Check values (a pass over the data): run this at protocol boundaries.

    Re-checks the structure (names, ranks, dtypes, devices, shared dims: a batch assembled
    without validation is caught here too), then that float fields are finite, prompt masks are
    left-padded and response masks right-padded, every prompt has at least one token, ids lie in
    ``[0, vocab_size)`` when given, ``group_ids`` are not negative, ``loss_mask`` is a subset of
    ``response_mask`` and ``turn_ids`` are >= 0 and non-decreasing along each response. Returns the
    batch itself so calls chain.

    Raises:
        NonFiniteError: a float field holds NaN or inf (the message names the field and sample).
        BatchValidationError: any other violation, naming ``where``, the field and the sample.
    """
    if not isinstance(where, str):
        raise BatchValidationError(f"check() where= must be a string, got {describe(where)}")
    if vocab_size is not None:
        check_int(vocab_size, f"{where}: check() vocab_size", low=1, error=BatchValidationError)
    sizes: dict[Dim, tuple[int, str]] = {"batch": (batch._size, "<batch size>")}
    device: list[torch.device] = []
    for name, t in batch._tensors.items():
        try:
            _validate_field(name, t, sizes, device)
        except BatchValidationError as e:
            raise BatchValidationError(f"{where}: {e}") from None
    for name, t in batch._tensors.items():
        spec = FIELDS[name]
        if spec.kind == "float" and t.numel():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                row = int(bad.reshape(t.shape[0], -1).any(1).nonzero()[0])
                raise NonFiniteError(f"{where}: field {name!r} holds NaN/inf (first at sample {row}); only finite values are allowed")
        elif spec.kind == "ids" and t.numel():
            lo = int(t.min())
            if lo < 0 or (vocab_size is not None and int(t.max()) >= vocab_size):
                raise BatchValidationError(
                    f"{where}: field {name!r} holds ids in [{lo}, {int(t.max())}], "
                    f"expected ids in [0, {vocab_size if vocab_size is not None else 'vocab'})"
                )
    _check_padding_side(batch._tensors.get("prompt_mask"), "prompt_mask", left=True, where=where)
    pm = batch._tensors.get("prompt_mask")
    if pm is not None and batch._size and (pm.shape[1] == 0 or not bool(pm[:, -1].all())):
        # the first response token is read from the logits of the last prompt token
        row = 0 if pm.shape[1] == 0 else int((~pm[:, -1]).nonzero()[0])
        raise BatchValidationError(
            f"{where}: sample {row} has an empty prompt; every sample needs at least one real "
            "prompt token (prompt_mask left-padded and ending in True)"
        )
    _check_padding_side(batch._tensors.get("response_mask"), "response_mask", left=False, where=where)
    if "group_ids" in batch._tensors and batch._size and int(batch._tensors["group_ids"].min()) < 0:
        raise BatchValidationError(f"{where}: group_ids must be >= 0")
    _check_turns(batch, where)
    return batch


def _check_turns(batch: TensorBatch, where: str) -> None:
    rm, lm, turns = (batch._tensors.get(k) for k in ("response_mask", "loss_mask", "turn_ids"))
    for name, bad, rule in (
        ("loss_mask", None if lm is None or rm is None else lm & ~rm, "a subset of response_mask (sampled tokens)"),
        ("turn_ids", None if turns is None or rm is None else rm & ((turns < 0) | (turns < turns.cummax(-1).values)),
         ">= 0 and never decreasing along the response (k on model turn k and the observations after it)"),
    ):
        if bad is not None and bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise BatchValidationError(f"{where}: field {name!r} of sample {row} is wrong at response position "
                                       f"{col}; expected {rule}")
