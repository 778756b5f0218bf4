"""update_bn_stats: exact pooled statistics, modes and momentum restored, clear errors."""

from __future__ import annotations

import pytest
import torch

import normkit


def _data(sizes, features=4, seed=0, offset=5.0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, features, generator=gen, dtype=torch.float64) * 2 + offset
            for n in sizes]


def test_pooled_statistics_equal_float64_over_the_concatenated_data():
    batches = _data([7, 3, 12, 2])
    bn = normkit.BatchNorm1d(4).double()
    counts = normkit.update_bn_stats(torch.nn.Sequential(bn), batches)
    everything = torch.cat(batches)
    assert counts == {"0": 24}
    torch.testing.assert_close(bn.running_mean, everything.mean(0), atol=1e-12, rtol=0)
    torch.testing.assert_close(bn.running_var, everything.var(0, correction=1), atol=1e-12,
                               rtol=1e-12)
    # not the average of per-batch variances (what fvcore / swa_utils compute)
    averaged = torch.stack([b.var(0, correction=1) for b in batches if len(b) > 1]).mean(0)
    assert (averaged - bn.running_var).abs().max() > 1e-3


def test_deeper_layers_see_their_real_inputs_and_dropout_stays_off():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), normkit.BatchNorm1d(6), torch.nn.ReLU(),
                                torch.nn.Dropout(0.5), torch.nn.Linear(6, 3),
                                torch.nn.BatchNorm1d(3, momentum=None)).double().eval()
    batches = _data([16, 16, 9], seed=1)
    inputs = []
    hook = model[5].register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
    normkit.update_bn_stats(model, batches)
    hook.remove()
    seen = torch.cat(inputs)
    # dropout stayed in eval: the recorded inputs are deterministic functions of the data
    assert not model[3].training and not model.training
    torch.testing.assert_close(model[5].running_mean, seen.mean(0), atol=1e-12, rtol=0)
    torch.testing.assert_close(model[5].running_var, seen.var(0), atol=1e-12, rtol=1e-12)
    assert model[5].momentum is None and model[1].momentum == 0.1
    assert int(model[1].num_batches_tracked) == 0


