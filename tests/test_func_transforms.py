"""normkit's layers under ``torch.func`` transforms: ``vmap`` (ensembles, per-sample
work), ``vmap(grad(...))`` (per-sample gradients, as Opacus-style DP training computes
them) and ``jvp`` (forward-mode products), each against the plain call it stands for.

torch.nn's norms compose with these transforms; normkit's fast paths read a statistic
back to choose (``.item()``, which ``vmap`` refuses) and run autograd Functions without
vmap rules, so under a transform ``backend="auto"`` takes the reference math, as under
torch.compile (``normkit.norms._core.compiling``). BatchNorm in training with running
statistics updates them in place, which ``torch.func`` refuses for torch's BatchNorm
too (torch.func's documentation: "Patching Batch Norm"); without them it composes.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_close, assert_grad_close
from torch.func import functional_call, grad, jvp, vmap

import normkit

#: name -> (module factory, one sample's shape, whether it takes a residual)
LAYERS = {
    "LayerNorm": (lambda: normkit.LayerNorm(16), (6, 16), False),
    "RMSNorm": (lambda: normkit.RMSNorm(16), (6, 16), False),
    "AddLayerNorm": (lambda: normkit.AddLayerNorm(16), (6, 16), True),
    "AddRMSNorm": (lambda: normkit.AddRMSNorm(16), (6, 16), True),
    "LayerNorm2d": (lambda: normkit.LayerNorm2d(4), (6, 4, 5, 5), False),
    "GroupNorm": (lambda: normkit.GroupNorm(2, 4), (6, 4, 5, 5), False),
    "GroupNormAct": (lambda: normkit.GroupNormAct(2, 4, act="silu"), (6, 4, 5, 5), False),
    "InstanceNorm2d": (lambda: normkit.InstanceNorm2d(4, affine=True), (6, 4, 5, 5), False),
    "BatchNorm2d eval": (lambda: normkit.BatchNorm2d(4).eval(), (6, 4, 5, 5), False),
    "BatchNormAct2d eval": (lambda: normkit.BatchNormAct2d(4, act="silu").eval(),
                            (6, 4, 5, 5), False),
    "BatchNorm2d without running statistics": (
        lambda: normkit.BatchNorm2d(4, track_running_stats=False), (6, 4, 5, 5), False),
    "BatchNormAct2d without running statistics": (
        lambda: normkit.BatchNormAct2d(4, act="silu", track_running_stats=False),
        (6, 4, 5, 5), False),
}

DTYPES = [torch.float32, torch.float64]


def _setup(name, dtype, offset=2.0):
    make, shape, residual = LAYERS[name]
    gen = torch.Generator().manual_seed(0)
    module = make().to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    # (a large enough sample that the fast paths would serve it outside a transform)
    xs = (torch.randn((3, *shape), generator=gen, dtype=torch.float64) + offset).to(dtype)
    rs = torch.randn((3, *shape), generator=gen, dtype=torch.float64).to(dtype)
    return module, xs, (rs if residual else None)


def _call(module, x, r):
    return module(x) if r is None else module(x, r)[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(LAYERS))
def test_vmap_equals_a_loop(name, dtype):
    module, xs, rs = _setup(name, dtype)
    if rs is None:
        got = vmap(lambda x: _call(module, x, None))(xs)
    else:
        got = vmap(lambda x, r: _call(module, x, r))(xs, rs)
    want = torch.stack([_call(module, xs[i], None if rs is None else rs[i])
                        for i in range(len(xs))])
    assert_close(got, want.double(), dtype, f"{name} under vmap")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(LAYERS))
def test_per_sample_gradients(name, dtype):
    """``vmap(grad(loss))`` over samples against each sample's own backward."""
    module, xs, rs = _setup(name, dtype)
    params = {k: v.detach() for k, v in module.named_parameters()}
    if not params:
        pytest.skip("no parameters")

    def loss(p, x, r=None):
        out = functional_call(module, p, (x,) if r is None else (x, r))
        out = out if r is None else out[0]
        return out.square().sum()

    if rs is None:
        per_sample = vmap(grad(loss), in_dims=(None, 0))(params, xs)
    else:
        per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, rs)
    for i in range(len(xs)):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        value = loss(leaves, xs[i], None if rs is None else rs[i])
        want = torch.autograd.grad(value, list(leaves.values()))
        for (k, g), w in zip(per_sample.items(), want, strict=True):
            assert_grad_close(g[i], w.double(), dtype, f"{name} sample {i} d{k}")


@pytest.mark.parametrize("name", [n for n, (_, _, r) in LAYERS.items() if not r])
def test_jvp_equals_the_jacobian_product(name):
    module, xs, _ = _setup(name, torch.float64)
    x = xs[0]
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    _, got = jvp(module, (x,), (tangent,))
    jac = torch.autograd.functional.jacobian(module, x)
    want = (jac.reshape(x.numel(), x.numel()) @ tangent.reshape(-1)).reshape(x.shape)
    assert_close(got, want, torch.float64, f"{name} jvp")
