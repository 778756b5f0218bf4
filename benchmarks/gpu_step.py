"""Does normkit's host cost show in a whole training step? Eager forward+backward+SGD
step of two small networks on CUDA, with torch's normalization layers and with normkit's
(``backend="auto"``, the Triton kernels on CUDA), median of timed steps:

* a pre-norm MLP stack: ``depth`` blocks of LayerNorm -> Linear(d, 4d) -> GELU ->
  Linear(4d, d) with a residual, on ``tokens x d`` float32 activations;
* a conv stack: ``depth`` blocks of Conv3x3 -> BatchNorm2d (or GroupNorm) -> ReLU on
  ``N x C x H x W`` channels_last activations;
* a LayerNorm LSTM (Ba et al. 2016): per time step three LayerNorms on ``batch x 4H``
  gates and ``batch x H`` cells, small launches one after another.

Rows marked "torch row kernels" run normkit's layers with
``normkit.functional.TRITON_AUTO_OPS`` emptied, so that ``"auto"`` hands LayerNorm/
RMSNorm on CUDA to torch's kernels too: the policy alternative, measured beside the
Triton default.

Matrix products and convolutions run in TF32. Last, a host-side profile of the conv stack
with torch's BatchNorm2d and with normkit's (:func:`profile_steps`).

A step's matrix products give the GPU work that can hide a layer's host cost (the CPU
issues kernels ahead of the GPU) or not. One machine, one run: figures to read.

    PYTHONPATH=src python3 benchmarks/gpu_step.py          (CUDA)
    NORMKIT_STEP_DEVICE=cpu PYTHONPATH=src python3 benchmarks/gpu_step.py   (rehearsal)
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
from torch import nn

import normkit
import normkit.functional as NF

DEV = os.environ.get("NORMKIT_STEP_DEVICE", "cuda")
BIG = DEV == "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


class Block(nn.Module):
    def __init__(self, d: int, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.up, self.down = norm, nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def mlp(d: int, depth: int, layer) -> nn.Module:
    return nn.Sequential(*[Block(d, layer(d)) for _ in range(depth)]).to(DEV)


def convnet(c: int, depth: int, layer) -> nn.Module:
    mods = []
    for _ in range(depth):
        mods += [nn.Conv2d(c, c, 3, padding=1, bias=False), layer(c), nn.ReLU()]
    return nn.Sequential(*mods).to(DEV).to(memory_format=torch.channels_last)


class LSTMLoss(nn.Module):
    """The output sequence of an LSTM (torch's or normkit's), for the step's loss."""

    def __init__(self, lstm: nn.Module) -> None:
        super().__init__()
        self.lstm = lstm

    def forward(self, x):
        return self.lstm(x)[0]


@contextlib.contextmanager
def torch_row_kernels():
    """``"auto"`` hands LayerNorm/RMSNorm on CUDA to torch's kernels while inside."""
    saved = NF.TRITON_AUTO_OPS
    NF.TRITON_AUTO_OPS = frozenset()
    try:
        yield
    finally:
        NF.TRITON_AUTO_OPS = saved


