"""Quickstart: train a small CNN on scikit-learn's digits with each normkit norm.

Everything runs on the CPU in about a minute and needs no download: the data set is
:func:`sklearn.datasets.load_digits` (1797 grey 8x8 images of the digits 0-9, bundled
with scikit-learn). The same CNN is trained with each normalization layer, picked by
name through :func:`normkit.get_norm_layer`, at a large and a small batch size with
the same budget (same number of epochs, learning rate scaled linearly with the batch
size), and the script prints what it measured: test accuracy, final training loss and
seconds per epoch. It also checks that :class:`normkit.BatchNorm2d` is a drop-in
replacement for :class:`torch.nn.BatchNorm2d` by training both from identical weights
and comparing their test-set logits.

Run it with ``python -m normkit quickstart`` (``--help`` lists the options) or from
Python:

Example:
    >>> from normkit.quickstart import make_cnn
    >>> import torch
    >>> make_cnn("bn")(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import argparse
import math
import textwrap
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .registry import NormSpec, get_norm_layer

__all__ = [
    "make_cnn", "load_digits_tensors", "train", "scaled_lr", "run", "check_drop_in", "main",
]

#: Learning rate at the reference batch size; other batch sizes scale it linearly.
BASE_LR = 0.05
#: The batch size at which :data:`BASE_LR` applies.
BASE_BATCH_SIZE = 32
#: Default number of epochs for every run (the same budget for each norm/batch size).
DEFAULT_EPOCHS = 4
#: Training steps of the drop-in check.
DROP_IN_STEPS = 20

Data = tuple[Tensor, Tensor, Tensor, Tensor]


def make_cnn(
    norm: NormSpec, channels: Sequence[int] = (16, 32), num_classes: int = 10
) -> nn.Module:
    """Build a small CNN for 1x8x8 images with ``norm`` after every convolution.

    Each block is ``Conv2d(3x3, padding=1) -> norm -> ReLU -> MaxPool2d(2)`` (the
    pooling is skipped once the feature map is 1x1), followed by a flatten and a
    linear head. The norm layer is built with ``get_norm_layer(norm, C)``, so ``norm``
    is any registered name (``"bn"``, ``"gn"``, ``"ln2d"``, ``"in"``, ``"none"``, ...)
    or a norm class such as :class:`torch.nn.BatchNorm2d`. Convolutions carry a bias
    only when the norm is the identity (a norm's own shift makes it redundant).

    Args:
        norm: the normalization, by name or class (see :func:`normkit.get_norm_layer`).
        channels: output channels of each conv block.
        num_classes: outputs of the linear head.

    Returns:
        An ``nn.Sequential`` mapping ``(N, 1, 8, 8)`` to ``(N, num_classes)`` logits.

    Example:
        >>> import torch
        >>> make_cnn("gn")(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
        >>> make_cnn("none", channels=(4, 8, 8))[1]
        Identity()
    """
    if not channels:
        raise ValueError("channels must name at least one conv block")
    layers: list[nn.Module] = []
    in_channels, size = 1, 8
    for out_channels in channels:
        norm_layer = get_norm_layer(norm, out_channels)
        use_bias = isinstance(norm_layer, nn.Identity)
        layers += [
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=use_bias),
            norm_layer,
            nn.ReLU(inplace=True),
        ]
        if size > 1:
            layers.append(nn.MaxPool2d(2))
            size //= 2
        in_channels = out_channels
    layers += [nn.Flatten(), nn.Linear(in_channels * size * size, num_classes)]
    return nn.Sequential(*layers)


def load_digits_tensors(seed: int = 0, train_fraction: float = 0.75) -> Data:
    """Load scikit-learn's digits as standardized ``(N, 1, 8, 8)`` float32 tensors.

    The split is stratified: each class is shuffled with a generator seeded by
    ``seed`` and its first ``round(train_fraction * n_class)`` images go to the
    training set. Pixels (0-16) are scaled to ``[0, 1]``, then standardized with the
    training set's mean and standard deviation, so no test statistics leak in.

    Args:
        seed: seeds the split.
        train_fraction: share of each class used for training.

    Returns:
        ``(x_train, y_train, x_test, y_test)``; images are float32 ``(N, 1, 8, 8)``,
        labels int64 ``(N,)``.

    Example:
        >>> x_train, y_train, x_test, y_test = load_digits_tensors(seed=0)
        >>> tuple(x_train.shape), tuple(x_test.shape), x_train.dtype, y_train.dtype
        ((1347, 1, 8, 8), (450, 1, 8, 8), torch.float32, torch.int64)
        >>> round(x_train.mean().item(), 4) + 0.0, round(x_train.std().item(), 4)
        (0.0, 1.0)
    """
    from sklearn.datasets import load_digits

    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.as_tensor(digits.target, dtype=torch.int64)

    generator = torch.Generator().manual_seed(seed)
    train_idx, test_idx = [], []
    for cls in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == cls).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=generator)]
        n_train = round(train_fraction * idx.numel())
        train_idx.append(idx[:n_train])
        test_idx.append(idx[n_train:])
    train_sel, test_sel = torch.cat(train_idx), torch.cat(test_idx)

    x_train, x_test = images[train_sel], images[test_sel]
    mean, std = x_train.mean(), x_train.std()
    x_train = ((x_train - mean) / std).contiguous()
    x_test = ((x_test - mean) / std).contiguous()
    return x_train, labels[train_sel], x_test, labels[test_sel]


@torch.no_grad()
def _logits(model: nn.Module, x: Tensor) -> Tensor:
    model.eval()
    return model(x)


def train(
    model: nn.Module,
    data: Data,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    momentum: float = 0.9,
) -> dict:
    """Train ``model`` with SGD + momentum and measure it on the test set.

    Deterministic given ``seed`` (and the model's initial weights): the global torch
    seed is set and the mini-batch order comes from a ``torch.Generator`` seeded with
    ``seed``. Every epoch visits each training image once; the last mini-batch may be
    smaller. The model is trained in place and left in eval mode.

    Args:
        model: maps ``(N, 1, 8, 8)`` images to logits.
        data: ``(x_train, y_train, x_test, y_test)`` as from :func:`load_digits_tensors`.
        epochs: passes over the training set.
        batch_size: images per step.
        lr: SGD learning rate.
        seed: seeds the shuffling (and torch's global generator).
        momentum: SGD momentum.

    Returns:
        ``{"test_accuracy": float in [0, 1] (eval mode), "final_train_loss": mean
        cross-entropy over the last epoch, "seconds_per_epoch": float, "steps": int}``.

    Example:
        >>> import torch
        >>> data = load_digits_tensors(seed=0)
        >>> _ = torch.manual_seed(0)
        >>> result = train(make_cnn("gn"), data, epochs=1, batch_size=64, lr=0.1, seed=0)
        >>> sorted(result)
        ['final_train_loss', 'seconds_per_epoch', 'steps', 'test_accuracy']
        >>> result["steps"], result["test_accuracy"] > 0.5
        (22, True)
    """
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    n = x_train.shape[0]
    steps, epoch_seconds, epoch_loss = 0, [], math.nan
    for _ in range(epochs):
        model.train()
        start = time.perf_counter()
        order = torch.randperm(n, generator=generator)
        total = 0.0
        for begin in range(0, n, batch_size):
            idx = order[begin : begin + batch_size]
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * idx.numel()
            steps += 1
        epoch_seconds.append(time.perf_counter() - start)
        epoch_loss = total / n
    accuracy = (_logits(model, x_test).argmax(dim=1) == y_test).float().mean().item()
    return {
        "test_accuracy": accuracy,
        "final_train_loss": epoch_loss,
        "seconds_per_epoch": sum(epoch_seconds) / len(epoch_seconds),
        "steps": steps,
    }


def scaled_lr(batch_size: int, base_lr: float = BASE_LR) -> float:
    """The learning rate for ``batch_size``: linear scaling from ``base_lr`` at batch 32.

    Example:
        >>> scaled_lr(32), scaled_lr(4), scaled_lr(64, base_lr=0.1)
        (0.05, 0.00625, 0.2)
    """
    return base_lr * batch_size / BASE_BATCH_SIZE


def run(
    norms: Sequence[str] = ("bn", "gn", "ln2d", "none"),
    batch_sizes: Sequence[int] = (32, 4),
    epochs: int = DEFAULT_EPOCHS,
    seed: int = 0,
    *,
    base_lr: float = BASE_LR,
    data: Data | None = None,
    progress: bool = False,
) -> list[dict]:
    """Train the CNN with every norm at every batch size under the same budget.

    Each run starts from ``torch.manual_seed(seed)`` (so runs with the same norm share
    their initial weights), trains for ``epochs`` epochs at learning rate
    ``base_lr * batch_size / 32`` and is measured by :func:`train`.

    Args:
        norms: norm names for :func:`normkit.get_norm_layer`.
        batch_sizes: batch sizes to train each norm at.
        epochs: epochs per run (the same for all).
        seed: seeds the split, the weights and the shuffling.
        base_lr: learning rate at batch size 32.
        data: the split to use; loaded with :func:`load_digits_tensors` when ``None``.
        progress: print one line per finished run.

    Returns:
        One dict per run, in order: ``norm``, ``batch_size``, ``lr``, ``epochs`` and
        the measurements of :func:`train`.

    Example:
        >>> rows = run(norms=("ln2d",), batch_sizes=(64,), epochs=1)
        >>> [(r["norm"], r["batch_size"], r["lr"], r["steps"]) for r in rows]
        [('ln2d', 64, 0.1, 22)]
    """
    if data is None:
        data = load_digits_tensors(seed)
    rows = []
    total = len(norms) * len(batch_sizes)
    for norm in norms:
        for batch_size in batch_sizes:
            lr = scaled_lr(batch_size, base_lr)
            torch.manual_seed(seed)
            model = make_cnn(norm)
            result = train(model, data, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)
            row = {"norm": norm, "batch_size": batch_size, "lr": lr, "epochs": epochs, **result}
            rows.append(row)
            if progress:
                print(
                    f"  [{len(rows)}/{total}] {norm:>5} | batch {batch_size:>3} | lr {lr:.5g}"
                    f" | {result['steps']} steps | test acc {100 * row['test_accuracy']:.1f}%"
                    f" | {row['seconds_per_epoch']:.2f} s/epoch",
                    flush=True,
                )
    return rows


def check_drop_in(seed: int = 0, steps: int = DROP_IN_STEPS, batch_size: int = 32) -> float:
    """Max |logit difference| between torch's and normkit's BatchNorm2d after training.

    Builds the CNN with :class:`torch.nn.BatchNorm2d`, copies its ``state_dict`` into
    the same CNN built with :class:`normkit.BatchNorm2d` (the keys are identical),
    trains both for ``steps`` SGD steps on the same mini-batches, and compares their
    eval-mode logits (which use the running statistics) on the test set.

    Args:
        seed: seeds the split, the initial weights and the mini-batch order.
        steps: training steps for each model.
        batch_size: images per step.

    Returns:
        The maximum absolute difference of the test-set logits (about ``1e-6``).

    Example:
        >>> check_drop_in(seed=0, steps=5) < 1e-4
        True
    """
    from .norms.batch import BatchNorm2d

    x_train, y_train, x_test, _ = load_digits_tensors(seed)
    torch.manual_seed(seed)
    reference = make_cnn(nn.BatchNorm2d)
    candidate = make_cnn(BatchNorm2d)
    candidate.load_state_dict(reference.state_dict())
    order = torch.randperm(x_train.shape[0], generator=torch.Generator().manual_seed(seed))
    batches = [order[(i * batch_size) % len(order) :][:batch_size] for i in range(steps)]
    loss_fn = nn.CrossEntropyLoss()
    for model in (reference, candidate):
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
        for idx in batches:
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return (_logits(reference, x_test) - _logits(candidate, x_test)).abs().max().item()


def _comma_list(kind, name):
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{name} needs at least one value")
        try:
            return [kind(item) for item in items]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid {name} {text!r}: {exc}") from None

    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _build_parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a small CNN on scikit-learn's digits with each normkit norm "
        "and print test accuracy, training loss and speed.",
    )
    parser.add_argument(
        "--epochs", type=_positive_int, default=DEFAULT_EPOCHS,
        help=f"epochs per run, the same for every norm and batch size "
        f"(default: {DEFAULT_EPOCHS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument(
        "--norms", type=_comma_list(str, "norm list"), default=["bn", "gn", "ln2d", "none"],
        help="comma-separated names for normkit.get_norm_layer of norms for (N, C, H, W) "
        "features, e.g. bn, gn, ln2d, in, none (default: bn,gn,ln2d,none)",
    )
    parser.add_argument(
        "--batch-sizes", type=_comma_list(_positive_int, "batch size list"), default=[32, 4],
        help=f"comma-separated batch sizes (default: 32,4); the learning rate is "
        f"{BASE_LR} at batch {BASE_BATCH_SIZE}, scaled linearly",
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=2,
        help="torch CPU threads (default: 2)",
    )
    return parser


def _table(rows: list[dict]) -> str:
    header = ("norm", "batch size", "test accuracy", "final train loss", "s/epoch")
    body = [
        (
            r["norm"],
            str(r["batch_size"]),
            f"{100 * r['test_accuracy']:.2f}%",
            f"{r['final_train_loss']:.4f}",
            f"{r['seconds_per_epoch']:.3f}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]

    def fmt(line: Sequence[str]) -> str:
        cells = [cell.rjust(width) for cell, width in zip(line, widths, strict=True)]
        cells[0] = line[0].ljust(widths[0])
        return " | ".join(cells)

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(line) for line in body)])


def _interpret(rows: list[dict], drop_in: float, n_test: int) -> list[str]:
    parts = []
    for batch_size in dict.fromkeys(r["batch_size"] for r in rows):
        group = [r for r in rows if r["batch_size"] == batch_size]
        best = max(r["test_accuracy"] for r in group)
        winners = [r["norm"] for r in group if r["test_accuracy"] == best]
        others = [r for r in group if r["test_accuracy"] != best]
        part = f"batch {batch_size}: {'/'.join(winners)} ({100 * best:.2f}%"
        if others:
            runner = max(others, key=lambda r: r["test_accuracy"])
            gap = best - runner["test_accuracy"]
            images = round(gap * n_test)
            part += f", {100 * gap:.2f} points = {images} test image{'s' * (images != 1)} over "
            part += runner["norm"]
        parts.append(part + ")")
    lines = [f"Best test accuracy: {'; '.join(parts)}."]
    bn = {
        r["batch_size"]: r for r in rows
        if isinstance(get_norm_layer(r["norm"], 1), nn.BatchNorm2d)
    }
    if len(bn) >= 2:
        large, small = max(bn), min(bn)
        change = bn[small]["test_accuracy"] - bn[large]["test_accuracy"]
        direction = "rose" if change > 0 else "fell" if change < 0 else "did not change"
        amount = f" by {100 * abs(change):.2f} points" if change else ""
        lines.append(
            f"BatchNorm's test accuracy {direction}{amount} from batch size {large} to {small} "
            f"({100 * bn[large]['test_accuracy']:.2f}% -> {100 * bn[small]['test_accuracy']:.2f}%"
            f"; same {bn[small]['epochs']} epoch(s), {bn[large]['steps']} vs "
            f"{bn[small]['steps']} steps)."
        )
    verdict = "matches torch (drop-in)" if drop_in < 1e-4 else "does NOT match torch"
    lines.append(
        f"normkit.BatchNorm2d {verdict}: max logit difference {drop_in:.1e} "
        f"{'<' if drop_in < 1e-4 else '>='} 1e-4."
    )
    return lines


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the quickstart from the command line; returns the exit code.

    Options: ``--epochs``, ``--seed``, ``--norms`` (comma list), ``--batch-sizes``
    (comma list) and ``--threads`` (``torch.set_num_threads``, default 2). Unknown
    norm names are reported as a usage error (exit code 2).

    Example:
        >>> import contextlib, io
        >>> out = io.StringIO()
        >>> with contextlib.redirect_stdout(out):
        ...     code = main(["--epochs", "1", "--norms", "gn", "--batch-sizes", "64"])
        >>> code, "test accuracy" in out.getvalue()
        (0, True)
    """
    parser = _build_parser(prog)
    args = parser.parse_args(argv)
    for name in args.norms:
        try:
            get_norm_layer(name, 8)
        except ValueError as exc:
            parser.error(str(exc))
        try:
            make_cnn(name).eval()(torch.zeros(2, 1, 8, 8))
        except (ValueError, RuntimeError) as exc:
            parser.error(f"norm {name!r} does not fit this CNN's (N, C, H, W) features: {exc}")

    torch.set_num_threads(args.threads)
    wall_start = time.perf_counter()
    data = load_digits_tensors(args.seed)
    x_train, _, x_test, _ = data
    print("normkit quickstart: a small CNN on scikit-learn's digits (8x8 grey images, 10 classes)")
    print(
        f"  data: {x_train.shape[0]} train / {x_test.shape[0]} test images "
        f"(stratified split, seed {args.seed})"
    )
    print(
        "  model: [conv3x3 -> norm -> ReLU -> maxpool] x 2 (16, 32 channels) -> linear"
    )
    print(
        f"  budget: {args.epochs} epoch(s) per run, SGD momentum 0.9, lr {BASE_LR} at batch "
        f"{BASE_BATCH_SIZE} scaled linearly; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print()
    print(f"Training {len(args.norms) * len(args.batch_sizes)} runs:", flush=True)
    rows = run(args.norms, args.batch_sizes, args.epochs, args.seed, data=data, progress=True)
    print()
    print(_table(rows))
    print()
    drop_in = check_drop_in(args.seed)
    print(
        f"Drop-in check: torch.nn.BatchNorm2d vs normkit.BatchNorm2d, same initial weights, "
        f"{DROP_IN_STEPS} steps: max |logit difference| on the test set = {drop_in:.3e}"
    )
    print()
    print("Interpretation (computed from the numbers above):")
    for line in _interpret(rows, drop_in, x_test.shape[0]):
        print(textwrap.fill(line, width=100, initial_indent="  ", subsequent_indent="    "))
    print()
    print(f"Total wall time: {time.perf_counter() - wall_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
