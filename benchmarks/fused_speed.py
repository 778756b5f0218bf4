"""Fused ops vs torch eager on CPU: speed ratios and In-Place ABN memory.

Three tables, each variant measured against torch eager in the same process, with a fixed
number of threads (1, then 2), the variants run round-robin (one call of each per round)
and the reported ratio the median over rounds of ``t_torch / t_variant`` (> 1: faster):

1. residual add + norm, ``(normed, new_residual)``: ``normkit`` ``add_layer_norm`` /
   ``add_rms_norm`` vs ``F.layer_norm(x + r)`` / ``F.rms_norm(x + r)``, float32,
   4096 x 1024 and 4096 x 4096; "fwd+bwd" takes the gradients of both outputs (as a
   pre-norm block does) with respect to ``x``, ``residual`` and the parameters;
2. norm + activation (training): ``batch_norm_act`` / ``group_norm_act`` vs
   ``act(F.batch_norm(...))`` / ``act(F.group_norm(..., 32))``, float32, 32x64x56x56
   and 32x256x14x14, NCHW and channels_last;
3. a deep conv-BN-act stack (10 blocks of conv3x3 64->64 + BatchNormAct2d(leaky_relu)),
   training step: torch (``nn.BatchNorm2d`` + ``nn.LeakyReLU``), normkit
   ``memory="standard"`` and ``memory="inplace"``. Memory is measured two ways:
   *saved bytes*, the distinct storages autograd keeps for backward (counted with
   ``torch.autograd.graph.saved_tensors_hooks``; deterministic), and *peak RSS*, the
   process's peak resident memory during one training step above its resident memory
   at the step's start (Linux ``VmHWM`` after resetting it through
   ``/proc/self/clear_refs``, in a fresh subprocess per variant with
   ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the OS and RSS
   follows the live tensors; tracemalloc does not see torch's allocations).

Run: ``python benchmarks/fused_speed.py [--threads 1 2] [--rounds 15] [--quick]
[--output benchmarks/FUSED.md]`` (about 10 minutes on 2 cores; ``--quick``: 2).
Timings on a shared machine drift; read ratios within ~10% of 1.0 as "no difference".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.nn import functional as TF

from normkit.norms.fused import (
    BatchNormAct2d,
    add_layer_norm,
    add_rms_norm,
    batch_norm_act,
    group_norm_act,
)

TORCH_ACT = {"relu": TF.relu, "leaky_relu": TF.leaky_relu, "elu": TF.elu, "silu": TF.silu,
             "gelu": TF.gelu, "identity": lambda y: y}


def round_robin(variants: dict, rounds: int, warmup: int = 2) -> dict:
    """``{name: (median ms, median per-round ratio to the first variant)}``."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = times[next(iter(variants))]
    return {name: (statistics.median(t) * 1e3,
                   statistics.median(b / v for b, v in zip(base, t, strict=True)))
            for name, t in times.items()}


def fwd_bwd(forward, inputs, grads):
    """A closure: forward, then the gradients of every output w.r.t. ``inputs``."""
    def run():
        outs = forward()
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.grad(outs, inputs, grads[:len(outs)])
    return run


def fwd_only(forward):
    def run():
        with torch.no_grad():
            forward()
    return run


# --------------------------------------------------------------------------- cases


def add_norm_case(kind: str, x, r, w, b, width: int):
    """``(torch reference, normkit, inputs to differentiate)`` for one residual-norm row."""
    if kind == "LayerNorm":
        def ref():
            s = x + r
            return TF.layer_norm(s, (width,), w, b), s

        return ref, lambda: add_layer_norm(x, r, width, w, b), [x, r, w, b]

    def ref_rms():
        s = x + r
        return TF.rms_norm(s, (width,), w), s

    return ref_rms, lambda: add_rms_norm(x, r, width, w), [x, r, w]


def add_norm_rows(rounds: int, quick: bool) -> list[list[str]]:
    rows = []
    widths = (1024,) if quick else (1024, 4096)
    for width in widths:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4096, width, generator=gen).requires_grad_()
        r = torch.randn(4096, width, generator=gen).requires_grad_()
        w = (torch.rand(width, generator=gen) + 0.5).requires_grad_()
        b = torch.randn(width, generator=gen).requires_grad_()
        grads = (torch.randn(4096, width, generator=gen), torch.randn(4096, width, generator=gen))
        for kind in ("LayerNorm", "RMSNorm"):
            ref, ours, inputs = add_norm_case(kind, x, r, w, b, width)
            rows.append(measure(f"add + {kind}", f"4096 x {width}", "-", ref, ours, inputs,
                                grads, rounds))
    return rows


def measure(op, shape, layout, ref, ours, inputs, grads, rounds) -> list[str]:
    """One table row: forward and forward+backward, each round-robin against torch."""
    f = round_robin({"torch": fwd_only(ref), "normkit": fwd_only(ours)}, rounds)
    fb = round_robin({"torch": fwd_bwd(ref, inputs, grads),
                      "normkit": fwd_bwd(ours, inputs, grads)}, rounds)
    return [op, shape, layout, f"{fb['torch'][0]:.1f}", f"{fb['normkit'][0]:.1f}",
            f"{f['normkit'][1]:.2f}x", f"**{fb['normkit'][1]:.2f}x**"]


def norm_act_case(norm: str, act: str, x, w, b):
    """``(torch reference, normkit)`` for one norm + activation row (training mode)."""
    t_act = TORCH_ACT[act]
    if norm == "BatchNorm":
        c = x.shape[1]
        rm, rv = torch.zeros(c), torch.ones(c)
        return (lambda: t_act(TF.batch_norm(x, rm, rv, w, b, True)),
                lambda: batch_norm_act(x, rm, rv, w, b, True, act=act))
    return (lambda: t_act(TF.group_norm(x, 32, w, b)),
            lambda: group_norm_act(x, 32, w, b, act=act))


