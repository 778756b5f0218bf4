"""Helpers shared by the experiments: grouping records, targets, formatting.

Example:
    >>> group_by([{"seed": 0, "key": "a"}, {"seed": 1, "key": "a"}], "seed")
    {0: [{'seed': 0, 'key': 'a'}], 1: [{'seed': 1, 'key': 'a'}]}
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from ..core import TARGET_FRACTION, Analysis
from ..training import steps_to_target, train_classifier

__all__ = ["group_by", "mean", "sd", "fmt_pm", "target_steps", "complete_seeds", "pct",
           "begin_analysis", "train_configured"]


def group_by(records: Iterable[dict], field: str) -> dict:
    """Records grouped by a top-level field, in first-seen order."""
    out: dict = {}
    for r in records:
        out.setdefault(r[field], []).append(r)
    return out


def mean(values: Sequence[float]) -> float:
    """The mean of the non-``None`` values (NaN if there are none).

    Example:
        >>> mean([1.0, None, 3.0])
        2.0
    """
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else math.nan


def sd(values: Sequence[float]) -> float:
    """The sample standard deviation of the non-``None`` values (0 for one value)."""
    vals = [v for v in values if v is not None]
    return statistics.stdev(vals) if len(vals) > 1 else 0.0


def fmt_pm(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> str:
    """``mean ± sd`` of the values times ``scale`` (``—`` when there is none; the value
    alone when there is one: a single seed measures no spread, which "± 0" would claim;
    the tables and sentences around it name the number of seeds).

    Example:
        >>> fmt_pm([0.9, 0.92], scale=100, digits=3)
        '91 ± 1.41'
        >>> fmt_pm([0.9], scale=100, digits=3)
        '90'
    """
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return "—"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}g}"
    return f"{statistics.fmean(vals):.{digits}g} ± {sd(vals):.{digits}g}"


def pct(value: float) -> str:
    """A fraction as a percentage with one decimal.

    Example:
        >>> pct(0.9734)
        '97.3%'
    """
    return f"{100 * value:.1f}%"


def complete_seeds(records: Sequence[dict], n_configs: int) -> list[int]:
    """The seeds that have a record for every one of the ``n_configs`` configurations."""
    counts: dict[int, int] = {}
    for r in records:
        counts[r["seed"]] = counts.get(r["seed"], 0) + 1
    return sorted(s for s, c in counts.items() if c >= n_configs)


def begin_analysis(records: Sequence[dict], n_configs: int) -> tuple[Analysis, list[int]]:
    """A fresh :class:`~normkit.lab.core.Analysis` and the seeds to analyse: those with
    a record for each of the ``n_configs`` configurations; the analysis is ``complete``
    when every seed in ``records`` is one of them (an analysis without seeds is empty).

    Example:
        >>> analysis, seeds = begin_analysis([{"seed": 0}, {"seed": 0}, {"seed": 1}], 2)
        >>> seeds, analysis.complete
        ([0], False)
    """
    analysis = Analysis()
    seeds = complete_seeds(records, n_configs)
    analysis.complete = bool(seeds) and len(seeds) == len({r["seed"] for r in records})
    return analysis, seeds


def target_steps(results: dict[str, dict], budget: int) -> tuple[float, dict[str, int | None],
                                                                  dict[str, float]]:
    """Steps to the lab's target accuracy for each variant run with one seed.

    The target is :data:`normkit.lab.core.TARGET_FRACTION` of the best test accuracy
    any of the ``results`` (variant -> result with a ``curve``) reached. A variant
    that never reaches it is counted as ``budget`` plus one evaluation interval (a lower
    bound), and reported as ``None`` in the second dict.

    Returns:
        ``(target, steps or None per variant, steps used for effects per variant)``.

    Example:
        >>> res = {"a": {"curve": {"step": [0, 10, 20], "test_acc": [0.1, 0.5, 0.95]}},
        ...        "b": {"curve": {"step": [0, 10, 20], "test_acc": [0.1, 0.2, 0.3]}}}
        >>> target_steps(res, budget=20)
        (0.855, {'a': 20, 'b': None}, {'a': 20, 'b': 30})
    """
    best = max(max(a for a in r["curve"]["test_acc"] if a is not None) for r in results.values())
    target = round(TARGET_FRACTION * best, 6)
    reached, used = {}, {}
    for name, r in results.items():
        steps = r["curve"]["step"]
        interval = steps[1] - steps[0] if len(steps) > 1 else budget
        s = steps_to_target(steps, r["curve"]["test_acc"], target)
        reached[name] = s
        used[name] = s if s is not None and s > 0 else (budget + interval if s is None else 1)
    return target, reached, used


def train_configured(model, data, config: dict, seed: int, on_step=None, *,
                     optimizer: str = "adam", **options) -> dict:
    """:func:`normkit.lab.training.train_classifier` with the ``steps``, ``batch_size``,
    ``lr`` and ``evals`` of an experiment's ``config``, and the test-set size the
    verdicts' resolution needs (``n_test``) added to its result.

    Example:
        >>> import torch
        >>> from normkit.lab.datasets import digits
        >>> config = {"steps": 2, "batch_size": 8, "lr": 1e-3, "evals": 1}
        >>> out = train_configured(torch.nn.Sequential(torch.nn.Flatten(),
        ...                        torch.nn.Linear(64, 10)), digits(0, "flat"), config, 0)
        >>> out["n_test"], out["steps_run"]
        (450, 2)
    """
    out = train_classifier(model, data, steps=config["steps"],
                           batch_size=config["batch_size"], lr=config["lr"], seed=seed,
                           optimizer=optimizer, evals=config["evals"], on_step=on_step,
                           **options)
    out["n_test"] = data.n_test
    return out
