"""ln-init: a small positive beta for a LayerNorm before a ReLU.

《深度学习归一化技术：BN与LN原理及应用对比》 §5.1 advises starting every norm at the identity
(gamma 1, beta 0) and, for a LayerNorm whose output goes straight into a ReLU, beta at a
small positive value such as 0.1, to avoid "dead neurons". Here: an MLP of 8 blocks
``Linear -> LayerNorm -> ReLU`` (width 64) on flattened digits, from the same weights
with beta 0 and with beta 0.1 (:func:`normkit.init_norms_` with
``bias_before_relu=0.1``), trained with SGD (momentum 0.9, rate 0.05) and with Adam
(1e-3), batch 32, for the same number of steps. Measured: the share of hidden units that
never activate on the training set (ReLU output 0 for every training example) at
initialization and after training; the final training loss and test error beside it.

Example:
    >>> [s.key for s in LNInit().plan("tiny", 0)]
    ['opt=sgd,beta=0', 'opt=sgd,beta=0.1', 'opt=adam,beta=0', 'opt=adam,beta=0.1']
"""

from __future__ import annotations

import torch
from torch import nn

from ...tools.init import init_norms_
from ..core import (
    ADAM_LR,
    ARTICLE_BN_LN,
    BASE_BATCH,
    BASE_LR,
    Experiment,
    Table,
    module_summary,
)
from ..datasets import digits
from ..models import mlp
from ..verdict import Check
from ._common import begin_analysis, fmt_pm, mean, train_configured

__all__ = ["LNInit", "dead_units"]

_SUMMARY = module_summary(__doc__)
DEPTH, WIDTH = 8, 64
BETAS = (0.0, 0.1)
OPTIMIZERS = {"sgd": ("SGD", BASE_LR), "adam": ("Adam", ADAM_LR)}


def dead_units(model: nn.Module, x: torch.Tensor) -> list[float]:
    """The share (in %) of the units of each of the model's ``nn.ReLU`` layers whose
    output is 0 for every example of ``x``, in the order they run.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with torch.no_grad():
        ...     _ = net[0].weight.copy_(torch.eye(2)), net[0].bias.copy_(torch.tensor([0., -9]))
        >>> dead_units(net, torch.rand(5, 2))
        [50.0]
    """
    alive: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, i, out: alive.append((out > 0).flatten(
        1).any(0))) for m in model.modules() if isinstance(m, nn.ReLU)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return [100.0 * float((~units).sum()) / units.numel() for units in alive]


def _beta_key(beta: float) -> str:
    return f"{beta:g}"


