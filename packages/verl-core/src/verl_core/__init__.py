"""verl-core: typed protocols, a validated tensor batch and shared RL algorithms for LLM post-training."""

from __future__ import annotations

from verl_core.algorithm import AlgorithmComponent, ComponentKind
from verl_core.batch import BatchMeta, MicroBatches, TensorBatch, partition_by_token_budget
from verl_core.buffer import ReplayBuffer
from verl_core.capabilities import (
    Capabilities,
    RewardCapabilities,
    RolloutCapabilities,
    SeedingMode,
    TrainingCapabilities,
)
from verl_core.engine import DType, EngineSpec, OptimConfig, ParallelSizes, Role
from verl_core.errors import (
    BatchValidationError,
    ConfigError,
    NonFiniteError,
    PluginError,
    StaleWeightsError,
    UnknownNameError,
    VerlError,
    WeightSyncError,
)
from verl_core.hookspecs import hookimpl
from verl_core.registry import (
    BackendSpec,
    InstalledBackend,
    available_backends,
    get_backend,
    get_registry,
    get_reward_engine,
    get_rollout_engine,
    get_training_engine,
    get_weight_sync,
    parse_options,
)
from verl_core.reward import FunctionReward, RewardEngine, ScoreFn
from verl_core.rollout import RolloutEngine, SamplingParams
from verl_core.schema import FIELDS, FieldSpec, register_field
from verl_core.tokenizer import Tokenizer
from verl_core.training import (
    GlobalBatchStats,
    LossFn,
    LossOutput,
    Metrics,
    ModelOutput,
    StepMetrics,
    TrainingEngine,
    dp_shard,
)
from verl_core.version import PROTOCOL_VERSION, __version__
from verl_core.weights import (
    StreamWeightSync,
    SyncReport,
    TensorInfo,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightSync,
    apply_weight_stream,
    stream_weights,
)

__all__ = [
    "FIELDS",
    "PROTOCOL_VERSION",
    "AlgorithmComponent",
    "BackendSpec",
    "BatchMeta",
    "BatchValidationError",
    "Capabilities",
    "ComponentKind",
    "ConfigError",
    "DType",
    "EngineSpec",
    "FieldSpec",
    "FunctionReward",
    "GlobalBatchStats",
    "InstalledBackend",
    "LossFn",
    "LossOutput",
    "Metrics",
    "MicroBatches",
    "ModelOutput",
    "NonFiniteError",
    "OptimConfig",
    "ParallelSizes",
    "PluginError",
    "ReplayBuffer",
    "RewardCapabilities",
    "RewardEngine",
    "Role",
    "RolloutCapabilities",
    "RolloutEngine",
    "SamplingParams",
    "ScoreFn",
    "SeedingMode",
    "StaleWeightsError",
    "StepMetrics",
    "StreamWeightSync",
    "SyncReport",
    "TensorBatch",
    "TensorInfo",
    "Tokenizer",
    "TrainingCapabilities",
    "TrainingEngine",
    "UnknownNameError",
    "VerlError",
    "WeightChunk",
    "WeightCommit",
    "WeightManifest",
    "WeightMessage",
    "WeightSync",
    "WeightSyncError",
    "__version__",
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
]
