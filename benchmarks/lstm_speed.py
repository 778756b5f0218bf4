"""CPU speed of normkit's LayerNorm LSTM against the same LSTM with torch's LayerNorm.

torch has no layer-normalized LSTM; a user writes the recurrence in Python (as
:mod:`normkit.recurrent` does) with ``torch.nn.LayerNorm`` modules. So the baseline
here is ``normkit.LayerNormLSTM`` with its LayerNorm modules turned into
``torch.nn.LayerNorm`` (same parameters, same recurrence: only the norm differs), and
the rows are

* **torch LayerNorm**: that baseline;
* **normkit**: ``normkit.LayerNormLSTM`` as shipped (torch's LayerNorm kernel where
  normkit's accuracy check passes, its compensated path where not);
* **torch.nn.LSTM**: torch's fused LSTM without LayerNorm, for scale.

Per call: forward without gradients, and forward + backward of the output's sum.
Ratio = baseline time / row time (> 1: faster than the baseline), median over
round-robin rounds, in one process::

    PYTHONPATH=src python benchmarks/lstm_speed.py --threads 1 2

The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import normkit


def _with_torch_layer_norms(lstm: torch.nn.Module) -> torch.nn.Module:
    """The same LSTM with every ``normkit.LayerNorm`` turned into ``torch.nn.LayerNorm``
    (a subclass's instance re-classed to its parent: same parameters and buffers)."""
    for module in lstm.modules():
        if isinstance(module, normkit.LayerNorm):
            module.__class__ = torch.nn.LayerNorm
    return lstm


def measure(steps: int, batch: int, hidden: int,
            rounds: int) -> list[tuple[str, str, float, float]]:
    """``(pass, row, median ms, median ratio)`` for one shape at the current threads."""
    torch.manual_seed(0)
    ours = normkit.LayerNormLSTM(hidden, hidden)
    base = _with_torch_layer_norms(normkit.LayerNormLSTM(hidden, hidden))
    base.load_state_dict(ours.state_dict())
    plain = torch.nn.LSTM(hidden, hidden)
    x = torch.randn(steps, batch, hidden)
    rows = {"torch LayerNorm": base, "normkit": ours, "torch.nn.LSTM (no LayerNorm)": plain}
    results = []
    for pass_ in ("fwd", "fwd+bwd"):
        def call(module, pass_=pass_):
            if pass_ == "fwd":
                with torch.no_grad():
                    return module(x)
            out, _ = module(x)
            out.sum().backward()
            return None
        fns = {name: (lambda m=module: call(m)) for name, module in rows.items()}
        times = {name: [] for name in fns}
        for round_ in range(rounds):
            names = list(fns)
            names = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in names:
                fns[name]()  # warm: allocator and caches, as every round
                begin = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - begin)
        reference = times["torch LayerNorm"]
        for name, samples in times.items():
            ratio = statistics.median(a / b for a, b in zip(reference, samples, strict=True))
            results.append((pass_, name, statistics.median(samples) * 1e3, ratio))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", default=["50x16x128", "50x64x256"],
                        help="steps x batch x hidden")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print("| threads | steps x batch x hidden | pass | row | ms | x torch LayerNorm |")
    print("|---:|---|---|---|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shapes:
            steps, batch, hidden = (int(v) for v in shape.split("x"))
            for pass_, name, ms, ratio in measure(steps, batch, hidden, args.rounds):
                print(f"| {threads} | {shape} | {pass_} | {name} | {ms:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
