"""weight-norm: weight normalization, its data-dependent initialization, and its cost.

Salimans & Kingma (2016) write each weight vector as ``w = g v / |v|``: the
optimization then speeds up like with BN, without any statistics of the activations,
so it costs less than BN; initializing ``g`` and the bias from one batch
(``g = 1 / sigma``, ``b = -mu / sigma``, with ``v ~ N(0, 0.05^2)``) helps further.
《归一化那些事》 repeats both (加速收敛; 权重初始化 from the first batch). Here: the
quickstart's CNN plain (biases, no norm), with BN, with :func:`normkit.weight_norm` on
every convolution and the head, and the same with
:func:`normkit.data_dependent_init_` on a batch of 128 training images, all trained with
Adam as in the paper (default rate 1e-3, batch 32) for the same number of steps. Measured: the mean
training loss over the last evaluation interval at half and at the full budget, and
the median wall time per step.

Example:
    >>> [s.key for s in WeightNormExperiment().plan("tiny", 0)]
    ['param=plain', 'param=bn', 'param=wn', 'param=wn_init']
"""

from __future__ import annotations

import torch
from torch import nn

from ...weights import data_dependent_init_, weight_norm
from ..core import ADAM_LR, ARTICLE_NORM, BASE_BATCH, Experiment, Table, module_summary
from ..datasets import digits
from ..models import cnn
from ..training import train_classifier
from ..verdict import RESOLUTION, Check, log2_ratio
from ._common import begin_analysis, fmt_pm, mean

__all__ = ["WeightNormExperiment"]

_SUMMARY = module_summary(__doc__)
PARAMS = ("plain", "bn", "wn", "wn_init")
LABELS = {"plain": "plain", "bn": "BN", "wn": "WN", "wn_init": "WN + data-dependent init"}


def _build(param: str, seed: int, data) -> nn.Module:
    torch.manual_seed(seed)
    model = cnn("bn" if param == "bn" else "none")
    if param in ("wn", "wn_init"):
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                weight_norm(m)
    if param == "wn_init":
        generator = torch.Generator().manual_seed(seed)
        pick = torch.randperm(data.x_train.shape[0], generator=generator)[:128]
        data_dependent_init_(model, data.x_train[pick], redraw_v=True, generator=generator)
    return model


def _loss_at(curve: dict, step: int) -> float:
    """The mean training loss over the evaluation interval that ends at ``step``."""
    for s, loss in zip(curve["step"], curve["train_loss"], strict=True):
        if s >= step and loss is not None:
            return loss
    raise ValueError(f"no training loss recorded at or after step {step}")


