r"""Fused ops: residual add + LayerNorm/RMSNorm, and BatchNorm/GroupNorm + activation.

Two patterns dominate the normalization layers of modern networks, and eager PyTorch
runs each of them as separate ops, each with its own passes over memory, its own
freshly allocated (page-faulted) output and its own autograd node:

* the **pre-norm Transformer block**, ``new_residual = x + residual`` then
  ``normed = norm(new_residual)`` (:func:`add_layer_norm`, :func:`add_rms_norm`,
  :class:`AddLayerNorm`, :class:`AddRMSNorm`);
* the **CNN block**, ``act(batch_norm(x))`` (:func:`batch_norm_act`,
  :class:`BatchNormAct1d`/``2d``/``3d``, :func:`group_norm_act`, :class:`GroupNormAct`),
  optionally as In-Place Activated BatchNorm (``memory="inplace"``).

Each is one autograd Function with a hand-derived backward (layer 2 of normkit's
design); the plain compositions are the references, and ``backend="reference"`` runs
them. The statistics come from :mod:`normkit._stats` or from torch's own kernels where
:mod:`normkit.kernels.native` proves them accurate for the input at hand (otherwise the
compensated path of :mod:`normkit.norms._core` takes over), so a large common offset
costs speed, never precision.

Residual add + norm
-------------------
With ``s = x + residual``, ``normed = norm(s)``, the gradient reaching ``s`` is
``d(new_residual) + norm'(s)^T d(normed)``; ``x`` and ``residual`` receive that same
tensor (the two gradients merge), so the backward computes one ``dx`` and returns it
for both. LayerNorm runs torch's fused kernels on the sum where they are accurate
(float32/float64 sums whose rows have ``|mean| / std <= 32``, see
:mod:`normkit.kernels.native`), normkit's compensated core otherwise (recomputed in
backward); RMSNorm has no such hazard, and its backward is

.. math::
    t = d\hat y \odot s,\quad dw = t^\top r,\quad
    ds = d(\text{new\_residual}) + r \odot \bigl(d\hat y\, w - s\, r^2\, (t\,w)/K\bigr)

with ``r = 1/sqrt(mean(s^2) + eps)`` per row: the one product ``t`` feeds both the
weight gradient and the row projection (two matrix-vector products), and is then
reused as the output buffer.

Norm + activation
-----------------
``z = act(y)``, ``y = xhat * gamma + beta``. Where the activation's derivative can be
read off its output (ReLU, LeakyReLU and ELU with non-negative slope, identity) it is
applied in place on the normalized output, so no second activation-sized buffer is
allocated or kept; SiLU and GELU keep ``y`` for their derivative, as torch does. The
norm's backward then runs on the resulting ``dy``. BatchNorm statistics come from the
slice-sums engine (:mod:`normkit.kernels.channels`) for large contiguous input and large
channels-last batches, otherwise from torch's own kernels (:func:`_fast_batch_norm`);
GroupNorm's from torch's fused kernel (contiguous, and small channels-last images) or
from the engine (larger channels-last images); each is kept only where its accuracy
bound holds for the data at hand, otherwise normkit's compensated core computes them.

In-Place Activated BatchNorm (Rota Bulò, Porzi & Kontschieder, CVPR 2018)
--------------------------------------------------------------------------
With ``memory="inplace"`` (invertible activations: LeakyReLU with a positive slope,
ELU with a positive ``alpha``, identity) only the *output* ``z`` and per-channel
statistics are saved. The backward recovers ``y = act^{-1}(z)`` and, with
``u = y - beta = gamma * xhat``,

.. math::
    \frac{\partial L}{\partial\gamma} = \frac{\sum dy\,u}{\gamma},\quad
    \frac{\partial L}{\partial x} = \sigma^{-1}\Bigl(\gamma\,(dy - \overline{dy})
        - u\,\frac{\overline{dy\,u}}{\gamma}\Bigr),

i.e. torch's BatchNorm backward run on ``y`` with mean ``beta``, inverse std
``1/gamma`` and weight ``gamma^2 / sigma``.

*The choice for gamma.* inplace_abn makes the affine invertible by training
``|gamma| + eps`` instead of ``gamma``; that changes the forward, so a checkpoint of a
plain BatchNorm would compute something else. normkit keeps the forward exact (a
drop-in) and decides per channel instead: a channel is *recoverable* when
``|gamma| >= |beta| / R`` and ``|gamma|`` is a normal float, with ``R = 64`` for
float32/float64 outputs and ``R = 4`` for float16/bfloat16 (recovering ``xhat`` from
the stored output costs about ``u * (|xhat| + |beta/gamma|)``, ``u`` the output's unit
roundoff, so ``R`` bounds the extra error by ``R u``). For the other channels --
e.g. ``gamma`` initialised to zero, as in zero-init residual blocks -- the normalized
input of just those channels is saved too. Gradients therefore match the reference
for every ``gamma``; the memory saving holds for the recoverable channels. (Below four
values per channel, a batch of 2-3 without spatial dims, no channel is: the gradient is
what ``eps`` leaves of cancelling terms, ``normkit._stats.FEW_VALUES``, and ``xhat``
recovered from the output lacks the digits for it, 1.2e-4 off at two values. Such calls
with a gradient run as ``memory="standard"`` does, in float64, and overwrite nothing.)
ELU's inverse ``log1p(z / alpha)`` recovers ``y < 0`` with an absolute error of about
``u * exp(-y)`` (1e-4 at ``y = -7`` in float32, 0.2 at ``y = -4`` in bfloat16), so
strongly negative pre-activations get less accurate gradients -- inherent to storing
only ELU's output (inplace_abn has the same limit); LeakyReLU and identity are exact.

*When the input buffer is overwritten.* In training with ``memory="inplace"``, the
output is written into the input's memory (like ``nn.ReLU(inplace=True)``) when the
input is an intermediate result of the autograd graph (it requires grad and is not a
leaf), is not a view, is dense (contiguous or channels-last) and float32/float64.
Autograd's version counter then rejects, at backward, any op that saved the input
before it was overwritten; reading the input *after* the layer (e.g. a skip
connection that adds the layer's input) would see the output, as with any in-place
op. Otherwise the output goes to a new buffer, and the memory saving is the same
(the input is not saved, so it is freed as soon as the caller drops it).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.fx import Proxy
from torch.nn import functional as TF

from .. import _stats
from .. import functional as F
from ..kernels import channels, library, native
from ..kernels import triton as tk
from ..kernels.memory import empty_like, fresh_out_like, out_like
from . import _nested
from ._base import BackendMixin, fx_leaf
from ._core import (
    affine_view,
    check_backend,
    check_channels,
    check_floating,
    compiling,
    in_graph,
    normalize,
    reference_normalize,
    shape_str,
)
from .batch import _BatchNormForward
from .group import TorchGroupNorm

__all__ = [
    "ACTIVATIONS",
    "INVERTIBLE_ACTIVATIONS",
    "MEMORY_MODES",
    "Activation",
    "make_activation",
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm_act",
    "group_norm_act",
    "AddLayerNorm",
    "AddRMSNorm",
    "BatchNormAct1d",
    "BatchNormAct2d",
    "BatchNormAct3d",
    "GroupNormAct",
]

#: Activations the fused norm + activation layers accept.
ACTIVATIONS = ("relu", "leaky_relu", "elu", "silu", "gelu", "identity")
#: Activations ``memory="inplace"`` accepts (their output determines their input).
INVERTIBLE_ACTIVATIONS = ("leaky_relu", "elu", "identity")
#: ``memory`` modes of :class:`BatchNormAct2d` and friends.
MEMORY_MODES = ("standard", "inplace")

_ATEN = torch.ops.aten
_WIDE = (torch.float32, torch.float64)
#: Largest |beta| / |gamma| for which a channel's input is recovered from its output.
_RECOVERY_RATIO = {torch.float64: 64.0, torch.float32: 64.0, torch.float16: 4.0,
                   torch.bfloat16: 4.0}


# --------------------------------------------------------------------------- activations


def _invertible(name: str, negative_slope: float, alpha: float) -> bool:
    """:attr:`Activation.invertible` as a function (torch 2.4's torch.compile cannot read
    a NamedTuple's properties, and :func:`make_activation` runs inside compiled code)."""
    if name == "identity":
        return True
    if name == "leaky_relu":
        return negative_slope > 0.0
    if name == "elu":
        return alpha > 0.0
    return False


class Activation(NamedTuple):
    """An activation of the fused layers: forward, derivative and (where it exists) inverse.

    Build it with :func:`make_activation`, which validates the arguments.

    Example:
        >>> act = make_activation("leaky_relu", negative_slope=0.1)
        >>> z = act(torch.tensor([-2.0, 3.0]))
        >>> z, act.inverse(z)
        (tensor([-0.2000,  3.0000]), tensor([-2.,  3.]))
    """

    name: str
    negative_slope: float = 0.01
    alpha: float = 1.0

    @property
    def from_output(self) -> bool:
        """True when the derivative can be computed from the output alone."""
        if self.name in ("relu", "identity"):
            return True
        if self.name == "leaky_relu":
            return self.negative_slope >= 0.0
        if self.name == "elu":
            return self.alpha >= 0.0
        return False

    @property
    def invertible(self) -> bool:
        """True when the input can be recovered from the output (``memory="inplace"``)."""
        return _invertible(self.name, self.negative_slope, self.alpha)

    def __call__(self, y: Tensor) -> Tensor:
        """The activation, out of place (differentiable by autograd)."""
        if self.name == "relu":
            return TF.relu(y)
        if self.name == "leaky_relu":
            return TF.leaky_relu(y, self.negative_slope)
        if self.name == "elu":
            return TF.elu(y, self.alpha)
        if self.name == "silu":
            return TF.silu(y)
        if self.name == "gelu":
            return TF.gelu(y)
        return y

    def apply_(self, y: Tensor) -> Tensor:
        """The activation in place on ``y`` (a buffer no autograd node has saved)."""
        if self.name == "relu":
            y.relu_()
        elif self.name == "leaky_relu":
            TF.leaky_relu_(y, self.negative_slope)
        elif self.name == "elu":
            TF.elu_(y, self.alpha)
        elif self.name == "silu":
            TF.silu(y, inplace=True)
        elif self.name == "gelu":
            _ATEN.gelu_(y)
        return y

    def backward(self, dz: Tensor, z: Tensor | None, y: Tensor | None) -> Tensor:
        """``dL/dy`` from ``dL/dz`` and the output ``z`` (``from_output``) or the input ``y``;
        a large result onto the output cache (:func:`~normkit.kernels.memory.out_like`)."""
        name, use_z = self.name, self.from_output
        if name == "identity":
            return dz
        out = out_like(dz)

        def call(op, *args):  # (the structured out= form into ``out`` where there is one)
            return op(*args) if out is None else op.grad_input(*args, grad_input=out)

        if name == "relu":
            return call(_ATEN.threshold_backward, dz, z if use_z else y, 0)
        if name == "leaky_relu":
            return call(_ATEN.leaky_relu_backward, dz, z if use_z else y, self.negative_slope,
                        use_z)
        if name == "elu":
            return call(_ATEN.elu_backward, dz, self.alpha, 1, 1, use_z, z if use_z else y)
        if name == "silu":
            return call(_ATEN.silu_backward, dz, y)
        return call(_ATEN.gelu_backward, dz, y)

    def as_taken(self, y: Tensor, z: Tensor | None, y_forward: Tensor | None) -> Tensor:
        """The activation of ``y``, differentiable, each kink's side taken as the forward
        took it (from its output ``z`` when ``from_output``, else its input
        ``y_forward``): for double backward through a recomputed ``y``. Recomputed in
        another precision, an input within rounding of zero may fall on the other side,
        where ReLU's, LeakyReLU's and ELU's derivatives differ by the whole upstream
        gradient; the first-order backward decides from the forward's values, and so
        must its derivative.

        Example:
            >>> act = make_activation("relu")
            >>> y = torch.tensor([1e-9, -1.0], requires_grad=True)
            >>> z = act.as_taken(y, torch.tensor([0.0, 0.0]), None)  # the forward said 0
            >>> torch.autograd.grad(z.sum(), y)[0]
            tensor([0., 0.])
        """
        if self.name not in ("relu", "leaky_relu", "elu"):
            return self(y)
        decided = z if self.from_output else y_forward
        positive = decided > 0
        if self.name == "relu":
            return torch.where(positive, y, 0.0)
        if self.name == "leaky_relu":
            return torch.where(positive, y, y * self.negative_slope)
        # At exactly 0 torch's ELU takes the negative side's first derivative (alpha) and
        # the positive side's second (0): alpha * y there has both. (The positive side is
        # zeroed before expm1: no inf there for where's backward.)
        negative = torch.where(positive, 0.0, y).expm1() * self.alpha
        return torch.where(positive, y, torch.where(decided == 0, y * self.alpha, negative))

    def inverse(self, z: Tensor) -> Tensor:
        """The input ``y`` with ``act(y) = z`` (invertible activations; ``z`` itself for identity).

        ELU's inverse ``log1p(z / alpha)`` is clamped where ``z`` has saturated at
        ``-alpha`` (there ``dL/dy = 0``, so only finiteness matters).
        """
        if self.name == "identity":
            return z
        if self.name == "leaky_relu":
            return TF.leaky_relu(z, 1.0 / self.negative_slope)
        tiny = torch.finfo(z.dtype).eps
        negative = z.clamp(max=0).div_(self.alpha).clamp_(min=-1.0 + tiny).log1p_()
        return negative.add_(z.clamp(min=0))


def make_activation(act: str, negative_slope: float = 0.01, alpha: float = 1.0,
                    memory: str = "standard", who: str = "make_activation") -> Activation:
    """Validate an activation name (and ``memory`` mode) and return its :class:`Activation`.

    Example:
        >>> make_activation("silu")
        Activation(name='silu', negative_slope=0.01, alpha=1.0)
        >>> make_activation("relu", memory="inplace")
        Traceback (most recent call last):
        ...
        ValueError: make_activation with memory='inplace' expected an invertible activation ...
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"{who} expected act to be one of {ACTIVATIONS}, got {act!r}")
    if memory not in MEMORY_MODES:
        raise ValueError(f"{who} expected memory to be one of {MEMORY_MODES}, got {memory!r}")
    activation = Activation(act, float(negative_slope), float(alpha))
    if memory == "inplace" and not _invertible(act, float(negative_slope), float(alpha)):
        raise ValueError(
            f"{who} with memory='inplace' expected an invertible activation "
            f"({', '.join(INVERTIBLE_ACTIVATIONS)}; leaky_relu needs negative_slope > 0 and "
            f"elu needs alpha > 0), got act={act!r}"
            + (f" with negative_slope={negative_slope}" if act == "leaky_relu" else "")
            + (f" with alpha={alpha}" if act == "elu" else "")
            + "; use memory='standard' for it"
        )
    return activation


# --------------------------------------------------------------------------- residual + norm


def _reference_backend(backend: str) -> bool:
    """``backend="reference"``, or ``"auto"`` under torch.compile (as in normkit's core:
    the reference math has no data-dependent branches and Inductor fuses it)."""
    return check_backend(backend) == "reference" or (backend == "auto" and compiling())


def _same_dtype(x: Tensor, *params: Tensor | None) -> bool:
    return all(p is None or p.dtype == x.dtype for p in params)


def _residual_dtype(x: Tensor, residual: Tensor | None, in_fp32: bool) -> torch.dtype:
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return torch.promote_types(dtype, torch.float32) if in_fp32 else dtype


def _check_add_inputs(x: Tensor, residual: Tensor | None, shape: tuple[int, ...], who: str,
                      **params: Tensor | None) -> None:
    F._check_trailing(x, shape, who, **params)
    if residual is None:
        return
    check_floating(residual, who)
    if residual.shape != x.shape:
        raise ValueError(
            f"{who} expected residual of the same shape as x {shape_str(x)}, got residual "
            f"of shape {shape_str(residual)}"
        )
    if residual.device != x.device:
        raise ValueError(f"{who} expected residual on x's device {x.device}, got "
                         f"{residual.device}")


def _residual_sum(x: Tensor, residual: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``x + residual`` in ``dtype``, contiguous (a new tensor unless it is ``x`` itself)."""
    if residual is None:
        s = x.to(dtype)
    elif torch.promote_types(x.dtype, residual.dtype) == dtype:
        s = torch.add(x, residual, out=out_like(x, dtype, torch.contiguous_format))
    else:
        s = torch.add(x.to(dtype), residual.to(dtype),
                      out=out_like(x, dtype, torch.contiguous_format))
    return s if s.is_contiguous() else s.contiguous()


def _add_norm_forward(x, residual, weight, bias, shape, eps, center, res_dtype, use_native
                      ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None,
                                 native.RowRepair | None]:
    """``(s, y, mean, rstd, repair)`` of ``s = x + residual``, ``y = norm(s)`` in ``s``'s
    dtype.

    ``mean``/``rstd`` are torch's LayerNorm statistics (``None`` when the compensated
    path served LayerNorm; RMSNorm has ``rstd`` only); ``repair`` the rows past the
    kernel's accuracy bound that the compensated core normalized (else ``None``).
    """
    k = _stats.reduced_count(shape, range(len(shape)))
    # (the flat views are made where they are used: each op costs host time, several
    # times its hot cost right after a large kernel has left the caches)
    # (every output is allocated in its final shape, the flat (M, K) views only written
    # through: autograd forbids in-place changes of a custom Function's outputs that are
    # views, and users scale or activate a norm's output in place)
    w = None if weight is None or center else weight.reshape(k)
    if not center and _rms_blocks_serve(x, residual, res_dtype):
        # (the sum too, block by block: each block is added, normalized and scaled while
        # it is in cache; without a residual the input itself is the sum)
        y = empty_like(x, None, torch.contiguous_format)
        if residual is None:
            s = x
            _, rstd = _rms_in_chunks(x.view(-1, k), w, eps, into=y.view(-1, k))
        else:
            s = empty_like(x, res_dtype, torch.contiguous_format)
            _, rstd = _rms_in_chunks(s.view(-1, k), w, eps, x.view(-1, k),
                                     residual.view(-1, k), into=y.view(-1, k))
        return s, y, None, rstd, None
    blocks = None
    use_native = use_native and not native.single_value(shape)
    if center and use_native and x.dtype == res_dtype and _same_dtype(x, weight, bias):
        # (large float32/float64 sums: block by block onto fresh huge pages, or None)
        blocks = native.layer_norm_blocks(x, shape, native.weight_for_bias(weight, bias),
                                          bias, eps, residual)
    s = _residual_sum(x, residual, res_dtype) if blocks is None else blocks[0]
    mean = rstd = repair = None
    if center:
        y = None
        if blocks is not None:
            _, y, mean, rstd = blocks
        elif use_native and native.kernel_dtypes(s, weight, bias):  # (16-bit s too)
            # (16-bit s: float32 parameters, so that the statistics come back in float32)
            w_kernel, b_kernel = native.kernel_params(s, shape, weight, bias)
            y, mean, rstd = torch.native_layer_norm(s, shape, w_kernel, b_kernel, eps)
        if y is not None and not native.well_conditioned(
                mean, rstd, native.THRESHOLDS["layer_norm"]):
            # the rows past the kernel's bound through the compensated core, the others
            # as they are: each row's result is its own (native.repair_rows)
            bad = native.ill_conditioned_rows(mean, rstd, native.THRESHOLDS["layer_norm"])
            if bad.numel() < mean.numel():
                repair = native.RowRepair.apply(y, s, k, bad, weight, bias, eps)
            else:
                y = mean = rstd = None
        if y is None:  # compensated statistics (normkit's core), recomputed in backward
            dims = tuple(range(s.dim() - len(shape), s.dim()))
            y = normalize(s, dims, weight, bias, eps)[0]
    else:
        sc = _stats.upcast(s)
        flat = sc.view(-1, k)  # (M, K)
        rstd = _stats.mean_square(flat, (1,)).add_(eps).rsqrt_()  # (M, 1)
        # (an upcast copy is scaled in place; else a new output, on huge pages when
        # large: kernels.memory)
        if sc is not s:
            y = sc
            flat.mul_(rstd)
        else:
            y = empty_like(s, None, torch.contiguous_format)
            flat = torch.mul(flat, rstd, out=y.view(-1, k))
        if w is not None:
            flat.mul_(w)
    return s, y, mean, rstd, repair


#: Bytes of input per block of rows in :func:`_rms_in_chunks`: its three passes (the
#: rows' norms, the scaling, the weight) run over one block while it is in cache, so
#: the input is read from memory once and the output written once. Chosen by
#: ``benchmarks/rms_chunks.py`` (1 to 8 MiB; two runs on an AMD EPYC VM with 2 MiB of
#: L2 per core and 32 MiB of L3): from 64 MiB of input, whole-tensor time / blocked
#: time 1.24-1.63x with one thread and 1.21-1.68x with two at 2 MiB blocks, 1.21-1.42x
#: and 1.33-1.66x at 4 MiB, 1.11-1.53x and 1.00-1.40x at 1 MiB.
RMS_CHUNK_BYTES = 2 << 20
#: Fewest bytes of input from which RMSNorm's forward runs in blocks: twice the
#: last-level cache here. Inputs of 12 to 32 MiB read 0.82-1.26x at 2 MiB blocks in the
#: same runs (no steady gain while much of the input stays in the L3).
RMS_CHUNK_MIN_BYTES = 64 << 20


def _rms_blocks_serve(x: Tensor, residual: Tensor | None, res_dtype: torch.dtype) -> bool:
    """Whether RMSNorm's forward of ``x + residual`` runs in blocks (:func:`_rms_in_chunks`):
    contiguous float32/float64 input of at least :data:`RMS_CHUNK_MIN_BYTES`, the sum (if
    any) in the inputs' own dtype."""
    return (x.dtype in _WIDE and x.dtype == res_dtype and x.is_contiguous()
            and x.numel() * x.element_size() >= RMS_CHUNK_MIN_BYTES
            and (residual is None or (residual.dtype == x.dtype
                                      and residual.is_contiguous())))


def _rms_in_chunks(rows: Tensor, w: Tensor | None, eps: float, x: Tensor | None = None,
                   residual: Tensor | None = None, into: Tensor | None = None
                   ) -> tuple[Tensor, Tensor]:
    """RMSNorm's forward of contiguous float32/float64 ``(M, K)`` rows, block by block of
    about :data:`RMS_CHUNK_BYTES`: ``(y, rstd)``, the same bits as the whole-tensor
    passes (each row's norm is its own reduction; ``benchmarks/rms_chunks.py`` checks
    it), which read the input, then the output twice, from memory. With ``x`` the rows
    are written first, block by block: ``x + residual``, the residual sum of
    ``add_rms_norm``, normalized while the block is in cache. ``into``: the ``(M, K)``
    rows of the output (a flat view of the caller's), else a new ``(M, K)`` output."""
    m, k = rows.shape
    step = max(1, RMS_CHUNK_BYTES // (k * rows.element_size()))
    y = out_like(rows) if into is None else into
    y = torch.empty_like(rows) if y is None else y
    rstd = rows.new_empty(m, 1)
    for start in range(0, m, step):
        block, out, r = rows[start:start + step], y[start:start + step], rstd[start:start + step]
        if x is not None:
            torch.add(x[start:start + step], residual[start:start + step], out=block)
        if k <= _stats.ROW_NORM_MAX:
            torch.linalg.vector_norm(block, 2, (1,), keepdim=True, out=r)
        else:  # (long rows: in pieces, as every RMSNorm path takes them)
            r.copy_(_stats.row_norm(block, (1,)))
        r.square_().div_(max(k, 1)).add_(eps).rsqrt_()
        torch.mul(block, r, out=out)
        if w is not None:
            out.mul_(w)
    return y, rstd


def _add_norm_apply(x, residual, weight, bias, shape, eps, center, res_dtype, use_native):
    """``_AddNormFunction.apply``, or its forward alone when no input needs a gradient
    (inference: no autograd node to build)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, residual, weight, bias)):
        return _AddNormFunction.apply(x, residual, weight, bias, shape, eps, center,
                                      res_dtype, use_native)
    s, y, _, _, _ = _add_norm_forward(x, residual, weight, bias, shape, eps, center, res_dtype,
                                   use_native)
    normed = y if y.dtype == x.dtype else y.to(x.dtype)
    return (normed, s) if s is not x else normed


class _AddNormFunction(torch.autograd.Function):
    """``s = x + residual``, ``normed = norm(s)`` (LayerNorm or RMSNorm) in one node.

    Saves ``s`` (which is also an output), the parameters and the row statistics.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, shape, eps, center, res_dtype, use_native):
        ctx.set_materialize_grads(False)
        s, y, mean, rstd, repair = _add_norm_forward(x, residual, weight, bias, shape, eps,
                                                     center, res_dtype, use_native)
        k = _stats.reduced_count(shape, range(len(shape)))
        ctx.shape, ctx.eps, ctx.center, ctx.k, ctx.repair = shape, eps, center, k, repair
        ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        normed = y if y.dtype == x.dtype else y.to(x.dtype)
        return (normed, s) if s is not x else normed

    @staticmethod
    def backward(ctx, dnormed, dres=None):
        s, weight, bias, mean, rstd = ctx.saved_tensors
        x_dtype, r_dtype = ctx.dtypes
        need_x, need_r, need_w, need_b = ctx.needs_input_grad[:4]
        dw = db = None
        if dnormed is None:
            ds = dres
        elif native.backward_by_reference(dnormed):  # create_graph=True, batched gradients
            ds, dw, db = _reference_grads(ctx, s, weight, bias, dnormed)
            if dres is not None:
                ds = ds + dres
        elif ctx.center and mean is None:
            ds, dw, db = _recomputed_grads(ctx, s, weight, bias, dnormed)
            if dres is not None:
                ds = ds.add_(dres)
        elif ctx.center:
            mask = [True, need_w, need_b]
            g = dnormed.to(s.dtype)
            # (16-bit s in float32 blocks: torch's 16-bit kernel sums dweight in 16 bits)
            ds, dw, db = native.layer_norm_backward(
                g if ctx.repair is None else ctx.repair.zeroed(g), s, ctx.shape, mean, rstd,
                weight, bias, mask, None if dres is None else dres.to(s.dtype))
            if ctx.repair is not None:  # (their kernel rows got a zero gradient: dres alone)
                ds, dw, db = ctx.repair.patch((ds, dw, db), g, weight, bias, mask, add=True)
        else:
            ds, dw = _rms_backward(ctx, s, weight, rstd, dnormed, dres, need_w)
        dx = None if not need_x or ds is None else ds.to(x_dtype)
        dr = None if not need_r or ds is None else ds.to(r_dtype)
        return dx, dr, dw, db, None, None, None, None, None


def _rms_backward(ctx, s, weight, rstd, dnormed, dres, need_w):
    """RMSNorm backward plus the residual gradient.

    float32/float64: torch's fused LayerNorm backward kernel with a zero mean, plus the
    one term LayerNorm has and RMSNorm lacks (see :func:`_rms_backward_native`);
    otherwise (16-bit, mixed dtypes) ATen compositions with one ``(M, K)`` temporary.
    """
    if (s.dtype in _WIDE and dnormed.dtype == s.dtype and _same_dtype(s, weight)
            and (dres is None or dres.dtype == s.dtype)):
        return _rms_backward_native(ctx, s, weight, rstd, dnormed, dres, need_w)
    k = ctx.k
    sc = _stats.upcast(s.view(-1, k))  # (M, K)
    g = _stats.upcast(dnormed.reshape(-1, k))
    tmp = g * sc  # (M, K): dnormed * s
    dw = None
    if weight is not None:
        wc = weight.reshape(k).to(tmp.dtype)
        if need_w:
            dw = (rstd.view(1, -1) @ tmp).view(weight.shape).to(weight.dtype)  # sum_m r dy s
        proj = (tmp @ wc).view(-1, 1)  # (M, 1): sum_k dy w s
        ds = torch.mul(g, wc, out=tmp)
    else:
        proj = tmp.sum(1, keepdim=True)
        ds = tmp.copy_(g)
    coef = proj.mul_(rstd.square()).div_(k)  # (M, 1): r^2 (dy w . s) / K
    ds.addcmul_(sc, coef, value=-1.0)
    if dres is not None and dres.dtype == ds.dtype:
        ds = torch.addcmul(dres.reshape(ds.shape), ds, rstd, out=ds)
    else:
        ds.mul_(rstd)
        if dres is not None:
            ds.add_(dres.reshape(ds.shape))
    return ds.view(s.shape), dw


def _rms_backward_native(ctx, s, weight, rstd, dnormed, dres, need_w):
    r"""RMSNorm backward through torch's LayerNorm backward kernel.

    With ``g = dy * w`` and ``xhat = s * rstd``, LayerNorm's input gradient given a zero
    mean is ``rstd * (g - mean(g) - xhat * mean(g * xhat))`` and RMSNorm's is the same
    without ``- mean(g)``; so ``ds = ds_LN + rstd * mean(g)`` (one matrix-vector product
    and one in-place add), and ``dweight = sum(dy * xhat)`` is LayerNorm's as it is.
    There is no cancellation to fear: ``mean(g)`` is bounded by ``max |g|``, so adding it
    back costs at most one rounding of the gradient's own size. 1.7-2x faster than the
    composition at 4096 x 768 (1 thread).
    """
    k = ctx.k
    rows = s.view(-1, k)
    g = dnormed.reshape(rows.shape)
    g = g if g.is_contiguous() else g.contiguous()
    w = None if weight is None else weight.reshape(k)
    rstd = rstd.view(-1, 1)
    zero = torch.zeros_like(rstd)

    def mean_g_term(block: slice) -> Tensor:  # (rows, 1): rstd * mean(g) of those rows
        gb = g[block]
        mean_g = (gb @ w if w is not None else gb.sum(1)).view(-1, 1)
        return mean_g.mul_(rstd[block]).div_(k)  # (addcmul_ of two (M, 1) operands: ~6x slower)

    # (from 32 MiB of fresh output, block by block onto huge pages: native.layer_norm_blocks)
    ds, dw, _ = native.layer_norm_backward(
        g, rows, (k,), zero, rstd, w, None, [True, need_w and w is not None, False],
        None if dres is None else dres.reshape(rows.shape), mean_g_term)
    return ds.view(s.shape), None if dw is None else dw.view(weight.shape)


def _grad_inputs(tensors, needs):
    """Detached copies that require grad where ``needs`` says so (for a recomputation)."""
    return [None if t is None else t.detach().requires_grad_(need)
            for t, need in zip(tensors, needs, strict=True)]


def _recomputed_grads(ctx, s, weight, bias, dnormed):
    """LayerNorm gradients through normkit's compensated core (the ill-conditioned path)."""
    k = ctx.k
    s_, w_, b_ = _grad_inputs((s, weight, bias), (True, *ctx.needs_input_grad[2:4]))
    with torch.enable_grad():
        y = normalize(s_.view(-1, k), (1,), None if w_ is None else w_.view(k),
                      None if b_ is None else b_.view(k), ctx.eps)[0]
        return _grads_of(y, (s_, w_, b_), dnormed.reshape(y.shape), create_graph=False)


def _reference_grads(ctx, s, weight, bias, dnormed):
    """Gradients from the reference math: differentiable under ``create_graph=True``
    (grad mode on), plain ones for a batched gradient."""
    dims = tuple(range(s.dim() - len(ctx.shape), s.dim()))
    graph = torch.is_grad_enabled()
    with torch.enable_grad():
        y = reference_normalize(s, dims, weight, bias, ctx.eps, ctx.center)[0]
        needs = (True, *ctx.needs_input_grad[2:4])
        return _grads_of(y, (s, weight, bias), dnormed.to(y.dtype), create_graph=graph,
                         needs=needs)


def _grads_of(output, inputs, grad, create_graph, needs=None):
    """``torch.autograd.grad`` over the inputs that need it, ``None`` for the others."""
    needs = [t is not None and t.requires_grad for t in inputs] if needs is None else [
        need and t is not None and t.requires_grad for t, need in zip(inputs, needs,
                                                                      strict=True)]
    wanted = [t for t, need in zip(inputs, needs, strict=True) if need]
    grads = iter(torch.autograd.grad(output, wanted, grad, create_graph=create_graph,
                                     allow_unused=True)) if wanted else iter(())
    return [next(grads) if need else None for need in needs]


def _add_norm(x, residual, normalized_shape, weight, bias, eps, center, residual_in_fp32,
              backend, who):
    if isinstance(x, Tensor) and x.is_nested:  # per token: on the values (norms._nested)
        normed, new_residual = _nested.per_token(
            lambda v, r: _add_norm(v, r, normalized_shape, weight, bias, eps, center,
                                   residual_in_fp32, backend, who),
            normalized_shape, who, x, residual)
        if residual is None and new_residual.dtype == x.dtype:
            new_residual = x  # (as for dense x: nothing added, x passes on)
        return normed, new_residual
    shape = F._as_shape(normalized_shape)
    _check_add_inputs(x, residual, shape, who, weight=weight, bias=bias)
    res_dtype = _residual_dtype(x, residual, residual_in_fp32)
    if eps is None:  # torch's RMSNorm rule, for the dtype of the normalized sum
        eps = F._machine_eps(res_dtype)
    # (rows of fewer than FEW_VALUES values with a gradient: the reference, in float64)
    count = _stats.reduced_count(shape, range(len(shape)))
    backend = F._few_values_backend(backend, count, x, residual, weight, bias)
    if _reference_backend(backend) or x.numel() == 0:
        s = x.to(res_dtype) if residual is None else x.to(res_dtype) + residual.to(res_dtype)
        dims = tuple(range(s.dim() - len(shape), s.dim()))
        if s.numel() == 0:
            return F._empty_result(s, weight, bias).to(x.dtype), s
        if center and backend == "auto" and in_graph() and library.serves_layer_norm(
                s, weight, bias):
            # torch.compile on the CPU: the add in the graph, the norm one operator
            return library.layer_norm(s, shape, weight, bias, eps).to(x.dtype), s
        y = reference_normalize(s, dims, weight, bias, eps, center)[0]
        return y.to(x.dtype), s
    if F._use_triton(backend, x, lambda: _triton_serves_add(x, residual, shape, weight, bias,
                                                             res_dtype),
                     "layer_norm" if center else "rms_norm"):
        if backend == "triton":  # (the checks of tk.layer_norm/rms_norm: "auto" made them)
            norm = tk.layer_norm if center else tk.rms_norm
            affine = (weight, bias) if center else (weight,)
            run = lambda s, res: norm(s, shape, *affine, eps, residual=res)  # noqa: E731
        else:
            run = lambda s, res: tk._row_norm_unchecked(  # noqa: E731
                s, res, weight, bias if center else None, len(shape), eps, center)
        if residual is None:
            s = x if res_dtype == x.dtype else x.to(res_dtype)
            return run(s, None).to(x.dtype), s
        # the kernel adds in promote(x, residual): an fp32 stream is asked for by handing
        # it an fp32 residual
        return run(x, residual if residual.dtype == res_dtype else residual.to(res_dtype))
    if F._torch_kernels(backend, x):
        # a GPU without a Triton kernel for it: the add, then torch's kernel
        s = x.to(res_dtype) if residual is None else x.to(res_dtype) + residual.to(res_dtype)
        norm = (TF.layer_norm(s, shape, weight, bias, eps) if center
                else TF.rms_norm(s, shape, weight, eps))
        return norm.to(x.dtype), s
    if residual is None and res_dtype == x.dtype and center:
        # nothing to add: the plain LayerNorm (torch's kernel where accurate), x passes on
        return F.layer_norm(x, shape, weight, bias, eps, backend=backend), x
    if F._small_rows(x, backend, residual, weight, bias) and res_dtype == x.dtype:
        # small inputs: the add and the norm as separate autograd ops cost less than one
        # fused node (see normkit.functional.SMALL_ROWS_COMPOSITE_BELOW)
        s = x if residual is None else x + residual
        if center:
            return F.layer_norm(s, shape, weight, bias, eps, backend=backend), s
        return F.rms_rows(s, shape, weight, eps), s  # (the fused kernel's arithmetic)
    out = _add_norm_apply(x, residual, weight, bias, shape, eps, center, res_dtype,
                          backend == "auto")
    return (out, x) if isinstance(out, Tensor) else out


def _triton_serves_add(x: Tensor, residual: Tensor | None, shape: tuple[int, ...],
                       weight: Tensor | None, bias: Tensor | None,
                       res_dtype: torch.dtype) -> bool:
    """Whether the Triton row kernels serve ``norm(x + residual)`` with the sum in
    ``res_dtype`` (they add in the promoted dtype of their two inputs; without a residual
    they normalize ``x`` cast to ``res_dtype``)."""
    return (res_dtype in (torch.float32, torch.float16, torch.bfloat16)
            and tk.supports_layer_norm(x, shape, weight, bias, residual=residual))


def add_layer_norm(
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual_in_fp32: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    r"""Residual add then LayerNorm, the pre-norm Transformer step, in one autograd node.

    .. math::
        s = x + r,\qquad
        \mathrm{normed} = \frac{s - \mathrm{E}[s]}{\sqrt{\mathrm{Var}[s] + \epsilon}}\gamma + \beta

    Returns ``(normed, new_residual)`` with ``new_residual = s``, like
    flash-attention's ``layer_norm_fn(..., prenorm=True)``. Same values as
    ``layer_norm(x + residual)``, faster on CPU: the backward merges the gradient of
    ``new_residual`` and the norm's into one tensor returned for both ``x`` and
    ``residual``. Statistics are normkit's: torch's kernel where it is accurate for the
    data (:mod:`normkit.kernels.native`), the compensated path otherwise, so rows at a
    large offset keep their digits.

    Args:
        x: ``(*, *normalized_shape)``, the sublayer output.
        residual: the residual stream, same shape, or ``None`` (then ``s = x``).
        normalized_shape: trailing shape to normalize over.
        weight, bias: elementwise affine of shape ``normalized_shape`` or ``None``.
        eps: added to the variance. Default: ``1e-5``.
        residual_in_fp32: keep ``new_residual`` in (at least) float32 even for
            float16/bfloat16 ``x``. Default: ``False``.
        backend: ``"auto"``, ``"eager"`` (compensated statistics always) or
            ``"reference"``. Default: ``"auto"``.

    Returns:
        ``normed`` in ``x``'s dtype and ``new_residual`` in the promoted dtype of ``x``
        and ``residual`` (at least float32 with ``residual_in_fp32``). With
        ``residual=None`` and no dtype change, ``new_residual`` is ``x`` itself.

    Example:
        >>> x, res = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        >>> normed, new_res = add_layer_norm(x, res, 16)
        >>> ref = torch.nn.functional.layer_norm(x + res, (16,))
        >>> torch.allclose(normed, ref, atol=1e-5), torch.equal(new_res, x + res)
        (True, True)
    """
    return _add_norm(x, residual, normalized_shape, weight, bias, eps, True,
                     residual_in_fp32, backend, "add_layer_norm")


def add_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    residual_in_fp32: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    r"""Residual add then RMSNorm (Zhang & Sennrich 2019) in one autograd node.

    .. math:: s = x + r,\qquad \mathrm{normed} = \frac{s}{\sqrt{\mathrm{E}[s^2] + \epsilon}}\gamma

    Returns ``(normed, new_residual)``; see :func:`add_layer_norm` for the dtypes.
    ``eps=None`` uses the machine epsilon of the compute dtype (float32 for 16- and
    32-bit input, float64 for float64), as torch does.

    Args:
        x: ``(*, *normalized_shape)``, the sublayer output.
        residual: the residual stream, same shape, or ``None``.
        normalized_shape: trailing shape to normalize over.
        weight: elementwise scale of shape ``normalized_shape`` or ``None``.
        eps: added to the mean square, or ``None``. Default: ``None``.
        residual_in_fp32: keep ``new_residual`` in at least float32. Default: ``False``.
        backend: ``"auto"``/``"eager"`` (the fused node) or ``"reference"``.

    Example:
        >>> x, res = torch.randn(4, 8), torch.randn(4, 8)
        >>> normed, new_res = add_rms_norm(x, res, 8)
        >>> ref = torch.nn.functional.rms_norm(x + res, (8,))
        >>> torch.allclose(normed, ref, atol=1e-5)
        True
    """
    return _add_norm(x, residual, normalized_shape, weight, None, eps, False,
                     residual_in_fp32, backend, "add_rms_norm")


class _ResidualMixin:
    """The ``residual_in_fp32`` option and the ``forward(x, residual=None)`` contract."""

    def __init__(self, *args, residual_in_fp32: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.residual_in_fp32 = bool(residual_in_fp32)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return f"{base}, residual_in_fp32=True" if self.residual_in_fp32 else base


class AddLayerNorm(_ResidualMixin, BackendMixin, nn.LayerNorm):
    r"""Residual add then LayerNorm: ``forward(x, residual=None) -> (normed, new_residual)``.

    The pre-norm Transformer block's ``h = h + sublayer(...)``; ``ln(h)`` as one layer
    (see :func:`add_layer_norm` for the math and the speed-up). A subclass of
    :class:`torch.nn.LayerNorm`: same constructor, parameters and ``state_dict``, so a
    checkpoint of ``nn.LayerNorm`` loads into it and back.

    Args:
        normalized_shape: trailing shape to normalize over.
        eps: added to the variance. Default: ``1e-5``.
        elementwise_affine: learnable ``weight`` (and ``bias``). Default: ``True``.
        bias: learnable ``bias``. Default: ``True``.
        residual_in_fp32: keep the residual stream in float32. Default: ``False``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``. Default: ``"auto"``.

    Shape:
        - x, residual: :math:`(*, \text{normalized\_shape})`; outputs: same.

    Example:
        >>> import torch, normkit
        >>> ln = AddLayerNorm(16)
        >>> x, res = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        >>> normed, res = ln(x, res)
        >>> normed.shape, torch.allclose(normed.mean(-1), torch.zeros(2, 5), atol=1e-5)
        (torch.Size([2, 5, 16]), True)
    """

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if isinstance(x, Proxy) or isinstance(residual, Proxy):
            return fx_leaf(self, x, residual)
        return add_layer_norm(x, residual, self.normalized_shape, self.weight, self.bias,
                              self.eps, residual_in_fp32=self.residual_in_fp32,
                              backend=self.backend)


class AddRMSNorm(_ResidualMixin, BackendMixin, nn.RMSNorm):
    r"""Residual add then RMSNorm: ``forward(x, residual=None) -> (normed, new_residual)``.

    See :func:`add_rms_norm`. A subclass of :class:`torch.nn.RMSNorm` (same
    ``state_dict``); ``eps=None`` uses the float32 (or float64) machine epsilon.

    Args:
        normalized_shape: trailing shape to normalize over.
        eps: added to the mean square, or ``None``. Default: ``None``.
        elementwise_affine: learnable ``weight``. Default: ``True``.
        residual_in_fp32: keep the residual stream in float32. Default: ``False``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``. Default: ``"auto"``.

    Shape:
        - x, residual: :math:`(*, \text{normalized\_shape})`; outputs: same.

    Example:
        >>> import torch
        >>> norm = AddRMSNorm(8)
        >>> normed, res = norm(torch.randn(3, 8), torch.randn(3, 8))
        >>> torch.allclose(normed.square().mean(-1), torch.ones(3), atol=1e-4)
        True
    """

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if isinstance(x, Proxy) or isinstance(residual, Proxy):
            return fx_leaf(self, x, residual)
        return add_rms_norm(x, residual, self.normalized_shape, self.weight, self.eps,
                            residual_in_fp32=self.residual_in_fp32, backend=self.backend)


# --------------------------------------------------------------------------- norm + activation


def _can_overwrite(x: Tensor) -> bool:
    """Whether ``memory="inplace"`` may write its output over ``x`` (see the module notes)."""
    dense = x.is_contiguous() or F._channels_last_format(x) is not None
    return (x.requires_grad and not x.is_leaf and not x._is_view() and x.dtype in _WIDE
            and dense)


def _update_running(running_mean: Tensor | None, running_var: Tensor | None, mean: Tensor,
                    var: Tensor, count: int, momentum: float, unbiased: bool) -> None:
    """torch's running-statistics update from the biased batch variance ``var``."""
    if running_mean is not None:
        _stats.update_running_(running_mean, mean.reshape(-1), momentum)
    if running_var is not None:
        batch_var = _stats.unbiased_var(var.reshape(-1), count) if unbiased else var.reshape(-1)
        _stats.update_running_(running_var, batch_var, momentum)


def _fast_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                     running_mean: Tensor | None, running_var: Tensor | None, momentum: float,
                     eps: float, count: int, unbiased: bool, overwrite: bool,
                     float32_statistics: bool = False
                     ) -> tuple[Tensor, Tensor, Tensor, bool] | None:
    """``(y, mean, invstd, from_row_sums)`` of training-mode BatchNorm from fast kernels,
    else ``None``.

    * inputs the slice-sums engine serves (:func:`_from_row_sums`: from 2^18 elements,
      contiguous, or channels-last with more values per channel than torch's
      channels-last kernel handles accurately): the per-(n, c) sums of
      :func:`normkit.kernels.channels.moments` (torch's NCHW statistics kernel is several
      times slower), then ``x * scale + shift``;
    * otherwise torch's own kernels, whose accuracy bound :mod:`normkit.kernels.native`
      checks: its fused BatchNorm (statistics and output in one call), or its statistics
      kernel alone when the output overwrites ``x`` or the running variance is not
      torch's unbiased one.

    ``y`` is ``x`` itself when ``overwrite``. The running statistics are updated once, by
    torch's kernel or here, and left untouched when every fast result is rejected.
    ``from_row_sums`` says the first path was taken (so the backward is the same
    engine's, :func:`normkit.kernels.channels.backward`). ``float32_statistics``: 16-bit
    input gets float32 statistics whatever its parameters' dtype.
    """
    if x.numel() > 0 and x.dtype in _HALF:  # (never overwritten: _can_overwrite)
        return _fast_batch_norm_16bit(x, weight, bias, running_mean, running_var, momentum,
                                      eps, count, unbiased, float32_statistics)
    if x.numel() == 0 or x.dtype not in _WIDE or not _same_dtype(x, weight, bias):
        return None
    if _from_row_sums(x):
        fast = channels.moments(x, channels.Pool("batch"), eps)
        if fast is not None:
            mean, var, invstd = (t.view(-1) for t in fast)
            _update_running(running_mean, running_var, mean, var, count, momentum, unbiased)
            y = (_normalize_with(x, mean, invstd, weight, bias, True) if overwrite else
                 channels.affine(x, fast[0], fast[2], weight, bias))
            return y, mean, invstd, True
    threshold = native._bn_threshold(x, training=True)
    if threshold is None:
        return None
    buffers = (running_mean, running_var)
    in_kernel = unbiased and all(t is not None and t.dtype == x.dtype for t in buffers)
    before = [t.clone() for t in buffers] if in_kernel else None
    rm, rv = (running_mean, running_var) if in_kernel else (None, None)
    if overwrite or not in_kernel:
        mean, var = torch.batch_norm_update_stats(x, rm, rv, momentum)
        invstd, y = torch.rsqrt(var + eps), None
    else:
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, rm, rv, True, momentum, eps)
    if not native.well_conditioned(mean, invstd, threshold):
        if in_kernel:
            with torch.no_grad():
                for running, old in zip(buffers, before, strict=True):
                    running.copy_(old)
        return None
    if y is None:
        if not in_kernel:
            _update_running(running_mean, running_var, mean, var, count, momentum, unbiased)
        y = _normalize_with(x, mean, invstd, weight, bias, overwrite)
    return y, mean, invstd, False


_HALF = (torch.float16, torch.bfloat16)


def _fast_batch_norm_16bit(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                           running_mean: Tensor | None, running_var: Tensor | None,
                           momentum: float, eps: float, count: int, unbiased: bool,
                           float32_statistics: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor, bool] | None:
    """:func:`_fast_batch_norm` of float16/bfloat16 input: torch's fused kernel under
    BatchNorm's bound and counts for 16-bit input (``native.CHANNELS_LAST_MAX_COUNT_16BIT``:
    its float32 sums stay far under the output's rounding), without the buffers, which
    are then updated once from its statistics. The kernel gets float32 parameters (a
    unit weight for a missing one: ``native.kernel_params``), so that its statistics
    come back in float32 (the kernel's mixed-dtype path) rather than rounded to 16 bits,
    as torch's own BatchNorm with 16-bit parameters leaves them (its output 1.0e-1 off
    at ``|mean| / std`` 30 in bfloat16: ``benchmarks/accuracy.py --sixteen-bit``) --
    except where every channel has ``|mean| / std <= native.HALF_STATISTICS_RATIO``: there
    16-bit parameters (or none) get torch's kernel as torch's BatchNorm runs it, 16-bit
    statistics and buffers updated inside it, as :func:`normkit.functional.batch_norm`
    does (unless ``float32_statistics``: In-Place ABN recovers its input from them)."""
    threshold = native._bn_threshold(x, training=True)
    if threshold is None or not native.kernel_dtypes(x, weight, bias):
        return None
    if unbiased and not float32_statistics and native.half_statistics(x, weight, bias):
        fast = native.batch_norm_train_saved(x, running_mean, running_var, weight, bias,
                                             momentum, eps)
        if fast is not None:
            return (*fast, False)
    w, b = native.kernel_params(x, x.shape[1:2], weight, bias)  # (float32 statistics)
    y, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.0, eps)
    if not native.well_conditioned(mean, invstd, threshold):
        return None
    mean, invstd = mean.detach(), invstd.detach()
    var = torch.pow(invstd.float(), -2).sub_(eps).clamp_(min=0.0)
    _update_running(running_mean, running_var, mean, var, count, momentum, unbiased)
    return y, mean, invstd, False


