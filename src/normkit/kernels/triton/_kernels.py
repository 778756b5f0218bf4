"""The Triton kernels behind :mod:`normkit.kernels.triton` (private: launched by ``_ops``).

Conventions shared by every kernel here:

* **float32 statistics.** Inputs of any dtype are loaded and up-cast to float32; every
  sum, mean and variance is accumulated in float32; values are cast to the dtype of the
  tensor they are stored into only at the store.
* **Compensated, two-pass moments.** A first pass gives ``mean_hi``; a second pass
  accumulates ``d = x - mean_hi`` (exact for values within a factor of two of the mean,
  by Sterbenz' lemma), giving ``mean_lo = mean(d)`` and
  ``var = mean(d**2) - mean_lo**2`` (``mean_lo`` is a few ulps of the offset, so nothing
  cancels). The variance is never ``E[x**2] - E[x]**2`` of the raw input, and the
  centred input is ``(x - mean_hi) - mean_lo``: data at an offset of 1e4 with unit
  spread keep their digits. This is the scheme of :func:`normkit._stats.moments`.
* **int64 offsets.** Program ids and every row, channel or spatial index are widened to
  int64 before they meet a stride, so tensors past 2**31 elements index correctly.
* **No atomics.** A reduction across programs (weight and bias gradients, BatchNorm
  statistics) writes per-program partials that a second kernel (:func:`_bn_merge`) or a
  torch sum reduces in a fixed order, so every result is bitwise reproducible.
* **Any width.** Rows and groups wider than one block are walked in ``BLOCK``-sized
  chunks; a ``SINGLE`` row (one block) is read once and kept in registers.
* **NaN and Inf propagate** as in torch: a NaN anywhere in a normalized group makes the
  group's statistics, and so all its outputs, NaN. (Variances are clamped at zero with
  ``where(v < 0, 0, v)``, which keeps a NaN, rather than with ``maximum``.)

Interpreter or compiler: Triton's CPU interpreter (``TRITON_INTERPRET=1``) is chosen
when :mod:`triton.language` is first imported -- its own helpers such as ``tl.sum``
are then interpreted functions, and a compiled kernel cannot call them, nor an
interpreted kernel compiled ones. The kernels here are therefore wrapped the way
:mod:`triton.language` was (:data:`INTERPRETING`), whatever ``TRITON_INTERPRET`` says
when this module is imported later.

This module has no ``from __future__ import annotations``: Triton reads the
``tl.constexpr`` annotations of kernel parameters, and older Triton releases compare
them as objects, not as strings.
"""

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - exercised only where triton is not installed
    triton = None

if triton is not None:
    #: True when Triton runs kernels through its CPU interpreter in this process.
    INTERPRETING = isinstance(tl.sum, InterpretedFunction)
    _jit = InterpretedFunction if INTERPRETING else JITFunction
else:  # pragma: no cover - exercised only where triton is not installed
    # normkit imports this module only once triton is known to import; these two names
    # let tools that import every module (``pytest --doctest-modules``) load it anyway.
    # Nothing defined below can be launched then.
    INTERPRETING = False

    class tl:  # stands in for ``triton.language`` in the signatures below
        constexpr = None

    def _jit(fn):
        return fn


# --------------------------------------------------------------------------------------
# Rows: LayerNorm (CENTER) and RMSNorm, with an optional residual add
#
# x, residual, h (= x + residual, the new residual stream), y: (M, N) with unit column
# stride and a row stride each; statistics: one float32 buffer STATS, rows MEAN_HI,
# MEAN_LO, RSTD of M values each (LayerNorm: (3, M)) or RSTD alone (RMSNorm: (1, M)),
# one allocation on the host instead of three (:func:`_row_stat_rows`).
# --------------------------------------------------------------------------------------


@_jit
def _row_stat_rows(STATS, M, CENTER: tl.constexpr):
    """``(MEAN_HI, MEAN_LO, RSTD)`` pointers into the statistics buffer (RMSNorm: all
    three ``RSTD``; the kernels read no mean without ``CENTER``). Offsets are added one
    row at a time, so none exceeds ``M``."""
    MEAN_LO = STATS
    RSTD = STATS
    if CENTER:
        MEAN_LO = STATS + M
        RSTD = MEAN_LO + M
    return STATS, MEAN_LO, RSTD


@_jit
def _partial_rows(PARTS, width, STORE_DW: tl.constexpr):
    """``(DW, DB)`` pointers into a ``(k, programs, width)`` float32 buffer of per-program
    weight/bias gradient partials: dw's rows, then db's (either alone at the start when
    the other is not stored). ``programs`` is the launch's grid size."""
    DB = PARTS
    if STORE_DW:
        DB = PARTS + tl.num_programs(0).to(tl.int64) * width
    return PARTS, DB


@_jit
def _program_run(total, per_program):
    """``(pid, start, end)``: this program's id and the run ``[start, end)`` of
    ``per_program`` items (rows, tiles) of ``total`` that it owns, int64."""
    pid = tl.program_id(0).to(tl.int64)
    start = pid * per_program
    return pid, start, tl.minimum(start + per_program, total)


