"""convert_norms, patch and unpatch: copies, the right layouts, state carried over."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normkit


def _cnn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48), nn.ReLU(),
                        nn.Conv2d(48, 8, 3), nn.GroupNorm(4, 8), nn.InstanceNorm2d(8, affine=True))
    with torch.no_grad():
        for m in net:
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-1, 1)
    return net


def test_bn_to_group_norm_keeps_channels_affine_and_the_original():
    net = _cnn()
    converted = normkit.convert_norms(net, "gn", where=nn.BatchNorm2d)
    assert type(net[1]) is nn.BatchNorm2d  # untouched
    gn = converted[1]
    assert isinstance(gn, normkit.GroupNorm) and (gn.num_groups, gn.num_channels) == (24, 48)
    torch.testing.assert_close(gn.weight, net[1].weight)
    assert converted[4] is not net[4] and type(converted[4]) is nn.GroupNorm  # not selected
    reference = nn.GroupNorm(24, 48)
    reference.load_state_dict(gn.state_dict())
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(converted[1](net[0](x)), reference(net[0](x)))


def test_every_channels_first_family_keeps_its_dimension():
    net = _cnn()  # BatchNorm2d at 1, GroupNorm at 4, InstanceNorm2d at 5
    x = torch.randn(2, 3, 9, 9)
    expected = {
        "ln": (normkit.LayerNorm2d,) * 3,
        "bn": (normkit.BatchNorm2d, normkit.BatchNorm, normkit.BatchNorm2d),  # GN: any rank
        "none": (nn.Identity,) * 3,
    }
    for to, classes in expected.items():
        converted = normkit.convert_norms(net, to)
        assert tuple(type(converted[i]) for i in (1, 4, 5)) == classes, to
        assert converted(x).shape == net(x).shape
    # (InstanceNorm2d's default affine=False: the converted layers say what they drop)
    with pytest.warns(UserWarning, match=r"has no place for the .*weight and bias; dropped "
                                         r"\(pass affine=True to convert_norms to keep them\)"):
        converted = normkit.convert_norms(net, "in", where=(nn.BatchNorm2d, nn.InstanceNorm2d))
    assert type(converted[1]) is normkit.InstanceNorm2d
    with warnings.catch_warnings():  # following the advice keeps them, silently
        warnings.simplefilter("error")
        kept = normkit.convert_norms(net, "in", where=nn.BatchNorm2d, affine=True)
    torch.testing.assert_close(kept[1].weight, net[1].weight)
    with pytest.raises(ValueError, match="rank is unknown"), pytest.warns(UserWarning):
        normkit.convert_norms(net, "in")  # the GroupNorm's input rank is unknown
    ln = normkit.convert_norms(net, "ln")
    torch.testing.assert_close(ln[4].weight, net[4].weight)
    torch.testing.assert_close(ln[1].bias, net[1].bias)


def test_layer_norm_to_rms_norm_warns_about_the_dropped_bias():
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    with torch.no_grad():
        net[1].bias.fill_(0.5)
    with pytest.warns(UserWarning, match="bias; dropped$"):  # (RMSNorm has no bias to ask)
        converted = normkit.convert_norms(net, "rms")
    assert isinstance(converted[1], normkit.RMSNorm)
    torch.testing.assert_close(converted[1].weight, net[1].weight)
    plain = nn.Sequential(nn.LayerNorm(8))
    assert isinstance(normkit.convert_norms(plain, "rms")[0], normkit.RMSNorm)  # no warning


def test_class_targets_and_predicates():
    net = _cnn()
    converted = normkit.convert_norms(net, normkit.GroupNorm, num_groups=2,
                                      where=lambda name, m: name == "1")
    assert converted[1].num_groups == 2 and type(converted[4]) is nn.GroupNorm


def test_impossible_conversions_name_the_layer():
    with pytest.raises(ValueError, match="'1'.*rms"):
        normkit.convert_norms(_cnn(), "rms")
    with pytest.raises(ValueError, match="'1'.*'bn'"):
        normkit.convert_norms(nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4)), "bn")
    with pytest.raises(ValueError, match="normalization layers"):
        normkit.convert_norms(nn.Linear(2, 2), "gn")
    with pytest.raises(TypeError, match="where"):
        normkit.convert_norms(_cnn(), "gn", where=3)


def test_patch_and_unpatch_round_trip_with_equal_outputs_and_state():
    net = _cnn()
    net.add_module("ln", nn.Flatten())
    net.add_module("ln2", nn.LayerNorm(8 * 5 * 5))
    net.train()
    net(torch.randn(4, 3, 9, 9))  # move BN statistics
    patched = normkit.patch(net)
    assert type(patched[1]) is normkit.BatchNorm2d and type(patched[4]) is normkit.GroupNorm
    assert type(patched.ln2) is normkit.LayerNorm and type(net[1]) is nn.BatchNorm2d
    assert patched.state_dict().keys() == net.state_dict().keys()
    x = torch.randn(4, 3, 9, 9)
    for mode in (True, False):
        net.train(mode), patched.train(mode)
        torch.testing.assert_close(patched(x), net(x), atol=2e-5, rtol=2e-5)
    back = normkit.unpatch(patched)
    assert type(back[1]) is nn.BatchNorm2d and not hasattr(back[1], "backend")
    torch.testing.assert_close(back(x), net(x))
    with pytest.raises(ValueError, match="to patch"):
        normkit.patch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="to unpatch"):
        normkit.unpatch(net)


class _Positive(nn.Module):
    def forward(self, w):
        return torch.nn.functional.softplus(w)


def test_patch_and_unpatch_keep_parametrizations():
    """Norm layers with a parametrized weight or bias (``torch.nn.utils.parametrize``: a
    positive gamma, say) are ``Parametrized<Class>`` instances: patch said the model held
    no norm layers. They are patched now, parametrizations and all: same state_dict,
    same outputs, gradients reaching the unconstrained parameter; unpatch undoes it."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    net = nn.Sequential(_cnn(), nn.Flatten(), nn.LazyLinear(6), nn.LayerNorm(6))
    net(torch.randn(2, 3, 9, 9))  # (initializes the lazy layer)
    parametrize.register_parametrization(net[0][1], "weight", _Positive())
    parametrize.register_parametrization(net[0][4], "bias", _Positive())
    parametrize.register_parametrization(net[3], "weight", _Positive())
    patched = normkit.patch(net)
    for i, cls in (((0, 1), normkit.BatchNorm2d), ((0, 4), normkit.GroupNorm),
                   ((3,), normkit.LayerNorm)):
        layer = patched[i[0]] if len(i) == 1 else patched[i[0]][i[1]]
        assert parametrize.is_parametrized(layer) and type(layer).__bases__[0] is cls
    assert patched.state_dict().keys() == net.state_dict().keys()
    x = torch.randn(4, 3, 9, 9)
    for mode in (True, False):
        net.train(mode), patched.train(mode)
        torch.testing.assert_close(patched(x), net(x), atol=2e-5, rtol=2e-5)
    patched(x).sum().backward()
    assert patched[0][1].parametrizations.weight.original.grad is not None
    back = normkit.unpatch(patched)
    assert type(back[0][1]).__bases__[0] is nn.BatchNorm2d
    assert parametrize.is_parametrized(back[3], "weight")
    torch.testing.assert_close(back(x), net(x), atol=2e-5, rtol=2e-5)
    synced = normkit.convert_sync_batchnorm(net)
    assert parametrize.is_parametrized(synced[0][1], "weight")
    assert synced.state_dict().keys() == net.state_dict().keys()
    torch.testing.assert_close(normkit.revert_sync_batchnorm(synced)(x), net(x))
    # (each converted layer has a class of its own: the shared classes stay plain)
    for cls in (normkit.BatchNorm2d, normkit.GroupNorm, normkit.LayerNorm,
                normkit.SyncBatchNorm, normkit.BatchNorm, nn.BatchNorm2d, nn.GroupNorm):
        assert not any(isinstance(cls.__dict__.get(n), property) for n in ("weight", "bias"))
        assert not parametrize.is_parametrized(cls(2, 2) if cls is nn.GroupNorm
                                               or cls is normkit.GroupNorm else cls(2))
    with pytest.warns(UserWarning, match=r"parametrizations of the BatchNorm2d at '0.1' "
                                         r"\(on weight\) are not carried over"):
        gn = normkit.convert_norms(net, "gn", where=nn.BatchNorm2d)
    torch.testing.assert_close(gn[0][1].weight, net[0][1].weight)


