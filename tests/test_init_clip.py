"""init_norms_ and adaptive gradient clipping."""

from __future__ import annotations

import warnings

import pytest
import torch
from cases import TORCH_RELEASE
from torch import nn

import normkit
from normkit.tools.clip import unitwise_norm


class Block(nn.Module):
    def __init__(self, channels, downsample=False):
        super().__init__()
        out = channels * 2 if downsample else channels
        self.conv1 = nn.Conv2d(channels, out, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(out)
        self.down = nn.Sequential(nn.Conv2d(channels, out, 1), nn.BatchNorm2d(out)) \
            if downsample else None

    def forward(self, x):
        skip = x if self.down is None else self.down(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + skip)


def test_identity_init_and_zero_init_residual():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), Block(4), Block(4, True))
    with torch.no_grad():
        for p in net.parameters():
            p.uniform_(-2, 2)
    done = normkit.init_norms_(net, zero_init_residual=True)
    assert set(done) == {"1", "2.bn1", "2.bn2", "3.bn1", "3.bn2", "3.down.1"}
    for name in ("2.bn2", "3.bn2"):
        assert torch.all(net.get_submodule(name).weight == 0), name
    for name in ("1", "2.bn1", "3.bn1", "3.down.1"):
        assert torch.all(net.get_submodule(name).weight == 1), name
        assert torch.all(net.get_submodule(name).bias == 0), name
    # every residual block now starts as its shortcut (identity / downsample branch)
    block = net[2].eval()
    x = torch.randn(2, 4, 5, 5).relu()
    torch.testing.assert_close(block(x), x)


def test_bias_before_relu_only_where_a_layernorm_feeds_a_relu():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.ln1 = nn.Linear(4, 8), nn.LayerNorm(8)
            self.ln2 = nn.LayerNorm(8)

        def forward(self, x):
            return self.ln2(torch.relu(self.ln1(self.a(x))))

    net = Mixed()
    done = normkit.init_norms_(net, bias_before_relu=0.1)
    assert torch.all(net.ln1.bias == 0.1) and torch.all(net.ln2.bias == 0.0)
    assert "before ReLU" in done["ln1"]


def test_untraceable_models():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.ReLU())

        def forward(self, x):
            return self.body(x) if x.sum() > 0 else x

    net = Branchy()
    normkit.init_norms_(net, bias_before_relu=0.1)  # Sequential order still finds it
    assert torch.all(net.body[1].bias == 0.1)
    with pytest.raises(ValueError, match="traceable"):
        normkit.init_norms_(net, zero_init_residual=True)
    with pytest.warns(UserWarning, match="no normalization layer"):
        assert normkit.init_norms_(nn.Linear(2, 2)) == {}


def _direct_agc(weight, grad, clip_factor, eps):
    """NFNets' AGC written out unit by unit, in float64."""
    out = grad.clone().double()
    w, g = weight.double(), grad.double()
    if w.dim() <= 1:
        w_norm, g_norm = w.abs(), g.abs()
        for i in range(w.numel()):
            limit = clip_factor * max(float(w_norm.view(-1)[i]), eps)
            if float(g_norm.view(-1)[i]) > limit:
                out.view(-1)[i] = g.view(-1)[i] * limit / float(g_norm.view(-1)[i])
        return out
    for i in range(w.shape[0]):
        limit = clip_factor * max(float(w[i].norm()), eps)
        if float(g[i].norm()) > limit:
            out[i] = g[i] * limit / float(g[i].norm())
    return out


@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 3, 3), (6,), (2, 3, 2, 2, 2)])
def test_agc_matches_the_direct_formula(shape):
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(shape, generator=gen))
    with torch.no_grad():
        w.view(-1)[:2] = 0.0  # zero weights: the eps floor matters
    grad = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[0]).view(
        -1, *([1] * (len(shape) - 1)))
    w.grad = grad.clone()
    count = normkit.adaptive_clip_grad_([w], clip_factor=0.05, eps=1e-3)
    expected = _direct_agc(w.detach(), grad, 0.05, 1e-3)
    torch.testing.assert_close(w.grad.double(), expected, atol=1e-6, rtol=1e-5)
    assert 0 < int(count) <= (shape[0] if len(shape) > 1 else shape[0])


