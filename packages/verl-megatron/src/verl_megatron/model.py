"""Build this rank's megatron-core GPTModel stage from a transformers folder and load its weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verl_core.enginekit.model_folder import check_layer_types, check_special_token_ids
from verl_core.kernel.errors import ConfigError
from verl_megatron.convert import HeadKind, ModelDims, StateDictAdapter

__all__ = ["AttentionKind", "ValueHead", "build_stage", "load_hf_state_dict", "sdpa_attention_class", "seeded_value_head",
           "transformer_config"]

AttentionKind = Literal["local", "sdpa"]
"""Core attention of the layer spec: megatron-core's DotProductAttention or torch's SDPA."""


def sdpa_attention_class() -> type:
    """A megatron-core core-attention module computing with ``torch.nn.functional.scaled_dot_product_attention``.

    It relies on the engines' layout: every row's real tokens come first and padding trails them,
    so a causal mask is the whole mask (``is_causal=True``: flash/efficient kernels on GPU) and the
    ``attention_mask`` Megatron passes is not read, unless the module's ``explicit_mask`` attribute
    is True (the rollout engine's KV-cached decoding sets it): then ``attention_mask``
    ([batch or 1, 1, queries, keys], True = masked) is the mask. Query groups are expanded to heads
    the same way as Megatron's DotProductAttention (head h uses group h // heads-per-group).

    With ``packed_seq_params`` (``qkv_format="thd"``: the training engine's packed micro-batches,
    :mod:`verl_megatron.packed`, :mod:`verl_core.enginekit.packed_attention`) queries are ``[tokens, heads, d]``, keys/values ``[tokens,
    groups, d]``, and each sequence between consecutive ``cu_seqlens_q`` attends causally to itself
    only; the result is ``[tokens, heads * d]``.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):  # type: ignore[misc]
        """Causal core attention through torch's scaled_dot_product_attention."""

        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> Tensor:
            """[sq, b, heads, d] queries and [sk, b, groups, d] keys/values -> [sq, b, heads * d]."""
            if attention_bias is not None:
                raise NotImplementedError("SDPAttention does not support attention_bias")
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params)
            cache = getattr(self, "static_cache", None)
            if cache is not None:  # the rollout's static decode loop (verl_megatron.static_decode)
                assert attention_mask is not None
                out: Tensor = cache.attend(query, key, value, attention_mask, self.softmax_scale)
                return out
            sq, b, heads, d = query.shape
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            rep = heads // k.shape[1]
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            mask = ~attention_mask if getattr(self, "explicit_mask", False) and attention_mask is not None else None
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None,
                scale=self.softmax_scale, dropout_p=self.attention_dropout.p if self.training else 0.0,
            )
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)

        def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: Any) -> Tensor:
            from verl_core.enginekit.packed_attention import packed_causal_attention

            cu = params.cu_seqlens_q
            kv = params.cu_seqlens_kv
            if (params.qkv_format != "thd" or query.dim() != 3 or kv is None
                    or (kv is not cu and not torch.equal(kv, cu))
                    or params.cu_seqlens_q_padded is not None
                    or (self.training and self.attention_dropout.p > 0)):
                raise NotImplementedError(
                    "SDPAttention's packed sequences take qkv_format='thd' self-attention with the same "
                    "unpadded cu_seqlens for queries and keys, and no attention dropout"
                )
            out = packed_causal_attention(query, key, value, cu, params.max_seqlen_q, self.softmax_scale)
            return out.reshape(out.shape[0], -1)

    return SDPAttention


class ValueHead(nn.Module):
    """A critic's scalar head on the final hidden states, replicated on every TP rank.

    Takes the place of GPTModel's output layer (same call signature), so the rest of the model is
    Megatron's own. The input (after the final norm) is identical on all TP ranks, hence so are
    this head's gradients.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = False

    def forward(self, hidden: Tensor, weight: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
        """Values [seq, batch, 1] of hidden states [seq, batch, hidden]."""
        return F.linear(hidden, self.weight, self.bias), None


def transformer_config(
    dims: ModelDims, *, tp: int, pp: int, dtype: torch.dtype, recompute: bool = False
) -> Any:
    """Megatron's TransformerConfig for ``dims`` (CPU-safe fusions off, float32 reductions)."""
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = {}
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_size,
        normalization="RMSNorm",
        layernorm_epsilon=dims.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        batch_p2p_comm=False,
        batch_p2p_sync=False,
        calculate_per_token_loss=True,
        **kwargs,
    )


