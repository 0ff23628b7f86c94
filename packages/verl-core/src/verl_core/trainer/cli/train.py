"""``verl train [CONFIG] [key.sub=value ...] [--resume] [--check]``: run a training loop from a config file."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_core.trainer.run.backends import check_backends

if TYPE_CHECKING:
    from verl_core.trainer.config import RunConfig
    from verl_core.trainer.run.folder import RunDir

__all__ = ["add_run_arguments", "load_run_config", "register", "resume_command", "stop_on_signals"]


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
    add_run_arguments(p, checks="keys, values, algorithm options, backends and the dtype, device and LoRA they declare")
    return _handle


def add_run_arguments(p: argparse.ArgumentParser, *, checks: str) -> None:
    """Add the arguments every run command takes to ``p``: CONFIG, overrides, ``--resume``,
    ``--output-dir``, ``--print-config``, ``--check`` (its help names ``checks``) and ``--debug``."""
    p.add_argument("config", nargs="?", help="config file (.toml, .yaml, .yml); omitted = the defaults")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of output_dir")
    p.add_argument("--output-dir", help="shorthand for output_dir=PATH")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument(
        "--check", action="store_true",
        help=f"validate the config ({checks}) and exit 0 if it is valid; builds no engine and writes nothing",
    )
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print the full traceback of an error")


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """The run config of :func:`add_run_arguments`' arguments: the file (if any), then the overrides.

    A first positional holding ``=`` that is not a file is taken as an override.

    Raises:
        ConfigError: the file or an override is invalid.
    """
    from verl_core.trainer.config import is_file, load_config

    config_path = args.config
    overrides = list(args.overrides)
    if config_path is not None and "=" in config_path and not is_file(config_path):
        overrides.insert(0, config_path)  # only overrides were given
        config_path = None
    if args.output_dir:
        overrides.append(f"output_dir={json.dumps(args.output_dir)}")
    return load_config(config_path, overrides)


def config_folder(args: argparse.Namespace) -> Path | None:
    """The folder of the config file named on the command line (None when only overrides were given)."""
    from verl_core.trainer.config import is_file

    path = args.config
    return Path(path).parent if path is not None and is_file(path) else None


def resume_command(args: argparse.Namespace, command: str, *, flag: str = "--resume") -> str:
    """The command line that continues the run of ``args``: the same config and overrides, then ``flag``.

    ``overwrite`` overrides are left out (``--resume`` refuses them).
    """
    tokens = [*([args.config] if args.config is not None else []), *args.overrides]
    tokens = [t for t in tokens if t.partition("=")[0].strip() != "overwrite"]
    if args.output_dir:
        tokens += ["--output-dir", args.output_dir]
    return shlex.join([*_program(), command, *tokens, flag])


def _program() -> list[str]:
    """How the command was started: ``python -m verl_core`` where that is how (``verl`` off the
    PATH), else ``verl``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name in ("verl_core", "verl_core.__main__"):
        return ["python", "-m", "verl_core"]
    return ["verl"]


@contextmanager
def stop_on_signals(args: argparse.Namespace, command: str, run_dir: Callable[[], RunDir | None]) -> Iterator[list[int]]:
    """Run the body with SIGINT and SIGTERM stopping the run; an interrupted run prints one line.

    The step loop stops at a step boundary and saves a checkpoint
    (:mod:`verl_core.trainer.run.interrupt`); elsewhere a signal stops at once. The line names the
    step, the newest checkpoint and the command that continues the run; the exit status
    (``128 + signal``) is put into the yielded list (empty when the run was not interrupted).

    Args:
        args: The command's arguments (for the resume command).
        command: ``train`` or ``sft``.
        run_dir: The run's claim on its output folder (None before it is claimed).
    """
    from verl_core.trainer import latest_checkpoint
    from verl_core.trainer.run.interrupt import RunInterrupted, StopSignals

    status: list[int] = []
    try:
        with StopSignals(defer=False):  # the step loop defers the stop to a step boundary itself
            yield status
    except RunInterrupted as e:
        run = run_dir()
        if e.checkpoint is None and run is not None:
            e.checkpoint = latest_checkpoint(run.path)
        if e.checkpoint is not None:
            then = f"continue with `{resume_command(args, command)}`"
        elif run is not None and run.created:  # a fresh run claimed its folder: a fresh start there needs overwrite
            then = f"nothing to resume: start again with `{resume_command(args, command, flag='overwrite=true')}`"
        else:
            then = "nothing to resume: start the run again"
        print(f"verl {command}: {e}; {then}", file=sys.stderr)
        status.append(e.exit_code)


def _handle(args: argparse.Namespace) -> int:
    from verl_core.trainer.config import check_device_here, config_to_dict
    from verl_core.trainer.run.model import check_model_folders
    from verl_core.trainer.sinks import check_sinks

    config = load_run_config(args)
    if args.print_config and not args.check:
        print(json.dumps(config_to_dict(config), indent=1))
        return 0
    from verl_core.trainer.rl.trainer import Trainer

    # checks the algorithm and its options against the rest of the config; relative paths in the
    # config (datasets, reward functions, callbacks) are looked up next to the config file first
    trainer = Trainer(config, base_dir=config_folder(args))
    check_device_here(config)
    check_backends(config, trainer.backend_roles())
    check_model_folders(config, use_critic=trainer.use_critic)
    check_sinks(config.output_dir, config.logging)
    if args.check:
        print(f"verl train: config is valid ({config.steps} steps, algorithm {config.algorithm.name!r}, "
              f"output_dir {config.output_dir!r})", file=sys.stderr)
        if args.print_config:
            print(json.dumps(config_to_dict(config), indent=1))
        return 0

    t0 = time.perf_counter()
    history: list[dict[str, Any]] = []
    with stop_on_signals(args, "train", lambda: trainer.run_dir) as interrupted, trainer:
        trainer.setup(resume=args.resume)  # the output folder is checked before any engine is built
        setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        history = trainer.train(resume=args.resume)
        train_s = time.perf_counter() - t1
    if interrupted:
        return interrupted[0]
    now = trainer.ctx.steps_run_now()
    if now:
        first, last = now[0], now[-1]
        since = f" after resuming at step {trainer.ctx.resumed_at}" if trainer.ctx.resumed_at else ""
        print(
            f"done: {len(now)} steps{since}, reward {first['reward/mean']:.3f} (step {first['step']}) -> "
            f"{last['reward/mean']:.3f} (step {last['step']}); set-up {setup_s:.1f}s, training {train_s:.1f}s; "
            f"outputs in {config.output_dir}",
            file=sys.stderr,
        )
    elif history:
        print(f"done: nothing left to run, the checkpoint is at step {trainer.ctx.resumed_at} of steps={config.steps}; "
              f"outputs in {config.output_dir}", file=sys.stderr)
    return 0
