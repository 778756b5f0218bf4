"""Numerical accuracy of normkit vs torch.nn against a float64 reference.

For each family, a float32 input with mean ``offset`` and standard deviation 1 is
normalized by normkit and by torch.nn (training-mode statistics), and both outputs
are compared with the float64 computation on the *same* float32 input; so are the
input gradients for one random upstream gradient (standard deviation 1). Prints a
Markdown table (max absolute error); ``--json`` writes the numbers.

``--counts`` measures instead what decides where torch's channels-last BatchNorm may
serve training (:data:`normkit.kernels.native.CHANNELS_LAST_MAX_COUNT`): its output error
by values per channel and ``|mean| / std``, the maximum over several seeds and all
channels, beside normkit's on the same inputs.

``--backward-counts`` measures what decides where torch's channels-last BatchNorm backward
kernel may serve (:data:`normkit.kernels.native.CHANNELS_LAST_BACKWARD_MAX_COUNT`): its
gradient errors by values per channel, beside the slice-sums engine's, from the same
accurate statistics.

``--sixteen-bit`` measures float16/bfloat16 input: torch's LayerNorm backward kernel sums
the weight and bias gradients in 16 bits, and torch's BatchNorm and GroupNorm kernels,
given 16-bit parameters, normalize with statistics rounded to 16 bits; the table gives the
output, input-gradient and weight-gradient errors of torch.nn and normkit (relative to the
largest reference value, as the tests measure gradients) by shape, parameter dtype and
offset.

``--few-values`` measures float32 first and second derivatives of layers whose statistics
pool 1 to 4 values each (``normkit._stats.FEW_VALUES``), torch.nn beside normkit, against
float64: there the input gradient is what ``eps`` leaves of cancelling terms.

``--second-order`` measures second derivatives (``create_graph=True``) of inference
BatchNorm + activation on float16/bfloat16 input, as the differential fuzz takes them
(``tests/test_dispatch_fuzz.py``): torch.nn's BatchNorm2d then the activation beside
normkit's BatchNormAct2d, each against float64 on the same input, over random cases; the
error relative to the fuzz's scale (the reference's largest magnitude, at least 1 and at
least the square root of the terms a parameter's derivative sums). What it shows sets
the tests' 16-bit tolerance for second derivatives (``tests/oracle.py``).

Run: ``python benchmarks/accuracy.py [--json FILE]``, ``python benchmarks/accuracy.py
--counts``, ``python benchmarks/accuracy.py --backward-counts``, ``python
benchmarks/accuracy.py --sixteen-bit``, ``python benchmarks/accuracy.py --second-order``
or ``python benchmarks/accuracy.py --few-values``
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from torch import nn

import normkit

#: A small input (torch's kernels under normkit's accuracy check) and one of 2^20 elements
#: (the slice-sums engine of normkit.kernels.channels and the LayerNorm2d NCHW path).
SHAPES = ((16, 32, 14, 14), (32, 32, 32, 32))
#: 1.5 sits under the slice-sums engine's |mean| / std <= 2 bound; 1e4 and 1e5 far past
#: every fast path's bound (normkit's compensated path).
OFFSETS = (0.0, 1.5, 1e4, 1e5)


class _PermutedLayerNorm(nn.Module):
    """torch's way to LayerNorm the channels of NCHW input (timm, ConvNeXt)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _families(c: int, last: int):
    return [
        ("BatchNorm2d", lambda: (normkit.BatchNorm2d(c), nn.BatchNorm2d(c)), False),
        ("BatchNorm2d (channels_last)",
         lambda: (normkit.BatchNorm2d(c), nn.BatchNorm2d(c)), True),
        ("LayerNorm (last dim)", lambda: (normkit.LayerNorm(last), nn.LayerNorm(last)), False),
        ("RMSNorm (last dim)", lambda: (normkit.RMSNorm(last), nn.RMSNorm(last)), False),
        ("LayerNorm2d", lambda: (normkit.LayerNorm2d(c), _PermutedLayerNorm(c)), False),
        ("GroupNorm (8 groups)", lambda: (normkit.GroupNorm(8, c), nn.GroupNorm(8, c)), False),
        ("GroupNorm (8 groups, channels_last)",
         lambda: (normkit.GroupNorm(8, c), nn.GroupNorm(8, c)), True),
        ("InstanceNorm2d", lambda: (normkit.InstanceNorm2d(c), nn.InstanceNorm2d(c)), False),
        ("InstanceNorm2d (channels_last)",
         lambda: (normkit.InstanceNorm2d(c), nn.InstanceNorm2d(c)), True),
    ]