def _from_row_sums(x: Tensor) -> bool:
    """Whether :func:`_fast_batch_norm` tries per-(n, c) sums for ``x`` first (the rule of
    :func:`normkit.kernels.channels.supports`: below its size floor torch's kernels are
    faster)."""
    return channels.supports(x) and channels.serves_batch_norm(x)


def _normalize_with(x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None,
                    bias: Tensor | None, overwrite: bool) -> Tensor:
    """``(x - mean) * invstd * weight + bias`` folded to ``x * scale + shift`` (exact for
    well-conditioned data, the only data it is used for)."""
    scale = invstd if weight is None else invstd * weight
    shift = -mean * scale if bias is None else bias - mean * scale
    view = F._channel_view(x)
    return _scale_shift(x, scale.view(view), shift.view(view), overwrite)


def _scale_shift(x: Tensor, scale: Tensor, shift: Tensor, overwrite: bool) -> Tensor:
    """``x * scale + shift`` with per-channel ``scale``/``shift``, into ``x`` or a new tensor.

    (On contiguous NCHW, torch's ``addcmul`` with per-channel operands is slower than a
    multiply followed by an in-place add; on channels-last it is the faster one.)
    """
    if x.is_contiguous():
        return (x.mul_(scale) if overwrite else
                torch.mul(x, scale, out=out_like(x))).add_(shift)
    return torch.addcmul(shift, x, scale, out=x if overwrite else out_like(x))


