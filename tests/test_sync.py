"""SyncBatchNorm on gloo (CPU): equal to single-process BatchNorm on the concatenated batch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from dist_workers import (
    channel_mismatch,
    full_batch,
    precise_model_and_batches,
    precise_stats,
    sync_bn_step,
)

import normkit

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


def _single_process(sizes, channels, spatial, dtype, steps, momentum):
    x_all, g_all, _ = full_batch(sizes, channels, spatial, seed=0)
    torch.manual_seed(0)
    bn = normkit.BatchNorm2d(channels, momentum=momentum) if len(spatial) == 2 else \
        normkit.BatchNorm1d(channels, momentum=momentum)
    bn = bn.to(dtype)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    outs = []
    for step in range(steps):
        x = (x_all + step).to(dtype).requires_grad_()
        y = bn(x)
        (y * g_all.to(dtype)).sum().backward()
        outs.append((y.detach(), x.grad))
    return bn, outs


@pytest.mark.parametrize("sizes,spatial,dtype,momentum", [
    ((4, 7), (3, 2), torch.float64, 0.1),          # 2 ranks, uneven, 4D input
    ((5, 3, 0), (), torch.float64, None),          # 3 ranks, one with an empty batch
    ((2, 1, 6), (5,), torch.float32, 0.3),         # 3 ranks, one sample on a rank
], ids=["2-ranks-uneven", "3-ranks-empty-rank", "3-ranks-float32"])
def test_sync_batchnorm_equals_batchnorm_on_the_concatenated_batch(sizes, spatial, dtype,
                                                                   momentum):
    steps, channels = 2, 3
    results = run_ranks(sync_bn_step, len(sizes), list(sizes), channels, spatial, dtype,
                        steps, momentum)
    bn, outs = _single_process(sizes, channels, spatial, dtype, steps, momentum)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    for step, (y, dx) in enumerate(outs):
        torch.testing.assert_close(torch.cat([r["steps"][step]["y"] for r in results]), y, **tol)
        torch.testing.assert_close(torch.cat([r["steps"][step]["dx"] for r in results]), dx,
                                   **tol)
    # parameter gradients are local; DDP all-reduces (sums) them across ranks
    torch.testing.assert_close(sum(r["dweight"] for r in results), bn.weight.grad, **tol)
    torch.testing.assert_close(sum(r["dbias"] for r in results), bn.bias.grad, **tol)
    for r in results:
        torch.testing.assert_close(r["running_mean"], bn.running_mean, **tol)
        torch.testing.assert_close(r["running_var"], bn.running_var, **tol)
        assert r["tracked"] == steps


def test_ranks_that_disagree_on_channels_all_raise_instead_of_hanging():
    results = run_ranks(channel_mismatch, 2, timeout=60)
    for r in results:
        assert r["error"] is not None and "[3, 4]" in r["error"], r


def test_update_bn_stats_pools_across_ranks():
    batches = [[8, 5], [3], [6, 6]]
    results = run_ranks(precise_stats, 3, batches, timeout=90)
    # single process over every rank's batches: the same statistics
    model, data = precise_model_and_batches(batches)
    normkit.update_bn_stats(model, data)
    for r in results:
        assert r["counts"] == {"1": 28, "4": 28}
        for key, value in model.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-10, rtol=1e-10, msg=key)


def test_without_a_process_group_it_is_batchnorm():
    sync, bn = normkit.SyncBatchNorm(4), torch.nn.BatchNorm2d(4)
    x = torch.randn(6, 4, 3, 3)
    for mode in (True, False):
        sync.train(mode), bn.train(mode)
        torch.testing.assert_close(sync(x), bn(x))
    assert isinstance(sync, torch.nn.SyncBatchNorm)
    assert sync.state_dict().keys() == torch.nn.SyncBatchNorm(4).state_dict().keys()


def test_convert_and_revert_copy_state_and_never_mutate():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=0.3),
                              torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3), normkit.BatchNorm2d(4))
    net(torch.randn(8, 3, 9, 9))  # move the running statistics
    net.eval()
    synced = normkit.convert_sync_batchnorm(net)
    assert type(net[1]) is torch.nn.BatchNorm2d and type(net[4]) is normkit.BatchNorm2d
    assert all(type(synced[i]) is normkit.SyncBatchNorm for i in (1, 4))
    assert synced[1].momentum == 0.3 and not synced.training
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(synced(x), net(x))
    reverted = normkit.revert_sync_batchnorm(synced)
    assert type(reverted[1]) is normkit.BatchNorm
    assert type(synced[1]) is normkit.SyncBatchNorm
    torch.testing.assert_close(reverted(x), net(x))
    assert type(normkit.revert_sync_batchnorm(synced, normkit.BatchNorm2d)[4]) is \
        normkit.BatchNorm2d
    torch_sync = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    assert type(normkit.revert_sync_batchnorm(torch_sync)[0]) is normkit.BatchNorm


def test_convert_errors_say_what_is_missing():
    with pytest.raises(ValueError, match="BatchNorm layers"):
        normkit.convert_sync_batchnorm(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="SyncBatchNorm layers"):
        normkit.revert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))


def test_layers_with_batch_statistics_it_cannot_synchronize_are_named():
    """BatchRenorm, MeanOnlyBatchNorm and PowerNorm have no synchronized version: a model
    holding them besides BatchNorm converts the BatchNorm and warns naming them; one
    holding only them raises, naming them (not "no BatchNorm layers")."""
    net = torch.nn.Sequential(torch.nn.BatchNorm2d(3), normkit.BatchRenorm2d(3),
                              torch.nn.Sequential(normkit.MeanOnlyBatchNorm2d(3)))
    with pytest.warns(UserWarning, match=r"left '1' \(BatchRenorm2d\), '2.0' "
                                         r"\(MeanOnlyBatchNorm2d\) as they are"):
        synced = normkit.convert_sync_batchnorm(net)
    assert [type(m).__name__ for m in (synced[0], synced[1], synced[2][0])] == [
        "SyncBatchNorm", "BatchRenorm2d", "MeanOnlyBatchNorm2d"]
    with warnings.catch_warnings():  # (where= leaves them out: nothing to say)
        warnings.simplefilter("error")
        normkit.convert_sync_batchnorm(
            net, where=lambda name, m: type(m) is torch.nn.BatchNorm2d)
    with pytest.raises(ValueError, match=r"no BatchNorm to synchronize.*'0' \(PowerNorm\)"):
        normkit.convert_sync_batchnorm(torch.nn.Sequential(normkit.PowerNorm(4)))


def test_classmethod_conversion_builds_normkit_layers():
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(3))
    converted = normkit.SyncBatchNorm.convert_sync_batchnorm(net)
    assert type(converted[0]) is normkit.SyncBatchNorm and type(net[0]) is torch.nn.BatchNorm1d
