"""Property tests: random shapes against the oracle, and the invariances of each family."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_close, reference_forward

import normkit

size = st.integers(min_value=1, max_value=6)


@st.composite
def channels_first_input(draw, min_spatial=0, max_spatial=3):
    n = draw(st.integers(1, 5))
    c = draw(st.integers(1, 8))
    spatial = draw(st.lists(size, min_size=min_spatial, max_size=max_spatial))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn((n, c, *spatial), generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    offset = draw(st.sampled_from([0.0, 10.0, -1e4]))
    return (x * scale + offset).float()


@settings(max_examples=60, deadline=None)
@given(x=channels_first_input(), data=st.data())
def test_random_shapes_match_oracle(x, data):
    c = x.shape[1]
    groups = data.draw(st.sampled_from([g for g in range(1, c + 1) if c % g == 0]))
    modules = [normkit.GroupNorm(groups, c), normkit.LayerNorm2d(c),
               normkit.LayerNorm(x.shape[-1]), normkit.RMSNorm(x.shape[-1])]
    per_channel = x.numel() // c
    if x.dim() in (2, 3) and per_channel > 1:
        modules.append(normkit.BatchNorm1d(c))
    if x.dim() == 4 and per_channel > 1:
        modules.append(normkit.BatchNorm2d(c))
    if x.dim() >= 3 and x[0, 0].numel() > 1:
        modules.append(normkit.InstanceNorm1d(c) if x.dim() == 3 else
                       normkit.InstanceNorm2d(c) if x.dim() == 4 else normkit.InstanceNorm3d(c))
    if groups == 1 and x.numel() == x.shape[0]:  # one value per group: torch's error case
        modules = modules[1:]
    for module in modules:
        if isinstance(module, normkit.GroupNorm) and x.shape[0] * x[0].numel() // groups == 1:
            continue
        y = module(x)
        ref = reference_forward(module, x.double(), input_dtype=x.dtype)
        assert_close(y, ref, torch.float32, type(module).__name__)


@settings(max_examples=40, deadline=None)
@given(x=channels_first_input(min_spatial=1), a=st.floats(0.1, 10.0), b=st.floats(-50, 50))
def test_layer_and_group_norm_are_invariant_to_per_sample_rescale_and_shift(x, a, b):
    """Ba et al. (2016), Table 1: LN is invariant to re-scaling and re-centering a sample."""
    c = x.shape[1]
    x = x.double()
    groups = {  # module -> the variance of each group it normalizes (eps=0 needs them > 0)
        normkit.LayerNorm2d(c, eps=0.0): x.var(1, correction=0) if c > 1 else None,
        normkit.GroupNorm(1, c, eps=0.0): x.flatten(1).var(1, correction=0),
    }
    for module, var in groups.items():
        if var is None or bool((var < 1e-20).any()):
            continue
        module = module.double()
        y1, y2 = module(x), module(x * a + b)
        torch.testing.assert_close(y1, y2, atol=1e-6, rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(x=channels_first_input(min_spatial=1), a=st.floats(0.1, 10.0))
def test_rms_norm_is_invariant_to_rescale_but_not_shift(x, a):
    x = x.double()
    module = normkit.RMSNorm(x.shape[-1], eps=0.0).double()
    if (x.abs().sum(-1) == 0).any():
        return
    torch.testing.assert_close(module(x), module(x * a), atol=1e-8, rtol=1e-8)
