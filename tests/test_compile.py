"""normkit layers inside torch.compile(fullgraph=True): no graph breaks, same results.

``backend="aot_eager"`` runs Dynamo (which is where graph breaks happen) and AOTAutograd
(functionalization of the in-place running-statistics updates) without Inductor's C++
code generation, which takes tens of seconds per graph on a 2-core CPU.
"""

from __future__ import annotations

import copy
import functools
import importlib
import subprocess
import sys

import pytest
import torch
from cases import IMAGE_LAYERS, RENORM_FULLGRAPH_GAP
from compile_recorder import recording_backend

import normkit
from normkit._constant import constant_result
from normkit.kernels import channels
from normkit.kernels import triton as triton_kernels


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), normkit.BatchNorm2d(8), torch.nn.ReLU(),
        normkit.GroupNorm(2, 8), normkit.LayerNorm2d(8),
        normkit.InstanceNorm2d(8, affine=True, track_running_stats=True),
        torch.nn.Flatten(1), torch.nn.Linear(8 * 6 * 6, 16), normkit.LayerNorm(16),
        normkit.RMSNorm(16), torch.nn.Unflatten(1, (16, 1)), normkit.BatchNorm1d(16))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fullgraph_compile_matches_eager(training):
    torch._dynamo.reset()
    eager, compiled_model = _model().train(training), _model().train(training)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    for step in range(2):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step)) * 3 + 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(xa), compiled(xb)
        torch.testing.assert_close(yb, ya, atol=2e-5, rtol=2e-5)
        ya.square().sum().backward()
        yb.square().sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(eager.named_buffers(), compiled_model.buffers(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_compiled_path_keeps_the_precision_at_large_offsets():
    torch._dynamo.reset()
    ln = normkit.LayerNorm(64)
    compiled = torch.compile(ln, fullgraph=True, backend="aot_eager")
    x = (torch.randn(32, 64, dtype=torch.float64) + 1e5).float()
    ref = torch.nn.functional.layer_norm(x.double(), (64,))
    assert float((compiled(x).detach().double() - ref).abs().max()) < 1e-4


# ------------------------------------------ CPU LayerNorm as one operator (kernels.library)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_layer_norm_is_one_operator_each_way(dtype):
    """A compiled CPU LayerNorm records normkit::layer_norm and its backward operator --
    torch's kernel where accurate, the compensated path elsewhere, inside the operator --
    and computes exactly what eager mode computes, at any offset."""
    torch._dynamo.reset()
    backend, seen = recording_backend()
    eager = normkit.LayerNorm(48).to(dtype)
    twin = normkit.LayerNorm(48).to(dtype)
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, fullgraph=True, backend=backend)
    for offset in (0.0, 1e5):
        x = (torch.randn(16, 48, dtype=torch.float64) + offset).to(dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(xa), compiled(xb)
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        torch.testing.assert_close(yb, ya, rtol=0, atol=0)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)
        for a, b in zip(eager.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
        ref = torch.nn.functional.layer_norm(x.double(), (48,), eager.weight.detach().double(),
                                             eager.bias.detach().double())
        assert float((yb.detach().double() - ref).abs().max()) < 1e-4
    ops = {name for name in seen if name.startswith("normkit.")}
    assert ops == {"normkit.layer_norm.default", "normkit.layer_norm_backward.default"}, seen


def test_compiled_layer_norm_outside_the_operator_takes_the_reference_math():
    """bfloat16 (and strided) input is not served by the operator: the reference math,
    still without graph breaks."""
    torch._dynamo.reset()
    backend, seen = recording_backend()
    ln = normkit.LayerNorm(32).to(torch.bfloat16)
    compiled = torch.compile(ln, fullgraph=True, backend=backend)
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    compiled(x).float().sum().backward()
    assert not any(name.startswith("normkit.") for name in seen)
    torch.testing.assert_close(compiled(x), ln(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["torch-kernel", "compensated"])
def test_layer_norm_operators_pass_opcheck_and_gradcheck(offset):
    from torch.library import opcheck

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=gen) + offset
    w, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    opcheck(torch.ops.normkit.layer_norm.default, (x, [8], w, b, 1e-5))
    opcheck(torch.ops.normkit.layer_norm.default,
            (x.clone().requires_grad_(), [8], None, b.clone().requires_grad_(), 1e-5))
    _, mean_hi, mean_lo, rstd = torch.ops.normkit.layer_norm(x, [8], w, b, 1e-5)
    assert bool((mean_lo == 0).all()) == (offset == 0.0)  # the compensated pair at 1e4
    opcheck(torch.ops.normkit.layer_norm_backward.default,
            (torch.randn(6, 8, generator=gen), x, [8], mean_hi, mean_lo, rstd, w, b,
             [True, False, True]))
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(
        lambda a, c, d: torch.ops.normkit.layer_norm(a, [8], c, d, 1e-5)[0], leaves)


#: case -> (operator, module factory, input shape, the operator's extra argument, memory
#: format, size floors to lower so that the case's path serves these small inputs)
_REPAIRED = {
    "layer_norm": ("layer_norm", lambda: normkit.LayerNorm(8), (6, 8), [8], None, {}),
    "group_norm": ("group_norm", lambda: normkit.GroupNorm(2, 8), (6, 8, 3, 3), 2, None, {}),
    "group_norm channels_last": ("group_norm", lambda: normkit.GroupNorm(2, 8), (6, 8, 3, 3),
                                 2, torch.channels_last,
                                 {(channels, "REPAIR_MAX_SHARE"): 1.0}),
    "group_norm channels_last, engine": (
        "group_norm", lambda: normkit.GroupNorm(2, 8), (6, 8, 4, 4), 2, torch.channels_last,
        {(channels, "REPAIR_MAX_SHARE"): 1.0, (channels, "MIN_ELEMENTS"): 0,
         (channels, "GROUP_NORM_MIN_POSITIONS"): 16}),
}


@pytest.mark.parametrize("case", list(_REPAIRED))
def test_compiled_norm_repairs_only_the_offset_rows(case, monkeypatch):
    """Under torch.compile LayerNorm and NCHW GroupNorm are normkit's operators, which
    sent the whole batch to the compensated path when one row (group) was past the
    kernel's bound. Like eager mode (``test_layers.py::
    test_each_sample_is_normalized_as_if_alone``) they now repair those alone: each
    sample's output is its output alone, bit for bit, the compiled output is eager's, the
    operators pass opcheck and gradcheck on such input, and the gradients match
    float64."""
    from torch.library import opcheck

    name, make, shape, arg, memory_format, floors = _REPAIRED[case]
    for (where, attr), value in floors.items():
        monkeypatch.setattr(where, attr, value)
    op, backward_op = (getattr(torch.ops.normkit, name),
                       getattr(torch.ops.normkit, f"{name}_backward"))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=gen)
    x[1], x[4] = x[1] * 0.01 + 3e3, x[4] * 0.01 - 1e4
    if name == "group_norm":  # (and one group of a third sample: the rest of it is kept)
        x[2, :4] = x[2, :4] * 0.01 + 50.0
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    w, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    opcheck(op.default, (x, arg, w, b, 1e-5))
    _, mean_hi, mean_lo, rstd = op(x, arg, w, b, 1e-5)
    opcheck(backward_op.default, (torch.randn(shape, generator=gen), x, arg, mean_hi,
                                  mean_lo, rstd, w, b, [True, True, True]))
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda a, c, d: op(a, arg, c, d, 1e-5)[0], leaves)

    torch._dynamo.reset()
    layer = make()
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    xs = x.clone().requires_grad_()
    y = compiled(xs)
    with torch.no_grad():
        torch.testing.assert_close(y, layer(x), rtol=0, atol=0)
        for i in range(shape[0]):
            torch.testing.assert_close(y[i:i + 1], compiled(x[i:i + 1]), rtol=0, atol=0)
    ref_x = x.double().requires_grad_()
    ref_w, ref_b = w.double().requires_grad_(), b.double().requires_grad_()
    ref = (torch.nn.functional.layer_norm(ref_x, (8,), ref_w, ref_b) if name == "layer_norm"
           # (on NCHW: torch's channels-last GroupNorm kernel sums squares unshifted, off
           # even in float64 at these offsets)
           else torch.nn.functional.group_norm(ref_x.contiguous(), 2, ref_w, ref_b))
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    y.backward(dy.float())
    ref.backward(dy)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5)
    scale = float(ref_x.grad.abs().max())
    assert float((xs.grad.double() - ref_x.grad).abs().max()) <= 5e-5 * scale
    for got, want in ((layer.weight.grad, ref_w.grad), (layer.bias.grad, ref_b.grad)):
        assert float((got.double() - want).abs().max()) <= 5e-5 * float(want.abs().max())


