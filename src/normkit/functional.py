"""Functional normalization, signature-compatible with ``torch.nn.functional``.

Each function takes the same positional and keyword arguments as its
``torch.nn.functional`` namesake, plus a keyword-only ``backend`` (``"auto"``,
``"eager"`` or ``"reference"``). Statistics are computed by :mod:`normkit._stats`
in float32 (float64 for float64 input) with a compensated mean, so inputs with a
large common offset keep their precision; the output has the input's dtype and
memory format.

NaN and Inf propagate exactly as in torch: a NaN or Inf anywhere in a normalized
group makes that group's statistics, and so every output of the group, NaN. They
are never replaced silently.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _stats
from .kernels import channels, library, native
from .kernels import triton as tk
from .norms import _nested
from .norms._core import (
    affine_view,
    check_backend,
    check_floating,
    compiling,
    deploying,
    in_graph,
    normalize,
    reference_normalize,
    scale_shift,
    shape_str,
)

__all__ = [
    "batch_norm",
    "instance_norm",
    "layer_norm",
    "layer_norm2d",
    "rms_norm",
    "group_norm",
    "add_layer_norm",  # noqa: F822 (resolved by the module __getattr__ below)
    "add_rms_norm",  # noqa: F822
]


#: Below these element counts (with a gradient to compute, without) RMSNorm and the
#: residual-add norms of :mod:`normkit.norms.fused` run as a composite of a few ATen ops
#: under torch's autograd (:func:`rms_rows`, the fused rows' arithmetic, so the same
#: bits; ``x + residual`` then :func:`layer_norm`) instead of normkit's fused node: its
#: fixed cost (Python and one autograd node) is larger than the whole op there. (The
#: measurements below were of torch's own composite, ``torch.nn.functional.rms_norm``,
#: which :func:`rms_rows` replaced: RESULTS.md, "RMSNorm rows: the same bits at any
#: size".) RMSNorm, float32, fused node against torch's composite
#: (``benchmarks/small_rows.py``, 1 and 2 threads, two runs): forward+backward 0.56-0.72x
#: up to 16384 elements, 0.85-0.98x at 32768, 1.01-1.13x at 65536, 1.2-1.6x at 131072;
#: forward without a gradient 0.4-0.85x up to 131072, 0.78-1.14x at 262144, 0.97-1.36x at
#: 524288. RMSNorm has no mean to cancel, so the composite is as accurate.
SMALL_ROWS_COMPOSITE_BELOW = (1 << 16, 1 << 18)


def _small_rows(x: Tensor, backend: str, *params: Tensor | None) -> bool:
    """Whether a rows op on ``x`` takes the small-input composite
    (:data:`SMALL_ROWS_COMPOSITE_BELOW`): ``backend="auto"``, eager mode, float32/float64
    with parameters of the same dtype."""
    if backend != "auto" or x.dtype not in (torch.float32, torch.float64) or compiling():
        return False
    grad = torch.is_grad_enabled() and (x.requires_grad or any(
        p is not None and p.requires_grad for p in params))
    return (x.numel() < SMALL_ROWS_COMPOSITE_BELOW[not grad]
            and all(p is None or p.dtype == x.dtype for p in params))


#: The norms whose Triton kernels ``backend="auto"`` runs on CUDA. Measured on an H200
#: (torch 2.11, Triton 3.6; benchmarks/RESULTS.md, "GPU", both measurements): launching a
#: Triton kernel from Python costs the host 20-31 us, so a call of normkit's kernels
#: costs ~0.1 ms of host time forward and ~0.5-1 ms forward+backward against torch's
#: ~0.02 and ~0.15-0.27. In a pre-norm MLP stack (8 blocks, 8192 x 1024 tokens, TF32)
#: the GPU's matrix products hide that: a step with normkit's LayerNorm/RMSNorm took
#: 0.98-0.99x torch's time, for kernels 1.15-1.88x faster than torch's forward+backward at
#: every width from 256 to 16384 (CUDA graphs) and float32 errors of ~6e-7 where torch's
#: reach 1.2e-3 (mean 1e4 x std). In a conv stack (8 x conv3x3 +
#: norm + ReLU, 32x64x56x56) nothing hides it: normkit's BatchNorm made the step 4.1x
#: slower and its GroupNorm 1.9x. So BatchNorm and GroupNorm (and the fused ops built on
#: them) run torch's CUDA kernels under ``"auto"``, and their Triton kernels only with
#: ``backend="triton"``. LayerNorm2d's channels-first kernels (``"layer_norm2d"``) are not
#: in the set until a GPU has timed them against its present route on CUDA, the row
#: kernels between copies (``benchmarks/gpu_overhead.py opt_in``). Every layer that no
#: Triton kernel serves on a GPU runs torch's kernel for the device there
#: (:func:`_torch_kernels`), never normkit's CPU paths. GroupNorm (and GroupNormAct) on
#: channels-innermost input asks for ``"group_norm_channels_last"`` (:func:`_group_norm_op`),
#: other layouts for ``"group_norm"``: the channels-last kernels (whole rows of channels,
#: since session 43) can join the set on their own once a GPU has timed them against
#: torch's, which on an H200 took 1.9x its NCHW time on channels-last input (table 5 of
#: RESULTS.md's first GPU measurement).
TRITON_AUTO_OPS = frozenset({"layer_norm", "rms_norm"})


def _group_norm_op(x: Tensor) -> str:
    """The :data:`TRITON_AUTO_OPS` entry a GroupNorm call on ``x`` asks for:
    ``"group_norm_channels_last"`` where channels are innermost (the layout the Triton
    GroupNorm reads as rows of channels; one position per channel counts too, whichever
    kernels then serve it), else ``"group_norm"``. Asked on every call: two attribute
    reads.

    Example:
        >>> x = torch.randn(2, 4, 3, 3)
        >>> _group_norm_op(x), _group_norm_op(x.to(memory_format=torch.channels_last))
        ('group_norm', 'group_norm_channels_last')
    """
    return "group_norm_channels_last" if x.stride(1) == 1 and x.dim() > 2 else "group_norm"


def _use_triton(backend: str, x: Tensor, supported, op: str) -> bool:
    """Whether this call of norm ``op`` runs the Triton kernel.

    ``backend="triton"`` always does (the kernel raises, saying why, when it cannot serve
    the input); ``"auto"`` does for CUDA tensors the kernel supports when ``op`` is in
    :data:`TRITON_AUTO_OPS`, inside torch.compile too: the kernels are registered
    operators (``torch.ops.normkit.triton_*``), so a compiled model runs the same
    kernels, with the same numerics, as in eager mode. Not under a ``torch.func``
    transform (``vmap``, ``grad``, ...), which the launchers' autograd Functions refuse:
    torch's own kernel serves there.
    """
    if backend == "triton":
        return True
    return (backend == "auto" and op in TRITON_AUTO_OPS and x.is_cuda
            and (in_graph() or not compiling()) and tk.available() and supported())


def _off_cpu(x: Tensor) -> bool:
    """Whether ``x`` lives on an accelerator (CUDA, or any device but the CPU)."""
    return not x.is_cpu


def _torch_kernels(backend: str, x: Tensor) -> bool:
    """``backend="auto"`` on an accelerator tensor that no Triton kernel serves: torch's
    own kernel for the device (see :data:`TRITON_AUTO_OPS`), never normkit's CPU-tuned
    paths, whose accuracy checks read a statistic back to the host -- a device sync per
    call, which stalls a GPU's queue of work."""
    return backend == "auto" and _off_cpu(x)


