"""The grid of layers the tests sweep: one entry per family and input rank."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import normkit
from normkit.norms import _core

#: (major, minor) of the torch under test: a few tests exercise what older releases that
#: ``torch>=2.4`` admits lack (.ci/versions runs the suite under them).
TORCH_RELEASE = _core.TORCH_RELEASE
#: torch 2.4 and 2.5's jagged layout: only (B, j, D...) tensors can be built, torch's own
#: nested rms_norm fails (2.4 has none; 2.5's calls aten.size, which jagged tensors refuse),
#: unbind's backward fails on narrowed sequences (2.5: "invalid gradient ... [3, j2, 4]")
#: and torch.compile of a block on them loses its parameter gradients (2.5, with
#: torch.nn's own LayerNorm too; 2.4: no Dynamo at all). Each checked without normkit.
OLD_JAGGED = pytest.mark.skipif(TORCH_RELEASE < (2, 6), reason=(
    "torch 2.4-2.5's jagged nested tensors: only (B, j, D...) shapes can be built, torch's "
    "own rms_norm and torch.compile fail on them, unbind() of narrowed sequences has no "
    "working backward (passes on 2.6 and later)"))

#: BatchRenorm under torch.compile(fullgraph=True) on torch 2.5-2.10: Dynamo cannot read
#: its step count, and the tensor limits torch 2.4 gets made wrong gradients under 2.8's
#: Inductor (normkit.norms.batch._DYNAMO_CANNOT_READ_STEP).
RENORM_FULLGRAPH_GAP = (2, 5) <= TORCH_RELEASE < (2, 11)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[..., nn.Module]          # make(affine: bool) -> normkit module
    torch_cls: Callable[..., nn.Module] | None  # same constructor, torch.nn class
    shape: tuple[int, ...]
    args: tuple = ()

    def build(self, affine: bool = True, **kwargs) -> tuple[nn.Module, nn.Module | None]:
        """A normkit module with non-trivial parameters/buffers, and its torch twin."""
        nk = self.make(*self.args, **affine_kwargs(self.make, affine), **kwargs)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in nk.named_parameters():
                if name.endswith("weight"):
                    p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen))
            if getattr(nk, "running_mean", None) is not None:
                nk.running_mean.copy_(torch.randn(nk.running_mean.shape, generator=gen) * 0.2)
                nk.running_var.copy_(torch.rand(nk.running_var.shape, generator=gen) + 0.5)
        if self.torch_cls is None:
            return nk, None
        tm = self.torch_cls(*self.args, **affine_kwargs(self.torch_cls, affine), **kwargs)
        tm.load_state_dict(nk.state_dict())
        return nk, tm


def affine_kwargs(cls, affine: bool) -> dict:
    if isinstance(cls, type) and issubclass(cls, (nn.LayerNorm, nn.RMSNorm)):
        return {"elementwise_affine": affine}
    return {"affine": affine}


CASES = [
    Case("BatchNorm1d-2D", normkit.BatchNorm1d, nn.BatchNorm1d, (9, 6), (6,)),
    Case("BatchNorm1d-3D", normkit.BatchNorm1d, nn.BatchNorm1d, (5, 6, 7), (6,)),
    Case("BatchNorm2d", normkit.BatchNorm2d, nn.BatchNorm2d, (5, 6, 3, 7), (6,)),
    Case("BatchNorm3d", normkit.BatchNorm3d, nn.BatchNorm3d, (3, 6, 2, 3, 5), (6,)),
    Case("LayerNorm", normkit.LayerNorm, nn.LayerNorm, (5, 6, 3, 7), ((3, 7),)),
    Case("RMSNorm", normkit.RMSNorm, nn.RMSNorm, (5, 6, 3, 7), ((7,),)),
    Case("GroupNorm", normkit.GroupNorm, nn.GroupNorm, (5, 6, 3, 7), (3, 6)),
    Case("GroupNorm-2D", normkit.GroupNorm, nn.GroupNorm, (7, 6), (2, 6)),
    Case("GroupNorm-1-per-group", normkit.GroupNorm, nn.GroupNorm, (4, 6, 1, 1), (6, 6)),
    Case("InstanceNorm1d", normkit.InstanceNorm1d, nn.InstanceNorm1d, (5, 6, 7), (6,)),
    Case("InstanceNorm2d", normkit.InstanceNorm2d, nn.InstanceNorm2d, (5, 6, 3, 7), (6,)),
    Case("InstanceNorm3d", normkit.InstanceNorm3d, nn.InstanceNorm3d, (3, 6, 2, 3, 5), (6,)),
    Case("LayerNorm2d", normkit.LayerNorm2d, None, (5, 6, 3, 7), (6,)),
]
CASE_IDS = [c.name for c in CASES]

#: Every image (per-channel) layer class, built for ``c`` channels (groups of 4 channels
#: where the layer has groups): the suites that sweep each layer once take it from here.
IMAGE_LAYERS: dict[str, Callable[[int], nn.Module]] = {
    "BatchNorm2d": lambda c: normkit.BatchNorm2d(c),
    "BatchNormAct2d": lambda c: normkit.BatchNormAct2d(c, act="silu"),
    "BatchRenorm2d": lambda c: normkit.BatchRenorm2d(c),
    "FrozenBatchNorm2d": lambda c: normkit.FrozenBatchNorm2d(c),
    "MeanOnlyBatchNorm2d": lambda c: normkit.MeanOnlyBatchNorm2d(c),
    "GroupNorm": lambda c: normkit.GroupNorm(max(1, c // 4), c),
    "GroupNormAct": lambda c: normkit.GroupNormAct(max(1, c // 4), c, act="silu"),
    "InstanceNorm2d": lambda c: normkit.InstanceNorm2d(c, affine=True),
    "LayerNorm2d": lambda c: normkit.LayerNorm2d(c),
}

LAYOUTS = ["contiguous", "channels_last", "noncontiguous"]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def make_input(shape, dtype, layout, *, seed=0, offset=0.0, scale=1.0):
    """A random input with the given layout; ``None`` when the layout does not apply."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "noncontiguous":
        big = torch.randn(*shape[:-1], shape[-1] * 2, generator=gen, dtype=torch.float64)
        x = (big * scale + offset).to(dtype)[..., ::2]
        assert not x.is_contiguous()
        return x
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)
    if layout == "channels_last":
        if x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        if x.dim() == 5:
            return x.contiguous(memory_format=torch.channels_last_3d)
        return None
    return x


def memory_format_of(x):
    """channels_last(_3d) when ``x`` is laid out so (and not also plainly contiguous)."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def float64_twin(module):
    """A float64 deep copy whose parameters collect reference gradients."""
    return copy.deepcopy(module).double()
