"""Bad input gets a ValueError that names what was expected and what was given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import normkit
import normkit.functional as F

# (call, fragments the message must contain)
BAD = {
    "bn-wrong-channels": (lambda: normkit.BatchNorm2d(3)(torch.randn(2, 4, 3, 3)),
                          ["3 channels", "(2, 4, 3, 3)"]),
    "bn-wrong-ndim": (lambda: normkit.BatchNorm2d(3)(torch.randn(2, 3, 3)),
                      ["4D", "3D", "(2, 3, 3)"]),
    "bn1d-wrong-ndim": (lambda: normkit.BatchNorm1d(3)(torch.randn(2, 3, 3, 3)),
                        ["2D or 3D", "4D"]),
    "bn3d-wrong-ndim": (lambda: normkit.BatchNorm3d(3)(torch.randn(2, 3, 3, 3)), ["5D", "4D"]),
    "bn-one-value-per-channel": (lambda: normkit.BatchNorm1d(3)(torch.randn(1, 3)),
                                 ["more than 1 value per channel", "(1, 3)"]),
    "bn-integer-input": (lambda: normkit.BatchNorm2d(3)(torch.ones(2, 3, 2, 2, dtype=torch.long)),
                         ["floating-point", "torch.int64"]),
    "bn-eps-zero-training": (lambda: normkit.BatchNorm2d(3, eps=0.0)(torch.randn(2, 3, 2, 2)),
                             ["eps must be positive", "0.0"]),
    "bn-eps-negative-eval": (lambda: F.batch_norm(torch.randn(2, 3, 2, 2), torch.zeros(3),
                                                  torch.ones(3), eps=-1e-5),
                             ["eps must be non-negative", "-1e-05"]),
    "bn-eval-without-stats": (lambda: F.batch_norm(torch.randn(2, 3), None, None),
                              ["running_mean", "None"]),
    "bn-weight-size": (lambda: F.batch_norm(torch.randn(2, 3), None, None, torch.ones(4),
                                            training=True), ["4 channels", "(2, 3)", "weight"]),
    "ln-empty-normalized-shape": (lambda: normkit.LayerNorm(())(torch.randn(2, 4)),
                                  ["at least one dimension", "normalized_shape=[]"]),
    "rms-empty-normalized-shape": (lambda: F.rms_norm(torch.randn(2, 4), []),
                                   ["at least one dimension", "normalized_shape=[]"]),
    "add-ln-empty-normalized-shape": (
        lambda: normkit.AddLayerNorm(())(torch.randn(2, 4), torch.randn(2, 4)),
        ["add_layer_norm expected normalized_shape with at least one dimension"]),
    "ln-wrong-shape": (lambda: normkit.LayerNorm(5)(torch.randn(2, 4)),
                       ["(*, 5)", "(2, 4)"]),
    "ln-weight-shape": (lambda: F.layer_norm(torch.randn(2, 4), (4,), torch.ones(3)),
                        ["(4,)", "(3)"]),
    "ln-integer": (lambda: normkit.LayerNorm(2)(torch.ones(2, 2, dtype=torch.int32)),
                   ["floating-point", "torch.int32"]),
    "rms-wrong-shape": (lambda: normkit.RMSNorm((3, 4))(torch.randn(2, 4, 3)),
                        ["(*, 3, 4)", "(2, 4, 3)"]),
    "gn-not-divisible": (lambda: F.group_norm(torch.randn(2, 6, 3), 4),
                         ["divisible", "num_groups=4", "6 channels"]),
    "gn-wrong-channels": (lambda: normkit.GroupNorm(2, 6)(torch.randn(2, 4, 3)),
                          ["(N, 6, *)", "(2, 4, 3)"]),
    "gn-1d-input": (lambda: F.group_norm(torch.randn(6), 2), ["(N, C, *)", "1D", "(6)"]),
    "gn-bad-groups": (lambda: F.group_norm(torch.randn(2, 6), 0), ["positive", "0"]),
    # torch raises for these since 2.14 (an empty batch stays fine); normkit under any torch
    "gn-no-channels": (lambda: F.group_norm(torch.randn(1, 0, 2), 1),
                       ["at least one channel", "(1, 0, 2)"]),
    "gn-no-positions": (lambda: normkit.GroupNorm(2, 4)(torch.randn(2, 4, 0, 3)),
                        ["at least one position", "(2, 4, 0, 3)"]),
    "gn-act-no-positions": (lambda: normkit.GroupNormAct(2, 4, act="silu")(torch.randn(2, 4, 0)),
                            ["at least one position", "(2, 4, 0)"]),
    "in-wrong-channels-affine": (
        lambda: normkit.InstanceNorm2d(3, affine=True)(torch.randn(2, 4, 5, 5)),
        ["3 channels", "(2, 4, 5, 5)"]),
    "in-one-spatial-element": (lambda: normkit.InstanceNorm1d(3)(torch.randn(2, 3, 1)),
                               ["more than 1 spatial element", "(2, 3, 1)"]),
    "in-functional-no-spatial-dim": (lambda: F.instance_norm(torch.randn(2, 3)),
                                     ["(N, C, *)", "at least one spatial", "2D", "(2, 3)"]),
    "in-running-stats-missing": (
        lambda: F.instance_norm(torch.randn(2, 3, 4), torch.zeros(3), None,
                                use_input_stats=False),
        ["use_input_stats=False", "running_mean=a tensor", "running_var=None"]),
    "in-wrong-ndim": (lambda: normkit.InstanceNorm2d(3)(torch.randn(3, 5)), ["3D", "4D", "2D"]),
    "ln2d-wrong-channels": (lambda: normkit.LayerNorm2d(8)(torch.randn(2, 4, 3, 3)),
                            ["(N, 8, *)", "(2, 4, 3, 3)"]),
    "backend-unknown": (lambda: normkit.LayerNorm(4, backend="cuda-magic"),
                        ["backend", "'cuda-magic'", "reference"]),
    "registry-unknown": (lambda: normkit.get_norm_layer("batchnrom", 8),
                         ["'batchnrom'", "groupnorm"]),
    "registry-bad-features": (lambda: normkit.get_norm_layer("bn", 0), ["positive", "0"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_value_error_naming_expected_and_given(name):
    call, fragments = BAD[name]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_instance_norm_without_affine_warns_like_torch_on_channel_mismatch():
    with pytest.warns(UserWarning, match="3 channels"):
        normkit.InstanceNorm2d(3)(torch.randn(2, 4, 5, 5))


dims = st.integers(min_value=1, max_value=5)


@settings(max_examples=40, deadline=None)
@given(n=dims, c=st.integers(2, 6), given_c=st.integers(1, 9), spatial=st.lists(dims, max_size=2))
def test_any_channel_mismatch_is_reported(n, c, given_c, spatial):
    if given_c == c:
        return
    x = torch.randn(n, given_c, *spatial) if spatial else torch.randn(n, given_c)
    for module in (normkit.BatchNorm1d(c) if len(spatial) <= 1 else normkit.BatchNorm2d(c),
                   normkit.GroupNorm(1, c), normkit.LayerNorm2d(c)):
        if isinstance(module, normkit.BatchNorm2d) and len(spatial) != 2:
            continue
        with pytest.raises(ValueError) as info:
            module(x)
        assert str(c) in str(info.value) and str(given_c) in str(info.value)


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.int8, torch.int32, torch.int64, torch.bool,
                              torch.uint8, torch.complex64]))
def test_any_non_floating_dtype_is_reported(dtype):
    x = torch.zeros(2, 4, 3, 3).to(dtype)
    for module in (normkit.BatchNorm2d(4), normkit.LayerNorm(3), normkit.RMSNorm(3),
                   normkit.GroupNorm(2, 4), normkit.InstanceNorm2d(4), normkit.LayerNorm2d(4)):
        with pytest.raises(ValueError, match=str(dtype)):
            module(x)


@pytest.mark.parametrize("cls", [normkit.BatchRenorm1d, normkit.BatchRenorm2d,
                                 normkit.BatchRenorm3d])
def test_batch_renorm_without_running_statistics_says_why(cls):
    """Batch Renormalization compares each batch to its running statistics: asked to go
    without them (``track_running_stats=False``, a BatchNorm argument it inherits) or
    stripped of them (``torch.func.replace_all_batch_norm_modules_``), it says so
    instead of an internal TypeError."""
    with pytest.raises(ValueError, match="expected track_running_stats=True, got False"):
        cls(4, track_running_stats=False)
    module = cls(4, warmup_steps=0)
    torch.func.replace_all_batch_norm_modules_(module)
    shape = {normkit.BatchRenorm1d: (2, 4), normkit.BatchRenorm2d: (2, 4, 3, 3),
             normkit.BatchRenorm3d: (2, 4, 2, 3, 3)}[cls]
    with pytest.raises(RuntimeError, match="running statistics.*removed"):
        module(torch.randn(shape))


def _lazy_model():
    return torch.nn.Sequential(torch.nn.LazyConv2d(8, 3), torch.nn.LazyBatchNorm2d(),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(4))


LAZY_TOOLS = {
    "patch": (normkit.patch, "'0' (LazyConv2d)"),
    "freeze_batchnorm": (normkit.freeze_batchnorm, "'0' (LazyConv2d)"),
    "convert_sync_batchnorm": (normkit.convert_sync_batchnorm, "'0' (LazyConv2d)"),
    "convert_norms": (lambda m: normkit.convert_norms(m, "group_norm"), "'0' (LazyConv2d)"),
    "fold_batchnorm": (normkit.fold_batchnorm, "'0' (LazyConv2d)"),
    "init_norms_": (normkit.init_norms_, "'1' (LazyBatchNorm2d)"),  # only the norms matter
    "weight_norm": (lambda m: normkit.weight_norm(m[4]), "LazyLinear.weight"),
}


@pytest.mark.parametrize("tool", list(LAZY_TOOLS))
def test_a_lazy_module_not_yet_initialized_gets_a_clear_error_and_works_after_a_forward(tool):
    """torch's lazy modules hold placeholders until their first forward pass; every tool
    says so, naming the module, instead of torch's error from deep inside a copy."""
    call, where = LAZY_TOOLS[tool]
    model = _lazy_model()
    with pytest.raises(ValueError, match=r"lazy module") as error:
        call(model)
    assert where in str(error.value) and f"then call {tool}" in str(error.value)
    model(torch.randn(2, 3, 6, 6))  # the lazy modules become Conv2d, BatchNorm2d, Linear
    with torch.no_grad():
        model[1].running_var.add_(0.5)  # not the identity, so that folding changes weights
    if tool == "fold_batchnorm":
        model.eval()
    call(model)


