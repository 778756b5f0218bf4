"""What every normkit module adds to its torch.nn parent: a forward-time backend, a leaf
node in ``torch.fx`` graphs, and a clear answer to ``torch.jit.script``."""

from __future__ import annotations

import functools
import inspect

from torch import nn
from torch.fx import Proxy

from ._arguments import check_constructor_call
from ._core import check_backend


class NotScriptable:
    """``torch.jit.script`` on a normkit layer (or a model holding one) fails at once
    with an error that says why and names what works instead (see
    :func:`script_error`), not deep inside TorchScript's compiler.

    (A hook that handed TorchScript an equivalent torch.nn layer would be swapped into
    the user's own model: torch's ``__prepare_scriptable__`` pass assigns what it
    returns into the parent module's children, in place.)
    """

    def __prepare_scriptable__(self) -> nn.Module:
        raise script_error(self)


@functools.cache
def constructor_signature(cls: type) -> inspect.Signature:
    """The signature of ``cls(...)`` for a class whose ``__init__`` methods pass
    ``*args, **kwargs`` up to a torch.nn parent: the parent's own parameters, then the
    keyword-only ones each mixin adds (``backend``, ``unbiased_running_var``, ...).

    Example:
        >>> import normkit
        >>> str(constructor_signature(normkit.GroupNorm))  # doctest: +ELLIPSIS
        "(num_groups: int, num_channels: int, eps: float = 1e-05, affine: bool = True, ..."
        >>> "backend" in constructor_signature(normkit.GroupNorm).parameters
        True
    """
    params: list[inspect.Parameter] = []
    added: list[inspect.Parameter] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        own = list(inspect.signature(init).parameters.values())[1:]  # (without self)
        if not any(p.kind is p.VAR_POSITIONAL for p in own):
            params = own  # the first constructor that takes its arguments itself
            break
        added += [p for p in own if p.kind is p.KEYWORD_ONLY]
    names = {p.name for p in params}
    extra = [p for p in added if p.name not in names]
    keep = [p for p in params if p.kind is not p.VAR_KEYWORD]
    tail = [p for p in params if p.kind is p.VAR_KEYWORD]
    return inspect.Signature(keep + extra + tail, return_annotation=None)


class _ClassSignature:
    """``cls.__signature__`` for :func:`inspect.signature` and ``help()``: the merged
    constructor signature on the class; absent on instances, whose signature stays their
    ``forward``'s."""

    def __get__(self, instance, owner):
        if instance is not None:
            raise AttributeError("__signature__")
        return constructor_signature(owner)


class BackendMixin(NotScriptable):
    """Adds the keyword-only ``backend`` argument and attribute to a torch.nn norm.

    The backend is read by ``forward`` every call, so it can be changed on a built
    module (``module.backend = "reference"``). It is not part of the ``state_dict``:
    checkpoints stay interchangeable with torch.nn.
    """

    __signature__ = _ClassSignature()

    def __init__(self, *args, backend: str = "auto", **kwargs) -> None:
        check_constructor_call(type(self), args, kwargs)  # (before torch.nn's obscure errors)
        super().__init__(*args, **kwargs)
        self.backend = check_backend(backend)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return base if self.backend == "auto" else f"{base}, backend={self.backend!r}"


def script_error(module: nn.Module) -> RuntimeError:
    """The error ``torch.jit.script`` raises for a normkit ``module``.

    TorchScript cannot compile normkit's forward: Python that chooses among kernels by
    the data. ``torch.jit.trace`` and ``torch.export`` record normkit's compensated math
    as ATen operators (what torch itself now recommends over scripting); a drop-in
    layer's model can also be scripted as torch's after :func:`normkit.unpatch`, which
    turns the drop-ins back into torch.nn layers with the same parameters and buffers
    (and torch's numerics).

    Example:
        >>> import normkit
        >>> print(script_error(normkit.LayerNorm2d(8)))  # doctest: +ELLIPSIS
        torch.jit.script cannot compile normkit.LayerNorm2d: normkit's layers are Python ...
    """
    from torch.nn import SyncBatchNorm

    from ..tools.convert import _TORCH_OF

    name = type(module).__name__
    torch_class = _TORCH_OF.get(type(module))
    if torch_class is SyncBatchNorm:
        instead = "torch.nn.SyncBatchNorm cannot be scripted either; "
    elif torch_class is not None:
        instead = (f"to script it as torch.nn.{torch_class.__name__}, with torch's kernels, "
                   f"script normkit.unpatch(model), a copy whose normkit drop-ins are torch.nn "
                   f"layers holding the same parameters and buffers; or ")
    else:
        instead = f"torch has no layer that computes what {name} does; "
    return RuntimeError(
        f"torch.jit.script cannot compile normkit.{name}: normkit's layers are Python "
        f"written for eager mode and torch.compile (their paths are chosen by the data), "
        f"which TorchScript cannot compile. Instead, {instead}use "
        f"torch.jit.trace(model, example_inputs) or torch.export.export(model, args), which "
        f"record normkit's math as ATen operators.")


def fx_leaf(module: nn.Module, *args, **kwargs) -> Proxy:
    """``module``'s call as one ``call_module`` node of the graph ``torch.fx.symbolic_trace``
    is building: what a normkit layer's ``forward`` returns when it is handed an FX
    ``Proxy`` (the first lines of each ``forward`` check).

    FX traces *into* any module whose class lives outside ``torch.nn``, and normkit's
    forwards inspect their input (its rank, dtype, layout, data) to choose a path, which
    a ``Proxy`` cannot answer. torch.nn's own norms are leaves -- one node each, run by the
    module itself when the graph runs -- and so are normkit's, which makes every model
    holding them traceable by FX-based tools (torchvision's ``create_feature_extractor``,
    FX graph-mode quantization, graph surgery). The graph module calls the normkit layer
    itself, with normkit's kernels and numerics.

    A normkit layer traced as the root (``symbolic_trace(normkit.LayerNorm(8))``) has no
    parent to call it from: that raises, saying so.

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), normkit.LayerNorm(8))
        >>> graph = torch.fx.symbolic_trace(net).graph
        >>> [node.op for node in graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """
    proxy = next(a for a in (*args, *kwargs.values()) if isinstance(a, Proxy))
    tracer = proxy.tracer
    if getattr(tracer, "root", None) is module:
        raise RuntimeError(
            f"torch.fx.symbolic_trace cannot trace into normkit.{type(module).__name__}: its "
            f"forward chooses a path by its input (rank, dtype, layout, data), which an FX "
            f"Proxy cannot answer. Inside a model it is one call_module node, as torch.nn's "
            f"norms are: trace the model that holds it, or use torch.export.export, which "
            f"records normkit's math as ATen operators.")
    return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)
