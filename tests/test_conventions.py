"""Framework conventions, with Keras 3 (torch backend) as the real reference."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import normkit
from normkit import conventions

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")
needs_torch_keras = pytest.mark.skipif(keras.backend.backend() != "torch",
                                       reason="Keras must run on the torch backend")


def _keras_bn(channels=5, momentum=0.99, epsilon=1e-3, center=True, scale=True, seed=0):
    layer = keras.layers.BatchNormalization(momentum=momentum, epsilon=epsilon, center=center,
                                            scale=scale)
    layer.build((None, 4, 3, channels))
    rng = np.random.default_rng(seed)
    weights = []
    if scale:
        weights.append(rng.uniform(0.5, 1.5, channels).astype("float32"))
    if center:
        weights.append(rng.normal(size=channels).astype("float32"))
    weights += [rng.normal(size=channels).astype("float32"),
                rng.uniform(0.5, 2.0, channels).astype("float32")]
    layer.set_weights(weights)
    return layer


def _nhwc(seed, channels=5):
    return np.random.default_rng(seed).normal(3.0, 2.0, (6, 4, 3, channels)).astype("float32")


def _ours(module, x_nhwc):
    y = module(torch.from_numpy(x_nhwc).movedim(-1, 1))
    return y.movedim(1, -1).detach().numpy()


def _keras(layer, x, training):
    return np.asarray(keras.ops.convert_to_numpy(layer(x, training=training)))


@needs_torch_keras
@pytest.mark.parametrize("momentum,epsilon", [(0.99, 1e-3), (0.9, 1e-2)])
def test_from_keras_inference_and_training_updates_match_keras(momentum, epsilon):
    layer = _keras_bn(momentum=momentum, epsilon=epsilon)
    bn = conventions.bn_from_keras(*layer.get_weights(), momentum=momentum, epsilon=epsilon)
    x = _nhwc(1)
    np.testing.assert_allclose(_ours(bn.eval(), x), _keras(layer, x, False), atol=2e-5)
    bn.train()
    for step in range(3):
        x = _nhwc(10 + step)
        np.testing.assert_allclose(_ours(bn, x), _keras(layer, x, True), atol=2e-5)
    np.testing.assert_allclose(bn.running_mean.numpy(), layer.moving_mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(bn.running_var.numpy(), layer.moving_variance.numpy(),
                               rtol=1e-6)


@needs_torch_keras
def test_keras_without_center_and_scale():
    layer = _keras_bn(center=False, scale=False)
    weights = layer.get_weights()
    assert len(weights) == 2
    bn = conventions.bn_from_keras(None, None, *weights).eval()
    assert bn.weight is None
    x = _nhwc(2)
    np.testing.assert_allclose(_ours(bn, x), _keras(layer, x, False), atol=2e-5)


@needs_torch_keras
def test_to_keras_reproduces_a_torch_trained_layer():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(5, momentum=0.2, eps=1e-4)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    for _ in range(4):
        bn(torch.randn(8, 5, 4, 3) * 2 + 1)
    out = conventions.bn_to_keras(bn.eval())
    layer = keras.layers.BatchNormalization(momentum=out["momentum"], epsilon=out["epsilon"],
                                            center=out["center"], scale=out["scale"])
    layer.build((None, 4, 3, 5))
    layer.set_weights(out["weights"])
    x = _nhwc(3)
    np.testing.assert_allclose(_keras(layer, x, False), _ours(bn, x), atol=2e-5)
    assert out["momentum"] == pytest.approx(0.8)


def _flax_step(params, stats, x_nhwc, momentum, eps):
    """Flax nn.BatchNorm(use_running_average=False) written out with numpy."""
    mean = x_nhwc.mean((0, 1, 2))
    var = x_nhwc.var((0, 1, 2))
    y = (x_nhwc - mean) / np.sqrt(var + eps) * params["scale"] + params["bias"]
    new = {"mean": momentum * stats["mean"] + (1 - momentum) * mean,
           "var": momentum * stats["var"] + (1 - momentum) * var}
    return y, new


def test_flax_round_trip_and_updates():
    rng = np.random.default_rng(0)
    params = {"scale": rng.uniform(0.5, 1.5, 5), "bias": rng.normal(size=5)}
    stats = {"mean": rng.normal(size=5), "var": rng.uniform(0.5, 2, 5)}
    bn = conventions.bn_from_flax(params, stats, momentum=0.9).double()
    x = rng.normal(2, 3, (6, 4, 3, 5))
    eval_ref = (x - stats["mean"]) / np.sqrt(stats["var"] + 1e-5) * params["scale"] + \
        params["bias"]
    np.testing.assert_allclose(_ours(bn.eval(), x), eval_ref, atol=1e-10)
    bn.train()
    for _ in range(2):
        y_ref, stats = _flax_step(params, stats, x, 0.9, 1e-5)
        np.testing.assert_allclose(_ours(bn, x), y_ref, atol=1e-10)
        x = x * 1.5 - 1
    np.testing.assert_allclose(bn.running_mean.numpy(), stats["mean"], atol=1e-10)
    np.testing.assert_allclose(bn.running_var.numpy(), stats["var"], atol=1e-10)
    back_params, back_stats = conventions.bn_to_flax(bn)
    np.testing.assert_allclose(back_params["scale"], params["scale"])
    np.testing.assert_allclose(back_stats["var"], stats["var"], atol=1e-10)


def test_momentum_conversions_and_defaults():
    assert conventions.momentum(0.99, "keras", "torch") == pytest.approx(0.01)
    assert conventions.momentum(0.1, "pytorch", "tensorflow") == pytest.approx(0.9)
    assert conventions.momentum(0.9, "flax", "keras") == 0.9
    assert conventions.DEFAULTS["torch"]["eps"] == torch.nn.BatchNorm2d(1).eps
    assert conventions.DEFAULTS["torch"]["momentum"] == torch.nn.BatchNorm2d(1).momentum


def test_bad_input():
    with pytest.raises(ValueError, match="unknown framework 'mxnet'"):
        conventions.momentum(0.9, "mxnet", "torch")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        conventions.momentum(1.5, "keras", "torch")
    with pytest.raises(ValueError, match="3 values"):
        conventions.bn_from_keras(np.ones(2), np.zeros(3), np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="keys"):
        conventions.bn_from_flax({}, {"mean": np.zeros(2)})
    with pytest.raises(ValueError, match="BatchNorm"):
        conventions.bn_to_keras(torch.nn.LayerNorm(3))
    with pytest.raises(ValueError, match="vector"):
        conventions.bn_from_keras(None, None, np.zeros((2, 2)), np.ones(4))
    assert isinstance(conventions.bn_from_keras(None, None, np.zeros(3), np.ones(3),
                                                cls=normkit.BatchNorm1d), normkit.BatchNorm1d)
