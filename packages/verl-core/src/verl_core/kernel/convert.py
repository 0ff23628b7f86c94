"""The one typed converter: config objects built from plain mappings (TOML, YAML, JSON, dicts).

Every config object of the SDK is a dataclass whose field annotations say what each value may be:
its type (``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, unions, ``list``/``tuple``/``dict``
of those, nested dataclasses) and its bounds, written once on the field with ``typing.Annotated``
and the constraint vocabulary of the `annotated-types` library::

    from typing import Annotated
    from annotated_types import Ge, Interval

    @dataclass(frozen=True)
    class BatchConfig:
        epochs: Annotated[int, Ge(1)] = 1
        top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0

:func:`build` turns a mapping into such a dataclass: an unknown key (with the closest valid one), a
value of the wrong type or out of bounds each raise one :class:`~verl_core.kernel.errors.ConfigError`
naming the dotted key, the value and what is allowed. The run config (``RunConfig`` and its
sections), backend options (through :func:`~verl_core.kernel.registry.parse_options`) and algorithm
options all go through it. Rules that involve several fields stay short methods beside their
section.

Supported constraints: ``Gt``, ``Ge``, ``Lt``, ``Le``, ``Interval``, ``MinLen``, ``MaxLen`` (re-exported
here, so a backend needs no import of its own), and :class:`Check` (a predicate with the text
saying what is allowed).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import annotated_types as at
from annotated_types import Ge, Gt, Interval, Le, Lt, MaxLen, MinLen

from verl_core.kernel.errors import ConfigError

__all__ = [
    "Check", "Ge", "Gt", "Interval", "Le", "Lt", "MaxLen", "MinLen",
    "allowed_text", "build", "check_fields", "constraints", "convert", "field_types", "satisfies",
]

_D = TypeVar("_D")
_INT64 = 2**63


@dataclass(frozen=True)
class Check:
    """A constraint ``ok(value)`` that bounds cannot say, with the text saying what is allowed.

    Example: ``Annotated[str, Check(lambda v: v in ("cpu", "cuda"), "cpu or cuda")]``.
    """

    ok: Callable[[Any], bool]
    allowed: str


def allowed_text(constraint: object) -> str | None:
    """What a constraint allows, as the error messages say it (None for metadata that is no constraint)."""
    if isinstance(constraint, Check):
        return constraint.allowed
    if isinstance(constraint, at.Interval):
        return " and ".join(filter(None, (allowed_text(c) for c in constraint)))
    bounds = ((at.Gt, "> {}", "gt"), (at.Ge, ">= {}", "ge"), (at.Lt, "< {}", "lt"), (at.Le, "<= {}", "le"))
    for kind, text, attr in bounds:
        if isinstance(constraint, kind):
            return text.format(getattr(constraint, attr))
    if isinstance(constraint, at.MinLen):
        return f"at least {constraint.min_length} item(s)" if constraint.min_length > 1 else "not empty"
    if isinstance(constraint, at.MaxLen):
        return f"at most {constraint.max_length} item(s)"
    return None


def satisfies(value: Any, constraint: object) -> bool:
    """True when ``value`` meets ``constraint`` (metadata that is no constraint is always met)."""
    if isinstance(constraint, Check):
        return bool(constraint.ok(value))
    if isinstance(constraint, at.Interval):
        return all(satisfies(value, c) for c in constraint)
    tests: tuple[tuple[type, Callable[[Any, Any], bool], str], ...] = (
        (at.Gt, lambda v, b: v > b, "gt"), (at.Ge, lambda v, b: v >= b, "ge"),
        (at.Lt, lambda v, b: v < b, "lt"), (at.Le, lambda v, b: v <= b, "le"),
        (at.MinLen, lambda v, b: len(v) >= b, "min_length"), (at.MaxLen, lambda v, b: len(v) <= b, "max_length"),
    )
    for kind, test, attr in tests:
        if isinstance(constraint, kind):
            return test(value, getattr(constraint, attr))
    return True


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        return _type_name(get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        return "a list of " + ", ".join(_type_name(a) for a in get_args(tp))
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a table"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def convert(value: Any, tp: Any, key: str, *, label: str = "config key") -> Any:
    """``value`` checked and converted to the annotation ``tp`` (``key`` names it in errors).

    Integers are accepted where a float is expected (and become floats); nothing else is coerced:
    ``"3"`` is not an integer and ``1`` is not ``true``.

    Raises:
        ConfigError: ``{label} {key!r}: ...`` naming the value and what is allowed.
    """
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *constraints = get_args(tp)
        out = convert(value, inner, key, label=label)
        for c in constraints:
            if out is not None and not satisfies(out, c):
                problem = "is not valid" if isinstance(out, str) else "is out of range"
                shown = list(out) if isinstance(out, tuple) else out  # as the file writes it
                raise ConfigError(f"{label} {key!r} = {shown!r} {problem}; allowed: {allowed_text(c)}")
        return out
    if origin is Literal:
        choices = get_args(tp)
        if not any(type(value) is type(c) and value == c for c in choices):
            raise ConfigError(
                f"{label} {key!r}: {value!r} is not valid; choices: {', '.join(repr(c) for c in choices)}"
            )
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors: list[tuple[Any, ConfigError]] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, key, label=label)
            except ConfigError as e:
                errors.append((arg, e))
        # the alternative of the value's own shape (a list for ``str | list[str]``, the only one
        # for ``X | None``) says more than "expected one of ..."
        same_shape = [e for arg, e in errors if len(errors) == 1 or _same_shape(value, arg)]
        if len(same_shape) == 1:
            raise same_shape[0]
        raise ConfigError(f"{label} {key!r}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            names = sorted(f.name for f in dataclasses.fields(tp))
            raise ConfigError(f"{label} {key!r}: expected a table of {names}, got {value!r}")
        return build(typing.cast(type, tp), value, prefix=key + ".", label=label)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{label} {key!r}: expected a table, got {value!r}")
        value_type = get_args(tp)[1]
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise ConfigError(f"{label} {key!r}: keys must be non-empty strings, got {k!r}")
            out[k] = convert(v, value_type, f"{key}.{k}", label=label)
        return out
    if origin is list or (origin is tuple and len(get_args(tp)) == 2 and get_args(tp)[1] is Ellipsis):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{label} {key!r}: expected a list, got {value!r}")
        items = [convert(v, get_args(tp)[0], f"{key}[{i}]", label=label) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{label} {key!r}: expected {_type_name(tp)}, got {value!r}")
        return tuple(convert(v, a, f"{key}[{i}]", label=label) for i, (v, a) in enumerate(zip(value, args)))
    return _scalar(value, tp, key, label)


_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations with their ``Annotated`` bounds, evaluated once per class."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return hints


def _same_shape(value: Any, tp: Any) -> bool:
    """``value`` is a container of the kind ``tp`` describes (a list for a list, a table for a table)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _same_shape(value, get_args(tp)[0])
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping)
    return False


