"""torch's own fused kernels, used where they are provably accurate.

torch's CPU normalization kernels lose precision in proportion to how far the data
sit from zero relative to their spread: their output error grows with
``ratio = |mean| / std`` of each normalized group (float32, measured on torch 2.13,
max abs error vs float64 on the same input, widths 64 to 8192)::

    ratio                     10       30       100      300
    layer_norm              1.9e-6   3.9e-6   1.6e-5   6.5e-5
    batch_norm (NCHW)       1.1e-6   1.7e-6   5.1e-6   2.6e-5
    batch_norm (NHWC)       2.0e-5   5.7e-5   2.3e-4   5.0e-4
    group_norm (NCHW)       1.9e-6   3.4e-6   1.4e-5   6.0e-5
    group_norm (NHWC)       1.4e-4   1.2e-3   1.5e-2   1.4e-1   (kept only at ratio <= 2)

torch's channels-last statistics kernels -- BatchNorm on channels-last and on 2D
``(N, C)`` input, GroupNorm on channels-last -- also accumulate sequentially along the
positions, so their error grows with the number of values per group even for centered
data (BatchNorm, 32 channels, no affine, max abs error over five seeds and ratios 0 to
2; ``python benchmarks/accuracy.py --counts``, which also prints each ratio)::

    values per channel      2048     4096     8192     16384    32768    131072
    batch_norm (NHWC, 2D)   3.0e-6   4.7e-6   8.3e-6   1.1e-5   1.7e-5   8.1e-5
                            -4.8e-6  -7.5e-6  -1.1e-5  -1.7e-5  -2.5e-5  -8.9e-5
    batch_norm (NCHW)       3.8e-7   3.9e-7   4.2e-7   4.3e-7   4.5e-7   4.9e-7
                            -4.8e-7  -4.9e-7  -4.3e-7  -4.9e-7  -6.0e-7  -5.7e-7

So torch's channels-last BatchNorm serves training only up to
:data:`CHANNELS_LAST_MAX_COUNT` values per channel and ratio 2: error up to 1.1e-5,
within the float32 tolerance every path is tested to (2e-5 + 2e-5 |y|), though twice
the 6e-6 of normkit's own fast paths (an earlier single-input measurement had put it at
3e-6 to 6e-6); beyond, the slice-sums engine keeps 6e-7 to 1.6e-6 (same command).
GroupNorm's channels-last kernel is used only on small images (see
:mod:`normkit.kernels.channels`).

Under ``backend="auto"`` normkit runs torch's kernel first (it returns the group
statistics anyway), and keeps its output only when every group's ratio is at most the
threshold below, which bounds the error at a few 1e-6 (the robust path's is ~5e-7);
otherwise the result is recomputed by normkit's compensated path. Well-conditioned
data (activations after a normalization, weights, most inputs) thus run at torch's
speed, and data at an offset get normkit's precision. NaN or Inf statistics always
take the robust path, which propagates them exactly as torch does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .memory import empty_like, fresh_out_like, out_like

_ATEN = torch.ops.aten

__all__ = ["THRESHOLDS", "well_conditioned", "ratio_within", "layer_norm", "batch_norm_train",
           "batch_norm_train_saved", "batch_norm_train_stats", "batch_norm_stats",
           "batch_norm_moments", "batch_norm_by_moments", "batch_norm_eval", "kernel_dtypes",
           "CHANNELS_LAST_BACKWARD_MAX_COUNT", "GROUP_NORM_BACKWARD_MAX_LENGTH",
           "channels_last_format", "group_norm",
           "instance_norm", "instance_norm_rows", "INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS",
           "FLOAT16_INSTANCE_VIEW_MIN_ELEMENTS", "layer_norm2d_nchw", "reference_grads",
           "kernel_params",
           "half_statistics", "HALF_STATISTICS_RATIO",
           "layer_norm_backward", "HALF_BACKWARD_BLOCK_BYTES", "HALF_BACKWARD_ONE_CALL_BELOW",
           "layer_norm_blocks", "LAYER_NORM_BLOCK_BYTES", "repair_rows", "RowRepair",
           "ill_conditioned_rows", "rows_past", "single_value", "group_norm_with_stats",
           "kernel_node",
           "batch_norm_kernel", "group_norm_kernel", "weight_for_bias", "strided_like",
           "sample_blocks", "group_norm_by_samples", "float64_total", "inference_kernel"]

#: Largest ``|mean| / std`` of a group for which torch's kernel output is kept.
THRESHOLDS = {
    "layer_norm": 32.0,
    "batch_norm": 32.0,
    "batch_norm_channels_last": 4.0,
    "batch_norm_channels_last_train": 2.0,
    "group_norm": 32.0,
}


def well_conditioned(mean: Tensor, rstd: Tensor, threshold: float) -> bool:
    """True when every group's ``|mean| * rstd`` is finite and at most ``threshold``.

    Example:
        >>> well_conditioned(torch.tensor([1.0, -3.0]), torch.tensor([1.0, 2.0]), 32.0)
        True
        >>> well_conditioned(torch.tensor([1e4]), torch.tensor([1.0]), 32.0)
        False
    """
    count = mean.numel()
    if count == 0:
        return True
    if count == 1:
        # one group (a single row: batch-1 inference, a decoding step): two reads and the
        # product on the host, ~0.6 us against the three kernels' ~3 us
        return abs(mean.item() * rstd.item()) <= threshold  # NaN, inf: False, as below
    if mean.requires_grad or rstd.requires_grad:  # (torch's statistics outputs never do)
        mean, rstd = mean.detach(), rstd.detach()
    # two small kernels (the product, then its least and greatest value in one pass) and
    # two reads: right after a large kernel, when Python and the dispatcher run from cold
    # caches, half the added time of the product's |.| and max as two kernels (26-29 us
    # against 32-61 us after torch's LayerNorm kernel at 4096 x 1024, one thread)
    low, high = torch.aminmax(torch.mul(mean, rstd))
    return -threshold <= low.item() and high.item() <= threshold  # NaN: False, robust path


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def channels_last_format(x: Tensor) -> torch.memory_format | None:
    """``channels_last`` (``_3d``) when ``x`` is laid out so and not also plainly
    contiguous, else ``None``.

    Example:
        >>> channels_last_format(torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last))
        torch.channels_last
        >>> channels_last_format(torch.randn(2, 3)) is None
        True
    """
    if x.is_contiguous():
        return None
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None


def strided_like(g: Tensor, x: Tensor) -> Tensor:
    """``g`` (dense in ``x``'s memory format) with exactly ``x``'s strides, as a view.

    Strides of size-1 dims address nothing, yet torch's BatchNorm backward kernel treats
    a gradient whose strides differ from the input's there as another layout and takes
    its slow generic path (several times slower on a ``(1, C, N, 1)`` view, whose last
    stride is 1 where an activation's output has ``C``; ``benchmarks/batch_norm_rows.py
    --act`` times BatchNormAct1d, which meets it).

    Example:
        >>> x = torch.randn(40, 3).t()[None, :, :, None]  # 40 rows' (1, C, N, 1) view
        >>> g = torch.randn(1, 3, 40, 1).contiguous(memory_format=torch.channels_last)
        >>> x.stride(), g.stride(), strided_like(g, x).stride()
        ((3, 1, 3, 1), (120, 1, 3, 3), (3, 1, 3, 1))
    """
    if g.stride() == x.stride():
        return g
    if all(a == b for a, b, size in zip(g.stride(), x.stride(), x.shape, strict=True)
           if size != 1):
        return g.as_strided(x.shape, x.stride(), g.storage_offset())
    return g


def _plain_dense(x: Tensor) -> bool:
    # (torch's CPU kernels can die with SIGFPE on empty input: never hand them one)
    return x.numel() > 0 and x.is_contiguous() and x.dtype in _FLOATS


def layer_norm(x: Tensor, shape: tuple[int, ...], weight: Tensor | None,
               bias: Tensor | None, eps: float) -> Tensor | None:
    """torch's fused LayerNorm where accurate, else ``None``.

    Row by row: the rows past the accuracy bound (:data:`THRESHOLDS`) are normalized by
    normkit's compensated core and the others keep the kernel's output
    (:func:`repair_rows`), so each row's result depends on that row alone, as torch's
    LayerNorm's does (a row normalized alone or in any batch: the same bits), and one
    offset row does not send the whole batch through the slower path. ``None`` when
    every row is past the bound: the caller's compensated path, the same bits.

    Rows wider than :data:`LAYER_NORM_BACKWARD_MAX_WIDTH` take their gradients from
    :func:`layer_norm_backward` (its centered sums), not from torch's autograd.

    Example:
        >>> layer_norm(torch.randn(4, 8), (8,), None, None, 1e-5).shape
        torch.Size([4, 8])
        >>> layer_norm(torch.randn(4, 8) + 1e5, (8,), None, None, 1e-5) is None
        True
    """
    if not _plain_dense(x) or not kernel_dtypes(x, weight, bias) or single_value(shape):
        return None
    if x.dtype in _HALF:
        return _layer_norm_16bit(x, shape, weight, bias, eps)
    kernel_weight = weight_for_bias(weight, bias)

    def backward(dy, x, weight, bias, mask):
        dx, dw, db = layer_norm_backward(dy, x, shape, mean, rstd,
                                         weight_for_bias(weight, bias), bias, mask)
        return dx, None if weight is None else dw, db

    def reference(x, weight, bias):  # torch's LayerNorm (create_graph=True)
        return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)

    blocks = layer_norm_blocks(x, shape, kernel_weight, bias, eps)
    if blocks is None:
        y, mean, rstd = torch.native_layer_norm(x, shape, kernel_weight, bias, eps)
        if (well_conditioned(mean, rstd, THRESHOLDS["layer_norm"])
                and not (y.requires_grad and _wide_rows(x, shape))):
            return y  # (torch's own autograd)
        y = y.detach()  # (the gradients of layer_norm_backward: repaired or wide rows)
    else:
        _, y, mean, rstd = blocks
    if not well_conditioned(mean, rstd, THRESHOLDS["layer_norm"]):
        return repair_rows(x, shape, weight, bias, eps, y, mean, rstd,
                           THRESHOLDS["layer_norm"], backward)
    return kernel_node(x, weight, bias, y, backward, reference)


def single_value(shape: Sequence[int]) -> bool:
    """Whether a LayerNorm normalizes single values (``shape`` of one element: a
    LayerNorm2d of one channel). Its output is its bias and its input gradient zero;
    torch's kernels give that gradient as rounding times ``1 / sqrt(eps)`` (6.1e-5 in
    float32: the dispatch fuzz found it), so normkit's compensated path, exact there,
    serves such rows.

    Example:
        >>> single_value((1,)), single_value((4, 1))
        (True, False)
    """
    return math.prod(shape) == 1


def ill_conditioned_rows(mean: Tensor, rstd: Tensor, threshold: float) -> Tensor:
    """Indices of the rows (one ``mean``/``rstd`` each, in their flat order) whose
    ``|mean| * rstd`` is past ``threshold`` or NaN: those a kernel's statistics do not
    normalize accurately.

    Example:
        >>> ill_conditioned_rows(torch.tensor([1.0, 1e4, float("nan")]), torch.ones(3), 32.0)
        tensor([1, 2])
    """
    ratio = torch.mul(mean.detach(), rstd.detach()).abs_().reshape(-1)
    return (ratio > threshold).logical_or_(ratio.isnan()).nonzero().reshape(-1)


class RowRepair:
    """Rows of a fast path's output normalized again by normkit's compensated core: the
    rows of a LayerNorm, the ``(sample, group)`` groups of a GroupNorm or InstanceNorm
    (NCHW or channels-last), the positions of a LayerNorm2d on NCHW.

    :meth:`apply` overwrites those rows of the output in place (no autograd) and keeps
    their compensated statistics (:meth:`statistics`); :meth:`backward` gives those rows'
    gradients from them. The caller runs the kernel's backward on the gradient with the
    rows zeroed (:meth:`zeroed`; a zero row adds nothing to any gradient) or skipping
    them (the slice-sums engine's ``skip``), then :meth:`patch` puts theirs in.

    Example:
        >>> x = torch.randn(3, 8)
        >>> x[1] += 1e5  # one row far off its spread
        >>> y, mean, rstd = torch.native_layer_norm(x, (8,), None, None, 1e-5)
        >>> bad = ill_conditioned_rows(mean, rstd, 32.0)
        >>> repair = RowRepair.apply(y, x, 8, bad, None, None, 1e-5)
        >>> ref = torch.nn.functional.layer_norm(x.double(), (8,))
        >>> bad.tolist(), bool((y - ref).abs().max() < 1e-5)
        ([1], True)
    """

    def __init__(self, bad: Tensor, k: int, rows: Tensor | None, mean_hi: Tensor | None,
                 mean_lo: Tensor | None, rstd: Tensor | None, groups: int | None = None,
                 layout: torch.memory_format = torch.contiguous_format,
                 positions: bool = False) -> None:
        self.bad, self.k, self.rows, self.groups = bad, k, rows, groups
        self.mean_hi, self.mean_lo, self.rstd = mean_hi, mean_lo, rstd
        self.var: Tensor | None = None
        self.layout, self.positions = layout, positions
        self._by_sample: tuple[Tensor, Tensor] | None = None
        self._length = 0  # (positions per sample, for ``positions``)

    @classmethod
    def apply(cls, y: Tensor, x: Tensor, k: int, bad: Tensor, weight: Tensor | None,
              bias: Tensor | None, eps: float, groups: int | None = None,
              positions: bool = False) -> RowRepair:
        """Rows ``bad`` of ``x``'s ``(M, k)`` rows, normalized into those of ``y``.

        ``groups``: the rows are the ``(n, g)`` groups of GroupNorm (row ``n * G + g``;
        InstanceNorm: one group per channel), whose affine is per channel, ``C / G``
        channels of ``k * G / C`` positions each, in any memory format (a channels-last
        group is gathered from its strided positions and written back to them).
        ``positions``: the rows are the positions of contiguous ``(N, C, L)`` input, each
        row its ``C = k`` channels (row ``n * L + l``: LayerNorm2d on NCHW). Else rows of
        contiguous ``x`` and ``y``. Without ``groups`` one weight and bias of ``k`` values
        serve every row (LayerNorm)."""
        from ..norms._core import normalize_forward

        layout = torch.contiguous_format if groups is None else (
            channels_last_format(x) or torch.contiguous_format)
        repair = cls(bad, k, None, None, None, None, groups, layout, positions)
        repair._length = x[0, 0].numel() if positions and x.numel() else 0
        repair.rows = rows = repair._take(x.detach())
        with torch.no_grad():
            y_bad, repair.mean_hi, repair.mean_lo, repair.var, repair.rstd = normalize_forward(
                rows, (1,), repair._affine(weight), repair._affine(bias), eps)
            repair._put(y, y_bad.to(y.dtype))
        return repair

    def _flat(self, t: Tensor) -> bool:
        """Whether the repaired rows of ``t`` are rows of its ``(M, k)`` view; else they
        are channels-last groups or channels-first positions (:meth:`_samples`)."""
        return not self.positions and (self.groups is None or t.is_contiguous())

    def _samples(self) -> tuple[Tensor, Tensor]:
        """``(samples, local)``: the samples holding repaired rows, and each repaired
        row's index among the rows of those samples laid out by :meth:`_sample_rows`.
        Strided rows are read and written a whole sample at a time -- one copy of those
        samples into a layout whose ``(M, k)`` rows they are, and back: with advanced
        indexing of the strided rows themselves, a channels-last GroupNorm step
        (32x64x28x28, two samples repaired, one thread, ``torch.profiler``) took 12.5 ms
        against 10.3 ms so."""
        if self._by_sample is None:
            inner = self.groups if not self.positions else self._length
            samples, inverse = torch.unique(self.bad // inner, return_inverse=True)
            self._by_sample = samples, inverse * inner + self.bad % inner
        return self._by_sample

    def _sample_rows(self, sub: Tensor) -> Tensor:
        """A fresh contiguous copy of samples ``sub`` whose ``(M, k)`` view has their rows:
        NCHW for groups, ``(S, L, C)`` for positions."""
        if self.positions:
            return sub.reshape(sub.shape[0], sub.shape[1], -1).transpose(1, 2).contiguous()
        return sub.contiguous()

    def _take(self, t: Tensor) -> Tensor:
        """The repaired rows of ``t``, as a ``(rows, k)`` tensor of their own."""
        if self._flat(t):
            return t.reshape(-1, self.k).index_select(0, self.bad)
        samples, local = self._samples()
        return self._sample_rows(t.index_select(0, samples)).view(-1, self.k).index_select(
            0, local)

    def _put(self, t: Tensor, rows: Tensor, add: bool = False) -> None:
        """Write (``add``: add) ``(rows, k)`` ``rows`` into the repaired rows of ``t``, in
        place."""
        if self._flat(t):
            view = t.view(-1, self.k)
            (view.index_add_ if add else view.index_copy_)(0, self.bad, rows)
            return
        samples, local = self._samples()
        sub = t.index_select(0, samples)
        laid = self._sample_rows(sub)
        view = laid.view(-1, self.k)
        (view.index_add_ if add else view.index_copy_)(0, local, rows)
        if self.positions:  # (back to the samples' own (S, C, *) shape)
            laid = laid.transpose(1, 2).reshape(sub.shape)
        t.index_copy_(0, samples, laid)

    def statistics(self, mean: Tensor, rstd: Tensor, var: Tensor | None = None
                   ) -> tuple[Tensor, ...]:
        """Copies of a kernel's per-row ``mean`` and ``rstd`` (and biased ``var``), their
        repaired rows replaced by the compensated statistics.

        Example:
            >>> x = torch.randn(3, 8)
            >>> x[1] += 1e5
            >>> y, mean, rstd = torch.native_layer_norm(x, (8,), None, None, 1e-5)
            >>> repair = RowRepair.apply(y, x, 8, torch.tensor([1]), None, None, 1e-5)
            >>> fixed, _ = repair.statistics(mean, rstd)
            >>> bool((fixed.view(-1)[1].double() - x[1].double().mean()).abs() < 1e-2)
            True
        """
        out = []
        for t, rows in ((mean, self.mean_hi + self.mean_lo), (rstd, self.rstd),
                        (var, self.var)):
            if t is not None:
                t = t.detach().clone()
                t.view(-1).index_copy_(0, self.bad, rows.view(-1).to(t.dtype))
                out.append(t)
        return tuple(out)

    def _affine(self, t: Tensor | None) -> Tensor | None:
        """``t`` as the repaired rows see it: ``(k,)``, or per group ``(rows, k)`` in
        float32 or better (its per-element gradient products are summed afterwards)."""
        if t is None:
            return None
        t = t.detach()
        if self.groups is None:
            return t.reshape(self.k)
        per_group = t.reshape(self.groups, -1).to(torch.promote_types(t.dtype, torch.float32))
        spread = per_group.repeat_interleave(self.k // per_group.shape[1], dim=1)
        return spread.index_select(0, self.bad % self.groups)

    def _reduced(self, grad: Tensor, param: Tensor) -> Tensor:
        """A parameter's gradient from :meth:`_affine`'s shape back to ``param``'s."""
        if self.groups is None:
            return grad.view(param.shape)
        per = param.numel() // self.groups
        sums = grad.reshape(grad.shape[0], per, -1).sum(-1)  # (rows, C / G)
        total = sums.new_zeros(self.groups, per).index_add_(0, self.bad % self.groups, sums)
        return total.view(param.shape).to(param.dtype)

    def zeroed(self, dy: Tensor) -> Tensor:
        """A copy of ``dy`` with the repaired rows zero (``dy`` itself is left as it is),
        contiguous, on huge pages where large (:func:`~normkit.kernels.memory.empty_like`:
        a fresh 16 MiB buffer's page faults cost more than the copy).

        Example:
            >>> repair = RowRepair(torch.tensor([1]), 2, torch.zeros(1, 2), None, None, None)
            >>> dy = torch.ones(3, 2)
            >>> repair.zeroed(dy).tolist(), dy.sum().item()
            ([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]], 6.0)
        """
        out = empty_like(dy, None, self.layout).copy_(dy)
        if self._flat(out):
            out.view(-1, self.k).index_fill_(0, self.bad, 0)
        else:
            self._put(out, out.new_zeros(()).expand(self.bad.numel(), self.k))
        return out

    def backward(self, dy: Tensor, weight: Tensor | None, bias: Tensor | None,
                 mask: Sequence[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(dx, dweight, dbias)`` of the repaired rows: ``dx`` as ``(rows, k)``, the
        parameter gradients their share, in the parameters' shapes.

        Example:
            >>> x = torch.randn(3, 8, dtype=torch.float64)
            >>> x[1] += 1e5
            >>> y, mean, rstd = torch.native_layer_norm(x, (8,), None, None, 1e-5)
            >>> repair = RowRepair.apply(y, x, 8, torch.tensor([1]), None, None, 1e-5)
            >>> dy = torch.randn(3, 8, dtype=torch.float64)
            >>> dx, _, _ = repair.backward(dy, None, None, [True, False, False])
            >>> leaf = x.clone().requires_grad_()
            >>> torch.nn.functional.layer_norm(leaf, (8,)).backward(dy)
            >>> bool((dx - leaf.grad[1:2]).abs().max() < 1e-6)
            True
        """
        from ..norms._core import normalize_backward

        dx, dw, db = normalize_backward(
            self._take(dy), self.rows, self._affine(weight),
            self._affine(bias), self.mean_hi, self.mean_lo, self.rstd, (1,), True, mask)
        return (dx, None if dw is None else self._reduced(dw, weight),
                None if db is None else self._reduced(db, bias))

    def patch(self, grads, dy: Tensor, weight: Tensor | None, bias: Tensor | None,
              mask: Sequence[bool], add: bool = False) -> tuple[Tensor | None, ...]:
        """The kernel's ``(dx, dweight, dbias)``, computed on :meth:`zeroed` ``dy``, with
        the repaired rows' gradients in: their ``dx`` rows written in (added with
        ``add``: a residual's gradient already there), their parameter shares added.

        Example:
            >>> x = torch.randn(3, 8)
            >>> x[1] += 1e5
            >>> w = torch.ones(8)
            >>> y, mean, rstd = torch.native_layer_norm(x, (8,), w, None, 1e-5)
            >>> repair = RowRepair.apply(y, x, 8, torch.tensor([1]), w, None, 1e-5)
            >>> dy = torch.randn(3, 8)
            >>> kernel = torch.ops.aten.native_layer_norm_backward(
            ...     repair.zeroed(dy), x, [8], mean, rstd, w, None, [True, True, False])
            >>> dx, dw, _ = repair.patch((kernel[0], kernel[1], None), dy, w, None,
            ...                         [True, True, False])
            >>> leaf, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            >>> torch.nn.functional.layer_norm(leaf, (8,), w64).backward(dy.double())
            >>> bool((dx - leaf.grad).abs().max() < 1e-4), bool((dw - w64.grad).abs().max() < 1e-4)
            (True, True)
        """
        dx, dw, db = grads
        dx_bad, dw_bad, db_bad = self.backward(dy, weight, bias, mask)
        if dx is not None and dx_bad is not None:
            self._put(dx, dx_bad.to(dx.dtype), add)
        return dx, _plus(dw, dw_bad), _plus(db, db_bad)


def repair_rows(x: Tensor, shape: tuple[int, ...], weight: Tensor | None,
                bias: Tensor | None, eps: float, y: Tensor, mean: Tensor, rstd: Tensor,
                threshold: float, kernel_backward) -> Tensor | None:
    """A LayerNorm kernel's output ``y`` over ``x`` (no autograd; one ``mean``/``rstd``
    per row) with the rows past ``threshold`` (:func:`ill_conditioned_rows`) normalized
    again by normkit's compensated core (:class:`RowRepair`), as one autograd node;
    ``None`` when every row is past it (the caller's compensated path over the whole
    input gives those rows the same bits).

    Backward: ``kernel_backward(dy, x, weight, bias, mask)`` (the kernel's, from its
    statistics) on the gradient with the repaired rows zeroed, then those rows' input
    gradient, and their share of the parameter gradients, from the compensated
    statistics. The repair costs the row selection and a few copies of the repaired
    rows; backward, one copy of ``dy``. Double backward differentiates normkit's
    reference math over every row.

    Example:
        >>> x = torch.randn(3, 8)
        >>> x[1] += 1e5
        >>> y, mean, rstd = torch.native_layer_norm(x, (8,), None, None, 1e-5)
        >>> y = repair_rows(x, (8,), None, None, 1e-5, y, mean, rstd, 32.0, None)
        >>> ref = torch.nn.functional.layer_norm(x.double(), (8,))
        >>> bool((y - ref).abs().max() < 1e-5)
        True
    """
    from ..norms._core import reference_normalize

    bad = ill_conditioned_rows(mean, rstd, threshold)
    m = mean.numel()
    if bad.numel() == m:
        return None
    k = x.numel() // m
    repair = RowRepair.apply(y, x, k, bad, weight, bias, eps)

    def backward(dy, x, weight, bias, mask):
        grads = kernel_backward(repair.zeroed(dy), x, weight, bias, mask)
        return repair.patch(grads, dy, weight, bias, mask)

    def reference(x, weight, bias):  # normkit's reference math (create_graph=True)
        dims = tuple(range(x.dim() - len(shape), x.dim()))
        return reference_normalize(x, dims, weight, bias, eps)[0]

    return kernel_node(x, weight, bias, y, backward, reference)


def _plus(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    return total if total is None or part is None else total + part


#: Bytes of input per block of rows in :func:`layer_norm_blocks` and LayerNorm's blocked
#: backward (:func:`layer_norm_backward`): each block's output, written by torch's kernel
#: into a buffer the allocator reuses, is still in cache when it is copied into the
#: huge-page result.
LAYER_NORM_BLOCK_BYTES = 2 << 20


def _blocks_setup(x: Tensor, shape: tuple[int, ...], weight: Tensor | None,
                  bias: Tensor | None):
    """``(out, m, k, w, b)`` for a blocked LayerNorm kernel call over ``x``'s ``(m, k)``
    rows -- ``out`` a fresh huge-page result, ``w``/``b`` flat -- or ``None`` where
    :func:`~normkit.kernels.memory.fresh_out_like` gives no result (nothing to gain)."""
    out = fresh_out_like(x)
    if out is None:
        return None
    k = math.prod(shape)
    return (out, x.numel() // k, k, None if weight is None else weight.reshape(k),
            None if bias is None else bias.reshape(k))


def _row_blocks(m: int, k: int, itemsize: int):
    """Slices of ``m`` rows of ``k`` values, about :data:`LAYER_NORM_BLOCK_BYTES` each."""
    step = max(1, LAYER_NORM_BLOCK_BYTES // (k * itemsize))
    return (slice(start, start + step) for start in range(0, m, step))


def layer_norm_blocks(x: Tensor, shape: tuple[int, ...], weight: Tensor | None,
                      bias: Tensor | None, eps: float, residual: Tensor | None = None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """torch's LayerNorm kernel block by block of rows, its output copied into a result
    on fresh huge pages: ``(s, y, mean, rstd)``, or ``None`` where that gains nothing.

    torch's kernel allocates its own output, and glibc maps every allocation of 32 MiB
    or more fresh, so at 4096 x 4096 float32 and larger each call pays a page fault per
    4 KiB of output (~20 ms for 64 MiB on the project's VM, more than the kernel's own
    memory traffic). Here the kernel runs on blocks of about
    :data:`LAYER_NORM_BLOCK_BYTES`, whose outputs come from (and go back to) glibc's
    heap, and each block is copied while in cache into one result that
    :func:`~normkit.kernels.memory.fresh_out_like` advised ``MADV_HUGEPAGE`` (512 times
    fewer faults). Where the result's memory is already faulted in (glibc's heap reuse,
    ``MALLOC_MMAP_MAX_=0``: torch's own output then costs no faults), below 32 MiB, with
    huge pages unavailable, or for input that is not contiguous float32/float64, it
    returns ``None`` and the caller runs the kernel once over the whole tensor.

    Each row is its own reduction, so ``y``, ``mean`` and ``rstd`` are the bits of the
    whole-tensor call. With ``residual`` (``add_layer_norm``) the rows normalized are
    ``s = x + residual``, written block by block and normalized while in cache; without
    it ``s`` is ``x``. No autograd: the caller attaches the gradient
    (:func:`layer_norm_backward`). ``mean`` and ``rstd`` have the kernel's shape.

    Example:
        >>> layer_norm_blocks(torch.randn(4, 8), (8,), None, None, 1e-5) is None  # small
        True
    """
    if (x.dtype not in (torch.float32, torch.float64) or not x.is_contiguous()
            or (residual is not None and (residual.dtype != x.dtype
                                          or not residual.is_contiguous()))):
        return None
    setup = _blocks_setup(x, shape, weight, bias)
    if setup is None:
        return None
    y, m, k, w, b = setup
    s = x if residual is None else empty_like(x)
    stats_shape = x.shape[:x.dim() - len(shape)] + (1,) * len(shape)
    mean, rstd = x.new_empty(stats_shape), x.new_empty(stats_shape)
    rows, out = s.view(m, k), y.view(m, k)
    mean_rows, rstd_rows = mean.view(m, 1), rstd.view(m, 1)
    with torch.no_grad():
        for block in _row_blocks(m, k, x.element_size()):
            if residual is not None:
                torch.add(x.view(m, k)[block], residual.view(m, k)[block], out=rows[block])
            yb, mb, rb = torch.native_layer_norm(rows[block], (k,), w, b, eps)
            out[block].copy_(yb)
            mean_rows[block].copy_(mb)
            rstd_rows[block].copy_(rb)
    return s, y, mean, rstd


def _layer_norm_backward_blocks(dy: Tensor, x: Tensor, shape: tuple[int, ...], mean: Tensor,
                                rstd: Tensor, weight: Tensor | None, bias: Tensor | None,
                                mask: list[bool], addend: Tensor | None, row_term
                                ) -> tuple[Tensor | None, ...] | None:
    """:func:`layer_norm_backward` of float32/float64 ``x`` block by block, ``dx`` (plus
    ``row_term`` and ``addend``) copied into fresh huge pages, as
    :func:`layer_norm_blocks` does the forward; ``None`` where it would gain nothing. The
    weight and bias gradients are the blocks' partial sums added in float64."""
    if not mask[0] or x.dtype not in (torch.float32, torch.float64):
        return None
    setup = _blocks_setup(x, shape, weight, bias)
    if setup is None:
        return None
    dx, m, k, w, b = setup
    rows, g, out = x.view(m, k), dy.reshape(m, k), dx.view(m, k)
    add = None if addend is None else addend.reshape(m, k)
    mean, rstd = mean.reshape(m, 1), rstd.reshape(m, 1)
    dws, dbs = [], []
    for block in _row_blocks(m, k, x.element_size()):
        d, pw, pb = _ATEN.native_layer_norm_backward(g[block], rows[block], (k,), mean[block],
                                                     rstd[block], w, b, mask)
        if row_term is not None:
            d.add_(row_term(block))  # (the block's gradient rows still in cache)
        if add is None:
            out[block].copy_(d)
        else:
            torch.add(d, add[block], out=out[block])
        dws.append(pw)
        dbs.append(pb)

    return (dx, float64_total(dws, weight) if mask[1] and weight is not None else None,
            float64_total(dbs, bias) if mask[2] and bias is not None else None)


_HALF = (torch.float16, torch.bfloat16)


def kernel_params(x: Tensor, shape: tuple[int, ...], weight: Tensor | None,
                  bias: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """The weight and bias to hand torch's LayerNorm, BatchNorm or GroupNorm kernel for
    ``x`` (``shape``: the weight's): as given, except for float16/bfloat16 ``x``, where
    they are float32 (a float32 unit weight where none is given; converted with
    ``.float()``, so gradients still reach 16-bit parameters). The kernels return their
    statistics in the parameters' dtype, and with 16-bit parameters, or none, they
    round the mean and ``1 / std`` to 16 bits and normalize with the rounded values:
    off by ``|mean| / std`` times the rounding. At 30 std of offset, bfloat16
    8x256x14x14 (``benchmarks/accuracy.py --sixteen-bit``, ACCURACY.md): torch's
    BatchNorm output 1.0e-1 off and its weight gradient 3.7e-2, GroupNorm's weight
    gradient 1.5e-2 (float16 5.1e-3, over its 5e-3 tolerance), against 2.8e-2 and
    2.0e-3 with float32 statistics. 16-bit parameters are exact in float32, so the
    output is otherwise the same. Any dtype: a bias without a weight gets a unit weight
    (torch's GroupNorm backward kernel raises on a bias without a weight, float32 too).

    Example:
        >>> x = torch.randn(4, 8, dtype=torch.bfloat16)
        >>> w, b = kernel_params(x, (8,), None, None)
        >>> w.dtype, bool((w == 1).all()), b
        (torch.float32, True, None)
    """
    if x.dtype not in _HALF:
        if weight is None and bias is not None:
            # (torch's GroupNorm backward kernel fails on a bias without a weight, "tensor
            # does not have a device": a unit weight of the bias's dtype instead)
            weight = torch.ones(shape, dtype=bias.dtype, device=x.device)
        return weight, bias
    if weight is None:
        weight = torch.ones(shape, dtype=torch.float32, device=x.device)
    return weight.float(), None if bias is None else bias.float()


#: Largest ``|mean| / std`` of a channel for which training BatchNorm (and BatchNormAct) of
#: 16-bit input keeps torch's kernel with 16-bit parameters and buffers, whose statistics
#: are rounded to 16 bits (:func:`half_statistics`): the mean's rounding (at most
#: ``2^-8 |mean|`` in bfloat16, ``2^-11 |mean|`` in float16) then moves the normalized input
#: by at most ``2^-8`` (``3.9e-3``; float16 ``4.9e-4``), the output's own rounding at
#: ``|y| = 1`` and a quarter of the per-dtype tolerances (bfloat16 ``1.6e-2 + 1.6e-2 |y|``,
#: gradients ``4e-2``; float16 ``2e-3 + 2e-3 |y|``, ``5e-3``). Past it, float32 statistics
#: (:func:`kernel_params`): at 30 std the 16-bit ones were 1.0e-1 off
#: (``benchmarks/accuracy.py --sixteen-bit``). Typical activations sit under it (ReLU's
#: output has ``|mean| / std`` 0.7), so they keep torch's kernel and its speed: bench
#: bfloat16 BatchNorm with bfloat16 parameters on centered data, two alternated runs at 1
#: and 2 threads, float32 statistics always -> this bound, forward 0.74-0.93x -> 0.89-0.96x,
#: forward+backward 0.83-0.98x -> 0.93-1.01x (RESULTS.md, "Correctness on 16-bit input").
HALF_STATISTICS_RATIO = 1.0


def half_statistics(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether torch's kernels would return 16-bit statistics for ``x`` with these
    parameters (16-bit ``x`` without float32 ones): then :func:`kernel_params` should
    stand in for them.

    Example:
        >>> x = torch.randn(2, 3).half()
        >>> half_statistics(x, None, None), half_statistics(x, torch.ones(3), None)
        (True, False)
    """
    return x.dtype in _HALF and (weight is None or weight.dtype != torch.float32 or (
        bias is not None and bias.dtype != torch.float32))


#: Bytes of float32 rows per block in :func:`layer_norm_backward` of 16-bit input.
HALF_BACKWARD_BLOCK_BYTES = 2 << 20
#: Fewer elements than this, :func:`layer_norm_backward` of 16-bit input takes all three
#: gradients from one float32 kernel call on upcast copies, not ``dx`` from the 16-bit
#: kernel and the parameters' from float32 blocks (a dozen more small calls). Two
#: alternated runs of each (``normkit bench layer_norm add_layer_norm --dtype bfloat16
#: --shapes 7x33,64x768,256x768,512x1024 --threads 1,2 --repeats 7``), blocks -> one call
#: for every input of one block, fwd+bwd: 7x33 0.20-0.28x -> 0.24-0.42x, 64x768 (49152
#: elements) 0.30-0.47x -> 0.39-0.56x torch, but 256x768 and 512x1024 0.49-0.81x ->
#: 0.49-0.71x (upcasting the whole input costs more there than the calls).
HALF_BACKWARD_ONE_CALL_BELOW = 1 << 16


def layer_norm_backward(dy: Tensor, x: Tensor, shape: tuple[int, ...], mean: Tensor,
                        rstd: Tensor, weight: Tensor | None, bias: Tensor | None,
                        mask: list[bool], addend: Tensor | None = None, row_term=None
                        ) -> tuple[Tensor | None, ...]:
    """torch's LayerNorm backward kernel, ``(dx, dweight, dbias)`` as ``mask`` asks, for
    contiguous ``x`` and its statistics from the forward kernel; ``dx + addend`` with an
    ``addend`` of ``x``'s dtype (``add_layer_norm``'s residual gradient), and with
    ``row_term`` (float32/float64 ``x``; a function of a slice of the ``M`` rows, as
    ``(M, K)``, giving an ``(rows, 1)`` tensor) that term added to those rows of ``dx``
    first (RMSNorm's, which LayerNorm's gradient lacks).

    float32/float64 CPU rows wider than :data:`LAYER_NORM_BACKWARD_MAX_WIDTH` take
    :func:`_layer_norm_backward_wide` (centered sums). Other float32/float64 ``x`` of 32 MiB
    and more whose ``dx`` would land on fresh memory runs block by block, as
    :func:`layer_norm_blocks` does the forward (``dx`` the same bits
    but for ``row_term``, which is then called per block, the parameter gradients the
    blocks' partial sums added in float64).

    float16/bfloat16 ``x``: torch's 16-bit kernel gives ``dx`` (from float32 statistics
    and weight, as :func:`kernel_params` hands the forward), but it accumulates the
    weight and bias gradients in 16 bits, so their error grows with the rows -- ``dweight``
    relative to the largest gradient (``benchmarks/accuracy.py --sixteen-bit``, torch
    2.13), bfloat16 9.1e-2 to 1.3e-1 at 4096 x 768 and 2.2e-1 to 3.2e-1 at 16384 x 256,
    float16 1.0e-2 to 3.3e-2, against normkit's per-dtype gradient tolerances of 4e-2
    and 5e-3 (``tests/test_dispatch_fuzz.py`` found it). Those two come from torch's
    float32 kernel instead, a block of rows of about :data:`HALF_BACKWARD_BLOCK_BYTES` at
    a time (each block upcast into a reused buffer, the partial sums added in float32):
    1.7e-7 to 1.5e-6 with float32 parameters; with 16-bit ones the gradient's own
    rounding, 1.9e-3 to 2.7e-3 (bfloat16) and 2.3e-4 to 3.5e-4 (float16).

    Example:
        >>> x, dy = torch.randn(6, 8).bfloat16(), torch.randn(6, 8).bfloat16()
        >>> w, b = kernel_params(x, (8,), None, None)
        >>> y, mean, rstd = torch.native_layer_norm(x, (8,), w, b, 1e-5)
        >>> dx, dw, _ = layer_norm_backward(dy, x, (8,), mean, rstd, w, b, [True, True, False])
        >>> dx.dtype, dw.dtype
        (torch.bfloat16, torch.float32)
    """
    if x.dtype not in _HALF:
        if _wide_rows(x, shape):
            return _layer_norm_backward_wide(dy, x, shape, mean, rstd, weight, bias, mask,
                                             addend, row_term)
        blocks = _layer_norm_backward_blocks(dy, x, shape, mean, rstd, weight, bias, mask,
                                             addend, row_term)
        if blocks is not None:
            return blocks
        grads = tuple(_ATEN.native_layer_norm_backward(dy, x, shape, mean, rstd, weight, bias,
                                                       mask))
        if row_term is not None and grads[0] is not None:
            grads[0].view(-1, math.prod(shape)).add_(row_term(slice(None)))
        if addend is not None and grads[0] is not None:
            grads[0].add_(addend)
        return grads
    if row_term is not None:
        raise ValueError(f"layer_norm_backward's row_term takes float32/float64 input, got "
                         f"{x.dtype}")
    k = 1
    for size in shape:
        k *= size
    m = x.numel() // k
    rows, g = x.reshape(m, k), dy.reshape(m, k)
    mean, rstd = mean.reshape(m, 1).float(), rstd.reshape(m, 1).float()
    w, b = kernel_params(x, (k,), None if weight is None else weight.reshape(k),
                             None if bias is None else bias.reshape(k))
    need_w, need_b = mask[1] and weight is not None, mask[2] and bias is not None
    dx = dw = db = None
    if mask[0] and (need_w or need_b) and m * k < HALF_BACKWARD_ONE_CALL_BELOW:
        # small: all three from one float32 call (dx rounded once, as the 16-bit kernel's),
        # the fixed cost of the calls below being most of the time there
        dx, dw, db = _ATEN.native_layer_norm_backward(g.float(), rows.float(), (k,), mean,
                                                      rstd, w, b, [True, need_w, need_b])
        dx = dx.to(x.dtype).view(x.shape)
    else:
        if mask[0]:
            dx = _ATEN.native_layer_norm_backward(g, rows, (k,), mean, rstd, w, b,
                                                  [True, False, False])[0].view(x.shape)
        if need_w:
            dw, db = _layer_norm_param_grads(g, rows, mean, rstd, w, b, need_b)
        elif need_b:
            db = torch.sum(g, 0, dtype=torch.float32)
    if addend is not None and dx is not None:
        dx.add_(addend)
    return (dx, None if dw is None else dw.view(weight.shape).to(weight.dtype),
            None if db is None else db.view(bias.shape).to(bias.dtype))


#: Widest rows whose LayerNorm gradients come from torch's LayerNorm backward kernel (on
#: float32/float64 CPU input). That kernel adds a row's ``sum g x`` and ``sum g`` (``g = dy
#: w``) in vector lanes, each in sequence, and takes ``sum g (x - mean)`` as their
#: difference: with an upstream gradient along the input (``dy = x``, ``|mean| / std`` 0
#: and 1.9, 6 seeds, 2^20 values in all; scratch measurements, ``benchmarks/accuracy.py
#: --wide-rows`` repeats 4096 to 2^20) its ``dx`` was off by 1.5e-5 at 8192 features,
#: 1.9e-5 at 16384, 2.3e-5 at 32768, 2.8e-5 at 65536 (3.2e-5 in a draw of 32 rows, 2
#: seeds) and 6.0e-5 at 262144 (relative to
#: the largest gradient, at least 1; float32 tolerance 5e-5), where torch's BatchNorm
#: backward kernel on the rows as channels, which centers first, gave 3.1e-6, 4.1e-6,
#: 4.4e-6, 7.5e-6 and 2.0e-5. So the LayerNorm kernel up to 65536 features (as far as
#: channels-last BatchNorm's bound keeps torch's kernel, 2.8e-5); wider rows take
#: :func:`_layer_norm_backward_wide` (that kernel, and past
#: ``channels.ROW_BACKWARD_MAX_LENGTH`` features the slice-sums engine's sums in pieces),
#: which costs time: LayerNorm fwd+bwd at 16 x 262144, ratio to torch 0.98x -> 0.77x
#: (one thread), 1.01x -> 0.58x (two); 4 x 2^20 1.01x -> 0.84x, 0.99x -> 0.74x.
LAYER_NORM_BACKWARD_MAX_WIDTH = 1 << 16


def _wide_rows(x: Tensor, shape: tuple[int, ...]) -> bool:
    """Whether :func:`layer_norm_backward` of ``x`` over ``shape`` takes
    :func:`_layer_norm_backward_wide`: contiguous float32/float64 CPU rows wider than
    :data:`LAYER_NORM_BACKWARD_MAX_WIDTH`.

    Example:
        >>> whole_samples, tokens = torch.empty(2, 64, 32, 64), torch.empty(8, 768)
        >>> _wide_rows(whole_samples, (64, 32, 64)), _wide_rows(tokens, (768,))
        (True, False)
    """
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and x.is_contiguous() and math.prod(shape) > LAYER_NORM_BACKWARD_MAX_WIDTH)


def _layer_norm_backward_wide(dy: Tensor, x: Tensor, shape: tuple[int, ...], mean: Tensor,
                              rstd: Tensor, weight: Tensor | None, bias: Tensor | None,
                              mask: list[bool], addend: Tensor | None = None, row_term=None
                              ) -> tuple[Tensor | None, ...]:
    """:func:`layer_norm_backward` of rows wider than :data:`LAYER_NORM_BACKWARD_MAX_WIDTH`:
    ``dx`` as InstanceNorm's of ``g = dy * weight`` over the ``(M, 1, K)`` view, one slice
    per row (:func:`normkit.kernels.channels.backward`: torch's BatchNorm backward kernel,
    whose sums are centered, or past ``ROW_BACKWARD_MAX_LENGTH`` features its sums in
    pieces), then ``row_term`` and ``addend``; the weight gradient ``sum_rows dy * xhat``
    and the bias gradient ``sum_rows dy``, the rows added in float64.

    Example:
        >>> x, dy = (torch.randn(2, 70000, dtype=torch.float64) for _ in range(2))
        >>> y, mean, rstd = torch.native_layer_norm(x, (70000,), None, None, 1e-5)
        >>> dx = _layer_norm_backward_wide(dy, x, (70000,), mean, rstd, None, None,
        ...                                [True, False, False])[0]
        >>> want = torch.ops.aten.native_layer_norm_backward(dy, x, (70000,), mean, rstd, None,
        ...                                                  None, [True, False, False])[0]
        >>> torch.allclose(dx, want)
        True
    """
    from . import channels  # (channels imports this module)

    k = math.prod(shape)
    m = x.numel() // k
    rows, g = x.view(m, 1, k), dy.reshape(m, 1, k)
    mean, rstd = mean.reshape(m, 1), rstd.reshape(m, 1)
    dx = dw = db = None
    if mask[0]:
        gw = g if weight is None else g * weight.reshape(1, 1, k)
        dx = channels.backward(gw, rows, mean, rstd, None, channels.Pool("instance"),
                               (True, False, False))[0]
        if row_term is not None:
            dx.view(m, k).add_(row_term(slice(None)))
        if addend is not None:
            dx.add_(addend.reshape(m, 1, k))
        dx = dx.view(x.shape)
    if (mask[1] and weight is not None) or (mask[2] and bias is not None):
        # (per feature, over the rows, centered: torch's LayerNorm kernel is accurate there)
        _, dw, db = _ATEN.native_layer_norm_backward(dy, x, shape, mean, rstd, weight, bias,
                                                     [False, mask[1], mask[2]])
    return dx, dw, db


def _half_backward_rows(k: int) -> int:
    """Rows of width ``k`` per float32 block of :func:`layer_norm_backward`."""
    return max(1, HALF_BACKWARD_BLOCK_BYTES // (4 * k))


def _layer_norm_param_grads(g: Tensor, rows: Tensor, mean: Tensor, rstd: Tensor, w: Tensor,
                            b: Tensor | None, need_b: bool) -> tuple[Tensor, Tensor | None]:
    """LayerNorm's float32 weight (and bias) gradients of 16-bit ``(M, K)`` rows: torch's
    float32 kernel a block of rows at a time (:func:`layer_norm_backward`)."""
    m, k = rows.shape
    step = min(m, _half_backward_rows(k))
    g32 = torch.empty(step, k, dtype=torch.float32, device=rows.device)
    x32 = torch.empty_like(g32)
    dw = torch.zeros(k, dtype=torch.float32, device=rows.device)
    db = torch.zeros_like(dw) if need_b else None
    for start in range(0, m, step):
        end = min(m, start + step)
        gb, xb = g32[:end - start], x32[:end - start]
        gb.copy_(g[start:end])
        xb.copy_(rows[start:end])
        _, pw, pb = _ATEN.native_layer_norm_backward(
            gb, xb, (k,), mean[start:end], rstd[start:end], w, b, [False, True, need_b])
        dw.add_(pw)
        if need_b:
            db.add_(pb)
    return dw, db


class _KernelNode(torch.autograd.Function):
    """A kernel's output as one autograd node over ``(x, weight, bias)``: backward by
    ``backward(dy, x, weight, bias, mask) -> (dx, dweight, dbias)``, the kernel's own;
    double backward (``create_graph=True``) by differentiating ``reference(x, weight,
    bias)``, float32 math for 16-bit input (see :func:`kernel_node`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out, backward, reference):
        ctx.backward_fn, ctx.reference = backward, reference
        ctx.save_for_backward(x, weight, bias)
        return out[0]  # (passed in a tuple: a fresh tensor, not an input of the node)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if backward_by_reference(dy):  # create_graph=True, batched gradients
            grads = reference_grads(ctx.reference, (x, weight, bias), needs, dy)
        else:
            grads = ctx.backward_fn(dy, x, weight, bias, list(needs))
        return (*grads, None, None, None)


def kernel_node(x: Tensor, weight: Tensor | None, bias: Tensor | None, y: Tensor,
                backward, reference) -> Tensor:
    """``y``, computed without autograd from ``(x, weight, bias)``, attached to them by one
    node (:class:`_KernelNode`) when any needs a gradient: first-order gradients from
    ``backward(dy, x, weight, bias, mask)``, higher orders from differentiating
    ``reference(x, weight, bias)``.

    For torch kernels whose own derivative is wrong in 16 bits: LayerNorm's backward
    sums the weight gradients in 16 bits (:func:`layer_norm_backward`), and BatchNorm's
    double backward reduces 16-bit tensors -- in float16 it overflows to inf/NaN from
    ~10^4 values per channel (``tests/test_dispatch_fuzz.py``'s second-derivative tests
    found it; torch 2.13) -- so their 16-bit paths differentiate float32 references.

    Example:
        >>> x = torch.randn(4, 3).half().requires_grad_()
        >>> y = kernel_node(x, None, None, x.detach() * 2,
        ...                 lambda dy, x, w, b, mask: (dy * 2, None, None),
        ...                 lambda x, w, b: (x.float() * 2).to(x.dtype))
        >>> y.backward(torch.ones_like(y)); x.grad.unique()
        tensor([2.], dtype=torch.float16)
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias)):
        return _KernelNode.apply(x, weight, bias, (y,), backward, reference)
    return y


def _float32(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float()


def weight_for_bias(weight: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """``weight``, or a unit weight where a bias comes without one: torch's LayerNorm and
    BatchNorm double backward raise through the bias's gradient without a weight
    ("Expected a proper Tensor but got None", torch 2.13; its GroupNorm backward even in
    first order), so normkit's kernel paths never hand them that combination.

    Example:
        >>> weight_for_bias(None, torch.zeros(3))
        tensor([1., 1., 1.])
        >>> weight_for_bias(None, None) is None
        True
    """
    return torch.ones_like(bias) if weight is None and bias is not None else weight


def group_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                        weight: Tensor | None, n: int, c: int, hxw: int, groups: int,
                        mask: list[bool]) -> tuple[Tensor | None, Tensor | None,
                                                   Tensor | None]:
    """torch's ``native_group_norm_backward``, safe on channels-last CPU input.

    torch's CPU kernel for channels-last input crashes the process (a segmentation
    fault, torch 2.13) when the input's gradient is not asked for (``mask[0]`` False
    with a parameter gradient asked): the GroupNorm's input does not require a gradient
    -- a first layer on image data, a frozen backbone under trainable norms -- while its
    weight or bias does. torch's own ``nn.GroupNorm`` crashes there. So on the CPU every
    input that is not plain contiguous asks for the input gradient too and drops it.

    Contiguous float32/float64 input with long slices (:func:`_long_slices`) gets its
    gradients from the slice-sums engine instead, whose sums stay accurate there.

    Example:
        >>> x = torch.randn(2, 4, 3, 3).contiguous(memory_format=torch.channels_last)
        >>> y, mean, rstd = torch.native_group_norm(x, torch.ones(4), None, 2, 4, 9, 2, 1e-5)
        >>> dx, dw, db = group_norm_backward(torch.ones_like(y), x, mean, rstd,
        ...                                  torch.ones(4), 2, 4, 9, 2, [False, True, True])
        >>> dx is None, dw.shape, db.tolist()
        (True, torch.Size([4]), [18.0, 18.0, 18.0, 18.0])
    """
    if _long_slices(x):  # (contiguous: no crash to avoid)
        from . import channels  # (channels imports this module)
        per_channel = [t.reshape(n, groups).repeat_interleave(c // groups, 1)
                       for t in (mean, rstd)]
        return channels.backward(dy, x, *per_channel, weight, channels.Pool("group", groups),
                                 tuple(mask))
    if mask[0] or not (mask[1] or mask[2]) or x.device.type != "cpu" or x.is_contiguous():
        return tuple(_ATEN.native_group_norm_backward(dy, x, mean, rstd, weight, n, c, hxw,
                                                      groups, mask))
    _, dw, db = _ATEN.native_group_norm_backward(dy, x, mean, rstd, weight, n, c, hxw,
                                                 groups, [True, mask[1], mask[2]])
    return None, dw, db


def group_norm_backward_crashes(x: Tensor, weight: Tensor | None,
                                bias: Tensor | None) -> bool:
    """Whether torch's own autograd of ``native_group_norm`` on ``x`` would reach the
    crash :func:`group_norm_backward` avoids: grad mode, a CPU input that is not plain
    contiguous and needs no gradient, and a weight or bias that does.

    Example:
        >>> x = torch.randn(2, 4, 3, 3).contiguous(memory_format=torch.channels_last)
        >>> group_norm_backward_crashes(x, torch.ones(4, requires_grad=True), None)
        True
        >>> group_norm_backward_crashes(x.contiguous(), torch.ones(4, requires_grad=True), None)
        False
    """
    return (torch.is_grad_enabled() and x.device.type == "cpu" and not x.requires_grad
            and not x.is_contiguous()
            and any(t is not None and t.requires_grad for t in (weight, bias)))


def group_norm_kernel(x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int,
                      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.native_group_norm`` of ``(N, C, *)`` input: ``(y, mean, rstd)``. 16-bit input
    that needs a gradient gets it from the same backward kernel through
    :func:`kernel_node`, whose double backward is float32 math: torch's own
    ``create_graph=True`` backward of its GroupNorm is a composite in the input's dtype,
    whose bfloat16 weight gradient was 1.6 off (relative 4e-2) at 40 std of offset.
    Contiguous float32/float64 input whose result would land on fresh memory (32 MiB and
    up with glibc's default allocator) runs the kernels block by block of samples onto
    huge pages, forward and backward (:func:`_group_norm_blocks`, the same bits but for
    the parameter gradients' float64-summed partials). Contiguous float32/float64 input
    with more than :data:`GROUP_NORM_BACKWARD_MAX_LENGTH` positions per channel gets its
    gradients from the slice-sums engine (:func:`_long_slices`).

    Example:
        >>> x = torch.randn(2, 4, 8, 8).bfloat16().requires_grad_()
        >>> y, mean, rstd = group_norm_kernel(x, torch.ones(4), None, 2, 1e-5)
        >>> y.dtype, mean.dtype, mean.shape
        (torch.bfloat16, torch.float32, torch.Size([2, 2]))
    """
    n, c = x.shape[:2]
    hxw = x.shape[2:].numel()
    blocks = None if x.dtype in _HALF else _group_norm_blocks(x, weight, bias, groups, eps)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, weight, bias))
    if (blocks is None and not group_norm_backward_crashes(x, weight, bias)
            and not (grad and (x.dtype in _HALF or _long_slices(x)))):
        return torch.native_group_norm(x, weight, bias, n, c, hxw, groups, eps)
    y, mean, rstd, backward, reference = group_norm_kernel_parts(x, weight, bias, groups,
                                                                 eps, blocks)
    return kernel_node(x, weight, bias, y, backward, reference), mean, rstd


