"""The ``verl`` command: ``verl --version``, ``verl backends``, the trainer's subcommands (``train``,
``sft``, ``export``) and those other distributions add through the ``verl.commands`` entry-point
group (``conformance``, from verl-conformance). A command whose distribution is broken (its entry
point cannot be imported) is listed with the error and fails only when it is run.

Errors are one line on stderr: a usage error or a :class:`~verl_core.kernel.errors.VerlError` (a bad
config, a missing checkpoint, ...) prints ``verl <command>: error: ...`` and exits 2; any other
exception prints its type and message and exits 1. ``--debug`` prints the full traceback instead.
A Ctrl-C that a command does not handle itself prints ``verl <command>: interrupted`` and exits 130
(``verl train`` and ``verl sft`` stop at a step boundary and name the step and the resume command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Final, NoReturn

from verl_core.kernel.errors import PluginError, VerlError
from verl_core.kernel.version import PROTOCOL_VERSION, __version__

__all__ = ["main"]

_SUBCOMMANDS: Final[dict[str, str]] = {
    # name -> "module:register" of a function(subparsers) -> handler (the trainer, one layer down)
    "train": "verl_core.trainer.cli.train:register",
    "sft": "verl_core.trainer.cli.sft:register",
    "export": "verl_core.trainer.cli.export:register",
}
COMMANDS_GROUP: Final = "verl.commands"
"""Entry-point group of the subcommands other distributions add: ``name = "module:register"``."""


def _plugin_commands() -> dict[str, str]:
    """``verl.commands`` entry points by name (the trainer's own names win)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP) if ep.name not in _SUBCOMMANDS}


def _capability_summary(caps: object) -> str:
    on = []
    for f in dataclasses.fields(caps):  # type: ignore[arg-type]
        value = getattr(caps, f.name)
        if value is True:
            on.append(f.name)
        elif isinstance(value, frozenset):
            on.append(f"{f.name}={'/'.join(sorted(value))}")
        elif isinstance(value, str):
            on.append(f"{f.name}={value}")
    return ", ".join(on)


def _cmd_backends(args: argparse.Namespace) -> int:
    from verl_core.kernel.registry import available_backends, broken_plugins

    backends = available_backends()
    broken = broken_plugins()
    if args.json:
        out = {
            name: {
                "distribution": b.distribution,
                "version": b.version,
                "protocol_version": b.spec.protocol_version,
                "roles": {
                    role: {k: sorted(v) if isinstance(v, frozenset) else v
                           for k, v in dataclasses.asdict(b.capabilities(role)).items()}
                    for role in b.spec.roles
                },
            }
            for name, b in backends.items()
        }
        for name, p in broken.items():  # installed but cannot be loaded: no roles, and why
            out[name] = {"distribution": p.distribution, "version": p.version, "roles": {}, "broken": p.error}
        print(json.dumps(dict(sorted(out.items())), indent=2))
        return 0
    if not backends and not broken:
        print("no verl backends installed (try: pip install verl-hf)")
        return 0
    # Columns as wide as their longest value: a VERL_PLUGINS backend's version is its module path.
    ok = {name: (name, b.distribution, b.version, b.spec.protocol_version) for name, b in backends.items()}
    bad = {name: (name, p.distribution, p.version, "-") for name, p in broken.items()}
    titles = ("backend", "distribution", "version", "protocol")
    widths = [max(len(t), *(len(lead[i]) for lead in [*ok.values(), *bad.values()])) for i, t in enumerate(titles)]

    def columns(values: tuple[str, ...]) -> str:
        return " ".join(f"{v:<{w}}" for v, w in zip(values, widths, strict=True))

    header = f"{columns(titles)} role: capabilities"
    print(header)
    print("-" * len(header))
    for name, b in backends.items():
        for i, role in enumerate(b.spec.roles):
            lead = columns(ok[name]) if i == 0 else " " * len(columns(titles))
            print(f"{lead} {role}: {_capability_summary(b.capabilities(role))}")
    for name, p in broken.items():
        print(f"{columns(bad[name])} broken: {_one_line(p.error)}")
    return 0


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit 2), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see '{self.prog} --help')\n")


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _shown(args: Sequence[str]) -> str:
    """Command-line words as an error quotes them: bare, or ``repr`` when a character would not show."""
    return " ".join(a if a.isprintable() and a == a.strip() else repr(a) for a in args)


def _build_parser() -> tuple[_Parser, argparse._SubParsersAction[_Parser], dict[str, Callable[[argparse.Namespace], int]]]:
    parser = _Parser(
        prog="verl", description="Reinforcement-learning post-training of language models, on any backend."
    )
    parser.add_argument(
        "--version", action="version", version=f"verl-core {__version__} (protocol {PROTOCOL_VERSION})"
    )
    parser.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {}
    p = sub.add_parser("backends", help="list installed backends, their versions and capabilities")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    handlers["backends"] = _cmd_backends
    from verl_core.kernel.registry import import_string

    for name, target in {**_SUBCOMMANDS, **_plugin_commands()}.items():
        try:
            register = import_string(target)
        except Exception as e:  # one broken distribution must not take the other commands down
            error = e if isinstance(e, VerlError) else PluginError(
                f"cannot load the 'verl {name}' command ({target}): {type(e).__name__}: {e}"
            )
            handlers[name] = _broken_command(sub, name, error)
            continue
        handlers[name] = register(sub)
    return parser, sub, handlers


def _broken_command(
    sub: argparse._SubParsersAction[_Parser], name: str, error: VerlError
) -> Callable[[argparse.Namespace], int]:
    """A subcommand whose module cannot be imported: listed with the error, which it raises when run."""
    p = sub.add_parser(name, help=f"(unavailable: {_one_line(str(error))})")
    p.add_argument("args", nargs=argparse.REMAINDER)

    def run(args: argparse.Namespace) -> int:
        raise error

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``verl`` command; returns the exit code (0 done, 1 unexpected error, 2 bad input).

    Flags may come anywhere among a command's positional arguments (``verl train run.toml --resume
    steps=10``): positionals after a flag are added to the command's ``overrides``.
    """
    parser, sub, handlers = _build_parser()
    args, extras = parser.parse_known_args(argv)
    if args.command is None:
        if extras:
            parser.error(f"unrecognized arguments: {_shown(extras)}")
        parser.print_help()
        return 2
    if extras:
        command_parser = sub.choices[args.command]
        flags = [x for x in extras if x.startswith("-")]
        if flags or not isinstance(getattr(args, "overrides", None), list):
            command_parser.error(f"unrecognized arguments: {_shown(flags or extras)}")
        args.overrides.extend(extras)
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM turned into one) outside a run's own handling
        if args.debug:
            traceback.print_exc()
        detail = str(e)
        print(f"verl {args.command}: interrupted{': ' + _one_line(detail) if detail else ''}", file=sys.stderr)
        code = getattr(e, "exit_code", 130)
        return code if isinstance(code, int) else 130
    except Exception as e:
        code = 2 if isinstance(e, VerlError) else 1
        if args.debug:
            traceback.print_exc()
        elif code == 2:
            print(f"verl {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
        else:
            print(
                f"verl {args.command}: error: unexpected {type(e).__name__}: {_one_line(str(e))} "
                "(run with --debug for the traceback)",
                file=sys.stderr,
            )
        return code


if __name__ == "__main__":
    sys.exit(main())
