"""The test suite's background jobs (``tests/background.py``), each test on a runner of its
own (the session's jobs stay untouched)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import background
import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")


#: A shell command printing the priority it runs at, and what it prints at the idle one.
if shutil.which("chrt") and sys.platform.startswith("linux"):
    _PRIORITY, _IDLE_PRIORITY = "chrt -p $$ | head -1", "SCHED_IDLE"
else:
    _PRIORITY, _IDLE_PRIORITY = "nice", "19"
_PRIORITY_TOOL = shutil.which("chrt") or shutil.which("nice")
pytestmark = [pytestmark, pytest.mark.skipif(_PRIORITY_TOOL is None, reason="no chrt or nice")]


def _shell(script: str, timeout: float = 60) -> background.Command:
    return background.Command(["bash", "-c", script], env=dict(os.environ), cwd=Path.cwd(),
                              timeout=timeout)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(path: Path, seconds: float = 20) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {seconds} s")


def test_a_started_job_runs_niced_and_its_test_reads_the_result():
    runner = background.Runner()
    try:
        runner.start({"t::a": lambda tmp: _shell(
            f"echo hi > {tmp}/out.txt; {_PRIORITY}; exit 3")})
        done = runner.result("t::a", None)
        assert done.returncode == 3
        assert (done.tmp / "out.txt").read_text() == "hi\n"
        assert _IDLE_PRIORITY in done.stdout, done.stdout
    finally:
        runner.stop()
    assert not done.tmp.exists()  # stop() removes the scratch folders


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(),
                    reason="no autogroup scheduling (Linux's sched_autogroup) here")
def test_a_started_job_gets_the_lowest_share_of_its_session_group():
    """With autogroup scheduling on, a session is a scheduling group and the job's own
    SCHED_IDLE ranks it only inside that group: the group itself must be niced."""
    runner = background.Runner()
    try:
        runner.start({"t::g": lambda tmp: _shell("sleep 0.2; cat /proc/self/autogroup")})
        done = runner.result("t::g", None)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-2:] == ["nice", "19"], done.stdout
        here = runner.result("t::h", lambda tmp: _shell("cat /proc/self/autogroup"))
        assert here.stdout.split()[-2:] == ["nice", "0"], here.stdout  # (run on the spot)
    finally:
        runner.stop()


def test_the_group_nice_is_retried_while_the_kernel_says_try_again(monkeypatch):
    """An unprivileged process may set an autogroup's nice once per 100 ms machine-wide
    (EAGAIN before, seen here as user nobody): the write is retried, not dropped."""
    writes = []

    class Proc:
        def __init__(self, path):
            self.path = path

        def write_text(self, text):
            writes.append((self.path, text))
            if len(writes) < 3:
                raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(background, "Path", Proc)
    background._lower_autogroup(1234)
    assert writes == [("/proc/1234/autogroup", "19")] * 3

    class Missing(Proc):
        def write_text(self, text):
            writes.append((self.path, text))
            raise FileNotFoundError(2, "No such file or directory")

    writes.clear()
    monkeypatch.setattr(background, "Path", Missing)
    background._lower_autogroup(1234)  # (no autogroup here: one try, no error)
    assert writes == [("/proc/1234/autogroup", "19")]


def test_a_job_not_started_runs_when_its_test_asks():
    runner = background.Runner()
    try:
        done = runner.result("t::b", lambda tmp: _shell(_PRIORITY))
        assert done.returncode == 0 and _IDLE_PRIORITY not in done.stdout  # (here)
        assert runner.result("t::c", lambda tmp: None) is None  # nothing to run
    finally:
        runner.stop()


def test_stop_ends_a_running_job_and_what_it_started():
    runner = background.Runner()
    pids = []

    def factory(tmp):
        pids.append(tmp / "pids")
        return _shell(f"sleep 120 & echo $$ $! > {tmp}/pids; wait")

    runner.start({"t::d": factory})
    try:
        while not pids:
            time.sleep(0.05)
        shell, child = map(int, _wait_for(pids[0]).split())
        assert _alive(shell) and _alive(child)
        assert os.getsid(shell) == shell == os.getpgid(child)  # a session of its own
        runner.stop()
        time.sleep(0.2)
        assert not _alive(shell) and not _alive(child)
    finally:
        runner.stop()


def test_a_job_past_its_time_limit_is_stopped_and_says_so():
    runner = background.Runner()
    try:
        done = runner.result("t::e", lambda tmp: _shell(
            f"sleep 120 & echo $! > {tmp}/pid; wait", timeout=1))
        child = int((done.tmp / "pid").read_text())
        assert done.returncode == -9
        assert "[background job stopped after 1 s]" in done.stderr
        time.sleep(0.2)
        assert not _alive(child)
    finally:
        runner.stop()