def _unrecoverable_channels(weight: Tensor | None, bias: Tensor | None, x: Tensor
                            ) -> Tensor | None:
    """Channels whose normalized input cannot be recovered from an output of ``x.dtype``."""
    # recoverable: |gamma| >= max(|beta| / ratio, tiny); NaN is not (few small ops: this
    # runs on every training step)
    tiny = torch.finfo(x.dtype).tiny
    if bias is None:
        if weight is None:
            return None  # gamma 1, beta 0
        bound = tiny
    else:
        bound = bias.detach().float().abs().div_(_RECOVERY_RATIO[x.dtype]).clamp_min_(tiny)
    gamma = (torch.ones((), device=x.device) if weight is None
             else weight.detach().float().abs())
    bad = torch.ge(gamma, bound).logical_not_()  # (C,): a weight or a bias is given
    return bad.nonzero().flatten() if bool(bad.any()) else None


def _robust_xhat(x: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``dims`` with normkit's compensated moments."""
    m = _stats.moments(_stats.upcast(x), dims)
    return m.shifted.sub_(m.mean_lo).mul_(torch.rsqrt(m.var + eps))


class _BatchNormActFunction(torch.autograd.Function):
    """Training-mode BatchNorm + activation, optionally In-Place Activated (see the module notes).

    Standard memory saves ``x``, the output (when the activation's derivative can use
    it) and per-channel ``mean``/``invstd``; in-place memory saves the output, the
    per-channel statistics and the normalized input of unrecoverable channels only.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, act, inplace,
                unbiased, use_native):
        dims = (0, *range(2, x.dim()))
        count = _stats.reduced_count(x.shape, dims)
        c = x.shape[1]
        view = F._channel_view(x)
        overwrite = inplace and _can_overwrite(x)
        fb_idx = fb_xhat = None
        if inplace:  # before x may be overwritten
            fb_idx = _unrecoverable_channels(weight, bias, x)
            if fb_idx is not None:
                fb_xhat = _robust_xhat(x.index_select(1, fb_idx), dims, eps).to(x.dtype)
        fast = None
        if use_native:
            # (In-Place ABN recovers the input from its 16-bit output with the statistics
            # and affine: in float32, so its 16-bit input takes the kernel with float32
            # parameters, whose statistics are float32, whatever its parameters' dtype)
            fast = _fast_batch_norm(x, weight, bias, running_mean, running_var, momentum, eps,
                                    count, unbiased, overwrite, float32_statistics=inplace)
        ctx.row_sums = False
        if fast is not None:
            out, mean, invstd, ctx.row_sums = fast
        else:  # compensated statistics (normkit's core)
            y, batch_mean, var = normalize(x, dims, affine_view(weight, view),
                                           affine_view(bias, view), eps)
            _update_running(running_mean, running_var, batch_mean, var, count, momentum,
                            unbiased)
            mean, invstd = batch_mean.view(c), torch.rsqrt(var + eps).view(c)
            out = x.copy_(y) if overwrite else y
        out, pre = _activate_output(act, out)
        if overwrite:
            ctx.mark_dirty(x)
        ctx.act, ctx.eps, ctx.inplace, ctx.dims = act, eps, inplace, dims
        ctx.fast = fast is not None
        if inplace:
            ctx.save_for_backward(out, weight, bias, mean, invstd, fb_idx, fb_xhat)
        else:
            ctx.save_for_backward(x, _kept_output(act, out), pre, weight, bias, mean, invstd)
        return out

    @staticmethod
    def backward(ctx, dz):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.inplace:
            grads = _inplace_abn_backward(ctx, dz, [need_x, need_w, need_b])
        else:
            grads = _bn_act_backward(ctx, dz, [need_x, need_w, need_b])
        return (*grads, None, None, None, None, None, None, None, None)


def _activate_output(act: Activation, y: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(z, y_kept)``: the activation in place when its derivative can use ``z``, else
    out of place, keeping the pre-activation ``y`` for the backward (as torch would)."""
    if act.from_output:
        return act.apply_(y), None
    out = out_like(y) if act.name in ("silu", "gelu") else None
    if out is not None:  # (large: onto the output cache)
        if act.name == "silu":
            return _ATEN.silu.out(y, out=out), y
        return _ATEN.gelu.out(y, out=out), y
    return Activation.__call__(act, y), y  # (as in _activate: traceable on older torch)


def _kept_output(act: Activation, z: Tensor) -> Tensor | None:
    """The output, when the activation's backward reads it."""
    return z if act.from_output and act.name != "identity" else None


def _bn_act_backward(ctx, dz, mask):
    x, z, y, weight, bias, mean, invstd = ctx.saved_tensors
    act = ctx.act
    view = F._channel_view(x)
    if native.backward_by_reference(dz):  # create_graph=True, batched gradients
        graph = torch.is_grad_enabled()
        with torch.enable_grad():
            ref = reference_normalize(x, ctx.dims, affine_view(weight, view),
                                      affine_view(bias, view), ctx.eps)[0]
            return _grads_of(act.as_taken(ref, z, y), (x, weight, bias), dz,
                             create_graph=graph, needs=mask)
    if not ctx.fast:  # ill-conditioned or 16-bit: through normkit's compensated core
        x_, w_, b_ = _grad_inputs((x, weight, bias), mask)
        with torch.enable_grad():
            y_ = normalize(x_, ctx.dims, affine_view(w_, view), affine_view(b_, view),
                           ctx.eps)[0]
        dy = act.backward(dz, z, y)
        return _grads_of(y_, (x_, w_, b_), dy, create_graph=False)
    dy = act.backward(dz, z, y)
    if ctx.row_sums:  # the engine's backward (its sums on channels-last input)
        c = x.shape[1]
        return channels.backward(dy, x, mean.view(1, c), invstd.view(1, c), weight,
                                 channels.Pool("batch"), mask)
    # (16-bit x: the float32 statistics of _fast_batch_norm_16bit with a float32 weight,
    # or its 16-bit ones with the weight as it is)
    w = (weight if weight is None or mean.dtype == x.dtype else
         native.kernel_params(x, x.shape[1:2], weight, None)[0])
    return _param_dtypes(_ATEN.native_batch_norm_backward(dy, x, w, None, None, mean, invstd,
                                                          True, ctx.eps, mask), weight, bias)


def _inplace_abn_backward(ctx, dz, mask):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "BatchNorm + activation with memory='inplace' does not support double backward "
            "(create_graph=True): the input was not kept; use memory='standard'")
    z, weight, bias, mean, invstd, fb_idx, fb_xhat = ctx.saved_tensors
    act = ctx.act
    dy = act.backward(dz, z, None)
    y = act.inverse(z)
    gamma = torch.ones_like(invstd) if weight is None else weight.to(invstd.dtype)
    beta = torch.zeros_like(invstd) if bias is None else bias.to(invstd.dtype)
    # torch's BatchNorm backward on y with mean beta and invstd 1/gamma gives
    # xhat = (y - beta) / gamma; weight gamma^2 * invstd restores dx's factor gamma * invstd
    center, inv, scale = beta.clone(), gamma.reciprocal(), gamma * gamma * invstd
    if fb_idx is not None:  # channels kept as normalized input: mean 0, invstd 1
        center[fb_idx], inv[fb_idx] = 0.0, 1.0
        scale[fb_idx] = gamma[fb_idx] * invstd[fb_idx]
        y = z.clone() if y is z else y
        y.index_copy_(1, fb_idx, fb_xhat)
    rows = y.dim() == 2  # ((N, C): the engine takes their (1, C, N, 1) channels-last view)
    engine_y = channels.rows_as_channels_last(y) if rows else y
    if y.device.type == "cpu" and channels.supports(engine_y, scale, center):
        # the engine's choice of that kernel or its own sums, which stay accurate where the
        # CPU kernel's do not (long NCHW slices; many values per channel on channels-last)
        c = y.shape[1]
        g = channels.rows_as_channels_last(dy.contiguous()) if rows else dy
        dx, dw, db = channels.backward(g, engine_y, center.view(1, c), inv.view(1, c), scale,
                                       channels.Pool("batch"), tuple(mask))
        if rows and dx is not None:
            dx = channels.channels_last_as_rows(dx)
    else:
        dx, dw, db = _ATEN.native_batch_norm_backward(dy, y, scale, None, None, center, inv,
                                                      True, ctx.eps, mask)
    if dw is not None:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return dx, dw, db


