"""The Megatron RolloutEngine: sampling on a megatron-core GPTModel, tensor parallel.

Decoding uses Megatron's static KV cache: one prefill of the left-padded prompts, then one token
per step, every row's next token in one column. RoPE attention scores depend only on distances,
so each row's real tokens attend as they do in training (positions ``0..L-1``) and the rollout
log-probs are the training engine's forward on the same weights, up to float rounding; pad keys
are masked. With the option ``rollout_kv_cache=False`` it recomputes the whole sequence at every
step in training's left-shifted layout instead. Under TP the vocabulary slices of the next-token
logits are gathered (one row per sample, not the whole sequence) and every TP rank samples the
same token from the same per-sample random stream.

Semantics shared with the other backends:

* ``rollout_log_probs`` are ``log softmax(logits / T)`` of the chosen token in float32, before
  top-k/top-p truncation, so they are exact for every sampling configuration;
* each sample draws its uniforms from its own generator seeded by a hash of (seed, group id,
  sample index) and picks a token by inverting the CDF of the (truncated) distribution in
  vocabulary order, so samples do not depend on batch order or batch composition;
* a generated EOS or stop token ends the response and is part of it; a response cut at
  ``max_new_tokens`` has ``truncated`` True. ``greedy`` takes the argmax (ties to the lowest id).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core import (
    ConfigError,
    EngineSpec,
    RolloutCapabilities,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    TensorInfo,
    Tokenizer,
    WeightMessage,
    apply_weight_stream,
)
from verl_core.enginekit.gates import refuse_undeclared
from verl_core.enginekit.hf_tokenizer import load_tokenizer
from verl_core.enginekit.rollout_base import GenerateLimits, Responses, RolloutEngineBase
from verl_core.enginekit.sampling import (
    CompiledOrEager,
    GraphCaptures,
    StaticDecoders,
    TokenSampler,
    eager_decode,
    slow_path_notes,
    static_prompt_width,
    uniform_table,
)
from verl_core.kernel.registry import parse_options
from verl_megatron.capabilities import rollout_capabilities
from verl_megatron.convert import StateDictAdapter
from verl_megatron.eager_decode import cached_logits, recomputed_logits
from verl_megatron.model import build_stage, load_hf_state_dict, load_stage_weights, model_dims
from verl_megatron.options import MegatronOptions
from verl_megatron.parallel import rollout_groups
from verl_megatron.static_decode import StaticDecoder, compiled_last_logits

__all__ = ["MegatronRolloutEngine", "build_rollout_engine"]


class MegatronRolloutEngine(RolloutEngineBase):
    """Generates responses with a megatron-core GPTModel under tensor parallelism (pp must be 1).

    Every rank of the group builds the engine with the same spec and calls ``generate`` with the
    same prompts; every rank returns the same batch. ``spec.parallel`` is ``tp`` x ``dp``
    replicas; colocated with a training engine of another layout (built first), the engine uses
    its own process groups (:func:`verl_megatron.parallel.rollout_groups`).

    Args:
        spec: The engine spec (role rollout).
    """

    def __init__(self, spec: EngineSpec) -> None:
        if spec.role != "rollout":
            raise ConfigError(f"MegatronRolloutEngine needs role 'rollout', got {spec.role!r}")
        if spec.parallel.pp != 1:
            raise ConfigError(
                f"the megatron rollout engine runs with pp=1 (tensor parallel only), got pp={spec.parallel.pp}"
            )
        refuse_undeclared(spec, rollout_capabilities(), engine="the megatron rollout engine")
        self._spec = spec
        self._options = parse_options(MegatronOptions, spec.options, where="backend 'megatron' options")
        if spec.device.startswith("cuda") and torch.cuda.is_available():
            import os

            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        elif spec.device == "cpu":
            self._device = torch.device("cpu")
        else:
            raise ConfigError(f"EngineSpec.device must be 'cpu' or an available 'cuda[:N]', got {spec.device!r}")
        # the folder is refused (unreadable config, family, RoPE, special ids) before any process group exists
        self.dims = model_dims(spec.model_path, "lm")
        groups = rollout_groups(spec.parallel, device=self._device.type, seed=spec.seed)
        self.tp = groups.tp
        self.tp_rank = groups.tp_rank
        self._tp_group = groups.tp_group
        self.dims.check_parallel(self.tp, 1)
        self.adapter = StateDictAdapter(self.dims)
        self._dtype: torch.dtype = spec.torch_dtype
        self.model = build_stage(self.dims, tp=self.tp, pp=1, pp_rank=0, dtype=self._dtype, device=self._device,
                                 attention=self._options.attention, pg_collection=groups.pg_collection)
        full = self.adapter.from_hf(load_hf_state_dict(spec.model_path))
        load_stage_weights(self.model, self.adapter, full, tp_rank=self.tp_rank, tp=self.tp, pp_rank=0, pp=1)
        self.model.requires_grad_(False)
        self.model.eval()
        # automatic decode choices: the fast static path on CUDA (graphs at tp=1), Megatron's KV cache elsewhere
        self._options = self._options.resolve_rollout(self._device, tp=self.tp, dtype=self._dtype)
        self._kv_cache = self._options.rollout_kv_cache
        if self._options.rollout_cuda_graphs and (self._device.type != "cuda" or self.tp != 1):
            raise ConfigError(
                "megatron option rollout_cuda_graphs needs a CUDA device and tp=1, the engine runs on "
                f"{self._device} with tp={self.tp}; leave it False there (rollout_static_cache alone works anywhere)"
            )
        # The static decoder of the last shape and sampling configuration; which shapes replay CUDA
        # graphs and which decode eagerly after failed captures.
        self._decoders: StaticDecoders[StaticDecoder] = StaticDecoders()
        self._graphs = GraphCaptures("megatron rollout")
        # torch.compile of the decode step's forward (MegatronOptions.rollout_compile), made on first use.
        self._compiled: CompiledOrEager | None = None
        for name, module in self.model.named_modules():
            if name.endswith("core_attention"):
                module.explicit_mask = True  # decoding passes its own masks (see eager_decode.cached_logits)
        self._tokenizer: Tokenizer = load_tokenizer(spec.model_path)

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> RolloutCapabilities:
        """What this engine supports."""
        return rollout_capabilities()

    @property
    def tokenizer(self) -> Tokenizer:
        """Tokenizer of the model folder."""
        return self._tokenizer

    @property
    def weight_dtype(self) -> torch.dtype:
        """The model's parameter dtype (weight streams arrive in it)."""
        return self._dtype

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Always True: log-probs are taken before truncation at the sampling temperature."""
        return True

    # ------------------------------------------------------------------ generation
    def _generate_limits(self) -> GenerateLimits:
        return GenerateLimits(vocab_size=self.dims.vocab_size, device=self._device,
                              logits_vocab=self.dims.vocab_size, group=self._tp_group)

    def _call_seed(self) -> int:
        """One draw shared by all ranks, so TP ranks sample the same tokens."""
        s = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(self._device)  # NCCL needs a device tensor
        dist.broadcast(s, src=0)
        return int(s)

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        return self._decode(rows.trim(), seeds, params)

    @torch.no_grad()
    def _decode(self, batch: TensorBatch, seeds: list[int], params: SamplingParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        rows = batch.batch_size
        dev = self._device
        stop_ids = sorted({self._tokenizer.eos_token_id, *params.stop_token_ids})
        max_new = params.max_new_tokens
        uniforms = None if params.greedy else uniform_table(seeds, max_new, dev)
        # Whether every row finished is asked (a host synchronisation) every few steps on a GPU.
        check_every = 8 if dev.type == "cuda" else 1
        if self._options.rollout_static_cache:
            # A few prompt widths (extra left padding is masked): one cache and graph serve batches
            # whose prompts differ in length.
            batch = batch.pad_prompts(static_prompt_width(batch["prompt_ids"].shape[1]))
            decoder = self._static_decoder(batch, params, stop_ids, uniforms)
            decoder.start(batch.to(dev), uniforms)
            decoder.run(check_every, graphs=self._graphs if self._options.rollout_cuda_graphs else None)
            return decoder.result()
        sampler = TokenSampler(params, self._tokenizer.pad_token_id, torch.tensor(stop_ids, device=dev), uniforms)
        if self._kv_cache:
            steps = cached_logits(self.model, batch, max_new, device=dev)
        else:
            steps = recomputed_logits(self.model, batch, max_new, pad=self._tokenizer.pad_token_id, device=dev,
                                      tp=self.tp, tp_group=self._tp_group)
        return eager_decode(steps, sampler, rows, max_new, dev, check_every)

    def _static_decoder(self, batch: TensorBatch, params: SamplingParams, stop_ids: list[int],
                        uniforms: Tensor | None) -> StaticDecoder:
        """The static decoder for this shape and sampling configuration (kept while they repeat)."""
        rows, width = batch["prompt_ids"].shape
        if self._options.rollout_compile and self._compiled is None:
            self._compiled = compiled_last_logits()

        def build(sampler: TokenSampler) -> StaticDecoder:
            return StaticDecoder(self.model, rows, width, sampler, params.max_new_tokens, self._device,
                                 step_logits=self._compiled, window=self._options.rollout_decode_window or 0,
                                 fused_attention=bool(self._options.rollout_decode_kernel))

        return self._decoders.get(self.model, rows, width, params, stop_ids, uniforms, self._tokenizer.pad_token_id,
                                  self._device, build, compile_sampling=bool(self._options.rollout_compile))

    @property
    def decode_mode(self) -> str:
        """How ``generate`` decodes: ``recompute``, ``kv-cache``, ``static``, ``static+compile``,
        ``static+cuda-graphs`` or ``static+compile+cuda-graphs``, ``+windows`` when steps attend over
        cache windows, ``+fused-attention`` when they run the fused decode-attention kernel (and
        which shapes decode eagerly after their CUDA-graph captures failed, and the error after
        which the decode step runs uncompiled)."""
        if not self._options.rollout_static_cache:
            return "kv-cache" if self._kv_cache else "recompute"
        mode = "static+compile" if self._options.rollout_compile else "static"
        if self._options.rollout_cuda_graphs:
            mode += "+cuda-graphs"
        if self._options.rollout_decode_window:
            mode += "+windows"
        if self._options.rollout_decode_kernel:
            mode += "+fused-attention"
        return mode + slow_path_notes(self._graphs if self._options.rollout_cuda_graphs else None, self._compiled)

    @property
    def graph_captures(self) -> GraphCaptures:
        """The record of CUDA-graph captures: graphs captured, failures, shapes decoding eagerly."""
        return self._graphs

    # ------------------------------------------------------------------ weights
    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply a weight stream in transformers naming; on failure the engine stays stale."""
        with self._writing_weights():
            params = dict(self.model.named_parameters())
            pending = {name: set(self.adapter.to_hf_tensor(name, None)) for name in self.adapter.megatron_names()}
            received: dict[str, Tensor] = {}

            def apply(chunk: list[tuple[str, Tensor]]) -> None:
                received.update(chunk)
                with torch.no_grad():
                    for name in [n for n, srcs in pending.items() if srcs <= received.keys()]:
                        full = self.adapter.from_hf_tensor(name, received)
                        shard = self.adapter.shard(name, full, self.tp_rank, self.tp)
                        params[name].copy_(shard.to(device=params[name].device, dtype=params[name].dtype))
                        for src in pending.pop(name):
                            received.pop(src, None)

            expected = {n: TensorInfo(s, self._dtype) for n, s in self.adapter.hf_shapes().items()}
            optional = frozenset({"lm_head.weight"}) if self.dims.tied else frozenset()
            manifest = apply_weight_stream(stream, expected, apply, optional=optional)
            if pending:
                raise StaleWeightsError(f"weight stream left Megatron tensors unset: {sorted(pending)[:3]}")
            self._commit_weights(manifest.version)

    def shard_parameters(self) -> dict[str, Tensor]:
        """This rank's parameters by Megatron global name (pp = 1: the model's own names)."""
        return dict(self.model.named_parameters())

    def begin_weight_update(self) -> None:
        """Mark the engine stale before its parameters are written in place (direct weight sync)."""
        self._mark_stale("a weight sync is in progress")

    def commit_weight_update(self, version: int) -> None:
        """Serve the parameters written since :meth:`begin_weight_update` as ``version``."""
        self._commit_weights(version)

    def close(self) -> None:
        """Drop the model."""
        self._closed = True
        self._decoders.clear()
        self._compiled = None
        self.model = None


def build_rollout_engine(spec: EngineSpec) -> MegatronRolloutEngine:
    """Factory of the ``megatron`` backend's rollout role."""
    return MegatronRolloutEngine(spec)

