"""Where the time of normkit's CUDA paths goes: host-side cost per call, kernel time
without the host, and a profile. Run on a CUDA machine (the device tool's H200):

    PYTHONPATH=src python3 benchmarks/gpu_overhead.py [STEP ...] > overhead.txt

(steps: precision, accuracy, double_backward, host_table, gpu_table, opt_in, tuning,
direct_launch, profiles, modules; default all)

Five tables, the first two beside torch eager (and Liger-Kernel where it imports):

1. **host us/call**: wall time per call of a loop that never synchronizes, on inputs so
   small that the GPU finishes each call before the next is issued: what Python, the
   dispatcher and the launches cost on the CPU. A call costs at least this much in any
   eager loop; when it exceeds the kernels' GPU time, the GPU waits for the host.
2. **GPU us/call**: the same calls captured in a CUDA graph and replayed, so no host work
   is timed: the kernels alone (on 4096 x >= 1024 rows and CNN activations; the graph
   replays the same buffers, so what fits in the 60 MB L2 is warm).
3. **tuning**: the kernel time of the launch parameters
   (``_ops.ROW_BWD_PROGRAMS_PER_SM``, ``_ops.BN_CHUNKS_PER_SM``,
   ``_ops.GN_CHUNKS_PER_SM``) over candidate values.
4. **direct launch**: a compiled kernel called through its launcher, bypassing
   ``JITFunction.run``: same output? host us?
5. **cProfile** of normkit's LayerNorm and BatchNorm forward+backward on CUDA.
6. **modules**: host time of whole modules under ``backend="auto"`` beside torch's, and
   a profile of the BatchNorm2d module (the route a conv net takes on a GPU).
7. **opt_in**: the Triton kernels ``"auto"`` does not take on CUDA (LayerNorm2d's
   channels-first ones, BatchNorm's and GroupNorm's) beside what it takes and torch.

Before them: the single-block LayerNorm's statistics at a mean of 1e4 (the H200 run
found them off with FMA contraction on), and the float32 accuracy of torch's CUDA
kernels beside normkit's Triton kernels at offsets (mean = ratio x std), which decides
whether ``backend="auto"`` could hand CUDA inputs to torch.

The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import cProfile
import functools
import importlib
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

from normkit.kernels import triton as tk
from normkit.kernels.triton import _ops

#: ``NORMKIT_OVERHEAD_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` rehearses the script here
#: (the graph table is then skipped).
DEV = os.environ.get("NORMKIT_OVERHEAD_DEVICE", "cuda")


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def on_device(t):
    with torch.cuda.device(t.device):
        pass


def host_us(fn, n: int = 300, warmup: int = 20, synced: bool = False) -> float:
    """us per call of ``n`` calls issued back to back after ``warmup``: the time to issue
    them (the host's), or with ``synced`` to their end on the device."""
    for _ in range(warmup):
        fn()
    sync()
    begin = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - begin
    sync()
    return (time.perf_counter() - begin if synced else host) / n * 1e6


def graph_us(fn, reps: int = 20, replays: int = 5) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * replays)


def fwd_bwd(fn, *leaves):
    def run():
        y = fn()
        y = y[0] if isinstance(y, tuple) else y
        torch.autograd.grad(y, leaves, torch.ones_like(y))
    return run


def liger(name: str, *args):
    try:
        module = importlib.import_module(f"liger_kernel.transformers.{name[0]}")
        return getattr(module, name[1])(*args).to(DEV)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"(liger {name[1]}: {type(e).__name__}: {e})")
        return None


def table(title: str, rows: dict[str, object], timer) -> None:
    print(f"\n## {title}\n")
    for name, fn in rows.items():
        if fn is None:
            continue
        try:
            print(f"{name:<46} {timer(fn):9.1f}")
        except Exception as e:  # noqa: BLE001
            print(f"{name:<46} failed: {type(e).__name__}: {str(e)[:160]}")
        sys.stdout.flush()