def load_hf_state_dict(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """All tensors of a transformers folder's safetensors files (single or sharded)."""
    from safetensors.torch import load_file

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no *.safetensors weights; save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def seeded_value_head(path: str | os.PathLike[str], hidden_size: int, seed: int) -> dict[str, Tensor]:
    """A value head (``score.weight [1, hidden]``, ``score.bias [1]``) for a critic built on a causal-LM
    folder (the policy's, where a run names no ``critic_model``): the weight from ``normal(0,
    initializer_range)`` of the folder's config under ``torch.manual_seed(seed)`` (the caller's
    generator untouched), the bias 0, as the ``hf`` backend initialises transformers' head."""
    from transformers import AutoConfig

    std = float(getattr(AutoConfig.from_pretrained(str(path), trust_remote_code=False), "initializer_range", 0.02))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        weight = torch.empty(1, hidden_size, dtype=torch.float32).normal_(0.0, std)
    return {"score.weight": weight, "score.bias": torch.zeros(1, dtype=torch.float32)}


def build_stage(
    dims: ModelDims,
    *,
    tp: int,
    pp: int,
    pp_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    recompute: bool = False,
    attention: AttentionKind = "local",
    pg_collection: Any = None,
) -> Any:
    """This rank's GPTModel stage (local layer spec, optionally SDPA core attention), weights uninitialised.

    ``pg_collection`` (a megatron ``ProcessGroupCollection``) gives the model its own process
    groups; None uses Megatron's global parallel state.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(dims, tp=tp, pp=pp, dtype=dtype, recompute=recompute)
    spec = get_gpt_layer_local_spec(qk_layernorm=dims.qk_norm, normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=dims.vocab_size,
        max_sequence_length=dims.max_position,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=dims.tied,
        position_embedding_type="rope",
        rotary_base=int(dims.rope_theta) if float(dims.rope_theta).is_integer() else dims.rope_theta,
        pg_collection=pg_collection,
    )
    if dims.head == "value" and pp_rank == pp - 1:
        model.output_layer = ValueHead(dims.hidden_size, dtype)
    if pp_rank == 0 and dims.pad_token_id is not None:
        model.embedding.word_embeddings.register_forward_hook(_padding_idx_hook(dims.pad_token_id))
    # The local spec's torch norms are built in float32 whatever params_dtype says; a float32
    # norm weight under bfloat16 activations misses the fused kernel. Parameters only: buffers
    # (e.g. rotary frequencies) keep their precision.
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    _mark_tensor_parallel(model)
    return model.to(device)


def _padding_idx_hook(pad: int) -> Any:
    """A forward hook on the word embedding that gives its pad row no gradient from the lookup
    (transformers' ``padding_idx``): the outputs at the pad id's positions, a real token's too,
    are detached. The values are unchanged; on a tied model the output layer's share of the row's
    gradient stays."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        ids = args[0]
        if ids.shape != output.shape[:-1]:
            return output  # not the [batch, seq] lookup this hook knows (left as megatron computes it)
        return torch.where((ids == pad).unsqueeze(-1), output.detach(), output)

    return hook


def _mark_tensor_parallel(model: nn.Module) -> None:
    """Set megatron's tensor-parallel attributes on the split weights where the layers left them unset.

    With ``perform_initialization=False`` megatron-core 0.16 creates the weights of its parallel
    linear and embedding layers without ``tensor_model_parallel`` / ``partition_dim`` (0.19 sets
    them); its optimizer needs them to count each split weight on every TP rank and a
    replicated one on one rank only when it computes the gradient norm.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=0, stride=1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=1, stride=1)


def load_stage_weights(
    model: nn.Module,
    adapter: StateDictAdapter,
    full: dict[str, Tensor],
    *,
    tp_rank: int,
    tp: int,
    pp_rank: int,
    pp: int,
) -> None:
    """Copy this rank's shards of the full Megatron state dict ``full`` into ``model``.

    Raises:
        RuntimeError: a tensor is missing, unexpected or of the wrong shape.
    """
    params = dict(model.named_parameters())
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    loaded: set[str] = set()
    with torch.no_grad():
        for global_name, local in adapter.stage_names(pp_rank, pp):
            if local not in params:
                raise RuntimeError(f"Megatron model has no parameter {local!r} (for {global_name!r})")
            shard = adapter.shard(_partition_name(global_name, local), full[global_name], tp_rank, tp)
            p = params[local]
            if tuple(shard.shape) != tuple(p.shape):
                raise RuntimeError(
                    f"{local}: converted shard has shape {tuple(shard.shape)}, the model expects "
                    f"{tuple(p.shape)} (tp={tp}, pp={pp})"
                )
            p.copy_(shard.to(p.dtype))
            loaded.add(local)
    left = sorted(expected - loaded)
    if left:
        raise RuntimeError(f"no weights were loaded for {left[:5]}")


def _partition_name(global_name: str, local: str) -> str:
    # A tied output layer on the last stage is split like the output layer (by vocabulary rows).
    return local if local == "output_layer.weight" else global_name


def model_dims(path: str | os.PathLike[str], head: HeadKind) -> ModelDims:
    """The dims of the transformers folder ``path``: every refusal of a model folder the engines make.

    It reads only the folder's files (no process group, no weights), so the engines call it before
    any distributed set-up: a folder they cannot run costs no ``torch.distributed`` initialisation.

    Raises:
        ConfigError: ``config.json`` cannot be read as a transformers config; an architecture or
            feature the converter does not handle (:meth:`ModelDims.from_hf_config`: the family,
            a RoPE scaling, biases, sliding windows); a pad, EOS or BOS id outside
            ``[0, vocab_size)`` in ``config.json``, ``generation_config.json`` or the tokenizer's
            files (:func:`verl_core.enginekit.model_folder.check_special_token_ids`). The message
            names the folder.
    """
    from transformers import AutoConfig

    check_special_token_ids(path)
    check_layer_types(path)  # sliding_attention layers without a window
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"cannot read the config of model folder {str(path)!r} with transformers ({type(e).__name__}: {e}); "
            "expected a transformers folder whose config.json names a llama, qwen2 or qwen3 model"
        ) from e
    try:
        return ModelDims.from_hf_config(config, head)
    except ConfigError as e:
        raise ConfigError(f"model folder {str(path)!r}: {e}") from e