def group_norm_kernel_parts(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                            groups: int, eps: float, blocks=None):
    """``(y, mean, rstd, backward, reference)`` of torch's GroupNorm kernels on ``x``, no
    autograd attached: the output (:func:`_group_norm_blocks`' when given), and the
    backward and reference of :func:`kernel_node` (see :func:`group_norm_kernel`).

    Example:
        >>> x = torch.randn(2, 4, 5)
        >>> y, mean, rstd, backward, _ = group_norm_kernel_parts(x, None, None, 2, 1e-5)
        >>> dx, _, _ = backward(torch.ones_like(y), x, None, None, [True, False, False])
        >>> mean.shape, y.requires_grad, bool(dx.abs().max() < 1e-4)
        (torch.Size([2, 2]), False, True)
    """
    n, c = x.shape[:2]
    hxw = x.shape[2:].numel()
    if blocks is not None:
        y, mean, rstd = blocks
    else:
        with torch.no_grad():
            y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hxw, groups, eps)

    def backward(dy, x, weight, bias, mask):
        # (the kernel reads dy in x's layout, as torch's autograd hands it: an activation's
        # channels-last gradient of a contiguous x gave garbage)
        dy = dy.contiguous(memory_format=channels_last_format(x) or torch.contiguous_format)
        blocked = None if x.dtype in _HALF else _group_norm_backward_blocks(
            dy, x, mean, rstd, weight, bias, groups, mask)
        if blocked is not None:
            return blocked
        return group_norm_backward(dy, x, mean, rstd, weight, n, c, hxw, groups, mask)

    def reference(x, weight, bias):  # torch's GroupNorm, in float32 for 16-bit x
        if x.dtype not in _HALF:
            return torch.nn.functional.group_norm(x, groups, weight, bias, eps)
        return torch.nn.functional.group_norm(x.float(), groups, _float32(weight),
                                              _float32(bias), eps).to(x.dtype)

    return y, mean, rstd, backward, reference


