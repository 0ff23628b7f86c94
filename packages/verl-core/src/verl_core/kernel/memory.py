"""How many bytes a device has available: CUDA's free memory, or the host's ``MemAvailable``.

:func:`check_fits` refuses requests that cannot fit (TensorBatch ops call it before allocating);
the probes of the micro-batch scheduler build on it (:mod:`verl_core.trainer.batching.probes`).
"""

from __future__ import annotations

import os
from typing import Any, Final

import torch

from verl_core.kernel.errors import RequestTooLargeError

__all__ = ["available_memory", "check_fits", "device_memory"]

_PROBE_ABOVE: Final = 64 << 20
"""Allocations up to this many bytes are not checked against the available memory (a probe costs a
file read or a device query)."""


def device_memory(device: str | torch.device = "cpu") -> tuple[int, int]:
    """Available and total bytes of ``device``.

    ``torch.cuda.mem_get_info`` for a CUDA device when CUDA is available; otherwise the host's
    ``MemAvailable`` and ``MemTotal`` of /proc/meminfo (sysconf where it is absent).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(dev)
        return int(free), int(total)
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        size = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * size, os.sysconf("SC_PHYS_PAGES") * size


def available_memory(device: torch.device | str) -> int:
    """Bytes that can still be allocated on ``device``.

    On CUDA: the free device memory plus what PyTorch's caching allocator holds unused (it reuses
    that before asking the device). Elsewhere: the host's available memory (``MemAvailable``).
    """
    dev = torch.device(device)
    free = device_memory(dev)[0]
    if dev.type == "cuda" and torch.cuda.is_available():
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return free


def check_fits(
    nbytes: int, device: torch.device | str, what: str, *, available: int | None = None, group: Any = None
) -> None:
    """Refuse an allocation of ``nbytes`` that cannot fit in ``device``'s available memory.

    Args:
        nbytes: What the allocation needs (an estimate; callers pass a lower bound, so a refusal
            is never wrong).
        device: Where it would be allocated.
        what: The request and how the estimate was made, for the message.
        available: The available bytes (default: :func:`available_memory`, probed only when
            ``nbytes`` exceeds 64 MiB).
        group: A ``torch.distributed`` process group whose ranks must decide alike (ranks that
            run collectives together): the smallest available memory among them is used, so a
            refusal on one rank never leaves the others waiting in a collective. Every rank of
            the group must make the same call.

    Raises:
        RequestTooLargeError: the estimate exceeds the available memory; the message gives both.
    """
    if available is None:
        if nbytes <= _PROBE_ABOVE:
            return
        available = available_memory(device)
        if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            least = torch.tensor([available], dtype=torch.int64, device=device)
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN, group=group)
            available = int(least.item())
    if nbytes > available:
        raise RequestTooLargeError(
            f"{what} needs at least {_gib(nbytes)}, but only {_gib(available)} of {torch.device(device)} memory "
            "is available; refused before allocating anything. Make the request smaller"
        )


def _gib(nbytes: int) -> str:
    if nbytes.bit_length() > 64:
        return f"more than 2**64 bytes ({_short(nbytes)})"
    return f"{nbytes / 2**30:.3g} GiB ({nbytes} bytes)"


def _short(i: int) -> str:
    return str(i) if i.bit_length() <= 64 else f"<an integer of {i.bit_length()} bits>"
