"""fold_batchnorm / fold_bn_weights: exact folds, only where safe, the caller's model untouched."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import normkit
from normkit.norms.mean_only import MeanOnlyBatchNorm2d
from normkit.tools.fold import FoldReport, fold_batchnorm, fold_bn_weights

# max |folded - unfolded| relative to max |unfolded|
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add start-up cost (and stall on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomize_(model: nn.Module, steps: int = 3, shape=None, seed: int = 0) -> nn.Module:
    """Non-trivial affine values and running statistics from a few momentum updates."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:   # norm gamma
                p.copy_(torch.rand(p.shape, generator=gen, dtype=dtype) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=dtype) * 2 - 1)
        for module in model.modules():
            if isinstance(module, normkit.FrozenBatchNorm):
                module.running_mean.uniform_(-1, 1, generator=gen)
                module.running_var.uniform_(0.5, 2.0, generator=gen)
                module.weight.uniform_(0.5, 1.5, generator=gen)
                module.bias.uniform_(-1, 1, generator=gen)
        if shape is not None:
            model.train()
            for _ in range(steps):
                model(torch.randn(shape, generator=gen, dtype=dtype) * 3 + 2)
    return model


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _check_fold(model: nn.Module, x: torch.Tensor, n_folded: int, **kwargs) -> FoldReport:
    reference = copy.deepcopy(model).eval()
    folded, report = fold_batchnorm(model, return_report=True, **kwargs)
    assert len(report.folded) == n_folded, str(report)
    assert not folded.training and all(not m.training for m in folded.modules())
    with torch.no_grad():
        err = _error(folded(x), reference(x))
    assert err <= TOL.get(x.dtype, 2e-2), f"{err:.3e}\n{report}"
    for _, norm in report.folded:
        assert isinstance(folded.get_submodule(norm), nn.Identity)
    return report


