"""What ``normkit bench`` measures: the ops, their torch baselines, shapes and ideal traffic.

Every op pairs a normkit module with the torch module a user would otherwise write
(``torch.nn.LayerNorm``; for what torch lacks, the natural composition: permute +
LayerNorm + permute for ``layer_norm2d``, ``x + residual`` then the norm for the
fused residual ops). Fused ops (``normkit.norms.fused``) are looked up when the
harness runs, so the harness works before, and without, them.

Ideal bytes
-----------
A normalization is memory-bound: its cost is the bytes it moves. The ideal bytes of
a pass are the compulsory traffic of a kernel that touches every tensor once, with
``X`` = one activation-sized tensor (``numel * itemsize``) and ``P`` = the parameter
bytes (``weight`` and ``bias``)::

    op                                          fwd        fwd+bwd
    layer_norm, rms_norm, batch_norm,           2X + P     5X + 3P
      group_norm, instance_norm, layer_norm2d,
      batch_norm_act(_inplace), group_norm_act
    batch_norm_eval, instance_norm_eval,        2X + P     4X + 3P
      frozen_batch_norm
    add_layer_norm, add_rms_norm                4X + P     8X + 3P

The forward reads ``x``, writes ``y`` and reads the parameters; the backward reads
``x`` (or ``y``), reads ``dy``, writes ``dx``, reads the parameters and writes their
gradients (inference BatchNorm's backward, a per-channel scaling, needs no ``x``). The
add ops read ``x`` and ``residual`` and write ``y`` and
``s = x + residual``; their backward reads ``s`` and both output gradients and writes
the one gradient both inputs share.

Per-group statistics (a few bytes per row, group or channel) and BatchNorm's running
buffers are left out. BatchNorm's statistics span the whole batch, so a kernel on a
tensor larger than the cache reads ``x`` twice in the forward and cannot reach 100% of
the copy bandwidth by this measure: the yardstick is the same for every op and every
implementation, not a per-algorithm bound.

Example:
    >>> op = get_op("layer_norm")
    >>> op.ideal_bytes((4096, 1024), "fwd", itemsize=4)   # 2 * 16 MiB + 2 * 4 KiB
    33562624
    >>> [s.label for s in parse_shapes("4096x1024,32x64x56x56:cl")]
    ['4096x1024', '32x64x56x56 channels_last']
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..registry import default_num_groups

__all__ = [
    "PASSES", "ROWS", "IMAGE", "Op", "OpUnavailable", "Shape", "External", "OPS", "EXTERNALS",
    "SHAPE_SETS", "get_op", "op_names", "parse_shapes", "AddThenNorm", "PermutedLayerNorm",
    "TorchFrozenBatchNorm",
]

#: The timed passes: a no-grad forward, and a forward then backward to every input and
#: parameter.
PASSES = ("fwd", "fwd+bwd")
#: Op kinds: ``rows`` normalize the last dim of ``(M, D)`` (or ``(B, T, D)``) input,
#: ``image`` ops take ``(N, C, H, W)`` input, NCHW or channels_last.
ROWS, IMAGE = "rows", "image"

Dims = tuple[int, ...]


class OpUnavailable(LookupError):
    """The op's normkit implementation does not exist in this installation."""


class PermutedLayerNorm(nn.Module):
    """torch's LayerNorm over the channels of ``(N, C, H, W)``: permute, LayerNorm, permute.

    The baseline of ``normkit.LayerNorm2d`` (what timm's ``LayerNorm2d`` does).

    Example:
        >>> PermutedLayerNorm(3)(torch.randn(2, 3, 4, 5)).shape
        torch.Size([2, 3, 4, 5])
    """

    def __init__(self, num_channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(num_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class TorchFrozenBatchNorm(nn.Module):
    """BatchNorm with fixed statistics and affine, all buffers, on torch's inference kernel.

    The baseline of ``normkit.FrozenBatchNorm2d``: what detectron2's ``FrozenBatchNorm2d``
    runs (``F.batch_norm`` with ``training=False``).

    Example:
        >>> frozen = TorchFrozenBatchNorm(3)
        >>> frozen(torch.zeros(2, 3, 4, 4)).abs().max().item(), list(frozen.parameters())
        (0.0, [])
    """

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0),
                           ("running_var", 1.0)):
            self.register_buffer(name, torch.full((num_features,), fill))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                        self.bias, training=False, eps=self.eps)


