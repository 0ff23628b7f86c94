"""Memory probes of the micro-batch scheduler: the memory a device has free now.

A probe is a plain function, so tests and tutorials inject their own (a fixed :class:`MemoryInfo`).
The reading itself is :func:`verl_core.kernel.memory.device_memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl_core.kernel.memory import device_memory

__all__ = ["MemoryInfo", "MemoryProbe", "cuda_memory_probe", "default_memory_probe", "host_memory_probe"]


@dataclass(frozen=True)
class MemoryInfo:
    """Free and total bytes of the device that runs the micro-batches."""

    free_bytes: int
    total_bytes: int


MemoryProbe = Callable[[], MemoryInfo]
"""A function reporting the memory available now."""


def host_memory_probe() -> MemoryInfo:
    """Host memory: ``MemAvailable`` and ``MemTotal`` of /proc/meminfo (sysconf where it is absent)."""
    return MemoryInfo(*device_memory("cpu"))


def cuda_memory_probe(device: str | torch.device = "cuda") -> MemoryProbe:
    """A probe reading ``torch.cuda.mem_get_info`` of ``device``."""
    return lambda: MemoryInfo(*device_memory(device))


def default_memory_probe(device: str | torch.device = "cpu") -> MemoryProbe:
    """The CUDA probe for a CUDA device when CUDA is available, else the host-memory probe."""
    dev = torch.device(device)
    return cuda_memory_probe(dev) if dev.type == "cuda" and torch.cuda.is_available() else host_memory_probe
