"""Precise (population) BatchNorm statistics: exact pooled moments over many batches."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from .. import _stats
from ..norms.batch import FrozenBatchNorm
from ..norms.sync import sync_moments

__all__ = ["update_bn_stats", "default_forward"]


def default_forward(model: nn.Module, batch):
    """How :func:`update_bn_stats` calls the model on a batch unless told otherwise.

    A tensor is passed as is, a tuple or list passes its first element (``(x, y)``
    batches), a mapping is passed as keyword arguments.

    Example:
        >>> import torch
        >>> default_forward(torch.nn.Identity(), (torch.ones(1), torch.zeros(1)))
        tensor([1.])
    """
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    if isinstance(batch, Mapping):
        return model(**batch)
    raise TypeError(
        f"update_bn_stats cannot call the model on a {type(batch).__name__} batch; expected "
        "a tensor, a tuple/list (first element is the input) or a mapping, or pass forward="
    )


def _batch_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and not isinstance(m, FrozenBatchNorm)]


@torch.no_grad()
def update_bn_stats(
    model: nn.Module,
    batches: Iterable,
    num_batches: int | None = None,
    forward: Callable[[nn.Module, object], object] | None = None,
    *,
    process_group=None,
) -> dict[str, int]:
    """Set every BatchNorm's running statistics to the exact statistics over ``batches``.

    Inference should normalize with the statistics of the data, not with an exponential
    average of batch statistics taken while the weights were still moving. This runs
    the model over the batches with its BatchNorm layers using batch statistics (as in
    training) and records, for each layer, the count-weighted pooled mean and variance
    of its input over all batches (Chan et al. merge in float64; the pooled variance,
    not an average of per-batch variances as fvcore and ``swa_utils.update_bn`` do).
    ``running_var`` receives the unbiased pooled variance (the biased one for layers
    with ``unbiased_running_var=False``).

    Only the BatchNorm layers are switched to training mode: dropout and every other
    module keep their mode. Momentum, mode and ``num_batches_tracked`` are restored
    afterwards. Inside an initialized process group of several ranks (or with
    ``process_group``), the statistics are pooled across ranks, so every rank ends with
    those of all ranks' batches.

    Args:
        model: the model; its BatchNorm layers must track running statistics.
        batches: an iterable of batches (tensors, tuples or dicts; e.g. a DataLoader).
        num_batches: use at most this many batches. Default: all.
        forward: ``forward(model, batch)`` runs the model on a batch. Default:
            :func:`default_forward`.
        process_group: pool across this group's ranks. Default: the default group when
            torch.distributed is initialized, else no pooling.

    Returns:
        ``{layer name: number of values per channel its statistics came from}``.

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), normkit.BatchNorm1d(3)).eval()
        >>> data = [torch.randn(16, 4) + 5 for _ in range(4)]
        >>> normkit.update_bn_stats(net, data)
        {'1': 64}
        >>> bool(net.training), net[1].momentum
        (False, 0.1)
    """
    layers = _batch_norms(model)
    if not layers:
        raise ValueError(
            f"update_bn_stats expected a model with BatchNorm layers that track running "
            f"statistics, got a {type(model).__name__} without any"
        )
    if num_batches is not None and num_batches <= 0:
        raise ValueError(f"num_batches must be positive or None, got {num_batches}")
    forward = default_forward if forward is None else forward
    pooled: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {
        m: None for _, m in layers}

    def record(module, args):
        x = args[0]
        dims = (0, *range(2, x.dim()))
        count = _stats.reduced_count(x.shape, dims)
        if count == 0:
            return
        m = _stats.moments(_stats.upcast(x.detach()), dims)
        stats = (torch.full((x.shape[1],), float(count), dtype=torch.float64, device=x.device),
                 (m.mean_hi.double() + m.mean_lo.double()).view(-1),
                 (m.var.double() * count).view(-1))
        previous = pooled[module]
        pooled[module] = stats if previous is None else _stats.merge_moments(*previous, *stats)

    saved = {m: (m.momentum, m.training, m.num_batches_tracked.clone()
                 if m.num_batches_tracked is not None else None) for _, m in layers}
    hooks = [m.register_forward_pre_hook(record) for _, m in layers]
    used = 0
    try:
        for _, m in layers:
            m.train()
            m.momentum = 0.0  # the running statistics stay put until the exact ones are in
        for batch in batches:
            if num_batches is not None and used >= num_batches:
                break
            forward(model, batch)
            used += 1
    finally:
        for hook in hooks:
            hook.remove()
        for m, (momentum, training, tracked) in saved.items():
            m.momentum = momentum
            m.train(training)
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)
    if used == 0:
        raise ValueError("update_bn_stats expected at least one batch, got none")
    counts = {}
    for name, m in layers:
        stats = pooled[m]
        if stats is None:
            stats = tuple(torch.zeros(m.num_features, dtype=torch.float64,
                                      device=m.running_mean.device) for _ in range(3))
        n, mean, m2 = sync_moments(*stats, process_group)
        total = int(round(float(n[0])))
        counts[name] = total
        if total == 0:
            warnings.warn(f"update_bn_stats: layer {name!r} saw no data; its running "
                          "statistics are unchanged", stacklevel=2)
            continue
        var = m2 / total
        if getattr(m, "unbiased_running_var", True):
            var = _stats.unbiased_var(var, total)
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)
    return counts
