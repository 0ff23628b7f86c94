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
import hashlib
from collections.abc import Iterable
from typing import Any, Final

import torch
from torch import Tensor

from verl_core.batch import TensorBatch
from verl_core.capabilities import RolloutCapabilities
from verl_core.engine import EngineSpec
from verl_core.errors import BatchValidationError, ConfigError, StaleWeightsError
from verl_core.registry import parse_options
from verl_core.rollout import RolloutEngine, SamplingParams
from verl_core.schema import FIELDS
from verl_core.weights import TensorInfo, WeightMessage, apply_weight_stream
from verl_hf.capabilities import ROLLOUT_CAPABILITIES
from verl_hf.config import HFOptions
from verl_hf.modeling import check_prompts_nonempty, load_model, position_ids
from verl_hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFRolloutEngine", "build_rollout_engine", "sample_seed"]

_MASK63: Final = (1 << 63) - 1


def sample_seed(seed: int, group_id: int, sample_index: int) -> int:
    """The seed of one sample's random stream: a hash of (seed, group id, sample index)."""
    digest = hashlib.blake2b(f"{seed}:{group_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def _truncate(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Probabilities of softmax(scaled) restricted to the top-k / nucleus set (renormalised later)."""
    probs = torch.softmax(scaled, -1)
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        probs = torch.where(scaled >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = before < top_p * sorted_p.sum(-1, keepdim=True)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs


def _pick(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Invert the CDF of ``probs`` (unnormalised, vocabulary order) at ``uniforms`` [rows]."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tok.clamp_max(probs.shape[-1] - 1)


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
        self._model: Any = load_model(
            spec.model_path, "causal_lm", dtype=spec.torch_dtype, device=self._device,
            attn_implementation=self._options.attn_implementation, seed=spec.seed,
        )
        self._model.requires_grad_(False)
        self._tied = bool(getattr(self._model.config, "tie_word_embeddings", False))
        self._vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self._tokenizer = load_tokenizer(spec.model_path, self._vocab_size)
        self._version = 0
        self._stale = False
        self._asleep = False

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

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Always True: log-probs are taken before truncation at the sampling temperature."""
        return True

    # ------------------------------------------------------------------ generation
    def _validate(self, prompts: TensorBatch, params: SamplingParams) -> None:
        where = "HFRolloutEngine.generate"
        prompts.require("prompt_ids", "prompt_mask", "group_ids", where=where)
        prompts.check(where=where, vocab_size=self._vocab_size)
        check_prompts_nonempty(prompts, where)
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
        base = prompts.drop(*[n for n, f in FIELDS.items() if "response" in f.dims or n == "truncated"])
        expanded = base.repeat_interleave(params.n)
        pad = self._tokenizer.pad_token_id
        meta = dataclasses.replace(
            prompts.meta, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            pad_token_id=pad, weight_version=self._version,
        )
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

    @torch.no_grad()
    def _decode(
        self, chunk: TensorBatch, seeds: list[int], params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Decode one chunk: response ids, mask, log-probs [rows, steps] and truncated [rows]."""
        model = self._model
        dev = self._device
        rows = chunk.batch_size
        pad = self._tokenizer.pad_token_id
        stops = torch.tensor(
            sorted({self._tokenizer.eos_token_id, *params.stop_token_ids}), dtype=torch.int64, device=dev
        )
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        ids = chunk["prompt_ids"]
        attn = chunk["prompt_mask"].long()
        pos = position_ids(attn)
        out: Any = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        logits = out.logits[:, -1].float()
        cur = pos[:, -1]
        finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        toks: list[Tensor] = []
        masks: list[Tensor] = []
        lps: list[Tensor] = []
        temp = params.temperature
        for t in range(params.max_new_tokens):
            scaled = logits / temp if temp != 1.0 else logits
            logp = torch.log_softmax(scaled, -1)
            if params.greedy:
                tok = torch.argmax(logits, -1)
            else:
                u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens]).to(dev)
                tok = _pick(_truncate(scaled, params.top_k, params.top_p), u)
            alive = ~finished
            tok = torch.where(alive, tok, pad)
            lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            toks.append(tok)
            masks.append(alive)
            lps.append(torch.where(alive, lp, 0.0))
            finished = finished | (alive & torch.isin(tok, stops))
            if bool(finished.all()) or t == params.max_new_tokens - 1:
                break
            attn = torch.cat([attn, torch.ones(rows, 1, dtype=attn.dtype, device=dev)], 1)
            cur = cur + 1
            out = model(
                input_ids=tok.unsqueeze(-1), attention_mask=attn, position_ids=cur.unsqueeze(-1),
                past_key_values=past, use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1].float()
        return torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(lps, 1), ~finished

    # ------------------------------------------------------------------ weights
    def _expected(self) -> dict[str, TensorInfo]:
        return {
            name: TensorInfo(tuple(t.shape), t.dtype)
            for name, t in self._model.state_dict().items()
            if not (self._tied and name == "lm_head.weight")
        }

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Apply a weight stream; on any failure the engine is stale until a complete sync."""
        self._stale = True
        params = dict(self._model.state_dict())

        def apply(chunk: list[tuple[str, Tensor]]) -> None:
            with torch.no_grad():
                for name, tensor in chunk:
                    params[name].copy_(tensor)

        optional = frozenset({"lm_head.weight"}) if self._tied else frozenset()
        manifest = apply_weight_stream(stream, self._expected(), apply, optional=optional)
        self._version = manifest.version
        self._stale = False

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Move the model to CPU on CUDA (a no-op on CPU)."""
        if self._device.type != "cpu" and not self._asleep:
            self._model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = self._device.type != "cpu"

    def wake(self) -> None:
        """Move the model back to its device."""
        if self._asleep:
            self._model.to(self._device)
            self._asleep = False

    def close(self) -> None:
        """Drop the model."""
        self._model = None


def build_rollout_engine(spec: EngineSpec) -> HFRolloutEngine:
    """Factory of the ``hf`` backend's rollout engine."""
    return HFRolloutEngine(spec)
