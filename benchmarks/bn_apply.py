"""Per-channel ``x * scale + shift``: torch's inference BatchNorm kernel or a broadcast addcmul?

Inference BatchNorm (and every per-channel affine pass of normkit's BatchNorm paths) is
``y = x * scale + shift`` with one ``scale`` and ``shift`` per channel. torch's inference
kernel (``torch.native_batch_norm(..., training=False)``) computes exactly that fold; so
does ``torch.addcmul(shift.view(1, C, 1, 1), x, scale.view(1, C, 1, 1))``. This script
times both on the same tensor, NCHW and channels-last (and 2D ``(N, C)`` rows), the
median of round-robin rounds in one process, and prints the kernel's time over
addcmul's (> 1: addcmul is faster)::

    PYTHONPATH=src python benchmarks/bn_apply.py --threads 1 2

It decided :data:`normkit.kernels.native.BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS` and the
channels-last branch of :func:`normkit.kernels.channels._slice_affine`. Figures for
reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = ("3x5x7x9", "64x512", "4096x768", "1x64x56x56", "1x2048x7x7", "16x64x32x32",
          "32x256x14x14", "32x64x56x56")


def _input(shape: tuple[int, ...], layout: str) -> torch.Tensor:
    x = torch.randn(*shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def measure(shape: tuple[int, ...], layout: str, rounds: int) -> tuple[float, float, float]:
    """``(kernel us, addcmul us, kernel / addcmul)`` at the current thread count.

    Raises AssertionError when the two results differ beyond float32 rounding."""
    x = _input(shape, layout)
    c = shape[1]
    scale, shift = torch.rand(c) + 0.5, torch.randn(c)
    zero, unit = torch.zeros(c), torch.ones(c)
    view = (1, c) + (1,) * (len(shape) - 2)
    calls = {
        "kernel": lambda: torch.native_batch_norm(x, scale, shift, zero, unit, False, 0.0,
                                                  0.0)[0],
        "addcmul": lambda: torch.addcmul(shift.view(view), x, scale.view(view)),
    }
    torch.testing.assert_close(calls["addcmul"](), calls["kernel"]())
    number = max(1, int(2e-3 / _once(calls["kernel"])))  # each sample lasts ~2 ms
    times = {name: [] for name in calls}
    for round_ in range(rounds):
        for name in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
            call = calls[name]
            call()
            begin = time.perf_counter()
            for _ in range(number):
                call()
            times[name].append((time.perf_counter() - begin) / number)
    ratio = statistics.median(a / b for a, b in zip(times["kernel"], times["addcmul"],
                                                     strict=True))
    return (statistics.median(times["kernel"]) * 1e6, statistics.median(times["addcmul"]) * 1e6,
            ratio)


def _once(call) -> float:
    call()
    begin = time.perf_counter()
    call()
    return max(time.perf_counter() - begin, 1e-7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    print("| threads | shape | layout | kernel us | addcmul us | kernel / addcmul |")
    print("|---:|---|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for spec in args.shapes:
            shape = tuple(int(v) for v in spec.split("x"))
            layouts = ("contiguous", "channels_last") if len(shape) == 4 else ("rows",)
            for layout in layouts:
                kernel, addcmul, ratio = measure(shape, layout, args.rounds)
                print(f"| {threads} | {spec} | {layout} | {kernel:.1f} | {addcmul:.1f} "
                      f"| {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