def test_unpatch_warns_where_torch_would_store_another_running_var():
    """torch's BatchNorm stores the unbiased batch variance: a layer built with
    ``unbiased_running_var=False`` would change what it stores, so unpatch says so."""
    net = torch.nn.Sequential(normkit.BatchNorm2d(3, unbiased_running_var=False),
                              normkit.BatchNorm1d(3))
    with pytest.warns(UserWarning, match=r"BatchNorm2d built with unbiased_running_var=False"):
        back = normkit.unpatch(net)
    assert type(back[0]) is torch.nn.BatchNorm2d
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normkit.unpatch(torch.nn.Sequential(normkit.BatchNorm2d(3)))


class _NormThenTanh(nn.LayerNorm):
    """A subclass of a torch norm with a forward of its own (as timm's LayerNorm2d,
    BatchNormAct2d, GroupNormAct are)."""

    def forward(self, x):
        return torch.tanh(super().forward(x))


def test_patch_names_the_subclasses_it_leaves_alone():
    """patch replaces exact torch classes only: a subclass's forward is its own. A model
    whose norms are all such subclasses (most timm models: timm.layers.LayerNorm,
    BatchNormAct2d, ...) got "without any" norm layers; the error now names them and what
    to do, and a model with both gets its torch layers patched and a warning naming the
    subclasses it kept."""
    only = nn.Sequential(nn.Linear(4, 8), _NormThenTanh(8), _NormThenTanh(8))
    with pytest.raises(ValueError, match=r"2 test_convert\._NormThenTanh.*normkit\."):
        normkit.patch(only)
    both = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), _NormThenTanh(8))
    with pytest.warns(UserWarning, match=r"left 1 test_convert\._NormThenTanh alone"):
        patched = normkit.patch(both)
    assert type(patched[1]) is normkit.LayerNorm and type(patched[2]) is _NormThenTanh
    x = torch.randn(3, 4)
    torch.testing.assert_close(patched(x), both(x))
    with warnings.catch_warnings():  # (normkit's own subclasses are not "left alone")
        warnings.simplefilter("error")
        normkit.patch(nn.Sequential(nn.LayerNorm(8), normkit.LayerNorm2d(8)))


