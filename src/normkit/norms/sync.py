"""SyncBatchNorm over any torch.distributed backend (gloo on CPU included).

torch's ``SyncBatchNorm`` refuses CPU tensors whenever it has to synchronize
("expected input tensor to be on GPU"), so it cannot run, or be tested, on a CPU
cluster. normkit's pools the per-rank statistics with collectives that every backend
has (``all_gather`` in forward, ``all_reduce`` in backward), weighted by each rank's
element count, so uneven and empty per-rank batches give exactly the statistics of the
concatenated batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.fx import Proxy
from torch.nn.utils import parametrize

from .. import _stats
from .. import functional as F
from .._surgery import (
    keep_activation,
    layers_named,
    move_parametrizations,
    refuse_own_forwards,
    replace_modules,
    replace_naming_the_rest,
)
from ._base import fx_leaf
from .batch import (
    BatchNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    _BatchNormForward,
)

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm",
           "sync_moments"]


def _group_or_world(process_group):
    return dist.group.WORLD if process_group is None else process_group


def _check_same_channels(channels: int, group, who: str, device) -> None:
    """All ranks must agree on C; every rank raises the same error otherwise (no hang)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([channels], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    counts = [int(t) for t in gathered]
    if len(set(counts)) > 1:
        raise ValueError(
            f"{who} expected every rank of the process group to have the same number of "
            f"channels, got channels per rank {counts}"
        )


def sync_moments(count: Tensor, mean: Tensor, m2: Tensor, group=None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Merge per-rank ``(count, mean, M2)`` into the statistics of all ranks' data.

    Every rank passes its own per-feature statistics (float64 recommended; ``count``
    may be a scalar or per feature, and may be zero); every rank gets back the same
    pooled ``(count, mean, M2)``, merged in rank order with
    :func:`normkit._stats.merge_moments`, so the result is identical on all ranks.
    Outside an initialized process group (or with one rank) the input is returned.

    Example:
        >>> n, mean, m2 = sync_moments(torch.tensor(4.0), torch.zeros(2), torch.ones(2))
        >>> float(n), mean.tolist(), m2.tolist()
        (4.0, [0.0, 0.0], [1.0, 1.0])
    """
    if not (dist.is_available() and dist.is_initialized()):
        return count, mean, m2
    group = _group_or_world(group)
    world = dist.get_world_size(group)
    if world == 1:
        return count, mean, m2
    count = count.expand_as(mean) if count.dim() == 0 else count
    packed = torch.cat([count.reshape(-1), mean.reshape(-1), m2.reshape(-1)]).to(torch.float64)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=group)
    size = mean.numel()
    total_n, total_mean, total_m2 = (torch.zeros(size, dtype=torch.float64, device=mean.device)
                                     for _ in range(3))
    for part in gathered:
        n, mu, sq = part[:size], part[size:2 * size], part[2 * size:]
        total_n, total_mean, total_m2 = _stats.merge_moments(total_n, total_mean, total_m2,
                                                             n, mu, sq)
    shape = mean.shape
    return total_n.view(shape), total_mean.view(shape), total_m2.view(shape)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: pooled statistics via all_gather. Backward: two pooled sums via all_reduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, unbiased,
                group, who):
        channels = x.shape[1]
        _check_same_channels(channels, group, who, x.device)
        dims = (0, *range(2, x.dim()))
        view = (1, channels) + (1,) * (x.dim() - 2)
        count = _stats.reduced_count(x.shape, dims)
        xc = _stats.upcast(x)
        if count > 0:
            m = _stats.moments(xc, dims)
            local_mean = m.mean_hi.double() + m.mean_lo.double()
            local_m2 = m.var.double() * count
        else:
            local_mean = torch.zeros(view, dtype=torch.float64, device=x.device)
            local_m2 = torch.zeros_like(local_mean)
        n, mean, m2 = sync_moments(torch.tensor(float(count), dtype=torch.float64,
                                                device=x.device),
                                   local_mean.view(-1), local_m2.view(-1), group)
        total = int(round(float(n[0])))
        var = m2 / max(total, 1)
        if total > 0 and running_mean is not None:
            _stats.update_running_(running_mean, mean, momentum)
        if total > 0 and running_var is not None:
            _stats.update_running_(running_var,
                                   _stats.unbiased_var(var, total) if unbiased else var,
                                   momentum)
        # the float64 mean as a float32 pair, so x - mean keeps its digits
        mean_hi = mean.to(xc.dtype)
        mean_lo = (mean - mean_hi.double()).to(xc.dtype)
        rstd = torch.rsqrt(var + eps).to(xc.dtype)
        mean_hi, mean_lo, rstd = mean_hi.view(view), mean_lo.view(view), rstd.view(view)
        y = (xc - mean_hi).sub_(mean_lo).mul_(rstd)
        if weight is not None:
            y.mul_(weight.view(view))
        if bias is not None:
            y.add_(bias.view(view))
        ctx.save_for_backward(x, weight, mean_hi, mean_lo, rstd)
        ctx.total, ctx.group, ctx.dims, ctx.has_bias = total, group, dims, bias is not None
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, mean_hi, mean_lo, rstd = ctx.saved_tensors
        dims = ctx.dims
        xhat = (_stats.upcast(x) - mean_hi).sub_(mean_lo).mul_(rstd)
        g = _stats.upcast(dy)
        # (2, C): the local sums every rank contributes, pooled over the group
        sums = torch.stack([g.sum(dims), (g * xhat).sum(dims)])
        local_dbias, local_dweight = sums[0].clone(), sums[1].clone()
        dist.all_reduce(sums, group=ctx.group)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            view = rstd.shape
            total = max(ctx.total, 1)
            mean_g = (sums[0] / total).view(view)
            mean_gx = (sums[1] / total).view(view)
            scale = rstd if weight is None else rstd * weight.view(view)
            dx = (g - mean_g - xhat * mean_gx).mul_(scale).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            dw = local_dweight.to(weight.dtype)  # local: DDP all-reduces parameter grads
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = local_dbias.to(dy.dtype if weight is None else weight.dtype)
        return dx, dw, db, None, None, None, None, None, None, None


class SyncBatchNorm(_BatchNormForward, nn.SyncBatchNorm):
    r"""Batch Normalization with statistics pooled across the ranks of a process group.

    A drop-in subclass of :class:`torch.nn.SyncBatchNorm` (same constructor, state and
    ``isinstance``) that works on every torch.distributed backend, gloo on CPU included.
    In training inside an initialized process group of more than one rank, the
    per-channel statistics are the count-weighted pool of every rank's batch: forward
    output, input gradients, the all-reduced weight/bias gradients and the running
    statistics equal single-process BatchNorm on the concatenated batch, also with
    uneven batch sizes and with ranks whose batch is empty (such a rank must still run
    forward and backward, as every rank must for any collective). Outside a process
    group, with one rank, or in eval it is plain BatchNorm. Ranks that disagree on the
    channel count all raise the same ``ValueError`` instead of hanging.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        momentum: running-average factor, or ``None`` (cumulative). Default: ``0.1``.
        affine: learnable ``weight`` and ``bias``. Default: ``True``.
        track_running_stats: keep running statistics. Default: ``True``.
        process_group: the group to synchronize over (``None``: the default group).
        unbiased_running_var: see :class:`normkit.BatchNorm2d`. Default: ``True``.

    Shape:
        - Input: :math:`(N, C, *)`; output: same.

    Example:
        >>> import torch, normkit
        >>> sbn = normkit.SyncBatchNorm(4)     # no process group here: plain BatchNorm
        >>> sbn(torch.randn(8, 4, 3)).shape
        torch.Size([8, 4, 3])
    """

    _ndims = ()
    _shape_doc = "(N, C, *)"

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """normkit's :func:`convert_sync_batchnorm` (returns a converted copy).

        Overrides torch's classmethod, which would build ``torch.nn.SyncBatchNorm``
        layers (CPU-incapable) and convert in place.
        """
        return convert_sync_batchnorm(module, process_group)

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        self._check_input_dim(input)
        running_mean, running_var, use_batch_stats, factor = self._step_arguments()
        group = _group_or_world(self.process_group)
        need_sync = (use_batch_stats and self.training and dist.is_available()
                     and dist.is_initialized() and dist.get_world_size(group) > 1)
        if not need_sync:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps,
                                unbiased_running_var=self.unbiased_running_var,
                                backend=self.backend)
        if self.eps <= 0.0:
            raise ValueError(f"{type(self).__name__} eps must be positive during training, "
                             f"but got {self.eps}")
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor,
                                            self.unbiased_running_var, group,
                                            type(self).__name__)


_BN_TYPES = (nn.modules.batchnorm._BatchNorm,)


def _is_plain_batchnorm(module: nn.Module) -> bool:
    from .batch import _BatchRenormForward

    return isinstance(module, _BN_TYPES) and not isinstance(module, _BatchRenormForward)


def _transfer(src: nn.Module, dst: nn.Module) -> nn.Module:
    """Copy parameters (as the same Parameter objects' data), buffers and mode; move
    parametrizations (``torch.nn.utils.parametrize``) over, originals and all."""
    with torch.no_grad():
        if src.affine:
            if not parametrize.is_parametrized(src, "weight"):
                dst.weight = nn.Parameter(src.weight.detach().clone(),
                                          requires_grad=src.weight.requires_grad)
            if parametrize.is_parametrized(src, "bias"):
                pass
            elif src.bias is not None:
                dst.bias = nn.Parameter(src.bias.detach().clone(),
                                        requires_grad=src.bias.requires_grad)
            else:
                dst.register_parameter("bias", None)
        if src.track_running_stats:
            dst.running_mean = src.running_mean.detach().clone()
            dst.running_var = src.running_var.detach().clone()
            dst.num_batches_tracked = src.num_batches_tracked.detach().clone()
    move_parametrizations(src, dst)
    dst.train(src.training)
    for attr in ("backend", "unbiased_running_var"):
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))
    return dst


def convert_sync_batchnorm(model: nn.Module, process_group=None, *, where=None) -> nn.Module:
    """A copy of ``model`` with every BatchNorm (torch or normkit) as normkit.SyncBatchNorm.

    The caller's model is not modified. Parameters, buffers, ``momentum``, ``eps`` and
    the train/eval mode carry over. BatchRenorm layers are left alone (their statistics
    are not BatchNorm's); FrozenBatchNorm has no batch statistics to synchronize. The
    activation of :class:`normkit.BatchNormAct2d` (and 1d/3d) stays, after the
    SyncBatchNorm (an ``nn.Sequential`` of the two); a subclass of torch's BatchNorm with
    a forward of its own (timm's ``BatchNormAct2d``) raises a ValueError naming it
    rather than losing what its forward adds. ``where(name, module) -> bool`` selects the
    layers (default: every BatchNorm), e.g. to leave such subclasses out.

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> synced = normkit.convert_sync_batchnorm(net)
        >>> type(synced[1]).__name__, type(net[1]).__name__
        ('SyncBatchNorm', 'BatchNorm2d')
    """
    def build(bn):
        ref = bn.running_mean if bn.running_mean is not None else bn.weight
        kw = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
        sync = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine,
                             bn.track_running_stats, process_group, **kw)
        return _transfer(bn, sync)

    def match(name, module):
        return (_is_plain_batchnorm(module) and not isinstance(module, SyncBatchNorm)
                and (where is None or bool(where(name, module))))

    refuse_own_forwards(model, match, "convert_sync_batchnorm", with_names=True,
                        hint="; leave them out with normkit.convert_sync_batchnorm(..., where=...)")
    unsynced = _unsynced_batch_statistics(model, where)
    return replace_naming_the_rest(
        model, match, lambda name, bn: keep_activation(bn, build(bn)),
        "BatchNorm layers" + ("" if where is None else " selected by where"),
        "convert_sync_batchnorm", unsynced,
        f"convert_sync_batchnorm found no BatchNorm to synchronize in the "
        f"{type(model).__name__}; its {unsynced} have batch statistics that normkit has no "
        f"synchronized version of: under DistributedDataParallel they stay each process's",
        f"convert_sync_batchnorm left {unsynced} as they are: normkit has no synchronized "
        f"version of them, so under DistributedDataParallel their batch statistics stay "
        f"each process's (pass where= to silence this by leaving them out of the selection)")


def _unsynced_batch_statistics(model: nn.Module, where) -> str:
    """The layers with batch statistics that :func:`convert_sync_batchnorm` cannot
    synchronize (Batch Renormalization, mean-only BatchNorm, PowerNorm), as
    ``'name' (Class), ...``; empty when none (or none that ``where`` selects)."""
    from .batch import _BatchRenormForward
    from .mean_only import _MeanOnlyBatchNorm
    from .power import PowerNorm

    return layers_named(model, (_BatchRenormForward, _MeanOnlyBatchNorm, PowerNorm), where)


def revert_sync_batchnorm(model: nn.Module, cls: type[nn.Module] = BatchNorm) -> nn.Module:
    """A copy of ``model`` with every SyncBatchNorm (torch or normkit) as a plain BatchNorm.

    SyncBatchNorm does not know the rank of its input, so the default target is
    :class:`normkit.BatchNorm` (any ``(N, C, *)``); pass ``cls=normkit.BatchNorm2d`` for a
    rank-checking class. The caller's model is not modified.

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(normkit.SyncBatchNorm(4))
        >>> type(normkit.revert_sync_batchnorm(net)[0]).__name__
        'BatchNorm'
    """
    if cls not in (BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d) and not (
            isinstance(cls, type) and issubclass(cls, nn.modules.batchnorm._BatchNorm)):
        raise ValueError(f"expected a BatchNorm class for cls, got {cls!r}")

    def build(sync):
        ref = sync.running_mean if sync.running_mean is not None else sync.weight
        kw = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
        bn = cls(sync.num_features, sync.eps, sync.momentum, sync.affine,
                 sync.track_running_stats, **kw)
        return _transfer(sync, bn)

    def match(module):
        return isinstance(module, nn.SyncBatchNorm)

    refuse_own_forwards(model, match, "revert_sync_batchnorm")
    return replace_modules(model, match, build, "SyncBatchNorm layers",
                           tool="revert_sync_batchnorm")
