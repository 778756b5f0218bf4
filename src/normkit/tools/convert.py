"""Swap normalization families in a model, and patch torch.nn norms with normkit's.

Both work on copies: the caller's model is never modified.

* :func:`convert_norms` replaces norm layers by another family through the registry
  (BatchNorm -> GroupNorm for small batches, LayerNorm -> RMSNorm, ...), keeping the
  channel count and the layout each layer normalizes, and copying affine parameters
  where they mean the same thing.
* :func:`patch` replaces every torch.nn norm by its normkit drop-in (same state, same
  outputs, robust statistics); :func:`unpatch` goes back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._surgery import (
    _layer_class,
    activation_module,
    activation_of,
    counted,
    keep_activation,
    move_parametrizations,
    own_norm_classes,
    refuse_own_forwards,
    replace_modules,
)
from ..norms import batch as nk_batch
from ..norms import fused as nk_fused
from ..norms import group as nk_group
from ..norms import layer as nk_layer
from ..norms import power as nk_power
from ..norms import sync as nk_sync
from ..registry import _canon, default_num_groups, get_norm_layer

__all__ = ["convert_norms", "patch", "unpatch", "is_norm_layer"]

# torch.nn class -> normkit drop-in (exact types: user subclasses are left alone)
_DROP_INS: dict[type, type] = {
    nn.BatchNorm1d: nk_batch.BatchNorm1d,
    nn.BatchNorm2d: nk_batch.BatchNorm2d,
    nn.BatchNorm3d: nk_batch.BatchNorm3d,
    nn.SyncBatchNorm: nk_sync.SyncBatchNorm,
    nn.LayerNorm: nk_layer.LayerNorm,
    nn.RMSNorm: nk_layer.RMSNorm,
    nn.GroupNorm: nk_group.GroupNorm,
    nn.InstanceNorm1d: nk_group.InstanceNorm1d,
    nn.InstanceNorm2d: nk_group.InstanceNorm2d,
    nn.InstanceNorm3d: nk_group.InstanceNorm3d,
}
_TORCH_OF = {nk: tc for tc, nk in _DROP_INS.items()}
_NORMKIT_ATTRS = ("backend", "unbiased_running_var")

_CHANNELS_FIRST = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
                   nn.modules.instancenorm._InstanceNorm, nk_batch.FrozenBatchNorm,
                   nk_layer.LayerNorm2d)
_LAST_DIM = (nn.LayerNorm, nn.RMSNorm, nk_power.PowerNorm)


def is_norm_layer(module: nn.Module) -> bool:
    """True for every normalization layer normkit knows (torch's and its own).

    Example:
        >>> import torch
        >>> is_norm_layer(torch.nn.GroupNorm(2, 4)), is_norm_layer(torch.nn.Linear(2, 2))
        (True, False)
    """
    return isinstance(module, _CHANNELS_FIRST + _LAST_DIM)


def _channels(module: nn.Module) -> int:
    if isinstance(module, nk_layer.LayerNorm2d):
        return module.num_channels
    if isinstance(module, nn.GroupNorm):
        return module.num_channels
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return int(module.normalized_shape[-1])
    return int(module.num_features)


def _rank_class(source: nn.Module, by_rank: tuple[type, type, type], generic: type | None):
    for torch_cls, target in zip((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), by_rank,
                                 strict=True):
        if isinstance(source, torch_cls):
            return target
    for torch_cls, target in zip((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
                                 by_rank, strict=True):
        if isinstance(source, torch_cls):
            return target
    for frozen, target in zip((nk_batch.FrozenBatchNorm1d, nk_batch.FrozenBatchNorm2d,
                               nk_batch.FrozenBatchNorm3d), by_rank, strict=True):
        if isinstance(source, frozen):
            return target
    return generic


def _target_factory(to: str, source: nn.Module, name: str) -> Callable[..., nn.Module]:
    """The constructor ``f(channels, **kw)`` of family ``to`` for the layout ``source`` has."""
    key = _canon(to)
    channels_first = isinstance(source, _CHANNELS_FIRST)
    if key in ("none", "identity"):
        return lambda channels, **kw: nn.Identity()
    if channels_first:
        if key in ("bn", "batchnorm", "bn1d", "bn2d", "bn3d", "batchnorm1d", "batchnorm2d",
                   "batchnorm3d"):
            return _rank_class(source, (nk_batch.BatchNorm1d, nk_batch.BatchNorm2d,
                                        nk_batch.BatchNorm3d), nk_batch.BatchNorm)
        if key in ("gn", "groupnorm"):
            def group_norm(channels, num_groups=None, **kw):
                groups = default_num_groups(channels) if num_groups is None else num_groups
                return nk_group.GroupNorm(groups, channels, **kw)
            return group_norm
        if key in ("in", "instancenorm", "in1d", "in2d", "in3d", "instancenorm1d",
                   "instancenorm2d", "instancenorm3d"):
            target = _rank_class(source, (nk_group.InstanceNorm1d, nk_group.InstanceNorm2d,
                                          nk_group.InstanceNorm3d), None)
            if target is None:
                raise ValueError(
                    f"cannot convert {type(source).__name__} at {name!r} to InstanceNorm: its "
                    "input rank is unknown (expected a BatchNorm1d/2d/3d or InstanceNorm "
                    "source); pass to=normkit.InstanceNorm2d (a class) instead")
            return target
        if key in ("ln", "layernorm", "ln2d", "layernorm2d"):
            return nk_layer.LayerNorm2d  # LayerNorm over dim 1, the dim this layer normalizes
        raise ValueError(
            f"cannot convert {type(source).__name__} at {name!r} (normalizes the channel dim 1 "
            f"of (N, C, *)) to {to!r}; expected one of bn, gn, in, ln/ln2d, none")
    family = _last_dim_family(key)
    if family is not None:
        return {"ln": nk_layer.LayerNorm, "rms": nk_layer.RMSNorm}[family]
    if key in ("pn", "powernorm"):
        shape = tuple(getattr(source, "normalized_shape", ()))
        if len(shape) > 1:
            raise ValueError(
                f"cannot convert {type(source).__name__} at {name!r} (normalizes the last "
                f"{len(shape)} dims, {shape}) to {to!r}: PowerNorm's statistic is per "
                f"channel of the last dim; expected a layer over the last dim only")
        return nk_power.PowerNorm
    raise ValueError(
        f"cannot convert {type(source).__name__} at {name!r} (normalizes the last dims) to "
        f"{to!r}; expected one of ln, rms, pn, none")


def _last_dim_family(key: str | None) -> str | None:
    """``"ln"`` or ``"rms"`` for the registry names of the last-dim families, else None."""
    return {"ln": "ln", "layernorm": "ln", "rms": "rms", "rmsnorm": "rms"}.get(key)


def _with_activation(target: nn.Module, source: nn.Module, act: str) -> nn.Module:
    """``target`` followed by ``source``'s activation: BatchNorm*d and GroupNorm as their
    fused classes (the same state), ``nn.Identity`` as the activation alone, anything else
    as ``nn.Sequential(target, activation)``."""
    options = {"act": act, "negative_slope": source.negative_slope, "alpha": source.alpha}
    fused = {nk_batch.BatchNorm1d: nk_fused.BatchNormAct1d,
             nk_batch.BatchNorm2d: nk_fused.BatchNormAct2d,
             nk_batch.BatchNorm3d: nk_fused.BatchNormAct3d}.get(type(target))
    if fused is not None:
        new = fused(target.num_features, target.eps, target.momentum, target.affine,
                    target.track_running_stats, **options)
    elif type(target) is nk_group.GroupNorm:
        new = nk_fused.GroupNormAct(target.num_groups, target.num_channels, target.eps,
                                    target.affine, **options)
    elif isinstance(target, nn.Identity):
        return activation_module(source)
    else:
        return keep_activation(source, target)
    ref = next(iter(target.parameters()), next(iter(target.buffers()), None))
    if ref is not None:
        new = new.to(device=ref.device, dtype=ref.dtype)
    new.load_state_dict(target.state_dict())
    new.backend = getattr(target, "backend", "auto")
    return new


def _residual_target(to, source: nn.Module, name: str) -> Callable[..., nn.Module]:
    """The residual-add class for ``to`` (AddLayerNorm, AddRMSNorm): their forward takes
    ``(x, residual)`` and returns two tensors, which only another of them does."""
    family = _last_dim_family(_canon(to) if isinstance(to, str) else None)
    if family is not None:
        return {"ln": nk_fused.AddLayerNorm, "rms": nk_fused.AddRMSNorm}[family]
    raise ValueError(
        f"cannot convert {type(source).__name__} at {name!r} (adds a residual, then "
        f"normalizes the last dims: its forward takes (x, residual) and returns two "
        f"tensors) to {to!r}; expected ln or rms")


def _copy_affine(source: nn.Module, target: nn.Module) -> list[str]:
    """Copy weight/bias when both exist with the same shape; return what was dropped."""
    dropped = []
    with torch.no_grad():
        for name in ("weight", "bias"):
            src = getattr(source, name, None)
            dst = getattr(target, name, None)
            if not isinstance(src, torch.Tensor):
                continue
            if isinstance(dst, torch.Tensor) and dst.shape == src.shape:
                dst.copy_(src)
            elif src.numel() and not (name == "weight" and torch.all(src == 1)) and not (
                    name == "bias" and torch.all(src == 0)):
                dropped.append(name)
    return dropped


def convert_norms(model: nn.Module, to, *, where=None, **kwargs) -> nn.Module:
    """A copy of ``model`` whose normalization layers are of another family.

    Each layer keeps its channel count and the dimension it normalizes: a channels-first
    layer (BatchNorm, GroupNorm, InstanceNorm, LayerNorm2d, FrozenBatchNorm) can become
    ``"bn"``, ``"gn"`` (group count: the largest divisor of C up to 32, or
    ``num_groups=``), ``"in"``, ``"ln"`` (as :class:`normkit.LayerNorm2d`) or ``"none"``;
    a last-dim layer (LayerNorm, RMSNorm, PowerNorm) can become ``"ln"``, ``"rms"``,
    ``"pn"`` (:class:`normkit.PowerNorm`, from a layer over the last dim only) or
    ``"none"``.
    Anything else raises a ValueError naming the layer. What a layer does besides
    normalizing stays: the activation of :class:`normkit.BatchNormAct2d` and
    :class:`normkit.GroupNormAct` (into the target's fused class where there is one --
    BatchNorm and GroupNorm -- else an ``nn.Sequential`` of the new norm and the
    activation; ``"none"`` leaves the activation), the residual add of
    :class:`normkit.AddLayerNorm` / :class:`normkit.AddRMSNorm` (``"ln"`` / ``"rms"``
    only). Subclasses of torch's norms with a forward of their own (timm's
    ``BatchNormAct2d``, ``LayerNorm2d``, ...) raise a ValueError naming them: their
    forward may add an activation or permute, which a conversion would silently drop --
    leave them out with ``where=``. ``weight``/``bias`` are copied
    when the target has them with the same shape; a non-trivial one that cannot be kept
    (LayerNorm's bias into RMSNorm) is reported with a warning. Running statistics are
    not copied (they belong to BatchNorm). Parametrizations
    (``torch.nn.utils.parametrize``) are not carried over either, with a warning: the
    new layer gets the current values.

    Args:
        model: the model (not modified).
        to: a registry name (see above), or a class / callable ``f(channels, **kw)``.
        where: which layers: ``None`` (every norm layer), a class or tuple of classes,
            or a predicate ``where(name, module) -> bool``.
        **kwargs: passed to the new layers (``eps``, ``num_groups``, ``affine``, ...).

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.BatchNorm2d(64))
        >>> normkit.convert_norms(net, "gn")[1]
        GroupNorm(32, 64, eps=1e-05, affine=True, bias=True)
        >>> normkit.convert_norms(net, "ln")[1]
        LayerNorm2d((64,), eps=1e-05, elementwise_affine=True...)
    """
    if where is None:
        def selected(name, module):
            return is_norm_layer(module)
    elif isinstance(where, type) or (isinstance(where, tuple) and all(
            isinstance(w, type) for w in where)):
        def selected(name, module):
            return isinstance(module, where)
    elif callable(where):
        selected = where
    else:
        raise TypeError(f"where must be None, a class, a tuple of classes or a predicate "
                        f"(name, module) -> bool, got {type(where).__name__}")

    def match(name, module):
        return is_norm_layer(module) and bool(selected(name, module))

    refuse_own_forwards(model, match, "convert_norms", with_names=True,
                        hint="; leave them out with normkit.convert_norms(..., where=...)")

    def build(name, source):
        act = activation_of(source)
        if isinstance(source, (nk_fused.AddLayerNorm, nk_fused.AddRMSNorm)):
            target = _residual_target(to, source, name)(_channels(source), **kwargs)
        elif isinstance(to, str):
            try:
                factory = _target_factory(to, source, name)
            except ValueError as error:  # a model of both layouts: say how to select
                hint = _convertible_hint(model, to, match) if where is None else ""
                if hint:
                    raise ValueError(f"{error}{hint}") from None
                raise
            target = factory(_channels(source), **kwargs)
        else:  # a class, partial or callable: the registry knows GroupNorm's argument order
            target = get_norm_layer(to, _channels(source), **kwargs)
        ref = next(iter(source.parameters()), next(iter(source.buffers()), None))
        if ref is not None:
            target = target.to(device=ref.device, dtype=ref.dtype)
        dropped = _copy_affine(source, target)
        if dropped and not isinstance(target, nn.Identity):  # "none" drops them by request
            flag = next((attr for attr in ("affine", "elementwise_affine")
                         if getattr(target, attr, None) is False), None)
            them = "them" if len(dropped) > 1 else "it"
            keep = f" (pass {flag}=True to convert_norms to keep {them})" if flag else ""
            warnings.warn(f"convert_norms: {type(target).__name__} at {name!r} has no place "
                          f"for the {type(source).__name__}'s {' and '.join(dropped)}; "
                          f"dropped{keep}", stacklevel=5)
        if parametrize.is_parametrized(source) and not isinstance(target, nn.Identity):
            # (another family's parameters: the constraint may not even apply; say so)
            warnings.warn(f"convert_norms: the parametrizations of the "
                          f"{_layer_class(source).__name__} at {name!r} (on "
                          f"{', '.join(source.parametrizations)}) are not carried over to "
                          f"the {type(target).__name__}; their current values are",
                          stacklevel=5)
        if act is not None:  # (the activation stays, fused where the target has a class)
            target = _with_activation(target, source, act)
        return target.train(source.training)

    what = "normalization layers" + ("" if where is None else " selected by where")
    converted = replace_modules(model, match, build, what, with_names=True,
                                tool="convert_norms")
    _torch_encoder_fast_paths_off(converted)
    return converted


def _torch_encoder_fast_paths_off(model: nn.Module) -> None:
    """torch's ``TransformerEncoderLayer`` in eval without autograd takes a fused "fast
    path" that computes LayerNorm itself from ``norm1``/``norm2``'s weight, bias and eps
    and never calls them: a layer whose norms are no longer LayerNorm would silently
    compute LayerNorm (a PowerNorm: its running statistic and group scaling ignored),
    or fail (RMSNorm has no bias, ``nn.Identity`` no eps). For such layers, turn the
    fast path off (``activation_relu_or_gelu``, which only the fast path reads, to 0,
    the value torch gives an activation it cannot fuse), and the nested-tensor
    conversion of a ``TransformerEncoder`` holding them (``use_nested_tensor``), so that
    their forward calls the norms."""
    def layer_norms_only(layer: nn.TransformerEncoderLayer) -> bool:
        return all(type(norm) in (nn.LayerNorm, nk_layer.LayerNorm)
                   for norm in (layer.norm1, layer.norm2))

    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and not layer_norms_only(module):
            module.activation_relu_or_gelu = 0
        if isinstance(module, nn.TransformerEncoder) and any(
                isinstance(layer, nn.TransformerEncoderLayer) and not layer_norms_only(layer)
                for layer in module.layers):
            module.use_nested_tensor = False


def _convertible_hint(model: nn.Module, to: str, match) -> str:
    """Where some of ``model``'s norm layers can become ``to`` and others cannot (a
    MobileViT: BatchNorm2d in the convolutions, LayerNorm in the attention blocks): the
    ``where=`` that selects exactly the ones that can, else ``""``."""
    can: list[nn.Module] = []
    cannot: list[nn.Module] = []
    for name, module in model.named_modules():
        if not match(name, module):
            continue
        try:
            if isinstance(module, (nk_fused.AddLayerNorm, nk_fused.AddRMSNorm)):
                _residual_target(to, module, name)
            else:
                _target_factory(to, module, name)
            can.append(module)
        except ValueError:
            cannot.append(module)
    exact = list(dict.fromkeys(_layer_class(module) for module in can))
    # the fewest classes: a class whose parent is listed is selected by it (normkit's
    # BatchNorm2d by torch's), unless the parent would also select a layer that cannot
    parents = [cls for cls in exact if not any(other is not cls and issubclass(cls, other)
                                               for other in exact)]
    if not exact:
        return ""
    select = None
    for classes in (parents, exact):
        if not any(isinstance(m, tuple(classes)) for m in cannot):
            names = [_spelled(cls) for cls in classes]
            select = names[0] if len(names) == 1 else f"({', '.join(names)})"
            break
    if select is None:  # a subclass of theirs cannot (LayerNorm2d of LayerNorm): exact types
        names = [_spelled(cls) for cls in exact]
        select = (f"lambda name, m: type(m) is {names[0]}" if len(names) == 1 else
                  f"lambda name, m: type(m) in ({', '.join(names)})")
    return (f"; {len(can)} of its norm layers can become {to!r}: convert only those "
            f"with normkit.convert_norms(model, {to!r}, where={select})")


def _spelled(cls: type) -> str:
    """How a user writes ``cls``: ``torch.nn.BatchNorm2d``, ``normkit.GroupNormAct``."""
    import normkit  # (complete by the time a conversion runs)

    for space, prefix in ((nn, "torch.nn"), (normkit, "normkit")):
        if getattr(space, cls.__name__, None) is cls:
            return f"{prefix}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _retype(module: nn.Module, cls: type, add_normkit: bool) -> nn.Module:
    """The same layer as an instance of ``cls``: state, hooks and attributes carried over,
    and its parametrizations (a ``Parametrized<cls>`` with the same properties)."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    move_parametrizations(module, new)
    if add_normkit:
        new.backend = getattr(module, "backend", "auto")
        if issubclass(cls, nk_batch._BatchNormForward):
            new.unbiased_running_var = getattr(module, "unbiased_running_var", True)
    else:
        for attr in _NORMKIT_ATTRS:
            new.__dict__.pop(attr, None)
    return new


