"""PowerNorm (Shen et al. 2020, as the authors' MaskPowerNorm computes it)."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from cases import OLD_JAGGED, TORCH_RELEASE
from oracle import assert_close, assert_grad_close
from torch.utils.checkpoint import checkpoint

import normkit
from normkit import PowerNorm


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Oracle:
    """PowerNorm's training steps in float64 numpy, written out from the algorithm:
    group scaling, the warm-up, the running quadratic mean, the approximate backward
    (its running term averaged over the counted tokens) and the group scaling's exact
    derivative."""

    def __init__(self, c, *, eps=1e-5, alpha_fwd=0.9, alpha_bkw=0.9, warmup_iters=2,
                 group_num=1, weight=None, bias=None):
        self.c, self.eps, self.af, self.ab = c, eps, alpha_fwd, alpha_bkw
        self.warmup, self.groups = warmup_iters, group_num
        self.w = np.ones(c) if weight is None else weight
        self.b = np.zeros(c) if bias is None else bias
        self.phi, self.ema, self.iters = np.ones(c), np.zeros(c), 0

    def _scale(self, x):
        if self.groups is None:
            return x, None
        g = x.reshape(*x.shape[:-1], self.groups, self.c // self.groups)
        r = np.sqrt((g * g).mean(-1, keepdims=True) + 1e-5)
        return (g / r).reshape(x.shape), r

    def eval(self, x):
        xs, _ = self._scale(x)
        return xs / np.sqrt(self.phi + self.eps) * self.w + self.b

    def step(self, x, dy, pad=None):
        c = self.c
        xs, r = self._scale(x)
        keep = np.ones(x.shape[:-1], bool) if pad is None else ~pad
        rows, kept = xs.reshape(-1, c), keep.reshape(-1)
        count = kept.sum()
        psi2 = (rows[kept] ** 2).mean(0) if count else self.phi.copy()
        t = self.iters + 1
        z = xs / np.sqrt((psi2 if t <= self.warmup else self.phi) + self.eps)
        y = z * self.w + self.b
        phi = self.phi * (t - 1) / t + psi2 / t if t < self.warmup else self.phi
        self.phi = self.af * phi + (1 - self.af) * psi2
        self.iters = t
        approx = dy * self.w - (1 - self.ab) * self.ema * z
        self.ema = self.ema + (approx * z).reshape(-1, c)[kept].sum(0) / max(count, 1)
        dxs = approx / np.sqrt(psi2 + self.eps)
        if r is None:
            dx = dxs
        else:
            shape = (*x.shape[:-1], self.groups, c // self.groups)
            gs, ss = dxs.reshape(shape), xs.reshape(shape)
            dx = ((gs - ss * (gs * ss).mean(-1, keepdims=True)) / r).reshape(x.shape)
        dims = tuple(range(x.ndim - 1))
        return y, dx, (dy * z).sum(dims), dy.sum(dims)


def _np(t):
    return t.detach().double().numpy()


def _check_buffers(layer, oracle, dtype):
    assert int(layer.num_batches_tracked) == oracle.iters
    assert_close(layer.running_phi, torch.from_numpy(oracle.phi), dtype, "running_phi")
    assert_grad_close(layer.ema_gz, torch.from_numpy(oracle.ema), dtype, "ema_gz")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("group_num", [None, 1, 2])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_training_steps_match_the_float64_oracle(dtype, group_num, padded):
    b, t, c = 3, 5, 8
    layer = PowerNorm(c, warmup_iters=2, group_num=group_num, alpha_fwd=0.8,
                      alpha_bkw=0.7).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(c, generator=_gen(0)) + 0.5)
        layer.bias.copy_(torch.randn(c, generator=_gen(1)))
    oracle = Oracle(c, warmup_iters=2, group_num=group_num, alpha_fwd=0.8, alpha_bkw=0.7,
                    weight=_np(layer.weight), bias=_np(layer.bias))
    for step in range(5):  # steps 1-2 the warm-up, 3-5 the running statistic
        x = (torch.randn(b, t, c, generator=_gen(10 + step), dtype=torch.float64) * 3
             + 2).to(dtype).requires_grad_()
        dy = torch.randn(b, t, c, generator=_gen(20 + step), dtype=torch.float64).to(dtype)
        pad = None
        if padded:
            pad = torch.zeros(b, t, dtype=torch.bool)
            pad[0, 3:] = True
            pad[2, 1 + step % 3:] = True
        layer.weight.grad = layer.bias.grad = None
        y = layer(x, padding_mask=pad)
        y.backward(dy)
        ry, rdx, rdw, rdb = oracle.step(_np(x), _np(dy), None if pad is None else pad.numpy())
        assert y.dtype == dtype
        assert_close(y, torch.from_numpy(ry), dtype, f"y, step {step + 1}")
        assert_grad_close(x.grad, torch.from_numpy(rdx), dtype, f"dx, step {step + 1}")
        assert_grad_close(layer.weight.grad, torch.from_numpy(rdw), dtype, "dweight")
        assert_grad_close(layer.bias.grad, torch.from_numpy(rdb), dtype, "dbias")
        _check_buffers(layer, oracle, dtype)
    layer.eval()
    x = torch.randn(2, c, generator=_gen(30), dtype=torch.float64).to(dtype)
    assert_close(layer(x), torch.from_numpy(oracle.eval(_np(x))), dtype, "eval")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_input_computes_in_float32(dtype):
    c = 16
    layer = PowerNorm(c, warmup_iters=1, group_num=4)
    oracle = Oracle(c, warmup_iters=1, group_num=4)
    for step in range(3):
        x = (torch.randn(4, 6, c, generator=_gen(step)) * 2 + 1).to(dtype).requires_grad_()
        dy = torch.randn(4, 6, c, generator=_gen(9 + step)).to(dtype)
        y = layer(x)
        y.backward(dy)
        ry, rdx, _, _ = oracle.step(_np(x), _np(dy))
        assert y.dtype == x.grad.dtype == dtype
        assert_close(y, torch.from_numpy(ry), dtype)
        assert_grad_close(x.grad, torch.from_numpy(rdx), dtype, "dx")
    assert layer.running_phi.dtype == torch.float32
    _check_buffers(layer, oracle, torch.float32)


def test_padding_tokens_stay_out_of_the_statistics():
    """The kept tokens of a padded batch are normalized, and their gradients computed,
    exactly as the same tokens alone (as a (K, C) batch); padding values change
    nothing but their own outputs."""
    torch.manual_seed(0)
    c = 6
    x = torch.randn(3, 4, c, dtype=torch.float64) * 2
    pad = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    garbage = x.clone()
    garbage[pad] = 1e3
    nonfinite = x.clone()  # (e.g. attention over a row of padding alone)
    nonfinite[pad] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"),
                                   1.0, float("nan")], dtype=torch.float64)[:int(pad.sum())
                                                                            ].view(-1, 1)
    dy = torch.randn(3, 4, c, dtype=torch.float64)
    dy[pad] = 0
    results = []
    for inp, mask in ((x, pad), (garbage, pad), (nonfinite, pad), (x[~pad], None)):
        layer = PowerNorm(c, warmup_iters=1, group_num=2).double()
        for _ in range(3):
            leaf = inp.clone().requires_grad_()
            y = layer(leaf, padding_mask=mask)
            y.backward(dy if mask is not None else dy[~pad])
        kept = (y, leaf.grad) if mask is None else (y[~pad], leaf.grad[~pad])
        results.append((*kept, layer.running_phi.clone(), layer.ema_gz.clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_batch_of_padding_only_changes_nothing():
    layer = PowerNorm(4, warmup_iters=0).double()
    with torch.no_grad():
        layer.running_phi.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        layer.ema_gz.copy_(torch.tensor([0.5, -0.5, 0.1, 0.0]))
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y = layer(x, padding_mask=torch.ones(2, 3, dtype=torch.bool))
    y.sum().backward()
    scaled = x / (x * x).mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(y, scaled / (layer.running_phi + 1e-5).sqrt())
    torch.testing.assert_close(layer.running_phi, torch.tensor([1.0, 2.0, 3.0, 4.0],
                                                                dtype=torch.float64))
    torch.testing.assert_close(layer.ema_gz, torch.tensor([0.5, -0.5, 0.1, 0.0],
                                                           dtype=torch.float64))
    assert int(layer.num_batches_tracked) == 1


def test_an_empty_batch_gives_an_empty_output_and_counts_nothing():
    layer = PowerNorm(4)
    x = torch.randn(0, 5, 4, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 5, 4) and x.grad.shape == x.shape
    assert int(layer.num_batches_tracked) == 0
    assert torch.equal(layer.running_phi, torch.ones(4))


def test_eval_normalizes_by_the_running_statistic_and_is_an_ordinary_derivative():
    layer = PowerNorm(4, group_num=None).double().eval()
    with torch.no_grad():
        layer.running_phi.copy_(torch.tensor([4.0, 1.0, 0.25, 9.0]))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(layer(x), x / (layer.running_phi + 1e-5).sqrt())
    assert torch.autograd.gradcheck(layer, (x,))
    assert int(layer.num_batches_tracked) == 0


def test_the_approximate_backward_is_not_differentiated_twice():
    layer = PowerNorm(4)
    x = torch.randn(3, 4, requires_grad=True)
    (dx,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dx.sum().backward()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_matches_the_plain_run(reentrant):
    """The recomputation normalizes as the first forward did (across the warm-up's end)
    and updates nothing; ema_gz is updated once per backward."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), PowerNorm(8, warmup_iters=2),
                                torch.nn.GELU(), torch.nn.Linear(8, 8))
    ckpt = copy.deepcopy(plain)
    for step in range(4):
        x = torch.randn(4, 3, 8, generator=_gen(step))
        plain(x).square().sum().backward()
        checkpoint(ckpt, x.clone().requires_grad_(), use_reentrant=reentrant
                   ).square().sum().backward()
        for (name, a), b in zip(plain.named_buffers(), ckpt.buffers(), strict=True):
            assert torch.equal(a, b), f"{name} after step {step + 1}"
        for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), f"{name}.grad after step {step + 1}"
    assert int(ckpt[1].num_batches_tracked) == 4


