"""Freeze and unfreeze every BatchNorm of a model (copies; the caller's model is untouched)."""

from __future__ import annotations

from torch import nn

from .._surgery import (
    keep_activation,
    layers_named,
    refuse_own_forwards,
    replace_modules,
    replace_naming_the_rest,
)
from ..norms.batch import (
    FrozenBatchNorm,
    FrozenBatchNorm1d,
    FrozenBatchNorm2d,
    FrozenBatchNorm3d,
)
from ..norms.mean_only import _MeanOnlyBatchNorm
from ..norms.power import PowerNorm

__all__ = ["freeze_batchnorm", "unfreeze_batchnorm"]

_BY_RANK = ((nn.BatchNorm1d, FrozenBatchNorm1d), (nn.BatchNorm2d, FrozenBatchNorm2d),
            (nn.BatchNorm3d, FrozenBatchNorm3d))


def _frozen_class(bn: nn.Module) -> type[FrozenBatchNorm]:
    for parent, frozen in _BY_RANK:
        if isinstance(bn, parent):
            return frozen
    return FrozenBatchNorm  # SyncBatchNorm and other rank-agnostic BatchNorms


def freeze_batchnorm(model: nn.Module, *, where=None) -> nn.Module:
    """A copy of ``model`` whose BatchNorm layers are FrozenBatchNorm (eval behaviour, fixed).

    Every torch or normkit BatchNorm (SyncBatchNorm and BatchRenorm included) becomes a
    :class:`normkit.FrozenBatchNorm` of the matching rank holding its running statistics
    and affine parameters as buffers: ``model.train()`` no longer changes them and the
    optimizer no longer sees them, while gradients still flow to earlier layers.
    The activation of :class:`normkit.BatchNormAct2d` (and 1d/3d) stays, after the frozen
    layer (an ``nn.Sequential`` of the two). Raises ValueError when the model holds no
    BatchNorm, or one without running statistics, or a subclass of torch's BatchNorm with
    a forward of its own (timm's ``BatchNormAct2d``: freezing it would drop its
    activation). ``where(name, module) -> bool`` selects the layers (default: every
    BatchNorm), e.g. to leave such subclasses out.

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        >>> frozen = normkit.freeze_batchnorm(net).train()
        >>> type(frozen[1]).__name__, len(list(frozen.parameters()))
        ('FrozenBatchNorm2d', 2)
    """
    def match(name, module):
        return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            where is None or bool(where(name, module)))

    refuse_own_forwards(model, match, "freeze_batchnorm", with_names=True,
                        hint="; leave them out with normkit.freeze_batchnorm(..., where=...)")
    # (running statistics that a training forward updates, with no frozen version)
    unfrozen = layers_named(model, (_MeanOnlyBatchNorm, PowerNorm), where)
    return replace_naming_the_rest(
        model, match,
        lambda name, bn: keep_activation(bn, _frozen_class(bn).from_batchnorm(bn)),
        "BatchNorm layers" + ("" if where is None else " selected by where"),
        "freeze_batchnorm", unfrozen,
        f"freeze_batchnorm found no BatchNorm to freeze in the {type(model).__name__}; its "
        f"{unfrozen} keep running statistics that training updates and have no frozen "
        f"version: put them in eval mode (module.eval()) to stop the updates",
        f"freeze_batchnorm left {unfrozen} as they are: they have no frozen version, so "
        f"training still updates their running statistics; put them in eval mode "
        f"(module.eval()) to stop that (pass where= to silence this by leaving them out "
        f"of the selection)")


def unfreeze_batchnorm(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose FrozenBatchNorm layers are trainable normkit BatchNorms.

    The running statistics and affine values carry over; ``num_batches_tracked``
    starts at 0 and ``momentum`` is torch's default 0.1. Raises ValueError when the
    model holds no FrozenBatchNorm.

    Example:
        >>> import torch, normkit
        >>> frozen = torch.nn.Sequential(normkit.FrozenBatchNorm2d(4))
        >>> type(normkit.unfreeze_batchnorm(frozen)[0]).__name__
        'BatchNorm2d'
    """
    def match(module):
        return isinstance(module, FrozenBatchNorm)

    refuse_own_forwards(model, match, "unfreeze_batchnorm")
    return replace_modules(model, match, lambda frozen: frozen.to_batchnorm(),
                           "FrozenBatchNorm layers", tool="unfreeze_batchnorm")