class AddThenNorm(nn.Module):
    """``s = x + residual``, then ``norm(s)``: returns ``(norm(s), s)`` as a pre-norm block does.

    The baseline of the fused residual ops (``AddLayerNorm``, ``AddRMSNorm``).

    Example:
        >>> y, s = AddThenNorm(nn.RMSNorm(4))(torch.ones(2, 4), torch.ones(2, 4))
        >>> s[0].tolist(), y.shape
        ([2.0, 2.0, 2.0, 2.0], torch.Size([2, 4]))
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = x + residual
        return self.norm(s), s


def _features(dims: Dims) -> int:
    return dims[-1]


def _channels(dims: Dims) -> int:
    return dims[1]


def _groups(dims: Dims) -> int:
    return default_num_groups(dims[1])


def _trained(norm: nn.Module) -> nn.Module:
    """``norm`` (a BatchNorm or InstanceNorm with running buffers) with the running
    statistics of a trained network (a fixed draw: means of spread 0.5, variances 0.5 to
    1.5), the same for normkit's module and torch's."""
    gen = torch.Generator().manual_seed(0)
    c = norm.running_mean.numel()
    with torch.no_grad():
        norm.running_mean.copy_(0.5 * torch.randn(c, generator=gen))
        norm.running_var.copy_(0.5 + torch.rand(c, generator=gen))
    return norm


@dataclass(frozen=True)
class Op:
    """One benchmarked op: how to build normkit's module and torch's, and its traffic.

    Args:
        name: the op's name on the command line (``layer_norm``).
        kind: :data:`ROWS` or :data:`IMAGE` (which shapes it runs on).
        symbol: the normkit class: an attribute of ``normkit`` (core ops) or of
            ``normkit.norms.fused`` (``fused=True``; also looked up on ``normkit``).
        build: ``build(cls, dims)`` -> the normkit module.
        baseline: ``baseline(dims)`` -> the torch eager module.
        baseline_doc: what the baseline is, for the reports.
        params: ``params(dims)`` -> the number of parameter elements.
        fused: the class lives in ``normkit.norms.fused`` and may be absent.
        inputs: activation-sized inputs (``x``, and ``residual`` for the add ops).
        outputs: activation-sized outputs (the add ops also return ``x + residual``).
        fwd_streams: activation-sized tensors an ideal forward reads or writes.
        bwd_streams: the same for the backward alone.
        training: the modules run in training mode (``False``: eval mode, each built
            with the same running statistics).

    Example:
        >>> op = get_op("group_norm")
        >>> type(op.build(op.resolve(), (2, 8, 4, 4))).__name__, op.params((2, 8, 4, 4))
        ('GroupNorm', 16)
        >>> type(op.baseline((2, 8, 4, 4))).__module__
        'torch.nn.modules.normalization'
    """

    name: str
    kind: str
    symbol: str
    build: Callable[[type, Dims], nn.Module]
    baseline: Callable[[Dims], nn.Module]
    baseline_doc: str
    params: Callable[[Dims], int]
    fused: bool = False
    inputs: int = 1
    outputs: int = 1
    fwd_streams: int = 2
    bwd_streams: int = 3
    training: bool = True

    @property
    def normkit_doc(self) -> str:
        """Where the normkit class is looked up, e.g. ``normkit.LayerNorm``."""
        return f"normkit.norms.fused.{self.symbol}" if self.fused else f"normkit.{self.symbol}"

    def resolve(self) -> type:
        """The normkit class, or :class:`OpUnavailable` saying why there is none.

        Example:
            >>> get_op("layer_norm").resolve().__name__
            'LayerNorm'
        """
        import normkit

        if not self.fused:
            return getattr(normkit, self.symbol)
        try:
            fused = importlib.import_module("normkit.norms.fused")
        except ModuleNotFoundError as error:
            if error.name != "normkit.norms.fused":
                raise OpUnavailable(f"normkit.norms.fused failed to import: {error}") from error
            fused = None
        except Exception as error:  # a broken module: report it, keep benchmarking the rest
            raise OpUnavailable(f"normkit.norms.fused failed to import: "
                                f"{type(error).__name__}: {error}") from error
        cls = getattr(fused, self.symbol, None) or getattr(normkit, self.symbol, None)
        if cls is None:
            where = "has no" if fused is not None else "does not exist yet, so no"
            raise OpUnavailable(f"normkit.norms.fused {where} {self.symbol}")
        return cls

    def available(self) -> str | None:
        """``None`` when the op can run here, else the reason it cannot.

        Example:
            >>> get_op("rms_norm").available() is None
            True
        """
        try:
            self.resolve()
        except OpUnavailable as error:
            return str(error)
        return None

    def ideal_bytes(self, dims: Dims, pass_: str, itemsize: int,
                    param_itemsize: int | None = None) -> int:
        """Bytes an ideal kernel must move for one pass (see the module docstring).

        Example:
            >>> op = get_op("rms_norm")
            >>> x, p = 4096 * 1024 * 4, 1024 * 4
            >>> op.ideal_bytes((4096, 1024), "fwd+bwd", 4) == 5 * x + 3 * p
            True
        """
        if pass_ not in PASSES:
            raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
        activation = math.prod(dims) * itemsize
        params = self.params(dims) * (itemsize if param_itemsize is None else param_itemsize)
        if pass_ == "fwd":
            return self.fwd_streams * activation + params
        return (self.fwd_streams + self.bwd_streams) * activation + 3 * params


OPS: tuple[Op, ...] = (
    Op("layer_norm", ROWS, "LayerNorm", lambda cls, d: cls(_features(d)),
       lambda d: nn.LayerNorm(_features(d)), "torch.nn.LayerNorm",
       lambda d: 2 * _features(d)),
    Op("rms_norm", ROWS, "RMSNorm", lambda cls, d: cls(_features(d)),
       lambda d: nn.RMSNorm(_features(d)), "torch.nn.RMSNorm", _features),
    Op("batch_norm", IMAGE, "BatchNorm2d", lambda cls, d: cls(_channels(d)),
       lambda d: nn.BatchNorm2d(_channels(d)), "torch.nn.BatchNorm2d (train)",
       lambda d: 2 * _channels(d)),
    Op("batch_norm_eval", IMAGE, "BatchNorm2d", lambda cls, d: _trained(cls(_channels(d))),
       lambda d: _trained(nn.BatchNorm2d(_channels(d))), "torch.nn.BatchNorm2d (eval)",
       lambda d: 2 * _channels(d), bwd_streams=2, training=False),
    Op("frozen_batch_norm", IMAGE, "FrozenBatchNorm2d",
       lambda cls, d: _trained(cls(_channels(d))),
       lambda d: _trained(TorchFrozenBatchNorm(_channels(d))),
       "F.batch_norm(training=False) on buffers (detectron2's FrozenBatchNorm2d)",
       lambda d: 0, bwd_streams=2, training=False),
    # the Keras/Flax convention (normkit.conventions): the same forward, the biased batch
    # variance into running_var, which torch's kernel cannot store
    Op("batch_norm_biased_var", IMAGE, "BatchNorm2d",
       lambda cls, d: cls(_channels(d), unbiased_running_var=False),
       lambda d: nn.BatchNorm2d(_channels(d)),
       "torch.nn.BatchNorm2d (train): it stores the unbiased variance; normkit's with "
       "unbiased_running_var=False (Keras/Flax)", lambda d: 2 * _channels(d)),
    # past the warm-up (r_max = 3, d_max = 5 from the first step): the renormalizing
    # regime; during the warm-up (r_max = 1, d_max = 0) BatchRenorm is BatchNorm's path
    Op("batch_renorm", IMAGE, "BatchRenorm2d",
       lambda cls, d: cls(_channels(d), warmup_steps=0, r_max_steps=0, d_max_steps=0),
       lambda d: nn.BatchNorm2d(_channels(d)),
       "torch.nn.BatchNorm2d (train): torch has no Batch Renormalization; normkit's "
       "past its warm-up (r_max = 3, d_max = 5)",
       lambda d: 2 * _channels(d)),
    # tokens x channels; past the warm-up (the running statistic in the forward); against
    # the layer it replaces in a Transformer
    Op("power_norm", ROWS, "PowerNorm", lambda cls, d: cls(_features(d), warmup_iters=0),
       lambda d: nn.LayerNorm(_features(d)),
       "torch.nn.LayerNorm: torch has no PowerNorm, the layer it replaces in a Transformer; "
       "normkit's past its warm-up, group scaling over 1 group",
       lambda d: 2 * _features(d)),
    Op("group_norm", IMAGE, "GroupNorm", lambda cls, d: cls(_groups(d), _channels(d)),
       lambda d: nn.GroupNorm(_groups(d), _channels(d)),
       "torch.nn.GroupNorm (32 groups, or the largest divisor of C below)",
       lambda d: 2 * _channels(d)),
    Op("instance_norm", IMAGE, "InstanceNorm2d", lambda cls, d: cls(_channels(d)),
       lambda d: nn.InstanceNorm2d(_channels(d)), "torch.nn.InstanceNorm2d (no affine)",
       lambda d: 0),
    Op("instance_norm_eval", IMAGE, "InstanceNorm2d",
       lambda cls, d: _trained(cls(_channels(d), affine=True, track_running_stats=True)),
       lambda d: _trained(nn.InstanceNorm2d(_channels(d), affine=True,
                                            track_running_stats=True)),
       "torch.nn.InstanceNorm2d (affine, running statistics, eval)",
       lambda d: 2 * _channels(d), bwd_streams=2, training=False),
    Op("layer_norm2d", IMAGE, "LayerNorm2d", lambda cls, d: cls(_channels(d)),
       lambda d: PermutedLayerNorm(_channels(d)), "permute + torch.nn.LayerNorm + permute",
       lambda d: 2 * _channels(d)),
    Op("add_layer_norm", ROWS, "AddLayerNorm", lambda cls, d: cls(_features(d)),
       lambda d: AddThenNorm(nn.LayerNorm(_features(d))), "x + residual, then torch.nn.LayerNorm",
       lambda d: 2 * _features(d), fused=True, inputs=2, outputs=2, fwd_streams=4,
       bwd_streams=4),
    Op("add_rms_norm", ROWS, "AddRMSNorm", lambda cls, d: cls(_features(d)),
       lambda d: AddThenNorm(nn.RMSNorm(_features(d))), "x + residual, then torch.nn.RMSNorm",
       _features, fused=True, inputs=2, outputs=2, fwd_streams=4, bwd_streams=4),
    Op("batch_norm_act", IMAGE, "BatchNormAct2d",
       lambda cls, d: cls(num_features=_channels(d), act="relu"),
       lambda d: nn.Sequential(nn.BatchNorm2d(_channels(d)), nn.ReLU()),
       "torch.nn.BatchNorm2d (train) then ReLU", lambda d: 2 * _channels(d), fused=True),
    Op("batch_norm_act_inplace", IMAGE, "BatchNormAct2d",
       lambda cls, d: cls(num_features=_channels(d), act="leaky_relu", memory="inplace"),
       lambda d: nn.Sequential(nn.BatchNorm2d(_channels(d)), nn.LeakyReLU()),
       "torch.nn.BatchNorm2d (train) then LeakyReLU(0.01)", lambda d: 2 * _channels(d),
       fused=True),
    Op("group_norm_act", IMAGE, "GroupNormAct",
       lambda cls, d: cls(num_groups=_groups(d), num_channels=_channels(d), act="silu"),
       lambda d: nn.Sequential(nn.GroupNorm(_groups(d), _channels(d)), nn.SiLU()),
       "torch.nn.GroupNorm then SiLU", lambda d: 2 * _channels(d), fused=True),
)

_BY_NAME = {op.name: op for op in OPS}


def op_names() -> list[str]:
    """Every op's name, core ops first (available here or not).

    Example:
        >>> op_names()[:3]
        ['layer_norm', 'rms_norm', 'batch_norm']
    """
    return [op.name for op in OPS]


def get_op(name: str) -> Op:
    """The op called ``name`` (``KeyError`` listing the valid names otherwise).

    Example:
        >>> op = get_op("rms_norm")
        >>> op.kind, op.symbol, op.baseline_doc
        ('rows', 'RMSNorm', 'torch.nn.RMSNorm')
        >>> get_op("rms")
        Traceback (most recent call last):
        ...
        KeyError: "unknown op 'rms'; valid ops: ..."
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; valid ops: {', '.join(op_names())}") from None


