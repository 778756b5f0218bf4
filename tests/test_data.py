"""Standardizer and StandardizedModel: scikit-learn's StandardScaler, as torch modules."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from dist_workers import standardizer_data, standardizer_fits
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sklearn.preprocessing import StandardScaler
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from normkit.data import StandardizedModel, Standardizer

EPS64 = float(np.finfo(np.float64).eps)
STATS = ("mean", "var", "scale", "count")


def _table(n: int, seed: int, offset: float) -> np.ndarray:
    """(n, 6) float64: spread at an offset, tiny spread at the offset, two constants, wide, ties."""
    rng = np.random.default_rng(seed)
    return np.stack([
        offset + rng.standard_normal(n),
        offset + 1e-3 * rng.standard_normal(n),
        np.full(n, offset + 0.1),
        np.zeros(n),
        1e4 * rng.standard_normal(n),
        rng.integers(-3, 4, n).astype(np.float64),
    ], axis=1)


def _assert_same_stats(a: Standardizer, b: Standardizer, rtol: float = 1e-13) -> None:
    assert a.feature_shape == b.feature_shape
    for name in STATS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=rtol, atol=1e-12)


def _assert_matches_sklearn(ours: Standardizer, ref: StandardScaler, data: np.ndarray) -> None:
    n_seen = np.broadcast_to(ref.n_samples_seen_, (data.shape[1],))
    np.testing.assert_array_equal(ours.count.numpy(), n_seen)
    if ref.mean_ is not None:
        np.testing.assert_allclose(ours.mean.numpy(), ref.mean_, rtol=1e-13, atol=1e-13)
    # sklearn's incremental update knows the std to a few ulps of the mean (ours is exact,
    # see _assert_exact): 1e-5 relative at an offset of 1e8 with a spread of 1e-3
    mean_ulps = 8 * EPS64 * np.abs(ours.mean.numpy())
    if ref.var_ is not None:
        np.testing.assert_array_equal(ours.scale.numpy() == 1.0, ref.scale_ == 1.0)
        std = np.sqrt(ours.var.numpy())
        assert np.all(np.abs(std - np.sqrt(ref.var_)) <= 1e-12 * std + mean_ulps)
        assert np.all(np.abs(ours.scale.numpy() - ref.scale_) <= 1e-12 * ref.scale_ + mean_ulps)
    x = torch.from_numpy(data)
    y, y_ref = ours.transform(x).numpy(), ref.transform(data)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(data))  # NaNs stay in place
    spread = ours.scale.numpy() if ours.with_std else 1.0
    scale_rtol = (1e-12 + mean_ulps / spread) if ours.with_std else 0.0
    # x - mean rounds at the ulp of x itself: a few EPS64 * |x| on top
    tol = scale_rtol * np.abs(y_ref) + (1e-12 + 2 * mean_ulps + 4 * EPS64 * np.abs(data)) / spread
    assert np.all((np.abs(y - y_ref) <= tol) | np.isnan(data))
    back = ours.inverse_transform(torch.from_numpy(y)).numpy()
    np.testing.assert_allclose(back, data, rtol=1e-13, atol=1e-12)


def _exact_stats(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and biased variance of each column in exact rational arithmetic (the oracle)."""
    means, variances = [], []
    for column in data.T:
        values = [Fraction(float(v)) for v in column]
        mean = sum(values) / len(values)
        means.append(float(mean))
        variances.append(float(sum((v - mean) ** 2 for v in values) / len(values)))
    return np.array(means), np.array(variances)


def _assert_exact(ours: Standardizer, mean: np.ndarray, var: np.ndarray,
                  data: np.ndarray) -> None:
    """float64-exact: the mean to a few ulps of the largest value, the variance to 1e-13."""
    magnitude = np.nanmax(np.abs(data), axis=0)
    assert np.all(np.abs(ours.mean.numpy() - mean) <= 4 * EPS64 * magnitude)
    np.testing.assert_allclose(ours.var.numpy(), var, rtol=1e-13, atol=1e-300)


