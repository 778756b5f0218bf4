"""Numerics that must beat torch: large offsets, float16 near its range, NaN/Inf, empty."""

from __future__ import annotations

import pytest
import torch
from cases import CASE_IDS, CASES, float64_twin, make_input
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_close, assert_grad_close, reference_forward

import normkit

# small inputs through normkit's fused rows node, not torch's composite (conftest.py)
pytestmark = pytest.mark.usefixtures("fused_rows_node")

BATCH_STAT_FAMILIES = ("Batch", "Instance")


def _set_running_near(module, offset):
    if getattr(module, "running_mean", None) is not None:
        with torch.no_grad():
            module.running_mean.add_(offset)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("offset", [1e4, 1e5])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_large_offset_float32_within_1e4_of_float64(case, offset, layout, training):
    """torch's CPU kernels are off by ~1e-3 (offset 1e4) to ~5e-2 (1e5) here."""
    x = make_input(case.shape, torch.float32, layout, offset=offset)
    if x is None:
        pytest.skip("layout does not apply")
    if case.name == "RMSNorm":  # RMS of an offset input is ~|offset|: use a mixed sign one
        x = x * torch.sign(torch.randn_like(x))
    nk, _ = case.build(True)
    _set_running_near(nk, offset)
    nk.train(training)
    ref_module = float64_twin(nk)
    x.requires_grad_()
    y = nk(x)
    x64 = x.detach().double().requires_grad_()
    ref = reference_forward(ref_module, x64, input_dtype=x.dtype)
    err = float((y.detach().double() - ref.detach()).abs().max())
    assert err < 1e-4, f"max error {err:.2e} at offset {offset:g}"
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    y.backward(dy)
    ref.backward(dy.double())
    assert_grad_close(x.grad, x64.grad, torch.float32, "input grad")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float16_near_its_range_is_finite_and_accurate(case):
    gen = torch.Generator().manual_seed(0)
    x = ((torch.rand(case.shape, generator=gen) * 2 - 1) * 6e4).half()
    x.view(-1)[0] = 6e4  # the largest magnitudes float16 holds
    x.view(-1)[1] = -6e4
    nk, _ = case.build(True)
    with torch.no_grad():
        if getattr(nk, "running_var", None) is not None:
            nk.running_var.fill_(1.2e9)  # running stats of such data, stored in float32
    for training in (True, False):
        nk.train(training)
        ref_module = float64_twin(nk)
        xg = x.clone().requires_grad_()
        y = nk(xg)
        assert torch.isfinite(y).all(), "float16 output overflowed"
        x64 = x.double().requires_grad_()
        ref = reference_forward(ref_module, x64, input_dtype=x.dtype)
        assert_close(y, ref, torch.float16)
        dy = torch.randn(y.shape, generator=gen).half()
        y.backward(dy)
        ref.backward(dy.double())
        assert torch.isfinite(xg.grad).all(), "float16 gradient overflowed"
        assert_grad_close(xg.grad, x64.grad, torch.float16, "input grad")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", [c for c in CASES if c.torch_cls], ids=lambda c: c.name)
