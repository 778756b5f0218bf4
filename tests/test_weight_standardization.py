"""Weight Standardization (Qiao et al. 2019) and Scaled WS (Brock et al. 2021, NF-Nets)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from oracle import GRAD_TOL
from torch import nn

import normkit
from normkit.weights import (
    WS_EPS,
    WeightStandardization,
    activation_gain,
    fan_in,
    reference_weight_standardization,
    remove_weight_standardization,
    weight_standardization,
)

ORIG, GAIN, WEIGHT = ("parametrizations.weight.original", "parametrizations.weight.original0",
                      "parametrizations.weight.original1")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _numpy_standardized(w: np.ndarray, dim, eps: float) -> np.ndarray:
    """The oracle: numpy float64, slice by slice."""
    if dim is None:
        return (w - w.mean()) / np.sqrt(w.var() + eps)
    moved = np.moveaxis(w, dim, 0)
    out = np.stack([(s - s.mean()) / np.sqrt(s.var() + eps) for s in moved])
    return np.moveaxis(out, 0, dim)


# (id, layer, input shape, dim)
CASES = [
    ("Linear", lambda: nn.Linear(7, 5), (4, 7), 0),
    ("Conv1d", lambda: nn.Conv1d(3, 5, 3), (2, 3, 9), 0),
    ("Conv2d", lambda: nn.Conv2d(3, 6, 3, padding=1), (2, 3, 6, 5), 0),
    ("Conv2d-groups", lambda: nn.Conv2d(4, 6, 3, groups=2), (2, 4, 6, 5), 0),
    ("Conv3d", lambda: nn.Conv3d(2, 4, 3), (2, 2, 5, 4, 5), 0),
    ("ConvTranspose2d-dim1", lambda: nn.ConvTranspose2d(3, 5, 3), (2, 3, 4, 5), 1),
    ("Conv2d-whole", lambda: nn.Conv2d(3, 4, 3), (2, 3, 5, 5), None),
]


@pytest.mark.parametrize("eps", [0.0, WS_EPS, 1e-2])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_layer_uses_the_standardized_weight(case, eps):
    _, make, shape, dim = case
    torch.manual_seed(0)
    plain = make().double()
    with torch.no_grad():  # an offset and a spread per slice: both must go
        plain.weight.mul_(3).add_(0.5)
    layer = weight_standardization(copy.deepcopy(plain), dim=dim, eps=eps)
    expected = _numpy_standardized(plain.weight.detach().numpy(), dim, eps)
    np.testing.assert_allclose(layer.weight.detach().numpy(), expected, rtol=1e-12,
                               atol=1e-12)
    x = torch.randn(shape, generator=_gen(1), dtype=torch.float64)
    with torch.no_grad():
        plain.weight.copy_(torch.from_numpy(expected))
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-12, atol=1e-12)
    assert sorted(layer.state_dict()) == sorted([ORIG, "bias"])


def test_scaled_ws_with_gain_is_timms_scaled_std_conv():
    """timm's ScaledStdConv2d computes its weight with F.batch_norm over each output
    channel's values, times gain * gamma / sqrt(fan_in): an independent formula."""
    torch.manual_seed(2)
    conv = nn.Conv2d(4, 6, 3).double()
    gamma, eps = activation_gain("silu"), 1e-6
    ours = weight_standardization(copy.deepcopy(conv), gamma=gamma, gain=True, eps=eps)
    with torch.no_grad():
        ours.parametrizations.weight.original0.uniform_(0.5, 1.5)
    gain = ours.parametrizations.weight.original0.detach()
    scale = gamma * fan_in(conv.weight) ** -0.5
    assert fan_in(conv.weight) == 4 * 9
    timm_weight = nn.functional.batch_norm(
        conv.weight.reshape(1, 6, -1), None, None, weight=(gain * scale).view(-1),
        training=True, momentum=0.0, eps=eps).reshape_as(conv.weight)
    torch.testing.assert_close(ours.weight, timm_weight, rtol=1e-12, atol=1e-12)
    assert sorted(ours.state_dict()) == ["bias", GAIN, WEIGHT]


