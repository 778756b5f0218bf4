r"""Fold BatchNorm into the Conv, ConvTranspose or Linear layer before it, for inference.

In eval mode a BatchNorm is a per-channel affine map,

.. math:: y = \gamma \, \frac{z - \mu_{running}}{\sqrt{\sigma^2_{running} + \epsilon}} + \beta,

so when ``z = W x + b`` comes from a convolution or linear layer, and nothing but the
BatchNorm reads ``z``, the map folds into that layer: ``W' = s W`` and
``b' = s (b - \mu) + \beta`` with ``s = \gamma / \sqrt{\sigma^2 + \epsilon}`` per output
channel. The BatchNorm is then removed: one pass over the activations less, the same
numbers.

Surgery in two levels, as everywhere in normkit:

* :func:`fold_bn_weights`, the pure tensor function (float64 arithmetic, the weight's
  dtype back);
* :func:`fold_batchnorm`, which returns a folded copy of a model (never touching the
  caller's) and, on request, a :class:`FoldReport` of what was folded, and of what was
  not and why.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from .._surgery import check_initialized
from ..norms._core import FLOAT16_MAX, overflowed_float16, without_data
from ..norms.batch import FrozenBatchNorm, _BatchNormForward, _BatchRenormForward
from ..norms.mean_only import _MeanOnlyBatchNorm
from ..norms.sync import SyncBatchNorm

__all__ = ["FoldReport", "fold_batchnorm", "fold_bn_weights"]

_CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_LAYER_BASES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, *_CONV_TRANSPOSE, nn.Linear)
_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, FrozenBatchNorm, _MeanOnlyBatchNorm)
# Forwards whose eval-mode output is exactly the affine map above (a subclass that
# overrides forward, e.g. BatchNorm + activation, is not folded).
_KNOWN_NORM_FORWARDS = frozenset({
    nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward,
    _BatchNormForward.forward, _BatchRenormForward.forward, SyncBatchNorm.forward,
    FrozenBatchNorm.forward, _MeanOnlyBatchNorm.forward,
})
# Modules and functions that keep the rank of their (first) input: they let a
# flatten-to-2D upstream prove that a Linear's output is (N, C).
_RANK_KEEPING_MODULES = (
    nn.Identity, nn.Dropout, nn.AlphaDropout, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU,
    nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Softplus,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Linear, *_NORM_TYPES,
)
_RANK_KEEPING_FUNCTIONS = frozenset({
    torch.relu, torch.sigmoid, torch.tanh, nn.functional.relu, nn.functional.gelu,
    nn.functional.silu, nn.functional.leaky_relu, nn.functional.dropout,
})
_RANK_KEEPING_METHODS = frozenset({"relu", "sigmoid", "tanh", "contiguous", "clone"})
# Tensor metadata that a fold does not change: reading it is not a use of the values.
_METADATA = frozenset({
    "shape", "ndim", "dtype", "device", "layout", "requires_grad", "is_cuda", "is_sparse",
    "is_quantized", "is_meta", "size", "dim", "numel", "__len__", "stride",
    "is_floating_point", "is_contiguous", "element_size", "get_device",
})


# --------------------------------------------------------------------------- tensors


def fold_bn_weights(
    weight: Tensor,
    bias: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    gamma: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    transpose: bool = False,
    groups: int = 1,
) -> tuple[Tensor, Tensor]:
    r"""The weight and bias of a Conv/ConvTranspose/Linear layer with an eval BatchNorm folded in.

    For ``z = W x + b`` followed by ``y = \gamma (z - \mu) / \sqrt{\sigma^2 + \epsilon} + \beta``
    (per output channel), returns ``(W', b')`` with ``W' x + b' = y``:

    .. math:: s = \frac{\gamma}{\sqrt{\sigma^2 + \epsilon}}, \quad W' = s W, \quad
              b' = s (b - \mu) + \beta.

    The arithmetic is float64; the results have ``weight``'s dtype, device and memory
    format (``bias``'s dtype for ``b'`` when given). Nothing is modified in place and
    no autograd history is kept.

    Args:
        weight: ``(out, in/groups, *kernel)`` for Conv, ``(out, in)`` for Linear, or,
            with ``transpose=True``, ConvTranspose's ``(in, out/groups, *kernel)``.
        bias: the layer's ``(out,)`` bias, or ``None`` (a zero bias; ``b'`` is created).
        running_mean, running_var: the BatchNorm's ``(out,)`` running statistics.
        eps: the BatchNorm's ``eps``.
        gamma, beta: the BatchNorm's ``(out,)`` weight and bias, or ``None``
            (``affine=False``: ``gamma = 1``, ``beta = 0``). Default: ``None``.
        transpose: ``weight`` is a ConvTranspose weight, whose output channels are
            dim 1 within each of the ``groups`` blocks of dim 0. Default: ``False``.
        groups: the ConvTranspose's ``groups`` (only read with ``transpose=True``; a
            Conv's grouping needs nothing, its output channels are dim 0). Default: ``1``.

    Returns:
        ``(new_weight, new_bias)``, shaped like ``weight`` and ``(out,)``.

    Example:
        >>> import torch
        >>> w, b = fold_bn_weights(torch.tensor([[1.0, 2.0]]), None, torch.tensor([1.0]),
        ...                        torch.tensor([3.0]), 1.0, torch.tensor([4.0]),
        ...                        torch.tensor([1.0]))
        >>> w, b
        (tensor([[2., 4.]]), tensor([-1.]))
        >>> conv = torch.nn.ConvTranspose2d(4, 6, 3, groups=2)
        >>> bn = torch.nn.BatchNorm2d(6).eval()
        >>> _ = bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
        >>> w, b = fold_bn_weights(conv.weight, conv.bias, bn.running_mean, bn.running_var,
        ...                        bn.eps, bn.weight, bn.bias, transpose=True, groups=2)
        >>> x = torch.randn(2, 4, 5, 5)
        >>> y = torch.nn.functional.conv_transpose2d(x, w, b, groups=2)
        >>> torch.allclose(y, bn(conv(x)), atol=1e-5)
        True
    """
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() < 2:
        got = (f"a {weight.dim()}D {weight.dtype} tensor" if isinstance(weight, Tensor)
               else type(weight).__name__)
        raise ValueError("fold_bn_weights expected a floating-point weight of at least 2 dims "
                         f"((out, in, *kernel), or (in, out/groups, *kernel) with "
                         f"transpose=True), got {got}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"fold_bn_weights expected a positive int groups, got {groups!r}")
    shape = tuple(weight.shape)
    if transpose:
        if shape[0] % groups:
            raise ValueError(
                f"fold_bn_weights expected a ConvTranspose weight whose dim 0 (input channels, "
                f"{shape[0]}) is divisible by groups={groups}, got shape {shape}")
        channels = shape[1] * groups
    else:
        channels = shape[0]
    given = {"bias": bias, "running_mean": running_mean, "running_var": running_var,
             "gamma": gamma, "beta": beta}
    for name, tensor in given.items():
        if tensor is None and name in ("running_mean", "running_var"):
            raise ValueError(f"fold_bn_weights expected a {name} tensor (a BatchNorm with "
                             "running statistics), got None")
        if tensor is not None and tuple(tensor.shape) != (channels,):
            raise ValueError(
                f"fold_bn_weights expected {name} of shape ({channels},) (the weight's output "
                f"channels), got shape {tuple(tensor.shape)}")

    def wide(tensor: Tensor) -> Tensor:
        return tensor.detach().to(device=weight.device, dtype=torch.float64)

    mean = wide(running_mean)
    scale = 1.0 / torch.sqrt(wide(running_var) + float(eps))  # (out,)
    if gamma is not None:
        scale = scale * wide(gamma)
    new_bias = (mean.neg() if bias is None else wide(bias) - mean) * scale
    if beta is not None:
        new_bias = new_bias + wide(beta)
    w = wide(weight)
    trailing = (1,) * (w.dim() - 2)
    if transpose:  # (in, out/groups, *k) = (groups, in/groups, out/groups, *k) blocks
        blocks = w.reshape(groups, shape[0] // groups, shape[1], *shape[2:])
        w = (blocks * scale.view(groups, 1, shape[1], *trailing)).reshape(shape)
    else:
        w = w * scale.view(channels, 1, *trailing)
    new_weight = torch.empty_like(weight, requires_grad=False).copy_(w)  # keeps the format
    bias_dtype = weight.dtype if bias is None else bias.dtype
    return new_weight, new_bias.to(bias_dtype)


# --------------------------------------------------------------------------- report


def _show(name: str) -> str:
    return name or "<the model itself>"


def _reasons_text(skipped: list[tuple[str, str]], shown: int = 3) -> str:
    """``"a, b and 6 more: reason; c: other reason"``: each reason once, with its layers.

    Example:
        >>> _reasons_text([("a", "why"), ("b", "why"), ("c", "other")], shown=1)
        'a and 1 more: why; c: other'
    """
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped:
        by_reason.setdefault(reason, []).append(_show(name))
    parts = []
    for reason, names in by_reason.items():
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"{', '.join(names[:shown])}{more}: {reason}")
    return "; ".join(parts)


@dataclass
class FoldReport:
    """What :func:`fold_batchnorm` folded, and what it left alone and why.

    Attributes:
        method: how the data flow was found: ``"torch.fx"``, ``"torch.fx + recorded
            run"`` (a trace checked against a run on ``example_inputs``), ``"recorded
            run"`` (the model is not traceable) or ``"nn.Sequential order"`` (not
            traceable and no ``example_inputs``).
        folded: ``(layer name, norm name)`` pairs, in model order; each norm is now an
            ``nn.Identity``.
        skipped: ``(norm name, reason)`` for every BatchNorm-like layer left in place.

    Example:
        >>> report = FoldReport("torch.fx", [("conv", "bn")], [("head.bn", "no running "
        ...                     "statistics")])
        >>> print(report)
        fold_batchnorm (torch.fx): folded 1, skipped 1
          folded  bn into conv
          skipped head.bn: no running statistics
    """

    method: str
    folded: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fold_batchnorm ({self.method}): folded {len(self.folded)}, "
                 f"skipped {len(self.skipped)}"]
        lines += [f"  folded  {_show(norm)} into {_show(layer)}" for layer, norm in self.folded]
        lines += [f"  skipped {_show(norm)}: {reason}" for norm, reason in self.skipped]
        return "\n".join(lines)


# --------------------------------------------------------------------------- modules


def _layer_base(module: nn.Module) -> type[nn.Module] | None:
    for base in _LAYER_BASES:
        if isinstance(module, base):
            return base
    return None


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES)


def _hooked(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _norm_problem(norm: nn.Module) -> str | None:
    """Why this BatchNorm-like layer cannot be folded whatever precedes it, or None."""
    kind = type(norm).__name__
    if isinstance(norm, LazyModuleMixin):
        return f"{kind} is not initialized yet (lazy)"
    if type(norm).forward not in _KNOWN_NORM_FORWARDS:
        return f"{kind} overrides forward: its eval output is not known to be BatchNorm's"
    if _hooked(norm):
        return "it has hooks, which an nn.Identity would not run"
    if norm.running_mean is None or getattr(norm, "running_var", norm.running_mean) is None:
        return ("no running statistics (track_running_stats=False): in eval it normalizes "
                "with batch statistics")
    for name in ("running_mean", "running_var"):
        value = getattr(norm, name, None)
        if (isinstance(value, Tensor) and not without_data(value)
                and not bool(torch.isfinite(value).all())):
            why = (f"a float16 overflow, values above {FLOAT16_MAX:.0f}: fold the float32 "
                   "model, then call .half()" if overflowed_float16(value) else
                   "from a training step that diverged?")
            return (f"its {name} holds NaN/Inf ({why}); folding it would write zeros or NaN "
                    "into the layer before it")
    return None


def _parametrized_problem(layer: nn.Module, name: str) -> str:
    """What to call to bake ``layer``'s parametrized tensors back, named per kind."""
    from ..weights import WeightNorm, WeightStandardization, _TorchWeightNorm

    parts = []
    for tensor, chain in layer.parametrizations.items():
        first = chain[0]
        if isinstance(first, WeightStandardization):
            fix = f"normkit.remove_weight_standardization(layer, {tensor!r})"
        elif isinstance(first, WeightNorm) or (_TorchWeightNorm is not None
                                               and isinstance(first, _TorchWeightNorm)):
            fix = f"normkit.remove_weight_norm(layer, {tensor!r})"
        else:
            fix = (f"torch.nn.utils.parametrize.remove_parametrizations(layer, {tensor!r}, "
                   "leave_parametrized=True)")
        parts.append(f"{tensor} is parametrized ({type(first).__name__}): bake it first with "
                     f"{fix}")
    return f"{name}'s {'; '.join(parts)}"


