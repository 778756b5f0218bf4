"""Eval-mode inference time of CNNs with BatchNorm after every conv: unfolded vs folded.

Two small networks, each with torch's and with normkit's BatchNorm2d: a ResNet-style
one (stride-2 stem, three stages of two basic residual blocks, 32/64/128 channels, a
1x1 conv + BN shortcut where the shape changes; 15 conv+BN pairs) and a MobileNet-style
one (depthwise-separable blocks, 32 to 256 channels; 11 pairs), on a batch of 16 images
of 3x64x64, timed in the same process with a fixed number of threads, round-robin,
median over repeats, for:

* the unfolded eval model;
* ``normkit.tools.fold.fold_batchnorm`` (a copy of the model, same class and forward);
* ``torch.fx.experimental.optimization.fuse`` (a traced GraphModule). It traces with
  torch.fx's default leaves and matches only the exact ``torch.nn.BatchNorm*`` classes,
  so on the normkit-BatchNorm model it fails (reported as such).

Prints a Markdown table with the time per batch, the speed-up over the unfolded model
and the max |output difference| from it (float32), plus the one-off cost of folding.

Run: ``python benchmarks/fold_speed.py [--threads 1] [--repeats 21]`` (about 30 s).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import warnings

import torch
from torch import nn
from torch.fx.experimental.optimization import fuse

import normkit
from normkit.tools.fold import fold_batchnorm


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus the (projected) input, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout)))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet_ish(norm) -> nn.Module:
    """Stride-2 stem, 3 stages of 2 basic blocks (32/64/128 channels): 15 conv+BN pairs."""
    layers = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), norm(32), nn.ReLU()]
    cin = 32
    for cout, stride in ((32, 1), (64, 2), (128, 2)):
        layers += [Block(cin, cout, stride, norm), Block(cout, cout, 1, norm)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def mobilenet_ish(norm) -> nn.Module:
    """Stride-2 stem, 5 depthwise-separable blocks (depthwise 3x3 + pointwise 1x1, each with
    BN + ReLU), 32 to 256 channels: 11 conv+BN pairs, where BN is a larger share of the time."""
    def unit(cin, cout, kernel, stride, groups):
        return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups,
                                       bias=False), norm(cout), nn.ReLU())

    layers = [unit(3, 32, 3, 2, 1)]
    cin = 32
    for cout, stride in ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1)):
        layers += [unit(cin, cin, 3, stride, cin), unit(cin, cout, 1, 1, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


MODELS = {"ResNet-ish": (resnet_ish, 15), "MobileNet-ish": (mobilenet_ish, 11)}


def trained(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial BN parameters and running statistics (a few train-mode batches)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.uniform_(0.5, 1.5, generator=gen)
                module.bias.uniform_(-0.5, 0.5, generator=gen)
        model.train()
        for _ in range(3):
            model(torch.randn(16, 3, 64, 64, generator=gen))
    return model.eval()


def timings(models: list[nn.Module], x: torch.Tensor, repeats: int
            ) -> list[tuple[float, float]]:
    """``(median ms per batch, median speed-up over models[0])`` for each model.

    The models run round-robin, and the speed-up is the median of the per-round ratios
    ``time(models[0]) / time(model)``, so that load from other processes, which comes
    and goes, hits the compared models alike.
    """
    times: list[list[float]] = [[] for _ in models]
    with torch.inference_mode():
        for model in models:
            model(x)
        for _ in range(repeats):
            for model, bucket in zip(models, times, strict=True):
                start = time.perf_counter()
                model(x)
                bucket.append(time.perf_counter() - start)
    return [(1e3 * statistics.median(bucket),
             statistics.median(b / t for b, t in zip(times[0], bucket, strict=True)))
            for bucket in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(args.seed + 1))

    print(f"torch {torch.__version__}, {args.threads} thread(s), batch 16 x 3 x 64 x 64, "
          f"float32, median of {args.repeats}\n")
    print("| model | variant | ms / batch | speed-up | max abs diff | BN left | fold time |")
    print("|---|---|---:|---:|---:|---:|---:|")
    norms = (("torch.nn.BatchNorm2d", nn.BatchNorm2d), ("normkit.BatchNorm2d", normkit.BatchNorm2d))
    for (name, (make, pairs)), (norm_name, norm) in itertools.product(MODELS.items(), norms):
        label = f"{name}, {norm_name}"
        model = trained(make(norm), args.seed)
        with torch.inference_mode():
            reference = model(x)
        start = time.perf_counter()
        folded, report = fold_batchnorm(model, return_report=True)
        fold_s = time.perf_counter() - start
        variants = [("unfolded", model, None), ("normkit fold_batchnorm", folded, fold_s)]
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fused = fuse(model, inplace=False)
            variants.append(("torch.fx fuse", fused, time.perf_counter() - start))
        except Exception as error:  # torch.fx cannot trace through normkit's input checks
            fuse_error = f"{type(error).__name__}: {error}"
        else:
            fuse_error = None
        measured = timings([candidate for _, candidate, _ in variants], x, args.repeats)
        for (variant, candidate, cost), (ms, ratio) in zip(variants, measured, strict=True):
            with torch.inference_mode():
                diff = float((candidate(x) - reference).abs().max())
            left = sum(isinstance(m, (nn.modules.batchnorm._BatchNorm,))
                       for m in candidate.modules())
            print(f"| {label} | {variant} | {ms:.2f} | {ratio:.3f}x | {diff:.2e} | {left} | "
                  f"{'-' if cost is None else f'{1e3 * cost:.0f} ms'} |")
        if fuse_error is not None:
            print(f"| {label} | torch.fx fuse | fails: {fuse_error} | | | | |")
        assert len(report.folded) == pairs, str(report)
    print("\nspeed-up: median over rounds of unfolded time / variant time (> 1: faster); "
          "max abs diff: against the unfolded model's output; BN left: BatchNorm modules "
          "remaining; fold time: one-off cost of the fold.")


if __name__ == "__main__":
    main()
