"""verl_core.enginekit.token_stats: chunked log-probs and entropy against log_softmax, values and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from verl_core import BatchValidationError, ConfigError
from verl_core.enginekit.sampling import tempered_log_probs
from verl_core.enginekit.token_stats import token_log_probs


def reference(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """What the engines computed before: the whole float32 log-softmax, gathered, and its entropy."""
    logp = tempered_log_probs(logits, temperature)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(shape: tuple[int, ...], vocab: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    return logits, torch.randint(0, vocab, shape, generator=g)


def test_gradcheck_in_double_through_both_outputs_across_chunk_boundaries() -> None:
    logits, targets = inputs((2, 5), 7, torch.float64)
    logits.requires_grad_(True)
    for chunk in (1, 3, 4, 10, 64):
        for temperature in (1.0, 0.6):
            def both(x: Tensor, c: int = chunk, t: float = temperature) -> tuple[Tensor, Tensor]:
                lp, ent = token_log_probs(x, targets, temperature=t, entropy=True, chunk_tokens=c)
                assert ent is not None
                return lp, ent

            def lp_only(x: Tensor, c: int = chunk, t: float = temperature) -> Tensor:
                return token_log_probs(x, targets, temperature=t, chunk_tokens=c)[0]

            assert torch.autograd.gradcheck(both, (logits,))
            assert torch.autograd.gradcheck(lp_only, (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_values_equal_the_reference_bit_for_bit_and_gradients_match(
    dtype: torch.dtype, temperature: float, chunk: int
) -> None:
    logits, targets = inputs((3, 5), 50, dtype)  # 15 tokens: 4 and 7 do not divide it
    w_lp, w_ent = torch.randn(3, 5), torch.randn(3, 5)
    x_ref = logits.clone().requires_grad_(True)
    lp_ref, ent_ref = reference(x_ref, targets, temperature)
    ((lp_ref * w_lp).sum() + (ent_ref * w_ent).sum()).backward()
    x = logits.clone().requires_grad_(True)
    lp, ent = token_log_probs(x, targets, temperature=temperature, entropy=True, chunk_tokens=chunk)
    assert ent is not None and lp.dtype == ent.dtype == torch.float32
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)  # the same float32 operations, row by row
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert x.grad is not None and x_ref.grad is not None and x.grad.dtype == dtype
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)


@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
def test_gradients_stay_float32_accurate_for_peaked_distributions(scale: float) -> None:
    """Logits in the thousands: the backward must not lose the log-sum-exp's low bits.

    The yardstick is float32 autograd through the whole log-softmax: against the float64 gradient,
    the chunked backward may err at most twice as much as it (plus 1e-6), at every scale.
    """
    logits, targets = inputs((8, 4), 200, torch.float64)
    logits = logits * scale
    g = torch.Generator().manual_seed(1)
    w_lp = torch.randn(8, 4, dtype=torch.float64, generator=g)
    w_ent = torch.randn(8, 4, dtype=torch.float64, generator=g)

    def objective(lp: Tensor, ent: Tensor) -> Tensor:
        return (lp * w_lp.to(lp.dtype)).sum() + (ent * w_ent.to(ent.dtype)).sum()

    def whole(x: Tensor) -> Tensor:
        logp = torch.log_softmax(x / 0.5, -1)
        objective(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)).backward()
        assert x.grad is not None
        return x.grad.double()

    exact = whole(logits.clone().requires_grad_(True))
    plain32 = whole(logits.float().requires_grad_(True))
    x = logits.float().requires_grad_(True)
    lp, ent = token_log_probs(x, targets, temperature=0.5, entropy=True, chunk_tokens=5)
    assert ent is not None
    objective(lp, ent).backward()
    assert x.grad is not None
    err, err32 = (x.grad.double() - exact).abs().max().item(), (plain32 - exact).abs().max().item()
    assert err <= 2 * err32 + 1e-6, (err, err32)


@pytest.mark.parametrize("which", ["log_probs", "entropy"])
def test_a_gradient_through_one_output_only_matches_the_reference(which: str) -> None:
    logits, targets = inputs((4, 3), 11, torch.float32)
    x_ref, x = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    pick = 0 if which == "log_probs" else 1
    reference(x_ref, targets, 1.3)[pick].pow(2).sum().backward()
    out = token_log_probs(x, targets, temperature=1.3, entropy=True, chunk_tokens=5)[pick]
    assert out is not None
    out.pow(2).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)


def test_without_entropy_no_entropy_is_returned_and_the_gradient_matches() -> None:
    logits, targets = inputs((2, 6), 9, torch.float32)
    x_ref, x = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    lp_ref = reference(x_ref, targets, 0.5)[0]
    lp, ent = token_log_probs(x, targets, temperature=0.5, chunk_tokens=5)
    assert ent is None and torch.equal(lp, lp_ref)
    lp_ref.sum().backward()
    lp.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_a_strided_slice_is_read_in_place_and_gets_its_gradient(fused: bool) -> None:
    """The engines pass ``logits[:, :r]`` of ``[batch, r + 1, vocab]``: its rows do not flatten to a view."""
    full, targets = inputs((3, 5), 13, torch.float32)
    targets = targets[:, :4]
    x_ref, x = full.clone().requires_grad_(True), full.clone().requires_grad_(True)
    lp_ref, ent_ref = reference(x_ref[:, :4], targets, 1.0)
    (lp_ref.sum() + ent_ref.sum()).backward()
    lp, ent = token_log_probs(x[:, :4], targets, entropy=True, chunk_tokens=3, fused=fused)  # chunks straddle rows
    assert ent is not None
    if fused:  # within float32 rounding
        torch.testing.assert_close(lp, lp_ref, atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(ent, ent_ref, atol=2e-6, rtol=1e-6)
    else:  # bit for bit
        assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)
    (lp.sum() + ent.sum()).backward()
    assert x.grad is not None and float(x.grad[:, 4].abs().sum()) == 0.0
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_zero_tokens_give_empty_outputs_and_an_empty_gradient(fused: bool) -> None:
    x = torch.randn(2, 0, 8, requires_grad=True)
    lp, ent = token_log_probs(x, torch.zeros(2, 0, dtype=torch.int64), entropy=True, fused=fused)
    assert ent is not None and lp.shape == ent.shape == (2, 0)
    (lp.sum() + ent.sum()).backward()
    assert x.grad is not None and x.grad.shape == (2, 0, 8)


def test_no_grad_forward_and_outputs_edited_in_place() -> None:
    logits, targets = inputs((2, 3), 5, torch.float32)
    with torch.no_grad():
        lp, _ = token_log_probs(logits, targets)
    assert not lp.requires_grad and torch.equal(lp, reference(logits, targets, 1.0)[0])
    mask = torch.tensor([[True, False, True], [False, True, True]])
    x_ref, x = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    lp_ref, ent_ref = reference(x_ref, targets, 1.0)
    (lp_ref.masked_fill_(mask, 0.0).sum() + ent_ref.mul_(2.0).sum()).backward()
    lp, ent = token_log_probs(x, targets, entropy=True)
    assert ent is not None
    (lp.masked_fill_(mask, 0.0).sum() + ent.mul_(2.0).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)


def test_bad_inputs_get_one_clear_error() -> None:
    logits, targets = inputs((2, 3), 5, torch.float32)
    with pytest.raises(BatchValidationError, match=r"targets must be integer token ids of shape \(2, 3\)"):
        token_log_probs(logits, targets[:, :2])
    with pytest.raises(BatchValidationError, match="targets must be integer"):
        token_log_probs(logits, targets.float())
    with pytest.raises(BatchValidationError, match="logits must be a floating tensor"):
        token_log_probs(targets, targets[..., 0])
    with pytest.raises(ConfigError, match="temperature"):
        token_log_probs(logits, targets, temperature=0.0)
    with pytest.raises(ConfigError, match="chunk_tokens must be an integer >= 1, got 0"):
        token_log_probs(logits, targets, chunk_tokens=0)


class LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any operation creates (the backward's operations too)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("entropy", [False, True])
def test_no_float32_tensor_is_larger_than_one_chunk(entropy: bool) -> None:
    logits, targets = inputs((4, 10), 50, torch.bfloat16)
    full = logits[:, :9]  # a strided slice, as the engines pass it
    targets = targets[:, :9]

    def run(fn: Any) -> int:
        x = full.clone().requires_grad_(True)
        with LargestFloat32() as mode:
            lp, ent = fn(x)
            (lp.sum() + (ent.sum() if ent is not None else 0)).backward()
        return mode.largest

    assert run(lambda x: reference(x, targets, 0.7)) == 36 * 50  # the check sees the reference's tensors
    assert run(lambda x: token_log_probs(x, targets, temperature=0.7, entropy=entropy, chunk_tokens=5)) <= 5 * 50


# ---------------------------------------------------------------------------------------- fused
# ``fused=True`` (the default on CUDA) runs each chunk through two compiled functions; on CPU torch
# compiles them with its C++ backend, so these tests run the traced code the GPU runs, compiled for
# another device.


def _both(x: Tensor, targets: Tensor, *, fused: bool, temperature: float = 1.0, chunk: int = 4
          ) -> tuple[Tensor, Tensor]:
    lp, ent = token_log_probs(x, targets, temperature=temperature, entropy=True, chunk_tokens=chunk, fused=fused)
    assert ent is not None
    return lp, ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_values_and_gradients_match_the_eager_passes(dtype: torch.dtype, temperature: float) -> None:
    logits, targets = inputs((3, 5), 50, dtype)  # 15 tokens, chunks of 4: the last chunk is smaller
    w_lp, w_ent = torch.randn(3, 5), torch.randn(3, 5)
    got = []
    for fused in (False, True):
        x = logits.clone().requires_grad_(True)
        lp, ent = _both(x, targets, fused=fused, temperature=temperature)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        assert x.grad is not None and x.grad.dtype == dtype and lp.dtype == ent.dtype == torch.float32
        got.append((lp, ent, x.grad))
    (lp_e, ent_e, grad_e), (lp_f, ent_f, grad_f) = got
    torch.testing.assert_close(lp_f, lp_e, atol=2e-6, rtol=1e-6)  # float32 rounding, not bit for bit
    torch.testing.assert_close(ent_f, ent_e, atol=2e-6, rtol=1e-6)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(grad_f, grad_e, **tol)
    assert not torch.equal(grad_f, torch.zeros_like(grad_f))


def test_fused_gradcheck_in_double_through_both_outputs_and_through_one() -> None:
    logits, targets = inputs((2, 5), 7, torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: _both(x, targets, fused=True, temperature=0.6, chunk=3), (logits,))
    assert torch.autograd.gradcheck(
        lambda x: token_log_probs(x, targets, temperature=0.6, chunk_tokens=3, fused=True)[0], (logits,))
    assert torch.autograd.gradcheck(lambda x: _both(x, targets, fused=True, chunk=3)[1], (logits,))


def test_fused_gradients_stay_float32_accurate_for_peaked_distributions() -> None:
    logits, targets = inputs((8, 4), 200, torch.float64)
    logits = logits * 300.0
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 4, dtype=torch.float64, generator=g)
    x64 = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(x64 / 0.5, -1)
    (logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * w).sum().backward()
    x = logits.float().requires_grad_(True)
    (token_log_probs(x, targets, temperature=0.5, chunk_tokens=5, fused=True)[0] * w.float()).sum().backward()
    assert x.grad is not None and x64.grad is not None
    assert float((x.grad.double() - x64.grad).abs().max()) < 1e-5


def test_fused_is_the_default_on_cuda_only() -> None:
    from verl_core.enginekit.token_stats import fuses_log_probs

    assert fuses_log_probs(torch.device("cuda")) and not fuses_log_probs(torch.device("cpu"))
    logits, targets = inputs((2, 3), 5, torch.float32)
    assert torch.equal(token_log_probs(logits, targets)[0], reference(logits, targets, 1.0)[0])  # eager on CPU


def test_a_fused_chunk_that_fails_to_compile_warns_once_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.exc as dynamo_exc

    from verl_core.enginekit import token_stats
    from verl_core.enginekit.sampling import CompiledOrEager

    calls = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise dynamo_exc.TorchDynamoException("inductor cannot lower this")

    made = {which: CompiledOrEager(fn, f"token log-probs ({which})", compiled=failing)
            for which, fn in (("forward", token_stats._fused_forward), ("backward", token_stats._fused_backward))}
    monkeypatch.setattr(token_stats, "_compiled", made.__getitem__)
    logits, targets = inputs((3, 5), 50, torch.float32)
    x_ref, x = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    lp_ref, ent_ref = _both(x_ref, targets, fused=False)
    (lp_ref.sum() + ent_ref.sum()).backward()
    with pytest.warns(RuntimeWarning, match=r"token log-probs \(forward\): torch.compile failed"):
        lp, ent = _both(x, targets, fused=True)
    with pytest.warns(RuntimeWarning, match=r"token log-probs \(backward\): torch.compile failed"):
        (lp.sum() + ent.sum()).backward()
    assert len(calls) == 2  # one failure each; the later chunks run eagerly without trying again
    torch.testing.assert_close(lp, lp_ref, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
