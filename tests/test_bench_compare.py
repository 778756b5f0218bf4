"""Saved bench runs before and after a change (normkit.bench.compare, ``--compare``), and
the commit a run records (``environment["normkit_commit"]``)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from normkit.bench import cli, compare, runner


def _run(rows, *, commit=None, dtype="float32"):
    """A saved run: ``rows`` of ``(op, shape, layout, pass, threads, ratio)``."""
    return {"environment": {"device": "cpu", "dtype": dtype, "param_dtype": dtype,
                            "normkit_commit": commit},
            "results": [{"op": op, "shape": list(shape), "layout": layout, "pass": pass_,
                         "threads": threads, "impls": {"torch": {"ratio": 1.0},
                                                       "normkit": {"ratio": ratio}}}
                        for op, shape, layout, pass_, threads, ratio in rows]}


def _rows(ratios):
    """One run's three rows with these normkit ratios."""
    a, b, c = ratios
    return [("group_norm", (32, 64, 56, 56), "channels_last", "fwd", 2, a),
            ("group_norm", (32, 64, 56, 56), "channels_last", "fwd+bwd", 2, b),
            ("layer_norm", (4096, 768), "contiguous", "fwd", 1, c)]


BEFORE = [_run(_rows((0.50, 1.70, 0.90)), commit="aaaa111"),
          _run(_rows((0.58, 1.80, 0.95)), commit="aaaa111")]
AFTER = [_run(_rows((0.60, 1.50, 0.93)), commit="bbbb222"),
         _run(_rows((0.70, 1.60, 0.97)), commit="bbbb222")]


def test_compare_pools_each_side_and_trusts_only_separate_ranges():
    rows = compare.compare(BEFORE, AFTER)
    assert [(r["op"], r["pass"], r["verdict"]) for r in rows] == [
        ("group_norm", "fwd", "faster"), ("group_norm", "fwd+bwd", "slower"),
        ("layer_norm", "fwd", "within noise")]
    first = rows[0]
    assert first["shape"] == (32, 64, 56, 56) and first["layout"] == "channels_last"
    assert first["before"] == (0.50, 0.58) and first["after"] == (0.60, 0.70)
    assert first["runs"] == (2, 2)
    assert first["change"] == pytest.approx(0.65 / 0.54)
    # a row wholly equal on both sides is within the noise, not faster or slower
    assert compare.compare(BEFORE, BEFORE)[0]["verdict"] == "within noise"


def test_compare_markdown_names_both_sides_and_the_rows_of_one_side_only():
    extra = _run(_rows((0.6, 1.6, 0.9)) + [("rms_norm", (7, 33), "contiguous", "fwd", 1, 0.7)],
                 commit="bbbb222")
    lines = compare.markdown_lines(BEFORE, [*AFTER, extra])
    text = "\n".join(lines)
    assert "before 2 run(s), aaaa111; after 3 run(s), bbbb222" in lines[0]
    assert ("| group_norm | 32x64x56x56 cl | fwd | 2 | 0.50-0.58x | 0.60-0.70x | 1.11 | "
            "faster |") in lines
    assert "| layer_norm | 4096x768 | fwd | 1 | 0.90-0.95x | 0.90-0.97x |" in text
    assert "Measured after only: rms_norm 7x33 fwd 1t." in lines
    assert lines[-1] == "3 rows: 1 faster, 1 slower, 1 within noise."
    changed = compare.markdown_lines(BEFORE, AFTER, changed_only=True)
    assert not any("layer_norm" in line for line in changed)
    assert sum(line.startswith("| group_norm") for line in changed) == 2
    unchanged = compare.markdown_lines(BEFORE, BEFORE, changed_only=True)
    assert "| (no row changed beyond the noise) | | | | | | | |" in unchanged
    unknown = compare.markdown_lines([_run(_rows((1, 1, 1)))], [_run(_rows((1, 1, 1)))])
    assert "before 1 run(s), commit not recorded" in unknown[0]


