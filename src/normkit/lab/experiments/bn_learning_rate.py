"""bn-learning-rate: BatchNorm allows higher learning rates and trains in fewer steps.

Ioffe & Szegedy (2015) trained Inception with BN to the baseline's accuracy in 14x
fewer steps, and with a 5x and 30x larger learning rate (BN-x5, BN-x30) where the
baseline could not use them; their MNIST network was 3 fully connected sigmoid layers
of 100 units. Here: sigmoid MLPs of 3 and 6 hidden layers of 100 units on the digits
(flattened), with and without BatchNorm before each sigmoid, trained by SGD (momentum
0.9, batch 32) at the lab's base rate (0.05) times 1, 5 and 30, all with the same step
budget. Measured: steps until the test accuracy first reaches the target (90 % of the
best accuracy any variant of the same depth reached with the same seed).

Example:
    >>> len(BNLearningRate().plan("quick", 0))
    36
"""

from __future__ import annotations

from ..core import BASE_BATCH, BASE_LR, Analysis, Experiment, Table, module_summary
from ..datasets import digits
from ..models import mlp
from ..training import train_classifier
from ..verdict import RESOLUTION, Check, log2_ratio
from ._common import complete_seeds, fmt_pm, mean, target_steps

__all__ = ["BNLearningRate"]

_SUMMARY = module_summary(__doc__)
NORMS = ("none", "bn")


