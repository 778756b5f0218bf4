"""half-precision: BatchNorm and LayerNorm trained in float16.

《深度学习归一化技术：BN与LN原理及应用对比》 §5.4 says that in half-precision training
BatchNorm needs special handling while LayerNorm is usually friendlier, without saying
why. One mechanism: a BatchNorm keeps running statistics in the model's dtype, and
float16 holds at most 65504, so a channel whose input has a standard deviation above 256
stores an infinite running variance, and in inference that channel outputs its bias
alone; a LayerNorm keeps nothing between calls. (The normalizations themselves compute
their statistics in float32 in torch's kernels and normkit's, for either norm.) Here:
the quickstart's CNN with BatchNorm and with LayerNorm (one group per layer) on digits
standardized, then multiplied by an input scale (1: standardized; 1000: measurements
left in their raw units), trained by SGD (momentum 0.9, rate 0.05, batch 32) in float32
and entirely in float16 (``model.half()``: weights, gradients, optimizer state and
running statistics); BatchNorm at scale 1000 also with its layers kept in float32 inside
the float16 model (``layer.float()``, apex's ``keep_batchnorm_fp32``: float16 input,
float32 parameters and statistics). Measured: the final test error in inference (eval
mode: BatchNorm's running statistics), the error with the batch's statistics beside it,
and the running variances stored.

Example:
    >>> [s.key for s in HalfPrecision().plan("tiny", 0)][:3]
    ['scale=1,norm=bn,precision=float32', 'scale=1,norm=bn,precision=float16', \
'scale=1,norm=ln,precision=float32']
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn

from ..core import ARTICLE_BN_LN, BASE_BATCH, BASE_LR, Experiment, Table, module_summary
from ..datasets import digits
from ..models import cnn
from ..verdict import Check, points_resolution
from ._common import begin_analysis, fmt_pm, mean, train_configured

__all__ = ["HalfPrecision", "running_variances"]

_SUMMARY = module_summary(__doc__)
NORMS = {"bn": "BatchNorm", "ln": "LayerNorm"}
#: precision -> (label, model dtype, norm layers kept in float32)
PRECISIONS = {
    "float32": ("float32", torch.float32, False),
    "float16": ("float16", torch.float16, False),
    "float16_norms_float32": ("float16, norms in float32", torch.float16, True),
}
#: the largest input scale: where BatchNorm's stored variance passes float16's range
RAW_SCALE = 1000.0


def running_variances(model: nn.Module) -> dict[str, float | int]:
    """The running variances a model's BatchNorm layers store: the largest finite value
    (as float32), the number of infinite ones, and how many there are.

    Example:
        >>> bn = torch.nn.BatchNorm1d(3).half()
        >>> _ = bn.running_var.copy_(torch.tensor([1.0, 2.0, 1e5]))  # 1e5: inf in float16
        >>> running_variances(torch.nn.Sequential(bn))
        {'max_finite': 2.0, 'infinite': 1, 'channels': 3}
    """
    values = [m.running_var.detach().float().flatten() for m in model.modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_var is not None]
    if not values:
        return {"max_finite": 0.0, "infinite": 0, "channels": 0}
    var = torch.cat(values)
    finite = var[torch.isfinite(var)]
    return {"max_finite": float(finite.max()) if finite.numel() else 0.0,
            "infinite": int((~torch.isfinite(var)).sum()), "channels": var.numel()}


def _norms_to_float32(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):
            module.float()


def _key(scale: float, norm: str, precision: str) -> str:
    return f"scale={scale:g},norm={norm},precision={precision}"


class HalfPrecision(Experiment):
    """The CNN with BN and LN in float32 and in float16, at two input scales."""

    name = "half-precision"
    title = "Half-precision training"
    summary = _SUMMARY
    claims = (
        ("hp.bn_special",
         "In half-precision (float16) training BatchNorm needs special handling and "
         "LayerNorm is friendlier: trained in float16, BatchNorm's test error rises over "
         "float32 more than LayerNorm's.",
         f"{ARTICLE_BN_LN} §5.4 (半精度训练：BN需要特别处理，LN通常更友好)"),
        ("hp.bn_float32",
         "The special handling is BatchNorm kept in float32 inside the float16 model: "
         "where plain float16 raises its test error, that removes the rise (a lower test "
         "error than plain float16's).",
         "NVIDIA apex AMP (keep_batchnorm_fp32, opt level O2); "
         f"{ARTICLE_BN_LN} §5.4"),
    )
    settings = {
        "tiny": {"seeds": 1, "scales": [1.0, RAW_SCALE], "steps": 10, "evals": 1},
        "quick": {"seeds": 3, "scales": [1.0, RAW_SCALE], "steps": 200, "evals": 2},
        "full": {"seeds": 5, "scales": [1.0, 30.0, RAW_SCALE], "steps": 800, "evals": 4},
    }

    def configs(self, settings):
        """Per input scale: BN and LN in float32 and float16; at the raw scale BN also
        with its layers in float32."""
        out = []
        for scale in settings["scales"]:
            for norm in NORMS:
                for precision in PRECISIONS:
                    if precision == "float16_norms_float32" and (
                            norm != "bn" or scale != RAW_SCALE):
                        continue
                    config = {"scale": scale, "norm": norm, "precision": precision,
                              "lr": BASE_LR, "steps": settings["steps"],
                              "evals": settings["evals"], "batch_size": BASE_BATCH}
                    # (float16 convolutions run ~4x slower on the CPU)
                    cost = settings["steps"] * (1.3e-3 if precision == "float32" else 5e-3)
                    out.append((_key(scale, norm, precision), config, cost))
        return out

    def run(self, config, seed, on_step=None):
        """Train the CNN in the configuration's precision; measure both error kinds."""
        _, dtype, norms_float32 = PRECISIONS[config["precision"]]
        base = digits(seed, "images")
        data = dataclasses.replace(base, x_train=(base.x_train * config["scale"]).to(dtype),
                                   x_test=(base.x_test * config["scale"]).to(dtype))
        torch.manual_seed(seed)
        model = cnn(config["norm"]).to(dtype)
        if norms_float32:
            _norms_to_float32(model)
        with warnings.catch_warnings(record=True) as caught:
            # (normkit warns at inference over infinite running statistics: counted here)
            warnings.simplefilter("always", RuntimeWarning)
            out = train_configured(model, data, config, seed, on_step, optimizer="sgd")
        out["statistics_warnings"] = sum(issubclass(w.category, RuntimeWarning)
                                         and "in eval mode" in str(w.message)
                                         for w in caught)
        # the same weights normalized by each test batch's own statistics (train mode,
        # on a copy: the running statistics stay as training left them)
        with torch.no_grad():
            logits = copy.deepcopy(model).train()(data.x_test)
        out["batch_stats_test_acc"] = float((logits.argmax(1) == data.y_test).float().mean())
        out["running_var"] = running_variances(model)
        return out

    def analyze(self, records):
        """Errors per scale, norm and precision; the claims."""
        scales = sorted({r["config"]["scale"] for r in records})
        keys = {(r["config"]["scale"], r["config"]["norm"], r["config"]["precision"])
                for r in records}
        analysis, seeds = begin_analysis(records, len(keys))
        if not seeds:
            return analysis
        res = {(r["seed"], r["config"]["scale"], r["config"]["norm"],
                r["config"]["precision"]): r["result"] for r in records}
        first = records[0]
        resolution = points_resolution(first["result"]["n_test"])
        steps = first["config"]["steps"]

        def errors(scale, norm, precision, field="final_test_acc"):
            return [100.0 * (1.0 - res[(s, scale, norm, precision)][field]) for s in seeds]

        def rise(scale, norm):
            return [a - b for a, b in zip(errors(scale, norm, "float16"),
                                          errors(scale, norm, "float32"), strict=True)]

        checks = []
        for scale in scales:
            bn, ln = rise(scale, "bn"), rise(scale, "ln")
            checks.append(Check(
                f"input scale {scale:g}: BatchNorm's float16 - float32 test error minus "
                "LayerNorm's", tuple(b - n for b, n in zip(bn, ln, strict=True)), "points",
                resolution, f"rise BatchNorm {fmt_pm(bn)}, LayerNorm {fmt_pm(ln)} points"))
        analysis.claims.append(self.make_claim("hp.bn_special", checks))
        if RAW_SCALE in scales:
            plain = errors(RAW_SCALE, "bn", "float16")
            kept = errors(RAW_SCALE, "bn", "float16_norms_float32")
            single = errors(RAW_SCALE, "bn", "float32")
            analysis.claims.append(self.make_claim("hp.bn_float32", [
                Check(f"input scale {RAW_SCALE:g}: BatchNorm's float16 test error minus "
                      "float16 with the norms in float32",
                      tuple(a - b for a, b in zip(plain, kept, strict=True)), "points",
                      resolution, f"float16 {fmt_pm(plain)} %, norms in float32 "
                      f"{fmt_pm(kept)} %, float32 {fmt_pm(single)} %")]))
        rows = []
        for scale in scales:
            for norm, label in NORMS.items():
                for precision, (plabel, _, _) in PRECISIONS.items():
                    if (scale, norm, precision) not in keys:
                        continue
                    got = [res[(s, scale, norm, precision)] for s in seeds]
                    rows.append([
                        f"{scale:g}", label, plabel,
                        fmt_pm(errors(scale, norm, precision)),
                        fmt_pm(errors(scale, norm, precision, "batch_stats_test_acc")),
                        "—" if norm != "bn" else
                        f"{max(g['running_var']['max_finite'] for g in got):.3g}",
                        "—" if norm != "bn" else
                        f"{mean([g['running_var']['infinite'] for g in got]):.3g} of "
                        f"{got[0]['running_var']['channels']}",
                        f"{mean([g['statistics_warnings'] for g in got]):.3g}"])
        analysis.tables.append(Table(
            f"Test error (%) after {steps} SGD steps, mean ± sd over {len(seeds)} seeds",
            ["input scale", "norm", "precision", "test error (inference)",
             "test error (batch statistics)", "largest finite running variance",
             "infinite running variances", "normkit warnings"],
            rows,
            "Inference: eval mode (BatchNorm's running statistics). Batch statistics: the "
            "same weights normalizing each test batch by its own statistics (train mode on "
            "a copy). float16 holds at most 65504: a running variance past it (a channel's "
            "standard deviation above 256) is stored as inf, and that channel then outputs "
            "its bias alone in inference. normkit warnings: the RuntimeWarnings its layers "
            "gave at the inference forwards that read such statistics."))
        analysis.series = {
            "scales": scales,
            "errors": {f"{scale:g},{norm},{precision}": mean(errors(scale, norm, precision))
                       for (scale, norm, precision) in sorted(keys)},
        }
        return analysis

    def figure(self, analysis):
        """Inference test error per precision, one group of bars per scale and norm."""
        from ..figures import COLORS, new_figure

        fig, (ax,) = new_figure(1)
        errors = analysis.series["errors"]
        groups = [(scale, norm) for scale in analysis.series["scales"] for norm in NORMS]
        width = 0.27
        colors = (COLORS["none"], COLORS["ln"], COLORS["bn"])
        for i, (precision, (plabel, _, _)) in enumerate(PRECISIONS.items()):
            xs, ys = [], []
            for j, (scale, norm) in enumerate(groups):
                value = errors.get(f"{scale:g},{norm},{precision}")
                if value is not None:
                    xs.append(j + (i - 1) * width)
                    ys.append(value)
            ax.bar(xs, ys, width, color=colors[i], label=plabel)
        ax.set_xticks(range(len(groups)),
                      [f"{NORMS[norm]}\ninput scale {scale:g}" for scale, norm in groups])
        ax.set_ylabel("test error in inference (%; mean over seeds)")
        ax.set_title("CNN on digits trained in float32 and float16")
        ax.legend(fontsize=8)
        return fig
