"""Running statistics past float16's range: an inference forward says so, once.

A BatchNorm stores its running variance in the model's dtype. float16 holds at most 65504,
so a channel whose input has a standard deviation above 256 stores ``inf`` (at
``model.half()``, at ``load_state_dict`` of a float32 checkpoint, or in a float16 training
step), and in inference that channel outputs its bias alone: no NaN, no error, a model
that predicts worse. torch's layers do exactly that silently; normkit's warn at the first
inference forward that reads such a statistic, and ``doctor`` names the overflow.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from oracle import TOL
from torch import nn

import normkit
from normkit.norms._core import check_running_statistics, statistic_problem

# (class, constructor kwargs, input shape, statistic, input scale past float16's range)
LAYERS = [
    (normkit.BatchNorm1d, {}, (16, 4), "running_var", 1000.0),
    (normkit.BatchNorm2d, {}, (8, 4, 3, 3), "running_var", 1000.0),
    (normkit.BatchNormAct2d, {}, (8, 4, 3, 3), "running_var", 1000.0),
    (normkit.SyncBatchNorm, {}, (8, 4, 3, 3), "running_var", 1000.0),
    (normkit.BatchRenorm2d, {}, (8, 4, 3, 3), "running_var", 1000.0),
    (normkit.InstanceNorm2d, {"track_running_stats": True, "affine": True}, (8, 4, 3, 3),
     "running_var", 1000.0),
    # (without group scaling: with it, running_phi is of the input scaled to RMS 1)
    (normkit.PowerNorm, {"group_num": None}, (8, 5, 4), "running_phi", 1000.0),
]
IDS = [cls.__name__ for cls, *_ in LAYERS]


def _trained(cls, kwargs, shape, scale):
    """A float32 layer trained (momentum 1: the last batch's statistics) on data of
    standard deviation ``scale``, and an input of that scale."""
    torch.manual_seed(0)
    layer = cls(4, **kwargs)
    if hasattr(layer, "momentum") and not isinstance(layer, normkit.PowerNorm):
        layer.momentum = 1.0
    if isinstance(layer, normkit.PowerNorm):
        layer.alpha_fwd, layer.warmup_iters = 0.0, 0  # running_phi = this batch's
    x = torch.randn(shape) * scale
    layer.train()
    for _ in range(2):
        layer(x)
    return layer.eval(), x


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize(("cls", "kwargs", "shape", "name", "scale"), LAYERS, ids=IDS)
def test_half_overflow_warns_once_naming_the_statistic_and_the_remedy(cls, kwargs, shape,
                                                                     name, scale):
    layer, x = _trained(cls, kwargs, shape, scale)
    assert float(getattr(layer, name).max()) > 65504  # (the premise: past float16)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    half = layer.half()
    assert torch.isinf(getattr(half, name)).any()
    _, first = _caught(lambda: half(x.half()))
    assert len(first) == 1
    text = str(first[0].message)
    assert text.startswith(f"{cls.__name__}(4") and f"{name} holds" in text
    assert "float16" in text and "65504" in text and "layer.float()" in text
    assert first[0].filename == __file__  # (at the caller's line, not in torch or normkit)
    _, again = _caught(lambda: half(x.half()))
    assert again == []  # unchanged since the check: not read again

    # the remedy: the layer in float32 (statistics from the float32 checkpoint) takes
    # float16 input, returns float16, silently, and equals the float32 layer
    half.float().load_state_dict(state)
    y, none = _caught(lambda: half(x.half()))
    assert none == [] and y.dtype == torch.float16 and torch.isfinite(y).all()
    expected = layer(x.half().float())
    torch.testing.assert_close(y.float(), expected, **TOL[torch.float16])


@pytest.mark.parametrize(("cls", "kwargs", "shape", "name", "scale"), LAYERS, ids=IDS)
def test_a_float32_checkpoint_loaded_into_a_float16_model_warns(cls, kwargs, shape, name,
                                                                scale):
    layer, x = _trained(cls, kwargs, shape, scale)
    target = cls(4, **kwargs).half().eval()
    target(x.half())  # (checked once with finite statistics)
    target.load_state_dict(layer.state_dict())  # in place: the version counter moves
    _, caught = _caught(lambda: target(x.half()))
    assert len(caught) == 1 and "overflowed" in str(caught[0].message)


@pytest.mark.parametrize("shape", [(8, 4, 3, 3), (64, 4, 64, 64)], ids=["small", "large"])
@pytest.mark.parametrize("cls", [normkit.BatchNorm2d, normkit.BatchNormAct2d,
                                 normkit.BatchRenorm2d], ids=lambda c: c.__name__)
def test_training_overflow_is_reported_at_the_next_inference_forward_only(cls, shape):
    """Also after an inference forward checked the statistics while they were finite:
    torch's batch_norm kernel updates them without moving their version counter, so a
    training forward forgets the check."""
    layer = cls(4).half()
    x = (torch.randn(shape) * 1000).half()
    layer.eval()(x)  # finite statistics: checked, silent
    layer.train()
    _, in_training = _caught(lambda: [layer(x) for _ in range(3)])
    assert in_training == [] and torch.isinf(layer.running_var).all()
    layer.eval()
    y, caught = _caught(lambda: layer(x))
    assert len(caught) == 1
    # what torch's own layer does with the same statistics: each channel its bias alone
    # (then the activation's)
    bias = layer.bias.detach().view(1, -1, 1, 1).expand_as(y)
    torch.testing.assert_close(y, bias.relu() if cls is normkit.BatchNormAct2d else bias)


def test_frozen_batch_norm_and_mean_only_warn_too():
    frozen = normkit.FrozenBatchNorm2d(4).half()
    frozen.running_var.fill_(float("inf"))
    _, caught = _caught(lambda: frozen(torch.randn(2, 4, 3, 3).half()))
    assert len(caught) == 1 and "running_var holds 4 infinite" in str(caught[0].message)
    mean_only = normkit.MeanOnlyBatchNorm2d(4).half().eval()
    mean_only.running_mean.copy_(torch.full((4,), 1e5))  # past float16: inf
    _, caught = _caught(lambda: mean_only(torch.randn(2, 4, 3, 3).half()))
    assert len(caught) == 1 and "running_mean holds 4 infinite" in str(caught[0].message)


def test_nan_statistics_are_not_called_an_overflow():
    bn = normkit.BatchNorm1d(3).eval()
    bn.running_mean[1] = float("nan")
    _, caught = _caught(lambda: bn(torch.randn(4, 3)))
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "running_mean holds 1 NaN/Inf value(s) of 3 (torch.float32)" in text
    assert "diverged" in text and "float16" not in text
    half = normkit.BatchNorm1d(3).half().eval()
    half.running_var[0] = float("nan")  # NaN in float16: not a range problem
    assert "overflowed" not in statistic_problem(half, "running_var", half.running_var)


def test_finite_statistics_and_training_mode_are_silent():
    model = nn.Sequential(normkit.BatchNorm2d(4), normkit.InstanceNorm2d(4),
                          normkit.GroupNorm(2, 4), normkit.BatchNormAct2d(4))
    x = torch.randn(8, 4, 3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.train()(x)
        model.half().eval()(x.half())
        model[0].running_var.fill_(float("inf"))
        model.train()(x.half())  # training normalizes by the batch: nothing read


def test_transforms_and_compilation_do_not_check():
    bn = normkit.BatchNorm1d(3).eval()
    bn.running_var.fill_(float("inf"))
    x = torch.randn(5, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y = torch.func.vmap(bn)(x)  # (a flag read back would fail under vmap)
        warnings.simplefilter("ignore", DeprecationWarning)  # (jit.trace's own)
        # (check_trace=False: its sanity check reruns the layer eagerly, which checks)
        traced = torch.jit.trace(bn, x[0], check_trace=False)
    assert torch.equal(y, bn.bias.detach().expand_as(y))
    assert torch.equal(traced(x[0]), bn.bias.detach().expand_as(x[0]))
    with pytest.warns(RuntimeWarning, match="running_var holds 3 NaN/Inf"):
        check_running_statistics(bn)  # eager: checked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_running_statistics(bn)  # unchanged


def test_statistics_made_under_inference_mode_are_checked_too():
    """Buffers created under ``torch.inference_mode`` (a model built or loaded there)
    have no version counter to key the once-per-change check by: they are checked by
    their identity and dtype, so a NaN in them warns once, and the layer still runs."""
    with torch.inference_mode():
        bn = normkit.BatchNorm1d(3).eval()
        bn.running_var[1] = float("nan")
        x = torch.randn(4, 3)
        with pytest.warns(RuntimeWarning, match="running_var holds 1 NaN/Inf"):
            y = bn(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = bn(x)  # (the same tensors: not read again)
        torch.testing.assert_close(again, y, equal_nan=True, rtol=0, atol=0)
    assert bool(y[:, 1].isnan().all()) and not bool(y[:, [0, 2]].isnan().any())


def test_doctor_names_the_float16_overflow_and_not_a_stale_statistic():
    from normkit.tools.doctor import doctor

    model = nn.Sequential(nn.Conv2d(1, 4, 3), normkit.BatchNorm2d(4))
    x = torch.randn(8, 1, 6, 6) * 2000
    with torch.no_grad():
        model[1].momentum = 1.0
        model(x)
    model.half().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = doctor(model, x.half())
    codes = [w.code for w in report.warnings]
    assert codes == ["invalid-state"]
    remedy = report.warnings[0].remedy
    assert remedy.startswith("running_var overflowed float16") and "layer.float()" in remedy
    model[1].running_var.fill_(float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = doctor(model, x.half())
    invalid = [w for w in report.warnings if w.code == "invalid-state"]
    assert len(invalid) == 1 and "diverged" in invalid[0].remedy


def test_data_parallel_replicas_are_not_checked():
    """nn.DataParallel broadcasts the buffers anew at every call: checking its replicas
    would read a flag back from every device at every forward."""
    bn = normkit.BatchNorm2d(4).half().eval()
    bn.running_var.fill_(float("inf"))
    replica = bn._replicate_for_data_parallel()  # (as torch.nn.parallel.replicate)
    replica._parameters = dict(bn._parameters)  # (replicate sets its copies on each device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        replica(torch.randn(2, 4, 3, 3).half())
    _, caught = _caught(lambda: bn(torch.randn(2, 4, 3, 3).half()))
    assert len(caught) == 1
