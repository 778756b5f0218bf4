"""Differential fuzzing of the CPU dispatch under ``backend="auto"``.

normkit picks among torch's kernels, the slice-sums engine, blocked and folded sums, the
fused nodes and the compensated core by size, layout, dtype, thread count and the data's
``|mean| / std`` (thresholds at 2^18 elements, 8192 and 131072 values per channel, 512
positions, 64 MiB, the ratio bounds ...). The other tests check each path on shapes
chosen for it; this one draws mid-size inputs *across* those thresholds -- in every
layout a user hands over (contiguous, channels-last, strided views), at offsets on both
sides of the ratio bounds, at one and two threads -- and checks the output, the running
statistics and every gradient against float64 references written here, with the per-dtype
tolerances of ``oracle.py``. Whatever path serves a draw, it must be as accurate as the
others.

The same draws also check second derivatives (``create_graph=True``, as gradient
penalties and meta-learning use them): each fast path's double backward is code of its
own (a float32 reference differentiated by autograd), which first-order tests never run.

``HYPOTHESIS_PROFILE=explore`` (conftest.py) searches with fresh examples, and
``NORMKIT_FUZZ_EXAMPLES`` / ``NORMKIT_FUZZ_SECOND_ORDER_EXAMPLES`` set how many a run
draws (CI: the defaults below).
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import GRAD_TOL, assert_close, normalize64

import normkit

EXAMPLES = int(os.environ.get("NORMKIT_FUZZ_EXAMPLES", "60"))

#: Spatial sizes around the thresholds: prime position counts (no fold), 7x7 and 14x14
#: (small images), 32x32 and 56x56 (past 512 positions, folded sums), and sizes that put
#: a batch's values per channel on either side of 8192.
SPATIAL = [(7, 7), (13, 11), (14, 14), (17, 31), (32, 32), (45, 91), (56, 56), (64, 64)]
#: |mean| / std of the drawn data: centered, inside the engine's and kernels' bounds,
#: just past them, and far past (the compensated core).
RATIOS = [0.0, 1.0, 1.9, 2.6, 40.0, 3e3]
LAYOUTS = ["contiguous", "channels_last", "batch_strided", "channel_strided"]
ACTS = ["relu", "leaky_relu", "elu", "silu", "gelu", "identity"]
MAX_ELEMENTS = 1 << 21


def _act64(name: str, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The activation in float64. At ReLU's, LeakyReLU's and ELU's kink the side is the
    one the layer's own output ``out`` took: a pre-activation within rounding of zero may
    fall either way (a 16-bit output is rounded by ~4e-3), and the two sides' derivatives
    differ by the whole upstream gradient there (ELU's second derivatives by
    ``alpha``)."""
    if name == "relu":
        return torch.where(out > 0, y, 0.0)
    if name == "leaky_relu":  # (out > 0 exactly where y > 0; a -0.0 out is y's side < 0)
        return torch.where(out > 0, y, 0.01 * y)
    if name == "elu":
        # (at exactly 0, torch's ELU takes the negative side's first derivative, alpha = 1,
        # and the positive side's second, 0: y itself there; the positive side zeroed
        # before expm1, so no inf enters where's backward)
        return torch.where(out >= 0, y, torch.where(out >= 0, 0.0, y).expm1())
    if name == "silu":
        return torch.nn.functional.silu(y)
    if name == "gelu":
        return torch.nn.functional.gelu(y)
    return y


def _view(p, ndim):
    return None if p is None else p.view((1, -1) + (1,) * (ndim - 2))


def _affine(y, p, ndim):
    """``y * weight + bias`` per channel (dim 1) with whichever of the two ``p`` has."""
    if p.get("weight") is not None:
        y = y * _view(p["weight"], ndim)
    if p.get("bias") is not None:
        y = y + _view(p["bias"], ndim)
    return y


#: Which parameters a layer gets: both, none (``affine=False``), or a weight alone
#: (``bias=False``) where the layer has that option.
AFFINE = st.sampled_from(["both", "both", "none", "weight"])


def _affine_kwargs(kind: str, affine: str) -> dict:
    """Constructor arguments for ``affine`` ("weight" falls back to "both" where the
    layer has no ``bias=False``)."""
    if kind in ("layer_norm", "layer_norm2d", "add_layer_norm", "rms_norm", "add_rms_norm"):
        out = {"elementwise_affine": affine != "none"}
        if affine == "weight" and kind in ("layer_norm", "layer_norm2d", "add_layer_norm"):
            out["bias"] = False
        return out
    if kind in ("group_norm", "group_norm_act"):
        return {"affine": affine != "none", **({"bias": False} if affine == "weight" else {})}
    return {"affine": affine != "none"}


@st.composite
def image_batches(draw, max_elements=MAX_ELEMENTS):
    """``(shape, layout)`` of a 4D batch of at most ``max_elements`` elements."""
    h, w = draw(st.sampled_from(SPATIAL))
    c = draw(st.sampled_from([1, 3, 8, 16, 32, 64]))
    n = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32]))
    while n > 1 and n * c * h * w > max_elements:
        n //= 2
    if n * c * h * w > max_elements:
        c = max(1, max_elements // (n * h * w))
    return (n, c, h, w), draw(st.sampled_from(LAYOUTS))


@st.composite
def row_batches(draw, max_elements=MAX_ELEMENTS, widths=(1, 33, 256, 768, 1024, 4096)):
    """``(shape, layout)`` of a ``(rows, width)`` or ``(B, T, width)`` batch."""
    k = draw(st.sampled_from(widths))
    rows = draw(st.sampled_from([1, 7, 64, 256, 1024, 4096]))
    while rows > 1 and rows * k > max_elements:
        rows //= 2
    shape = (rows, k) if draw(st.booleans()) or rows % 4 else (4, rows // 4, k)
    return shape, draw(st.sampled_from(["contiguous", "batch_strided", "transposed"]))


def _make_input(shape, layout, dtype, ratio, gen):
    """float64 data of std ~1 and per-channel (dim 1) offsets ``ratio * U(0.7, 1.3)``,
    rounded to ``dtype`` and laid out as asked (a strided layout is a view into a larger
    buffer)."""
    full = list(shape)
    if layout == "batch_strided":
        full[0] *= 2
    elif layout == "channel_strided":
        full[1] *= 2
    elif layout == "transposed":
        full[0], full[1] = full[1], full[0]
    base = torch.randn(full, generator=gen, dtype=torch.float64)
    offsets = ratio * (0.7 + 0.6 * torch.rand(full[1], generator=gen, dtype=torch.float64))
    sign = torch.where(torch.rand(full[1], generator=gen) < 0.5, -1.0, 1.0).double()
    base = base + _view(offsets * sign, len(full))
    x = base.to(dtype)
    if layout == "batch_strided":
        x = x[::2]
    elif layout == "channel_strided":
        x = x[:, ::2]
    elif layout == "transposed":
        x = x.transpose(0, 1)
    elif layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    assert tuple(x.shape) == tuple(shape)
    return x


def _randomize(module, gen):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        if getattr(module, "running_mean", None) is not None:
            module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=gen))
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=gen) + 0.5)


