"""Helpers of the vLLM backend tests: the row-wise float64 reference, prompt batches, weight streams."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from verl_conformance.testkit import reference_forward
from verl_core import (
    BatchMeta,
    TensorBatch,
    TensorInfo,
    WeightManifest,
    WeightMessage,
    stream_weights,
)
from verl_core.enginekit.weight_stream import fusion_group

KV_CACHE_BYTES = 32 * 1024 * 1024
MAX_PROMPT = 16
MAX_RESPONSE = 16


def reference_log_probs(model_path: str | os.PathLike[str], batch: TensorBatch) -> Tensor:
    """Float64 reference log-probs of ``batch``'s responses, one unpadded sample at a time.

    Each sample is trimmed of its padding columns first, so the reference never sees a
    fully-masked query row (transformers' eager float64 attention returns NaN for those).
    """
    width = batch.response_len
    rows = []
    for i in range(batch.batch_size):
        one = batch.index([i]).trim()
        lp = reference_forward(model_path, one, ("log_probs",))["log_probs"][0]
        rows.append(torch.nn.functional.pad(lp, (0, width - lp.shape[0])))
    return torch.stack(rows) if rows else torch.zeros(0, width, dtype=torch.float64)


def make_prompts(token_lists: list[list[int]], group_ids: list[int], pad_id: int = 0) -> TensorBatch:
    """A left-padded prompt batch of the given token lists and group ids."""
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(token_lists), width), dtype=torch.bool)
    for i, toks in enumerate(token_lists):
        ids[i, width - len(toks) :] = torch.tensor(toks)
        mask[i, width - len(toks) :] = True
    return TensorBatch(
        {"prompt_ids": ids, "prompt_mask": mask, "group_ids": torch.tensor(group_ids, dtype=torch.int64)},
        meta=BatchMeta(pad_token_id=pad_id),
    )


def load_state_dict(model_path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The tensors of a test-kit folder's safetensors file."""
    from safetensors.torch import load_file

    return dict(load_file(str(Path(model_path) / "model.safetensors")))


def save_variant(src: str | os.PathLike[str], dst: Path, state: Mapping[str, Tensor]) -> Path:
    """Copy the folder ``src`` to ``dst`` with its weights replaced by ``state``."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def weight_stream(
    state: Mapping[str, Tensor], version: int, *, tied: bool = False, bucket_bytes: int = 1 << 20
) -> Iterator[WeightMessage]:
    """The canonical stream of ``state`` with fusion groups contiguous."""
    names = sorted(state, key=lambda n: (fusion_group(n), n))
    manifest = WeightManifest(
        version, {n: TensorInfo(tuple(state[n].shape), state[n].dtype) for n in names}, tied
    )
    return stream_weights(((n, state[n]) for n in names), manifest, bucket_bytes=bucket_bytes)
