"""Adaptive gradient clipping (Brock et al. 2021, NFNets), unit-wise."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["adaptive_clip_grad_", "unitwise_norm", "AGC"]


def unitwise_norm(x: Tensor) -> Tensor:
    """The 2-norm of each unit of ``x``, broadcastable against it (float32 or better).

    A unit is a slice along dim 0, the output unit of ``Linear`` and ``ConvNd`` weights
    ``(out, in, *k)``, normed over every other dim whatever the memory layout; vectors and
    scalars (biases, gains) are normed elementwise, as in NFNets.

    Example:
        >>> unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([[5.],
                [1.]])
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.dim() <= 1:
        return x.abs().to(compute)
    return torch.linalg.vector_norm(x, 2, tuple(range(1, x.dim())), keepdim=True, dtype=compute)


def _check_clipping(who: str, clip_factor: float, eps: float) -> None:
    for name, value in (("clip_factor", clip_factor), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                0 < value < float("inf")):
            raise ValueError(f"{who} expected clip_factor > 0 and eps > 0 (finite numbers), "
                             f"got {name}={value!r}")


@torch.no_grad()
def adaptive_clip_grad_(parameters: Iterable[Tensor] | Tensor, clip_factor: float = 0.01,
                        eps: float = 1e-3) -> Tensor:
    r"""Clip gradients unit-wise relative to their weights, in place (NFNets' AGC).

    For every unit ``i`` (see :func:`unitwise_norm`) of every parameter ``W`` with
    gradient ``G``:

    .. math:: G_i \leftarrow G_i \cdot \frac{\lambda \max(\lVert W_i\rVert, \epsilon)}
              {\lVert G_i \rVert} \quad \text{if} \quad
              \frac{\lVert G_i\rVert}{\max(\lVert W_i\rVert, \epsilon)} > \lambda

    The ``eps`` keeps zero-initialized weights (biases, a zero-init residual gamma) from
    freezing. Brock et al. use ``clip_factor`` 0.01 at large batch and never clip the
    final classifier (see :class:`AGC`'s ``exclude``).

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` is clipped.
        clip_factor: the largest allowed ``||G_i|| / max(||W_i||, eps)``. Default: ``0.01``.
        eps: floor of the weight norm. Default: ``1e-3``.

    Returns:
        The number of units clipped (a tensor, so no device sync is forced).

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
        >>> w.grad = torch.tensor([[30.0, 40.0]])
        >>> adaptive_clip_grad_([w], clip_factor=0.1)
        tensor(1)
        >>> w.grad
        tensor([[0.3000, 0.4000]])
    """
    _check_clipping("adaptive_clip_grad_", clip_factor, eps)
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    clipped = torch.zeros((), dtype=torch.int64)
    for p in parameters:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise ValueError("adaptive_clip_grad_ expected dense gradients, got a sparse one")
        max_norm = unitwise_norm(p.detach()).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(p.grad)
        too_big = grad_norm > max_norm
        scale = torch.where(too_big, max_norm / grad_norm.clamp(min=1e-6), 1.0)
        p.grad.mul_(scale.to(p.grad.dtype))
        clipped = clipped.to(too_big.device) + too_big.sum()
    return clipped


def _params_of(items) -> list[Tensor]:
    out: list[Tensor] = []
    for item in items:
        if isinstance(item, nn.Module):
            out.extend(item.parameters())
        elif isinstance(item, Tensor):
            out.append(item)
        else:
            raise TypeError(f"exclude expects parameters or modules (or names with model=), "
                            f"got {type(item).__name__}")
    return out


