"""Tests of ``normkit lab``: every experiment's tiny profile, the report, resume, the CLI.

One module-scoped fixture runs the tiny profile of every experiment once (one CPU
thread, no progress display) into a temporary folder; the other tests read it. Nothing
here asserts what a verdict is: only that it is computed from the data.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from normkit.lab import cli  # noqa: E402
from normkit.lab.experiments import EXPERIMENTS, get_experiment  # noqa: E402
from normkit.lab.report import COMPARISON_ROWS, write_report  # noqa: E402
from normkit.lab.runner import execute, run_plan  # noqa: E402
from normkit.lab.store import RESULTS, ResultStore, deterministic_view  # noqa: E402
from normkit.lab.verdict import MIXED, NOT_REPRODUCED, REPRODUCED  # noqa: E402

VERDICTS = {REPRODUCED, NOT_REPRODUCED, MIXED}


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_lab(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("lab-tiny")
        outcome = run_plan(EXPERIMENTS, "tiny", 0, out, progress="none", log=lambda s: None)
        report = write_report(out)
    finally:
        torch.set_num_threads(threads)
    return out, outcome, report


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=lambda e: e.name)
def test_tiny_profile_of_every_experiment(tiny_lab, experiment):
    out, outcome, _ = tiny_lab
    assert not outcome.failed
    records = [r for r in outcome.records if r["experiment"] == experiment.name]
    plan = experiment.plan("tiny", 0)
    assert [r["run_id"] for r in records] == [s.run_id for s in plan]
    for r in records:
        assert r["seed"] in {s.seed for s in plan}
        assert r["config"] == next(s.config for s in plan if s.run_id == r["run_id"])
    analysis = experiment.analyze(records)
    assert analysis.complete
    assert [c.id for c in analysis.claims] == [c[0] for c in experiment.claims]
    for claim in analysis.claims:
        assert claim.verdict in VERDICTS
        assert claim.source and claim.checks
        for check in claim.checks:
            assert check.outcome in {"supports", "contradicts", "inconclusive"}
            assert check.effect_text()


def test_every_experiment_states_claims_sources_and_profiles():
    for e in EXPERIMENTS:
        assert e.name and e.title and len(e.summary) > 100, e.name
        assert set(e.settings) == {"tiny", "quick", "full"}, e.name
        for cid, statement, source in e.claims:
            assert cid and statement and source, (e.name, cid)
        # more seeds in the bigger profiles, never fewer
        seeds = [e.settings[p]["seeds"] for p in ("tiny", "quick", "full")]
        assert seeds == sorted(seeds) and seeds[1] >= 2, e.name


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.external, self.tags = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        for key in ("src", "href"):
            value = attrs.get(key) or ""
            if re.match(r"^(https?:)?//", value):
                self.external.append(value)


def test_report_html_is_self_contained_with_every_figure(tiny_lab):
    out, _, report = tiny_lab
    assert not report.problems
    parser = _Images()
    parser.feed((out / "report.html").read_text(encoding="utf-8"))
    parser.close()
    assert parser.external == []
    assert "script" not in parser.tags and "link" not in parser.tags
    assert len(parser.images) == len(EXPERIMENTS)
    for src in parser.images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        assert base64.b64decode(src[len(prefix):])[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_markdown_has_table_figures_and_a_verdict_per_claim(tiny_lab):
    out, _, report = tiny_lab
    text = (out / "report.md").read_text(encoding="utf-8")
    assert "| property | article: BN | article: LN | measured: BN | measured: LN |" in text
    for _, prop, _, _ in COMPARISON_ROWS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {prop} |"))
        assert "not measured" not in row, row
        assert row.rstrip(" |").rsplit("|", 1)[-1].strip() in VERDICTS, row
    for e in EXPERIMENTS:
        assert f"(figures/{e.name}.png)" in text
        assert (out / "figures" / f"{e.name}.png").read_bytes()[:4] == b"\x89PNG"
        for cid, _, _ in e.claims:
            assert re.search(rf"### Claim `{re.escape(cid)}`: "
                             rf"({'|'.join(VERDICTS)})\n", text), cid
    assert {c.id for c in report.claims} == {c[0] for e in EXPERIMENTS for c in e.claims}


def test_verdicts_follow_the_data_not_the_claim(tiny_lab):
    # Swap the measurements of raw and standardized inputs: the verdict must follow.
    _, outcome, _ = tiny_lab
    exp = get_experiment("inputs")
    records = [r for r in outcome.records if r["experiment"] == "inputs"]
    before = exp.analyze(records).claims[0]
    swapped = []
    for r in records:
        other = "raw" if r["config"]["scaling"] == "standardized" else "standardized"
        swapped.append({**r, "config": {**r["config"], "scaling": other}})
    after = exp.analyze(swapped).claims[0]
    for a, b in zip(before.checks, after.checks, strict=True):
        assert a.summary.mean == pytest.approx(-b.summary.mean)
    flipped = {REPRODUCED: NOT_REPRODUCED, NOT_REPRODUCED: REPRODUCED, MIXED: MIXED}
    if all(c.outcome != "inconclusive" for c in before.checks):
        assert after.verdict == flipped[before.verdict]


def test_a_run_depends_only_on_its_seed_and_config():
    torch.set_num_threads(1)
    exp = get_experiment("bn-learning-rate")
    spec = exp.plan("tiny", 3)[1]
    first = deterministic_view(execute(exp, spec))
    execute(exp, exp.plan("tiny", 4)[0])  # something else in between
    assert deterministic_view(execute(exp, spec)) == first


def test_resume_after_interruption_recomputes_only_unfinished_runs(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    exp = get_experiment("inputs")
    calls = []
    original = type(exp).run
    monkeypatch.setattr(type(exp), "run",
                        lambda self, c, s, cb=None: calls.append(c["scaling"])
                        or original(self, c, s, cb))
    quiet = {"progress": "none", "log": lambda s: None}
    run_plan([exp], "tiny", 0, tmp_path, **quiet)
    assert calls == ["raw", "standardized"]
    path = tmp_path / RESULTS
    first, second = _lines(path)
    # interrupted while writing the second record: half a line on disk
    path.write_text(first + "\n" + second[: len(second) // 2])
    calls.clear()
    with pytest.warns(UserWarning, match="not a complete lab record"):
        outcome = run_plan([exp], "tiny", 0, tmp_path, **quiet)
    assert calls == ["standardized"] and outcome.skipped == 1
    lines = _lines(path)
    assert lines[0] == first and len(lines) == 2
    assert deterministic_view(json.loads(lines[1])) == deterministic_view(json.loads(second))
    calls.clear()
    run_plan([exp], "tiny", 0, tmp_path, **quiet)
    assert calls == []
    run_plan([exp], "tiny", 0, tmp_path, force=True, **quiet)
    assert calls == ["raw", "standardized"]
    assert len(ResultStore(tmp_path).load()) == 2


def test_store_appends_on_a_new_line_after_a_cut_line(tmp_path):
    store = ResultStore(tmp_path)
    (tmp_path / RESULTS).write_text('{"run_id": "a"}\n{"run_id": "b", "res')
    store.append({"run_id": "c", "result": {"x": float("inf")}})
    with pytest.warns(UserWarning):
        records = store.load()
    assert sorted(records) == ["a", "c"] and records["c"]["result"]["x"] is None


def _cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_cli_list_names_every_experiment_and_claim():
    code, out, _ = _cli("list")
    assert code == 0
    for e in EXPERIMENTS:
        assert e.name in out
        for cid, _, _ in e.claims:
            assert cid in out


def test_cli_usage_errors_say_what_was_expected(tmp_path):
    code, _, err = _cli("run", "no-such-experiment", "--out", str(tmp_path))
    assert code == 2 and "expected one of inputs, bn-learning-rate" in err
    code, _, err = _cli("report", str(tmp_path))
    assert code == 2 and "expected a normkit lab output folder with manifest.json" in err
    code, _, err = _cli("--profile", "huge")
    assert code == 2 and "invalid choice: 'huge'" in err
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for out in (a_file, a_file / "sub"):  # before any run starts, the file untouched
        code, _, err = _cli("run", "invariances", "--profile", "tiny", "--out", str(out))
        assert code == 2 and "--out expected an output folder it can write" in err, err
        assert "is a file, not a folder" in err
    assert a_file.read_text() == "mine"


def test_cli_run_writes_report_and_resumes(tmp_path):
    args = ("run", "invariances", "--profile", "tiny", "--out", str(tmp_path), "--threads",
            "1", "--progress", "plain")
    code, out, err = _cli(*args)
    assert code == 0, err
    assert "reproduced" in out and (tmp_path / "report.html").exists()
    assert "[1/1] invariances/check=table1/seed=0 done" in err
    code, out, err = _cli(*args)
    assert code == 0 and "1 already recorded" in err and "0 to run" in err
    code, out, _ = _cli("report", str(tmp_path))
    assert code == 0 and "Report:" in out


def test_the_transformer_experiments_norms_are_what_they_say():
    """BatchNorm over the batch's tokens is torch's BatchNorm1d on the (N*T, C) view
    (output and running statistics); every norm of the classifier is the one named."""
    import normkit
    from normkit.lab.models import TokenBatchNorm, TransformerClassifier

    x = torch.randn(4, 5, 6) * 3 + 1
    ours, theirs = TokenBatchNorm(6), torch.nn.BatchNorm1d(6)
    torch.testing.assert_close(ours(x), theirs(x.reshape(-1, 6)).view(4, 5, 6))
    torch.testing.assert_close(ours.bn.running_var, theirs.running_var)
    kinds = {"ln": normkit.LayerNorm, "bn": TokenBatchNorm, "pn": normkit.PowerNorm,
             "none": torch.nn.Identity}
    for name, cls in kinds.items():
        model = TransformerClassifier(name, features=8, tokens=8, warmup_iters=3)
        norms = [model.norm] + [m for b in model.blocks for m in (b.norm1, b.norm2)]
        assert len(norms) == 5 and all(type(m) is cls for m in norms), name
        if name == "pn":
            assert {m.warmup_iters for m in norms} == {3}


def test_the_ln_init_experiments_models_differ_in_beta_alone():
    """The beta = 0.1 model is the beta = 0 model with every LayerNorm's bias at 0.1 (all
    8 feed a ReLU), nothing else changed; the dead-unit count reads each ReLU."""
    import normkit
    from normkit.lab.experiments.ln_init import dead_units
    from normkit.lab.models import mlp

    torch.manual_seed(3)
    plain = mlp("ln", depth=8, width=16)
    torch.manual_seed(3)
    lifted = mlp("ln", depth=8, width=16)
    done = normkit.init_norms_(lifted, bias_before_relu=0.1)
    assert len(done) == 8 and all("before ReLU" in what for what in done.values())
    for (name, a), b in zip(plain.state_dict().items(), lifted.state_dict().values(),
                            strict=True):
        is_ln_bias = name.endswith(".bias") and isinstance(plain.get_submodule(
            name.rsplit(".", 1)[0]), torch.nn.LayerNorm)
        assert torch.equal(b, torch.full_like(a, 0.1) if is_ln_bias else a), name
    x = torch.randn(50, 64)
    shares = dead_units(plain, x)
    assert len(shares) == 8 and all(0.0 <= s <= 100.0 for s in shares)
    with torch.no_grad():
        plain[-3].bias.fill_(-1e3)  # (the last LayerNorm's shift: its ReLU all dead)
    assert dead_units(plain, x)[-1] == 100.0


#: The checked-in run of the quick profile (README: "This repository's run").
CHECKED_IN = Path(__file__).resolve().parent.parent / "docs" / "lab-report" / RESULTS


def test_the_checked_in_report_is_what_this_code_computes():
    """The cheapest quick-profile run of every experiment (``cost`` aside: it times),
    rerun here, gives the checked-in record bit for bit -- where torch's version and
    CPU kernels are the ones it was made with (a record's bits depend on them). A
    failure means a change altered the lab's numerics and docs/lab-report is stale:
    rerun it (``python -m normkit lab run all --force --out docs/lab-report``) and
    read the verdicts again."""
    from normkit.lab.runner import cpu_capability

    checked_in = {}
    for line in _lines(CHECKED_IN):
        record = json.loads(line)
        checked_in[record["run_id"]] = record
    torch.set_num_threads(1)
    compared = 0
    for exp in EXPERIMENTS:
        if exp.name == "cost":
            continue
        spec = min((s for s in exp.plan("quick", 0) if s.seed == 0), key=lambda s: s.cost)
        want = checked_in.get(spec.run_id)
        assert want is not None, f"{spec.run_id} is not in {CHECKED_IN}"
        if want.get("torch") != torch.__version__ or want.get("cpu") != cpu_capability():
            continue
        got = execute(exp, spec)
        assert got["result"] == want["result"], (
            f"{spec.run_id}: the checked-in record differs from this code's: rerun "
            f"docs/lab-report")
        compared += 1
    if not compared:
        pytest.skip(f"docs/lab-report was made with another torch or CPU (torch "
                    f"{torch.__version__}, {cpu_capability()} kernels here)")


def test_the_half_precision_experiments_precisions_are_what_they_say(monkeypatch):
    """float16: every parameter and buffer in float16 (running statistics included);
    norms in float32: the norm layers' in float32, the rest float16; the error with batch
    statistics leaves the running ones as training left them; the verdicts follow the
    errors (BatchNorm's float16 rise at the raw scale only: mixed, and the float32 norms
    remove it)."""
    from normkit.lab.experiments import half_precision as hp

    seen = {}

    def fake_train(model, data, config, seed, on_step=None, **options):
        seen[config["precision"]] = (model, data.x_train.dtype)
        return {"final_test_acc": 0.5, "n_test": data.n_test}

    monkeypatch.setattr(hp, "train_configured", fake_train)
    exp = hp.HalfPrecision()
    for spec in exp.plan("tiny", 0):
        if spec.config["norm"] == "bn" and spec.config["scale"] == hp.RAW_SCALE:
            out = exp.run(spec.config, spec.seed)
            assert out["running_var"] == {"max_finite": 1.0, "infinite": 0, "channels": 48}
    norm_types = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm)
    for precision, (_, dtype, norms_float32) in hp.PRECISIONS.items():
        model, data_dtype = seen[precision]
        assert data_dtype == dtype
        for module in model.modules():
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            floating = [t for t in tensors if t.is_floating_point()]
            want = torch.float32 if norms_float32 and isinstance(module, norm_types) else dtype
            assert all(t.dtype == want for t in floating), (precision, module)

    def record(seed, scale, norm, precision, acc):
        return {"seed": seed, "config": {"scale": scale, "norm": norm, "precision": precision,
                                         "steps": 200},
                "result": {"final_test_acc": acc, "batch_stats_test_acc": 0.98, "n_test": 450,
                           "statistics_warnings": 0,
                           "running_var": {"max_finite": 1.0, "infinite": 0, "channels": 48}}}

    def records(broken):
        out = []
        for seed in range(3):
            for _, c, _ in exp.configs(exp.profile_settings("quick")):
                acc = 0.98 - 0.002 * seed
                if broken and (c["scale"], c["norm"], c["precision"]) == (
                        hp.RAW_SCALE, "bn", "float16"):
                    acc = 0.1
                out.append(record(seed, c["scale"], c["norm"], c["precision"], acc))
        return out

    verdicts = {c.id: c.verdict for c in exp.analyze(records(True)).claims}
    assert verdicts == {"hp.bn_special": "mixed", "hp.bn_float32": "reproduced"}
    verdicts = {c.id: c.verdict for c in exp.analyze(records(False)).claims}
    assert verdicts == {"hp.bn_special": "not reproduced", "hp.bn_float32": "not reproduced"}
