"""invariances: what re-scaling and re-centering leave unchanged, checked numerically.

Ba, Kiros & Hinton (2016, Table 1) list the invariances of BN, weight normalization
and LN under six transformations; Zhang & Sennrich (2019) give RMSNorm's (re-scaling,
never re-centering). Here a bias-free linear layer ``a = W x`` (for WN, the layer
``g v / |v| . x + b``) feeds the norm, in float64 with ``eps = 1e-300`` (no effect on
the variances), on random weights and a random batch of 32 examples. Each
transformation is applied and the norm's output compared with the original one:
*invariant* when the largest difference is at most ``1e-6`` relative (float64
round-off is ~1e-15). The transformations: weight matrix re-scaling ``W -> d W``,
weight matrix re-centering ``W -> W + 1 c^T`` (the same vector added to every row),
weight vector re-scaling (row ``i`` times ``d_i``), dataset re-scaling ``x -> d x``,
dataset re-centering ``x -> x + c``, single training case re-scaling (example ``n``
times ``d_n``). The same code also probes which dimensions the statistics span (the
articles' first table row): for BN over ``(N, C, H, W)`` and LN over ``(C, H, W)``, one
input value is changed and the outputs that move are counted: of other examples, of
other channels of the same example, of other positions of the same channel.

Example:
    >>> [s.key for s in Invariances().plan("tiny", 0)]
    ['check=table1']
"""

from __future__ import annotations

import torch
from torch import nn

from ...norms.batch import BatchNorm1d, BatchNorm2d
from ...norms.layer import LayerNorm, RMSNorm
from ...weights import weight_norm
from ..core import Analysis, Cell, Experiment, Table, module_summary
from ..verdict import RESOLUTION, ExactCheck

__all__ = ["Invariances", "TRANSFORMS", "EXPECTED", "measure_invariances"]

_SUMMARY = module_summary(__doc__)

TRANSFORMS = (
    ("weight_rescale", "weight matrix re-scaling"),
    ("weight_recenter", "weight matrix re-centering"),
    ("weight_vector_rescale", "weight vector re-scaling"),
    ("data_rescale", "dataset re-scaling"),
    ("data_recenter", "dataset re-centering"),
    ("case_rescale", "single training case re-scaling"),
)
#: Ba et al. 2016 Table 1 (BN, WN, LN) and Zhang & Sennrich 2019 (RMSNorm): invariant?
EXPECTED = {
    "bn": (True, False, True, True, True, False),
    "wn": (True, False, True, False, False, False),
    "ln": (True, True, False, True, False, True),
    "rms": (True, False, False, True, False, True),
}
NORMS = {"bn": "BatchNorm", "wn": "WeightNorm", "ln": "LayerNorm", "rms": "RMSNorm"}
#: Expected "does the output of ... move?" for (other examples, other channels, other
#: positions of the same channel) — the articles' "normalized dimensions" row.
DIMS_EXPECTED = {"bn": (True, False, True), "ln": (False, True, True)}
DIMS = ("other examples", "other channels", "other positions, same channel")


