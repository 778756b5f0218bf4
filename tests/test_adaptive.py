"""Adaptive (conditional) normalization: AdaptiveLayerNorm, AdaptiveGroupNorm, AdaIN."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normkit
from normkit import AdaptiveGroupNorm, AdaptiveLayerNorm, adaptive_instance_norm


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference(x, cond, layer):
    """float64, written out: normalize over dims, then * (1 + scale) + shift."""
    x, cond = x.double(), cond.double()
    w = layer.modulation.weight.double()
    b = layer.modulation.bias.double()
    scale, shift = (cond @ w.T + b).chunk(2, dim=1)
    if isinstance(layer, AdaptiveGroupNorm):
        n, c = x.shape[:2]
        g = layer.norm.num_groups
        grouped = x.reshape(n, g, -1)
        mean = grouped.mean(-1, keepdim=True)
        var = grouped.var(-1, correction=0, keepdim=True)
        normed = ((grouped - mean) / (var + layer.norm.eps).sqrt()).reshape(x.shape)
        view = (n, c) + (1,) * (x.dim() - 2)
    else:
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, correction=0, keepdim=True)
        normed = (x - mean) / (var + layer.norm.eps).sqrt()
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return normed * (1 + scale.view(view)) + shift.view(view)


CASES = [
    ("ln-tokens", lambda: AdaptiveLayerNorm(12, 6, zero_init=False), (3, 7, 12)),
    ("ln-rows", lambda: AdaptiveLayerNorm(12, 6, eps=1e-6, zero_init=False), (3, 12)),
    ("gn-images", lambda: AdaptiveGroupNorm(4, 12, 6, zero_init=False), (3, 12, 5, 4)),
    ("gn-instance", lambda: AdaptiveGroupNorm(12, 12, 6, zero_init=False), (3, 12, 9)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradients_match_a_float64_reference(case, dtype):
    _, make, shape = case
    torch.manual_seed(0)
    layer = make().to(dtype)
    x = (torch.randn(shape, generator=_gen(1), dtype=torch.float64) * 3 + 100).to(dtype)
    cond = torch.randn(shape[0], 6, generator=_gen(2), dtype=dtype)
    x.requires_grad_()
    cond.requires_grad_()
    y = layer(x, cond)
    ref_layer = copy.deepcopy(layer).double()
    x64 = x.detach().double().requires_grad_()
    c64 = cond.detach().double().requires_grad_()
    ref = _reference(x64, c64, ref_layer)
    tol = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.float64: dict(rtol=1e-10,
                                                                        atol=1e-10)}[dtype]
    torch.testing.assert_close(y.double(), ref, **tol)
    dy = torch.randn(shape, generator=_gen(3), dtype=torch.float64)
    y.backward(dy.to(dtype))
    ref.backward(dy)
    # (float32: relative to the gradient's scale; x's gradient is 1/std = 1/3 here)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(cond.grad.double(), c64.grad, rtol=tol["rtol"],
                               atol=tol["atol"] * 100)
    for (name, p), q in zip(layer.named_parameters(), ref_layer.parameters(), strict=True):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=tol["rtol"],
                                   atol=tol["atol"] * 100, msg=name)


def test_zero_init_starts_as_the_plain_norm_and_the_condition_gets_gradients():
    ln = AdaptiveLayerNorm(8, 3)
    gn = AdaptiveGroupNorm(2, 8, 3)
    x, images, cond = torch.randn(4, 5, 8), torch.randn(4, 8, 3, 3), torch.randn(4, 3)
    torch.testing.assert_close(ln(x, cond), nn.functional.layer_norm(x, (8,)))
    torch.testing.assert_close(gn(images, cond), nn.functional.group_norm(images, 2))
    ln(x, cond).square().sum().backward()
    assert ln.modulation.weight.grad.abs().sum() > 0  # zero weights, nonzero gradient
    # the condition changes the output once the modulation has learned something
    with torch.no_grad():
        ln.modulation.weight.normal_()
    assert not torch.allclose(ln(x, cond), ln(x, cond.flip(0)))


def test_the_doctor_sees_the_inner_norm_and_the_state_dict_is_the_modules():
    model = AdaptiveGroupNorm(4, 16, 8)
    assert sorted(model.state_dict()) == ["modulation.bias", "modulation.weight"]
    report = normkit.doctor(model, {"x": torch.randn(2, 16, 4, 4), "cond": torch.randn(2, 8)})
    assert report.error is None
    assert [layer.name for layer in report.layers] == ["norm"]
    assert "4, 16, cond_features=8, eps=1e-05, zero_init=True" in repr(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adain_gives_each_channel_the_styles_mean_and_std(dtype):
    content = torch.randn(2, 3, 8, 8, generator=_gen(1)).to(dtype)
    style = (torch.randn(2, 3, 5, 6, generator=_gen(2)) * torch.tensor([1.0, 4.0, 0.5]).view(
        1, 3, 1, 1) + torch.tensor([2.0, -1.0, 50.0]).view(1, 3, 1, 1)).to(dtype)
    out = adaptive_instance_norm(content, style)
    assert out.dtype == dtype and out.shape == content.shape
    c64, s64 = content.double(), style.double()
    normed = (c64 - c64.mean((2, 3), keepdim=True)) / (
        c64.var((2, 3), correction=0, keepdim=True) + 1e-5).sqrt()
    expected = normed * (s64.var((2, 3), correction=0, keepdim=True) + 1e-5).sqrt() + \
        s64.mean((2, 3), keepdim=True)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 * 2 ** -8}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * 50)


def test_adain_gradcheck_and_one_style_for_the_batch():
    content = torch.randn(2, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    style = torch.randn(1, 2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c, s: adaptive_instance_norm(c, s, eps=1e-3),
                                    (content, style))
    out = adaptive_instance_norm(content, style)
    torch.testing.assert_close(out.mean((2, 3)), style.mean(2).expand(2, 2),
                               rtol=0, atol=1e-10)


def test_bad_input_names_what_was_expected():
    ln = AdaptiveLayerNorm(8, 4)
    with pytest.raises(ValueError, match=r"cond of shape \(N, cond_features\) = \(2, 4\) for "
                                         r"input of shape \(2, 8\), got \(2, 5\)"):
        ln(torch.randn(2, 8), torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"= \(2, 4\).*got \(3, 4\)"):
        ln(torch.randn(2, 8), torch.randn(3, 4))
    with pytest.raises(TypeError, match="cond to be a tensor, got NoneType"):
        ln(torch.randn(2, 8), None)
    with pytest.raises(ValueError, match="cond_features to be a positive int, got 0"):
        AdaptiveLayerNorm(8, 0)
    with pytest.raises(ValueError, match=r"normalized_shape to be one positive int \(the last "
                                         r"dim\), got \(2, 8\)"):
        AdaptiveLayerNorm((2, 8), 4)
    with pytest.raises(ValueError, match=r"style of shape \(2 or 1, 3, \*\)"):
        adaptive_instance_norm(torch.randn(2, 3, 4, 4), torch.randn(2, 4, 4, 4))
    with pytest.raises(ValueError, match="content of shape \\(N, C, \\*\\) with a spatial dim"):
        adaptive_instance_norm(torch.randn(2, 3), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"at least 2 values per channel .*got \(2, 3, 1, 1\)"):
        adaptive_instance_norm(torch.randn(2, 3, 1, 1), torch.randn(2, 3, 4, 4))


def test_compiles_without_graph_breaks():
    torch.manual_seed(4)
    layer = AdaptiveGroupNorm(4, 16, 8, zero_init=False)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 16, 6, 6).contiguous(memory_format=torch.channels_last)
    cond = torch.randn(2, 8)
    torch.testing.assert_close(compiled(x, cond), layer(x, cond))
    style = torch.compile(adaptive_instance_norm, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(style(x, x * 2 + 1), adaptive_instance_norm(x, x * 2 + 1))
