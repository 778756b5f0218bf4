"""``normkit lab compare``: your model and data, with each normalization, at each batch size.

The model factory (``pkg.module:make_model``, called with no arguments) returns a
``torch.nn.Module`` with normalization layers; :func:`normkit.convert_norms` swaps
them for each requested family (``bn``, ``gn``, ``ln``, ``in``, ``rms``, ``pn``, ``none``: the
registry names it accepts for the layers the model has). The data factory
(``pkg.module:make_loaders``) is called as ``make_loaders(batch_size)`` (and with
``seed=`` if it accepts it) and returns ``(train_loader, test_loader)``: iterables of
``(input, target)`` batches. Integer targets mean classification (cross-entropy,
accuracy), floating targets regression (mean squared error).

Every variant gets the same budget: the same epochs, SGD with momentum 0.9 (or Adam)
at ``--lr`` for the largest batch size, scaled linearly for the others, and the same
initial weights for a given seed (the factory runs after ``torch.manual_seed(seed)``).
A trailing training batch of one example is skipped (BatchNorm cannot train on it).
The report gives the test metric per norm and batch size over seeds, and recommends,
per batch size, the best norm, counting as tied the norms within the noise (one test
example, or the best variant's spread over seeds).

Example:
    >>> exp = CompareExperiment("m:make_model", "m:make_loaders", ["bn", "gn"], [32, 8],
    ...                         epochs=1, seeds=2)
    >>> [s.key for s in exp.plan("quick", 0)][:3]
    ['norm=bn,batch=32', 'norm=bn,batch=8', 'norm=gn,batch=32']
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..tools.convert import convert_norms
from .core import MOMENTUM, Analysis, Experiment, Table
from .experiments._common import fmt_pm, mean, sd
from .training import make_optimizer
from .verdict import points_resolution

__all__ = ["CompareExperiment", "load_object", "build_variant", "call_loaders"]


def load_object(spec: str, what: str) -> Any:
    """Import the object a ``module:attribute`` spec names (from the cwd or sys.path).

    Example:
        >>> load_object("torch.nn:Identity", "--model").__name__
        'Identity'
        >>> load_object("torch.nn", "--model")
        Traceback (most recent call last):
        ...
        ValueError: --model must be 'module:attribute' (e.g. 'mymodels:make_model'), got 'torch.nn'
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{what} must be 'module:attribute' (e.g. 'mymodels:make_model'), "
                         f"got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"{what} {spec!r}: expected an importable module {module_name!r} "
                         f"(from the current directory or sys.path), got "
                         f"{type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: expected module {module_name!r} to define "
                             f"{attribute!r}, got no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def build_variant(model_spec: str, norm: str, seed: int) -> nn.Module:
    """The user's model, built after ``torch.manual_seed(seed)``, with norms ``norm``.

    Example:
        >>> build_variant("torch.nn:Identity", "gn", 0)
        Traceback (most recent call last):
        ...
        ValueError: expected a model holding normalization layers, got a Identity without any
    """
    factory = load_object(model_spec, "--model")
    torch.manual_seed(seed)
    try:
        model = factory() if callable(factory) and not isinstance(factory, nn.Module) \
            else factory
    except Exception as exc:
        raise ValueError(f"--model {model_spec!r}: calling it raised {type(exc).__name__}: "
                         f"{exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {model_spec!r}: expected a torch.nn.Module (or a callable "
                         f"returning one), got {type(model).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dropped affine parameters: expected when swapping
        return convert_norms(model, norm)


def call_loaders(data_spec: str, batch_size: int, seed: int):
    """``(train_loader, test_loader)`` from the data factory, for ``batch_size``.

    The factory is called as ``make_loaders(batch_size)``, with ``seed=seed`` added when
    its signature accepts a ``seed`` argument.
    """
    factory = load_object(data_spec, "--data")
    kwargs = {}
    try:
        if "seed" in inspect.signature(factory).parameters:
            kwargs["seed"] = seed
    except (TypeError, ValueError):
        pass
    try:
        loaders = factory(batch_size, **kwargs)
    except Exception as exc:
        raise ValueError(f"--data {data_spec!r}: calling it with batch_size={batch_size} "
                         f"raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(loaders, (tuple, list)) and len(loaders) == 2):
        raise ValueError(f"--data {data_spec!r}: expected (train_loader, test_loader), got "
                         f"{type(loaders).__name__}")
    return loaders


def _split(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    raise ValueError(f"expected (input, target) batches from the loaders, got "
                     f"{type(batch).__name__}")


def _prediction(out) -> torch.Tensor:
    """The model's prediction in its output: the tensor itself, a Hugging Face output's
    ``logits``, or a tuple's first element (``(logits, aux)``).

    Example:
        >>> _prediction((torch.ones(2, 3), "aux")).shape
        torch.Size([2, 3])
    """
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"compare expected the model to return its predictions (logits) as a "
                    f"tensor, an output with .logits (Hugging Face) or a tuple whose first "
                    f"element is the logits, got {type(out).__name__}")


def _loss(out, y: torch.Tensor) -> torch.Tensor:
    out = _prediction(out)
    if y.dtype.is_floating_point:
        return nn.functional.mse_loss(out, y.reshape(out.shape))
    return nn.functional.cross_entropy(out, y)


class CompareExperiment(Experiment):
    """Swap the norms of a user's model and train each variant with the same budget."""

    name = "compare"
    title = "Your model: normalizations compared"
    claims = ()

    def __init__(self, model: str, data: str, norms: list[str], batch_sizes: list[int], *,
                 epochs: int = 3, lr: float = 0.05, optimizer: str = "sgd", seeds: int = 2,
                 scale_lr: bool = True) -> None:
        if not norms or not batch_sizes:
            raise ValueError("compare expected at least one norm and one batch size, got "
                             f"norms={norms}, batch_sizes={batch_sizes}")
        self.options = {"model": model, "data": data, "norms": list(norms),
                        "batch_sizes": [int(b) for b in batch_sizes], "epochs": int(epochs),
                        "lr": float(lr), "optimizer": optimizer, "seeds": int(seeds),
                        "scale_lr": bool(scale_lr)}
        self.summary = (
            f"The model `{model}` with its normalization layers swapped by "
            f"`normkit.convert_norms` for each of {', '.join(norms)}, trained on `{data}` at "
            f"batch sizes {', '.join(map(str, batch_sizes))} with the same budget: "
            f"{epochs} epoch(s), {optimizer.upper()}"
            + (f" (momentum {MOMENTUM})" if optimizer == "sgd" else "")
            + f", learning rate {lr:g} at batch {max(batch_sizes)}"
            + (" scaled linearly with the batch size" if scale_lr else " at every batch size")
            + f"; {seeds} seed(s), each variant starting from the same weights for a seed.")

    @classmethod
    def from_manifest(cls, entry: dict) -> CompareExperiment:
        """Rebuild the experiment from its manifest entry (for ``normkit lab report``)."""
        o = dict(entry["options"])
        return cls(o.pop("model"), o.pop("data"), o.pop("norms"), o.pop("batch_sizes"), **o)

    @property
    def settings(self) -> dict:  # type: ignore[override]
        """The options under every profile name (compare has no profiles)."""
        return {p: dict(self.options) for p in ("tiny", "quick", "full")}

    def lr_for(self, batch_size: int) -> float:
        """The learning rate of a batch size (linear scaling from the largest)."""
        o = self.options
        return o["lr"] * batch_size / max(o["batch_sizes"]) if o["scale_lr"] else o["lr"]

    def configs(self, settings):
        """One configuration per (norm, batch size); cost ~ epochs / batch size."""
        o = self.options
        return [(f"norm={n},batch={b}",
                 {"model": o["model"], "data": o["data"], "norm": n, "batch_size": b,
                  "epochs": o["epochs"], "lr": self.lr_for(b), "optimizer": o["optimizer"]},
                 o["epochs"] / b) for n in o["norms"] for b in o["batch_sizes"]]

    def run(self, config, seed, on_step=None):
        """Build the variant, train it for the epochs, measure it on the test loader."""
        model = build_variant(config["model"], config["norm"], seed)
        train_loader, test_loader = call_loaders(config["data"], config["batch_size"], seed)
        torch.manual_seed(seed)
        opt = make_optimizer(config["optimizer"], model.parameters(), config["lr"])
        try:
            total = config["epochs"] * len(train_loader)
        except TypeError:
            total = 0
        steps, last_epoch, diverged, error = 0, math.nan, False, None
        try:
            for _ in range(config["epochs"]):
                model.train()
                losses = []
                for batch in train_loader:
                    x, y = _split(batch)
                    if x.shape[0] < 2:
                        continue
                    loss = _loss(model(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    steps += 1
                    if not math.isfinite(loss.item()):
                        diverged = True
                        break
                    losses.append(loss.item())
                    if on_step is not None:
                        on_step(steps, max(total, steps))
                last_epoch = mean(losses)
                if diverged:
                    break
        except RuntimeError as exc:  # e.g. a norm that cannot train at this batch size
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        out = {"steps": steps, "train_loss": last_epoch, "diverged": diverged, "error": error}
        correct, total_loss, n, classification = 0.0, 0.0, 0, True
        if error is None:
            model.eval()
            with torch.no_grad():
                for batch in test_loader:
                    x, y = _split(batch)
                    pred = _prediction(model(x))
                    classification = not y.dtype.is_floating_point
                    total_loss += _loss(pred, y).item() * x.shape[0]
                    if classification:
                        correct += (pred.argmax(dim=1) == y).sum().item()
                    n += x.shape[0]
        out.update({"classification": classification, "n_test": n,
                    "test_loss": total_loss / n if n else None,
                    "test_acc": correct / n if n and classification else None})
        return out

    def analyze(self, records):
        """The metric per norm and batch size, and the recommendation per batch size."""
        analysis = Analysis()
        o = self.options
        res = {(r["config"]["norm"], r["config"]["batch_size"], r["seed"]): r["result"]
               for r in records}
        seeds = sorted({r["seed"] for r in records})
        analysis.complete = len(records) == len(o["norms"]) * len(o["batch_sizes"]) * len(seeds)
        if not records:
            return analysis
        first = records[0]["result"]
        classification = first["classification"]
        n_test = max(r["result"]["n_test"] for r in records) or 1

        def metric(norm, bs):
            vals = []
            for s in seeds:
                r = res.get((norm, bs, s))
                if r is None or r["error"] is not None or r["diverged"]:
                    vals.append(None)
                elif classification:
                    vals.append(100 * r["test_acc"])
                else:
                    vals.append(r["test_loss"])
            return vals

        label = "test accuracy (%)" if classification else "test loss (MSE)"
        better = max if classification else min
        rows, recommendations, wins = [], [], {n: 0 for n in o["norms"]}
        for bs in sorted(o["batch_sizes"], reverse=True):
            values = {n: metric(n, bs) for n in o["norms"]}
            usable = {n: v for n, v in values.items() if v and all(x is not None for x in v)}
            for n in o["norms"]:
                errs = [res[(n, bs, s)]["error"] for s in seeds
                        if (n, bs, s) in res and res[(n, bs, s)]["error"]]
                text = fmt_pm(values[n]) if n in usable else (
                    f"failed: {errs[0]}" if errs else "diverged or missing")
                rows.append([str(bs), n, text])
            if not usable:
                recommendations.append(f"batch {bs}: no variant finished")
                continue
            best = better(usable, key=lambda n: mean(usable[n]))
            noise = max(points_resolution(n_test) if classification else 0.0,
                        sd(usable[best]))
            # (a relative slack: one test example apart is a tie, whatever the rounding of
            # the two accuracies' difference)
            tied = [n for n in usable if n != best
                    and abs(mean(usable[n]) - mean(usable[best])) <= noise * (1 + 1e-9)]
            for n in (best, *tied):
                wins[n] += 1
            text = f"batch {bs}: **{best}** ({mean(usable[best]):.4g})"
            if tied:
                text += (" — tied within the noise (±" f"{noise:.3g}) with "
                         + ", ".join(f"{n} ({mean(usable[n]):.4g})" for n in tied))
            recommendations.append(text)
        analysis.tables.append(Table(
            f"{label}, mean ± sd over {len(seeds)} seed(s)", ["batch size", "norm", label],
            rows))
        top = max(wins.values())
        overall = [n for n in o["norms"] if wins[n] == top and top > 0]
        analysis.notes.append("**Recommendation** (best, or tied with the best, at the most "
                              f"batch sizes): **{', '.join(overall) or 'none'}**.")
        analysis.notes.extend(f"- {r}" for r in recommendations)
        analysis.notes.append(
            f"Ties: a difference within one test example ({points_resolution(n_test):.3g} "
            "points) or the best variant's standard deviation over seeds counts as no "
            "difference." if classification else
            "Ties: a difference within the best variant's standard deviation over seeds counts "
            "as no difference.")
        analysis.series = {"label": label, "sizes": sorted(o["batch_sizes"], reverse=True),
                           "values": {n: [metric(n, bs) for bs in sorted(o["batch_sizes"],
                                                                         reverse=True)]
                                      for n in o["norms"]}}
        return analysis

    def figure(self, analysis):
        """The test metric against the batch size, one line per norm."""
        from .figures import COLORS, errorbar_series, new_figure

        fig, (ax,) = new_figure(1, width=6.0)
        sizes = analysis.series["sizes"]
        for n, vals in analysis.series["values"].items():
            errorbar_series(ax, sizes, vals, n, COLORS.get(n))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.invert_xaxis()
        ax.set_xlabel("batch size")
        ax.set_ylabel(analysis.series["label"])
        ax.set_title("your model: metric vs batch size (min-max over seeds)")
        ax.legend(fontsize=8)
        return fig