def batch_norm_act(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    act: str = "relu",
    negative_slope: float = 0.01,
    alpha: float = 1.0,
    memory: str = "standard",
    unbiased_running_var: bool = True,
    backend: str = "auto",
) -> Tensor:
    r"""BatchNorm then an activation, ``act(batch_norm(input, ...))``, in one autograd node.

    Arguments and running-statistics semantics are those of
    :func:`normkit.functional.batch_norm`. In training the normalization is fused with
    the activation (applied in place on the normalized output) and the backward is
    hand-derived; ``memory="inplace"`` is In-Place Activated BatchNorm (only the output
    is saved; see :mod:`normkit.norms.fused`). In eval, with ``backend="reference"``,
    for an empty batch, in training without a gradient (nothing to save; In-Place ABN
    still overwrites an intermediate input) and, with ``memory="standard"``, for inputs
    below :data:`FUSED_ACT_MIN_ELEMENTS` (where the fused node's overhead outweighs it)
    it is the plain composition, the activation in place where nothing needs its input.

    Args:
        input: ``(N, C)`` or ``(N, C, *)``.
        running_mean, running_var: ``(C,)`` buffers or ``None``.
        weight, bias: ``(C,)`` affine parameters or ``None``.
        training: use (and update) batch statistics. Default: ``False``.
        momentum: running-average factor. Default: ``0.1``.
        eps: added to the variance. Default: ``1e-5``.
        act: one of :data:`ACTIVATIONS`. Default: ``"relu"``.
        negative_slope: LeakyReLU's slope. Default: ``0.01``.
        alpha: ELU's ``alpha``. Default: ``1.0``.
        memory: ``"standard"`` or ``"inplace"`` (invertible activations only).
        unbiased_running_var: as in :func:`normkit.functional.batch_norm`.
        backend: ``"auto"``, ``"eager"`` (compensated statistics always),
            ``"reference"`` or ``"triton"`` (the Triton BatchNorm kernels, then the
            activation; ``memory="standard"`` only). ``"auto"`` takes torch's CUDA
            BatchNorm kernel, then the activation, for CUDA input with
            ``memory="standard"`` (see :data:`normkit.functional.TRITON_AUTO_OPS`).

    Example:
        >>> x = torch.randn(8, 3, 4, 4)
        >>> y = batch_norm_act(x, None, None, training=True, act="relu")
        >>> ref = torch.relu(torch.nn.functional.batch_norm(x, None, None, training=True))
        >>> torch.allclose(y, ref, atol=1e-5)
        True
    """
    who = "batch_norm_act"
    activation = make_activation(act, negative_slope, alpha, memory, who)
    # (a meta input: the reference math, whose every step has a meta kernel -- the fused
    # node reads statistics back to choose its path)
    reference = _reference_backend(backend) or input.is_meta
    F._check_channels_first(input, who)
    F._check_per_channel(input, who, running_mean=running_mean, running_var=running_var,
                         weight=weight, bias=bias)
    weight, bias = F._dense_params(weight, bias)
    if memory == "inplace" and check_backend(backend) == "triton":
        raise ValueError(f"{who} with memory='inplace' has no Triton kernel (its backward "
                         "recovers the input from the output); got backend='triton', use "
                         "backend='auto' or memory='standard'")
    if memory == "standard" and F._use_triton(backend, input, lambda: tk.supports_batch_norm(
            input, weight, bias, running_mean, running_var), "batch_norm"):
        # the Triton BatchNorm kernels, the activation after them
        y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
                         eps, unbiased_running_var=unbiased_running_var, backend="triton")
        return _activate(activation, y, False)
    if memory == "standard" and F._torch_kernels(backend, input):
        # torch's CUDA BatchNorm, the activation after it (see F.TRITON_AUTO_OPS)
        y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
                         eps, unbiased_running_var=unbiased_running_var, backend=backend)
        return _activate(activation, y, False)
    if backend == "auto" and not reference:
        input = F._dense(input)  # (a strided view: one copy first, as torch's kernels make)
    dims = (0, *range(2, input.dim()))
    count = _stats.reduced_count(input.shape, dims)
    # without a gradient (statistics recalibration under no_grad, e.g. SWA's update_bn)
    # the node has nothing to save: the norm, then the activation in place on its fresh
    # output -- unless In-Place ABN is to overwrite an intermediate input, as documented
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (input, weight, bias))
    node = grad or (memory == "inplace" and _can_overwrite(input))
    fused = (training and not reference and input.numel() > 0 and count > 1 and eps > 0
             and node and (memory == "inplace" or input.numel() >= FUSED_ACT_MIN_ELEMENTS))
    if fused and memory == "inplace" and grad and type(count) is int and (
            count < _stats.FEW_VALUES):
        # (fewer than FEW_VALUES values per channel: the output cannot give xhat back to
        # the digits the gradient needs; the standard route, in float64 there)
        fused = False
    if not fused:  # (F.batch_norm raises the errors: one value per channel, eps <= 0)
        y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
                         eps, unbiased_running_var=unbiased_running_var, backend=backend)
        return _activate(activation, y, reference)
    if (memory == "standard" and backend == "auto" and input.dim() == 2
            and not F._off_cpu(input) and channels.serves_batch_norm(input)):
        # 2D rows past torch's accurate count: the node on their channels-last view, the
        # slice-sums engine's path, as F.batch_norm takes it (In-Place ABN keeps the rows,
        # so that its output may still overwrite them)
        z = _BatchNormActFunction.apply(channels.rows_as_channels_last(input), weight, bias,
                                        running_mean, running_var, momentum, eps, activation,
                                        False, unbiased_running_var, True)
        return channels.channels_last_as_rows(z)
    return _BatchNormActFunction.apply(input, weight, bias, running_mean, running_var,
                                       momentum, eps, activation, memory == "inplace",
                                       unbiased_running_var, backend == "auto")


