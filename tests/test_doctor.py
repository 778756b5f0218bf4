"""normkit.tools.doctor and normkit.tools.recommend: warnings, statistics, CLI, rules."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import normkit
from normkit import cli
from normkit.tools import doctor as doctor_mod
from normkit.tools.doctor import doctor, example_batch_from_shape, infer_architecture
from normkit.tools.recommend import FAMILIES, NOTES, RULES, TASKS, recommend

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
sys.path.insert(0, str(TESTS))

import doctor_models  # noqa: E402


def codes(report) -> list[str]:
    return [w.code for w in report.warnings]


def finding(report, code):
    matches = [w for w in report.warnings if w.code == code]
    assert len(matches) == 1, (code, codes(report))
    return matches[0]


def images(n, c=3, h=8, w=8, *, seed=0, offset=0.0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=gen) * scale + offset


# --------------------------------------------------------------------------- healthy


def test_healthy_cnn_in_train_mode_with_grad_is_silent():
    model = doctor_models.healthy_cnn()
    report = doctor(model, images(64))
    assert report.ok and report.warnings == []
    assert [layer.name for layer in report.layers] == ["1", "4"]
    assert {layer.statistics for layer in report.layers} == {"batch"}
    assert report.architecture == "cnn" and report.batch_size == 64
    assert report.recommendation.family == "bn"
    assert "No warnings." in report.render()


def test_eval_model_after_update_bn_stats_is_silent():
    model = doctor_models.healthy_cnn().eval()
    data = [images(64, seed=s, offset=3.0, scale=2.0) for s in range(4)]
    with torch.no_grad():
        assert "stale-running-stats" in codes(doctor(model, data[0]))
    normkit.update_bn_stats(model, data)
    with torch.no_grad():
        report = doctor(model, images(64, seed=9, offset=3.0, scale=2.0))
    assert report.warnings == []
    assert {layer.statistics for layer in report.layers} == {"running"}
    assert all(layer.running.mean_shift_rms < 0.2 for layer in report.layers)


# --------------------------------------------------------------------------- each warning


def test_bn_at_batch_2_on_1x1_spatial_has_few_values():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    report = doctor(model, images(2, h=1, w=1))
    assert codes(report) == ["few-values"]
    w = finding(report, "few-values")
    assert w.layer == "1" and w.severity == "warning"
    assert "2 value(s) per channel" in w.message and "GroupNorm" in w.remedy
    assert report.layers[0].values_per_stat == 2
    assert report.recommendation.family == "gn"


def test_bn_training_on_few_images_is_a_small_batch():
    model = doctor_models.healthy_cnn()
    report = doctor(model, images(4))
    w = finding(report, "small-batch")
    assert w.layers == ("1", "4")  # reported once for the whole model
    assert "Wu & He" in w.message and codes(report) == ["small-batch"]


def test_train_mode_under_no_grad_is_validation_in_train_mode():
    model = doctor_models.healthy_cnn()
    with torch.no_grad():
        report = doctor(model, images(64))
    w = finding(report, "train-under-no-grad")
    assert w.layers == ("1", "4") and "model.eval()" in w.remedy
    assert not report.grad_enabled and codes(report) == ["train-under-no-grad"]
    with torch.inference_mode():
        assert codes(doctor(model, images(64))) == ["train-under-no-grad"]
    with torch.no_grad():
        assert doctor(nn.Sequential(nn.LayerNorm(8)), torch.randn(4, 8)).warnings == []


class Checkpointed(nn.Module):
    """A block under activation checkpointing, as Hugging Face's
    gradient_checkpointing_enable() runs each layer (reentrant by default)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = doctor_models.healthy_cnn()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_training_is_not_validation_in_train_mode(reentrant):
    """Reentrant checkpointing runs the first forward without autograd (the backward
    reruns it with autograd on): no train-under-no-grad there; under the caller's own
    no_grad it still is."""
    model = Checkpointed(reentrant)
    x = images(64).requires_grad_()
    report = doctor(model, x)
    assert report.warnings == [] and all(layer.grad_enabled for layer in report.layers)
    with torch.no_grad(), pytest.warns(UserWarning) if reentrant else nullcontext():
        report = doctor(model, images(64))  # (torch: "None of the inputs have requires_grad")
    assert codes(report) == ["train-under-no-grad"]


