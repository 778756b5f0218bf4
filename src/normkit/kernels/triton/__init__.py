"""Triton kernels: LayerNorm, RMSNorm (with residual add), LayerNorm2d (channels-first
LayerNorm), GroupNorm (NCHW and NHWC, with SiLU) and BatchNorm (statistics and apply, NCHW
and NHWC), forward and backward.

This package is the ``"triton"`` backend of normkit's forward-time dispatch. For each
op it offers a predicate that says whether the backend can serve an input, and the op
itself, a :class:`torch.autograd.Function` underneath:

==========================  =====================================================
``supports_layer_norm``     :func:`layer_norm` (optional residual add)
``supports_rms_norm``       :func:`rms_norm` (optional residual add)
``supports_group_norm``     :func:`group_norm` (optional SiLU)
``supports_batch_norm``     :func:`batch_norm_train`, :func:`batch_norm_eval`
``supports_layer_norm2d``   :func:`layer_norm2d` (channels-first LayerNorm)
==========================  =====================================================

The ops raise a ValueError that says why when their predicate is False.

Numerics follow normkit's CPU path: statistics accumulate in float32 (inputs float32,
float16 or bfloat16; the output has the input's dtype), the mean is a compensated
two-pass pair so data at a large offset keep their digits, the variance is never
``E[x^2] - E[x]^2``, NaN and Inf propagate as in torch. Indexing is int64, rows and
groups of any width are processed in chunks, and weight/bias gradients and BatchNorm
statistics are reduced without atomics (per-program partials summed in a fixed order),
so results are bitwise reproducible. A backward called with ``create_graph=True``
differentiates normkit's reference, so higher-order gradients are exact; so does every
backward of statistics over fewer than four values each, in float64
(``normkit._stats.FEW_VALUES``: their gradient is what ``eps`` leaves of cancelling terms).

Where it runs: CUDA tensors (compiled by Triton). CPU tensors only through Triton's
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before ``triton`` is
first imported in the process (:func:`interpreting`); that is how the kernels are
tested without a GPU, and it is far too slow for anything else. Importing this package
does not import ``triton``; the first predicate that needs it does.
``python -m normkit.kernels.triton.compile_check`` compiles every kernel variant for a
GPU target (sm_90 by default) on a machine without one.

Under ``torch.compile``: every launcher is a registered operator
(``torch.ops.normkit.triton_rows_fwd``, ``..._rows_bwd``, ``..._cf_fwd``, ``..._cf_bwd``,
``..._gn_fwd``, ``..._gn_bwd``, ``..._bn_stats``, ``..._bn_apply``, ``..._bn_bwd``) with a
fake implementation, so a compiled model (``fullgraph=True`` included) keeps the kernels
as opaque graph nodes and computes what eager mode computes. The device checks below are
constants of the process for the compiler.

Example:
    The predicates are cheap; an op that cannot serve its input raises, saying why:

    >>> import torch
    >>> from normkit.kernels import triton as tk
    >>> x = torch.randn(4, 8, dtype=torch.float64)
    >>> tk.supports_layer_norm(x, (8,))
    False
    >>> tk.layer_norm(x, (8,))
    Traceback (most recent call last):
    ...
    ValueError: triton layer_norm expected a float32, float16 or bfloat16 input, got float64

    On a GPU (not run here: the doctests run on a CPU without the interpreter):

    >>> x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> y, h = tk.rms_norm(x, (1024,), torch.ones(1024, device="cuda"),  # doctest: +SKIP
    ...                    residual=torch.zeros_like(x))
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from ..._constant import constant_result

__all__ = [
    "available",
    "interpreting",
    "interpreter_problem",
    "supports_layer_norm",
    "supports_rms_norm",
    "supports_group_norm",
    "supports_batch_norm",
    "supports_layer_norm2d",
    "layer_norm",
    "rms_norm",
    "layer_norm2d",
    "group_norm",
    "batch_norm_train",
    "batch_norm_eval",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ACTS = (None, "identity", "silu")


@functools.cache
def _triton_imports() -> bool:
    try:
        importlib.import_module("triton.language")
    except ImportError:
        return False
    return True


# (torch.compile calls this once while tracing and bakes in the result. The decorator
# must sit on a plain function: on a functools.cache wrapper, torch 2.11's Dynamo traces
# into the wrapper instead, reaches importlib and breaks the graph -- seen on an H200.)
@constant_result
def available() -> bool:
    """True when ``triton`` imports (the result is cached; the first call imports it).

    Prefer the ``supports_*`` predicates: they import ``triton`` only for inputs the
    backend could serve, so CPU-only runs never pay for it. (No example runs it here:
    importing ``triton`` settles its interpreter-or-compiler mode for the process, which
    ``tests/test_triton.py`` must set first.)
    """
    return _triton_imports()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"3.6.0"`` or ``"2.4.0rc1"``."""
    parts = [int("".join(ch for ch in part if ch.isdigit()) or 0)
             for part in text.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def interpreter_problem(triton_version: str | None = None,
                        numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run normkit's kernels with these versions, or None.

    Two Triton bugs, both in the interpreter only (compiled kernels on a GPU are not
    affected), found by running normkit's interpreter tests on each release:

    * Triton 3.0 and 3.1 under NumPy 2: every store a kernel makes is lost, silently
      (the tensors keep what they held). Measured with NumPy 2.3.5 on a plain vector
      store; the tests then fail with garbage. With NumPy 1.26 both releases pass every
      test, and Triton 3.2 passes with NumPy 2.3.5.
    * Triton 3.6 and older under NumPy 2.4+: the interpreter turns loop bounds into
      Python ints with ``int(array)``, which NumPy 2.4 refuses for its 1-element arrays
      ("only 0-dimensional arrays can be converted to Python scalars"), so every kernel
      with a runtime loop fails. Triton 3.7's interpreter squeezes the array first (read
      in its source; run here: 3.9 with NumPy 2.4.6).

    Defaults to the installed versions (read from the package metadata; triton is not
    imported).

    Example:
        >>> interpreter_problem("3.6.0", "2.4.1")[:42]
        "Triton's interpreter of triton 3.6.0 fails"
        >>> interpreter_problem("3.1.0", "2.0.2")[:46]
        "Triton's interpreter of triton 3.1.0 loses the"
        >>> interpreter_problem("3.1.0", "1.26.4") is None, interpreter_problem("3.7.1", "2.5.0")
        (True, None)
    """
    if triton_version is None:  # (from the installed metadata: triton is not imported)
        try:
            triton_version = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            return "the triton package is not installed (pip install triton)"
    if numpy_version is None:
        numpy_version = importlib.metadata.version("numpy")
    if _version(triton_version) < (3, 2) and _version(numpy_version) >= (2, 0):
        return (f"Triton's interpreter of triton {triton_version} loses the stores of every "
                f"kernel under NumPy {numpy_version}, silently; install triton>=3.7, or "
                f"numpy<2")
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4):
        return (f"Triton's interpreter of triton {triton_version} fails on every kernel with "
                f"a runtime loop under NumPy {numpy_version} (int() of a 1-element array, "
                f"refused since NumPy 2.4); install triton>=3.7 or numpy<2.4")
    return None


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter in this process.

    Triton settles this when ``triton`` is first imported, from ``TRITON_INTERPRET``;
    setting the variable later has no effect. When ``triton`` is not imported yet and
    the variable is not set, this returns False without importing it.

    Example:
        >>> isinstance(interpreting(), bool)
        True
    """
    if "triton" not in sys.modules and not _env_flag("TRITON_INTERPRET"):
        return False
    if not available():
        return False
    from . import _kernels

    return _kernels.INTERPRETING


# ------------------------------------------------------------------------ predicates


def _problem_device(x: Tensor) -> str | None:
    """Whether ``x``'s device can run the kernels; imports triton only when it might."""
    return _device_problem(x.device.type, str(x.device))


@constant_result  # (torch.compile: a constant of the process)
def _device_problem(device_type: str, device: str) -> str | None:
    cpu = ("a CUDA tensor, got a CPU tensor (CPU tensors run only through Triton's "
           "interpreter, which TRITON_INTERPRET=1 must switch on before triton is first "
           "imported)")
    if device_type not in ("cuda", "cpu"):
        return f"a CUDA tensor, got a tensor on {device}"
    if device_type == "cpu" and "triton" not in sys.modules and not _env_flag(
            "TRITON_INTERPRET"):
        return cpu
    if not available():
        return "the triton package, which is not installed (pip install triton)"
    if device_type == "cpu" and not interpreting():
        return cpu
    if device_type == "cpu":
        problem = _interpreter_problem()
        if problem is not None:
            return f"a working Triton interpreter for CPU tensors: {problem}"
    return None


@functools.cache
def _interpreter_problem() -> str | None:
    return interpreter_problem()


def _problem_input(x: Tensor) -> str | None:
    """Everything about ``x`` itself, cheapest checks first (the device check may import
    triton, so it comes last)."""
    if not isinstance(x, Tensor):
        return f"a torch.Tensor input, got {type(x).__name__}"
    if x.dtype not in _DTYPES:
        return f"a float32, float16 or bfloat16 input, got {str(x.dtype).replace('torch.', '')}"
    if x.numel() == 0:
        return f"a non-empty input, got shape {tuple(x.shape)}"
    return None


def _problem_tensor(x: Tensor, name: str, t: Tensor | None, numel: int,
                    dtypes: tuple[torch.dtype, ...] = _PARAM_DTYPES) -> str | None:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        return f"{name} to be a torch.Tensor or None, got {type(t).__name__}"
    if t.device != x.device:
        return f"{name} on the input's device {x.device}, got {name} on {t.device}"
    if t.dtype not in dtypes:
        return f"a floating-point {name}, got {name} of dtype {t.dtype}"
    if t.numel() != numel:
        return f"{name} with {numel} elements, got {name} of shape {tuple(t.shape)}"
    return None


def _first(*problems: str | None) -> str | None:
    for problem in problems:  # (a loop, not next() over a generator: torch 2.8's
        if problem is not None:  # torch.compile cannot trace next() with a default)
            return problem
    return None


def _as_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(s) for s in normalized_shape)