def test_the_authors_state_dict_loads():
    """MaskPowerNorm's buffers: ``iters`` of shape (1,), running_phi and ema_gz of shape
    (1, C, 1, 1)."""
    c = 4
    theirs = {"weight": torch.rand(c), "bias": torch.randn(c),
              "running_phi": torch.rand(1, c, 1, 1) + 0.5,
              "ema_gz": torch.randn(1, c, 1, 1), "iters": torch.tensor([7])}
    layer = PowerNorm(c)
    layer.load_state_dict(theirs)
    assert int(layer.num_batches_tracked) == 7
    assert torch.equal(layer.running_phi, theirs["running_phi"].view(c))
    assert torch.equal(layer.ema_gz, theirs["ema_gz"].view(c))
    assert theirs["iters"].shape == (1,)  # (the caller's dict is not changed)
    again = PowerNorm(c)
    again.load_state_dict(pickle.loads(pickle.dumps(layer.state_dict())))
    for name, value in layer.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_a_module_cast_to_16_bits_keeps_working():
    """bfloat16 parameters and buffers: the same steps as a float32 module on the same
    (bfloat16) inputs, to bfloat16's tolerance (its buffers round at every update)."""
    layer = PowerNorm(8, warmup_iters=1).to(torch.bfloat16)
    twin = PowerNorm(8, warmup_iters=1)
    assert layer.running_phi.dtype == torch.bfloat16
    for step in range(3):
        x = (torch.randn(4, 8, generator=_gen(step)) * 2).to(torch.bfloat16)
        xa, xb = x.clone().requires_grad_(), x.float().requires_grad_()
        ya, yb = layer(xa), twin(xb)
        assert ya.dtype == torch.bfloat16 and ya.grad_fn is not None
        assert_close(ya, yb.detach(), torch.bfloat16, f"output, step {step + 1}")
        ya.float().square().sum().backward()
        yb.square().sum().backward()
        assert_grad_close(xa.grad, xb.grad, torch.bfloat16, f"dx, step {step + 1}")
    assert_close(layer.running_phi, twin.running_phi, torch.bfloat16, "running_phi")
    assert_grad_close(layer.ema_gz, twin.ema_gz, torch.bfloat16, "ema_gz")