def _scalar(value: Any, tp: Any, key: str, label: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{label} {key!r}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label} {key!r}: expected an integer, got {value!r}")
        if not -_INT64 <= value < _INT64:
            raise ConfigError(f"{label} {key!r} = {value!r} is out of range; allowed: a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(_as_float(value)):
            raise ConfigError(f"{label} {key!r}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(f"{label} {key!r}: expected a string (without NUL characters), got {value!r}")
        return value
    if tp is Any or tp is object:
        return value
    raise ConfigError(f"{label} {key!r}: unsupported type {tp!r}")  # pragma: no cover


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        return math.inf


def build(cls: type[_D], data: Mapping[str, Any], *, prefix: str = "", label: str = "config key") -> _D:
    """The dataclass ``cls`` built from ``data``, every value checked against its field's annotation.

    Args:
        cls: A dataclass (its annotations are the schema).
        data: Keys and values as read from a file or given in code.
        prefix: Dotted prefix of the keys in messages (``"batch."``).
        label: What a key is called in messages (``config key``, ``backend 'hf' option``).

    Raises:
        ConfigError: an unknown key (listing the valid keys and the closest one), a value of the
            wrong type or out of bounds (naming the dotted key, the value and what is allowed), or
            what the class's own cross-field checks refuse (prefixed with the section).
    """
    hints = field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = prefix + str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            where = f" in {prefix[:-1]!r}" if prefix else ""
            raise ConfigError(
                f"unknown {label} {full!r}; valid keys{where}: {', '.join(names)}"
                + (f"; did you mean {prefix + close[0]!r}?" if close else "")
            )
        kwargs[key] = convert(value, hints[key], full, label=label)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{label.rsplit(' ', 1)[0]} section {prefix[:-1] or 'top level'!r}: {e}") from e


def check_fields(obj: object, *, prefix: str = "", label: str = "config key") -> None:
    """Check a dataclass instance built in code against its annotations, as :func:`build` would.

    For a section's ``__post_init__``, so an object built directly (``DataConfig(eval_n=0)``) is
    refused with the same message as the same value in a config file. Values the converter
    normalises (an integer for a float field, a list for a tuple field) are stored normalised.

    Raises:
        ConfigError: naming the dotted key, the value and what is allowed.
    """
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            continue  # a nested section checked itself when it was built
        out = convert(value, tp, prefix + f.name, label=label)
        if out is not value:  # normalised (an int for a float field, a list for a tuple field)
            object.__setattr__(obj, f.name, out)


def constraints(cls: type, prefix: str = "") -> dict[str, tuple[object, ...]]:
    """The constraints of every bounded field of a dataclass, nested sections by dotted key.

    A report of the schema (for docs and tests): ``{"batch.epochs": (Ge(ge=1),), ...}``.
    """
    out: dict[str, tuple[object, ...]] = {}
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            out.update(constraints(typing.cast(type, tp), f"{prefix}{name}."))
        elif get_origin(tp) is Annotated:
            out[prefix + name] = tuple(c for c in get_args(tp)[1:] if allowed_text(c) is not None)
    return out
