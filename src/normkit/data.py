"""Data standardization: fit per-feature statistics once, then standardize with them.

:class:`Standardizer` is scikit-learn's ``StandardScaler`` as a ``torch.nn.Module``:
``fit`` / ``partial_fit`` / ``transform`` / ``inverse_transform`` with the same
statistics (biased variance, the same constant-feature rule, NaNs ignored on request),
fit from tensors, DataLoaders or shards spread over ``torch.distributed`` ranks, and
saved in the ``state_dict`` as float64 buffers. :class:`StandardizedModel` wraps a
regression model with an input and a target standardizer: it trains in standardized
units and predicts in the original ones.

Numerics
--------
* Every chunk's mean and ``M2`` (sum of squared deviations) are computed in float64
  with the compensated two-pass of :func:`normkit._stats.moments`, and chunks, batches
  and ranks are pooled with the count-weighted merge :func:`normkit._stats.merge_moments`
  (Chan, Golub & LeVeque 1979).
* The merge runs on means relative to a per-feature pivot (the first chunk's mean, or
  the current mean in ``partial_fit``), and the rounding residual of the stored mean is
  kept in memory, so fitting in one piece, in any chunking, by ``partial_fit`` or over
  ranks agrees to float64 rounding *of the spread*, even at offsets of 1e8 (a merge of
  plain float64 means, as in scikit-learn, loses ``ulp(mean) / std`` there). The
  residual is not saved: ``partial_fit`` after loading a checkpoint continues from the
  saved mean.
* ``transform`` runs in float64 for float64 input and in float32 otherwise, with the
  float64 mean split into a float32 pair ``mean_hi + mean_lo`` so that large offsets do
  not eat the digits of ``x - mean``; the output has the input's dtype.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import Proxy

from . import _stats
from .norms._base import NotScriptable, fx_leaf

__all__ = ["Standardizer", "StandardizedModel"]

_NAN_POLICIES = ("raise", "ignore")
_STAT_NAMES = ("mean", "var", "scale", "count")
# not saved: the rounding residual of ``mean``, so that partial_fit continues exactly
_RESIDUAL = "_mean_residual"
_EPS64 = float(torch.finfo(torch.float64).eps)


class _Pooled(NamedTuple):
    """Pooled moments, each of the feature shape, float64.

    ``mean`` is relative to the pivot ``shift`` (the full mean is ``shift + mean``), so
    merged means are small numbers whose rounding is relative to the spread, not to a
    large offset: chunks at an offset of 1e8 merge without losing the digits of ``M2``.
    """

    shift: Tensor
    count: Tensor
    mean: Tensor
    m2: Tensor

    def merge(self, other: _Pooled) -> _Pooled:
        """Pool with ``other`` (which must be relative to the same shift)."""
        return _Pooled(self.shift, *_stats.merge_moments(
            self.count, self.mean, self.m2, other.count, other.mean, other.m2))


def _size_str(shape: Sequence[int]) -> str:
    """``(5,)`` / ``(3, 4)`` / ``()``: a shape the way Python writes it."""
    return str(tuple(shape))


def _shape_str(x: Tensor) -> str:
    """The shape of ``x`` the way Python writes it."""
    return _size_str(x.shape)


def _as_tensor(obj: Any, who: str, where: str) -> Tensor:
    """A batch as a tensor: tensors pass, numpy arrays are wrapped, complex is refused."""
    if isinstance(obj, np.ndarray):
        obj = torch.from_numpy(np.ascontiguousarray(obj))
    if not isinstance(obj, Tensor):
        hint = ("; a nested list of numbers is read as a list of (x, y) batches: pass "
                "torch.tensor(data) or np.asarray(data)" if isinstance(obj, numbers.Number)
                else "")
        raise TypeError(
            f"{who} expected {where} to be a torch.Tensor or numpy array, "
            f"got {type(obj).__name__}{hint}"
        )
    if obj.is_complex():
        raise ValueError(
            f"{who} expected real-valued data (floating, integer or bool), "
            f"got dtype {obj.dtype} in {where}"
        )
    return obj


def _select(batch: Any, key: Any, who: str, where: str) -> Any:
    """The tensor to fit in one batch: itself, ``batch[key]``, or ``x`` of an ``(x, y)`` batch."""
    if isinstance(batch, (Tensor, np.ndarray)):
        if key is not None:
            raise ValueError(
                f"{who} got key={key!r}, which picks from tuple, list or dict batches, "
                f"but {where} is a {type(batch).__name__}"
            )
        return batch
    if isinstance(batch, Mapping):
        if key is None:
            raise ValueError(
                f"{who} got a dict batch with keys {list(batch)} ({where}); pass key= to "
                f"say which entry to fit"
            )
        if key not in batch:
            raise KeyError(f"{who} expected key {key!r} in the dict batch ({where}), "
                           f"got keys {list(batch)}")
        return batch[key]
    if isinstance(batch, (tuple, list)):
        index = 0 if key is None else key
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"{who} expected an integer key= for tuple/list batches, "
                            f"got {key!r} ({where})")
        if not -len(batch) <= index < len(batch):
            raise IndexError(f"{who} expected key= to index a batch of {len(batch)} "
                             f"items, got {index} ({where})")
        return batch[index]
    raise TypeError(
        f"{who} expected each batch to be a tensor, an (x, y) tuple/list or a dict, "
        f"got {type(batch).__name__} ({where})"
    )


def _masked_moments(x: Tensor, valid: Tensor,
                    dims: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(count, mean_hi, mean_lo, M2) of the ``valid`` entries of ``x`` over ``dims`` (keepdim).

    The same compensated two-pass as :func:`normkit._stats.moments`, with a mask: a first
    mean, then the mean and squares of the residuals. Features without a valid entry get
    count 0, mean 0 and M2 0.
    """
    count = valid.sum(dims, keepdim=True, dtype=torch.float64)
    safe = count.clamp(min=1.0)
    mean_hi = torch.where(valid, x, 0.0).sum(dims, keepdim=True) / safe
    residual = torch.where(valid, x - mean_hi, 0.0)
    mean_lo = residual.sum(dims, keepdim=True) / safe
    m2 = ((residual * residual).sum(dims, keepdim=True) - count * mean_lo.square()).clamp(min=0)
    return count, mean_hi, mean_lo, m2