def patch(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every torch.nn norm replaced by its normkit drop-in.

    Exact torch classes only (``BatchNorm*d``, ``SyncBatchNorm``, ``LayerNorm``,
    ``RMSNorm``, ``GroupNorm``, ``InstanceNorm*d``), parametrized ones too
    (``torch.nn.utils.parametrize``: the parametrizations are kept); subclasses of them
    are left alone -- their forward is their own (timm's ``BatchNormAct2d`` adds an
    activation, its ``LayerNorm2d`` permutes) -- with a warning naming them, and where
    they are all the model holds, the ValueError names them.
    Parameters, buffers, hooks and settings carry over, so the ``state_dict`` and the
    outputs are the same (up to normkit's more precise statistics). Raises ValueError
    when there is nothing to patch.

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        >>> type(normkit.patch(net)[1]).__module__
        'normkit.norms.layer'
    """
    kept = _subclassed_norms(model)
    what = "torch.nn normalization layers to patch"
    exact = any(_layer_class(m) in _DROP_INS for m in model.modules())
    own = {} if exact or kept else own_norm_classes(model)
    if own:
        raise ValueError(
            f"expected a model holding {what}, got a {type(model).__name__} whose norm "
            f"layers are classes of its own ({counted(own)}), not torch.nn's, which "
            "patch replaces; build those layers from normkit's classes instead (they take "
            "torch's arguments: normkit.RMSNorm, normkit.LayerNorm, ...), keeping their eps "
            "(and, for a norm that scales by 1 + weight as Gemma's RMSNorm does, loading "
            "weight + 1)")
    if kept and not exact:
        raise ValueError(
            f"expected a model holding {what}, got a {type(model).__name__} whose norm "
            f"layers are all subclasses of them ({counted(kept)}), which patch leaves "
            "alone: their forward is their own. Build those layers from normkit's classes "
            "instead (normkit.BatchNormAct2d, normkit.LayerNorm2d, normkit.GroupNormAct, "
            "... take torch's arguments)")
    if kept:
        warnings.warn(f"patch: left {counted(kept)} alone (subclasses of torch.nn norms, "
                      "whose forward is their own)", stacklevel=2)
    return replace_modules(model, lambda m: _layer_class(m) in _DROP_INS,
                           lambda m: _retype(m, _DROP_INS[_layer_class(m)], True),
                           what, tool="patch")


def _subclassed_norms(model: nn.Module) -> dict[str, int]:
    """``{class name: count}`` of ``model``'s layers whose classes subclass a torch.nn
    norm :func:`patch` replaces without being one (nor normkit's own)."""
    kept: dict[str, int] = {}
    for module in model.modules():
        cls = _layer_class(module)
        if (cls not in _DROP_INS and issubclass(cls, tuple(_DROP_INS))
                and not cls.__module__.startswith("normkit.")):
            name = f"{cls.__module__}.{cls.__qualname__}"
            kept[name] = kept.get(name, 0) + 1
    return kept


def unpatch(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every normkit drop-in turned back into its torch.nn class.

    Layers torch has no class for (LayerNorm2d, BatchRenorm, FrozenBatchNorm, ...) stay
    as they are. Raises ValueError when there is nothing to unpatch. A BatchNorm built
    with ``unbiased_running_var=False`` warns: torch's class stores the unbiased batch
    variance in ``running_var`` from its next training step on (the running statistics
    so far are kept).

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(normkit.GroupNorm(2, 4))
        >>> type(normkit.unpatch(net)[0]) is torch.nn.GroupNorm
        True
    """
    biased = sorted({_layer_class(m).__name__ for m in model.modules()
                     if _layer_class(m) in _TORCH_OF
                     and getattr(m, "unbiased_running_var", True) is False})
    if biased:
        warnings.warn(f"unpatch: {', '.join(biased)} built with unbiased_running_var=False "
                      "become torch.nn layers, which store the unbiased batch variance in "
                      "running_var from their next training step on", stacklevel=2)
    return replace_modules(model, lambda m: _layer_class(m) in _TORCH_OF,
                           lambda m: _retype(m, _TORCH_OF[_layer_class(m)], False),
                           "normkit drop-in layers to unpatch", tool="unpatch")
