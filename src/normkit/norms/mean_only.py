r"""Mean-only batch normalization (Salimans & Kingma 2016, section 3).

The companion of weight normalization: the batch mean of each channel is subtracted
(no division by the standard deviation; the scale is left to weight normalization's
``g``), then a learnable bias is added:

.. math:: y = x - \mathrm{E}[x] + b

Statistics come from :mod:`normkit._stats` (float32 or float64, compensated mean).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.fx import Proxy

from .. import _stats
from ._arguments import check_arguments
from ._base import NotScriptable, fx_leaf
from ._core import (
    check_backend,
    check_floating,
    check_running_statistics,
    compiling,
    forget_checked_statistics,
    shape_str,
    skip_recomputed_update,
)

__all__ = ["MeanOnlyBatchNorm1d", "MeanOnlyBatchNorm2d", "reference_mean_only"]


def reference_mean_only(x: Tensor, dims: tuple[int, ...],
                        bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Subtract the mean over ``dims`` and add ``bias`` (already viewed), differentiably.

    The ``backend="reference"`` path: plain PyTorch math on :func:`normkit._stats.moments`,
    differentiated by autograd. Returns ``(y, mean)``: ``y`` in ``x``'s dtype, the
    (detached, keepdim) mean in the compute dtype.

    Example:
        >>> y, mean = reference_mean_only(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), (0,))
        >>> y
        tensor([[-1., -2.],
                [ 1.,  2.]])
        >>> mean
        tensor([[2., 4.]])
    """
    m = _stats.moments(_stats.upcast(x), dims)
    y = m.shifted - m.mean_lo
    if bias is not None:
        y = y + bias
    return y.to(x.dtype), (m.mean_hi + m.mean_lo).detach()  # (torch 2.4 traces no property)


class _MeanOnlyFunction(torch.autograd.Function):
    """``y = x - mean(x) + b`` with the hand-derived backward.

    ``dx = dy - mean(dy)`` over the reduced dims and ``db = sum(dy)``: linear in ``dy``
    and independent of ``x``, so nothing is saved, and the backward, made of
    differentiable operations, also serves double backward.
    """

    @staticmethod
    def forward(ctx, x, bias, dims):
        m = _stats.moments(_stats.upcast(x), dims)
        y = m.shifted.sub_(m.mean_lo)  # a fresh tensor: x - mean_hi
        if bias is not None:
            y = y.add_(bias)
        ctx.dims, ctx.x_dtype = dims, x.dtype
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        mean = m.mean_hi + m.mean_lo
        ctx.mark_non_differentiable(mean)
        return y.to(x.dtype), mean

    @staticmethod
    def backward(ctx, dy, _dmean):
        g = _stats.upcast(dy)
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = (g - g.mean(ctx.dims, keepdim=True)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            db = g.sum_to_size(ctx.bias_shape).to(ctx.bias_dtype)
        return dx, db, None


class _MeanOnlyBatchNorm(NotScriptable, nn.Module):
    """The module shared by MeanOnlyBatchNorm1d/2d (the docstring is on each)."""

    _ndims: tuple[int, ...] = ()
    _shape_doc: str = ""

    def __init__(
        self,
        num_features: int,
        momentum: float | None = 0.1,
        track_running_stats: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        name = type(self).__name__
        check_arguments(name, {"num_features": num_features, "momentum": momentum})
        if num_features == 0:
            raise ValueError(f"{name} expected num_features to be an int >= 1, got 0")
        self.num_features = int(num_features)
        self.momentum = momentum
        self.track_running_stats = track_running_stats
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_features, **factory))
        else:
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(self.num_features, **factory))
            self.register_buffer(
                "num_batches_tracked",
                torch.tensor(0, dtype=torch.long,
                             **{k: v for k, v in factory.items() if k != "dtype"}))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("num_batches_tracked", None)
        self.backend = check_backend(backend)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        """Zero the running mean and the batch counter."""
        if self.track_running_stats:
            self.running_mean.zero_()
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """Reset the running statistics and set the bias to zero."""
        self.reset_running_stats()
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        s = (f"{self.num_features}, momentum={self.momentum}, "
             f"track_running_stats={self.track_running_stats}, bias={self.bias is not None}")
        return s if self.backend == "auto" else f"{s}, backend={self.backend!r}"

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
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        self._check_input_dim(input)
        view = (1, self.num_features) + (1,) * (input.dim() - 2)  # broadcast per channel
        bias = None if self.bias is None else self.bias.view(view)
        if input.numel() == 0:  # nothing to average: running statistics stay as they are
            out = input if bias is None else input + bias
            return (out if out is not input else input.clone()).to(input.dtype)
        if not self.training and self.running_mean is not None:
            check_running_statistics(self, ("running_mean",))
            y = _stats.upcast(input) - self.running_mean.view(view)
            return (y if bias is None else y + bias).to(input.dtype)
        dims = (0, *range(2, input.dim()))
        if self.backend == "reference" or compiling():  # (plain ops: no node without a jvp)
            y, mean = reference_mean_only(input, dims, bias)
        else:
            y, mean = _MeanOnlyFunction.apply(input, bias, dims)
        # as torch's BatchNorm: setting track_running_stats=False after construction stops
        # the updates (the buffers stay and serve eval); activation checkpointing's
        # recomputation of this forward counts nothing (the first forward did)
        updates = (self.training and self.track_running_stats
                   and self.running_mean is not None)
        if self.training and not skip_recomputed_update(self, updates) and updates:
            forget_checked_statistics(self)
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
            _stats.update_running_(self.running_mean, mean.view(-1), factor)
        return y


