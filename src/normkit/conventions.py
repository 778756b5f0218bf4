r"""BatchNorm conventions of PyTorch, Keras/TensorFlow and Flax, and exact conversions.

The same word means different things in each framework, which is the source of many
porting bugs:

==================  =====================  =====================  =====================
\                   PyTorch                Keras 3 / TensorFlow   Flax ``nn.BatchNorm``
==================  =====================  =====================  =====================
momentum default    0.1                    0.99                   0.99
running update      ``(1-m)*run+m*new``    ``m*run+(1-m)*new``    ``m*run+(1-m)*new``
eps default         1e-5                   1e-3                   1e-5
stored variance     unbiased (n/(n-1))     biased                 biased
normalizes with     biased batch var       biased batch var       biased batch var
channel axis        1 (``N, C, *``)        -1 (``N, *, C``)       -1
scale / shift       ``weight``/``bias``    ``gamma``/``beta``     ``scale``/``bias``
running names       ``running_mean/var``   moving_mean/variance   ``mean``/``var``
==================  =====================  =====================  =====================

So PyTorch's ``m`` is Keras' and Flax's ``1 - m`` (:func:`momentum`), and a faithful port
also needs the eps and the biased running variance. :func:`bn_from_keras` and
:func:`bn_from_flax` build a normkit BatchNorm whose eval output equals the framework's
inference output and whose training updates equal the framework's moving averages
(``unbiased_running_var=False``); :func:`bn_to_keras` and :func:`bn_to_flax` go back.
Inputs are channels-first in PyTorch: move the channel axis when you feed the same data
(``x.movedim(-1, 1)``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from .norms.batch import BatchNorm2d

__all__ = ["DEFAULTS", "momentum", "bn_from_keras", "bn_from_flax", "bn_to_keras",
           "bn_to_flax"]

#: Default BatchNorm settings per framework (momentum in that framework's own meaning).
DEFAULTS = {
    "torch": {"momentum": 0.1, "eps": 1e-5, "running_var": "unbiased", "axis": 1},
    "keras": {"momentum": 0.99, "eps": 1e-3, "running_var": "biased", "axis": -1},
    "flax": {"momentum": 0.99, "eps": 1e-5, "running_var": "biased", "axis": -1},
}

_ALIASES = {"torch": "torch", "pytorch": "torch", "keras": "keras", "tensorflow": "keras",
            "tf": "keras", "flax": "flax", "jax": "flax"}


def _framework(name: str) -> str:
    key = str(name).lower()
    if key not in _ALIASES:
        raise ValueError(f"unknown framework {name!r}; expected one of "
                         f"{sorted(set(_ALIASES))}")
    return _ALIASES[key]


def momentum(value: float, src: str, dst: str) -> float:
    """Convert a BatchNorm momentum from one framework's meaning to another's.

    PyTorch weighs the *new* batch by ``m``; Keras/TensorFlow and Flax weigh the *old*
    running value by ``m``.

    Example:
        >>> momentum(0.99, "keras", "torch")
        0.01
        >>> momentum(0.1, "torch", "flax")
        0.9
    """
    return _convert_momentum(value, src, dst)


def _convert_momentum(value: float, src: str, dst: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {value}")
    same = (_framework(src) == "torch") == (_framework(dst) == "torch")
    return float(value) if same else round(1.0 - float(value), 15)


def _tensor(value, name: str) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        t = value.detach()
    else:
        t = torch.as_tensor(np.asarray(value))
    if t.dim() != 1:
        raise ValueError(f"expected {name} to be a vector (one value per channel), got "
                         f"shape {tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    return t


def _build(gamma, beta, mean, var, *, torch_momentum: float, eps: float,
           cls: type[nn.Module]) -> nn.Module:
    mean, var = _tensor(mean, "the moving mean"), _tensor(var, "the moving variance")
    gamma, beta = _tensor(gamma, "gamma/scale"), _tensor(beta, "beta/bias")
    channels = mean.numel()
    for name, t in (("moving variance", var), ("gamma/scale", gamma), ("beta/bias", beta)):
        if t is not None and t.numel() != channels:
            raise ValueError(f"expected the {name} to have {channels} values (one per "
                             f"channel, like the moving mean), got {t.numel()}")
    affine = gamma is not None or beta is not None
    bn = cls(channels, eps=eps, momentum=torch_momentum, affine=affine,
             unbiased_running_var=False, dtype=mean.dtype)
    with torch.no_grad():
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
        if affine:
            bn.weight.copy_(gamma if gamma is not None else torch.ones(channels))
            bn.bias.copy_(beta if beta is not None else torch.zeros(channels))
            bn.weight.requires_grad_(gamma is not None)
            bn.bias.requires_grad_(beta is not None)
    return bn


def bn_from_keras(gamma, beta, moving_mean, moving_variance, *, momentum: float = 0.99,
                  epsilon: float = 1e-3, cls: type[nn.Module] = BatchNorm2d) -> nn.Module:
    """A normkit BatchNorm equal to a Keras ``BatchNormalization`` layer.

    Eval output equals Keras' inference output (``training=False``) on the same data
    with the channel axis moved to dim 1, and training steps update the running
    statistics exactly as Keras updates ``moving_mean``/``moving_variance`` (biased
    variance, momentum converted). ``gamma``/``beta`` may be ``None`` (``scale=False``,
    ``center=False``). Arrays may be numpy arrays or tensors.

    Args:
        gamma, beta, moving_mean, moving_variance: the layer's weights, in
            ``layer.get_weights()`` order (drop the missing ones' slots as ``None``).
        momentum: Keras' momentum. Default: ``0.99``.
        epsilon: Keras' epsilon. Default: ``1e-3``.
        cls: the normkit BatchNorm class to build. Default: :class:`normkit.BatchNorm2d`.

    Example:
        >>> import numpy as np
        >>> bn = bn_from_keras(np.ones(3), np.zeros(3), np.zeros(3), np.ones(3))
        >>> bn.momentum, bn.eps, bn.unbiased_running_var
        (0.01, 0.001, False)
    """
    return _build(gamma, beta, moving_mean, moving_variance,
                  torch_momentum=_convert_momentum(momentum, "keras", "torch"),
                  eps=epsilon, cls=cls)


def bn_from_flax(params: Mapping, batch_stats: Mapping, *, momentum: float = 0.99,
                 epsilon: float = 1e-5, cls: type[nn.Module] = BatchNorm2d) -> nn.Module:
    """A normkit BatchNorm equal to a Flax ``nn.BatchNorm`` with these variables.

    ``params`` holds ``scale`` and ``bias`` (either may be missing for
    ``use_scale=False`` / ``use_bias=False``), ``batch_stats`` holds ``mean`` and ``var``.

    Example:
        >>> import numpy as np
        >>> bn = bn_from_flax({"scale": np.ones(2), "bias": np.zeros(2)},
        ...                   {"mean": np.zeros(2), "var": np.ones(2)})
        >>> bn.momentum, bn.eps
        (0.01, 1e-05)
    """
    for name, mapping, keys in (("batch_stats", batch_stats, ("mean", "var")),):
        missing = [k for k in keys if k not in mapping]
        if missing:
            raise ValueError(f"expected {name} with keys {list(keys)}, got keys "
                             f"{sorted(mapping)}")
    return _build(params.get("scale"), params.get("bias"), batch_stats["mean"],
                  batch_stats["var"],
                  torch_momentum=_convert_momentum(momentum, "flax", "torch"),
                  eps=epsilon, cls=cls)


def _check_bn(module: nn.Module) -> None:
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.running_mean is None:
        raise ValueError(f"expected a BatchNorm layer with running statistics, got "
                         f"{type(module).__name__}")


def _numpy(t: torch.Tensor | None):
    return None if t is None else t.detach().cpu().numpy().copy()


def bn_to_keras(module: nn.Module) -> dict:
    """Keras ``BatchNormalization`` weights and settings equal to a torch/normkit BatchNorm.

    Returns ``{"weights": [gamma, beta, moving_mean, moving_variance] (numpy, the
    missing affine ones left out, as Keras' ``set_weights`` expects), "momentum",
    "epsilon", "center", "scale"}``. The running variance is passed as stored: inference
    is exact either way; a torch-trained ``running_var`` is the unbiased estimate.

    Example:
        >>> import torch
        >>> out = bn_to_keras(torch.nn.BatchNorm2d(3))
        >>> out["momentum"], out["epsilon"], len(out["weights"])
        (0.9, 1e-05, 4)
    """
    _check_bn(module)
    torch_momentum = 0.1 if module.momentum is None else module.momentum
    weights = [w for w in (_numpy(module.weight), _numpy(module.bias)) if w is not None]
    weights += [_numpy(module.running_mean), _numpy(module.running_var)]
    return {"weights": weights,
            "momentum": _convert_momentum(torch_momentum, "torch", "keras"),
            "epsilon": module.eps, "scale": module.weight is not None,
            "center": module.bias is not None}


def bn_to_flax(module: nn.Module) -> tuple[dict, dict]:
    """Flax ``(params, batch_stats)`` equal to a torch/normkit BatchNorm (numpy arrays).

    Example:
        >>> import torch
        >>> params, stats = bn_to_flax(torch.nn.BatchNorm1d(2))
        >>> sorted(params), sorted(stats)
        (['bias', 'scale'], ['mean', 'var'])
    """
    _check_bn(module)
    params = {}
    if module.weight is not None:
        params["scale"] = _numpy(module.weight)
    if module.bias is not None:
        params["bias"] = _numpy(module.bias)
    return params, {"mean": _numpy(module.running_mean), "var": _numpy(module.running_var)}
