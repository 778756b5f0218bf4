"""The shape every lab experiment has: a claim, a plan of runs, a run, an analysis.

An :class:`Experiment` states its claims and sources, turns a *profile* (``tiny``,
``quick``, ``full``) and a base seed into a list of :class:`RunSpec` (one per
configuration and seed), runs one spec at a time (:meth:`Experiment.run`: the result
depends only on the spec's config and seed) and analyses the finished records into
an :class:`Analysis`: verdicts per claim, tables, contributions to the articles'
comparison table, and a figure.

Lab-wide settings shared by the experiments (never tuned per claim) live here too.

Example:
    >>> spec = RunSpec("inputs", "scale=raw", {"scale": "raw"}, seed=0)
    >>> spec.run_id.startswith("inputs/scale=raw/seed=0/")
    True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .verdict import Claim

__all__ = [
    "PROFILES", "DEFAULT_PROFILE", "BASE_LR", "BASE_BATCH", "MOMENTUM", "GN_GROUPS",
    "TARGET_FRACTION", "ADAM_LR", "module_summary", "ARTICLE_BN_LN", "ARTICLE_NORM", "RunSpec",
    "Table", "Cell", "Analysis", "Experiment", "config_digest", "seeds_for", "StepCallback",
]

#: Profiles, smallest first: ``tiny`` for tests (seconds per experiment), ``quick`` for
#: ``normkit lab`` (minutes for all), ``full`` for more seeds and steps.
PROFILES = ("tiny", "quick", "full")
DEFAULT_PROFILE = "quick"

#: SGD learning rate at :data:`BASE_BATCH` (momentum :data:`MOMENTUM`), the quickstart's;
#: other batch sizes scale it linearly.
BASE_LR = 0.05
BASE_BATCH = 32
MOMENTUM = 0.9
#: Adam's default learning rate, used for the recurrent networks (Ba et al. used Adam).
ADAM_LR = 1e-3
#: GroupNorm's group count in the lab's small networks (16-100 channels): Wu & He's
#: G = 8 (24.4 % vs 24.1 % at their default 32, Table 3) keeps >= 2 channels a group.
GN_GROUPS = 8
#: "Steps to a target accuracy": the target is this fraction of the best test accuracy
#: any compared variant reached with the same seed (one rule for every experiment).
TARGET_FRACTION = 0.9

#: The two source articles (cited by title).
ARTICLE_BN_LN = "《深度学习归一化技术：BN与LN原理及应用对比》"
ARTICLE_NORM = "《归一化那些事》"

#: ``callback(done, total)`` reports a run's progress in steps.
StepCallback = Callable[[int, int], None]


def module_summary(doc: str | None) -> str:
    """The paragraphs of a module docstring between its first line and ``Example:``.

    Example:
        >>> module_summary(chr(10).join(["title", "", "What it does.", "", "Example:"]))
        'What it does.'
    """
    body = (doc or "").split("\n\n", 1)
    text = body[1] if len(body) > 1 else body[0]
    return text.split("\n\nExample:")[0].strip()


def config_digest(config: dict) -> str:
    """A short, stable hash of a JSON-able config (keys sorted).

    Example:
        >>> config_digest({"a": 1, "b": [2, 3]}) == config_digest({"b": [2, 3], "a": 1})
        True
    """
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def seeds_for(base_seed: int, n: int) -> list[int]:
    """The seeds of ``n`` repetitions: ``base_seed, base_seed + 1, ...``.

    Example:
        >>> seeds_for(7, 3)
        [7, 8, 9]
    """
    if n < 1:
        raise ValueError(f"expected at least one seed, got n={n}")
    return [base_seed + i for i in range(n)]


@dataclass(frozen=True)
class RunSpec:
    """One run: an experiment, a configuration and a seed.

    Args:
        experiment: the experiment's name.
        key: a readable label of the configuration (without the seed).
        config: everything the run needs besides the seed (JSON-able).
        seed: the run's seed; the result depends only on ``config`` and ``seed``.
        cost: a relative cost estimate, used to balance runs over ranks.
    """

    experiment: str
    key: str
    config: dict
    seed: int
    cost: float = 1.0

    @property
    def run_id(self) -> str:
        """``experiment/key/seed=S/digest``: changes whenever the config changes."""
        return f"{self.experiment}/{self.key}/seed={self.seed}/{config_digest(self.config)}"


@dataclass
class Table:
    """A results table for the report: a title, a header row and rows of strings."""

    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Cell:
    """One row of the articles' BN-vs-LN comparison table, as measured.

    Args:
        row: the row key (see :data:`normkit.lab.report.COMPARISON_ROWS`).
        bn: what was measured for BatchNorm.
        ln: what was measured for LayerNorm.
        experiment: the experiment that measured it.
        claim_ids: the claims whose verdicts say whether the article's cell holds.
    """

    row: str
    bn: str
    ln: str
    experiment: str
    claim_ids: tuple[str, ...]


@dataclass
class Analysis:
    """What an experiment's records say: verdicts, tables, comparison cells, plot data."""

    claims: list[Claim] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    complete: bool = True


