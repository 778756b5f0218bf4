"""normkit lab: measure the articles' claims about normalization on real data.

``normkit lab`` runs every experiment (:mod:`normkit.lab.experiments`) with the quick
profile and writes a report (``report.md`` and a self-contained ``report.html``) with
one figure per experiment, the articles' BN-vs-LN comparison table filled with measured
values, and a verdict per claim computed from the data (:mod:`normkit.lab.verdict`).
``normkit lab compare`` does the same kind of comparison on your own model and data.
See :func:`normkit.lab.cli.main` for the command line.

Example:
    >>> from normkit.lab import experiment_names
    >>> experiment_names()
    ['inputs', 'bn-learning-rate', 'lr-sensitivity', 'batch-size', 'rnn', 'transformer',
     'train-eval-gap', 'smoothness', 'weight-norm', 'ln-init', 'half-precision', 'norm-free',
     'invariances', 'cost']
"""

from __future__ import annotations

from .experiments import EXPERIMENTS, get_experiment
from .experiments import names as experiment_names

__all__ = ["EXPERIMENTS", "get_experiment", "experiment_names"]