@pytest.mark.parametrize("to", ["bn", "gn", "in", "ln", "none"])
@pytest.mark.parametrize("source", ["BatchNormAct2d", "GroupNormAct"])
def test_convert_norms_keeps_the_activation_of_fused_layers(source, to):
    """convert_norms replaced normkit.BatchNormAct2d / GroupNormAct by the plain target
    norm: the activation inside them vanished silently (a ReLU network turned linear).
    The activation stays now -- in the target's fused class for bn/gn, after the new norm
    otherwise, alone for "none" -- and the output is the target norm's, activated."""
    layer = (normkit.BatchNormAct2d(8, act="leaky_relu", negative_slope=0.2)
             if source == "BatchNormAct2d" else
             normkit.GroupNormAct(2, 8, act="leaky_relu", negative_slope=0.2))
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), layer)
    if source == "GroupNormAct" and to == "in":  # (GroupNorm's rank is unknown: as before)
        with pytest.raises(ValueError, match="input rank is unknown"):
            normkit.convert_norms(net, to)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (InstanceNorm has no affine: dropped, said)
        converted = normkit.convert_norms(net, to)
    x = torch.randn(4, 3, 10, 10)
    h = net[0](x)
    new = converted[1]
    norm = new[0] if isinstance(new, nn.Sequential) else new
    if to == "none":
        want = torch.nn.functional.leaky_relu(h, 0.2)
    elif isinstance(new, nn.Sequential):
        want = torch.nn.functional.leaky_relu(norm(h), 0.2)
    else:  # the fused class: the plain norm's output from the same state, then the act
        plain = {"bn": nn.BatchNorm2d(8), "gn": nn.GroupNorm(norm.num_groups if to == "gn"
                                                             else 1, 8)}[to]
        plain.load_state_dict(norm.state_dict())
        plain.train(norm.training)
        want = torch.nn.functional.leaky_relu(plain(h), 0.2)
        assert getattr(norm, "act", None) == "leaky_relu" and norm.negative_slope == 0.2
    torch.testing.assert_close(converted(x), want, rtol=1e-5, atol=1e-5)
    if to in ("bn", "gn"):  # (the source's affine carried over)
        torch.testing.assert_close(norm.weight, layer.weight)


