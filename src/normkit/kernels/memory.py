"""Large CPU outputs on transparent huge pages: fewer first-touch page faults.

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
import os
import sys

import torch
from torch import Tensor

__all__ = ["MIN_BYTES", "advise_huge_pages", "empty_like", "fresh_out_like",
           "huge_pages_available", "out_like"]

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
    calls = _libc()
    if calls is None:
        return False
    madvise, mincore = calls
    storage = t.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE  # aligned interior
    end = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= first:
        return False
    resident = (ctypes.c_ubyte * 1)()  # one page's residency byte
    if mincore(first, _PAGE, resident) != 0 or resident[0] & 1:
        return False
    return madvise(first, end - first, _MADV_HUGEPAGE) == 0


def out_like(x: Tensor, dtype: torch.dtype | None = None,
             memory_format: torch.memory_format = torch.preserve_format) -> Tensor | None:
    """An ``out=`` tensor for an op whose result has ``x``'s shape: huge pages or ``None``.

    ``None`` (torch allocates, as without ``out=``) unless the result is a CPU tensor of
    at least :data:`MIN_BYTES` and huge pages are available; then a fresh uninitialized
    tensor in ``memory_format`` (as :func:`torch.empty_like`) given the huge-page advice.
    The size test comes first, so small inputs pay one multiplication (~0.3 us).

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
    """``(t, advised)``: a fresh uninitialized tensor like ``x`` and whether its memory was
    untouched and got the huge-page advice; ``None`` (nothing allocated) below
    :data:`MIN_BYTES`, off the CPU, without huge pages or while compiling."""
    dtype = x.dtype if dtype is None else dtype
    if (x.numel() * dtype.itemsize < MIN_BYTES or x.device.type != "cpu" or _libc() is None
            or torch.compiler.is_compiling()):  # (traced tensors have no memory to advise)
        return None
    t = torch.empty_like(x, dtype=dtype, memory_format=memory_format)
    return t, advise_huge_pages(t)


def fresh_out_like(x: Tensor, dtype: torch.dtype | None = None,
                   memory_format: torch.memory_format = torch.contiguous_format
                   ) -> Tensor | None:
    """An ``out=`` tensor on huge pages only where torch's own allocation would fault.

    As :func:`out_like`, but ``None`` also when the buffer's memory has been touched
    already (glibc's heap handing back memory it reuses, as with
    ``MALLOC_MMAP_MAX_=0``): there a torch kernel's own output costs no page faults, and
    a caller that would have to copy into this buffer (torch's LayerNorm kernels have no
    ``out=``) is better off letting the kernel allocate. The buffer is freed before
    returning ``None``, so the kernel's allocation finds it.

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