def test_batch_kinds_limits_and_custom_forward():
    bn = normkit.BatchNorm1d(4).double()
    model = torch.nn.Sequential(bn)
    batches = _data([5, 5, 5, 5])
    normkit.update_bn_stats(model, [(b, torch.zeros(len(b))) for b in batches], num_batches=2)
    torch.testing.assert_close(bn.running_mean, torch.cat(batches[:2]).mean(0))

    class Keyword(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = normkit.BatchNorm1d(4).double()

        def forward(self, *, features):
            return self.bn(features)

    keyword = Keyword()
    normkit.update_bn_stats(keyword, [{"features": b} for b in batches])
    torch.testing.assert_close(keyword.bn.running_mean, torch.cat(batches).mean(0))
    normkit.update_bn_stats(model, [{"x": b} for b in batches],
                            forward=lambda m, batch: m(batch["x"]))
    torch.testing.assert_close(bn.running_mean, torch.cat(batches).mean(0))


def test_biased_convention_and_training_mode_restored():
    bn = normkit.BatchNorm1d(4, unbiased_running_var=False).double().train()
    batches = _data([6, 10])
    normkit.update_bn_stats(torch.nn.Sequential(bn), batches)
    torch.testing.assert_close(bn.running_var, torch.cat(batches).var(0, correction=0))
    assert bn.training


def test_errors():
    with pytest.raises(ValueError, match="BatchNorm layers"):
        normkit.update_bn_stats(torch.nn.Linear(2, 2), [torch.randn(2, 2)])
    with pytest.raises(ValueError, match="at least one batch"):
        normkit.update_bn_stats(torch.nn.BatchNorm1d(2), [])
    with pytest.raises(ValueError, match="num_batches"):
        normkit.update_bn_stats(torch.nn.BatchNorm1d(2), [torch.randn(3, 2)], num_batches=0)
    with pytest.raises(TypeError, match="forward="):
        normkit.update_bn_stats(torch.nn.BatchNorm1d(2), [3.0])
    bn = torch.nn.BatchNorm1d(2)
    with pytest.raises(RuntimeError, match="boom"):
        def explode(model, batch):
            raise RuntimeError("boom")
        normkit.update_bn_stats(bn, [torch.randn(3, 2)], forward=explode)
    assert bn.momentum == 0.1 and bn.training  # restored even when the forward fails


def _group_scaled(x, groups, eps=1e-5):
    """PowerNorm's per-token group scaling, float64, written out."""
    g = x.double().reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    return (g / (g * g).mean(-1, keepdim=True).add(eps).sqrt()).reshape(x.shape)


def test_power_norm_gets_the_pooled_mean_square_of_its_counted_tokens():
    """running_phi becomes the mean square of the group-scaled input over every token
    the forward counts (explicit masks, normkit.padding_mask, nested batches), where
    training leaves an average of the last few batches; the passes normalize by each
    batch's statistic, and every buffer but running_phi, the mode and the warm-up are
    as they were."""
    torch.manual_seed(0)
    first = normkit.PowerNorm(6, group_num=2, warmup_iters=3).double()
    second = normkit.PowerNorm(6, group_num=None).double()
    with torch.no_grad():
        first.running_phi.fill_(100.0)  # (far off: the passes must not normalize by it)
        first.ema_gz.normal_()
        first.num_batches_tracked.fill_(7)
    linear = torch.nn.Linear(6, 6).double()
    model = torch.nn.ModuleDict({"first": first, "linear": linear, "second": second}).eval()
    gen = torch.Generator().manual_seed(3)
    batches = []
    for b, t in ((4, 5), (2, 9), (3, 3)):
        x = torch.randn(b, t, 6, generator=gen, dtype=torch.float64) * 3 + 2
        pad = torch.rand(b, t, generator=gen) < 0.3
        pad[0] = False
        batches.append((x, pad))
    seqs = [torch.randn(n, 6, generator=gen, dtype=torch.float64) * 3 + 2 for n in (4, 1, 7)]
    batches.append((torch.nested.nested_tensor(seqs, layout=torch.jagged), None))
    seen = []

    def forward(model, batch):
        x, pad = batch
        if pad is None:  # a nested batch: every token counts
            h = model["first"](x)
            seen.append(h.values())
            return model["second"](model["linear"](h))
        with normkit.padding_mask(pad):
            h = model["first"](x)
            seen.append(h[~pad])
            return model["second"](model["linear"](h))

    ema, before = first.ema_gz.clone(), {k: v.clone() for k, v in model.state_dict().items()}
    counts = normkit.update_bn_stats(model, batches, forward=forward)
    kept = torch.cat([x[~pad] if pad is not None else x.values() for x, pad in batches])
    assert counts == {"first": len(kept), "second": len(kept)}
    torch.testing.assert_close(first.running_phi, (_group_scaled(kept, 2) ** 2).mean(0),
                               atol=1e-12, rtol=1e-12)
    # the passes normalized by each batch's statistic: its counted outputs' mean square
    # is psi2 / (psi2 + eps), psi2 the batch's (~0.01 had running_phi served)
    for out, (x, pad) in zip(seen, batches, strict=True):
        psi2 = (_group_scaled(x[~pad] if pad is not None else x.values(), 2) ** 2).mean(0)
        torch.testing.assert_close((out * out).mean(0), psi2 / (psi2 + 1e-5), atol=1e-12,
                                   rtol=1e-12)
    assert not first.training and not second.training
    assert first.warmup_iters == 3 and int(first.num_batches_tracked) == 7
    assert torch.equal(first.ema_gz, ema)
    assert torch.equal(model.state_dict()["linear.weight"], before["linear.weight"])


def test_mean_only_batch_norm_gets_the_pooled_mean():
    batches = _data([6, 2, 9], seed=4)
    layer = normkit.MeanOnlyBatchNorm1d(4, momentum=None).double()
    counts = normkit.update_bn_stats(torch.nn.Sequential(layer), batches)
    assert counts == {"0": 17}
    torch.testing.assert_close(layer.running_mean, torch.cat(batches).mean(0), atol=1e-12,
                               rtol=0)
    assert layer.momentum is None and int(layer.num_batches_tracked) == 0


def test_a_power_norm_that_sees_no_data_keeps_its_statistics():
    used, unused = normkit.PowerNorm(4).double(), normkit.PowerNorm(4).double()
    with torch.no_grad():
        unused.running_phi.fill_(3.0)
    model = torch.nn.ModuleDict({"used": used, "unused": unused})
    with pytest.warns(UserWarning, match="'unused' saw no data"):
        counts = normkit.update_bn_stats(model, _data([5, 3]),
                                         forward=lambda m, x: m["used"](x))
    assert counts == {"used": 8, "unused": 0}
    assert torch.equal(unused.running_phi, torch.full((4,), 3.0, dtype=torch.float64))


def test_a_failing_forward_leaves_power_norm_as_it_was():
    layer = normkit.PowerNorm(4, warmup_iters=2).double().eval()
    with torch.no_grad():
        layer.running_phi.fill_(3.0)
        layer.num_batches_tracked.fill_(9)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    calls = []

    def forward(model, x):
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("the data loader broke")
        return model(x)

    with pytest.raises(RuntimeError, match="data loader broke"):
        normkit.update_bn_stats(torch.nn.Sequential(layer), _data([5, 3, 4]), forward=forward)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not layer.training and layer.warmup_iters == 2
    assert layer._observer is None
