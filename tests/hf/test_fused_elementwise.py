"""HFOptions.fused_elementwise: RMSNorms and SiLU-gated MLPs routed through compiled functions, with
transformers' arithmetic."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import actor_spec, flat_grads, model_path

from verl_conformance.testkit import assert_close, random_batch
from verl_core import EngineSpec, GlobalBatchStats, SamplingParams
from verl_core.algorithms import Algorithm
from verl_hf.config import HFOptions
from verl_hf.fused_elementwise import (
    compile_decoder_layers,
    compiled_layers,
    fuse_elementwise,
    fused_modules,
)
from verl_hf.rollout import HFRolloutEngine
from verl_hf.training import HFTrainingEngine

PPO = Algorithm.ppo(kl_coef=0.0, entropy_coef=0.01)


def _step(engine: HFTrainingEngine) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Log-probs of a ragged batch, then one forward_backward: (log-probs, flat gradients, loss)."""
    batch = random_batch(batch_size=4, max_prompt=6, max_response=5, temperature=0.8, seed=5, with_rl_fields=True)
    old = engine.forward(batch, ["log_probs"])["log_probs"]
    batch = batch.update(old_log_probs=old + 0.05, ref_log_probs=old)
    loss = engine.forward_backward(batch, PPO.actor_loss, GlobalBatchStats.of(batch))["loss"]
    return old, flat_grads(engine.model), float(loss)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_routed_modules_compute_transformers_arithmetic_bit_for_bit(arch: str) -> None:
    """Uncompiled, the routed forwards are transformers' own operations: identical log-probs,
    loss and gradients; every RMSNorm (Qwen3's q/k norms too) and every MLP is routed."""
    spec = actor_spec(model_path(arch), options={"fused_elementwise": False})
    plain, routed = HFTrainingEngine(spec), HFTrainingEngine(spec)
    assert plain.fused_elementwise_modules == routed.fused_elementwise_modules == 0
    config = routed.model.config
    layers = config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    assert fuse_elementwise(routed.model, compile=False) == norms + layers
    assert fuse_elementwise(routed.model, compile=False) == 0  # already routed: left as it is
    assert fused_modules(routed.model) == norms + layers
    a, b = _step(plain), _step(routed)
    assert torch.equal(b[0], a[0]) and float(a[0].abs().max()) > 0
    assert b[2] == a[2]
    assert torch.equal(b[1], a[1]) and float(a[1].norm()) > 0


@pytest.mark.slow
def test_the_compiled_engine_trains_like_the_plain_one() -> None:
    """``fused_elementwise=True`` on CPU (inductor's C++ backend): log-probs, loss and gradients of
    the float32 engine within the float32 tier of the plain engine's."""
    path = model_path("llama")
    plain = HFTrainingEngine(actor_spec(path, options={"fused_elementwise": False}))
    fused = HFTrainingEngine(actor_spec(path, options={"fused_elementwise": True}))
    assert fused.fused_elementwise_modules == fused_modules(fused.model) > 0
    a, b = _step(plain), _step(fused)
    assert_close(b[0], a[0], dtype="float32", quantity="log_probs")
    assert b[2] == pytest.approx(a[2], abs=1e-5)
    assert_close(b[1], a[1], dtype="float32", quantity="grad")


def test_auto_leaves_cpu_engines_unfused() -> None:
    assert HFOptions().fused_elementwise is None
    engine = HFTrainingEngine(actor_spec(model_path()))
    assert engine.fused_elementwise_modules == 0 and fused_modules(engine.model) == 0
    rollout = HFRolloutEngine(_rollout_spec("static"))
    assert rollout.fused_elementwise_modules == 0


def test_auto_fuses_cuda_engines_in_bfloat16_only() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert HFOptions().fuses_elementwise(cuda, torch.bfloat16)
    assert not HFOptions().fuses_elementwise(cuda, torch.float32)
    assert not HFOptions().fuses_elementwise(cpu, torch.bfloat16)
    assert not HFOptions(fused_elementwise=False).fuses_elementwise(cuda, torch.bfloat16)
    assert HFOptions(fused_elementwise=True).fuses_elementwise(cpu, torch.float32)


def _rollout_spec(cache: str, **options: object) -> EngineSpec:
    return EngineSpec(model_path=model_path("llama"), role="rollout", max_prompt_len=32, max_response_len=16,
                      options={"rollout_cache": cache, **options})


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_rollout_routes_its_modules_and_samples_what_transformers_does(cache: str) -> None:
    """The rollout engine routes its norms and MLPs too (its prefill runs uncompiled); uncompiled, the
    routed modules sample the plain engine's tokens with its log-probs, bit for bit."""
    plain, routed = HFRolloutEngine(_rollout_spec(cache)), HFRolloutEngine(_rollout_spec(cache))
    layers = routed.model.config.num_hidden_layers
    assert fuse_elementwise(routed.model, compile=False) == 3 * layers + 1  # 2 norms a layer, the final norm, MLPs
    assert routed.fused_elementwise_modules == 3 * layers + 1
    batch = random_batch(batch_size=4, max_prompt=6, max_response=1, seed=3).select("prompt_ids", "prompt_mask",
                                                                                      "group_ids")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=5)
    a, b = plain.generate(batch, params), routed.generate(batch, params)
    assert torch.equal(b["response_ids"], a["response_ids"])
    assert torch.equal(b["rollout_log_probs"], a["rollout_log_probs"])
    asked = HFRolloutEngine(_rollout_spec(cache, fused_elementwise=True))  # compiles on its first generate
    assert asked.fused_elementwise_modules == 3 * layers + 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_layers_train_like_eager_ones(arch: str) -> None:
    """Each decoder layer compiled whole (traced by dynamo and split by AOT autograd; the
    ``aot_eager`` backend, so CPU tests skip inductor's C++ builds, whose kernels the fused
    element-wise test covers): log-probs, loss and gradients within the float32 tier of the eager
    engine's; every decoder layer compiled, the parameter names unchanged."""
    path = model_path(arch)
    eager = HFTrainingEngine(actor_spec(path, options={"compile_layers": False}))
    whole = HFTrainingEngine(actor_spec(path, options={"compile_layers": False}))
    assert eager.compiled_layers == whole.compiled_layers == 0
    layers = whole.model.config.num_hidden_layers
    assert compile_decoder_layers(whole.model, backend="aot_eager") == layers
    assert compile_decoder_layers(whole.model) == 0  # already compiled: left as it is
    assert whole.compiled_layers == compiled_layers(whole.model) == layers
    a, b = _step(eager), _step(whole)
    assert_close(b[0], a[0], dtype="float32", quantity="log_probs")
    assert b[2] == pytest.approx(a[2], abs=1e-5)
    assert_close(b[1], a[1], dtype="float32", quantity="grad")
    assert [n for n, _ in whole.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]


def test_compile_layers_option_compiles_every_layer() -> None:
    engine = HFTrainingEngine(actor_spec(model_path(), options={"compile_layers": True}))
    assert engine.compiled_layers == engine.model.config.num_hidden_layers > 0


def test_auto_leaves_cpu_engines_uncompiled() -> None:
    assert HFOptions().compile_layers is None
    engine = HFTrainingEngine(actor_spec(model_path()))
    assert engine.compiled_layers == 0 and compiled_layers(engine.model) == 0
