"""``verl sft [CONFIG] [key.sub=value ...] [--resume] [--check]``: supervised fine-tuning from a config file."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from verl_core.trainer.cli.train import (
    add_run_arguments,
    config_folder,
    load_run_config,
    stop_on_signals,
)
from verl_core.trainer.run.backends import check_backends

__all__ = ["register"]


def register(subparsers: Any) -> Callable[[argparse.Namespace], int]:
    """Add the ``sft`` subcommand to the ``verl`` parser; returns its handler."""
    p = subparsers.add_parser(
        "sft",
        help="supervised fine-tuning on prompt/response pairs (its model-sft folder is a model.path for train)",
        description=(
            "Supervised fine-tuning of the actor on the prompt/response pairs of data.train (columns "
            "data.prompt_key and data.response_key), with the loss on the response tokens only, or on whole "
            "conversations (chat messages in data.prompt_key, no response column), with the loss on the "
            "assistant's tokens only. It uses the "
            "config format, engines, run folders, checkpoints and --resume of `verl train`; at the end it "
            "writes the final weights as a transformers folder, OUTPUT_DIR/model-sft, and prints its path: "
            "pass it to `verl train` as model.path. Overrides are key.sub=value (TOML literals; bare words "
            "are strings); flags may come anywhere among them."
        ),
    )
    add_run_arguments(p, checks="keys, values, that data.train is set, the actor backend")
    return _handle


def _handle(args: argparse.Namespace) -> int:
    from verl_core.trainer.config import check_device_here, config_to_dict
    from verl_core.trainer.sft.trainer import SFTTrainer
    from verl_core.trainer.sinks import check_sinks

    config = load_run_config(args)
    if args.print_config and not args.check:
        print(json.dumps(config_to_dict(config), indent=1))
        return 0
    trainer = SFTTrainer(config, base_dir=config_folder(args))  # checks the data section
    check_device_here(config)
    check_backends(config, {"actor": config.backends.actor})
    check_sinks(config.output_dir, config.logging)
    if args.check:
        print(f"verl sft: config is valid ({config.steps} steps on {', '.join(config.data.train_paths)}, "
              f"output_dir {config.output_dir!r})", file=sys.stderr)
        if args.print_config:
            print(json.dumps(config_to_dict(config), indent=1))
        return 0
    history: list[dict[str, Any]] = []
    with stop_on_signals(args, "sft", lambda: trainer.run_dir) as interrupted, trainer:
        history = trainer.train(resume=args.resume)
    if interrupted:
        return interrupted[0]
    now = trainer.ctx.steps_run_now()
    if now:
        first, last = now[0], now[-1]
        since = f" after resuming at step {trainer.ctx.resumed_at}" if trainer.ctx.resumed_at else ""
        print(f"done: {len(now)} steps{since}, loss {first['train/loss']:.4f} (step {first['step']}) -> "
              f"{last['train/loss']:.4f} (step {last['step']}); outputs in {config.output_dir}", file=sys.stderr)
    elif history:
        print(f"done: nothing left to run, the checkpoint is at step {trainer.ctx.resumed_at}; outputs in "
              f"{config.output_dir}", file=sys.stderr)
    print(trainer.model_dir)  # the model.path for `verl train`
    return 0
