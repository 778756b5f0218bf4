"""batch-size: how each normalization's error depends on the batch size.

Wu & He (2018, Group Normalization) trained ResNet-50 with 32/16/8/4/2 images per GPU:
BN's error rose from 23.6 % to 34.7 %, GN's stayed at 24.0-24.2 %; at 32, LN had
25.3 %. The articles' table says BN is highly sensitive to small batches and LN is not,
that BN suits CNNs, and that BN regularizes more than LN. Here: BN, Batch
Renormalization, GN (8 groups), LN and no normalization in an MLP (2 hidden ReLU layers
of 64 units, flattened digits) and in the quickstart's CNN (LN over ``(C, H, W)`` as in
Wu & He), at batch sizes 32/16/8/4/2 with the learning rate scaled linearly (0.05 at
32, SGD momentum 0.9) and the same number of epochs, so every run sees the same
examples. Measured: test error, and train-minus-test accuracy (the generalization gap),
both in eval mode.

Example:
    >>> [s.key for s in BatchSize().plan("tiny", 0)][:2]
    ['model=mlp,norm=bn,batch=32', 'model=mlp,norm=bn,batch=4']
"""

from __future__ import annotations

from ..core import BASE_BATCH, BASE_LR, Analysis, Cell, Experiment, Table, module_summary
from ..datasets import Split, digits
from ..models import cnn, mlp
from ..training import scaled_lr, train_classifier
from ..verdict import Check, points_resolution
from ._common import complete_seeds, fmt_pm, mean

__all__ = ["BatchSize"]

_SUMMARY = module_summary(__doc__)
NORMS = ("bn", "brn", "gn", "ln", "none")
MODELS = ("mlp", "cnn")
LABELS = {"bn": "BN", "brn": "BatchRenorm", "gn": "GN", "ln": "LN", "none": "none"}