def host_table() -> None:
    import triton

    @triton.jit
    def noop(X):
        pass

    x = torch.randn(64, 256, device=DEV, requires_grad=True)
    w = torch.ones(256, device=DEV, requires_grad=True)
    b = torch.zeros(256, device=DEV, requires_grad=True)
    xn = x.detach()
    img = torch.randn(4, 16, 8, 8, device=DEV, requires_grad=True)
    c = torch.ones(16, device=DEV, requires_grad=True)
    cb = torch.zeros(16, device=DEV, requires_grad=True)
    ln_l = liger(("layer_norm", "LigerLayerNorm"), 256)
    rms_l = liger(("rms_norm", "LigerRMSNorm"), 256)
    import normkit
    ln_m = normkit.LayerNorm(256).to(DEV)
    from normkit.kernels.triton import _kernels as K

    y0 = torch.empty_like(xn)
    stats = [torch.empty(64, device=DEV) for _ in range(3)]
    row_args = (xn, xn, xn, y0, w.detach(), b.detach(), *stats, 256, 256, 256, 256, 256,
                1.0 / 256, 1e-5)
    row_flags = dict(CENTER=True, HAS_RES=False, HAS_W=True, HAS_B=True, SINGLE=True,
                     BLOCK=256, num_warps=1)
    rows = {
        "torch.empty(1024)": lambda: torch.empty(1024, device=DEV),
        "triton _row_fwd launch, 17 args + 6 constexprs":
            lambda: K._row_fwd[(64,)](*row_args, **row_flags),
        "torch.cuda.device(x.device) enter+exit": lambda: on_device(x),
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "triton no-op kernel, 1 arg": lambda: noop[(1,)](xn),
        "normkit rows_forward (launcher, no autograd)":
            lambda: _ops.rows_forward(xn, None, w.detach(), b.detach(), 256, 1e-5, True, None),
        "normkit tk.layer_norm fwd (no grad)":
            lambda: tk.layer_norm(xn, (256,), w.detach(), b.detach()),
        "normkit tk.layer_norm fwd (grad)": lambda: tk.layer_norm(x, (256,), w, b),
        "normkit.LayerNorm module fwd (auto)": lambda: ln_m(x),
        "torch F.layer_norm fwd (grad)": lambda: F.layer_norm(x, (256,), w, b),
        "liger LayerNorm fwd": None if ln_l is None else (lambda: ln_l(x)),
        "normkit tk.layer_norm fwd+bwd": fwd_bwd(lambda: tk.layer_norm(x, (256,), w, b), x, w, b),
        "torch F.layer_norm fwd+bwd": fwd_bwd(lambda: F.layer_norm(x, (256,), w, b), x, w, b),
        "liger LayerNorm fwd+bwd": None if ln_l is None else fwd_bwd(lambda: ln_l(x), x),
        "normkit tk.rms_norm fwd (grad)": lambda: tk.rms_norm(x, (256,), w),
        "torch F.rms_norm fwd (grad)": lambda: F.rms_norm(x, (256,), w),
        "liger RMSNorm fwd": None if rms_l is None else (lambda: rms_l(x)),
        "normkit bn_stats (launcher)": lambda: _ops.bn_stats(img.detach(), 1e-5, None),
        "normkit tk.batch_norm_train fwd": lambda: tk.batch_norm_train(img, c, cb),
        "torch F.batch_norm train fwd": lambda: F.batch_norm(img, None, None, c, cb, True),
        "normkit tk.batch_norm_train fwd+bwd":
            fwd_bwd(lambda: tk.batch_norm_train(img, c, cb)[0], img, c, cb),
        "torch F.batch_norm train fwd+bwd":
            fwd_bwd(lambda: F.batch_norm(img, None, None, c, cb, True), img, c, cb),
        "normkit tk.group_norm fwd": lambda: tk.group_norm(img, 4, c, cb),
        "torch F.group_norm fwd": lambda: F.group_norm(img, 4, c, cb),
        "normkit tk.group_norm fwd+bwd": fwd_bwd(lambda: tk.group_norm(img, 4, c, cb), img, c, cb),
        "torch F.group_norm fwd+bwd": fwd_bwd(lambda: F.group_norm(img, 4, c, cb), img, c, cb),
    }
    table("host us/call (no sync in the loop; tiny inputs: 64x256, 4x16x8x8)", rows, host_us)


def bn_train(x, w, b):
    mean_hi, mean_lo, _, rstd = _ops.bn_stats(x, 1e-5, None)
    return _ops.bn_apply(x, mean_hi, mean_lo, rstd, w, b, None)


