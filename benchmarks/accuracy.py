"""Numerical accuracy of normkit vs torch.nn against a float64 reference.

For each family, a float32 input with mean ``offset`` and standard deviation 1 is
normalized by normkit and by torch.nn (training-mode statistics), and both outputs
are compared with the float64 computation on the *same* float32 input. Prints a
Markdown table (max absolute error); ``--json`` writes the numbers.

Run: ``python benchmarks/accuracy.py [--json FILE]``
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import normkit

SHAPE = (16, 32, 14, 14)
OFFSETS = (0.0, 1e4, 1e5)


def _families():
    return [
        ("BatchNorm2d", lambda: (normkit.BatchNorm2d(32), nn.BatchNorm2d(32)), False),
        ("BatchNorm2d (channels_last)",
         lambda: (normkit.BatchNorm2d(32), nn.BatchNorm2d(32)), True),
        ("LayerNorm (last dim)", lambda: (normkit.LayerNorm(14), nn.LayerNorm(14)), False),
        ("GroupNorm (8 groups)", lambda: (normkit.GroupNorm(8, 32), nn.GroupNorm(8, 32)), False),
        ("InstanceNorm2d", lambda: (normkit.InstanceNorm2d(32), nn.InstanceNorm2d(32)), False),
    ]


def measure(seed: int = 0) -> list[dict]:
    """Max |output - float64 reference| per family and offset, for normkit and torch."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, make, channels_last in _families():
        for offset in OFFSETS:
            x = (torch.randn(SHAPE, generator=gen, dtype=torch.float64) + offset).float()
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            ours, theirs = make()
            reference = make()[1].double()
            with torch.no_grad():
                exact = reference(x.double())
                err_ours = float((ours(x).double() - exact).abs().max())
                err_torch = float((theirs(x).double() - exact).abs().max())
            rows.append({"layer": name, "offset": offset, "normkit": err_ours,
                         "torch": err_torch})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| layer | offset | normkit max error | torch.nn max error |",
             "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['offset']:g} | {r['normkit']:.1e} | {r['torch']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.seed)
    print(f"torch {torch.__version__}, float32 input of shape {SHAPE}, std 1, "
          "error vs float64 on the same input\n")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