class BatchSize(Experiment):
    """BN, BatchRenorm, GN, LN, none at batch 32..2: error vs batch size, MLP and CNN."""

    name = "batch-size"
    title = "Batch size"
    summary = _SUMMARY
    claims = (
        ("bs.bn_small",
         "BatchNorm's error grows as the batch shrinks (32 -> 2, learning rate scaled "
         "linearly, same epochs).",
         "Wu & He 2018 (BN 23.6 % -> 34.7 %); 《深度学习归一化技术：BN与LN原理及应用对比》 "
         "§2.3 (对小批次大小敏感); 《归一化那些事》 (不适合于样本量太小的数据)"),
        ("bs.gn_flat",
         "GroupNorm is less sensitive to the batch size than BatchNorm: its error grows "
         "less from batch 32 to 2.",
         "Wu & He 2018 (GN 24.1 % -> 24.1 %)"),
        ("bs.ln_flat",
         "LayerNorm is less sensitive to the batch size than BatchNorm (LN's sensitivity "
         "'low, independent of batch size').",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §4.1 table (对小批次大小的敏感性)"),
        ("bs.renorm",
         "Batch Renormalization reduces BatchNorm's loss of accuracy at small batches.",
         "Ioffe 2017 (Batch Renormalization)"),
        ("bs.bn_cnn",
         "In a CNN at batch 32, BatchNorm gives a lower error than LayerNorm.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §3.3 and §4.2 (CNN优先考虑BN); "
         "Wu & He 2018 (BN 23.6 % vs LN 25.3 %)"),
        ("bs.regularization",
         "BatchNorm regularizes more than LayerNorm: a smaller gap between training and "
         "test accuracy at batch 32.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §2.2 and §4.1 table (正则化效果 较强/较弱)"),
    )
    settings = {
        "tiny": {"seeds": 1, "batch_sizes": [32, 4], "epochs": 1, "train_subset": 128,
                 "evals": 2},
        "quick": {"seeds": 2, "batch_sizes": [32, 16, 8, 4, 2], "epochs": 1,
                  "train_subset": None, "evals": 4},
        "full": {"seeds": 5, "batch_sizes": [32, 16, 8, 4, 2], "epochs": 10,
                 "train_subset": None, "evals": 10},
    }

    def configs(self, settings):
        """One configuration per (model, norm, batch size); cost ~ steps."""
        out = []
        for model in MODELS:
            for norm in NORMS:
                for bs in settings["batch_sizes"]:
                    config = {"model": model, "norm": norm, "batch_size": bs,
                              "epochs": settings["epochs"], "lr": scaled_lr(bs, BASE_LR,
                                                                            BASE_BATCH),
                              "train_subset": settings["train_subset"],
                              "evals": settings["evals"]}
                    n = settings["train_subset"] or 1347
                    steps = settings["epochs"] * (n // bs)
                    out.append((f"model={model},norm={norm},batch={bs}", config,
                                steps * (2.0 if model == "cnn" else 1.0) * 1e-3))
        return out

    def run(self, config, seed, on_step=None):
        """Train one model with one norm at one batch size for the epochs; measure it."""
        import torch

        data = digits(seed, "images" if config["model"] == "cnn" else "flat")
        if config["train_subset"]:
            pick = torch.randperm(data.x_train.shape[0],
                                  generator=torch.Generator().manual_seed(seed))
            pick = pick[:config["train_subset"]]
            data = Split(data.x_train[pick], data.y_train[pick], data.x_test, data.y_test)
        bs = config["batch_size"]
        steps = config["epochs"] * (data.x_train.shape[0] // bs)
        torch.manual_seed(seed)
        if config["model"] == "cnn":
            model = cnn(config["norm"], total_steps=steps)
        else:
            model = mlp(config["norm"], depth=2, width=64, total_steps=steps)
        out = train_classifier(model, data, steps=steps, batch_size=bs, lr=config["lr"],
                               seed=seed, evals=config["evals"], on_step=on_step,
                               final_train_metrics=True)
        out["n_test"] = data.n_test
        return out

    def analyze(self, records):
        """Error vs batch size per norm, the six claims and three comparison cells."""
        analysis = Analysis()
        if not records:
            analysis.complete = False
            return analysis
        sizes = sorted({r["config"]["batch_size"] for r in records}, reverse=True)
        seeds = complete_seeds(records, len(MODELS) * len(NORMS) * len(sizes))
        analysis.complete = bool(seeds) and len(seeds) == len({r["seed"] for r in records})
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["model"], r["config"]["norm"],
                r["config"]["batch_size"]): r["result"] for r in records}
        n_test = records[0]["result"]["n_test"]
        resolution = points_resolution(n_test)
        big, small = sizes[0], sizes[-1]

        def err(model, norm, bs):
            return [100 * (1 - res[(s, model, norm, bs)]["final_test_acc"]) for s in seeds]

        def delta(model, norm):
            return [b - a for a, b in zip(err(model, norm, big), err(model, norm, small),
                                          strict=True)]

        def gap(model, norm, bs):
            return [100 * (res[(s, model, norm, bs)]["final_train_acc"]
                           - res[(s, model, norm, bs)]["final_test_acc"]) for s in seeds]

        def diff(a, b):
            return tuple(x - y for x, y in zip(a, b, strict=True))

        name = {"mlp": "MLP", "cnn": "CNN"}
        claims = {
            "bs.bn_small": [Check(f"{name[m]}: BN error at batch {small} minus at {big}",
                                  tuple(delta(m, "bn")), "points", resolution,
                                  f"BN error {fmt_pm(err(m, 'bn', big))}% at {big}, "
                                  f"{fmt_pm(err(m, 'bn', small))}% at {small}")
                            for m in MODELS],
        }
        for cid, other in (("bs.gn_flat", "gn"), ("bs.ln_flat", "ln"), ("bs.renorm", "brn")):
            claims[cid] = [Check(
                f"{name[m]}: error increase {big}->{small}, BN minus {LABELS[other]}",
                diff(delta(m, "bn"), delta(m, other)), "points", resolution,
                f"increase BN {fmt_pm(delta(m, 'bn'))}, {LABELS[other]} "
                f"{fmt_pm(delta(m, other))} points") for m in MODELS]
        claims["bs.bn_cnn"] = [Check(
            f"CNN at batch {big}: LN error minus BN error", diff(err("cnn", "ln", big),
                                                                 err("cnn", "bn", big)),
            "points", resolution,
            f"BN {fmt_pm(err('cnn', 'bn', big))}%, LN {fmt_pm(err('cnn', 'ln', big))}%")]
        claims["bs.regularization"] = [Check(
            f"{name[m]} at batch {big}: train-test accuracy gap, LN minus BN",
            diff(gap(m, "ln", big), gap(m, "bn", big)), "points", resolution,
            f"gap BN {fmt_pm(gap(m, 'bn', big))}, LN {fmt_pm(gap(m, 'ln', big))} points")
            for m in MODELS]
        for cid, _, _ in self.claims:
            analysis.claims.append(self.make_claim(cid, claims[cid]))

        for m in MODELS:
            rows = [[LABELS[n], *[fmt_pm(err(m, n, bs)) for bs in sizes],
                     fmt_pm(delta(m, n)), fmt_pm(gap(m, n, big))] for n in NORMS]
            analysis.tables.append(Table(
                f"{name[m]}: test error (%) by batch size, mean ± sd over {len(seeds)} seeds",
                ["norm", *[str(bs) for bs in sizes], f"increase {big}->{small}",
                 f"train-test gap at {big}"], rows))

        def both(metric):
            return "; ".join(f"{name[m]} {metric(m)}" for m in MODELS)

        analysis.cells = [
            Cell("batch",
                 both(lambda m: f"{mean(delta(m, 'bn')):+.1f} pts"),
                 both(lambda m: f"{mean(delta(m, 'ln')):+.1f} pts"),
                 self.name, ("bs.ln_flat",)),
            Cell("fit",
                 f"CNN error at batch {big}: {mean(err('cnn', 'bn', big)):.1f}%",
                 f"CNN error at batch {big}: {mean(err('cnn', 'ln', big)):.1f}%",
                 self.name, ("bs.bn_cnn",)),
            Cell("regularization",
                 both(lambda m: f"gap {mean(gap(m, 'bn', big)):.1f} pts"),
                 both(lambda m: f"gap {mean(gap(m, 'ln', big)):.1f} pts"),
                 self.name, ("bs.regularization",)),
        ]
        analysis.notes.append(
            f"'increase {big}->{small}' is the error at batch {small} minus the error at batch "
            f"{big} (error-rate points, test set of {n_test} images: one image = "
            f"{resolution:.2f} points). Row 'batch' of the comparison table gives the "
            "increase from the largest to the smallest batch.")
        analysis.series = {
            "sizes": sizes, "models": list(MODELS),
            "errors": {f"{m}|{n}": [err(m, n, bs) for bs in sizes]
                       for m in MODELS for n in NORMS},
        }
        return analysis

    def figure(self, analysis):
        """Test error against batch size, one panel per model, one line per norm."""
        from ..figures import COLORS, errorbar_series, new_figure

        sizes = analysis.series["sizes"]
        fig, axes = new_figure(2)
        for ax, m in zip(axes, analysis.series["models"], strict=True):
            for n in NORMS:
                errorbar_series(ax, sizes, analysis.series["errors"][f"{m}|{n}"], LABELS[n],
                                COLORS[n])
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.invert_xaxis()
            ax.set_xlabel("batch size (learning rate scaled linearly)")
            ax.set_ylabel("test error (%)")
            ax.set_title(f"{m.upper()}: error vs batch size (min-max over seeds)")
            ax.legend(fontsize=8)
        return fig
