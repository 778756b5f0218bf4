"""Model surgery shared by every tool: replace matching submodules in a copy."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

from torch import nn
from torch.nn.utils import parametrize

__all__ = ["check_initialized", "replace_modules", "move_parametrizations",
           "refuse_own_forwards", "activation_of", "activation_module", "keep_activation",
           "is_own_norm", "own_norm_classes", "counted", "own_parametrized_class"]

#: torch's normalization classes (and their subclasses): not "a norm class of its own"
_TORCH_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm,
                nn.LocalResponseNorm, nn.CrossMapLRN2d)


def _layer_class(module: nn.Module) -> type:
    """``module``'s class, or for a parametrized layer (``torch.nn.utils.parametrize``:
    a ``Parametrized<Class>`` made for it) the class it was made from."""
    cls = type(module)
    return cls.__bases__[0] if parametrize.is_parametrized(module) else cls


def is_own_norm(module: nn.Module) -> bool:
    """Whether ``module`` looks like a normalization layer of a model's own class: a leaf
    module whose class name contains "norm" (Hugging Face's ``LlamaRMSNorm``,
    ``T5LayerNorm``), defined neither in torch nor in normkit nor as a subclass of torch's
    norms, with no weight or a 1-D one (a ``NormalizedLinear``'s 2-D weight is a layer's).

    Example:
        >>> import torch
        >>> class MyRMSNorm(nn.Module):
        ...     def __init__(self, d):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(d))
        >>> MyRMSNorm.__module__ = "mymodels"  # (a doctest's is this module's)
        >>> is_own_norm(MyRMSNorm(4)), is_own_norm(nn.LayerNorm(4)), is_own_norm(nn.Linear(2, 2))
        (True, False, False)
    """
    cls = _layer_class(module)
    weight = getattr(module, "weight", None)
    return ("norm" in cls.__name__.lower()
            and not cls.__module__.startswith(("torch.", "normkit."))
            and not isinstance(module, _TORCH_NORMS)
            and next(module.children(), None) is None
            and (weight is None or (hasattr(weight, "dim") and weight.dim() <= 1)))


def own_norm_classes(model: nn.Module) -> dict[str, int]:
    """``{qualified class name: count}`` of ``model``'s :func:`is_own_norm` layers.

    Example:
        >>> own_norm_classes(nn.Sequential(nn.LayerNorm(4)))
        {}
    """
    found: dict[str, int] = {}
    for module in model.modules():
        if is_own_norm(module):
            cls = _layer_class(module)
            name = f"{cls.__module__}.{cls.__qualname__}"
            found[name] = found.get(name, 0) + 1
    return found


def counted(classes: dict[str, int]) -> str:
    """``"2 a.B, 1 c.D"``: class names with their counts, sorted by name.

    Example:
        >>> counted({"x.Norm": 2, "a.RMS": 1})
        '1 a.RMS, 2 x.Norm'
    """
    return ", ".join(f"{count} {name}" for name, count in sorted(classes.items()))


def refuse_own_forwards(model: nn.Module, match: Callable[..., bool], tool: str,
                        with_names: bool = False, hint: str = "") -> None:
    """Raise a ValueError naming the layers ``match`` selects whose class defines the
    forward it runs outside torch and normkit: subclasses of torch's norms with a forward
    of their own (timm's ``BatchNormAct2d`` adds an activation, its ``LayerNorm2d``
    permutes), which replacing by another norm would silently change beyond the norm.

    Example:
        >>> import torch
        >>> class NormThenTanh(nn.LayerNorm):
        ...     def forward(self, x):
        ...         return torch.tanh(super().forward(x))
        >>> NormThenTanh.forward.__module__ = "mymodels"  # (a doctest's is this module's)
        >>> net = nn.Sequential(nn.LayerNorm(4), NormThenTanh(4))
        >>> refuse_own_forwards(net, lambda m: isinstance(m, nn.LayerNorm), "convert_norms")
        Traceback (most recent call last):
        ...
        ValueError: convert_norms: ...NormThenTanh at '1': subclasses of torch's norm ...
    """
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        cls = _layer_class(module)
        owner = getattr(cls.forward, "__module__", None) or ""
        selected = match(name, module) if with_names else match(module)
        if selected and not owner.startswith(("torch.", "normkit.")):
            found.setdefault(f"{cls.__module__}.{cls.__qualname__}", []).append(name)
    if found:
        listed = "; ".join(
            f"{cls} at {', '.join(repr(n) for n in names[:3])}"
            f"{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
            for cls, names in sorted(found.items()))
        raise ValueError(
            f"{tool}: {listed}: subclasses of torch's norm layers with a forward of their "
            "own (it may add an activation or permute), which the replacement would drop"
            f"{hint}; build those layers from normkit's classes (normkit.BatchNormAct2d, "
            "normkit.GroupNormAct, normkit.LayerNorm2d, ...) to use this tool on them")


#: normkit's fused act layers' activation names -> torch modules computing them
_ACTIVATIONS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "relu": lambda m: nn.ReLU(),
    "leaky_relu": lambda m: nn.LeakyReLU(m.negative_slope),
    "elu": lambda m: nn.ELU(m.alpha),
    "silu": lambda m: nn.SiLU(),
    "gelu": lambda m: nn.GELU(),
    "identity": lambda m: nn.Identity(),
}


def activation_of(module: nn.Module) -> str | None:
    """The activation a normkit fused layer (``BatchNormAct*d``, ``GroupNormAct``)
    applies after its norm, else ``None``.

    Example:
        >>> import normkit
        >>> activation_of(normkit.GroupNormAct(2, 4, act="silu")), activation_of(nn.ReLU())
        ('silu', None)
    """
    if _layer_class(module).__module__ == "normkit.norms.fused" and isinstance(
            getattr(module, "act", None), str):
        return module.act
    return None


def activation_module(module: nn.Module) -> nn.Module:
    """The torch module computing the activation of normkit fused layer ``module``.

    Example:
        >>> import normkit
        >>> activation_module(normkit.BatchNormAct2d(4, act="leaky_relu", negative_slope=0.2))
        LeakyReLU(negative_slope=0.2)
    """
    return _ACTIVATIONS[module.act](module)


def keep_activation(source: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` (what replaces ``source``), followed by ``source``'s activation where
    ``source`` is a normkit fused layer: ``nn.Sequential(new, activation)``; else ``new``.

    Example:
        >>> import normkit
        >>> keep_activation(normkit.BatchNormAct2d(4), normkit.FrozenBatchNorm2d(4))
        Sequential(
          (0): FrozenBatchNorm2d(4, eps=1e-05)
          (1): ReLU()
        )
    """
    if activation_of(source) is None:
        return new
    return nn.Sequential(new, activation_module(source))


