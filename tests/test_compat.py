"""What keeps normkit working across the torch and Triton releases ``torch>=2.4`` admits.

The device machine that runs the GPU checks has torch 2.11 and Triton 3.6, this one
torch 2.13 and Triton 3.9: the shims below are exercised here whichever torch is
installed, against torch's own module where it has the feature.
"""

import pytest
import torch
from torch import nn

import normkit
from normkit.norms import group


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, True),
                                         (False, False)])
def test_group_norm_bias_keyword_shim(affine, bias):
    """The shim for torch releases whose nn.GroupNorm has no ``bias`` keyword gives what
    recent torch's keyword gives: the same parameters, state_dict keys, repr, forward."""
    shim = group._GroupNormBiasKeyword(2, 6, affine=affine, bias=bias)
    names = {"weight", "bias"} if affine and bias else {"weight"} if affine else set()
    assert set(shim.state_dict()) == names
    assert {name for name, _ in shim.named_parameters()} == names
    assert shim.bias is None or (affine and bias)
    assert repr(shim) == (f"_GroupNormBiasKeyword(2, 6, eps=1e-05, affine={affine}, "
                          f"bias={bias and affine})")
    shim.reset_parameters()  # no bias to zero: must not fail
    x = torch.randn(3, 6, 4)
    if affine:
        with torch.no_grad():
            shim.weight.uniform_(0.5, 2.0)
    want = nn.functional.group_norm(x, 2, shim.weight, shim.bias)
    torch.testing.assert_close(shim(x), want)
    if group.TORCH_GROUP_NORM_TAKES_BIAS:  # against torch's own keyword where it has it
        torch_gn = nn.GroupNorm(2, 6, affine=affine, bias=bias)
        assert set(torch_gn.state_dict()) == names
        assert repr(torch_gn).split("(", 1)[1] == repr(shim).split("(", 1)[1]


def test_normkit_group_norms_take_bias_on_every_torch():
    for layer in (normkit.GroupNorm(2, 6, bias=False), normkit.GroupNormAct(2, 6, bias=False)):
        assert isinstance(layer, nn.GroupNorm) and layer.bias is None
        assert set(layer.state_dict()) == {"weight"}
        assert "bias=False" in repr(layer)
        layer(torch.randn(2, 6, 3)).sum().backward()
        assert layer.weight.grad is not None


def test_drop_in_signatures_read_like_torchs():
    """``inspect.signature`` and ``help()`` show each drop-in's real constructor: torch's
    parameters in torch's order, then normkit's keyword-only ones (its ``__init__``
    methods take ``*args, **kwargs`` on to torch's); an instance keeps the call
    signature torch's modules have."""
    import inspect

    from normkit.tools.convert import _DROP_INS

    for torch_cls, nk_cls in _DROP_INS.items():
        theirs = list(inspect.signature(torch_cls).parameters)
        ours = inspect.signature(nk_cls).parameters
        assert list(ours)[:len(theirs)] == theirs, nk_cls.__name__
        assert "backend" in ours and ours["backend"].kind is inspect.Parameter.KEYWORD_ONLY
        assert not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in ours.values())
    assert "unbiased_running_var" in inspect.signature(normkit.BatchNorm2d).parameters
    assert "residual_in_fp32" in inspect.signature(normkit.AddLayerNorm).parameters
    layer = normkit.LayerNorm(4)
    assert str(inspect.signature(layer)) == str(inspect.signature(torch.nn.LayerNorm(4)))
