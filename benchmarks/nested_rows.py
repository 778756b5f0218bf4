"""LayerNorm and RMSNorm on jagged nested tensors: normkit against torch's own.

torch's ``nn.LayerNorm`` and ``nn.RMSNorm`` take jagged nested tensors
(``torch.nested.nested_tensor(seqs, layout=torch.jagged)``); normkit's run on the packed
tokens (``normkit.norms._nested``). This script times both on the same float32 batch of
sequences of random lengths, in one process with a fixed thread count, round-robin,
median of the per-round times, forward and forward+backward, and checks that they
agree::

    PYTHONPATH=src python benchmarks/nested_rows.py --threads 1 2 [--rounds 9]

Prints a Markdown table: ms per call of each and the ratio (> 1: normkit faster). The
figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import normkit

#: (sequences, mean length, width)
SHAPES = ((64, 64, 768), (64, 64, 4096), (16, 512, 1024))


def _batch(sequences: int, mean_length: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean_length // 2, mean_length * 3 // 2 + 1, (sequences,),
                            generator=gen).tolist()
    seqs = [torch.randn(n, width, generator=gen) for n in lengths]
    return torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=True)


def _run(layer, x: torch.Tensor, backward: bool) -> float:
    """Seconds for one forward (and backward) of ``layer`` on ``x``."""
    start = time.perf_counter()
    y = layer(x)
    if backward:
        y.values().sum().backward()
    elapsed = time.perf_counter() - start
    x.grad = None
    layer.zero_grad(set_to_none=True)
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    print("| threads | norm | sequences x mean length x width | pass | torch ms | normkit ms "
          "| torch / normkit | max abs difference |")
    print("|---:|---|---|---|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            x = _batch(*shape, seed=0)
            width = shape[2]
            for name, theirs, ours in (
                    ("LayerNorm", torch.nn.LayerNorm(width), normkit.LayerNorm(width)),
                    ("RMSNorm", torch.nn.RMSNorm(width, eps=1e-6),
                     normkit.RMSNorm(width, eps=1e-6))):
                with torch.no_grad():
                    diff = float((theirs(x).values() - ours(x).values()).abs().max())
                for label in ("fwd", "fwd+bwd"):
                    backward = label == "fwd+bwd"
                    for layer in (theirs, ours):  # (warm-up)
                        _run(layer, x, backward)
                    times: dict[str, list[float]] = {"torch": [], "normkit": []}
                    for _ in range(args.rounds):
                        times["torch"].append(_run(theirs, x, backward))
                        times["normkit"].append(_run(ours, x, backward))
                    t, n = (statistics.median(times[k]) * 1e3 for k in ("torch", "normkit"))
                    print(f"| {threads} | {name} | {' x '.join(map(str, shape))} | {label} | "
                          f"{t:.2f} | {n:.2f} | {t / n:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
