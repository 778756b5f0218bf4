"""Normalization of strided views: normkit against torch on inputs that are not dense.

A layer's input is not always a dense tensor: a ``(T, B, D)`` sequence transposed to
batch-first, the first half of the features, every other sample, the first channels of
a wider activation. torch's CPU kernels copy such a view to a dense tensor first and
run as on any input; normkit's fast paths serve dense (contiguous or channels-last)
input. This script times each layer's module on each kind of view, forward (no grad)
and forward+backward, torch's and normkit's in the same process (median of round-robin
rounds), checks that the outputs agree, and prints a Markdown table: ms and torch time /
normkit time (> 1: normkit faster)::

    PYTHONPATH=src python benchmarks/strided_inputs.py --threads 1 2

Figures for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import normkit
from normkit.bench.measure import module_passes

#: ``name: (make the view, torch module, normkit module)``; every view is strided.
CASES = {
    "LayerNorm (T, B, D).transpose(0, 1)": (
        lambda g: torch.randn(128, 32, 768, generator=g).transpose(0, 1),
        lambda: nn.LayerNorm(768), lambda: normkit.LayerNorm(768)),
    "LayerNorm x[:, :768] of 4096x1536": (
        lambda g: torch.randn(4096, 1536, generator=g)[:, :768],
        lambda: nn.LayerNorm(768), lambda: normkit.LayerNorm(768)),
    "RMSNorm (T, B, D).transpose(0, 1)": (
        lambda g: torch.randn(128, 32, 768, generator=g).transpose(0, 1),
        lambda: nn.RMSNorm(768), lambda: normkit.RMSNorm(768)),
    "BatchNorm2d x[:, :64] of 32x128x28x28": (
        lambda g: torch.randn(32, 128, 28, 28, generator=g)[:, :64],
        lambda: nn.BatchNorm2d(64), lambda: normkit.BatchNorm2d(64)),
    "BatchNorm2d eval x[:, :64] of 32x128x28x28": (
        lambda g: torch.randn(32, 128, 28, 28, generator=g)[:, :64],
        lambda: nn.BatchNorm2d(64).eval(), lambda: normkit.BatchNorm2d(64).eval()),
    "GroupNorm x[::2] of 64x64x28x28": (
        lambda g: torch.randn(64, 64, 28, 28, generator=g)[::2],
        lambda: nn.GroupNorm(32, 64), lambda: normkit.GroupNorm(32, 64)),
    "InstanceNorm2d x[:, :64] of 32x128x28x28": (
        lambda g: torch.randn(32, 128, 28, 28, generator=g)[:, :64],
        lambda: nn.InstanceNorm2d(64, affine=True),
        lambda: normkit.InstanceNorm2d(64, affine=True)),
    "LayerNorm2d x[:, :64] of 32x128x28x28": (
        lambda g: torch.randn(32, 128, 28, 28, generator=g)[:, :64],
        lambda: _PermutedLayerNorm(64), lambda: normkit.LayerNorm2d(64)),
    "BatchNormAct2d (ReLU) x[:, :64] of 32x128x28x28": (
        lambda g: torch.randn(32, 128, 28, 28, generator=g)[:, :64],
        lambda: nn.Sequential(nn.BatchNorm2d(64), nn.ReLU()),
        lambda: normkit.BatchNormAct2d(64, act="relu")),
    "GroupNormAct (SiLU) x[::2] of 64x64x28x28": (
        lambda g: torch.randn(64, 64, 28, 28, generator=g)[::2],
        lambda: nn.Sequential(nn.GroupNorm(32, 64), nn.SiLU()),
        lambda: normkit.GroupNormAct(32, 64, act="silu")),
}


class _PermutedLayerNorm(nn.LayerNorm):
    """torch's LayerNorm over dim 1 of ``(N, C, H, W)``: permute, LayerNorm, permute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def measure(name: str, rounds: int) -> dict[str, dict[str, float]]:
    """``{pass: {"torch": ms, "normkit": ms}}`` at the current thread count.

    Raises AssertionError when normkit's output differs from torch's."""
    make_view, make_torch, make_normkit = CASES[name]
    x = make_view(torch.Generator().manual_seed(0))
    assert not x.is_contiguous()
    modules = {"torch": make_torch(), "normkit": make_normkit()}
    with torch.no_grad():
        torch.testing.assert_close(modules["normkit"](x), modules["torch"](x), rtol=1e-4,
                                   atol=1e-4)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    return module_passes(modules, x, dy, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cases", nargs="+", default=list(CASES), metavar="CASE",
                        help="case names (default: all)")
    args = parser.parse_args()
    print("| threads | layer and view | pass | torch ms | normkit ms | torch / normkit |")
    print("|---:|---|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.cases:
            for label, ms in measure(name, args.rounds).items():
                print(f"| {threads} | {name} | {label} | {ms['torch']:.3f} | "
                      f"{ms['normkit']:.3f} | {ms['torch'] / ms['normkit']:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
