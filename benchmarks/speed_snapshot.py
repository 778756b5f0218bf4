"""A quick CPU speed snapshot: normkit vs torch.nn, same process, fixed threads.

Prints the ratio torch_time / normkit_time (> 1 means normkit is faster) for the
forward and forward+backward of a few layers, medians over repeats. This is a
snapshot, not the full harness (`normkit bench` is issue 6).

Run: ``python benchmarks/speed_snapshot.py [--threads 1] [--repeats 15]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import normkit

CASES = [
    ("LayerNorm 4096x1024", lambda: (normkit.LayerNorm(1024), torch.nn.LayerNorm(1024)),
     (4096, 1024), None),
    ("RMSNorm 4096x1024", lambda: (normkit.RMSNorm(1024), torch.nn.RMSNorm(1024)),
     (4096, 1024), None),
    ("BatchNorm2d 32x64x28x28", lambda: (normkit.BatchNorm2d(64), torch.nn.BatchNorm2d(64)),
     (32, 64, 28, 28), None),
    ("BatchNorm2d 32x64x28x28 channels_last",
     lambda: (normkit.BatchNorm2d(64), torch.nn.BatchNorm2d(64)),
     (32, 64, 28, 28), torch.channels_last),
    ("GroupNorm(32) 32x64x28x28", lambda: (normkit.GroupNorm(32, 64), torch.nn.GroupNorm(32, 64)),
     (32, 64, 28, 28), None),
    ("GroupNorm(32) 32x64x28x28 channels_last",
     lambda: (normkit.GroupNorm(32, 64), torch.nn.GroupNorm(32, 64)),
     (32, 64, 28, 28), torch.channels_last),
]


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats}; "
          "ratio = torch time / normkit time\n")
    print("| layer | forward ratio | forward+backward ratio |\n|---|---:|---:|")
    for name, make, shape, fmt in CASES:
        fwd, both = _ratios(*make(), shape, fmt, args.repeats)
        print(f"| {name} | {fwd:.2f} | {both:.2f} |")


def _ratios(ours, theirs, shape, fmt, repeats: int) -> tuple[float, float]:
    """(forward, forward+backward) time ratios torch / normkit on one input."""
    x = torch.randn(shape)
    if fmt is not None:
        x = x.contiguous(memory_format=fmt)
    xg = x.clone().requires_grad_()

    def train_step(module):
        y = module(xg)
        y.backward(torch.ones_like(y))

    with torch.no_grad():
        fwd = _median_time(lambda: theirs(x), repeats) / _median_time(lambda: ours(x), repeats)
    both = _median_time(lambda: train_step(theirs), repeats) / _median_time(
        lambda: train_step(ours), repeats)
    return fwd, both


if __name__ == "__main__":
    main()
