"""smoothness: internal covariate shift vs the smoothness of the loss landscape.

The articles (and Ioffe & Szegedy 2015) explain BN by *internal covariate shift*: the
distribution of each layer's inputs keeps moving as earlier layers learn, and BN holds
it still. Santurkar et al. (2018) injected random, time-varying scale and shift after
every BN layer ("noisy BN") and found it trains about as well as BN although its
layer inputs move more; instead, BN makes the loss landscape smoother: along the
gradient the loss varies less, the gradient changes less (it is more *predictive*) and
the effective beta-smoothness is smaller. Here: a ReLU MLP (4 hidden layers of 64 units,
flattened digits) without normalization, with BN, and with noisy BN (per unit
``s ~ U(0.5, 1.5)``, ``m ~ U(-0.5, 0.5)``, redrawn every step), trained by SGD (0.05,
momentum 0.9, batch 32). At evenly spaced steps, on that step's batch: the loss and the
gradient at ``w - eta * g`` for ``eta = lr * (1, 2, 4, 8, 16)``, giving the loss range,
the largest gradient change ``|g(w - eta g) - g(w)|`` and the effective smoothness
``max |g(w - eta g) - g(w)| / |eta g|``; and on a fixed set of 256 training images,
each hidden layer's output mean and standard deviation per unit, whose relative change
between consecutive probes is the layer's *drift*.

Example:
    >>> [s.key for s in Smoothness().plan("tiny", 0)]
    ['norm=none', 'norm=bn', 'norm=noisy_bn']
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import BASE_BATCH, BASE_LR, Experiment, Table, module_summary
from ..datasets import digits
from ..models import mlp, resample_noise
from ..training import train_classifier
from ..verdict import RESOLUTION, Check, log2_ratio
from ._common import begin_analysis, fmt_pm, mean

__all__ = ["Smoothness", "landscape_probe"]

_SUMMARY = module_summary(__doc__)
NORMS = ("none", "bn", "noisy_bn")
LABELS = {"none": "no BN", "bn": "BN", "noisy_bn": "noisy BN"}
ETA_MULTIPLIERS = (1, 2, 4, 8, 16)


def _loss_and_grad(model: nn.Module, x, y) -> tuple[float, list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params)
    return loss.item(), [g.detach() for g in grads]


def _norm(tensors) -> float:
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).item()


def landscape_probe(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
                    multipliers=ETA_MULTIPLIERS) -> dict[str, float]:
    """Loss range, gradient change and effective beta-smoothness along the gradient.

    The model stays in training mode (BN uses batch statistics) but no running
    statistics change; its parameters are restored afterwards.

    Example:
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> out = landscape_probe(torch.nn.Linear(4, 3), torch.randn(8, 4),
        ...                       torch.randint(0, 3, (8,)), lr=0.1)
        >>> sorted(out)
        ['beta', 'grad_change', 'loss_range']
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved_momentum = [m.momentum for m in bns]
    saved_tracked = [m.num_batches_tracked.clone() for m in bns]
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    try:
        for m in bns:
            m.momentum = 0.0
        loss0, g0 = _loss_and_grad(model, x, y)
        gnorm = _norm(g0)
        losses, changes, betas = [loss0], [], []
        for k in multipliers:
            eta = lr * k
            with torch.no_grad():
                for p, w, g in zip(params, saved, g0, strict=True):
                    p.copy_(w - eta * g)
            loss, grad = _loss_and_grad(model, x, y)
            change = _norm([a - b for a, b in zip(grad, g0, strict=True)])
            losses.append(loss)
            changes.append(change)
            betas.append(change / (eta * gnorm) if gnorm > 0 else 0.0)
    finally:
        with torch.no_grad():
            for p, w in zip(params, saved, strict=True):
                p.copy_(w)
        for m, momentum, tracked in zip(bns, saved_momentum, saved_tracked, strict=True):
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)
    return {"loss_range": max(losses) - min(losses), "grad_change": max(changes),
            "beta": max(betas)}


