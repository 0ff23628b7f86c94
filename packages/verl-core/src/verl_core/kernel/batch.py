"""TensorBatch: the immutable, validated batch every protocol takes and returns, with its ops.

Construction checks names, ranks, dtypes, devices and shared dim sizes (cheap: no pass over the
data). Value checks (NaN/inf, padding sides, pad values) cost a pass over the data and run only at
protocol boundaries through :meth:`TensorBatch.check`. Every op checks its arguments' types and
ranges, and an op that would allocate more than the device's available memory (a huge repeat,
padding width or multiple) is refused with :class:`~verl_core.kernel.errors.RequestTooLargeError` before
it allocates.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import Tensor

from verl_core.kernel.errors import (
    BatchValidationError,
    MissingFieldError,
    NonFiniteError,
    check_bool,
    check_int,
    check_number,
    describe,
)
from verl_core.kernel.memory import _short, available_memory, check_fits
from verl_core.kernel.schema import FIELDS, Dim, FieldSpec, check_temperature

__all__ = ["BatchMeta", "MicroBatches", "TensorBatch", "available_memory", "check_fits", "micro_batch_cost",
           "partition_by_token_budget"]


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


@dataclass(frozen=True)
class BatchMeta:
    """What the whole batch shares; every op carries it through.

    Attributes:
        temperature: Sampling temperature T >= ``MIN_TEMPERATURE`` (1e-4); log-probs are of
            softmax(logits / T).
        top_p: Nucleus sampling threshold used to generate the batch (1.0 = off).
        top_k: Top-k used to generate the batch (0 = off).
        pad_token_id: The tokenizer's pad id, which fills padding positions of id fields.
        weight_version: Version of the weights that generated the batch.
        step: Trainer step that produced the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    pad_token_id: int = 0
    weight_version: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        err = BatchValidationError
        check_temperature(self.temperature, "BatchMeta.temperature", error=err)
        check_number(self.top_p, "BatchMeta.top_p", low=0, high=1, low_open=True, error=err, hint=" (1 = off)")
        check_int(self.top_k, "BatchMeta.top_k", low=0, error=err, hint=" (0 = off)")
        for name in ("pad_token_id", "weight_version", "step"):
            check_int(getattr(self, name), f"BatchMeta.{name}", low=0, error=err)




