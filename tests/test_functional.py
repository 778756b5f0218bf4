"""normkit.functional: torch.nn.functional-compatible signatures and behaviour."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as TF

import normkit
import normkit.functional as F
from normkit.norms import fused

PAIRS = ["batch_norm", "instance_norm", "layer_norm", "rms_norm", "group_norm"]


@pytest.mark.parametrize("name", PAIRS)
def test_signature_extends_torch(name):
    ours = inspect.signature(getattr(F, name)).parameters
    theirs = inspect.signature(getattr(TF, name)).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for key, param in theirs.items():
        assert ours[key].default == param.default, key
    assert ours["backend"].kind is inspect.Parameter.KEYWORD_ONLY


def test_positional_call_like_torch():
    x = torch.randn(4, 3, 5)
    rm, rv = torch.zeros(3), torch.ones(3)
    rm_t, rv_t = rm.clone(), rv.clone()
    w, b = torch.rand(3), torch.randn(3)
    torch.testing.assert_close(F.batch_norm(x, rm, rv, w, b, True, 0.3, 1e-3),
                               TF.batch_norm(x, rm_t, rv_t, w, b, True, 0.3, 1e-3))
    torch.testing.assert_close(rm, rm_t)
    torch.testing.assert_close(rv, rv_t)
    torch.testing.assert_close(F.group_norm(x, 3, w, b, 1e-3), TF.group_norm(x, 3, w, b, 1e-3))
    torch.testing.assert_close(F.layer_norm(x, [5]), TF.layer_norm(x, [5]))
    torch.testing.assert_close(F.layer_norm(x, 5), TF.layer_norm(x, (5,)))
    torch.testing.assert_close(F.rms_norm(x, [5], None, 1e-3), TF.rms_norm(x, [5], None, 1e-3))
    torch.testing.assert_close(F.instance_norm(x, None, None, w, b),
                               TF.instance_norm(x, None, None, w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("input_dtype", ["float32", "low"])
def test_autocast_gives_torchs_dtypes_and_values(dtype, input_dtype):
    pairs = [(normkit.BatchNorm2d(8), torch.nn.BatchNorm2d(8)),
             (normkit.LayerNorm(5), torch.nn.LayerNorm(5)),
             (normkit.GroupNorm(2, 8), torch.nn.GroupNorm(2, 8)),
             (normkit.InstanceNorm2d(8), torch.nn.InstanceNorm2d(8)),
             (normkit.RMSNorm(5), torch.nn.RMSNorm(5))]
    x = torch.randn(4, 8, 5, 5)
    if input_dtype == "low":
        x = x.to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        for nk, tm in pairs:
            y, yt = nk(x), tm(x)
            # (torch 2.4's composite RMSNorm computes low-precision input in that precision
            # and returns float32 with a float32 weight; normkit keeps the input's dtype,
            # as documented and as torch 2.11 and 2.13 do: there the oracle is float64)
            want = x.dtype if isinstance(nk, normkit.RMSNorm) and x.dtype == dtype else yt.dtype
            assert y.dtype == want, type(nk).__name__
            if yt.dtype != want:
                yt = torch.nn.functional.rms_norm(x.double(), (5,), tm.weight.double())
            tol = 2e-5 if y.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.float(), yt.float(), atol=tol, rtol=tol)


def test_autocast_training_step_inside_a_model():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), normkit.BatchNorm2d(8),
                                torch.nn.ReLU(), normkit.GroupNorm(2, 8))
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_functional_keeps_channels_last():
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    for y in (F.batch_norm(x, None, None, training=True), F.group_norm(x, 4),
              F.layer_norm2d(x), F.instance_norm(x)):
        assert y.is_contiguous(memory_format=torch.channels_last)


def _path(y):
    """The autograd node that computed ``y``, looking through views."""
    fn = y.grad_fn
    while type(fn).__name__.startswith(("View", "UnsafeView", "Permute", "Reshape", "Clone")):
        fn = fn.next_functions[0][0]
    return type(fn).__name__


def test_backend_is_read_at_call_time():
    ln = normkit.LayerNorm(6)
    x = torch.randn(3, 6, requires_grad=True)
    assert _path(ln(x)) == "NativeLayerNormBackward0"  # well conditioned: torch's kernel
    assert "NormalizeFunction" in _path(ln(x + 1e4))     # offset: the robust path
    ln.backend = "eager"
    assert "NormalizeFunction" in _path(ln(x))
    ln.backend = "reference"
    assert "NormalizeFunction" not in _path(ln(x)) and "Native" not in _path(ln(x))
    assert "backend='reference'" in repr(ln)


@pytest.mark.parametrize("make,shape,layout,fast", [
    (lambda: normkit.BatchNorm2d(4), (8, 4, 5, 5), "contiguous", "SliceNorm"),
    (lambda: normkit.BatchNorm2d(4), (8, 4, 3, 3), "contiguous", "NativeBatchNorm"),
    (lambda: normkit.BatchNorm2d(4), (8, 4, 5, 5), "channels_last", "NativeBatchNorm"),
    (lambda: normkit.GroupNorm(2, 4), (8, 4, 5, 5), "contiguous", "NativeGroupNorm"),
    (lambda: normkit.GroupNorm(2, 4), (8, 4, 5, 5), "channels_last", "NativeGroupNorm"),
    (lambda: normkit.GroupNorm(2, 4), (8, 4, 24, 24), "channels_last", "SliceNorm"),
    (lambda: normkit.InstanceNorm2d(4), (8, 4, 5, 5), "contiguous", "NativeGroupNorm"),
    (lambda: normkit.InstanceNorm2d(4), (8, 4, 5, 5), "channels_last", "SliceNorm"),
    (lambda: normkit.LayerNorm2d(4), (8, 4, 5, 5), "channels_last", "NativeLayerNorm"),
    (lambda: normkit.LayerNorm2d(4), (8, 4, 5, 5), "contiguous", "NativeLayerNorm"),
    (lambda: normkit.LayerNorm(5), (8, 4, 5, 5), "contiguous", "NativeLayerNorm"),
], ids=["bn", "bn-small", "bn-cl", "gn", "gn-cl", "gn-cl-large", "in", "in-cl", "ln2d-cl",
        "ln2d", "ln"])
def test_auto_uses_torchs_kernel_only_where_it_is_accurate(make, shape, layout, fast,
                                                           monkeypatch):
    """Every fast path is taken on well-conditioned data and refused at an offset."""
    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0)  # small inputs take the slice engine
    module = make()
    x = torch.randn(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    path = _path(module(x))
    assert fast in path, path
    offset = _path(module(x + 1e3))
    assert "NormalizeFunction" in offset, offset


STRIDED = {  # a strided view of each layer's input, and the node of its dense fast path
    "ln-transposed": (lambda: normkit.LayerNorm(16),
                      lambda t: t(7, 5, 16).transpose(0, 1), "NativeLayerNorm"),
    "ln-sliced": (lambda: normkit.LayerNorm(16), lambda t: t(9, 32)[:, :16], "NativeLayerNorm"),
    "gn-every-other-sample": (lambda: normkit.GroupNorm(2, 4),
                              lambda t: t(8, 4, 5, 5)[::2], "NativeGroupNorm"),
    "in-sliced-channels": (lambda: normkit.InstanceNorm2d(4, affine=True),
                           lambda t: t(4, 8, 5, 5)[:, :4], "NativeGroupNorm"),
    "bn-sliced-channels": (lambda: normkit.BatchNorm2d(4), lambda t: t(6, 8, 3, 3)[:, :4],
                           "NativeBatchNorm"),
    # (the activation's node on top: values and gradients only)
    "bn-act-sliced-channels": (lambda: normkit.BatchNormAct2d(4, act="elu"),
                               lambda t: t(6, 8, 3, 3)[:, :4], None),
    "bn-act-inplace-sliced-channels": (
        lambda: normkit.BatchNormAct2d(4, act="leaky_relu", memory="inplace"),
        lambda t: t(6, 8, 3, 3)[:, :4], None),
    "gn-act-every-other-sample": (lambda: normkit.GroupNormAct(2, 4, act="silu"),
                                  lambda t: t(8, 4, 5, 5)[::2], None),
}


@pytest.mark.parametrize("offset", [0.5, 1e3], ids=["fast", "compensated"])
@pytest.mark.parametrize("name", list(STRIDED))
def test_strided_views_take_the_dense_fast_paths(name, offset):
    """A strided view is copied to a dense tensor first (as torch's kernels do) and takes
    the fast path its dense copy takes; ill-conditioned data the compensated core. The
    output and the gradient of the view itself equal the float64 reference."""
    from oracle import assert_close, assert_grad_close, reference_forward

    make, view, node = STRIDED[name]
    gen = torch.Generator().manual_seed(5)
    x = view(lambda *s: (torch.randn(*s, generator=gen, dtype=torch.float64) + offset)
             .float()).requires_grad_()  # (a leaf that is a strided view)
    assert not x.is_contiguous() and x.is_leaf
    module = make()
    before = x.detach().clone()
    y = module(x)
    if node is not None:
        assert (node if offset < 1 else "NormalizeFunction") in _path(y), _path(y)
    assert torch.equal(x.detach(), before)  # (the view itself is never overwritten)
    twin = make().double()
    twin.load_state_dict(module.state_dict())
    ref_x = x.detach().double().requires_grad_()
    if isinstance(module, normkit.GroupNormAct):  # (the oracle knows the plain norm)
        twin = normkit.GroupNorm(module.num_groups, module.num_channels).double()
        twin.load_state_dict(module.state_dict())
    ref = reference_forward(twin, ref_x, input_dtype=torch.float32)
    act = getattr(module, "act", None)  # the norm's reference, then the activation
    if act is not None:
        ref = {"elu": TF.elu, "leaky_relu": TF.leaky_relu, "silu": TF.silu}[act](ref)
    assert_close(y, ref, torch.float32)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy), ref.backward(dy.double())
    assert x.grad is not None and x.grad.shape == x.shape
    assert_grad_close(x.grad, ref_x.grad, torch.float32)


HALF_CASES = {  # a 16-bit input past float32's fast-path limits, and its layer
    # channels-last BatchNorm past 8192 values per channel (4 x 48 x 48 = 9216)
    "bn-cl-many-values": (lambda: normkit.BatchNorm2d(4), (4, 4, 48, 48), True),
    "bn-act-cl-many-values": (lambda: normkit.BatchNormAct2d(4, act="elu"), (4, 4, 48, 48),
                              True),
    # channels-last GroupNorm from 512 positions (24 x 24 = 576)
    "gn-cl-many-positions": (lambda: normkit.GroupNorm(2, 4), (3, 4, 24, 24), True),
    "gn-act-cl-many-positions": (lambda: normkit.GroupNormAct(2, 4, act="silu"),
                                 (3, 4, 24, 24), True),
    "in-nchw": (lambda: normkit.InstanceNorm2d(4, affine=True, track_running_stats=True),
                (3, 4, 6, 7), False),
    "in-cl": (lambda: normkit.InstanceNorm2d(4, affine=True), (3, 4, 24, 24), True),
    "add-layer-norm": (lambda: normkit.AddLayerNorm(24), (9, 24), False),
}


@pytest.mark.parametrize("param_dtype", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(HALF_CASES))
def test_16bit_input_takes_torchs_kernels_past_float32_limits(name, dtype, param_dtype,
                                                              monkeypatch):
    """float16/bfloat16 input whose float32 twin would take the slice-sums engine (which
    serves float32/float64 only) or the compensated core runs torch's kernels instead:
    their float32 sums stay far under the output's rounding. The compensated core is
    never called; output, input gradient and running statistics equal float64 within the
    dtype's tolerance, with 16-bit or float32 parameters."""
    from oracle import GRAD_TOL, assert_close, reference_forward

    from normkit.norms import fused

    def forbidden(*args, **kwargs):
        raise AssertionError("the compensated core ran")

    monkeypatch.setattr(F, "normalize", forbidden)
    monkeypatch.setattr(fused, "normalize", forbidden)
    monkeypatch.setattr(fused, "FUSED_ACT_MIN_ELEMENTS", 0)  # (the fused nodes at any size)
    make, shape, channels_last = HALF_CASES[name]
    module = make()
    module.to(dtype if param_dtype == "same" else torch.float32)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    x64 = torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5 + 1.0
    x = x64.to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    if name == "add-layer-norm":
        residual = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        y, _ = module(x, residual)
        s64 = x.detach().double() + residual.double()
        ref_x = s64.requires_grad_()  # (the sum's gradient is the input's)
        ref = torch.nn.functional.layer_norm(ref_x, (shape[-1],), module.weight.double(),
                                             module.bias.double())
    else:
        y = module(x)
        ref_x = x.detach().double().requires_grad_()
        twin = module
        if isinstance(module, normkit.GroupNormAct):
            twin = normkit.GroupNorm(2, 4).to(module.weight.dtype)
            twin.load_state_dict(module.state_dict())
        if hasattr(module, "running_mean") and module.running_mean is not None:
            twin = make().to(module.weight.dtype).train()  # fresh buffers: the same mode
            twin.load_state_dict({k: v for k, v in module.state_dict().items()
                                  if not k.startswith("running") and "batches" not in k},
                                 strict=False)
        ref = reference_forward(twin, ref_x, input_dtype=dtype)
        act = getattr(module, "act", None)
        if act is not None:
            ref = {"elu": TF.elu, "silu": TF.silu}[act](ref)
    assert y.dtype == dtype
    assert_close(y, ref, dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    y.backward(dy), ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=GRAD_TOL[dtype],
                               atol=GRAD_TOL[dtype] * float(ref_x.grad.abs().max()))
    if getattr(module, "running_mean", None) is not None:
        dims = (0, *range(2, len(shape)))
        per = (lambda t: t.mean(dims)) if "bn" in name else (
            lambda t: t.mean(dims[1:]).mean(0))
        torch.testing.assert_close(module.running_mean.double(), 0.1 * per(x64.to(dtype)
                                                                           .double()),
                                   rtol=GRAD_TOL[dtype], atol=GRAD_TOL[dtype])
    with torch.no_grad():  # (inference takes its own paths: the same result)
        again = module(x.detach(), residual)[0] if name == "add-layer-norm" else module(
            x.detach())
    assert_close(again, ref.detach(), dtype, "no-grad output")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_inplace_abn_takes_torchs_kernel_with_float32_statistics(dtype, layout,
                                                                        monkeypatch):
    """In-Place ABN on 16-bit input takes torch's fused kernel with float32 parameters
    (autocast's, or float32 stand-ins for a 16-bit module's), whose statistics come back
    in float32: its backward recovers the input from the 16-bit output with them. (With
    16-bit parameters it took normkit's compensated core until the stand-ins, several
    times slower; RESULTS.md "In-Place ABN of 16-bit modules".)"""
    from oracle import GRAD_TOL, assert_close

    from normkit.norms import fused

    calls = []
    real = fused._fast_batch_norm_16bit
    monkeypatch.setattr(fused, "_fast_batch_norm_16bit",
                        lambda *a: calls.append(real(*a)) or calls[-1])
    gen = torch.Generator().manual_seed(4)
    x64 = torch.randn(6, 5, 12, 12, generator=gen, dtype=torch.float64) * 2 + 0.5
    x = x64.to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    for param_dtype in (torch.float32, dtype):
        module = normkit.BatchNormAct2d(5, act="leaky_relu", negative_slope=0.1,
                                        memory="inplace").to(param_dtype)
        with torch.no_grad():
            module.weight.copy_(torch.rand(5, generator=gen) + 0.5)
            module.bias.copy_(torch.randn(5, generator=gen))
        leaf = x.detach().clone().requires_grad_()
        z = module(leaf * 1)
        assert calls and calls[-1] is not None, (param_dtype, calls)
        assert calls[-1][1].dtype == torch.float32  # (the statistics)
        calls.clear()
        ref_x = x.detach().double().requires_grad_()
        w64, b64 = (p.detach().double().requires_grad_() for p in (module.weight,
                                                                   module.bias))
        ref = TF.leaky_relu(TF.batch_norm(ref_x, None, None, w64, b64, training=True), 0.1)
        assert_close(z, ref, dtype)
        dz = torch.randn(z.shape, generator=gen, dtype=torch.float64)
        z.backward(dz.to(dtype)), ref.backward(dz)
        for got, want in ((leaf.grad, ref_x.grad), (module.weight.grad, w64.grad)):
            torch.testing.assert_close(got.double(), want, rtol=GRAD_TOL[dtype],
                                       atol=GRAD_TOL[dtype] * float(want.abs().max()))


@pytest.mark.parametrize("shape,layout", [((8, 4, 3, 3), "contiguous"),
                                          ((8, 4, 5, 5), "channels_last"), ((16, 4), "rows")])
@pytest.mark.parametrize("offset", [0.5, 1e3], ids=["kernel", "compensated"])
def test_biased_running_variance_takes_torchs_kernel_where_accurate(shape, layout, offset):
    """``unbiased_running_var=False`` (Keras/Flax): where BatchNorm keeps torch's kernel,
    the kernel runs without the buffers (it would store the unbiased variance) and the
    buffers get the biased variance from its statistics; ill-conditioned data take the
    compensated core. Output, gradients and buffers equal float64 either way."""
    from oracle import assert_close, assert_grad_close

    c = shape[1]
    bn = (normkit.BatchNorm2d if len(shape) == 4 else normkit.BatchNorm1d)(
        c, momentum=0.3, eps=1e-3, unbiased_running_var=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(c, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(c, generator=gen))
        bn.running_var.fill_(2.0)
    x64 = torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5 + offset
    x = x64.float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = bn(x)
    path = _path(y)
    assert ("NativeBatchNorm" if offset < 1 else "NormalizeFunction") in path, path
    dims = (0, *range(2, x64.dim()))
    view = (1, c) + (1,) * (x64.dim() - 2)
    ref_x = x.detach().double().requires_grad_()
    mean, var = ref_x.mean(dims), ref_x.var(dims, correction=0)
    ref = ((ref_x - mean.view(view)) / (var.view(view) + 1e-3).sqrt()
           * bn.weight.detach().double().view(view) + bn.bias.detach().double().view(view))
    assert_close(y, ref, torch.float32)
    dy = torch.randn(shape, generator=gen)
    y.backward(dy), ref.backward(dy.double())
    assert_grad_close(x.grad, ref_x.grad, torch.float32)
    torch.testing.assert_close(bn.running_mean.double(), 0.3 * mean.detach(),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), 0.7 * 2.0 + 0.3 * var.detach(),
                               rtol=1e-6, atol=1e-6)


def test_rejected_fast_path_does_not_double_count_running_stats():
    nk, tm = normkit.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    x = torch.randn(16, 3, dtype=torch.float64).float() * 0.01 + 5.0  # ratio ~500: rejected
    nk(x), tm(x)
    torch.testing.assert_close(nk.running_mean, tm.running_mean)
    torch.testing.assert_close(nk.running_var, tm.running_var, rtol=1e-3, atol=1e-7)
    assert int(nk.num_batches_tracked) == 1


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("offset", [0.5, 1e3], ids=["kernel", "compensated"])
def test_instance_norm_running_statistics_take_inference_batch_norm(layout, offset,
                                                                     monkeypatch):
    """InstanceNorm with use_input_stats=False normalizes with per-channel running
    statistics: inference BatchNorm's math, so torch's inference kernel where its check
    passes, normkit's scale_shift past it; values and gradients equal float64."""
    from oracle import assert_close, assert_grad_close

    from normkit.kernels import native

    served = []
    check = native.batch_norm_eval
    monkeypatch.setattr(native, "batch_norm_eval",
                        lambda *a: served.append(check(*a)) or served[-1])
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 4, 5, 6, generator=gen)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    rm = torch.randn(4, generator=gen) * offset
    rv = torch.rand(4, generator=gen) + 0.5
    w, b = (torch.randn(4, generator=gen).requires_grad_() for _ in range(2))
    y = F.instance_norm(x, rm, rv, w, b, use_input_stats=False)
    assert (served[-1] is not None) == (offset < 1.0)
    assert y.is_contiguous(memory_format=torch.channels_last if layout == "channels_last"
                           else torch.contiguous_format)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.nn.functional.instance_norm(x64, rm.double(), rv.double(), w64, b64,
                                            use_input_stats=False)
    assert_close(y, ref, torch.float32)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    want = torch.autograd.grad(ref, (x64, w64, b64), dy.double())
    for got, expected in zip(grads, want, strict=True):
        assert_grad_close(got, expected, torch.float32)