def own_parametrized_class(module: nn.Module) -> None:
    """Give a parametrized ``module`` a ``Parametrized<Class>`` of its own, before a
    parametrization is added to it or removed from it.

    ``torch.nn.utils.parametrize`` keeps each parametrized tensor as a property of the
    module's class, and ``copy.deepcopy`` shares that class between the copies: removing
    a parametrization from one copy (``remove_parametrizations``) deletes the property
    from the class and breaks every other copy (``AttributeError`` on its ``.weight``),
    and registering one on a copy gives the others a property they cannot serve. A
    private class (same name, bases and attributes) keeps the change to this module.

    Example:
        >>> import copy, torch
        >>> a = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(2, 2))
        >>> b = copy.deepcopy(a)
        >>> type(a) is type(b)
        True
        >>> own_parametrized_class(b)
        >>> type(a) is type(b), type(b).__name__, isinstance(b, torch.nn.Linear)
        (False, 'ParametrizedLinear', True)
        >>> _ = parametrize.remove_parametrizations(b, "weight")
        >>> a.weight.shape  # (torch alone: AttributeError here)
        torch.Size([2, 2])
    """
    if not parametrize.is_parametrized(module):
        return
    cls = type(module)
    body = {key: value for key, value in cls.__dict__.items()
            if key not in ("__dict__", "__weakref__")}
    private = type(cls.__name__, cls.__bases__, body)
    private.__qualname__ = cls.__qualname__
    module.__class__ = private


