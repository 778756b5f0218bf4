"""LayerNorm block by block onto huge pages: which block size, and what it gains?

torch's LayerNorm kernels allocate their outputs, and glibc maps every allocation of
32 MiB or more fresh, so at 4096 x 4096 float32 and larger each call pays a page fault
per 4 KiB of output. normkit runs the kernels block by block of rows instead
(:func:`normkit.kernels.native.layer_norm_blocks`, and the backward's counterpart), each
block's output copied while in cache into one result advised ``MADV_HUGEPAGE``, where
that result's memory is fresh. This script times ``normkit.LayerNorm`` and
``normkit.AddLayerNorm``, forward (no gradient) and forward+backward, with
``LAYER_NORM_BLOCK_BYTES`` set to each size and with the blocks off (torch's kernel over
the whole tensor, as where the memory is reused), in one process, round-robin, median of
the per-round ratios (whole time / blocked time: > 1, blocks faster), and checks that
every size gives the same output and input-gradient bits::

    PYTHONPATH=src python benchmarks/layer_norm_blocks.py --threads 1 2

Run it with glibc's default allocator: with heap reuse (``MALLOC_MMAP_MAX_=0``) the
outputs' memory is resident, the layer takes the whole-tensor call, and there is
nothing to measure (the script says so and stops). Figures for reading, not asserting:
one machine, one run.

``--floor`` asks instead what bounds torch's LayerNorm forward kernel itself (which
normkit's forward runs), with heap reuse so that no output pays page faults: ms per call
(median) of ``dst.copy_(x)``, the kernel over the whole tensor, the kernel on 128-row
blocks whose outputs stay in cache (no memory writes), those blocks copied into one
result, and a composition from other ATen kernels (normkit's one-read row sums, then
BatchNorm's inference kernel per row and an ``addcmul`` for the affine, block by
block)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \
        PYTHONPATH=src python benchmarks/layer_norm_blocks.py --floor --threads 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import normkit
from normkit.kernels import channels, memory, native

SHAPES = ("4096x2048", "4096x4096", "4096x8192", "16384x1024")
SIZES_MIB = (1, 2, 4, 8)


def _no_blocks(*args, **kwargs):
    return None


def measure(shape: tuple[int, int], layer: str, backward: bool,
            rounds: int) -> dict[str, float]:
    """``{size: whole time / blocked time}`` at the current thread count."""
    m, k = shape
    gen = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, k, generator=gen) for _ in range(3))
    module = normkit.LayerNorm(k) if layer == "layer_norm" else normkit.AddLayerNorm(k)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.normal_()
    sizes = {"whole": 0, **{f"{mib} MiB": mib << 20 for mib in SIZES_MIB}}
    saved = native.LAYER_NORM_BLOCK_BYTES, native.fresh_out_like

    def call(nbytes: int) -> tuple[torch.Tensor, ...]:
        native.LAYER_NORM_BLOCK_BYTES = nbytes or saved[0]
        native.fresh_out_like = saved[1] if nbytes else _no_blocks
        try:
            xi = x.detach().requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                out = module(xi) if layer == "layer_norm" else module(xi, r)[0]
            if not backward:
                return (out,)
            (dx,) = torch.autograd.grad(out, xi, dy)
            return out.detach(), dx
        finally:
            native.LAYER_NORM_BLOCK_BYTES, native.fresh_out_like = saved

    want = call(0)
    for name, nbytes in sizes.items():
        got = call(nbytes)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
    times: dict[str, list[float]] = {name: [] for name in sizes}
    for _ in range(rounds):
        for name, nbytes in sizes.items():
            begin = time.perf_counter()
            call(nbytes)
            times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(a / b for a, b in zip(times["whole"], samples,
                                                           strict=True))
            for name, samples in times.items() if name != "whole"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--layers", nargs="+", default=["layer_norm", "add_layer_norm"],
                        choices=["layer_norm", "add_layer_norm"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--floor", action="store_true",
                        help="time what bounds torch's forward kernel (run with heap reuse)")
    args = parser.parse_args()
    if args.floor:
        floor(args.threads, args.shapes, args.rounds)
        return
    if not memory.huge_pages_available():
        raise SystemExit("huge pages unavailable here (not Linux, THP not in madvise mode, "
                         "or NORMKIT_HUGEPAGES=0): the layers never take the blocks")
    if any(name.startswith("MALLOC_") for name in os.environ):
        raise SystemExit("run with glibc's default allocator (no MALLOC_* variables): "
                         "with heap reuse the layers take the whole-tensor call")
    print("| layer | pass | threads | shape | MiB | "
          + " | ".join(f"{mib} MiB" for mib in SIZES_MIB) + " |")
    print("|---|---|---:|---|---:|" + "---:|" * len(SIZES_MIB))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for layer in args.layers:
            for backward in (False, True):
                for spec in args.shapes:
                    m, k = (int(v) for v in spec.split("x"))
                    ratios = measure((m, k), layer, backward, args.rounds)
                    print(f"| {layer} | {'fwd+bwd' if backward else 'fwd'} | {threads} | "
                          f"{spec} | {m * k * 4 / (1 << 20):.0f} | "
                          + " | ".join(f"{ratio:.2f}x" for ratio in ratios.values()) + " |",
                          flush=True)


def floor(threads: list[int], shapes: list[str], rounds: int) -> None:
    """``--floor``: ms per call of the forward's candidate ways (module docstring)."""
    if "MALLOC_MMAP_MAX_" not in os.environ:
        raise SystemExit("run --floor with heap reuse (MALLOC_MMAP_MAX_=0 "
                         "MALLOC_TRIM_THRESHOLD_=68719476736): fresh outputs would measure "
                         "page faults, not the kernel")
    print("| threads | shape | copy_ ms | kernel ms | cached blocks ms | blocks + copy ms "
          "| row sums + BN kernel + addcmul ms |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for count in threads:
        torch.set_num_threads(count)
        for spec in shapes:
            m, k = (int(v) for v in spec.split("x"))
            medians = _floor_ms(m, k, rounds)
            print(f"| {count} | {spec} | " + " | ".join(f"{ms:.2f}" for ms in medians) + " |",
                  flush=True)


def _floor_ms(m: int, k: int, rounds: int, rows: int = 128) -> list[float]:
    """Median ms of each way of :func:`floor` on an ``m x k`` float32 input, round-robin."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen) * 2 + 1
    w, b = torch.randn(k, generator=gen), torch.randn(k, generator=gen)
    out = torch.empty_like(x)
    saved_mean, saved_invstd = torch.empty(0), torch.empty(0)

    def blocks(copy: bool) -> None:
        for i in range(0, m, rows):
            y = torch.native_layer_norm(x[i:i + rows], (k,), w, b, 1e-5)[0]
            if copy:
                out[i:i + rows].copy_(y)

    def composition() -> None:
        for i in range(0, m, rows):
            block = x[i:i + rows].view(1, -1, k)
            s1, s2 = channels._row_sums(block)
            mean = s1.div_(k)
            var = s2.div_(k).sub_(mean * mean)
            o = out[i:i + rows]
            torch.ops.aten.native_batch_norm.out(
                block, None, None, mean, var, False, 0.0, 1e-5, out=o.view(1, -1, k),
                save_mean=saved_mean, save_invstd=saved_invstd)
            torch.addcmul(b, o, w, out=o)

    ways = [lambda: out.copy_(x), lambda: torch.native_layer_norm(x, (k,), w, b, 1e-5),
            lambda: blocks(False), lambda: blocks(True), composition]
    for way in ways:  # (warm-up)
        way()
    times: list[list[float]] = [[] for _ in ways]
    for _ in range(rounds):
        for way, way_times in zip(ways, times, strict=True):
            begin = time.perf_counter()
            way()
            way_times.append(time.perf_counter() - begin)
    return [statistics.median(t) * 1e3 for t in times]


if __name__ == "__main__":
    main()