#: Most positions per channel for which GroupNorm's and InstanceNorm's gradients on
#: contiguous float32/float64 input come from torch's GroupNorm backward kernel
#: (:func:`_long_slices`). That kernel adds each channel's ``sum dy`` and ``sum dy x`` in
#: vector lanes, each lane in sequence, and takes ``sum dy (x - mean)`` as their
#: difference: with an upstream gradient along the input (``dy = x``, whose exact ``dx`` is
#: what ``eps`` leaves; ``|mean| / std`` 0 and 1.9, 4 seeds, one and two channels per
#: group; scratch measurements) its ``dx`` was off by up to 2.1e-5 at 65536 positions,
#: 3.3e-5 at 131072, 6.9e-5 at 262144 and 2.3e-4 at 2^20 (relative to the largest
#: gradient, at least 1; float32 tolerance 5e-5), where the slice-sums engine's sums in
#: pieces give 1e-6 at every length (``benchmarks/accuracy.py --long-slices``). So the
#: kernel up to 2^16, within half the tolerance.
GROUP_NORM_BACKWARD_MAX_LENGTH = 1 << 16


def _long_slices(x: Tensor) -> bool:
    """Whether the gradients of GroupNorm (and InstanceNorm) of ``x`` come from the
    slice-sums engine rather than torch's GroupNorm backward kernel: contiguous
    float32/float64 CPU input with more than :data:`GROUP_NORM_BACKWARD_MAX_LENGTH`
    positions per channel.

    Example:
        >>> _long_slices(torch.empty(1, 2, 512, 512)), _long_slices(torch.empty(8, 2, 64, 64))
        (True, False)
    """
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and x.dim() > 2 and x.is_contiguous()
            and x.shape[2:].numel() > GROUP_NORM_BACKWARD_MAX_LENGTH)