def test_stale_running_statistics_point_to_update_bn_stats():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).eval()  # running_mean 0, running_var 1
    x = torch.randn(64, 3, dtype=torch.float64) + 5.0
    report = doctor(nn.Sequential(bn), x)
    w = finding(report, "stale-running-stats")
    assert "normkit.update_bn_stats" in w.remedy and "num_batches_tracked is 0" in w.message
    running = report.layers[0].running
    batch_mean, batch_var = x.mean(0), x.var(0)  # the unbiased variance, as in running_var
    expected_shift = (batch_mean.abs() / math.sqrt(1 + bn.eps))
    assert running.mean_shift_max == pytest.approx(float(expected_shift.max()), rel=1e-6)
    assert running.mean_shift_rms == pytest.approx(
        float(expected_shift.square().mean().sqrt()), rel=1e-6)
    assert running.var_ratio_min == pytest.approx(float(batch_var.min()), rel=1e-6)
    assert running.var_ratio_max == pytest.approx(float(batch_var.max()), rel=1e-6)
    assert running.var_ratio_gmean == pytest.approx(float(batch_var.log().mean().exp()),
                                                    rel=1e-6)


def test_frozen_batchnorm_with_mismatched_statistics_is_stale_in_train_mode_too():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), normkit.FrozenBatchNorm2d(4)).train()
    report = doctor(model, images(16, scale=10.0))
    w = finding(report, "stale-running-stats")
    assert "freeze_batchnorm" in w.remedy
    assert report.layers[0].family == "frozenbn" and report.layers[0].statistics == "running"


def test_variance_mismatch_alone_is_stale():
    bn = nn.BatchNorm1d(4).eval()
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    report = doctor(bn, (x - x.mean(0)) * 10)
    assert report.layers[0].running.mean_shift_rms < 1.0
    assert "stale-running-stats" in codes(report)


def test_nan_input_is_reported_once_at_the_first_norm_layer():
    model = doctor_models.healthy_cnn()
    x = images(64)
    x[3, 1, 2, 2] = float("nan")
    report = doctor(model, x)
    w = finding(report, "nonfinite-input")
    assert w.severity == "error" and w.layer == "1" and w.layers == ("1", "4")
    assert report.warnings[0] is w  # errors first
    assert report.layers[0].input.nonfinite > 0
    assert "nonfinite-output" not in codes(report)
    data = json.loads(report.to_json())  # strict JSON: NaN statistics become null
    assert data["layers"][0]["input"]["mean"] is None


def test_finite_input_nan_output_and_invalid_state():
    ln = nn.LayerNorm(4, eps=0.0)
    report = doctor(ln, torch.ones(3, 4))  # constant rows: 0 / sqrt(0)
    assert codes(report) == ["nonfinite-output"]
    bn = nn.BatchNorm1d(3).eval()
    with torch.no_grad():
        bn.running_var[1] = -1.0
        bn.weight[0] = float("inf")
    report = doctor(bn, torch.randn(32, 3))
    w = finding(report, "invalid-state")
    assert "weight has 1 NaN/Inf" in w.message and "running_var has 1 negative" in w.message


def test_collapsed_gamma():
    model = doctor_models.healthy_cnn()
    with torch.no_grad():
        model[4].weight.zero_()
        model[1].weight[:2] = 1e-5
    report = doctor(model, images(64))
    found = [w for w in report.warnings if w.code == "collapsed-gamma"]
    assert [w.layer for w in found] == ["1"]
    assert "2 of 8 gamma values" in found[0].message
    # every gamma exactly 0: the zero-init-residual start (torchvision, timm), an info
    zero = [w for w in report.warnings if w.code == "zero-init-gamma"]
    assert [(w.layer, w.severity) for w in zero] == [("4", "info")]
    assert "every gamma value is exactly 0" in zero[0].message
    gammas = {layer.name: layer.gamma for layer in report.layers}
    assert gammas["4"].fraction_collapsed == 1.0 and gammas["4"].min_abs == 0.0
    assert gammas["1"].collapsed == 2 and gammas["1"].fraction_collapsed == 0.25


def test_informational_codes():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=None))
    assert codes(doctor(model, torch.randn(64, 4))) == ["cumulative-momentum"]
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, track_running_stats=False)).eval()
    report = doctor(model, torch.randn(64, 4))
    assert codes(report) == ["batch-stats-in-eval"]
    assert finding(report, "batch-stats-in-eval").severity == "info"
    report = doctor(nn.Linear(4, 3), torch.randn(8, 4))
    assert codes(report) == ["no-norm-layers"] and report.layers == []
    # a normalizer-free network (weight-standardized convolutions) is named as one
    nf = nn.Sequential(normkit.weight_standardization(nn.Conv2d(3, 4, 3), gamma=1.0,
                                                      gain=True), nn.ReLU())
    found = finding(doctor(nf, images(8)), "no-norm-layers")
    assert "1 layer(s) with weight standardization" in found.message
    assert "normkit.AGC" in found.remedy