def _problem_rows(x, normalized_shape, weight, bias, residual) -> str | None:
    problem = _problem_input(x)
    if problem is not None:
        return problem
    shape = _as_shape(normalized_shape)
    if not shape or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return (f"an input of shape (*, {', '.join(map(str, shape))}) to match "
                f"normalized_shape={list(shape)}, got input of shape {tuple(x.shape)}")
    n = x.shape[x.dim() - len(shape):].numel()
    if residual is not None and (not isinstance(residual, Tensor)
                                 or residual.shape != x.shape):
        got = tuple(residual.shape) if isinstance(residual, Tensor) else type(residual).__name__
        return f"a residual of the input's shape {tuple(x.shape)}, got {got}"
    return _first(_problem_tensor(x, "weight", weight, n),
                  _problem_tensor(x, "bias", bias, n),
                  _problem_tensor(x, "residual", residual, x.numel(), _DTYPES),
                  _problem_device(x))


def _problem_channels(x, weight, bias, *, min_dim: int = 2) -> str | None:
    problem = _problem_input(x)
    if problem is not None:
        return problem
    if x.dim() < min_dim:
        return f"an input of shape (N, C, *), got a {x.dim()}D input of shape {tuple(x.shape)}"
    c = x.shape[1]
    return _first(_problem_tensor(x, "weight", weight, c),
                  _problem_tensor(x, "bias", bias, c))


