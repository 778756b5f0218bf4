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

import copy

import pytest
import torch
from cases import float64_twin
from oracle import assert_close, assert_grad_close
from torch.func import functional_call, grad, jvp, stack_module_state, vmap

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


#: Every fast path's node at sizes where the kernels serve it: name -> (factory, shape).
BATCHED = {
    "LayerNorm": (lambda: normkit.LayerNorm(512), (64, 512)),
    "RMSNorm": (lambda: normkit.RMSNorm(512), (200, 512)),
    "AddLayerNorm": (lambda: normkit.AddLayerNorm(512), (64, 512)),
    "LayerNorm2d": (lambda: normkit.LayerNorm2d(16), (8, 16, 40, 40)),
    "LayerNorm2d channels_last": (lambda: normkit.LayerNorm2d(16), (8, 16, 40, 40, "cl")),
    "BatchNorm2d": (lambda: normkit.BatchNorm2d(16), (8, 16, 40, 40)),
    "BatchNorm2d channels_last": (lambda: normkit.BatchNorm2d(16), (8, 16, 40, 40, "cl")),
    "BatchNorm2d eval": (lambda: normkit.BatchNorm2d(16).eval(), (8, 16, 40, 40)),
    "GroupNorm channels_last": (lambda: normkit.GroupNorm(4, 16), (8, 16, 40, 40, "cl")),
    "GroupNormAct": (lambda: normkit.GroupNormAct(4, 16, act="silu"), (8, 16, 40, 40)),
    "BatchNormAct2d": (lambda: normkit.BatchNormAct2d(16, act="silu"), (8, 16, 40, 40)),
    "InstanceNorm2d": (lambda: normkit.InstanceNorm2d(16, affine=True), (8, 16, 40, 40)),
}


@pytest.mark.parametrize("offset", [1.0, 1e4], ids=["kernels", "compensated"])
@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_gradients_equal_one_at_a_time(name, offset):
    """``torch.autograd.grad(..., is_grads_batched=True)`` (and ``jacobian(...,
    vectorize=True)``, built on it) runs the backward under torch's legacy vmap, which
    has no batching rule for the ``out=`` calls of the fast paths' backward (LayerNorm2d
    on NCHW raised). Such a backward differentiates the reference math; the input and
    parameter gradients equal the same gradients taken one grad output at a time."""
    make, shape = BATCHED[name]
    channels_last = shape[-1] == "cl"
    shape = shape[:-1] if channels_last else shape
    module = make()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 2 + offset
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    args = (x, torch.randn(shape, generator=gen)) if name == "AddLayerNorm" else (x,)
    y = module(*args)
    y = y[0] if isinstance(y, tuple) else y
    leaves = (x, *module.parameters())
    dys = torch.randn((3, *y.shape), generator=gen)
    batched = torch.autograd.grad(y, leaves, dys, retain_graph=True, is_grads_batched=True)
    assert not any(g.requires_grad for g in batched)  # (no graph kept: not create_graph)
    for i in range(3):
        one = torch.autograd.grad(y, leaves, dys[i], retain_graph=True)
        for got, want in zip(batched, one, strict=True):
            assert_grad_close(got[i], want, torch.float32, name)


FORWARD_AD = {
    **{name: (make, shape) for name, (make, shape) in BATCHED.items()},
    "RMSNorm rows node": (lambda: normkit.RMSNorm(512), (300, 512)),
    "AddRMSNorm": (lambda: normkit.AddRMSNorm(512), (64, 512)),
    "MeanOnlyBatchNorm2d": (lambda: normkit.MeanOnlyBatchNorm2d(16), (8, 16, 20, 20)),
    "BatchNormAct2d inplace": (
        lambda: normkit.BatchNormAct2d(16, act="leaky_relu", memory="inplace"), (8, 16, 20, 20)),
    "weight_norm Linear": (lambda: normkit.weight_norm(torch.nn.Linear(32, 16)), (20, 32)),
}