def test_a_keras_momentum_given_to_pytorch_is_a_warning():
    """Keras' and Flax's BatchNorm momentum is the weight of the past (0.99), PyTorch's
    the weight of the new batch (0.1): 0.99 ported as is makes the running statistics
    follow the last few batches (article §5.3, normkit.conventions)."""
    def model(momentum, **kwargs):
        return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=momentum, **kwargs),
                             nn.Linear(3, 3), normkit.BatchNorm1d(3, momentum=momentum))

    for train in (True, False):
        report = doctor(model(0.99).train(train), torch.randn(64, 4))
        found = finding(report, "momentum-convention")
        assert found.severity == "warning" and found.layers == ("1", "3")
        assert "momentum=0.99" in found.message and "PyTorch's 0.01" in found.message
        assert "momentum=0.01" in found.remedy and "update_bn_stats" in found.remedy
    assert "momentum-convention" not in codes(doctor(model(0.5), torch.randn(64, 4)))
    # (exactly 1: the last batch's statistics, what precise-BN code sets on purpose)
    assert "momentum-convention" not in codes(doctor(model(1.0), torch.randn(64, 4)))
    assert "momentum-convention" not in codes(doctor(model(0.1), torch.randn(64, 4)))
    untracked = nn.Sequential(nn.Linear(4, 3),
                              nn.BatchNorm1d(3, momentum=0.99, track_running_stats=False))
    assert codes(doctor(untracked, torch.randn(64, 4))) == []


def test_a_failing_analysis_never_breaks_the_run(monkeypatch):
    def broken(cls, x, axis):
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor_mod.TensorStats, "of", classmethod(broken))
    report = doctor(nn.Sequential(nn.LayerNorm(4)), torch.randn(2, 4))
    assert report.ok and codes(report) == ["analysis-failed"]


