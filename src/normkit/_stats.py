"""The one statistics core of normkit.

Every normalization family (batch, layer, RMS, group, instance) and every tool that
pools statistics (precise BN statistics, synchronized BN, the Standardizer) computes
its moments here, so there is exactly one place where numerical care lives.

Numerics
--------
* Statistics are accumulated in at least float32: float16 and bfloat16 inputs are
  up-cast, float64 stays float64 (:func:`compute_dtype`).
* The variance never comes from ``E[x^2] - E[x]^2``. :func:`moments` uses a
  *compensated shift*: a first mean ``mean_hi`` is computed in the compute dtype,
  the input is shifted by it (exact for values within a factor of two of the mean,
  by Sterbenz' lemma), and the mean and variance of the small residual give the
  correction ``mean_lo`` and the variance. The pair ``(mean_hi, mean_lo)`` represents
  the mean to roughly twice the working precision, so ``x - mean`` keeps its digits
  even when the data sit at an offset of 1e5 with unit spread, where a plain float32
  mean already carries an error of ~1e-3.
* Pooling of per-chunk statistics uses the count-weighted parallel merge of Chan,
  Golub and LeVeque (:func:`merge_moments`).

All functions here are built from differentiable PyTorch operations, so the
reference implementations can differentiate through them with autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Moments",
    "compute_dtype",
    "upcast",
    "FEW_VALUES",
    "reference_dtype",
    "reduced_count",
    "moments",
    "mean_square",
    "ROW_NORM_MAX",
    "NORM_PIECE",
    "row_norm",
    "equal_pieces",
    "unbiased_var",
    "merge_moments",
    "update_running_",
]


class Moments(NamedTuple):
    """First and second central moments over some dimensions (``keepdim`` shapes).

    ``mean = mean_hi + mean_lo`` (a compensated pair), ``var`` is the biased
    (population) variance, and ``shifted = x - mean_hi`` is the input shifted by the
    leading part of the mean, so ``shifted - mean_lo`` is the centered input.
    """

    mean_hi: Tensor
    mean_lo: Tensor
    var: Tensor
    shifted: Tensor

    @property
    def mean(self) -> Tensor:
        """The mean as one tensor (rounded to the compute dtype)."""
        return self.mean_hi + self.mean_lo


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype statistics are accumulated in for inputs of ``dtype``.

    float64 stays float64; every other floating dtype computes in float32.

    Example:
        >>> compute_dtype(torch.bfloat16)
        torch.float32
        >>> compute_dtype(torch.float64)
        torch.float64
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: Tensor) -> Tensor:
    """Return ``x`` in its compute dtype (no copy when it already is).

    Example:
        >>> upcast(torch.ones(2, dtype=torch.float16)).dtype
        torch.float32
    """
    target = compute_dtype(x.dtype)
    return x if x.dtype == target else x.to(target)


#: Statistics over fewer values than this are differentiated in float64 by the reference
#: math (:func:`reference_dtype`). Over ``k`` values the input gradient of a
#: normalization, ``rstd * (g - mean(g) - xhat * mean(g * xhat))``, is ``g`` with its
#: components along the constant vector and ``xhat`` taken out (along ``xhat`` alone
#: without centering). At ``k = 2`` that leaves nothing but what ``eps`` adds: the terms
#: cancel to ``eps / (var + eps)`` of their size, and float32 loses the digits the ratio
#: ``var / eps`` takes. Second derivatives of normkit's float32 paths before it took
#: float64 here, over 200 draws per count, against float64, relative to their largest
#: value: LayerNorm 8.9e-4 (torch's 9.3e-4) at 2 values, 2.7e-5 at 3, 1.0e-6 at 4;
#: BatchNorm 1.6e-4 (torch's 4.6e-3) at 2, 7.8e-6 at 3, 2.6e-6 at 4; RMSNorm 4.2e-4 at 1,
#: 2.3e-6 at 2 (the Triton fuzz's float32 tolerance is 1e-5). Since: benchmarks/ACCURACY.md,
#: "Statistics over few values".
FEW_VALUES = 4


def reference_dtype(x: Tensor, count: int) -> torch.dtype:
    """Return the dtype normkit's reference math computes in when each statistic pools
    ``count`` values of ``x``: its compute dtype, or float64 for fewer than
    :data:`FEW_VALUES` values (the derivatives there are what ``eps`` leaves of cancelling
    terms). A symbolic ``count`` (a dynamic shape under ``torch.compile`` or
    ``torch.export``) keeps the compute dtype, so no guard is added on the shape, as does
    a device without float64 (MPS).

    Example:
        >>> reference_dtype(torch.ones(2, 3), 3)
        torch.float64
        >>> reference_dtype(torch.ones(2, 8), 8)
        torch.float32
    """
    if type(count) is int and count < FEW_VALUES and x.device.type != "mps":
        return torch.float64
    return compute_dtype(x.dtype)


def reduced_count(shape: Sequence[int], dims: Sequence[int]) -> int:
    """Number of elements each statistic is computed over.

    Example:
        >>> reduced_count((8, 3, 5, 5), (0, 2, 3))
        200
    """
    count = 1
    for d in dims:
        count *= shape[d]
    return count


def moments(x: Tensor, dims: Sequence[int]) -> Moments:
    """Compensated mean and biased variance of ``x`` over ``dims`` (keepdim shapes).

    ``x`` should already be in its compute dtype (see :func:`upcast`).

    Example:
        >>> x = torch.tensor([[1e5 + 1.0, 1e5 - 1.0, 1e5 + 3.0, 1e5 - 3.0]])
        >>> m = moments(x, (1,))
        >>> float(m.var), float(m.mean_hi + m.mean_lo)
        (5.0, 100000.0)
    """
    dims = tuple(dims)
    mean_hi = x.mean(dims, keepdim=True)
    shifted = x - mean_hi
    mean_lo = shifted.mean(dims, keepdim=True)
    # E[d^2] - E[d]^2 on the *shifted* data: E[d] is at most a few ulps of the offset,
    # so the subtraction cancels nothing that matters (and is clamped at zero).
    # (torch.var_mean would be exact too, but is ~30x slower than two plain reductions on CPU.)
    var = (_mean_of_squares(shifted, dims) - mean_lo.square()).clamp(min=0)
    return Moments(mean_hi, mean_lo, var, shifted)


def mean_square(x: Tensor, dims: Sequence[int]) -> Tensor:
    """Mean of ``x**2`` over ``dims`` (keepdim), the statistic of RMSNorm.

    Example:
        >>> mean_square(torch.tensor([[3.0, 4.0]]), (1,))
        tensor([[12.5000]])
    """
    return _mean_of_squares(x, tuple(dims))


def _reduces_innermost(x: Tensor, dims: tuple[int, ...]) -> bool:
    """True when ``dims`` are the innermost block of ``x`` in memory (row-like reduction)."""
    if dims == tuple(range(x.dim() - len(dims), x.dim())) and x.is_contiguous():
        return True  # (the common case, decided without sorting strides)
    real = [d for d in range(x.dim()) if x.shape[d] > 1]
    reduced = {d for d in dims if x.shape[d] > 1}
    by_stride = sorted(real, key=lambda d: x.stride(d))
    return set(by_stride[: len(reduced)]) == reduced


#: Longest row whose RMS statistic ``torch.linalg.vector_norm`` reads whole
#: (:func:`row_norm`). On the CPU it adds a row in vector lanes, each lane in sequence, so
#: its error grows with the row: RMSNorm's output, against torch's composite (which sums
#: in cascade), 2.1e-7 / 1.4e-7 at 4096 values, 5.5e-7 / 1.5e-7 at 65536, 1.6e-6 / 1.2e-7
#: at 262144, 9.6e-6 / 6.9e-8 at 2^20. Longer rows are read in pieces of at most
#: :data:`NORM_PIECE` values (their output 4.4e-8 to 1.2e-7 off); up to here the pieces'
#: extra calls would cost more than they save (RMSNorm's forward at 4096 x 8192, two
#: pieces a row: 0.77-0.88x as fast).
ROW_NORM_MAX = 1 << 16
#: Most values of a piece of a row longer than :data:`ROW_NORM_MAX` (:func:`row_norm`).
NORM_PIECE = 4096


def equal_pieces(length: int, longest: int, shortest: int = 16) -> int | None:
    """The fewest equal pieces ``k`` (``k`` divides ``length``) of at most ``longest``
    values each, when those pieces hold at least ``shortest``; else ``None``. How
    normkit splits long sums that torch's CPU kernels would add in sequence
    (:func:`row_norm`, ``kernels.channels``' folds).

    Example:
        >>> equal_pieces(3136, 64), equal_pieces(64, 64), equal_pieces(4099, 64)
        (49, 1, None)
    """
    for k in range(max(1, -(-length // longest)), length // shortest + 1):
        if length % k == 0:
            return k
    return None


def row_norm(x: Tensor, dims: Sequence[int]) -> Tensor:
    """``torch.linalg.vector_norm(x, 2, dims, keepdim=True)``; rows longer than
    :data:`ROW_NORM_MAX` read in pieces of at most :data:`NORM_PIECE` values whose squared
    norms are added in float64 (else, with no equal pieces of 16 values or more, the
    square root of torch's cascaded sum of squares). The RMS statistic of every RMSNorm
    path that normalizes whole rows (``mean_square``, ``functional.rms_rows``, the fused
    row kernel's blocks) comes from here, so a row has the same bits on each;
    differentiable.

    Example:
        >>> x = torch.randn(2, 17 * 4096, dtype=torch.float64)
        >>> torch.allclose(row_norm(x, (1,)), x.norm(dim=1, keepdim=True))
        True
    """
    dims = tuple(sorted(d % x.dim() for d in dims))
    count = reduced_count(x.shape, dims)
    if count <= ROW_NORM_MAX:
        return torch.linalg.vector_norm(x, 2, dims, keepdim=True)
    keep = tuple(1 if d in dims else size for d, size in enumerate(x.shape))
    pieces = equal_pieces(count, NORM_PIECE)
    if pieces is None:
        return (x * x).sum(dims, keepdim=True).sqrt()
    # (the reduced dims last, in order: a view where they are trailing or, as for
    # mean_square's rows, innermost in memory around size-1 dims)
    rows = x.movedim(dims, tuple(range(x.dim() - len(dims), x.dim())))
    # (16-bit rows: the pieces' norms in float32, rounded once at the end, as whole)
    parts = torch.linalg.vector_norm(rows.reshape(*rows.shape[:x.dim() - len(dims)], pieces,
                                                  -1), 2, -1,
                                     dtype=torch.promote_types(x.dtype, torch.float32))
    return parts.double().square().sum(-1).sqrt().to(x.dtype).reshape(keep)


def _mean_of_squares(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    if ((torch.is_grad_enabled() and x.requires_grad) or torch.jit.is_tracing()
            or torch.compiler.is_compiling()):
        # differentiable everywhere (the norm's gradient is 0/0 at a zero vector); a
        # torch.jit.trace graph may run with or without a gradient, whichever it was
        # traced under; under torch.compile the choice below is Inductor's to make (and
        # sorting symbolic strides, with dynamic shapes, would break the graph)
        return (x * x).mean(dims, keepdim=True)
    if _reduces_innermost(x, dims):
        # rows: vector_norm reads x once with no temporary (3x faster than square + mean)
        count = reduced_count(x.shape, dims)
        return row_norm(x, dims).square() / max(count, 1)
    # strided/column reductions: vector_norm is up to 8x slower there than square + mean
    return (x * x).mean(dims, keepdim=True)


def unbiased_var(var: Tensor, count: int) -> Tensor:
    """Turn a biased variance over ``count`` values into the unbiased one.

    With a single value the unbiased variance is undefined; like torch, the result
    is then ``inf``/``nan`` rather than a silent zero.

    Example:
        >>> unbiased_var(torch.tensor([2.0]), 4)
        tensor([2.6667])
    """
    if count > 1:
        return var * (count / (count - 1))
    return var * float("inf") if count == 1 else var * float("nan")


def merge_moments(
    count_a: Tensor, mean_a: Tensor, m2_a: Tensor,
    count_b: Tensor, mean_b: Tensor, m2_b: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Merge two sets of (count, mean, M2) exactly (Chan, Golub & LeVeque 1979).

    ``M2`` is the sum of squared deviations from the mean, i.e. ``count * var``.
    Counts may differ per feature and may be zero. The result equals the moments of
    the concatenated data, whatever the split.

    Example:
        >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
        >>> n, mean, m2 = merge_moments(
        ...     torch.tensor(2.0), a.mean(), ((a - a.mean()) ** 2).sum(),
        ...     torch.tensor(3.0), b.mean(), ((b - b.mean()) ** 2).sum())
        >>> float(n), float(mean), float(m2 / n)
        (5.0, 3.0, 2.0)
    """
    count = count_a + count_b
    safe = torch.where(count > 0, count, torch.ones_like(count))
    delta = mean_b - mean_a
    weight_b = count_b / safe
    mean = mean_a + delta * weight_b
    m2 = m2_a + m2_b + delta.square() * count_a * weight_b
    return count, mean, m2


@torch.no_grad()
def update_running_(running: Tensor, value: Tensor, momentum: float) -> None:
    """PyTorch's running-average update in place: ``(1 - m) * running + m * value``.

    Example:
        >>> r = torch.zeros(2)
        >>> update_running_(r, torch.tensor([1.0, 2.0]), 0.1)
        >>> r
        tensor([0.1000, 0.2000])
    """
    # (one write, from a result that depends on ``value``: under a FakeTensorMode whose
    # ``value`` is fake, a step on ``running`` alone -- ``running.mul_`` -- would run on
    # the real buffer and leave it scaled. 16-bit statistics are averaged in float32 and
    # rounded once, as torch's kernels do: rounding the batch's value, the product and
    # the sum each to 16 bits put bfloat16 statistics several ulps off float64)
    acc = torch.float32 if running.dtype in (torch.float16, torch.bfloat16) else running.dtype
    new = torch.add(running.to(acc) * (1.0 - momentum), value.to(acc), alpha=momentum)
    try:
        running.copy_(new)
    except RuntimeError as error:
        if not _functorch_transforms_active():
            raise
        # vmap: a batched batch statistic cannot be written into an unbatched buffer;
        # torch's own error names vmap's in-place rule, not the layer or the way out
        raise RuntimeError(
            "a normalization layer in training mode got a batched input under "
            "torch.func.vmap while its running statistics, which are updated in place, "
            "are not batched; expected either batched buffers (stack_module_state + "
            "functional_call) or no running statistics: "
            "torch.func.replace_all_batch_norm_modules_(model) for BatchNorm layers, or "
            "set track_running_stats = False and the running buffers to None on the layer "
            "(MeanOnlyBatchNorm, InstanceNorm), or call model.eval()") from error


_functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active",
                                       lambda: False)
