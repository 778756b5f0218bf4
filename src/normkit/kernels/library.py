"""normkit's CPU fast paths as torch.library operators, for ``torch.compile``.

Under ``torch.compile`` normkit's ``backend="auto"`` cannot branch on the data (the
accuracy checks of :mod:`normkit.kernels.native` read a value), so it used to hand
Inductor the compensated reference math. On the CPU that is slower than normkit's eager
paths, and for LayerNorm Inductor's kernel is slower than torch's ATen kernel too
(table 3 of ``benchmarks/RESULTS.md``). So the eager choice is wrapped whole -- torch's
kernel under its accuracy bound, normkit's engine, the compensated fallback -- in one
opaque operator per direction, with a fake implementation and a registered autograd
formula: a compiled model keeps ``fullgraph=True``, normkit's precision at any offset
and the eager paths' speed.

* ``normkit::layer_norm(x, normalized_shape, weight, bias, eps)`` (contiguous input)
  ``-> (y, mean_hi, mean_lo, rstd)``: torch's ``native_layer_norm`` when every row's
  ``|mean| / std`` is within :data:`~normkit.kernels.native.THRESHOLDS`, else normkit's
  compensated path (the mean as a hi/lo pair);
* ``normkit::group_norm`` ``-> (y, mean_hi, mean_lo, rstd)`` per ``(N, G)``: on NCHW
  torch's kernel under its bound, on channels-last torch's kernel below
  :data:`~normkit.kernels.channels.GROUP_NORM_MIN_POSITIONS` positions and the
  slice-sums engine above; the compensated path otherwise;
* ``normkit::batch_norm_train`` ``-> (y, mean_hi, mean_lo, rstd, var)`` per channel,
  ``var`` biased: on contiguous (NCHW) input the slice-sums engine, below its size torch's
  kernel under its bound; on channels-last input torch's kernel up to
  :data:`~normkit.kernels.native.CHANNELS_LAST_MAX_COUNT` values per channel, the engine
  beyond; the compensated path otherwise. The caller updates its running statistics from
  the batch statistics in the graph (an operator with a registered backward cannot mutate
  its inputs);
* each has a ``*_backward`` operator taking the saved statistics: torch's backward
  kernel, :func:`normkit.kernels.channels.backward` or
  :func:`normkit.norms._core.normalize_backward`, re-checking the ratio on the
  statistics it receives (given accurate statistics within the bound, each is accurate).
  No autograd runs inside an operator, so they also run under dispatch modes
  (``torch.library.opcheck``, ``FlopCounterMode``).

Served: float32/float64 CPU input with parameters of its dtype (elsewhere, and for
layouts not listed, the reference math as before). A second derivative through the
operators is not available, as for any graph compiled by AOTAutograd.

One more operator serves a different purpose: ``normkit::snapshot(x) -> Tensor``, a copy
of ``x`` the compiler cannot see through (see :func:`snapshot`).

A schema, once released, is frozen: a change takes a new operator name, because
Inductor's on-disk graph cache does not key on custom operators' schemas (measured: a
graph cached before a schema change called the operator with the old arguments).

Example:
    >>> x = torch.randn(4, 8)
    >>> y, mean_hi, mean_lo, rstd = torch.ops.normkit.layer_norm(x, [8], None, None, 1e-5)
    >>> torch.allclose(y, torch.nn.functional.layer_norm(x, (8,)), atol=1e-6)
    True
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import channels, native

__all__ = ["snapshot", "serves_layer_norm", "layer_norm", "serves_channels_last",
           "serves_group_norm", "group_norm", "serves_batch_norm_train", "batch_norm_train"]

_LIB = torch.library.Library("normkit", "FRAGMENT")
_LIB.define("layer_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
            "float eps) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define("layer_norm_backward(Tensor dy, Tensor x, SymInt[] normalized_shape, "
            "Tensor mean_hi, Tensor mean_lo, Tensor rstd, Tensor? weight, Tensor? bias, "
            "bool[3] output_mask) -> (Tensor, Tensor, Tensor)")


def _row_dims(x: Tensor, shape) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(shape), x.dim()))


def _layer_norm(x, normalized_shape, weight, bias, eps):
    from ..norms._core import normalize_forward

    y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
    mean_lo = torch.zeros_like(mean)
    single = native.single_value(normalized_shape)
    if not single and native.well_conditioned(mean, rstd, native.THRESHOLDS["layer_norm"]):
        return y, mean, mean_lo, rstd
    bad = native.ill_conditioned_rows(mean, rstd, native.THRESHOLDS["layer_norm"])
    if single or bad.numel() == mean.numel():
        y, mean_hi, mean_lo, _, rstd = normalize_forward(x, _row_dims(x, normalized_shape),
                                                         weight, bias, eps)
        return y, *(t.to(mean.dtype) for t in (mean_hi, mean_lo, rstd))
    # the rows past the kernel's bound by the compensated core, each row its own (as in
    # eager: native.repair_rows); their statistics replace the kernel's, row by row
    repair = native.RowRepair.apply(y, x, x.numel() // mean.numel(), bad, weight, bias, eps)
    for stat, fixed in ((mean, repair.mean_hi), (mean_lo, repair.mean_lo),
                        (rstd, repair.rstd)):
        stat.view(-1).index_copy_(0, bad, fixed.reshape(-1).to(stat.dtype))
    return y, mean, mean_lo, rstd


def _layer_norm_fake(x, normalized_shape, weight, bias, eps):
    stats = tuple(x.shape[:x.dim() - len(normalized_shape)]) + (1,) * len(normalized_shape)
    return (torch.empty_like(x), *(x.new_empty(stats) for _ in range(3)))


def _layer_norm_backward(dy, x, normalized_shape, mean_hi, mean_lo, rstd, weight, bias,
                         output_mask):
    from ..norms._core import normalize_backward

    mask = [output_mask[0], output_mask[1] and weight is not None,
            output_mask[2] and bias is not None]
    mean = mean_hi + mean_lo
    dy = dy.contiguous()  # (x's layout: the compensated dx followed dy's strides)
    threshold = native.THRESHOLDS["layer_norm"]
    bad = None if native.well_conditioned(mean, rstd, threshold) else \
        native.ill_conditioned_rows(mean, rstd, threshold)
    if native.single_value(normalized_shape):
        bad = torch.arange(mean.numel(), device=x.device)  # (the compensated backward)
    if bad is None or bad.numel() < mean.numel():
        # the kernel's backward, the compensated rows' (if any) with a zero gradient,
        # then those rows' own from their statistics
        k = x.numel() // mean.numel()
        repair = None if bad is None else native.RowRepair(
            bad, k, x.reshape(-1, k).index_select(0, bad), *(
                t.reshape(-1, 1).index_select(0, bad) for t in (mean_hi, mean_lo, rstd)))
        grads = torch.ops.aten.native_layer_norm_backward(
            dy if repair is None else repair.zeroed(dy), x, normalized_shape, mean, rstd,
            weight, bias, mask)
        if repair is not None:
            grads = repair.patch(_masked(grads, mask), dy, weight, bias, mask)
    else:  # the compensated path's backward
        grads = normalize_backward(dy, x, weight, bias, mean_hi, mean_lo, rstd,
                                   _row_dims(x, normalized_shape), True, mask)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


def _masked(grads, mask) -> list:
    """A backward kernel's gradients, ``None`` where ``mask`` did not ask for one."""
    return [g if need else None for g, need in zip(grads, mask, strict=True)]