#: Fewest elements from which training-mode BatchNormAct (``memory="standard"``) and
#: GroupNormAct with a gradient run their one fused autograd node; below, the norm's own
#: path and then the activation (torch's autograd node) cost less: the fused node's
#: Python forward and backward add tens of microseconds a call, more than a pass over so
#: few values saves. The threshold sits above the largest size measured faster unfused
#: (4x32x32x32, 2^17 elements, below) and under the bench's fused-node rows (8x64x28x28).
#: Alternated ``normkit bench batch_norm_act group_norm_act`` runs at 1 and 2 threads,
#: forward+backward, fused node -> this rule: BN+ReLU 3x5x7x9 0.52-0.62x -> 0.66-0.73x,
#: 4x8x16x16 0.56-0.61x -> 0.71-0.77x, 4x32x32x32 0.72-0.99x -> 0.82-0.91x; GN+SiLU
#: 3x5x7x9 0.55-0.60x -> 0.70-0.75x, 4x8x16x16 0.57-0.61x -> 0.73-0.78x, 4x32x32x32
#: 0.72-1.20x -> 0.81-1.19x.
FUSED_ACT_MIN_ELEMENTS = 1 << 18


def _activate(activation: Activation, y: Tensor, reference: bool) -> Tensor:
    """The activation of a fresh norm output: in place unless autograd needs ``y``."""
    if reference or (torch.is_grad_enabled() and y.requires_grad):
        # (the method, not the instance, is called: torch.compile of torch 2.4 to 2.8
        # cannot call a NamedTuple instance)
        return Activation.__call__(activation, y)
    return activation.apply_(y)