def _few_values_backend(backend: str, count: int, *tensors: Tensor | None) -> str:
    """``backend``, or ``"reference"`` where ``"auto"`` would take a gradient of
    statistics over fewer than :data:`normkit._stats.FEW_VALUES` values each.

    There the gradient is what ``eps`` leaves of cancelling terms (see ``FEW_VALUES``):
    float32 kernels, torch's and normkit's alike, lose the digits the ratio ``var / eps``
    takes (torch's layers at two values per statistic: first derivatives up to 1.9e-3,
    second derivatives up to 2.1e-2 of the largest value, where the float32 tolerance is
    5e-5; benchmarks/ACCURACY.md, "Statistics over few values"), and the reference math
    computes such statistics in float64. Inference, a symbolic count and a program being
    exported keep ``backend``.

    Example:
        >>> x = torch.randn(4, 2, requires_grad=True)
        >>> _few_values_backend("auto", 2, x), _few_values_backend("auto", 8, x)
        ('reference', 'auto')
    """
    if (backend == "auto" and type(count) is int and count < _stats.FEW_VALUES
            and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in tensors) and not deploying()):
        return "reference"
    return backend


#: ``channels_last`` (``_3d``) when a tensor is laid out so, else ``None``.
_channels_last_format = native.channels_last_format


def _dense(x: Tensor) -> Tensor:
    """``x`` when it is contiguous or channels-last, else a contiguous copy.

    normkit's CPU fast paths (torch's kernels under an accuracy check, the slice-sums
    engine) serve dense input; a strided view (a transposed sequence, a slice of the
    features, every other sample) would take the compensated core, several passes over
    memory. torch's kernels copy such a view first; so does ``backend="auto"`` on the
    CPU for LayerNorm, GroupNorm, InstanceNorm, training BatchNorm and the fused
    norm + activation layers (``benchmarks/strided_inputs.py``, forward+backward, torch
    time / normkit time: LayerNorm 0.32-0.45x -> 1.16-1.42x, GroupNorm 0.29-0.36x ->
    0.87-1.04x, BatchNorm2d 0.81-1.14x -> 1.79-2.11x; RESULTS.md "Strided views"). The
    copy is differentiable: the gradient reaches the view as it is.

    Example:
        >>> x = torch.randn(4, 6)[:, ::2]
        >>> _dense(x).is_contiguous(), torch.equal(_dense(x), x)
        (True, True)
    """
    if x.is_contiguous() or _channels_last_format(x) is not None:
        return x
    return x.contiguous()


def _channel_view(x: Tensor) -> tuple[int, ...]:
    """Broadcast shape of a per-channel parameter for ``(N, C, *)`` input."""
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _check_channels_first(x: Tensor, who: str) -> None:
    check_floating(x, who)
    if x.dim() < 2:
        raise ValueError(
            f"{who} expected input of shape (N, C, *) with at least 2 dimensions, "
            f"got a {x.dim()}D input of shape {shape_str(x)}"
        )


def _check_per_channel(x: Tensor, who: str, **tensors: Tensor | None) -> None:
    channels = x.shape[1]
    for name, t in tensors.items():
        if t is not None and t.numel() != channels:
            raise ValueError(
                f"{who} expected input with {t.numel()} channels (dim 1) to match "
                f"{name} of shape {shape_str(t)}, got input of shape {shape_str(x)}"
            )


