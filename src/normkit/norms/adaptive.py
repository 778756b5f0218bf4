r"""Adaptive (conditional) normalization: the affine comes from a condition.

《深度学习归一化技术：BN与LN原理及应用对比》 §6 lists *adaptive normalization* -- norms
whose parameters follow the input -- among the frontier. Three forms in use:

* :class:`AdaptiveLayerNorm` -- LayerNorm whose scale and shift are a linear function of
  a condition vector per sample (the class label and time step of a diffusion
  transformer: DiT's adaLN, Peebles & Xie 2023; FiLM, Perez et al. 2018):
  ``y = LN(x) * (1 + scale(c)) + shift(c)``.
* :class:`AdaptiveGroupNorm` -- the same over GroupNorm for images (diffusers'
  ``AdaGroupNorm``, the time-conditioned blocks of diffusion U-Nets).
* :func:`adaptive_instance_norm` -- AdaIN (Huang & Belongie 2017, style transfer): each
  channel of the content features takes the mean and standard deviation of the same
  channel of the style features.

The normalization is normkit's (:class:`~normkit.LayerNorm`, :class:`~normkit.GroupNorm`
without affine, kept as the submodule ``norm``, so :func:`normkit.doctor` sees it); the
modulation is one ``nn.Linear`` (``modulation``), initialized to zero with
``zero_init=True`` so that the layer starts as the plain norm (adaLN-Zero's idea). Its
output is ``[scale, shift]``, in that order: diffusers' ``AdaGroupNorm`` order (its
``linear`` loads as ``modulation``); DiT's ``adaLN_modulation`` puts the shift first, so
swap the two halves of its rows when porting such weights.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.fx import Proxy

from .. import _stats
from .. import functional as F
from . import _nested
from ._arguments import check_arguments
from ._base import NotScriptable, fx_leaf
from ._core import check_floating, shape_str
from .group import GroupNorm
from .layer import LayerNorm

__all__ = ["AdaptiveLayerNorm", "AdaptiveGroupNorm", "adaptive_instance_norm"]


class _Modulated(NotScriptable, nn.Module):
    """A norm without affine, then ``* (1 + scale(c)) + shift(c)`` per sample."""

    features: int
    channel_dim: int  # the dim of x the scale and shift run along (negative: from the end)

    def _init_modulation(self, cond_features: int, zero_init: bool, device, dtype) -> None:
        if isinstance(cond_features, bool) or not isinstance(cond_features, numbers.Integral) \
                or cond_features < 1:
            raise ValueError(f"{type(self).__name__} expected cond_features to be a positive "
                             f"int, got {cond_features!r}")
        self.cond_features = int(cond_features)
        self.zero_init = bool(zero_init)
        self.modulation = nn.Linear(self.cond_features, 2 * self.features, device=device,
                                    dtype=dtype)
        if self.zero_init:
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)

    def _modulate(self, y: Tensor, cond: Tensor) -> Tensor:
        name = type(self).__name__
        if not isinstance(cond, Tensor):
            raise TypeError(f"{name} expected cond to be a tensor, got {type(cond).__name__}")
        if cond.dim() != 2 or cond.shape[1] != self.cond_features or (
                cond.shape[0] != y.shape[0]):
            raise ValueError(
                f"{name} expected cond of shape (N, cond_features) = ({y.shape[0]}, "
                f"{self.cond_features}) for input of shape {shape_str(y)}, got "
                f"{shape_str(cond)}")
        scale, shift = self.modulation(cond).chunk(2, dim=1)
        view = [y.shape[0]] + [1] * (y.dim() - 1)
        view[self.channel_dim] = self.features
        if y.is_nested:  # (a jagged (N, j, D) sequence batch: no nested addcmul in torch)
            out = y * (1 + scale).view(view) + shift.view(view)
        else:
            out = torch.addcmul(shift.view(view), y, (1 + scale).view(view))
        return out.to(torch.promote_types(y.dtype, scale.dtype))


class AdaptiveLayerNorm(_Modulated):
    r"""LayerNorm over the last dim whose scale and shift come from a condition per sample.

    .. math:: y = \mathrm{LN}(x) \odot (1 + \gamma(c)) + \beta(c),
              \quad [\gamma(c), \beta(c)] = W c + b

    DiT's adaptive LayerNorm (Peebles & Xie 2023), FiLM's feature-wise modulation
    (Perez et al. 2018) after a LayerNorm. Pass the condition through an activation
    first where a model does (DiT: ``SiLU``).

    Args:
        normalized_shape: the last dim's size ``D``.
        cond_features: the condition's size.
        eps: LayerNorm's. Default: ``1e-5`` (DiT: ``1e-6``).
        zero_init: start the modulation at zero, so the layer starts as the plain
            LayerNorm (adaLN-Zero). Default: ``True``.

    Shape:
        - ``x``: :math:`(N, *, D)`; ``cond``: :math:`(N, \text{cond\_features})`.
        - Output: as ``x``.

    Example:
        >>> ada = AdaptiveLayerNorm(8, cond_features=4)
        >>> x, c = torch.randn(2, 5, 8), torch.randn(2, 4)
        >>> torch.allclose(ada(x, c), torch.nn.functional.layer_norm(x, (8,)), atol=1e-6)
        True
        >>> sorted(ada.state_dict())
        ['modulation.bias', 'modulation.weight']
    """

    channel_dim = -1

    def __init__(self, normalized_shape: int, cond_features: int, eps: float = 1e-5, *,
                 zero_init: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        check_arguments("AdaptiveLayerNorm", {"eps": eps})
        if isinstance(normalized_shape, Sequence) and len(normalized_shape) == 1:
            normalized_shape = normalized_shape[0]
        if isinstance(normalized_shape, bool) or not isinstance(
                normalized_shape, numbers.Integral) or normalized_shape < 1:
            raise ValueError(f"AdaptiveLayerNorm expected normalized_shape to be one positive "
                             f"int (the last dim), got {normalized_shape!r}")
        self.features = int(normalized_shape)
        self.norm = LayerNorm(self.features, eps, elementwise_affine=False, device=device,
                              dtype=dtype)
        self._init_modulation(cond_features, zero_init, device, dtype)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        if isinstance(x, Proxy) or isinstance(cond, Proxy):
            return fx_leaf(self, x, cond)
        if isinstance(x, Tensor) and x.is_nested and (x.layout != torch.jagged
                                                       or x._ragged_idx != 1):
            raise ValueError(f"AdaptiveLayerNorm expected a dense tensor or a jagged nested "
                             f"tensor with its ragged dim second (N, j, ..., D), got "
                             f"{_nested.describe(x)}" + (
                                 "" if x.layout == torch.jagged else
                                 ": build it with torch.nested.nested_tensor(..., "
                                 "layout=torch.jagged)"))
        if x.dim() < 2:
            raise ValueError(f"AdaptiveLayerNorm expected input of shape (N, *, "
                             f"{self.features}) with a batch dim, got {shape_str(x)}")
        return self._modulate(self.norm(x), cond)

    def extra_repr(self) -> str:
        return (f"{self.features}, cond_features={self.cond_features}, eps={self.norm.eps}, "
                f"zero_init={self.zero_init}")


class AdaptiveGroupNorm(_Modulated):
    r"""GroupNorm whose per-channel scale and shift come from a condition per sample.

    .. math:: y = \mathrm{GN}(x) \odot (1 + \gamma(c)) + \beta(c)

    The time-conditioned norm of diffusion U-Nets (diffusers' ``AdaGroupNorm``); with
    ``num_groups == num_channels`` the conditional instance norm of style networks.

    Args:
        num_groups, num_channels, eps: GroupNorm's.
        cond_features: the condition's size.
        zero_init: start as the plain GroupNorm. Default: ``True``.

    Shape:
        - ``x``: :math:`(N, C, *)`; ``cond``: :math:`(N, \text{cond\_features})`.

    Example:
        >>> ada = AdaptiveGroupNorm(4, 16, cond_features=8, zero_init=False)
        >>> ada(torch.randn(2, 16, 5, 5), torch.randn(2, 8)).shape
        torch.Size([2, 16, 5, 5])
    """

    channel_dim = 1

    def __init__(self, num_groups: int, num_channels: int, cond_features: int,
                 eps: float = 1e-5, *, zero_init: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        check_arguments("AdaptiveGroupNorm", {"num_groups": num_groups,
                                              "num_channels": num_channels, "eps": eps})
        self.norm = GroupNorm(num_groups, num_channels, eps, affine=False, device=device,
                              dtype=dtype)
        self.features = int(num_channels)
        self._init_modulation(cond_features, zero_init, device, dtype)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        if isinstance(x, Proxy) or isinstance(cond, Proxy):
            return fx_leaf(self, x, cond)
        return self._modulate(self.norm(x), cond)

    def extra_repr(self) -> str:
        return (f"{self.norm.num_groups}, {self.features}, cond_features="
                f"{self.cond_features}, eps={self.norm.eps}, zero_init={self.zero_init}")


def adaptive_instance_norm(content: Tensor, style: Tensor, eps: float = 1e-5) -> Tensor:
    r"""AdaIN (Huang & Belongie 2017): each channel of ``content`` normalized, then given
    the mean and standard deviation of the same channel of ``style``.

    .. math:: \mathrm{AdaIN}(x, s) = \sigma(s) \frac{x - \mu(x)}{\sqrt{\sigma^2(x) +
              \epsilon}} + \mu(s)

    Statistics per sample and channel over the spatial dims, biased variance, in float32
    (float64 for float64 input); :math:`\sigma(s) = \sqrt{\sigma^2(s) + \epsilon}`. (The
    authors' code takes the unbiased variance plus ``eps`` for both: a factor
    ``sqrt(L / (L - 1))`` on ``sigma(s) / sigma(x)``, the same for every channel of
    ``L`` positions.) Differentiable in both inputs.

    Args:
        content: ``(N, C, *)``.
        style: ``(N, C, *)``, any spatial size (or ``(1, C, *)``: one style for all).
        eps: added to both variances. Default: ``1e-5``.

    Example:
        >>> content, style = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4) * 5 + 2
        >>> out = adaptive_instance_norm(content, style)
        >>> torch.allclose(out.mean((2, 3)), style.mean((2, 3)), atol=1e-4)
        True
    """
    who = "adaptive_instance_norm"
    for name, t in (("content", content), ("style", style)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{who} expected {name} to be a tensor, got {type(t).__name__}")
        check_floating(t, who)
        if t.dim() < 3:
            raise ValueError(f"{who} expected {name} of shape (N, C, *) with a spatial dim, "
                             f"got {shape_str(t)}")
    if style.shape[1] != content.shape[1] or style.shape[0] not in (1, content.shape[0]):
        raise ValueError(f"{who} expected style of shape ({content.shape[0]} or 1, "
                         f"{content.shape[1]}, *) for content of shape {shape_str(content)}, "
                         f"got {shape_str(style)}")
    if _stats.reduced_count(content.shape, range(2, content.dim())) < 2:
        raise ValueError(f"{who} expected content with at least 2 values per channel (its "
                         f"mean and variance normalize them), got {shape_str(content)}")
    normalized = F.instance_norm(content, eps=eps)
    dims = tuple(range(2, style.dim()))
    moments = _stats.moments(_stats.upcast(style), dims)
    mean = moments.mean_hi + moments.mean_lo
    std = (moments.var + eps).sqrt()
    view = (style.shape[0], style.shape[1]) + (1,) * (content.dim() - 2)
    out = torch.addcmul(mean.reshape(view), _stats.upcast(normalized), std.reshape(view))
    return out.to(torch.promote_types(content.dtype, style.dtype))
