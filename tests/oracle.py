"""Test oracle: float64 references written independently of normkit, and tolerances.

Every normkit forward and gradient is compared with these plain two-pass float64
formulas computed on the *same* input (the input cast to float64), and, where torch
has the layer, with torch.nn in float64 as a second, independent oracle.
"""

from __future__ import annotations

import torch

# Per-dtype tolerances: max |actual - expected| <= atol + rtol * |expected|.
# float32/float64: the output's rounding plus a few ulps of accumulation.
# float16/bfloat16: the output is rounded to the input dtype (eps 9.8e-4 / 7.8e-3);
# statistics are float32, so the rounding of the output dominates.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# Gradients sum over many terms: compared relative to the largest reference value.
GRAD_TOL = {
    torch.float64: 1e-9,
    torch.float32: 5e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 4e-2,
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 what: str = "output") -> None:
    """Elementwise check with the per-dtype table; NaN must match NaN."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), equal_nan=True,
                               msg=lambda m: f"{what} ({dtype}): {m}", **tol)


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                      what: str = "grad") -> None:
    """Max error relative to the largest reference magnitude."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    actual, expected = actual.double(), expected.double()
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert err <= GRAD_TOL[dtype] * scale, (
        f"{what} ({dtype}): max error {err:.3e} (scale {scale:.3e})")


def normalize64(x: torch.Tensor, dims, weight=None, bias=None, eps=1e-5, center=True):
    """Plain two-pass normalization in float64; weight/bias already broadcastable."""
    x = x.double()
    if center:
        mean = x.mean(dims, keepdim=True)
        xc = x - mean
    else:
        xc = x
    var = (xc * xc).mean(dims, keepdim=True)
    y = xc / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def channel_view(p, ndim):
    return None if p is None else p.view((1, -1) + (1,) * (ndim - 2))


def reference_forward(module, x: torch.Tensor, input_dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
    """float64 output of a normkit module (in its current mode) computed independently.

    ``input_dtype`` is the dtype the module really saw (``x`` may be its float64 copy);
    it decides RMSNorm's ``eps=None`` (machine epsilon of float32, or of float64).
    """
    input_dtype = x.dtype if input_dtype is None else input_dtype
    name = type(module).__name__
    w = getattr(module, "weight", None)
    b = getattr(module, "bias", None)
    if name.startswith("BatchNorm"):
        wv, bv = channel_view(w, x.dim()), channel_view(b, x.dim())
        use_batch = module.training or module.running_mean is None
        if use_batch:
            return normalize64(x, (0, *range(2, x.dim())), wv, bv, module.eps)
        mean = channel_view(module.running_mean, x.dim()).double()
        var = channel_view(module.running_var, x.dim()).double()
        y = (x.double() - mean) / torch.sqrt(var + module.eps)
        return y * wv.double() + bv.double() if w is not None else y
    if name.startswith("InstanceNorm"):
        unbatched = x.dim() == int(name[-2]) + 1
        xb = x.unsqueeze(0) if unbatched else x
        wv, bv = channel_view(w, xb.dim()), channel_view(b, xb.dim())
        if module.training or not module.track_running_stats:
            y = normalize64(xb, tuple(range(2, xb.dim())), wv, bv, module.eps)
        else:
            mean = channel_view(module.running_mean, xb.dim()).double()
            var = channel_view(module.running_var, xb.dim()).double()
            y = (xb.double() - mean) / torch.sqrt(var + module.eps)
            y = y * wv.double() + bv.double() if w is not None else y
        return y.squeeze(0) if unbatched else y
    if name == "LayerNorm2d":
        return normalize64(x, (1,), channel_view(w, x.dim()), channel_view(b, x.dim()), module.eps)
    if name == "LayerNorm":
        k = len(module.normalized_shape)
        return normalize64(x, tuple(range(x.dim() - k, x.dim())), w, b, module.eps)
    if name == "RMSNorm":
        k = len(module.normalized_shape)
        eps = module.eps
        if eps is None:
            wide = input_dtype == torch.float64
            eps = torch.finfo(torch.float64 if wide else torch.float32).eps
        return normalize64(x, tuple(range(x.dim() - k, x.dim())), w, None, eps, center=False)
    if name == "GroupNormAct":  # (GroupNorm's oracle, then the activation in float64)
        act = {"relu": torch.relu, "identity": lambda t: t, "silu": torch.nn.functional.silu,
               "gelu": torch.nn.functional.gelu,
               "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, module.negative_slope),
               "elu": lambda t: torch.nn.functional.elu(t, module.alpha)}[module.act]
        plain = type("GroupNorm", (), {"num_groups": module.num_groups, "eps": module.eps,
                                       "weight": w, "bias": b})()
        return act(reference_forward(plain, x, input_dtype))
    if name == "GroupNorm":
        g = module.num_groups
        xg = x.unflatten(1, (g, x.shape[1] // g))
        y = normalize64(xg, tuple(range(2, xg.dim())), None, None, module.eps).flatten(1, 2)
        if w is not None:
            y = y * channel_view(w, x.dim()).double()
        if b is not None:
            y = y + channel_view(b, x.dim()).double()
        return y
    raise AssertionError(f"no oracle for {name}")