def _layer_problem(layer: nn.Module, name: str) -> str | None:
    """Why this Conv/ConvTranspose/Linear cannot take a fold, or None."""
    base = _layer_base(layer)
    kind = type(layer).__name__
    if isinstance(layer, LazyModuleMixin):
        return f"{name} ({kind}) is not initialized yet (lazy)"
    if parametrize.is_parametrized(layer):
        return _parametrized_problem(layer, name)
    if (type(layer).forward is not base.forward
            or getattr(type(layer), "_conv_forward", None) is not getattr(base, "_conv_forward",
                                                                        None)):
        return f"{name} ({kind}) overrides forward: its output is not known to be W x + b"
    if _hooked(layer):
        return f"{name} has hooks, which would see the folded output"
    if not layer.weight.is_floating_point():
        return f"{name} has a {layer.weight.dtype} weight, expected a floating-point one"
    return None


def _norm_statistics(norm: nn.Module) -> tuple[Tensor, Tensor, float, Tensor | None,
                                              Tensor | None]:
    """``(mean, var, eps, gamma, beta)`` of the eval-mode affine map of a norm layer."""
    if isinstance(norm, _MeanOnlyBatchNorm):  # y = x - mean + b
        return norm.running_mean, torch.ones_like(norm.running_mean), 0.0, None, norm.bias
    return norm.running_mean, norm.running_var, norm.eps, norm.weight, norm.bias