def _group_norm_for_act(x, weight, bias, groups, eps, use_native, for_backward=True):
    """``(y, mean, rstd, path, repair)``: GroupNorm of ``x`` in its layout, a fresh
    tensor, by the path :class:`_GroupNormActFunction` describes (``mean``/``rstd``
    ``None`` on the compensated path, which its backward recomputes). Without a backward
    to come (``for_backward=False``) 16-bit channels-last input from
    ``GROUP_NORM_MIN_POSITIONS`` positions takes torch's channels-last forward kernel
    itself, as :func:`normkit.functional.group_norm` does.

    Where some groups (not all) are past the bound of the kernel or engine that ran,
    those groups are normalized again by the compensated core (``repair``, a
    :class:`~normkit.kernels.native.RowRepair`, else ``None``) and the others keep its
    result: each sample its own bits, as :func:`normkit.functional.group_norm` gives
    them, and one blank image no longer sends the batch to the compensated path."""
    n, c = x.shape[:2]
    layout = F._channels_last_format(x)
    fast = use_native and x.dtype in _WIDE and _same_dtype(x, weight, bias)
    half = use_native and x.dtype in _HALF and native.kernel_dtypes(x, weight, bias)
    y = mean = rstd = repair = None
    path = "robust"
    if (fast and layout is not None
            and x.shape[2:].numel() >= channels.GROUP_NORM_MIN_POSITIONS):
        pool = channels.Pool("group", groups)
        stats = channels.group_moments(x, pool, eps)
        if stats is not None:  # (the groups past the engine's bound renormalized)
            mean, _, rstd, bad = stats
            y, path = channels.affine(x, mean, rstd, weight, bias), "channels_last"
            if bad is not None:
                repair = channels.repair_groups(y, x, pool, bad, weight, bias, eps)
    elif fast or half:  # torch's kernels both ways, in x's layout; 16-bit at any size (its
        # float32 sums far under the output's rounding), channels-last 16-bit on an NCHW
        # copy (torch's channels-last 16-bit kernels are the slower, its backward ~25x)
        copy = half and layout is not None and (
            for_backward or x.shape[2:].numel() < channels.GROUP_NORM_MIN_POSITIONS)
        path = "native-nchw" if copy else "native"
        kernel_layout = layout if path == "native" else None
        w, b = native.kernel_params(x, (c,), weight, bias)  # (16-bit x: float32 statistics)
        y, mean, rstd = torch.native_group_norm(x if kernel_layout else x.contiguous(),
                                                w, b, n, c, x.numel() // (n * c), groups, eps)
        bound = channels.RATIO if kernel_layout else native.THRESHOLDS["group_norm"]
        if not native.well_conditioned(mean, rstd, bound):
            bad = native.ill_conditioned_rows(mean, rstd, bound)
            if bad.numel() == mean.numel():
                y = mean = rstd = None
                path = "robust"
            else:  # (the groups past the bound only, in the layout the kernel ran in)
                repair = native.RowRepair.apply(y, x if kernel_layout else x.contiguous(),
                                                x.numel() // mean.numel(), bad, w, b, eps,
                                                groups=groups)
        if path == "native-nchw":
            y = y.contiguous(memory_format=layout)
    if y is None:  # compensated statistics (normkit's core), recomputed in backward
        w, b = _group_params(x, groups, weight, bias)
        y = normalize(_grouped(x.contiguous(), groups), _group_dims(x), w, b,
                      eps)[0].flatten(1, 2)
        if layout is not None:
            y = y.contiguous(memory_format=layout)
    return y, mean, rstd, path, repair


def _group_norm_act_blocks(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                           groups: int, eps: float, act: Activation, keep_input: bool):
    """GroupNorm + activation of contiguous float32/float64 ``(N, C, *)`` input whose
    output would land on fresh memory, block by block of samples (about
    ``native.LAYER_NORM_BLOCK_BYTES`` each) onto huge pages: ``(z, y, mean, rstd)``, or
    ``None`` for other input, where the output's memory would not be fresh
    (:func:`~normkit.kernels.memory.fresh_out_like`: below 32 MiB, glibc's heap reuse,
    no huge pages), or where torch's kernel is not accurate for it
    (``native.THRESHOLDS``).

    torch's GroupNorm kernel allocates its own output -- at these sizes a fresh mapping
    faulted in 4 KiB pages, as is the activation's output after it. Here the kernel
    normalizes a block into a buffer glibc's heap reuses, the activation runs on it in
    place while it is in cache, and only the output ``z`` is written to the huge-page
    result -- plus the pre-activation ``y`` with ``keep_input`` (the backward of SiLU
    and GELU reads it; ``None`` otherwise). Each sample's groups are their own
    reductions, so ``y``, ``mean`` and ``rstd`` are the whole call's bits; ``z`` equals
    the activation over the whole tensor to float32 rounding (an elementwise kernel may
    round a block's last values in its scalar tail). Where the memory is not fresh the
    whole-tensor calls are faster (``benchmarks/RESULTS.md``, "GroupNormAct on NCHW:
    torch's kernels block by block onto huge pages"). No autograd:
    :class:`_GroupNormActFunction` attaches the gradient
    (:func:`_group_norm_act_backward_blocks`).

    Example:
        >>> act = make_activation("silu")
        >>> _group_norm_act_blocks(torch.randn(2, 4, 3), None, None, 2, 1e-5, act,
        ...                        True) is None  # small: nothing to gain
        True
    """
    if x.dtype not in _WIDE or not x.is_contiguous() or not _same_dtype(x, weight, bias):
        return None
    z = fresh_out_like(x)
    if z is None:
        return None
    w, b = native.kernel_params(x, x.shape[1:2], weight, bias)
    y = empty_like(x) if keep_input else None

    def store(block, yb):
        if y is not None:
            y[block].copy_(yb)
        z[block].copy_(act.apply_(yb))

    mean, rstd = native.group_norm_by_samples(x, w, b, groups, eps, store)
    if not native.well_conditioned(mean, rstd, native.THRESHOLDS["group_norm"]):
        return None
    return z, y, mean, rstd


def _group_norm_act_backward_blocks(dz: Tensor, x: Tensor, z: Tensor | None,
                                    y: Tensor | None, mean: Tensor, rstd: Tensor,
                                    weight: Tensor | None, bias: Tensor | None, groups: int,
                                    act: Activation, mask: list[bool]) -> tuple:
    """The backward of :func:`_group_norm_act_blocks`, block by block of samples: the
    activation's derivative of a block (from ``z`` or ``y``), then torch's GroupNorm
    backward kernel on it while in cache; ``dx`` equals the whole-tensor calls' to float32
    rounding, the weight and bias gradients are the blocks' partial sums added in
    float64."""
    dz = dz.contiguous()  # (the kernel reads dy in x's layout)
    n, c = x.shape[:2]
    hxw = x.shape[2:].numel()
    w = native.kernel_params(x, (c,), weight, bias)[0]  # (as the forward's)
    dx = empty_like(x) if mask[0] else None
    dws, dbs = [], []
    for block in native.sample_blocks(x):
        xb = x[block]
        dyb = act.backward(dz[block], None if z is None else z[block],
                           None if y is None else y[block])
        d, pw, pb = native.group_norm_backward(dyb, xb, mean[block], rstd[block], w,
                                               xb.shape[0], c, hxw, groups, mask)
        if dx is not None:
            dx[block].copy_(d)
        dws.append(pw)
        dbs.append(pb)
    return (dx, native.float64_total(dws, weight) if mask[1] and weight is not None else None,
            native.float64_total(dbs, bias) if mask[2] and bias is not None else None)


class _GroupNormActFunction(torch.autograd.Function):
    """GroupNorm + activation in one node; the statistics path is chosen at forward time.

    * contiguous input: torch's fused kernels, forward and backward, where accurate;
      contiguous float32/float64 input whose output would land on fresh memory block by
      block of samples onto huge pages, each block activated (and differentiated) while
      in cache (:func:`_group_norm_act_blocks`);
    * channels-last input: below ``GROUP_NORM_MIN_POSITIONS`` positions torch's kernels
      under the ``r <= 2`` rule of :mod:`normkit.kernels.channels`, from there up that
      engine (per-(sample, channel) sums both ways), as
      :func:`normkit.functional.group_norm` does;
    * 16-bit input (with 16-bit or float32 parameters): torch's kernels at any size, on
      an NCHW copy of channels-last input;
    * otherwise (ill-conditioned, mixed dtypes): normkit's compensated core, recomputed
      in backward.

    Saves the input, the output where the activation's derivative can use it, and the
    ``(N, G)`` statistics.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, act, use_native):
        blocked = None if not use_native else _group_norm_act_blocks(
            x, weight, bias, groups, eps, act, keep_input=not act.from_output)
        if blocked is not None:
            out, pre, mean, rstd = blocked
            path, repair = "native-blocks", None
        else:
            y, mean, rstd, path, repair = _group_norm_for_act(x, weight, bias, groups, eps,
                                                              use_native)
            out, pre = _activate_output(act, y)
        ctx.act, ctx.eps, ctx.groups, ctx.path, ctx.repair = act, eps, groups, path, repair
        ctx.save_for_backward(x, _kept_output(act, out), pre, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, dz):
        x, z, y, weight, bias, mean, rstd = ctx.saved_tensors
        act, groups = ctx.act, ctx.groups
        mask = list(ctx.needs_input_grad[:3])
        n, c = x.shape[:2]
        if native.backward_by_reference(dz):  # create_graph=True, batched gradients
            graph = torch.is_grad_enabled()
            with torch.enable_grad():
                w, b = _group_params(x, groups, weight, bias)
                ref = reference_normalize(_grouped(x, groups), _group_dims(x), w, b,
                                          ctx.eps)[0].flatten(1, 2)
                grads = _grads_of(act.as_taken(ref, z, y), (x, weight, bias), dz,
                                  create_graph=graph, needs=mask)
        elif ctx.path == "robust":  # through normkit's compensated core
            x_, w_, b_ = _grad_inputs((x, weight, bias), mask)
            with torch.enable_grad():
                w, b = _group_params(x, groups, w_, b_)
                y_ = normalize(_grouped(x_.contiguous(), groups), _group_dims(x), w, b,
                               ctx.eps)[0].flatten(1, 2)
            dy = act.backward(dz, z, y)
            grads = _grads_of(y_, (x_, w_, b_), dy.contiguous(), create_graph=False)
        elif ctx.path == "native-blocks":
            grads = _group_norm_act_backward_blocks(dz, x, z, y, mean, rstd, weight, bias,
                                                    groups, act, mask)
        else:
            dy = act.backward(dz, z, y)
            if ctx.path in ("native", "native-nchw"):
                layout = F._channels_last_format(x) if ctx.path == "native" else None
                w, b = native.kernel_params(x, (c,), weight, bias)  # (as the forward's)
                repair = ctx.repair
                kernel_dy = dy.contiguous(memory_format=layout or torch.contiguous_format)
                if repair is not None:  # (the repaired groups' gradients from their own
                    kernel_dy = repair.zeroed(kernel_dy)  # statistics, the rest's zeroed)
                grads = native.group_norm_backward(
                    kernel_dy, x if layout else x.contiguous(), mean, rstd, w, n, c,
                    x.numel() // (n * c), groups, mask)
                if repair is not None:
                    grads = repair.patch(grads, dy, w, b, mask)
                grads = _param_dtypes(grads, weight, bias)
            else:
                repair, pool = ctx.repair, channels.Pool("group", groups)
                if repair is None:
                    grads = channels.backward(dy, x, mean, rstd, weight, pool, mask)
                else:  # (the repaired groups' gradients from their own statistics)
                    grads = channels.repaired_backward(repair, dy, x, mean, rstd, weight,
                                                       bias, pool, mask)
        return (*grads, None, None, None, None)


def _param_dtypes(grads, weight: Tensor | None, bias: Tensor | None) -> tuple:
    """``(dx, dweight, dbias)`` with the parameter gradients in their parameters' dtypes
    (a kernel given float32 stand-ins for 16-bit parameters returns float32 ones)."""
    dx, dw, db = grads
    if dw is not None and weight is not None:
        dw = dw.to(weight.dtype)
    if db is not None and bias is not None:
        db = db.to(bias.dtype)
    return dx, dw, db


def _grouped(x: Tensor, groups: int) -> Tensor:
    return x.unflatten(1, (groups, x.shape[1] // groups))  # (N, G, C/G, *)


def _group_dims(x: Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.dim() + 1))


def _group_params(x: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None):
    pview = (1, groups, x.shape[1] // groups) + (1,) * (x.dim() - 2)
    return affine_view(weight, pview), affine_view(bias, pview)


def group_norm_act(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    act: str = "relu",
    negative_slope: float = 0.01,
    alpha: float = 1.0,
    backend: str = "auto",
) -> Tensor:
    r"""GroupNorm then an activation, ``act(group_norm(input, ...))``, in one autograd node.

    Arguments as :func:`normkit.functional.group_norm`, plus the activation (see
    :func:`batch_norm_act`). Contiguous input runs torch's fused GroupNorm kernels where
    they are accurate; channels-last input is normalized in its own layout (no copy) from
    per-channel sums (torch's channels-last GroupNorm kernel loses precision with the
    data's offset, see :mod:`normkit.kernels.native`) and gives channels-last output;
    ill-conditioned or 16-bit input takes normkit's compensated core. CUDA input takes
    torch's GroupNorm kernel, then the activation (the Triton path's launch cost made a
    conv step 1.9x slower on an H200: :data:`normkit.functional.TRITON_AUTO_OPS`);
    ``backend="triton"`` takes the Triton GroupNorm kernel, SiLU and identity fused into
    it, other activations after it.

    Example:
        >>> x = torch.randn(2, 6, 5, 5)
        >>> y = group_norm_act(x, 3, act="silu")
        >>> ref = torch.nn.functional.silu(torch.nn.functional.group_norm(x, 3))
        >>> torch.allclose(y, ref, atol=1e-5)
        True
    """
    who = "group_norm_act"
    activation = make_activation(act, negative_slope, alpha, "standard", who)
    reference = _reference_backend(backend)
    F._check_channels_first(input, who)
    channels = input.shape[1]
    valid = (isinstance(num_groups, numbers.Integral) and num_groups > 0
             and channels % num_groups == 0)
    if reference or input.numel() == 0 or not valid:
        y = F.group_norm(input, num_groups, weight, bias, eps, backend=backend)  # or raises
        return _activate(activation, y, reference)
    F._check_per_channel(input, who, weight=weight, bias=bias)
    weight, bias = F._dense_params(weight, bias)
    fused = act if act in ("silu", "identity") else None  # in the Triton kernel
    if F._use_triton(backend, input, lambda: tk.supports_group_norm(
            input, int(num_groups), weight, bias, act=fused), F._group_norm_op(input)):
        y = tk.group_norm(input, int(num_groups), weight, bias, eps, act=fused)
        return y if fused is not None else _activate(activation, y, False)
    if F._torch_kernels(backend, input):
        # torch's CUDA GroupNorm (the arguments are checked above), the activation after
        # it (see F.TRITON_AUTO_OPS)
        y = TF.group_norm(input, int(num_groups), weight, bias, eps)
        return _activate(activation, y, False)
    if backend == "auto":  # (not under torch.compile: `reference` returned above)
        input = F._dense(input)  # (a strided view: one copy first, as torch's kernels make)
    per_group = input.numel() // (input.shape[0] * num_groups)
    if per_group == 1:
        y = F.group_norm(input, num_groups, weight, bias, eps, backend=backend)  # raises
        return _activate(activation, y, reference)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (input, weight, bias))):
        # inference: no autograd node, and the activation in place on the fresh output
        # (the node keeps the pre-activation for the backward of SiLU, GELU, ...)
        blocked = None if backend != "auto" else _group_norm_act_blocks(
            input, weight, bias, int(num_groups), eps, activation, keep_input=False)
        if blocked is not None:
            return blocked[0]
        y = _group_norm_for_act(input, weight, bias, int(num_groups), eps,
                                backend == "auto", for_backward=False)[0]
        return activation.apply_(y)
    if input.numel() < FUSED_ACT_MIN_ELEMENTS:  # small: GroupNorm's node, then the act's
        y = F.group_norm(input, num_groups, weight, bias, eps, backend=backend)
        return _activate(activation, y, False)
    return _GroupNormActFunction.apply(input, weight, bias, int(num_groups), eps, activation,
                                       backend == "auto")


# --------------------------------------------------------------------------- modules


_BN_ACT_DOC = r"""BatchNorm over {what} fused with an activation (and In-Place ABN).

    .. math:: z = \mathrm{{act}}\Bigl(\frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x]
        + \epsilon}}}} \gamma + \beta\Bigr)

    A subclass of :class:`torch.nn.{parent}` (and of normkit's BatchNorm forward): same
    constructor, parameters, buffers, ``state_dict`` keys and train/eval semantics
    (running statistics, ``momentum=None``, ``num_batches_tracked``), so checkpoints of
    a plain BatchNorm load into it and back; the activation is configuration, not state.
    In training with a gradient, normalization and activation are one autograd node with
    a hand-derived backward (from :data:`FUSED_ACT_MIN_ELEMENTS` elements; smaller inputs
    run the norm then the activation, which costs less there); ``memory="inplace"`` is In-Place
    Activated BatchNorm (Rota Bulò et al. 2018): only the output is saved and the input
    is recovered in backward, for invertible activations (see :mod:`normkit.norms.fused`
    for the exact treatment of ``gamma`` and when the input buffer is overwritten).

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        momentum: running-average factor, or ``None`` (cumulative). Default: ``0.1``.
        affine: learnable ``weight`` and ``bias``. Default: ``True``.
        track_running_stats: keep running statistics. Default: ``True``.
        act: ``"relu"``, ``"leaky_relu"``, ``"elu"``, ``"silu"``, ``"gelu"`` or
            ``"identity"``. Default: ``"relu"``.
        negative_slope: LeakyReLU's slope. Default: ``0.01``.
        alpha: ELU's ``alpha``. Default: ``1.0``.
        memory: ``"standard"`` or ``"inplace"`` (``leaky_relu``, ``elu``, ``identity``
            only; a ValueError otherwise). Default: ``"standard"``.
        bias, unbiased_running_var, backend: as in :class:`normkit.{parent}`.

    Shape:
        - Input: {shape}; output: same shape, dtype and memory format.

    Example:
        >>> import torch
        >>> x = torch.randn({example})
        >>> bn = {name}(3, act="leaky_relu", memory="inplace")
        >>> plain = torch.nn.{parent}(3)
        >>> ref = torch.nn.functional.leaky_relu(plain(x), 0.01)
        >>> torch.allclose(bn(x), ref, atol=1e-5)
        True
        >>> bn.state_dict().keys() == plain.state_dict().keys()
        True
    """


class _BatchNormActForward(_BatchNormForward):
    """The forward shared by BatchNormAct1d/2d/3d."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, act: str = "relu",
                 negative_slope: float = 0.01, alpha: float = 1.0, memory: str = "standard",
                 device=None, dtype=None, **kwargs) -> None:
        # (device and dtype named: torch.nn.utils.skip_init looks for them in the signature)
        make_activation(act, negative_slope, alpha, memory, type(self).__name__)
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, **kwargs)
        self.act, self.memory = act, memory
        self.negative_slope, self.alpha = float(negative_slope), float(alpha)

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, act={self.act!r}"
        if self.act == "leaky_relu":
            text += f", negative_slope={self.negative_slope}"
        if self.act == "elu":
            text += f", alpha={self.alpha}"
        return text if self.memory == "standard" else f"{text}, memory={self.memory!r}"

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        self._check_input_dim(input)
        running_mean, running_var, use_batch_stats, factor = self._step_arguments()
        return batch_norm_act(
            input,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            use_batch_stats,
            factor,
            self.eps,
            act=self.act,
            negative_slope=self.negative_slope,
            alpha=self.alpha,
            memory=self.memory,
            unbiased_running_var=self.unbiased_running_var,
            backend=self.backend,
        )


