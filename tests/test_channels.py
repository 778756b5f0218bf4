"""The per-(sample, channel) sums engine (normkit.kernels.channels): BN, IN and GN.

Each case checks that ``backend="auto"`` takes the engine on well-conditioned data,
that forward and every gradient equal the float64 reference (per-dtype tolerances,
also just under the engine's ``|mean| / std`` bound), that the engine refuses data past
the bound, and that double backward and running statistics are right.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_close, assert_grad_close, reference_forward

import normkit
from normkit.kernels import channels, native


@pytest.fixture(autouse=True)
def small_inputs_take_the_engine(monkeypatch):
    """The engine's size floor is a speed rule; these tests exercise it on small inputs."""
    monkeypatch.setattr(channels, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(channels, "GROUP_NORM_MIN_POSITIONS", 0)


CASES = {
    "bn": (lambda: normkit.BatchNorm2d(6), "contiguous"),
    "bn1d": (lambda: normkit.BatchNorm1d(6), "contiguous"),
    # (NCHW InstanceNorm takes torch's GroupNorm kernel first: see the NCHW test below)
    "in": (lambda: normkit.InstanceNorm2d(6, affine=True, track_running_stats=True),
           "channels_last"),
    "in-cl": (lambda: normkit.InstanceNorm2d(6, affine=True), "channels_last"),
    "in3d-cl": (lambda: normkit.InstanceNorm3d(6, affine=True), "channels_last"),
    "gn-cl": (lambda: normkit.GroupNorm(3, 6), "channels_last"),
    # one group (timm's GroupNorm1): its pooled sums broadcast over every channel; the
    # engine once wrote them in place through a stride-0 view (RuntimeError)
    "gn1-cl": (lambda: normkit.GroupNorm(1, 6), "channels_last"),
}


def _input(name: str, offset: float, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    shape = {"bn1d": (5, 6, 40), "in3d-cl": (3, 6, 3, 4, 5)}.get(name, (5, 6, 7, 9))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    # every (n, c) slice standardized exactly, so every pooled group has mean 0 and std 1
    dims = tuple(range(2, x.dim()))
    x = (x - x.mean(dims, keepdim=True)) / x.std(dims, correction=0, keepdim=True)
    x = (x * 1.5 + offset).to(dtype)
    layout = CASES[name][1]
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4
                         else torch.channels_last_3d)
    return x


def _module(name: str, dtype) -> torch.nn.Module:
    module = CASES[name][0]().to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    return module


def _run(name, offset, dtype):
    module = _module(name, dtype)
    x = _input(name, offset, dtype).requires_grad_()
    y = module(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    twin = _module(name, torch.float64)
    ref = reference_forward(twin, x64, input_dtype=dtype)
    ref.backward(dy.double())
    return module, twin, x, y, x64, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("ratio", [0.0, 0.85], ids=["centered", "near-bound"])
@pytest.mark.parametrize("name", list(CASES))
def test_engine_is_taken_and_equals_the_reference(name, ratio, dtype):
    # offset = ratio * bound * std (std 1.5): just under the bound the engine still runs
    module, twin, x, y, x64, ref = _run(name, ratio * channels.RATIO * 1.5, dtype)
    assert "SliceNorm" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    if CASES[name][1] == "channels_last":
        layout = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    else:
        layout = torch.contiguous_format
    assert y.is_contiguous(memory_format=layout)  # the output keeps the input's layout
    assert_close(y, ref, dtype)
    assert_grad_close(x.grad, x64.grad, dtype, "input grad")
    for p, p64 in zip(module.parameters(), twin.parameters(), strict=True):
        assert_grad_close(p.grad, p64.grad, dtype, "parameter grad")


@pytest.mark.parametrize("name", list(CASES))
def test_engine_refuses_data_past_its_bound(name):
    module = _module(name, torch.float32)
    y = module(_input(name, 3.0 * channels.RATIO * 1.5).requires_grad_())
    assert "SliceNorm" not in type(y.grad_fn).__name__


def test_engine_refuses_nan_and_lets_it_propagate():
    x = torch.randn(2, 3, 5, 5)
    x[1, 2, 0, 0] = float("nan")
    assert channels.moments(x, channels.Pool("batch"), 1e-5) is None
    y = normkit.functional.batch_norm(x, None, None, training=True)
    assert torch.isnan(y[:, 2]).all() and not torch.isnan(y[:, :2]).any()


@pytest.mark.parametrize("kind", ["batch", "instance", "group", "batch-2d"])
def test_double_backward_through_the_engine(kind, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    if kind == "batch-2d":  # 2D rows through the channels-last view, past a small bound
        monkeypatch.setattr(channels, "CHANNELS_LAST_MAX_COUNT", 8)
        x = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    fn = {
        "batch": lambda x, w, b: normkit.functional.batch_norm(x, None, None, w, b, True),
        "batch-2d": lambda x, w, b: normkit.functional.batch_norm(x, None, None, w, b, True),
        "instance": lambda x, w, b: normkit.functional.instance_norm(
            x.contiguous(memory_format=torch.channels_last), weight=w, bias=b),
        "group": lambda x, w, b: normkit.functional.group_norm(
            x.contiguous(memory_format=torch.channels_last), 2, w, b),
    }[kind]
    y = fn(x, w, b)
    assert "SliceNorm" in type((y._base if kind == "batch-2d" else y).grad_fn).__name__
    torch.autograd.gradgradcheck(fn, (x, w, b))


def test_batch_norm_running_stats_match_torch():
    nk, tm = normkit.BatchNorm2d(6), torch.nn.BatchNorm2d(6)
    for seed in range(3):
        x = _input("bn", 0.5, seed=seed)
        y = nk(x)
        torch.testing.assert_close(y, tm(x), atol=2e-5, rtol=2e-5)
        assert "SliceNorm" in type(nk(x.requires_grad_()).grad_fn).__name__
        nk(x.detach())  # (the extra calls keep nk and tm in step below)
        tm(x.detach()), tm(x.detach())
    torch.testing.assert_close(nk.running_mean, tm.running_mean)
    torch.testing.assert_close(nk.running_var, tm.running_var)


def test_instance_norm_running_stats_match_torch():
    nk = normkit.InstanceNorm2d(6, track_running_stats=True)
    tm = torch.nn.InstanceNorm2d(6, track_running_stats=True)
    x = _input("in", 0.5)
    torch.testing.assert_close(nk(x), tm(x), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(nk.running_mean, tm.running_mean)
    torch.testing.assert_close(nk.running_var, tm.running_var)


def test_pool_groups_and_counts():
    x = torch.zeros(2, 6, 3, 4)
    assert [channels.Pool(k, 3).count(x) for k in ("batch", "instance", "group")] == [
        24, 12, 24]
    t = torch.arange(12.0).view(2, 6)
    assert channels.Pool("batch").sum(t).tolist() == [[6, 8, 10, 12, 14, 16]]
    assert channels.Pool("group", 3).sum(t)[1].tolist() == [13, 13, 17, 17, 21, 21]


@pytest.mark.parametrize("threads, block_bytes, way", [
    (1, 8192, "blocks of 2 whole samples"),
    (1, 1024, "4 parts of each sample's rows"),
    (2, 8192, "blocks of 4 whole samples"),
    (2, 1024, "the whole tensor (a block holds less than a sample per thread)"),
], ids=["samples", "parts", "samples-2-threads", "whole-2-threads"])
def test_blocked_column_sums_equal_float64(monkeypatch, threads, block_bytes, way):
    """The channels-last slice sums, taken block by block in each of the function's three
    ways, are the float64 sums to within a few ulps of a cascade sum; blocks of whole
    samples give the whole-tensor sums bit for bit."""
    monkeypatch.setattr(channels, "COLUMN_BLOCK_BYTES", block_bytes)
    x = torch.randn(3, 8, 10, 12, generator=torch.Generator().manual_seed(0)).add_(2.0)
    cols = channels._columns(x.contiguous(memory_format=torch.channels_last))  # (3, 120, 8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s1, s2 = channels._blocked_column_sums(cols)
        whole = cols.sum(1), (cols * cols).sum(1)
    finally:
        torch.set_num_threads(before)
    c64 = cols.double()
    eps = torch.finfo(torch.float32).eps
    assert (s1.double() - c64.sum(1)).abs().le(16 * eps * c64.abs().sum(1)).all(), way
    ref2 = (c64 * c64).sum(1)
    assert (s2.double() - ref2).abs().le(16 * eps * ref2).all(), way
    if "whole" in way or "samples" in way:
        assert torch.equal(s1, whole[0]) and torch.equal(s2, whole[1]), way


@pytest.mark.parametrize("shape", [(4, 8, 56, 56), (64, 5, 4, 4), (3, 7, 1, 577)],
                         ids=["large-samples", "small-samples", "no-fold"])
def test_whole_column_sums_are_the_pooled_float64_sums(shape):
    """BatchNorm's sums from one kernel call over the whole (N*L, C) matrix folded to at
    most FOLD_ROWS_BATCH rows: (1, C) pooled sums of x and x^2 within the error of
    FOLD_ROWS_BATCH sequential adds (their partials added in float64); None where no
    fold leaves FOLD_MIN_ROWS rows (and then the per-sample ways serve)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).add_(1.5)
    cols = channels._columns(x.contiguous(memory_format=torch.channels_last))
    n, length, c = cols.shape
    fold = channels._fold(n * length, channels.FOLD_ROWS_BATCH)
    sums = channels._whole_column_sums(cols)
    if fold is None:
        assert sums is None
        return
    s1, s2 = sums
    assert s1.shape == s2.shape == (1, c) and s1.dtype == torch.float32
    c64 = cols.double()
    rows = n * length // fold  # added in sequence per column
    bound = (rows + 2) * torch.finfo(torch.float32).eps
    assert ((s1.double().view(c) - c64.sum((0, 1))).abs()
            <= bound * c64.abs().sum((0, 1))).all()
    ref2 = (c64 * c64).sum((0, 1))
    assert ((s2.double().view(c) - ref2).abs() <= bound * ref2).all()


def test_fold_views_at_most_fold_rows_in_sequence():
    assert channels.FOLD_ROWS == 64  # (the expectations below are for it)
    assert channels._fold(24 * 24) == 9  # 64 rows of 9 positions
    assert channels._fold(56 * 56) == 49  # 64 rows
    assert channels._fold(64) == 1  # few rows already
    assert channels._fold(4099) is None  # a prime past FOLD_ROWS: no fold leaves >= 16 rows
    for length in (300, 576, 3136, 16384, 12544):
        k = channels._fold(length)
        assert length % k == 0 and channels.FOLD_MIN_ROWS <= length // k <= channels.FOLD_ROWS
    # BatchNorm pools every sample's sums: longer runs, narrower folded matrices
    assert channels.FOLD_ROWS_BATCH == 256
    assert channels._fold(56 * 56, channels.FOLD_ROWS_BATCH) == 14  # 224 rows
    assert channels._fold(24 * 24, channels.FOLD_ROWS_BATCH) == 3  # 192 rows
    assert channels._fold(200, channels.FOLD_ROWS_BATCH) == 1
    # so do GroupNorm's with two channels per group or more; one slice per group does not
    for pool, wide in ((channels.Pool("batch"), True), (channels.Pool("group", 3), True),
                       (channels.Pool("group", 6), False), (channels.Pool("instance"), False)):
        rows = channels.FOLD_ROWS_BATCH if wide else channels.FOLD_ROWS
        assert channels._fold_rows(pool, 6) == rows, pool


@pytest.mark.parametrize("threads, block_bytes, way", [
    (1, 1024, "folded kernel"), (1, None, "blocks"),
    (2, 1024, "folded kernel"), (2, None, "blocks"),
])
@pytest.mark.parametrize("name", ["bn-cl", "in-cl", "gn-cl"])
def test_folded_channels_last_sums_forward_and_backward_equal_float64(
        monkeypatch, name, threads, block_bytes, way):
    """Channels-last input with more positions than FOLD_ROWS: the statistics come from
    each sample's folded matrix where a cache block holds fewer than two samples (one
    per thread; for BatchNorm four per thread), else from cache blocks -- except
    BatchNorm's, from one call over the whole folded matrix wherever the blocks would
    serve and, with two threads (WHOLE_FOLD_MIN_THREADS), everywhere; the backward sums
    always fold. Output and every gradient equal the float64 reference either way."""
    if block_bytes is not None:
        monkeypatch.setattr(channels, "COLUMN_BLOCK_BYTES", block_bytes)
    calls, whole_calls = [], []
    kernel_sums, whole_sums = channels._kernel_column_sums, channels._whole_column_sums
    monkeypatch.setattr(channels, "_kernel_column_sums",
                        lambda cols, fold=1: calls.append(fold) or kernel_sums(cols, fold))
    monkeypatch.setattr(channels, "_whole_column_sums",
                        lambda cols: whole_calls.append(cols.shape) or whole_sums(cols))
    gen = torch.Generator().manual_seed(1)
    # (16 x 576 values per channel: past the count where BatchNorm keeps torch's kernel)
    x64 = torch.randn(16, 6, 24, 24, generator=gen, dtype=torch.float64).add_(1.0)
    assert channels._fold(24 * 24) > 1
    _channels_last_layer_equals_float64(name, x64, gen, threads)
    rows = channels.FOLD_ROWS if name == "in-cl" else channels.FOLD_ROWS_BATCH
    whole = name == "bn-cl" and (way == "blocks" or threads >= channels.WHOLE_FOLD_MIN_THREADS)
    kernel = way == "folded kernel" and not whole
    assert calls == ([channels._fold(24 * 24, rows)] if kernel else []), calls
    assert whole_calls == ([(16, 24 * 24, 6)] if whole else []), whole_calls


@pytest.mark.parametrize("name", ["bn-cl", "in-cl", "gn-cl"])
def test_unfoldable_channels_last_sums_equal_float64(monkeypatch, name):
    """A prime number of positions has no fold: BatchNorm sums each sample's unfolded
    (L, C) matrix with torch's kernel (at most CHANNELS_LAST_MAX_COUNT rows, as torch's
    own BatchNorm does; one thread, where no cache block serves, else one call over all
    samples' rows, which fold), GroupNorm and InstanceNorm take the cache blocks. Output
    and input gradient equal the float64 reference."""
    monkeypatch.setattr(channels, "COLUMN_BLOCK_BYTES", 1024)  # (no blocks of samples)
    calls = []
    kernel_sums = channels._kernel_column_sums
    monkeypatch.setattr(channels, "_kernel_column_sums",
                        lambda cols, fold=1: calls.append(fold) or kernel_sums(cols, fold))
    positions = 577  # prime, <= CHANNELS_LAST_MAX_COUNT; 16 x 577 values per channel
    assert channels._fold(positions, channels.FOLD_ROWS_BATCH) is None
    assert channels._fold(positions) is None
    gen = torch.Generator().manual_seed(2)
    x64 = torch.randn(16, 6, 1, positions, generator=gen, dtype=torch.float64).add_(1.0)
    _channels_last_layer_equals_float64(name, x64, gen, threads=1)
    assert calls == ([1] if name == "bn-cl" else []), calls


_CHANNELS_LAST_LAYERS = {"bn-cl": lambda: normkit.BatchNorm2d(6),
                         "gn-cl": lambda: normkit.GroupNorm(3, 6),
                         "in-cl": lambda: normkit.InstanceNorm2d(6, affine=True)}


def _channels_last_layer_equals_float64(name, x64, gen, threads=None):
    """Run layer ``name`` (random affine) on ``x64`` as channels-last float32 with
    ``threads`` and check that the engine served it and that its output and input
    gradient equal the float64 reference."""
    make = _CHANNELS_LAST_LAYERS[name]
    dy = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        module = make()
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        x = x64.float().contiguous(memory_format=torch.channels_last).requires_grad_()
        y = module(x)
        y.backward(dy.float())
    finally:
        torch.set_num_threads(before)
    assert "SliceNorm" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    twin = make().double()
    twin.load_state_dict(module.state_dict())
    if name == "bn-cl":  # the reference in the module's mode before the call (training)
        twin.running_mean.zero_(), twin.running_var.fill_(1.0)
    ref_x = x64.clone().requires_grad_()
    ref = reference_forward(twin, ref_x, input_dtype=torch.float32)
    ref.backward(dy)
    assert_close(y, ref, torch.float32)
    assert_grad_close(x.grad, ref_x.grad, torch.float32, "input grad")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("sample_bytes", "blocks"), [
    ((1 << 20) // 4, True), ((1 << 20) // 4 + 8, False), ((1 << 20) // 3, False),
    ((1 << 20) // 2, False)])
def test_batch_norm_sums_take_the_blocks_only_for_small_samples(threads, sample_bytes,
                                                                blocks):
    """BatchNorm's channels-last sums take the cache blocks only where a block holds at
    least BATCH_BLOCK_MIN_SAMPLES whole samples per thread (else the 256-row kernel
    folds); GroupNorm over one channel per group and InstanceNorm (64-row folds) from
    two samples, one per thread; GroupNorm over several channels per group (256-row
    folds) from GROUP_BLOCK_MIN_SAMPLES samples, and one per thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_block = channels.COLUMN_BLOCK_BYTES // sample_bytes  # samples per thread
        cols = torch.empty(2, sample_bytes // 4, 1)  # (N, L, C): L * C * 4 bytes a sample
        assert channels._blocks_of_samples(cols, channels.Pool("batch")) == blocks
        assert blocks == (per_block >= channels.BATCH_BLOCK_MIN_SAMPLES)
        step = channels.COLUMN_BLOCK_BYTES * threads // sample_bytes
        assert channels._blocks_of_samples(cols, channels.Pool("group", 1)) == (
            step >= max(threads, 2))
        assert channels._blocks_of_samples(cols, channels.Pool("instance")) == (
            step >= max(threads, 2))
        wide = torch.empty(2, sample_bytes // 8, 2)  # two channels in one group
        assert channels._fold_rows(channels.Pool("group", 1), 2) == channels.FOLD_ROWS_BATCH
        assert channels._blocks_of_samples(wide, channels.Pool("group", 1)) == (
            step >= max(threads, channels.GROUP_BLOCK_MIN_SAMPLES))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False),
                                  (False, True, True)], ids=["all", "dx", "params"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("kind", ["batch", "instance", "batch-channels-last"])
def test_nchw_backward_is_torchs_kernel_and_equals_float64(monkeypatch, kind, affine, mask,
                                                           large):
    """Contiguous input, pooled per channel or per slice, and channels-last input pooled
    per channel with at most ``CHANNELS_LAST_BACKWARD_MAX_COUNT`` values: the backward is
    torch's BatchNorm backward kernel from the saved statistics (the slice sums are never
    taken) -- unless BatchNorm's ``dx`` is wanted and the input has
    KERNEL_BACKWARD_MAX_BYTES or more (set to 0 here), where the sums and two passes write
    it (InstanceNorm keeps the kernel: its slices are finished in cache); every gradient asked for
    equals float64 autograd of torch's BatchNorm / InstanceNorm."""
    calls = []
    sums = channels._backward_sums
    monkeypatch.setattr(channels, "_backward_sums", lambda *a: calls.append(1) or sums(*a))
    if large:
        monkeypatch.setattr(channels, "KERNEL_BACKWARD_MAX_BYTES", 0)
    gen = torch.Generator().manual_seed(5)
    x64 = torch.randn(4, 6, 7, 9, generator=gen, dtype=torch.float64).add_(0.75)
    w64 = torch.randn(6, generator=gen, dtype=torch.float64) if affine else None
    dy64 = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    x, w, dy = x64.float(), None if w64 is None else w64.float(), dy64.float()
    if kind == "batch-channels-last":  # (dy stays contiguous: the engine converts it)
        x = x.contiguous(memory_format=torch.channels_last)
        assert x.numel() // 6 <= channels.CHANNELS_LAST_BACKWARD_MAX_COUNT
    pool = channels.Pool(kind.split("-")[0])
    mean, _, rstd = channels.moments(x, pool, 1e-5)
    mask = (mask[0], mask[1] and affine, mask[2])
    got = channels.backward(dy, x, mean, rstd, w, pool, mask)
    assert bool(calls) == (large and mask[0] and kind != "instance")
    if mask[0] and kind == "batch-channels-last":
        assert got[0].is_contiguous(memory_format=torch.channels_last)
    leaves = [x64.clone().requires_grad_(), None if w64 is None else w64.clone(),
              torch.zeros(6, dtype=torch.float64)]
    leaves = [t if t is None else t.requires_grad_() for t in leaves]
    ref = (torch.nn.functional.batch_norm(leaves[0], None, None, *leaves[1:], True, eps=1e-5)
           if kind.startswith("batch") else
           torch.nn.functional.instance_norm(leaves[0], weight=leaves[1], bias=leaves[2],
                                             eps=1e-5))
    ref.backward(dy64)
    for g, leaf, need, what in zip(got, leaves, mask, ("dx", "dweight", "dbias"), strict=True):
        if not need:
            assert g is None, what
            continue
        assert g.shape == leaf.shape and g.dtype == torch.float32, what
        assert_grad_close(g, leaf.grad, torch.float32, what)


@pytest.mark.parametrize("bound", ["kernel", "sums"])
def test_channels_last_batch_backward_bound(bound, monkeypatch):
    """Channels-last BatchNorm's backward from the engine's statistics: torch's backward
    kernel up to CHANNELS_LAST_BACKWARD_MAX_COUNT values per channel, the engine's
    folded sums and two passes past it; both equal float64 autograd within the float32
    gradient tolerance."""
    calls = []
    sums = channels._backward_sums
    monkeypatch.setattr(channels, "_backward_sums", lambda *a: calls.append(1) or sums(*a))
    if bound == "sums":
        monkeypatch.setattr(channels, "CHANNELS_LAST_BACKWARD_MAX_COUNT", 100)
    gen = torch.Generator().manual_seed(7)
    x64 = torch.randn(4, 6, 7, 9, generator=gen, dtype=torch.float64).add_(1.0)
    w64 = torch.rand(6, generator=gen, dtype=torch.float64) + 0.5
    dy64 = torch.randn(x64.shape, generator=gen, dtype=torch.float64).add_(0.5)
    x = x64.float().contiguous(memory_format=torch.channels_last)
    dy = dy64.float().contiguous(memory_format=torch.channels_last)
    mean, _, rstd = channels.moments(x, channels.Pool("batch"), 1e-5)
    got = channels.backward(dy, x, mean, rstd, w64.float(), channels.Pool("batch"),
                            (True, True, True))
    assert bool(calls) == (bound == "sums")  # (252 values per channel)
    leaves = [x64.clone().requires_grad_(), w64.clone().requires_grad_(),
              torch.zeros(6, dtype=torch.float64, requires_grad=True)]
    ref = torch.nn.functional.batch_norm(leaves[0], None, None, *leaves[1:], True, eps=1e-5)
    want = torch.autograd.grad(ref, leaves, dy64)
    for g, w_, what in zip(got, want, ("dx", "dweight", "dbias"), strict=True):
        assert_grad_close(g, w_, torch.float32, what)
    assert got[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("affine", [True, False])
def test_2d_batch_norm_past_torchs_count_takes_the_engine_through_a_view(affine):
    """BatchNorm1d on 2D ``(N, C)`` input with more rows than torch's kernel sums
    accurately: the engine on the ``(1, C, N, 1)`` channels-last view of the same memory
    (no copy), output 2D and contiguous; output, gradients and running statistics equal
    float64 torch, and the output can be modified in place (ReLU(inplace=True))."""
    from oracle import assert_close

    gen = torch.Generator().manual_seed(3)
    n = native.CHANNELS_LAST_MAX_COUNT * 2
    x64 = torch.randn(n, 24, generator=gen, dtype=torch.float64) * 2 + 1
    bn = normkit.BatchNorm1d(24, affine=affine, momentum=0.3)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5, generator=gen)
            bn.bias.normal_(generator=gen)
    ref_bn = torch.nn.BatchNorm1d(24, affine=affine, momentum=0.3).double()
    ref_bn.load_state_dict(bn.state_dict())
    x = x64.float().requires_grad_()
    y = bn(x)
    assert "SliceNorm" in type(y._base.grad_fn).__name__  # the engine, through the view
    assert y.shape == (n, 24) and y.is_contiguous()
    x64.requires_grad_()
    ref = ref_bn(x64)
    assert_close(y, ref, torch.float32)
    dy = torch.randn(n, 24, generator=gen, dtype=torch.float64)
    leaves = [x, *bn.parameters()]
    got = torch.autograd.grad(torch.relu_(y.clone()), leaves, dy.float())
    want = torch.autograd.grad(torch.relu(ref), [x64, *ref_bn.parameters()], dy)
    for g, w_ in zip(got, want, strict=True):
        assert_grad_close(g, w_, torch.float32)
    torch.testing.assert_close(bn.running_mean.double(), ref_bn.running_mean, rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), ref_bn.running_var, rtol=1e-5,
                               atol=1e-6)
    y2 = bn(x)
    torch.relu_(y2)  # in place on the engine's output, through the view
    y2.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_kernel_backward_takes_the_inputs_strides_in_size_one_dims():
    """A gradient dense in the input's memory format but with other strides in a size-1
    dim (an activation's output against a ``(1, C, N, 1)`` view) is restrided as a view,
    not copied, and the backward equals the one from matching strides."""
    x = channels.rows_as_channels_last(torch.randn(40, 3))
    g = torch.randn(1, 3, 40, 1).contiguous(memory_format=torch.channels_last)
    assert g.stride() != x.stride()
    same = native.strided_like(g, x)
    assert same.stride() == x.stride() and same.data_ptr() == g.data_ptr()
    torch.testing.assert_close(same, g)
    mean, _, rstd = channels.moments(x, channels.Pool("batch"), 1e-5)
    w = torch.rand(3) + 0.5
    got = channels.backward(g, x, mean, rstd, w, channels.Pool("batch"), (True, True, True))
    want = channels.backward(g.clone().as_strided(x.shape, x.stride()), x, mean, rstd, w,
                             channels.Pool("batch"), (True, True, True))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_engine_supports_only_what_it_serves():
    x = torch.randn(2, 3, 8, 8)
    assert channels.supports(x)
    assert not channels.supports(x.half())
    assert not channels.supports(x, torch.ones(3, dtype=torch.float64))
    assert not channels.supports(x[:, :, ::2])  # strided
    assert not channels.supports(torch.randn(2, 3, 3, 3))  # too few positions
    assert not channels.supports(torch.randn(0, 3, 8, 8))


def test_engine_size_floor(monkeypatch):
    monkeypatch.setattr(channels, "MIN_ELEMENTS", 1 << 18)
    assert not channels.supports(torch.randn(8, 16, 32, 32))
    assert channels.supports(torch.randn(16, 16, 32, 32))
    y = normkit.BatchNorm2d(16)(torch.randn(8, 16, 32, 32, requires_grad=True))
    assert "SliceNorm" not in type(y.grad_fn).__name__


def test_engine_output_can_be_modified_in_place():
    """An inplace ReLU after the norm (torchvision's ResNets) needs a non-view output."""
    cases = [(normkit.BatchNorm2d, torch.nn.BatchNorm2d, _input("bn", 0.0)),
             (normkit.InstanceNorm2d, torch.nn.InstanceNorm2d, _input("in-cl", 0.0))]
    for nk_cls, torch_cls, x in cases:
        grads = []
        for cls, relu in ((nk_cls, torch.nn.ReLU(inplace=True)), (torch_cls, torch.nn.ReLU())):
            x_ = x.detach().clone().requires_grad_()
            torch.nn.Sequential(cls(6, affine=True), relu)(x_).sum().backward()
            grads.append(x_.grad)
        torch.testing.assert_close(grads[0], grads[1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("min_elements", [0, 1 << 30], ids=["engine-size", "below-engine-size"])
def test_small_channels_last_group_norm_keeps_torchs_kernels_under_the_bound(monkeypatch,
                                                                             min_elements):
    """Below GROUP_NORM_MIN_POSITIONS torch's channels-last kernels serve both passes,
    under the engine's |mean| / std rule (their forward has the same sums), also on
    inputs too small for the engine (no copies to NCHW and back)."""
    monkeypatch.setattr(channels, "GROUP_NORM_MIN_POSITIONS", 1 << 30)
    monkeypatch.setattr(channels, "MIN_ELEMENTS", min_elements)
    module, twin, x, y, x64, ref = _run("gn-cl", 0.85 * channels.RATIO * 1.5, torch.float32)
    assert "NativeGroupNorm" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_close(y, ref, torch.float32)
    assert_grad_close(x.grad, x64.grad, torch.float32, "input grad")
    y = module(_input("gn-cl", 3.0 * channels.RATIO * 1.5))
    assert "NativeGroupNorm" not in type(y.grad_fn).__name__


def test_large_channels_last_and_2d_batch_norm_avoid_torchs_sequential_sums():
    """torch's channels-last (and 2D) BatchNorm statistics lose precision with the count
    per channel (3e-5 at 131072 values for centered data); normkit keeps them only up to
    CHANNELS_LAST_MAX_COUNT values and takes the slice-sums engine beyond (2D rows
    through their channels-last view)."""
    from normkit.kernels import native

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, 64, 64, generator=gen, dtype=torch.float64)  # 131072 per channel
    cl = x.float().contiguous(memory_format=torch.channels_last).requires_grad_()
    y = normkit.BatchNorm2d(4)(cl)
    assert "SliceNorm" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    assert y.is_contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.batch_norm(x, None, None, training=True)
    assert float((y.detach().double() - ref).abs().max()) < 2e-6
    small = cl.detach()[:, :, :8, :8].contiguous(memory_format=torch.channels_last)
    assert small.numel() // 4 <= native.CHANNELS_LAST_MAX_COUNT
    assert "Native" in type(normkit.BatchNorm2d(4)(small.requires_grad_()).grad_fn).__name__
    rows = torch.randn(131072, 4, generator=gen, dtype=torch.float64)
    y2 = normkit.BatchNorm1d(4)(rows.float().requires_grad_())
    assert "Native" not in type(y2.grad_fn).__name__
    ref2 = torch.nn.functional.batch_norm(rows, None, None, training=True)
    assert float((y2.detach().double() - ref2).abs().max()) < 2e-6


@pytest.mark.parametrize("offset", [0.0, 6.0, 1e4], ids=["centered", "ratio-4", "offset-1e4"])
def test_instance_norm_on_nchw_takes_torchs_group_norm_kernel(offset):
    """NCHW InstanceNorm is torch's GroupNorm kernel with one group per channel (faster
    than the engine there) under its bound (ratio <= 32), else normkit's compensated
    path; both equal the float64 reference and update the running statistics as torch
    does."""
    make = lambda: normkit.InstanceNorm2d(6, affine=True, track_running_stats=True)  # noqa: E731
    module, twin = make(), make().double()
    with torch.no_grad():
        for p, q in zip(module.parameters(), twin.parameters(), strict=True):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
            q.copy_(p)
    x = _input("in", offset).contiguous().requires_grad_()
    y = module(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    ref = reference_forward(twin, x64, input_dtype=torch.float32)
    ref.backward(dy.double())
    path = type(y.grad_fn).__name__
    assert ("NativeGroupNorm" if offset < 100 else "NormalizeFunction") in path, path
    assert y.is_contiguous()
    assert_close(y, ref, torch.float32)
    assert_grad_close(x.grad, x64.grad, torch.float32, "input grad")
    for p, p64 in zip(module.parameters(), twin.parameters(), strict=True):
        assert_grad_close(p.grad, p64.grad, torch.float32, "parameter grad")
    tm = torch.nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
    tm(x.detach())
    torch.testing.assert_close(module.running_mean, tm.running_mean)
    torch.testing.assert_close(module.running_var, tm.running_var, rtol=1e-4, atol=1e-6)
    if offset < 100:  # double backward through torch's kernel
        torch.autograd.gradgradcheck(
            lambda a, w, b: normkit.functional.instance_norm(a, weight=w, bias=b),
            (x64[:2], twin.weight, twin.bias))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_engine_repairs_a_few_bad_slices_in_either_layout(layout):
    """``channels.normalize`` with one InstanceNorm slice in 30 far off its spread: that
    slice by the compensated core, the others by the engine (one node), forward and
    every gradient within the float32 tolerance of float64. On NCHW input the backward
    zeroes the slice in a copy of ``dy`` (the engine's NCHW backward takes no ``skip``);
    the layers send NCHW InstanceNorm to torch's kernel first, so only a direct call
    runs that branch."""
    gen = torch.Generator().manual_seed(5)
    x64 = torch.randn(5, 6, 7, 9, generator=gen, dtype=torch.float64)
    x64[3, 2] = x64[3, 2] * 0.01 + 100.0
    x = x64.float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    w, b = (torch.randn(6, generator=gen).requires_grad_() for _ in range(2))
    skipped = []
    backward = channels.backward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(channels, "backward", lambda *a, **k: skipped.append(
            k.get("skip") is not None) or backward(*a, **k))
        y, mean, var = channels.normalize(
            x, w, b, channels.Pool("instance"), 1e-5,
            lambda x, w, b: torch.nn.functional.instance_norm(x, weight=w, bias=b))
        dy = torch.randn(y.shape, generator=gen)
        y.backward(dy)
    assert skipped == [layout == "channels_last"], skipped
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = torch.nn.functional.instance_norm(leaves[0], weight=leaves[1], bias=leaves[2])
    ref.backward(dy.double())
    assert_close(y, ref, torch.float32)
    assert abs(float(mean[3, 2]) - float(x64[3, 2].mean())) < 1e-4
    for got, leaf, what in zip((x, w, b), leaves, ("input", "weight", "bias"), strict=True):
        assert_grad_close(got.grad, leaf.grad, torch.float32, f"{what} grad")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), c=st.sampled_from([2, 4, 6]), h=st.integers(4, 9),
       w=st.integers(4, 9), offset=st.sampled_from([0.0, 1.0, 2.5, 40.0, 1e4]),
       kind=st.sampled_from(["batch", "instance", "group"]),
       channels_last=st.booleans())
def test_property_every_path_matches_float64(n, c, h, w, offset, kind, channels_last):
    """Random shapes, layouts and offsets: inside the engine's bound (the engine), past
    it (torch's kernel or the compensated path) and far past it; forward and gradients
    against float64 on the same input."""
    if kind == "batch" and n * h * w == 1:
        return
    gen = torch.Generator().manual_seed(n * 1000 + c * 100 + h * 10 + w)
    x0 = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) + offset
    wt = torch.randn(c, generator=gen, dtype=torch.float64)
    bs = torch.randn(c, generator=gen, dtype=torch.float64)

    def run(x, weight, bias):
        if kind == "batch":
            return normkit.functional.batch_norm(x, None, None, weight, bias, True)
        if kind == "instance":
            return normkit.functional.instance_norm(x, weight=weight, bias=bias)
        return normkit.functional.group_norm(x, 2, weight, bias)

    def ref(x, weight, bias):
        if kind == "batch":
            return torch.nn.functional.batch_norm(x, None, None, weight, bias, True)
        if kind == "instance":
            return torch.nn.functional.instance_norm(x, weight=weight, bias=bias)
        return torch.nn.functional.group_norm(x, 2, weight, bias)

    x = x0.float()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    leaves = [t.clone().requires_grad_() for t in (x, wt.float(), bs.float())]
    y = run(*leaves)
    leaves64 = [t.detach().double().contiguous().requires_grad_() for t in leaves]
    y64 = ref(*leaves64)
    assert_close(y, y64, torch.float32)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(dy.float())
    y64.backward(dy)
    for got, want, what in zip(leaves, leaves64, ("dx", "dweight", "dbias"), strict=True):
        assert_grad_close(got.grad, want.grad, torch.float32, what)


@pytest.mark.parametrize("block_bytes, threads, pooled",
                         [(None, 1, True), (1024, 1, False), (1024, 2, True)],
                         ids=["small-samples-whole-fold", "per-sample-folds",
                              "two-threads-whole-fold"])
def test_batch_norm_backward_sums_of_small_samples_in_one_call(monkeypatch, block_bytes,
                                                               threads, pooled):
    """BatchNorm's channels-last backward sums: small samples (those the forward sums in
    cache blocks), and any with WHOLE_FOLD_MIN_THREADS threads, in one kernel call over
    the whole folded matrix, already pooled to (1, C); larger ones with one thread per
    sample, (N, C). Both equal the float64 sums."""
    if block_bytes is not None:
        monkeypatch.setattr(channels, "COLUMN_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 6, 24, 24, generator=gen).add_(1.0).contiguous(
        memory_format=torch.channels_last)
    dy = torch.randn(x.shape, generator=gen).contiguous(memory_format=torch.channels_last)
    mean = x.double().mean((0, 2, 3)).float().view(1, 6)
    calls = []
    kernel = torch.ops.aten.native_batch_norm_backward
    monkeypatch.setattr(channels, "_ATEN", type("A", (), {
        "native_batch_norm_backward": staticmethod(
            lambda *a: calls.append(tuple(a[0].shape)) or kernel(*a))})())
    s1, sx = channels._backward_sums(dy, x, mean, channels.Pool("batch"))
    assert s1.shape == sx.shape == ((1, 6) if pooled else (16, 6))
    assert len(calls) == (1 if pooled else 16), calls
    want1 = dy.double().sum((0, 2, 3))
    wantx = (dy.double() * (x.double() - mean.double().view(1, 6, 1, 1))).sum((0, 2, 3))
    torch.testing.assert_close(s1.double().sum(0), want1, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(sx.double().sum(0), wantx, rtol=1e-6, atol=1e-4)


def test_channels_last_batch_norm_backward_with_an_upstream_gradient_along_the_input():
    """``dy = x`` (a loss on the normalized output itself, at its extreme): the exact input
    gradient is what ``eps`` leaves, and ``sum dy * (x - mean)`` does not cancel, so
    torch's backward kernel, which sums sequentially, shows its error in full -- 1.2e-4
    at 131072 values per channel, where normkit ran it until 2026-12-04 (tolerance 5e-5).
    The engine's sums serve past 16384 values (CHANNELS_LAST_BACKWARD_MAX_COUNT)."""
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x0 = torch.randn(32, 4, 64, 64, generator=gen).contiguous(
            memory_format=torch.channels_last)
        x = x0.clone().requires_grad_()
        (dx,) = torch.autograd.grad(normkit.BatchNorm2d(4)(x), x, x0)
        x64 = x0.double().requires_grad_()
        (want,) = torch.autograd.grad(torch.nn.BatchNorm2d(4).double()(x64), x64,
                                      x0.double())
        assert_grad_close(dx, want, torch.float32, f"dx, seed {seed}")


@pytest.mark.parametrize("offset", [0.0, 1.9])
def test_long_nchw_slices_are_summed_in_pieces(offset):
    """torch's BatchNorm backward kernel, which gives the engine its NCHW slice sums, adds
    a slice in vector lanes, each in sequence: over a whole 1024 x 1024 slice the mean it
    gave BatchNorm2d was 8 ulps off and the output 2.3e-5 (relative to its largest value;
    torch's 5.9e-8). Read in pieces of at most ROW_FOLD_LENGTH positions (or by torch's
    cascaded sums where a slice has no such pieces), the statistics are as exact as the
    float64 ones rounded, and the output within a few ulps."""
    x = torch.randn(1, 2, 1024, 1024, generator=torch.Generator().manual_seed(0)) + offset
    bn = normkit.BatchNorm2d(2, momentum=1.0)
    y = bn(x)
    x64 = x.double()
    torch.testing.assert_close(bn.running_mean, x64.mean((0, 2, 3)).float(), rtol=0,
                               atol=2.5e-7)
    y64 = torch.nn.functional.batch_norm(x64, None, None, training=True, eps=1e-5)
    assert float((y.double() - y64).abs().max()) <= 5e-7 * float(y64.abs().max())
    s1, s2 = channels._row_sums(x.view(1, 2, -1)[:, :, :1024 * 1023 + 7])  # no pieces
    rows = x64.view(2, -1)[:, :1024 * 1023 + 7]
    assert bool(((s1.double() - rows.sum(1)).abs() <= 1e-7 * rows.abs().sum(1)).all())
    torch.testing.assert_close(s2.double(), rows.square().sum(1), rtol=1e-7, atol=0)


@pytest.mark.parametrize("kind", ["batch", "instance"])
def test_nchw_backward_past_row_bound_with_an_upstream_gradient_along_the_input(kind):
    """``dy = x`` on 1024 x 1024 slices: torch's backward kernels' lane sums left 1.0e-4 to
    2.5e-4 of the exact (eps-sized) input gradient, more than the float32 tolerance; past
    ROW_BACKWARD_MAX_LENGTH positions (BatchNorm's kernel) and
    GROUP_NORM_BACKWARD_MAX_LENGTH (the GroupNorm kernel InstanceNorm runs on NCHW) the
    engine's sums in pieces and two passes serve (1e-6)."""
    assert 1024 * 1024 > channels.ROW_BACKWARD_MAX_LENGTH
    assert 1024 * 1024 > native.GROUP_NORM_BACKWARD_MAX_LENGTH
    x0 = torch.randn(1, 2, 1024, 1024, generator=torch.Generator().manual_seed(1)) + 1.9
    x64 = x0.double().requires_grad_()
    if kind == "batch":
        layer, ref = normkit.BatchNorm2d(2), torch.nn.BatchNorm2d(2).double()
    else:
        layer = normkit.InstanceNorm2d(2, affine=True)
        ref = torch.nn.InstanceNorm2d(2, affine=True).double()
    x = x0.clone().requires_grad_()
    (dx,) = torch.autograd.grad(layer(x), x, x0)
    (want,) = torch.autograd.grad(ref(x64), x64, x0.double())
    assert_grad_close(dx, want, torch.float32, "dx")


def test_group_norm_backward_over_long_slices_with_an_upstream_gradient_along_the_input():
    """GroupNorm on NCHW runs torch's GroupNorm kernels; their backward's lane sums left
    1.1e-4 of ``dy = x``'s exact input gradient here, over 1024 x 1024 positions (1.3e-4
    to 1.7e-4 in other draws). Past GROUP_NORM_BACKWARD_MAX_LENGTH the slice-sums engine gives
    the gradients (9e-7)."""
    x0 = torch.randn(1, 2, 1024, 1024, generator=torch.Generator().manual_seed(0)) + 1.9
    w = torch.rand(2, generator=torch.Generator().manual_seed(3)) + 0.5
    leaf, wl = x0.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(normkit.functional.group_norm(leaf, 1, wl), (leaf, wl), x0)
    x64, w64 = x0.double().requires_grad_(), w.double().requires_grad_()
    want = torch.autograd.grad(torch.nn.functional.group_norm(x64, 1, w64), (x64, w64),
                               x0.double())
    for g, w_, what in zip(got, want, ("dx", "dweight"), strict=True):
        assert_grad_close(g, w_, torch.float32, what)


@pytest.mark.parametrize("length", [4099, 8192, 3 * 4096 + 3])
@pytest.mark.parametrize("kind", ["batch", "group"])
def test_backward_sums_of_contiguous_slices_in_pieces(kind, length):
    """``_backward_sums`` of contiguous input reads each slice in pieces of at most
    ROW_FOLD_LENGTH positions, the fewest equal ones (8192: two; 12291: 17 of 723), else
    takes torch's cascaded sums (4099 is prime); every way equals float64 sums to a few
    ulps of the sums' magnitudes."""
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(3, 4, length, generator=gen) + 1.5
    dy = x + 0.25 * torch.randn(x.shape, generator=gen)
    pool = channels.Pool(kind, 2) if kind == "group" else channels.Pool(kind)
    mean = x.double().mean((0, 2)).float().view(1, 4).expand(3, 4).contiguous()
    s1, sx = channels._backward_sums(dy, x, mean, pool)
    centered = x.double() - mean.double().view(3, 4, 1)
    for got, want, scale in ((s1, dy.double().sum(2), dy.double().abs().sum(2)),
                             (sx, (dy.double() * centered).sum(2),
                              (dy.double() * centered).abs().sum(2))):
        assert got.shape == (3, 4)
        assert bool(((got.double() - want).abs() <= 1e-6 * scale).all())
