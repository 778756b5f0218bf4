"""``normkit lab compare`` on a small model and data defined in tests/lab_models.py."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from normkit.lab import cli  # noqa: E402

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(TESTS), *sys.path])
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_compare_trains_each_norm_at_each_batch_size_and_recommends(tmp_path):
    code, out, err = _cli(
        "compare", "--model", "lab_models:make_model", "--data", "lab_models:make_loaders",
        "--norms", "bn,gn,none", "--batch-sizes", "16,4", "--epochs", "1", "--seeds", "1",
        "--out", str(tmp_path), "--threads", "1", "--progress", "none")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text()
               .splitlines()]
    assert sorted((r["config"]["norm"], r["config"]["batch_size"]) for r in records) == [
        ("bn", 4), ("bn", 16), ("gn", 4), ("gn", 16), ("none", 4), ("none", 16)]
    for r in records:
        assert r["result"]["error"] is None and r["result"]["n_test"] == 128
        assert r["config"]["lr"] == pytest.approx(0.05 * r["config"]["batch_size"] / 16)
        assert r["result"]["steps"] == 256 // r["config"]["batch_size"]
    text = (tmp_path / "report.md").read_text()
    assert "**Recommendation**" in text and "batch 16: **" in text and "batch 4: **" in text
    assert "(figures/compare.png)" in text
    assert text.count("data:image/png;base64,") == 0
    assert (tmp_path / "report.html").read_text().count("data:image/png;base64,") == 1
    # the report can be rebuilt from the folder alone
    code, out, _ = _cli("report", str(tmp_path))
    assert code == 0 and "Report:" in out


@pytest.mark.parametrize("model, chosen", [("make_model", "bn, gn, ln, none"),
                                           ("make_mlp", "ln, rms, none")])
def test_compare_without_norms_takes_the_families_the_model_can(model, chosen, tmp_path):
    """The default --norms was bn,gn,ln,none, which a Transformer-style model (last-dim
    LayerNorms) cannot take: the command failed before training with its defaults. Now
    the default is the families every norm layer of the model can become, said up front;
    the report names the user's data (it said the lab's digits and synthetic tasks) and a
    single seed's result without a "± 0" spread it did not measure."""
    code, out, err = _cli(
        "compare", "--model", f"lab_models:{model}", "--data", "lab_models:make_loaders",
        "--batch-sizes", "8", "--epochs", "1", "--seeds", "1", "--out", str(tmp_path),
        "--threads", "1", "--progress", "none")
    assert code == 0, err
    assert f"comparing {chosen} (the families every norm layer" in out
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text()
               .splitlines()]
    assert sorted(r["config"]["norm"] for r in records) == sorted(chosen.split(", "))
    text = (tmp_path / "report.md").read_text()
    assert "data: yours, from `lab_models:make_loaders`." in text
    assert "digits and synthetic" not in text and "± 0 |" not in text


def test_compare_without_norms_and_no_family_that_fits(tmp_path):
    code, _, err = _cli("compare", "--model", "torch.nn:Identity", "--data",
                        "lab_models:make_loaders", "--out", str(tmp_path))
    assert code == 2 and "--norms: no family fits every norm layer of the model" in err


def test_compare_rejects_norms_the_model_cannot_take(tmp_path):
    code, _, err = _cli(
        "compare", "--model", "lab_models:make_model", "--data", "lab_models:make_loaders",
        "--norms", "bn,rms", "--out", str(tmp_path), "--progress", "none")
    assert code == 2
    assert "--norms 'rms'" in err and "expected one of bn, gn, in, ln/ln2d, none" in err


def test_compare_reports_a_bad_spec_in_the_callers_terms(tmp_path):
    code, _, err = _cli("compare", "--model", "lab_models:nope", "--data",
                        "lab_models:make_loaders", "--out", str(tmp_path))
    assert code == 2
    assert "expected module 'lab_models' to define 'nope'" in err


def test_compare_takes_a_models_logits_from_its_output_object(tmp_path):
    """Hugging Face models return an output object with ``.logits``: compare trained
    nothing (a TypeError traceback per run) before."""
    code, out, err = _cli(
        "compare", "--model", "lab_models:make_hf_style_model", "--data",
        "lab_models:make_loaders", "--norms", "bn,gn", "--batch-sizes", "16", "--epochs", "1",
        "--seeds", "1", "--out", str(tmp_path), "--threads", "1", "--progress", "none")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text()
               .splitlines()]
    assert [r["result"]["error"] for r in records] == [None, None]
    assert all(r["result"]["test_acc"] is not None for r in records)


def test_one_test_example_apart_is_a_tie_whatever_the_rounding():
    from normkit.lab.compare import CompareExperiment

    experiment = CompareExperiment("m:f", "d:f", ["ln", "rms", "none"], [32], seeds=1)
    n_test = 297  # 100/297 points per example: the differences round either way
    records = [{"config": {"norm": norm, "batch_size": 32}, "seed": 0,
                "result": {"error": None, "diverged": False, "classification": True,
                           "n_test": n_test, "test_acc": correct / n_test, "test_loss": 1.0}}
               for norm, correct in (("ln", 28), ("rms", 29), ("none", 28))]
    notes = "\n".join(experiment.analyze(records).notes)
    assert "**Recommendation** (best, or tied with the best, at the most batch sizes): " \
           "**ln, rms, none**." in notes, notes