def _output_and_grad(module: nn.Module, x: torch.Tensor, dy: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(dy.to(y.dtype))
    return y.detach().double(), x.grad.double()


def measure(seed: int = 0) -> list[dict]:
    """Max |output - float64 reference| and max |input grad - float64 reference| per
    shape, family and offset, normkit and torch."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    # (the upstream gradients from their own stream: the inputs stay those of seed)
    grad_gen = torch.Generator().manual_seed(seed + 1)
    for shape in SHAPES:
        for name, make, channels_last in _families(shape[1], shape[-1]):
            for offset in OFFSETS:
                x = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset).float()
                if channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                dy = torch.randn(shape, generator=grad_gen, dtype=torch.float64)
                ours, theirs = make()
                reference = make()[1].double()
                # (a contiguous float64 input: torch's channels-last kernels sum
                # sequentially and unshifted, which costs float64 ~1e-5 at offset 1e5)
                exact, exact_dx = _output_and_grad(reference, x.double().contiguous(), dy)
                row = {"shape": "x".join(map(str, shape)), "layer": name, "offset": offset}
                for who, module in (("normkit", ours), ("torch", theirs)):
                    y, dx = _output_and_grad(module, x, dy)
                    row[who] = float((y - exact).abs().max())
                    row[who + "_dx"] = float((dx - exact_dx).abs().max())
                rows.append(row)
    return rows


#: ``--counts``: values per channel (N x 32 x 32 channels-last images), ratios, seeds.
COUNTS = (2048, 4096, 8192, 16384, 32768, 131072)
RATIOS = (0.0, 1.0, 1.5, 2.0)
SEEDS = 5


def channels_last_counts(counts=COUNTS, ratios=RATIOS, seeds: int = SEEDS,
                         channels: int = 32) -> list[dict]:
    """Max output error vs float64 of training-mode BatchNorm on channels-last input
    (``N x channels x 32 x 32``, ``N = count / 1024``, no affine), torch's and normkit's,
    over ``seeds`` standard-normal inputs shifted by ``ratio`` (= ``|mean| / std``); and
    torch's on the same values laid out NCHW, for scale."""
    rows = []
    for count in counts:
        n = max(count // 1024, 1)
        for ratio in ratios:
            errors = {"torch": 0.0, "normkit": 0.0, "torch_nchw": 0.0}
            for seed in range(seeds):
                g = torch.Generator().manual_seed(seed)
                x = (torch.randn(n, channels, 32, 32, generator=g) + ratio).contiguous(
                    memory_format=torch.channels_last)
                ref = nn.functional.batch_norm(x.double(), None, None, training=True)
                for name, module in (("torch", nn.BatchNorm2d), ("normkit", normkit.BatchNorm2d)):
                    y = module(channels, affine=False, track_running_stats=False)(x)
                    errors[name] = max(errors[name], float((y.double() - ref).abs().max()))
                y = nn.functional.batch_norm(x.contiguous(), None, None, training=True)
                errors["torch_nchw"] = max(errors["torch_nchw"],
                                           float((y.double() - ref).abs().max()))
            rows.append({"count": n * 1024, "ratio": ratio, **errors})
    return rows


#: ``--backward-counts``: values per channel (N x 16 x 64 x 64 channels-last images).
BACKWARD_COUNTS = (8192, 16384, 32768, 65536, 131072, 262144)
BACKWARD_RATIOS = (0.0, 1.0, 1.9)


def _grad_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error relative to the reference's largest magnitude (at least 1), as the
    tests' ``assert_grad_close`` measures it."""
    return float((got.double() - want).abs().max()) / max(1.0, float(want.abs().max()))


def channels_last_backward_counts(counts=BACKWARD_COUNTS, ratios=BACKWARD_RATIOS,
                                  seeds: int = 3) -> list[dict]:
    """Max gradient errors (dx, dweight, dbias) vs float64 of training-mode BatchNorm's
    backward on channels-last input, from the same accurate statistics
    (``normkit.kernels.channels.moments``): torch's backward kernel, which sums
    sequentially along the positions, against the slice-sums engine's folded sums; over
    ``seeds`` inputs shifted by each ``ratio`` (``|mean| / std``) and upstream gradients
    of mean 0 and 1; and, in columns of their own (``*_dx_collinear``), ``dx`` for an
    upstream gradient equal to the input (``dy = x``: the exact ``dx`` is what ``eps``
    leaves, and ``sum dy * (x - mean)`` does not cancel, so a sequential sum's error
    shows in full)."""
    from normkit.kernels import channels, native

    rows = []
    for count in counts:
        shape = (max(count // 4096, 1), 16, 64, 64)
        c = shape[1]
        worst = {f"{way}_{g}": 0.0 for way in ("torch", "normkit")
                 for g in ("dx", "dw", "db", "dx_collinear")}
        for seed in range(seeds):
            for ratio in ratios:
                for dy_mean in (0.0, 1.0, None):  # (None: dy = x)
                    g = torch.Generator().manual_seed(seed)
                    x = (torch.randn(shape, generator=g) + ratio).contiguous(
                        memory_format=torch.channels_last)
                    dy = (torch.randn(shape, generator=g) + (dy_mean or 0.0)).contiguous(
                        memory_format=torch.channels_last)
                    if dy_mean is None:
                        dy = x.clone()
                    w = torch.rand(c, generator=g) + 0.5
                    leaves = [x.double().requires_grad_(), w.double().requires_grad_(),
                              torch.zeros(c, dtype=torch.float64, requires_grad=True)]
                    ref = nn.functional.batch_norm(leaves[0], None, None, *leaves[1:], True)
                    want = torch.autograd.grad(ref, leaves, dy.double())
                    stats = channels.moments(x, channels.Pool("batch"), 1e-5)
                    if stats is None:  # (past the engine's bound: neither way serves)
                        continue
                    mean, _, rstd = stats
                    kernel = torch.ops.aten.native_batch_norm_backward(
                        dy, x, w, None, None, mean.view(c), rstd.view(c), True, 1e-5,
                        [True, True, True])
                    saved = native.CHANNELS_LAST_BACKWARD_MAX_COUNT
                    channels.CHANNELS_LAST_BACKWARD_MAX_COUNT = 0  # the engine's own sums
                    try:
                        engine = channels.backward(dy, x, mean, rstd, w, channels.Pool("batch"),
                                                   (True, True, True))
                    finally:
                        channels.CHANNELS_LAST_BACKWARD_MAX_COUNT = saved
                    for way, grads in (("torch", kernel), ("normkit", engine)):
                        for name, got, ref_grad in zip(("dx", "dw", "db"), grads, want,
                                                       strict=True):
                            if dy_mean is None and name != "dx":
                                continue
                            key = f"{way}_{name}" + ("_collinear" if dy_mean is None else "")
                            worst[key] = max(worst[key], _grad_error(got, ref_grad))
        rows.append({"count": shape[0] * 4096, **worst})
    return rows


#: ``--long-slices``: square positions per slice (side), offsets (|mean| / std), seeds.
LONG_SIDES = (256, 512, 1024)
LONG_RATIOS = (0.0, 1.9)
LONG_SEEDS = 2


def _long_slice_layers(c: int):
    """``(label, normkit module, torch.nn module)`` for :func:`long_slices`."""
    from normkit.norms.fused import BatchNormAct2d, GroupNormAct

    return (("BatchNorm2d", normkit.BatchNorm2d(c), nn.BatchNorm2d(c)),
            ("InstanceNorm2d (affine)", normkit.InstanceNorm2d(c, affine=True),
             nn.InstanceNorm2d(c, affine=True)),
            ("GroupNorm (1 group)", normkit.GroupNorm(1, c), nn.GroupNorm(1, c)),
            ("GroupNormAct (SiLU)", GroupNormAct(1, c, act="silu"),
             nn.Sequential(nn.GroupNorm(1, c), nn.SiLU())),
            ("BatchNormAct2d (In-Place ABN)",
             BatchNormAct2d(c, act="identity", memory="inplace"), nn.BatchNorm2d(c)))


def _worst_against_float64(row: dict, shape: tuple[int, ...], layers, ratios,
                           seeds: int) -> None:
    """Into ``row``: the worst output error (relative to the largest output) and input
    gradient errors (:func:`_grad_error`; ``dx`` for an upstream gradient of mean 1,
    ``dx_collinear`` for ``dy = x``) of each ``(who, module)`` of ``layers`` against a
    float64 copy of the last (torch's), over ``seeds`` inputs of ``shape`` at each of
    ``ratios`` (``|mean| / std``)."""
    exact = copy.deepcopy(layers[-1][1]).double()  # (default parameters, as normkit's)
    for seed in range(seeds):
        for ratio in ratios:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(shape, generator=g) + ratio
            upstream = {"dx": torch.randn(shape, generator=g) + 1.0, "dx_collinear": x}
            for key, dy in upstream.items():
                x64 = x.double().requires_grad_()
                y64 = exact(x64)
                (dx64,) = torch.autograd.grad(y64, x64, dy.double())
                for who, module in layers:
                    leaf = x.clone().requires_grad_()
                    y = module(leaf)
                    (dx,) = torch.autograd.grad(y, leaf, dy)
                    out = float((y.detach().double() - y64.detach()).abs().max()
                                ) / float(y64.detach().abs().max())
                    row[f"{who}_out"] = max(row.get(f"{who}_out", 0.0), out)
                    row[f"{who}_{key}"] = max(row.get(f"{who}_{key}", 0.0),
                                              _grad_error(dx, dx64))


def long_slices(sides=LONG_SIDES, ratios=LONG_RATIOS, seeds: int = LONG_SEEDS) -> list[dict]:
    """Max output and input-gradient errors vs float64 of per-channel and per-sample
    layers on ``1 x 2 x side x side`` float32 input (long NCHW slices), torch.nn beside
    normkit; gradients for an upstream gradient of mean 1 and for ``dy = x`` (whose exact
    ``dx`` is what ``eps`` leaves, so a sum's error shows in full). Output error relative
    to the largest output, gradient error to the largest gradient (at least 1)."""
    rows = []
    for side in sides:
        for label, ours, theirs in _long_slice_layers(2):
            row = {"layer": label, "positions": side * side}
            _worst_against_float64(row, (1, 2, side, side),
                                   (("normkit", ours), ("torch", theirs)), ratios, seeds)
            rows.append(row)
    return rows


def _versus_float64_markdown(rows: list[dict], size_title: str, size_key: str) -> str:
    """The table of :func:`_worst_against_float64`'s rows, one size column."""
    return _table([("layer", "layer", ""), (size_title, size_key, "d")]
                  + [(f"{who} {name}", f"{who}_{key}", ".1e")
                     for name, key in (("output", "out"), ("dx", "dx"),
                                       ("dx, dy = x", "dx_collinear"))
                     for who in ("torch", "normkit")], rows)


def long_slices_markdown(rows: list[dict]) -> str:
    return _versus_float64_markdown(rows, "positions per slice", "positions")


#: ``--wide-rows``: row widths (features) for LayerNorm and RMSNorm, 2^21 values each.
WIDE_ROWS = (4096, 65536, 262144, 1 << 20)


def wide_rows(widths=WIDE_ROWS, ratios=LONG_RATIOS, seeds: int = LONG_SEEDS) -> list[dict]:
    """:func:`long_slices` for the per-row layers: LayerNorm and RMSNorm over rows of each
    width (2^21 values in all), torch.nn beside normkit, output error and input-gradient
    errors (upstream gradient of mean 1, and ``dy = x``) against float64."""
    rows = []
    for width in widths:
        for label, ours, theirs in (("LayerNorm", normkit.LayerNorm(width),
                                     nn.LayerNorm(width)),
                                    ("RMSNorm", normkit.RMSNorm(width, eps=1e-6),
                                     nn.RMSNorm(width, eps=1e-6))):
            row = {"layer": label, "features": width}
            _worst_against_float64(row, (max(2, (1 << 21) // width), width),
                                   (("normkit", ours), ("torch", theirs)), ratios, seeds)
            rows.append(row)
    return rows


def wide_rows_markdown(rows: list[dict]) -> str:
    return _versus_float64_markdown(rows, "features", "features")


#: ``--offset-gradients``: offsets (|mean| / std) and upstream-gradient means (None: dy = x).
OFFSET_RATIOS = (2.0, 5.0, 10.0, 30.0)
OFFSET_GRADIENT_MEANS = (0.0, 1.0, 30.0, None)


def offset_gradients(ratios=OFFSET_RATIOS, means=OFFSET_GRADIENT_MEANS,
                     seeds: int = 3) -> list[dict]:
    """Max input-gradient error vs float64 of LayerNorm (64 x 768), GroupNorm (2 groups)
    and BatchNorm2d (8 x 4 x 32 x 32) on input at an offset (``|mean| / std``) within
    normkit's bound for torch's kernels (32), for upstream gradients of unit spread and
    mean 0, 1 or 30, and ``dy = x``: torch.nn, normkit (``backend="auto"``: torch's
    backward kernels there) and normkit's reference math (``backend="reference"``), each
    relative to the largest float64 gradient (at least 1), as the tests measure."""
    layers = (("LayerNorm", (64, 768), lambda: nn.LayerNorm(768),
               lambda b: normkit.LayerNorm(768, backend=b)),
              ("GroupNorm (2 groups)", (8, 4, 32, 32), lambda: nn.GroupNorm(2, 4),
               lambda b: normkit.GroupNorm(2, 4, backend=b)),
              ("BatchNorm2d", (8, 4, 32, 32), lambda: nn.BatchNorm2d(4),
               lambda b: normkit.BatchNorm2d(4, backend=b)))
    rows = []
    for label, shape, make_torch, make_ours in layers:
        for ratio in ratios:
            for mean in means:
                worst = {"torch": 0.0, "normkit": 0.0, "reference": 0.0}
                for seed in range(seeds):
                    g = torch.Generator().manual_seed(seed)
                    x = torch.randn(shape, generator=g) + ratio
                    dy = x.clone() if mean is None else torch.randn(shape, generator=g) + mean
                    x64 = x.double().requires_grad_()
                    (want,) = torch.autograd.grad(make_torch().double()(x64), x64, dy.double())
                    for who, module in (("torch", make_torch()), ("normkit", make_ours("auto")),
                                        ("reference", make_ours("reference"))):
                        leaf = x.clone().requires_grad_()
                        (dx,) = torch.autograd.grad(module(leaf), leaf, dy)
                        worst[who] = max(worst[who], _grad_error(dx, want))
                rows.append({"layer": label, "offset": ratio,
                             "dy": "x" if mean is None else f"N({mean:g}, 1)", **worst})
    return rows


def offset_gradients_markdown(rows: list[dict]) -> str:
    return _table([("layer", "layer", ""), ("offset", "offset", "g"), ("dy", "dy", ""),
                   ("torch dx", "torch", ".1e"), ("normkit dx", "normkit", ".1e"),
                   ("normkit reference dx", "reference", ".1e")], rows)


#: ``--sixteen-bit``: (layer, shape) pairs, offsets (|mean| / std).
SIXTEEN_BIT_CASES = (("LayerNorm", (4096, 768)), ("LayerNorm", (16384, 256)),
                     ("BatchNorm2d", (8, 256, 14, 14)), ("GroupNorm (8 groups)", (8, 256, 14, 14)))
SIXTEEN_BIT_OFFSETS = (0.0, 30.0)


def _sixteen_bit_modules(layer: str, channels: int) -> tuple[nn.Module, nn.Module]:
    if layer == "LayerNorm":
        return normkit.LayerNorm(channels), nn.LayerNorm(channels)
    if layer == "BatchNorm2d":
        return normkit.BatchNorm2d(channels), nn.BatchNorm2d(channels)
    return normkit.GroupNorm(8, channels), nn.GroupNorm(8, channels)


def sixteen_bit(seed: int = 0) -> list[dict]:
    """Output, input-gradient and weight-gradient errors vs float64 of torch.nn and
    normkit on float16/bfloat16 input, parameters float32 (autocast's case) or of the
    input's dtype (``model.half()``), centered and at 30 std of offset. Output: max
    absolute error; gradients: relative to the reference's largest magnitude (at least
    1)."""
    rows = []
    for layer, shape in SIXTEEN_BIT_CASES:
        channels = shape[-1] if layer == "LayerNorm" else shape[1]
        for dtype in (torch.bfloat16, torch.float16):
            for params in ("float32", "same"):
                for offset in SIXTEEN_BIT_OFFSETS:
                    gen = torch.Generator().manual_seed(seed)
                    x = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset
                         ).to(dtype)
                    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
                    ours, theirs = _sixteen_bit_modules(layer, channels)
                    with torch.no_grad():
                        ours.weight.copy_(torch.rand(channels, generator=gen) + 0.5)
                        ours.bias.copy_(torch.randn(channels, generator=gen))
                    theirs.load_state_dict(ours.state_dict())
                    reference = _sixteen_bit_modules(layer, channels)[1].double()
                    reference.load_state_dict(ours.state_dict())
                    x64 = x.double().requires_grad_()
                    exact = reference(x64)
                    exact.backward(dy.double())
                    row = {"layer": layer, "shape": "x".join(map(str, shape)),
                           "dtype": str(dtype).removeprefix("torch."), "params": params,
                           "offset": offset}
                    pdtype = torch.float32 if params == "float32" else dtype
                    for who, module in (("torch", theirs), ("normkit", ours)):
                        module = module.to(pdtype)
                        xr = x.detach().requires_grad_()
                        y = module(xr)
                        y.backward(dy)
                        row[who] = float((y.detach().double() - exact.detach()).abs().max())
                        row[who + "_dx"] = _grad_error(xr.grad, x64.grad)
                        row[who + "_dw"] = _grad_error(module.weight.grad,
                                                       reference.weight.grad)
                    rows.append(row)
    return rows


def _table(columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """A Markdown table: one ``(title, key, format)`` per column, text left-aligned and
    numbers right-aligned."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |",
             "|" + "|".join("---" if fmt == "" else "---:" for _, _, fmt in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(format(r[key], fmt) for _, key, fmt in columns) + " |")
    return "\n".join(lines)


def sixteen_bit_markdown(rows: list[dict]) -> str:
    return _table([("layer", "layer", ""), ("shape", "shape", ""), ("input", "dtype", ""),
                   ("parameters", "params", ""), ("offset", "offset", "g"),
                   ("torch output", "torch", ".1e"), ("torch dx", "torch_dx", ".1e"),
                   ("torch dweight", "torch_dw", ".1e"), ("normkit output", "normkit", ".1e"),
                   ("normkit dx", "normkit_dx", ".1e"),
                   ("normkit dweight", "normkit_dw", ".1e")], rows)


def backward_counts_markdown(rows: list[dict]) -> str:
    return _table([("values per channel", "count", "d")]
                  + [(f"{who} {name}", f"{who}_{key}", ".1e") for who in ("torch", "normkit")
                     for name, key in (("dx", "dx"), ("dweight", "dw"), ("dbias", "db"),
                                       ("dx, dy = x", "dx_collinear"))],
                  rows)


def counts_markdown(rows: list[dict]) -> str:
    return _table([("values per channel", "count", "d"), ("mean / std", "ratio", "g"),
                   ("torch max error", "torch", ".1e"), ("normkit max error", "normkit", ".1e"),
                   ("torch, same values NCHW", "torch_nchw", ".1e")], rows)


class _Act(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


#: Cases per dtype, parameter dtype and activation in ``--second-order``.
SECOND_ORDER_CASES = 100


def _derivatives(forward, params: list[torch.Tensor], x: torch.Tensor,
                 upstream: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fuzz's double backward: first derivatives of ``forward(x)`` against a fixed
    upstream gradient (``create_graph=True``), then the derivatives of their sum against
    fixed directions, for the input and every parameter; both in float64 (an unused
    input's second derivative as zeros). The upstream gradient is rounded to ``upstream``,
    the dtype under test, for the float64 reference too: both then differentiate the same
    numbers (as the fuzz does)."""
    leaf = x.detach().requires_grad_()
    out = forward(leaf)
    gen = torch.Generator().manual_seed(11)
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(upstream).to(out.dtype)
    wrt = [leaf, *params]
    first = torch.autograd.grad(out, wrt, dy, create_graph=True)
    gen = torch.Generator().manual_seed(12)
    directions = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in wrt]
    total = sum((g.double() * v).sum() for g, v in zip(first, directions, strict=True))
    second = torch.autograd.grad(total, wrt, allow_unused=True)
    return ([g.detach().double() for g in first],
            [torch.zeros(t.shape, dtype=torch.float64) if h is None else h.double()
             for h, t in zip(second, wrt, strict=True)])


def _second_derivatives(forward, params: list[torch.Tensor], x: torch.Tensor,
                        upstream: torch.dtype) -> list[torch.Tensor]:
    """The second derivatives of :func:`_derivatives`."""
    return _derivatives(forward, params, x, upstream)[1]


def second_order(cases: int = SECOND_ORDER_CASES) -> list[dict]:
    """Second-derivative errors of inference BatchNorm + activation on 16-bit input, torch
    beside normkit, each case's worst of input, weight and bias relative to the fuzz's
    scale; the median, 99th percentile and maximum over ``cases`` random cases (1 to 4
    samples of 8 channels, 2x2 to 8x8 positions, data within 2 std of the running
    statistics)."""
    activations = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
                   "elu": nn.functional.elu}
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for params in ("float32", "same"):
            pdtype = torch.float32 if params == "float32" else dtype
            for act, act_fn in activations.items():
                errors = {"torch": [], "normkit": []}
                for seed in range(cases):
                    gen = torch.Generator().manual_seed(seed)
                    n, size = (int(torch.randint(lo, hi, (1,), generator=gen))
                               for lo, hi in ((1, 5), (2, 9)))
                    x = (torch.randn(n, 8, size, size, generator=gen, dtype=torch.float64)
                         * 1.5 + 0.5).to(dtype)
                    ours = normkit.BatchNormAct2d(8, act=act).eval()
                    with torch.no_grad():
                        ours.weight.copy_(torch.rand(8, generator=gen) + 0.5)
                        ours.bias.copy_(torch.randn(8, generator=gen) * 0.3)
                        ours.running_mean.copy_(torch.randn(8, generator=gen) * 0.5)
                        ours.running_var.copy_(torch.rand(8, generator=gen) + 0.5)
                    ours = ours.to(pdtype)  # (then copied: the reference gets the same
                    # rounded parameters and statistics)
                    theirs, exact = nn.BatchNorm2d(8).eval(), nn.BatchNorm2d(8).eval()
                    theirs, exact = theirs.to(pdtype), exact.double()
                    theirs.load_state_dict(ours.state_dict())
                    exact.load_state_dict(ours.state_dict())
                    reference = _second_derivatives(nn.Sequential(exact, _Act(act_fn)),
                                                    [exact.weight, exact.bias], x.double(),
                                                    dtype)
                    terms = (1, n * size * size, n * size * size)
                    for who, forward, module in (
                            ("torch", nn.Sequential(theirs, _Act(act_fn)), theirs),
                            ("normkit", ours, ours)):
                        got = _second_derivatives(forward, [module.weight, module.bias], x,
                                                  dtype)
                        errors[who].append(max(
                            float((h - h64).abs().max())
                            / max(1.0, float(h64.abs().max()), t ** 0.5)
                            for h, h64, t in zip(got, reference, terms, strict=True)))
                row = {"dtype": str(dtype).removeprefix("torch."), "params": params,
                       "act": act, "cases": cases}
                for who, values in errors.items():
                    values.sort()
                    row[who + "_median"] = values[len(values) // 2]
                    row[who + "_p99"] = values[min(len(values) - 1, int(len(values) * 0.99))]
                    row[who + "_max"] = values[-1]
                rows.append(row)
    return rows


#: Layers whose statistics pool few values each in ``--few-values``: (row label, values
#: per statistic, normkit module, the same layer from torch.nn, input shape).
FEW_VALUES_LAYERS = (
    ("LayerNorm(2)", 2, lambda: normkit.LayerNorm(2), lambda: nn.LayerNorm(2), (6, 2)),
    ("LayerNorm(3)", 3, lambda: normkit.LayerNorm(3), lambda: nn.LayerNorm(3), (6, 3)),
    ("LayerNorm(4)", 4, lambda: normkit.LayerNorm(4), lambda: nn.LayerNorm(4), (6, 4)),
    ("RMSNorm(1)", 1, lambda: normkit.RMSNorm(1, eps=1e-6),
     lambda: nn.RMSNorm(1, eps=1e-6), (6, 1)),
    ("RMSNorm(2)", 2, lambda: normkit.RMSNorm(2, eps=1e-6),
     lambda: nn.RMSNorm(2, eps=1e-6), (6, 2)),
    ("BatchNorm2d, 2x1x1", 2, lambda: normkit.BatchNorm2d(8), lambda: nn.BatchNorm2d(8),
     (2, 8, 1, 1)),
    ("BatchNorm2d, 3x1x1", 3, lambda: normkit.BatchNorm2d(8), lambda: nn.BatchNorm2d(8),
     (3, 8, 1, 1)),
    ("BatchNorm2d, 4x1x1", 4, lambda: normkit.BatchNorm2d(8), lambda: nn.BatchNorm2d(8),
     (4, 8, 1, 1)),
    ("GroupNorm(8, 8), 1x2", 2, lambda: normkit.GroupNorm(8, 8),
     lambda: nn.GroupNorm(8, 8), (3, 8, 1, 2)),
    ("InstanceNorm1d, 2", 2, lambda: normkit.InstanceNorm1d(8, affine=True),
     lambda: nn.InstanceNorm1d(8, affine=True), (3, 8, 2)),
    ("LayerNorm2d(2)", 2, lambda: normkit.LayerNorm2d(2), lambda: _PermutedLayerNorm(2),
     (3, 2, 5, 5)),
)


def few_values(cases: int = SECOND_ORDER_CASES) -> list[dict]:
    """First and second derivatives (``create_graph=True``) of layers whose statistics
    pool 1 to 4 values each, float32, torch.nn beside normkit, against torch.nn in float64
    on the same input and parameters: each case's worst of input and parameters relative
    to the largest reference magnitude (at least 1); the median and maximum over ``cases``
    random cases (input of standard deviation 2 at offset 0 or 3, weights 1 + 0.5 N(0, 1),
    biases 0.3 N(0, 1))."""
    rows = []
    for label, count, make_ours, make_torch, shape in FEW_VALUES_LAYERS:
        errors = {(who, order): [] for who in ("torch", "normkit") for order in (1, 2)}
        for seed in range(cases):
            gen = torch.Generator().manual_seed(seed)
            x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2
                 + 3.0 * (seed % 2)).float()
            ours = make_ours()
            with torch.no_grad():
                for name, p in ours.named_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "bias" in name
                                                                     else 0.5)
                            + (0.0 if "bias" in name else 1.0))
            theirs, exact = make_torch(), make_torch()
            with torch.no_grad():  # (by position: LayerNorm2d's are named otherwise)
                for p, q, mine in zip(theirs.parameters(), exact.parameters(),
                                      ours.parameters(), strict=True):
                    p.copy_(mine)
                    q.copy_(mine)
            exact = exact.double()
            reference = _derivatives(exact, list(exact.parameters()), x.double(),
                                     torch.float32)
            for who, module in (("torch", theirs), ("normkit", ours)):
                got = _derivatives(module, list(module.parameters()), x, torch.float32)
                for order in (1, 2):
                    errors[who, order].append(max(
                        float((h - h64).abs().max()) / max(1.0, float(h64.abs().max()))
                        for h, h64 in zip(got[order - 1], reference[order - 1],
                                          strict=True)))
        row = {"layer": label, "values": count, "cases": cases}
        for (who, order), values in errors.items():
            values.sort()
            row[f"{who}_{order}_median"] = values[len(values) // 2]
            row[f"{who}_{order}_max"] = values[-1]
        rows.append(row)
    return rows


def few_values_markdown(rows: list[dict]) -> str:
    return _table([("layer", "layer", ""), ("values per statistic", "values", "d"),
                   ("cases", "cases", "d"),
                   ("torch 1st median", "torch_1_median", ".1e"),
                   ("torch 1st max", "torch_1_max", ".1e"),
                   ("normkit 1st median", "normkit_1_median", ".1e"),
                   ("normkit 1st max", "normkit_1_max", ".1e"),
                   ("torch 2nd median", "torch_2_median", ".1e"),
                   ("torch 2nd max", "torch_2_max", ".1e"),
                   ("normkit 2nd median", "normkit_2_median", ".1e"),
                   ("normkit 2nd max", "normkit_2_max", ".1e")], rows)


def second_order_markdown(rows: list[dict]) -> str:
    return _table([("input", "dtype", ""), ("parameters", "params", ""), ("act", "act", ""),
                   ("cases", "cases", "d"),
                   ("torch median", "torch_median", ".1e"), ("torch p99", "torch_p99", ".1e"),
                   ("torch max", "torch_max", ".1e"),
                   ("normkit median", "normkit_median", ".1e"),
                   ("normkit p99", "normkit_p99", ".1e"),
                   ("normkit max", "normkit_max", ".1e")], rows)


def markdown(rows: list[dict]) -> str:
    return _table([("shape", "shape", ""), ("layer", "layer", ""), ("offset", "offset", "g"),
                   ("normkit max error", "normkit", ".1e"),
                   ("torch.nn max error", "torch", ".1e"),
                   ("normkit input grad", "normkit_dx", ".1e"),
                   ("torch.nn input grad", "torch_dx", ".1e")], rows)


#: The modes of ``main`` besides the default table: flag and what it measures.
MODE_FLAGS = (
    ("--counts", "channels-last BatchNorm error by values per channel instead"),
    ("--backward-counts", "channels-last BatchNorm gradient error by values per channel"),
    ("--sixteen-bit", "float16/bfloat16 input: torch.nn and normkit against float64"),
    ("--second-order", "16-bit second derivatives of inference BatchNorm + activation"),
    ("--few-values", "float32 derivatives of statistics over 1 to 4 values each"),
    ("--long-slices", "float32 NCHW layers over 2^16 to 2^20 positions per slice"),
    ("--wide-rows", "float32 LayerNorm and RMSNorm over 4096 to 2^20 features"),
    ("--offset-gradients", "input gradients at an offset, by the upstream gradient's mean"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--seed", type=int, default=0)
    for flag, text in MODE_FLAGS:  # (each picks a mode instead of the default table)
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    torch.set_num_threads(1)
    version = f"torch {torch.__version__}"
    # (flag, rows, table, header): the first flag given picks its mode, none the default
    modes = (
        ("offset_gradients", offset_gradients, offset_gradients_markdown,
         f"{version}, float32, training mode, max input-gradient error relative to the "
         "largest float64 gradient (at least 1) over 3 seeds; the float32 tolerance is "
         "5e-5, 1 thread"),
        ("wide_rows", wide_rows, wide_rows_markdown,
         f"{version}, float32 rows of 2^21 values in all, |mean| / std "
         f"{' and '.join(map(str, LONG_RATIOS))}, {LONG_SEEDS} seeds; output error relative "
         "to the largest output, dx relative to the largest gradient (at least 1) for an "
         "upstream gradient of mean 1 and for dy = x; the float32 tolerances are 2e-5 + "
         "2e-5 |y| and 5e-5, 1 thread"),
        ("long_slices", long_slices, long_slices_markdown,
         f"{version}, float32 1 x 2 x side x side NCHW input, |mean| / std "
         f"{' and '.join(map(str, LONG_RATIOS))}, {LONG_SEEDS} seeds, training mode; output "
         "error relative to the largest output, dx relative to the largest gradient (at "
         "least 1) for an upstream gradient of mean 1 and for dy = x; the float32 "
         "tolerances are 2e-5 + 2e-5 |y| and 5e-5, 1 thread"),
        ("few_values", few_values, few_values_markdown,
         f"{version}, float32, first and second derivatives of input and parameters (each "
         "case's worst) relative to the largest float64 magnitude (at least 1), 1 thread; "
         "the float32 gradient tolerance is 5e-5 (tests/oracle.py), the Triton fuzz's 1e-5"),
        ("second_order", second_order, second_order_markdown,
         f"{version}, inference BatchNorm2d + activation, second derivatives of input, "
         "weight and bias (each case's worst) relative to the differential fuzz's scale, "
         "1 thread"),
        ("sixteen_bit", lambda: sixteen_bit(args.seed), sixteen_bit_markdown,
         f"{version}, training mode, 1 thread; output: max absolute error, gradients: max "
         "error relative to the largest reference magnitude (at least 1); the per-dtype "
         "test tolerances are 1.6e-2 + 1.6e-2 |y| and 4e-2 (bfloat16), 2e-3 + 2e-3 |y| "
         "and 5e-3 (float16)"),
        ("backward_counts", channels_last_backward_counts, backward_counts_markdown,
         f"{version}, channels-last BatchNorm2d backward (training, affine) from accurate "
         "statistics, N x 16 x 64 x 64 float32; max gradient error relative to the largest "
         "reference magnitude (at least 1), over 3 seeds, |mean| / std 0, 1, 1.9 and "
         "upstream gradients of mean 0 and 1 (and dy = x in its columns), 1 thread"),
        ("counts", channels_last_counts, counts_markdown,
         f"{version}, channels-last BatchNorm2d (training, no affine), N x 32 x 32 x 32 "
         f"float32, max error vs float64 over {SEEDS} seeds, 1 thread"),
    )
    for flag, rows, table, header in modes:
        if getattr(args, flag):
            _emit(rows(), table, args.json, header)
            return
    _emit(measure(args.seed), markdown, args.json,
          f"{version}, float32 input, std 1, error vs float64 on the same input")


def _emit(rows: list[dict], table, json_path: str | None, header: str) -> None:
    """Print ``header`` and ``table(rows)``; write ``rows`` to ``json_path`` if given."""
    print(header + "\n")
    print(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)

if __name__ == "__main__":
    main()
