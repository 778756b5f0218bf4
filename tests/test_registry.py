"""get_norm_layer: names, classes, partials; channel count first for every family."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import normkit

NAMES = {
    "bn": normkit.BatchNorm2d, "BatchNorm": normkit.BatchNorm2d,
    "batch_norm_2d": normkit.BatchNorm2d,
    "bn1d": normkit.BatchNorm1d, "batchnorm3d": normkit.BatchNorm3d,
    "ln": normkit.LayerNorm, "LayerNorm": normkit.LayerNorm,
    "layernorm2d": normkit.LayerNorm2d, "ln2d": normkit.LayerNorm2d,
    "rms": normkit.RMSNorm, "RMSNorm": normkit.RMSNorm,
    "gn": normkit.GroupNorm, "group-norm": normkit.GroupNorm,
    "in": normkit.InstanceNorm2d, "instancenorm1d": normkit.InstanceNorm1d,
    "in3d": normkit.InstanceNorm3d, "none": torch.nn.Identity,
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_names_build_the_right_class_for_the_channel_count(name):
    layer = normkit.get_norm_layer(name, 16)
    assert type(layer) is NAMES[name]
    channels = getattr(layer, "num_features", None) or getattr(layer, "num_channels", None)
    if channels is None and hasattr(layer, "normalized_shape"):
        channels = layer.normalized_shape[0]
    assert channels in (16, None) or isinstance(layer, torch.nn.Identity)


def test_group_norm_gets_a_sensible_group_count():
    assert normkit.get_norm_layer("gn", 64).num_groups == 32
    assert normkit.get_norm_layer("gn", 48).num_groups == 24
    assert normkit.get_norm_layer("gn", 6).num_groups == 6
    assert normkit.get_norm_layer("gn", 64, num_groups=8).num_groups == 8
    assert normkit.get_norm_layer("gn", 64, groups=4).num_groups == 4


def test_kwargs_classes_and_partials():
    bn = normkit.get_norm_layer("bn", 8, momentum=None, eps=1e-3)
    assert bn.momentum is None and bn.eps == 1e-3
    assert isinstance(normkit.get_norm_layer(torch.nn.BatchNorm2d, 8), torch.nn.BatchNorm2d)
    gn = normkit.get_norm_layer(normkit.GroupNorm, 12)
    assert (gn.num_groups, gn.num_channels) == (12, 12)
    part = functools.partial(normkit.GroupNorm, 3, eps=1e-3)
    gn = normkit.get_norm_layer(part, 12)
    assert (gn.num_groups, gn.num_channels, gn.eps) == (3, 12, 1e-3)
    ln = normkit.get_norm_layer(functools.partial(normkit.LayerNorm2d, eps=1e-6), 5)
    assert ln.eps == 1e-6 and ln.num_channels == 5
    custom = normkit.get_norm_layer(lambda c, **kw: torch.nn.BatchNorm1d(c, **kw), 4, affine=False)
    assert custom.weight is None


def test_register_a_new_family():
    normkit.register_norm("half_gn", lambda c, **kw: normkit.GroupNorm(c // 2, c, **kw))
    assert normkit.get_norm_layer("HalfGN", 8).num_groups == 4
    assert "halfgn" in normkit.norm_names()


def test_register_refuses_a_taken_name_unless_told_to_replace():
    """register_norm overwrote any name silently: registering your own "ln" changed what
    get_norm_layer, convert_norms and the lab build everywhere in the process."""
    with pytest.raises(ValueError, match=r"'ln' is taken by normkit\.norms\.layer\.LayerNorm"):
        normkit.register_norm("my_ln", nn.Identity, "ln")
    assert type(normkit.get_norm_layer("ln", 4)) is normkit.LayerNorm
    assert "myln" not in normkit.norm_names()  # (nothing registered when one name fails)

    def first(c, **kw):
        return normkit.GroupNorm(1, c, **kw)

    def second(c, **kw):
        return normkit.GroupNorm(c, c, **kw)

    normkit.register_norm("one_group_test", first)
    normkit.register_norm("one_group_test", first)  # the same factory again: fine
    with pytest.raises(ValueError, match="replace=True"):
        normkit.register_norm("one_group_test", second)
    normkit.register_norm("one_group_test", second, replace=True)
    assert normkit.get_norm_layer("one_group_test", 4).num_groups == 4
    with pytest.raises(TypeError, match="callable factory"):
        normkit.register_norm("broken", "GroupNorm")
    with pytest.raises(ValueError, match="non-empty string names"):
        normkit.register_norm("--", nn.Identity)


def test_bad_specs():
    with pytest.raises(TypeError, match="int"):
        normkit.get_norm_layer(3, 8)
    with pytest.raises(ValueError, match="num_groups"):
        normkit.get_norm_layer("gn", 6, num_groups=4)
    with pytest.raises(ValueError, match="no options"):
        normkit.get_norm_layer("none", 6, eps=1e-3)