def test_convert_norms_keeps_residual_norms_and_refuses_foreign_forwards():
    """AddLayerNorm/AddRMSNorm take (x, residual) and return two tensors: they convert
    to each other only. A subclass of a torch norm with a forward of its own (timm's
    BatchNormAct2d, LayerNorm2d: an activation, a permute) is refused by name rather than
    converted without it; ``where=`` leaves it out."""
    added = normkit.convert_norms(nn.Sequential(normkit.AddLayerNorm(8)), "rms")
    assert type(added[0]) is normkit.AddRMSNorm
    with pytest.raises(ValueError, match="adds a residual"):
        normkit.convert_norms(nn.Sequential(normkit.AddLayerNorm(8)), "none")
    net = nn.Sequential(nn.Linear(4, 8), _NormThenTanh(8), nn.Linear(8, 8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"test_convert\._NormThenTanh at '1'.*where="):
        normkit.convert_norms(net, "rms")
    kept = normkit.convert_norms(net, "rms", where=lambda name, m: type(m) is nn.LayerNorm)
    assert type(kept[1]) is _NormThenTanh and type(kept[3]) is normkit.RMSNorm


@pytest.mark.parametrize("tool", ["freeze_batchnorm", "convert_sync_batchnorm"])
def test_batchnorm_tools_keep_the_activation_and_refuse_own_forwards(tool):
    """freeze_batchnorm and convert_sync_batchnorm replaced normkit.BatchNormAct2d by a
    plain FrozenBatchNorm2d / SyncBatchNorm: its activation vanished silently, as did the
    activation of a subclass with its own forward (timm's BatchNormAct2d). The activation
    stays now (after the new layer), and such subclasses are refused by name."""
    layer = normkit.BatchNormAct2d(8, act="leaky_relu", negative_slope=0.2)
    with torch.no_grad():
        layer.running_mean.uniform_(-1, 1)
        layer.bias.uniform_(-0.5, 0.5)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), layer).eval()
    new = getattr(normkit, tool)(net).eval()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(new(x), net(x), rtol=1e-5, atol=1e-6)
    assert isinstance(new[1][1], nn.LeakyReLU) and new[1][1].negative_slope == 0.2

    class ReluBatchNorm(nn.BatchNorm2d):
        def forward(self, x):
            return torch.relu(super().forward(x))

    mixed = nn.Sequential(nn.Conv2d(3, 8, 3), ReluBatchNorm(8), nn.BatchNorm2d(8))
    with pytest.raises(ValueError, match=rf"{tool}: .*ReluBatchNorm at '1'.*where="):
        getattr(normkit, tool)(mixed)
    kept = getattr(normkit, tool)(mixed, where=lambda name, m: type(m) is nn.BatchNorm2d)
    assert type(kept[1]) is ReluBatchNorm and type(kept[2]) is not nn.BatchNorm2d


