"""FrozenBatchNorm and BatchRenorm."""

from __future__ import annotations

import warnings

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


def test_layers_with_running_statistics_it_cannot_freeze_are_named():
    """MeanOnlyBatchNorm and PowerNorm have no frozen version: freezing a model holding
    them besides BatchNorm (BatchRenorm freezes) warns naming them, a model holding only
    them raises naming them, and where= leaving them out is silent."""
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(4), normkit.BatchRenorm1d(4),
                              normkit.MeanOnlyBatchNorm1d(4), normkit.PowerNorm(4))
    with pytest.warns(UserWarning, match=r"left '2' \(MeanOnlyBatchNorm1d\), '3' "
                                         r"\(PowerNorm\) as they are.*module\.eval\(\)"):
        frozen = normkit.freeze_batchnorm(net)
    assert [type(m).__name__ for m in frozen] == [
        "FrozenBatchNorm1d", "FrozenBatchNorm1d", "MeanOnlyBatchNorm1d", "PowerNorm"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normkit.freeze_batchnorm(net, where=lambda name, m: name in ("0", "1"))
    with pytest.raises(ValueError, match=r"no BatchNorm to freeze.*'0' "
                                         r"\(MeanOnlyBatchNorm2d\)"):
        normkit.freeze_batchnorm(torch.nn.Sequential(normkit.MeanOnlyBatchNorm2d(3)))


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


def _paper_renorm(x, brn, rm, rv, r_max, d_max):
    """Batch Renormalization by the paper's formula in float64 (r and d stopped), with
    the float64 leaves ``(x, weight, bias)`` and the running statistics it updates."""
    c = x.shape[1]
    view = (1, c) + (1,) * (x.dim() - 2)
    x64 = x.detach().double().requires_grad_()
    w64, b64 = (p.detach().double().requires_grad_() for p in (brn.weight, brn.bias))
    dims = (0, *range(2, x.dim()))
    mean, var = x64.mean(dims, keepdim=True), x64.var(dims, correction=0, keepdim=True)
    sigma_b, sigma = torch.sqrt(var + brn.eps), torch.sqrt(rv.view(view) + brn.eps)
    r = (sigma_b / sigma).clamp(1 / r_max, r_max).detach()
    d = ((mean - rm.view(view)) / sigma).clamp(-d_max, d_max).detach()
    ref = ((x64 - mean) / sigma_b * r + d) * w64.view(view) + b64.view(view)
    count = x.numel() // c
    m = brn.momentum
    running = ((1 - m) * rm + m * mean.view(c).detach(),
               (1 - m) * rv + m * var.view(c).detach() * count / (count - 1))
    return ref, (x64, w64, b64), running


def _check_renorm(brn, x, r_max, d_max, dtype=torch.float32):
    from oracle import assert_close, assert_grad_close

    rm, rv = brn.running_mean.double(), brn.running_var.double()
    x.requires_grad_()
    y = brn(x)
    ref, leaves, running = _paper_renorm(x, brn, rm, rv, r_max, d_max)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref, dtype)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype)
    got = torch.autograd.grad(y, (x, brn.weight, brn.bias), dy)
    want = torch.autograd.grad(ref, leaves, dy.double())
    for g, w_ in zip(got, want, strict=True):
        assert_grad_close(g, w_, dtype)
    torch.testing.assert_close(brn.running_mean.double(), running[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(brn.running_var.double(), running[1], rtol=1e-5, atol=1e-6)


def _renorm_for_paths(gen, offset=1.0, backend="auto", **limits):
    brn = normkit.BatchRenorm2d(4, momentum=0.3, backend=backend, **limits)
    with torch.no_grad():
        brn.running_mean.copy_(torch.randn(4, generator=gen) + offset)
        brn.running_var.copy_(torch.rand(4, generator=gen) * 4 + 0.5)
        brn.weight.copy_(torch.randn(4, generator=gen))
        brn.bias.copy_(torch.randn(4, generator=gen))
    return brn


def _route(path, monkeypatch):
    """Send small test input down ``path``: the slice-sums engine (``"engine"``), torch's
    fused kernel twice (the default below ``RENORM_BY_MOMENTS_MIN_ELEMENTS``), or its
    statistics and inference kernels (``"by-moments..."``)."""
    from normkit.kernels import channels
    from normkit.norms import batch

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0 if path == "engine" else 1 << 30)
    monkeypatch.setattr(batch, "RENORM_BY_MOMENTS_MIN_ELEMENTS",
                        0 if path.startswith("by-moments") else 1 << 30)


@pytest.mark.parametrize("path", ["engine", "engine-channels-last",
                                  "engine-channels-last-few", "torch-kernel",
                                  "channels-last", "by-moments", "by-moments-channels-last",
                                  "compensated", "engine-ill-conditioned",
                                  "channels-last-few-ill-conditioned", "reference"])
def test_renorm_float32_paths_match_the_paper_formula(path, monkeypatch):
    """Past the warm-up, Batch Renormalization takes its batch statistics first (the
    slice-sums engine's sums; on channels-last input with few values per channel
    torch's statistics kernel; on small input torch's fused kernel, from
    ``RENORM_BY_MOMENTS_MIN_ELEMENTS`` its statistics kernel), then normalizes once
    with the corrected affine (``weight * r``, ``weight * d + bias``: the engine's pass,
    the fused kernel again, or torch's inference kernel, ``native.batch_norm_by_moments``);
    ill-conditioned data and the reference backend take normkit's compensated core. Each
    path's output, gradients and running statistics equal the paper's formula in
    float64."""
    from normkit.kernels import channels, native
    from normkit.norms import batch

    engine = path.startswith("engine") or path == "channels-last-few-ill-conditioned"
    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0 if engine else 1 << 30)
    monkeypatch.setattr(batch, "RENORM_BY_MOMENTS_MIN_ELEMENTS",
                        0 if path.startswith("by-moments") else 1 << 30)
    if path == "engine-channels-last":  # channels-last past torch's accurate counts (the
        # engine's own backward sums; "-few": below them, torch's backward kernel)
        monkeypatch.setattr(channels, "CHANNELS_LAST_MAX_COUNT", 16)
        monkeypatch.setattr(channels, "CHANNELS_LAST_BACKWARD_MAX_COUNT", 16)
    if path == "engine-channels-last-few":
        monkeypatch.setattr(channels, "_backward_sums", lambda *a: pytest.fail("slice sums"))
    served = {"engine": [], "torch-kernel": [], "engine-sums": [], "stats-kernel": [],
              "by-moments": []}

    def spy(module, name, key):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a: served[key].append(real(*a)) or served[key][-1])

    spy(channels, "normalize_by", "engine")
    spy(native, "batch_norm_stats", "torch-kernel")
    spy(native, "batch_norm_by_moments", "by-moments")
    spy(channels, "moments", "engine-sums")
    spy(native, "batch_norm_moments", "stats-kernel")
    gen = torch.Generator().manual_seed(4)
    offset = 1e4 if path.endswith("ill-conditioned") or path == "compensated" else 1.0
    brn = _renorm_for_paths(gen, offset, "reference" if path == "reference" else "auto",
                            r_max=1.5, d_max=0.5, warmup_steps=0, r_max_steps=0,
                            d_max_steps=0)
    x = torch.randn(6, 4, 5, 7, generator=gen) * 2 + offset
    if "channels-last" in path:
        x = x.contiguous(memory_format=torch.channels_last)
    _check_renorm(brn, x, 1.5, 0.5)
    want_engine = path in ("engine", "engine-channels-last", "engine-channels-last-few")
    want_kernel = path in ("torch-kernel", "channels-last")
    assert bool(served["engine"]) == want_engine, served
    assert any(s is not None for s in served["torch-kernel"]) == want_kernel, served
    assert bool(served["by-moments"]) == path.startswith("by-moments"), served
    stats_kernel = path in ("engine-channels-last-few", "channels-last-few-ill-conditioned",
                            "by-moments", "by-moments-channels-last")
    assert bool(served["stats-kernel"]) == stats_kernel, served  # (not the engine's sums)
    assert bool(served["engine-sums"]) == (path in ("engine", "engine-channels-last",
                                                    "engine-ill-conditioned")), served


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_renorm_16bit_input_takes_the_statistics_kernel_in_float32(dtype, layout, spy):
    """16-bit input past the warm-up: float32 statistics from torch's statistics kernel
    (one read), one pass of its inference kernel with the corrected affine
    (``native.batch_norm_by_moments``), BatchNorm's backward kernel; output, gradients and
    running statistics equal the paper's formula in float64."""
    from normkit.kernels import native

    served = spy(native, "batch_norm_by_moments")
    gen = torch.Generator().manual_seed(6)
    brn = _renorm_for_paths(gen, r_max=1.5, d_max=0.5, warmup_steps=0, r_max_steps=0,
                            d_max_steps=0)
    x = (torch.randn(6, 4, 5, 7, generator=gen) * 2 + 1).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    mean, var, invstd = native.batch_norm_moments(x, brn.eps)
    assert mean.dtype == var.dtype == invstd.dtype == torch.float32
    torch.testing.assert_close(mean.double(), x.double().mean((0, 2, 3)), rtol=0, atol=1e-6)
    # the fused kernel's statistics with float32 parameters: the mean bit for bit, invstd
    # within an ulp
    _, fused_mean, fused_invstd = torch.native_batch_norm(x, torch.ones(4), None, None, None,
                                                          True, 0.0, brn.eps)
    assert torch.equal(mean, fused_mean)
    torch.testing.assert_close(invstd, fused_invstd, rtol=2 ** -23, atol=0.0)
    _check_renorm(brn, x, 1.5, 0.5, dtype)
    assert len(served) == 1 and served[0].dtype == dtype  # (one pass, in the input dtype)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert brn(x).is_contiguous(memory_format=fmt)  # (in the input's layout)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_renorm_warm_up_is_batchnorm_and_matches_the_paper_formula(layout, monkeypatch):
    """During the warm-up (r_max = 1, d_max = 0) r = 1 and d = 0 exactly: the module
    runs BatchNorm's path, and its result is still the paper's formula."""
    calls = []
    batch_norm = normkit.functional.batch_norm
    monkeypatch.setattr(normkit.functional, "batch_norm",
                        lambda *a, **k: calls.append(1) or batch_norm(*a, **k))
    gen = torch.Generator().manual_seed(7)
    brn = _renorm_for_paths(gen, warmup_steps=3)
    assert brn.current_limits() == (1.0, 0.0)
    x = torch.randn(6, 4, 5, 7, generator=gen) * 2 + 1
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    _check_renorm(brn, x, 1.0, 0.0)
    assert calls and int(brn.num_batches_tracked) == 1


