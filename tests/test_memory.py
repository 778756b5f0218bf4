"""Huge-page outputs (normkit.kernels.memory): the advice itself, and every composition
that writes its large output through ``out_like`` giving the same values, gradients and
layout as with torch's own allocation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cases import make_input, memory_format_of
from oracle import assert_close, assert_grad_close, normalize64

from normkit import functional as F
from normkit.kernels import channels, memory, native
from normkit.norms.fused import add_layer_norm, add_rms_norm, batch_norm_act, group_norm_act

MIB = 1 << 20


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that contains ``address`` (/proc/self/smaps)."""
    inside, flags = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


def test_small_or_gpu_results_are_left_to_torch():
    x = torch.ones(1000)
    assert memory.out_like(x) is None
    assert memory.advise_huge_pages(x) is False
    assert memory.empty_like(x).shape == x.shape
    if memory.huge_pages_available():
        big = torch.empty(0).new_empty(memory.MIN_BYTES // 4, device="meta")
        assert memory.out_like(big) is None  # not a CPU tensor


_FRESH_OUTPUT_CHECK = """
import torch
from normkit.kernels import memory
import test_memory as t
like = torch.empty(memory.MIN_BYTES // 4 + 12345)  # never written: fresh pages
out = memory.out_like(like)
assert out is not None and out.shape == like.shape and out.is_contiguous()
middle = out.data_ptr() + out.numel() * 2  # inside the advised interior
flags = t._vm_flags(middle)
assert "hg" in flags, flags  # MADV_HUGEPAGE on the mapping
assert "sh" not in flags, flags  # private (a shared one: shmem, no huge pages, and shared
                                 # with forked children)
assert memory.OUTPUT_CACHE_BYTES == 0 or not out.untyped_storage().resizable()  # cached
out.fill_(1.0)
assert memory.advise_huge_pages(out) is False  # now resident: no faults left to save
assert out.sum().item() == out.numel()
print("ok")
"""


@pytest.mark.skipif(not memory.huge_pages_available(),
                    reason="needs Linux with transparent huge pages in madvise mode")
def test_fresh_large_output_is_advised_and_touched_memory_is_not():
    """In a fresh process: in this one, earlier tests may have left glibc a free heap top
    past 32 MiB (its mmap and trim thresholds rise with the sizes it has freed), which
    then serves the request from memory already touched -- rightly left unadvised, but
    not the fresh mapping this test is about (it failed so once in a full run)."""
    env = {k: v for k, v in os.environ.items()  # (glibc's defaults: large = fresh mmap)
           if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__),
                                         os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _FRESH_OUTPUT_CHECK], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stdout + out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_environment_switch_turns_the_advice_off():
    code = ("import torch; from normkit.kernels import memory; "
            "print(memory.huge_pages_available(), "
            "memory.out_like(torch.empty(memory.MIN_BYTES)) is None)")
    env = {**os.environ, "NORMKIT_HUGEPAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "True"]


@pytest.fixture
def advised(monkeypatch):
    """Every output of at least 4 MiB goes through ``out_like`` with a recording ``libc``
    (so the paths run the same on a machine without transparent huge pages), onto the
    buffers of an output cache of the test's own, whose hand-outs are recorded as well."""
    calls = []

    def madvise(address, length, advice):
        calls.append((address, length, advice))
        return 0

    def mincore(address, length, vec):
        return 0  # leaves the residency byte at 0: never touched

    monkeypatch.setattr(memory, "MIN_BYTES", 4 * MIB)
    monkeypatch.setattr(memory, "_libc", lambda: (madvise, mincore))
    monkeypatch.setattr(memory, "_CACHE", memory._OutputCache())  # (empty: this test's own)
    cached_empty = memory._cached_empty

    def recorded(shape, stride, dtype):  # a reused buffer is advised already: record it too
        t = cached_empty(shape, stride, dtype)
        calls.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), "cache"))
        return t

    monkeypatch.setattr(memory, "_cached_empty", recorded)
    return calls