def test_layer_norm_compiles_with_inductor():
    """The default backend (Inductor, C++ code generation) runs the operator as an
    external kernel: same values and gradients as eager mode."""
    from torch._inductor.utils import fresh_inductor_cache

    torch._dynamo.reset()
    ln = normkit.LayerNorm(24)
    compiled = torch.compile(ln, fullgraph=True)
    x = torch.randn(10, 24) * 3 + 2
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = ln(xa)
    with fresh_inductor_cache():  # (never a graph cached for another normkit version)
        yb = compiled(xb)
        ya.square().sum().backward()
        yb.square().sum().backward()
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["add_layer_norm", "layer_norm2d_channels_last"])
def test_compiled_fused_and_channels_last_layer_norms_use_the_operator(case):
    """AddLayerNorm (the add stays in the graph) and channels-last LayerNorm2d (a view of
    the operator's output) compile to normkit::layer_norm, with eager mode's results."""
    torch._dynamo.reset()
    backend, seen = recording_backend()
    torch.manual_seed(1)
    if case == "add_layer_norm":
        eager, twin = normkit.AddLayerNorm(40), normkit.AddLayerNorm(40)
        inputs = [torch.randn(12, 40) * 2 + 3, torch.randn(12, 40)]
    else:
        eager, twin = normkit.LayerNorm2d(6), normkit.LayerNorm2d(6)
        inputs = [(torch.randn(2, 6, 5, 7) + 4).contiguous(memory_format=torch.channels_last)]
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, fullgraph=True, backend=backend)
    a = [t.clone().requires_grad_() for t in inputs]
    b = [t.clone().requires_grad_() for t in inputs]
    ya, yb = eager(*a), compiled(*b)
    outs_a = ya if isinstance(ya, tuple) else (ya,)
    outs_b = yb if isinstance(yb, tuple) else (yb,)
    grads = [torch.randn_like(t) for t in outs_a]
    torch.autograd.backward(outs_a, grads)
    torch.autograd.backward(outs_b, grads)
    for got, want in zip(outs_b, outs_a, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for got, want in zip(b, a, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
    assert "normkit.layer_norm.default" in seen, seen
    if case != "add_layer_norm":
        assert outs_b[0].is_contiguous(memory_format=torch.channels_last)


def _twins(eager: torch.nn.Module, backend):
    """``eager`` with a random affine, and a compiled twin with its state."""
    with torch.no_grad():
        eager.weight.normal_(1.0, 0.3)
        eager.bias.normal_(0.0, 0.3)
    twin = copy.deepcopy(eager)
    return twin, torch.compile(twin, fullgraph=True, backend=backend)


def _step_both(eager, twin, compiled, x, layout):
    """One forward+backward of both on ``x``: same outputs, layout, input and parameter
    gradients (the compiled one returned)."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = eager(xa), compiled(xb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    assert yb.is_contiguous(memory_format=layout)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    for a, b in zip(eager.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-4)
    return yb


@pytest.mark.parametrize("shape,offset,channels_last", [
    ((4, 8, 6, 6), 0.0, True),        # few positions: torch's kernel inside the operator
    ((4, 8, 6, 6), 1e3, True),        # ill-conditioned: the compensated path
    ((8, 16, 48, 48), 0.0, True),     # the slice-sums engine
    ((2, 8, 4, 4, 6), 1.0, True),     # channels_last_3d
    ((4, 8, 6, 6), 1.0, False),       # NCHW: torch's kernel
    ((4, 8, 6, 6), 1e3, False),       # NCHW, ill-conditioned: compensated
], ids=["torch-kernel", "compensated", "engine", "3d", "nchw", "nchw-compensated"])
def test_compiled_group_norm_is_one_operator_each_way(shape, offset, channels_last,
                                                      monkeypatch):
    """GroupNorm compiles to normkit::group_norm and its backward operator (explicit
    backwards, no autograd inside): eager mode's values and gradients, the memory format
    kept, precision at an offset."""
    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 1 << 15)  # the engine on a small input
    torch._dynamo.reset()
    backend, seen = recording_backend()
    torch.manual_seed(5)
    eager = normkit.GroupNorm(4, shape[1])
    twin, compiled = _twins(eager, backend)
    layout = ((torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
              if channels_last else torch.contiguous_format)
    x = (torch.randn(shape, dtype=torch.float64) * 2 + offset).float()
    x = x.contiguous(memory_format=layout)
    yb = _step_both(eager, twin, compiled, x, layout)
    ref = torch.nn.functional.group_norm(x.double(), 4, eager.weight.detach().double(),
                                         eager.bias.detach().double())
    assert float((yb.detach().double() - ref).abs().max()) < 2e-5
    assert {"normkit.group_norm.default", "normkit.group_norm_backward.default"} <= set(seen)


def test_group_norm_operators_pass_opcheck_on_every_path(monkeypatch):
    from torch.library import opcheck

    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 1 << 12)
    gen = torch.Generator().manual_seed(6)
    cl, nchw = torch.channels_last, torch.contiguous_format
    for shape, offset, layout in (((3, 4, 5, 5), 0.0, cl), ((3, 4, 5, 5), 1e3, cl),
                                  ((2, 4, 24, 24), 0.0, cl), ((3, 4, 5, 5), 0.0, nchw),
                                  ((3, 4, 5, 5), 1e3, nchw)):
        x = (torch.randn(shape, generator=gen) + offset).contiguous(memory_format=layout)
        w, b = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
        dy = torch.randn(shape, generator=gen).contiguous(memory_format=layout)
        opcheck(torch.ops.normkit.group_norm.default, (x, 2, w, b, 1e-5))
        opcheck(torch.ops.normkit.group_norm.default,
                (x.clone().requires_grad_(), 2, w.clone().requires_grad_(), None, 1e-5))
        _, hi, lo, rstd = torch.ops.normkit.group_norm(x, 2, w, b, 1e-5)
        opcheck(torch.ops.normkit.group_norm_backward.default,
                (dy, x, 2, hi, lo, rstd, w, b, [True, True, False]))


@pytest.mark.parametrize("shape,offset,biased,channels_last", [
    ((8, 6, 5, 5), 0.0, False, True),       # torch's kernel inside the operator
    ((8, 6, 5, 5), 1e3, True, True),        # ill-conditioned: compensated
    ((16, 6, 24, 24), 0.5, False, True),    # > 8192 values per channel: the slice-sums engine
    ((4, 6, 2, 3, 4), 1.0, False, True),    # channels_last_3d
    ((8, 6, 5, 5), 0.5, False, False),      # NCHW below the engine's size: torch's kernel
    ((16, 6, 24, 24), 0.5, True, False),    # NCHW: the slice-sums engine
    ((16, 6, 24, 24), 1e3, False, False),   # NCHW, ill-conditioned: compensated
    ((32, 6, 600), 1.0, False, False),      # (N, C, L): the engine
    ((4, 6, 4, 8, 8), 1.0, False, False),   # NCDHW: the engine
], ids=["torch-kernel", "compensated", "engine", "3d", "nchw-kernel", "nchw-engine",
        "nchw-compensated", "ncl", "ncdhw"])
def test_compiled_batch_norm_is_one_operator_each_way(shape, offset, biased, channels_last,
                                                      monkeypatch):
    """Training BatchNorm, contiguous or channels-last, compiles to
    normkit::batch_norm_train and its backward operator; the running statistics are
    updated in the graph from the batch statistics it returns: eager mode's values,
    gradients and buffers."""
    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 1 << 12 if not channels_last else 1 << 15)
    torch._dynamo.reset()
    backend, seen = recording_backend()
    torch.manual_seed(7)
    make = {3: normkit.BatchNorm1d, 4: normkit.BatchNorm2d, 5: normkit.BatchNorm3d}[len(shape)]
    eager = make(6, unbiased_running_var=not biased)
    twin, compiled = _twins(eager, backend)
    layout = (torch.contiguous_format if not channels_last
              else torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    for step in range(2):
        x = (torch.randn(shape, dtype=torch.float64) * 2 + offset + step).float()
        _step_both(eager, twin, compiled, x.contiguous(memory_format=layout), layout)
    for (name, a), b in zip(eager.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    assert {"normkit.batch_norm_train.default",
            "normkit.batch_norm_train_backward.default"} <= set(seen), seen


@pytest.mark.parametrize("shape,offset,layout", [
    ((8, 4, 5, 5), 0.5, "nchw"),        # below the engine's size: torch's kernel
    ((16, 4, 24, 24), 0.5, "nchw"),     # the slice-sums engine
    ((16, 4, 24, 24), 1e4, "nchw"),     # ill-conditioned: compensated
    ((32, 4, 600), 1.0, "nchw"),        # (N, C, L)
    ((8, 4, 5, 5), 0.5, "cl"),          # torch's channels-last kernel
    ((16, 4, 24, 24), 0.5, "cl"),       # > 8192 values per channel: the engine
    ((16, 4, 24, 24), 1e4, "cl"),       # ill-conditioned: compensated
], ids=["nchw-kernel", "nchw-engine", "nchw-compensated", "ncl", "cl-kernel", "cl-engine",
        "cl-compensated"])
def test_batch_norm_operators_match_the_float64_oracle(shape, offset, layout, monkeypatch):
    """normkit::batch_norm_train and its backward operator, called directly, against the
    plain two-pass float64 formulas on the same input: output, batch mean and biased
    variance, and all three gradients, within the float32 tolerance table."""
    from oracle import TOL, assert_close, assert_grad_close, channel_view, normalize64

    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 1 << 12)
    gen = torch.Generator().manual_seed(12)
    fmt = torch.contiguous_format if layout == "nchw" else torch.channels_last
    x = ((torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + offset).float()
         .contiguous(memory_format=fmt))
    w = torch.rand(4, generator=gen) + 0.5
    b = torch.randn(4, generator=gen)
    dy = torch.randn(shape, generator=gen).contiguous(memory_format=fmt)
    dims = (0,) + tuple(range(2, x.dim()))
    y, hi, lo, rstd, var = torch.ops.normkit.batch_norm_train(x, w, b, 1e-5)
    x64 = x.double().requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    ref = normalize64(x64, dims, channel_view(w64, x.dim()), channel_view(b64, x.dim()))
    assert y.is_contiguous(memory_format=fmt)
    assert_close(y, ref, torch.float32)
    # (the statistics relative to their size: the table's float32 rtol, no atol; the
    # compensated path keeps the mean at an offset of 1e4 as a float32 hi/lo pair)
    rtol = TOL[torch.float32]["rtol"]
    torch.testing.assert_close(hi.double() + lo.double(), x64.detach().mean(dims), rtol=rtol,
                               atol=0)
    torch.testing.assert_close(var.double(), x64.detach().var(dims, correction=0), rtol=rtol,
                               atol=0)
    got = torch.ops.normkit.batch_norm_train_backward(dy, x, hi, lo, rstd, w, 1e-5,
                                                      [True, True, True])
    expected = torch.autograd.grad(ref, (x64, w64, b64), dy.double())
    for g, e, name in zip(got, expected, ("dx", "dweight", "dbias"), strict=True):
        assert_grad_close(g, e, torch.float32, name)


def test_batch_norm_operators_pass_opcheck_on_every_path(monkeypatch):
    import inspect

    from torch.library import opcheck

    if "rtol" not in inspect.signature(opcheck).parameters:
        pytest.skip("this torch's opcheck takes no tolerances (torch 2.4); the weight and "
                    "bias gradient sums below need rtol=1e-5")

    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 1 << 12)
    gen = torch.Generator().manual_seed(8)
    cl, nchw = torch.channels_last, torch.contiguous_format
    for shape, offset, layout in (((8, 4, 5, 5), 0.0, cl), ((8, 4, 5, 5), 1e3, cl),
                                  ((16, 4, 24, 24), 0.0, cl), ((8, 4, 5, 5), 0.0, nchw),
                                  ((16, 4, 24, 24), 0.0, nchw), ((16, 4, 24, 24), 1e3, nchw)):
        x = (torch.randn(shape, generator=gen) + offset).contiguous(memory_format=layout)
        w, b = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
        dy = torch.randn(shape, generator=gen).contiguous(memory_format=layout)
        # (weight/bias gradients are sums over N*H*W values: AOT hands the backward its
        # gradient in another memory format, so they are summed in another order)
        sums = dict(rtol=1e-5, atol=1e-4)
        opcheck(torch.ops.normkit.batch_norm_train.default, (x, w, b, 1e-5), **sums)
        opcheck(torch.ops.normkit.batch_norm_train.default,
                (x.clone().requires_grad_(), w.clone().requires_grad_(), None, 1e-5), **sums)
        _, hi, lo, rstd, _ = torch.ops.normkit.batch_norm_train(x, w, b, 1e-5)
        opcheck(torch.ops.normkit.batch_norm_train_backward.default,
                (dy, x, hi, lo, rstd, w, 1e-5, [True, True, False]))


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("name", list(IMAGE_LAYERS))
def test_fullgraph_compile_across_image_sizes(name, layout, grad):
    """Images of several sizes through one compiled layer (detection and segmentation
    inference, multi-scale training): from the second size on Dynamo compiles with
    symbolic sizes and strides, and nothing in the layer may need concrete ones (sorting
    strides to choose a reduction did: a graph break on channels-last input without a
    gradient). Outputs equal eager at every size."""
    if name.startswith("BatchRenorm") and RENORM_FULLGRAPH_GAP:
        pytest.skip("torch 2.5-2.10: BatchRenorm's step count breaks a full graph")
    torch._dynamo.reset()
    eager = IMAGE_LAYERS[name](4).train()
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, backend="aot_eager")
    for step, (n, size) in enumerate([(2, 5), (3, 7), (2, 9)]):
        x = torch.randn(n, 4, size, size + 1, generator=torch.Generator().manual_seed(step))
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.set_grad_enabled(grad):
            want, got = eager(x), compiled(x)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("positions", [(3, 3), (4, 4)], ids=["kernel", "engine"])
def test_group_norm_backward_operator_keeps_the_input_layout(positions, monkeypatch):
    """normkit.group_norm_backward's dx has x's layout whatever dy's, as its fake says: on
    channels-last input served by the slice-sums engine it followed dy's layout, so a
    compiled channels-last GroupNorm whose gradient came back contiguous (a flatten and a
    linear head after it) failed in Inductor's stride assertion."""
    from torch.library import opcheck

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0)  # (the engine at this small size)
    monkeypatch.setattr(channels, "GROUP_NORM_MIN_POSITIONS", 16)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, *positions, generator=gen).contiguous(
        memory_format=torch.channels_last)
    w, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    _, mean_hi, mean_lo, rstd = torch.ops.normkit.group_norm(x, 2, w, b, 1e-5)
    dy = torch.randn(x.shape, generator=gen)  # (contiguous)
    opcheck(torch.ops.normkit.group_norm_backward.default,
            (dy, x, 2, mean_hi, mean_lo, rstd, w, b, [True, True, True]))
    dx = torch.ops.normkit.group_norm_backward(dy, x, 2, mean_hi, mean_lo, rstd, w, b,
                                               [True, True, True])[0]
    assert dx.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("route", ["kernel", "compensated", "engine"])
