"""Hypothesis strategies of configs and overrides: real, misspelt and junk keys, values of random types."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, Literal, get_args, get_origin

from hypothesis import strategies as st

from verl_core.trainer.config import RunConfig, config_to_dict

__all__ = ["DEFAULTS", "LEAVES", "SCALAR_KEYS", "SECTIONS", "configs", "key_paths", "overrides", "toml_literal",
           "typed_values", "values"]

DEFAULTS = config_to_dict(RunConfig())
SECTIONS = {k: v for k, v in DEFAULTS.items() if isinstance(v, dict) and k != "options"}
SCALAR_KEYS = [k for k, v in DEFAULTS.items() if not isinstance(v, dict)]


def _leaf_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> annotation of every field that is not a section (options tables are leaves)."""
    out: dict[str, Any] = {}
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out.update(_leaf_types(typing.cast(type, tp), f"{prefix}{name}."))
        else:
            out[prefix + name] = tp
    return out


LEAVES = _leaf_types(RunConfig)
KEY_PATHS = sorted(LEAVES) + sorted(SECTIONS)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 130),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 1e308, 0.5, 1.0, -1.0]),
    st.text(max_size=8), st.sampled_from(["cpu", "cuda", "cuda:3", "grpo", "ppo", "qwen2", "token", "a\0b", ""]),
    st.binary(max_size=4), st.dates(),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4) | st.integers(0, 3), inner, max_size=3),
    max_leaves=6,
)


def typed_values(tp: Any) -> st.SearchStrategy[Any]:
    """Values of (about) the declared type, near its bounds: most pass the type check, many a rule."""
    origin = get_origin(tp)
    if origin is Literal:
        return st.sampled_from(get_args(tp)) | st.text(max_size=6)
    if origin is tuple:
        return st.lists(st.floats(-0.5, 1.5) | st.sampled_from([0.0, 0.9, 0.999, 1.0]), min_size=1, max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), values, max_size=3)
    if tp is bool or tp == (bool | None):
        return st.booleans()
    if tp is int:
        return st.integers(-2, 140) | st.sampled_from([2**24, 2**63 - 1, 2**63, -(2**63) - 1])
    if tp is float or tp == (float | None):
        return st.floats(-1.0, 2.0) | st.sampled_from([0.0, 1e-8, 1.0, math.inf, math.nan])
    return st.text(max_size=8)


def _misspell(word: str) -> st.SearchStrategy[str]:
    """``word`` with one character dropped, doubled, swapped with the next, replaced, or upper-cased."""
    return st.tuples(st.integers(0, max(len(word) - 1, 0)), st.sampled_from("drsuc"), st.characters()).map(
        lambda t: {
            "d": word[: t[0]] + word[t[0] + 1 :],
            "r": word[: t[0]] + word[t[0]] * 2 + word[t[0] + 1 :] if word else t[2],
            "s": word[: t[0]] + word[t[0] + 1 : t[0] + 2] + word[t[0] : t[0] + 1] + word[t[0] + 2 :],
            "u": word.upper(),
            "c": word[: t[0]] + t[2] + word[t[0] + 1 :],
        }[t[1]]
    )


@st.composite
def key_paths(draw: st.DrawFn) -> tuple[list[str], Any]:
    """A key path (a real one, misspelt at one part, cut short, made deeper, or junk) and its value."""
    kind = draw(st.sampled_from(["real", "real", "real", "misspelt", "deeper", "junk"]))
    if kind == "junk":
        return draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3)), draw(values)
    path = draw(st.sampled_from(KEY_PATHS))
    parts = path.split(".")
    if kind == "misspelt":
        i = draw(st.integers(0, len(parts) - 1))
        parts[i] = draw(_misspell(parts[i]))
        return parts, draw(values)
    if kind == "deeper":
        return [*parts, draw(st.text(min_size=1, max_size=5))], draw(values)
    tp = LEAVES.get(path)
    return parts, draw(typed_values(tp) | values if tp is not None else values)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """Nested tables built from up to 6 generated key paths (a path through a value is skipped)."""
    data: dict[str, Any] = {}
    for parts, value in draw(st.lists(key_paths(), max_size=6)):
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[parts[-1]] = value
    return data


def toml_literal(value: Any) -> str:
    """``value`` as a TOML literal (inline tables for tables); None has no TOML form and is dropped."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_literal(v)}" for k, v in value.items() if v is not None) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value if v is not None) + "]"
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")



@st.composite
def overrides(draw: st.DrawFn) -> str:
    """``key=value`` with a generated key path and a value as a TOML literal, a bare word or junk; or junk."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.text(max_size=20))
    parts, value = draw(key_paths())
    text = draw(st.sampled_from([toml_literal(value), str(value), toml_literal(value)[:3]])) if value is not None else "null"
    return ".".join(parts) + "=" + text