@dataclass(frozen=True)
class External:
    """A third-party kernel library benchmarked beside torch where it covers an op.

    Args:
        name: the column name (``liger``, ``apex``).
        module: the module holding its classes.
        classes: op name -> (class name, ``build(cls, dims)``); a dotted class name
            (``group_norm.LigerGroupNorm``) is looked up in that submodule of ``module``.
            A class missing from the installed version, or one whose import fails (Liger
            refuses some attributes without ``transformers``), just leaves that op
            uncovered.
        needs_cuda: only runs with ``--device cuda``.
    """

    name: str
    module: str
    classes: dict[str, tuple[str, Callable[[type, Dims], nn.Module]]]
    needs_cuda: bool = True

    def status(self, device: str) -> str | None:
        """``None`` when usable on ``device``, else why not (not installed, needs CUDA...).

        Example:
            >>> External("nope", "surely_not_installed_module", {}).status("cuda")
            'not installed (no module surely_not_installed_module)'
        """
        top = self.module.partition(".")[0]
        if importlib.util.find_spec(top) is None:
            return f"not installed (no module {top})"
        if self.needs_cuda and device != "cuda":
            return "needs --device cuda"
        try:
            importlib.import_module(self.module)
        except Exception as error:
            return f"import {self.module} failed: {type(error).__name__}: {error}"
        return None

    def builder(self, op: str) -> Callable[[Dims], nn.Module] | None:
        """``build(dims)`` for ``op`` when this library covers it here, else ``None``."""
        if op not in self.classes:
            return None
        path, build = self.classes[op]
        submodule, _, class_name = path.rpartition(".")
        try:
            module = importlib.import_module(
                f"{self.module}.{submodule}" if submodule else self.module)
            cls = getattr(module, class_name, None)
        except ImportError:
            return None
        if cls is None:
            return None
        return lambda dims: build(cls, dims)


