"""``normkit bench``: the benchmark's command line (also ``python -m normkit.bench``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence

from .._files import unwritable_reason, write_text_atomic
from . import compare
from .ops import EXTERNALS, OPS, SHAPE_SETS, get_op, op_names
from .report import to_json, to_markdown
from .runner import BENCH_BACKENDS, DTYPES, INPUTS, BenchConfig, errors, plan, run
from .targets import markdown_lines

__all__ = ["main", "build_parser"]

_EPILOG = """\
Ops (default: every op available here): {ops}.
Fused ops come from normkit.norms.fused and are skipped while it lacks them.

Shapes: 'standard' (transformer rows 4096 x 768/1024/4096/8192, CNN activations
32x64x56x56 and 32x256x14x14 in NCHW and channels_last, small odd shapes 7x33 and
3x5x7x9), 'small' (a reduced set for quick runs), or a comma list such as
4096x1024,32x64x56x56:cl (':cl' = channels_last). 2- or 3-dim shapes feed the
row ops (layer_norm, rms_norm, add_*), 4-dim ones the image ops.

Output: the Markdown table on stdout (progress on stderr); --json and --markdown
also write files ('--json -' prints the JSON instead of the table). Ratios are
torch eager time / implementation time measured in the same process (> 1: faster
than torch). Time is never asserted anywhere: read the numbers on a quiet machine.

exit status: 0 every implementation ran, 1 some failed (listed in the report),
2 usage error.

example: normkit bench layer_norm rms_norm --threads 1,2 --json bench.json