CONVS = {
    "conv1d": (lambda b: nn.Conv1d(4, 6, 3, bias=b), nn.BatchNorm1d, (5, 4, 9)),
    "conv2d": (lambda b: nn.Conv2d(4, 6, 3, bias=b), normkit.BatchNorm2d, (5, 4, 7, 6)),
    "conv2d-groups2": (lambda b: nn.Conv2d(4, 6, 3, groups=2, bias=b), nn.BatchNorm2d,
                       (5, 4, 7, 6)),
    "depthwise": (lambda b: nn.Conv2d(4, 8, 3, groups=4, padding=1, bias=b),
                  normkit.BatchNorm2d, (5, 4, 7, 6)),
    "conv3d": (lambda b: nn.Conv3d(4, 6, 3, bias=b), normkit.BatchNorm3d, (3, 4, 5, 4, 5)),
    "convT1d": (lambda b: nn.ConvTranspose1d(4, 6, 3, stride=2, bias=b), normkit.BatchNorm1d,
                (5, 4, 9)),
    "convT1d-groups2": (lambda b: nn.ConvTranspose1d(4, 6, 3, groups=2, bias=b),
                        nn.BatchNorm1d, (5, 4, 9)),
    "convT2d": (lambda b: nn.ConvTranspose2d(4, 6, 3, stride=2, output_padding=1, bias=b),
                nn.BatchNorm2d, (5, 4, 5, 4)),
    "convT2d-groups2": (lambda b: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, bias=b),
                        normkit.BatchNorm2d, (5, 4, 5, 4)),
    "convT3d": (lambda b: nn.ConvTranspose3d(4, 6, 2, bias=b), nn.BatchNorm3d, (3, 4, 3, 4, 3)),
    "convT3d-groups2": (lambda b: nn.ConvTranspose3d(4, 6, 2, groups=2, bias=b),
                        normkit.BatchNorm3d, (3, 4, 3, 4, 3)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", list(CONVS))
def test_fold_equals_the_eval_model_for_every_conv_kind(kind, bias, affine, dtype):
    make, norm_cls, shape = CONVS[kind]
    torch.manual_seed(0)
    conv = make(bias)
    model = nn.Sequential(conv, norm_cls(conv.out_channels, affine=affine), nn.ReLU())
    model = _randomize_(model.to(dtype), shape=shape)
    x = torch.randn(shape, dtype=dtype) * 3 + 2
    report = _check_fold(model, x, 1)
    assert report.method == "torch.fx" and report.folded == [("0", "1")]
    folded = fold_batchnorm(model)
    assert folded[0].bias is not None and folded[0].bias.dtype == dtype
    assert folded[0].weight.dtype == dtype and model[0].bias is (conv.bias if bias else None)


NORMS = {
    "torch": lambda c: nn.BatchNorm2d(c),
    "torch-sync": lambda c: nn.SyncBatchNorm(c),
    "normkit": lambda c: normkit.BatchNorm2d(c, momentum=None),
    "normkit-biased-var": lambda c: normkit.BatchNorm2d(c, unbiased_running_var=False),
    "normkit-sync": lambda c: normkit.SyncBatchNorm(c),
    "frozen": lambda c: normkit.FrozenBatchNorm2d(c),
    "frozen-any-rank": lambda c: normkit.FrozenBatchNorm(c),
    "renorm": lambda c: normkit.BatchRenorm2d(c, warmup_steps=0, r_max_steps=1, d_max_steps=1),
    "mean-only": lambda c: MeanOnlyBatchNorm2d(c),
}


@pytest.mark.parametrize("norm", list(NORMS))
def test_every_batchnorm_like_layer_folds(norm):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, bias=False), NORMS[norm](5), nn.ReLU())
    # torch's SyncBatchNorm cannot train on CPU: its running statistics come from a BN
    shape = None if norm == "torch-sync" else (6, 3, 8, 8)
    model = _randomize_(model.double(), shape=shape)
    if norm == "torch-sync":
        with torch.no_grad():
            model[1].running_mean.uniform_(-1, 1)
            model[1].running_var.uniform_(0.5, 2)
    _check_fold(model, torch.randn(4, 3, 8, 8, dtype=torch.float64) + 1, 1)


class Residual(nn.Module):
    """conv -> bn -> relu twice, plus the input: traceable, not a Sequential."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = normkit.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def test_traced_residual_model_folds_and_keeps_its_class():
    torch.manual_seed(2)
    model = _randomize_(Residual().double(), shape=(6, 4, 6, 6))
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    report = _check_fold(model, x, 2)
    assert report.method == "torch.fx" and report.skipped == []
    folded = fold_batchnorm(model)
    assert type(folded) is Residual
    report = _check_fold(model, x, 2, example_inputs=x)
    assert report.method == "torch.fx + recorded run"


class Branchy(nn.Module):
    """Data-dependent control flow (untraceable); a Sequential inside, nested across ends."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3)),
                                      nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()))
        self.conv = nn.Conv2d(4, 4, 1, bias=False)
        self.bn = normkit.BatchNorm2d(4)

    def forward(self, x):
        x = self.features(x)
        if x.sum() > 0:
            x = x * 2
        return self.bn(self.conv(x))


def test_untraceable_model_folds_sequential_neighbours_or_what_a_run_records():
    torch.manual_seed(3)
    model = _randomize_(Branchy().double(), shape=(6, 3, 7, 7))
    x = torch.randn(3, 3, 7, 7, dtype=torch.float64)
    report = _check_fold(model, x, 1)
    assert report.method == "nn.Sequential order"
    assert report.folded == [("features.0.0", "features.1.0")]
    assert report.skipped[0][0] == "bn" and "not traceable" in report.skipped[0][1]
    report = _check_fold(model, x, 2, example_inputs=(x,))
    assert report.method == "recorded run"


