"""Deliberately broken backends: the example backend with one fault each (for the suite's meta-tests).

They are never installed, so ``verl backends`` lists only what a user installed: the meta-tests
put ``src/`` on the path and name the backends in ``VERL_PLUGINS`` (see :func:`verl_plugins`), which
the registry reads in the test process and in every process it starts (pytest runs, ``verl
conformance``, torchrun ranks).
"""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parent.parent
"""The folder to put on ``sys.path`` / ``PYTHONPATH`` for ``import verl_broken_backends``."""


def verl_plugins() -> str:
    """The ``VERL_PLUGINS`` value registering every broken backend: ``name=module:attr``, comma-separated."""
    from verl_broken_backends import multiturn, plugin, prefix_cache

    backends = (plugin.BrokenBackend, plugin.BrokenHFBackend, plugin.BrokenMegatronBackend,
                prefix_cache.PrefixCacheBackend)
    return ",".join(f"{obj.name}={module.__name__}:{attr}" for module in (plugin, multiturn, prefix_cache)
                    for attr, obj in vars(module).items() if isinstance(obj, backends))