class Experiment:
    """Base class of the lab's experiments (subclasses fill in the class attributes).

    Attributes:
        name: the CLI name (``normkit lab run NAME``).
        title: a one-line title.
        summary: one paragraph: what is measured and how.
        claims: ``(claim id, statement, source)`` for each claim tested.
        settings: profile -> settings dict (sizes, steps, number of seeds ``seeds``).
    """

    name: str = ""
    title: str = ""
    summary: str = ""
    claims: tuple[tuple[str, str, str], ...] = ()
    settings: dict[str, dict[str, Any]] = {}

    def profile_settings(self, profile: str) -> dict[str, Any]:
        """The settings of ``profile`` (a ValueError names the known profiles)."""
        if profile not in self.settings:
            raise ValueError(f"experiment {self.name!r} expected a profile in "
                             f"{', '.join(self.settings)}, got {profile!r}")
        return dict(self.settings[profile])

    def plan(self, profile: str, base_seed: int) -> list[RunSpec]:
        """Every run of this experiment for a profile and base seed, in a fixed order."""
        settings = self.profile_settings(profile)
        specs = []
        for seed in seeds_for(base_seed, settings["seeds"]):
            for key, config, cost in self.configs(settings):
                specs.append(RunSpec(self.name, key, config, seed, cost))
        return specs

    def configs(self, settings: dict[str, Any]) -> list[tuple[str, dict, float]]:
        """``(key, config, cost)`` of every configuration (each run once per seed)."""
        raise NotImplementedError(f"{type(self).__name__} must define configs()")

    def run(self, config: dict, seed: int, on_step: StepCallback | None = None) -> dict:
        """Run one configuration with one seed; returns a JSON-able result.

        Wall-clock measurements go under the key ``"timing"`` (they differ between
        runs of the same seed); everything else must be a function of config and seed.
        """
        raise NotImplementedError(f"{type(self).__name__} must define run()")

    def analyze(self, records: Sequence[dict]) -> Analysis:
        """Verdicts, tables and comparison cells from this experiment's finished records."""
        raise NotImplementedError(f"{type(self).__name__} must define analyze()")

    def figure(self, analysis: Analysis):
        """One matplotlib figure of the analysis (``matplotlib.figure.Figure``)."""
        raise NotImplementedError(f"{type(self).__name__} must define figure()")

    def claim_text(self, claim_id: str) -> tuple[str, str]:
        """``(statement, source)`` of one of this experiment's claims."""
        for cid, statement, source in self.claims:
            if cid == claim_id:
                return statement, source
        raise KeyError(f"experiment {self.name!r} has no claim {claim_id!r}; it has "
                       f"{', '.join(c[0] for c in self.claims)}")

    def make_claim(self, claim_id: str, checks, note: str = "") -> Claim:
        """The :class:`Claim` ``claim_id`` with its measured checks."""
        statement, source = self.claim_text(claim_id)
        return Claim(claim_id, statement, source, tuple(checks), note)
