"""norm-free: a deep network without normalization layers (NF-Nets' recipe).

《深度学习归一化技术：BN与LN原理及应用对比》 §6 names normalization-free architectures
(NFNet) as the frontier: networks that train without any norm layer. Brock et al. (2021)
make that work with Scaled Weight Standardization (each convolution's weights
standardized per output channel, times ``gamma / sqrt(fan_in)`` and a learnable gain,
:func:`normkit.weight_standardization` with :func:`normkit.activation_gain`) and
adaptive gradient clipping (AGC, :class:`normkit.AGC`), which they credit for training
at large learning rates. Here: a 12-layer convolutional stack (3x3, 32 channels, ReLU,
no pooling until the global average before the linear head) on the digits, trained
with SGD at the lab's BatchNorm learning rate (0.05, momentum 0.9, batch 32) four ways:
plain weights, BatchNorm after every convolution (the reference), Scaled WS without
clipping, and Scaled WS with AGC (clip factor 0.01, the classifier unclipped). Measured:
test accuracy and the training loss over the last evaluation interval.

Example:
    >>> [s.key for s in NormFree().plan("tiny", 0)]
    ['net=plain', 'net=bn', 'net=ws', 'net=nf']
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...norms.batch import BatchNorm2d
from ...weights import activation_gain, weight_standardization
from ..core import ARTICLE_BN_LN, BASE_BATCH, BASE_LR, Experiment, Table, module_summary
from ..datasets import digits
from ..verdict import RESOLUTION, Check, log2_ratio, points_resolution
from ._common import begin_analysis, fmt_pm, mean, train_configured

__all__ = ["NormFree", "deep_cnn"]

_SUMMARY = module_summary(__doc__)
NETS = ("plain", "bn", "ws", "nf")
LABELS = {"plain": "plain weights", "bn": "BatchNorm", "ws": "Scaled WS, no clipping",
          "nf": "Scaled WS + AGC (NF)"}
COLOR_KEYS = {"plain": "none", "bn": "bn", "ws": "wn_init", "nf": "wn"}
DEPTH, WIDTH, CLIP = 12, 32, 0.01


def deep_cnn(net: str, depth: int = DEPTH, width: int = WIDTH) -> nn.Sequential:
    """``depth`` 3x3 convolutions of ``width`` channels with ReLU on ``(N, 1, 8, 8)``
    digits, global average pooling and a linear head; ``net`` is ``"plain"``, ``"bn"``
    (BatchNorm after each convolution, which then has no bias), or ``"ws"``/``"nf"``
    (Scaled WS with a gain; ``gamma`` is the gain of the ReLU each convolution reads,
    1 for the first).

    Example:
        >>> [type(m).__name__ for m in deep_cnn("bn", depth=2)][:4]
        ['Conv2d', 'BatchNorm2d', 'ReLU', 'Conv2d']
    """
    if net not in NETS:
        raise ValueError(f"deep_cnn expected net in {NETS}, got {net!r}")
    layers: list[nn.Module] = []
    channels = 1
    for i in range(depth):
        conv = nn.Conv2d(channels, width, 3, padding=1, bias=net != "bn")
        if net in ("ws", "nf"):
            conv = weight_standardization(conv, gamma=1.0 if i == 0 else activation_gain(
                "relu"), gain=True)
        layers.append(conv)
        if net == "bn":
            layers.append(BatchNorm2d(width))
        layers.append(nn.ReLU())
        channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def _last_loss(curve: dict) -> float:
    """The mean training loss of the last evaluation interval (inf for a diverged run,
    which stops with no loss recorded)."""
    losses = [loss for loss in curve["train_loss"] if loss is not None]
    if len(curve["train_loss"]) < 2 or curve["train_loss"][-1] is None or not losses:
        return math.inf
    return losses[-1]


class NormFree(Experiment):
    """Plain, BatchNorm, Scaled WS and Scaled WS + AGC on a deep stack: accuracy, loss."""

    name = "norm-free"
    title = "Normalization-free networks"
    summary = _SUMMARY
    claims = (
        ("nf.trains",
         "A deep network without normalization layers trains with Scaled Weight "
         "Standardization and adaptive gradient clipping, where the same network with "
         "plain weights does not: higher test accuracy, lower training loss.",
         f"Brock et al. 2021 (NFNets), §3-4; {ARTICLE_BN_LN} §6"),
        ("nf.agc",
         "Adaptive gradient clipping is what lets the normalizer-free network train at "
         "BatchNorm's learning rate: with it, higher test accuracy than without.",
         "Brock et al. 2021 (NFNets), §4"),
    )
    settings = {
        "tiny": {"seeds": 1, "steps": 12, "evals": 2},
        "quick": {"seeds": 3, "steps": 200, "evals": 4},
        "full": {"seeds": 5, "steps": 1000, "evals": 10},
    }

    def configs(self, settings):
        """One configuration per network."""
        return [(f"net={n}", {"net": n, "steps": settings["steps"], "evals": settings["evals"],
                              "lr": BASE_LR, "batch_size": BASE_BATCH,
                              "agc": CLIP if n == "nf" else None},
                 settings["steps"] * 1.5e-2) for n in NETS]

    def run(self, config, seed, on_step=None):
        """Build the network and train it with SGD (and AGC for ``nf``)."""
        data = digits(seed, "images")
        torch.manual_seed(seed)
        model = deep_cnn(config["net"])
        return train_configured(model, data, config, seed, on_step, optimizer="sgd",
                                agc=config["agc"])

    def analyze(self, records):
        """Test accuracy and last-interval training loss; the two claims."""
        analysis, seeds = begin_analysis(records, len(NETS))
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["net"]): r["result"] for r in records}
        resolution = points_resolution(records[0]["result"]["n_test"])

        def acc(n):
            return [100 * res[(s, n)]["final_test_acc"] for s in seeds]

        def loss(n):
            return [_last_loss(res[(s, n)]["curve"]) for s in seeds]

        def points(a, b):
            return Check(f"test accuracy {LABELS[a]} - {LABELS[b]}",
                         tuple(x - y for x, y in zip(acc(a), acc(b), strict=True)),
                         "points", resolution,
                         f"{LABELS[a]} {fmt_pm(acc(a))} %, {LABELS[b]} {fmt_pm(acc(b))} %")

        def loss_text(n):
            values = loss(n)
            finite = [v for v in values if math.isfinite(v)]
            text = fmt_pm(finite) if finite else "-"
            return text + (f" ({len(values) - len(finite)} diverged)"
                           if len(finite) < len(values) else "")

        ratio = tuple(log2_ratio(p, f) if math.isfinite(p) and math.isfinite(f) else (
            math.inf if math.isfinite(f) else 0.0) for p, f in zip(loss("plain"), loss("nf"),
                                                                   strict=True))
        analysis.claims.append(self.make_claim("nf.trains", [
            points("nf", "plain"),
            Check(f"training loss {LABELS['plain']} / {LABELS['nf']}", ratio, "log2 ratio",
                  RESOLUTION["ratio"],
                  f"{LABELS['plain']} {loss_text('plain')}, {LABELS['nf']} "
                  f"{loss_text('nf')}")]))
        analysis.claims.append(self.make_claim("nf.agc", [points("nf", "ws")]))
        rows = [[LABELS[n], fmt_pm(acc(n)), loss_text(n)] for n in NETS]
        steps = records[0]["config"]["steps"]
        analysis.tables.append(Table(
            f"Mean ± sd over {len(seeds)} seeds, {DEPTH} convolutions, {steps} SGD steps",
            ["network", "test accuracy (%)", "training loss, last interval"], rows,
            "BatchNorm is the reference the normalizer-free network is measured against; "
            "a diverged run stops at its first non-finite loss."))
        analysis.series = {
            "acc": {n: acc(n) for n in NETS},
            "curves": {n: (res[(seeds[0], n)]["curve"]["step"],
                           [mean([res[(s, n)]["curve"]["test_acc"][i] * 100 for s in seeds
                                  if i < len(res[(s, n)]["curve"]["test_acc"])])
                            for i in range(len(res[(seeds[0], n)]["curve"]["step"]))])
                       for n in NETS},
        }
        return analysis

    def figure(self, analysis):
        """Test-accuracy curves and final accuracies."""
        from ..figures import COLORS, new_figure

        fig, (left, right) = new_figure(2)
        for n in NETS:
            steps, accs = analysis.series["curves"][n]
            left.plot(steps, accs, "o-", ms=3, color=COLORS[COLOR_KEYS[n]], label=LABELS[n])
        left.set_xlabel("step")
        left.set_ylabel("test accuracy (%, mean over seeds)")
        left.set_title(f"{DEPTH}-layer CNN on digits, SGD lr {BASE_LR}")
        left.legend(fontsize=8)
        accs = analysis.series["acc"]
        right.bar(range(len(NETS)), [mean(accs[n]) for n in NETS],
                  yerr=[[mean(accs[n]) - min(accs[n]) for n in NETS],
                        [max(accs[n]) - mean(accs[n]) for n in NETS]],
                  color=[COLORS[COLOR_KEYS[n]] for n in NETS], capsize=3)
        right.set_xticks(range(len(NETS)), ["plain", "BN", "WS", "WS+AGC"])
        right.set_ylabel("final test accuracy (%; min-max over seeds)")
        right.set_title("without norm layers: WS and AGC")
        return fig
