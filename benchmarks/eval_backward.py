"""Inference BatchNorm with a gradient on NCHW input: which forward+backward is fastest?

Fixed statistics (BatchNorm in eval mode, FrozenBatchNorm, InstanceNorm with running
statistics) while a gradient flows -- fine-tuning with frozen statistics. Three ways to
run ``y = x * scale + shift`` per channel and its backward, on the same tensor:

* ``kernel``: torch's inference kernel and its autograd backward (what torch runs);
* ``node``: that kernel forward, backward ``dx = dy * scale`` as one broadcast multiply
  (:class:`normkit.kernels.native._EvalInputGradFunction`; the input's gradient only);
* ``per-slice``: torch's kernel on the ``(1, N*C, L)`` view with every per-channel
  tensor repeated per sample, as torch's own InstanceNorm does
  (:func:`normkit.kernels.native._eval_per_slice`).

Each is timed with only the input needing a gradient ("x") and with trainable weight and
bias too ("all"; the node does not serve it), the median of round-robin rounds in one
process; the table gives milliseconds and kernel time / each way's (> 1: faster than
torch)::

    PYTHONPATH=src python benchmarks/eval_backward.py --threads 1 2

It decided :data:`normkit.kernels.native.EVAL_INPUT_GRAD_MIN_ELEMENTS` and
:data:`normkit.kernels.native.EVAL_PER_SLICE_MIN_ELEMENTS`. Figures for reading, not
asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from normkit.bench.measure import Timer, calibrate, interleaved
from normkit.kernels import native

SHAPES = ("3x5x7x9", "4x32x32x32", "8x64x28x28", "16x64x32x32", "32x256x14x14",
          "32x64x56x56")


def _ways(x: torch.Tensor, params: bool) -> dict:
    c = x.shape[1]
    gen = torch.Generator().manual_seed(0)
    weight = (torch.rand(c, generator=gen) + 0.5).requires_grad_(params)
    bias = torch.randn(c, generator=gen).requires_grad_(params)
    mean, var = torch.randn(c, generator=gen) * 0.1, torch.rand(c, generator=gen) + 0.5
    args = (x, weight, bias, mean, var)
    ways = {
        "kernel": lambda: torch.native_batch_norm(*args, False, 0.0, 1e-5)[0],
        "per-slice": lambda: native._eval_per_slice(*args, 1e-5),
    }
    if not params:
        ways["node"] = lambda: native._EvalInputGradFunction.apply(*args, 1e-5)
    return ways, ([x, weight, bias] if params else [x])


def measure(shape: tuple[int, ...], params: bool, rounds: int) -> dict[str, float]:
    """Median ms of forward+backward for each way at the current thread count.

    Raises AssertionError when a way's output or gradients differ from the kernel's."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
    dy = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    ways, leaves = _ways(x, params)

    def step(way):
        return torch.autograd.grad(ways[way](), leaves, dy)

    want = step("kernel")
    for way in ways:
        for got, expected in zip(step(way), want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    timer = Timer()
    number = calibrate(timer(lambda: step("kernel")), 5e-3)  # each sample ~5 ms
    samples = interleaved({way: (lambda w=way: step(w)) for way in ways}, timer, rounds,
                          number)
    return {way: statistics.median(times) * 1e3 for way, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    print("| threads | shape | elements | grads | kernel ms | node ms | per-slice ms "
          "| kernel / node | kernel / per-slice |")
    print("|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for spec in args.shapes:
            shape = tuple(int(v) for v in spec.split("x"))
            elements = 1
            for size in shape:
                elements *= size
            for params in (False, True):
                ms = measure(shape, params, args.rounds)
                node = ms.get("node")
                node_cols = ("-", "-") if node is None else (f"{node:.3f}",
                                                            f"{ms['kernel'] / node:.2f}")
                print(f"| {threads} | {spec} | {elements} | {'all' if params else 'x'} "
                      f"| {ms['kernel']:.3f} | {node_cols[0]} | {ms['per-slice']:.3f} "
                      f"| {node_cols[1]} | {ms['kernel'] / ms['per-slice']:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