def _holds(t: torch.Tensor, calls) -> bool:
    """Whether some advised range lies inside ``t``'s storage."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    return any(start <= a and a + n <= end for a, n, _ in calls)


def _run(fn, inputs):
    """Outputs and input gradients of ``fn`` (sum of every output against a fixed weight)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.rand(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


ROWS = (256, 4096 + 8)  # 4 MiB of float32 and a bit: the rows ops' outputs are advised
IMAGE = (4, 64, 48, 88)  # 4.1 MiB of float32: the per-channel ops' outputs


def _rows(*, bias=False):
    gen = torch.Generator().manual_seed(2)
    x, r = (make_input(ROWS, torch.float32, "contiguous", seed=s) for s in (0, 3))
    w, b = torch.rand(ROWS[1], generator=gen) + 0.5, torch.randn(ROWS[1], generator=gen)
    return [x, r, w, b] if bias else [x, r, w]


def _image(layout):
    gen = torch.Generator().manual_seed(4)
    c = IMAGE[1]
    return [make_input(IMAGE, torch.float32, layout), torch.rand(c, generator=gen) + 0.5,
            torch.randn(c, generator=gen)]


#: Ops whose gradients, on huge pages, come from blocks of rows or samples (torch's
#: LayerNorm and GroupNorm kernels block by block, ``native.layer_norm_blocks``), from the
#: index given on: the
#: parameter gradients are sums of per-block partials, and RMSNorm's input gradient
#: holds one matrix-vector product per block, whose rows MKL may sum in another order
#: than in one product over every row. The same values to float32 rounding, not the
#: same bits as the whole-tensor calls.
BLOCK_SUMMED_GRADIENTS = {"add_layer_norm": 2, "layer_norm": 2, "rms_norm": 0,
                          "add_rms_norm": 0, "group_norm_nchw": 1, "instance_norm_nchw": 1,
                          "group_norm_act_nchw": 1}

# (op, inputs, layout) for every composition that writes a large result through out_like;
# layouts that take torch's own kernels (which allocate for themselves) are not listed
CASES = {
    "rms_norm": (lambda x, r, w: F.rms_norm(x, ROWS[1:], w), _rows, None),
    "add_rms_norm": (lambda x, r, w: add_rms_norm(x, r, ROWS[1:], w), _rows, None),
    "add_layer_norm": (lambda x, r, w, b: add_layer_norm(x, r, ROWS[1:], w, b),
                       lambda: _rows(bias=True), None),
    "layer_norm": (lambda x, r, w, b: F.layer_norm(x, ROWS[1:], w, b),
                   lambda: _rows(bias=True), None),
    "add_rms_norm_bf16_fp32_residual": (
        lambda x, r, w: add_rms_norm(x.bfloat16(), r.bfloat16(), ROWS[1:], w.bfloat16(),
                                     residual_in_fp32=True), _rows, None),
    "group_norm_act_channels_last": (lambda x, w, b: group_norm_act(x, 8, w, b, act="silu"),
                                     _image, "channels_last"),
    "group_norm_act_nchw": (lambda x, w, b: group_norm_act(x, 8, w, b, act="silu"), _image,
                            "contiguous"),
    "group_norm_channels_last": (lambda x, w, b: F.group_norm(x, 8, w, b), _image,
                                 "channels_last"),
    "instance_norm_channels_last": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
                                    _image, "channels_last"),
    "batch_norm_channels_last": (lambda x, w, b: F.batch_norm(x, None, None, w, b, True),
                                 _image, "channels_last"),
    "batch_norm_act_channels_last": (lambda x, w, b: batch_norm_act(x, None, None, w, b, True),
                                     _image, "channels_last"),
    "batch_norm_act_nchw": (lambda x, w, b: batch_norm_act(x, None, None, w, b, True,
                                                           act="leaky_relu"),
                            _image, "contiguous"),
    "batch_norm_act_elu_nchw": (lambda x, w, b: batch_norm_act(x, None, None, w, b, True,
                                                               act="elu"),
                                _image, "contiguous"),
    "group_norm_act_gelu_channels_last": (lambda x, w, b: group_norm_act(x, 8, w, b,
                                                                         act="gelu"),
                                          _image, "channels_last"),
    "layer_norm2d_nchw": (lambda x, w, b: F.layer_norm2d(x, w, b), _image, "contiguous"),
    "group_norm_nchw": (lambda x, w, b: F.group_norm(x, 8, w, b), _image, "contiguous"),
    "instance_norm_nchw": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b), _image,
                           "contiguous"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_huge_page_outputs_equal_torch_allocated_ones(name, advised, monkeypatch):
    fn, make, layout = CASES[name]
    inputs = make() if layout is None else make(layout)
    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0)
    outs, grads = _run(fn, inputs)
    assert advised, f"{name}: no result went through kernels.memory.out_like"
    advised.clear()
    monkeypatch.setattr(memory, "MIN_BYTES", 1 << 62)  # torch allocates everything
    ref_outs, ref_grads = _run(fn, inputs)
    assert not advised
    first_sum = len(outs) + BLOCK_SUMMED_GRADIENTS.get(name, len(grads))
    for i, (got, want) in enumerate(zip(outs + grads, ref_outs + ref_grads, strict=True)):
        if want is None:  # (an input the op does not use)
            assert got is None
            continue
        if i >= first_sum:
            assert_grad_close(got, want, torch.float32, f"{name} parameter gradient {i}")
        else:
            assert torch.equal(got, want), f"{name}: values differ from torch's allocation"
        assert got.stride() == want.stride(), f"{name}: layout {got.stride()} != {want.stride()}"
    assert memory_format_of(outs[0]) == memory_format_of(inputs[0])


