"""Llama / Qwen2 / Qwen3 decoder in plain torch, loaded from a transformers folder (transformers naming)."""
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


@dataclass(frozen=True)
class Rope:
    """The rotary frequencies a folder declares, computed as transformers does.

    ``default`` and ``linear`` (frequencies divided by ``factor``) have one set of frequencies;
    ``longrope`` has two: a sequence longer than ``threshold`` (the config's
    ``original_max_position_embeddings``) uses the long factors at every position, a shorter one
    the short factors. This model decides per sequence, by its own number of real tokens, which is
    what each sample alone computes (transformers decides per forward call, by the batch's
    longest row). ``scale`` (LongRoPE's attention factor) multiplies cos and sin.
    """

    inv_freq: Tensor
    long_inv_freq: Tensor | None = None
    threshold: int = 0
    scale: float = 1.0

    @staticmethod
    def load(raw: dict[str, Any], head_dim: int, path: str) -> Rope:
        """The rotary embedding of a ``config.json``: ``rope_parameters`` (transformers 5) or a
        top-level ``rope_scaling`` and ``rope_theta`` (transformers 4); a non-empty ``rope_scaling``
        replaces ``rope_parameters`` as a whole, as transformers 5 reads a folder with both.

        Raises:
            ConfigError: a rope type this model does not implement (it would compute another model).
        """
        params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ConfigError(f"the tiny backend rotates every dimension of a head; {path} declares a "
                              "partial_rotary_factor (RoPE on part of each head is not implemented)")
        base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        if rope_type == "default":
            return Rope(base)
        if rope_type == "linear":
            return Rope(base / float(params["factor"]))
        if rope_type == "longrope":
            longest = raw.get("max_position_embeddings", 2048 if raw.get("model_type") == "llama" else 32768)
            original = int(params.get("original_max_position_embeddings")
                           or raw.get("original_max_position_embeddings") or longest)
            factor = float(params.get("factor") or longest / original)
            scale = params.get("attention_factor")
            if scale is None:
                scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * (1.0 / base))
            long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * (1.0 / base))
            return Rope(short, long, original, float(scale))
        raise ConfigError(f"the tiny backend implements the RoPE types default, linear and longrope; {path} declares "
                          f"rope_type {rope_type!r}, which it would compute as another model")

    def cos_sin(self, pos: Tensor, lengths: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [batch, 1, seq, head_dim] at positions ``pos`` [batch, seq] of sequences of ``lengths`` real tokens."""
        inv = self.inv_freq.expand(len(lengths), -1)
        if self.long_inv_freq is not None:
            inv = torch.where((lengths > self.threshold)[:, None], self.long_inv_freq, inv)
        ang = pos.float()[..., None] * inv[:, None, :]  # [b, s, d/2]
        emb = torch.cat([ang, ang], -1)
        return (emb.cos() * self.scale)[:, None].to(dtype), (emb.sin() * self.scale)[:, None].to(dtype)


@dataclass(frozen=True)
class Cfg:
    """What the model needs from a folder's config.json."""

    model_type: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    rope: Rope
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    value_head: bool
    pad_token_id: int | None = None  # the embedding's padding_idx, as transformers builds it

    @staticmethod
    def load(path: str) -> Cfg:
        """Read ``config.json``; an unsupported architecture raises ConfigError naming it, and so
        does a pad, EOS or BOS id outside ``[0, vocab_size)`` (``config.json``, ``generation_config.json``
        or the tokenizer's files)."""
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} is not a transformers model folder: cannot read {file} ({e})") from None
        mt = raw.get("model_type")
        if mt not in ("llama", "qwen2", "qwen3"):
            raise ConfigError(f"the tiny backend runs llama, qwen2 and qwen3 folders; {path} has model_type {mt!r}")
        # what the model below leaves out is refused by name, not met as tensors that do not match
        missing = ["mlp_bias"] if raw.get("mlp_bias") else []
        if mt == "llama" and raw.get("attention_bias"):
            missing.append("attention_bias (an o_proj bias)")
        if raw.get("hidden_act", "silu") != "silu":
            missing.append(f"hidden_act {raw['hidden_act']!r} (its MLP runs silu)")
        if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or []):
            missing.append("sliding-window attention")
        if missing:
            raise ConfigError(f"the tiny backend does not implement {', '.join(missing)}, which {path} declares")
        check_special_token_ids(path, raw)  # pad is the embedding's padding_idx; eos/bos (the tokenizer's too) rows
        heads = int(raw["num_attention_heads"])
        archs = raw.get("architectures") or []
        # the keys a config may omit, filled as transformers 5's config classes fill them
        if raw.get("head_dim") is not None:
            head_dim = int(raw["head_dim"])
        elif mt == "qwen3" and "head_dim" in raw:
            raise ConfigError(f"{file}: head_dim is null; Qwen3 needs a number (leave the key out for 128)")
        else:
            head_dim = 128 if mt == "qwen3" else int(raw["hidden_size"]) // heads
        kv_heads = raw.get("num_key_value_heads", heads if mt == "llama" else 32)
        eps = raw.get("rms_norm_eps", 1e-6)
        if eps is None:
            raise ConfigError(f"{file}: rms_norm_eps is null; expected a number (leave the key out for 1e-6)")
        return Cfg(mt, int(raw["vocab_size"]), int(raw["hidden_size"]), int(raw["num_hidden_layers"]), heads,
                   int(heads if kv_heads is None else kv_heads), head_dim, int(raw["intermediate_size"]),
                   float(eps), Rope.load(raw, head_dim, path), bool(raw.get("tie_word_embeddings", False)),
                   mt == "qwen2", mt == "qwen3",
                   any("TokenClassification" in a for a in archs), raw.get("pad_token_id"))