@pytest.mark.parametrize(("shape", "layout"), [
    ((4, 8, 32, 32), "channels_last"), ((2, 8, 4, 16, 16), "channels_last_3d"),
    ((2048, 8), "rows"), ((4, 8, 32, 32), "contiguous"), ((2, 8, 4, 4), "channels_last")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("huge_pages", [False, True], ids=["small", "huge-page-output"])
def test_inference_batch_norm_fold_on_rows_last_input(shape, layout, dtype, affine, grad,
                                                      huge_pages, monkeypatch):
    """Inference BatchNorm of channels-last or 2D input from 2^14 elements without a
    gradient for its parameters (the input's may be wanted: the addcmul's is dy * scale)
    is one broadcast addcmul of torch's fold (native._fold_eval); NCHW input, small input
    and, in grad mode, trainable affine parameters keep torch's kernel. Either way the
    output and the input gradient keep the layout and equal float64 and torch's module;
    also where the output is a huge-page out= tensor (which autograd refuses: not when
    the input needs a gradient)."""
    from oracle import assert_close

    from normkit.kernels import memory, native

    if huge_pages:  # (outputs this small take kernels.memory's out= path too)
        monkeypatch.setattr(memory, "MIN_BYTES", 0)
    folds = []
    fold = native._fold_eval
    monkeypatch.setattr(native, "_fold_eval", lambda *a: folds.append(1) or fold(*a))
    gen = torch.Generator().manual_seed(10)
    c = shape[1]
    cls = {2: normkit.BatchNorm1d, 4: normkit.BatchNorm2d, 5: normkit.BatchNorm3d}[len(shape)]
    module = cls(c, affine=affine).to(dtype).eval()
    with torch.no_grad():
        module.running_mean.copy_(torch.randn(c, generator=gen) * 2)
        module.running_var.copy_(torch.rand(c, generator=gen) + 0.25)
        if affine:
            module.weight.copy_(torch.randn(c, generator=gen))
            module.bias.copy_(torch.randn(c, generator=gen))
    x = torch.randn(shape, generator=gen, dtype=dtype)
    fmt = {"channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d,
           "rows": torch.contiguous_format, "contiguous": torch.contiguous_format}[layout]
    x = x.contiguous(memory_format=fmt).requires_grad_(grad)
    with torch.set_grad_enabled(grad):  # (in grad mode the affine parameters need one)
        y = module(x)
    taken = layout != "contiguous" and x.numel() >= native.BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS
    assert bool(folds) == (taken and not (grad and affine))
    assert y.is_contiguous(memory_format=fmt) and y.dtype == dtype
    torch_module = {2: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
                    5: torch.nn.BatchNorm3d}[len(shape)](c, affine=affine).double().eval()
    torch_module.load_state_dict(module.state_dict())
    x64 = x.detach().double().requires_grad_(grad)
    ref = torch_module(x64)
    assert_close(y, ref, dtype)
    if grad:
        dy = torch.randn(shape, generator=gen, dtype=dtype).contiguous(memory_format=fmt)
        (dx,) = torch.autograd.grad(y, x, dy)
        (dx64,) = torch.autograd.grad(ref, x64, dy.double())
        assert dx.is_contiguous(memory_format=fmt)
        assert_close(dx, dx64, dtype, "input grad")


@pytest.mark.parametrize(("shape", "layout"), [
    ((4, 8, 16, 16), "contiguous"), ((4, 8, 32, 32), "channels_last"),
    ((2, 8, 3, 3), "channels_last"), ((2, 8, 3, 3), "contiguous"), ((64, 8), "rows"),
    ((2048, 8), "rows"), ((4, 8, 9), "contiguous"), ((2, 8, 4, 6, 6), "channels_last_3d")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("wanted", ["x", "params", "all"])
@pytest.mark.parametrize("floors", ["measured", "zero"])
def test_inference_batch_norm_with_a_gradient(shape, layout, dtype, affine, wanted, floors,
                                              monkeypatch):
    """Inference BatchNorm (fixed statistics) in grad mode. Channels-last or 2D input
    from 2^14 elements whose input alone needs a gradient: the broadcast-addcmul fold.
    NCHW input whose input alone needs one: torch's kernel forward, ``dy * scale``
    backward (from EVAL_INPUT_GRAD_MIN_ELEMENTS); with trainable affine: torch's kernels
    on the ``(1, N*C, L)`` view (from EVAL_PER_SLICE_MIN_ELEMENTS); else torch's kernel.
    Output and every gradient equal float64 torch, in the input's layout."""
    from oracle import assert_close, assert_grad_close

    from normkit.kernels import native

    if wanted != "x" and not affine:
        pytest.skip("no parameters")
    if floors == "zero":
        monkeypatch.setattr(native, "EVAL_INPUT_GRAD_MIN_ELEMENTS", 0)
        monkeypatch.setattr(native, "EVAL_PER_SLICE_MIN_ELEMENTS", 0)
    taken = []
    fold, per_slice = native._fold_eval, native._eval_per_slice
    node = native._EvalInputGradFunction.apply
    monkeypatch.setattr(native, "_fold_eval", lambda *a: taken.append("fold") or fold(*a))
    monkeypatch.setattr(native, "_eval_per_slice",
                        lambda *a: taken.append("per-slice") or per_slice(*a))
    monkeypatch.setattr(native._EvalInputGradFunction, "apply",
                        lambda *a: taken.append("node") or node(*a))
    gen = torch.Generator().manual_seed(12)
    c = shape[1]
    cls = {2: normkit.BatchNorm1d, 3: normkit.BatchNorm1d, 4: normkit.BatchNorm2d,
           5: normkit.BatchNorm3d}[len(shape)]
    module = cls(c, affine=affine).to(dtype).eval()
    with torch.no_grad():
        module.running_mean.copy_(torch.randn(c, generator=gen))
        module.running_var.copy_(torch.rand(c, generator=gen) + 0.25)
        if affine:
            module.weight.copy_(torch.randn(c, generator=gen))
            module.bias.copy_(torch.randn(c, generator=gen))
            module.requires_grad_(wanted != "x")
    fmt = {"channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d,
           "rows": torch.contiguous_format, "contiguous": torch.contiguous_format}[layout]
    x = torch.randn(shape, generator=gen, dtype=dtype).contiguous(memory_format=fmt)
    x.requires_grad_(wanted != "params")
    y = module(x)
    leaves = [t for t in (x, module.weight, module.bias) if t is not None and t.requires_grad]
    dy = torch.randn(shape, generator=gen, dtype=dtype).contiguous(memory_format=fmt)
    grads = torch.autograd.grad(y, leaves, dy)
    if layout != "contiguous":
        want_path = ("fold" if wanted == "x" and
                     x.numel() >= native.BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS else None)
    elif x.dim() == 2:
        want_path = None
    elif wanted == "x":
        want_path = "node" if x.numel() >= native.EVAL_INPUT_GRAD_MIN_ELEMENTS else None
    else:
        want_path = "per-slice" if x.numel() >= native.EVAL_PER_SLICE_MIN_ELEMENTS else None
    assert taken == ([want_path] if want_path else []), taken
    assert y.is_contiguous(memory_format=fmt) and y.dtype == dtype
    torch_module = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
                    5: torch.nn.BatchNorm3d}[len(shape)](c, affine=affine).double().eval()
    torch_module.load_state_dict(module.state_dict())
    torch_module.requires_grad_(wanted != "x")
    x64 = x.detach().double().requires_grad_(wanted != "params")
    ref = torch_module(x64)
    assert_close(y, ref, dtype)
    ref_leaves = [t for t in (x64, torch_module.weight, torch_module.bias)
                  if t is not None and t.requires_grad]
    want = torch.autograd.grad(ref, ref_leaves, dy.double())
    for got, expected in zip(grads, want, strict=True):
        assert_grad_close(got, expected, dtype)
    if wanted != "params":
        assert grads[0].is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("wanted", ["x", "all"])
def test_inference_batch_norm_double_backward(wanted, monkeypatch):
    """Second derivatives of the NCHW inference paths with a gradient (the ``dy * scale``
    node, the per-slice view), by finite differences (float64)."""
    from normkit.kernels import native

    monkeypatch.setattr(native, "EVAL_INPUT_GRAD_MIN_ELEMENTS", 0)
    monkeypatch.setattr(native, "EVAL_PER_SLICE_MIN_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(13)
    rm, rv = torch.randn(3, generator=gen, dtype=torch.float64), torch.rand(
        3, generator=gen, dtype=torch.float64) + 0.5
    x = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w, b = (torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=wanted == "all")
            for _ in range(2))
    inputs = (x, w, b) if wanted == "all" else (x,)

    def fn(x, *params):
        return F.batch_norm(x, rm, rv, *(params or (w, b)), training=False)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("layer", ["BatchNorm2d", "InstanceNorm2d", "FrozenBatchNorm2d"])
@pytest.mark.parametrize(("x_dtype", "buffer_dtype"), [
    (torch.float64, torch.float32), (torch.float32, torch.float64),
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.float16, torch.float16)])
def test_inference_statistics_of_another_dtype(layer, x_dtype, buffer_dtype):
    """Inference with running statistics whose dtype differs from the input's: torch's
    kernel takes 16-bit input with float32 statistics and raises on other mixes, which
    normkit serves on its own path instead; the output keeps the input's dtype and equals
    float64."""
    from oracle import assert_close

    gen = torch.Generator().manual_seed(9)
    module = {"BatchNorm2d": lambda: normkit.BatchNorm2d(6),
              "InstanceNorm2d": lambda: normkit.InstanceNorm2d(6, affine=True,
                                                               track_running_stats=True),
              "FrozenBatchNorm2d": lambda: normkit.FrozenBatchNorm2d(6)}[layer]().eval()
    with torch.no_grad():
        module.running_mean.copy_(torch.randn(6, generator=gen))
        module.running_var.copy_(torch.rand(6, generator=gen) + 0.5)
        module.weight.copy_(torch.randn(6, generator=gen))
        module.bias.copy_(torch.randn(6, generator=gen))
    module.to(buffer_dtype)
    x = torch.randn(4, 6, 5, 7, generator=gen).to(x_dtype)
    y = module(x)
    assert y.dtype == x_dtype
    b = {name: t.double() for name, t in module.state_dict().items()
         if name != "num_batches_tracked"}
    ref = torch.nn.functional.batch_norm(x.double(), b["running_mean"], b["running_var"],
                                         b["weight"], b["bias"], eps=module.eps)
    assert_close(y, ref, x_dtype)


_MIXED = {
    "BatchNorm2d": (lambda: normkit.BatchNorm2d(6),
                    lambda x, w, b: torch.nn.functional.batch_norm(x, None, None, w, b, True)),
    "GroupNorm": (lambda: normkit.GroupNorm(3, 6),
                  lambda x, w, b: torch.nn.functional.group_norm(x, 3, w, b)),
    "LayerNorm2d": (lambda: normkit.LayerNorm2d(6),
                    lambda x, w, b: torch.nn.functional.layer_norm(
                        x.permute(0, 2, 3, 1), (6,), w, b).permute(0, 3, 1, 2)),
    "LayerNorm": (lambda: normkit.LayerNorm(7),
                  lambda x, w, b: torch.nn.functional.layer_norm(x, (7,), w, b)),
}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("layer", list(_MIXED))
def test_float64_input_through_float32_parameters(layer, layout):
    """torch's CPU kernels raise "mixed dtype" on float64 input with float32 parameters;
    normkit's own paths serve it: float64 output, values and gradients of float64."""
    from oracle import assert_close, assert_grad_close

    build, reference = _MIXED[layer]
    module = build()
    gen = torch.Generator().manual_seed(10)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
        module.bias.copy_(torch.randn(module.bias.shape, generator=gen))
    x = torch.randn(4, 6, 5, 7, generator=gen, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = module(x)
    assert y.dtype == torch.float64
    w64, b64 = (p.detach().double().requires_grad_() for p in (module.weight, module.bias))
    x64 = x.detach().clone().requires_grad_()
    ref = reference(x64, w64, b64)
    assert_close(y, ref, torch.float64)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, module.weight, module.bias), dy)
    want = torch.autograd.grad(ref, (x64, w64, b64), dy)
    assert [g.dtype for g in got] == [torch.float64, torch.float32, torch.float32]
    assert_grad_close(got[0], want[0], torch.float64)
    for g, w_ in zip(got[1:], want[1:], strict=True):  # (rounded to the parameters' dtype)
        assert_grad_close(g.double(), w_, torch.float32)


def _check_layer_norm2d_against_float64(y, x, w, b, gen):
    """``y = layer_norm2d(x, w, b)`` (float32) and its gradients against float64
    LayerNorm over the channels (permute, LayerNorm, permute back)."""
    from oracle import assert_close, assert_grad_close

    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = torch.nn.functional.layer_norm(leaves[0].permute(0, 2, 3, 1), (x.shape[1],),
                                         leaves[1], leaves[2]).permute(0, 3, 1, 2)
    ref.backward(dy.double())
    assert_close(y, ref, torch.float32)
    for got, want in zip((x.grad, w.grad, b.grad), leaves, strict=True):
        assert_grad_close(got, want.grad, torch.float32)


def test_layer_norm2d_nchw_fast_path(monkeypatch):
    """NCHW LayerNorm2d runs torch's BatchNorm kernel per sample (kernels.native) on
    well-conditioned data, equals the float64 reference, refuses an offset past the
    kernel's bound, and supports double backward."""

    from normkit.kernels import native

    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_ELEMENTS", 0)
    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_POSITIONS", (0, 0))
    monkeypatch.setattr(native, "LAYER_NORM2D_CHANNEL_SUMS", ((0, 0), (0, 0)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 5, 7, generator=gen, requires_grad=True)
    w = torch.randn(6, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    y = F.layer_norm2d(x, w, b)
    assert "ColumnNorm" in _path(y), _path(y)
    assert y.is_contiguous()
    _check_layer_norm2d_against_float64(y, x, w, b, gen)
    assert "ColumnNorm" not in _path(F.layer_norm2d(x + 100.0, w, b))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    assert "ColumnNorm" in _path(F.layer_norm2d(x64, w64, b64))
    torch.autograd.gradgradcheck(lambda *a: F.layer_norm2d(*a), (x64, w64, b64))


@pytest.mark.parametrize(("path", "affine", "wanted"), [
    (path, affine, wanted) for path in ("per-sample", "channel sums")
    for affine in ("weight+bias", "weight", "bias", "none")
    for wanted in ("all", "params", "input") if (affine, wanted) != ("none", "params")])
def test_layer_norm2d_nchw_backward_every_affine_and_mask(path, affine, wanted, monkeypatch):
    """The backward of both copy-free NCHW paths -- per-sample (parameter sums from
    torch's BatchNorm backward kernel on ``(dy, xhat)``, input gradient per sample) and
    channel sums (the same parameter sums, the input gradient from sums over the channels
    of the whole batch) -- for every affine and every set of requested gradients, against
    float64 autograd."""
    from oracle import assert_grad_close

    from normkit.kernels import native

    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_ELEMENTS", 0)
    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_POSITIONS", (0, 0))
    sums = ((0, 0), (0, 0)) if path == "per-sample" else ((0, 1 << 62), (0, 1 << 62))
    monkeypatch.setattr(native, "LAYER_NORM2D_CHANNEL_SUMS", sums)
    monkeypatch.setattr(native, "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS", (0, 0))
    node = "ColumnNorm" if path == "per-sample" else "KernelNode"
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, 5, 7, generator=gen) * 2.0 + 1.5
    w = torch.randn(6, generator=gen) if "weight" in affine else None
    b = torch.randn(6, generator=gen) if "bias" in affine else None
    leaves = [t for t in (x, w, b) if t is not None]
    if wanted == "params":
        leaves = leaves[1:]
    elif wanted == "input":
        leaves = leaves[:1]
    for t in leaves:
        t.requires_grad_()
    y = F.layer_norm2d(x, w, b)
    assert node in _path(y), _path(y)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_in = {id(t): t.detach().double().requires_grad_(t.requires_grad) if t is not None else None
              for t in (x, w, b)}
    x64, w64, b64 = (ref_in[id(t)] if t is not None else None for t in (x, w, b))
    ref = torch.nn.functional.layer_norm(x64.permute(0, 2, 3, 1), (6,), w64,
                                         b64).permute(0, 3, 1, 2)
    want = torch.autograd.grad(ref, [ref_in[id(t)] for t in leaves], dy.double())
    for got, expected in zip(grads, want, strict=True):
        assert_grad_close(got, expected, torch.float32)


def test_layer_norm2d_nchw_channel_sums_path(monkeypatch):
    """NCHW LayerNorm2d by whole-batch sums over the channels (kernels.native): NCHW
    output equal to the float64 reference with its gradients, an offset past torch's
    LayerNorm bound refused (the robust path takes it), float32 and float64, double
    backward through the reference."""
    from normkit.kernels import native

    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_ELEMENTS", 0)
    for name in ("LAYER_NORM2D_CHANNEL_SUMS", "LAYER_NORM2D_CHANNEL_SUMS_INFERENCE"):
        monkeypatch.setattr(native, name, ((0, 1 << 62), (0, 1 << 62)))
        monkeypatch.setattr(native, name.replace("SUMS", "SUMS_MIN_ELEMENTS"), (0, 0))
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 6, 5, 7, generator=gen) * 3.0 - 2.0).requires_grad_()
    w = torch.randn(6, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    y = F.layer_norm2d(x, w, b)
    assert "KernelNode" in _path(y), _path(y)
    assert y.is_contiguous() and y.shape == x.shape
    _check_layer_norm2d_against_float64(y, x, w, b, gen)
    assert "NormalizeFunction" in _path(F.layer_norm2d(x.detach() + 1e4, w, b))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    assert "KernelNode" in _path(F.layer_norm2d(x64, w64, b64))
    torch.autograd.gradgradcheck(lambda *a: F.layer_norm2d(*a), (x64, w64, b64))
    torch.autograd.gradgradcheck(lambda x: F.layer_norm2d(x), (x64,))
    # other ranks: (N, C, L) and (N, C, D, H, W), and under inference_mode
    from oracle import assert_close, assert_grad_close

    for shape in ((3, 6, 35), (2, 6, 3, 4, 5)):
        x = (torch.randn(shape, generator=gen) * 2.0 + 1.0).requires_grad_()
        y = F.layer_norm2d(x, w, b)
        assert "KernelNode" in _path(y), _path(y)
        leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
        ref = torch.nn.functional.layer_norm(leaves[0].movedim(1, -1), (6,), leaves[1],
                                             leaves[2]).movedim(-1, 1)
        assert_close(y, ref.detach(), torch.float32)
        dy = torch.randn(shape, generator=gen)
        got = torch.autograd.grad(y, (x, w, b), dy)
        want = torch.autograd.grad(ref, leaves, dy.double())
        for g, expected in zip(got, want, strict=True):
            assert_grad_close(g, expected, torch.float32)
        with torch.inference_mode():
            assert_close(F.layer_norm2d(x.detach(), w.detach(), b.detach()), ref.detach(),
                         torch.float32)


@pytest.mark.parametrize("grad", [True, False], ids=["fwd+bwd", "inference"])
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_norm2d_nchw_path_by_positions(threads, grad, monkeypatch):
    """Which NCHW path serves how many positions per sample (per thread count, with a
    gradient and without): channel sums on ``LAYER_NORM2D_CHANNEL_SUMS`` (``_INFERENCE``)
    from ``LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS`` (``_INFERENCE``) elements, else
    per-sample from ``LAYER_NORM2D_MIN_POSITIONS`` (``_INFERENCE``), else torch's
    LayerNorm on a channels-innermost copy. Every path's output is NCHW and equals
    float64 LayerNorm over the channels, its gradients too."""
    from oracle import assert_close

    from normkit.kernels import native

    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_ELEMENTS", 0)
    suffix = "" if grad else "_INFERENCE"
    ranges, per_sample_floors, element_positions = ((4, 40), (6, 40)), (20, 30), (24, 34)
    monkeypatch.setattr(native, "LAYER_NORM2D_CHANNEL_SUMS" + suffix, ranges)
    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_POSITIONS" + suffix, per_sample_floors)
    # (the inputs are 2 x 16 x positions: the element floors at 24 and 34 positions)
    monkeypatch.setattr(native, "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS" + suffix,
                        tuple(2 * 16 * p for p in element_positions))
    served = []  # the copy-free path each call took
    sums, per_sample = native._layer_norm2d_channel_sums, native._ColumnNormFunction.apply
    monkeypatch.setattr(native, "_layer_norm2d_channel_sums",
                        lambda *a: served.append("channel sums") or sums(*a))
    monkeypatch.setattr(native, "_ColumnNormFunction", type("Spy", (), {"apply": staticmethod(
        lambda *a: served.append("per-sample") or per_sample(*a))}))
    (low, high), floor = ranges[threads > 1], per_sample_floors[threads > 1]
    fewest = element_positions[threads > 1]
    expected = {low - 1: "copy",
                floor - 1: "copy",  # in the range, too few elements, below per-sample's floor
                floor + 1: "per-sample",  # in the range, too few elements
                fewest: "channel sums", high - 1: "channel sums", high: "per-sample"}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(1)
        w = torch.randn(16, generator=gen, requires_grad=True)
        b = torch.randn(16, generator=gen, requires_grad=True)
        for positions, path in expected.items():
            served.clear()
            x = torch.randn(2, 16, positions, 1, generator=gen, requires_grad=grad)
            with torch.set_grad_enabled(grad):
                y = F.layer_norm2d(x, w, b)
            assert (served or ["copy"]) == [path], (positions, served)
            assert y.is_contiguous()
            if grad:
                _check_layer_norm2d_against_float64(y, x, w, b, gen)
                w.grad = b.grad = None
            else:
                ref = torch.nn.functional.layer_norm(
                    x.double().permute(0, 2, 3, 1), (16,), w.double(),
                    b.double()).permute(0, 3, 1, 2)
                assert_close(y, ref.detach(), torch.float32)
    finally:
        torch.set_num_threads(previous)


def test_layer_norm2d_nchw_shipped_floors():
    """The shipped floors are ordered: inference's per-sample path never later than with a
    gradient, and each channel-sums range a real one."""
    from normkit.kernels import native

    for inference, grad in zip(native.LAYER_NORM2D_MIN_POSITIONS_INFERENCE,
                               native.LAYER_NORM2D_MIN_POSITIONS, strict=True):
        assert inference <= grad
    for ranges in (native.LAYER_NORM2D_CHANNEL_SUMS, native.LAYER_NORM2D_CHANNEL_SUMS_INFERENCE):
        assert all(1 <= low < high for low, high in ranges)
    for floors in (native.LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS,
                   native.LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS_INFERENCE):
        assert all(fewest >= native.LAYER_NORM2D_MIN_ELEMENTS for fewest in floors)


@pytest.mark.parametrize("offset", [1.0, 1e4], ids=["torch-kernel", "compensated"])
def test_small_channels_last_instance_norm(offset):
    """Below the engine's size floor, channels-last InstanceNorm is torch's GroupNorm
    kernel (one group per channel) on an NCHW copy, back in channels_last; past that
    kernel's bound, the compensated path. Values, gradients and running statistics as
    the float64 reference and torch."""
    from oracle import assert_close, assert_grad_close

    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 5, 7, 9, generator=gen, dtype=torch.float64) * 2 + offset).float()
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    module = normkit.InstanceNorm2d(5, affine=True, track_running_stats=True)
    with torch.no_grad():
        module.weight.normal_(1.0, 0.3, generator=gen)
        module.bias.normal_(0.0, 0.3, generator=gen)
    y = module(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert ("NativeGroupNorm" if offset < 100 else "NormalizeFunction") in _path(y), _path(y)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, module.weight, module.bias)]
    ref = torch.nn.functional.instance_norm(leaves[0], weight=leaves[1], bias=leaves[2])
    ref.backward(dy.double())
    assert_close(y, ref, torch.float32)
    for got, want in zip((x.grad, module.weight.grad, module.bias.grad), leaves, strict=True):
        assert_grad_close(got, want.grad, torch.float32)
    tm = torch.nn.InstanceNorm2d(5, affine=True, track_running_stats=True)
    tm(x.detach())
    torch.testing.assert_close(module.running_mean, tm.running_mean)
    torch.testing.assert_close(module.running_var, tm.running_var, rtol=1e-4, atol=1e-6)


