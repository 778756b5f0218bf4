"""Large CPU outputs without first-touch page faults: cached buffers on huge pages.

On Linux a new buffer costs one page fault per 4 KiB page the first time it is written.
glibc serves every allocation of 32 MiB or more with a fresh ``mmap`` (and returns it to
the system on free), so an out-of-place op on such a tensor pays those faults on every
call (on the project's machine ~20 ms for a 64 MiB output, more than the op's own
memory traffic). Advising the fresh buffer ``MADV_HUGEPAGE`` before the first write makes
the kernel fault 2 MiB pages instead, 512 times fewer: RMSNorm's forward at 4096 x 4096
went from 42 to 25 ms (``benchmarks/RESULTS.md``, "Page faults", with the command).

:func:`out_like` allocates through torch and gives that advice to CPU buffers of at
least :data:`MIN_BYTES` whose memory has not been touched yet (a ``mincore`` check, so
memory the allocator reuses, which costs no faults, is left as it is); normkit's own
compositions write their large outputs into them (``out=``). Nothing changes where
transparent huge pages are off (``never``) or already on for all memory (``always``),
off Linux, or with ``NORMKIT_HUGEPAGES=0`` in the environment. torch's kernels allocate
their outputs themselves; LayerNorm's (forward and backward, also in ``add_layer_norm``,
and in RMSNorm's backward) and GroupNorm's (GroupNorm, GroupNormAct and InstanceNorm on
NCHW) run block by block of rows or samples where :func:`fresh_out_like` finds fresh
memory, each block copied into the advised result while in cache
(:func:`normkit.kernels.native.layer_norm_blocks`); for the others, torch's own switch
``THP_MEM_ALLOC_ENABLE=1`` (read once at start-up) gives every allocation the advice.

In a virtual machine whose balloon driver reports free 2 MiB blocks to the hypervisor
(free page reporting at order 9, as on the project's VM; ``normkit bench`` prints the
order in its header), every freed huge page goes back to the host, and the next fault on
one makes the host back it afresh: two threads faulting such pages at once stalled there
(``benchmarks/huge_page_faults.py``: 68-101 ms to fill 64 MiB against 4-8 ms once the
guest's memory was backed; 13-33 ms unadvised). Elsewhere -- and on that VM with the
reporting off -- the advised outputs were faster than plain ones at one and two threads
in every bench row measured (RESULTS.md, "Huge pages with two threads: this VM's free
page reporting").

Advised fresh memory still costs a fault per 2 MiB page, and the kernel zeroes each page
it hands out; in such a VM the host backs it afresh too. So the buffers of normkit's
large outputs are kept when freed, in an output cache, and the next output of the same
size (rounded up to 2 MiB) reuses one, already faulted in: no faults, no zeroing --
what glibc's heap reuse does process-wide, here for normkit's own outputs only. A
cached output is an ordinary CPU tensor whose storage is a ``memoryview`` of an
anonymous mapping (``torch.frombuffer``); it goes back to the cache when the last
tensor or storage using it is freed, never earlier. One difference from torch's own
allocations: its storage cannot grow (``resize_`` to more elements raises "Trying to
resize storage that is not resizable", as for a ``torch.from_numpy`` tensor); shrinking,
saving, copying, autograd and ``share_memory_()`` work as usual. The cache keeps at most
:data:`OUTPUT_CACHE_BYTES` of idle buffers, the longest idle unmapped first
(``NORMKIT_OUTPUT_CACHE_MIB``, default 1024;
``0`` turns it off and leaves the huge-page advice alone); :func:`release_cached`
unmaps them, :func:`cached_bytes` tells how much it holds. Where torch's allocation is
already touched memory (glibc's heap reuse, ``MALLOC_MMAP_MAX_=0``) nothing is cached:
there is nothing to save. RMSNorm's forward at 4096 x 4096 with glibc's default
allocator: 1.52-1.54x faster with the cache with one thread, 1.62-1.78x with two
(``benchmarks/output_cache.py``, two runs; RESULTS.md, "Large outputs: a cache of their
buffers").

Another cost is the kernel's: with ``/sys/kernel/mm/transparent_hugepage/defrag`` at its
usual ``madvise``, a fault in an advised range may compact memory to find a free 2 MiB
page, which on a long-running machine with fragmented memory can stall that fault
(never seen here: ``compact_stall`` in ``/proc/vmstat`` stayed 0 over every benchmark).
``NORMKIT_HUGEPAGES=0`` is the way out if either shows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
import threading
import weakref

import torch
from torch import Tensor

__all__ = ["MIN_BYTES", "OUTPUT_CACHE_BYTES", "advise_huge_pages", "cached_bytes",
           "empty_like", "fresh_out_like", "huge_pages_available", "out_like",
           "release_cached"]

#: Smallest CPU buffer (bytes) given the huge-page advice: glibc's largest ``mmap``
#: threshold (32 MiB on 64-bit), at and above which every allocation is a fresh mapping.
#: Smaller buffers come back from glibc's heap already faulted in after the first call.
MIN_BYTES = 32 << 20

_HUGE_PAGE = 2 << 20
_PAGE = 4096
_MADV_HUGEPAGE = 14
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _libc():
    """libc's ``madvise`` and ``mincore`` through ctypes, or ``None`` where unusable."""
    if not sys.platform.startswith("linux") or os.environ.get("NORMKIT_HUGEPAGES") == "0":
        return None
    try:
        with open(_THP_SETTING) as f:
            if "[madvise]" not in f.read():  # [always]: already huge; [never]: no use
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise, mincore = libc.madvise, libc.mincore
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    madvise.restype = mincore.restype = ctypes.c_int
    return madvise, mincore