def test_fx_traces_it_as_a_leaf():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), PowerNorm(4))
    traced = torch.fx.symbolic_trace(model)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["0", "1"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(traced.eval()(x), model.eval()(x))


def test_repr_and_defaults_follow_the_authors():
    layer = PowerNorm(8)
    assert repr(layer) == ("PowerNorm(8, eps=1e-05, alpha_fwd=0.9, alpha_bkw=0.9, "
                           "affine=True, warmup_iters=10000, group_num=1)")
    assert PowerNorm(8, affine=False).weight is None
    assert normkit.get_norm_layer("powernorm", 8).num_features == 8


@pytest.mark.parametrize("make, match", [
    (lambda: PowerNorm(0), "positive int num_features"),
    (lambda: PowerNorm(8, group_num=3), "divides num_features=8, got 3"),
    (lambda: PowerNorm(8, alpha_fwd=1.5), r"alpha_fwd in \[0, 1\]"),
    (lambda: PowerNorm(8, alpha_bkw=-0.1), r"alpha_bkw in \[0, 1\]"),
    (lambda: PowerNorm(8, warmup_iters=-1), "warmup_iters to be an int >= 0"),
    (lambda: PowerNorm(8, eps=-1.0), "eps > 0"),
    (lambda: PowerNorm(8, eps=0.0), r"eps > 0 \(a channel whose tokens are all 0"),
])
def test_bad_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_inputs_are_named():
    layer = PowerNorm(8)
    with pytest.raises(ValueError, match=r"shape \(\*, 8\) \(channels last\), got input of "
                                         r"shape \(2, 8, 5\)"):
        layer(torch.randn(2, 8, 5))
    with pytest.raises(ValueError, match="floating-point"):
        layer(torch.ones(2, 8, dtype=torch.long))
    x = torch.randn(5, 3, 8)  # (T, B, C)
    with pytest.raises(TypeError, match="bool tensor .* got dtype torch.float32"):
        layer(x, padding_mask=torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"shape \(5, 3\) .* got \(3, 5\) -- a \(B, T\) mask "
                                         r"for a \(T, B, C\) input: pass padding_mask.t\(\)"):
        layer(x, padding_mask=torch.zeros(3, 5, dtype=torch.bool))
    assert int(layer.num_batches_tracked) == 0


def test_column_dot_sums_block_by_block():
    from normkit.kernels.channels import COLUMN_BLOCK_BYTES
    from normkit.norms.power import column_dot

    c = 200
    n = 2 * (COLUMN_BLOCK_BYTES // (c * 8)) + 7  # two whole float64 blocks and a partial
    a = torch.randn(n, c, generator=_gen(0), dtype=torch.float64)
    b = torch.randn(n, c, generator=_gen(1), dtype=torch.float64)
    keep = (torch.rand(n, 1, generator=_gen(2)) > 0.3).double()
    torch.testing.assert_close(column_dot(a, b), (a * b).sum(0))
    torch.testing.assert_close(column_dot(a, b, keep), (a * b * keep).sum(0))
    assert column_dot(a[:0], b[:0]).tolist() == [0.0] * c


def test_a_batch_of_many_blocks_matches_the_oracle():
    c = 96
    layer = PowerNorm(c, warmup_iters=1, group_num=4).double()
    oracle = Oracle(c, warmup_iters=1, group_num=4)
    for step in range(2):
        x = torch.randn(9, 700, c, generator=_gen(step), dtype=torch.float64).requires_grad_()
        dy = torch.randn(9, 700, c, generator=_gen(5 + step), dtype=torch.float64)
        pad = torch.rand(9, 700, generator=_gen(7 + step)) > 0.8
        y = layer(x, padding_mask=pad)
        y.backward(dy)
        ry, rdx, _, _ = oracle.step(_np(x), _np(dy), pad.numpy())
        assert_close(y, torch.from_numpy(ry), torch.float64)
        assert_grad_close(x.grad, torch.from_numpy(rdx), torch.float64, "dx")
        _check_buffers(layer, oracle, torch.float64)


def test_column_dot_gives_both_sums_from_one_pass():
    from normkit.kernels.channels import COLUMN_BLOCK_BYTES
    from normkit.norms.power import column_dot

    c = 64
    n = COLUMN_BLOCK_BYTES // (c * 8) + 3
    a = torch.randn(n, c, generator=_gen(3), dtype=torch.float64)
    b = torch.randn(n, c, generator=_gen(4), dtype=torch.float64)
    keep = (torch.rand(n, 1, generator=_gen(5)) > 0.5).double()
    weighted, plain = column_dot(a, b, keep, total=True)
    torch.testing.assert_close(weighted, (a * b * keep).sum(0))
    torch.testing.assert_close(plain, (a * b).sum(0))
    weighted, plain = column_dot(a, b, None, total=True)
    torch.testing.assert_close(weighted, plain)
    torch.testing.assert_close(plain, (a * b).sum(0))


def test_torch_func_transforms_take_eval_mode_and_refuse_training_clearly():
    import torch.autograd.forward_ad as fwad
    from torch.func import grad, vmap

    layer = PowerNorm(4, group_num=2)
    with torch.no_grad():
        layer.running_phi.copy_(torch.tensor([0.5, 1.0, 2.0, 4.0]))
    xs = torch.randn(3, 5, 4, generator=_gen(0))
    for run in (lambda: vmap(layer)(xs), lambda: grad(lambda x: layer(x).sum())(xs)):
        with pytest.raises(RuntimeError, match="training mode cannot run under a torch.func "
                                               "transform .* eval mode"):
            run()
    with fwad.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        layer(fwad.make_dual(xs, torch.ones_like(xs)))
    assert int(layer.num_batches_tracked) == 0
    layer.eval()
    torch.testing.assert_close(vmap(layer)(xs), torch.stack([layer(x) for x in xs]))
    leaf = xs.clone().requires_grad_()
    layer(leaf).sum().backward()
    torch.testing.assert_close(grad(lambda x: layer(x).sum())(xs), leaf.grad)


class _NormsCalledPlainly(torch.nn.Module):
    """A model that calls its norms as ``norm(x)`` (torch's and Hugging Face's layers),
    or, with ``explicit``, passes them the mask."""

    def __init__(self):
        super().__init__()
        self.a, self.b = PowerNorm(6, warmup_iters=1), PowerNorm(6, warmup_iters=1)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x, mask=None):
        h = self.a(x) if mask is None else self.a(x, padding_mask=mask)
        h = self.lin(h)
        return self.b(h) if mask is None else self.b(h, padding_mask=mask)


def test_the_padding_mask_context_reaches_norms_called_without_one():
    torch.manual_seed(0)
    plain = _NormsCalledPlainly()
    explicit = copy.deepcopy(plain)
    pad = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    for step in range(3):
        x = torch.randn(3, 4, 6, generator=_gen(step)) * 2
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with normkit.padding_mask(pad):
            ya = plain(xa)
        yb = explicit(xb, pad)
        assert torch.equal(ya, yb)
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
    for (name, a), b in zip(plain.named_buffers(), explicit.buffers(), strict=True):
        assert torch.equal(a, b), name
    unmasked = copy.deepcopy(explicit)
    x = torch.randn(3, 4, 6, generator=_gen(9))
    unmasked(x), explicit(x, pad)
    assert not torch.equal(unmasked.a.running_phi, explicit.a.running_phi)  # (it matters)


def test_the_padding_mask_context_nests_restores_and_yields_to_an_argument():
    layer = PowerNorm(4, warmup_iters=5)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    pad[0, 1:] = True
    x = torch.randn(2, 3, 4, generator=_gen(0))
    want = copy.deepcopy(layer)(x, padding_mask=pad)
    nopad = copy.deepcopy(layer)(x)
    assert not torch.equal(want, nopad)  # (in the warm-up the mask changes the output)
    with normkit.padding_mask(pad):
        torch.testing.assert_close(copy.deepcopy(layer)(x), want)
        with normkit.padding_mask(None):  # off inside
            torch.testing.assert_close(copy.deepcopy(layer)(x), nopad)
        torch.testing.assert_close(copy.deepcopy(layer)(x), want)
        other = torch.zeros(2, 3, dtype=torch.bool)  # an explicit argument wins
        torch.testing.assert_close(copy.deepcopy(layer)(x, padding_mask=other), nopad)
    with pytest.raises(RuntimeError, match="boom"), normkit.padding_mask(pad):
        raise RuntimeError("boom")
    torch.testing.assert_close(copy.deepcopy(layer)(x), nopad)  # (restored: no mask)


def test_the_padding_mask_context_names_a_layer_it_does_not_fit():
    pad = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="bool tensor .* attention_mask == 0"):
        with normkit.padding_mask(torch.ones(2, 3)):
            pass
    with normkit.padding_mask(pad), pytest.raises(
            ValueError, match=r"shape \(2\) .* got \(2, 3\) \(the mask of "
                              r"normkit.padding_mask\(...\), which every PowerNorm"):
        PowerNorm(4)(torch.randn(2, 4))  # (a pooled (B, C) input)


