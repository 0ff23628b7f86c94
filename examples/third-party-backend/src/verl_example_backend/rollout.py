"""The example backend's RolloutEngine: a sampling loop with per-sample seeded generators."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from verl_core import (
    ConfigError,
    EngineSpec,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    StaleWeightsError,
    TensorBatch,
    TensorInfo,
    WeightMessage,
    WeightSyncError,
    apply_weight_stream,
    parse_options,
)
from verl_core.enginekit.memory import check_generate_memory
from verl_core.enginekit.sampling import tempered_log_probs
from verl_example_backend.inputs import validate
from verl_example_backend.model import load_model
from verl_example_backend.plugin import ROLLOUT_CAPABILITIES, ExampleOptions
from verl_example_backend.tokenizer import FolderTokenizer

__all__ = ["ExampleRolloutEngine", "build_rollout_engine", "sample_seed"]

_MASK64 = (1 << 63) - 1


def sample_seed(seed: int, group_id: int, sample_index: int) -> int:
    """The seed of one sample's random stream: a fixed mix of (seed, group id, sample index)."""
    x = (seed * 0x9E3779B97F4A7C15 + group_id * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB)
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & _MASK64


def _truncate(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Logits with tokens outside the top-k / nucleus set at -inf (the sampling heuristics)."""
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class ExampleRolloutEngine(RolloutEngine):
    """Generates with a full forward per token (no KV cache): simple, exact, and slow on big models."""

    def __init__(self, spec: EngineSpec) -> None:
        options = parse_options(ExampleOptions, spec.options, where="example backend options")
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        if spec.parallel.world_size != 1 or spec.device != "cpu":
            raise ConfigError("the example backend's rollout runs in one process on cpu")
        if spec.dtype not in self.capabilities.dtypes:
            raise ConfigError(f"the example backend's rollout runs in {', '.join(sorted(self.capabilities.dtypes))}; "
                              f"got EngineSpec.dtype {spec.dtype!r}")
        self._spec = spec
        self.model = load_model(spec.model_path, spec.torch_dtype).eval()
        cfg = self.model.cfg
        if cfg.value_head:
            raise ConfigError(f"rollout needs a causal LM folder; {spec.model_path} has a value head")
        self._tokenizer = FolderTokenizer(
            spec.model_path, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
            vocab_size=cfg.vocab_size,
        )
        self._version = 0
        self._stale = False

    @property
    def spec(self) -> EngineSpec:
        """The spec the engine was built from."""
        return self._spec

    @property
    def capabilities(self) -> RolloutCapabilities:
        """Declared capabilities."""
        return ROLLOUT_CAPABILITIES

    @property
    def tokenizer(self) -> FolderTokenizer:
        """The folder's tokenizer."""
        return self._tokenizer

    @property
    def weight_dtype(self) -> torch.dtype:
        """Weights arrive in the model's dtype."""
        return self._spec.torch_dtype

    @property
    def weight_version(self) -> int:
        """Version serving now."""
        return self._version

    def log_probs_exact(self, params: SamplingParams) -> bool:
        """Always exact: log-probs come from the untruncated tempered distribution."""
        return True

    # ------------------------------------------------------------------ sampling
    def generators(self, batch: TensorBatch, params: SamplingParams) -> list[torch.Generator]:
        """One generator per sample, seeded from (seed, group id, sample index); a hook for subclasses."""
        gens = []
        gids = batch["group_ids"].tolist()
        idx = batch["sample_index"].tolist()
        for g, i in zip(gids, idx, strict=True):
            gen = torch.Generator()
            if params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(sample_seed(params.seed, int(g), int(i)))
            gens.append(gen)
        return gens

    def tempered_log_probs(self, logits: Tensor, params: SamplingParams) -> Tensor:
        """log softmax(logits / T) in float32: the reported log-prob distribution."""
        return tempered_log_probs(logits, params.temperature)

    def generate(self, prompts: TensorBatch, params: SamplingParams) -> TensorBatch:
        """Sample ``params.n`` responses per prompt, token by token."""
        if self._stale:
            raise StaleWeightsError(
                "the last weight sync failed; this engine serves no weights until a complete "
                "update_weights() succeeds"
            )
        if params.max_new_tokens > self._spec.max_response_len:
            raise ConfigError(
                f"max_new_tokens={params.max_new_tokens} exceeds EngineSpec.max_response_len="
                f"{self._spec.max_response_len}"
            )
        cfg = self.model.cfg
        prompts = validate(prompts, where="generate", needs=("prompt_ids", "prompt_mask", "group_ids"),
                           vocab_size=cfg.vocab_size, max_prompt_len=self._spec.max_prompt_len)
        check_generate_memory(prompts, params, device="cpu", vocab_size=cfg.vocab_size, where="generate")
        batch = prompts.repeat_interleave(params.n)
        gens = self.generators(batch, params)
        b = batch.batch_size
        pad, eos = cfg.pad_token_id, cfg.eos_token_id
        stops = torch.tensor([eos, *params.stop_token_ids], dtype=torch.int64)
        ids = batch["prompt_ids"]
        mask = batch["prompt_mask"]
        out_ids = torch.full((b, params.max_new_tokens), pad, dtype=torch.int64)
        out_mask = torch.zeros((b, params.max_new_tokens), dtype=torch.bool)
        out_lp = torch.zeros((b, params.max_new_tokens), dtype=torch.float32)
        done = torch.zeros(b, dtype=torch.bool)
        with torch.no_grad():
            for t in range(params.max_new_tokens):
                logits = self.model.logits(self.model.hidden(ids, mask)[:, -1]).float()
                logp = self.tempered_log_probs(logits, params)
                if params.greedy:
                    tokens = logits.argmax(-1)
                else:
                    probs = _truncate(logits / params.temperature, params.top_k, params.top_p).softmax(-1)
                    tokens = torch.stack([
                        torch.multinomial(probs[i], 1, generator=gens[i])[0] for i in range(b)
                    ])
                live = ~done
                tokens = torch.where(live, tokens, torch.full_like(tokens, pad))
                out_ids[:, t] = tokens
                out_mask[:, t] = live
                out_lp[:, t] = torch.where(live, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), 0.0)
                done = done | (live & torch.isin(tokens, stops))
                ids = torch.cat([ids, tokens.unsqueeze(1)], 1)
                mask = torch.cat([mask, live.unsqueeze(1)], 1)
                if bool(done.all()):
                    out_ids, out_mask, out_lp = out_ids[:, : t + 1], out_mask[:, : t + 1], out_lp[:, : t + 1]
                    break
        lengths = out_mask.sum(1)
        truncated = ~done & (lengths == params.max_new_tokens)
        meta = batch.meta.__class__(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            pad_token_id=pad, weight_version=self._version, step=batch.meta.step,
        )
        return batch.update(
            {"response_ids": out_ids, "response_mask": out_mask, "rollout_log_probs": out_lp,
             "truncated": truncated},
            meta=meta,
        )

    # ------------------------------------------------------------------ weights
    def expected_weights(self) -> dict[str, TensorInfo]:
        """Name -> shape/dtype of every tensor a weight stream must carry."""
        return {n: TensorInfo(tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}

    def update_weights(self, stream: Iterable[WeightMessage]) -> None:
        """Receive a full stream; apply on commit; on any failure become stale."""
        staged: dict[str, Tensor] = {}
        self._stale = True
        try:
            manifest = apply_weight_stream(
                stream, self.expected_weights(), lambda chunk: staged.update(chunk),
                optional=frozenset({"lm_head.weight"}) if self.model.cfg.tied else frozenset(),
            )
        except WeightSyncError:
            raise
        except Exception as e:
            raise WeightSyncError(f"weight stream failed: {e}") from e
        if self.model.cfg.tied:
            staged.pop("lm_head.weight", None)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in staged.items():
                params[name].copy_(t)
        self._version = manifest.version
        self._stale = False


def build_rollout_engine(spec: EngineSpec) -> ExampleRolloutEngine:
    """Factory named in the BackendSpec."""
    return ExampleRolloutEngine(spec)
