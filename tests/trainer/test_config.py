"""Run configuration: TOML/YAML loading, overrides, and errors that name the bad key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_core.errors import ConfigError
from verl_core.trainer.config import (
    RunConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_override,
)

TOML = """
steps = 30
seed = 3
[model]
hidden_size = 32
[rollout]
n = 4
max_new_tokens = 6
[algorithm]
name = "grpo"
options = { clip_high = 0.28 }
[optim]
lr = 1e-3
betas = [0.9, 0.95]
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_toml_file_and_overrides(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "run.toml", TOML), ["optim.lr=3e-3", "task.name=reverse",
                                                           "algorithm.options.clip_high=0.3",
                                                           "logging.plot=false"])
    assert cfg.steps == 30
    assert cfg.model.hidden_size == 32
    assert cfg.rollout.n == 4
    assert cfg.optim.lr == 3e-3
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.task.name == "reverse"
    assert cfg.algorithm.options == {"clip_high": 0.3}
    assert cfg.logging.plot is False
    assert cfg.model.num_layers == RunConfig().model.num_layers  # untouched default
    assert config_from_dict(config_to_dict(cfg)) == cfg  # round trip


def test_yaml_file(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    cfg = load_config(write(tmp_path, "run.yaml", "steps: 5\nrollout:\n  n: 2\n  temperature: 0.7\n"))
    assert cfg.steps == 5
    assert cfg.rollout.n == 2
    assert cfg.rollout.temperature == 0.7


def test_yaml_without_pyyaml_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ConfigError, match=r"needs PyYAML: pip install 'verl-core\[yaml\]'"):
        load_config(write(tmp_path, "run.yaml", "steps: 5\n"))


def test_unknown_key_names_full_key_and_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temprature'.*temperature") as info:
        load_config(None, ["rollout.temprature=0.5"])
    assert "max_new_tokens" in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown config key 'stepz'; valid keys: steps"):
        config_from_dict({"stepz": 3})
    with pytest.raises(ConfigError, match=r"unknown config key 'model.hiden'"):
        config_from_dict({"model": {"hiden": 3}})


def test_invalid_choice_names_key_and_choices() -> None:
    with pytest.raises(ConfigError, match=r"'task.name': 'sort' is not valid; choices: 'copy', 'reverse', 'add'"):
        load_config(None, ["task.name=sort"])
    with pytest.raises(ConfigError, match=r"'optim.schedule'.*'constant', 'cosine'"):
        load_config(None, ["optim.schedule=linear"])


def test_wrong_types_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'rollout.n': expected an integer, got 'many'"):
        load_config(None, ["rollout.n=many"])
    with pytest.raises(ConfigError, match=r"'logging.plot': expected true or false"):
        load_config(None, ["logging.plot=1"])
    with pytest.raises(ConfigError, match=r"'optim.betas': expected a list of float, float"):
        load_config(None, ["optim.betas=[0.9]"])
    with pytest.raises(ConfigError, match=r"'model': expected a table"):
        config_from_dict({"model": 3})
    with pytest.raises(ConfigError, match=r"'steps': expected an integer, got 2.5"):
        config_from_dict({"steps": 2.5})


def test_out_of_range_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'rollout.temperature' = 0.0 is out of range; allowed: > 0"):
        load_config(None, ["rollout.temperature=0"])
    with pytest.raises(ConfigError, match=r"'steps' = 0 is out of range"):
        load_config(None, ["steps=0"])
    with pytest.raises(ConfigError, match=r"'rollout.max_new_tokens' = 3 is too short"):
        load_config(None, ["rollout.max_new_tokens=3"])
    with pytest.raises(ConfigError, match=r"'batch.min_tokens'.*'batch.max_tokens'"):
        load_config(None, ["batch.min_tokens=100", "batch.max_tokens=10"])


def test_override_parsing() -> None:
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a=1e-3") == (["a"], 1e-3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=hello") == (["a"], "hello")
    assert parse_override('a="x y"') == (["a"], "x y")
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    with pytest.raises(ConfigError, match=r"must look like key\.sub=value"):
        parse_override("novalue")
    with pytest.raises(ConfigError, match="is a value, not a table"):
        apply_overrides({"steps": 3}, ["steps.x=1"])


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"unknown format '\.ini'"):
        load_config(write(tmp_path, "x.ini", ""))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "bad.toml", "steps = = 3"))