def gpu_table() -> None:
    if DEV != "cuda":
        print("\n(GPU table skipped: not on CUDA)")
        return
    rows = {}
    for m, n in ((4096, 1024), (4096, 4096), (4096, 8192)):
        x = torch.randn(m, n, device=DEV)
        w, b = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
        dy = torch.randn(m, n, device=DEV)
        y, _, stats = _ops.rows_forward(x, None, w, b, n, 1e-5, True, None)
        _, mean, rs = torch.ops.aten.native_layer_norm(x, (n,), w, b, 1e-5)
        rows[f"normkit LN fwd kernel {m}x{n}"] = (
            lambda x=x, w=w, b=b, n=n: _ops.rows_forward(x, None, w, b, n, 1e-5, True, None))
        rows[f"torch   LN fwd {m}x{n}"] = lambda x=x, w=w, b=b, n=n: F.layer_norm(x, (n,), w, b)
        rows[f"normkit LN bwd kernels {m}x{n}"] = (
            lambda x=x, dy=dy, w=w, stats=stats, n=n: _ops.rows_backward(
                x, dy, None, w, stats, n, True, None, x.dtype, None, True, True))
        rows[f"torch   LN bwd {m}x{n}"] = (
            lambda x=x, dy=dy, w=w, b=b, mean=mean, rs=rs, n=n:
            torch.ops.aten.native_layer_norm_backward(dy, x, (n,), mean, rs, w, b,
                                                      [True, True, True]))
        rows[f"normkit RMS fwd kernel {m}x{n}"] = (
            lambda x=x, w=w, n=n: _ops.rows_forward(x, None, w, None, n, 1e-5, False, None))
        rows[f"torch   RMS fwd {m}x{n}"] = lambda x=x, w=w, n=n: F.rms_norm(x, (n,), w, 1e-5)
    for shape, cl in (((32, 64, 56, 56), False), ((32, 64, 56, 56), True),
                      ((32, 256, 14, 14), True)):
        x = torch.randn(shape, device=DEV)
        if cl:
            x = x.to(memory_format=torch.channels_last)
        cc = shape[1]
        w, b = torch.randn(cc, device=DEV), torch.randn(cc, device=DEV)
        tag = f"{'x'.join(map(str, shape))} {'NHWC' if cl else 'NCHW'}"
        rows[f"normkit BN stats+apply {tag}"] = lambda x=x, w=w, b=b: bn_train(x, w, b)
        rows[f"normkit BN stats {tag}"] = lambda x=x: _ops.bn_stats(x, 1e-5, None)
        rows[f"torch   BN train fwd {tag}"] = lambda x=x, w=w, b=b: F.batch_norm(
            x, None, None, w, b, True)
        rows[f"normkit GN fwd {tag}"] = lambda x=x, w=w, b=b: _ops.gn_forward(
            x, 32, w, b, 1e-5, 0, None)
        rows[f"torch   GN fwd {tag}"] = lambda x=x, w=w, b=b: F.group_norm(x, 32, w, b)
    with torch.no_grad():
        table("GPU us/call (CUDA graph of 20 calls, replayed 5 times; no host time)",
              rows, graph_us)


def direct_launch() -> None:
    """Whether calling a compiled kernel's launcher directly (``CompiledKernel[grid]``,
    bypassing ``JITFunction.run``: binding, specialization key, cache lookup) gives the
    same output for less host time: the experiment before any library code relies on
    Triton's private API. Tries the argument conventions of the Triton releases (every
    parameter in order, constexprs included, as 3.3+ pass them; or only the runtime
    ones, as 3.0-3.2 did) and reports each: error, equal output or not, host us."""
    if DEV != "cuda":
        print("\n(direct_launch skipped: not on CUDA)")
        return
    from normkit.kernels.triton import _kernels as K

    print("\n## Direct launch of a compiled kernel (_row_fwd, 64 x 256)\n")
    x = torch.randn(64, 256, device=DEV)
    w, b = torch.randn(256, device=DEV), torch.randn(256, device=DEV)
    y = torch.empty_like(x)
    stats = [torch.empty(64, device=DEV) for _ in range(3)]
    args = (x, x, x, y, w, b, *stats, 256, 256, 256, 256, 256, 1.0 / 256, 1e-5)
    flags = dict(CENTER=True, HAS_RES=False, HAS_W=True, HAS_B=True, SINGLE=True, BLOCK=256)
    launch = dict(num_warps=1, **_ops.COMPILE_OPTIONS)
    compiled = K._row_fwd[(64,)](*args, **flags, **launch)
    torch.cuda.synchronize()
    want = y.clone()
    runtime = dict(zip([p.name for p in K._row_fwd.params if not p.is_constexpr], args,
                       strict=True))
    every = [runtime[p.name] if not p.is_constexpr else flags[p.name]
             for p in K._row_fwd.params]
    print(f"JITFunction launch: {host_us(lambda: K._row_fwd[(64,)](*args, **flags, **launch)):.1f}"
          f" us host; returned {type(compiled).__name__}")
    for name, call_args in (("every parameter", every), ("runtime parameters", list(args))):
        try:
            runner = compiled[(64, 1, 1)]
            y.zero_()
            runner(*call_args)
            torch.cuda.synchronize()
            same = torch.equal(y, want)
            print(f"direct, {name}: output {'equal' if same else 'DIFFERENT'}, "
                  f"{host_us(functools.partial(runner, *call_args)):.1f} us host")
        except Exception as e:  # noqa: BLE001 - the experiment reports, it does not stop
            print(f"direct, {name}: {type(e).__name__}: {str(e)[:200]}")


