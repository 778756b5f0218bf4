"""Test-suite configuration: deterministic property tests.

Hypothesis draws examples from a fixed seed (``derandomize``), so a CI run tests exactly
what a local run tests and a failure reproduces; set ``HYPOTHESIS_PROFILE=explore`` to
search with fresh random examples.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
