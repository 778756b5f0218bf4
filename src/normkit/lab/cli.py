"""The ``normkit lab`` command line.

Usage::

    normkit lab [--profile quick] [--seed 0] [--out normkit-lab] [--force]
    normkit lab list
    normkit lab run NAME... [--profile P] [--seed S] [--out DIR] [--force]
    normkit lab report DIR
    normkit lab compare --model pkg.module:make_model --data pkg.module:make_loaders \\
        --norms bn,gn,ln,none --batch-sizes 32,8,2

With no subcommand, every experiment runs with the quick profile and the report is
written. Runs already recorded in the output folder are skipped (``--force`` reruns
them); each finished run is on disk at once, so an interrupted command resumes where it
stopped. Under ``torchrun --nproc_per_node N -m normkit lab ...`` the runs are sharded
over the ranks (gloo) and rank 0 writes one report, the same as a single process with
the same seeds and ``--threads`` (default 1 everywhere) gives.

Example:
    >>> import contextlib, io
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     code = main(["list"])
    >>> code, out.getvalue().split()[0]
    (0, 'inputs')
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from .._files import unwritable_folder_reason

__all__ = ["main", "build_parser"]

_EPILOG = """\
subcommands:
  (none)    run every experiment (quick profile) and write the report
  list      list the experiments and their claims
  run       run the named experiments ('all' for every one) and write the report
  report    write report.md and report.html from an output folder's records
  compare   swap the norm layers of your model and compare them at several batch sizes

'normkit lab SUBCOMMAND --help' shows a subcommand's options.
exit status: 0 done, 1 some runs failed (the report marks what is missing), 2 usage error.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _comma_list(kind, what: str):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, "
                                             f"got {text!r}")
        return [kind(t) for t in items]
    return parse


def _add_run_options(parser: argparse.ArgumentParser, out_default: str,
                     profile: bool = True) -> None:
    from .core import DEFAULT_PROFILE, PROFILES
    from .progress import KINDS

    if profile:
        parser.add_argument("--profile", choices=PROFILES, default=DEFAULT_PROFILE,
                            help="tiny (tests), quick (default: all experiments in a few "
                            "minutes on 2 cores) or full (more seeds and steps)")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed; runs use seed, seed+1, ... (default: 0)")
    parser.add_argument("--out", default=out_default,
                        help=f"output folder for results.jsonl and the report "
                        f"(default: {out_default})")
    parser.add_argument("--force", action="store_true",
                        help="rerun runs that already have a record in the output folder")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch CPU threads per process (default: 1: the lab's small "
                        "networks are overhead-bound, and extra threads slow them down on a "
                        "busy machine); results depend on it, so compare runs made with the "
                        "same value")
    parser.add_argument("--progress", choices=KINDS, default="auto",
                        help="progress display: rich bars, plain text lines, or none "
                        "(default: auto)")


def build_parser(prog: str = "normkit lab") -> argparse.ArgumentParser:
    """The argument parser of ``normkit lab`` (subcommands list, run, report, compare)."""
    parser = argparse.ArgumentParser(
        prog=prog, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure the articles' claims about normalization on real data (digits, "
        "synthetic tasks; no download) and write a report with figures, the measured BN-vs-LN "
        "table and a verdict per claim.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    sub.add_parser("list", help="list the experiments and their claims")
    run = sub.add_parser("run", help="run experiments and write the report")
    run.add_argument("names", nargs="*", metavar="NAME",
                     help="experiments to run (default: all; see 'normkit lab list')")
    _add_run_options(run, "normkit-lab")
    report = sub.add_parser("report", help="write the report of an output folder")
    report.add_argument("dir", metavar="DIR", help="an output folder of 'normkit lab'")
    compare = sub.add_parser(
        "compare", help="compare norms on your own model and data",
        description="Swap the normalization layers of your model (normkit.convert_norms) for "
        "each of --norms, train each variant on your data at each of --batch-sizes with the "
        "same budget, and write a report with a recommendation.")
    compare.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                         help="a callable returning your torch.nn.Module (with norm layers)")
    compare.add_argument("--data", required=True, metavar="MODULE:FACTORY",
                         help="a callable make_loaders(batch_size[, seed=]) returning "
                         "(train_loader, test_loader) of (input, target) batches")
    compare.add_argument("--norms", type=_comma_list(str, "norm names"), default=None,
                         help="norm families to compare (default: those of "
                         f"{','.join(AUTO_NORMS)} that every norm layer of the model can "
                         "take: bn,gn,ln,none for a CNN, ln,rms,none for a Transformer)")
    compare.add_argument("--batch-sizes", type=_comma_list(_positive_int, "batch sizes"),
                         default=[32, 8, 2], help="batch sizes (default: 32,8,2)")
    compare.add_argument("--epochs", type=_positive_int, default=3,
                         help="epochs per variant, the same for all (default: 3)")
    compare.add_argument("--lr", type=_positive_float, default=0.05,
                         help="learning rate at the largest batch size (default: 0.05)")
    compare.add_argument("--no-lr-scaling", action="store_true",
                         help="use --lr at every batch size instead of scaling it linearly")
    compare.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                         help="sgd (momentum 0.9) or adam (default: sgd)")
    compare.add_argument("--seeds", type=_positive_int, default=2,
                         help="seeds per variant (default: 2)")
    _add_run_options(compare, "normkit-lab-compare", profile=False)
    return parser


