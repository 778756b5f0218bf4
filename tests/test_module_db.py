"""torch's own module test samples (common_modules.module_db) through the normkit drop-ins."""

from __future__ import annotations

import pytest
import torch

import normkit

# small inputs through normkit's fused rows node, not torch's composite (conftest.py)
pytestmark = pytest.mark.usefixtures("fused_rows_node")

common_modules = pytest.importorskip("torch.testing._internal.common_modules")

DROP_INS = {
    "BatchNorm1d": normkit.BatchNorm1d, "BatchNorm2d": normkit.BatchNorm2d,
    "BatchNorm3d": normkit.BatchNorm3d, "LayerNorm": normkit.LayerNorm,
    "RMSNorm": normkit.RMSNorm, "GroupNorm": normkit.GroupNorm,
    "InstanceNorm1d": normkit.InstanceNorm1d, "InstanceNorm2d": normkit.InstanceNorm2d,
    "InstanceNorm3d": normkit.InstanceNorm3d,
}
INFOS = [m for m in common_modules.module_db if m.module_cls.__name__ in DROP_INS]


def _clone_inputs(args, requires_grad):
    return [a.detach().clone().requires_grad_(requires_grad and a.is_floating_point())
            if isinstance(a, torch.Tensor) else a for a in args]


def test_every_core_layer_has_samples():
    assert {m.module_cls.__name__ for m in INFOS} == set(DROP_INS)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("info", INFOS, ids=lambda m: m.module_cls.__name__)
def test_module_db_samples(info, dtype, training):
    samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                      training=training)
    assert samples
    for sample in samples:
        ctor = sample.constructor_input
        torch.manual_seed(0)
        tm = info.module_cls(*ctor.args, **ctor.kwargs).to(dtype)
        nk = DROP_INS[info.module_cls.__name__](*ctor.args, **ctor.kwargs).to(dtype)
        assert isinstance(nk, info.module_cls)
        assert nk.state_dict().keys() == tm.state_dict().keys()
        with torch.no_grad():  # non-trivial affine parameters, shared
            for p in tm.parameters():
                p.uniform_(0.5, 1.5)
        nk.load_state_dict(tm.state_dict())
        tm.train(training), nk.train(training)
        args_t = _clone_inputs(sample.forward_input.args, True)
        args_n = _clone_inputs(sample.forward_input.args, True)
        yt = tm(*args_t, **sample.forward_input.kwargs)
        yn = nk(*args_n, **sample.forward_input.kwargs)
        tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=3e-5, rtol=3e-5)
        torch.testing.assert_close(yn, yt, **tol)
        grad = torch.randn(yt.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
        yt.backward(grad)
        yn.backward(grad)
        for a, b in zip(args_n, args_t, strict=True):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                torch.testing.assert_close(a.grad, b.grad, **tol)
        for (name, p), pt in zip(nk.named_parameters(), tm.parameters(), strict=True):
            torch.testing.assert_close(p.grad, pt.grad, **tol, msg=name)
        for (name, b), bt in zip(nk.named_buffers(), tm.buffers(), strict=True):
            torch.testing.assert_close(b, bt, **tol, msg=name)


@pytest.mark.parametrize("info", [m for m in INFOS if m.module_error_inputs_func],
                         ids=lambda m: m.module_cls.__name__)
def test_module_db_error_samples(info):
    errors = info.module_error_inputs_func(info, device="cpu", dtype=torch.float32,
                                           requires_grad=False, training=True)
    for err in errors:
        sample = err.module_error_input
        ctor, fwd = sample.constructor_input, sample.forward_input
        with pytest.raises(err.error_type, match=err.error_regex):
            module = DROP_INS[info.module_cls.__name__](*ctor.args, **ctor.kwargs)
            module(*fwd.args, **fwd.kwargs)