def test_nan_and_inf_propagate_exactly_as_in_torch(case, training, value):
    nk, tm = case.build(True, **({"track_running_stats": True}
                                 if case.name.startswith("Instance") else {}))
    nk.train(training), tm.train(training)
    x = make_input(case.shape, torch.float32, "contiguous")
    x.view(-1)[x.numel() // 2] = value
    y, yt = nk(x), tm(x)
    assert torch.equal(torch.isnan(y), torch.isnan(yt))
    assert torch.equal(torch.isinf(y), torch.isinf(yt))
    finite = torch.isfinite(yt)
    torch.testing.assert_close(y[finite], yt[finite], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", [c for c in CASES if c.torch_cls], ids=lambda c: c.name)
def test_empty_batch_same_as_torch(case, training):
    shape = (0,) + case.shape[1:]
    nk, tm = case.build(True)
    nk.train(training), tm.train(training)
    x = torch.randn(shape, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    y = nk(x)
    if case.name.startswith("Instance"):
        # torch's affine InstanceNorm raises IndexError on an empty batch; normkit
        # returns the empty output, like every other family
        with pytest.raises(IndexError):
            tm(xt)
        tm = case.build(False)[1].train(training)
        nk = case.build(False)[0].train(training)
        y = nk(x)
    yt = tm(xt)
    assert y.shape == yt.shape == x.shape
    y.sum().backward()
    yt.sum().backward()
    assert x.grad.shape == x.shape
    for p, pt in zip(nk.parameters(), tm.parameters(), strict=True):
        torch.testing.assert_close(p.grad, pt.grad)
    for (name, b), bt in zip(nk.named_buffers(), tm.buffers(), strict=True):
        torch.testing.assert_close(b, bt, msg=name)


@pytest.mark.parametrize("cls", ["InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"])
def test_empty_batch_never_corrupts_instance_norm_running_stats(cls):
    """torch writes NaN into them (or raises IndexError with affine=True); normkit keeps them."""
    import normkit
    module = getattr(normkit, cls)(4, affine=True, track_running_stats=True)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    x = torch.randn((0, 4) + (3,) * int(cls[-2]), requires_grad=True)
    module(x).sum().backward()
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, before[key], msg=key)


def test_unbatched_instance_norm_matches_torch():
    import normkit
    nk, tm = normkit.InstanceNorm2d(3, affine=True), torch.nn.InstanceNorm2d(3, affine=True)
    x = torch.randn(3, 5, 5)
    torch.testing.assert_close(nk(x), tm(x))


@pytest.mark.parametrize("name,make,shape,layout,key", [
    ("LayerNorm", lambda: __import__("normkit").LayerNorm(512), (64, 512), "contiguous",
     "layer_norm"),
    ("BatchNorm2d", lambda: __import__("normkit").BatchNorm2d(8), (32, 8, 9, 9), "contiguous",
     "batch_norm"),
    ("BatchNorm2d-cl", lambda: __import__("normkit").BatchNorm2d(8), (32, 8, 9, 9),
     "channels_last", "batch_norm_channels_last_train"),
    ("GroupNorm", lambda: __import__("normkit").GroupNorm(2, 8), (32, 8, 9, 9), "contiguous",
     "group_norm"),
])
def test_fast_paths_stay_accurate_up_to_their_threshold(name, make, shape, layout, key):
    """Near the threshold torch's kernel is used, and is still within 1e-5 of float64."""
    from normkit.kernels.native import THRESHOLDS

    ratio = 0.85 * THRESHOLDS[key]  # sampled groups' std varies by a few percent
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
         + ratio).float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    module = make()
    y = module(x.requires_grad_())
    assert "Native" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    with torch.no_grad():  # (the module's parameters require grad)
        ref = reference_forward(module, x.detach().double(), input_dtype=torch.float32)
    assert float((y.detach().double() - ref).abs().max()) < 1e-5


@settings(max_examples=200, deadline=None)
@given(data=st.data(), channels=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       threshold=st.sampled_from([2.0, 4.0, 32.0]), eps=st.sampled_from([0.0, 1e-5, 1e-3]))
def test_running_statistics_ratio_check_agrees_with_its_definition(data, channels, dtype,
                                                                   threshold, eps):
    """native.ratio_within (inference BatchNorm's check of its running statistics) says
    what max |mean| / sqrt(var + eps) <= threshold says in float64, away from the
    threshold itself; NaN and Inf statistics fail as they do there."""
    from normkit.kernels import native

    def values(low, high):
        return data.draw(st.lists(st.floats(low, high, allow_nan=False), min_size=channels,
                                  max_size=channels))

    var = torch.tensor(values(1e-3, 1e3), dtype=torch.float64)
    ratio = torch.tensor(values(-3 * threshold, 3 * threshold), dtype=torch.float64)
    mean = ratio * (var + eps).sqrt()
    special = data.draw(st.sampled_from([None, "nan-mean", "nan-var", "inf-mean"]))
    if special == "nan-mean":
        mean[0] = float("nan")
    elif special == "nan-var":
        var[-1] = float("nan")
    elif special == "inf-mean":
        mean[0] = float("inf")
    mean, var = mean.to(dtype), var.to(dtype)  # (the check sees the stored values)
    true = (mean.double().abs() / (var.double() + eps).sqrt()).max()
    if special is None and abs(float(true) / threshold - 1) < 1e-2:
        return  # within rounding of the threshold: either answer is right
    want = bool(true <= threshold)  # (NaN: False)
    assert native.ratio_within(mean, var, eps, threshold) is want
    if dtype == torch.float32:  # buffers that require grad are read, not differentiated
        assert native.ratio_within(mean.requires_grad_(), var, eps, threshold) is want


def _layer_norm_16bit_case(kind, dtype, param_dtype, offset):
    """(module, x, inputs) of a 16-bit LayerNorm-family layer on 16384 rows of 64."""
    import normkit

    gen = torch.Generator().manual_seed(0)
    shape = {"LayerNorm": (16384, 64), "AddLayerNorm": (16384, 64),
             "LayerNorm2d": (16, 64, 32, 32)}[kind]
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset).to(dtype)
    if kind == "LayerNorm2d":
        x = x.contiguous(memory_format=torch.channels_last)
        module = normkit.LayerNorm2d(64)
    else:
        module = normkit.LayerNorm(64) if kind == "LayerNorm" else normkit.AddLayerNorm(64)
    with torch.no_grad():
        module.weight.copy_(torch.rand(64, generator=gen) + 0.5)
        module.bias.copy_(torch.randn(64, generator=gen))
    inputs = (x,) if kind != "AddLayerNorm" else (
        x, torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
    return module.to(param_dtype), inputs


@pytest.mark.parametrize("offset", [0.0, 20.0], ids=["centered", "offset"])
@pytest.mark.parametrize("param_dtype", ["float32", "same"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["LayerNorm", "LayerNorm2d", "AddLayerNorm"])
@pytest.mark.parametrize("route", ["blocks", "one-call"])
def test_16bit_layer_norm_gradients_within_tolerance(kind, dtype, param_dtype, offset, route,
                                                     monkeypatch, spy):
    """torch's CPU LayerNorm backward on 16-bit input sums the weight and bias gradients
    in 16 bits: 16384 rows put them 14% (bfloat16) and 1.7% (float16) off, while the
    gradient tolerances are 4e-2 and 5e-3 -- and 16-bit parameters had it return 16-bit
    statistics, whose rounding at an offset of 20 std is another 3%. normkit takes the
    forward from torch's kernel with float32 statistics and the backward in float32:
    blocks for the parameters' gradients, or below ``HALF_BACKWARD_ONE_CALL_BELOW``
    elements (here forced at 16384 rows) one float32 call for all three
    (normkit.kernels.native.layer_norm_backward)."""
    from normkit.kernels import native

    monkeypatch.setattr(native, "HALF_BACKWARD_ONE_CALL_BELOW",
                        1 << 40 if route == "one-call" else 0)
    blocks = spy(native, "_layer_norm_param_grads")
    module, inputs = _layer_norm_16bit_case(kind, dtype, dtype if param_dtype == "same"
                                            else torch.float32, offset)
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = module(*leaves)
    normed = out[0] if isinstance(out, tuple) else out
    dy = torch.randn(normed.shape, generator=torch.Generator().manual_seed(5),
                     dtype=torch.float64).to(dtype)
    normed.backward(dy)
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    w64, b64 = (p.detach().double().requires_grad_() for p in (module.weight, module.bias))
    s64 = leaves64[0] if kind != "AddLayerNorm" else leaves64[0] + leaves64[1]
    if kind == "AddLayerNorm":  # (the norm sees the sum rounded to the residual's dtype)
        s64 = s64 + ((inputs[0] + inputs[1]).double() - s64).detach()
    dims = (1,) if kind == "LayerNorm2d" else (-1,)
    view = (1, -1, 1, 1) if kind == "LayerNorm2d" else (-1,)
    mean = s64.mean(dims, keepdim=True)
    var = ((s64 - mean) ** 2).mean(dims, keepdim=True)
    ref = (s64 - mean) / torch.sqrt(var + 1e-5) * w64.view(view) + b64.view(view)
    ref.backward(dy.double())
    assert bool(blocks) == (route == "blocks")
    assert_close(normed, ref, dtype)
    assert_grad_close(leaves[0].grad, leaves64[0].grad, dtype, "input grad")
    assert_grad_close(module.weight.grad, w64.grad, dtype, "weight grad")
    assert_grad_close(module.bias.grad, b64.grad, dtype, "bias grad")


def test_16bit_layer_norm_double_backward_is_the_float32_composites():
    import normkit

    x = torch.randn(64, 32, dtype=torch.float64).bfloat16().requires_grad_()
    module = normkit.LayerNorm(32)
    y = module(x)
    assert "KernelNode" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    (gx,) = torch.autograd.grad(y.float().pow(2).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.float().sum(), x)
    x32 = x.detach().float().requires_grad_()
    y32 = torch.nn.functional.layer_norm(x32, (32,))
    (gx32,) = torch.autograd.grad(y32.bfloat16().float().pow(2).sum(), x32, create_graph=True)
    (ggx32,) = torch.autograd.grad(gx32.bfloat16().float().sum(), x32)
    assert_grad_close(ggx, ggx32, torch.bfloat16, "double backward")


_SIXTEEN_BIT_PARAM_LAYERS = {
    "BatchNorm2d": lambda: __import__("normkit").BatchNorm2d(32),
    "BatchNormAct2d": lambda: __import__("normkit").BatchNormAct2d(32, act="silu"),
    "GroupNorm": lambda: __import__("normkit").GroupNorm(8, 32),
    "GroupNormAct": lambda: __import__("normkit").GroupNormAct(8, 32, act="silu"),
    "InstanceNorm2d": lambda: __import__("normkit").InstanceNorm2d(32, affine=True),
}


@pytest.mark.parametrize("offset", [30.0, 40.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(_SIXTEEN_BIT_PARAM_LAYERS))
def test_16bit_parameters_keep_float32_statistics(name, dtype, offset):
    """With 16-bit parameters (``model.half()``/``.bfloat16()``) torch's BatchNorm and
    GroupNorm kernels round the batch statistics to 16 bits and normalize with them: at
    30 std of offset BatchNorm's bfloat16 output was 0.11 off and its weight gradient 5%.
    normkit hands them float32 parameters (and so gets float32 statistics)."""
    from oracle import normalize64

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 32, 14, 14, generator=gen, dtype=torch.float64) + offset).to(dtype)
    module = _SIXTEEN_BIT_PARAM_LAYERS[name]()
    with torch.no_grad():
        module.weight.copy_(torch.rand(32, generator=gen) + 0.5)
        module.bias.copy_(torch.randn(32, generator=gen))
    module = module.to(dtype)
    xr = x.detach().requires_grad_()
    y = module(xr)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    y.backward(dy)
    x64 = x.double().requires_grad_()
    w64, b64 = (p.detach().double().requires_grad_() for p in (module.weight, module.bias))
    if name.startswith("Group"):
        ref = normalize64(x64.unflatten(1, (8, 4)), (2, 3, 4)).flatten(1, 2)
    elif name.startswith("Instance"):
        ref = normalize64(x64, (2, 3))
    else:
        ref = normalize64(x64, (0, 2, 3))
    ref = ref * w64.view(1, -1, 1, 1) + b64.view(1, -1, 1, 1)
    if name.endswith("Act2d") or name.endswith("Act"):
        ref = torch.nn.functional.silu(ref)
    ref.backward(dy.double())
    assert_close(y, ref, dtype)
    assert_grad_close(xr.grad, x64.grad, dtype, "input grad")
    assert_grad_close(module.weight.grad, w64.grad, dtype, "weight grad")
    assert_grad_close(module.bias.grad, b64.grad, dtype, "bias grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_batch_renorm_16bit_robust_path_rounds_only_its_output(dtype):
    """Past the kernels' bound (40 std of offset) Batch Renormalization takes the
    compensated path, whose normalized input was rounded to 16 bits before the corrected
    affine: where ``d`` cancels most of the output that rounding, times the affine's
    scale, is the output's error (4 * 9.8e-4 at outputs near 0 in float16, above its
    2e-3 tolerance). Built so: every channel exactly standardized (r = 1), d = 5, weight
    4 and bias -28, so ``y = 4 (xhat - 2)``."""
    import normkit

    x = torch.randn(8, 4, 16, 16, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    x = (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), correction=0, keepdim=True)
    x = (x + 40.0).to(dtype)
    module = normkit.BatchRenorm2d(4, eps=0.0, warmup_steps=0, r_max_steps=1, d_max_steps=1)
    module.num_batches_tracked.fill_(5)
    with torch.no_grad():
        module.weight.fill_(4.0)
        module.bias.fill_(-28.0)
        module.running_var.fill_(1.0)
    y = module(x)
    x64 = x.double()
    mean, std = x64.mean((0, 2, 3), keepdim=True), x64.std((0, 2, 3), correction=0, keepdim=True)
    r = std.clamp(1 / 3, 3)  # (sigma = 1)
    ref = ((x64 - mean) / std * r + mean.clamp(-5, 5)) * 4.0 - 28.0
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(4, 6, 5, 5), (8, 6, 32, 32)], ids=["small", "engine"])
@pytest.mark.parametrize("op", ["group_norm", "instance_norm", "group_norm_act"])
def test_bias_without_weight_has_gradients(op, shape, layout):
    """The functional API takes a bias without a weight; torch's GroupNorm backward kernel
    raises on it ("tensor does not have a device", also for torch.nn.functional's own
    group_norm), so normkit hands its kernels a unit weight there."""
    from oracle import normalize64

    from normkit import functional as NF
    from normkit.norms import fused

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    b = torch.randn(6, generator=gen).requires_grad_()
    if op == "group_norm":
        y = NF.group_norm(x, 2, None, b)
    elif op == "instance_norm":
        y = NF.instance_norm(x, None, None, None, b)
    else:
        y = fused.group_norm_act(x, 2, None, b, act="silu")
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    groups = 6 if op == "instance_norm" else 2
    ref = normalize64(x64.unflatten(1, (groups, 6 // groups)), (2, 3, 4)).flatten(1, 2)
    ref = ref + b64.view(1, -1, 1, 1)
    ref = torch.nn.functional.silu(ref) if op == "group_norm_act" else ref
    ref.backward(dy.double())
    assert_close(y, ref, torch.float32)
    assert_grad_close(x.grad, x64.grad, torch.float32, "input grad")
    assert_grad_close(b.grad, b64.grad, torch.float32, "bias grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("ratio", [0.0, 0.9, 1.5], ids=["centered", "under", "past"])
@pytest.mark.parametrize("layer", ["BatchNorm2d", "BatchNormAct2d"])
def test_16bit_batch_norm_statistics_bound(layer, ratio, dtype, monkeypatch):
    """BatchNorm (and BatchNormAct) of 16-bit input with 16-bit parameters keeps torch's
    kernel (16-bit statistics, its own buffer update) up to native.HALF_STATISTICS_RATIO,
    and takes float32 statistics (float32 copies of the parameters) past it; both within
    the per-dtype tolerances, buffers too."""
    from oracle import normalize64

    import normkit
    from normkit.kernels import native

    calls = []
    params = native.kernel_params
    monkeypatch.setattr(native, "kernel_params", lambda *a: calls.append(1) or params(*a))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 10, 10, generator=gen, dtype=torch.float64)
    x = (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), correction=0, keepdim=True)
    x = (x + ratio).to(dtype).requires_grad_()
    module = (normkit.BatchNorm2d(16) if layer == "BatchNorm2d" else
              normkit.BatchNormAct2d(16, act="silu")).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.rand(16, generator=gen) + 0.5)
        module.bias.copy_(torch.randn(16, generator=gen))
    y = module(x)
    assert bool(calls) == (ratio > native.HALF_STATISTICS_RATIO), (ratio, calls)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64, b64 = (p.detach().double().requires_grad_() for p in (module.weight, module.bias))
    ref = normalize64(x64, (0, 2, 3), w64.view(1, -1, 1, 1), b64.view(1, -1, 1, 1))
    ref = ref if layer == "BatchNorm2d" else torch.nn.functional.silu(ref)
    ref.backward(dy.double())
    assert_close(y, ref, dtype)
    assert_grad_close(x.grad, x64.grad, dtype, "input grad")
    assert_grad_close(module.weight.grad, w64.grad, dtype, "weight grad")
    want_var = 0.9 + 0.1 * x64.detach().var((0, 2, 3), correction=1)
    torch.testing.assert_close(module.running_var.double(), want_var,
                               rtol=3 * torch.finfo(dtype).eps, atol=0.0)


def _second_derivatives(layer, x, dy, direction):
    """``(first, second)``: the layer's gradients of ``sum(out * dy)`` with respect to
    its input and weight (``create_graph=True``), then those of ``sum(first * direction)``."""
    x = x.detach().requires_grad_()
    out = layer(x)
    first = torch.autograd.grad(out, (x, layer.weight), dy, create_graph=True)
    total = sum((g.double() * v).sum() for g, v in zip(first, direction, strict=True))
    return first, torch.autograd.grad(total, (x, layer.weight))


@pytest.mark.parametrize("layer", ["BatchNorm2d", "BatchRenorm2d", "GroupNorm", "LayerNorm2d"])
def test_16bit_second_derivatives_match_float64(layer):
    """Double backward of 16-bit input: torch's own BatchNorm double backward reduces
    float16 tensors and returned inf/NaN weight second derivatives at 16380 values per
    channel, and its create_graph GroupNorm backward, a bfloat16 composite, a weight
    gradient 4e-2 off; normkit's 16-bit kernel paths differentiate float32 references
    (``native.kernel_node``). Found by ``tests/test_dispatch_fuzz.py``."""
    from oracle import GRAD_TOL, normalize64

    import normkit

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(4, 4, 45, 91, generator=gen, dtype=torch.float64)
        if layer == "GroupNorm":  # groups at |mean| / std 28, under the kernel's bound 32
            x = x + torch.tensor([29.0, 29.5, -29.0, -29.5]).double().view(1, 4, 1, 1)
        x = x.to(dtype)
        module = {"BatchNorm2d": lambda: normkit.BatchNorm2d(4),
                  "BatchRenorm2d": lambda: normkit.BatchRenorm2d(4, warmup_steps=0),
                  "GroupNorm": lambda: normkit.GroupNorm(2, 4),
                  "LayerNorm2d": lambda: normkit.LayerNorm2d(4)}[layer]()
        with torch.no_grad():
            module.weight.copy_(torch.rand(4, generator=gen) + 0.5)
        dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        direction = [torch.randn(x.shape, generator=gen, dtype=torch.float64),
                     torch.randn(4, generator=gen, dtype=torch.float64)]
        first, second = _second_derivatives(module, x, dy.to(dtype), direction)

        x64 = x.double().requires_grad_()
        w64 = module.weight.detach().double().requires_grad_()
        if layer == "GroupNorm":
            y64 = normalize64(x64.unflatten(1, (2, 2)), (2, 3, 4)).flatten(1, 2)
        else:  # (BatchRenorm at its first step: r = 1, d = 0, BatchNorm)
            y64 = normalize64(x64, (1,) if layer == "LayerNorm2d" else (0, 2, 3))
        y64 = y64 * w64.view(1, -1, 1, 1)
        first64 = torch.autograd.grad(y64, (x64, w64), dy, create_graph=True)
        total64 = sum((g * v).sum() for g, v in zip(first64, direction, strict=True))
        second64 = torch.autograd.grad(total64, (x64, w64))
        count = x.numel() // 4
        for got, want, what in zip((*first, *second), (*first64, *second64),
                                   ("dx", "dweight", "second dx", "second dweight"),
                                   strict=True):
            got, want = got.detach(), want.detach()
            assert bool(got.isfinite().all()), f"{layer} {dtype} {what}: not finite"
            scale = max(1.0, float(want.abs().max()),
                        count ** 0.5 if "dweight" in what else 1.0)
            err = float((got.double() - want).abs().max())
            assert err <= GRAD_TOL[dtype] * scale, f"{layer} {dtype} {what}: {err:.3e}"


@pytest.mark.parametrize("layout", ["x_contiguous", "x_channels_last"])
@pytest.mark.parametrize("layer", ["GroupNorm", "GroupNormAct"])
def test_16bit_group_norm_gradient_in_the_other_layout(layer, layout):
    """torch's GroupNorm backward kernel reads the upstream gradient as if laid out like
    the input (torch's autograd converts it first), so normkit's 16-bit GroupNorm node
    (``native.group_norm_kernel``) must too: without, a channels-last gradient of a
    contiguous input (ReLU's, after a channels-last input was normalized through a
    contiguous copy) gave a GroupNormAct input gradient 5.8 off -- found by
    ``tests/test_dispatch_fuzz.py`` in the node's first version, before it shipped."""
    from oracle import normalize64

    import normkit

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 7, generator=gen, dtype=torch.float64).bfloat16()
    other = torch.channels_last if layout == "x_contiguous" else torch.contiguous_format
    if layout == "x_channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    module = (normkit.GroupNorm(1, 3) if layer == "GroupNorm" else
              normkit.GroupNormAct(1, 3, act="relu"))
    y = module(x)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).bfloat16()
    y.backward(dy.contiguous(memory_format=other))
    x64 = x.detach().double().requires_grad_()
    ref = normalize64(x64.unflatten(1, (1, 3)), (2, 3, 4)).flatten(1, 2)
    if layer == "GroupNormAct":  # (the kink's side as the layer's output took it)
        ref = torch.where(y.detach() > 0, ref, 0.0)
    ref.backward(dy.double())
    assert_grad_close(x.grad, x64.grad, torch.bfloat16, "input grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(("op", "shape"), [
    ("layer_norm", (4, 8)), ("layer_norm", (512, 768)), ("add_layer_norm", (4, 8)),
    ("add_layer_norm", (512, 768)), ("layer_norm2d", (2, 8, 6, 6)),
    ("layer_norm2d", (8, 32, 32, 32))], ids=str)