def _list() -> int:
    from .experiments import EXPERIMENTS

    for e in EXPERIMENTS:
        runs = {p: len(e.plan(p, 0)) for p in e.settings}
        print(f"{e.name:<17} {e.title} (runs: "
              + ", ".join(f"{p} {n}" for p, n in runs.items()) + ")")
        for cid, statement, source in e.claims:
            print(f"    {cid}: {statement} [{source}]")
    return 0


def _print_summary(result, started: float) -> None:
    claims = result.claims
    if claims:
        print("Verdicts:")
        for c in claims:
            counts = c.counts()
            print(f"  {c.verdict:>14}  {c.id}  ({counts['supports']}/{len(c.checks)} checks "
                  "support)")
    for problem in result.problems:
        print(f"  note: {problem}")
    print(f"Report: {result.markdown} and {result.html} ({len(result.figures)} figure(s)); "
          f"wall time {time.perf_counter() - started:.1f} s")


def _run(experiments, args, parser, manifest_extra=None, title="normkit lab report") -> int:
    import torch

    from .report import write_report
    from .runner import Distributed, run_plan

    reason = unwritable_folder_reason(args.out)
    if reason is not None:
        parser.error(f"--out expected an output folder it can write, got {args.out!r}: "
                     f"{reason}")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    try:
        dist_ctx = Distributed.from_env()
    except RuntimeError as exc:
        parser.error(str(exc))
    try:
        outcome = run_plan(experiments, getattr(args, "profile", "quick"), args.seed, args.out,
                           force=args.force, progress=args.progress,
                           manifest_extra=manifest_extra, distributed=dist_ctx)
    finally:
        dist_ctx.close()
    if not outcome.is_main:
        return 1 if outcome.failed else 0
    result = write_report(args.out, title=title)
    _print_summary(result, started)
    if outcome.failed:
        print(f"{len(outcome.failed)} run(s) failed (tracebacks above): "
              + ", ".join(outcome.failed), file=sys.stderr)
        return 1
    return 0


#: The families ``lab compare`` tries when ``--norms`` is not given, in report order.
AUTO_NORMS = ("bn", "gn", "ln", "rms", "none")


def _compare(args, parser) -> int:
    from .compare import CompareExperiment, build_variant, call_loaders

    if args.norms is None:  # every family the model's norm layers can all become
        fits, reasons = [], []
        for norm in AUTO_NORMS:
            try:
                build_variant(args.model, norm, args.seed)
                fits.append(norm)
            except ValueError as exc:
                reasons.append(str(exc))
        if fits in ([], ["none"]):
            parser.error("--norms: no family fits every norm layer of the model: "
                         + "; ".join(dict.fromkeys(reasons)))
        args.norms = fits
        print(f"normkit lab compare: comparing {', '.join(fits)} (the families every norm "
              f"layer of the model can take; --norms to choose)", flush=True)
    experiment = CompareExperiment(args.model, args.data, args.norms, args.batch_sizes,
                                   epochs=args.epochs, lr=args.lr, optimizer=args.optimizer,
                                   seeds=args.seeds, scale_lr=not args.no_lr_scaling)
    problems = []
    for norm in args.norms:  # fail early, in the caller's terms, before any training
        try:
            build_variant(args.model, norm, args.seed)
        except ValueError as exc:
            problems.append(f"--norms {norm!r}: {exc}")
    try:
        call_loaders(args.data, args.batch_sizes[0], args.seed)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        parser.error("; ".join(problems))
    return _run([experiment], args, parser, {"compare": {"options": experiment.options}},
                title="normkit lab compare report")


def main(argv: Sequence[str] | None = None, prog: str = "normkit lab") -> int:
    """Run ``normkit lab``; returns the exit status (0 done, 1 runs failed, 2 usage).

    ``argv`` are the arguments after ``normkit lab`` (default: ``sys.argv[1:]``); with no
    subcommand (or only options) it means ``run`` of every experiment.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    try:
        return _main(argv, prog)
    except SystemExit as exc:  # argparse usage errors and --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def _main(argv: list[str], prog: str) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list()
    if args.command == "report":
        from .report import write_report

        started = time.perf_counter()
        try:
            result = write_report(args.dir)
        except FileNotFoundError as exc:
            parser.error(str(exc))
        _print_summary(result, started)
        return 0
    if args.command == "compare":
        return _compare(args, parser)
    from .experiments import EXPERIMENTS, get_experiment

    names = args.names or ["all"]
    if "all" in names:
        experiments = list(EXPERIMENTS)
    else:
        try:
            experiments = [get_experiment(n) for n in dict.fromkeys(names)]
        except ValueError as exc:
            parser.error(str(exc))
    return _run(experiments, args, parser)