@pytest.mark.parametrize(("before", "after", "message"), [
    ([], AFTER, "at least one run on each side, got 0 before and 2 after"),
    (BEFORE, [], "got 2 before and 0 after"),
    (BEFORE, [_run(_rows((1, 1, 1)), dtype="bfloat16")], "differ in dtype (bfloat16, float32)"),
])
def test_compare_refuses_what_it_cannot_compare(before, after, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compare.compare(before, after)


def _save(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_cli_compare_prints_and_writes_the_table(tmp_path, capsys):
    before = [_save(tmp_path, f"before-{i}.json", doc) for i, doc in enumerate(BEFORE)]
    after = [_save(tmp_path, f"after-{i}.json", doc) for i, doc in enumerate(AFTER)]
    table = tmp_path / "compare.md"
    assert cli.main(["--compare", *before, "--to", *after, "--changed-only",
                     "--markdown", str(table)]) == 0
    out = capsys.readouterr().out
    assert "| group_norm | 32x64x56x56 cl | fwd+bwd | 2 | 1.70-1.80x | 1.50-1.60x |" in out
    assert "layer_norm" not in out.split("\n\n")[1]
    assert table.read_text() == out


@pytest.mark.parametrize(("args", "message"), [
    (["--compare", "{before}"], "needs --to AFTER.json"),
    (["--to", "{after}"], "--to needs --compare BEFORE.json"),
    (["--compare", "{missing}", "--to", "{after}"], "--compare could not read"),
    (["--compare", "{before}", "--to", "{bad}"],
     "--to expected the JSON of a normkit bench run"),
    (["--compare", "{before}", "--to", "{half}"], "differ in dtype"),
])
def test_cli_compare_usage_errors(tmp_path, capsys, args, message):
    paths = {"before": _save(tmp_path, "before.json", BEFORE[0]),
             "after": _save(tmp_path, "after.json", AFTER[0]),
             "missing": str(tmp_path / "missing.json"),
             "bad": _save(tmp_path, "bad.json", {"results": []}),
             "half": _save(tmp_path, "half.json", _run(_rows((1, 1, 1)), dtype="float16"))}
    with pytest.raises(SystemExit) as exit_info:
        cli.main([arg.format(**paths) for arg in args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_runs_record_the_commit_they_measured(monkeypatch):
    commit = runner.source_commit()
    # this checkout is a git clone in CI and here; an installed wheel would say None
    if commit is not None:
        assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", commit)
    assert runner.environment(runner.BenchConfig(shapes="small"))["normkit_commit"] == commit

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert runner.source_commit() is None

    def untracked(cmd, **kwargs):  # a copy of the package inside some other repository
        return subprocess.CompletedProcess(cmd, 1 if "ls-files" in cmd else 0, "abc1234\n", "")

    monkeypatch.setattr(subprocess, "run", untracked)
    assert runner.source_commit() is None

    def modified(cmd, **kwargs):
        out = " M layer.py\n" if "status" in cmd else "abc1234def00\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(subprocess, "run", modified)
    assert runner.source_commit() == "abc1234def00+dirty"


def test_report_names_the_commit_a_run_measured():
    """The Markdown report's software line carries ``normkit_commit`` when the run has one."""
    import normkit
    from normkit.bench import report

    version = normkit.__version__
    doc = runner.run(runner.BenchConfig(ops=("layer_norm",), shapes="4x8", repeats=2,
                                        warmup=0, min_time=0.0, copy_mib=1))
    doc["environment"]["normkit_commit"] = "abc1234def00+dirty"
    assert f", normkit {version} at abc1234def00+dirty, Python " in report.to_markdown(doc)
    doc["environment"]["normkit_commit"] = None
    text = report.to_markdown(doc)
    assert f", normkit {version}, Python " in text and " at None" not in text
