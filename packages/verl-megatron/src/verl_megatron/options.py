"""Backend options of verl-megatron, validated from ``EngineSpec.options`` (imports no engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from verl_core.kernel.convert import check_fields
from verl_core.kernel.errors import ConfigError

__all__ = ["MegatronOptions"]


@dataclass(frozen=True)
class MegatronOptions:
    """Options of the ``megatron`` backend (``EngineSpec.options``).

    Attributes:
        attention: Core attention of the layer spec: ``sdpa`` (torch's scaled_dot_product_attention,
            causal; flash attention on GPUs without TransformerEngine) or ``local`` (megatron-core's
            own DotProductAttention, the reference implementation).
        export_ranks: Which ranks receive the gathered weights of ``export_weights``: ``all``
            (every rank yields the full stream; each must consume it) or ``first`` (global rank 0
            yields the stream, the others only take part in the gathers and yield nothing but the
            manifest and the commit).
        during_rollout: What an actor's optimizer state and gradients do while a colocated rollout
            runs (applied by the direct weight sync, undone by the next training call): ``keep``
            them in place or ``offload`` them to CPU memory (on a CPU-only machine the move is a
            no-op that is still performed and timed).
        rollout_kv_cache: The rollout engine decodes with Megatron's static KV cache (one prefill,
            then one token per step); False recomputes the whole sequence at every step.
        rollout_static_cache: The rollout engine decodes with its own preallocated KV cache and
            device-side positions instead of Megatron's inference context
            (:mod:`verl_megatron.static_decode`): every step has one shape and no host
            synchronisation. Needs ``attention="sdpa"``.
        rollout_cuda_graphs: Capture that decode step in a CUDA graph and replay it; needs
            ``rollout_static_cache=True``, a CUDA device and tp=1.
        rollout_compile: Run that decode step's model forward through ``torch.compile``
            (inductor fuses the per-token elementwise work: norms, rotary embeddings,
            activations); needs ``rollout_static_cache=True``. Compiled on the first ``generate``
            of each shape; combines with ``rollout_cuda_graphs``.
        master_weights: With a bfloat16 spec, let the optimizer update float32 master copies
            of the parameters and round them into the model after each step
            (:class:`verl_core.enginekit.precision.MasterWeights`), so updates smaller than bfloat16's
            spacing accumulate instead of being rounded away. False trains in pure bfloat16.
            No effect in float32.
        optimizer: Which optimizer steps an actor or critic: ``torch`` (torch's AdamW over the
            parameters or their float32 masters; data-parallel gradients all-reduced by the
            engine) or ``megatron`` (megatron-core's own: ``get_megatron_optimizer`` over the stage
            wrapped in megatron's DistributedDataParallel, gradients in its float32 buffers,
            float32 main parameters under bfloat16; see :mod:`verl_megatron.core_optimizer`).
            ``megatron`` needs ``master_weights=True`` and ``during_rollout="keep"``, and a
            float32 or bfloat16 spec.
        distributed_optimizer: With ``optimizer="megatron"``, megatron's distributed optimizer:
            each data-parallel rank keeps the main parameters and Adam moments of its shard only.
    """

    attention: Literal["sdpa", "local"] = "sdpa"
    export_ranks: Literal["all", "first"] = "all"
    during_rollout: Literal["keep", "offload"] = "keep"
    rollout_kv_cache: bool = True
    rollout_static_cache: bool = False
    rollout_cuda_graphs: bool = False
    rollout_compile: bool = False
    master_weights: bool = True
    optimizer: Literal["torch", "megatron"] = "torch"
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        check_fields(self, prefix="megatron.", label="option")  # types and choices, from the fields
        if self.rollout_cuda_graphs and not self.rollout_static_cache:
            raise ConfigError(
                "megatron option rollout_cuda_graphs needs rollout_static_cache=True (a graph replays one shape)"
            )
        if self.rollout_compile and not self.rollout_static_cache:
            raise ConfigError(
                "megatron option rollout_compile compiles the static decode step; set rollout_static_cache=True as well"
            )
        if self.rollout_static_cache and self.attention != "sdpa":
            raise ConfigError("megatron option rollout_static_cache needs attention='sdpa'")
        if self.distributed_optimizer and self.optimizer != "megatron":
            raise ConfigError("megatron option distributed_optimizer=True needs optimizer='megatron'")
        if self.optimizer == "megatron" and self.during_rollout == "offload":
            raise ConfigError(
                "megatron option during_rollout='offload' is not supported with optimizer='megatron' "
                "(megatron-core's optimizer state and gradient buffers are not moved); use "
                "during_rollout='keep' or optimizer='torch'"
            )
        if self.optimizer == "megatron" and not self.master_weights:
            raise ConfigError(
                "megatron option master_weights=False is not supported with optimizer='megatron' "
                "(megatron-core's optimizer always steps float32 main parameters); use optimizer='torch'"
            )