class KeywordOnly(nn.Module):
    """A Hugging Face-style model: keyword input (``pixel_values``), data-dependent
    control flow (untraceable), conv-BN pairs outside any nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1)
                                   for i in range(4))
        self.norms = nn.ModuleList(nn.BatchNorm2d(4) for _ in range(4))

    def forward(self, *, pixel_values, scale: float = 1.0):
        x = pixel_values * scale
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = torch.relu(norm(conv(x))) if x.sum() > -1e9 else x
        return x


def test_keyword_example_inputs_record_an_untraceable_forward():
    """Hugging Face models take keyword inputs and rarely trace: a mapping records the
    run (as doctor and update_bn_stats take it); the warning names each reason once."""
    torch.manual_seed(4)
    model = KeywordOnly().double()
    with torch.no_grad():
        for _ in range(3):
            model(pixel_values=torch.randn(8, 3, 6, 6, dtype=torch.float64) * 2 + 1)
    for norm in model.norms:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 3, 6, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="nothing to fold") as caught:
        _, report = fold_batchnorm(model, return_report=True)
    message = str(caught[0].message)
    assert "norms.0, norms.1, norms.2 and 1 more: the model is not traceable" in message
    assert message.count("not traceable") == 1 and len(report.skipped) == 4
    folded, report = fold_batchnorm(model, {"pixel_values": x, "scale": 2.0},
                                    return_report=True)
    assert report.method == "recorded run" and len(report.folded) == 4, str(report)
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()(pixel_values=x)
        assert _error(folded(pixel_values=x), expected) <= TOL[torch.float64]
    with pytest.raises(ValueError, match=r"model\(\*\*example_inputs\) for a mapping"):
        fold_batchnorm(model, {"images": x})


class SharedOutput(nn.Module):
    """The conv output feeds the BN and a skip connection: not foldable."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.branch = branch
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.conv(x)
        if self.branch and x.sum() > 0:  # data-dependent: only a recorded run sees the flow
            x = x + 1
        return self.bn(y) + y


@pytest.mark.parametrize("branch", [False, True])
def test_conv_feeding_bn_and_a_skip_is_not_folded(branch):
    torch.manual_seed(4)
    model = _randomize_(SharedOutput(branch).double(), shape=(6, 3, 5, 5))
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match="nothing to fold"):
        report = _check_fold(model, x, 0, example_inputs=x)
    assert report.skipped[0][0] == "bn"
    assert ("2 users" in report.skipped[0][1] if not branch
            else "also read by add" in report.skipped[0][1])


class BnTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 1)
        self.conv2 = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv1(x)) + self.bn(self.conv2(x))


class ConvTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn1 = nn.BatchNorm2d(4)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn1(self.conv(x)) + self.bn2(self.conv(x * 2))


class ReadsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)) + self.conv.weight.sum()


class Stores(nn.Module):
    def __init__(self, returns: bool = False) -> None:
        super().__init__()
        self.returns = returns
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        if self.returns:
            return self.bn(y), y
        self.cache = y
        return self.bn(y)


class TwoNorms(ConvTwice):
    """One conv output normalized by two BatchNorms (two heads): folding either into the
    conv would change what the other reads."""

    def forward(self, x):
        y = self.conv(x)
        return self.bn1(y) * self.bn2(y)