@pytest.mark.parametrize("path", ["engine", "torch-kernel", "by-moments", "compensated"])
def test_renorm_without_affine_matches_the_paper_formula(path, monkeypatch):
    """``affine=False``: the corrected affine is ``r`` and ``d`` alone, on every path."""
    from oracle import assert_close, assert_grad_close


    _route(path, monkeypatch)
    gen = torch.Generator().manual_seed(6)
    offset = 1e4 if path == "compensated" else 1.0
    brn = normkit.BatchRenorm2d(4, affine=False, momentum=0.3, r_max=1.5, d_max=0.5,
                                warmup_steps=0, r_max_steps=0, d_max_steps=0)
    with torch.no_grad():
        brn.running_mean.copy_(torch.randn(4, generator=gen) + offset)
        brn.running_var.copy_(torch.rand(4, generator=gen) * 4 + 0.5)
    rm, rv = brn.running_mean.double(), brn.running_var.double()
    x = (torch.randn(6, 4, 5, 7, generator=gen) * 2 + offset).requires_grad_()
    y = brn(x)
    x64 = x.detach().double().requires_grad_()
    view, dims = (1, 4, 1, 1), (0, 2, 3)
    mean, var = x64.mean(dims, keepdim=True), x64.var(dims, correction=0, keepdim=True)
    sigma_b, sigma = torch.sqrt(var + brn.eps), torch.sqrt(rv.view(view) + brn.eps)
    r = (sigma_b / sigma).clamp(1 / 1.5, 1.5).detach()
    d = ((mean - rm.view(view)) / sigma).clamp(-0.5, 0.5).detach()
    ref = (x64 - mean) / sigma_b * r + d
    assert_close(y, ref, torch.float32)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy), ref.backward(dy.double())
    assert_grad_close(x.grad, x64.grad, torch.float32)
    torch.testing.assert_close(brn.running_mean.double(), 0.7 * rm + 0.3 * mean.view(4),
                               rtol=1e-6, atol=1e-6)
    assert (r != 1).any() and (d.abs() > 0).any()


