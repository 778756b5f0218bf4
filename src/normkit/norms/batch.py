"""BatchNorm1d/2d/3d: drop-in subclasses of torch.nn's, with robust statistics."""

from __future__ import annotations

from torch import Tensor, nn

from .. import functional as F
from ._base import BackendMixin
from ._core import check_floating, shape_str

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]

_DOC = r"""Batch Normalization over {what} (Ioffe & Szegedy 2015).

    .. math::
        y = \frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x] + \epsilon}}}} \gamma + \beta

    A drop-in subclass of :class:`torch.nn.{name}`: same constructor, parameters,
    buffers, ``state_dict`` keys and train/eval semantics (batch statistics in
    training, running statistics in eval, ``momentum=None`` for a cumulative average,
    unbiased ``running_var``, ``num_batches_tracked``). Statistics are computed in
    float32 (float64 for float64 input) with a compensated mean, so inputs with a
    large offset keep their precision; float16/bfloat16 inputs give outputs of the
    same dtype.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        momentum: running-average factor, or ``None`` for a cumulative average.
            Default: ``0.1``.
        affine: learnable ``weight`` and ``bias``. Default: ``True``.
        track_running_stats: keep running statistics. Default: ``True``.
        bias: learnable ``bias`` (with ``affine``). Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"`` (keyword-only, read at
            every forward). Default: ``"auto"``.

    Shape:
        - Input: {shape}
        - Output: same shape, dtype and memory format as the input.

    Example:
        >>> import torch, normkit
        >>> bn = normkit.{name}(3)
        >>> y = bn(torch.randn({example}))
        >>> y.shape == torch.Size([{example}]), int(bn.num_batches_tracked)
        (True, 1)
    """


class _BatchNormForward(BackendMixin):
    """The forward shared by BatchNorm1d/2d/3d (torch's ``_BatchNorm.forward`` logic)."""

    _ndims: tuple[int, ...] = ()
    _shape_doc: str = ""

    def _check_input_dim(self, input: Tensor) -> None:
        name = type(self).__name__
        check_floating(input, name)
        if input.dim() not in self._ndims:
            expected = " or ".join(f"{d}D" for d in self._ndims)
            raise ValueError(
                f"{name} expected {expected} input {self._shape_doc}, got a "
                f"{input.dim()}D input of shape {shape_str(input)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{name} expected input with {self.num_features} channels (dim 1), "
                f"got input of shape {shape_str(input)}"
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        return F.batch_norm(
            input,
            self.running_mean if keep else None,
            self.running_var if keep else None,
            self.weight,
            self.bias,
            use_batch_stats,
            factor,
            self.eps,
            backend=self.backend,
        )


class BatchNorm1d(_BatchNormForward, nn.BatchNorm1d):
    _ndims = (2, 3)
    _shape_doc = "(N, C) or (N, C, L)"
    __doc__ = _DOC.format(name="BatchNorm1d", what="a 2D or 3D input",
                          shape=":math:`(N, C)` or :math:`(N, C, L)`", example="8, 3")


class BatchNorm2d(_BatchNormForward, nn.BatchNorm2d):
    _ndims = (4,)
    _shape_doc = "(N, C, H, W)"
    __doc__ = _DOC.format(name="BatchNorm2d", what="a 4D input (images)",
                          shape=":math:`(N, C, H, W)`", example="8, 3, 5, 5")


class BatchNorm3d(_BatchNormForward, nn.BatchNorm3d):
    _ndims = (5,)
    _shape_doc = "(N, C, D, H, W)"
    __doc__ = _DOC.format(name="BatchNorm3d", what="a 5D input (volumes, video)",
                          shape=":math:`(N, C, D, H, W)`", example="4, 3, 2, 5, 5")