def test_bias_without_weight_double_backward(op, shape, dtype):
    """The functional API takes a bias without a weight; torch's LayerNorm double backward
    raises through the bias's gradient there ("Expected a proper Tensor but got None",
    torch.nn.functional.layer_norm too), so normkit's kernel paths hand it a unit weight.
    Found by the Triton fuzz's second-derivative check, whose float64 reference hit it."""
    from oracle import normalize64

    from normkit import functional as NF

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k = shape[1] if op == "layer_norm2d" else shape[-1]
    b = torch.randn(k, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    if op == "layer_norm":
        y = NF.layer_norm(x, (k,), None, b)
    elif op == "add_layer_norm":
        y = NF.add_layer_norm(x, torch.zeros_like(x), (k,), None, b)[0]
    else:
        y = NF.layer_norm2d(x, None, b)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    gx, gb = torch.autograd.grad(y, (x, b), dy, create_graph=True)
    hx, _ = torch.autograd.grad((gx.double().square().sum() + gb.double().square().sum()),
                                (x, b), allow_unused=True)
    x64 = x.detach().double().requires_grad_()
    dims = (1,) if op == "layer_norm2d" else (-1,)
    view = (1, -1, 1, 1) if op == "layer_norm2d" else (-1,)
    y64 = normalize64(x64, dims) + b.detach().double().view(view)
    (gx64,) = torch.autograd.grad(y64, x64, dy.double(), create_graph=True)
    (hx64,) = torch.autograd.grad(gx64.square().sum(), x64)
    assert_grad_close(gx.detach(), gx64.detach(), dtype, "input grad")
    assert_grad_close(hx, hx64, dtype, "second derivative")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(8, 4, 5, 5), (32, 8, 32, 32)], ids=str)
