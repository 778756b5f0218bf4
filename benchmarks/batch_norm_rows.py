"""BatchNorm1d in training on 2D ``(N, C)`` input with many rows: normkit against torch.

``normkit bench``'s shape set has no 2D BatchNorm rows, yet large-batch MLPs (tabular,
recommendation, contrastive heads) normalize ``(N, C)`` activations with ``N`` in the tens
of thousands. torch's kernel sums each column sequentially, which loses precision past
:data:`normkit.kernels.native.CHANNELS_LAST_MAX_COUNT` rows; normkit serves those inputs
with the slice-sums engine through the ``(1, C, N, 1)`` channels-last view of the same
memory (``normkit.kernels.channels.rows_as_channels_last``). This script times forward
(no gradient) and forward+backward of ``torch.nn.BatchNorm1d`` and ``normkit.BatchNorm1d``
round-robin in one process (median, ``normkit.bench.measure``) and prints each one's max
output error against float64 on the same input (mean 1, std 1); ``--act`` the same for
BatchNorm1d then ReLU against ``normkit.BatchNormAct1d``::

    PYTHONPATH=src python benchmarks/batch_norm_rows.py --threads 1 2 [--act]

Figures for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import normkit
from normkit.bench.measure import Timer, calibrate, interleaved

SHAPES = ("8192x512", "16384x256", "32768x512", "65536x128")


def measure(n: int, c: int, rounds: int, act: bool = False) -> dict[str, float]:
    """Median ms of each (implementation, pass) and each implementation's output error;
    ``act``: BatchNorm then ReLU (``normkit.BatchNormAct1d``) instead."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, generator=gen) + 1.0
    dy = torch.randn(n, c, generator=gen)
    layers = ({"torch": torch.nn.Sequential(torch.nn.BatchNorm1d(c), torch.nn.ReLU()),
               "normkit": normkit.BatchNormAct1d(c, act="relu")} if act else
              {"torch": torch.nn.BatchNorm1d(c), "normkit": normkit.BatchNorm1d(c)})
    exact = torch.nn.functional.batch_norm(x.double(), None, None, training=True)
    if act:
        exact = exact.relu()
    out = {}
    for name, layer in layers.items():
        with torch.no_grad():
            out[f"{name} error"] = float((layer(x).double() - exact).abs().max())
    xg = x.clone().requires_grad_()

    def forward(layer):
        with torch.no_grad():
            layer(x)

    def step(layer):
        torch.autograd.grad(layer(xg), (xg, *layer.parameters()), dy)

    calls = {f"{name} {pass_}": (lambda fn=fn, layer=layer: fn(layer))
             for name, layer in layers.items()
             for pass_, fn in (("fwd", forward), ("fwd+bwd", step))}
    timer = Timer()
    number = calibrate(timer(calls["torch fwd+bwd"]), 5e-3)
    samples = interleaved(calls, timer, rounds, number)
    out.update({key: statistics.median(times) * 1e3 for key, times in samples.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--act", action="store_true",
                        help="BatchNorm1d then ReLU against normkit.BatchNormAct1d instead")
    args = parser.parse_args()
    print("| threads | N x C | torch fwd ms | normkit fwd ms | x | torch fwd+bwd ms "
          "| normkit fwd+bwd ms | x | torch error | normkit error |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for spec in args.shapes:
            n, c = (int(v) for v in spec.split("x"))
            r = measure(n, c, args.rounds, args.act)
            fwd, both = (r[f"torch {p}"] / r[f"normkit {p}"] for p in ("fwd", "fwd+bwd"))
            print(f"| {threads} | {spec} | {r['torch fwd']:.2f} | {r['normkit fwd']:.2f} "
                  f"| {fwd:.2f}x | {r['torch fwd+bwd']:.2f} | {r['normkit fwd+bwd']:.2f} "
                  f"| {both:.2f}x | {r['torch error']:.1e} | {r['normkit error']:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
