"""What normkit's layers buy in a whole CPU training step, not only in the norm alone.

``normkit bench`` times each normalization op by itself; a user trains a network, where
convolutions and matrix products take most of the step. This script times forward +
loss + backward + SGD update of small networks built from torch.nn, in these rows:

* **torch**: the network as written, with torch.nn's normalization layers;
* **normkit**: ``normkit.patch(network)``: every torch.nn norm swapped for normkit's
  drop-in, same parameters and buffers (the first step's loss is checked to agree);
* **normkit fused**: the norm and the activation after it as one normkit layer
  (``BatchNormAct2d``, ``GroupNormAct``), same parameters (state_dict-compatible);
* **no norm**: the norms replaced by ``nn.Identity`` (activations kept): the step's
  cost without normalization, so ``1 - no norm / torch`` is the share of the step the
  norms take, the most any faster norm could save.

Networks (float32; images NCHW and channels_last):

* ``resnet``: a ResNet basic-block stage (Conv3x3 -> BatchNorm2d -> ReLU -> Conv3x3 ->
  BatchNorm2d, + input, ReLU) x 2;
* ``mbconv``: MobileNetV2/EfficientNet inverted residuals (Conv1x1 expand x6 ->
  BatchNorm2d -> SiLU -> depthwise Conv3x3 -> BatchNorm2d -> SiLU -> Conv1x1 ->
  BatchNorm2d, + input) x 2: cheap depthwise convolutions, so the norms weigh more;
* ``unet``: diffusion-UNet style blocks (Conv3x3 -> GroupNorm(32) -> SiLU) x 3;
* ``convnext``: ConvNeXt blocks (depthwise Conv7x7 -> LayerNorm over the channels ->
  Conv1x1 c->4c -> GELU -> Conv1x1 4c->c, + input) x 2; torch has no channels-first
  LayerNorm, so torch's row is timm's (permute, ``nn.LayerNorm``, permute back) and
  normkit's is ``normkit.LayerNorm2d`` with the same parameters (no fused row);
* ``transformer``: pre-norm MLP blocks (LayerNorm or RMSNorm -> Linear d->4d -> GELU ->
  Linear 4d->d, + input) x 4 on ``tokens x d`` rows.

Ratio = torch's step time / the row's, the median of per-round ratios over round-robin
rounds (each round runs every row once, in a rotated order, after one untimed step), in
one process, at fixed thread counts::

    PYTHONPATH=src python benchmarks/train_step.py --threads 1 2

``--inference`` times an eval-mode forward pass under ``torch.inference_mode()`` instead
(BatchNorm running statistics from two training-mode passes over the input), with one
more row for the BatchNorm networks, **normkit fold_batchnorm**: the BatchNorms folded
into the convolutions before them (``normkit.fold_batchnorm``); every row's output is
checked against torch's.

``--autocast-bf16`` times the training steps under ``torch.autocast("cpu",
dtype=torch.bfloat16)``: the convolutions and matrix products run in bfloat16 and hand
the norms bfloat16 input (with float32 parameters), CPU mixed-precision training.

``--frozen-statistics`` times training steps of the BatchNorm networks with every
BatchNorm in eval mode (running statistics from two training-mode passes, affine still
trained): the fine-tuning recipe that freezes a pretrained backbone's statistics. Two
more rows freeze the affine too (detectron2's recipe; the same first loss): **torch
FrozenBatchNorm2d** (detectron2's form, ``F.batch_norm(training=False)`` on buffers) and
**normkit FrozenBatchNorm2d** (``normkit.freeze_batchnorm``), whose ratio is to the
former.

The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import normkit
from normkit.bench.ops import PermutedLayerNorm, TorchFrozenBatchNorm
from normkit.tools.convert import is_norm_layer

#: (batch, channels, height = width) of the image networks; (tokens, d) of the transformer.
SIZES = {"resnet": (16, 64, 32), "mbconv": (32, 32, 28), "unet": (8, 64, 32),
         "convnext": (16, 96, 28), "transformer": (1024, 384)}


class NormAct(nn.Module):
    """``act(norm(x))`` as two submodules, ``norm`` and ``act``: a fused layer takes the
    ``norm`` slot (and ``act`` becomes ``nn.Identity``) with the same state_dict keys."""

    def __init__(self, norm: nn.Module, act: nn.Module) -> None:
        super().__init__()
        self.norm, self.act = norm, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(x))


class Residual(nn.Module):
    """``post(body(x) + x)``."""

    def __init__(self, body: nn.Module, post: nn.Module | None = None) -> None:
        super().__init__()
        self.body, self.post = body, post or nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.body(x) + x)


def _bn(c: int) -> NormAct:
    return NormAct(nn.BatchNorm2d(c), nn.Identity())


def resnet(c: int) -> nn.Module:
    def block() -> nn.Module:
        return Residual(nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False), NormAct(nn.BatchNorm2d(c), nn.ReLU()),
            nn.Conv2d(c, c, 3, padding=1, bias=False), _bn(c)), nn.ReLU())
    return nn.Sequential(block(), block())


def mbconv(c: int) -> nn.Module:
    def block() -> nn.Module:
        e = 6 * c
        return Residual(nn.Sequential(
            nn.Conv2d(c, e, 1, bias=False), NormAct(nn.BatchNorm2d(e), nn.SiLU()),
            nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False),
            NormAct(nn.BatchNorm2d(e), nn.SiLU()),
            nn.Conv2d(e, c, 1, bias=False), _bn(c)))
    return nn.Sequential(block(), block())


def unet(c: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(c, c, 3, padding=1),
                                         NormAct(nn.GroupNorm(32, c), nn.SiLU()))
                           for _ in range(3)])


def convnext(c: int) -> nn.Module:
    return nn.Sequential(*[Residual(nn.Sequential(
        nn.Conv2d(c, c, 7, padding=3, groups=c), PermutedLayerNorm(c), nn.Conv2d(c, 4 * c, 1),
        nn.GELU(), nn.Conv2d(4 * c, c, 1))) for _ in range(2)])


def with_layer_norm2d(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each permute-LayerNorm-permute made ``normkit.LayerNorm2d``
    with the same parameters."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, PermutedLayerNorm):
                new = normkit.LayerNorm2d(child.norm.normalized_shape[0], child.norm.eps)
                new.load_state_dict(child.norm.state_dict())
                setattr(module, name, new)
    return model


def transformer(d: int, norm: Callable[[int], nn.Module]) -> nn.Module:
    return nn.Sequential(*[Residual(nn.Sequential(norm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)))
                           for _ in range(4)])


_ACTS = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Identity: "identity"}


def fused(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each :class:`NormAct` of a BatchNorm2d or GroupNorm made
    one normkit layer (``BatchNormAct2d``/``GroupNormAct``) carrying the same state."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if not isinstance(module, NormAct):
            continue
        norm, act = module.norm, _ACTS[type(module.act)]
        if isinstance(norm, nn.BatchNorm2d):
            new = normkit.BatchNormAct2d(norm.num_features, norm.eps, norm.momentum, act=act)
        else:
            new = normkit.GroupNormAct(norm.num_groups, norm.num_channels, norm.eps, act=act)
        new.load_state_dict(norm.state_dict())
        module.norm, module.act = new, nn.Identity()
    return model


def torch_frozen(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each BatchNorm2d made detectron2's FrozenBatchNorm2d form
    (:class:`normkit.bench.ops.TorchFrozenBatchNorm`: statistics and affine as buffers)."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.BatchNorm2d):
                frozen = TorchFrozenBatchNorm(child.num_features, child.eps)
                frozen.load_state_dict({key: value.detach() for key, value in
                                        child.state_dict().items() if key in
                                        ("weight", "bias", "running_mean", "running_var")})
                setattr(module, name, frozen)
    return model


def _reference_row(name: str, base: str) -> str:
    """The row a row's ratio (and first loss) is taken against."""
    if "RMSNorm" in name:
        return "torch RMSNorm"
    if name == "normkit FrozenBatchNorm2d":
        return "torch FrozenBatchNorm2d"
    return base


