"""matplotlib helpers: figures drawn off-screen (Agg canvas) and saved as PNG bytes.

Figures are built with :class:`matplotlib.figure.Figure` directly, never through
``pyplot``, so no window, no global figure state and no display are involved.

Example:
    >>> fig, (ax,) = new_figure(1)
    >>> _ = ax.plot([0, 1], [1, 0])
    >>> png_bytes(fig)[:8]
    b'\\x89PNG\\r\\n\\x1a\\n'
"""

from __future__ import annotations

import io

__all__ = ["new_figure", "png_bytes", "COLORS", "errorbar_series"]

#: One color per norm name, the same in every figure.
COLORS = {
    "none": "tab:gray", "bn": "tab:blue", "brn": "tab:cyan", "gn": "tab:green",
    "ln": "tab:red", "rms": "tab:orange", "noisy_bn": "tab:purple", "wn": "tab:olive",
    "wn_init": "tab:brown", "in": "tab:pink", "pn": "darkgoldenrod",
}


def new_figure(ncols: int, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """A figure with ``nrows x ncols`` axes; returns ``(figure, flat list of axes)``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def png_bytes(fig, dpi: int = 90) -> bytes:
    """The figure as PNG bytes (no timestamp metadata, so equal figures give equal bytes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None})
    return buffer.getvalue()


def errorbar_series(ax, xs, values_per_x, label: str, color: str | None = None,
                    marker: str = "o") -> None:
    """Plot the mean of each ``values_per_x`` entry with a bar for the min-max over seeds.

    ``None`` values (failed or diverged runs) are left out of a point; a point with no
    value is not drawn.
    """
    pts = []
    for x, values in zip(xs, values_per_x, strict=True):
        vals = [v for v in values if v is not None]
        if vals:
            mean = sum(vals) / len(vals)
            pts.append((x, mean, mean - min(vals), max(vals) - mean))
    if not pts:
        return
    x, y, lo, hi = zip(*pts, strict=True)
    ax.errorbar(x, y, yerr=[lo, hi], label=label, color=color, marker=marker, capsize=3,
                ms=4, lw=1.2)
