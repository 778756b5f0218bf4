"""backend='triton' through the module API, on the CPU via Triton's interpreter.

The interpreter must be on before triton is first imported, and earlier tests import
it without (torch.compile does), so the checks run in a fresh process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from normkit.kernels import triton as tk  # (does not import triton)

#: Why the interpreter cannot run the kernels here (old Triton, new NumPy), or None.
PROBLEM = tk.interpreter_problem() if importlib.util.find_spec("triton") else None

needs_interpreter = [pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                        reason="triton is not installed"),
                     pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))]

SCRIPT = textwrap.dedent('''
    import copy, json
    import torch, normkit
    torch.manual_seed(0)
    out = {}

    def rel(a, b):  # max error relative to the reference's scale (grads sum many terms)
        return ((a - b).abs().max() / a.abs().max().clamp(min=1.0)).item()

    cases = {"LayerNorm": (normkit.LayerNorm(33), (5, 33)),
             "RMSNorm": (normkit.RMSNorm(33), (5, 33)),
             "GroupNorm": (normkit.GroupNorm(2, 4), (3, 4, 5, 5)),
             "GroupNorm-nhwc": (normkit.GroupNorm(2, 4), (3, 4, 5, 5)),
             "BatchNorm2d": (normkit.BatchNorm2d(4), (3, 4, 5, 5))}
    for name, (eager, shape) in cases.items():
        x = torch.randn(shape) * 2 + 1
        if name.endswith("nhwc"):
            x = x.contiguous(memory_format=torch.channels_last)
        tri = copy.deepcopy(eager)
        tri.backend = "triton"
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(a), tri(b)
        ya.square().sum().backward()
        yb.square().sum().backward()
        errors = [rel(ya, yb), rel(a.grad, b.grad)]
        errors += [rel(p.grad, q.grad) for p, q in zip(eager.parameters(), tri.parameters())]
        errors += [rel(p, q) for p, q in zip(eager.buffers(), tri.buffers())
                   if p.is_floating_point()]
        eager.eval(), tri.eval()
        errors.append(rel(eager(x), tri(x)))
        out[name] = {"errors": errors, "node": type(yb.grad_fn).__name__}
    try:
        normkit.InstanceNorm2d(4, backend="triton")(torch.randn(2, 4, 3, 3))
    except ValueError as error:
        out["unsupported"] = str(error)
    print(json.dumps(out))
''')


@needs_interpreter[0]
@needs_interpreter[1]
def test_triton_backend_matches_the_default_path():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "no kernel" in result.pop("unsupported")
    for name, case in result.items():
        assert "Function" in case["node"] and "Native" not in case["node"], (name, case)
        assert max(case["errors"]) < 1e-5, (name, case["errors"])


@pytest.mark.parametrize("triton_version,numpy_version,broken", [
    ("3.6.0", "2.4.0", True), ("3.0.0", "2.5.2", True), ("3.6.0", "2.3.5", False),
    ("3.6.0", "1.26.4", False), ("3.7.0", "2.4.6", False), ("3.9.0", "2.5.5", False),
    ("3.10.0rc1", "2.4.0", False), ("3.1.0", "2.0.0", True), ("3.0.0", "2.3.5", True),
    ("3.1.0", "1.26.4", False), ("3.2.0", "2.3.5", False),
])
def test_interpreter_problem_names_the_versions(triton_version, numpy_version, broken):
    problem = tk.interpreter_problem(triton_version, numpy_version)
    assert (problem is not None) == broken
    if broken:
        assert triton_version in problem and numpy_version in problem
        assert "triton>=3.7" in problem and "numpy<2" in problem


def test_cpu_tensors_report_a_broken_interpreter(monkeypatch):
    """With the interpreter on but unusable, the predicate says no and backend='triton'
    raises the reason, instead of an InterpreterError from inside a kernel."""
    monkeypatch.setattr(tk, "interpreting", lambda: True)
    monkeypatch.setattr(tk, "available", lambda: True)
    monkeypatch.setattr(tk, "_interpreter_problem", lambda: "triton 3.6.0 ... numpy<2.4")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(4, 8)
    assert not tk.supports_layer_norm(x, (8,))
    with pytest.raises(ValueError, match=r"working Triton interpreter.*numpy<2\.4"):
        tk.layer_norm(x, (8,))


@needs_interpreter[0]
def test_every_kernel_variant_compiles_for_sm90_without_spilling():
    """The interpreter cannot tell whether Triton's compiler accepts the kernels, nor
    whether they fit the registers: compile every launched variant for sm_90 with the
    real compiler (no GPU needed) and read each cubin's registers (compile_check)."""
    from normkit.kernels.triton import compile_check

    pytest.importorskip("triton.compiler")
    if compile_check._cuobjdump() is None:
        pytest.skip("this Triton has no bundled cuobjdump to read the cubins' registers")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "normkit.kernels.triton.compile_check",
                           "--arch", "90", "--fail-on-spills"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.endswith(" compiled, 0 failed, 0 spilling registers"), summary
    assert int(summary.split()[0]) >= 40  # every family's variants, not an empty plan
    assert "REG" in done.stdout