# ---------------------------------------------------------------- against scikit-learn


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=1, max_size=6),
       offset=st.sampled_from([0.0, 1e3, 1e8]), with_mean=st.booleans(),
       with_std=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_sklearn_for_any_chunking(sizes, offset, with_mean, with_std, seed):
    assume(sum(sizes) > 0)
    data = _table(sum(sizes), seed, offset)
    chunks = [torch.from_numpy(c) for c in np.split(data, np.cumsum(sizes)[:-1])]
    flags = {"with_mean": with_mean, "with_std": with_std}
    ours, ref = Standardizer(**flags), StandardScaler(**flags)
    for chunk in chunks:
        if len(chunk):
            ours.partial_fit(chunk)
            ref.partial_fit(chunk.numpy())
    _assert_matches_sklearn(ours, ref, data)
    # partial_fit over chunks == fit on the chunk list (empty chunks skipped) == fit on all
    _assert_same_stats(Standardizer(**flags).fit(chunks), ours)
    _assert_same_stats(Standardizer(**flags).fit(torch.from_numpy(data)), ours)
    mean, var = _exact_stats(data)
    _assert_exact(ours, mean, var, data)
    # the constant features get scale 1 and transform to (numerically) 0
    assert ours.scale[2] == 1.0 and ours.scale[3] == 1.0
    if with_mean:
        assert float(ours.transform(torch.from_numpy(data))[:, 2:4].abs().max()) < 1e-6


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(1, 15), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_nan_ignore_matches_sklearn(sizes, seed):
    rng = np.random.default_rng(seed)
    data = _table(sum(sizes) + 1, seed, 1e3)
    data[1:][rng.random((sum(sizes), data.shape[1])) < 0.3] = np.nan  # row 0 stays complete
    ours = Standardizer(nan="ignore")
    for chunk in np.split(data, np.cumsum([1, *sizes])[:-1]):
        ours.partial_fit(torch.from_numpy(chunk))
    # sklearn's partial_fit makes a variance NaN once a chunk has no value of a feature; fit
    # on the whole does not
    _assert_matches_sklearn(ours, StandardScaler().fit(data), data)
    _assert_same_stats(Standardizer(nan="ignore").fit(torch.from_numpy(data)), ours)
    valid = [column[~np.isnan(column)][:, None] for column in data.T]
    mean, var = zip(*(_exact_stats(v) for v in valid), strict=True)
    _assert_exact(ours, np.concatenate(mean), np.concatenate(var), data)


def test_feature_without_any_value_is_fit_as_mean_0_scale_1():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("nan")]])
    s = Standardizer(nan="ignore").fit(x)
    assert s.count.tolist() == [2.0, 0.0] and s.mean.tolist() == [2.0, 0.0]
    assert s.scale.tolist() == [1.0, 1.0]
    assert torch.isnan(s(x)[:, 1]).all()


# ---------------------------------------------------------------- numerics and dtypes


def test_float32_at_1e8_offset_keeps_its_digits():
    k = torch.randint(-50, 51, (1000, 3), generator=torch.Generator().manual_seed(0))
    x = (1e8 + 8.0 * k).float()  # exactly representable: the float32 grid at 1e8 is 8
    exact = 1e8 + 8.0 * k.double()
    assert torch.equal(x.double(), exact)
    s = Standardizer().fit(list(x.split([1, 499, 500])))
    torch.testing.assert_close(s.mean, 1e8 + 8.0 * k.double().mean(0), rtol=1e-16, atol=0)
    torch.testing.assert_close(s.var, 64.0 * k.double().var(0, correction=0), rtol=1e-12, atol=0)
    y = s(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), (exact - s.mean) / s.scale, rtol=1e-6, atol=1e-6)
    assert torch.equal(s.inverse_transform(y), x)
    # the float32 mean alone is up to 4 off, i.e. ~0.02 standard deviations
    naive = (x - s.mean.float()) / s.scale.float()
    assert float((naive.double() - (exact - s.mean) / s.scale).abs().max()) > 1e-3


