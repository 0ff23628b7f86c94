"""Hypothesis-generated configs, config files and overrides through ``config_from_dict`` and ``load_config``.

Configs of random keys (real ones, misspelt ones, junk), values of random types, random nesting;
TOML and YAML text (rendered from such configs, then cut and spliced), random text and random bytes
as config files; lists of ``key=value`` overrides. The only outcomes allowed: a valid config (which
satisfies every rule and round-trips), or a ConfigError whose message names the offending key
(quoted, as a full dotted path), override or file. Never a KeyError, TypeError, UnicodeDecodeError
or traceback. The ``verl`` command line is fuzzed in test_fuzz_cli.py.

Generated inputs (``max_examples``): 1000 nested configs + 400 one-key mutations + 400 TOML texts
+ 300 YAML texts + 150 random texts + 250 random byte files + 500 override lists = 3000
(test_fuzz_cli.py adds 1000: about 4000 in all).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from config_strategies import (
    DEFAULTS,
    LEAVES,
    SCALAR_KEYS,
    SECTIONS,
    configs,
    overrides,
    toml_literal,
    typed_values,
    values,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_core import ConfigError
from verl_core.kernel.convert import constraints, satisfies
from verl_core.kernel.rollout import SamplingParams
from verl_core.trainer.config import (
    RunConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_override,
)

TMP_FILES = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _paths(data: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key in ``data`` (as the config names them: ``str`` of each key)."""
    if isinstance(data, Mapping):
        for k, v in data.items():
            yield prefix + str(k)
            yield from _paths(v, f"{prefix}{k}.")


def _names_a_key(message: str, data: Any) -> bool:
    """Whether ``message`` quotes one of the dotted keys of ``data`` (``'a.b'``, or ``'a.b[0]'`` for an item)."""
    return any(repr(p) in message or repr(p)[:-1] + "[" in message for p in _paths(data))


def _error(fn: Any, *args: Any) -> ConfigError | None:
    """The ConfigError ``fn(*args)`` raised, or None when it succeeded (any other error fails the test)."""
    error: ConfigError | None = None
    try:
        fn(*args)
    except ConfigError as e:
        error = e
    assert error is None or (isinstance(error, ValueError) and str(error))
    return error


RULES = constraints(RunConfig)  # every bound, written once on its field


def _assert_valid(cfg: RunConfig) -> None:
    for key, rules in RULES.items():
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert all(satisfies(node, rule) for rule in rules), (key, node)
    assert config_from_dict(config_to_dict(cfg)) == cfg


def _check(data: Any, where: str = "") -> ConfigError | None:
    """config_from_dict(data): a valid config, or a ConfigError quoting a key of ``data`` (or ``where``)."""
    err = _error(config_from_dict, data)
    if err is None:
        _assert_valid(config_from_dict(data))
    else:
        msg = str(err)
        assert _names_a_key(msg, data) or (where and where in msg), (data, msg)
    return err


@given(data=configs())
@settings(max_examples=1000, deadline=None)
def test_nested_configs_of_random_keys_and_values(data: dict[str, Any], tally: Counter[str]) -> None:
    if _check(data) is not None:
        tally["fuzz/config (nested keys and values)"] += 1


@st.composite
def one_key_mutations(draw: st.DrawFn) -> dict[str, Any]:
    """The full default config with one value replaced, one unknown key added, or one section replaced."""
    data = json.loads(json.dumps(DEFAULTS))
    kind = draw(st.sampled_from(["value", "unknown_key", "section_type"]))
    section = draw(st.sampled_from([None, *SECTIONS]))
    node = data if section is None else data[section]
    if kind == "unknown_key":
        node[draw(st.text(min_size=1, max_size=10).filter(lambda s: s not in node))] = draw(values)
    elif kind == "section_type":
        data[draw(st.sampled_from(list(SECTIONS)))] = draw(values.filter(lambda v: not isinstance(v, dict)))
    else:
        key = draw(st.sampled_from([k for k in node if k != "options" and not isinstance(node[k], dict)]))
        node[key] = draw(typed_values(LEAVES[f"{section}.{key}" if section else key]) | values)
    return data


@given(data=one_key_mutations())
@settings(max_examples=400, deadline=None)
def test_the_defaults_with_one_key_changed(data: dict[str, Any], tally: Counter[str]) -> None:
    if _check(data) is not None:
        tally["fuzz/config (one key changed)"] += 1


# ---------------------------------------------------------------------------- files
def _spliced(text: str, draw: st.DrawFn) -> str:
    """``text``, or it with a random slice replaced by random text (half of the time)."""
    if not text or draw(st.booleans()):
        return text
    i = draw(st.integers(0, len(text)))
    j = draw(st.integers(i, min(len(text), i + 8)))
    return text[:i] + draw(st.text(max_size=6)) + text[j:]


@st.composite
def toml_texts(draw: st.DrawFn) -> str:
    data = draw(configs())
    return _spliced("\n".join(f"{json.dumps(k)} = {toml_literal(v)}" for k, v in data.items() if v is not None), draw)


