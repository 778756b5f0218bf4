"""PowerNorm's per-channel sums: the whole product against cache-sized blocks.

PowerNorm (``normkit.norms.power``) needs per-channel sums over every token of
products of two ``(N, C)`` tensors -- ``x * x`` for its statistic, ``g * x`` in its
backward, with and without the padding mask's weights. ``(a * b).sum(0)`` writes the
whole product through memory (and, past 32 MiB, page-faults a fresh buffer for it);
``column_dot`` multiplies a block of rows at a time into one reused buffer of
``COLUMN_BLOCK_BYTES`` (the slice-sums engine's block) and sums it while it is in cache.
This script times both on the same float32 inputs in one process with a fixed thread
count, round-robin, median of the per-round times, and checks that they agree::

    PYTHONPATH=src python benchmarks/power_norm_sums.py --threads 1 2 [--rounds 9]

Prints a Markdown table: ms per call of each and the ratio (> 1: blocks faster), and the
largest error of the two from the float64 sum, relative to the sum of the terms' absolute
values. The figures are for reading, not
asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from normkit.norms.power import column_dot

SHAPES = ((4096, 768), (4096, 4096), (4096, 8192))


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    print("| threads | shape | mask | whole product ms | blocks ms | whole / blocks | "
          "max error / sum of abs |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(shape, generator=gen)
            b = torch.randn(shape, generator=gen)
            for masked in (False, True):
                keep = ((torch.rand(shape[0], 1, generator=gen) > 0.2).float()
                        if masked else None)

                def whole(a=a, b=b, keep=keep):
                    product = a * b
                    return (product if keep is None else product * keep).sum(0)

                def blocks(a=a, b=b, keep=keep):
                    return column_dot(a, b, keep)

                terms = a.double() * b.double() * (1.0 if keep is None else keep.double())
                want, scale = terms.sum(0), terms.abs().sum(0)  # (the sum's condition)
                diff = max(float(((f() - want).abs() / scale).max())
                           for f in (whole, blocks))
                whole(), blocks()  # (warm-up)
                times = {"whole": [], "blocks": []}
                for _ in range(args.rounds):
                    times["whole"].append(_time(whole))
                    times["blocks"].append(_time(blocks))
                w = statistics.median(times["whole"]) * 1e3
                k = statistics.median(times["blocks"]) * 1e3
                print(f"| {threads} | {shape[0]}x{shape[1]} | {'yes' if masked else 'no'} | "
                      f"{w:.2f} | {k:.2f} | {w / k:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
