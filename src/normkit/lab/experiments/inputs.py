"""inputs: features on very different scales, with and without input standardization.

The article's example (《归一化那些事》, "为什么要归一化？"): one feature in 0-1, one in
0-10000. The rate that suits one feature does not suit the other, so plain SGD has to
use a rate small enough for the large feature and then barely moves the small one.
A linear model is trained by mini-batch SGD (no momentum, batch 32) on
``y = 2 x1 - 3 x2 / 10000 + 1 + 0.1 noise`` over a grid of learning rates, on the raw
features and on features standardized by :class:`normkit.Standardizer`; both start
from the same weights and see the same mini-batches.

Measured per seed: the lowest training MSE reached over the grid after the step
budget, and the largest *stable* rate (finite loss that ends below where it started).

Example:
    >>> exp = Inputs()
    >>> [spec.key for spec in exp.plan("tiny", 0)]
    ['scaling=raw', 'scaling=standardized']
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...data import Standardizer
from ..core import ARTICLE_NORM, Analysis, Experiment, Table, module_summary
from ..datasets import two_scale_regression
from ..training import batch_indices
from ..verdict import RESOLUTION, Check, log2_ratio

__all__ = ["Inputs"]

_SUMMARY = module_summary(__doc__)

SCALINGS = ("raw", "standardized")


def _grid(low: float, high: float, per_decade: int) -> list[float]:
    count = round((high - low) * per_decade)
    return [10.0 ** (low + i / per_decade) for i in range(count + 1)]


class Inputs(Experiment):
    """Raw vs standardized inputs: loss curves and the range of stable learning rates."""

    name = "inputs"
    title = "Input scales and the learning rate"
    summary = _SUMMARY
    claims = (
        ("inputs.scale",
         "Unnormalized inputs (one feature in 0-1, one in 0-10000) make SGD sensitive to "
         "the learning rate and slow to converge; standardizing the inputs removes the "
         "conflict: lower loss within the same budget and a much wider range of usable "
         "learning rates.",
         f"{ARTICLE_NORM}, 为什么要归一化？"),
    )
    settings = {
        "tiny": {"seeds": 1, "n": 256, "steps": 60, "batch_size": 32, "lr_low": -9.0,
                 "lr_high": 1.0, "per_decade": 1, "evals": 10},
        "quick": {"seeds": 3, "n": 1000, "steps": 200, "batch_size": 32, "lr_low": -9.0,
                  "lr_high": 1.0, "per_decade": 2, "evals": 20},
        "full": {"seeds": 5, "n": 2000, "steps": 1000, "batch_size": 32, "lr_low": -9.0,
                 "lr_high": 1.0, "per_decade": 4, "evals": 25},
    }

    def configs(self, settings):
        """One configuration per input scaling (raw, standardized)."""
        cost = settings["steps"] * (settings["lr_high"] - settings["lr_low"]) * 1e-3
        return [(f"scaling={s}", {**{k: v for k, v in settings.items() if k != "seeds"},
                                  "scaling": s}, cost) for s in SCALINGS]

    def run(self, config, seed, on_step=None):
        """Train the linear model at every rate of the grid; record the loss curves."""
        x, y = two_scale_regression(config["n"], seed)
        if config["scaling"] == "standardized":
            x = Standardizer().fit(x)(x)
        grid = _grid(config["lr_low"], config["lr_high"], config["per_decade"])
        steps, evals = config["steps"], config["evals"]
        every = max(1, steps // evals)
        loss_fn = nn.MSELoss()
        runs = []
        for i, lr in enumerate(grid):
            torch.manual_seed(seed)
            model = nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            batches = batch_indices(x.shape[0], config["batch_size"],
                                    torch.Generator().manual_seed(seed))
            with torch.no_grad():
                initial = loss_fn(model(x), y).item()
            curve_steps, curve = [0], [initial]
            diverged = False
            for step in range(1, steps + 1):
                idx = next(batches)
                loss = loss_fn(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step % every == 0 or step == steps:
                    with torch.no_grad():
                        full = loss_fn(model(x), y).item()
                    if not math.isfinite(full) or full > 1e6 * initial:
                        diverged = True
                        break
                    curve_steps.append(step)
                    curve.append(full)
            final = None if diverged else curve[-1]
            runs.append({"lr": lr, "initial_loss": initial, "final_loss": final,
                         "diverged": diverged, "stable": final is not None and final < initial,
                         "curve_steps": curve_steps, "curve": curve})
            if on_step is not None:
                on_step(i + 1, len(grid))
        return {"runs": runs, "noise_mse": 0.01}

    def analyze(self, records):
        """Lowest loss and largest stable rate per scaling and seed; the claim."""
        by_seed: dict[int, dict[str, dict]] = {}
        for r in records:
            by_seed.setdefault(r["seed"], {})[r["config"]["scaling"]] = r["result"]
        seeds = sorted(s for s, v in by_seed.items() if len(v) == len(SCALINGS))
        analysis = Analysis(complete=len(seeds) == len(by_seed) and bool(seeds))
        if not seeds:
            analysis.complete = False
            return analysis
        best: dict[str, list[float]] = {s: [] for s in SCALINGS}
        lr_max: dict[str, list[float]] = {s: [] for s in SCALINGS}
        best_lr: dict[str, list[float]] = {s: [] for s in SCALINGS}
        for seed in seeds:
            for s in SCALINGS:
                runs = by_seed[seed][s]["runs"]
                finite = [r for r in runs if r["final_loss"] is not None]
                top = min(finite, key=lambda r: r["final_loss"])
                best[s].append(top["final_loss"])
                best_lr[s].append(top["lr"])
                stable = [r["lr"] for r in runs if r["stable"]]
                lr_max[s].append(max(stable) if stable else min(r["lr"] for r in runs))
        steps = records[0]["config"]["steps"]
        checks = [
            Check(f"lowest training MSE over the rate grid after {steps} steps "
                  "(raw / standardized)",
                  tuple(log2_ratio(a, b) for a, b in zip(best["raw"], best["standardized"],
                                                          strict=True)),
                  "log2 ratio", RESOLUTION["ratio"],
                  f"raw {_mean(best['raw']):.4g}, standardized "
                  f"{_mean(best['standardized']):.4g} (noise floor 0.01)"),
            Check("largest stable learning rate (standardized / raw)",
                  tuple(log2_ratio(b, a) for a, b in zip(lr_max["raw"],
                                                          lr_max["standardized"], strict=True)),
                  "log2 ratio", RESOLUTION["ratio"],
                  f"raw {_geo(lr_max['raw']):.3g}, standardized "
                  f"{_geo(lr_max['standardized']):.3g}"),
        ]
        analysis.claims.append(self.make_claim("inputs.scale", checks))
        analysis.tables.append(Table(
            "Per scaling (geometric mean over seeds for rates, mean for losses)",
            ["inputs", "largest stable rate", "best rate", f"lowest MSE after {steps} steps"],
            [[s, f"{_geo(lr_max[s]):.3g}", f"{_geo(best_lr[s]):.3g}", f"{_mean(best[s]):.4g}"]
             for s in SCALINGS],
            "The noise floor (best achievable MSE) is 0.01."))
        grid = [r["lr"] for r in by_seed[seeds[0]]["raw"]["runs"]]
        finals = {s: [[by_seed[seed][s]["runs"][i]["final_loss"] for seed in seeds]
                      for i in range(len(grid))] for s in SCALINGS}
        curves = {}
        for s in SCALINGS:
            runs = by_seed[seeds[0]][s]["runs"]
            top = min((r for r in runs if r["final_loss"] is not None),
                      key=lambda r: r["final_loss"])
            curves[s] = (top["lr"], top["curve_steps"], top["curve"])
        analysis.series = {"grid": grid, "finals": finals, "curves": curves}
        return analysis

    def figure(self, analysis):
        """Final loss over the rate grid, and the loss curves at the best rates."""
        from ..figures import new_figure

        fig, (left, right) = new_figure(2)
        grid = analysis.series["grid"]
        for s, color in zip(SCALINGS, ("tab:red", "tab:blue"), strict=True):
            vals = analysis.series["finals"][s]
            xs = [lr for lr, v in zip(grid, vals, strict=True) if all(u is not None for u in v)]
            ys = [_mean(v) for v in vals if all(u is not None for u in v)]
            left.plot(xs, ys, "o-", color=color, label=s)
            lr, steps, curve = analysis.series["curves"][s]
            right.plot(steps, curve, color=color, label=f"{s} (lr {lr:.2g})")
        for ax in (left, right):
            ax.set_yscale("log")
            ax.axhline(0.01, color="grey", lw=0.8, ls=":")
            ax.legend(fontsize=8)
        left.set_xscale("log")
        left.set_xlabel("learning rate")
        left.set_ylabel("final training MSE (diverged: not shown)")
        left.set_title("final loss over the rate grid")
        right.set_xlabel("step")
        right.set_ylabel("training MSE")
        right.set_title("loss curve at the best rate (first seed)")
        return fig


def _mean(values) -> float:
    return sum(values) / len(values)


def _geo(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