def test_agc_is_layout_independent():
    w = torch.randn(8, 4, 3, 3)
    g = torch.randn(8, 4, 3, 3) * 10
    a = nn.Parameter(w.clone())
    a.grad = g.clone()
    b = nn.Parameter(w.clone().contiguous(memory_format=torch.channels_last))
    b.grad = g.clone().contiguous(memory_format=torch.channels_last)
    normkit.adaptive_clip_grad_(a), normkit.adaptive_clip_grad_(b)
    torch.testing.assert_close(a.grad, b.grad)
    assert b.grad.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(unitwise_norm(w), w.flatten(1).norm(dim=1).view(8, 1, 1, 1))


def test_agc_optimizer_wrapper_excludes_the_classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = normkit.AGC(torch.optim.SGD(net.parameters(), lr=0.0), clip_factor=1e-4,
                      exclude=["2"], model=net)
    (net(torch.randn(16, 4)) * 100).sum().backward()
    head = net[2].weight.grad.clone()
    body = net[0].weight.grad.clone()
    opt.step()
    torch.testing.assert_close(net[2].weight.grad, head)  # excluded: untouched
    assert (net[0].weight.grad.norm(dim=1) < body.norm(dim=1)).all()
    assert opt.param_groups is opt.optimizer.param_groups
    excluded_by_module = normkit.AGC(torch.optim.SGD(net.parameters(), lr=0.1),
                                     exclude=[net[2]])
    assert len(excluded_by_module._excluded) == 2
    with pytest.raises(ValueError, match="model="):
        normkit.AGC(torch.optim.SGD(net.parameters(), lr=0.1), exclude=["2"])
    with pytest.raises(ValueError, match="'fc'"):
        normkit.AGC(torch.optim.SGD(net.parameters(), lr=0.1), exclude=["fc"], model=net)
    with pytest.raises(ValueError, match="clip_factor"):
        normkit.adaptive_clip_grad_(net.parameters(), clip_factor=0)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_agc_copies_keep_their_exclusions(how):
    """A deep copy or a pickle round trip of the wrapper (and its model, in one object,
    as checkpointing a whole training state does) excludes the same layers: the
    exclusions were kept as ids of the original parameters, so a copy silently clipped
    the classifier it was told to leave alone."""
    import copy
    import pickle

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = normkit.AGC(torch.optim.SGD(net.parameters(), lr=0.0), clip_factor=1e-4,
                      exclude=["2"], model=net)
    net2, opt2 = (copy.deepcopy((net, opt)) if how == "deepcopy"
                  else pickle.loads(pickle.dumps((net, opt))))
    assert opt2.param_groups[0]["params"][2] is net2[2].weight
    (net2(torch.randn(16, 4)) * 100).sum().backward()
    head, body = net2[2].weight.grad.clone(), net2[0].weight.grad.clone()
    assert int(opt2.clip_()) > 0
    torch.testing.assert_close(net2[2].weight.grad, head)  # still excluded: untouched
    assert (net2[0].weight.grad.norm(dim=1) < body.norm(dim=1)).all()
    assert "excluded=2" in repr(opt2) and len(opt._excluded) == 2  # (the original kept)
    old = normkit.AGC.__new__(normkit.AGC)  # (a pickle that kept ids: nothing to map)
    with pytest.warns(RuntimeWarning, match="2 excluded parameters .* are lost"):
        old.__setstate__(dict(opt.__dict__))
    assert old._excluded == set()


@pytest.mark.parametrize("scheduler", ["StepLR", "OneCycleLR", "ReduceLROnPlateau",
                                       "SequentialLR"])