@pytest.mark.parametrize("op", ["batch_norm", "batch_norm_eval", "batch_norm_act"])
def test_bias_without_weight_double_backward_batch_norm(op, shape, dtype, layout):
    """:func:`test_bias_without_weight_double_backward` for BatchNorm, whose double
    backward raises the same way without a weight (training and inference kernels,
    16-bit node's float32 reference too)."""
    from oracle import normalize64

    from normkit import functional as NF
    from normkit.norms import fused

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    c = shape[1]
    b = torch.randn(c, generator=gen, dtype=torch.float64).float().requires_grad_()
    rm, rv = torch.randn(c, generator=gen) * 0.1, torch.rand(c, generator=gen) + 0.5
    if op == "batch_norm":
        y = NF.batch_norm(x, None, None, None, b, True)
    elif op == "batch_norm_eval":
        y = NF.batch_norm(x, rm, rv, None, b, False)
    else:
        y = fused.batch_norm_act(x, None, None, None, b, True, act="silu")
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    gx, gb = torch.autograd.grad(y, (x, b), dy, create_graph=True)
    total = gx.double().square().sum() + gb.double().square().sum()
    hx = (torch.autograd.grad(total, (x, b), allow_unused=True)[0] if total.requires_grad
          else None)  # (inference BatchNorm is linear: nothing to differentiate again)
    hx = torch.zeros_like(x) if hx is None else hx
    x64 = x.detach().double().requires_grad_()
    if op == "batch_norm_eval":
        y64 = (x64 - rm.double().view(1, -1, 1, 1)) / torch.sqrt(rv.double() + 1e-5).view(
            1, -1, 1, 1)
    else:
        y64 = normalize64(x64, (0, 2, 3))
    b64 = b.detach().double().requires_grad_()
    y64 = y64 + b64.view(1, -1, 1, 1)
    y64 = torch.nn.functional.silu(y64) if op == "batch_norm_act" else y64
    gx64, gb64 = torch.autograd.grad(y64, (x64, b64), dy.double(), create_graph=True)
    total64 = gx64.square().sum() + gb64.square().sum()
    hx64 = (torch.autograd.grad(total64, x64, allow_unused=True)[0]
            if total64.requires_grad else None)
    hx64 = torch.zeros_like(x64) if hx64 is None else hx64
    assert_grad_close(gx.detach(), gx64.detach(), dtype, "input grad")
    assert_grad_close(hx, hx64, dtype, "second derivative")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("shape", "offset", "rows"), [
    ((4, 6, 9, 11), 0.5, True), ((2, 4, 3, 5, 6), 0.5, True), ((4, 6, 9, 11), 4.0, False)],
    ids=["4d", "5d", "past-the-bound"])