def _grads_fake(x, weight, bias, output_mask):
    return tuple(torch.empty_like(t) if need and t is not None else x.new_empty(0)
                 for t, need in zip((x, weight, bias), output_mask, strict=True))


def _register_with_statistics(name: str, forward, fake, backward) -> None:
    """Register ``normkit::<name>(x, meta, weight, bias, eps) -> (y, mean_hi, mean_lo,
    rstd)`` and ``normkit::<name>_backward(dy, x, meta, mean_hi, mean_lo, rstd, weight,
    bias, output_mask) -> (dx, dweight, dbias)`` (already defined): implementations,
    fake implementations and the autograd formula that links them."""
    _LIB.impl(name, forward, "CompositeExplicitAutograd")
    _LIB.impl(f"{name}_backward", backward, "CompositeExplicitAutograd")
    torch.library.register_fake(f"normkit::{name}", fake, lib=_LIB)
    torch.library.register_fake(
        f"normkit::{name}_backward",
        lambda dy, x, meta, mean_hi, mean_lo, rstd, weight, bias, output_mask: _grads_fake(
            x, weight, bias, output_mask), lib=_LIB)
    backward_op = getattr(torch.ops.normkit, f"{name}_backward")

    def setup_context(ctx, inputs, output):
        x, meta, weight, bias, _eps = inputs
        _, mean_hi, mean_lo, rstd = output
        ctx.save_for_backward(x, mean_hi, mean_lo, rstd, weight, bias)
        ctx.meta = meta
        ctx.mark_non_differentiable(mean_hi, mean_lo, rstd)

    def autograd_backward(ctx, dy, *_stat_grads):
        x, mean_hi, mean_lo, rstd, weight, bias = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        dx, dw, db = backward_op(dy, x, ctx.meta, mean_hi, mean_lo, rstd, weight, bias, mask)
        return (dx if mask[0] else None, None, dw if mask[1] else None,
                db if mask[2] else None, None)

    torch.library.register_autograd(f"normkit::{name}", autograd_backward,
                                    setup_context=setup_context, lib=_LIB)