class _TorchActivation(torch.nn.Module):
    """torch's own activation of a normkit BatchNormAct module (same name, slope, alpha)."""

    def __init__(self, module):
        super().__init__()
        self.name, self.slope, self.alpha = module.act, module.negative_slope, module.alpha

    def forward(self, y):
        fn = torch.nn.functional
        if self.name == "leaky_relu":
            return fn.leaky_relu(y, self.slope)
        if self.name == "elu":
            return fn.elu(y, self.alpha)
        return y if self.name == "identity" else getattr(fn, self.name)(y)


def _params64(module):
    return {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}


def _check_grad(actual, expected, dtype, what, terms=1, torch_error=None):
    """oracle.assert_grad_close's bound, relative to the largest reference value -- or,
    for a parameter's gradient, a sum of ``terms`` products of O(1) values, to
    ``sqrt(terms)``, the size such a sum has before it cancels (a float32 sum of 65520
    terms that cancel to -0.84 is off by ~3e-4 in torch's kernels as in any other).
    ``torch_error``: how far torch's own layers computing the same are from ``expected``
    on this case; up to :data:`TORCH_ERROR_SLACK` times that passes too (see
    :func:`_run_second_order`)."""
    scale = max(1.0, float(expected.abs().max()), terms ** 0.5) if expected.numel() else 1.0
    err = float((actual.double() - expected).abs().max()) if expected.numel() else 0.0
    bound = GRAD_TOL[dtype] * scale
    if torch_error is not None:
        bound = max(bound, TORCH_ERROR_SLACK * torch_error)
    assert err <= bound, (f"{what}: max error {err:.3e} (scale {scale:.3e}"
                          + ("" if torch_error is None else f", torch's {torch_error:.3e}")
                          + ")")


#: A second derivative may be this many times as far from float64 as torch's own layers'
#: on the same case. Products of several O(1) factors (upstream gradient, direction,
#: ``(weight * rstd)^2``, the activation's second derivative) are rounded to 16 bits in
#: the first derivatives, so 16-bit second derivatives are off by more than the
#: first-order tolerance in torch as in normkit: inference BatchNorm + SiLU in bfloat16
#: reaches 0.24 of the fuzz's scale, 30 times the dtype's epsilon, with torch's layers and
#: with normkit's alike (``python benchmarks/accuracy.py --second-order``;
#: benchmarks/ACCURACY.md, "Second derivatives in 16 bits"); float32 loses ~2e-4 of the
#: weight's second derivative at 40 std from the running statistics (xhat^2 ~1600).
TORCH_ERROR_SLACK = 1.5


