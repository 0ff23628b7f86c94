"""``verl train CONFIG [key.sub=value ...] [--resume]``: run a training loop from a config file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> Callable[[argparse.Namespace], int]:
    """Add the ``train`` subcommand to the ``verl`` parser; returns its handler."""
    p = subparsers.add_parser(
        "train",
        help="run RL post-training from a TOML/YAML config",
        description=(
            "Run RL post-training from a TOML or YAML config. Any key can be overridden as key.sub=value "
            "(values are TOML literals; bare words are strings), e.g. optim.lr=3e-3 task.name=reverse."
        ),
    )
    p.add_argument("config", nargs="?", help="config file (.toml, .yaml, .yml); omitted = the defaults")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of output_dir")
    p.add_argument("--output-dir", help="shorthand for output_dir=PATH")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    return _handle


def _handle(args: argparse.Namespace) -> int:
    from verl_core.trainer.config import config_to_dict, load_config

    config_path = args.config
    overrides = list(args.overrides)
    if config_path is not None and "=" in config_path:  # only overrides were given
        overrides.insert(0, config_path)
        config_path = None
    if args.output_dir:
        overrides.append(f"output_dir={json.dumps(args.output_dir)}")
    config = load_config(config_path, overrides)
    if args.print_config:
        print(json.dumps(config_to_dict(config), indent=1))
        return 0
    from verl_core.trainer.trainer import Trainer

    t0 = time.perf_counter()
    with Trainer(config) as trainer:
        trainer.setup(resume=args.resume)  # the output folder is checked before any engine is built
        setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        history = trainer.train(resume=args.resume)
        train_s = time.perf_counter() - t1
    if history:
        last = history[-1]
        first = history[0]
        print(
            f"done: {len(history)} steps, reward {first['reward/mean']:.3f} (step {first['step']}) -> "
            f"{last['reward/mean']:.3f} (step {last['step']}); set-up {setup_s:.1f}s, training {train_s:.1f}s; "
            f"outputs in {config.output_dir}",
            file=sys.stderr,
        )
    return 0