_DOC = r"""Mean-only batch normalization over {what} (Salimans & Kingma 2016, section 3).

    .. math:: y = x - \mathrm{{E}}[x] + b

    The companion of weight normalization (:func:`normkit.weights.weight_norm`): in
    training the batch mean of each channel (over ``N`` and every spatial dim) is
    subtracted, without dividing by the standard deviation; in eval the running mean
    is. There is no ``weight`` (the scale is weight normalization's ``g``), and the
    layer before it usually has ``bias=False``, since ``b`` here replaces its bias.

    Running statistics follow torch's BatchNorm: ``running_mean`` is updated with
    ``(1 - momentum) * running + momentum * batch_mean``; ``momentum=None`` makes it
    the cumulative average over ``num_batches_tracked`` batches; with
    ``track_running_stats=False`` the batch mean is used in eval too. An empty batch
    gives an empty output and leaves the statistics untouched. A batch of one value
    per channel is allowed (its mean is defined; the output is then ``b``). The mean
    is computed in float32 (float64 for float64 input) with a compensated mean; the
    output keeps the input's dtype and memory format.

    Args:
        num_features: number of channels ``C``.
        momentum: running-average factor, or ``None`` for a cumulative average.
            Default: ``0.1``.
        track_running_stats: keep ``running_mean`` and ``num_batches_tracked``.
            Default: ``True``.
        bias: learnable per-channel ``bias`` (initialized to zero); ``False`` registers
            ``bias`` as ``None``. Default: ``True``.
        device, dtype: factory arguments of the parameter and buffers.
        backend: ``"auto"``/``"eager"`` (hand-derived backward) or ``"reference"``
            (autograd), keyword-only, read at every forward. Default: ``"auto"``.

    Shape:
        - Input: {shape}
        - Output: same shape, dtype and memory format as the input.

    Example:
        >>> import torch
        >>> from normkit.norms.mean_only import {name}
        >>> m = {name}(3)
        >>> y = m(torch.randn({example}) + 5)
        >>> bool(y.mean({dims}).abs().max() < 1e-5), int(m.num_batches_tracked)
        (True, 1)
    """


class MeanOnlyBatchNorm1d(_MeanOnlyBatchNorm):
    _ndims = (2, 3)
    _shape_doc = "(N, C) or (N, C, L)"
    __doc__ = _DOC.format(name="MeanOnlyBatchNorm1d", what="a 2D or 3D input",
                          shape=":math:`(N, C)` or :math:`(N, C, L)`", example="8, 3, 4",
                          dims="(0, 2)")


class MeanOnlyBatchNorm2d(_MeanOnlyBatchNorm):
    _ndims = (4,)
    _shape_doc = "(N, C, H, W)"
    __doc__ = _DOC.format(name="MeanOnlyBatchNorm2d", what="a 4D input (images)",
                          shape=":math:`(N, C, H, W)`", example="8, 3, 5, 5",
                          dims="(0, 2, 3)")
