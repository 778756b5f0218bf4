"""Compile every Triton kernel variant normkit launches, for a GPU target, without a GPU.

::

    python -m normkit.kernels.triton.compile_check             # sm_90 (H100, H200)
    python -m normkit.kernels.triton.compile_check --arch 80 90
    python -m normkit.kernels.triton.compile_check --fail-on-spills

Each op runs forward and backward on small CPU tensors with kernel launches intercepted
(:data:`normkit.kernels.triton._ops.launch_hook`). Every distinct launch (kernel,
argument types, constexpr values, warps) is compiled by ``triton.compile`` for
``GPUTarget("cuda", arch, 32)``, through TTIR, TTGIR, LLVM IR and PTX to a cubin made by
the ``ptxas`` that ships with Triton. This checks what the interpreter cannot: that the
kernels are valid input for Triton's compiler (types, loop-carried values, constexpr
branches, layouts) and fit the target. It runs nothing on a GPU and measures nothing.

Each line also gives the cubin's resources as Triton's ``cuobjdump`` reads them: ``REG``
registers per thread and ``LOCAL`` bytes of local memory per thread, which in these
kernels (no local arrays) means registers spilled to memory, a slowdown a GPU run would
only show as lost bandwidth. ``--fail-on-spills`` makes a spilling variant a failure (CI
runs it: ``tests/test_triton_dispatch.py``). The widest rows are what spill first:
``ROW_BLOCK`` (8192) was set where the float32 backward used 128 registers at 16 warps
in a compile without the JIT's specialization, the most a 512-thread program can have
without spilling; as launched it uses 92-111 (Triton 3.6 and 3.9).

Each launch is specialized as Triton's JIT specializes it at run time (where the
installed Triton exposes its ``native_specialize_impl``, 3.6 to 3.9): an integer equal to
1 becomes a constant, integers and data pointers divisible by 16 carry that divisibility.
Without it the compiler cannot know that a channel stride is 1, and it may lay a tile out
along the wrong axis: Triton 3.6 then compiled the channels-last BatchNorm/GroupNorm tiles
uncoalesced at 144-251 registers (session 43), figures no real launch has.

It needs ``triton`` imported *without* the interpreter (``TRITON_INTERPRET`` unset), and
uses ``triton.compiler.ASTSource`` as in Triton 3.6 to 3.9 (a semi-public interface; run
with both).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.float64: "fp64"}


def _signature(kernel, args: tuple, constexprs: dict) -> dict[str, str]:
    """Triton's type string of each argument (generic: no value specialization)."""
    signature = {}
    for name, arg in zip(kernel.arg_names, args, strict=False):
        if isinstance(arg, torch.Tensor):
            signature[name] = "*" + _TYPES[arg.dtype]
        elif isinstance(arg, bool):
            signature[name] = "i1"
        elif isinstance(arg, int):
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
        elif isinstance(arg, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: no Triton type for argument {name}={arg!r}")
    signature.update({name: "constexpr" for name in constexprs})
    return signature


def _specialization(kernel, args: tuple, constexprs: dict
                    ) -> tuple[dict[str, str], dict, dict] | None:
    """``(signature, constants, attributes)`` of a launch as Triton's JIT specializes it
    (``JITFunction._pack_args``: integers equal to 1 become constants, integers and
    pointers divisible by 16 get ``tt.divisibility``), or None where the installed Triton
    has no ``native_specialize_impl``."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return None
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        kind, attr = native_specialize_impl(BaseBackend, args[index], False, True, True)[:2]
        signature[name] = kind
        if kind == "constexpr":
            constants[(index,)] = attr
        elif isinstance(attr, str):
            attrs[(index,)] = BaseBackend.parse_attr(attr)
    return signature, constants, attrs


def launches() -> dict[tuple, tuple]:
    """Every distinct launch of the ops on a representative set of small inputs:
    ``(kernel, signature, constants, num_warps, attributes)`` by a key of all of them."""
    from . import _ops

    seen: dict[tuple, tuple] = {}

    def record(kernel, grid, args, constexprs, num_warps):
        special = _specialization(kernel, args, constexprs)
        if special is None:  # (no runtime specialization: generic types, names)
            special = (_signature(kernel, args, constexprs), dict(constexprs), {})
        signature, constants, attrs = special
        key = (kernel.__name__, tuple(signature.items()),
               tuple(sorted((str(k), v) for k, v in constants.items())),
               tuple(sorted((k, str(v)) for k, v in attrs.items())), num_warps)
        seen.setdefault(key, (kernel, signature, constants, num_warps, attrs))

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype)

    previous, _ops.launch_hook = _ops.launch_hook, record
    try:
        for center in (True, False):
            for n, block in ((33, None), (130, 32), (8192, None), (16384, None)):
                for residual in (None, rand(4, n)):
                    x, w = rand(4, n, dtype=torch.bfloat16), rand(n)
                    b = rand(n) if center else None
                    _, h, stats = _ops.rows_forward(x, residual, w, b, n, 1e-5, center,
                                                    block)
                    src = x if h is None else h
                    _ops.rows_backward(src, torch.randn_like(x), None if h is None else src,
                                       w, stats, n, center, block, x.dtype,
                                       None if residual is None else residual.dtype, True,
                                       b is not None)
                    _ops.rows_forward(x, residual, w, b, n, 1e-5, center, block, stats=False)
            x = rand(4, 33)
            _ops.rows_forward(x, None, None, None, 33, 1e-5, center, None)  # no affine
        for c, block in ((96, None), (768, None), (4096, None), (6, 16)):  # channels-first
            x = rand(2, c, 5, 5, dtype=torch.bfloat16)
            w, b = rand(c), rand(c)
            _, stats = _ops.cf_forward(x, w, b, 1e-5, block)
            for params in ((w, b), (None, None)):
                _ops.cf_forward(x, *params, 1e-5, block, stats=False)
                _ops.cf_backward(x, torch.randn_like(x), params[0], stats, block, True,
                                 params[1] is not None)
        for act in (0, 1):
            for layout in (torch.contiguous_format, torch.channels_last):
                x = rand(2, 8, 5, 5, dtype=torch.float16).contiguous(memory_format=layout)
                w, b = rand(8), rand(8)
                _, mh, ml, rstd = _ops.gn_forward(x, 4, w, b, 1e-5, act, None)
                _ops.gn_backward(x, torch.randn_like(x), w, b, mh, ml, rstd, 4, act, None)
            _ops.gn_forward(x, 4, None, None, 1e-5, act, None)
            for c in (64, 256):  # channels-innermost tiles of 64 channels, as on CNN shapes
                x = rand(2, c, 6, 6).contiguous(memory_format=torch.channels_last)
                w, b = rand(c), rand(c)
                _, mh, ml, rstd = _ops.gn_forward(x, 32, w, b, 1e-5, act, None)
                _ops.gn_backward(x, torch.randn_like(x), w, b, mh, ml, rstd, 32, act, None)
        for layout, c in ((torch.contiguous_format, 8), (torch.channels_last, 8),
                          (torch.channels_last, 64)):  # (64: the tiles of CNN shapes)
            x = rand(4, c, 5, 5, dtype=torch.bfloat16).contiguous(memory_format=layout)
            w, b = rand(c), rand(c)
            mh, ml, _, rstd = _ops.bn_stats(x, 1e-5, None)
            for params in ((w, b), (None, None)):
                _ops.bn_apply(x, mh, ml, rstd, *params, None)
                for train in (True, False):
                    _ops.bn_backward(x, torch.randn_like(x), params[0], mh, ml, rstd, train,
                                     None)
    finally:
        _ops.launch_hook = previous
    return seen


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _cuobjdump() -> str | None:
    """The ``cuobjdump`` that ships with Triton's NVIDIA backend, or None."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    return path if os.access(path, os.X_OK) else None


def resource_usage(cubin: bytes, cuobjdump: str) -> dict[str, int] | None:
    """``{"REG", "STACK", "SHARED", "LOCAL"}`` of a one-kernel cubin, or None if unread.

    Example:
        >>> resource_usage(b"not a cubin", "true") is None  # a tool that prints nothing
        True
    """
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        done = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True,
                              text=True, timeout=60)
    found = _USAGE.search(done.stdout)
    if found is None:
        return None
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, found.groups()),
                    strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90],
                        help="CUDA compute capabilities to compile for (default: 90)")
    parser.add_argument("--fail-on-spills", action="store_true",
                        help="count a variant that spills registers (LOCAL > 0) as failed")
    options = parser.parse_args(argv)
    from . import interpreting

    if interpreting():
        print("compile_check needs the compiler: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ._ops import COMPILE_OPTIONS

    cuobjdump = _cuobjdump()
    if options.fail_on_spills and cuobjdump is None:
        print("--fail-on-spills needs the cuobjdump of Triton's NVIDIA backend, not found",
              file=sys.stderr)
        return 2
    todo = launches()
    failures = spills = 0
    for arch in options.arch:
        target = GPUTarget("cuda", arch, 32)
        for (name, sig, _, _, warps), (kernel, signature, values, num_warps,
                                        attrs) in todo.items():
            start = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(kernel, signature, values, attrs),
                                          target=target,
                                          options={"num_warps": num_warps, **COMPILE_OPTIONS})
                status = f"ok   {len(compiled.asm['cubin']):>7} B cubin"
                usage = None if cuobjdump is None else resource_usage(compiled.asm["cubin"],
                                                                      cuobjdump)
                if usage is not None:
                    status += f"  REG {usage['REG']:>3} LOCAL {usage['LOCAL']}"
                    if usage["LOCAL"]:
                        spills += 1
                        status += " SPILLS"
            except Exception as error:  # report every failing variant, then fail
                failures += 1
                status = f"FAIL {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            flags = " ".join(f"{k}={v}" for k, v in sorted(
                (n, values.get((i,), values.get(n))) for i, n in enumerate(kernel.arg_names)
                if signature.get(n) == "constexpr" and n.isupper()))
            dtype = dict(sig).get(kernel.arg_names[0], "")
            print(f"sm_{arch} {name:<16} {dtype:<5} warps={warps:<2} {status}  "
                  f"({time.perf_counter() - start:.1f}s)  {flags}", flush=True)
    print(f"{sum(1 for _ in todo) * len(options.arch) - failures} compiled, {failures} failed, "
          f"{spills} spilling registers")
    return 1 if failures or (options.fail_on_spills and spills) else 0


if __name__ == "__main__":
    sys.exit(main())