EXTERNALS: tuple[External, ...] = (
    External("liger", "liger_kernel.transformers", {
        "layer_norm": ("LigerLayerNorm", lambda cls, d: cls(_features(d), eps=1e-5, bias=True)),
        "rms_norm": ("LigerRMSNorm", lambda cls, d: cls(_features(d))),
        "add_rms_norm": ("LigerFusedAddRMSNorm", lambda cls, d: cls(_features(d))),
        # (channels, groups): Liger's order; its own module, which needs no transformers
        "group_norm": ("group_norm.LigerGroupNorm",
                       lambda cls, d: cls(_channels(d), _groups(d), eps=1e-5, bias=True)),
    }),
    External("apex", "apex.normalization", {
        "layer_norm": ("FusedLayerNorm", lambda cls, d: cls(_features(d))),
        "rms_norm": ("FusedRMSNorm", lambda cls, d: cls(_features(d))),
    }),
)


@dataclass(frozen=True)
class Shape:
    """An input shape and layout: ``(M, D)`` / ``(B, T, D)`` rows or ``(N, C, H, W)`` images.

    Example:
        >>> Shape((32, 64, 56, 56), channels_last=True).label
        '32x64x56x56 channels_last'
    """

    dims: Dims
    channels_last: bool = False

    def __post_init__(self) -> None:
        if len(self.dims) not in (2, 3, 4) or any(d < 1 for d in self.dims):
            raise ValueError(f"expected a shape of 2 or 3 dims (rows: M x D, B x T x D) or 4 "
                             f"dims (images: N x C x H x W), all >= 1, got {self.dims}")
        if self.channels_last and len(self.dims) != 4:
            raise ValueError(f"channels_last needs a 4-dim N x C x H x W shape, got {self.dims}")

    @property
    def kind(self) -> str:
        """:data:`IMAGE` for 4 dims, else :data:`ROWS`."""
        return IMAGE if len(self.dims) == 4 else ROWS

    @property
    def layout(self) -> str:
        """``channels_last`` or ``contiguous``."""
        return "channels_last" if self.channels_last else "contiguous"

    @property
    def label(self) -> str:
        text = "x".join(map(str, self.dims))
        return f"{text} channels_last" if self.channels_last else text

    @property
    def spec(self) -> str:
        """The shape in ``--shapes`` syntax."""
        text = "x".join(map(str, self.dims))
        return f"{text}:cl" if self.channels_last else text


