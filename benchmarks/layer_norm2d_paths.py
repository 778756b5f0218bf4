"""Which of LayerNorm2d's three NCHW paths is fastest, by positions per sample and threads.

``normkit.LayerNorm2d`` on contiguous float32 NCHW input has three paths
(:mod:`normkit.kernels.native`):

* **channel sums**: whole-batch reductions over the channel dim, the statistics and the
  output in a few passes over the batch, no copies
  (:func:`~normkit.kernels.native._layer_norm2d_channel_sums`);
* **per-sample**: torch's BatchNorm kernel on each sample's ``(C, H*W)`` matrix, no
  copies (:func:`~normkit.kernels.native.layer_norm2d_nchw`);
* **copy**: torch's LayerNorm on a channels-innermost copy, then a copy back to NCHW.

Channel sums on the range of positions ``LAYER_NORM2D_CHANNEL_SUMS`` when a gradient is
needed (``..._INFERENCE`` when not), else per-sample from ``LAYER_NORM2D_MIN_POSITIONS``
(``..._INFERENCE``), else the copy path (each by thread count: one, or more). This
script forces each path, forward without gradients and forward + backward, and prints
copy time / that path's time (> 1: faster than the copy path), the median over
round-robin rounds in one process, float32::

    PYTHONPATH=src python benchmarks/layer_norm2d_paths.py --threads 1 2 [--shapes small]

The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import normkit
from normkit.kernels import native

#: (N, C, H, W): 2x2 to 56x56 positions, every input at least LAYER_NORM2D_MIN_ELEMENTS;
#: the last four ConvNeXt-T's stages at batch 32.
SHAPES = ((64, 1024, 2, 2), (32, 512, 4, 4), (32, 512, 5, 5), (32, 512, 6, 6),
          (32, 512, 7, 7), (32, 256, 8, 8), (32, 256, 14, 14), (32, 128, 16, 16),
          (32, 128, 20, 20), (32, 128, 28, 28), (32, 64, 56, 56), (32, 768, 7, 7),
          (32, 384, 14, 14), (32, 192, 28, 28), (32, 96, 56, 56))

#: Small batches (``--shapes small``): where the channel sums' element floors
#: (``LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS``) come from.
SMALL_SHAPES = ((2, 768, 7, 7), (4, 768, 7, 7), (8, 768, 7, 7), (16, 768, 7, 7),
                (1, 384, 14, 14), (2, 384, 14, 14), (4, 384, 14, 14), (8, 384, 14, 14))

#: The paths, each as the (channel sums' range, per-sample floor) it is forced by.
_NEVER = 1 << 62
PATHS = {"channel sums": ((0, _NEVER), _NEVER), "per-sample": ((0, 0), 0),
         "copy": ((0, 0), _NEVER)}
_FLOORS = ("LAYER_NORM2D_CHANNEL_SUMS", "LAYER_NORM2D_CHANNEL_SUMS_INFERENCE",
           "LAYER_NORM2D_MIN_POSITIONS", "LAYER_NORM2D_MIN_POSITIONS_INFERENCE",
           "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS",
           "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS_INFERENCE")


def _on_path(module: torch.nn.Module, x: torch.Tensor, path: str):
    """A call of ``module(x)`` forced onto one NCHW path (the floors patched for it)."""
    sums, per_sample = PATHS[path]
    forced = ((sums, sums), (sums, sums), (per_sample, per_sample), (per_sample, per_sample),
              (0, 0), (0, 0))

    def call():
        saved = [getattr(native, name) for name in _FLOORS]
        for name, value in zip(_FLOORS, forced, strict=True):
            setattr(native, name, value)
        try:
            return module(x)
        finally:
            for name, value in zip(_FLOORS, saved, strict=True):
                setattr(native, name, value)
    return call


def measure(shape: tuple[int, ...], rounds: int) -> dict[str, dict[str, float]]:
    """``{pass: {path: copy time / path time}}`` for ``shape`` (``"copy"`` itself 1.0)."""
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
            calls = {path: _on_path(module, x, path) for path in PATHS}
        else:
            def step(call):
                torch.autograd.grad(call(), [xg, *module.parameters()], dy)
            calls = {path: _on_path(module, xg, path) for path in PATHS}
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        order = list(PATHS)
        for round_ in range(rounds):
            for path in order[round_ % len(order):] + order[:round_ % len(order)]:
                step(calls[path])  # warm, every round alike
                begin = time.perf_counter()
                step(calls[path])
                times[path].append(time.perf_counter() - begin)
        out[pass_] = {path: statistics.median(c / t for t, c in zip(times[path], times["copy"],
                                                                     strict=True))
                      for path in PATHS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shapes", choices=["standard", "small"], default="standard",
                        help="batch-32 shapes from 2x2 to 56x56 images, or small batches")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes == "standard" else SMALL_SHAPES
    print("| threads | shape | positions | fwd (no grad): copy / channel sums | copy / "
          "per-sample | fwd+bwd: copy / channel sums | copy / per-sample |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in shapes:
            r = measure(shape, args.rounds)
            print(f"| {threads} | {'x'.join(map(str, shape))} | {shape[2] * shape[3]} "
                  f"| {r['fwd']['channel sums']:.2f}x | {r['fwd']['per-sample']:.2f}x "
                  f"| {r['fwd+bwd']['channel sums']:.2f}x | {r['fwd+bwd']['per-sample']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
