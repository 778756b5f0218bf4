"""LayerNorm, RMSNorm and LayerNorm2d: drop-ins (and the channels-first LN torch lacks)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.fx import Proxy

from .. import functional as F
from ._base import BackendMixin, fx_leaf
from ._core import check_channels

__all__ = ["LayerNorm", "RMSNorm", "LayerNorm2d"]


class LayerNorm(BackendMixin, nn.LayerNorm):
    r"""Layer Normalization over the trailing ``normalized_shape`` dims (Ba et al. 2016).

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    A drop-in subclass of :class:`torch.nn.LayerNorm` (same constructor, parameters and
    ``state_dict``). Statistics are per sample, so training and inference behave the
    same and the batch size does not matter: the choice for RNNs and Transformers.
    Statistics use a compensated mean in float32 (float64 for float64 input).

    Args:
        normalized_shape: trailing shape to normalize over (an int or a sequence).
        eps: added to the variance. Default: ``1e-5``.
        elementwise_affine: learnable ``weight`` (and ``bias``). Default: ``True``.
        bias: learnable ``bias`` (with ``elementwise_affine``). Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``. Default: ``"auto"``.

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`; output: same.

    Example:
        >>> import torch, normkit
        >>> ln = normkit.LayerNorm(16)
        >>> y = ln(torch.randn(2, 5, 16))
        >>> torch.allclose(y.mean(-1), torch.zeros(2, 5), atol=1e-5)
        True
    """

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps,
                            backend=self.backend)


class RMSNorm(BackendMixin, nn.RMSNorm):
    r"""Root Mean Square Normalization over the trailing dims (Zhang & Sennrich 2019).

    .. math:: y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \gamma

    A drop-in subclass of :class:`torch.nn.RMSNorm`. ``eps=None`` uses the machine
    epsilon of float32 (float64 for float64 input), like torch. Unlike torch's CPU
    composite, the forward is one statistic and one scaling pass and the backward is
    hand-derived.

    Args:
        normalized_shape: trailing shape to normalize over.
        eps: added to the mean square, or ``None``. Default: ``None``.
        elementwise_affine: learnable ``weight``. Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``. Default: ``"auto"``.

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`; output: same.

    Example:
        >>> import torch, normkit
        >>> rms = normkit.RMSNorm(8)
        >>> y = rms(torch.randn(3, 8))
        >>> torch.allclose(y.square().mean(-1), torch.ones(3), atol=1e-4)
        True
    """

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps,
                          backend=self.backend)


class LayerNorm2d(BackendMixin, nn.LayerNorm):
    r"""LayerNorm over the channel dimension of channels-first ``(N, C, *)`` input.

    What ConvNeXt-style CNNs need and torch lacks: each spatial position of each sample
    is normalized over its ``C`` channels. A subclass of :class:`torch.nn.LayerNorm`
    with ``normalized_shape=(C,)``, so its ``state_dict`` (``weight``, ``bias``) is a
    plain LayerNorm's; no permutes and no copies, and ``channels_last`` input stays
    ``channels_last``.

    Args:
        num_channels: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        elementwise_affine: learnable per-channel ``weight`` (and ``bias``). Default: ``True``.
        bias: learnable ``bias``. Default: ``True``.
        backend: ``"auto"``, ``"eager"``, ``"reference"`` or ``"triton"`` (GPU kernels:
            channels-first tiles read in place for NCHW input, the row kernels for
            channels-last). Default: ``"auto"``.

    Shape:
        - Input: :math:`(N, C, *)`; output: same shape and memory format.

    Note:
        timm's form (permute, LayerNorm, permute back) returns a channels-last-strided
        tensor from NCHW input; on the CPU the next convolution runs faster on that
        layout, so a ConvNeXt step on NCHW input measured slower with this layer's NCHW
        output even though the layer itself is faster (``benchmarks/RESULTS.md``,
        "Whole training steps on the CPU"). For speed, run such a network
        ``channels_last``: then both keep that layout.

    Example:
        >>> import torch, normkit
        >>> ln2d = normkit.LayerNorm2d(8)
        >>> y = ln2d(torch.randn(2, 8, 4, 4))
        >>> torch.allclose(y.mean(1), torch.zeros(2, 4, 4), atol=1e-5)
        True
    """

    @property
    def num_channels(self) -> int:
        """The number of channels ``C`` this layer normalizes over."""
        return self.normalized_shape[0]

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        check_channels(self, input, self.num_channels)
        return F.layer_norm2d(input, self.weight, self.bias, self.eps, backend=self.backend)
