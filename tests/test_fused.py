"""Fused ops (normkit.norms.fused) against float64 references written with plain torch ops.

Every fast path is exercised here and compared with the reference on the same input:
residual add + LayerNorm (torch's kernel, compensated core) and + RMSNorm (hand-derived);
BatchNorm + activation (row statistics for contiguous input, torch's statistics kernel for
channels-last, compensated core at an offset), In-Place ABN (output-only saving, recovered
input, per-channel fallback); GroupNorm + activation (torch's kernel, channels-last sums,
compensated core).
"""

from __future__ import annotations

import pytest
import torch
from cases import TORCH_RELEASE, make_input, memory_format_of
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_close, assert_grad_close, channel_view, normalize64
from torch import nn
from torch.nn import functional as TF

import normkit.functional as F
from normkit.norms.fused import (
    ACTIVATIONS,
    INVERTIBLE_ACTIVATIONS,
    AddLayerNorm,
    AddRMSNorm,
    BatchNormAct1d,
    BatchNormAct2d,
    BatchNormAct3d,
    GroupNormAct,
    add_layer_norm,
    add_rms_norm,
    batch_norm_act,
    group_norm_act,
    make_activation,
)

# small inputs through normkit's fused rows node, not torch's composite (conftest.py)
pytestmark = pytest.mark.usefixtures("fused_rows_node")

DTYPES = [torch.float64, torch.float32, torch.bfloat16]
LAYOUTS = ["contiguous", "channels_last"]


