"""Activation checkpointing: the recomputed forward does not update running statistics.

torch.utils.checkpoint recomputes a segment's forward inside backward; torch's BatchNorm
then updates its running statistics a second time (pytorch issue 96136). normkit's layers
with running statistics update them once, so a checkpointed model ends each step with
the buffers and gradients of the same model trained without checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import normkit
from normkit.norms._core import recomputing

LAYERS = {
    "BatchNorm2d": lambda: normkit.BatchNorm2d(4),
    "BatchNorm2d-cumulative": lambda: normkit.BatchNorm2d(4, momentum=None),
    "SyncBatchNorm": lambda: normkit.SyncBatchNorm(4),
    "BatchNormAct2d": lambda: normkit.BatchNormAct2d(4, act="silu"),
    "InPlaceABN": lambda: normkit.BatchNormAct2d(4, act="leaky_relu", memory="inplace"),
    # r and d clipped away from (1, 0) from the first step: they read the statistics
    "BatchRenorm2d": lambda: normkit.BatchRenorm2d(4, warmup_steps=0, r_max_steps=10,
                                                   d_max_steps=10),
    "MeanOnlyBatchNorm2d": lambda: normkit.MeanOnlyBatchNorm2d(4),
    "InstanceNorm2d": lambda: normkit.InstanceNorm2d(4, affine=True,
                                                     track_running_stats=True),
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_checkpointed_training_ends_with_the_plain_runs_buffers_and_gradients(layer,
                                                                               reentrant):
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), LAYERS[layer](), nn.Conv2d(4, 2, 1))
    checkpointed = copy.deepcopy(plain)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(8, 3, 6, 6, generator=gen) * 2 + 1
        plain.zero_grad()
        checkpointed.zero_grad()
        plain(x).square().mean().backward()
        out = checkpoint(checkpointed, x.requires_grad_(), use_reentrant=reentrant)
        out.square().mean().backward()
        for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
        for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(),
                                strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    if hasattr(plain[1], "num_batches_tracked") and layer != "InstanceNorm2d":
        assert int(checkpointed[1].num_batches_tracked) == 3


def test_a_patched_torch_model_under_checkpointing_counts_each_step_once():
    """The drop-in path: a torch model patched to normkit, checkpointed per block."""
    torch.manual_seed(3)
    blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4),
                                         nn.ReLU()) for _ in range(3))
    patched = normkit.patch(blocks)
    x = torch.randn(4, 4, 5, 5, requires_grad=True)
    for _ in range(2):
        y = x
        for block in patched:
            y = checkpoint(block, y, use_reentrant=False)
        y.sum().backward()
    assert [int(block[1].num_batches_tracked) for block in patched] == [2, 2, 2]


def test_recomputing_is_false_outside_a_backward_and_inside_autograd_grad_calls():
    seen = []

    def f(x):
        seen.append(recomputing())
        return x.exp()

    x = torch.ones(3, requires_grad=True)
    y = f(x)
    torch.autograd.grad(f(torch.autograd.grad(y.sum(), x, create_graph=True)[0]).sum(), x)
    assert seen == [False, False]
    checkpoint(f, x, use_reentrant=True).sum().backward()
    assert seen == [False, False, False, True]


def _fairscale_patch_batchnorm(module: nn.Module) -> None:
    """FairScale's ``patch_batchnorm`` (what its ``checkpoint_wrapper`` applies): no
    running-statistics update in the first forward, run without autograd, so that the
    recomputation makes it."""

    def pre(layer, args):
        if not torch.is_grad_enabled():
            layer._track_running_stats_backup = layer.track_running_stats
            layer.track_running_stats = False

    def post(layer, args, output):
        if not torch.is_grad_enabled():
            layer.track_running_stats = layer._track_running_stats_backup

    for layer in module.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.register_forward_pre_hook(pre)
            layer.register_forward_hook(post)


@pytest.mark.parametrize("layer", ["BatchNorm2d", "BatchNormAct2d", "SyncBatchNorm"])
def test_a_wrapper_that_moves_the_update_into_the_recomputation_still_gets_one(layer):
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), LAYERS[layer](), nn.Conv2d(4, 2, 1))
    wrapped = copy.deepcopy(plain)
    _fairscale_patch_batchnorm(wrapped)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randn(8, 3, 6, 6, generator=gen) * 2 + 1
        plain(x).square().mean().backward()
        checkpoint(wrapped, x.requires_grad_(), use_reentrant=True).square().mean().backward()
    for (name, a), b in zip(plain.named_buffers(), wrapped.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert int(wrapped[1].num_batches_tracked) == 2
