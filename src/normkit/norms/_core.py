"""The shared normalization engine: reference, autograd Function, dispatch.

Every family in normkit is "normalize ``x`` over some dimensions, then apply an
affine map whose parameters broadcast against ``x``". The family modules only
decide the view of the input, the reduced dimensions and the view of the affine
parameters; everything else happens here, once:

* :func:`reference_normalize` -- plain PyTorch math on top of :mod:`normkit._stats`,
  differentiated by autograd. It is the test oracle (run in float64) and the
  ``backend="reference"`` path.
* :class:`NormalizeFunction` -- the default path: same forward numerics, with a
  hand-derived backward that saves only the input and the per-group statistics
  (``mean_hi``, ``mean_lo``, ``rstd``, all in float32 or float64).
  Double backward (``create_graph=True``) differentiates the reference instead,
  so higher-order gradients stay exact.
* :func:`normalize` -- chooses the backend when it runs, not when a module is built.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Sequence

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from .. import _stats
from .._constant import constant_result
from ..kernels import library
from ..kernels.native import backward_by_reference

BACKENDS = ("auto", "reference", "eager", "triton")


#: ``(major, minor)`` of the torch this process runs, for the few places where releases
#: that ``torch>=2.4`` admits differ (``.ci/versions`` runs the suite under them).
TORCH_RELEASE: tuple[int, int] = tuple(
    int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def compiling() -> bool:
    """True while torch.compile or torch.export traces the code, ``torch.jit.trace``
    records it, a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ``jacrev``
    ...) runs it, or forward-mode AD is on (inside ``torch.autograd.forward_ad.dual_level``).

    Under compilation ``backend="auto"`` takes the reference math on the CPU: it has no
    data-dependent branches (``fullgraph=True`` works) and Inductor fuses its
    elementwise passes and reductions into its own kernels. (Except on the CPU LayerNorm,
    GroupNorm and training BatchNorm (NCHW and channels-last), whose eager paths are registered
    operators, :mod:`normkit.kernels.library` -- under torch.compile only, see
    :func:`in_graph`; CUDA inputs keep the LayerNorm/RMSNorm Triton kernels, registered
    operators too, and torch's BatchNorm/GroupNorm: see
    :data:`normkit.functional.TRITON_AUTO_OPS`.) Under a ``torch.func`` transform the
    fast paths' accuracy checks cannot read a statistic back (``vmap`` refuses
    ``.item()``), so the reference math serves there too: plain torch operations, which
    every transform composes with. Under a ``FakeTensorMode`` (shape and memory
    estimation without data: ``torch.distributed._tools``' memory and runtime
    estimators, a model's shapes traced by hand) no statistic exists to read back
    either: the reference math again, whose every operator has a fake implementation. A
    ``torch.jit.trace`` graph records the operators one call ran and replays them for
    any input: a fast path's choice, made on the traced input's statistics, would be
    frozen into it (and its checks break the tracer's sanity check), so a trace records
    the reference math, accurate at any offset, too. Forward-mode AD needs a ``jvp``
    from every autograd Function it meets, which the fast paths' nodes do not have:
    plain torch operations have theirs.

    Example:
        >>> compiling()
        False
        >>> torch.func.vmap(lambda x: x * compiling())(torch.ones(2))
        tensor([1., 1.])
        >>> import torch.autograd.forward_ad as fwAD
        >>> with fwAD.dual_level():
        ...     compiling()
        True
    """
    return (torch.compiler.is_compiling() or _transforms_active() or _tracing()
            or _forward_ad.__dict__.get("_current_level", -1) >= 0
            or _dispatch_mode(_FAKE_MODE) is not None)  # (_faking(), inlined: see _tracing)


def recomputing() -> bool:
    """True while this forward runs inside a backward pass of autograd's engine: what
    activation checkpointing (``torch.utils.checkpoint``, reentrant or not, and every
    wrapper built on it -- Hugging Face's ``gradient_checkpointing_enable``) does when
    it recomputes a segment's forward to get the activations it did not keep.

    Layers with running statistics skip their update then: the first forward already
    counted this batch. torch's layers update them again (pytorch issue 96136): with
    checkpointing, ``num_batches_tracked`` counts every step twice and each batch
    enters the running averages twice. False under compilation and ``torch.func``
    transforms (:func:`compiling`): a compiled graph makes the update once already.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> seen = []
        >>> def f(x):
        ...     seen.append(recomputing())
        ...     return x.sin()
        >>> checkpoint(f, torch.ones(2, requires_grad=True), use_reentrant=False).sum().backward()
        >>> seen  # the forward, then its recomputation in backward
        [False, True]
    """
    return not compiling() and _graph_task_id() != -1


#: The id of the backward pass autograd's engine runs on this thread, -1 outside one.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def may_be_recomputed() -> bool:
    """Whether activation checkpointing may recompute this forward in backward: it runs
    under saved-tensor hooks (non-reentrant checkpointing keeps none of the tensors the
    forward saves) or without autograd (reentrant checkpointing's first forward). What a
    layer whose output reads its running statistics (BatchRenorm) keeps them for.

    Without torch's query for the saved-tensor hooks (torch 2.4 lacks
    ``torch._C._autograd._top_saved_tensors_default_hooks``) the answer is always True,
    the safe side: the copies are then kept at every training step.

    Example:
        >>> with torch.no_grad():
        ...     may_be_recomputed()
        True
        >>> may_be_recomputed() == (_saved_tensors_hooks(False) is not None)
        True
    """
    return not torch.is_grad_enabled() or _saved_tensors_hooks(False) is not None


def keep_for_recomputation(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Keep copies of the buffers ``names`` that a training forward reads before it
    updates them (BatchRenorm's running statistics, PowerNorm's), where activation
    checkpointing may recompute the forward (:func:`may_be_recomputed`): the
    recomputation must read what the first forward read (see
    :func:`restored_for_recomputation`). Nothing under compilation (a compiled graph is
    not recomputed this way) or outside checkpointing.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> with torch.no_grad():  # (as reentrant checkpointing's first forward)
        ...     keep_for_recomputation(bn, ("running_mean",))
        >>> bn.__dict__["_before_step"]
        (tensor([0., 0.]),)
    """
    if not compiling() and may_be_recomputed():
        module.__dict__["_before_step"] = tuple(
            module._buffers[name].detach().clone() for name in names)


@contextlib.contextmanager
def restored_for_recomputation(module: torch.nn.Module, names: Sequence[str]):
    """Inside: the buffers ``names`` of ``module`` are copies of what its first forward
    read (kept by :func:`keep_for_recomputation`; the current values where none was
    kept, as when the first forward ran under compilation), so that activation
    checkpointing's recomputation computes the same output; what it writes into them
    goes to the copies, dropped on exit, where the module's own buffers come back.
    One call per checkpointed segment: a layer called twice in one segment recomputes
    both calls with what the second read.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> with restored_for_recomputation(bn, ("running_mean",)):
        ...     _ = bn.running_mean.add_(5)
        >>> bn.running_mean
        tensor([0., 0.])
    """
    buffers = module._buffers
    kept = {name: buffers[name] for name in names}
    before = module.__dict__.get("_before_step") or tuple(kept.values())
    for name, value in zip(names, before, strict=True):
        buffers[name] = value.clone()
    try:
        yield
    finally:
        buffers.update(kept)


_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks",
                               lambda ignore_is_tracing: True)


def skip_recomputed_update(module: torch.nn.Module, updates: bool) -> bool:
    """Whether a layer should skip its running-statistics update in this forward:
    activation checkpointing's recomputation (:func:`recomputing`) of a forward that
    made it already. ``updates``: whether this forward would update them (training with
    running statistics). A forward that may be recomputed (:func:`may_be_recomputed`)
    records ``updates``, so a recomputation whose first forward did not update them --
    FairScale's ``checkpoint_wrapper`` switches ``track_running_stats`` off for it, to
    make the update in the recomputation instead -- makes it once, there.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> skip_recomputed_update(bn, True)  # an ordinary forward
        False
    """
    if compiling():
        return False
    if _graph_task_id() != -1:  # recomputing
        return module.__dict__.get("_first_forward_updated", True)
    if may_be_recomputed():
        module.__dict__["_first_forward_updated"] = updates
    return False


#: Whether a torch.func transform is active (looked up once: compiling() runs on every
#: call of every layer).
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
#: Whether ``torch.jit.trace`` is recording: the C function ``torch.jit.is_tracing`` calls
#: (outside TorchScript, which cannot compile normkit's layers anyway), without its
#: Python frame. compiling() runs on every call, and right after a large kernel from cold
#: caches, where that frame cost ~7 us (``benchmarks/host_overhead.py cold``).
_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)


def _faking() -> bool:
    """Whether a ``FakeTensorMode`` is active (tensors with shapes but no data)."""
    return _dispatch_mode(_FAKE_MODE) is not None


def transformed() -> bool:
    """True inside a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ``jacrev``
    ...) or forward-mode AD (``torch.autograd.forward_ad.dual_level``), outside
    torch.compile's tracing: where a layer whose backward is not a derivative (PowerNorm's)
    cannot run.

    Example:
        >>> transformed(), torch.func.vmap(lambda x: x * transformed())(torch.ones(2))
        (False, tensor([1., 1.]))
    """
    return not torch.compiler.is_compiling() and (
        _transforms_active() or _forward_ad.__dict__.get("_current_level", -1) >= 0)


def without_data(t: Tensor) -> bool:
    """Whether ``t``'s values cannot be read: a meta tensor, or any tensor while a
    ``FakeTensorMode`` is active. Shape inference runs there; the few layer decisions
    made on a value (Batch Renormalization's step count, In-Place ABN's unrecoverable
    channels) then take the choice every input shape allows.

    Example:
        >>> without_data(torch.ones(2)), without_data(torch.ones(2, device="meta"))
        (False, True)
    """
    # (torch.compile's own fake tensors are traced: Dynamo reads what it can, and the
    # mode lookup is not traceable)
    return t.is_meta or (not torch.compiler.is_compiling() and _faking())


_dispatch_mode = getattr(torch._C, "_get_dispatch_mode", lambda key: None)
_FAKE_MODE = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _exporting() -> bool:
    """Whether torch.export is tracing.

    From torch 2.7 the exporting flag is read itself: Dynamo up to torch 2.11 at least
    folds a *call* of ``torch.compiler.is_exporting()`` to True under any torch.compile
    trace (2.13 reads the flag), so compiled models took export's paths -- the reference
    math instead of the registered operators. Reading the module attribute gives its
    value in eager code, in a compile trace (False) and in an export trace (True).

    torch 2.4-2.6 have no exporting flag, but only export raises their compiling flag
    (torch.compile's Dynamo answers ``is_compiling()`` without it): that flag, read the
    same way, tells a non-strict export. Before torch 2.8 a strict export (the default
    ``strict=True`` up to 2.7) traces the model with Dynamo before raising either flag:
    there Dynamo's own record of the trace tells (:func:`_dynamo_strict_export`).
    """
    if _STRICT_EXPORT_UNFLAGGED:
        flag = getattr(torch.compiler, "_is_exporting_flag",
                       getattr(torch.compiler, "_is_compiling_flag", False))
        return bool(flag) or (torch.compiler.is_compiling() and _dynamo_strict_export())
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return bool(flag) if isinstance(flag, bool) else _is_exporting()


#: torch 2.4-2.7 trace a strict export with Dynamo while the exporting flag (2.4-2.6: the
#: compiling flag) is down (2.8 raises it first): in that trace it reads False, as under
#: torch.compile.
_STRICT_EXPORT_UNFLAGGED = TORCH_RELEASE < (2, 8)


def _dynamo_strict_export() -> bool:
    """Whether the Dynamo trace under way is a strict ``torch.export`` (torch 2.4-2.7):
    Dynamo's own record of it, read at trace time (Dynamo takes the answer as a
    constant, ``assume_constant_result``; a private attribute of those fixed releases,
    read on no other). False outside a Dynamo trace (a non-strict export runs the
    Python itself)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        translator = InstructionTranslator.current_tx()
    except AttributeError:  # no Dynamo trace on this thread
        return False
    return bool(getattr(translator, "export", False))


if _STRICT_EXPORT_UNFLAGGED:
    _dynamo_strict_export = constant_result(_dynamo_strict_export)


def in_graph() -> bool:
    """True while torch.compile traces the code (not under a ``torch.func`` transform
    alone, nor torch.export): where :mod:`normkit.kernels.library`'s registered
    operators serve.

    An exported program is made to run elsewhere -- AOTInductor, ExecuTorch, ONNX, a
    process that never imports normkit -- where normkit's Python operators do not exist,
    so under torch.export ``backend="auto"`` records the reference math instead: ATen
    operators only (and torch's own kernels on a GPU; inference BatchNorm records torch's
    ``batch_norm``, :func:`deploying`).

    Example:
        >>> in_graph()
        False
    """
    return torch.compiler.is_compiling() and not _exporting()


def deploying() -> bool:
    """True while ``torch.export`` or ``torch.jit.trace`` records the code: a program
    made to run elsewhere (ONNX, AOTInductor, ExecuTorch, a process without normkit).
    Inference BatchNorm (and InstanceNorm on running statistics) then records torch's
    ``batch_norm``: the same formula on the same statistics, which the consumers of such
    programs recognize (ONNX ``BatchNormalization``, conv + BN folding) where the
    reference math is a few anonymous elementwise operators.

    Example:
        >>> deploying()
        False
    """
    return _exporting() or torch.jit.is_tracing()


def read_before_update(buffer: Tensor) -> Tensor:
    """``buffer`` as read now, by a training forward that updates it in place later and
    whose backward uses what it read (BatchRenorm's running statistics in r and d,
    PowerNorm's running quadratic mean). Under torch.compile a copy through
    :func:`normkit.kernels.library.snapshot`, without which torch 2.13's compiled
    backward reads the buffer after the update (wrong gradients); elsewhere ``buffer``
    itself (eager code reads it at once).

    Example:
        >>> running = torch.ones(2)
        >>> read_before_update(running) is running  # (eager)
        True
    """
    return library.snapshot(buffer) if in_graph() else buffer


#: float16's largest finite value: a running variance or mean square above it (a standard
#: deviation or RMS above 256) is stored as inf.
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


#: what to do about running statistics that overflowed float16 (:func:`overflowed_float16`)
FLOAT16_STATISTICS_REMEDY = (
    "keep the norm layers in float32 -- layer.float(): they take float16 input with "
    "float32 parameters and statistics and return float16, as under torch.autocast -- or "
    "fold BatchNorm into the layer before it ahead of .half() (normkit.fold_batchnorm); "
    "then reload the statistics from the float32 checkpoint or recompute them "
    "(normkit.update_bn_stats)")


def overflowed_float16(value: Tensor) -> bool:
    """Whether a float16 statistic holds infinite values and no NaN: values past float16's
    range (:data:`FLOAT16_MAX`), stored or converted.

    Example:
        >>> overflowed_float16(torch.tensor([1.0, 1e5]).half())
        True
        >>> overflowed_float16(torch.tensor([1.0, float("inf")]))  # float32: not range
        False
    """
    return (value.dtype == torch.float16 and bool(torch.isinf(value).any())
            and not bool(torch.isnan(value).any()))


def statistic_problem(module: torch.nn.Module, name: str, value: Tensor) -> str | None:
    """What is wrong with a running statistic that holds NaN or Inf, why, and what to do
    (``None`` when every value is finite): the warning an inference forward gives
    (:func:`check_running_statistics`).

    A float16 statistic with infinite values and no NaN overflowed float16's range when
    it was stored or converted (``model.half()``, a float32 checkpoint loaded into a
    float16 model, a float16 training step); anything else usually comes from a training
    step that diverged.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2).half()
        >>> bn.running_var.copy_(torch.tensor([1.0, 1e5]))  # 1e5 > 65504: inf
        tensor([1., inf], dtype=torch.float16)
        >>> print(statistic_problem(bn, "running_var", bn.running_var))  # doctest: +ELLIPSIS
        running_var holds 1 infinite value(s) of 2 in float16, whose largest is 65504: ...
        >>> statistic_problem(bn, "running_mean", bn.running_mean) is None
        True
    """
    bad = ~torch.isfinite(value.detach())
    if not bool(bad.any()):
        return None
    count, numel = int(bad.sum()), value.numel()
    if overflowed_float16(value):
        square = name in ("running_var", "running_phi")
        return (
            f"{name} holds {count} infinite value(s) of {numel} in float16, whose largest is "
            f"{FLOAT16_MAX:.0f}: {'a variance' if name == 'running_var' else 'a value'} "
            "above it"
            + (" (a standard deviation above 256)" if name == "running_var" else
               " (a root mean square above 256)" if square else "")
            + " overflowed when it was stored or converted (model.half(), a float32 "
            "checkpoint loaded into a float16 model, a float16 training step), and in "
            "inference those channels output "
            + ("their bias alone" if square else "infinite or NaN values")
            + ". " + FLOAT16_STATISTICS_REMEDY[0].upper() + FLOAT16_STATISTICS_REMEDY[1:])
    return (f"{name} holds {count} NaN/Inf value(s) of {numel} ({value.dtype}): in "
            f"inference those channels output NaN or a constant. NaN statistics usually "
            "come from a training step that diverged: reload the last good checkpoint or "
            "recompute them (normkit.update_bn_stats), and lower the learning rate or clip "
            "gradients")


#: the module attribute holding what :func:`check_running_statistics` last checked
_CHECKED = "_normkit_checked_statistics"


def check_running_statistics(module: torch.nn.Module,
                             names: Sequence[str] = ("running_mean", "running_var")) -> None:
    """Warn (RuntimeWarning) when an inference forward reads running statistics that
    hold NaN or Inf (see :func:`statistic_problem`): they do not fail loudly -- an
    infinite variance makes its channels output their bias alone -- so without this a
    model that overflowed float16 just predicts worse.

    Checks each statistic once per change (its tensor, dtype or in-place version, or a
    training forward: :func:`forget_checked_statistics`), so a model in eval mode reads
    back one flag per layer after each training phase or conversion, not at every call
    (on a GPU, one host sync then). Nothing is checked
    while torch.compile, torch.export, jit.trace or a ``torch.func`` transform runs
    the code (:func:`compiling`), nor in ``nn.DataParallel``'s replicas.

    Example:
        >>> import warnings
        >>> bn = torch.nn.BatchNorm1d(2).half().eval()
        >>> _ = bn.running_var.fill_(float("inf"))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     check_running_statistics(bn)
        ...     check_running_statistics(bn)  # unchanged since: not read again
        >>> len(caught), caught[0].message.args[0][:45]
        (1, 'BatchNorm1d(2, eps=1e-05, momentum=0.1, affin')
    """
    if torch.compiler.is_compiling() or module.__dict__.get("_is_replica"):
        # (an nn.DataParallel replica holds buffers broadcast anew at every call: a check
        # would read a flag back from each device at every forward)
        return
    seen = module.__dict__.get(_CHECKED)
    if seen is None:
        seen = module.__dict__[_CHECKED] = {}
    buffers = module._buffers  # (not getattr: nn.Module's __getattr__ costs more here)
    for name in names:
        value = buffers.get(name)
        if value is None:
            continue
        try:
            key = (id(value), value.data_ptr(), value.dtype, value._version)
        except RuntimeError:  # an inference tensor (no version counter), a fake tensor
            key = (id(value), None, value.dtype, None)
        if seen.get(name) == key:
            continue
        if compiling():  # (a transform, a trace, a fake mode: checked eagerly later)
            return
        seen[name] = key
        if without_data(value):
            continue
        problem = statistic_problem(module, name, value)
        if problem is not None:
            warnings.warn(f"{module!r} in eval mode: {problem}", RuntimeWarning,
                          stacklevel=_caller_level())


def forget_checked_statistics(module: torch.nn.Module) -> None:
    """Make the next :func:`check_running_statistics` of ``module`` read its statistics
    again: called by every training forward that may update them, since torch's
    ``batch_norm`` kernel updates them in place without moving their version counter.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2).eval()
        >>> check_running_statistics(bn)
        >>> forget_checked_statistics(bn)
        >>> _CHECKED in bn.__dict__
        False
    """
    if not torch.compiler.is_compiling():
        module.__dict__.pop(_CHECKED, None)


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, _stats))


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside torch and normkit, from the caller
    of :func:`warnings.warn` up: the line of user code that called the model."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def check_backend(backend: str) -> str:
    """Validate a backend name (see :data:`BACKENDS`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_floating(x: Tensor, who: str) -> None:
    """Raise a ValueError unless ``x`` is a real floating-point tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{who} expected a torch.Tensor input, got {type(x).__name__}")
    if x.is_nested:
        from ._nested import refuse

        refuse(x, who)
    if not x.is_floating_point():
        raise ValueError(
            f"{who} expected a floating-point input (float16, bfloat16, float32 or "
            f"float64), got dtype {x.dtype}"
        )


def check_channels(module, input: Tensor, channels: int) -> None:
    """A module's check for floating ``(N, channels, *)`` input, in the module's name."""
    name = type(module).__name__
    check_floating(input, name)
    if input.dim() < 2 or input.shape[1] != channels:
        raise ValueError(
            f"{name} expected input of shape (N, {channels}, *) with {channels} channels "
            f"(dim 1), got input of shape {shape_str(input)}"
        )


def shape_str(x: Tensor) -> str:
    """``(8, 3, 32, 32)``: a shape the way users write it."""
    return "(" + ", ".join(str(s) for s in x.shape) + ")"


def affine_view(param: Tensor | None, shape: Sequence[int]) -> Tensor | None:
    """View a parameter so that it broadcasts against the (viewed) input."""
    return None if param is None else param.view(tuple(shape))


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def reference_normalize(
    x: Tensor,
    dims: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    center: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Normalize ``x`` over ``dims`` with plain, differentiable PyTorch math.

    Returns ``(y, mean, var)``: ``y`` in ``x``'s dtype, and the statistics in the
    compute dtype with keepdim shapes (``mean`` is zero and ``var`` is the mean
    square when ``center`` is False, i.e. RMSNorm). Statistics over fewer than
    :data:`normkit._stats.FEW_VALUES` values are computed (and differentiated) in float64,
    where the device has it: their derivatives are what ``eps`` leaves of cancelling terms.

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
        >>> y, mean, var = reference_normalize(x, (1,), eps=0.0)
        >>> y
        tensor([[-1.2247,  0.0000,  1.2247]], dtype=torch.float64)
    """
    # (float64 over fewer than FEW_VALUES values per statistic: the derivatives there
    # cancel to what eps leaves, _stats.reference_dtype)
    wide = _stats.reference_dtype(x, _stats.reduced_count(x.shape, dims))
    xc = x if x.dtype == wide else x.to(wide)
    if center:
        m = _stats.moments(xc, dims)
        centered = m.shifted - m.mean_lo
        mean, var = m.mean_hi + m.mean_lo, m.var  # (not the property: torch 2.4 cannot trace it)
    else:
        centered = xc
        var = _stats.mean_square(xc, dims)
        mean = torch.zeros_like(var)
    y = centered * torch.rsqrt(var + eps)
    y = _affine(y, weight, bias)
    stats = _stats.compute_dtype(x.dtype)
    return y.to(x.dtype), mean.detach().to(stats), var.detach().to(stats)


class NormalizeFunction(torch.autograd.Function):
    """Normalize over ``dims`` and apply the affine map, with a hand-derived backward.

    With ``xhat = (x - mean) * rstd`` and ``g = dy * weight`` the input gradient is
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (the ``mean(g)`` term is
    absent without centering), ``dweight = sum(dy * xhat)`` and ``dbias = sum(dy)``
    over the dimensions the parameters broadcast along.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dims, eps, center):
        y, mean_hi, mean_lo, var, rstd = normalize_forward(x, dims, weight, bias, eps, center)
        ctx.dims, ctx.eps, ctx.center = tuple(dims), eps, center
        ctx.save_for_backward(x, weight, bias, mean_hi, mean_lo, rstd)
        mean = mean_hi + mean_lo
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, weight, bias, mean_hi, mean_lo, rstd = ctx.saved_tensors
        if backward_by_reference(dy):
            return _double_differentiable_backward(ctx, dy, x, weight, bias)
        grads = normalize_backward(dy, x, weight, bias, mean_hi, mean_lo, rstd, ctx.dims,
                                   ctx.center, ctx.needs_input_grad[:3])
        return (*grads, None, None, None)


def normalize_forward(x: Tensor, dims: Sequence[int], weight: Tensor | None,
                      bias: Tensor | None, eps: float, center: bool = True,
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, mean_hi, mean_lo, var, rstd)``: :class:`NormalizeFunction`'s forward, no
    autograd (``y`` in ``x``'s dtype, statistics keepdim in the compute dtype; without
    centering the mean pair is zeros).

    Example:
        >>> x = torch.randn(4, 8) + 1e4
        >>> y, hi, lo, var, rstd = normalize_forward(x, (1,), None, None, 1e-5)
        >>> torch.allclose(y.double(), torch.nn.functional.layer_norm(x.double(), (8,)).double(),
        ...                atol=1e-5)
        True
    """
    xc = _stats.upcast(x)
    if center:
        m = _stats.moments(xc, dims)
        mean_hi, mean_lo, var = m.mean_hi, m.mean_lo, m.var
        rstd = torch.rsqrt(var + eps)
        y = m.shifted.sub_(m.mean_lo).mul_(rstd)  # in place on the shifted temporary
    else:
        var = _stats.mean_square(xc, dims)
        mean_hi = mean_lo = torch.zeros_like(var)
        rstd = torch.rsqrt(var + eps)
        y = xc * rstd  # one pass, no copy of the input first
    if weight is not None:
        y.mul_(weight)
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype), mean_hi, mean_lo, var, rstd