def test_the_padding_mask_context_under_torch_compile():
    torch._dynamo.reset()
    layer = PowerNorm(4, warmup_iters=1)
    twin = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for step, cut in enumerate((1, 2, None, 3)):
        x = torch.randn(2, 4, 4, generator=_gen(step))
        pad = torch.zeros(2, 4, dtype=torch.bool)
        if cut is not None:
            pad[0, cut:] = True
        with normkit.padding_mask(None if cut is None else pad):
            got = compiled(x)
        torch.testing.assert_close(got, twin(x, padding_mask=None if cut is None else pad))
    torch.testing.assert_close(layer.running_phi, twin.running_phi)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointing_recomputes_with_the_context_mask_of_the_first_forward(reentrant):
    """The backward (and so the recomputation) runs after the ``with`` block."""
    torch.manual_seed(0)
    plain = _NormsCalledPlainly()
    ckpt = copy.deepcopy(plain)
    pad = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    for step in range(3):  # (warm-up, then the running statistic)
        x = torch.randn(3, 4, 6, generator=_gen(step)) * 2
        plain(x, pad).square().sum().backward()
        with normkit.padding_mask(pad):
            y = checkpoint(ckpt, x.clone().requires_grad_(), use_reentrant=reentrant)
        y.square().sum().backward()
        for (name, a), b in zip(plain.named_buffers(), ckpt.buffers(), strict=True):
            assert torch.equal(a, b), f"{name} after step {step + 1}"
        for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), f"{name}.grad after step {step + 1}"


