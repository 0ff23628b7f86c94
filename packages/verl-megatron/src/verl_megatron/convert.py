"""Converters between transformers and Megatron (local spec) weight layouts, TP-sharded and PP-staged.

One :class:`StateDictAdapter` per model: ``from_hf`` and ``to_hf`` map whole state dicts
(Megatron names use global layer numbers, TP=1), :meth:`StateDictAdapter.shard` /
:meth:`StateDictAdapter.unshard` split and join one tensor for tensor parallelism, and
:meth:`StateDictAdapter.stage_names` picks the tensors a pipeline stage holds.

Layout facts (Llama, Qwen2 with QKV bias, Qwen3 with QK norm; checked numerically):

* ``linear_qkv`` holds, per query group g, ``[q heads of g; k_g; v_g]`` stacked on dim 0;
* ``linear_fc1`` is ``[gate; up]``; under TP each rank holds ``[its gate slice; its up slice]``;
* ``linear_qkv`` shards on dim 0 by whole groups, ``linear_proj``/``linear_fc2`` on dim 1,
  embedding and output layer by vocabulary rows; norms (and a value head) are replicated.

This module imports no megatron code: it is plain tensor bookkeeping.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
from torch import Tensor

from verl_core import ConfigError

__all__ = ["ModelDims", "Partition", "StateDictAdapter"]

HeadKind = Literal["lm", "value"]
Partition = Literal["rows", "cols", "fc1", "replicated"]
"""How a Megatron tensor splits under TP: dim 0, dim 1, gate/up-wise on dim 0, or not at all."""

_LAYER_RE: Final = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE: Final = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Per-layer 1:1 names (megatron suffix -> transformers suffix).
_LAYER_SIMPLE: Final = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


@dataclass(frozen=True)
class ModelDims:
    """The shape of a Llama/Qwen2/Qwen3 decoder as both layouts need it.

    Attributes:
        num_layers: Decoder layers.
        hidden_size: Model width.
        num_heads: Attention (query) heads.
        num_kv_heads: Key/value heads (query groups).
        head_dim: Per-head width.
        ffn_size: MLP intermediate width.
        vocab_size: Embedding rows.
        qkv_bias: q/k/v projections have a bias (Qwen2).
        qk_norm: Per-head RMS norm of queries and keys (Qwen3).
        tied: The output layer shares the input embedding.
        head: ``lm`` (a vocabulary output layer) or ``value`` (a 1-unit score head with bias).
        rms_norm_eps: Epsilon of every RMS norm.
        rope_theta: RoPE base.
        max_position: Longest sequence.
        pad_token_id: The config's pad id (None where it has none): the embedding row that gets no
            gradient from the lookup, as transformers' ``nn.Embedding(..., padding_idx=...)``.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    head: HeadKind
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    pad_token_id: int | None = None

    @classmethod
    def from_hf_config(cls, config: Any, head: HeadKind = "lm") -> ModelDims:
        """Read the dims of a transformers Llama/Qwen2/Qwen3 config.

        Raises:
            ConfigError: an architecture or feature this converter does not handle.
        """
        model_type = getattr(config, "model_type", "")
        if model_type not in ("llama", "qwen2", "qwen3"):
            raise ConfigError(
                f"verl-megatron converts llama, qwen2 and qwen3 models, got model_type={model_type!r}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"only default RoPE is supported, got rope_type={rope_type!r}")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ConfigError("the config names no rope_theta")
        heads = int(config.num_attention_heads)
        if model_type == "llama":
            qkv_bias = bool(getattr(config, "attention_bias", False))
            if getattr(config, "mlp_bias", False):
                raise ConfigError("llama models with mlp_bias=True are not supported")
        else:
            qkv_bias = model_type == "qwen2"
        if model_type == "qwen3" and getattr(config, "attention_bias", False):
            raise ConfigError("qwen3 models with attention_bias=True are not supported")
        if getattr(config, "use_sliding_window", False):
            raise ConfigError("sliding-window attention is not supported")
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            ffn_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            tied=bool(getattr(config, "tie_word_embeddings", False)) and head == "lm",
            head=head,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta),
            max_position=int(config.max_position_embeddings),
            pad_token_id=_pad_id(getattr(config, "pad_token_id", None), int(config.vocab_size)),
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise ConfigError naming the first dim that ``tp``/``pp`` does not divide."""
        for what, n, by in (
            ("attention heads", self.num_heads, tp),
            ("key/value heads (query groups)", self.num_kv_heads, tp),
            ("vocabulary size", self.vocab_size, tp),
            ("MLP width", self.ffn_size, tp),
            ("layers", self.num_layers, pp),
        ):
            if n % by != 0:
                axis = "tp" if by == tp else "pp"
                raise ConfigError(
                    f"{axis}={by} does not divide the model's {what} ({n}); choose a {axis} that "
                    f"divides {n}"
                )


class StateDictAdapter:
    """Maps weights between transformers naming and Megatron's local-spec GPTModel naming.

    Args:
        dims: The model's shape.
    """

    def __init__(self, dims: ModelDims) -> None:
        self.dims = dims

    # ------------------------------------------------------------------ names
    def hf_head_names(self) -> tuple[str, ...]:
        """Names of the output head in transformers naming (empty when tied)."""
        if self.dims.head == "value":
            return ("score.weight", "score.bias")
        return () if self.dims.tied else ("lm_head.weight",)

    def megatron_names(self) -> list[str]:
        """Every Megatron tensor name (global layer numbers), in stream order."""
        d = self.dims
        names = ["embedding.word_embeddings.weight"]
        for i in range(d.num_layers):
            names.extend(f"decoder.layers.{i}.{s}" for s in self._layer_suffixes())
        names.append("decoder.final_layernorm.weight")
        if d.head == "value":
            names.extend(["output_layer.weight", "output_layer.bias"])
        elif not d.tied:
            names.append("output_layer.weight")
        return names

    def _layer_suffixes(self) -> list[str]:
        d = self.dims
        out = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
        if d.qkv_bias:
            out.append("self_attention.linear_qkv.bias")
        if d.qk_norm:
            out.extend(["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"])
        out.extend([
            "self_attention.linear_proj.weight",
            "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        ])
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Transformers name -> shape of every tensor, in stream order (a tied lm_head omitted)."""
        d = self.dims
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab_size, d.hidden_size)}
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (d.hidden_size,)
            out[p + "self_attn.q_proj.weight"] = (q, d.hidden_size)
            out[p + "self_attn.k_proj.weight"] = (kv, d.hidden_size)
            out[p + "self_attn.v_proj.weight"] = (kv, d.hidden_size)
            if d.qkv_bias:
                out[p + "self_attn.q_proj.bias"] = (q,)
                out[p + "self_attn.k_proj.bias"] = (kv,)
                out[p + "self_attn.v_proj.bias"] = (kv,)
            if d.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (d.head_dim,)
                out[p + "self_attn.k_norm.weight"] = (d.head_dim,)
            out[p + "self_attn.o_proj.weight"] = (d.hidden_size, q)
            out[p + "post_attention_layernorm.weight"] = (d.hidden_size,)
            out[p + "mlp.gate_proj.weight"] = (d.ffn_size, d.hidden_size)
            out[p + "mlp.up_proj.weight"] = (d.ffn_size, d.hidden_size)
            out[p + "mlp.down_proj.weight"] = (d.hidden_size, d.ffn_size)
        out["model.norm.weight"] = (d.hidden_size,)
        if d.head == "value":
            out["score.weight"] = (1, d.hidden_size)
            out["score.bias"] = (1,)
        elif not d.tied:
            out["lm_head.weight"] = (d.vocab_size, d.hidden_size)
        return out

    def megatron_shape(self, name: str) -> tuple[int, ...]:
        """Full (TP=1) shape of a Megatron tensor."""
        d = self.dims
        hf = self.to_hf_tensor(name, None)
        shapes = self.hf_shapes()
        parts = [shapes[n] for n in hf]
        if len(parts) == 1:
            return parts[0]
        if name.endswith("linear_qkv.weight"):
            return ((d.num_heads + 2 * d.num_kv_heads) * d.head_dim, d.hidden_size)
        if name.endswith("linear_qkv.bias"):
            return ((d.num_heads + 2 * d.num_kv_heads) * d.head_dim,)
        return (2 * d.ffn_size, d.hidden_size)  # linear_fc1

    # ------------------------------------------------------------------ QKV layout
    def _fuse_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        d = self.dims
        ng, hpg = d.num_kv_heads, d.num_heads // d.num_kv_heads
        tail = q.shape[1:]
        parts = [
            q.reshape(ng, hpg * d.head_dim, *tail),
            k.reshape(ng, d.head_dim, *tail),
            v.reshape(ng, d.head_dim, *tail),
        ]
        return torch.cat(parts, 1).reshape(-1, *tail)

    def _split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        d = self.dims
        ng, hpg = d.num_kv_heads, d.num_heads // d.num_kv_heads
        tail = qkv.shape[1:]
        grouped = qkv.reshape(ng, (hpg + 2) * d.head_dim, *tail)
        q, k, v = torch.split(grouped, [hpg * d.head_dim, d.head_dim, d.head_dim], 1)
        return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)

    # ------------------------------------------------------------------ tensor maps
    def to_hf_tensor(self, name: str, tensor: Tensor | None) -> dict[str, Tensor | None]:
        """The transformers tensors of one full Megatron tensor (names only when ``tensor`` is None)."""
        if name == "embedding.word_embeddings.weight":
            return {"model.embed_tokens.weight": tensor}
        if name == "decoder.final_layernorm.weight":
            return {"model.norm.weight": tensor}
        if name.startswith("output_layer."):
            suffix = name.removeprefix("output_layer.")
            if self.dims.head == "value":
                return {f"score.{suffix}": tensor}
            return {"lm_head.weight": tensor}
        m = _LAYER_RE.match(name)
        if m is None:
            raise KeyError(f"unknown Megatron tensor {name!r}")
        prefix, suffix = f"model.layers.{m.group(1)}.", m.group(2)
        if suffix in _LAYER_SIMPLE:
            return {prefix + _LAYER_SIMPLE[suffix]: tensor}
        if suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            names = [f"{prefix}self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")]
            if tensor is None:
                return dict.fromkeys(names)
            return dict(zip(names, self._split_qkv(tensor), strict=True))
        if suffix == "mlp.linear_fc1.weight":
            names = [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
            if tensor is None:
                return dict.fromkeys(names)
            return dict(zip(names, tensor.chunk(2, 0), strict=True))
        raise KeyError(f"unknown Megatron tensor {name!r}")

    def from_hf_tensor(self, name: str, hf: Mapping[str, Tensor]) -> Tensor:
        """The full Megatron tensor ``name`` built from a transformers state dict."""
        srcs = self.to_hf_tensor(name, None)
        if name == "output_layer.weight" and self.dims.head == "lm" and "lm_head.weight" not in hf:
            raise KeyError("lm_head.weight is missing from the transformers weights (untied model)")
        missing = [n for n in srcs if n not in hf]
        if missing:
            raise KeyError(f"transformers weights lack {missing} (needed for Megatron {name!r})")
        if len(srcs) == 1:
            return hf[next(iter(srcs))]
        if name.endswith("mlp.linear_fc1.weight"):
            gate, up = (hf[n] for n in srcs)
            return torch.cat([gate, up], 0)
        q, k, v = (hf[n] for n in srcs)
        return self._fuse_qkv(q, k, v)

    def from_hf(self, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Full Megatron state dict (global layer numbers, TP=1) of a transformers state dict.

        Raises:
            KeyError: a tensor the model needs is missing, or ``hf`` holds tensors nobody uses.
        """
        out = {name: self.from_hf_tensor(name, hf) for name in self.megatron_names()}
        used = set(self.hf_shapes())
        if self.dims.tied:
            used.add("lm_head.weight")  # a tied checkpoint may still store it
        extra = sorted(set(hf) - used)
        if extra:
            raise KeyError(f"transformers weights hold tensors the converter does not map: {extra[:5]}")
        return out

    def to_hf(self, megatron: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Transformers state dict of a full Megatron state dict (global layer numbers, TP=1)."""
        out: dict[str, Tensor] = {}
        for name in self.megatron_names():
            if name not in megatron:
                raise KeyError(f"Megatron weights lack {name!r}")
            for hf_name, t in self.to_hf_tensor(name, megatron[name]).items():
                assert t is not None
                out[hf_name] = t
        return out

    # ------------------------------------------------------------------ tensor parallel
    def partition(self, name: str) -> Partition:
        """How the Megatron tensor ``name`` is split under tensor parallelism."""
        if name.startswith("output_layer.") and self.dims.head == "value":
            return "replicated"
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return "rows"
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            return "rows"
        if name.endswith("linear_fc1.weight"):
            return "fc1"
        if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
            return "cols"
        return "replicated"

    def shard(self, name: str, full: Tensor, tp_rank: int, tp: int) -> Tensor:
        """The piece of the full Megatron tensor ``name`` that TP rank ``tp_rank`` of ``tp`` holds."""
        part = self.partition(name)
        if part == "replicated" or tp == 1:
            return full
        if part == "rows":
            return full.chunk(tp, 0)[tp_rank]
        if part == "cols":
            return full.chunk(tp, 1)[tp_rank]
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]], 0)

    def unshard(self, name: str, shards: Sequence[Tensor]) -> Tensor:
        """Join the TP shards (in TP-rank order) of ``name`` into the full tensor."""
        part = self.partition(name)
        if part == "replicated" or len(shards) == 1:
            return shards[0]
        if part == "rows":
            return torch.cat(list(shards), 0)
        if part == "cols":
            return torch.cat(list(shards), 1)
        halves = [s.chunk(2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)

    # ------------------------------------------------------------------ pipeline parallel
    def stage_of(self, name: str, pp: int) -> int:
        """The pipeline stage that holds ``name`` (the first stage holds the tied embedding)."""
        if name.startswith("embedding."):
            return 0
        if name.startswith("decoder.final_layernorm") or name.startswith("output_layer."):
            return pp - 1
        m = _LAYER_RE.match(name)
        if m is None:
            raise KeyError(f"unknown Megatron tensor {name!r}")
        return int(m.group(1)) // (self.dims.num_layers // pp)

    def local_name(self, name: str, pp: int) -> str:
        """The name of global tensor ``name`` inside its stage's module (layers renumbered from 0)."""
        m = _LAYER_RE.match(name)
        if m is None:
            return name
        per_stage = self.dims.num_layers // pp
        return f"decoder.layers.{int(m.group(1)) % per_stage}.{m.group(2)}"

    def stage_names(self, pp_rank: int, pp: int) -> Iterator[tuple[str, str]]:
        """(global name, local name) of every tensor stage ``pp_rank`` of ``pp`` holds.

        A tied output layer also lives on the last stage (as ``output_layer.weight``, a copy of
        the embedding whose gradients Megatron's embedding group keeps in sync) when pp > 1.
        """
        for name in self.megatron_names():
            if self.stage_of(name, pp) == pp_rank:
                yield name, self.local_name(name, pp)
        if self.dims.tied and pp > 1 and pp_rank == pp - 1:
            yield "embedding.word_embeddings.weight", "output_layer.weight"

    def hf_layer_of(self, hf_name: str) -> int | None:
        """Layer number of a transformers tensor name (None outside the decoder layers)."""
        m = _HF_LAYER_RE.match(hf_name)
        return int(m.group(1)) if m else None


def _pad_id(pad: Any, vocab: int) -> int | None:
    """The config's pad id as the embedding's padding index (None: none, or not a row of the table)."""
    return int(pad) if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab else None
