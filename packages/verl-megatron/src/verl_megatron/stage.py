"""What every part of the Megatron training engine shares: the model stage and its place in the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.convert import ModelDims, StateDictAdapter

__all__ = ["Stage"]


@dataclass(frozen=True)
class Stage:
    """This rank's model stage and its coordinates in the tensor, pipeline and data-parallel layout.

    Attributes:
        model: The megatron-core GPTModel stage of this rank.
        adapter: Megatron names, shapes, shards and transformers names of the model's tensors.
        dims: The model's dimensions.
        ps: megatron-core's ``parallel_state`` module (its process groups).
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        dp: Data-parallel size.
        tp_rank: This rank's tensor-parallel rank.
        pp_rank: This rank's pipeline stage.
        dp_rank: This rank's data-parallel rank.
        device: Where the stage computes.
        dtype: The parameters' dtype.
    """

    model: Any
    adapter: StateDictAdapter
    dims: ModelDims
    ps: Any
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    dtype: torch.dtype

    @property
    def last(self) -> bool:
        """This rank holds the last pipeline stage (the one that computes outputs and losses)."""
        return self.pp_rank == self.pp - 1

    def pp_last_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline."""
        ranks = dist.get_process_group_ranks(self.ps.get_pipeline_model_parallel_group())
        return int(ranks[-1])
