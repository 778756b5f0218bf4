"""Forward and every gradient of every core layer against the float64 oracle and torch."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from cases import (
    CASE_IDS,
    CASES,
    DTYPES,
    IMAGE_LAYERS,
    LAYOUTS,
    float64_twin,
    make_input,
    memory_format_of,
)
from oracle import assert_close, assert_grad_close, normalize64, reference_forward

import normkit
from normkit.kernels import channels, native
from normkit.norms import fused

# small inputs through normkit's fused rows node, not torch's composite (conftest.py)
pytestmark = pytest.mark.usefixtures("fused_rows_node")


def _run(case, dtype, layout, affine, training, backend="auto", **kwargs):
    x = make_input(case.shape, dtype, layout)
    if x is None:
        pytest.skip(f"{layout} does not apply to a {len(case.shape)}D input")
    nk, tm = case.build(affine, **kwargs)
    if dtype == torch.float64:
        nk, tm = nk.double(), (tm.double() if tm is not None else None)
    nk.backend = backend
    nk.train(training)
    if tm is not None:
        tm.train(training)
    ref_module = float64_twin(nk)
    x = x.requires_grad_()
    y = nk(x)
    x64 = x.detach().double().requires_grad_()
    ref = reference_forward(ref_module, x64, input_dtype=dtype)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    dy = dy.to(dtype)
    y.backward(dy)
    ref.backward(dy.double())
    return nk, tm, x, y, ref_module, x64, ref, dy


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_and_grads_match_float64_reference(case, dtype, layout, affine, training):
    nk, tm, x, y, ref_module, x64, ref, dy = _run(case, dtype, layout, affine, training)
    assert y.dtype == dtype
    assert memory_format_of(y) == memory_format_of(x)
    assert_close(y, ref, dtype)
    assert_grad_close(x.grad, x64.grad, dtype, "input grad")
    for (name, p), p64 in zip(nk.named_parameters(), ref_module.parameters(), strict=True):
        assert p.grad is not None, name
        assert_grad_close(p.grad, p64.grad, dtype, f"{name} grad")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
# The 1-element-per-group case is left to the oracle test: with zero variance,
# rstd = 1/sqrt(eps) ~ 316 amplifies torch's own float32 rounding in its input gradient
# (measured 6e-5 where the exact gradient is 0), so torch is no oracle there.
@pytest.mark.parametrize("case", [c for c in CASES if c.torch_cls and "1-per" not in c.name],
                         ids=lambda c: c.name)
def test_matches_torch(case, dtype, training):
    nk, tm, x, y, *_ = _run(case, dtype, "contiguous", True, training)
    xt = x.detach().clone().requires_grad_()
    yt = tm(xt)
    yt.backward(torch.randn(yt.shape, generator=torch.Generator().manual_seed(3),
                            dtype=torch.float64).to(dtype))
    assert_close(y, yt, dtype)
    assert_grad_close(x.grad, xt.grad, dtype, "input grad")
    for (name, p), pt in zip(nk.named_parameters(), tm.parameters(), strict=True):
        assert_grad_close(p.grad, pt.grad, dtype, f"{name} grad")
    for (name, b), bt in zip(nk.named_buffers(), tm.buffers(), strict=True):
        assert_close(b, bt, dtype if b.is_floating_point() else torch.float64, name)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_backend_equals_default(case):
    nk, *_ = case.build(True)
    x = make_input(case.shape, torch.float32, "contiguous").requires_grad_()
    y = nk(x)
    y.sum().backward()
    fast = [x.grad.clone()] + [p.grad.clone() for p in nk.parameters()]
    x.grad = None
    nk.zero_grad()
    nk.backend = "reference"
    y_ref = nk(x)
    y_ref.sum().backward()
    slow = [x.grad] + [p.grad for p in nk.parameters()]
    assert_close(y, y_ref, torch.float32)
    for a, b in zip(fast, slow, strict=True):
        assert_grad_close(a, b, torch.float32)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradcheck_float64(case):
    nk, _ = case.build(True)
    nk = nk.double()
    # small enough for finite differences; channels and normalized_shape kept
    shape = {"LayerNorm": (2, 3, 7), "RMSNorm": (2, 3, 7)}.get(
        case.name, (2,) + case.shape[1:2] + tuple(min(s, 3) for s in case.shape[2:]))
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    params = [p for p in nk.parameters()]

    names = [name for name, _ in nk.named_parameters()]

    def fn(x, *ps):
        return torch.func.functional_call(nk, dict(zip(names, ps, strict=True)), (x,))

    nk.train()
    if nk.__class__.__name__.startswith("BatchNorm"):
        nk.track_running_stats = False
        nk.running_mean = nk.running_var = None
    assert torch.autograd.gradcheck(fn, (x, *params))
    assert torch.autograd.gradgradcheck(fn, (x, *params))


@pytest.mark.parametrize("momentum", [0.1, 0.7, None])
@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith(("Batch", "Instance"))],
                         ids=lambda c: c.name)
def test_running_statistics_follow_torch(case, momentum):
    nk, tm = case.build(True, momentum=momentum, track_running_stats=True)
    for step in range(4):
        x = make_input(case.shape, torch.float32, "contiguous", seed=step, offset=step, scale=2)
        nk.train(), tm.train()
        torch.testing.assert_close(nk(x), tm(x), atol=2e-5, rtol=2e-5)
    for (name, b), bt in zip(nk.named_buffers(), tm.buffers(), strict=True):
        torch.testing.assert_close(b, bt, atol=1e-6, rtol=1e-6, msg=name)
    nk.eval(), tm.eval()
    x = make_input(case.shape, torch.float32, "contiguous", seed=9)
    torch.testing.assert_close(nk(x), tm(x), atol=2e-5, rtol=2e-5)


#: BatchNorm-like layers and the torch layer whose running-statistics rule each follows.
_LATE_FLAG = {
    "BatchNorm2d": (lambda nk: nk.BatchNorm2d(3), torch.nn.BatchNorm2d),
    "BatchNormAct2d": (lambda nk: nk.BatchNormAct2d(3, act="identity"), torch.nn.BatchNorm2d),
    "SyncBatchNorm": (lambda nk: nk.SyncBatchNorm(3), torch.nn.BatchNorm2d),
    "BatchRenorm2d": (lambda nk: nk.BatchRenorm2d(3), torch.nn.BatchNorm2d),
    "MeanOnlyBatchNorm2d": (lambda nk: nk.MeanOnlyBatchNorm2d(3), torch.nn.BatchNorm2d),
    "InstanceNorm2d": (lambda nk: nk.InstanceNorm2d(3, track_running_stats=True),
                       torch.nn.InstanceNorm2d),
}


@pytest.mark.parametrize("name", list(_LATE_FLAG))
def test_track_running_stats_turned_off_after_construction_follows_torch(name):
    """Fine-tuning and test-time adaptation code sets ``track_running_stats = False`` on
    a built layer to stop its running statistics moving: torch's BatchNorm then stops
    updating them (and still uses them in eval); torch's InstanceNorm keeps updating
    them. Each normkit layer does what its torch counterpart does."""
    import normkit

    make, torch_cls = _LATE_FLAG[name]
    nk, tm = make(normkit), torch_cls(3, track_running_stats=True)
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    nk.train()(x), tm.train()(x)  # running statistics away from their initial values
    for m in (nk, tm):
        m.track_running_stats = False
    before = {k: v.clone() for k, v in nk.state_dict().items()}
    torch_before = tm.running_mean.clone()
    nk(x * 3 + 2), tm(x * 3 + 2)
    torch_moved = not torch.equal(torch_before, tm.running_mean)
    moved = not torch.equal(before["running_mean"], nk.running_mean)
    assert moved == torch_moved, f"{name}: running_mean moved {moved}, torch's {torch_moved}"
    if not moved:
        assert all(torch.equal(v, nk.state_dict()[k]) for k, v in before.items())
        y = nk.eval()(x)  # eval still normalizes with the running statistics
        assert not torch.allclose(y.mean((0, 2, 3)), torch.zeros(3), atol=1e-3)


def test_batchnorm_without_running_stats_uses_batch_stats_in_eval():
    import normkit
    nk, tm = normkit.BatchNorm2d(3, track_running_stats=False), torch.nn.BatchNorm2d(
        3, track_running_stats=False)
    nk.eval(), tm.eval()
    x = torch.randn(4, 3, 5, 5) * 3 + 2
    torch.testing.assert_close(nk(x), tm(x))
    assert nk.running_mean is None and "running_mean" not in nk.state_dict()


_FROZEN_INPUT_LAYERS = {  # (below and from GROUP_NORM_MIN_POSITIONS: torch's kernels, engine)
    "GroupNorm": lambda c: normkit.GroupNorm(2, c),
    "GroupNormAct": lambda c: normkit.GroupNormAct(2, c, act="silu"),
    "InstanceNorm": lambda c: normkit.InstanceNorm2d(c, affine=True),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(3, 4, 5, 5), (2, 4, 24, 24), (2, 4, 3, 4, 5)],
                         ids=["small", "engine", "5d"])
@pytest.mark.parametrize("name", list(_FROZEN_INPUT_LAYERS))
def test_channels_last_input_without_a_gradient_under_trainable_parameters(name, shape, dtype,
                                                                           compiled):
    """A channels-last input that needs no gradient (image data into a first layer, a
    frozen backbone under trainable norms) with a weight and bias that do: torch's CPU
    GroupNorm backward kernel crashes the process there (segmentation fault, torch 2.13;
    ``nn.GroupNorm`` itself does), so normkit asks it for the input gradient too
    (``native.group_norm_backward``). The parameter gradients match float64."""
    if name == "InstanceNorm" and len(shape) == 5:
        pytest.skip("InstanceNorm2d takes 4D input")
    if compiled and dtype != torch.float32:
        pytest.skip("one dtype under torch.compile (compile time)")
    module = _FROZEN_INPUT_LAYERS[name](shape[1]).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)).to(dtype))
    layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
         * 2 + 3).to(dtype).contiguous(memory_format=layout)
    run = torch.compile(module, backend="aot_eager", fullgraph=True) if compiled else module
    y = run(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y.backward(dy.to(dtype))
    params64 = [p.detach().double().requires_grad_() for p in module.parameters()]
    groups = shape[1] if name == "InstanceNorm" else 2
    # (NCHW: torch's own GroupNorm would crash on the channels-last float64 copy)
    ref = torch.nn.functional.group_norm(x.double().contiguous(), groups, *params64)
    if name == "GroupNormAct":
        ref = torch.nn.functional.silu(ref)
    ref.backward(dy)
    for (pname, p), p64 in zip(module.named_parameters(), params64, strict=True):
        assert_grad_close(p.grad, p64.grad, dtype, f"{name} {pname} grad")


#: Every layer with its input shape(s), at sizes where the fast paths serve it.
_IN_PLACE_AFTER = {
    **{name: (functools.partial(make, 16), (8, 16, 20, 20))
       for name, make in IMAGE_LAYERS.items()},
    "LayerNorm": (lambda: normkit.LayerNorm(512), (300, 512)),
    "RMSNorm": (lambda: normkit.RMSNorm(512), (300, 512)),
    "AddLayerNorm": (lambda: normkit.AddLayerNorm(512), ((300, 512), (300, 512))),
    "AddRMSNorm": (lambda: normkit.AddRMSNorm(512), ((300, 512), (300, 512))),
    "LayerNormLSTMCell": (lambda: normkit.LayerNormLSTMCell(16, 8), (6, 16)),
}


@pytest.mark.parametrize("offset", [1.0, 1e3], ids=["kernels", "compensated"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("name", list(_IN_PLACE_AFTER))
def test_output_can_be_changed_in_place(name, layout, offset):
    """User code scales or activates a norm's output in place (``y.mul_(g)``,
    ``nn.ReLU(inplace=True)`` after a BatchNorm), as torch's layers allow; a custom
    autograd node whose output is a view forbids it (RMSNorm's did). Gradients through
    the in-place change equal float64's. (In-Place ABN is the documented exception.)"""
    make, shape = _IN_PLACE_AFTER[name]
    shapes = shape if isinstance(shape[0], tuple) else (shape,)
    if layout == "channels_last" and len(shapes[0]) != 4:
        pytest.skip("channels_last takes 4D input")
    torch.manual_seed(0)
    module = make()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    twin = float64_twin(module)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64) * 2 + offset for s in shapes]
    xs = [t.float() for t in inputs]
    if layout == "channels_last":
        xs = [t.contiguous(memory_format=torch.channels_last) for t in xs]
    xs = [t.requires_grad_() for t in xs]
    refs = [t.float().double().requires_grad_() for t in inputs]
    y, y_ref = module(*xs), twin(*refs)
    y, y_ref = (y[0], y_ref[0]) if isinstance(y, tuple) else (y, y_ref)
    y.mul_(2.0).sigmoid_()  # (smooth: a ReLU's kink turns rounding into a jump)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(dy.float())
    (y_ref * 2.0).sigmoid().backward(dy)
    assert_grad_close(xs[0].grad, refs[0].grad, torch.float32, f"{name} input grad")


