"""``torch.compiler.assume_constant_result`` without importing Dynamo at import time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

_F = TypeVar("_F", bound=Callable)


def constant_result(fn: _F) -> _F:
    """Mark ``fn`` as torch's ``assume_constant_result`` does: torch.compile (and a strict
    torch.export) calls it once while tracing and bakes in the result instead of tracing
    into it.

    torch's decorator imports ``torch._dynamo`` (and sympy with it) to set one attribute
    on ``fn``, which Dynamo reads when it traces a call: that import took 2.7 s on a
    2-core VM, more than ``import torch`` itself, and every ``import normkit`` paid it.
    The same attribute is set here; ``tests/test_compile.py`` checks it is the one
    torch's decorator sets and that a compiled call takes the result as a constant.

    Example:
        >>> @constant_result
        ... def threads():
        ...     return 2
        >>> threads(), threads._dynamo_marked_constant
        (2, True)
    """
    fn._dynamo_marked_constant = True
    return fn
