"""Per-token log-probs and entropy of ``softmax(logits / T)`` without a float32 copy of all the logits.

:func:`token_log_probs` is what every training engine that produces full-vocabulary logits calls.
It gives the numbers of the whole-tensor computation, ``tempered_log_probs(logits, T)`` gathered
at the targets and ``-(exp(logp) * logp).sum(-1)``, bit for bit (the same float32 operations, row
by row), but works through the tokens in chunks: no float32 ``[tokens, vocab]`` tensor larger than one chunk
exists at any time, in the forward or the backward. The backward recomputes each chunk's
log-softmax from the logits (which the model's graph holds anyway) and two saved floats per
token, and writes the gradient straight into a tensor of the logits' dtype; besides the logits it
keeps the targets, those floats and the entropy.

That computation keeps two float32 ``[tokens, vocab]`` tensors from the forward until the backward
(the log-softmax and, for the entropy, its exponential) and makes more in both passes: at 8192
tokens and a 150k vocabulary each is 5 GB.

Fused (``fused=True``, the default on CUDA: :func:`fuses_log_probs`), each chunk's forward and
backward is one ``torch.compile``d function instead of a few eager passes over a float32 copy of the
chunk: the backward reads the logits once and writes the gradient once, where the eager backward
makes six float32 passes over every chunk (on an H100 at 135k tokens x 32,000 those passes took
77 ms of the 1.28 s of kernels of one ``forward_backward``). The same formulas in float32, not bit
for bit: within float32 rounding of the eager values (the reductions run in another order).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Final

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from verl_core.enginekit.sampling import CompiledOrEager
from verl_core.kernel.errors import BatchValidationError, ConfigError
from verl_core.kernel.schema import check_temperature

__all__ = ["CHUNK_ELEMENTS", "default_chunk_tokens", "fuses_log_probs", "token_log_probs"]

CHUNK_ELEMENTS: Final = {"cpu": 1 << 19, "cuda": 1 << 26}
"""Default chunk size in logits (tokens x vocab) by device type; other devices take the CUDA size.

