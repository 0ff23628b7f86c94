"""The training engine's weights by exported name: live tensors, the weight stream, full state dicts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from verl_core.enginekit.weight_stream import stream_weights
from verl_core.kernel.training import DEFAULT_BUCKET_BYTES
from verl_core.kernel.weights import TensorInfo, WeightManifest, WeightMessage
from verl_hf.modeling import FlatParameters, export_order

if TYPE_CHECKING:
    from verl_hf.lora import HFLora

__all__ = ["LoraWeightExport", "WeightExport"]


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


class LoraWeightExport(WeightExport):
    """The exported tensors of a model training a LoRA adapter (:class:`~verl_hf.lora.HFLora`).

    The weight stream carries the merged weights, each target's ``W + scale * B A`` computed as
    the stream reaches it (no second copy of the model); :meth:`adapter_stream` carries the
    adapter itself. The live state, and what a checkpoint stores, is the adapter (the base is
    frozen and read again from the model folder). Never in one buffer: the merged tensors are new.

    Args:
        lora: The adapted model.
    """

    def __init__(self, lora: HFLora) -> None:
        self._lora = lora
        self._model = lora.model
        self.tied = lora.tied
        self._fsdp = False
        self._keep_flat = False
        self.flat = None
        self.names = list(lora.adapter())
        self._owners = None

    def live_state(self) -> dict[str, Tensor]:
        """Stream name -> the live adapter tensor (``lora_A``/``lora_B`` per target, fully trained copies)."""
        return self._lora.adapter()

    def rebuild_flat(self) -> None:
        """Nothing to rebuild: the weights are never in one buffer."""

    def stream(
        self, version: int, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[WeightMessage]:
        """The merged weight stream of version ``version`` (the base model's names)."""
        infos = {n: TensorInfo(i.shape, dtype if dtype is not None else i.dtype)
                 for n, i in self._lora.base_infos.items()}
        manifest = WeightManifest(version=version, tensors=infos, tied_embeddings=self.tied)
        return stream_weights(self._lora.merged(dtype), manifest, bucket_bytes=bucket_bytes, dtype=dtype)

    def adapter_stream(self, version: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightMessage]:
        """The adapter stream of version ``version`` (every tensor in its own dtype)."""
        state = self._lora.adapter()
        infos = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in state.items()}
        return stream_weights(state.items(), WeightManifest(version=version, tensors=infos), bucket_bytes=bucket_bytes)

    def full_state(self) -> dict[str, Tensor]:
        """Every adapter tensor on CPU (what a checkpoint stores)."""
        return {n: t.detach().cpu().contiguous() for n, t in self._lora.adapter().items()}