def _layer_output(norm: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The norm applied to ``W x`` (WN: the weight-normalized layer itself), in train mode."""
    out_features = weight.shape[0]
    if norm == "wn":
        layer = weight_norm(nn.Linear(weight.shape[1], out_features, dtype=torch.float64))
        with torch.no_grad():
            layer.parametrizations.weight.original1.copy_(weight)  # v
            layer.parametrizations.weight.original0.fill_(1.5)     # g
            layer.bias.fill_(0.25)
        return layer(x)
    a = x @ weight.T  # (N, out)
    if norm == "bn":
        layer = BatchNorm1d(out_features, eps=1e-300, dtype=torch.float64)
    elif norm == "ln":
        layer = LayerNorm(out_features, eps=1e-300, dtype=torch.float64)
    else:
        layer = RMSNorm(out_features, eps=1e-300, dtype=torch.float64)
    return layer.train()(a)


def _transform(name: str, weight: torch.Tensor, x: torch.Tensor,
               g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    def positive(*shape):
        return 0.5 + 2.5 * torch.rand(*shape, generator=g, dtype=torch.float64)

    if name == "weight_rescale":
        return weight * positive(1), x
    if name == "weight_recenter":
        return weight + torch.randn(1, weight.shape[1], generator=g, dtype=torch.float64), x
    if name == "weight_vector_rescale":
        return weight * positive(weight.shape[0], 1), x
    if name == "data_rescale":
        return weight, x * positive(1)
    if name == "data_recenter":
        return weight, x + torch.randn(1, x.shape[1], generator=g, dtype=torch.float64)
    if name == "case_rescale":
        return weight, x * positive(x.shape[0], 1)
    raise ValueError(f"unknown transformation {name!r}")


@torch.no_grad()
def measure_invariances(seed: int, n: int = 32, d_in: int = 12,
                        d_out: int = 16) -> dict[str, dict[str, float]]:
    """Relative max output change per norm and transformation (0 ~ invariant).

    Example:
        >>> out = measure_invariances(0)
        >>> out["ln"]["weight_recenter"] < 1e-12, out["bn"]["case_rescale"] > 1e-3
        (True, True)
    """
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64) + 0.5
    out: dict[str, dict[str, float]] = {}
    for norm in EXPECTED:
        base = _layer_output(norm, weight, x)
        out[norm] = {}
        for name, _ in TRANSFORMS:
            w2, x2 = _transform(name, weight, x, torch.Generator().manual_seed(seed + 1))
            new = _layer_output(norm, w2, x2)
            out[norm][name] = ((new - base).abs().max() / base.abs().max()).item()
    return out


@torch.no_grad()
def measure_dims(seed: int) -> dict[str, list[float]]:
    """For BN (N, C, H, W) and LN over (C, H, W): how much outputs move when one input
    value changes — max |change| among other examples, other channels, other positions.

    Example:
        >>> out = measure_dims(0)
        >>> out["bn"][1] == 0.0, out["ln"][0] == 0.0
        (True, True)
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
    layers = {"bn": BatchNorm2d(3, eps=1e-300, dtype=torch.float64).train(),
              "ln": LayerNorm([3, 5, 5], eps=1e-300, dtype=torch.float64)}
    x2 = x.clone()
    x2[0, 0, 0, 0] += 1.0
    out = {}
    for name, layer in layers.items():
        diff = (layer(x2) - layer(x)).abs()
        other_examples = diff[1:].max().item()
        other_channels = diff[0, 1:].max().item()
        same_channel = diff[0, 0].flatten()[1:].max().item()
        out[name] = [other_examples, other_channels, same_channel]
    return out


class Invariances(Experiment):
    """Ba et al. Table 1 for BN, WN, LN (+ RMSNorm), and the normalized dimensions."""

    name = "invariances"
    title = "Invariances (Ba et al. 2016, Table 1) and normalized dimensions"
    summary = _SUMMARY
    claims = (
        ("inv.table1",
         "BN, WN and LN have exactly the invariances of Table 1 of the LayerNorm paper "
         "(BN: weight matrix and vector re-scaling, dataset re-scaling and re-centering; "
         "WN: weight matrix and vector re-scaling; LN: weight matrix re-scaling and "
         "re-centering, dataset re-scaling, single-case re-scaling).",
         "Ba, Kiros & Hinton 2016 (Layer Normalization), Table 1"),
        ("inv.rms",
         "RMSNorm is invariant to re-scaling (weight matrix, dataset, single case) but not "
         "to re-centering.",
         "Zhang & Sennrich 2019 (Root Mean Square Layer Normalization), §4"),
        ("inv.dims",
         "BN normalizes over the batch and spatial dimensions (each channel separately); "
         "LN over the features of each example.",
         "《深度学习归一化技术：BN与LN原理及应用对比》 §4.1 table (归一化维度); 《归一化那些事》 "
         "(输入形状的影响)"),
    )
    settings = {"tiny": {"seeds": 1}, "quick": {"seeds": 3}, "full": {"seeds": 10}}

    def configs(self, settings):
        """A single configuration (the checks are cheap); one run per seed."""
        return [("check=table1", {"n": 32, "d_in": 12, "d_out": 16}, 0.01)]

    def run(self, config, seed, on_step=None):
        """Measure every invariance and the dimension probe for one seed."""
        out = {"invariance": measure_invariances(seed, config["n"], config["d_in"],
                                                 config["d_out"]),
               "dims": measure_dims(seed)}
        if on_step is not None:
            on_step(1, 1)
        return out

    def analyze(self, records):
        """One exact check per table cell; the three claims and a comparison cell."""
        analysis = Analysis(complete=bool(records))
        if not records:
            return analysis
        tol = RESOLUTION["exact"]
        results = [r["result"] for r in sorted(records, key=lambda r: r["seed"])]

        def cell_check(norm, i, name, label):
            diffs = [r["invariance"][norm][name] for r in results]
            return ExactCheck(f"{NORMS[norm]}: {label}", EXPECTED[norm][i],
                              tuple(d <= tol for d in diffs),
                              f"largest relative output change {max(diffs):.2g}")

        table1 = [cell_check(norm, i, name, label) for norm in ("bn", "wn", "ln")
                  for i, (name, label) in enumerate(TRANSFORMS)]
        rms = [cell_check("rms", i, name, label) for i, (name, label) in enumerate(TRANSFORMS)]
        analysis.claims.append(self.make_claim("inv.table1", table1))
        analysis.claims.append(self.make_claim("inv.rms", rms))
        dims = []
        for norm in ("bn", "ln"):
            for j, what in enumerate(DIMS):
                moves = [r["dims"][norm][j] for r in results]
                dims.append(ExactCheck(
                    f"{'BN' if norm == 'bn' else 'LN'}: changing one input moves outputs of "
                    f"{what}", DIMS_EXPECTED[norm][j], tuple(m > tol for m in moves),
                    f"largest change {max(moves):.2g}"))
        analysis.claims.append(self.make_claim("inv.dims", dims))

        def mark(norm, i, name):
            worst = max(r["invariance"][norm][name] for r in results)
            got = "invariant" if worst <= tol else "no"
            agree = (worst <= tol) == EXPECTED[norm][i]
            return f"{got} ({worst:.0e})" + ("" if agree else " ≠ paper")

        analysis.tables.append(Table(
            f"Measured invariance (largest relative output change over {len(results)} "
            "seeds; invariant if <= 1e-6); '≠ paper' marks a disagreement with the source",
            ["transformation", *[NORMS[n] for n in EXPECTED]],
            [[label, *[mark(n, i, name) for n in EXPECTED]]
             for i, (name, label) in enumerate(TRANSFORMS)]))
        analysis.tables.append(Table(
            "Which outputs move when one input value changes (largest change)",
            ["norm", *DIMS],
            [[label, *[f"{max(r['dims'][n][j] for r in results):.2g}" for j in range(3)]]
             for n, label in (("bn", "BN over (N, H, W) per channel"),
                              ("ln", "LN over (C, H, W) per example"))]))

        def spans(norm):
            moved = [any(r["dims"][norm][j] > tol for r in results) for j in range(3)]
            parts = [what for what, m in zip(("batch", "channels", "spatial"), moved,
                                             strict=True) if m]
            return "statistics span " + " x ".join(parts)

        analysis.cells.append(Cell("dims", spans("bn"), spans("ln"), self.name, ("inv.dims",)))
        analysis.series = {"diffs": {n: {name: max(r["invariance"][n][name] for r in results)
                                         for name, _ in TRANSFORMS} for n in EXPECTED}}
        return analysis

    def figure(self, analysis):
        """The largest relative output change per norm and transformation."""
        from ..figures import new_figure

        fig, (ax,) = new_figure(1, width=7.5, height=3.4)
        norms = list(EXPECTED)
        grid = [[max(analysis.series["diffs"][n][name], 1e-17) for n in norms]
                for name, _ in TRANSFORMS]
        import math

        data = [[math.log10(v) for v in row] for row in grid]
        image = ax.imshow(data, cmap="viridis_r", vmin=-17, vmax=1, aspect="auto")
        ax.set_xticks(range(len(norms)), [NORMS[n] for n in norms])
        ax.set_yticks(range(len(TRANSFORMS)), [label for _, label in TRANSFORMS])
        for i in range(len(TRANSFORMS)):
            for j in range(len(norms)):
                invariant = grid[i][j] <= RESOLUTION["exact"]
                ax.text(j, i, "inv." if invariant else "no", ha="center", va="center",
                        color="white" if data[i][j] < -8 else "black", fontsize=8)
        fig.colorbar(image, ax=ax, label="log10 relative output change")
        ax.set_title("Invariances measured in float64 (inv. = change <= 1e-6)")
        return fig