def test_rms_norm_on_huge_pages_matches_float64(advised):
    x, _, w = _rows()
    y = F.rms_norm(x, ROWS[1:], w, 1e-6)
    assert _holds(y, advised)
    assert_close(y, normalize64(x, (1,), w, eps=1e-6, center=False), torch.float32)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("block_bytes", [1 << 12, 5 * (4096 + 8) * 4, 1 << 30])
def test_layer_norm_blocks_match_the_whole_kernel_call_and_float64(residual, block_bytes,
                                                                   advised, monkeypatch):
    """torch's LayerNorm kernels block by block onto huge pages (one block, blocks of one
    row, blocks of five rows whose last is short): the output, statistics and input
    gradient are the whole-tensor call's bits; the parameter gradients, sums of the
    blocks' partials, match float64 to the float32 gradient tolerance."""
    monkeypatch.setattr(native, "LAYER_NORM_BLOCK_BYTES", block_bytes)
    x, r, w, b = (t.requires_grad_() for t in _rows(bias=True))
    dy, dr = torch.randn_like(x), torch.randn_like(x)
    blocks = native.layer_norm_blocks(x.detach(), ROWS[1:], w.detach(), b.detach(), 1e-5,
                                      r.detach() if residual else None)
    assert blocks is not None and _holds(blocks[1], advised)
    s, y, mean, rstd = blocks
    s_ref = x.detach() + r.detach() if residual else x.detach()
    assert torch.equal(s, s_ref)
    y_ref, mean_ref, rstd_ref = torch.native_layer_norm(s_ref, ROWS[1:], w.detach(),
                                                        b.detach(), 1e-5)
    for got, want in ((y, y_ref), (mean, mean_ref), (rstd, rstd_ref)):
        assert torch.equal(got, want) and got.shape == want.shape
    if residual:
        normed, new_residual = add_layer_norm(x, r, ROWS[1:], w, b)
        outs, grads_at = (normed, new_residual), (dy, dr)
        leaves = (x, r, w, b)
    else:
        outs, grads_at, leaves = (F.layer_norm(x, ROWS[1:], w, b),), (dy,), (x, w, b)
    assert torch.equal(outs[0], y)
    grads = torch.autograd.grad(outs, leaves, grads_at)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    s64 = x64 + r.detach().double() if residual else x64
    y64 = normalize64(s64, (1,), w64, b64)
    refs = torch.autograd.grad((y64, s64) if residual else (y64,), (x64, w64, b64),
                               (dy.double(), dr.double()) if residual else (dy.double(),))
    torch_dx = torch.ops.aten.native_layer_norm_backward(
        dy, s_ref, ROWS[1:], mean_ref, rstd_ref, w.detach(), b.detach(),
        [True, False, False])[0]
    assert torch.equal(grads[0], torch_dx + dr if residual else torch_dx)
    for got, want, what in zip((grads[0], *grads[-2:]), refs, ("dx", "dweight", "dbias"),
                               strict=True):
        assert_grad_close(got, want, torch.float32, what)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_backward_blocks_match_the_whole_call_and_float64(residual, advised,
                                                                   monkeypatch):
    """RMSNorm's backward (LayerNorm's kernel at a zero mean plus its ``mean(g)`` term)
    block by block onto huge pages: its gradients match the whole-tensor path's to
    float32 rounding, and float64."""
    monkeypatch.setattr(native, "LAYER_NORM_BLOCK_BYTES", 5 * (4096 + 8) * 4)
    x, r, w = (t.requires_grad_() for t in _rows())
    dy, dr = torch.randn_like(x), torch.randn_like(x)

    def grads():
        if residual:
            normed, s = add_rms_norm(x, r, ROWS[1:], w, 1e-6)
            return torch.autograd.grad((normed, s), (x, r, w), (dy, dr))
        return torch.autograd.grad(F.rms_norm(x, ROWS[1:], w, 1e-6), (x, w), dy)

    got = grads()
    assert any(_holds(g, advised) for g in got[:-1])
    monkeypatch.setattr(native, "fresh_out_like", lambda *args, **kwargs: None)
    whole = grads()
    for a, b in zip(got, whole, strict=True):
        assert_grad_close(a, b, torch.float32, "blocked against whole")
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    s64 = x64 + r.detach().double() if residual else x64
    y64 = normalize64(s64, (1,), w64, eps=1e-6, center=False)
    refs = torch.autograd.grad((y64, s64) if residual else (y64,), (x64, w64),
                               (dy.double(), dr.double()) if residual else (dy.double(),))
    assert_grad_close(got[0], refs[0], torch.float32, "dx")
    assert_grad_close(got[-1], refs[1], torch.float32, "dweight")


