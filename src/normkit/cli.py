"""The ``normkit`` command line: ``normkit <subcommand> [options]``.

Subcommands:
    quickstart  train a small CNN on scikit-learn's digits with each norm and print
                the measurements (see :mod:`normkit.quickstart`).
    doctor      run a model once on an example batch and diagnose its normalization
                layers (see :mod:`normkit.tools.doctor`):
                ``normkit doctor mymodels:make_model --input-shape 8,3,32,32``.
    bench       time normkit's ops against torch in the same process
                (see :mod:`normkit.bench`).
    lab         measure the articles' claims and write a report (see :mod:`normkit.lab`);
                the main job: ``normkit lab``.

The same entry point runs as ``python -m normkit``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ._files import unwritable_reason, write_text_atomic

__all__ = ["main", "doctor_main"]


def _version() -> str:
    import torch

    from . import __version__

    return f"normkit {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normkit",
        description="normkit: normalization layers for PyTorch.",
        epilog="Run 'normkit <subcommand> --help' for a subcommand's options.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="{lab,quickstart,doctor,bench}",
                                title="subcommands")
    sub.add_parser(
        "lab",
        add_help=False,
        help="measure the articles' claims on real data and write report.md/report.html",
    )
    sub.add_parser(
        "quickstart",
        add_help=False,
        help="train a small CNN on scikit-learn's digits with each norm and print "
        "test accuracy, training loss and speed",
    )
    sub.add_parser(
        "doctor",
        add_help=False,
        help="run a model once on an example batch and diagnose its normalization layers",
    )
    sub.add_parser(
        "bench",
        add_help=False,
        help="time forward, forward+backward and memory of normkit's ops against torch",
    )
    return parser


_DOCTOR_EPILOG = """\
The model and batch specs are 'module:attribute', imported from the current directory
or sys.path; the attribute is a callable returning the model (or the batch), or the
model (or batch) itself.

exit status: 0 the model ran (warnings or not), 1 the model raised (the report, naming
the failing layer, is still printed), 2 usage error (bad spec, import failure).