def normalize_backward(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                       mean_hi: Tensor, mean_lo: Tensor, rstd: Tensor, dims: Sequence[int],
                       center: bool, needs: Sequence[bool],
                       ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` of :class:`NormalizeFunction` from its saved statistics.

    ``mean_hi + mean_lo`` is the compensated mean (keepdim shapes), ``weight``/``bias``
    are viewed to broadcast; ``needs`` says which gradients to compute (``None`` for the
    others). Plain tensor arithmetic, no autograd: torch.library operators call it too.

    Example:
        >>> x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        >>> y = torch.nn.functional.layer_norm(x, (8,))
        >>> dy = torch.randn_like(y)
        >>> y.backward(dy)
        >>> xd = x.detach()
        >>> mean, rstd = xd.mean(1, keepdim=True), (xd.var(1, False, keepdim=True) + 1e-5).rsqrt()
        >>> dx, _, _ = normalize_backward(dy, xd, None, None, mean, torch.zeros_like(mean),
        ...                               rstd, (1,), True, (True, False, False))
        >>> torch.allclose(dx, x.grad)
        True
    """
    need_x, need_w, need_b = needs
    if center:
        xhat = (_stats.upcast(x) - mean_hi).sub_(mean_lo).mul_(rstd)
    else:
        xhat = _stats.upcast(x) * rstd
    g = _stats.upcast(dy)
    dx = dw = db = None
    if need_w and weight is not None:
        dw = (g * xhat).sum_to_size(weight.shape).to(weight.dtype)
    if need_b and bias is not None:
        db = g.sum_to_size(bias.shape).to(bias.dtype)
    if need_x:
        if weight is not None:
            g = g * weight
        proj = (g * xhat).mean(tuple(dims), keepdim=True)
        dx = g - xhat.mul_(proj)
        if center:
            dx = dx.sub_(g.mean(tuple(dims), keepdim=True))
        dx = dx.mul_(rstd).to(x.dtype)
    return dx, dw, db


def _double_differentiable_backward(ctx, dy, x, weight, bias):
    """Backward for ``create_graph=True`` (and batched gradients): differentiate the
    reference with autograd, differentiably where grad mode is on."""
    wanted = zip((x, weight, bias), ctx.needs_input_grad[:3], strict=True)
    inputs = [t for t, need in wanted if need]
    graph = torch.is_grad_enabled()
    with torch.enable_grad():
        y, _, _ = reference_normalize(x, ctx.dims, weight, bias, ctx.eps, ctx.center)
        grads = iter(torch.autograd.grad(y, inputs, dy, create_graph=graph, allow_unused=True))
    out = [next(grads) if need else None for need in ctx.needs_input_grad[:3]]
    return (*out, None, None, None)


def normalize(
    x: Tensor,
    dims: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    center: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """Normalize ``x`` over ``dims`` and apply ``weight``/``bias`` (already viewed).

    Returns ``(y, mean, var)`` like :func:`reference_normalize`. The backend is
    chosen here, at call time: ``"reference"`` differentiates the reference math,
    ``"eager"`` and ``"auto"`` use :class:`NormalizeFunction`.

    Example:
        >>> x = torch.randn(4, 8)
        >>> y, mean, var = normalize(x, (1,))
        >>> torch.allclose(y.mean(1), torch.zeros(4), atol=1e-6)
        True
    """
    check_backend(backend)
    if backend == "triton":
        raise ValueError("backend='triton' has no kernel for this normalization; expected one "
                         "of layer_norm, rms_norm, layer_norm2d, group_norm, batch_norm (or "
                         "backend='auto')")
    dims = tuple(d % x.dim() for d in dims)
    if backend == "reference" or (backend == "auto" and compiling()):
        return reference_normalize(x, dims, weight, bias, eps, center)
    return NormalizeFunction.apply(x, weight, bias, dims, eps, center)


def scale_shift(
    x: Tensor,
    mean: Tensor,
    var: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with fixed statistics.

    This is inference-mode BatchNorm/InstanceNorm: the statistics are constants
    (running buffers), so the result is an affine map of ``x``. ``x - mean`` is
    formed first, so a large common offset does not eat the precision. All
    arguments are already viewed to broadcast against ``x``.

    Example:
        >>> scale_shift(torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([4.0]),
        ...             None, None, 0.0)
        tensor([1.])
    """
    xc = _stats.upcast(x)
    # (float32 statistics of a float64 input: the square root in float64 too)
    scale = torch.rsqrt(var.to(torch.promote_types(_stats.upcast(var).dtype, xc.dtype)) + eps)
    if weight is not None:
        scale = scale * weight
    centered = xc - mean.to(xc.dtype)
    if bias is None:
        y = centered * scale
    else:
        y = torch.addcmul(bias.to(xc.dtype), centered, scale)
    return y.to(x.dtype)
