"""Entry point of the ``megatron`` backend (import-light: no engine library is imported here)."""

from __future__ import annotations

from verl_core import PROTOCOL_VERSION, BackendSpec, hookimpl
from verl_core.kernel.capabilities import Capabilities
from verl_core.kernel.engine import Role
from verl_core.kernel.weights import WeightSync
from verl_megatron.capabilities import rollout_capabilities, training_capabilities

_TRAINING = "verl_megatron.training:build_training_engine"
_ROLLOUT = "verl_megatron.rollout:build_rollout_engine"


@hookimpl
def verl_backend() -> BackendSpec:
    """The ``megatron`` backend: megatron-core GPTModel training engines under TP/PP/DP, TP rollout."""
    roles: tuple[Role, ...] = ("actor", "reference", "critic")
    caps: dict[Role, Capabilities] = {r: training_capabilities(r) for r in roles}
    caps["rollout"] = rollout_capabilities()
    return BackendSpec(
        name="megatron",
        roles={"actor": _TRAINING, "reference": _TRAINING, "critic": _TRAINING, "rollout": _ROLLOUT},
        capabilities=caps,
        protocol_version=PROTOCOL_VERSION,
        config_class="verl_megatron.options:MegatronOptions",
        description="megatron-core GPTModel (local layer spec): TP/PP/DP training, TP rollout",
    )


@hookimpl
def verl_weight_sync(source: str, target: str) -> WeightSync | None:
    """The direct megatron -> megatron path (colocated resharding); None for every other pair."""
    if source == "megatron" and target == "megatron":
        from verl_megatron.reshard import MegatronDirectSync

        return MegatronDirectSync()
    return None
