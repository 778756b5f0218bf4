"""rnn: LayerNorm in recurrent networks, and BatchNorm's trouble with them.

Ba, Kiros & Hinton (2016) report that LayerNorm makes recurrent networks converge
faster; the articles say BN suits RNNs badly (statistics differ across time steps,
training and inference disagree) and LN suits them well. Here: digits read as
sequences, row by row (8 steps of 8 pixels) and, in the full profile, also pixel by
pixel (64 steps of 1 pixel), classified from the last state of a one-layer LSTM of 64
units: without normalization (``normkit.LayerNormLSTM(layer_norm=False)``, i.e.
``torch.nn.LSTM``'s computation), with LayerNorm (``normkit.LayerNormLSTM``) and with
BatchNorm on the same three terms, statistics shared over time
(:class:`normkit.lab.models.BatchNormLSTM`). All start from the same LSTM weights, train
with Adam (default rate 1e-3, batch 32) for the same number of steps. Measured: steps to
the target (90 % of the best accuracy any variant reached with the same seed) and the
final test error (eval mode: BN uses its running statistics).

Example:
    >>> [s.key for s in RNN().plan("tiny", 0)]
    ['task=rows,norm=none', 'task=rows,norm=ln', 'task=rows,norm=bn']
"""

from __future__ import annotations

from ..core import ADAM_LR, BASE_BATCH, Analysis, Cell, Experiment, Table, module_summary
from ..datasets import digits
from ..models import lstm_classifier
from ..verdict import RESOLUTION, Check, log2_ratio, points_resolution
from ._common import complete_seeds, fmt_pm, mean, target_steps, train_configured

__all__ = ["RNN"]

_SUMMARY = module_summary(__doc__)
NORMS = ("none", "ln", "bn")
LABELS = {"none": "LSTM", "ln": "LN-LSTM", "bn": "BN-LSTM"}
TASKS = {"rows": "row by row (8 x 8)", "pixels": "pixel by pixel (64 x 1)"}


