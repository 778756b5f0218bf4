"""Diagnose a model's normalization layers on one batch: ``doctor(model, example_batch)``.

The doctor runs the model **once** with hooks on every normalization layer (torch's
and normkit's BatchNorm, SyncBatchNorm, BatchRenorm, FrozenBatchNorm, MeanOnlyBatchNorm,
LayerNorm, LayerNorm2d, RMSNorm, GroupNorm, InstanceNorm, and normkit's PowerNorm; norm
layers of the model's own classes, such as Hugging Face's ``LlamaRMSNorm``, are reported
and checked for NaN/Inf only) and reports, per layer, what
the layer saw and did: its mode, the number of values each statistic is computed over
at this batch, the statistics of its input and output, how far BatchNorm's running
statistics are from the batch's, and its affine ``gamma``. It turns what it sees into
structured warnings, each with a remedy, and adds a recommendation
(:func:`normkit.tools.recommend.recommend`) for the model's architecture and batch size.
The model is left as it
was: every buffer (running statistics, ``num_batches_tracked``) and every module's
train/eval mode is restored after the run. A model that raises does not crash the
doctor: the report names the layer that was running (``report.error``).

The advice encoded here comes from 《深度学习归一化技术：BN与LN原理及应用对比》 (BN needs
batch >= 32 and degrades below 16; validate in eval mode; a sudden drop of validation
accuracy points to BN's running statistics; gamma = 1 and beta = 0 at initialization),
《归一化那些事》 (BN depends on the batch and does not suit tiny batches), and Wu & He 2018
(ResNet-50 error with BN at 32/16/8/4/2 images per GPU: 23.6/23.7/24.8/27.3/34.7 %).

Example:
    >>> import torch, normkit
    >>> from normkit.tools.doctor import doctor
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), normkit.BatchNorm2d(4))
    >>> report = doctor(net, torch.randn(2, 3, 3, 3))
    >>> [w.code for w in report.warnings]
    ['few-values']
    >>> report.layers[0].values_per_stat
    2
"""

from __future__ import annotations

import io
import json
import math
import sys
import textwrap
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .. import _stats
from .._surgery import is_own_norm
from ..norms._core import FLOAT16_MAX, FLOAT16_STATISTICS_REMEDY, overflowed_float16
from ..norms._nested import padding_of_values
from ..norms.batch import (
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    FrozenBatchNorm,
)
from ..norms.layer import LayerNorm2d
from ..norms.mean_only import MeanOnlyBatchNorm1d, MeanOnlyBatchNorm2d
from ..norms.power import PowerNorm
from ..recurrent import LayerNormLSTM, LayerNormLSTMCell
from .precise import default_forward
from .recommend import Recommendation, _canonical_architecture, recommend

__all__ = [
    "doctor", "DoctorReport", "LayerReport", "TensorStats", "RunningCheck", "GammaStats",
    "Finding", "ModelError", "print_report", "example_batch_from_shape", "infer_architecture",
    "norm_family", "CODES", "FEW_VALUES", "SMALL_BATCH", "STALE_SHIFT", "STALE_VAR_RATIO",
    "COLLAPSED_GAMMA",
]

_ARTICLE_BN_LN = "《深度学习归一化技术：BN与LN原理及应用对比》"

#: BatchNorm normalizing with batch statistics of fewer values per channel than this
#: gets a ``few-values`` warning: the standard error of the batch mean is then at least
#: 1/4 of the standard deviation. 《深度学习归一化技术：BN与LN原理及应用对比》 §2.3: with a batch
#: "< 16 the statistics are inaccurate and accuracy drops markedly".
FEW_VALUES = 16
#: BatchNorm in training on fewer samples than this gets a ``small-batch`` warning
#: (positions within one sample are correlated, so the samples are the real sample size).
#: Wu & He 2018: ResNet-50 error with BN is 23.6/23.7 % at 32/16 images per GPU, but
#: 24.8/27.3/34.7 % at 8/4/2.
SMALL_BATCH = 16
#: ``stale-running-stats`` fires in eval mode when the RMS over channels of
#: ``|batch mean - running mean| / sqrt(running var + eps)`` exceeds
#: ``max(STALE_SHIFT, 3 / sqrt(N))``: one running standard deviation, and never less than
#: three standard errors of a mean over ``N`` independent samples (so a tiny example
#: batch does not raise false alarms).
STALE_SHIFT = 1.0
#: ... or when the geometric mean over channels of ``batch var / running var`` lies
#: outside ``[1 / STALE_VAR_RATIO, STALE_VAR_RATIO]``.
STALE_VAR_RATIO = 4.0
#: ``|gamma|`` below this counts as collapsed: the channel outputs ``beta`` whatever its
#: input (《深度学习归一化技术：BN与LN原理及应用对比》 §5.1 initializes gamma = 1, beta = 0).
COLLAPSED_GAMMA = 1e-3

#: Every warning code: severity and meaning.
CODES: dict[str, tuple[str, str]] = {
    "nonfinite-input": ("error", "NaN/Inf in a norm layer's input (first layer that saw it)"),
    "nonfinite-output": ("error", "finite input, NaN/Inf output"),
    "invalid-state": ("error", "NaN/Inf parameters or running statistics, negative running_var"),
    "few-values": ("warning", f"BatchNorm statistics over < {FEW_VALUES} values per channel"),
    "small-batch": ("warning", f"BatchNorm in training with < {SMALL_BATCH} samples"),
    "train-under-no-grad": ("warning", "BatchNorm in train mode under torch.no_grad(): "
                                       "validation in train mode"),
    "stale-running-stats": ("warning", "eval-mode running statistics far from the batch's"),
    "collapsed-gamma": ("warning", f"|gamma| < {COLLAPSED_GAMMA:g} in some channels"),
    "zero-init-gamma": ("info", "every gamma exactly 0: the zero-init-residual start"),
    "momentum-convention": ("warning", "BatchNorm momentum in (0.5, 1): Keras' or Flax's "
                                       "convention (PyTorch's is 1 - m)"),
    "cumulative-momentum": ("info", "BatchNorm with momentum=None in training"),
    "batch-stats-in-eval": ("info", "BatchNorm without running statistics in eval mode"),
    "own-norm-layers": ("info", "norm layers of the model's own classes: only checked for "
                                "NaN/Inf"),
    "no-norm-layers": ("info", "the model has no normalization layer"),
    "analysis-failed": ("info", "the doctor could not analyse a layer call"),
}

# codes that describe the whole model: one finding listing every layer
_MODEL_WIDE = ("small-batch", "train-under-no-grad", "momentum-convention",
               "cumulative-momentum",
               "batch-stats-in-eval", "zero-init-gamma", "own-norm-layers")
_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}

# (classes, family, how the statistics are taken); the first match wins
_KINDS: tuple[tuple[type | tuple[type, ...], str, str], ...] = (
    (FrozenBatchNorm, "frozenbn", "channel"),
    ((BatchRenorm1d, BatchRenorm2d, BatchRenorm3d), "batchrenorm", "channel"),
    (nn.SyncBatchNorm, "syncbn", "channel"),
    (nn.modules.batchnorm._BatchNorm, "bn", "channel"),
    ((MeanOnlyBatchNorm1d, MeanOnlyBatchNorm2d), "meanonly", "channel"),
    (PowerNorm, "powernorm", "tokens"),
    (LayerNorm2d, "ln2d", "ln2d"),
    (nn.LayerNorm, "ln", "trailing"),
    (nn.RMSNorm, "rms", "trailing"),
    (nn.GroupNorm, "gn", "group"),
    (nn.modules.instancenorm._InstanceNorm, "in", "instance"),
)
_BATCH_FAMILIES = frozenset({"bn", "syncbn", "batchrenorm", "meanonly"})

_ARCH_MODULES: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("transformer", (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoderLayer,
                     nn.TransformerDecoderLayer)),
    ("rnn", (nn.RNNBase, nn.RNNCellBase, LayerNormLSTM, LayerNormLSTMCell)),
    ("cnn", (nn.modules.conv._ConvNd,)),
)


