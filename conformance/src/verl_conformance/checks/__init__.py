"""The conformance checks, registered by area: each is a function of a Harness.

Importing this package imports every area module, which registers its checks in :data:`CHECKS`
(in import order, then definition order).
"""

from __future__ import annotations

from verl_conformance.checks import (  # noqa: F401  (registration by import)
    differential,
    eos,
    invariance,
    numerics,
    positions,
    reward,
    robustness,
    rope,
    sampling,
    schema,
    sync_coverage,
    weight_sync,
)

# isort: split
# checks of declared capabilities, state and runs: listed after the checks above of the same area
from verl_conformance.checks import (  # noqa: F401  (registration by import)
    buffer,
    concurrent_sync,
    declared,
    lora,
    optimizer,
    stateful,
    trajectory,
)

# isort: split
# multi-turn episodes, in the areas above: listed last in each
from verl_conformance.checks import multiturn  # noqa: F401  (registration by import)
from verl_conformance.checks._registry import AREAS, CHECKS, Area, Check, check

__all__ = ["AREAS", "CHECKS", "Area", "Check", "check"]