def sample_blocks(x: Tensor):
    """Slices of ``x``'s samples (dim 0), about :data:`LAYER_NORM_BLOCK_BYTES` each.

    Example:
        >>> list(sample_blocks(torch.empty(5, 128, 1024)))  # 512 KiB per sample
        [slice(0, 4, None), slice(4, 8, None)]
    """
    return _row_blocks(x.shape[0], x[0].numel(), x.element_size())


def _group_norm_blocks(x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int,
                       eps: float) -> tuple[Tensor, Tensor, Tensor] | None:
    """torch's GroupNorm kernel block by block of samples into a result on fresh huge
    pages, as :func:`layer_norm_blocks` does rows: ``(y, mean, rstd)``, the whole call's
    bits (each sample's groups are their own reductions), or ``None`` unless ``x`` is
    contiguous float32/float64 whose result's memory would be fresh (32 MiB and up with
    glibc's default allocator). No autograd: the caller attaches the gradient.

    Example:
        >>> _group_norm_blocks(torch.randn(2, 4, 3), None, None, 2, 1e-5) is None  # small
        True
    """
    if x.dtype not in (torch.float32, torch.float64) or not x.is_contiguous():
        return None
    y = fresh_out_like(x)
    if y is None:
        return None
    mean, rstd = group_norm_by_samples(x, weight, bias, groups, eps,
                                       lambda block, yb: y[block].copy_(yb))
    return y, mean, rstd


def group_norm_by_samples(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                          groups: int, eps: float, store) -> tuple[Tensor, Tensor]:
    """torch's GroupNorm kernel over contiguous ``(N, C, *)`` ``x`` block by block of
    samples (:func:`sample_blocks`), each block's output handed to ``store(block, yb)``
    while in cache (``block`` a slice of the samples, ``yb`` a buffer the next block
    reuses); returns the ``(N, G)`` mean and rstd, the whole call's bits. No autograd.

    Example:
        >>> x = torch.randn(3, 4, 5)
        >>> y = torch.empty_like(x)
        >>> mean, rstd = group_norm_by_samples(x, None, None, 2, 1e-5,
        ...                                    lambda block, yb: y[block].copy_(yb))
        >>> torch.equal(y, torch.nn.functional.group_norm(x, 2)), mean.shape
        (True, torch.Size([3, 2]))
    """
    n, c = x.shape[:2]
    hxw = x.shape[2:].numel()
    mean, rstd = x.new_empty(n, groups), x.new_empty(n, groups)
    with torch.no_grad():
        for block in sample_blocks(x):
            xb = x[block]
            yb, mb, rb = torch.native_group_norm(xb, weight, bias, xb.shape[0], c, hxw,
                                                 groups, eps)
            mean[block].copy_(mb)
            rstd[block].copy_(rb)
            store(block, yb)
    return mean, rstd


def _group_norm_backward_blocks(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                                weight: Tensor | None, bias: Tensor | None, groups: int,
                                mask: list[bool]) -> tuple[Tensor | None, ...] | None:
    """torch's GroupNorm backward kernel block by block of samples, ``dx`` copied into
    fresh huge pages (``None`` where it would gain nothing); the weight and bias
    gradients are the blocks' partial sums added in float64."""
    if not mask[0] or not x.is_contiguous():
        return None
    dx = fresh_out_like(x)
    if dx is None:
        return None
    c, hxw = x.shape[1], x.shape[2:].numel()
    dws, dbs = [], []
    for block in sample_blocks(x):
        xb = x[block]
        d, pw, pb = group_norm_backward(dy[block], xb, mean[block], rstd[block], weight,
                                        xb.shape[0], c, hxw, groups, mask)
        dx[block].copy_(d)
        dws.append(pw)
        dbs.append(pb)
    return (dx, float64_total(dws, weight) if mask[1] and weight is not None else None,
            float64_total(dbs, bias) if mask[2] and bias is not None else None)


def float64_total(parts: list[Tensor], like: Tensor) -> Tensor:
    """The sum of per-block partial gradients, added in float64, in ``like``'s dtype.

    Example:
        >>> float64_total([torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])],
        ...               torch.zeros(2))
        tensor([1.5000, 2.2500])
    """
    return torch.stack(parts).sum(0, dtype=torch.float64).to(like.dtype).view(like.shape)


