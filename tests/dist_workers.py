"""Rank functions for the multi-process tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import normkit
from normkit.data import Standardizer


def full_batch(sizes, channels, spatial, seed):
    """The concatenated batch every rank can rebuild, and the slice bounds per rank."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    x = torch.randn((total, channels, *spatial), generator=gen, dtype=torch.float64) * 2 + 3
    grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
    return x, grad, bounds


def sync_bn_step(rank, world, sizes, channels, spatial, dtype, steps, momentum):
    """Train-mode SyncBatchNorm steps on this rank's slice; returns everything to compare."""
    x_all, g_all, bounds = full_batch(sizes, channels, spatial, seed=0)
    lo, hi = bounds[rank], bounds[rank + 1]
    torch.manual_seed(0)
    bn = normkit.SyncBatchNorm(channels, momentum=momentum).to(dtype)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    outputs = []
    for step in range(steps):
        x = (x_all[lo:hi] + step).to(dtype).requires_grad_()
        y = bn(x)
        (y * g_all[lo:hi].to(dtype)).sum().backward()
        outputs.append({"y": y.detach(), "dx": x.grad})
    return {"steps": outputs, "dweight": bn.weight.grad, "dbias": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var,
            "tracked": int(bn.num_batches_tracked)}


def channel_mismatch(rank, world):
    bn = normkit.SyncBatchNorm(3 + rank)
    try:
        bn(torch.randn(4, 3 + rank))
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def precise_model_and_batches(batches_per_rank):
    """The small MLP and every rank's batches (the same on every process)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), normkit.BatchNorm1d(4), torch.nn.ReLU(),
                                torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2)).double().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3 + 7
               for n in sum(batches_per_rank, [])]
    return model, batches


def precise_stats(rank, world, batches_per_rank):
    """update_bn_stats on this rank's batches of a small MLP; returns the statistics."""
    model, all_batches = precise_model_and_batches(batches_per_rank)
    start = sum(len(b) for b in batches_per_rank[:rank])
    mine = all_batches[start:start + len(batches_per_rank[rank])]
    counts = normkit.update_bn_stats(model, mine)
    return {"counts": counts, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def standardizer_data():
    """61 x 4 float32 rows at an offset of 1e6, a fifth of them NaN (the same on every rank)."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(61, 4, generator=gen, dtype=torch.float64) * 3 + 1e6
    data[torch.rand(61, 4, generator=gen) < 0.2] = float("nan")
    return data.float()


def standardizer_fits(rank, world):
    """Standardizer.fit across ranks: uneven shards, an empty rank, errors on one rank."""
    group, data, out = dist.group.WORLD, standardizer_data(), {}
    # uneven shards: 13 rows in chunks of 5, and 48 rows from a DataLoader of (x, y)
    shard = (list(data[:13].split(5)) if rank == 0 else
             DataLoader(TensorDataset(data[13:], data[13:, :1]), batch_size=7))
    out["uneven"] = Standardizer(nan="ignore").fit(shard, process_group=group).state_dict()
    # rank 1 has no data at all
    shard = data if rank == 0 else []
    out["empty"] = Standardizer(nan="ignore").fit(shard, process_group=group).state_dict()
    # an error on one rank is raised on every rank (and keeps the previous statistics)
    s = Standardizer().fit(torch.ones(3, 4))
    try:
        s.fit(data if rank == 1 else torch.randn(5, 4), process_group=group)
    except (ValueError, RuntimeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["kept"] = s.state_dict()
    try:
        Standardizer().fit(torch.randn(4, 3 + rank), process_group=group)
    except ValueError as exc:
        out["shapes"] = str(exc)
    try:
        Standardizer().fit([], process_group=group)
    except ValueError as exc:
        out["all_empty"] = str(exc)
    return out
