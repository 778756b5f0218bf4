"""Training and measuring a classifier with a fixed step budget, deterministically.

Every run trains from ``torch.manual_seed(seed)`` with mini-batches drawn by a
``torch.Generator`` seeded with ``seed`` (epoch-wise permutations, full batches only,
so a BatchNorm never sees a batch of one), and evaluates the test set at evenly spaced
steps. The result depends only on the model, the data, the settings and the seed.

Example:
    >>> import torch
    >>> from normkit.lab.datasets import digits
    >>> from normkit.lab.models import mlp
    >>> _ = torch.manual_seed(0)
    >>> out = train_classifier(mlp("bn", depth=1, width=16), digits(0, "flat"), steps=20,
    ...                        batch_size=32, lr=0.05, seed=0, evals=2)
    >>> out["curve"]["step"], out["diverged"]
    ([0, 10, 20], False)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from .core import MOMENTUM, StepCallback
from .datasets import Split

__all__ = ["batch_indices", "evaluate", "train_classifier", "steps_to_target",
           "make_optimizer", "scaled_lr"]


def scaled_lr(batch_size: int, base_lr: float, base_batch: int) -> float:
    """Linear learning-rate scaling: ``base_lr * batch_size / base_batch``.

    Example:
        >>> scaled_lr(2, 0.05, 32)
        0.003125
    """
    return base_lr * batch_size / base_batch


def batch_indices(n: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Endless mini-batches of indices: a new permutation each epoch, full batches only.

    Example:
        >>> it = batch_indices(5, 2, torch.Generator().manual_seed(0))
        >>> [len(next(it)) for _ in range(4)]
        [2, 2, 2, 2]
    """
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be in [1, {n}] for {n} examples, got {batch_size}")
    while True:
        order = torch.randperm(n, generator=generator)
        for begin in range(0, n - batch_size + 1, batch_size):
            yield order[begin:begin + batch_size]


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 1024) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` in eval mode; restores its mode.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> acc, loss = evaluate(model, torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
        >>> 0.0 <= acc <= 1.0, model.training
        (True, True)
    """
    was_training = model.training
    model.eval()
    correct, total = 0.0, 0.0
    for begin in range(0, x.shape[0], chunk):
        logits = model(x[begin:begin + chunk])
        target = y[begin:begin + chunk]
        correct += (logits.argmax(dim=1) == target).sum().item()
        total += nn.functional.cross_entropy(logits.float(), target, reduction="sum").item()
    model.train(was_training)
    n = x.shape[0]
    return correct / n, total / n


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """``"sgd"`` (momentum :data:`normkit.lab.core.MOMENTUM`) or ``"adam"`` (defaults).

    Example:
        >>> type(make_optimizer("adam", torch.nn.Linear(2, 2).parameters(), 1e-3)).__name__
        'Adam'
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {name!r}")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def train_classifier(
    model: nn.Module,
    data: Split,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    optimizer: str = "sgd",
    evals: int = 20,
    on_step: StepCallback | None = None,
    before_step: Callable[[int], None] | None = None,
    probe: Callable[[int, Tensor, Tensor], None] | None = None,
    final_train_metrics: bool = False,
    agc: float | None = None,
) -> dict:
    """Train ``model`` for ``steps`` mini-batch steps with cross-entropy; measure it.

    Args:
        model: maps ``data.x_*`` batches to logits; trained in place.
        data: the split.
        steps: the budget in optimizer steps.
        batch_size: examples per step (full batches only).
        lr: the learning rate.
        seed: seeds torch's global generator and the mini-batch order.
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adam"``.
        evals: number of evenly spaced test evaluations (plus one at step 0).
        on_step: ``on_step(done, steps)`` after every step (progress).
        before_step: ``before_step(step)`` before every step (e.g. to resample noise).
        probe: ``probe(step, x, y)`` before the update of evaluation steps, with that
            step's batch (for measurements of the loss landscape).
        final_train_metrics: also measure accuracy and loss on the whole training set.
        agc: adaptive gradient clipping with this clip factor before every step
            (:class:`normkit.AGC`; the last ``nn.Linear``, the classifier, is left
            unclipped, as Brock et al. 2021 do), or ``None``.

    Returns:
        ``curve`` (``step``, ``test_acc``, ``test_loss``, ``train_loss``: the mean
        training loss since the previous evaluation), ``final_test_acc``,
        ``final_test_loss``, ``diverged`` (a non-finite loss stopped training),
        ``steps_run`` and, with ``final_train_metrics``, ``final_train_acc`` and
        ``final_train_loss``; ``timing`` holds the median seconds per step.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    batches = batch_indices(data.x_train.shape[0], batch_size, generator)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    if agc is not None:
        from ..tools.clip import AGC

        heads = [m for m in model.modules() if isinstance(m, nn.Linear)]
        opt = AGC(opt, clip_factor=agc, exclude=heads[-1:])
    every = max(1, steps // max(1, evals))
    eval_steps = sorted({0, *range(every, steps + 1, every), steps})
    curve: dict[str, list] = {"step": [], "test_acc": [], "test_loss": [], "train_loss": []}
    running: list[float] = []
    step_times: list[float] = []
    diverged = False

    def record(step: int) -> None:
        acc, loss = evaluate(model, data.x_test, data.y_test)
        curve["step"].append(step)
        curve["test_acc"].append(acc)
        curve["test_loss"].append(_finite(loss))
        curve["train_loss"].append(statistics.fmean(running) if running else None)
        running.clear()

    record(0)
    model.train()
    step = 0
    for step in range(1, steps + 1):
        idx = next(batches)
        x, y = data.x_train[idx], data.y_train[idx]
        if before_step is not None:
            before_step(step)
        if probe is not None and step in eval_steps:
            probe(step, x, y)
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - start)
        value = loss.item()
        if not math.isfinite(value):
            diverged = True
            running.clear()
            record(step)
            break
        running.append(value)
        if on_step is not None:
            on_step(step, steps)
        if step in eval_steps:
            record(step)
    result = {
        "curve": curve,
        "final_test_acc": curve["test_acc"][-1],
        "final_test_loss": curve["test_loss"][-1],
        "diverged": diverged,
        "steps_run": step,
        "timing": {"step_s": statistics.median(step_times)},
    }
    if final_train_metrics:
        acc, loss = evaluate(model, data.x_train, data.y_train)
        result["final_train_acc"] = acc
        result["final_train_loss"] = _finite(loss)
    return result


def steps_to_target(steps: list[int], accuracies: list[float], target: float) -> int | None:
    """The first evaluated step whose accuracy reaches ``target``; ``None`` if none does.

    Example:
        >>> steps_to_target([0, 10, 20, 30], [0.1, 0.5, 0.92, 0.95], 0.9)
        20
        >>> steps_to_target([0, 10], [0.1, 0.5], 0.9) is None
        True
    """
    for step, acc in zip(steps, accuracies, strict=True):
        if acc is not None and acc >= target:
            return step
    return None