@pytest.mark.parametrize("op", ["layer_norm", "group_norm", "batch_norm_train"])
def test_backward_operators_return_dx_in_the_inputs_layout(op, route, monkeypatch):
    """Every backward operator's dx has its input's layout whatever the gradient's, as
    their fake implementations say. The compensated paths' (and the channels-last
    engine's) dx followed dy's strides: a compiled LayerNorm on far off-center features
    followed by a transpose failed in Inductor's stride assertion (reproduced); opcheck's
    fake-tensor comparison finds it on small inputs."""
    from torch.library import opcheck

    from normkit.kernels import native

    if route == "engine":  # (the slice-sums engine for channels-last input of this size)
        if op == "layer_norm":
            pytest.skip("LayerNorm rows take no engine")
        for where, attr, value in ((channels, "MIN_ELEMENTS", 0),
                                   (channels, "GROUP_NORM_MIN_POSITIONS", 16),
                                   (native, "CHANNELS_LAST_MAX_COUNT", 1),
                                   (channels, "CHANNELS_LAST_BACKWARD_MAX_COUNT", 1)):
            monkeypatch.setattr(where, attr, value)
    offset = 1e4 if route == "compensated" else 0.0
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    if op == "layer_norm":
        x = torch.randn(6, 8, generator=gen) + offset
        stats = torch.ops.normkit.layer_norm(x, [8], w, b, 1e-5)[1:]
        dys = [torch.randn(8, 6, generator=gen).t()]  # (a transposed gradient)
        args = lambda dy: (dy, x, [8], *stats, w, b, [True, True, True])  # noqa: E731
    else:
        dys = []
        for layout in (torch.contiguous_format, torch.channels_last):
            x = (torch.randn(4, 8, 4, 4, generator=gen) + offset).contiguous(
                memory_format=layout)
            other = (torch.channels_last if layout == torch.contiguous_format
                     else torch.contiguous_format)
            dys.append((x, torch.randn(4, 8, 4, 4, generator=gen).contiguous(
                memory_format=other)))
    backward = getattr(torch.ops.normkit, f"{op}_backward").default
    if op == "layer_norm":
        for dy in dys:
            opcheck(backward, args(dy))
        return
    for x, dy in dys:
        if op == "group_norm":
            stats = torch.ops.normkit.group_norm(x, 2, w, b, 1e-5)[1:]
            opcheck(backward, (dy, x, 2, *stats, w, b, [True, True, True]))
        else:
            stats = torch.ops.normkit.batch_norm_train(x, w, b, 1e-5)[1:4]
            opcheck(backward, (dy, x, *stats, w, 1e-5, [True, True, True]))


