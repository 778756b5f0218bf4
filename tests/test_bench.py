"""Tests of the benchmark harness (normkit.bench): plumbing, schema, formulas, CLI errors.

Benchmarks are not tests: nothing here asserts a time or a ratio's value. Runs use
tiny shapes, two rounds, no minimum measurement time and a 1 MiB copy buffer.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import background
import pytest
import torch
from torch import nn

import normkit
from normkit.bench import cli, measure, report, runner
from normkit.bench.ops import (
    EXTERNALS,
    OPS,
    PASSES,
    AddThenNorm,
    External,
    Shape,
    get_op,
    op_names,
    parse_shapes,
)
from normkit.bench.runner import SCHEMA, BenchConfig, errors, make_input, plan, run
from normkit.kernels import memory

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = dict(repeats=2, warmup=1, min_time=0.0, copy_mib=1)
CORE = [op.name for op in OPS if not op.fused]
FUSED = [op.name for op in OPS if op.fused]
DIMS = {"rows": (6, 16), "image": (3, 8, 4, 5)}

ENVIRONMENT_KEYS = {
    "date", "normkit", "normkit_commit", "torch", "python", "platform", "cpu_model",
    "cpu_count", "device", "device_name", "dtype", "param_dtype", "threads", "input",
    "input_doc",
    "copy_bandwidth_gbs",
    "copy_buffer_bytes", "memory_method", "load_average", "allocator",
}
RECORD_KEYS = {"op", "shape", "layout", "pass", "threads", "ideal_bytes", "baseline", "normkit",
               "impls"}
ENTRY_KEYS = {"ms", "samples_ms", "number", "ratio", "ratio_iqr", "gbs", "pct_copy",
              "compile_s", "memory", "error"}


@pytest.fixture(scope="module")
def doc():
    config = BenchConfig(ops=("layer_norm", "batch_norm"), shapes="8x16,2x4x3x3:cl", **TINY)
    return run(config, command="normkit bench layer_norm batch_norm --shapes 8x16,2x4x3x3:cl")


# --- the JSON document ---------------------------------------------------------------


def test_json_schema(doc):
    assert json.loads(report.to_json(doc)) == doc  # plain JSON data, nothing lost
    assert set(doc) == {"schema", "command", "environment", "settings", "implementations",
                        "ops", "skipped", "results"}
    assert doc["schema"] == SCHEMA
    assert doc["command"].startswith("normkit bench layer_norm")
    env = doc["environment"]
    assert set(env) == ENVIRONMENT_KEYS
    assert (env["device"], env["dtype"], env["param_dtype"], env["threads"], env["input"]) == (
        "cpu", "float32", "float32", [1], "randn")
    assert env["torch"] == torch.__version__ and env["normkit"] == normkit.__version__
    assert list(env["copy_bandwidth_gbs"]) == ["1"] and env["copy_bandwidth_gbs"]["1"] > 0
    assert set(env["load_average"]) == {"start", "end"}
    assert env["allocator"]["normkit_huge_pages"] is memory.huge_pages_available()
    assert env["allocator"]["page_reporting_order"] == runner.page_reporting_order()
    assert "allocator: transparent huge pages" in report.to_markdown(doc)
    assert doc["settings"]["shape_list"] == ["8x16", "2x4x3x3:cl"]
    assert doc["settings"]["repeats"] == 2
    assert [(o["op"], o["available"]) for o in doc["ops"]] == [
        ("layer_norm", True), ("batch_norm", True)]
    assert set(doc["implementations"]) == {"torch", "normkit", "torch.compile",
                                           "normkit.compile", "liger", "apex"}
    for name in ("torch.compile", "normkit.compile"):
        assert doc["implementations"][name] == {
            "used": False, "reason": "not requested (--compile)"}


def test_page_reporting_order_is_read_and_reported(doc, tmp_path, monkeypatch):
    setting = tmp_path / "page_reporting_order"
    monkeypatch.setattr(runner, "_PAGE_REPORTING_ORDER", str(setting))
    assert runner.page_reporting_order() is None  # no balloon driver reporting
    setting.write_text("9\n")
    assert runner.page_reporting_order() == 9
    assert runner.allocator()["page_reporting_order"] == 9
    env = dict(doc["environment"], allocator=dict(doc["environment"]["allocator"]))
    env["allocator"]["page_reporting_order"] = 9
    line = report.to_markdown(dict(doc, environment=env))
    assert ("free page reporting to the hypervisor from 2048 KiB blocks (order 9: freed "
            "huge pages are backed afresh by the host)") in line
    env["allocator"]["page_reporting_order"] = 11
    assert "from 8192 KiB blocks (order 11)" in report.to_markdown(dict(doc, environment=env))
    del env["allocator"]["page_reporting_order"]  # a run saved before it was recorded
    assert "free page reporting" not in report.to_markdown(dict(doc, environment=env))


def test_results_cover_every_case_and_pass(doc):
    keys = [(r["op"], tuple(r["shape"]), r["layout"], r["pass"]) for r in doc["results"]]
    assert keys == [
        ("layer_norm", (8, 16), "contiguous", "fwd"),
        ("layer_norm", (8, 16), "contiguous", "fwd+bwd"),
        ("batch_norm", (2, 4, 3, 3), "channels_last", "fwd"),
        ("batch_norm", (2, 4, 3, 3), "channels_last", "fwd+bwd"),
    ]
    assert errors(doc) == []
    for record in doc["results"]:
        assert set(record) == RECORD_KEYS
        assert record["threads"] == 1 and record["baseline"].startswith("torch.nn.")
        assert list(record["impls"]) == ["torch", "normkit"]
        for name, entry in record["impls"].items():
            assert set(entry) == ENTRY_KEYS, name
            assert entry["error"] is None and entry["compile_s"] is None
            assert len(entry["samples_ms"]) == 2 and entry["number"] >= 1
            assert entry["ms"] > 0 and entry["ratio"] > 0 and entry["gbs"] > 0
            assert entry["ratio_iqr"][0] <= entry["ratio"] <= entry["ratio_iqr"][1]
            assert entry["pct_copy"] > 0
            if record["pass"] == "fwd":
                assert entry["memory"] is None
            else:
                memory = entry["memory"]
                assert set(memory) == {"peak_bytes", "saved_bytes", "output_bytes"}
                out = math.prod(record["shape"]) * 4
                assert memory["output_bytes"] == out
                assert max(out, memory["saved_bytes"]) <= memory["peak_bytes"]
                assert memory["peak_bytes"] <= memory["saved_bytes"] + out
        assert record["impls"]["torch"]["ratio"] == 1.0


def test_run_restores_the_thread_count():
    before = torch.get_num_threads()
    run(BenchConfig(ops=("rms_norm",), shapes="4x8", threads=(1, 2), **TINY))
    assert torch.get_num_threads() == before


def test_plan_skips_ops_without_a_matching_shape():
    cases, skipped = plan(BenchConfig(ops=("rms_norm", "group_norm"), shapes="4x8"))
    assert [op.name for op, _ in cases] == ["rms_norm"]
    assert skipped == [{"op": "group_norm", "reason": "no image shape in the shape set "
                                                      "(4-dim N x C x H x W)"}]


@pytest.mark.parametrize("kwargs", [
    {"device": "tpu"}, {"threads": (0,)}, {"dtype": "int8"}, {"input": "zeros"},
    {"repeats": 0}, {"shapes": "4x4x4x4x4"}, {"flush_mib": -1}, {"cuda_graphs": True},
    {"backend": "reference"},
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        BenchConfig(**kwargs)


# --- the Markdown report -------------------------------------------------------------


def test_markdown_table_columns(doc):
    text = report.to_markdown(doc)
    lines = text.splitlines()
    assert lines[0] == "# normkit bench: cpu, float32, input randn (well-conditioned)"
    assert lines[lines.index("```sh") + 1] == doc["command"]
    header = [line for line in lines if line.startswith("| op ")]
    assert header == ["| op | shape | layout | pass | torch ms | normkit ms | normkit x "
                      "| normkit GB/s | % copy | torch MiB | normkit MiB |"]
    at = lines.index(header[0])
    assert lines[at + 1] == "|---|---|---|---|" + "---:|" * 7
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in lines[at + 2:at + 2 + len(doc["results"])]]
    assert [row[:4] for row in rows] == [
        ["layer_norm", "8x16", "-", "fwd"], ["layer_norm", "8x16", "-", "fwd+bwd"],
        ["batch_norm", "2x4x3x3", "NHWC", "fwd"], ["batch_norm", "2x4x3x3", "NHWC", "fwd+bwd"]]
    for row in rows:
        assert len(row) == 11
        assert float(row[4]) > 0 and float(row[5]) > 0  # ms
        assert re.fullmatch(r"~?\d+\.\d\dx", row[6]) and row[8].endswith("%")
        assert (row[9] == "-") == (row[3] == "fwd")
    assert "well-conditioned" in text and "torch.nn.BatchNorm2d (train)" in text


def test_markdown_marks_noisy_ratios(doc):
    noisy = json.loads(json.dumps(doc))
    entry = noisy["results"][0]["impls"]["normkit"]
    entry["ratio"], entry["ratio_iqr"] = 1.0, [0.7, 1.3]
    calm = noisy["results"][1]["impls"]["normkit"]
    calm["ratio"], calm["ratio_iqr"] = 2.0, [1.9, 2.1]
    rows = [line for line in report.to_markdown(noisy).splitlines()
            if line.startswith("| layer_norm ")]
    assert "| ~1.00x |" in rows[0] and "| 2.00x |" in rows[1]


def test_markdown_extra_columns_for_threads_and_compile(doc):
    multi = json.loads(json.dumps(doc))
    multi["environment"]["threads"] = [1, 2]
    for record in multi["results"]:
        record["impls"]["torch.compile"] = dict(record["impls"]["torch"], compile_s=3.5)
        record["impls"]["normkit.compile"] = dict(record["impls"]["normkit"], compile_s=1.25)
    cols = report.columns(multi)
    assert cols[0] == "threads"
    assert cols[-8:] == ["torch.compile ms", "torch.compile x", "torch.compile 1st s",
                         "normkit.compile ms", "normkit.compile x", "normkit.compile 1st s",
                         "torch MiB", "normkit MiB"]
    row = next(line for line in report.to_markdown(multi).splitlines()
               if line.startswith("| 1 | layer_norm"))
    assert "| 3.5 |" in row and "| 1.2 |" in row  # first-call (compile) seconds


# --- ops and baselines ----------------------------------------------------------------


def test_op_names_are_unique_and_complete():
    assert len(set(op_names())) == len(OPS)
    assert set(CORE) == {"layer_norm", "rms_norm", "batch_norm", "batch_norm_eval",
                         "frozen_batch_norm", "batch_norm_biased_var", "batch_renorm",
                         "group_norm", "instance_norm", "instance_norm_eval", "layer_norm2d",
                         "power_norm"}
    assert {"add_layer_norm", "add_rms_norm", "batch_norm_act"} <= set(FUSED)


@pytest.mark.parametrize("name", op_names())
def test_every_op_has_a_torch_baseline(name):
    op = get_op(name)
    assert op.baseline_doc
    dims = DIMS[op.kind]
    baseline = op.baseline(dims)
    assert isinstance(baseline, nn.Module)
    assert sum(p.numel() for p in baseline.parameters()) == op.params(dims)
    inputs = [torch.randn(dims) for _ in range(op.inputs)]
    outputs = baseline(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(outputs) == op.outputs
    assert all(out.shape == dims for out in outputs)


@pytest.mark.parametrize("name", CORE)
def test_core_ops_compute_what_their_baseline_computes(name):
    op = get_op(name)
    dims = DIMS[op.kind]
    x = torch.randn(dims)
    ours = op.build(op.resolve(), dims).train(op.training)
    theirs = op.baseline(dims).train(op.training)
    assert sum(p.numel() for p in ours.parameters()) == op.params(dims)
    if not op.training:  # the same running statistics in both
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name))
    want = theirs(x)
    if name == "batch_renorm":  # past its warm-up: BatchNorm's output renormalized by
        # r = clip(sigma_B / 1, 1/3, 3) and d = clip(mu_B - 0, -5, 5) (fresh running
        # statistics 0 and 1, weight 1, bias 0)
        dims_ = (0, *range(2, x.dim()))
        var, mean = torch.var_mean(x.double(), dims_, correction=0, keepdim=True)
        r = torch.sqrt(var + 1e-5).clamp(1 / 3, 3.0)
        want = (want.double() * r + mean.clamp(-5.0, 5.0)).float()
    if name == "power_norm":  # past its warm-up, against LayerNorm (the layer it replaces):
        # each token's RMS scaling, then the fresh running quadratic mean 1
        xd = x.double()
        want = (xd * (xd.square().mean(-1, keepdim=True) + 1e-5).rsqrt()
                / (1 + 1e-5) ** 0.5).float()
    torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


def _hide_top_level_fused(monkeypatch):
    """The fused classes are also re-exported from normkit: hide those too."""
    for cls in ("AddLayerNorm", "AddRMSNorm", "BatchNormAct2d", "GroupNormAct"):
        monkeypatch.delattr(normkit, cls, raising=False)


def test_fused_ops_are_skipped_with_a_reason_when_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "normkit.norms.fused", types.ModuleType("fused"))
    _hide_top_level_fused(monkeypatch)
    for name in FUSED:
        reason = get_op(name).available()
        assert reason is not None and "normkit.norms.fused has no" in reason


# --- a stand-in for normkit.norms.fused: detection and two-output plumbing --------------


class _AddRMSNorm(AddThenNorm):
    def __init__(self, normalized_shape):
        super().__init__(normkit.RMSNorm(normalized_shape))


class _BatchNormAct2d(nn.Sequential):
    def __init__(self, num_features, act="relu", memory="standard"):
        super().__init__(normkit.BatchNorm2d(num_features),
                         nn.LeakyReLU() if act == "leaky_relu" else nn.ReLU())


class _BrokenAddLayerNorm(nn.Module):
    def __init__(self, normalized_shape):
        super().__init__()

    def forward(self, x, residual):
        raise RuntimeError("kernel exploded")


@pytest.fixture
def fake_fused(monkeypatch):
    module = types.ModuleType("normkit.norms.fused")
    module.AddRMSNorm = _AddRMSNorm
    module.AddLayerNorm = _BrokenAddLayerNorm
    module.BatchNormAct2d = _BatchNormAct2d
    monkeypatch.setitem(sys.modules, "normkit.norms.fused", module)
    _hide_top_level_fused(monkeypatch)
    return module


def test_fused_ops_are_detected_at_run_time(fake_fused):
    assert get_op("add_rms_norm").available() is None
    assert get_op("group_norm_act").available() == "normkit.norms.fused has no GroupNormAct"
    _, skipped = plan(BenchConfig(shapes="4x8"))
    assert [item["op"] for item in skipped if item["op"] in FUSED] == [
        "batch_norm_act", "batch_norm_act_inplace", "group_norm_act"]  # no image shape / absent
    doc = run(BenchConfig(ops=("add_rms_norm", "batch_norm_act_inplace"),
                          shapes="4x8,2x3x4x4", **TINY))
    assert errors(doc) == []
    rms = [r for r in doc["results"] if r["op"] == "add_rms_norm"]
    assert [r["pass"] for r in rms] == list(PASSES)
    assert rms[0]["ideal_bytes"] == 4 * 32 * 4 + 8 * 4
    memory = rms[1]["impls"]["normkit"]["memory"]
    assert memory["output_bytes"] == 2 * 32 * 4  # normed and x + residual


def test_a_failing_implementation_is_reported_and_the_rest_run(fake_fused, capsys):
    doc = run(BenchConfig(ops=("add_layer_norm",), shapes="4x8", **TINY))
    failures = errors(doc)
    assert len(failures) == 2 and all("kernel exploded" in f for f in failures)
    for record in doc["results"]:
        assert record["impls"]["torch"]["ms"] > 0
        assert record["impls"]["normkit"]["ms"] is None
    assert "kernel exploded" in report.to_markdown(doc)
    code = cli.main(["add_layer_norm", "--shapes", "4x8", "--repeats", "2", "--min-time", "0",
                     "--copy-mib", "1", "--quiet"])
    assert code == 1
    assert "| error |" in capsys.readouterr().out


def test_a_build_failure_or_a_timing_failure_is_reported_and_the_bench_goes_on(monkeypatch):
    """An implementation that cannot be built, and a timing run that fails midway (out
    of memory on a GPU, say), are errors in their records; torch's column, the other
    pass and the other shapes are still measured."""
    def refuse(module, backend):
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(runner, "with_backend", refuse)
    doc = run(BenchConfig(ops=("layer_norm",), shapes="4x8", **TINY))
    assert [r["impls"]["normkit"]["error"] for r in doc["results"]] == [
        "build failed: RuntimeError: no such kernel here"] * 2
    assert all(r["impls"]["torch"]["ms"] > 0 for r in doc["results"])
    monkeypatch.undo()

    calls, interleaved = [], measure.interleaved

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return interleaved(*args, **kwargs)

    monkeypatch.setattr(measure, "interleaved", fails_once)
    doc = run(BenchConfig(ops=("layer_norm",), shapes="4x8,6x16", **TINY))
    first, *rest = doc["results"]
    for entry in first["impls"].values():
        assert entry["ms"] is None
        assert entry["error"] == "timing failed: RuntimeError: CUDA out of memory (a stand-in)"
    assert len(rest) == 3 and all(r["impls"][name]["ms"] > 0 for r in rest
                                  for name in ("torch", "normkit"))


# --- ideal bytes ------------------------------------------------------------------------


def test_ideal_bytes_layer_norm_transformer_rows():
    op, x, p = get_op("layer_norm"), 4096 * 1024 * 4, 2 * 1024 * 4
    assert op.ideal_bytes((4096, 1024), "fwd", 4) == 2 * x + p  # read x, write y, params
    assert op.ideal_bytes((4096, 1024), "fwd+bwd", 4) == 5 * x + 3 * p  # + x, dy, dx, grads


@pytest.mark.parametrize("name, fwd, both, params", [
    ("rms_norm", 2, 5, 16),
    ("batch_norm", 2, 5, 16),
    ("instance_norm", 2, 5, 0),
    ("add_rms_norm", 4, 8, 16),
    ("add_layer_norm", 4, 8, 32),
])
def test_ideal_bytes_formulas(name, fwd, both, params):
    op = get_op(name)
    dims = (2, 8, 16) if op.kind == "rows" else (2, 8, 4, 4)
    x = math.prod(dims)
    for itemsize in (4, 2):
        p = op.params(dims) * itemsize
        assert op.ideal_bytes(dims, "fwd", itemsize) == fwd * x * itemsize + p
        assert op.ideal_bytes(dims, "fwd+bwd", itemsize) == both * x * itemsize + 3 * p
    assert op.params(dims) == params
    assert op.ideal_bytes(dims, "fwd", 2, param_itemsize=4) == fwd * x * 2 + params * 4
    with pytest.raises(ValueError, match="pass must be one of"):
        op.ideal_bytes(dims, "bwd", 4)


# --- shapes ------------------------------------------------------------------------------


def test_shape_sets():
    standard = {(s.dims, s.channels_last) for s in parse_shapes("standard")}
    for d in (768, 1024, 4096, 8192):
        assert ((4096, d), False) in standard
    for dims in ((32, 64, 56, 56), (32, 256, 14, 14)):
        assert {(dims, False), (dims, True)} <= standard
    assert ((7, 33), False) in standard and ((3, 5, 7, 9), False) in standard
    small = parse_shapes("small")
    assert {s.kind for s in small} == {"rows", "image"}
    assert max(math.prod(s.dims) for s in small) < max(math.prod(d) for d, _ in standard)


def test_parse_shape_specs():
    shapes = parse_shapes(" 4096x1024, 2x16x8 ,32x64x56x56:cl, 3x5x7x9:nchw")
    assert [(s.dims, s.channels_last, s.kind) for s in shapes] == [
        ((4096, 1024), False, "rows"), ((2, 16, 8), False, "rows"),
        ((32, 64, 56, 56), True, "image"), ((3, 5, 7, 9), False, "image")]
    assert [s.spec for s in shapes][2] == "32x64x56x56:cl"


@pytest.mark.parametrize("spec, message", [
    ("4096by1024", "expected sizes joined by 'x'"),
    ("4x8:cl", "channels_last needs a 4-dim"),
    ("4x8x2x2:nhcw", "expected a layout suffix"),
    ("8", "expected a shape of 2 or 3 dims"),
    ("0x8", "all >= 1"),
    (",", "expected a shape set"),
])
def test_parse_shape_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_shapes(spec)


def test_param_dtype_times_mixed_precision(monkeypatch):
    """``--param-dtype float32`` with 16-bit inputs: every implementation's module keeps
    float32 parameters (as under torch.autocast), the inputs are 16-bit, the ideal bytes
    count the parameters at 4 bytes, and the report says so; a bad dtype is refused."""
    built = []
    real = runner._Case._build

    def spy(self, name):
        module = real(self, name)
        built.append((name, {p.dtype for p in module.parameters()}, self.inputs[0].dtype))
        return module

    monkeypatch.setattr(runner._Case, "_build", spy)
    config = BenchConfig(ops=("layer_norm",), shapes="8x16", dtype="bfloat16",
                         param_dtype="float32", repeats=1, warmup=0, min_time=0.0)
    doc = run(config)
    assert {name for name, _, _ in built} == {"torch", "normkit"}
    assert all(p == {torch.float32} and x == torch.bfloat16 for _, p, x in built), built
    env = doc["environment"]
    assert (env["dtype"], env["param_dtype"]) == ("bfloat16", "float32")
    record = next(r for r in doc["results"] if r["pass"] == "fwd")
    assert record["ideal_bytes"] == 2 * 8 * 16 * 2 + 2 * 16 * 4
    assert "bfloat16 (float32 parameters)" in report.to_markdown(doc)
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        BenchConfig(param_dtype="int8")


def test_make_input_layouts_and_offset():
    x = make_input(Shape((2, 3, 4, 5), True), torch.bfloat16, "cpu", "offset")
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
    assert 90 < float(x.float().mean()) < 110


# --- measurement primitives ---------------------------------------------------------------


def test_interleaved_rotates_the_first_implementation():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    measure.interleaved(fns, measure.Timer(), repeats=3, number=1)
    assert calls == list("abc" "bca" "cab")


def test_cold_timer_flushes_before_every_call_and_times_only_the_call():
    """With flush_bytes every call starts after a write of the whole buffer (the inputs
    leave the cache), and the time of that write is not the call's."""
    order = []
    timer = measure.Timer("cpu", flush_bytes=8 << 20)
    assert timer.flush_seconds > 0
    flush = timer._buffer.zero_
    timer._buffer = types.SimpleNamespace(zero_=lambda: (order.append("flush"), flush()))
    seconds = timer(lambda: order.append("call"), number=3)
    assert order == ["flush", "call"] * 3
    assert seconds < timer.flush_seconds / 10  # an 8 MiB write: ~1 ms; an append: ~1 us
    assert measure.Timer("cpu").flush_seconds == 0.0
    with pytest.raises(ValueError, match="flush_bytes"):
        measure.Timer("cpu", flush_bytes=-1)


