"""Algorithm parts: the protocols of advantage estimators, policy losses, KL estimators and loss
aggregation, and the AlgorithmComponent record through which they are registered by name.

Every part is a pure function of TensorBatch fields and a typed config. Implementations of the
built-in parts live in :mod:`verl_core.algorithms`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["AlgorithmComponent", "ComponentKind"]

ComponentKind = Literal["advantage", "policy_loss", "kl", "aggregation", "value_loss"]
"""The kinds of algorithm components that are registered by name."""


@dataclass(frozen=True)
class AlgorithmComponent:
    """A named algorithm part, registered through the ``verl_algorithm_components`` hook.

    Attributes:
        kind: What the component is.
        name: The name users select it by (unique per kind).
        impl: The function (its signature is fixed per kind; see :mod:`verl_core.algorithms`).
        config_class: Dataclass of its options, or None.
        doc: One line describing it.
    """

    kind: ComponentKind
    name: str
    impl: Callable[..., Any]
    config_class: type | None = None
    doc: str = ""
