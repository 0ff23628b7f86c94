"""Backend options of verl-megatron, validated from ``EngineSpec.options`` (imports no engine)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from verl_core.kernel.convert import Ge, check_fields
from verl_core.kernel.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_DECODE_WINDOW", "MegatronOptions"]

DEFAULT_DECODE_WINDOW = 256
"""Smallest attention window of a static decode step on CUDA (``MegatronOptions.rollout_decode_window``)."""


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
            then one token per step); False recomputes the whole sequence at every step. Applies
            when the static cache below is off.
        rollout_static_cache: The rollout engine decodes with its own preallocated KV cache and
            device-side positions instead of Megatron's inference context
            (:mod:`verl_megatron.static_decode`): every step has one shape and no host
            synchronisation. Needs ``attention="sdpa"``. None (default): on for CUDA rollouts
            with sdpa attention, off elsewhere (see :meth:`resolve_rollout`).
        rollout_cuda_graphs: Capture that decode step in a CUDA graph and replay it; needs
            the static cache, a CUDA device and tp=1. None (default): on wherever the static
            cache is used on CUDA with tp=1.
        rollout_compile: Run that decode step's model forward and its sampling through
            ``torch.compile`` (inductor fuses the per-token elementwise work: norms, rotary
            embeddings, activations, the sampling's softmax and CDF scans); needs the static
            cache. Where compiling fails the step runs uncompiled after one warning
            (``decode_mode`` names the error). Compiled on the first ``generate``, specialised to
            its shape; the first ``generate`` whose rows (or prompt width) differ compiles once
            more with that size symbolic, and later shapes reuse those graphs; combines with
            ``rollout_cuda_graphs``. None (default): on wherever the static cache is used on CUDA.
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
        rollout_decode_window: Smallest attention window (cache slots) of a static-cache decode
            step: each step attends over the smallest of ``w, 2w, 3w, ...`` and the whole cache
            that holds every slot written so far, and the prefill over the prompt's slots only
            (:func:`verl_core.enginekit.sampling.cache_windows`); each window is its own CUDA
            graph, and a compiled step compiles once for the windows below the whole cache and once
            for the whole cache. 0 reads the whole cache at every step. None (default): 256
            where the static cache is used on CUDA, 0 elsewhere.
        rollout_decode_kernel: Run each static decode step's attention through the fused Triton
            kernel (:func:`verl_core.enginekit.decode_attention.grouped_decode_attention`, the hf
            rollout's: keys and values read once per group, no block past the last attended slot
            read, and a finished row's cache skipped) instead of two matrix products around a
            softmax. None (default): on where it can run (CUDA, bfloat16, Triton installed);
            True: on, refused with the reason where it cannot run; False: off.
        pack_sequences: Run the training engine's micro-batches (``forward`` and
            ``forward_backward``) without padding: the real tokens of a micro-batch are laid end to
            end in one row (megatron-core's ``thd`` format, ``PackedSeqParams``), rotary positions
            restart at 0 for each sequence and attention never crosses sequences
            (``torch.nn.attention.varlen.varlen_attn``, a CUDA flash kernel, in bfloat16/float16;
            elsewhere an exact per-sequence SDPA loop; :mod:`verl_core.enginekit.packed_attention`). The outputs
            equal the padded path's up to float rounding. Needs ``attention="sdpa"`` and pipeline
            parallel size 1 (tensor and data parallelism are fine). None (default): off for now,
            since this engine's packed path has run on CPU only (float32, the per-sequence loop; its
            CUDA kernel is the hf engine's, but not yet run here); True turns it on (a ConfigError
            naming what does not qualify); False keeps padded micro-batches. A
            packing engine declares ``capabilities.packed_sequences`` and its micro-batch token
            budget counts real tokens (the sum of the sequences' lengths, not size x longest).
    """

    attention: Literal["sdpa", "local"] = "sdpa"
    export_ranks: Literal["all", "first"] = "all"
    during_rollout: Literal["keep", "offload"] = "keep"
    rollout_kv_cache: bool = True
    rollout_static_cache: bool | None = None
    rollout_cuda_graphs: bool | None = None
    rollout_compile: bool | None = None
    master_weights: bool = True
    optimizer: Literal["torch", "megatron"] = "torch"
    distributed_optimizer: bool = False
    rollout_decode_window: Annotated[int, Ge(0)] | None = None
    rollout_decode_kernel: bool | None = None
    pack_sequences: bool | None = None

    def __post_init__(self) -> None:
        check_fields(self, prefix="megatron.", label="option")  # types and choices, from the fields
        static_off = self.rollout_static_cache is False or (
            self.rollout_static_cache is None and self.attention != "sdpa")
        if self.rollout_cuda_graphs and static_off:
            raise ConfigError(
                "megatron option rollout_cuda_graphs needs rollout_static_cache=True (a graph replays one shape)"
            )
        if self.rollout_compile and static_off:
            raise ConfigError(
                "megatron option rollout_compile compiles the static decode step; set rollout_static_cache=True as well"
            )
        if self.rollout_decode_window and static_off:
            raise ConfigError(
                "megatron option rollout_decode_window sets the attention windows of the static decode step; set "
                "rollout_static_cache=True as well (or leave rollout_decode_window unset)"
            )
        if self.rollout_decode_kernel and static_off:
            raise ConfigError(
                "megatron option rollout_decode_kernel is the static decode step's attention; set "
                "rollout_static_cache=True as well (or leave rollout_decode_kernel unset)"
            )
        if self.rollout_static_cache and self.attention != "sdpa":
            raise ConfigError("megatron option rollout_static_cache needs attention='sdpa'")
        if self.pack_sequences and self.attention != "sdpa":
            raise ConfigError(
                "megatron option pack_sequences=True needs attention='sdpa' (megatron-core's DotProductAttention "
                "takes no packed sequences without TransformerEngine); set attention='sdpa' or pack_sequences=False"
            )
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

    def resolve_rollout(self, device: torch.device, *, tp: int = 1,
                        dtype: torch.dtype | None = None) -> MegatronOptions:
        """These options with the rollout's ``None`` (automatic) choices made for ``device`` and the
        rollout's ``dtype`` (None: float32).

        On CUDA the fast decode path is the default, as for the hf rollout: the engine's static
        cache (with sdpa attention), ``torch.compile`` of its decode step, CUDA graphs (at tp=1),
        attention over cache windows, and in bfloat16 the fused decode-attention kernel; each can be
        turned off by setting it. Elsewhere Megatron's own KV cache, without graphs or compilation,
        unless a fast-path option is set (it then asks for the static cache too).

        Raises:
            ConfigError: ``rollout_decode_kernel=True`` where the kernel cannot run.
        """
        import torch

        from verl_core.enginekit.decode_attention import resolve_decode_kernel

        cuda = device.type == "cuda"
        static = self.rollout_static_cache
        if static is None:
            wanted = (cuda or bool(self.rollout_compile) or bool(self.rollout_cuda_graphs)
                      or bool(self.rollout_decode_window) or bool(self.rollout_decode_kernel))
            static = wanted and self.attention == "sdpa"
        fast = cuda and static
        graphs = self.rollout_cuda_graphs if self.rollout_cuda_graphs is not None else fast and tp == 1
        compiled = self.rollout_compile if self.rollout_compile is not None else fast
        window = self.rollout_decode_window
        if window is None or not static:
            window = DEFAULT_DECODE_WINDOW if fast and window is None else 0
        kernel = bool(static) and resolve_decode_kernel(self.rollout_decode_kernel, device, dtype or torch.float32,
                                                        "megatron option rollout_decode_kernel")
        return dataclasses.replace(self, rollout_static_cache=static, rollout_cuda_graphs=graphs,
                                   rollout_compile=compiled, rollout_decode_window=window,
                                   rollout_decode_kernel=kernel)