def _renorm_past_warm_up() -> torch.nn.Module:
    layer = normkit.BatchRenorm2d(16)
    layer.num_batches_tracked.fill_(10**6)  # (r and d clipped at their final limits)
    return layer


#: Every layer at fast-path sizes, and the layers whose path reads a value to choose.
_SHAPE_INFERENCE = {
    **_IN_PLACE_AFTER,
    "BatchRenorm2d past its warm-up": (_renorm_past_warm_up, (8, 16, 20, 20)),
    "In-Place ABN": (lambda: normkit.BatchNormAct2d(16, act="leaky_relu", memory="inplace"),
                     (8, 16, 20, 20)),
    "SyncBatchNorm": (lambda: normkit.SyncBatchNorm(16), (8, 16, 20, 20)),
    "LayerNormLSTM": (lambda: normkit.LayerNormLSTM(16, 8, num_layers=2), (5, 3, 16)),
    "weight-normed Linear": (lambda: normkit.weight_norm(torch.nn.Linear(16, 8)), (6, 16)),
    "RMSNorm from 2^16 elements": (lambda: normkit.RMSNorm(1024), (128, 1024)),
    "PowerNorm": (lambda: normkit.PowerNorm(16, warmup_iters=1, group_num=4), (5, 3, 16)),
    "AdaptiveGroupNorm": (lambda: normkit.AdaptiveGroupNorm(2, 16, 6),
                          ((8, 16, 20, 20), (8, 6))),
}


