"""MegatronOptions' rollout choices made per device: the fast decode path by default on CUDA, as
the hf rollout's, and Megatron's own KV cache on the CPU (no engine is built: no launch needed)."""

from __future__ import annotations

import pytest
import torch

from verl_core import ConfigError
from verl_megatron.options import DEFAULT_DECODE_WINDOW, MegatronOptions

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _choices(options: MegatronOptions) -> tuple[object, ...]:
    return (options.rollout_static_cache, options.rollout_cuda_graphs, options.rollout_compile,
            options.rollout_decode_window)


def test_the_default_is_the_fast_decode_path_on_cuda_and_megatron_s_kv_cache_on_cpu() -> None:
    assert _choices(MegatronOptions().resolve_rollout(CUDA)) == (True, True, True, DEFAULT_DECODE_WINDOW)
    assert _choices(MegatronOptions().resolve_rollout(CPU)) == (False, False, False, 0)
    # graphs replay one rank's step: tensor parallelism keeps the static cache and compilation only
    assert _choices(MegatronOptions().resolve_rollout(CUDA, tp=2)) == (True, False, True, DEFAULT_DECODE_WINDOW)
    # megatron's local attention has no static cache: Megatron's KV cache, as before
    assert _choices(MegatronOptions(attention="local").resolve_rollout(CUDA)) == (False, False, False, 0)


def test_choices_set_by_the_user_are_kept() -> None:
    assert _choices(MegatronOptions(rollout_compile=False).resolve_rollout(CUDA)) == (True, True, False, 256)
    assert _choices(MegatronOptions(rollout_static_cache=False).resolve_rollout(CUDA)) == (False, False, False, 0)
    assert _choices(MegatronOptions(rollout_decode_window=0).resolve_rollout(CUDA)) == (True, True, True, 0)
    # on the CPU a fast-path option asks for the static cache, as with the hf rollout
    assert _choices(MegatronOptions(rollout_static_cache=True).resolve_rollout(CPU)) == (True, False, False, 0)
    assert _choices(MegatronOptions(rollout_compile=True).resolve_rollout(CPU)) == (True, False, True, 0)
    assert _choices(MegatronOptions(rollout_decode_window=64).resolve_rollout(CPU)) == (True, False, False, 64)
    resolved = MegatronOptions().resolve_rollout(CUDA)
    assert resolved.resolve_rollout(CUDA) == resolved  # resolving again changes nothing


def test_the_fused_decode_kernel_is_on_where_it_can_run_and_refused_where_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``rollout_decode_kernel``: the hf rollout's kernel and the same rules
    (:func:`verl_core.enginekit.decode_attention.resolve_decode_kernel`), for the static decode only."""
    import verl_core.enginekit.decode_attention as decode_attention

    bf16 = torch.bfloat16
    monkeypatch.setattr(decode_attention, "fused_decode_kernel", lambda: object())  # as where Triton is installed
    assert MegatronOptions().resolve_rollout(CUDA, dtype=bf16).rollout_decode_kernel is True
    assert MegatronOptions().resolve_rollout(CUDA, dtype=torch.float32).rollout_decode_kernel is False
    assert MegatronOptions().resolve_rollout(CPU, dtype=bf16).rollout_decode_kernel is False
    assert MegatronOptions(rollout_decode_kernel=False).resolve_rollout(CUDA, dtype=bf16).rollout_decode_kernel is False
    assert MegatronOptions(rollout_static_cache=False).resolve_rollout(CUDA, dtype=bf16).rollout_decode_kernel is False
    resolved = MegatronOptions().resolve_rollout(CUDA, dtype=bf16)
    assert resolved.resolve_rollout(CUDA, dtype=bf16) == resolved
    # set on the CPU, it asks for the static cache (as the other fast-path options) and is refused there
    with pytest.raises(ConfigError, match="megatron option rollout_decode_kernel=True needs a CUDA device .* runs on "
                                          "cpu in bfloat16; set rollout_decode_kernel=False"):
        MegatronOptions(rollout_decode_kernel=True).resolve_rollout(CPU, dtype=bf16)
    with pytest.raises(ConfigError, match="in float32"):
        MegatronOptions(rollout_decode_kernel=True).resolve_rollout(CUDA)
    with pytest.raises(ConfigError, match="rollout_decode_kernel is the static decode step's attention"):
        MegatronOptions(rollout_static_cache=False, rollout_decode_kernel=True)
    monkeypatch.setattr(decode_attention, "fused_decode_kernel", lambda: None)  # no Triton
    assert MegatronOptions().resolve_rollout(CUDA, dtype=bf16).rollout_decode_kernel is False
    with pytest.raises(ConfigError, match="needs Triton, which is not installed"):
        MegatronOptions(rollout_decode_kernel=True).resolve_rollout(CUDA, dtype=bf16)


def test_contradictory_choices_are_refused() -> None:
    with pytest.raises(ConfigError, match="rollout_decode_window sets the attention windows"):
        MegatronOptions(rollout_static_cache=False, rollout_decode_window=64)
    with pytest.raises(ConfigError, match="needs attention='sdpa'"):
        MegatronOptions(rollout_static_cache=True, attention="local")
    with pytest.raises(ConfigError, match="rollout_decode_window"):
        MegatronOptions(rollout_decode_window=-2)


def test_the_compiled_decode_step_falls_back_to_last_logits_where_it_fails_to_compile() -> None:
    """The megatron rollout's compiled step is a CompiledOrEager around last_logits: where inductor
    cannot compile it, last_logits itself runs the step (tests/core/test_sampling.py tests the fallback)."""
    from verl_core.enginekit.sampling import CompiledOrEager
    from verl_megatron.static_decode import compiled_last_logits, last_logits

    step = compiled_last_logits()
    assert isinstance(step, CompiledOrEager) and step.fn is last_logits and step.error is None
