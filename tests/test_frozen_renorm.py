"""FrozenBatchNorm and BatchRenorm."""

from __future__ import annotations

import pytest
import torch

import normkit


def _trained_bn(cls=torch.nn.BatchNorm2d, channels=4, shape=(8, 4, 5, 5)):
    torch.manual_seed(0)
    bn = cls(channels)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    for _ in range(3):
        bn(torch.randn(shape) * 2 + 1)
    return bn.eval()


def test_frozen_equals_eval_batchnorm_and_ignores_train():
    bn = _trained_bn()
    frozen = normkit.FrozenBatchNorm2d.from_batchnorm(bn)
    x = torch.randn(3, 4, 5, 5, requires_grad=True)
    frozen.train()
    y = frozen(x)
    torch.testing.assert_close(y, bn(x))
    y.sum().backward()
    expected = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).view(1, 4, 1, 1)
    torch.testing.assert_close(x.grad, expected.expand_as(x))
    assert list(frozen.parameters()) == []
    before = frozen.running_mean.clone()
    frozen(torch.randn(3, 4, 5, 5) + 10)
    torch.testing.assert_close(frozen.running_mean, before)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("offset", [0.5, 1e3], ids=["kernel", "compensated"])
def test_frozen_takes_inference_batchnorms_path_and_equals_float64(layout, offset,
                                                                   monkeypatch):
    """FrozenBatchNorm is inference BatchNorm: torch's kernel where the check of its
    statistics passes, normkit's scale_shift past it (a running mean 1e3 standard
    deviations out); output and input gradient equal float64 either way."""
    from oracle import assert_close, assert_grad_close

    from normkit.kernels import native

    served = []
    check = native.batch_norm_eval
    monkeypatch.setattr(native, "batch_norm_eval",
                        lambda *a: served.append(check(*a)) or served[-1])
    gen = torch.Generator().manual_seed(3)
    frozen = normkit.FrozenBatchNorm2d(4)
    with torch.no_grad():
        frozen.running_mean.copy_(torch.randn(4, generator=gen) * offset)
        frozen.running_var.copy_(torch.rand(4, generator=gen) + 0.5)
        frozen.weight.copy_(torch.randn(4, generator=gen))
        frozen.bias.copy_(torch.randn(4, generator=gen))
    x = torch.randn(3, 4, 5, 6, generator=gen) + frozen.running_mean.view(1, 4, 1, 1)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = frozen(x)
    assert (served[-1] is not None) == (offset < 1.0)
    x64 = x.detach().double().requires_grad_()
    b = {name: t.double() for name, t in frozen.state_dict().items()}
    ref = torch.nn.functional.batch_norm(x64, b["running_mean"], b["running_var"],
                                         b["weight"], b["bias"], eps=frozen.eps)
    assert_close(y, ref, torch.float32)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    ref.backward(dy.double())
    assert_grad_close(x.grad, x64.grad, torch.float32)


def test_frozen_loads_any_batchnorm_checkpoint():
    bn = _trained_bn()
    frozen = normkit.FrozenBatchNorm2d(4)
    frozen.load_state_dict(bn.state_dict())  # num_batches_tracked dropped
    torch.testing.assert_close(frozen.running_var, bn.running_var)
    plain = torch.nn.BatchNorm2d(4, affine=False)
    frozen.load_state_dict(plain.state_dict())
    torch.testing.assert_close(frozen.weight, torch.ones(4))
    with pytest.raises(ValueError, match="running statistics"):
        normkit.FrozenBatchNorm2d.from_batchnorm(torch.nn.BatchNorm2d(4,
                                                                      track_running_stats=False))
    with pytest.raises(ValueError, match="4 channels"):
        frozen(torch.randn(2, 3, 4, 4))


