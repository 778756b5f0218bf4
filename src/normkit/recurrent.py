r"""LayerNorm LSTM (Ba, Kiros & Hinton 2016, section 3.2): the recurrent layer torch lacks.

torch.nn.LSTM has no layer normalization (pytorch/pytorch#6760, #7032). The modules
here add it where the paper puts it, as reference-quality RNNs: a Python loop over
time steps, with the input projection of every time step computed in one matmul. With
``layer_norm=False`` they compute exactly what :class:`torch.nn.LSTMCell` and
:class:`torch.nn.LSTM` compute, with the same parameter names, so checkpoints move
between them in both directions.

Every LayerNorm is a :class:`normkit.LayerNorm` (so :func:`normkit.functional.layer_norm`:
robust statistics and a hand-derived backward).

In 16 bits (a ``.bfloat16()`` or ``.half()`` module) the gate arithmetic and the cell
state run in float32 between the time steps, as in torch's fused LSTM kernels; the
outputs and returned states are in the module's dtype. A bfloat16 cell state had 1.5-1.9x
torch.nn.LSTM's error from float64 over 30 steps; now 0.9-1.1x
(``tests/test_recurrent.py``). With LayerNorm, rounding grows along a sequence far
more than without it, whatever the arithmetic inside a step: the recurrence itself
amplifies it, so long 16-bit sequences drift from a float64 run of the same weights;
train such models in float32 or under autocast.
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings

import torch
from torch import Tensor, nn
from torch.fx import Proxy
from torch.nn import functional as TF
from torch.nn.utils.rnn import PackedSequence

from .norms._arguments import check_arguments
from .norms._base import NotScriptable, fx_leaf
from .norms._core import check_floating, shape_str
from .norms.layer import LayerNorm

__all__ = ["LayerNormLSTMCell", "LayerNormLSTM"]

_HALF = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- math


def _input_gates(x: Tensor, weight_ih: Tensor, bias_ih: Tensor | None,
                 bias_hh: Tensor | None, ln_ih: LayerNorm | None) -> Tensor:
    """``LN(W_ih x) + b_ih + b_hh`` for every row of ``x`` (all time steps) in one matmul.

    ``x`` is ``(T, input_size)``; the result is ``(T, 4 * hidden_size)``. LayerNorm
    normalizes each row over its ``4 * hidden_size`` gate features, so normalizing all
    rows at once is normalizing each time step (and each sample) separately.
    """
    gates = TF.linear(x, weight_ih)  # (T, 4H)
    if ln_ih is not None:
        gates = ln_ih(gates)
    if bias_ih is not None and bias_hh is not None:
        gates = gates + (bias_ih + bias_hh)
    return gates


def _step(gates_x: Tensor, h: Tensor, c: Tensor, weight_hh: Tensor,
          ln_hh: LayerNorm | None, ln_cell: LayerNorm | None) -> tuple[Tensor, Tensor]:
    """One LSTM step from precomputed input gates ``(B, 4H)`` and state ``(B, H)``.

    With 16-bit ``h`` the gate arithmetic and the cell state ``c`` are float32 (``c``
    comes in and goes out in float32; ``h``, which feeds the next step's matmul, is
    rounded to ``h``'s dtype), as torch's fused LSTM kernels keep them: a 16-bit cell
    state accumulates a rounding per step, which the cell's LayerNorm then amplifies.
    """
    gates_h = TF.linear(h, weight_hh)  # (B, 4H)
    if ln_hh is not None:
        gates_h = ln_hh(gates_h)
    gates = gates_x + gates_h if h.dtype not in _HALF else gates_x.float() + gates_h.float()
    i, f, g, o = gates.chunk(4, dim=-1)  # torch's gate order
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h_new = torch.sigmoid(o) * torch.tanh(c if ln_cell is None else ln_cell(c))
    return h_new.to(h.dtype), c


def _run_direction(gates_x: Tensor, batch_sizes: list[int], h0: Tensor, c0: Tensor,
                   weight_hh: Tensor, ln_hh: LayerNorm | None, ln_cell: LayerNorm | None,
                   reverse: bool, stacked: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Run one layer in one direction over time-major packed rows.

    ``gates_x`` is ``(T, 4H)`` laid out like ``PackedSequence.data``: time step ``t``
    owns ``batch_sizes[t]`` consecutive rows, sequences sorted longest first, so the
    sequences alive at step ``t`` are the first ``batch_sizes[t]``. A padded batch is
    the special case of equal batch sizes. Padded steps never touch the state: in the
    forward direction a sequence's state is set aside when it ends; in reverse each
    sequence starts from its initial state at its own last valid step.

    Returns ``output`` ``(T, H)`` (packed like ``gates_x``; with ``stacked``, for a
    padded batch, ``(L, N, H)``: the same values, a tensor of its own rather than a view)
    and ``h_n``, ``c_n`` ``(N, H)``, the state after each sequence's last processed step.
    """
    starts = list(itertools.accumulate(batch_sizes, initial=0))
    outputs: list[Tensor] = []
    if c0.dtype in _HALF:  # the cell state in float32 between the steps (see _step)
        c0 = c0.float()
    if not reverse:
        h, c = h0, c0
        ended_h: list[Tensor] = []  # states of finished sequences, highest index first
        ended_c: list[Tensor] = []
        for t, size in enumerate(batch_sizes):
            if size < h.shape[0]:  # sequences size.. ended at step t - 1
                ended_h.append(h[size:])
                ended_c.append(c[size:])
                h, c = h[:size], c[:size]
            h, c = _step(gates_x[starts[t]:starts[t + 1]], h, c, weight_hh, ln_hh, ln_cell)
            outputs.append(h)
        ended_h.append(h)
        ended_c.append(c)
        h_n, c_n = torch.cat(ended_h[::-1]), torch.cat(ended_c[::-1])
    else:
        alive = batch_sizes[-1]
        h, c = h0[:alive], c0[:alive]
        for t in reversed(range(len(batch_sizes))):
            size = batch_sizes[t]
            if size > alive:  # sequences alive.. have their last valid step at t
                h = torch.cat([h, h0[alive:size]])
                c = torch.cat([c, c0[alive:size]])
                alive = size
            h, c = _step(gates_x[starts[t]:starts[t + 1]], h, c, weight_hh, ln_hh, ln_cell)
            outputs.append(h)
        outputs.reverse()
        h_n, c_n = h, c
    return (torch.stack(outputs) if stacked else torch.cat(outputs)), h_n, c_n.to(h_n.dtype)


# --------------------------------------------------------------------------- checks


def _check_size(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_dtype(who: str, x: Tensor, weight: Tensor) -> None:
    check_floating(x, who)
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(
            f"{who} expected input of dtype {weight.dtype} (the dtype of its parameters), "
            f"got {x.dtype}; convert the input with .to({weight.dtype}) or the module "
            f"with .to({x.dtype})"
        )


def _shape(shape: tuple[int, ...]) -> str:
    """``(2, 5)``, ``(5)``: a shape written like :func:`shape_str` writes a tensor's."""
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _check_state(who: str, hx: object, expected: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Validate ``hx = (h_0, c_0)``, both of shape ``expected``."""
    if not (isinstance(hx, (tuple, list)) and len(hx) == 2
            and all(isinstance(t, Tensor) for t in hx)):
        raise TypeError(
            f"{who} expected hx to be a tuple (h_0, c_0) of two tensors of shape "
            f"{_shape(expected)}, got {type(hx).__name__}"
            + (f" of length {len(hx)}" if isinstance(hx, (tuple, list)) else "")
        )
    for name, t in zip(("h_0", "c_0"), hx, strict=True):
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{who} expected {name} of shape {_shape(expected)}, got {name} of shape "
                f"{shape_str(t)}"
            )
    return hx[0], hx[1]


def _make_layer_norms(layer_norm: bool, hidden_size: int, eps: float,
                      factory: dict) -> tuple[LayerNorm | None, ...]:
    """``(ln_ih, ln_hh, ln_cell)``: over the ``4H`` gates, the ``4H`` gates and ``H``."""
    if not layer_norm:
        return None, None, None
    return (LayerNorm(4 * hidden_size, eps=eps, **factory),
            LayerNorm(4 * hidden_size, eps=eps, **factory),
            LayerNorm(hidden_size, eps=eps, **factory))


# --------------------------------------------------------------------------- modules


class LayerNormLSTMCell(NotScriptable, nn.Module):
    r"""An LSTM cell with Layer Normalization (Ba, Kiros & Hinton 2016, section 3.2).

    Layer Normalization, arXiv:1607.06450: the input and recurrent contributions to
    the gates are normalized separately over the ``4 * hidden_size`` gate features,
    and the cell state is normalized before the output nonlinearity:

    .. math::
        \begin{aligned}
        (i, f, g, o) &= \mathrm{LN}(W_{ih} x; \alpha_1, \beta_1)
                      + \mathrm{LN}(W_{hh} h; \alpha_2, \beta_2) + b_{ih} + b_{hh} \\
        c' &= \sigma(f) \odot c + \sigma(i) \odot \tanh(g) \\
        h' &= \sigma(o) \odot \tanh(\mathrm{LN}(c'; \alpha_3, \beta_3))
        \end{aligned}

    The gate order (``i, f, g, o``) and the parameters ``weight_ih``, ``weight_hh``,
    ``bias_ih``, ``bias_hh`` are :class:`torch.nn.LSTMCell`'s, so its ``state_dict``
    loads with ``strict=False`` (the LayerNorms ``ln_ih``, ``ln_hh``, ``ln_cell`` keep
    their initial gains 1 and biases 0). With ``layer_norm=False`` the cell *is*
    :class:`torch.nn.LSTMCell`: same parameters, same ``state_dict``, same outputs.
    The cell state ``c'`` is returned unnormalized; only ``h'`` sees
    :math:`\mathrm{LN}(c')`.

    Args:
        input_size: number of features of the input ``x``.
        hidden_size: number of features of the state ``h`` and ``c``.
        bias: learnable ``bias_ih`` and ``bias_hh``. Default: ``True``.
        layer_norm: add the three LayerNorms (``ln_ih``, ``ln_hh``, ``ln_cell``).
            Default: ``True``.
        eps: added to the variance in each LayerNorm. Default: ``1e-5``.
        device, dtype: factory arguments for the parameters.

    The LSTM weights and biases are initialized like torch's,
    :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`; LayerNorm gains to 1, biases to 0.

    Shape:
        - input: :math:`(N, H_{in})` or :math:`(H_{in})`.
        - hx: a tuple ``(h, c)`` of :math:`(N, H)` or :math:`(H)` tensors, or ``None``
          (zeros).
        - output: ``(h', c')``, each :math:`(N, H)` or :math:`(H)`.

    Example:
        >>> import torch
        >>> from normkit.recurrent import LayerNormLSTMCell
        >>> cell = LayerNormLSTMCell(10, 20)
        >>> x = torch.randn(5, 3, 10)                  # (time, batch, features)
        >>> h, c = torch.zeros(3, 20), torch.zeros(3, 20)
        >>> for x_t in x:
        ...     h, c = cell(x_t, (h, c))
        >>> h.shape, c.shape
        (torch.Size([3, 20]), torch.Size([3, 20]))
        >>> torch_cell = torch.nn.LSTMCell(10, 20)     # same parameter names
        >>> LayerNormLSTMCell(10, 20, layer_norm=False).load_state_dict(
        ...     torch_cell.state_dict())
        <All keys matched successfully>
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, *,
                 layer_norm: bool = True, eps: float = 1e-5, device=None,
                 dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.input_size = _check_size("input_size", input_size, 0)
        self.hidden_size = _check_size("hidden_size", hidden_size, 1)
        self.bias = bool(bias)
        self.layer_norm = bool(layer_norm)
        check_arguments(type(self).__name__, {"eps": eps})
        self.eps = eps
        gates = 4 * self.hidden_size
        self.weight_ih = nn.Parameter(torch.empty(gates, self.input_size, **factory))
        self.weight_hh = nn.Parameter(torch.empty(gates, self.hidden_size, **factory))
        if self.bias:
            self.bias_ih = nn.Parameter(torch.empty(gates, **factory))
            self.bias_hh = nn.Parameter(torch.empty(gates, **factory))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.ln_ih, self.ln_hh, self.ln_cell = _make_layer_norms(
            self.layer_norm, self.hidden_size, eps, factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's LSTM initialization for the weights and biases; LayerNorm to identity."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh):
            if p is not None:
                nn.init.uniform_(p, -bound, bound)
        for ln in (self.ln_ih, self.ln_hh, self.ln_cell):
            if ln is not None:
                ln.reset_parameters()

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            s += ", bias=False"
        if not self.layer_norm:
            s += ", layer_norm=False"
        return s

    def forward(self, input: Tensor,
                hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        if isinstance(input, Proxy) or isinstance(hx, Proxy):
            return fx_leaf(self, input, hx)
        who = type(self).__name__
        _check_dtype(who, input, self.weight_ih)
        if input.dim() not in (1, 2) or input.shape[-1] != self.input_size:
            raise ValueError(
                f"{who} expected input of shape (N, {self.input_size}) or "
                f"({self.input_size}) (input_size={self.input_size}), got input of shape "
                f"{shape_str(input)}"
            )
        unbatched = input.dim() == 1
        x = input.unsqueeze(0) if unbatched else input  # (N, H_in)
        n = x.shape[0]
        if hx is None:
            h = c = x.new_zeros(n, self.hidden_size)
        else:
            expected = (self.hidden_size,) if unbatched else (n, self.hidden_size)
            h, c = _check_state(who, hx, expected)
            if unbatched:
                h, c = h.unsqueeze(0), c.unsqueeze(0)
        gates_x = _input_gates(x, self.weight_ih, self.bias_ih, self.bias_hh, self.ln_ih)
        h, c = _step(gates_x, h, c, self.weight_hh, self.ln_hh, self.ln_cell)
        c = c.to(h.dtype)  # (float32 inside a 16-bit step)
        if unbatched:
            h, c = h.squeeze(0), c.squeeze(0)
        return h, c


class LayerNormLSTM(NotScriptable, nn.Module):
    r"""A multi-layer LSTM with Layer Normalization (Ba, Kiros & Hinton 2016, section 3.2).

    Layer Normalization, arXiv:1607.06450. Each layer, in each direction, runs the
    :class:`LayerNormLSTMCell` recurrence over the sequence:

    .. math::
        \begin{aligned}
        (i_t, f_t, g_t, o_t) &= \mathrm{LN}(W_{ih} x_t; \alpha_1, \beta_1)
            + \mathrm{LN}(W_{hh} h_{t-1}; \alpha_2, \beta_2) + b_{ih} + b_{hh} \\
        c_t &= \sigma(f_t) \odot c_{t-1} + \sigma(i_t) \odot \tanh(g_t) \\
        h_t &= \sigma(o_t) \odot \tanh(\mathrm{LN}(c_t; \alpha_3, \beta_3))
        \end{aligned}

    The interface is :class:`torch.nn.LSTM`'s (without ``proj_size``): the same
    constructor arguments, input and state shapes, :class:`PackedSequence` support,
    dropout between layers (not after the last), and the same parameter names
    (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ``bias_hh_l0``, with
    ``_reverse`` for the backward direction). The LayerNorms are ``ln_ih_l{k}``,
    ``ln_hh_l{k}`` and ``ln_cell_l{k}`` (``_reverse`` likewise). With
    ``layer_norm=False`` it computes what :class:`torch.nn.LSTM` computes and their
    ``state_dict`` s are interchangeable; with ``layer_norm=True`` a torch ``state_dict``
    loads with ``strict=False``.

    The input projection :math:`W_{ih} x_t` of every time step is one matmul and one
    LayerNorm over the whole sequence; only the recurrence loops over time. Padded
    steps of a :class:`PackedSequence` never update the state: ``h_n``/``c_n`` are
    each sequence's state at its own last step, and the reverse direction starts
    each sequence at its own last step.

    Args:
        input_size: number of features of the input.
        hidden_size: number of features of the state ``H``.
        num_layers: number of stacked layers. Default: ``1``.
        bias: learnable ``bias_ih``/``bias_hh`` per layer and direction. Default: ``True``.
        batch_first: input and output are ``(N, L, *)`` instead of ``(L, N, *)`` (the
            states are always ``(D * num_layers, N, H)``). Default: ``False``.
        dropout: dropout probability on the outputs of every layer but the last, in
            training mode. Default: ``0.0``.
        bidirectional: run a second, reversed direction (``D = 2``). Default: ``False``.
        layer_norm: add the LayerNorms. Default: ``True``.
        eps: added to the variance in each LayerNorm. Default: ``1e-5``.
        device, dtype: factory arguments for the parameters.

    The LSTM weights and biases are initialized like torch's,
    :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`; LayerNorm gains to 1, biases to 0.

    Shape:
        - input: :math:`(L, N, H_{in})`, :math:`(N, L, H_{in})` with ``batch_first``,
          :math:`(L, H_{in})` unbatched, or a :class:`PackedSequence`.
        - hx: a tuple ``(h_0, c_0)``, each :math:`(D \cdot \text{num\_layers}, N, H)`
          (:math:`(D \cdot \text{num\_layers}, H)` unbatched), or ``None`` (zeros).
        - output: :math:`(L, N, D \cdot H)` (``batch_first``: :math:`(N, L, D \cdot H)`;
          unbatched: :math:`(L, D \cdot H)`; a :class:`PackedSequence` for packed
          input), and ``(h_n, c_n)`` shaped like ``(h_0, c_0)``.

    Example:
        >>> import torch
        >>> from normkit.recurrent import LayerNormLSTM
        >>> lstm = LayerNormLSTM(10, 20, num_layers=2, batch_first=True, bidirectional=True)
        >>> out, (h_n, c_n) = lstm(torch.randn(3, 7, 10))   # (batch, time, features)
        >>> out.shape, h_n.shape
        (torch.Size([3, 7, 40]), torch.Size([4, 3, 20]))
        >>> plain = LayerNormLSTM(10, 20, layer_norm=False)  # torch.nn.LSTM's weights
        >>> plain.load_state_dict(torch.nn.LSTM(10, 20).state_dict())
        <All keys matched successfully>
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, *, layer_norm: bool = True, eps: float = 1e-5,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.input_size = _check_size("input_size", input_size, 0)
        self.hidden_size = _check_size("hidden_size", hidden_size, 1)
        self.num_layers = _check_size("num_layers", num_layers, 1)
        if (isinstance(dropout, bool) or not isinstance(dropout, numbers.Real)
                or not 0.0 <= dropout <= 1.0):
            raise ValueError(
                f"dropout should be a number in the range [0, 1] representing the "
                f"probability of an element being zeroed, got {dropout!r}"
            )
        if dropout > 0 and self.num_layers == 1:
            warnings.warn(
                "dropout adds dropout after all but the last recurrent layer, so a "
                f"non-zero dropout expects num_layers greater than 1, but got "
                f"dropout={dropout} and num_layers={self.num_layers}",
                stacklevel=2,
            )
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.dropout = float(dropout)
        self.bidirectional = bool(bidirectional)
        self.layer_norm = bool(layer_norm)
        check_arguments(type(self).__name__, {"eps": eps})
        self.eps = eps
        gates = 4 * self.hidden_size
        num_directions = 2 if self.bidirectional else 1
        self._suffixes: list[str] = []  # "_l0", "_l0_reverse", ... (layer-major)
        for layer in range(self.num_layers):
            layer_input = self.input_size if layer == 0 else num_directions * self.hidden_size
            for direction in range(num_directions):
                sfx = f"_l{layer}" + ("_reverse" if direction == 1 else "")
                self._suffixes.append(sfx)
                self.register_parameter(
                    f"weight_ih{sfx}", nn.Parameter(torch.empty(gates, layer_input, **factory)))
                self.register_parameter(
                    f"weight_hh{sfx}",
                    nn.Parameter(torch.empty(gates, self.hidden_size, **factory)))
                for name in (f"bias_ih{sfx}", f"bias_hh{sfx}"):
                    param = nn.Parameter(torch.empty(gates, **factory)) if self.bias else None
                    self.register_parameter(name, param)
                lns = _make_layer_norms(self.layer_norm, self.hidden_size, eps, factory)
                for name, ln in zip(("ln_ih", "ln_hh", "ln_cell"), lns, strict=True):
                    self.register_module(f"{name}{sfx}", ln)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's LSTM initialization for the weights and biases; LayerNorm to identity."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for sfx in self._suffixes:
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                p = getattr(self, f"{name}{sfx}")
                if p is not None:
                    nn.init.uniform_(p, -bound, bound)
            for name in ("ln_ih", "ln_hh", "ln_cell"):
                ln = getattr(self, f"{name}{sfx}")
                if ln is not None:
                    ln.reset_parameters()

    def flatten_parameters(self) -> None:
        """Do nothing: there is no cuDNN weight buffer to compact (torch.nn.LSTM parity).

        Example:
            >>> LayerNormLSTM(4, 8).flatten_parameters() is None
            True
        """

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        if not self.layer_norm:
            s += ", layer_norm=False"
        return s

    def forward(
        self, input: Tensor | PackedSequence, hx: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        if isinstance(input, Proxy) or isinstance(hx, Proxy):
            return fx_leaf(self, input, hx)
        who = type(self).__name__
        num_directions = 2 if self.bidirectional else 1
        packed = isinstance(input, PackedSequence)
        if packed:
            data, batch_sizes_t, sorted_indices, unsorted_indices = input
            _check_dtype(who, data, self.weight_ih_l0)
            if data.dim() != 2 or data.shape[1] != self.input_size:
                raise ValueError(
                    f"{who} expected a PackedSequence with data of shape "
                    f"(*, {self.input_size}) (input_size={self.input_size}), got data of "
                    f"shape {shape_str(data)}"
                )
            batch_sizes = batch_sizes_t.tolist()
            n, unbatched = batch_sizes[0], False
        else:
            _check_dtype(who, input, self.weight_ih_l0)
            layout = "(N, L, H_in)" if self.batch_first else "(L, N, H_in)"
            if input.dim() not in (2, 3) or input.shape[-1] != self.input_size:
                raise ValueError(
                    f"{who} expected input of shape {layout} or (L, H_in) with "
                    f"H_in = input_size = {self.input_size}, got input of shape "
                    f"{shape_str(input)}"
                )
            unbatched = input.dim() == 2
            if unbatched:
                x = input.unsqueeze(1)
            else:
                x = input.transpose(0, 1) if self.batch_first else input
            steps, n = x.shape[:2]  # x: (L, N, H_in)
            if steps == 0:
                raise ValueError(
                    f"{who} expected a sequence length of at least 1, got input of shape "
                    f"{shape_str(input)}"
                )
            data = x.reshape(steps * n, self.input_size)  # time-major rows, like packed data
            batch_sizes = [n] * steps
        layers = num_directions * self.num_layers
        if hx is None:
            h0 = c0 = data.new_zeros(layers, n, self.hidden_size)
        else:
            expected = (layers, self.hidden_size) if unbatched else (
                layers, n, self.hidden_size)
            h0, c0 = _check_state(who, hx, expected)
            if unbatched:
                h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
            elif packed and sorted_indices is not None:
                h0 = h0.index_select(1, sorted_indices)
                c0 = c0.index_select(1, sorted_indices)

        layer_input = data  # (T, features), T = sum(batch_sizes)
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(num_directions):
                k = layer * num_directions + direction
                sfx = self._suffixes[k]
                gates_x = _input_gates(
                    layer_input, getattr(self, f"weight_ih{sfx}"),
                    getattr(self, f"bias_ih{sfx}"), getattr(self, f"bias_hh{sfx}"),
                    getattr(self, f"ln_ih{sfx}"))  # (T, 4H)
                # (the last layer of a padded batch stacked as (L, N, H): its output is
                # then a tensor of its own, as torch's LSTM's, not a view)
                out, h, c = _run_direction(
                    gates_x, batch_sizes, h0[k], c0[k], getattr(self, f"weight_hh{sfx}"),
                    getattr(self, f"ln_hh{sfx}"), getattr(self, f"ln_cell{sfx}"),
                    reverse=direction == 1,
                    stacked=not packed and layer == self.num_layers - 1)
                outputs.append(out)
                h_n.append(h)
                c_n.append(c)
            layer_input = torch.cat(outputs, dim=-1) if num_directions == 2 else outputs[0]
            if layer < self.num_layers - 1 and self.dropout > 0:
                layer_input = TF.dropout(layer_input, self.dropout, self.training)
        h_out, c_out = torch.stack(h_n), torch.stack(c_n)  # (D * num_layers, N, H)

        if packed:
            if unsorted_indices is not None:
                h_out = h_out.index_select(1, unsorted_indices)
                c_out = c_out.index_select(1, unsorted_indices)
            output = PackedSequence(layer_input, batch_sizes_t, sorted_indices,
                                    unsorted_indices)
            return output, (h_out, c_out)
        output = layer_input  # (L, N, D * H)
        if unbatched:
            return output.squeeze(1), (h_out.squeeze(1), c_out.squeeze(1))
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, (h_out, c_out)
