"""Weight normalization, data-dependent init and mean-only BatchNorm (Salimans & Kingma 2016).

weight_norm is checked against torch.nn.utils.parametrizations.weight_norm (forward,
gradients, checkpoints in both directions, old weight_g/weight_v checkpoints) and a
float64 reference; data_dependent_init_ by measuring the pre-activations afterwards;
MeanOnlyBatchNorm against a float64 reference written here.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.parametrizations import weight_norm as torch_weight_norm

from normkit.norms.mean_only import MeanOnlyBatchNorm1d, MeanOnlyBatchNorm2d
from normkit.weights import (
    WeightNorm,
    data_dependent_init_,
    reference_weight_norm,
    remove_weight_norm,
    weight_norm,
)

G_KEY, V_KEY = "parametrizations.weight.original0", "parametrizations.weight.original1"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial parameters (positive g far from ||v||, so g and v both matter)."""
    gen = _gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("original0"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


def _out(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = module(x)
    return y[0] if isinstance(y, tuple) else y  # RNNs return (output, state)


def _state_roundtrip(module: nn.Module) -> dict:
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# (id, module factory, input shape, parameter name, dim)
TORCH_CASES = [
    ("Linear", lambda: nn.Linear(7, 5), (4, 7), "weight", 0),
    ("Linear-dim1", lambda: nn.Linear(7, 5), (4, 7), "weight", 1),
    ("Linear-dimNone", lambda: nn.Linear(7, 5), (4, 7), "weight", None),
    ("Conv1d", lambda: nn.Conv1d(3, 5, 3), (2, 3, 9), "weight", 0),
    ("Conv2d-groups", lambda: nn.Conv2d(4, 6, 3, groups=2), (2, 4, 6, 5), "weight", 0),
    ("Conv2d-dim-2", lambda: nn.Conv2d(3, 5, 3), (2, 3, 6, 5), "weight", -2),
    ("Conv3d", lambda: nn.Conv3d(2, 4, 3), (2, 2, 5, 4, 5), "weight", 0),
    ("ConvTranspose2d-dim0", lambda: nn.ConvTranspose2d(3, 5, 3), (2, 3, 4, 5), "weight", 0),
    ("ConvTranspose2d-dim1", lambda: nn.ConvTranspose2d(3, 5, 3), (2, 3, 4, 5), "weight", 1),
    ("LSTM-weight_hh_l0", lambda: nn.LSTM(3, 6), (5, 2, 3), "weight_hh_l0", 0),
    ("LSTM2-weight_ih_l1", lambda: nn.LSTM(3, 6, num_layers=2, batch_first=True), (2, 5, 3),
     "weight_ih_l1", 0),
]


def _twins(make, name, dim, dtype, torch_dim=None):
    base = make().to(dtype)
    ours = weight_norm(copy.deepcopy(base), name, dim)
    theirs = torch_weight_norm(copy.deepcopy(base), name, dim if torch_dim is None else torch_dim)
    _randomize_(ours)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _compare_forward_and_grads(ours, theirs, shape, dtype, atol, rtol):
    x = torch.randn(shape, generator=_gen(1), dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = _out(ours, xa), _out(theirs, xb)
    torch.testing.assert_close(ya, yb, atol=atol, rtol=rtol)
    dy = torch.randn(ya.shape, generator=_gen(2), dtype=dtype)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, atol=atol, rtol=rtol)
    grads_b = {n: p.grad for n, p in theirs.named_parameters()}
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads_b[n], atol=atol, rtol=rtol, msg=n)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_matches_torch_weight_norm_forward_and_grads(case, dtype):
    _, make, shape, name, dim = case
    ours, theirs = _twins(make, name, dim, dtype)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        assert ours.state_dict()[key].shape == value.shape, key
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-6)
    _compare_forward_and_grads(ours, theirs, shape, dtype, **tol)


def test_negative_dims_follow_torch():
    # torch's weight_norm reads dim=-1 as the whole tensor (it stores None as -1)
    ours, theirs = _twins(lambda: nn.Conv2d(3, 5, 3), "weight", -1, torch.float64)
    assert ours.parametrizations.weight.original0.shape == ()
    _compare_forward_and_grads(ours, theirs, (2, 3, 6, 5), torch.float64, atol=1e-12, rtol=1e-12)
    ours, theirs = _twins(lambda: nn.Conv2d(3, 5, 3), "weight", -2, torch.float64)
    assert ours.parametrizations.weight.original0.shape == (1, 1, 3, 1)
    _compare_forward_and_grads(ours, theirs, (2, 3, 6, 5), torch.float64, atol=1e-12, rtol=1e-12)
    whole = weight_norm(nn.Linear(4, 3), dim=None)
    assert whole.parametrizations.weight.original0.shape == ()