def tuning() -> None:
    """Kernel time (CUDA graphs) of the launch parameters over candidate values:
    ``_ops.ROW_BWD_PROGRAMS_PER_SM`` (LayerNorm backward, 4096 rows, by width),
    ``_ops.BN_CHUNKS_PER_SM`` (BatchNorm statistics + merge, and its backward),
    ``_ops.GN_CHUNKS_PER_SM`` (GroupNorm(32) of channels-last input, forward and backward),
    and the forward's block at width 16384 (``ROW_BLOCK`` chunks, two reads, against one
    block)."""
    big = DEV == "cuda"  # (the interpreter rehearsal: tiny shapes, one timed call each)
    timer = graph_us if big else (lambda fn: host_us(fn, n=1))
    rows = 4096 if big else 8
    print("\n## Tuning: GPU us/call under CUDA graphs (columns: the parameter's value)\n")
    saved = _ops.ROW_BWD_PROGRAMS_PER_SM, _ops.BN_CHUNKS_PER_SM, _ops.GN_CHUNKS_PER_SM
    candidates = (1, 2, 4, 8, 16)
    try:
        print(f"{'LN bwd, ROW_BWD_PROGRAMS_PER_SM':<40}" + "".join(f"{k:>9}" for k in candidates))
        for n in (256, 1024, 2048, 4096, 8192, 16384) if big else (16,):
            x = torch.randn(rows, n, device=DEV)
            w, b, dy = torch.randn(n, device=DEV), torch.randn(n, device=DEV), torch.randn_like(x)
            _, _, stats = _ops.rows_forward(x, None, w, b, n, 1e-5, True, None)
            times = []
            for k in candidates:
                _ops.ROW_BWD_PROGRAMS_PER_SM = ((1 << 62, k),)
                times.append(timer(functools.partial(
                    _ops.rows_backward, x, dy, None, w, stats, n, True, None, x.dtype,
                    None, True, True)))
            print(f"{f'{rows}x{n}':<40}" + "".join(f"{t:9.1f}" for t in times))
        _ops.ROW_BWD_PROGRAMS_PER_SM = saved[0]
        n = 16384 if big else 32
        blocks = (_ops.ROW_BLOCK, None) if big else (16, None)
        print(f"\n{'LN/RMS fwd block at width ' + str(n):<40}" + "".join(
            f"{'chunks' if k else 'single':>9}" for k in blocks))
        x = torch.randn(rows, n, device=DEV)
        w, b = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
        for center in (True, False):
            times = [timer(functools.partial(_ops.rows_forward, x, None, w, b if center else None,
                                             n, 1e-5, center, k)) for k in blocks]
            print(f"{f'{rows}x{n} ' + ('LN' if center else 'RMS'):<40}"
                  + "".join(f"{t:9.1f}" for t in times))
        print(f"\n{'BN, BN_CHUNKS_PER_SM':<40}" + "".join(f"{k:>9}" for k in candidates))
        images = ((((32, 64, 56, 56), False), ((32, 64, 56, 56), True),
                   ((32, 256, 14, 14), True)) if big else (((2, 4, 3, 3), True),))
        for shape, cl in images:
            x = torch.randn(shape, device=DEV)
            x = x.to(memory_format=torch.channels_last) if cl else x
            dy = torch.randn_like(x)
            tag = f"{'x'.join(map(str, shape))} {'NHWC' if cl else 'NCHW'}"
            for what in ("stats", "bwd"):
                times = []
                for k in candidates:
                    _ops.BN_CHUNKS_PER_SM = k
                    mh, ml, _, rstd = _ops.bn_stats(x, 1e-5, None)
                    fn = (functools.partial(_ops.bn_stats, x, 1e-5, None) if what == "stats"
                          else functools.partial(_ops.bn_backward, x, dy, None, mh, ml, rstd,
                                                 True, None))
                    times.append(timer(fn))
                print(f"{f'{what} {tag}':<40}" + "".join(f"{t:9.1f}" for t in times))
        _ops.BN_CHUNKS_PER_SM = saved[1]
        print(f"\n{'GN(32) NHWC, GN_CHUNKS_PER_SM':<40}" + "".join(f"{k:>9}" for k in candidates))
        for shape in ((32, 64, 56, 56), (32, 256, 14, 14)) if big else ((2, 64, 3, 3),):
            x = torch.randn(shape, device=DEV).to(memory_format=torch.channels_last)
            dy = torch.randn_like(x)
            c = shape[1]
            w, b = torch.randn(c, device=DEV), torch.randn(c, device=DEV)
            tag = "x".join(map(str, shape))
            for what in ("fwd", "bwd"):
                times = []
                for k in candidates:
                    _ops.GN_CHUNKS_PER_SM = k
                    _, mh, ml, rstd = _ops.gn_forward(x, 32, w, b, 1e-5, 0, None)
                    fn = (functools.partial(_ops.gn_forward, x, 32, w, b, 1e-5, 0, None)
                          if what == "fwd" else functools.partial(
                              _ops.gn_backward, x, dy, w, b, mh, ml, rstd, 32, 0, None))
                    times.append(timer(fn))
                print(f"{f'{what} {tag}':<40}" + "".join(f"{t:9.1f}" for t in times))
    finally:
        (_ops.ROW_BWD_PROGRAMS_PER_SM, _ops.BN_CHUNKS_PER_SM,
         _ops.GN_CHUNKS_PER_SM) = saved


