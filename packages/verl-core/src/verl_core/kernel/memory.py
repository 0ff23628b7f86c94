"""Memory probes: how many bytes a device has free (host memory, or CUDA's ``mem_get_info``).

Used by the micro-batch scheduler to pick budgets and by :func:`verl_core.kernel.batch.check_fits`
to refuse requests that cannot fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * 1024
        return MemoryInfo(fields["MemAvailable"], fields["MemTotal"])
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return MemoryInfo(avail * size, pages * size)


def cuda_memory_probe(device: str | torch.device = "cuda") -> MemoryProbe:
    """A probe reading ``torch.cuda.mem_get_info`` of ``device``."""

    def probe() -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return MemoryInfo(int(free), int(total))

    return probe


def default_memory_probe(device: str | torch.device = "cpu") -> MemoryProbe:
    """The CUDA probe for a CUDA device when CUDA is available, else the host-memory probe."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return cuda_memory_probe(dev)
    return host_memory_probe
