"""torch's own test samples through the normkit drop-ins: the modules'
(``common_modules.module_db``) and the functional forms' (``common_methods_invocations.op_db``)."""

from __future__ import annotations

import pytest
import torch

import normkit
import normkit.functional as F

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


methods = pytest.importorskip("torch.testing._internal.common_methods_invocations")

FUNCTIONAL = {"nn.functional.batch_norm": F.batch_norm, "nn.functional.layer_norm": F.layer_norm,
              "nn.functional.group_norm": F.group_norm,
              "nn.functional.instance_norm": F.instance_norm,
              "nn.functional.rms_norm": F.rms_norm}
OP_INFOS = [o for o in methods.op_db if o.name in FUNCTIONAL]


def _sample_args(sample):
    """Fresh leaves of a sample's input, arguments and keyword arguments (running
    statistics are updated in place, so each side gets its own)."""
    def fresh(t):
        return t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t

    return (fresh(sample.input), [fresh(a) for a in sample.args],
            {k: fresh(v) for k, v in sample.kwargs.items()})


def _double_leaves(args):
    """A float64 copy of a sample's argument(s), leaves where the originals need grad."""
    if isinstance(args, list):
        return [_double_leaves(a) for a in args]
    if torch.is_tensor(args):
        return args.detach().double().requires_grad_(args.requires_grad)
    return args


def _is_1d_batch_norm(name, x):
    # normkit's documented difference: BatchNorm wants (N, C, *); torch's op_db also feeds
    # a 1D empty tensor, which torch returns as it is
    return name == "nn.functional.batch_norm" and x.dim() < 2


def test_every_functional_norm_has_samples():
    assert {o.name for o in OP_INFOS} == set(FUNCTIONAL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("info", OP_INFOS, ids=lambda o: f"{o.name}{o.variant_test_name}")
def test_op_db_samples(info, dtype):
    """Outputs, running statistics and every gradient on each sample: within the dtype's
    tolerance of float64, or no further from float64 than torch's own."""
    from oracle import GRAD_TOL, TOL

    count = 0
    for sample in info.sample_inputs("cpu", dtype, requires_grad=True):
        x_t, args_t, kwargs_t = _sample_args(sample)
        x_n, args_n, kwargs_n = _sample_args(sample)
        if _is_1d_batch_norm(info.name, x_n):
            with pytest.raises(ValueError, match="at least 2 dimensions"):
                FUNCTIONAL[info.name](x_n, *args_n, **kwargs_n)
            continue
        want = info.op(x_t, *args_t, **kwargs_t)
        got = FUNCTIONAL[info.name](x_n, *args_n, **kwargs_n)
        what = f"{info.name} on {tuple(x_n.shape)} {sample.kwargs}"
        assert got.dtype == want.dtype, what
        x_64, args_64, kwargs_64 = _sample_args(sample)  # (float64 leaves, the same values)
        x_64, args_64, kwargs_64 = _double_leaves(x_64), _double_leaves(args_64), {
            k: _double_leaves(v) for k, v in kwargs_64.items()}
        ref = info.op(x_64, *args_64, **kwargs_64)

        def near(ours, torchs, exact, bound):
            """``ours`` within ``bound`` of float64 or no further from it than torch (x1.5:
            a 16-bit output rounds w * x_hat + b, whose terms can be far larger than it);
            torch 2.4's bfloat16 kernels stray further than later releases'."""
            err, torch_err = (ours.double() - exact).abs(), (torchs.double() - exact).abs()
            return (err <= torch.maximum(bound, 1.5 * torch_err)) | (err.isnan()
                                                                     & torch_err.isnan())

        exact = ref.detach()
        bound = TOL[dtype]["atol"] + TOL[dtype]["rtol"] * exact.abs()
        ok = near(got.detach(), want.detach(), exact, bound)
        assert bool(ok.all()), (f"{what}: error "
                                f"{float((got.detach().double() - exact).abs().max()):.3e} "
                                f"from float64")
        for key, value in kwargs_n.items():
            if torch.is_tensor(value):  # running statistics
                exact_stat = kwargs_64[key].detach()
                stat_bound = TOL[dtype]["atol"] + TOL[dtype]["rtol"] * exact_stat.abs()
                assert bool(near(value, kwargs_t[key], exact_stat, stat_bound).all()), (
                    f"{what}: {key} {value.tolist()} against float64 {exact_stat.tolist()} "
                    f"(torch: {kwargs_t[key].tolist()})")
        leaves_t = [t for t in (x_t, *args_t, *kwargs_t.values())
                    if torch.is_tensor(t) and t.requires_grad]
        leaves_n = [t for t in (x_n, *args_n, *kwargs_n.values())
                    if torch.is_tensor(t) and t.requires_grad]
        leaves_64 = [t for t in (x_64, *args_64, *kwargs_64.values())
                     if torch.is_tensor(t) and t.requires_grad]
        if want.requires_grad:
            dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(count),
                             dtype=torch.float64).to(dtype)
            grads_t = torch.autograd.grad(want, leaves_t, dy, allow_unused=True)
            grads_n = torch.autograd.grad(got, leaves_n, dy, allow_unused=True)
            grads_64 = torch.autograd.grad(ref, leaves_64, dy.double(), allow_unused=True)
            for g_n, g_t, g_64 in zip(grads_n, grads_t, grads_64, strict=True):
                assert (g_n is None) == (g_t is None), what
                if g_t is not None and g_t.numel():
                    scale = max(1.0, float(g_64.abs().max()))
                    # (relative to the largest reference value: GRAD_TOL's convention)
                    ok = near(g_n, g_t, g_64, torch.full_like(g_64, 4 * GRAD_TOL[dtype] * scale))
                    assert bool(ok.all()), (f"{what}: grad error "
                                            f"{float((g_n.double() - g_64).abs().max())} from "
                                            f"float64 (torch: "
                                            f"{float((g_t.double() - g_64).abs().max())})")
        count += 1
    assert count


@pytest.mark.parametrize("info", [o for o in OP_INFOS if o.error_inputs_func],
                         ids=lambda o: o.name)
def test_op_db_error_samples(info):
    """Where torch raises, normkit raises too: a ValueError naming what was expected
    (torch's RuntimeError where normkit leaves the check to torch)."""
    for err in info.error_inputs("cpu"):
        sample = err.sample_input
        with pytest.raises((ValueError, err.error_type)):
            FUNCTIONAL[info.name](sample.input, *sample.args, **sample.kwargs)
