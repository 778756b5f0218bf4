"""``backend="auto"`` on a GPU never takes normkit's CPU-tuned paths.

Those paths keep torch's kernel output only after an accuracy check that reads a
statistic back to the host (``native.well_conditioned``: one ``.item()``), and the
channels engine is tuned for CPU caches. On a GPU that read is a device sync per call,
which stalls the queue of work: under ``"auto"``, an accelerator input takes the Triton
row kernels (LayerNorm/RMSNorm on CUDA) or torch's own kernel for the device.

The CPU test makes every CPU tensor look like an accelerator's to the dispatch
(``normkit.functional._off_cpu``) and forbids the sync-capable paths: each layer must
still run forward and backward, with torch's results. The CUDA test runs the same
layers on a GPU under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any
implicit sync (it runs where a GPU is: ``benchmarks/gpu_check.sh``).
"""

import copy
import pickle

import pytest
import torch

import normkit
import normkit.functional as NF
from normkit.kernels import channels, native


def _layers():
    """``{name: (normkit layer, torch equivalent or None, input shape, channels_last)}``."""
    return {
        "LayerNorm": (normkit.LayerNorm(12), torch.nn.LayerNorm(12), (4, 5, 12), False),
        "RMSNorm": (normkit.RMSNorm(12), torch.nn.RMSNorm(12), (4, 5, 12), False),
        "LayerNorm2d-nchw": (normkit.LayerNorm2d(6), None, (4, 6, 3, 5), False),
        "LayerNorm2d-nhwc": (normkit.LayerNorm2d(6), None, (4, 6, 3, 5), True),
        "InstanceNorm2d": (normkit.InstanceNorm2d(6, affine=True, track_running_stats=True),
                           torch.nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
                           (4, 6, 3, 5), False),
        "InstanceNorm2d-eval": (
            normkit.InstanceNorm2d(6, affine=True, track_running_stats=True).eval(),
            torch.nn.InstanceNorm2d(6, affine=True, track_running_stats=True).eval(),
            (4, 6, 3, 5), True),
        "BatchNorm2d": (normkit.BatchNorm2d(6), torch.nn.BatchNorm2d(6), (4, 6, 3, 5), True),
        "BatchNorm2d-biased": (normkit.BatchNorm2d(6, unbiased_running_var=False), None,
                               (4, 6, 3, 5), False),
        "BatchNorm2d-eval": (normkit.BatchNorm2d(6).eval(), torch.nn.BatchNorm2d(6).eval(),
                             (4, 6, 3, 5), False),
        "GroupNorm": (normkit.GroupNorm(3, 6), torch.nn.GroupNorm(3, 6), (4, 6, 3, 5), True),
        "BatchNormAct2d": (normkit.BatchNormAct2d(6, act="relu"),
                           torch.nn.Sequential(torch.nn.BatchNorm2d(6), torch.nn.ReLU()),
                           (4, 6, 3, 5), False),
        "GroupNormAct": (normkit.GroupNormAct(3, 6, act="silu"),
                         torch.nn.Sequential(torch.nn.GroupNorm(3, 6), torch.nn.SiLU()),
                         (4, 6, 3, 5), False),
        "AddLayerNorm": (normkit.AddLayerNorm(12), None, (4, 5, 12), False),
        "AddRMSNorm": (normkit.AddRMSNorm(12), None, (4, 5, 12), False),
        "FrozenBatchNorm2d": (normkit.FrozenBatchNorm2d(6), None, (4, 6, 3, 5), False),
        "BatchRenorm2d": (normkit.BatchRenorm2d(6), None, (4, 6, 3, 5), False),
        "BatchRenorm2d-renorm": (normkit.BatchRenorm2d(6, warmup_steps=0, r_max=1.5,
                                                       d_max=0.5, r_max_steps=2,
                                                       d_max_steps=2), None,
                                 (4, 6, 3, 5), True),
        "MeanOnlyBatchNorm2d": (normkit.MeanOnlyBatchNorm2d(6), None, (4, 6, 3, 5), False),
        "BatchNorm1d": (normkit.BatchNorm1d(12), torch.nn.BatchNorm1d(12), (8, 12), False),
        "InstanceNorm1d": (normkit.InstanceNorm1d(5), torch.nn.InstanceNorm1d(5), (4, 5, 12),
                           False),
    }