def _shapes_of(module, xs):
    """The output's and every gradient's shape and dtype, after a backward."""
    out = module(*xs)
    first = out[0] if isinstance(out, tuple) else out
    first.sum().backward()
    tensors = [first, *(x.grad for x in xs), *(p.grad for p in module.parameters())]
    return [(tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("without_data", ["meta", "FakeTensorMode"])
@pytest.mark.parametrize("name", list(_SHAPE_INFERENCE))
def test_shape_inference_without_data(name, without_data):
    """Shape and memory estimation runs a model on tensors without values: on the meta
    device, or under a ``FakeTensorMode`` (torch's memory and runtime estimators). torch's
    layers run there; normkit's read statistics back to choose a path (accuracy checks,
    In-Place ABN's unrecoverable channels, Batch Renormalization's step count), which
    such tensors refuse. Outputs and gradients have the shapes and dtypes of a real run,
    and under a FakeTensorMode the real buffers are left as torch's layers leave them
    (only the step count moves)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    make, shape = _SHAPE_INFERENCE[name]
    shapes = shape if isinstance(shape[0], tuple) else (shape,)
    module = make()
    want = _shapes_of(copy.deepcopy(module), [torch.randn(s).requires_grad_() for s in shapes])
    if without_data == "meta":
        module = module.to("meta")
        got = _shapes_of(module, [torch.empty(s, device="meta").requires_grad_()
                                  for s in shapes])
    else:
        before = copy.deepcopy(module.state_dict())
        with FakeTensorMode(allow_non_fake_inputs=True):
            got = _shapes_of(module, [torch.empty(s).requires_grad_() for s in shapes])
        for key, value in module.state_dict().items():
            moved = before[key] + 1 if key.endswith("num_batches_tracked") else before[key]
            assert torch.equal(value, moved), f"{name}: {key} changed under FakeTensorMode"
    assert got == want


#: Per-sample layers that normalize each sample alone, bit for bit, each with an input
#: shape whose samples can be offset, its memory format, whether it takes a residual
#: (whose sum is normalized), and the size floors to lower so that a sample alone takes
#: the batch's path (``(module, name): value``; paths are chosen by size, and different
#: paths round differently).
_CL = torch.channels_last
_SHARE = {(channels, "REPAIR_MAX_SHARE"): 1.0}  # (three samples of six: repaired, too)
_ENGINE = {(channels, "MIN_ELEMENTS"): 0, (channels, "GROUP_NORM_MIN_POSITIONS"): 16,
           **_SHARE}
_LN2D_PER_SAMPLE = {(native, "LAYER_NORM2D_REPAIR_MAX_SHARE"): 1.0,
                    (native, "LAYER_NORM2D_MIN_ELEMENTS"): 0,
                    (native, "LAYER_NORM2D_CHANNEL_SUMS"): ((0, 0), (0, 0)),
                    (native, "LAYER_NORM2D_CHANNEL_SUMS_INFERENCE"): ((0, 0), (0, 0)),
                    (native, "LAYER_NORM2D_MIN_POSITIONS"): (1, 1),
                    (native, "LAYER_NORM2D_MIN_POSITIONS_INFERENCE"): (1, 1),
                    (native, "LAYER_NORM2D_MIN_POSITIONS_16BIT"): (1, 1),
                    (native, "LAYER_NORM2D_MIN_POSITIONS_16BIT_INFERENCE"): (1, 1)}
_LN2D_CHANNEL_SUMS = {**_LN2D_PER_SAMPLE,
                      (native, "LAYER_NORM2D_CHANNEL_SUMS"): ((1, 1 << 30),) * 2,
                      (native, "LAYER_NORM2D_CHANNEL_SUMS_INFERENCE"): ((1, 1 << 30),) * 2,
                      (native, "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS"): (0, 0),
                      (native, "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS_INFERENCE"): (0, 0)}
_ROW_LAYERS = {
    "LayerNorm": (lambda: normkit.LayerNorm(64), (40, 64), None, False, {}),
    "LayerNorm over (4, 16)": (lambda: normkit.LayerNorm((4, 16)), (12, 3, 4, 16), None,
                               False, {}),
    "LayerNorm2d channels_last": (lambda: normkit.LayerNorm2d(32), (6, 32, 5, 5), _CL,
                                  False, {}),
    "LayerNorm2d NCHW": (lambda: normkit.LayerNorm2d(16), (8, 16, 5, 5), None, False, {}),
    "LayerNorm2d NCHW, per sample": (lambda: normkit.LayerNorm2d(16), (6, 16, 8, 8), None,
                                     False, _LN2D_PER_SAMPLE),
    "LayerNorm2d NCHW, channel sums": (lambda: normkit.LayerNorm2d(16), (6, 16, 8, 8), None,
                                       False, _LN2D_CHANNEL_SUMS),
    "AddLayerNorm": (lambda: normkit.AddLayerNorm(64), (40, 64), None, True, {}),
    "GroupNorm NCHW": (lambda: normkit.GroupNorm(4, 16), (8, 16, 5, 5), None, False, {}),
    "GroupNorm NCHW, 3D": (lambda: normkit.GroupNorm(2, 8), (6, 8, 7), None, False, {}),
    "GroupNorm channels_last": (lambda: normkit.GroupNorm(4, 16), (8, 16, 5, 5), _CL, False,
                                _SHARE),
    "GroupNorm channels_last, engine": (lambda: normkit.GroupNorm(4, 16), (6, 16, 8, 8), _CL,
                                        False, _ENGINE),
    "GroupNormAct NCHW": (lambda: normkit.GroupNormAct(4, 16, act="relu"), (8, 16, 5, 5),
                          None, False, {}),
    "GroupNormAct channels_last": (lambda: normkit.GroupNormAct(4, 16, act="relu"),
                                   (8, 16, 5, 5), _CL, False, {}),
    "GroupNormAct channels_last, engine": (lambda: normkit.GroupNormAct(4, 16, act="relu"),
                                           (6, 16, 8, 8), _CL, False, _ENGINE),
    "InstanceNorm2d NCHW": (lambda: normkit.InstanceNorm2d(16, affine=True,
                                                           track_running_stats=True),
                            (8, 16, 5, 5), None, False, {}),
    "InstanceNorm2d channels_last": (lambda: normkit.InstanceNorm2d(
        16, affine=True, track_running_stats=True), (8, 16, 5, 5), _CL, False, {}),
    "InstanceNorm2d channels_last, engine": (lambda: normkit.InstanceNorm2d(
        16, affine=True, track_running_stats=True), (6, 16, 8, 8), _CL, False, _ENGINE),
}


@pytest.mark.parametrize("path", ["kernel", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset_samples", [(3,), (0, 4, 5)], ids=["one", "three"])
@pytest.mark.parametrize("name", list(_ROW_LAYERS))
def test_each_sample_is_normalized_as_if_alone(name, offset_samples, dtype, path,
                                               monkeypatch):
    """torch's LayerNorm (GroupNorm) normalizes each row (group) by itself: a sample
    gives the same bits alone or in any batch. normkit's accuracy check sent the whole
    batch to the compensated path when one row was far off its spread (an outlier token,
    a constant padding row, a blank image), changing every other sample by an ulp or two
    and costing the batch 2-4x the time. Now only those rows take it: each sample's
    output equals its output alone, bit for bit, and outputs and every gradient of the
    mixed batch are within the per-dtype tolerance of float64."""
    if path == "blocks":
        if dtype != torch.float32:
            pytest.skip("the blocked kernel serves float32/float64")
        # (the blocked kernel from any size, in blocks of a few rows)
        monkeypatch.setattr(native, "fresh_out_like", lambda x, *a, **k: torch.empty_like(x))
        monkeypatch.setattr(native, "LAYER_NORM_BLOCK_BYTES", 1024)
    make, shape, memory_format, residual, floors = _ROW_LAYERS[name]
    for (where, attr), value in floors.items():
        monkeypatch.setattr(where, attr, value)
    # (GroupNormAct's one autograd node at any size; ReLU, exact in vector code and scalar
    # tails alike: torch's elementwise SiLU itself rounds a sample alone differently)
    monkeypatch.setattr(fused, "FUSED_ACT_MIN_ELEMENTS", 1)
    torch.manual_seed(0)
    module = make().to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape).to(dtype))
    twin = float64_twin(module)
    inputs64 = [torch.randn(shape, dtype=torch.float64) for _ in range(1 + residual)]
    for i in offset_samples:
        # (|mean| / std ~ 3e5 in the normalized sum: past the kernel's bound)
        inputs64[0][i] = inputs64[0][i] * 0.01 + 3000.0
        if residual:  # (zero: the sum, rounded to dtype, is then exact as float64's)
            inputs64[1][i] = 0.0
    inputs = [t.to(dtype) for t in inputs64]
    if memory_format is not None:
        inputs = [t.contiguous(memory_format=memory_format) for t in inputs]
    inputs = [t.requires_grad_() for t in inputs]

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    running = copy.deepcopy(dict(module.named_buffers()))
    out = module(*inputs)
    y = first(out)
    updated = copy.deepcopy(dict(module.named_buffers()))  # (before the calls alone)
    with torch.no_grad():
        for i in range(shape[0]):
            alone = first(module(*(t[i:i + 1].detach() for t in inputs)))
            assert torch.equal(y[i:i + 1], alone), f"{name}: sample {i} differs from alone"
    # (the oracle's independent float64 formulas, with the twin's parameters as leaves:
    # the twin itself runs normkit's own paths in float64)
    refs = [t.detach().double().requires_grad_() for t in inputs]
    if residual:
        dims = tuple(range(len(shape) - len(twin.normalized_shape), len(shape)))
        ref = normalize64(refs[0] + refs[1], dims, twin.weight, twin.bias, twin.eps)
    else:
        ref = reference_forward(twin, refs[0])
    assert_close(y, ref, dtype, f"{name} output")
    if "running_mean" in running:  # (InstanceNorm: the batch-averaged instance statistics)
        x64, m = inputs[0].detach().double(), module.momentum  # (as rounded to dtype)
        means = x64.flatten(2).mean(-1).mean(0)
        variances = x64.flatten(2).var(-1).mean(0)
        assert_close(updated["running_mean"], (1 - m) * running["running_mean"].double()
                     + m * means, dtype, f"{name} running_mean")
        assert_close(updated["running_var"], (1 - m) * running["running_var"].double()
                     + m * variances, dtype, f"{name} running_var")
    dy = torch.randn(shape, dtype=torch.float64)
    if residual:  # (a gradient through the new residual stream too, as a block sends one)
        ds = torch.randn(shape, dtype=torch.float64)
        torch.autograd.backward([y, out[1]], [dy.to(dtype), ds.to(dtype)])
        torch.autograd.backward([ref, refs[0] + refs[1]], [dy, ds])
    else:
        y.backward(dy.to(dtype))
        ref.backward(dy)
    for t, t64 in zip(inputs, refs, strict=True):
        assert_grad_close(t.grad, t64.grad, dtype, f"{name} input grad")
    for (pname, p), p64 in zip(module.named_parameters(), twin.parameters(), strict=True):
        assert_grad_close(p.grad, p64.grad, dtype, f"{name} {pname} grad")


@pytest.mark.parametrize("name", ["LayerNorm", "LayerNorm2d", "AddLayerNorm"])
def test_layer_norm_of_single_values_has_a_zero_input_gradient(name):
    """A LayerNorm over one value (LayerNorm2d of one channel) outputs its bias, and its
    input gradient is zero. torch's kernels give that zero as rounding times
    1/sqrt(eps) (6.1e-5 in float32); with the row-by-row repair, rows of |x| < 0.1 kept
    the kernel's result, so the dispatch fuzz saw it. Such input takes the exact path."""
    torch.manual_seed(0)
    x = torch.randn(4, 256, 1) if name != "LayerNorm2d" else torch.randn(3, 1, 13, 11)
    x.requires_grad_()
    module = {"LayerNorm": lambda: normkit.LayerNorm(1),
              "LayerNorm2d": lambda: normkit.LayerNorm2d(1),
              "AddLayerNorm": lambda: normkit.AddLayerNorm(1)}[name]()
    with torch.no_grad():  # (a weight other than 1: its rounding is what showed)
        module.weight.copy_(torch.rand(module.weight.shape) + 0.5)
        module.bias.add_(torch.randn(module.bias.shape))
    out = module(x, torch.zeros_like(x)) if name == "AddLayerNorm" else module(x)
    y = out[0] if isinstance(out, tuple) else out
    # (one channel, one bias value: it broadcasts to every output)
    torch.testing.assert_close(y, module.bias.expand(y.shape), rtol=0, atol=0)
    y.backward(torch.randn(y.shape))
    assert float(x.grad.abs().max()) == 0.0


@pytest.mark.parametrize("name", ["GroupNorm channels_last, engine",
                                  "InstanceNorm2d channels_last, engine",
                                  "LayerNorm2d NCHW, per sample"])
def test_many_offset_samples_take_the_whole_batch_path(name, monkeypatch):
    """The per-group repair pays off for a few groups only: where the whole call's own
    fallback is cheap (torch's kernels on an NCHW or channels-innermost copy), more than
    ``REPAIR_MAX_SHARE`` of the groups past the bound send the call there (measured
    crossovers: channels.REPAIR_MAX_SHARE, native.LAYER_NORM2D_REPAIR_MAX_SHARE). Either
    way the output and gradients are within tolerance of float64."""
    make, _, memory_format, _, floors = _ROW_LAYERS[name]
    for (where, attr), value in floors.items():
        if "REPAIR_MAX_SHARE" not in attr:  # (the shares as shipped)
            monkeypatch.setattr(where, attr, value)
    repairs = []  # (of the strided rows: the fallback's own flat-row repairs not counted)
    real = native.RowRepair.apply
    monkeypatch.setattr(native.RowRepair, "apply", classmethod(
        lambda cls, y, x, *args, **kwargs: repairs.append(
            kwargs.get("positions") or not x.is_contiguous()) or real(y, x, *args, **kwargs)))
    torch.manual_seed(0)
    module = make()
    for offset, repaired in ((1, True), (8, False)):  # (1 or 8 of 32 samples)
        repairs.clear()
        x64 = torch.randn(32, 16, 8, 8, dtype=torch.float64)
        x64[:offset] = x64[:offset] * 0.01 + 3000.0
        x = x64.float().contiguous(memory_format=memory_format or torch.contiguous_format)
        x.requires_grad_()
        y = module(x)
        assert any(repairs) == repaired, f"{name}: {offset} offset samples"
        ref64 = x.detach().double().requires_grad_()
        ref = reference_forward(float64_twin(module), ref64)
        assert_close(y, ref, torch.float32, f"{name} output")
        dy = torch.randn(x.shape, dtype=torch.float64)
        y.backward(dy.float())
        ref.backward(dy)
        assert_grad_close(x.grad, ref64.grad, torch.float32, f"{name} input grad")
