"""Host-side cost of normkit's Triton ops without the launches, measured on a CPU.

On a GPU, a small LayerNorm forward+backward through the Triton path is bound by the
host: Python, torch's dispatcher, allocations and the launches (benchmarks/RESULTS.md,
"GPU", table 1). Everything but the launches themselves is the same Python on any
machine, so it can be measured here: the kernels run on CPU tensors through Triton's
interpreter path with ``_ops.launch_hook`` set to a counter, which skips each launch and
counts it. Per call, the script prints

* **host us**: median wall time per call, launches excluded;
* **launches**: Triton launches per call (each ~20-45 us of host time on the H200
  machines measured, not included above);
* **aten ops**: torch operators dispatched per call (allocations, views, sums: each a
  few us of host time, and a kernel on a GPU when it computes);
* **normkit / torch**: the median over alternating rounds of the ratio of the two host
  times (> 1: normkit costs more);

beside the same numbers for torch eager's own op, which runs on the CPU here (its host
time there includes its CPU kernels: tiny inputs keep them short).

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host_overhead.py
    PYTHONPATH=src python benchmarks/host_overhead.py wrapper
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host_overhead.py rows
    PYTHONPATH=src python benchmarks/host_overhead.py cold

(``wrapper``: normkit's modules on the route a GPU input takes to torch's kernels,
beside torch's modules; see :func:`wrapper`. ``rows``: the LayerNorm/RMSNorm modules on
the route a CUDA input takes to the Triton row kernels, :func:`rows`. ``cold``: calls
from cold caches, as right after a large kernel, :func:`cold`.)

The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_overhead import fwd_bwd  # noqa: E402  (benchmarks/, this script's folder)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from normkit.kernels import triton as tk  # noqa: E402
from normkit.kernels.triton import _ops  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _launch_counter():
    launches = [0]

    def hook(kernel, grid, args, constexprs, num_warps):
        launches[0] += 1

    return launches, hook


def host_us(ours, theirs, number: int = 200, rounds: int = 15) -> tuple[float, float, float]:
    """Median us per call of ``ours`` and ``theirs``, timed in alternating rounds (this
    VM's speed drifts between seconds), and the median of the per-round ratios."""
    for _ in range(50):
        ours()
        theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            begin = time.perf_counter()
            for _ in range(number):
                fn()
            out.append((time.perf_counter() - begin) / number * 1e6)
    ratios = [a / b for a, b in zip(*times, strict=True)]
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios)


def cases() -> dict[str, tuple]:
    """``name: (normkit call, torch eager call)``, small inputs (64 x 256 rows,
    4 x 16 x 8 x 8 images), parameters requiring grad."""
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    b = torch.zeros(256, requires_grad=True)
    xn, wn, bn = x.detach(), w.detach(), b.detach()
    img = torch.randn(4, 16, 8, 8, requires_grad=True)
    c = torch.ones(16, requires_grad=True)
    cb = torch.zeros(16, requires_grad=True)
    return {
        "layer_norm fwd (no grad)": (lambda: tk.layer_norm(xn, (256,), wn, bn),
                                     lambda: F.layer_norm(xn, (256,), wn, bn)),
        "layer_norm fwd": (lambda: tk.layer_norm(x, (256,), w, b),
                           lambda: F.layer_norm(x, (256,), w, b)),
        "layer_norm fwd+bwd": (fwd_bwd(lambda: tk.layer_norm(x, (256,), w, b), x, w, b),
                               fwd_bwd(lambda: F.layer_norm(x, (256,), w, b), x, w, b)),
        "rms_norm fwd+bwd": (fwd_bwd(lambda: tk.rms_norm(x, (256,), w), x, w),
                             fwd_bwd(lambda: F.rms_norm(x, (256,), w), x, w)),
        "add+rms_norm fwd+bwd": (
            fwd_bwd(lambda: tk.rms_norm(x, (256,), w, residual=x), x, w),
            fwd_bwd(lambda: F.rms_norm(x + x, (256,), w), x, w)),
        "batch_norm train fwd": (lambda: tk.batch_norm_train(img, c, cb),
                                 lambda: F.batch_norm(img, None, None, c, cb, True)),
        "batch_norm train fwd+bwd": (
            fwd_bwd(lambda: tk.batch_norm_train(img, c, cb), img, c, cb),
            fwd_bwd(lambda: F.batch_norm(img, None, None, c, cb, True), img, c, cb)),
        "group_norm fwd": (lambda: tk.group_norm(img, 4, c, cb),
                           lambda: F.group_norm(img, 4, c, cb)),
        "group_norm fwd+bwd": (fwd_bwd(lambda: tk.group_norm(img, 4, c, cb), img, c, cb),
                               fwd_bwd(lambda: F.group_norm(img, 4, c, cb), img, c, cb)),
    }


