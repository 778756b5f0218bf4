"""Model surgery shared by every tool: replace matching submodules in a copy."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

__all__ = ["replace_modules"]


def replace_modules(model: nn.Module, match: Callable[[nn.Module], bool],
                    build: Callable[[nn.Module], nn.Module], what: str) -> nn.Module:
    """Return a deep copy of ``model`` where every module ``match`` accepts is ``build(it)``.

    The caller's model is never modified. The root itself may match. Raises a
    ValueError naming ``what`` when nothing matches, so "nothing to convert" is never
    silent.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.ReLU(), nn.Tanh())
        >>> new = replace_modules(net, lambda m: isinstance(m, nn.ReLU), lambda m: nn.GELU(),
        ...                       "ReLU layers")
        >>> [type(m).__name__ for m in new], type(net[0]).__name__
        (['GELU', 'Tanh'], 'ReLU')
    """
    model = copy.deepcopy(model)
    if match(model):
        return build(model)
    found = False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if match(child):
                setattr(parent, name, build(child))
                found = True
    if not found:
        raise ValueError(f"expected a model holding {what}, got a {type(model).__name__} "
                         "without any")
    return model
