"""cost: forward + backward time of each normalization family at matched shapes.

The articles' table rates BN's compute overhead "lower" and LN's "slightly higher";
Zhang & Sennrich (2019) report RMSNorm 7-64 % faster than LN. Here every family runs
forward and backward on the same input with the same output gradient, timed with
``normkit bench``'s interleaved timer (:func:`normkit.bench.measure.interleaved`: each
round times every family once, starting from a different one, so machine noise hits
all of them) in the current process and thread count. Shapes: image features
``(N, C, H, W)`` for BN, LN over ``(C, H, W)`` (``GroupNorm(1, C)``), LayerNorm2d (over
``C`` at each position), GN and InstanceNorm; token features ``(N, D)`` for BN, LN and
RMSNorm. Both normkit's layers and torch.nn's are timed (torch has no LayerNorm2d),
since a cost claim is about a family and an implementation can decide it. Each seed is
one independent measurement (median over rounds).

Example:
    >>> [s.key for s in Cost().plan("tiny", 0)]
    ['shape=image', 'shape=tokens']
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from ...bench.measure import Timer, calibrate, interleaved
from ...norms.batch import BatchNorm1d, BatchNorm2d
from ...norms.group import GroupNorm, InstanceNorm2d
from ...norms.layer import LayerNorm, LayerNorm2d, RMSNorm
from ...registry import default_num_groups
from ..core import ARTICLE_BN_LN, Analysis, Cell, Experiment, Table, module_summary
from ..verdict import RESOLUTION, Check, log2_ratio
from ._common import fmt_pm, mean

__all__ = ["Cost", "families"]

_SUMMARY = module_summary(__doc__)
LABELS = {"bn": "BN", "ln": "LN", "ln2d": "LayerNorm2d", "gn": "GN", "in": "InstanceNorm",
          "rms": "RMSNorm"}
IMPLS = ("normkit", "torch")


def _label(name: str) -> str:
    family, _, impl = name.partition(":")
    return f"{LABELS[family]} ({'torch.nn' if impl == 'torch' else 'normkit'})"


def families(kind: str, shape: list[int]) -> dict[str, nn.Module]:
    """The layers timed for a shape kind (``image``: ``(N, C, H, W)``, ``tokens``: ``(N, D)``).

    Keys are ``family`` (normkit's layer) and ``family:torch`` (torch.nn's).

    Example:
        >>> sorted(families("tokens", [4, 8]))
        ['bn', 'bn:torch', 'ln', 'ln:torch', 'rms', 'rms:torch']
    """
    if kind == "image":
        c, g = shape[1], default_num_groups(shape[1])
        return {"bn": BatchNorm2d(c), "ln": GroupNorm(1, c), "ln2d": LayerNorm2d(c),
                "gn": GroupNorm(g, c), "in": InstanceNorm2d(c, affine=True),
                "bn:torch": nn.BatchNorm2d(c), "ln:torch": nn.GroupNorm(1, c),
                "gn:torch": nn.GroupNorm(g, c), "in:torch": nn.InstanceNorm2d(c, affine=True)}
    if kind == "tokens":
        d = shape[1]
        return {"bn": BatchNorm1d(d), "ln": LayerNorm(d), "rms": RMSNorm(d),
                "bn:torch": nn.BatchNorm1d(d), "ln:torch": nn.LayerNorm(d),
                "rms:torch": nn.RMSNorm(d)}
    raise ValueError(f"shape kind must be 'image' or 'tokens', got {kind!r}")


class Cost(Experiment):
    """Forward + backward time per family at matched shapes."""

    name = "cost"
    title = "Compute cost"
    summary = _SUMMARY
    claims = (
        ("cost.ln_vs_bn",
         "LayerNorm costs slightly more compute than BatchNorm at the same shape.",
         f"{ARTICLE_BN_LN} §3.3 and §4.1 table (计算开销 较低/略高)"),
        ("cost.rms_vs_ln",
         "RMSNorm runs faster than LayerNorm (7-64 % less time).",
         "Zhang & Sennrich 2019 (Root Mean Square Layer Normalization)"),
    )
    settings = {
        "tiny": {"seeds": 1, "image": [4, 16, 8, 8], "tokens": [64, 128], "rounds": 3,
                 "min_time": 0.0},
        "quick": {"seeds": 5, "image": [32, 64, 16, 16], "tokens": [2048, 512], "rounds": 5,
                  "min_time": 0.01},
        "full": {"seeds": 10, "image": [32, 64, 32, 32], "tokens": [8192, 1024], "rounds": 15,
                 "min_time": 0.02},
    }

    def configs(self, settings):
        """One configuration per shape kind (image, tokens)."""
        return [(f"shape={kind}", {"kind": kind, "shape": settings[kind],
                                   "rounds": settings["rounds"],
                                   "min_time": settings["min_time"]},
                 settings["rounds"] * 0.05) for kind in ("image", "tokens")]

    def run(self, config, seed, on_step=None):
        """Time forward + backward of every layer, interleaved; times go to ``timing``."""
        shape = config["shape"]
        modules = families(config["kind"], shape)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*shape, generator=g).requires_grad_()
        grad = torch.randn(*shape, generator=g)

        def step_of(module):
            def step():
                x.grad = None
                module.zero_grad(set_to_none=True)
                module(x).backward(grad)
            return step

        fns = {name: step_of(m.train()) for name, m in modules.items()}
        timer = Timer("cpu")
        per_call = []
        for fn in fns.values():
            fn()  # warm-up
            per_call.append(timer(fn, 1))
        number = calibrate(min(per_call), config["min_time"])
        samples = interleaved(fns, timer, config["rounds"], number)
        if on_step is not None:
            on_step(1, 1)
        return {"families": list(fns),
                "timing": {"median_s": {k: statistics.median(v) for k, v in samples.items()},
                           "number": number}}

    def analyze(self, records):
        """Time ratios per shape and implementation; the two claims and a cell."""
        analysis = Analysis(complete=bool(records))
        if not records:
            return analysis
        by_kind: dict[str, list[dict]] = {}
        for r in sorted(records, key=lambda r: r["seed"]):
            by_kind.setdefault(r["config"]["kind"], []).append(r)
        kinds = [k for k in ("image", "tokens") if k in by_kind]
        analysis.complete = len({len(v) for v in by_kind.values()}) == 1

        def ms(kind, fam):
            return [1e3 * r["timing"]["median_s"][fam] for r in by_kind[kind]]

        def ratio(kind, a, b):
            return tuple(log2_ratio(x, y) for x, y in zip(ms(kind, a), ms(kind, b),
                                                          strict=True))

        def shape_text(kind):
            return "x".join(str(s) for s in by_kind[kind][0]["config"]["shape"])

        def fam(name, impl):
            return name if impl == "normkit" else f"{name}:torch"

        def impl_text(impl):
            return "torch.nn" if impl == "torch" else "normkit"

        analysis.claims.append(self.make_claim("cost.ln_vs_bn", [Check(
            f"{kind} {shape_text(kind)}, {impl_text(impl)}: time LN / BN",
            ratio(kind, fam("ln", impl), fam("bn", impl)), "log2 ratio", RESOLUTION["ratio"],
            f"BN {fmt_pm(ms(kind, fam('bn', impl)))} ms, LN {fmt_pm(ms(kind, fam('ln', impl)))} "
            "ms") for kind in kinds for impl in IMPLS]))
        if "tokens" in by_kind:
            analysis.claims.append(self.make_claim("cost.rms_vs_ln", [Check(
                f"tokens {shape_text('tokens')}, {impl_text(impl)}: time LN / RMSNorm",
                ratio("tokens", fam("ln", impl), fam("rms", impl)), "log2 ratio",
                RESOLUTION["ratio"],
                f"LN {fmt_pm(ms('tokens', fam('ln', impl)))} ms, RMSNorm "
                f"{fmt_pm(ms('tokens', fam('rms', impl)))} ms") for impl in IMPLS]))
        threads = records[0]["threads"]
        for kind in kinds:
            fams = by_kind[kind][0]["result"]["families"]
            base = {impl: mean(ms(kind, fam("bn", impl))) for impl in IMPLS}
            analysis.tables.append(Table(
                f"{kind} {shape_text(kind)}: forward + backward, ms (median over rounds; mean "
                f"± sd over {len(by_kind[kind])} measurements; {threads} thread(s))",
                ["layer", "ms", "relative to BN of the same implementation"],
                [[_label(f), fmt_pm(ms(kind, f)),
                  f"{mean(ms(kind, f)) / base['torch' if ':torch' in f else 'normkit']:.2f}x"]
                 for f in fams]))
        analysis.notes.append("Wall-clock times depend on the machine, its load and the "
                              "thread count; rerunning gives other numbers.")

        def cell(name):
            parts = []
            for impl in IMPLS:
                times = []
                for kind in kinds:
                    t = mean(ms(kind, fam(name, impl)))
                    rel = t / mean(ms(kind, fam("bn", impl)))
                    times.append(f"{kind} {t:.3g} ms" + ("" if name == "bn" else
                                                         f" ({rel:.2f}x BN)"))
                parts.append(f"{impl_text(impl)}: " + ", ".join(times))
            return "; ".join(parts)

        analysis.cells.append(Cell("compute", cell("bn"), cell("ln"), self.name,
                                   ("cost.ln_vs_bn",)))
        analysis.series = {"kinds": kinds,
                           "ms": {k: {f: ms(k, f) for f in by_kind[k][0]["result"]["families"]}
                                  for k in kinds},
                           "shapes": {k: shape_text(k) for k in kinds}}
        return analysis

    def figure(self, analysis):
        """Forward + backward time per layer, one panel per shape."""
        from ..figures import COLORS, new_figure

        kinds = analysis.series["kinds"]
        fig, axes = new_figure(len(kinds), width=6.0, height=4.2)
        for ax, kind in zip(axes, kinds, strict=True):
            data = analysis.series["ms"][kind]
            names = list(data)
            ax.bar(range(len(names)), [mean(data[n]) for n in names],
                   yerr=[[mean(data[n]) - min(data[n]) for n in names],
                         [max(data[n]) - mean(data[n]) for n in names]],
                   color=[COLORS.get(n.partition(":")[0], "tab:gray") for n in names],
                   hatch=None, capsize=3)
            ax.set_xticks(range(len(names)), [_label(n) for n in names], fontsize=7,
                          rotation=35, ha="right")
            ax.set_ylabel("forward + backward, ms")
            ax.set_title(f"{kind} {analysis.series['shapes'][kind]}")
        return fig
