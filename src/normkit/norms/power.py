r"""Power Normalization (Shen, Yao, Gholami, Mahoney & Keutzer, ICML 2020).

《深度学习归一化技术：BN与LN原理及应用对比》 §6 lists PowerNorm among the frontier.
Shen et al. find BatchNorm doing poorly in NLP Transformers: the batch statistics of
token features swing from batch to batch, and so do their gradients (normkit lab's
``transformer`` experiment, on digit rows, does not see it). PowerNorm keeps
BatchNorm's per-channel, batch-wide statistic but

* drops the mean (a quadratic mean, :math:`\psi^2 = \mathrm{E}[x^2]`, as RMSNorm does),
* normalizes by the *running* quadratic mean in training (after a warm-up that uses the
  batch's), so the forward no longer follows each batch, and
* replaces the gradient through the statistic by an approximation driven by a running
  average (the paper's :math:`\nu`), so the backward does not either.

What :class:`PowerNorm` computes follows the authors' code (``MaskPowerNorm`` in
github.com/sIncerass/powernorm, the code behind the paper's results), which differs from
the paper's Algorithm 1 in three places, all kept here (see the class docstring): a
per-token group scaling before the layer, a warm-up with batch statistics, and a
backward divided by the batch's quadratic mean.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.fx import Proxy

from .. import _stats
from .. import functional as F
from ..kernels import channels
from ..kernels.memory import out_like
from . import _nested
from ._base import NotScriptable, fx_leaf
from ._core import (
    check_floating,
    check_running_statistics,
    compiling,
    forget_checked_statistics,
    keep_for_recomputation,
    may_be_recomputed,
    read_before_update,
    recomputing,
    restored_for_recomputation,
    shape_str,
    transformed,
)

__all__ = ["PowerNorm", "padding_mask", "column_dot"]

#: The group scaling's epsilon: fixed, as in the authors' ``GroupScaling1D``.
GROUP_SCALING_EPS = 1e-5

#: The mask of :func:`padding_mask`, per thread (a ``threading.local``, which
#: torch.compile traces; it cannot trace a ``contextvars.ContextVar``).
_CONTEXT = threading.local()


@contextlib.contextmanager
def padding_mask(mask: Tensor | None) -> Iterator[Tensor | None]:
    """Inside, every :class:`PowerNorm` called without ``padding_mask=`` takes ``mask``
    (bool, ``True`` at padding): for models that call their norms as ``norm(x)``
    (``torch.nn.TransformerEncoderLayer``, Hugging Face models after
    ``normkit.convert_norms(model, "pn")``), whose padding would otherwise enter the
    statistics. A Hugging Face ``attention_mask`` (1 at tokens, 0 at padding) is
    ``attention_mask == 0``. Every PowerNorm called inside in training must see inputs
    whose shape without the last dim is the mask's (a ValueError names the layer's input
    shape otherwise; in eval the mask plays no part); an explicit ``padding_mask=``
    argument wins. Nests (``None`` turns it off inside); per thread; works under
    torch.compile and under activation checkpointing, whose recomputation in the
    backward (outside the block) takes the mask the first forward took.

    Example:
        >>> import torch, normkit
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        >>> layer = normkit.convert_norms(layer, "pn", warmup_iters=100)
        >>> x = torch.randn(3, 5, 8)
        >>> pad = torch.zeros(3, 5, dtype=torch.bool)
        >>> pad[0, 2:] = True
        >>> with normkit.padding_mask(pad):
        ...     y = layer(x, src_key_padding_mask=pad)  # attention and norms skip the pads
        >>> y.shape
        torch.Size([3, 5, 8])
    """
    if mask is not None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool
                             or mask.dim() == 0):
        got = (f"dtype {mask.dtype}, shape {shape_str(mask)}" if isinstance(mask, Tensor)
               else type(mask).__name__)
        raise TypeError(f"normkit.padding_mask expected a bool tensor of the tokens' shape "
                        f"(True at padding; a Hugging Face attention_mask is "
                        f"attention_mask == 0) or None, got {got}")
    previous = getattr(_CONTEXT, "mask", None)
    _CONTEXT.mask = mask
    try:
        yield mask
    finally:
        _CONTEXT.mask = previous


def column_dot(a: Tensor, b: Tensor, keep: Tensor | None = None, *,
               total: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``(a * b)[kept rows].sum(0)`` of ``(N, C)`` tensors (``keep``: ``(N, 1)`` of 0 and 1,
    or ``None``: every row), block by block of rows into one reused cache-sized buffer
    (:data:`normkit.kernels.channels.COLUMN_BLOCK_BYTES`, as the slice-sums engine's
    blocked sums), without the ``(N, C)`` product that ``(x * x).sum(0)`` writes (and
    page-faults) through memory: ``benchmarks/power_norm_sums.py``. ``total=True`` returns the pair
    ``(weighted, (a * b).sum(0))`` from the same pass (each block's product summed
    plainly and through ``keep``'s row vector). Under compilation (the compiler fuses
    them) and off the CPU (one kernel each, on a caching allocator), the plain
    expressions. Rows left out are left out, not weighted by 0: a NaN or inf there
    (padding, or the rows between ``torch.nested.narrow``'s sequences) stays out.

    Example:
        >>> x = torch.arange(6.0).view(3, 2)
        >>> column_dot(x, x), column_dot(x, x, torch.tensor([[1.0], [0.0], [1.0]]))
        (tensor([20., 35.]), tensor([16., 26.]))
    """
    if compiling() or a.device.type != "cpu":
        product = a * b
        plain = product.sum(0)
        weighted = plain if keep is None else torch.where(keep > 0, product, 0).sum(0)
        return (weighted, plain) if total else weighted
    n, c = a.shape
    dtype = torch.promote_types(a.dtype, b.dtype)
    # (the slice-sums engine's block: a block and its product stay in a core's L2)
    rows = max(1, channels.COLUMN_BLOCK_BYTES // max(c * dtype.itemsize, 1))
    plain = torch.zeros(c, dtype=dtype, device=a.device)
    weighted = plain if keep is None else torch.zeros(c, dtype=dtype, device=a.device)
    buffer = torch.empty(min(rows, n), c, dtype=dtype, device=a.device)
    for start in range(0, n, rows):
        block = a[start:start + rows]
        part = torch.mul(block, b[start:start + rows], out=buffer[:block.shape[0]])
        if keep is None or total:
            plain.add_(part.sum(0))
        if keep is not None:
            weighted.addmv_(part.t(), keep[start:start + rows, 0].to(dtype))
    if keep is not None and not bool(torch.isfinite(weighted).all()):
        # a NaN or inf times a weight of 0 is NaN: the sums again with the rows left out
        # zeroed (a masking pass per block: 2-5x the matrix-vector product's time in a
        # scratch timing at 4096 x 768-8192, hence only where needed)
        weighted.zero_()
        for start in range(0, n, rows):
            block = a[start:start + rows]
            part = torch.mul(block, b[start:start + rows], out=buffer[:block.shape[0]])
            weighted.add_(part.masked_fill_(keep[start:start + rows] == 0, 0).sum(0))
    return (weighted, plain) if total else weighted


class _PowerFunction(torch.autograd.Function):
    r"""``y = z * weight + bias``, ``z = x * inv_fwd``, with PowerNorm's approximate
    backward (the authors' ``PowerFunction``):

    .. math::
        g = \frac{\partial L}{\partial y}\gamma,\quad
        \tilde g = g - (1 - \alpha_{bkw})\, u\, z,\quad
        u \mathrel{+}= \mathrm{mean}(\tilde g z),\quad
        \frac{\partial L}{\partial x} = \tilde g \cdot \mathrm{inv\_bwd}

    with ``u`` the buffer ``ema_gz`` (the paper's :math:`\nu = (1 - \alpha_{bkw}) u`),
    updated in place by the backward, its mean over the counted (unpadded) tokens.
    ``weight`` and ``bias`` get their exact gradients. Not differentiable twice: the
    backward is an approximation by design, not a derivative.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, inv_fwd, inv_bwd, ema_gz, alpha_bkw, keep, count,
                squares):
        # x: (*, C), the scaled input; keep: (N, 1) or None for its N rows; squares: the
        # sum of x**2 over the counted rows
        xs = x.reshape(-1, x.shape[-1])  # (N, C)
        scale = inv_fwd if weight is None else inv_fwd * weight.to(xs.dtype)
        # (the output allocated in the input's shape and written through its (N, C) view:
        # a layer's output that is a view makes FSDP2 warn that an in-place op on it would
        # skip its hooks)
        out = out_like(x, memory_format=torch.contiguous_format)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        rows = out.view(xs.shape)
        with torch.no_grad():  # (what eager mode runs a forward under; torch 2.4's Dynamo
            if bias is None:   # traces it with grad on, where out= refuses the parameters)
                torch.mul(xs, scale, out=rows)
            else:
                torch.addcmul(bias.to(xs.dtype), xs, scale, out=rows)
        ctx.save_for_backward(xs, weight, inv_fwd, inv_bwd, keep, count, squares)
        ctx.shape = x.shape
        ctx.ema_gz, ctx.alpha_bkw, ctx.has_bias = ema_gz, alpha_bkw, bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        # With z = xs * inv_fwd and v = (1 - alpha_bkw) * u:
        #   dx = (g w - v z) inv_bwd           = g (w inv_bwd) - xs (v inv_fwd inv_bwd)
        #   u += mean_kept((g w - v z) z)      = (w inv_fwd sum_kept(g xs)
        #                                         - v inv_fwd^2 sum_kept(xs^2)) / count
        #   dweight = sum(g z)                 = inv_fwd sum(g xs)
        # so one blocked pass gives every per-channel sum, and dx takes two passes
        xs, weight, inv_fwd, inv_bwd, keep, count, squares = ctx.saved_tensors
        g = dy.reshape(xs.shape).to(xs.dtype)
        w = None if weight is None else weight.to(xs.dtype)
        v = (1.0 - ctx.alpha_bkw) * ctx.ema_gz.to(xs.dtype)
        kept_gx, all_gx = column_dot(g, xs, keep, total=True)
        # (kept_gx may be all_gx itself: per-channel vectors, out of place)
        term = kept_gx * inv_fwd if w is None else kept_gx * (inv_fwd * w)
        step = (term - v * inv_fwd.square() * squares) / count.clamp(min=1)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.mul(g, inv_bwd if w is None else w * inv_bwd,
                           out=out_like(xs, memory_format=torch.contiguous_format))
            dx = dx.addcmul_(xs, -(v * inv_fwd * inv_bwd)).view(ctx.shape)
        ctx.ema_gz.add_(step.to(ctx.ema_gz.dtype))
        dw = db = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = (all_gx * inv_fwd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0).to(ctx.ema_gz.dtype if weight is None else weight.dtype)
        return dx, dw, db, None, None, None, None, None, None, None


class PowerNorm(NotScriptable, nn.Module):
    r"""Power Normalization over the last dim (Shen et al. 2020), BatchNorm for Transformers.

    A drop-in for ``nn.LayerNorm(C)`` in a Transformer whose statistics are BatchNorm's:
    per channel, over every token of the batch (all dims but the last). With
    :math:`\tilde x` the input after the group scaling (below):

    .. math::
        y = \frac{\tilde x}{\sqrt{\psi^2 + \epsilon}} \gamma + \beta,
        \qquad \psi^2_B = \mathrm{E}_{\text{tokens}}[\tilde x^2]

    In training, for the first ``warmup_iters`` steps :math:`\psi^2` is the batch's
    :math:`\psi^2_B`; after them it is ``running_phi`` as it stood before this step.
    ``running_phi`` is updated every training step: during the warm-up it is first made
    the cumulative average of the batches so far, then, at every step, the running
    average ``alpha_fwd * running_phi + (1 - alpha_fwd) * psi2_B``. In eval
    ``running_phi`` serves. The backward replaces the gradient through
    :math:`\psi^2_B` by PowerNorm's approximation (the paper's Algorithm 1: the term
    :math:`\nu \odot \hat x` with :math:`\nu` a running average kept in the buffer
    ``ema_gz``, updated by every backward), divided by :math:`\sqrt{\psi^2_B +
    \epsilon}`; ``weight`` and ``bias`` get their exact gradients.

    **Group scaling.** Before all of this each token is divided by its root mean square
    over each of ``group_num`` contiguous blocks of channels (``eps`` ``1e-5``, an
    ordinary differentiable operation): the authors' ``GroupScaling1D``, which their
    ``MaskPowerNorm`` always applies (their fairseq models pass the number of attention
    heads). ``group_num=None`` leaves it out: the paper's Algorithm 1.

    **As the authors' code, not Algorithm 1.** Besides the group scaling, the
    authors' ``MaskPowerNorm`` (the code behind the paper's results), which this layer
    reproduces (checked against it: float64 outputs, gradients and buffers over steps
    across the warm-up agree to 3e-14), uses the batch statistic during the warm-up
    and divides the backward by the *batch's* :math:`\sqrt{\psi^2_B + \epsilon}`, where
    Algorithm 1 uses :math:`\psi_{t-1}` in both passes. One difference from that code:
    with a ``padding_mask`` it averages the backward's running term over the padding
    positions too; this layer over the tokens the statistic counts (without a mask
    both are the same).

    **Padding.** ``padding_mask`` (bool, the input's shape without the last dim,
    ``True`` at padding: torch's ``key_padding_mask`` convention, so ``(B, T)`` for a
    batch-first ``(B, T, C)`` input) keeps padding tokens out of the statistics; they
    are still normalized (by the same :math:`\psi^2`). A batch with no token counted
    normalizes by ``running_phi`` and leaves it as it is. For a model that calls its
    norms as ``norm(x)``, :func:`normkit.padding_mask` gives every PowerNorm inside a
    ``with`` block the mask.

    **Precision.** Statistics and the arithmetic in float32 (float64 for float64
    input); the output in the input's dtype. No step reads a value back to the host
    (the warm-up test is a tensor operation), so a CUDA step does not synchronize.

    **Checkpointing.** Under activation checkpointing (``torch.utils.checkpoint``,
    reentrant or not) the recomputation normalizes as the first forward did (by the
    ``running_phi`` and step count that forward read) and updates nothing; the
    backward updates ``ema_gz`` once. Statistics are this process's (no
    synchronization across data-parallel processes, as the authors' code).

    Args:
        num_features: ``C``, the size of the last dim.
        eps: added to :math:`\psi^2`. Default: ``1e-5``.
        alpha_fwd: the fraction of ``running_phi`` kept at each step (torch's BatchNorm
            ``momentum`` is ``1 - alpha_fwd``). Default: ``0.9``.
        alpha_bkw: the backward's running average factor :math:`\alpha_{bkw}`.
            Default: ``0.9``.
        affine: learnable ``weight`` (ones) and ``bias`` (zeros). Default: ``True``.
        warmup_iters: training steps that normalize by the batch statistic. The
            authors' default ``10000``; their fairseq models pass their warm-up updates
            (e.g. ``4000``).
        group_num: blocks of the group scaling (``C`` must divide by it), or ``None``
            for none. Default: ``1`` (the authors' default).
        device, dtype: factory arguments of the parameters and buffers (the buffers are
            float32 unless ``dtype`` says otherwise).

    Buffers: ``running_phi`` :math:`(C,)` (ones), ``ema_gz`` :math:`(C,)` (zeros),
    ``num_batches_tracked`` (the training steps so far; the authors' ``iters``). A
    state dict of the authors' ``MaskPowerNorm`` (``iters``, buffers of shape
    ``(1, C, 1, 1)``) loads as is.

    Shape:
        - Input: :math:`(*, C)`; ``padding_mask``: :math:`(*)` (bool) or ``None``.
        - Output: same shape and dtype as the input.

    Example:
        >>> import torch
        >>> from normkit import PowerNorm
        >>> pn = PowerNorm(8, warmup_iters=2)
        >>> x = (torch.randn(4, 5, 8) * 3).requires_grad_()  # (B, T, C)
        >>> pad = torch.zeros(4, 5, dtype=torch.bool)
        >>> pad[0, 3:] = True  # the first sequence has 3 tokens
        >>> y = pn(x, padding_mask=pad)  # warm-up: the batch's quadratic mean
        >>> kept = y[~pad]
        >>> bool(((kept * kept).mean(0) - 1).abs().max() < 1e-3)
        True
        >>> (y * y).sum().backward()  # updates ema_gz
        >>> int(pn.num_batches_tracked), bool(pn.ema_gz.abs().sum() > 0)
        (1, True)
    """

    #: ``(count, per-channel sums of squares)`` of every training batch goes here when
    #: set (:func:`normkit.update_bn_stats` sets it for its passes)
    _observer = None

    def __init__(self, num_features: int, eps: float = 1e-5, alpha_fwd: float = 0.9,
                 alpha_bkw: float = 0.9, affine: bool = True, warmup_iters: int = 10000,
                 group_num: int | None = 1, device=None, dtype=None) -> None:
        super().__init__()
        if (isinstance(num_features, bool) or not isinstance(num_features, numbers.Integral)
                or num_features <= 0):
            raise ValueError(f"PowerNorm expected a positive int num_features, got "
                             f"{num_features!r}")
        for name, value in (("alpha_fwd", alpha_fwd), ("alpha_bkw", alpha_bkw)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                    0.0 <= value <= 1.0):
                raise ValueError(f"PowerNorm expected {name} in [0, 1] (the fraction of the "
                                 f"running average kept at each step), got {value!r}")
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (
                0 < eps < float("inf")):
            raise ValueError(f"PowerNorm expected a finite eps > 0 (a channel whose tokens "
                             f"are all 0 would divide 0 by 0), got {eps!r}")
        if (isinstance(warmup_iters, bool) or not isinstance(warmup_iters, numbers.Integral)
                or warmup_iters < 0):
            raise ValueError(f"PowerNorm expected warmup_iters to be an int >= 0, got "
                             f"{warmup_iters!r}")
        if group_num is not None and (
                isinstance(group_num, bool) or not isinstance(group_num, numbers.Integral)
                or group_num <= 0 or num_features % group_num):
            raise ValueError(f"PowerNorm expected group_num to be None or a positive int "
                             f"that divides num_features={num_features}, got {group_num!r}")
        self.num_features = int(num_features)
        self.eps = float(eps)
        self.alpha_fwd, self.alpha_bkw = float(alpha_fwd), float(alpha_bkw)
        self.affine = bool(affine)
        self.warmup_iters = int(warmup_iters)
        self.group_num = None if group_num is None else int(group_num)
        factory = {"device": device, "dtype": dtype}
        if self.affine:
            self.weight = nn.Parameter(torch.empty(self.num_features, **factory))
            self.bias = nn.Parameter(torch.empty(self.num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        buffers = {"device": device, "dtype": dtype or torch.float32}
        self.register_buffer("running_phi", torch.ones(self.num_features, **buffers))
        self.register_buffer("ema_gz", torch.zeros(self.num_features, **buffers))
        self.register_buffer("num_batches_tracked",
                             torch.tensor(0, dtype=torch.long, device=device))
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        """``running_phi`` to ones, ``ema_gz`` to zeros, the step count to 0 (the
        warm-up starts again)."""
        self.running_phi.fill_(1.0)
        self.ema_gz.zero_()
        self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """Reset the running statistics; ``weight`` to ones, ``bias`` to zeros."""
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, "
                f"alpha_bkw={self.alpha_bkw}, affine={self.affine}, "
                f"warmup_iters={self.warmup_iters}, group_num={self.group_num}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the authors' MaskPowerNorm: the step count is `iters` (shape (1,)), the
        # buffers have shape (1, C, 1, 1)
        iters, steps = prefix + "iters", prefix + "num_batches_tracked"
        if iters in state_dict and steps not in state_dict:
            state_dict[steps] = state_dict.pop(iters).reshape(())
        for name in ("running_phi", "ema_gz"):
            value = state_dict.get(prefix + name)
            if (isinstance(value, Tensor) and value.dim() == 4
                    and value.numel() == self.num_features):
                state_dict[prefix + name] = value.reshape(self.num_features)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _padding_of_this_call(self, padding_mask: Tensor | None
                              ) -> tuple[Tensor | None, bool]:
        """``(mask, whether it came from normkit.padding_mask)``. Activation
        checkpointing recomputes a forward in the backward, usually outside the ``with``
        block: the recomputation takes the context's mask its first forward took (kept
        where the forward may be recomputed)."""
        if padding_mask is not None or not self.training:
            return padding_mask, False
        if recomputing():
            kept = self.__dict__.get("_context_mask")
            return kept, kept is not None
        context = getattr(_CONTEXT, "mask", None)
        if not compiling() and may_be_recomputed():
            self.__dict__["_context_mask"] = context
        return context, context is not None

    def _check_inputs(self, input: Tensor, padding_mask: Tensor | None,
                      from_context: bool = False) -> None:
        check_floating(input, "PowerNorm")
        if input.dim() == 0 or input.shape[-1] != self.num_features:
            raise ValueError(f"PowerNorm expected input of shape (*, {self.num_features}) "
                             f"(channels last), got input of shape {shape_str(input)}")
        if padding_mask is None:
            return
        if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool:
            got = (f"dtype {padding_mask.dtype}" if isinstance(padding_mask, Tensor)
                   else type(padding_mask).__name__)
            raise TypeError(f"PowerNorm expected padding_mask to be a bool tensor (True at "
                            f"padding), got {got}")
        lead = tuple(input.shape[:-1])
        if tuple(padding_mask.shape) != lead:
            hint = ""
            if padding_mask.dim() == 2 and tuple(padding_mask.shape) == lead[::-1]:
                hint = (" -- a (B, T) mask for a (T, B, C) input: pass "
                        "padding_mask.t()")
            if from_context:
                hint += (" (the mask of normkit.padding_mask(...), which every PowerNorm "
                         "called inside takes: call this layer outside it, or pass it "
                         "padding_mask= explicitly)")
            raise ValueError(f"PowerNorm expected padding_mask of shape "
                             f"({', '.join(map(str, lead))}) (the input's shape without "
                             f"the last dim), got {shape_str(padding_mask)}{hint}")
        if padding_mask.device != input.device:
            raise ValueError(f"PowerNorm expected padding_mask on the input's device "
                             f"{input.device}, got {padding_mask.device}")

    def _scaled(self, input: Tensor, compute: torch.dtype) -> Tensor:
        """The group scaling (or the input, in the compute dtype)."""
        x = input.to(compute)
        if self.group_num is None:
            return x
        c, g = self.num_features, self.group_num
        grouped = x.reshape(*x.shape[:-1], g, c // g)
        return F.rms_norm(grouped, (c // g,), eps=GROUP_SCALING_EPS).reshape(x.shape)

    def forward(self, input: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, input) if padding_mask is None else fx_leaf(
                self, input, padding_mask)
        if isinstance(input, Tensor) and input.is_nested:
            return self._nested_forward(input, padding_mask)
        padding_mask, from_context = self._padding_of_this_call(padding_mask)
        return self._forward(input, padding_mask, from_context)

    def _nested_forward(self, input: Tensor, padding_mask: Tensor | None) -> Tensor:
        """A jagged nested tensor: the layer on its ``values()``, the tokens of every
        sequence packed, with the rows of no sequence (``torch.nested.narrow``'s) masked
        out of the statistics; :mod:`normkit.norms._nested`."""
        if padding_mask is not None:
            raise ValueError(
                "PowerNorm expected no padding_mask with a nested input (its sequences hold "
                "only real tokens, which are what the statistics count), got a padding_mask "
                f"of shape {shape_str(padding_mask)}")
        if input.layout != torch.jagged:
            raise ValueError(
                f"PowerNorm expected a dense tensor or a jagged nested tensor (its statistics "
                f"are over every token of the batch, which only the jagged layout packs in "
                f"one tensor), got {_nested.describe(input)}: build it with "
                f"torch.nested.nested_tensor(..., layout=torch.jagged)")
        ragged = input._ragged_idx
        if input.dim() - 1 <= ragged:
            raise ValueError(
                f"PowerNorm expected input of shape (*, {self.num_features}) (channels last) "
                f"with the channels after the ragged dim {ragged}, got "
                f"{_nested.describe(input)}")
        values = input.values()
        mask = _nested.padding_of_values(input)
        if mask is None:
            return _nested.per_token(lambda v: self._forward(v, None, False),
                                     (self.num_features,), "PowerNorm", input)
        # the rows run along the values' dim ragged - 1; they are zeroed, not only masked
        # (they belong to no sequence: whatever they hold reaches no output, no gradient)
        view = [1] * (values.dim() - 1)
        view[ragged - 1] = -1
        mask = mask.view(view).expand(values.shape[:-1])
        return _nested.per_token(
            lambda v: self._forward(v.masked_fill(mask[..., None], 0), mask, False),
            (self.num_features,), "PowerNorm", input)

    def _forward(self, input: Tensor, padding_mask: Tensor | None,
                 from_context: bool) -> Tensor:
        self._check_inputs(input, padding_mask, from_context)
        compute = _stats.compute_dtype(input.dtype)
        xs = self._scaled(input, compute)
        if not self.training:
            check_running_statistics(self, ("running_phi",))
            inv = torch.rsqrt(self.running_phi.to(compute) + self.eps)
            return self._affine(xs * inv).to(input.dtype)
        if transformed():
            raise RuntimeError(
                "PowerNorm in training mode cannot run under a torch.func transform (vmap, "
                "grad, jacrev, ...) or forward-mode AD: its backward is an approximation, "
                "not a derivative, and updates the buffer ema_gz, which a transform cannot "
                "compose; call it outside the transform, or in eval mode (model.eval(): "
                "plain differentiable operations on running_phi), which transforms accept")
        if input.numel() == 0:  # nothing to count: the statistics stay as they are
            return self._affine(xs).to(input.dtype)
        if recomputing():
            with restored_for_recomputation(self, ("running_phi", "num_batches_tracked")):
                return self._training_forward(input, xs, padding_mask)
        keep_for_recomputation(self, ("running_phi", "num_batches_tracked"))
        forget_checked_statistics(self)
        return self._training_forward(input, xs, padding_mask)

    def _affine(self, z: Tensor) -> Tensor:
        if self.weight is not None:
            z = z * self.weight.to(z.dtype)
        if self.bias is not None:
            z = z + self.bias.to(z.dtype)
        return z

    def _training_forward(self, input: Tensor, xs: Tensor,
                          padding_mask: Tensor | None) -> Tensor:
        compute, c = xs.dtype, self.num_features
        xs = xs.contiguous()  # (one copy at most: the rows below and the autograd node's)
        rows = xs.view(-1, c)
        if padding_mask is None:
            keep = None
            count = rows.new_full((), float(rows.shape[0]))
        else:
            keep = (~padding_mask).reshape(-1, 1).to(compute)
            count = keep.sum()
        phi = read_before_update(self.running_phi).to(compute, copy=True)  # (updated below)
        counted = count > 0
        # a batch with no token counted: its statistic is running_phi's (which the
        # updates below then leave as it is)
        squares = column_dot(rows.detach(), rows.detach(), keep)  # (over counted rows)
        if self._observer is not None:  # (normkit.update_bn_stats: the batch's sums)
            self._observer(count, squares)
        psi2 = torch.where(counted, squares / count.clamp(min=1), phi)
        step = self.num_batches_tracked + 1
        warm = step <= self.warmup_iters
        inv_batch = torch.rsqrt(psi2 + self.eps)
        inv_fwd = torch.where(warm, inv_batch, torch.rsqrt(phi + self.eps))
        with torch.no_grad():
            t = step.to(compute)
            averaged = torch.where(step < self.warmup_iters, phi * (t - 1) / t + psi2 / t, phi)
            self.running_phi.copy_(self.alpha_fwd * averaged + (1 - self.alpha_fwd) * psi2)
            self.num_batches_tracked.add_(1)
        y = _PowerFunction.apply(xs, self.weight, self.bias, inv_fwd, inv_batch,
                                 self.ema_gz, self.alpha_bkw, keep, count, squares)
        return y.to(input.dtype)
