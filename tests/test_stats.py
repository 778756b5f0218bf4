"""The statistics core: compensated moments and the count-weighted merge."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normkit import _stats


def test_moments_keep_their_digits_at_large_offsets():
    gen = torch.Generator().manual_seed(0)
    for offset in (1e4, 1e5, 1e6):
        x = (torch.randn(64, 4096, generator=gen, dtype=torch.float64) + offset).float()
        m = _stats.moments(x, (1,))
        exact = x.double()
        mean = exact.mean(1, keepdim=True)
        var = ((exact - mean) ** 2).mean(1, keepdim=True)
        assert float(((m.mean_hi.double() + m.mean_lo.double()) - mean).abs().max()) < 1e-6
        assert float((m.var.double() - var).abs().max()) < 1e-5


def test_naive_float32_mean_would_not():
    """The reason for the compensated pair: a plain float32 mean is off by >1e-4 at 1e5."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4096, generator=gen, dtype=torch.float64) + 1e5).float()
    naive = x.mean(1).double()
    exact = x.double().mean(1)
    m = _stats.moments(x, (1,))
    compensated = (m.mean_hi.double() + m.mean_lo.double()).view(-1)
    assert float((compensated - exact).abs().max()) < float((naive - exact).abs().max())


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=2, max_size=6),
       offset=st.sampled_from([0.0, 1e3, 1e8]), seed=st.integers(0, 1000))
def test_merge_equals_whole_for_any_chunking(sizes, offset, seed):
    total = sum(sizes)
    if total == 0:
        return
    data = torch.randn(total, 3, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) + offset
    n = torch.zeros(3, dtype=torch.float64)
    mean = torch.zeros(3, dtype=torch.float64)
    m2 = torch.zeros(3, dtype=torch.float64)
    for chunk in torch.split(data, sizes):
        cn = torch.full((3,), float(chunk.shape[0]), dtype=torch.float64)
        cmean = chunk.mean(0) if chunk.shape[0] else torch.zeros(3, dtype=torch.float64)
        cm2 = ((chunk - cmean) ** 2).sum(0)
        n, mean, m2 = _stats.merge_moments(n, mean, m2, cn, cmean, cm2)
    assert torch.equal(n, torch.full((3,), float(total), dtype=torch.float64))
    torch.testing.assert_close(mean, data.mean(0), atol=1e-9 * max(1, offset), rtol=1e-12)
    torch.testing.assert_close(m2 / total, data.var(0, correction=0), atol=1e-7, rtol=1e-9)


def test_unbiased_var_and_running_update():
    torch.testing.assert_close(_stats.unbiased_var(torch.tensor([3.0]), 4), torch.tensor([4.0]))
    assert torch.isinf(_stats.unbiased_var(torch.tensor([1.0]), 1)).all()
    running = torch.tensor([1.0, 2.0])
    _stats.update_running_(running, torch.tensor([3.0, 4.0], dtype=torch.float64), 0.5)
    torch.testing.assert_close(running, torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_running_statistics_are_rounded_once(dtype):
    """torch's kernels average 16-bit running statistics in float32 and round once; the
    update rounded the batch's value, the product and the sum each to 16 bits, which put
    bfloat16 statistics several ulps off float64 (torch's op_db instance_norm samples,
    momentum -1.2, under torch 2.4)."""
    g = torch.Generator().manual_seed(0)
    for momentum in (0.1, 0.01, 0.9, -1.2):
        running = (torch.randn(4096, generator=g) * 10).to(dtype)
        value = torch.randn(4096, generator=g, dtype=torch.float64) * 10
        exact = running.double() * (1.0 - momentum) + momentum * value
        _stats.update_running_(running, value, momentum)
        assert running.dtype == dtype
        # one rounding: within half a 16-bit ulp of the exact value (plus float32's own)
        bits = {torch.float16: 10, torch.bfloat16: 7}[dtype]
        half_ulp = torch.exp2(torch.floor(torch.log2(exact.abs())) - bits - 1)
        half_ulp = half_ulp.clamp(min=2.0 ** -25 if dtype == torch.float16 else 0.0)
        err = (running.double() - exact).abs()
        assert bool((err <= half_ulp + 1e-6 * exact.abs()).all()), (
            momentum, float((err / half_ulp).max()))
