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

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from verl_core.enginekit.memory import check_generate_memory
from verl_core.enginekit.sampling import (
    StaticDecodeLoop,
    StaticDecoders,
    TokenSampler,
    expand_prompts,
    sample_seed,
    static_prompt_width,
    uniform_table,
)
from verl_core.enginekit.weight_stream import (
    all_finite_flag,
    apply_weight_stream,
    contiguous_span,
    first_non_finite,
)
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RolloutCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import (
    BatchValidationError,
    ConfigError,
    StaleWeightsError,
    WeightSyncError,
)
from verl_core.kernel.registry import parse_options
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.training import TrainingEngine
from verl_core.kernel.weights import (
    StreamWeightSync,
    SyncReport,
    TensorInfo,
    WeightMessage,
    WeightSync,
)
from verl_hf.capabilities import ROLLOUT_CAPABILITIES
from verl_hf.config import HFOptions
from verl_hf.modeling import (
    FlatParameters,
    cache_keyword,
    export_order,
    load_model,
    position_ids,
    register_grouped_sdpa,
)
from verl_hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFDirectSync", "HFRolloutEngine", "build_rollout_engine", "sample_seed"]

class _StaticDecoder(StaticDecodeLoop):
    """The decode loop over a preallocated StaticCache, every step at one shape.

    Besides the loop's state (:class:`~verl_core.enginekit.sampling.StaticDecodeLoop`), the position to
    feed and the cache slot are device tensors updated in place. The attention mask is built here
    as a 4D mask over the whole cache (prompt padding and not-yet-written slots masked), which
    keeps transformers' own mask code (with its host synchronisations) out of the step.
    """

    def __init__(self, model: Any, rows: int, width: int, sampler: TokenSampler, max_new: int, *,
                 eager_attention: bool, device: torch.device, step_model: Any = None) -> None:
        from transformers import StaticCache

        super().__init__(rows, max_new, sampler, device, model, "hf rollout")
        # What a decode step calls: the model, or a compiled version of it (one shape, so no
        # recompilation while the decoder is reused; the prefill always runs the model itself).
        self.step_model = model if step_model is None else step_model
        self.width = width
        length = width + max_new
        self.cache_kw = cache_keyword(model)
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        if any(bool(getattr(layer, "is_sliding", False)) for layer in self.cache.layers):
            raise ConfigError(
                "HFOptions.rollout_cache='static' supports full-attention models only; this model has "
                "sliding-window layers: use rollout_cache='dynamic'"
            )
        self.eager_attention = eager_attention
        self.dtype = model.get_input_embeddings().weight.dtype
        self.valid = torch.ones(rows, length, dtype=torch.bool, device=device)
        self.slots = torch.arange(length, device=device)
        self.pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot = torch.full((1,), width, dtype=torch.int64, device=device)

    def _prefill(self, chunk: TensorBatch) -> Tensor:
        ids = chunk["prompt_ids"]
        prompt_mask = chunk["prompt_mask"]
        width = self.width
        dev = ids.device
        self.cache.reset()  # type: ignore[no-untyped-call]
        self.valid[:, :width].copy_(prompt_mask)
        pos = position_ids(prompt_mask)
        # Prefill: causal over the prompt, padding masked; a padding query also sees itself so no
        # row is fully masked (its output is never read).
        causal = self.slots[None, :] <= torch.arange(width, device=dev)[:, None]
        own = self.slots[None, :] == torch.arange(width, device=dev)[:, None]
        mask = (self.valid[:, None, :] & causal[None]) | own[None]
        out: Any = self.model(input_ids=ids, attention_mask=self._attention(mask[:, None]), position_ids=pos,
                              use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        self.pos.copy_(pos[:, -1] + 1)
        self.slot.fill_(width)
        logits: Tensor = out.logits[:, -1].float()
        return logits

    def _attention(self, mask: Tensor) -> Tensor:
        """The 4D boolean mask (True = attend) in the form the attention kernel takes."""
        if not self.eager_attention:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.dtype).min
        )

    def _advance(self) -> Tensor:
        mask = self.valid & (self.slots <= self.slot)
        out: Any = self.step_model(
            input_ids=self.tok.unsqueeze(-1), attention_mask=self._attention(mask[:, None, None, :]),
            position_ids=self.pos.unsqueeze(-1), use_cache=True, **{self.cache_kw: self.cache},
        )
        self.pos.add_(1)
        self.slot.add_(1)
        logits: Tensor = out.logits[:, -1].float()
        return logits