def _composite_calls(monkeypatch) -> list:
    """Record every call of the RMSNorm composite (normkit's small-input path)."""
    calls, original = [], F.rms_rows

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "rms_rows", spy)
    return calls


@pytest.mark.parametrize("grad", [True, False])
def test_small_rows_take_the_composite_below_the_rule(grad, monkeypatch):
    """Below SMALL_ROWS_COMPOSITE_BELOW (with / without a gradient) RMSNorm and add+RMSNorm
    run a composite of ATen ops, at and above it normkit's fused node; both match float64,
    and a row gets the same bits from either (a sample alone as in a large batch: torch's
    own composite, used here before, rounded differently)."""
    from oracle import assert_close, assert_grad_close, normalize64

    from normkit.norms.fused import add_rms_norm

    calls = _composite_calls(monkeypatch)
    below = F.SMALL_ROWS_COMPOSITE_BELOW[not grad]
    gen = torch.Generator().manual_seed(0)
    for rows, composite in ((below // 64 - 1, True), (below // 64, False)):
        x = torch.randn(rows, 64, generator=gen).requires_grad_(grad)
        r = torch.randn(rows, 64, generator=gen).requires_grad_(grad)
        w = (torch.rand(64, generator=gen) + 0.5).requires_grad_(grad)
        calls.clear()
        y = F.rms_norm(x, 64, w, 1e-6)
        normed, s = add_rms_norm(x, r, 64, w, 1e-6)
        assert len(calls) == (2 if composite else 0), (rows * 64, calls)
        assert torch.equal(s, x + r)
        for out, src in ((y, x), (normed, s)):
            assert_close(out, normalize64(src.detach(), (1,), w.detach(), eps=1e-6,
                                          center=False), torch.float32)
        with torch.no_grad():  # (the first rows alone: the other path, the same bits)
            assert torch.equal(F.rms_norm(x[:3], 64, w, 1e-6), y[:3])
            assert torch.equal(add_rms_norm(x[:3], r[:3], 64, w, 1e-6)[0], normed[:3])
        if grad:  # the input and weight gradients of either path against float64
            x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
            normalize64(x64, (1,), w64, eps=1e-6, center=False).sum().backward()
            y.sum().backward()
            assert_grad_close(x.grad, x64.grad, torch.float32, "dx")
            assert_grad_close(w.grad, w64.grad, torch.float32, "dw")


def test_small_add_layer_norm_keeps_normkits_layer_norm(monkeypatch):
    """The small add+LayerNorm path adds, then runs normkit's layer_norm: an offset row
    still takes the compensated statistics."""
    from oracle import assert_close, normalize64

    from normkit.norms.fused import add_layer_norm

    x = (torch.randn(4, 32, dtype=torch.float64) + 3e4).float()
    r = torch.randn(4, 32)
    normed, s = add_layer_norm(x, r, 32)
    assert torch.equal(s, x + r)
    assert_close(normed, normalize64(s, (1,)), torch.float32)
    monkeypatch.setattr(F, "SMALL_ROWS_COMPOSITE_BELOW", (0, 0))  # the fused node agrees
    torch.testing.assert_close(add_layer_norm(x, r, 32)[0], normed, rtol=0, atol=2e-6)


_PER_CHANNEL = {
    "batch_norm train": lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=True),
    "batch_norm eval": lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=False),
    "instance_norm": lambda x, w, b, rm, rv: F.instance_norm(x, weight=w, bias=b),
    "group_norm": lambda x, w, b, rm, rv: F.group_norm(x, 4, w, b),
    "layer_norm2d": lambda x, w, b, rm, rv: F.layer_norm2d(x, w, b),
    "batch_norm_act train": lambda x, w, b, rm, rv: fused.batch_norm_act(
        x, rm, rv, w, b, training=True, act="silu"),
    "batch_norm_act inplace eval": lambda x, w, b, rm, rv: fused.batch_norm_act(
        x, rm, rv, w, b, training=False, act="leaky_relu", memory="inplace"),
    "group_norm_act": lambda x, w, b, rm, rv: fused.group_norm_act(
        x, 4, w, b, act="silu"),
}


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(4, 8, 5, 6), (8, 8, 40, 40)], ids=["small", "large"])
@pytest.mark.parametrize("name", list(_PER_CHANNEL))
def test_strided_weight_and_bias(name, shape, layout):
    """Per-channel weight and bias that are strided views (slices of a larger tensor, a
    hypernetwork's output): torch's raw GroupNorm kernels read such a weight as dense
    (wrong outputs) and its BatchNorm backward kernel on channels-last input does too
    (a wrong input gradient, also through torch's own ``F.batch_norm``). Output, input
    gradient and parameter gradients match float64."""
    from oracle import assert_close, assert_grad_close

    gen = torch.Generator().manual_seed(0)
    c = shape[1]
    x64 = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 1
    packed = torch.randn(2 * c, 2, generator=gen, dtype=torch.float64)
    packed[:, 0] = packed[:, 0].abs() + 0.5
    rm, rv = torch.randn(c, generator=gen) * 0.2, torch.rand(c, generator=gen) + 0.5
    x = x64.float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    source = packed.float().requires_grad_()
    w, b = source[::2, 0], source[1::2, 1]  # strided views, gradients flow to `source`
    assert not w.is_contiguous() and not b.is_contiguous()
    x_ref, source_ref = x64.clone().requires_grad_(), packed.clone().requires_grad_()
    y = _PER_CHANNEL[name](x, w, b, rm.clone(), rv.clone())
    ref = _PER_CHANNEL[name](x_ref, source_ref[::2, 0].contiguous(),
                             source_ref[1::2, 1].contiguous(), rm.double(), rv.double())
    assert_close(y, ref.detach(), torch.float32, name)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    y.backward(dy.float())
    ref.backward(dy)
    assert_grad_close(x.grad, x_ref.grad, torch.float32, f"{name} input grad")
    assert_grad_close(source.grad, source_ref.grad, torch.float32, f"{name} parameter grads")


