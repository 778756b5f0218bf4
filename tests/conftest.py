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
    """Small inputs through normkit's fused RMSNorm / residual-add node instead of torch's
    composite: ``normkit.functional.SMALL_ROWS_COMPOSITE_BELOW`` is a speed rule, and the
    node's tests need it on small shapes (test_functional checks the rule itself)."""
    from normkit import functional

    monkeypatch.setattr(functional, "SMALL_ROWS_COMPOSITE_BELOW", (0, 0))
