"""An engine checkpoint that does not fit the engine is refused before anything is copied (hf backend).

``param.copy_(saved)`` broadcasts: a norm weight saved with shape (1,) would fill a (128,)
parameter with one value, an embedding saved as one row would fill every row, and both would load
without error. Each case corrupts one part of a real checkpoint (a model tensor's shape or dtype,
a missing or an extra tensor, an Adam moment, a step counter, a float32 master, the RNG state) and
loads it into an engine that trained on other data: the load must raise ``CheckpointError``
naming the tensor, what was saved, what the engine expects and the folder, and leave the engine's
weights, optimizer state, step and the RNG exactly as they were. The megatron engine's checks run
in its torchrun launches (tests/megatron/engine_checks.py: ``refused_load``).
"""

from __future__ import annotations

import copy
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl_conformance.testkit import TinyModelSpec, random_batch, tiny_model
from verl_core import CheckpointError, EngineSpec, GlobalBatchStats, OptimConfig
from verl_core.algorithms import Algorithm
from verl_hf.checkpoint import current_state_dir
from verl_hf.training import HFTrainingEngine

LOSS = Algorithm.grpo(kl_loss_coef=0.0).actor_loss
MODEL = str(tiny_model(TinyModelSpec()))
H = TinyModelSpec().hidden_size
Edit = Callable[[dict[str, Any]], None]


def _engine(dtype: Literal["float32", "bfloat16"] = "float32") -> HFTrainingEngine:
    return HFTrainingEngine(EngineSpec(model_path=MODEL, role="actor", dtype=dtype, optim=OptimConfig(lr=1e-2),
                                       max_prompt_len=16, max_response_len=16))


def _train(engine: HFTrainingEngine, seed: int) -> None:
    b = random_batch(batch_size=4, max_prompt=5, max_response=5, seed=seed, with_rl_fields=True)
    b = b.update(old_log_probs=engine.forward(b)["log_probs"])
    engine.forward_backward(b, LOSS, GlobalBatchStats.of(b))
    assert not engine.optimizer_step().skipped