On CPU a chunk of 512K float32 values (2 MiB per temporary) stays in cache between the few passes
over it. On an H200 (``benchmarks/bench_logprobs.py --device cuda --dtype bfloat16``, 8 x 1024
tokens x 32,000) forward and backward took 1.21x the whole-tensor time at 16M values per chunk,
1.10x at 64M and 1.06x at 256M, with 0.15x, 0.30x and 0.60x its peak memory: 64M values (256 MiB
per float32 temporary) is the default.
"""


def default_chunk_tokens(vocab: int, device: torch.device) -> int:
    """Tokens per chunk when none are given: :data:`CHUNK_ELEMENTS` logits of ``device``, at least one token."""
    return max(1, CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cuda"]) // vocab)


def fuses_log_probs(device: torch.device) -> bool:
    """Whether :func:`token_log_probs` fuses each chunk's passes by default on ``device``: on CUDA.

    Elsewhere the eager passes stay the default: they give the whole-tensor computation's values
    bit for bit, and a CPU process would compile the two functions before its first step.
    """
    return device.type == "cuda"


def token_log_probs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` and (optionally) the entropy under ``softmax(logits / T)``.

    Differentiable with respect to ``logits`` (through either output or both); the gradient has
    the logits' dtype. The values equal ``log_softmax(logits.float() / T)`` gathered at
    ``targets`` and ``-(exp(logp) * logp).sum(-1)``, computed ``chunk_tokens`` tokens at a time.

    Args:
        logits: ``[..., vocab]`` in any float dtype and any layout (a strided slice of a model's
            output is read in place, not copied).
        targets: Integer token ids of shape ``logits.shape[:-1]``, each in ``[0, vocab)``.
        temperature: The sampling temperature T (at least ``kernel.schema.MIN_TEMPERATURE``).
        entropy: Also return the entropy of each token's distribution.
        chunk_tokens: Tokens per chunk (default: :func:`default_chunk_tokens`).
        fused: Run each chunk's forward and backward as one compiled function (the module's
            docstring); None: :func:`fuses_log_probs` of the logits' device. Where compiling
            fails, a warning names the error and the process computes eagerly from then on.

    Returns:
        ``(log_probs, entropy)``, both of shape ``logits.shape[:-1]`` in float32 (float64 for
        float64 logits); ``entropy`` is None unless asked for. Zero-size shapes pass through:
        ``[B, 0, vocab]`` logits (empty responses) give ``[B, 0]`` outputs and a gradient of
        zeros, so an engine needs no special case for them.

    Raises:
        BatchValidationError: ``logits`` is not a floating tensor with a non-empty last dimension,
            or ``targets`` is not an integer tensor of its leading shape.
        ConfigError: ``temperature`` or ``chunk_tokens`` is out of range.
    """
    if not logits.is_floating_point() or logits.ndim < 1 or logits.shape[-1] == 0:
        raise BatchValidationError(
            f"token_log_probs: logits must be a floating tensor [..., vocab] with vocab >= 1, "
            f"got dtype {logits.dtype} and shape {tuple(logits.shape)}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool \
            or targets.shape != logits.shape[:-1]:
        raise BatchValidationError(
            f"token_log_probs: targets must be integer token ids of shape {tuple(logits.shape[:-1])} "
            f"(the logits' leading dimensions), got dtype {targets.dtype} and shape {tuple(targets.shape)}"
        )
    t = check_temperature(temperature, "token_log_probs temperature")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(logits.shape[-1], logits.device)
    elif isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"token_log_probs: chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    if fused is None:
        fused = fuses_log_probs(logits.device)
    out = _TokenLogProbs.apply(logits, targets, t, entropy, chunk_tokens, bool(fused))  # type: ignore[no-untyped-call]
    if entropy:
        lp, ent = out
        return lp, ent
    return out, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for every float dtype but float64 (kept, so gradcheck can run in double)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_views(x: Tensor) -> list[Tensor]:
    """2-D ``[rows, vocab]`` views of ``x [..., vocab]`` that cover its rows in flattened order.

    One view when the leading dimensions flatten without a copy, else one per leading index (a
    ``[:, :r]`` slice of ``[batch, r + 1, vocab]`` logits gives ``batch`` views of ``[r, vocab]``).
    """
    if x.ndim == 1:
        return [x.unsqueeze(0)]
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:  # the leading dimensions do not merge under these strides
        return [v for i in range(x.shape[0]) for v in _row_views(x[i])]


def _chunks(views: list[Tensor], chunk_tokens: int) -> Iterator[tuple[int, int, list[Tensor]]]:
    """``(start, end, pieces)``: flat row ranges of at most ``chunk_tokens`` rows and the views covering them."""
    start, pieces, size = 0, [], 0
    for v in views:
        at = 0
        while at < v.shape[0]:
            take = min(chunk_tokens - size, v.shape[0] - at)
            pieces.append(v[at : at + take])
            at += take
            size += take
            if size == chunk_tokens:
                yield start, start + size, pieces
                start, pieces, size = start + size, [], 0
    if size:
        yield start, start + size, pieces


def _scaled(pieces: list[Tensor], temperature: float, dtype: torch.dtype) -> Tensor:
    """``logits / T`` of one chunk in the compute dtype: the same operations as ``tempered_log_probs``."""
    z = _joined(pieces).to(dtype)
    return z / temperature if temperature != 1.0 else z


def _joined(pieces: list[Tensor]) -> Tensor:
    """One chunk's logits as one ``[rows, vocab]`` tensor (a copy only where the chunk straddles views)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _fused_forward(x: Tensor, targets: Tensor, temperature: float, entropy: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One chunk's forward, compiled into few kernels: ``(max z, log sum exp(z - max z), log-prob at
    the targets, entropy or None)`` with ``z = x / T`` in the compute dtype (``x / 1.0`` is ``x``)."""
    z = x.to(_compute_dtype(x.dtype)) / temperature
    z_max = z.amax(-1, keepdim=True)
    shifted = z - z_max
    log_sum = shifted.exp().sum(-1, keepdim=True).log()
    lp = (shifted.gather(-1, targets) - log_sum).squeeze(-1)
    if not entropy:
        return z_max, log_sum, lp, None
    logp = shifted - log_sum
    return z_max, log_sum, lp, -(logp.exp() * logp).sum(-1)


def _fused_backward(x: Tensor, out: Tensor, targets: Tensor, z_max: Tensor, log_sum: Tensor, lp_coef: Tensor,
                    ent_coef: Tensor | None, ent: Tensor, temperature: float) -> None:
    """One chunk's gradient into ``out`` (the logits' dtype), compiled into one pass over ``x``:
    ``lp_coef * (onehot(t) - p)``, plus ``-ent_coef * p * (logp + H)`` where the entropy has a gradient."""
    z = x.to(z_max.dtype) / temperature
    logp = (z - z_max) - log_sum
    p = logp.exp()
    hit = torch.arange(x.shape[-1], device=x.device) == targets
    if ent_coef is None:
        g = torch.where(hit, lp_coef, 0.0) - p * lp_coef
    else:
        g = torch.where(hit, lp_coef, 0.0) - p * (lp_coef + ent_coef * (logp + ent))
    out.copy_(g)


@functools.cache
def _compiled(which: str) -> CompiledOrEager:
    """The compiled chunk function ``which`` (``forward`` or ``backward``), made once per process."""
    fn = _fused_forward if which == "forward" else _fused_backward
    return CompiledOrEager(fn, f"token log-probs ({which})")


class _TokenLogProbs(torch.autograd.Function):
    """The chunked forward and backward of :func:`token_log_probs`."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, temperature: float, entropy: bool, chunk_tokens: int, fused: bool
    ) -> Tensor | tuple[Tensor, Tensor]:
        dtype = _compute_dtype(logits.dtype)
        lead = logits.shape[:-1]
        flat_targets = targets.reshape(-1, 1)
        # the outputs are returned as allocated, not as views, so callers may edit them in place
        lp = torch.empty(lead, dtype=dtype, device=logits.device)
        ent = torch.empty(lead if entropy else (0,), dtype=dtype, device=logits.device)
        flat_lp, flat_ent = lp.view(-1), ent.view(-1)
        # per token: max z and log sum exp(z - max z), so the backward gets logp back as log_softmax
        # computes it, (z - max) - log sum, in two subtractions instead of a log-softmax
        z_max = torch.empty(flat_targets.shape, dtype=dtype, device=logits.device)
        log_sum = torch.empty_like(z_max)
        for a, b, pieces in _chunks(_row_views(logits), chunk_tokens):
            if fused:
                parts = _compiled("forward")(_joined(pieces), flat_targets[a:b], temperature, entropy)
                z_max[a:b], log_sum[a:b], flat_lp[a:b] = parts[:3]
                if entropy:
                    flat_ent[a:b] = parts[3]
                continue
            z = _scaled(pieces, temperature, dtype)
            torch.amax(z, -1, keepdim=True, out=z_max[a:b])
            logp = torch.log_softmax(z, -1)
            del z  # one chunk-sized temporary fewer below
            torch.neg(logp.amax(-1, keepdim=True), out=log_sum[a:b])  # logp at the max is 0 - log sum
            flat_lp[a:b] = logp.gather(-1, flat_targets[a:b]).squeeze(-1)
            if entropy:
                flat_ent[a:b] = -(logp.exp() * logp).sum(-1)
        ctx.set_materialize_grads(False)
        # the backward's own copy of the entropy, which an in-place edit of the output leaves intact
        ctx.save_for_backward(logits, flat_targets, z_max, log_sum, flat_ent.clone())
        ctx.temperature, ctx.entropy, ctx.chunk_tokens, ctx.fused = temperature, entropy, chunk_tokens, fused
        if entropy:
            return lp, ent
        return lp

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, None, None, None, None, None]:
        logits, flat_targets, z_max, log_sum, ent = ctx.saved_tensors
        g_lp = grads[0]
        g_ent = grads[1] if ctx.entropy else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None
        temperature: float = ctx.temperature
        dtype = _compute_dtype(logits.dtype)
        # z = logits / T;  d logp_t / dz = onehot(t) - p;  d H / dz = -p * (logp + H)
        lp_coef = None if g_lp is None else g_lp.reshape(-1, 1).to(dtype) / temperature
        ent_coef = None if g_ent is None else g_ent.reshape(-1, 1).to(dtype) / temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        if ctx.fused:
            coef = lp_coef if lp_coef is not None else torch.zeros_like(z_max)
            ent_col = ent.unsqueeze(-1)
            for a, b, pieces in _chunks(_row_views(logits), ctx.chunk_tokens):
                _compiled("backward")(_joined(pieces), flat_grad[a:b], flat_targets[a:b], z_max[a:b], log_sum[a:b],
                                      coef[a:b], None if ent_coef is None else ent_coef[a:b],
                                      ent_col[a:b], temperature)
            return grad, None, None, None, None, None
        # -p * (lp_coef + ent_coef * (logp + H)) = p * (logp * -ent_coef - shift)
        shift = None if ent_coef is None else ent_coef * ent.unsqueeze(-1) + (0.0 if lp_coef is None else lp_coef)
        for a, b, pieces in _chunks(_row_views(logits), ctx.chunk_tokens):
            logp = (_scaled(pieces, temperature, dtype) - z_max[a:b]).sub_(log_sum[a:b])
            p = logp.exp()
            if ent_coef is None or shift is None:
                assert lp_coef is not None
                g = p.mul_(-lp_coef[a:b])
            else:
                g = logp.mul_(-ent_coef[a:b]).sub_(shift[a:b]).mul_(p)
            if lp_coef is not None:
                g.scatter_add_(-1, flat_targets[a:b], lp_coef[a:b])
            flat_grad[a:b] = g
        return grad, None, None, None, None, None
