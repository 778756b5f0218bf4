"""Name -> norm layer: one way to build any normalization from a config string.

``get_norm_layer(spec, num_features, **kwargs)`` takes a name (``"bn"``, ``"gn"``,
``"layernorm2d"``, ...), a class or a :func:`functools.partial`, and always takes the
*channel count first*, whatever the family's own constructor order (GroupNorm's is
``(num_groups, num_channels)``). Names are case-insensitive and ignore ``_``, ``-``
and spaces, so ``"BatchNorm2d"``, ``"batch_norm_2d"`` and ``"bn2d"`` are the same.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from torch import nn

from .norms.batch import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .norms.group import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .norms.layer import LayerNorm, LayerNorm2d, RMSNorm
from .norms.power import PowerNorm

__all__ = ["get_norm_layer", "register_norm", "norm_names", "default_num_groups"]

NormSpec = str | type | functools.partial | Callable[..., nn.Module]

_REGISTRY: dict[str, type | Callable[..., nn.Module]] = {}


def _canon(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch not in "_- ")


def register_norm(name: str, factory: type | Callable[..., nn.Module], *aliases: str,
                  replace: bool = False) -> None:
    """Register ``factory`` (a class or ``factory(num_features, **kw)``) under names.

    A name already taken by another factory raises: the registry is the process's, and
    ``get_norm_layer``, ``convert_norms`` and ``normkit lab`` would all build the new one
    from then on. ``replace=True`` says that is what you want (registering the same
    factory again is always fine).

    Example:
        >>> from torch import nn
        >>> register_norm("my_identity", nn.Identity)
        >>> get_norm_layer("MyIdentity", 8)
        Identity()
        >>> register_norm("bn", nn.Identity)
        Traceback (most recent call last):
        ...
        ValueError: register_norm: the name 'bn' is taken by normkit.norms.batch.BatchNorm2d...
    """
    if not callable(factory):
        raise TypeError(f"register_norm expected a class or a callable factory(num_features, "
                        f"**kwargs) returning a module, got {type(factory).__name__}")
    keys = {}
    for given in (name, *aliases):
        if not isinstance(given, str) or not _canon(given):
            raise ValueError(f"register_norm expected non-empty string names, got {given!r}")
        keys[_canon(given)] = given
    for key, given in keys.items():
        old = _REGISTRY.get(key)
        if old is not None and old is not factory and not replace:
            raise ValueError(
                f"register_norm: the name {given!r} is taken by {_qualified(old)}; pass "
                f"replace=True to replace it (get_norm_layer, convert_norms and normkit lab "
                f"in this process then build yours), or choose another name")
    for key in keys:
        _REGISTRY[key] = factory


def _qualified(factory) -> str:
    module = getattr(factory, "__module__", None)
    name = getattr(factory, "__qualname__", None) or repr(factory)
    return f"{module}.{name}" if module else name


def norm_names() -> list[str]:
    """All registered (canonical) names, sorted.

    Example:
        >>> "gn" in norm_names() and "layernorm2d" in norm_names()
        True
    """
    return sorted(_REGISTRY)


def default_num_groups(num_channels: int, preferred: int = 32) -> int:
    """The largest group count ``<= preferred`` that divides ``num_channels``.

    Wu & He (2018) use 32 groups; channel counts that 32 does not divide get the
    nearest smaller divisor rather than an error.

    Example:
        >>> default_num_groups(64), default_num_groups(48), default_num_groups(3)
        (32, 24, 3)
    """
    if num_channels <= 0:
        raise ValueError(f"num_channels must be positive, got {num_channels}")
    for groups in range(min(preferred, num_channels), 0, -1):
        if num_channels % groups == 0:
            return groups
    return 1


def _identity(num_features: int, **kwargs) -> nn.Module:
    if kwargs:
        raise ValueError(f"the 'none' norm takes no options, got {sorted(kwargs)}")
    return nn.Identity()


def _build(factory, num_features: int, args: tuple, kwargs: dict) -> nn.Module:
    if inspect.isclass(factory) and issubclass(factory, nn.GroupNorm):
        kwargs = dict(kwargs)
        if "groups" in kwargs:
            kwargs["num_groups"] = kwargs.pop("groups")
        if not args and "num_groups" not in kwargs:
            kwargs["num_groups"] = default_num_groups(num_features)
        if args:
            return factory(*args, num_channels=num_features, **kwargs)
        return factory(num_channels=num_features, **kwargs)
    return factory(*args, num_features, **kwargs) if args else factory(num_features, **kwargs)


def get_norm_layer(spec: NormSpec, num_features: int, **kwargs) -> nn.Module:
    """Build a normalization layer for ``num_features`` channels from a spec.

    Args:
        spec: a registered name (see :func:`norm_names`), a norm class, a
            :func:`functools.partial` of one, or a callable ``f(num_features, **kw)``.
        num_features: the channel count (first, for every family).
        **kwargs: passed to the constructor (``eps``, ``affine``, ``num_groups``, ...).

    Example:
        >>> import functools, normkit
        >>> get_norm_layer("gn", 64)
        GroupNorm(32, 64, eps=1e-05, affine=True, bias=True)
        >>> get_norm_layer("BatchNorm2d", 16, momentum=0.01).momentum
        0.01
        >>> get_norm_layer(functools.partial(normkit.GroupNorm, num_groups=4), 8).num_groups
        4
    """
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
        raise ValueError(f"num_features must be a positive int, got {num_features!r}")
    if isinstance(spec, str):
        key = _canon(spec)
        if key not in _REGISTRY:
            raise ValueError(
                f"unknown norm {spec!r}; expected one of {', '.join(norm_names())} "
                "(or a class, a functools.partial or a callable)"
            )
        return _build(_REGISTRY[key], num_features, (), kwargs)
    if isinstance(spec, functools.partial):
        return _build(spec.func, num_features, spec.args, {**spec.keywords, **kwargs})
    if callable(spec):
        return _build(spec, num_features, (), kwargs)
    raise TypeError(
        f"norm spec must be a name, a class, a functools.partial or a callable, "
        f"got {type(spec).__name__}"
    )


register_norm("batchnorm2d", BatchNorm2d, "bn", "batchnorm", "bn2d")
register_norm("batchnorm1d", BatchNorm1d, "bn1d")
register_norm("batchnorm3d", BatchNorm3d, "bn3d")
register_norm("layernorm", LayerNorm, "ln")
register_norm("layernorm2d", LayerNorm2d, "ln2d")
register_norm("rmsnorm", RMSNorm, "rms")
register_norm("groupnorm", GroupNorm, "gn")
register_norm("instancenorm2d", InstanceNorm2d, "in", "instancenorm", "in2d")
register_norm("instancenorm1d", InstanceNorm1d, "in1d")
register_norm("instancenorm3d", InstanceNorm3d, "in3d")
register_norm("powernorm", PowerNorm, "pn")
register_norm("none", _identity, "identity")