def _dense_params(weight: Tensor | None, bias: Tensor | None) -> tuple[Tensor | None,
                                                                       Tensor | None]:
    """``weight`` and ``bias`` with contiguous storage (a differentiable copy where they are
    strided views, e.g. slices of a hypernetwork's output): torch's raw GroupNorm kernels
    (``torch.native_group_norm`` and its backward, which normkit calls directly; the
    public ``F.group_norm`` copies first) read a strided weight as if it were dense, and
    returned garbage (torch 2.13); so does its BatchNorm backward kernel on channels-last
    input (``native_batch_norm_backward``: torch's own ``F.batch_norm`` returns a wrong
    input gradient there). Every per-channel functional takes dense copies first.

    Example:
        >>> w, b = _dense_params(torch.arange(8.0)[::2], None)
        >>> w.is_contiguous(), w.tolist(), b
        (True, [0.0, 2.0, 4.0, 6.0], None)
    """
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    return weight, bias


def _reference(dims: tuple[int, ...], view: tuple[int, ...], eps: float):
    """``(x, weight, bias) -> y`` by the reference math (double backward of fast paths)."""

    def reference(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        return reference_normalize(x, dims, affine_view(weight, view), affine_view(bias, view),
                                   eps)[0]

    return reference


def _empty_result(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """The (empty) output for an input with no elements, still connected to autograd."""
    y = x
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return (y if y is not x else x.clone()).to(x.dtype)


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    unbiased_running_var: bool = True,
    backend: str = "auto",
) -> Tensor:
    r"""Batch Normalization (Ioffe & Szegedy 2015) over the channel dim of ``(N, C, *)``.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    In training the batch statistics (over ``N`` and every spatial dim) normalize the
    input and update ``running_mean``/``running_var`` in place with
    ``(1 - momentum) * running + momentum * batch``; ``running_var`` receives the
    *unbiased* batch variance, as in torch (the biased one with
    ``unbiased_running_var=False``, the Keras/Flax convention). Otherwise the running
    statistics are used.
    An empty batch normalizes to an empty output and leaves the running statistics
    untouched.

    Args:
        input: ``(N, C)`` or ``(N, C, *)``.
        running_mean, running_var: ``(C,)`` buffers or ``None``.
        weight, bias: ``(C,)`` affine parameters or ``None``.
        training: use (and update) batch statistics. Default: ``False``.
        momentum: running-average factor. Default: ``0.1``.
        eps: added to the variance. Default: ``1e-5``.
        unbiased_running_var: store the unbiased (torch) or biased (Keras, Flax) batch
            variance in ``running_var``. Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``.

    Example:
        >>> x = torch.randn(8, 3, 4, 4)
        >>> rm, rv = torch.zeros(3), torch.ones(3)
        >>> y = batch_norm(x, rm, rv, training=True)
        >>> y.shape, bool(rm.abs().sum() > 0)
        (torch.Size([8, 3, 4, 4]), True)
    """
    who = "batch_norm"
    _check_channels_first(input, who)
    _check_per_channel(input, who, running_mean=running_mean, running_var=running_var,
                       weight=weight, bias=bias)
    weight, bias = _dense_params(weight, bias)
    if training and eps <= 0.0:
        raise ValueError(f"{who} eps must be positive during training, but got {eps}")
    if eps < 0.0:
        raise ValueError(f"{who} eps must be non-negative, but got {eps}")
    # (the broadcastable views of the per-channel tensors are made where they are used:
    # each costs host time, which torch's GPU kernels below do not need)
    if not training:
        if running_mean is None or running_var is None:
            raise ValueError(
                f"{who} expected running_mean and running_var tensors when "
                f"training=False, got running_mean={'None' if running_mean is None else 'a tensor'}"
                f" and running_var={'None' if running_var is None else 'a tensor'}"
            )
        if _use_triton(backend, input, lambda: tk.supports_batch_norm(
                input, weight, bias, running_mean, running_var), "batch_norm"):
            return tk.batch_norm_eval(input, running_mean, running_var, weight, bias, eps)
        if _torch_kernels(backend, input) or (backend == "auto" and deploying()):
            # torch.export/jit.trace: torch's batch_norm, the same formula on the same
            # statistics (equal accuracy), so that the recorded program holds a batch norm
            # its consumers recognize -- ONNX's BatchNormalization (3.5-4x the speed of
            # the formula's elementwise ops in onnxruntime: benchmarks/onnx_export.py,
            # RESULTS.md), conv + BN folding -- where the formula would be anonymous
            # elementwise ops
            return torch.nn.functional.batch_norm(input, running_mean, running_var, weight,
                                                  bias, False, momentum, eps)
        if backend == "auto" and not compiling():
            y = native.batch_norm_eval(input, running_mean, running_var, weight, bias, eps)
            if y is not None:
                return y
        view = _channel_view(input)
        return scale_shift(input, running_mean.view(view), running_var.view(view),
                           affine_view(weight, view), affine_view(bias, view), eps)
    dims = (0, *range(2, input.dim()))
    count = _stats.reduced_count(input.shape, dims)
    if count == 1:
        raise ValueError(
            "Expected more than 1 value per channel when training, got input size "
            f"{shape_str(input)} (batch statistics of a single value are undefined; use "
            "a larger batch, or eval mode)"
        )
    backend = _few_values_backend(backend, count, input, weight, bias)
    view = _channel_view(input)
    if input.numel() == 0:
        return _empty_result(input, affine_view(weight, view), affine_view(bias, view))
    if _use_triton(backend, input, lambda: tk.supports_batch_norm(
            input, weight, bias, running_mean, running_var), "batch_norm"):
        y, mean, var = tk.batch_norm_train(input, weight, bias, eps)
    elif _torch_kernels(backend, input) and (unbiased_running_var or running_var is None):
        # (torch's kernel updates running_var with the unbiased variance only; called as
        # torch.batch_norm, which torch.nn.functional.batch_norm calls after checks made
        # above: on a GPU host each Python call shows, RESULTS.md "GPU, second measurement")
        return torch.batch_norm(input, weight, bias, running_mean, running_var, True,
                                momentum, eps, torch.backends.cudnn.enabled)
    elif _torch_kernels(backend, input):
        # the biased running variance (Keras, Flax): torch's kernel without the buffers,
        # which are updated below from its batch statistics (var = invstd^-2 - eps)
        y, mean, invstd = torch.native_batch_norm(input, weight, bias, None, None, True, 0.0,
                                                  eps)
        mean, var = mean.detach(), (invstd.detach().double().pow(-2) - eps).clamp_min_(0.0)
    elif backend == "auto" and in_graph() and library.serves_batch_norm_train(input, weight,
                                                                              bias):
        # torch.compile: the eager paths as one operator (kernels.library)
        y, mean, var = library.batch_norm_train(input, weight, bias, eps)
    else:
        fast = None
        eager = backend == "auto" and not compiling()  # (asked once: ~1 us each on the CPU)
        if eager:
            input = _dense(input)
        if eager and channels.serves_batch_norm(input):
            # NCHW: per-(n, c) row sums, 2-3x faster than torch's kernel; channels-last
            # (and 2D rows, viewed so) with many values per channel: column sums, where
            # torch's kernel loses precision (kernels.channels)
            if input.dim() == 2:
                fast = channels.normalize(channels.rows_as_channels_last(input), weight,
                                          bias, channels.Pool("batch"), eps,
                                          _reference((0, 2, 3), (1, -1, 1, 1), eps))
                if fast is not None:
                    fast = (channels.channels_last_as_rows(fast[0]), *fast[1:])
            else:
                fast = channels.normalize(input, weight, bias, channels.Pool("batch"), eps,
                                          _reference(dims, view, eps))
        if fast is None and eager:
            if unbiased_running_var:  # (torch's kernel updates the buffers itself)
                y = native.batch_norm_train(input, running_mean, running_var, weight, bias,
                                            momentum, eps)
                if y is not None:
                    return y
            if not unbiased_running_var or native.half_statistics(input, weight, bias):
                # the biased running variance, or 16-bit input without float32 parameters
                # past the 16-bit statistics' bound (float32 ones then, for buffers of
                # another dtype): the buffers from the kernel's statistics
                fast = native.batch_norm_train_stats(input, weight, bias, eps)
        if fast is not None:
            y, mean, var = fast
        else:
            y, mean, var = normalize(input, dims, affine_view(weight, view),
                                     affine_view(bias, view), eps, backend=backend)
    if running_mean is not None:
        _stats.update_running_(running_mean, mean.view(-1), momentum)
    if running_var is not None:
        batch_var = _stats.unbiased_var(var.view(-1), count) if unbiased_running_var else var
        _stats.update_running_(running_var, batch_var.view(-1), momentum)
    return y


def instance_norm(
    input: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
) -> Tensor:
    r"""Instance Normalization (Ulyanov et al. 2016): per sample and channel of ``(N, C, *)``.

    Statistics are taken over the spatial dims of each ``(n, c)`` slice. With
    ``use_input_stats`` and running buffers, the buffers are updated with the
    batch-averaged instance mean and unbiased variance (torch's rule). An empty batch
    leaves them untouched (torch writes NaN there; normkit never corrupts saved state).

    Args:
        input: ``(N, C, *)`` with at least one spatial dim.
        running_mean, running_var: ``(C,)`` buffers or ``None``.
        weight, bias: ``(C,)`` affine parameters or ``None``.
        use_input_stats: normalize with the instance statistics. Default: ``True``.
        momentum: running-average factor. Default: ``0.1``.
        eps: added to the variance. Default: ``1e-5``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``.

    Example:
        >>> y = instance_norm(torch.randn(2, 3, 5, 5))
        >>> torch.allclose(y.mean((2, 3)), torch.zeros(2, 3), atol=1e-5)
        True
    """
    who = "instance_norm"
    _check_channels_first(input, who)
    if input.dim() < 3:
        raise ValueError(
            f"{who} expected input of shape (N, C, *) with at least one spatial "
            f"dimension, got a {input.dim()}D input of shape {shape_str(input)}"
        )
    _check_per_channel(input, who, running_mean=running_mean, running_var=running_var,
                       weight=weight, bias=bias)
    weight, bias = _dense_params(weight, bias)
    view = _channel_view(input)
    if not use_input_stats:
        if running_mean is None or running_var is None:
            raise ValueError(
                f"{who} expected running_mean and running_var tensors when "
                f"use_input_stats=False, got running_mean="
                f"{'None' if running_mean is None else 'a tensor'} and running_var="
                f"{'None' if running_var is None else 'a tensor'}"
            )
        # per-channel running statistics: inference BatchNorm's math, so its kernels
        if _torch_kernels(backend, input):
            return torch.nn.functional.instance_norm(input, running_mean, running_var,
                                                     weight, bias, False, momentum, eps)
        if backend == "auto" and deploying():  # (as inference batch_norm does, above)
            return torch.nn.functional.batch_norm(input, running_mean, running_var, weight,
                                                  bias, False, momentum, eps)
        if backend == "auto" and not compiling():
            y = native.batch_norm_eval(input, running_mean, running_var, weight, bias, eps)
            if y is not None:
                return y
        return scale_shift(input, running_mean.view(view), running_var.view(view),
                           affine_view(weight, view), affine_view(bias, view), eps)
    dims = tuple(range(2, input.dim()))
    count = _stats.reduced_count(input.shape, dims)
    if count == 1:
        raise ValueError(
            "Expected more than 1 spatial element when training, got input size "
            f"{shape_str(input)}"
        )
    backend = _few_values_backend(backend, count, input, weight, bias)
    if input.numel() == 0:
        return _empty_result(input, affine_view(weight, view), affine_view(bias, view))
    if _torch_kernels(backend, input):
        return torch.nn.functional.instance_norm(input, running_mean, running_var, weight,
                                                 bias, True, momentum, eps)
    fast = None
    if backend == "auto" and not compiling():
        # NCHW: torch's GroupNorm kernel, one group per channel, where it is accurate;
        # channels-last (or past that bound): the slice-sums engine
        input = _dense(input)
        stats = running_mean is not None or running_var is not None
        fast = native.instance_norm(input, weight, bias, eps, stats)
        if fast is None:
            fast = channels.normalize(input, weight, bias, channels.Pool("instance"), eps,
                                      _reference(dims, view, eps))
        layout = _channels_last_format(input)
        if fast is None and layout is not None and input.dtype in (torch.float16,
                                                                   torch.bfloat16):
            # 16-bit channels-last input (the engine serves float32/float64 only): torch's
            # BatchNorm kernels sample by sample, in its layout
            fast = native.instance_norm_rows(input, weight, bias, eps, stats)
        if fast is None and layout is not None and (
                input.numel() < channels.MIN_ELEMENTS
                or input.dtype in (torch.float16, torch.bfloat16)):
            # small (or 16-bit, past the rows' bound) channels-last input: that kernel on
            # an NCHW copy (1.2-2x faster fwd+bwd than the compensated path below the
            # engine's size floor)
            fast = native.instance_norm(input.contiguous(), weight, bias, eps, stats)
            if fast is not None:
                fast = (fast[0].contiguous(memory_format=layout), *fast[1:])
        if fast is None and layout is not None and input.numel() < channels.MIN_ELEMENTS:
            # small channels-last input past every fast path: the compensated core on an
            # NCHW copy, the bits the per-channel repair of the paths above gives such
            # channels (so a sample's result does not depend on the batch around it).
            # Larger input keeps it on its own layout: on the copy, batches with a quarter
            # to half of their samples off center ran forward at 0.92-1.08x torch's time
            # against 1.37-1.86x (RESULTS.md, "Many samples a little off center")
            y, mean, var = normalize(input.contiguous(), dims, affine_view(weight, view),
                                     affine_view(bias, view), eps)
            fast = y.contiguous(memory_format=layout), mean, var
    y, mean, var = fast if fast is not None else normalize(
        input, dims, affine_view(weight, view), affine_view(bias, view), eps, backend=backend)
    n, c = input.shape[:2]
    if running_mean is not None:
        _stats.update_running_(running_mean, mean.view(n, c).mean(0), momentum)
    if running_var is not None:
        unbiased = _stats.unbiased_var(var.view(n, c), count).mean(0)
        _stats.update_running_(running_var, unbiased, momentum)
    return y


def _as_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if type(normalized_shape) is tuple:  # what torch's modules store: returned as it is
        for size in normalized_shape:
            if type(size) is not int:
                break
        else:
            return normalized_shape
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def _check_trailing(x: Tensor, shape: tuple[int, ...], who: str,
                    **params: Tensor | None) -> None:
    check_floating(x, who)
    if not shape:
        raise ValueError(f"{who} expected normalized_shape with at least one dimension (the "
                         f"trailing dims to normalize over), got normalized_shape=[]")
    if x.dim() < len(shape) or x.shape[x.dim() - len(shape):] != shape:
        raise ValueError(
            f"{who} expected input of shape (*, {', '.join(map(str, shape))}) to match "
            f"normalized_shape={list(shape)}, got input of shape {shape_str(x)}"
        )
    for name, t in params.items():
        if t is not None and t.shape != shape:
            raise ValueError(
                f"{who} expected {name} of shape {shape} (normalized_shape), got "
                f"{name} of shape {shape_str(t)}"
            )


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
) -> Tensor:
    r"""Layer Normalization (Ba et al. 2016) over the trailing ``normalized_shape`` dims.

    Args:
        input: ``(*, *normalized_shape)``.
        normalized_shape: the trailing shape to normalize over.
        weight, bias: elementwise affine of shape ``normalized_shape`` or ``None``.
        eps: added to the variance. Default: ``1e-5``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"``.

    Example:
        >>> x = torch.randn(4, 10) + 1e5          # a large offset keeps its digits
        >>> y = layer_norm(x, (10,))
        >>> ref = torch.nn.functional.layer_norm(x.double(), (10,))
        >>> float((y.double() - ref).abs().max()) < 1e-4
        True
    """
    if isinstance(input, Tensor) and input.is_nested:  # per token: on its values (_nested)
        return _nested.per_token(lambda v: layer_norm(v, normalized_shape, weight, bias, eps,
                                                      backend=backend),
                                 normalized_shape, "layer_norm", input)
    shape = _as_shape(normalized_shape)
    _check_trailing(input, shape, "layer_norm", weight=weight, bias=bias)
    if input.numel() == 0:
        return _empty_result(input, weight, bias)
    backend = _few_values_backend(backend, math.prod(shape), input, weight, bias)
    # (the shapes were checked above; the predicate asks the rest)
    if _use_triton(backend, input, lambda: tk._serves_checked_rows(input, weight, bias),
                   "layer_norm"):
        if backend == "triton":  # (checks its arguments; under "auto" supports_* did)
            return tk.layer_norm(input, shape, weight, bias, eps)
        return tk._row_norm_unchecked(input, None, weight, bias, len(shape), eps, True)
    if _torch_kernels(backend, input):
        return torch.nn.functional.layer_norm(input, shape, weight, bias, eps)
    if backend == "auto":
        if not compiling():
            y = native.layer_norm(_dense(input), shape, weight, bias, eps)
            if y is not None:
                return y
        elif in_graph() and library.serves_layer_norm(input, weight, bias):
            # torch.compile: the same path as one opaque operator (kernels.library)
            return library.layer_norm(input, shape, weight, bias, eps)
    dims = tuple(range(input.dim() - len(shape), input.dim()))
    return normalize(input, dims, weight, bias, eps, backend=backend)[0]


