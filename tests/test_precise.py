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