def _run(layer, x):
    """Forward (an add op gets ``x`` as the residual too) and backward."""
    out = layer(x, x * 0.5) if isinstance(layer, (normkit.AddLayerNorm, normkit.AddRMSNorm)) \
        else layer(x)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(torch.ones_like(y))
    return out


def _input(shape, channels_last, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device) * 2.0 + 3.0
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """Every tensor looks like an accelerator's to the dispatch; the CPU-tuned paths
    that could sync raise if reached."""
    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} reached on an accelerator input under 'auto'")
        return call

    monkeypatch.setattr(NF, "_off_cpu", lambda x: True)
    monkeypatch.setattr(native, "well_conditioned", forbidden("native.well_conditioned"))
    monkeypatch.setattr(native, "ratio_within", forbidden("native.ratio_within"))
    monkeypatch.setattr(native, "batch_norm_eval", forbidden("native.batch_norm_eval"))
    monkeypatch.setattr(channels, "well_conditioned", forbidden("channels.well_conditioned"))
    monkeypatch.setattr(channels, "normalize", forbidden("channels.normalize"))
    monkeypatch.setattr(channels, "moments", forbidden("channels.moments"))


@pytest.mark.parametrize("name", list(_layers()))
def test_accelerator_inputs_take_torch_or_triton_kernels(name, as_on_a_gpu):
    """Forward and backward run without the forbidden paths; where torch has the same
    layer, output, input gradient and running statistics equal torch's."""
    layer, twin, shape, channels_last = _layers()[name]
    norm = twin[0] if isinstance(twin, torch.nn.Sequential) else twin  # (norm, then act)
    if twin is not None:
        norm.load_state_dict(layer.state_dict())  # (the same start)
    x = _input(shape, channels_last)
    out = _run(layer, x)
    y = out[0] if isinstance(out, tuple) else out
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if name == "LayerNorm2d-nhwc":
        assert y.is_contiguous(memory_format=torch.channels_last)
    if name == "LayerNorm2d-nchw":
        assert y.is_contiguous()
    if name.startswith("LayerNorm2d"):  # LayerNorm over the channels, as timm computes it
        want = torch.nn.functional.layer_norm(x.detach().permute(0, 2, 3, 1), (shape[1],),
                                              layer.weight, layer.bias, layer.eps)
        torch.testing.assert_close(y, want.permute(0, 3, 1, 2))
    if name.startswith("Add"):  # (normed, x + residual) of the residual 0.5 x
        s = x.detach() * 1.5
        want = (torch.nn.functional.layer_norm(s, (12,), layer.weight, layer.bias, layer.eps)
                if name == "AddLayerNorm" else
                torch.nn.functional.rms_norm(s, (12,), layer.weight, layer.eps))
        torch.testing.assert_close(out[0], want)
        torch.testing.assert_close(out[1], s)
    if twin is None:
        return
    x_twin = _input(shape, channels_last)
    torch.testing.assert_close(y, _run(twin, x_twin))
    torch.testing.assert_close(x.grad, x_twin.grad)
    for key, value in norm.state_dict().items():
        if "running" in key:
            torch.testing.assert_close(layer.state_dict()[key], value)


def test_biased_running_variance_on_an_accelerator(as_on_a_gpu):
    """unbiased_running_var=False on a GPU: torch's kernel normalizes, the running
    variance receives the biased batch variance (from its inverse std), as on the CPU."""
    layer = normkit.BatchNorm2d(6, unbiased_running_var=False, momentum=1.0)
    x = _input((4, 6, 3, 5), False)
    y = layer(x)
    want = torch.nn.functional.batch_norm(x.detach(), None, None, training=True)
    torch.testing.assert_close(y, want)
    dims = (0, 2, 3)
    torch.testing.assert_close(layer.running_mean, x.detach().mean(dims))
    torch.testing.assert_close(layer.running_var, x.detach().var(dims, unbiased=False),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(_layers()))
def test_no_device_sync_under_auto_on_cuda(name):
    """On a GPU, forward and backward of every layer under "auto" never sync."""
    layer, _, shape, channels_last = _layers()[name]
    layer = layer.cuda()
    x = _input(shape, channels_last, device="cuda")
    _run(layer, x)  # (first call: Triton compiles, allocator warms up)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(layer, x)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm", "AddRMSNorm", "BatchNorm2d"])
