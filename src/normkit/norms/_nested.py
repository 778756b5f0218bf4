"""Nested tensors (``torch.nested``) through the per-token norms.

A jagged nested tensor -- ``torch.nested.nested_tensor(seqs, layout=torch.jagged)``,
torch's way to batch sequences of different lengths without padding -- keeps its
tokens packed in one dense ``values()`` tensor of shape ``(total tokens, *rest)``. A
norm whose statistics are per token (LayerNorm, RMSNorm, their residual-add forms)
runs on that tensor unchanged, and a norm with statistics over the batch's tokens
(PowerNorm) gets exactly the real tokens there, no padding to mask. The result is
wrapped back as a nested tensor with the input's offsets, so it has the input's ragged
size (``x + norm(x)`` works) and autograd reaches ``x`` through the view.

The older strided layout (``torch.nested.nested_tensor(seqs)``) has no dense values
tensor: its per-token norms run component by component.

Normalizing over the ragged dimension itself (a LayerNorm over a whole sequence) is
refused, as torch refuses it for its own LayerNorm on most such inputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ._core import shape_str

TAKE_NESTED = ("LayerNorm", "RMSNorm", "AddLayerNorm", "AddRMSNorm", "PowerNorm",
               "AdaptiveLayerNorm")
"""The layers (and their functional forms) that take nested tensors."""


def describe(x: Tensor) -> str:
    """A nested tensor's layout and shape the way users write them (a strided nested
    tensor has no shape: its components' shapes).

    Example:
        >>> x = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)],
        ...                                layout=torch.jagged)
        >>> describe(x) == f"a jagged nested tensor of shape (2, {x.shape[1]}, 3)"
        True
    """
    if x.layout == torch.jagged:
        return f"a jagged nested tensor of shape {shape_str(x)}"
    shapes = ", ".join(shape_str(t) for t in x.unbind())
    return (f"a strided nested tensor of {x.size(0)} components of shapes {shapes}"
            if shapes else "a strided nested tensor of no components")


def refuse(x: Tensor, who: str) -> None:
    """The error for a nested tensor given to a norm whose statistics are not per token."""
    raise ValueError(
        f"{who} expected a regular (dense) tensor, got {describe(x)}: of normkit's norms only "
        f"{', '.join(TAKE_NESTED)} take nested tensors (their statistics are per token, "
        f"or over the real tokens); for batch statistics over the real tokens of a "
        f"jagged (B, j, C) tensor pass its values(), the (tokens, C) rows, and wrap the "
        f"result with torch.nested.nested_tensor_from_jagged(result, x.offsets())")


def _check_trailing(x: Tensor, shape: int | Sequence[int], who: str) -> None:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    rest = x.dim() - len(shape)
    if x.layout == torch.jagged and rest <= x._ragged_idx:
        raise ValueError(
            f"{who} normalizes over the trailing {len(shape)} dim(s) "
            f"(normalized_shape={list(shape)}), which on {describe(x)} include its ragged "
            f"dim {x._ragged_idx} (the sequence lengths): normalizing over the ragged dim is "
            f"not supported; the normalized dims must come after it")
    trailing = ([tuple(x.shape[rest:])] if x.layout == torch.jagged
                else [tuple(t.shape[rest - 1:]) for t in x.unbind()])
    if rest < 1 or any(t != tuple(shape) for t in trailing):
        raise ValueError(
            f"{who} expected input of shape (*, {', '.join(map(str, shape))}) to match "
            f"normalized_shape={list(shape)}, got {describe(x)}")


try:  # what torch.nested.nested_tensor_from_jagged calls, without its fx-tracing check
    from torch.nested._internal.nested_tensor import (
        nested_view_from_values_offsets_lengths as _view,
    )
except ImportError:  # (a private module: the public function where it moved)
    _view = None
#: Whether the view takes the cached sequence-length bounds (torch 2.4's does not).
_VIEW_TAKES_BOUNDS = _view is not None and "min_seqlen" in inspect.signature(_view).parameters


def _wrap(like: Tensor, values: Tensor) -> Tensor:
    """``values`` (the shape of ``like.values()``) as a jagged nested tensor with
    ``like``'s offsets, lengths and ragged dim: the same ragged size, a view of
    ``values`` for autograd."""
    if _view is None:
        return torch.nested.nested_tensor_from_jagged(
            values, like.offsets(), like.lengths(), jagged_dim=like._ragged_idx)
    if not _VIEW_TAKES_BOUNDS:
        return _view(values, like.offsets(), like.lengths(), ragged_idx=like._ragged_idx)
    return _view(values, like.offsets(), like.lengths(), ragged_idx=like._ragged_idx,
                 min_seqlen=getattr(like, "_maybe_min_seqlen", None),
                 max_seqlen=getattr(like, "_maybe_max_seqlen", None))


def per_token(fn: Callable[..., Tensor], shape: Sequence[int], who: str, x: Tensor,
              *others: Tensor | None) -> Tensor | tuple[Tensor, ...]:
    """``fn(x, *others)`` for nested ``x`` (and ``others`` of its nesting, or None),
    where ``fn`` normalizes rows over the trailing ``shape`` dims of dense tensors and
    returns a tensor or a tuple of them, each of its input's shape; the results come
    back nested like ``x``."""
    _check_trailing(x, shape, who)
    for other in others:
        if other is None:
            continue
        if not (isinstance(other, Tensor) and other.is_nested
                and other.layout == x.layout and _same_shape(x, other)):
            got = (describe(other) if isinstance(other, Tensor) and other.is_nested else
                   f"a dense tensor of shape {shape_str(other)}"
                   if isinstance(other, Tensor) else type(other).__name__)
            raise ValueError(
                f"{who} expected the residual to be nested like x ({describe(x)}; jagged: "
                f"the same ragged size, i.e. built on x's offsets, as torch's own "
                f"x + residual requires), got {got}")
    if x.layout == torch.jagged:
        out = fn(x.values(), *(o if o is None else o.values() for o in others))
        if isinstance(out, tuple):
            return tuple(_wrap(x, t) for t in out)
        return _wrap(x, out)
    # strided layout: one component at a time (as_nested_tensor keeps autograd)
    parts = [fn(*args) for args in zip(x.unbind(), *(
        [None] * x.size(0) if o is None else o.unbind() for o in others), strict=True)]
    if isinstance(parts[0], tuple):
        return tuple(torch.nested.as_nested_tensor(list(p), layout=torch.strided)
                     for p in zip(*parts, strict=True))
    return torch.nested.as_nested_tensor(parts, layout=torch.strided)


def _same_shape(a: Tensor, b: Tensor) -> bool:
    if a.layout == torch.strided:
        return a.size(0) == b.size(0) and all(
            s.shape == t.shape for s, t in zip(a.unbind(), b.unbind(), strict=True))
    # (jagged: equal ragged sizes are one offsets tensor's, as torch's binary ops demand)
    return a._ragged_idx == b._ragged_idx and a.shape == b.shape


def padding_of_values(x: Tensor) -> Tensor | None:
    """For a jagged ``x`` whose ``values()`` hold rows that belong to no sequence (one
    made by ``torch.nested.narrow``: ``lengths()`` is set), the bool mask over those
    rows, True at the rows outside every sequence; None where every row is a token.

    Example:
        >>> base = torch.zeros(2, 4, 3)
        >>> x = torch.nested.narrow(base, 1, torch.tensor([0, 1]), torch.tensor([2, 3]),
        ...                         layout=torch.jagged)
        >>> padding_of_values(x).tolist()
        [False, False, True, True, True, False, False, False]
    """
    lengths = x.lengths()
    if lengths is None:
        return None
    starts = x.offsets()[:-1]
    rows = torch.arange(x.values().size(x._ragged_idx - 1), device=starts.device)
    # the sequence each row would belong to: the last one starting at or before it
    # (offsets ascend); a row is a token where that sequence has not ended yet
    seq = torch.searchsorted(starts, rows, right=True) - 1
    inside = seq >= 0
    seq = seq.clamp(min=0)
    return ~(inside & (rows < starts[seq] + lengths[seq]))
