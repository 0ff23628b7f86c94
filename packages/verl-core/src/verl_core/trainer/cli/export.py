"""``verl export CHECKPOINT OUT``: write a checkpoint's actor as a transformers folder."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> Callable[[argparse.Namespace], int]:
    """Add the ``export`` subcommand to the ``verl`` parser; returns its handler."""
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's actor as a transformers folder (for transformers, vLLM, the Hub)",
        description=(
            "Write the actor of a `verl train` checkpoint as a transformers folder: safetensors "
            "weights, config.json, tokenizer files and generation_config.json (a LoRA run's merged "
            "weights; --adapter-only writes its adapter as a PEFT folder instead). CHECKPOINT is a "
            "run's output_dir (its newest checkpoint) or one of its checkpoints/step-N folders."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run output folder or checkpoints/step-N folder")
    p.add_argument("out", metavar="OUT", help="folder to create (must not exist, or be empty)")
    p.add_argument("--device", help="device to load the actor on (default: the run's model.device)")
    p.add_argument("--adapter-only", action="store_true",
                   help="write only the LoRA adapter of a model.lora run, as a PEFT adapter folder")
    return _handle


def _handle(args: argparse.Namespace) -> int:
    from verl_core.trainer.run.export import export_checkpoint, resolve_checkpoint

    ckpt = resolve_checkpoint(args.checkpoint)
    out = export_checkpoint(ckpt, args.out, device=args.device, adapter_only=args.adapter_only)
    print(f"exported {ckpt} to {out}", file=sys.stderr)
    return 0
