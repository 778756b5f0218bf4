"""Issue #6's targets on bench documents (normkit.bench.targets) and ``--summarize``.

Synthetic documents fix the ratios, so the verdicts are known; one real tiny run checks
that every report ends with the targets section. No timing is asserted.
"""

from __future__ import annotations

import json

import pytest

from normkit.bench import cli, report
from normkit.bench.runner import BenchConfig, run
from normkit.bench.targets import TARGETS, evaluate, markdown_lines


def _row(op, shape, ratio, *, layout="contiguous", pass_="fwd+bwd", threads=1, gbs=None,
         pct_copy=None):
    return {"op": op, "shape": list(shape), "layout": layout, "pass": pass_,
            "threads": threads, "impls": {"torch": {"ratio": 1.0}, "normkit": {
                "ratio": ratio, "gbs": gbs, "pct_copy": pct_copy}}}


def _doc(rows, device="cpu", peak=None):
    return {"environment": {"device": device, "peak_bandwidth_gbs": peak}, "results": rows}


def _verdict(docs, start):
    return next(v for v in evaluate(docs) if v["target"].startswith(start))


def test_a_target_is_met_only_when_its_lowest_row_reaches_the_goal():
    runs = [_doc([_row("rms_norm", (4096, 1024), 3.0), _row("rms_norm", (4096, 768), 2.6)]),
            _doc([_row("rms_norm", (4096, 1024), 2.4, threads=2)])]
    first = _verdict(runs[:1], "RMSNorm fwd+bwd")
    assert (first["rows"], first["low"], first["high"], first["met"]) == (2, 2.6, 3.0, True)
    pooled = _verdict(runs, "RMSNorm fwd+bwd")
    assert pooled["met"] is False and pooled["below"] == 1
    assert pooled["worst"] == "rms_norm 4096x1024 fwd+bwd 2 thread(s)"


def test_rows_outside_a_target_are_not_counted():
    rows = [_row("rms_norm", (7, 33), 0.3),                     # small shape: not "standard"
            _row("rms_norm", (4096, 1024), 3.0, pass_="fwd"),   # forward: another target
            _row("batch_norm", (32, 64, 56, 56), 1.2, layout="channels_last"),
            _row("batch_norm", (32, 64, 56, 56), 1.6)]
    assert _verdict([_doc(rows)], "RMSNorm fwd+bwd")["rows"] == 0
    bn = _verdict([_doc(rows)], "BatchNorm2d NCHW")
    assert (bn["rows"], bn["met"]) == (1, True)
    core = _verdict([_doc(rows)], "every core layer")
    assert core["rows"] == 4 and core["below"] == 1 and core["met"] is False


def test_copy_and_peak_bandwidth_targets():
    cpu = _doc([_row("layer_norm", (4096, 4096), 1.0, pass_="fwd", pct_copy=65.0),
                _row("layer_norm", (4096, 1024), 1.0, pass_="fwd", pct_copy=10.0)])
    copy = _verdict([cpu], "LayerNorm/RMSNorm fwd >= 60% of copy")
    assert (copy["rows"], copy["low"], copy["met"]) == (1, 65.0, True)  # >= 64 MiB only
    gpu_rows = [_row("rms_norm", (4096, 4096), 1.3, pass_="fwd", gbs=4000.0)]
    unknown = _verdict([_doc(gpu_rows, "cuda")], "LayerNorm/RMSNorm fwd >= 80% of HBM")
    assert unknown["rows"] == 1 and unknown["met"] is None
    known = _verdict([_doc(gpu_rows, "cuda", peak=4800.0)], "LayerNorm/RMSNorm fwd >= 80%")
    assert known["low"] == pytest.approx(100 * 4000 / 4800) and known["met"] is True


def test_runs_of_another_dtype_are_not_evaluated():
    """The issue's targets are float32: a bfloat16 run, or one with float32 parameters
    but 16-bit inputs, covers none of them (documents without dtypes count as float32)."""
    rows = [_row("rms_norm", (4096, 1024), 3.0)]
    for dtype, params in (("bfloat16", "bfloat16"), ("float16", "float32")):
        doc = _doc(rows)
        doc["environment"].update(dtype=dtype, param_dtype=params)
        assert _verdict([doc], "RMSNorm fwd+bwd")["rows"] == 0
        assert markdown_lines([doc]) == []
    doc = _doc(rows)
    doc["environment"].update(dtype="float32", param_dtype="float32")
    assert _verdict([doc], "RMSNorm fwd+bwd")["rows"] == 1 == _verdict(
        [_doc(rows)], "RMSNorm fwd+bwd")["rows"]


def test_targets_of_another_device_are_left_out():
    cpu = {v["target"] for v in evaluate([_doc([])])}
    cuda = {v["target"] for v in evaluate([_doc([], "cuda")])}
    assert cpu and cuda and not cpu & cuda
    assert cpu | cuda == {t.text for t in TARGETS}


def test_markdown_states_the_verdicts():
    rows = [_row("add_rms_norm", (4096, 1024), 2.0), _row("add_layer_norm", (4096, 1024), 1.1)]
    text = "\n".join(markdown_lines([_doc(rows)]))
    assert "| add + RMSNorm fwd+bwd >= 1.5x | 1 | 2.00x | met |" in text
    assert ("| add + LayerNorm fwd+bwd >= 1.5x | 1 | 1.10x; 1 of 1 rows below, lowest: "
            "add_layer_norm 4096x1024 fwd+bwd 1 thread(s) | not met |") in text
    assert "RMSNorm fwd+bwd >= 2.5x" not in text  # no row: not listed
    gpu = "\n".join(markdown_lines([_doc([_row("layer_norm", (4096, 2048), 1.0, pass_="fwd",
                                                gbs=3000.0)], "cuda")]))
    assert "not evaluated: give the nominal bandwidth with --peak-gbs" in gpu


def test_every_report_ends_with_the_targets_of_its_rows():
    doc = run(BenchConfig(ops=("rms_norm",), shapes="256x256", repeats=2, warmup=0,
                          min_time=0.0, copy_mib=1))
    text = report.to_markdown(doc)
    assert text.index("## Issue #6 targets") > text.index("| op |")
    assert "| RMSNorm fwd+bwd >= 2.5x | 1 |" in text


def test_cli_summarize_pools_saved_runs(tmp_path, capsys):
    paths = []
    for i, ratio in enumerate((3.0, 2.0)):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(_doc([_row("rms_norm", (4096, 1024), ratio)])))
        paths.append(str(path))
    assert cli.main(["--summarize", *paths]) == 0
    out = capsys.readouterr().out
    assert "over 2 run(s)" in out and "| RMSNorm fwd+bwd >= 2.5x | 2 | 2.00-3.00x;" in out
    assert out.rstrip().endswith(f"Runs: {', '.join(paths)}.")


@pytest.mark.parametrize("content, message", [
    (None, "could not read"), ("{", "could not read"),
    ('{"results": []}', "expected the JSON of a normkit bench run")])
def test_cli_summarize_rejects_what_is_not_a_run(tmp_path, capsys, content, message):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--summarize", str(path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-3", "fast", "inf"])
def test_cli_peak_gbs_must_be_positive(capsys, value):
    with pytest.raises(SystemExit):
        cli.main(["--peak-gbs", value, "--list"])
    assert "expected a positive number" in capsys.readouterr().err
