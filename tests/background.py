"""Slow subprocess checks, started once pytest has collected them, run beside the rest.

A few tests only wait on a child process for most of a minute (the Triton suite rerun in a
fresh process, the GPU check's dry run), which leaves one of a CI machine's two cores idle
while this process waits. Such a test names its command with :func:`job`; right after
collection ``conftest.py`` hands every collected job to :func:`start`, which runs them one
after another in a thread, niced, so they use the core this process leaves idle and yield
it when this process needs both. The test then calls :func:`result`, which waits for its
job (or runs it on the spot where none was started: a test run by itself, or
``NORMKIT_TEST_BACKGROUND=0``, which starts none); the child's work and checks are the
same either way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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
_JOBS: dict[str, _Job] = {}
_STOP = threading.Event()
_LOCK = threading.Lock()


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
    return os.environ.get("NORMKIT_TEST_BACKGROUND", "1").strip() not in ("0", "")


def start(jobs: dict[str, Callable[[Path], Command | None]]) -> None:
    """Run ``jobs`` (test node id -> factory) one after another in a daemon thread."""
    queued = []
    for nodeid, factory in jobs.items():
        if nodeid not in _JOBS:
            _JOBS[nodeid] = _Job(factory, Path(tempfile.mkdtemp(prefix="normkit-bg-")))
            queued.append(_JOBS[nodeid])
    if queued:
        threading.Thread(target=_run_all, args=(queued,), name="normkit-background",
                         daemon=True).start()


def _run_all(jobs: list[_Job]) -> None:
    for j in jobs:
        if not _STOP.is_set():
            _run(j, nice=True)
        j.done.set()


def _run(j: _Job, nice: bool) -> None:
    command = j.factory(j.tmp)
    if command is None:
        return
    began = time.perf_counter()
    out, err = j.tmp / "job-stdout.txt", j.tmp / "job-stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr, _LOCK:
        if _STOP.is_set():
            return
        # (niced, by nice(1) rather than a preexec_fn, which is unsafe in a process with
        # threads: a child that competes with this process for a core slows both)
        niced = ["nice", "-n", "10"] if nice and shutil.which("nice") else []
        j.process = subprocess.Popen([*niced, *command.argv], cwd=command.cwd,
                                     env=command.env, stdout=stdout, stderr=stderr, text=True)
    try:
        code = j.process.wait(timeout=command.timeout)
    except subprocess.TimeoutExpired:
        j.process.kill()
        j.process.wait()
        code = None
    seconds = time.perf_counter() - began
    stderr_text = err.read_text()
    if code is None:
        stderr_text += f"\n[background job stopped after {command.timeout:.0f} s]"
        code = -9
    j.result = Result(code, out.read_text(), stderr_text, j.tmp, seconds)


def result(nodeid: str, factory: Callable[[Path], Command | None]) -> Result | None:
    """The finished child of test ``nodeid`` (``None``: its factory had nothing to run).
    Waits for a started job; runs it here where none was started."""
    j = _JOBS.get(nodeid)
    if j is None:
        j = _JOBS[nodeid] = _Job(factory, Path(tempfile.mkdtemp(prefix="normkit-bg-")))
        _run(j, nice=False)
        j.done.set()
    j.done.wait()
    return j.result


def stop() -> None:
    """Stop the jobs still running or queued and remove every job's scratch folder."""
    _STOP.set()
    with _LOCK:
        for j in _JOBS.values():
            if j.process is not None and j.process.poll() is None:
                j.process.kill()
                j.process.wait()
    for j in _JOBS.values():
        shutil.rmtree(j.tmp, ignore_errors=True)
    _JOBS.clear()
