"""HFRolloutEngine: sampling with a KV cache over a transformers causal LM.

The engine runs its own decoding loop (prefill, then one token per step through the model's KV
cache) so every detail of the contract is under its control:

* prompts are left-padded and positions are ``cumsum(mask) - 1``;
* ``rollout_log_probs`` are ``log softmax(logits / T)`` of the chosen token in float32, before
  top-k/top-p truncation, so they are exact for every sampling configuration;
* each sample draws its uniforms from its own generator seeded by (seed, group id, sample index),
  and picks a token by inverting the CDF of the truncated distribution in vocabulary order, so
  the samples do not depend on the batch order or on which other prompts share the batch;
* a generated EOS or stop token ends the response and is part of it (mask True); a response cut
  at ``max_new_tokens`` has ``truncated`` True.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from verl_core.enginekit.gates import refuse_undeclared
from verl_core.enginekit.rollout_base import GenerateLimits, Responses, RolloutEngineBase
from verl_core.enginekit.sampling import (
    CompiledOrEager,
    GraphCaptures,
    StaticDecoders,
    TokenSampler,
    sample_seed,
    static_prompt_width,
    uniform_table,
)
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RolloutCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.registry import parse_options
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES, TrainingEngine
from verl_core.kernel.weights import (
    StreamWeightSync,
    SyncReport,
    TensorInfo,
    WeightMessage,
    WeightSync,
)
from verl_hf.capabilities import ROLLOUT_CAPABILITIES
from verl_hf.config import HFOptions
from verl_hf.fused_elementwise import fuse_elementwise, fused_modules
from verl_hf.fused_projections import FusedProjections
from verl_hf.lora import HFLora
from verl_hf.modeling import (
    FUSED_SDPA,
    GROUPED_SDPA,
    FlatParameters,
    load_model,
    register_grouped_sdpa,
)
from verl_hf.rollout_decode import (
    HFStaticDecoder,
    allow_recompiles,
    compiled_graphs,
    decode_dynamic,
    decode_mode,
    full_attention,
    log_compile,
)
from verl_hf.rollout_request import concat_responses
from verl_hf.rollout_weights import (
    apply_stream,
    copy_flat,
    copy_state,
    flat_to_device,
    flat_to_host,
    live_targets,
    same_flat_layout,
)
from verl_hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFDirectSync", "HFRolloutEngine", "build_rollout_engine", "sample_seed"]

class HFRolloutEngine(RolloutEngineBase):
    """A transformers causal LM generating responses with exact log-probs.

    With ``spec.lora`` the model carries the same LoRA adapter as a trainer built with that spec
    (peft, injected in place; ``B = 0`` or ``spec.lora.init_path`` until the first sync), and
    ``update_weights`` takes that trainer's adapter stream (``export_adapter``): the base is never
    sent again, and the samples are those of base + adapter without merging. Each layer's
    projections then run one matmul each (no fused projections). Colocated with the hf LoRA actor
    of the same base (one process, one device, one dtype), the engine serves the actor's frozen
    base tensors instead of its own copy once :meth:`share_base` ran (the trainer's weight sync,
    :class:`HFDirectSync`, calls it before the first rollout): one copy of the base for both.

    Args:
        spec: The engine spec (role rollout; ``parallel`` must be all 1).
        options: Backend options (default: parsed from ``spec.options``).

    Raises:
        ConfigError: wrong role, parallel sizes other than 1, float16 (not a declared dtype), a
            folder that is not a causal LM, or a ``spec.lora`` that does not fit the model.
    """

    def __init__(self, spec: EngineSpec, options: HFOptions | None = None) -> None:
        if spec.role != "rollout":
            raise ConfigError(f"HFRolloutEngine needs role 'rollout', got {spec.role!r}")
        if spec.parallel.world_size != 1:
            raise ConfigError(
                f"the hf rollout engine runs on one device, got parallel={spec.parallel}; run one "
                "engine per data-parallel rank instead"
            )
        refuse_undeclared(spec, ROLLOUT_CAPABILITIES, engine="the hf rollout engine")
        self._spec = spec
        self._options = options if options is not None else parse_options(
            HFOptions, spec.options, where="hf backend options"
        )
        self._device = torch.device(spec.device)
        # On CUDA, sdpa rollouts run decode steps that read a grouped KV cache once, and only the
        # slots written so far (the same math; elsewhere transformers' own sdpa, so a CPU engine
        # decodes like a user's model object, unless rollout_decode_window asks for windows).
        attn: str = self._options.attn_implementation
        fused = self._options.fused_decode(self._device, spec.torch_dtype)
        if attn == "sdpa" and (self._device.type == "cuda" or self._options.rollout_decode_window):
            attn = register_grouped_sdpa(fused)
        self._model: Any = load_model(
            spec.model_path, "causal_lm", dtype=spec.torch_dtype, device=self._device,
            attn_implementation=attn, seed=spec.seed, sequence_len=spec.max_prompt_len + spec.max_response_len,
        )
        self._tied = bool(getattr(self._model.config, "tie_word_embeddings", False))
        self._lora = HFLora(self._model, spec.lora, tied=self._tied, seed=spec.seed) if spec.lora is not None else None
        self._model.requires_grad_(False)
        # Norms and gated activations as compiled kernels: the prefill runs the model uncompiled.
        if self._options.fuses_elementwise(self._device, spec.torch_dtype):
            fuse_elementwise(self._model)
        # "auto" decode choices: the fast static path on CUDA, when the model allows a static cache
        self._options = dataclasses.replace(
            self._options.resolve_rollout(self._device, static_ok=full_attention(self._model.config)),
            rollout_decode_kernel=fused)
        self._vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self._tokenizer = load_tokenizer(spec.model_path, self._vocab_size)
        self._weights: dict[str, Tensor] | None = None
        # Which decode shapes replay CUDA graphs, and those that decode eagerly after failed captures.
        self._graphs = GraphCaptures("hf rollout")
        if self._options.rollout_cuda_graphs and self._device.type != "cuda":
            raise ConfigError(
                f"HFOptions.rollout_cuda_graphs needs a CUDA device, the engine runs on {self._device}; "
                "leave it False off CUDA (rollout_cache='static' alone works on every device)"
            )
        self._expected: dict[str, TensorInfo] = {}
        self._dropped = False  # sleep_until_sync() dropped the weight buffer's values
        # torch.compile of the model for decode steps (HFOptions.rollout_compile), made on first use;
        # the model itself runs the steps if compiling fails.
        self._compiled: CompiledOrEager | None = None
        # Seconds of the first decode of each (rows, prompt width) that compiled (see compile_seconds).
        self._first_compiled: dict[tuple[int, int], float] = {}
        self._shapes: set[tuple[int, int]] = set()  # the shapes decoded under rollout_compile
        # The static decoder of the last shape and sampling configuration, kept for reuse.
        self._decoders: StaticDecoders[HFStaticDecoder] = StaticDecoders()
        # The weights in one buffer, in export order (see FlatParameters); rebuilt on wake.
        self._flat: FlatParameters | None = FlatParameters.build(self._targets())
        # Each layer's q/k/v and gate/up as one matmul over weights lying back to back in that buffer.
        self._fused: FusedProjections | None = (
            FusedProjections.install(self._model, self._targets())
            if self._options.rollout_fused_projections and self._lora is None else None)
        # Pinned host memory the weight buffer sleeps in (allocated on the first sleep, then reused).
        self._host: Tensor | None = None
        # Whether the frozen base tensors are a LoRA actor's (share_base): sleep then frees caches only.
        self._shares_base = False

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> RolloutCapabilities:
        """What this engine supports."""
        return ROLLOUT_CAPABILITIES

    @property
    def tokenizer(self) -> HFTokenizer:
        """Tokenizer of the model."""
        return self._tokenizer

    @property
    def weight_dtype(self) -> torch.dtype:
        """The model's parameter dtype."""
        return self._spec.torch_dtype

    @property
    def model(self) -> Any:
        """The underlying transformers model."""
        return self._model

    @property
    def decode_mode(self) -> str:
        """How ``generate`` decodes: ``dynamic``, ``static``, ``static+cuda-graphs``, ``static+compile``
        or ``static+compile+cuda-graphs``, ``+windows`` when steps attend over cache windows (and
        which shapes decode eagerly after their CUDA-graph captures failed)."""
        return decode_mode(self._options, self._graphs, self._compiled)

    @property
    def graph_captures(self) -> GraphCaptures:
        """The record of CUDA-graph captures: graphs captured, failures, shapes decoding eagerly
        (``graph_captures.metrics()``)."""
        return self._graphs

    @property
    def fused_elementwise_modules(self) -> int:
        """How many modules run through the compiled element-wise functions (``HFOptions.fused_elementwise``)."""
        return fused_modules(self._model)

    @property
    def fused_projection_groups(self) -> int:
        """How many q/k/v and gate/up groups run as one matmul (``HFOptions.rollout_fused_projections``)."""
        return 0 if self._fused is None else self._fused.groups

    @property
    def compile_seconds(self) -> Mapping[tuple[int, int], float]:
        """Wall seconds of the first decode of each (rows, prompt width) that compiled under
        ``rollout_compile``, compiling included: the first shape's, and the first whose rows (or
        prompt width) differ (a graph with that size symbolic, which later shapes reuse)."""
        return dict(self._first_compiled)

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Always True: log-probs are taken before truncation at the sampling temperature."""
        return True

    # ------------------------------------------------------------------ generation
    def _generate_limits(self) -> GenerateLimits:
        return GenerateLimits(vocab_size=self._vocab_size, device=self._device, logits_vocab=self._vocab_size,
                              rows_at_once=self._options.rollout_batch_size)

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        """Decode the rows ``rollout_batch_size`` at a time (all at once when unset)."""
        if self._fused is not None and not self._fused.intact():
            # a rebuilt weight buffer no longer holds a group back to back: one matmul per projection
            self._fused.remove()
            self._fused = None
            self._decoders.clear()
        size = rows.batch_size
        step = self._options.rollout_batch_size or size
        parts = [self._decode(rows.index(slice(start, start + step)).trim(), seeds[start : start + step], params)
                 for start in range(0, size, step)]
        return concat_responses(parts, self._tokenizer.pad_token_id, self._device)

    def _uniforms(self, seeds: list[int], params: SamplingParams) -> Tensor | None:
        """Every uniform a chunk can use, [rows, max_new_tokens] float64 on the device (None if greedy).

        Row r holds the first draws of sample r's own generator, in order: the values a draw per
        step would give, drawn once so no decode step waits for the host.
        """
        return None if params.greedy else uniform_table(seeds, params.max_new_tokens, self._device)

    @torch.no_grad()
    def _decode(
        self, chunk: TensorBatch, seeds: list[int], params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Decode one chunk: response ids, mask, log-probs [rows, steps] and truncated [rows]."""
        uniforms = self._uniforms(seeds, params)
        stop_ids = sorted({self._tokenizer.eos_token_id, *params.stop_token_ids})
        stops = torch.tensor(stop_ids, dtype=torch.int64, device=self._device)
        if self._options.rollout_cache == "static":
            # A few prompt widths (extra left padding is masked): one cache, graph and compiled
            # step serve batches whose prompts differ in length.
            chunk = chunk.pad_prompts(static_prompt_width(chunk["prompt_ids"].shape[1]))
            decoder = self._static_decoder(chunk, params, stop_ids, uniforms)
            rows, width = chunk["prompt_ids"].shape
            first = self._options.rollout_compile and (rows, width) not in self._shapes
            started, graphs = time.perf_counter(), compiled_graphs()
            decoder.start(chunk, uniforms)
            # On a GPU, ask whether every row finished only every few steps (each ask is a sync).
            decoder.run(check_every=8 if self._device.type == "cuda" else 1,
                        graphs=self._graphs if self._options.rollout_cuda_graphs else None)
            result = decoder.result()
            if first:
                self._shapes.add((rows, width))
                if compiled_graphs() > graphs:
                    self._first_compiled[(rows, width)] = seconds = time.perf_counter() - started
                    log_compile(rows, width, seconds)
            return result
        sampler = TokenSampler(params, self._tokenizer.pad_token_id, stops, uniforms)
        return decode_dynamic(self._model, chunk, sampler, params.max_new_tokens, self._device)

    def _static_decoder(
        self, chunk: TensorBatch, params: SamplingParams, stop_ids: list[int], uniforms: Tensor | None
    ) -> HFStaticDecoder:
        """The static decoder for this shape and sampling configuration (kept while they repeat;
        dropped on sleep/wake)."""
        rows, width = chunk["prompt_ids"].shape
        if self._options.rollout_compile and self._compiled is None:
            allow_recompiles()
            self._compiled = CompiledOrEager(self._model, "hf rollout decode step")

        # windows need the attention that reads a narrower mask as "the first slots only" (a
        # user's own model object keeps its attention, and the whole cache)
        windowed = getattr(self._model.config, "_attn_implementation", None) in (GROUPED_SDPA, FUSED_SDPA)
        window = (self._options.rollout_decode_window or 0) if windowed else 0

        def build(sampler: TokenSampler) -> HFStaticDecoder:
            return HFStaticDecoder(self._model, rows, width, sampler, params.max_new_tokens,
                                  eager_attention=self._options.attn_implementation == "eager",
                                  device=self._device, step_model=self._compiled, window=window)

        return self._decoders.get(self._model, rows, width, params, stop_ids, uniforms,
                                  self._tokenizer.pad_token_id, self._device, build,
                                  compile_sampling=bool(self._options.rollout_compile))

    # ------------------------------------------------------------------ weights
    def _targets(self) -> dict[str, Tensor]:
        """Name -> the live tensor a sync writes (parameters and persistent buffers; under LoRA the
        adapter's tensors by adapter stream name), cached.

        Parameters keep their identity when the model moves between devices, buffers do not, so
        the cache is dropped on sleep and wake.
        """
        if self._weights is None:
            self._weights = self._lora.adapter() if self._lora is not None else live_targets(self._model, self._tied)
            self._expected = {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in self._weights.items()}
        return self._weights

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply a weight stream; on any failure the engine is stale until a complete sync.

        Each chunk's names, shapes and dtypes are checked, then it is copied straight into the
        live parameters with one multi-tensor copy (every byte is copied once); the finiteness of
        every chunk is read once, at the commit. Any failure leaves the engine stale rather than
        serving half-applied or non-finite weights.
        """
        with self._writing_weights():
            targets = self._targets()
            flat = self._flat if self._flat is not None and self._flat.intact(targets) else None
            self._commit_weights(apply_stream(stream, targets, self._expected, flat, tied=self._tied))

    def _load_local(self, state: Mapping[str, Tensor], *, version: int) -> int:
        """Copy same-device, same-dtype tensors by name into the parameters (the direct path).

        The same checks as a stream, in one go: every name and shape first (nothing is copied on a
        mismatch), then one multi-tensor copy and one fused finiteness check with a single host
        synchronisation at the end; a non-finite tensor raises and leaves the engine stale.

        Returns:
            Bytes copied.

        Raises:
            WeightSyncError: a tensor is missing, mis-shaped, of another dtype or not finite.
        """
        with self._writing_weights():
            moved = copy_state(state, self._targets(), self._expected, tied=self._tied)
            self._commit_weights(version)
        return moved

    def _load_flat(self, actor: Any, *, version: int) -> int | None:
        """Copy the actor's weight buffer into this engine's with one device copy (the direct path).

        Applies when both engines keep their weights in one buffer of one layout on one device
        (see :class:`~verl_hf.modeling.FlatParameters`). The copy and one reduction over the
        actor's buffer are queued first; the host then checks that every tensor of both engines
        is still the view its layout placed, while the device copies. When one is not, it returns
        None with the engine stale, and the caller's per-tensor path rewrites every weight. A
        non-finite reduction is resolved tensor by tensor, as in a stream.

        Raises:
            WeightSyncError: a tensor holds NaN/inf (the engine is then stale).
        """
        source: FlatParameters | None = actor._flat
        flat = self._flat
        if source is None or flat is None or not same_flat_layout(source, flat):
            return None
        with self._writing_weights():
            moved = copy_flat(source, flat, actor._live_state(), self._targets())
            if moved is not None:
                self._commit_weights(version)
        return moved

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Move the model to CPU on CUDA, freeing its device memory (a no-op on CPU).

        The weight buffer goes in one copy into pinned host memory that is kept for the next
        sleep (what a colocated trainer does every step); whatever is not in the buffer moves
        with ``Module.to``. An engine serving a LoRA actor's base (:meth:`share_base`) frees its
        caches only: the base stays where the actor trains on it.
        """
        self._sleep(keep=True)

    def sleep_until_sync(self) -> None:
        """:meth:`sleep` that drops the weight buffer instead of copying it to the host and back.

        The buffer's layout moves to the host without its values, and :meth:`wake` gives it new
        device memory without copying anything, so the engine is stale (``generate`` raises
        ``StaleWeightsError``) until the complete weight sync the caller sends after waking. At a
        6.7B model that saves two copies of 13.5 GB over PCIe a step. What does not lie in the
        buffer (non-persistent buffers such as rotary frequencies) moves as in :meth:`sleep`. An
        engine whose weights are not in one buffer, one on CPU, and one serving a LoRA adapter
        stream (the stream does not carry the base) sleep as :meth:`sleep` does, and so does
        every engine under ``HFOptions.rollout_sleep_keeps_weights``.
        """
        self._sleep(keep=self._lora is not None or self._shares_base or self._options.rollout_sleep_keeps_weights)

    def _sleep(self, *, keep: bool) -> None:
        if self._shares_base:
            if self._device.type != "cpu" and not self._asleep:
                self._decoders.clear()
                torch.cuda.empty_cache()
            self._asleep = self._device.type != "cpu"
            return
        if self._device.type != "cpu" and not self._asleep:
            targets = self._targets()
            self._weights = None
            self._decoders.clear()
            drop = not keep and self._flat is not None and self._flat.intact(targets)
            if drop:
                self._mark_stale("sleep_until_sync() dropped the weights; a complete weight sync restores them")
            self._flat, self._host = flat_to_host(self._flat, targets, self._host, copy=not drop)
            self._dropped = drop
            self._model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = self._device.type != "cpu"

    def wake(self) -> None:
        """Move the model back to its device (the weight buffer in one copy, or none after
        :meth:`sleep_until_sync`, whose weights come with the next sync)."""
        if self._asleep and self._shares_base:
            self._asleep = False
        if self._asleep:
            self._weights = None
            self._decoders.clear()
            flat = flat_to_device(self._flat, self._targets(), self._device, copy=not self._dropped)
            self._model.to(self._device)
            self._flat = flat if flat is not None else FlatParameters.build(self._targets())
            self._dropped = False
            self._asleep = False

    @property
    def shares_base(self) -> bool:
        """Whether the engine serves a LoRA actor's frozen base tensors (:meth:`share_base`)."""
        return self._shares_base

    def share_base(self, actor: Any) -> int:
        """Serve ``actor``'s frozen base tensors instead of this engine's copy; returns the bytes freed.

        Applies to an engine built with ``spec.lora`` (the adapter sync) when ``actor`` is an hf
        training engine with a LoRA adapter of the same base (its identity: every base tensor's
        name and shape and a sample of its values) whose base tensors lie on this engine's device
        in its dtype. Every frozen parameter of the actor (the base, peft's original copies of the
        fully trained modules) becomes this engine's parameter of the same name, and this engine's
        own copies are dropped; its adapter and fully trained copies stay its own (the adapter sync
        writes them). Neither engine writes a frozen tensor, so both read one copy. The compiled
        decode step and captured graphs are dropped (they hold the old tensors). Idempotent; 0
        where it does not apply (nothing changes then).
        """
        source = getattr(actor, "lora", None)
        if (self._lora is None or not isinstance(source, HFLora) or self._shares_base or self._asleep
                or source.identity != self._lora.identity):
            return 0
        theirs = dict(actor.model.named_parameters())
        swap: dict[int, torch.nn.Parameter] = {}
        for name, mine in self._model.named_parameters():
            other = theirs.get(name)
            if (other is None or other.requires_grad or "lora_" in name or ".modules_to_save." in name
                    or other.shape != mine.shape or other.dtype != mine.dtype or other.device != mine.device):
                continue
            swap[id(mine)] = other
        if not swap:
            return 0
        freed = 0
        with self._turns.writing():  # no generate call runs while the parameters change
            for module in self._model.modules():
                for key, param in list(module._parameters.items()):
                    if param is not None and id(param) in swap:
                        freed += param.numel() * param.element_size()
                        module._parameters[key] = swap[id(param)]
            self._decoders.clear()
            self._compiled = None
            self._first_compiled.clear()
            self._shapes.clear()
            self._weights = None
            self._shares_base = True
        return freed

    def close(self) -> None:
        """Drop the model."""
        self._closed = True
        self._compiled = None
        self._weights = None
        self._decoders.clear()
        self._host = None
        self._model = None


