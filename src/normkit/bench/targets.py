"""Issue #6's speed targets, evaluated on ``normkit bench`` documents.

Each :class:`Target` names the rows of a bench document it is about (ops, passes,
layouts, shapes, device) and the goal their worst row must reach: a ratio to torch
eager, a % of the machine's measured copy bandwidth, or a % of the device's nominal
memory bandwidth (``--peak-gbs``). :func:`evaluate` pools the rows of one or several
documents (several runs of a noisy machine give ranges), and :func:`markdown_lines`
writes the verdicts as the table at the end of every bench report, so
``benchmarks/RESULTS.md`` states what the measurement says, not a hand-made summary.

Example:
    >>> doc = {"environment": {"device": "cpu"}, "results": [
    ...     {"op": "rms_norm", "shape": [4096, 1024], "layout": "contiguous",
    ...      "pass": "fwd+bwd", "threads": 1, "impls": {"normkit": {"ratio": 3.1}}}]}
    >>> verdict = next(v for v in evaluate([doc]) if v["target"].startswith("RMSNorm"))
    >>> verdict["rows"], verdict["low"], verdict["met"]
    (1, 3.1, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Target", "TARGETS", "evaluate", "markdown_lines"]

_CORE = ("layer_norm", "rms_norm", "batch_norm", "batch_norm_eval", "frozen_batch_norm",
         "group_norm", "instance_norm", "instance_norm_eval", "layer_norm2d")
_BOTH = ("fwd", "fwd+bwd")
_MIB = 1 << 20


def _any(shape: Sequence[int]) -> bool:
    return True


def _standard(shape: Sequence[int]) -> bool:
    """The transformer rows and CNN activations, not the small odd shapes."""
    return math.prod(shape) >= 1 << 16


def _above_64_mib(shape: Sequence[int]) -> bool:
    """float32 inputs of 64 MiB and more (4096 x 4096 and wider rows)."""
    return math.prod(shape) * 4 >= 64 * _MIB


def _rows_4096_from_1024(shape: Sequence[int]) -> bool:
    return len(shape) == 2 and shape[0] == 4096 and shape[1] >= 1024


def _widths_256_to_16384(shape: Sequence[int]) -> bool:
    return len(shape) == 2 and 256 <= shape[-1] <= 16384


@dataclass(frozen=True)
class Target:
    """One speed target: which bench rows it covers and what their worst row must reach.

    ``metric`` is ``"ratio"`` (torch eager time / normkit time), ``"pct_copy"`` (% of
    the copy bandwidth measured in the same run) or ``"pct_peak"`` (% of the nominal
    bandwidth given with ``--peak-gbs``). ``layouts`` of ``None`` accepts every layout;
    ``shapes`` is a predicate on the shape. Every target is about ``dtype`` inputs and
    modules (the issue's are float32): runs of another ``--dtype`` or ``--param-dtype``
    are not evaluated against it.
    """

    text: str
    device: str
    ops: tuple[str, ...]
    passes: tuple[str, ...]
    goal: float
    metric: str = "ratio"
    layouts: tuple[str | None, ...] | None = None
    shapes: Callable[[Sequence[int]], bool] = _any
    dtype: str = "float32"

    def covers(self, device: str, record: dict) -> bool:
        """Whether a bench row of a run on ``device`` is one this target is about."""
        return (device == self.device and record["op"] in self.ops
                and record["pass"] in self.passes
                and (self.layouts is None or record["layout"] in self.layouts)
                and self.shapes(record["shape"]))


#: The targets of issue #6, in the issue's order (CPU, then GPU).
TARGETS: tuple[Target, ...] = (
    Target("every core layer >= 1.0x (float32, fwd and fwd+bwd, every shape)", "cpu",
           _CORE, _BOTH, 1.0),
    Target("RMSNorm fwd+bwd >= 2.5x", "cpu", ("rms_norm",), ("fwd+bwd",), 2.5,
           shapes=_standard),
    Target("BatchNorm2d NCHW training fwd+bwd >= 1.5x", "cpu", ("batch_norm",),
           ("fwd+bwd",), 1.5, layouts=("contiguous",), shapes=_standard),
    Target("GroupNorm channels_last >= 1.3x (fwd and fwd+bwd)", "cpu", ("group_norm",),
           _BOTH, 1.3, layouts=("channels_last",), shapes=_standard),
    Target("LayerNorm/RMSNorm fwd >= 60% of copy bandwidth (inputs >= 64 MiB)", "cpu",
           ("layer_norm", "rms_norm"), ("fwd",), 60.0, metric="pct_copy",
           shapes=_above_64_mib),
    Target("add + LayerNorm fwd+bwd >= 1.5x", "cpu", ("add_layer_norm",), ("fwd+bwd",), 1.5,
           shapes=_standard),
    Target("add + RMSNorm fwd+bwd >= 1.5x", "cpu", ("add_rms_norm",), ("fwd+bwd",), 1.5,
           shapes=_standard),
    Target("BN/GN + activation fwd+bwd >= 1.3x", "cpu", ("batch_norm_act", "group_norm_act"),
           ("fwd+bwd",), 1.3, shapes=_standard),
    Target("LayerNorm/RMSNorm fwd >= 80% of HBM peak at 4096 x >= 1024", "cuda",
           ("layer_norm", "rms_norm"), ("fwd",), 80.0, metric="pct_peak",
           shapes=_rows_4096_from_1024),
    Target("LayerNorm/RMSNorm fwd+bwd >= 1.0x at every width 256 to 16384", "cuda",
           ("layer_norm", "rms_norm"), ("fwd+bwd",), 1.0, shapes=_widths_256_to_16384),
    Target("GroupNorm/BatchNorm channels_last >= 1.5x (fwd and fwd+bwd)", "cuda",
           ("group_norm", "batch_norm"), _BOTH, 1.5, layouts=("channels_last",),
           shapes=_standard),
)


def _value(target: Target, doc: dict, record: dict) -> float | None:
    measured = record["impls"].get("normkit") or {}
    if target.metric == "ratio":
        value = measured.get("ratio")
    elif target.metric == "pct_copy":
        value = measured.get("pct_copy")
    else:
        peak = doc["environment"].get("peak_bandwidth_gbs")
        gbs = measured.get("gbs")
        value = None if not peak or gbs is None else 100.0 * gbs / peak
    return None if value is None or not math.isfinite(value) else float(value)


def _where(record: dict) -> str:
    layout = ({"contiguous": "NCHW", "channels_last": "NHWC"}.get(record["layout"], "")
              if len(record["shape"]) == 4 else "")
    shape = "x".join(map(str, record["shape"]))
    return " ".join(filter(None, [record["op"], shape, layout, record["pass"],
                                  f"{record['threads']} thread(s)"]))


def evaluate(docs: Sequence[dict], targets: Sequence[Target] = TARGETS) -> list[dict]:
    """Verdicts of the targets over the rows of ``docs`` (bench documents, pooled).

    Each verdict: ``target``, ``metric``, ``goal``, ``rows`` (how many rows it covers),
    ``low`` and ``high`` (the range of the metric over them), ``worst`` (where ``low``
    was measured), ``below`` (how many rows miss the goal) and ``met``
    (``True``/``False``; ``None`` when no row covers it, or the metric could not be
    computed, e.g. ``pct_peak`` without ``--peak-gbs``).
    Targets of another device than every document's are left out, and so are the rows of
    documents whose dtypes are not the target's.

    Example:
        >>> row = {"op": "add_layer_norm", "shape": [4096, 1024], "layout": "contiguous",
        ...        "pass": "fwd+bwd", "threads": 2, "impls": {"normkit": {"ratio": 1.2}}}
        >>> v = next(v for v in evaluate([{"environment": {"device": "cpu"}, "results": [row]}])
        ...          if v["target"].startswith("add + LayerNorm"))
        >>> v["met"], v["below"], v["worst"]
        (False, 1, 'add_layer_norm 4096x1024 fwd+bwd 2 thread(s)')
    """
    devices = {doc["environment"]["device"] for doc in docs}
    verdicts = []
    for target in targets:
        if target.device not in devices:
            continue
        rows = [(value, record) for doc in docs if _dtypes(doc) == (target.dtype,) * 2
                for record in doc["results"]
                if target.covers(doc["environment"]["device"], record)
                for value in [_value(target, doc, record)]]
        values = [(value, record) for value, record in rows if value is not None]
        low = min(values, key=lambda item: item[0]) if values else None
        verdicts.append({
            "target": target.text, "metric": target.metric, "goal": target.goal,
            "rows": len(rows),
            "low": None if low is None else low[0],
            "high": max(value for value, _ in values) if values else None,
            "worst": None if low is None else _where(low[1]),
            "below": sum(value < target.goal for value, _ in values),
            "met": None if not values or len(values) < len(rows) else low[0] >= target.goal,
        })
    return verdicts


def _dtypes(doc: dict) -> tuple[str, str]:
    """A bench document's input and parameter dtypes (float32 where it does not say)."""
    env = doc["environment"]
    dtype = env.get("dtype", "float32")
    return dtype, env.get("param_dtype", dtype)


def _range(verdict: dict) -> str:
    if verdict["low"] is None:
        if verdict["metric"] == "pct_peak":
            return "not evaluated: give the nominal bandwidth with --peak-gbs"
        return "no value (the normkit implementation failed)"
    fmt = "{:.2f}x" if verdict["metric"] == "ratio" else "{:.0f}%"
    low, high = fmt.format(verdict["low"]), fmt.format(verdict["high"])
    text = low if low == high else f"{low[:-1]}-{high}"
    if verdict["met"]:
        return text
    return (f"{text}; {verdict['below']} of {verdict['rows']} rows below, lowest: "
            f"{verdict['worst']}")


def markdown_lines(docs: Sequence[dict]) -> list[str]:
    """The targets section of a report: a heading and one table row per target.

    Targets that cover no measured row are left out; empty when none covers any.

    Example:
        >>> row = {"op": "rms_norm", "shape": [4096, 1024], "layout": "contiguous",
        ...        "pass": "fwd+bwd", "threads": 1, "impls": {"normkit": {"ratio": 3.0}}}
        >>> lines = markdown_lines([{"environment": {"device": "cpu"}, "results": [row]}])
        >>> lines[0], lines[-1]
        ('## Issue #6 targets', '| RMSNorm fwd+bwd >= 2.5x | 1 | 3.00x | met |')
    """
    verdicts = [v for v in evaluate(docs) if v["rows"]]
    if not verdicts:
        return []
    status = {True: "met", False: "not met", None: "not evaluated"}
    lines = ["## Issue #6 targets", "",
             f"Evaluated by `normkit.bench.targets` over {len(docs)} run(s): the range of "
             "every row a target covers (all thread counts), met when its lowest row "
             "reaches the goal.", ""]
    if any(doc.get("settings", {}).get("cuda_graphs") for doc in docs):
        lines += ["Timed as CUDA graph replays (`--cuda-graphs`): the kernels alone. The "
                  "ratio targets, stated against torch eager, compare kernels here, not "
                  "eager calls.", ""]
    lines += ["| target | rows | measured | status |", "|---|---:|---|---|"]
    lines += [f"| {v['target']} | {v['rows']} | {_range(v)} | {status[v['met']]} |"
              for v in verdicts]
    return lines
