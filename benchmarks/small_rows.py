"""Where normkit's fused RMSNorm node starts paying: torch's composite vs the node by size.

``normkit.functional.SMALL_ROWS_COMPOSITE_BELOW`` sends small RMSNorm (and residual-add
norm) inputs to torch's own composite, because the fused node's fixed cost (Python and
one autograd node) exceeds the whole op there. This script measures both paths on the
same inputs, float32, for rows x 1024 and 8 x 4096: ``torch.nn.functional.rms_norm``
against ``normkit.functional.rms_norm`` with the rule switched off (the fused node
always), forward without a gradient and forward+backward, in one process with a fixed
thread count, round-robin, median over repeats of the per-round ratio.

Prints a Markdown table: the elements, the ratio torch time / fused-node time per pass
(> 1: the node is faster), and which path the rule picks there.

Run: ``python benchmarks/small_rows.py [--threads 1 2] [--repeats 15]`` (about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as TF

from normkit import functional as F

SHAPES = [(4, 1024), (16, 1024), (8, 4096), (32, 1024), (64, 1024), (128, 1024),
          (256, 1024), (512, 1024)]


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(shape: tuple[int, int], grad: bool, repeats: int) -> float:
    """Median over rounds of torch composite time / fused-node time."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).requires_grad_(grad)
    w = (torch.rand(shape[1], generator=gen) + 0.5).requires_grad_(grad)
    rule = F.SMALL_ROWS_COMPOSITE_BELOW

    def call(fn):
        def run():
            if grad:
                fn(x, shape[1:], w, 1e-6).sum().backward()
            else:
                with torch.no_grad():
                    fn(x, shape[1:], w, 1e-6)
        return run

    def node(*args):
        F.SMALL_ROWS_COMPOSITE_BELOW = (0, 0)
        try:
            return F.rms_norm(*args)
        finally:
            F.SMALL_ROWS_COMPOSITE_BELOW = rule

    torch_run, node_run = call(TF.rms_norm), call(node)
    calls = max(5, int(2e6 / (x.numel() + 2e4)))
    for run in (torch_run, node_run):  # warm-up
        _per_call(run, calls)
    ratios = [_per_call(torch_run, calls) / _per_call(node_run, calls)
              for _ in range(repeats)]
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print("| threads | shape | elements | fwd (no grad) | fwd+bwd | the rule picks "
          "(no grad / grad) |")
    print("|---:|---|---:|---:|---:|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            n = shape[0] * shape[1]
            fwd, both = measure(shape, False, args.repeats), measure(shape, True, args.repeats)
            picks = ["composite" if n < limit else "node"
                     for limit in reversed(F.SMALL_ROWS_COMPOSITE_BELOW)]
            print(f"| {threads} | {shape[0]}x{shape[1]} | {n} | {fwd:.2f}x | {both:.2f}x | "
                  f"{' / '.join(picks)} |")


if __name__ == "__main__":
    main()