# ------------------------------------------------------------ constructor arguments
#: Every layer built from keywords, with the arguments it takes: what torch.nn accepts
#: and then fails on obscurely (BatchNorm2d(-3): "negative dimension"; GroupNorm(0, 8):
#: ZeroDivisionError) or computes garbage with (eps=-1: NaN; momentum=1.5: running
#: statistics extrapolated past each batch), normkit refuses when the layer is built.
CONSTRUCTORS = {
    "BatchNorm1d": (normkit.BatchNorm1d, {"num_features": 8}),
    "BatchNorm2d": (normkit.BatchNorm2d, {"num_features": 8}),
    "BatchNorm3d": (normkit.BatchNorm3d, {"num_features": 8}),
    "SyncBatchNorm": (normkit.SyncBatchNorm, {"num_features": 8}),
    "BatchNormAct2d": (normkit.BatchNormAct2d, {"num_features": 8}),
    "BatchRenorm2d": (normkit.BatchRenorm2d, {"num_features": 8}),
    "InstanceNorm2d": (normkit.InstanceNorm2d, {"num_features": 8}),
    "FrozenBatchNorm2d": (normkit.FrozenBatchNorm2d, {"num_features": 8}),
    "MeanOnlyBatchNorm2d": (normkit.MeanOnlyBatchNorm2d, {"num_features": 8}),
    "LayerNorm": (normkit.LayerNorm, {"normalized_shape": 8}),
    "LayerNorm2d": (normkit.LayerNorm2d, {"normalized_shape": 8}),
    "RMSNorm": (normkit.RMSNorm, {"normalized_shape": 8}),
    "AddLayerNorm": (normkit.AddLayerNorm, {"normalized_shape": 8}),
    "AddRMSNorm": (normkit.AddRMSNorm, {"normalized_shape": 8}),
    "GroupNorm": (normkit.GroupNorm, {"num_groups": 2, "num_channels": 8}),
    "GroupNormAct": (normkit.GroupNormAct, {"num_groups": 2, "num_channels": 8}),
}
#: (argument, bad value, error type, fragments of the message besides the layer's name)
BAD_ARGUMENTS = [
    ("num_features", -3, ValueError, ["num_features", "int >= 0", "-3"]),
    ("num_features", 3.5, TypeError, ["num_features", "an int", "3.5 (float)"]),
    ("num_features", "8", TypeError, ["num_features", "'8' (str)"]),
    ("num_features", True, TypeError, ["num_features", "True (bool)"]),
    ("num_channels", -8, ValueError, ["num_channels", "int >= 0", "-8"]),
    ("num_groups", 0, ValueError, ["num_groups", "int >= 1", "got 0"]),
    ("num_groups", 3, ValueError, ["num_channels (8) must be divisible by num_groups (3)",
                                   "divisors of 8: 1, 2, 4, 8"]),
    ("num_groups", 2.0, TypeError, ["num_groups", "2.0 (float)"]),
    ("normalized_shape", -1, ValueError, ["normalized_shape", "int >= 0", "-1"]),
    ("normalized_shape", (4, -2), ValueError, ["normalized_shape", "(4, -2)"]),
    ("normalized_shape", 8.0, TypeError, ["normalized_shape", "8.0"]),
    ("eps", -1e-5, ValueError, ["eps must be positive or zero", "-1e-05"]),
    ("eps", float("nan"), ValueError, ["eps must be positive or zero", "nan"]),
    ("eps", float("inf"), ValueError, ["eps must be positive or zero", "inf"]),
    ("eps", "1e-5", TypeError, ["eps", "a number", "'1e-5' (str)"]),
    ("momentum", 1.5, ValueError, ["momentum", "[0, 1]", "1 - m", "1.5"]),
    ("momentum", -0.1, ValueError, ["momentum", "[0, 1]", "-0.1"]),
    ("momentum", float("nan"), ValueError, ["momentum", "[0, 1]", "nan"]),
    ("momentum", "0.1", TypeError, ["momentum", "'0.1' (str)"]),
]


