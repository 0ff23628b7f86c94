"""Faulty engines built on the ``megatron`` backend (megatron-core on gloo) for the suite's meta-tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from verl_core import EngineSpec
from verl_megatron.training import MegatronTrainingEngine

__all__ = ["QKNormGradsNotSummedOverTP"]


class QKNormGradsNotSummedOverTP(MegatronTrainingEngine):
    """The megatron training engine without the tensor-parallel sum of Qwen3's q/k-norm gradients.

    The q_layernorm / k_layernorm weights are replicated on every tp rank but each rank applies them
    to its own heads only, so each rank's gradient is a partial sum. This engine syncs the gradients
    as if the model had no q/k norms: every other reduction (data-parallel, tied embeddings under
    pp) is the real engine's. With tp = 1, or on a folder without q/k norms, it is the real engine.
    """

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        loop = self._loop
        sync = loop._sync_grads

        def sync_without_qk_norm_sum(opt: Any) -> None:
            stage = loop._s
            loop._s = replace(stage, dims=replace(stage.dims, qk_norm=False))
            try:
                sync(opt)
            finally:
                loop._s = stage

        loop._sync_grads = sync_without_qk_norm_sum  # type: ignore[method-assign]
