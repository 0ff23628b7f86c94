"""The hf backend through the plugin registry, as the trainer and the conformance suite reach it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hf_helpers import model_path

from verl_core import (
    PROTOCOL_VERSION,
    ConfigError,
    EngineSpec,
    RewardEngine,
    RolloutEngine,
    TrainingEngine,
    get_backend,
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
)
from verl_hf.config import HFOptions


def test_backend_is_registered_with_every_role() -> None:
    backend = get_backend("hf")
    assert backend.distribution == "verl-hf"
    assert backend.spec.protocol_version == PROTOCOL_VERSION
    assert set(backend.spec.roles) == {"actor", "reference", "critic", "rollout", "reward"}
    critic = backend.capabilities("critic")
    assert critic.values and not critic.log_probs  # type: ignore[union-attr]
    assert backend.capabilities("rollout").seeding == "per_sample"  # type: ignore[union-attr]


def test_plugin_module_does_not_import_transformers() -> None:
    code = (
        "import sys, verl_hf.plugin\n"
        "from verl_core import available_backends\n"
        "assert 'hf' in available_backends()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'safetensors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registry_builds_engines_that_subclass_the_protocols() -> None:
    path = model_path()
    actor = get_training_engine("hf", EngineSpec(model_path=path, role="actor"))
    assert TrainingEngine in type(actor).__mro__
    rollout = get_rollout_engine("hf", EngineSpec(model_path=path, role="rollout"))
    assert RolloutEngine in type(rollout).__mro__
    reward = get_reward_engine("hf", EngineSpec(model_path=model_path(head="reward"), role="reward"))
    assert RewardEngine in type(reward).__mro__
    assert actor.tokenizer.eos_token_id == 1 and actor.tokenizer.pad_token_id == 0
    assert actor.tokenizer.decode(actor.tokenizer.encode("ab 12")) == "ab 12"


def test_unknown_or_bad_options_are_rejected() -> None:
    with pytest.raises(ConfigError, match="valid keys"):
        get_training_engine("hf", EngineSpec(model_path=model_path(), role="actor", options={"nope": 1}))
    with pytest.raises(ConfigError, match="data_parallel"):
        HFOptions(data_parallel="ddp")  # type: ignore[arg-type]
