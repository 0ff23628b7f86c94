"""The float64 transformers reference: what every backend's numbers are compared against."""

from __future__ import annotations

import functools
import os
from collections.abc import Collection

import torch
from torch import Tensor

from verl_core import BatchValidationError, TensorBatch

__all__ = ["position_ids", "reference_forward"]


def position_ids(attention_mask: Tensor) -> Tensor:
    """``cumsum(attention_mask) - 1`` clipped at 0 (DESIGN.md: never arange under left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


@functools.lru_cache(maxsize=8)
def _load(path: str, head: str) -> torch.nn.Module:
    import transformers

    auto = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "value": transformers.AutoModelForTokenClassification,
    }[head]
    model = auto.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    return model  # type: ignore[no-any-return]


def reference_forward(
    model_path: str | os.PathLike[str],
    batch: TensorBatch,
    outputs: Collection[str] = ("log_probs", "entropy"),
) -> dict[str, Tensor]:
    """Log-probs and entropy (from a causal-LM folder) or values (from a value-head folder) in float64.

    ``log_probs[b, t]`` is log softmax(logits / T) of ``response_ids[b, t]`` from the logits at the
    preceding position, T = ``batch.meta.temperature``; ``values[b, t]`` is read at the same
    position. Masked positions hold 0.

    Returns:
        Float64 tensors [batch, response] by output name.
    """
    batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="reference_forward")
    unknown = set(outputs) - {"log_probs", "entropy", "values"}
    if unknown:
        raise BatchValidationError(f"reference_forward: unknown outputs {sorted(unknown)}")
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).cpu()
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1).cpu()
    p, r = batch.prompt_len, batch.response_len
    rmask = batch["response_mask"].cpu()
    result: dict[str, Tensor] = {}
    with torch.no_grad():
        if "values" in outputs:
            model = _load(str(model_path), "value")
            out = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask))
            scores = out.logits[..., 0].double()
            result["values"] = scores[:, p - 1 : p + r - 1].masked_fill(~rmask, 0.0)
        if {"log_probs", "entropy"} & set(outputs):
            model = _load(str(model_path), "causal_lm")
            out = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask))
            logits = out.logits[:, p - 1 : p + r - 1].double() / batch.meta.temperature
            logp = torch.log_softmax(logits, -1)
            if "log_probs" in outputs:
                lp = logp.gather(-1, batch["response_ids"].cpu().unsqueeze(-1)).squeeze(-1)
                result["log_probs"] = lp.masked_fill(~rmask, 0.0)
            if "entropy" in outputs:
                ent = -(logp.exp() * logp).sum(-1)
                result["entropy"] = ent.masked_fill(~rmask, 0.0)
    return result
