"""The training engine's weights by exported name: live tensors, the weight stream, full state dicts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from verl_core.enginekit.weight_stream import stream_weights
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_core.kernel.weights import TensorInfo, WeightManifest, WeightMessage
from verl_hf.modeling import FlatParameters, export_order

__all__ = ["WeightExport"]


class WeightExport:
    """The exported tensors of a model (transformers naming, a tied lm_head left out).

    An actor on one device keeps its weights in one buffer, in export order (``flat``): a rollout
    engine with the same layout syncs with one device copy (``HFDirectSync``). The buffer is
    dropped while the model is offloaded and rebuilt when it comes back.

    Args:
        model: The transformers model (FSDP2-wrapped under ``fsdp``).
        tied: The lm_head shares the input embedding (it is not exported).
        fsdp: The model is sharded with FSDP2 (full tensors are gathered collectively).
        flat: Keep the weights in one buffer (``FlatParameters``).
    """

    def __init__(self, model: Any, *, tied: bool, fsdp: bool, flat: bool) -> None:
        self._model = model
        self.tied = tied
        self._fsdp = fsdp
        self._keep_flat = flat
        self.names = export_order([n for n in model.state_dict() if not (tied and n == "lm_head.weight")])
        # (name, owning module, attribute) of every exported tensor, found on first use.
        self._owners: list[tuple[str, Any, str]] | None = None
        self.flat: FlatParameters | None = FlatParameters.build(self.live_state()) if flat else None

    def live_state(self) -> dict[str, Tensor]:
        """Name -> the tensor the model holds now under each exported name (its state dict).

        Read through each name's owning module (found once), not by walking the whole module
        tree as ``state_dict()`` does: a sync asks for it every step. A parameter replaced or
        moved since the last call is seen as it is now.
        """
        if self._owners is None:
            owners = []
            for name in self.names:
                prefix, _, attr = name.rpartition(".")
                owners.append((name, self._model.get_submodule(prefix), attr))
            self._owners = owners
        return {name: getattr(module, attr) for name, module, attr in self._owners}

    def rebuild_flat(self) -> None:
        """Put the weights back into one buffer (after the model came back to its device)."""
        if self._keep_flat:
            self.flat = FlatParameters.build(self.live_state())

    def _full_tensors(self, state: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        for name in self.names:
            t = state[name]
            full = getattr(t, "full_tensor", None)
            yield name, (full() if full is not None else t)

    def stream(
        self, version: int, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """The weight stream of weight version ``version`` (manifest, chunks, commit)."""
        state = self.live_state()
        infos = {
            n: TensorInfo(tuple(state[n].shape), dtype if dtype is not None else state[n].dtype)
            for n in self.names
        }
        manifest = WeightManifest(version=version, tensors=infos, tied_embeddings=self.tied)
        return stream_weights(self._full_tensors(state), manifest, bucket_bytes=bucket_bytes, dtype=dtype)

    def full_state(self) -> dict[str, Tensor]:
        """Every exported tensor whole, on CPU (what a checkpoint stores)."""
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            sd = get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = self._model.state_dict()
        keep = set(self.names)
        return {k: v.detach().cpu().contiguous() for k, v in sd.items() if k in keep and isinstance(v, Tensor)}