def test_flush_default_per_device_recorded_in_the_document():
    assert BenchConfig().flush_mib == 0 and BenchConfig(flush_mib=8).flush_mib == 8
    doc = run(BenchConfig(ops=("rms_norm",), shapes="4x8", flush_mib=1, **TINY))
    assert doc["settings"]["flush_mib"] == 1
    assert "cache: cold (1 MiB written before every call" in report.to_markdown(doc)
    warm = run(BenchConfig(ops=("rms_norm",), shapes="4x8", **TINY))
    assert "cache: warm" in report.to_markdown(warm)


def test_cuda_graphs_setting_is_recorded_and_explained():
    """--cuda-graphs needs CUDA (the CPU config refuses it, saying why); a document made
    with it records the setting and its Markdown says what the times mean."""
    with pytest.raises(ValueError, match="needs device 'cuda', got device 'cpu'"):
        BenchConfig(cuda_graphs=True)
    doc = run(BenchConfig(ops=("rms_norm",), shapes="4x8", **TINY))
    assert doc["settings"]["cuda_graphs"] is False
    assert "CUDA graphs" not in report.to_markdown(doc)
    doc["settings"]["cuda_graphs"] = True
    text = report.to_markdown(doc)
    assert "captured once in a CUDA graph" in text
    assert "compare kernels here, not eager calls" in text  # (the targets section says so)