def test_gradients_of_weight_and_gain_pass_gradcheck():
    torch.manual_seed(3)
    w = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    g = (torch.rand(4, 1, 1, 1, dtype=torch.float64) + 0.5).requires_grad_()
    ws = WeightStandardization(gamma=1.5, gain=True, eps=1e-3)
    assert torch.autograd.gradcheck(lambda g, w: ws(g, w), (g, w))
    assert torch.autograd.gradgradcheck(lambda g, w: ws(g, w), (g, w))
    plain = WeightStandardization(dim=None)
    assert torch.autograd.gradcheck(plain, (w,))


@pytest.mark.parametrize("fan", [2, 3])
def test_gradients_of_slices_of_few_values_hold_float32_tolerance(fan):
    """A slice of two or three values (a fan-in of 2: ``Linear(2, n)``, a two-tap
    depthwise kernel): its gradient is what ``eps`` leaves of cancelling terms, 1.4e-4 off
    in float32 for fan-in 2 (relative to the largest value) before normkit took float64
    there; first and second derivatives now within the float32 gradient tolerance of a
    float64 oracle written here."""
    def standardized64(w):  # (numpy's formula, in torch for autograd)
        centered = w - w.mean(1, keepdim=True)
        return centered / (centered.square().mean(1, keepdim=True) + WS_EPS).sqrt()

    gen = _gen(5)
    for _ in range(50):
        v = (torch.randn(8, fan, generator=gen, dtype=torch.float64) * 0.1).float()
        dy = torch.randn(8, fan, generator=gen)
        direction = torch.randn(8, fan, generator=gen, dtype=torch.float64)
        results = []
        for dtype, fn in ((torch.float32, WeightStandardization()),
                          (torch.float64, standardized64)):
            w = v.to(dtype).requires_grad_()
            (first,) = torch.autograd.grad(fn(w), w, dy.to(dtype), create_graph=True)
            (second,) = torch.autograd.grad((first.double() * direction).sum(), w)
            results.append((first.detach().double(), second.double()))
        for got, want in zip(*results, strict=True):
            scale = max(1.0, float(want.abs().max()))
            assert float((got - want).abs().max()) <= GRAD_TOL[torch.float32] * scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_weights_are_standardized_in_float32(dtype):
    w64 = torch.randn(8, 300, generator=_gen(), dtype=torch.float64) * 50 + 200
    w = w64.to(dtype)
    out = WeightStandardization()(w)
    assert out.dtype == dtype
    ref = reference_weight_standardization(w.double())
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), ref, rtol=2 * eps, atol=2 * eps * 4)


def test_training_steps_reach_the_gain_and_remove_bakes_the_weight():
    torch.manual_seed(4)
    net = nn.Sequential(weight_standardization(nn.Conv2d(3, 8, 3), gamma=activation_gain(
        "relu"), gain=True), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 2, (8,))
    net(x)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    gain = net[0].parametrizations.weight.original0
    assert gain.grad is not None and not torch.equal(gain, torch.ones_like(gain))
    before = net(x)
    deployed = copy.deepcopy(net)
    remove_weight_standardization(deployed[0])
    assert type(deployed[0]) is nn.Conv2d and sorted(deployed[0].state_dict()) == [
        "bias", "weight"]
    torch.testing.assert_close(deployed(x), before)
    torch.testing.assert_close(net(x), before)  # (the original keeps its parametrization)