def _kind(module: nn.Module) -> tuple[str, str] | None:
    for classes, family, kind in _KINDS:
        if isinstance(module, classes):
            return family, kind
    if is_own_norm(module):  # a Hugging Face LlamaRMSNorm, T5LayerNorm, ...
        return "own", "own"
    return None


def norm_family(module: nn.Module) -> str | None:
    """The family the doctor files ``module`` under, or ``None`` for a non-norm module.

    Families: ``bn``, ``syncbn``, ``batchrenorm``, ``frozenbn``, ``meanonly``, ``ln``,
    ``ln2d``, ``rms``, ``gn``, ``in``, ``powernorm``, and ``own`` for a norm of the
    model's own class (:func:`normkit._surgery.is_own_norm`: Hugging Face's
    ``LlamaRMSNorm``), whose
    statistics and affine convention the doctor cannot know.

    Example:
        >>> import torch, normkit
        >>> norm_family(torch.nn.BatchNorm2d(3)), norm_family(normkit.LayerNorm2d(3))
        ('bn', 'ln2d')
        >>> norm_family(torch.nn.Linear(2, 2)) is None
        True
    """
    found = _kind(module)
    return None if found is None else found[0]


def infer_architecture(model: nn.Module) -> str:
    """Guess the architecture :func:`~normkit.tools.recommend.recommend` should assume.

    In this order: attention (``nn.MultiheadAttention``, ``nn.Transformer*Layer``, or a
    module whose class name contains "Attention" or "Transformer") → ``"transformer"``;
    a recurrent module (``nn.RNN/LSTM/GRU`` and their cells, normkit's ``LayerNormLSTM``)
    → ``"rnn"``; a convolution → ``"cnn"``; anything else → ``"mlp"``. Style-transfer
    networks and GANs cannot be told apart from CNNs: pass ``architecture=`` for them.

    Example:
        >>> import torch
        >>> infer_architecture(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3)))
        'cnn'
        >>> infer_architecture(torch.nn.LSTM(4, 8))
        'rnn'
        >>> infer_architecture(torch.nn.Linear(4, 2))
        'mlp'
    """
    modules = list(model.modules())
    for architecture, classes in _ARCH_MODULES:
        for module in modules:
            named = architecture == "transformer" and any(
                word in type(module).__name__ for word in ("Attention", "Transformer"))
            if isinstance(module, classes) or named:
                return architecture
    return "mlp"


