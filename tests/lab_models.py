"""A small model and data loaders for the ``normkit lab compare`` tests (test_lab_compare.py).

The command imports them by spec, ``lab_models:make_model`` and
``lab_models:make_loaders``, with this directory on ``sys.path``.

Example:
    >>> train, test = make_loaders(16, seed=0)
    >>> x, y = next(iter(train))
    >>> make_model()(x).shape, y.dtype
    (torch.Size([16, 10]), torch.int64)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from normkit.quickstart import load_digits_tensors


def make_model() -> nn.Module:
    """A two-block CNN for 8x8 digits with ``torch.nn.BatchNorm2d`` layers.

    Example:
        >>> sum(isinstance(m, nn.BatchNorm2d) for m in make_model().modules())
        2
    """
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def make_mlp() -> nn.Module:
    """An MLP for flattened 8x8 digits with a ``torch.nn.LayerNorm`` (last-dim norm).

    Example:
        >>> make_mlp()(torch.randn(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(),
                         nn.Linear(32, 10))


class _Output:
    """A Hugging Face-style model output: the prediction as ``.logits``."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _HFStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()

    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(self.body(x))


def make_hf_style_model() -> nn.Module:
    """:func:`make_model` returning an object with ``.logits``, as Hugging Face models do.

    Example:
        >>> make_hf_style_model()(torch.randn(2, 1, 8, 8)).logits.shape
        torch.Size([2, 10])
    """
    return _HFStyle()


def make_loaders(batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Loaders over 256 training and 128 test digits; the training order follows ``seed``.

    Example:
        >>> [len(loader.dataset) for loader in make_loaders(32)]
        [256, 128]
    """
    x_train, y_train, x_test, y_test = load_digits_tensors(seed=0)  # class-ordered
    pick = torch.Generator().manual_seed(0)
    tr = torch.randperm(x_train.shape[0], generator=pick)[:256]
    te = torch.randperm(x_test.shape[0], generator=pick)[:128]
    train = TensorDataset(x_train[tr], y_train[tr])
    test = TensorDataset(x_test[te], y_test[te])
    generator = torch.Generator().manual_seed(seed)
    return (DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator),
            DataLoader(test, batch_size=64))