def _problem_group(x, num_groups, weight, bias, act) -> str | None:
    problem = _problem_channels(x, weight, bias)
    if problem is not None:
        return problem
    if act not in _ACTS:
        return f"act to be one of {_ACTS}, got {act!r}"
    if (isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0
            or x.shape[1] % num_groups):
        return (f"num_groups to be a positive divisor of the {x.shape[1]} channels (dim 1), "
                f"got num_groups={num_groups!r}")
    return _problem_device(x)


def _problem_batch(x, weight, bias, running_mean=None, running_var=None) -> str | None:
    problem = _problem_channels(x, weight, bias)
    if problem is not None:
        return problem
    c = x.shape[1]
    return _first(_problem_tensor(x, "running_mean", running_mean, c),
                  _problem_tensor(x, "running_var", running_var, c),
                  _problem_device(x))


def supports_layer_norm(x: Tensor, normalized_shape: int | Sequence[int],
                        weight: Tensor | None = None, bias: Tensor | None = None,
                        residual: Tensor | None = None) -> bool:
    """True when :func:`layer_norm` can serve these arguments.

    Example:
        >>> supports_layer_norm(torch.randn(2, 3, dtype=torch.float64), (3,))
        False
    """
    return _problem_rows(x, normalized_shape, weight, bias, residual) is None