class RMSNorm(nn.Module):
    """RMS normalisation in float32, scaled by a learned weight."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` [batch, heads, seq, head_dim] (``cos``, ``sin`` from :meth:`Rope.cos_sin`)."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attn(nn.Module):
    """Grouped-query attention with optional QKV bias (Qwen2) and QK norm (Qwen3)."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.eps)
            self.k_norm = RMSNorm(c.head_dim, c.eps)

    def forward(self, x: Tensor, cos_sin: tuple[Tensor, Tensor], bias: Tensor) -> Tensor:
        c = self.c
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, c.heads, c.head_dim)
        k = self.k_proj(x).view(b, s, c.kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q.transpose(1, 2), *cos_sin), rope(k.transpose(1, 2), *cos_sin)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim) + bias
        out = att.softmax(-1) @ v
        proj: Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return proj


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.inter, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.inter, bias=False)
        self.down_proj = nn.Linear(c.inter, c.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        down: Tensor = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class Layer(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.self_attn = Attn(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)

    def forward(self, x: Tensor, cos_sin: tuple[Tensor, Tensor], bias: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, bias)
        mlp: Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp


class Body(nn.Module):
    """Embedding, layers and final norm (``model.*`` in transformers naming)."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        # padding_idx: the pad row gets no gradient from the lookup, where the id occurs as a real token too
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden, padding_idx=c.pad_token_id)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)


class Model(nn.Module):
    """Names follow transformers: model.*, lm_head (causal LM) or score (value head)."""

    def __init__(self, c: Cfg) -> None:
        super().__init__()
        self.cfg = c
        self.model = Body(c)
        if c.value_head:
            self.score = nn.Linear(c.hidden, 1, bias=True)
        elif not c.tied:
            self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)

    @staticmethod
    def from_folder(path: str, dtype: torch.dtype = torch.float32, *, value_head: bool = False, seed: int = 0) -> Model:
        """Build the model of a folder and load its safetensors weights.

        ``value_head`` (a critic): on a causal-LM folder, its backbone with a value head drawn from
        ``seed`` (weight ``normal(0, initializer_range)``, bias 0; the global generator untouched).
        """
        cfg = Cfg.load(path)
        fresh_head = value_head and not cfg.value_head
        m = Model(replace(cfg, value_head=True) if fresh_head else cfg)
        files = sorted(Path(path).glob("*.safetensors"))  # one model.safetensors, or the shards of a large folder
        if not files:
            raise ConfigError(f"{path} has no *.safetensors file; expected a transformers model folder")
        state: dict[str, Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        if fresh_head:
            state.pop("lm_head.weight", None)
            std = float(json.loads((Path(path) / "config.json").read_text()).get("initializer_range", 0.02))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                state["score.weight"] = torch.empty(1, cfg.hidden).normal_(0.0, std)
            state["score.bias"] = torch.zeros(1)
        missing, unexpected = m.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ConfigError(f"{path}: weights do not match the model: missing {missing}, unexpected {unexpected}")
        return m.to(dtype)

    def hidden(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Final hidden states; positions count real tokens only (left padding safe), and a
        LongRoPE folder picks its frequencies by each row's number of real tokens."""
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)
        s = ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        allowed = causal[None] & mask[:, None, :]
        allowed = allowed | torch.eye(s, dtype=torch.bool)[None]  # padding rows attend to themselves
        bias = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, float("-inf"))[:, None]
        x = self.model.embed_tokens(ids)
        cos_sin = self.cfg.rope.cos_sin(pos, mask.sum(1), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos_sin, bias.to(x.dtype))
        normed: Tensor = self.model.norm(x)
        return normed

    def logits(self, h: Tensor) -> Tensor:
        """float32 logits of hidden states (tied to the embedding when the folder says so)."""
        w = self.model.embed_tokens.weight if self.cfg.tied else self.lm_head.weight
        return (h @ w.t()).float()

    def values(self, h: Tensor) -> Tensor:
        """float32 values of the value head."""
        score: Tensor = self.score(h)
        return score.float().squeeze(-1)

    def named_weights(self) -> list[tuple[str, Tensor]]:
        """Every parameter in transformers naming (a tied lm_head is not a parameter here)."""
        return [(n, p) for n, p in self.named_parameters()]
