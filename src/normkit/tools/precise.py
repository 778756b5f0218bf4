"""Precise (population) BatchNorm statistics: exact pooled moments over many batches."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from .. import _stats
from ..norms.batch import FrozenBatchNorm
from ..norms.mean_only import _MeanOnlyBatchNorm
from ..norms.power import PowerNorm
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


def _running_layers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(name, layer, kind)`` of the layers keeping running statistics that a training
    forward computes: ``"bn"`` (torch's and normkit's BatchNorm family), ``"mean"``
    (MeanOnlyBatchNorm: a running mean), ``"power"`` (PowerNorm: a running mean
    square). FrozenBatchNorm's statistics are fixed by design."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, PowerNorm):
            found.append((name, m, "power"))
        elif (isinstance(m, (nn.modules.batchnorm._BatchNorm, _MeanOnlyBatchNorm))
              and not isinstance(m, FrozenBatchNorm) and m.track_running_stats
              and m.running_mean is not None):
            found.append((name, m, "mean" if isinstance(m, _MeanOnlyBatchNorm) else "bn"))
    return found


@torch.no_grad()
def update_bn_stats(
    model: nn.Module,
    batches: Iterable,
    num_batches: int | None = None,
    forward: Callable[[nn.Module, object], object] | None = None,
    *,
    process_group=None,
) -> dict[str, int]:
    """Set every BatchNorm's running statistics to the exact statistics over ``batches``
    (and MeanOnlyBatchNorm's running mean, PowerNorm's running mean square).

    Inference should normalize with the statistics of the data, not with an exponential
    average of batch statistics taken while the weights were still moving. This runs
    the model over the batches with its BatchNorm layers using batch statistics (as in
    training) and records, for each layer, the count-weighted pooled mean and variance
    of its input over all batches (Chan et al. merge in float64; the pooled variance,
    not an average of per-batch variances as fvcore and ``swa_utils.update_bn`` do).
    ``running_var`` receives the unbiased pooled variance (the biased one for layers
    with ``unbiased_running_var=False``). A :class:`normkit.PowerNorm` gets the pooled
    mean square of its (group-scaled) input over every counted token -- padding left
    out as its forward leaves it out -- in ``running_phi``, where training leaves an
    average of its last ~``1 / (1 - alpha_fwd)`` batches; during the passes it normalizes
    by each batch's statistic, as BatchNorm does. A :class:`normkit.MeanOnlyBatchNorm1d`
    (2d) gets the pooled mean.

    Only these layers are switched to training mode: dropout and every other module
    keep their mode. Momentum, mode and ``num_batches_tracked`` are restored afterwards
    (PowerNorm's ``ema_gz`` is not touched: no backward runs). Inside an initialized
    process group of several ranks (or with ``process_group``), the statistics are
    pooled across ranks, so every rank ends with those of all ranks' batches.

    Args:
        model: the model; at least one of its BatchNorm (or MeanOnlyBatchNorm) layers
            must track running statistics, or it holds a PowerNorm.
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
    layers = _running_layers(model)
    if not layers:
        raise ValueError(
            f"update_bn_stats expected a model with BatchNorm layers that track running "
            f"statistics (or MeanOnlyBatchNorm, PowerNorm), got a {type(model).__name__} "
            f"without any"
        )
    if num_batches is not None and num_batches <= 0:
        raise ValueError(f"num_batches must be positive or None, got {num_batches}")
    forward = default_forward if forward is None else forward
    pooled: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {
        m: None for _, m, _ in layers}

    def pool(module, stats):
        previous = pooled[module]
        pooled[module] = stats if previous is None else _stats.merge_moments(*previous, *stats)

    def record(module, args):
        x = args[0]
        dims = (0, *range(2, x.dim()))
        count = _stats.reduced_count(x.shape, dims)
        if count == 0:
            return
        m = _stats.moments(_stats.upcast(x.detach()), dims)
        pool(module, (torch.full((x.shape[1],), float(count), dtype=torch.float64,
                                 device=x.device),
                      (m.mean_hi.double() + m.mean_lo.double()).view(-1),
                      (m.var.double() * count).view(-1)))

    def observer(module):
        def observe(count, squares):  # PowerNorm: its mean square pooled as a mean
            if float(count) > 0:
                n = torch.full_like(squares, float(count), dtype=torch.float64)
                pool(module, (n, squares.double() / n, torch.zeros_like(n)))
        return observe

    saved = {}
    for _, m, kind in layers:
        tracked = m.num_batches_tracked
        saved[m] = (m.training, None if tracked is None else tracked.clone(),
                    (m.warmup_iters, m.running_phi.clone()) if kind == "power"
                    else m.momentum)
    hooks = [m.register_forward_pre_hook(record) for _, m, kind in layers if kind != "power"]
    used = 0
    try:
        for _, m, kind in layers:
            m.train()
            if kind == "power":
                # the batch statistic at every step (the warm-up's), its sums observed
                m.warmup_iters = 2 ** 62
                m.num_batches_tracked.zero_()
                m._observer = observer(m)
            else:
                m.momentum = 0.0  # the running statistics stay until the exact ones are in
        for batch in batches:
            if num_batches is not None and used >= num_batches:
                break
            forward(model, batch)
            used += 1
    finally:
        for hook in hooks:
            hook.remove()
        for m, (training, tracked, kept) in saved.items():
            m.train(training)
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)
            if isinstance(m, PowerNorm):
                m.warmup_iters = kept[0]
                m.running_phi.copy_(kept[1])
                del m._observer
            else:
                m.momentum = kept
    if used == 0:
        raise ValueError("update_bn_stats expected at least one batch, got none")
    counts = {}
    for name, m, kind in layers:
        stats = pooled[m]
        if stats is None:
            channels = m.running_phi if kind == "power" else m.running_mean
            stats = tuple(torch.zeros(m.num_features, dtype=torch.float64,
                                      device=channels.device) for _ in range(3))
        n, mean, m2 = sync_moments(*stats, process_group)
        total = int(round(float(n[0])))
        counts[name] = total
        if total == 0:
            warnings.warn(f"update_bn_stats: layer {name!r} saw no data; its running "
                          "statistics are unchanged", stacklevel=2)
            continue
        if kind == "power":
            m.running_phi.copy_(mean)
            continue
        m.running_mean.copy_(mean)
        if kind == "mean":
            continue
        var = m2 / total
        if getattr(m, "unbiased_running_var", True):
            var = _stats.unbiased_var(var, total)
        m.running_var.copy_(var)
    return counts
