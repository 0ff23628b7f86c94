"""Moving a training engine's parameters, gradients and optimizer state off its device and back."""

from __future__ import annotations

from typing import Any

import torch

from verl_hf.optim import HFOptimizer
from verl_hf.weight_export import WeightExport

__all__ = ["Offloader"]


class Offloader:
    """Offloads a model with its optimizer to the CPU and brings them back (no-ops on a CPU engine).

    Args:
        model: The transformers model.
        device: The engine's device.
        weights: The model's exported tensors (their one-buffer layout is rebuilt on return).
        optimizer: The model's optimizer (None for a frozen reference).
    """

    def __init__(self, model: Any, device: torch.device, weights: WeightExport, optimizer: HFOptimizer | None) -> None:
        self._model = model
        self._device = device
        self._weights = weights
        self._optimizer = optimizer
        self.offloaded = False

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to CPU (a no-op on CPU)."""
        if self._device.type == "cpu" or self.offloaded:
            self.offloaded = self._device.type != "cpu"
            return
        self.move(torch.device("cpu"))
        self.offloaded = True
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Move everything back to the engine's device."""
        if not self.offloaded:
            return
        self.move(self._device)
        self.offloaded = False

    def move(self, device: torch.device) -> None:
        """Move the model, masters and Adam's moments to ``device``."""
        # The weight buffer would keep the old device's memory alive once the parameters move; it
        # is rebuilt when they come back.
        self._weights.flat = None
        self._model.to(device)
        if self._optimizer is not None:
            self._optimizer.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if device == self._device:
            self._weights.rebuild_flat()
