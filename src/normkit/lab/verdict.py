"""Verdicts computed from the data: one rule for every claim the lab tests.

A claim is tested by one or more *checks*. A check is one comparison in one setting
(e.g. "depth 6, learning rate x1: steps without BN / steps with BN"), measured once
per seed and oriented so that a **positive effect supports the claim**. A check's
outcome follows one rule, the same for every claim:

* ``supports``: the mean effect exceeds the metric's *resolution* and every seed
  shows the effect in the claimed direction;
* ``contradicts``: the mirror image (mean below ``-resolution``, every seed opposite);
* ``inconclusive``: anything else (seeds disagree, or the effect is below resolution).

Resolutions are fixed per kind of metric, never per claim: one test example for
accuracies (:func:`points_resolution`), 10 % for ratios (steps, times, losses, drifts:
``log2(1.1)``) and a relative ``1e-6`` for exact float64 comparisons (:data:`RESOLUTION`).
A claim is ``reproduced`` when all its checks support it, ``not reproduced`` when none does, and
``mixed`` otherwise. With ``n`` seeds, the chance that all agree by luck is ``2**-n``
per direction, which is why the report prints ``n`` and the spread next to every effect.

Example:
    >>> check = Check("depth 3", (0.8, 1.1, 0.9), "log2 ratio", RESOLUTION["ratio"])
    >>> check.outcome, round(check.summary.mean, 2)
    ('supports', 0.93)
    >>> Claim("x", "BN trains faster", "Ioffe & Szegedy 2015", (check,)).verdict
    'reproduced'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "RESOLUTION", "points_resolution", "Summary", "summarize", "Check", "ExactCheck", "Claim",
    "combine_verdicts", "log2_ratio", "fmt_effect",
]

#: Smallest effect the lab treats as measurable, per kind of metric (not per claim):
#: ``ratio`` for log2 ratios (10 %), ``exact`` for relative float64 differences.
RESOLUTION: dict[str, float] = {
    "ratio": math.log2(1.1),
    "exact": 1e-6,
}

SUPPORTS, CONTRADICTS, INCONCLUSIVE = "supports", "contradicts", "inconclusive"
REPRODUCED, NOT_REPRODUCED, MIXED = "reproduced", "not reproduced", "mixed"


def points_resolution(n_test: int) -> float:
    """One test example in percentage points: the resolution of accuracy differences.

    Example:
        >>> round(points_resolution(450), 4)
        0.2222
    """
    if n_test < 1:
        raise ValueError(f"points_resolution expected a positive test-set size, got {n_test}")
    return 100.0 / n_test


@dataclass(frozen=True)
class Summary:
    """Mean, sample standard deviation, extremes and count of per-seed values.

    Example:
        >>> s = summarize([1.0, 2.0, 3.0])
        >>> (s.mean, s.sd, s.low, s.high, s.n)
        (2.0, 1.0, 1.0, 3.0, 3)
    """

    mean: float
    sd: float
    low: float
    high: float
    n: int

    @property
    def standardized(self) -> float | None:
        """``mean / sd`` (a Cohen's-d-like effect size); ``None`` with fewer than 2 values
        or no spread."""
        if self.n < 2 or self.sd == 0 or not math.isfinite(self.sd):
            return None
        return self.mean / self.sd


def summarize(values: Sequence[float]) -> Summary:
    """Summarize per-seed values (non-finite values are rejected).

    Example:
        >>> summarize([0.5]).sd
        0.0
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("summarize expected at least one value, got none")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"summarize expected finite values, got {vals}")
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return Summary(statistics.fmean(vals), sd, min(vals), max(vals), len(vals))


def log2_ratio(numerator: float, denominator: float) -> float:
    """``log2(numerator / denominator)``: +1 means twice as large, -1 half as large.

    Example:
        >>> log2_ratio(400, 100)
        2.0
    """
    if numerator <= 0 or denominator <= 0:
        raise ValueError(f"log2_ratio expected positive values, got {numerator} and "
                         f"{denominator}")
    return math.log2(numerator / denominator)


def fmt_effect(summary: Summary, unit: str = "", digits: int = 3) -> str:
    """``+0.93 ± 0.15 (n=3, range +0.80…+1.10)``: the effect with its spread.

    Example:
        >>> fmt_effect(summarize([0.8, 1.1, 0.9]), "log2")
        '+0.933 ± 0.153 log2 (n=3, range +0.8…+1.1)'
    """
    unit = f" {unit}" if unit else ""
    text = f"{summary.mean:+.{digits}g} ± {summary.sd:.{digits}g}{unit} (n={summary.n}"
    if summary.n > 1:
        text += f", range {summary.low:+.{digits}g}…{summary.high:+.{digits}g}"
    return text + ")"


