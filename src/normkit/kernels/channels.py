"""BatchNorm, InstanceNorm and GroupNorm from per-(sample, channel) sums.

BN, IN and GN all normalize whole ``(n, c)`` slices of ``(N, C, *)`` input and differ
only in how they pool them (:class:`Pool`): BN pools a channel's slices over the batch,
IN keeps each slice alone, GN pools the ``C / G`` consecutive channels of a sample. So

* the statistics of all three come from two sums per slice over its ``L`` positions,
  ``S1 = sum x`` and ``S2 = sum x^2``, pooled (:func:`moments`);
* the backward of all three from two more, ``sum dy`` and ``sum dy (x - mean)``, pooled
  the same way (:func:`backward`);
* the elementwise work is one pass forward, ``y = x * a + b`` with per-slice ``a, b``,
  and two backward, ``dx = k1 * dy + k2 * x + k3``.

Contiguous (NCHW) input: the forward slice sums come from torch's BatchNorm backward
kernel run on the ``(1, N*C, L)`` view (each slice a "channel", reductions only, both
sums in one read; :func:`_row_sums`; slices longer than :data:`ROW_FOLD_LENGTH` read in
pieces, whose sums are added in float64), and every per-slice affine pass is torch's
inference BatchNorm kernel on that view (torch's own NCHW BatchNorm and InstanceNorm
statistics kernels are 2-3x slower). The backward of BatchNorm and InstanceNorm is that
kernel's full backward from the saved statistics, on ``x`` or on the ``(1, N*C, L)``
view (:func:`_kernel_backward`: it finishes each channel while the channel is in cache),
but for slices longer than :data:`ROW_BACKWARD_MAX_LENGTH` and BatchNorm inputs of
:data:`KERNEL_BACKWARD_MAX_BYTES` and more (:func:`_kernel_serves_backward`);
GroupNorm's per-channel weight varies inside a group, so its backward takes the sums and
the two elementwise passes. Channels-last input: the
forward sums are column sums of each sample's ``(L, C)`` matrix, vectorized across the
channels, on the tensor as it is -- from torch's BatchNorm backward kernel on the matrix
folded to at most ``FOLD_ROWS`` rows (:func:`_kernel_column_sums`), or with more than
one thread, where a thread's cache block holds whole samples, from torch's cascaded
sums a block at a time (:func:`_blocked_column_sums`); BatchNorm, which pools every
sample, takes them from one call of that kernel over all samples' rows folded
(:func:`_whole_column_sums`) except with one thread on large samples. The backward sums
come from that kernel on each sample's folded matrix.

Accuracy: ``var = E[x^2] - E[x]^2`` loses a factor ``1 + r^2`` (``r = |mean| / std`` of a
pooled group) of the sums' relative error (2-5 ulps for torch's cascaded row sums), so
a result is kept only when every group has ``r <= RATIO``; otherwise the caller takes
another path (torch's kernel where accurate, else normkit's compensated one) -- except
that InstanceNorm and GroupNorm, whose groups are each sample's own, renormalize only the
groups past the bound by normkit's compensated core and keep the others
(:func:`group_moments`, :func:`repair_groups`): one blank image does not move the batch
to a slower path, nor change the other samples' bits. A larger
true ``r`` cannot pass the check: the computed variance is at most the true one plus
``1e-6 * mean^2``. The folded affine ``x * a + b`` (``b = beta - mean * a``) costs one more
rounding of relative size ``r * 6e-8``. Measured max error vs float64 (float32,
``benchmarks/ACCURACY.md``): 6e-7 to 1e-6 for centered data and up to 5.6e-6 at
``r = 1.5`` (InstanceNorm of 128 x 128 slices), against 4e-7 to 5e-7 for torch's NCHW
kernels and normkit's compensated path -- and 8e-5 for torch's own channels-last
BatchNorm at 131072 values per channel, which this engine replaces there (6e-7 to 1.6e-6:
``benchmarks/accuracy.py --counts``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .._stats import equal_pieces
from .memory import empty_like, out_like
from .native import (
    CHANNELS_LAST_BACKWARD_MAX_COUNT,
    CHANNELS_LAST_MAX_COUNT,
    RowRepair,
    backward_by_reference,
    channels_last_format,
    ill_conditioned_rows,
    kernel_node,
    reference_grads,
    strided_like,
    well_conditioned,
)

__all__ = ["RATIO", "REPAIR_MAX_SHARE", "MIN_POSITIONS", "MIN_ELEMENTS", "Pool", "wide",
           "supports", "moments", "group_moments", "repair_groups", "repaired_backward",
           "affine", "backward", "GROUP_NORM_MIN_POSITIONS", "normalize",
           "normalize_by", "serves_batch_norm", "rows_as_channels_last", "channels_last_as_rows",
           "ROW_FOLD_LENGTH", "ROW_BACKWARD_MAX_LENGTH", "KERNEL_BACKWARD_MAX_BYTES"]

#: Largest pooled ``|mean| / std`` for which ``E[x^2] - E[x]^2`` from float32 sums is kept.
RATIO = 2.0
#: Largest share of a call's groups that InstanceNorm and GroupNorm renormalize one by one
#: when they are past :data:`RATIO` (:func:`group_moments`); past it the caller's path for
#: the whole call serves (an NCHW copy through torch's kernels, or the compensated core),
#: which then costs less than the repair's copies, compensated passes and scatters.
#: ``benchmarks/outlier_rows.py --offset-samples 2 4 8 16 --scale 1 --shift 3`` (k of 32
#: samples at 3 std off zero, 32x64x28x28 channels-last, one thread; RESULTS.md, "Many
#: samples a little off center"), torch time / normkit time, whole-call path -> repair:
#: GroupNorm fwd 0.57-0.65x -> 0.91-1.20x at 2-4 samples, fwd+bwd about even there (its
#: whole-call path is the cheap one); InstanceNorm and GroupNormAct fwd+bwd 0.42-0.64x ->
#: 0.58-0.85x at 2-4; at a quarter of the samples and more every layer loses or ties. So
#: 1/8.
REPAIR_MAX_SHARE = 1 / 8
#: Fewest positions per slice, and fewest elements, for which the engine pays off. It
#: runs ~40 small ATen calls per forward and backward (~0.1 ms on one CPU thread), so
#: below ~2^18 elements torch's kernels, even with normkit's accuracy check, are faster
#: (measured crossover on BatchNorm2d training: 2^17 to 2^19 elements).
MIN_POSITIONS = 16
MIN_ELEMENTS = 1 << 18

_WIDE = (torch.float32, torch.float64)
_ATEN = torch.ops.aten


class Pool(NamedTuple):
    """How slices are pooled into normalization groups.

    ``kind`` is ``"batch"`` (one group per channel, across the batch: BatchNorm),
    ``"instance"`` (each slice alone) or ``"group"`` (``groups`` groups of consecutive
    channels per sample: GroupNorm).

    Example:
        >>> Pool("group", 2).sum(torch.arange(8.0).view(2, 4))
        tensor([[ 1.,  1.,  5.,  5.],
                [ 9.,  9., 13., 13.]])
        >>> Pool("group", 1).sum(torch.ones(2, 3)).div_(3)  # (a tensor of its own)
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """

    kind: str
    groups: int = 1

    def sum(self, t: Tensor) -> Tensor:
        """Sum an ``(N, C)`` per-slice tensor over each group, broadcast to its slices
        (``(1, C)`` for batch pooling, ``(N, C)`` otherwise)."""
        if self.kind == "batch":
            return t.sum(0, keepdim=True)
        if self.kind == "instance":
            return t
        n, c = t.shape
        # (contiguous: with one group the reshape is a view of the broadcast sums, whose
        # in-place use by the callers would write one value through many elements)
        return t.view(n, self.groups, -1).sum(2, keepdim=True).expand(
            n, self.groups, c // self.groups).reshape(n, c).contiguous()

    def count(self, x: Tensor) -> int:
        """Number of elements in each group of ``x``."""
        n, c = x.shape[:2]
        positions = x.shape[2:].numel() if x.numel() else 0
        if self.kind == "batch":
            return n * positions
        if self.kind == "instance":
            return positions
        return c // self.groups * positions


def _channels_last(x: Tensor) -> bool:
    if x.is_contiguous():
        return False
    return ((x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
            or (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)))


def serves_batch_norm(x: Tensor) -> bool:
    """Whether training-mode BatchNorm of ``x`` should take this engine: contiguous input
    with spatial dims, and channels-last input -- or 2D ``(N, C)`` rows, through
    :func:`rows_as_channels_last` -- with more values per channel than torch's
    channels-last kernel handles accurately
    (:data:`normkit.kernels.native.CHANNELS_LAST_MAX_COUNT`).

    Example:
        >>> serves_batch_norm(torch.randn(32, 16, 32, 32))
        True
        >>> serves_batch_norm(torch.randn(32, 16, 8, 8).to(memory_format=torch.channels_last))
        False
        >>> serves_batch_norm(torch.randn(16384, 32)), serves_batch_norm(torch.randn(64, 32))
        (True, False)
    """
    if x.dim() == 2:
        return x.is_contiguous() and x.shape[0] > CHANNELS_LAST_MAX_COUNT
    if x.is_contiguous():
        return True
    return _channels_last(x) and x.numel() // max(x.shape[1], 1) > CHANNELS_LAST_MAX_COUNT


def rows_as_channels_last(x: Tensor) -> Tensor:
    """A contiguous 2D ``(N, C)`` tensor as the ``(1, C, N, 1)`` channels-last view of the
    same memory: one sample of ``N`` positions with the channels innermost. BatchNorm over
    the rows is BatchNorm of this view, whose channels-last paths (folded column sums,
    one broadcast affine pass) this engine has; the result comes back through
    :func:`channels_last_as_rows`.

    Example:
        >>> x = torch.randn(6, 3)
        >>> v = rows_as_channels_last(x)
        >>> v.shape, v.is_contiguous(memory_format=torch.channels_last)
        (torch.Size([1, 3, 6, 1]), True)
        >>> torch.equal(channels_last_as_rows(v), x)
        True
    """
    n, c = x.shape
    return x.view(1, n, c).permute(0, 2, 1).unsqueeze(-1)


def channels_last_as_rows(v: Tensor) -> Tensor:
    """The inverse view of :func:`rows_as_channels_last`: ``(1, C, N, 1)`` to ``(N, C)``.

    Example:
        >>> v = torch.randn(1, 3, 5, 1).contiguous(memory_format=torch.channels_last)
        >>> rows = channels_last_as_rows(v)
        >>> rows.shape, rows.is_contiguous(), rows.data_ptr() == v.data_ptr()
        (torch.Size([5, 3]), True, True)
    """
    return v.squeeze(-1).squeeze(0).t()


def wide(x: Tensor, *params: Tensor | None) -> bool:
    """Whether ``x`` is float32 or float64 and every given parameter has its dtype.

    Example:
        >>> wide(torch.randn(2, 3), torch.ones(3)), wide(torch.randn(2, 3).half())
        (True, False)
    """
    return x.dtype in _WIDE and all(p is None or p.dtype == x.dtype for p in params)


def supports(x: Tensor, *params: Tensor | None) -> bool:
    """Whether this engine serves ``x``: float32/float64, parameters of the same dtype,
    contiguous or channels-last, at least :data:`MIN_POSITIONS` positions per slice and
    :data:`MIN_ELEMENTS` elements.

    Example:
        >>> supports(torch.randn(32, 16, 32, 32)), supports(torch.randn(2, 3, 8, 8))
        (True, False)
    """
    if x.dim() < 3 or x.numel() == 0 or x.numel() < MIN_ELEMENTS or not wide(x, *params):
        return False
    if x.shape[2:].numel() < MIN_POSITIONS:
        return False
    return x.is_contiguous() or _channels_last(x)


def _columns(t: Tensor) -> Tensor:
    """``(N, L, C)``: channels innermost (a view of channels-last input, else a copy)."""
    return t.movedim(1, -1).reshape(t.shape[0], -1, t.shape[1])


def _slice_sums(x: Tensor, pool: Pool) -> tuple[Tensor, Tensor]:
    """``(N, C)`` sums of ``x`` and ``x^2`` over each slice's positions (``(1, C)``, already
    pooled, for channels-last BatchNorm from :func:`_whole_column_sums`)."""
    n, c = x.shape[:2]
    if x.is_contiguous():
        s1, s2 = _row_sums(x.view(1, n * c, -1))
        return s1.view(n, c), s2.view(n, c)
    cols = _columns(x)  # (N, L, C)
    blocks = _blocks_of_samples(cols, pool)
    if pool.kind == "batch" and (blocks or torch.get_num_threads() >= WHOLE_FOLD_MIN_THREADS):
        sums = _whole_column_sums(cols)  # ((1, C): already pooled, as Pool.sum keeps it)
        if sums is not None:
            return sums
    if blocks:
        return _blocked_column_sums(cols)
    fold = _fold(cols.shape[1], _fold_rows(pool, c))
    if fold is not None:
        return _kernel_column_sums(cols, fold)
    if pool.kind == "batch" and cols.shape[1] <= CHANNELS_LAST_MAX_COUNT:
        return _kernel_column_sums(cols)  # (few rows, or no fold: unfolded, as torch's BN)
    return _blocked_column_sums(cols)


def _row_sums(rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(N*C,)`` sums of ``x`` and ``x^2`` over each slice of contiguous input, viewed as
    ``(1, N*C, L)``: torch's BatchNorm backward kernel with ``dy = x``, zero mean and unit
    invstd, reductions only -- both sums in one read. Against a row sum plus a row
    ``vector_norm`` (two reads), ``benchmarks/column_sums.py``, two runs: 1.17-1.37x
    faster with one thread, 1.06-1.17x with two; BatchNorm from either's sums as accurate
    (max error vs float64 within 1.5x of each other at ``|mean| / std`` 0 to 2,
    ``--accuracy``).

    The kernel adds each slice in vector lanes, each lane in sequence, so a slice is read
    folded (:func:`_row_fold`) as pieces of at most :data:`ROW_FOLD_LENGTH` positions, and
    each slice's partial sums are added in float64; a long slice with no such fold takes
    torch's cascaded row sums instead.
    """
    _, slices, length = rows.shape
    fold = _row_fold(length)
    if fold is None:
        return rows.sum(-1).view(-1), rows.square().sum(-1).view(-1)
    pieces = rows.view(1, slices * fold, length // fold)
    unit = torch.ones(slices * fold, dtype=rows.dtype, device=rows.device)
    _, s2, s1 = _ATEN.native_batch_norm_backward(pieces, pieces, unit, None, None,
                                                 torch.zeros_like(unit), unit, True, 0.0,
                                                 [False, True, True])
    return _fold_total(s1, fold), _fold_total(s2, fold)


#: Most positions of a contiguous slice that torch's BatchNorm backward kernel adds in one
#: run for normkit's sums (:func:`_row_sums`, :func:`_backward_sums`). The kernel adds a
#: slice in 16 (AVX-512) or 8 vector lanes, each in sequence, so the sums of long slices
#: lose digits: relative error of ``sum x^2`` over 2^20 positions at ``|mean| / std`` 1.9,
#: AMD EPYC (AVX-512), max over 8 slices (a scratch measurement), unfolded 1.1e-5
#: (BatchNorm2d's output 2.3e-5 off at 1 x 2 x 1024 x 1024, torch's 5.9e-8), in pieces of
#: 16384 positions 5.0e-8, 4096 7.6e-9, 512 1.5e-9, torch's cascaded ``sum`` 8.2e-8.
ROW_FOLD_LENGTH = 4096


#: Most positions per slice for which the backward of contiguous BatchNorm and
#: InstanceNorm is torch's BatchNorm backward kernel (:func:`_kernel_serves_backward`);
#: longer slices take the sums of :func:`_backward_sums`, read in pieces, and two passes.
#: The kernel adds each slice's ``sum dy (x - mean)`` in vector lanes, each in sequence;
#: with an upstream gradient along the input (``dy = x``, whose exact ``dx`` is what
#: ``eps`` leaves) its ``dx`` was off by 1.6e-6 at 32768 positions, 3.9e-6 at 65536,
#: 1.0e-5 at 131072, 2.0e-5 at 262144, 4.8e-5 at 524288 and 1.3e-4 at 2^20 (scratch
#: measurements; ``benchmarks/accuracy.py --long-slices`` repeats 2^16, 2^18, 2^20;
#: relative to the largest gradient, at least 1; 3 seeds, ``|mean| / std`` 0 and 1.9; float32
#: tolerance 5e-5), the sums in pieces 7.9e-7 to 1.6e-6 at every length. So the kernel
#: up to 2^18 (within half the tolerance, as channels-last BatchNorm's bound keeps it):
#: past it the sums and passes cost time below 32 MiB (``benchmarks/RESULTS.md``, "Long
#: NCHW slices and large BatchNorm backward"; ``benchmarks/accuracy.py --long-slices``).
ROW_BACKWARD_MAX_LENGTH = 1 << 18


def _row_fold(length: int) -> int | None:
    """How many pieces :func:`_row_sums` reads a slice of ``length`` positions as: 1 up
    to :data:`ROW_FOLD_LENGTH`, else the fewest pieces of equal length within it, when
    they hold at least :data:`FOLD_MIN_ROWS` positions; ``None`` where there are none.

    Example:
        >>> _row_fold(56 * 56), _row_fold(512 * 512), _row_fold(5000), _row_fold(4099)
        (1, 64, 2, None)
    """
    if length <= ROW_FOLD_LENGTH:
        return 1
    return _fold(length, ROW_FOLD_LENGTH)


def _fold_total(sums: Tensor, fold: int) -> Tensor:
    """Each ``fold`` consecutive partial sums added in float64, in their dtype."""
    if fold == 1:
        return sums
    return sums.view(-1, fold).sum(1, dtype=torch.float64).to(sums.dtype)


def _blocks_of_samples(cols: Tensor, pool: Pool) -> bool:
    """Whether :func:`_blocked_column_sums` takes ``(N, L, C)`` in blocks of at least two
    whole samples, and one per thread (for BatchNorm, :data:`BATCH_BLOCK_MIN_SAMPLES`
    per thread): there it beats the folded kernel sums, which cost one call per sample
    (``benchmarks/column_sums.py``, two runs each: with one thread blocks of five 14 x 14
    x 256 samples are 1.1x faster, while at one 56 x 56 x 64 sample per block the kernel
    is 1.05-1.13x faster and at 128 x 128 1.17-1.32x; with two threads, with 64-row
    folds, blocks of whole samples were 1.1-1.75x faster at 56 x 56 and 14 x 14 -- fewer
    rows per fold only slow the kernel -- and where a sample overflows a thread's block
    the kernel is faster than the whole-tensor way the blocks fall back to).

    BatchNorm's sums fold to :data:`FOLD_ROWS_BATCH` rows, and so folded the kernel beats
    the blocks unless the samples are small (``column_sums.py --folds`` on an AMD EPYC VM
    with 2 MiB of L2 per core; the rule before was measured on an Intel Xeon VM; ms,
    kernel / blocks): one thread 32x64x56x56 1.34 / 2.54, 8x32x128x128 0.83 / 1.15,
    32x128x28x28 0.75 / 1.04, 32x192x28x28 1.11 / 2.11, 16x64x32x32 0.27 / 0.28,
    64x64x16x16 0.59 / 0.30; two threads 0.88 / 1.47, 0.48 / 0.87, 0.53 / 0.62,
    0.72 / 1.35, 0.23 / 0.16, 0.64 / 0.20. A block of four samples per thread or more
    (the last two shapes) takes the blocks, fewer the kernel: the faster way in each row.
    GroupNorm pooling several channels per group folds to as many rows, and there the
    blocks need :data:`GROUP_BLOCK_MIN_SAMPLES` samples in all (see there); InstanceNorm
    (and one channel per group) keeps the 64-row folds and the rule above.
    """
    threads = torch.get_num_threads()
    n, length, c = cols.shape
    step = COLUMN_BLOCK_BYTES * threads // max(length * c * cols.element_size(), 1)
    if pool.kind == "batch":
        return step >= BATCH_BLOCK_MIN_SAMPLES * threads
    if _fold_rows(pool, c) == FOLD_ROWS_BATCH:  # GroupNorm's 256-row folds
        return step >= max(threads, GROUP_BLOCK_MIN_SAMPLES)
    return step >= max(threads, 2)


#: Fewest threads from which channels-last BatchNorm takes its forward sums from one kernel
#: call over the whole ``(N*L, C)`` matrix (:func:`_whole_column_sums`) also where its
#: samples are too large for the cache blocks (where they are not, it always does), not
#: one call per sample. ms per call, per-sample folds / whole fold / blocks, cold cache
#: and warm (``benchmarks/column_sums.py --batch-sums``, AMD EPYC VM, the two runs of
#: RESULTS.md "Channels-last BatchNorm sums: one call over every sample"): with two
#: threads the whole fold was the fastest way at every large-sample shape warm and at all
#: but one cold, a tie (32x64x56x56 cold 2.38-3.03 / 2.28-2.51 / 2.77-2.81, 32x128x28x28
#: warm 1.16-1.18 / 0.92-1.02 / 1.21-1.48: each per-sample call forks and joins the
#: threads on a sample's worth of work), and on small samples as fast as the blocks warm
#: (0.20-0.73 / 0.20-0.66 ms) and faster cold (0.54-0.93 / 0.56-1.08); with one thread the
#: per-sample folds stay faster on large samples (32x64x56x56 warm 2.03-2.06 /
#: 2.61-2.91) while the whole fold matches or beats the blocks on small ones. Its pooled
#: variance is also the most accurate of the three (2.6e-7 to 7.7e-7 relative at
#: ``|mean| / std`` 1.5, against 6.1e-7 to 9.7e-7 and 6.1e-7 to 1.1e-6), its few hundred
#: partial sums being added in float64. The backward's sums past
#: ``CHANNELS_LAST_BACKWARD_MAX_COUNT`` values per channel follow the same rule
#: (:func:`_backward_sums`; ``column_sums.py --backward-sums``, two threads, per-sample /
#: whole ms, cold: 16x64x112x112 5.83-7.65 / 5.14-6.05, 8x32x256x256 8.17-8.75 /
#: 7.25-7.58, 64x64x56x56 4.72-5.37 / 4.88-5.34).
WHOLE_FOLD_MIN_THREADS = 2
#: Fewest whole samples per thread a cache block must hold for BatchNorm's channels-last
#: sums to take the blocks rather than the kernel's 256-row folds (:func:`_blocks_of_samples`).
BATCH_BLOCK_MIN_SAMPLES = 4
#: Fewest whole samples a cache block (:data:`COLUMN_BLOCK_BYTES` per thread) must hold for
#: GroupNorm's channels-last sums over several channels per group to take the blocks rather
#: than the kernel's 256-row folds, and at least one per thread (:func:`_blocks_of_samples`).
#: Blocks / kernel ms, two runs (``benchmarks/column_sums.py --group-blocks``, 32 groups, AMD
#: EPYC VM): two samples per block 1.10-1.28x (one thread, 28x28) and 1.28-1.58x (two
#: threads, 32x64x56x56 and 16x64x64x64), three 1.06-1.12x: the kernel is faster; five
#: 0.98-0.99x (one thread, 14x14) and 0.81-1.12x (two threads, 28x28), six or more
#: 0.66-0.79x: the blocks. (Two samples, one per thread, was the rule when GroupNorm folded
#: to 64 rows like InstanceNorm, whose wider folded matrices the blocks still beat there.)
GROUP_BLOCK_MIN_SAMPLES = 4


#: Most rows torch's BatchNorm kernel sums in sequence for :func:`_kernel_column_sums` and the
#: channels-last backward sums (:func:`_fold`). Its channels-last sums add the rows one after
#: another, so their error grows with the rows. Max error vs float64 of GroupNorm from each way's
#: sums, at ``|mean| / std`` 0, 1 and 2 (``benchmarks/column_sums.py --accuracy``): 32x64x56x56, 32
#: groups, unfolded (3136 rows) 2.0e-6 / 6.5e-6 / 2.2e-5, folded to 224 rows 3.3e-7 / 1.0e-6 /
#: 2.5e-6, to 64 rows 2.4e-7 / 7.9e-7 / 2.1e-6, torch's cascaded sums 3.4e-7 / 1.1e-6 / 2.8e-6;
#: 32x32x32x32, 8 groups, 256 rows 1.9e-7 / 7.6e-7 / 2.1e-6 against the cascade's 1.3e-7 / 4.5e-7 /
#: 1.5e-6. One group per channel (InstanceNorm) averages nothing over channels: 256 rows 4.6e-7 /
#: 1.4e-6 / 5.2e-6, 64 rows 3.3e-7 / 1.2e-6 / 3.4e-6, the cascade 2.9e-7 / 8.4e-7 / 2.8e-6. So 64
#: rows: within 1.2x of the cascade for every pool (256 rows were 1.1-1.7x faster than the blocks
#: with one thread, 64 rows are 1.05-1.3x where they are taken). Only InstanceNorm (and
#: GroupNorm with one channel per group) keeps it; pooled sums take
#: :data:`FOLD_ROWS_BATCH` (:func:`_fold_rows`).
FOLD_ROWS = 64
#: Most rows in sequence for BatchNorm's sums, which pool every sample's (and GroupNorm's,
#: which pool several channels': :func:`_fold_rows`). Relative error
#: of the pooled variance (``|mean| / std`` 1.5) at 32x64x56x56: 2.6e-7 at 224 rows, 1.5e-7
#: at 64, 1.8e-7 from the blocks, 2.2e-6 unfolded (3136 rows); at 8x32x128x128 2.2e-7 at
#: 256 rows. The kernel's sums at 224 rows (896 columns) took 1.2x less time than at 64
#: (3136 columns: its per-column accumulators leave the L1 cache), at 256 rows of
#: 128 x 128 1.35-1.4x less than at 64, with 1 and 2 threads
#: (``benchmarks/column_sums.py --folds``).
FOLD_ROWS_BATCH = 256
#: Fewest rows a fold may leave: below, the folded matrix is so wide that summing its
#: folds costs more than it saves (and a prime ``L`` has no fold but ``L`` itself).
FOLD_MIN_ROWS = 16


def _fold_rows(pool: Pool, channels: int) -> int:
    """The most rows :func:`_fold` leaves for sums pooled by ``pool`` over ``channels``
    channels: :data:`FOLD_ROWS_BATCH` where a group pools several slices' sums (BatchNorm;
    GroupNorm with two channels per group or more), else :data:`FOLD_ROWS`.

    GroupNorm at :data:`FOLD_ROWS_BATCH` rows: max error vs float64 at ``|mean| / std``
    0 / 1 / 2 (``benchmarks/column_sums.py --accuracy``) 32x64x56x56 in 32 groups, 224
    rows, 3.3e-7 / 1.0e-6 / 2.5e-6 (64 rows: 2.4e-7 / 7.9e-7 / 2.1e-6; torch's cascaded
    sums 3.4e-7 / 1.1e-6 / 2.8e-6), 32x32x32x32 in 8 groups, 256 rows, 1.9e-7 / 7.6e-7 /
    2.1e-6 (64 rows: 1.5e-7 / 6.7e-7 / 1.8e-6): within the cascade's. Its channels-last
    forward was 1.1-1.3x faster than at 64 rows, whose folded matrices are as wide as
    BatchNorm's were at 64 (RESULTS.md, "GroupNorm's folds"). One slice per group
    (InstanceNorm) averages nothing over channels: 256 rows reach 5.2e-6 there, so it
    keeps 64 (3.4e-6).

    Example:
        >>> _fold_rows(Pool("group", 32), 64), _fold_rows(Pool("instance"), 64)
        (256, 64)
    """
    if pool.kind == "batch" or (pool.kind == "group" and channels // pool.groups >= 2):
        return FOLD_ROWS_BATCH
    return FOLD_ROWS


@functools.lru_cache(maxsize=256)
def _fold(length: int, rows: int = FOLD_ROWS) -> int | None:
    """The smallest ``k`` dividing ``length`` with ``length / k <= rows`` rows
    (:data:`FOLD_ROWS` by default), when those rows are at least :data:`FOLD_MIN_ROWS`;
    else ``None``.

    An ``(L, C)`` matrix viewed as ``(L / k, k * C)`` (the same memory) has rows of ``k``
    consecutive positions: torch's BatchNorm kernel then sums ``L / k`` rows in sequence
    per column, and the ``k`` column sums of each channel are added after.

    Example:
        >>> _fold(3136), _fold(64), _fold(4099)  # 56 x 56, 8 x 8, a prime
        (49, 1, None)
        >>> _fold(3136, FOLD_ROWS_BATCH)  # 224 rows
        14
    """
    return equal_pieces(length, rows, FOLD_MIN_ROWS)


#: Bytes of input per thread that :func:`_blocked_column_sums` squares at a time: the
#: block and its squares stay in this machine's per-core L2 cache (2 MiB) between the
#: passes. Chosen by ``benchmarks/column_sums.py --block-bytes`` (128 KiB to 2 MiB).
COLUMN_BLOCK_BYTES = 1 << 20


def _blocked_column_sums(cols: Tensor) -> tuple[Tensor, Tensor]:
    """``(N, C)`` sums of ``x`` and ``x^2`` over the rows of each ``(L, C)`` matrix of
    ``(N, L, C)``, a cache-sized block at a time.

    Outer reductions, summed in cascade by torch (2-5 ulps at any count; vector_norm is
    up to 8x slower there than square + sum, and torch's BatchNorm kernel sums
    sequentially). Squaring the whole tensor and then summing the squares streams a
    full-size temporary through memory twice; squaring a block of whole samples into a
    reused buffer and summing it while it is in cache does not (the sums are the same,
    bit for bit). With one thread a sample larger than the block is taken in parts of
    its rows, whose sums are then added. With more threads a block must hold at least
    one sample per thread (each op then splits across the samples; split within a
    sample's rows, torch's outer reductions measured slower than the whole-tensor way),
    else the whole tensor is squared as before. Measured (``benchmarks/column_sums.py``,
    float32, channels-last, whole-tensor time / blocked time, five runs): 32x64x56x56
    1.7-3.0x at 1 thread and 1.5-4.1x at 2, 32x256x14x14 1.25-1.4x and 0.96-1.09x,
    8x32x128x128 1.4-2.0x at 1 thread (2 threads: the whole-tensor way).
    """
    n, length, c = cols.shape
    threads = torch.get_num_threads()
    sample = length * c * cols.element_size()
    step = COLUMN_BLOCK_BYTES * threads // max(sample, 1)
    if step < threads and threads > 1:
        return cols.sum(1), (cols * cols).sum(1)
    s1, s2 = cols.new_empty(n, c), cols.new_empty(n, c)
    if step >= 1:  # blocks of whole samples
        buffer = cols.new_empty(min(step, n), length, c)
        for i in range(0, n, step):
            block = cols[i:i + step]
            squares = buffer[:block.shape[0]]
            torch.sum(block, 1, out=s1[i:i + step])
            torch.mul(block, block, out=squares)
            torch.sum(squares, 1, out=s2[i:i + step])
        return s1, s2
    rows = max(1, COLUMN_BLOCK_BYTES // (c * cols.element_size()))
    pieces = -(-length // rows)
    p1, p2 = cols.new_empty(n, pieces, c), cols.new_empty(n, pieces, c)
    buffer = cols.new_empty(rows, c)
    for i in range(n):
        for j in range(pieces):
            block = cols[i, j * rows:(j + 1) * rows]
            squares = buffer[:block.shape[0]]
            torch.sum(block, 0, out=p1[i, j])
            torch.mul(block, block, out=squares)
            torch.sum(squares, 0, out=p2[i, j])
    return torch.sum(p1, 1, out=s1), torch.sum(p2, 1, out=s2)


def _kernel_column_sums(cols: Tensor, fold: int = 1) -> tuple[Tensor, Tensor]:
    """Column sums of each ``(L, C)`` matrix of ``(N, L, C)`` from torch's BatchNorm
    backward kernel: with ``dy = x``, zero mean and unit invstd its "dbias" and "dweight"
    are ``sum x`` and ``sum x^2``, read with the channels innermost and no temporary (2x
    faster than a column sum plus a sum of squares).

    The kernel adds sequentially along the rows, so its sums carry the error of torch's
    channels-last BatchNorm at that many rows; each matrix is therefore read folded
    (:func:`_fold`), as ``L / fold`` rows of ``fold * C`` columns, and the ``fold`` sums
    of each channel added after. Unfolded, pooling the ``N`` matrices cannot raise the
    relative error of sums of squares, which kept BatchNorm within normkit's bound up to
    :data:`~normkit.kernels.native.CHANNELS_LAST_MAX_COUNT` rows; pooled over only a few
    channels, as GroupNorm does, the unfolded error at 56 x 56 positions was 5x the
    cascade's. Folded to at most :data:`FOLD_ROWS` rows the error is within 1.2x of the
    cascade's (see there), at one call per sample as unfolded; which of this and
    :func:`_blocked_column_sums` is faster where: :func:`_blocks_of_samples`.
    """
    n, length, c = cols.shape
    unit = torch.ones(fold * c, dtype=cols.dtype, device=cols.device)
    zero = torch.zeros_like(unit)
    sums = [_ATEN.native_batch_norm_backward(m, m, unit, None, None, zero, unit, True, 0.0,
                                             [False, True, True])
            for m in cols.reshape(n, length // fold, fold * c).unbind(0)]
    s1, s2 = torch.stack([t[2] for t in sums]), torch.stack([t[1] for t in sums])
    if fold == 1:
        return s1, s2
    return s1.view(n, fold, c).sum(1), s2.view(n, fold, c).sum(1)


def _whole_column_sums(cols: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(1, C)`` sums of ``x`` and ``x^2`` over every row of ``(N, L, C)`` (BatchNorm's
    pooled sums) from one call of torch's BatchNorm backward kernel on the whole
    ``(N*L, C)`` matrix folded to at most :data:`FOLD_ROWS_BATCH` rows
    (:func:`_whole_fold_sums`); ``None`` where no such fold exists.

    Example:
        >>> cols = torch.randn(4, 3136, 8)
        >>> s1, s2 = _whole_column_sums(cols)
        >>> torch.allclose(s1, cols.sum((0, 1)).view(1, 8), rtol=1e-4, atol=1e-3)
        True
    """
    return _whole_fold_sums(cols, cols, None)


def _whole_fold_sums(g: Tensor, x: Tensor, mean: Tensor | None
                     ) -> tuple[Tensor, Tensor] | None:
    """``(1, C)`` ``sum g`` and ``sum g (x - mean)`` over every row of the ``(N, L, C)``
    matrices ``g`` and ``x`` (``mean``: ``C`` values, ``None`` for zero), from one call of
    torch's BatchNorm backward kernel on both viewed as ``(N*L, C)`` folded to at most
    :data:`FOLD_ROWS_BATCH` rows (the kernel adds that many rows in sequence, as the
    per-sample folds do); ``None`` where no such fold exists. Its ``fold`` partial sums
    per channel (hundreds, where a sample's fold leaves tens) are added in float64: added
    in float32, the pooled variance was 2-4x less accurate than from the per-sample folds
    (``benchmarks/column_sums.py --batch-sums``)."""
    n, length, c = x.shape
    fold = _fold(n * length, FOLD_ROWS_BATCH)
    if fold is None:
        return None
    unit = torch.ones(fold * c, dtype=x.dtype, device=x.device)
    means = torch.zeros_like(unit) if mean is None else mean.reshape(c).repeat(fold)
    shape = (n * length // fold, fold * c)
    _, sx, s1 = _ATEN.native_batch_norm_backward(g.reshape(shape), x.reshape(shape), unit,
                                                 None, None, means, unit, True, 0.0,
                                                 [False, True, True])
    return tuple(t.view(fold, c).sum(0, keepdim=True, dtype=torch.float64).to(x.dtype)
                 for t in (s1, sx))


def group_moments(x: Tensor, pool: Pool, eps: float
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
    """:func:`moments` that keeps the groups under the bound: ``(mean, var, rstd, bad)``
    with ``bad`` the indices ``n * G + g`` of the ``(sample, group)`` groups past
    :data:`RATIO` (``G`` is ``C`` for InstanceNorm), for :func:`repair_groups`, or
    ``None`` where every group is under it. ``None`` as a whole where more than
    :data:`REPAIR_MAX_SHARE` of the groups are past it, and for BatchNorm (whose groups
    pool every sample) past it.

    Example:
        >>> x = torch.randn(3, 4, 8, 8)
        >>> x[1, 2] += 100.0  # one (sample, channel) far off its spread
        >>> mean, var, rstd, bad = group_moments(x, Pool("instance"), 1e-5)
        >>> bad.tolist(), mean.shape
        ([6], torch.Size([3, 4]))
    """
    mean, var, rstd = _moments(x, pool, eps)
    if well_conditioned(mean, rstd, RATIO):
        return mean, var, rstd, None
    if pool.kind == "batch":
        return None
    n, c = mean.shape
    groups = c if pool.kind == "instance" else pool.groups
    first = (slice(None), slice(None), 0)  # (one slice per group: its stats are the group's)
    bad = ill_conditioned_rows(mean.view(n, groups, -1)[first], rstd.view(n, groups, -1)[first],
                               RATIO)
    if bad.numel() > REPAIR_MAX_SHARE * n * groups:
        return None
    return mean, var, rstd, bad


def repair_groups(y: Tensor, x: Tensor, pool: Pool, bad: Tensor, weight: Tensor | None,
                  bias: Tensor | None, eps: float) -> RowRepair:
    """The groups ``bad`` (:func:`group_moments`) of ``x`` normalized by normkit's
    compensated core into ``y`` in place, in ``x``'s layout (a
    :class:`~normkit.kernels.native.RowRepair`: its ``zeroed`` and ``patch`` serve the
    backward).

    Example:
        >>> x = torch.randn(3, 4, 8, 8).contiguous(memory_format=torch.channels_last)
        >>> x[1, 2] = x[1, 2] * 0.01 + 100.0
        >>> mean, var, rstd, bad = group_moments(x, Pool("instance"), 1e-5)
        >>> y = affine(x, mean, rstd, None, None)
        >>> _ = repair_groups(y, x, Pool("instance"), bad, None, None, 1e-5)
        >>> ref = torch.nn.functional.instance_norm(x.double())
        >>> bool((y - ref).abs().max() < 1e-5)
        True
    """
    n, c = x.shape[:2]
    groups = c if pool.kind == "instance" else pool.groups
    return RowRepair.apply(y, x, x.numel() // (n * groups), bad, weight, bias, eps,
                           groups=groups)


def _skips(x: Tensor, pool: Pool) -> bool:
    """Whether :func:`backward` of ``x`` takes ``skip`` (its per-sample sums path)."""
    return pool.kind != "batch" and not (x.is_contiguous() and pool.kind != "group")


def repaired_backward(repair: RowRepair, dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                      weight: Tensor | None, bias: Tensor | None, pool: Pool,
                      mask: Sequence[bool]) -> tuple[Tensor | None, Tensor | None,
                                                     Tensor | None]:
    """:func:`backward` of an output whose groups :func:`repair_groups` renormalized: the
    engine's gradients with those groups skipped (or, where its backward takes no
    ``skip``, from a copy of ``dy`` with them zeroed), then theirs from their own
    compensated statistics (``repair.patch``).

    Example:
        >>> x = torch.randn(3, 4, 8, 8).contiguous(memory_format=torch.channels_last)
        >>> x[1, 2] = x[1, 2] * 0.01 + 100.0
        >>> pool = Pool("instance")
        >>> mean, var, rstd, bad = group_moments(x, pool, 1e-5)
        >>> y = affine(x, mean, rstd, None, None)
        >>> repair = repair_groups(y, x, pool, bad, None, None, 1e-5)
        >>> dy = torch.randn(x.shape).contiguous(memory_format=torch.channels_last)
        >>> dx, _, _ = repaired_backward(repair, dy, x, mean, rstd, None, None, pool,
        ...                              (True, False, False))
        >>> leaf = x.double().requires_grad_()
        >>> torch.nn.functional.instance_norm(leaf).backward(dy.double())
        >>> bool((dx - leaf.grad).abs().max() < 1e-3)
        True
    """
    mask = tuple(mask)
    if _skips(x, pool):
        grads = backward(dy, x, mean, rstd, weight, pool, mask, skip=repair.bad)
    else:
        grads = backward(repair.zeroed(dy), x, mean, rstd, weight, pool, mask)
    return repair.patch(grads, dy, weight, bias, mask)


def _per_group(stats: tuple[Tensor, ...], pool: Pool) -> tuple[Tensor, ...]:
    """``(N, C)`` per-slice statistics as ``(N, G)``, one value per group."""
    n, c = stats[0].shape
    groups = c if pool.kind == "instance" else pool.groups
    return tuple(t.view(n, groups, -1)[:, :, 0] for t in stats)


def moments(x: Tensor, pool: Pool, eps: float) -> tuple[Tensor, Tensor, Tensor] | None:
    """Pooled ``(mean, var, rstd)`` per slice, or ``None`` when a group is ill-conditioned.

    Shapes are ``(1, C)`` for batch pooling and ``(N, C)`` otherwise; ``var`` is biased.

    Example:
        >>> x = torch.randn(4, 3, 8, 8)
        >>> mean, var, rstd = moments(x, Pool("batch"), 1e-5)
        >>> torch.allclose(mean.view(-1), x.mean((0, 2, 3)), atol=1e-6)
        True
        >>> moments(x + 100.0, Pool("batch"), 1e-5) is None
        True
    """
    mean, var, rstd = _moments(x, pool, eps)
    if not well_conditioned(mean, rstd, RATIO):
        return None
    return mean, var, rstd


def _moments(x: Tensor, pool: Pool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`moments` without the accuracy check."""
    s1, s2 = _slice_sums(x, pool)
    count = pool.count(x)
    mean = pool.sum(s1).div_(count)
    var = pool.sum(s2).div_(count).sub_(mean * mean).clamp_(min=0)
    return mean, var, torch.rsqrt(var + eps)


def _per_slice(t: Tensor, n: int) -> Tensor:
    """A ``(1, C)`` or ``(N, C)`` tensor as ``N*C`` contiguous values."""
    return t.expand(n, t.shape[1]).reshape(-1)


def _slice_affine(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``x * scale + shift`` with per-slice ``(1|N, C)`` scale and shift, in x's layout."""
    n, c = x.shape[:2]
    if x.is_contiguous():
        # torch's inference BatchNorm kernel on the (1, N*C, L) view: one pass, and
        # faster than a broadcast addcmul (running_var = 1 and eps = 0 make it exact)
        # (written through a view of a fresh tensor: the result itself is not a view, so
        # autograd lets callers modify it in place, e.g. an inplace ReLU)
        unit = torch.ones(n * c, dtype=x.dtype, device=x.device)
        y = empty_like(x, memory_format=torch.contiguous_format)
        _ATEN.native_batch_norm.out(
            x.view(1, n * c, -1), _per_slice(scale, n), _per_slice(shift, n),
            torch.zeros_like(unit), unit, False, 0.0, 0.0, out=y.view(1, n * c, -1),
            save_mean=x.new_empty(0), save_invstd=x.new_empty(0))
        return y
    # channels-last, per slice or per channel: one broadcast addcmul, in x's layout (per
    # channel up to 3x faster than torch's inference BatchNorm kernel on the same
    # channels-last tensor, never slower: native.BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS)
    view = (-1, c) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.view(view), x, scale.view(view), out=out_like(x))


def affine(x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor | None,
           bias: Tensor | None) -> Tensor:
    """``(x - mean) * rstd * weight + bias`` folded into one per-slice ``x * a + b`` pass.

    Example:
        >>> x = torch.randn(2, 3, 4, 4)
        >>> mean, var, rstd = moments(x, Pool("instance"), 0.0)
        >>> y = affine(x, mean, rstd, None, None)
        >>> torch.allclose(y.mean((2, 3)), torch.zeros(2, 3), atol=1e-5)
        True
    """
    scale = rstd if weight is None else rstd * weight
    shift = -mean * scale if bias is None else bias - mean * scale
    return _slice_affine(x, scale, shift)


def _backward_sums(dy: Tensor, x: Tensor, mean: Tensor, pool: Pool
                   ) -> tuple[Tensor, Tensor]:
    """``(N, C)`` per-slice ``sum dy`` and ``sum dy (x - mean)`` (``(1, C)``, already
    pooled, for channels-last BatchNorm where its forward sums take one call over every
    sample's rows: small samples, or :data:`WHOLE_FOLD_MIN_THREADS` threads)."""
    n, c = x.shape[:2]
    if x.is_contiguous():
        # torch's BatchNorm backward on the (1, N*C*fold, L / fold) view with unit invstd,
        # reductions only: its "dweight" is sum dy (x - mean) per piece of a slice,
        # "dbias" is sum dy (pieces as _row_sums reads them)
        length = x[0, 0].numel()
        fold = _row_fold(length)
        if fold is None:
            rows, g = x.view(n, c, -1), dy.reshape(n, c, -1)
            return g.sum(-1), (g * (rows - mean.view(-1, c, 1))).sum(-1)
        shape = (1, n * c * fold, length // fold)
        unit = torch.ones(n * c * fold, dtype=x.dtype, device=x.device)
        _, sx, s1 = _ATEN.native_batch_norm_backward(
            dy.contiguous().view(shape), x.view(shape), unit, None, None,
            _per_slice(mean, n).repeat_interleave(fold), unit, True, 0.0, [False, True, True])
        return _fold_total(s1, fold).view(n, c), _fold_total(sx, fold).view(n, c)
    # channels-last: the same kernel per sample on the (L, C) matrix, whose channels are
    # the columns (2x faster than a product and two column sums, and no temporary),
    # folded as the forward's sums are (_kernel_column_sums: the same rows in sequence)
    cols_dy, cols_x = _columns(dy), _columns(x)  # (N, L, C)
    length = cols_x.shape[1]
    if pool.kind == "batch" and (_blocks_of_samples(cols_x, pool)
                                 or torch.get_num_threads() >= WHOLE_FOLD_MIN_THREADS):
        # BatchNorm of small samples (those its forward sums in cache blocks), and of any
        # with two threads: one call over the whole (N*L, C) matrix folded to
        # FOLD_ROWS_BATCH rows, not one per sample (per-sample calls cost more than they
        # read there; column_sums.py --folds, ms per call, per sample -> whole, one / two
        # threads: 64x64x16x16 1.29 -> 0.60 / 1.34 -> 0.40, 16x64x32x32 0.40 -> 0.38 /
        # 0.40 -> 0.25; column_sums.py --backward-sums, measured past 131072 values per
        # channel, where this engine took BatchNorm's backward then, see
        # WHOLE_FOLD_MIN_THREADS); with
        # one thread larger samples keep the per-sample folds, as the forward does
        sums = _whole_fold_sums(cols_dy, cols_x, mean)
        if sums is not None:
            return sums
    fold = _fold(length, _fold_rows(pool, c)) or 1
    shape = (n, length // fold, fold * c)
    unit = torch.ones(fold * c, dtype=x.dtype, device=x.device)
    means = mean.expand(n, c).repeat(1, fold)
    sums = [_ATEN.native_batch_norm_backward(g, v, unit, None, None, m, unit, True, 0.0,
                                             [False, True, True])
            for g, v, m in zip(cols_dy.reshape(shape).unbind(0), cols_x.reshape(shape).unbind(0),
                               means.unbind(0), strict=True)]
    s1, sx = torch.stack([s[2] for s in sums]), torch.stack([s[1] for s in sums])
    if fold == 1:
        return s1, sx
    return s1.view(n, fold, c).sum(1), sx.view(n, fold, c).sum(1)


def backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor | None,
             pool: Pool, mask: tuple[bool, bool, bool], skip: Tensor | None = None
             ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    r"""``(dx, dweight, dbias)`` of :func:`affine` over statistics pooled by ``pool``.

    ``skip``: groups (``n * G + g``, :func:`group_moments`' ``bad``; InstanceNorm and
    GroupNorm only) that add nothing to the parameter gradients and whose ``dx`` is left
    for the caller to overwrite -- the groups :func:`repair_groups` renormalized, whose
    gradients its ``patch`` gives (no zeroed copy of ``dy`` needed).

    With per-slice ``S1 = sum dy`` and ``Sx = sum dy (x - mean)``: ``dbias = sum_n S1``,
    ``dweight = sum_n rstd Sx``, and ``dx = rstd gamma dy - rstd A - rstd^2 B (x - mean)``
    with the group means ``A = mean_g(gamma S1)``, ``B = mean_g(gamma rstd Sx)``, applied
    as ``dx = k1 dy + k2 x + k3``. Contiguous input pooled per channel or per slice
    computes the same with torch's BatchNorm backward kernel (:func:`_kernel_backward`).

    Example:
        >>> x = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
        >>> y = torch.nn.functional.group_norm(x, 2, eps=1e-5)
        >>> dy = torch.randn_like(y)
        >>> y.backward(dy)
        >>> mean, var, rstd = moments(x.detach(), Pool("group", 2), 1e-5)
        >>> dx, _, _ = backward(dy, x.detach(), mean, rstd, None, Pool("group", 2),
        ...                     (True, False, False))
        >>> torch.allclose(dx, x.grad)
        True
    """
    n, c = x.shape[:2]
    if skip is not None and not _skips(x, pool):
        raise ValueError("skip serves the per-sample sums of GroupNorm and of channels-last "
                         f"InstanceNorm, got {pool.kind} pooling of "
                         f"{'contiguous' if x.is_contiguous() else 'channels-last'} input")
    if _kernel_serves_backward(x, pool, mask):
        return _kernel_backward(dy, x, mean, rstd, weight, pool, mask)
    # (dy in x's layout: the sums read both alike and dx comes out in x's layout)
    dy = strided_like(dy.contiguous(memory_format=channels_last_format(x)
                                    or torch.contiguous_format), x)
    s1, sx = _backward_sums(dy, x, mean, pool)
    if skip is not None:
        groups = c if pool.kind == "instance" else pool.groups
        skipped = torch.zeros(n * groups, dtype=torch.bool, device=x.device)
        skipped[skip] = True
        skipped = skipped.view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
        s1, sx = s1.masked_fill(skipped, 0), sx.masked_fill(skipped, 0)
    dx = dw = db = None
    if mask[1]:
        dw = (rstd * sx).sum(0)
    if mask[2]:
        db = s1.sum(0)
    if mask[0]:
        count = pool.count(x)
        gamma = s1.new_ones(c) if weight is None else weight
        a = pool.sum(gamma * s1).div_(count)
        b = pool.sum(gamma * rstd * sx).div_(count)
        k1, k2 = rstd * gamma, -rstd * rstd * b
        k3 = rstd * (rstd * b * mean - a)
        dx = _slice_affine(dy, k1, k3)
        if x.is_contiguous():
            dx.view(1, n * c, -1).addcmul_(x.view(1, n * c, -1), _per_slice(k2, n).view(
                1, -1, 1))
        else:
            dx.addcmul_(x, k2.view((-1, c) + (1,) * (x.dim() - 2)))
    return dx, dw, db


#: Largest BatchNorm input (bytes) whose input gradient :func:`backward` takes from torch's
#: BatchNorm backward kernel (:func:`_kernel_serves_backward`). That kernel allocates its own
#: ``dx`` (its ``out=`` overload computes, then copies), and from 32 MiB glibc's default
#: allocator hands out fresh memory, faulted in page by page, where the sums and two passes
#: write into normkit's output cache (:mod:`normkit.kernels.memory`). ``BatchNorm2d``
#: fwd+bwd, median of 31 alternated calls in one process (scratch timings; the
#: ``normkit bench`` rows of RESULTS.md, "Long NCHW slices and large BatchNorm backward",
#: are the reproducible ones), ms, kernel / sums and passes: one thread
#: 32x64x64x64 27.2 / 17.4, 8x64x128x128 26.2 / 17.3, channels-last 16x512x32x32
#: 33.0 / 22.8; two threads 16.6 / 14.6, 16.3 / 14.6, 20.8 / 18.4. With glibc's heap reuse
#: (``MALLOC_MMAP_MAX_=0``) the two were within noise of each other. A size, not the
#: allocator's state, decides, so that a shape's gradients have the same bits whatever
#: memory they land on.
KERNEL_BACKWARD_MAX_BYTES = 32 << 20


def _kernel_serves_backward(x: Tensor, pool: Pool, mask: tuple[bool, bool, bool]) -> bool:
    """Whether :func:`backward` is torch's BatchNorm backward kernel
    (:func:`_kernel_backward`) rather than the sums and two passes.

    The kernel serves contiguous BatchNorm and InstanceNorm up to
    :data:`ROW_BACKWARD_MAX_LENGTH` positions per slice and channels-last BatchNorm up to
    :data:`~normkit.kernels.native.CHANNELS_LAST_BACKWARD_MAX_COUNT` values per channel,
    where its sums are accurate (channels-last: within the gradient tolerance, an upstream
    gradient along the input included, and 1.3-2x faster than the sums and two passes
    there), and BatchNorm's, where ``dx`` is wanted, below
    :data:`KERNEL_BACKWARD_MAX_BYTES`. InstanceNorm's slices are each read and finished
    while in cache (one pass over memory, against the sums' and passes' three), which
    outweighs the faults of the kernel's own ``dx``: fwd+bwd 32x64x64x64, one thread,
    2.99-4.21x torch with the kernel, 1.33-1.84x with the sums and passes.
    """
    if pool.kind == "group":
        return False
    if x.is_contiguous():
        if x[0, 0].numel() > ROW_BACKWARD_MAX_LENGTH:
            return False
    elif pool.kind != "batch" or pool.count(x) > CHANNELS_LAST_BACKWARD_MAX_COUNT:
        return False
    return (not mask[0] or pool.kind == "instance"
            or x.numel() * x.element_size() < KERNEL_BACKWARD_MAX_BYTES)


def _kernel_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                     weight: Tensor | None, pool: Pool, mask: tuple[bool, bool, bool]
                     ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`backward` of contiguous input pooled per channel (BatchNorm) or per slice
    (InstanceNorm), and of channels-last input pooled per channel: torch's BatchNorm
    backward kernel on ``x`` -- or, per slice, on its ``(1, N*C, L)`` view, each slice a
    channel -- from the saved statistics.

    That kernel runs channel by channel: the two sums, in double across the batch, then
    ``dx`` while the channel's ``dy`` and ``x`` are still in cache -- one pass over memory
    where the sums and a two-step ``k1 dy + k3``, ``+= k2 x`` make three.
    """
    n, c = x.shape[:2]
    g = strided_like(dy.contiguous(memory_format=channels_last_format(x)
                                    or torch.contiguous_format), x)
    if pool.kind == "batch":
        inputs = (g, x, weight, mean.reshape(c), rstd.reshape(c))
    else:
        inputs = (g.view(1, n * c, -1), x.view(1, n * c, -1),
                  None if weight is None else weight.repeat(n), mean.reshape(n * c),
                  rstd.reshape(n * c))
    g, v, w, m, r = inputs
    dx, dw, db = _ATEN.native_batch_norm_backward(g, v, w, None, None, m, r, True, 0.0,
                                                  list(mask))
    dx = dx.view(x.shape) if mask[0] else None
    if pool.kind == "instance":
        dw = dw.view(n, c).sum(0) if mask[1] else None
        db = db.view(n, c).sum(0) if mask[2] else None
    return dx, (dw if mask[1] else None), (db if mask[2] else None)


#: Fewest positions per slice from which channels-last GroupNorm takes this engine.
#: Below it torch's channels-last kernels serve both passes (under :data:`RATIO`): their
#: backward is faster there (this engine's fwd+bwd, 1 thread: 0.58x torch at 7x7, 0.89x
#: at 14x14, 1.3x at 28x28, 2x at 64x64, 3.3x at 128x128), and their forward, which sums
#: sequentially along the positions, is still accurate (max error 2.8e-6 at 14x14 and
#: ratio 1.5, but 2.5e-5 at 56x56 and 6.3e-5 at 128x128).
GROUP_NORM_MIN_POSITIONS = 512


class _SliceNormFunction(torch.autograd.Function):
    """:func:`affine` with fixed pooled statistics; backward by :func:`backward`.

    Double backward differentiates ``reference``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, rstd, pool, reference):
        y = affine(x, mean, rstd, weight, bias)
        ctx.pool, ctx.reference = pool, reference
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if backward_by_reference(dy):  # create_graph=True, batched gradients
            out = reference_grads(ctx.reference, (x, weight, bias), needs, dy)
        else:
            out = backward(dy, x, mean, rstd, weight, ctx.pool, needs)
        return (*out, None, None, None, None)


def normalize(x: Tensor, weight: Tensor | None, bias: Tensor | None, pool: Pool, eps: float,
              reference: Callable[[Tensor, Tensor | None, Tensor | None], Tensor],
              ) -> tuple[Tensor, Tensor, Tensor] | None:
    """Normalize ``(N, C, *)`` input by pooled slice statistics: ``(y, mean, var)``.

    Returns ``None`` (and computes nothing else) when :func:`supports` refuses the input
    or a group is ill-conditioned (see the module notes). ``weight``/``bias`` are ``(C,)``;
    ``mean``/``var`` come back as ``(1, C)`` (batch pooling) or ``(N, C)``, ``var`` biased.
    ``reference(x, weight, bias)`` recomputes ``y`` differentiably (double backward).

    Example:
        >>> x = torch.randn(16, 4, 64, 64, requires_grad=True)  # 2^18 elements
        >>> ref = lambda x, w, b: torch.nn.functional.instance_norm(x)
        >>> y, mean, var = normalize(x, None, None, Pool("instance"), 1e-5, ref)
        >>> torch.allclose(y, ref(x, None, None), atol=1e-5)
        True
    """
    if not supports(x, weight, bias):
        return None
    stats = group_moments(x.detach(), pool, eps)
    if stats is None:
        return None
    mean, var, rstd, bad = stats
    if bad is None:
        return normalize_by(x, weight, bias, mean, rstd, pool, reference), mean, var
    # InstanceNorm / GroupNorm with groups past the bound: those by the compensated core,
    # the others as the engine gives them (each sample its own result)
    with torch.no_grad():
        y = affine(x.detach(), mean, rstd, weight, bias)
    repair = repair_groups(y, x, pool, bad, weight, bias, eps)

    def grads(dy, x, weight, bias, mask):
        return repaired_backward(repair, dy, x, mean, rstd, weight, bias, pool, mask)

    y = kernel_node(x, weight, bias, y, grads, reference)
    group_stats = repair.statistics(*_per_group((mean, rstd, var), pool))
    mean, _, var = (t.repeat_interleave(mean.shape[1] // t.shape[1], dim=1)
                    for t in group_stats)
    return y, mean, var


def normalize_by(x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                 rstd: Tensor, pool: Pool,
                 reference: Callable[[Tensor, Tensor | None, Tensor | None], Tensor]) -> Tensor:
    """The second half of :func:`normalize`: ``y`` from statistics :func:`moments` gave
    for ``x`` (one pass forward; backward by :func:`backward`, which treats them as
    ``x``'s own, so they must be). For callers whose affine depends on the statistics,
    such as Batch Renormalization's ``weight * r`` (``r`` held constant).

    Example:
        >>> x = torch.randn(16, 4, 64, 64)
        >>> mean, var, rstd = moments(x, Pool("batch"), 1e-5)
        >>> ref = lambda x, w, b: torch.nn.functional.batch_norm(x, None, None, w, b, True)
        >>> y = normalize_by(x, 2 * torch.ones(4), None, mean, rstd, Pool("batch"), ref)
        >>> torch.allclose(y, ref(x, 2 * torch.ones(4), None), atol=1e-5)
        True
    """
    return _SliceNormFunction.apply(x, weight, bias, mean, rstd, pool, reference)