def test_norms_of_the_models_own_classes_are_reported_and_checked_for_nan():
    """Hugging Face's LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm are classes of their own:
    the doctor reports them (it said "no normalization layer" for a Llama), names them in
    one info, catches NaN there, and judges no gamma (Gemma's scale is 1 + weight)."""
    own = doctor_models.OwnRMSNorm
    model = nn.Sequential(nn.Linear(4, 8), own(8), nn.Linear(8, 8), own(8, plus_one=True),
                          nn.Linear(8, 2))
    x = torch.randn(16, 4)
    report = doctor(model, x)
    assert [(layer.name, layer.family, layer.statistics, layer.gamma)
            for layer in report.layers] == [("1", "own", "unknown", None),
                                            ("3", "own", "unknown", None)]
    assert codes(report) == ["own-norm-layers"]  # no zero-init-gamma for the 1 + 0 scale
    w = finding(report, "own-norm-layers")
    assert w.severity == "info" and w.layers == ("1", "3")
    assert "2 OwnRMSNorm" in w.message and "normkit.RMSNorm" in w.remedy
    table = report.render()
    assert "| OwnRMSNorm | train | unknown |           - |" in table
    x[2, 1] = float("nan")
    report = doctor(model, x)
    assert finding(report, "nonfinite-input").layer == "1"
    with torch.no_grad():
        model[3].weight[0] = float("inf")
    report = doctor(model, torch.randn(16, 4))
    assert finding(report, "invalid-state").layer == "3"
    # a wrapper named "...Norm..." (lucidrains' PreNorm) is not a norm layer itself
    class PreNorm(nn.Module):
        def __init__(self, dim, fn):
            super().__init__()
            self.norm, self.fn = nn.LayerNorm(dim), fn

        def forward(self, x):
            return self.fn(self.norm(x))

    report = doctor(PreNorm(4, nn.Linear(4, 4)), torch.randn(16, 4))
    assert [layer.name for layer in report.layers] == ["norm"] and report.warnings == []


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("module, shape, values, axis", [
    (normkit.BatchNorm2d(6), (5, 6, 4, 3), 5 * 4 * 3, 1),
    (nn.BatchNorm1d(6), (7, 6), 7, 1),
    (normkit.GroupNorm(3, 6), (5, 6, 4, 3), 2 * 4 * 3, 1),
    (nn.LayerNorm((4, 6)), (5, 3, 4, 6), 24, -1),
    (normkit.LayerNorm2d(6), (5, 6, 4, 3), 6, 1),
    (normkit.RMSNorm(6), (5, 7, 6), 6, -1),
    (nn.InstanceNorm2d(6, affine=True), (5, 6, 4, 3), 12, 1),
    (nn.InstanceNorm1d(6), (6, 10), 10, 0),  # unbatched (C, L)
    (normkit.FrozenBatchNorm2d(6), (5, 6, 4, 3), 60, 1),
    (normkit.MeanOnlyBatchNorm2d(6), (5, 6, 4, 3), 60, 1),
    (normkit.BatchRenorm2d(6), (5, 6, 4, 3), 60, 1),
    # timm's LayerNorm2d, HF's ConvNextLayerNorm: channels along dim 1, not the last
    (doctor_models.ChannelsFirstLayerNorm(6), (5, 6, 4, 3), 6, 1),
    # a norm of the model's own class: values per statistic unknown (0), no gamma
    (doctor_models.OwnRMSNorm(6), (5, 7, 6), 0, -1),
])
def test_statistics_match_direct_computation(module, shape, values, axis):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * 2 + 3).to(torch.float32)
    with torch.no_grad():
        if getattr(module, "weight", None) is not None:
            module.weight.copy_(torch.linspace(0.5, 2.0, module.weight.numel()).view_as(
                module.weight))
    before = copy.deepcopy(module.state_dict())
    report = doctor(module, x)
    assert report.ok
    for key, value in module.state_dict().items():  # the doctor changed nothing
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    layer = report.layers[0]
    assert layer.family == doctor_mod.norm_family(module)
    assert layer.values_per_stat == values and layer.input_shape == shape
    with torch.no_grad():
        y = module(x)  # the buffers were restored, so this is the doctor's call again
    for stats, t in ((layer.input, x), (layer.output, y)):
        t = t.double()
        dims = tuple(d for d in range(t.dim()) if d != axis % t.dim())
        means, stds = t.mean(dims), t.std(dims, correction=0)
        assert stats.mean == pytest.approx(float(t.mean()), abs=1e-5)
        assert stats.std == pytest.approx(float(t.std(correction=0)), rel=1e-5)
        assert stats.channel_mean_min == pytest.approx(float(means.min()), abs=1e-5)
        assert stats.channel_mean_max == pytest.approx(float(means.max()), abs=1e-5)
        assert stats.channel_std_min == pytest.approx(float(stds.min()), rel=1e-5)
        assert stats.channel_std_max == pytest.approx(float(stds.max()), rel=1e-5)
        assert stats.nonfinite == 0 and stats.numel == t.numel()
    weight = getattr(module, "weight", None)
    if weight is None or layer.family == "own":
        assert layer.gamma is None
    else:
        assert layer.gamma.min_abs == pytest.approx(0.5) and layer.gamma.collapsed == 0


def test_bn_output_statistics_follow_gamma_and_beta():
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        bn.bias.copy_(torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    out = doctor(bn, images(64, c=4)).layers[0].output
    assert (out.channel_mean_min, out.channel_mean_max) == pytest.approx((-1.0, 2.0), abs=1e-5)
    assert (out.channel_std_min, out.channel_std_max) == pytest.approx((1.0, 4.0), rel=1e-3)


def test_layer_called_twice_counts_calls_and_pools_them():
    """A reused layer, or a norm inside a recurrent cell (once per step, the first on a
    zero hidden state): its input and output statistics cover every call, not the
    first alone (which showed a recurrent LayerNorm's input as all zeros)."""
    torch.manual_seed(0)
    ln = nn.LayerNorm(4)
    model = nn.Sequential(ln, nn.Linear(4, 4), ln)
    x = torch.randn(3, 4) * 2 + 1
    report = doctor(model, x)
    layer = report.layers[0]
    assert layer.calls == 2 and layer.name == "0"
    with torch.no_grad():
        seen = torch.cat([x, model[1](ln(x))]).double()
    assert layer.input.numel == seen.numel()
    assert layer.input.mean == pytest.approx(float(seen.mean()), abs=1e-6)
    assert layer.input.std == pytest.approx(float(seen.std(unbiased=False)), rel=1e-5)
    assert layer.output.numel == seen.numel()
    assert "0 (2 calls)" in report.render()


# --------------------------------------------------------------------------- no side effects


def test_model_buffers_and_modes_are_unchanged():
    model = doctor_models.healthy_cnn()
    model[4].momentum = None
    model[3].eval()  # a mixed-mode model
    before = copy.deepcopy(model.state_dict())
    modes = [m.training for m in model.modules()]
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            doctor(model, images(64, offset=4.0))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    assert [m.training for m in model.modules()] == modes
    # no hooks are left behind
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_buffers_restored_when_the_model_raises():
    model = doctor_models.failing_cnn()
    before = copy.deepcopy(model.state_dict())
    report = doctor(model, images(8))
    assert not report.ok
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)