class HFDirectSync(WeightSync):
    """The direct hf -> hf path: the actor's parameters copied straight into the rollout engine's.

    No stream, no buckets, with the stream's checks and failure semantics. When both engines keep
    their weights in one buffer of the same layout (see :class:`verl_hf.modeling.FlatParameters`:
    an actor on one device and a rollout engine of the same architecture and dtype), one device
    copy of the buffer and one reduction; otherwise one multi-tensor copy and one fused
    finiteness check (``HFRolloutEngine._load_local``). It applies when the actor holds full
    tensors on the rollout engine's device in its dtype (one process, no FSDP2 sharding, not
    offloaded); every other case, and every other engine pair, runs the canonical stream. Under
    LoRA the stream runs (merged, or the adapter), and a rollout built with the adapter first takes
    the actor's frozen base tensors (:meth:`HFRolloutEngine.share_base`).

    Args:
        bucket_bytes: Bytes per chunk when falling back to the canonical stream.
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self._stream = StreamWeightSync(bucket_bytes)

    def sync(self, source: TrainingEngine, target: RolloutEngine, *, version: int) -> SyncReport:
        """Copy ``source``'s weights into ``target`` as ``version``."""
        from verl_hf.training import HFTrainingEngine

        if not (isinstance(source, HFTrainingEngine) and isinstance(target, HFRolloutEngine)) or (
                source.lora is not None or target.spec.lora is not None):
            if isinstance(source, HFTrainingEngine) and isinstance(target, HFRolloutEngine):
                target.share_base(source)  # adapter sync: one copy of the frozen base for both
            # LoRA: the stream merges tensor by tensor (or carries the adapter) with no second copy
            return self._stream.sync(source, target, version=version)
        t0 = time.perf_counter()
        # One turn for every path tried: a generate call on another thread waits for the whole
        # sync, never meeting the engine stale between a failed fast path and its fallback.
        with target._writing_weights():
            moved = target._load_flat(source, version=version)
            if moved is not None:
                return SyncReport(version, len(target._expected), moved, time.perf_counter() - t0, {"direct": 1.0})
            state = source._live_state()
            tied = bool(getattr(source.model.config, "tie_word_embeddings", False))
            # Sharded (DTensor), offloaded (another device), other-dtype or other-architecture
            # actors go through the stream, which gathers, casts or rejects them.
            device = target.model.get_input_embeddings().weight.device
            if tied != target._tied or any(
                hasattr(t, "full_tensor") or t.device != device or t.dtype != target.weight_dtype
                for t in state.values()
            ):
                return self._stream.sync(source, target, version=version)
            moved = target._load_local(state, version=version)
            return SyncReport(version, len(target._expected), moved, time.perf_counter() - t0, {"direct": 1.0})


def build_rollout_engine(spec: EngineSpec) -> HFRolloutEngine:
    """Factory of the ``hf`` backend's rollout engine."""
    return HFRolloutEngine(spec)

