"""Memory probes of the micro-batch scheduler: the memory a device has free now, and a call's peak.

A probe is a plain function, so tests and tutorials inject their own (a fixed :class:`MemoryInfo`).
The reading itself is :func:`verl_core.kernel.memory.device_memory`. A :class:`PeakProbe` runs a
call and reports the allocator's peak during it (:func:`cuda_peak_probe`); the scheduler reads one
after its first training call to correct its bytes-per-token estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from verl_core.kernel.memory import available_memory, device_memory

__all__ = [
    "MemoryInfo",
    "MemoryProbe",
    "PeakProbe",
    "PeakReading",
    "cuda_memory_probe",
    "cuda_peak_probe",
    "default_memory_probe",
    "default_peak_probe",
    "host_memory_probe",
]

T = TypeVar("T")


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
    """A probe of ``device``: ``torch.cuda.mem_get_info``'s free memory plus what PyTorch's caching
    allocator holds unused (it reuses those blocks before asking the device:
    :func:`~verl_core.kernel.memory.available_memory`). Engines that re-home their weights (one
    buffer per engine) leave the old storage cached, which the device alone reports as used."""
    return lambda: MemoryInfo(available_memory(device), device_memory(device)[1])


def default_memory_probe(device: str | torch.device = "cpu") -> MemoryProbe:
    """The CUDA probe for a CUDA device when CUDA is available, else the host-memory probe."""
    dev = torch.device(device)
    return cuda_memory_probe(dev) if dev.type == "cuda" and torch.cuda.is_available() else host_memory_probe


@dataclass(frozen=True)
class PeakReading:
    """Bytes the device's allocator held around one call.

    Attributes:
        before: Allocated when the call started.
        peak: Most allocated at any time during the call.
        after: Allocated when it returned (``after - before`` stays: gradients, optimizer state).
    """

    before: int
    peak: int
    after: int

    @property
    def transient(self) -> int:
        """What the call needed above what it started and ended with: its activations at the peak."""
        return max(0, self.peak - max(self.before, self.after))


class PeakProbe(Protocol):
    """Runs a call and reads the allocator's peak during it (None: nothing readable, e.g. on the CPU)."""

    def __call__(self, fn: Callable[[], T]) -> tuple[T, PeakReading | None]: ...


def cuda_peak_probe(device: str | torch.device = "cuda") -> PeakProbe:
    """A probe of ``torch.cuda.max_memory_allocated`` on ``device`` (its peak statistics are reset first).

    It reads None when this process allocated nothing there (engines placed in other processes).
    """
    dev = torch.device(device)

    def measure(fn: Callable[[], T]) -> tuple[T, PeakReading | None]:
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # nothing allocated here
            return fn(), None
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result = fn()
        torch.cuda.synchronize(dev)
        peak, after = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
        return result, (PeakReading(before, peak, after) if peak > before else None)

    return measure


def default_peak_probe(device: str | torch.device = "cpu") -> PeakProbe | None:
    """The CUDA peak probe for a CUDA device when CUDA is available, else None.

    The host has no allocator statistics to read, so a CPU run keeps its estimate.
    """
    dev = torch.device(device)
    return cuda_peak_probe(dev) if dev.type == "cuda" and torch.cuda.is_available() else None