def training_step(model: nn.Module, x: torch.Tensor):
    """One forward+backward+SGD step of ``model`` on ``x``, as a function, after three
    warm-up steps (compilation, the allocator)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def one():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        one()
    sync()
    return one


def step_ms(model: nn.Module, x: torch.Tensor, steps: int) -> tuple[float, float]:
    """(median step ms, host ms per step spent issuing it) of forward+backward+SGD."""
    one = training_step(model, x)
    times, issue = [], []
    for _ in range(steps):
        begin = time.perf_counter()
        one()
        issued = time.perf_counter()
        sync()
        end = time.perf_counter()
        times.append(end - begin)
        issue.append(issued - begin)
    return statistics.median(times) * 1e3, statistics.median(issue) * 1e3


def main() -> None:
    # TF32 matrix products, as fp32 training on Hopper usually runs: less GPU time per
    # step to hide the normalization layers' host cost behind
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    tokens, d, depth = (8192, 1024, 8) if BIG else (64, 32, 2)
    n, c, hw = (32, 64, 56) if BIG else (2, 4, 6)
    steps = 20 if BIG else 2
    x_rows = torch.randn(tokens, d, device=DEV)
    x_img = torch.randn(n, c, hw, hw, device=DEV).contiguous(memory_format=torch.channels_last)
    seq, batch, hidden = (64, 32, 512) if BIG else (3, 2, 8)
    x_seq = torch.randn(seq, batch, hidden, device=DEV)
    lstm = {"torch.nn.LSTM (no LayerNorm)": lambda: nn.LSTM(hidden, hidden),
            "normkit.LayerNormLSTM": lambda: normkit.LayerNormLSTM(hidden, hidden),
            "normkit.LayerNormLSTM, torch row kernels":
                lambda: normkit.LayerNormLSTM(hidden, hidden)}
    cases = [
        (f"MLP stack {depth} x [LayerNorm, Linear {d}->{4 * d}->{d}], {tokens} tokens",
         x_rows, lambda layer: mlp(d, depth, layer),
         {"torch.nn.LayerNorm": nn.LayerNorm, "normkit.LayerNorm": normkit.LayerNorm,
          "normkit.LayerNorm, torch row kernels": normkit.LayerNorm}),
        (f"MLP stack {depth} x [RMSNorm, ...], {tokens} tokens",
         x_rows, lambda layer: mlp(d, depth, layer),
         {"torch.nn.RMSNorm": nn.RMSNorm, "normkit.RMSNorm": normkit.RMSNorm,
          "normkit.RMSNorm, torch row kernels": normkit.RMSNorm}),
        (f"Conv stack {depth} x [Conv3x3 {c}, BatchNorm2d, ReLU], {n}x{c}x{hw}x{hw} NHWC",
         x_img, lambda layer: convnet(c, depth, layer),
         {"torch.nn.BatchNorm2d": nn.BatchNorm2d, "normkit.BatchNorm2d": normkit.BatchNorm2d}),
        (f"Conv stack {depth} x [Conv3x3 {c}, GroupNorm(32), ReLU], {n}x{c}x{hw}x{hw} NHWC",
         x_img, lambda layer: convnet(c, depth, layer),
         {"torch.nn.GroupNorm": lambda ch: nn.GroupNorm(min(32, ch), ch),
          "normkit.GroupNorm": lambda ch: normkit.GroupNorm(min(32, ch), ch)}),
        (f"LSTM {hidden} -> {hidden}, {seq} steps x batch {batch}", x_seq,
         lambda layer: LSTMLoss(layer()).to(DEV), lstm),
    ]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if BIG else DEV}; "
          f"median of {steps} steps after 3 warm-up steps\n")
    print("| network | norm layers | step ms | host ms to issue a step | vs torch |")
    print("|---|---|---:|---:|---:|")
    for title, x, build, layers in cases:
        base = None
        for name, layer in layers.items():
            torch.manual_seed(0)
            policy = torch_row_kernels() if "torch row kernels" in name else \
                contextlib.nullcontext()
            with policy:
                ms, host = step_ms(build(layer), x, steps)
            base = base or ms
            print(f"| {title} | {name} | {ms:.2f} | {host:.2f} | {base / ms:.2f}x |",
                  flush=True)


def profile_steps(x: torch.Tensor, layers: dict, build, steps: int = 3) -> None:
    """Where a host-bound step's issue time goes, by layer choice: ``torch.profiler`` over
    ``steps`` training steps (CPU activity only: the host's side), per step the count of
    ATen operators and of kernel launches (``cudaLaunchKernel`` and the like, as the
    runtime API calls the host makes), then the operators with the most host time of
    their own. For the conv stack, whose step with normkit's BatchNorm2d took 0.71x
    torch's on 2026-12-04 while the module alone cost what torch's does
    (RESULTS.md, "GPU, second measurement")."""
    from torch.profiler import ProfilerActivity, profile, schedule

    for name, layer in layers.items():
        torch.manual_seed(0)
        one = training_step(build(layer), x)
        # (one step recorded and dropped first: the profiler's own start-up lands on the
        # first operator it records, ~3 ms on the CPU)
        recorded = []
        with profile(activities=[ProfilerActivity.CPU],
                     schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                     on_trace_ready=lambda p, to=recorded: to.append(p.key_averages())) as prof:
            for _ in range(steps + 1):
                one()
                sync()
                prof.step()
        events = recorded[0]
        aten = sum(e.count for e in events if e.key.startswith("aten::"))
        launches = sum(e.count for e in events if e.key.startswith("cuda") and "Launch" in e.key)
        print(f"\n{name}: per step {aten / steps:.0f} ATen operator calls, "
              f"{launches / steps:.0f} kernel launches; host time of their own, top 8:\n")
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        for e in rows:
            print(f"  {e.key[:48]:<48} {e.count / steps:>6.1f} calls "
                  f"{e.self_cpu_time_total / steps / 1e3:>8.3f} ms")


if __name__ == "__main__":
    main()
    n, c, hw = (32, 64, 56) if BIG else (2, 4, 6)
    print("\n## Conv stack, host side per step (torch.profiler)")
    profile_steps(torch.randn(n, c, hw, hw, device=DEV).contiguous(
                      memory_format=torch.channels_last),
                  {"torch.nn.BatchNorm2d": nn.BatchNorm2d,
                   "normkit.BatchNorm2d": normkit.BatchNorm2d},
                  lambda layer: convnet(c, 8 if BIG else 2, layer))
