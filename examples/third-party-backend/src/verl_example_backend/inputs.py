"""Boundary validation of input batches: reject bad input before any model code runs."""

from __future__ import annotations

from verl_core import BatchValidationError, TensorBatch

__all__ = ["validate"]


def validate(
    batch: TensorBatch, *, where: str, needs: tuple[str, ...], vocab_size: int,
    max_prompt_len: int | None = None, max_response_len: int | None = None, allow_empty: bool = False,
) -> TensorBatch:
    """Re-validate ``batch`` (dtypes, shapes, padding sides, ids, NaN/inf) and return it.

    The batch is rebuilt through the public constructor so that even a batch assembled without
    validation is checked, then value-checked with :meth:`TensorBatch.check`. A batch of 0 rows
    is refused unless ``allow_empty`` (a training engine's ``forward`` answers one with
    ``[0, width]`` outputs).

    Raises:
        BatchValidationError: naming ``where``, the field and what was expected.
    """
    if not isinstance(batch, TensorBatch):
        raise BatchValidationError(f"{where}: expected a TensorBatch, got {type(batch).__name__}")
    batch.require(*needs, where=where)
    try:
        rebuilt = TensorBatch(dict(batch.items()), batch.extras, batch.meta, batch_size=batch.batch_size)
    except BatchValidationError as e:
        raise BatchValidationError(f"{where}: {e}") from None
    rebuilt.check(where=where, vocab_size=vocab_size)
    if rebuilt.batch_size == 0:
        if allow_empty:
            return rebuilt
        raise BatchValidationError(f"{where}: the batch is empty; pass at least one sample")
    if max_prompt_len is not None and rebuilt.prompt_len > max_prompt_len:
        longest = int(rebuilt["prompt_mask"].sum(1).max())
        if longest > max_prompt_len:
            raise BatchValidationError(
                f"{where}: a prompt has {longest} tokens, more than EngineSpec.max_prompt_len="
                f"{max_prompt_len}; shorten the prompts or raise max_prompt_len"
            )
    if max_response_len is not None and "response_mask" in rebuilt:
        longest = int(rebuilt["response_mask"].sum(1).max())
        if longest > max_response_len:
            raise BatchValidationError(
                f"{where}: a response has {longest} tokens, more than EngineSpec.max_response_len="
                f"{max_response_len}"
            )
    return rebuilt
