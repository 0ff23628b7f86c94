"""A RolloutEngine around a transformers model the user built (no model folder needed).

The model needs only its forward (see :mod:`verl_core.enginekit.byo`): the engine runs
:class:`~verl_hf.rollout.HFRolloutEngine`'s own decoding loop over it (KV cache, exact log-probs,
per-sample seeded sampling), so it samples exactly like an engine loaded from a folder holding
the same weights. A model that also has ``generate_tokens`` supplies the response ids itself and
the engine adds the log-probs from one teacher-forced forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from verl_core.enginekit.byo import GeneratesTokens, generate_with_model, in_memory_spec
from verl_core.enginekit.model_folder import check_tokenizer_ids
from verl_core.enginekit.sampling import GraphCaptures, StaticDecoders
from verl_core.enginekit.token_stats import token_log_probs
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.rollout import SamplingParams
from verl_hf.config import HFOptions
from verl_hf.modeling import position_ids
from verl_hf.rollout import HFRolloutEngine
from verl_hf.tokenizer import HFTokenizer

__all__ = ["HFModelRollout", "rollout_from_model"]


class HFModelRollout(HFRolloutEngine):
    """An :class:`HFRolloutEngine` over a model object instead of a folder.

    Args:
        model: A transformers causal LM (``*ForCausalLM``: forward with ``input_ids``,
            ``attention_mask``, ``position_ids``, ``past_key_values`` (or ``cache``, as newer
            transformers name it), ``use_cache``, returning ``logits``), on the device it should
            run on. The engine shares it (no copy): it puts it in eval mode, decodes without
            gradients, and ``update_weights`` writes into it.
        tokenizer: Its transformers tokenizer (or an :class:`~verl_hf.tokenizer.HFTokenizer`).
        seed: Seed recorded in the spec (sampling seeds come from ``SamplingParams.seed``).
        max_prompt_len: Longest prompt accepted.
        max_response_len: Longest response generated.
        options: Backend options (``rollout_batch_size``).

    Raises:
        ConfigError: the model is not a module with an input embedding, or the tokenizer has no EOS,
            or its pad, EOS or BOS id is not a row of the model's input embedding
            (:func:`verl_core.enginekit.model_folder.check_tokenizer_ids`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        seed: int = 0,
        max_prompt_len: int = 512,
        max_response_len: int = 512,
        options: HFOptions | None = None,
    ) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "get_input_embeddings"):
            raise ConfigError(
                f"rollout_from_model needs a transformers causal LM (an nn.Module with "
                f"get_input_embeddings and an LM head), got {type(model).__name__}"
            )
        param = next(model.parameters(), None)
        if param is None:
            raise ConfigError(f"the model {type(model).__name__} has no parameters")
        device = param.device
        lm: Any = model
        vocab = int(lm.get_input_embeddings().num_embeddings)
        check_tokenizer_ids(tokenizer, vocab)
        # No super().__init__: it loads a folder; this sets the state the engine's methods use.
        self._spec = in_memory_spec(
            dtype=param.dtype, device=str(device), seed=seed,
            max_prompt_len=max_prompt_len, max_response_len=max_response_len,
        )
        self._options = options or HFOptions()
        self._device = device
        model.eval()  # dropout off: samples are a function of the weights and the seeds
        self._model = model
        self._tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        self._vocab_size = vocab
        self._tokenizer = tokenizer if isinstance(tokenizer, HFTokenizer) else HFTokenizer(tokenizer, vocab)
        # the weight-update path's caches (filled on the first update_weights); the decoder's state
        self._weights = None
        self._graphs = GraphCaptures("hf rollout")
        self._compiled = None
        self._first_compiled: dict[tuple[int, int], float] = {}
        self._shapes: set[tuple[int, int]] = set()
        self._decoders = StaticDecoders()
        self._flat = None  # the user's parameters stay where they are (no shared weight buffer)
        self._fused = None  # and the user's modules keep their own forwards
        self._lora = None  # a user's model object takes merged weights, never an adapter
        self._host = None
        self._dropped = False  # no weight buffer to drop: sleep_until_sync() sleeps as sleep() does
        self._shares_base = False  # no LoRA actor's base: the user's model is its own
        if not callable(getattr(HFRolloutEngine, "_expected", None)):
            setattr(self, "_expected", {})  # noqa: B010
        self._user_generates = isinstance(model, GeneratesTokens)

    @property
    def user_generates(self) -> bool:
        """True when the model's own ``generate_tokens`` supplies the response ids."""
        return self._user_generates

    def _decode(
        self, chunk: TensorBatch, seeds: list[int], params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if not self._user_generates:
            return super()._decode(chunk, seeds, params)
        tok = self._tokenizer
        return generate_with_model(
            self._model, chunk["prompt_ids"].to(self._device), chunk["prompt_mask"].to(self._device), seeds,
            params, stop_ids=[tok.eos_token_id, *params.stop_token_ids], pad_id=tok.pad_token_id,
            vocab_size=self._vocab_size, score=self._score,
        )

    def _score(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, temperature: float
    ) -> Tensor:
        """Teacher-forced log-probs of the response tokens under softmax(logits / T)."""
        ids = torch.cat([prompt_ids, response_ids], 1)
        attn = torch.cat([prompt_mask, response_mask], 1).long()
        out: Any = self._model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False)
        p = prompt_ids.shape[1]
        return token_log_probs(out.logits[:, p - 1 : -1], response_ids, temperature=temperature)[0]


def rollout_from_model(
    model: Any,
    tokenizer: Any,
    *,
    seed: int = 0,
    max_prompt_len: int = 512,
    max_response_len: int = 512,
    options: HFOptions | None = None,
) -> HFModelRollout:
    """A RolloutEngine around a transformers causal LM the caller built (see :class:`HFModelRollout`)."""
    return HFModelRollout(
        model, tokenizer, seed=seed, max_prompt_len=max_prompt_len, max_response_len=max_response_len,
        options=options,
    )
