"""Measurement primitives: interleaved timing, the copy-bandwidth yardstick, peak memory.

Timing
------
Every implementation of a case runs in the same process, on the same tensors, with
the same thread count. After a warm-up, each round times every implementation once,
round-robin (the starting one rotates per round), so a burst of machine noise hits
all of them rather than one; a measurement repeats the call ``number`` times, chosen
so it lasts at least ``min_time`` (small shapes would otherwise time the clock). The
summary is the median time of each implementation and the median over rounds of the
per-round ratio ``reference time / implementation time``. On CUDA, times come from
CUDA events around the calls, synchronized after each measurement.

Cold cache: a cache that holds the inputs turns a memory-bound op into a cache-bound
one, and an H200's 60 MB L2 holds every transformer row up to 4096 x 1024 in float32,
input and output. With ``flush_bytes``, the timer writes a buffer that large before
every call, outside the timed span (CUDA: the buffer's write runs before the call's
start event in the stream), so each call reads its inputs from device memory, as
``triton.testing.do_bench`` does; calls are then timed one by one.

Peak memory
-----------
* CPU: there are no allocator statistics, so "peak memory" is what a training step
  keeps alive between forward and backward: the bytes of the distinct storages
  autograd saves for backward (seen through ``torch.autograd.graph.saved_tensors_hooks``,
  so the input counts when it is saved) together with the outputs' storages. It is
  deterministic, and it is what limits the batch size. Transient workspace inside
  the forward is not counted.
* CUDA: ``torch.cuda.max_memory_allocated`` over one forward + backward, minus what
  was allocated before it (inputs, output gradients and parameters excluded),
  transients included.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["Timer", "interleaved", "calibrate", "median_ratio", "ratio_quartiles",
           "module_passes", "copy_bandwidth", "graphed",
           "saved_bytes", "cuda_peak_bytes", "tensor_bytes"]


class Timer:
    """Seconds per call of ``fn`` repeated ``number`` times, on ``device``'s clock.

    Args:
        device: whose clock: CUDA events on ``"cuda"``, ``time.perf_counter`` otherwise.
        flush_bytes: bytes written before every call and kept out of its time, so that
            the call finds no input in the cache (see the module docstring); 0: none.

    ``flush_seconds`` is what one flush costs (0.0 without): the wall time a
    measurement spends beyond its calls.

    Example:
        >>> Timer("cpu")(lambda: None, number=10) >= 0.0
        True
        >>> cold = Timer("cpu", flush_bytes=1 << 20)
        >>> cold(lambda: None, number=3) < cold.flush_seconds   # the flush is not timed
        True
    """

    def __init__(self, device: str | torch.device = "cpu", flush_bytes: int = 0) -> None:
        if flush_bytes < 0:
            raise ValueError(f"flush_bytes must be >= 0, got {flush_bytes}")
        self.cuda = torch.device(device).type == "cuda"
        self._buffer = (torch.empty(flush_bytes, dtype=torch.uint8, device=device)
                        if flush_bytes else None)
        self.flush_seconds = 0.0
        if self._buffer is not None:
            self._buffer.fill_(1)  # fault its pages in
            self.flush_seconds = statistics.median(
                Timer(device)(self._buffer.zero_) for _ in range(3))

    def __call__(self, fn: Callable[[], object], number: int = 1) -> float:
        if self._buffer is not None:
            return self._cold(fn, number)
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(number):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / number
        begin = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - begin) / number

    def _cold(self, fn: Callable[[], object], number: int) -> float:
        buffer = self._buffer
        assert buffer is not None
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(number)]
            for start, end in events:
                buffer.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in events) / 1e3 / number
        total = 0.0
        for _ in range(number):
            buffer.zero_()
            begin = time.perf_counter()
            fn()
            total += time.perf_counter() - begin
        return total / number


def graphed(fn: Callable[[], object], warmup: int = 3) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph: the returned function replays it, so a timed call
    is the kernels' time without the host's (Python, dispatch, launches).

    ``fn`` runs ``warmup`` times on a side stream first (compilation, the allocator),
    then once under capture; its tensors live in the graph's private memory pool and
    every replay rewrites them. A call that cannot be captured (one that synchronizes,
    or computes on the CPU) raises here.

    Example (needs a CUDA GPU):
        >>> replay = graphed(lambda: torch.ones(8, device="cuda") * 2)  # doctest: +SKIP
        >>> Timer("cuda")(replay, number=10)  # doctest: +SKIP
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def calibrate(seconds_per_call: float, min_time: float, cap: int = 10_000) -> int:
    """Calls per measurement so that one measurement lasts at least ``min_time``.

    Example:
        >>> calibrate(1e-5, 1e-3), calibrate(0.5, 1e-3), calibrate(0.0, 1e-3)
        (100, 1, 10000)
    """
    if seconds_per_call <= 0:
        return cap
    return max(1, min(cap, math.ceil(min_time / seconds_per_call - 1e-9)))


def interleaved(fns: dict[str, Callable[[], object]], timer: Timer, repeats: int,
                number: int) -> dict[str, list[float]]:
    """Time every function ``repeats`` times, round-robin; seconds per call, per round.

    Round ``r`` starts with function ``r % len(fns)``, so no function always runs first.

    Example:
        >>> samples = interleaved({"a": lambda: None, "b": lambda: None}, Timer(), 3, 1)
        >>> {name: len(times) for name, times in samples.items()}
        {'a': 3, 'b': 3}
    """
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        start = round_ % len(names) if names else 0
        for name in names[start:] + names[:start]:
            samples[name].append(timer(fns[name], number))
    return samples


def module_passes(modules: dict[str, torch.nn.Module], x: torch.Tensor, dy: torch.Tensor,
                  rounds: int, min_time: float = 5e-3) -> dict[str, dict[str, float]]:
    """Median ms of each module's forward (no grad) and forward+backward (the gradient
    ``dy`` to ``x``, as a leaf of its own layout), timed round-robin: ``{"fwd": {name:
    ms}, "fwd+bwd": {name: ms}}``. Each measurement repeats the call so that it lasts
    ``min_time`` as the first module runs it. For the scripts of ``benchmarks/`` that
    compare modules on one input.

    Example:
        >>> mods = {"a": torch.nn.LayerNorm(8), "b": torch.nn.LayerNorm(8)}
        >>> out = module_passes(mods, torch.randn(4, 8), torch.randn(4, 8), 3, 1e-4)
        >>> sorted(out), sorted(out["fwd"])
        (['fwd', 'fwd+bwd'], ['a', 'b'])
    """
    leaf = x.detach().requires_grad_()

    def forward(module):
        with torch.no_grad():
            return module(x)

    def forward_backward(module):
        return torch.autograd.grad(module(leaf), [leaf], dy)

    out = {}
    timer = Timer()
    first = next(iter(modules.values()))
    for label, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
        number = calibrate(timer(lambda s=step: s(first)), min_time)
        samples = interleaved({k: (lambda s=step, m=m: s(m)) for k, m in modules.items()},
                              timer, rounds, number)
        out[label] = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    return out


def median_ratio(reference: Sequence[float], other: Sequence[float]) -> float:
    """Median over rounds of ``reference[r] / other[r]`` (> 1: ``other`` is faster).

    Example:
        >>> median_ratio([2.0, 2.0, 9.0], [1.0, 2.0, 3.0])
        2.0
    """
    return statistics.median(a / b for a, b in zip(reference, other, strict=True))


def ratio_quartiles(reference: Sequence[float],
                    other: Sequence[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile of the per-round ratios ``reference / other``.

    The spread says how much to trust the median: on a noisy machine it is wide.

    Example:
        >>> ratio_quartiles([2.0, 2.0, 9.0], [1.0, 2.0, 3.0])
        (1.5, 2.0, 2.5)
        >>> ratio_quartiles([3.0], [1.5])
        (2.0, 2.0, 2.0)
    """
    ratios = [a / b for a, b in zip(reference, other, strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q2, q3


def copy_bandwidth(device: str | torch.device = "cpu", nbytes: int = 256 << 20,
                   repeats: int = 11) -> float:
    """This machine's copy bandwidth in GB/s: median time of ``dst.copy_(src)``.

    A copy reads and writes ``nbytes``, so it moves ``2 * nbytes``. Use a buffer much
    larger than the last-level cache (the default, 256 MiB) for a memory figure.

    Example:
        >>> copy_bandwidth(nbytes=1 << 20, repeats=3) > 0
        True
    """
    src = torch.rand(max(1, nbytes // 4), device=device)  # touched: no lazily-mapped pages
    dst = torch.empty_like(src)
    timer = Timer(device)
    for _ in range(2):
        dst.copy_(src)
    seconds = statistics.median(timer(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def _storage_key(t: torch.Tensor) -> tuple[tuple[str, int], int]:
    """((device, storage address), storage bytes) of a tensor; numel-based if it has none."""
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return (str(t.device), id(t)), t.numel() * t.element_size()


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once).

    Example:
        >>> x = torch.zeros(4, 8)
        >>> tensor_bytes([x, x[1:], x.t()]), tensor_bytes([x, x.clone()])
        (128, 256)
    """
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        key, nbytes = _storage_key(t)
        if nbytes:
            seen[key] = nbytes
    return sum(seen.values())


def saved_bytes(forward: Callable[[], tuple[torch.Tensor, ...]]) -> dict[str, int]:
    """What one training forward keeps alive for backward (the CPU "peak memory").

    Runs ``forward`` (grad enabled) under ``saved_tensors_hooks`` and returns
    ``saved_bytes`` (distinct storages autograd saved), ``output_bytes`` and
    ``peak_bytes`` (the union of both: an output that is also saved counts once).

    Example:
        >>> x = torch.randn(8, 16, requires_grad=True)
        >>> saved_bytes(lambda: (torch.exp(x),))   # exp saves its output only
        {'saved_bytes': 512, 'output_bytes': 512, 'peak_bytes': 512}
    """
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = forward()
    result = {"saved_bytes": tensor_bytes(saved), "output_bytes": tensor_bytes(outputs),
              "peak_bytes": tensor_bytes([*saved, *outputs])}
    saved.clear()  # release the graph's tensors with the caller's outputs
    return result


def cuda_peak_bytes(step: Callable[[], object]) -> int:
    """Peak CUDA memory allocated by ``step`` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