def test_jagged_sequences_count_every_token_and_nothing_else():
    """A jagged nested batch packs the real tokens of every sequence in ``values()``: the
    statistics are the oracle's over those tokens (no padding to mask), steps across
    the warm-up; gradients reach each sequence."""
    c, lengths = 8, (3, 1, 6)
    layer = PowerNorm(c, warmup_iters=2, alpha_fwd=0.8, alpha_bkw=0.7).double()
    oracle = Oracle(c, warmup_iters=2, alpha_fwd=0.8, alpha_bkw=0.7, group_num=1)
    for step in range(4):
        seqs = [torch.randn(n, c, generator=_gen(40 + 3 * step + i), dtype=torch.float64) * 2
                + 1 for i, n in enumerate(lengths)]
        x = torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=True)
        dy = torch.randn(sum(lengths), c, generator=_gen(60 + step), dtype=torch.float64)
        with normkit.padding_mask(torch.ones(5, 5, dtype=torch.bool)):  # (not for nested)
            y = layer(x)
        assert y.is_nested and y.shape == x.shape
        y.values().backward(dy)
        ry, rdx, _, _ = oracle.step(_np(torch.cat(seqs)), _np(dy))
        assert_close(y.values(), torch.from_numpy(ry), torch.float64, f"y, step {step + 1}")
        assert_grad_close(torch.cat(x.grad.unbind()), torch.from_numpy(rdx), torch.float64,
                          f"dx, step {step + 1}")
        _check_buffers(layer, oracle, torch.float64)