@pytest.mark.parametrize("width", [65537, 1 << 20], ids=["cascade", "pieces"])
def test_rms_norm_of_long_rows_sums_in_pieces_with_the_same_bits_on_every_path(width):
    """torch's CPU ``vector_norm`` adds a row in vector lanes, each in sequence: over 2^20
    values RMSNorm's output was 9.6e-6 off (torch's composite 6.9e-8). Rows longer than
    ``_stats.ROW_NORM_MAX`` are read in pieces (or, with no equal pieces -- 65537 is
    prime -- by torch's cascaded sum), and the
    composite, the fused node and the blocks of the fused forward give a row the same
    bits."""
    from oracle import normalize64

    x = torch.randn(2, width, generator=torch.Generator().manual_seed(0)) + 1.9
    want = normalize64(x, (1,), eps=1e-6, center=False)
    composite = F.rms_rows(x, (width,), None, 1e-6)
    fused_node = fused._add_norm_apply(x, None, None, None, (width,), 1e-6, False, x.dtype,
                                       False)
    blocks, _ = fused._rms_in_chunks(x, None, 1e-6)
    assert float((composite.double() - want).abs().max()) <= 3e-7 * float(want.abs().max())
    assert torch.equal(fused_node, composite) and torch.equal(blocks, composite)