def test_renorm_empty_batch_and_one_value_per_channel_answer_as_batchnorm():
    """Past the warm-up, an empty batch normalizes to an empty output and leaves the
    running statistics as they were; one value per channel raises BatchNorm's error."""
    brn = normkit.BatchRenorm2d(3, warmup_steps=0, r_max_steps=0, d_max_steps=0,
                                r_max=2.0, d_max=1.0)
    before = brn.running_mean.clone(), brn.running_var.clone()
    y = brn(torch.randn(0, 3, 4, 4, requires_grad=True))
    assert y.shape == (0, 3, 4, 4)
    y.sum().backward()
    assert torch.equal(brn.running_mean, before[0]) and torch.equal(brn.running_var, before[1])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        brn(torch.randn(1, 3, 1, 1))


def test_renorm_bad_arguments():
    with pytest.raises(ValueError, match="r_max"):
        normkit.BatchRenorm2d(3, r_max=0.5)


@pytest.mark.parametrize("path", ["engine", "torch-kernel", "channels-last", "by-moments",
                                  "by-moments-channels-last", "compensated"])
def test_renorm_double_backward_float64(path, monkeypatch):
    """Second derivatives of every renormalizing path equal those of the paper's formula
    with r and d stopped (finite differences cannot check these: r and d do depend on
    the batch, by design not through autograd)."""
    from normkit.kernels import channels

    _route(path, monkeypatch)
    served = []
    by = channels.normalize_by
    monkeypatch.setattr(channels, "normalize_by", lambda *a: served.append(1) or by(*a))
    gen = torch.Generator().manual_seed(8)
    offset = 1e4 if path == "compensated" else 0.5
    brn = _renorm_for_paths(gen, offset, r_max=1.5, d_max=0.5, warmup_steps=0,
                            r_max_steps=0, d_max_steps=0).double()
    x = torch.randn(2, 4, 4, 5, generator=gen, dtype=torch.float64) * 2 + offset
    if path.endswith("channels-last"):
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    rm, rv = brn.running_mean.clone(), brn.running_var.clone()
    y = brn(x)
    assert bool(served) == (path == "engine")
    ref, leaves, _ = _paper_renorm(x, brn, rm, rv, 1.5, 0.5)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    v = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in leaves]
    second = []
    for out, inputs in ((y, (x, brn.weight, brn.bias)), (ref, leaves)):
        grads = torch.autograd.grad(out, inputs, dy, create_graph=True)
        total = sum((g * w).sum() for g, w in zip(grads, v, strict=True))
        second.append(torch.autograd.grad(total, inputs[:2]))
    for got, want in zip(*second, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("module_dtype", [torch.float16, torch.bfloat16])
def test_renorm_16bit_module_takes_torch_kernel(module_dtype):
    """A 16-bit module (16-bit parameters and running statistics) on 16-bit input past
    the warm-up: torch's kernel with the float32 correction; the 16-bit running
    statistics are updated here (the kernel takes no 16-bit buffers beside float32
    affine), and everything matches the paper's formula in float64."""
    from oracle import assert_close

    gen = torch.Generator().manual_seed(14)
    brn = _renorm_for_paths(gen, r_max=1.5, d_max=0.5, warmup_steps=0, r_max_steps=0,
                            d_max_steps=0).to(module_dtype)
    rm, rv = brn.running_mean.double(), brn.running_var.double()
    x = (torch.randn(6, 4, 5, 7, generator=gen) * 2 + 1).to(module_dtype).requires_grad_()
    y = brn(x)
    ref, leaves, running = _paper_renorm(x, brn, rm, rv, 1.5, 0.5)
    assert y.dtype == module_dtype
    assert_close(y, ref, module_dtype)
    y.float().sum().backward()
    assert x.grad is not None and brn.weight.grad.dtype == module_dtype
    tol = dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(brn.running_mean.double(), running[0], **tol)
    torch.testing.assert_close(brn.running_var.double(), running[1], **tol)


@pytest.mark.parametrize("path", ["engine", "torch-kernel", "by-moments"])
def test_renorm_biased_running_variance(path, monkeypatch):
    """``unbiased_running_var=False`` (the Keras/Flax convention) on both fast paths: the
    running variance follows the biased batch variance."""

    _route(path, monkeypatch)
    gen = torch.Generator().manual_seed(15)
    brn = normkit.BatchRenorm2d(4, momentum=0.5, unbiased_running_var=False, warmup_steps=0,
                                r_max_steps=0, d_max_steps=0)
    x = torch.randn(6, 4, 5, 7, generator=gen) * 3 + 1
    rv = brn.running_var.clone()
    brn(x)
    var = x.double().var((0, 2, 3), correction=0)
    torch.testing.assert_close(brn.running_var.double(), 0.5 * rv.double() + 0.5 * var,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["engine", "torch-kernel", "by-moments", "compensated"])
def test_renorm_cumulative_running_statistics(path, monkeypatch):
    """``momentum=None`` past the warm-up: the running statistics are the plain average
    of the batches' (torch's cumulative rule), on every path."""

    _route(path, monkeypatch)
    gen = torch.Generator().manual_seed(16)
    brn = normkit.BatchRenorm2d(4, momentum=None, warmup_steps=0, r_max_steps=0,
                                d_max_steps=0)
    offset = 1e4 if path == "compensated" else 1.0
    batches = [torch.randn(6, 4, 5, 7, generator=gen) * 3 + offset for _ in range(3)]
    for x in batches:
        brn(x)
    means = torch.stack([x.double().mean((0, 2, 3)) for x in batches])
    variances = torch.stack([x.double().var((0, 2, 3)) for x in batches])  # unbiased
    assert int(brn.num_batches_tracked) == 3
    torch.testing.assert_close(brn.running_mean.double(), means.mean(0), rtol=1e-6,
                               atol=1e-6 * offset)
    torch.testing.assert_close(brn.running_var.double(), variances.mean(0), rtol=1e-5,
                               atol=1e-5)


def test_renorm_2d_rows_past_torchs_count_take_the_engine_through_a_view(monkeypatch):
    """BatchRenorm1d on 2D input with more rows than torch's kernel sums accurately: the
    engine on the rows' channels-last view (not the compensated core), equal to the
    paper's formula in float64, output 2D and contiguous."""
    from normkit.kernels import channels, native

    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0)  # (a small input stands in)
    served = []
    by = channels.normalize_by
    monkeypatch.setattr(channels, "normalize_by",
                        lambda *a: served.append(a[0].shape) or by(*a))
    gen = torch.Generator().manual_seed(17)
    brn = _renorm_for_paths(gen, r_max=1.5, d_max=0.5, warmup_steps=0, r_max_steps=0,
                            d_max_steps=0)
    brn.__class__ = normkit.BatchRenorm1d  # (the same state; 2D input)
    n = native.CHANNELS_LAST_MAX_COUNT + 100
    x = torch.randn(n, 4, generator=gen) * 2 + 1
    _check_renorm(brn, x, 1.5, 0.5)
    assert served == [torch.Size([1, 4, n, 1])]
    assert brn(x.detach()).is_contiguous()
