"""GroupNorm and InstanceNorm1d/2d/3d: drop-in subclasses of torch.nn's."""

from __future__ import annotations

import inspect
import warnings

from torch import Tensor, nn
from torch.fx import Proxy

from .. import functional as F
from ._base import BackendMixin, fx_leaf
from ._core import (
    check_channels,
    check_floating,
    check_running_statistics,
    forget_checked_statistics,
    shape_str,
    skip_recomputed_update,
)

__all__ = ["GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"]

#: Whether this torch's ``nn.GroupNorm`` takes the keyword-only ``bias`` (recent releases
#: do; torch 2.11, for one, does not).
TORCH_GROUP_NORM_TAKES_BIAS = "bias" in inspect.signature(nn.GroupNorm.__init__).parameters


class _GroupNormBiasKeyword(nn.GroupNorm):
    """``nn.GroupNorm`` with the ``bias`` keyword of recent torch releases, for torch
    releases without it: ``bias=False`` registers no bias (``state_dict`` has only
    ``weight``), and ``repr`` names ``bias`` as recent releases do."""

    def __init__(self, *args, bias: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.affine and not bias:
            self.bias = None  # (a None parameter, what recent torch registers for bias=False)

    def reset_parameters(self) -> None:
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}, bias={self.bias is not None}")


#: The torch.nn GroupNorm normkit's GroupNorm layers subclass: torch's own, or, on torch
#: releases whose GroupNorm has no ``bias`` keyword, a subclass that adds it.
TorchGroupNorm = nn.GroupNorm if TORCH_GROUP_NORM_TAKES_BIAS else _GroupNormBiasKeyword


class GroupNorm(BackendMixin, TorchGroupNorm):
    r"""Group Normalization (Wu & He 2018) over groups of channels of ``(N, C, *)`` input.

    .. math:: y = \frac{x - \mathrm{E}_g[x]}{\sqrt{\mathrm{Var}_g[x] + \epsilon}} \gamma_c + \beta_c

    Statistics are per sample and group, so accuracy does not depend on the batch
    size: the replacement for BatchNorm at small batches. A drop-in subclass of
    :class:`torch.nn.GroupNorm`; ``channels_last`` input is handled without copies.

    Args:
        num_groups: number of groups; must divide ``num_channels``.
        num_channels: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        affine: learnable per-channel ``weight`` and ``bias``. Default: ``True``.
        bias: learnable ``bias`` (with ``affine``). Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``. Default: ``"auto"``.

    Shape:
        - Input: :math:`(N, C, *)`; output: same shape and memory format.

    Example:
        >>> import torch, normkit
        >>> gn = normkit.GroupNorm(4, 16)
        >>> gn(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
    """

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        check_channels(self, input, self.num_channels)
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps,
                            backend=self.backend)


_IN_DOC = r"""Instance Normalization over {what} (Ulyanov et al. 2016).

    Each ``(sample, channel)`` slice is normalized over its spatial positions. A drop-in
    subclass of :class:`torch.nn.{name}` (defaults ``affine=False``,
    ``track_running_stats=False``; unbatched input accepted). With
    ``track_running_stats=True`` the running statistics are used in eval.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        momentum: running-average factor. ``None`` means 0, i.e. the running
            statistics never move (torch.nn's behaviour, kept for drop-in parity).
            Default: ``0.1``.
        affine: learnable per-channel ``weight`` and ``bias``. Default: ``False``.
        track_running_stats: keep running statistics. Default: ``False``.
        bias: learnable ``bias`` (with ``affine``). Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``. Default: ``"auto"``.

    Shape:
        - Input: {shape}; output: same.

    Example:
        >>> import torch, normkit
        >>> inorm = normkit.{name}(3)
        >>> y = inorm(torch.randn({example}))
        >>> y.shape == torch.Size([{example}])
        True
    """


class _InstanceNormForward(BackendMixin):
    """The forward shared by InstanceNorm1d/2d/3d (torch's ``_InstanceNorm`` logic)."""

    _spatial: int = 0

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        name = type(self).__name__
        check_floating(input, name)
        batched = self._spatial + 2
        if input.dim() not in (batched - 1, batched):
            raise ValueError(
                f"{name} expected {batched - 1}D (unbatched) or {batched}D (batched) "
                f"input, got a {input.dim()}D input of shape {shape_str(input)}"
            )
        unbatched = input.dim() == batched - 1
        x = input.unsqueeze(0) if unbatched else input
        if x.shape[1] != self.num_features:
            message = (
                f"{name} expected input with {self.num_features} channels "
                f"(dim {0 if unbatched else 1}), got input of shape {shape_str(input)}"
            )
            if self.affine or self.track_running_stats:
                raise ValueError(message)
            warnings.warn(message + "; num_features is unused without affine or running "
                          "statistics (torch.nn warns the same way)", stacklevel=2)
        factor = 0.0 if self.momentum is None else self.momentum
        use_input_stats = self.training or not self.track_running_stats
        if not use_input_stats:
            check_running_statistics(self)
        elif self.training:
            forget_checked_statistics(self)
        running = (self.running_mean, self.running_var)
        updates = use_input_stats and any(t is not None for t in running)
        if use_input_stats and skip_recomputed_update(self, updates):
            # activation checkpointing's recomputation of this forward: the update goes to
            # copies that are dropped (the first forward made it)
            running = tuple(None if t is None else t.clone() for t in running)
        y = F.instance_norm(
            x, *running, self.weight, self.bias, use_input_stats, factor, self.eps,
            backend=self.backend,
        )
        return y.squeeze(0) if unbatched else y


class InstanceNorm1d(_InstanceNormForward, nn.InstanceNorm1d):
    _spatial = 1
    __doc__ = _IN_DOC.format(name="InstanceNorm1d", what="each channel of a sequence",
                             shape=":math:`(N, C, L)` or :math:`(C, L)`", example="2, 3, 7")


class InstanceNorm2d(_InstanceNormForward, nn.InstanceNorm2d):
    _spatial = 2
    __doc__ = _IN_DOC.format(name="InstanceNorm2d", what="each channel of an image",
                             shape=":math:`(N, C, H, W)` or :math:`(C, H, W)`",
                             example="2, 3, 5, 5")


class InstanceNorm3d(_InstanceNormForward, nn.InstanceNorm3d):
    _spatial = 3
    __doc__ = _IN_DOC.format(name="InstanceNorm3d", what="each channel of a volume",
                             shape=":math:`(N, C, D, H, W)` or :math:`(C, D, H, W)`",
                             example="2, 3, 3, 4, 4")
