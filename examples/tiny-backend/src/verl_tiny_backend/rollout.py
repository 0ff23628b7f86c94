"""The rollout engine: the engine kit's facade and seeded sampling, no KV cache, weight updates."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from verl_core import (
    EngineSpec,
    RolloutCapabilities,
    SamplingParams,
    TensorBatch,
    TensorInfo,
    Tokenizer,
    WeightMessage,
    apply_weight_stream,
)
from verl_core.enginekit.gates import refuse_undeclared
from verl_core.enginekit.hf_tokenizer import load_tokenizer
from verl_core.enginekit.rollout_base import GenerateLimits, Responses, RolloutEngineBase
from verl_core.enginekit.sampling import TokenSampler, uniform_table
from verl_tiny_backend.model import Model
from verl_tiny_backend.plugin import ROLLOUT_CAPABILITIES
from verl_tiny_backend.training import DTYPES

__all__ = ["TinyRolloutEngine", "build_rollout_engine"]


class TinyRolloutEngine(RolloutEngineBase):
    """Samples by recomputing the whole sequence each step (fine for the suite's tiny models).

    ``generate`` comes from :class:`~verl_core.enginekit.rollout_base.RolloutEngineBase`: it checks
    the request against :meth:`_generate_limits`, repeats each prompt ``n`` times and calls
    :meth:`_sample` with one seed per sample.

    Args:
        spec: What to build; ``spec.model_path`` is a Llama, Qwen2 or Qwen3 transformers folder.

    Raises:
        ConfigError: the folder's architecture is not supported.
    """

    def __init__(self, spec: EngineSpec) -> None:
        refuse_undeclared(spec, ROLLOUT_CAPABILITIES, engine="the tiny rollout engine")
        self._spec = spec
        self.model = Model.from_folder(spec.model_path, DTYPES[spec.dtype])
        self._tok = load_tokenizer(spec.model_path, self.model.cfg.vocab_size)

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

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Always exact: log-probs are of the untruncated tempered distribution."""
        return True

    def _generate_limits(self) -> GenerateLimits:
        vocab = self.model.cfg.vocab_size
        return GenerateLimits(vocab_size=vocab, device=torch.device("cpu"), logits_vocab=vocab)

    def _sample(self, rows: TensorBatch, params: SamplingParams, seeds: list[int]) -> Responses:
        """Each row's response; row r's draws come from ``seeds[r]`` (fixed by seed, group and index)."""
        pad, eos = self._tok.pad_token_id, self._tok.eos_token_id
        uniforms = None if params.greedy else uniform_table(seeds, params.max_new_tokens)
        sampler = TokenSampler(params, pad, torch.tensor([eos, *params.stop_token_ids]), uniforms)
        ids, mask = rows["prompt_ids"], rows["prompt_mask"]
        toks: list[Tensor] = []
        masks: list[Tensor] = []
        lps: list[Tensor] = []
        alive = torch.ones(rows.batch_size, dtype=torch.bool)
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
        return torch.stack(toks, 1), torch.stack(masks, 1), torch.stack(lps, 1).float(), alive.clone()

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Check the whole stream, then copy it in; any failure leaves the engine stale."""
        staged: dict[str, Tensor] = {}
        with self._writing_weights():  # stale until the commit below; stays stale if anything raises
            expected = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in self.model.named_parameters()}
            manifest = apply_weight_stream(stream, expected, staged.update)
            with torch.no_grad():
                params = dict(self.model.named_parameters())
                for name, tensor in staged.items():
                    params[name].copy_(tensor)
            self._commit_weights(manifest.version)


def build_rollout_engine(spec: EngineSpec) -> TinyRolloutEngine:
    """The factory the entry point names for the rollout role."""
    return TinyRolloutEngine(spec)
