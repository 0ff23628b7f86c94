"""The built-in RL algorithms: advantage estimators, policy and value losses, KL, aggregation."""

from __future__ import annotations

__all__: list[str] = []