class WeightNormExperiment(Experiment):
    """Plain, BN, WN and WN + data-dependent init: loss at fixed steps, time per step."""

    name = "weight-norm"
    title = "Weight normalization"
    summary = _SUMMARY
    claims = (
        ("wn.faster",
         "Weight normalization speeds up training compared with the plain "
         "parameterization: lower training loss after the same number of steps.",
         f"Salimans & Kingma 2016, §5; {ARTICLE_NORM} (加速收敛)"),
        ("wn.init",
         "Data-dependent initialization of g and b improves weight-normalized training "
         "further.",
         f"Salimans & Kingma 2016, §2.2; {ARTICLE_NORM} (权重初始化)"),
        ("wn.cheaper",
         "Weight normalization costs less time per step than BatchNorm (no statistics "
         "over the batch).",
         "Salimans & Kingma 2016, abstract and §2"),
    )
    settings = {
        "tiny": {"seeds": 1, "steps": 20, "evals": 4},
        "quick": {"seeds": 3, "steps": 240, "evals": 8},
        "full": {"seeds": 5, "steps": 1500, "evals": 20},
    }

    def configs(self, settings):
        """One configuration per parameterization."""
        return [(f"param={p}", {"param": p, "steps": settings["steps"],
                                "evals": settings["evals"], "lr": ADAM_LR,
                                "optimizer": "adam", "batch_size": BASE_BATCH},
                 settings["steps"] * 3e-3) for p in PARAMS]

    def run(self, config, seed, on_step=None):
        """Build the parameterization and train it with Adam for the step budget."""
        data = digits(seed, "images")
        model = _build(config["param"], seed, data)
        return train_classifier(model, data, steps=config["steps"],
                                batch_size=config["batch_size"], lr=config["lr"], seed=seed,
                                optimizer=config["optimizer"], evals=config["evals"],
                                on_step=on_step)

    def analyze(self, records):
        """Training losses at half and full budget, step times; the three claims."""
        analysis, seeds = begin_analysis(records, len(PARAMS))
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["param"]): r for r in records}
        steps = records[0]["config"]["steps"]
        half = steps // 2

        def loss(p, at):
            return [_loss_at(res[(s, p)]["result"]["curve"], at) for s in seeds]

        def step_ms(p):
            return [1e3 * res[(s, p)]["timing"]["step_s"] for s in seeds]

        def ratio(a, b):
            return tuple(log2_ratio(x, y) for x, y in zip(a, b, strict=True))

        def check(label, a, b, at):
            return Check(f"{label} at step {at}", ratio(loss(a, at), loss(b, at)),
                         "log2 ratio", RESOLUTION["ratio"],
                         f"{LABELS[a]} {fmt_pm(loss(a, at))}, {LABELS[b]} "
                         f"{fmt_pm(loss(b, at))}")

        analysis.claims.append(self.make_claim("wn.faster", [
            check("training loss plain / WN", "plain", "wn", at) for at in (half, steps)]))
        analysis.claims.append(self.make_claim("wn.init", [
            check("training loss WN / WN + init", "wn", "wn_init", at)
            for at in (half, steps)]))
        analysis.claims.append(self.make_claim("wn.cheaper", [Check(
            "median time per step BN / WN", ratio(step_ms("bn"), step_ms("wn")),
            "log2 ratio", RESOLUTION["ratio"],
            f"BN {fmt_pm(step_ms('bn'))} ms, WN {fmt_pm(step_ms('wn'))} ms (wall clock, "
            f"{records[0]['threads']} thread(s))")]))
        rows = [[LABELS[p], fmt_pm(loss(p, half)), fmt_pm(loss(p, steps)),
                 fmt_pm([res[(s, p)]["result"]["final_test_acc"] for s in seeds], 100),
                 fmt_pm(step_ms(p))] for p in PARAMS]
        analysis.tables.append(Table(
            f"Mean ± sd over {len(seeds)} seeds",
            ["parameterization", f"training loss at {half}", f"training loss at {steps}",
             "test accuracy (%)", "ms per step"], rows,
            "Times are wall-clock medians per run; they vary between machines and runs."))
        analysis.series = {
            "curves": {p: (res[(seeds[0], p)]["result"]["curve"]["step"][1:],
                           [mean([res[(s, p)]["result"]["curve"]["train_loss"][i]
                                  for s in seeds])
                            for i in range(1, len(res[(seeds[0], p)]["result"]["curve"]
                                                  ["step"]))])
                       for p in PARAMS},
            "ms": {p: step_ms(p) for p in PARAMS},
        }
        return analysis

    def figure(self, analysis):
        """Training-loss curves and time per step."""
        from ..figures import COLORS, new_figure

        fig, (left, right) = new_figure(2)
        for p in PARAMS:
            steps, losses = analysis.series["curves"][p]
            left.plot(steps, losses, "o-", ms=3, color=COLORS[p if p != "plain" else "none"],
                      label=LABELS[p])
        left.set_yscale("log")
        left.set_xlabel("step")
        left.set_ylabel("training loss (mean over interval and seeds)")
        left.set_title("CNN on digits: training loss")
        left.legend(fontsize=8)
        ms = analysis.series["ms"]
        right.bar(range(len(PARAMS)), [mean(ms[p]) for p in PARAMS],
                  yerr=[[mean(ms[p]) - min(ms[p]) for p in PARAMS],
                        [max(ms[p]) - mean(ms[p]) for p in PARAMS]],
                  color=[COLORS[p if p != "plain" else "none"] for p in PARAMS], capsize=3)
        right.set_xticks(range(len(PARAMS)), ["plain", "BN", "WN", "WN+init"])
        right.set_ylabel("ms per step (median per run; min-max over seeds)")
        right.set_title("time per training step")
        return fig