@torch.no_grad()
def _layer_moments(model: nn.Module, x: torch.Tensor) -> list[tuple[list[float], list[float]]]:
    """Per hidden layer (the output of each activation): per-unit mean and std on ``x``."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    outputs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: outputs.append(out))
             for m in model.modules() if isinstance(m, nn.ReLU)]
    try:
        for m in bns:
            m.momentum = 0.0
        tracked = [m.num_batches_tracked.clone() for m in bns]
        model(x)
        for m, t in zip(bns, tracked, strict=True):
            m.num_batches_tracked.copy_(t)
    finally:
        for h in hooks:
            h.remove()
        for m, momentum in zip(bns, saved, strict=True):
            m.momentum = momentum
    return [(o.mean(0).tolist(), o.std(0, correction=0).tolist()) for o in outputs]


def _drift(previous, current) -> float:
    """(|mu' - mu| + |sigma' - sigma|) / |sigma| for one layer's per-unit moments."""
    mu0, sd0 = torch.tensor(previous[0]), torch.tensor(previous[1])
    mu1, sd1 = torch.tensor(current[0]), torch.tensor(current[1])
    scale = sd0.norm().clamp_min(1e-12)
    return (((mu1 - mu0).norm() + (sd1 - sd0).norm()) / scale).item()


