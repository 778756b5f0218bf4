"""Channels-last slice sums: one full-size square against cache-sized blocks.

The slice-sums engine (``normkit.kernels.channels``) needs, for channels-last input, the
per-(sample, channel) sums of ``x`` and ``x^2`` over the positions: outer reductions of
each sample's ``(L, C)`` matrix. It used to square the whole tensor and then sum the
squares (a full-size temporary written and read back through memory); it now squares a
block of about ``COLUMN_BLOCK_BYTES`` per thread into a reused buffer and sums it while
it is in cache (``_blocked_column_sums``). This script times both on the same inputs,
float32, in one process with a fixed thread count, round-robin, median of the per-round
times, and checks that the sums agree.

Prints a Markdown table: ms per call of each and the ratio (> 1: blocks faster), and the
largest relative difference between the two results; ``--block-bytes`` times several
block sizes (each a column) to choose the constant. The last timed column is the other
way the engine takes these sums with one thread, torch's BatchNorm kernel on each
sample's folded matrix (``_kernel_column_sums`` with ``_fold``), where a fold exists. A
second table times the contiguous (NCHW) case: a row sum plus a row ``vector_norm``
against torch's BatchNorm backward kernel on the ``(1, N*C, L)`` view (``_row_sums``).

Run: ``python benchmarks/column_sums.py [--threads 1 2] [--repeats 9]
[--block-bytes 262144 1048576]`` (under a minute per block size), ``--accuracy`` for
the errors behind ``FOLD_ROWS``, or ``--folds`` for the kernel's time and BatchNorm's
error at every fold (the table behind ``FOLD_ROWS_BATCH``), then the backward sums per
sample against one call over the whole folded matrix, then (also alone, ``--backward``)
the engine's whole channels-last BatchNorm backward against torch's backward kernel
(the table behind ``CHANNELS_LAST_BACKWARD_MAX_COUNT``). ``--stats-kernel`` times the
engine's BatchNorm statistics against torch's statistics kernel and its fused kernel on
channels-last input with few values per channel (the table behind
``native.batch_norm_moments``). ``--group-blocks`` times GroupNorm's channels-last sums
from the cache blocks against the kernel folds (the table behind
``GROUP_BLOCK_MIN_SAMPLES``). ``--batch-sums`` and ``--backward-sums`` time BatchNorm's
channels-last forward and backward sums per sample, in one call over the whole folded
matrix (and, forward, from the blocks), each call also from a cold cache (the tables
behind ``WHOLE_FOLD_MIN_THREADS``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from normkit.kernels import channels

SHAPES = [(32, 64, 56, 56), (32, 256, 14, 14), (8, 32, 128, 128), (4, 64, 128, 128)]


def whole(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous way: column sums, then the sums of a full-size tensor of squares."""
    return cols.sum(1), (cols * cols).sum(1)


def _time(fn, calls: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _round_robin_ms(fns, repeats: int) -> list[float]:
    """Median ms per call of each of ``fns``: one warm-up call each, then ``repeats``
    rounds that time every function once, in turn."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(repeats):  # round-robin
        for fn, into in zip(fns, times, strict=True):
            into.append(_time(fn))
    return [statistics.median(t) * 1e3 for t in times]


def _blocks(cols: torch.Tensor, block_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    saved = channels.COLUMN_BLOCK_BYTES
    channels.COLUMN_BLOCK_BYTES = block_bytes
    try:
        return channels._blocked_column_sums(cols)
    finally:
        channels.COLUMN_BLOCK_BYTES = saved


def measure(shape: tuple[int, ...], repeats: int, sizes: list[int]
            ) -> tuple[float, list[float], float]:
    """``(whole ms, [blocks ms per block size], max relative difference)`` for
    channels-last ``shape``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).add_(1.0).to(memory_format=torch.channels_last)
    cols = channels._columns(x)
    ref = whole(cols)
    diff = max(((u - v).abs() / v.abs().clamp_min(1e-30)).max().item()
               for size in sizes for u, v in zip(ref, _blocks(cols, size), strict=True))
    fold = channels._fold(cols.shape[1])
    fns = [lambda: whole(cols)] + [lambda s=size: _blocks(cols, s) for size in sizes]
    if fold is not None:
        folded = channels._kernel_column_sums(cols, fold)
        diff = max(diff, *(((u - v).abs() / v.abs().clamp_min(1e-30)).max().item()
                           for u, v in zip(ref, folded, strict=True)))
        fns.append(lambda: channels._kernel_column_sums(cols, fold))
    medians = _round_robin_ms(fns, repeats)
    if fold is None:
        medians.append(float("nan"))
    return medians[0], medians[1:], diff