def test_agc_takes_lr_schedulers_grad_scaler_and_checkpoints(scheduler):
    """Wrapping the optimizer is how AGC is used, and the wrapper then goes where the
    optimizer went: torch's LR schedulers refused it ("AGC is not an Optimizer"). The
    schedule reaches the wrapped optimizer, GradScaler unscales before the clip, and a
    checkpoint of the wrapper is the wrapped optimizer's; no scheduler warning fires."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = normkit.AGC(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                      clip_factor=1e-3)
    lr_scheduler = torch.optim.lr_scheduler
    sched = {
        "StepLR": lambda: lr_scheduler.StepLR(opt, 1, gamma=0.5),
        "OneCycleLR": lambda: lr_scheduler.OneCycleLR(opt, 1.0, total_steps=10),
        "ReduceLROnPlateau": lambda: lr_scheduler.ReduceLROnPlateau(opt, patience=0),
        "SequentialLR": lambda: lr_scheduler.SequentialLR(
            opt, [lr_scheduler.LinearLR(opt, total_iters=2),
                  lr_scheduler.ExponentialLR(opt, 0.9)], [2]),
    }[scheduler]()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if TORCH_RELEASE < (2, 11):  # (2.4 and 2.8: SequentialLR warns about itself, AGC or not)
            warnings.filterwarnings("ignore", "The epoch parameter in `scheduler.step", UserWarning)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(torch.randn(16, 4)).float().square().mean()
            scaler.scale(loss).backward()
            grads = [p.grad.clone() / scaler.get_scale() for p in net.parameters()]
            scaler.step(opt)
            clipped = [p.grad for p in net.parameters()]
            scaler.update()
            opt.zero_grad()
            sched.step(1.0) if scheduler == "ReduceLROnPlateau" else sched.step()
            lrs.append(opt.optimizer.param_groups[0]["lr"])
    # unscaled before the clip: clipped relative to the weights, never grown
    assert all(float(c.norm()) <= float(g.norm()) * (1 + 1e-5)
               for c, g in zip(clipped, grads, strict=True))
    assert lrs[-1] != 0.1 and opt.param_groups[0]["lr"] == lrs[-1]
    twin = normkit.AGC(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    twin.load_state_dict(opt.state_dict())
    saved, loaded = opt.optimizer.state_dict(), twin.optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert all(torch.equal(loaded["state"][i]["momentum_buffer"], state["momentum_buffer"])
               for i, state in saved["state"].items()) and len(saved["state"]) == 4
    assert isinstance(opt, torch.optim.Optimizer)
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer to wrap, got list"):
        normkit.AGC([p for p in net.parameters()])


class _BatchNormAct(nn.BatchNorm2d):
    """A subclass of a torch norm defined outside torch, whose forward calls batch_norm
    itself (as timm's BatchNormAct2d does: it traces, into a function call)."""

    def forward(self, x):
        return torch.relu(torch.nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
            0.1, self.eps))


class _LayerNormEps(nn.LayerNorm):
    """A LayerNorm subclass with its own forward (as timm's LayerNorm)."""

    def forward(self, x):
        return super().forward(x)


def test_norm_subclasses_are_found_by_the_traced_searches():
    """torch.fx traces through modules defined outside torch, so a residual branch ending
    in a subclass of a torch norm (timm's ConvNormAct + BatchNormAct2d: regnetx_002's 13
    branch ends) ended in a batch_norm call the search did not see, and zero_init_residual
    zeroed nothing; a subclassed LayerNorm feeding a ReLU was missed the same way. Norm
    layers are leaves of the trace now."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), _BatchNormAct(4)
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), _BatchNormAct(4)

        def forward(self, x):
            return x + self.bn2(self.conv2(self.bn1(self.conv1(x))))

    net = nn.Sequential(Residual(), Residual())
    done = normkit.init_norms_(net, zero_init_residual=True)
    zeroed = sorted(name for name, what in done.items() if "weight=0" in what)
    assert zeroed == ["0.bn2", "1.bn2"]
    mlp = nn.Sequential(nn.Linear(4, 8), _LayerNormEps(8), nn.ReLU(), nn.Linear(8, 2))
    # (not a Sequential-adjacency guess: a module whose forward puts the ReLU elsewhere)
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp

        def forward(self, x):
            return self.body(x)

    assert normkit.init_norms_(Head(), bias_before_relu=0.1) == {
        "body.1": "weight=1.0, bias=0.1 (before ReLU)"}