@pytest.mark.parametrize("make, shape", [
    (lambda: normkit.BatchRenorm1d(6, warmup_steps=0, r_max_steps=1, d_max_steps=1), (8, 6)),
    (lambda: normkit.PowerNorm(6, warmup_iters=0, group_num=2), (4, 5, 6)),
], ids=["batch-renorm", "power-norm"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layers_reading_buffers_they_update_keep_eager_gradients(make, shape, backend):
    """BatchRenorm's r and d and PowerNorm's divisor come from running statistics the
    same forward then updates in place: torch 2.13's compiled backward read them after
    the update (gradients 1-10 % off from the second step on) until they were read
    through ``normkit::snapshot``."""
    if isinstance(make(), normkit.BatchRenorm1d) and RENORM_FULLGRAPH_GAP:
        pytest.skip("torch 2.5-2.10: BatchRenorm's step count breaks a full graph")
    torch._dynamo.reset()
    eager = make()
    with torch.no_grad():
        for name, buffer in eager.named_buffers():
            if buffer.is_floating_point() and name != "ema_gz":
                buffer.mul_(3.0).add_(0.5)  # (running statistics away from the batch's)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    for step in range(3):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        dy = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step))
        eager(xa).backward(dy)
        compiled(xb).backward(dy)
        torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, s=step: f"dx at step {s + 1}: {m}")
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=name)
    for (name, a), b in zip(eager.named_buffers(), compiled_model.buffers(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)


# ------------------------------------ constants of the process without importing Dynamo

def test_importing_normkit_does_not_import_dynamo():
    """``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (2.7 s on a
    2-core VM, more than torch itself): ``import normkit`` took 5 s until the Triton
    package marked its constants itself. Checked in a fresh process, with the modules the
    command line and the lab import."""
    code = ("import sys, normkit, normkit.cli, normkit.lab, normkit.bench, normkit.tools; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout[-2000:]


def test_the_constant_marker_is_the_one_torchs_decorator_sets():
    def torchs():
        return 1

    def normkits():
        return 1

    torch.compiler.assume_constant_result(torchs)
    assert constant_result(normkits) is normkits
    assert vars(normkits) == vars(torchs) != {}
    for name in ("available", "_device_problem"):
        assert vars(getattr(triton_kernels, name)) == vars(torchs), name
    from normkit.norms import _core
    if _core._STRICT_EXPORT_UNFLAGGED:  # (torch 2.4-2.7: strict export told by Dynamo)
        assert vars(_core._dynamo_strict_export) == vars(torchs)


def test_a_marked_function_is_a_constant_under_fullgraph_compile():
    """What the marker is for: Dynamo calls the function once while tracing and bakes in
    its result instead of tracing into it (here a ``functools.cache`` wrapper and an
    import, which break the graph -- ``available()`` broke it so on an H200)."""
    torch._dynamo.reset()
    calls = []

    @functools.cache
    def probe():
        calls.append(1)
        return importlib.import_module("math").pi

    @constant_result
    def constant():
        return probe() > 3

    def f(x):
        return x * 2 if constant() else x

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), 2 * x, rtol=0, atol=0)
    torch.testing.assert_close(compiled(x + 1), 2 * (x + 1), rtol=0, atol=0)
    assert calls == [1]