@pytest.mark.parametrize("layer", ["layer_norm", "rms_norm", "add_layer_norm"])
def test_wide_rows_backward_with_an_upstream_gradient_along_the_input(layer):
    """Rows wider than LAYER_NORM_BACKWARD_MAX_WIDTH (whole-sample LayerNorm): torch's
    LayerNorm backward kernel adds ``sum g x`` in vector lanes and subtracts ``mean sum g``,
    which left 2.5e-4 of ``dy = x``'s exact (eps-sized) input gradient over 2^20 features;
    the wide route (torch's BatchNorm kernel on the rows as channels, past 2^18 features
    the slice-sums engine) keeps every gradient within 1e-6 of float64 there."""
    from oracle import assert_grad_close

    from normkit.kernels import native
    from normkit.norms.fused import add_layer_norm

    width = 1 << 20
    assert width > native.LAYER_NORM_BACKWARD_MAX_WIDTH
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, width, generator=gen) + 1.9
    r0 = torch.randn(2, width, generator=gen)
    w0, b0 = torch.rand(width, generator=gen) + 0.5, torch.randn(width, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x0, r0, w0, b0)]
    exact = [t.double().requires_grad_() for t in (x0, r0, w0, b0)]
    if layer == "layer_norm":
        got = F.layer_norm(leaves[0], (width,), leaves[2], leaves[3])
        ref = TF.layer_norm(exact[0], (width,), exact[2], exact[3])
        dy, used = x0, (0, 2, 3)
    elif layer == "rms_norm":
        got = F.rms_norm(leaves[0], (width,), leaves[2], 1e-6)
        ref = TF.rms_norm(exact[0], (width,), exact[2], 1e-6)
        dy, used = x0, (0, 2)
    else:
        got = add_layer_norm(leaves[0], leaves[1], (width,), leaves[2], leaves[3])[0]
        ref = TF.layer_norm(exact[0] + exact[1], (width,), exact[2], exact[3])
        dy, used = x0 + r0, (0, 1, 2, 3)
    grads = torch.autograd.grad(got, [leaves[i] for i in used], dy)
    wants = torch.autograd.grad(ref, [exact[i] for i in used], dy.double())
    for i, g, w in zip(used, grads, wants, strict=True):
        assert_grad_close(g, w, torch.float32, f"gradient {i}")
