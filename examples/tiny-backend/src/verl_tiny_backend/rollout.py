"""The rollout engine: seeded sampling with the engine kit's helpers, no KV cache, weight updates."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from verl_core import (
    BatchValidationError,
    EngineSpec,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    TensorInfo,
    Tokenizer,
    WeightMessage,
    apply_weight_stream,
)
from verl_core.enginekit.hf_tokenizer import load_tokenizer
from verl_core.enginekit.memory import check_generate_memory
from verl_core.enginekit.sampling import TokenSampler, sample_seed, uniform_table
from verl_tiny_backend.model import Model
from verl_tiny_backend.plugin import ROLLOUT_CAPABILITIES
from verl_tiny_backend.training import DTYPES, validate

__all__ = ["TinyRolloutEngine", "build_rollout_engine"]


class TinyRolloutEngine(RolloutEngine):
    """Samples by recomputing the whole sequence each step (fine for the suite's tiny models).

    Args:
        spec: What to build; ``spec.model_path`` is a Llama, Qwen2 or Qwen3 transformers folder.

    Raises:
        ConfigError: the folder's architecture is not supported.
    """

    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self.model = Model.from_folder(spec.model_path, DTYPES[spec.dtype])
        self._tok = load_tokenizer(spec.model_path, self.model.cfg.vocab_size)
        self._version = 0
        self._stale = False

    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> RolloutCapabilities:
        """What this engine supports."""
        return ROLLOUT_CAPABILITIES

    @property
    def tokenizer(self) -> Tokenizer:
        """The folder's tokenizer."""
        return self._tok

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype a weight stream must carry."""
        return DTYPES[self._spec.dtype]

    @property
    def weight_version(self) -> int:
        """The version of the last applied stream (0 = as loaded)."""
        return self._version

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Always exact: log-probs are of the untruncated tempered distribution."""
        return True

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Sample ``params.n`` responses per prompt; each sample's stream depends on (seed, group, index)."""
        if self._stale:
            raise StaleWeightsError("generate: the last weight sync failed; a complete sync must succeed first")
        vocab = self.model.cfg.vocab_size
        p = validate(prompts, "generate", ("prompt_ids", "prompt_mask", "group_ids"), vocab)
        longest = int(p["prompt_mask"].sum(1).max())
        if longest > self._spec.max_prompt_len:
            raise BatchValidationError(f"generate: a prompt has {longest} tokens, more than "
                                       f"EngineSpec.max_prompt_len={self._spec.max_prompt_len}")
        check_generate_memory(p, params, device="cpu", vocab_size=vocab)
        b = p.repeat_interleave(params.n)  # adds sample_index 0..n-1 within each group
        rows = b.batch_size
        pad, eos = self._tok.pad_token_id, self._tok.eos_token_id
        uniforms = None
        if not params.greedy:
            if params.seed is None:
                seeds = [int(s) for s in torch.randint(0, 2**62, (rows,)).tolist()]
            else:
                seeds = [sample_seed(params.seed, int(g), int(i))
                         for g, i in zip(b["group_ids"].tolist(), b["sample_index"].tolist(), strict=True)]
            uniforms = uniform_table(seeds, params.max_new_tokens)
        sampler = TokenSampler(params, pad, torch.tensor([eos, *params.stop_token_ids]), uniforms)
        ids, mask = b["prompt_ids"], b["prompt_mask"]
        toks: list[Tensor] = []
        masks: list[Tensor] = []
        lps: list[Tensor] = []
        alive = torch.ones(rows, dtype=torch.bool)
        with torch.no_grad():
            for t in range(params.max_new_tokens):
                logits = self.model.logits(self.model.hidden(ids, mask)[:, -1])
                tok, lp, stopped = sampler.step(logits, t, alive)
                toks.append(tok)
                masks.append(alive.clone())
                lps.append(lp)
                ids = torch.cat([ids, tok[:, None]], 1)
                mask = torch.cat([mask, alive[:, None]], 1)
                alive = alive & ~stopped
                if not bool(alive.any()):
                    break
        meta = b.meta.__class__(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                pad_token_id=pad, weight_version=self._version, step=b.meta.step)
        return b.update({"response_ids": torch.stack(toks, 1), "response_mask": torch.stack(masks, 1),
                         "rollout_log_probs": torch.stack(lps, 1).float(), "truncated": alive.clone()},
                        meta=meta)

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Check the whole stream, then copy it in; any failure leaves the engine stale."""
        staged: dict[str, Tensor] = {}
        self._stale = True
        expected = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in self.model.named_parameters()}
        manifest = apply_weight_stream(stream, expected, staged.update)
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, tensor in staged.items():
                params[name].copy_(tensor)
        self._version = manifest.version
        self._stale = False


def build_rollout_engine(spec: EngineSpec) -> TinyRolloutEngine:
    """The factory the entry point names for the rollout role."""
    return TinyRolloutEngine(spec)