def move_parametrizations(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` the parametrizations of ``source`` (``torch.nn.utils.parametrize``):
    its plain tensors of those names give way to the parametrized ones, and its class
    becomes ``Parametrized<its class>``, as ``register_parametrization`` makes it. The
    parametrizations (their unconstrained originals included) are moved, not copied:
    ``source`` is the copy of a layer being replaced, ``target`` a fresh layer of a plain
    (not yet parametrized) class.

    Example:
        >>> import torch
        >>> class Positive(nn.Module):
        ...     def forward(self, w):
        ...         return w.exp()
        >>> bn = nn.BatchNorm1d(3)
        >>> parametrize.register_parametrization(bn, "weight", Positive())
        ParametrizedBatchNorm1d(...)
        >>> new = nn.BatchNorm1d(3)
        >>> move_parametrizations(bn, new)
        >>> type(new).__name__, torch.equal(new.weight, torch.ones(3).exp())
        ('ParametrizedBatchNorm1d', True)
    """
    if not parametrize.is_parametrized(source):
        return
    names = list(source.parametrizations)
    for name in names:
        target._parameters.pop(name, None)
        target._buffers.pop(name, None)
        target.__dict__.pop(name, None)
    target._modules["parametrizations"] = source.parametrizations
    # (a class of its own, always: the properties below go on the class, and ``target``
    # is a fresh layer of a plain class shared with every other layer of its kind)
    parametrize._inject_new_class(target)
    for name in names:
        parametrize._inject_property(target, name)


def check_initialized(model: nn.Module, tool: str, named=None) -> None:
    """Raise a ValueError naming the first lazy module of ``model`` not yet initialized.

    ``named`` restricts the check to these ``(qualified name, module)`` pairs (default:
    ``model.named_modules()``).

    A lazy module (``nn.LazyLinear``, ``nn.LazyBatchNorm2d``, ...) holds placeholder
    parameters until its first forward pass, and nothing can copy, convert or fold it
    before then (torch's own ``copy.deepcopy`` fails deep inside).

    Example:
        >>> from torch import nn
        >>> check_initialized(nn.Sequential(nn.LazyLinear(3)), "patch")
        Traceback (most recent call last):
        ...
        ValueError: patch expected a model whose lazy modules are initialized, got '0'...
    """
    for name, module in model.named_modules() if named is None else named:
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(isinstance(t, nn.parameter.UninitializedTensorMixin) for t in tensors):
            raise ValueError(
                f"{tool} expected a model whose lazy modules are initialized, got "
                f"'{name or '(the model itself)'}' ({type(module).__name__}) with "
                "uninitialized parameters: run one forward pass on a real batch first (a "
                f"lazy module takes its sizes from it), then call {tool}")


def layers_named(model: nn.Module, kinds: tuple[type, ...], where=None) -> str:
    """``'name' (Class), ...`` of the modules of ``kinds`` in ``model`` that
    ``where(name, module)`` selects (every one by default); empty when none: the layers a
    tool leaves as they are, for its warning or error.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
        >>> layers_named(net, (nn.ReLU,))
        "'1.0' (ReLU)"
    """
    return ", ".join(f"{name!r} ({type(m).__name__})" for name, m in model.named_modules()
                     if isinstance(m, kinds) and (where is None or bool(where(name, m))))


def replace_naming_the_rest(model: nn.Module, match: Callable[..., bool], build, what: str,
                            tool: str, rest: str, alone: str, left: str) -> nn.Module:
    """:func:`replace_modules` (with names) for a tool that has no version of some layers
    ``rest`` names (see :func:`layers_named`): a ValueError saying ``alone`` when they
    are all the model holds, else the replacement, then a UserWarning saying ``left``.
    Nothing is said when ``rest`` is empty.

    Example:
        >>> import warnings
        >>> net = nn.Sequential(nn.ReLU(), nn.Tanh())
        >>> def is_relu(name, m):
        ...     return isinstance(m, nn.ReLU)
        >>> rest = layers_named(net, (nn.Tanh,))
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     new = replace_naming_the_rest(net, is_relu, lambda name, m: nn.GELU(), "ReLUs",
        ...                                   "tool", rest, "only " + rest, "left " + rest)
        >>> [type(m).__name__ for m in new], str(said[0].message)
        (['GELU', 'Tanh'], "left '1' (Tanh)")
        >>> replace_naming_the_rest(nn.Sequential(nn.Tanh()), is_relu, None, "ReLUs", "tool",
        ...                         "'0' (Tanh)", "only '0' (Tanh)", "")
        Traceback (most recent call last):
        ...
        ValueError: only '0' (Tanh)
    """
    if rest and not any(match(name, m) for name, m in model.named_modules()):
        raise ValueError(alone)
    replaced = replace_modules(model, match, build, what, with_names=True, tool=tool)
    if rest:
        warnings.warn(left, UserWarning, stacklevel=3)  # (at the tool's caller)
    return replaced


def replace_modules(model: nn.Module, match: Callable[..., bool],
                    build: Callable[..., nn.Module], what: str, *,
                    with_names: bool = False, tool: str = "this tool") -> nn.Module:
    """Return a deep copy of ``model`` where every module ``match`` accepts is ``build(it)``.

    The caller's model is never modified. The root itself may match. With
    ``with_names=True``, ``match`` and ``build`` receive ``(qualified_name, module)``
    (``""`` for the root). Raises a ValueError naming ``what`` when nothing matches, so
    "nothing to convert" is never silent, and one naming ``tool`` for a lazy module not
    yet initialized (:func:`check_initialized`).

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

    check_initialized(model, tool)
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
        own = own_norm_classes(model)
        mine = "" if not own else (
            f" (its norm layers are classes of its own: {counted(own)}, which {tool} does not "
            "replace; build them from normkit's classes -- normkit.RMSNorm, "
            "normkit.LayerNorm, ... take torch's arguments -- keeping their eps, and loading "
            "weight + 1 for a norm that scales by 1 + weight, as Gemma's)")
        raise ValueError(f"expected a model holding {what}, got a {type(model).__name__} "
                         f"without any{mine}")
    return model
