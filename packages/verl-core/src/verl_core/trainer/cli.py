"""``verl train [CONFIG] [key.sub=value ...] [--resume] [--check]``: run a training loop from a config file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> Callable[[argparse.Namespace], int]:
    """Add the ``train`` subcommand to the ``verl`` parser; returns its handler."""
    p = subparsers.add_parser(
        "train",
        help="run RL post-training from a TOML/YAML config",
        description=(
            "Run RL post-training from a TOML or YAML config. Any key can be overridden as key.sub=value "
            "(values are TOML literals; bare words are strings), e.g. optim.lr=3e-3 task.name=reverse. "
            "Flags may come anywhere among the overrides."
        ),
    )
    p.add_argument("config", nargs="?", help="config file (.toml, .yaml, .yml); omitted = the defaults")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of output_dir")
    p.add_argument("--output-dir", help="shorthand for output_dir=PATH")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument(
        "--check", action="store_true",
        help="validate the config (keys, values, algorithm options) and exit 0 if it is valid; builds no "
        "engine and writes nothing",
    )
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print the full traceback of an error")
    return _handle


def _handle(args: argparse.Namespace) -> int:
    from verl_core.trainer.config import config_to_dict, load_config

    config_path = args.config
    overrides = list(args.overrides)
    if config_path is not None and "=" in config_path and not Path(config_path).is_file():
        overrides.insert(0, config_path)  # only overrides were given
        config_path = None
    if args.output_dir:
        overrides.append(f"output_dir={json.dumps(args.output_dir)}")
    config = load_config(config_path, overrides)
    from verl_core.trainer.trainer import Trainer

    if args.check:
        Trainer(config)  # its constructor checks the algorithm and its options; setup() would build engines
        print(f"verl train: config is valid ({config.steps} steps, algorithm {config.algorithm.name!r}, "
              f"output_dir {config.output_dir!r})", file=sys.stderr)
    if args.print_config:
        print(json.dumps(config_to_dict(config), indent=1))
    if args.check or args.print_config:
        return 0

    t0 = time.perf_counter()
    with Trainer(config) as trainer:
        trainer.setup()
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