class TensorBatch(Mapping[str, Tensor]):
    """An immutable mapping from schema fields to tensors sharing a batch dimension.

    Also carries per-sample non-tensor ``extras`` (e.g. ground-truth answers; one value per sample)
    and :class:`BatchMeta`. Every op returns a new batch; tensors are shared, not copied, so do not
    modify them in place.

    Args:
        tensors: Field name -> tensor; every name must be in the schema (:data:`~verl_core.kernel.schema.FIELDS`).
        extras: Key -> one value per sample.
        meta: What the whole batch shares (default: ``BatchMeta()``).
        batch_size: The number of samples; needed only for a batch without fields or extras.

    Raises:
        BatchValidationError: on an argument of the wrong type, an unknown field, a wrong rank,
            dtype or device, a dim size that disagrees with another field, or extras of the wrong
            length. The message names the field, the expected and the actual value. Values
            (NaN/inf, padding) are checked by :meth:`check`, not here.
    """

    __slots__ = ("_extras", "_meta", "_size", "_tensors")

    _tensors: dict[str, Tensor]
    _extras: dict[str, tuple[Any, ...]]
    _meta: BatchMeta
    _size: int

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        extras: Mapping[str, Sequence[Any]] | None = None,
        meta: BatchMeta | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        _check_mapping(tensors, "TensorBatch tensors", "field names to tensors")
        _check_meta(meta, "TensorBatch meta")
        if batch_size is not None:
            check_int(batch_size, "TensorBatch batch_size", low=0, error=BatchValidationError)
        sizes: dict[Dim, tuple[int, str]] = {}
        device: list[torch.device] = []
        checked = {name: _validate_field(name, t, sizes, device) for name, t in tensors.items()}
        size = sizes["batch"][0] if "batch" in sizes else None
        ext = _validate_extras({} if extras is None else extras, size if size is not None else batch_size)
        if size is None:
            size = batch_size if batch_size is not None else _extras_size(ext)
        if batch_size is not None and batch_size != size:
            raise BatchValidationError(f"batch_size={batch_size} but the fields have batch size {size}")
        self._init(checked, ext, meta or BatchMeta(), size)

    def _init(
        self, tensors: dict[str, Tensor], extras: dict[str, tuple[Any, ...]], meta: BatchMeta, size: int
    ) -> None:
        object.__setattr__(self, "_tensors", tensors)
        object.__setattr__(self, "_extras", extras)
        object.__setattr__(self, "_meta", meta)
        object.__setattr__(self, "_size", size)

    @classmethod
    def _trusted(
        cls, tensors: dict[str, Tensor], extras: dict[str, tuple[Any, ...]], meta: BatchMeta, size: int
    ) -> TensorBatch:
        """Build without validation: only for ops whose output is valid by construction."""
        out = cls.__new__(cls)
        out._init(tensors, extras, meta, size)
        return out

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("TensorBatch is immutable; use update() to get a new batch")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as the constructor's arguments: unpickling (and ``copy.deepcopy``) rebuilds the batch
        through the validating constructor, with the same tensors, extras, meta and batch size.

        A field registered with :func:`~verl_core.kernel.schema.register_field` must be registered
        in the process that unpickles too. (Between Ray worker groups batches travel in the wire
        format of :mod:`verl_core.trainer.executor.wire` instead.)
        """
        return _unpickle_batch, (type(self), dict(self._tensors), dict(self._extras), self._meta, self._size)

    # ----------------------------------------------------------------- mapping and access
    def __getitem__(self, name: str) -> Tensor:
        """The field ``name``.

        Raises:
            MissingFieldError: the batch has no such field (a ``KeyError`` too).
        """
        try:
            return self._tensors[name]
        except (KeyError, TypeError):  # TypeError: an unhashable key
            raise MissingFieldError(
                f"field {describe(name)} is not in this batch; it has: {', '.join(self._tensors) or 'none'}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        """Number of fields (use :attr:`batch_size` for the number of samples)."""
        return len(self._tensors)

    @property
    def batch_size(self) -> int:
        """Number of samples."""
        return self._size

    @property
    def extras(self) -> Mapping[str, tuple[Any, ...]]:
        """Per-sample non-tensor values, one tuple of ``batch_size`` values per key."""
        return dict(self._extras)

    @property
    def meta(self) -> BatchMeta:
        """What the whole batch shares (temperature, pad id, weight version, step)."""
        return self._meta

    @property
    def device(self) -> torch.device:
        """Device of the tensors (cpu for a batch without tensors)."""
        for t in self._tensors.values():
            return t.device
        return torch.device("cpu")

    @property
    def prompt_len(self) -> int:
        """Padded prompt width (0 without prompt fields)."""
        t = self._tensors.get("prompt_ids", self._tensors.get("prompt_mask"))
        return 0 if t is None else int(t.shape[1])

    @property
    def response_len(self) -> int:
        """Padded response width (0 without per-token fields)."""
        for name, t in self._tensors.items():
            if FIELDS[name].dims == ("batch", "response"):
                return int(t.shape[1])
        return 0

    @property
    def loss_mask(self) -> Tensor:
        """Field ``loss_mask``, else ``response_mask``: what every loss, KL, aggregation and count reads."""
        mask = self._tensors.get("loss_mask")
        return self["response_mask"] if mask is None else mask

    def require(self, *names: str, where: str = "this operation") -> None:
        """Raise BatchValidationError naming every missing field that ``where`` needs."""
        _check_names(names, f"{where}: field names")
        missing = [n for n in names if n not in self._tensors]
        if missing:
            raise BatchValidationError(
                f"{where} needs field(s) {', '.join(missing)}, but the batch has only: "
                f"{', '.join(self._tensors) or 'none'}"
            )

    def _check_rows_fit(self, rows: int, what: str) -> None:
        """Refuse an op that would make a batch of ``rows`` samples larger than the available memory."""
        per_row = sum(t.element_size() * math.prod(t.shape[1:]) for t in self._tensors.values())
        per_row += 8 * len(self._extras) + 24  # extras pointers, the gather index and sample_index
        check_fits(rows * per_row, self.device, f"{what} (a batch of {_short(rows)} samples, {per_row} bytes each)")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self._tensors.items())
        return f"TensorBatch(batch_size={self._size}, {fields}, extras={list(self._extras)})"

    # ----------------------------------------------------------------- derived views
    def seq_lengths(self) -> Tensor:
        """Real tokens per sample: prompt tokens plus response tokens (int64 [batch])."""
        total = torch.zeros(self._size, dtype=torch.int64, device=self.device)
        if "prompt_mask" in self._tensors:
            total += self._tensors["prompt_mask"].sum(1)
        if "response_mask" in self._tensors:
            total += self._tensors["response_mask"].sum(1)
        return total

    # ----------------------------------------------------------------- ops
    def select(self, *names: str, extras: bool | Sequence[str] = True) -> TensorBatch:
        """A batch with only the named fields (and all, none, or the named extras)."""
        self.require(*names, where="select()")
        ext = self._pick_extras(extras)
        return TensorBatch._trusted({n: self._tensors[n] for n in names}, ext, self._meta, self._size)

    def drop(self, *names: str) -> TensorBatch:
        """A batch without the named fields (missing names are ignored)."""
        _check_names(names, "drop(): field names")
        kept = {k: v for k, v in self._tensors.items() if k not in names}
        return TensorBatch._trusted(kept, dict(self._extras), self._meta, self._size)

    def _pick_extras(self, extras: bool | Sequence[str]) -> dict[str, tuple[Any, ...]]:
        if extras is True:
            return dict(self._extras)
        if extras is False:
            return {}
        if not _is_list(extras):
            raise BatchValidationError(f"extras= must be True, False or a list of extras keys, got {describe(extras)}")
        _check_names(extras, "extras keys")
        missing = [k for k in extras if k not in self._extras]
        if missing:
            raise BatchValidationError(f"extras {missing} are not in the batch: {list(self._extras)}")
        return {k: self._extras[k] for k in extras}

    def update(
        self,
        tensors: Mapping[str, Tensor] | None = None,
        /,
        *,
        extras: Mapping[str, Sequence[Any]] | None = None,
        meta: BatchMeta | None = None,
        **fields: Tensor,
    ) -> TensorBatch:
        """A new batch with fields added or replaced (validated against the existing ones)."""
        if tensors is not None:
            _check_mapping(tensors, "update() tensors", "field names to tensors")
        _check_meta(meta, "update() meta")
        new = dict(tensors or {})
        new.update(fields)
        sizes: dict[Dim, tuple[int, str]] = {"batch": (self._size, "<batch>")}
        device: list[torch.device] = []
        for name, t in self._tensors.items():
            if name not in new:
                for dim, size in zip(FIELDS[name].dims, t.shape, strict=True):
                    sizes.setdefault(dim, (size, name))
                if not device:
                    device.append(t.device)
        merged = dict(self._tensors)
        for name, t in new.items():
            merged[name] = _validate_field(name, t, sizes, device)
        ext = dict(self._extras)
        ext.update(_validate_extras({} if extras is None else extras, self._size))
        return TensorBatch._trusted(merged, ext, meta or self._meta, self._size)

    def with_meta(self, **changes: Any) -> TensorBatch:
        """A new batch whose meta has the given attributes replaced."""
        valid = [f.name for f in dataclasses.fields(BatchMeta)]
        unknown = sorted(set(changes) - set(valid))
        if unknown:
            raise BatchValidationError(f"with_meta(): unknown BatchMeta attribute(s) {unknown}; valid: {', '.join(valid)}")
        meta = dataclasses.replace(self._meta, **changes)
        return TensorBatch._trusted(dict(self._tensors), dict(self._extras), meta, self._size)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TensorBatch:
        """The batch with every tensor on ``device``."""
        dev = _device(device, "to() device")
        tensors = {k: v.to(dev, non_blocking=non_blocking) for k, v in self._tensors.items()}
        return TensorBatch._trusted(tensors, dict(self._extras), self._meta, self._size)

    # ----------------------------------------------------------------- ops and value checks
    def index(self, indices: Tensor | Sequence[int] | slice) -> TensorBatch:
        """The samples at ``indices`` (any order, repeats allowed, negative from the end), or a slice of them.

        ``indices`` is a 1-D integer tensor or array, a sequence of ints, or a slice with a positive
        step; bools and floats are refused (a bool mask is not an index list).
        """
        if isinstance(indices, slice):
            for part in ("start", "stop", "step"):
                value = getattr(indices, part)
                if value is not None:
                    check_int(value, f"index(): slice {part}", low=1 if part == "step" else None, error=BatchValidationError)
            start, stop, step = indices.indices(self._size)
            # In range: torch truncates (with a warning) slice bounds beyond 64 bits, which would
            # disagree with the rows counted here.
            indices = slice(start, stop, min(step, max(self._size, 1)))
            rows = range(self._size)[indices]
            tensors = {k: v[indices] for k, v in self._tensors.items()}
            ext = {k: v[indices] for k, v in self._extras.items()}
            return self._trusted(tensors, ext, self._meta, len(rows))
        idx = _index_tensor(indices, self._size)
        if idx.dim() != 1:
            raise BatchValidationError(f"index() takes a 1-D index, got shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < -self._size or int(idx.max()) >= self._size):
            raise _out_of_range(int(idx.min()), int(idx.max()), self._size)
        idx = idx % max(self._size, 1)
        tensors = {k: v.index_select(0, idx.to(v.device)) for k, v in self._tensors.items()}
        picked: list[int] = idx.tolist()
        ext = {k: tuple(v[i] for i in picked) for k, v in self._extras.items()}
        return self._trusted(tensors, ext, self._meta, len(picked))

    def split(self, sizes: Sequence[int]) -> list[TensorBatch]:
        """Consecutive pieces of the given sizes (must sum to the batch size; zeros allowed)."""
        if not _is_list(sizes):
            raise BatchValidationError(f"split() takes a list of sizes, got {describe(sizes)}")
        for s in sizes:
            check_int(s, "split() sizes", low=0, error=BatchValidationError)
        check_fits(len(sizes) * _PIECE_BYTES, "cpu", f"split() into {len(sizes)} pieces")
        if sum(sizes) != self._size:
            raise BatchValidationError(f"split() sizes {list(sizes)} must be >= 0 and sum to the batch size {self._size}")
        starts = itertools.accumulate(sizes, initial=0)
        return [self.index(slice(start, start + s)) for start, s in zip(starts, sizes)]

    def chunk(self, n: int) -> list[TensorBatch]:
        """``n`` consecutive pieces whose sizes differ by at most one (the first ones larger)."""
        check_int(n, "chunk() n", low=1, error=BatchValidationError)
        check_fits(n * _PIECE_BYTES, "cpu", f"chunk({_short(n)})")
        base, extra = divmod(self._size, n)
        return self.split([base + (1 if i < extra else 0) for i in range(n)])

    def repeat_interleave(self, n: int) -> TensorBatch:
        """Each sample repeated ``n`` times in place (s0, s0, s1, s1, ...).

        Repeats keep their ``group_ids`` and get ``sample_index`` 0..n-1 when the batch has
        ``group_ids`` (the n samples of one prompt form one group).
        """
        check_int(n, "repeat_interleave() n", low=1, error=BatchValidationError)
        self._check_rows_fit(self._size * n, f"repeat_interleave({_short(n)}) of {self._size} samples")
        out = self.index(torch.arange(self._size).repeat_interleave(n))
        if "group_ids" in self._tensors:
            out = out.update(sample_index=torch.arange(n, device=out.device).repeat(self._size))
        return out

    @staticmethod
    def concat(batches: Sequence[TensorBatch]) -> TensorBatch:
        """Concatenate along the batch dim, re-padding prompts (left) and responses (right).

        All batches must have the same fields and extras keys, and agree on temperature, top_p,
        top_k and pad id; the result's step and weight version are the oldest of the inputs.
        """
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

    def trim(self) -> TensorBatch:
        """Drop padding columns: all-padding prompt columns on the left, response columns on the right."""
        tensors = dict(self._tensors)
        for dim in ("prompt", "response") if self._size else ():
            mask = tensors.get(f"{dim}_mask")
            if mask is not None:
                used = mask.any(0).nonzero()  # prompts: drop columns on the left; responses: on the right
                if dim == "prompt":
                    cols = slice(int(used[0]) if used.numel() else mask.shape[1], None)
                else:
                    cols = slice(None, int(used[-1]) + 1 if used.numel() else 0)
                tensors.update({n: t[:, cols] for n, t in tensors.items() if FIELDS[n].dims[1:] == (dim,)})
        return self._trusted(tensors, dict(self._extras), self._meta, self._size)

    def pad_prompts(self, width: int) -> TensorBatch:
        """Left-pad every prompt field to ``width`` columns (the pad id, a False mask; the inverse of :meth:`trim`).

        An engine that compiles or captures one program per prompt width pads to a few widths
        instead of one per batch.
        """
        check_int(width, "pad_prompts() width", low=0, error=BatchValidationError)
        prompt_fields = [t for n, t in self._tensors.items() if FIELDS[n].dims[1:] == ("prompt",)]
        current = prompt_fields[0].shape[1] if prompt_fields else None
        if current is None or width <= current:
            if current is not None and width < current:
                raise BatchValidationError(f"pad_prompts({width}): the prompts are already {current} wide")
            return self
        row_bytes = sum(t.element_size() for t in prompt_fields) * width
        check_fits(self._size * row_bytes, self.device, f"pad_prompts({_short(width)}) of {self._size} samples")
        tensors = dict(self._tensors)
        for name, t in tensors.items():
            spec = FIELDS[name]
            if spec.dims[1:] == ("prompt",):
                fill = self._meta.pad_token_id if spec.pad_value is None else spec.pad_value
                tensors[name] = _pad_cols(t, width, left=True, value=fill)
        return self._trusted(tensors, dict(self._extras), self._meta, self._size)

    def pad_to_multiple(self, divisor: int) -> tuple[TensorBatch, int]:
        """Append padding samples so the batch size divides by ``divisor``.

        Padding samples copy the last sample with ``response_mask`` (and ``loss_mask``) all False and
        per-token values 0, so every loss and aggregation ignores them. Returns the padded batch and
        the number of samples added, which :meth:`unpad` removes.
        """
        check_int(divisor, "pad_to_multiple() divisor", low=1, error=BatchValidationError)
        n_pad = -self._size % divisor
        if n_pad == 0:
            return self, 0
        if self._size == 0:
            raise BatchValidationError("pad_to_multiple(): an empty batch has no sample to pad with")
        self._check_rows_fit(n_pad + self._size, f"pad_to_multiple({_short(divisor)}) of {self._size} samples")
        pad = self.index([self._size - 1] * n_pad)
        if "response_mask" in pad._tensors:  # masks False, floats and turn ids 0 (ids keep the copy)
            per_token = [k for k in pad._tensors if FIELDS[k].kind != "ids" and FIELDS[k].dims == ("batch", "response")]
            pad = pad.update({k: torch.zeros_like(pad._tensors[k]) for k in per_token})
        return TensorBatch.concat([self, pad]), n_pad

    def unpad(self, n_pad: int) -> TensorBatch:
        """Remove the last ``n_pad`` samples added by :meth:`pad_to_multiple`."""
        check_int(n_pad, f"unpad() n_pad (on a batch of {self._size})", low=0, high=self._size, error=BatchValidationError)
        return self.index(slice(0, self._size - n_pad))

    def micro_batches(
        self: TensorBatch, *, max_tokens: int | None = None, size: int | None = None, trim: bool = True,
        packed: bool = False,
    ) -> MicroBatches:
        """Split into micro-batches by a token budget or a fixed size.

        With ``max_tokens``, samples are partitioned (:func:`partition_by_token_budget`, ``packed`` for
        an engine without padding) so each micro-batch's cost (prompt plus response tokens) stays within
        the budget; with ``size``, consecutive samples are taken ``size`` at a time. Give exactly one of
        the two (the whole batch as one micro-batch: ``size=max(1, batch_size)``; a batch of no
        samples gives no micro-batches). Each micro-batch is trimmed of all-padding columns unless
        ``trim`` is False; :meth:`MicroBatches.restore` undoes the reordering.

        Raises:
            BatchValidationError: both or neither of ``max_tokens`` and ``size``, or a value out of range.
        """
        if (max_tokens is None) == (size is None):
            raise BatchValidationError("micro_batches() takes exactly one of max_tokens= or size=")
        check_bool(trim, "micro_batches() trim", error=BatchValidationError)
        check_bool(packed, "micro_batches() packed", error=BatchValidationError)
        lengths = self.seq_lengths()
        if max_tokens is not None:
            groups = partition_by_token_budget(lengths.tolist(), max_tokens, packed=packed)
        else:
            assert size is not None
            check_int(size, "micro_batches() size", low=1, error=BatchValidationError)
            groups = [list(range(i, min(i + size, self._size))) for i in range(0, self._size, size)]
        order = torch.tensor([i for g in groups for i in g], dtype=torch.int64)
        parts = (self.index(g) for g in groups)
        return MicroBatches(tuple(mb.trim() if trim else mb for mb in parts), order, lengths)

    def check(self, *, where: str = "input", vocab_size: int | None = None) -> TensorBatch:
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
        sizes: dict[Dim, tuple[int, str]] = {"batch": (self._size, "<batch size>")}
        device: list[torch.device] = []
        for name, t in self._tensors.items():
            try:
                _validate_field(name, t, sizes, device)
            except BatchValidationError as e:
                raise BatchValidationError(f"{where}: {e}") from None
        for name, t in self._tensors.items():
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
        _check_padding_side(self._tensors.get("prompt_mask"), "prompt_mask", left=True, where=where)
        pm = self._tensors.get("prompt_mask")
        if pm is not None and self._size and (pm.shape[1] == 0 or not bool(pm[:, -1].all())):
            # the first response token is read from the logits of the last prompt token
            row = 0 if pm.shape[1] == 0 else int((~pm[:, -1]).nonzero()[0])
            raise BatchValidationError(
                f"{where}: sample {row} has an empty prompt; every sample needs at least one real "
                "prompt token (prompt_mask left-padded and ending in True)"
            )
        _check_padding_side(self._tensors.get("response_mask"), "response_mask", left=False, where=where)
        if "group_ids" in self._tensors and self._size and int(self._tensors["group_ids"].min()) < 0:
            raise BatchValidationError(f"{where}: group_ids must be >= 0")
        _check_turns(self, where)
        return self


def _check_meta(meta: object, name: str) -> None:
    if meta is not None and not isinstance(meta, BatchMeta):
        raise BatchValidationError(f"{name} must be a BatchMeta or None, got {describe(meta)}")


def _device(device: object, name: str) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise BatchValidationError(f"{name} must be a torch.device or a string like 'cpu' or 'cuda:0', got "
                                   f"{describe(device)}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BatchValidationError(f"{name} must name a torch device like 'cpu' or 'cuda:0', got "
                                   f"{describe(device)}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise BatchValidationError(f"{name} is {dev}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _unpickle_batch(
    cls: type[TensorBatch], tensors: dict[str, Tensor], extras: dict[str, tuple[Any, ...]], meta: BatchMeta, size: int
) -> TensorBatch:
    """A pickled batch rebuilt (:meth:`TensorBatch.__reduce__`), validated as any new batch is."""
    return cls(tensors, extras, meta, batch_size=size)


def _extras_size(extras: Mapping[str, tuple[Any, ...]]) -> int:
    for v in extras.values():
        return len(v)
    raise BatchValidationError("a TensorBatch without fields or extras needs batch_size=")


@dataclass(frozen=True)
class MicroBatches:
    """Micro-batches of a batch and the order that restores the original sample order.

    Attributes:
        batches: The micro-batches, in the order they should run.
        order: ``concat(batches)`` holds the original samples ``order[0], order[1], ...``.
        lengths: Real tokens per original sample (prompt plus response).
    """

    batches: tuple[TensorBatch, ...]
    order: Tensor
    lengths: Tensor

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[TensorBatch]:
        return iter(self.batches)

    def restore(self, outputs: Sequence[TensorBatch]) -> TensorBatch:
        """Concatenate per-micro-batch outputs and put the samples back in the original order."""
        if not _is_list(outputs) or not all(isinstance(o, TensorBatch) for o in outputs):
            raise BatchValidationError(f"restore() takes a list of TensorBatch, got {describe(outputs)}")
        if [o.batch_size for o in outputs] != [b.batch_size for b in self.batches]:
            raise BatchValidationError(
                "restore(): outputs have sizes "
                f"{[o.batch_size for o in outputs]}, micro-batches {[b.batch_size for b in self.batches]}"
            )
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.order.numel())
        return TensorBatch.concat(outputs).index(inverse)

    def utilisation(self) -> float:
        """Real tokens / sum over micro-batches of (size x its longest sequence)."""
        real = int(self.lengths.sum())
        cost = 0
        start = 0
        for b in self.batches:
            idx = self.order[start : start + b.batch_size]
            start += b.batch_size
            if idx.numel():
                cost += idx.numel() * int(self.lengths[idx].max())
        return real / cost if cost else 1.0
