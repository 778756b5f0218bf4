"""Constructor arguments of the norm layers, checked before torch.nn sees them.

torch.nn builds a norm from any value and fails later, or never: ``BatchNorm2d(-3)``
raises "Trying to create tensor with negative dimension", ``GroupNorm(0, 8)`` a
ZeroDivisionError, and ``LayerNorm(8, eps=-1)`` or ``BatchNorm2d(8, momentum=1.5)``
build a layer that returns NaN or running statistics that extrapolate past each batch,
silently. normkit's layers refuse such values when they are built, naming the layer,
the argument, what it expects and what it got. Values torch.nn accepts and computes
with (``eps=0``, ``momentum=0``, ``1`` or ``None``, zero features) stay accepted.

Only the constructor checks: an attribute changed on a built layer is the caller's
(``bn.momentum = 1.0`` for one batch, as precise-BN code does, is legitimate).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Mapping

__all__ = ["check_arguments", "check_constructor_call"]


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_arguments(name: str, arguments: Mapping[str, object]) -> None:
    """Raise a ValueError (TypeError for a value of the wrong type) naming ``name`` and
    the argument for the first invalid value among ``arguments`` (those present).

    Checked names: ``num_features`` and ``num_channels`` (an int >= 0), ``num_groups``
    (an int >= 1 that divides ``num_channels``), ``normalized_shape`` (an int >= 0 or a
    sequence of them), ``eps`` (a finite number >= 0; ``None`` where the layer takes
    it), ``momentum`` (``None`` or a number in [0, 1], PyTorch's convention).

    Example:
        >>> check_arguments("BatchNorm2d", {"num_features": 8, "momentum": 0.99})
        >>> check_arguments("BatchNorm2d", {"num_features": 8, "momentum": 1.5})
        Traceback (most recent call last):
        ...
        ValueError: BatchNorm2d expected momentum to be None or a number in [0, 1] \
(PyTorch's convention: the weight of each new batch in the running average; Keras' and \
Flax's momentum m is PyTorch's 1 - m, normkit.conventions.momentum), got 1.5
    """
    for key in ("num_features", "num_channels"):
        if key in arguments:
            value = arguments[key]
            if not _integer(value):
                raise TypeError(f"{name} expected {key} to be an int, got {value!r} "
                                f"({type(value).__name__})")
            if value < 0:
                raise ValueError(f"{name} expected {key} to be an int >= 0, got {value!r}")
    if "num_groups" in arguments:
        groups = arguments["num_groups"]
        if not _integer(groups):
            raise TypeError(f"{name} expected num_groups to be an int, got {groups!r} "
                            f"({type(groups).__name__})")
        channels = arguments.get("num_channels")
        if groups < 1:
            raise ValueError(f"{name} expected num_groups to be an int >= 1, got {groups!r}")
        if _integer(channels) and channels % groups:
            divisors = [g for g in range(1, min(channels, 64) + 1) if channels % g == 0]
            # (torch's own words first: its module tests match them)
            raise ValueError(f"{name}: num_channels ({channels}) must be divisible by "
                             f"num_groups ({groups}); divisors of {channels}"
                             f"{' up to 64' if channels > 64 else ''}: "
                             f"{', '.join(map(str, divisors))}")
    if "normalized_shape" in arguments:
        shape = arguments["normalized_shape"]
        dims = [shape] if _integer(shape) else (
            list(shape) if isinstance(shape, (list, tuple)) else None)
        if dims is None or not all(_integer(d) and d >= 0 for d in dims):
            raise (TypeError if dims is None else ValueError)(
                f"{name} expected normalized_shape to be an int >= 0 or a sequence of "
                f"them (the trailing dims to normalize), got {shape!r}")
    if "eps" in arguments and arguments["eps"] is not None:
        eps = arguments["eps"]
        if not _real(eps):
            raise TypeError(f"{name} expected eps to be a number, got {eps!r} "
                            f"({type(eps).__name__})")
        if not (math.isfinite(eps) and eps >= 0):
            # ("eps must be positive": the words torch's BatchNorm says it in at forward)
            raise ValueError(f"{name} eps must be positive or zero (a finite number added "
                             f"to the variance), got {eps!r}")
    if "momentum" in arguments and arguments["momentum"] is not None:
        momentum = arguments["momentum"]
        if not _real(momentum):
            raise TypeError(f"{name} expected momentum to be None or a number, got "
                            f"{momentum!r} ({type(momentum).__name__})")
        if not 0 <= momentum <= 1:
            raise ValueError(
                f"{name} expected momentum to be None or a number in [0, 1] (PyTorch's "
                f"convention: the weight of each new batch in the running average; Keras' "
                f"and Flax's momentum m is PyTorch's 1 - m, normkit.conventions.momentum), "
                f"got {momentum!r}")


@functools.cache
def _torch_signature(cls: type) -> inspect.Signature | None:
    """The signature of the torch.nn constructor ``cls`` builds on (without ``self``)."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and klass.__module__.startswith("torch."):
            return inspect.signature(init).replace(
                parameters=list(inspect.signature(init).parameters.values())[1:])
    return None


def check_constructor_call(cls: type, args: tuple, kwargs: Mapping[str, object]) -> None:
    """:func:`check_arguments` on a call ``cls(*args, **kwargs)`` that a normkit layer
    passes on to its torch.nn parent. Arguments the parent would not bind are left to
    the parent's own error.

    Example:
        >>> import torch
        >>> check_constructor_call(torch.nn.GroupNorm, (0, 8), {})
        Traceback (most recent call last):
        ...
        ValueError: GroupNorm expected num_groups to be an int >= 1, got 0
    """
    signature = _torch_signature(cls)
    if signature is None:
        return
    known = {k: v for k, v in kwargs.items() if k in signature.parameters}
    try:
        bound = signature.bind_partial(*args, **known)
    except TypeError:
        return  # (the parent raises its own error for the call)
    check_arguments(cls.__name__, bound.arguments)