class LNInit(Experiment):
    """LayerNorm + ReLU MLP with beta initialized to 0 and to 0.1: dead units, loss."""

    name = "ln-init"
    title = "LayerNorm's beta before a ReLU"
    summary = _SUMMARY
    claims = (
        ("init.ln_beta",
         "Initializing the beta of a LayerNorm that feeds a ReLU to a small positive value "
         "(0.1) instead of 0 avoids dead neurons: fewer hidden units that never activate.",
         f"{ARTICLE_BN_LN} §5.1 (β初始化为小的正值(如0.1)以避免\"死神经元\")"),
    )
    settings = {
        "tiny": {"seeds": 1, "steps": 20, "evals": 2},
        "quick": {"seeds": 3, "steps": 400, "evals": 4},
        "full": {"seeds": 5, "steps": 1500, "evals": 10},
    }

    def configs(self, settings):
        """One configuration per (optimizer, beta)."""
        return [(f"opt={opt},beta={_beta_key(beta)}",
                 {"optimizer": opt, "beta": beta, "lr": lr, "steps": settings["steps"],
                  "evals": settings["evals"], "batch_size": BASE_BATCH, "depth": DEPTH,
                  "width": WIDTH}, settings["steps"] * 4e-3)
                for opt, (_, lr) in OPTIMIZERS.items() for beta in BETAS]

    def run(self, config, seed, on_step=None):
        """Build the MLP, set beta, count dead units, train, count them again."""
        data = digits(seed, "flat")
        torch.manual_seed(seed)
        model = mlp("ln", depth=config["depth"], width=config["width"])
        if config["beta"]:
            init_norms_(model, bias_before_relu=config["beta"])
        dead_init = dead_units(model, data.x_train)
        out = train_configured(model, data, config, seed, on_step,
                               optimizer=config["optimizer"], final_train_metrics=True)
        dead_final = dead_units(model.eval(), data.x_train)
        # (the blocks have equal widths: the model's share is their mean)
        out["dead_init"], out["dead_init_blocks"] = mean(dead_init), dead_init
        out["dead_final"], out["dead_final_blocks"] = mean(dead_final), dead_final
        return out

    def analyze(self, records):
        """Dead units at initialization and after training; the claim."""
        analysis, seeds = begin_analysis(records, len(OPTIMIZERS) * len(BETAS))
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["optimizer"], _beta_key(r["config"]["beta"])):
               r["result"] for r in records}
        first = records[0]["config"]
        units = first["depth"] * first["width"]
        resolution = 100.0 / units  # (one unit, in percent)
        steps = first["steps"]
        zero, small = (_beta_key(b) for b in BETAS)

        def values(opt, beta, field):
            return [res[(s, opt, beta)][field] for s in seeds]

        def fewer(label, opt, field):
            a, b = values(opt, zero, field), values(opt, small, field)
            return Check(label, tuple(x - y for x, y in zip(a, b, strict=True)), "points",
                         resolution, f"beta 0: {fmt_pm(a)} %, beta 0.1: {fmt_pm(b)} % dead")

        checks = [fewer("dead units at initialization, beta 0 minus beta 0.1", "sgd",
                        "dead_init")]
        checks += [fewer(f"dead units after {steps} {OPTIMIZERS[opt][0]} steps, beta 0 minus "
                         f"beta 0.1", opt, "dead_final") for opt in OPTIMIZERS]
        analysis.claims.append(self.make_claim("init.ln_beta", checks))
        rows = []
        for opt, (label, lr) in OPTIMIZERS.items():
            for beta in (zero, small):
                rows.append([f"{label} ({lr:g})", beta,
                             fmt_pm(values(opt, beta, "dead_init")),
                             fmt_pm(values(opt, beta, "dead_final")),
                             fmt_pm(values(opt, beta, "final_train_loss")),
                             fmt_pm([100.0 * (1.0 - a)
                                     for a in values(opt, beta, "final_test_acc")])])
        analysis.tables.append(Table(
            f"Mean ± sd over {len(seeds)} seeds; {DEPTH} blocks of {WIDTH} units "
            f"({units} ReLU units)",
            ["optimizer (rate)", "beta", "dead units at init (%)",
             f"dead units after {steps} steps (%)", "final training loss", "test error (%)"],
            rows,
            "A unit is dead when its ReLU output is 0 for every training example."))
        blocks = range(first["depth"])
        analysis.tables.append(Table(
            f"Dead units at initialization by block (%), mean over {len(seeds)} seeds",
            ["beta", *(f"block {b + 1}" for b in blocks)],
            [[beta, *(f"{mean([res[(s, 'sgd', beta)]['dead_init_blocks'][b] for s in seeds]):.3g}"
                      for b in blocks)] for beta in (zero, small)],
            "The same weights, only beta differs. A reading consistent with it (not "
            "tested on its own): a positive beta lifts every active unit by the same "
            "amount in every example, a component common to all examples, which the next "
            "linear layer turns into a fixed offset per unit; the next LayerNorm centres "
            "each example over its units, not each unit over the examples, so it keeps "
            "that offset, and units pushed down by it stay below zero everywhere."))
        analysis.series = {
            "dead": {f"{opt},{beta}": (mean(values(opt, beta, "dead_init")),
                                       mean(values(opt, beta, "dead_final")))
                     for opt in OPTIMIZERS for beta in (zero, small)},
        }
        return analysis

    def figure(self, analysis):
        """Dead units at initialization and after training, per optimizer and beta."""
        from ..figures import COLORS, new_figure

        fig, (ax,) = new_figure(1)
        labels = list(analysis.series["dead"])
        width = 0.38
        for i, (stage, color) in enumerate((("at initialization", COLORS["none"]),
                                            ("after training", COLORS["ln"]))):
            ax.bar([j + (i - 0.5) * width for j in range(len(labels))],
                   [analysis.series["dead"][k][i] for k in labels], width, color=color,
                   label=stage)
        ax.set_xticks(range(len(labels)),
                      [f"{OPTIMIZERS[k.split(',')[0]][0]}\nbeta {k.split(',')[1]}"
                       for k in labels])
        ax.set_ylabel("dead ReLU units (%; mean over seeds)")
        ax.set_title(f"LayerNorm + ReLU MLP ({DEPTH} x {WIDTH}) on digits")
        ax.legend(fontsize=8)
        return fig