def supports_rms_norm(x: Tensor, normalized_shape: int | Sequence[int],
                      weight: Tensor | None = None, residual: Tensor | None = None) -> bool:
    """True when :func:`rms_norm` can serve these arguments.

    Example:
        >>> supports_rms_norm(torch.randn(2, 3).to(torch.int64), (3,))
        False
    """
    return _problem_rows(x, normalized_shape, weight, None, residual) is None


def _serves_checked_rows(x: Tensor, *params: Tensor | None) -> bool:
    """:func:`supports_layer_norm` (``params``: weight, bias) or :func:`supports_rms_norm`
    (weight) for a caller that has already checked what those check first: ``x`` a
    non-empty tensor whose trailing dims match the normalized shape, ``params`` tensors
    of that shape or None (``normkit.functional``'s argument checks). What remains:
    the dtypes, the parameters' device, the input's device. Under ``backend="auto"`` on a
    GPU every LayerNorm/RMSNorm call asks, and on a GPU host each check is host time.

    Example:
        >>> x = torch.randn(2, 8, dtype=torch.float64)
        >>> _serves_checked_rows(x, None), supports_layer_norm(x, (8,))
        (False, False)
    """
    if x.dtype not in _DTYPES:
        return False
    for t in params:
        if t is not None and (t.dtype not in _PARAM_DTYPES or t.device != x.device):
            return False
    return _problem_device(x) is None


def supports_group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None,
                        bias: Tensor | None = None, act: str | None = None) -> bool:
    """True when :func:`group_norm` can serve these arguments.

    Example:
        >>> supports_group_norm(torch.randn(2, 6, 4, 4, dtype=torch.float64), 3)
        False
    """
    return _problem_group(x, num_groups, weight, bias, act) is None


def supports_layer_norm2d(x: Tensor, weight: Tensor | None = None,
                          bias: Tensor | None = None) -> bool:
    """True when :func:`layer_norm2d` can serve these arguments.

    Example:
        >>> supports_layer_norm2d(torch.randn(2, 3, 4, 4, dtype=torch.float64))
        False
    """
    return _problem_layer_norm2d(x, weight, bias) is None


def _problem_layer_norm2d(x, weight, bias) -> str | None:
    problem = _problem_channels(x, weight, bias)
    return problem if problem is not None else _problem_device(x)


def supports_batch_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                        running_mean: Tensor | None = None,
                        running_var: Tensor | None = None) -> bool:
    """True when :func:`batch_norm_train` (and, given the running statistics,
    :func:`batch_norm_eval`) can serve these arguments.

    Example:
        >>> supports_batch_norm(torch.empty(0, 3, 4, 4))
        False
    """
    return _problem_batch(x, weight, bias, running_mean, running_var) is None