@pytest.mark.parametrize("act", ["relu", "silu", "tanh"])
def test_signal_survives_a_deep_normalizer_free_stack(act):
    """The point of Scaled WS: with gamma = activation_gain of the activation each conv
    reads, a 20-layer conv + activation stack without any norm layer keeps its
    pre-activations' variance within an order of magnitude of 1 (measured 0.2-0.9;
    the zero padding and the activations' mean shift make it drift down slowly, which
    NF-Nets' residual blocks handle), where plain convolutions lose 15 orders of it.
    SiLU is not homogeneous: gamma on the weight of the next layer, not of this one."""
    torch.manual_seed(5)
    activation = {"relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}[act]

    def stack(scaled):
        layers = []
        for i in range(20):
            conv = nn.Conv2d(16, 16, 3, padding=1, bias=False)
            if scaled:
                conv = weight_standardization(conv, gamma=1.0 if i == 0 else
                                              activation_gain(act))
            layers += [conv, activation()]
        return nn.Sequential(*layers[:-1])  # ends with the last pre-activation

    x = torch.randn(8, 16, 12, 12)
    with torch.no_grad():
        assert 0.1 < float(stack(True)(x).var()) < 2.0
        assert float(stack(False)(x).var()) < 1e-6


def test_activation_gains_match_nf_nets_constants_and_the_relu_closed_form():
    """Brock et al.'s code estimates the gains from samples (deepmind-research
    nfnets/base.py); the quadrature here is exact to 1e-12 for ReLU's closed form."""
    assert activation_gain("relu") == pytest.approx(1 / math.sqrt(0.5 - 1 / (2 * math.pi)),
                                                    rel=1e-12)
    published = {"relu": 1.7139588594436646, "gelu": 1.7015043497085571,
                 "silu": 1.7881293296813965, "tanh": 1.5939117670059204,
                 "elu": 1.2716004848480225, "leaky_relu": 1.70590341091156,
                 "sigmoid": 4.803835391998291, "softplus": 1.9203323125839233,
                 "identity": 1.0}
    for name, value in published.items():
        assert activation_gain(name) == pytest.approx(value, rel=1e-3), name
    assert activation_gain(lambda x: 2 * x) == pytest.approx(0.5, rel=1e-12)


def test_bad_input_names_what_was_expected():
    conv = nn.Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"eps to be a finite number >= 0, got -1"):
        weight_standardization(copy.deepcopy(conv), eps=-1)
    with pytest.raises(ValueError, match=r"gamma to be a finite number >= 0, got nan"):
        weight_standardization(copy.deepcopy(conv), gamma=float("nan"))
    with pytest.raises(ValueError, match=r"dim in \[-4, 3\].*got dim=4"):
        weight_standardization(copy.deepcopy(conv), dim=4)
    with pytest.raises(ValueError, match=r"at least 2 values .*shape \(4, 1, 1, 1\), one value "
                                         r"per slice"):
        weight_standardization(nn.Conv2d(4, 4, 1, groups=4))  # depthwise 1x1: fan-in 1
    with pytest.raises(ValueError, match="parameter named 'kernel'"):
        weight_standardization(copy.deepcopy(conv), "kernel")
    with pytest.raises(TypeError, match="expected a torch.nn.Module, got Tensor"):
        weight_standardization(torch.ones(3))
    twice = weight_standardization(copy.deepcopy(conv))
    with pytest.raises(ValueError, match="already parametrized by WeightStandardization"):
        weight_standardization(twice)
    with pytest.raises(ValueError, match="to be weight-standardized, got a plain tensor"):
        remove_weight_standardization(conv)
    with pytest.raises(ValueError, match="to be weight-standardized, got another "):
        remove_weight_standardization(normkit.weight_norm(copy.deepcopy(conv)))
    with pytest.raises(ValueError, match="activation_gain expected one of identity, relu"):
        activation_gain("swish")
    with pytest.raises(ValueError, match="whose output varies"):
        activation_gain(torch.zeros_like)
    with pytest.raises(TypeError, match="an activation name or a callable, got int"):
        activation_gain(3)
    with pytest.raises(ValueError, match="to a tensor of the same shape"):
        activation_gain(lambda x: x.sum())
    with pytest.raises(TypeError, match="dim to be an int or None, got True"):
        WeightStandardization(dim=True)
    with pytest.raises(ValueError, match=r"WeightStandardization\(gain=True\) expected 2 "
                                         r"tensor\(s\), got 1"):
        WeightStandardization(gain=True)(torch.ones(4, 3))


def test_compiles_without_graph_breaks_and_matches_eager():
    torch.manual_seed(6)
    model = nn.Sequential(weight_standardization(nn.Conv2d(3, 8, 3), gamma=1.0, gain=True),
                          nn.SiLU())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(compiled(x), model(x))
    compiled(x).square().sum().backward()
    eager = copy.deepcopy(model)
    eager.zero_grad()
    eager(x).square().sum().backward()
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_has_the_same_bits_with_and_without_autograd(dtype):
    """What training uses (autograd on) is what inference and remove_* bake (off)."""
    torch.manual_seed(7)
    conv = weight_standardization(nn.Conv2d(16, 32, 3).to(dtype), gamma=1.3, gain=True)
    with torch.no_grad():
        inference = conv.weight.clone()
    trained = conv.weight
    assert trained.requires_grad and torch.equal(trained, inference)
    assert torch.equal(remove_weight_standardization(conv).weight, trained)
