"""The float64 transformers reference: what every backend's numbers are compared against.

One implementation serves the test kit and the suite: :class:`verl_conformance.reference.ReferenceModel`
runs every sample on its own, unpadded, so the reference does not depend on any padding convention.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from torch import Tensor

from verl_core import BatchValidationError, TensorBatch

__all__ = ["reference_forward"]


def reference_forward(
    model_path: str | os.PathLike[str],
    batch: TensorBatch,
    outputs: Collection[str] = ("log_probs", "entropy"),
) -> dict[str, Tensor]:
    """Log-probs and entropy (from a causal-LM folder) or values (from a value-head folder) in float64.

    ``log_probs[b, t]`` is log softmax(logits / T) of ``response_ids[b, t]`` from the logits at the
    preceding position, T = ``batch.meta.temperature``; ``values[b, t]`` is read at the same
    position. Masked positions hold 0. The model is loaded once per process and folder.

    Returns:
        Float64 tensors [batch, response] by output name.
    """
    from verl_conformance.reference import cached_outputs

    unknown = set(outputs) - {"log_probs", "entropy", "values"}
    if unknown:
        raise BatchValidationError(f"reference_forward: unknown outputs {sorted(unknown)}")
    return cached_outputs(model_path, batch, tuple(outputs))
