"""Multi-turn episodes: environments, tools, a code sandbox and the token-in, token-out episode loop.

Imports only the kernel and the engine kit; see docs/architecture.md. The kernel's environment
protocol (:mod:`verl_core.kernel.environment`) is re-exported here.
"""

from __future__ import annotations

from verl_core.agent.loop import (
    EPISODE_KEY,
    AgentLoop,
    EpisodeInfo,
    EpisodeLimits,
    Termination,
    TurnInfo,
    environment_seconds,
    episode_metrics,
)
from verl_core.agent.render import (
    DUMMY_PREFIX,
    ObservationRenderer,
    chat_tokenizer,
    prompts_from_ids,
    render_prompts,
)
from verl_core.agent.sandbox import SandboxLimits, SandboxResult, python_tool, run_python
from verl_core.agent.tools import (
    HermesToolParser,
    ParsedTurn,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolEnvironment,
    ToolError,
    ToolSchemaError,
    ToolTimeoutError,
    as_tools,
)
from verl_core.kernel.environment import (
    Environment,
    EnvironmentFactory,
    Observation,
    StepResult,
    StepResultError,
)

__all__ = [
    "DUMMY_PREFIX",
    "EPISODE_KEY",
    "AgentLoop",
    "Environment",
    "EnvironmentFactory",
    "EpisodeInfo",
    "EpisodeLimits",
    "HermesToolParser",
    "Observation",
    "ObservationRenderer",
    "ParsedTurn",
    "SandboxLimits",
    "SandboxResult",
    "StepResult",
    "StepResultError",
    "Termination",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolError",
    "ToolSchemaError",
    "ToolTimeoutError",
    "TurnInfo",
    "as_tools",
    "chat_tokenizer",
    "environment_seconds",
    "episode_metrics",
    "prompts_from_ids",
    "python_tool",
    "render_prompts",
    "run_python",
]