# --------------------------------------------------------------------------- failing models


def test_failing_model_reports_the_failing_layer():
    report = doctor(doctor_models.failing_cnn(), images(8))
    err = report.error
    assert err.layer == "3" and err.layer_type == "Linear"
    assert err.path == ("", "3") and err.exception == "RuntimeError"
    assert "mat1 and mat2" in err.message and "Traceback" in err.traceback
    assert [layer.name for layer in report.layers] == ["1"]  # the layers that ran
    assert "Error: the model raised RuntimeError in 3 (Linear)" in report.render()
    assert json.loads(report.to_json())["error"]["layer"] == "3"


def test_bn_with_one_value_per_channel_fails_in_the_bn_and_says_why():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    report = doctor(model, torch.randn(1, 4))
    assert report.error.layer == "1" and report.error.layer_type == "BatchNorm1d"
    assert "few-values" in codes(report)
    assert report.layers[0].output is None  # it never produced one


def test_error_outside_every_module():
    def forward(model, batch):
        model(batch)
        raise KeyError("after the model")

    report = doctor(nn.LayerNorm(4), torch.randn(2, 4), forward=forward)
    assert report.error.layer is None and report.error.exception == "KeyError"
    assert len(report.layers) == 1


def test_bad_arguments():
    with pytest.raises(TypeError, match="expected a torch.nn.Module, got int"):
        doctor(3, torch.randn(2))
    with pytest.raises(ValueError, match="architecture must be one of cnn, mlp"):
        doctor(nn.LayerNorm(2), torch.randn(2, 2), architecture="vit")
    with pytest.raises(TypeError, match="forward must be callable"):
        doctor(nn.LayerNorm(2), torch.randn(2, 2), forward=1)


# --------------------------------------------------------------------------- report


def test_json_round_trip_and_render():
    model = doctor_models.healthy_cnn()
    with torch.no_grad():
        model[1].weight.fill_(1e-5)
        report = doctor(model, doctor_models.make_batch())
    text = report.to_json()
    data = json.loads(text)
    assert data == report.to_dict()
    assert data["batch_size"] == 64 and data["recommendation"]["family"] == "bn"
    assert [w["code"] for w in data["warnings"]] == ["train-under-no-grad", "collapsed-gamma"]
    assert data["layers"][0]["input_shape"] == [64, 8, 8, 8]
    assert data["thresholds"]["few_values"] == doctor_mod.FEW_VALUES
    rendered = report.render()
    header = rendered.splitlines()[2]
    assert [c.strip() for c in header.split("|")] == list(doctor_mod._HEADER)
    assert "warning: collapsed-gamma at 1" in rendered
    assert "Recommendation: BatchNorm ('bn') for cnn at batch 64" in rendered
    out = io.StringIO()
    doctor_mod.print_report(report, out)  # not a terminal: the plain table
    assert out.getvalue() == rendered + "\n"


def test_rich_rendering_when_available():
    report = doctor(doctor_models.healthy_cnn(), images(4))
    text = report.render(rich=True)
    try:
        import rich  # noqa: F401
    except ImportError:
        assert text == report.render()
    else:
        assert "\x1b[" in text and "small-batch" in text and "BatchNorm2d" in text


def test_infer_architecture_and_batch_size():
    assert infer_architecture(doctor_models.healthy_cnn()) == "cnn"
    lstm = normkit.LayerNormLSTM(4, 8)
    report = doctor(lstm, torch.randn(7, 3, 4))  # (L, N, H): not batch_first
    assert report.architecture == "rnn" and report.batch_size == 3
    assert report.recommendation.family == "ln" and report.layers
    encoder = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    report = doctor(encoder, torch.randn(5, 6, 8))
    assert report.architecture == "transformer" and report.batch_size == 5
    assert report.recommendation.alternatives == ("rms", "pn")
    report = doctor(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), torch.randn(8, 4),
                    architecture="GAN")
    assert report.architecture == "gan" and report.recommendation.family == "in"
    assert doctor(nn.LayerNorm(4), {"input": torch.randn(2, 4)}).batch_size == 2


def test_example_batch_from_shape():
    x = example_batch_from_shape("8, 3, 4x4")
    assert x.shape == (8, 3, 4, 4) and torch.equal(x, example_batch_from_shape((8, 3, 4, 4)))
    for bad in ("", "8,0", "8,-1", "a,b", (2, 2.5)):
        with pytest.raises(ValueError, match="expected a shape of positive ints"):
            example_batch_from_shape(bad)