def test_half_input_neither_overflows_nor_changes_dtype():
    x = torch.full((20_000, 2), 6e4, dtype=torch.float16)  # sum 1.2e9 overflows float16
    x[::2] = 5e4
    s = Standardizer().fit(x)
    torch.testing.assert_close(s.mean, torch.full((2,), 54992.0, dtype=torch.float64))
    y = s(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.abs().float(), torch.ones_like(y, dtype=torch.float32))
    assert torch.equal(s.inverse_transform(y), x)


def test_integer_input_is_fit_in_float64_and_transforms_to_default_float():
    x = torch.tensor([[1, 2], [3, 2], [5, 2]])
    s = Standardizer().fit(x)
    _assert_same_stats(s, Standardizer().fit(x.double()))
    assert s(x).dtype == torch.get_default_dtype()
    assert s(x.double()).dtype == torch.float64


def test_transform_is_differentiable():
    s = Standardizer().fit(torch.randn(10, 3) * 4)
    x = torch.randn(5, 3, requires_grad=True)
    s(x).sum().backward()
    torch.testing.assert_close(x.grad, (1 / s.scale.float()).expand(5, 3))


# ---------------------------------------------------------------- feature dims


def test_per_channel_images_match_reshaped_table():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 3, 5, 4, generator=gen) * torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1, 1)
         + torch.tensor([0.0, -5.0, 1e4]).view(1, 3, 1, 1))
    table = x.permute(0, 2, 3, 1).reshape(-1, 3)
    a, b = Standardizer((1,)).fit(x), Standardizer().fit(table)
    _assert_same_stats(a, b)
    assert a.count.tolist() == [120.0] * 3
    _assert_same_stats(Standardizer(-3).fit(x), a)
    expected = b(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    torch.testing.assert_close(a(x), expected)
    torch.testing.assert_close(a(x.to(memory_format=torch.channels_last)), expected)
    torch.testing.assert_close(a.inverse_transform(a(x)), x)
    per_pixel = Standardizer((-2, -1)).fit(x)
    assert per_pixel.feature_shape == (5, 4)
    torch.testing.assert_close(per_pixel.mean, x.double().mean((0, 1)))
    everything = Standardizer(()).fit(x)
    assert everything.feature_shape == () and float(everything.count) == x.numel()


def test_sequences_reduce_over_batch_and_time():
    x = torch.randn(4, 7, 3, dtype=torch.float64)
    s = Standardizer().fit(x)
    _assert_same_stats(s, Standardizer().fit(x.reshape(-1, 3)))
    torch.testing.assert_close(s(x[0, 0]), (x[0, 0] - s.mean) / s.scale)  # a single row


# ---------------------------------------------------------------- data sources


def test_dataloader_tuple_and_dict_batches():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 3, generator=gen) * 3 + 1, torch.randn(50, 2, generator=gen) * 100
    on_x, on_y = Standardizer().fit(x), Standardizer().fit(y)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    _assert_same_stats(Standardizer().fit(loader), on_x)
    _assert_same_stats(Standardizer().fit(loader, key=1), on_y)
    _assert_same_stats(Standardizer().fit(loader, key=-1), on_y)
    dicts = DataLoader([{"x": x[i], "y": y[i]} for i in range(50)], batch_size=16)
    _assert_same_stats(Standardizer().fit(dicts, key="y"), on_y)
    _assert_same_stats(Standardizer().fit({"x": x}, key="x"), on_x)
    _assert_same_stats(Standardizer().fit(x.numpy()), on_x)
    _assert_same_stats(Standardizer().fit(iter(x.split(7))), on_x)  # a one-shot generator
    streamed = Standardizer()
    for batch in loader:
        streamed.partial_fit(batch)  # an (x, y) batch: x
    _assert_same_stats(streamed, on_x)


def test_failed_fit_keeps_the_previous_statistics():
    s = Standardizer().fit(torch.randn(5, 3))
    before = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(ValueError, match="NaN"):
        s.fit([torch.randn(4, 3), torch.tensor([[0.0, float("nan"), 1.0]])])
    with pytest.raises(ValueError, match="feature shape"):
        s.partial_fit(torch.randn(2, 4))
    for k, v in s.state_dict().items():
        assert torch.equal(v, before[k])


