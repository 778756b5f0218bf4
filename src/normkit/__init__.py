"""normkit: normalization for deep learning, correct, robust and fast.

Drop-in subclasses of the torch.nn normalization layers (same arguments, parameters,
buffers and checkpoints) with numerically robust statistics, the layers torch lacks,
and a registry to build any of them by name.

Example:
    >>> import torch, normkit
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), normkit.BatchNorm2d(8))
    >>> model(torch.randn(4, 1, 8, 8)).shape
    torch.Size([4, 8, 6, 6])
"""

from . import functional
from .norms.batch import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .norms.group import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .norms.layer import LayerNorm, LayerNorm2d, RMSNorm
from .registry import default_num_groups, get_norm_layer, norm_names, register_norm

__version__ = "0.1.0"

__all__ = [
    "functional",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "LayerNorm",
    "LayerNorm2d",
    "RMSNorm",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "get_norm_layer",
    "register_norm",
    "norm_names",
    "default_num_groups",
]
