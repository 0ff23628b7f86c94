"""HFOptions: the ``hf`` backend's options, validated from ``EngineSpec.options``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from verl_core.kernel.convert import Ge, check_fields
from verl_core.kernel.errors import ConfigError

__all__ = ["DEFAULT_DECODE_WINDOW", "HFOptions"]

DEFAULT_DECODE_WINDOW = 256
"""Smallest attention window of a static decode step on CUDA (``HFOptions.rollout_decode_window``)."""

DataParallelMode = Literal["auto", "fsdp2", "allreduce"]
"""How gradients are reduced over data-parallel ranks (see :class:`HFOptions`)."""


@dataclass(frozen=True)
class HFOptions:
    """Options of the ``hf`` backend (``EngineSpec.options``).

    One class for every role: a role ignores the options it does not read (the training engines
    the ``rollout_*`` ones, the rollout the training ones such as ``master_weights``).

    Attributes:
        attn_implementation: transformers attention kernel: ``sdpa`` (default) or ``eager``.
        data_parallel: ``fsdp2`` shards parameters, gradients and optimizer state with
            ``torch.distributed.fsdp.fully_shard``; ``allreduce`` keeps a full replica per rank and
            sums gradients with one all-reduce per bucket before the optimizer step; ``auto`` picks
            ``fsdp2`` on CUDA and ``allreduce`` on CPU.
        allreduce_bucket_bytes: Bytes per gradient all-reduce bucket in ``allreduce`` mode.
        forward_micro_batch_tokens: Token budget of the no-grad ``forward`` micro-batches (None
            uses the spec's training budget or size).
        rollout_batch_size: Most sequences one ``generate`` step decodes together (None = all).
        rollout_cache: KV cache of the rollout decode loop: ``dynamic`` grows transformers'
            DynamicCache step by step; ``static`` preallocates a StaticCache of prompt + max new
            tokens and keeps every decode step at one shape (the same samples up to float rounding);
            ``auto`` (default) is ``static`` on a CUDA device for full-attention models and
            ``dynamic`` elsewhere (see :meth:`resolve_rollout`).
        rollout_cuda_graphs: Capture the decode step (forward, sampling, bookkeeping) in a CUDA
            graph and replay it; needs ``rollout_cache='static'`` and a CUDA device. None
            (default): on wherever the static cache is used on CUDA.
        rollout_compile: Run the static decode step's model forward and its sampling through
            ``torch.compile`` (inductor fuses the per-token elementwise work: norms, rotary
            embeddings, activations, and the sampling's softmax and CDF scans:
            :class:`~verl_core.enginekit.sampling.TokenSampler`); needs ``rollout_cache='static'``.
            Where compiling fails the step runs uncompiled after one warning (``decode_mode``
            names the error). Compiled on the first ``generate``, specialised to its shape; the
            first ``generate`` whose rows (or prompt width) differ compiles once more with that
            size symbolic, and later shapes reuse those graphs
            (:class:`~verl_core.enginekit.sampling.CompiledOrEager`; inductor's on-disk cache
            makes later runs' compiles shorter); combines with
            ``rollout_cuda_graphs``. None (default): on wherever the
            static cache is used on CUDA.
        rollout_fused_projections: Run each layer's q/k/v projections as one matmul and its
            gate/up projections as another in the rollout, where their weights lie back to back
            in the engine's weight buffer and carry no bias (llama-style layers); the fused
            weight is a view of the three (or two), so weight syncs need nothing more. The same
            outputs up to float rounding (one matrix product instead of several). None (default):
            on for CUDA rollouts, where a decode step's small matmuls are bound by launches and
            reading the input; True also elsewhere; False keeps one matmul per projection.
        master_weights: With a bfloat16 spec, let the optimizer update float32 master copies
            of the parameters and round them into the model after each step
            (:class:`verl_core.enginekit.precision.MasterWeights`), so updates smaller than bfloat16's
            spacing accumulate instead of being rounded away. False trains in pure bfloat16.
            Not applied under ``fsdp2`` data parallelism (pure bfloat16 there).
        pack_sequences: Run training micro-batches (``forward`` and ``forward_backward``)
            without padding: the real tokens of a micro-batch are laid end to end in one row,
            positions restart at 0 for each sequence, and attention never crosses sequences
            (``torch.nn.attention.varlen.varlen_attn``, a CUDA flash kernel; on CPU or in float32
            an exact per-sequence SDPA loop). Only the tokens before response tokens go through
            the LM head. The outputs equal the padded path's (up to float rounding). Needs a
            llama, mistral, qwen2 or qwen3 model with sdpa and full attention in every layer.
            None (default): on for CUDA engines in bfloat16 where ``varlen_attn`` exists and the
            model qualifies; True forces it (a ConfigError where the model does not qualify);
            False keeps padded micro-batches. A packing engine declares
            ``capabilities.packed_sequences`` and its micro-batch token budget counts real tokens
            (the sum of the sequences' lengths, not size x longest), so a packed micro-batch holds
            more sequences of a ragged batch under the same budget. The megatron backend has
            its own ``pack_sequences`` option (megatron-core's ``thd`` format, the same attention:
            :mod:`verl_core.enginekit.packed_attention`).
        rollout_decode_window: Smallest attention window (cache slots) of a static-cache decode
            step. Each step attends over the smallest of ``w, 2w, 3w, ...`` and the whole cache
            that holds every slot written so far (the step grows past ``w`` to keep a decode to 16
            windows: :func:`verl_core.enginekit.sampling.cache_windows`), instead of the whole
            preallocated cache (prompt plus ``max_new_tokens``), and the prefill over the prompt's
            slots only (its grouped key/value heads repeated over those slots, not the whole cache).
            Each window is its own CUDA graph; a compiled step compiles once for the windows below
            the whole cache and once for the whole cache. The same samples up to float rounding. 0 reads the whole
            cache at every step. Needs ``attn_implementation='sdpa'`` (the rollout then runs
            :func:`verl_hf.modeling.grouped_decode_sdpa`, also off CUDA). None (default): 256 for
            static-cache rollouts on CUDA with sdpa, 0 elsewhere.
        rollout_decode_kernel: Run each decode step's attention through the fused Triton kernel
            (:func:`verl_core.enginekit.decode_attention.grouped_decode_attention`: flash decoding,
            each written key and value read once, a float32 online softmax, slots not yet written
            not read) instead of two matrix products around a softmax. The same samples up to float
            rounding. None (default): on where it can run (``attn_implementation='sdpa'``, a CUDA
            device, a bfloat16 rollout and Triton, which comes with PyTorch's CUDA wheels), off
            elsewhere; True asks for it (a ConfigError where it cannot run); False keeps the matrix
            products. On an H100 at 0.89B x 128 rows x 2048 new tokens the default decode (windows and
            this kernel) runs 1.77x the tokens/s of the whole-cache matrix-product decode, 0.70 of the
            bandwidth bound (``benchmarks/gpu/bench_decode_long.py``,
            benchmarks/results/gpu-2026-12-06-kernel.md).
        fused_elementwise: In the training and rollout engines, run each RMSNorm and each
            SiLU-gated MLP's ``silu(gate) * up`` through one ``torch.compile``d function each
            (inductor fuses each chain of element-wise kernels into one kernel forward and one
            backward: :mod:`verl_hf.fused_elementwise`), for the llama, mistral, qwen2 and qwen3 families;
            other modules keep their forward. transformers' arithmetic in the same dtypes, up to
            the order of the float32 mean's additions. None (default): on for CUDA engines in
            bfloat16, where those chains took about half of ``forward_backward``'s kernel time
            (0.89B x 18k tokens on an H100); True also elsewhere (on CPU inductor compiles C++,
            slowly); False keeps transformers' modules. The first micro-batch of each kind
            (with and without gradients) compiles. In the rollout it fuses the prefill's chains
            (the prefill runs the model uncompiled); a compiled decode step traces the same
            functions inline.
        compile_layers: In the training engines, ``torch.compile`` each decoder layer whole
            (:func:`verl_hf.fused_elementwise.compile_decoder_layers`), so inductor also fuses the
            rotary embedding, residual adds and casts around the projections, forward and backward.
            None (default): on for one-process CUDA engines in bfloat16 (data-parallel ranks keep
            eager layers unless asked: not measured there; one ``forward_backward`` of 0.89B x
            18k packed tokens on an H100: 0.177 s against 0.210 s with ``fused_elementwise``
            alone, benchmarks/gpu/profile_update.py ``--compile-layers``); True also elsewhere
            (on CPU inductor compiles C++, slowly); False runs the layers eagerly. The first
            micro-batch of each kind (with and without gradients) compiles.
        rollout_sleep_keeps_weights: Keep the rollout's weights through the trainer's sleep
            (``sleep_until_sync``: copied to pinned host memory and back, as ``sleep()`` does)
            instead of dropping them and taking them from the weight sync that follows the wake.
            False (default) drops them on CUDA: no host round trip (two copies of the weights
            over PCIe a step), the same weights served after the sync.
    """

    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    data_parallel: DataParallelMode = "auto"
    allreduce_bucket_bytes: Annotated[int, Ge(1)] = 64 * 1024 * 1024
    forward_micro_batch_tokens: Annotated[int, Ge(1)] | None = None
    rollout_batch_size: Annotated[int, Ge(1)] | None = None
    rollout_cache: Literal["auto", "dynamic", "static"] = "auto"
    rollout_cuda_graphs: bool | None = None
    rollout_compile: bool | None = None
    rollout_fused_projections: bool | None = None
    master_weights: bool = True
    pack_sequences: bool | None = None
    rollout_decode_window: Annotated[int, Ge(0)] | None = None
    rollout_decode_kernel: bool | None = None
    rollout_sleep_keeps_weights: bool = False
    fused_elementwise: bool | None = None
    compile_layers: bool | None = None

    def __post_init__(self) -> None:
        check_fields(self, prefix="HFOptions.", label="option")  # types, choices and bounds, from the fields
        if self.rollout_compile and self.rollout_cache == "dynamic":
            raise ConfigError(
                "HFOptions.rollout_compile compiles the static decode step; set rollout_cache='static' as well"
            )
        if self.rollout_cuda_graphs and self.rollout_cache == "dynamic":
            raise ConfigError(
                "HFOptions.rollout_cuda_graphs needs a static KV cache (a graph replays fixed shapes); "
                "set rollout_cache='static' as well"
            )
        if self.rollout_decode_window and self.rollout_cache == "dynamic":
            raise ConfigError(
                "HFOptions.rollout_decode_window sets the attention windows of the static decode step; set "
                "rollout_cache='static' as well (or leave rollout_decode_window unset)"
            )
        if self.rollout_decode_window and self.attn_implementation != "sdpa":
            raise ConfigError(
                f"HFOptions.rollout_decode_window needs attn_implementation='sdpa' (its attention reads the "
                f"window's slots only), got {self.attn_implementation!r}; set rollout_decode_window=0 for eager attention"
            )
        if self.rollout_decode_kernel and self.attn_implementation != "sdpa":
            raise ConfigError(
                f"HFOptions.rollout_decode_kernel replaces sdpa's decode-step attention, but attn_implementation is "
                f"{self.attn_implementation!r}; set attn_implementation='sdpa' or rollout_decode_kernel=False"
            )
        if self.pack_sequences and self.attn_implementation != "sdpa":
            raise ConfigError(
                f"HFOptions.pack_sequences=True runs sdpa-based packed attention, but attn_implementation is "
                f"{self.attn_implementation!r}; set attn_implementation='sdpa' or pack_sequences=False"
            )

    def fused_decode(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a rollout on ``device`` in ``dtype`` runs the fused decode-attention kernel
        (``rollout_decode_kernel``): None decides from where it can run, True refuses where it cannot
        (:func:`verl_core.enginekit.decode_attention.resolve_decode_kernel`)."""
        from verl_core.enginekit.decode_attention import resolve_decode_kernel

        if self.rollout_decode_kernel is None and self.attn_implementation != "sdpa":
            return False  # the kernel replaces sdpa's decode step (True with another attention is refused)
        return resolve_decode_kernel(self.rollout_decode_kernel, device, dtype, "HFOptions.rollout_decode_kernel")

    def fuses_elementwise(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether an engine on ``device`` in ``dtype`` routes its norms and gated activations through
        compiled functions (``fused_elementwise``; None: on CUDA in bfloat16)."""
        if self.fused_elementwise is not None:
            return self.fused_elementwise
        return device.type == "cuda" and dtype == torch.bfloat16

    def resolve_rollout(self, device: torch.device, *, static_ok: bool = True) -> HFOptions:
        """These options with the rollout's ``auto`` choices made for ``device``.

        On CUDA the fast decode path is the default: a static KV cache, CUDA graphs,
        ``torch.compile`` of the decode step and attention over cache windows (each can be turned
        off by setting it). Elsewhere, and for models the static cache does not support
        (``static_ok=False``: sliding-window layers), the dynamic cache without graphs or compilation.
        """
        cuda = device.type == "cuda"
        cache = self.rollout_cache
        if cache == "auto":
            wanted = (cuda or bool(self.rollout_compile) or bool(self.rollout_cuda_graphs)
                      or bool(self.rollout_decode_window))
            cache = "static" if wanted and static_ok else "dynamic"
        fast = cuda and cache == "static"
        graphs = self.rollout_cuda_graphs if self.rollout_cuda_graphs is not None else fast
        compiled = self.rollout_compile if self.rollout_compile is not None else fast
        fused = self.rollout_fused_projections if self.rollout_fused_projections is not None else cuda
        window = self.rollout_decode_window
        if window is None or cache != "static":
            window = DEFAULT_DECODE_WINDOW if fast and self.attn_implementation == "sdpa" and window is None else 0
        return dataclasses.replace(self, rollout_cache=cache, rollout_cuda_graphs=graphs, rollout_compile=compiled,
                                   rollout_fused_projections=fused, rollout_decode_window=window)
