"""HFRewardEngine: a transformers sequence-classification reward model scoring prompt + response."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from verl_core.enginekit.gates import check_model_inputs
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError, RewardError, VerlError
from verl_core.kernel.registry import parse_options
from verl_core.kernel.reward import RewardEngine
from verl_hf.capabilities import REWARD_CAPABILITIES
from verl_hf.config import HFOptions
from verl_hf.modeling import load_model, sequence_inputs
from verl_hf.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFRewardEngine", "build_reward_engine"]


class HFRewardEngine(RewardEngine):
    """Scores each sample with ``AutoModelForSequenceClassification`` (one label).

    The score is the head's output at the last real token of prompt + response (found from the
    masks, never from the pad id, which may equal EOS). Samples are scored in micro-batches of
    ``HFOptions.rollout_batch_size``, else ``EngineSpec.micro_batch_size`` (all at once by
    default). A non-finite score raises :class:`~verl_core.RewardError` naming the samples.

    The folder must hold a trained reward model: one that names a causal-LM architecture, or has
    no weights for the ``score`` head (which transformers would initialise at random), is refused
    with a :class:`~verl_core.ConfigError` naming it (with ``verl train``, the config key
    ``reward_model`` names the folder; empty, it is the policy's). Its :attr:`tokenizer` lets the
    trainer score a policy of another vocabulary through text
    (:class:`~verl_core.enginekit.retokenize.CrossTokenizerReward`).

    Args:
        spec: The engine spec (role reward; ``parallel`` must be all 1).
        options: Backend options (default: parsed from ``spec.options``).

    Raises:
        ConfigError: the role is not ``reward``, parallel sizes other than 1, or the folder is not a
            trained reward model.
    """

    def __init__(self, spec: EngineSpec, options: HFOptions | None = None) -> None:
        if spec.role != "reward":
            raise ConfigError(f"HFRewardEngine needs role 'reward', got {spec.role!r}")
        if spec.parallel.world_size != 1:
            raise ConfigError(
                f"the hf reward engine runs on one device, got parallel={spec.parallel}; build one engine per "
                "process with tp, pp and dp all 1"
            )
        self._spec = spec
        self._options = options if options is not None else parse_options(
            HFOptions, spec.options, where="hf backend options"
        )
        self._device = torch.device(spec.device)
        self._model: Any = load_model(
            spec.model_path, "reward", dtype=spec.torch_dtype, device=self._device,
            attn_implementation=self._options.attn_implementation, seed=spec.seed,
            sequence_len=spec.max_prompt_len + spec.max_response_len,
        )
        self._model.requires_grad_(False)
        head = getattr(self._model, "score", None)
        if not isinstance(head, nn.Module):
            raise ConfigError(
                f"reward model {type(self._model).__name__} has no `score` head; expected a "
                "transformers *ForSequenceClassification decoder model"
            )
        self._head: nn.Module = head
        self._vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self._tokenizer: HFTokenizer | None = None

    @property
    def capabilities(self) -> RewardCapabilities:
        """Sequence-level scores from token ids."""
        return REWARD_CAPABILITIES

    @property
    def tokenizer(self) -> HFTokenizer:
        """Tokenizer of the reward model."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._spec.model_path, self._vocab_size)
        return self._tokenizer

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Return ``batch`` with ``scores`` [batch] (float32).

        Raises:
            RewardError: the model gave a NaN or inf score (naming the samples).
            VerlError: the engine is closed.
        """
        where = "HFRewardEngine.score"
        if self._model is None:
            raise VerlError(f"{where}: the engine is closed; build a new one")
        check_model_inputs(batch, self._spec, where=where, vocab_size=self._vocab_size)
        step = self._options.rollout_batch_size or self._spec.micro_batch_size or max(batch.batch_size, 1)
        parts: list[Tensor] = []
        work = batch.to(self._device)
        with torch.no_grad():
            for start in range(0, batch.batch_size, step):
                parts.append(self._score(work.index(slice(start, start + step)).trim()))
        scores = torch.cat(parts) if parts else torch.zeros(0)
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(
                f"{where}: the reward model gave non-finite scores (NaN or inf) to samples {bad[:8]}"
                f"{'...' if len(bad) > 8 else ''} of {batch.batch_size}; check the model's weights and dtype"
            )
        return batch.update(scores=scores.float().to(batch.device))

    def _score(self, chunk: TensorBatch) -> Tensor:
        ids, mask, pos = sequence_inputs(chunk)
        out = self._model.base_model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False)
        hidden = out.last_hidden_state
        last = (mask.long() * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        scores: Tensor = self._head(picked)[:, 0].float()
        return scores

    def close(self) -> None:
        """Drop the model."""
        self._model = None


def build_reward_engine(spec: EngineSpec) -> HFRewardEngine:
    """Factory of the ``hf`` backend's reward-model engine."""
    return HFRewardEngine(spec)