def test_registration_keeps_the_weight_and_lstm_sees_new_parameters():
    lstm = nn.LSTM(3, 4)
    x = torch.randn(5, 2, 3, generator=_gen())
    before = lstm(x)[0]
    weight_norm(lstm, "weight_hh_l0")
    torch.testing.assert_close(lstm(x)[0], before, atol=1e-6, rtol=1e-6)
    with torch.no_grad():  # the flattened weights must follow a change of g
        lstm.parametrizations.weight_hh_l0.original0.mul_(2.0)
    ref = nn.LSTM(3, 4)  # (deepcopy of an RNN fails after a forward with grad, as in torch)
    ref.load_state_dict({**{k: v for k, v in lstm.state_dict().items() if "." not in k},
                         "weight_hh_l0": lstm.weight_hh_l0.detach()})
    torch.testing.assert_close(lstm(x)[0], ref(x)[0])
    assert not torch.allclose(lstm(x)[0], before)


@pytest.mark.parametrize("dim", [0, 1, -1, None])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_gradcheck_float64(dim, backend):
    v = torch.randn(4, 3, 5, generator=_gen(), dtype=torch.float64, requires_grad=True)
    wn = WeightNorm(dim, backend=backend)
    g = (wn.right_inverse(v.detach())[0] * 1.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda g_, v_: wn(g_, v_), (g, v))
    assert torch.autograd.gradgradcheck(lambda g_, v_: wn(g_, v_), (g, v))


def test_gradcheck_one_dimensional_weight():
    v = torch.randn(6, generator=_gen(), dtype=torch.float64, requires_grad=True)
    g = torch.rand(6, generator=_gen(1), dtype=torch.float64).add(0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda g_, v_: WeightNorm(0)(g_, v_), (g, v))
    torch.testing.assert_close(WeightNorm(0)(g, v), g * v.sign())


