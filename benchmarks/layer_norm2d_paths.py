"""Which of LayerNorm2d's two NCHW paths is faster, by positions per sample and threads.

``normkit.LayerNorm2d`` on contiguous NCHW input has two fast paths
(:mod:`normkit.kernels.native`):

* **per-sample**: torch's BatchNorm kernel on each sample's ``(C, H*W)`` matrix, no
  copies (:func:`~normkit.kernels.native.layer_norm2d_nchw`);
* **copy**: torch's LayerNorm on a channels-innermost copy, then a copy back to NCHW.

The per-sample path is taken from ``LAYER_NORM2D_MIN_POSITIONS`` positions when a
gradient is needed, from ``LAYER_NORM2D_MIN_POSITIONS_INFERENCE`` when not (each by
thread count: one, or more);
this script measures both paths, forward without gradients and forward + backward, and
prints copy time / per-sample time (> 1: the per-sample path is faster), the median over
round-robin rounds in one process, float32::

    PYTHONPATH=src python benchmarks/layer_norm2d_paths.py --threads 1 2

The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import normkit
from normkit.kernels import native

#: (N, C, H, W): 2x2 to 56x56 positions, every input at least LAYER_NORM2D_MIN_ELEMENTS.
SHAPES = ((64, 1024, 2, 2), (32, 512, 4, 4), (32, 512, 5, 5), (32, 512, 6, 6),
          (32, 512, 7, 7), (32, 256, 8, 8), (32, 256, 14, 14), (32, 128, 28, 28),
          (32, 64, 56, 56))


def _on_path(module: torch.nn.Module, x: torch.Tensor, per_sample: bool):
    """A call of ``module(x)`` forced onto one NCHW path (the floors patched for it)."""
    floor = 0 if per_sample else 1 << 30

    def call():
        saved = native.LAYER_NORM2D_MIN_POSITIONS, native.LAYER_NORM2D_MIN_POSITIONS_INFERENCE
        native.LAYER_NORM2D_MIN_POSITIONS = (floor, floor)
        native.LAYER_NORM2D_MIN_POSITIONS_INFERENCE = (floor, floor)
        try:
            return module(x)
        finally:
            native.LAYER_NORM2D_MIN_POSITIONS, native.LAYER_NORM2D_MIN_POSITIONS_INFERENCE = saved
    return call


def measure(shape: tuple[int, ...], rounds: int) -> dict[str, float]:
    """``{"fwd": ratio, "fwd+bwd": ratio}``: copy time / per-sample time for ``shape``."""
    torch.manual_seed(0)
    module = normkit.LayerNorm2d(shape[1])
    x = torch.randn(shape)
    xg = x.clone().requires_grad_()
    dy = torch.randn(shape)
    out = {}
    for pass_ in ("fwd", "fwd+bwd"):
        if pass_ == "fwd":
            def step(call):
                with torch.no_grad():
                    call()
            calls = [_on_path(module, x, p) for p in (True, False)]
        else:
            def step(call):
                torch.autograd.grad(call(), [xg, *module.parameters()], dy)
            calls = [_on_path(module, xg, p) for p in (True, False)]
        times: list[list[float]] = [[], []]
        for round_ in range(rounds):
            order = (0, 1) if round_ % 2 == 0 else (1, 0)
            for i in order:
                step(calls[i])  # warm, every round alike
                begin = time.perf_counter()
                step(calls[i])
                times[i].append(time.perf_counter() - begin)
        out[pass_] = statistics.median(c / p for p, c in zip(*times, strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print("| threads | shape | positions | fwd (no grad): copy / per-sample "
          "| fwd+bwd: copy / per-sample |")
    print("|---:|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            ratios = measure(shape, args.rounds)
            print(f"| {threads} | {'x'.join(map(str, shape))} | {shape[2] * shape[3]} "
                  f"| {ratios['fwd']:.2f}x | {ratios['fwd+bwd']:.2f}x |")


if __name__ == "__main__":
    main()