@pytest.fixture(autouse=True)
def small_inputs_take_the_slice_sums_engine(monkeypatch):
    """The engine's size floor (kernels.channels.MIN_ELEMENTS) is a speed rule; these
    tests exercise the engine on small inputs (test_engine_size_floor_for_batch_norm_act
    checks the floor itself)."""
    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are tiny: with intra-op threads on a busy machine, torch's
    per-channel kernels wait on descheduled threads (gradcheck: seconds per test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def act64(name: str, y: torch.Tensor, negative_slope: float = 0.01,
          alpha: float = 1.0) -> torch.Tensor:
    """The activations, written out (not normkit's Activation)."""
    if name == "relu":
        return y.clamp(min=0)
    if name == "leaky_relu":
        return torch.where(y >= 0, y, y * negative_slope)
    if name == "elu":
        return torch.where(y > 0, y, alpha * torch.expm1(y))
    if name == "silu":
        return y * torch.sigmoid(y)
    if name == "gelu":
        return 0.5 * y * (1 + torch.erf(y / 2 ** 0.5))
    return y


def bn_act64(x, weight, bias, act, eps=1e-5, **act_kw):
    dims = (0, *range(2, x.dim()))
    w, b = channel_view(weight, x.dim()), channel_view(bias, x.dim())
    return act64(act, normalize64(x, dims, w, b, eps), **act_kw)


def gn_act64(x, groups, weight, bias, act, eps=1e-5):
    xg = x.unflatten(1, (groups, x.shape[1] // groups))
    y = normalize64(xg, tuple(range(2, xg.dim())), None, None, eps).flatten(1, 2)
    if weight is not None:
        y = y * channel_view(weight, x.dim()).double()
    if bias is not None:
        y = y + channel_view(bias, x.dim()).double()
    return act64(act, y)


def params(c, dtype, affine, seed=3):
    if not affine:
        return None, None
    gen = torch.Generator().manual_seed(seed)
    w = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    b = (torch.randn(c, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    return w.requires_grad_(), b.requires_grad_()


def leaf64(t):
    return None if t is None else t.detach().double().requires_grad_()


def grads_of(out, inputs, grad):
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(out, wanted, grad))
    return [next(got) if t is not None else None for t in inputs]


def check_grads(actual, expected, dtype, names):
    for a, e, name in zip(actual, expected, names, strict=True):
        if e is not None:
            assert_grad_close(a, e, dtype, name)


# --------------------------------------------------------------------------- activations


def test_activation_inverse_and_derivative_from_output():
    y = torch.linspace(-6, 6, 96, dtype=torch.float64)  # (no kink at 0)
    dz = torch.randn(96, dtype=torch.float64)
    for name in ACTIVATIONS:
        act = make_activation(name, negative_slope=0.2, alpha=0.7)
        z = act(y)
        torch.testing.assert_close(z, act64(name, y, 0.2, 0.7))
        y_ = y.clone().requires_grad_()
        expected = torch.autograd.grad(act64(name, y_, 0.2, 0.7), y_, dz)[0]
        torch.testing.assert_close(act.backward(dz, z, y), expected)
        if name in INVERTIBLE_ACTIVATIONS:
            torch.testing.assert_close(act.inverse(z), y, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("act, kw", [("relu", {}), ("silu", {}), ("gelu", {}),
                                     ("leaky_relu", {"negative_slope": 0.0}),
                                     ("elu", {"alpha": -1.0})])
def test_inplace_memory_rejects_non_invertible_activations(act, kw):
    with pytest.raises(ValueError, match="leaky_relu, elu, identity") as info:
        BatchNormAct2d(4, act=act, memory="inplace", **kw)
    assert repr(act) in str(info.value)
    with pytest.raises(ValueError, match="invertible"):
        batch_norm_act(torch.randn(4, 4, 3), None, None, training=True, act=act,
                       memory="inplace", **kw)


def test_bad_act_memory_and_backend_are_named():
    with pytest.raises(ValueError, match=r"act to be one of .*'mish'"):
        BatchNormAct2d(4, act="mish")
    with pytest.raises(ValueError, match=r"memory to be one of .*'low'"):
        BatchNormAct2d(4, memory="low")
    with pytest.raises(ValueError, match=r"act to be one of .*'tanh'"):
        GroupNormAct(2, 4, act="tanh")
    with pytest.raises(ValueError, match="backend"):
        add_layer_norm(torch.randn(2, 4), None, 4, backend="fast")


# --------------------------------------------------------------------------- BatchNorm + act


def _bn_cases():
    for dtype in DTYPES:
        for layout in LAYOUTS:
            for act in ACTIVATIONS:
                for memory in ("standard", "inplace"):
                    if memory == "inplace" and act not in INVERTIBLE_ACTIVATIONS:
                        continue
                    yield pytest.param(dtype, layout, act, memory,
                                       id=f"{str(dtype)[6:]}-{layout}-{act}-{memory}")


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype, layout, act, memory", list(_bn_cases()))
def test_batch_norm_act_training_matches_reference(dtype, layout, act, memory, affine):
    x0 = make_input((6, 5, 4, 5), dtype, layout, seed=1, scale=2.0, offset=0.5)
    w, b = params(5, dtype, affine)
    leaf = x0.clone().requires_grad_()
    x = leaf * 1  # an intermediate tensor: memory="inplace" may overwrite it
    z = batch_norm_act(x, None, None, w, b, True, act=act, memory=memory,
                       negative_slope=0.1, alpha=0.8)
    assert z.dtype == dtype and memory_format_of(z) == memory_format_of(x0)
    x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
    ref = bn_act64(x64, w64, b64, act, negative_slope=0.1, alpha=0.8)
    assert_close(z, ref, dtype)
    dz = torch.randn(z.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = grads_of(z, [leaf, w, b], dz.to(dtype))
    expected = grads_of(ref, [x64, w64, b64], dz)
    check_grads(got, expected, dtype, ["dx", "dweight", "dbias"])


@pytest.mark.parametrize("offset", [8.0, 1e4], ids=["ratio-8", "offset-1e4"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memory", ["standard", "inplace"])
def test_batch_norm_act_keeps_precision_at_an_offset(offset, layout, memory):
    # ratio 8: row statistics are rejected (|mean|/std > 2), torch's kernel is kept for
    # contiguous input and rejected for channels-last (> 4); 1e4: the compensated core
    x0 = make_input((6, 5, 4, 5), torch.float32, layout, seed=4, offset=offset)
    w, b = params(5, torch.float32, True)
    leaf = x0.clone().requires_grad_()
    z = batch_norm_act(leaf * 1, None, None, w, b, True, act="leaky_relu", memory=memory)
    x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
    ref = bn_act64(x64, w64, b64, "leaky_relu")
    assert float((z.double() - ref).abs().max().detach()) < 1e-5
    dz = torch.randn(z.shape, dtype=torch.float64)
    got = grads_of(z, [leaf, w, b], dz.float())
    check_grads(got, grads_of(ref, [x64, w64, b64], dz), torch.float32, ["dx", "dw", "db"])


@pytest.mark.parametrize("backend", ["auto", "eager", "reference"])
def test_batch_norm_act_backends_agree(backend):
    x = make_input((4, 3, 5, 5), torch.float64, "contiguous", seed=5).requires_grad_()
    w, b = params(3, torch.float64, True)
    z = batch_norm_act(x, None, None, w, b, True, act="elu", backend=backend)
    ref = bn_act64(x, w, b, "elu")
    assert_close(z, ref, torch.float64)
    dz = torch.randn_like(ref)
    check_grads(grads_of(z, [x, w, b], dz), grads_of(ref, [x, w, b], dz), torch.float64,
                ["dx", "dw", "db"])


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memory", ["standard", "inplace"])
def test_batch_norm_act_module_matches_torch_train_and_eval(momentum, layout, memory):
    x = make_input((8, 4, 5, 6), torch.float32, layout, seed=6, offset=0.3)
    ours = BatchNormAct2d(4, momentum=momentum, act="leaky_relu", memory=memory)
    plain = nn.BatchNorm2d(4, momentum=momentum)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ours.bias.normal_()
    plain.load_state_dict(ours.state_dict())
    for step in range(3):
        z = ours(x * (step + 1))
        ref = TF.leaky_relu(plain(x * (step + 1)), 0.01)
        assert_close(z, ref, torch.float32, f"train step {step}")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(plain, name), rtol=1e-5,
                                   atol=1e-6, msg=name)
    ours.eval()
    plain.eval()
    assert_close(ours(x), TF.leaky_relu(plain(x), 0.01), torch.float32, "eval")


@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_norm_act_running_statistics(unbiased, layout):
    x = make_input((6, 3, 4, 5), torch.float64, layout, seed=7, scale=3.0, offset=1.0)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    batch_norm_act(x, rm, rv, training=True, momentum=0.2, unbiased_running_var=unbiased)
    dims = (0, 2, 3)
    var = x.var(dims, correction=1 if unbiased else 0)
    torch.testing.assert_close(rm, 0.2 * x.mean(dims))
    torch.testing.assert_close(rv, 0.8 + 0.2 * var)


@pytest.mark.parametrize("offset", [8.0, 1e4], ids=["ratio-8", "offset-1e4"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memory", ["standard", "inplace"])
def test_batch_norm_act_rejected_kernel_updates_running_statistics_once(offset, layout,
                                                                         memory):
    """With a gradient, small input runs torch's kernel with the running buffers (its
    fused BatchNorm, or its statistics kernel where the output overwrites the input),
    which updates them; when its statistics fail the accuracy bound the buffers are
    restored and the robust path updates them once, from accurate statistics."""
    x0 = make_input((6, 3, 4, 5), torch.float32, layout, seed=8, offset=offset)
    rm, rv = torch.full((3,), 0.5), torch.full((3,), 2.0)
    leaf = x0.clone().requires_grad_()
    z = batch_norm_act(leaf * 1, rm, rv, training=True, momentum=0.2, act="leaky_relu",
                       memory=memory)
    x64 = x0.double()
    dims = (0, 2, 3)
    torch.testing.assert_close(rm.double(), 0.8 * 0.5 + 0.2 * x64.mean(dims),
                               rtol=1e-6, atol=0.0)
    torch.testing.assert_close(rv.double(), 0.8 * 2.0 + 0.2 * x64.var(dims, correction=1),
                               rtol=1e-5, atol=0.0)
    ref = bn_act64(x64, None, None, "leaky_relu")
    assert float((z.double() - ref).abs().max().detach()) < 1e-5


@pytest.mark.parametrize("cls, shape", [(BatchNormAct1d, (7, 4)), (BatchNormAct1d, (5, 4, 6)),
                                        (BatchNormAct3d, (3, 4, 2, 3, 5))],
                         ids=["1d-2D", "1d-3D", "3d"])
@pytest.mark.parametrize("memory", ["standard", "inplace"])
def test_batch_norm_act_1d_and_3d(cls, shape, memory):
    x = make_input(shape, torch.float64, "contiguous", seed=8).requires_grad_()
    bn = cls(4, act="elu", memory=memory).double()
    z = bn(x)
    ref = bn_act64(x, bn.weight, bn.bias, "elu")
    assert_close(z, ref, torch.float64)
    dz = torch.randn_like(ref)
    params_ = [x, bn.weight, bn.bias]
    check_grads(grads_of(z, params_, dz), grads_of(ref, params_, dz), torch.float64,
                ["dx", "dw", "db"])


def test_batch_norm_act_rank_and_channel_errors():
    with pytest.raises(ValueError, match=r"BatchNormAct2d expected 4D input .* got a 3D"):
        BatchNormAct2d(4)(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match=r"BatchNormAct2d expected input of shape \(N, 4, \*\)"):
        BatchNormAct2d(4)(torch.randn(2, 3, 5, 5))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        BatchNormAct1d(4)(torch.randn(1, 4))
    with pytest.raises(ValueError, match="floating-point"):
        BatchNormAct2d(4)(torch.ones(2, 4, 3, 3, dtype=torch.long))
    empty = BatchNormAct2d(4, memory="inplace", act="identity")(torch.randn(0, 4, 3, 3))
    assert empty.shape == (0, 4, 3, 3)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 5), c=st.integers(1, 4), h=st.integers(1, 6), w=st.integers(1, 6),
       offset=st.sampled_from([0.0, 3.0, 50.0, 1e4]), layout=st.sampled_from(LAYOUTS),
       act=st.sampled_from(INVERTIBLE_ACTIVATIONS))
def test_property_every_statistics_path_matches_float64(n, c, h, w, offset, layout, act):
    """Random shapes (rows shorter and longer than 16, one position per row) and offsets
    (each fast path, its rejection, the compensated core); both memory modes."""
    x0 = make_input((n, c, h, w), torch.float32, layout, seed=n * 31 + c * 7 + h + w,
                    offset=offset)
    weight, bias = params(c, torch.float32, True, seed=c)
    x64, w64, b64 = leaf64(x0), leaf64(weight), leaf64(bias)
    ref = bn_act64(x64, w64, b64, act)
    dz = torch.randn(ref.shape, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    expected = grads_of(ref, [x64, w64, b64], dz)
    for memory in ("standard", "inplace"):
        leaf = x0.clone().requires_grad_()
        z = batch_norm_act(leaf * 1, None, None, weight, bias, True, act=act, memory=memory)
        assert_close(z, ref, torch.float32, memory)
        check_grads(grads_of(z, [leaf, weight, bias], dz.float()), expected, torch.float32,
                    ["dx", "dw", "db"])
    groups = 1 if c % 2 else 2
    if c // groups * h * w > 1:  # (one value per group raises, as in torch)
        zg = group_norm_act(x0, groups, weight.detach(), bias.detach(), act=act)
        assert_close(zg, gn_act64(x64.detach(), groups, w64.detach(), b64.detach(), act),
                     torch.float32, "group_norm_act")


# --------------------------------------------------------------------------- In-Place ABN


def test_inplace_overwrites_an_intermediate_input_and_spares_leaves():
    leaf = torch.randn(4, 3, 5, 5, requires_grad=True)
    x = leaf * 2
    z = batch_norm_act(x, None, None, training=True, act="leaky_relu", memory="inplace")
    assert z.data_ptr() == x.data_ptr() and z._version > 0
    before = leaf.detach().clone()
    z2 = batch_norm_act(leaf, None, None, training=True, act="leaky_relu", memory="inplace")
    assert z2.data_ptr() != leaf.data_ptr() and torch.equal(leaf.detach(), before)
    with torch.no_grad():  # nothing to save: the input is left alone
        y = torch.randn(4, 3, 5, 5)
        kept = y.clone()
        batch_norm_act(y, None, None, training=True, act="identity", memory="inplace")
        assert torch.equal(y, kept)


def test_inplace_overwrite_of_a_saved_tensor_is_caught_by_autograd():
    a = torch.randn(4, 3, 5, 5, requires_grad=True)
    x = torch.exp(a)  # exp saves its output for backward
    z = batch_norm_act(x, None, None, training=True, act="identity", memory="inplace")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_inplace_refuses_double_backward():
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    z = batch_norm_act(x, None, None, training=True, act="elu", memory="inplace")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(z.square().sum(), x, create_graph=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inplace_unrecoverable_channels_keep_their_input(dtype):
    # gamma = 0 (zero-init residual), |beta/gamma| > 64, a subnormal gamma, a negative one
    w = torch.tensor([1.0, 0.0, 1e-3, -0.5, 1e-40, 2.0], dtype=dtype, requires_grad=True)
    b = torch.tensor([0.0, 1.0, 1.0, -0.3, 0.0, -5.0], dtype=dtype, requires_grad=True)
    x0 = make_input((4, 6, 5, 5), dtype, "contiguous", seed=9, scale=3.0, offset=2.0)
    leaf = x0.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        z = batch_norm_act(leaf * 1, None, None, w, b, True, act="leaky_relu",
                           negative_slope=0.1, memory="inplace")
    kept = [t for t in saved if t.dim() == 4 and t.shape[1] != 6]
    # channels 1 and 2, and 4 where 1e-40 is subnormal (float32, not float64)
    assert [t.shape[1] for t in kept] == [3 if dtype == torch.float32 else 2]
    x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
    ref = bn_act64(x64, w64, b64, "leaky_relu", negative_slope=0.1)
    assert_close(z, ref, dtype)
    dz = torch.randn(z.shape, dtype=torch.float64)
    check_grads(grads_of(z, [leaf, w, b], dz.to(dtype)), grads_of(ref, [x64, w64, b64], dz),
                dtype, ["dx", "dw", "db"])


@pytest.mark.parametrize("act", ["identity", "leaky_relu", "elu"])
def test_inplace_over_few_values_per_channel_holds_the_gradient_tolerance(act):
    """Over two values per channel the gradient is what ``eps`` leaves of cancelling
    terms; ``xhat`` recovered from the stored output lacked the digits (these draws: up to
    1.2e-4 off, the float32 tolerance 5e-5). Such calls now run as the standard memory mode,
    in float64 there, and still overwrite nothing they should not."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(100):
        x0 = (torch.randn(2, 4, 1, 1, generator=gen, dtype=torch.float64) * 0.3).float()
        w = (1 + 0.5 * torch.randn(4, generator=gen)).requires_grad_()
        b = (2 * torch.randn(4, generator=gen)).requires_grad_()  # (|beta/gamma| within 64)
        leaf = x0.clone().requires_grad_()
        z = batch_norm_act(leaf, None, None, w, b, True, act=act, memory="inplace")
        assert torch.equal(leaf.detach(), x0)
        x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
        ref = bn_act64(x64, w64, b64, act)
        dz = torch.randn(z.shape, generator=gen)
        check_grads(grads_of(z, [leaf, w, b], dz),
                    grads_of(ref, [x64, w64, b64], dz.double()), torch.float32,
                    ["dx", "dw", "db"])


def test_unrecoverable_channels_rule():
    """A channel's normalized input is recoverable from the output when ``|gamma| >=
    max(|beta| / ratio, tiny)`` (ratio 64 in float32); zero, subnormal, NaN and too
    small gammas are not."""
    from normkit.norms.fused import _unrecoverable_channels

    x = torch.zeros(2, 6, 3)
    w = torch.tensor([1.0, 0.0, 1e-40, float("nan"), 0.5, -0.5])
    b = torch.tensor([0.0, 0.0, 0.0, 0.0, 31.0, -33.0])  # 31/64 < 0.5 < 33/64
    assert _unrecoverable_channels(None, None, x) is None
    assert _unrecoverable_channels(w, b, x).tolist() == [1, 2, 3, 5]
    assert _unrecoverable_channels(w, None, x).tolist() == [1, 2, 3]
    assert _unrecoverable_channels(None, b, x) is None  # gamma 1 >= 33/64
    assert _unrecoverable_channels(None, b * 3, x).tolist() == [4, 5]
    assert _unrecoverable_channels(torch.ones(6), b, x) is None


@pytest.mark.parametrize("memory", ["standard", "inplace"])
@pytest.mark.parametrize("act", ["relu", "leaky_relu", "silu"])
def test_training_without_a_gradient_runs_the_norm_then_the_activation(memory, act,
                                                                       monkeypatch):
    """Training mode under no_grad (statistics recalibration, e.g. SWA's update_bn):
    no autograd node to save for, so BatchNorm's path then the activation in place; the
    output and the running statistics equal the fused node's. In-Place ABN still
    overwrites an intermediate input that requires grad, as documented."""
    from normkit.norms import fused

    if memory == "inplace" and act != "leaky_relu":
        pytest.skip("In-Place ABN needs an invertible activation")
    calls = []
    node = fused._BatchNormActFunction.apply
    monkeypatch.setattr(fused._BatchNormActFunction, "apply",
                        lambda *a: calls.append(1) or node(*a))
    monkeypatch.setattr(fused, "FUSED_ACT_MIN_ELEMENTS", 0)
    x = make_input((4, 6, 5, 5), torch.float32, "contiguous", seed=11, scale=2.0, offset=0.5)
    w, b = torch.rand(6) + 0.5, torch.randn(6)
    rm, rv = torch.zeros(6), torch.ones(6)
    with torch.no_grad():
        z = batch_norm_act(x, rm, rv, w, b, True, act=act, memory=memory)
    assert not calls
    rm2, rv2 = torch.zeros(6), torch.ones(6)
    z2 = batch_norm_act(x.clone().requires_grad_(), rm2, rv2, w, b, True, act=act,
                        memory=memory)  # the node
    assert calls
    torch.testing.assert_close(z, z2.detach())
    torch.testing.assert_close((rm, rv), (rm2, rv2))
    if memory == "inplace":
        calls.clear()
        inner = x.clone().requires_grad_() * 1
        with torch.no_grad():
            out = batch_norm_act(inner, None, None, w, b, True, act=act, memory=memory)
        assert calls and out.data_ptr() == inner.data_ptr()


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_2d_rows_past_torchs_count_take_the_engine_through_a_view(act, monkeypatch):
    """BatchNormAct1d (memory="standard") on 2D input with more rows than torch's kernel
    sums accurately: the fused node on the rows' channels-last view (the engine's row-sums
    path; its backward kernel gets the activation's gradient, whose size-1 stride differs
    from the view's), equal to float64 BatchNorm then the activation, output 2D and
    contiguous, running statistics updated."""
    from normkit.kernels import channels, native

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0)  # (a small input stands in)
    seen = []
    moments = channels.moments
    monkeypatch.setattr(channels, "moments", lambda x, *a: seen.append(x.shape) or
                        moments(x, *a))
    n = native.CHANNELS_LAST_MAX_COUNT + 64
    x0 = make_input((n, 6), torch.float32, "contiguous", seed=12, scale=2.0, offset=1.0)
    weight, bias = torch.rand(6) + 0.5, torch.randn(6)
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    x = x0.clone().requires_grad_()
    rm, rv = torch.zeros(6), torch.ones(6)
    z = batch_norm_act(x, rm, rv, w, b, True, act=act)
    assert seen == [torch.Size([1, 6, n, 1])] and z.shape == (n, 6) and z.is_contiguous()
    assert "BatchNormAct" in type(z._base.grad_fn).__name__  # the fused node, on the view
    x64, w64, b64 = leaf64(x0), leaf64(weight), leaf64(bias)
    ref = bn_act64(x64, w64, b64, act)
    assert_close(z, ref, torch.float32)
    dz = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    check_grads(grads_of(z, [x, w, b], dz.float()), grads_of(ref, [x64, w64, b64], dz),
                torch.float32, ["dx", "dw", "db"])
    torch.testing.assert_close(rm.double(), 0.1 * x0.double().mean(0), rtol=1e-5, atol=1e-6)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (deterministic)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def conv_bn_act_stack(memory: str, blocks: int = 6, channels: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                   BatchNormAct2d(channels, act="leaky_relu", memory=memory)]
    return nn.Sequential(*layers)


def test_inplace_abn_saves_at_most_0_6_of_the_standard_memory():
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(18))
    standard, inplace = conv_bn_act_stack("standard"), conv_bn_act_stack("inplace")
    inplace.load_state_dict(standard.state_dict())
    bytes_std, out_std = saved_bytes(lambda: standard(x))
    bytes_inp, out_inp = saved_bytes(lambda: inplace(x))
    # per block: conv output + BN output (standard) vs one shared buffer (in place)
    assert bytes_inp <= 0.6 * bytes_std, (bytes_inp, bytes_std)
    reference = conv_bn_act_stack("standard").double()
    reference.load_state_dict(standard.state_dict())
    out64 = reference(x.double())
    for out in (out_std, out_inp):
        assert_close(out, out64, torch.float32)
        out.square().sum().backward()
    out64.square().sum().backward()
    for (name, p64), p_std, p_inp in zip(reference.named_parameters(), standard.parameters(),
                                         inplace.parameters(), strict=True):
        assert_grad_close(p_std.grad, p64.grad, torch.float32, f"standard {name}")
        assert_grad_close(p_inp.grad, p64.grad, torch.float32, f"inplace {name}")


# --------------------------------------------------------------------------- GroupNorm + act


@pytest.mark.parametrize("engine", [False, True], ids=["torch-bwd", "slice-bwd"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_group_norm_act_matches_reference(dtype, layout, act, affine, engine, monkeypatch):
    # channels-last: torch's backward kernel below GROUP_NORM_MIN_POSITIONS positions,
    # normkit's slice-sums backward from there up (both compared with the reference)
    from normkit.kernels import channels

    if engine:
        if layout != "channels_last":
            pytest.skip("the slice-sums backward serves channels-last input")
        monkeypatch.setattr(channels, "GROUP_NORM_MIN_POSITIONS", 0)
    x0 = make_input((3, 6, 4, 5), dtype, layout, seed=10, scale=2.0, offset=0.5)
    w, b = params(6, dtype, affine)
    x = x0.clone().requires_grad_()
    z = group_norm_act(x, 3, w, b, act=act)
    assert z.dtype == dtype and memory_format_of(z) == memory_format_of(x0)
    x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
    ref = gn_act64(x64, 3, w64, b64, act)
    assert_close(z, ref, dtype)
    dz = torch.randn(z.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    check_grads(grads_of(z, [x, w, b], dz.to(dtype)), grads_of(ref, [x64, w64, b64], dz),
                dtype, ["dx", "dw", "db"])


@pytest.mark.parametrize("offset", [0.5, 1e4], ids=["kernel", "offset-1e4"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_group_norm_act_inference_builds_no_node(dtype, layout, act, offset, monkeypatch):
    """Without a gradient (inference, or parameters that need none) GroupNormAct runs no
    autograd node and activates its fresh output in place: the reference's values, the
    input's layout and dtype, the input untouched."""
    from normkit.kernels import channels

    monkeypatch.setattr(channels, "GROUP_NORM_MIN_POSITIONS", 0)  # the engine at 4x5 too
    x0 = make_input((3, 6, 4, 5), dtype, layout, seed=12, scale=2.0, offset=offset)
    w, b = params(6, dtype, True)
    before = x0.clone()
    with torch.no_grad():
        z = group_norm_act(x0, 3, w, b, act=act)
    z2 = group_norm_act(x0, 3, w.detach(), b.detach(), act=act)  # nothing needs a gradient
    assert z.grad_fn is None and z2.grad_fn is None
    assert z.dtype == dtype and memory_format_of(z) == memory_format_of(x0)
    assert torch.equal(x0, before)
    ref = gn_act64(leaf64(x0), 3, leaf64(w), leaf64(b), act).detach()
    for out in (z, z2):
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("offset", [8.0, 1e4], ids=["ratio-8", "offset-1e4"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_norm_act_keeps_precision_at_an_offset(offset, layout):
    x0 = make_input((3, 6, 4, 5), torch.float32, layout, seed=11, offset=offset)
    w, b = params(6, torch.float32, True)
    x = x0.clone().requires_grad_()
    z = group_norm_act(x, 2, w, b, act="silu")
    x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
    ref = gn_act64(x64, 2, w64, b64, "silu")
    assert float((z.double() - ref).abs().max().detach()) < 1e-5
    dz = torch.randn(z.shape, dtype=torch.float64)
    check_grads(grads_of(z, [x, w, b], dz.float()), grads_of(ref, [x64, w64, b64], dz),
                torch.float32, ["dx", "dw", "db"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_norm_act_with_broadcast_gradient_and_3d_input(layout):
    x = make_input((2, 4, 3, 4, 5), torch.float64, layout, seed=12).requires_grad_()
    gn = GroupNormAct(2, 4, act="relu").double()
    z = gn(x)
    ref = gn_act64(x, 2, gn.weight, gn.bias, "relu")
    assert_close(z, ref, torch.float64)
    got = torch.autograd.grad(z.sum(), [x, gn.weight, gn.bias])  # an expanded gradient
    expected = torch.autograd.grad(ref.sum(), [x, gn.weight, gn.bias])
    check_grads(got, expected, torch.float64, ["dx", "dw", "db"])


@pytest.fixture
def gn_act_blocks(monkeypatch):
    """GroupNormAct's blocked path (``fused._group_norm_act_blocks``) at any size, as if
    every output's memory were fresh; yields the list of the blocked forwards that served
    (their outputs)."""
    from normkit.norms import fused as fused_mod

    monkeypatch.setattr(fused_mod, "fresh_out_like", lambda x: torch.empty_like(x))
    served, blocks = [], fused_mod._group_norm_act_blocks

    def spy(*args, **kwargs):
        out = blocks(*args, **kwargs)
        if out is not None:
            served.append(out[0])
        return out

    monkeypatch.setattr(fused_mod, "_group_norm_act_blocks", spy)
    return served


@pytest.mark.parametrize("block_bytes", [1, 2 * 6 * 4 * 5 * 4, 1 << 30],
                         ids=["one-sample", "two-samples", "whole"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_group_norm_act_blocks_match_torch_and_float64(act, affine, block_bytes,
                                                       gn_act_blocks, monkeypatch):
    """torch's GroupNorm kernels block by block of samples, each block activated and
    differentiated while in cache (blocks of one sample, of two and a short last one,
    one block): the pre-activation is the bits of torch's GroupNorm over the whole
    tensor; the output and gradients match torch's GroupNorm then activation to float32
    rounding (an elementwise kernel may round a block's last values in its scalar tail,
    and normkit differentiates ELU from its output) and float64, and inference gives the
    same output."""
    from normkit.kernels import native

    monkeypatch.setattr(native, "LAYER_NORM_BLOCK_BYTES", block_bytes)
    x0 = make_input((5, 6, 4, 5), torch.float32, "contiguous", seed=13, scale=2.0,
                    offset=0.5)
    w, b = params(6, torch.float32, affine)
    x = x0.clone().requires_grad_()
    z = group_norm_act(x, 3, w, b, act=act)
    assert len(gn_act_blocks) == 1 and gn_act_blocks[0] is z
    wt, bt = (None, None) if not affine else (leaf64(w).float(), leaf64(b).float())
    if not make_activation(act).from_output:  # (the pre-activation, kept for backward)
        kept = z.grad_fn.saved_tensors[2]
        assert torch.equal(kept, TF.group_norm(x0, 3, wt, bt))
    dz = torch.randn(z.shape, generator=torch.Generator().manual_seed(3))
    got = grads_of(z, [x, w, b], dz)
    xt = x0.clone().requires_grad_()
    zt = make_activation(act)(TF.group_norm(xt, 3, wt, bt))
    want = grads_of(zt, [xt, wt, bt], dz)
    assert_close(z, zt, torch.float32)
    check_grads(got, want, torch.float32, ["dx", "dw", "db"])
    x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
    ref = gn_act64(x64, 3, w64, b64, act)
    assert_close(z, ref, torch.float32)
    check_grads(got, grads_of(ref, [x64, w64, b64], dz.double()), torch.float32,
                ["dx", "dw", "db"])
    with torch.no_grad():
        assert torch.equal(group_norm_act(x0, 3, w, b, act=act), z)
    assert len(gn_act_blocks) == 2


def test_group_norm_act_blocks_fall_back_where_torch_is_inaccurate(gn_act_blocks):
    """At 1e4 std of offset torch's GroupNorm kernel is off: the blocked path declines and
    the compensated core serves, forward and backward."""
    x0 = make_input((5, 6, 4, 5), torch.float32, "contiguous", seed=14, offset=1e4)
    w, b = params(6, torch.float32, True)
    x = x0.clone().requires_grad_()
    z = group_norm_act(x, 3, w, b, act="silu")
    assert not gn_act_blocks
    x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
    ref = gn_act64(x64, 3, w64, b64, "silu")
    assert_close(z, ref, torch.float32)
    dz = torch.randn(z.shape, dtype=torch.float64)
    check_grads(grads_of(z, [x, w, b], dz.float()), grads_of(ref, [x64, w64, b64], dz),
                torch.float32, ["dx", "dw", "db"])


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_group_norm_act_blocks_gradcheck(act, gn_act_blocks, monkeypatch):
    """float64 through the blocked path, first and second derivatives."""
    from normkit.kernels import native

    monkeypatch.setattr(native, "LAYER_NORM_BLOCK_BYTES", 1)  # a block per sample
    x = make_input((3, 4, 2, 3), torch.float64, "contiguous", seed=18,
                   offset=0.3).requires_grad_()
    w, b = _f64(4, seed=1), _f64(4, seed=2)
    fn = lambda x, w, b: group_norm_act(x, 2, w, b, act=act)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))
    assert gn_act_blocks


def test_group_norm_act_errors():
    with pytest.raises(ValueError, match=r"GroupNormAct expected input of shape \(N, 6, \*\)"):
        GroupNormAct(3, 6)(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="divisible by num_groups=4"):
        group_norm_act(torch.randn(2, 6, 5), 4)
    with pytest.raises(ValueError, match="more than 1 value per group"):
        group_norm_act(torch.randn(1, 6, 1), 6)


# --------------------------------------------------------------------------- residual + norm


def add_norm64(kind, x, residual, shape, weight, bias, eps):
    s = x if residual is None else x + residual
    dims = tuple(range(s.dim() - len(shape), s.dim()))
    return normalize64(s, dims, weight, bias, eps, center=kind == "layer"), s


@pytest.mark.parametrize("residual_in_fp32", [False, True], ids=["same-dtype", "fp32-res"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_add_norm_matches_reference(dtype, kind, affine, with_residual, residual_in_fp32):
    shape = (3, 8)
    gen = torch.Generator().manual_seed(13)
    x0 = (torch.randn(4, 5, *shape, generator=gen, dtype=torch.float64) * 2).to(dtype)
    r0 = torch.randn(4, 5, *shape, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    b = (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    w, b = (w.requires_grad_(), b.requires_grad_()) if affine else (None, None)
    x = x0.clone().requires_grad_()
    r = r0.clone().requires_grad_() if with_residual else None
    if kind == "layer":
        normed, s = add_layer_norm(x, r, shape, w, b, residual_in_fp32=residual_in_fp32)
        eps = 1e-5
    else:
        normed, s = add_rms_norm(x, r, shape, w, residual_in_fp32=residual_in_fp32)
        b = None
        eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    res_dtype = torch.float32 if residual_in_fp32 and dtype != torch.float64 else dtype
    assert normed.dtype == dtype and s.dtype == res_dtype
    # the sum is rounded to its dtype exactly as torch's add does; normalize *that* sum
    torch.testing.assert_close(s, (x0.to(res_dtype) + r0.to(res_dtype)) if with_residual
                               else x0.to(res_dtype), rtol=0, atol=0)
    x64, r64, w64, b64 = leaf64(x0), leaf64(r0) if with_residual else None, leaf64(w), leaf64(b)
    ref, s64 = add_norm64(kind, x64, r64, shape, w64, b64, eps)
    rounding = (s.detach().double() - s64).detach()  # the new residual's own rounding
    ref, s64 = add_norm64(kind, x64 + rounding, r64, shape, w64, b64, eps)
    assert_close(normed, ref, dtype)
    gen2 = torch.Generator().manual_seed(14)
    dn = torch.randn(normed.shape, generator=gen2, dtype=torch.float64)
    ds = torch.randn(s.shape, generator=gen2, dtype=torch.float64)
    got = torch.autograd.grad([normed, s], [t for t in (x, r, w, b) if t is not None],
                              [dn.to(normed.dtype), ds.to(s.dtype)])
    expected = torch.autograd.grad([ref, s64], [t for t in (x64, r64, w64, b64) if t is not None],
                                   [dn, ds])
    names = [n for n, t in zip("x r w b".split(), (x, r, w, b), strict=True) if t is not None]
    for g, e, name in zip(got, expected, names, strict=True):
        tol_dtype = dtype if name in "xr" else (w.dtype if w is not None else dtype)
        assert_grad_close(g, e, tol_dtype, f"d{name}")


@pytest.mark.parametrize("with_residual", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rms_forward_in_blocks_equals_the_whole_tensor_passes(dtype, affine, with_residual,
                                                              monkeypatch):
    """Large inputs run RMSNorm's forward block by block of rows (the blocks here a few
    rows, not dividing the row count): the output and the saved ``rstd`` are the same
    bits as the whole-tensor passes, and output and gradients equal float64."""
    from normkit.norms import fused

    gen = torch.Generator().manual_seed(21)
    x0 = (torch.randn(37, 50, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype)
    r0 = torch.randn(37, 50, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.rand(50, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if affine else None

    def run(block_bytes, floor):
        monkeypatch.setattr(fused, "RMS_CHUNK_BYTES", block_bytes)
        monkeypatch.setattr(fused, "RMS_CHUNK_MIN_BYTES", floor)
        calls = []
        real = fused._rms_in_chunks
        monkeypatch.setattr(fused, "_rms_in_chunks",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        x = x0.clone().requires_grad_()
        r = r0.clone().requires_grad_() if with_residual else None
        wl = None if w is None else w.clone().requires_grad_()
        normed, s = add_rms_norm(x, r, (50,), wl)
        assert (s is x) != with_residual  # (no residual: x passes on, never copied)
        rstd = normed.grad_fn.saved_tensors[4]  # (s, weight, bias, mean, rstd)
        dn = torch.randn(normed.shape, generator=torch.Generator().manual_seed(3),
                         dtype=dtype)
        grads = torch.autograd.grad(normed, [t for t in (x, r, wl) if t is not None], dn)
        return normed.detach(), rstd, grads, bool(calls), s.detach()

    blocked = run(3 * 50 * dtype.itemsize, 0)  # blocks of 3 rows
    whole = run(3 * 50 * dtype.itemsize, 1 << 40)  # (the floor: the whole-tensor passes)
    assert blocked[3] and not whole[3]
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    assert torch.equal(blocked[4], whole[4])  # the residual sum, built block by block
    for a, b in zip(blocked[2], whole[2], strict=True):
        assert torch.equal(a, b)
    s64 = x0.double() + (r0.double() if with_residual else 0)
    eps = torch.finfo(dtype).eps
    ref = s64 * torch.rsqrt(s64.square().mean(-1, keepdim=True) + eps)
    ref = ref * w.double() if affine else ref
    assert_close(blocked[0], ref, dtype)


@pytest.mark.parametrize("offset", [1e4, 1e5])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_add_norm_large_offset_within_1e_4_of_float64(kind, offset):
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(64, 256, generator=gen, dtype=torch.float64) + offset).float()
    r = torch.randn(64, 256, generator=gen, dtype=torch.float64).float()
    fn = add_layer_norm if kind == "layer" else add_rms_norm
    normed, s = fn(x, r, 256)
    eps = 1e-5 if kind == "layer" else torch.finfo(torch.float32).eps
    ref = normalize64(s.double(), (1,), None, None, eps, center=kind == "layer")
    assert float((normed.double() - ref).abs().max()) < 1e-4
    if kind == "layer":  # torch's own kernel on the same sum is far off (native.py's table)
        torch_err = (TF.layer_norm(s, (256,)).double() - ref).abs().max()
        assert float(torch_err) > 1e-3


def test_add_norm_residual_none_passes_x_through():
    x = torch.randn(3, 8)
    normed, res = add_layer_norm(x, None, 8)
    assert res is x
    torch.testing.assert_close(normed, TF.layer_norm(x, (8,)))
    normed, res = add_rms_norm(x, None, 8)
    assert torch.equal(res, x)
    torch.testing.assert_close(normed, TF.rms_norm(x, (8,)))
    bf = x.bfloat16()
    normed, res = add_layer_norm(bf, None, 8, residual_in_fp32=True)
    assert normed.dtype == torch.bfloat16 and res.dtype == torch.float32


@pytest.mark.parametrize("backend", ["auto", "eager", "reference"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_add_norm_backends_and_modules_agree(kind, backend):
    cls, torch_cls = (AddLayerNorm, nn.LayerNorm) if kind == "layer" else (AddRMSNorm,
                                                                           nn.RMSNorm)
    ours = cls(16, backend=backend).double()
    plain = torch_cls(16).double()
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    normed, s = ours(x, r)
    ref = plain(x + r)
    assert_close(normed, ref, torch.float64)
    dn = torch.randn_like(ref)
    ps = [x, r, *ours.parameters()]
    check_grads(torch.autograd.grad(normed, ps, dn),
                torch.autograd.grad(ref, [x, r, *plain.parameters()], dn), torch.float64,
                ["dx", "dr", "dw", "db"][:len(ps)])


def test_add_norm_only_one_output_used():
    x = torch.randn(4, 8, requires_grad=True)
    r = torch.randn(4, 8, requires_grad=True)
    normed, s = add_rms_norm(x, r, 8)
    (gx,) = torch.autograd.grad(s.sum(), x)  # normed unused
    torch.testing.assert_close(gx, torch.ones_like(x))
    normed, s = add_layer_norm(x, r, 8)
    gx, gr = torch.autograd.grad(normed.square().sum(), [x, r])  # new residual unused
    torch.testing.assert_close(gx, gr)


def test_add_norm_errors():
    with pytest.raises(ValueError, match=r"residual of the same shape as x \(2, 4\), got .*"
                                         r"\(2, 5\)"):
        add_layer_norm(torch.randn(2, 4), torch.randn(2, 5), 4)
    with pytest.raises(ValueError, match=r"add_rms_norm expected input of shape \(\*, 5\)"):
        add_rms_norm(torch.randn(2, 4), None, 5)
    with pytest.raises(ValueError, match="floating-point"):
        add_layer_norm(torch.randn(2, 4), torch.ones(2, 4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"weight of shape \(4,\)"):
        add_layer_norm(torch.randn(2, 4), None, 4, torch.ones(3))


# --------------------------------------------------------------------------- gradcheck


def _f64(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)


# (2, 2, 4, 4): 16 positions per row, so contiguous input takes the row-statistics path
@pytest.mark.parametrize("act, memory", [(a, "standard") for a in ACTIVATIONS]
                         + [(a, "inplace") for a in INVERTIBLE_ACTIVATIONS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_batch_norm_act(act, memory, layout):
    x = make_input((2, 2, 4, 4), torch.float64, layout, seed=16, offset=0.3).requires_grad_()
    w = (_f64(2, seed=1).detach() * 0.2 + 1).requires_grad_()
    b = _f64(2, seed=2)

    def fn(x, w, b):
        return batch_norm_act(x, None, None, w, b, True, act=act, memory=memory)

    assert torch.autograd.gradcheck(fn, (x, w, b))


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_group_norm_act(act, layout):
    x = make_input((2, 4, 2, 3), torch.float64, layout, seed=17, offset=0.3).requires_grad_()
    w, b = _f64(4, seed=1), _f64(4, seed=2)
    assert torch.autograd.gradcheck(lambda x, w, b: group_norm_act(x, 2, w, b, act=act),
                                    (x, w, b))


@pytest.mark.parametrize("act", ["leaky_relu", "silu"])
def test_gradgradcheck_norm_act(act):
    """Double backward differentiates the reference (one activation of each kind)."""
    x = make_input((2, 4, 2, 3), torch.float64, "channels_last", seed=19).requires_grad_()
    w, b = _f64(4, seed=1), _f64(4, seed=2)
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: batch_norm_act(x, None, None, w, b, True, act=act), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x, w, b: group_norm_act(x, 2, w, b, act=act),
                                        (x, w, b))


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gradcheck_add_norm(kind, with_residual):
    x = _f64(3, 6, seed=3)
    r = _f64(3, 6, seed=4) if with_residual else None
    w, b = _f64(6, seed=5), _f64(6, seed=6)

    def fn(x, r, w, b):
        if kind == "layer":
            return add_layer_norm(x, r, 6, w, b, residual_in_fp32=True)
        return add_rms_norm(x, r, 6, w, residual_in_fp32=True)

    assert torch.autograd.gradcheck(fn, (x, r, w, b))
    if with_residual:
        assert torch.autograd.gradgradcheck(fn, (x, r, w, b))


# --------------------------------------------------------------------------- drop-in


@pytest.mark.parametrize("cls, torch_cls, args", [
    (BatchNormAct1d, nn.BatchNorm1d, (4,)), (BatchNormAct2d, nn.BatchNorm2d, (4,)),
    (BatchNormAct3d, nn.BatchNorm3d, (4,)), (GroupNormAct, nn.GroupNorm, (2, 4)),
    (AddLayerNorm, nn.LayerNorm, (4,)), (AddRMSNorm, nn.RMSNorm, (4,)),
])
def test_state_dict_interchange_with_torch(cls, torch_cls, args):
    ours, plain = cls(*args), torch_cls(*args)
    assert isinstance(ours, torch_cls)
    with torch.no_grad():
        for p in plain.parameters():
            p.uniform_(-1, 1)
        if isinstance(plain, nn.BatchNorm2d | nn.BatchNorm1d | nn.BatchNorm3d):
            plain.running_mean.uniform_(-1, 1)
            plain.num_batches_tracked.fill_(7)
    ours.load_state_dict(plain.state_dict())
    back = torch_cls(*args)
    back.load_state_dict(ours.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert ours.state_dict().keys() == plain.state_dict().keys()


def test_batch_norm_act2d_loads_a_trained_batchnorm_and_matches_it():
    plain = nn.BatchNorm2d(3)
    x = torch.randn(8, 3, 4, 4) * 2 + 1
    plain(x)
    ours = BatchNormAct2d(3, act="relu")
    ours.load_state_dict(plain.state_dict())
    ours.eval()
    plain.eval()
    assert_close(ours(x), torch.relu(plain(x)), torch.float32)
    assert "act='relu'" in repr(ours) and "memory" not in repr(ours)
    assert "memory='inplace'" in repr(BatchNormAct2d(3, act="elu", memory="inplace"))
    assert "act='silu'" in repr(GroupNormAct(1, 3, act="silu"))
    # (an activation's own parameter shows beside it: printed models tell slopes apart)
    for make in (lambda **k: BatchNormAct2d(3, **k), lambda **k: GroupNormAct(1, 3, **k)):
        assert repr(make(act="leaky_relu", negative_slope=0.2)).endswith(
            "act='leaky_relu', negative_slope=0.2)")
        assert repr(make(act="elu", alpha=0.5)).endswith("act='elu', alpha=0.5)")
        assert "alpha" not in repr(make(act="leaky_relu"))
    assert "residual_in_fp32=True" in repr(AddRMSNorm(3, residual_in_fp32=True))


def test_modules_trace_without_graph_breaks():
    """Under torch.compile ``backend="auto"`` takes the reference math (fullgraph works)."""
    cases = [(BatchNormAct2d(4, act="silu"), (torch.randn(2, 4, 5, 5),)),
             (BatchNormAct2d(4, act="elu", memory="inplace"), (torch.randn(2, 4, 5, 5),)),
             (GroupNormAct(2, 4), (torch.randn(2, 4, 5, 5),)),
             (AddLayerNorm(8), (torch.randn(3, 8), torch.randn(3, 8))),
             (AddRMSNorm(8), (torch.randn(3, 8), None))]
    for module, args in cases:
        eager = module(*args)
        compiled = torch.compile(module, backend="eager", fullgraph=True)(*args)
        for a, b in zip(torch.utils._pytree.tree_leaves(compiled),
                        torch.utils._pytree.tree_leaves(eager), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_engine_size_floor_for_batch_norm_act(monkeypatch):
    """Below the floor BatchNorm + act takes torch's kernels (faster there), above it
    the slice-sums engine, both equal to the reference."""
    from normkit.kernels import channels

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 1 << 18)
    for shape, engine in (((6, 5, 4, 5), False), ((64, 4, 32, 32), True)):
        x0 = make_input(shape, torch.float32, "contiguous", seed=3)
        w, b = params(shape[1], torch.float32, True)
        leaf = x0.clone().requires_grad_()
        z = batch_norm_act(leaf, None, None, w, b, True, act="relu")
        x64, w64, b64 = leaf64(x0), leaf64(w), leaf64(b)
        ref = bn_act64(x64, w64, b64, "relu")
        assert_close(z, ref, torch.float32)
        dz = torch.randn(z.shape, generator=torch.Generator().manual_seed(5),
                         dtype=torch.float64)
        check_grads(grads_of(z, [leaf, w, b], dz.float()), grads_of(ref, [x64, w64, b64], dz),
                    torch.float32, ["dx", "dw", "db"])
        assert channels.supports(x0) == engine


@pytest.mark.parametrize("layer", ["bn", "gn"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_small_inputs_take_the_norm_then_the_activation(layer, layout, monkeypatch):
    """Below FUSED_ACT_MIN_ELEMENTS a training call that needs a gradient runs the norm's
    own path and then the activation's autograd node (cheaper than the fused node there);
    from it, the fused node. Both give the fused node's output, gradients and running
    statistics."""
    import normkit.norms.fused as fused_mod

    monkeypatch.setattr(fused_mod, "FUSED_ACT_MIN_ELEMENTS", 1 << 18)  # the library's rule
    gen = torch.Generator().manual_seed(5)

    def build():
        torch.manual_seed(0)
        if layer == "bn":
            return BatchNormAct2d(8, act="silu")
        return GroupNormAct(4, 8, act="silu")

    for shape, small in (((2, 8, 6, 6), True), ((4, 8, 96, 96), False)):
        x = torch.randn(shape, generator=gen).add_(0.5)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        dy = torch.randn(shape, generator=gen)
        module, twin = build(), build()
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = module(xa)
        node = type(y.grad_fn).__name__
        assert ("ActFunction" not in node) == small, (shape, node)
        monkeypatch.setattr(fused_mod, "FUSED_ACT_MIN_ELEMENTS", 0)  # the fused node
        ref = twin(xb)
        monkeypatch.setattr(fused_mod, "FUSED_ACT_MIN_ELEMENTS", 1 << 18)
        assert "ActFunction" in type(ref.grad_fn).__name__
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(y, [xa, *module.parameters()], dy)
        grads_ref = torch.autograd.grad(ref, [xb, *twin.parameters()], dy)
        for got, want in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for got, want in zip(module.buffers(), twin.buffers(), strict=True):
            torch.testing.assert_close(got, want)



@pytest.mark.parametrize(("name", "kwargs"), [
    ("relu", {}), ("leaky_relu", {"negative_slope": 0.1}), ("elu", {"alpha": 1.0}),
    ("elu", {"alpha": 2.0}), ("silu", {}), ("gelu", {}), ("identity", {})])
def test_activation_as_taken_is_torchs_where_the_forward_agrees(name, kwargs):
    """``Activation.as_taken`` (the double backward's activation) has torch's value and
    first and second derivatives wherever the forward's side is the input's own --
    exact zeros too, where torch's ELU takes the negative side's first derivative and
    the positive side's second."""
    from normkit.norms.fused import make_activation

    act = make_activation(name, **kwargs)
    t = torch.tensor([0.0, -0.0, -1e-9, 1e-9, -1.5, 2.0], dtype=torch.float64,
                     requires_grad=True)
    z = act(t.detach())
    got = act.as_taken(t, z, t.detach())
    t2 = t.detach().requires_grad_()
    want = act(t2)
    if name == "elu" and TORCH_RELEASE < (2, 8):
        # (torch 2.4's ELU computes exp(x) - 1, 2.8's expm1: 3e-17 apart at -1e-9)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-7, atol=0.0)
    else:
        assert torch.equal(got.detach(), want.detach())
    for a, b in ((got, t), (want, t2)):
        (g,) = torch.autograd.grad(a, b, torch.ones_like(a), create_graph=True)
        h = (torch.autograd.grad(g.sum(), b)[0] if g.requires_grad else torch.zeros_like(b))
        a.first, a.second = g.detach(), h
    # (within rounding: alpha * exp(y) multiplies in another order than torch's kernel)
    torch.testing.assert_close(got.first, want.first, rtol=1e-14, atol=0.0)
    torch.testing.assert_close(got.second, want.second, rtol=1e-14, atol=0.0)



@pytest.mark.parametrize("path", ["rows", "blocks", "compensated"])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "add_layer_norm"])
@pytest.mark.parametrize("shape", [(37, 50), (3, 11, 2, 25)], ids=["2d", "4d"])
def test_fused_rows_output_can_be_changed_in_place(op, path, shape, monkeypatch):
    """Scaling or activating a norm's output in place (``y.mul_(g)``, ``y.relu_()``) is
    ordinary user code, and autograd refuses it on a custom Function's output that is a
    view: the fused rows node returned its ``(M, K)`` result viewed back to the input's
    shape (RMSNorm from 2^16 elements, add + RMSNorm, the compensated add + LayerNorm).
    Every output is now allocated in its final shape; gradients through the in-place
    change equal float64's."""
    from normkit.norms import fused

    if path == "compensated" and op != "add_layer_norm":
        pytest.skip("RMSNorm has no compensated path")
    k = shape[-1] if len(shape) == 2 else shape[-2] * shape[-1]
    normalized = shape[-1:] if len(shape) == 2 else shape[-2:]
    monkeypatch.setattr(fused, "RMS_CHUNK_BYTES", 3 * k * 4)
    monkeypatch.setattr(fused, "RMS_CHUNK_MIN_BYTES", 0 if path == "blocks" else 1 << 40)
    offset = 1e4 if path == "compensated" else 1.0
    gen = torch.Generator().manual_seed(5)
    # (on a 2^-8 grid: exact in float32 at the offset, and so is their sum)
    x64 = ((torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + offset) * 256).round()
    x64 = x64 / 256
    r64 = (torch.randn(shape, generator=gen, dtype=torch.float64) * 256).round() / 256
    w64 = torch.rand(normalized, generator=gen, dtype=torch.float64) + 0.5
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)

    def run(x, r, w):
        if op == "rms_norm":
            y = F.rms_norm(x, normalized, w)
        elif op == "add_rms_norm":
            y = add_rms_norm(x, r, normalized, w)[0]
        else:
            y = add_layer_norm(x, r, normalized, w)[0]
        return y

    leaves = [t.float().requires_grad_() for t in (x64, r64, w64)]
    y = run(*leaves)
    assert not y._is_view()
    y.mul_(2.0).relu_()  # in place, as user code does
    y.backward(dy.float())
    refs = [t.clone().requires_grad_() for t in (x64, r64, w64)]
    (run(*refs) * 2.0).relu().backward(dy)
    assert_close(y.detach(), (run(*[t.detach() for t in refs]) * 2.0).relu(), torch.float32)
    for got, want, name in zip(leaves, refs, ("input", "residual", "weight"), strict=True):
        if want.grad is not None:
            assert_grad_close(got.grad, want.grad, torch.float32, f"{op} {name} grad")


@pytest.mark.parametrize("shape", [(1, 2, 1024, 1024), (262144, 4)], ids=["nchw", "rows"])
def test_inplace_backward_with_long_sums_and_an_upstream_gradient_along_the_input(shape):
    """In-Place ABN's backward ran torch's BatchNorm backward kernel on the stored output,
    whose per-channel sums are added in sequence (lanes of a 1024 x 1024 slice; the 262144
    rows of a 2D input): with ``dy = x``, whose exact gradient is what ``eps`` leaves, it
    was 1.0e-4 and 1.2e-4 off (tolerance 5e-5). It now takes the slice-sums engine's
    choice, as the standard memory mode does (the rows through their channels-last view)."""
    c = shape[1]
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(0)) + 1.9
    layer = (BatchNormAct2d if len(shape) == 4 else BatchNormAct1d)(c, act="identity",
                                                                    memory="inplace")
    leaf = x0.clone().requires_grad_()
    (dx,) = torch.autograd.grad(layer(leaf), leaf, x0)
    x64 = x0.double().requires_grad_()
    ref = TF.batch_norm(x64, None, None, training=True, eps=1e-5)
    (want,) = torch.autograd.grad(ref, x64, x0.double())
    assert_grad_close(dx, want, torch.float32, "dx")


@pytest.mark.parametrize("act", ["identity", "silu"])
def test_group_norm_act_backward_over_long_slices(act):
    """torch's GroupNorm backward kernel (GroupNormAct's on NCHW) adds each channel's sums
    over its positions in vector lanes, each in sequence: over 1024 x 1024 positions with
    ``dy`` along the input its ``dx`` was 2e-4 off. Past GROUP_NORM_BACKWARD_MAX_LENGTH
    positions the slice-sums engine's sums in pieces serve."""
    x0 = torch.randn(1, 2, 1024, 1024, generator=torch.Generator().manual_seed(3)) + 1.9
    leaf = x0.clone().requires_grad_()
    (dx,) = torch.autograd.grad(GroupNormAct(2, 2, act=act)(leaf), leaf, x0)
    x64 = x0.double().requires_grad_()
    ref = TF.group_norm(x64, 2, eps=1e-5)
    ref = ref if act == "identity" else TF.silu(ref)
    (want,) = torch.autograd.grad(ref, x64, x0.double())
    assert_grad_close(dx, want, torch.float32, "dx")