# ---------------------------------------------------------------- checkpoints


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_fitted_state_dict_loads_into_fresh_standardizer():
    x = torch.randn(8, 3, 4, 4) * 5 + 2
    x[0, 0, 0, 0] = float("nan")
    s = Standardizer((1,), nan="ignore").fit(x)
    state = _roundtrip(s.state_dict())
    assert set(state) == set(STATS) and all(v.dtype == torch.float64 for v in state.values())
    fresh = Standardizer((1,), nan="ignore")
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    assert fresh.fitted and fresh.feature_shape == (3,)
    _assert_same_stats(fresh, s, rtol=0)
    torch.testing.assert_close(fresh(x), s(x), rtol=0, atol=0, equal_nan=True)
    more = torch.randn(2, 3, 4, 4)
    _assert_same_stats(fresh.partial_fit(more), Standardizer((1,), nan="ignore").fit([x, more]))
    other = Standardizer((1,)).fit(torch.randn(2, 7, 1, 1))  # a fitted one takes the new shape
    other.load_state_dict(state)
    _assert_same_stats(other, s, rtol=0)


def test_unfitted_state_dict_round_trips():
    state = _roundtrip(Standardizer().state_dict())
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: (0,) for k in STATS}
    fresh = Standardizer()
    fresh.load_state_dict(state)
    assert not fresh.fitted
    fitted = Standardizer().fit(torch.randn(4, 3))
    fitted.load_state_dict(state)  # loading an unfitted checkpoint un-fits
    assert not fitted.fitted and fitted.feature_shape is None


def test_inconsistent_checkpoint_is_refused():
    state = Standardizer().fit(torch.randn(4, 3)).state_dict()
    state["count"] = torch.ones(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"one shape.*mean \(3,\).*count \(4,\)"):
        Standardizer().load_state_dict(state)


def test_dtype_casts_keep_float64_statistics_and_reset():
    s = Standardizer().fit(torch.randn(6, 2) + 1e6)
    mean = s.mean.clone()
    s.half()
    s.to(torch.float32)
    assert s.mean.dtype == torch.float64 and torch.equal(s.mean, mean)
    assert "feature_shape=(2,)" in repr(s)
    s.reset_statistics()
    assert not s.fitted and "unfitted" in repr(s)


# ---------------------------------------------------------------- bad input

NAN = float("nan")


def _fitted() -> Standardizer:
    return Standardizer().fit(torch.randn(4, 3))


