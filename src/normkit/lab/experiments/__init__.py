"""The lab's experiments, in report order; each module states its claims and sources.

Example:
    >>> names()[:3]
    ['inputs', 'bn-learning-rate', 'lr-sensitivity']
    >>> get_experiment("rnn").title
    'LayerNorm in recurrent networks'
"""

from __future__ import annotations

from ..core import Experiment
from .batch_size import BatchSize
from .bn_learning_rate import BNLearningRate
from .cost import Cost
from .half_precision import HalfPrecision
from .inputs import Inputs
from .invariances import Invariances
from .ln_init import LNInit
from .lr_sensitivity import LRSensitivity
from .norm_free import NormFree
from .rnn import RNN
from .smoothness import Smoothness
from .train_eval_gap import TrainEvalGap
from .transformer import TransformerNorms
from .weight_norm import WeightNormExperiment

__all__ = ["EXPERIMENTS", "names", "get_experiment"]

#: Every experiment, in the order of the report.
EXPERIMENTS: tuple[Experiment, ...] = (
    Inputs(), BNLearningRate(), LRSensitivity(), BatchSize(), RNN(), TransformerNorms(),
    TrainEvalGap(), Smoothness(), WeightNormExperiment(), LNInit(), HalfPrecision(), NormFree(),
    Invariances(), Cost(),
)


def names() -> list[str]:
    """The experiments' names, in report order.

    Example:
        >>> names()[:3]
        ['inputs', 'bn-learning-rate', 'lr-sensitivity']
    """
    return [e.name for e in EXPERIMENTS]


def get_experiment(name: str) -> Experiment:
    """The experiment called ``name`` (a ValueError lists the names).

    Example:
        >>> get_experiment("inputs").claims[0][0]
        'inputs.scale'
        >>> get_experiment("dropout")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown experiment 'dropout'; expected one of inputs, bn-learning-rate, ...
    """
    for experiment in EXPERIMENTS:
        if experiment.name == name:
            return experiment
    raise ValueError(f"unknown experiment {name!r}; expected one of {', '.join(names())}")