@_jit
def _weight_chunk(W, start, width, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """``(cols, mask, w)``: columns ``start .. start + BLOCK`` of a weight of ``width``
    values, their mask and the weight there in float32 (ones without ``HAS_W``)."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < width
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.where(mask, 1.0, 0.0)
    return cols, mask, w


@_jit
def _row_input(X, R, H, x_off, r_off, mask, HAS_RES: tl.constexpr):
    """A chunk of the row input in float32: ``x``, or ``x + r`` rounded as ``H`` stores it."""
    x = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + r_off, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(H.dtype.element_ty).to(tl.float32)
    return x


@_jit
def _row_out(xhat, W, B, Y_row, cols, mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """Store ``xhat * w + b`` (affine optional) into a chunk of one output row."""
    y = xhat
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y_row + cols, y.to(Y_row.dtype.element_ty), mask=mask)


@_jit
def _row_stats(
    X, R, H, STATS,
    stride_x, stride_r, stride_h, M, N, inv_n, eps,
    CENTER: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    """Statistics of rows wider than one block (one program per row), chunk by chunk.

    With a residual, the first pass also stores ``h = x + residual``; later passes
    recompute it from ``x`` and ``residual`` rather than read back what this program
    stored.
    """
    MEAN_HI, MEAN_LO, RSTD = _row_stat_rows(STATS, M, CENTER)
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = _row_input(X, R, H, row * stride_x + cols, row * stride_r + cols, mask, HAS_RES)
        if HAS_RES:
            tl.store(H + row * stride_h + cols, x.to(H.dtype.element_ty), mask=mask)
        if CENTER:
            acc += x
        else:
            acc += x * x
    if CENTER:
        mean_hi = tl.sum(acc, axis=0) * inv_n
        acc_d = tl.zeros([BLOCK], dtype=tl.float32)
        acc_dd = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            x = _row_input(X, R, H, row * stride_x + cols, row * stride_r + cols, mask, HAS_RES)
            d = tl.where(mask, x - mean_hi, 0.0)
            acc_d += d
            acc_dd += d * d
        mean_lo = tl.sum(acc_d, axis=0) * inv_n
        var = tl.sum(acc_dd, axis=0) * inv_n - mean_lo * mean_lo
        var = tl.where(var < 0.0, 0.0, var)
        tl.store(MEAN_HI + row, mean_hi)
        tl.store(MEAN_LO + row, mean_lo)
    else:
        var = tl.sum(acc, axis=0) * inv_n
    tl.store(RSTD + row, 1.0 / tl.sqrt(var + eps))


@_jit
def _row_fwd(
    X, R, H, Y, W, B, STATS,
    stride_x, stride_r, stride_h, stride_y, M, N, inv_n, eps,
    CENTER: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    SINGLE: tl.constexpr, STORE_STATS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Normalize one row per program.

    ``SINGLE``: the row fits one block; it is read once, its statistics computed in
    registers and, with ``STORE_STATS`` (a backward will need them), stored. Otherwise
    the statistics come from :func:`_row_stats` and the row is normalized chunk by chunk
    (reading ``h`` when there is a residual).
    """
    MEAN_HI, MEAN_LO, RSTD = _row_stat_rows(STATS, M, CENTER)
    row = tl.program_id(0).to(tl.int64)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = _row_input(X, R, H, row * stride_x + cols, row * stride_r + cols, mask, HAS_RES)
        if HAS_RES:
            tl.store(H + row * stride_h + cols, x.to(H.dtype.element_ty), mask=mask)
        if CENTER:
            mean_hi = tl.sum(x, axis=0) * inv_n
            d = tl.where(mask, x - mean_hi, 0.0)
            mean_lo = tl.sum(d, axis=0) * inv_n
            var = tl.sum(d * d, axis=0) * inv_n - mean_lo * mean_lo
            var = tl.where(var < 0.0, 0.0, var)
            xc = d - mean_lo
            if STORE_STATS:
                tl.store(MEAN_HI + row, mean_hi)
                tl.store(MEAN_LO + row, mean_lo)
        else:
            var = tl.sum(x * x, axis=0) * inv_n
            xc = x
        rstd = 1.0 / tl.sqrt(var + eps)
        if STORE_STATS:
            tl.store(RSTD + row, rstd)
        _row_out(xc * rstd, W, B, Y + row * stride_y, cols, mask, HAS_W, HAS_B)
    else:
        rstd = tl.load(RSTD + row)
        if CENTER:
            mean_hi = tl.load(MEAN_HI + row)
            mean_lo = tl.load(MEAN_LO + row)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            if HAS_RES:
                x = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            if CENTER:
                x = (x - mean_hi) - mean_lo
            _row_out(x * rstd, W, B, Y + row * stride_y, cols, mask, HAS_W, HAS_B)


@_jit
def _row_xhat(X, MEAN_HI, MEAN_LO, RSTD, row, x_off, mask, CENTER: tl.constexpr):
    """A chunk of the normalized row ``(x - mean) * rstd`` in float32 (0 where masked)."""
    x = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    if CENTER:
        x = (x - tl.load(MEAN_HI + row)) - tl.load(MEAN_LO + row)
    return tl.where(mask, x * tl.load(RSTD + row), 0.0)


@_jit
def _row_bwd_coeffs(
    X, DY, W, STATS, COEFFS,
    stride_x, stride_dy, M, N, inv_n,
    CENTER: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per-row ``c1 = mean(g * xhat)`` and ``c2 = mean(g)``, ``g = dy * w``, of wide rows,
    into the rows of ``COEFFS`` (``(2, M)``; ``(1, M)``, ``c1`` alone, without centering)."""
    MEAN_HI, MEAN_LO, RSTD = _row_stat_rows(STATS, M, CENTER)
    C1 = COEFFS
    C2 = COEFFS + M
    row = tl.program_id(0).to(tl.int64)
    acc_gx = tl.zeros([BLOCK], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        xhat = _row_xhat(X, MEAN_HI, MEAN_LO, RSTD, row, row * stride_x + cols, mask, CENTER)
        g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        acc_gx += g * xhat
        acc_g += g
    tl.store(C1 + row, tl.sum(acc_gx, axis=0) * inv_n)
    if CENTER:
        tl.store(C2 + row, tl.sum(acc_g, axis=0) * inv_n)


@_jit
def _row_bwd(
    X, DY, DH, DX, DR, W, STATS, COEFFS, PARTS,
    stride_x, stride_dy, stride_dh, stride_dx, stride_dr, M, N, inv_n, rows_per_program,
    CENTER: tl.constexpr, HAS_W: tl.constexpr, STORE_DW: tl.constexpr, STORE_DB: tl.constexpr,
    HAS_DH: tl.constexpr, STORE_DR: tl.constexpr, SINGLE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Input gradient of rows, and per-program partial weight/bias gradients.

    ``dx = rstd * (g - xhat * c1 - c2)`` with ``g = dy * w`` (no ``c2`` without
    centering), plus the gradient ``dh`` flowing into the new residual stream. Program
    ``p`` owns rows ``[p * rows_per_program, (p + 1) * rows_per_program)`` and row ``p``
    of the ``(programs, N)`` float32 partials ``DW`` (``sum dy * xhat``) and ``DB``
    (``sum dy``), kept in registers chunk by chunk: ``PARTS`` holds ``DW`` then ``DB``
    (either alone when the other is not stored). ``c1``/``c2`` come from the row itself
    when it fits one block (``SINGLE``), else from :func:`_row_bwd_coeffs` (``COEFFS``).
    """
    MEAN_HI, MEAN_LO, RSTD = _row_stat_rows(STATS, M, CENTER)
    C1 = COEFFS
    C2 = COEFFS + M
    DW, DB = _partial_rows(PARTS, N, STORE_DW)
    pid, row_start, row_end = _program_run(M, rows_per_program)
    for start in range(0, N, BLOCK):
        cols, mask, w = _weight_chunk(W, start, N, HAS_W, BLOCK)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(row_start, row_end):
            xhat = _row_xhat(X, MEAN_HI, MEAN_LO, RSTD, row, row * stride_x + cols, mask, CENTER)
            dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                g = dy * w
            else:
                g = dy
            if SINGLE:
                c1 = tl.sum(g * xhat, axis=0) * inv_n
                if CENTER:
                    c2 = tl.sum(g, axis=0) * inv_n
            else:
                c1 = tl.load(C1 + row)
                if CENTER:
                    c2 = tl.load(C2 + row)
            dx = g - xhat * c1
            if CENTER:
                dx = dx - c2
            dx = dx * tl.load(RSTD + row)
            if HAS_DH:
                dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            if STORE_DR:
                tl.store(DR + row * stride_dr + cols, dx.to(DR.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        if STORE_DW:
            tl.store(DW + pid * N + cols, dw, mask=mask)
        if STORE_DB:
            tl.store(DB + pid * N + cols, db, mask=mask)


# --------------------------------------------------------------------------------------
# GroupNorm over (N, C, S) with any strides (NCHW: s-stride 1; NHWC: c-stride 1)
#
# Program ``pid`` of the statistics kernels handles group ``g = pid % G`` of sample
# ``n = pid // G``: channels ``[g * CPG, (g + 1) * CPG)`` times all ``S`` positions,
# walked in [BLOCK_S, BLOCK_C] tiles. Statistics: (N * G,) float32.
# --------------------------------------------------------------------------------------


@_jit
def _tile(s0, c0, S, CPG, ss_, sc_, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """int64 offsets ``s * ss_ + c * sc_`` and the mask of a [BLOCK_S, BLOCK_C] tile."""
    s = s0 + tl.arange(0, BLOCK_S)
    c = c0 + tl.arange(0, BLOCK_C)
    mask = (s[:, None] < S) & (c[None, :] < CPG)
    offs = s[:, None].to(tl.int64) * ss_ + c[None, :].to(tl.int64) * sc_
    return offs, mask


@_jit
def _act(z, ACT: tl.constexpr):
    """The fused activation: identity (0) or SiLU (1)."""
    if ACT == 1:
        z = z * tl.sigmoid(z)
    return z


@_jit
def _act_grad(dy, z, ACT: tl.constexpr):
    """``dy * act'(z)``: SiLU' = s (1 + z (1 - s)) with s = sigmoid(z)."""
    if ACT == 1:
        s = tl.sigmoid(z)
        dy = dy * (s * (1.0 + z * (1.0 - s)))
    return dy


@_jit
def _gn_stats(
    X, MEAN_HI, MEAN_LO, RSTD,
    sxn, sxc, sxs, G, CPG, S, inv_n, eps,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Compensated mean and rstd of one (sample, group) per program, in two passes."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // G
    g = pid - n * G
    base = X + n * sxn + g * CPG * sxc
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, CPG, BLOCK_C):
        for s0 in range(0, S, BLOCK_S):
            offs, mask = _tile(s0, c0, S, CPG, sxs, sxc, BLOCK_S, BLOCK_C)
            acc += tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    mean_hi = tl.sum(tl.sum(acc, axis=1), axis=0) * inv_n
    acc_d = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    acc_dd = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, CPG, BLOCK_C):
        for s0 in range(0, S, BLOCK_S):
            offs, mask = _tile(s0, c0, S, CPG, sxs, sxc, BLOCK_S, BLOCK_C)
            x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - mean_hi, 0.0)
            acc_d += d
            acc_dd += d * d
    mean_lo = tl.sum(tl.sum(acc_d, axis=1), axis=0) * inv_n
    var = tl.sum(tl.sum(acc_dd, axis=1), axis=0) * inv_n - mean_lo * mean_lo
    var = tl.where(var < 0.0, 0.0, var)
    tl.store(MEAN_HI + pid, mean_hi)
    tl.store(MEAN_LO + pid, mean_lo)
    tl.store(RSTD + pid, 1.0 / tl.sqrt(var + eps))


@_jit
def _gn_fwd(
    X, Y, W, B, MEAN_HI, MEAN_LO, RSTD,
    sxn, sxc, sxs, syn, syc, sys_, G, CPG, S, S_BLOCKS,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``act(xhat * w + b)`` for one (sample, group, spatial block) per program."""
    pid = tl.program_id(0).to(tl.int64)
    grp = pid // S_BLOCKS
    s0 = (pid - grp * S_BLOCKS) * BLOCK_S
    n = grp // G
    g = grp - n * G
    mean_hi = tl.load(MEAN_HI + grp)
    mean_lo = tl.load(MEAN_LO + grp)
    rstd = tl.load(RSTD + grp)
    x_base = X + n * sxn + g * CPG * sxc
    y_base = Y + n * syn + g * CPG * syc
    for c0 in range(0, CPG, BLOCK_C):
        offs, mask = _tile(s0, c0, S, CPG, sxs, sxc, BLOCK_S, BLOCK_C)
        y_offs, _ = _tile(s0, c0, S, CPG, sys_, syc, BLOCK_S, BLOCK_C)
        x = tl.load(x_base + offs, mask=mask, other=0.0).to(tl.float32)
        z = ((x - mean_hi) - mean_lo) * rstd
        ch = g * CPG + c0 + tl.arange(0, BLOCK_C)
        cmask = c0 + tl.arange(0, BLOCK_C) < CPG
        if HAS_W:
            z = z * tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            z = z + tl.load(B + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
        z = _act(z, ACT)
        tl.store(y_base + y_offs, z.to(Y.dtype.element_ty), mask=mask)


@_jit
def _gn_dz(
    x_ptrs, dy_ptrs, W, B, mask, ch, cmask, mean_hi, mean_lo, rstd,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
):
    """A tile's ``xhat``, the gradient ``dz`` at the affine output, and ``w`` per channel."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, ((x - mean_hi) - mean_lo) * rstd, 0.0)
    dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.where(cmask, 1.0, 0.0)
    z = xhat * w[None, :]
    if HAS_B:
        z = z + tl.load(B + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dz = tl.where(mask, _act_grad(dy, z, ACT), 0.0)
    return xhat, dz, w


@_jit
def _gn_bwd_sums(
    X, DY, W, B, MEAN_HI, MEAN_LO, RSTD, C1, C2, DW, DB,
    sxn, sxc, sxs, sdn, sdc, sds, G, C, CPG, S, inv_n,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per (sample, group): ``c1 = mean(g * xhat)``, ``c2 = mean(g)`` with ``g = dz * w``,
    and the sample's partial ``sum dz * xhat`` / ``sum dz`` of each channel of the group
    (rows ``n`` of the ``(N, C)`` float32 partials ``DW``/``DB``)."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // G
    g = pid - n * G
    mean_hi = tl.load(MEAN_HI + pid)
    mean_lo = tl.load(MEAN_LO + pid)
    rstd = tl.load(RSTD + pid)
    x_base = X + n * sxn + g * CPG * sxc
    dy_base = DY + n * sdn + g * CPG * sdc
    acc_gx = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, CPG, BLOCK_C):
        ch = g * CPG + c0 + tl.arange(0, BLOCK_C)
        cmask = c0 + tl.arange(0, BLOCK_C) < CPG
        acc_dw = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        acc_db = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            offs, mask = _tile(s0, c0, S, CPG, sxs, sxc, BLOCK_S, BLOCK_C)
            dy_offs, _ = _tile(s0, c0, S, CPG, sds, sdc, BLOCK_S, BLOCK_C)
            xhat, dz, w = _gn_dz(x_base + offs, dy_base + dy_offs, W, B, mask, ch, cmask,
                                 mean_hi, mean_lo, rstd, HAS_W, HAS_B, ACT)
            acc_dw += dz * xhat
            acc_db += dz
            gz = dz * w[None, :]
            acc_gx += gz * xhat
            acc_g += gz
        if HAS_W:
            tl.store(DW + n * C + ch, tl.sum(acc_dw, axis=0), mask=cmask)
        if HAS_B:
            tl.store(DB + n * C + ch, tl.sum(acc_db, axis=0), mask=cmask)
    tl.store(C1 + pid, tl.sum(tl.sum(acc_gx, axis=1), axis=0) * inv_n)
    tl.store(C2 + pid, tl.sum(tl.sum(acc_g, axis=1), axis=0) * inv_n)


@_jit
def _gn_bwd_dx(
    X, DY, DX, W, B, MEAN_HI, MEAN_LO, RSTD, C1, C2,
    sxn, sxc, sxs, sdn, sdc, sds, son, soc, sos, G, CPG, S, S_BLOCKS,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``dx = rstd * (g - xhat * c1 - c2)`` per (sample, group, spatial block)."""
    pid = tl.program_id(0).to(tl.int64)
    grp = pid // S_BLOCKS
    s0 = (pid - grp * S_BLOCKS) * BLOCK_S
    n = grp // G
    g = grp - n * G
    mean_hi = tl.load(MEAN_HI + grp)
    mean_lo = tl.load(MEAN_LO + grp)
    rstd = tl.load(RSTD + grp)
    c1 = tl.load(C1 + grp)
    c2 = tl.load(C2 + grp)
    x_base = X + n * sxn + g * CPG * sxc
    dy_base = DY + n * sdn + g * CPG * sdc
    dx_base = DX + n * son + g * CPG * soc
    for c0 in range(0, CPG, BLOCK_C):
        ch = g * CPG + c0 + tl.arange(0, BLOCK_C)
        cmask = c0 + tl.arange(0, BLOCK_C) < CPG
        offs, mask = _tile(s0, c0, S, CPG, sxs, sxc, BLOCK_S, BLOCK_C)
        dy_offs, _ = _tile(s0, c0, S, CPG, sds, sdc, BLOCK_S, BLOCK_C)
        dx_offs, _ = _tile(s0, c0, S, CPG, sos, soc, BLOCK_S, BLOCK_C)
        xhat, dz, w = _gn_dz(x_base + offs, dy_base + dy_offs, W, B, mask, ch, cmask,
                             mean_hi, mean_lo, rstd, HAS_W, HAS_B, ACT)
        dx = (dz * w[None, :] - xhat * c1 - c2) * rstd
        tl.store(dx_base + dx_offs, dx.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# BatchNorm over (N, C, S) with any strides, statistics per channel over N and S
#
# The R = N * S reduced positions of each channel are split into chunks of
# ``rows_per_program``; program ``pid`` handles chunk ``pid // C_BLOCKS`` of channel
# block ``pid % C_BLOCKS`` in [BLOCK_R, BLOCK_C] tiles and writes one row of the
# (chunks, C) float32 partials, which _bn_merge merges (count-weighted, float64).
# --------------------------------------------------------------------------------------


@_jit
def _bn_tile(r, c, S, sn, ss_, sc_, MERGED: tl.constexpr):
    """int64 offsets of positions ``r`` (flat over N, S) times channels ``c``. ``MERGED``:
    the samples' positions are one run of stride ``ss_`` (``sn == S * ss_``, as in
    channels-last, or one sample), so ``r`` indexes them directly, with no 64-bit
    division per position."""
    if MERGED:
        return (r * ss_)[:, None] + c.to(tl.int64)[None, :] * sc_
    n = r // S
    s = r - n * S
    return (n * sn + s * ss_)[:, None] + c.to(tl.int64)[None, :] * sc_


@_jit
def _chunk_moments(X, r_start, r_end, c, cmask, S, sxn, sxs, sxc, MERGED: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``(mean_hi, mean_lo, M2)`` of positions ``r_start .. r_end`` of channels ``c``, in
    two passes (:func:`_bn_tile` indexing)."""
    count = (r_end - r_start).to(tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < r_end)[:, None] & cmask[None, :]
        offs = _bn_tile(r, c, S, sxn, sxs, sxc, MERGED)
        acc += tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    mean_hi = tl.sum(acc, axis=0) / count
    acc_d = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc_dd = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < r_end)[:, None] & cmask[None, :]
        offs = _bn_tile(r, c, S, sxn, sxs, sxc, MERGED)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean_hi[None, :], 0.0)
        acc_d += d
        acc_dd += d * d
    mean_lo = tl.sum(acc_d, axis=0) / count
    m2 = tl.sum(acc_dd, axis=0) - count * mean_lo * mean_lo
    return mean_hi, mean_lo, tl.where(m2 < 0.0, 0.0, m2)


@_jit
def _bn_stats(
    X, PMEAN_HI, PMEAN_LO, PM2,
    sxn, sxc, sxs, C, S, R, rows_per_program, C_BLOCKS,
    MERGED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Compensated mean and ``M2 = sum (x - mean)**2`` of a chunk of each channel."""
    pid = tl.program_id(0).to(tl.int64)
    chunk = pid // C_BLOCKS
    c = (pid - chunk * C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    r_start = chunk * rows_per_program
    r_end = tl.minimum(r_start + rows_per_program, R)
    mean_hi, mean_lo, m2 = _chunk_moments(X, r_start, r_end, c, cmask, S, sxn, sxs, sxc,
                                          MERGED, BLOCK_R, BLOCK_C)
    out = chunk * C + c
    tl.store(PMEAN_HI + out, mean_hi, mask=cmask)
    tl.store(PMEAN_LO + out, mean_lo, mask=cmask)
    tl.store(PM2 + out, m2, mask=cmask)


@_jit
def _bn_parts(PMEAN_HI, PMEAN_LO, k0, c, cmask, C, chunks, last, rows_per_program,
              BLOCK_K: tl.constexpr):
    """Chunks ``k0 .. k0 + BLOCK_K`` of the partials for channels ``c``: their counts,
    their means in float64, the offsets and the mask of the ``[BLOCK_K, BLOCK_C]`` tile."""
    k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    mask = (k < chunks)[:, None] & cmask[None, :]
    count = tl.where(k == chunks - 1, last, rows_per_program).to(tl.float64)
    off = k[:, None] * C + c[None, :]
    m = (tl.load(PMEAN_HI + off, mask=mask, other=0.0).to(tl.float64)
         + tl.load(PMEAN_LO + off, mask=mask, other=0.0).to(tl.float64))
    return count, m, off, mask


@_jit
def _bn_merge(
    PMEAN_HI, PMEAN_LO, PM2, MEAN_HI, MEAN_LO, VAR, RSTD,
    C, R, chunks, rows_per_program, eps,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Merge the ``(chunks, C)`` partials of :func:`_bn_stats` by count, in float64.

    Chan et al.'s pairwise formula, summed in a fixed order: ``mean = sum(n_k m_k) / R``,
    ``M2 = sum(M2_k) + sum(n_k (m_k - mean)**2)``, every chunk holding
    ``rows_per_program`` values but the last. Stores the biased variance, ``rstd`` and the
    mean split into a float32 pair, so ``x - mean`` keeps its digits at any offset.
    """
    c = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    last = R - rows_per_program * (chunks - 1)
    acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float64)
    for k0 in range(0, chunks, BLOCK_K):
        count, m, off, mask = _bn_parts(PMEAN_HI, PMEAN_LO, k0, c, cmask, C, chunks, last,
                                        rows_per_program, BLOCK_K)
        acc += tl.where(mask, count[:, None] * m, 0.0)
    mean = tl.sum(acc, axis=0) / R
    acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float64)
    for k0 in range(0, chunks, BLOCK_K):
        count, m, off, mask = _bn_parts(PMEAN_HI, PMEAN_LO, k0, c, cmask, C, chunks, last,
                                        rows_per_program, BLOCK_K)
        d = m - mean[None, :]
        m2 = tl.load(PM2 + off, mask=mask, other=0.0).to(tl.float64)
        acc += tl.where(mask, m2 + count[:, None] * d * d, 0.0)
    var = tl.sum(acc, axis=0) / R
    mean_hi = mean.to(tl.float32)
    tl.store(MEAN_HI + c, mean_hi, mask=cmask)
    tl.store(MEAN_LO + c, (mean - mean_hi.to(tl.float64)).to(tl.float32), mask=cmask)
    tl.store(VAR + c, var.to(tl.float32), mask=cmask)
    tl.store(RSTD + c, (1.0 / tl.sqrt(var + eps)).to(tl.float32), mask=cmask)


@_jit
def _bn_channel(MEAN_HI, MEAN_LO, RSTD, W, c, cmask, HAS_W: tl.constexpr):
    """Per-channel ``mean_hi``, ``mean_lo`` and ``scale = rstd * w`` of a channel block."""
    mean_hi = tl.load(MEAN_HI + c, mask=cmask, other=0.0)
    mean_lo = tl.load(MEAN_LO + c, mask=cmask, other=0.0)
    rstd = tl.load(RSTD + c, mask=cmask, other=0.0)
    if HAS_W:
        w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.where(cmask, 1.0, 0.0)
    return mean_hi, mean_lo, rstd, w


@_jit
def _bn_fwd(
    X, Y, W, B, MEAN_HI, MEAN_LO, RSTD,
    sxn, sxc, sxs, syn, syc, sys_, C, S, R, C_BLOCKS,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, MERGED: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``((x - mean_hi) - mean_lo) * rstd * w + b`` on one [BLOCK_R, BLOCK_C] tile."""
    pid = tl.program_id(0).to(tl.int64)
    rb = pid // C_BLOCKS
    c = (pid - rb * C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (r < R)[:, None] & cmask[None, :]
    mean_hi, mean_lo, rstd, w = _bn_channel(MEAN_HI, MEAN_LO, RSTD, W, c, cmask, HAS_W)
    offs = _bn_tile(r, c, S, sxn, sxs, sxc, MERGED)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((x - mean_hi[None, :]) - mean_lo[None, :]) * (rstd * w)[None, :]
    if HAS_B:
        y = y + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + _bn_tile(r, c, S, syn, sys_, syc, MERGED), y.to(Y.dtype.element_ty), mask=mask)


@_jit
def _bn_bwd_sums(
    X, DY, MEAN_HI, MEAN_LO, RSTD, PDY, PDYX,
    sxn, sxc, sxs, sdn, sdc, sds, C, S, R, rows_per_program, C_BLOCKS,
    MERGED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per chunk and channel: partial ``sum dy`` and ``sum dy * xhat``."""
    pid = tl.program_id(0).to(tl.int64)
    chunk = pid // C_BLOCKS
    c = (pid - chunk * C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    mean_hi, mean_lo, rstd, _ = _bn_channel(MEAN_HI, MEAN_LO, RSTD, RSTD, c, cmask, False)
    r_start = chunk * rows_per_program
    r_end = tl.minimum(r_start + rows_per_program, R)
    acc_dy = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc_dyx = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < r_end)[:, None] & cmask[None, :]
        offs = _bn_tile(r, c, S, sxn, sxs, sxc, MERGED)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        offs = _bn_tile(r, c, S, sdn, sds, sdc, MERGED)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, ((x - mean_hi[None, :]) - mean_lo[None, :]) * rstd[None, :], 0.0)
        acc_dy += dy
        acc_dyx += dy * xhat
    out = chunk * C + c
    tl.store(PDY + out, tl.sum(acc_dy, axis=0), mask=cmask)
    tl.store(PDYX + out, tl.sum(acc_dyx, axis=0), mask=cmask)


@_jit
def _bn_bwd_dx(
    X, DY, DX, W, MEAN_HI, MEAN_LO, RSTD, SUM_DY, SUM_DYX,
    sxn, sxc, sxs, sdn, sdc, sds, son, soc, sos, C, S, R, C_BLOCKS, inv_n,
    HAS_W: tl.constexpr, TRAIN: tl.constexpr, MERGED: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``dx = rstd * w * (dy - mean(dy) - xhat * mean(dy * xhat))`` in training (the
    statistics depend on x); ``dx = rstd * w * dy`` with fixed (running) statistics."""
    pid = tl.program_id(0).to(tl.int64)
    rb = pid // C_BLOCKS
    c = (pid - rb * C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (r < R)[:, None] & cmask[None, :]
    mean_hi, mean_lo, rstd, w = _bn_channel(MEAN_HI, MEAN_LO, RSTD, W, c, cmask, HAS_W)
    offs = _bn_tile(r, c, S, sdn, sds, sdc, MERGED)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    if TRAIN:
        offs = _bn_tile(r, c, S, sxn, sxs, sxc, MERGED)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = ((x - mean_hi[None, :]) - mean_lo[None, :]) * rstd[None, :]
        mean_dy = tl.load(SUM_DY + c, mask=cmask, other=0.0) * inv_n
        mean_dyx = tl.load(SUM_DYX + c, mask=cmask, other=0.0) * inv_n
        dy = dy - mean_dy[None, :] - xhat * mean_dyx[None, :]
    dx = dy * (rstd * w)[None, :]
    tl.store(DX + _bn_tile(r, c, S, son, sos, soc, MERGED), dx.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# GroupNorm of channels-innermost input (channels_last), over (N, C, S) with unit channel
# stride
#
# The per-(sample, group) kernels above read a group's CPG channels at each position:
# on channels-last input that is CPG * itemsize bytes out of every C * itemsize, a
# strided gather. Here a program reads [BLOCK_R positions, BLOCK_C channels] tiles of
# one sample, whole rows of channels (coalesced), as the BatchNorm kernels do, and the
# group statistics come from per-channel partials: each sample's S positions are split
# into K chunks of ``per_chunk``; a chunk's per-channel (mean, M2) (:func:`_chunk_moments`)
# are merged per (sample, group) by count in float64 (:func:`_gncl_merge`, Chan et al.,
# as :func:`_bn_merge`). Statistics: (N * G,) float32, as for the kernels above.
# --------------------------------------------------------------------------------------


@_jit
def _gncl_chunk(pid, C, K, per_chunk, S, C_BLOCKS, BLOCK_C: tl.constexpr):
    """Sample ``n``, chunk ``j``, its positions ``s_start .. s_end`` and channels ``c`` of
    program ``pid`` (chunk-major over the channel blocks)."""
    rest = pid // C_BLOCKS
    c = (pid - rest * C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = rest // K
    j = rest - n * K
    s_start = j * per_chunk
    return n, j, tl.minimum(s_start + per_chunk, S), s_start, c, c < C


@_jit
def _gncl_stats(
    X, PMEAN_HI, PMEAN_LO, PM2,
    sxn, sxc, sxs, C, S, K, per_chunk, C_BLOCKS,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per-channel compensated (mean, M2) of one chunk of one sample's positions; rows
    ``n * K + j`` of the ``(N * K, C)`` partials."""
    pid = tl.program_id(0).to(tl.int64)
    n, j, s_end, s_start, c, cmask = _gncl_chunk(pid, C, K, per_chunk, S, C_BLOCKS, BLOCK_C)
    mean_hi, mean_lo, m2 = _chunk_moments(X + n * sxn, s_start, s_end, c, cmask, S, sxn, sxs,
                                          sxc, True, BLOCK_R, BLOCK_C)
    out = (n * K + j) * C + c
    tl.store(PMEAN_HI + out, mean_hi, mask=cmask)
    tl.store(PMEAN_LO + out, mean_lo, mask=cmask)
    tl.store(PM2 + out, m2, mask=cmask)


@_jit
def _gncl_pass(PMEAN_HI, PMEAN_LO, PM2, base, mean, C, CPG, K, per_chunk, last,
               SECOND: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """A pass over the ``K x CPG`` chunk partials of one (sample, group) (from row
    ``base``), in float64: ``sum n_k m_k`` (first), or with ``SECOND``
    ``sum M2_k + n_k (m_k - mean)**2``."""
    acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float64)
    for c0 in range(0, CPG, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        for k0 in range(0, K, BLOCK_K):
            count, m, off, mask = _bn_parts(PMEAN_HI + base, PMEAN_LO + base, k0, cc, cc < CPG,
                                            C, K, last, per_chunk, BLOCK_K)
            if SECOND:
                d = m - mean
                term = (tl.load(PM2 + base + off, mask=mask, other=0.0).to(tl.float64)
                        + count[:, None] * d * d)
            else:
                term = count[:, None] * m
            acc += tl.where(mask, term, 0.0)
    return tl.sum(tl.sum(acc, axis=1), axis=0)


@_jit
def _gncl_merge(
    PMEAN_HI, PMEAN_LO, PM2, MEAN_HI, MEAN_LO, RSTD,
    G, C, CPG, S, K, per_chunk, last, eps,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Merge one (sample, group)'s ``K x CPG`` chunk partials by count, in float64, into
    its ``mean_hi``, ``mean_lo`` and ``rstd`` (the group's ``CPG * S`` values; every chunk
    holds ``per_chunk`` positions but the last, ``last``)."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // G
    g = pid - n * G
    base = n * K * C + g * CPG
    mean = _gncl_pass(PMEAN_HI, PMEAN_LO, PM2, base, 0.0, C, CPG, K, per_chunk, last, False,
                      BLOCK_K, BLOCK_C) / CPG / S
    var = _gncl_pass(PMEAN_HI, PMEAN_LO, PM2, base, mean, C, CPG, K, per_chunk, last, True,
                     BLOCK_K, BLOCK_C) / CPG / S
    mean_hi = mean.to(tl.float32)
    tl.store(MEAN_HI + pid, mean_hi)
    tl.store(MEAN_LO + pid, (mean - mean_hi.to(tl.float64)).to(tl.float32))
    tl.store(RSTD + pid, (1.0 / tl.sqrt(var + eps)).to(tl.float32))


@_jit
def _gncl_tile(pid, C, G, CPG, S, S_BLOCKS, C_BLOCKS, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """Sample ``n``, positions ``s``, channels ``c``, the tile's mask and each channel's
    (sample, group) index of program ``pid`` of the elementwise kernels."""
    rest = pid // C_BLOCKS
    c = (pid - rest * C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = rest // S_BLOCKS
    s = (rest - n * S_BLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)
    cmask = c < C
    mask = (s < S)[:, None] & cmask[None, :]
    return n, s, c, cmask, mask, n * G + c // CPG


@_jit
def _gncl_fwd(
    X, Y, W, B, MEAN_HI, MEAN_LO, RSTD,
    sxn, sxc, sxs, syn, syc, sys_, C, G, CPG, S, S_BLOCKS, C_BLOCKS,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``act(xhat * w + b)`` on one [BLOCK_R, BLOCK_C] tile of one sample."""
    pid = tl.program_id(0).to(tl.int64)
    n, s, c, cmask, mask, grp = _gncl_tile(pid, C, G, CPG, S, S_BLOCKS, C_BLOCKS, BLOCK_R,
                                           BLOCK_C)
    mean_hi = tl.load(MEAN_HI + grp, mask=cmask, other=0.0)
    mean_lo = tl.load(MEAN_LO + grp, mask=cmask, other=0.0)
    rstd = tl.load(RSTD + grp, mask=cmask, other=0.0)
    x = tl.load(X + n * sxn + _bn_tile(s, c, S, sxn, sxs, sxc, True), mask=mask,
                other=0.0).to(tl.float32)
    z = ((x - mean_hi[None, :]) - mean_lo[None, :]) * rstd[None, :]
    if HAS_W:
        z = z * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        z = z + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    z = _act(z, ACT)
    tl.store(Y + n * syn + _bn_tile(s, c, S, syn, sys_, syc, True), z.to(Y.dtype.element_ty),
             mask=mask)


@_jit
def _gncl_bwd_sums(
    X, DY, W, B, MEAN_HI, MEAN_LO, RSTD, PDZ, PDZX,
    sxn, sxc, sxs, sdn, sdc, sds, C, G, CPG, S, K, per_chunk, C_BLOCKS,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per channel, over one chunk of one sample's positions: partial ``sum dz`` and
    ``sum dz * xhat`` (``dz``: the gradient at the affine output, through the
    activation); rows ``n * K + j`` of the ``(N * K, C)`` partials."""
    pid = tl.program_id(0).to(tl.int64)
    n, j, s_end, s_start, c, cmask = _gncl_chunk(pid, C, K, per_chunk, S, C_BLOCKS, BLOCK_C)
    grp = n * G + c // CPG
    mean_hi = tl.load(MEAN_HI + grp, mask=cmask, other=0.0)[None, :]
    mean_lo = tl.load(MEAN_LO + grp, mask=cmask, other=0.0)[None, :]
    rstd = tl.load(RSTD + grp, mask=cmask, other=0.0)[None, :]
    acc_dz = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc_dzx = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for s0 in range(s_start, s_end, BLOCK_R):
        s = s0 + tl.arange(0, BLOCK_R)
        mask = (s < s_end)[:, None] & cmask[None, :]
        xhat, dz, _ = _gn_dz(X + n * sxn + _bn_tile(s, c, S, sxn, sxs, sxc, True),
                             DY + n * sdn + _bn_tile(s, c, S, sdn, sds, sdc, True), W, B,
                             mask, c, cmask, mean_hi, mean_lo, rstd, HAS_W, HAS_B, ACT)
        acc_dz += dz
        acc_dzx += dz * xhat
    out = (n * K + j) * C + c
    tl.store(PDZ + out, tl.sum(acc_dz, axis=0), mask=cmask)
    tl.store(PDZX + out, tl.sum(acc_dzx, axis=0), mask=cmask)


@_jit
def _gncl_bwd_reduce(
    PDZ, PDZX, W, C1, C2, DW, DB,
    G, C, CPG, K, inv_n,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (sample, group): its channels' sums over the K chunks, stored as the sample's
    rows of the ``(N, C)`` weight/bias gradient partials (those of the parameters given),
    and ``c1 = mean(g * xhat)``, ``c2 = mean(g)`` with ``g = dz * w`` (as
    :func:`_gn_bwd_sums` gives them)."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // G
    g = pid - n * G
    acc_gx = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, CPG, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        cmask = cc < CPG
        ch = g * CPG + cc
        dz = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
        dzx = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
            mask = (k < K)[:, None] & cmask[None, :]
            off = (n * K + k)[:, None] * C + ch[None, :]
            dz += tl.load(PDZ + off, mask=mask, other=0.0)
            dzx += tl.load(PDZX + off, mask=mask, other=0.0)
        sum_dz = tl.sum(dz, axis=0)
        sum_dzx = tl.sum(dzx, axis=0)
        if HAS_B:
            tl.store(DB + n * C + ch, sum_dz, mask=cmask)
        if HAS_W:
            tl.store(DW + n * C + ch, sum_dzx, mask=cmask)
            w = tl.load(W + ch, mask=cmask, other=0.0).to(tl.float32)
            sum_dz = sum_dz * w
            sum_dzx = sum_dzx * w
        acc_gx += sum_dzx
        acc_g += sum_dz
    tl.store(C1 + pid, tl.sum(acc_gx, axis=0) * inv_n)
    tl.store(C2 + pid, tl.sum(acc_g, axis=0) * inv_n)


@_jit
def _gncl_bwd_dx(
    X, DY, DX, W, B, MEAN_HI, MEAN_LO, RSTD, C1, C2,
    sxn, sxc, sxs, sdn, sdc, sds, son, soc, sos, C, G, CPG, S, S_BLOCKS, C_BLOCKS,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``dx = rstd * (dz * w - xhat * c1 - c2)`` on one [BLOCK_R, BLOCK_C] tile."""
    pid = tl.program_id(0).to(tl.int64)
    n, s, c, cmask, mask, grp = _gncl_tile(pid, C, G, CPG, S, S_BLOCKS, C_BLOCKS, BLOCK_R,
                                           BLOCK_C)
    mean_hi = tl.load(MEAN_HI + grp, mask=cmask, other=0.0)[None, :]
    mean_lo = tl.load(MEAN_LO + grp, mask=cmask, other=0.0)[None, :]
    rstd = tl.load(RSTD + grp, mask=cmask, other=0.0)[None, :]
    c1 = tl.load(C1 + grp, mask=cmask, other=0.0)[None, :]
    c2 = tl.load(C2 + grp, mask=cmask, other=0.0)[None, :]
    xhat, dz, w = _gn_dz(X + n * sxn + _bn_tile(s, c, S, sxn, sxs, sxc, True),
                         DY + n * sdn + _bn_tile(s, c, S, sdn, sds, sdc, True), W, B, mask,
                         c, cmask, mean_hi, mean_lo, rstd, HAS_W, HAS_B, ACT)
    dx = (dz * w[None, :] - xhat * c1 - c2) * rstd
    tl.store(DX + n * son + _bn_tile(s, c, S, son, sos, soc, True), dx.to(DX.dtype.element_ty),
             mask=mask)


# --------------------------------------------------------------------------------------
# Channels-first LayerNorm (LayerNorm2d of NCHW input) over (N, C, S) with any strides
#
# Each position ``p = n * S + s`` is normalized over its C channels, which lie ``sc``
# apart (NCHW: S apart), so a program takes a [BLOCK_C, BLOCK_S] tile: BLOCK_S
# neighbouring positions (contiguous along s for NCHW: coalesced loads) times the
# channels, reduced along axis 0. ``SINGLE``: every channel in one tile, read once;
# else the channels are walked in BLOCK_C chunks (statistics, then normalizing).
# Statistics: one float32 buffer, rows mean_hi, mean_lo, rstd of P = N * S values
# (:func:`_row_stat_rows`).
# --------------------------------------------------------------------------------------


@_jit
def _cf_positions(t, S, S_BLOCKS, BLOCK_S: tl.constexpr):
    """``(n, s, smask, p)`` of tile ``t`` (int64): its sample, its BLOCK_S positions in
    the sample, their mask and their flat numbers ``n * S + s``."""
    n = t // S_BLOCKS
    s = (t - n * S_BLOCKS) * BLOCK_S + tl.arange(0, BLOCK_S)
    return n, s, s < S, n * S + s


@_jit
def _cf_tile(n, s, c, C, S, sn, sc, ss):
    """int64 offsets of channels ``c`` ([BLOCK_C]) times positions ``s`` ([BLOCK_S]) of
    sample ``n``, and their mask."""
    mask = (c < C)[:, None] & (s < S)[None, :]
    offs = n * sn + c.to(tl.int64)[:, None] * sc + s[None, :] * ss
    return offs, mask


@_jit
def _cf_out(xhat, W, B, Y, n, s, c, C, S, syn, syc, sys_, HAS_W: tl.constexpr,
            HAS_B: tl.constexpr):
    """Store ``xhat * w[c] + b[c]`` (affine optional) into a [BLOCK_C, BLOCK_S] tile."""
    offs, mask = _cf_tile(n, s, c, C, S, syn, syc, sys_)
    y = xhat
    if HAS_W:
        y = y * tl.load(W + c, mask=c < C, other=0.0).to(tl.float32)[:, None]
    if HAS_B:
        y = y + tl.load(B + c, mask=c < C, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@_jit
def _cf_fwd(
    X, Y, W, B, STATS,
    sxn, sxc, sxs, syn, syc, sys_, C, S, P, S_BLOCKS, inv_c, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SINGLE: tl.constexpr,
    STORE_STATS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Normalize BLOCK_S positions of one sample over their channels (compensated
    two-pass moments, as the row kernels)."""
    MEAN_HI, MEAN_LO, RSTD = _row_stat_rows(STATS, P, True)
    n, s, smask, p = _cf_positions(tl.program_id(0).to(tl.int64), S, S_BLOCKS, BLOCK_S)
    if SINGLE:
        c = tl.arange(0, BLOCK_C)
        offs, mask = _cf_tile(n, s, c, C, S, sxn, sxc, sxs)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        mean_hi = tl.sum(x, axis=0) * inv_c
        d = tl.where(mask, x - mean_hi[None, :], 0.0)
        mean_lo = tl.sum(d, axis=0) * inv_c
        var = tl.sum(d * d, axis=0) * inv_c - mean_lo * mean_lo
        var = tl.where(var < 0.0, 0.0, var)
        rstd = 1.0 / tl.sqrt(var + eps)
        _cf_out((d - mean_lo[None, :]) * rstd[None, :], W, B, Y, n, s, c, C, S, syn, syc, sys_,
                HAS_W, HAS_B)
    else:
        acc = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            offs, mask = _cf_tile(n, s, c0 + tl.arange(0, BLOCK_C), C, S, sxn, sxc, sxs)
            acc += tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        mean_hi = tl.sum(acc, axis=0) * inv_c
        acc_d = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        acc_dd = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            offs, mask = _cf_tile(n, s, c0 + tl.arange(0, BLOCK_C), C, S, sxn, sxc, sxs)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - mean_hi[None, :], 0.0)
            acc_d += d
            acc_dd += d * d
        mean_lo = tl.sum(acc_d, axis=0) * inv_c
        var = tl.sum(acc_dd, axis=0) * inv_c - mean_lo * mean_lo
        var = tl.where(var < 0.0, 0.0, var)
        rstd = 1.0 / tl.sqrt(var + eps)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            offs, mask = _cf_tile(n, s, c, C, S, sxn, sxc, sxs)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = ((x - mean_hi[None, :]) - mean_lo[None, :]) * rstd[None, :]
            _cf_out(xhat, W, B, Y, n, s, c, C, S, syn, syc, sys_, HAS_W, HAS_B)
    if STORE_STATS:
        tl.store(MEAN_HI + p, mean_hi, mask=smask)
        tl.store(MEAN_LO + p, mean_lo, mask=smask)
        tl.store(RSTD + p, rstd, mask=smask)


@_jit
def _cf_xhat(X, MEAN_HI, MEAN_LO, RSTD, p, smask, offs, mask):
    """A [BLOCK_C, BLOCK_S] tile of ``(x - mean) * rstd`` in float32 (0 where masked)."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    mean_hi = tl.load(MEAN_HI + p, mask=smask, other=0.0)
    mean_lo = tl.load(MEAN_LO + p, mask=smask, other=0.0)
    rstd = tl.load(RSTD + p, mask=smask, other=0.0)
    return tl.where(mask, ((x - mean_hi[None, :]) - mean_lo[None, :]) * rstd[None, :], 0.0)


@_jit
def _cf_bwd_coeffs(
    X, DY, W, STATS, COEFFS,
    sxn, sxc, sxs, sdn, sdc, sds, C, S, P, S_BLOCKS, inv_c,
    HAS_W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Per position ``c1 = mean(g * xhat)`` and ``c2 = mean(g)`` over the channels,
    ``g = dy * w``, into the rows of ``COEFFS`` (``(2, P)``): for channels wider than one
    tile."""
    MEAN_HI, MEAN_LO, RSTD = _row_stat_rows(STATS, P, True)
    n, s, smask, p = _cf_positions(tl.program_id(0).to(tl.int64), S, S_BLOCKS, BLOCK_S)
    acc_gx = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        offs, mask = _cf_tile(n, s, c, C, S, sxn, sxc, sxs)
        xhat = _cf_xhat(X, MEAN_HI, MEAN_LO, RSTD, p, smask, offs, mask)
        d_offs, _ = _cf_tile(n, s, c, C, S, sdn, sdc, sds)
        g = tl.load(DY + d_offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(W + c, mask=c < C, other=0.0).to(tl.float32)[:, None]
        acc_gx += g * xhat
        acc_g += g
    tl.store(COEFFS + p, tl.sum(acc_gx, axis=0) * inv_c, mask=smask)
    tl.store(COEFFS + P + p, tl.sum(acc_g, axis=0) * inv_c, mask=smask)


@_jit
def _cf_bwd(
    X, DY, DX, W, STATS, COEFFS, PARTS,
    sxn, sxc, sxs, sdn, sdc, sds, son, soc, sos, C, S, P, S_BLOCKS, TILES, tiles_per_program,
    inv_c,
    HAS_W: tl.constexpr, STORE_DW: tl.constexpr, STORE_DB: tl.constexpr,
    SINGLE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Input gradient of channels-first LayerNorm, and per-program partial weight/bias
    gradients.

    ``dx = rstd * (g - xhat * c1 - c2)``, ``g = dy * w``, per position. Program ``q`` owns
    tiles ``[q * tiles_per_program, (q + 1) * tiles_per_program)`` (tile ``t``: sample
    ``t // S_BLOCKS``, positions block ``t % S_BLOCKS``) and row ``q`` of the
    ``(programs, C)`` float32 partials ``sum dy * xhat`` and ``sum dy`` in ``PARTS`` (dw's,
    then db's, as :func:`_row_bwd`). ``c1``/``c2`` from the tile itself when ``SINGLE``,
    else from :func:`_cf_bwd_coeffs`.
    """
    MEAN_HI, MEAN_LO, RSTD = _row_stat_rows(STATS, P, True)
    DW, DB = _partial_rows(PARTS, C, STORE_DW)
    q, t_start, t_end = _program_run(TILES, tiles_per_program)
    for c0 in range(0, C, BLOCK_C):
        c, cmask, w = _weight_chunk(W, c0, C, HAS_W, BLOCK_C)
        acc_dw = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        acc_db = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        for t in range(t_start, t_end):
            n, s, smask, p = _cf_positions(t, S, S_BLOCKS, BLOCK_S)
            offs, mask = _cf_tile(n, s, c, C, S, sxn, sxc, sxs)
            xhat = _cf_xhat(X, MEAN_HI, MEAN_LO, RSTD, p, smask, offs, mask)
            d_offs, _ = _cf_tile(n, s, c, C, S, sdn, sdc, sds)
            dy = tl.load(DY + d_offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                g = dy * w[:, None]
            else:
                g = dy
            if SINGLE:
                c1 = tl.sum(g * xhat, axis=0) * inv_c
                c2 = tl.sum(g, axis=0) * inv_c
            else:
                c1 = tl.load(COEFFS + p, mask=smask, other=0.0)
                c2 = tl.load(COEFFS + P + p, mask=smask, other=0.0)
            rstd = tl.load(RSTD + p, mask=smask, other=0.0)
            dx = (g - xhat * c1[None, :] - c2[None, :]) * rstd[None, :]
            o_offs, _ = _cf_tile(n, s, c, C, S, son, soc, sos)
            tl.store(DX + o_offs, dx.to(DX.dtype.element_ty), mask=mask)
            acc_dw += dy * xhat
            acc_db += dy
        if STORE_DW:
            tl.store(DW + q * C + c, tl.sum(acc_dw, axis=1), mask=cmask)
        if STORE_DB:
            tl.store(DB + q * C + c, tl.sum(acc_db, axis=1), mask=cmask)