@pytest.mark.parametrize("name", list(FORWARD_AD))
def test_forward_mode_ad_equals_the_float64_jvp(name):
    """Plain forward-mode AD (``torch.autograd.forward_ad.dual_level``, ``make_dual``)
    needs a ``jvp`` from every autograd node it meets; the fast paths' nodes have none
    (RMSNorm from 2^16 elements, MeanOnlyBatchNorm, In-Place ABN and weight norm raised
    "You must implement the jvp function"). Inside a dual level ``backend="auto"`` takes
    the reference math, as under the torch.func transforms: the tangent equals the
    float64 ``torch.func.jvp``."""
    import torch.autograd.forward_ad as fwad

    make, shape = FORWARD_AD[name]
    channels_last = shape[-1] == "cl"
    shape = shape[:-1] if channels_last else shape
    module = make()
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=gen) * 2 + 1]
    if name.startswith("Add"):
        inputs.append(torch.randn(shape, generator=gen))
    if channels_last:
        inputs = [t.contiguous(memory_format=torch.channels_last) for t in inputs]
    tangents = [torch.randn(shape, generator=gen) for _ in inputs]
    twin = float64_twin(module)
    for layer in twin.modules():  # (torch.func refuses in-place running-statistics updates;
        if layer.training and getattr(layer, "running_mean", None) is not None:  # unread)
            for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                if hasattr(layer, buffer):
                    setattr(layer, buffer, None)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    with fwad.dual_level():
        y = first(module(*(fwad.make_dual(x, t) for x, t in zip(inputs, tangents, strict=True))))
        got = fwad.unpack_dual(y).tangent
    _, want = jvp(lambda *xs: first(twin(*xs)), tuple(t.double() for t in inputs),
                  tuple(t.double() for t in tangents))
    assert_grad_close(got.detach(), want.detach(), torch.float32, f"{name} tangent")


#: Training-mode layers that update running statistics in place.
RUNNING = {
    "BatchNorm2d": lambda: normkit.BatchNorm2d(4),
    "BatchNormAct2d": lambda: normkit.BatchNormAct2d(4, act="silu"),
    "In-Place ABN": lambda: normkit.BatchNormAct2d(4, act="leaky_relu", memory="inplace"),
    "MeanOnlyBatchNorm2d": lambda: normkit.MeanOnlyBatchNorm2d(4),
    "InstanceNorm2d": lambda: normkit.InstanceNorm2d(4, track_running_stats=True),
    "BatchRenorm2d": lambda: normkit.BatchRenorm2d(4),
}


@pytest.mark.parametrize("name", list(RUNNING))
def test_vmap_over_unbatched_running_statistics_says_how_to_remove_them(name):
    """vmap of a training layer whose running buffers are not batched cannot update them
    (torch's BatchNorm refuses too, with its own message); the error names the remedies
    -- and the one it names for layers torch.func does not patch works."""
    module = RUNNING[name]()
    xs = torch.randn(3, 6, 4, 5, 5)
    with pytest.raises(RuntimeError, match="running statistics.*replace_all_batch_norm"):
        vmap(module)(xs)
    if name in ("MeanOnlyBatchNorm2d", "InstanceNorm2d"):
        module.track_running_stats = False
        module.running_mean = module.running_var = None
        torch.testing.assert_close(vmap(module)(xs), torch.stack([module(x) for x in xs]))


@pytest.mark.parametrize("name", list(RUNNING))
def test_ensemble_training_with_stacked_buffers_equals_each_member(name):
    """Model ensembling (``stack_module_state`` + ``functional_call`` under ``vmap``) in
    training mode: each member's running statistics are its own batched buffer, updated
    as the member alone would update them. Batch Renormalization reads its step count to
    set its limits, which vmap refuses: a clear error."""
    members = [RUNNING[name]() for _ in range(3)]
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    xs = torch.randn(3, 6, 4, 5, 5) * 2 + 1

    def call(p, b, x):
        return functional_call(base, (p, b), (x,))

    if name == "BatchRenorm2d":
        with pytest.raises(RuntimeError, match="step count.*batched"):
            vmap(call)(params, buffers, xs)
        return
    got = vmap(call)(params, buffers, xs)
    want = torch.stack([m(x) for m, x in zip(members, xs, strict=True)])
    torch.testing.assert_close(got, want)
    for key, value in buffers.items():
        torch.testing.assert_close(
            value, torch.stack([dict(m.named_buffers())[key] for m in members]), msg=key)
