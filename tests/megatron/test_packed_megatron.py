"""Packed micro-batches in the Megatron training engine (``MegatronOptions.pack_sequences``).

One launch of ``packed_checks.py`` per tensor-parallel size (1 and 2): a packed and a padded
float32 engine of one spec give the same forward outputs and the same update (loss, grad norm,
gradients, weights) on a ragged batch, an actor's and a critic's; the packed engine declares
``packed_sequences`` and its budget counts real tokens. The option's refusals run in-process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from verl_conformance.testkit import TinyModelSpec, assert_close, launch_torchrun, tiny_model
from verl_core import ConfigError, EngineSpec, OptimConfig, ParallelSizes
from verl_megatron.options import MegatronOptions

SCRIPT = Path(__file__).with_name("packed_checks.py")
_launched: dict[int, list[dict[str, Any]]] = {}


def ranks_of(tp: int) -> list[dict[str, Any]]:
    if tp not in _launched:
        _launched[tp] = launch_torchrun(SCRIPT, tp, [str(tp)], timeout=300,
                                        env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return _launched[tp]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_packed_equals_padded(tp: int, role: str) -> None:
    for r in ranks_of(tp):
        padded, packed = r[role]["padded"], r[role]["packed"]
        assert packed["packs"] and packed["declared"] and packed["packed_calls"] > 0
        assert not padded["packs"] and not padded["declared"] and padded["packed_calls"] == 0
        mask = r["mask"]
        diffs = {k: float((packed["outputs"][k] - v).abs().max()) for k, v in padded["outputs"].items()}
        diffs["grads"] = max(float((packed["grads"][n] - g).abs().max()) for n, g in padded["grads"].items())
        diffs["weights"] = max(float((packed["weights"][n] - w).abs().max()) for n, w in padded["weights"].items())
        diffs["loss"] = abs(packed["metrics"]["loss"] - padded["metrics"]["loss"])
        diffs["grad_norm"] = abs(packed["grad_norm"] - padded["grad_norm"])
        print(f"tp={tp} {role} max |packed - padded|: {diffs}")
        for k, v in padded["outputs"].items():
            assert_close(packed["outputs"][k], v, dtype="float32", quantity=k)
            assert not bool(packed["outputs"][k][~mask].any())
        assert packed["metrics"]["loss"] == pytest.approx(padded["metrics"]["loss"], rel=1e-5, abs=1e-7)
        assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
        assert set(packed["grads"]) == set(padded["grads"])
        for name, g in padded["grads"].items():
            assert_close(packed["grads"][name], g, dtype="float32", quantity="grad", what=f"grad {name}")
        for name, w in padded["weights"].items():
            assert_close(packed["weights"][name], w, dtype="float32", quantity="weights", what=name)
        # the same budget holds more of the ragged batch's sequences when it counts real tokens
        assert packed["metrics"]["num_micro_batches"] < padded["metrics"]["num_micro_batches"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_auto_packing_is_off_for_float32_on_cpu() -> None:
    assert all(r["auto"] is False for r in ranks_of(1))


def test_pack_sequences_refusals() -> None:
    with pytest.raises(ConfigError, match="pack_sequences=True needs attention='sdpa'"):
        MegatronOptions(attention="local", pack_sequences=True)
    MegatronOptions(attention="local")  # auto: off with local attention
    with pytest.raises(ConfigError, match="pack_sequences"):
        MegatronOptions(pack_sequences="yes")  # type: ignore[arg-type]


def test_pack_sequences_refuses_pipeline_stages() -> None:
    from verl_megatron.training import MegatronTrainingEngine

    path = tiny_model(TinyModelSpec(arch="llama"))
    spec = EngineSpec(str(path), "actor", parallel=ParallelSizes(pp=2), optim=OptimConfig(lr=1e-3),
                      options={"pack_sequences": True})
    started = torch.distributed.is_initialized()  # an earlier in-process test may have started one
    with pytest.raises(ConfigError, match="pack_sequences=True cannot run here: pipeline parallel size 2"):
        MegatronTrainingEngine(spec)
    assert torch.distributed.is_initialized() == started  # refused before any process group
