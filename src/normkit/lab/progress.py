"""Progress bars for runs and steps: rich when it is installed, else one plain line.

``make_progress("auto", total_runs)`` returns a :class:`RichProgress` when ``rich`` is
importable and stderr is a terminal, a :class:`PlainProgress` otherwise (a line per
finished run, and on a terminal a line rewritten in place as steps advance), or a
:class:`NullProgress` for ``"none"``.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> bar = PlainProgress(2, stream=out)
    >>> bar.start_run("inputs/scale=raw/seed=0")
    >>> bar.step(5, 10)
    >>> bar.end_run(ok=True)
    >>> bar.close()
    >>> out.getvalue().splitlines()[-1]
    '[1/2] inputs/scale=raw/seed=0 done'
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["KINDS", "NullProgress", "PlainProgress", "RichProgress", "make_progress"]

KINDS = ("auto", "rich", "plain", "none")


class NullProgress:
    """Shows nothing."""

    def start_run(self, label: str) -> None:
        """A run begins."""

    def step(self, done: int, total: int) -> None:
        """The current run has done ``done`` of ``total`` steps."""

    def end_run(self, ok: bool) -> None:
        """The current run ended (``ok``: it finished without an error)."""

    def close(self) -> None:
        """Everything ended."""


class PlainProgress(NullProgress):
    """A text line per finished run; on a terminal, a step line rewritten in place."""

    def __init__(self, total_runs: int, stream: TextIO | None = None) -> None:
        self.total, self.done = total_runs, 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = ""
        self.last = 0.0

    def start_run(self, label: str) -> None:
        """Remember the run's label."""
        self.label = label
        self.last = 0.0

    def step(self, done: int, total: int) -> None:
        """Rewrite the step line (on a terminal, at most 5 times a second)."""
        now = time.monotonic()
        if self.tty and (now - self.last > 0.2 or done == total):
            self.last = now
            self.stream.write(f"\r[{self.done + 1}/{self.total}] {self.label} "
                              f"step {done}/{total}\x1b[K")
            self.stream.flush()

    def end_run(self, ok: bool) -> None:
        """Print one line for the finished run."""
        self.done += 1
        prefix = "\r\x1b[K" if self.tty else ""
        self.stream.write(f"{prefix}[{self.done}/{self.total}] {self.label} "
                          f"{'done' if ok else 'FAILED'}\n")
        self.stream.flush()


class RichProgress(NullProgress):
    """Two rich progress bars: runs, and steps of the current run."""

    def __init__(self, total_runs: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=False)
        self.bar.start()
        self.runs = self.bar.add_task("runs", total=total_runs)
        self.steps = self.bar.add_task("", total=1, visible=False)

    def start_run(self, label: str) -> None:
        """Reset the step bar for a new run."""
        self.bar.update(self.steps, description=f"  {label}", completed=0, total=1,
                        visible=True)

    def step(self, done: int, total: int) -> None:
        """Advance the step bar."""
        self.bar.update(self.steps, completed=done, total=total)

    def end_run(self, ok: bool) -> None:
        """Advance the run bar (and say so when the run failed)."""
        self.bar.advance(self.runs)
        if not ok:
            label = self.bar.tasks[self.steps].description
            self.bar.console.print(f"[red]run failed:[/red] {label}")

    def close(self) -> None:
        """Hide the step bar and stop the display."""
        self.bar.update(self.steps, visible=False)
        self.bar.stop()


def make_progress(kind: str, total_runs: int) -> NullProgress:
    """A progress display of ``kind`` (``auto``, ``rich``, ``plain`` or ``none``).

    Example:
        >>> type(make_progress("none", 3)).__name__
        'NullProgress'
    """
    if kind not in KINDS:
        raise ValueError(f"progress must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "none" or total_runs == 0:
        return NullProgress()
    if kind in ("auto", "rich"):
        try:
            import rich  # noqa: F401
        except ImportError:
            if kind == "rich":
                raise ValueError("progress 'rich' needs the rich package (pip install rich)") \
                    from None
            return PlainProgress(total_runs)
        if kind == "rich" or sys.stderr.isatty():
            return RichProgress(total_runs)
    return PlainProgress(total_runs)