# --------------------------------------------------------------------------- recommend


@pytest.mark.parametrize("args, kwargs, family, alternatives", [
    (("cnn", 32), {}, "bn", ("gn",)),
    (("CNN", 256), {"distributed": True}, "bn", ("gn",)),
    (("cnn", 31), {}, "gn", ("batchrenorm", "frozenbn")),
    (("cnn", 2), {}, "gn", ("batchrenorm", "frozenbn")),
    (("cnn", 8, "fine_tuning"), {}, "frozenbn", ("gn", "batchrenorm")),
    (("cnn", 8), {"distributed": True, "world_size": 4}, "syncbn", ("gn", "batchrenorm")),
    (("cnn", 8), {"distributed": True, "world_size": 2}, "gn", ("batchrenorm", "frozenbn")),
    (("cnn", 8), {"distributed": True}, "gn", ("batchrenorm", "frozenbn")),
    (("rnn", 64), {}, "ln", ("wn",)),
    (("LSTM", 1), {}, "ln", ("wn",)),
    (("gru", 8), {}, "ln", ("wn",)),
    (("transformer", 512), {}, "ln", ("rms", "pn")),
    (("mlp", 32), {}, "bn", ("ln",)),
    (("mlp", 8), {}, "ln", ("rms", "bn")),
    (("mlp", 64), {"sequence": True}, "ln", ("rms",)),
    (("gan", 64), {}, "in", ("bn", "gn")),
    (("Style", 4), {}, "in", ("bn", "gn")),
    (("cnn", 64, "style transfer"), {}, "in", ("gn", "ln2d")),
    (("mlp", 64, "RL"), {}, "ln", ("wn",)),
])
def test_recommend_rules(args, kwargs, family, alternatives):
    rec = recommend(*args, **kwargs)
    assert (rec.family, rec.alternatives) == (family, alternatives)
    assert rec.reasons and all(isinstance(r, str) and r for r in rec.reasons)
    assert rec.family in FAMILIES and all(a in FAMILIES for a in rec.alternatives)
    assert str(rec).startswith(f"{FAMILIES[family][0]} ({family!r}) for {args[0].lower()}")


def test_recommend_cautions_and_sources():
    bn = recommend("cnn", 64)
    assert any("normkit.update_bn_stats" in c for c in bn.cautions)
    assert any("eval mode" in c for c in bn.cautions)
    assert any("gamma = 1 and beta = 0" in c for c in bn.cautions)
    small = recommend("cnn", 8, distributed=True)
    assert any("convert_sync_batchnorm" in c for c in small.cautions)
    assert any("Wu & He" in r for r in small.reasons)
    # GroupNorm for a CNN comes with weight standardization (Qiao et al. 2019)
    assert any("normkit.weight_standardization" in c for c in recommend("cnn", 2).cautions)
    assert not any("weight_standardization" in c for c in bn.cautions)
    assert any("Zhang & Sennrich" in r for r in recommend("transformer", 8).reasons)
    assert not any("update_bn_stats" in c for c in recommend("transformer", 8).cautions)
    # every rule cites a source
    sources = ("《", "Wu & He", "Ulyanov", "Zhang & Sennrich", "Ba, Kiros")
    for _, choice in RULES:
        assert any(s in r for r in choice.reasons for s in sources), choice
    assert all(text for _, text in NOTES)
    # every task is accepted
    for task in TASKS:
        recommend("cnn", 8, task.upper())


@pytest.mark.parametrize("dtype", [torch.float16, "float16", "half", "torch.float16"])
def test_recommend_in_float16_cautions_the_batchnorm_families_only(dtype):
    """A running variance past 65504 is stored as inf in float16 (the lab's
    half-precision experiment): BatchNorm picks say to keep the norms in float32;
    LayerNorm/GroupNorm picks and other dtypes say nothing of it."""
    def cautioned(rec):
        return [c for c in rec.cautions if "65504" in c]

    for args in (("cnn", 64), ("mlp", 64), ("cnn", 4, "fine-tuning")):
        rec = recommend(*args, dtype=dtype)
        assert rec.family in ("bn", "frozenbn")
        (text,) = cautioned(rec)
        assert "layer.float()" in text and "torch.autocast" in text and "§5.4" in text
        assert cautioned(recommend(*args)) == []
        for other in ("bfloat16", torch.float32, "double"):
            assert cautioned(recommend(*args, dtype=other)) == []
    for args in (("transformer", 64), ("cnn", 4), ("rnn", 64)):
        assert recommend(*args, dtype=dtype).family in ("ln", "gn")
        assert cautioned(recommend(*args, dtype=dtype)) == []