class Standardizer(NotScriptable, nn.Module):
    r"""Standardize features with statistics fit on data: ``y = (x - mean) / scale``.

    scikit-learn's ``StandardScaler`` as a module (also Keras' ``Normalization`` layer
    with ``adapt``): ``mean`` and the biased ``var`` are kept per position of
    ``feature_dims`` and reduced over every other dim, pooled exactly over any number of
    chunks, batches or ranks (count-weighted merge of Chan, Golub & LeVeque 1979).

    .. math:: \mathrm{scale} = \sqrt{\mathrm{var} + \epsilon}, \quad
              y = \frac{x - \mathrm{mean}}{\mathrm{scale}}

    A feature is *constant* when ``var <= n * eps64 * var + (n * mean * eps64) ** 2``
    (``n`` its count, ``eps64`` the float64 machine epsilon; scikit-learn's rule, the error
    bound of a two-pass variance): its scale is 1, so it transforms to ``x - mean``
    (0 for the fitted constant) and inverts exactly.

    The buffers always hold the statistics of the data; ``with_mean`` and ``with_std``
    only decide how ``transform`` uses them (scikit-learn stores ``None`` instead), so a
    checkpoint does not depend on them.

    Input data: floating tensors of any dtype; integer and bool tensors and numpy arrays
    are accepted too and fit in float64 (exact for integers up to 2**53). Infinite values
    raise a ValueError. ``transform`` of an integer tensor returns the default float
    dtype (``torch.get_default_dtype()``).

    Args:
        feature_dims: the dims that index features, negative dims allowed; statistics
            have the shape of ``x`` at these dims (in increasing dim order) and are reduced
            over all other dims. ``(-1,)`` for ``(N, F)`` tables (and ``(N, T, F)``
            sequences), ``(1,)`` for per-channel statistics of ``(N, C, H, W)`` images,
            ``()`` for one global mean and scale. Default: ``(-1,)``.
        with_mean: subtract the mean in ``transform``. Default: ``True``.
        with_std: divide by the scale in ``transform``. Default: ``True``.
        nan: ``"raise"`` (a ValueError naming how many NaNs and where) or ``"ignore"``
            (NaNs are skipped when fitting, so counts are per feature). Applies to
            fitting; ``transform`` never inspects values (no device synchronization), so
            NaNs there always stay NaN in place. Default: ``"raise"``.
        eps: added to the variance before the square root. Default: ``0.0``
            (scikit-learn; Keras uses a floor of 1e-7 on the std instead).
        device: where the statistics live. Default: CPU. ``.to(device)`` moves them;
            ``.half()``, ``.to(dtype)`` and the like leave them in float64.

    Buffers (float64, of the feature shape once fitted, of shape ``(0,)`` before):
        ``mean``, ``var`` (biased), ``scale`` and ``count`` (values seen per feature).
        A fresh ``Standardizer`` built with the same ``feature_dims`` loads a fitted or
        an unfitted checkpoint (the buffers take the checkpoint's shape).

    Shape:
        - Input: ``(*)`` with at least as many dims as ``feature_dims`` reaches.
        - Output: same shape as the input, and same dtype for floating input.

    Example:
        >>> x = torch.tensor([[1.0, 10.0], [3.0, 10.0], [5.0, 10.0]])
        >>> s = Standardizer().fit(x)
        >>> s.mean, s.scale
        (tensor([ 3., 10.], dtype=torch.float64), tensor([1.6330, 1.0000], dtype=torch.float64))
        >>> s(x)
        tensor([[-1.2247,  0.0000],
                [ 0.0000,  0.0000],
                [ 1.2247,  0.0000]])
        >>> torch.equal(s.inverse_transform(s(x)), x)
        True
    """

    mean: Tensor
    var: Tensor
    scale: Tensor
    count: Tensor

    def __init__(
        self,
        feature_dims: int | Sequence[int] = (-1,),
        *,
        with_mean: bool = True,
        with_std: bool = True,
        nan: str = "raise",
        eps: float = 0.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        dims = tuple(feature_dims) if isinstance(feature_dims, Iterable) else (feature_dims,)
        if any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise TypeError(f"Standardizer expected feature_dims to be an int or a sequence "
                            f"of ints, got {feature_dims!r}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"Standardizer expected distinct feature_dims, got {dims}")
        if nan not in _NAN_POLICIES:
            raise ValueError(f"Standardizer expected nan to be one of {_NAN_POLICIES}, "
                             f"got {nan!r}")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"Standardizer expected a finite eps >= 0, got {eps!r}")
        self.feature_dims = dims
        self.with_mean = bool(with_mean)
        self.with_std = bool(with_std)
        self.nan = nan
        self.eps = float(eps)
        for name in _STAT_NAMES:
            self.register_buffer(name, torch.empty(0, dtype=torch.float64, device=device))
        self.register_buffer(_RESIDUAL, torch.empty(0, dtype=torch.float64, device=device),
                             persistent=False)

    # ------------------------------------------------------------------ state

    @property
    def fitted(self) -> bool:
        """Whether statistics are present (from ``fit``, ``partial_fit`` or a checkpoint).

        Example:
            >>> s = Standardizer()
            >>> s.fitted, s.fit(torch.randn(4, 2)).fitted
            (False, True)
        """
        return self.count.numel() > 0

    @property
    def feature_shape(self) -> torch.Size | None:
        """The shape of the statistics (the input's size at ``feature_dims``), ``None`` unfitted.

        Example:
            >>> Standardizer((1,)).fit(torch.randn(2, 3, 4, 4)).feature_shape
            torch.Size([3])
        """
        return self.count.shape if self.fitted else None

    def reset_statistics(self) -> None:
        """Forget the fitted statistics (the buffers go back to shape ``(0,)``).

        Example:
            >>> s = Standardizer().fit(torch.randn(4, 2))
            >>> s.reset_statistics()
            >>> s.fitted
            False
        """
        for name in (*_STAT_NAMES, _RESIDUAL):
            buf = self._buffers[name]
            self._buffers[name] = torch.empty(0, dtype=torch.float64, device=buf.device)

    def _set_moments(self, pooled: _Pooled) -> None:
        """Store pooled moments as the buffers; the scale follows scikit-learn's rule."""
        count = pooled.count
        mean = pooled.shift + pooled.mean
        var = pooled.m2 / count.clamp(min=1.0)
        constant = var <= count * _EPS64 * var + (count * mean * _EPS64).square()
        scale = torch.where(constant, 1.0, (var + self.eps).sqrt())
        residual = pooled.mean - (mean - pooled.shift)  # mean + residual: the pooled mean
        device = self.count.device
        self.count, self.mean = count.to(device), mean.to(device)
        self.var, self.scale = var.to(device), scale.to(device)
        self._buffers[_RESIDUAL] = residual.to(device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs) -> None:
        # The buffers are lazily shaped: take the checkpoint's (fitted or unfitted) shape.
        shapes = {}
        for name in _STAT_NAMES:
            value = state_dict.get(prefix + name)
            if isinstance(value, Tensor):
                shapes[name] = value.shape
        if len(set(shapes.values())) > 1:
            error_msgs.append(
                "Standardizer expected the statistics " + ", ".join(shapes) + " to have one "
                "shape, got " + ", ".join(f"{n} {_size_str(s)}" for n, s in shapes.items())
            )
            return
        for name, shape in shapes.items():
            buf = self._buffers[name]
            if buf.shape != shape:
                self._buffers[name] = torch.empty(shape, dtype=torch.float64, device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        self._buffers[_RESIDUAL] = torch.zeros_like(self.mean)

    def _apply(self, fn, recurse=True):
        # .to(device) moves the statistics; .half() / .to(dtype) / .double() do not cast
        # them: they stay float64 (taken from the original, not round-tripped).
        before = {name: self._buffers[name] for name in (*_STAT_NAMES, _RESIDUAL)}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float64:
                self._buffers[name] = old.to(new.device)
        return self

    def extra_repr(self) -> str:
        shape = "unfitted" if not self.fitted else f"feature_shape={_size_str(self.count.shape)}"
        return (f"feature_dims={self.feature_dims}, with_mean={self.with_mean}, "
                f"with_std={self.with_std}, nan={self.nan!r}, eps={self.eps}, {shape}")

    # ------------------------------------------------------------------ shapes

    def _resolve_dims(self, x: Tensor, who: str, where: str) -> tuple[int, ...]:
        """``feature_dims`` as sorted non-negative dims of ``x``."""
        ndim = x.dim()
        need = max([0, *(d + 1 if d >= 0 else -d for d in self.feature_dims)])  # (no
        # default=: torch.compile cannot trace that keyword of the builtin)
        if ndim < need:
            raise ValueError(
                f"{who} with feature_dims={self.feature_dims} expected an input with at "
                f"least {need} dims, got a {ndim}D input of shape {_shape_str(x)} ({where})"
            )
        dims = tuple(sorted(d % ndim for d in self.feature_dims))
        if len(set(dims)) != len(dims):
            raise ValueError(
                f"{who}: feature_dims={self.feature_dims} name the same dim twice for a "
                f"{ndim}D input of shape {_shape_str(x)} ({where})"
            )
        return dims

    def _check_shape(self, x: Tensor, dims: tuple[int, ...], expected: Sequence[int],
                     who: str, where: str) -> None:
        given = tuple(x.shape[d] for d in dims)
        if given != tuple(expected):
            raise ValueError(
                f"{who} expected feature shape {_size_str(expected)} at feature_dims="
                f"{self.feature_dims}, got feature shape {_size_str(given)} from an input of "
                f"shape {_shape_str(x)} ({where})"
            )

    # ------------------------------------------------------------------ fitting

    def _chunk_moments(self, batch: Any, who: str, where: str, shift: Tensor | None,
                       expected: Sequence[int] | None) -> _Pooled | None:
        """Moments of one chunk in float64, relative to ``shift`` (or to its own first mean
        when ``shift`` is None); ``None`` when the chunk has no elements."""
        x = _as_tensor(batch, who, where)
        dims = self._resolve_dims(x, who, where)
        reduce = tuple(d for d in range(x.dim()) if d not in dims)
        if not reduce:
            raise ValueError(
                f"{who} with feature_dims={self.feature_dims} got a {x.dim()}D input of shape "
                f"{_shape_str(x)} ({where}): every dim is a feature dim, so there are no samples "
                f"to reduce over; add a batch dim (x.unsqueeze(0)) for one sample, or a "
                f"feature dim (x.unsqueeze(-1)) for one column of values"
            )
        if expected is not None:
            self._check_shape(x, dims, expected, who, where)
        if x.numel() == 0:
            return None
        feature_shape = tuple(x.shape[d] for d in dims)
        finite = torch.isfinite(x)
        if bool(finite.all()):
            isnan = None
        else:
            isnan = torch.isnan(x)
            n_nan = int(isnan.sum())
            n_inf = int((~finite).sum()) - n_nan
            if n_inf:
                raise ValueError(f"{who} expected finite values, got {n_inf} infinite "
                                 f"value(s) in {where} of shape {_shape_str(x)}")
            if self.nan == "raise":
                first = ", ".join(str(tuple(i)) for i in torch.nonzero(isnan)[:3].tolist())
                raise ValueError(
                    f"{who} found {n_nan} NaN value(s) in {where} of shape {_shape_str(x)}, "
                    f"first at index {first}; pass nan='ignore' to skip NaNs when fitting"
                )
        if x.dtype == torch.bool:
            x = x.to(torch.float64)
        if shift is None:
            y = x.to(torch.float64)
        else:  # one pass: computed in float64 by type promotion
            view = [x.shape[d] if d in dims else 1 for d in range(x.dim())]  # (1, .., F, .., 1)
            y = x - shift.to(x.device).reshape(view)
        if isnan is None:
            m = _stats.moments(y, reduce)
            count = torch.full_like(m.var, float(_stats.reduced_count(x.shape, reduce)))
            mean_hi, mean_lo, m2 = m.mean_hi, m.mean_lo, m.var * count
        else:
            count, mean_hi, mean_lo, m2 = _masked_moments(y, ~isnan, reduce)
        if shift is None:  # pivot on the chunk's first mean; the rest is relative to it
            shift, mean = mean_hi, mean_lo
        else:
            mean = mean_hi + mean_lo
        device = self.count.device
        return _Pooled(*(t.reshape(feature_shape).to(device) for t in (shift, count, mean, m2)))

    def _accumulate(self, data: Any, key: Any, who: str) -> _Pooled | None:
        """Pool every batch of ``data``; ``None`` when there was no element at all."""
        single = isinstance(data, (Tensor, np.ndarray, Mapping))
        if not single and not isinstance(data, Iterable):
            raise TypeError(f"{who} expected a tensor or an iterable of batches, "
                            f"got {type(data).__name__}")
        state: _Pooled | None = None
        for i, batch in enumerate([data] if single else data):
            where = "the input" if single else f"batch {i}"
            x = _select(batch, key, who, where)
            if state is None:
                state = self._chunk_moments(x, who, where, None, None)
            else:
                chunk = self._chunk_moments(x, who, where, state.shift, state.count.shape)
                if chunk is not None:
                    state = state.merge(chunk)
        return state

    @torch.no_grad()
    def fit(self, data: Any, *, key: Any = None, process_group: Any = None) -> Standardizer:
        """Fit the statistics on ``data``, replacing any previous ones; returns ``self``.

        ``data`` is a tensor (or numpy array), or any iterable of batches such as a
        DataLoader or a list of tensors. A batch is a tensor, an ``(x, y)`` tuple/list
        (``x`` is fit, or ``batch[key]`` with an integer ``key``) or a dict (``key=`` is
        required). Empty batches are skipped; data without any element raise a ValueError.
        On an error the previous statistics are kept.

        Distributed fit: with ``process_group`` (``torch.distributed.group.WORLD`` or a
        group from ``new_group``) every rank of the group calls ``fit`` on its own shard
        (which may be empty) and all end with the statistics of the union of the shards:
        the per-rank moments (count, mean relative to a pivot, M2) are all-gathered in
        float64 and merged with :func:`normkit._stats.merge_moments` in rank order, so
        every rank holds bitwise identical buffers. Any backend works (tensors travel on
        CPU, on the current CUDA device for NCCL). An error on one rank (bad data) is
        raised there and, as a RuntimeError naming that rank, on every other rank;
        differing feature shapes or no data on any rank raise a ValueError on every rank:
        no rank is left hanging. ``process_group=None`` (the default) never communicates,
        even when
        torch.distributed is initialized: synchronizing is explicit. Note that
        ``torch.distributed.group.WORLD`` is ``None`` before ``init_process_group``.

        Args:
            data: the data to fit.
            key: which entry of tuple/list (an int) or dict batches to fit. Default: ``None``
                (``x`` of tuple batches; dict batches then raise).
            process_group: the group to synchronize over, or ``None``. Default: ``None``.

        Example:
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> x, y = torch.randn(100, 3) * 5 + 2, torch.randn(100, 1)
            >>> loader = DataLoader(TensorDataset(x, y), batch_size=32)
            >>> s = Standardizer().fit(loader)  # fits x of each (x, y) batch
            >>> torch.allclose(s.mean, x.double().mean(0)), s.count
            (True, tensor([100., 100., 100.], dtype=torch.float64))
            >>> Standardizer().fit(loader, key=1).feature_shape  # the targets
            torch.Size([1])
        """
        who = "Standardizer.fit"
        if process_group is None:
            pooled = self._accumulate(data, key, who)
            if pooled is None:
                raise ValueError(f"{who} expected data with at least one element, got "
                                 f"zero-size data")
        else:
            pooled = self._fit_distributed(data, key, process_group, who)
        self._set_moments(pooled)
        return self

    def _fit_distributed(self, data: Any, key: Any, group: Any, who: str) -> _Pooled:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{who} got process_group={group!r}, but torch.distributed is "
                               f"not initialized; call init_process_group first, or pass "
                               f"process_group=None for a local fit")
        error: Exception | None = None
        local: _Pooled | None = None
        try:
            local = self._accumulate(data, key, who)
        except Exception as exc:  # raised after the exchange, so peers do not hang
            error = exc
        world = dist.get_world_size(group)
        shape = None if local is None else tuple(local.count.shape)
        headers: list[Any] = [None] * world
        message = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(headers, (shape, message), group=group)
        failed = [(rank, msg) for rank, (_, msg) in enumerate(headers) if msg is not None]
        if error is not None:
            raise error
        if failed:
            rank, msg = failed[0]
            raise RuntimeError(f"{who} failed on rank {rank} of the process group: {msg}")
        shapes = [s for s, _ in headers]
        distinct = {s for s in shapes if s is not None}
        if len(distinct) > 1:
            raise ValueError(
                f"{who} expected every rank to have the same feature shape, got "
                + ", ".join(f"rank {r}: {_size_str(s)}" for r, s in enumerate(shapes)
                            if s is not None)
            )
        if not distinct:
            raise ValueError(f"{who} expected data with at least one element on some rank, "
                             f"got zero-size data on all {world} ranks")
        feature_shape = distinct.pop()
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        if local is None:
            packed = torch.zeros((4, *feature_shape), dtype=torch.float64, device=device)
        else:  # (4, *feature_shape): shift, count, mean (relative to shift), M2
            packed = torch.stack(local).to(device)
        parts = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(parts, packed, group=group)
        gathered = [_Pooled(*part) for part in parts]
        # one pivot for all: per feature, the shift of the first rank with values there
        shift = torch.zeros(feature_shape, dtype=torch.float64, device=device)
        taken = torch.zeros(feature_shape, dtype=torch.bool, device=device)
        for part in gathered:
            fresh = ~taken & (part.count > 0)
            shift, taken = torch.where(fresh, part.shift, shift), taken | fresh
        zero = torch.zeros_like(shift)
        total = _Pooled(shift, zero, zero, zero)
        for part in gathered:  # rank order: the same operations, hence bits, on every rank
            rebased = (part.shift - shift) + part.mean
            total = total.merge(_Pooled(shift, part.count, rebased, part.m2))
        return total

    @torch.no_grad()
    def partial_fit(self, batch: Any, *, key: Any = None) -> Standardizer:
        """Add one batch to the statistics (exact pooled merge); returns ``self``.

        ``batch`` is one batch in any form :meth:`fit` accepts (a tensor, an ``(x, y)``
        tuple/list, a dict with ``key=``). Fitting chunk by chunk gives the statistics of
        the concatenation, whatever the chunk sizes, up to float64 rounding. A zero-size
        batch raises a ValueError (as in scikit-learn).

        Args:
            batch: the batch to add.
            key: as in :meth:`fit`. Default: ``None``.

        Example:
            >>> x = torch.randn(10, 3, dtype=torch.float64)
            >>> s = Standardizer()
            >>> for chunk in x.split([3, 5, 2]):
            ...     _ = s.partial_fit(chunk)
            >>> torch.allclose(s.var, x.var(0, correction=0)), s.count
            (True, tensor([10., 10., 10.], dtype=torch.float64))
        """
        who = "Standardizer.partial_fit"
        x = _select(batch, key, who, "the input")
        expected = self.count.shape if self.fitted else None
        # pivot on the current mean: relative to it, the state's mean is the residual
        shift = self.mean if self.fitted else None
        chunk = self._chunk_moments(x, who, "the input", shift, expected)
        if chunk is None:
            raise ValueError(f"{who} expected a batch with at least one element, got a "
                             f"zero-size input of shape {_shape_str(_as_tensor(x, who, ''))}")
        if self.fitted:
            residual = self._buffers[_RESIDUAL]
            if residual.shape != self.mean.shape:  # the buffers were set by hand
                residual = torch.zeros_like(self.mean)
            state = _Pooled(self.mean, self.count, residual, self.var * self.count)
            chunk = state.merge(chunk)
        self._set_moments(chunk)
        return self

    # ------------------------------------------------------------------ transforming

    def _standardize(self, x: Tensor, inverse: bool, who: str) -> Tensor:
        if not self.fitted:
            raise RuntimeError(
                f"{who} called on a Standardizer that is not fitted; call fit() or "
                f"partial_fit() first, or load a fitted state_dict"
            )
        x = _as_tensor(x, who, "the input")
        dims = self._resolve_dims(x, who, "the input")
        self._check_shape(x, dims, self.count.shape, who, "the input")
        out_dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
        cdtype = _stats.compute_dtype(out_dtype)
        view = [x.shape[d] if d in dims else 1 for d in range(x.dim())]  # (1, .., F, .., 1)
        y = x.to(cdtype)
        mean = self.mean.to(x.device).reshape(view) if self.with_mean else None
        if mean is not None and cdtype != torch.float64:
            # compensated pair: mean_hi + mean_lo carries the float64 mean in float32
            mean_hi = mean.to(cdtype)
            mean_lo = (mean - mean_hi.to(torch.float64)).to(cdtype)
        else:
            mean_hi, mean_lo = mean, None
        scale = self.scale.to(x.device, cdtype).reshape(view) if self.with_std else None
        if not inverse:
            if mean_hi is not None:
                y = y - mean_hi
            if mean_lo is not None:
                y = y - mean_lo
            if scale is not None:
                y = y / scale
        else:
            if scale is not None:
                y = y * scale
            if mean_lo is not None:
                y = y + mean_lo
            if mean_hi is not None:
                y = y + mean_hi
        y = y.to(out_dtype)
        return y.clone() if y is x else y

    def transform(self, x: Tensor) -> Tensor:
        """Standardize ``x``: ``(x - mean) / scale`` per feature (same as calling the module).

        Computes in float64 for float64 input and in float32 otherwise (with a
        compensated float32 mean), and returns the input's dtype (the default float
        dtype for integer input). NaNs stay NaN in place. Differentiable in ``x``.

        Raises:
            RuntimeError: before any fit. The call is wrong for the module's state, not
                for its argument, which is what a ValueError would say.
            ValueError: when the size of ``x`` at ``feature_dims`` is not the fitted
                feature shape.

        Example:
            >>> s = Standardizer().fit(torch.tensor([[0.0], [2.0]]))
            >>> s.transform(torch.tensor([[1.0], [3.0]]))
            tensor([[0.],
                    [2.]])
        """
        return self._standardize(x, inverse=False, who="Standardizer.transform")

    def forward(self, x: Tensor) -> Tensor:
        """Standardize ``x`` (see :meth:`transform`).

        Example:
            >>> s = Standardizer().fit(torch.tensor([[0.0], [2.0]]))
            >>> s(torch.tensor([[2.0]]))
            tensor([[1.]])
        """
        if isinstance(x, Proxy):
            return fx_leaf(self, x)
        return self.transform(x)

    def inverse_transform(self, y: Tensor) -> Tensor:
        """Undo :meth:`transform`: ``y * scale + mean``, back in the original units.

        Same dtypes, errors and precision rules as :meth:`transform`;
        ``inverse_transform(transform(x))`` returns ``x`` to within float rounding.

        Example:
            >>> s = Standardizer().fit(torch.tensor([[0.0], [2.0]]))
            >>> s.inverse_transform(torch.tensor([[-1.0], [3.0]]))
            tensor([[0.],
                    [4.]])
        """
        return self._standardize(y, inverse=True, who="Standardizer.inverse_transform")


def _make_scaler(spec: Standardizer | bool | None, name: str) -> Standardizer | None:
    if isinstance(spec, Standardizer):
        return spec
    if spec is True:
        return Standardizer()
    if spec is None or spec is False:
        return None
    raise TypeError(f"StandardizedModel expected {name} to be a Standardizer, True or None, "
                    f"got {type(spec).__name__}")


class StandardizedModel(NotScriptable, nn.Module):
    """A model that sees standardized inputs and targets but predicts in original units.

    ``forward(x) = y_scaler.inverse_transform(model(x_scaler(x)))``. Regression trains
    far better on standardized inputs and targets (gradients of comparable size for
    every weight and a loss of order 1), but predictions are wanted in the data's
    units; this module does both and saves as one ``state_dict`` (``model.*``,
    ``x_scaler.*``, ``y_scaler.*``).

    Training recipe:

    1. ``fit_scalers`` on the training data (before training; the scalers have no
       parameters, so ``model.parameters()`` only holds the wrapped model's).
    2. Minimize :meth:`standardized_loss` (the loss between the raw output and the
       standardized target), or for a custom loss use ``self(x, standardized_output=True)``
       against ``self.y_scaler.transform(y)``. Do not train on ``self(x)``: its loss is in
       the target's units, scaled by ``scale**2``.
    3. Predict with ``self(x)``, in the original units.

    Args:
        model: the wrapped model, fed standardized inputs, predicting standardized targets.
        x: the input Standardizer, ``True`` for ``Standardizer()``, or ``None`` for none.
            Default: ``None``.
        y: the target Standardizer, ``True``, or ``None``. Default: ``None``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(256, 1) * 20 + 100
        >>> y = 3000 * x + 5e4
        >>> sm = StandardizedModel(nn.Linear(1, 1), x=True, y=True).fit_scalers(x, y)
        >>> opt = torch.optim.SGD(sm.parameters(), lr=0.1)
        >>> for _ in range(100):
        ...     opt.zero_grad()
        ...     sm.standardized_loss(x, y).backward()
        ...     opt.step()
        >>> pred = sm(torch.tensor([[100.0]]))  # original units: 3000 * 100 + 5e4
        >>> abs(pred.item() - 350_000) < 50
        True
    """

    def __init__(self, model: nn.Module, x: Standardizer | bool | None = None,
                 y: Standardizer | bool | None = None) -> None:
        super().__init__()
        self.model = model
        self.register_module("x_scaler", _make_scaler(x, "x"))
        self.register_module("y_scaler", _make_scaler(y, "y"))

    def fit_scalers(self, x_data: Any, y_data: Any = None, *, x_key: Any = None,
                    y_key: Any = None, process_group: Any = None) -> StandardizedModel:
        """Fit the input and target scalers (see :meth:`Standardizer.fit`); returns ``self``.

        With ``y_data=None`` the targets come from the batches of ``x_data``:
        ``batch[1]`` of ``(x, y)`` batches, or ``batch[y_key]``; ``x_data`` is then read
        twice, so it must be re-iterable (a DataLoader or a list is, a generator is not).

        Args:
            x_data: inputs, or batches holding inputs (and targets).
            y_data: targets, or ``None`` to take them from ``x_data``. Default: ``None``.
            x_key, y_key: the ``key=`` for each scaler. Default: ``None``.
            process_group: passed to both fits. Default: ``None`` (local).

        Example:
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> x, y = torch.randn(64, 3), torch.randn(64, 2) * 10
            >>> sm = StandardizedModel(nn.Linear(3, 2), x=True, y=True)
            >>> _ = sm.fit_scalers(DataLoader(TensorDataset(x, y), batch_size=16))
            >>> sm.x_scaler.feature_shape, sm.y_scaler.feature_shape
            (torch.Size([3]), torch.Size([2]))
        """
        if self.x_scaler is not None:
            self.x_scaler.fit(x_data, key=x_key, process_group=process_group)
        if self.y_scaler is not None:
            if y_data is None:
                if isinstance(x_data, (Tensor, np.ndarray)):
                    raise ValueError(
                        "StandardizedModel.fit_scalers expected targets for the y scaler: "
                        "pass y_data, or batches of (x, y) as x_data; got a single "
                        f"{type(x_data).__name__} and y_data=None"
                    )
                y_data, y_key = x_data, (1 if y_key is None else y_key)
            self.y_scaler.fit(y_data, key=y_key, process_group=process_group)
        return self

    def forward(self, x: Tensor, *args: Any, standardized_output: bool = False,
                **kwargs: Any) -> Tensor:
        """Predict from raw inputs, in original target units (or standardized ones).

        Extra arguments are passed to the wrapped model.

        Args:
            x: raw inputs.
            standardized_output: return the model's output as is, in standardized target
                units (for training losses). Default: ``False``.

        Example:
            >>> sm = StandardizedModel(nn.Identity(), y=True).fit_scalers(
            ...     torch.zeros(2, 1), torch.tensor([[10.0], [30.0]]))
            >>> sm(torch.tensor([[1.0]])), sm(torch.tensor([[1.0]]), standardized_output=True)
            (tensor([[30.]]), tensor([[1.]]))
        """
        if isinstance(x, Proxy):
            return fx_leaf(self, x, *args, standardized_output=standardized_output, **kwargs)
        if self.x_scaler is not None:
            x = self.x_scaler(x)
        out = self.model(x, *args, **kwargs)
        if standardized_output or self.y_scaler is None:
            return out
        return self.y_scaler.inverse_transform(out)

    def standardized_loss(self, x: Tensor, y: Tensor,
                          loss_fn: Callable[[Tensor, Tensor], Tensor] = F.mse_loss) -> Tensor:
        """The training loss: ``loss_fn(model output, standardized y)``, in standardized units.

        Args:
            x: raw inputs.
            y: raw targets (standardized here by ``y_scaler``, if any).
            loss_fn: ``loss_fn(prediction, target)``. Default: ``F.mse_loss``.

        Example:
            >>> sm = StandardizedModel(nn.Identity(), y=True).fit_scalers(
            ...     torch.zeros(2, 1), torch.tensor([[10.0], [30.0]]))
            >>> sm.standardized_loss(torch.tensor([[1.0]]), torch.tensor([[30.0]]))
            tensor(0.)
        """
        target = self.y_scaler.transform(y) if self.y_scaler is not None else y
        return loss_fn(self(x, standardized_output=True), target)
