"""Normalization of a batch with one outlier: normkit against torch, clean and mixed.

normkit keeps its fast paths (torch's kernels, the slice-sums engine) where their
statistics are accurate and normalizes the rows (groups, positions) past that bound with
its compensated core. One row far off its spread -- an outlier token, a constant padding
row, a blank image's constant maps after a convolution -- used to send the whole batch
through a slower path; now only that row takes it, in LayerNorm, AddLayerNorm,
LayerNorm2d, GroupNorm, GroupNormAct and InstanceNorm. This script times each layer's
module on a clean batch and on the same batch with one row (sample) offset by 3000 at a
spread of 0.01, forward (no grad) and forward+backward, torch's and normkit's in the
same process (median of round-robin rounds), checks normkit's output against float64,
and prints a Markdown table: ms and torch time / normkit time (> 1: normkit faster)::

    PYTHONPATH=src python benchmarks/outlier_rows.py --threads 1
    PYTHONPATH=src python benchmarks/outlier_rows.py --offset-samples 2 4 8 16 \
        --scale 1 --shift 3   # many samples a little off: where the repair stops paying

Run it with ``PYTHONPATH`` at an older checkout's ``src`` for the before/after. Figures
for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import normkit
from normkit.bench.measure import module_passes

#: ``name: (input shape, torch module, normkit module, float64 reference)``
CASES = {
    "LayerNorm 4096x1024": (
        (4096, 1024), lambda: nn.LayerNorm(1024), lambda: normkit.LayerNorm(1024),
        lambda x: torch.nn.functional.layer_norm(x, (1024,))),
    "LayerNorm2d channels_last 32x64x28x28": (
        (32, 64, 28, 28), lambda: _PermutedLayerNorm(64), lambda: normkit.LayerNorm2d(64),
        lambda x: torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (64,))
        .permute(0, 3, 1, 2)),
    "GroupNorm 32x64x28x28": (
        (32, 64, 28, 28), lambda: nn.GroupNorm(16, 64), lambda: normkit.GroupNorm(16, 64),
        lambda x: torch.nn.functional.group_norm(x, 16)),
    "GroupNorm channels_last 32x64x28x28": (
        (32, 64, 28, 28), lambda: nn.GroupNorm(16, 64), lambda: normkit.GroupNorm(16, 64),
        lambda x: torch.nn.functional.group_norm(x, 16)),
    "InstanceNorm2d 32x64x28x28": (
        (32, 64, 28, 28), lambda: nn.InstanceNorm2d(64, affine=True),
        lambda: normkit.InstanceNorm2d(64, affine=True),
        lambda x: torch.nn.functional.instance_norm(x)),
    "InstanceNorm2d channels_last 32x64x28x28": (
        (32, 64, 28, 28), lambda: nn.InstanceNorm2d(64, affine=True),
        lambda: normkit.InstanceNorm2d(64, affine=True),
        lambda x: torch.nn.functional.instance_norm(x)),
    "GroupNormAct (SiLU) 32x64x28x28": (
        (32, 64, 28, 28), lambda: nn.Sequential(nn.GroupNorm(16, 64), nn.SiLU()),
        lambda: normkit.GroupNormAct(16, 64, act="silu"),
        lambda x: torch.nn.functional.silu(torch.nn.functional.group_norm(x, 16))),
    "GroupNormAct (SiLU) channels_last 32x64x28x28": (
        (32, 64, 28, 28), lambda: nn.Sequential(nn.GroupNorm(16, 64), nn.SiLU()),
        lambda: normkit.GroupNormAct(16, 64, act="silu"),
        lambda x: torch.nn.functional.silu(torch.nn.functional.group_norm(x, 16))),
    "LayerNorm2d NCHW 32x64x28x28": (
        (32, 64, 28, 28), lambda: _PermutedLayerNorm(64), lambda: normkit.LayerNorm2d(64),
        lambda x: torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (64,))
        .permute(0, 3, 1, 2)),
}


class _PermutedLayerNorm(nn.LayerNorm):
    """torch's LayerNorm over dim 1 of ``(N, C, H, W)``: permute, LayerNorm, permute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def measure(name: str, offset: int, rounds: int, scale: float = 0.01,
            shift: float = 3000.0) -> dict[str, dict[str, float]]:
    """``{pass: {"torch": ms, "normkit": ms}}`` at the current thread count, with the first
    ``offset`` samples made ``x * scale + shift`` (0: a clean batch).

    Raises AssertionError when normkit's output is not within 1e-5 of float64's."""
    shape, make_torch, make_normkit, reference = CASES[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x[:offset] = x[:offset] * scale + shift
    if "channels_last" in name:
        x = x.contiguous(memory_format=torch.channels_last)
    modules = {"torch": make_torch(), "normkit": make_normkit()}
    with torch.no_grad():
        # (the reference on a contiguous copy: torch's channels-last GroupNorm kernel
        # sums squares unshifted, 3.4e-4 off even in float64 at this offset)
        err = (modules["normkit"](x).double() - reference(x.double().contiguous())).abs().max()
    assert float(err) < 1e-5, f"{name}: normkit is {float(err):.2e} off float64"
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return module_passes(modules, x, dy, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cases", nargs="+", default=list(CASES), metavar="CASE",
                        help="case names (default: all)")
    parser.add_argument("--offset-samples", type=int, nargs="+", default=[1], metavar="K",
                        help="how many samples to offset, each count its own row (default: 1)")
    parser.add_argument("--scale", type=float, default=0.01,
                        help="offset samples are x * scale + shift (default: 0.01)")
    parser.add_argument("--shift", type=float, default=3000.0, help="(default: 3000)")
    args = parser.parse_args()
    print("| threads | layer | batch | pass | torch ms | normkit ms | torch / normkit |")
    print("|---:|---|---|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.cases:
            for offset in (0, *args.offset_samples):
                batch = ("clean" if offset == 0 else "one outlier row" if offset == 1
                         else f"{offset} outlier rows")
                for label, ms in measure(name, offset, args.rounds, args.scale,
                                         args.shift).items():
                    print(f"| {threads} | {name} | {batch} | {label} | {ms['torch']:.3f} | "
                          f"{ms['normkit']:.3f} | {ms['torch'] / ms['normkit']:.2f}x |",
                          flush=True)


if __name__ == "__main__":
    main()
