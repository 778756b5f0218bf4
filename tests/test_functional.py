"""normkit.functional: torch.nn.functional-compatible signatures and behaviour."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as TF

import normkit
import normkit.functional as F

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
            assert y.dtype == yt.dtype, type(nk).__name__
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


def test_backend_is_read_at_call_time():
    ln = normkit.LayerNorm(6)
    x = torch.randn(3, 6, requires_grad=True)
    ln(x).sum().backward()
    assert "NormalizeFunction" in type(ln(x).grad_fn).__name__
    ln.backend = "reference"
    assert "NormalizeFunction" not in type(ln(x).grad_fn).__name__
    assert "backend='reference'" in repr(ln)