@OLD_JAGGED
def test_narrowed_sequences_leave_the_rows_between_them_out():
    """``torch.nested.narrow``'s values hold the whole padded batch: the rows outside the
    sequences (here NaN) must not reach the statistics."""
    base = torch.randn(3, 6, 4, generator=_gen(70), dtype=torch.float64)
    base[0, 4:] = float("nan")
    base[2, :2] = float("nan")
    starts, lengths = torch.tensor([0, 1, 2]), torch.tensor([4, 3, 4])
    narrowed = torch.nested.narrow(base, 1, starts, lengths, layout=torch.jagged)
    packed = torch.nested.nested_tensor([base[i, s:s + n] for i, (s, n) in enumerate(
        zip(starts.tolist(), lengths.tolist(), strict=True))], layout=torch.jagged)
    a, b = PowerNorm(4).double(), PowerNorm(4).double()
    ya, yb = a(narrowed), b(packed)
    for got, want in zip(ya.unbind(), yb.unbind(), strict=True):
        assert_close(got, want, torch.float64)
    assert torch.isfinite(a.running_phi).all()
    assert_close(a.running_phi, b.running_phi, torch.float64, "running_phi")
    for y in (ya, yb):
        sum((t * torch.arange(t.numel()).view(t.shape)).sum() for t in y.unbind()).backward()
    for name in ("weight", "bias"):  # (sums over every position: the rows between too)
        grad = getattr(a, name).grad
        assert torch.isfinite(grad).all(), name
        assert_grad_close(grad, getattr(b, name).grad, torch.float64, name)
    assert_close(a.ema_gz, b.ema_gz, torch.float64, "ema_gz")