def _images(*dims: Dims, odd: Dims | None = None) -> list[Shape]:
    shapes = [Shape(d, cl) for d in dims for cl in (False, True)]
    return shapes + ([Shape(odd), Shape(odd, True)] if odd else [])


#: Named shape sets. ``standard``: transformer rows (4096 x {768, 1024, 4096, 8192}), CNN
#: activations (NCHW and channels_last) and small, odd shapes; ``small``: a reduced set
#: for quick runs.
SHAPE_SETS: dict[str, tuple[Shape, ...]] = {
    "standard": (
        *(Shape((4096, d)) for d in (768, 1024, 4096, 8192)),
        Shape((7, 33)),
        *_images((32, 64, 56, 56), (32, 256, 14, 14), odd=(3, 5, 7, 9)),
    ),
    "small": (
        Shape((256, 1024)), Shape((7, 33)),
        *_images((8, 64, 28, 28)), Shape((3, 5, 7, 9)),
    ),
}

_LAYOUTS = {"cl": True, "channels_last": True, "nhwc": True, "nchw": False, "contiguous": False}


def parse_shapes(spec: str) -> tuple[Shape, ...]:
    """A named set (``standard``, ``small``) or ``AxB[xC[xD]][:cl],...`` as shapes.

    A 4-dim shape with the suffix ``:cl`` (or ``:channels_last``, ``:nhwc``) is laid out
    channels_last; ``:nchw`` or no suffix means contiguous.

    Example:
        >>> [s.label for s in parse_shapes("7x33, 2x3x4x5:cl")]
        ['7x33', '2x3x4x5 channels_last']
        >>> len(parse_shapes("small")) > 0
        True
    """
    if spec in SHAPE_SETS:
        return SHAPE_SETS[spec]
    shapes = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        text, _, layout = item.partition(":")
        if layout and layout.lower() not in _LAYOUTS:
            raise ValueError(f"shape {item!r}: expected a layout suffix :cl or :nchw, "
                             f"got :{layout}")
        try:
            dims = tuple(int(d) for d in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {item!r}: expected sizes joined by 'x' such as 4096x1024 "
                             f"or 32x64x56x56:cl, or a set name ({', '.join(SHAPE_SETS)})"
                             ) from None
        try:
            shapes.append(Shape(dims, _LAYOUTS.get(layout.lower(), False)))
        except ValueError as error:
            raise ValueError(f"shape {item!r}: {error}") from None
    if not shapes:
        raise ValueError(f"expected a shape set ({', '.join(SHAPE_SETS)}) or shapes such as "
                         f"4096x1024,32x64x56x56:cl, got {spec!r}")
    return tuple(shapes)