def example_batch_from_shape(shape: str | Sequence[int], *, seed: int = 0,
                             dtype: torch.dtype = torch.float32) -> Tensor:
    """A standard-normal example batch of ``shape`` (``"8,3,32,32"``, ``"8x3x32x32"`` or ints).

    Args:
        shape: positive sizes, as a string separated by commas or ``x``, or a sequence.
        seed: seed of the generator (the batch is reproducible). Default: ``0``.
        dtype: floating dtype. Default: ``torch.float32``.

    Example:
        >>> example_batch_from_shape("8,3,32,32").shape
        torch.Size([8, 3, 32, 32])
        >>> example_batch_from_shape("2x4").shape
        torch.Size([2, 4])
        >>> example_batch_from_shape("8,three")
        Traceback (most recent call last):
        ...
        ValueError: expected a shape of positive ints separated by commas, like '8,3,32,32', \
got '8,three'
    """
    if isinstance(shape, str):
        parts = [p.strip() for p in shape.replace("x", ",").replace("X", ",").split(",")]
        sizes = [int(p) if p.isdigit() else -1 for p in parts]
    else:
        sizes = [int(s) if isinstance(s, int) and not isinstance(s, bool) else -1
                 for s in shape]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError("expected a shape of positive ints separated by commas, like "
                         f"'8,3,32,32', got {shape!r}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*sizes, generator=generator, dtype=dtype)


# --------------------------------------------------------------------------- report types


@dataclass(frozen=True)
class TensorStats:
    """Statistics of a norm layer's input or output at this batch (NaN where undefined).

    ``mean`` and ``std`` are over all values; ``channel_*`` summarize the per-channel
    mean and standard deviation along the layer's channel axis (dim 1 for BatchNorm,
    GroupNorm, InstanceNorm and LayerNorm2d; the last dim for LayerNorm and RMSNorm).
    Standard deviations are biased (population), as normalization uses them.
    ``nonfinite`` counts NaN and Inf values.

    Example:
        >>> s = TensorStats.of(torch.tensor([[1.0, 10.0], [3.0, 10.0]]), axis=1)
        >>> s.mean, s.channel_mean_min, s.channel_mean_max, s.channel_std_max
        (6.0, 2.0, 10.0, 1.0)
    """

    mean: float
    std: float
    channel_mean_min: float
    channel_mean_max: float
    channel_std_min: float
    channel_std_max: float
    nonfinite: int
    numel: int

    @classmethod
    def of(cls, x: Tensor, axis: int) -> TensorStats | None:
        """The statistics of ``x`` with channels along ``axis`` (``None`` for an empty ``x``)."""
        if x.numel() == 0:
            return None
        x = _stats.upcast(x.detach())
        if x.dim() == 0:
            x = x.reshape(1)
        overall = _stats.moments(x, tuple(range(x.dim())))
        dims = tuple(d for d in range(x.dim()) if d != axis % x.dim())
        if dims:
            per_channel = _stats.moments(x, dims)
            means, stds = per_channel.mean.reshape(-1), per_channel.var.sqrt().reshape(-1)
        else:  # a single vector of channels: each channel is one value
            means, stds = x, torch.zeros_like(x)
        mean, std = float(overall.mean), float(overall.var.sqrt())
        # a NaN or Inf anywhere makes the mean non-finite: count them only then
        nonfinite = 0 if math.isfinite(mean) and math.isfinite(std) else int(
            (~torch.isfinite(x)).sum())
        return cls(mean, std, float(means.min()), float(means.max()), float(stds.min()),
                   float(stds.max()), nonfinite, x.numel())

    def pooled(self, other: TensorStats | None) -> TensorStats:
        """The statistics of this tensor and ``other`` together (a layer's calls pooled):
        count-weighted mean and biased variance, extremes of the per-channel summaries.

        Example:
            >>> a = TensorStats.of(torch.tensor([[0.0, 2.0]]), axis=1)
            >>> b = TensorStats.of(torch.tensor([[4.0, 6.0]]), axis=1)
            >>> both = a.pooled(b)
            >>> both.mean, round(both.std ** 2, 5), both.channel_mean_max, both.numel
            (3.0, 5.0, 6.0, 4)
        """
        if other is None:
            return self
        n = self.numel + other.numel
        mean = (self.numel * self.mean + other.numel * other.mean) / n
        var = (self.numel * (self.std ** 2 + (self.mean - mean) ** 2)
               + other.numel * (other.std ** 2 + (other.mean - mean) ** 2)) / n
        return TensorStats(
            mean, math.sqrt(var), min(self.channel_mean_min, other.channel_mean_min),
            max(self.channel_mean_max, other.channel_mean_max),
            min(self.channel_std_min, other.channel_std_min),
            max(self.channel_std_max, other.channel_std_max),
            self.nonfinite + other.nonfinite, n)


@dataclass(frozen=True)
class RunningCheck:
    """How far a BatchNorm's running statistics are from this batch's (before the update).

    ``mean_shift_*`` are the max and RMS over channels of
    ``|batch mean - running mean| / sqrt(running var + eps)`` (for MeanOnlyBatchNorm,
    which keeps no variance, the batch standard deviation is the unit). ``var_ratio_*``
    are the min, max and geometric mean over channels of ``batch var / running var``,
    with the batch variance in ``running_var``'s convention (unbiased unless the layer
    has ``unbiased_running_var=False``); ``None`` without a running variance or with
    fewer than 2 values per channel.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2).eval()
        >>> c = RunningCheck.of(bn, torch.tensor([[4.0, 0.0], [6.0, 0.0]]))
        >>> round(c.mean_shift_max, 3), c.var_ratio_max, c.num_batches_tracked
        (5.0, 2.0, 0)
    """

    mean_shift_max: float
    mean_shift_rms: float
    var_ratio_min: float | None
    var_ratio_max: float | None
    var_ratio_gmean: float | None
    num_batches_tracked: int | None

    @classmethod
    def of(cls, module: nn.Module, x: Tensor) -> RunningCheck | None:
        """Compare ``module``'s running statistics with those of its input ``x``."""
        running_mean = getattr(module, "running_mean", None)
        if (running_mean is None or x.dim() < 2 or x.shape[1] != running_mean.numel()
                or x.numel() == 0):
            return None
        dims = (0, *range(2, x.dim()))
        count = _stats.reduced_count(x.shape, dims)
        m = _stats.moments(_stats.upcast(x.detach()), dims)
        mean, var = m.mean.reshape(-1), m.var.reshape(-1)
        eps = float(getattr(module, "eps", 1e-5))
        running_var = getattr(module, "running_var", None)
        ratios = None
        if running_var is None:
            unit = torch.sqrt(var + eps)
        else:
            running_var = running_var.to(var.dtype)
            unit = torch.sqrt(running_var + eps)
            if count > 1:
                unbiased = getattr(module, "unbiased_running_var", True)
                ratios = (_stats.unbiased_var(var, count) if unbiased else var) / running_var
        z = (mean - running_mean.to(mean.dtype)).abs() / unit  # (C,)
        rms = float(_stats.mean_square(z, (0,)).sqrt())
        tracked = getattr(module, "num_batches_tracked", None)
        tracked = None if tracked is None else int(tracked)
        if ratios is None:
            return cls(float(z.max()), rms, None, None, None, tracked)
        gmean = float(_stats.moments(ratios.log(), (0,)).mean.exp())
        return cls(float(z.max()), rms, float(ratios.min()), float(ratios.max()), gmean,
                   tracked)

    @classmethod
    def of_power_norm(cls, module: nn.Module, x: Tensor) -> RunningCheck | None:
        """A :class:`normkit.PowerNorm`'s running quadratic mean against its input's:
        ``var_ratio_*`` compare the batch's mean of squares of the (group-scaled)
        input per channel with ``running_phi``; there is no mean, so the shifts are 0.

        Example:
            >>> import normkit
            >>> pn = normkit.PowerNorm(2, group_num=None).eval()
            >>> c = RunningCheck.of_power_norm(pn, torch.tensor([[2.0, 1.0], [2.0, 1.0]]))
            >>> c.var_ratio_min, c.var_ratio_max
            (1.0, 4.0)
        """
        if x.dim() == 0 or x.shape[-1] != module.num_features or x.numel() == 0:
            return None
        with torch.no_grad():
            xs = module._scaled(x.detach(), _stats.compute_dtype(x.dtype))
            psi2 = xs.reshape(-1, module.num_features).square().mean(0)
            ratios = psi2 / module.running_phi.to(psi2.dtype)
        if not bool(torch.isfinite(ratios).all()) or bool((ratios <= 0).any()):
            return None
        gmean = float(_stats.moments(ratios.log(), (0,)).mean.exp())
        return cls(0.0, 0.0, float(ratios.min()), float(ratios.max()), gmean,
                   int(module.num_batches_tracked))


@dataclass(frozen=True)
class GammaStats:
    """The affine scale ``gamma`` (``weight``) of a norm layer.

    ``collapsed`` counts entries with ``|gamma| < COLLAPSED_GAMMA``.

    Example:
        >>> g = GammaStats.of(torch.tensor([1.0, 0.0, -2.0, 1e-4]))
        >>> g.min_abs, g.collapsed, g.fraction_collapsed
        (0.0, 2, 0.5)
    """

    min_abs: float
    max_abs: float
    collapsed: int
    fraction_collapsed: float
    numel: int

    @classmethod
    def of(cls, weight: Tensor | None) -> GammaStats | None:
        """Summarize ``weight`` (``None`` when there is none)."""
        if weight is None or not isinstance(weight, Tensor) or weight.numel() == 0:
            return None
        magnitude = weight.detach().abs().float()
        collapsed = int((magnitude < COLLAPSED_GAMMA).sum())
        return cls(float(magnitude.min()), float(magnitude.max()), collapsed,
                   collapsed / magnitude.numel(), magnitude.numel())


@dataclass(frozen=True)
class LayerReport:
    """What one normalization layer saw and did during the doctor's run.

    Attributes:
        name: the layer's qualified name in the model (``""`` for the model itself).
        type: its class name.
        family: see :func:`norm_family`.
        mode: ``"train"`` or ``"eval"`` (the module's ``training`` flag).
        statistics: what it normalized with: ``"batch"`` (statistics of this batch,
            shared by its samples), ``"running"`` (stored running statistics) or
            ``"sample"`` (each sample's own statistics: LN, RMS, GN, IN).
        grad_enabled: whether autograd was on when the layer ran (or will be: reentrant
            activation checkpointing runs its first forward without autograd and the
            recomputation in backward with it; such calls count as on).
        calls: how many times the layer ran: a layer reused in the model, or a norm inside
            a recurrent cell (once per time step). ``input`` and ``output`` pool every
            call; the other fields describe the first.
        input_shape: shape of its input.
        values_per_stat: the number of values each statistic is computed over at this
            batch: ``N*H*W`` per channel for BatchNorm (what the batch statistics compared
            with the running ones are computed over in eval), the normalized numel for
            LayerNorm/RMSNorm, ``C`` for LayerNorm2d, ``C/G*H*W`` for GroupNorm, ``H*W``
            for InstanceNorm; 0 (unknown) for a norm of the model's own class (family
            ``own``).
        input, output: :class:`TensorStats` (``output`` is ``None`` when the layer raised).
        running: :class:`RunningCheck` for layers with running statistics, else ``None``.
        gamma: :class:`GammaStats` for layers with an affine ``weight``, else ``None``.

    Example:
        >>> report = doctor(torch.nn.LayerNorm(6), torch.randn(4, 6))
        >>> layer = report.layers[0]
        >>> layer.family, layer.statistics, layer.values_per_stat
        ('ln', 'sample', 6)
    """

    name: str
    type: str
    family: str
    mode: str
    statistics: str
    grad_enabled: bool
    calls: int
    input_shape: tuple[int, ...]
    values_per_stat: int
    input: TensorStats | None
    output: TensorStats | None
    running: RunningCheck | None
    gamma: GammaStats | None


@dataclass(frozen=True)
class Finding:
    """One warning of the doctor: where, what (a code of :data:`CODES`), and what to do.

    ``layer`` is the (first) layer concerned; ``layers`` lists every layer the finding
    covers (model-wide findings such as ``small-batch`` are reported once).

    Example:
        >>> f = Finding("bn1", "small-batch", "warning", "4 samples", "use GroupNorm")
        >>> f.layers
        ('bn1',)
    """

    layer: str
    code: str
    severity: str
    message: str
    remedy: str
    layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", (self.layer,))


@dataclass(frozen=True)
class ModelError:
    """The exception the model raised during the doctor's run, and where.

    Attributes:
        layer: the innermost module that was running (``""``: the model's own forward;
            ``None``: outside every module, e.g. in a custom ``forward`` function).
        layer_type: its class name.
        path: the modules being run, outermost first.
        exception: the exception's class name.
        message: the exception's text.
        traceback: the formatted traceback.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(5))
        >>> err = doctor(net, torch.randn(8, 3)).error
        >>> err.layer, err.layer_type, err.exception
        ('1', 'BatchNorm1d', 'RuntimeError')
    """

    layer: str | None
    layer_type: str | None
    path: tuple[str, ...]
    exception: str
    message: str
    traceback: str


def _clean(value):
    """JSON-ready: non-finite floats become None, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.3g}"
    return str(value)


_HEADER = ("layer", "type", "mode", "stats", "values/stat", "in mean", "in std", "out mean",
           "out std", "shift", "var ratio", "min abs(gamma)")
_LEGEND = ("values/stat: values each statistic is computed over at this batch. shift: RMS "
           "over channels of |batch mean - running mean| / sqrt(running var + eps). var ratio: "
           "geometric mean over channels of batch var / running var. (N calls): a layer "
           "that ran N times (reused, or once per time step); in/out pool every call.")


def _row(layer: LayerReport) -> tuple[str, ...]:
    def get(stats, attr):
        return None if stats is None else getattr(stats, attr)

    name = layer.name or "<model>"
    if layer.calls > 1:
        name += f" ({layer.calls} calls)"
    return (name, layer.type, layer.mode, layer.statistics,
            "-" if layer.family == "own" else str(layer.values_per_stat),
            _fmt(get(layer.input, "mean")),
            _fmt(get(layer.input, "std")), _fmt(get(layer.output, "mean")),
            _fmt(get(layer.output, "std")),
            "-" if layer.family == "powernorm" else _fmt(get(layer.running, "mean_shift_rms")),
            _fmt(get(layer.running, "var_ratio_gmean")), _fmt(get(layer.gamma, "min_abs")))


@dataclass(frozen=True)
class DoctorReport:
    """The result of :func:`doctor`.

    Attributes:
        model: the model's class name.
        architecture: the architecture given or inferred (:func:`infer_architecture`).
        batch_size: the per-device batch size read from the example batch, or ``None``.
        grad_enabled: whether autograd was on for the run.
        layers: a :class:`LayerReport` per normalization layer that ran, in order.
        warnings: :class:`Finding` s, errors first, then warnings, then infos.
        recommendation: :func:`~normkit.tools.recommend.recommend` for the architecture
            and batch size (``None`` when the batch size is unknown).
        error: a :class:`ModelError` when the model raised, else ``None``.

    Example:
        >>> import json
        >>> report = doctor(torch.nn.BatchNorm1d(3), torch.randn(64, 3))
        >>> report.ok, report.warnings, report.recommendation.family
        (True, [], 'bn')
        >>> json.loads(report.to_json())["layers"][0]["values_per_stat"]
        64
        >>> print(report.render().splitlines()[0])
        normkit doctor: BatchNorm1d (mlp), batch 64, 1 norm layer, grad enabled
    """

    model: str
    architecture: str | None
    batch_size: int | None
    grad_enabled: bool
    layers: list[LayerReport] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    recommendation: Recommendation | None = None
    error: ModelError | None = None

    @property
    def ok(self) -> bool:
        """``True`` when the model ran without raising (warnings or not)."""
        return self.error is None

    def to_dict(self) -> dict:
        """The report as plain, JSON-serializable data.

        Floats that are NaN or Inf become ``None`` (strict JSON has no NaN); the
        ``nonfinite`` counts and the warnings say where they were.
        ``json.loads(report.to_json()) == report.to_dict()``.

        Example:
            >>> d = doctor(torch.nn.GroupNorm(2, 4), torch.randn(2, 4, 3)).to_dict()
            >>> sorted(d)  # doctest: +NORMALIZE_WHITESPACE
            ['architecture', 'batch_size', 'error', 'grad_enabled', 'layers', 'model', 'ok',
             'recommendation', 'thresholds', 'warnings']
        """
        return _clean({
            "model": self.model,
            "architecture": self.architecture,
            "batch_size": self.batch_size,
            "grad_enabled": self.grad_enabled,
            "ok": self.ok,
            "layers": [asdict(layer) for layer in self.layers],
            "warnings": [asdict(w) for w in self.warnings],
            "recommendation": (None if self.recommendation is None
                               else self.recommendation.to_dict()),
            "error": None if self.error is None else asdict(self.error),
            "thresholds": {"few_values": FEW_VALUES, "small_batch": SMALL_BATCH,
                           "stale_shift": STALE_SHIFT, "stale_var_ratio": STALE_VAR_RATIO,
                           "collapsed_gamma": COLLAPSED_GAMMA},
        })

    def to_json(self, indent: int | None = 2) -> str:
        """The report as strict JSON (see :meth:`to_dict`).

        Example:
            >>> import json
            >>> report = doctor(torch.nn.LayerNorm(4), torch.randn(2, 4))
            >>> json.loads(report.to_json()) == report.to_dict()
            True
        """
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False, allow_nan=False)

    def _title(self) -> str:
        arch = f" ({self.architecture})" if self.architecture else ""
        batch = "" if self.batch_size is None else f", batch {self.batch_size}"
        count = len(self.layers)
        grad = "grad enabled" if self.grad_enabled else "grad disabled"
        return (f"normkit doctor: {self.model}{arch}{batch}, {count} norm "
                f"layer{'s' if count != 1 else ''}, {grad}")

    def _error_lines(self) -> list[str]:
        if self.error is None:
            return []
        err = self.error
        if err.layer is None:
            where = "outside every module"
        else:
            where = f"in {err.layer or '<model>'} ({err.layer_type})"
        return [f"Error: the model raised {err.exception} {where}: {err.message}"]

    def render(self, rich: bool = False) -> str:
        """The report as terminal text: title, layer table, warnings, recommendation.

        Args:
            rich: use the ``rich`` package for a coloured table (ANSI escapes) when it is
                importable; otherwise, and by default, a plain aligned text table.

        Example:
            >>> report = doctor(torch.nn.BatchNorm1d(3), torch.randn(64, 3))
            >>> print(report.render())  # doctest: +NORMALIZE_WHITESPACE, +ELLIPSIS
            normkit doctor: BatchNorm1d (mlp), batch 64, 1 norm layer, grad enabled
            <BLANKLINE>
            layer   | type        | mode  | stats | values/stat | in mean | in std | ...
            --------+-------------+-------+-------+-------------+---------+--------+-...
            <model> | BatchNorm1d | train | batch |          64 | ...
            ...
            No warnings.
            <BLANKLINE>
            Recommendation: BatchNorm ('bn') for mlp at batch 64 per device
            ...
        """
        if rich:
            text = _render_rich(self)
            if text is not None:
                return text
        lines = [self._title(), ""]
        if self.layers:
            lines += [_plain_table([_HEADER, *(_row(layer) for layer in self.layers)]),
                      *textwrap.wrap(_LEGEND, 100), ""]
        lines += self._error_lines()
        if self.warnings:
            lines.append(f"Warnings ({len(self.warnings)}):")
            for w in self.warnings:
                lines.append(f"  {w.severity}: {w.code} at {_where(w)}")
                lines.append(textwrap.fill(w.message, 100, initial_indent=" " * 4,
                                           subsequent_indent=" " * 4, break_on_hyphens=False))
                lines.append(textwrap.fill(w.remedy, 100, initial_indent="    fix: ",
                                           subsequent_indent=" " * 9, break_on_hyphens=False))
        else:
            lines.append("No warnings.")
        if self.recommendation is not None:
            lines += ["", f"Recommendation: {self.recommendation}"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _where(finding: Finding, shown: int = 6) -> str:
    names = [name or "<model>" for name in finding.layers]
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _plain_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def fmt(row: tuple[str, ...]) -> str:
        cells = [cell.rjust(width) for cell, width in zip(row, widths, strict=True)]
        for i in (0, 1, 2, 3):  # text columns left-aligned, numbers right-aligned
            cells[i] = row[i].ljust(widths[i])
        return " | ".join(cells).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(rows[0]), rule, *(fmt(row) for row in rows[1:])])


def _render_rich(report: DoctorReport) -> str | None:
    try:
        from rich.console import Console
    except ImportError:
        return None
    buffer = io.StringIO()
    _print_rich(report, Console(file=buffer, force_terminal=True, width=160))
    return buffer.getvalue().rstrip("\n")


def _print_rich(report: DoctorReport, console) -> None:
    from rich.table import Table
    from rich.text import Text

    console.print(Text(report._title(), style="bold"))
    if report.layers:
        table = Table(show_lines=False, header_style="bold")
        for i, name in enumerate(_HEADER):
            table.add_column(name, justify="left" if i < 4 else "right")
        flagged = {name: w.severity for w in reversed(report.warnings) for name in w.layers}
        for layer in report.layers:
            style = {"error": "red", "warning": "yellow"}.get(flagged.get(layer.name, ""), "")
            table.add_row(*_row(layer), style=style)
        console.print(table)
        console.print(Text(_LEGEND, style="dim"))
    for line in report._error_lines():
        console.print(Text(line, style="bold red"))
    colours = {"error": "bold red", "warning": "yellow", "info": "cyan"}
    if report.warnings:
        table = Table(title=f"Warnings ({len(report.warnings)})", title_justify="left",
                      show_lines=True, header_style="bold")
        for name in ("severity", "code", "at", "what, and the fix"):
            table.add_column(name, overflow="fold")
        for w in report.warnings:
            text = Text(w.message)
            text.append(f"\nfix: {w.remedy}", style="green")
            table.add_row(Text(w.severity, style=colours.get(w.severity, "")), w.code,
                          _where(w), text)
        console.print(table)
    else:
        console.print(Text("No warnings.", style="green"))
    if report.recommendation is not None:
        console.print()
        console.print(Text(f"Recommendation: {report.recommendation}"))


def print_report(report: DoctorReport, file=None, *, rich: bool | None = None) -> None:
    """Print ``report`` to ``file`` (default: stdout).

    Args:
        report: a :class:`DoctorReport`.
        file: a text stream. Default: ``sys.stdout``.
        rich: ``True``: a coloured ``rich`` table when ``rich`` is importable; ``False``:
            the plain table; ``None`` (default): rich only when it is importable and
            ``file`` is a terminal, so piped output stays plain text.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> print_report(doctor(torch.nn.LayerNorm(4), torch.randn(2, 4)), out)
        >>> out.getvalue().startswith("normkit doctor: LayerNorm (mlp), batch 2")
        True
    """
    file = sys.stdout if file is None else file
    if rich is None:
        rich = bool(getattr(file, "isatty", lambda: False)())
    if rich:
        try:
            from rich.console import Console
        except ImportError:
            rich = False
        else:
            _print_rich(report, Console(file=file))
            return
    print(report.render(), file=file)


# --------------------------------------------------------------------------- the run


@dataclass
class _Call:
    """One call of a norm layer: what the pre-hook measured, before the forward."""

    name: str
    module: nn.Module
    family: str
    kind: str
    mode: str
    statistics: str
    grad_enabled: bool
    input_shape: tuple[int, ...]
    batch: int
    values: int
    axis: int
    input: TensorStats | None
    running: RunningCheck | None
    gamma: GammaStats | None
    invalid: list[str]
    momentum: object


def _first_tensor(obj) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _tokens(x: Tensor) -> tuple[Tensor, int] | None:
    """A nested tensor as what a per-token norm sees: ``(its packed tokens, the number
    of sequences)`` for the jagged layout (the rows of a ``torch.nested.narrow`` view
    that belong to no sequence left out), None for the strided one (no dense tokens)."""
    if x.layout != torch.jagged:
        return None
    values = x.values()
    pad = padding_of_values(x)
    if pad is not None and x._ragged_idx == 1:
        values = values[~pad]
    return values, x.size(0)


def _unbatched(module: nn.Module, x: Tensor) -> bool:
    get = getattr(module, "_get_no_batch_dim", None)
    return get is not None and x.dim() == get()


def _layout(module: nn.Module, kind: str, x: Tensor) -> tuple[int, int]:
    """(values per statistic, channel axis) of ``module`` on input ``x``."""
    shape, nd = x.shape, x.dim()
    if kind == "channel":
        return _stats.reduced_count(shape, (0, *range(2, nd))), 1
    if kind == "ln2d":
        return shape[1], 1
    if kind == "tokens":  # PowerNorm: per channel of the last dim, over every token
        return x.numel() // max(shape[-1], 1), nd - 1
    if kind == "trailing":
        shape_ = tuple(module.normalized_shape)
        if (tuple(shape[nd - len(shape_):]) != shape_ and len(shape_) == 1 and nd >= 3
                and shape[1] == shape_[0]):
            return shape_[0], 1  # a subclass normalizing dim 1 (timm's LayerNorm2d)
        return math.prod(shape_), nd - 1
    if kind == "own":  # values unknown (0); channels along the weight's dim
        weight = getattr(module, "weight", None)
        size = weight.numel() if isinstance(weight, Tensor) else None
        return 0, 1 if nd >= 2 and size != shape[-1] and size == shape[1] else nd - 1
    if kind == "group":
        return shape[1] // module.num_groups * _stats.reduced_count(shape, range(2, nd)), 1
    start = 1 if _unbatched(module, x) else 2  # instance norm
    return _stats.reduced_count(shape, range(start, nd)), start - 1


def _statistics(module: nn.Module, family: str) -> str:
    if family == "own":
        return "unknown"
    has_running = getattr(module, "running_mean", None) is not None
    if family == "frozenbn":
        return "running"
    if family == "powernorm":  # the batch statistic during the warm-up only
        warm = int(module.num_batches_tracked) < module.warmup_iters
        return "batch" if module.training and warm else "running"
    if family in _BATCH_FAMILIES:
        return "running" if not module.training and has_running else "batch"
    if family == "in" and not module.training and has_running:
        return "running"
    return "sample"


#: the running statistics a norm layer may hold
_STATISTICS = ("running_mean", "running_var", "running_phi")


def _invalid_state(module: nn.Module) -> list[str]:
    problems = []
    for attr in ("weight", "bias", *_STATISTICS, "ema_gz"):
        value = getattr(module, attr, None)
        if not isinstance(value, Tensor) or value.numel() == 0:
            continue
        bad = int((~torch.isfinite(value.detach())).sum())
        if bad:
            problems.append(f"{attr} has {bad} NaN/Inf value(s)")
        if attr in ("running_var", "running_phi"):
            negative = int((value.detach() < 0).sum())
            if negative:
                problems.append(f"{attr} has {negative} negative value(s)")
    return problems


def _weight_standardized(model: nn.Module) -> int:
    """How many of ``model``'s layers have a weight-standardized tensor."""
    from ..weights import WeightStandardization

    return sum(any(isinstance(chain[0], WeightStandardization)
                   for chain in module.parametrizations.values())
               for module in model.modules() if parametrize.is_parametrized(module))


def _inside_reentrant_checkpoint() -> bool:
    """Whether this call runs inside reentrant activation checkpointing's first forward
    (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, Hugging Face's
    ``gradient_checkpointing_enable()`` default), which turns autograd off and reruns
    the segment with it in backward: not validation in train mode."""
    function = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
    code = getattr(getattr(function, "forward", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _measure(name: str, module: nn.Module, family: str, kind: str, x: Tensor,
             grad: bool, batch: int | None = None) -> _Call:
    with torch.no_grad():
        values, axis = _layout(module, kind, x)
        running = (RunningCheck.of(module, x)
                   if family in _BATCH_FAMILIES or family == "frozenbn" else
                   RunningCheck.of_power_norm(module, x) if family == "powernorm" else None)
        return _Call(
            name=name, module=module, family=family, kind=kind,
            mode="train" if module.training else "eval",
            statistics=_statistics(module, family), grad_enabled=grad,
            input_shape=tuple(x.shape),
            batch=batch if batch is not None else x.shape[0] if x.dim() >= 2 else 1,
            values=values, axis=axis, input=TensorStats.of(x, axis), running=running,
            gamma=None if family == "own" else GammaStats.of(getattr(module, "weight", None)),
            invalid=_invalid_state(module), momentum=getattr(module, "momentum", 0.1))


_SMALL_BATCH_REMEDY = (
    "use a norm that does not depend on the batch: GroupNorm "
    "(normkit.get_norm_layer('gn', C); Wu & He 2018) or LayerNorm; or SyncBatchNorm "
    "(normkit.convert_sync_batchnorm) when training on several devices, BatchRenorm2d, or "
    "FrozenBatchNorm (normkit.freeze_batchnorm) when fine-tuning; see "
    "normkit.tools.recommend.recommend")


def _diagnose(call: _Call, output: TensorStats | None) -> list[tuple[str, str, str]]:
    """(code, message, remedy) for one call of a norm layer."""
    found: list[tuple[str, str, str]] = []
    inp = call.input
    if inp is not None and inp.nonfinite:
        found.append(("nonfinite-input",
                      f"{inp.nonfinite} of {inp.numel} input values are NaN or Inf",
                      "find where they come from: the data, the layer before this one, or an "
                      "activation that overflowed its dtype (fp16); "
                      "torch.autograd.set_detect_anomaly(True) locates NaN in the backward"))
    elif output is not None and output.nonfinite:
        found.append(("nonfinite-output",
                      f"the input is finite but {output.nonfinite} of {output.numel} output "
                      "values are NaN or Inf",
                      "check eps > 0, the running statistics and the affine parameters "
                      "(see invalid-state), and whether the output overflows its dtype"))
    if call.invalid:
        overflowed = [name for name in _STATISTICS
                      if isinstance(t := getattr(call.module, name, None), Tensor)
                      and overflowed_float16(t)]
        found.append(("invalid-state", "; ".join(call.invalid),
                      f"{' and '.join(overflowed)} overflowed float16 (largest value "
                      f"{FLOAT16_MAX:.0f}; in inference those channels output their bias "
                      f"alone or NaN): {FLOAT16_STATISTICS_REMEDY}" if overflowed else
                      "reload the last good checkpoint or reset the layer "
                      "(reset_running_stats() / reset_parameters()); NaN statistics usually "
                      "come from a training step that diverged (lower the learning rate, clip "
                      "gradients)"))
    if call.statistics == "batch" and call.family in _BATCH_FAMILIES and call.values > 0:
        if call.values < FEW_VALUES:
            found.append(("few-values",
                          f"BatchNorm statistics from only {call.values} value(s) per channel "
                          f"(input {list(call.input_shape)}): below {FEW_VALUES} the batch "
                          "mean and variance are noisy (standard error of the mean >= 1/4 "
                          "std) and every output depends strongly on the other samples; "
                          f"{_ARTICLE_BN_LN} §2.3: batch < 16 gives inaccurate statistics",
                          _SMALL_BATCH_REMEDY))
        elif call.module.training and call.batch < SMALL_BATCH:
            found.append(("small-batch",
                          f"BatchNorm trains on batches of {call.batch} samples: values within "
                          "a sample are correlated, so its statistics rest on few samples; Wu "
                          "& He 2018 measure ResNet-50 error 23.7/24.8/27.3/34.7 % with BN at "
                          "16/8/4/2 images per GPU (GN: 24.2/24.0/24.2/24.1 %); "
                          f"{_ARTICLE_BN_LN} §2.3 advises batch >= 32",
                          _SMALL_BATCH_REMEDY))
    updates_running = (call.module.training and call.family != "frozenbn"
                       and (getattr(call.module, "running_mean", None) is not None
                            or call.family == "powernorm"))
    if (call.module.training and not call.grad_enabled
            and (call.statistics == "batch" or updates_running)):
        found.append(("train-under-no-grad",
                      "normalization with batch statistics in train mode while autograd is "
                      "off (torch.no_grad()/inference_mode): this looks like validation in "
                      "train mode: the outputs use this batch's statistics instead of the "
                      "running ones, and the running statistics are being updated with "
                      "validation data",
                      f"call model.eval() before validating and model.train() after "
                      f"({_ARTICLE_BN_LN} §5.2: run validation in eval mode); if the running "
                      "statistics are already polluted, recompute them with "
                      "normkit.update_bn_stats(model, train_loader)"))
    run = call.running
    # (NaN/Inf statistics or parameters: invalid-state says so; no comparison is meaningful)
    finite = inp is not None and not inp.nonfinite and not call.invalid
    if (call.family == "powernorm" and call.statistics == "running" and run is not None
            and finite and not 1.0 / STALE_VAR_RATIO <= run.var_ratio_gmean <= STALE_VAR_RATIO):
        message = (f"this PowerNorm normalizes by a running quadratic mean (running_phi) "
                   f"that does not match this batch: batch/running mean-square ratio "
                   f"{run.var_ratio_gmean:.3g} (geometric mean over channels; "
                   f"{run.var_ratio_min:.3g}..{run.var_ratio_max:.3g}; limits "
                   f"{1 / STALE_VAR_RATIO:g}..{STALE_VAR_RATIO:g})")
        if run.num_batches_tracked == 0:
            message += "; num_batches_tracked is 0: running_phi was never updated (ones)"
        found.append(("stale-running-stats", message,
                      "recompute running_phi with normkit.update_bn_stats(model, "
                      "train_loader) (the exact mean square over the training data, where "
                      "training leaves an average of the last ~1/(1 - alpha_fwd) batches), "
                      "or train the model first; if this batch is preprocessed differently "
                      "from the training data, fix the preprocessing instead"))
    elif call.statistics == "running" and run is not None and finite:
        limit = max(STALE_SHIFT, 3.0 / math.sqrt(max(call.batch, 1)))
        var_off = run.var_ratio_gmean is not None and not (
            1.0 / STALE_VAR_RATIO <= run.var_ratio_gmean <= STALE_VAR_RATIO)
        if run.mean_shift_rms > limit or var_off:
            message = (f"in eval mode this layer normalizes with running statistics that do "
                       f"not match this batch: the batch means are {run.mean_shift_rms:.3g} "
                       f"running standard deviations away (RMS over channels, max "
                       f"{run.mean_shift_max:.3g}; limit {limit:.3g})")
            if run.var_ratio_gmean is not None:
                message += (f", batch/running variance ratio {run.var_ratio_gmean:.3g} "
                            f"(geometric mean; {run.var_ratio_min:.3g}..{run.var_ratio_max:.3g};"
                            f" limits {1 / STALE_VAR_RATIO:g}..{STALE_VAR_RATIO:g})")
            if run.num_batches_tracked == 0:
                message += ("; num_batches_tracked is 0: the running statistics were never "
                            "updated (initial mean 0, variance 1)")
            if call.family == "frozenbn":
                remedy = ("FrozenBatchNorm keeps fixed statistics: refresh them on the "
                          "unfrozen model with normkit.update_bn_stats(model, train_loader) "
                          "before normkit.freeze_batchnorm, or check that the input is "
                          "preprocessed like the training data")
            else:
                remedy = ("recompute the running statistics with "
                          "normkit.update_bn_stats(model, train_loader) (exact population "
                          "statistics of the training data); if this batch is preprocessed "
                          "differently from the training data, fix the preprocessing instead "
                          f"({_ARTICLE_BN_LN} §5.2: a sudden drop of validation accuracy "
                          "points to BN's running statistics)")
            found.append(("stale-running-stats", message, remedy))
    gamma = call.gamma
    if gamma is not None and gamma.max_abs == 0.0:
        # (exactly 0 everywhere: an initialization, not something training arrives at;
        # gamma still gets its gradient, so nothing is stuck)
        found.append(("zero-init-gamma",
                      "every gamma value is exactly 0: the layer outputs beta, as the "
                      "zero-initialized last norm of a residual branch does "
                      "before training (Goyal et al. 2017; torchvision's "
                      "zero_init_residual=True, timm's default zero_init_last), so each "
                      "block starts as the identity; gamma still gets its gradient",
                      "nothing to do for a zero-init-residual model; elsewhere, initialize "
                      f"gamma = 1, beta = 0 ({_ARTICLE_BN_LN} §5.1)"))
    elif gamma is not None and gamma.collapsed:
        found.append(("collapsed-gamma",
                      f"{gamma.collapsed} of {gamma.numel} gamma values have |gamma| < "
                      f"{COLLAPSED_GAMMA:g} (min |gamma| {gamma.min_abs:.3g}): those channels "
                      "output beta whatever the input; intended only for the zero-initialized "
                      "last norm of a residual block",
                      f"initialize gamma = 1, beta = 0 ({_ARTICLE_BN_LN} §5.1: "
                      "nn.init.ones_(layer.weight), nn.init.zeros_(layer.bias)); if training "
                      "drove gamma to zero, check weight decay on norm parameters and the "
                      "learning rate"))
    # (exactly 1, the last batch's statistics, is deliberate -- precise-BN code sets it --
    # and no Keras momentum is 1)
    momentum = call.momentum
    if (call.family in _BATCH_FAMILIES and isinstance(momentum, (int, float))
            and 0.5 < momentum < 1
            and getattr(call.module, "running_mean", None) is not None):
        kept = 1.0 - momentum
        found.append(("momentum-convention",
                      f"momentum={momentum:g}: in PyTorch's convention each batch weighs "
                      f"{momentum:.0%} in the running statistics and their past {kept:.0%}, "
                      "so they follow the last few batches and inference sees their noise; "
                      f"{momentum:g} is a Keras/Flax momentum (the weight of the past), "
                      f"which is PyTorch's {kept:.3g} ({_ARTICLE_BN_LN} §5.3)",
                      f"build the layers with momentum={kept:.3g} (normkit.conventions."
                      f"momentum({momentum:g}, 'keras', 'torch')); to repair a trained "
                      "model's statistics, normkit.update_bn_stats re-estimates them"))
    if (call.family in _BATCH_FAMILIES and call.module.training and call.momentum is None
            and getattr(call.module, "running_mean", None) is not None):
        found.append(("cumulative-momentum",
                      "momentum=None: the running statistics are a cumulative average over "
                      "every batch seen, so batches from early, long-gone weights weigh as "
                      "much as recent ones",
                      "train with momentum=0.1; for a one-off re-estimation use "
                      "normkit.update_bn_stats, which computes the exact pooled statistics"))
    if (call.family in _BATCH_FAMILIES and not call.module.training
            and call.statistics == "batch"):
        found.append(("batch-stats-in-eval",
                      "BatchNorm without running statistics (track_running_stats=False) "
                      "uses batch statistics in eval too: predictions depend on which "
                      "samples share the batch",
                      "build it with track_running_stats=True and fill the statistics with "
                      "normkit.update_bn_stats, or use a per-sample norm (GroupNorm, "
                      "LayerNorm)"))
    return found


def _snapshot(model: nn.Module) -> list[tuple[nn.Module, str, Tensor, Tensor | None]]:
    saved = []
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            lazy = nn.parameter.is_lazy(buffer)
            saved.append((module, name, buffer, None if lazy else buffer.detach().clone()))
    return saved


def _restore(saved) -> None:
    with torch.no_grad():
        for module, name, buffer, copy in saved:
            setattr(module, name, buffer)
            if copy is not None:
                buffer.copy_(copy)


def _infer_batch_size(model: nn.Module, architecture: str, example_batch) -> int | None:
    x = _first_tensor(example_batch)
    if x is None or x.dim() == 0:
        return None
    size = x.shape[0]
    if architecture in ("rnn", "lstm", "gru", "transformer") and x.dim() >= 3:
        for module in model.modules():  # (L, N, *) layout unless batch_first
            if (isinstance(module, (nn.RNNBase, LayerNormLSTM, nn.MultiheadAttention))
                    and hasattr(module, "batch_first")):
                if not module.batch_first:
                    size = x.shape[1]
                break
    return int(size) if size > 0 else None


def _merge(findings: list[tuple[int, Finding]]) -> list[Finding]:
    """One finding per (layer, code); one per model-wide code; the first NaN input only."""
    seen: dict[tuple[str, str], Finding] = {}
    order: dict[tuple[str, str], int] = {}
    for position, f in findings:
        key = (f.layer, f.code)
        if key not in seen:
            seen[key], order[key] = f, position
    merged: list[tuple[int, Finding]] = []
    grouped: dict[str, list[tuple[int, Finding]]] = {}
    for key, f in seen.items():
        if f.code in _MODEL_WIDE or f.code == "nonfinite-input":
            grouped.setdefault(f.code, []).append((order[key], f))
        else:
            merged.append((order[key], f))
    for code, items in grouped.items():
        items.sort(key=lambda item: item[0])
        first = items[0][1]
        layers = tuple(f.layer for _, f in items)
        message = first.message
        if len(items) > 1 and code == "nonfinite-input":
            message += (f" ({len(items)} norm layers received NaN/Inf; this is the first: "
                        "look before it)")
        merged.append((items[0][0], Finding(first.layer, code, first.severity, message,
                                            first.remedy, layers)))
    merged.sort(key=lambda item: (_SEVERITY_ORDER[item[1].severity], item[0]))
    return [f for _, f in merged]


def _pool(first: TensorStats | None, later: TensorStats | None) -> TensorStats | None:
    return later if first is None else first.pooled(later)


class _Run:
    """The hooks of one doctor run and what they collect."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {module: name for name, module in model.named_modules()}
        self.stack: list[nn.Module] = []
        self.pending: dict[nn.Module, list[_Call]] = {}
        self.layers: dict[nn.Module, LayerReport] = {}
        self.findings: list[tuple[int, Finding]] = []
        self.position = 0
        self.outer_grad = torch.is_grad_enabled()

    # error tracking: which module is running
    def enter(self, module, args, kwargs) -> None:
        if not self.stack:  # the outermost module: the autograd mode the model runs in
            self.outer_grad = torch.is_grad_enabled()
        self.stack.append(module)

    def leave(self, module, args, kwargs, output) -> None:
        while self.stack:  # modules above it raised and were caught inside its forward
            if self.stack.pop() is module:
                break

    # analysis of norm layers
    def before(self, module, args, kwargs) -> None:
        x = _first_tensor((args, kwargs))
        if x is None or not x.is_floating_point():
            return
        sequences = None
        if x.is_nested:  # (sequences of tokens: measured as the tokens a norm sees)
            tokens = _tokens(x)
            if tokens is None:
                return
            x, sequences = tokens
        family, kind = _kind(module)
        try:
            # (autograd off inside reentrant checkpointing of a model run with it on:
            # the segment reruns with it in backward)
            grad = torch.is_grad_enabled() or (self.outer_grad
                                               and _inside_reentrant_checkpoint())
            call = _measure(self.names[module], module, family, kind, x, grad, sequences)
        except Exception as exc:  # the doctor must never break the model's run
            self._add(self.names[module], "analysis-failed",
                      f"could not measure the input {list(x.shape)}: "
                      f"{type(exc).__name__}: {exc}", "please report this as a normkit bug")
            return
        self.pending.setdefault(module, []).append(call)

    def after(self, module, args, kwargs, output) -> None:
        calls = self.pending.get(module)
        if not calls:
            return
        call = calls.pop()
        y = _first_tensor(output)
        if y is not None and y.is_nested:
            tokens = _tokens(y)
            y = None if tokens is None else tokens[0]
        try:
            with torch.no_grad():
                stats = (TensorStats.of(y, call.axis)
                         if y is not None and y.is_floating_point() else None)
        except Exception as exc:
            stats = None
            self._add(call.name, "analysis-failed", f"could not measure the output: "
                      f"{type(exc).__name__}: {exc}", "please report this as a normkit bug")
        self._finish(call, stats)

    def finish_pending(self) -> None:
        """Layers that raised: report what their input looked like."""
        for calls in self.pending.values():
            while calls:
                self._finish(calls.pop(), None)

    def _finish(self, call: _Call, output: TensorStats | None) -> None:
        existing = self.layers.get(call.module)
        if existing is None:
            self.layers[call.module] = LayerReport(
                call.name, type(call.module).__name__, call.family, call.mode,
                call.statistics, call.grad_enabled, 1, call.input_shape, call.values,
                call.input, output, call.running, call.gamma)
        else:
            self.layers[call.module] = replace(
                existing, calls=existing.calls + 1,
                input=_pool(existing.input, call.input), output=_pool(existing.output, output))
        for code, message, remedy in _diagnose(call, output):
            self._add(call.name, code, message, remedy)

    def _add(self, layer: str, code: str, message: str, remedy: str) -> None:
        self.findings.append((self.position, Finding(layer, code, CODES[code][0], message,
                                                     remedy)))
        self.position += 1


def doctor(
    model: nn.Module,
    example_batch,
    *,
    forward: Callable[[nn.Module, object], object] | None = None,
    architecture: str | None = None,
) -> DoctorReport:
    """Run ``model`` once on ``example_batch`` and diagnose its normalization layers.

    Every normalization layer (see :func:`norm_family`) is hooked; the report holds a
    :class:`LayerReport` per layer, :class:`Finding` warnings with remedies, and a
    :func:`~normkit.tools.recommend.recommend`-ation for the architecture (given, or
    :func:`infer_architecture`) at the batch size of the example batch (its first
    tensor's first dim; the second for sequence models that are not ``batch_first``).

    The model runs as it is: in its own train/eval mode and in the caller's autograd
    mode, which is how ``train-under-no-grad`` (validation in train mode) is detected.
    It is left as it was: every buffer (running statistics, ``num_batches_tracked``) is
    snapshot before the run and restored after, and so is every module's mode.
    Parameters are not copied (a forward does not change them). If the model raises,
    the exception is caught and ``report.error`` names the module that was running.

    Warnings (codes of :data:`CODES`; thresholds are module constants):

    * ``few-values``: BatchNorm with batch statistics over fewer than
      :data:`FEW_VALUES` values per channel; ``small-batch``: BatchNorm training on
      fewer than :data:`SMALL_BATCH` samples (Wu & He 2018; 《深度学习归一化技术：BN与LN原理
      及应用对比》 §2.3).
    * ``train-under-no-grad``: BatchNorm in train mode while autograd is off, i.e.
      validation in train mode (the same article, §5.2: validate in eval mode).
    * ``stale-running-stats``: in eval, running statistics far from this batch's
      (:data:`STALE_SHIFT`, :data:`STALE_VAR_RATIO`) → :func:`normkit.update_bn_stats`
      (§5.2: a drop of validation accuracy points to the running statistics).
    * ``nonfinite-input`` / ``nonfinite-output`` / ``invalid-state``: NaN or Inf.
    * ``collapsed-gamma``: ``|gamma| <`` :data:`COLLAPSED_GAMMA` (§5.1: gamma = 1, beta = 0);
      every gamma exactly 0 is ``zero-init-gamma`` instead (info: the zero-init-residual
      start of torchvision's and timm's ResNets).
    * ``own-norm-layers``: norm layers of the model's own classes (Hugging Face's
      ``LlamaRMSNorm``, :func:`normkit._surgery.is_own_norm`) are reported and checked for
      NaN/Inf only; their values per statistic and gamma are left out (unknown).
    * ``momentum-convention``: BatchNorm momentum in (0.5, 1), a Keras/Flax momentum (the
      weight of the past) given to PyTorch (where it is the weight of the new batch):
      《深度学习归一化技术：BN与LN原理及应用对比》 §5.3: TensorFlow's momentum means
      about 1 - PyTorch's; :mod:`normkit.conventions`.
    * ``cumulative-momentum``, ``batch-stats-in-eval``, ``no-norm-layers``: information.

    Args:
        model: the model (any ``nn.Module``).
        example_batch: what the model runs on: a tensor, a tuple/list (first element
            is the input) or a mapping of keyword arguments, as for
            :func:`normkit.update_bn_stats`.
        forward: ``forward(model, example_batch)`` runs the model. Default:
            :func:`normkit.tools.precise.default_forward`.
        architecture: one of :data:`normkit.tools.recommend.ARCHITECTURES`, for the
            recommendation. Default: inferred.

    Returns:
        A :class:`DoctorReport`.

    Example:
        >>> import torch, normkit
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), normkit.BatchNorm1d(8)).eval()
        >>> with torch.no_grad():
        ...     report = doctor(net, torch.randn(64, 4) * 3 + 5)
        >>> [w.code for w in report.warnings]
        ['stale-running-stats']
        >>> "normkit.update_bn_stats" in report.warnings[0].remedy
        True
        >>> _ = normkit.update_bn_stats(net, [torch.randn(64, 4) * 3 + 5])
        >>> doctor(net, torch.randn(64, 4) * 3 + 5).warnings
        []
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"doctor expected a torch.nn.Module, got {type(model).__name__}")
    if forward is not None and not callable(forward):
        raise TypeError(f"forward must be callable as forward(model, batch) or None, got "
                        f"{type(forward).__name__}")
    arch = infer_architecture(model) if architecture is None else _canonical_architecture(
        architecture)
    forward = default_forward if forward is None else forward
    run = _Run(model)
    norms = [module for module in run.names if _kind(module) is not None]
    grad_enabled = torch.is_grad_enabled()
    saved = _snapshot(model)
    modes = [(module, module.training) for module in model.modules()]
    handles = []
    error = None
    try:
        for module in run.names:
            handles.append(module.register_forward_pre_hook(run.enter, with_kwargs=True))
            handles.append(module.register_forward_hook(run.leave, with_kwargs=True))
        for module in norms:
            handles.append(module.register_forward_pre_hook(run.before, with_kwargs=True))
            handles.append(module.register_forward_hook(run.after, with_kwargs=True))
        try:
            forward(model, example_batch)
        except Exception as exc:
            inner = run.stack[-1] if run.stack else None
            error = ModelError(
                layer=None if inner is None else run.names[inner],
                layer_type=None if inner is None else type(inner).__name__,
                path=tuple(run.names[m] for m in run.stack),
                exception=type(exc).__name__, message=str(exc),
                traceback="".join(traceback.format_exception(type(exc), exc,
                                                             exc.__traceback__)))
            run.finish_pending()
    finally:
        for handle in handles:
            handle.remove()
        _restore(saved)
        for module, training in modes:
            module.training = training
    own = [layer for layer in run.layers.values() if layer.family == "own"]
    if own:
        classes: dict[str, int] = {}
        for layer in own:
            classes[layer.type] = classes.get(layer.type, 0) + 1
        listed = ", ".join(f"{count} {name}" for name, count in sorted(classes.items()))
        for layer in own:
            run._add(layer.name, "own-norm-layers",
                     f"{len(own)} norm layer(s) of the model's own classes ({listed}): the "
                     "doctor reports their input and output and checks them for NaN/Inf, "
                     "but cannot know how they compute their statistics or use their weight "
                     "(Gemma's RMSNorm scales by 1 + weight), so it checks neither gamma nor "
                     "batch statistics there",
                     "build those layers from normkit's classes (normkit.RMSNorm, "
                     "normkit.LayerNorm, normkit.LayerNorm2d, ... take torch's arguments; "
                     "keep their eps; a norm that scales by 1 + weight, as Gemma's, loads weight + "
                     "1) for every check")
    if not norms:
        standardized = _weight_standardized(model)
        if standardized:
            run._add("", "no-norm-layers",
                     f"the model has no normalization layer, and {standardized} layer(s) "
                     "with weight standardization: a normalizer-free network (NF-Nets, "
                     "Brock et al. 2021), which keeps its activations' scale without norm "
                     "layers when the standardization is scaled (gamma=)",
                     "train it with adaptive gradient clipping (normkit.AGC); the "
                     "recommendation below is for a network with norm layers")
        else:
            run._add("", "no-norm-layers",
                     "the model has no normalization layer the doctor recognizes (torch or "
                     "normkit BatchNorm, SyncBatchNorm, BatchRenorm, FrozenBatchNorm, "
                     "MeanOnlyBatchNorm, LayerNorm, LayerNorm2d, RMSNorm, GroupNorm, "
                     "InstanceNorm, PowerNorm)",
                     "see the recommendation for which normalization suits this model")
    batch_size = _infer_batch_size(model, arch, example_batch)
    recommendation = None
    if batch_size is not None:
        distributed = dist.is_available() and dist.is_initialized()
        # (running statistics stored in float16: the recommendation's float16 caution)
        half = any(isinstance(t := m._buffers.get(name), Tensor) and t.dtype == torch.float16
                   for m in model.modules() for name in _STATISTICS)
        recommendation = recommend(arch, batch_size, distributed=distributed,
                                   world_size=dist.get_world_size() if distributed else None,
                                   dtype=torch.float16 if half else None)
    return DoctorReport(
        model=type(model).__name__, architecture=arch, batch_size=batch_size,
        grad_enabled=grad_enabled, layers=list(run.layers.values()),
        warnings=_merge(run.findings), recommendation=recommendation, error=error)