def wrapper() -> None:
    """``wrapper`` step: normkit's modules on the route a GPU input takes to torch's own
    kernels (``normkit.functional._off_cpu`` patched to say every tensor is on one), beside
    torch's modules, on tiny CPU inputs where the wrapper's cost shows most. Ratio: torch
    module time / normkit module time (< 1: normkit's wrapper costs that much more)."""
    import normkit
    import normkit.functional as NF

    NF._off_cpu = lambda x: True
    x = torch.randn(3, 5, 7, 9)
    pairs = {
        "BatchNorm2d, training": (torch.nn.BatchNorm2d(5), normkit.BatchNorm2d(5)),
        "BatchNorm2d, eval": (torch.nn.BatchNorm2d(5).eval(), normkit.BatchNorm2d(5).eval()),
        "GroupNorm": (torch.nn.GroupNorm(5, 5), normkit.GroupNorm(5, 5)),
        "BatchNormAct2d (ReLU)": (torch.nn.Sequential(torch.nn.BatchNorm2d(5), torch.nn.ReLU()),
                                  normkit.BatchNormAct2d(5)),
        "GroupNormAct (SiLU)": (torch.nn.Sequential(torch.nn.GroupNorm(5, 5), torch.nn.SiLU()),
                                normkit.GroupNormAct(5, 5, act="silu")),
        "InstanceNorm2d": (torch.nn.InstanceNorm2d(5), normkit.InstanceNorm2d(5)),
    }
    print("| layer (3x5x7x9, GPU route) | torch us | normkit us | torch / normkit |")
    print("|---|---:|---:|---:|")
    for name, (theirs, ours) in pairs.items():
        mine, torchs, ratio = host_us(lambda m=ours: m(x), lambda m=theirs: m(x), number=1000)
        print(f"| {name} | {torchs:.1f} | {mine:.1f} | {1 / ratio:.2f}x |", flush=True)


def rows() -> None:
    """``rows`` step: normkit's LayerNorm/RMSNorm modules on the route a CUDA input takes
    under ``"auto"`` (the Triton row kernels: ``normkit.functional._use_triton`` patched
    to ignore the device, launches skipped and counted), beside torch's modules, whose
    time here includes their CPU kernels (kept small: 8 x 64 rows). Module forward (with
    and without grad mode) and forward + ``backward``; ratio: torch us / normkit us."""
    import normkit
    import normkit.functional as NF

    def use_triton(backend, x, supported, op):
        return backend == "triton" or (backend == "auto" and op in NF.TRITON_AUTO_OPS
                                       and supported())

    NF._use_triton = use_triton
    launches, hook = _launch_counter()
    _ops.launch_hook = hook
    n = 64
    x = torch.randn(8, n, requires_grad=True)
    dy = torch.randn(8, n)
    pairs = {"LayerNorm": (torch.nn.LayerNorm(n), normkit.LayerNorm(n)),
             "RMSNorm": (torch.nn.RMSNorm(n), normkit.RMSNorm(n))}

    def fwd_bwd_of(m):
        params = list(m.parameters())

        def call():
            m(x).backward(dy)
            x.grad = None
            for p in params:
                p.grad = None
        return call

    print("| module (8 x 64, Triton route, launches skipped) | call | launches | torch us "
          "| normkit us | torch / normkit |")
    print("|---|---|---:|---:|---:|---:|")
    for name, (theirs, ours) in pairs.items():
        calls = {"fwd, no grad": (lambda m=ours: m(x.detach()), lambda m=theirs: m(x.detach())),
                 "fwd": (lambda m=ours: m(x), lambda m=theirs: m(x)),
                 "fwd+bwd": (fwd_bwd_of(ours), fwd_bwd_of(theirs))}
        for call, (mine_fn, torch_fn) in calls.items():
            launches[0] = 0
            mine_fn()
            n_launch = launches[0]
            mine, torchs, ratio = host_us(mine_fn, torch_fn, number=500)
            print(f"| {name} | {call} | {n_launch} | {torchs:.1f} | {mine:.1f} | "
                  f"{1 / ratio:.2f}x |", flush=True)


