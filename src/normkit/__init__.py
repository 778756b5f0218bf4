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

from . import conventions, functional
from .data import StandardizedModel, Standardizer
from .norms.adaptive import AdaptiveGroupNorm, AdaptiveLayerNorm, adaptive_instance_norm
from .norms.batch import (
    BatchNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    FrozenBatchNorm,
    FrozenBatchNorm1d,
    FrozenBatchNorm2d,
    FrozenBatchNorm3d,
    renorm_limits,
)
from .norms.fused import (
    AddLayerNorm,
    AddRMSNorm,
    BatchNormAct1d,
    BatchNormAct2d,
    BatchNormAct3d,
    GroupNormAct,
)
from .norms.group import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .norms.layer import LayerNorm, LayerNorm2d, RMSNorm
from .norms.mean_only import MeanOnlyBatchNorm1d, MeanOnlyBatchNorm2d
from .norms.power import PowerNorm, padding_mask
from .norms.sync import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from .recurrent import LayerNormLSTM, LayerNormLSTMCell
from .registry import default_num_groups, get_norm_layer, norm_names, register_norm
from .tools.clip import AGC, adaptive_clip_grad_
from .tools.convert import convert_norms, patch, unpatch
from .tools.doctor import DoctorReport, doctor
from .tools.fold import FoldReport, fold_batchnorm, fold_bn_weights
from .tools.freeze import freeze_batchnorm, unfreeze_batchnorm
from .tools.init import init_norms_
from .tools.precise import update_bn_stats
from .tools.recommend import Recommendation, recommend
from .weights import (
    WeightNorm,
    WeightStandardization,
    activation_gain,
    data_dependent_init_,
    remove_weight_norm,
    remove_weight_standardization,
    weight_norm,
    weight_standardization,
)

__version__ = "0.1.0"

__all__ = [
    "conventions",
    "functional",
    "Standardizer",
    "StandardizedModel",
    "BatchNorm",
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
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "update_bn_stats",
    "FrozenBatchNorm",
    "FrozenBatchNorm1d",
    "FrozenBatchNorm2d",
    "FrozenBatchNorm3d",
    "freeze_batchnorm",
    "unfreeze_batchnorm",
    "BatchRenorm1d",
    "BatchRenorm2d",
    "BatchRenorm3d",
    "renorm_limits",
    "LayerNormLSTM",
    "LayerNormLSTMCell",
    "weight_norm",
    "remove_weight_norm",
    "data_dependent_init_",
    "WeightNorm",
    "weight_standardization",
    "remove_weight_standardization",
    "WeightStandardization",
    "activation_gain",
    "MeanOnlyBatchNorm1d",
    "MeanOnlyBatchNorm2d",
    "PowerNorm",
    "padding_mask",
    "convert_norms",
    "patch",
    "unpatch",
    "init_norms_",
    "adaptive_clip_grad_",
    "AGC",
    "fold_batchnorm",
    "fold_bn_weights",
    "FoldReport",
    "doctor",
    "DoctorReport",
    "recommend",
    "Recommendation",
    "AddLayerNorm",
    "AddRMSNorm",
    "BatchNormAct1d",
    "BatchNormAct2d",
    "BatchNormAct3d",
    "GroupNormAct",
    "AdaptiveLayerNorm",
    "AdaptiveGroupNorm",
    "adaptive_instance_norm",
]