def profiles() -> None:
    big = DEV == "cuda"  # (the interpreter rehearsal: tiny shapes, few calls)
    m, n = (4096, 1024) if big else (8, 64)
    shape, calls = ((32, 64, 56, 56), 200) if big else ((2, 4, 3, 3), 3)
    x = torch.randn(m, n, device=DEV, requires_grad=True)
    w = torch.ones(n, device=DEV, requires_grad=True)
    b = torch.zeros(n, device=DEV, requires_grad=True)
    img = torch.randn(shape, device=DEV, requires_grad=True)
    c = torch.ones(shape[1], device=DEV, requires_grad=True)
    cb = torch.zeros(shape[1], device=DEV, requires_grad=True)
    for name, fn in ((f"LayerNorm {m}x{n} fwd+bwd",
                      fwd_bwd(lambda: tk.layer_norm(x, (n,), w, b), x, w, b)),
                     (f"BatchNorm train {'x'.join(map(str, shape))} fwd+bwd",
                      fwd_bwd(lambda: tk.batch_norm_train(img, c, cb)[0], img, c, cb))):
        for _ in range(3):
            fn()
        print_profile(f"normkit {name}", fn, calls, 22)


def print_profile(title: str, fn, calls: int, top: int) -> None:
    """cProfile of ``calls`` calls of ``fn`` (synchronized at the end), its ``top``
    functions by own time."""
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    sync()
    prof.disable()
    print(f"\n## cProfile: {title}, {calls} calls (sorted by own time)\n")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def modules() -> None:
    """Host us per forward+backward of whole modules as users call them (``backend="auto"``:
    torch's kernels for BatchNorm/GroupNorm on CUDA, the Triton row kernels for
    LayerNorm/RMSNorm) beside torch's modules, at the shapes of ``gpu_step.py``, then a
    profile of normkit's BatchNorm2d module: what its wrapper costs on the device's host.
    Each loop is timed to its end with a sync (at these sizes the host issues slower than
    the GPU runs, so this is host time)."""
    import normkit

    big = DEV == "cuda"
    calls = 200 if big else 3
    image = (32, 64, 56, 56) if big else (2, 4, 3, 3)
    rows = (8192, 1024) if big else (8, 16)
    cases = {
        "BatchNorm2d NHWC": (torch.nn.BatchNorm2d(image[1]), normkit.BatchNorm2d(image[1]),
                             image, True),
        "GroupNorm(32) NHWC": (torch.nn.GroupNorm(min(32, image[1]), image[1]),
                               normkit.GroupNorm(min(32, image[1]), image[1]), image, True),
        "LayerNorm": (torch.nn.LayerNorm(rows[1]), normkit.LayerNorm(rows[1]), rows, False),
        "RMSNorm": (torch.nn.RMSNorm(rows[1]), normkit.RMSNorm(rows[1]), rows, False),
    }
    print("\n## Modules under backend=\"auto\": host us per forward+backward\n")
    print(f"{'module':<22}{'torch':>10}{'normkit':>10}{'torch/normkit':>15}")
    profiled = None
    for name, (theirs, ours, shape, channels_last) in cases.items():
        x = torch.randn(shape, device=DEV)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        times = []
        for module in (theirs.to(DEV), ours.to(DEV)):
            def step(module=module, x=x):
                module(x).sum().backward()
            times.append(host_us(step, calls, warmup=5, synced=True))
            if module is ours and profiled is None:
                profiled = (name, step)
        print(f"{name:<22}{times[0]:>10.1f}{times[1]:>10.1f}{times[0] / times[1]:>14.2f}x")
    name, step = profiled
    print_profile(f"normkit {name} module fwd+bwd", step, calls, 18)