def cold() -> None:
    """``cold`` step: the host time of calls made from cold caches, as a call right after a
    large kernel makes them (the kernel has streamed its tensors through the caches): a
    64 MiB write before each timed call, medians of 61 calls, 64 x 768 rows (short
    kernels), one thread, the same calls warm beside them. normkit's LayerNorm module and
    its parts against torch's, then the accuracy check's product reduced as ``abs_`` then
    ``max`` (before ``34d3e24``) and by one ``aminmax`` (``native.well_conditioned``)."""
    import normkit
    import normkit.functional as NF
    from normkit.kernels import native

    flush = torch.empty(16 * 1024 * 1024)
    n = 768
    x = torch.randn(64, n, requires_grad=True)
    theirs, ours = torch.nn.LayerNorm(n), normkit.LayerNorm(n)
    w, b = ours.weight, ours.bias
    _, mean, rstd = torch.native_layer_norm(x, (n,), w, b, 1e-5)

    def two_kernels():
        return torch.mul(mean, rstd).abs_().max().item() <= 32.0

    calls = {
        "torch.nn.LayerNorm module": lambda: theirs(x),
        "torch.native_layer_norm": lambda: torch.native_layer_norm(x, (n,), w, b, 1e-5),
        "normkit.LayerNorm module": lambda: ours(x),
        "normkit.functional.layer_norm": lambda: NF.layer_norm(x, (n,), w, b, 1e-5),
        "native.layer_norm (kernel + check)": lambda: native.layer_norm(x, (n,), w, b, 1e-5),
        "check: mul, abs_, max, item": two_kernels,
        "check: native.well_conditioned": lambda: native.well_conditioned(mean, rstd, 32.0),
    }
    print("| call (64 x 768, one thread) | cold us | warm us |")
    print("|---|---:|---:|")
    times = {name: ([], []) for name in calls}
    for _ in range(5):
        for fn in calls.values():
            fn()
    for _ in range(61):
        for name, fn in calls.items():
            for evict, out in ((True, times[name][0]), (False, times[name][1])):
                if evict:
                    flush.fill_(1.0)
                begin = time.perf_counter()
                fn()
                out.append((time.perf_counter() - begin) * 1e6)
    for name, (cold_us, warm_us) in times.items():
        print(f"| {name} | {statistics.median(cold_us):.1f} | {statistics.median(warm_us):.1f} |",
              flush=True)


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1:] == ["cold"]:
        cold()
        return
    if sys.argv[1:] == ["wrapper"]:
        wrapper()
        return
    if sys.argv[1:] == ["rows"]:
        rows()
        return
    if sys.argv[1:]:
        raise SystemExit(f"unknown arguments {sys.argv[1:]}: expected none, 'wrapper', "
                         f"'rows' or 'cold'")
    if not tk.interpreting():
        raise SystemExit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    launches, hook = _launch_counter()
    print("| call | normkit host us | launches | aten ops | torch host us | torch aten ops "
          "| normkit / torch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    previous, _ops.launch_hook = _ops.launch_hook, hook
    try:
        for name, (ours, theirs) in cases().items():
            ours()
            launches[0] = 0
            with _Count() as counted:
                ours()
            n_launch, n_ops = launches[0], counted.ops
            with _Count() as counted_torch:
                theirs()
            mine, torchs, ratio = host_us(ours, theirs)
            print(f"| {name} | {mine:.1f} | {n_launch} | {n_ops} | {torchs:.1f} | "
                  f"{counted_torch.ops} | {ratio:.2f} |", flush=True)
    finally:
        _ops.launch_hook = previous


if __name__ == "__main__":
    main()