def test_backend_is_set_on_normkit_modules_and_recorded(monkeypatch):
    """--backend sets every normkit module's backend (the layers read it per call) and the
    document and its Markdown say so; "auto" leaves the modules as built, and a module
    with no backend to set is refused, saying which."""
    from normkit.bench import runner

    built = []
    original = runner.with_backend

    def spy(module, backend):
        built.append(original(module, backend))
        return built[-1]

    monkeypatch.setattr(runner, "with_backend", spy)
    doc = run(BenchConfig(ops=("group_norm", "layer_norm"), shapes="4x8,2x8x3x3:cl",
                          backend="eager", **TINY))
    assert doc["settings"]["backend"] == "eager"
    assert {type(m).__name__ for m in built} == {"GroupNorm", "LayerNorm"}
    assert all(m.backend == "eager" for m in built)
    assert all("error" not in r["impls"]["normkit"] or r["impls"]["normkit"]["error"] is None
               for r in doc["results"])
    assert "normkit backend: 'eager'" in report.to_markdown(doc)
    auto = run(BenchConfig(ops=("rms_norm",), shapes="4x8", **TINY))
    assert auto["settings"]["backend"] == "auto"
    assert "normkit backend" not in report.to_markdown(auto)
    with pytest.raises(ValueError, match="Identity has no backend to set to 'triton'"):
        original(torch.nn.Identity(), "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_timing_replays_every_implementation():
    """On a GPU, --cuda-graphs times replays: every implementation gets a time and a
    ratio, forward and forward+backward, and a replay rewrites the captured outputs."""
    doc = run(BenchConfig(ops=("layer_norm", "rms_norm"), device="cuda", shapes="256x512",
                          cuda_graphs=True, **TINY))
    for record in doc["results"]:
        for name, entry in record["impls"].items():
            if entry.get("error") and "not installed" in entry["error"]:
                continue
            assert entry["error"] is None, (record["op"], name, entry["error"])
            assert entry["ms"] > 0 and entry["ratio"] is not None
    x = torch.zeros(4, device="cuda")
    out = []
    replay = measure.graphed(lambda: out.append(x + 1), warmup=1)
    x.fill_(2.0)
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out[-1], torch.full((4,), 3.0, device="cuda"))


def test_saved_bytes_sees_saved_input_and_dedupes_the_output():
    x = torch.randn(16, 32, requires_grad=True)
    ln = nn.LayerNorm(32)
    memory = measure.saved_bytes(lambda: (ln(x),))
    nbytes = 16 * 32 * 4
    assert memory["output_bytes"] == nbytes
    assert memory["saved_bytes"] >= nbytes  # the input (and params, statistics)
    assert memory["peak_bytes"] == memory["saved_bytes"] + nbytes
    relu = measure.saved_bytes(lambda: (torch.relu(x),))  # saves its output: counted once
    assert relu == {"saved_bytes": nbytes, "output_bytes": nbytes, "peak_bytes": nbytes}


def test_median_ratio_and_calibrate():
    assert measure.median_ratio([4.0, 1.0, 3.0], [2.0, 1.0, 1.0]) == 2.0
    assert measure.calibrate(1e-3, 1e-2) == 10 and measure.calibrate(1.0, 1e-2) == 1
    with pytest.raises(ValueError):
        measure.median_ratio([1.0], [1.0, 2.0])


def test_externals_absent_are_reported_cleanly():
    doc_impls = run(BenchConfig(ops=("rms_norm",), shapes="4x8", **TINY))["implementations"]
    for ext in EXTERNALS:
        reason = ext.status("cpu")
        assert reason is not None  # not installed here, or needs CUDA
        assert doc_impls[ext.name] == {"used": False, "reason": reason}
    fake = External("fake", "json", {"rms_norm": ("NoSuchClass", lambda cls, d: cls())},
                    needs_cuda=False)
    assert fake.status("cpu") is None
    assert fake.builder("rms_norm") is None and fake.builder("layer_norm") is None
    # a dotted class name is looked up in that submodule; a failing import leaves the op out
    nested = External("fake", "json", {
        "rms_norm": ("decoder.JSONDecoder", lambda cls, d: cls.__name__),
        "layer_norm": ("no_such_submodule.Anything", lambda cls, d: cls())}, needs_cuda=False)
    assert nested.builder("rms_norm")((4, 8)) == "JSONDecoder"
    assert nested.builder("layer_norm") is None


def test_report_number_format():
    assert [report.format_ms(v) for v in (0.000123, 0.5, 12.345, 999.9, float("nan"))] == [
        "0.000123", "0.500", "12.3", "1000", "-"]


# --- the command line -------------------------------------------------------------------


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(list(argv))
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: normkit bench")
    return err


def test_cli_unknown_op_lists_the_valid_ones(capsys):
    err = _usage_error(capsys, "layer_norm", "lyaer_norm")
    assert "unknown op 'lyaer_norm'; valid ops: " + ", ".join(op_names()) in err


def test_cli_unavailable_fused_op_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "normkit.norms.fused", types.ModuleType("fused"))
    _hide_top_level_fused(monkeypatch)
    err = _usage_error(capsys, "add_rms_norm", "--shapes", "4x8")
    assert "op 'add_rms_norm' is not available here: normkit.norms.fused has no AddRMSNorm" in err


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "4x"], "expected sizes joined by 'x'"),
    (["--threads", "0"], "expected a positive integer or a comma list"),
    (["--threads", "one"], "expected a positive integer or a comma list"),
    (["--dtype", "float64"], "invalid choice: 'float64'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--repeats", "0"], "expected repeats >= 1"),
    (["--backend", "cudnn"], "invalid choice: 'cudnn'"),
    (["rms_norm", "--shapes", "2x3x4x5"], "nothing to run with --shapes '2x3x4x5'"),
])
def test_cli_argument_errors(capsys, argv, message):
    assert message in _usage_error(capsys, *argv)


def test_cli_output_files_are_checked_before_anything_is_measured(tmp_path, capsys,
                                                                   monkeypatch):
    """An output that cannot be written, or that would overwrite another output or one of
    the command's input runs, is a usage error at once -- not a traceback after the whole
    bench has run, its measurements lost."""
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("measured before the check"))
    kept = tmp_path / "before.json"
    kept.write_text("{}")
    cases = [
        (["--json", str(tmp_path / "no-such-folder" / "b.json")],
         f"--json expected a file it can write, got '{tmp_path}/no-such-folder/b.json': "
         f"its folder '{tmp_path}/no-such-folder' does not exist"),
        (["--markdown", str(tmp_path)], "it is a folder"),
        (["--json", str(tmp_path / "b.out"), "--markdown", str(tmp_path / "b.out")],
         "--json and --markdown name the same file"),
        (["--compare", str(kept), "--to", str(kept), "--markdown", str(kept)],
         "--markdown expected a file other than this command's inputs"),
    ]
    for extra, message in cases:
        assert message in _usage_error(capsys, "layer_norm", "--shapes", "4x8", *extra)
    assert kept.read_text() == "{}"


def test_cli_output_files_are_replaced_whole(tmp_path, capsys, monkeypatch):
    """A failure while writing (a full disk) leaves the user's old file as it was."""
    from normkit import _files

    json_path = tmp_path / "bench.json"
    json_path.write_text("old run\n")
    real_fdopen = os.fdopen

    def failing_fdopen(fd, *args, **kwargs):
        handle = real_fdopen(fd, *args, **kwargs)
        handle.write = lambda text: (_ for _ in ()).throw(OSError(28, "No space left"))
        return handle

    monkeypatch.setattr(_files.os, "fdopen", failing_fdopen)
    with pytest.raises(OSError, match="No space left"):
        cli.main(["rms_norm", "--shapes", "4x8", "--repeats", "1", "--min-time", "0",
                  "--copy-mib", "1", "--quiet", "--json", str(json_path)])
    assert json_path.read_text() == "old run\n"
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary left


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cli_cuda_without_a_gpu_is_a_usage_error(capsys):
    assert "torch.cuda.is_available() is False" in _usage_error(capsys, "--device", "cuda")


def test_cli_writes_json_and_markdown(tmp_path, capsys):
    json_path, md_path = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["group_norm", "--shapes", "2x4x3x3", "--repeats", "2", "--warmup", "0",
            "--min-time", "0", "--copy-mib", "1", "--json", str(json_path),
            "--markdown", str(md_path)]
    assert cli.main(argv, prog="normkit bench") == 0
    captured = capsys.readouterr()
    assert "[0/2] measuring copy bandwidth" in captured.err  # plain progress: not a terminal
    assert "[2/2] group_norm 2x4x3x3 fwd+bwd [1t]: normkit " in captured.err
    data = json.loads(json_path.read_text())
    assert data["schema"] == SCHEMA
    assert data["command"] == "normkit bench " + " ".join(argv)
    markdown = md_path.read_text()
    assert markdown == captured.out
    assert markdown.splitlines()[5] == data["command"]


def test_interrupted_run_keeps_the_measured_passes(tmp_path, capsys, monkeypatch):
    """Ctrl-C or SIGTERM (gpu_check.sh's per-step timeout) mid-run: the passes measured so
    far are written, marked interrupted, and the exit code is 3."""
    def stop_after_three(done, total, label):
        if done == 3:
            raise KeyboardInterrupt

    doc = run(BenchConfig(ops=("layer_norm",), shapes="4x8,6x8,8x8", **TINY),
              progress=stop_after_three)
    assert doc["interrupted"] == "after 3 of 6 passes" and len(doc["results"]) == 3
    assert "**Interrupted after 3 of 6 passes**" in report.to_markdown(doc)

    real_run = cli.run
    monkeypatch.setattr(cli, "run", lambda config, **kw: real_run(
        config, command=kw.get("command"), progress=stop_after_three))
    json_path, md_path = tmp_path / "partial.json", tmp_path / "partial.md"
    code = cli.main(["layer_norm", "--shapes", "4x8,6x8", "--repeats", "2", "--min-time", "0",
                     "--copy-mib", "1", "--quiet", "--json", str(json_path), "--markdown",
                     str(md_path)], prog="normkit bench")
    assert code == 3
    assert "interrupted after 3 of 4 passes" in capsys.readouterr().err
    assert len(json.loads(json_path.read_text())["results"]) == 3
    assert "Interrupted after 3 of 4 passes" in md_path.read_text()
    summary = cli._summarize([str(json_path)], cli.build_parser())
    assert "(interrupted after 3 of 4 passes: partial)" in summary


def test_sigterm_raises_keyboard_interrupt_inside_the_bench_only():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), cli._sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes
            pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_cli_json_to_stdout(capsys):
    code = cli.main(["rms_norm", "--shapes", "4x8", "--repeats", "2", "--min-time", "0",
                     "--copy-mib", "1", "--quiet", "--json", "-"], prog="normkit bench")
    captured = capsys.readouterr()
    assert code == 0 and captured.err == ""
    assert json.loads(captured.out)["results"][0]["op"] == "rms_norm"


def test_cli_param_dtype(capsys):
    code = cli.main(["rms_norm", "--shapes", "4x8", "--repeats", "1", "--min-time", "0",
                     "--copy-mib", "1", "--dtype", "float16", "--param-dtype", "float32",
                     "--quiet", "--json", "-"], prog="normkit bench")
    env = json.loads(capsys.readouterr().out)["environment"]
    assert code == 0 and (env["dtype"], env["param_dtype"]) == ("float16", "float32")


def test_python_m_normkit_bench_lists_the_ops():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "normkit.bench", "--list"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in op_names():
        assert f"\n{name} | " in proc.stdout
    assert "permute + torch.nn.LayerNorm + permute" in proc.stdout


def test_compile_times_torch_and_normkit_under_torch_compile():
    """--compile adds torch.compile of both modules: timed, their first call (compile)
    reported apart, ratios against torch eager."""
    from torch._inductor.utils import fresh_inductor_cache

    with fresh_inductor_cache():  # (never a graph cached for another normkit version)
        doc = run(BenchConfig(ops=("layer_norm",), shapes="16x32", compile=True, **TINY))
    for record in doc["results"]:
        for name in ("torch.compile", "normkit.compile"):
            entry = record["impls"][name]
            assert entry["error"] is None, entry["error"]
            assert entry["ms"] > 0 and entry["compile_s"] > 0 and entry["ratio"] > 0
    text = report.to_markdown(doc)
    assert "normkit.compile 1st s" in text and "not requested" not in text


def _write_wheel(path: Path, name: str, version: str) -> None:
    """A minimal pure-Python wheel (one empty module) that pip installs offline."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as wheel:
        for f, text in {**files, f"{info}/RECORD": record}.items():
            wheel.writestr(f, text)


def _gpu_check_dry_run(tmp: Path) -> background.Command:
    root = Path(__file__).resolve().parents[1]
    wheels = tmp / "wheels"  # the device reaches no registry: wheels travel with it
    wheels.mkdir()
    _write_wheel(wheels / "normkit_probe-1.0-py3-none-any.whl", "normkit_probe", "1.0")
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp / "gpu-out"),
           "PYTHON": sys.executable, "GPU_WHEELS": str(wheels)}
    return background.Command(["bash", str(root / "benchmarks" / "gpu_check.sh")], env=env,
                              cwd=root, timeout=300)


@background.job(_gpu_check_dry_run)
def test_gpu_check_script_rehearses_on_the_cpu(background_result):
    """benchmarks/gpu_check.sh is run once per lent GPU, never in CI: its dry run checks
    the script itself, the bench options it passes and the summary step on the CPU (a
    background job: it runs while the rest of the suite does)."""
    done, out = background_result, background_result.tmp / "gpu-out"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for step in ("bench", "sweep", "triton eager", "targets"):
        assert f"{step}: exit 0" in done.stdout, done.stdout[-3000:]
    assert "tests: skipped (dry run)" in done.stdout
    assert "wheels: exit 0 (1 installed)" in done.stdout
    steps = (out / "steps.log").read_text()
    assert steps.startswith("python ") and "Successfully installed normkit-probe-1.0" in steps
    assert "overhead: exit 0" in done.stdout
    assert "block=None" in (out / "overhead.txt").read_text()
    # the device tool brings back at most 8 files, named in letters, digits, '.', '_', '-'
    files = sorted(p.name for p in out.rglob("*"))
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    with pytest.raises(ImportError):  # a dry run installs aside, never into this python
        importlib.import_module("normkit_probe")
    full = json.loads((out / "results-gpu.json").read_text())
    widths = json.loads((out / "results-gpu-widths.json").read_text())
    for doc in (full, widths):
        assert doc["environment"]["device"] == "cpu"
        assert doc["environment"]["peak_bandwidth_gbs"] == 4800
        assert doc["results"]
    assert {r["op"] for r in widths["results"]} == {"layer_norm", "rms_norm", "add_layer_norm",
                                                   "add_rms_norm"}
    assert "| BatchNorm2d" in (out / "RESULTS-gpu.md").read_text()
    targets = (out / "targets-gpu.md").read_text()
    assert targets.startswith("## Issue #6 targets") and "results-gpu-widths.json" in targets
    # normkit's Triton BatchNorm/GroupNorm on channels-last (--backend triton, through the
    # interpreter here): their table in steps.log, their verdicts after the main ones
    assert "== triton channels-last, eager: exit 0" in steps
    assert "normkit backend: 'triton'" in steps
    assert "## normkit bench --backend triton (eager): channels-last BN, GN" in targets


def test_accuracy_script_measures_outputs_and_input_gradients(monkeypatch):
    """benchmarks/accuracy.py (ACCURACY.md): on a small shape every family's row holds the
    output and input-gradient errors of normkit and torch against float64; normkit stays
    within 1e-5 at every offset, torch's LayerNorm loses its digits far from zero."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("accuracy_script",
                                                  root / "benchmarks" / "accuracy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "SHAPES", ((4, 8, 5, 6),))
    rows = script.measure()
    assert len(rows) == len(script._families(8, 6)) * len(script.OFFSETS)
    for row in rows:
        for key in ("normkit", "torch", "normkit_dx", "torch_dx"):
            assert math.isfinite(row[key]) and row[key] >= 0, (row, key)
        assert row["normkit"] < 1e-5 and row["normkit_dx"] < 1e-5, row
    far = [r for r in rows if r["layer"].startswith("LayerNorm (") and r["offset"] == 1e5]
    assert far and far[0]["torch"] > 1e-3 and far[0]["torch_dx"] > 1e-3, far
    table = script.markdown(rows)
    assert "| normkit input grad | torch.nn input grad |" in table.splitlines()[0]


def test_accuracy_script_counts_mode_measures_channels_last_batch_norm():
    """benchmarks/accuracy.py --counts: one row per values-per-channel and ratio, each with
    torch's channels-last error, normkit's and torch's on the same values laid out NCHW;
    normkit's and the NCHW kernel's stay at float32 rounding."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("accuracy_counts_script",
                                                  root / "benchmarks" / "accuracy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.channels_last_counts(counts=(2048, 16384), ratios=(0.0, 1.5), seeds=1,
                                       channels=4)
    assert [(r["count"], r["ratio"]) for r in rows] == [
        (2048, 0.0), (2048, 1.5), (16384, 0.0), (16384, 1.5)]
    for row in rows:
        assert 0 < row["torch"] < 1e-3 and 0 < row["normkit"] < 1e-5, row
        assert row["torch_nchw"] < 2e-6, row
    table = script.counts_markdown(rows).splitlines()
    assert len(table) == 2 + len(rows) and "| torch, same values NCHW |" in table[0]


def test_accuracy_script_sixteen_bit_mode_shows_torchs_16bit_defects(monkeypatch):
    """benchmarks/accuracy.py --sixteen-bit: one row per case, dtype, parameter dtype and
    offset; torch's 16-bit LayerNorm weight gradient is off past the bfloat16 tolerance
    from a few thousand rows, normkit's stays at float32 rounding with float32
    parameters."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("accuracy_16bit_script",
                                                  root / "benchmarks" / "accuracy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "SIXTEEN_BIT_CASES", (("LayerNorm", (4096, 32)),
                                                      ("BatchNorm2d", (4, 8, 5, 5))))
    rows = script.sixteen_bit()
    assert len(rows) == 2 * 2 * 2 * len(script.SIXTEEN_BIT_OFFSETS)
    for row in rows:
        for key in ("torch", "torch_dx", "torch_dw", "normkit", "normkit_dx", "normkit_dw"):
            assert math.isfinite(row[key]) and row[key] >= 0, (row, key)
    ln = [r for r in rows if r["layer"] == "LayerNorm" and r["params"] == "float32"
          and r["dtype"] == "bfloat16"]
    assert ln and all(r["torch_dw"] > 4e-2 and r["normkit_dw"] < 1e-5 for r in ln), ln
    table = script.sixteen_bit_markdown(rows).splitlines()
    assert len(table) == 2 + len(rows) and "| normkit dweight |" in table[0]


