"""Tests of the quickstart (normkit.quickstart) and the command line (python -m normkit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")

import normkit  # noqa: E402
from normkit import cli, quickstart  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def _run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "normkit", *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


@pytest.fixture(scope="module")
def data():
    return quickstart.load_digits_tensors(seed=0)


def test_cli_quickstart_prints_table():
    proc = _run_cli("quickstart", "--epochs", "1", "--norms", "bn,gn", "--batch-sizes", "32")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    header = next(line for line in out.splitlines() if line.startswith("norm "))
    assert [c.strip() for c in header.split("|")] == [
        "norm", "batch size", "test accuracy", "final train loss", "s/epoch",
    ]
    rows = [line.split("|") for line in out.splitlines() if line.startswith(("bn ", "gn "))]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("bn", "32"), ("gn", "32")]
    for row in rows:
        assert 0.0 <= float(row[2].strip().rstrip("%")) <= 100.0
    assert "Drop-in check" in out
    assert "Best test accuracy: batch 32:" in out


def test_cli_without_subcommand_prints_usage(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: normkit")
    assert "quickstart" in err


def test_cli_version_and_unknown_options(capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["--version"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"normkit {normkit.__version__} (torch {torch.__version__}, Python ")
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["--verbose"])
    assert excinfo.value.code == 2
    assert "normkit: error: unrecognized arguments: --verbose" in capsys.readouterr().err


def test_cli_unknown_norm_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["quickstart", "--norms", "bn,not_a_norm", "--epochs", "1"])
    assert excinfo.value.code == 2
    captured = capsys.readouterr()
    assert "normkit quickstart: error: unknown norm 'not_a_norm'" in captured.err
    assert "bn, " in captured.err  # the message lists the known names
    assert captured.out == ""


def test_main_rejects_norm_that_does_not_fit_images(capsys):
    with pytest.raises(SystemExit) as excinfo:
        quickstart.main(["--norms", "bn1d", "--epochs", "1"])
    assert excinfo.value.code == 2
    assert "'bn1d' does not fit" in capsys.readouterr().err


def test_check_drop_in_matches_torch():
    assert quickstart.check_drop_in(seed=0) < 1e-4


def test_train_is_deterministic(data):
    results = []
    for _ in range(2):
        torch.manual_seed(1)
        model = quickstart.make_cnn("bn")
        results.append(quickstart.train(model, data, epochs=1, batch_size=32, lr=0.05, seed=1))
    assert results[0]["test_accuracy"] == results[1]["test_accuracy"]
    assert results[0]["final_train_loss"] == results[1]["final_train_loss"]


def test_split_is_stratified_and_standardized(data):
    x_train, y_train, x_test, y_test = data
    assert x_train.shape[1:] == x_test.shape[1:] == (1, 8, 8)
    assert x_train.dtype == torch.float32
    assert len(x_train) + len(x_test) == 1797
    train_share = torch.bincount(y_train) / (torch.bincount(y_train) + torch.bincount(y_test))
    assert torch.all((train_share - 0.75).abs() < 0.01)
    assert abs(x_train.mean().item()) < 1e-5
    assert abs(x_train.std().item() - 1.0) < 1e-5


def test_run_uses_the_same_budget_and_scales_lr(data):
    rows = quickstart.run(norms=("none",), batch_sizes=(64, 16), epochs=1, data=data)
    assert [(r["batch_size"], r["lr"], r["epochs"]) for r in rows] == [
        (64, 0.1, 1), (16, 0.025, 1),
    ]
    assert rows[0]["steps"] == 22 and rows[1]["steps"] == 85