class Untraceable(nn.Module):
    """Wraps a model behind data-dependent control flow, which torch.fx cannot trace."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) if x.sum() > -1e9 else x


UNSAFE = {  # model, reason from the trace, reason from a recorded run
    "bn twice": (BnTwice, "bn: called 2 times in forward",
                 "inner.bn: called 2 times in the recorded run"),
    "conv twice": (ConvTwice, "bn1: conv is called 2 times in forward",
                   "inner.bn1: inner.conv is called 2 times in the recorded run"),
    "reads weight": (ReadsWeight, "bn: forward reads conv.weight directly",
                     "inner.bn: inner.conv: forward reads its parameters directly (sum)"),
    "stores output": (Stores, "bn: the output of conv has 2 users",
                      "inner.bn: the output of inner.conv outlives the forward"),
    "returns output": (lambda: Stores(True), "bn: the output of conv has 2 users",
                       "inner.bn: the output of inner.conv outlives the forward"),
    "two norms": (TwoNorms, "bn1: the output of conv has 2 users",
                  "inner.bn1: inner.conv: its output is also passed to inner.bn2"),
}


@pytest.mark.parametrize("analysis", ["trace", "trace + run", "run"])
@pytest.mark.parametrize("pattern", list(UNSAFE))
def test_unsafe_patterns_are_skipped_with_the_reason(pattern, analysis):
    make, traced_reason, recorded_reason = UNSAFE[pattern]
    model = _randomize_(make().double())
    if analysis == "run":
        model = Untraceable(model)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="nothing to fold"):
        folded, report = fold_batchnorm(model, example_inputs=None if analysis == "trace" else x,
                                        return_report=True)
    reasons = [f"{norm}: {why}" for norm, why in report.skipped]
    expected = recorded_reason if analysis == "run" else traced_reason
    assert report.folded == [] and any(r.startswith(expected) for r in reasons), str(report)
    with torch.no_grad():
        assert _error(folded(x)[0], copy.deepcopy(model).eval()(x)[0]) == 0.0


def test_example_inputs_the_model_rejects_raise_a_clear_error():
    with pytest.raises(ValueError, match="example_inputs that the eval-mode model accepts"):
        fold_batchnorm(Residual(), example_inputs=torch.randn(2, 3, 4, 4))


def test_linear_folds_only_where_its_output_is_n_by_c():
    torch.manual_seed(5)
    mlp = _randomize_(nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(),
                                    nn.Linear(5, 5, bias=False), normkit.BatchNorm1d(5))
                      .double(), shape=(16, 6))
    x = torch.randn(8, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="nothing to fold"):
        report = _check_fold(mlp, x, 0)
    assert "Linear" in report.skipped[0][1] and "example_inputs" in report.skipped[0][1]
    _check_fold(mlp, x, 2, example_inputs=x)
    head = _randomize_(nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.BatchNorm1d(5),
                                     nn.Dropout(0.2), nn.Linear(5, 4), nn.BatchNorm1d(4))
                       .double(), shape=(16, 3, 4))
    _check_fold(head, torch.randn(8, 3, 4, dtype=torch.float64), 2)
    # Linear over the last dim of (N, L, C) with L == C: BatchNorm1d sees L as channels
    tokens = _randomize_(nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5)).double(),
                         shape=(8, 5, 5))
    x3 = torch.randn(4, 5, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match="nothing to fold"):
        report = _check_fold(tokens, x3, 0, example_inputs=x3)
    assert "shape (4, 5, 5)" in report.skipped[0][1]


class Flattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(16, 6)
        self.bn_fc = nn.BatchNorm1d(6)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.bn_fc(self.fc(x.view(x.size(0), -1)))


def test_linear_after_a_view_to_2d_in_a_traced_forward_folds():
    model = _randomize_(Flattened().double(), shape=(8, 3, 4, 4))
    report = _check_fold(model, torch.randn(5, 3, 4, 4, dtype=torch.float64), 2)
    assert report.folded == [("conv", "bn"), ("fc", "bn_fc")]


def test_callers_model_is_untouched_train_mode_included():
    torch.manual_seed(6)
    model = _randomize_(Residual(), shape=(4, 4, 5, 5)).train()
    model.bn2.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    params = [id(p) for p in model.parameters()]
    folded = fold_batchnorm(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [m.training for m in model.modules()] == modes
    assert [id(p) for p in model.parameters()] == params
    assert isinstance(model.bn1, normkit.BatchNorm2d) and model.conv1.bias is None
    assert isinstance(folded.bn1, nn.Identity) and folded.conv1.bias is not None


def test_a_weight_tied_to_another_layer_keeps_its_value_there():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1))
    model[2].weight = model[0].weight
    model = _randomize_(model.double(), shape=(6, 4, 3, 3))
    _check_fold(model, torch.randn(2, 4, 3, 3, dtype=torch.float64), 1)
    folded = fold_batchnorm(model)
    assert torch.equal(folded[2].weight, model[2].weight)


def test_dtypes_and_memory_format_are_kept():
    torch.manual_seed(7)
    model = _randomize_(nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6)),
                        shape=(8, 3, 6, 6)).eval()
    x = torch.randn(4, 3, 6, 6) + 1
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    folded = fold_batchnorm(bf16)
    assert folded[0].weight.dtype == folded[0].bias.dtype == torch.bfloat16
    exact = copy.deepcopy(model).double()(x.double())
    with torch.no_grad():
        err_folded = _error(folded(x.bfloat16()), exact)
        err_unfolded = _error(bf16(x.bfloat16()), exact)
    assert err_folded <= max(2 * err_unfolded, 1e-2), (err_folded, err_unfolded)
    cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    assert fold_batchnorm(cl)[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_nothing_to_fold_warns_and_returns_an_eval_copy():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    with pytest.warns(UserWarning, match="nothing to fold .* no BatchNorm layers"):
        folded, report = fold_batchnorm(model, return_report=True)
    assert folded is not model and not folded.training and model.training
    assert report.folded == report.skipped == []
    stats_free = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.warns(UserWarning, match="no running statistics"):
        folded = fold_batchnorm(stats_free)
    assert isinstance(folded[1], nn.BatchNorm2d)


def test_layers_and_norms_that_are_not_plain_are_skipped():
    class BNAct(nn.BatchNorm2d):
        def forward(self, x):
            return torch.relu(super().forward(x))

    hooked = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    hooked[1].register_forward_hook(lambda m, a, out: None)
    normed = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 1)),
                           nn.BatchNorm2d(4))
    for model, reason in ((nn.Sequential(nn.Conv2d(3, 4, 1), BNAct(4)), "overrides forward"),
                          (hooked, "hooks"), (normed, "parametrized"),
                          (nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(5)),
                           "channels differ")):
        with pytest.warns(UserWarning, match=reason):
            fold_batchnorm(model)


def test_report_text_and_bad_arguments():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm2d(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = fold_batchnorm(model, return_report=True)
    assert str(report).splitlines() == [
        "fold_batchnorm (torch.fx): folded 1, skipped 1", "  folded  1 into 0",
        "  skipped 2: no preceding Conv/ConvTranspose/Linear: its input is the output of 1 "
        "(BatchNorm2d)"]
    with pytest.raises(TypeError, match="expected an eager torch.nn.Module, got a Tensor"):
        fold_batchnorm(torch.zeros(1))
    with pytest.raises(TypeError, match="example_inputs to be a tensor, a tuple of positional "
                                        "inputs or a mapping of keyword inputs, got set"):
        fold_batchnorm(model, example_inputs={torch.zeros(1)})
    w = torch.randn(6, 4, 3, 3)
    with pytest.raises(ValueError, match=r"running_mean of shape \(6,\).*got shape \(5,\)"):
        fold_bn_weights(w, None, torch.zeros(5), torch.ones(6), 1e-5)
    with pytest.raises(ValueError, match="divisible by groups=3"):
        fold_bn_weights(torch.randn(4, 3, 3), None, torch.zeros(9), torch.ones(9), 1e-5,
                        transpose=True, groups=3)
    with pytest.raises(ValueError, match="at least 2 dims.*got a 1D"):
        fold_bn_weights(torch.randn(4), None, torch.zeros(4), torch.ones(4), 1e-5)


@settings(max_examples=20, deadline=None)
@given(transpose=st.booleans(), dims=st.integers(1, 3), groups=st.sampled_from([1, 2, 3]),
       per_group=st.integers(1, 3), stride=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_fold_bn_weights_matches_conv_then_bn(transpose, dims, groups, per_group, stride, seed):
    gen = torch.Generator().manual_seed(seed)
    cin, cout = 2 * groups, per_group * groups
    cls = ((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d) if transpose
           else (nn.Conv1d, nn.Conv2d, nn.Conv3d))[dims - 1]
    conv = cls(cin, cout, 2, stride=stride, groups=groups).double()
    bn = nn.BatchNorm1d(cout).double().eval()
    with torch.no_grad():
        for t, low, high in ((conv.weight, -1, 1), (conv.bias, -1, 1), (bn.weight, 0.2, 2),
                             (bn.bias, -1, 1), (bn.running_mean, -2, 2),
                             (bn.running_var, 0.1, 3)):
            t.uniform_(low, high, generator=gen)
    w, b = fold_bn_weights(conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.eps,
                           bn.weight, bn.bias, transpose=transpose, groups=groups)
    x = torch.randn(2, cin, *(4,) * dims, generator=gen, dtype=torch.float64)
    view = (1, cout) + (1,) * dims
    expected = ((conv(x) - bn.running_mean.view(view)) / (bn.running_var.view(view) + bn.eps)
                .sqrt() * bn.weight.view(view) + bn.bias.view(view))
    with torch.no_grad():
        folded_conv = copy.deepcopy(conv)
        folded_conv.weight.copy_(w)
        folded_conv.bias.copy_(b)
        assert _error(folded_conv(x), expected) <= 1e-12


def test_a_parametrized_layer_is_skipped_with_how_to_bake_it_then_folds():
    """Weight norm, weight standardization or any parametrization: the reason names the
    call that bakes the weight; baked, the layer folds."""
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    for wrap, fix in ((normkit.weight_standardization, normkit.remove_weight_standardization),
                      (nn.utils.parametrizations.weight_norm, normkit.remove_weight_norm)):
        torch.manual_seed(8)
        model = _randomize_(nn.Sequential(wrap(nn.Conv2d(3, 4, 3)), nn.BatchNorm2d(4))
                            .double(), shape=(8, 3, 5, 5))
        with pytest.warns(UserWarning, match="nothing to fold"):
            _, report = fold_batchnorm(model, return_report=True)
        call = f"normkit.{fix.__name__}(layer, 'weight')"
        assert report.skipped[0][1].endswith(f"bake it first with {call}"), report.skipped
        fix(model[0])
        _check_fold(model, x, 1)


@pytest.mark.parametrize("value", ["inf16", "nan"])
def test_norms_with_nan_or_inf_statistics_are_skipped_with_the_reason(value):
    """Folding an infinite running variance writes zero weights (a NaN one NaN weights)
    into the layer before it, and the BatchNorm -- whose inference forward would warn --
    is gone: such norms stay in place, with the reason in the report."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), normkit.BatchNorm2d(4), nn.Conv2d(4, 4, 1),
                          normkit.BatchNorm2d(4)).eval()
    if value == "inf16":
        model.half()
        model[1].running_var.copy_(torch.full((4,), 1e5))  # past float16: inf
    else:
        model[1].running_mean[2] = float("nan")
    folded, report = fold_batchnorm(model, return_report=True)
    assert report.folded == [("2", "3")]
    assert [name for name, _ in report.skipped] == ["1"]
    reason = report.skipped[0][1]
    want = ("running_var holds NaN/Inf (a float16 overflow" if value == "inf16" else
            "running_mean holds NaN/Inf (from a training step that diverged?)")
    assert want in reason and "zeros or NaN" in reason
    assert isinstance(folded[1], normkit.BatchNorm2d) and isinstance(folded[3], nn.Identity)
    assert torch.equal(folded[0].weight, model[0].weight)  # untouched