A change, before and after (each side's runs pooled; run them alternated):
  normkit bench --compare before-1.json before-2.json --to after-1.json after-2.json
"""


def _threads(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or a comma list such as 1,2, got {text!r}")
    return tuple(dict.fromkeys(values))


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _check_outputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error, before anything is measured, for an output file that cannot be
    written or that would overwrite another output or an input of this command."""
    outputs = [(option, path) for option, path in (("--json", args.json),
                                                   ("--markdown", args.markdown))
               if path is not None and path != "-"]
    for option, path in outputs:
        reason = unwritable_reason(path)
        if reason is not None:
            parser.error(f"{option} expected a file it can write, got {path!r}: {reason}")
    inputs = {os.path.realpath(path)
              for path in [*(args.summarize or ()), *(args.compare or ()), *(args.to or ())]}
    written: dict[str, str] = {}
    for option, path in outputs:
        real = os.path.realpath(path)
        if real in inputs:
            parser.error(f"{option} expected a file other than this command's inputs, got "
                         f"{path!r}, one of them: writing it would overwrite that run")
        if real in written:
            parser.error(f"{written[real]} and {option} name the same file {path!r}: one "
                         "would overwrite the other")
        written[real] = option


def _load_runs(paths: Sequence[str], option: str,
               parser: argparse.ArgumentParser) -> list[dict]:
    """The saved runs (``--json`` files) at ``paths``; a usage error names the bad one."""
    docs = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                doc = json.load(handle)
        except (OSError, ValueError) as error:
            parser.error(f"{option} could not read {path}: {error}")
        if not isinstance(doc, dict) or "results" not in doc or "environment" not in doc:
            parser.error(f"{option} expected the JSON of a normkit bench run (--json), got "
                         f"{path} without 'results' and 'environment'")
        docs.append(doc)
    return docs


def _compare(before: Sequence[str], after: Sequence[str] | None, changed_only: bool,
             parser: argparse.ArgumentParser) -> str:
    """The rows of saved runs before and after a change, side by side (``--compare``)."""
    if not after:
        parser.error("--compare BEFORE.json ... needs --to AFTER.json ...: the runs after "
                     "the change")
    try:
        lines = compare.markdown_lines(_load_runs(before, "--compare", parser),
                                       _load_runs(after, "--to", parser),
                                       changed_only=changed_only)
    except ValueError as error:
        parser.error(str(error))
    return "\n".join(lines) + "\n"


def _summarize(paths: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The targets' verdicts over saved runs, pooled (``--summarize``)."""
    docs = _load_runs(paths, "--summarize", parser)
    lines = markdown_lines(docs)
    if not lines:
        return "No issue #6 target covers these runs.\n"
    sources = ", ".join(path + (f" (interrupted {doc['interrupted']}: partial)"
                                if doc.get("interrupted") else "")
                        for path, doc in zip(paths, docs, strict=True))
    return "\n".join(lines) + f"\n\nRuns: {sources}.\n"


def build_parser(prog: str = "normkit bench") -> argparse.ArgumentParser:
    """The argument parser of ``normkit bench``."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG.format(ops=", ".join(op_names())),
        description="Measure forward, forward+backward and peak memory of normkit's "
        "normalization ops\nagainst torch eager in the same process (and torch.compile, "
        "Liger-Kernel and apex\nwhere available): median ms, GB/s, % of this machine's copy "
        "bandwidth and the\nratio to torch.")
    parser.add_argument("ops", nargs="*", metavar="OP", help="ops to run (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="device (default: cpu)")
    parser.add_argument("--threads", type=_threads, default=(1,), metavar="N[,N...]",
                        help="CPU threads (torch.set_num_threads); a list runs the set once per "
                        "count (default: 1)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="dtype of inputs and modules (default: float32)")
    parser.add_argument("--param-dtype", choices=tuple(DTYPES), default=None,
                        help="dtype of the modules when not --dtype: float32 with a 16-bit "
                        "--dtype times mixed precision as torch.autocast runs it (default: "
                        "--dtype)")
    parser.add_argument("--shapes", default="standard", metavar="standard|small|SPEC",
                        help="shape set or comma list of shapes (default: standard)")
    parser.add_argument("--input", choices=tuple(INPUTS), default="randn",
                        help="randn: well-conditioned (normkit keeps torch's fused kernels "
                        "where accurate); offset: randn + 100 (normkit's compensated path) "
                        "(default: randn)")
    parser.add_argument("--repeats", type=int, default=15, metavar="R",
                        help="timed rounds per pass (default: 15)")
    parser.add_argument("--warmup", type=int, default=3, metavar="W",
                        help="untimed calls per implementation first (default: 3)")
    parser.add_argument("--min-time", type=float, default=2e-3, metavar="S",
                        help="seconds one measurement lasts at least; calls repeat to reach it "
                        "(default: 0.002)")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile of the torch module and of normkit's, "
                        "reporting their first-call (compile) time separately")
    parser.add_argument("--copy-mib", type=int, default=256, metavar="MIB",
                        help="buffer size for the copy-bandwidth yardstick (default: 256)")
    parser.add_argument("--flush-mib", type=int, default=None, metavar="MIB",
                        help="MiB written before every timed call, untimed, so that inputs "
                        "come from memory, not the cache (default: 256 on cuda, 0 on cpu)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="CUDA: time each call captured in a CUDA graph and replayed -- "
                             "the kernels' time without the host's, for every implementation")
    parser.add_argument("--backend", choices=BENCH_BACKENDS, default="auto",
                        help="backend of normkit's modules: auto (as users get them), eager "
                        "(the compensated statistics everywhere) or triton (normkit's Triton "
                        "kernels on CUDA, also for the ops whose auto runs torch's there) "
                        "(default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    parser.add_argument("--peak-gbs", type=_positive, default=None, metavar="GB/S",
                        help="the device's nominal memory bandwidth, for the targets stated "
                        "as a %% of peak (e.g. 4800 for an H200)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="measure nothing: print the targets' verdicts over these saved "
                        "runs (--json files), pooled")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="measure nothing: compare saved runs before a change with "
                             "those after it (--to), row by row: the ratio's range on each "
                             "side and whether the ranges overlap")
    parser.add_argument("--to", nargs="+", metavar="JSON",
                        help="with --compare: the saved runs after the change")
    parser.add_argument("--changed-only", action="store_true",
                        help="with --compare: only the rows whose ranges do not overlap")
    parser.add_argument("--json", metavar="FILE",
                        help="write the results as JSON ('-': print it instead of the table)")
    parser.add_argument("--markdown", metavar="FILE", help="write the Markdown table to FILE")
    parser.add_argument("--list", action="store_true",
                        help="list the ops, their baselines and the implementations, then exit")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


class _Progress:
    """A rich progress bar on a terminal, else one plain line per finished pass (stderr)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.bar, self.task = enabled, None, None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        console = Console(stderr=True)
        if console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=console)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)
            return
        if self.task is None:
            self.task = self.bar.add_task(label, total=total)
        self.bar.update(self.task, completed=done, description=label)