_MACHINE_EPS = {dtype: torch.finfo(_stats.compute_dtype(dtype)).eps
                for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _machine_eps(dtype: torch.dtype) -> float:
    """RMSNorm's default ``eps``: the machine epsilon of ``dtype``'s compute dtype (a plain
    table for the usual dtypes: no per-call ``finfo``, nothing for torch.compile to warn of)."""
    eps = _MACHINE_EPS.get(dtype)
    return torch.finfo(_stats.compute_dtype(dtype)).eps if eps is None else eps


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    r"""RMS Normalization (Zhang & Sennrich 2019) over the trailing dims.

    .. math:: y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \gamma

    ``eps=None`` uses the machine epsilon of the compute dtype (float32 for
    float16/bfloat16/float32 input, float64 for float64), as torch does.

    Example:
        >>> y = rms_norm(torch.tensor([[3.0, 4.0]]), (2,), eps=0.0)
        >>> y
        tensor([[0.8485, 1.1314]])
    """
    if isinstance(input, Tensor) and input.is_nested:  # per token: on its values (_nested)
        return _nested.per_token(lambda v: rms_norm(v, normalized_shape, weight, eps,
                                                    backend=backend),
                                 normalized_shape, "rms_norm", input)
    shape = _as_shape(normalized_shape)
    _check_trailing(input, shape, "rms_norm", weight=weight)
    if eps is None:
        eps = _machine_eps(input.dtype)
    if input.numel() == 0:
        return _empty_result(input, weight, None)
    backend = _few_values_backend(backend, math.prod(shape), input, weight)
    if _use_triton(backend, input, lambda: tk._serves_checked_rows(input, weight),
                   "rms_norm"):
        if backend == "triton":  # (checks its arguments; under "auto" supports_* did)
            return tk.rms_norm(input, shape, weight, eps)
        return tk._row_norm_unchecked(input, None, weight, None, len(shape), eps, False)
    if _torch_kernels(backend, input):
        return torch.nn.functional.rms_norm(input, shape, weight, eps)
    if check_backend(backend) == "reference" or compiling() or not input.is_contiguous():
        # (the strided path keeps the input's memory format in the output)
        dims = tuple(range(input.dim() - len(shape), input.dim()))
        return normalize(input, dims, weight, None, eps, center=False, backend=backend)[0]
    if _small_rows(input, backend, weight):
        return rms_rows(input, shape, weight, eps)
    # RMSNorm has no mean to cancel, so one path serves every contiguous input: the row
    # kernel of the fused residual-add RMSNorm with nothing to add (its backward is
    # torch's LayerNorm backward kernel plus one correction term)
    from .norms import fused

    return fused._add_norm_apply(input, None, weight, None, shape, eps, False, input.dtype,
                                 False)


def rms_rows(x: Tensor, shape: tuple[int, ...], weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of contiguous rows as a few differentiable ATen ops (torch's autograd), with
    the arithmetic of normkit's fused row kernel (``norms.fused``: ``vector_norm``, squared,
    over the count, ``+ eps``, ``rsqrt``; ``x * rstd``, then ``* weight``), so a row gets
    the same bits whichever of the two serves its call -- the composite on small inputs
    (:data:`SMALL_ROWS_COMPOSITE_BELOW`), the fused node on large ones: a sample alone
    and in a large batch alike. (torch's own composite, which it replaced there, rounds
    differently: 4.8e-7 apart at 4096-wide rows.)

    Example:
        >>> x = torch.randn(4, 8)
        >>> ref = torch.nn.functional.rms_norm(x, (8,), eps=1e-6)
        >>> bool((rms_rows(x, (8,), None, 1e-6) - ref).abs().max() < 1e-6)
        True
    """
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    count = max(math.prod(shape), 1)
    norm = _stats.row_norm(x, dims)  # (torch's vector_norm, in pieces on long rows)
    if not (torch.is_grad_enabled() and (x.requires_grad or (
            weight is not None and weight.requires_grad))):
        # (inference: in place on the fresh statistics and output, the same arithmetic,
        # fewer allocations; RESULTS.md, "RMSNorm rows: the same bits at any size")
        y = torch.mul(x, norm.square_().div_(count).add_(eps).rsqrt_())
        return y if weight is None else y.mul_(weight)
    y = x * norm.square().div(count).add(eps).rsqrt()
    return y if weight is None else y * weight


def layer_norm2d(
    input: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
) -> Tensor:
    r"""LayerNorm over the channel dimension of channels-first ``(N, C, *)`` input.

    Equivalent to permuting ``C`` last, applying ``layer_norm(x, (C,))`` and permuting
    back, without the two copies; a ``channels_last`` input stays ``channels_last``.

    Example:
        >>> x = torch.randn(2, 8, 4, 4)
        >>> y = layer_norm2d(x)
        >>> ref = torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (8,))
        >>> torch.allclose(y, ref.permute(0, 3, 1, 2), atol=1e-5)
        True
    """
    who = "layer_norm2d"
    _check_channels_first(input, who)
    _check_per_channel(input, who, weight=weight, bias=bias)
    weight, bias = _dense_params(weight, bias)
    view = _channel_view(input)
    if input.numel() == 0:
        return _empty_result(input, affine_view(weight, view), affine_view(bias, view))
    backend = _few_values_backend(backend, input.shape[1], input, weight, bias)
    if _use_triton(backend, input, lambda: tk.supports_layer_norm2d(input, weight, bias),
                   "layer_norm2d"):
        if backend == "triton":  # (checks its arguments; under "auto" supports_* did)
            return tk.layer_norm2d(input, weight, bias, eps)
        return tk._layer_norm2d_unchecked(input, weight, bias, eps)
    if _torch_kernels(backend, input):
        return _layer_norm2d_accelerator(input, weight, bias, eps)
    if backend == "auto" and not compiling():
        # channels-last (or 2D) data already has C innermost: torch's LayerNorm over the
        # last dim of the (N, *, C) view, no copies, then the view back (a strided view
        # stays so: a dense copy first measured no faster, 0.6-0.7x at two threads,
        # benchmarks/strided_inputs.py)
        last = input.movedim(1, -1)
        if last.is_contiguous():
            y = native.layer_norm(last, (input.shape[1],), weight, bias, eps)
            if y is not None:
                return y.movedim(-1, 1)
        elif input.is_contiguous():
            # NCHW, no transposing copies: sums over the channels of the whole batch on
            # few positions per sample, torch's BatchNorm kernel per sample on more; on
            # small inputs (and 2x2 images) torch's LayerNorm on a channels-innermost copy
            y = native.layer_norm2d_nchw(input, weight, bias, eps,
                                         _reference((1,), (1, input.shape[1], 1), eps))
            if y is None:
                rows = last.contiguous()
                y = native.layer_norm(rows, (input.shape[1],), weight, bias, eps)
                if y is None:  # (the compensated core on those rows: the bits the row
                    # repair gives a row past the kernel's bound, so a sample's result
                    # does not depend on the batch around it)
                    y = normalize(rows, (rows.dim() - 1,), weight, bias, eps)[0]
                y = y.movedim(-1, 1).contiguous()
            return y
    elif backend == "auto" and input.dim() > 1:
        last = input.movedim(1, -1)  # torch.compile: channels-last input, one operator
        if in_graph() and library.serves_layer_norm(last, weight, bias):
            return library.layer_norm(last, (input.shape[1],), weight, bias, eps).movedim(-1, 1)
    return normalize(input, (1,), affine_view(weight, view), affine_view(bias, view), eps,
                     backend=backend)[0]


def _layer_norm2d_accelerator(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                              eps: float) -> Tensor:
    """LayerNorm2d on a GPU: the row norm (Triton's under ``"auto"`` where it serves,
    else torch's) over the channels-innermost view, copied there first from NCHW and
    back after, so the output keeps the input's memory format."""
    last = x.movedim(1, -1)  # (N, *, C)
    nchw = not last.is_contiguous()
    if nchw:
        last = last.contiguous()
    y = layer_norm(last, (x.shape[1],), weight, bias, eps).movedim(-1, 1)
    return y.contiguous() if nchw and x.is_contiguous() else y


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
) -> Tensor:
    r"""Group Normalization (Wu & He 2018): per sample, over groups of channels.

    The ``C`` channels of ``(N, C, *)`` input are split into ``num_groups`` groups of
    ``C / num_groups`` consecutive channels; each ``(n, group)`` is normalized over its
    channels and spatial positions, then the per-channel affine is applied.
    ``num_groups=1`` is LayerNorm over ``(C, *)`` with per-channel affine;
    ``num_groups=C`` is InstanceNorm. An empty batch gives an empty output; input with
    no channels or no positions raises a ValueError, under every torch (torch's own
    rule since 2.14; before, it returned an empty output).

    Example:
        >>> x = torch.randn(2, 6, 5)
        >>> y = group_norm(x, 3)
        >>> torch.allclose(y.view(2, 3, -1).mean(-1), torch.zeros(2, 3), atol=1e-5)
        True
    """
    who = "group_norm"
    _check_channels_first(input, who)
    channels = input.shape[1]
    if (type(num_groups) is not int and not isinstance(num_groups, numbers.Integral)
            or num_groups <= 0):
        raise ValueError(f"{who} expected a positive integer num_groups, got {num_groups!r}")
    if channels % num_groups != 0:
        raise ValueError(
            f"{who} expected the number of channels (dim 1) to be divisible by "
            f"num_groups={num_groups}, got input of shape {shape_str(input)} "
            f"({channels} channels)"
        )
    if input.numel() == 0 and (channels == 0 or input.shape[2:].numel() == 0):
        # torch's rule since 2.14 (an empty batch stays fine): a group of no channels or
        # of no positions has no statistics; raised under every torch, the same answer
        what = "channel (dim 1)" if channels == 0 else "position in the dims after dim 1"
        raise ValueError(f"{who} expected at least one {what}, got input of shape "
                         f"{shape_str(input)}")
    _check_per_channel(input, who, weight=weight, bias=bias)
    weight, bias = _dense_params(weight, bias)
    # torch's rule (F.group_norm's _verify_batch_size), kept for parity: one value per
    # group, i.e. numel = N * G * (C / G) * HxW equal to G
    if input.numel() == num_groups:
        raise ValueError(
            f"Expected more than 1 value per group, got input size {shape_str(input)} "
            f"with num_groups={num_groups}"
        )
    backend = _few_values_backend(backend, channels // num_groups * math.prod(input.shape[2:]),
                                  input, weight, bias)
    if input.numel() > 0:  # (torch's GPU kernels first: they need none of the views below)
        if _use_triton(backend, input, lambda: tk.supports_group_norm(
                input, num_groups, weight, bias), _group_norm_op(input)):
            return tk.group_norm(input, num_groups, weight, bias, eps)
        if _torch_kernels(backend, input):
            return torch.nn.functional.group_norm(input, num_groups, weight, bias, eps)
    # (N, G, C/G, *): a view for any strides, channels_last included; with the affine
    # views, made only for the paths that use them (each costs host time)
    if input.numel() == 0:
        pview = (1, num_groups, channels // num_groups) + (1,) * (input.dim() - 2)
        grouped = input.unflatten(1, (num_groups, channels // num_groups))
        return _empty_result(grouped, affine_view(weight, pview),
                             affine_view(bias, pview)).reshape(input.shape)
    if backend == "auto" and in_graph() and library.serves_group_norm(input, weight, bias):
        # torch.compile: the eager paths below as one operator (kernels.library)
        return library.group_norm(input, num_groups, weight, bias, eps)
    eager = backend == "auto" and not compiling()  # (asked once: ~1 us each on the CPU)
    if eager:
        input = _dense(input)
    layout = _channels_last_format(input)
    if layout is not None and eager:
        fast = _group_norm_channels_last(input, num_groups, weight, bias, eps)
        if fast is not None:
            return fast
    if layout is not None:
        # Grouped statistics over a channels_last tensor are strided reductions with a
        # tiny inner extent (C/G), ~5x slower than on NCHW; one copy each way is cheaper.
        y = group_norm(input.contiguous(), num_groups, weight, bias, eps, backend=backend)
        return y.contiguous(memory_format=layout)
    if eager:
        y = native.group_norm(input, num_groups, weight, bias, eps)
        if y is not None:
            return y
    grouped = input.unflatten(1, (num_groups, channels // num_groups))
    dims = tuple(range(2, grouped.dim()))
    pview = (1, num_groups, channels // num_groups) + (1,) * (input.dim() - 2)
    y = normalize(grouped, dims, affine_view(weight, pview), affine_view(bias, pview), eps,
                  backend=backend)[0]
    return y.flatten(1, 2)


def _group_norm_channels_last(x: Tensor, groups: int, weight: Tensor | None,
                              bias: Tensor | None, eps: float) -> Tensor | None:
    """GroupNorm of channels-last input without copies: torch's kernels both ways below
    :data:`~normkit.kernels.channels.GROUP_NORM_MIN_POSITIONS` positions (at any size:
    on small inputs the copies to NCHW and back cost more than the kernel), the
    slice-sums engine from there up (see there why), either with the groups past its
    bound renormalized by the compensated core (each sample its own result); ``None``
    when every group is past it or neither serves them. 16-bit input (which the engine does not
    serve) takes torch's channels-last kernel from those positions up when no gradient is
    needed (its float32 sums, 2.5e-5 to 6.3e-5 off at 56 x 56 to 128 x 128 positions,
    ACCURACY.md, stay far under the output's rounding); else ``None``: the NCHW kernels
    on a copy, faster there than torch's 16-bit channels-last ones (RESULTS.md, "16-bit
    input on the CPU")."""
    many = x.shape[2:].numel() >= channels.GROUP_NORM_MIN_POSITIONS
    if x.dtype in (torch.float16, torch.bfloat16):
        kernel = many and native.kernel_dtypes(x, weight, bias) and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (x, weight, bias)))
    else:
        kernel = not many and channels.wide(x, weight, bias)
    if kernel:  # (the groups past the bound renormalized, the others kept: native.RowRepair)
        out = native.group_norm_with_stats(x, groups, weight, bias, eps, channels.RATIO,
                                           channels.REPAIR_MAX_SHARE)
        return None if out is None else out[0]
    if not many or not channels.supports(x, weight, bias):
        return None
    per_group = x.shape[1] // groups
    pview = (1, groups, per_group) + (1,) * (x.dim() - 2)

    def reference(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        grouped = x.unflatten(1, (groups, per_group))
        dims = tuple(range(2, grouped.dim()))
        return reference_normalize(grouped, dims, affine_view(weight, pview),
                                   affine_view(bias, pview), eps)[0].flatten(1, 2)

    fast = channels.normalize(x, weight, bias, channels.Pool("group", groups), eps, reference)
    return None if fast is None else fast[0]


def __getattr__(name: str):
    """``add_layer_norm`` and ``add_rms_norm`` live with the fused modules
    (:mod:`normkit.norms.fused`, which itself uses this module); they are part of the
    functional API too, resolved on first use (PEP 562)."""
    if name in ("add_layer_norm", "add_rms_norm"):
        from .norms import fused

        return getattr(fused, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
