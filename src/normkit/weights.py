r"""Weight normalization (Salimans & Kingma 2016) and its data-dependent initialization.

Weight normalization re-parametrizes a weight ``w`` by a magnitude ``g`` and a
direction ``v``:

.. math:: w = g \, \frac{v}{\lVert v \rVert}

where the norm is taken over every dimension of ``v`` except ``dim`` (so there is one
``g`` per slice along ``dim``), or over the whole tensor when ``dim`` is ``None``.

* :func:`weight_norm` registers the re-parametrization with
  :mod:`torch.nn.utils.parametrize` exactly like
  :func:`torch.nn.utils.parametrizations.weight_norm` does: ``g`` is
  ``parametrizations.<name>.original0`` and ``v`` is ``parametrizations.<name>.original1``,
  so checkpoints move between the two in both directions, and old-style
  ``<name>_g``/``<name>_v`` checkpoints (from the deprecated
  :func:`torch.nn.utils.weight_norm`) load too. The norm is accumulated in float32 or
  better and the backward is hand-derived (:class:`WeightNorm`).
* :func:`remove_weight_norm` bakes ``w`` back into a plain parameter.
* :func:`data_dependent_init_` is the paper's initialization: on one batch, every
  weight-normalized layer is rescaled so that its pre-activations start with zero mean
  and unit variance per output unit.

The mean-only batch normalization of the same paper is
:class:`normkit.norms.mean_only.MeanOnlyBatchNorm1d` / ``2d``.

Weight standardization (Qiao et al. 2019) standardizes each output unit's weights at
every forward (:func:`weight_standardization`); its scaled form with a learnable gain
(Brock et al. 2021) is what normalization-free networks (NF-Nets) use instead of norm
layers, with :func:`activation_gain` giving the constant each activation needs.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd, _ConvTransposeNd
from torch.nn.utils import parametrize

from . import _stats
from ._surgery import own_parametrized_class
from .norms._base import NotScriptable
from .norms._core import check_backend, compiling

__all__ = [
    "WeightNorm",
    "weight_norm",
    "remove_weight_norm",
    "data_dependent_init_",
    "reference_weight_norm",
    "WeightStandardization",
    "weight_standardization",
    "remove_weight_standardization",
    "reference_weight_standardization",
    "activation_gain",
    "fan_in",
    "WS_EPS",
]

# torch's own parametrization class, recognized by remove_weight_norm and
# data_dependent_init_ (private in torch; absent means only normkit's is recognized).
_TorchWeightNorm: type | None = getattr(
    torch.nn.utils.parametrizations, "_WeightNorm", None)

# The paper's draw for a fresh direction: v ~ N(0, 0.05^2).
_REDRAW_STD = 0.05


# --------------------------------------------------------------------------------------
# tensor level
# --------------------------------------------------------------------------------------


def _reduction(ndim: int, dim: int | None) -> tuple[tuple[int, ...], bool]:
    """The dims the norm reduces over, and whether it keeps them (one ``g`` per slice)."""
    if dim is None or ndim == 0:
        return tuple(range(ndim)), False  # one scalar g (torch's g is 0-dim too)
    dim = dim % ndim
    return tuple(d for d in range(ndim) if d != dim), True


def _sum(x: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    # sum(dim=()) would reduce *every* dim; an empty reduction is the identity here
    return x.sum(dims, keepdim=keepdim) if dims else x


def _slice_dtype(v: Tensor, dims: tuple[int, ...]) -> torch.dtype:
    """The dtype weight normalization computes a weight's slices in: the compute dtype, or
    float64 for slices of fewer than :data:`normkit._stats.FEW_VALUES` values. A slice of
    one value has ``v / ||v|| = +-1`` and a zero gradient: float32 left rounding of
    ``g * dw / |v|`` there (2.4e-4 of the scale at ``|v| ~ 0.1``, and second derivatives
    off by 16, noise over ``|v|^2``)."""
    return _stats.reference_dtype(v, _stats.reduced_count(v.shape, dims) if dims else 1)


def _norm(v: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    """2-norm of ``v`` over ``dims``, accumulated in the compute dtype (fp32 or fp64;
    :func:`_slice_dtype`)."""
    ct = _slice_dtype(v, dims)
    if not dims:  # 1-D weight with dim=0 (or a 0-dim weight): the norm of one value
        return v.abs().to(ct)
    return torch.linalg.vector_norm(v, 2, dims, keepdim=keepdim, dtype=ct)


def _check_dim(dim: Any, ndim: int, who: str) -> None:
    if dim is None:
        return
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{who} expected dim to be an int or None, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{who} expected dim in [{-ndim}, {ndim - 1}] (or None for the whole tensor) "
            f"for a {ndim}-D weight, got dim={dim}"
        )


def _check_g(v: Tensor, g: Tensor, dim: int | None, who: str) -> None:
    dims, keepdim = _reduction(v.dim(), dim)
    expected = tuple(1 if d in dims else s for d, s in enumerate(v.shape)) if keepdim else ()
    if tuple(g.shape) != expected:
        raise ValueError(
            f"{who} expected g of shape {expected} (one value per slice of v {tuple(v.shape)} "
            f"along dim={dim}), got g of shape {tuple(g.shape)}"
        )


def reference_weight_norm(v: Tensor, g: Tensor, dim: int | None = 0) -> Tensor:
    r"""``g * v / ||v||`` in plain, differentiable PyTorch math (the test oracle).

    Weight normalization (Salimans & Kingma 2016):

    .. math:: w = g \, \frac{v}{\lVert v \rVert}

    Args:
        v: the direction, any shape.
        g: the magnitude, of the shape of ``||v||`` with ``keepdim`` (``()`` when
            ``dim`` is ``None``).
        dim: the dim that keeps one ``g`` per slice; the norm is over all others.
            ``None`` takes the norm of the whole tensor. Default: ``0``.

    Example:
        >>> v = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
        >>> reference_weight_norm(v, torch.tensor([[10.0], [1.0]]))
        tensor([[6., 8.],
                [0., 1.]])
    """
    dims, keepdim = _reduction(v.dim(), dim)
    ct = _slice_dtype(v, dims)
    vc = v.to(ct)
    norm = _sum(vc * vc, dims, keepdim).sqrt()
    w = vc * (g.to(ct) / norm)
    return w.to(torch.promote_types(v.dtype, g.dtype))


class _WeightNormFunction(torch.autograd.Function):
    """``w = g * v / ||v||`` with a hand-derived backward.

    With ``n = ||v||`` (over the reduced dims) and ``s = sum(dw * v)`` over the same
    dims: ``dg = s / n`` and ``dv = (g / n) * (dw - v * s / n^2)``. Both are computed in
    the compute dtype; only ``v``, ``g`` and ``n`` are saved. Double backward
    (``create_graph=True``) differentiates :func:`reference_weight_norm` instead.
    """

    @staticmethod
    def forward(ctx, v, g, dim):
        dims, keepdim = _reduction(v.dim(), dim)
        norm = _norm(v, dims, keepdim)  # g's shape, compute dtype (_slice_dtype)
        w = v.to(norm.dtype) * (g.to(norm.dtype) / norm)
        ctx.dim = dim
        ctx.save_for_backward(v, g, norm)
        return w.to(torch.promote_types(v.dtype, g.dtype))

    @staticmethod
    def backward(ctx, dw):
        v, g, norm = ctx.saved_tensors
        need_v, need_g = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():
            wanted = [t for t, need in ((v, need_v), (g, need_g)) if need]
            with torch.enable_grad():
                w = reference_weight_norm(v, g, ctx.dim)
                grads = iter(torch.autograd.grad(w, wanted, dw, create_graph=True))
            return (next(grads) if need_v else None, next(grads) if need_g else None, None)
        dims, keepdim = _reduction(v.dim(), ctx.dim)
        vc, dwc = v.to(norm.dtype), dw.to(norm.dtype)
        dot = _sum(dwc * vc, dims, keepdim)  # g's shape: <dw, v> per slice
        dv = dg = None
        if need_g:
            dg = (dot / norm).to(g.dtype)
        if need_v:
            dv = dwc - vc * (dot / norm.square())  # dw minus its component along v
            dv = dv.mul_(g.to(norm.dtype) / norm).to(v.dtype)
        return dv, dg, None


# --------------------------------------------------------------------------------------
# module level
# --------------------------------------------------------------------------------------


class WeightNorm(NotScriptable, nn.Module):
    r"""The weight-normalization parametrization ``(g, v) -> g * v / ||v||``.

    Weight Normalization (Salimans & Kingma 2016):

    .. math:: w = g \, \frac{v}{\lVert v \rVert}

    Registered by :func:`weight_norm` with :mod:`torch.nn.utils.parametrize` (two
    originals: ``original0 = g``, ``original1 = v``), like torch's own
    parametrization. The norm is accumulated in float32 (float64 for float64 weights,
    so float16/bfloat16 weights neither overflow nor lose digits) and the backward is
    hand-derived. A slice of ``v`` that is all zeros gives NaN, as in torch.

    Args:
        dim: the dim that keeps one ``g`` per slice (the norm is over all other dims).
            ``None`` or ``-1`` takes the norm of the whole tensor (one scalar ``g``),
            as in torch's ``weight_norm``; other negative values count from the end.
            Default: ``0``.
        backend: ``"auto"``/``"eager"`` (hand-derived backward) or ``"reference"``
            (autograd through :func:`reference_weight_norm`), read at every forward.
            Default: ``"auto"``.

    Example:
        >>> wn = WeightNorm(dim=0)
        >>> g, v = wn.right_inverse(torch.tensor([[3.0, 4.0], [0.0, 2.0]]))
        >>> g
        tensor([[5.],
                [2.]])
        >>> wn(2 * g, v)
        tensor([[6., 8.],
                [0., 4.]])
    """

    def __init__(self, dim: int | None = 0, *, backend: str = "auto") -> None:
        super().__init__()
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, numbers.Integral)):
            raise TypeError(f"WeightNorm expected dim to be an int or None, got {dim!r}")
        # torch's weight_norm stores None as -1 and reads -1 as "the whole tensor";
        # the same here, so weight_norm(m, dim=-1) means what it means in torch
        self.dim = None if dim is None or dim == -1 else int(dim)
        self.backend = check_backend(backend)

    def forward(self, weight_g: Tensor, weight_v: Tensor) -> Tensor:
        _check_dim(self.dim, weight_v.dim(), "WeightNorm")
        _check_g(weight_v, weight_g, self.dim, "WeightNorm")
        if self.backend == "reference" or compiling():  # (plain ops under forward-mode AD)
            return reference_weight_norm(weight_v, weight_g, self.dim)
        return _WeightNormFunction.apply(weight_v, weight_g, self.dim)

    def right_inverse(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        """Split ``weight`` into ``(g, v) = (||weight||, weight)``: ``forward`` gives it back.

        Example:
            >>> wn = WeightNorm(dim=0)
            >>> w = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
            >>> g, v = wn.right_inverse(w)
            >>> g.flatten().tolist(), torch.allclose(wn(g, v), w)
            ([5.0, 2.0], True)
        """
        _check_dim(self.dim, weight.dim(), "WeightNorm")
        dims, keepdim = _reduction(weight.dim(), self.dim)
        return _norm(weight, dims, keepdim).to(weight.dtype), weight

    def extra_repr(self) -> str:
        base = f"dim={self.dim}"
        return base if self.backend == "auto" else f"{base}, backend={self.backend!r}"


class _OldCheckpointHook:
    """Load-state-dict pre-hook: ``<name>_g``/``<name>_v`` -> ``parametrizations.<name>.*``.

    The same remapping as torch's hook, but inert once ``<name>`` is no longer
    weight-normalized (after :func:`remove_weight_norm`), so an old checkpoint then
    fails to load with the usual missing/unexpected-keys error.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
        if _weight_norm_of(module, self.name) is None:
            return
        g_key, v_key = f"{prefix}{self.name}_g", f"{prefix}{self.name}_v"
        if g_key in state_dict and v_key in state_dict:
            base = f"{prefix}parametrizations.{self.name}"
            state_dict[f"{base}.original0"] = state_dict.pop(g_key)
            state_dict[f"{base}.original1"] = state_dict.pop(v_key)


