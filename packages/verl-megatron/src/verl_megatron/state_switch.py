"""Switching a colocated Megatron training engine's optimizer state and gradients off the device and back."""

from __future__ import annotations

import time

import torch

from verl_core import ConfigError
from verl_megatron.stage_optimizer import StageOptimizer

__all__ = ["TrainingStateSwitch"]


class TrainingStateSwitch:
    """Moves optimizer state and pending gradients to CPU memory while a colocated rollout runs.

    Args:
        optimizer: The stage's optimizer (None for a frozen reference: nothing to move).
        device: The engine's device.
    """

    def __init__(self, optimizer: StageOptimizer | None, device: torch.device) -> None:
        self._opt = optimizer
        self._device = device
        self.offloaded = False
        self.offload_s = 0.0  # time of the last switch to rollout, reported with the switch back

    def _move(self, device: torch.device) -> int:
        moved = self._opt.move_state(device) if self._opt is not None else 0
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return moved

    def offload(self) -> float:
        """Move the state to CPU memory; returns the seconds the switch took."""
        if self._opt is not None and self._opt.core is not None:
            raise ConfigError(
                "offload_training_state is not supported with the megatron option optimizer='megatron'; "
                "sync with during_rollout='keep' or use optimizer='torch'"
            )
        t0 = time.perf_counter()
        if not self.offloaded:
            self._move(torch.device("cpu"))
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            self.offloaded = True
        self.offload_s = time.perf_counter() - t0
        return self.offload_s

    def onload(self) -> float:
        """Move the state back to the device; returns the seconds the switch took."""
        t0 = time.perf_counter()
        if self.offloaded:
            self._move(self._device)
            self.offloaded = False
        return time.perf_counter() - t0

    def ensure_onloaded(self) -> float | None:
        """Switch back to training if the state is offloaded; the seconds it took, or None."""
        if not self.offloaded:
            return None
        return self.onload()
