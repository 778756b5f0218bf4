"""Slow subprocess checks, started once pytest has collected them, run beside the rest.

A few tests only wait on a child process for most of a minute (the Triton suite rerun in a
fresh process, the GPU check's dry run), which leaves one of a CI machine's two cores idle
while this process waits. Such a test names its command with :func:`job`; right after
collection ``conftest.py`` hands every collected job to :func:`start`, which runs them one
after another in a thread at the idle priority (Linux's SCHED_IDLE, else niced; with the
session's autogroup niced too, see :func:`_lower_autogroup`), so they
use the core this process leaves idle and yield it when this process needs both. The test
then calls :func:`result`, which waits for its job (or runs it on the spot where none was
started: a test run by itself, or ``NORMKIT_TEST_BACKGROUND=0``, which starts none); the
child's work and checks are the same either way. At the session's end :func:`stop` stops
what still runs, with the processes it started (``tests/test_background.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Command:
    """A child process: ``argv`` run in ``cwd`` with ``env``, stopped after ``timeout`` s."""
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    timeout: float


@dataclass
class Result:
    """What the child did: its exit status and output, and the scratch folder it wrote
    into (``tmp``; the job's factory built the command for it)."""
    returncode: int
    stdout: str
    stderr: str
    tmp: Path
    seconds: float


@dataclass
class _Job:
    factory: Callable[[Path], Command | None]
    tmp: Path
    done: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None
    process: subprocess.Popen | None = None


_ATTRIBUTE = "_normkit_background_job"


def job(factory: Callable[[Path], Command | None]):
    """Decorate a test with the ``factory`` of its child process: ``factory(tmp)`` returns
    the :class:`Command` to run with ``tmp`` as its scratch folder, or ``None`` where the
    test has nothing to run (it then skips by itself)."""
    def mark(test):
        setattr(test, _ATTRIBUTE, factory)
        return test
    return mark


def factory_of(test) -> Callable[[Path], Command | None] | None:
    return getattr(test, _ATTRIBUTE, None)


def enabled() -> bool:
    """Whether jobs start right after collection (not on Windows, nor where
    ``NORMKIT_TEST_BACKGROUND=0``)."""
    return (os.name == "posix"
            and os.environ.get("NORMKIT_TEST_BACKGROUND", "1").strip() not in ("0", ""))


class Runner:
    """Jobs by test node id: started in a thread (:meth:`start`), waited for or run on the
    spot (:meth:`result`), stopped (:meth:`stop`). The session has one (:data:`RUNNER`)."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def start(self, jobs: dict[str, Callable[[Path], Command | None]]) -> None:
        """Run ``jobs`` (test node id -> factory) one after another in a daemon thread."""
        queued = [self._add(nodeid, factory) for nodeid, factory in jobs.items()
                  if nodeid not in self._jobs]
        if queued:
            threading.Thread(target=self._run_all, args=(queued,), name="normkit-background",
                             daemon=True).start()

    def result(self, nodeid: str, factory: Callable[[Path], Command | None]) -> Result | None:
        """The finished child of test ``nodeid`` (``None``: its factory had nothing to
        run). Waits for a started job; runs it here where none was started."""
        j = self._jobs.get(nodeid)
        if j is None:
            j = self._add(nodeid, factory)
            self._run(j, nice=False)
            j.done.set()
        j.done.wait()
        return j.result

    def stop(self) -> None:
        """Stop the jobs still running or queued, with every process they started, and
        remove every job's scratch folder."""
        self._stopped.set()
        with self._lock:
            for j in self._jobs.values():
                if j.process is not None and j.process.poll() is None:
                    _kill(j.process)
        for j in self._jobs.values():
            shutil.rmtree(j.tmp, ignore_errors=True)
        self._jobs.clear()

    def _add(self, nodeid: str, factory: Callable[[Path], Command | None]) -> _Job:
        j = self._jobs[nodeid] = _Job(factory, Path(tempfile.mkdtemp(prefix="normkit-bg-")))
        return j

    def _run_all(self, jobs: list[_Job]) -> None:
        for j in jobs:
            if not self._stopped.is_set():
                self._run(j, nice=True)
            j.done.set()

    def _run(self, j: _Job, nice: bool) -> None:
        command = j.factory(j.tmp)
        if command is None:
            return
        began = time.perf_counter()
        out, err = j.tmp / "job-stdout.txt", j.tmp / "job-stderr.txt"
        with open(out, "w") as stdout, open(err, "w") as stderr, self._lock:
            if self._stopped.is_set():
                return
            # (at the idle priority, chrt(1)'s SCHED_IDLE, else nice(1); by a command
            # rather than a preexec_fn, which is unsafe in a process with threads: the job
            # gets only what this process leaves idle -- niced alone, its torch threads took
            # their share from this process's, which made two-thread tests here up to 28x
            # slower in one full run; a session of its own: stopping it stops what it
            # started too, gpu_check.sh's python processes, and the terminal's Ctrl-C
            # reaches only this process; and that session's autogroup niced, or the
            # idle priority counts only inside it)
            niced = _IDLE if nice else []
            j.process = subprocess.Popen([*niced, *command.argv], cwd=command.cwd,
                                         env=command.env, stdout=stdout, stderr=stderr,
                                         text=True, start_new_session=True)
            if nice:
                _lower_autogroup(j.process.pid)
        try:
            code = j.process.wait(timeout=command.timeout)
        except subprocess.TimeoutExpired:
            _kill(j.process)
            code = None
        if self._stopped.is_set():  # (stop() removes the scratch folder)
            return
        stderr_text = err.read_text()
        if code is None:
            stderr_text += f"\n[background job stopped after {command.timeout:g} s]"
            code = -9
        j.result = Result(code, out.read_text(), stderr_text, j.tmp,
                          time.perf_counter() - began)


#: The command prefix that runs a job at the idle priority (empty: none available).
_IDLE = (["chrt", "--idle", "0"] if shutil.which("chrt") and sys.platform.startswith("linux")
         else ["nice", "-n", "19"] if shutil.which("nice") else [])


def _lower_autogroup(pid: int) -> None:
    """Give the new session of process ``pid`` the lowest CPU share among sessions.

    Where Linux's autogroup scheduling is on (``/proc/sys/kernel/sched_autogroup_enabled``)
    a new session is a scheduling group of its own, which the CPU is shared between as
    between equals: the SCHED_IDLE of the processes inside ranks them only within their
    group. Without this the job's group took half of a core the suite's second thread
    needed (four two-thread tests overlapping the Triton job ran 5-6x slower, about 55 s
    of a full run). The group's nice value of 19 is what ``/proc/<pid>/autogroup`` takes;
    raising it needs no privilege, but the kernel takes such a write from an unprivileged
    process once per 100 ms machine-wide (EAGAIN before): retried for up to 2 s.
    Elsewhere there is no such file and nothing to do.
    """
    path, end = Path(f"/proc/{pid}/autogroup"), time.monotonic() + 2.0
    while True:
        try:
            path.write_text("19")
            return
        except BlockingIOError:  # (EAGAIN: another autogroup write in the last 100 ms)
            if time.monotonic() > end:
                return
            time.sleep(0.02)
        except OSError:  # (no autogroup here, or the child is already gone)
            return


def _kill(process: subprocess.Popen) -> None:
    """Stop ``process`` and every process of its session (the job's children too)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(process.pid, signal.SIGKILL)
        else:  # (Windows: no process groups to stop)
            process.kill()
    except ProcessLookupError:  # (already gone, with everything it started)
        pass
    process.wait()


#: The test session's jobs (``conftest.py``).
RUNNER = Runner()
start, result, stop = RUNNER.start, RUNNER.result, RUNNER.stop