def test_freeze_and_unfreeze_a_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), _trained_bn(), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 7 * 7, 2),
                              _trained_bn(torch.nn.BatchNorm1d, 2, (8, 2)))
    net.eval()
    x = torch.randn(5, 3, 9, 9)
    frozen = normkit.freeze_batchnorm(net)
    assert type(net[1]) is torch.nn.BatchNorm2d  # the caller's model is untouched
    assert type(frozen[1]) is normkit.FrozenBatchNorm2d
    assert type(frozen[5]) is normkit.FrozenBatchNorm1d
    frozen.train()  # stays frozen
    torch.testing.assert_close(frozen(x), net(x))
    thawed = normkit.unfreeze_batchnorm(frozen)
    assert type(thawed[1]) is normkit.BatchNorm2d and thawed[1].weight.requires_grad
    thawed.eval()
    torch.testing.assert_close(thawed(x), net(x))
    with pytest.raises(ValueError, match="BatchNorm layers"):
        normkit.freeze_batchnorm(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="FrozenBatchNorm layers"):
        normkit.unfreeze_batchnorm(net)


def test_renorm_schedule():
    assert normkit.renorm_limits(0) == (1.0, 0.0)
    assert normkit.renorm_limits(5000) == (1.0, 0.0)
    r, d = normkit.renorm_limits(15000)
    assert r == pytest.approx(1 + 2 * 10000 / 35000) and d == pytest.approx(2.5)
    assert normkit.renorm_limits(25000)[1] == 5.0 and normkit.renorm_limits(40000)[0] == 3.0
    assert normkit.renorm_limits(100, 2.0, 1.0, 0, 200, 50) == (1.5, 1.0)
    brn = normkit.BatchRenorm1d(3, warmup_steps=2, r_max_steps=4, d_max_steps=4)
    seen = []
    for _ in range(5):
        seen.append(brn.current_limits())
        brn(torch.randn(8, 3))
    assert seen == [(1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (2.0, 2.5), (3.0, 5.0)]


def test_renorm_with_r1_d0_is_batchnorm():
    brn = normkit.BatchRenorm2d(4, r_max=1.0, d_max=0.0, momentum=0.2).double()
    bn = normkit.BatchNorm2d(4, momentum=0.2).double()
    with torch.no_grad():
        brn.weight.uniform_(0.5, 1.5)
        bn.weight.copy_(brn.weight)
    for step in range(3):
        x = torch.randn(6, 4, 3, 3, dtype=torch.float64) * 3 + step
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = brn(xa), bn(xb)
        torch.testing.assert_close(ya, yb)
        ya.sum().backward(), yb.sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(brn.weight.grad, bn.weight.grad)
    torch.testing.assert_close(brn.running_var, bn.running_var)
    brn.eval(), bn.eval()
    torch.testing.assert_close(brn(x), bn(x))
    bn.load_state_dict(brn.state_dict())  # checkpoints are BatchNorm's


def test_renorm_matches_the_paper_formula_with_stopped_gradients():
    brn = normkit.BatchRenorm1d(3, r_max=1.5, d_max=0.5, warmup_steps=0, r_max_steps=0,
                                d_max_steps=0).double()
    with torch.no_grad():
        brn.running_mean.copy_(torch.tensor([0.0, 10.0, -3.0]))
        brn.running_var.copy_(torch.tensor([1.0, 0.1, 9.0]))
        brn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        brn.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
    rm, rv = brn.running_mean.clone(), brn.running_var.clone()
    x = (torch.randn(10, 3, dtype=torch.float64) * 2 + 1).requires_grad_()
    y = brn(x)
    x2 = x.detach().clone().requires_grad_()
    mean, var = x2.mean(0), x2.var(0, correction=0)
    sigma_b = torch.sqrt(var + brn.eps)
    sigma = torch.sqrt(rv + brn.eps)
    r = (sigma_b / sigma).clamp(1 / 1.5, 1.5).detach()
    d = ((mean - rm) / sigma).clamp(-0.5, 0.5).detach()
    ref = ((x2 - mean) / sigma_b * r + d) * brn.weight.detach() + brn.bias.detach()
    torch.testing.assert_close(y, ref)
    g = torch.randn(10, 3, dtype=torch.float64)
    y.backward(g), ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    assert (r != 1).all() and (d.abs() == 0.5).any()  # the clipping really happened


@pytest.mark.parametrize("path", ["engine", "torch-kernel", "channels-last", "compensated",
                                  "reference"])
def test_renorm_float32_paths_match_the_paper_formula(path, monkeypatch):
    """Batch Renormalization's batch statistics come from BatchNorm's fast paths (the
    slice-sums engine, torch's kernel where accurate) or normkit's compensated core;
    each path's output, gradients and running statistics equal the paper's formula in
    float64 (r and d stopped)."""
    from oracle import assert_close, assert_grad_close

    from normkit.kernels import channels, native

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0 if path == "engine" else 1 << 30)
    served = {"engine": [], "torch-kernel": []}
    engine, kernel = channels.normalize, native.batch_norm_normalized
    monkeypatch.setattr(channels, "normalize",
                        lambda *a: served["engine"].append(engine(*a)) or served["engine"][-1])
    monkeypatch.setattr(native, "batch_norm_normalized",
                        lambda *a: served["torch-kernel"].append(kernel(*a))
                        or served["torch-kernel"][-1])
    gen = torch.Generator().manual_seed(4)
    brn = normkit.BatchRenorm2d(4, r_max=1.5, d_max=0.5, warmup_steps=0, r_max_steps=0,
                                d_max_steps=0, momentum=0.3,
                                backend="reference" if path == "reference" else "auto")
    offset = 1e4 if path == "compensated" else 1.0
    with torch.no_grad():
        brn.running_mean.copy_(torch.randn(4, generator=gen) + offset)
        brn.running_var.copy_(torch.rand(4, generator=gen) * 4 + 0.5)
        brn.weight.copy_(torch.randn(4, generator=gen))
        brn.bias.copy_(torch.randn(4, generator=gen))
    rm, rv = brn.running_mean.double(), brn.running_var.double()
    x = torch.randn(6, 4, 5, 7, generator=gen) * 2 + offset
    if path == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = brn(x)
    if path in served:
        assert served[path] and served[path][-1] is not None, path
    elif path == "channels-last":
        assert served["torch-kernel"][-1] is not None
    x64 = x.detach().double().requires_grad_()
    w64, b64 = (p.detach().double().requires_grad_() for p in (brn.weight, brn.bias))
    dims = (0, 2, 3)
    mean, var = x64.mean(dims, keepdim=True), x64.var(dims, correction=0, keepdim=True)
    sigma_b, sigma = torch.sqrt(var + brn.eps), torch.sqrt(rv.view(1, 4, 1, 1) + brn.eps)
    r = (sigma_b / sigma).clamp(1 / 1.5, 1.5).detach()
    d = ((mean - rm.view(1, 4, 1, 1)) / sigma).clamp(-0.5, 0.5).detach()
    ref = ((x64 - mean) / sigma_b * r + d) * w64.view(1, 4, 1, 1) + b64.view(1, 4, 1, 1)
    assert_close(y, ref, torch.float32)
    dy = torch.randn(y.shape, generator=gen)
    got = torch.autograd.grad(y, (x, brn.weight, brn.bias), dy)
    want = torch.autograd.grad(ref, (x64, w64, b64), dy.double())
    for g, w_ in zip(got, want, strict=True):
        assert_grad_close(g, w_, torch.float32)
    count = x.numel() // 4
    batch_var = var.view(4) * count / (count - 1)
    torch.testing.assert_close(brn.running_mean.double(), 0.7 * rm + 0.3 * mean.view(4).detach(),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(brn.running_var.double(), 0.7 * rv + 0.3 * batch_var.detach(),
                               rtol=1e-5, atol=1e-6)


def test_renorm_bad_arguments():
    with pytest.raises(ValueError, match="r_max"):
        normkit.BatchRenorm2d(3, r_max=0.5)