def _takes(layer, argument):
    cls, base = CONSTRUCTORS[layer]
    if argument in base:
        return True
    signature = normkit.norms._base.constructor_signature(cls) if issubclass(
        cls, normkit.norms._base.BackendMixin) else __import__("inspect").signature(cls)
    return argument in signature.parameters


@pytest.mark.parametrize("layer", sorted(CONSTRUCTORS))
def test_invalid_constructor_arguments_are_refused_naming_the_layer(layer):
    cls, base = CONSTRUCTORS[layer]
    checked = 0
    for argument, value, error, fragments in BAD_ARGUMENTS:
        if not _takes(layer, argument):
            continue
        if argument == "num_groups" and value == 3 and "num_channels" not in base:
            continue
        with pytest.raises(error) as info:
            cls(**{**base, argument: value})
        message = str(info.value)
        for fragment in [layer, *fragments]:
            assert fragment in message, f"{layer}({argument}={value!r}): {fragment!r} not in " \
                                        f"{message!r}"
        checked += 1
    assert checked >= 5, checked


#: Values torch.nn accepts and computes with stay accepted, and build what torch builds.
GOOD_ARGUMENTS = [("eps", 0.0), ("eps", 0), ("eps", np.float32(1e-3)), ("momentum", 0.0),
                  ("momentum", 1), ("momentum", None), ("momentum", np.float64(0.01)),
                  ("num_features", 0), ("num_features", np.int64(4)),
                  ("normalized_shape", torch.Size([2, 4])), ("normalized_shape", []),
                  ("num_groups", 8), ("num_channels", 0)]