def test_doctor_passes_a_float16_models_dtype_to_the_recommendation():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), normkit.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 10)).eval()
    x = torch.randn(64, 1, 8, 8)
    half = doctor(copy.deepcopy(model).half(), x.half()).recommendation
    assert half.family == "bn" and any("65504" in c for c in half.cautions)
    assert not any("65504" in c for c in doctor(model, x).recommendation.cautions)


@pytest.mark.parametrize("args, kwargs, message", [
    (("vit", 8), {}, "architecture must be one of cnn, mlp, rnn, lstm, gru, transformer, "
                     "gan, style (case-insensitive), got 'vit'"),
    ((None, 8), {}, "architecture must be one of"),
    (("cnn", 0), {}, "batch_size (per device) must be a positive int, got 0"),
    (("cnn", -4), {}, "got -4"),
    (("cnn", 2.5), {}, "got 2.5"),
    (("cnn", True), {}, "got True"),
    (("cnn", 8, "poetry"), {}, "task must be None or one of classification"),
    (("cnn", 8), {"sequence": "yes"}, "sequence must be None, True or False"),
    (("cnn", 8), {"distributed": 1}, "distributed must be True or False"),
    (("cnn", 8), {"distributed": True, "world_size": 0}, "world_size must be a positive int"),
    (("cnn", 8), {"dtype": "int8"}, "dtype must be a floating torch.dtype or one of float16"),
    (("cnn", 8), {"dtype": torch.int64}, "got torch.int64"),
])
def test_recommend_rejects_bad_input(args, kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        recommend(*args, **kwargs)
    assert message in str(excinfo.value)


# --------------------------------------------------------------------------- command line


_CLI_CASES = {
    "ok": ("doctor_models:healthy_cnn", "--input-shape", "4,3,8,8", "--json", "{tmp}/r.json"),
    "raises": ("doctor_models:failing_cnn", "--batch", "doctor_models:make_batch", "--eval",
               "--json", "-"),
    "no-module": ("no_such_module_xyz:factory", "--input-shape", "2,3"),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Run the three command lines as subprocesses, concurrently (each imports torch)."""
    tmp = tmp_path_factory.mktemp("cli")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "normkit", "doctor", *(a.format(tmp=tmp) for a in args)],
            cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name, args in _CLI_CASES.items()
    }
    runs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        runs[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), tmp)
    return runs


def test_cli_exit_0_prints_the_table_and_writes_json(cli_runs):
    proc, tmp = cli_runs["ok"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("normkit doctor: Sequential (cnn), batch 4, 2 norm layers")
    assert "warning: small-batch at 1, 4" in proc.stdout
    data = json.loads((tmp / "r.json").read_text())
    assert data["ok"] and data["recommendation"]["family"] == "gn"


def test_cli_exit_1_when_the_model_raises(cli_runs):
    proc, _ = cli_runs["raises"]
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["error"]["layer"] == "3" and data["layers"][0]["mode"] == "eval"


def test_cli_exit_2_on_an_import_failure(cli_runs):
    proc, _ = cli_runs["no-module"]
    assert proc.returncode == 2
    assert "expected an importable module 'no_such_module_xyz'" in proc.stderr
    assert "ModuleNotFoundError" in proc.stderr


def test_cli_reader_gone_keeps_the_json_and_prints_no_traceback(tmp_path):
    """``normkit doctor ... --json r.json | head``: when the reader of stdout is gone,
    the JSON file is still written and no BrokenPipeError traceback is printed; the
    exit status is a Unix tool's on SIGPIPE."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    read, write = os.pipe()
    os.close(read)  # every write to stdout fails at once
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "normkit", "doctor", "doctor_models:healthy_cnn",
             "--input-shape", "4,3,8,8", "--json", str(tmp_path / "r.json")],
            cwd=TESTS, stdout=write, stderr=subprocess.PIPE, text=True, env=env,
            timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and proc.returncode == 141, proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ok"]


@pytest.mark.parametrize("argv, message", [
    (["doctor_models", "--input-shape", "2,3"], "must be 'module:attribute'"),
    (["doctor_models:nope", "--input-shape", "2,3"], "got no attribute 'nope'"),
    (["doctor_models:not_a_model", "--input-shape", "2,3"],
     "expected a torch.nn.Module (or a callable returning one), got int"),
    (["doctor_models:healthy_cnn", "--input-shape", "2,three"], "--input-shape: expected"),
    (["doctor_models:healthy_cnn"], "one of the arguments --input-shape --batch is required"),
    (["doctor_models:healthy_cnn", "--input-shape", "2,3", "--architecture", "vit"],
     "invalid choice: 'vit'"),
    (["doctor_models:healthy_cnn", "--input-shape", "2,3", "--json", "no_such_dir/r.json"],
     "--json expected a file it can write, got 'no_such_dir/r.json': its folder "
     "'no_such_dir' does not exist"),
])
def test_cli_usage_errors_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(TESTS)
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["doctor", *argv])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("usage: normkit doctor")


