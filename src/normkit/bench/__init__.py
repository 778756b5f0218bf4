"""``normkit bench``: speed and memory of normkit's ops against torch, in the same process.

Benchmarks are not tests: nothing here asserts a time. The harness measures forward,
forward+backward and peak memory of every normkit normalization op against torch
eager (and ``torch.compile``, Liger-Kernel or apex where available), on a fixed
thread count with interleaved rounds, and reports median ms, the median per-round
ratio to torch, GB/s of ideal traffic and its share of this machine's copy bandwidth.

* :mod:`~normkit.bench.ops`: the ops, their torch baselines, shape sets, ideal bytes;
* :mod:`~normkit.bench.measure`: timing, copy bandwidth, peak memory;
* :mod:`~normkit.bench.runner`: :class:`BenchConfig` and :func:`run` (the JSON document);
* :mod:`~normkit.bench.report`: Markdown and JSON;
* :mod:`~normkit.bench.cli`: ``normkit bench`` / ``python -m normkit.bench``.

Example:
    >>> from normkit.bench import BenchConfig, run, to_markdown
    >>> doc = run(BenchConfig(ops=("group_norm",), shapes="2x4x3x3:cl", repeats=2, warmup=0,
    ...                       min_time=0.0, copy_mib=1))
    >>> [(r["op"], r["layout"], r["pass"]) for r in doc["results"]]
    [('group_norm', 'channels_last', 'fwd'), ('group_norm', 'channels_last', 'fwd+bwd')]
    >>> "| group_norm | 2x4x3x3 | NHWC | fwd |" in to_markdown(doc)
    True
"""

from __future__ import annotations

from .ops import OPS, SHAPE_SETS, Op, Shape, get_op, op_names, parse_shapes
from .report import to_json, to_markdown
from .runner import SCHEMA, BenchConfig, errors, run

__all__ = [
    "OPS", "SHAPE_SETS", "Op", "Shape", "get_op", "op_names", "parse_shapes",
    "BenchConfig", "run", "errors", "SCHEMA", "to_json", "to_markdown",
]
