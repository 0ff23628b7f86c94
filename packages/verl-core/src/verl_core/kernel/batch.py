"""TensorBatch: the immutable, validated batch every protocol takes and returns.

Construction checks names, ranks, dtypes, devices and shared dim sizes (cheap: no pass over the
data). Value checks (NaN/inf, padding sides, pad values) cost a pass over the data and run only at
protocol boundaries through :meth:`TensorBatch.check`. Every op checks its arguments' types and
ranges, and an op that would allocate more than the device's available memory (a huge repeat,
padding width or multiple) is refused with :class:`~verl_core.kernel.errors.RequestTooLargeError` before
it allocates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from verl_core.kernel import batch_ops as _ops
from verl_core.kernel.batch_ops import micro_batch_cost, partition_by_token_budget
from verl_core.kernel.errors import (
    BatchValidationError,
    MissingFieldError,
    check_int,
    check_number,
    describe,
)
from verl_core.kernel.memory import _short, available_memory, check_fits
from verl_core.kernel.schema import FIELDS, Dim, check_temperature

__all__ = ["BatchMeta", "MicroBatches", "TensorBatch", "available_memory", "check_fits", "micro_batch_cost",
           "partition_by_token_budget"]


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
        _ops._check_mapping(tensors, "TensorBatch tensors", "field names to tensors")
        _check_meta(meta, "TensorBatch meta")
        if batch_size is not None:
            check_int(batch_size, "TensorBatch batch_size", low=0, error=BatchValidationError)
        sizes: dict[Dim, tuple[int, str]] = {}
        device: list[torch.device] = []
        checked = {name: _ops._validate_field(name, t, sizes, device) for name, t in tensors.items()}
        size = sizes["batch"][0] if "batch" in sizes else None
        ext = _ops._validate_extras({} if extras is None else extras, size if size is not None else batch_size)
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
        _ops._check_names(names, f"{where}: field names")
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
        _ops._check_names(names, "drop(): field names")
        kept = {k: v for k, v in self._tensors.items() if k not in names}
        return TensorBatch._trusted(kept, dict(self._extras), self._meta, self._size)

    def _pick_extras(self, extras: bool | Sequence[str]) -> dict[str, tuple[Any, ...]]:
        if extras is True:
            return dict(self._extras)
        if extras is False:
            return {}
        if not _ops._is_list(extras):
            raise BatchValidationError(f"extras= must be True, False or a list of extras keys, got {describe(extras)}")
        _ops._check_names(extras, "extras keys")
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
            _ops._check_mapping(tensors, "update() tensors", "field names to tensors")
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
            merged[name] = _ops._validate_field(name, t, sizes, device)
        ext = dict(self._extras)
        ext.update(_ops._validate_extras({} if extras is None else extras, self._size))
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

    # ----------------------------------------------------------------- ops and value checks (in batch_ops)
    index = _ops.index
    split = _ops.split
    chunk = _ops.chunk
    repeat_interleave = _ops.repeat_interleave
    concat = staticmethod(_ops.concat)
    trim = _ops.trim
    pad_prompts = _ops.pad_prompts
    pad_to_multiple = _ops.pad_to_multiple
    unpad = _ops.unpad
    micro_batches = _ops.micro_batches
    check = _ops.check


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
        if not _ops._is_list(outputs) or not all(isinstance(o, TensorBatch) for o in outputs):
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
