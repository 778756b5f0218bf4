"""train-eval-gap: BatchNorm computes differently in training and in inference.

In training, BN normalizes with the statistics of the current batch; in inference
with running averages collected during training. The articles' table lists this
train/inference difference for BN and none for LN, and warns that inaccurate running
averages can make validation accuracy drop (§5.2). Here: the quickstart's CNN with BN
(torch's momentum 0.1, and 0.01, which is Keras/Flax's default 0.99 and leaves the
running averages *stale*: they still remember the early weights) or LN, trained by SGD
(0.05, momentum 0.9, batch 32). Measured afterwards on the test set: accuracy with the
running statistics (eval mode), with batch statistics (train mode, batches of 32, no
update), and with *precise* statistics recomputed over the training set by
:func:`normkit.update_bn_stats`; and the relative difference between train-mode and
eval-mode outputs of the same batch.

Example:
    >>> [s.key for s in TrainEvalGap().plan("tiny", 0)]
    ['norm=bn,momentum=0.1', 'norm=bn,momentum=0.01', 'norm=ln']
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...tools.precise import update_bn_stats
from ..core import BASE_BATCH, BASE_LR, Cell, Experiment, Table, module_summary
from ..datasets import digits
from ..models import cnn
from ..training import evaluate, train_classifier
from ..verdict import RESOLUTION, Check, ExactCheck, points_resolution
from ._common import begin_analysis, fmt_pm, mean

__all__ = ["TrainEvalGap"]

_SUMMARY = module_summary(__doc__)
VARIANTS = (("bn", 0.1), ("bn", 0.01), ("ln", None))


def _key(norm: str, momentum: float | None) -> str:
    return f"norm={norm}" + (f",momentum={momentum}" if momentum is not None else "")


@torch.no_grad()
def _batch_stat_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         batch: int) -> float:
    """Accuracy with each test batch normalized by its own statistics (no running update)."""
    model = copy.deepcopy(model).train()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = 0.0
    correct = 0
    for begin in range(0, x.shape[0], batch):
        xb = x[begin:begin + batch]
        if xb.shape[0] < 2:  # one example has no batch statistics
            xb = x[begin - 1:begin + 1]
            correct += int((model(xb).argmax(1)[-1:] == y[begin:begin + 1]).sum())
            continue
        correct += int((model(xb).argmax(1) == y[begin:begin + batch]).sum())
    return correct / x.shape[0]


@torch.no_grad()
def _relative_mode_gap(model: nn.Module, x: torch.Tensor) -> float:
    """mean |train-mode output - eval-mode output| / mean |eval-mode output| on ``x``."""
    train_model = copy.deepcopy(model).train()
    for m in train_model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = 0.0
    eval_out = copy.deepcopy(model).eval()(x)
    return ((train_model(x) - eval_out).abs().mean() / eval_out.abs().mean()).item()


def _stats_error(model: nn.Module, precise: nn.Module) -> float:
    """Mean over BN layers and channels of |running mean - precise mean| / precise std."""
    errors = []
    for (_, a), (_, b) in zip(model.named_modules(), precise.named_modules(), strict=True):
        if isinstance(a, nn.modules.batchnorm._BatchNorm):
            errors.append(((a.running_mean - b.running_mean).abs()
                           / (b.running_var + a.eps).sqrt()).mean().item())
    return sum(errors) / len(errors)


class TrainEvalGap(Experiment):
    """Batch, running and precise statistics of BN; LN for contrast."""

    name = "train-eval-gap"
    title = "Training vs inference statistics"
    summary = _SUMMARY
    claims = (
        ("gap.bn_differs",
         "BatchNorm computes differently in training (batch statistics) and in inference "
         "(running averages); LayerNorm computes the same in both.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §2.3 and §4.1 table (训练/推理差异 有/无); "
         "《归一化那些事》 (训练和推理)"),
        ("gap.stale",
         "Stale running averages lower BatchNorm's inference accuracy; statistics "
         "recomputed over the training data (precise BN) recover it.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §5.2 (验证集性能突然下降); "
         "Wu & Johnson 2021 (Rethinking 'Batch' in BatchNorm: precise BN)"),
    )
    settings = {
        "tiny": {"seeds": 1, "steps": 20, "evals": 2},
        "quick": {"seeds": 3, "steps": 300, "evals": 5},
        "full": {"seeds": 5, "steps": 1500, "evals": 10},
    }

    def configs(self, settings):
        """One configuration per variant (BN momentum 0.1, 0.01; LN)."""
        return [(_key(norm, m), {"norm": norm, "momentum": m, "steps": settings["steps"],
                                 "batch_size": BASE_BATCH, "lr": BASE_LR,
                                 "evals": settings["evals"]},
                 settings["steps"] * 3e-3) for norm, m in VARIANTS]

    def run(self, config, seed, on_step=None):
        """Train the CNN, then measure it with batch, running and precise statistics."""
        data = digits(seed, "images")
        torch.manual_seed(seed)
        model = cnn(config["norm"])
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = config["momentum"]
        out = train_classifier(model, data, steps=config["steps"],
                               batch_size=config["batch_size"], lr=config["lr"], seed=seed,
                               evals=config["evals"], on_step=on_step)
        out["n_test"] = data.n_test
        out["acc_running"] = out["final_test_acc"]
        # the splits are ordered by class: shuffle, so that batches are i.i.d. samples
        g = torch.Generator().manual_seed(seed)
        test_order = torch.randperm(data.x_test.shape[0], generator=g)
        x_test, y_test = data.x_test[test_order], data.y_test[test_order]
        out["mode_gap"] = _relative_mode_gap(model, x_test[:config["batch_size"]])
        if config["norm"] == "bn":
            out["acc_batch"] = _batch_stat_accuracy(model, x_test, y_test,
                                                    config["batch_size"])
            precise = copy.deepcopy(model)
            x_train = data.x_train[torch.randperm(data.x_train.shape[0], generator=g)]
            chunks = [x_train[i:i + config["batch_size"]]
                      for i in range(0, x_train.shape[0], config["batch_size"])]
            update_bn_stats(precise, chunks)
            out["acc_precise"] = evaluate(precise, data.x_test, data.y_test)[0]
            out["stats_error"] = _stats_error(model, precise)
        return out

    def analyze(self, records):
        """Accuracies per kind of statistics; the two claims and a cell."""
        analysis, seeds = begin_analysis(records, len(VARIANTS))
        if not seeds:
            return analysis
        res = {(r["seed"], r["key"]): r["result"] for r in records}
        resolution = points_resolution(records[0]["result"]["n_test"])

        def values(norm, m, field):
            return [res[(s, _key(norm, m))][field] for s in seeds]

        bn_gap = values("bn", 0.1, "mode_gap")
        ln_gap = values("ln", None, "mode_gap")
        analysis.claims.append(self.make_claim("gap.bn_differs", [
            Check("BN (momentum 0.1): |train-mode - eval-mode output| / |eval-mode output|",
                  tuple(bn_gap), "relative difference", RESOLUTION["exact"],
                  f"mean {mean(bn_gap):.3g} on a test batch of {BASE_BATCH}"),
            ExactCheck("LN: train-mode and eval-mode outputs identical (relative difference "
                       f"<= {RESOLUTION['exact']:g})", True,
                       tuple(g <= RESOLUTION["exact"] for g in ln_gap),
                       f"largest relative difference {max(ln_gap):.3g}"),
        ]))
        precise = values("bn", 0.01, "acc_precise")
        running = values("bn", 0.01, "acc_running")
        analysis.claims.append(self.make_claim("gap.stale", [Check(
            "BN with stale averages (momentum 0.01): precise minus running accuracy",
            tuple(100 * (p - r) for p, r in zip(precise, running, strict=True)), "points",
            resolution,
            f"running {fmt_pm(running, 100)}%, precise {fmt_pm(precise, 100)}%, "
            f"batch statistics {fmt_pm(values('bn', 0.01, 'acc_batch'), 100)}%")]))
        rows = []
        for norm, m in VARIANTS:
            label = "LN" if norm == "ln" else f"BN, momentum {m}"
            if norm == "bn":
                rows.append([label, fmt_pm(values(norm, m, "acc_batch"), 100),
                             fmt_pm(values(norm, m, "acc_running"), 100),
                             fmt_pm(values(norm, m, "acc_precise"), 100),
                             fmt_pm(values(norm, m, "stats_error")),
                             fmt_pm(values(norm, m, "mode_gap"))])
            else:
                rows.append([label, "(same)", fmt_pm(values(norm, m, "acc_running"), 100),
                             "(same)", "—", fmt_pm(values(norm, m, "mode_gap"))])
        steps = records[0]["config"]["steps"]
        analysis.tables.append(Table(
            f"Test accuracy (%) after {steps} steps, mean ± sd over {len(seeds)} seeds",
            ["model", "batch statistics", "running statistics", "precise statistics",
             "running-stats error (std units)", "train/eval output difference"], rows))
        analysis.cells.append(Cell(
            "train_eval",
            f"train/eval outputs differ by {100 * mean(bn_gap):.1f}% (test accuracy: batch "
            f"stats {100 * mean(values('bn', 0.1, 'acc_batch')):.1f}%, running "
            f"{100 * mean(values('bn', 0.1, 'acc_running')):.1f}%)",
            f"train/eval outputs identical (difference {max(ln_gap):.1g})",
            self.name, ("gap.bn_differs",)))
        analysis.series = {
            "labels": ["BN m=0.1", "BN m=0.01"],
            "acc": {kind: [values("bn", m, f"acc_{kind}") for m in (0.1, 0.01)]
                    for kind in ("batch", "running", "precise")},
            "ln": values("ln", None, "acc_running"),
        }
        return analysis

    def figure(self, analysis):
        """Test accuracy per kind of statistics, BN variants and LN."""
        from ..figures import new_figure

        fig, (ax,) = new_figure(1, width=6.5)
        kinds = (("batch", "batch statistics", "tab:orange"),
                 ("running", "running statistics", "tab:blue"),
                 ("precise", "precise statistics", "tab:green"))
        labels = analysis.series["labels"]
        width = 0.25
        for k, (kind, label, color) in enumerate(kinds):
            vals = analysis.series["acc"][kind]
            xs = [i + (k - 1) * width for i in range(len(labels))]
            ys = [100 * mean(v) for v in vals]
            lo = [100 * (mean(v) - min(v)) for v in vals]
            hi = [100 * (max(v) - mean(v)) for v in vals]
            ax.bar(xs, ys, width, yerr=[lo, hi], label=label, color=color, capsize=3)
        ln = analysis.series["ln"]
        ax.bar([len(labels)], [100 * mean(ln)], width, color="tab:red", label="LN (one mode)",
               yerr=[[100 * (mean(ln) - min(ln))], [100 * (max(ln) - mean(ln))]], capsize=3)
        ax.set_xticks(list(range(len(labels) + 1)), [*labels, "LN"])
        low = min(100 * min(min(v) for vals in analysis.series["acc"].values() for v in vals),
                  100 * min(ln))
        ax.set_ylim(max(0.0, low - 5), 100)
        ax.set_ylabel("test accuracy (%), min-max over seeds")
        ax.set_title("CNN on digits: which statistics at inference")
        ax.legend(fontsize=8, loc="lower right")
        return fig