class Smoothness(Experiment):
    """Activation drift and loss-landscape smoothness for no BN, BN and noisy BN."""

    name = "smoothness"
    title = "Internal covariate shift and loss-landscape smoothness"
    summary = _SUMMARY
    claims = (
        ("smooth.ics",
         "BatchNorm reduces internal covariate shift: the distribution of each hidden "
         "layer's output (the next layer's input) drifts less during training.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §1; 《归一化那些事》 (内部协变量偏移); "
         "Ioffe & Szegedy 2015"),
        ("smooth.noisy",
         "BN's benefit does not come from reducing internal covariate shift: noisy BN "
         "drifts more than BN yet still trains better than no BN.",
         "Santurkar et al. 2018 (How Does Batch Normalization Help Optimization?), §2"),
        ("smooth.landscape",
         "BatchNorm makes the loss landscape smoother: a smaller loss range along the "
         "gradient, a smaller gradient change (more predictive gradients) and a smaller "
         "effective beta-smoothness.",
         "Santurkar et al. 2018, §3 (Figure 4)"),
    )
    settings = {
        "tiny": {"seeds": 1, "steps": 20, "probes": 2, "depth": 2, "width": 16},
        "quick": {"seeds": 3, "steps": 300, "probes": 10, "depth": 4, "width": 64},
        "full": {"seeds": 5, "steps": 1500, "probes": 25, "depth": 4, "width": 64},
    }

    def configs(self, settings):
        """One configuration per norm (none, BN, noisy BN)."""
        return [(f"norm={n}", {"norm": n, "steps": settings["steps"],
                               "probes": settings["probes"], "depth": settings["depth"],
                               "width": settings["width"], "lr": BASE_LR,
                               "batch_size": BASE_BATCH},
                 settings["steps"] * 2.5e-3) for n in NORMS]

    def run(self, config, seed, on_step=None):
        """Train with landscape and drift probes at evenly spaced steps."""
        data = digits(seed, "flat")
        generator = torch.Generator().manual_seed(seed + 7919)
        torch.manual_seed(seed)
        model = mlp(config["norm"], config["depth"], config["width"], generator=generator)
        probe_x = data.x_train[torch.randperm(data.x_train.shape[0],
                                              generator=torch.Generator().manual_seed(seed))
                               [:256]]
        probes: list[dict] = []

        def probe(step, x, y):
            out = landscape_probe(model, x, y, config["lr"])
            out["step"] = step
            out["moments"] = _layer_moments(model, probe_x)
            probes.append(out)

        result = train_classifier(model, data, steps=config["steps"],
                                  batch_size=config["batch_size"], lr=config["lr"], seed=seed,
                                  evals=config["probes"], on_step=on_step,
                                  before_step=lambda step: resample_noise(model), probe=probe,
                                  final_train_metrics=True)
        drifts = [[_drift(a, b) for a, b in zip(p0["moments"], p1["moments"], strict=True)]
                  for p0, p1 in zip(probes, probes[1:], strict=False)]
        layers = len(probes[0]["moments"]) if probes else 0
        result["drift_per_layer"] = [mean([d[i] for d in drifts]) for i in range(layers)]
        result["probe_steps"] = [p["step"] for p in probes]
        for key in ("loss_range", "grad_change", "beta"):
            result[key] = [p[key] for p in probes]
        return result

    def analyze(self, records):
        """Drift per layer and landscape measures; the three claims."""
        analysis, seeds = begin_analysis(records, len(NORMS))
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["norm"]): r["result"] for r in records}

        def per_seed(norm, fn):
            return [fn(res[(s, norm)]) for s in seeds]

        def drift(norm):
            return per_seed(norm, lambda r: mean(r["drift_per_layer"]))

        def ratio(a, b):
            return tuple(log2_ratio(x, y) for x, y in zip(a, b, strict=True))

        layers = len(res[(seeds[0], "none")]["drift_per_layer"])
        ics = [Check(f"hidden layer {i + 1}: drift without BN / with BN",
                     ratio(per_seed("none", lambda r, i=i: r["drift_per_layer"][i]),
                           per_seed("bn", lambda r, i=i: r["drift_per_layer"][i])),
                     "log2 ratio", RESOLUTION["ratio"],
                     f"no BN {fmt_pm(per_seed('none', lambda r, i=i: r['drift_per_layer'][i]))}"
                     f", BN {fmt_pm(per_seed('bn', lambda r, i=i: r['drift_per_layer'][i]))}")
               for i in range(layers)]
        analysis.claims.append(self.make_claim("smooth.ics", ics))
        loss = {n: per_seed(n, lambda r: r["final_train_loss"]) for n in NORMS}
        analysis.claims.append(self.make_claim("smooth.noisy", [
            Check("drift (mean over layers): noisy BN / BN", ratio(drift("noisy_bn"),
                                                                   drift("bn")),
                  "log2 ratio", RESOLUTION["ratio"],
                  f"noisy BN {fmt_pm(drift('noisy_bn'))}, BN {fmt_pm(drift('bn'))}"),
            Check("final training loss: no BN / noisy BN", ratio(loss["none"],
                                                                 loss["noisy_bn"]),
                  "log2 ratio", RESOLUTION["ratio"],
                  f"no BN {fmt_pm(loss['none'])}, noisy BN {fmt_pm(loss['noisy_bn'])}, "
                  f"BN {fmt_pm(loss['bn'])}"),
        ]))
        measures = (("loss_range", "loss range along the gradient"),
                    ("grad_change", "gradient change along the gradient"),
                    ("beta", "effective beta-smoothness"))
        landscape = []
        for key, label in measures:
            a = per_seed("none", lambda r, key=key: mean(r[key]))
            b = per_seed("bn", lambda r, key=key: mean(r[key]))
            landscape.append(Check(f"{label}: no BN / BN (mean over probes)", ratio(a, b),
                                   "log2 ratio", RESOLUTION["ratio"],
                                   f"no BN {fmt_pm(a)}, BN {fmt_pm(b)}"))
        analysis.claims.append(self.make_claim("smooth.landscape", landscape))
        rows = []
        for n in NORMS:
            rows.append([LABELS[n], fmt_pm(loss[n]),
                         fmt_pm(per_seed(n, lambda r: r["final_test_acc"]), 100),
                         fmt_pm(drift(n)),
                         *[fmt_pm(per_seed(n, lambda r, key=key: mean(r[key])))
                           for key, _ in measures]])
        steps = records[0]["config"]["steps"]
        analysis.tables.append(Table(
            f"After {steps} steps, mean ± sd over {len(seeds)} seeds (probes: mean over "
            "training)",
            ["model", "final training loss", "test accuracy (%)", "drift", "loss range",
             "gradient change", "beta-smoothness"], rows))
        analysis.series = {
            "layers": layers,
            "drift": {n: [mean(per_seed(n, lambda r, i=i: r["drift_per_layer"][i]))
                          for i in range(layers)] for n in NORMS},
            "steps": res[(seeds[0], "none")]["probe_steps"],
            "probes": {f"{n}|{key}": [mean([res[(s, n)][key][i] for s in seeds])
                                      for i in range(len(res[(seeds[0], n)][key]))]
                       for n in NORMS for key, _ in measures},
        }
        return analysis

    def figure(self, analysis):
        """Drift per layer, loss range and beta-smoothness over training."""
        from ..figures import COLORS, new_figure

        fig, axes = new_figure(3, width=4.4)
        layers = analysis.series["layers"]
        width = 0.27
        for k, n in enumerate(NORMS):
            axes[0].bar([i + 1 + (k - 1) * width for i in range(layers)],
                        analysis.series["drift"][n], width, color=COLORS[n], label=LABELS[n])
        axes[0].set_xticks(range(1, layers + 1))
        axes[0].set_xlabel("hidden layer")
        axes[0].set_ylabel("drift between probes (relative)")
        axes[0].set_title("activation drift ('ICS')")
        axes[0].legend(fontsize=8)
        for ax, key, title in ((axes[1], "loss_range", "loss range along the gradient"),
                               (axes[2], "beta", "effective beta-smoothness")):
            for n in NORMS:
                vals = analysis.series["probes"][f"{n}|{key}"]
                ax.plot(analysis.series["steps"][:len(vals)], vals, "o-", ms=3,
                        color=COLORS[n], label=LABELS[n])
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_title(title)
            ax.legend(fontsize=8)
        return fig