def batch_norm_kernel(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                      running_mean: Tensor | None, running_var: Tensor | None,
                      momentum: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.native_batch_norm`` in training mode: ``(y, mean, invstd)``. 16-bit input
    that needs a gradient gets it from the same backward kernel through
    :func:`kernel_node`, whose double backward is float32 math: torch's own reduces
    float16 tensors and returns inf/NaN second derivatives from ~10^4 values per channel.

    Example:
        >>> x = torch.randn(4, 3, 64, 64).half().requires_grad_()
        >>> w = torch.ones(3, requires_grad=True)
        >>> y, mean, invstd = batch_norm_kernel(x, w, None, None, None, 0.1, 1e-5)
        >>> dy = torch.randn_like(y)
        >>> gw, = torch.autograd.grad(y, w, dy, create_graph=True)
        >>> hx, = torch.autograd.grad(gw.sum(), x)
        >>> bool(hx.isfinite().all())
        True
    """
    weight = weight_for_bias(weight, bias)
    if x.dtype not in _HALF or not torch.is_grad_enabled() or not any(
            t is not None and t.requires_grad for t in (x, weight, bias)):
        return torch.native_batch_norm(x, weight, bias, running_mean, running_var, True,
                                       momentum, eps)
    with torch.no_grad():
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean,
                                                  running_var, True, momentum, eps)

    def backward(dy, x, weight, bias, mask):
        # (dy in x's memory format: torch's 16-bit kernel, handed a channels-last x and an
        # NCHW dy, took a path 3.9e-3 off float64 where the matching one is 1.8e-5 off,
        # for an upstream gradient along the input; 9.9e-4 against 3.3e-4 for a random one)
        dy = strided_like(dy.contiguous(memory_format=channels_last_format(x)
                                        or torch.contiguous_format), x)
        return tuple(_ATEN.native_batch_norm_backward(dy, x, weight, None, None, mean, invstd,
                                                      True, eps, mask))

    def reference(x, weight, bias):  # torch's BatchNorm in float32
        return torch.nn.functional.batch_norm(x.float(), None, None, _float32(weight),
                                              _float32(bias), True, 0.0, eps).to(x.dtype)

    return kernel_node(x, weight, bias, y, backward, reference), mean, invstd


def _layer_norm_16bit(x: Tensor, shape: tuple[int, ...], weight: Tensor | None,
                      bias: Tensor | None, eps: float) -> Tensor | None:
    """:func:`layer_norm` of float16/bfloat16 ``x``: torch's forward kernel with float32
    parameters (:func:`kernel_params`: float32 statistics) under the same ratio
    bound, and an accurate backward (:func:`layer_norm_backward`)."""
    w, b = kernel_params(x, shape, weight, bias)
    with torch.no_grad():
        y, mean, rstd = torch.native_layer_norm(x, shape, w, b, eps)

    def backward(dy, x, weight, bias, mask):
        return layer_norm_backward(dy, x, shape, mean, rstd, weight, bias, mask)

    if not well_conditioned(mean, rstd, THRESHOLDS["layer_norm"]):
        return repair_rows(x, shape, weight, bias, eps, y, mean, rstd,
                           THRESHOLDS["layer_norm"], backward)

    def reference(x, weight, bias):  # torch's composite in float32
        return torch.nn.functional.layer_norm(x.float(), shape,
                                              _float32(weight_for_bias(weight, bias)),
                                              _float32(bias), eps).to(x.dtype)

    return kernel_node(x, weight, bias, y, backward, reference)


#: Most values per channel for which torch's channels-last (and 2D) training-mode
#: BatchNorm is kept (error <= 1.1e-5 at ratio <= 2; see the tables above).
CHANNELS_LAST_MAX_COUNT = 8192
#: Most values per channel for which the slice-sums engine's channels-last BatchNorm
#: backward is torch's backward kernel, from the engine's accurate statistics (one call:
#: sums and ``dx``), rather than the engine's folded sums and two elementwise passes
#: (1.31-2.07x faster at 16384 to 131072 values, ``benchmarks/column_sums.py
#: --backward``, 1 and 2 threads). The kernel sums ``dy`` and ``dy * (x - mean)``
#: sequentially along the positions, so its errors grow with the count. With upstream
#: gradients unrelated to the input they stay small (dx 2.0e-6 at 131072 values, where
#: this bound sat until 2026-12-04), but an upstream gradient along the input, whose
#: ``sum dy * (x - mean)`` does not cancel (``dy = x``: the exact ``dx`` is what ``eps``
#: leaves), shows the sequential sum's error in full: dx 1.6e-5 at 8192, 2.8e-5 at 16384,
#: 3.8e-5 at 32768, 9.3e-5 at 65536, 2.2e-4 at 131072, the engine 1.8e-6 to 4.8e-6
#: (max error relative to the largest reference magnitude, float32 tolerance 5e-5;
#: ``benchmarks/accuracy.py --backward-counts``, ACCURACY.md). Kept up to 16384, under
#: the tolerance with a margin.
CHANNELS_LAST_BACKWARD_MAX_COUNT = 1 << 14
#: :data:`CHANNELS_LAST_MAX_COUNT` for float16/bfloat16 input, whose output is rounded to
#: 11 or 8 significant bits: torch's sequential float32 sums stay 8.9e-5 off at 131072
#: values per channel (``benchmarks/accuracy.py --counts``, ACCURACY.md), 5x under
#: float16's half-ulp at 1.0 (4.9e-4) and 40x under bfloat16's (3.9e-3), so its kernel
#: serves 16-bit input up to there (the slice-sums engine, float32/float64 only, does not
#: serve 16-bit input at all: it took the compensated core, 5-8x slower than torch).
CHANNELS_LAST_MAX_COUNT_16BIT = 1 << 17


def _bn_threshold(x: Tensor, training: bool = False) -> float | None:
    """The ratio bound under which torch's BatchNorm kernel is kept for ``x``, or
    ``None`` where it is never used (empty input, strided input, and in training
    channels-last or 2D input with more than :data:`CHANNELS_LAST_MAX_COUNT` values per
    channel, :data:`CHANNELS_LAST_MAX_COUNT_16BIT` for 16-bit input)."""
    if x.numel() == 0:  # torch's CPU kernel dies with SIGFPE on an empty batch in eval
        return None
    if x.dim() > 2 and x.is_contiguous():
        return THRESHOLDS["batch_norm"]
    rows_last = (x.dim() == 2 and x.is_contiguous()) or (
        x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or (
        x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))
    if not rows_last:
        return None
    if not training:
        return THRESHOLDS["batch_norm_channels_last"]
    limit = (CHANNELS_LAST_MAX_COUNT_16BIT if x.dtype in (torch.float16, torch.bfloat16)
             else CHANNELS_LAST_MAX_COUNT)
    if x.numel() // x.shape[1] > limit:
        return None
    return THRESHOLDS["batch_norm_channels_last_train"]


def batch_norm_train(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                     weight: Tensor | None, bias: Tensor | None, momentum: float,
                     eps: float) -> Tensor | None:
    """torch's fused training-mode BatchNorm when accurate, else ``None``.

    torch updates the running statistics (unbiased variance) inside its kernel; when
    the output is rejected they are restored, so the robust path updates them once.
    16-bit input without float32 parameters gets 16-bit statistics from the kernel, kept
    only under :data:`HALF_STATISTICS_RATIO` (the caller then takes
    :func:`batch_norm_train_stats`, whose statistics are float32).

    Example:
        >>> rm, rv = torch.zeros(3), torch.ones(3)
        >>> y = batch_norm_train(torch.randn(8, 3) + 1e5, rm, rv, None, None, 0.1, 1e-5)
        >>> y is None, bool((rm == 0).all())
        (True, True)
    """
    fast = batch_norm_train_saved(x, running_mean, running_var, weight, bias, momentum, eps)
    return None if fast is None else fast[0]


def batch_norm_train_saved(x: Tensor, running_mean: Tensor | None,
                           running_var: Tensor | None, weight: Tensor | None,
                           bias: Tensor | None, momentum: float, eps: float
                           ) -> tuple[Tensor, Tensor, Tensor] | None:
    """:func:`batch_norm_train` with what the kernel saves for its backward: ``(y, mean,
    invstd)`` (detached; 16-bit for 16-bit input without float32 parameters, as
    ``torch.ops.aten.native_batch_norm_backward`` then wants them), else ``None``.

    Example:
        >>> x = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 2.0, -3.0]] * 4).bfloat16()  # centered
        >>> y, mean, invstd = batch_norm_train_saved(x, None, None, None, None, 0.1, 1e-5)
        >>> mean.dtype, invstd.shape
        (torch.bfloat16, torch.Size([3]))
    """
    threshold = _bn_threshold(x, training=True)
    if (threshold is None or x.dtype not in _FLOATS
            or not kernel_dtypes(x, running_mean, running_var, weight, bias)):
        return None
    if half_statistics(x, weight, bias):
        threshold = min(threshold, HALF_STATISTICS_RATIO)
    saved = [t.clone() if t is not None else None for t in (running_mean, running_var)]
    y, mean, invstd = batch_norm_kernel(x, weight, bias, running_mean, running_var, momentum,
                                        eps)
    if well_conditioned(mean, invstd, threshold):
        return y, mean.detach(), invstd.detach()
    with torch.no_grad():
        for running, before in zip((running_mean, running_var), saved, strict=True):
            if running is not None:
                running.copy_(before)
    return None


def batch_norm_train_stats(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                           eps: float) -> tuple[Tensor, Tensor, Tensor] | None:
    """torch's fused training-mode BatchNorm without running buffers, when accurate:
    ``(y, mean, var)`` with the detached ``(C,)`` batch mean and biased variance, else
    ``None``.

    For callers that update the running statistics their own way: torch's kernel stores
    the unbiased variance, the Keras and Flax convention the biased one
    (``unbiased_running_var=False``). ``var`` comes from the kernel's ``invstd``
    (``invstd^-2 - eps``), off by a few ulps of ``var + eps``, the quantity inference
    normalizes with.

    Example:
        >>> x = torch.randn(8, 3, 4, 4) * 2 + 1
        >>> y, mean, var = batch_norm_train_stats(x, None, None, 1e-5)
        >>> torch.allclose(var, x.var((0, 2, 3), correction=0), rtol=1e-5)
        True
        >>> batch_norm_train_stats(x + 1e5, None, None, 1e-5) is None
        True
    """
    threshold = _bn_threshold(x, training=True)
    if threshold is None or x.dtype not in _FLOATS or not kernel_dtypes(x, weight, bias):
        return None
    weight, bias = kernel_params(x, x.shape[1:2], weight, bias)  # (16-bit x: float32 stats)
    y, mean, invstd = batch_norm_kernel(x, weight, bias, None, None, 0.0, eps)
    if not well_conditioned(mean, invstd, threshold):
        return None
    var = torch.pow(invstd.detach(), -2).sub_(eps).clamp_(min=0.0)
    return y, mean.detach(), var


def batch_norm_stats(x: Tensor, eps: float, *params: Tensor | None
                     ) -> tuple[Tensor, Tensor] | None:
    """``(mean, invstd)`` per channel, training-mode BatchNorm's batch statistics by
    torch's kernel (detached; ``invstd = 1 / sqrt(var + eps)``, ``var`` biased), when
    accurate and the kernel takes ``params`` (the affine the caller will pass it) beside
    ``x``, else ``None``.

    For callers that need the statistics before they normalize (Batch Renormalization's
    correction enters its affine): the same kernel run again on the same input
    reproduces them exactly. The kernel's normalized output is dropped.

    Example:
        >>> mean, invstd = batch_norm_stats(torch.randn(8, 3, 4, 4) * 2 + 1, 1e-5)
        >>> mean.shape, bool((invstd < 0.71).all())
        (torch.Size([3]), True)
        >>> batch_norm_stats(torch.randn(8, 3) + 1e5, 1e-5) is None
        True
    """
    threshold = _bn_threshold(x, training=True)
    if threshold is None or x.dtype not in _FLOATS or not kernel_dtypes(x, *params):
        return None
    # (16-bit input: a float32 weight selects the kernel's mixed-dtype path, which
    # returns the statistics in float32 rather than rounded to the input's dtype)
    unit = (torch.ones(x.shape[1], dtype=torch.float32, device=x.device)
            if x.dtype in (torch.float16, torch.bfloat16) else None)
    with torch.no_grad():
        _, mean, invstd = torch.native_batch_norm(x, unit, None, None, None, True, 0.0, eps)
    if not well_conditioned(mean, invstd, threshold):
        return None
    return mean, invstd


def batch_norm_moments(x: Tensor, eps: float, checked: bool = True
                       ) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(mean, var, invstd)`` per channel (``var`` biased, ``invstd = 1 / sqrt(var +
    eps)``, detached) of training-mode BatchNorm by torch's statistics kernel alone
    (``torch.batch_norm_update_stats``: one read of ``x``, no output written), when
    accurate by the bound of :func:`batch_norm_train`, else ``None``; with ``checked=False``
    always, unchecked (an accelerator's: the check reads a statistic back to the host, a
    device sync, and torch's GPU kernels are BatchNorm's there anyway). Any float dtype:
    for float16/bfloat16 ``x`` the statistics come back in float32 (the kernel returns
    them in its running buffers' dtype: it is handed float32 stand-ins with momentum 0):
    the fused kernel's with float32 parameters, the same mean bit for bit and ``invstd``
    within an ulp (``tests/test_frozen_renorm.py`` checks it), so the same accuracy.

    Its sums are those of torch's fused kernel (the same mean, ``invstd`` within an ulp,
    the same error: ``benchmarks/column_sums.py --stats-kernel``), so the same accuracy
    rule holds; on channels-last input with at most :data:`CHANNELS_LAST_MAX_COUNT` values
    per channel it is 2.3-3.4x faster than the fused kernel and than the slice-sums engine's
    accurate sums (same command). For callers that normalize with statistics of their
    own making (Batch Renormalization's corrected affine, through
    :func:`normkit.kernels.channels.normalize_by`).

    Example:
        >>> mean, var, invstd = batch_norm_moments(torch.randn(8, 3, 4, 4) * 2 + 1, 1e-5)
        >>> mean.shape, bool((var > 2).all()), torch.allclose(invstd, (var + 1e-5).rsqrt())
        (torch.Size([3]), True, True)
        >>> batch_norm_moments(torch.randn(8, 3) + 1e5, 1e-5) is None
        True
        >>> batch_norm_moments(torch.randn(8, 3) + 1e5, 1e-5, checked=False)[0].shape
        torch.Size([3])
    """
    threshold = _bn_threshold(x, training=True) if checked else 0.0
    if threshold is None or x.dtype not in _FLOATS:
        return None
    running = (None, None)
    if x.dtype in _HALF:  # (float32 buffers: float32 statistics; momentum 0 keeps them)
        running = (x.new_zeros(x.shape[1], dtype=torch.float32),
                   x.new_ones(x.shape[1], dtype=torch.float32))
    # (detached: the statistics kernel has no derivative; callers hold them constant)
    mean, var = torch.batch_norm_update_stats(x.detach(), *running, 0.0)
    invstd = torch.add(var, eps).rsqrt_()
    return (mean, var, invstd) if not checked or well_conditioned(mean, invstd, threshold) \
        else None


def batch_norm_by_moments(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                          mean: Tensor, var: Tensor, invstd: Tensor, eps: float) -> Tensor:
    """Training-mode BatchNorm of ``x`` from its own batch statistics, computed beforehand
    by :func:`batch_norm_moments`: the output in one pass of torch's inference kernel
    (the batch's mean and variance in the running statistics' place), the gradients from
    its training backward kernel (the statistics as functions of ``x``, which they are),
    double backward from torch's BatchNorm in float32 (:func:`kernel_node`).

    For callers whose affine depends on the statistics (Batch Renormalization's
    ``weight * r``, ``weight * d + bias``): the fused training kernel would compute the
    statistics a second time (and ran a whole normalizing pass to give them first).
    16-bit ``x`` takes float32 parameters (:func:`kernel_params`); ``weight``/``bias`` of
    the module's dtype otherwise.

    Example:
        >>> x = torch.randn(8, 3, 4, 4) * 2 + 1
        >>> mean, var, invstd = batch_norm_moments(x, 1e-5)
        >>> y = batch_norm_by_moments(x, None, None, mean, var, invstd, 1e-5)
        >>> ref = torch.nn.functional.batch_norm(x, None, None, training=True)
        >>> torch.allclose(y, ref, atol=1e-5)
        True
    """
    c = x.shape[1]
    w, b = kernel_params(x, (c,), weight, bias)
    with torch.no_grad():
        y = torch.native_batch_norm(x, w, b, mean, var, False, 0.0, eps)[0]

    def backward(dy, x, weight, bias, mask):
        w = kernel_params(x, (c,), weight, bias)[0]
        dy = strided_like(dy.contiguous(memory_format=channels_last_format(x)
                                        or torch.contiguous_format), x)
        dx, dw, db = _ATEN.native_batch_norm_backward(dy, x, w, None, None, mean, invstd,
                                                      True, eps, mask)
        # (16-bit x: the kernel's parameter gradients are float32, as its parameters were)
        return (dx, None if dw is None or weight is None else dw.to(weight.dtype),
                None if db is None or bias is None else db.to(bias.dtype))

    def reference(x, weight, bias):  # torch's BatchNorm, float32 for 16-bit input
        wide = x.float() if x.dtype in _HALF else x
        weight = weight_for_bias(weight, bias)
        return torch.nn.functional.batch_norm(
            wide, None, None, None if weight is None else weight.to(wide.dtype),
            None if bias is None else bias.to(wide.dtype), True, 0.0, eps).to(x.dtype)

    return kernel_node(x, weight, bias, y, backward, reference)


#: Fewest elements from which float16 InstanceNorm on NCHW runs torch's BatchNorm kernels
#: on the ``(1, N*C, L)`` view (:func:`instance_norm`) rather than its GroupNorm kernel,
#: whose float16 version is slow but whose one call (and C++ autograd node) costs less on
#: small inputs. Two alternated runs of each (``normkit bench instance_norm --dtype
#: float16 --shapes 3x5x7x9,2x8x16x16,4x16x16x16,8x16x16x16,8x32x16x16,16x32x16x16,
#: 32x256x14x14,32x64x56x56,8x32x128x128 --threads 1,2 --repeats 7``), the GroupNorm
#: kernel -> the view with this floor at 0, ratio to torch's InstanceNorm: up to 32768
#: elements fwd+bwd 0.48-0.64x -> 0.32-0.47x, at 65536 and 131072 0.52-0.63x ->
#: 0.44-0.71x (even), from 802816 0.32-0.76x -> 0.83-0.92x.
FLOAT16_INSTANCE_VIEW_MIN_ELEMENTS = 1 << 17


def instance_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                  eps: float, stats: bool = True
                  ) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """torch's fused kernels for InstanceNorm of contiguous input when accurate:
    ``(y, mean, var)`` with ``(N, C)`` statistics (``var`` biased; both None unless
    ``stats``: without running buffers nothing reads them), else ``None``.

    InstanceNorm is GroupNorm with one group per channel, and torch's GroupNorm kernel
    (NCHW) runs it faster than torch's own InstanceNorm (BatchNorm of the ``(1, N*C, *)``
    view) and than normkit's slice-sums engine: fwd+bwd 1.4-1.6x torch's InstanceNorm and
    1.1-1.5x the engine, forward 3.1-3.9x and 1.6-1.7x (32x64x56x56, 32x256x14x14,
    8x32x128x128, 1 and 2 threads). Its bound is the NCHW GroupNorm one. 16-bit input
    too (with parameters of its dtype or float32: the kernel's mixed-dtype path), whose
    statistics come back in float32 where the kernel computes them so -- except float16
    from :data:`FLOAT16_INSTANCE_VIEW_MIN_ELEMENTS`, for which torch's GroupNorm kernels
    are slower than its BatchNorm kernels: there the statistics kernel and the inference
    kernel on the ``(1, N*C, L)`` view (:func:`batch_norm_moments`,
    :func:`batch_norm_by_moments`), as torch's own InstanceNorm does (RESULTS.md,
    "Float16 InstanceNorm on NCHW").

    Example:
        >>> y, mean, var = instance_norm(torch.randn(2, 3, 8, 8) + 5.0, None, None, 1e-5)
        >>> mean.shape, bool((mean - 5.0).abs().max() < 1.0)
        (torch.Size([2, 3]), True)
    """
    if not _plain_dense(x) or x.dim() < 3 or not kernel_dtypes(x, weight, bias):
        return None
    n, c = x.shape[:2]
    if x.dtype == torch.float16 and x.numel() >= FLOAT16_INSTANCE_VIEW_MIN_ELEMENTS:
        # torch's float16 GroupNorm kernels are the slow ones (its bfloat16 ones are not):
        # its BatchNorm kernels on the (1, N*C, L) view instead, as torch's InstanceNorm
        # runs, each slice a channel
        view = x.view(1, n * c, -1)
        moments = batch_norm_moments(view, eps)  # (float32; the bound of NCHW BatchNorm)
        if moments is None:
            return None
        mean, var, invstd = moments
        y = batch_norm_by_moments(view, None if weight is None else weight.repeat(n),
                                  None if bias is None else bias.repeat(n), mean, var,
                                  invstd, eps).view(x.shape)
        return (y, mean.view(n, c), var.view(n, c)) if stats else (y, None, None)
    # (one group per channel: the channels past the kernel's bound repaired one by one)
    out = group_norm_with_stats(x, c, weight, bias, eps)
    if out is None:
        return None
    y, mean, rstd = out
    if not stats:
        return y, None, None
    var = rstd.detach().double().pow(-2).sub_(eps).clamp_(min=0).to(rstd.dtype)
    return y, mean.detach().view(n, c), var.view(n, c)


