"""First touch of a fresh huge-page buffer by one thread or several (``kernels.memory``).

normkit advises its large fresh outputs ``MADV_HUGEPAGE`` (``kernels.memory.out_like``).
This script times what the first write of such a buffer costs, the way a training step
meets it: a fresh 64 MiB buffer filled between two plain 64 MiB allocations (the
backward's gradients, say), freed each round, for each thread count and each way:

* ``plain``: no advice (4 KiB pages, faulted by the filling kernel's threads);
* ``advised``: ``MADV_HUGEPAGE`` only, the filling kernel's threads fault the 2 MiB pages;
* ``faulted``: ``MADV_HUGEPAGE``, then every huge page faulted in from the calling
  thread (one byte written per 2 MiB) before the fill -- tried in ``advise_huge_pages``
  with more than one thread and not adopted (``benchmarks/RESULTS.md``, "Huge pages with
  two threads: this VM's free page reporting").

Prints a Markdown table of the median ms per fill, and, in a virtual machine whose
balloon driver reports free memory to the hypervisor (``normkit.bench.runner.
page_reporting_order``), the MiB reported during each row: memory the host dropped and
backs afresh on the next touch. Needs Linux with transparent huge pages in ``madvise``
mode (``kernels.memory.huge_pages_available``); run with glibc's default allocator (no
``MALLOC_*`` variables: with heap reuse nothing is fresh).

To tell the host's share from the guest's (root only; the setting is restored on exit):
``--page-reporting-order 11`` reports only free 8 MiB blocks for the run (freed 2 MiB
pages then stay with the guest), and ``--touch-gib G`` writes G GiB once before it, so
that the guest's free memory is backed by the host already.

Run: ``PYTHONPATH=src python benchmarks/huge_page_faults.py [--threads 1 2] [--rounds 12]
[--page-reporting-order N] [--touch-gib G]``
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time

import torch

from normkit.bench import runner
from normkit.kernels import memory

WAYS = ("plain", "advised", "faulted")


def _advise(t: torch.Tensor, fault: bool) -> None:
    """``MADV_HUGEPAGE`` on ``t``'s aligned interior, then (``fault``) one byte written per
    huge page from this thread."""
    madvise, _ = memory._libc()
    start = t.data_ptr()
    first = -(-start // memory._HUGE_PAGE) * memory._HUGE_PAGE
    end = (start + t.numel() * t.element_size()) // memory._HUGE_PAGE * memory._HUGE_PAGE
    if madvise(first, end - first, memory._MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise failed")
    if fault:
        for page in range(first, end, memory._HUGE_PAGE):
            ctypes.memset(page, 0, 1)


def fill_ms(way: str, rounds: int, mib: int = 64) -> float:
    """Median ms to advise (per ``way``) and fill a fresh ``mib`` MiB buffer, each round
    followed by a plain buffer of the same size, both freed."""
    n = (mib << 20) // 4
    times = []
    for _ in range(rounds):
        begin = time.perf_counter()
        buffer = torch.empty(n)
        if way != "plain":
            _advise(buffer, fault=way == "faulted")
        buffer.fill_(1.0)
        times.append(time.perf_counter() - begin)
        other = torch.empty(n)
        other.fill_(2.0)
        del buffer, other
    return statistics.median(times) * 1e3


_REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"


def reported_kib() -> int | None:
    """KiB of free memory reported to the hypervisor since boot, or ``None``."""
    try:
        with open(_REPORTED_KIB) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def page_reporting_order(order: int | None):
    """Within the block, free page reporting from blocks of ``order`` (root only), the
    setting restored after; ``None`` leaves it as it is."""
    before = runner.page_reporting_order()
    if order is None:
        yield before
        return
    if before is None:
        raise SystemExit("--page-reporting-order: this machine reports no free pages "
                         f"({runner._PAGE_REPORTING_ORDER} does not exist)")
    try:
        with open(runner._PAGE_REPORTING_ORDER, "w") as f:
            f.write(str(order))
    except OSError as e:
        raise SystemExit(f"--page-reporting-order {order}: could not set it ({e}; needs "
                         "root, and an order the kernel accepts)") from e
    try:
        yield order
    finally:
        with open(runner._PAGE_REPORTING_ORDER, "w") as f:
            f.write(str(before))


def touch(gib: int) -> None:
    """Writes ``gib`` GiB, one GiB at a time, all held until the end, then frees them."""
    held = []
    for _ in range(gib):
        held.append(torch.empty(1 << 28))
        held[-1].fill_(1.0)
    del held


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--page-reporting-order", type=int, default=None,
                        help="report free blocks of this order to the hypervisor during "
                             "the run (root; restored after)")
    parser.add_argument("--touch-gib", type=int, default=0,
                        help="write this many GiB once before measuring")
    args = parser.parse_args(argv)
    if not memory.huge_pages_available():
        raise SystemExit("needs Linux with transparent huge pages in madvise mode "
                         "(and NORMKIT_HUGEPAGES unset)")
    if args.touch_gib < 0:
        raise SystemExit(f"--touch-gib expects a count of GiB >= 0, got {args.touch_gib}")
    with page_reporting_order(args.page_reporting_order) as order:
        print(f"free page reporting order: {order}; touched first: {args.touch_gib} GiB")
        touch(args.touch_gib)
        print("| threads | " + " | ".join(f"{way} ms" for way in WAYS)
              + " | reported MiB |")
        print("|---:|" + "---:|" * (len(WAYS) + 1))
        for threads in args.threads:
            torch.set_num_threads(threads)
            fill_ms("plain", 2)  # (warm-up)
            before = reported_kib()
            cells = [f"{fill_ms(way, args.rounds):.1f}" for way in WAYS]
            after = reported_kib()
            cells.append("-" if before is None else f"{(after - before) / 1024:.0f}")
            print(f"| {threads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