def _cache_limit() -> int:
    """``NORMKIT_OUTPUT_CACHE_MIB`` in bytes (default 1024 MiB; ``0`` turns the cache off)."""
    text = os.environ.get("NORMKIT_OUTPUT_CACHE_MIB", "1024")
    try:
        mib = int(text)
    except ValueError:
        raise ValueError(f"NORMKIT_OUTPUT_CACHE_MIB must be a whole number of MiB (0 turns "
                         f"the output cache off), got {text!r}") from None
    if mib < 0:
        raise ValueError(f"NORMKIT_OUTPUT_CACHE_MIB must be >= 0, got {mib}")
    return mib << 20


#: Most bytes of idle buffers the output cache keeps for reuse (from
#: ``NORMKIT_OUTPUT_CACHE_MIB``, read at import: default 1 GiB, ``0`` turns the cache off).
OUTPUT_CACHE_BYTES = _cache_limit()


class _OutputCache:
    """Idle anonymous mappings of freed large outputs, for the next output of the same
    size: already faulted in, so writing it costs no page faults.

    Each buffer is one private anonymous ``mmap`` of its size rounded up to 2 MiB, plus
    2 MiB of slack so the tensor can start on a 2 MiB boundary (all of it huge pages).
    A tensor's storage holds a ``memoryview`` of its buffer (``torch.frombuffer``); when
    the last tensor or storage using it is freed, a ``weakref.finalize`` on that view
    hands the buffer back here -- never earlier, so no live tensor ever shares one. Past
    :data:`OUTPUT_CACHE_BYTES` of idle buffers the longest idle ones are unmapped (so
    that sizes no longer used, as with a sequence length that changed, make room for the
    current ones); the most recently returned buffer of a size is handed out first.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # (a finalizer can run inside a locked section)
        self.idle: list[tuple[int, mmap.mmap, int]] = []  # (size, buffer, offset), oldest first
        self.idle_bytes = 0

    def has_idle(self, size: int) -> bool:
        """Whether an idle buffer of ``size`` bytes waits here."""
        return any(entry[0] == size for entry in self.idle)

    def take(self, size: int) -> tuple[mmap.mmap, int]:
        """``(buffer, offset)``: an idle buffer of ``size`` bytes, or a new one (advised
        ``MADV_HUGEPAGE``); ``offset`` is where its 2 MiB-aligned ``size`` bytes start."""
        with self.lock:
            for i in range(len(self.idle) - 1, -1, -1):
                if self.idle[i][0] == size:
                    _, buffer, offset = self.idle.pop(i)
                    self.idle_bytes -= size
                    return buffer, offset
        # (private: Python's default for anonymous maps is MAP_SHARED, shmem -- no
        # transparent huge pages there, and shared with forked children)
        buffer = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        offset = -start % _HUGE_PAGE
        _advise(start + offset, size)
        return buffer, offset

    def give_back(self, buffer: mmap.mmap, offset: int, size: int) -> None:
        """Keep a buffer no tensor uses any more, unmapping the longest idle ones past
        :data:`OUTPUT_CACHE_BYTES`.

        (Called by a finalizer, possibly while the interpreter shuts down, when module
        globals may already be ``None``: then nothing is kept.)"""
        limit = OUTPUT_CACHE_BYTES if isinstance(OUTPUT_CACHE_BYTES, int) else 0
        if size > limit:
            _unmap(buffer)
            return
        evicted = []
        with self.lock:
            self.idle.append((size, buffer, offset))
            self.idle_bytes += size
            while self.idle_bytes > limit:
                old_size, old, _ = self.idle.pop(0)
                self.idle_bytes -= old_size
                evicted.append(old)
        for old in evicted:
            _unmap(old)

    def clear(self) -> int:
        """Unmap every idle buffer; the bytes released."""
        with self.lock:
            buffers = [buffer for _, buffer, _ in self.idle]
            released, self.idle, self.idle_bytes = self.idle_bytes, [], 0
        for buffer in buffers:
            _unmap(buffer)
        return released


def _unmap(buffer: mmap.mmap) -> None:
    """Close ``buffer`` now, or leave it to its last reference where a view of it still
    lives (``close`` refuses while one does)."""
    try:
        buffer.close()
    except BufferError:
        pass


_CACHE = _OutputCache()


def _forget_after_fork() -> None:  # (a lock another thread held at fork stays held)
    global _CACHE
    _CACHE = _OutputCache()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _cache_size(nbytes: int) -> int:
    """The cache's buffer size for ``nbytes``: rounded up to whole 2 MiB pages."""
    return -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE


