"""lr-sensitivity: how wide a range of learning rates LayerNorm and BatchNorm train at.

《深度学习归一化技术：BN与LN原理及应用对比》 §3.3 lists among LayerNorm's limits that it
may be more sensitive to the learning rate than BatchNorm and need more careful tuning.
Here: a ReLU MLP (4 hidden layers of 64 units, flattened digits) and the quickstart's
CNN (digit images), each without a norm, with BatchNorm and with LayerNorm, trained by
SGD (momentum 0.9, batch 32) for the same number of steps at every rate of a grid of
half decades from 10^-2.5 to 10^0.5 (0.0032 to 3.2). A rate is *usable* when the final
test accuracy reaches the target: 90 % of the best accuracy any norm and rate of the same
model reached with the same seed. Measured: the usable range per norm, the number of
usable rates times the grid's step (half a decade, 1.66 in log2).

Example:
    >>> len(LRSensitivity().plan("quick", 0))
    126
"""

from __future__ import annotations

import math

import torch

from ..core import BASE_BATCH, TARGET_FRACTION, Experiment, Table, module_summary
from ..datasets import digits
from ..models import cnn, mlp
from ..verdict import RESOLUTION, Check
from ._common import begin_analysis, fmt_pm, mean, train_configured

__all__ = ["LRSensitivity", "usable_range"]

_SUMMARY = module_summary(__doc__)
NORMS = ("none", "bn", "ln")
LABELS = {"none": "no norm", "bn": "BatchNorm", "ln": "LayerNorm"}
MODELS = {"mlp": "ReLU MLP (4 x 64)", "cnn": "CNN"}
#: log10 of the grid's rates, half a decade apart
LOG_RATES = (-2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5)


def usable_range(accuracies: list[float], target: float, step: float) -> float:
    """The width (log2 of a rate ratio) of the learning rates that train to ``target``:
    the number of grid rates whose accuracy reaches it, each standing for one grid
    ``step`` (0 where none does).

    Example:
        >>> usable_range([0.95, 0.97, 0.1], 0.9, 1.0)  # two of three rates
        2.0
    """
    return step * sum(1 for a in accuracies if a >= target)


class LRSensitivity(Experiment):
    """MLP and CNN without a norm, with BN and with LN over a grid of learning rates."""

    name = "lr-sensitivity"
    title = "LayerNorm, BatchNorm and the learning rate"
    summary = _SUMMARY
    claims = (
        ("lr.ln_sensitive",
         "LayerNorm is more sensitive to the learning rate than BatchNorm: a narrower "
         "range of learning rates trains the network to the target accuracy.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §3.3 (对学习率的敏感性可能更高："
         "需要更仔细的调参)"),
    )
    settings = {
        "tiny": {"seeds": 1, "models": ["mlp"], "log_rates": [-2.0, -1.0, 0.0], "steps": 20,
                 "evals": 2},
        "quick": {"seeds": 3, "models": ["mlp", "cnn"], "log_rates": list(LOG_RATES),
                  "steps": 300, "evals": 3},
        "full": {"seeds": 5, "models": ["mlp", "cnn"], "log_rates": list(LOG_RATES),
                 "steps": 1000, "evals": 5},
    }

    def configs(self, settings):
        """One configuration per (model, norm, rate)."""
        out = []
        for model in settings["models"]:
            for norm in NORMS:
                for log_rate in settings["log_rates"]:
                    config = {"model": model, "norm": norm, "log_rate": log_rate,
                              "lr": 10.0 ** log_rate, "steps": settings["steps"],
                              "evals": settings["evals"], "batch_size": BASE_BATCH}
                    out.append((f"model={model},norm={norm},lr=1e{log_rate:+g}", config,
                                settings["steps"] * (1.3e-3 if model == "cnn" else 7e-4)))
        return out

    def run(self, config, seed, on_step=None):
        """Train one model with SGD at the configuration's rate."""
        data = digits(seed, "flat" if config["model"] == "mlp" else "images")
        torch.manual_seed(seed)
        model = (mlp(config["norm"], depth=4, width=64) if config["model"] == "mlp"
                 else cnn(config["norm"]))
        return train_configured(model, data, config, seed, on_step, optimizer="sgd")

    def analyze(self, records):
        """Usable ranges per model, norm and seed; the claim."""
        models = list(dict.fromkeys(r["config"]["model"] for r in records))
        log_rates = sorted({r["config"]["log_rate"] for r in records})
        analysis, seeds = begin_analysis(records, len(models) * len(NORMS) * len(log_rates))
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["model"], r["config"]["norm"], r["config"]["log_rate"]):
               r["result"] for r in records}
        rates = [10.0 ** k for k in log_rates]
        step = math.log2(10.0) * (log_rates[1] - log_rates[0]) if len(log_rates) > 1 else 1.0
        steps = records[0]["config"]["steps"]
        checks, curves = [], {}
        for model in models:
            ranges: dict[str, list[float]] = {n: [] for n in NORMS}
            for s in seeds:
                acc = {n: [res[(s, model, n, k)]["final_test_acc"] for k in log_rates]
                       for n in NORMS}
                target = TARGET_FRACTION * max(max(a) for a in acc.values())
                for n in NORMS:
                    ranges[n].append(usable_range(acc[n], target, step))
            effects = tuple(b - ln for b, ln in zip(ranges["bn"], ranges["ln"], strict=True))
            checks.append(Check(
                f"{MODELS[model]}: usable range of BatchNorm minus LayerNorm", effects,
                "log2 of a rate ratio", RESOLUTION["ratio"],
                f"BatchNorm {fmt_pm(ranges['bn'])}, LayerNorm {fmt_pm(ranges['ln'])} "
                f"(usable rates x the grid step, {step:.2f} in log2)"))
            errors = {n: [mean([100.0 * (1.0 - res[(s, model, n, k)]["final_test_acc"])
                                for s in seeds]) for k in log_rates] for n in NORMS}
            curves[model] = errors
            analysis.tables.append(Table(
                f"{MODELS[model]}: final test error (%) after {steps} SGD steps, mean over "
                f"{len(seeds)} seeds",
                ["norm", *(f"{r:.2g}" for r in rates), "usable range (log2)"],
                [[LABELS[n], *(f"{e:.3g}" for e in errors[n]), fmt_pm(ranges[n])]
                 for n in NORMS],
                "Usable: the final test accuracy reaches 90 % of the best any norm and rate "
                "of this model reached with the same seed."))
        analysis.claims.append(self.make_claim("lr.ln_sensitive", checks))
        analysis.series = {"rates": rates, "curves": curves}
        return analysis

    def figure(self, analysis):
        """Final test error against the learning rate, one panel per model."""
        from ..figures import COLORS, new_figure

        curves = analysis.series["curves"]
        fig, axes = new_figure(len(curves))
        for ax, (model, errors) in zip(axes, curves.items(), strict=True):
            for n in NORMS:
                ax.plot(analysis.series["rates"], errors[n], "o-", ms=3, color=COLORS[n],
                        label=LABELS[n])
            ax.set_xscale("log")
            ax.set_xlabel("learning rate (SGD, momentum 0.9)")
            ax.set_ylabel("final test error (%; mean over seeds)")
            ax.set_title(f"{MODELS[model]} on digits")
            ax.legend(fontsize=8)
        return fig