def _run(module, x, reference, params64, dtype, what, inputs=None, extra=None, order=1,
         twin=None):
    """Forward and backward of ``module`` against ``reference(x64, params64)``; both take
    the same upstream gradient. ``inputs`` are the tensors fed to the module (default
    ``(x,)``); ``reference`` receives their float64 copies. ``order=2`` checks the
    second derivatives instead (:func:`_run_second_order`; ``twin``: torch's layers
    computing the same, for the second derivatives' bound)."""
    inputs = (x,) if inputs is None else inputs
    _set_backend(module)
    what = f"{what} backend {_BACKEND['name']}"
    if order == 2:
        _run_second_order(module, inputs, reference, params64, dtype, what, twin)
        return
    leaves, outs, leaves64, refs, grads = _forward_both(module, inputs, reference, params64)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_close(o.detach(), r.detach(), dtype, f"{what} output {i}")
        assert o.shape == r.shape
    torch.autograd.backward(list(outs), [g.to(o.dtype) for o, g in zip(outs, grads, strict=True)])
    torch.autograd.backward(list(refs), grads)
    for i, (t, t64) in enumerate(zip(leaves, leaves64, strict=True)):
        _check_grad(t.grad, t64.grad, dtype, f"{what} input {i} grad")
    for name, p in module.named_parameters():
        _check_grad(p.grad, params64[name].grad, dtype, f"{what} {name} grad",
                    terms=outs[0].numel() // max(1, p.numel()))
    if extra is not None:
        extra()


def _forward_both(module, inputs, reference, params64):
    """``(leaves, outs, leaves64, refs, grads)``: the module's outputs on fresh leaves of
    ``inputs``, the reference's on their float64 copies, and the upstream gradient of
    each output (float64 values rounded to its dtype, as the layer receives them)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = module(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    refs = reference(*leaves64, params64, outs[0].detach())
    refs = refs if isinstance(refs, tuple) else (refs,)
    gen = torch.Generator().manual_seed(GRAD_SEED)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype).double()
             for o in outs]
    return leaves, outs, leaves64, refs, grads


def _second_derivatives(outs, wrt, grads, directions):
    """The first derivatives of ``outs`` (against ``grads``, ``create_graph=True``), and
    the derivatives of ``sum(first * directions)`` with respect to ``wrt``."""
    first = torch.autograd.grad(outs, wrt, [g.to(o.dtype) for o, g in zip(outs, grads,
                                                                          strict=True)],
                                create_graph=True, allow_unused=True)
    total = sum((g.double() * v).sum() for g, v in zip(first, directions, strict=True)
                if g is not None and g.requires_grad)
    second = (torch.autograd.grad(total, wrt, allow_unused=True)
              if torch.is_tensor(total) and total.requires_grad else [None] * len(wrt))
    return first, second


def _run_second_order(module, inputs, reference, params64, dtype, what, twin=None):
    """Double backward (``create_graph=True``, as gradient penalties and meta-learning
    use it): the first derivatives ``g`` of the outputs against ``dy``, then the
    derivatives of ``sum(g * v)`` for fixed directions ``v``, of ``module`` against the
    float64 reference, every input and parameter. With ``twin`` (torch's layers computing
    the same, in the same dtypes, its parameters in ``module``'s order) a second
    derivative passes also within :data:`TORCH_ERROR_SLACK` times torch's own error on
    the case: in 16 bits (and in float32 far from the running statistics) these products
    lose more than the first-order tolerance in torch's layers as in normkit's."""
    names = [name for name, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]
    leaves, outs, leaves64, refs, grads = _forward_both(module, inputs, reference, params64)
    wrt, wrt64 = leaves + params, leaves64 + [params64[name] for name in names]
    gen = torch.Generator().manual_seed(DIRECTION_SEED)
    directions = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in wrt64]
    first, second = _second_derivatives(outs, wrt, grads, directions)
    first64, second64 = _second_derivatives(refs, wrt64, grads, directions)
    torch_second = [None] * len(wrt)
    if twin is not None:
        twin_leaves = [t.detach().requires_grad_() for t in inputs]
        twin_out = twin(*twin_leaves)
        twin_outs = twin_out if isinstance(twin_out, tuple) else (twin_out,)
        torch_second = _second_derivatives(twin_outs, twin_leaves + list(twin.parameters()),
                                           grads, directions)[1]
    labels = [f"input {i}" for i in range(len(leaves))] + names
    # a parameter's gradient sums over every position it scales: the size such a sum
    # has before it cancels (see _check_grad)
    terms = [1] * len(leaves) + [outs[0].numel() // max(1, p.numel()) for p in params]
    for g, g64, label, n in zip(first, first64, labels, terms, strict=True):
        assert (g is None) == (g64 is None), f"{what}: first derivative of {label}"
        if g is not None:
            _check_grad(g.detach(), g64.detach(), dtype, f"{what} {label} grad", terms=n)
    for h, h64, ht, t, t64, label, n in zip(second, second64, torch_second, wrt, wrt64,
                                            labels, terms, strict=True):
        h = torch.zeros_like(t64) if h is None else h
        h64 = torch.zeros_like(t64) if h64 is None else h64
        # (a group of a few nearly equal values has second derivatives past float16's
        # range, ~8e4 over 3 channels: a float16 gradient holds inf there, as it must)
        beyond = h64.abs() > torch.finfo(t.dtype).max
        assert bool(h[beyond].isinf().all()), f"{what} {label} second derivative"
        torch_error = None
        if twin is not None:
            ht = torch.zeros_like(t64) if ht is None else ht.double()
            torch_error = float((ht - h64).masked_fill(beyond, 0).abs().max())
        _check_grad(h.masked_fill(beyond, 0), h64.masked_fill(beyond, 0), dtype,
                    f"{what} {label} second derivative", terms=n, torch_error=torch_error)


def _settings():
    return settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


#: The speed rules (size floors and block sizes, not accuracy bounds), lowered so that
#: every fast path and every blocked loop runs on the drawn sizes.
FAST_EVERYWHERE = {
    "normkit.functional": {"SMALL_ROWS_COMPOSITE_BELOW": (0, 0)},
    "normkit.norms.fused": {"RMS_CHUNK_MIN_BYTES": 0, "RMS_CHUNK_BYTES": 1 << 12,
                            "FUSED_ACT_MIN_ELEMENTS": 0},
    "normkit.kernels.native": {"HALF_BACKWARD_BLOCK_BYTES": 1 << 12,
                               "LAYER_NORM_BLOCK_BYTES": 1 << 12,
                               "HALF_BACKWARD_ONE_CALL_BELOW": 0,
                               "EVAL_INPUT_GRAD_MIN_ELEMENTS": 0,
                               "EVAL_PER_SLICE_MIN_ELEMENTS": 0,
                               "BATCH_NORM_EVAL_ADDCMUL_MIN_ELEMENTS": 0,
                               "LAYER_NORM2D_MIN_ELEMENTS": 0,
                               "LAYER_NORM2D_MIN_POSITIONS": (0, 0),
                               "LAYER_NORM2D_MIN_POSITIONS_INFERENCE": (0, 0),
                               "LAYER_NORM2D_MIN_POSITIONS_16BIT_INFERENCE": (0, 0),
                               "LAYER_NORM2D_MIN_POSITIONS_16BIT": (0, 0),
                               "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS": (0, 0),
                               "LAYER_NORM2D_CHANNEL_SUMS_MIN_ELEMENTS_INFERENCE": (0, 0),
                               "INSTANCE_ROWS_MIN_SAMPLE_ELEMENTS": 0,
                               "FLOAT16_INSTANCE_VIEW_MIN_ELEMENTS": 0},
    "normkit.norms.batch": {"RENORM_BY_MOMENTS_MIN_ELEMENTS": 0},
    "normkit.kernels.channels": {"MIN_ELEMENTS": 0, "GROUP_NORM_MIN_POSITIONS": 0,
                                 "COLUMN_BLOCK_BYTES": 1 << 12},
    "normkit.kernels.memory": {"MIN_BYTES": 1 << 16},
}


#: The ``backend`` :func:`_run` gives the layers of the current draw (see _conditions).
_BACKEND = {"name": "auto"}


@contextlib.contextmanager
def _conditions(n_threads: int, fast_everywhere: bool, backend: str = "auto"):
    """``n_threads`` intra-op threads, if asked :data:`FAST_EVERYWHERE`, and the layers'
    ``backend`` (``"eager"``: normkit's compensated core always; ``"reference"``: its
    autograd-differentiated math)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    _BACKEND["name"] = backend
    with contextlib.ExitStack() as stack:
        if fast_everywhere:
            for module, values in FAST_EVERYWHERE.items():
                stack.enter_context(mock.patch.multiple(module, **values))
        try:
            yield
        finally:
            torch.set_num_threads(before)
            _BACKEND["name"] = "auto"


def _set_backend(module) -> None:
    for m in module.modules():
        if hasattr(m, "backend"):
            m.backend = _BACKEND["name"]


DTYPES = st.sampled_from([torch.float32] * 6 + [torch.float64, torch.bfloat16, torch.float16])


#: Seeds of the upstream gradients' and the second derivatives' directions' generators:
#: outside the data seeds' range (``COMMON_DRAWS``), so that neither is the input's own
#: noise. With 11 and 12, data seed 11 made the upstream gradient equal the input (an
#: explore run drew it): the input gradient is then what eps leaves of cancelling terms
#: (max 6e-5), and torch's float16 BatchNorm backward kernel, given the channels-last
#: input and this NCHW gradient, was 3.5e-3 to 5.1e-3 off it, past the 5e-3 tolerance
#: (normkit now hands the kernel the input's layout: 1.8e-5, ``native.batch_norm_kernel``).
GRAD_SEED, DIRECTION_SEED = 2**20 + 11, 2**20 + 12

#: What every test draws besides its batch.
COMMON_DRAWS = {"ratio": st.sampled_from(RATIOS), "dtype": DTYPES,
                "n_threads": st.sampled_from([1, 2]), "fast_everywhere": st.booleans(),
                "backend": st.sampled_from(["auto"] * 6 + ["eager", "reference"]),
                "seed": st.integers(0, 2**16), "data": st.data()}


def _16bit_draws(dtype, ratio, data):
    """``(ratio, parameter dtype)``: 16-bit input takes float32 parameters
    (``torch.autocast``'s case) or its own dtype, and at most 40 std of offset (at 3000
    a bfloat16 sample is nearly constant)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return ratio, dtype
    return min(ratio, 40.0), data.draw(st.sampled_from([torch.float32, dtype]))


@_settings()
@given(batch=image_batches(), **COMMON_DRAWS)
def test_image_layers_match_float64(batch, ratio, dtype, n_threads, fast_everywhere,
                                    backend, seed, data):
    """BatchNorm2d (training and eval, either running variance), BatchNormAct2d (both
    memory modes, training and eval), InstanceNorm2d, GroupNorm, GroupNormAct and
    LayerNorm2d on one drawn batch."""
    with _conditions(n_threads, fast_everywhere, backend):
        _image_case(batch, ratio, dtype, n_threads, seed, data)


def _image_case(batch, ratio, dtype, n_threads, seed, data, order=1):
    shape, layout = batch
    n, c = shape[:2]
    gen = torch.Generator().manual_seed(seed)
    ratio, param_dtype = _16bit_draws(dtype, ratio, data)
    x = _make_input(shape, layout, dtype, ratio, gen)
    kind = data.draw(st.sampled_from(["batch_norm", "batch_norm_eval", "batch_norm_act",
                                      "batch_norm_act_eval", "instance_norm", "group_norm",
                                      "group_norm_act", "layer_norm2d"]))
    what = (f"{kind} {tuple(shape)} {layout} {dtype} (parameters {param_dtype}) ratio "
            f"{ratio} threads {n_threads}")
    dims = (0, 2, 3)
    if kind in ("batch_norm", "batch_norm_eval", "batch_norm_act", "batch_norm_act_eval"):
        training = kind in ("batch_norm", "batch_norm_act")
        if training and n * shape[2] * shape[3] == 1:
            return  # one value per channel: torch's error case (test_bad_input covers it)
        act = data.draw(st.sampled_from(ACTS)) if kind.startswith("batch_norm_act") else None
        memory = "standard"
        if act in ("leaky_relu", "elu", "identity") and order == 1:
            # (memory="inplace" keeps no input: it refuses double backward by design)
            memory = data.draw(st.sampled_from(["standard", "inplace"]))
        unbiased = data.draw(st.booleans())
        kw = _affine_kwargs(kind, data.draw(AFFINE))
        module = (normkit.BatchNorm2d(c, **kw) if act is None else
                  normkit.BatchNormAct2d(c, act=act, memory=memory, **kw))
        module.unbiased_running_var = unbiased
        _randomize(module, gen)
        module = module.to(param_dtype)
        module.train(training)
        rm0, rv0 = module.running_mean.clone().double(), module.running_var.clone().double()
        what += f" act {act} memory {memory} unbiased {unbiased}"

        def reference(x64, p, out):
            if training:
                y = _affine(normalize64(x64, dims, None, None, module.eps), p, 4)
            else:
                y = _affine((x64 - _view(rm0, 4)) / torch.sqrt(_view(rv0, 4) + module.eps),
                            p, 4)
            return y if act is None else _act64(act, y, out)

        def running():
            if not training:
                assert torch.equal(module.running_mean.double(), rm0), what
                return
            x64 = x.double()
            count = x64.numel() // c
            mean = x64.mean(dims)
            var = x64.var(dims, correction=1 if unbiased and count > 1 else 0)
            # 16-bit buffers: torch's own update rounds each of its three steps (up to
            # 2.2 ulps off, as normkit's)
            rtol = {torch.float64: 1e-9, torch.float32: 2e-5}.get(
                param_dtype, 3 * torch.finfo(param_dtype).eps)
            torch.testing.assert_close(module.running_mean.double(), 0.9 * rm0 + 0.1 * mean,
                                       rtol=rtol, atol=rtol, msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(module.running_var.double(), 0.9 * rv0 + 0.1 * var,
                                       rtol=rtol, atol=rtol * (1 + ratio * ratio),
                                       msg=lambda m: f"{what}: {m}")

        twin = None
        if order == 2:  # torch's BatchNorm2d (then the activation), same state and dtypes
            twin = torch.nn.BatchNorm2d(c, affine=module.affine).to(param_dtype)
            twin.load_state_dict(module.state_dict())
            twin.train(training)
            if act is not None:
                twin = torch.nn.Sequential(twin, _TorchActivation(module))
        _run(module, x, reference, _params64(module), dtype, what, extra=running, order=order,
             twin=twin)
        return
    kw = _affine_kwargs(kind, data.draw(AFFINE))
    if kind == "instance_norm":
        module = normkit.InstanceNorm2d(c, **kw)

        def reference(x64, p, out):
            return _affine(normalize64(x64, (2, 3), None, None, module.eps), p, 4)
    elif kind in ("group_norm", "group_norm_act"):
        groups = data.draw(st.sampled_from([g for g in (1, 2, 4, 8, 32, c) if c % g == 0]))
        act = data.draw(st.sampled_from(ACTS)) if kind == "group_norm_act" else None
        if n * c // groups * shape[2] * shape[3] == 1:
            return
        module = (normkit.GroupNorm(groups, c, **kw) if act is None else
                  normkit.GroupNormAct(groups, c, act=act, **kw))
        what += f" groups {groups} act {act}"

        def reference(x64, p, out):
            xg = x64.unflatten(1, (groups, c // groups))
            y = normalize64(xg, (2, 3, 4), None, None, module.eps).flatten(1, 2)
            y = _affine(y, p, 4)
            return y if act is None else _act64(act, y, out)
    else:
        module = normkit.LayerNorm2d(c, **kw)

        def reference(x64, p, out):
            return _affine(normalize64(x64, (1,), None, None, module.eps), p, 4)
    _randomize(module, gen)
    module = module.to(param_dtype)
    _run(module, x, reference, _params64(module), dtype, what, order=order)


@_settings()
@given(batch=row_batches(), **COMMON_DRAWS)
def test_row_layers_match_float64(batch, ratio, dtype, n_threads, fast_everywhere, backend,
                                  seed, data):
    """LayerNorm, RMSNorm, AddLayerNorm, AddRMSNorm and BatchNorm1d (over rows) on one
    drawn batch of rows."""
    with _conditions(n_threads, fast_everywhere, backend):
        _row_case(batch, ratio, dtype, n_threads, seed, data)


def _row_case(batch, ratio, dtype, n_threads, seed, data, order=1):
    shape, layout = batch
    k = shape[-1]
    gen = torch.Generator().manual_seed(seed)
    ratio, param_dtype = _16bit_draws(dtype, ratio, data)
    kind = data.draw(st.sampled_from(["layer_norm", "rms_norm", "add_layer_norm",
                                      "add_rms_norm", "batch_norm1d"]))
    # offsets per row (LayerNorm's groups) or, for BatchNorm1d, per channel (the last dim)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    groups = (k,) if kind == "batch_norm1d" else shape[:-1] + (1,)
    x = (x + ratio * (0.7 + 0.6 * torch.rand(groups, generator=gen, dtype=torch.float64))
         ).to(dtype)
    if layout == "batch_strided":  # every other row of a buffer twice the size
        x = torch.stack([x, torch.zeros_like(x)], 1).flatten(0, 1)[::2]
    elif layout == "transposed":  # (T, B, D) memory seen batch-first, or column-major rows
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    what = (f"{kind} {tuple(shape)} {layout} {dtype} (parameters {param_dtype}) ratio "
            f"{ratio} threads {n_threads}")
    rms = kind in ("rms_norm", "add_rms_norm")
    eps = data.draw(st.sampled_from([None, 1e-6])) if rms else 1e-5
    eps64 = eps if eps is not None else torch.finfo(
        torch.float64 if dtype == torch.float64 else torch.float32).eps
    kw = _affine_kwargs(kind, data.draw(AFFINE))
    if kind == "batch_norm1d":
        if x.dim() != 2 or shape[0] == 1:
            return
        module = normkit.BatchNorm1d(k, **kw)

        def reference(x64, p, out):
            return normalize64(x64, (0,), p.get("weight"), p.get("bias"), module.eps)
    elif kind in ("layer_norm", "rms_norm"):
        module = normkit.LayerNorm(k, **kw) if not rms else normkit.RMSNorm(k, eps=eps, **kw)

        def reference(x64, p, out):
            return normalize64(x64, (-1,), p.get("weight"), p.get("bias"), eps64,
                               center=not rms)
    else:
        module = (normkit.AddLayerNorm(k, **kw) if not rms else
                  normkit.AddRMSNorm(k, eps=eps, **kw))
        residual = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)

        def reference(x64, r64, p, out):
            # the new residual is rounded to the residual stream's dtype, and the norm
            # sees the rounded sum (its rounding, ~6e-5 of a value near 1000 in
            # float32, is the caller's precision, not the norm's error)
            s = x64 + r64
            s = s + ((x + residual).double() - s).detach()
            return normalize64(s, (-1,), p.get("weight"), p.get("bias"), eps64,
                               center=not rms), s

        _randomize(module, gen)
        module = module.to(param_dtype)
        _run(module, x, reference, _params64(module), dtype, what, inputs=(x, residual),
             order=order)
        return
    _randomize(module, gen)
    module = module.to(param_dtype)
    _run(module, x, reference, _params64(module), dtype, what, order=order)


@st.composite
def other_batches(draw, max_elements=MAX_ELEMENTS):
    """``(kind, shape, layout)`` for the layers and ranks the two tests above leave out."""
    kind = draw(st.sampled_from([
        "batch_norm1d_3d", "batch_norm3d", "instance_norm3d", "group_norm_5d",
        "instance_norm_running", "batch_renorm", "frozen_batch_norm",
        "batch_norm_cumulative", "batch_norm_act_rows", "batch_norm_act3d",
        "layer_norm_2dims", "rms_norm_2dims"]))
    n = draw(st.sampled_from([1, 2, 4, 8, 16]))
    c = draw(st.sampled_from([1, 3, 8, 32]))
    if kind in ("batch_norm3d", "instance_norm3d", "group_norm_5d", "batch_norm_act3d"):
        spatial = draw(st.sampled_from([(2, 7, 7), (4, 14, 14), (8, 16, 16), (3, 17, 13)]))
        layouts = ["contiguous", "channels_last_3d", "batch_strided"]
    elif kind in ("batch_norm1d_3d", "layer_norm_2dims", "rms_norm_2dims"):
        spatial = (draw(st.sampled_from([7, 64, 500, 4096])),)
        layouts = ["contiguous", "transposed", "batch_strided"]
    elif kind == "batch_norm_act_rows":  # 2D rows on either side of 8192
        n, spatial = draw(st.sampled_from([64, 4096, 8193, 20000])), ()
        layouts = ["contiguous", "batch_strided"]
    else:
        spatial = draw(st.sampled_from(SPATIAL))
        layouts = LAYOUTS
    shape = (n, c, *spatial)
    while n > 1 and torch.Size(shape).numel() > max_elements:
        n //= 2
        shape = (n, c, *spatial)
    return kind, shape, draw(st.sampled_from(layouts))


def _other_input(shape, layout, dtype, ratio, gen):
    """:func:`_make_input` for any rank: ``channels_last_3d`` and ``transposed`` (the
    ``(N, L, C)`` memory of a sequence seen as ``(N, C, L)``) too."""
    if layout == "channels_last_3d":
        x = _make_input(shape, "contiguous", dtype, ratio, gen)
        return x.contiguous(memory_format=torch.channels_last_3d)
    if layout == "transposed":
        x = _make_input(shape, "contiguous", dtype, ratio, gen)
        return x.transpose(1, -1).contiguous().transpose(1, -1)
    return _make_input(shape, layout, dtype, ratio, gen)


@_settings()
@given(batch=other_batches(), **COMMON_DRAWS)
def test_other_layers_and_ranks_match_float64(batch, ratio, dtype, n_threads,
                                              fast_everywhere, backend, seed, data):
    """BatchNorm1d on ``(N, C, L)``, BatchNorm3d, InstanceNorm3d and GroupNorm on 5D input
    (channels_last_3d too), InstanceNorm with running statistics, Batch Renormalization
    past its warm-up, FrozenBatchNorm2d, BatchNorm with a cumulative average
    (``momentum=None``), BatchNormAct1d on 2D rows around 8192, BatchNormAct3d, LayerNorm
    and RMSNorm over two trailing dims."""
    with _conditions(n_threads, fast_everywhere, backend):
        _other_case(batch, ratio, dtype, n_threads, seed, data)


def _other_case(batch, ratio, dtype, n_threads, seed, data, order=1):
    kind, shape, layout = batch
    n, c = shape[:2]
    gen = torch.Generator().manual_seed(seed)
    ratio, param_dtype = _16bit_draws(dtype, ratio, data)
    x = _other_input(shape, layout, dtype, ratio, gen)
    nd = x.dim()
    what = (f"{kind} {tuple(shape)} {layout} {dtype} (parameters {param_dtype}) ratio "
            f"{ratio} threads {n_threads}")
    spatial = tuple(range(2, nd))
    per_channel = (0, *spatial)
    count = x.numel() // c
    if kind in ("batch_norm1d_3d", "batch_norm3d", "batch_norm_cumulative",
                "batch_norm_act_rows", "batch_norm_act3d", "batch_renorm"):
        if count <= 1:
            return
        act = data.draw(st.sampled_from(ACTS)) if kind.startswith("batch_norm_act") else None
        if kind == "batch_norm_act_rows":
            module = normkit.BatchNormAct1d(c, act=act)
        elif kind == "batch_norm_act3d":
            module = normkit.BatchNormAct3d(c, act=act)
        elif kind == "batch_renorm":
            module = normkit.BatchRenorm2d(c, warmup_steps=0, r_max_steps=1, d_max_steps=1)
        else:
            module = {2: normkit.BatchNorm1d, 3: normkit.BatchNorm1d, 4: normkit.BatchNorm2d,
                      5: normkit.BatchNorm3d}[nd](
                c, momentum=None if kind == "batch_norm_cumulative" else 0.1)
        _randomize(module, gen)
        module = module.to(param_dtype)
        if kind == "batch_renorm":
            module.num_batches_tracked.fill_(5)  # past the warm-up: limits (3, 5)
        elif kind == "batch_norm_cumulative":
            module.num_batches_tracked.fill_(3)  # the fourth batch: factor 1/4
        rm0, rv0 = module.running_mean.clone().double(), module.running_var.clone().double()
        factor = 0.25 if kind == "batch_norm_cumulative" else 0.1

        def reference(x64, p, out):
            y = normalize64(x64, per_channel, None, None, module.eps)
            if kind == "batch_renorm":  # r and d from the batch, gradients stopped
                mean = x64.detach().mean(per_channel)
                std = torch.sqrt(x64.detach().var(per_channel, correction=0) + module.eps)
                sigma = torch.sqrt(rv0 + module.eps)
                r = (std / sigma).clamp(1 / 3.0, 3.0)
                d = ((mean - rm0) / sigma).clamp(-5.0, 5.0)
                y = y * _view(r, nd) + _view(d, nd)
            y = _affine(y, p, nd)
            return y if act is None else _act64(act, y, out)

        def running():
            x64 = x.double()
            want_mean = (1 - factor) * rm0 + factor * x64.mean(per_channel)
            want_var = (1 - factor) * rv0 + factor * x64.var(per_channel, correction=1)
            rtol = {torch.float64: 1e-9, torch.float32: 2e-5}.get(
                param_dtype, 3 * torch.finfo(param_dtype).eps)
            torch.testing.assert_close(module.running_mean.double(), want_mean, rtol=rtol,
                                       atol=rtol, msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(module.running_var.double(), want_var, rtol=rtol,
                                       atol=rtol * (1 + ratio * ratio),
                                       msg=lambda m: f"{what}: {m}")

        _run(module, x, reference, _params64(module), dtype, what, extra=running, order=order)
        return
    extra = None
    if kind in ("instance_norm3d", "instance_norm_running"):
        if x[0, 0].numel() <= 1:
            return
        tracked = kind == "instance_norm_running"
        cls = {3: normkit.InstanceNorm1d, 4: normkit.InstanceNorm2d,
               5: normkit.InstanceNorm3d}[nd]
        module = cls(c, affine=True, track_running_stats=tracked)
        training = not tracked or data.draw(st.booleans())
        _randomize(module, gen)
        module = module.to(param_dtype).train(training)
        if tracked:
            rm0, rv0 = module.running_mean.clone().double(), module.running_var.clone().double()

        def reference(x64, p, out):
            if training:
                y = normalize64(x64, spatial, None, None, module.eps)
            else:
                y = (x64 - _view(rm0, nd)) / torch.sqrt(_view(rv0, nd) + module.eps)
            return _affine(y, p, nd)

        if tracked and training:
            def extra():  # torch's rule: the per-instance statistics averaged over N
                x64 = x.double()
                want_mean = 0.9 * rm0 + 0.1 * x64.mean(spatial).mean(0)
                want_var = 0.9 * rv0 + 0.1 * x64.var(spatial, correction=1).mean(0)
                rtol = {torch.float64: 1e-9, torch.float32: 2e-5}.get(
                    param_dtype, 3 * torch.finfo(param_dtype).eps)
                torch.testing.assert_close(module.running_mean.double(), want_mean,
                                           rtol=rtol, atol=rtol, msg=lambda m: f"{what}: {m}")
                torch.testing.assert_close(module.running_var.double(), want_var,
                                           rtol=rtol, atol=rtol * (1 + ratio * ratio),
                                           msg=lambda m: f"{what}: {m}")
    elif kind == "group_norm_5d":
        groups = data.draw(st.sampled_from([g for g in (1, 2, 4, 8, c) if c % g == 0]))
        if x[0].numel() // groups <= 1:
            return
        module = normkit.GroupNorm(groups, c)
        _randomize(module, gen)
        module = module.to(param_dtype)

        def reference(x64, p, out):
            xg = x64.unflatten(1, (groups, c // groups))
            y = normalize64(xg, tuple(range(2, nd + 1)), None, None, module.eps).flatten(1, 2)
            return _affine(y, p, nd)
    elif kind == "frozen_batch_norm":
        module = normkit.FrozenBatchNorm2d(c).to(param_dtype)
        with torch.no_grad():
            module.weight.copy_(torch.rand(c, generator=gen) + 0.5)
            module.bias.copy_(torch.randn(c, generator=gen))
            module.running_mean.copy_(torch.randn(c, generator=gen) + ratio)
            module.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
        buffers = {k: getattr(module, k).double() for k in
                   ("weight", "bias", "running_mean", "running_var")}

        def reference(x64, p, out):
            b = buffers
            y = (x64 - _view(b["running_mean"], nd)) / torch.sqrt(
                _view(b["running_var"], nd) + module.eps)
            return y * _view(b["weight"], nd) + _view(b["bias"], nd)
    else:  # LayerNorm / RMSNorm over the last two dims of (N, C, L)
        rms = kind == "rms_norm_2dims"
        shape2 = tuple(shape[-2:])
        module = normkit.RMSNorm(shape2) if rms else normkit.LayerNorm(shape2)
        _randomize(module, gen)
        module = module.to(param_dtype)
        eps64 = module.eps if module.eps is not None else torch.finfo(
            torch.float64 if dtype == torch.float64 else torch.float32).eps

        def reference(x64, p, out):
            return normalize64(x64, (-2, -1), p.get("weight"), p.get("bias"), eps64,
                               center=not rms)
    _run(module, x, reference, _params64(module), dtype, what, extra=extra, order=order)


#: Examples per second-derivative test (each runs two double backwards).
SECOND_ORDER_EXAMPLES = int(os.environ.get("NORMKIT_FUZZ_SECOND_ORDER_EXAMPLES", "25"))
#: Largest second-derivative draw: past the slice-sums engine's 2^18-element floor.
SECOND_ORDER_MAX_ELEMENTS = 1 << 19


def _second_order_settings():
    return settings(max_examples=SECOND_ORDER_EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_second_order_settings()
@given(batch=image_batches(SECOND_ORDER_MAX_ELEMENTS), **COMMON_DRAWS)
def test_image_layers_second_derivatives(batch, ratio, dtype, n_threads, fast_everywhere,
                                         backend, seed, data):
    """Double backward of the image layers on every path a draw selects: the fast paths'
    ``create_graph=True`` branches differentiate reference math of their own, which the
    first-order tests never run."""
    with _conditions(n_threads, fast_everywhere, backend):
        _image_case(batch, ratio, dtype, n_threads, seed, data, order=2)


@_second_order_settings()
@given(batch=row_batches(SECOND_ORDER_MAX_ELEMENTS, widths=(33, 256, 768, 1024, 4096)),
       **COMMON_DRAWS)
def test_row_layers_second_derivatives(batch, ratio, dtype, n_threads, fast_everywhere,
                                       backend, seed, data):
    """Double backward of LayerNorm, RMSNorm, AddLayerNorm, AddRMSNorm and BatchNorm1d."""
    with _conditions(n_threads, fast_everywhere, backend):
        _row_case(batch, ratio, dtype, n_threads, seed, data, order=2)


@_second_order_settings()
@given(batch=other_batches(SECOND_ORDER_MAX_ELEMENTS), **COMMON_DRAWS)
def test_other_layers_second_derivatives(batch, ratio, dtype, n_threads, fast_everywhere,
                                         backend, seed, data):
    """Double backward of the other layers and ranks."""
    with _conditions(n_threads, fast_everywhere, backend):
        _other_case(batch, ratio, dtype, n_threads, seed, data, order=2)


class _Draws:
    """Fixed answers to a case's ``data.draw`` calls, in order: a found example, kept."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


def test_found_bn_act_double_backward_takes_the_forward_kink_side():
    """Found by the second-derivative fuzz: BatchNormAct's ``create_graph=True`` backward
    recomputed ReLU on a float32 reference of a float16 forward, so a pre-activation
    within rounding of zero could take the other side of the kink than the forward's
    output did (input gradient 0.87 off there). ``Activation.as_taken`` keeps the
    forward's side."""
    with _conditions(1, False):
        _image_case(((1, 64, 64, 64), "channels_last"), 1.0, torch.float16, 1, 147,
                    _Draws(torch.float32, "batch_norm_act", "relu", False, "both"), order=2)


class _Functional(torch.nn.Module):
    """A functional op with any of its parameters -- a bias without a weight too, which no
    module builds -- as a module :func:`_run` can drive."""

    def __init__(self, fn, weight, bias):
        super().__init__()
        self.fn = fn
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None:
                self.register_parameter(name, torch.nn.Parameter(p))

    def forward(self, *inputs):
        return self.fn(*inputs, getattr(self, "weight", None), getattr(self, "bias", None))


FUNCTIONAL_EXAMPLES = int(os.environ.get("NORMKIT_FUZZ_FUNCTIONAL_EXAMPLES", "40"))


@settings(max_examples=FUNCTIONAL_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(op=st.sampled_from(["batch_norm", "batch_norm_eval", "instance_norm", "group_norm",
                           "layer_norm", "layer_norm2d", "add_layer_norm", "rms_norm",
                           "batch_norm_act", "group_norm_act"]),
       params=st.sampled_from(["none", "weight", "bias", "both"]),
       large=st.booleans(), channels_last=st.booleans(), order=st.sampled_from([1, 2]),
       ratio=st.sampled_from([0.0, 1.0, 40.0]), dtype=DTYPES,
       seed=st.integers(0, 2**16), data=st.data())
def test_functional_parameter_combinations(op, params, large, channels_last, order, ratio,
                                           dtype, seed, data):
    """The functional API with every combination of parameters (a bias without a weight
    is the functional API's alone: torch's LayerNorm, BatchNorm and GroupNorm kernels
    each failed on it somewhere), first and second derivatives."""
    from normkit import functional as NF
    from normkit.norms import fused

    gen = torch.Generator().manual_seed(seed)
    rows = op in ("layer_norm", "add_layer_norm", "rms_norm")
    if params in ("bias", "both") and op == "rms_norm":
        params = "weight"  # (RMSNorm has no bias)
    ratio, param_dtype = _16bit_draws(dtype, ratio, data)
    shape = ((512, 768) if large else (64, 33)) if rows else (
        (16, 16, 32, 32) if large else (4, 6, 5, 5))
    k = shape[-1] if rows else shape[1]
    x = _make_input(shape, "channels_last" if channels_last and not rows else "contiguous",
                    dtype, ratio, gen)
    weight = (torch.rand(k, generator=gen) + 0.5 if params in ("weight", "both") else None)
    bias = (torch.randn(k, generator=gen) * 0.5 if params in ("bias", "both") else None)
    weight, bias = (None if p is None else p.to(param_dtype) for p in (weight, bias))
    rm = torch.randn(k, generator=gen, dtype=torch.float64) * 0.1
    rv = torch.rand(k, generator=gen, dtype=torch.float64) + 0.5
    nd = x.dim()
    act = data.draw(st.sampled_from(ACTS)) if op.endswith("_act") else None
    what = (f"{op} {shape} channels_last {channels_last} {dtype} (parameters {param_dtype}) "
            f"params {params} ratio {ratio} order {order} act {act}")
    inputs = (x,)
    if op == "batch_norm":
        def fn(x, w, b):
            return NF.batch_norm(x, None, None, w, b, True)
    elif op == "batch_norm_eval":
        def fn(x, w, b):
            return NF.batch_norm(x, rm.to(param_dtype), rv.to(param_dtype), w, b, False)
    elif op == "instance_norm":
        def fn(x, w, b):
            return NF.instance_norm(x, None, None, w, b)
    elif op == "group_norm":
        def fn(x, w, b):
            return NF.group_norm(x, 2, w, b)
    elif op == "layer_norm":
        def fn(x, w, b):
            return NF.layer_norm(x, (k,), w, b)
    elif op == "layer_norm2d":
        def fn(x, w, b):
            return NF.layer_norm2d(x, w, b)
    elif op == "rms_norm":
        def fn(x, w, b):
            return NF.rms_norm(x, (k,), w, 1e-6)
    elif op == "add_layer_norm":
        residual = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        inputs = (x, residual)

        def fn(x, r, w, b):
            return NF.add_layer_norm(x, r, (k,), w, b)
    elif op == "batch_norm_act":
        def fn(x, w, b):
            return fused.batch_norm_act(x, None, None, w, b, True, act=act)
    else:
        def fn(x, w, b):
            return fused.group_norm_act(x, 2, w, b, act=act)
    module = _Functional(fn, weight, bias)

    def reference(*args):
        *xs, p, out = args
        x64 = xs[0] if op != "add_layer_norm" else xs[0] + xs[1]
        if op == "add_layer_norm":  # (the norm sees the rounded sum: see _row_case)
            x64 = x64 + ((x + residual).double() - x64).detach()
        if op == "batch_norm_eval":  # (the statistics as the op got them, rounded)
            mean, var = (t.to(param_dtype).double() for t in (rm, rv))
            y = (x64 - _view(mean, nd)) / torch.sqrt(_view(var, nd) + 1e-5)
        elif op in ("group_norm", "group_norm_act"):
            y = normalize64(x64.unflatten(1, (2, k // 2)), (2, 3, 4)).flatten(1, 2)
        elif op == "instance_norm":
            y = normalize64(x64, (2, 3))
        elif op == "layer_norm2d":
            y = normalize64(x64, (1,))
        elif rows:
            y = normalize64(x64, (-1,), None, None, 1e-6 if op == "rms_norm" else 1e-5,
                            center=op != "rms_norm")
        else:
            y = normalize64(x64, (0, 2, 3))
        y = _affine(y, p, nd) if not rows else y * (p["weight"] if "weight" in p else 1) + (
            p["bias"] if "bias" in p else 0)
        y = _act64(act, y, out) if op.endswith("_act") else y
        return (y, x64) if op == "add_layer_norm" else y

    with _conditions(1, False):
        _run(module, x, reference, _params64(module), dtype, what, inputs=inputs,
             order=order)
