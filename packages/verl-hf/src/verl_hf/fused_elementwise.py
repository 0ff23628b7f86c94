"""Training forward passes with each RMSNorm and each gated MLP activation as one compiled kernel.

transformers' eager RMSNorm is a chain of element-wise kernels over the activations (a float32
cast, ``pow``, ``mean``, ``rsqrt``, two products, a cast back), and its MLP multiplies the
activation of the gate projection by the up projection in kernels of their own; each reads and
writes the whole ``[tokens, hidden]`` activation, forward and backward. In a training micro-batch
of 0.89B x 18k tokens on an H100 these chains take about half of ``forward_backward``'s kernel time
(benchmarks/results/gpu-2026-12-06-kernel.md). :func:`fuse_elementwise` routes them through
``torch.compile``d functions, so inductor fuses each chain into one kernel forward and one
backward. The arithmetic is transformers' own (the same operations in the same dtypes); only
inductor's order of the float32 mean's additions differs, a rounding-level difference.

Only modules whose forward is known are routed: the RMSNorm and MLP classes of the llama,
mistral, qwen2 and qwen3 families (a SiLU gate); any other module keeps its own forward.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FUSABLE_MLPS", "FUSABLE_NORMS", "compile_decoder_layers", "compiled_layers", "fuse_elementwise", "fused_modules"]

FUSABLE_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
"""RMSNorm classes whose forward is ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``."""

FUSABLE_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
"""MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""

_ATTR = "_verl_fused_elementwise"


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' llama RMSNorm: normalise in float32, cast back, then scale by the weight."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_gate(gate: Tensor, up: Tensor) -> Tensor:
    """The gated MLP's product: ``silu(gate) * up``."""
    return F.silu(gate) * up


_COMPILED: dict[str, Callable[..., Tensor]] = {}


def _compiled(name: str, fn: Callable[..., Tensor], compile: bool) -> Callable[..., Tensor]:
    if not compile:
        return fn
    if name not in _COMPILED:  # one compiled function per kind, shared by every layer (dynamic shapes)
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def _norm_forward(norm: Callable[..., Tensor]) -> Callable[[nn.Module, Tensor], Tensor]:
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        return norm(hidden_states, self.weight, self.variance_epsilon)

    return forward


def _mlp_forward(gate: Callable[..., Tensor]) -> Callable[[Any, Tensor], Tensor]:
    def forward(self: Any, x: Tensor) -> Tensor:
        return self.down_proj(gate(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-any-return]

    return forward


def _silu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def fuse_elementwise(model: nn.Module, *, compile: bool = True) -> int:
    """Route every known RMSNorm and SiLU-gated MLP of ``model`` through one compiled function each
    (``compile=False``: the same functions uncompiled, for tests of the arithmetic). Returns how
    many modules were routed; a module already routed is left as it is."""
    norm = _compiled("rms_norm", rms_norm, compile)
    gate = _compiled("silu_gate", silu_gate, compile)
    routed = 0
    for module in model.modules():
        kind = type(module).__name__
        if getattr(module, _ATTR, False):
            continue
        if kind in FUSABLE_NORMS and hasattr(module, "weight") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward(norm), module)
        elif kind in FUSABLE_MLPS and _silu(module) and all(
                hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            module.forward = types.MethodType(_mlp_forward(gate), module)
        else:
            continue
        setattr(module, _ATTR, True)
        routed += 1
    return routed


def fused_modules(model: Any) -> int:
    """How many modules of ``model`` :func:`fuse_elementwise` routed."""
    return sum(bool(getattr(m, _ATTR, False)) for m in model.modules())


_LAYER_ATTR = "_verl_compiled_layer"


def compile_decoder_layers(model: nn.Module, *, backend: str = "inductor") -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (``nn.Module.compile``, dynamic
    shapes), so inductor fuses the element-wise work between the projections (rotary, residual
    adds, casts, the norms) across the whole layer, forward and backward. A decoder layer is a
    module whose class name ends in ``DecoderLayer`` (transformers' naming); parameter names and
    the module tree are unchanged. Layers of one class share their compiled graphs (dynamo treats
    the parameters as inputs). ``backend`` is ``torch.compile``'s (tests trace with ``aot_eager``:
    dynamo's graphs and autograd's split without inductor's code generation). Returns how many layers
    were compiled; one already compiled is left as it is."""
    compiled = 0
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer") and not getattr(module, _LAYER_ATTR, False):
            module.compile(dynamic=True, backend=backend)
            setattr(module, _LAYER_ATTR, True)
            compiled += 1
    return compiled


def compiled_layers(model: Any) -> int:
    """How many decoder layers of ``model`` :func:`compile_decoder_layers` compiled."""
    return sum(bool(getattr(m, _LAYER_ATTR, False)) for m in model.modules())
