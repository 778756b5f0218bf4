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
  two threads: an open trade-off").

Prints a Markdown table of the median ms per fill. Needs Linux with transparent huge
pages in ``madvise`` mode (``kernels.memory.huge_pages_available``); run with glibc's
default allocator (no ``MALLOC_*`` variables: with heap reuse nothing is fresh).

Run: ``PYTHONPATH=src python benchmarks/huge_page_faults.py [--threads 1 2] [--rounds 12]``
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    if not memory.huge_pages_available():
        raise SystemExit("needs Linux with transparent huge pages in madvise mode "
                         "(and NORMKIT_HUGEPAGES unset)")
    print("| threads | " + " | ".join(f"{way} ms" for way in WAYS) + " |")
    print("|---:|" + "---:|" * len(WAYS))
    for threads in args.threads:
        torch.set_num_threads(threads)
        fill_ms("plain", 2)  # (warm-up)
        cells = [f"{fill_ms(way, args.rounds):.1f}" for way in WAYS]
        print(f"| {threads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
