"""``normkit lab`` on 2 gloo ranks gives the records and report of a single process.

Two processes are started the way ``torchrun --nproc_per_node 2 -m normkit.lab ...``
starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with a hard time
limit; their merged ``results.jsonl`` and ``report.md`` are compared with a
single-process run of the same experiments, seeds and thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import free_port

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from normkit.lab.experiments import get_experiment  # noqa: E402
from normkit.lab.report import write_report  # noqa: E402
from normkit.lab.runner import run_plan  # noqa: E402
from normkit.lab.store import RESULTS, deterministic_view  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
NAMES = ("inputs", "invariances")
TIMEOUT = 120


def _records(out: Path) -> list[dict]:
    return [deterministic_view(json.loads(line))
            for line in (out / RESULTS).read_text().splitlines() if line.strip()]


def _report_without_wall_clock(out: Path) -> str:
    return "\n".join(line for line in (out / "report.md").read_text().splitlines()
                     if "compute time of the runs" not in line)


def test_two_gloo_ranks_equal_one_process(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    port = free_port()
    env_base = dict(os.environ)
    env_base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC),
                                                           env_base.get("PYTHONPATH")]))
    procs = []
    for rank in range(2):
        env = {**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "normkit.lab", "run", *NAMES, "--profile", "tiny",
             "--out", str(multi), "--threads", "1", "--progress", "none"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err}"
    assert "on 2 ranks" in outputs[0][1]
    # (torch 2.8's gloo prints "[Gloo] Rank r is connected to ..." on stdout itself)
    quiet = ["\n".join(line for line in out.splitlines() if not line.startswith("[Gloo]"))
             for out, _ in outputs]
    assert "Report:" in quiet[0] and quiet[1] == ""
    assert not list(multi.glob("results.rank*.jsonl"))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_plan([get_experiment(n) for n in NAMES], "tiny", 0, single, progress="none",
                 log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    write_report(single)
    assert _records(multi) == _records(single)
    assert _report_without_wall_clock(multi) == _report_without_wall_clock(single)