#: Fewest elements per sample, per CPU thread, from which :func:`instance_norm_rows`
#: serves: its kernel calls, two per sample forward and one backward, each parallel
#: inside, cost more than they save on smaller samples (and more with more threads).
#: Two alternated runs of each (``normkit bench instance_norm --dtype bfloat16 --shapes
#: 3x5x7x9:cl,32x16x8x8:cl,64x32x16x16:cl,16x128x16x16:cl,8x64x28x28:cl,32x256x14x14:cl,
#: 16x128x24x24:cl,32x64x56x56:cl,4x64x64x64:cl,8x32x128x128:cl --threads 1,2``), ratio to
#: torch's InstanceNorm, the NCHW copy -> this path with the floor at 0: 1 thread,
#: samples of 315 to 8192 elements 0.51-1.07x -> 0.12-0.64x, from 32768 forward+backward
#: 0.47-1.03x -> 0.97-1.50x; 2 threads, samples of 32768 and 50176 elements 0.70-0.99x
#: -> 0.55-1.08x (mostly worse), from 73728 forward+backward 0.48-0.91x -> 0.90-1.46x.
INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS = 1 << 15


def instance_norm_rows(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                       stats: bool = True
                       ) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """InstanceNorm of channels-last float16/bfloat16 input by torch's BatchNorm kernels,
    sample by sample, each sample's ``(positions, C)`` matrix a view of ``x``: the
    statistics from its statistics kernel (float32), the output by its inference kernel
    written into the output's view, the gradients by its training backward kernel, all in
    the input's layout. ``(y, mean, var)`` as :func:`instance_norm` returns them, or
    ``None`` where BatchNorm's channels-last rule refuses (more than
    :data:`CHANNELS_LAST_MAX_COUNT_16BIT` positions, or a slice's ``|mean| / std`` past
    ``THRESHOLDS["batch_norm_channels_last_train"]``: these kernels sum sequentially
    along the positions, as torch's channels-last BatchNorm does) and for samples under
    :data:`INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS` per thread.

    torch has no channels-last InstanceNorm: its own copies the input to NCHW, and
    torch's channels-last 16-bit GroupNorm kernels are the slow ones (see
    :func:`normkit.functional.group_norm`). The previous route, an NCHW copy through
    :func:`instance_norm` and back, was slower than torch's InstanceNorm (RESULTS.md,
    "InstanceNorm on channels-last 16-bit input").

    Example:
        >>> x = (torch.randn(2, 64, 128, 128) + 1).bfloat16().contiguous(
        ...     memory_format=torch.channels_last)
        >>> y, mean, var = instance_norm_rows(x, None, None, 1e-5)
        >>> ref = torch.nn.functional.instance_norm(x.float())
        >>> bool((y.float() - ref).abs().max() < 0.05), mean.dtype, mean.shape
        (True, torch.float32, torch.Size([2, 64]))
        >>> y.is_contiguous(memory_format=torch.channels_last)
        True
    """
    layout = channels_last_format(x)
    if (layout is None or x.dtype not in _HALF or x.numel() == 0
            or not kernel_dtypes(x, weight, bias)):
        return None
    n, c = x.shape[:2]
    length = x.numel() // (n * c)
    if (length > CHANNELS_LAST_MAX_COUNT_16BIT
            or length * c < INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS * torch.get_num_threads()):
        return None

    def rows(t: Tensor, written: bool = False) -> list[Tensor]:
        # (positions, C) matrices of each sample: views (an output written through them
        # must be one, so ``view``, which raises rather than copies; an input may be read
        # from a copy where its strides of size-1 dims make it one)
        t = t.movedim(1, -1)
        return list((t.view if written else t.reshape)(n, length, c).unbind(0))

    # (float32 running buffers, momentum 0: float32 statistics, the buffers unchanged)
    zero = x.new_zeros(c, dtype=torch.float32)
    one = x.new_ones(c, dtype=torch.float32)
    moments = [torch.batch_norm_update_stats(r, zero, one, 0.0) for r in rows(x.detach())]
    mean = torch.stack([m for m, _ in moments])  # (N, C)
    var = torch.stack([v for _, v in moments])
    invstd = torch.add(var, eps).rsqrt_()
    if not well_conditioned(mean, invstd, THRESHOLDS["batch_norm_channels_last_train"]):
        return None
    w, b = kernel_params(x, (c,), weight, bias)
    y = torch.empty_like(x, memory_format=layout)
    unused = x.new_empty(0, dtype=torch.float32)
    with torch.no_grad():
        for i, (src, dst) in enumerate(zip(rows(x.detach()), rows(y, True), strict=True)):
            _ATEN.native_batch_norm.out(src, w, b, mean[i], var[i], False, 0.0, eps,
                                        out=dst, save_mean=unused, save_invstd=unused)

    def backward(dy, x, weight, bias, mask):
        w = kernel_params(x, (c,), weight, bias)[0]
        grads = [rows(dy.contiguous(memory_format=layout)), rows(x)]
        dx = torch.empty_like(x, memory_format=layout) if mask[0] else None
        dx_rows = None if dx is None else rows(dx, True)
        per_sample = []
        for i, (g, v) in enumerate(zip(*grads, strict=True)):
            if dx_rows is None:
                per_sample.append(_ATEN.native_batch_norm_backward(
                    g, v, w, None, None, mean[i], invstd[i], True, eps, [False, *mask[1:]]))
            else:  # (the out= overload computes all three, then copies: no CPU kernel)
                sums = (mean.new_empty(c), mean.new_empty(c))
                per_sample.append(_ATEN.native_batch_norm_backward.out(
                    g, v, w, None, None, mean[i], invstd[i], True, eps, [True] * 3,
                    out0=dx_rows[i], out1=sums[0], out2=sums[1]))
        dw = (torch.stack([s[1] for s in per_sample]).sum(0).to(weight.dtype)
              if mask[1] and weight is not None else None)
        db = (torch.stack([s[2] for s in per_sample]).sum(0).to(bias.dtype)
              if mask[2] and bias is not None else None)
        return dx, dw, db

    def reference(x, weight, bias):  # torch's InstanceNorm in float32
        return torch.nn.functional.instance_norm(
            x.float(), weight=_float32(weight_for_bias(weight, bias)), bias=_float32(bias),
            eps=eps).to(x.dtype)

    y = kernel_node(x, weight, bias, y, backward, reference)
    return (y, mean, var) if stats else (y, None, None)


def inference_kernel(x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                     var: Tensor, eps: float) -> Tensor:
    """torch's inference BatchNorm kernel (``x`` normalized by the given per-channel
    ``mean`` and ``var``), without autograd (:func:`batch_norm_eval` where no gradient is
    wanted): for contiguous ``x`` whose output
    :func:`~normkit.kernels.memory.out_like` puts on huge pages (32 MiB and up) it writes
    there through the kernel's ``out=`` form -- the same bits, without the 4 KiB page
    faults of the fresh mapping the kernel would allocate (NCHW inference BatchNorm at
    64x64x56x56: ~2.5x faster, ``benchmarks/RESULTS.md``, "Inference BatchNorm on NCHW
    onto huge pages").

    Example:
        >>> x = torch.randn(2, 3, 4)
        >>> y = inference_kernel(x, None, None, torch.zeros(3), torch.ones(3), 0.0)
        >>> torch.equal(y, x)
        True
    """
    out = out_like(x) if x.is_contiguous() else None
    if out is None:
        return torch.native_batch_norm(x, weight, bias, mean, var, False, 0.0, eps)[0]
    _ATEN.native_batch_norm.out(x, weight, bias, mean, var, False, 0.0, eps, out=out,
                                save_mean=x.new_empty(0), save_invstd=x.new_empty(0))
    return out


#: Fewest elements from which inference BatchNorm of channels-last (or 2D ``(N, C)``)
#: float32/float64 input whose parameters and statistics need no gradient (the input's
#: may be wanted: the addcmul's backward is one broadcast ``dy * scale``; FrozenBatchNorm2d
#: forward+backward on channels-last 1x64x56x56 to 32x64x56x56 went from 0.82-1.08x to
#: 0.88-2.79x torch, mostly 1.03-2.34x, in alternated ``normkit bench frozen_batch_norm``
#: runs at 1 and 2 threads) is one broadcast ``torch.addcmul(shift, x, scale)`` instead
#: of torch's inference kernel, which computes the same fold but runs slower on rows-last
#: input: kernel time / addcmul time 1.6-3.0x on channels-last
#: 1x64x56x56 to 32x256x14x14, 1.0-1.3x at 32x64x56x56 (memory-bound), 1.35-2.5x on 2D
#: 64 x 512 and 4096 x 768, 1 and 2 threads (``benchmarks/bn_apply.py``). Below, the
#: kernel's single call beats the five small ops (0.63-0.73x at 945 elements, one thread);
#: on NCHW the kernel is the faster one at every size (addcmul 0.34-0.92x).
BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS = 1 << 14


def batch_norm_eval(x: Tensor, running_mean: Tensor, running_var: Tensor,
                    weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor | None:
    """torch's fused inference BatchNorm when accurate for these running statistics.

    torch folds inference BN into ``x * scale + shift``, which cancels catastrophically
    when the running mean is large relative to the running spread. On channels-last and
    2D input from :data:`BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS`, when no gradient is wanted
    for the parameters or statistics, the same fold runs as a broadcast ``addcmul``
    (faster there than torch's kernel, forward and backward). On NCHW input with a
    gradient, from :data:`EVAL_INPUT_GRAD_MIN_ELEMENTS` (the input's alone: backward
    ``dy * scale``) or :data:`EVAL_PER_SLICE_MIN_ELEMENTS` (trainable affine: torch's
    kernels per ``(n, c)`` slice), faster backward passes than torch's.

    Example:
        >>> batch_norm_eval(torch.randn(2, 3), torch.zeros(3), torch.ones(3), None, None,
        ...                 1e-5).shape
        torch.Size([2, 3])
    """
    threshold = _bn_threshold(x)
    if (threshold is None or not kernel_dtypes(x, running_mean, running_var, weight, bias)
            or not ratio_within(running_mean, running_var, eps, threshold)):
        return None
    weight = weight_for_bias(weight, bias)  # (torch's double backward: see there)
    grads = torch.is_grad_enabled() and (x.requires_grad or any(
        t is not None and t.requires_grad for t in (weight, bias)))
    if (threshold == THRESHOLDS["batch_norm_channels_last"]
            and x.numel() >= BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS
            and x.dtype in (torch.float32, torch.float64) and running_mean.dtype == x.dtype
            and not (grads and any(t is not None and t.requires_grad
                                   for t in (weight, bias, running_mean, running_var)))):
        # (a gradient for x alone is the addcmul's: dy * scale, one broadcast multiply)
        return _fold_eval(x, running_mean, running_var, weight, bias, eps)
    if (grads and x.dim() > 2 and x.is_contiguous() and x.dtype in (torch.float32, torch.float64)
            and not any(t is not None and t.dtype != x.dtype
                        for t in (weight, bias, running_mean, running_var))):
        params = any(t is not None and t.requires_grad for t in (weight, bias))
        if not params and x.numel() >= EVAL_INPUT_GRAD_MIN_ELEMENTS:
            return _EvalInputGradFunction.apply(x, weight, bias, running_mean, running_var,
                                                eps)
        if params and x.numel() >= EVAL_PER_SLICE_MIN_ELEMENTS:
            return _eval_per_slice(x, weight, bias, running_mean, running_var, eps)
    if not grads:
        return inference_kernel(x, weight, bias, running_mean, running_var, eps)
    return torch.native_batch_norm(x, weight, bias, running_mean, running_var, False, 0.0,
                                   eps)[0]


#: Fewest elements from which inference BatchNorm of NCHW input whose gradient alone is
#: wanted runs :class:`_EvalInputGradFunction`: torch's inference backward kernel also
#: computes the parameters' sums nobody asked for, and the node's broadcast multiply
#: instead makes forward+backward 1.34-2.02x faster from 2^20 elements; below, the
#: node's Python costs what it saves (0.41-0.89x at 945 to 131072 elements, 0.90-1.16x
#: at 401408; ``benchmarks/eval_backward.py``, two runs at 1 and 2 threads, glibc heap
#: reuse).
EVAL_INPUT_GRAD_MIN_ELEMENTS = 1 << 19
#: Fewest elements from which inference BatchNorm of NCHW input with trainable affine
#: runs torch's kernels on the ``(1, N*C, L)`` view, parameters repeated per sample (as
#: torch's own InstanceNorm does): their backward reduces each contiguous slice instead
#: of each channel across the batch, forward+backward 1.22-1.72x faster from 1605632
#: elements (32x256x14x14), 0.87-1.38x at 2^20, 0.22-0.90x below
#: (``benchmarks/eval_backward.py``, as above).
EVAL_PER_SLICE_MIN_ELEMENTS = 3 << 19


class _EvalInputGradFunction(torch.autograd.Function):
    """Inference BatchNorm (fixed statistics, parameters without a gradient) of an input
    that needs one: torch's kernel forward, backward ``dy * weight / sqrt(running_var +
    eps)``, one broadcast multiply (differentiable in ``dy``; nothing else is)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps):
        scale = torch.rsqrt(running_var + eps)
        if weight is not None:
            scale.mul_(weight)
        ctx.save_for_backward(scale.view((1, x.shape[1]) + (1,) * (x.dim() - 2)))
        # (torch's own allocation: through inference_kernel it was 0.48-0.59x of this at
        # 64x64x56x56 with two threads on the project's VM, whose balloon re-backs freed
        # huge pages, and 1.50-1.64x with that off -- RESULTS.md, "Inference BatchNorm on
        # NCHW onto huge pages")
        return torch.native_batch_norm(x, weight, bias, running_mean, running_var, False,
                                       0.0, eps)[0]

    @staticmethod
    def backward(ctx, dy):
        (scale,) = ctx.saved_tensors
        return dy * scale, None, None, None, None, None


def _eval_per_slice(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                    running_mean: Tensor, running_var: Tensor, eps: float) -> Tensor:
    """Inference BatchNorm of contiguous ``(N, C, *)`` input as torch's kernel on its
    ``(1, N*C, L)`` view, every per-channel tensor repeated per sample."""
    n, c = x.shape[:2]

    def per_slice(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.repeat(n)

    y = torch.native_batch_norm(x.view(1, n * c, -1), per_slice(weight), per_slice(bias),
                                per_slice(running_mean), per_slice(running_var), False, 0.0,
                                eps)[0]
    return y.view(x.shape)


def _fold_eval(x: Tensor, running_mean: Tensor, running_var: Tensor, weight: Tensor | None,
               bias: Tensor | None, eps: float) -> Tensor:
    """``x * scale + shift`` with torch's inference fold (``scale = weight / sqrt(var +
    eps)``, ``shift = bias - mean * scale``) as one broadcast addcmul, in ``x``'s layout."""
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale.mul_(weight)
    shift = torch.mul(running_mean, scale).neg_() if bias is None else torch.addcmul(
        bias, running_mean, scale, value=-1.0)
    view = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    # (out= takes no part in autograd: a fresh huge-page output only without a gradient)
    out = None if torch.is_grad_enabled() and x.requires_grad else out_like(x)
    return torch.addcmul(shift.view(view), x, scale.view(view), out=out)


def kernel_dtypes(x: Tensor, *tensors: Tensor | None) -> bool:
    """Whether torch's CPU normalization kernels take these dtypes: every tensor in ``x``'s,
    or 16-bit ``x`` with float32 parameters (and statistics). They raise "mixed dtype" on
    other mixes, such as float64 input with float32 parameters, which normkit's own
    paths serve.

    Example:
        >>> x, w = torch.randn(2, 3), torch.ones(3)
        >>> kernel_dtypes(x, w, None), kernel_dtypes(x.half(), w), kernel_dtypes(x.double(), w)
        (True, True, False)
    """
    dtype = x.dtype
    for t in tensors:
        if t is not None and t.dtype != dtype:
            break
    else:
        return True  # (the common case, checked first: every call of a fast path asks)
    return dtype in (torch.float16, torch.bfloat16) and all(
        t is None or t.dtype == torch.float32 for t in tensors)