def _list_text(device: str) -> str:
    lines = ["op | kind | normkit | torch baseline | status", "---|---|---|---|---"]
    for op in OPS:
        reason = op.available()
        lines.append(f"{op.name} | {op.kind} | {op.normkit_doc} | {op.baseline_doc} | "
                     f"{'available' if reason is None else reason}")
    lines.append("")
    lines.append("implementations: torch (eager, the reference), normkit, torch.compile and "
                 "normkit.compile (--compile)")
    for ext in EXTERNALS:
        reason = ext.status(device)
        covers = ", ".join(ext.classes)
        lines.append(f"  {ext.name} ({covers}): {'available' if reason is None else reason}")
    sets = ", ".join(f"{name} ({len(shapes)} shapes)" for name, shapes in SHAPE_SETS.items())
    lines.append(f"shape sets: {sets}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "normkit bench") -> int:
    """Run ``normkit bench``; returns the exit code (0 all ran, 1 some implementation failed,
    3 interrupted by Ctrl-C or SIGTERM: the passes measured so far are still printed and
    written, marked as interrupted).

    Usage errors (an unknown op, whose message lists the valid ones, a bad shape, an
    unavailable device) exit with code 2 through ``argparse``.

    Example:
        >>> import contextlib, io
        >>> out = io.StringIO()
        >>> with contextlib.redirect_stdout(out):
        ...     code = main(["layer_norm", "--shapes", "4x8", "--repeats", "2", "--warmup",
        ...                  "0", "--min-time", "0", "--copy-mib", "1", "--quiet"])
        >>> code, "| op | shape | layout | pass | torch ms | normkit ms |" in out.getvalue()
        (0, True)
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(args_list)
    if args.list:
        print(_list_text(args.device))
        return 0
    if args.summarize:
        print(_summarize(args.summarize, parser), end="")
        return 0
    if args.compare or args.to:
        if not args.compare:
            parser.error("--to needs --compare BEFORE.json ...: the runs before the change")
        _check_outputs(args, parser)
        text = _compare(args.compare, args.to, args.changed_only, parser)
        print(text, end="")
        if args.markdown is not None:
            write_text_atomic(args.markdown, text)
        return 0
    for name in args.ops:
        try:
            op = get_op(name)
        except KeyError:
            parser.error(f"unknown op {name!r}; valid ops: {', '.join(op_names())}")
        reason = op.available()
        if reason is not None:
            parser.error(f"op {name!r} is not available here: {reason}")
    try:
        config = BenchConfig(ops=tuple(dict.fromkeys(args.ops)), device=args.device,
                             threads=args.threads, dtype=args.dtype,
                             param_dtype=args.param_dtype, shapes=args.shapes,
                             input=args.input, repeats=args.repeats, warmup=args.warmup,
                             min_time=args.min_time, compile=args.compile,
                             copy_mib=args.copy_mib, seed=args.seed,
                             flush_mib=args.flush_mib, cuda_graphs=args.cuda_graphs,
                             backend=args.backend)
    except ValueError as error:
        parser.error(str(error))
    cases, skipped = plan(config)
    if not cases:
        reasons = "; ".join(f"{item['op']}: {item['reason']}" for item in skipped)
        parser.error(f"nothing to run with --shapes {args.shapes!r}: {reasons}")
    _check_outputs(args, parser)
    command = " ".join([prog, shlex.join(args_list)]).strip()
    with _Progress(not args.quiet) as progress, _sigterm_interrupts():
        doc = run(config, command=command, progress=progress)
    doc["environment"]["peak_bandwidth_gbs"] = args.peak_gbs
    markdown = to_markdown(doc)
    if args.json == "-":
        print(to_json(doc))
    else:
        print(markdown, end="")
        if args.json is not None:
            write_text_atomic(args.json, to_json(doc) + "\n")
    if args.markdown is not None:
        write_text_atomic(args.markdown, markdown)
    if doc.get("interrupted"):
        print(f"normkit bench: interrupted {doc['interrupted']}; the passes measured so far "
              "were written", file=sys.stderr)
        return 3
    return 1 if errors(doc) else 0


@contextlib.contextmanager
def _sigterm_interrupts():
    """Within the block, SIGTERM (``timeout``, a job scheduler) raises KeyboardInterrupt,
    so :func:`normkit.bench.runner.run` returns the passes measured so far and they are
    written; the previous handler is restored after it (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