def without_norms(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every normalization layer replaced by ``nn.Identity``."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if is_norm_layer(child) or isinstance(child, PermutedLayerNorm):
                setattr(module, name, nn.Identity())
    return model


def networks(which: str, layout: str, inference: bool = False, frozen: bool = False
             ) -> tuple[dict[str, nn.Module], torch.Tensor]:
    """The rows (name -> network, all from one seeded torch network) and the input.

    ``inference``: every row in eval mode, its BatchNorms' running statistics those of two
    training-mode passes over the input (not 0 and 1), plus ``normkit fold_batchnorm``
    for networks with BatchNorm. ``frozen``: those statistics too, the networks in
    training mode but every BatchNorm in eval mode, plus both FrozenBatchNorm2d rows."""
    rows, x = _networks(which, layout, inference or frozen)
    if frozen:
        rows = {name: model for name, model in rows.items() if "fold" not in name}
        rows["torch FrozenBatchNorm2d"] = torch_frozen(rows["torch"])
        rows["normkit FrozenBatchNorm2d"] = normkit.freeze_batchnorm(rows["torch"])
        rows["no norm"] = rows.pop("no norm")  # (last, as in the other modes)
        for model in rows.values():
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
    if inference:
        for model in rows.values():
            model.eval()
    return rows, x


def _warm_statistics(model: nn.Module, x: torch.Tensor) -> None:
    """Running statistics of two training-mode forward passes over ``x``."""
    with torch.no_grad():
        for _ in range(2):
            model(x)


def _networks(which: str, layout: str, inference: bool
              ) -> tuple[dict[str, nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    if which == "transformer":
        tokens, d = SIZES[which]
        x = torch.randn(tokens, d)
        ln, rms = transformer(d, nn.LayerNorm), transformer(d, nn.RMSNorm)
        rms.load_state_dict(ln.state_dict(), strict=False)  # (RMSNorm has no bias)
        return {"torch LayerNorm": ln, "normkit LayerNorm": normkit.patch(ln),
                "torch RMSNorm": rms, "normkit RMSNorm": normkit.patch(rms),
                "no norm": without_norms(ln)}, x
    n, c, hw = SIZES[which]
    model = {"resnet": resnet, "mbconv": mbconv, "unet": unet, "convnext": convnext}[which](c)
    x = torch.randn(n, c, hw, hw)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if which == "convnext":
        return {"torch": model, "normkit": with_layer_norm2d(model),
                "no norm": without_norms(model)}, x
    if inference:
        _warm_statistics(model, x)
    rows = {"torch": model, "normkit": normkit.patch(model), "normkit fused": fused(model)}
    if inference and which != "unet":
        rows["normkit fold_batchnorm"] = normkit.fold_batchnorm(model)
    return {**rows, "no norm": without_norms(model)}, x


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          autocast: bool = False) -> float:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _inference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def measure(which: str, layout: str, rounds: int, inference: bool = False,
            frozen: bool = False, autocast: bool = False) -> list[tuple[str, float, float]]:
    """``(row, median ms, median ratio to the baseline)`` at the current threads: of a
    training step (with ``frozen`` BatchNorm statistics; under ``autocast``, bfloat16
    mixed precision), or with ``inference`` of an eval-mode forward under inference mode.

    Raises AssertionError when a row's first-step loss (inference: output) departs from
    its baseline's (a row that computed something else would time something else)."""
    rows, x = networks(which, layout, inference, frozen)
    base = next(iter(rows))
    if inference:
        calls = {name: (lambda m=m: _inference(m, x)) for name, m in rows.items()}
        outputs = {name: call() for name, call in calls.items()}
        for name, out in outputs.items():
            reference = outputs[_reference_row(name, base)]
            if name != "no norm" and not torch.allclose(out, reference, rtol=1e-4,
                                                        atol=1e-4):
                raise AssertionError(f"{which}: {name}'s output departs from {base}'s")
    else:
        opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
                for name, m in rows.items()}
        calls = {name: (lambda m=m, o=opts[name]: _step(m, o, x, autocast))
                 for name, m in rows.items()}
        losses = {name: call() for name, call in calls.items()}
        tolerance = 2e-2 if autocast else 1e-4  # (bfloat16 keeps 8 significant bits)
        for name, loss in losses.items():
            reference = losses[_reference_row(name, base)]
            if name != "no norm" and abs(loss - reference) > tolerance * max(1.0,
                                                                              abs(reference)):
                raise AssertionError(f"{which}: {name}'s first loss {loss} != {reference}")
    times: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(rounds):
        names = list(rows)
        names = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in names:
            calls[name]()  # warm: allocator and caches
            begin = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - begin)
    out = []
    for name, samples in times.items():
        reference = times[_reference_row(name, base)]
        ratio = statistics.median(a / b for a, b in zip(reference, samples, strict=True))
        out.append((name, statistics.median(samples) * 1e3, ratio))
    return out