@pytest.mark.parametrize("layer", sorted(CONSTRUCTORS))
def test_valid_edge_arguments_still_build(layer):
    cls, base = CONSTRUCTORS[layer]
    for argument, value in GOOD_ARGUMENTS:
        if not _takes(layer, argument):
            continue
        if layer == "MeanOnlyBatchNorm2d" and argument == "num_features" and value == 0:
            continue  # (MeanOnlyBatchNorm asks for a positive int, as it always did)
        kwargs = {**base, argument: value}
        if argument == "num_channels":
            kwargs["num_groups"] = 1
        module = cls(**kwargs)
        stored = getattr(module, argument, None)
        if argument in ("eps", "momentum", "num_features", "num_groups"):
            assert stored == value, (layer, argument, stored, value)


def test_the_functional_batch_norm_checks_eps_at_each_call():
    """The functional API keeps torch's forward-time errors (what the module_db error
    samples ask of torch's own BatchNorm: eps 0 in training fails at the forward)."""
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="eps must be positive during training"):
        F.batch_norm(x, None, None, training=True, eps=0.0)
    with pytest.raises(ValueError, match="eps must be non-negative"):
        F.batch_norm(x, torch.zeros(3), torch.ones(3), eps=float("-inf"))


def _sgd():
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


#: Layers and tools that build a norm inside or take their own numbers: the error names
#: them, not the LayerNorm or GroupNorm they hold, and comes when they are built.
WRAPPED = {
    "AdaptiveLayerNorm": (lambda: normkit.AdaptiveLayerNorm(8, 4, eps=-1.0),
                          ["AdaptiveLayerNorm eps must be positive or zero", "-1.0"]),
    "AdaptiveGroupNorm": (lambda: normkit.AdaptiveGroupNorm(3, 8, 4),
                          ["AdaptiveGroupNorm: num_channels (8) must be divisible by "
                           "num_groups (3)"]),
    "LayerNormLSTMCell": (lambda: normkit.LayerNormLSTMCell(4, 8, eps=float("nan")),
                          ["LayerNormLSTMCell eps must be positive or zero", "nan"]),
    "LayerNormLSTM": (lambda: normkit.LayerNormLSTM(4, 8, eps=-1e-5),
                      ["LayerNormLSTM eps must be positive or zero", "-1e-05"]),
    "PowerNorm-inf": (lambda: normkit.PowerNorm(4, eps=float("inf")),
                      ["PowerNorm expected a finite eps > 0", "inf"]),
    "AGC-clip": (lambda: normkit.AGC(_sgd(), clip_factor=-0.01),
                 ["AGC expected clip_factor > 0", "clip_factor=-0.01"]),
    "AGC-eps": (lambda: normkit.AGC(_sgd(), eps=float("nan")), ["AGC", "eps=nan"]),
    "adaptive_clip_grad_": (lambda: normkit.adaptive_clip_grad_([], clip_factor=float("inf")),
                            ["adaptive_clip_grad_ expected", "clip_factor=inf"]),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_wrapping_layers_and_clipping_refuse_bad_numbers_naming_themselves(name):
    call, fragments = WRAPPED[name]
    with pytest.raises(ValueError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