@st.composite
def yaml_texts(draw: st.DrawFn) -> str:
    data = draw(configs())
    return _spliced(yaml.safe_dump(json.loads(json.dumps(data, default=str))), draw)


def _check_file(path: Path, parsed: Any) -> ConfigError | None:
    """load_config(path): a valid config, or a ConfigError naming the file (bad text) or a key."""
    err = _error(load_config, path)
    if err is not None:
        msg = str(err)
        assert repr(str(path)) in msg or _names_a_key(msg, parsed), msg
        assert "\n" not in msg, "a file's error is one line"
    return err


def _parsed(text: str, suffix: str) -> Any:
    try:
        return yaml.safe_load(text) if suffix == ".yaml" else tomllib.loads(text)
    except Exception:  # a syntax error: then the message must name the file
        return None


@given(text=toml_texts())
@settings(TMP_FILES, max_examples=400)
def test_toml_files_rendered_from_random_configs(text: str, tmp_path: Path, tally: Counter[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    if _check_file(path, _parsed(text, ".toml")) is not None:
        tally["fuzz/config files (TOML)"] += 1


@given(text=yaml_texts())
@settings(TMP_FILES, max_examples=300)
def test_yaml_files_rendered_from_random_configs(text: str, tmp_path: Path, tally: Counter[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    if _check_file(path, _parsed(text, ".yaml")) is not None:
        tally["fuzz/config files (YAML)"] += 1


@given(text=st.text(max_size=200), suffix=st.sampled_from([".toml", ".yaml"]))
@settings(TMP_FILES, max_examples=150)
def test_any_text_as_a_config_file(text: str, suffix: str, tmp_path: Path, tally: Counter[str]) -> None:
    path = tmp_path / f"run{suffix}"
    path.write_text(text, encoding="utf-8")
    if _check_file(path, _parsed(text, suffix)) is not None:
        tally["fuzz/config files (any text)"] += 1


@given(raw=st.binary(max_size=120) | st.binary(max_size=40).map(lambda b: b"steps = 3\n" + b),
       suffix=st.sampled_from([".toml", ".yaml", ".yml"]))
@settings(TMP_FILES, max_examples=250)
def test_any_bytes_as_a_config_file(raw: bytes, suffix: str, tmp_path: Path, tally: Counter[str]) -> None:
    path = tmp_path / f"run{suffix}"
    path.write_bytes(raw)
    try:
        parsed = _parsed(raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8"), suffix.replace(".yml", ".yaml"))
    except UnicodeDecodeError:
        parsed = None
    err = _check_file(path, parsed)
    if err is not None:
        tally["fuzz/config files (any bytes)"] += 1
        if parsed is None:
            assert repr(str(path)) in str(err)


# ---------------------------------------------------------------------------- overrides
def _override_names(texts: list[str]) -> list[Any]:
    """The key paths of the overrides that parse (as nested tables, for _names_a_key)."""
    out: list[Any] = []
    for text in texts:
        try:
            path, _ = parse_override(text)
        except ConfigError:
            continue
        node: Any = None
        for part in reversed(path):
            node = {part: node}
        out.append(node)
    return out


@given(texts=st.lists(overrides(), min_size=1, max_size=4))
@settings(max_examples=500, deadline=None)
def test_any_overrides_give_a_config_or_a_config_error(texts: list[str], tally: Counter[str]) -> None:
    err = _error(load_config, None, texts)
    if err is None:
        _assert_valid(load_config(None, texts))
        return
    tally["fuzz/config overrides"] += 1
    msg = str(err)
    assert any(repr(t) in msg for t in texts) or any(_names_a_key(msg, n) for n in _override_names(texts)), (texts, msg)


def test_every_field_is_fuzzed_and_every_rule_names_a_field() -> None:
    assert set(SECTIONS) == {f.name for f in dataclasses.fields(RunConfig)} - set(SCALAR_KEYS)
    assert set(RULES) <= set(LEAVES), set(RULES) - set(LEAVES)
    numeric = {k for k, tp in LEAVES.items() if tp in (int, float) and not k.startswith("ray.")}
    # the rollout section is bounded by SamplingParams itself (one rule for sampling parameters)
    sampling = {k for k in numeric if k.startswith("rollout.")}
    assert {k.removeprefix("rollout.") for k in sampling} <= {f.name for f in dataclasses.fields(SamplingParams)}
    assert not sampling & set(RULES), "a rollout value with a second rule besides SamplingParams'"
    assert numeric - sampling - set(RULES) == set(), "a number without a bound (annotate its field with a bound)"


@pytest.mark.parametrize(("text", "match"), [
    (b"steps = 3\n\xff\xfe = 1\n", r"is not UTF-8 text: byte 0xff at line 2"),
    (b"steps = 3\n[optim\n", r"is not valid TOML: .*line 2"),
])
def test_file_errors_name_the_line(tmp_path: Path, text: bytes, match: str) -> None:
    path = tmp_path / "run.toml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)