def test_nested_input_errors():
    seqs = [torch.randn(2, 4), torch.randn(3, 4)]
    layer = PowerNorm(4)
    jagged = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    with pytest.raises(ValueError, match="no padding_mask with a nested input"):
        layer(jagged, torch.zeros(2, 3, dtype=torch.bool))
    with warnings.catch_warnings():  # (torch, once per process: "a prototype")
        warnings.simplefilter("ignore", UserWarning)
        strided = torch.nested.nested_tensor(seqs)
    with pytest.raises(ValueError, match="got a strided nested tensor of 2 components"):
        layer(strided)
    if TORCH_RELEASE < (2, 6):
        return  # (torch 2.4-2.5 cannot build the tensor below: OLD_JAGGED)
    channels_first = torch.nested.nested_tensor([s.t() for s in seqs], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"shape \(\*, 4\).*got a jagged nested tensor of "
                                         r"shape \(2, 4, j\d+\)"):
        layer(channels_first)


def test_the_training_output_is_a_tensor_of_its_own_not_a_view():
    """As torch.nn's norms return: FSDP2 warns for a sharded module whose output is a view
    (an in-place op on it would skip its pre-backward hook)."""
    layer = PowerNorm(6)
    for x in (torch.randn(3, 4, 6), torch.randn(5, 6), torch.randn(2, 3, 9)[..., :6]):
        y = layer.train()(x.requires_grad_())
        assert not y._is_view() and y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape
