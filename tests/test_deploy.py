"""normkit's layers on the ways torch hands a model to deployment and to graph tools:
``torch.jit.trace``, ``torch.export``, ``torch.jit.script`` and ``torch.fx.symbolic_trace``.

A trace records the operators one call ran and replays them for any input. normkit's
eager fast paths choose a kernel by the data (an accuracy check on the statistics), so a
trace of them would freeze the traced input's choice -- torch's kernel replayed on data
at an offset, where it loses precision -- and their checks failed the tracer's sanity
check outright (BatchNorm in eval, GroupNorm, InstanceNorm, the fused norm + activation
layers). Under ``torch.jit.trace`` and ``torch.export`` normkit records its reference
math: ATen operators only, accurate at any offset, portable to wherever the graph runs
(inference BatchNorm records torch's ``batch_norm``, the same formula, which ONNX and
conv + BN folding recognize).
TorchScript cannot compile normkit's Python: ``torch.jit.script`` fails at once, saying
what works instead, and leaves the model as it was. ``torch.fx.symbolic_trace`` keeps each
normkit layer one ``call_module`` node, as it keeps torch.nn's norms (it used to trace
into normkit's forwards and fail on their first check of the input).
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from oracle import TOL, assert_close, assert_grad_close, reference_forward

import normkit

#: name -> (module factory, input shape(s)); every public layer class at least once.
LAYERS = {
    "BatchNorm1d": (lambda: normkit.BatchNorm1d(4), (6, 4, 5)),
    "BatchNorm2d": (lambda: normkit.BatchNorm2d(4), (3, 4, 5, 5)),
    "BatchNorm3d": (lambda: normkit.BatchNorm3d(4), (2, 4, 3, 3, 3)),
    "BatchNorm2d biased running_var": (
        lambda: normkit.BatchNorm2d(4, unbiased_running_var=False), (3, 4, 5, 5)),
    "LayerNorm": (lambda: normkit.LayerNorm(16), (6, 16)),
    "RMSNorm": (lambda: normkit.RMSNorm(16), (6, 16)),
    "LayerNorm2d": (lambda: normkit.LayerNorm2d(4), (3, 4, 5, 5)),
    "GroupNorm": (lambda: normkit.GroupNorm(2, 4), (3, 4, 5, 5)),
    "InstanceNorm2d": (lambda: normkit.InstanceNorm2d(4, affine=True, track_running_stats=True),
                       (3, 4, 5, 5)),
    "FrozenBatchNorm2d": (lambda: normkit.FrozenBatchNorm2d(4), (3, 4, 5, 5)),
    "BatchRenorm2d": (lambda: normkit.BatchRenorm2d(4), (3, 4, 5, 5)),
    "MeanOnlyBatchNorm2d": (lambda: normkit.MeanOnlyBatchNorm2d(4), (3, 4, 5, 5)),
    "BatchNormAct2d": (lambda: normkit.BatchNormAct2d(4, act="silu"), (3, 4, 5, 5)),
    "BatchNormAct2d inplace": (
        lambda: normkit.BatchNormAct2d(4, act="leaky_relu", memory="inplace"), (3, 4, 5, 5)),
    "GroupNormAct": (lambda: normkit.GroupNormAct(2, 4, act="silu"), (3, 4, 5, 5)),
    "AddLayerNorm": (lambda: normkit.AddLayerNorm(16), ((6, 16), (6, 16))),
    "AddRMSNorm": (lambda: normkit.AddRMSNorm(16), ((6, 16), (6, 16))),
    "LayerNormLSTMCell": (lambda: normkit.LayerNormLSTMCell(16, 8), (6, 16)),
    "LayerNormLSTM": (lambda: normkit.LayerNormLSTM(16, 8), (5, 3, 16)),
    "PowerNorm": (lambda: normkit.PowerNorm(16, warmup_iters=1, group_num=4), (5, 3, 16)),
    "AdaptiveLayerNorm": (lambda: normkit.AdaptiveLayerNorm(16, 6, zero_init=False),
                          ((5, 3, 16), (5, 6))),
    "AdaptiveGroupNorm": (lambda: normkit.AdaptiveGroupNorm(2, 4, 6, zero_init=False),
                          ((3, 4, 5, 5), (3, 6))),
}
#: The layers ``oracle.reference_forward`` knows: checked against float64 too.
ORACLE = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "RMSNorm", "LayerNorm2d",
          "GroupNorm", "InstanceNorm2d"}


def _module(name):
    gen = torch.Generator().manual_seed(1)
    module = LAYERS[name][0]()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return module


def _inputs(name, seed, offset):
    shape = LAYERS[name][1]
    gen = torch.Generator().manual_seed(seed)
    shapes = shape if isinstance(shape[0], tuple) else (shape,)
    # (an adaptive layer's condition is not normalized: offset, its scale and shift
    # would be ~1e4 and the output a float32 cancellation of them)
    offsets = [offset] + [0.0 if name.startswith("Adaptive") else offset] * (len(shapes) - 1)
    return tuple((torch.randn(s, generator=gen, dtype=torch.float64) * 2 + o).float()
                 for s, o in zip(shapes, offsets, strict=True))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _trace(module, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch 2.13 deprecates tracing; shape warnings)
        return torch.jit.trace(module, args)  # check_trace: traced twice, graphs compared


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_traced_layer_replays_normkit_math_on_any_input(name, training):
    """Traced on centred data, replayed on data at an offset of 1e4 (torch's kernels are
    off by ~1e-3 there): the output, every gradient and the running statistics equal the
    eager layer's, and the float64 oracle's, within the float32 tolerances."""
    eager = _module(name).train(training)
    traced_module = copy.deepcopy(eager)
    traced = _trace(traced_module, _inputs(name, 0, 0.0))
    traced_module.load_state_dict(eager.state_dict())  # (tracing ran it: undo its updates)
    offset = 0.0 if name.startswith("LayerNormLSTM") else 1e4  # (an LSTM's gates saturate)
    args = _inputs(name, 1, offset)
    eager_args = tuple(a.clone().requires_grad_() for a in args)
    traced_args = tuple(a.clone().requires_grad_() for a in args)
    y_eager, y_traced = _first(eager(*eager_args)), _first(traced(*traced_args))
    assert_close(y_traced, y_eager, torch.float32)
    if name in ORACLE:
        assert_close(y_traced, reference_forward(eager, args[0].double()), torch.float32)
    dy = torch.randn_like(y_eager)
    y_eager.backward(dy)
    y_traced.backward(dy)
    for a, b in zip(eager_args, traced_args, strict=True):
        assert_grad_close(b.grad, a.grad, torch.float32, "input grad")
    for (pname, a), b in zip(eager.named_parameters(), traced_module.parameters(), strict=True):
        assert_grad_close(b.grad, a.grad, torch.float32, pname)
    for (bname, a), b in zip(eager.named_buffers(), traced_module.buffers(), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, msg=bname, **TOL[torch.float32])
        else:
            assert torch.equal(b, a), bname


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_compile_is_not_taken_for_export(strict):
    """Dynamo up to torch 2.11 at least folds a call of ``torch.compiler.is_exporting()``
    to True in any torch.compile trace, so compiled models took export's paths (the
    reference math, not the registered operators) until normkit read the flag itself;
    torch 2.4-2.7 trace a strict export (their default) before raising it, and 2.4-2.6
    have no exporting flag at all, so there the export took torch.compile's paths (its
    program held normkit's operators) until normkit read Dynamo's own record."""
    from normkit.norms._core import _exporting, in_graph

    class Probe(torch.nn.Module):
        def forward(self, x):
            return torch.stack([x.sum() * 0 + float(_exporting()),
                                x.sum() * 0 + float(in_graph())])

    x = torch.ones(3)
    assert Probe()(x).tolist() == [0.0, 0.0]
    torch._dynamo.reset()
    assert torch.compile(Probe(), fullgraph=True, backend="eager")(x).tolist() == [0.0, 1.0]
    program = torch.export.export(Probe(), (x,), strict=strict)
    assert program.module()(x).tolist() == [1.0, 0.0]


#: torch.export cases: the layers whose eager paths are registered operators under
#: torch.compile (LayerNorm, GroupNorm, training BatchNorm, the add-norm and the
#: channels-last LayerNorm2d through LayerNorm's), and two that never were.
EXPORTS = ["LayerNorm", "GroupNorm", "BatchNorm2d", "AddLayerNorm", "LayerNorm2d channels_last",
           "GroupNormAct", "RMSNorm"]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", EXPORTS)
def test_exported_program_holds_only_aten_operators(case, training, strict):
    """An exported program runs where normkit's Python operators do not exist
    (AOTInductor, ExecuTorch, ONNX, a process without normkit): it records ATen only,
    and computes what the eager layer does, at an offset too -- strict export (Dynamo's
    trace, torch's default up to 2.7) and non-strict alike."""
    name = case.removesuffix(" channels_last")
    eager = _module(name).train(training)
    exported_module = copy.deepcopy(eager)
    args = _inputs(name, 0, 0.0)
    if case.endswith("channels_last"):
        args = tuple(a.contiguous(memory_format=torch.channels_last) for a in args)
    program = torch.export.export(exported_module, args, strict=strict)
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    foreign = sorted(str(t) for t in targets
                     if isinstance(t, torch._ops.OpOverload) and t.namespace != "aten")
    assert not foreign, f"non-ATen operators in the exported graph: {foreign}"
    assert any(isinstance(t, torch._ops.OpOverload) for t in targets)
    new = tuple(a + 1e4 for a in _inputs(name, 1, 0.0))
    assert_close(_first(program.module()(*new)), _first(eager(*new)), torch.float32)


@pytest.mark.parametrize("step", [0, 3, 7, 50], ids=lambda s: f"step{s}")
def test_exported_batch_renorm_reads_its_step_count_in_the_graph(step):
    """A training graph of Batch Renormalization (PT2E quantization-aware training exports
    one): the clipping limits follow the step count in the graph -- in the warm-up (step
    0), on both ramps (3), past the r ramp (7) and past both (50) -- so one program
    computes, step after step, what the eager layer does: output, gradients, running
    statistics and step count. (torch.export cannot read the step count, which the eager
    layer does to set the limits.)"""
    torch.manual_seed(0)
    eager = normkit.BatchRenorm2d(4, warmup_steps=2, r_max_steps=6, d_max_steps=10)
    with torch.no_grad():
        eager.running_mean.normal_()
        eager.running_var.uniform_(0.3, 3.0)
        eager.weight.uniform_(0.5, 1.5)
        eager.num_batches_tracked.fill_(step)
    exported = copy.deepcopy(eager)
    program = torch.export.export(copy.deepcopy(eager), _inputs("BatchRenorm2d", 0, 0.0))
    module = program.module()
    module.load_state_dict(exported.state_dict())
    for k in range(3):  # (the same program at steps step, step + 1, step + 2)
        x = _inputs("BatchRenorm2d", 10 + k, 1.0)[0] * 2
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(xa), module(xb)
        assert_close(yb, ya, torch.float32, f"output at step {step + k}")
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        assert_grad_close(xb.grad, xa.grad, torch.float32, f"input grad at step {step + k}")
    # (by name: a strict export on torch 2.7 lists the buffers in another order)
    buffers, parameters = dict(module.named_buffers()), dict(module.named_parameters())
    assert buffers.keys() == dict(eager.named_buffers()).keys()
    assert parameters.keys() == dict(eager.named_parameters()).keys()
    for name, a in eager.named_buffers():
        torch.testing.assert_close(buffers[name], a, msg=name, **TOL[torch.float32])
    for name, a in eager.named_parameters():
        assert_grad_close(parameters[name].grad, a.grad, torch.float32, name)


#: The layers whose eval forward is inference BatchNorm's formula on running statistics.
RUNNING = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "BatchNorm2d biased running_var",
           "FrozenBatchNorm2d", "BatchRenorm2d", "BatchNormAct2d", "BatchNormAct2d inplace",
           "InstanceNorm2d", "SyncBatchNorm"]


@functools.cache
def _torch_batch_norm_export() -> str:
    """The operator torch.export records for torch's own inference BatchNorm:
    ``aten.batch_norm.default`` (torch 2.4 lowers it to
    ``aten._native_batch_norm_legit_no_training.default``)."""
    program = torch.export.export(torch.nn.BatchNorm2d(2).eval(), (torch.randn(2, 2, 3, 3),))
    (target,) = {str(n.target) for n in program.graph.nodes
                 if n.op == "call_function" and "batch_norm" in str(n.target)}
    return target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", RUNNING)
def test_inference_batch_norm_is_recorded_as_torchs_batch_norm(name, dtype):
    """Exported and traced in eval, a layer normalizing by running statistics is one
    ``aten.batch_norm`` -- what ONNX's BatchNormalization, conv + BN folding and PT2E
    quantization recognize, where the formula would be anonymous elementwise operators
    -- and the recorded program computes what the eager layer does, at an offset too."""
    if name == "SyncBatchNorm":
        eager, shape = normkit.SyncBatchNorm(4), (3, 4, 5, 5)
    else:
        eager, shape = _module(name), LAYERS[name][1]
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        eager.running_mean.copy_(torch.randn(4, generator=gen) * 3)
        eager.running_var.copy_(torch.rand(4, generator=gen) * 4 + 0.1)
    eager = eager.eval().to(dtype)
    x = (torch.randn(shape, generator=gen) * 2 + 1).to(dtype)
    program = torch.export.export(copy.deepcopy(eager), (x,))
    exported = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    traced = _trace(copy.deepcopy(eager), (x,))
    recorded = {n.kind() for n in traced.inlined_graph.nodes()}
    assert _torch_batch_norm_export() in exported and "aten::batch_norm" in recorded
    for op in ("sub", "rsqrt", "addcmul"):
        assert f"aten.{op}.Tensor" not in exported and f"aten.{op}.default" not in exported
        assert f"aten::{op}" not in recorded
    shifted = x.float().add(1e3).to(dtype)
    for run in (program.module(), traced):
        assert_close(run(shifted), eager(shifted), dtype)


@pytest.mark.parametrize("name", ["LayerNorm", "BatchNorm2d", "GroupNorm", "LayerNorm2d",
                                  "AddLayerNorm", "BatchNormAct2d", "InstanceNorm2d"])
def test_exported_program_takes_any_batch_size(name):
    """A dynamic batch dimension: the reference math has no size baked in."""
    eager = _module(name).eval()
    args = _inputs(name, 0, 0.0)
    batch = torch.export.Dim("batch", min=2, max=64)
    program = torch.export.export(copy.deepcopy(eager), args,
                                  dynamic_shapes=tuple({0: batch} for _ in args))
    larger = tuple(torch.cat([a, a[:2] * 2 + 1e3]) for a in args)
    assert_close(_first(program.module()(*larger)), _first(eager(*larger)), torch.float32)


def test_compile_keeps_the_registered_operators():
    """(The converse: torch.compile, which runs in this process, keeps normkit's operators,
    the eager paths' speed.)"""
    from compile_recorder import recording_backend

    torch._dynamo.reset()
    backend, seen = recording_backend()
    torch.compile(normkit.LayerNorm(16), fullgraph=True, backend=backend)(torch.randn(6, 16))
    assert any(target.startswith("normkit.layer_norm") for target in seen), seen


def _model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), normkit.BatchNorm2d(4), torch.nn.ReLU(),
        normkit.GroupNorm(2, 4), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 8),
        normkit.LayerNorm(8), normkit.RMSNorm(8))


#: Layers beyond LAYERS that a model may hold: (the class named in the error, factory).
OTHERS = {
    "weight_norm": ("WeightNorm", lambda: normkit.weight_norm(torch.nn.Linear(3, 2))),
    "Standardizer": ("Standardizer", lambda: normkit.Standardizer().fit(torch.randn(9, 3))),
    "StandardizedModel": ("StandardizedModel", lambda: normkit.StandardizedModel(
        torch.nn.Linear(3, 1), x=True).fit_scalers(torch.randn(9, 3))),
    "SyncBatchNorm": ("SyncBatchNorm", lambda: normkit.SyncBatchNorm(4)),
    "FrozenBatchNorm": ("FrozenBatchNorm", lambda: normkit.FrozenBatchNorm(4)),
}


@pytest.mark.parametrize("name", list(LAYERS) + list(OTHERS))
def test_script_fails_at_once_and_says_what_works(name):
    """Not deep inside TorchScript's compiler: at the layer, naming it and the ways that
    work (``normkit.unpatch`` only where it gives a scriptable torch.nn layer)."""
    shown, make = OTHERS[name] if name in OTHERS else (name.split()[0], lambda: _module(name))
    with pytest.raises(RuntimeError, match=rf"cannot compile normkit\.{shown}:.*"
                                           r"torch\.jit\.trace.*torch\.export\.export") as error:
        torch.jit.script(make())
    drop_in = shown in {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "RMSNorm",
                        "GroupNorm", "InstanceNorm2d"}
    assert ("normkit.unpatch(model)" in str(error.value)) == drop_in


def test_script_leaves_the_model_alone_and_scripts_after_unpatch():
    model = _model().eval()
    before = [type(m) for m in model.modules()]
    with pytest.raises(RuntimeError, match=r"normkit\.BatchNorm2d.*normkit\.unpatch\(model\)"):
        torch.jit.script(model)
    assert [type(m) for m in model.modules()] == before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(normkit.unpatch(model))
    x = torch.randn(2, 3, 6, 6)
    assert_close(scripted(x), model(x), torch.float32)
    assert sorted(scripted.state_dict()) == sorted(model.state_dict())


class _Holder(torch.nn.Module):
    """A model around one layer (FX never makes the root a leaf)."""

    def __init__(self, norm):
        super().__init__()
        self.pre = torch.nn.Identity()
        self.norm = norm

    def forward(self, x):
        return self.norm(self.pre(x))


class _Holder2(_Holder):
    def forward(self, x, residual):
        return self.norm(self.pre(x), residual)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_fx_keeps_each_layer_one_call_module_node(name, training):
    """The graph calls the layer itself: the same outputs and running statistics as
    eager mode, with normkit's own paths."""
    args = _inputs(name, 1, 3.0)
    holder = _Holder if len(args) == 1 else _Holder2
    eager = holder(_module(name).train(training))
    graph_module = torch.fx.symbolic_trace(holder(copy.deepcopy(eager.norm)))
    calls = [n.target for n in graph_module.graph.nodes if n.op == "call_module"]
    assert calls == ["pre", "norm"]
    assert type(graph_module.norm) is type(eager.norm)
    y_graph, y_eager = graph_module(*args), eager(*args)
    for a, b in zip(torch.utils._pytree.tree_leaves(y_graph),
                    torch.utils._pytree.tree_leaves(y_eager), strict=True):
        assert torch.equal(a, b)
    for (bname, a), b in zip(eager.named_buffers(), graph_module.buffers(), strict=True):
        assert torch.equal(b, a), bname


def test_fx_standardizer_is_one_node_and_a_root_layer_says_why_it_cannot_be_traced():
    x = torch.randn(9, 3)
    model = torch.nn.Sequential(normkit.Standardizer().fit(x), torch.nn.Linear(3, 2))
    graph_module = torch.fx.symbolic_trace(model)
    assert [n.op for n in graph_module.graph.nodes].count("call_module") == 2
    assert torch.equal(graph_module(x), model(x))
    with pytest.raises(RuntimeError, match=r"cannot trace into normkit\.LayerNorm.*trace the "
                                           r"model that holds it"):
        torch.fx.symbolic_trace(normkit.LayerNorm(8))


def test_fx_graph_mode_quantization_runs_around_normkit_layers():
    """FX graph-mode quantization (``prepare_fx``/``convert_fx``) traces the model: the
    convolutions are quantized, normkit's layers stay float32 nodes between them."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), normkit.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3), normkit.GroupNorm(2, 8)).eval()
    x = torch.randn(4, 3, 10, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(model, get_default_qconfig_mapping(), (x,))
        prepared(x)
        quantized = convert_fx(prepared)
    kinds = {type(m).__module__.split(".")[0] for m in quantized.modules()}
    assert "normkit" in kinds
    assert any("quantized" in type(m).__module__ for m in quantized.modules())
    reference = model(x)
    err = float((quantized(x) - reference).abs().max())
    assert err < 0.1 * float(reference.abs().max()), err  # int8 rounding, not a wrong graph


def test_quantization_fusions_after_unpatch():
    """Quantization's fusions name torch's classes: eager ``fuse_modules`` refuses a
    normkit BatchNorm, and fuses conv + BN + ReLU of the unpatched copy (README)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), normkit.BatchNorm2d(8),
                                torch.nn.ReLU())
    x = torch.randn(4, 3, 10, 10)
    model(x)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AssertionError, match="did not find fuser method"):
            torch.ao.quantization.fuse_modules(model, [["0", "1", "2"]])
        fused = torch.ao.quantization.fuse_modules(normkit.unpatch(model),
                                                   [["0", "1", "2"]])
    assert type(fused[0]).__name__ == "ConvReLU2d", fused
    torch.testing.assert_close(fused(x), model(x), **TOL[torch.float32])
