"""The lab's data: scikit-learn's bundled digits (no download) and synthetic tasks.

* :func:`digits`: the 1797 8x8 digit images, stratified 75/25 split seeded by ``seed``,
  standardized with training statistics (see :func:`normkit.quickstart.load_digits_tensors`),
  as images ``(N, 1, 8, 8)``, flat vectors ``(N, 64)``, or sequences read row by row
  ``(N, 8, 8)`` or pixel by pixel ``(N, 64, 1)``.
* :func:`two_scale_regression`: the article's example, one feature in 0-1 and one in
  0-10000, with a linear target.

Example:
    >>> split = digits(0, "flat")
    >>> tuple(split.x_train.shape), tuple(split.x_test.shape), split.n_test
    ((1347, 64), (450, 64), 450)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Split", "digits", "LAYOUTS", "two_scale_regression"]

#: Layouts of :func:`digits`.
LAYOUTS = ("images", "flat", "rows", "pixels")


@dataclass(frozen=True)
class Split:
    """A train/test split of a classification task (tensors are shared: do not modify)."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    @property
    def n_test(self) -> int:
        """Number of test examples."""
        return int(self.y_test.shape[0])

    @property
    def n_classes(self) -> int:
        """Number of classes (labels are ``0 .. n_classes - 1``)."""
        return int(max(self.y_train.max(), self.y_test.max())) + 1


@functools.lru_cache(maxsize=16)
def _images(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from ..quickstart import load_digits_tensors

    return load_digits_tensors(seed)


def digits(seed: int, layout: str = "images") -> Split:
    """scikit-learn's digits, split and standardized with ``seed``, in a ``layout``.

    Args:
        seed: seeds the stratified split.
        layout: ``"images"`` ``(N, 1, 8, 8)``, ``"flat"`` ``(N, 64)``, ``"rows"``
            ``(N, 8, 8)`` (8 steps of 8 pixels) or ``"pixels"`` ``(N, 64, 1)``.

    Example:
        >>> tuple(digits(0, "pixels").x_test.shape)
        (450, 64, 1)
    """
    if layout not in LAYOUTS:
        raise ValueError(f"digits expected a layout in {', '.join(LAYOUTS)}, got {layout!r}")
    x_train, y_train, x_test, y_test = _images(seed)
    shape = {"images": (1, 8, 8), "flat": (64,), "rows": (8, 8), "pixels": (64, 1)}[layout]
    return Split(x_train.reshape(-1, *shape), y_train, x_test.reshape(-1, *shape), y_test)


def two_scale_regression(n: int, seed: int, noise: float = 0.1) -> tuple[Tensor, Tensor]:
    """The article's two-feature example: ``x1 ~ U(0, 1)``, ``x2 ~ U(0, 10000)``.

    The target is linear in both features with effects of the same size,
    ``y = 2 x1 - 3 x2 / 10000 + 1 + noise * N(0, 1)``, so both features matter equally
    and only their scales differ.

    Args:
        n: number of examples.
        seed: seeds the draw.
        noise: standard deviation of the additive noise (the best achievable RMSE).

    Returns:
        ``(x, y)``: float32 ``(n, 2)`` and ``(n, 1)``.

    Example:
        >>> x, y = two_scale_regression(1000, seed=0)
        >>> bool(x[:, 0].max() <= 1), bool(x[:, 1].max() > 9000), tuple(y.shape)
        (True, True, (1000, 1))
    """
    generator = torch.Generator().manual_seed(seed)
    x1 = torch.rand(n, 1, generator=generator)
    x2 = torch.rand(n, 1, generator=generator) * 10000.0
    eps = torch.randn(n, 1, generator=generator)
    y = 2.0 * x1 - 3.0 * x2 / 10000.0 + 1.0 + noise * eps
    return torch.cat([x1, x2], dim=1), y
