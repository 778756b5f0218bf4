"""The ``normkit`` command line: ``normkit <subcommand> [options]``.

Subcommands:
    quickstart  train a small CNN on scikit-learn's digits with each norm and print
                the measurements (see :mod:`normkit.quickstart`).

The same entry point runs as ``python -m normkit``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normkit",
        description="normkit: normalization layers for PyTorch.",
        epilog="Run 'normkit <subcommand> --help' for a subcommand's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{quickstart}", title="subcommands")
    sub.add_parser(
        "quickstart",
        add_help=False,
        help="train a small CNN on scikit-learn's digits with each norm and print "
        "test accuracy, training loss and speed",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``normkit`` command line; returns the exit code.

    ``quickstart`` forwards every argument after it to :func:`normkit.quickstart.main`.
    With no subcommand the usage is printed to stderr and the exit code is 2, as for
    any argparse usage error.

    Example:
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     code = main([])
        >>> code, err.getvalue().startswith("usage: normkit")
        (2, True)
    """
    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "quickstart":
        from . import quickstart

        return quickstart.main(rest, prog=f"{parser.prog} quickstart")
    parser.error(f"unknown subcommand {args.command!r}")
    return 2
