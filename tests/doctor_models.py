"""Small models and batches for the ``normkit doctor`` command-line tests (test_doctor.py).

The CLI imports these by spec, e.g. ``doctor_models:healthy_cnn``, with this directory
as the working directory.

Example:
    >>> healthy_cnn()(make_batch()[0]).shape
    torch.Size([64, 10])
"""

from __future__ import annotations

import torch
from torch import nn

import normkit


def healthy_cnn() -> nn.Module:
    """A conv -> BatchNorm -> ReLU CNN that is healthy at batch 64 in train mode.

    Example:
        >>> type(healthy_cnn()[1]).__name__
        'BatchNorm2d'
    """
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), normkit.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )


def failing_cnn() -> nn.Module:
    """A CNN whose head has the wrong input width: layer ``"3"`` raises.

    Example:
        >>> failing_cnn()[3]
        Linear(in_features=10, out_features=2, bias=True)
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(),
                         nn.Linear(10, 2))


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """An ``(images, labels)`` batch of 64 3x8x8 images.

    Example:
        >>> [t.shape[0] for t in make_batch()]
        [64, 64]
    """
    gen = torch.Generator().manual_seed(1)
    return torch.randn(64, 3, 8, 8, generator=gen), torch.zeros(64, dtype=torch.long)


def not_a_model() -> int:
    """A factory that returns something other than a module.

    Example:
        >>> not_a_model()
        3
    """
    return 3


class OwnRMSNorm(nn.Module):
    """A norm of a model's own class, as Hugging Face's ``LlamaRMSNorm``; ``plus_one``
    scales by ``1 + weight`` as ``GemmaRMSNorm`` does (weight 0 is the identity scale).

    Example:
        >>> OwnRMSNorm(4)(torch.ones(2, 4))
        tensor([[1.0000, 1.0000, 1.0000, 1.0000],
                [1.0000, 1.0000, 1.0000, 1.0000]], grad_fn=<MulBackward0>)
    """

    def __init__(self, dim: int, plus_one: bool = False) -> None:
        super().__init__()
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1 + self.weight if self.plus_one else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """A LayerNorm over dim 1 of ``(N, C, H, W)`` written as a subclass of torch's, as
    timm's ``LayerNorm2d`` and Hugging Face's ``ConvNextLayerNorm`` are.

    Example:
        >>> ChannelsFirstLayerNorm(3)(torch.randn(2, 3, 4, 4)).shape
        torch.Size([2, 3, 4, 4])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