def opt_in() -> None:
    """The Triton kernels ``"auto"`` does not take on CUDA, beside what it takes and beside
    torch, kernel time (CUDA graphs) and synced host time per call, forward and
    forward+backward, so that one device run can decide the policy:

    * LayerNorm2d of NCHW input: timm's ``permute -> F.layer_norm -> permute`` (its output
      a channels-last-strided view), normkit under ``"auto"`` (a copy to channels-innermost,
      the Triton row kernels, a copy back: ``_layer_norm2d_accelerator``) and the
      channels-first kernels (``backend="triton"``, not yet measured on a GPU);
    * training BatchNorm and GroupNorm(32) on channels-last input: torch, normkit under
      ``"auto"`` (torch's kernels behind normkit's wrapper) and normkit's Triton kernels
      (channels-last BatchNorm without the per-position division since ``972c1f2``;
      GroupNorm as tiles of whole channel rows since ``8f0b9f6``, whose entry
      ``"group_norm_channels_last"`` in ``TRITON_AUTO_OPS`` would make them ``"auto"``'s)."""
    import normkit.functional as NF

    big = DEV == "cuda"
    graph = (graph_us, "GPU us")
    eager = (functools.partial(host_us, n=100, warmup=5, synced=True), "eager us") if big \
        else (functools.partial(host_us, n=1, warmup=0), "us")

    def layer_norm2d(x, w, b):
        c = x.shape[1]
        return {"torch": lambda: F.layer_norm(x.permute(0, 2, 3, 1), (c,), w, b).permute(
                    0, 3, 1, 2),
                "auto": lambda: NF.layer_norm2d(x, w, b),
                "triton": lambda: NF.layer_norm2d(x, w, b, backend="triton")}

    def batch_norm(x, w, b):
        return {"torch": lambda: F.batch_norm(x, None, None, w, b, True),
                "auto": lambda: NF.batch_norm(x, None, None, w, b, True),
                "triton": lambda: NF.batch_norm(x, None, None, w, b, True, backend="triton")}

    def group_norm(x, w, b):
        g = min(32, x.shape[1])
        return {"torch": lambda: F.group_norm(x, g, w, b),
                "auto": lambda: NF.group_norm(x, g, w, b),
                "triton": lambda: NF.group_norm(x, g, w, b, backend="triton")}

    # (LayerNorm2d: ConvNeXt's stem width at 56x56, a mid stage, a wide late stage whose
    # backward walks the channels in chunks; BatchNorm/GroupNorm: the bench's CNN shapes)
    cases = [("LayerNorm2d NCHW", layer_norm2d, False,
              ((8, 96, 56, 56), (32, 256, 14, 14), (32, 768, 7, 7))),
             ("BatchNorm NHWC", batch_norm, True, ((32, 64, 56, 56), (32, 256, 14, 14))),
             ("GroupNorm(32) NHWC", group_norm, True, ((32, 64, 56, 56), (32, 256, 14, 14)))]
    print("\n## Triton kernels \"auto\" does not take on CUDA (torch: timm's permutes for "
          "LayerNorm2d)\n")
    print(f"{'op':<20}{'shape':<16}{'pass':<9}{'timer':<10}{'torch':>9}{'auto':>9}"
          f"{'triton':>9}{'torch/triton':>13}{'auto/triton':>12}")
    for title, make, channels_last, shapes in cases:
        for shape in shapes if big else ((2, 6, 3, 4),):
            c = shape[1]
            x = torch.randn(shape, device=DEV)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            w = torch.randn(c, device=DEV, requires_grad=True)
            b = torch.randn(c, device=DEV, requires_grad=True)
            calls = make(x, w, b)
            for label, timers in (("fwd", [graph] if big else [eager]),
                                  ("fwd+bwd", [graph, eager] if big else [eager])):
                for timer, unit in timers:
                    times = []
                    for fn in calls.values():
                        run = fn if label == "fwd" else fwd_bwd(fn, x, w, b)
                        try:
                            times.append(timer(run))
                        except Exception as e:  # noqa: BLE001 - reported, the rest runs
                            print(f"({title} {label} failed: {type(e).__name__}: "
                                  f"{str(e)[:160]})")
                            times.append(float("nan"))
                    print(f"{title:<20}{'x'.join(map(str, shape)):<16}{label:<9}{unit:<10}"
                          + "".join(f"{t:9.1f}" for t in times)
                          + f"{times[0] / times[2]:12.2f}x{times[1] / times[2]:11.2f}x")
                    sys.stdout.flush()