BAD = {
    "transform-wrong-features": (lambda: _fitted()(torch.randn(2, 4)), ValueError,
                                 ["expected feature shape (3,)", "(4,)", "(2, 4)"]),
    "inverse-wrong-features": (lambda: _fitted().inverse_transform(torch.randn(2, 5)),
                               ValueError, ["(3,)", "(5,)"]),
    "partial-fit-wrong-features": (lambda: _fitted().partial_fit(torch.randn(2, 4)), ValueError,
                                   ["(3,)", "(4,)"]),
    "batches-disagree": (lambda: Standardizer().fit([torch.randn(2, 3), torch.randn(2, 4)]),
                         ValueError, ["(3,)", "(4,)", "batch 1"]),
    "nan-raise": (lambda: Standardizer().fit(torch.tensor([[0.0, NAN], [1.0, 2.0], [NAN, NAN]])),
                  ValueError, ["3 NaN", "index (0, 1), (2, 0), (2, 1)", "nan='ignore'"]),
    "nan-raise-in-batch": (lambda: Standardizer().fit([torch.ones(2, 1), torch.tensor([[NAN]])]),
                           ValueError, ["1 NaN", "batch 1"]),
    "inf": (lambda: Standardizer(nan="ignore").fit(torch.tensor([[float("inf")], [1.0]])),
            ValueError, ["finite", "1 infinite"]),
    "zero-size-fit": (lambda: Standardizer().fit(torch.empty(0, 3)), ValueError, ["zero-size"]),
    "zero-size-iterable": (lambda: Standardizer().fit([torch.empty(0, 3)]), ValueError,
                           ["zero-size"]),
    "zero-size-partial-fit": (lambda: Standardizer().partial_fit(torch.empty(0, 3)), ValueError,
                              ["zero-size", "(0, 3)"]),
    "zero-features": (lambda: Standardizer().fit(torch.empty(5, 0)), ValueError, ["zero-size"]),
    "transform-before-fit": (lambda: Standardizer()(torch.randn(2, 3)), RuntimeError,
                             ["not fitted", "fit()"]),
    "inverse-before-fit": (lambda: Standardizer().inverse_transform(torch.randn(2, 3)),
                           RuntimeError, ["not fitted"]),
    "bad-nan-policy": (lambda: Standardizer(nan="skip"), ValueError, ["'raise'", "'skip'"]),
    "negative-eps": (lambda: Standardizer(eps=-1.0), ValueError, ["eps >= 0", "-1.0"]),
    "duplicate-dims": (lambda: Standardizer((1, 1)), ValueError, ["distinct", "(1, 1)"]),
    "same-dim-twice": (lambda: Standardizer((1, -1)).fit(torch.randn(3, 2)), ValueError,
                       ["same dim twice", "(3, 2)"]),
    "non-int-dims": (lambda: Standardizer(1.5), TypeError, ["ints", "1.5"]),
    "too-few-dims": (lambda: Standardizer((1,)).fit(torch.randn(5)), ValueError,
                     ["at least 2 dims", "1D", "(5,)"]),
    "no-sample-dims": (lambda: Standardizer().fit(torch.randn(5)), ValueError,
                       ["no samples", "(5,)", "unsqueeze"]),
    "dict-without-key": (lambda: Standardizer().fit([{"x": torch.ones(2, 1), "y": 1}]),
                         ValueError, ["key=", "['x', 'y']", "batch 0"]),
    "dict-missing-key": (lambda: Standardizer().fit({"x": torch.ones(2, 1)}, key="z"), KeyError,
                         ["'z'", "['x']"]),
    "key-on-tensor": (lambda: Standardizer().fit(torch.ones(2, 1), key=0), ValueError,
                      ["key=0", "Tensor"]),
    "tuple-index": (lambda: Standardizer().fit([(torch.ones(2, 1),)], key=3), IndexError,
                    ["1 items", "3"]),
    "batch-type": (lambda: Standardizer().fit(["text"]), TypeError, ["str", "batch 0"]),
    "nested-list": (lambda: Standardizer().fit([[1.0, 2.0], [3.0, 4.0]]), TypeError,
                    ["got float", "nested list of numbers", "torch.tensor(data)"]),
    "data-type": (lambda: Standardizer().fit(3), TypeError, ["iterable", "int"]),
    "complex": (lambda: Standardizer().fit(torch.ones(2, 2, dtype=torch.complex64)), ValueError,
                ["real-valued", "complex64"]),
    "group-without-init": (lambda: Standardizer().fit(torch.ones(2, 1), process_group=object()),
                           RuntimeError, ["not initialized", "process_group=None"]),
    "model-without-targets": (lambda: StandardizedModel(nn.Linear(1, 1), y=True).fit_scalers(
        torch.ones(2, 1)), ValueError, ["y_data", "Tensor"]),
    "model-bad-scaler": (lambda: StandardizedModel(nn.Linear(1, 1), x="yes"), TypeError,
                         ["Standardizer, True or None", "str"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_message(name):
    call, error, fragments = BAD[name]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ---------------------------------------------------------------- StandardizedModel


def _regression():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 2, generator=gen) * torch.tensor([20.0, 0.5]) + torch.tensor([100.0, -3.0])
    y = 3000 * x[:, :1] - 40 * x[:, 1:] + 5e4
    return x, y


def _train(module: nn.Module, loss, steps: int, lr: float) -> None:
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()


def _rmse(pred: Tensor, y: Tensor) -> float:
    return float((pred.double() - y.double()).square().mean().sqrt())


def test_standardized_regression_beats_raw_and_predicts_original_units():
    x, y = _regression()
    torch.manual_seed(0)
    sm = StandardizedModel(nn.Linear(2, 1), x=True, y=True).fit_scalers(x, y)
    _train(sm, lambda: sm.standardized_loss(x, y), steps=100, lr=0.1)
    with torch.no_grad():
        pred = sm(x)
        std_error = _rmse(pred, y)
        torch.testing.assert_close(sm(x, standardized_output=True), sm.y_scaler(pred),
                                   rtol=1e-5, atol=1e-5)
    raw_errors = []
    for lr in (1e-7, 1e-6, 1e-5, 1e-4):  # the best raw run, for fairness
        torch.manual_seed(0)
        raw = nn.Linear(2, 1)
        _train(raw, lambda raw=raw: nn.functional.mse_loss(raw(x), y), steps=100, lr=lr)
        with torch.no_grad():
            error = _rmse(raw(x), y)
        raw_errors.append(error if np.isfinite(error) else float("inf"))
    assert std_error < 1.0 < float(y.std())  # original units: a y of ~3.5e5 to within 1
    assert std_error < 1e-3 * min(raw_errors)


def test_standardized_model_saves_and_loads_as_one_module():
    x, y = _regression()
    sm = StandardizedModel(nn.Linear(2, 1), x=True, y=Standardizer()).fit_scalers(
        DataLoader(TensorDataset(x, y), batch_size=100))
    _train(sm, lambda: sm.standardized_loss(x, y, nn.functional.l1_loss), steps=10, lr=0.1)
    state = _roundtrip(sm.state_dict())
    assert {"model.weight", "model.bias", "x_scaler.mean", "y_scaler.scale"} <= set(state)
    fresh = StandardizedModel(nn.Linear(2, 1), x=True, y=True)
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        assert torch.equal(fresh(x), sm(x))
    assert list(fresh.parameters()) == list(fresh.model.parameters())


def test_standardized_model_without_scalers_is_the_model():
    lin = nn.Linear(3, 1)
    sm = StandardizedModel(lin).fit_scalers(torch.randn(4, 3))
    x = torch.randn(4, 3)
    assert torch.equal(sm(x), lin(x))
    assert set(sm.state_dict()) == {"model.weight", "model.bias"}


# ---------------------------------------------------------------- distributed


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="needs torch.distributed with gloo")
def test_distributed_fit_equals_single_process_fit():
    ranks = run_ranks(standardizer_fits, 2, timeout=120)
    whole = Standardizer(nan="ignore").fit(standardizer_data())
    for scenario in ("uneven", "empty"):
        for name in STATS:  # bitwise the same on every rank, the union's statistics
            assert torch.equal(ranks[0][scenario][name], ranks[1][scenario][name])
        fitted = Standardizer(nan="ignore")
        fitted.load_state_dict(ranks[0][scenario])
        _assert_same_stats(fitted, whole, rtol=1e-13)
    assert ranks[1]["error"].startswith("ValueError: Standardizer.fit found")
    assert ranks[0]["error"].startswith("RuntimeError: Standardizer.fit failed on rank 1")
    for r in range(2):
        assert torch.equal(ranks[r]["kept"]["mean"], torch.ones(4, dtype=torch.float64))
        assert "rank 0: (3,), rank 1: (4,)" in ranks[r]["shapes"]
        assert "zero-size data on all 2 ranks" in ranks[r]["all_empty"]


def test_standardizer_and_standardized_model_compile_without_graph_breaks():
    """torch.compile(fullgraph=True) of the transform, its inverse and the wrapped model's
    prediction and loss: no graph break (a builtin's ``default=`` keyword used to stop
    Dynamo), the same values as eager mode, at an offset of 100 too."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=gen) * 10 + 100
    y = torch.randn(50, 1, generator=gen) * 5 + 3
    scaler = Standardizer().fit(x)
    compiled = torch.compile(scaler, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), scaler(x))
    inverse = torch.compile(scaler.inverse_transform, fullgraph=True, backend="aot_eager")
    assert torch.equal(inverse(scaler(x)), scaler.inverse_transform(scaler(x)))
    torch.manual_seed(0)
    model = StandardizedModel(nn.Linear(3, 1), x=True, y=True).fit_scalers(x, y)
    predict = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(predict(x), model(x))
    loss = torch.compile(model.standardized_loss, fullgraph=True, backend="aot_eager")
    assert torch.equal(loss(x, y), model.standardized_loss(x, y))