class MyRMSNorm(nn.Module):
    """A norm class of a model's own (as Hugging Face's LlamaRMSNorm), not torch's."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_patch_names_a_models_own_norm_classes():
    """A model whose norms are classes of its own (Hugging Face's LlamaRMSNorm) holds
    nothing patch replaces; the error names them and says what to build instead."""
    net = nn.Sequential(nn.Linear(4, 8), MyRMSNorm(8), nn.Linear(8, 8), MyRMSNorm(8))
    with pytest.raises(ValueError, match=r"2 test_convert\.MyRMSNorm.*normkit\.RMSNorm"):
        normkit.patch(net)
    # convert_norms (and normkit lab compare, built on it) names them too
    with pytest.raises(ValueError, match=r"without any \(its norm layers are classes of its "
                                         r"own: 2 test_convert\.MyRMSNorm, which convert_norms"):
        normkit.convert_norms(net, "ln")


@pytest.mark.parametrize("layers, to, expected", [
    # a MobileViT: BatchNorm2d in the convolutions, LayerNorm in the attention blocks
    ((nn.BatchNorm2d(4), nn.LayerNorm(4)), "gn", "where=torch.nn.BatchNorm2d"),
    # normkit's BatchNorm2d is selected by torch's class, its parent
    ((nn.BatchNorm2d(4), normkit.BatchNorm2d(4), nn.LayerNorm(4)), "in",
     "where=torch.nn.BatchNorm2d"),
    ((normkit.BatchNorm2d(4), nn.LayerNorm(4)), "gn", "where=normkit.BatchNorm2d"),
    # LayerNorm2d subclasses LayerNorm but cannot become RMSNorm: exact types
    ((nn.LayerNorm(4), normkit.LayerNorm2d(4)), "rms",
     "where=lambda name, m: type(m) is torch.nn.LayerNorm"),
    ((nn.LayerNorm(4), normkit.LayerNorm2d(4), normkit.RMSNorm(4)), "rms",
     "where=lambda name, m: type(m) in (torch.nn.LayerNorm, normkit.RMSNorm)"),
    ((nn.LayerNorm(4), nn.LayerNorm(4)), "gn", None),  # nothing can: no advice
])
def test_a_model_of_both_layouts_is_told_which_where_converts(layers, to, expected):
    """Converting every norm of a model that holds both layouts fails on the first layer
    that cannot become ``to``; the error gives the ``where=`` that selects exactly the
    layers that can, and that ``where=`` works."""
    net = nn.Sequential(*layers)
    with pytest.raises(ValueError, match="cannot convert") as raised:
        normkit.convert_norms(net, to)
    message = str(raised.value)
    if expected is None:
        assert "where=" not in message
        return
    assert expected in message
    where = eval(message.split("where=")[1][:-1], {"torch": torch, "normkit": normkit})
    converted = normkit.convert_norms(net, to, where=where)
    assert message.split("; ")[-1].startswith(f"{len(layers) - 1} of its norm layers")
    target = type(normkit.get_norm_layer(to, 4))
    kept = [(type(a), type(b)) for a, b in zip(net, converted, strict=True)
            if not isinstance(b, target)]
    assert len(kept) == 1 and kept[0][0] is kept[0][1]  # the one that cannot, as it was


def test_a_transformers_layer_norms_become_power_norms_and_back():
    torch.manual_seed(0)
    net = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    with torch.no_grad():
        net.norm1.weight.uniform_(0.5, 1.5)
        net.norm1.bias.normal_()
    pn = normkit.convert_norms(net, "pn", warmup_iters=100, group_num=2)
    assert isinstance(pn.norm1, normkit.PowerNorm) and isinstance(pn.norm2, normkit.PowerNorm)
    assert pn.norm1.warmup_iters == 100 and pn.norm1.group_num == 2
    torch.testing.assert_close(pn.norm1.weight, net.norm1.weight)
    torch.testing.assert_close(pn.norm1.bias, net.norm1.bias)
    pn(torch.randn(4, 5, 16)).sum().backward()
    assert int(pn.norm1.num_batches_tracked) == 1
    back = normkit.convert_norms(pn, "ln")
    assert type(back.norm1) is normkit.LayerNorm and back.norm1.normalized_shape == (16,)
    torch.testing.assert_close(back.norm1.weight, net.norm1.weight)
    with pytest.raises(ValueError, match=r"last 2 dims, \(4, 16\).*per channel"):
        normkit.convert_norms(nn.Sequential(nn.LayerNorm((4, 16))), "pn")
    with pytest.raises(ValueError, match="expected one of ln, rms, pn, none"):
        normkit.convert_norms(nn.Sequential(nn.LayerNorm(16)), "gn")


def _without_fast_path(module, *args, **kwargs):
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            return module(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@pytest.mark.parametrize("to", ["pn", "rms", "none", "ln"])
def test_torchs_encoder_layer_calls_the_converted_norms_in_eval(to):
    """torch's TransformerEncoderLayer in eval without autograd computes LayerNorm itself
    from norm1/norm2's weight and bias (its fused fast path): after a conversion to
    another family it silently computed LayerNorm (PowerNorm: 2.4 off) or failed
    (RMSNorm: no bias; Identity: no eps). The converted layer now calls its norms."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    converted = normkit.convert_norms(layer, to, **({"group_num": None} if to == "pn"
                                                    else {})).eval()
    if to == "pn":
        with torch.no_grad():
            converted.norm1.running_phi.fill_(9.0)  # (LayerNorm's answer is far off)
            converted.norm2.running_phi.fill_(4.0)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        got = converted(x)
    torch.testing.assert_close(got, _without_fast_path(converted, x), atol=1e-5, rtol=1e-5)
    assert (converted.activation_relu_or_gelu == 0) == (to != "ln")  # (ln keeps it)


def test_torchs_encoder_stack_calls_the_converted_norms_on_padded_batches():
    """nn.TransformerEncoder packs a padded batch into a nested tensor for its layers'
    fast path; with PowerNorms inside it must not."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    stack = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    assert stack.use_nested_tensor
    converted = normkit.convert_norms(stack, "pn", group_num=None).eval()
    assert not converted.use_nested_tensor
    with torch.no_grad():
        for m in converted.modules():
            if isinstance(m, normkit.PowerNorm):
                m.running_phi.fill_(9.0)
    x = torch.randn(3, 5, 16)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    with torch.no_grad():
        got = converted(x, src_key_padding_mask=pad)
    want = _without_fast_path(converted, x, src_key_padding_mask=pad)
    keep = ~pad
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
