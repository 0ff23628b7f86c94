"""Backend options of verl-megatron, validated from ``EngineSpec.options`` (imports no engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from verl_core import ConfigError

__all__ = ["MegatronOptions"]


@dataclass(frozen=True)
class MegatronOptions:
    """Options of the ``megatron`` backend (``EngineSpec.options``).

    Attributes:
        attention: Core attention of the layer spec: ``sdpa`` (torch's scaled_dot_product_attention,
            causal; flash attention on GPUs without TransformerEngine) or ``local`` (megatron-core's
            own DotProductAttention, the reference implementation).
        export_ranks: Which ranks receive the gathered weights of ``export_weights``: ``all``
            (every rank yields the full stream; each must consume it) or ``first`` (global rank 0
            yields the stream, the others only take part in the gathers and yield nothing but the
            manifest and the commit).
    """

    attention: Literal["sdpa", "local"] = "sdpa"
    export_ranks: Literal["all", "first"] = "all"

    def __post_init__(self) -> None:
        if self.attention not in ("sdpa", "local"):
            raise ConfigError(f"megatron option attention must be 'sdpa' or 'local', got {self.attention!r}")
        if self.export_ranks not in ("all", "first"):
            raise ConfigError(f"megatron option export_ranks must be 'all' or 'first', got {self.export_ranks!r}")