def ratio_within(mean: Tensor, var: Tensor, eps: float, threshold: float) -> bool:
    """True when every channel's ``|mean| / sqrt(var + eps)`` is at most ``threshold``
    (NaN fails), for statistics given as mean and variance.

    Computed as ``min(var - mean^2 / threshold^2) >= -eps``: two small kernels and one
    read-back, against five and one for the square root and :func:`well_conditioned`
    (an inference BatchNorm call checks its running statistics every time). Rounding
    moves the decision only for ratios within float rounding of the threshold.

    Example:
        >>> ratio_within(torch.tensor([3.0, -1.0]), torch.tensor([1.0, 4.0]), 0.0, 4.0)
        True
        >>> ratio_within(torch.tensor([5.0]), torch.tensor([1.0]), 0.0, 4.0)
        False
        >>> ratio_within(torch.tensor([float("nan")]), torch.tensor([1.0]), 0.0, 4.0)
        False
    """
    if mean.numel() == 0:
        return True
    if mean.requires_grad or var.requires_grad:
        mean, var = mean.detach(), var.detach()
    # (16-bit buffers: torch's CPU addcmul computes in float32, so mean^2 cannot overflow)
    margin = torch.addcmul(var, mean, mean, value=-1.0 / threshold ** 2).min().item()
    return margin >= -eps  # NaN compares False


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None,
               eps: float) -> Tensor | None:
    """torch's fused GroupNorm for contiguous input when accurate, else ``None``: the
    output of :func:`group_norm_with_stats`.

    (torch's channels_last GroupNorm uses an unshifted sum of squares, so it is never
    used here.)

    Example:
        >>> group_norm(torch.randn(2, 4, 3), 2, None, None, 1e-5).shape
        torch.Size([2, 4, 3])
    """
    out = group_norm_with_stats(x, num_groups, weight, bias, eps)
    return None if out is None else out[0]


def group_norm_with_stats(x: Tensor, num_groups: int, weight: Tensor | None,
                          bias: Tensor | None, eps: float, bound: float | None = None,
                          max_share: float = 1.0) -> tuple[Tensor, Tensor, Tensor] | None:
    """torch's fused GroupNorm of contiguous ``(N, C, *)`` input (or channels-last, for
    which the caller gives the ``bound`` of that kernel), group by group where accurate:
    ``(y, mean, rstd)`` with ``(N, G)`` statistics (no autograd on them), else ``None``
    (also where more than ``max_share`` of the groups are past the bound: a caller whose
    own path for the whole call is cheap, see ``channels.REPAIR_MAX_SHARE``).

    The groups past the kernel's bound (``bound``, by default NCHW GroupNorm's in
    :data:`THRESHOLDS`) are normalized again by the
    compensated core (:class:`RowRepair`, per-channel affine) and their statistics are
    the compensated ones; the other groups keep the kernel's result, so each sample gets
    the same bits alone or in any batch, as with torch's GroupNorm (see
    :func:`repair_rows`). ``None`` when every group is past the bound: the caller's
    compensated path gives those groups the same bits. InstanceNorm is this with one
    group per channel (:func:`instance_norm`).

    Example:
        >>> x = torch.randn(3, 4, 5)
        >>> x[1, :2] = x[1, :2] * 0.01 + 3000.0  # one group far off its spread
        >>> y, mean, rstd = group_norm_with_stats(x, 2, None, None, 1e-5)
        >>> ref = torch.nn.functional.group_norm(x.double(), 2)
        >>> bool((y - ref).abs().max() < 1e-5), mean.shape, round(float(mean[1, 0]))
        (True, torch.Size([3, 2]), 3000)
    """
    dense = _plain_dense(x) or (x.numel() > 0 and x.dtype in _FLOATS
                                and channels_last_format(x) is not None)
    if not dense or not kernel_dtypes(x, weight, bias):
        return None
    bound = THRESHOLDS["group_norm"] if bound is None else bound
    weight, bias = kernel_params(x, x.shape[1:2], weight, bias)  # (16-bit x: float32 stats)
    y, mean, rstd = group_norm_kernel(x, weight, bias, num_groups, eps)
    if well_conditioned(mean, rstd, bound):
        return y, mean, rstd
    # the groups past the bound by the compensated core, the others as the kernel left
    # them: each sample its own bits, as with torch's GroupNorm (see repair_rows)
    bad = ill_conditioned_rows(mean, rstd, bound)
    if bad.numel() == mean.numel() or bad.numel() > max_share * mean.numel():
        return None
    y = y.detach()
    _, _, _, kernel_backward, _ = group_norm_kernel_parts(x, weight, bias, num_groups, eps,
                                                          (y, mean, rstd))
    k = x.numel() // mean.numel()
    repair = RowRepair.apply(y, x, k, bad, weight, bias, eps, groups=num_groups)

    def backward(dy, x, weight, bias, mask):
        grads = kernel_backward(repair.zeroed(dy), x, weight, bias, mask)
        return repair.patch(grads, dy, weight, bias, mask)

    def reference(x, weight, bias):  # normkit's reference math (create_graph=True)
        from ..norms._core import affine_view, reference_normalize

        grouped = x.unflatten(1, (num_groups, x.shape[1] // num_groups))
        view = (1, *grouped.shape[1:3]) + (1,) * (x.dim() - 2)
        return reference_normalize(grouped, tuple(range(2, grouped.dim())),
                                   affine_view(weight, view), affine_view(bias, view),
                                   eps)[0].flatten(1, 2)

    mean, rstd = repair.statistics(mean, rstd)
    return kernel_node(x, weight, bias, y, backward, reference), mean, rstd


# ------------------------------------------------------------------ LayerNorm2d on NCHW

#: Largest share of the positions that :func:`layer_norm2d_nchw` renormalizes one by one
#: when they are past its bound (:class:`RowRepair`); past it ``None``: torch's LayerNorm
#: on a channels-innermost copy (its row repair on flat rows costs less).
#: ``benchmarks/outlier_rows.py --cases "LayerNorm2d NCHW 32x64x28x28" --offset-samples 1
#: 2 4 8 --scale 0.1 --shift 1`` (RESULTS.md, "Many samples a little off center"), torch
#: time / normkit time, the copy path -> the repair: 1-2 of 32 samples fwd 0.39-0.42x ->
#: 0.79-0.94x, fwd+bwd 0.69-0.80x -> 0.57-0.83x (even); in scratch runs at 4 samples
#: fwd+bwd 0.86-0.88x -> 0.63x. So 1/16.
LAYER_NORM2D_REPAIR_MAX_SHARE = 1 / 16
#: Fewest elements for which :func:`layer_norm2d_nchw` pays off (it loops over the batch).
LAYER_NORM2D_MIN_ELEMENTS = 1 << 16
#: Fewest positions per sample (``H * W``) for which it pays off when a gradient is
#: needed, with one CPU thread and with more: torch's BatchNorm kernel vectorizes and
#: parallelizes across the positions, so on few of them torch's LayerNorm on a
#: channels-innermost copy is faster. Forward+backward, copy path time / this path's
#: (``benchmarks/layer_norm2d_paths.py``, three runs at 1 thread, two at 2; RESULTS.md):
#: 7 x 7 0.65-0.82x at 1 thread and 0.30-0.36x at 2, 8 x 8 0.79-0.98x and 0.44-0.45x,
#: 14 x 14 1.20-1.23x and 0.57-0.71x, 28 x 28 0.93-0.99x and 0.85-0.92x, 56 x 56
#: 0.90-1.13x and 0.88-1.14x. Where the two are about even this path is kept: it saves
#: the input itself for the backward, where the copy path saves the copy.
LAYER_NORM2D_MIN_POSITIONS = (64, 256)
#: The same floors when no gradient is needed (inference): this path's forward needs no
#: copies. Forward alone, copy time / this path's (same runs): 1 thread 6 x 6 0.76-0.87x,
#: 7 x 7 1.06-1.43x, 8 x 8 1.17-1.23x, 14 x 14 and up 2.1-5.2x; 2 threads 8 x 8
#: 0.60x, 14 x 14 1.02-2.87x, 28 x 28 and up 1.5-4.8x. With one thread the floor is
#: 48 (so 7 x 7 images take this path); with more it stays at 256: at 14 x 14 the layer
#: (``normkit bench layer_norm2d``) showed no gain in four alternated runs.
LAYER_NORM2D_MIN_POSITIONS_INFERENCE = (48, 256)
#: The floors of float16/bfloat16 input without a gradient
#: (:func:`_layer_norm2d_nchw_16bit`: three calls per sample, not one). Two alternated
#: runs of each (``normkit bench layer_norm2d --dtype bfloat16 --shapes 64x128x7x7,
#: 32x256x14x14,32x128x28x28,32x64x56x56,8x96x56x56 --threads 1,2 --repeats 7``), the
#: copy path -> this path at the float32 floors, forward: 1 thread 7 x 7 0.62-0.67x ->
#: 0.27x torch, 14 x 14 0.62-0.63x -> 0.57-0.68x, 28 x 28 0.63x -> 0.77-0.88x, 56 x 56
#: 0.63-0.67x -> 0.91-1.12x; 2 threads 28 x 28 0.57-0.62x -> 0.58-0.69x, 56 x 56
#: 0.61-0.67x -> 0.66-0.90x. float16 (the same command, ``--dtype float16``, without
#: 7 x 7): 1 thread 14 x 14 0.58-0.61x -> 0.57-0.60x, 28 x 28 0.60-0.62x -> 0.81-0.96x,
#: 56 x 56 0.62-0.67x -> 0.85-1.11x; 2 threads 28 x 28 0.57-0.62x -> 0.54-0.67x, 56 x 56
#: 0.63-0.68x -> 0.59-0.89x. So 512 positions with one thread, 2048 with more.
LAYER_NORM2D_MIN_POSITIONS_16BIT_INFERENCE = (512, 2048)
#: The same with a gradient to come: 512 positions with one thread, never with more.
#: Two alternated runs of each (``normkit bench layer_norm2d --dtype bfloat16 --shapes
#: 64x128x7x7,32x256x14x14,32x128x28x28,32x64x56x56,8x96x56x56 --threads 1,2 --repeats
#: 7``), the copy path -> this path at every size, forward+backward: 1 thread 7 x 7
#: 0.74-0.83x -> 0.22-0.24x torch, 14 x 14 0.85-0.87x -> 0.81-0.85x, 28 x 28 0.85-0.88x
#: -> 0.91-1.06x, 56 x 56 0.85-0.93x -> 0.94-1.08x; 2 threads slower at every size
#: (0.81-0.93x -> 0.74-0.88x at 56 x 56, 0.87-0.89x -> 0.52-0.74x at 28 x 28: three
#: kernel calls per sample, each a parallel loop of its own).
LAYER_NORM2D_MIN_POSITIONS_16BIT = (512, float("inf"))


#: The positions per sample (``[low, high)``, with one CPU thread and with more) on which
#: :func:`_layer_norm2d_channel_sums` serves when a gradient is needed; above them the
#: per-sample path from its floor, else (and below them) the copy path. Two runs of
#: ``benchmarks/layer_norm2d_paths.py --threads 1 2`` (RESULTS.md, "LayerNorm2d on NCHW:
#: sums over the channels"), forward+backward, copy time / channel sums and / per-sample:
#: 1 thread 2 x 2 0.23-0.32x, 4 x 4 0.96-1.40x (per-sample 0.47-0.77x), 5 x 5 0.80-1.01x,
#: 6 x 6 1.28-1.34x, 7 x 7 1.51-1.85x (1.02-1.27x), 16 x 16 1.38-1.71x (0.89-0.94x),
#: 14 x 14 1.01-1.50x (1.16-1.70x), 20 x 20 1.31-1.51x (0.87-1.49x), 28 x 28 0.98-1.22x
#: (1.03-1.50x); 2 threads 4 x 4 to 6 x 6 0.62-0.89x, 7 x 7 1.11-1.50x (0.36-0.90x),
#: 8 x 8 0.85-0.94x (0.35x), 14 x 14 to 28 x 28 0.97-1.33x (0.44-0.93x), 56 x 56
#: 0.84-1.85x (0.82-1.40x). So with more threads per-sample from 1024 positions: at
#: 56 x 56 with 64 channels the two were even (0.84-0.98x and 0.82-0.94x), and the bench
#: (``normkit bench layer_norm2d``, two alternated runs each at `fca7b02` and with the
#: range reaching 4096) read 32x64x56x56 forward+backward 0.93-1.20x -> 0.88-0.95x torch.
#: With one thread per-sample from 196 positions: at 14 x 14 with 384 channels it was the
#: faster (above), and two such bench pairs with the range reaching 512 read
#: 32x384x14x14 forward+backward 0.95-1.11x -> 0.84-1.01x and 1.07-1.14x -> 0.92-1.04x
#: torch (32x256x14x14 within the noise both times).
LAYER_NORM2D_CHANNEL_SUMS = ((32, 196), (48, 1024))
#: The same without a gradient (inference). Forward alone, the same runs: 1 thread 2 x 2
#: 0.47-0.60x, 4 x 4 1.76-1.86x (per-sample 0.64-0.67x), 7 x 7 2.69-9.03x (2.21-4.58x),
#: 8 x 8 2.76-2.96x (1.19-1.21x), 14 x 14 1.75-6.15x (2.05-6.22x: per-sample from 128);
#: 2 threads 4 x 4 to 8 x 8 1.25-3.93x (0.26-1.26x), 14 x 14 to 20 x 20 1.74-3.14x
#: (0.69-1.48x), 28 x 28 1.50-6.04x (1.69-5.23x), 56 x 56 1.46-4.96x (1.83-5.91x). With
#: more threads per-sample from 512 positions: the same bench runs, with the range
#: reaching 1024, read 32x192x28x28 forward 1.00-1.05x -> 0.77-0.86x torch.
LAYER_NORM2D_CHANNEL_SUMS_INFERENCE = ((16, 128), (16, 512))
#: Fewest elements for which :func:`_layer_norm2d_channel_sums` serves (with one CPU
#: thread and with more) when a gradient is needed; below, the other paths by their
#: floors. Its dozen whole-batch calls cost more than the copy path's three on small
#: batches. Two runs of ``benchmarks/layer_norm2d_paths.py --threads 1 2 --shapes
#: small`` (RESULTS.md, "LayerNorm2d on NCHW: sums over the channels"), forward+backward,
#: copy time / channel sums at 75264, 150528 and 301056 elements (2, 4, 8 x 768 x 7 x 7
#: and 1, 2, 4 x 384 x 14 x 14): 1 thread 0.74-0.92x, 0.99-1.19x, 1.24-1.87x; 2 threads
#: 0.65-0.73x, 0.76-0.95x, 1.04-1.37x. So 2^17 elements with one thread, 2^18 with more.
LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS = (1 << 17, 1 << 18)
#: The same without a gradient. Forward alone, the same runs: 1 thread 1.17-1.36x at
#: 75264 elements (so :data:`LAYER_NORM2D_MIN_ELEMENTS`'s 2^16), 2 threads 0.91-1.03x at
#: 75264 and 1.03-1.36x at 150528 (so 2^17).
LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS_INFERENCE = (1 << 16, 1 << 17)


#: Whether a tensor is a batched gradient of ``torch.autograd.grad(...,
#: is_grads_batched=True)`` (torch's legacy vmap; False on a torch without the check).
_legacy_batched = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor",
                          lambda t: False)


def backward_by_reference(dy: Tensor | None) -> bool:
    """Whether a fast path's backward differentiates its reference math instead of
    running its kernels: under ``create_graph=True`` (grad mode on in the backward: the
    double backward needs a differentiable graph), and for a batched gradient
    (``torch.autograd.grad(..., is_grads_batched=True)``, ``jacobian(...,
    vectorize=True)``), whose legacy vmap has no batching rule for the ``out=`` calls the
    kernels write through.

    Example:
        >>> with torch.no_grad():  # (a backward runs without grad mode)
        ...     backward_by_reference(torch.ones(2))
        False
        >>> backward_by_reference(torch.ones(2))  # grad mode on: create_graph=True
        True
    """
    if torch.is_grad_enabled():
        return True
    # (Dynamo cannot trace the check, and traces no legacy vmap)
    return dy is not None and not torch.compiler.is_compiling() and _legacy_batched(dy)


def reference_grads(reference, inputs: tuple, needs: tuple[bool, ...], dy: Tensor) -> list:
    """Gradients of ``reference(*inputs)`` for the inputs that ``needs``: differentiable
    themselves where grad mode is on (``create_graph=True``: the double backward of a
    fast path's node), plain ones in a batched gradient's backward.

    Example:
        >>> x = torch.randn(3, requires_grad=True)
        >>> g = reference_grads(lambda x, w: x * x, (x, None), (True, False), torch.ones(3))
        >>> torch.allclose(g[0], 2 * x), g[1] is None
        (True, True)
    """
    wanted = [t for t, need in zip(inputs, needs, strict=True) if need]
    graph = torch.is_grad_enabled()  # (off for a batched gradient: plain gradients)
    with torch.enable_grad():
        y = reference(*inputs)
        grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=graph, allow_unused=True))
    return [next(grads) if need else None for need in needs]


