"""Saved runs before and after a change, row by row (``normkit bench --compare``).

A change to a fast path is shown by the same ``normkit bench`` command run at the commit
before it and at the commit after it, alternated, several times each: on a noisy machine
one run per side says little. :func:`compare` pools the ratio to torch of every row (op,
shape, layout, pass, threads) over the runs of each side and gives the range on each
side, the change of the medians, and a verdict that only trusts ranges which do not
overlap: ``faster`` when every run after beats every run before, ``slower`` in the other
direction, ``within noise`` otherwise. :func:`markdown_lines` writes the table that
``benchmarks/RESULTS.md`` sections show, with the commits each side's runs measured
(``environment["normkit_commit"]``, recorded by runs since it exists).

Example:
    >>> def run(ratio, commit):
    ...     return {"environment": {"device": "cpu", "dtype": "float32",
    ...                             "param_dtype": "float32", "normkit_commit": commit},
    ...             "results": [{"op": "rms_norm", "shape": [4096, 768],
    ...                          "layout": "contiguous", "pass": "fwd+bwd", "threads": 1,
    ...                          "impls": {"normkit": {"ratio": ratio}}}]}
    >>> [row] = compare([run(2.1, "a1"), run(2.3, "a1")], [run(2.6, "b2"), run(2.7, "b2")])
    >>> row["before"], row["after"], row["verdict"]
    ((2.1, 2.3), (2.6, 2.7), 'faster')
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["compare", "markdown_lines", "VERDICTS"]

#: The verdicts :func:`compare` gives a row.
VERDICTS = ("faster", "slower", "within noise")

#: What must agree between the runs of the two sides for their ratios to be comparable.
_SAME = ("device", "dtype", "param_dtype")


def _key(record: dict) -> tuple:
    """``(op, shape, layout, pass, threads)`` of a result record."""
    return (record["op"], tuple(record["shape"]), record["layout"], record["pass"],
            record["threads"])


def _ratios(docs: Sequence[dict], implementation: str) -> dict[tuple, list[float]]:
    """Every row's ratios to torch of ``implementation`` over ``docs``, in run order."""
    pooled: dict[tuple, list[float]] = {}
    for doc in docs:
        for record in doc.get("results", []):
            ratio = record.get("impls", {}).get(implementation, {}).get("ratio")
            if ratio is not None:
                pooled.setdefault(_key(record), []).append(float(ratio))
    return pooled


def _setting(docs: Sequence[dict], name: str) -> set:
    return {doc.get("environment", {}).get(name) for doc in docs}


def compare(before: Sequence[dict], after: Sequence[dict],
            implementation: str = "normkit") -> list[dict]:
    """One dict per row measured on both sides, in the order of the first run after.

    Each has ``op``, ``shape`` (a tuple), ``layout``, ``pass``, ``threads``, ``before``
    and ``after`` (the lowest and highest ratio to torch over that side's runs),
    ``runs`` (how many runs of each side measured the row), ``change`` (median after /
    median before) and ``verdict`` (one of :data:`VERDICTS`).

    Raises:
        ValueError: a side without runs, or runs whose device, dtype or parameter dtype
            differ (their ratios are not comparable).
    """
    if not before or not after:
        raise ValueError(f"compare needs at least one run on each side, got "
                         f"{len(before)} before and {len(after)} after")
    for name in _SAME:
        values = _setting([*before, *after], name)
        if len(values) > 1:
            shown = ", ".join(sorted(map(str, values)))
            raise ValueError(f"the runs to compare differ in {name} ({shown}): compare runs "
                             f"of the same command")
    old, new = _ratios(before, implementation), _ratios(after, implementation)
    rows = []
    for key, ratios in new.items():
        if key not in old:
            continue
        was = old[key]
        low, high = min(ratios), max(ratios)
        if low > max(was):
            verdict = "faster"
        elif high < min(was):
            verdict = "slower"
        else:
            verdict = "within noise"
        op, shape, layout, pass_, threads = key
        rows.append({"op": op, "shape": shape, "layout": layout, "pass": pass_,
                     "threads": threads, "before": (min(was), max(was)),
                     "after": (low, high), "runs": (len(was), len(ratios)),
                     "change": statistics.median(ratios) / statistics.median(was),
                     "verdict": verdict})
    return rows


def _span(values: tuple[float, float]) -> str:
    low, high = values
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def _shape(row: dict) -> str:
    text = "x".join(map(str, row["shape"]))
    return f"{text} cl" if row["layout"] == "channels_last" else text


def _commits(docs: Sequence[dict]) -> str:
    commits = [doc.get("environment", {}).get("normkit_commit") for doc in docs]
    known = list(dict.fromkeys(c for c in commits if c))
    text = ", ".join(known) if known else "commit not recorded"
    return f"{len(docs)} run(s), {text}"


def markdown_lines(before: Sequence[dict], after: Sequence[dict],
                   implementation: str = "normkit", changed_only: bool = False) -> list[str]:
    """The comparison as Markdown lines: what each side is, the table (every row, or with
    ``changed_only`` those whose verdict is not ``within noise``), and the rows measured
    on one side only. Raises what :func:`compare` raises.

    Example:
        >>> doc = {"environment": {"device": "cpu", "dtype": "float32"}, "results": [
        ...     {"op": "layer_norm", "shape": [7, 33], "layout": "contiguous",
        ...      "pass": "fwd", "threads": 2, "impls": {"normkit": {"ratio": 0.5}}}]}
        >>> print("\\n".join(markdown_lines([doc], [doc])[2:5]))
        | op | shape | pass | threads | before | after | after / before | verdict |
        |---|---|---|---:|---:|---:|---:|---|
        | layer_norm | 7x33 | fwd | 2 | 0.50x | 0.50x | 1.00 | within noise |
    """
    rows = compare(before, after, implementation)
    shown = [row for row in rows if not changed_only or row["verdict"] != "within noise"]
    env = before[0].get("environment", {})
    lines = [f"{implementation} / torch eager, {env.get('device')} {env.get('dtype')}: before "
             f"{_commits(before)}; after {_commits(after)}. Verdict: the ranges do not "
             f"overlap (faster, slower) or do (within noise).", ""]
    lines += ["| op | shape | pass | threads | before | after | after / before | verdict |",
              "|---|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {row['op']} | {_shape(row)} | {row['pass']} | {row['threads']} | "
              f"{_span(row['before'])} | {_span(row['after'])} | {row['change']:.2f} | "
              f"{row['verdict']} |" for row in shown]
    if not shown:
        lines.append("| (no row changed beyond the noise) | | | | | | | |")
    old, new = _ratios(before, implementation), _ratios(after, implementation)
    for side, keys in (("before", old.keys() - new.keys()), ("after", new.keys() - old.keys())):
        if keys:
            names = ", ".join(sorted(f"{op} {'x'.join(map(str, shape))}"
                                     f"{' cl' if layout == 'channels_last' else ''} {pass_} "
                                     f"{threads}t" for op, shape, layout, pass_, threads in keys))
            lines += ["", f"Measured {side} only: {names}."]
    counts = {verdict: sum(row["verdict"] == verdict for row in rows) for verdict in VERDICTS}
    lines += ["", f"{len(rows)} rows: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + "."]
    return lines
