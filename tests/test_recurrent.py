"""LayerNormLSTMCell / LayerNormLSTM against torch.nn (layer_norm=False) and an
independent float64 reference of the LN-LSTM equations (layer_norm=True)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from normkit.recurrent import LayerNormLSTM, LayerNormLSTMCell

IN, H, N, L = 3, 5, 4, 6
LENGTHS = [3, 6, 1, 4]  # unsorted, N of them, max == L
TIGHT = dict(atol=1e-12, rtol=1e-12)  # float64 vs torch.nn: only summation order differs
F32 = dict(atol=1e-6, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float64, requires_grad=False):
    return torch.randn(shape, generator=_gen(seed), dtype=dtype).requires_grad_(requires_grad)


def _perturb_layer_norms(module: nn.Module, seed: int = 7) -> None:
    """Move every LayerNorm gain/bias away from 1/0, so the wiring of each one is tested."""
    g = _gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("ln_") or ".ln_" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


# --------------------------------------------------------------------------- reference


def ln64(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim, written out: two-pass biased variance."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def ref_cell(x, h, c, p, eps=1e-5):
    """Ba et al. (2016) LN-LSTM step; ``p`` maps torch's names (and ln_*) to tensors."""
    a = x @ p["weight_ih"].T
    r = h @ p["weight_hh"].T
    if "ln_ih.weight" in p:
        a = ln64(a, p["ln_ih.weight"], p["ln_ih.bias"], eps)
        r = ln64(r, p["ln_hh.weight"], p["ln_hh.bias"], eps)
    gates = a + r
    if "bias_ih" in p:
        gates = gates + p["bias_ih"] + p["bias_hh"]
    hid = h.shape[-1]
    i, f, g, o = (gates[..., k * hid:(k + 1) * hid] for k in range(4))
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    c_out = c_new
    if "ln_cell.weight" in p:
        c_out = ln64(c_new, p["ln_cell.weight"], p["ln_cell.bias"], eps)
    return torch.sigmoid(o) * torch.tanh(c_out), c_new


def _layer_params(module: nn.Module, suffix: str) -> dict:
    """One layer/direction's parameters (``suffix`` "_l0", "_l0_reverse", ...) under the
    cell's names, e.g. ``weight_ih_l1_reverse`` -> ``weight_ih``, ``ln_ih_l1.bias`` ->
    ``ln_ih.bias``."""
    out = {}
    for name, p in module.named_parameters():
        base, dot, field = name.partition(".")
        if base.endswith(suffix):
            out[base[: -len(suffix)] + dot + field] = p
    return out


def ref_lstm(module, x, hx):
    """Full-length (unpacked) multi-layer, optionally bidirectional LN-LSTM, time-major."""
    d = 2 if module.bidirectional else 1
    h0, c0 = hx
    layer_input, hs, cs = x, [], []
    for layer in range(module.num_layers):
        outs = []
        for direction in range(d):
            k = layer * d + direction
            sfx = f"_l{layer}" + ("_reverse" if direction else "")
            p = _layer_params(module, sfx)
            h, c = h0[k], c0[k]
            steps = range(x.shape[0])
            out = [None] * x.shape[0]
            for t in reversed(steps) if direction else steps:
                h, c = ref_cell(layer_input[t], h, c, p, module.eps)
                out[t] = h
            outs.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        layer_input = torch.cat(outs, -1)
    return layer_input, (torch.stack(hs), torch.stack(cs))


# --------------------------------------------------------------------------- torch parity


def _twins(dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    ref = nn.LSTM(IN, H, **kwargs).to(dtype)
    nk = LayerNormLSTM(IN, H, layer_norm=False, **kwargs).to(dtype)
    nk.load_state_dict(ref.state_dict())  # strict: the parameter sets are identical
    return ref, nk


def _forward_backward(module, x, hx, lengths, batch_first):
    """Forward (packed or padded) and backward of a fixed random projection."""
    module.zero_grad()
    for t in (x, *(hx or ())):
        t.grad = None
    inp = x
    if lengths is not None:
        inp = pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first,
                                   enforce_sorted=False)
    out, (h_n, c_n) = module(inp, hx)
    if lengths is not None:
        assert isinstance(out, PackedSequence)
        out = out.data
    loss = sum((t * _randn(*t.shape, seed=s, dtype=t.dtype)).sum()
               for s, t in enumerate((out, h_n, c_n), start=10))
    loss.backward()
    grads = {"input": x.grad.clone()}
    if hx is not None:
        grads.update(h_0=hx[0].grad.clone(), c_0=hx[1].grad.clone())
    grads.update({n: p.grad.clone() for n, p in module.named_parameters()})
    return (out, h_n, c_n), grads