@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
@pytest.mark.parametrize("block_bytes", [1 << 12, 3 * 48 * 88 * 64 * 4, 1 << 30])
def test_group_norm_blocks_match_the_whole_kernel_call_and_float64(op, block_bytes, advised,
                                                                   monkeypatch):
    """torch's GroupNorm kernels (InstanceNorm's too) block by block of samples onto huge
    pages (one sample per block, three and a short last one, one block): output and input
    gradient are the whole call's bits, the parameter gradients match float64."""
    monkeypatch.setattr(native, "LAYER_NORM_BLOCK_BYTES", block_bytes)
    x, w, b = (t.requires_grad_() for t in _image("contiguous"))
    dy = torch.randn_like(x)
    groups = 8 if op == "group_norm" else IMAGE[1]

    def run(fn):
        y = fn(x, groups, w, b, 1e-5)
        return (y.detach(), *torch.autograd.grad(y, (x, w, b), dy))

    got = run(F.group_norm if op == "group_norm" else
              lambda x, g, w, b, eps: F.instance_norm(x, weight=w, bias=b, eps=eps))
    assert _holds(got[0], advised) and _holds(got[1], advised)
    want = run(torch.nn.functional.group_norm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = torch.nn.functional.group_norm(x64, groups, w64, b64, 1e-5)
    refs = torch.autograd.grad(y64, (x64, w64, b64), dy.double())
    for g, ref, what in zip(got[1:], refs, ("dx", "dweight", "dbias"), strict=True):
        assert_grad_close(g, ref, torch.float32, what)


def test_blocked_layer_norm_second_derivatives_match_torch(advised, monkeypatch):
    """``create_graph=True`` through the blocked forward's node differentiates torch's
    LayerNorm: the same second derivatives as torch's own double backward."""
    monkeypatch.setattr(native, "LAYER_NORM_BLOCK_BYTES", 1 << 16)
    x, _, w, b = (t.requires_grad_() for t in _rows(bias=True))
    dy = torch.randn_like(x)

    def second(fn):
        gx, gw = torch.autograd.grad(fn(x, ROWS[1:], w, b), (x, w), dy, create_graph=True)
        return torch.autograd.grad((gx.square().sum() + gw.square().sum()), (x, w))

    got = second(F.layer_norm)
    assert advised  # (the forward went on huge pages)
    for g, want in zip(got, second(torch.nn.functional.layer_norm), strict=True):
        assert_grad_close(g, want, torch.float32, "second derivative")


def test_fresh_out_like_only_for_untouched_memory(advised, monkeypatch):
    assert memory.fresh_out_like(torch.ones(1000)) is None  # small
    out = memory.fresh_out_like(torch.ones(2 * MIB), torch.float64)
    assert out is not None and out.dtype == torch.float64 and _holds(out, advised)

    def resident(address, length, vec):
        vec[0] = 1
        return 0

    monkeypatch.setattr(memory, "_libc", lambda: (lambda *a: 0, resident))
    assert memory.fresh_out_like(torch.ones(2 * MIB)) is None  # reused memory


def test_layer_norm_leaves_reused_memory_to_torch(monkeypatch):
    """Memory the allocator reuses (resident: no faults to save) -- torch's kernel over
    the whole tensor, with torch's own autograd node, and nothing advised."""
    calls = []

    def mincore(address, length, vec):
        vec[0] = 1  # resident
        return 0

    monkeypatch.setattr(memory, "MIN_BYTES", 4 * MIB)
    monkeypatch.setattr(memory, "_libc", lambda: (lambda *a: calls.append(a) or 0, mincore))
    x, _, w, b = (t.requires_grad_() for t in _rows(bias=True))
    assert native.layer_norm_blocks(x.detach(), ROWS[1:], w, b, 1e-5) is None
    y = F.layer_norm(x, ROWS[1:], w, b)
    assert type(y.grad_fn).__name__ == "NativeLayerNormBackward0" and calls == []


def test_mincore_residency_stops_the_advice(monkeypatch):
    def mincore(address, length, vec):
        vec[0] = 1  # resident
        return 0

    calls = []
    monkeypatch.setattr(memory, "MIN_BYTES", 4 * MIB)
    monkeypatch.setattr(memory, "_libc", lambda: (lambda *a: calls.append(a) or 0, mincore))
    out = memory.out_like(torch.empty(2 * MIB))  # 8 MiB of float32
    assert out is not None and out.numel() == 2 * MIB
    assert calls == []  # reused memory: no advice


def test_no_advice_while_compiling(advised, monkeypatch):
    """Traced tensors have no memory: under torch.compile the op allocates as usual."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert memory.out_like(torch.empty(2 * MIB)) is None
    assert advised == []


@pytest.mark.parametrize("wanted", ["none", "input", "inference_mode"])
def test_inference_batch_norm_on_huge_pages_equals_torch(wanted, advised):
    """Inference BatchNorm of NCHW input without a gradient goes through torch's kernel's
    ``out=`` form onto huge pages (``native.inference_kernel``), under ``no_grad`` and
    ``torch.inference_mode``, as does FrozenBatchNorm2d's: torch's bits. With the input's
    gradient wanted (``_EvalInputGradFunction``) torch allocates: torch's bits, its
    gradient."""
    from normkit import FrozenBatchNorm2d

    x, w, b = _image("contiguous")
    gen = torch.Generator().manual_seed(5)
    rm, rv = torch.randn(IMAGE[1], generator=gen) * 0.3, torch.rand(IMAGE[1], generator=gen) + 0.5
    want = torch.nn.functional.batch_norm(x, rm, rv, w, b, False)
    leaf = x.clone().requires_grad_(wanted == "input")
    if wanted == "inference_mode":
        with torch.inference_mode():
            y = F.batch_norm(leaf, rm, rv, w, b, False)
    else:
        y = F.batch_norm(leaf, rm, rv, w, b, False)
    assert _holds(y, advised) is (wanted != "input") and torch.equal(y.detach(), want)
    view = (1, -1, 1, 1)
    ref = ((x.double() - rm.double().view(view)) / (rv.double().view(view) + 1e-5).sqrt()
           * w.double().view(view) + b.double().view(view))
    assert_close(y.detach(), ref, torch.float32)
    if wanted == "input":
        dy = torch.randn_like(x)
        ref = x.clone().requires_grad_()
        (got,) = torch.autograd.grad(y, leaf, dy)
        (expected,) = torch.autograd.grad(torch.nn.functional.batch_norm(ref, rm, rv, w, b,
                                                                         False), ref, dy)
        assert_grad_close(got, expected, torch.float32, "dx")
    advised.clear()
    frozen = FrozenBatchNorm2d(IMAGE[1])
    frozen.weight.copy_(w), frozen.bias.copy_(b)
    frozen.running_mean.copy_(rm), frozen.running_var.copy_(rv)
    with torch.no_grad():
        z = frozen(x)
    assert _holds(z, advised) and torch.equal(z, want)


# ---------------------------------------------------------------- the output cache


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_output_cache_reuses_a_freed_buffer_never_a_live_one(advised):
    like = torch.empty(2 * MIB)  # 8 MiB of float32: fresh memory (the fake mincore)
    a, b = memory.out_like(like), memory.out_like(like)
    assert _address(a) != _address(b) and _address(a) % (2 * MIB) == 0
    assert memory.cached_bytes() == 0
    first, view = _address(a), a[10:]
    del a
    assert memory.cached_bytes() == 0  # the view still uses the buffer
    c = memory.out_like(like)
    assert _address(c) not in (first, _address(b))
    del view
    assert memory.cached_bytes() == 8 * MIB
    d = memory.out_like(like)
    assert _address(d) == first and memory.cached_bytes() == 0
    d.fill_(3.0), c.fill_(1.0)  # distinct memory: neither write reaches the other
    assert d.sum().item() == 3 * d.numel() and c.sum().item() == c.numel()
    assert {call[2] for call in advised} == {14, "cache"}  # new buffers: MADV_HUGEPAGE


@pytest.mark.parametrize("shape,dtype,memory_format", [
    ((1024, 2048 + 3), torch.float32, torch.contiguous_format),
    ((8, 64, 48, 48), torch.float64, torch.channels_last),
    ((4, 32, 8, 40, 40), torch.float32, torch.channels_last_3d),
    ((2049, 2048), torch.bfloat16, torch.preserve_format),
])
def test_output_cache_tensors_are_laid_out_as_torch_would(shape, dtype, memory_format,
                                                          advised):
    like = torch.empty(shape)
    if memory_format is not torch.preserve_format:
        like = like.contiguous(memory_format=memory_format)
    out = memory.out_like(like, dtype, memory_format)
    want = torch.empty_like(like, dtype=dtype, memory_format=memory_format)
    assert (out.shape, out.stride(), out.dtype) == (want.shape, want.stride(), want.dtype)
    assert out.untyped_storage().nbytes() >= out.numel() * out.element_size()
    assert _holds(out, advised)
    out.copy_(torch.randn(shape, dtype=torch.float64))  # every element writable
    assert torch.isfinite(out).all()


def test_output_cache_keeps_at_most_its_limit_and_releases(advised, monkeypatch):
    monkeypatch.setattr(memory, "OUTPUT_CACHE_BYTES", 8 * MIB)
    like = torch.empty(2 * MIB)
    a, b = memory.out_like(like), memory.out_like(like)
    del a, b
    assert memory.cached_bytes() == 8 * MIB  # the second buffer was unmapped
    assert memory.release_cached() == 8 * MIB and memory.cached_bytes() == 0
    assert memory.release_cached() == 0


def test_output_cache_off_gives_advised_torch_memory(advised, monkeypatch):
    monkeypatch.setattr(memory, "OUTPUT_CACHE_BYTES", 0)
    out = memory.out_like(torch.empty(2 * MIB))
    assert out.untyped_storage().resizable()  # torch's own allocation
    assert _holds(out, advised) and all(call[2] != "cache" for call in advised)
    del out
    assert memory.cached_bytes() == 0


def test_output_cache_buffer_freed_in_another_thread_comes_back(advised):
    import threading

    holder = [memory.out_like(torch.empty(2 * MIB))]
    first = _address(holder[0])
    thread = threading.Thread(target=holder.clear)
    thread.start(), thread.join()
    assert memory.cached_bytes() == 8 * MIB
    assert _address(memory.out_like(torch.empty(2 * MIB))) == first


def test_output_cache_tensors_behave_as_tensors(advised, tmp_path):
    """What differs from torch's allocation: the storage cannot grow (as a
    ``torch.frombuffer`` or ``torch.from_numpy`` tensor's); shrinking, saving, copying,
    autograd and shared memory work as usual."""
    import copy

    out = memory.out_like(torch.empty(2 * MIB))
    out.copy_(torch.arange(out.numel(), dtype=torch.float32))
    torch.save(out, tmp_path / "t.pt")
    assert torch.equal(torch.load(tmp_path / "t.pt"), out)
    assert torch.equal(copy.deepcopy(out), out)
    leaf = out.detach().requires_grad_()
    (leaf * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 2.0))
    out.resize_(10)
    assert torch.equal(out, torch.arange(10, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="not resizable"):
        out.resize_(4 * MIB)


def test_output_cache_after_fork_starts_empty(advised):
    del advised
    memory.out_like(torch.empty(2 * MIB))  # freed at once: idle in the cache
    assert memory.cached_bytes() == 8 * MIB
    before = memory._CACHE
    memory._forget_after_fork()
    try:
        assert memory._CACHE is not before and memory.cached_bytes() == 0
    finally:
        memory._CACHE = before


@pytest.mark.parametrize("value,expected", [("0", "0"), ("64", str(64 << 20))])
def test_output_cache_environment_limit(value, expected):
    code = "from normkit.kernels import memory; print(memory.OUTPUT_CACHE_BYTES)"
    env = {**os.environ, "NORMKIT_OUTPUT_CACHE_MIB": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [expected]


def test_output_cache_environment_limit_rejects_garbage():
    code = "import normkit"
    env = {**os.environ, "NORMKIT_OUTPUT_CACHE_MIB": "lots"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0
    assert "NORMKIT_OUTPUT_CACHE_MIB must be a whole number of MiB" in out.stderr
    assert "'lots'" in out.stderr


def test_output_cache_gives_nothing_back_once_the_limit_is_gone(advised, monkeypatch):
    """A finalizer can run while the interpreter shuts down, its module globals already
    ``None``: the buffer is then unmapped, not kept, and nothing raises."""
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)  # (a finalizer's errors)
    out = memory.out_like(torch.empty(2 * MIB))
    monkeypatch.setattr(memory, "OUTPUT_CACHE_BYTES", None)
    del out
    assert memory.cached_bytes() == 0 and raised == []


def test_output_cache_unmaps_the_longest_idle_buffers_first(advised, monkeypatch):
    """Sizes no longer used make room for the current ones (a sequence length that
    changed): past the limit the oldest idle buffers go, whatever their size."""
    monkeypatch.setattr(memory, "OUTPUT_CACHE_BYTES", 8 * MIB)
    old = memory.out_like(torch.empty(2 * MIB))  # 8 MiB
    new = memory.out_like(torch.empty(3 * MIB // 2))  # 6 MiB
    new_address = _address(new)
    del old
    assert memory.cached_bytes() == 8 * MIB
    del new  # 14 MiB idle: the 8 MiB one, idle longest, is unmapped
    assert memory.cached_bytes() == 6 * MIB
    again = memory.out_like(torch.empty(3 * MIB // 2))
    assert _address(again) == new_address and memory.cached_bytes() == 0
    del again
    bigger = memory.out_like(torch.empty(3 * MIB))  # 12 MiB: more than the limit
    del bigger
    assert memory.cached_bytes() == 6 * MIB  # not kept, and nothing evicted for it
