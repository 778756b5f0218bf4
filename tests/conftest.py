"""Test-suite configuration: deterministic property tests.

Hypothesis draws examples from a fixed seed (``derandomize``), so a CI run tests exactly
what a local run tests and a failure reproduces; set ``HYPOTHESIS_PROFILE=explore`` to
search with fresh random examples.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture
def fused_rows_node(monkeypatch):
    """Small inputs through normkit's fused nodes instead of the unfused compositions:
    ``normkit.functional.SMALL_ROWS_COMPOSITE_BELOW`` (RMSNorm, residual add) and
    ``normkit.norms.fused.FUSED_ACT_MIN_ELEMENTS`` (norm + activation) are speed rules,
    and the nodes' tests need them on small shapes (test_functional and test_fused check
    the rules themselves)."""
    from normkit import functional
    from normkit.norms import fused

    monkeypatch.setattr(functional, "SMALL_ROWS_COMPOSITE_BELOW", (0, 0))
    monkeypatch.setattr(fused, "FUSED_ACT_MIN_ELEMENTS", 0)


@pytest.fixture
def spy(monkeypatch):
    """``spy(module, name)`` replaces ``module.name`` for the test by a wrapper that calls
    it and records each result in the list it returns: which route a layer took (a
    route's function returns ``None`` where it refuses the input)."""
    def install(module, name: str) -> list:
        results = []
        real = getattr(module, name)

        def recorded(*args, **kwargs):
            results.append(real(*args, **kwargs))
            return results[-1]

        monkeypatch.setattr(module, name, recorded)
        return results

    return install


def _denormals_flushed() -> bool:
    import torch

    return (torch.tensor([1e-39]) * 1.0).item() == 0.0  # a float32 subnormal survives?


@pytest.fixture(autouse=True)
def _subnormals_stay_on():
    """Restore IEEE subnormals after a test that lost them.

    torch 2.4's Inductor loads CPU kernels built with -ffast-math, which switch the whole
    process to flush-to-zero (measured: one torch.compile call on torch 2.4.1 does it,
    2.8 not); later tests of subnormal weights (In-Place ABN's recoverability rule) and
    hypothesis' float strategies then fail. normkit itself never changes the mode: the
    fixture fails a test that turns it on without compiling anything.
    """
    import torch
    import torch._dynamo

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    yield
    if _denormals_flushed():
        torch.set_flush_denormal(False)
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
        assert compiled, "this test switched the process to flush-to-zero (subnormals lost)"


def pytest_collection_finish(session):
    """Start the collected tests' background jobs (``tests/background.py``)."""
    import background

    if (session.config.option.collectonly or not background.enabled()
            or hasattr(session.config, "workerinput")):  # (an xdist worker: each would)
        return
    jobs = {item.nodeid: factory for item in session.items
            if (factory := background.factory_of(getattr(item, "function", None)))}
    background.start(jobs)


def pytest_sessionfinish(session):
    import background

    background.stop()


@pytest.fixture
def background_result(request):
    """The finished child process of a test decorated with ``background.job``."""
    import background

    factory = background.factory_of(request.function)
    assert factory is not None, "background_result needs a test decorated with background.job"
    return background.result(request.node.nodeid, factory)