@pytest.mark.parametrize("needs", ["all", "params-only", "no-weight"])
def test_16bit_channels_last_instance_norm(dtype, shape, offset, rows, needs, monkeypatch,
                                           spy):
    """16-bit channels-last InstanceNorm runs torch's BatchNorm kernels sample by sample
    in its layout (``native.instance_norm_rows``, here at any sample size) where
    BatchNorm's channels-last rule allows (|mean| / std <= 2; past it, 4 std here, an
    NCHW copy through the GroupNorm kernel): output in the input's layout, output,
    gradients (for any subset of inputs, the upstream gradient in the other layout) and
    running statistics equal float64, and second derivatives equal float64's."""
    from oracle import normalize64

    import normkit
    from normkit.kernels import native

    monkeypatch.setattr(native, "INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS", 0)  # (small samples)
    served = spy(native, "instance_norm_rows")
    gen = torch.Generator().manual_seed(1)
    c = shape[1]
    affine = needs != "no-weight"
    module = normkit.InstanceNorm3d(c, affine=affine, track_running_stats=True) if len(
        shape) == 5 else normkit.InstanceNorm2d(c, affine=affine, track_running_stats=True)
    if affine:
        with torch.no_grad():
            module.weight.copy_(torch.rand(c, generator=gen) + 0.5)
            module.bias.copy_(torch.randn(c, generator=gen))
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 2 * offset).to(dtype)
    x = x.contiguous(memory_format=fmt).requires_grad_(needs != "params-only")
    y = module(x)
    assert bool(served) and (served[0] is not None) == rows
    assert y.dtype == dtype and y.is_contiguous(memory_format=fmt)
    dims = tuple(range(2, len(shape)))
    x64 = x.detach().double().requires_grad_(x.requires_grad)
    view = (1, c) + (1,) * len(dims)
    params = [p.detach().double().requires_grad_() for p in module.parameters()]
    ref = normalize64(x64, dims, *(p.view(view) for p in params))
    assert_close(y, ref, dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).contiguous()
    inputs = [t for t in (x, *module.parameters()) if t.requires_grad]
    inputs64 = [t for t in (x64, *params) if t.requires_grad]
    for got, want in zip(torch.autograd.grad(y, inputs, dy),
                         torch.autograd.grad(ref, inputs64, dy.double()), strict=True):
        assert_grad_close(got, want, dtype)
    count = x.numel() // (shape[0] * c)
    unbiased = x64.detach().var(dims, correction=1).mean(0)
    torch.testing.assert_close(module.running_var.double(), 0.9 + 0.1 * unbiased,
                               rtol=4 * torch.finfo(torch.float32).eps * count ** 0.5,
                               atol=0.0)
    if needs == "all":  # second derivatives: through float32 math, against float64
        x2 = x.detach().requires_grad_()
        first = torch.autograd.grad(module(x2), (x2, module.weight), dy, create_graph=True)
        direction = [torch.randn(t.shape, generator=gen, dtype=torch.float64)
                     for t in first]
        total = sum((g.double() * v).sum() for g, v in zip(first, direction, strict=True))
        second = torch.autograd.grad(total, (x2, module.weight))
        x64 = x.detach().double().requires_grad_()
        ref = normalize64(x64, dims, params[0].view(view), params[1].view(view))
        first64 = torch.autograd.grad(ref, (x64, params[0]), dy.double(), create_graph=True)
        total64 = sum((g * v).sum() for g, v in zip(first64, direction, strict=True))
        second64 = torch.autograd.grad(total64, (x64, params[0]))
        for got, want in zip(second, second64, strict=True):
            assert_grad_close(got, want, dtype, "second derivative")


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_16bit_channels_last_instance_norm_rows_size_floor(threads, monkeypatch):
    """The per-sample BatchNorm kernels serve samples of at least
    ``INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS`` per thread (below, their calls cost more than
    they save: the NCHW copy serves), and the floor scales with the thread count."""
    from normkit.kernels import native

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    floor = native.INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS * threads
    c = 16
    for positions, served in ((floor // c - 1, False), (floor // c, True)):
        x = torch.randn(2, c, positions, 1).bfloat16().contiguous(
            memory_format=torch.channels_last)
        assert (native.instance_norm_rows(x, None, None, 1e-5) is not None) == served


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0.5, 40.0], ids=["centered", "past-the-bound"])
def test_16bit_nchw_instance_norm_kernels(dtype, offset, monkeypatch, spy):
    """NCHW InstanceNorm of float16 input runs torch's BatchNorm statistics and inference
    kernels on the ``(1, N*C, L)`` view (torch's float16 GroupNorm kernels are the slow
    ones), bfloat16 the GroupNorm kernel; past the bound (40 std) the compensated core.
    Output, gradients, running statistics and second derivatives equal float64."""
    from oracle import normalize64

    import normkit
    from normkit.kernels import native

    monkeypatch.setattr(native, "FLOAT16_INSTANCE_VIEW_MIN_ELEMENTS", 0)  # (small input)
    served = spy(native, "batch_norm_by_moments")
    gen = torch.Generator().manual_seed(2)
    module = normkit.InstanceNorm2d(6, affine=True, track_running_stats=True)
    with torch.no_grad():
        module.weight.copy_(torch.rand(6, generator=gen) + 0.5)
        module.bias.copy_(torch.randn(6, generator=gen))
    module = module.to(dtype)
    x = (torch.randn(4, 6, 9, 11, generator=gen, dtype=torch.float64) + offset).to(dtype)
    x.requires_grad_()
    y = module(x)
    assert bool(served) == (dtype == torch.float16 and offset < 32)
    x64 = x.detach().double().requires_grad_()
    w64, b64 = (p.detach().double().requires_grad_() for p in module.parameters())
    ref = normalize64(x64, (2, 3), w64.view(1, 6, 1, 1), b64.view(1, 6, 1, 1))
    assert_close(y, ref, dtype)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    first = torch.autograd.grad(y, (x, *module.parameters()), dy.to(dtype), create_graph=True)
    first64 = torch.autograd.grad(ref, (x64, w64, b64), dy, create_graph=True)
    for got, want in zip(first, first64, strict=True):
        assert_grad_close(got.detach(), want.detach(), dtype)
    direction = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in first[:2]]
    second = torch.autograd.grad(sum((g.double() * v).sum() for g, v in zip(
        first[:2], direction, strict=True)), (x, module.weight))
    second64 = torch.autograd.grad(sum((g * v).sum() for g, v in zip(
        first64[:2], direction, strict=True)), (x64, w64))
    for got, want in zip(second, second64, strict=True):
        assert_grad_close(got, want, dtype, "second derivative")
    unbiased = x64.detach().var((2, 3), correction=1).mean(0)
    torch.testing.assert_close(module.running_var.double(), 0.9 + 0.1 * unbiased,
                               rtol=torch.finfo(dtype).eps, atol=0.0)  # (16-bit buffers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("offset", [0.5, 10.0], ids=["centered", "past-the-bound"])
