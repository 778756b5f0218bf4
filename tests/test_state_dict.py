"""Checkpoints move between torch.nn and normkit in both directions, outputs unchanged."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from cases import CASES, IMAGE_LAYERS, affine_kwargs, make_input

import normkit


def _roundtrip(module):
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("case", [c for c in CASES if c.torch_cls], ids=lambda c: c.name)
def test_torch_checkpoint_loads_into_normkit_and_back(case, affine):
    extra = {"track_running_stats": True} if case.name.startswith("Instance") else {}
    nk, tm = case.build(affine, **extra)
    tm.train()
    for step in range(3):  # move the running statistics in torch
        tm(make_input(case.shape, torch.float32, "contiguous", seed=step, offset=step))
    fresh = type(nk)(*case.args, **affine_kwargs(type(nk), affine), **extra)
    result = fresh.load_state_dict(_roundtrip(tm))
    assert not result.missing_keys and not result.unexpected_keys
    back = type(tm)(*case.args, **affine_kwargs(type(tm), affine), **extra)
    back.load_state_dict(_roundtrip(fresh))
    x = make_input(case.shape, torch.float32, "contiguous", seed=7)
    for mode in (False, True):
        tm.train(mode), fresh.train(mode), back.train(mode)
        torch.testing.assert_close(fresh(x), tm(x), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(back(x), tm(x), atol=2e-5, rtol=2e-5)


def test_old_batchnorm_checkpoint_without_num_batches_tracked_loads():
    old = torch.nn.BatchNorm2d(4).state_dict()
    del old["num_batches_tracked"]
    old._metadata[""]["version"] = 1  # as saved before torch 0.4.1
    torch.nn.BatchNorm2d(4).load_state_dict(old)
    module = normkit.BatchNorm2d(4)
    module.load_state_dict(old)  # torch's version hook fills it in
    assert int(module.num_batches_tracked) == 0


def test_layernorm2d_state_dict_is_a_plain_layernorm():
    ln2d = normkit.LayerNorm2d(6)
    ln = torch.nn.LayerNorm(6)
    ln.load_state_dict(ln2d.state_dict())
    x = torch.randn(2, 6, 3, 3)
    torch.testing.assert_close(ln2d(x), ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_whole_model_swap_keeps_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.GroupNorm(4, 8))
    twin = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), normkit.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), normkit.GroupNorm(4, 8))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 10, 10)
    for mode in (True, False):
        model.train(mode), twin.train(mode)
        torch.testing.assert_close(twin(x), model(x), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(twin[1].running_mean, model[1].running_mean)


#: Every public layer class, with constructor arguments.
_DEFERRED = {
    **{name: functools.partial(make, 5) for name, make in IMAGE_LAYERS.items()},
    "SyncBatchNorm": lambda: normkit.SyncBatchNorm(5),
    "InstanceNorm2d with running statistics": lambda: normkit.InstanceNorm2d(
        5, affine=True, track_running_stats=True),
    "LayerNorm": lambda: normkit.LayerNorm(5),
    "RMSNorm": lambda: normkit.RMSNorm(5),
    "AddLayerNorm": lambda: normkit.AddLayerNorm(5),
    "AddRMSNorm": lambda: normkit.AddRMSNorm(5),
    "LayerNormLSTMCell": lambda: normkit.LayerNormLSTMCell(5, 3),
    "LayerNormLSTM": lambda: normkit.LayerNormLSTM(5, 3, num_layers=2),
}


@pytest.mark.parametrize("name", list(_DEFERRED))
def test_deferred_init_on_meta_then_reset_parameters_equals_the_constructor(name):
    """A model built on the ``meta`` device, moved with ``to_empty`` and initialised by
    calling ``reset_parameters`` on every module that has one (as FSDP's deferred
    initialization does) holds what the constructor gives: no buffer keeps the
    uninitialised memory."""
    with torch.device("meta"):
        module = _DEFERRED[name]()
    module = module.to_empty(device="cpu")
    with torch.no_grad():  # what to_empty may hand out
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.fill_(7)
    torch.manual_seed(0)
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    torch.manual_seed(0)
    want = _DEFERRED[name]().state_dict()
    got = module.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{name}: {key} after reset_parameters"


#: Constructor arguments of every public layer class (the test below checks the list
#: is complete).
_ARGS = {
    "BatchNorm1d": (5,), "BatchNorm2d": (5,), "BatchNorm3d": (5,), "SyncBatchNorm": (5,),
    "BatchRenorm1d": (5,), "BatchRenorm2d": (5,), "BatchRenorm3d": (5,),
    "FrozenBatchNorm": (5,), "FrozenBatchNorm1d": (5,), "FrozenBatchNorm2d": (5,),
    "FrozenBatchNorm3d": (5,), "MeanOnlyBatchNorm1d": (5,), "MeanOnlyBatchNorm2d": (5,),
    "BatchNormAct1d": (5,), "BatchNormAct2d": (5,), "BatchNormAct3d": (5,),
    "InstanceNorm1d": (5, 1e-5, 0.1, True), "InstanceNorm2d": (5, 1e-5, 0.1, True),
    "InstanceNorm3d": (5, 1e-5, 0.1, True), "BatchNorm": (5,), "LayerNorm": (5,),
    "LayerNorm2d": (5,), "RMSNorm": (5,), "AddLayerNorm": (5,), "AddRMSNorm": (5,),
    "GroupNorm": (1, 5), "GroupNormAct": (1, 5), "PowerNorm": (5,),
    "AdaptiveLayerNorm": (5, 3), "AdaptiveGroupNorm": (1, 5, 3),
    "LayerNormLSTM": (5, 3), "LayerNormLSTMCell": (5, 3),
}
_NOT_LAYERS = {"Standardizer", "StandardizedModel", "WeightNorm", "WeightStandardization",
               "AGC"}  # (built from data or around another module)


def test_the_layer_list_covers_every_public_layer():
    public = {name for name in normkit.__all__ if isinstance(getattr(normkit, name), type)
              and issubclass(getattr(normkit, name), torch.nn.Module)}
    assert public - _NOT_LAYERS == set(_ARGS)


@pytest.mark.parametrize("name", list(_ARGS))
def test_device_and_dtype_arguments_and_skip_init(name):
    """``device=``/``dtype=`` reach every parameter and buffer, and
    ``torch.nn.utils.skip_init`` (which requires a ``device`` argument in the
    signature) builds the layer without initializing it."""
    cls, args = getattr(normkit, name), _ARGS[name]
    module = cls(*args, device="meta", dtype=torch.float64)
    tensors = [*module.parameters(), *module.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    assert all(t.dtype == torch.float64 for t in tensors if t.is_floating_point())
    skipped = torch.nn.utils.skip_init(cls, *args)
    reference = cls(*args)
    assert {k: v.shape for k, v in skipped.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()}
    assert all(not t.is_meta for t in skipped.state_dict().values())