def describe(which: str) -> str:
    if which == "transformer":
        return "{} x {}".format(*SIZES[which])
    return "{}x{}x{h}x{h}".format(*SIZES[which][:2], h=SIZES[which][2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--networks", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "channels_last"],
                        choices=["contiguous", "channels_last"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inference", action="store_true",
                        help="time eval-mode forward passes under inference mode instead")
    parser.add_argument("--frozen-statistics", action="store_true",
                        help="training steps with every BatchNorm in eval mode (BatchNorm "
                             "networks only)")
    parser.add_argument("--autocast-bf16", action="store_true",
                        help="training steps under torch.autocast('cpu', bfloat16): the "
                             "norms see bfloat16 input")
    args = parser.parse_args()
    if args.autocast_bf16 and args.inference:
        parser.error("--autocast-bf16 times training steps; --inference forward passes: "
                     "pick one")
    if args.frozen_statistics and args.inference:
        parser.error("--frozen-statistics times training steps; --inference forward passes: "
                     "pick one")
    if args.frozen_statistics:
        args.networks = [n for n in args.networks if n in ("resnet", "mbconv")]
        if not args.networks:
            parser.error("--frozen-statistics needs a BatchNorm network: resnet or mbconv")
    print("| threads | network | input | layout | row | "
          f"{'forward' if args.inference else 'step'} ms | x torch |")
    print("|---:|---|---|---|---|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for which in args.networks:
            layouts = ["rows"] if which == "transformer" else args.layouts
            for layout in layouts:
                for name, ms, ratio in measure(which, layout, args.rounds, args.inference,
                                               args.frozen_statistics, args.autocast_bf16):
                    print(f"| {threads} | {which} | {describe(which)} | {layout} | {name} "
                          f"| {ms:.1f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
