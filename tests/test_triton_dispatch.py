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

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

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
