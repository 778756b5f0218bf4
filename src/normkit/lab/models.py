"""The lab's small networks, each built with a normalization chosen by a short name.

Names (:data:`NORMS`): ``bn`` (BatchNorm), ``brn`` (Batch Renormalization), ``gn``
(GroupNorm, :data:`normkit.lab.core.GN_GROUPS` groups), ``ln`` (LayerNorm: over the
features of ``(N, C)``; over ``(C, H, W)`` of each image for a CNN, as in Wu & He 2018
and the article's code, i.e. ``GroupNorm(1, C)``), ``rms`` (RMSNorm), ``noisy_bn``
(BatchNorm followed by random per-unit scale and shift, Santurkar et al. 2018) and
``none``.

Example:
    >>> import torch
    >>> mlp("ln", depth=2, width=16)(torch.zeros(3, 64)).shape
    torch.Size([3, 10])
    >>> cnn("gn")(torch.zeros(3, 1, 8, 8)).shape
    torch.Size([3, 10])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..norms.batch import BatchNorm1d, BatchNorm2d, BatchRenorm1d, BatchRenorm2d
from ..norms.group import GroupNorm
from ..norms.layer import LayerNorm, RMSNorm
from ..norms.power import PowerNorm
from ..recurrent import LayerNormLSTM
from .core import GN_GROUPS

__all__ = [
    "NORMS", "norm_layer", "mlp", "cnn", "NoisyBatchNorm1d", "resample_noise",
    "renorm_schedule", "BatchNormLSTM", "SequenceClassifier", "lstm_classifier",
    "TokenBatchNorm", "TRANSFORMER_NORMS", "token_norm", "TransformerClassifier",
]

NORMS = ("bn", "brn", "gn", "ln", "rms", "noisy_bn", "none")


def renorm_schedule(total_steps: int) -> dict[str, int]:
    """Batch Renormalization's schedule (Ioffe 2017) mapped onto a run of ``total_steps``.

    The paper relaxes ``r_max`` from step 5k to 40k and ``d_max`` from 5k to 25k; here
    those step counts are scaled by ``total_steps / 80000``, so ``r_max`` reaches its
    final value at half of the run.

    Example:
        >>> renorm_schedule(800)
        {'warmup_steps': 50, 'r_max_steps': 400, 'd_max_steps': 250}
    """
    scale = total_steps / 80000
    return {"warmup_steps": round(5000 * scale), "r_max_steps": max(1, round(40000 * scale)),
            "d_max_steps": max(1, round(25000 * scale))}


class NoisyBatchNorm1d(BatchNorm1d):
    """BatchNorm followed by a random per-unit scale and shift while training.

    Santurkar et al. 2018 ("How does batch normalization help optimization?", §2.1)
    inject "time-varying, non-zero mean and non-unit variance" noise after each BN
    layer to make the distribution of the next layer's inputs shift at every step.
    Here, per unit, ``y = BN(x) * s + m`` with ``s ~ U(1 - scale, 1 + scale)`` and
    ``m ~ U(-shift, shift)``, redrawn by :meth:`resample` (call it once per step);
    inference is plain BatchNorm.

    Example:
        >>> layer = NoisyBatchNorm1d(4, generator=torch.Generator().manual_seed(0))
        >>> layer.resample()
        >>> layer(torch.randn(8, 4)).shape
        torch.Size([8, 4])
    """

    def __init__(self, num_features: int, *, shift: float = 0.5, scale: float = 0.5,
                 generator: torch.Generator | None = None, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.noise_shift, self.noise_scale = float(shift), float(scale)
        self.generator = generator
        self.register_buffer("noise_s", torch.ones(num_features), persistent=False)
        self.register_buffer("noise_m", torch.zeros(num_features), persistent=False)

    def resample(self) -> None:
        """Draw a new scale and shift for every unit."""
        c = self.num_features
        u = torch.rand(2, c, generator=self.generator)
        self.noise_s.copy_(1 - self.noise_scale + 2 * self.noise_scale * u[0])
        self.noise_m.copy_(self.noise_shift * (2 * u[1] - 1))

    def forward(self, input: Tensor) -> Tensor:
        """BatchNorm, then the current noise while training."""
        out = super().forward(input)
        if self.training:
            out = out * self.noise_s + self.noise_m
        return out


def resample_noise(model: nn.Module) -> None:
    """Call :meth:`NoisyBatchNorm1d.resample` on every noisy layer of ``model``.

    Example:
        >>> resample_noise(torch.nn.Linear(2, 2))  # no noisy layer: nothing to do
    """
    for module in model.modules():
        if isinstance(module, NoisyBatchNorm1d):
            module.resample()


def norm_layer(name: str, channels: int, *, image: bool = False,
               total_steps: int | None = None,
               generator: torch.Generator | None = None) -> nn.Module:
    """The lab's norm ``name`` for ``channels`` features (``image``: ``(N, C, H, W)``).

    Args:
        name: one of :data:`NORMS`.
        channels: the feature or channel count.
        image: build for ``(N, C, H, W)`` instead of ``(N, C)``.
        total_steps: the run's length, for ``brn``'s schedule (:func:`renorm_schedule`).
        generator: the noise generator of ``noisy_bn``.

    Example:
        >>> norm_layer("ln", 16, image=True)
        GroupNorm(1, 16, eps=1e-05, affine=True, bias=True)
        >>> norm_layer("gn", 16)
        GroupNorm(8, 16, eps=1e-05, affine=True, bias=True)
    """
    if name == "bn":
        return BatchNorm2d(channels) if image else BatchNorm1d(channels)
    if name == "brn":
        if total_steps is None:
            raise ValueError("norm 'brn' expected total_steps (its schedule follows the run)")
        cls = BatchRenorm2d if image else BatchRenorm1d
        return cls(channels, **renorm_schedule(total_steps))
    if name == "gn":
        return GroupNorm(math.gcd(GN_GROUPS, channels), channels)
    if name == "ln":
        return GroupNorm(1, channels) if image else LayerNorm(channels)
    if name == "rms":
        if image:
            raise ValueError("norm 'rms' expected (N, C) features, got image=True")
        return RMSNorm(channels)
    if name == "noisy_bn":
        if image:
            raise ValueError("norm 'noisy_bn' expected (N, C) features, got image=True")
        return NoisyBatchNorm1d(channels, generator=generator)
    if name == "none":
        return nn.Identity()
    raise ValueError(f"unknown lab norm {name!r}; expected one of {', '.join(NORMS)}")


def mlp(norm: str, depth: int = 3, width: int = 64, *, activation: str = "relu",
        in_features: int = 64, num_classes: int = 10, total_steps: int | None = None,
        generator: torch.Generator | None = None) -> nn.Sequential:
    """``depth`` blocks ``Linear -> norm -> activation``, then a linear head.

    The linear layers carry a bias only without a norm (the norm's shift replaces it).

    Example:
        >>> [type(m).__name__ for m in mlp("bn", depth=1, width=8, activation="sigmoid")]
        ['Linear', 'BatchNorm1d', 'Sigmoid', 'Linear']
    """
    acts = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}
    if activation not in acts:
        raise ValueError(f"activation must be one of {', '.join(acts)}, got {activation!r}")
    layers: list[nn.Module] = []
    d = in_features
    for _ in range(depth):
        layers.append(nn.Linear(d, width, bias=norm == "none"))
        layers.append(norm_layer(norm, width, total_steps=total_steps, generator=generator))
        layers.append(acts[activation]())
        d = width
    layers.append(nn.Linear(d, num_classes))
    return nn.Sequential(*layers)


def cnn(norm: str, channels: tuple[int, ...] = (16, 32), *,
        total_steps: int | None = None) -> nn.Sequential:
    """The quickstart's CNN for ``(N, 1, 8, 8)`` digits with the lab's norm ``name``.

    See :func:`normkit.quickstart.make_cnn`: ``[conv3x3 -> norm -> ReLU -> maxpool]``
    per entry of ``channels``, then a linear head.

    Example:
        >>> [type(m).__name__ for m in cnn("bn")][:4]
        ['Conv2d', 'BatchNorm2d', 'ReLU', 'MaxPool2d']
    """
    from ..quickstart import make_cnn

    def factory(num_features: int, **kwargs) -> nn.Module:
        return norm_layer(norm, num_features, image=True, total_steps=total_steps)

    return make_cnn(factory, channels=channels)


class BatchNormLSTM(nn.Module):
    """An LSTM with BatchNorm on its input, recurrent and cell terms (one layer).

    The recurrent batch normalization of Cooijmans et al. 2016 with the statistics of
    each BatchNorm shared over time steps (what a plain ``BatchNorm1d`` per term gives):

    ``gates = BN_x(W_ih x_t) + BN_h(W_hh h_{t-1}) + b``,
    ``h_t = o * tanh(BN_c(c_t))``. ``BN_h`` is skipped at ``t = 0`` (``h_0 = 0``).

    Weights are named and initialized like :class:`torch.nn.LSTM`'s (``U(-1/sqrt(H),
    1/sqrt(H))`` in the order ``weight_ih, weight_hh, bias_ih, bias_hh``), so with the
    same seed it starts from the same weights as :class:`normkit.LayerNormLSTM`.

    Shape: input ``(N, L, input_size)`` (batch first), output ``(N, L, H)``.

    Example:
        >>> lstm = BatchNormLSTM(8, 16)
        >>> out, (h, c) = lstm(torch.randn(4, 5, 8))
        >>> out.shape, h.shape
        (torch.Size([4, 5, 16]), torch.Size([1, 4, 16]))
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_size, self.hidden_size = input_size, hidden_size
        gates = 4 * hidden_size
        self.weight_ih_l0 = nn.Parameter(torch.empty(gates, input_size))
        self.weight_hh_l0 = nn.Parameter(torch.empty(gates, hidden_size))
        self.bias_ih_l0 = nn.Parameter(torch.empty(gates))
        self.bias_hh_l0 = nn.Parameter(torch.empty(gates))
        self.bn_ih = BatchNorm1d(gates, affine=False)
        self.bn_hh = BatchNorm1d(gates, affine=False)
        self.bn_cell = BatchNorm1d(hidden_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's LSTM initialization; BatchNorm to identity."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in (self.weight_ih_l0, self.weight_hh_l0, self.bias_ih_l0, self.bias_hh_l0):
            nn.init.uniform_(p, -bound, bound)
        for bn in (self.bn_ih, self.bn_hh, self.bn_cell):
            bn.reset_parameters()

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Run the sequence; returns ``(output, (h_n, c_n))`` like ``torch.nn.LSTM``."""
        n, length, _ = x.shape
        gx = self.bn_ih((x @ self.weight_ih_l0.T).reshape(n * length, -1))  # (N*L, 4H)
        gx = gx.reshape(n, length, -1) + self.bias_ih_l0 + self.bias_hh_l0
        h = x.new_zeros(n, self.hidden_size)
        c = x.new_zeros(n, self.hidden_size)
        outputs = []
        for t in range(length):
            gates = gx[:, t]
            if t > 0:
                gates = gates + self.bn_hh(h @ self.weight_hh_l0.T)
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(self.bn_cell(c))
            outputs.append(h)
        return torch.stack(outputs, dim=1), (h.unsqueeze(0), c.unsqueeze(0))


class SequenceClassifier(nn.Module):
    """A recurrent network followed by a linear head on its last output.

    Example:
        >>> model = SequenceClassifier(torch.nn.LSTM(8, 16, batch_first=True), 16, 10)
        >>> model(torch.randn(4, 5, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(self, rnn: nn.Module, hidden_size: int, num_classes: int) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits from the recurrent network's last output."""
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def lstm_classifier(norm: str, input_size: int, hidden_size: int,
                    num_classes: int = 10) -> SequenceClassifier:
    """An LSTM classifier: ``none`` and ``ln`` use :class:`normkit.LayerNormLSTM`
    (``layer_norm`` off/on), ``bn`` uses :class:`BatchNormLSTM`.

    Example:
        >>> type(lstm_classifier("ln", 8, 16).rnn).__name__
        'LayerNormLSTM'
    """
    if norm in ("none", "ln"):
        rnn: nn.Module = LayerNormLSTM(input_size, hidden_size, batch_first=True,
                                       layer_norm=norm == "ln")
    elif norm == "bn":
        rnn = BatchNormLSTM(input_size, hidden_size)
    else:
        raise ValueError(f"lstm_classifier expected norm 'none', 'ln' or 'bn', got {norm!r}")
    return SequenceClassifier(rnn, hidden_size, num_classes)


class TokenBatchNorm(nn.Module):
    """BatchNorm over the tokens of ``(N, T, C)``: each channel's statistics over every
    token of the batch (``BatchNorm1d`` on the ``(N*T, C)`` view), as BatchNorm in a
    Transformer computes them (Shen et al. 2020's baseline).

    Example:
        >>> y = TokenBatchNorm(4)(torch.randn(3, 5, 4) * 2 + 1)
        >>> bool(y.reshape(-1, 4).mean(0).abs().max() < 1e-5)
        True
    """

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.bn = BatchNorm1d(num_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(x.reshape(-1, x.shape[-1])).view(x.shape)


#: The norms a :class:`TransformerClassifier` takes.
TRANSFORMER_NORMS = ("none", "ln", "bn", "pn")


def token_norm(name: str, d_model: int, *, warmup_iters: int = 0) -> nn.Module:
    """A norm over the channels of ``(N, T, d_model)`` tokens: ``ln`` (LayerNorm per
    token), ``bn`` (:class:`TokenBatchNorm`), ``pn`` (:class:`normkit.PowerNorm`, with
    its group scaling over one group and ``warmup_iters`` steps of batch statistics) or
    ``none``.

    Example:
        >>> token_norm("pn", 8, warmup_iters=30).warmup_iters
        30
    """
    if name == "ln":
        return LayerNorm(d_model)
    if name == "bn":
        return TokenBatchNorm(d_model)
    if name == "pn":
        return PowerNorm(d_model, warmup_iters=warmup_iters)
    if name == "none":
        return nn.Identity()
    raise ValueError(f"token_norm expected one of {', '.join(TRANSFORMER_NORMS)}, got "
                     f"{name!r}")


class _EncoderBlock(nn.Module):
    """Pre-norm: ``x + attn(norm1(x))``, then ``x + ff(norm2(x))``."""

    def __init__(self, norm: str, d_model: int, heads: int, warmup_iters: int) -> None:
        super().__init__()
        self.norm1 = token_norm(norm, d_model, warmup_iters=warmup_iters)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm2 = token_norm(norm, d_model, warmup_iters=warmup_iters)
        self.ff = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.ReLU(),
                                nn.Linear(2 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class TransformerClassifier(nn.Module):
    """A small pre-norm Transformer encoder classifying ``(N, T, F)`` token sequences.

    Each token (a digit's row of pixels) is embedded linearly with a learned position,
    then ``depth`` encoder blocks as in the article's encoder layer (norm1 before the
    self-attention, norm2 before the feed-forward block of width ``2 * d_model``), a
    final norm, the mean over tokens, and a linear head. Every norm is ``norm`` (see
    :func:`token_norm`).

    Example:
        >>> model = TransformerClassifier("bn", features=8, tokens=8, d_model=16)
        >>> model(torch.randn(4, 8, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(self, norm: str, *, features: int, tokens: int, d_model: int = 32,
                 depth: int = 2, heads: int = 4, num_classes: int = 10,
                 warmup_iters: int = 0) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d_model)
        self.position = nn.Parameter(0.1 * torch.randn(tokens, d_model))
        self.blocks = nn.Sequential(*(_EncoderBlock(norm, d_model, heads, warmup_iters)
                                      for _ in range(depth)))
        self.norm = token_norm(norm, d_model, warmup_iters=warmup_iters)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.embed(x) + self.position)
        return self.head(self.norm(h).mean(1))
