"""BatchNorm and its relatives: drop-in BatchNorm1d/2d/3d, FrozenBatchNorm, BatchRenorm."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.fx import Proxy

from .. import _stats
from .. import functional as F
from ..kernels import channels, native
from ._arguments import check_arguments
from ._base import BackendMixin, NotScriptable, fx_leaf
from ._core import (
    TORCH_RELEASE,
    _exporting,
    check_channels,
    check_floating,
    check_running_statistics,
    compiling,
    forget_checked_statistics,
    keep_for_recomputation,
    normalize,
    read_before_update,
    recomputing,
    restored_for_recomputation,
    shape_str,
    skip_recomputed_update,
    without_data,
)

__all__ = [
    "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "check_batch_input",
    "FrozenBatchNorm", "FrozenBatchNorm1d", "FrozenBatchNorm2d", "FrozenBatchNorm3d",
    "BatchRenorm1d", "BatchRenorm2d", "BatchRenorm3d", "renorm_limits",
]

_DOC = r"""Batch Normalization over {what} (Ioffe & Szegedy 2015).

    .. math::
        y = \frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x] + \epsilon}}}} \gamma + \beta

    A drop-in subclass of :class:`torch.nn.{name}`: same constructor, parameters,
    buffers, ``state_dict`` keys and train/eval semantics (batch statistics in
    training, running statistics in eval, ``momentum=None`` for a cumulative average,
    unbiased ``running_var``, ``num_batches_tracked``). Statistics are computed in
    float32 (float64 for float64 input) with a compensated mean, so inputs with a
    large offset keep their precision; float16/bfloat16 inputs give outputs of the
    same dtype.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        momentum: running-average factor, or ``None`` for a cumulative average.
            Default: ``0.1``.
        affine: learnable ``weight`` and ``bias``. Default: ``True``.
        track_running_stats: keep running statistics. Default: ``True``.
        bias: learnable ``bias`` (with ``affine``). Default: ``True``.
        unbiased_running_var: store the unbiased batch variance in ``running_var``
            (torch's convention), or the biased one (Keras/Flax; see
            :mod:`normkit.conventions`). Keyword-only. Default: ``True``.
        backend: ``"auto"``, ``"eager"`` or ``"reference"`` (keyword-only, read at
            every forward). Default: ``"auto"``.

    Shape:
        - Input: {shape}
        - Output: same shape, dtype and memory format as the input.

    Example:
        >>> import torch, normkit
        >>> bn = normkit.{name}(3)
        >>> y = bn(torch.randn({example}))
        >>> y.shape == torch.Size([{example}]), int(bn.num_batches_tracked)
        (True, 1)
    """


def check_batch_input(module: nn.Module, input: Tensor, ndims: tuple[int, ...],
                      shape_doc: str) -> None:
    """The input checks every BatchNorm-like module shares (dtype, rank, channels).

    Raises a ``ValueError`` naming what was expected and what was given (a non-floating
    dtype, another rank, another channel count; a ``TypeError`` for a non-tensor);
    returns ``None`` otherwise.

    Example::

        >>> import torch, normkit
        >>> from normkit.norms.batch import check_batch_input
        >>> bn = normkit.BatchNorm2d(3)
        >>> check_batch_input(bn, torch.randn(2, 3, 4, 4), (4,), "(N, C, H, W)")
        >>> check_batch_input(bn, torch.randn(2, 3), (4,), "(N, C, H, W)")
        Traceback (most recent call last):
            ...
        ValueError: BatchNorm2d expected 4D input (N, C, H, W), got a 2D input of shape (2, 3)
    """
    name = type(module).__name__
    check_floating(input, name)
    if ndims and input.dim() not in ndims:
        expected = " or ".join(f"{d}D" for d in ndims)
        raise ValueError(
            f"{name} expected {expected} input {shape_doc}, got a "
            f"{input.dim()}D input of shape {shape_str(input)}"
        )
    check_channels(module, input, module.num_features)


class _BatchNormForward(BackendMixin):
    """The forward shared by BatchNorm1d/2d/3d (torch's ``_BatchNorm.forward`` logic)."""

    _ndims: tuple[int, ...] = ()
    _shape_doc: str = ""

    def __init__(self, *args, unbiased_running_var: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.unbiased_running_var = bool(unbiased_running_var)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return base if self.unbiased_running_var else f"{base}, unbiased_running_var=False"

    def _check_input_dim(self, input: Tensor) -> None:
        check_batch_input(self, input, self._ndims, self._shape_doc)

    def _momentum_factor(self) -> float:
        """Count this training step and return its running-average factor (torch's rule)."""
        factor = 0.0 if self.momentum is None else self.momentum
        count = self.num_batches_tracked  # (read once: a buffer's lookup costs ~0.6 us)
        if self.training and self.track_running_stats and count is not None:
            count.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(count)
        return factor

    def _step_arguments(self) -> tuple[Tensor | None, Tensor | None, bool, float]:
        """``(running_mean, running_var, use_batch_stats, factor)`` for this forward.

        torch's ``_BatchNorm.forward`` rules: count the step, use batch statistics in
        training (or without running buffers), and hand the buffers over only when they
        are read (eval) or updated (training with ``track_running_stats``). Except in
        activation checkpointing's recomputation of this forward (:func:`recomputing`):
        no count, and the update goes to copies of the buffers that are dropped -- the
        first forward made it. (Copies, not ``None``: the recomputation must save the
        tensors the first forward saved, which non-reentrant checkpointing checks.)
        """
        running_mean, running_var = self.running_mean, self.running_var  # (read once)
        keep = not self.training or self.track_running_stats
        has_running = running_mean is not None or running_var is not None
        if self.training:
            forget_checked_statistics(self)
        else:
            check_running_statistics(self)
        skip = self.training and skip_recomputed_update(self, keep and has_running)
        factor = (0.0 if self.momentum is None else self.momentum) if skip else (
            self._momentum_factor())
        use_batch_stats = self.training or not has_running
        mean, var = (running_mean, running_var) if keep else (None, None)
        if skip:
            mean, var = (None if t is None else t.clone() for t in (mean, var))
        return mean, var, use_batch_stats, factor

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        self._check_input_dim(input)
        running_mean, running_var, use_batch_stats, factor = self._step_arguments()
        return F.batch_norm(
            input,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            use_batch_stats,
            factor,
            self.eps,
            unbiased_running_var=self.unbiased_running_var,
            backend=self.backend,
        )


class BatchNorm(_BatchNormForward, nn.modules.batchnorm._BatchNorm):
    _ndims = ()
    _shape_doc = "(N, C, *)"
    __doc__ = _DOC.replace(":class:`torch.nn.{name}`", "torch's ``_BatchNorm`` base").format(
        name="BatchNorm", what="any channels-first input (N, C, *) of rank >= 2",
        shape=":math:`(N, C, *)`", example="8, 3, 5")


class BatchNorm1d(_BatchNormForward, nn.BatchNorm1d):
    _ndims = (2, 3)
    _shape_doc = "(N, C) or (N, C, L)"
    __doc__ = _DOC.format(name="BatchNorm1d", what="a 2D or 3D input",
                          shape=":math:`(N, C)` or :math:`(N, C, L)`", example="8, 3")


class BatchNorm2d(_BatchNormForward, nn.BatchNorm2d):
    _ndims = (4,)
    _shape_doc = "(N, C, H, W)"
    __doc__ = _DOC.format(name="BatchNorm2d", what="a 4D input (images)",
                          shape=":math:`(N, C, H, W)`", example="8, 3, 5, 5")


class BatchNorm3d(_BatchNormForward, nn.BatchNorm3d):
    _ndims = (5,)
    _shape_doc = "(N, C, D, H, W)"
    __doc__ = _DOC.format(name="BatchNorm3d", what="a 5D input (volumes, video)",
                          shape=":math:`(N, C, D, H, W)`", example="4, 3, 2, 5, 5")


# --------------------------------------------------------------------------- frozen


class FrozenBatchNorm(NotScriptable, nn.Module):
    r"""BatchNorm with fixed statistics and affine parameters, all stored as buffers.

    .. math:: y = \frac{x - \mu_{running}}{\sqrt{\sigma^2_{running} + \epsilon}} \gamma + \beta

    The layer fine-tuning and detection models use (as in detectron2): nothing it holds
    is trained or updated, ``model.train()`` does not change it, and gradients still flow
    to its input. It loads the ``state_dict`` of any BatchNorm (``num_batches_tracked``
    is dropped). This class accepts any ``(N, C, *)`` input; the 1d/2d/3d subclasses also
    check the rank.

    Args:
        num_features: number of channels ``C``.
        eps: added to the running variance. Default: ``1e-5``.

    Shape:
        - Input: :math:`(N, C, *)`; output: same shape, dtype and memory format.

    Example:
        >>> import torch, normkit
        >>> frozen = normkit.FrozenBatchNorm2d.from_batchnorm(torch.nn.BatchNorm2d(4).eval())
        >>> frozen.train()(torch.zeros(2, 4, 3, 3)).abs().max().item()
        0.0
        >>> [name for name, _ in frozen.named_parameters()]
        []
    """

    _ndims: tuple[int, ...] = ()
    _shape_doc = "(N, C, *)"

    def __init__(self, num_features: int, eps: float = 1e-5, *, device=None, dtype=None):
        check_arguments(type(self).__name__, {"num_features": num_features, "eps": eps})
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        for name in ("weight", "bias", "running_mean", "running_var"):
            self.register_buffer(name, torch.empty(num_features, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Make the layer the identity again: ``weight`` 1, ``bias`` 0, running mean 0 and
        running variance 1, as the constructor sets them.

        Deferred initialization calls it (a model built on the ``meta`` device, then
        ``to_empty`` and ``reset_parameters`` on each module, as FSDP does): without it
        the buffers would keep whatever memory ``to_empty`` handed out.

        Example:
            >>> import torch, normkit
            >>> with torch.device("meta"):
            ...     frozen = normkit.FrozenBatchNorm2d(3)
            >>> frozen = frozen.to_empty(device="cpu")
            >>> frozen.reset_parameters()
            >>> frozen.running_var.tolist(), frozen.bias.tolist()
            ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
        """
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()
            self.running_mean.zero_()
            self.running_var.fill_(1.0)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "num_batches_tracked", None)
        for name, fill in (("weight", 1.0), ("bias", 0.0)):  # from an affine=False BN
            if prefix + name not in state_dict and prefix + "running_mean" in state_dict:
                state_dict[prefix + name] = torch.full_like(state_dict[prefix + "running_mean"],
                                                            fill)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        check_batch_input(self, input, self._ndims, self._shape_doc)
        check_running_statistics(self)
        # inference BatchNorm: torch's kernel where its check of these statistics passes
        # (a GPU: torch's kernel), normkit's scale_shift past it
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                            self.bias, training=False, eps=self.eps)

    @classmethod
    def from_batchnorm(cls, bn: nn.Module) -> FrozenBatchNorm:
        """A frozen copy of a BatchNorm-like layer (its eval-mode behaviour, fixed).

        Raises ValueError for a BatchNorm without running statistics: there is nothing
        to freeze (its eval mode normalizes with batch statistics).
        """
        if getattr(bn, "running_mean", None) is None or getattr(bn, "running_var", None) is None:
            raise ValueError(
                f"cannot freeze {type(bn).__name__}: expected running statistics "
                "(track_running_stats=True), got none"
            )
        ref = bn.running_mean
        frozen = cls(bn.num_features, bn.eps, device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            frozen.running_mean.copy_(bn.running_mean)
            frozen.running_var.copy_(bn.running_var)
            if getattr(bn, "weight", None) is not None:
                frozen.weight.copy_(bn.weight)
            if getattr(bn, "bias", None) is not None:
                frozen.bias.copy_(bn.bias)
        return frozen

    def to_batchnorm(self, cls: type[nn.Module] | None = None) -> nn.Module:
        """A trainable BatchNorm (normkit's of the matching rank, or ``cls``) with this
        layer's state.

        Example:
            >>> import normkit
            >>> bn = normkit.FrozenBatchNorm2d(4).to_batchnorm()
            >>> type(bn).__name__, bn.training, [name for name, _ in bn.named_parameters()]
            ('BatchNorm2d', True, ['weight', 'bias'])
        """
        if cls is None:
            cls = _UNFROZEN.get(type(self).__name__, BatchNorm)
        ref = self.running_mean
        bn = cls(self.num_features, eps=self.eps, device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            bn.weight.copy_(self.weight)
            bn.bias.copy_(self.bias)
            bn.running_mean.copy_(self.running_mean)
            bn.running_var.copy_(self.running_var)
        return bn


class FrozenBatchNorm1d(FrozenBatchNorm):
    """:class:`FrozenBatchNorm` for ``(N, C)`` or ``(N, C, L)`` input.

    Example:
        >>> import torch, normkit
        >>> normkit.FrozenBatchNorm1d(3)(torch.randn(4, 3)).shape
        torch.Size([4, 3])
    """

    _ndims = (2, 3)
    _shape_doc = "(N, C) or (N, C, L)"


class FrozenBatchNorm2d(FrozenBatchNorm):
    """:class:`FrozenBatchNorm` for ``(N, C, H, W)`` input.

    Example:
        >>> import torch, normkit
        >>> normkit.FrozenBatchNorm2d(3)(torch.randn(2, 3, 4, 4)).shape
        torch.Size([2, 3, 4, 4])
    """

    _ndims = (4,)
    _shape_doc = "(N, C, H, W)"


class FrozenBatchNorm3d(FrozenBatchNorm):
    """:class:`FrozenBatchNorm` for ``(N, C, D, H, W)`` input.

    Example:
        >>> import torch, normkit
        >>> normkit.FrozenBatchNorm3d(3)(torch.randn(2, 3, 2, 4, 4)).shape
        torch.Size([2, 3, 2, 4, 4])
    """

    _ndims = (5,)
    _shape_doc = "(N, C, D, H, W)"


_UNFROZEN = {"FrozenBatchNorm1d": BatchNorm1d, "FrozenBatchNorm2d": BatchNorm2d,
             "FrozenBatchNorm3d": BatchNorm3d}


# --------------------------------------------------------------------------- renorm


def renorm_limits(step: int, r_max: float = 3.0, d_max: float = 5.0,
                  warmup_steps: int = 5000, r_max_steps: int = 40000,
                  d_max_steps: int = 25000) -> tuple[float, float]:
    """Batch Renormalization's clipping limits ``(r_max, d_max)`` at a training step.

    The schedule of Ioffe (2017): ``r_max = 1`` and ``d_max = 0`` (plain BatchNorm) for
    the first ``warmup_steps``, then relaxed linearly to their final values, reached at
    ``r_max_steps`` and ``d_max_steps``.

    Example:
        >>> renorm_limits(0), renorm_limits(5000), renorm_limits(22500)
        ((1.0, 0.0), (1.0, 0.0), (2.0, 4.375))
        >>> renorm_limits(10**6)
        (3.0, 5.0)
    """
    def ramp(start: float, end: float, end_step: int) -> float:
        if step < warmup_steps:
            return start
        if step >= end_step:
            return end
        return start + (end - start) * (step - warmup_steps) / (end_step - warmup_steps)

    return ramp(1.0, float(r_max), r_max_steps), ramp(0.0, float(d_max), d_max_steps)


#: Fewest elements from which float32/float64 Batch Renormalization outside the slice-sums
#: engine (small input, 2D rows torch's kernel sums accurately) takes torch's statistics
#: kernel and one inference-kernel pass (:func:`normkit.kernels.native.batch_norm_by_moments`)
#: rather than its fused training kernel twice; 16-bit input takes it at any size (its
#: fused-kernel route had its own autograd node too). Two alternated runs of each
#: (``normkit bench batch_renorm --shapes 3x5x7x9,2x8x16x16,4x16x16x16,8x16x16x16,
#: 8x32x16x16,16x32x16x16 --threads 1,2 --repeats 7``, fused kernel twice -> these
#: kernels at every size), forward+backward: 0.36-0.44x -> 0.24-0.35x torch's BatchNorm
#: up to 16384 elements (the fixed cost of a Python autograd node and of updating the
#: running statistics outside the kernel), 0.42-0.47x -> 0.37-0.43x at 32768, 0.43-0.51x
#: -> 0.46-0.69x at 65536 and 131072; forward 0.37-0.45x -> 0.49-0.73x at 65536 and
#: 131072. bfloat16 (``--dtype bfloat16 --shapes 32x64x56x56,32x64x56x56:cl,32x256x14x14,
#: 32x256x14x14:cl``): forward 0.36-0.50x -> 0.62-0.89x, forward+backward 0.56-0.72x ->
#: 0.66-0.94x (RESULTS.md, "Batch Renormalization on 16-bit input").
RENORM_BY_MOMENTS_MIN_ELEMENTS = 1 << 16


_RENORM_DOC = r"""Batch Renormalization over {what} (Ioffe 2017).

    In training, the batch-normalized input is corrected towards the running statistics,

    .. math::
        \hat x = rac{{x - \mu_B}}{{\sigma_B}} r + d, \quad
        r = \mathrm{{clip}}_{{[1/r_{{max}}, r_{{max}}]}}\left(rac{{\sigma_B}}{{\sigma}}
ight),
        \quad d = \mathrm{{clip}}_{{[-d_{{max}}, d_{{max}}]}}\left(rac{{\mu_B - \mu}}{{\sigma}}
ight)

    with gradients stopped through ``r`` and ``d`` (``sigma = sqrt(running_var + eps)``),
    so training sees the same normalization as inference, and small or non-i.i.d.
    batches hurt less. Inference is plain BatchNorm with the running statistics. The
    limits follow :func:`normkit.renorm_limits` at step ``num_batches_tracked``
    (the paper's schedule by default). A subclass of :class:`torch.nn.{parent}`, so BN
    checkpoints load into it and back.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance. Default: ``1e-5``.
        momentum: running-average factor, or ``None`` (cumulative). Default: ``0.1``.
        affine: learnable ``weight`` and ``bias``. Default: ``True``.
        r_max, d_max: final clipping limits. Default: ``3.0``, ``5.0``.
        warmup_steps: steps of plain BatchNorm before relaxing. Default: ``5000``.
        r_max_steps, d_max_steps: steps at which the final limits are reached.
            Default: ``40000``, ``25000``.

    Shape:
        - Input: {shape}; output: same.

    Example:
        >>> import torch, normkit
        >>> brn = normkit.{name}(3, warmup_steps=0, r_max_steps=1, d_max_steps=1)
        >>> y = brn(torch.randn({example}))
        >>> brn.current_limits()
        (3.0, 5.0)
    """


#: torch.compile of torch 2.4 refuses ``int(num_batches_tracked)`` in a full graph
#: ("Unsupported: Tensor.item"): there a compiled graph takes the limits as tensors
#: (checked with aot_eager and Inductor). 2.8's refuses it too, but its Inductor made
#: wrong input gradients from the tensor limits, so from 2.5 the read stays: up to 2.10 it
#: breaks the graph (fullgraph=True fails loudly, a plain compile runs it eagerly); 2.11
#: and 2.13 read it.
_DYNAMO_CANNOT_READ_STEP = TORCH_RELEASE < (2, 5)


class _BatchRenormForward(_BatchNormForward):
    _STEP_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, *, r_max: float = 3.0, d_max: float = 5.0,
                 warmup_steps: int = 5000, r_max_steps: int = 40000,
                 d_max_steps: int = 25000, device=None, dtype=None, **kwargs) -> None:
        if r_max < 1.0 or d_max < 0.0:
            raise ValueError(f"{type(self).__name__} expected r_max >= 1 and d_max >= 0, got "
                             f"r_max={r_max}, d_max={d_max}")
        if not kwargs.pop("track_running_stats", True):
            raise ValueError(f"{type(self).__name__} needs running statistics (r and d "
                             f"compare each batch to them): expected "
                             f"track_running_stats=True, got False")
        super().__init__(num_features, eps, momentum, affine, True, device=device,
                         dtype=dtype, **kwargs)
        self.r_max, self.d_max = float(r_max), float(d_max)
        self.warmup_steps, self.r_max_steps, self.d_max_steps = (
            int(warmup_steps), int(r_max_steps), int(d_max_steps))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, r_max={self.r_max}, d_max={self.d_max}, "
                f"warmup_steps={self.warmup_steps}, r_max_steps={self.r_max_steps}, "
                f"d_max_steps={self.d_max_steps}")

    def current_limits(self) -> tuple[float, float]:
        """``(r_max, d_max)`` for the next training step."""
        if self.num_batches_tracked is None or self.running_mean is None:
            # (e.g. torch.func.replace_all_batch_norm_modules_, which sets them to None)
            raise RuntimeError(
                f"{type(self).__name__} needs its running statistics and step count (r "
                f"and d compare each batch to them), but they were removed (None); "
                f"expected the buffers running_mean, running_var and num_batches_tracked "
                f"-- under torch.func use BatchNorm instead, or keep the module out of "
                f"replace_all_batch_norm_modules_")
        if without_data(self.num_batches_tracked):
            # shape inference (meta device, FakeTensorMode): no step to read; the limits
            # past the warm-up (the warm-up's path makes the same shapes)
            return self.r_max, self.d_max
        try:
            step = self._step_count()
        except RuntimeError as error:
            if not compiling():
                raise
            # (vmap over an ensemble's stacked buffers: one step count per member)
            raise RuntimeError(
                f"{type(self).__name__} reads its step count to set the clipping limits, "
                f"which a torch.func transform refuses (expected one unbatched "
                f"num_batches_tracked, got a batched one: an ensemble's stacked buffers?); "
                f"run the members one at a time, or use BatchNorm under vmap") from error
        return renorm_limits(step, self.r_max, self.d_max,
                             self.warmup_steps, self.r_max_steps, self.d_max_steps)

    def _step_count(self) -> int:
        """``int(num_batches_tracked)`` without reading an accelerator's buffer back at
        every step: that read is a device sync, which stalls the GPU's queue of work once
        per training step. There the count this module last read or wrote is kept with
        the buffer object and its version counter, and holds while both are unchanged:
        every other write (``load_state_dict``, ``reset_running_stats``, a user's
        ``fill_``) bumps the version, a move to another device makes another buffer, a
        copy or a pickle of the module leaves the count behind (:meth:`__getstate__`), and
        then the buffer is read again, once. A write through ``.data``, which moves no
        version counter, is not seen (known limit). CPU buffers are read every time (no
        sync to save), as under torch.compile (the graph's business)."""
        count = self.num_batches_tracked
        if compiling() or not F._off_cpu(count):
            return int(count)
        seen = self.__dict__.get("_step_seen")
        if seen is not None and seen[0] is count and seen[1] == count._version:
            return seen[2]
        step = int(count)
        self.__dict__["_step_seen"] = (count, count._version, step)
        return step

    def _momentum_factor(self) -> float:
        """BatchNorm's count and factor; the count kept on the host follows this step's
        ``add_(1)`` (:meth:`_step_count`)."""
        count, seen = self.num_batches_tracked, self.__dict__.get("_step_seen")
        known = (seen is not None and count is not None and seen[0] is count
                 and not compiling() and seen[1] == count._version)
        factor = super()._momentum_factor()
        if known and count._version == seen[1] + 1:  # (its add_(1), and no other write)
            self.__dict__["_step_seen"] = (count, count._version, seen[2] + 1)
        return factor

    def __getstate__(self) -> dict:
        """The module's state for pickling and ``copy.deepcopy``, without the step count
        kept on the host (:meth:`_step_count`): a copy reads its own buffer first."""
        state = dict(super().__getstate__())
        state.pop("_step_seen", None)
        return state

    def _limit_tensors(self) -> tuple[Tensor, Tensor]:
        """:meth:`current_limits` as float64 tensors computed from
        ``num_batches_tracked`` (the same arithmetic as :func:`renorm_limits`), for a
        graph that cannot read the step count: torch.export's. A step count past both
        ramps gives the final limits, one in the warm-up exactly 1 and 0."""
        if self.num_batches_tracked is None or self.running_mean is None:
            self.current_limits()  # (raises, saying why)
        step = self.num_batches_tracked.to(torch.float64)
        warmup = self.warmup_steps

        def ramp(start: float, end: float, end_step: int) -> Tensor:
            value = torch.full_like(step, end)
            if end_step > warmup:
                value = torch.where(step >= end_step, value,
                                    start + (end - start) * (step - warmup) / (end_step - warmup))
            return torch.where(step < warmup, torch.full_like(step, start), value)

        return ramp(1.0, self.r_max, self.r_max_steps), ramp(0.0, self.d_max, self.d_max_steps)

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input)
        if not self.training:
            return super().forward(input)
        forget_checked_statistics(self)
        if self.running_mean is not None and self.num_batches_tracked is not None:
            if recomputing():
                return self._recomputed(input)
            # (what r, d and the limits read, for checkpointing's recomputation)
            keep_for_recomputation(self, self._STEP_BUFFERS)
        return self._training_forward(input)

    def _recomputed(self, input: Tensor) -> Tensor:
        """Activation checkpointing's recomputation of this forward in backward: the same
        output as the first forward, so the same r, d and limits, from the running
        statistics and step count it read (kept by it) -- and no update: the statistics
        go to copies that are dropped."""
        with restored_for_recomputation(self, self._STEP_BUFFERS):
            return self._training_forward(input)

    def _training_forward(self, input: Tensor) -> Tensor:
        if (_exporting() or (_DYNAMO_CANNOT_READ_STEP and torch.compiler.is_compiling())) and (
                self.num_batches_tracked is not None):
            # torch.export (and torch 2.4's torch.compile) cannot read the step count: the
            # limits as tensors and the renormalizing math at every step (in the warm-up
            # r = 1 and d = 0 exactly: BatchNorm's output, running statistics alike)
            r_max, d_max = self._limit_tensors()
        else:
            r_max, d_max = self.current_limits()
            if r_max == 1.0 and d_max == 0.0:
                # the warm-up (or limits fixed at 1 and 0): r = 1 and d = 0 exactly, which
                # is BatchNorm, statistics and running updates alike, so BatchNorm's
                # paths serve
                return super().forward(input)
        self._check_input_dim(input)
        factor = self._momentum_factor()
        dims = (0, *range(2, input.dim()))
        count = _stats.reduced_count(input.shape, dims)
        if count <= 1:  # empty batch or one value per channel: BatchNorm's answer
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, factor, self.eps, backend=self.backend)
        y = self._renormalized_fast(input, dims, count, r_max, d_max, factor)
        if y is not None:
            return y
        xhat, mean, var, mean_lo = self._normalized(input, dims)
        mean, var = mean.detach().view(-1), var.detach().view(-1)
        scale, shift = self._corrected_affine(mean, torch.rsqrt(var + self.eps), mean_lo,
                                              r_max, d_max)
        self._update_running(mean, var, count, factor)
        view = F._channel_view(input)
        return torch.addcmul(shift.view(view), xhat, scale.view(view)).to(input.dtype)

    def _corrected_affine(self, mean: Tensor, rstd: Tensor, mean_lo: Tensor | None,
                          r_max: float | Tensor, d_max: float | Tensor
                          ) -> tuple[Tensor, Tensor]:
        """``(weight * r, weight * d + bias)`` per channel from the batch's detached
        ``(C,)`` mean and ``1 / sqrt(var + eps)`` (``mean_lo``: the part of the mean its
        rounding dropped, or None), differentiable in ``weight`` and ``bias`` only (r and
        d are constants for autograd: the paper's stop-gradient). The renormalized
        output is BatchNorm of the batch with this affine. Few, small ops: at small
        inputs each costs about as much as the normalization."""
        running_mean = read_before_update(self.running_mean)  # (updated after)
        running_var = read_before_update(self.running_var)
        if isinstance(r_max, Tensor):  # (torch.export: the limits as tensors)
            r_max, d_max = r_max.to(mean.dtype), d_max.to(mean.dtype)
        inv_sigma = torch.add(running_var.to(mean.dtype), self.eps).rsqrt_()
        r = torch.div(inv_sigma, rstd).clamp_(1.0 / r_max, r_max)
        if mean_lo is None:
            # well-conditioned statistics (|mean| <= a few std): the float mean is exact
            # enough, and mean - running_mean rounds once
            d = torch.sub(mean, running_mean.to(mean.dtype)).mul_(inv_sigma)
        else:
            # data far from zero: (mean - running_mean) in float64 with the batch mean's
            # low part (a float32 mean at 1e4 is off by up to 5e-4)
            d = (mean.double() - running_mean.double() + mean_lo.double().view(-1)
                 ).mul_(inv_sigma.double()).to(mean.dtype)
        d = d.clamp(-d_max, d_max)  # (not in place: torch 2.4's export refuses it here)
        w, b = self.weight, self.bias
        if w is None:
            return r, d if b is None else b + d
        return w * r, w * d if b is None else torch.addcmul(b, w, d)

    def _update_running(self, mean: Tensor, var: Tensor, count: int, factor: float) -> None:
        """The running statistics' update from the batch's ``(C,)`` mean and biased
        variance (BatchNorm's rule)."""
        batch_var = _stats.unbiased_var(var, count) if self.unbiased_running_var else var
        _stats.update_running_(self.running_mean, mean, factor)
        _stats.update_running_(self.running_var, batch_var, factor)

    def _renormalized_fast(self, x: Tensor, dims: tuple[int, ...], count: int, r_max: float,
                           d_max: float, factor: float) -> Tensor | None:
        """The renormalized output as BatchNorm with the corrected affine, statistics
        first (from the slice-sums engine, or torch's kernel where it is accurate; on an
        accelerator torch's kernels, unchecked), then one normalizing pass whose backward
        is BatchNorm's: no ``xhat`` tensor and no broadcast affine node. ``None`` where
        neither serves (``backend="auto"`` only; ill-conditioned data on the CPU and
        fewer than four values per channel take the compensated path)."""
        if self.backend != "auto" or compiling():
            return None
        weight, bias = self.weight, self.bias
        if F._off_cpu(x):
            # an accelerator: torch's statistics and normalizing kernels, unchecked (as
            # BatchNorm's there: a check reads a statistic back, a device sync per step);
            # few values per channel take the reference's float64 statistics, and shape
            # inference (meta or fake tensors) the compensated path's shapes
            if (without_data(x) or count < _stats.FEW_VALUES
                    or not native.kernel_dtypes(x, weight, bias)):
                return None
            mean, var, invstd = native.batch_norm_moments(x, self.eps, checked=False)
            scale, shift = self._corrected_affine(mean, invstd, None, r_max, d_max)
            self._update_running(mean, var, count, factor)
            return native.batch_norm_by_moments(x, scale, shift, mean, var, invstd, self.eps)
        # (the engine's one affine pass also on channels-last input with few values per
        # channel, where BatchNorm keeps torch's kernel: cheaper than a second run of it;
        # and on 2D rows past torch's accurate count, through their channels-last view)
        rows = x.dim() == 2 and channels.serves_batch_norm(x)
        engine_input = channels.rows_as_channels_last(x) if rows else x
        if channels.supports(engine_input, weight, bias):
            pool = channels.Pool("batch")
            if channels.serves_batch_norm(engine_input):
                stats = channels.moments(engine_input.detach(), pool, self.eps)
            else:  # channels-last, few values per channel: torch's statistics kernel
                stats = native.batch_norm_moments(x, self.eps)
            if stats is None:
                return None
            mean, var, rstd = (s.view(-1) for s in stats)
            scale, shift = self._corrected_affine(mean, rstd, None, r_max, d_max)
            self._update_running(mean, var, count, factor)
            y = channels.normalize_by(engine_input, scale, shift, mean.view(1, -1),
                                      rstd.view(1, -1), pool,
                                      F._reference((0, *range(2, engine_input.dim())),
                                                   F._channel_view(engine_input), self.eps))
            return channels.channels_last_as_rows(y) if rows else y
        if not native.kernel_dtypes(x, weight, bias):
            return None
        if (x.dtype in (torch.float16, torch.bfloat16)
                or x.numel() >= RENORM_BY_MOMENTS_MIN_ELEMENTS):
            # torch's statistics kernel (one read; float32 statistics for 16-bit input),
            # then one pass of its inference kernel with the corrected affine, the
            # gradients from BatchNorm's backward kernel
            stats = native.batch_norm_moments(x, self.eps)
            if stats is None:
                return None
            mean, var, invstd = stats
            scale, shift = self._corrected_affine(mean, invstd, None, r_max, d_max)
            self._update_running(mean, var, count, factor)
            return native.batch_norm_by_moments(x, scale, shift, mean, var, invstd, self.eps)
        # small float32/float64 input: torch's fused kernel twice (its autograd node and
        # its running-statistics update cost less than the above's there)
        stats = native.batch_norm_stats(x, self.eps, weight, bias)
        if stats is None:
            return None
        mean, invstd = stats
        scale, shift = self._corrected_affine(mean, invstd, None, r_max, d_max)
        running = (self.running_mean, self.running_var)
        # (torch's kernel updates the running statistics when it takes their dtype)
        if not (self.unbiased_running_var and native.kernel_dtypes(x, scale, shift, *running)):
            self._update_running(mean, invstd.double().pow(-2).sub_(self.eps).clamp_(min=0)
                                 .to(mean.dtype), count, factor)
            running = (None, None)
        # the same kernel on the same input: the statistics r and d came from, again
        # (and it updates the running statistics, torch's way, after r and d read them)
        return native.batch_norm_kernel(x, scale, shift, *running, factor, self.eps)[0]

    def _normalized(self, x: Tensor, dims: tuple[int, ...]
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(xhat, mean, var, mean_lo)`` of the batch by normkit's compensated core
        (``backend="eager"``/``"reference"``, accelerators, ill-conditioned data), with
        ``mean_lo`` the part of the batch mean its rounding to ``mean`` dropped. 16-bit
        input is normalized in float32: ``xhat`` rounded to 16 bits before the corrected
        affine would cost that rounding times the affine's scale where ``d`` cancels
        most of the output (``tests/test_numerics.py``,
        ``test_batch_renorm_16bit_robust_path_rounds_only_its_output``)."""
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()  # (differentiable: the gradient reaches the 16-bit input)
        xhat, mean, var = normalize(x, dims, None, None, self.eps, backend=self.backend)
        with torch.no_grad():  # x - mean is exact near the mean: the residual's average
            mean_lo = (_stats.upcast(x.detach()) - mean).mean(dims, keepdim=True)
        return xhat, mean, var, mean_lo


class BatchRenorm1d(_BatchRenormForward, nn.BatchNorm1d):
    _ndims = (2, 3)
    _shape_doc = "(N, C) or (N, C, L)"
    __doc__ = _RENORM_DOC.format(name="BatchRenorm1d", parent="BatchNorm1d",
                                 what="a 2D or 3D input", example="8, 3",
                                 shape=":math:`(N, C)` or :math:`(N, C, L)`")


class BatchRenorm2d(_BatchRenormForward, nn.BatchNorm2d):
    _ndims = (4,)
    _shape_doc = "(N, C, H, W)"
    __doc__ = _RENORM_DOC.format(name="BatchRenorm2d", parent="BatchNorm2d",
                                 what="a 4D input", example="8, 3, 4, 4",
                                 shape=":math:`(N, C, H, W)`")


class BatchRenorm3d(_BatchRenormForward, nn.BatchNorm3d):
    _ndims = (5,)
    _shape_doc = "(N, C, D, H, W)"
    __doc__ = _RENORM_DOC.format(name="BatchRenorm3d", parent="BatchNorm3d",
                                 what="a 5D input", example="4, 3, 2, 4, 4",
                                 shape=":math:`(N, C, D, H, W)`")

