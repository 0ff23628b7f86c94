"""A Llama-family decoder in plain torch that loads a transformers-format safetensors folder.

Covers what the test kit's tiny models use: Llama (RMSNorm, RoPE, grouped-query attention,
SwiGLU), Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each query/key head), tied or untied
lm_head, and the ``score`` head of a token-classification (critic) folder. Parameters are named
exactly as in transformers, so loading and exporting weights needs no name mapping.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from verl_core import ConfigError
from verl_core.enginekit.model_folder import check_special_token_ids

__all__ = ["DecoderConfig", "DecoderLM", "load_model", "position_ids"]


@dataclass(frozen=True)
class DecoderConfig:
    """The fields of a transformers config.json this model reads."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    value_head: bool
    eos_token_id: int
    pad_token_id: int
    padding_idx: int | None = None  # the config's own pad id (None when it has none), as transformers reads it

    @classmethod
    def from_folder(cls, path: str | Path) -> DecoderConfig:
        """Read ``config.json`` of a transformers folder; unsupported architectures raise ConfigError,
        and so does a pad, EOS or BOS id outside ``[0, vocab_size)`` in ``config.json``,
        ``generation_config.json`` or the tokenizer's files (the embedding's ``padding_idx`` must be
        a row, and a rollout stops on EOS)."""
        raw: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in ("llama", "qwen2", "qwen3"):
            raise ConfigError(
                f"the example backend runs llama, qwen2 and qwen3 folders; {path} has model_type "
                f"{model_type!r}"
            )
        check_special_token_ids(path, raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":  # the MLP below is SwiGLU; transformers applies whatever the config names
            raise ConfigError(f"the example backend's MLP runs hidden_act 'silu'; {path} sets hidden_act {act!r}")
        if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or []):
            raise ConfigError(f"the example backend attends to every earlier position; {path} declares "
                              "sliding_window attention (use_sliding_window or layer_types)")
        # transformers 5 writes rope_parameters; transformers 4 folders a top-level rope_scaling, which
        # (non-empty) replaces rope_parameters as a whole, as transformers 5 reads a folder with both
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"only default RoPE is supported, {path} uses rope_type {rope_type!r}")
        heads = int(raw["num_attention_heads"])
        archs = raw.get("architectures") or []
        eos = raw.get("eos_token_id", 1)
        # the keys a config may omit, filled as transformers 5's config classes fill them (null kv heads: all)
        kv_heads = raw.get("num_key_value_heads", heads if model_type == "llama" else 32)
        eps = raw.get("rms_norm_eps", 1e-6)
        if eps is None:
            raise ConfigError(f"{Path(path) / 'config.json'}: rms_norm_eps is null; expected a number "
                              "(leave the key out for 1e-6)")
        if raw.get("head_dim") is not None:
            head_dim = int(raw["head_dim"])
        elif model_type == "qwen3" and "head_dim" in raw:
            raise ConfigError(f"{Path(path) / 'config.json'}: head_dim is null; Qwen3 needs a number (leave the key "
                              "out for 128)")
        else:
            head_dim = 128 if model_type == "qwen3" else int(raw["hidden_size"]) // heads
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(heads if kv_heads is None else kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            rope_theta=theta,
            tied=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            value_head=any(a.endswith("ForTokenClassification") for a in archs),
            eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
            pad_token_id=int(raw.get("pad_token_id") or 0),
            padding_idx=raw.get("pad_token_id"),
        )


def position_ids(mask: Tensor) -> Tensor:
    """``cumsum(mask) - 1`` clipped at 0: correct under left padding."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dim."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE at explicit positions."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor) -> Tensor:
        """``bias`` is [batch, 1, seq, seq] with 0 where attending is allowed and -inf-like elsewhere."""
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, s, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim) + bias
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)  # type: ignore[no-any-return]


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class Layer(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor) -> Tensor:
        """Residual attention then residual MLP."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, bias)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class Backbone(nn.Module):
    """Embedding, layers and final norm (transformers' ``model.`` prefix)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        # padding_idx: the pad row gets no gradient from the lookup, where the id occurs as a real token too
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.padding_idx)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """The decoder with an lm_head (policy) or a one-output ``score`` head (critic)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        if cfg.value_head:
            self.score = nn.Linear(cfg.hidden_size, 1, bias=True)
        elif not cfg.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def hidden(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Final hidden states [batch, seq, hidden] for left- or right-padded ``ids`` under ``mask``."""
        pos = position_ids(mask)
        freqs = pos.unsqueeze(-1).float() * self.inv_freq  # type: ignore[operator]
        emb = torch.cat([freqs, freqs], -1)
        x = self.model.embed_tokens(ids)
        cos = emb.cos().to(x.dtype).unsqueeze(1)
        sin = emb.sin().to(x.dtype).unsqueeze(1)
        s = ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        allowed = causal.unsqueeze(0) & mask.unsqueeze(1)
        bias = torch.zeros(allowed.shape, dtype=x.dtype, device=ids.device)
        # A finite minimum, not -inf: fully masked rows (padding) stay finite instead of NaN.
        bias = bias.masked_fill(~allowed, torch.finfo(x.dtype).min).unsqueeze(1)
        for layer in self.model.layers:
            x = layer(x, cos, sin, bias)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def head_weight(self) -> Tensor:
        """The lm_head matrix (the input embedding when tied)."""
        if self.cfg.tied:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """Vocabulary logits of hidden states."""
        return hidden @ self.head_weight().t()

    def values(self, hidden: Tensor) -> Tensor:
        """Value of every position (critic folders only)."""
        return self.score(hidden)[..., 0]  # type: ignore[no-any-return]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, *, value_head: bool = False,
               seed: int = 0) -> DecoderLM:
    """Build the model of a transformers folder and load its safetensors weights by name.

    ``value_head`` (a critic) on a causal-LM folder: its backbone with a value head drawn from
    ``seed`` (weight ``normal(0, initializer_range)``, bias 0; the caller's generator untouched),
    as PPO builds its critic on the policy's folder.
    """
    cfg = DecoderConfig.from_folder(path)
    fresh_head = value_head and not cfg.value_head
    if fresh_head:
        cfg = replace(cfg, value_head=True)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model = model.to_empty(device="cpu")
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    model.inv_freq = inv.float()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors file in {path}; expected a transformers model folder")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if cfg.tied or fresh_head:
        state.pop("lm_head.weight", None)
    if fresh_head:
        std = float(json.loads((Path(path) / "config.json").read_text()).get("initializer_range", 0.02))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            state["score.weight"] = torch.empty(1, cfg.hidden_size).normal_(0.0, std)
        state["score.bias"] = torch.zeros(1)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{path}: weights do not match a {cfg.model_type} model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    return model.to(dtype)
