"""A RolloutEngine around a megatron-core GPTModel the user built, optionally tensor parallel.

One switch, ``parallel``, turns tensor parallelism on: with ``parallel=ParallelConfig(tp=2)``
under ``torchrun --nproc_per_node 2`` the SDK initialises torch.distributed (gloo on CPU, nccl on
GPU) and Megatron's process groups, seeds every rank alike, and only then calls the user's builder,
so each rank builds its own shard. A GPTModel built with ``use_cpu_initialization=True`` draws the
full weights from the seed and keeps its shard, so the same builder gives the same model at any TP.

The model needs only GPTModel's forward ``model(input_ids, position_ids, attention_mask)`` returning
this rank's vocabulary slice of the logits (``parallel_output=True``); generation is
:class:`~verl_megatron.rollout.MegatronRolloutEngine`'s own seeded loop, so TP=2 samples what TP=1
samples. A model with ``generate_tokens`` (see :mod:`verl_core.enginekit.byo`) supplies the ids itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from verl_core import ConfigError, SamplingParams, TensorBatch, Tokenizer
from verl_core.enginekit.byo import (
    GeneratesTokens,
    as_tokenizer,
    generate_with_model,
    in_memory_spec,
)
from verl_core.enginekit.model_folder import check_tokenizer_ids
from verl_core.enginekit.sampling import GraphCaptures, StaticDecoders
from verl_megatron.convert import ModelDims, StateDictAdapter
from verl_megatron.logprobs import vocab_parallel_log_probs
from verl_megatron.options import MegatronOptions
from verl_megatron.parallel import ParallelConfig, ParallelState, init_distributed
from verl_megatron.rollout import MegatronRolloutEngine

__all__ = ["MegatronModelRollout", "ModelBuilder", "rollout_from_model"]

ModelBuilder = Callable[[ParallelState], nn.Module]
"""``build(state) -> GPTModel``: builds this rank's model once the process groups exist."""


