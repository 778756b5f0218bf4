"""Model surgery shared by every tool: replace matching submodules in a copy."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

__all__ = ["replace_modules"]


def replace_modules(model: nn.Module, match: Callable[..., bool],
                    build: Callable[..., nn.Module], what: str, *,
                    with_names: bool = False) -> nn.Module:
    """Return a deep copy of ``model`` where every module ``match`` accepts is ``build(it)``.

    The caller's model is never modified. The root itself may match. With
    ``with_names=True``, ``match`` and ``build`` receive ``(qualified_name, module)``
    (``""`` for the root). Raises a ValueError naming ``what`` when nothing matches, so
    "nothing to convert" is never silent.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.ReLU(), nn.Tanh())
        >>> new = replace_modules(net, lambda m: isinstance(m, nn.ReLU), lambda m: nn.GELU(),
        ...                       "ReLU layers")
        >>> [type(m).__name__ for m in new], type(net[0]).__name__
        (['GELU', 'Tanh'], 'ReLU')
    """
    def call(fn, name, module):
        return fn(name, module) if with_names else fn(module)

    model = copy.deepcopy(model)
    if call(match, "", model):
        return call(build, "", model)
    found = False
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if call(match, qualified, child):
                setattr(parent, name, call(build, qualified, child))
                found = True
    if not found:
        raise ValueError(f"expected a model holding {what}, got a {type(model).__name__} "
                         "without any")
    return model
