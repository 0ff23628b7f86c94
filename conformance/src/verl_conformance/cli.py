"""``verl conformance NAME [--against OTHER]``: run the suite, print a table per area, write JSON."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_conformance.runner import CheckResult

__all__ = ["register"]


def register(subparsers: Any) -> Callable[[argparse.Namespace], int]:
    """Add the ``conformance`` subcommand to the ``verl`` command; return its handler."""
    p = subparsers.add_parser(
        "conformance", help="run the conformance suite on an installed backend",
        description="Run the conformance suite on an installed backend: print a line per check on stderr as it "
                    "ends, then a table per area (passed, failed, skipped with the reason) and write a JSON report.",
    )
    p.add_argument("backend", metavar="NAME", help="installed backend (see `verl backends`)")
    p.add_argument("--against", metavar="OTHER", default=None,
                   help="second installed backend for the differential checks")
    p.add_argument("--check", "-k", dest="checks", action="append", default=None, metavar="ID",
                   help="run only checks matching ID (area::name, wildcards allowed); repeatable")
    p.add_argument("--area", dest="areas", action="append", default=None, metavar="AREA",
                   help="run only this area (schema, numerics, invariance, differential, weight_sync, robustness, "
                        "reward, stateful, buffer)")
    p.add_argument("--xfails-file", default=None, metavar="PATH", help="known gaps of the backend")
    p.add_argument("--check-timeout", type=float, default=None, metavar="S",
                   help="seconds one check may run before it fails, naming where it hung (default 900; 0: no limit)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype every engine is built in, which selects the tolerance tier (default float32; a "
                        "dtype no role declares is refused)")
    p.add_argument("--device", default="cpu", help="device every engine is built on (default cpu; e.g. cuda)")
    p.add_argument("--options", default=None, metavar="JSON",
                   help='backend options given to every engine, a JSON object (e.g. \'{"enforce_eager": true}\')')
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="where to write the JSON report (default: conformance-NAME.json)")
    return _handle


def _handle(args: argparse.Namespace) -> int:
    from verl_conformance.api import parse_options, run_conformance
    from verl_conformance.runner import reproduction
    from verl_conformance.timelimit import limit_from_option

    try:
        options = parse_options(args.options)
        report = run_conformance(args.backend, against=args.against, checks=args.checks, areas=args.areas,
                                 known_gaps=args.xfails_file, check_timeout_s=limit_from_option(args.check_timeout),
                                 progress=_progress, dtype=args.dtype, device=args.device, options=options)
    except (ValueError, OSError) as e:  # an unknown area or check pattern, an unreadable gaps file, a bad setting
        print(f"verl conformance: error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    flags = [f"--verl-{key} {value}" for key, value, default in (
        ("dtype", args.dtype, "float32"), ("device", args.device, "cpu")) if value != default]
    if options:
        flags.append(f"--verl-options {shlex.quote(json.dumps(options))}")
    for r in report.failures:
        print(f"\nFAILED {r.id}\n  {r.message}\n  reproduce:\n    "
              + reproduction(r.id, report.backend, report.against, pytest_flags=flags).replace("\n", "\n    "))
    out = Path(args.json_path or f"conformance-{args.backend}.json")
    out.write_text(report.to_json())
    print(f"\nJSON report: {out}")
    return 1 if report.failures else 0


def _progress(result: CheckResult, done: int, total: int) -> None:
    """One line on stderr per check as it ends (the tables come at the end, on stdout)."""
    print(f"[{done}/{total}] {result.id} {result.status} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)