_register_with_statistics("layer_norm", _layer_norm, _layer_norm_fake, _layer_norm_backward)


# --------------------------------------------------------------------------- GroupNorm
#
# normkit::group_norm(x, num_groups, weight, bias, eps) -> (y, mean_hi, mean_lo, rstd),
# statistics (N, G). The eager choice, made once in the forward:
#   NCHW: torch's kernel (ratio <= 32), else the compensated path;
#   channels-last: torch's kernel (fewer than channels.GROUP_NORM_MIN_POSITIONS
#   positions, ratio <= 2), the slice-sums engine (from there up, where it serves,
#   ratio <= 2), else the compensated path on an NCHW copy (mean as a hi/lo pair).
# The backward operator takes the matching explicit backward -- torch's GroupNorm backward
# kernel, channels.backward, normalize_backward -- from the saved statistics: no autograd
# inside an operator, so it also runs under dispatch modes (opcheck, FlopCounterMode).
# (Given accurate statistics with ratio <= 2, each of the first two is accurate; the
# backward re-checks the ratio on the statistics it receives.)

_LIB.define("group_norm(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define("group_norm_backward(Tensor dy, Tensor x, int num_groups, Tensor mean_hi, "
            "Tensor mean_lo, Tensor rstd, Tensor? weight, Tensor? bias, bool[3] output_mask) "
            "-> (Tensor, Tensor, Tensor)")


def _channels_last_format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def _grouped_view(x: Tensor, groups: int) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(N, G, C/G, *)`` view of NCHW ``x``, its reduced dims and the parameters' view."""
    grouped = x.unflatten(1, (groups, x.shape[1] // groups))
    pview = (1, groups, x.shape[1] // groups) + (1,) * (x.dim() - 2)
    return grouped, tuple(range(2, grouped.dim())), pview


def _view(t: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    return None if t is None else t.view(shape)


def _layout(x: Tensor) -> torch.memory_format:
    return torch.contiguous_format if x.is_contiguous() else _channels_last_format(x)


def _group_bound(x: Tensor) -> float:
    """The ratio bound of torch's GroupNorm kernel for ``x``'s layout (native.THRESHOLDS,
    channels.RATIO)."""
    return native.THRESHOLDS["group_norm"] if x.is_contiguous() else channels.RATIO


def _group_norm_forward(x, num_groups, weight, bias, eps):
    from ..norms._core import normalize_forward

    n, c = x.shape[:2]
    positions, cpg = x[0, 0].numel(), c // num_groups
    zeros = x.new_zeros(n, num_groups)
    if x.is_contiguous():  # NCHW: torch's kernel, whose error stays small here
        y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, positions, num_groups,
                                                eps)
        if native.well_conditioned(mean, rstd, _group_bound(x)):
            return y, mean, zeros, rstd
        bad = native.ill_conditioned_rows(mean, rstd, _group_bound(x))
        if bad.numel() < mean.numel():
            # the groups past the bound by the compensated core, as in eager mode
            # (native.group_norm): their statistics replace the kernel's
            repair = native.RowRepair.apply(y, x, x.numel() // mean.numel(), bad, weight,
                                            bias, eps, groups=num_groups)
            for stat, fixed in ((mean, repair.mean_hi), (zeros, repair.mean_lo),
                                (rstd, repair.rstd)):
                stat.view(-1).index_copy_(0, bad, fixed.reshape(-1).to(stat.dtype))
            return y, mean, zeros, rstd
    elif positions < channels.GROUP_NORM_MIN_POSITIONS:
        y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, positions, num_groups,
                                                eps)
        bad = native.rows_past(mean, rstd, channels.RATIO)
        if bad is None:
            return y, mean, zeros, rstd
        if _repairs(bad, mean):  # (as in eager mode: functional._group_norm_channels_last)
            return _repaired(y, x, bad, mean, zeros, rstd, weight, bias, eps, num_groups)
    elif channels.supports(x, weight, bias):
        stats = channels.group_moments(x, channels.Pool("group", num_groups), eps)
        if stats is not None:
            mean, _, rstd, bad = stats  # (N, C): each group's value repeated over its channels
            y = channels.affine(x, mean, rstd, weight, bias)
            mean, rstd = mean[:, ::cpg].contiguous(), rstd[:, ::cpg].contiguous()
            if bad is None:
                return y, mean, zeros, rstd
            return _repaired(y, x, bad, mean, zeros, rstd, weight, bias, eps, num_groups)
    grouped, dims, pview = _grouped_view(x.contiguous(), num_groups)
    y, mean_hi, mean_lo, _, rstd = normalize_forward(grouped, dims, _view(weight, pview),
                                                     _view(bias, pview), eps)
    y = y.flatten(1, 2).contiguous(memory_format=_layout(x))
    return (y, *(t.reshape(n, num_groups).to(x.dtype) for t in (mean_hi, mean_lo, rstd)))


def _repairs(bad: Tensor, mean: Tensor) -> bool:
    """Whether channels-last GroupNorm renormalizes groups ``bad`` one by one rather than
    taking the compensated path for the whole call (``channels.REPAIR_MAX_SHARE``)."""
    return bad.numel() <= channels.REPAIR_MAX_SHARE * mean.numel()


def _repaired(y, x, bad, mean, mean_lo, rstd, weight, bias, eps, num_groups):
    """The forward's result with the channels-last groups ``bad`` renormalized by the
    compensated core (:class:`~normkit.kernels.native.RowRepair`) and their compensated
    statistics in the ``(N, G)`` outputs, from which the backward finds them again."""
    repair = native.RowRepair.apply(y, x, x.numel() // mean.numel(), bad, weight, bias, eps,
                                    groups=num_groups)
    for stat, fixed in ((mean, repair.mean_hi), (mean_lo, repair.mean_lo),
                        (rstd, repair.rstd)):
        stat.view(-1).index_copy_(0, bad, fixed.reshape(-1).to(stat.dtype))
    return y, mean, mean_lo, rstd


def _group_norm_forward_fake(x, num_groups, weight, bias, eps):
    stats = tuple(x.new_empty(x.shape[0], num_groups) for _ in range(3))
    return (torch.empty_like(x), *stats)


def _group_norm_backward(dy, x, num_groups, mean_hi, mean_lo, rstd, weight, bias,
                         output_mask):
    from ..norms._core import normalize_backward

    n, c = x.shape[:2]
    positions, cpg = x[0, 0].numel(), c // num_groups
    mean = mean_hi + mean_lo
    mask = [output_mask[0], output_mask[1] and weight is not None,
            output_mask[2] and bias is not None]
    accurate = native.well_conditioned(mean, rstd, _group_bound(x))
    layout = _layout(x)
    # (dy in x's layout: every branch returns dx in it, as the fake implementation says;
    # the engine's dx followed dy's layout)
    dy = dy.contiguous(memory_format=layout)
    bad = None if accurate else native.ill_conditioned_rows(mean, rstd, _group_bound(x))
    engine = not x.is_contiguous() and positions >= channels.GROUP_NORM_MIN_POSITIONS
    if bad is not None and bad.numel() < mean.numel() and (
            x.is_contiguous() or (_repairs(bad, mean) and (
                not engine or channels.supports(x, weight, bias)))):
        # repaired groups (as the forward found them from its statistics): the kernel's
        # (engine's) backward without them, then theirs from their compensated statistics
        k = x.numel() // mean.numel()
        repair = native.RowRepair(bad, k, None, *(t.reshape(-1, 1).index_select(0, bad)
                                                  for t in (mean_hi, mean_lo, rstd)),
                                  groups=num_groups, layout=layout)
        repair.rows = repair._take(x)
        if engine:
            pool = channels.Pool("group", num_groups)
            grads = channels.repaired_backward(
                repair, dy, x, mean.repeat_interleave(cpg, 1), rstd.repeat_interleave(cpg, 1),
                weight, bias, pool, mask)
        else:
            grads = native.group_norm_backward(repair.zeroed(dy), x, mean, rstd, weight, n,
                                               c, positions, num_groups, mask)
            grads = repair.patch(_masked(grads, mask), dy, weight, bias, mask)
    elif accurate and (x.is_contiguous() or positions < channels.GROUP_NORM_MIN_POSITIONS):
        grads = native.group_norm_backward(
            dy.contiguous(memory_format=layout), x, mean, rstd, weight, n, c, positions,
            num_groups, mask)
    elif accurate and channels.supports(x, weight, bias):
        grads = channels.backward(dy, x, mean.repeat_interleave(cpg, 1),
                                  rstd.repeat_interleave(cpg, 1), weight,
                                  channels.Pool("group", num_groups), mask)
    else:  # the compensated path's backward, on NCHW copies
        grouped, dims, pview = _grouped_view(x.contiguous(), num_groups)
        stat_view = (n, num_groups) + (1,) * len(dims)
        dx, dw, db = normalize_backward(
            dy.contiguous().view(grouped.shape), grouped, _view(weight, pview),
            _view(bias, pview), mean_hi.view(stat_view), mean_lo.view(stat_view),
            rstd.view(stat_view), dims, True, mask)
        grads = (None if dx is None else dx.flatten(1, 2).contiguous(memory_format=layout),
                 None if dw is None else dw.view(c), None if db is None else db.view(c))
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


_register_with_statistics("group_norm", _group_norm_forward, _group_norm_forward_fake,
                          _group_norm_backward)


# ------------------------------------------- channels-last BatchNorm, training mode
#
# normkit::batch_norm_train(x, weight, bias, eps) -> (y, mean_hi, mean_lo, rstd, var),
# per-channel statistics, ``var`` biased (the caller updates its running statistics from
# mean_hi + mean_lo and var: an operator with a registered backward cannot mutate its
# inputs). The eager choice for channels-last input: torch's kernel up to
# native.CHANNELS_LAST_MAX_COUNT values per channel (ratio <= 2), the slice-sums engine
# beyond, else the compensated path. Backwards as for GroupNorm above.

_LIB.define("batch_norm_train(Tensor x, Tensor? weight, Tensor? bias, float eps) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define("batch_norm_train_backward(Tensor dy, Tensor x, Tensor mean_hi, Tensor mean_lo, "
            "Tensor rstd, Tensor? weight, float eps, bool[3] output_mask) "
            "-> (Tensor, Tensor, Tensor)")

_BATCH_DIMS = {3: (0, 2), 4: (0, 2, 3), 5: (0, 2, 3, 4)}


def _nchw_bound(x: Tensor, weight: Tensor | None) -> float:
    """The ratio bound of contiguous (NCHW) input's statistics: the slice-sums engine's
    (channels.RATIO) where it serves ``x``, torch's kernel's (native.THRESHOLDS) below."""
    return (channels.RATIO if channels.supports(x, weight)
            else native.THRESHOLDS["batch_norm"])


def _batch_norm_train(x, weight, bias, eps):
    from ..norms._core import normalize_forward

    c = x.shape[1]
    count = x.numel() // c
    zeros = x.new_zeros(c)
    # as in eager mode: on NCHW input the slice-sums engine (its sums contiguous, per
    # (n, c) slice; 2-3x faster than torch's kernel forward) and torch's kernel below its
    # size; on channels-last input torch's kernel up to CHANNELS_LAST_MAX_COUNT values per
    # channel, the engine beyond
    nchw = x.is_contiguous()
    if channels.supports(x, weight, bias) and (nchw or count > native.CHANNELS_LAST_MAX_COUNT):
        stats = channels.moments(x, channels.Pool("batch"), eps)
        if stats is not None:
            mean, var, rstd = stats  # (1, C)
            y = channels.affine(x, mean, rstd, weight, bias)
            return y, mean.view(c), zeros, rstd.view(c), var.view(c)
    elif nchw or count <= native.CHANNELS_LAST_MAX_COUNT:
        y, mean, rstd = torch.native_batch_norm(x, weight, bias, None, None, True, 0.0, eps)
        bound = native.THRESHOLDS["batch_norm" if nchw else "batch_norm_channels_last_train"]
        if native.well_conditioned(mean, rstd, bound):
            # the kernel's variance back from its rstd (float64: ~1e-7 relative), no pass
            var = (rstd.double().pow(-2) - eps).clamp_(min=0.0).to(x.dtype)
            return y, mean, zeros, rstd, var
    view = (1, c) + (1,) * (x.dim() - 2)
    y, mean_hi, mean_lo, var, rstd = normalize_forward(x, _BATCH_DIMS[x.dim()],
                                                       _view(weight, view), _view(bias, view),
                                                       eps)
    return (y, *(t.reshape(c).to(x.dtype) for t in (mean_hi, mean_lo, rstd, var)))


def _batch_norm_train_fake(x, weight, bias, eps):
    return (torch.empty_like(x), *(x.new_empty(x.shape[1]) for _ in range(4)))


def _batch_norm_train_backward(dy, x, mean_hi, mean_lo, rstd, weight, eps, output_mask):
    from ..norms._core import normalize_backward

    c = x.shape[1]
    count = x.numel() // c
    mean = mean_hi + mean_lo
    mask = [output_mask[0], output_mask[1] and weight is not None, output_mask[2]]
    nchw = x.is_contiguous()
    # (dy in x's layout: every branch returns dx in it, as the fake implementation says;
    # the engine's and the compensated path's dx followed dy's)
    dy = dy.contiguous(memory_format=torch.contiguous_format if nchw
                       else _channels_last_format(x))
    accurate = native.well_conditioned(
        mean, rstd, _nchw_bound(x, weight) if nchw
        else native.THRESHOLDS["batch_norm_channels_last_train"])
    if accurate and nchw:  # torch's backward kernel from the saved statistics
        grads = channels.backward(dy, x, mean.view(1, c), rstd.view(1, c), weight,
                                  channels.Pool("batch"), mask)
    elif accurate and count <= native.CHANNELS_LAST_MAX_COUNT:
        grads = torch.ops.aten.native_batch_norm_backward(
            dy.contiguous(memory_format=_channels_last_format(x)), x, weight, None, None,
            mean, rstd, True, eps, mask)
    elif accurate and channels.supports(x, weight):
        grads = channels.backward(dy, x, mean.view(1, c), rstd.view(1, c), weight,
                                  channels.Pool("batch"), mask)
    else:  # the compensated path's backward (dbias is sum dy, whatever the bias)
        view, dims = (1, c) + (1,) * (x.dim() - 2), _BATCH_DIMS[x.dim()]
        dx, dw, _ = normalize_backward(dy, x, _view(weight, view), None, mean_hi.view(view),
                                       mean_lo.view(view), rstd.view(view), dims, True,
                                       (mask[0], mask[1], False))
        db = dy.sum(dims).to(x.dtype) if mask[2] else None
        grads = (dx, None if dw is None else dw.view(c), db)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


def _batch_norm_train_backward_fake(dy, x, mean_hi, mean_lo, rstd, weight, eps, output_mask):
    c = x.shape[1]
    return (torch.empty_like(x) if output_mask[0] else x.new_empty(0),
            x.new_empty(c) if output_mask[1] and weight is not None else x.new_empty(0),
            x.new_empty(c) if output_mask[2] else x.new_empty(0))


_LIB.impl("batch_norm_train", _batch_norm_train, "CompositeExplicitAutograd")
_LIB.impl("batch_norm_train_backward", _batch_norm_train_backward, "CompositeExplicitAutograd")
torch.library.register_fake("normkit::batch_norm_train", _batch_norm_train_fake, lib=_LIB)
torch.library.register_fake("normkit::batch_norm_train_backward",
                            _batch_norm_train_backward_fake, lib=_LIB)


def _batch_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean_hi, mean_lo, rstd, var = output
    ctx.save_for_backward(x, mean_hi, mean_lo, rstd, weight)
    ctx.eps, ctx.has_bias = eps, bias is not None
    ctx.mark_non_differentiable(mean_hi, mean_lo, rstd, var)


def _batch_norm_autograd(ctx, dy, *_stat_grads):
    x, mean_hi, mean_lo, rstd, weight = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
            ctx.has_bias and ctx.needs_input_grad[2]]
    dx, dw, db = torch.ops.normkit.batch_norm_train_backward(dy, x, mean_hi, mean_lo, rstd,
                                                             weight, ctx.eps, mask)
    return (dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None, None)


torch.library.register_autograd("normkit::batch_norm_train", _batch_norm_autograd,
                                setup_context=_batch_norm_setup, lib=_LIB)


def batch_norm_train(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm through the ``normkit::batch_norm_train`` operator
    (arguments :func:`serves_batch_norm_train` accepts): ``(y, batch mean, biased batch
    variance)``; the running statistics are the caller's to update.

    Example:
        >>> x = torch.randn(8, 3, 4, 4).contiguous(memory_format=torch.channels_last)
        >>> y, mean, var = batch_norm_train(x, None, None, 1e-5)
        >>> torch.allclose(mean, x.mean((0, 2, 3)), atol=1e-6)
        True
        >>> torch.allclose(var, x.var((0, 2, 3), unbiased=False), atol=1e-5)
        True
    """
    y, mean_hi, mean_lo, _, var = torch.ops.normkit.batch_norm_train(x, weight, bias,
                                                                     float(eps))
    return y, mean_hi + mean_lo, var


def serves_group_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether ``normkit::group_norm`` serves these arguments: float32/float64 CPU input,
    contiguous or channels-last, parameters of its dtype.

    Example:
        >>> serves_group_norm(torch.randn(2, 4, 3, 3), None, None)
        True
        >>> serves_group_norm(torch.randn(2, 4, 3, 3).transpose(2, 3), None, None)
        False
    """
    return ((x.is_contiguous() and x.device.type == "cpu" and x.numel() > 0
             and x.dtype in (torch.float32, torch.float64)
             and all(p is None or (p.dtype == x.dtype and p.device == x.device)
                     for p in (weight, bias)))
            or serves_channels_last(x, weight, bias))


def serves_batch_norm_train(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether ``normkit::batch_norm_train`` serves these arguments: float32/float64 CPU
    input with one to three spatial dims, contiguous (NCL, NCHW, NCDHW) or channels-last,
    parameters of its dtype.

    Example:
        >>> serves_batch_norm_train(torch.randn(8, 4, 5, 5), None, None)
        True
        >>> serves_batch_norm_train(torch.randn(8, 4), None, None)  # (rows: reference math)
        False
    """
    return ((x.dim() in _BATCH_DIMS and x.is_contiguous() and x.device.type == "cpu"
             and x.numel() > 0 and x.dtype in (torch.float32, torch.float64)
             and all(p is None or (p.dtype == x.dtype and p.device == x.device)
                     for p in (weight, bias)))
            or serves_channels_last(x, weight, bias))


def serves_channels_last(x: Tensor, *params: Tensor | None) -> bool:
    """Whether the channels-last operators serve these arguments: float32/float64 CPU
    input in channels_last (4D) or channels_last_3d (5D) memory format (and not also
    NCHW-contiguous), parameters of its dtype.

    Example:
        >>> x = torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)
        >>> serves_channels_last(x), serves_channels_last(x.contiguous())
        (True, False)
    """
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return (layout is not None and x.device.type == "cpu" and x.numel() > 0
            and x.dtype in (torch.float32, torch.float64)
            and x.is_contiguous(memory_format=layout) and not x.is_contiguous()
            and all(p is None or (p.dtype == x.dtype and p.device == x.device)
                    for p in params))


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None,
               eps: float) -> Tensor:
    """GroupNorm through the ``normkit::group_norm`` operator (what ``torch.compile``
    records for a CPU normkit GroupNorm).

    Example:
        >>> x = torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last)
        >>> y = group_norm(x, 2, None, None, 1e-5)
        >>> torch.allclose(y, torch.nn.functional.group_norm(x, 2), atol=1e-5)
        True
    """
    return torch.ops.normkit.group_norm(x, int(num_groups), weight, bias, float(eps))[0]


def serves_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether :func:`layer_norm` serves these arguments: contiguous float32/float64 CPU
    input, parameters of its dtype.

    Example:
        >>> serves_layer_norm(torch.randn(2, 3), None, None)
        True
        >>> serves_layer_norm(torch.randn(2, 3, dtype=torch.bfloat16), None, None)
        False
    """
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and x.numel() > 0 and x.is_contiguous()
            and all(p is None or (p.dtype == x.dtype and p.device == x.device)
                    for p in (weight, bias)))


def layer_norm(x: Tensor, normalized_shape: tuple[int, ...], weight: Tensor | None,
               bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm through the ``normkit::layer_norm`` operator (what ``torch.compile``
    records for a CPU normkit LayerNorm).

    Example:
        >>> x = torch.randn(3, 5) + 1e5          # past torch's kernel bound: compensated
        >>> y = layer_norm(x, (5,), None, None, 1e-5)
        >>> ref = torch.nn.functional.layer_norm(x.double(), (5,))
        >>> float((y.double() - ref).abs().max()) < 1e-4
        True
    """
    return torch.ops.normkit.layer_norm(x, list(normalized_shape), weight, bias, eps)[0]


_LIB.define("snapshot(Tensor x) -> Tensor")
_LIB.impl("snapshot", lambda x: x.clone(), "CompositeExplicitAutograd")
torch.library.register_fake("normkit::snapshot", lambda x: torch.empty_like(x), lib=_LIB)
torch.library.register_autograd("normkit::snapshot", lambda ctx, grad: grad, lib=_LIB)


def snapshot(x: Tensor) -> Tensor:
    """A copy of ``x`` as it is now, through the opaque ``normkit::snapshot`` operator:
    under ``torch.compile``, what a layer reads from a buffer it then updates in place
    in the same forward, where the backward needs what was read (BatchRenorm's r and
    d, PowerNorm's running quadratic mean).

    torch's AOTAutograd (2.13) may hand the backward the buffer itself and recompute
    from it what the forward computed, after the forward's in-place update: silently
    wrong gradients (pytorch pull request 197039, "Don't recompute reads of mutated
    inputs or mutable buffers"). A ``clone`` or a reduction does not stop it (measured:
    the compiler sees through both); a copy made by an operator it cannot look into
    is what the backward then reads.

    Example:
        >>> buffer = torch.ones(3)
        >>> copy = snapshot(buffer)
        >>> _ = buffer.add_(1)
        >>> copy
        tensor([1., 1., 1.])
    """
    return torch.ops.normkit.snapshot(x)
