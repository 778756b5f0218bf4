"""Run the planned runs: resume, shard over ranks, record each finished run at once.

:func:`run_plan` takes experiments, a profile and a base seed, and

1. plans every run (:meth:`normkit.lab.core.Experiment.plan`): a fixed list, the same
   on every rank;
2. skips the runs whose records are already in the output folder (unless ``force``);
3. with ``torch.distributed`` (started from the ``RANK``/``WORLD_SIZE`` environment
   variables with the gloo backend, as ``torchrun`` sets them, or already initialized),
   shards the remaining runs over the ranks, balanced by their estimated cost;
4. runs each one from its own seed (so a result never depends on the rank or the order
   that ran it), appending its record to disk as soon as it finishes;
5. gathers the records on rank 0, which rewrites ``results.jsonl`` in plan order and
   updates the manifest.

Results depend on the seed, the config and the number of CPU threads (floating-point
reductions are split by thread); a multi-process run whose ranks use the same thread
count as a single-process run gives the same records, up to the wall-clock ``timing``.

Example:
    >>> shard_by_cost([3.0, 1.0, 1.0, 1.0], world_size=2)
    [[0], [1, 2, 3]]
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .core import Experiment, RunSpec
from .progress import NullProgress, make_progress
from .store import ResultStore, update_manifest

__all__ = ["LAB_VERSION", "Distributed", "shard_by_cost", "RunOutcome", "run_plan",
           "execute", "cpu_capability"]

#: Bumped when a record's meaning changes.
LAB_VERSION = 1


class Distributed:
    """This process's place in a torch.distributed job (rank 0 of 1 without one).

    Initializes a gloo process group from the environment when ``WORLD_SIZE`` > 1 and
    none is initialized (and destroys it in :meth:`close`).

    Example:
        >>> d = Distributed.from_env({})
        >>> (d.rank, d.world_size, d.all_gather([1]))
        (0, 1, [[1]])
    """

    def __init__(self, rank: int = 0, world_size: int = 1, created: bool = False) -> None:
        self.rank, self.world_size, self.created = rank, world_size, created

    @classmethod
    def from_env(cls, environ: dict | None = None, timeout_s: float = 1800.0) -> Distributed:
        """Join the job described by ``environ`` (default ``os.environ``), if any."""
        import torch.distributed as dist

        env = os.environ if environ is None else environ
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), False)
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_available():
            raise RuntimeError(f"WORLD_SIZE={world} asks for {world} processes, but this torch "
                               "build has no torch.distributed")
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(f"WORLD_SIZE={world} expected the environment variables RANK, "
                               f"MASTER_ADDR and MASTER_PORT (as torchrun sets them); "
                               f"missing: {', '.join(missing)}")
        dist.init_process_group("gloo", init_method="env://", rank=int(env["RANK"]),
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), world, True)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the merged results and the report."""
        return self.rank == 0

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Destroy the process group if this object created it."""
        if self.created:
            import torch.distributed as dist

            if dist.is_initialized():
                if self.world_size > 1:
                    dist.barrier()  # no rank closes its sockets while a peer still talks
                dist.destroy_process_group()
            self.created = False


def shard_by_cost(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Assign runs to ranks: largest cost first, each to the least-loaded rank.

    Deterministic (ties go to the lower rank); each rank's indices come back sorted.

    Example:
        >>> shard_by_cost([1.0, 1.0, 1.0], world_size=1)
        [[0, 1, 2]]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0.0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(index)
        loads[rank] += costs[index]
    return [sorted(s) for s in shards]


def cpu_capability() -> str:
    """The instruction set of torch's CPU kernels in this process (``"AVX512"``,
    ``"AVX2"``, ``"DEFAULT"``...; ``"?"`` where torch does not say) and the processor
    they run on (:func:`processor_model`): ``"AVX512 on GenuineIntel 6/106"``.

    The processor is part of it because MKL and oneDNN (torch's matrix products and
    convolutions) choose their code paths by processor model, beyond torch's instruction
    set level: two AVX512 Intel machines of different models gave the lab's runs
    different float32 bits.

    Example:
        >>> cpu_capability().split(" on ")[0] in ("AVX512", "AVX2", "DEFAULT", "ZVECTOR",
        ...                                       "VSX", "SVE256", "?")
        True
    """
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return f"{get() if get is not None else '?'} on {processor_model()}"


def processor_model() -> str:
    """The processor's vendor, family and model as ``/proc/cpuinfo`` gives them
    (``"GenuineIntel 6/106"``), else :func:`platform.processor` or the machine type.

    Example:
        >>> isinstance(processor_model(), str) and processor_model() != ""
        True
    """
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # (the first processor is enough)
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    if "vendor_id" in fields:
        return f"{fields['vendor_id']} {fields.get('cpu family', '?')}/{fields.get('model', '?')}"
    return platform.processor() or platform.machine() or "?"


def execute(experiment: Experiment, spec: RunSpec, on_step=None) -> dict:
    """Run one spec and return its record (``timing`` holds the wall-clock values).

    Example:
        >>> from normkit.lab.experiments import get_experiment
        >>> exp = get_experiment("invariances")
        >>> record = execute(exp, exp.plan("tiny", 0)[0])
        >>> sorted(record)
        ['config', 'cpu', 'experiment', 'key', 'result', 'run_id', 'seed', 'threads',
         'timing', 'torch', 'version']

    ``cpu`` is the instruction set torch's CPU kernels use here and the processor
    model (:func:`cpu_capability`, e.g. ``AVX512 on GenuineIntel 6/106``): with the
    torch version, what a record's bits depend on besides its seed, config and thread
    count.
    """
    torch.manual_seed(spec.seed)
    start = time.perf_counter()
    result = dict(experiment.run(spec.config, spec.seed, on_step))
    timing = dict(result.pop("timing", {}) or {})
    timing["wall_s"] = time.perf_counter() - start
    return {
        "run_id": spec.run_id, "experiment": spec.experiment, "key": spec.key,
        "seed": spec.seed, "config": spec.config, "result": result, "timing": timing,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": cpu_capability(), "version": LAB_VERSION,
    }


@dataclass
class RunOutcome:
    """What :func:`run_plan` did. ``records`` (plan order) is complete on rank 0 only."""

    records: list[dict] = field(default_factory=list)
    ran: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    is_main: bool = True
    world_size: int = 1


def run_plan(
    experiments: Sequence[Experiment],
    profile: str,
    base_seed: int,
    out_dir: str | os.PathLike,
    *,
    force: bool = False,
    progress: str = "auto",
    log: Callable[[str], None] | None = None,
    manifest_extra: dict[str, dict] | None = None,
    distributed: Distributed | None = None,
) -> RunOutcome:
    """Plan, resume, shard and run the experiments; write ``results.jsonl`` and the manifest.

    Args:
        experiments: the experiments to run.
        profile: ``tiny``, ``quick`` or ``full``.
        base_seed: the first seed (runs use ``base_seed + i``).
        out_dir: the output folder.
        force: rerun runs that already have a record.
        progress: ``auto``, ``rich``, ``plain`` or ``none`` (shown on rank 0 only).
        log: where to print status lines (default: stderr, rank 0 only).
        manifest_extra: extra manifest fields per experiment name.
        distributed: the job (default: from the environment; see :class:`Distributed`).

    Returns:
        A :class:`RunOutcome`; a failed run is reported (with its traceback on stderr)
        and the others still run.
    """
    dist_ctx = Distributed.from_env() if distributed is None else distributed
    try:
        return _run_plan(experiments, profile, base_seed, out_dir, force, progress, log,
                         manifest_extra or {}, dist_ctx)
    finally:
        if distributed is None:
            dist_ctx.close()


def _run_plan(experiments, profile, base_seed, out_dir, force, progress, log, manifest_extra,
              dist_ctx: Distributed) -> RunOutcome:
    if log is None:
        def log(text: str) -> None:
            if dist_ctx.is_main:
                print(text, file=sys.stderr, flush=True)
    by_name = {e.name: e for e in experiments}
    plan: list[RunSpec] = [spec for e in experiments for spec in e.plan(profile, base_seed)]
    planned_ids = {s.run_id for s in plan}
    store = ResultStore(out_dir, dist_ctx.rank)

    loaded = {}
    for part in dist_ctx.all_gather(store.load()):
        loaded.update(part)
    done_ids = set() if force else set(loaded) & planned_ids
    pending = [i for i, s in enumerate(plan) if s.run_id not in done_ids]
    mine = shard_by_cost([plan[i].cost for i in pending], dist_ctx.world_size)[dist_ctx.rank]
    mine = [pending[j] for j in mine]
    log(f"normkit lab: {len(plan)} runs planned ({profile} profile, base seed {base_seed}); "
        f"{len(plan) - len(pending)} already recorded in {out_dir}, {len(pending)} to run"
        + (f" on {dist_ctx.world_size} ranks" if dist_ctx.world_size > 1 else ""))

    bar = make_progress(progress, len(mine)) if dist_ctx.is_main else NullProgress()
    new: list[dict] = []
    failed: list[str] = []
    try:
        for index in mine:
            spec = plan[index]
            bar.start_run(f"{spec.experiment}/{spec.key}/seed={spec.seed}")
            try:
                record = execute(by_name[spec.experiment], spec, bar.step)
            except Exception:
                bar.end_run(ok=False)
                failed.append(spec.run_id)
                print(f"normkit lab: run {spec.run_id} failed (rank {dist_ctx.rank}):\n"
                      f"{traceback.format_exc()}", file=sys.stderr, flush=True)
                continue
            store.append(record)
            new.append(record)
            bar.end_run(ok=True)
    finally:
        bar.close()

    gathered = dist_ctx.all_gather((new, failed))
    outcome = RunOutcome(ran=len(mine), skipped=len(plan) - len(pending),
                         is_main=dist_ctx.is_main, world_size=dist_ctx.world_size)
    outcome.failed = [run_id for _, part in gathered for run_id in part]
    if dist_ctx.is_main:
        merged = dict(loaded)
        for part, _ in gathered:
            for record in part:
                merged[record["run_id"]] = record
        ordered = [merged[s.run_id] for s in plan if s.run_id in merged]
        others = [r for run_id, r in merged.items() if run_id not in planned_ids]
        ResultStore(out_dir).rewrite(ordered + others)
        entries = {}
        for e in experiments:
            entry = {"profile": profile, "base_seed": base_seed, "title": e.title,
                     "settings": e.profile_settings(profile),
                     "run_ids": [s.run_id for s in plan if s.experiment == e.name]}
            entry.update(manifest_extra.get(e.name, {}))
            entries[e.name] = entry
        update_manifest(out_dir, entries)
        outcome.records = ordered
    dist_ctx.barrier()
    return outcome