class BNLearningRate(Experiment):
    """Sigmoid MLPs with/without BN at learning rates x1, x5, x30: steps to a target."""

    name = "bn-learning-rate"
    title = "BatchNorm and the learning rate"
    summary = _SUMMARY
    claims = (
        ("bnlr.faster",
         "At the same learning rate, a network with BatchNorm reaches the target accuracy "
         "in fewer steps than without.",
         "Ioffe & Szegedy 2015 (BN: 14x fewer steps); "
         "《深度学习归一化技术：BN与LN原理及应用对比》 §2.2 (加速训练收敛)"),
        ("bnlr.higher",
         "BatchNorm allows much higher learning rates: with BN at 5x and 30x the rate, the "
         "network reaches the target in fewer steps than the baseline (no BN, 1x).",
         "Ioffe & Szegedy 2015 (BN-x5, BN-x30); "
         "《深度学习归一化技术：BN与LN原理及应用对比》 §2.2 (允许使用更大的学习率)"),
    )
    settings = {
        "tiny": {"seeds": 1, "depths": [3], "lr_mults": [1, 30], "steps": 30, "width": 32,
                 "evals": 5},
        "quick": {"seeds": 3, "depths": [3, 6], "lr_mults": [1, 5, 30], "steps": 300,
                  "width": 100, "evals": 20},
        "full": {"seeds": 5, "depths": [3, 6], "lr_mults": [1, 5, 30], "steps": 1500,
                 "width": 100, "evals": 30},
    }

    def configs(self, settings):
        """One configuration per (depth, norm, learning-rate multiplier)."""
        out = []
        for depth in settings["depths"]:
            for norm in NORMS:
                for mult in settings["lr_mults"]:
                    config = {"depth": depth, "norm": norm, "lr_mult": mult,
                              "lr": BASE_LR * mult, "batch_size": BASE_BATCH,
                              "steps": settings["steps"], "width": settings["width"],
                              "evals": settings["evals"]}
                    out.append((f"depth={depth},norm={norm},lr=x{mult}", config,
                                settings["steps"] * depth * 2e-3))
        return out

    def run(self, config, seed, on_step=None):
        """Train one sigmoid MLP for the step budget, with test evaluations."""
        import torch

        data = digits(seed, "flat")
        torch.manual_seed(seed)
        model = mlp(config["norm"], config["depth"], config["width"], activation="sigmoid")
        return train_classifier(model, data, steps=config["steps"],
                                batch_size=config["batch_size"], lr=config["lr"], seed=seed,
                                evals=config["evals"], on_step=on_step)

    def analyze(self, records):
        """Steps to the target per variant and seed; the two claims."""
        analysis = Analysis()
        if not records:
            analysis.complete = False
            return analysis
        settings = records[0]["config"]
        mults = sorted({r["config"]["lr_mult"] for r in records})
        depths = sorted({r["config"]["depth"] for r in records})
        seeds = complete_seeds(records, len(mults) * len(depths) * len(NORMS))
        analysis.complete = len(seeds) == len({r["seed"] for r in records})
        budget = settings["steps"]
        res = {(r["seed"], r["config"]["depth"], r["config"]["norm"], r["config"]["lr_mult"]):
               r["result"] for r in records}
        steps: dict[tuple, list] = {}
        used: dict[tuple, list] = {}
        targets: dict[int, list[float]] = {d: [] for d in depths}
        for seed in seeds:
            for depth in depths:
                variants = {(n, m): res[(seed, depth, n, m)] for n in NORMS for m in mults}
                target, reached, counted = target_steps(variants, budget)
                targets[depth].append(target)
                for v in variants:
                    steps.setdefault((depth, *v), []).append(reached[v])
                    used.setdefault((depth, *v), []).append(counted[v])
        faster, higher = [], []
        for depth in depths:
            base = used[(depth, "none", 1)]
            faster.append(Check(
                f"depth {depth}, rate x1: steps without BN / with BN",
                tuple(log2_ratio(a, b) for a, b in zip(base, used[(depth, "bn", 1)],
                                                        strict=True)),
                "log2 ratio", RESOLUTION["ratio"], _detail(steps, depth, [("none", 1),
                                                                            ("bn", 1)])))
            for m in mults:
                if m == 1:
                    continue
                higher.append(Check(
                    f"depth {depth}: steps of no BN x1 / BN x{m}",
                    tuple(log2_ratio(a, b) for a, b in zip(base, used[(depth, "bn", m)],
                                                            strict=True)),
                    "log2 ratio", RESOLUTION["ratio"],
                    _detail(steps, depth, [("none", 1), ("bn", m), ("none", m)])))
        note = (f"Runs that never reach the target count as {budget} steps plus one "
                "evaluation interval (a lower bound).")
        analysis.claims.append(self.make_claim("bnlr.faster", faster, note))
        if higher:
            analysis.claims.append(self.make_claim("bnlr.higher", higher, note))
        for depth in depths:
            rows = []
            for n in NORMS:
                for m in mults:
                    reached = steps[(depth, n, m)]
                    finals = [res[(s, depth, n, m)]["final_test_acc"] for s in seeds]
                    diverged = sum(res[(s, depth, n, m)]["diverged"] for s in seeds)
                    rows.append([n, f"x{m} ({BASE_LR * m:g})", _steps_text(reached),
                                 fmt_pm(finals, 100), f"{diverged}/{len(seeds)}"])
            analysis.tables.append(Table(
                f"Depth {depth} (target: {100 * mean(targets[depth]):.1f}% test accuracy, "
                f"mean over seeds)",
                ["norm", "learning rate", "steps to target (per seed)",
                 f"test accuracy after {budget} steps (%)", "diverged"], rows))
        analysis.series = {
            "depths": depths, "mults": mults,
            "curves": {f"{d}|{n}|{m}": _mean_curve([res[(s, d, n, m)] for s in seeds])
                       for d in depths for n in NORMS for m in mults},
            "targets": {d: mean(targets[d]) for d in depths},
        }
        return analysis

    def figure(self, analysis):
        """Mean test-accuracy curves, one panel per depth."""
        from ..figures import new_figure

        depths, mults = analysis.series["depths"], analysis.series["mults"]
        fig, axes = new_figure(len(depths))
        colors = ["tab:blue", "tab:orange", "tab:red", "tab:green"]
        for ax, depth in zip(axes, depths, strict=True):
            for color, m in zip(colors, mults, strict=False):
                for n, style in (("bn", "-"), ("none", "--")):
                    x, y = analysis.series["curves"][f"{depth}|{n}|{m}"]
                    ax.plot(x, [100 * v for v in y], style, color=color,
                            label=f"{'BN' if n == 'bn' else 'no BN'} x{m}")
            ax.axhline(100 * analysis.series["targets"][depth], color="grey", lw=0.8, ls=":")
            ax.set_title(f"sigmoid MLP, {depth} hidden layers")
            ax.set_xlabel("step")
            ax.set_ylabel("test accuracy (%), mean over seeds")
            ax.set_ylim(0, 100)
            ax.legend(fontsize=7, ncol=2)
        return fig


def _mean_curve(results: list[dict]) -> tuple[list[int], list[float]]:
    """Mean test accuracy per evaluated step; a diverged run keeps its last accuracy."""
    steps = max((r["curve"]["step"] for r in results), key=len)
    values = []
    for s in steps:
        vals = []
        for r in results:
            accs = [a for st, a in zip(r["curve"]["step"], r["curve"]["test_acc"], strict=True)
                    if st <= s]
            vals.append(accs[-1])
        values.append(mean(vals))
    return steps, values


def _steps_text(values: list[int | None]) -> str:
    return ", ".join("never" if v is None else str(v) for v in values)


def _detail(steps: dict, depth: int, variants: list[tuple[str, int]]) -> str:
    parts = []
    for n, m in variants:
        parts.append(f"{'BN' if n == 'bn' else 'no BN'} x{m}: {_steps_text(steps[(depth, n, m)])}")
    return "steps to target per seed — " + "; ".join(parts)