class RNN(Experiment):
    """LSTM with and without LayerNorm (and with BatchNorm) on digit sequences."""

    name = "rnn"
    title = "LayerNorm in recurrent networks"
    summary = _SUMMARY
    claims = (
        ("rnn.ln_faster",
         "LayerNorm makes a recurrent network reach the target accuracy in fewer steps.",
         "Ba, Kiros & Hinton 2016 (Layer Normalization), §6; 《归一化那些事》 (LN per time step "
         "for RNN/LSTM)"),
        ("rnn.bn_unfit",
         "BatchNorm suits recurrent networks worse than LayerNorm: with the same budget, "
         "the BN-LSTM ends with a higher test error than the LN-LSTM.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §2.3 and §4.1 table (适合的网络类型: "
         "RNN/Transformer -> LN); 《归一化那些事》"),
    )
    settings = {
        "tiny": {"seeds": 1, "tasks": ["rows"], "hidden": 16, "steps": {"rows": 20},
                 "evals": 4},
        "quick": {"seeds": 3, "tasks": ["rows"], "hidden": 64, "steps": {"rows": 300},
                  "evals": 15},
        "full": {"seeds": 5, "tasks": ["rows", "pixels"], "hidden": 64,
                 "steps": {"rows": 1000, "pixels": 1500}, "evals": 25},
    }

    def configs(self, settings):
        """One configuration per (task, norm)."""
        out = []
        for task in settings["tasks"]:
            for norm in NORMS:
                steps = settings["steps"][task]
                config = {"task": task, "norm": norm, "hidden": settings["hidden"],
                          "steps": steps, "batch_size": BASE_BATCH, "lr": ADAM_LR,
                          "evals": settings["evals"]}
                per_step = 8 if task == "rows" else 64
                out.append((f"task={task},norm={norm}", config, steps * per_step * 6e-4))
        return out

    def run(self, config, seed, on_step=None):
        """Train one LSTM classifier with Adam for the step budget."""
        import torch

        data = digits(seed, config["task"])
        torch.manual_seed(seed)
        model = lstm_classifier(config["norm"], data.x_train.shape[-1], config["hidden"])
        return train_configured(model, data, config, seed, on_step)

    def analyze(self, records):
        """Steps to the target and final errors; the two claims and a cell."""
        analysis = Analysis()
        if not records:
            analysis.complete = False
            return analysis
        tasks = list(dict.fromkeys(r["config"]["task"] for r in records))
        seeds = complete_seeds(records, len(tasks) * len(NORMS))
        analysis.complete = bool(seeds) and len(seeds) == len({r["seed"] for r in records})
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["task"], r["config"]["norm"]): r for r in records}
        resolution = points_resolution(records[0]["result"]["n_test"])
        faster, unfit = [], []
        curves = {}
        for task in tasks:
            budget = res[(seeds[0], task, "none")]["config"]["steps"]
            reached = {n: [] for n in NORMS}
            used = {n: [] for n in NORMS}
            targets = []
            for seed in seeds:
                target, r, u = target_steps({n: res[(seed, task, n)]["result"] for n in NORMS},
                                            budget)
                targets.append(target)
                for n in NORMS:
                    reached[n].append(r[n])
                    used[n].append(u[n])
            errors = {n: [100 * (1 - res[(s, task, n)]["result"]["final_test_acc"])
                          for s in seeds] for n in NORMS}
            steps_text = {n: ", ".join("never" if v is None else str(v) for v in reached[n])
                          for n in NORMS}
            faster.append(Check(
                f"{TASKS[task]}: steps of LSTM / LN-LSTM",
                tuple(log2_ratio(a, b) for a, b in zip(used["none"], used["ln"], strict=True)),
                "log2 ratio", RESOLUTION["ratio"],
                f"steps to target per seed — LSTM: {steps_text['none']}; LN-LSTM: "
                f"{steps_text['ln']}"))
            unfit.append(Check(
                f"{TASKS[task]}: test error of BN-LSTM minus LN-LSTM after {budget} steps",
                tuple(b - a for a, b in zip(errors["ln"], errors["bn"], strict=True)),
                "points", resolution,
                f"BN-LSTM {fmt_pm(errors['bn'])}%, LN-LSTM {fmt_pm(errors['ln'])}%"))
            analysis.tables.append(Table(
                f"{TASKS[task]}: {budget} steps, target {100 * mean(targets):.1f}% "
                "(mean over seeds)",
                ["model", "steps to target (per seed)", "test error (%)"],
                [[LABELS[n], steps_text[n], fmt_pm(errors[n])] for n in NORMS]))
            for n in NORMS:
                results = [res[(s, task, n)]["result"] for s in seeds]
                steps = results[0]["curve"]["step"]
                curves[f"{task}|{n}"] = (steps, [
                    mean([r["curve"]["test_acc"][i] if i < len(r["curve"]["test_acc"])
                          else r["curve"]["test_acc"][-1] for r in results])
                    for i in range(len(steps))])
            if task == tasks[0]:
                analysis.cells.append(Cell(
                    "fit", f"LSTM ({task}) error: {mean(errors['bn']):.1f}% (BN-LSTM)",
                    f"LSTM ({task}) error: {mean(errors['ln']):.1f}% (LN-LSTM)", self.name,
                    ("rnn.bn_unfit",)))
        analysis.claims.append(self.make_claim(
            "rnn.ln_faster", faster,
            "Runs that never reach the target count as the budget plus one evaluation "
            "interval (a lower bound)."))
        analysis.claims.append(self.make_claim("rnn.bn_unfit", unfit))
        analysis.series = {"tasks": tasks, "curves": curves}
        return analysis

    def figure(self, analysis):
        """Mean test-accuracy curves, one panel per task."""
        from ..figures import COLORS, new_figure

        tasks = analysis.series["tasks"]
        fig, axes = new_figure(len(tasks))
        for ax, task in zip(axes, tasks, strict=True):
            for n in NORMS:
                steps, acc = analysis.series["curves"][f"{task}|{n}"]
                ax.plot(steps, [100 * a for a in acc], color=COLORS[n], label=LABELS[n])
            ax.set_title(f"digits {TASKS[task]}")
            ax.set_xlabel("step (Adam, batch 32)")
            ax.set_ylabel("test accuracy (%), mean over seeds")
            ax.set_ylim(0, 100)
            ax.legend(fontsize=8)
        return fig
