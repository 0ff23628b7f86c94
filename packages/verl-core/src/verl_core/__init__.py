"""verl-core: typed protocols, a validated tensor batch and shared RL algorithms for LLM post-training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.enginekit.rollout_base import EngineAsleepError
from verl_core.enginekit.weight_stream import apply_weight_stream, stream_weights
from verl_core.kernel.algorithm import (
    AdvantageEstimator,
    Aggregation,
    AlgorithmComponent,
    ComponentKind,
    KLEstimator,
    PolicyLoss,
    PolicyLossTerms,
    Preset,
    ValueLoss,
    ValueLossTerms,
)
from verl_core.kernel.batch import BatchMeta, MicroBatches, TensorBatch, partition_by_token_budget
from verl_core.kernel.buffer import ReplayBuffer
from verl_core.kernel.capabilities import (
    Capabilities,
    RewardCapabilities,
    RolloutCapabilities,
    SeedingMode,
    TrainingCapabilities,
)
from verl_core.kernel.engine import DType, EngineSpec, LoraSpec, OptimConfig, ParallelSizes, Role
from verl_core.kernel.errors import (
    BatchValidationError,
    CheckpointError,
    ConfigError,
    MissingFieldError,
    NonFiniteError,
    PluginError,
    RequestTooLargeError,
    RewardError,
    StaleWeightsError,
    StorageError,
    UnknownNameError,
    VerlError,
    WeightSyncError,
)
from verl_core.kernel.hookspecs import hookimpl
from verl_core.kernel.registry import (
    BackendSpec,
    InstalledBackend,
    add_builtin_plugin,
    available_backends,
    get_backend,
    get_registry,
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
    parse_options,
)
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.schema import FIELDS, MIN_TEMPERATURE, FieldSpec, register_field
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.kernel.training import (
    GlobalBatchStats,
    LossFn,
    LossOutput,
    Metrics,
    ModelOutput,
    StepMetrics,
    TrainingEngine,
    dp_shard,
)
from verl_core.kernel.version import PROTOCOL_VERSION, __version__
from verl_core.kernel.weights import (
    StreamWeightSync,
    SyncReport,
    TensorInfo,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightSync,
)

__all__ = [
    "FIELDS",
    "MIN_TEMPERATURE",
    "PROTOCOL_VERSION",
    "ActorLoss",
    "ActorLossConfig",
    "AdvantageEstimator",
    "AggMode",
    "Aggregation",
    "Algorithm",
    "AlgorithmComponent",
    "BackendSpec",
    "BatchMeta",
    "BatchValidationError",
    "CheckpointError",
    "Capabilities",
    "ComponentKind",
    "ConfigError",
    "CriticLoss",
    "CriticLossConfig",
    "DType",
    "EngineAsleepError",
    "EngineSpec",
    "FieldSpec",
    "FunctionReward",
    "GAEConfig",
    "GRPOConfig",
    "GlobalBatchStats",
    "HFTokenizer",
    "InstalledBackend",
    "KLEstimator",
    "KLName",
    "LoraSpec",
    "LossFn",
    "LossOutput",
    "Metrics",
    "MicroBatches",
    "MissingFieldError",
    "ModelOutput",
    "NonFiniteError",
    "OffPolicyConfig",
    "OptimConfig",
    "ParallelSizes",
    "PluginError",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossTerms",
    "Preset",
    "ReplayBuffer",
    "RequestTooLargeError",
    "RewardCapabilities",
    "RewardConfig",
    "RewardEngine",
    "RewardError",
    "Role",
    "RolloutCapabilities",
    "RolloutEngine",
    "SamplingParams",
    "ScoreFn",
    "SeedingMode",
    "StaleWeightsError",
    "StorageError",
    "StepMetrics",
    "StreamWeightSync",
    "SyncReport",
    "TensorBatch",
    "TensorInfo",
    "Tokenizer",
    "TrainingCapabilities",
    "TrainingEngine",
    "UnknownNameError",
    "ValueLoss",
    "ValueLossTerms",
    "VerlError",
    "WeightChunk",
    "WeightCommit",
    "WeightManifest",
    "WeightMessage",
    "WeightSync",
    "WeightSyncError",
    "apply_weight_stream",
    "available_backends",
    "dp_shard",
    "get_backend",
    "get_registry",
    "get_reward_engine",
    "get_rollout_engine",
    "get_training_engine",
    "get_weight_sync",
    "hookimpl",
    "parse_options",
    "partition_by_token_budget",
    "register_field",
    "stream_weights",
    "__version__",
]

if TYPE_CHECKING:
    from verl_core.algorithms import (
        ActorLoss,
        ActorLossConfig,
        AggMode,
        Algorithm,
        CriticLoss,
        CriticLossConfig,
        GAEConfig,
        GRPOConfig,
        KLName,
        OffPolicyConfig,
        PolicyLossConfig,
        RewardConfig,
    )
    from verl_core.trainer.inputs.rewards import FunctionReward, ScoreFn

_ALGORITHM_NAMES: Final = frozenset({
    "ActorLoss", "ActorLossConfig", "AggMode", "Algorithm", "CriticLoss", "CriticLossConfig",
    "GAEConfig", "GRPOConfig", "KLName", "OffPolicyConfig", "PolicyLossConfig", "RewardConfig",
})


def _builtin_algorithms() -> object:
    from verl_core.algorithms import builtin

    return builtin


# verl-core's own algorithms register through the plugin hook like a third party's, imported when
# algorithm components are first looked up (a backend process that only builds engines never loads them)
add_builtin_plugin("verl-core.algorithms", _builtin_algorithms)


def __getattr__(name: str) -> Any:
    # The algorithms and the reward functions (trainer layer) are imported on first use: importing
    # them here would load them into every backend process that imports this package.
    if name in _ALGORITHM_NAMES:
        import verl_core.algorithms as algorithms

        return getattr(algorithms, name)
    if name in ("FunctionReward", "ScoreFn"):
        from verl_core.trainer.inputs import rewards

        return getattr(rewards, name)
    raise AttributeError(f"module 'verl_core' has no attribute {name!r}")