class HFRolloutEngine(RolloutEngine):
    """A transformers causal LM generating responses with exact log-probs.

    Args:
        spec: The engine spec (role rollout; ``parallel`` must be all 1).
        options: Backend options (default: parsed from ``spec.options``).

    Raises:
        ConfigError: wrong role, parallel sizes other than 1, or a folder that is not a causal LM.
    """

    def __init__(self, spec: EngineSpec, options: HFOptions | None = None) -> None:
        if spec.role != "rollout":
            raise ConfigError(f"HFRolloutEngine needs role 'rollout', got {spec.role!r}")
        if spec.parallel.world_size != 1:
            raise ConfigError(
                f"the hf rollout engine runs on one device, got parallel={spec.parallel}; run one "
                "engine per data-parallel rank instead"
            )
        self._spec = spec
        self._options = options if options is not None else parse_options(
            HFOptions, spec.options, where="hf backend options"
        )
        self._device = torch.device(spec.device)
        # On CUDA, sdpa rollouts run decode steps that read a grouped KV cache once (the same math;
        # elsewhere transformers' own sdpa, so a CPU engine decodes like a user's model object).
        attn: str = self._options.attn_implementation
        if attn == "sdpa" and self._device.type == "cuda":
            attn = register_grouped_sdpa()
        self._model: Any = load_model(
            spec.model_path, "causal_lm", dtype=spec.torch_dtype, device=self._device,
            attn_implementation=attn, seed=spec.seed,
        )
        self._model.requires_grad_(False)
        # "auto" decode choices: the fast static path on CUDA, when the model allows a static cache
        self._options = self._options.resolve_rollout(self._device, static_ok=_full_attention(self._model.config))
        self._tied = bool(getattr(self._model.config, "tie_word_embeddings", False))
        self._vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self._tokenizer = load_tokenizer(spec.model_path, self._vocab_size)
        self._version = 0
        self._stale = False
        self._asleep = False
        self._weights: dict[str, Tensor] | None = None
        # Why CUDA-graph capture failed on this engine (it then decodes eagerly), None while it works.
        self._graphs_error: str | None = None
        if self._options.rollout_cuda_graphs and self._device.type != "cuda":
            raise ConfigError(
                f"HFOptions.rollout_cuda_graphs needs a CUDA device, the engine runs on {self._device}; "
                "leave it False off CUDA (rollout_cache='static' alone works on every device)"
            )
        self._expected: dict[str, TensorInfo] = {}
        # torch.compile of the model for decode steps (HFOptions.rollout_compile), made on first use.
        self._compiled: Any = None
        # The static decoder of the last shape and sampling configuration, kept for reuse.
        self._decoders: StaticDecoders[_StaticDecoder] = StaticDecoders()
        # The weights in one buffer, in export order (see FlatParameters); rebuilt on wake.
        self._flat: FlatParameters | None = FlatParameters.build(self._targets())
        # Pinned host memory the weight buffer sleeps in (allocated on the first sleep, then reused).
        self._host: Tensor | None = None

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
        return self._spec.torch_dtype  # type: ignore[no-any-return]

    @property
    def weight_version(self) -> int:
        """Version of the weights serving now."""
        return self._version

    @property
    def model(self) -> Any:
        """The underlying transformers model."""
        return self._model

    @property
    def decode_mode(self) -> str:
        """How ``generate`` decodes: ``dynamic``, ``static``, ``static+cuda-graphs``, ``static+compile``
        or ``static+compile+cuda-graphs`` (and why graphs are not used when capture failed)."""
        if self._options.rollout_cache == "dynamic":
            return "dynamic"
        if self._options.rollout_compile:
            base = "static+compile"
            if not self._options.rollout_cuda_graphs:
                return base
            if self._graphs_error is not None:
                return f"{base} (CUDA graph capture failed: {self._graphs_error})"
            return f"{base}+cuda-graphs"
        if not self._options.rollout_cuda_graphs:
            return "static"
        if self._graphs_error is not None:
            return f"static (CUDA graph capture failed: {self._graphs_error})"
        return "static+cuda-graphs"

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Always True: log-probs are taken before truncation at the sampling temperature."""
        return True

    # ------------------------------------------------------------------ generation
    def _validate(self, prompts: TensorBatch, params: SamplingParams) -> None:
        where = "HFRolloutEngine.generate"
        prompts.require("prompt_ids", "prompt_mask", "group_ids", where=where)
        prompts.check(where=where, vocab_size=self._vocab_size)
        if prompts.batch_size:
            longest = int(prompts["prompt_mask"].sum(1).max())
            if longest > self._spec.max_prompt_len:
                raise BatchValidationError(
                    f"{where}: longest prompt has {longest} tokens, more than max_prompt_len="
                    f"{self._spec.max_prompt_len}; raise it in the EngineSpec or shorten the prompts"
                )
        if params.max_new_tokens > self._spec.max_response_len:
            raise ConfigError(
                f"{where}: max_new_tokens={params.max_new_tokens} exceeds the engine's max_response_len="
                f"{self._spec.max_response_len}; lower it or raise max_response_len"
            )
        for t in params.stop_token_ids:
            if not 0 <= t < self._vocab_size:
                raise ConfigError(f"{where}: stop token id {t} is outside the vocabulary [0, {self._vocab_size})")
        check_generate_memory(prompts, params, device=self._device, vocab_size=self._vocab_size,
                              rows_at_once=self._options.rollout_batch_size, where=where)

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Sample ``params.n`` responses per prompt (see :meth:`RolloutEngine.generate`)."""
        if self._stale:
            raise StaleWeightsError(
                "HFRolloutEngine.generate: the last weight sync failed part-way, so the weights are "
                "inconsistent; run a complete update_weights before generating"
            )
        if self._asleep:
            raise ConfigError("HFRolloutEngine.generate: the engine is asleep; call wake() first")
        self._validate(prompts, params)
        pad = self._tokenizer.pad_token_id
        expanded, meta = expand_prompts(prompts, params, pad_token_id=pad, weight_version=self._version)
        size = expanded.batch_size
        if size == 0:
            empty = torch.zeros(0, 0, dtype=torch.int64, device=prompts.device)
            return expanded.update(
                response_ids=empty, response_mask=empty.bool(), rollout_log_probs=empty.float(),
                truncated=torch.zeros(0, dtype=torch.bool, device=prompts.device), meta=meta,
            )
        work = expanded.to(self._device)
        if params.seed is not None:
            seed = params.seed
        else:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        groups = work["group_ids"].tolist()
        indices = work["sample_index"].tolist()
        seeds = [sample_seed(seed, g, s) for g, s in zip(groups, indices)]
        step = self._options.rollout_batch_size or size
        parts: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
        for start in range(0, size, step):
            chunk = work.index(slice(start, start + step)).trim()
            parts.append(self._decode(chunk, seeds[start : start + step], params))
        width = max(int(p[0].shape[1]) for p in parts)

        def cat(i: int, fill: float | int | bool) -> Tensor:
            padded = []
            for p in parts:
                t = p[i]
                missing = width - t.shape[1]
                if missing:
                    t = torch.cat([t, torch.full((t.shape[0], missing), fill, dtype=t.dtype, device=t.device)], 1)
                padded.append(t)
            return torch.cat(padded, 0).to(prompts.device)

        return expanded.update(
            response_ids=cat(0, pad),
            response_mask=cat(1, False),
            rollout_log_probs=cat(2, 0.0),
            truncated=torch.cat([p[3] for p in parts]).to(prompts.device),
            meta=meta,
        )

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
            decoder.start(chunk, uniforms)
            if self._options.rollout_cuda_graphs and self._graphs_error is None:
                self._graphs_error = decoder.run_with_graph()
            else:
                # On a GPU, ask whether every row finished only every few steps (each ask is a sync).
                decoder.run(check_every=8 if self._device.type == "cuda" else 1)
            return decoder.result()
        sampler = TokenSampler(params, self._tokenizer.pad_token_id, stops, uniforms)
        return self._decode_dynamic(chunk, sampler, params.max_new_tokens)

    def _static_decoder(
        self, chunk: TensorBatch, params: SamplingParams, stop_ids: list[int], uniforms: Tensor | None
    ) -> _StaticDecoder:
        """The static decoder for this shape and sampling configuration (kept while they repeat;
        dropped on sleep/wake)."""
        rows, width = chunk["prompt_ids"].shape
        if self._options.rollout_compile and self._compiled is None:
            self._compiled = torch.compile(self._model, dynamic=False)

        def build(sampler: TokenSampler) -> _StaticDecoder:
            return _StaticDecoder(self._model, rows, width, sampler, params.max_new_tokens,
                                  eager_attention=self._options.attn_implementation == "eager",
                                  device=self._device, step_model=self._compiled)

        return self._decoders.get(self._model, rows, width, params, stop_ids, uniforms,
                                  self._tokenizer.pad_token_id, self._device, build)

    def _decode_dynamic(
        self, chunk: TensorBatch, sampler: TokenSampler, max_new: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The decode loop over transformers' DynamicCache (grows one column per step)."""
        model = self._model
        dev = self._device
        rows = chunk.batch_size
        ids = chunk["prompt_ids"]
        attn = chunk["prompt_mask"].long()
        pos = position_ids(attn)
        out: Any = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache_kw = cache_keyword(model)
        past = getattr(out, cache_kw)
        logits = out.logits[:, -1].float()
        cur = pos[:, -1]
        finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        toks: list[Tensor] = []
        masks: list[Tensor] = []
        lps: list[Tensor] = []
        for t in range(max_new):
            alive = ~finished
            tok, lp, stopped = sampler.step(logits, t, alive)
            toks.append(tok)
            masks.append(alive)
            lps.append(lp)
            finished = finished | stopped
            if bool(finished.all()) or t == max_new - 1:
                break
            attn = torch.cat([attn, torch.ones(rows, 1, dtype=attn.dtype, device=dev)], 1)
            cur = cur + 1
            out = model(
                input_ids=tok.unsqueeze(-1), attention_mask=attn, position_ids=cur.unsqueeze(-1),
                use_cache=True, **{cache_kw: past},
            )
            past = getattr(out, cache_kw)
            logits = out.logits[:, -1].float()
        return torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(lps, 1), ~finished

    # ------------------------------------------------------------------ weights
    def _targets(self) -> dict[str, Tensor]:
        """Name -> the live tensor a sync writes (parameters and persistent buffers), cached.

        Parameters keep their identity when the model moves between devices, buffers do not, so
        the cache is dropped on sleep and wake.
        """
        if self._weights is None:
            state = self._model.state_dict(keep_vars=True)
            names = export_order([n for n in state if not (self._tied and n == "lm_head.weight")])
            self._weights = {name: state[name] for name in names}
            self._expected = {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in self._weights.items()}
        return self._weights

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply a weight stream; on any failure the engine is stale until a complete sync.

        Each chunk's names, shapes and dtypes are checked, then it is copied straight into the
        live parameters with one multi-tensor copy (every byte is copied once); the finiteness of
        every chunk is read once, at the commit. Any failure leaves the engine stale rather than
        serving half-applied or non-finite weights.
        """
        self._stale = True
        targets = self._targets()
        flat = self._flat if self._flat is not None and self._flat.intact(targets) else None

        def apply(chunk: list[tuple[str, Tensor]]) -> None:
            tensors = [t for _, t in chunk]
            with torch.no_grad():
                # A chunk sent back to back (a sender's flat buffer) into a part of this engine's
                # buffer laid out alike: one copy. Otherwise one multi-tensor copy.
                src = contiguous_span(tensors) if flat is not None else None
                dst = flat.span([name for name, _ in chunk]) if flat is not None and src is not None else None
                if src is not None and dst is not None and dst.numel() == src.numel():
                    dst.copy_(src)
                else:
                    torch._foreach_copy_([targets[name] for name, _ in chunk], tensors)

        optional = frozenset({"lm_head.weight"}) if self._tied else frozenset()
        # The engine is stale until this returns, so the finiteness checks may wait for the commit:
        # one host synchronisation per sync instead of one per chunk.
        manifest = apply_weight_stream(stream, self._expected, apply, optional=optional, copy=False,
                                       defer_checks=True)
        self._version = manifest.version
        self._stale = False

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
        self._stale = True
        targets = self._targets()
        src: list[Tensor] = []
        for name, info in self._expected.items():
            t = state.get(name)
            if t is None or tuple(t.shape) != info.shape or t.dtype != info.dtype:
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise WeightSyncError(
                    f"direct weight sync: {name!r} is {got} in the actor, the rollout model has "
                    f"{info.shape} {info.dtype}; the two engines must load the same architecture and dtype"
                )
            src.append(t.detach())
        extra = sorted(set(state) - set(targets) - ({"lm_head.weight"} if self._tied else set()))
        if extra:
            raise WeightSyncError(
                f"direct weight sync: the actor has tensors the rollout model lacks, e.g. {extra[:3]}; "
                "the two engines must load the same architecture"
            )
        with torch.no_grad():
            # Check and copy are queued back to back; the one host sync comes last. A non-finite
            # tensor then raises with the engine stale (its weights are not served).
            finite = all_finite_flag(src)
            torch._foreach_copy_(list(targets.values()), src)
            if finite is not None and not bool(finite):
                bad = first_non_finite(list(zip(targets, src)))
                if bad is not None:
                    raise WeightSyncError(f"weight {bad!r} holds NaN/inf; refusing to serve it")
        self._version = version
        self._stale = False
        return sum(t.numel() * t.element_size() for t in src)

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
        if (source is None or flat is None or not flat.same_layout(source)
                or source.buffer.device != flat.buffer.device):
            return None
        self._stale = True
        with torch.no_grad():
            norm = torch.linalg.vector_norm(source.buffer)
            flat.buffer.copy_(source.buffer)
        state = actor._live_state()
        if not (source.intact(state) and flat.intact(self._targets())):
            return None
        if not bool(norm.isfinite()):
            bad = first_non_finite([(name, state[name]) for name in source.names])
            if bad is not None:
                raise WeightSyncError(f"weight {bad!r} holds NaN/inf; refusing to serve it")
        self._version = version
        self._stale = False
        return sum(math.prod(shape) for shape in source.shapes) * source.buffer.element_size()

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Move the model to CPU on CUDA, freeing its device memory (a no-op on CPU).

        The weight buffer goes in one copy into pinned host memory that is kept for the next
        sleep (what a colocated trainer does every step); whatever is not in the buffer moves
        with ``Module.to``.
        """
        if self._device.type != "cpu" and not self._asleep:
            self._weights = None
            self._decoders.clear()
            targets = self._targets()
            if self._flat is not None and self._flat.intact(targets):
                host = self._host
                if host is None or host.numel() != self._flat.buffer.numel() or host.dtype != self._flat.buffer.dtype:
                    host = self._host = torch.empty_like(self._flat.buffer, device="cpu", pin_memory=True)
                self._flat = self._flat.moved(targets, host)
            else:
                self._flat = None
            self._model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = self._device.type != "cpu"

    def wake(self) -> None:
        """Move the model back to its device (the weight buffer in one copy)."""
        if self._asleep:
            self._weights = None
            self._decoders.clear()
            targets = self._targets()
            flat = self._flat if self._flat is not None and self._flat.intact(targets) else None
            if flat is not None:
                flat = flat.moved(targets, torch.empty_like(flat.buffer, device=self._device))
            self._model.to(self._device)
            self._flat = flat if flat is not None else FlatParameters.build(self._targets())
            self._asleep = False

    def close(self) -> None:
        """Drop the model."""
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
    offloaded); every other case, and every other engine pair, runs the canonical stream.

    Args:
        bucket_bytes: Bytes per chunk when falling back to the canonical stream.
    """

    def __init__(self, bucket_bytes: int = 256 * 1024 * 1024) -> None:
        self._stream = StreamWeightSync(bucket_bytes)

    def sync(self, source: TrainingEngine, target: RolloutEngine, *, version: int) -> SyncReport:
        """Copy ``source``'s weights into ``target`` as ``version``."""
        from verl_hf.training import HFTrainingEngine

        if not (isinstance(source, HFTrainingEngine) and isinstance(target, HFRolloutEngine)):
            return self._stream.sync(source, target, version=version)
        t0 = time.perf_counter()
        moved = target._load_flat(source, version=version)
        if moved is not None:
            return SyncReport(version, len(target._expected), moved, time.perf_counter() - t0)
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
        return SyncReport(version, len(target._expected), moved, time.perf_counter() - t0)


def build_rollout_engine(spec: EngineSpec) -> HFRolloutEngine:
    """Factory of the ``hf`` backend's rollout engine."""
    return HFRolloutEngine(spec)


def _full_attention(config: Any) -> bool:
    """Whether every layer of the model attends to the whole context (a static KV cache fits it)."""
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return False
    return not bool(getattr(config, "use_sliding_window", False))