@pytest.mark.parametrize("shape", [(8, 1), (8,)], ids=["Linear(1, 8)", "1-D"])
def test_slices_of_one_value_have_a_zero_direction_gradient(shape):
    """``w = g * v / |v| = g * sign(v)`` for a slice of one value (``Linear(1, n)``, a 1-D
    weight): ``v``'s gradient is zero at both orders. In float32 it was rounding of
    ``g * dw / |v|``, 2.4e-4 at ``|v| ~ 0.1`` and second derivatives up to 16; such slices
    are now computed in float64 (within float32's rounding of zero)."""
    gen = _gen(4)
    for _ in range(50):
        v = (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1).float()
        v.requires_grad_()
        g = (torch.rand(shape, generator=gen) + 0.5).requires_grad_()
        dw = torch.randn(shape, generator=gen)
        w = WeightNorm(0)(g, v)
        torch.testing.assert_close(w, g * v.sign())
        dv, dg = torch.autograd.grad(w, (v, g), dw, create_graph=True)
        assert float(dv.detach().abs().max()) <= 1e-6, float(dv.detach().abs().max())
        torch.testing.assert_close(dg, dw * v.sign())
        direction = torch.randn(shape, generator=gen)
        (h,) = torch.autograd.grad((dv * direction).sum() + (dg * direction).sum(), v,
                                   allow_unused=True)
        assert h is None or float(h.abs().max()) <= 1e-6, float(h.abs().max())
        (first,) = torch.autograd.grad(WeightNorm(0)(g, v), v, dw)  # (no graph: by hand)
        assert float(first.abs().max()) <= 1e-6, float(first.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_against_float64_reference(dtype):
    v = torch.randn(16, 300, generator=_gen(), dtype=torch.float64) * 200  # |v|^2 > fp16 max
    g = torch.rand(16, 1, generator=_gen(1), dtype=torch.float64) + 0.5
    vl, gl = v.to(dtype).requires_grad_(), g.to(dtype).requires_grad_()
    w = WeightNorm(0)(gl, vl)
    assert w.dtype == dtype
    v64, g64 = vl.detach().double().requires_grad_(), gl.detach().double().requires_grad_()
    ref = reference_weight_norm(v64, g64, 0)
    eps = torch.finfo(dtype).eps
    scale = float(ref.detach().abs().max())
    torch.testing.assert_close(w.double(), ref, atol=4 * eps * scale, rtol=4 * eps)
    dw = torch.randn(w.shape, generator=_gen(2), dtype=torch.float64)
    w.backward(dw.to(dtype))
    ref.backward(dw)
    for got, want in ((vl.grad, v64.grad), (gl.grad, g64.grad)):
        err = float((got.double() - want).abs().max())
        assert err <= 8 * eps * float(want.abs().max()), err


@settings(max_examples=25, deadline=None)
@given(st.floats(1e-3, 1e3), st.integers(0, 2))
def test_output_is_invariant_to_the_scale_of_v(alpha, dim):
    v = torch.randn(3, 4, 5, generator=_gen(), dtype=torch.float64)
    g = torch.rand(*[s if d == dim else 1 for d, s in enumerate(v.shape)], generator=_gen(1),
                   dtype=torch.float64)
    wn = WeightNorm(dim)
    torch.testing.assert_close(wn(g, v * alpha), wn(g, v), atol=1e-13, rtol=1e-12)


def _conv_model(wn):
    return nn.Sequential(wn(nn.Conv2d(3, 6, 3)), nn.ReLU(), wn(nn.Conv2d(6, 4, 3)), nn.Flatten(),
                         wn(nn.Linear(4 * 4 * 4, 5)))


def test_checkpoints_move_between_torch_and_normkit_both_ways():
    x = torch.randn(3, 3, 8, 8, generator=_gen())
    theirs = _randomize_(_conv_model(torch_weight_norm), seed=1)
    ours = _conv_model(weight_norm)
    result = ours.load_state_dict(_state_roundtrip(theirs))
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)
    _randomize_(ours, seed=2)
    back = _conv_model(torch_weight_norm)
    back.load_state_dict(_state_roundtrip(ours))
    torch.testing.assert_close(back(x), ours(x), atol=1e-6, rtol=1e-6)


def test_old_weight_g_weight_v_checkpoint_loads():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        old = _randomize_(_conv_model(torch.nn.utils.weight_norm), seed=3)
    state = old.state_dict()
    assert "0.weight_g" in state and "4.weight_v" in state
    ours = _conv_model(weight_norm)
    result = ours.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, 3, 8, 8, generator=_gen())
    torch.testing.assert_close(ours(x), old(x), atol=1e-6, rtol=1e-6)


