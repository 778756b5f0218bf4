"""normkit's output cache for large CPU outputs, off against on, in one process.

``normkit.kernels.memory`` keeps the buffers of freed outputs of 32 MiB and more and
hands them to the next output of the same size, already faulted in
(``NORMKIT_OUTPUT_CACHE_MIB``; RESULTS.md, "Large outputs: a cache of their buffers").
This script times each op's normkit module with the cache off
(``memory.OUTPUT_CACHE_BYTES = 0``: fresh memory advised ``MADV_HUGEPAGE``, as before
the cache) and on, alternating call by call in one process, so both sides meet the same
machine state; ``off / on`` is the median over the pairs of (time off / time on), > 1
where the cache is faster. The modules and inputs are ``normkit bench``'s (its op names,
float32)::

    PYTHONPATH=src python benchmarks/output_cache.py --threads 1 2 [--pairs 15]

With glibc's heap reuse (``MALLOC_MMAP_MAX_=0 ...``) torch's allocations are already
touched memory and the cache stays out of the way: the two columns then time the same
code. The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from normkit.bench.ops import get_op
from normkit.kernels import memory

#: (op, dims, channels_last): transformer rows of 64 and 128 MiB and 51 MiB images.
CASES = tuple((op, dims, False) for op in ("layer_norm", "rms_norm", "add_layer_norm",
                                           "add_rms_norm")
              for dims in ((4096, 4096), (4096, 8192))) + tuple(
    (op, (64, 64, 56, 56), cl) for op in ("batch_norm", "group_norm", "batch_norm_act",
                                          "group_norm_act", "instance_norm", "layer_norm2d")
    for cl in (False, True))


def _step(op_name: str, dims: tuple[int, ...], channels_last: bool, grad: bool):
    """One call of the op's normkit module on fixed inputs (with ``grad``: forward and
    the gradients of every input and parameter)."""
    op = get_op(op_name)
    torch.manual_seed(0)
    module = op.build(op.resolve(), dims)
    module.train(op.training)
    inputs = [torch.randn(dims) for _ in range(op.inputs)]
    if channels_last:
        inputs = [t.contiguous(memory_format=torch.channels_last) for t in inputs]
    if not grad:
        def step():
            with torch.no_grad():
                module(*inputs)
        return step
    leaves = [t.requires_grad_() for t in inputs]
    targets = [*leaves, *(p for p in module.parameters() if p.requires_grad)]
    out = module(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    dys = [torch.randn_like(o) for o in outs]

    def step():
        out = module(*leaves)
        torch.autograd.grad(out if isinstance(out, tuple) else (out,), targets, dys)
    return step


def measure(step, pairs: int) -> tuple[float, float, float, float, float]:
    """``(ms off, ms on, off/on median, first quartile, third quartile)`` over ``pairs``
    alternating pairs (which side goes first alternates too)."""
    limit = memory.OUTPUT_CACHE_BYTES

    def timed(cache_on: bool) -> float:
        memory.OUTPUT_CACHE_BYTES = limit if cache_on else 0
        begin = time.perf_counter()
        step()
        return time.perf_counter() - begin

    try:
        for _ in range(2):  # warm-up: the first call of each side fills what it fills
            timed(False), timed(True)
        off, on = [], []
        for i in range(pairs):
            first = bool(i % 2)
            a = timed(first)
            b = timed(not first)
            off.append(b if first else a)
            on.append(a if first else b)
    finally:
        memory.OUTPUT_CACHE_BYTES = limit
    ratios = [a / b for a, b in zip(off, on, strict=True)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return (statistics.median(off) * 1e3, statistics.median(on) * 1e3,
            statistics.median(ratios), q1, q3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    if memory.OUTPUT_CACHE_BYTES <= 0 or not memory.huge_pages_available():
        raise SystemExit("the output cache is off here (NORMKIT_OUTPUT_CACHE_MIB=0, "
                         "NORMKIT_HUGEPAGES=0, or no Linux transparent huge pages in "
                         "madvise mode): nothing to compare")
    print("| threads | op | shape | layout | pass | ms, cache off | ms, cache on "
          "| off / on (IQR) |")
    print("|---:|---|---|---|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for op_name, dims, channels_last in CASES:
            for grad in (False, True):
                off, on, ratio, q1, q3 = measure(_step(op_name, dims, channels_last, grad),
                                                 args.pairs)
                memory.release_cached()  # (the next case starts from an empty cache)
                print(f"| {threads} | {op_name} | {'x'.join(map(str, dims))} "
                      f"| {'channels_last' if channels_last else 'contiguous'} "
                      f"| {'fwd+bwd' if grad else 'fwd'} | {off:.2f} | {on:.2f} "
                      f"| {ratio:.2f}x ({q1:.2f}-{q3:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
