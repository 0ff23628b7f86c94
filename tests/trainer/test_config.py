"""Run configuration: TOML/YAML loading, overrides, and errors that name the bad key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_core.kernel.errors import ConfigError
from verl_core.trainer.config import (
    RunConfig,
    apply_overrides,
    check_device_here,
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


@pytest.mark.parametrize(("override", "match"), [
    ("optim.eps=-1", r"'optim.eps' = -1.0 is out of range; allowed: > 0"),
    ("critic_optim.eps=0", r"'critic_optim.eps' = 0.0 is out of range; allowed: > 0"),
    ("optim.weight_decay=-0.1", r"'optim.weight_decay' = -0.1 is out of range; allowed: >= 0"),
    ("optim.betas=[0.9, 1.0]", r"'optim.betas' = \[0.9, 1.0\] is out of range; allowed: two numbers in \[0, 1\)"),
    ("optim.lr=inf", r"'optim.lr': expected a finite number, got inf"),
    ("optim.lr=1e400", r"'optim.lr': expected a finite number"),
    ("optim.lr=0", r"'optim.lr' = 0.0 is out of range; allowed: > 0"),
    ("steps=9223372036854775808", r"'steps' = 9223372036854775808 is out of range; allowed: a 64-bit integer"),
    ("seed=-1", r"'seed' = -1 is out of range; allowed: 0 to 16777215"),
    ("output_dir=''", r"'output_dir' = '' is not valid; allowed: a non-empty path"),
    ('model.path="a\\u0000b"', r"'model.path': expected a string \(without NUL characters\)"),
    ("model.device=gpu", r"'model.device' = 'gpu' is not valid; allowed: cpu, cuda or cuda:N"),
    ("model.num_heads=3", r"'model.num_heads' = 3 does not divide 'model.hidden_size' = 64"),
    ("model.num_kv_heads=4", r"'model.num_kv_heads' = 4 does not divide 'model.num_heads' = 2"),
    ("task.digits=9", r"'rollout.max_new_tokens' = 8 is too short for 'task.name' = 'copy' with 'task.digits' = 9"),
    ("algorithm.options=3", r"'algorithm.options': expected a table, got 3"),
    ("backends.options.critc={}", r"'backends.options.critc': unknown role; choices: actor, rollout"),
    ("ray.parallel.actor.dp=0", r"'ray.parallel.actor.dp' must be an integer >= 1"),
])
def test_every_rule_names_the_key_the_value_and_what_is_allowed(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_model_shape() -> None:
    # head_dim may differ from hidden_size / num_heads (as in Qwen3) except for qwen2, whose vLLM
    # model derives it; it must be even for the rotary embedding
    assert load_config(None, ["model.hidden_size=32"]).model.head_dim == 32
    with pytest.raises(ConfigError, match=r"'model.head_dim' = 32 must be .* = 16 with 'model.arch' = 'qwen2'"):
        load_config(None, ["model.hidden_size=32", "model.arch=qwen2"])
    with pytest.raises(ConfigError, match=r"'model.head_dim' = 7 must be even"):
        load_config(None, ["model.head_dim=7"])
    # a model folder brings its own shape: the tiny-model keys are not checked against each other
    assert load_config(None, ["model.path=/m", "model.num_heads=3"]).model.num_heads == 3


def test_cuda_needs_cuda_here_unless_ray_workers_place_the_engines() -> None:
    import torch

    cfg = load_config(None, ["model.device=cuda"])  # a config for a GPU machine loads anywhere
    if torch.cuda.is_available():
        check_device_here(cfg)
    else:
        with pytest.raises(ConfigError, match=r"'model.device' = 'cuda', but CUDA is not available here"):
            check_device_here(cfg)
    check_device_here(load_config(None, ["model.device=cuda:1", "executor=ray"]))


def test_unknown_keys_suggest_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.esp'.*; did you mean 'optim.eps'\?$"):
        load_config(None, ["optim.esp=1e-6"])
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'; valid keys: [^?]*$"):
        load_config(None, ["zzz=1"])


def test_file_text_errors_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_bytes(b"steps = 3\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text: byte 0xe9 at line 2; save it as UTF-8"):
        load_config(p)
    p.write_bytes(b"\xef\xbb\xbfsteps = 3\n")  # a byte-order mark is fine
    assert load_config(p).steps == 3
    with pytest.raises(ConfigError, match=r"Invalid value \(at line 2, column 8\)"):
        load_config(write(tmp_path, "b.toml", "steps = 3\nseed = = 1\n"))
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="a config must be a table"):
        config_from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"'algorithm.options': keys must be non-empty strings, got 1"):
        config_from_dict({"algorithm": {"options": {1: 2}}})  # YAML allows such keys


def test_yaml_errors_are_one_line_with_the_line(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    with pytest.raises(ConfigError, match=r"not valid YAML: line 2, column 8: mapping values are not allowed") as info:
        load_config(write(tmp_path, "run.yaml", "steps: 3\nseed: 1: 2\n"))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="must hold a table of keys at the top level, got list"):
        load_config(write(tmp_path, "list.yaml", "- 1\n"))
    # an anchor used many times is copied once per table, not once per use
    laughs = "a0: &a0 {x: 1}\n" + "".join(
        f"a{i}: &a{i} {{{', '.join(f'k{k}: *a{i - 1}' for k in range(9))}}}\n" for i in range(1, 9)
    )
    with pytest.raises(ConfigError, match="unknown config key 'a0'"):
        load_config(write(tmp_path, "laughs.yaml", laughs))