def precision() -> None:
    """The LayerNorm large-offset case that failed on the H200 (single block, width 6)."""
    print("\n## LayerNorm, mean 1e4, std 1, width 6: float32 kernels vs float64\n")
    torch.manual_seed(7)
    x64 = torch.randn(16, 6, dtype=torch.float64) + 1e4
    x = x64.to(DEV, torch.float32)
    x64 = x.double()
    w = (torch.randn(6, dtype=torch.float64) * 0.5 + 1).to(DEV, torch.float32)
    b = torch.randn(6, dtype=torch.float64).to(DEV, torch.float32)
    dy = torch.randn(16, 6, device=DEV)
    mean = x64.mean(-1)
    rstd64 = (x64.var(-1, unbiased=False) + 1e-5).rsqrt()
    xhat64 = (x64 - mean[:, None]) * rstd64[:, None]
    g = dy.double() * w.double()
    dx64 = rstd64[:, None] * (g - g.mean(-1, keepdim=True)
                              - xhat64 * (g * xhat64).mean(-1, keepdim=True))
    for block in (None, 8, 16, 4, 2):
        y, _, stats = _ops.rows_forward(x, None, w, b, 6, 1e-5, True, block)
        dx = _ops.rows_backward(x, dy, None, w, stats, 6, True, block, x.dtype, None,
                                False, False)[0]
        mh, ml, rstd = stats
        stat_mean = mh.double() + ml.double()
        y64 = xhat64 * w.double() + b.double()
        # the backward from the kernel's own statistics, in float64
        xh = (x64 - stat_mean[:, None]) * rstd.double()[:, None]
        dxs = rstd.double()[:, None] * (g - g.mean(-1, keepdim=True)
                                        - xh * (g * xh).mean(-1, keepdim=True))
        print(f"block={block}: |mean err| {float((stat_mean - mean).abs().max()):.2e}, "
              f"|mean_lo| {float(ml.abs().max()):.2e}, "
              f"|rstd rel err| {float((rstd.double() / rstd64 - 1).abs().max()):.2e}, "
              f"|y err| {float((y.double() - y64).abs().max()):.2e}, "
              f"|dx err| {float((dx.double() - dx64).abs().max()):.2e}, "
              f"|dx - dx(kernel stats)| {float((dx.double() - dxs).abs().max()):.2e}")


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.detach()).abs().max())