def test_cli_in_process_and_quickstart_still_listed(capsys, monkeypatch):
    monkeypatch.chdir(TESTS)
    assert cli.main(["doctor", "doctor_models:healthy_cnn", "--batch",
                     "doctor_models:make_batch", "--architecture", "CNN"]) == 0
    assert "No warnings." in capsys.readouterr().out
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "quickstart" in err and "doctor" in err


def test_power_norm_is_diagnosed_with_its_statistics_and_buffers():
    model = nn.Sequential(nn.Linear(8, 16), normkit.PowerNorm(16, warmup_iters=2), nn.ReLU(),
                          nn.Linear(16, 4))
    tokens = torch.randn(4, 5, 8)
    report = doctor(model, tokens)
    (layer,) = report.layers
    assert (layer.family, layer.statistics, layer.values_per_stat) == ("powernorm", "batch", 20)
    assert codes(report) == []
    assert int(model[1].num_batches_tracked) == 0  # (the doctor restores the buffers)
    with torch.no_grad():
        model[1].num_batches_tracked.fill_(2)  # past the warm-up: the running statistic
        assert doctor(model, tokens).layers[0].statistics == "running"
        model[1].running_phi[3] = float("nan")
        model[1].running_phi[4] = -1.0
    with torch.no_grad():
        report = doctor(model, tokens)
    assert "train-under-no-grad" in codes(report)  # (validation would update running_phi)
    message = finding(report, "invalid-state").message
    assert "running_phi has 1 NaN/Inf" in message and "running_phi has 1 negative" in message


def test_power_norm_in_eval_with_a_running_statistic_off_the_batch_is_stale():
    model = nn.Sequential(nn.Linear(8, 16), normkit.PowerNorm(16, group_num=None))
    tokens = torch.randn(6, 5, 8) * 10
    w = finding(doctor(model.eval(), tokens), "stale-running-stats")
    assert "running quadratic mean (running_phi)" in w.message
    assert "num_batches_tracked is 0" in w.message
    assert "normkit.update_bn_stats(model, train_loader)" in w.remedy
    trained = copy.deepcopy(model).train()
    for _ in range(60):  # (running_phi follows the batches: 0.9 ** 60 of the start left)
        trained(torch.randn(6, 5, 8) * 10)
    report = doctor(trained.eval(), tokens)
    assert "stale-running-stats" not in codes(report)
    assert report.layers[0].running.var_ratio_gmean == pytest.approx(1.0, rel=0.5)
    # the remedy it names
    normkit.update_bn_stats(model, [torch.randn(6, 5, 8) * 10 for _ in range(4)])
    report = doctor(model.eval(), tokens)
    assert "stale-running-stats" not in codes(report)
    assert report.layers[0].running.var_ratio_gmean == pytest.approx(1.0, rel=0.2)


def test_nested_sequences_are_measured_as_their_tokens():
    """A jagged batch: each per-token norm is measured on the tokens it normalizes (a
    narrowed batch's rows between its sequences, here NaN, left out); the batch is the
    number of sequences."""
    torch.manual_seed(0)
    model = nn.Sequential(normkit.LayerNorm(8), normkit.PowerNorm(8), normkit.RMSNorm(8))
    base = torch.randn(3, 6, 8) * 3 + 1
    base[0, 4:] = float("nan")
    x = torch.nested.narrow(base, 1, torch.tensor([0, 1, 2]), torch.tensor([4, 5, 3]),
                            layout=torch.jagged)
    report = doctor(model.train(), x)
    assert not [w for w in report.warnings
                if w.code in ("analysis-failed", "nonfinite-input", "nonfinite-output")]
    layers = {layer.type: layer for layer in report.layers}
    assert layers["PowerNorm"].values_per_stat == 12
    assert layers["LayerNorm"].values_per_stat == 8
    assert layers["LayerNorm"].output.std == pytest.approx(1.0, rel=1e-3)
    assert "batch 3" in str(report)