def test_compile_check_specializes_launches_as_the_jit_does():
    """compile_check compiles each launch with the JIT's run-time specialization: a
    channels-last tile's unit channel stride is the constant 1 and 16-multiples carry
    their divisibility, so the compiler lays the tile along the channels as a real launch
    does (without it, Triton 3.6 compiled those tiles uncoalesced at 144-251 registers)."""
    from normkit.kernels.triton import _ops, compile_check

    pytest.importorskip("triton.compiler")
    recorded = []
    previous, _ops.launch_hook = _ops.launch_hook, (
        lambda kernel, grid, args, constexprs, warps: recorded.append((kernel, args,
                                                                      constexprs)))
    try:
        x = torch.randn(2, 32, 4, 4).contiguous(memory_format=torch.channels_last)
        _ops.gn_forward(x, 8, None, None, 1e-5, 0, None)
    finally:
        _ops.launch_hook = previous
    kernel, args, constexprs = next(r for r in recorded if r[0].__name__ == "_gncl_fwd")
    special = compile_check._specialization(kernel, args, constexprs)
    if special is None:
        pytest.skip("this Triton exposes no native_specialize_impl")
    signature, constants, attrs = special
    names = kernel.arg_names
    assert signature["sxc"] == "constexpr" and constants[(names.index("sxc"),)] == 1
    assert signature["sxs"] == "i32" and attrs[(names.index("sxs"),)] == [
        ["tt.divisibility", 16]]  # (the position stride: 32 channels)
    assert signature["X"] == "*fp32" and (names.index("X"),) in attrs
    assert constants[(names.index("BLOCK_C"),)] == 32


def test_available_is_a_constant_inside_fullgraph_compile():
    """``tk.available()`` (asked by every ``backend="auto"`` call on a CUDA tensor) must
    not break a ``fullgraph=True`` graph: Dynamo runs it once and bakes in the answer.
    Wrapped around a functools.cache object it traced into importlib instead (seen with
    torch 2.11 on an H200; torch 2.13 here does the same)."""
    def pick(x):
        return x + 1 if tk.available() else x - 1

    torch._dynamo.reset()
    got = torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(2))
    want = 1.0 if importlib.util.find_spec("triton") else -1.0
    assert got.tolist() == [want, want]


def test_every_launch_disables_fma_contraction():
    """Kernels are compiled with ``enable_fp_fusion=False``: with contraction, the
    single-block LayerNorm's stored mean and the mean it centred on differed by the
    rounding of one product, and its input gradient at a mean of 1e4 was off by 1.4e-3
    on an H200. The interpreter (CI) never contracts, so this pins the option itself."""
    pytest.importorskip("triton")
    from normkit.kernels.triton import _ops

    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append((grid, args, options))

    _ops._launch(Kernel(), 3, ("x",), num_warps=2, BLOCK=8)
    assert launched == [((3,), ("x",), {"num_warps": 2, "enable_fp_fusion": False,
                                         "BLOCK": 8})]


def test_auto_picks_triton_on_cuda_for_row_norms_only(monkeypatch):
    """Under backend="auto" a CUDA input takes the Triton kernels for LayerNorm/RMSNorm
    only; BatchNorm/GroupNorm run torch's CUDA kernels (measured on an H200: their
    Triton path's host cost made a conv step 4.1x / 1.9x slower). "triton" always takes
    the kernels; CPU inputs never do under "auto"."""
    import normkit.functional as F

    class OnCuda:  # (_use_triton reads only .is_cuda of the input, _torch_kernels .is_cpu)
        is_cuda, is_cpu = True, False
        device = torch.device("cuda")

    class OnCpu:
        is_cuda, is_cpu = False, True
        device = torch.device("cpu")

    monkeypatch.setattr(tk, "available", lambda: True)
    assert F.TRITON_AUTO_OPS == {"layer_norm", "rms_norm"}
    for op in ("layer_norm", "rms_norm"):
        assert F._use_triton("auto", OnCuda(), lambda: True, op)
        assert not F._use_triton("auto", OnCuda(), lambda: False, op)  # kernel can't serve
        assert not F._use_triton("auto", OnCpu(), lambda: True, op)
        assert not F._use_triton("eager", OnCuda(), lambda: True, op)
    for op in ("batch_norm", "group_norm", "group_norm_channels_last", "layer_norm2d"):
        assert not F._use_triton("auto", OnCuda(), lambda: True, op)
        assert F._use_triton("triton", OnCuda(), lambda: True, op)
    assert F._torch_kernels("auto", OnCuda())
    assert not F._torch_kernels("auto", OnCpu()) and not F._torch_kernels("eager", OnCuda())
    assert F._torch_kernels("auto", torch.empty(2, device="meta"))  # any device but the CPU


def test_auto_keeps_triton_launches_out_of_traced_and_exported_graphs(monkeypatch):
    """torch.compile keeps the Triton kernels (registered operators); a torch.jit.trace
    graph cannot hold a launch and an exported program must run without normkit, so
    there a CUDA input takes torch's own kernels (``_torch_kernels``)."""
    import normkit.functional as F
    from normkit.norms import _core

    class OnCuda:
        is_cuda, is_cpu = True, False

    monkeypatch.setattr(tk, "available", lambda: True)
    assert F._use_triton("auto", OnCuda(), lambda: True, "layer_norm")  # eager
    monkeypatch.setattr(_core.torch.compiler, "is_compiling", lambda: True)
    assert F._use_triton("auto", OnCuda(), lambda: True, "layer_norm")  # torch.compile
    monkeypatch.setattr(_core, "_exporting", lambda: True)
    assert not F._use_triton("auto", OnCuda(), lambda: True, "layer_norm")  # torch.export
    assert F._torch_kernels("auto", OnCuda())
    monkeypatch.setattr(_core, "_exporting", lambda: False)
    monkeypatch.setattr(_core.torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(_core, "_tracing", lambda: True)
    assert not F._use_triton("auto", OnCuda(), lambda: True, "layer_norm")  # jit.trace
    assert F._use_triton("triton", OnCuda(), lambda: True, "layer_norm")  # asked for
