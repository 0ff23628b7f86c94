"""User code and files that a run config names: ``"package.module:attr"``, ``"path/to/file.py:attr"``, paths.

Reward functions (``reward.functions``) and metric callbacks (``logging.sinks``) are named by an
import spec; :func:`import_object` resolves both the same way. A target ending in ``.py`` or
holding a path separator is a Python file, run once as a module (named after its resolved path,
so two files both called ``rewards.py`` do not collide) and reused by every spec naming it;
anything else is an importable module. ``attr`` may be dotted (``Class.method``).

A relative path (a file spec, a dataset) is looked up first in the folder of the config file
(``base_dir``), then in the working directory (:func:`resolve_path`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

from verl_core.kernel.errors import ConfigError

__all__ = ["import_object", "is_file_target", "resolve_path", "split_spec"]

_FORMS = "'package.module:attr' or 'path/to/file.py:attr'"


def split_spec(spec: object, what: str) -> tuple[str, str]:
    """``(target, attr)`` of an import spec, checked for shape only (nothing is imported).

    Args:
        spec: The spec as written in the config.
        what: What the spec names, for the message (e.g. ``"reward function"``).

    Raises:
        ConfigError: ``spec`` is not a string ``target:attr`` with a dotted identifier after the colon.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"a {what} is named by a string {_FORMS}, got {spec!r}")
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not all(part.isidentifier() for part in attr.split(".")):
        raise ConfigError(f"{what} {spec!r} is not {_FORMS} (e.g. 'verl_core.trainer.inputs.reward_functions:exact_match')")
    return target, attr


def is_file_target(target: str) -> bool:
    """Whether the part before the colon names a Python file rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target or os.sep in target


def resolve_path(path: str | os.PathLike[str], base_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a path named in a config is: absolute as is; relative, in ``base_dir`` if it exists there,
    else in the working directory (also when it exists in neither, so the caller reports that path)."""
    p = Path(path).expanduser()
    if p.is_absolute() or base_dir is None:
        return p
    candidate = Path(base_dir) / p
    return candidate if candidate.exists() or not p.exists() else p


def import_object(spec: str, *, what: str, base_dir: str | os.PathLike[str] | None = None) -> Any:
    """The object that ``"package.module:attr"`` or ``"path/to/file.py:attr"`` names.

    Args:
        spec: The import spec.
        what: What the spec names, the start of every message (e.g. ``"reward function"``).
        base_dir: The config file's folder, where relative file paths are looked up first.

    Raises:
        ConfigError: the spec is malformed; the module cannot be imported or the file does not
            exist; importing or running it raised (the error is named); it has no such attribute
            (its public names are listed).
    """
    target, attr = split_spec(spec, what)
    if is_file_target(target):
        module = _import_file(spec, resolve_path(target, base_dir), what, base_dir)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(
                f"{what} {spec!r}: cannot import module {target!r} ({type(e).__name__}: {e}); install it, add "
                f"its folder to PYTHONPATH, or name a file as 'path/to/file.py:{attr}'"
            ) from e
        except Exception as e:  # the module itself raised while importing
            raise ConfigError(f"{what} {spec!r}: importing {target!r} raised {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise ConfigError(
                f"{what} {spec!r}: {target!r} has no attribute {attr!r}; its public callables: "
                f"{', '.join(found) or '(none)'}"
            )
        obj = getattr(obj, part)
    return obj


def _import_file(spec: str, path: Path, what: str, base_dir: str | os.PathLike[str] | None) -> types.ModuleType:
    if not path.is_file():
        where = f" (relative paths are looked up in {str(base_dir)!r}, then in the working directory)" if base_dir else ""
        raise ConfigError(f"{what} {spec!r}: the file {str(path.resolve())!r} does not exist{where}")
    resolved = path.resolve()
    name = f"verl_user_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    mod_spec = importlib.util.spec_from_file_location(name, resolved)
    if mod_spec is None or mod_spec.loader is None:
        raise ConfigError(f"{what} {spec!r}: {str(resolved)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module  # before running it, as importlib does (dataclasses and pickling look it up)
    try:
        mod_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if not isinstance(e, Exception):
            raise
        raise ConfigError(f"{what} {spec!r}: running {str(resolved)!r} raised {type(e).__name__}: {e}") from e
    return module