def _snapshot(engine: HFTrainingEngine) -> dict[str, Any]:
    assert engine._optimizer is not None
    return {
        "model": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "optimizer": copy.deepcopy(engine._optimizer.state_dict()),
        "masters": engine._master.state() if engine._master is not None else None,
        "step": engine.step,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A float32 checkpoint after two steps, and the state it holds."""
    engine = _engine()
    for seed in (0, 1):
        _train(engine, seed)
    root = tmp_path_factory.mktemp("saved") / "ck"
    engine.save_checkpoint(root)
    return root, _snapshot(engine)


@pytest.fixture(scope="module")
def target() -> HFTrainingEngine:
    """An engine one step along other data: its weights and Adam state differ from the checkpoint's."""
    engine = _engine()
    _train(engine, 7)
    return engine


def _corrupt(root: Path, dest: Path, *, model: Edit | None = None, trainer: Edit | None = None,
             rng: Edit | None = None) -> Path:
    """A copy of checkpoint ``root`` with its files edited; returns the copy's state folder."""
    shutil.copytree(root, dest)
    state = current_state_dir(dest)
    if model is not None:
        weights = load_file(str(state / "model.safetensors"))
        model(weights)
        save_file(weights, str(state / "model.safetensors"))
    for name, edit in (("trainer_state.pt", trainer), ("rng_rank0.pt", rng)):
        if edit is not None:
            obj = torch.load(state / name, weights_only=True)
            edit(obj)
            torch.save(obj, state / name)
    return state


def _refused(engine: HFTrainingEngine, state: Path, tally: Counter[str], kind: str) -> str:
    """Load the corrupted checkpoint; return the message after checking nothing changed."""
    before, rng = _snapshot(engine), torch.get_rng_state()
    tally[f"fuzz/engine checkpoint load ({kind})"] += 1
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(state.parent)
    after = _snapshot(engine)
    for part in ("model", "optimizer", "masters", "step"):
        assert _same(after[part], before[part]), f"a refused load changed the engine's {part}"
    assert torch.equal(torch.get_rng_state(), rng), "a refused load changed the RNG"
    message = str(info.value)
    assert f"checkpoint {str(state)!r}" in message, message
    return message


@pytest.mark.parametrize(("name", "shape"), [("model.norm.weight", (1,)), ("model.embed_tokens.weight", (1, H))])
def test_a_broadcastable_wrong_shape_is_refused(
    name: str, shape: tuple[int, ...], saved: tuple[Path, dict[str, Any]], target: HFTrainingEngine,
    tmp_path: Path, tally: Counter[str],
) -> None:
    root, state = saved
    want = tuple(state["model"][name].shape)
    torch.empty(want).copy_(torch.zeros(shape))  # what a load without the check would have done silently

    def shrink(w: dict[str, Any]) -> None:
        w[name] = w[name].reshape(-1)[: torch.Size(shape).numel()].reshape(shape).clone()

    message = _refused(target, _corrupt(root, tmp_path / "ck", model=shrink), tally, "broadcastable shape")
    assert f"model tensor {name!r} is saved with shape {shape} dtype float32" in message, message
    assert f"expects shape {want} dtype float32" in message, message


def test_a_wrong_dtype_is_refused(
    saved: tuple[Path, dict[str, Any]], target: HFTrainingEngine, tmp_path: Path, tally: Counter[str]
) -> None:
    name = "model.layers.1.mlp.up_proj.weight"

    def halve(w: dict[str, Any]) -> None:
        w[name] = w[name].bfloat16()

    message = _refused(target, _corrupt(saved[0], tmp_path / "ck", model=halve), tally, "dtype")
    assert f"model tensor {name!r} is saved with shape (128, {H}) dtype bfloat16" in message, message
    assert f"expects shape (128, {H}) dtype float32" in message, message


@pytest.mark.parametrize("kind", ["missing", "unexpected"])
def test_a_missing_or_an_extra_tensor_is_refused(
    kind: str, saved: tuple[Path, dict[str, Any]], target: HFTrainingEngine, tmp_path: Path, tally: Counter[str]
) -> None:
    def edit(w: dict[str, Any]) -> None:
        if kind == "missing":
            del w["model.layers.0.self_attn.k_proj.weight"]
        else:
            w["model.layers.2.input_layernorm.weight"] = torch.ones(H)

    message = _refused(target, _corrupt(saved[0], tmp_path / "ck", model=edit), tally, f"{kind} tensor")
    if kind == "missing":
        assert "missing 1 model tensors ('model.layers.0.self_attn.k_proj.weight')" in message, message
    else:
        assert "1 unexpected model tensors ('model.layers.2.input_layernorm.weight')" in message, message


def _first_state(t: dict[str, Any]) -> dict[str, Any]:
    """Adam's state of the first parameter (the input embedding)."""
    state: dict[str, Any] = t["optimizer"]["state"][0]
    return state


OPTIMIZER_CASES: dict[str, tuple[Edit, str]] = {
    "moment shape": (lambda t: _first_state(t).update(exp_avg=torch.zeros(1, H)),
                     f"optimizer state tensor 'model.embed_tokens.weight.exp_avg' is saved with shape (1, {H})"),
    "missing moment": (lambda t: _first_state(t).pop("exp_avg_sq"),
                       "missing 1 optimizer state tensors ('model.embed_tokens.weight.exp_avg_sq')"),
    "negative Adam step": (lambda t: _first_state(t).update(step=torch.tensor(-1.0)),
                           "step counter 'model.embed_tokens.weight Adam step' is -1.0"),
    "fractional Adam step": (lambda t: _first_state(t).update(step=torch.tensor(1.5)), "is 1.5; expected a whole"),
    "NaN Adam step": (lambda t: _first_state(t).update(step=torch.tensor(float("nan"))), "is nan"),
    "engine step": (lambda t: t.update(step=-2), "step counter 'step' is -2"),
    "parameter group": (lambda t: t["optimizer"]["param_groups"][0]["params"].pop(),
                        "optimizer parameter group 0 holds"),
    "scheduler": (lambda t: t["scheduler"].update(last_epoch=-5), "'scheduler last_epoch' is -5"),
}


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
def test_optimizer_state_and_step_counters_are_checked(
    case: str, saved: tuple[Path, dict[str, Any]], target: HFTrainingEngine, tmp_path: Path, tally: Counter[str]
) -> None:
    edit, expected = OPTIMIZER_CASES[case]
    message = _refused(target, _corrupt(saved[0], tmp_path / "ck", trainer=edit), tally, case)
    assert expected in message, message


def test_a_broken_rng_state_is_refused(
    saved: tuple[Path, dict[str, Any]], target: HFTrainingEngine, tmp_path: Path, tally: Counter[str]
) -> None:
    def cut(r: dict[str, Any]) -> None:
        r["torch"] = r["torch"][:100].clone()

    message = _refused(target, _corrupt(saved[0], tmp_path / "ck", rng=cut), tally, "RNG state")
    assert "the RNG state is not a torch and Python generator state" in message, message


def test_float32_masters_are_checked(tmp_path: Path, tally: Counter[str]) -> None:
    source, engine = _engine("bfloat16"), _engine("bfloat16")
    _train(source, 0)
    _train(engine, 7)
    source.save_checkpoint(tmp_path / "bf16")
    norm = [n for n, _ in source.model.named_parameters()].index("model.norm.weight")

    def shrink(t: dict[str, Any]) -> None:
        t["master_weights"][norm] = torch.ones(1)

    state = _corrupt(tmp_path / "bf16", tmp_path / "ck", trainer=shrink)
    message = _refused(engine, state, tally, "master shape")
    assert f"float32 master tensor 'model.norm.weight' is saved with shape (1,) dtype float32, this engine " \
           f"expects shape ({H},) dtype float32" in message, message


def test_a_good_checkpoint_still_loads_exactly(saved: tuple[Path, dict[str, Any]]) -> None:
    root, state = saved
    engine = _engine()
    _train(engine, 7)
    engine.load_checkpoint(root)
    got = _snapshot(engine)
    for part in ("model", "optimizer", "step"):
        assert _same(got[part], state[part]), part
    assert got["step"] == 2
