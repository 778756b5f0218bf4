"""normkit layers inside torch.compile(fullgraph=True): no graph breaks, same results.

``backend="aot_eager"`` runs Dynamo (which is where graph breaks happen) and AOTAutograd
(functionalization of the in-place running-statistics updates) without Inductor's C++
code generation, which takes tens of seconds per graph on a 2-core CPU.
"""

from __future__ import annotations

import pytest
import torch

import normkit


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), normkit.BatchNorm2d(8), torch.nn.ReLU(),
        normkit.GroupNorm(2, 8), normkit.LayerNorm2d(8),
        normkit.InstanceNorm2d(8, affine=True, track_running_stats=True),
        torch.nn.Flatten(1), torch.nn.Linear(8 * 6 * 6, 16), normkit.LayerNorm(16),
        normkit.RMSNorm(16), torch.nn.Unflatten(1, (16, 1)), normkit.BatchNorm1d(16))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fullgraph_compile_matches_eager(training):
    torch._dynamo.reset()
    eager, compiled_model = _model().train(training), _model().train(training)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    for step in range(2):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step)) * 3 + 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(xa), compiled(xb)
        torch.testing.assert_close(yb, ya, atol=2e-5, rtol=2e-5)
        ya.square().sum().backward()
        yb.square().sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(eager.named_buffers(), compiled_model.buffers(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_compiled_path_keeps_the_precision_at_large_offsets():
    torch._dynamo.reset()
    ln = normkit.LayerNorm(64)
    compiled = torch.compile(ln, fullgraph=True, backend="aot_eager")
    x = (torch.randn(32, 64, dtype=torch.float64) + 1e5).float()
    ref = torch.nn.functional.layer_norm(x.double(), (64,))
    assert float((compiled(x).detach().double() - ref).abs().max()) < 1e-4