def accuracy() -> None:
    """torch's CUDA kernels and normkit's Triton kernels against float64, data at an
    offset (mean = ratio * std): what ``backend="auto"`` on CUDA may hand to torch."""
    print("\n## Accuracy on CUDA, float32, max abs error vs float64 (y; input gradient)\n")
    print(f"{'op':<20} {'ratio':>6} {'torch y':>9} {'normkit y':>10} "
          f"{'torch dx':>9} {'normkit dx':>10}")
    big = DEV == "cuda"
    cases = {
        "layer_norm": ((256, 1024) if big else (4, 64), None,
                       lambda x: F.layer_norm(x, x.shape[-1:]),
                       lambda x: tk.layer_norm(x, x.shape[-1:])),
        "batch_norm NCHW": ((32, 64, 16, 16) if big else (2, 4, 3, 3), False,
                            lambda x: F.batch_norm(x, None, None, training=True),
                            lambda x: tk.batch_norm_train(x)[0]),
        "batch_norm NHWC": ((32, 64, 16, 16) if big else (2, 4, 3, 3), True,
                            lambda x: F.batch_norm(x, None, None, training=True),
                            lambda x: tk.batch_norm_train(x)[0]),
        "group_norm NCHW": ((8, 64, 16, 16) if big else (2, 4, 3, 3), False,
                            lambda x: F.group_norm(x, 2), lambda x: tk.group_norm(x, 2)),
        "group_norm NHWC": ((8, 64, 16, 16) if big else (2, 4, 3, 3), True,
                            lambda x: F.group_norm(x, 2), lambda x: tk.group_norm(x, 2)),
    }
    for name, (shape, cl, torch_fn, normkit_fn) in cases.items():
        for ratio in (0.0, 10.0, 100.0, 1e3, 1e4):
            gen = torch.Generator().manual_seed(0)
            x64 = torch.randn(shape, dtype=torch.float64, generator=gen) + ratio
            dy = torch.randn(shape, dtype=torch.float64, generator=gen).to(DEV)
            x = x64.to(DEV, torch.float32)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            xd = x.double().requires_grad_()
            ref = torch_fn(xd)
            dref, = torch.autograd.grad(ref, xd, dy)
            row = []
            for fn in (torch_fn, normkit_fn):
                xi = x.detach().clone().requires_grad_()
                y = fn(xi)
                dx, = torch.autograd.grad(y, xi, dy.float())
                row.append((_err(y, ref), _err(dx, dref)))
            print(f"{name:<20} {ratio:>6g} {row[0][0]:>9.1e} {row[1][0]:>10.1e} "
                  f"{row[0][1]:>9.1e} {row[1][1]:>10.1e}")
        sys.stdout.flush()


def double_backward() -> None:
    """16-bit second derivatives on the device: torch's BatchNorm/GroupNorm double backward
    on the CPU overflows (float16 BatchNorm: inf/NaN from ~10^4 values per channel) or
    loses digits (16-bit GroupNorm composite); does CUDA's, and normkit's "auto" there?
    Max error of the weight's second derivative relative to float64's largest value."""
    import normkit

    print("\n## 16-bit second derivatives (weight), max error / max |float64|\n")
    print(f"{'layer':<12} {'dtype':<9} {'torch':>9} {'normkit':>9}")
    for name in ("BatchNorm2d", "GroupNorm"):
        for dtype in (torch.float16, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            x64 = torch.randn(4, 4, 45, 91, dtype=torch.float64, generator=gen)
            dy = torch.randn(x64.shape, dtype=torch.float64, generator=gen).to(DEV)
            v = torch.randn(x64.shape, dtype=torch.float64, generator=gen).to(DEV)
            out = {}
            for impl in ("float64", "torch", "normkit"):
                if name == "BatchNorm2d":
                    m = normkit.BatchNorm2d(4) if impl == "normkit" else torch.nn.BatchNorm2d(4)
                else:
                    m = normkit.GroupNorm(2, 4) if impl == "normkit" else torch.nn.GroupNorm(2, 4)
                # (float32 parameters: mixed precision as autocast runs BatchNorm; torch's
                # GroupNorm takes only parameters of the input's dtype on CUDA)
                m = m.to(DEV, torch.float64 if impl == "float64" else
                         dtype if name == "GroupNorm" else torch.float32)
                x = x64.to(DEV, torch.float64 if impl == "float64" else dtype)
                x.requires_grad_()
                y = m(x)
                gx, = torch.autograd.grad(y, x, dy.to(y.dtype), create_graph=True)
                out[impl], = torch.autograd.grad((gx.double() * v).sum(), m.weight)
            scale = float(out["float64"].abs().max())
            errors = [_err(out[impl], out["float64"]) / scale for impl in ("torch", "normkit")]
            print(f"{name:<12} {str(dtype)[6:]:<9} {errors[0]:>9.1e} {errors[1]:>9.1e}")
    sys.stdout.flush()


if __name__ == "__main__":
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name() if DEV == 'cuda' else DEV}")
    steps = {f.__name__: f for f in (precision, accuracy, double_backward, host_table,
                                     gpu_table, opt_in, tuning, direct_launch, profiles,
                                     modules)}
    unknown = [name for name in sys.argv[1:] if name not in steps]
    if unknown:
        sys.exit(f"unknown step(s) {unknown}: expected some of {list(steps)}")
    for step in [steps[name] for name in sys.argv[1:]] or list(steps.values()):
        try:
            step()
        except Exception:  # noqa: BLE001 - the next step still runs
            import traceback
            print(f"\n{step.__name__} failed:")
            traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
