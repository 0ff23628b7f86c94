"""How many bytes a device has available: CUDA's free memory, or the host's ``MemAvailable``.

Read by :func:`verl_core.kernel.batch.check_fits` to refuse requests that cannot fit; the probes of
the micro-batch scheduler build on it (:mod:`verl_core.trainer.memory`).
"""

from __future__ import annotations

import os

import torch

__all__ = ["device_memory"]


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