def norm_act_rows(rounds: int, quick: bool) -> list[list[str]]:
    rows = []
    shapes = ((32, 256, 14, 14),) if quick else ((32, 64, 56, 56), (32, 256, 14, 14))
    bn_acts = ("relu", "silu") if quick else ("relu", "leaky_relu", "elu", "silu", "gelu",
                                              "identity")
    cases = [("BatchNorm", act) for act in bn_acts] + [("GroupNorm(32)", "relu"),
                                                       ("GroupNorm(32)", "silu")]
    for shape in shapes:
        for layout in ("NCHW", "channels_last"):
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(shape, generator=gen)
            dz = torch.randn(shape, generator=gen)
            if layout == "channels_last":
                x, dz = (t.contiguous(memory_format=torch.channels_last) for t in (x, dz))
            x.requires_grad_()
            w = (torch.rand(shape[1], generator=gen) + 0.5).requires_grad_()
            b = torch.randn(shape[1], generator=gen).requires_grad_()
            for norm, act in cases:
                ref, ours = norm_act_case(norm, act, x, w, b)
                rows.append(measure(f"{norm} + {act}", "x".join(map(str, shape)), layout, ref,
                                    ours, [x, w, b], (dz,), rounds))
    return rows


# --------------------------------------------------------------------------- memory


def conv_stack(variant: str, blocks: int = 10, channels: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers.append(nn.Conv2d(channels, channels, 3, padding=1, bias=False))
        if variant == "torch":
            layers += [nn.BatchNorm2d(channels), nn.LeakyReLU(0.01)]
        else:
            layers.append(BatchNormAct2d(channels, act="leaky_relu", memory=variant))
    return nn.Sequential(*layers)


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values())


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(variant: str, batch: int, threads: int) -> None:
    """Child process: peak RSS of one training step above the RSS at its start (MiB)."""
    torch.set_num_threads(threads)
    model = conv_stack(variant)
    x = torch.randn(batch, 64, 56, 56, generator=torch.Generator().manual_seed(2))

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    step()  # warm-up: every parameter gradient and one-off buffer exists afterwards
    model.zero_grad(set_to_none=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    step()
    peak = _rss_kib("VmHWM")
    print(json.dumps({"peak_mib": (peak - before) / 1024}))


def peak_rss_mib(variant: str, batch: int, threads: int) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, __file__, "--memory-worker", variant, str(batch),
                          str(threads)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def memory_rows(rounds: int, batch: int, threads: int) -> list[list[str]]:
    x = torch.randn(batch, 64, 56, 56, generator=torch.Generator().manual_seed(2))
    models = {v: conv_stack(v) for v in ("torch", "standard", "inplace")}
    models["inplace"].load_state_dict(models["standard"].state_dict())
    saved = {v: saved_bytes(m, x) for v, m in models.items()}
    peaks = {v: peak_rss_mib(v, batch, threads) for v in models}

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        return run

    timing = round_robin({v: step(m) for v, m in models.items()}, max(rounds // 3, 5), 1)
    rows = []
    for v in models:
        rows.append([v if v == "torch" else f'normkit memory="{v}"',
                     f"{saved[v] / 2**20:.0f}", f"{saved[v] / saved['standard']:.2f}",
                     f"{peaks[v]:.0f}", f"{peaks[v] / peaks['standard']:.2f}",
                     f"{timing[v][0]:.0f}", f"{timing[v][1]:.2f}x"])
    return rows


# --------------------------------------------------------------------------- report


def table(header: list[str], rows: list[list[str]], align: str) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8, help="batch of the conv stack")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and activations")
    parser.add_argument("--output", help="also write the Markdown report to this file")
    parser.add_argument("--memory-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        variant, batch, threads = args.memory_worker
        memory_worker(variant, int(batch), int(threads))
        return
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    out = [f"torch {torch.__version__}, {cpu}, {os.cpu_count()} logical CPUs, float32; "
           f"load average at start {os.getloadavg()[0]:.1f}; median of {args.rounds} "
           "round-robin rounds", ""]
    header = ["op", "shape", "layout", "torch ms (fwd+bwd)", "normkit ms (fwd+bwd)",
              "speed-up fwd", "speed-up fwd+bwd"]
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows = add_norm_rows(args.rounds, args.quick) + norm_act_rows(args.rounds, args.quick)
        out += [f"### {threads} thread(s)", "", table(header, rows, ["---"] * 3 + ["---:"] * 4),
                ""]
        print("\n".join(out[-4:]), flush=True)
    threads = args.threads[0]
    torch.set_num_threads(threads)
    mem_header = ["10 x (conv3x3 64->64 + BN + LeakyReLU)", "saved MiB", "saved vs standard",
                  "peak RSS MiB", "peak vs standard", "step ms", "speed vs torch"]
    out += [f"### Training step of a conv-BN-act stack, {args.batch}x64x56x56, "
            f"{threads} thread(s)", "",
            table(mem_header, memory_rows(args.rounds, args.batch, threads),
                  ["---"] + ["---:"] * 6), "",
            f"load average at end {os.getloadavg()[0]:.1f}"]
    print("\n".join(out[-5:]), flush=True)
    if args.output:
        command = "python benchmarks/fused_speed.py " + " ".join(sys.argv[1:])
        with open(args.output, "w") as report:
            report.write(f"```sh\n{command}\n```\n\n" + "\n".join(out) + "\n")


if __name__ == "__main__":
    main()
