"""RMSNorm's forward block by block: which block size, and from which input size?

normkit's RMSNorm forward on the CPU is three ATen passes: the rows' norms
(``vector_norm``), the scaling by ``rstd``, the weight. Over the whole tensor each pass
streams it from memory; block by block (:func:`normkit.norms.fused._rms_in_chunks`) the
second and third passes find the block in cache. This script times the forward of
``normkit.RMSNorm`` (no gradient) with ``RMS_CHUNK_BYTES`` set to each size and to
"whole" (no blocks), in one process, round-robin, median of the per-round ratios
(whole time / blocked time: > 1, blocks faster), and checks that every size gives the
same output bits::

    PYTHONPATH=src python benchmarks/rms_chunks.py --threads 1 2

It chose :data:`normkit.norms.fused.RMS_CHUNK_BYTES` and
:data:`normkit.norms.fused.RMS_CHUNK_MIN_BYTES` (the sizes below that floor are timed
too: the layer itself would not take the blocks there, so the script lowers the floor
while it runs). Figures for reading, not
asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import normkit
from normkit.norms import fused

SHAPES = ("4096x768", "4096x1024", "4096x2048", "16384x1024", "65536x256", "4096x4096",
          "4096x8192", "2048x32768")
SIZES_MIB = (1, 2, 4, 8)


def measure(shape: tuple[int, int], rounds: int) -> dict[str, float]:
    """``{size: whole time / blocked time}`` at the current thread count."""
    m, k = shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0))
    layer = normkit.RMSNorm(k)
    sizes = {"whole": 1 << 62, **{f"{mib} MiB": mib << 20 for mib in SIZES_MIB}}
    saved = fused.RMS_CHUNK_BYTES, fused.RMS_CHUNK_MIN_BYTES

    def call(nbytes: int) -> torch.Tensor:
        fused.RMS_CHUNK_BYTES, fused.RMS_CHUNK_MIN_BYTES = nbytes, 0
        try:
            with torch.no_grad():
                return layer(x)
        finally:
            fused.RMS_CHUNK_BYTES, fused.RMS_CHUNK_MIN_BYTES = saved

    want = call(sizes["whole"])
    for name, nbytes in sizes.items():
        assert torch.equal(call(nbytes), want), name
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
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print("| threads | shape | MiB | " + " | ".join(f"{mib} MiB" for mib in SIZES_MIB) + " |")
    print("|---:|---|---:|" + "---:|" * len(SIZES_MIB))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for spec in args.shapes:
            m, k = (int(v) for v in spec.split("x"))
            ratios = measure((m, k), args.rounds)
            print(f"| {threads} | {spec} | {m * k * 4 / (1 << 20):.0f} | "
                  + " | ".join(f"{ratio:.2f}x" for ratio in ratios.values()) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