class BatchNormAct1d(_BatchNormActForward, nn.BatchNorm1d):
    _ndims = (2, 3)
    _shape_doc = "(N, C) or (N, C, L)"
    __doc__ = _BN_ACT_DOC.format(name="BatchNormAct1d", parent="BatchNorm1d",
                                 what="a 2D or 3D input", example="8, 3, 5",
                                 shape=":math:`(N, C)` or :math:`(N, C, L)`")


class BatchNormAct2d(_BatchNormActForward, nn.BatchNorm2d):
    _ndims = (4,)
    _shape_doc = "(N, C, H, W)"
    __doc__ = _BN_ACT_DOC.format(name="BatchNormAct2d", parent="BatchNorm2d",
                                 what="a 4D input (images)", example="8, 3, 5, 5",
                                 shape=":math:`(N, C, H, W)`")


class BatchNormAct3d(_BatchNormActForward, nn.BatchNorm3d):
    _ndims = (5,)
    _shape_doc = "(N, C, D, H, W)"
    __doc__ = _BN_ACT_DOC.format(name="BatchNormAct3d", parent="BatchNorm3d",
                                 what="a 5D input (volumes, video)", example="4, 3, 2, 5, 5",
                                 shape=":math:`(N, C, D, H, W)`")


class GroupNormAct(BackendMixin, TorchGroupNorm):
    r"""GroupNorm (Wu & He 2018) fused with an activation: ``act(group_norm(x))``.

    A subclass of :class:`torch.nn.GroupNorm` (same constructor, parameters and
    ``state_dict``); the activation is configuration. One autograd node with a
    hand-derived backward (from :data:`FUSED_ACT_MIN_ELEMENTS` elements; below, the norm's
    node then the activation's, cheaper there); ``channels_last`` input stays
    ``channels_last``.

    Args:
        num_groups: number of groups; must divide ``num_channels``.
        num_channels: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        affine: learnable per-channel ``weight`` and ``bias``. Default: ``True``.
        act: one of ``"relu"``, ``"leaky_relu"``, ``"elu"``, ``"silu"``, ``"gelu"``,
            ``"identity"``. Default: ``"relu"``.
        negative_slope: LeakyReLU's slope. Default: ``0.01``.
        alpha: ELU's ``alpha``. Default: ``1.0``.
        bias: learnable ``bias`` (with ``affine``). Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``. Default: ``"auto"``.

    Shape:
        - Input: :math:`(N, C, *)`; output: same shape and memory format.

    Example:
        >>> import torch
        >>> gn = GroupNormAct(4, 16, act="silu")
        >>> gn(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, *, act: str = "relu", negative_slope: float = 0.01,
                 alpha: float = 1.0, device=None, dtype=None, **kwargs) -> None:
        # (device and dtype named: torch.nn.utils.skip_init looks for them in the signature)
        make_activation(act, negative_slope, alpha, "standard", type(self).__name__)
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype,
                         **kwargs)
        self.act = act
        self.negative_slope, self.alpha = float(negative_slope), float(alpha)

    def extra_repr(self) -> str:
        text = f"{super().extra_repr()}, act={self.act!r}"
        if self.act == "leaky_relu":
            text += f", negative_slope={self.negative_slope}"
        if self.act == "elu":
            text += f", alpha={self.alpha}"
        return text

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        check_channels(self, input, self.num_channels)
        return group_norm_act(input, self.num_groups, self.weight, self.bias, self.eps,
                              act=self.act, negative_slope=self.negative_slope,
                              alpha=self.alpha, backend=self.backend)