example: normkit doctor mymodels:make_resnet --input-shape 8,3,32,32 --json report.json
"""


def _doctor_parser(prog: str) -> argparse.ArgumentParser:
    from .tools.recommend import ARCHITECTURES

    parser = argparse.ArgumentParser(
        prog=prog, epilog=_DOCTOR_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a model once on an example batch and report, per normalization "
        "layer, its mode, the number of values its statistics use, input/output "
        "statistics, running-statistics drift and gamma, with warnings and a "
        "recommendation.")
    parser.add_argument("model", metavar="MODULE:FACTORY",
                        help="a callable returning the torch.nn.Module to diagnose, e.g. "
                        "'mymodels:make_model'")
    batch = parser.add_mutually_exclusive_group(required=True)
    batch.add_argument("--input-shape", metavar="SHAPE",
                       help="run on a standard-normal batch of this shape, e.g. 8,3,32,32")
    batch.add_argument("--batch", metavar="MODULE:FUNC",
                       help="a callable returning the example batch (a tensor, a tuple whose "
                       "first element is the input, or a dict of keyword arguments)")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the report as JSON to FILE ('-': print the JSON "
                        "instead of the table)")
    parser.add_argument("--eval", action="store_true",
                        help="put the model in eval mode first (default: the mode the factory "
                        "returns it in)")
    parser.add_argument("--architecture", type=str.lower, choices=ARCHITECTURES,
                        help="architecture for the recommendation (default: inferred)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the --input-shape batch (default: 0)")
    return parser


def _load(parser: argparse.ArgumentParser, spec: str, what: str):
    """Import the object a 'module:attribute' spec names (usage error otherwise)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        parser.error(f"{what} must be 'module:attribute' (e.g. 'mymodels:make_model'), "
                     f"got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:
        parser.error(f"{what} {spec!r}: expected an importable module {module_name!r} (from "
                     f"the current directory or sys.path), got {type(exc).__name__}: {exc}")
    for part in attribute.split("."):
        if not hasattr(obj, part):
            parser.error(f"{what} {spec!r}: expected module {module_name!r} to define "
                         f"{attribute!r}, got no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _build(parser: argparse.ArgumentParser, spec: str, what: str, direct: tuple[type, ...]):
    """Load a spec; call it unless it already is one of ``direct``."""
    obj = _load(parser, spec, what)
    if isinstance(obj, direct) or not callable(obj):
        return obj
    try:
        return obj()
    except Exception as exc:
        parser.error(f"{what} {spec!r}: calling it raised {type(exc).__name__}: {exc}")


def doctor_main(argv: Sequence[str] | None = None, *, prog: str = "normkit doctor") -> int:
    """Run ``normkit doctor``; returns the exit code (0 ran, 1 the model raised).

    Usage errors (a malformed spec, an import failure, a factory that does not return
    a module) exit with code 2 through ``argparse``.

    Example:
        >>> import contextlib, io
        >>> out = io.StringIO()
        >>> with contextlib.redirect_stdout(out):
        ...     code = doctor_main(["torch.nn:Identity", "--input-shape", "4,3"])
        >>> code, out.getvalue().splitlines()[0]
        (0, 'normkit doctor: Identity (mlp), batch 4, 0 norm layers, grad enabled')
    """
    import torch

    from .tools import doctor as doctor_tool

    parser = _doctor_parser(prog)
    args = parser.parse_args(argv)
    model = _build(parser, args.model, "MODULE:FACTORY", (torch.nn.Module,))
    if not isinstance(model, torch.nn.Module):
        parser.error(f"MODULE:FACTORY {args.model!r}: expected a torch.nn.Module (or a callable "
                     f"returning one), got {type(model).__name__}")
    if args.batch is not None:
        batch = _build(parser, args.batch, "--batch", (torch.Tensor, tuple, list, dict))
    else:
        try:
            batch = doctor_tool.example_batch_from_shape(args.input_shape, seed=args.seed)
        except ValueError as exc:
            parser.error(f"--input-shape: {exc}")
    if args.eval:
        model.eval()
    if args.json not in (None, "-") and (reason := unwritable_reason(args.json)) is not None:
        parser.error(f"--json expected a file it can write, got {args.json!r}: {reason}")
    report = doctor_tool.doctor(model, batch, architecture=args.architecture)
    if args.json == "-":
        print(report.to_json())
    else:
        if args.json is not None:  # (first: a reader that stops early cannot lose it)
            write_text_atomic(args.json, report.to_json() + "\n")
        doctor_tool.print_report(report)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``normkit`` command line; returns the exit code.

    ``quickstart`` forwards every argument after it to :func:`normkit.quickstart.main`,
    ``doctor`` to :func:`doctor_main`.
    With no subcommand the usage is printed to stderr and the exit code is 2, as for
    any argparse usage error; ``--version`` prints normkit's, torch's and Python's.

    Example:
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     code = main([])
        >>> code, err.getvalue().startswith("usage: normkit")
        (2, True)
    """
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        # the reader of stdout went away (`normkit doctor ... | head`): no traceback, and
        # the exit status of a Unix tool ended by SIGPIPE; stdout now goes nowhere, so the
        # interpreter's last flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        if rest:  # (parse_known_args keeps what no subcommand took: say so)
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        parser.print_help(sys.stderr)
        return 2
    if args.command == "quickstart":
        from . import quickstart

        return quickstart.main(rest, prog=f"{parser.prog} quickstart")
    if args.command == "doctor":
        return doctor_main(rest, prog=f"{parser.prog} doctor")
    if args.command == "lab":
        from .lab import cli as lab_cli

        return lab_cli.main(rest, prog=f"{parser.prog} lab")
    if args.command == "bench":
        from .bench import cli as bench_cli

        return bench_cli.main(rest, prog=f"{parser.prog} bench")
    parser.error(f"unknown subcommand {args.command!r}")
    return 2