def rows_whole(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous input, the previous way: a row sum and a row vector_norm (two reads)."""
    rows = x.view(x.shape[0] * x.shape[1], -1)
    return rows.sum(1), torch.linalg.vector_norm(rows, 2, 1).square_()


def rows_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous input, the engine's way: torch's BatchNorm backward kernel (one read)."""
    return channels._row_sums(x.view(1, x.shape[0] * x.shape[1], -1))


def measure_rows(shape: tuple[int, ...], repeats: int) -> tuple[float, float]:
    """``(row sum + vector_norm ms, kernel ms)`` for contiguous ``shape``."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).add_(1.0)
    whole_ms, kernel_ms = _round_robin_ms((lambda: rows_whole(x), lambda: rows_kernel(x)),
                                         repeats)
    return whole_ms, kernel_ms


def _batch_norm_error(x: torch.Tensor, sums: tuple[torch.Tensor, torch.Tensor],
                      eps: float = 1e-5) -> float:
    """Max error vs float64 of training BatchNorm of contiguous ``x`` from per-slice sums."""
    n, c = x.shape[:2]
    count = n * x.shape[2:].numel()
    s1, s2 = (s.double().view(n, c).sum(0) for s in sums)
    mean = s1 / count
    rstd = torch.rsqrt((s2 / count - mean * mean).clamp_min(0) + eps)
    view = (1, c) + (1,) * (x.dim() - 2)
    y = (x.double() - mean.view(view)) * rstd.view(view)
    ref = torch.nn.functional.batch_norm(x.double(), None, None, training=True, eps=eps)
    return float((y - ref).abs().max())


def _group_norm_error(x: torch.Tensor, sums: tuple[torch.Tensor, torch.Tensor],
                      groups: int, eps: float = 1e-5) -> float:
    """Max error vs float64 of GroupNorm of ``x`` with statistics from ``sums``."""
    n, c = x.shape[:2]
    count = c // groups * x.shape[2:].numel()
    s1, s2 = (s.double().view(n, groups, -1).sum(2) for s in sums)
    mean = s1 / count
    rstd = torch.rsqrt((s2 / count - mean * mean).clamp_min(0) + eps)
    grouped = x.double().contiguous().view(n, groups, -1)
    y = (grouped - mean[..., None]) * rstd[..., None]
    ref = torch.nn.functional.group_norm(x.double().contiguous(), groups, eps=eps).view(
        n, groups, -1)
    return float((y - ref).abs().max())


#: (shape, groups) of the channels-last accuracy table: GroupNorm as in the bench, and
#: GroupNorm and InstanceNorm (one group per channel) as in benchmarks/accuracy.py.
ACCURACY_CASES = [((32, 64, 56, 56), 32), ((32, 32, 32, 32), 8), ((32, 32, 32, 32), 32)]
#: Rows per fold to compare (each where it divides the positions), and unfolded.
ACCURACY_ROWS = (512, 256, 224, 128, 64, 32)


def accuracy() -> None:
    """Print GroupNorm's error from each way's sums (torch's kernel at several folds
    included), at ``|mean| / std`` 0, 1 and 2: the table behind ``FOLD_ROWS``."""
    print("GroupNorm of channels_last input from float32 sums, max error vs float64 "
          f"(FOLD_ROWS = {channels.FOLD_ROWS})\n")
    print("| shape | groups | sums | ratio 0 | ratio 1 | ratio 2 |")
    print("|---|---:|---|---:|---:|---:|")
    for shape, groups in ACCURACY_CASES:
        length = shape[2] * shape[3]
        ways = {"cascade (whole)": whole, "blocks": channels._blocked_column_sums,
                f"kernel, {length} rows (unfolded)": channels._kernel_column_sums}
        for rows in ACCURACY_ROWS:
            if length % rows == 0 and rows < length:
                ways[f"kernel, {rows} rows"] = (
                    lambda cols, k=length // rows: channels._kernel_column_sums(cols, k))
        errors: dict[str, list[float]] = {name: [] for name in ways}
        for offset in (0.0, 1.0, 2.0):
            gen = torch.Generator().manual_seed(0)
            x = (torch.randn(shape, generator=gen) + offset).contiguous(
                memory_format=torch.channels_last)
            cols = channels._columns(x)
            for name, way in ways.items():
                errors[name].append(_group_norm_error(x, way(cols), groups))
        for name, errs in errors.items():
            print(f"| {'x'.join(map(str, shape))} | {groups} | {name} | "
                  + " | ".join(f"{e:.1e}" for e in errs) + " |")
    print("\nBatchNorm (training) of contiguous input from per-slice sums, max error vs "
          "float64\n")
    print("| shape | sums | ratio 0 | ratio 1 | ratio 2 |")
    print("|---|---|---:|---:|---:|")
    for shape in SHAPES[:3]:
        row = {"row sum + vector_norm": [], "BatchNorm kernel": []}
        for offset in (0.0, 1.0, 2.0):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) + offset
            row["row sum + vector_norm"].append(_batch_norm_error(x, rows_whole(x)))
            row["BatchNorm kernel"].append(_batch_norm_error(x, rows_kernel(x)))
        for name, errs in row.items():
            print(f"| {'x'.join(map(str, shape))} | {name} | "
                  + " | ".join(f"{e:.1e}" for e in errs) + " |")


#: Channels-last BatchNorm shapes of the fold table (more than 8192 values per channel:
#: the engine's, not torch's kernel).
FOLD_SHAPES = [(32, 64, 56, 56), (8, 32, 128, 128), (32, 128, 28, 28), (32, 192, 28, 28),
               (16, 64, 32, 32), (64, 64, 16, 16)]


def _offset_batch_input(shape: tuple[int, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, cols, exact)``: seeded float64 ``randn + 1.5`` as channels-last float32 ``x``,
    its ``(N, L, C)`` columns, and the float64 input's biased per-channel variance."""
    x64 = torch.randn(shape, generator=torch.Generator().manual_seed(0),
                      dtype=torch.float64).add_(1.5)
    x = x64.float().contiguous(memory_format=torch.channels_last)
    return x, channels._columns(x), x64.var((0, 2, 3), correction=0)


def _variance_error(s1: torch.Tensor, s2: torch.Tensor, count: int,
                    exact: torch.Tensor) -> float:
    """Max relative error of ``E[x^2] - E[x]^2`` from pooled float64 sums ``s1``, ``s2``
    over ``count`` values per channel against ``exact``."""
    mean = s1 / count
    return ((s2 / count - mean * mean - exact).abs() / exact).max().item()


def folds(threads: list[int], repeats: int) -> None:
    """Print, per channels-last shape, the time of torch's BatchNorm kernel sums at every
    fold leaving 16 or more rows (and of the blocks), and the relative error of the
    BatchNorm variance pooled from each fold's sums (input ``randn + 1.5``)."""
    print("Channels-last BatchNorm sums: ms per call of the kernel at each fold (rows in "
          "sequence x columns), and of the blocks; then the max relative error of the "
          "pooled variance vs float64\n")
    print("| threads | shape | way | ms | variance rel. error |")
    print("|---:|---|---|---:|---:|")
    for threads_now in threads:
        torch.set_num_threads(threads_now)
        for shape in FOLD_SHAPES:
            x, cols, exact = _offset_batch_input(shape)
            n, length, c = cols.shape
            ways = {f"kernel, {length // k} x {k * c}": (
                lambda k=k, cols=cols: channels._kernel_column_sums(cols, k))
                for k in range(1, length // channels.FOLD_MIN_ROWS + 1) if length % k == 0
                and k in (1, 2, 4, 7, 8, 14, 16, 28, 49, 64, 256)}
            ways["blocks"] = lambda cols=cols: channels._blocked_column_sums(cols)
            times = dict(zip(ways, _round_robin_ms(list(ways.values()), repeats),
                             strict=True))
            for name, fn in ways.items():
                err = _variance_error(*(t.double().sum(0) for t in fn()), n * length, exact)
                print(f"| {threads_now} | {'x'.join(map(str, shape))} | {name} | "
                      f"{times[name]:.2f} | {err:.1e} |")


def _channels_last_inputs(shape: tuple[int, ...], offset: float = 0.0
                          ) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """``(generator, x, dy)``: seeded channels-last ``randn + offset`` and ``randn`` of
    ``shape`` (the generator goes on, for more draws)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).add_(offset).contiguous(
        memory_format=torch.channels_last)
    dy = torch.randn(shape, generator=gen).contiguous(memory_format=torch.channels_last)
    return gen, x, dy


def _backward_sums_as(way: bool, dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor):
    """BatchNorm's channels-last backward sums with the whole-matrix fold forced on
    (``way=True``) or off (one call per sample), whatever the sample size and threads."""
    saved = channels._blocks_of_samples, channels.WHOLE_FOLD_MIN_THREADS
    channels._blocks_of_samples = lambda cols, pool: way
    channels.WHOLE_FOLD_MIN_THREADS = 1 if way else 1 << 30
    try:
        return channels._backward_sums(dy, x, mean, channels.Pool("batch"))
    finally:
        channels._blocks_of_samples, channels.WHOLE_FOLD_MIN_THREADS = saved


def backward_folds(threads: list[int], repeats: int) -> None:
    """Print, per channels-last shape, the time of BatchNorm's backward sums taken per
    sample (folded to at most FOLD_ROWS_BATCH rows each) and in one call over the whole
    (N*L, C) matrix folded to FOLD_ROWS_BATCH rows, and the max relative difference of
    the pooled sums against float64 of each."""
    print("\nChannels-last BatchNorm backward sums (sum dy, sum dy (x - mean)): ms per call "
          "one call per sample / one call over the whole folded matrix; max relative error "
          "of the pooled sums vs float64\n")
    print("| threads | shape | per sample ms | whole ms | per sample error | whole error |")
    print("|---:|---|---:|---:|---:|---:|")
    for threads_now in threads:
        torch.set_num_threads(threads_now)
        for shape in FOLD_SHAPES:
            _, x, dy = _channels_last_inputs(shape, 1.5)
            c = shape[1]
            mean = x.double().mean((0, 2, 3)).float().view(1, c)
            want = (dy.double().sum((0, 2, 3)),
                    (dy.double() * (x.double() - mean.double().view(1, c, 1, 1))).sum((0, 2, 3)))
            errors = []
            for way in (False, True):
                got = [t.double().sum(0) for t in _backward_sums_as(way, dy, x, mean)]
                errors.append(max(float(((g - w).abs() / w.abs().max()).max())
                                  for g, w in zip(got, want, strict=True)))
            per_sample, whole = _round_robin_ms(
                [lambda way=way, args=(dy, x, mean): _backward_sums_as(way, *args)
                 for way in (False, True)], repeats)
            print(f"| {threads_now} | {'x'.join(map(str, shape))} | {per_sample:.2f} | "
                  f"{whole:.2f} | {errors[0]:.1e} | {errors[1]:.1e} |")


def backward_ways(threads: list[int], repeats: int) -> None:
    """Print, per channels-last shape, the time of the engine's whole BatchNorm backward
    (folded sums, then the two elementwise passes) and of torch's backward kernel from the
    same statistics (one call: sums and ``dx``), ``dx``, ``dweight`` and ``dbias`` all
    wanted (the table behind ``CHANNELS_LAST_BACKWARD_MAX_COUNT``; the errors are
    ``benchmarks/accuracy.py --backward-counts``)."""
    print("\nChannels-last BatchNorm backward: ms per call, the engine's (folded sums + two "
          "passes) / torch's backward kernel from the same statistics\n")
    print("| threads | shape | values per channel | engine ms | kernel ms | engine / kernel |")
    print("|---:|---|---:|---:|---:|---:|")
    for threads_now in threads:
        torch.set_num_threads(threads_now)
        for shape in FOLD_SHAPES:
            gen, x, dy = _channels_last_inputs(shape)
            c = shape[1]
            weight = torch.rand(c, generator=gen) + 0.5
            mean, _, rstd = channels.moments(x, channels.Pool("batch"), 1e-5)

            def engine(x=x, dy=dy, weight=weight, mean=mean, rstd=rstd):
                saved = channels.CHANNELS_LAST_BACKWARD_MAX_COUNT
                channels.CHANNELS_LAST_BACKWARD_MAX_COUNT = 0  # the engine's own sums
                try:
                    return channels.backward(dy, x, mean, rstd, weight,
                                             channels.Pool("batch"), (True, True, True))
                finally:
                    channels.CHANNELS_LAST_BACKWARD_MAX_COUNT = saved

            def kernel(x=x, dy=dy, weight=weight, mean=mean, rstd=rstd, c=c):
                return torch.ops.aten.native_batch_norm_backward(
                    dy, x, weight, None, None, mean.view(c), rstd.view(c), True, 1e-5,
                    [True, True, True])

            for got, want in zip(engine(), kernel(), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            engine_ms, kernel_ms = _round_robin_ms([engine, kernel], repeats)
            count = x.numel() // c
            print(f"| {threads_now} | {'x'.join(map(str, shape))} | {count} | "
                  f"{engine_ms:.2f} | {kernel_ms:.2f} | {engine_ms / kernel_ms:.2f}x |",
                  flush=True)


#: Channels-last GroupNorm shapes (32 groups of several channels) whose samples span the
#: sizes where ``_blocks_of_samples`` switches between the cache blocks and the 256-row
#: kernel folds with one and two threads (``--group-blocks``).
GROUP_BLOCK_SHAPES = [(32, 256, 14, 14), (16, 128, 28, 28), (32, 96, 28, 28),
                      (32, 128, 28, 28), (32, 64, 56, 56), (16, 64, 64, 64),
                      (32, 96, 56, 56)]


def group_blocks(threads: list[int], repeats: int) -> None:
    """Print, per channels-last GroupNorm shape, the time of its slice sums from the cache
    blocks (``_blocked_column_sums``) and from torch's kernel on each sample folded to
    ``FOLD_ROWS_BATCH`` rows (``_kernel_column_sums``), with the whole samples a block
    holds and the way the engine takes (the table behind ``GROUP_BLOCK_MIN_SAMPLES``)."""
    print("\nChannels-last GroupNorm slice sums (32 groups): ms per call, cache blocks / "
          "kernel folds; samples per block; the engine's way\n")
    print("| threads | shape | sample KiB | samples per block | blocks ms | kernel ms | "
          "blocks / kernel | engine takes |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for threads_now in threads:
        torch.set_num_threads(threads_now)
        for shape in GROUP_BLOCK_SHAPES:
            _, x, _ = _channels_last_inputs(shape, 1.0)
            cols = channels._columns(x)
            pool = channels.Pool("group", 32)
            fold = channels._fold(cols.shape[1], channels._fold_rows(pool, shape[1])) or 1
            for u, v in zip(channels._blocked_column_sums(cols),
                            channels._kernel_column_sums(cols, fold), strict=True):
                torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-3)
            blocks, kernel = _round_robin_ms(
                [lambda c=cols: channels._blocked_column_sums(c),
                 lambda c=cols, f=fold: channels._kernel_column_sums(c, f)], repeats)
            sample = cols[0].numel() * cols.element_size()
            per_block = channels.COLUMN_BLOCK_BYTES * threads_now // sample
            way = "blocks" if channels._blocks_of_samples(cols, pool) else "kernel"
            print(f"| {threads_now} | {'x'.join(map(str, shape))} | {sample >> 10} | "
                  f"{per_block} | {blocks:.3f} | {kernel:.3f} | {blocks / kernel:.2f}x | "
                  f"{way} |", flush=True)


#: Channels-last shapes with at most CHANNELS_LAST_MAX_COUNT values per channel, where
#: torch's BatchNorm sums are accurate under the ratio bound (``--stats-kernel``).
FEW_VALUES_SHAPES = [(32, 256, 14, 14), (8, 64, 32, 32), (128, 512, 7, 7), (64, 128, 8, 8)]


def stats_kernel(threads: list[int], repeats: int) -> None:
    """Print, per channels-last shape with few values per channel, the time of three ways
    to training-mode BatchNorm statistics -- the engine's accurate sums
    (``channels.moments``), torch's statistics kernel (``torch.batch_norm_update_stats``,
    what ``native.batch_norm_moments`` runs) and torch's fused kernel (statistics and a
    normalized output) -- and the error of each one's mean and ``invstd`` against float64
    (relative to ``1 / std``, at ``|mean| / std`` = 1.5, inside the bound of 2)."""
    print("\nChannels-last BatchNorm statistics, few values per channel: ms per call, and "
          "max error of mean * invstd64 and of invstd / invstd64 vs float64 (offset 1.5)\n")
    print("| threads | shape | values per channel | engine ms | stats kernel ms | "
          "fused kernel ms | engine / stats kernel | engine error | stats kernel error | "
          "fused kernel error |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    eps = 1e-5
    for threads_now in threads:
        torch.set_num_threads(threads_now)
        for shape in FEW_VALUES_SHAPES:
            _, x, _ = _channels_last_inputs(shape, 1.5)
            c = shape[1]
            assert x.numel() // c <= channels.CHANNELS_LAST_MAX_COUNT
            ways = [
                lambda x=x: channels.moments(x, channels.Pool("batch"), eps),
                lambda x=x: torch.batch_norm_update_stats(x, None, None, 0.0),
                lambda x=x: torch.native_batch_norm(x, None, None, None, None, True, 0.0, eps),
            ]
            x64 = x.double()
            mean64 = x64.mean((0, 2, 3))
            invstd64 = (x64.var((0, 2, 3), correction=0) + eps).rsqrt()
            engine = channels.moments(x, channels.Pool("batch"), eps)
            stats = torch.batch_norm_update_stats(x, None, None, 0.0)
            fused = torch.native_batch_norm(x, None, None, None, None, True, 0.0, eps)[1:]
            pairs = [(engine[0].view(c), engine[2].view(c)),
                     (stats[0], (stats[1] + eps).rsqrt()), tuple(fused)]
            errors = [max(float(((m.double() - mean64).abs() * invstd64).max()),
                          float(((r.double() - invstd64).abs() / invstd64).max()))
                      for m, r in pairs]
            times = _round_robin_ms(ways, repeats)
            print(f"| {threads_now} | {'x'.join(map(str, shape))} | {x.numel() // c} | "
                  + " | ".join(f"{t:.3f}" for t in times)
                  + f" | {times[0] / times[1]:.2f}x | "
                  + " | ".join(f"{e:.1e}" for e in errors) + " |", flush=True)


#: Bytes written between two timed calls of ``--batch-sums``: twice this VM's 32 MiB L3, so
#: every call reads its input from memory, as a layer in a network does.
FLUSH_BYTES = 64 << 20

#: Channels-last BatchNorm shapes past CHANNELS_LAST_MAX_COUNT values per channel
#: (``--batch-sums``): the fold table's, and larger batches of small samples.
BATCH_SUMS_SHAPES = FOLD_SHAPES + [(128, 64, 16, 16), (64, 128, 14, 14)]


def _cold_round_robin_ms(fns, repeats: int) -> list[float]:
    """Median ms per call of each of ``fns``, every call from a cold cache: a
    :data:`FLUSH_BYTES` buffer is written before each (untimed), round-robin."""
    flush = torch.empty(FLUSH_BYTES // 4)
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for round_ in range(repeats):
        for fn, into in zip(fns, times, strict=True):
            flush.fill_(round_)
            start = time.perf_counter()
            fn()
            into.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def _print_cold_warm_row(threads: int, shape: tuple[int, ...], size: int, ways, repeats: int,
                         errors: list[float], engine: str) -> None:
    """One table row of ``--batch-sums`` / ``--backward-sums``: every way's ms from a cold
    cache and warm, the errors and the way the engine takes."""
    cold = _cold_round_robin_ms(ways, repeats)
    warm = _round_robin_ms(ways, repeats)
    print(f"| {threads} | {'x'.join(map(str, shape))} | {size} | "
          + " / ".join(f"{t:.2f}" for t in cold) + " | "
          + " / ".join(f"{t:.2f}" for t in warm) + " | "
          + ", ".join(f"{e:.1e}" for e in errors) + f" | {engine} |", flush=True)


def batch_sums(threads: list[int], repeats: int) -> None:
    """Print, per channels-last BatchNorm shape, the time of the three ways to its forward
    sums -- torch's kernel on each sample folded to FOLD_ROWS_BATCH rows, the same kernel
    once on the whole ``(N*L, C)`` matrix so folded, and the cache blocks -- each call
    from a cold cache, and the relative error of the pooled variance from each (input
    ``randn + 1.5``); the way the engine takes (the table behind
    ``channels.WHOLE_FOLD_MIN_THREADS``)."""
    print("\nChannels-last BatchNorm forward sums: ms per call of each way (per-sample "
          "folds / whole fold / blocks), from a cold cache and warm (the input just read); "
          "max relative error of the pooled variance vs float64 (offset 1.5)\n")
    print("| threads | shape | sample KiB | cold ms | warm ms | "
          "errors (per sample, whole, blocks) | engine takes |")
    print("|---:|---|---:|---|---|---|---|")
    pool = channels.Pool("batch")
    for threads_now in threads:
        torch.set_num_threads(threads_now)
        for shape in BATCH_SUMS_SHAPES:
            x, cols, exact = _offset_batch_input(shape)
            n, length, c = cols.shape
            fold = channels._fold(length, channels.FOLD_ROWS_BATCH) or 1
            ways = [lambda cols=cols, fold=fold: channels._kernel_column_sums(cols, fold),
                    lambda cols=cols: channels._whole_column_sums(cols),
                    lambda cols=cols: channels._blocked_column_sums(cols)]
            errors = []
            for way in ways:  # (pooled as the engine pools: Pool.sum, in float32)
                errors.append(_variance_error(*(t.sum(0).double() for t in way()),
                                              n * length, exact))
            s1, _ = channels._slice_sums(x, pool)
            engine = ("whole fold" if s1.shape[0] == 1 else "blocks"
                      if channels._blocks_of_samples(cols, pool) else "per-sample folds")
            _print_cold_warm_row(threads_now, shape, cols[0].numel() * 4 >> 10, ways,
                                 repeats, errors, engine)


#: Channels-last BatchNorm shapes past CHANNELS_LAST_BACKWARD_MAX_COUNT values per channel,
#: whose backward takes the engine's sums (``--backward-sums``).
BACKWARD_SUMS_SHAPES = [(16, 64, 112, 112), (64, 64, 56, 56), (8, 32, 256, 256)]


def backward_sums(threads: list[int], repeats: int) -> None:
    """Print, per channels-last BatchNorm shape whose backward takes the engine's sums, the
    time of those sums per sample and in one call over the whole folded matrix, cold and
    warm, and their max error relative to float64 (the sums pooled in float32, as the
    engine pools them); the way the engine takes (the backward half of the table behind
    ``channels.WHOLE_FOLD_MIN_THREADS``)."""
    print("\nChannels-last BatchNorm backward sums (sum dy, sum dy (x - mean)) past "
          f"{channels.CHANNELS_LAST_BACKWARD_MAX_COUNT} values per channel: ms per call, "
          "per-sample folds / whole fold, from a cold cache and warm; max error relative "
          "to the largest sum vs float64\n")
    print("| threads | shape | values per channel | cold ms | warm ms | "
          "errors (per sample, whole) | engine takes |")
    print("|---:|---|---:|---|---|---|---|")
    pool = channels.Pool("batch")
    for threads_now in threads:
        torch.set_num_threads(threads_now)
        for shape in BACKWARD_SUMS_SHAPES:
            _, x, dy = _channels_last_inputs(shape, 1.5)
            c = shape[1]
            assert x.numel() // c > channels.CHANNELS_LAST_BACKWARD_MAX_COUNT
            mean = x.double().mean((0, 2, 3)).float().view(1, c)
            want = (dy.double().sum((0, 2, 3)),
                    (dy.double() * (x.double() - mean.double().view(1, c, 1, 1))).sum((0, 2, 3)))
            errors = []
            for way in (False, True):
                got = [t.sum(0).double() for t in _backward_sums_as(way, dy, x, mean)]
                errors.append(max(float(((g - w).abs() / w.abs().max()).max())
                                  for g, w in zip(got, want, strict=True)))
            ways = [lambda way=way, args=(dy, x, mean): _backward_sums_as(way, *args)
                    for way in (False, True)]
            s1, _ = channels._backward_sums(dy, x, mean, pool)
            engine = "whole fold" if s1.shape[0] == 1 else "per-sample folds"
            _print_cold_warm_row(threads_now, shape, x.numel() // c, ways, repeats, errors,
                                 engine)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--block-bytes", type=int, nargs="+",
                        default=[channels.COLUMN_BLOCK_BYTES],
                        help="block sizes per thread to time (default: the library's)")
    parser.add_argument("--accuracy", action="store_true",
                        help="print the error of each way's sums instead of timing them")
    parser.add_argument("--folds", action="store_true",
                        help="time torch's kernel sums at every fold (BatchNorm) instead")
    parser.add_argument("--backward", action="store_true",
                        help="time the engine's channels-last BatchNorm backward against "
                             "torch's backward kernel instead")
    parser.add_argument("--stats-kernel", action="store_true",
                        help="time the engine's BatchNorm statistics against torch's "
                             "statistics kernel on channels-last input with few values per "
                             "channel instead")
    parser.add_argument("--group-blocks", action="store_true",
                        help="time GroupNorm's channels-last sums from the cache blocks "
                             "against the kernel folds instead")
    parser.add_argument("--batch-sums", action="store_true",
                        help="time BatchNorm's channels-last forward sums per sample, over "
                             "the whole folded matrix and from the blocks, cold, instead")
    parser.add_argument("--backward-sums", action="store_true",
                        help="time BatchNorm's channels-last backward sums past the count "
                             "where the engine takes its backward, per sample and over the "
                             "whole folded matrix, cold and warm, instead")
    args = parser.parse_args(argv)
    if args.batch_sums:
        batch_sums(args.threads, args.repeats)
        return
    if args.backward_sums:
        backward_sums(args.threads, args.repeats)
        return
    if args.group_blocks:
        group_blocks(args.threads, args.repeats)
        return
    if args.stats_kernel:
        stats_kernel(args.threads, args.repeats)
        return
    if args.accuracy:
        accuracy()
        return
    if args.folds:
        folds(args.threads, args.repeats)
        backward_folds(args.threads, args.repeats)
        backward_ways(args.threads, args.repeats)
        return
    if args.backward:
        backward_ways(args.threads, args.repeats)
        return
    sizes = args.block_bytes
    print(f"torch {torch.__version__}, COLUMN_BLOCK_BYTES = {channels.COLUMN_BLOCK_BYTES}; "
          f"blocks: ms (whole / blocks) per block size in bytes per thread\n")
    print("| threads | shape (channels_last) | whole ms | "
          + " | ".join(f"{s} B" for s in sizes) + " | folded kernel | max rel diff |")
    print("|---:|---|---:|" + "---:|" * (len(sizes) + 1) + "---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            old, new, diff = measure(shape, args.repeats, sizes)
            cells = " | ".join("-" if t != t else f"{t:.2f} ({old / t:.2f}x)" for t in new)
            print(f"| {threads} | {'x'.join(map(str, shape))} | {old:.2f} | {cells} | "
                  f"{diff:.1e} |")
    print("\nContiguous (NCHW) input, per-slice sums: ms\n")
    print("| threads | shape | row sum + vector_norm | BatchNorm kernel | x |")
    print("|---:|---|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            old, new_ms = measure_rows(shape, args.repeats)
            print(f"| {threads} | {'x'.join(map(str, shape))} | {old:.2f} | {new_ms:.2f} | "
                  f"{old / new_ms:.2f}x |")


if __name__ == "__main__":
    main()