class AGC(torch.optim.Optimizer):
    """Wrap an optimizer so every ``step()`` applies adaptive gradient clipping first.

    An :class:`torch.optim.Optimizer` itself, sharing the wrapped one's parameter groups
    and state: learning-rate schedulers, ``torch.amp.GradScaler`` (``scaler.step(agc)``
    unscales, then clips) and checkpoints (``state_dict`` is the wrapped optimizer's)
    take it where they take the optimizer.

    Args:
        optimizer: any ``torch.optim.Optimizer``; everything but ``step`` is forwarded
            (hooks registered on the wrapper are the wrapped optimizer's: they run
            around its step, after the clipping).
        clip_factor, eps: see :func:`adaptive_clip_grad_`.
        exclude: parameters, modules, or (with ``model``) module/parameter names whose
            gradients are never clipped: Brock et al. leave the final classifier alone.
        model: resolves names in ``exclude``.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                           torch.nn.Linear(8, 2))
        >>> opt = AGC(torch.optim.SGD(net.parameters(), lr=0.1), exclude=["2"], model=net)
        >>> net(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clip_factor: float = 0.01,
                 eps: float = 1e-3, *, exclude: Iterable = (), model: nn.Module | None = None):
        # (not Optimizer.__init__: the wrapped optimizer owns the groups and the state)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"AGC expected a torch.optim.Optimizer to wrap, got "
                            f"{type(optimizer).__name__}")
        _check_clipping("AGC", clip_factor, eps)  # (when built, not at the first step)
        self.__dict__["optimizer"] = optimizer
        self.clip_factor, self.eps = clip_factor, eps
        names = [e for e in exclude if isinstance(e, str)]
        others = [e for e in exclude if not isinstance(e, str)]
        excluded = _params_of(others)
        if names:
            if model is None:
                raise ValueError(f"exclude names {names} need model= to resolve them")
            modules, params = dict(model.named_modules()), dict(model.named_parameters())
            for name in names:
                if name in modules:
                    excluded.extend(modules[name].parameters())
                elif name in params:
                    excluded.append(params[name])
                else:
                    raise ValueError(f"exclude name {name!r} is neither a module nor a "
                                     f"parameter of the model")
        self._excluded = {id(p) for p in excluded}

    def clip_(self) -> Tensor:
        """Clip the gradients of every non-excluded parameter; return units clipped.

        Example:
            >>> import torch
            >>> layer = torch.nn.Linear(2, 1, bias=False)
            >>> layer.weight.data.fill_(1.0)  # doctest: +ELLIPSIS
            tensor(...)
            >>> layer.weight.grad = torch.full((1, 2), 10.0)  # 10x the weight's norm
            >>> agc = AGC(torch.optim.SGD(layer.parameters(), lr=0.1), clip_factor=0.1)
            >>> int(agc.clip_()), round(layer.weight.grad.norm().item(), 4)  # 0.1 x |w|
            (1, 0.1414)
        """
        params = [p for group in self.optimizer.param_groups for p in group["params"]
                  if id(p) not in self._excluded]
        return adaptive_clip_grad_(params, self.clip_factor, self.eps)

    def step(self, closure=None):
        """Clip, then take the wrapped optimizer's step (with an optional ``closure`` that
        recomputes the loss, as ``torch.optim.Optimizer.step`` takes one).

        Example:
            >>> import torch
            >>> layer = torch.nn.Linear(2, 1)
            >>> agc = AGC(torch.optim.SGD(layer.parameters(), lr=0.1))
            >>> def closure():
            ...     agc.zero_grad()
            ...     loss = layer(torch.ones(4, 2)).square().mean()
            ...     loss.backward()
            ...     return loss
            >>> bool(agc.step(closure) >= 0)
            True
        """
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.clip_()
            self.optimizer.step()
            return loss
        self.clip_()
        return self.optimizer.step()

    # the wrapped optimizer's groups, state and settings, read and written through
    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    state = property(lambda self: self.optimizer.state,
                     lambda self, value: setattr(self.optimizer, "state", value))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, value: setattr(self.optimizer, "defaults", value))

    def state_dict(self):
        """The wrapped optimizer's ``state_dict`` (AGC itself keeps no state).

        Example:
            >>> import torch
            >>> sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
            >>> AGC(sgd).state_dict()["param_groups"][0]["lr"]
            0.1
        """
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load into the wrapped optimizer (a checkpoint of it, or of an AGC around it).

        Example:
            >>> import torch
            >>> params = list(torch.nn.Linear(2, 1).parameters())
            >>> agc = AGC(torch.optim.SGD(params, lr=0.1))
            >>> agc.load_state_dict(torch.optim.SGD(params, lr=0.5).state_dict())
            >>> agc.optimizer.param_groups[0]["lr"]
            0.5
        """
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``.

        Example:
            >>> import torch
            >>> layer = torch.nn.Linear(2, 1)
            >>> layer(torch.ones(1, 2)).sum().backward()
            >>> AGC(torch.optim.SGD(layer.parameters(), lr=0.1)).zero_grad()
            >>> layer.weight.grad is None
            True
        """
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the wrapped optimizer (clipped from the next step on).

        Example:
            >>> import torch
            >>> agc = AGC(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
            >>> agc.add_param_group({"params": torch.nn.Linear(3, 1).parameters()})
            >>> len(agc.param_groups)
            2
        """
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook):
        """Hooks of every kind are the wrapped optimizer's: they run around its step,
        after the clipping (the five ``register_*`` methods alike).

        Example:
            >>> import torch
            >>> agc = AGC(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
            >>> handle = agc.register_step_pre_hook(lambda opt, args, kwargs: None)
            >>> len(agc.optimizer._optimizer_step_pre_hooks)
            1
        """
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self):
        # the exclusions as positions in the wrapped optimizer's groups: ids name these
        # parameters only, and a copy or an unpickled wrapper holds others (by ids it
        # would silently clip the layers the user excluded)
        state = dict(self.__dict__)
        state["_excluded"] = frozenset(
            (g, i) for g, group in enumerate(self.optimizer.param_groups)
            for i, p in enumerate(group["params"]) if id(p) in self._excluded)
        return state

    def __setstate__(self, state) -> None:
        state = dict(state)
        excluded = state.pop("_excluded", frozenset())
        self.__dict__.update(state)
        if any(isinstance(e, int) for e in excluded):  # (ids: an older normkit's pickle)
            warnings.warn(f"this AGC was pickled with {len(excluded)} excluded parameters "
                          "named by the ids of the originals, which name nothing now: the "
                          "exclusions are lost, every parameter is clipped; build the AGC "
                          "again with exclude=", RuntimeWarning, stacklevel=2)
        self._excluded = {
            id(p) for g, group in enumerate(self.optimizer.param_groups)
            for i, p in enumerate(group["params"]) if (g, i) in excluded}

    def __repr__(self) -> str:
        return (f"AGC(clip_factor={self.clip_factor}, eps={self.eps}, "
                f"excluded={len(self._excluded)}) wrapping {self.optimizer!r}")

    def __getattr__(self, name):
        if name == "optimizer":  # (not set yet: unpickling, a failed __init__)
            raise AttributeError(name)
        return getattr(self.optimizer, name)