def _dims_of(model: Any, vocab_size: int) -> ModelDims:
    """The shape of a GPTModel as the weight converters see it (read from its TransformerConfig)."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv = int(cfg.num_query_groups or heads)
    head_dim = int(cfg.kv_channels or cfg.hidden_size // heads)
    rope = getattr(getattr(model, "rotary_pos_emb", None), "rotary_base", None) or 10000.0
    return ModelDims(
        num_layers=int(cfg.num_layers), hidden_size=int(cfg.hidden_size), num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, ffn_size=int(cfg.ffn_hidden_size), vocab_size=vocab_size,
        qkv_bias=bool(getattr(cfg, "add_qkv_bias", False)), qk_norm=bool(getattr(cfg, "qk_layernorm", False)),
        tied=bool(getattr(model, "share_embeddings_and_output_weights", False)), head="lm",
        rms_norm_eps=float(getattr(cfg, "layernorm_epsilon", 1e-5)), rope_theta=float(rope),
        max_position=int(getattr(model, "max_sequence_length", 0) or 0),
    )


class MegatronModelRollout(MegatronRolloutEngine):
    """A :class:`MegatronRolloutEngine` over a GPTModel the caller built (pp = 1).

    Every rank of the group builds the engine alike and calls ``generate`` with the same prompts;
    every rank returns the same batch.

    Args:
        model: A GPTModel (process groups must already exist; the engine shares it, in eval mode)
            or a :data:`ModelBuilder` (the SDK creates the groups first, from ``parallel``).
        tokenizer: A :class:`verl_core.Tokenizer` or a transformers tokenizer.
        parallel: The tensor-parallel layout (None = TP 1); it must match groups created before.
        device: ``cpu`` or ``cuda``.
        seed: Seed of Megatron's RNG streams and of the torch RNG before ``build`` runs.
        max_prompt_len: Longest prompt accepted.
        max_response_len: Longest response generated.

    Raises:
        ConfigError: pp > 1, a model without ``parallel_output`` under TP, or a layout that does not
            fit the launched processes; a tokenizer whose pad, EOS or BOS id is not a row of the
            model's word embedding, all ranks' rows together
            (:func:`verl_core.enginekit.model_folder.check_tokenizer_ids`).
    """

    def __init__(
        self,
        model: nn.Module | ModelBuilder,
        tokenizer: Any,
        *,
        parallel: ParallelConfig | None = None,
        device: str = "cpu",
        seed: int = 0,
        max_prompt_len: int = 512,
        max_response_len: int = 512,
    ) -> None:
        config = parallel or ParallelConfig()
        if config.pp != 1:
            raise ConfigError(
                f"rollout_from_model runs tensor parallel only (pp=1), got pp={config.pp}; use tp for the split"
            )
        if device.startswith("cuda") and torch.cuda.is_available():
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        elif device == "cpu":
            self._device = torch.device("cpu")
        else:
            raise ConfigError(f"device must be 'cpu' or an available 'cuda', got {device!r}")
        state = init_distributed(config, device=self._device.type, seed=seed)
        from megatron.core import parallel_state as ps

        self.tp = state.tp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self._tp_group = ps.get_tensor_model_parallel_group()
        if isinstance(model, nn.Module):
            built = model
        else:
            torch.manual_seed(seed)  # every rank draws the same full weights
            built = model(state)
            if not isinstance(built, nn.Module):
                raise ConfigError(f"the model builder returned {type(built).__name__}, expected a GPTModel")
        if self.tp > 1 and not getattr(built, "parallel_output", True):
            raise ConfigError(
                "the GPTModel was built with parallel_output=False; under tensor parallelism the engine "
                "gathers the vocabulary slices itself: build it with parallel_output=True"
            )
        local_vocab = self._local_vocab(built)
        vocab = local_vocab * self.tp  # the embedding's rows over all ranks (a padded vocabulary counts its padding)
        check_tokenizer_ids(tokenizer, vocab)
        param = next(built.parameters())
        self._dtype = param.dtype
        self._spec = in_memory_spec(
            dtype=param.dtype, device=device, seed=seed, max_prompt_len=max_prompt_len,
            max_response_len=max_response_len, tp=self.tp,
        )
        self.dims = _dims_of(built, vocab)
        self.adapter = StateDictAdapter(self.dims)
        self.model = built.to(self._device)
        if not isinstance(model, nn.Module):  # built here, so the engine owns it
            self.model.requires_grad_(False)
        self.model.eval()
        self._tokenizer: Tokenizer = as_tokenizer(tokenizer, vocab)
        self._options = MegatronOptions()
        # decode by recomputing the sequence each step: it needs nothing of the model but its forward
        self._kv_cache = False
        self._decoders = StaticDecoders()
        self._graphs = GraphCaptures("megatron rollout")
        self._compiled = None
        self._user_generates = isinstance(built, GeneratesTokens)

    @staticmethod
    def _local_vocab(model: nn.Module) -> int:
        emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
        weight = getattr(emb, "weight", None)
        if not isinstance(weight, Tensor):
            raise ConfigError(
                f"expected a megatron-core GPTModel (embedding.word_embeddings.weight), got {type(model).__name__}"
            )
        return int(weight.shape[0])

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer given at construction."""
        return self._tokenizer

    @property
    def user_generates(self) -> bool:
        """True when the model's own ``generate_tokens`` supplies the response ids."""
        return self._user_generates

    def _decode(
        self, batch: TensorBatch, seeds: list[int], params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if not self._user_generates:
            return super()._decode(batch, seeds, params)
        tok = self._tokenizer
        return generate_with_model(
            self.model, batch["prompt_ids"].to(self._device), batch["prompt_mask"].to(self._device), seeds,
            params, stop_ids=[tok.eos_token_id, *params.stop_token_ids], pad_id=tok.pad_token_id,
            vocab_size=self.dims.vocab_size, score=self._score,
        )

    def _score(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, temperature: float
    ) -> Tensor:
        """Teacher-forced log-probs in the engine's left-shifted layout, vocabulary-parallel."""
        dev = self._device
        rows, p = prompt_ids.shape
        width = response_ids.shape[1]
        lengths = prompt_mask.sum(1)
        cols = torch.arange(p, device=dev).unsqueeze(0)
        src = (cols + (p - lengths).unsqueeze(1)).clamp(max=p - 1)
        pad = self._tokenizer.pad_token_id
        tokens = torch.full((rows, p + width), pad, dtype=torch.int64, device=dev)
        tokens[:, :p] = prompt_ids.gather(1, src).masked_fill(cols >= lengths.unsqueeze(1), pad)
        at = lengths.unsqueeze(1) + torch.arange(width, device=dev).unsqueeze(0)
        tokens.scatter_(1, at, response_ids)
        s = tokens.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=dev), 1).view(1, 1, s, s)
        positions = torch.arange(s, device=dev).unsqueeze(0).expand(rows, s)
        out: Tensor = self.model(tokens, positions, mask)  # [rows, s, vocab / tp]
        logits = out.gather(1, (at - 1).unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        group = self._tp_group if self.tp > 1 else None
        lp, _ = vocab_parallel_log_probs(
            logits, response_ids, vocab_start=self.tp_rank * out.shape[-1], tp_group=group, tp_size=self.tp,
            temperature=temperature,
        )
        return lp


def rollout_from_model(
    model: nn.Module | ModelBuilder,
    tokenizer: Any,
    *,
    parallel: ParallelConfig | None = None,
    device: str = "cpu",
    seed: int = 0,
    max_prompt_len: int = 512,
    max_response_len: int = 512,
) -> MegatronModelRollout:
    """A RolloutEngine around a GPTModel the caller built (see :class:`MegatronModelRollout`)."""
    return MegatronModelRollout(
        model, tokenizer, parallel=parallel, device=device, seed=seed, max_prompt_len=max_prompt_len,
        max_response_len=max_response_len,
    )