def _type_name(module: nn.Module) -> str:
    return parametrize.type_before_parametrizations(module).__name__


def _weight_norm_of(module: nn.Module, name: str) -> nn.Module | None:
    """The weight-norm parametrization (normkit's or torch's) on ``module.<name>``, if any."""
    if not parametrize.is_parametrized(module, name):
        return None
    first = module.parametrizations[name][0]
    kinds = (WeightNorm,) if _TorchWeightNorm is None else (WeightNorm, _TorchWeightNorm)
    return first if isinstance(first, kinds) else None


def _wn_dim(param: nn.Module, ndim: int) -> int | None:
    """The reduced-out dim of a parametrization, non-negative, or None (whole tensor)."""
    dim = param.dim
    if not isinstance(param, WeightNorm) and dim == -1:
        return None  # torch stores dim=None as -1, and treats -1 as the whole tensor
    return None if dim is None else dim % ndim


def weight_norm(module: nn.Module, name: str = "weight", dim: int | None = 0, *,
                backend: str = "auto") -> nn.Module:
    r"""Apply weight normalization to ``module.<name>`` (in place; returns ``module``).

    Weight Normalization (Salimans & Kingma 2016), as a parametrization:

    .. math:: w = g \, \frac{v}{\lVert v \rVert}

    A drop-in for :func:`torch.nn.utils.parametrizations.weight_norm`: the same
    parametrization structure and ``state_dict`` keys
    (``parametrizations.<name>.original0`` is ``g``, ``...original1`` is ``v``), so
    checkpoints load in both directions with identical outputs; old-style
    ``<name>_g``/``<name>_v`` checkpoints load too. ``g`` starts at ``||weight||`` and
    ``v`` at ``weight``, so the module computes what it computed before.

    Which ``dim``: ``0`` (the default, as in torch, for every module type) keeps one
    ``g`` per output unit of ``Linear`` and ``ConvNd`` (weight ``(out, in, *k)``) and per
    gate row of RNN weights. ``ConvTransposeNd`` stores its weight as
    ``(in, out / groups, *k)``, so ``dim=0`` is per *input* channel there; use
    ``dim=1`` for one ``g`` per output channel (what :func:`data_dependent_init_`
    needs; with ``groups=1``). ``dim=None`` or ``dim=-1`` normalizes the whole tensor
    (torch's reading of ``-1``); other negative dims count from the end.

    RNNs: ``weight_norm(lstm, "weight_hh_l0")`` works; torch's RNN forward re-reads
    its flat weight list when a weight tensor changes, which a parametrized weight
    does at every access (on CUDA, cuDNN then warns that the weights are not one
    contiguous chunk). As with torch's, such an RNN cannot be deep-copied after a
    forward with autograd on (its flat weight list then holds non-leaf tensors).

    Args:
        module: the module holding the parameter.
        name: the parameter's name. Default: ``"weight"``.
        dim: the dim that keeps one ``g`` per slice, or ``None`` for one scalar ``g``
            (norm of the whole tensor). Default: ``0``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"`` (keyword-only; see
            :class:`WeightNorm`). Default: ``"auto"``.

    Returns:
        ``module``, now parametrized.

    Example:
        >>> m = weight_norm(torch.nn.Linear(20, 40))
        >>> m.parametrizations.weight.original0.shape   # g
        torch.Size([40, 1])
        >>> sorted(m.state_dict())
        ['bias', 'parametrizations.weight.original0', 'parametrizations.weight.original1']
    """
    who = "weight_norm"
    param = _plain_parameter(module, name, who)
    _check_dim(dim, param.dim(), who)
    own_parametrized_class(module)  # (a deep copy's class is shared: keep the change here)
    parametrize.register_parametrization(module, name, WeightNorm(dim, backend=backend),
                                         unsafe=True)
    hook = _OldCheckpointHook(name)
    if hasattr(module, "register_load_state_dict_pre_hook"):
        module.register_load_state_dict_pre_hook(hook)
    else:  # torch 2.4: the same hook through the then-private method (public from 2.5)
        module._register_load_state_dict_pre_hook(hook, with_module=True)
    return module