def _column_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                          mean: Tensor, invstd: Tensor, eps: float, mask: Sequence[bool]
                          ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The backward of the per-channel affine of a ``(N, C, L)`` tensor normalized per
    position (statistics ``(N, 1, L)``): torch's BatchNorm backward kernel for each
    sample (see :func:`layer_norm2d_nchw`)."""
    need_x, need_w, need_b = mask
    need_w, need_b = need_w and weight is not None, need_b and bias is not None
    g = dy.contiguous()
    dx = dw = db = None
    if need_w or need_b:
        # the per-channel sums over (n, l) of dy * xhat and of dy in one read of both:
        # torch's NCHW BatchNorm backward kernel with zero mean and unit invstd,
        # reductions only (instead of a product, its sum and a second sum)
        xhat = (torch.addcmul(-mean * invstd, x, invstd, out=empty_like(x)) if need_w
                else g)
        unit = x.new_ones(x.shape[1])
        _, dw, db = _ATEN.native_batch_norm_backward(
            g, xhat, unit, None, None, torch.zeros_like(unit), unit, True, 0.0,
            [False, need_w, need_b])
    if need_x:
        gx = (torch.mul(g, weight.view(1, -1, 1), out=empty_like(g)) if weight is not None
              else g)
        dx = empty_like(x)
        # each sample into its slice of dx through out= (torch computes, then copies:
        # the overload has no CPU kernel), which needs every output defined: a unit
        # weight and two small scratch outputs for the column sums it also returns
        unit = x.new_ones(x.shape[2])
        scratch = (torch.empty_like(unit), torch.empty_like(unit))
        for i in range(x.shape[0]):
            _ATEN.native_batch_norm_backward.out(
                gx[i], x[i], unit, None, None, mean[i, 0], invstd[i, 0], True, eps,
                [True, True, True], out0=dx[i], out1=scratch[0], out2=scratch[1])
    return dx, dw, db


def rows_past(mean: Tensor, rstd: Tensor, threshold: float) -> Tensor | None:
    """``None`` where every row (one ``mean``/``rstd`` each) is within ``threshold``
    (:func:`well_conditioned`), else the rows past it (:func:`ill_conditioned_rows`).

    Example:
        >>> rows_past(torch.zeros(3), torch.ones(3), 4.0) is None
        True
        >>> rows_past(torch.tensor([0.0, 9.0, 0.0]), torch.ones(3), 4.0)
        tensor([1])
    """
    if well_conditioned(mean, rstd, threshold):
        return None
    return ill_conditioned_rows(mean, rstd, threshold)


class _ColumnNormFunction(torch.autograd.Function):
    """Per-channel affine of a normalized ``(N, C, L)`` tensor; backward by torch's
    BatchNorm backward kernel for each sample (see :func:`layer_norm2d_nchw`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized, mean, invstd, eps, reference):
        y = normalized[0]  # (passed in a tuple: a fresh tensor, not an input of the node)
        if weight is not None:
            y.mul_(weight.view(1, -1, 1))
        if bias is not None:
            y.add_(bias.view(1, -1, 1))
        ctx.eps, ctx.reference = eps, reference
        ctx.save_for_backward(x, weight, bias, mean, invstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, invstd = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if backward_by_reference(dy):  # create_graph=True, batched gradients
            grads = reference_grads(ctx.reference, (x, weight, bias), needs, dy)
        else:
            grads = _column_norm_backward(dy, x, weight, bias, mean, invstd, ctx.eps, needs)
        return (*grads, None, None, None, None, None)


def _position_node(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                   y: Tensor, bad: Tensor | None, backward, reference) -> Tensor:
    """:func:`kernel_node` of a LayerNorm2d on NCHW ``x`` whose positions ``bad`` (in
    ``(n, l)`` order, :func:`rows_past`; not every one) are normalized again by
    normkit's compensated core (:class:`RowRepair`), the others kept as ``y`` has them:
    each sample gets the same bits alone or in any batch, as with torch's LayerNorm over
    the channels (the caller's path for input whose every position is past the bound
    gives those positions the same bits)."""
    if bad is None:
        return kernel_node(x, weight, bias, y, backward, reference)
    repair = RowRepair.apply(y, x, x.shape[1], bad, weight, bias, eps, positions=True)

    def repaired(dy, x, weight, bias, mask):
        grads = backward(repair.zeroed(dy), x, weight, bias, mask)
        return repair.patch(grads, dy, weight, bias, mask)

    return kernel_node(x, weight, bias, y, repaired, reference)


def _layer_norm2d_nchw_16bit(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                            eps: float) -> Tensor | None:
    """:func:`layer_norm2d_nchw` of float16/bfloat16 input: per sample the float32
    statistics of each position over the channels (torch's statistics kernel on the
    ``(C, L)`` matrix, float32 stand-in buffers), the float32 normalized matrix (one
    ``addcmul``, in cache), then the affine written into the 16-bit output (one
    ``addcmul``): one rounding, as torch's LayerNorm on the channels-innermost copy,
    without the copies there and back. The backward, per sample too and in float32
    (:func:`kernel_node`): the weight and bias gradients as two sums over the positions
    in one call of torch's BatchNorm backward kernel (reductions only, on the ``(1, C, L)``
    view), the input's by the same kernel on the ``(C, L)`` matrix -- each position a
    BatchNorm channel whose statistics are the normalized input's (mean 0, ``1/std`` 1)
    and whose weight is the position's ``1/std`` -- from ``dy * weight``; unlike torch's
    16-bit LayerNorm backward, which sums the weight gradient in 16 bits.

    Example:
        >>> x = torch.randn(2, 8, 32, 32).bfloat16()
        >>> y = _layer_norm2d_nchw_16bit(x, None, None, 1e-6)
        >>> ref = torch.nn.functional.layer_norm(x.float().permute(0, 2, 3, 1), (8,),
        ...                                      eps=1e-6).permute(0, 3, 1, 2)
        >>> bool((y.float() - ref).abs().max() <= 0.02), y.dtype, y.is_contiguous()
        (True, torch.bfloat16, True)
    """
    n, c = x.shape[:2]
    v = x.detach().view(n, c, -1)
    length = v.shape[2]
    zero = x.new_zeros(length, dtype=torch.float32)
    one = x.new_ones(length, dtype=torch.float32)
    moments = [torch.batch_norm_update_stats(v[i], zero, one, 0.0) for i in range(n)]
    mean = torch.stack([m for m, _ in moments])  # (N, L)
    invstd = torch.stack([s for _, s in moments]).add_(eps).rsqrt_()
    bad = rows_past(mean, invstd, THRESHOLDS["batch_norm_channels_last"])
    if bad is not None and bad.numel() > LAYER_NORM2D_REPAIR_MAX_SHARE * mean.numel():
        return None  # (many positions past the bound: the caller's path)
    shift = mean.mul(invstd).neg_()  # (-mean * invstd, per position)
    with torch.no_grad():
        w, b = kernel_params(x, (c,), weight, bias)
        w, b = w.view(c, 1), (torch.zeros_like(w) if b is None else b).view(c, 1)
        y = torch.empty_like(x)
        out = y.view(n, c, length)
        for i in range(n):
            xhat = torch.addcmul(shift[i], v[i], invstd[i])  # (C, L) float32
            torch.addcmul(b, xhat, w, out=out[i])

    def backward(dy, x, weight, bias, mask):
        w32 = kernel_params(x, (c,), weight, bias)[0].view(c, 1)
        unit = x.new_ones(c, dtype=torch.float32)
        g = dy.contiguous().view(n, c, length)
        v = x.view(n, c, length)
        dx = torch.empty_like(x) if mask[0] else None
        sums = []
        for i in range(n):
            g32 = g[i].float()
            xhat = torch.addcmul(shift[i], v[i], invstd[i])
            if mask[1] or mask[2]:  # sum_l dy * xhat and sum_l dy per channel
                sums.append(_ATEN.native_batch_norm_backward(
                    g32[None], xhat[None], unit, None, None, torch.zeros_like(unit), unit,
                    True, 0.0, [False, mask[1], mask[2]]))
            if dx is not None:
                dx.view(n, c, length)[i].copy_(_ATEN.native_batch_norm_backward(
                    g32.mul_(w32), xhat, invstd[i], None, None, zero, one, True, 0.0,
                    [True, False, False])[0])
        dw = (torch.stack([s[1] for s in sums]).sum(0).to(weight.dtype)
              if mask[1] and weight is not None else None)
        db = (torch.stack([s[2] for s in sums]).sum(0).to(bias.dtype)
              if mask[2] and bias is not None else None)
        return dx, dw, db

    def reference(x, weight, bias):  # torch's LayerNorm in float32 over the channels
        weight = weight_for_bias(weight, bias)
        return torch.nn.functional.layer_norm(
            x.float().movedim(1, -1), (c,), _float32(weight), _float32(bias),
            eps).movedim(-1, 1).to(x.dtype)

    # (the positions past the bound renormalized, in float32 too)
    return _position_node(x, weight, bias, eps, y, bad, backward, reference)


def _layer_norm2d_channel_sums(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                               eps: float, reference) -> Tensor | None:
    """:func:`layer_norm2d_nchw` by whole-batch reductions over the channel dim: the
    ``(N, 1, L)`` statistics of contiguous float32/float64 ``(N, C, *)`` input from two
    sums over ``C`` (the mean, then the centered squares: two-pass, as torch's LayerNorm),
    each one call over the whole batch that torch vectorizes across the ``L`` positions;
    then the normalized input by one ``addcmul`` and the affine by two in-place passes.
    No per-sample loop, no transposing copies: on few positions per sample torch's
    kernels over one sample's ``(C, L)`` matrix have too little work per call (with two
    threads most of all), and the copy path pays two transposing copies.

    The backward (:func:`kernel_node`, double backward by ``reference``) is the same kind:
    the normalized input once more (one ``addcmul``), the weight and bias gradients as two
    sums over ``(N, L)`` in one call of torch's BatchNorm backward kernel (reductions
    only), then ``dx = invstd * (g - mean_C(g) - xhat * mean_C(g * xhat))`` with
    ``g = dy * weight`` from two more sums over ``C`` and two ``addcmul`` passes, written
    over ``g``'s buffer. ``None`` where some position's ``|mean| / std`` exceeds torch's
    LayerNorm threshold: the float32 mean itself is then too coarse, and the caller's
    robust path takes over.

    Example:
        >>> x = torch.randn(8, 64, 7, 7)
        >>> ref = torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (64,))
        >>> y = _layer_norm2d_channel_sums(x, None, None, 1e-5, None)
        >>> torch.allclose(y, ref.permute(0, 3, 1, 2), atol=1e-5), y.is_contiguous()
        (True, True)
    """
    n, c = x.shape[:2]
    v = x.detach().view(n, c, -1)
    mean = v.mean(1, keepdim=True)  # (N, 1, L)
    y = torch.sub(v, mean, out=empty_like(v))
    invstd = y.square_().sum(1, keepdim=True).div_(c).add_(eps).rsqrt_()
    bad = rows_past(mean, invstd, THRESHOLDS["layer_norm"])
    if bad is not None and bad.numel() > LAYER_NORM2D_REPAIR_MAX_SHARE * mean.numel():
        return None  # (many positions past the bound: the caller's path)
    shift = torch.mul(mean, invstd).neg_()
    torch.addcmul(shift, v, invstd, out=y)  # the normalized input
    with torch.no_grad():
        if weight is not None:
            y.mul_(weight.view(1, c, 1))
        if bias is not None:
            y.add_(bias.view(1, c, 1))

    def backward(dy, v, weight, bias, mask):  # (v: the (N, C, L) view of the input)
        g = dy.contiguous()
        xhat = torch.addcmul(shift, v, invstd)
        dw = db = dx = None
        if (mask[1] and weight is not None) or (mask[2] and bias is not None):
            # sum over (n, l) of dy * xhat and of dy per channel in one read of both
            unit = v.new_ones(c)
            _, dw, db = _ATEN.native_batch_norm_backward(
                g, xhat, unit, None, None, torch.zeros_like(unit), unit, True, 0.0,
                [False, mask[1] and weight is not None, mask[2] and bias is not None])
        if mask[0]:
            gw = (torch.mul(g, weight.view(1, c, 1), out=empty_like(g)) if weight is not None
                  else g.clone(memory_format=torch.contiguous_format))
            gmean = gw.mean(1, keepdim=True)
            proj = xhat.mul_(gw).sum(1, keepdim=True).div_(c)  # mean_C(g * xhat)
            del xhat
            # dx = invstd * (g - gmean) - invstd^2 * proj * (x - mean), as
            # invstd * g + k0 - k1 * x with k1 = invstd^2 * proj, k0 = k1 * mean - invstd * gmean
            k1 = proj.mul_(invstd).mul_(invstd)
            k0 = torch.addcmul(gmean.mul_(invstd).neg_(), k1, mean)
            dx = torch.addcmul(k0, gw, invstd, out=gw)
            dx.addcmul_(v, k1, value=-1)
        return dx, dw, db

    # (the positions past the bound renormalized)
    return _position_node(x.view(n, c, -1), weight, bias, eps, y, bad, backward,
                          reference).view(x.shape)


def layer_norm2d_nchw(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                      reference) -> Tensor | None:
    """LayerNorm over the channels of contiguous ``(N, C, *)`` input, else ``None``.

    For each sample the ``(C, L)`` matrix (``L`` positions) is normalized over its rows:
    that is training-mode BatchNorm of a 2D ``(batch=C, channels=L)`` input, which
    torch's kernel vectorizes across ``L``. So the statistics and the normalized input
    come from one BatchNorm call per sample (written into one output, no copies), the
    affine is one in-place pass, and the backward is torch's BatchNorm backward per
    sample. The permute + LayerNorm + permute alternative pays two transposing copies.
    Kept under the ``|mean| / std <= 4`` rule of torch's channels-last BatchNorm kernel
    (the same kernel; see the table above); ``reference(x, weight, bias)`` serves double
    backward. On few positions per sample (:data:`LAYER_NORM2D_CHANNEL_SUMS`, ``_INFERENCE``
    without a gradient) :func:`_layer_norm2d_channel_sums` serves instead: whole-batch
    sums over the channels, no per-sample calls. float16/bfloat16 input:
    :func:`_layer_norm2d_nchw_16bit` (float32 math per sample, one rounding), under its
    own floors.

    Example:
        >>> x = torch.randn(8, 16, 32, 32)
        >>> ref = torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (16,))
        >>> y = layer_norm2d_nchw(x, None, None, 1e-5, None)
        >>> torch.allclose(y, ref.permute(0, 3, 1, 2), atol=1e-5)
        True
    """
    if not _plain_dense(x) or x.dim() < 3 or x.numel() < LAYER_NORM2D_MIN_ELEMENTS:
        return None
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, weight, bias))
    positions, many = x.shape[2:].numel(), torch.get_num_threads() > 1
    if x.dtype in _HALF:
        floors = (LAYER_NORM2D_MIN_POSITIONS_16BIT if grad else
                  LAYER_NORM2D_MIN_POSITIONS_16BIT_INFERENCE)
        return (_layer_norm2d_nchw_16bit(x, weight, bias, eps)
                if positions >= floors[many] and kernel_dtypes(x, weight, bias) else None)
    if (x.dtype not in (torch.float32, torch.float64)
            or any(p is not None and p.dtype != x.dtype for p in (weight, bias))):
        return None
    low, high = (LAYER_NORM2D_CHANNEL_SUMS if grad else
                 LAYER_NORM2D_CHANNEL_SUMS_INFERENCE)[many]
    fewest = (LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS if grad else
              LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS_INFERENCE)[many]
    if low <= positions < high and x.numel() >= fewest:
        return _layer_norm2d_channel_sums(x, weight, bias, eps, reference)
    floors = LAYER_NORM2D_MIN_POSITIONS if grad else LAYER_NORM2D_MIN_POSITIONS_INFERENCE
    if positions < floors[many]:
        return None
    n, c = x.shape[:2]
    v = x.detach().view(n, c, -1)
    xhat = empty_like(v)
    mean = v.new_empty(n, 1, v.shape[2])
    invstd = torch.empty_like(mean)
    for i in range(n):
        _ATEN.native_batch_norm.out(v[i], None, None, None, None, True, 0.0, eps,
                                    out=xhat[i], save_mean=mean[i, 0],
                                    save_invstd=invstd[i, 0])
    bad = rows_past(mean, invstd, THRESHOLDS["batch_norm_channels_last"])
    if bad is None:
        y = _ColumnNormFunction.apply(x.view(n, c, -1), weight, bias, (xhat,), mean, invstd,
                                      eps, reference)
        return y.view(x.shape)
    if bad.numel() > LAYER_NORM2D_REPAIR_MAX_SHARE * mean.numel():
        return None  # (many positions past the bound: the caller's path)
    with torch.no_grad():  # (the affine in place on the normalized input)
        if weight is not None:
            xhat.mul_(weight.view(1, -1, 1))
        if bias is not None:
            xhat.add_(bias.view(1, -1, 1))

    def backward(dy, v, weight, bias, mask):
        return _column_norm_backward(dy, v, weight, bias, mean, invstd, eps, mask)

    # (the positions past the bound renormalized)
    return _position_node(x.view(n, c, -1), weight, bias, eps, xhat, bad, backward,
                          reference).view(x.shape)