GRID = list(itertools.product([1, 2], [False, True], [False, True], [False, True],
                              [False, True]))


@pytest.mark.parametrize(
    "num_layers,bidirectional,batch_first,packed,init_state", GRID,
    ids=[f"L{a}-{'bi' if b else 'uni'}-{'bf' if c else 'tf'}-{'packed' if d else 'padded'}"
         f"-{'hx' if e else 'nohx'}" for a, b, c, d, e in GRID])
def test_lstm_matches_torch_float64(num_layers, bidirectional, batch_first, packed,
                                    init_state):
    kw = dict(num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first)
    ref, nk = _twins(**kw)
    shape = (N, L, IN) if batch_first else (L, N, IN)
    d = 2 if bidirectional else 1
    lengths = LENGTHS if packed else None
    results = []
    for module in (ref, nk):
        x = _randn(*shape, seed=1, requires_grad=True)
        hx = None
        if init_state:
            hx = (_randn(d * num_layers, N, H, seed=2, requires_grad=True),
                  _randn(d * num_layers, N, H, seed=3, requires_grad=True))
        results.append(_forward_backward(module, x, hx, lengths, batch_first))
    (ref_out, ref_grads), (nk_out, nk_grads) = results
    for name, a, b in zip(("output", "h_n", "c_n"), nk_out, ref_out, strict=True):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
    assert nk_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(nk_grads[name], g, **TIGHT,
                                   msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_lstm_matches_torch_float32(packed):
    ref, nk = _twins(dtype=torch.float32, num_layers=2, bidirectional=True)
    lengths = LENGTHS if packed else None
    (ref_out, ref_grads), (nk_out, nk_grads) = (
        _forward_backward(m, _randn(L, N, IN, seed=1, dtype=torch.float32,
                                    requires_grad=True), None, lengths, False)
        for m in (ref, nk))
    for a, b in zip(nk_out, ref_out, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **F32)
    for name, g in ref_grads.items():
        torch.testing.assert_close(nk_grads[name], g, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"grad {n}: {m}")


def test_lstm_without_bias_and_unbatched_match_torch():
    ref, nk = _twins(num_layers=2, bias=False, bidirectional=True)
    assert {n for n, _ in nk.named_parameters()} == {n for n, _ in ref.named_parameters()}
    assert nk.bias_ih_l0 is None
    x = _randn(L, IN, seed=1)
    hx = (_randn(4, H, seed=2), _randn(4, H, seed=3))
    for a, b in zip(nk(x, hx), ref(x, hx), strict=True):
        torch.testing.assert_close(a, b, **TIGHT)
    out, (h_n, c_n) = nk(x)
    assert out.shape == (L, 2 * H) and h_n.shape == c_n.shape == (4, H)


def test_sorted_packed_input_matches_torch():
    ref, nk = _twins(num_layers=2, bidirectional=True)
    x = _randn(L, N, IN, seed=1)
    packed = pack_padded_sequence(x, torch.tensor(sorted(LENGTHS, reverse=True)))
    assert packed.sorted_indices is None
    (out, (h_n, c_n)), (ref_out, (ref_h, ref_c)) = nk(packed), ref(packed)
    assert out.sorted_indices is None and out.unsorted_indices is None
    for a, b in zip((out.data, h_n, c_n), (ref_out.data, ref_h, ref_c), strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


def test_lstm_state_dict_round_trips_with_torch():
    ref = nn.LSTM(IN, H, num_layers=2, bidirectional=True)
    plain = LayerNormLSTM(IN, H, num_layers=2, bidirectional=True, layer_norm=False)
    plain.load_state_dict(ref.state_dict())
    nn.LSTM(IN, H, num_layers=2, bidirectional=True).load_state_dict(plain.state_dict())
    ln = LayerNormLSTM(IN, H, num_layers=2, bidirectional=True)
    result = ln.load_state_dict(ref.state_dict(), strict=False)
    assert result.unexpected_keys == []
    expected_missing = {f"ln_{kind}_l{layer}{rev}.{field}"
                        for kind in ("ih", "hh", "cell") for layer in (0, 1)
                        for rev in ("", "_reverse") for field in ("weight", "bias")}
    assert set(result.missing_keys) == expected_missing
    assert torch.equal(ln.weight_hh_l1_reverse, ref.weight_hh_l1_reverse)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("unbatched", [False, True])
@pytest.mark.parametrize("init_state", [False, True])
def test_cell_matches_torch_float64(bias, unbatched, init_state):
    torch.manual_seed(0)
    ref = nn.LSTMCell(IN, H, bias=bias).double()
    nk = LayerNormLSTMCell(IN, H, bias=bias, layer_norm=False).double()
    nk.load_state_dict(ref.state_dict())
    results = []
    for module in (ref, nk):
        x = _randn(*((IN,) if unbatched else (N, IN)), seed=1, requires_grad=True)
        state_shape = (H,) if unbatched else (N, H)
        hx = None
        if init_state:
            hx = (_randn(*state_shape, seed=2, requires_grad=True),
                  _randn(*state_shape, seed=3, requires_grad=True))
        h, c = module(x, hx)
        ((h * _randn(*h.shape, seed=4)).sum() + (c * _randn(*c.shape, seed=5)).sum()).backward()
        grads = [x.grad] + ([hx[0].grad, hx[1].grad] if hx else [])
        results.append(([h, c], grads + [p.grad for p in module.parameters()]))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        torch.testing.assert_close(b, a, **TIGHT)


def test_cell_state_dict_matches_torch():
    ref = nn.LSTMCell(IN, H)
    cell = LayerNormLSTMCell(IN, H)
    result = cell.load_state_dict(ref.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert set(result.missing_keys) == {f"ln_{k}.{f}" for k in ("ih", "hh", "cell")
                                        for f in ("weight", "bias")}
    ref.load_state_dict(LayerNormLSTMCell(IN, H, layer_norm=False).state_dict())


# --------------------------------------------------------------------------- LN on


def test_initialization_like_torch_and_identity_layer_norms():
    torch.manual_seed(0)
    lstm = LayerNormLSTM(IN, H, num_layers=2, bidirectional=True)
    bound = H ** -0.5
    for name, p in lstm.named_parameters():
        if name.startswith("ln_"):
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight")
                               else torch.zeros_like(p)), name
        else:
            assert p.abs().max() <= bound and p.std() > bound / 4, name
    assert lstm.ln_ih_l1_reverse.normalized_shape == (4 * H,)
    assert lstm.ln_cell_l0.normalized_shape == (H,)


@pytest.mark.parametrize("bias", [True, False])
def test_cell_matches_reference_equations(bias):
    torch.manual_seed(0)
    cell = LayerNormLSTMCell(IN, H, bias=bias, eps=1e-3).double()
    _perturb_layer_norms(cell)
    x = _randn(N, IN, seed=1, requires_grad=True)
    h = _randn(N, H, seed=2, requires_grad=True)
    c = _randn(N, H, seed=3, requires_grad=True)
    params = list(cell.parameters())
    got = cell(x, (h, c))
    want = ref_cell(x, h, c, dict(cell.named_parameters()), eps=1e-3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    dh, dc = _randn(N, H, seed=4), _randn(N, H, seed=5)
    inputs = [x, h, c, *params]
    g_got = torch.autograd.grad((got[0] * dh).sum() + (got[1] * dc).sum(), inputs)
    g_want = torch.autograd.grad((want[0] * dh).sum() + (want[1] * dc).sum(), inputs)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_matches_reference_equations(batch_first):
    torch.manual_seed(0)
    lstm = LayerNormLSTM(IN, H, num_layers=2, bidirectional=True, batch_first=batch_first,
                         dtype=torch.float64)
    _perturb_layer_norms(lstm)
    x = _randn(L, N, IN, seed=1)
    hx = (_randn(4, N, H, seed=2), _randn(4, N, H, seed=3))
    out, (h_n, c_n) = lstm(x.transpose(0, 1) if batch_first else x, hx)
    ref_out, (ref_h, ref_c) = ref_lstm(lstm, x, hx)
    torch.testing.assert_close(out.transpose(0, 1) if batch_first else out, ref_out,
                               atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(h_n, ref_h, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(c_n, ref_c, atol=1e-12, rtol=1e-10)


def test_cell_gradcheck():
    torch.manual_seed(0)
    cell = LayerNormLSTMCell(2, 3, dtype=torch.float64)
    _perturb_layer_norms(cell)
    names = [n for n, _ in cell.named_parameters()]

    def f(x, h, c, *params):
        out = torch.func.functional_call(cell, dict(zip(names, params, strict=True)),
                                         (x, (h, c)))
        return out

    inputs = (_randn(2, 2, seed=1), _randn(2, 3, seed=2), _randn(2, 3, seed=3),
              *(p.detach() for p in cell.parameters()))
    inputs = tuple(t.clone().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_bidirectional_two_layer_lstm_gradcheck(packed):
    torch.manual_seed(0)
    lstm = LayerNormLSTM(2, 3, num_layers=2, bidirectional=True, dtype=torch.float64)
    _perturb_layer_norms(lstm)
    names = [n for n, _ in lstm.named_parameters()]

    def f(x, h0, c0, *params):
        inp = pack_padded_sequence(x, torch.tensor([2, 4]), enforce_sorted=False) \
            if packed else x
        out, (h_n, c_n) = torch.func.functional_call(
            lstm, dict(zip(names, params, strict=True)), (inp, (h0, c0)))
        return (out.data if packed else out), h_n, c_n

    inputs = (_randn(4, 2, 2, seed=1), _randn(4, 2, 3, seed=2), _randn(4, 2, 3, seed=3),
              *(p.detach() for p in lstm.parameters()))
    inputs = tuple(t.clone().requires_grad_() for t in inputs)
    # every input and parameter (~600 of them): fast mode checks random projections of
    # the whole Jacobian in seconds; the full Jacobian is checked for the data and states
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)
    data, params = inputs[:3], tuple(t.detach() for t in inputs[3:])
    assert torch.autograd.gradcheck(lambda x, h0, c0: f(x, h0, c0, *params), data)


def _ln_lstm(**kwargs):
    torch.manual_seed(0)
    lstm = LayerNormLSTM(IN, H, num_layers=2, bidirectional=True, dtype=torch.float64,
                         **kwargs)
    _perturb_layer_norms(lstm)
    return lstm


@pytest.mark.parametrize("batch_first", [False, True])
def test_packed_unsorted_lengths_equal_each_sequence_alone(batch_first):
    lstm = _ln_lstm(batch_first=batch_first)
    x = _randn(L, N, IN, seed=1, requires_grad=True)
    hx = (_randn(4, N, H, seed=2), _randn(4, N, H, seed=3))
    xb = x.transpose(0, 1) if batch_first else x
    packed = pack_padded_sequence(xb, torch.tensor(LENGTHS), batch_first=batch_first,
                                  enforce_sorted=False)
    out, (h_n, c_n) = lstm(packed, hx)
    assert isinstance(out, PackedSequence)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    padded, out_lengths = pad_packed_sequence(out, batch_first=batch_first)
    assert out_lengths.tolist() == LENGTHS
    padded = padded.transpose(0, 1) if batch_first else padded  # (L, N, 2H)
    for i, n in enumerate(LENGTHS):
        alone_x = x[:n, i:i + 1].transpose(0, 1) if batch_first else x[:n, i:i + 1]
        alone, (h_i, c_i) = lstm(alone_x, (hx[0][:, i:i + 1], hx[1][:, i:i + 1]))
        alone = alone.transpose(0, 1) if batch_first else alone
        torch.testing.assert_close(padded[:n, i:i + 1], alone, atol=1e-12, rtol=1e-10)
        assert torch.all(padded[n:, i] == 0)
        torch.testing.assert_close(h_n[:, i:i + 1], h_i, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(c_n[:, i:i + 1], c_i, atol=1e-12, rtol=1e-10)
    (out.data.sum() + h_n.sum() + c_n.sum()).backward()
    for i, n in enumerate(LENGTHS):  # padded steps do not influence anything
        assert torch.all(x.grad[n:, i] == 0) and torch.all(x.grad[:n, i] != 0)


def test_batch_first_equals_transposed():
    tm, bf = _ln_lstm(), _ln_lstm(batch_first=True)
    x = _randn(L, N, IN, seed=1)
    out, (h_n, c_n) = tm(x)
    out_bf, (h_bf, c_bf) = bf(x.transpose(0, 1))
    assert out_bf.shape == (N, L, 2 * H)
    torch.testing.assert_close(out_bf.transpose(0, 1), out, atol=0, rtol=0)
    torch.testing.assert_close(h_bf, h_n, atol=0, rtol=0)
    torch.testing.assert_close(c_bf, c_n, atol=0, rtol=0)


def test_unbatched_equals_batch_of_one():
    lstm = _ln_lstm()
    x = _randn(L, IN, seed=1)
    hx = (_randn(4, H, seed=2), _randn(4, H, seed=3))
    out, (h_n, c_n) = lstm(x, hx)
    out1, (h1, c1) = lstm(x.unsqueeze(1), (hx[0].unsqueeze(1), hx[1].unsqueeze(1)))
    assert out.shape == (L, 2 * H) and h_n.shape == (4, H)
    torch.testing.assert_close(out, out1.squeeze(1), atol=1e-14, rtol=0)
    torch.testing.assert_close(h_n, h1.squeeze(1), atol=1e-14, rtol=0)
    torch.testing.assert_close(c_n, c1.squeeze(1), atol=1e-14, rtol=0)
    cell = LayerNormLSTMCell(IN, H, dtype=torch.float64)
    h, c = cell(x[0], (hx[0][0], hx[1][0]))
    hb, cb = cell(x[:1], (hx[0][:1], hx[1][:1]))
    assert h.shape == c.shape == (H,)
    torch.testing.assert_close(h, hb[0], atol=1e-14, rtol=0)
    torch.testing.assert_close(c, cb[0], atol=1e-14, rtol=0)


def test_lstm_equals_unrolled_cells():
    """One layer, one direction: the sequence loop is the cell applied step by step."""
    torch.manual_seed(0)
    lstm = LayerNormLSTM(IN, H, dtype=torch.float64)
    _perturb_layer_norms(lstm)
    cell = LayerNormLSTMCell(IN, H, dtype=torch.float64)
    cell.load_state_dict({k.replace("_l0", ""): v for k, v in lstm.state_dict().items()})
    x = _randn(L, N, IN, seed=1)
    out, (h_n, c_n) = lstm(x)
    h = c = torch.zeros(N, H, dtype=torch.float64)
    for t in range(L):
        h, c = cell(x[t], (h, c))
        torch.testing.assert_close(out[t], h, atol=1e-14, rtol=0)
    torch.testing.assert_close(h_n[0], h, atol=1e-14, rtol=0)
    torch.testing.assert_close(c_n[0], c, atol=1e-14, rtol=0)


def test_empty_batch_and_float32():
    lstm = LayerNormLSTM(IN, H, num_layers=2, bidirectional=True)
    out, (h_n, c_n) = lstm(torch.randn(L, 0, IN))
    assert out.shape == (L, 0, 2 * H) and h_n.shape == c_n.shape == (4, 0, H)
    out, (h_n, _) = lstm(torch.randn(L, N, IN))
    assert out.dtype == h_n.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_dropout_eval_is_deterministic_and_train_is_not():
    torch.manual_seed(0)
    lstm = LayerNormLSTM(IN, H, num_layers=2, dropout=0.5)
    no_dropout = LayerNormLSTM(IN, H, num_layers=2)
    no_dropout.load_state_dict(lstm.state_dict())
    x = torch.randn(L, N, IN)
    lstm.eval()
    first, second = lstm(x)[0], lstm(x)[0]
    assert torch.equal(first, second)
    assert torch.equal(first, no_dropout(x)[0])
    lstm.train()
    torch.manual_seed(1)
    a = lstm(x)[0]
    b = lstm(x)[0]
    assert not torch.allclose(a, b) and not torch.allclose(a, first)
    torch.manual_seed(1)
    assert torch.equal(lstm(x)[0], a)  # the dropout draws come from torch's RNG
    with pytest.warns(UserWarning, match="num_layers greater than 1"):
        LayerNormLSTM(IN, H, dropout=0.5)


def test_extra_repr():
    assert "num_layers=2" in repr(LayerNormLSTM(IN, H, num_layers=2, dropout=0.1))
    assert "layer_norm=False" in repr(LayerNormLSTMCell(IN, H, layer_norm=False))
    assert "ln_cell" in repr(LayerNormLSTMCell(IN, H))
    every = LayerNormLSTM(IN, H, num_layers=2, bias=False, batch_first=True, dropout=0.1,
                          bidirectional=True, layer_norm=False)
    assert every.extra_repr() == (f"{IN}, {H}, num_layers=2, bias=False, batch_first=True, "
                                  "dropout=0.1, bidirectional=True, layer_norm=False")
    assert LayerNormLSTMCell(IN, H, bias=False).extra_repr() == f"{IN}, {H}, bias=False"


# --------------------------------------------------------------------------- bad input


def _hx(*shape):
    return torch.zeros(shape), torch.zeros(shape)


BAD = [
    # (callable, exception, regex)
    ("lstm feature size", lambda: LayerNormLSTM(3, 5)(torch.randn(6, 2, 4)),
     ValueError, r"input_size = 3, got input of shape \(6, 2, 4\)"),
    ("lstm 4D", lambda: LayerNormLSTM(3, 5)(torch.randn(6, 2, 1, 3)),
     ValueError, r"\(L, N, H_in\) or \(L, H_in\).*got input of shape \(6, 2, 1, 3\)"),
    ("lstm 1D", lambda: LayerNormLSTM(3, 5)(torch.randn(3)),
     ValueError, r"got input of shape \(3\)"),
    ("lstm batch_first layout", lambda: LayerNormLSTM(3, 5, batch_first=True)(
        torch.randn(2, 6, 4)), ValueError, r"\(N, L, H_in\).*\(2, 6, 4\)"),
    ("lstm empty sequence", lambda: LayerNormLSTM(3, 5)(torch.randn(0, 2, 3)),
     ValueError, r"sequence length of at least 1"),
    ("packed feature size", lambda: LayerNormLSTM(3, 5)(
        pack_padded_sequence(torch.randn(4, 2, 2), torch.tensor([4, 2]))),
     ValueError, r"data of shape \(\*, 3\).*got data of shape \(6, 2\)"),
    ("lstm h_0 shape", lambda: LayerNormLSTM(3, 5)(torch.randn(6, 2, 3), _hx(1, 2, 4)),
     ValueError, r"expected h_0 of shape \(1, 2, 5\), got h_0 of shape \(1, 2, 4\)"),
    ("lstm c_0 shape", lambda: LayerNormLSTM(3, 5, bidirectional=True)(
        torch.randn(6, 2, 3), (torch.zeros(2, 2, 5), torch.zeros(1, 2, 5))),
     ValueError, r"expected c_0 of shape \(2, 2, 5\), got c_0 of shape \(1, 2, 5\)"),
    ("lstm unbatched with batched hx", lambda: LayerNormLSTM(3, 5)(
        torch.randn(6, 3), _hx(1, 1, 5)),
     ValueError, r"expected h_0 of shape \(1, 5\), got h_0 of shape \(1, 1, 5\)"),
    ("lstm hx not a pair", lambda: LayerNormLSTM(3, 5)(torch.randn(6, 2, 3),
                                                       torch.zeros(1, 2, 5)),
     TypeError, r"tuple \(h_0, c_0\).*got Tensor"),
    ("lstm integer input", lambda: LayerNormLSTM(3, 5)(torch.ones(6, 2, 3, dtype=torch.long)),
     ValueError, r"floating-point"),
    ("lstm dtype mismatch", lambda: LayerNormLSTM(3, 5)(torch.randn(6, 2, 3).double()),
     ValueError, r"expected input of dtype torch.float32.*got torch.float64"),
    ("cell feature size", lambda: LayerNormLSTMCell(3, 5)(torch.randn(2, 4)),
     ValueError, r"\(N, 3\) or \(3\) \(input_size=3\), got input of shape \(2, 4\)"),
    ("cell 3D", lambda: LayerNormLSTMCell(3, 5)(torch.randn(6, 2, 3)),
     ValueError, r"got input of shape \(6, 2, 3\)"),
    ("cell hx shape", lambda: LayerNormLSTMCell(3, 5)(torch.randn(2, 3), _hx(3, 5)),
     ValueError, r"expected h_0 of shape \(2, 5\), got h_0 of shape \(3, 5\)"),
    ("cell unbatched hx", lambda: LayerNormLSTMCell(3, 5)(torch.randn(3), _hx(1, 5)),
     ValueError, r"expected h_0 of shape \(5\), got h_0 of shape \(1, 5\)"),
    ("dropout negative", lambda: LayerNormLSTM(3, 5, num_layers=2, dropout=-0.1),
     ValueError, r"dropout .*\[0, 1\].*-0.1"),
    ("dropout above one", lambda: LayerNormLSTM(3, 5, num_layers=2, dropout=1.5),
     ValueError, r"dropout .*\[0, 1\].*1.5"),
    ("dropout bool", lambda: LayerNormLSTM(3, 5, num_layers=2, dropout=True),
     ValueError, r"dropout .*\[0, 1\].*True"),
    ("hidden_size zero", lambda: LayerNormLSTM(3, 0), ValueError, r"hidden_size .*>= 1.*0"),
    ("num_layers zero", lambda: LayerNormLSTM(3, 5, num_layers=0),
     ValueError, r"num_layers .*>= 1.*0"),
    ("proj_size unsupported", lambda: LayerNormLSTM(3, 5, proj_size=2),
     TypeError, r"proj_size"),
]


@pytest.mark.parametrize("make,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_reported(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# --------------------------------------------------------------------------- training


def test_ln_lstm_learns_the_sign_of_a_sequence_sum():
    torch.manual_seed(0)
    x = torch.randn(12, 64, 1)  # (L, N, 1)
    target = (x.sum(0) > 0).float()  # (N, 1)
    lstm, head = LayerNormLSTM(1, 8), nn.Linear(8, 1)
    params = [*lstm.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=0.03)
    losses = []
    for _ in range(50):
        _, (h_n, _) = lstm(x)
        loss = nn.functional.binary_cross_entropy_with_logits(head(h_n[-1]), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in params)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_lstm_is_no_less_accurate_than_torchs(dtype):
    """In 16 bits the gate arithmetic and the cell state stay float32 between the steps,
    as torch's fused LSTM keeps them (a 16-bit cell state takes a rounding per step).
    With ``layer_norm=False`` the module computes torch.nn.LSTM's function, so torch's
    16-bit error from float64 on the same weights and inputs is the yardstick: outputs,
    final states and input gradients, summed over seeds, within 1.25x of it (measured
    0.88-1.11x; a bfloat16 cell state measured 1.5-1.9x, float16 1.0-1.14x)."""
    errors = {name: torch.zeros(4, dtype=torch.float64) for name in ("normkit", "torch")}
    for seed in range(8):
        torch.manual_seed(seed)
        ours = LayerNormLSTM(16, 32, num_layers=2, layer_norm=False)
        theirs = nn.LSTM(16, 32, num_layers=2)
        theirs.load_state_dict(ours.state_dict())
        gen = torch.Generator().manual_seed(seed)
        x64 = torch.randn(30, 3, 16, generator=gen, dtype=torch.float64)
        dy = torch.randn(30, 3, 32, generator=gen, dtype=torch.float64)
        ref_x = x64.clone().requires_grad_()
        ref_out, (ref_h, ref_c) = ours.double()(ref_x)
        ref_out.backward(dy)
        ref_out, ref_h, ref_c = ref_out.detach(), ref_h.detach(), ref_c.detach()
        for name, module in (("normkit", ours), ("torch", theirs)):
            module = module.to(dtype)
            x = x64.to(dtype).requires_grad_()
            out, (h, c) = module(x)
            assert out.dtype == h.dtype == c.dtype == dtype
            out.backward(dy.to(dtype))
            errors[name] += torch.tensor([
                float((got.detach().double() - want).abs().max()) / float(want.abs().max())
                for got, want in ((out, ref_out), (h, ref_h), (c, ref_c),
                                  (x.grad, ref_x.grad))], dtype=torch.float64)
    assert bool((errors["normkit"] <= 1.25 * errors["torch"]).all()), errors


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("shape", [(5, 2, 4), (5, 4)], ids=["batched", "unbatched"])
def test_the_output_is_a_view_exactly_where_torchs_is(batch_first, shape):
    """torch's LSTM returns a tensor of its own, except batch-first and unbatched outputs
    (views); FSDP2 warns for a sharded module whose output is a view."""
    x = torch.randn(shape)
    ours = LayerNormLSTM(4, 3, num_layers=2, bidirectional=True,
                         batch_first=batch_first)(x)[0]
    theirs = torch.nn.LSTM(4, 3, num_layers=2, bidirectional=True,
                           batch_first=batch_first)(x)[0]
    assert ours.shape == theirs.shape and ours._is_view() == theirs._is_view()