def test_old_checkpoint_hook_on_torch_without_the_public_hook_method(monkeypatch):
    """torch 2.4 has only Module._register_load_state_dict_pre_hook: the same hook goes
    through it there, and old g/v checkpoints still load (on later torch, run by hiding
    the public method)."""
    monkeypatch.delattr(nn.Module, "register_load_state_dict_pre_hook", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        old = _randomize_(_conv_model(torch.nn.utils.weight_norm), seed=3)
    ours = _conv_model(weight_norm)
    result = ours.load_state_dict(old.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, 3, 8, 8, generator=_gen())
    torch.testing.assert_close(ours(x), old(x), atol=1e-6, rtol=1e-6)


def test_remove_weight_norm_bakes_the_weight():
    x = torch.randn(4, 7, generator=_gen())
    for wn in (weight_norm, torch_weight_norm):
        m = _randomize_(wn(nn.Linear(7, 5)))
        before = m(x)
        assert remove_weight_norm(m) is m
        assert sorted(m.state_dict()) == ["bias", "weight"]
        assert type(m) is nn.Linear and isinstance(m.weight, nn.Parameter)
        torch.testing.assert_close(m(x), before)
        if wn is weight_norm:  # normkit's old-checkpoint hook is inert once removed
            old = {"weight_g": torch.ones(5, 1), "weight_v": torch.ones(5, 7),
                   "bias": torch.ones(5)}
            with pytest.raises(RuntimeError, match="Unexpected key.*weight_g"):
                m.load_state_dict(old)


@pytest.mark.parametrize("wn", [weight_norm, torch_weight_norm], ids=["normkit", "torch"])
def test_removing_or_adding_on_a_deep_copy_leaves_the_original_whole(wn):
    """copy.deepcopy shares a parametrized module's class, on which torch keeps the
    weight's property: torch's remove_parametrizations on an inference copy deleted it,
    so the training model's .weight raised AttributeError."""
    x = torch.randn(4, 7, generator=_gen())
    model = nn.Sequential(_randomize_(wn(nn.Linear(7, 5))), nn.ReLU(),
                          _randomize_(wn(nn.Linear(5, 3))))
    before = model(x)
    deploy = copy.deepcopy(model)
    for layer in (deploy[0], deploy[2]):
        remove_weight_norm(layer)
    assert type(deploy[0]) is nn.Linear and type(model[0]).__name__ == "ParametrizedLinear"
    torch.testing.assert_close(model(x), before)  # (AttributeError without the fix)
    torch.testing.assert_close(deploy(x), before)
    assert sorted(model[0].state_dict()) == [
        "bias", "parametrizations.weight.original0", "parametrizations.weight.original1"]
    # adding one to a copy gives the original no property it cannot serve
    other = copy.deepcopy(model)
    weight_norm(other[0], "bias")
    assert "bias" in other[0].parametrizations
    torch.testing.assert_close(model(x), before)  # (AttributeError on .bias without it)
    torch.testing.assert_close(other(x), before, rtol=1.3e-6, atol=1e-5)


def test_weight_norm_errors_name_what_was_expected():
    with pytest.raises(ValueError, match=r"LSTM .*'weight'.*weight_ih_l0, weight_hh_l0"):
        weight_norm(nn.LSTM(3, 4))
    with pytest.raises(ValueError, match=r"Linear .*'bias_x'.*weight, bias"):
        weight_norm(nn.Linear(3, 4), "bias_x")
    with pytest.raises(ValueError, match="buffer"):
        weight_norm(nn.BatchNorm1d(3), "running_mean")
    with pytest.raises(ValueError, match="already parametrized by WeightNorm"):
        weight_norm(weight_norm(nn.Linear(3, 4)))
    with pytest.raises(ValueError, match=r"dim in \[-2, 1\].*got dim=2"):
        weight_norm(nn.Linear(3, 4), dim=2)
    with pytest.raises(TypeError, match="int or None"):
        weight_norm(nn.Linear(3, 4), dim=1.0)
    with pytest.raises(TypeError, match="WeightNorm expected dim to be an int or None, got '0'"):
        WeightNorm("0")
    with pytest.raises(ValueError, match="to be weight-normalized, got a plain tensor"):
        remove_weight_norm(nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"expected g of shape \(5, 1\)"):
        WeightNorm(0)(torch.ones(5), torch.ones(5, 2))


# ---------------------------------------------------------------- data-dependent init


def _pre_activations(model, x, forward=None):
    """Run one forward and return {name: output} of every weight-normalized layer."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        if hasattr(module, "parametrizations") and "weight" in module.parametrizations:
            handles.append(module.register_forward_hook(
                lambda m, a, out, name=name: seen.setdefault(name, out.detach())))
    try:
        (forward or (lambda m, b: m(b)))(model, x)
    finally:
        for h in handles:
            h.remove()
    return seen


def _assert_standardized(t, channel_dim, scale=1.0, tol=1e-9, centered=True):
    t = t.detach()
    dims = [d for d in range(t.dim()) if d != channel_dim % t.dim()]
    mean, std = t.mean(dims), t.var(dims, correction=0).sqrt()
    if centered:
        assert float(mean.abs().max()) < tol, mean
    assert float((std - scale).abs().max()) < tol, std


def _mlp(bias=True):
    return nn.Sequential(weight_norm(nn.Linear(6, 16)), nn.Tanh(), weight_norm(nn.Linear(16, 16)),
                         nn.ReLU(), weight_norm(nn.Linear(16, 3, bias=bias))).double()


@pytest.mark.parametrize("init_scale", [1.0, 0.5])
def test_init_standardizes_every_layer_of_an_mlp(init_scale):
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(256, 6, generator=_gen(), dtype=torch.float64) * 3 + 2
    first = model[0](x)
    stats = data_dependent_init_(model, x, init_scale=init_scale)
    assert list(stats) == ["0", "2", "4"]
    torch.testing.assert_close(stats["0"]["mean"], first.mean(0))
    torch.testing.assert_close(stats["0"]["std"], first.var(0, correction=0).sqrt())
    for t in _pre_activations(model, x).values():
        _assert_standardized(t, -1, scale=init_scale)


class _ResidualCNN(nn.Module):
    """Declared out of forward order, with a residual add, BatchNorm and a ConvTranspose."""

    def __init__(self):
        super().__init__()
        self.head = weight_norm(nn.Linear(8, 4))
        self.up = weight_norm(nn.ConvTranspose2d(8, 8, 2, stride=2), dim=1)
        self.conv2 = weight_norm(nn.Conv2d(8, 8, 3, padding=1))
        self.stem = torch_weight_norm(nn.Conv2d(3, 8, 3, padding=1))  # torch's is fine too
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = h + torch.relu(self.bn(self.conv2(h)))
        h = self.up(h)
        return self.head(h.mean((2, 3)))


def test_init_is_sequential_and_exact_on_a_non_sequential_cnn():
    torch.manual_seed(0)
    model = _ResidualCNN().double()
    model.eval()
    model.bn.train()  # mixed modes are restored per module
    bn_state = copy.deepcopy(model.bn.state_dict())
    x = torch.randn(16, 3, 6, 6, generator=_gen(), dtype=torch.float64) + 0.5
    outputs = []
    stats = data_dependent_init_(model, x, forward=lambda m, b: outputs.append(m(b)))
    assert list(stats) == ["stem", "conv2", "up", "head"]  # forward order
    assert not model.training and model.bn.training and not model.head.training
    for key, value in bn_state.items():  # BatchNorm buffers untouched
        assert torch.equal(model.bn.state_dict()[key], value), key
    model.train()  # the mode of the init pass
    assert torch.equal(outputs[0], model(x))  # later layers saw the initialized earlier ones
    seen = _pre_activations(model, x)
    for name in ("stem", "conv2", "up"):
        _assert_standardized(seen[name], 1)
    _assert_standardized(seen["head"], -1)


def test_init_handles_bias_free_layers_shared_layers_and_batch_conventions():
    model = _mlp(bias=False)
    x = torch.randn(128, 6, generator=_gen(), dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"without bias.*: 4"):
        data_dependent_init_(model, x)
    t = _pre_activations(model, x)["4"]
    _assert_standardized(t, -1, centered=False)
    assert float(t.mean(0).abs().max()) > 1e-3

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = weight_norm(nn.Linear(5, 5))

        def forward(self, a, b=None):
            return self.lin(torch.tanh(self.lin(a))) + (0 if b is None else b)

    shared = Shared().double()
    a = torch.randn(64, 5, generator=_gen(1), dtype=torch.float64)
    assert list(data_dependent_init_(shared, (a, torch.ones(1)))) == ["lin"]  # tuple: *batch
    _assert_standardized(shared.lin(a), -1)  # initialized on its first call
    data_dependent_init_(shared, {"a": a * 2, "b": None})  # mapping: **batch
    _assert_standardized(shared.lin(a * 2), -1)


def test_init_only_centers_units_with_a_constant_output():
    """A unit whose output does not vary over the batch (std 0: here a zero row of
    ``v``'s input weights is impossible, so the input feature it reads is constant)
    keeps its gain, is centered, and is named in a warning; the others are standardized."""
    lin = weight_norm(nn.Linear(3, 4)).double()
    with torch.no_grad():
        lin.parametrizations.weight.original1[1].copy_(torch.tensor([0.0, 0.0, 2.0]))
    x = torch.randn(64, 3, generator=_gen(), dtype=torch.float64)
    x[:, 2] = 0.5  # unit 1 reads only this constant feature
    g_before = lin.parametrizations.weight.original0.detach().clone()
    with pytest.warns(UserWarning, match=r"constant output .*only centered: <model> \(1 of 4\)"):
        stats = data_dependent_init_(lin, x)
    assert float(next(iter(stats.values()))["std"][1]) == 0.0
    t = lin(x)
    assert torch.equal(lin.parametrizations.weight.original0.detach()[1], g_before[1])
    assert float(t[:, 1].detach().abs().max()) < 1e-12  # centered: constant minus its mean
    keep = [0, 2, 3]
    _assert_standardized(t[:, keep], -1)


def test_redraw_v_is_reproducible_with_a_generator():
    x = torch.randn(64, 6, generator=_gen(), dtype=torch.float64)
    base = _mlp()
    models = [copy.deepcopy(base) for _ in range(3)]
    for model, seed in zip(models, (5, 5, 6), strict=True):
        data_dependent_init_(model, x, redraw_v=True, generator=_gen(seed))
    a, b, c = (dict(m.named_parameters()) for m in models)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["2." + V_KEY], c["2." + V_KEY])
    v = a["2." + V_KEY].detach()
    assert abs(float(v.std()) - 0.05) < 0.01 and abs(float(v.mean())) < 0.01
    for t in _pre_activations(models[0], x).values():
        _assert_standardized(t, -1)


def test_init_errors_and_skips():
    x = torch.randn(8, 3)
    with pytest.raises(ValueError, match="at least one weight-normalized layer"):
        data_dependent_init_(nn.Sequential(nn.Linear(3, 3)), x)
    with pytest.raises(ValueError, match=r"dim=1\) for ConvTranspose2d.*has dim=0"):
        data_dependent_init_(weight_norm(nn.ConvTranspose2d(3, 4, 2)), torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match="groups=2"):
        data_dependent_init_(weight_norm(nn.ConvTranspose2d(4, 4, 2, groups=2), dim=1),
                             torch.randn(2, 4, 4, 4))
    double = weight_norm(weight_norm(nn.Linear(3, 3)), "bias")
    with pytest.raises(ValueError, match="parametrized bias"):
        data_dependent_init_(double, x)
    with pytest.raises(ValueError, match="positive, finite init_scale"):
        data_dependent_init_(weight_norm(nn.Linear(3, 3)), x, init_scale=0.0)
    lstm = weight_norm(nn.LSTM(3, 4), "weight_hh_l0")
    with pytest.warns(UserWarning, match="skipped"), pytest.raises(ValueError, match="only"):
        data_dependent_init_(lstm, torch.randn(5, 2, 3))

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = weight_norm(nn.LSTM(3, 4, batch_first=True), "weight_hh_l0")
            self.out = weight_norm(nn.Linear(4, 2))
            self.unused = weight_norm(nn.Linear(4, 2))

        def forward(self, x):
            return self.out(self.rnn(x)[0])

    with pytest.raises(TypeError, match="expected a torch.nn.Module, got Tensor"):
        data_dependent_init_(x, x)
    with pytest.raises(ValueError, match=r"at least one weight-normalized layer, got none "
                                         r"called \(layers: lin\)"):
        data_dependent_init_(nn.ModuleDict({"lin": weight_norm(nn.Linear(3, 3))}), x,
                             forward=lambda model, batch: batch)

    class PairLinear(nn.Linear):  # (a Linear whose forward returns a pair)
        def forward(self, x):
            return super().forward(x), x

    with pytest.raises(TypeError, match="expected '<model>' to return a tensor, got tuple"):
        data_dependent_init_(weight_norm(PairLinear(3, 3)), x)

    mixed = Mixed()
    seq = torch.randn(16, 5, 3, generator=_gen())
    with pytest.warns(UserWarning) as record:
        stats = data_dependent_init_(mixed, seq)
    messages = " ".join(str(w.message) for w in record)
    assert "rnn.weight_hh_l0 (LSTM)" in messages and "not called" in messages
    assert list(stats) == ["out"]
    _assert_standardized(mixed.out(mixed.rnn(seq)[0]), -1, tol=1e-5)


# ---------------------------------------------------------------- mean-only BatchNorm


def _mean_only64(x, bias, dims):
    x = x.double()
    y = x - x.mean(dims, keepdim=True)
    return y if bias is None else y + bias.double().view(1, -1, *([1] * (x.dim() - 2)))


MEAN_ONLY_CASES = [(MeanOnlyBatchNorm1d, (8, 3)), (MeanOnlyBatchNorm1d, (6, 3, 5)),
                   (MeanOnlyBatchNorm2d, (4, 3, 5, 7))]


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cls,shape", MEAN_ONLY_CASES, ids=["1d-2D", "1d-3D", "2d"])
def test_mean_only_matches_float64_reference(cls, shape, bias, backend):
    m = cls(3, bias=bias, backend=backend)
    if bias:
        with torch.no_grad():
            m.bias.copy_(torch.randn(3, generator=_gen(9)))
    dims = (0, *range(2, len(shape)))
    x = (torch.randn(shape, generator=_gen()) * 2 + 1e3).requires_grad_()  # offset: compensation
    y = m(x)
    x64 = x.detach().double().requires_grad_()
    b64 = None if not bias else m.bias.detach().double().requires_grad_()
    ref = _mean_only64(x64, b64, dims)
    torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=0)
    dy = torch.randn(shape, generator=_gen(2))
    y.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    if bias:
        torch.testing.assert_close(m.bias.grad.double(), b64.grad, atol=1e-5, rtol=1e-5)
    m.eval()  # eval: the running mean, here 0.1 * the batch mean
    x2 = torch.randn(shape, generator=_gen(3))
    ref_eval = x2.double() - 0.1 * x64.detach().mean(dims, keepdim=True)
    if bias:
        ref_eval = ref_eval + b64.detach().view(1, -1, *([1] * (len(shape) - 2)))
    torch.testing.assert_close(m(x2).double(), ref_eval, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("momentum", [0.1, 0.3, None])
def test_mean_only_running_mean_follows_torch_momentum_convention(momentum):
    m = MeanOnlyBatchNorm2d(3, momentum=momentum).double()
    expected, means = torch.zeros(3, dtype=torch.float64), []
    for step in range(4):
        x = torch.randn(5, 3, 4, 4, generator=_gen(step), dtype=torch.float64) + step
        m(x)
        means.append(x.mean((0, 2, 3)))
        factor = 1.0 / (step + 1) if momentum is None else momentum
        expected = (1 - factor) * expected + factor * means[-1]
    assert int(m.num_batches_tracked) == 4
    torch.testing.assert_close(m.running_mean, expected, atol=1e-14, rtol=1e-14)
    if momentum is None:  # cumulative: the plain average of the batch means
        torch.testing.assert_close(m.running_mean, torch.stack(means).mean(0))
    before = m.running_mean.clone()
    m(torch.empty(0, 3, 4, 4, dtype=torch.float64))  # an empty batch changes nothing
    assert torch.equal(m.running_mean, before) and int(m.num_batches_tracked) == 4


def test_mean_only_without_running_stats_and_state_dict():
    m = MeanOnlyBatchNorm1d(4, track_running_stats=False, bias=False)
    assert m.bias is None and m.running_mean is None and list(m.state_dict()) == []
    m.eval()
    x = torch.randn(6, 4, generator=_gen())
    torch.testing.assert_close(m(x), x - x.mean(0))  # batch statistics in eval too
    assert sorted(MeanOnlyBatchNorm1d(4).state_dict()) == [
        "bias", "num_batches_tracked", "running_mean"]
    assert not any(n == "weight" for n, _ in MeanOnlyBatchNorm2d(4).named_parameters())
    torch.testing.assert_close(MeanOnlyBatchNorm1d(4)(x[:1]), torch.zeros(1, 4))  # batch of 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mean_only_keeps_dtype_and_memory_format(dtype):
    m = MeanOnlyBatchNorm2d(3)
    x = torch.randn(4, 3, 5, 5, generator=_gen()).to(dtype).to(memory_format=torch.channels_last)
    for training in (True, False):
        m.train(training)
        y = m(x)
        assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    view = torch.randn(4, 6, 5, generator=_gen()).transpose(1, 2)[:, :3]  # non-contiguous
    torch.testing.assert_close(MeanOnlyBatchNorm1d(3)(view), view - view.mean((0, 2), True))


def test_mean_only_gradcheck_float64():
    m = MeanOnlyBatchNorm1d(3, track_running_stats=False).double()
    with torch.no_grad():
        m.bias.normal_(generator=_gen())
    x = torch.randn(4, 3, 5, generator=_gen(1), dtype=torch.float64, requires_grad=True)

    def f(x_, b_):
        return torch.func.functional_call(m, {"bias": b_}, (x_,))

    b = m.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x, b))
    assert torch.autograd.gradgradcheck(f, (x, b))


def test_mean_only_errors_name_expected_and_given():
    with pytest.raises(ValueError, match=r"expected 4D input \(N, C, H, W\), got a 3D input"):
        MeanOnlyBatchNorm2d(3)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"expected 2D or 3D input.*got a 4D"):
        MeanOnlyBatchNorm1d(3)(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match=r"with 3 channels \(dim 1\), got .*\(2, 5\)"):
        MeanOnlyBatchNorm1d(3)(torch.randn(2, 5))
    with pytest.raises(ValueError, match="num_features to be an int >= 1, got 0"):
        MeanOnlyBatchNorm1d(0)
