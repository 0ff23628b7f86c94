"""Measuring the peak of memory a call allocates beyond what was allocated when it started.

On a CUDA device this is the caching allocator's own statistics (``max_memory_allocated``): every
allocation on the device, collectives' buffers included.

On the CPU torch keeps no allocator statistics, so the call runs under a dispatcher mode that
sees every tensor an operator creates on the calling thread: each new storage (one that shares
memory with none of the operator's inputs, so views and in-place results do not count) adds its
bytes while it is alive, and a finalizer on the storage subtracts them when it is freed, from
whichever thread drops the last reference (collectives hand tensors to worker threads). What it
does not see: scratch memory a collective allocates inside its own worker threads, and Python
objects. It counts tensor bytes, not the process's resident size.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorBytesTracker", "peak_extra_bytes"]

T = TypeVar("T")


class TensorBytesTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatcher mode counting the bytes of the CPU tensor storages created under it while alive.

    Attributes:
        alive: Bytes of tracked storages alive now.
        peak: Largest value ``alive`` reached.
        created: Bytes of all storages created (alive or not).
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.alive = 0
        self.peak = 0
        self.created = 0
        self._lock = threading.Lock()
        self._tracked: set[int] = set()

    def _freed(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._tracked.discard(ptr)
            self.alive -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == self.device_type}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            nbytes, ptr = storage.nbytes(), storage.data_ptr()
            if nbytes == 0 or ptr in inputs:
                continue
            with self._lock:
                if ptr in self._tracked:  # already counted (an op handing back a tracked tensor)
                    continue
                self._tracked.add(ptr)
                self.alive += nbytes
                self.created += nbytes
                self.peak = max(self.peak, self.alive)
            weakref.finalize(storage, self._freed, ptr, nbytes)
        return out


def peak_extra_bytes(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, int]:
    """Run ``fn`` and return its result and the peak of bytes it had allocated on ``device`` at once.

    Memory allocated before the call (model weights, optimizer state) is not counted; memory the
    call allocates and frees again counts while it is alive. See the module docstring for what the
    CPU measurement sees.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        return out, max(0, torch.cuda.max_memory_allocated(dev) - base)
    with TensorBytesTracker(dev.type) as tracker:
        out = fn()
    return out, tracker.peak