def test_lstm_speed_script_compares_the_same_recurrence():
    """benchmarks/lstm_speed.py: its baseline is normkit's recurrence with torch's
    LayerNorm modules (same parameters, same outputs up to the norm's rounding), and every
    row comes back with a time and a ratio for both passes."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("lstm_speed_script",
                                                  root / "benchmarks" / "lstm_speed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.manual_seed(0)
    ours = normkit.LayerNormLSTM(4, 4)
    base = script._with_torch_layer_norms(normkit.LayerNormLSTM(4, 4))
    base.load_state_dict(ours.state_dict())
    assert not any(isinstance(m, normkit.LayerNorm) for m in base.modules())
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in base.modules()) == 3
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(base(x)[0], ours(x)[0])
    rows = script.measure(steps=3, batch=2, hidden=4, rounds=2)
    assert {(p, name) for p, name, _, _ in rows} == {
        (p, name) for p in ("fwd", "fwd+bwd")
        for name in ("torch LayerNorm", "normkit", "torch.nn.LSTM (no LayerNorm)")}
    assert all(ms > 0 and ratio > 0 for _, _, ms, ratio in rows)
    assert all(ratio == 1.0 for _, name, _, ratio in rows if name == "torch LayerNorm")


def test_layer_norm2d_paths_script_times_every_path_and_restores_the_floors(monkeypatch):
    """benchmarks/layer_norm2d_paths.py: each forced call really takes its path, with a
    gradient and without, the floors come back afterwards, and every path of both passes
    gets a ratio (the copy path's own 1.0)."""
    from normkit.kernels import native

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("layer_norm2d_paths_script",
                                                  root / "benchmarks" / "layer_norm2d_paths.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(native, "LAYER_NORM2D_MIN_ELEMENTS", 0)
    floors = [getattr(native, name) for name in script._FLOORS]
    served = []
    sums, per_sample = native._layer_norm2d_channel_sums, native._ColumnNormFunction.apply
    monkeypatch.setattr(native, "_layer_norm2d_channel_sums",
                        lambda *a: served.append("channel sums") or sums(*a))
    monkeypatch.setattr(native, "_ColumnNormFunction", type("Spy", (), {"apply": staticmethod(
        lambda *a: served.append("per-sample") or per_sample(*a))}))
    module = normkit.LayerNorm2d(4)
    for grad in (False, True):
        x = torch.randn(2, 4, 3, 3, requires_grad=grad)
        for path in script.PATHS:
            served.clear()
            with torch.set_grad_enabled(grad):
                script._on_path(module, x, path)()
            assert (served or ["copy"]) == [path], (grad, path, served)
    assert [getattr(native, name) for name in script._FLOORS] == floors
    ratios = script.measure((2, 4, 3, 3), rounds=2)
    assert set(ratios) == {"fwd", "fwd+bwd"}
    assert all(set(r) == set(script.PATHS) and r["copy"] == 1.0
               and all(v > 0 for v in r.values()) for r in ratios.values())


@pytest.mark.parametrize("name", ["batch_norm_eval", "instance_norm_eval", "frozen_batch_norm"])
def test_eval_ops_run_in_eval_mode_on_trained_statistics(name, monkeypatch):
    """The eval ops time both modules in eval mode (never updating their running
    statistics, which are a trained network's, not 0 and 1), forward and backward."""
    op = get_op(name)
    cls, modes = op.resolve(), []
    forward = cls.forward
    monkeypatch.setattr(cls, "forward",
                        lambda self, x: modes.append(self.training) or forward(self, x))
    doc = run(BenchConfig(ops=(name,), shapes="2x3x4x4", **TINY))
    assert errors(doc) == []
    assert modes and not any(modes)
    assert [r["pass"] for r in doc["results"]] == list(PASSES)
    x, p = 2 * 3 * 4 * 4 * 4, op.params((2, 3, 4, 4)) * 4
    assert [r["ideal_bytes"] for r in doc["results"]] == [2 * x + p, 4 * x + 3 * p]
    norm = op.build(cls, (2, 3, 4, 4))
    assert float(norm.running_mean.abs().max()) > 0 and not torch.equal(
        norm.running_var, torch.ones(3))


def test_train_step_script_times_the_same_networks(monkeypatch):
    """benchmarks/train_step.py: every row of a network starts from the same parameters
    (normkit's drop-ins, the fused layers and LayerNorm2d carry torch's state; the first
    step's losses agree, else measure raises), the "no norm" row has no norm left, and
    every row gets a time and a ratio."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("train_step_script",
                                                  root / "benchmarks" / "train_step.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "SIZES", {"resnet": (2, 8, 6), "mbconv": (2, 4, 6),
                                          "unet": (2, 32, 6), "convnext": (2, 8, 6),
                                          "transformer": (16, 8)})
    rows, x = script.networks("mbconv", "channels_last")
    assert list(rows) == ["torch", "normkit", "normkit fused", "no norm"]
    assert x.is_contiguous(memory_format=torch.channels_last)
    fused = [m for m in rows["normkit fused"].modules() if isinstance(m, normkit.BatchNormAct2d)]
    assert [m.act for m in fused] == ["silu", "silu", "identity"] * 2
    torch.testing.assert_close(rows["normkit fused"].state_dict(), rows["torch"].state_dict())
    assert not any(normkit.tools.convert.is_norm_layer(m) for m in rows["no norm"].modules())
    rows, _ = script.networks("convnext", "contiguous")
    assert sum(isinstance(m, normkit.LayerNorm2d) for m in rows["normkit"].modules()) == 2
    x = torch.randn(2, 8, 6, 6)
    torch.testing.assert_close(rows["normkit"](x), rows["torch"](x))
    for which in script.SIZES:
        results = script.measure(which, "contiguous", rounds=2)
        assert all(ms > 0 and ratio > 0 for _, ms, ratio in results), results
        assert results[0][2] == 1.0
    # inference: eval mode, trained-looking running statistics, a folded row for BatchNorm
    rows, x = script.networks("resnet", "channels_last", inference=True)
    assert list(rows) == ["torch", "normkit", "normkit fused", "normkit fold_batchnorm",
                          "no norm"]
    assert not any(m.training for model in rows.values() for m in model.modules())
    bns = [m for m in rows["torch"].modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(float(m.running_var.sub(1).abs().max()) > 0 for m in bns)
    assert not any(isinstance(m, torch.nn.BatchNorm2d)
                   for m in rows["normkit fold_batchnorm"].modules())
    results = script.measure("mbconv", "channels_last", rounds=2, inference=True)
    assert [name for name, _, _ in results] == ["torch", "normkit", "normkit fused",
                                                "normkit fold_batchnorm", "no norm"]
    assert all(ms > 0 and ratio > 0 for _, ms, ratio in results), results
    # frozen statistics: training mode, every BatchNorm in eval mode; both FrozenBatchNorm
    # rows carry torch's state (the first losses agree, else measure raises)
    rows, x = script.networks("resnet", "contiguous", frozen=True)
    assert list(rows) == ["torch", "normkit", "normkit fused", "torch FrozenBatchNorm2d",
                          "normkit FrozenBatchNorm2d", "no norm"]
    bns = [m for model in rows.values() for m in model.modules()
           if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and not any(m.training for m in bns)
    assert all(model.training for model in rows.values())
    assert not list(rows["torch FrozenBatchNorm2d"].modules())[0].state_dict().keys() - set(
        rows["torch"].state_dict())
    results = script.measure("mbconv", "contiguous", rounds=2, frozen=True)
    assert [name for name, _, _ in results][-3:] == ["torch FrozenBatchNorm2d",
                                                     "normkit FrozenBatchNorm2d", "no norm"]
    assert all(ms > 0 and ratio > 0 for _, ms, ratio in results), results
    torch.manual_seed(1)
    other = script.resnet(8)  # other weights: its first loss differs
    built = script.networks
    monkeypatch.setattr(script, "networks", lambda which, layout, inference=False, frozen=False: (
        {**built(which, layout, inference)[0], "normkit": other.train(not inference)},
        built(which, layout, inference)[1]))
    with pytest.raises(AssertionError, match="first loss"):
        script.measure("resnet", "contiguous", rounds=1)
    with pytest.raises(AssertionError, match="output departs"):
        script.measure("resnet", "contiguous", rounds=1, inference=True)


def _benchmark_script(name: str):
    """A script of ``benchmarks/`` imported as a module."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(f"{name}_script",
                                                  root / "benchmarks" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_column_sums_group_blocks_table_states_the_engines_way(monkeypatch, capsys):
    """benchmarks/column_sums.py --group-blocks: one row per shape and thread count, the
    two ways' sums checked against each other, the way the engine takes named by
    ``_blocks_of_samples`` (blocks from GROUP_BLOCK_MIN_SAMPLES samples per block)."""
    from normkit.kernels import channels

    script = _benchmark_script("column_sums")
    monkeypatch.setattr(channels, "COLUMN_BLOCK_BYTES", 4096)
    monkeypatch.setattr(script, "GROUP_BLOCK_SHAPES", [(8, 64, 2, 2), (2, 64, 8, 8)])
    before = torch.get_num_threads()
    try:
        script.main(["--group-blocks", "--threads", "1", "--repeats", "1"])
    finally:
        torch.set_num_threads(before)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    # 1 KiB samples: 4 per 4 KiB block -> blocks; 16 KiB samples: none -> the kernel
    assert [row.split("|")[4].strip() for row in rows] == ["4", "0"]
    assert [row.split("|")[-2].strip() for row in rows] == ["blocks", "kernel"]


def test_column_sums_batch_sums_table_states_the_engines_way(monkeypatch, capsys):
    """benchmarks/column_sums.py --batch-sums: one row per shape and thread count with the
    three ways' cold and warm times and errors, and the way the engine takes: the whole
    fold with two threads, the per-sample folds with one where no block serves."""
    from normkit.kernels import channels

    script = _benchmark_script("column_sums")
    monkeypatch.setattr(script, "FLUSH_BYTES", 1 << 20)
    monkeypatch.setattr(channels, "COLUMN_BLOCK_BYTES", 1 << 16)  # (< a 98 KiB sample)
    monkeypatch.setattr(script, "BATCH_SUMS_SHAPES", [(4, 8, 56, 56)])
    before = torch.get_num_threads()
    try:
        script.main(["--batch-sums", "--threads", "1", "2", "--repeats", "1"])
    finally:
        torch.set_num_threads(before)
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2
    for row in rows:
        assert len(row[4].split("/")) == len(row[5].split("/")) == 3  # cold, warm ms
        assert all(float(e) < 1e-5 for e in row[6].split(","))  # variance errors
    assert [row[-2].strip() for row in rows] == ["per-sample folds", "whole fold"]


@pytest.mark.skipif(not memory.huge_pages_available(),
                    reason="needs Linux with transparent huge pages in madvise mode")
def test_huge_page_faults_script_times_every_way(capsys):
    """benchmarks/huge_page_faults.py: a median per way, and the faulted way really leaves
    the huge pages resident before the fill."""
    script = _benchmark_script("huge_page_faults")
    assert all(script.fill_ms(way, rounds=1, mib=4) > 0 for way in script.WAYS)
    t = torch.empty((8 << 20) // 4)
    script._advise(t, fault=True)
    _, mincore = memory._libc()
    first = -(-t.data_ptr() // memory._HUGE_PAGE) * memory._HUGE_PAGE
    vec = (ctypes.c_ubyte * 1)()
    assert mincore(first, 4096, vec) == 0 and vec[0] & 1


def test_output_cache_script_times_both_sides_and_restores_the_limit(monkeypatch):
    """benchmarks/output_cache.py: with the cache on, the op's large outputs come from it
    (its buffers fill as they are freed); with it off, none do; the limit comes back
    afterwards, and every case gets a ratio."""
    from normkit.kernels import memory

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("output_cache_script",
                                                  root / "benchmarks" / "output_cache.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(memory, "MIN_BYTES", 4 << 20)  # (8 MiB outputs count as large)
    monkeypatch.setattr(memory, "_libc", lambda: (lambda *a: 0, lambda *a: 0))  # fresh
    monkeypatch.setattr(memory, "_CACHE", memory._OutputCache())
    assert {op for op, _, _ in script.CASES} >= {"layer_norm", "rms_norm", "batch_norm"}
    limit = memory.OUTPUT_CACHE_BYTES
    for op, dims, channels_last in (("rms_norm", (1024, 2048), False),
                                    ("batch_norm", (8, 16, 128, 128), True)):
        for grad in (False, True):
            step = script._step(op, dims, channels_last, grad)
            memory.release_cached()  # (building the step ran the module once)
            monkeypatch.setattr(memory, "OUTPUT_CACHE_BYTES", 0)
            step()
            assert memory.cached_bytes() == 0, (op, grad)
            monkeypatch.setattr(memory, "OUTPUT_CACHE_BYTES", limit)
            step()
            assert memory.cached_bytes() > 0, (op, grad)  # the freed outputs came back
            off, on, ratio, q1, q3 = script.measure(step, pairs=2)
            assert memory.OUTPUT_CACHE_BYTES == limit
            assert off > 0 and on > 0 and q1 <= ratio <= q3
            memory.release_cached()


def test_power_norm_sums_table_checks_the_blocks_against_float64(monkeypatch, capsys):
    """benchmarks/power_norm_sums.py: one row per shape and mask, both ways' sums within
    float32 rounding of the float64 sum, over several blocks."""
    from normkit.kernels import channels

    script = _benchmark_script("power_norm_sums")
    monkeypatch.setattr(channels, "COLUMN_BLOCK_BYTES", 4096)  # (16 rows of 64 per block)
    monkeypatch.setattr(script, "SHAPES", ((100, 64),))
    before = torch.get_num_threads()
    try:
        script.main(["--threads", "1", "--rounds", "1"])
    finally:
        torch.set_num_threads(before)
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 1 |")]
    assert [row[3].strip() for row in rows] == ["no", "yes"]
    assert all(float(row[-2]) < 1e-6 for row in rows)