@pytest.mark.parametrize("needs", ["none", "all", "input-only", "params-only", "plain"])
def test_16bit_nchw_layer_norm2d(dtype, offset, needs, monkeypatch, spy):
    """LayerNorm2d of NCHW 16-bit input normalizes each sample's ``(C, L)`` matrix in
    float32 and rounds once into the output (no transposing copies), its backward per
    sample in float32 too, where the statistics kernel's bound allows (|mean| / std <= 4;
    past it, 10 std here, the channels-innermost copy). Output, gradients (of every
    subset of inputs; torch's own 16-bit LayerNorm sums the weight gradient in 16 bits)
    and second derivatives equal float64, the output in NCHW."""
    from oracle import normalize64

    import normkit
    from normkit.kernels import native

    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_ELEMENTS", 0)  # (small input)
    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_POSITIONS_16BIT_INFERENCE", (0, 0))
    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_POSITIONS_16BIT", (0, 0))
    served = spy(native, "_layer_norm2d_nchw_16bit")
    gen = torch.Generator().manual_seed(3)
    affine = needs != "plain"
    module = normkit.LayerNorm2d(16, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            module.weight.copy_(torch.rand(16, generator=gen) + 0.5)
            module.bias.copy_(torch.randn(16, generator=gen))
    module = module.to(dtype)
    x = (torch.randn(4, 16, 9, 10, generator=gen, dtype=torch.float64) * 2 + 2 * offset)
    x = x.to(dtype).requires_grad_(needs in ("all", "input-only", "plain"))
    for p in module.parameters():
        p.requires_grad_(needs in ("all", "params-only"))
    y = module(x)
    assert len(served) == 1 and (served[0] is not None) == (offset < 4)
    assert y.dtype == dtype and y.is_contiguous()
    view = (1, 16, 1, 1)
    x64 = x.detach().double().requires_grad_(x.requires_grad)
    params = [p.detach().double().requires_grad_(p.requires_grad)
              for p in module.parameters()]
    ref = normalize64(x64, (1,), *(p.view(view) for p in params), eps=module.eps)
    assert_close(y, ref, dtype)
    if needs == "none":
        return
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    inputs = [t for t in (x, *module.parameters()) if t.requires_grad]
    inputs64 = [t for t in (x64, *params) if t.requires_grad]
    first = torch.autograd.grad(y, inputs, dy.to(dtype), create_graph=needs == "all")
    first64 = torch.autograd.grad(ref, inputs64, dy, create_graph=needs == "all")
    for got, want in zip(first, first64, strict=True):
        assert_grad_close(got.detach(), want.detach(), dtype)
    if needs == "all":  # second derivatives: through float32 math, against float64
        direction = [torch.randn(t.shape, generator=gen, dtype=torch.float64)
                     for t in first[:2]]
        second = torch.autograd.grad(sum((g.double() * v).sum() for g, v in zip(
            first[:2], direction, strict=True)), inputs[:2])
        second64 = torch.autograd.grad(sum((g * v).sum() for g, v in zip(
            first64[:2], direction, strict=True)), inputs64[:2])
        for got, want in zip(second, second64, strict=True):
            assert_grad_close(got, want, dtype, "second derivative")


def test_well_conditioned_decides_one_group_on_the_host_as_the_kernels_do():
    """A single group's check (a one-row LayerNorm: batch-1 inference, a decoding step)
    reads the two statistics back instead of running three kernels: the same verdict on
    every value, NaN and inf included (both send the input to the compensated path)."""
    from normkit.kernels.native import well_conditioned

    inf, nan = float("inf"), float("nan")
    means = [0.0, 1.0, -3.0, 31.9, 32.0, 32.1, -1e4, inf, -inf, nan]
    rstds = [0.0, 0.5, 1.0, 2.0, inf, nan]
    for m in means:
        for r in rstds:
            one = well_conditioned(torch.tensor([[m]]), torch.tensor([[r]]), 32.0)
            kernels = well_conditioned(torch.tensor([m, 0.0]), torch.tensor([r, 1.0]), 32.0)
            assert one == kernels, (m, r)
    mean = torch.tensor([2.0], requires_grad=True)
    assert well_conditioned(mean * 1.0, torch.tensor([1.0]), 32.0)


@pytest.mark.parametrize("offset", [0.0, 1e5], ids=["torch-kernel", "compensated"])
def test_one_row_layer_norm_keeps_both_paths(offset):
    """One row takes torch's kernel where accurate (bitwise its output) and the
    compensated path at an offset (within the float32 tolerance of float64)."""
    x = (torch.randn(1, 1, 96, dtype=torch.float64) * 3 + offset).float()
    ln = normkit.LayerNorm(96)
    y = ln(x)
    assert_close(y, torch.nn.functional.layer_norm(x.double(), (96,), ln.weight.double(),
                                                   ln.bias.double()), torch.float32)
    if offset == 0.0:
        assert torch.equal(y, torch.nn.functional.layer_norm(x, (96,), ln.weight, ln.bias))


def _act(name):
    return {"identity": lambda t: t, "silu": torch.nn.functional.silu,
            "elu": torch.nn.functional.elu}[name]


#: Layers whose statistics pool 2 or 3 values each (normkit._stats.FEW_VALUES), with a
#: float64 reference from torch.nn.functional on the same input and parameters.
_FEW_VALUES = {
    "LayerNorm-2": (lambda: normkit.LayerNorm(2), (5, 2),
                    lambda x, w, b: torch.nn.functional.layer_norm(x, (2,), w, b)),
    "LayerNorm-3": (lambda: normkit.LayerNorm(3), (5, 3),
                    lambda x, w, b: torch.nn.functional.layer_norm(x, (3,), w, b)),
    "RMSNorm-1": (lambda: normkit.RMSNorm(1, eps=1e-6), (5, 1),
                  lambda x, w: torch.nn.functional.rms_norm(x, (1,), w, 1e-6)),
    "BatchNorm1d-batch2": (lambda: normkit.BatchNorm1d(6), (2, 6),
                           lambda x, w, b: torch.nn.functional.batch_norm(
                               x, None, None, w, b, True)),
    "BatchNorm2d-2x1x1": (lambda: normkit.BatchNorm2d(4), (2, 4, 1, 1),
                          lambda x, w, b: torch.nn.functional.batch_norm(
                              x, None, None, w, b, True)),
    "GroupNorm-1x2": (lambda: normkit.GroupNorm(4, 4), (3, 4, 1, 2),
                      lambda x, w, b: torch.nn.functional.group_norm(x, 4, w, b)),
    "InstanceNorm1d-2": (lambda: normkit.InstanceNorm1d(4, affine=True), (3, 4, 2),
                         lambda x, w, b: torch.nn.functional.instance_norm(
                             x, weight=w, bias=b)),
    "LayerNorm2d-2": (lambda: normkit.LayerNorm2d(2), (3, 2, 5, 5),
                      lambda x, w, b: torch.nn.functional.layer_norm(
                          x.movedim(1, -1), (2,), w, b).movedim(-1, 1)),
    "BatchNormAct2d-elu": (lambda: normkit.BatchNormAct2d(4, act="elu"), (2, 4, 1, 1),
                           lambda x, w, b: _act("elu")(torch.nn.functional.batch_norm(
                               x, None, None, w, b, True))),
    "GroupNormAct-silu": (lambda: normkit.GroupNormAct(4, 4, act="silu"), (3, 4, 1, 2),
                          lambda x, w, b: _act("silu")(torch.nn.functional.group_norm(
                              x, 4, w, b))),
}


def _first_and_second(fn, x, params, dy, directions, dtype):
    """Derivatives of ``fn(x, *params)`` in ``dtype``: the first against ``dy``
    (``create_graph=True``), then those of their sum against ``directions``."""
    x = x.to(dtype).requires_grad_()
    params = [p.detach().to(dtype).requires_grad_() for p in params]
    first = torch.autograd.grad(fn(x, *params), [x, *params], dy.to(dtype), create_graph=True)
    total = sum((g.double() * d).sum() for g, d in zip(first, directions, strict=True))
    second = torch.autograd.grad(total, [x, *params], allow_unused=True)
    second = [torch.zeros_like(t) if h is None else h
              for h, t in zip(second, [x, *params], strict=True)]
    return first, second


@pytest.mark.parametrize("name", list(_FEW_VALUES))
def test_gradients_over_few_values_per_statistic_hold_float32_tolerance(name):
    """Over two or three values per statistic the input gradient is what ``eps`` leaves
    of cancelling terms, and float32 kernels (torch's too) lost digits there: normkit's
    first derivatives were 3.6e-5 to 6.7e-5 off, its second derivatives up to 6.4e-4
    (relative to their largest value). normkit now differentiates such statistics in
    float64: both orders within the float32 gradient tolerance, on many draws."""
    make, shape, reference = _FEW_VALUES[name]
    gen = torch.Generator().manual_seed(0)
    for draw in range(32):
        x = torch.randn(shape, generator=gen) * 2 + (0.0 if draw % 2 else 3.0)
        _derivatives_match_float64(make(), reference, x, gen, f"{name} draw {draw}")


def _derivatives_match_float64(module, reference, x, gen, what):
    """First and second derivatives of ``module(x)`` (float32; its parameters drawn
    around 1 from ``gen``) against ``reference(x, *parameters)`` in float64, for the
    input and every parameter, within the float32 gradient tolerance."""
    names = [n for n, _ in module.named_parameters()]
    params = list(module.parameters())
    with torch.no_grad():
        for p in params:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    dy = torch.randn(x.shape, generator=gen)
    directions = [torch.randn(t.shape, generator=gen, dtype=torch.float64)
                  for t in (x, *params)]

    def layer(x, *p):
        return torch.func.functional_call(module, dict(zip(names, p, strict=True)), (x,))

    got = _first_and_second(layer, x, params, dy, directions, torch.float32)
    want = _first_and_second(reference, x, params, dy, directions, torch.float64)
    for order, (gs, ws) in enumerate(zip(got, want, strict=True), 1):
        for i, (g, w) in enumerate(zip(gs, ws, strict=True)):
            assert_grad_close(g.detach(), w.detach(), torch.float32,
                              f"{what} derivative {order} of input {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_channels_last_batch_norm_gradient_whatever_the_upstream_gradients_layout(dtype):
    """torch's 16-bit BatchNorm backward kernel, handed a channels-last input and an NCHW
    upstream gradient, took a less accurate path (float16, an upstream gradient along the
    input: 3.9e-3 off float64 against 1.8e-5; the differential fuzz found it at 5.07e-3,
    past the 5e-3 tolerance). normkit hands it the gradient in the input's layout: the
    same bits either way."""
    gen = torch.Generator().manual_seed(11)
    x64 = torch.randn(8, 3, 45, 91, generator=gen, dtype=torch.float64)
    x0 = x64.to(dtype).contiguous(memory_format=torch.channels_last)
    grads = []
    for layout in (torch.channels_last, torch.contiguous_format):
        x = x0.clone().requires_grad_()
        (dx,) = torch.autograd.grad(normkit.BatchNorm2d(3)(x), x,
                                    x64.to(dtype).contiguous(memory_format=layout))
        grads.append(dx)
    assert torch.equal(grads[0], grads[1])
    ref = x0.double().requires_grad_()
    (want,) = torch.autograd.grad(torch.nn.BatchNorm2d(3).double()(ref), ref, x0.double())
    assert_grad_close(grads[1], want, dtype, "dx, NCHW upstream gradient")


#: Layers whose fast path repairs a few ill-conditioned rows or groups
#: (``native.RowRepair``): ``(module, input shape, which slice of the input to offset,
#: float64 reference)``. One row or group in 16 sits at ``|mean| / std`` ~1e4, past every
#: kernel's bound, so the kernel keeps the others and the repair takes that one.
_REPAIRED = {
    "LayerNorm": (lambda: normkit.LayerNorm(24), (16, 24), (3,),
                  lambda x, w, b: torch.nn.functional.layer_norm(x, (24,), w, b)),
    "GroupNorm": (lambda: normkit.GroupNorm(4, 8), (4, 8, 5, 5), (1, slice(2, 4)),
                  lambda x, w, b: torch.nn.functional.group_norm(x, 4, w, b)),
    "InstanceNorm2d": (lambda: normkit.InstanceNorm2d(4, affine=True), (4, 4, 6, 6), (2, 1),
                       lambda x, w, b: torch.nn.functional.instance_norm(x, weight=w,
                                                                         bias=b)),
    "LayerNorm2d": (lambda: normkit.LayerNorm2d(6), (2, 6, 9, 9), (1, slice(None), 4, 5),
                    lambda x, w, b: torch.nn.functional.layer_norm(
                        x.movedim(1, -1), (6,), w, b).movedim(-1, 1)),
}


@pytest.mark.parametrize("name", list(_REPAIRED))
def test_second_derivatives_through_repaired_rows(name, monkeypatch):
    """Double backward through a node whose forward repaired a few rows or groups
    differentiates normkit's reference math over every row (``native.repair_rows``,
    ``group_norm_with_stats``): first and second derivatives, input and parameters,
    within the float32 gradient tolerance of float64's; the repair is asserted to have
    run, so the test covers that node and not the all-compensated path."""
    from normkit.kernels import native

    make, shape, where, reference = _REPAIRED[name]
    repaired = []
    apply = native.RowRepair.apply
    monkeypatch.setattr(native.RowRepair, "apply",
                        staticmethod(lambda *a, **k: repaired.append(1) or apply(*a, **k)))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x[where] = x[where] * 0.5 + 5e3
    _derivatives_match_float64(make(), reference, x.float(), gen, name)
    assert repaired, f"{name}: the repair did not run (the test needs its node)"