@dataclass(frozen=True)
class Check:
    """One comparison behind a claim, one effect per seed, positive = supports the claim.

    Args:
        label: the setting, e.g. ``"CNN, batch 32 -> 2"``.
        effects: one value per seed, oriented so that > 0 supports the claim.
        unit: how to read an effect, e.g. ``"log2 ratio"`` or ``"points"``.
        resolution: the smallest effect that counts (see :data:`RESOLUTION`).
        detail: the raw numbers behind the effect, for the report.

    Example:
        >>> Check("a", (0.5, -0.1), "points", 0.2).outcome
        'inconclusive'
        >>> Check("a", (-0.5, -0.4), "points", 0.2).outcome
        'contradicts'
    """

    label: str
    effects: tuple[float, ...]
    unit: str
    resolution: float
    detail: str = ""

    @property
    def summary(self) -> Summary:
        """The per-seed effects summarized."""
        return summarize(self.effects)

    @property
    def outcome(self) -> str:
        """``supports``, ``contradicts`` or ``inconclusive`` (see the module docstring)."""
        s = self.summary
        if s.mean > self.resolution and s.low > 0:
            return SUPPORTS
        if s.mean < -self.resolution and s.high < 0:
            return CONTRADICTS
        return INCONCLUSIVE

    def effect_text(self) -> str:
        """The effect with its spread, e.g. ``+1.2 ± 0.3 points (n=3, range …)``."""
        return fmt_effect(self.summary, self.unit)


@dataclass(frozen=True)
class ExactCheck:
    """A yes/no property measured exactly (e.g. an invariance): expected vs measured.

    ``measured`` holds one boolean per seed; the check supports the claim when every
    seed measured what the claim expects, contradicts it when every seed measured the
    opposite.

    Example:
        >>> ExactCheck("BN, dataset re-scaling", True, (True, True), "max |diff| 3e-15").outcome
        'supports'
    """

    label: str
    expected: bool
    measured: tuple[bool, ...]
    detail: str = ""
    unit: str = "yes/no"

    @property
    def outcome(self) -> str:
        """``supports``, ``contradicts`` or ``inconclusive``."""
        if all(m == self.expected for m in self.measured):
            return SUPPORTS
        if all(m != self.expected for m in self.measured):
            return CONTRADICTS
        return INCONCLUSIVE

    def effect_text(self) -> str:
        """``expected yes, measured yes (3/3 seeds)``."""
        agree = sum(m == self.expected for m in self.measured)
        word = "yes" if self.expected else "no"
        got = "yes" if self.measured and all(self.measured) else (
            "no" if not any(self.measured) else "varies")
        return f"expected {word}, measured {got} ({agree}/{len(self.measured)} seeds agree)"


@dataclass(frozen=True)
class Claim:
    """A claim, its source and its checks; the verdict follows from the checks.

    Example:
        >>> good = Check("a", (1.0, 2.0), "x", 0.1)
        >>> bad = Check("b", (-1.0, -2.0), "x", 0.1)
        >>> Claim("c", "text", "src", (good, bad)).verdict
        'mixed'
        >>> Claim("c", "text", "src", (bad,)).verdict
        'not reproduced'
    """

    id: str
    statement: str
    source: str
    checks: tuple[Check | ExactCheck, ...] = field(default_factory=tuple)
    note: str = ""

    @property
    def verdict(self) -> str:
        """``reproduced``, ``not reproduced`` or ``mixed``."""
        outcomes = [c.outcome for c in self.checks]
        if not outcomes:
            raise ValueError(f"claim {self.id!r} has no checks, so no verdict")
        if all(o == SUPPORTS for o in outcomes):
            return REPRODUCED
        if not any(o == SUPPORTS for o in outcomes):
            return NOT_REPRODUCED
        return MIXED

    def counts(self) -> dict[str, int]:
        """How many checks support, contradict, or are inconclusive."""
        outcomes = [c.outcome for c in self.checks]
        return {k: outcomes.count(k) for k in (SUPPORTS, CONTRADICTS, INCONCLUSIVE)}


def combine_verdicts(verdicts: Sequence[str]) -> str:
    """One verdict for several claims: all reproduced, none, or mixed.

    Example:
        >>> combine_verdicts(["reproduced", "reproduced"]), combine_verdicts(["reproduced",
        ...     "not reproduced"])
        ('reproduced', 'mixed')
    """
    if not verdicts:
        raise ValueError("combine_verdicts expected at least one verdict, got none")
    if all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    if all(v == NOT_REPRODUCED for v in verdicts):
        return NOT_REPRODUCED
    return MIXED