def _cached_empty(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialized CPU tensor of ``shape``, ``stride`` and ``dtype`` (dense) on a
    buffer of the output cache."""
    size = _cache_size(shape.numel() * dtype.itemsize)
    cache = _CACHE
    buffer, offset = cache.take(size)
    view = memoryview(buffer)[offset:offset + size]
    weakref.finalize(view, cache.give_back, buffer, offset, size).atexit = False
    storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)


def cached_bytes() -> int:
    """Bytes of idle buffers the output cache holds for normkit's next large outputs.

    Example:
        >>> cached_bytes() >= 0
        True
    """
    return _CACHE.idle_bytes


def release_cached() -> int:
    """Unmap the output cache's idle buffers (as ``torch.cuda.empty_cache()`` does for
    CUDA's); returns the bytes released. Tensors in use keep their memory; the cache
    fills again as normkit's large outputs are freed.

    Example:
        >>> release_cached() >= 0 and cached_bytes() == 0
        True
    """
    return _CACHE.clear()


def huge_pages_available() -> bool:
    """Whether :func:`advise_huge_pages` can advise here (Linux, THP in ``madvise`` mode).

    Example:
        >>> isinstance(huge_pages_available(), bool)
        True
    """
    return _libc() is not None


def advise_huge_pages(t: Tensor) -> bool:
    """Advise the untouched 2 MiB-aligned interior of ``t``'s CPU memory ``MADV_HUGEPAGE``.

    The advice covers ``t``'s whole storage. Returns whether it was given: ``False`` for
    GPU tensors, tensors smaller than :data:`MIN_BYTES`, memory already touched (reused
    by the allocator, no faults to save), or where huge pages are unavailable
    (:func:`huge_pages_available`). The contents and the tensor are unchanged either way.

    Example:
        >>> advise_huge_pages(torch.empty(16))  # too small to be worth a system call
        False
    """
    if t.numel() * t.element_size() < MIN_BYTES or t.device.type != "cpu":
        return False
    if _libc() is None or not _untouched(t):
        return False
    storage = t.untyped_storage()
    return _advise(storage.data_ptr(), storage.nbytes())


def _interior(start: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned ``[first, end)`` inside ``nbytes`` bytes from ``start``."""
    return -(-start // _HUGE_PAGE) * _HUGE_PAGE, (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE


def _untouched(t: Tensor) -> bool:
    """Whether the first page of the aligned interior of ``t``'s storage has never been
    touched (``mincore``: not resident), as a fresh mapping's; needs :func:`_libc`."""
    storage = t.untyped_storage()
    first, end = _interior(storage.data_ptr(), storage.nbytes())
    if end <= first:
        return False
    resident = (ctypes.c_ubyte * 1)()  # one page's residency byte
    return _libc()[1](first, _PAGE, resident) == 0 and not resident[0] & 1


def _advise(start: int, nbytes: int) -> bool:
    """``MADV_HUGEPAGE`` over the aligned interior of ``nbytes`` bytes from ``start``."""
    first, end = _interior(start, nbytes)
    return end > first and _libc()[0](first, end - first, _MADV_HUGEPAGE) == 0


def out_like(x: Tensor, dtype: torch.dtype | None = None,
             memory_format: torch.memory_format = torch.preserve_format) -> Tensor | None:
    """An ``out=`` tensor for an op whose result has ``x``'s shape: huge pages or ``None``.

    ``None`` (torch allocates, as without ``out=``) unless the result is a CPU tensor of
    at least :data:`MIN_BYTES` and huge pages are available; then an uninitialized
    tensor in ``memory_format`` (as :func:`torch.empty_like`): a buffer of the output
    cache where torch's allocation would be fresh memory (with the cache off, that fresh
    memory given the huge-page advice), else torch's allocation as it is. The size test
    comes first, so small inputs pay one multiplication (~0.3 us).

    Example:
        >>> x = torch.ones(2, 3)
        >>> out_like(x) is None  # small: torch allocates
        True
        >>> torch.add(x, x, out=out_like(x))
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
    """
    allocated = _advised_empty_like(x, dtype, memory_format)
    return None if allocated is None else allocated[0]


def _advised_empty_like(x: Tensor, dtype: torch.dtype | None,
                        memory_format: torch.memory_format) -> tuple[Tensor, bool] | None:
    """``(t, spared)``: an uninitialized tensor like ``x`` and whether it spares the page
    faults torch's own allocation would take -- memory from the output cache (or, with
    the cache off, untouched memory given the huge-page advice); ``None`` (nothing
    allocated) below :data:`MIN_BYTES`, off the CPU, without huge pages or while
    compiling.

    An idle cached buffer of the size serves at once (~5 us). Otherwise torch allocates
    first (~20 us with the check): memory it hands back already touched (glibc's heap
    reuse, ``MALLOC_MMAP_MAX_=0``) costs no faults and is returned as it is, ``spared``
    False; fresh memory is released again for a new buffer of the output cache."""
    dtype = x.dtype if dtype is None else dtype
    nbytes = x.numel() * dtype.itemsize
    if (nbytes < MIN_BYTES or x.device.type != "cpu" or _libc() is None
            or torch.compiler.is_compiling()):  # (traced tensors have no memory to advise)
        return None
    if OUTPUT_CACHE_BYTES > 0 and _CACHE.has_idle(_cache_size(nbytes)):
        like = torch.empty_like(x, dtype=dtype, memory_format=memory_format, device="meta")
        return _cached_empty(like.shape, like.stride(), dtype), True
    t = torch.empty_like(x, dtype=dtype, memory_format=memory_format)
    if not _untouched(t):
        return t, False
    if OUTPUT_CACHE_BYTES <= 0:
        return t, advise_huge_pages(t)
    shape, stride = t.shape, t.stride()
    del t  # (glibc unmaps it: nothing was touched)
    return _cached_empty(shape, stride, dtype), True


def fresh_out_like(x: Tensor, dtype: torch.dtype | None = None,
                   memory_format: torch.memory_format = torch.contiguous_format
                   ) -> Tensor | None:
    """An ``out=`` tensor (cached or on huge pages) only where torch's own allocation
    would fault.

    As :func:`out_like`, but ``None`` also when torch's allocation is memory touched
    already (glibc's heap handing back memory it reuses, as with
    ``MALLOC_MMAP_MAX_=0``): there a torch kernel's own output costs no page faults, and
    a caller that would have to copy into this buffer (torch's LayerNorm kernels have no
    real ``out=``: theirs computes, then copies) is better off letting the kernel
    allocate. The buffer is freed before returning ``None``, so the kernel's allocation
    finds it.

    Example:
        >>> fresh_out_like(torch.ones(2, 3)) is None  # small: torch allocates
        True
    """
    allocated = _advised_empty_like(x, dtype, memory_format)
    return allocated[0] if allocated is not None and allocated[1] else None


def empty_like(x: Tensor, dtype: torch.dtype | None = None,
               memory_format: torch.memory_format = torch.preserve_format) -> Tensor:
    """:func:`torch.empty_like`, on huge pages where :func:`out_like` would give some.

    Example:
        >>> empty_like(torch.ones(2, 3).t(), memory_format=torch.contiguous_format).stride()
        (2, 1)
    """
    t = out_like(x, dtype, memory_format)
    return torch.empty_like(x, dtype=dtype, memory_format=memory_format) if t is None else t
