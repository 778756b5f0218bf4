"""Nested tensors (``torch.nested``) through the per-token norms, and clear errors from
the others.

The oracle: every sequence normalized on its own, as a dense float64 tensor
(``oracle.normalize64``), its gradients by float64 autograd through that formula; and
torch's own LayerNorm/RMSNorm on the same nested tensor where torch takes it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from cases import OLD_JAGGED, TORCH_RELEASE
from oracle import assert_close, assert_grad_close, normalize64
from torch import nn

import normkit
from normkit import functional as NF
from normkit.norms._nested import padding_of_values

C = 8
LENGTHS = (3, 1, 6)


def _seqs(dtype=torch.float32, c=C, seed=0, lengths=LENGTHS, extra=()):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *extra, c, generator=g, dtype=torch.float64) * 2 + 3).to(dtype)
            for n in lengths]


def _nested(seqs, layout):
    with warnings.catch_warnings():  # (torch: "the strided layout is a prototype")
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(seqs, layout=layout, requires_grad=True)


def _weighted_sum(y, weights):
    """A loss that weights every output value differently (a plain sum's gradient
    through a norm is zero)."""
    if y.layout == torch.jagged and y.is_contiguous():
        # (through the values: torch 2.4's unbind of a jagged tensor has a broken backward)
        return (y.values() * torch.cat(weights).to(y.dtype)).sum()
    return sum((t * w.to(t.dtype)).sum() for t, w in zip(y.unbind(), weights, strict=True))


def _grad_weights(seqs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.shape, generator=g, dtype=torch.float64) for s in seqs]


def _oracle(seqs, weights, weight, bias, eps, center):
    """Per sequence, float64: outputs, input gradients, weight and bias gradients."""
    w = None if weight is None else weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    xs = [s.detach().double().requires_grad_() for s in seqs]
    ys = [normalize64(x, (-1,), w, b, eps, center) for x in xs]
    sum((y * gw).sum() for y, gw in zip(ys, weights, strict=True)).backward()
    return ys, [x.grad for x in xs], w, b


LAYERS = {
    "LayerNorm": (lambda: normkit.LayerNorm(C), True, True),
    "LayerNorm-no-affine": (lambda: normkit.LayerNorm(C, elementwise_affine=False), True,
                            False),
    "RMSNorm": (lambda: normkit.RMSNorm(C, eps=1e-6), False, True),
    "RMSNorm-no-weight": (lambda: normkit.RMSNorm(C, eps=1e-6, elementwise_affine=False),
                          False, False),
}


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(LAYERS))
def test_per_token_norms_of_nested_sequences_match_each_sequence_alone(name, dtype, layout):
    make, center, affine = LAYERS[name]
    layer = make().to(dtype)
    if affine:
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            layer.weight.copy_(torch.rand(C, generator=g) + 0.5)
            if center:
                layer.bias.copy_(torch.randn(C, generator=g))
    seqs = _seqs(dtype)
    x = _nested(seqs, layout)
    y = layer(x)
    assert y.is_nested and y.layout == layout and y.dtype == dtype
    if layout == torch.jagged:
        assert y.shape == x.shape  # the same ragged size: x + y works
        assert (x + y).shape == x.shape
    weights = _grad_weights(seqs)
    _weighted_sum(y, weights).backward()
    ys, dxs, w, b = _oracle(seqs, weights, layer.weight, getattr(layer, "bias", None),
                            layer.eps, center)
    for i, (got, want) in enumerate(zip(y.unbind(), ys, strict=True)):
        assert_close(got, want, dtype, f"sequence {i}")
    for i, (got, want) in enumerate(zip(x.grad.unbind(), dxs, strict=True)):
        assert_grad_close(got, want, dtype, f"d sequence {i}")
    if affine:
        assert_grad_close(layer.weight.grad, w.grad, dtype, "dweight")
        if center:
            assert_grad_close(layer.bias.grad, b.grad, dtype, "dbias")


@pytest.mark.parametrize("name", ["layer_norm", pytest.param("rms_norm", marks=OLD_JAGGED)])
def test_jagged_results_equal_torchs_own_nested_norms(name):
    seqs = _seqs(torch.float32, seed=3)
    weight = torch.rand(C, generator=torch.Generator().manual_seed(4)) + 0.5
    x = _nested(seqs, torch.jagged)
    if name == "layer_norm":
        ours, theirs = NF.layer_norm(x, C, weight, None), nn.functional.layer_norm(
            x, (C,), weight, None)
    else:
        ours, theirs = NF.rms_norm(x, C, weight, 1e-6), nn.functional.rms_norm(
            x, (C,), weight, 1e-6)
    assert ours.shape == theirs.shape
    assert_close(ours.values(), theirs.values(), torch.float32, name)


def test_a_transposed_jagged_tensor_normalizes_its_last_dim():
    """(B, H, j, D), the ragged dim second: the values hold (H, tokens, D)."""
    seqs = _seqs(torch.float64, extra=(2,), seed=6)  # each (n, 2, C)
    x = torch.nested.nested_tensor(seqs, layout=torch.jagged).transpose(1, 2)
    assert x._ragged_idx == 2
    y = normkit.LayerNorm(C)(x)
    assert y.shape == x.shape
    for got, s in zip(y.unbind(), seqs, strict=True):
        assert_close(got, normalize64(s.transpose(0, 1), (-1,)), torch.float64)


def test_narrowed_sequences_keep_their_lengths():
    """``torch.nested.narrow`` views parts of a padded batch: its values hold the rows
    between the sequences too, which a per-token norm normalizes (harmlessly) and a
    batch statistic must not count (PowerNorm, below)."""
    base = torch.randn(3, 6, C, dtype=torch.float64)
    base[1, 0] = float("nan")  # a row outside every sequence
    x = torch.nested.narrow(base, 1, torch.tensor([0, 1, 2]), torch.tensor([3, 4, 2]),
                            layout=torch.jagged)
    y = normkit.RMSNorm(C, eps=1e-6)(x)
    assert torch.equal(y.lengths(), x.lengths())
    for got, (i, start, n) in zip(y.unbind(), [(0, 0, 3), (1, 1, 4), (2, 2, 2)], strict=True):
        assert_close(got, normalize64(base[i, start:start + n], (-1,), eps=1e-6,
                                      center=False), torch.float64)
    pad = padding_of_values(x)
    assert pad.tolist() == [False, False, False, True, True, True,
                            True, False, False, False, False, True,
                            True, True, False, False, True, True]


@pytest.mark.parametrize("name", ["AddLayerNorm", "AddRMSNorm"])
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_residual_add_norms_take_nested_x_and_residual(name, layout):
    center = name == "AddLayerNorm"
    layer = getattr(normkit, name)(C).double()
    xs, rs = _seqs(torch.float64, seed=7), _seqs(torch.float64, seed=8)
    x = _nested(xs, layout)
    if layout == torch.jagged:  # (a residual stream shares x's offsets, its ragged size)
        packed = torch.cat(rs).requires_grad_()
        residual = torch.nested.nested_tensor_from_jagged(packed, x.offsets())
    else:
        residual = _nested(rs, layout)
    normed, new_residual = layer(x, residual)
    assert normed.is_nested and new_residual.is_nested
    sums = [a + b for a, b in zip(xs, rs, strict=True)]
    for got, s in zip(new_residual.unbind(), sums, strict=True):
        assert torch.equal(got, s)
    weights = _grad_weights(sums)
    (_weighted_sum(normed, weights) + _weighted_sum(new_residual, weights)).backward()
    ys, dss, *_ = _oracle(sums, weights, layer.weight, getattr(layer, "bias", None),
                          layer.eps if layer.eps is not None else torch.finfo(
                              torch.float64).eps, center)
    for got, want in zip(normed.unbind(), ys, strict=True):
        assert_close(got, want, torch.float64)
    dresidual = (residual.grad.unbind() if layout == torch.strided else
                 packed.grad.split(list(LENGTHS)))
    for got_x, got_r, want, w in zip(x.grad.unbind(), dresidual, dss, weights, strict=True):
        assert_grad_close(got_x, want + w, torch.float64, "dx")  # (+ w: through new_residual)
        assert_grad_close(got_r, want + w, torch.float64, "dresidual")


def test_residual_add_norm_without_residual_passes_nested_x_on():
    x = _nested(_seqs(), torch.jagged)
    normed, new_residual = normkit.AddRMSNorm(C)(x)
    assert new_residual is x and normed.shape == x.shape


def test_residual_add_norm_refuses_a_residual_not_nested_like_x():
    x = _nested(_seqs(), torch.jagged)
    other = _nested(_seqs(lengths=(3, 2, 5)), torch.jagged)
    # (equal lengths on another offsets tensor: another ragged size, which torch's own
    # x + residual refuses too)
    for residual, said in ((other, "jagged nested tensor"), (torch.zeros(3, 6, C), "dense"),
                           (_nested(_seqs(), torch.jagged), "jagged nested tensor")):
        with pytest.raises(ValueError, match=f"residual to be nested like x.*got a {said}"):
            normkit.AddLayerNorm(C)(x, residual)


def test_normalizing_over_the_ragged_dim_is_refused():
    x = _nested(_seqs(), torch.jagged)  # (3, j, 8)
    with pytest.raises(ValueError, match=r"include its ragged dim 1"):
        NF.layer_norm(x, x.shape[1:])
    with pytest.raises(ValueError, match=r"normalized_shape=\[4\], got a jagged nested"):
        normkit.RMSNorm(4)(x)
    strided = _nested(_seqs(), torch.strided)
    with pytest.raises(ValueError, match=r"components of shapes \(3, 8\), \(1, 8\), \(6, 8\)"):
        normkit.LayerNorm(4)(strided)


def test_adaptive_layer_norm_modulates_each_jagged_sequence_by_its_condition():
    layer = normkit.AdaptiveLayerNorm(C, 4, zero_init=False).double()
    seqs = _seqs(torch.float64, seed=9)
    cond = torch.randn(len(seqs), 4, dtype=torch.float64)
    y = layer(_nested(seqs, torch.jagged), cond)
    for i, (got, s) in enumerate(zip(y.unbind(), seqs, strict=True)):
        assert_close(got, layer(s[None], cond[i:i + 1])[0], torch.float64)
    with pytest.raises(ValueError, match="ragged dim second .*got a strided nested"):
        layer(_nested(seqs, torch.strided), cond)
    if TORCH_RELEASE < (2, 6):
        return  # (torch 2.4-2.5 cannot build the tensor below: OLD_JAGGED)
    transposed = torch.nested.nested_tensor([s.view(-1, 2, C // 2).transpose(0, 1)
                                             for s in seqs], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"ragged dim second .*got a jagged nested tensor "
                                         r"of shape \(3, 2, j\d+, 4\)"):
        normkit.AdaptiveLayerNorm(C // 2, 4).double()(transposed, cond)


REFUSING = {
    "BatchNorm1d": lambda: normkit.BatchNorm1d(C),
    "GroupNorm": lambda: normkit.GroupNorm(2, C),
    "InstanceNorm1d": lambda: normkit.InstanceNorm1d(C),
    "LayerNorm2d": lambda: normkit.LayerNorm2d(C),
    "BatchRenorm1d": lambda: normkit.BatchRenorm1d(C),
    "MeanOnlyBatchNorm1d": lambda: normkit.MeanOnlyBatchNorm1d(C),
    "BatchNormAct1d": lambda: normkit.BatchNormAct1d(C),
    "GroupNormAct": lambda: normkit.GroupNormAct(2, C),
    "FrozenBatchNorm1d": lambda: normkit.FrozenBatchNorm1d(C),
    "SyncBatchNorm": lambda: normkit.SyncBatchNorm(C),
}


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("name", list(REFUSING))
def test_norms_with_batch_or_channel_statistics_refuse_nested_input_clearly(name, layout):
    """Their (N, C, *) statistics have no meaning on (B, j, C) sequences; torch's raise
    NotImplementedError or 'Internal error' here."""
    x = _nested([torch.randn(3, C), torch.randn(5, C)], layout)
    with pytest.raises(ValueError, match=rf"{name} expected a regular \(dense\) tensor, "
                                         rf"got a {layout_name(layout)} nested tensor.*"
                                         rf"pass its values\(\)"):
        REFUSING[name]()(x)


def layout_name(layout):
    return "jagged" if layout == torch.jagged else "strided"


@OLD_JAGGED
def test_a_compiled_block_on_jagged_sequences_equals_eager():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin, self.add = (normkit.LayerNorm(C), nn.Linear(C, C),
                                             normkit.AddRMSNorm(C))

        def forward(self, x):
            normed, residual = self.add(self.lin(self.norm(x)), x)
            return normed + residual

    torch.manual_seed(0)
    eager = Block()
    twin = Block()
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    x = _nested(_seqs(seed=11), torch.jagged)
    ours, ref = compiled(x), eager(x)
    assert_close(ours.values(), ref.values(), torch.float32)
    grads = torch.autograd.grad(ours.values().square().sum(), list(compiled.parameters()))
    refs = torch.autograd.grad(ref.values().square().sum(), list(eager.parameters()))
    for got, want in zip(grads, refs, strict=True):
        assert_grad_close(got, want, torch.float32)
