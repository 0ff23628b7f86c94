"""Saving and restoring a training engine's state: model, optimizer, masters, schedule, RNG and step.

The folder layout and its atomic commit are :mod:`verl_hf.checkpoint`'s; this module decides what
goes in (``model.safetensors``, ``trainer_state.pt``, one ``rng_rank{r}.pt`` per rank) and checks
everything against the live engine before restoring anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from verl_core.enginekit.checkpoint import verify_step_count, verify_tensors
from verl_core.kernel.errors import CheckpointError
from verl_core.kernel.weights import TensorInfo
from verl_hf import checkpoint as ckpt
from verl_hf.distributed import DataParallel
from verl_hf.optim import HFOptimizer, verify_masters
from verl_hf.weight_export import WeightExport

if TYPE_CHECKING:
    from verl_hf.lora import HFLora

__all__ = ["EngineCheckpoint"]


class EngineCheckpoint:
    """Writes and reads the checkpoints of one training engine.

    Args:
        model: The transformers model (FSDP2-wrapped under ``fsdp``).
        weights: Its exported tensors.
        optimizer: Its optimizer (None for a frozen reference).
        dp: The data-parallel group (every rank takes part in a save).
        fsdp: The model is sharded with FSDP2.
        role: The engine's role (stored for information).
        lora: The LoRA adapter the engine trains, or None. Its checkpoint holds the adapter (as
            ``model.safetensors``), its optimizer state and the base's identity; loading it onto
            another base model is refused.
    """

    def __init__(
        self, model: Any, weights: WeightExport, optimizer: HFOptimizer | None, dp: DataParallel, *,
        fsdp: bool, role: str, lora: HFLora | None = None,
    ) -> None:
        self._model = model
        self._weights = weights
        self._optimizer = optimizer
        self._dp = dp
        self._fsdp = fsdp
        self._role = role
        self._lora = lora

    def _lora_record(self) -> dict[str, Any] | None:
        """What a checkpoint says about the adapter: its shape and the base it was trained on."""
        if self._lora is None:
            return None
        spec = self._lora.spec
        return {"rank": spec.rank, "alpha": float(spec.alpha), "targets": list(self._lora.targets),
                "full": list(self._lora.full), "base_identity": self._lora.identity}

    def save(self, path: str | os.PathLike[str], step: int) -> None:
        """Save the state of optimizer step ``step`` atomically under ``path`` (every rank calls this)."""
        root = Path(path)
        name = self._dp.broadcast_str(ckpt.new_state_name(step))
        part = ckpt.partial_dir(root, name)
        if self._dp.rank == 0:
            part.mkdir(parents=True, exist_ok=False)
        self._dp.barrier()
        model_state = self._weights.full_state()
        optim = self._optimizer.state() if self._optimizer is not None else None
        if self._dp.rank == 0:
            save_file(model_state, str(part / "model.safetensors"), metadata={"format": "pt"})
            torch.save(
                {
                    "format": ckpt.CHECKPOINT_FORMAT,
                    "step": step,
                    "role": self._role,
                    "optimizer": optim["optimizer"] if optim is not None else None,
                    "master_weights": optim["master_weights"] if optim is not None else None,
                    "scheduler": optim["scheduler"] if optim is not None else None,
                    "lora": self._lora_record(),
                },
                part / "trainer_state.pt",
            )
        torch.save(ckpt.get_rng_state(), part / f"rng_rank{self._dp.rank}.pt")
        self._dp.barrier()
        if self._dp.rank == 0:
            ckpt.commit_state_dir(root, name)
        self._dp.barrier()

    def load(self, path: str | os.PathLike[str]) -> int:
        """Restore the state committed under ``path`` after checking all of it; returns its step.

        Raises:
            ConfigError: ``path`` holds no committed checkpoint.
            CheckpointError: the checkpoint does not fit this engine (see
                ``HFTrainingEngine.load_checkpoint``); nothing was restored.
        """
        state_dir = ckpt.current_state_dir(path)
        weights = load_file(str(state_dir / "model.safetensors"))
        trainer = torch.load(state_dir / "trainer_state.pt", map_location="cpu", weights_only=True)
        rng_file = state_dir / f"rng_rank{self._dp.rank}.pt"
        if not rng_file.exists():
            rng_file = state_dir / "rng_rank0.pt"
        rng = torch.load(rng_file, map_location="cpu", weights_only=True)
        self._verify(state_dir, weights, trainer, rng)
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self._model, dict[str, Any](weights), options=opts)
        else:
            with torch.no_grad():
                params = self._weights.live_state()  # the exported names (under LoRA: the adapter's)
                for name, value in weights.items():
                    params[name].copy_(value.to(params[name].device))
        if self._optimizer is not None:
            self._optimizer.load(trainer)
        ckpt.set_rng_state(rng)
        return int(trainer["step"])

    def _verify(self, folder: Path, weights: dict[str, Tensor], trainer: Any, rng: Any) -> None:
        """Refuse a checkpoint that does not fit this engine; copies nothing."""
        if not isinstance(trainer, dict) or trainer.get("format") != ckpt.CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: trainer_state.pt is not a {ckpt.CHECKPOINT_FORMAT} state; "
                "load a checkpoint written by HFTrainingEngine.save_checkpoint"
            )
        self._verify_lora(folder, trainer.get("lora"))
        live = self._weights.live_state()
        verify_tensors(weights, {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in live.items()}, checkpoint=folder)
        verify_step_count(trainer.get("step"), name="step", checkpoint=folder)
        trainable = [(n, p) for n, p in self._model.named_parameters() if p.requires_grad]
        verify_masters(folder, trainer.get("master_weights"), trainable)
        if self._optimizer is not None:
            self._optimizer.verify(folder, trainer, [n for n, _ in trainable])
        ckpt.verify_rng_state(rng, folder)

    def _verify_lora(self, folder: Path, saved: Any) -> None:
        """Refuse an adapter checkpoint for a full-weight engine (and the reverse), another adapter
        shape, or an adapter trained on another base model."""
        live = self._lora_record()
        if saved is None and live is None:
            return
        if live is None:
            raise CheckpointError(
                f"checkpoint {str(folder)!r} holds a LoRA adapter (rank {saved.get('rank') if isinstance(saved, dict) else '?'}), "
                "but this engine trains full weights; build it with the run's EngineSpec.lora (model.lora)"
            )
        if saved is None:
            raise CheckpointError(
                f"checkpoint {str(folder)!r} holds full weights, but this engine trains a LoRA adapter; build it "
                "without EngineSpec.lora (model.lora.enabled=false) to load it"
            )
        if not isinstance(saved, dict):
            raise CheckpointError(f"checkpoint {str(folder)!r}: its LoRA record is not a table; the file is corrupted")
        if saved.get("base_identity") != live["base_identity"]:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: its adapter was trained on another base model (identity "
                f"{saved.get('base_identity')!r}; this engine's base is {live['base_identity']!r}: other weights, "
                "names or shapes); resume with the model folder the run trained from"
            )
        for key in ("rank", "alpha", "targets", "full"):
            if saved.get(key) != live[key]:
                raise CheckpointError(
                    f"checkpoint {str(folder)!r}: its adapter has {key} {saved.get(key)!r}, this engine's "
                    f"{live[key]!r}; build the engine with the run's EngineSpec.lora (model.lora)"
                )