def _plain_parameter(module: nn.Module, name: str, who: str) -> Tensor:
    """``module.<name>``: an initialized parameter, not parametrized yet, or a ValueError
    (TypeError for a non-module) naming what was expected and what was given."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who} expected a torch.nn.Module, got {type(module).__name__}")
    if parametrize.is_parametrized(module, name):
        raise ValueError(
            f"{who} expected {_type_name(module)}.{name} to be a plain parameter, got one "
            f"already parametrized by "
            f"{', '.join(type(p).__name__ for p in module.parametrizations[name])}; remove "
            f"that first"
        )
    param = module._parameters.get(name) if name in module._parameters else None
    if param is None:
        available = [n for n, p in module._parameters.items() if p is not None]
        if parametrize.is_parametrized(module):
            available += [f"{n} (parametrized)" for n in module.parametrizations]
        extra = " (it is a buffer)" if name in module._buffers else ""
        raise ValueError(
            f"{who} expected {_type_name(module)} to have a parameter named {name!r}, got "
            f"none{extra}; its parameters are: {', '.join(available) or '(none)'}"
        )
    if isinstance(param, nn.parameter.UninitializedParameter):
        raise ValueError(
            f"{who} expected {_type_name(module)}.{name} to be initialized, got the "
            f"placeholder of a lazy module: run one forward pass on a real batch first (a "
            f"lazy module takes its sizes from it), then call {who}")
    return param


def remove_weight_norm(module: nn.Module, name: str = "weight") -> nn.Module:
    """Bake the weight-normalized ``module.<name>`` back into a plain parameter.

    Works for normkit's and torch's weight norm (it wraps
    ``parametrize.remove_parametrizations(module, name, leave_parametrized=True)``):
    the new parameter holds the current ``g * v / ||v||``, so the output is unchanged.
    Unlike torch's function it leaves deep copies of ``module`` alone: torch deletes the
    weight's property from the class that ``copy.deepcopy`` shares between the copies,
    so removing the weight norm from an inference copy broke the training model.

    Args:
        module: a module passed to :func:`weight_norm`.
        name: the parameter's name. Default: ``"weight"``.

    Returns:
        ``module``, with ``<name>`` a plain parameter again.

    Example:
        >>> m = weight_norm(torch.nn.Linear(3, 2))
        >>> sorted(remove_weight_norm(m).state_dict())
        ['bias', 'weight']
    """
    if _weight_norm_of(module, name) is None:
        got = "another parametrization" if parametrize.is_parametrized(module, name) else (
            "a plain tensor" if hasattr(module, name) else "no such tensor")
        raise ValueError(
            f"remove_weight_norm expected {_type_name(module)}.{name} to be weight-normalized, "
            f"got {got}"
        )
    # (torch deletes the property from the class, which a deep copy of the module shares:
    # the copy's .weight would be gone too)
    own_parametrized_class(module)
    parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    return module


# --------------------------------------------------------------------------------------
# weight standardization (Qiao et al. 2019) and its scaled form (Brock et al. 2021)
# --------------------------------------------------------------------------------------

#: ``eps`` of :func:`weight_standardization`, added to the variance: timm's ``StdConv2d``
#: and ``ScaledStdConv2d`` default (BiT's and NF-Nets' own code use 1e-10 and 1e-4
#: under other formulas; Qiao et al. add 1e-5 to the unbiased standard deviation).
WS_EPS = 1e-6


def reference_weight_standardization(weight: Tensor, dim: int | None = 0, eps: float = WS_EPS,
                                     gain: Tensor | None = None, scale: float = 1.0
                                     ) -> Tensor:
    r"""Weight standardization in plain, differentiable PyTorch math (the test oracle).

    .. math:: \hat w = \text{gain} \cdot \text{scale} \cdot
              \frac{w - \mathrm{mean}(w)}{\sqrt{\mathrm{var}(w) + \epsilon}}

    with the mean and biased variance over every dim but ``dim`` (one statistic per
    output unit for ``dim=0``), or over the whole tensor for ``dim=None``, computed in
    float32 (float64 for float64 weights, and for slices of fewer than
    :data:`normkit._stats.FEW_VALUES` values, whose gradient is what ``eps`` leaves of
    cancelling terms).

    Args:
        weight: any shape.
        dim: the dim that keeps one statistic per slice. Default: ``0``.
        eps: added to the variance. Default: :data:`WS_EPS`.
        gain: per-slice gain (the shape of the statistics with keepdim) or ``None``.
        scale: a constant factor, e.g. ``gamma / sqrt(fan_in)`` for Scaled WS.

    Example:
        >>> w = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
        >>> reference_weight_standardization(w, eps=0.0)[0]
        tensor([-1.,  1.])
    """
    dims, keepdim = _reduction(weight.dim(), dim)
    if not dims:
        dims = tuple(range(weight.dim()))  # (a slice of one value: itself)
    # (float64 for slices of fewer than _stats.FEW_VALUES values, e.g. a fan-in of 2:
    # their gradient is what eps leaves of cancelling terms, 1.4e-4 off in float32)
    wide = _stats.reference_dtype(weight, _stats.reduced_count(weight.shape, dims))
    w = weight if weight.dtype == wide else weight.to(wide)
    # two passes (mean, then the centered values' mean square), the same ops with and
    # without autograd: _stats.moments picks another reduction without it, which would
    # make the weight a training step uses differ by an ulp from the one
    # remove_weight_standardization bakes
    mean = w.mean(dims, keepdim=True)
    centered = w - mean
    var = centered.square().mean(dims, keepdim=True)
    factor = torch.rsqrt(var + eps) * scale
    if gain is not None:
        factor = factor * _stats.upcast(gain).reshape(factor.shape)
    out_dtype = weight.dtype if gain is None else torch.promote_types(weight.dtype, gain.dtype)
    return (centered * factor).to(out_dtype)


def fan_in(weight: Tensor, dim: int | None = 0) -> int:
    """The number of values each standardized slice holds: ``in * prod(kernel)`` of a
    conv weight ``(out, in / groups, *kernel)`` with ``dim=0``.

    Example:
        >>> fan_in(torch.nn.Conv2d(3, 8, 3).weight)
        27
    """
    dims, _ = _reduction(weight.dim(), dim)
    return _stats.reduced_count(weight.shape, dims) if dims else 1


class WeightStandardization(NotScriptable, nn.Module):
    r"""The weight-standardization parametrization: each slice of the weight standardized
    to zero mean and unit variance, optionally times a learnable gain and a constant.

    Weight Standardization (Qiao et al. 2019, with GroupNorm: BatchNorm's accuracy at
    one or two images per device) and Scaled Weight Standardization (Brock et al. 2021,
    NF-Nets: no normalization layer at all):

    .. math:: \hat w = \text{gain} \cdot \frac{\gamma}{\sqrt{N}} \cdot
              \frac{w - \mathrm{mean}(w)}{\sqrt{\mathrm{var}(w) + \epsilon}}

    over the ``N`` values of each slice (the fan-in of a conv or linear weight for
    ``dim=0``). Registered by :func:`weight_standardization`; see there.

    Args:
        dim: the dim that keeps one statistic per slice. Default: ``0``.
        eps: added to the (biased) variance. Default: :data:`WS_EPS`.
        gamma: ``None`` for plain WS; a float for Scaled WS, which multiplies by
            ``gamma / sqrt(N)`` (``gamma``: :func:`activation_gain` of the activation
            whose output this layer reads, 1 for a layer reading the unit-variance
            input). Default: ``None``.
        gain: a learnable per-slice gain (``original0``, initialized to 1), as NF-Nets
            and timm's ``ScaledStdConv2d`` have. Default: ``False``.

    Example:
        >>> ws = WeightStandardization()
        >>> w = ws(torch.tensor([[1.0, 3.0], [2.0, 6.0]]))
        >>> w.mean(1), w.var(1, correction=0)
        (tensor([0., 0.]), tensor([1.0000, 1.0000]))
    """

    def __init__(self, dim: int | None = 0, eps: float = WS_EPS, *,
                 gamma: float | None = None, gain: bool = False) -> None:
        super().__init__()
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, numbers.Integral)):
            raise TypeError(f"WeightStandardization expected dim to be an int or None, got "
                            f"{dim!r}")
        _check_nonnegative(eps, "eps", "WeightStandardization")
        if gamma is not None:
            _check_nonnegative(gamma, "gamma", "WeightStandardization")
        self.dim = None if dim is None else int(dim)
        self.eps = float(eps)
        self.gamma = None if gamma is None else float(gamma)
        self.gain = bool(gain)

    def _scale(self, weight: Tensor) -> float:
        return 1.0 if self.gamma is None else self.gamma / math.sqrt(fan_in(weight, self.dim))

    def forward(self, *originals: Tensor) -> Tensor:
        if len(originals) != 1 + self.gain:
            raise ValueError(f"WeightStandardization(gain={self.gain}) expected "
                             f"{1 + self.gain} tensor(s), got {len(originals)}")
        gain, weight = originals if self.gain else (None, originals[0])
        _check_dim(self.dim, weight.dim(), "WeightStandardization")
        if gain is not None:
            _check_g(weight, gain, self.dim, "WeightStandardization")
        return reference_weight_standardization(weight, self.dim, self.eps, gain,
                                                self._scale(weight))

    def right_inverse(self, weight: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """The originals from a weight: the weight itself, with a gain of ones first when
        ``gain=True`` (standardizing is not invertible: the layer's output changes).

        Example:
            >>> gain, w = WeightStandardization(gain=True).right_inverse(torch.ones(3, 2))
            >>> gain.shape, w.shape
            (torch.Size([3, 1]), torch.Size([3, 2]))
        """
        _check_dim(self.dim, weight.dim(), "WeightStandardization")
        if not self.gain:
            return weight
        dims, keepdim = _reduction(weight.dim(), self.dim)
        shape = tuple(1 if d in dims else s for d, s in enumerate(weight.shape)) if keepdim \
            else ()
        return torch.ones(shape, dtype=weight.dtype, device=weight.device), weight

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, eps={self.eps:g}"
        if self.gamma is not None:
            text += f", gamma={self.gamma:g}"
        return text + (", gain=True" if self.gain else "")


def _check_nonnegative(value: Any, name: str, who: str) -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"{who} expected {name} to be a finite number >= 0, got {value!r}")


def weight_standardization(module: nn.Module, name: str = "weight", dim: int | None = 0, *,
                           eps: float = WS_EPS, gamma: float | None = None,
                           gain: bool = False) -> nn.Module:
    r"""Standardize ``module.<name>`` at every forward (in place; returns ``module``).

    Weight Standardization (Qiao et al. 2019): each output unit's weights are
    standardized to zero mean and unit variance before the layer uses them; with
    GroupNorm it matches BatchNorm's accuracy where BatchNorm fails, at one or two
    images per device. Scaled Weight Standardization (Brock et al. 2021, NF-Nets) adds
    ``gamma / sqrt(fan_in)`` and a learnable gain so that a network *without*
    normalization layers keeps its activations' variance: pass ``gamma`` and
    ``gain=True``. ``gamma`` is the :func:`activation_gain` of the activation whose
    output the layer reads (the one *before* it; 1.0 for a layer reading the input):
    NF-Nets multiply each activation's output by it, the same as scaling the next
    layer's weight, which is what this does -- any activation, homogeneous or not.
    ``nn.Conv2d`` with this is timm's ``ScaledStdConv2d`` (``gamma=1.0, eps=1e-6,
    gain_init=1``; timm puts the activation's gamma on the activation), and with
    ``gamma=None`` its ``StdConv2d``. Pair Scaled WS with
    :func:`normkit.adaptive_clip_grad_` (NF-Nets' AGC).

    Registered with :mod:`torch.nn.utils.parametrize`: the stored parameter is
    ``parametrizations.<name>.original`` (``original1``, with the gain as
    ``original0``, when ``gain=True``); :func:`remove_weight_standardization` bakes the
    standardized weight back. The statistics are computed in float32 (float64 for
    float64 weights); autograd differentiates through them, as the papers do.

    Args:
        module: the module holding the parameter (``Conv*d``, ``Linear``, ...).
        name: the parameter's name. Default: ``"weight"``.
        dim: the dim that keeps one statistic per slice: ``0``, one per output unit of
            ``Linear``/``ConvNd``; ``1`` for ``ConvTranspose`` (``groups=1``);
            ``None``, the whole tensor. Default: ``0``.
        eps: added to the biased variance. Default: :data:`WS_EPS` (timm's).
        gamma: ``None`` for plain WS, else Scaled WS's constant: the
            :func:`activation_gain` of the activation before the layer. Default: ``None``.
        gain: add a learnable per-slice gain. Default: ``False``.

    Returns:
        ``module``, now parametrized.

    Example:
        >>> conv = weight_standardization(torch.nn.Conv2d(3, 8, 3))
        >>> w = conv.weight.flatten(1)
        >>> mean, var = w.mean(1), w.var(1, correction=0)
        >>> bool(mean.abs().max() < 1e-6), bool((var - 1).abs().max() < 1e-3)
        (True, True)
        >>> nf = weight_standardization(torch.nn.Conv2d(3, 8, 3), gamma=activation_gain("relu"),
        ...                             gain=True)
        >>> sorted(nf.state_dict())
        ['bias', 'parametrizations.weight.original0', 'parametrizations.weight.original1']
    """
    who = "weight_standardization"
    param = _plain_parameter(module, name, who)
    _check_dim(dim, param.dim(), who)
    if fan_in(param, dim) < 2:
        raise ValueError(
            f"{who} expected slices of at least 2 values along the dims other than "
            f"dim={dim}, got {_type_name(module)}.{name} of shape {tuple(param.shape)}, one "
            "value per slice: standardized, every value would be 0 (a depthwise 1x1 "
            "convolution has fan-in 1)")
    parametrization = WeightStandardization(dim, eps, gamma=gamma, gain=gain)
    own_parametrized_class(module)  # (a deep copy's class is shared: keep the change here)
    parametrize.register_parametrization(module, name, parametrization, unsafe=True)
    return module


def remove_weight_standardization(module: nn.Module, name: str = "weight") -> nn.Module:
    """Bake the standardized ``module.<name>`` back into a plain parameter (the output
    is unchanged), e.g. for inference or export.

    Example:
        >>> m = weight_standardization(torch.nn.Linear(3, 2))
        >>> w = m.weight
        >>> torch.equal(remove_weight_standardization(m).weight, w), sorted(m.state_dict())
        (True, ['bias', 'weight'])
    """
    if not (parametrize.is_parametrized(module, name)
            and isinstance(module.parametrizations[name][0], WeightStandardization)):
        got = "another parametrization" if parametrize.is_parametrized(module, name) else (
            "a plain tensor" if hasattr(module, name) else "no such tensor")
        raise ValueError(f"remove_weight_standardization expected {_type_name(module)}.{name} "
                         f"to be weight-standardized, got {got}")
    own_parametrized_class(module)
    parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    return module


def activation_gain(activation: str | Callable[[Tensor], Tensor]) -> float:
    r"""Scaled WS's ``gamma`` for an activation: ``1 / std(f(x))`` for ``x ~ N(0, 1)``,
    so that the activation of a unit-variance input, times it, has unit variance again
    (Brock et al. 2021, section 3: the factor on the activation's output, or on the
    next layer's weight; they estimate it from samples; here Gauss-Legendre quadrature
    against the normal density in float64, split at the kink at 0).

    Args:
        activation: ``"relu"``, ``"gelu"``, ``"silu"``, ``"tanh"``, ``"elu"``,
            ``"leaky_relu"`` (slope 0.01), ``"sigmoid"``, ``"softplus"``,
            ``"identity"``, or any callable on a float64 tensor.

    Example:
        >>> round(activation_gain("relu"), 5)  # 1 / sqrt(1/2 - 1/(2 pi))
        1.71286
        >>> round(activation_gain("identity"), 9)
        1.0
    """
    functions = {
        "identity": lambda x: x, "relu": torch.relu, "gelu": nn.functional.gelu,
        "silu": nn.functional.silu, "tanh": torch.tanh, "elu": nn.functional.elu,
        "leaky_relu": nn.functional.leaky_relu, "sigmoid": torch.sigmoid,
        "softplus": nn.functional.softplus,
    }
    if isinstance(activation, str):
        if activation not in functions:
            raise ValueError(f"activation_gain expected one of {', '.join(functions)} or a "
                             f"callable, got {activation!r}")
        activation = functions[activation]
    elif not callable(activation):
        raise TypeError(f"activation_gain expected an activation name or a callable, got "
                        f"{type(activation).__name__}")
    nodes, weights = _normal_nodes()
    values = activation(nodes)
    if not isinstance(values, Tensor) or values.shape != nodes.shape:
        raise ValueError("activation_gain expected the activation to map a float64 tensor "
                         "to a tensor of the same shape")
    mean = (weights * values).sum()
    var = (weights * (values - mean).square()).sum()
    if not var > 0:
        raise ValueError("activation_gain expected an activation whose output varies, got "
                         f"a variance of {float(var):g}")
    return float(var.rsqrt())


def _normal_nodes(count: int = 200, reach: float = 12.0) -> tuple[Tensor, Tensor]:
    """Nodes and weights (summing to 1) that integrate against the standard normal
    density: Gauss-Legendre on ``[-reach, 0]`` and ``[0, reach]`` separately, so that
    activations with a kink at 0 (ReLU, LeakyReLU, ELU) are integrated exactly on each
    side, float64."""
    import numpy as np

    unit, unit_weights = np.polynomial.legendre.leggauss(count)
    half = (unit + 1) * (reach / 2)  # [0, reach]
    nodes = np.concatenate([-half[::-1], half])
    weights = np.concatenate([unit_weights[::-1], unit_weights]) * (reach / 2)
    weights = weights * np.exp(-nodes ** 2 / 2)
    weights = weights / weights.sum()
    return (torch.from_numpy(nodes).to(torch.float64),
            torch.from_numpy(weights).to(torch.float64))


# --------------------------------------------------------------------------------------
# data-dependent initialization
# --------------------------------------------------------------------------------------


@dataclass
class _Layer:
    """One weight-normalized layer that data_dependent_init_ can initialize."""

    name: str
    module: nn.Module
    g: Tensor
    v: Tensor
    out_channels: int

    @property
    def label(self) -> str:
        """The name in messages (``<model>`` for the model itself, whose name is ``""``)."""
        return self.name or "<model>"


def _find_weight_normed(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    found = []
    for qualname, module in model.named_modules():
        if parametrize.is_parametrized(module):
            found += [(qualname, module, n) for n in module.parametrizations
                      if _weight_norm_of(module, n) is not None]
    return found


def _plan(qualname: str, module: nn.Module, name: str) -> _Layer | None:
    """The layer's (g, v, out_channels), None for an unsupported type, or a ValueError."""
    if name != "weight" or not isinstance(module, (nn.Linear, _ConvNd)):
        return None
    plist = module.parametrizations.weight
    g, v = plist.original0, plist.original1
    transposed = isinstance(module, _ConvTransposeNd)
    out_axis = 1 if transposed else 0
    dim = _wn_dim(plist[0], v.dim())
    label = f"layer {qualname or '<model>'!r} ({_type_name(module)})"
    if dim != out_axis:
        raise ValueError(
            f"data_dependent_init_ needs one g per output channel, i.e. "
            f"weight_norm(..., dim={out_axis}) for {_type_name(module)}; {label} has "
            f"dim={dim}"
        )
    if parametrize.is_parametrized(module, "bias"):
        raise ValueError(f"data_dependent_init_ needs a plain bias to shift; {label} has a "
                         f"parametrized bias")
    out_channels = module.out_features if isinstance(module, nn.Linear) else module.out_channels
    if g.numel() != out_channels:  # ConvTranspose with groups > 1 shares g across groups
        raise ValueError(
            f"data_dependent_init_ needs one g per output channel; {label} has "
            f"{out_channels} output channels but {g.numel()} values of g (groups="
            f"{getattr(module, 'groups', 1)}: ConvTranspose shares g across groups)"
        )
    return _Layer(qualname, module, g, v, out_channels)


def _call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def data_dependent_init_(
    model: nn.Module,
    batch: Any,
    *,
    init_scale: float = 1.0,
    redraw_v: bool = False,
    generator: torch.Generator | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, dict[str, Tensor]]:
    r"""Data-dependent initialization of every weight-normalized layer, in forward order.

    Salimans & Kingma 2016, section 2.2: on one batch, each weight-normalized layer's
    pre-activations ``t`` get mean ``mu`` and standard deviation ``sigma`` per output
    unit (``Linear``: the last dim; ``ConvNd``/``ConvTransposeNd``: dim 1, dim 0 for
    unbatched input), and then

    .. math::
        g \leftarrow g \, \frac{s}{\sigma}, \qquad b \leftarrow (b - \mu) \frac{s}{\sigma}

    with ``s = init_scale``, so the layer's new pre-activations are exactly
    ``(t - mu) * s / sigma``: zero mean and standard deviation ``s`` on this batch.
    (The paper starts from ``g = 1, b = 0``, giving ``g = 1/sigma, b = -mu/sigma``.)

    Sequential and exact, in one forward pass: a forward hook on each layer (run
    before any other hook of that layer) measures its output, updates ``g`` and ``b``,
    then recomputes the layer's output with the new parameters from the same inputs
    and passes that on, so every later layer sees exactly what a fresh forward of the
    already-initialized earlier layers produces, whatever the model's control flow
    (residual connections, shared trunks, non-``Sequential`` forwards). A layer called
    several times in one forward is initialized on its first call.

    Details:

    * Supported layers: ``Linear`` and ``ConvNd``/``ConvTransposeNd`` whose ``weight``
      is weight-normalized (normkit's or torch's ``parametrizations.weight_norm``)
      with one ``g`` per output channel (``dim=0``; ``dim=1`` and ``groups=1`` for
      ``ConvTranspose``), else a ValueError before anything changes. Other
      weight-normalized modules (e.g. an LSTM) are skipped with a warning.
    * A layer without bias only gets ``g`` rescaled (its mean stays); a warning
      names it. A unit with ``sigma = 0`` on this batch is only centered.
    * The pass runs under ``torch.no_grad()`` with every module in training mode
      (dropout and batch statistics as in training); afterwards each module's
      train/eval flag and every buffer (e.g. BatchNorm running statistics) are
      restored, so only ``g``, ``b`` (and ``v`` with ``redraw_v``) change.
    * ``redraw_v=True`` first redraws ``v ~ N(0, 0.05^2)`` (the paper's choice) for
      every supported layer, in ``named_modules`` order, from ``generator``.

    Args:
        model: the model (modified in place).
        batch: the data. The default call is ``model(**batch)`` for a mapping,
            ``model(*batch)`` for a tuple, and ``model(batch)`` otherwise (a tensor, a
            list); pass ``forward`` for anything else, e.g. an ``(input, target)``
            pair: ``forward=lambda m, b: m(b[0])``.
        init_scale: the standard deviation ``s`` to start with. Default: ``1.0``.
        redraw_v: redraw ``v`` from ``N(0, 0.05^2)`` first. Default: ``False``.
        generator: the random generator for ``redraw_v``. Default: ``None`` (global).
        forward: ``forward(model, batch)`` runs the model. Default: see ``batch``.

    Returns:
        ``{layer_name: {"mean": mu, "std": sigma}}`` in forward order: the statistics
        (shape ``(out_channels,)``, float32 or float64) that were corrected.

    Example:
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 8)), torch.nn.ReLU(),
        ...                             weight_norm(torch.nn.Linear(8, 2)))
        >>> x = torch.randn(256, 4) * 3 + 1
        >>> stats = data_dependent_init_(model, x)
        >>> list(stats)
        ['0', '2']
        >>> t = model(x)                       # the last layer's pre-activations
        >>> bool(t.mean(0).abs().max() < 1e-5)
        True
        >>> bool((t.std(0, correction=0) - 1).abs().max() < 1e-5)
        True
    """
    who = "data_dependent_init_"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who} expected a torch.nn.Module, got {type(model).__name__}")
    if (isinstance(init_scale, bool) or not isinstance(init_scale, numbers.Real)
            or not math.isfinite(init_scale) or init_scale <= 0):
        raise ValueError(f"{who} expected a positive, finite init_scale, got {init_scale!r}")
    found = _find_weight_normed(model)
    if not found:
        raise ValueError(
            f"{who} expected a model with at least one weight-normalized layer "
            f"(normkit.weights.weight_norm or torch.nn.utils.parametrizations.weight_norm), "
            f"got a {type(model).__name__} with none"
        )
    layers, skipped = [], []
    for qualname, module, name in found:
        layer = _plan(qualname, module, name)
        if layer is None:
            skipped.append(f"{qualname or '<model>'}.{name} ({_type_name(module)})")
        else:
            layers.append(layer)
    if skipped:
        warnings.warn(
            f"{who} skipped weight-normalized tensors it cannot initialize (only the weight "
            f"of Linear/ConvNd/ConvTransposeNd layers): {', '.join(skipped)}", stacklevel=2)
    if not layers:
        raise ValueError(
            f"{who} expected at least one weight-normalized Linear/ConvNd/ConvTransposeNd "
            f"weight, got only: {', '.join(skipped)}"
        )
    if redraw_v:
        with torch.no_grad():
            for layer in layers:
                layer.v.normal_(0.0, _REDRAW_STD, generator=generator)

    stats: dict[str, dict[str, Tensor]] = {}
    no_bias: list[str] = []  # layers that cannot be centered
    constant: list[str] = []  # layers with units of zero spread on this batch

    def make_hook(layer: _Layer):
        def hook(module, args, kwargs, output):
            if layer.name in stats:  # called again in the same forward: already done
                return None
            if not isinstance(output, Tensor):
                raise TypeError(f"{who} expected {layer.label!r} to return a tensor, got "
                                f"{type(output).__name__}")
            axis = output.dim() - 1 if isinstance(module, nn.Linear) else (
                1 if output.dim() == layer.v.dim() else 0)  # conv: (N, C, *) or (C, *)
            dims = tuple(d for d in range(output.dim()) if d != axis)
            m = _stats.moments(_stats.upcast(output), dims)
            mean, std = m.mean.reshape(-1), m.var.sqrt().reshape(-1)  # (C,)
            live = std > 0
            scale = torch.where(live, init_scale / torch.where(live, std, 1.0), 1.0)
            g = layer.g
            g.copy_(_stats.upcast(g) * scale.view(g.shape))
            bias = module.bias
            if bias is not None:
                bias.copy_((_stats.upcast(bias) - mean) * scale)
            if bias is None:
                no_bias.append(layer.label)
            if not bool(live.all()):
                constant.append(f"{layer.label} ({int((~live).sum())} of {live.numel()})")
            stats[layer.name] = {"mean": mean.clone(), "std": std.clone()}
            return module.forward(*args, **kwargs)  # exact: the new parameters, same input
        return hook

    modes = [(m, m.training) for m in model.modules()]
    saved_buffers = [(b, b.clone()) for b in model.buffers()]
    handles = []
    try:
        for layer in layers:
            handles.append(layer.module.register_forward_hook(
                make_hook(layer), with_kwargs=True, prepend=True))
        model.train()
        with torch.no_grad():
            (forward or _call_model)(model, batch)
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes:
            module.training = mode
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
    if not stats:
        raise ValueError(
            f"{who} expected the forward to call at least one weight-normalized layer, got "
            f"none called (layers: {', '.join(layer.label for layer in layers)})"
        )
    missed = [layer.label for layer in layers if layer.name not in stats]
    if missed:
        warnings.warn(f"{who}: these weight-normalized layers were not called by the "
                      f"forward and were left as they were: {', '.join(missed)}", stacklevel=2)
    if no_bias:
        warnings.warn(f"{who}: layers without bias were only rescaled, their mean stays: "
                      f"{', '.join(no_bias)}", stacklevel=2)
    if constant:
        warnings.warn(f"{who}: units with a constant output on this batch (std 0) were "
                      f"only centered: {', '.join(constant)}", stacklevel=2)
    return stats
