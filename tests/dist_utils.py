"""Run a function on N local gloo ranks in fresh processes, with a hard time limit.

Each rank calls ``fn(rank, world_size, *args)`` inside an initialized gloo process
group and returns a dict of tensors/values; the parent gets the list of those dicts.
Any exception on a rank is re-raised in the parent with the rank's traceback; a rank
that does not finish within ``timeout`` seconds is killed and the test fails (never
hangs CI).
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, out_dir, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=30))
        result = {"ok": True, "value": fn(rank, world_size, *args)}
        dist.barrier()  # no rank tears its sockets down while a peer still talks to it
    except BaseException:  # report everything to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0) -> list:
    """Run ``fn`` on ``world_size`` gloo ranks; return each rank's result, in rank order."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, out_dir, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if stuck:
            raise AssertionError(f"ranks {stuck} did not finish within {timeout} s")
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} exited with code {procs[r].exitcode} "
                                     "and no result")
            result = torch.load(path, weights_only=False)
            if not result["ok"]:
                raise AssertionError(f"rank {r} failed:\n{result['error']}")
            results.append(result["value"])
        return results
