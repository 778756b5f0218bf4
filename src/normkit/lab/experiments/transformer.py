"""transformer: LayerNorm, BatchNorm and PowerNorm in a Transformer.

The articles' comparison table files Transformers under LayerNorm (《深度学习归一化技术：
BN与LN原理及应用对比》 §4.1-4.2: "RNN/Transformer must use LN"), and Shen et al. (2020)
find BatchNorm's batch statistics too unstable in NLP Transformers, proposing PowerNorm
(:class:`normkit.PowerNorm`), which they report beating BatchNorm and matching or
beating LayerNorm. Here: digits read as 8 tokens (rows) of 8 pixels, classified by a
small pre-norm Transformer encoder (:class:`normkit.lab.models.TransformerClassifier`:
2 blocks, width 32, 4 heads, the article's encoder layer) whose every norm is none,
LayerNorm, BatchNorm over the batch's tokens, or PowerNorm (its group scaling over one
group, batch statistics for the first tenth of the steps), all from the same initial
weights, trained with Adam (1e-3) at batch 32 and 4. Measured: the final test error
(eval mode: BatchNorm and PowerNorm use their running statistics).

A digit's rows are not text: the batch statistics of these tokens may be steadier than
a translation model's, so the verdicts speak for small Transformers on such data only.

Example:
    >>> [s.key for s in TransformerNorms().plan("tiny", 0)]
    ['batch=32,norm=none', 'batch=32,norm=ln', 'batch=32,norm=bn', 'batch=32,norm=pn']
"""

from __future__ import annotations

from ..core import ADAM_LR, ARTICLE_BN_LN, Cell, Experiment, Table, module_summary
from ..datasets import digits
from ..models import TRANSFORMER_NORMS, TransformerClassifier
from ..verdict import Check, points_resolution
from ._common import begin_analysis, fmt_pm, mean, train_configured

__all__ = ["TransformerNorms"]

_SUMMARY = module_summary(__doc__)
NORMS = TRANSFORMER_NORMS
LABELS = {"none": "no norm", "ln": "LayerNorm", "bn": "BatchNorm", "pn": "PowerNorm"}
COLOR_KEYS = {"none": "none", "ln": "ln", "bn": "bn", "pn": "pn"}
#: PowerNorm's warm-up with batch statistics, as a fraction of the run (the authors pass
#: their learning-rate warm-up, a few thousand of their tens of thousands of updates).
WARMUP_FRACTION = 0.1


class TransformerNorms(Experiment):
    """No norm, LayerNorm, BatchNorm and PowerNorm in a small Transformer on digit rows."""

    name = "transformer"
    title = "Normalization in a Transformer"
    summary = _SUMMARY
    claims = (
        ("tr.bn_unfit",
         "BatchNorm suits Transformers worse than LayerNorm: with the same budget, the "
         "Transformer with BatchNorm ends with a higher test error than with LayerNorm.",
         f"{ARTICLE_BN_LN} §4.1 table and §4.2 (RNN/Transformer -> LN); Shen et al. 2020 "
         "(PowerNorm), §3"),
        ("tr.pn",
         "PowerNorm trains a Transformer better than BatchNorm: a lower test error with "
         "the same budget.",
         f"Shen et al. 2020 (PowerNorm), §5; {ARTICLE_BN_LN} §6"),
    )
    settings = {
        "tiny": {"seeds": 1, "batch_sizes": [32], "steps": 12, "evals": 2},
        "quick": {"seeds": 3, "batch_sizes": [32, 4], "steps": 300, "evals": 5},
        "full": {"seeds": 5, "batch_sizes": [32, 4], "steps": 1000, "evals": 10},
    }

    def configs(self, settings):
        """One configuration per (batch size, norm)."""
        steps = settings["steps"]
        return [(f"batch={b},norm={n}",
                 {"batch_size": b, "norm": n, "steps": steps, "evals": settings["evals"],
                  "lr": ADAM_LR, "warmup_iters": max(1, round(WARMUP_FRACTION * steps))},
                 steps * (3e-3 if n in ("bn", "pn") else 2e-3))
                for b in settings["batch_sizes"] for n in NORMS]

    def run(self, config, seed, on_step=None):
        """Build the Transformer with its norms and train it with Adam."""
        import torch

        data = digits(seed, "rows")
        torch.manual_seed(seed)
        model = TransformerClassifier(config["norm"], features=data.x_train.shape[-1],
                                      tokens=data.x_train.shape[1],
                                      warmup_iters=config["warmup_iters"])
        return train_configured(model, data, config, seed, on_step)

    def analyze(self, records):
        """Final test errors per batch size; the two claims and a cell."""
        batches = list(dict.fromkeys(r["config"]["batch_size"] for r in records))
        analysis, seeds = begin_analysis(records, len(batches) * len(NORMS))
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["batch_size"], r["config"]["norm"]): r["result"]
               for r in records}
        resolution = points_resolution(records[0]["result"]["n_test"])
        steps = records[0]["config"]["steps"]
        unfit, pn = [], []
        errors = {}
        for b in batches:
            err = {n: [100 * (1 - res[(s, b, n)]["final_test_acc"]) for s in seeds]
                   for n in NORMS}
            errors[b] = err

            def worse(a, than, err=err, b=b):
                return Check(f"batch {b}: test error of {LABELS[a]} minus {LABELS[than]}",
                             tuple(x - y for x, y in zip(err[a], err[than], strict=True)),
                             "points", resolution,
                             f"{LABELS[a]} {fmt_pm(err[a])} %, {LABELS[than]} "
                             f"{fmt_pm(err[than])} %")

            unfit.append(worse("bn", "ln"))
            pn.append(worse("bn", "pn"))
            analysis.tables.append(Table(
                f"Batch {b}: test error after {steps} Adam steps, mean ± sd over "
                f"{len(seeds)} seeds", ["norm", "test error (%)"],
                [[LABELS[n], fmt_pm(err[n])] for n in NORMS]))
        first = batches[0]
        analysis.cells.append(Cell(
            "fit", f"Transformer (digit rows, batch {first}) error: "
                   f"{mean(errors[first]['bn']):.1f}% (BN)",
            f"Transformer (digit rows, batch {first}) error: "
            f"{mean(errors[first]['ln']):.1f}% (LN)", self.name, ("tr.bn_unfit",)))
        analysis.claims.append(self.make_claim("tr.bn_unfit", unfit))
        analysis.claims.append(self.make_claim("tr.pn", pn))
        analysis.series = {"batches": batches,
                           "errors": {str(b): errors[b] for b in batches}}
        return analysis

    def figure(self, analysis):
        """Final test error per norm, one group of bars per batch size."""
        from ..figures import COLORS, new_figure

        fig, (ax,) = new_figure(1)
        batches = analysis.series["batches"]
        width = 0.8 / len(NORMS)
        for i, n in enumerate(NORMS):
            values = [analysis.series["errors"][str(b)][n] for b in batches]
            xs = [j + (i - (len(NORMS) - 1) / 2) * width for j in range(len(batches))]
            ax.bar(xs, [mean(v) for v in values], width,
                   yerr=[[mean(v) - min(v) for v in values],
                         [max(v) - mean(v) for v in values]],
                   color=COLORS[COLOR_KEYS[n]], capsize=3, label=LABELS[n])
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel("final test error (%; min-max over seeds)")
        ax.set_title("2-block Transformer on digit rows, Adam")
        ax.legend(fontsize=8)
        return fig
