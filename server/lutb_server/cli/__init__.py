"""The ``lutb`` command: one subcommand per module, each with ``register(subparsers)``.

A subcommand module adds its parser with ``set_defaults(run=...)``; ``run(args)``
returns the process exit code. Modules are imported when the command starts,
so each keeps its heavy imports inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Order here is the order in `lutb --help`.
SUBCOMMAND_MODULES = (
    "lutb_server.cli.serve_cmd",  # serve
    "lutb_server.cli.client_cmds",  # info, bench
    "lutb_server.cli.check_cmd",  # check, record
    "lutb_server.cli.checkpoint_cmds",  # synth, quantize, inspect
    "lutb_server.cli.health_cmd",  # health
    "lutb_server.cli.shard_cmd",  # shard
    "lutb_server.cli.load_cmd",  # load
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lutb",
        description="Serve, inspect and check 3-bit LUT-B Mixture-of-Experts experts.",
    )
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                        help=f"logging level: {', '.join(LOG_LEVELS)} (default: INFO)")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lutb`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