# ------------------------------------------------------------------------------- ops


def _raise_if(who: str, problem: str | None) -> None:
    if problem is not None:
        raise ValueError(f"triton {who} expected {problem}")


def _check_block(block: int | None) -> None:
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                              or block < 1 or block & (block - 1)):
        raise ValueError(f"block must be None or a power of two, got {block!r}")


def _row_norm_unchecked(x: Tensor, residual: Tensor | None, weight: Tensor | None,
                       bias: Tensor | None, ndim: int, eps: float, center: bool,
                       block: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`layer_norm` (``center``) or :func:`rms_norm` over the trailing ``ndim``
    dims, without checking the arguments: for callers that have just asked
    :func:`supports_layer_norm` (each check costs host time on a GPU, where a small
    normalization is bound by it). ``eps`` is a number, not None.

    Example (needs a CUDA GPU, or the interpreter):
        >>> if supports_layer_norm(x, (d,), w, b):  # doctest: +SKIP
        ...     y = _row_norm_unchecked(x, None, w, b, 1, 1e-5, True)
    """
    from . import _ops

    eps = float(eps)
    if _ops.records_graph(x, residual, weight, bias):
        return _ops.RowNormFunction.apply(x, residual, weight, bias, ndim, eps, center, block)
    n = x.shape[x.dim() - ndim:].numel()
    y, h, _ = _ops.rows_forward(x, residual, weight, bias, n, eps, center, block, stats=False)
    return y if h is None else (y, h)


def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5, residual: Tensor | None = None,
               *, block: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""LayerNorm over the trailing ``normalized_shape`` dims, optionally after a residual add.

    .. math:: y = \frac{h - \mathrm{E}[h]}{\sqrt{\mathrm{Var}[h] + \epsilon}} \gamma + \beta,
              \qquad h = x \;(+\; \mathrm{residual})

    Args:
        x: ``(*, *normalized_shape)``, float32/float16/bfloat16.
        normalized_shape: the trailing shape to normalize over.
        weight, bias: elementwise affine with ``normalized_shape`` elements, or ``None``.
        eps: added to the variance. Default: ``1e-5``.
        residual: a tensor of ``x``'s shape, or ``None``. When given, ``h = x + residual``
            (in the promoted dtype: an fp32 residual stream stays fp32) is normalized
            and returned as the new residual stream: the result is ``(y, h)``.
        block: largest row chunk (a power of two) one program handles at once; ``None``
            chooses per device. Tests pass a small value to exercise the chunked path.

    Returns:
        ``y`` in ``x``'s dtype and shape, or ``(y, h)`` with a residual.

    Example (needs a CUDA GPU, or the interpreter):
        >>> y = layer_norm(torch.randn(8, 4096, device="cuda"), (4096,))  # doctest: +SKIP
    """
    _raise_if("layer_norm", _problem_rows(x, normalized_shape, weight, bias, residual))
    _check_block(block)
    return _row_norm_unchecked(x, residual, weight, bias, len(_as_shape(normalized_shape)),
                              eps, True, block)


def rms_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             eps: float | None = None, residual: Tensor | None = None, *,
             block: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""RMSNorm (Zhang & Sennrich 2019) over the trailing dims, optionally after a residual add.

    .. math:: y = \frac{h}{\sqrt{\mathrm{E}[h^2] + \epsilon}} \gamma,
              \qquad h = x \;(+\; \mathrm{residual})

    Args:
        x: ``(*, *normalized_shape)``, float32/float16/bfloat16.
        normalized_shape: the trailing shape to normalize over.
        weight: elementwise scale with ``normalized_shape`` elements, or ``None``.
        eps: added to the mean square; ``None`` uses ``torch.finfo(torch.float32).eps``
            (the compute dtype's, as torch does).
        residual: as in :func:`layer_norm`: the result is then ``(y, x + residual)``.
        block: as in :func:`layer_norm`.

    Example (pre-norm Transformer block with an fp32 residual stream; needs a GPU):
        >>> y, stream = rms_norm(x_bf16, (d,), w, residual=stream)  # doctest: +SKIP
    """
    _raise_if("rms_norm", _problem_rows(x, normalized_shape, weight, None, residual))
    _check_block(block)

    if eps is None:
        eps = torch.finfo(torch.float32).eps
    return _row_norm_unchecked(x, residual, weight, None, len(_as_shape(normalized_shape)),
                              eps, False, block)


def layer_norm2d(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                 eps: float = 1e-5, *, block: int | None = None) -> Tensor:
    r"""LayerNorm over the channels of ``(N, C, *)`` input (LayerNorm2d, as in ConvNeXt).

    .. math:: y_{n,:,s} = \frac{x_{n,:,s} - \mathrm{E}_c[x_{n,:,s}]}
              {\sqrt{\mathrm{Var}_c[x_{n,:,s}] + \epsilon}} \gamma + \beta

    Every position of every sample is normalized over its ``C`` channels. Channels-last
    input (channels innermost) runs the row kernels of :func:`layer_norm` on its
    ``(N * S, C)`` view; NCHW and other layouts run channels-first kernels that read
    ``[channels, positions]`` tiles in place (loads along the positions), with no copy to
    a channels-innermost layout and back. The output keeps the input's memory format.

    Args:
        x: ``(N, C, *)``, float32/float16/bfloat16.
        weight, bias: ``(C,)`` or ``None``.
        eps: added to the variance. Default: ``1e-5``.
        block: elements of one tile (channels-first) or largest row chunk (channels
            innermost), a power of two; ``None`` chooses per device.

    Example (needs a CUDA GPU, or the interpreter):
        >>> y = layer_norm2d(torch.randn(8, 96, 56, 56, device="cuda"))  # doctest: +SKIP
    """
    _raise_if("layer_norm2d", _problem_layer_norm2d(x, weight, bias))
    _check_block(block)
    return _layer_norm2d_unchecked(x, weight, bias, eps, block)


def _layer_norm2d_unchecked(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                            eps: float, block: int | None = None) -> Tensor:
    """:func:`layer_norm2d` without the argument checks (for callers that asked
    :func:`supports_layer_norm2d`)."""
    from . import _ops

    last = x.movedim(1, -1)
    if last.is_contiguous():  # channels innermost: the rows of its (N * S, C) view
        y = _row_norm_unchecked(last, None, weight, bias, 1, eps, True, block)
        return y.movedim(-1, 1)
    if _ops.records_graph(x, weight, bias):
        return _ops.ChannelsFirstNormFunction.apply(x, weight, bias, float(eps), block)
    return _ops.cf_forward(x, weight, bias, float(eps), block, stats=False)[0]


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5, act: str | None = None, *,
               block: int | None = None) -> Tensor:
    r"""GroupNorm (Wu & He 2018) of ``(N, C, *)`` input, optionally fused with SiLU.

    Each sample's ``C`` channels form ``num_groups`` groups of consecutive channels,
    normalized over their channels and positions; then the per-channel affine, then
    ``act``. NCHW, channels_last and other layouts whose spatial dims merge into one
    stride are read in place; the output keeps the input's memory format.

    Args:
        x: ``(N, C, *)``, float32/float16/bfloat16.
        num_groups: a divisor of ``C``.
        weight, bias: ``(C,)`` or ``None``.
        eps: added to the variance. Default: ``1e-5``.
        act: ``None`` (or ``"identity"``) or ``"silu"``: ``y = z * sigmoid(z)``.
        block: elements of one tile (a power of two); ``None`` chooses per device.

    Example (needs a CUDA GPU, or the interpreter):
        >>> x = torch.randn(8, 64, 32, 32, device="cuda")  # doctest: +SKIP
        >>> y = group_norm(x.to(memory_format=torch.channels_last), 32,  # doctest: +SKIP
        ...                act="silu")
    """
    _raise_if("group_norm", _problem_group(x, num_groups, weight, bias, act))
    _check_block(block)
    from . import _ops

    if _ops.records_graph(x, weight, bias):
        return _ops.GroupNormFunction.apply(x, weight, bias, num_groups, float(eps),
                                            _ops.ACTIVATIONS[act], block)
    return _ops.gn_forward(x, num_groups, weight, bias, float(eps), _ops.ACTIVATIONS[act],
                           block)[0]


def batch_norm_train(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                     eps: float = 1e-5, *, block: int | None = None
                     ) -> tuple[Tensor, Tensor, Tensor]:
    r"""Training-mode BatchNorm of ``(N, C, *)``: normalize with the batch statistics.

    Statistics are per channel over ``N`` and every spatial position: chunks are
    reduced on the device (compensated two-pass, float32) and merged by count in
    float64, deterministically. Running statistics are the caller's: update them with
    ``mean`` and the unbiased ``var * count / (count - 1)`` (or the biased ``var``).

    Args:
        x: ``(N, C)`` or ``(N, C, *)``, float32/float16/bfloat16, any layout (NCHW and
            channels_last are read in place).
        weight, bias: ``(C,)`` or ``None``.
        eps: added to the variance. Default: ``1e-5``.
        block: elements of one tile (a power of two); ``None`` chooses per device.

    Returns:
        ``(y, mean, var)``: ``y`` in ``x``'s dtype and memory format; ``mean`` and the
        biased ``var``, float32 ``(C,)``, not differentiable.

    Example (needs a CUDA GPU, or the interpreter):
        >>> x = torch.randn(32, 64, 56, 56, device="cuda")  # doctest: +SKIP
        >>> y, mean, var = batch_norm_train(x)  # doctest: +SKIP
    """
    _raise_if("batch_norm_train", _problem_batch(x, weight, bias))
    _check_block(block)
    from . import _ops

    if _ops.records_graph(x, weight, bias):
        return _ops.BatchNormTrainFunction.apply(x, weight, bias, float(eps), block)
    mean_hi, mean_lo, var, rstd = _ops.bn_stats(x, float(eps), block)
    return _ops.bn_apply(x, mean_hi, mean_lo, rstd, weight, bias, block), mean_hi + mean_lo, var


def batch_norm_eval(x: Tensor, running_mean: Tensor, running_var: Tensor,
                    weight: Tensor | None = None, bias: Tensor | None = None,
                    eps: float = 1e-5, *, block: int | None = None) -> Tensor:
    r"""Inference-mode BatchNorm: ``(x - running_mean) / sqrt(running_var + eps) * w + b``.

    ``x - mean`` is formed before scaling (never ``x * scale + shift``), so a large
    running mean does not eat the precision. Gradients flow to ``x``, ``weight`` and
    ``bias``; the running statistics are constants.

    Example (needs a CUDA GPU, or the interpreter):
        >>> y = batch_norm_eval(x, bn.running_mean, bn.running_var, bn.weight,  # doctest: +SKIP
        ...                     bn.bias, bn.eps)
    """
    if running_mean is None or running_var is None:
        raise ValueError("triton batch_norm_eval expected running_mean and running_var "
                         "tensors, got None")
    _raise_if("batch_norm_eval", _problem_batch(x, weight, bias, running_mean, running_var))
    _check_block(block)
    from . import _ops

    if _ops.records_graph(x, weight, bias):
        return _ops.BatchNormEvalFunction.apply(x, weight, bias, running_mean, running_var,
                                                float(eps), block)
    return _ops.bn_apply(x, *_ops.running_statistics(running_mean, running_var, float(eps)),
                         weight, bias, block)
