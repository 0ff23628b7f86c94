"""TensorBatch across process boundaries: plain tensors, JSON extras and meta, rebuilt with validation.

A batch that travels between Ray worker groups is never pickled as an object graph: the sender
turns it into :func:`to_wire`'s dict of NumPy arrays (which Ray's object store holds without a
copy) plus JSON text for the meta and the per-sample extras, and the receiver rebuilds it with
:func:`from_wire`, which checks the format, every dtype and shape against the schema (the
TensorBatch constructor) before anything uses it. Extras must be JSON values; anything else is
refused with an error naming the extra. :func:`register_batch_serializer` installs this pair as
Ray's serializer for TensorBatch in the calling process.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final

import torch

from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.errors import BatchValidationError

__all__ = ["WIRE_FORMAT", "from_wire", "register_batch_serializer", "to_wire"]

WIRE_FORMAT: Final = "verl.TensorBatch.wire/1"

# dtype name -> (torch dtype, the dtype its NumPy array travels as); bfloat16 has no NumPy dtype
# and travels as its raw 16-bit pattern
_DTYPES: Final[dict[str, tuple[torch.dtype, torch.dtype]]] = {
    "float64": (torch.float64, torch.float64),
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "int64": (torch.int64, torch.int64),
    "int32": (torch.int32, torch.int32),
    "int16": (torch.int16, torch.int16),
    "int8": (torch.int8, torch.int8),
    "uint8": (torch.uint8, torch.uint8),
    "bool": (torch.bool, torch.bool),
}
_NAME_OF: Final = {torch_dtype: name for name, (torch_dtype, _) in _DTYPES.items()}
_META_KEYS: Final = frozenset(f.name for f in dataclasses.fields(BatchMeta))


def to_wire(batch: TensorBatch) -> dict[str, Any]:
    """The batch as a dict of NumPy arrays and JSON text (tensors are moved to the CPU).

    Raises:
        BatchValidationError: an extra that is not a JSON value, or a field dtype with no wire form.
    """
    fields: dict[str, dict[str, Any]] = {}
    for name, t in batch.items():
        dname = _NAME_OF.get(t.dtype)
        if dname is None:
            raise BatchValidationError(
                f"field {name!r} has dtype {t.dtype}, which cannot cross a process boundary; "
                f"supported: {', '.join(_DTYPES)}"
            )
        data = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        fields[name] = {"dtype": dname, "data": data.numpy()}
    extras = {}
    for key, values in batch.extras.items():
        try:
            extras[key] = json.dumps(list(values), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise BatchValidationError(
                f"extra {key!r} cannot cross a process boundary: {e}. Only JSON values (str, int, "
                "float, bool, None, lists and dicts of them) travel between worker groups; convert "
                "it, or keep the extra in the controller"
            ) from None
    return {
        "format": WIRE_FORMAT,
        "batch_size": batch.batch_size,
        "meta": json.dumps(dataclasses.asdict(batch.meta)),
        "extras": extras,
        "fields": fields,
    }


def from_wire(wire: Any) -> TensorBatch:
    """Rebuild and validate a batch written by :func:`to_wire`.

    Raises:
        BatchValidationError: not a wire batch, an unknown dtype, an array that disagrees with its
            declared dtype, meta keys that BatchMeta does not have, or any schema violation the
            TensorBatch constructor finds (naming the field).
    """
    import numpy as np

    if not isinstance(wire, dict) or wire.get("format") != WIRE_FORMAT:
        raise BatchValidationError(
            f"received an object that is not a {WIRE_FORMAT} batch; both sides must run the same verl-core"
        )
    raw_fields = wire.get("fields")
    raw_extras = wire.get("extras")
    size = wire.get("batch_size")
    if not isinstance(raw_fields, dict) or not isinstance(raw_extras, dict) or not isinstance(size, int):
        raise BatchValidationError(f"received {WIRE_FORMAT} batch lacks fields, extras or batch_size")
    tensors: dict[str, torch.Tensor] = {}
    for name, item in raw_fields.items():
        if not isinstance(item, dict) or item.get("dtype") not in _DTYPES:
            raise BatchValidationError(
                f"received field {name!r} has no known dtype (got {item.get('dtype') if isinstance(item, dict) else item!r}); "
                f"expected one of {', '.join(_DTYPES)}"
            )
        torch_dtype, carrier = _DTYPES[item["dtype"]]
        data = item.get("data")
        if not isinstance(data, np.ndarray):
            raise BatchValidationError(f"received field {name!r} is a {type(data).__name__}, expected a NumPy array")
        # object store buffers are read-only: copy so engines may own their inputs
        t = torch.from_numpy(data if data.flags.writeable else data.copy())
        if t.dtype != carrier:
            raise BatchValidationError(
                f"received field {name!r} is declared {item['dtype']} but its array holds {t.dtype}"
            )
        tensors[name] = t.view(torch_dtype) if torch_dtype != carrier else t
    try:
        meta_dict = json.loads(wire["meta"])
        extras = {str(k): json.loads(v) for k, v in raw_extras.items()}
    except (TypeError, ValueError, KeyError) as e:
        raise BatchValidationError(f"received {WIRE_FORMAT} batch has unreadable meta or extras: {e}") from None
    if not isinstance(meta_dict, dict) or not set(meta_dict) <= _META_KEYS:
        raise BatchValidationError(
            f"received batch meta {meta_dict!r} has keys BatchMeta does not know; expected a subset of "
            f"{sorted(_META_KEYS)}"
        )
    return TensorBatch(tensors, extras, BatchMeta(**meta_dict), batch_size=size)


def register_batch_serializer() -> None:
    """Make Ray serialise TensorBatch with :func:`to_wire` / :func:`from_wire` in this process.

    Idempotent. Needs Ray (``pip install 'verl-core[ray]'``).
    """
    import ray.util

    ray.util.register_serializer(TensorBatch, serializer=to_wire, deserializer=from_wire)