def test_a_training_step_captures_in_a_cuda_graph(name):
    """CUDA graphs remove the host cost of the launches: a forward+backward of the
    layer (the Triton row kernels for LayerNorm/RMSNorm under "auto") captured once and
    replayed gives eager mode's output and gradients."""
    layer, _, shape, channels_last = _layers()[name]
    layer = layer.cuda()
    static_x = _input(shape, channels_last, device="cuda")

    def step():
        out = layer(static_x, static_x * 0.5) if name.startswith("Add") else layer(static_x)
        y = out[0] if isinstance(out, tuple) else out
        y.backward(torch.ones_like(y))
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up: Triton compiles, the allocator settles)
        for _ in range(3):
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    torch.manual_seed(1)
    fresh = torch.randn(shape, device="cuda") * 2.0 + 3.0
    static_x.data.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    eager_x = fresh.clone().requires_grad_()
    if channels_last:
        eager_x = fresh.contiguous(memory_format=torch.channels_last).requires_grad_()
    out = layer(eager_x, eager_x * 0.5) if name.startswith("Add") else layer(eager_x)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(static_y, y)
    torch.testing.assert_close(static_x.grad, eager_x.grad)


def test_batch_renorm_reads_its_step_count_once(as_on_a_gpu, monkeypatch):
    """BatchRenorm's clipping limits follow num_batches_tracked; on a GPU reading it is a
    device sync, so the count is read once and then followed on the host: later steps
    never read the buffer, until a write the module did not make (load_state_dict)."""
    torch.manual_seed(0)
    layer = normkit.BatchRenorm2d(6, warmup_steps=1, r_max=2.0, d_max=1.0, r_max_steps=4,
                                  d_max_steps=4, momentum=0.5)
    layer.running_mean.fill_(0.5)
    twin = normkit.BatchRenorm2d(6, warmup_steps=1, r_max=2.0, d_max=1.0, r_max_steps=4,
                                 d_max_steps=4, momentum=0.5, backend="reference")
    twin.load_state_dict(layer.state_dict())
    xs = [torch.randn(4, 6, 3, 5) * 2.0 + 1.0 for _ in range(6)]
    layer(xs[0])  # (reads the count: 0)
    twin(xs[0])

    def forbidden(*args):
        raise AssertionError("num_batches_tracked read back, or the compensated path")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "__int__", forbidden)
        m.setattr(torch.Tensor, "item", forbidden)
        m.setattr(layer, "_normalized", forbidden)  # (torch's kernels, not the CPU's core)
        for x in xs[1:5]:  # (the warm-up, the ramp, the final limits)
            y = layer(x)
            torch.testing.assert_close(y, twin(x), rtol=1e-5, atol=1e-5)
    assert int(layer.num_batches_tracked) == 5
    assert "_step_seen" in layer.__dict__
    copied = copy.deepcopy(layer)  # (a copy reads its own buffer: nothing carried over)
    assert "_step_seen" not in copied.__dict__
    assert "_step_seen" not in pickle.loads(pickle.dumps(layer)).__dict__
    assert copied.current_limits() == layer.current_limits()
    state = twin.state_dict()
    state["num_batches_tracked"].fill_(0)  # back into the warm-up: r = 1, d = 0
    layer.load_state_dict(state)
    assert layer.current_limits() == (1.0, 0.0)
    torch.testing.assert_close(layer(xs[5]),
                               torch.nn.functional.batch_norm(xs[5], None, None,
                                                              layer.weight, layer.bias,
                                                              training=True))


def test_batch_renorm_reads_a_cpu_step_count_every_time():
    """On the CPU reading the step count costs no sync: it is read at every step, and
    nothing is kept beside the buffer (a write through ``.data`` is seen there too)."""
    layer = normkit.BatchRenorm2d(3, warmup_steps=1, r_max_steps=3, d_max_steps=3)
    x = torch.randn(4, 3, 2, 2)
    layer(x)
    layer(x)
    assert "_step_seen" not in layer.__dict__
    layer.num_batches_tracked.data.fill_(0)  # (no version bump)
    assert layer.current_limits() == (1.0, 0.0)