def _fold_pair_(layer: nn.Module, norm: nn.Module) -> None:
    """Fold ``norm`` into ``layer`` (a copy's), as new Parameters (ties to others are cut)."""
    mean, var, eps, gamma, beta = _norm_statistics(norm)
    weight, bias = fold_bn_weights(
        layer.weight, layer.bias, mean, var, eps, gamma, beta,
        transpose=isinstance(layer, _CONV_TRANSPOSE), groups=getattr(layer, "groups", 1))
    bias_grad = (layer.bias if layer.bias is not None else layer.weight).requires_grad
    layer.weight = nn.Parameter(weight, requires_grad=layer.weight.requires_grad)
    layer.bias = nn.Parameter(bias, requires_grad=bias_grad)


def _replace_everywhere_(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child is old:
                setattr(parent, child_name, new)


def _out_channels(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels


def _layout_problem(layer: nn.Module, layer_name: str, norm: nn.Module,
                    shape: tuple[int, ...] | None, proven_2d: bool) -> str | None:
    """Whether the norm's channel dim (dim 1) is the layer's output channel dim."""
    channels = _out_channels(layer)
    if norm.running_mean.numel() != channels:
        return (f"channels differ: {layer_name} has {channels} output channels, the norm "
                f"{norm.running_mean.numel()}")
    linear = isinstance(layer, nn.Linear)
    if shape is not None:
        expected = 2 if linear else layer.weight.dim()
        if len(shape) != expected:
            layout = "(N, C)" if linear else "(N, C, *spatial)"
            return (f"in the recorded run {layer_name}'s output has shape {shape}, expected a "
                    f"{expected}D {layout} output whose dim 1 is the channels")
        return None
    if linear and not proven_2d:
        return (f"{layer_name} is a Linear, whose features are the last dim, and BatchNorm "
                "normalizes dim 1: the same only for (N, C) output, not proven here (pass "
                "example_inputs, or flatten to 2D before the Linear)")
    return None


# --------------------------------------------------------------------------- analysis


@dataclass
class _Flow:
    """Which layer's output each norm consumes, as far as one analysis can prove."""

    method: str
    pairs: dict[str, str] = field(default_factory=dict)      # norm name -> layer name
    reasons: dict[str, str] = field(default_factory=dict)    # norm name -> why no pair
    proven_2d: set[str] = field(default_factory=set)         # layers with (N, C) output
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # layer -> output shape


class _Tracer(fx.Tracer):
    """torch.fx tracing with conv/linear, norm and normkit norm layers as leaves."""

    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return (_is_norm(module) or _layer_base(module) is not None
                or type(module).__module__.startswith("normkit.norms")
                or super().is_leaf_module(module, qualname))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _trace(model: nn.Module) -> tuple[fx.Graph | None, set[fx.Node], str | None]:
    """The traced graph, the nodes whose value the forward stored on a module, or the error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = _Tracer().trace(model)
    except Exception as error:  # any failure to trace means "use another analysis"
        return None, set(), _first_line(error)
    stored: set[fx.Node] = set()
    for module in model.modules():  # e.g. `self.cache = y`: a user that fx does not record
        for value in vars(module).values():
            items = value.values() if isinstance(value, dict) else (
                value if isinstance(value, (list, tuple)) else (value,))
            stored.update(item.node for item in items if isinstance(item, fx.Proxy))
    return graph, stored, None


def _within(attr: str, module_name: str) -> bool:
    return attr == module_name or attr.startswith(module_name + ".")


def _describe_node(node: Any, model: nn.Module) -> str:
    if not isinstance(node, fx.Node):
        return "not a single positional tensor"
    if node.op == "call_module":
        return f"the output of {node.target} ({type(model.get_submodule(node.target)).__name__})"
    if node.op == "placeholder":
        return f"the model input {node.target!r}"
    target = getattr(node.target, "__name__", node.target)
    return f"the result of {target}"


def _flattens_to_2d(node: fx.Node, model: nn.Module) -> bool | None:
    """True/False when ``node`` surely gives/does not give a 2D output; None: look upstream."""
    args = node.args
    if node.op == "call_module":
        module = model.get_submodule(node.target)
        if isinstance(module, nn.Flatten):
            return module.start_dim == 1 and module.end_dim == -1
        return None if isinstance(module, _RANK_KEEPING_MODULES) else False
    if node.op == "call_function":
        if node.target is torch.flatten:
            start = args[1] if len(args) > 1 else node.kwargs.get("start_dim", 0)
            end = args[2] if len(args) > 2 else node.kwargs.get("end_dim", -1)
            return start == 1 and end == -1
        if node.target is torch.reshape:
            return len(args) > 1 and isinstance(args[1], (tuple, list)) and len(args[1]) == 2
        return None if node.target in _RANK_KEEPING_FUNCTIONS else False
    if node.op == "call_method":
        if node.target == "flatten":
            start = args[1] if len(args) > 1 else node.kwargs.get("start_dim", 0)
            end = args[2] if len(args) > 2 else node.kwargs.get("end_dim", -1)
            return start == 1 and end == -1
        if node.target in ("view", "reshape"):  # x.view(a, b) or x.view((a, b))
            return len(args) == 3 or (len(args) == 2 and isinstance(args[1], (tuple, list))
                                      and len(args[1]) == 2)
        return None if node.target in _RANK_KEEPING_METHODS else False
    return False


def _proven_2d_in_graph(node: Any, model: nn.Module) -> bool:
    """Whether the tensor ``node`` is 2D by construction: flattened to 2D upstream."""
    while isinstance(node, fx.Node):
        verdict = _flattens_to_2d(node, model)
        if verdict is not None:
            return verdict
        node = node.args[0] if node.args else None
    return False


def _graph_flow(model: nn.Module, graph: fx.Graph, stored: set[fx.Node]) -> _Flow:
    nodes = list(graph.nodes)
    calls = Counter(node.target for node in nodes if node.op == "call_module")
    reads = [node.target for node in nodes if node.op == "get_attr"]
    flow = _Flow("torch.fx")
    for node in nodes:
        if node.op != "call_module" or not _is_norm(model.get_submodule(node.target)):
            continue
        name = node.target
        if name in flow.pairs or name in flow.reasons:
            continue
        if calls[name] > 1:
            flow.reasons[name] = f"called {calls[name]} times in forward"
            continue
        source = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        if not (isinstance(source, fx.Node) and source.op == "call_module"
                and _layer_base(model.get_submodule(source.target)) is not None):
            flow.reasons[name] = ("no preceding Conv/ConvTranspose/Linear: its input is "
                                  + _describe_node(source, model))
            continue
        layer = source.target
        users = len(source.users) + (source in stored)
        read = next((attr for attr in reads if _within(attr, layer) or _within(attr, name)),
                    None)
        if calls[layer] > 1:
            flow.reasons[name] = f"{layer} is called {calls[layer]} times in forward"
        elif users > 1:
            flow.reasons[name] = f"the output of {layer} has {users} users"
        elif read is not None:
            flow.reasons[name] = f"forward reads {read} directly"
        else:
            flow.pairs[name] = layer
            if _proven_2d_in_graph(source.args[0] if source.args else None, model):
                flow.proven_2d.add(layer)
    return flow


def _plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _sequential_chain(seq: nn.Sequential) -> Iterator[nn.Module]:
    """The modules a plain Sequential applies one after the other, nested ones opened."""
    for child in seq:
        if _plain_sequential(child):
            yield from _sequential_chain(child)
        else:
            yield child


def _proven_2d_in_chain(before: list[nn.Module]) -> bool:
    for module in reversed(before):
        if isinstance(module, nn.Flatten):
            return module.start_dim == 1 and module.end_dim == -1
        if not isinstance(module, _RANK_KEEPING_MODULES):
            return False
    return False  # the Sequential's own input: rank unknown


def _sequential_flow(model: nn.Module, trace_error: str) -> _Flow:
    """Neighbours inside plain nn.Sequential containers (the model could not be traced)."""
    names = {id(module): name for name, module in model.named_modules()}
    registered = Counter(id(module) for _, module in model.named_modules(remove_duplicate=False))
    flow = _Flow("nn.Sequential order")
    for _, seq in model.named_modules():
        if not _plain_sequential(seq):
            continue
        chain = list(_sequential_chain(seq))
        for index in range(1, len(chain)):
            layer, norm = chain[index - 1], chain[index]
            if not _is_norm(norm) or _layer_base(layer) is None:
                continue
            name, layer_name = names[id(norm)], names[id(layer)]
            twice = next((n for n, m in ((name, norm), (layer_name, layer))
                          if registered[id(m)] > 1), None)
            if twice is not None:
                flow.reasons[name] = (f"{twice} is registered under more than one name, so the "
                                      "untraceable forward may call it elsewhere")
                continue
            flow.pairs[name] = layer_name
            if _proven_2d_in_chain(chain[:index - 1]):
                flow.proven_2d.add(layer_name)
    for name, module in model.named_modules():
        if _is_norm(module) and name not in flow.pairs and name not in flow.reasons:
            flow.reasons[name] = (
                f"the model is not traceable by torch.fx ({trace_error}) and this norm does not "
                "directly follow a Conv/ConvTranspose/Linear in an nn.Sequential; pass "
                "example_inputs to record the forward")
    return flow


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _function_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a Tensor property, e.g. .shape
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


@dataclass
class _Output:
    ref: weakref.ReferenceType
    layer: str
    consumer: nn.Module | None = None


class _Recorder(TorchFunctionMode):
    """Watch one forward: which norm consumes which layer output, and every other use.

    Module hooks keep a stack of the modules running and tie each norm call to the
    layer output it receives (by identity); this mode sees every torch function and
    Tensor method call, so a read of a layer output anywhere but inside its norm, or of
    a layer's or norm's parameters outside their own forward, is recorded as a misuse.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.stack: list[nn.Module] = []
        self.outputs: dict[str, list[_Output]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.inputs: dict[str, list[str | None]] = {}
        self.misuse: dict[str, str] = {}
        self._by_id: dict[int, list[_Output]] = {}
        self._owned: dict[int, list[tuple[Tensor, str, nn.Module]]] = {}
        self._handles = []
        for name, module in model.named_modules():
            watched = _is_norm(module) or _layer_base(module) is not None
            if watched:
                for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                    self._owned.setdefault(id(tensor), []).append((tensor, name, module))
            self._handles.append(module.register_forward_pre_hook(
                self._pre_hook(name, _is_norm(module)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                self._post_hook(name, _layer_base(module) is not None), always_call=True))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _found(self, tensor: Any) -> list[_Output]:
        return [out for out in self._by_id.get(id(tensor), ()) if out.ref() is tensor]

    def _flag(self, name: str, what: str) -> None:
        self.misuse.setdefault(name, what)

    def _pre_hook(self, name: str, is_norm: bool):
        def hook(module, args, kwargs):
            if is_norm:
                source = None
                for out in self._found(args[0] if args else None):
                    if out.consumer is None:
                        out.consumer, source = module, out.layer
                    else:
                        self._flag(out.layer, f"its output is also passed to {name}")
                self.inputs.setdefault(name, []).append(source)
            self.stack.append(module)
        return hook

    def _post_hook(self, name: str, is_layer: bool):
        def hook(module, args, output):
            if self.stack and self.stack[-1] is module:
                self.stack.pop()
            if is_layer and isinstance(output, Tensor):
                out = _Output(weakref.ref(output), name)
                self.outputs.setdefault(name, []).append(out)
                self.shapes[name] = tuple(output.shape)
                self._by_id.setdefault(id(output), []).append(out)
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _function_name(func)
        if name not in _METADATA:
            top = self.stack[-1] if self.stack else None
            for tensor in _tensors((args, kwargs)):
                for out in self._found(tensor):
                    if out.consumer is None or top is not out.consumer:
                        self._flag(out.layer, f"its output is also read by {name}")
                for owned, owner_name, owner in self._owned.get(id(tensor), ()):
                    if owned is tensor and top is not owner:
                        self._flag(owner_name, f"forward reads its parameters directly ({name})")
        return func(*args, **kwargs)


def _recorded_flow(model: nn.Module, call: tuple[tuple, dict]) -> _Flow:
    """Run ``model(*args, **kwargs)`` once and derive each norm's source from what ran."""
    recorder = _Recorder(model)
    args, kwargs = call
    try:
        with torch.no_grad(), recorder:
            output = model(*args, **kwargs)
    except Exception as error:
        raise ValueError(
            "fold_batchnorm expected example_inputs that the eval-mode model accepts "
            "(model(*example_inputs), or model(**example_inputs) for a mapping), got an "
            f"error: {_first_line(error)}") from error
    finally:
        recorder.remove_hooks()
    gc.collect()
    outlive = {layer for layer, outs in recorder.outputs.items()
               if any(out.ref() is not None for out in outs)}  # returned or stored
    del output
    flow = _Flow("recorded run", shapes=recorder.shapes)
    for name, module in model.named_modules():
        if not _is_norm(module):
            continue
        calls = recorder.inputs.get(name, [])
        layer = calls[0] if len(calls) == 1 else None
        if not calls:
            flow.reasons[name] = "not called in the recorded run"
        elif len(calls) > 1:
            flow.reasons[name] = f"called {len(calls)} times in the recorded run"
        elif layer is None:
            flow.reasons[name] = ("no preceding Conv/ConvTranspose/Linear: in the recorded run "
                                  "its input is not such a layer's output")
        elif len(recorder.outputs[layer]) > 1:
            flow.reasons[name] = (f"{layer} is called {len(recorder.outputs[layer])} times in "
                                  "the recorded run")
        elif layer in recorder.misuse:
            flow.reasons[name] = f"{layer}: {recorder.misuse[layer]}"
        elif name in recorder.misuse:
            flow.reasons[name] = f"{name}: {recorder.misuse[name]}"
        elif layer in outlive:
            flow.reasons[name] = f"the output of {layer} outlives the forward (returned or stored)"
        else:
            flow.pairs[name] = layer
    return flow


def _copy(model: nn.Module) -> nn.Module:
    check_initialized(model, "fold_batchnorm")
    try:
        return copy.deepcopy(model)
    except Exception as error:
        raise TypeError(
            "fold_batchnorm expected a model that copy.deepcopy can copy (the caller's model "
            f"is never modified), got a {type(model).__name__} that fails: {_first_line(error)}"
        ) from error


def _find_flow(model: nn.Module, args: tuple[tuple, dict] | None) -> _Flow:
    """Trace a scratch copy; check it against (or fall back to) a recorded run, or Sequentials."""
    scratch = _copy(model)
    graph, stored, trace_error = _trace(scratch)
    flow = (_graph_flow(scratch, graph, stored) if graph is not None
            else _sequential_flow(scratch, trace_error) if args is None else None)
    del scratch, graph, stored
    if args is None:
        return flow
    recorded = _recorded_flow(_copy(model), copy.deepcopy(args))
    if flow is None:
        return recorded
    for name, layer in list(flow.pairs.items()):  # both must agree
        if recorded.pairs.get(name) != layer:
            del flow.pairs[name]
            flow.reasons[name] = recorded.reasons.get(
                name, f"the recorded run feeds it {recorded.pairs.get(name)}, not {layer}")
    flow.method, flow.shapes = "torch.fx + recorded run", recorded.shapes
    return flow


def _as_args(example_inputs: Any) -> tuple[tuple, dict] | None:
    """``(positional, keyword)`` arguments of the recorded call, or ``None``."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    raise TypeError("fold_batchnorm expected example_inputs to be a tensor, a tuple of "
                    "positional inputs or a mapping of keyword inputs, got "
                    f"{type(example_inputs).__name__}")


def fold_batchnorm(model: nn.Module, example_inputs: Tensor | tuple | Mapping | None = None,
                   *,
                   return_report: bool = False) -> nn.Module | tuple[nn.Module, FoldReport]:
    """An eval-mode copy of ``model`` with each BatchNorm folded into the layer before it.

    Every BatchNorm-like layer (``torch.nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``, and
    normkit's ``BatchNorm*``, ``SyncBatchNorm``, ``FrozenBatchNorm*``, ``BatchRenorm*``,
    ``MeanOnlyBatchNorm*``) whose input is the output of a ``Conv1d/2d/3d``,
    ``ConvTranspose1d/2d/3d`` or ``Linear`` used by nothing else is folded into that
    layer with :func:`fold_bn_weights` (a bias is created where there was none; grouped,
    depthwise and transposed convolutions and ``affine=False`` are handled; dtypes are
    kept) and replaced by ``nn.Identity``. The copy keeps the model's class and forward
    and is returned in eval mode; the caller's model (its parameters, buffers and
    train/eval mode) is not modified. In float64 the output equals the unfolded eval
    model's to about 1e-12, in float32 to about 1e-6 relative.

    A pair is folded only where that provably keeps the eval output:

    * the norm has running statistics (``track_running_stats=False`` normalizes with
      batch statistics in eval), a known BatchNorm forward and no hooks; the layer is a
      plain, unhooked, unparametrized Conv/ConvTranspose/Linear;
    * the norm and the layer are each called once, the norm's only input is the layer's
      output, and nothing else reads that output or either module's parameters;
    * the norm's channel dim (dim 1) is the layer's output channels. For convolutions
      the input is taken to be batched, ``(N, C, *)``, as every BatchNorm needs. A
      ``Linear`` maps the *last* dim, so it is folded only when its output is provably
      ``(N, C)``: recorded with ``example_inputs``, or flattened to 2D upstream
      (``nn.Flatten()``, ``torch.flatten(x, 1)``, ``x.view(n, -1)``, through
      activations, dropout, norms and other Linears).

    How the data flow is found (``FoldReport.method``): a ``torch.fx`` trace (in eval
    mode) when the forward is traceable; with ``example_inputs`` also one recorded run
    of the forward (hooks, plus a ``TorchFunctionMode`` that sees every other read of a
    layer's output or parameters, and whether the output outlives the forward), whose
    findings must agree with the trace. A forward that torch.fx cannot trace (data-
    dependent control flow) is analysed by the recorded run alone, or, without
    ``example_inputs``, only neighbours inside plain ``nn.Sequential`` containers are
    folded, assuming the untraceable forward calls their children only through them.
    Limits: a recorded run sees the branches taken for ``example_inputs`` only; a trace
    does not see the forward read a norm's non-tensor attributes (after folding it is an
    ``nn.Identity``) or keep a layer's output in a global. A model that cannot be traced
    or analysed never makes it raise: its norms are skipped, with the reason. It raises
    only for a model ``copy.deepcopy`` cannot copy (``TypeError``) and for
    ``example_inputs`` the model rejects (``ValueError``).

    Args:
        model: the model (any mode; it is copied with ``copy.deepcopy``).
        example_inputs: a tensor, a tuple of positional inputs or a mapping of keyword
            inputs (``{"pixel_values": x}`` for a Hugging Face model) the eval model
            accepts, to record one forward (on another copy, without gradients).
            Default: ``None``.
        return_report: also return the :class:`FoldReport` (keyword-only).
            Default: ``False``.

    Returns:
        The folded eval-mode copy, or ``(copy, report)`` with ``return_report=True``.
        When nothing could be folded it warns (``UserWarning``, reasons included) and
        returns an eval-mode copy.

    Example:
        >>> import torch, normkit
        >>> from normkit.tools.fold import fold_batchnorm
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, bias=False),
        ...                           normkit.BatchNorm2d(8), torch.nn.ReLU())
        >>> folded, report = fold_batchnorm(net, return_report=True)
        >>> report.folded, type(folded[1]).__name__, net.training
        ([('0', '1')], 'Identity', True)
        >>> x = torch.randn(2, 3, 8, 8)
        >>> torch.allclose(folded(x), net.eval()(x), atol=1e-5)
        True
    """
    if not isinstance(model, nn.Module) or isinstance(model, torch.jit.ScriptModule):
        raise TypeError("fold_batchnorm expected an eager torch.nn.Module, got a "
                        f"{type(model).__name__}")
    args = _as_args(example_inputs)
    working = _copy(model).eval()
    norms = {name: module for name, module in working.named_modules() if _is_norm(module)}
    reasons = {name: problem for name, module in norms.items()
               if (problem := _norm_problem(module)) is not None}
    flow = (_find_flow(working, args) if len(reasons) < len(norms)
            else _Flow("not analysed: no candidate"))
    folded: list[tuple[str, str]] = []
    taken: set[str] = set()
    for name, norm in norms.items():
        if name in reasons:
            continue
        layer_name = flow.pairs.get(name)
        if layer_name is None:
            reasons[name] = flow.reasons.get(name, "not called as a module in the traced "
                                                   "forward")
            continue
        layer = working.get_submodule(layer_name)
        problem = (f"{layer_name} already takes another fold" if layer_name in taken
                   else _layer_problem(layer, layer_name)
                   or _layout_problem(layer, layer_name, norm, flow.shapes.get(layer_name),
                                      layer_name in flow.proven_2d))
        if problem is not None:
            reasons[name] = problem
            continue
        _fold_pair_(layer, norm)
        _replace_everywhere_(working, norm, nn.Identity())
        folded.append((layer_name, name))
        taken.add(layer_name)
    working.eval()
    report = FoldReport(flow.method, folded, [(name, reasons[name]) for name in norms
                                               if name in reasons])
    if not folded:
        why = "it has no BatchNorm layers" if not norms else _reasons_text(report.skipped)
        warnings.warn(f"fold_batchnorm: nothing to fold in this {type(model).__name__} ({why}); "
                      "returning an eval-mode copy", stacklevel=2)
    return (working, report) if return_report else working
