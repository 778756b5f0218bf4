"""The report: ``report.md`` and a self-contained ``report.html`` from the records.

:func:`write_report` reads an output folder (``manifest.json`` + ``results.jsonl``),
analyses each experiment's records (:meth:`normkit.lab.core.Experiment.analyze`) and
writes

* ``report.md``: verdicts, the articles' BN-vs-LN comparison table filled with measured
  values (each cell names the experiment that measured it), and a section per
  experiment with its claim, source, settings, seeds, figure, tables and the checks
  behind each verdict; figures are PNG files in ``figures/``;
* ``report.html``: the same, with the figures embedded as base64 PNG and the style
  inline, so it opens offline in any browser.

The report is a pure function of the records (no dates, no host names), so equal
records give equal reports; wall-clock values (times per step, the cost experiment)
are the only measurements that change from run to run.

Example:
    >>> blocks = [Heading(1, "Title"), Para("Some **bold** and `code`."),
    ...           TableBlock(["a", "b"], [["1", "x|y"]])]
    >>> print(render_markdown(blocks))
    # Title
    <BLANKLINE>
    Some **bold** and `code`.
    <BLANKLINE>
    | a | b |
    |---|---|
    | 1 | x\\|y |
    <BLANKLINE>
    >>> "<strong>bold</strong>" in render_html(blocks, "Title")
    True
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .._files import write_text_atomic
from .core import ARTICLE_BN_LN, ARTICLE_NORM, Analysis, Experiment
from .store import ResultStore, read_manifest
from .verdict import (
    CONTRADICTS,
    INCONCLUSIVE,
    MIXED,
    NOT_REPRODUCED,
    REPRODUCED,
    SUPPORTS,
    Claim,
    combine_verdicts,
)

__all__ = [
    "COMPARISON_ROWS", "Heading", "Para", "TableBlock", "Image", "Bullets",
    "render_markdown", "render_html", "build_report", "write_report", "ReportResult",
    "VERDICT_RULE", "rst_to_markdown",
]

#: The articles' BN-vs-LN table (《深度学习归一化技术：BN与LN原理及应用对比》 §4.1):
#: ``(key, property, BN says, LN says)``.
COMPARISON_ROWS = (
    ("dims", "归一化维度 normalized dimensions", "批次×空间维度 batch × spatial",
     "特征维度 feature dimensions"),
    ("batch", "对小批次大小的敏感性 sensitivity to small batches",
     "高 high (needs a large batch)", "低 low (independent of the batch size)"),
    ("fit", "适合的网络类型 suited networks", "CNN", "RNN/Transformer"),
    ("train_eval", "训练/推理差异 train/inference difference", "有 yes (running averages)",
     "无 none (same computation)"),
    ("compute", "计算开销 compute overhead", "较低 lower", "略高 slightly higher"),
    ("regularization", "正则化效果 regularization effect", "较强 stronger", "较弱 weaker"),
)

VERDICT_RULE = (
    "Each claim is tested by one or more checks: one comparison in one setting, measured "
    "once per seed, oriented so that a positive effect supports the claim. A check "
    "**supports** the claim when the mean effect exceeds the metric's resolution and every "
    "seed shows it in the claimed direction, **contradicts** it in the mirror case, and is "
    "**inconclusive** otherwise. Resolutions are fixed per kind of metric, never per claim: "
    "one test image for accuracies, 10 % (0.1375 in log2) for ratios of steps, losses, "
    "drifts and times, 1e-6 relative for exact float64 checks. A claim is **reproduced** "
    "when all its checks support it, **not reproduced** when none does, **mixed** otherwise. "
    "Effects are given as mean ± standard deviation over seeds (n seeds, range)."
)

_OUTCOME_MARK = {SUPPORTS: "✔ supports", CONTRADICTS: "✘ contradicts",
                 INCONCLUSIVE: "– inconclusive"}
_VERDICT_STYLE = {REPRODUCED: "ok", NOT_REPRODUCED: "bad", MIXED: "mixed"}


# --------------------------------------------------------------------------- blocks


@dataclass
class Heading:
    """A heading of ``level`` (1-3); ``anchor`` is the HTML id (default: from the text)."""

    level: int
    text: str
    anchor: str | None = None


@dataclass
class Para:
    """A paragraph; ``**bold**`` and ```code``` are the only inline markup."""

    text: str


@dataclass
class TableBlock:
    """A table with a header row; ``caption`` goes above it."""

    header: list[str]
    rows: list[list[str]]
    caption: str = ""
    classes: list[str] = field(default_factory=list)


@dataclass
class Image:
    """A PNG figure: ``name`` is its file name under ``figures/``."""

    name: str
    png: bytes
    caption: str


@dataclass
class Bullets:
    """A bullet list."""

    items: list[str]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


def rst_to_markdown(text: str) -> str:
    """Docstring markup to markdown: ``:role:`x``` and double backticks become `x`.

    Example:
        >>> rst_to_markdown("see :func:`normkit.weight_norm` and ``x = 1``")
        'see `normkit.weight_norm` and `x = 1`'
    """
    text = re.sub(r":(?:class|func|data|meth|mod|attr):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list, figure_dir: str = "figures") -> str:
    """The blocks as GitHub-flavoured markdown (figures as links to ``figure_dir``)."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}")
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {item}" for item in b.items))
        elif isinstance(b, TableBlock):
            lines = [f"*{b.caption}*", ""] if b.caption else []
            lines.append("| " + " | ".join(_md_cell(h) for h in b.header) + " |")
            lines.append("|" + "|".join("---" for _ in b.header) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            out.append(f"![{b.caption}]({figure_dir}/{b.name})\n\n*{b.caption}*")
        else:
            raise TypeError(f"unknown report block {type(b).__name__}")
        out.append("")
    return "\n".join(out)


def _inline(text: str) -> str:
    text = html.escape(str(text), quote=False)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"(?<![\w*])\*([^*\n]+)\*(?![\w*])", r"<em>\1</em>", text)


_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC",sans-serif;
max-width:1100px;margin:2em auto;padding:0 1em;color:#1f2328;line-height:1.5}
h1{border-bottom:2px solid #d0d7de;padding-bottom:.3em}h2{border-bottom:1px solid #d0d7de;
padding-bottom:.2em;margin-top:2em}table{border-collapse:collapse;margin:.6em 0 1.2em;
font-size:.9em}th,td{border:1px solid #d0d7de;padding:.3em .6em;vertical-align:top;
text-align:left}th{background:#f6f8fa}caption{caption-side:top;text-align:left;
font-style:italic;padding:.2em 0}code{background:#f6f8fa;padding:.1em .3em;border-radius:4px}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #d0d7de}
figcaption{font-style:italic;color:#57606a}.ok{color:#1a7f37;font-weight:600}
.bad{color:#cf222e;font-weight:600}.mixed{color:#9a6700;font-weight:600}
nav ul{columns:2}
"""


def _html_cell(text: str) -> str:
    inner = _inline(text)
    for verdict, cls in _VERDICT_STYLE.items():
        if str(text).strip().lower() == verdict:
            return f'<span class="{cls}">{inner}</span>'
    return inner


def render_html(blocks: list, title: str) -> str:
    """The blocks as one self-contained HTML page (inline CSS, base64 PNG figures)."""
    body: list[str] = []
    toc = [b for b in blocks if isinstance(b, Heading) and b.level == 2]
    for b in blocks:
        if isinstance(b, Heading):
            anchor = b.anchor or _slug(b.text)
            body.append(f'<h{b.level} id="{html.escape(anchor)}">{_inline(b.text)}</h{b.level}>')
            if b.level == 1 and toc:
                items = "".join(f'<li><a href="#{html.escape(h.anchor or _slug(h.text))}">'
                                f"{_inline(h.text)}</a></li>" for h in toc)
                body.append(f"<nav><ul>{items}</ul></nav>")
        elif isinstance(b, Para):
            body.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, TableBlock):
            cap = f"<caption>{_inline(b.caption)}</caption>" if b.caption else ""
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{_html_cell(c)}</td>" for c in row) + "</tr>"
                           for row in b.rows)
            body.append(f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody>"
                        "</table>")
        elif isinstance(b, Image):
            data = base64.b64encode(b.png).decode("ascii")
            body.append(f'<figure><img alt="{html.escape(b.caption)}" '
                        f'src="data:image/png;base64,{data}"><figcaption>{_inline(b.caption)}'
                        "</figcaption></figure>")
        else:
            raise TypeError(f"unknown report block {type(b).__name__}")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


# --------------------------------------------------------------------------- content


@dataclass
class _Section:
    experiment: Experiment
    entry: dict
    records: list[dict]
    analysis: Analysis | None
    error: str | None
    figure: bytes | None


def _claims_of(sections: list[_Section]) -> list[tuple[_Section, Claim]]:
    return [(s, c) for s in sections if s.analysis is not None for c in s.analysis.claims]


def _verdict_table(sections: list[_Section]) -> TableBlock:
    rows = []
    for s, c in _claims_of(sections):
        counts = c.counts()
        rows.append([f"{c.statement}", c.source, c.verdict,
                     f"{counts[SUPPORTS]}/{len(c.checks)} support, {counts[CONTRADICTS]} "
                     f"contradict", s.experiment.name])
    return TableBlock(["claim", "source", "verdict", "checks", "experiment"], rows)


def _comparison_table(sections: list[_Section]) -> TableBlock:
    claims = {c.id: c for _, c in _claims_of(sections)}
    cells: dict[str, list] = {}
    for s in sections:
        if s.analysis is not None:
            for cell in s.analysis.cells:
                cells.setdefault(cell.row, []).append(cell)
    rows = []
    for key, prop, bn_says, ln_says in COMPARISON_ROWS:
        found = cells.get(key, [])
        if not found:
            rows.append([prop, bn_says, ln_says, "not measured", "not measured", "—", "—"])
            continue
        ids = [cid for cell in found for cid in cell.claim_ids if cid in claims]
        verdict = combine_verdicts([claims[cid].verdict for cid in ids]) if ids else "—"
        rows.append([prop, bn_says, ln_says, "; ".join(c.bn for c in found),
                     "; ".join(c.ln for c in found),
                     ", ".join(dict.fromkeys(f"{c.experiment} ({', '.join(c.claim_ids)})"
                                             for c in found)), verdict])
    return TableBlock(["property", "article: BN", "article: LN", "measured: BN",
                       "measured: LN", "measured by (claims)", "article's cell"], rows,
                      f"The comparison table of {ARTICLE_BN_LN} §4.1, with the values "
                      "measured here; the last column is the verdict of the claims behind "
                      "the row.")


def _settings_text(entry: dict, records: list[dict]) -> list[str]:
    settings = dict(entry.get("settings", {}))
    seeds = sorted({r["seed"] for r in records})
    items = [f"profile `{entry.get('profile', '?')}`, base seed {entry.get('base_seed', '?')}, "
             f"seeds {', '.join(map(str, seeds)) or '—'} ({len(records)} runs)"]
    shown = {k: v for k, v in settings.items() if k != "seeds"}
    if shown:
        items.append("settings: `" + json.dumps(shown, sort_keys=True, ensure_ascii=False)
                     + "`")
    threads = sorted({r.get("threads") for r in records if r.get("threads") is not None})
    wall = sum(r.get("timing", {}).get("wall_s", 0.0) for r in records)
    versions = sorted({r.get("torch") for r in records if r.get("torch")})
    cpus = sorted({r.get("cpu") for r in records if r.get("cpu")})
    kernels = f" (CPU kernels: {', '.join(cpus)})" if cpus else ""
    items.append(f"torch {', '.join(versions) or '?'}{kernels}, CPU threads per run: "
                 f"{', '.join(map(str, threads)) or '?'}; compute time of the runs: "
                 f"{wall:.1f} s (wall clock)")
    return items


def _experiment_blocks(index: int, s: _Section) -> list:
    e = s.experiment
    blocks: list = [Heading(2, f"{index}. {e.title} (`{e.name}`)", _slug(e.name)),
                    Para(rst_to_markdown(" ".join(e.summary.split()))),
                    Bullets(_settings_text(s.entry, s.records))]
    if s.error is not None:
        blocks.append(Para(f"**The analysis failed**: `{s.error}`"))
        return blocks
    a = s.analysis
    if not a.complete:
        planned = len(s.entry.get("run_ids", []))
        blocks.append(Para(f"**Incomplete**: {len(s.records)} of {planned} planned runs have "
                           "records; the numbers below use the seeds whose runs all finished. "
                           "Rerun the same command to finish the missing runs."))
    if s.figure is not None:
        blocks.append(Image(f"{e.name}.png", s.figure, f"Figure {index}: {e.title}."))
    for t in a.tables:
        blocks.append(TableBlock(t.header, t.rows, t.title))
        if t.note:
            blocks.append(Para(t.note))
    for c in a.claims:
        blocks.append(Heading(3, f"Claim `{c.id}`: {c.verdict}"))
        blocks.append(Para(f"**Claim.** {c.statement} *Source: {c.source}.*"))
        rows = [[ch.label, ch.effect_text(), _OUTCOME_MARK[ch.outcome], ch.detail]
                for ch in c.checks]
        blocks.append(TableBlock(["check", "effect (positive supports the claim)", "outcome",
                                  "measured"], rows))
        verdict_line = f"**Verdict: {c.verdict}** ({c.counts()[SUPPORTS]} of {len(c.checks)} " \
                       "checks support the claim)."
        if c.note:
            verdict_line += f" {c.note}"
        blocks.append(Para(verdict_line))
    for note in a.notes:
        blocks.append(Para(note))
    return blocks


def build_report(sections: list[_Section], title: str = "normkit lab report") -> list:
    """The report's blocks for analysed sections (see :func:`write_report`)."""
    blocks: list = [Heading(1, title)]
    claims = _claims_of(sections)
    profiles = sorted({s.entry.get("profile", "?") for s in sections})
    n_runs = sum(len(s.records) for s in sections)
    verdicts = [c.verdict for _, c in claims]
    own = [s.entry.get("settings", {}).get("data") for s in sections
           if s.experiment.name == "compare"]
    data = ("scikit-learn's bundled digits and synthetic tasks (no download)"
            if len(own) < len(sections) else "")
    if own:  # (lab compare: the user's data, named by its --data spec)
        data += ("; " if data else "") + "yours, from " + ", ".join(
            f"`{spec}`" for spec in dict.fromkeys(own))
    intro = (f"{len(sections)} experiment(s), {n_runs} runs, profile "
             f"{', '.join(f'`{p}`' for p in profiles)}. Every number below was measured by "
             f"the runs recorded in `results.jsonl` next to this report; data: {data}.")
    if claims:
        intro += (f" Claims: {verdicts.count(REPRODUCED)} reproduced, "
                  f"{verdicts.count(MIXED)} mixed, {verdicts.count(NOT_REPRODUCED)} not "
                  "reproduced.")
    blocks.append(Para(intro))
    if claims:
        blocks.append(Para(f"Sources: the articles {ARTICLE_NORM} (*All about normalization*) "
                           f"and {ARTICLE_BN_LN} (*Deep-learning normalization: BN vs LN*), and "
                           "the papers they rest on."))
        blocks.append(Heading(2, "Verdicts", "verdicts"))
        blocks.append(_verdict_table(sections))
        blocks.append(Para(VERDICT_RULE))
        if any(s.analysis is not None and s.analysis.cells for s in sections):
            blocks.append(Heading(2, "The articles' BN-vs-LN table, measured", "comparison"))
            blocks.append(_comparison_table(sections))
    for i, s in enumerate(sections, 1):
        blocks += _experiment_blocks(i, s)
    blocks.append(Heading(2, "Reproducing", "reproducing"))
    blocks.append(Para(
        "Results depend only on each run's configuration and seed (and on the number of "
        "torch CPU threads, which splits floating-point reductions); wall-clock times are "
        "the exception. Rerunning a command in the same folder skips the finished runs; "
        "`--force` reruns them. The commands for this report:"))
    blocks.append(Bullets([f"`{_command(s)}`" for s in sections]))
    return blocks


def _command(section: _Section) -> str:
    entry = section.entry
    if section.experiment.name == "compare":
        o = entry.get("options", {})
        return (f"normkit lab compare --model {o.get('model')} --data {o.get('data')} "
                f"--norms {','.join(o.get('norms', []))} --batch-sizes "
                f"{','.join(map(str, o.get('batch_sizes', [])))} --epochs {o.get('epochs')} "
                f"--lr {o.get('lr')} --optimizer {o.get('optimizer')} --seeds {o.get('seeds')}"
                + ("" if o.get("scale_lr", True) else " --no-lr-scaling")
                + f" --seed {entry.get('base_seed', 0)}")
    threads = sorted({r.get("threads") for r in section.records if r.get("threads")})
    return (f"normkit lab run {section.experiment.name} --profile {entry.get('profile')} "
            f"--seed {entry.get('base_seed', 0)}"
            + (f" --threads {threads[0]}" if len(threads) == 1 else ""))


@dataclass
class ReportResult:
    """What :func:`write_report` wrote, and the problems it met."""

    markdown: Path
    html: Path
    figures: list[Path]
    problems: list[str]
    claims: list[Claim]


def _resolve(name: str, entry: dict) -> Experiment:
    if name == "compare":
        from .compare import CompareExperiment

        return CompareExperiment.from_manifest(entry)
    from .experiments import get_experiment

    return get_experiment(name)


def _analyse(experiment: Experiment, entry: dict, records: list[dict]) -> _Section:
    try:
        analysis = experiment.analyze(records)
    except Exception as exc:  # a broken analysis must not hide the other sections
        return _Section(experiment, entry, records, None,
                        f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}", None)
    figure = None
    if records and (analysis.claims or analysis.tables):
        try:
            from .figures import png_bytes

            figure = png_bytes(experiment.figure(analysis))
        except Exception as exc:
            analysis.notes.append(f"(The figure could not be drawn: {type(exc).__name__}: "
                                  f"{exc})")
    return _Section(experiment, entry, records, analysis, None, figure)


def write_report(out_dir: str | os.PathLike, names: list[str] | None = None,
                 title: str = "normkit lab report") -> ReportResult:
    """Analyse the records in ``out_dir`` and write ``report.md``, ``report.html``, figures.

    Args:
        out_dir: an output folder of ``normkit lab`` (with ``manifest.json``).
        names: the experiments to include, in this order (default: every experiment in
            the manifest, in the lab's order).
        title: the report's title.
    """
    out = Path(out_dir)
    manifest = read_manifest(out).get("experiments", {})
    if not manifest:
        raise FileNotFoundError(f"expected a normkit lab output folder with manifest.json, "
                                f"got {str(out)!r} without one (run 'normkit lab' or "
                                "'normkit lab run NAME' first)")
    from .experiments import names as lab_order

    if names is None:
        order = {n: i for i, n in enumerate(lab_order())}
        names = sorted(manifest, key=lambda n: (order.get(n, len(order)), n))
    records = ResultStore(out).load()
    sections, problems = [], []
    for name in names:
        if name not in manifest:
            problems.append(f"{name}: not in the manifest of {out}")
            continue
        entry = manifest[name]
        runs = [records[i] for i in entry.get("run_ids", []) if i in records]
        missing = len(entry.get("run_ids", [])) - len(runs)
        if missing:
            problems.append(f"{name}: {missing} planned run(s) have no record")
        section = _analyse(_resolve(name, entry), entry, runs)
        if section.error is not None:
            problems.append(f"{name}: analysis failed: {section.error.splitlines()[0]}")
        sections.append(section)
    blocks = build_report(sections, title)
    fig_dir = out / "figures"
    fig_dir.mkdir(exist_ok=True)
    figures = []
    for b in blocks:
        if isinstance(b, Image):
            path = fig_dir / b.name
            path.write_bytes(b.png)
            figures.append(path)
    md_path, html_path = out / "report.md", out / "report.html"
    write_text_atomic(md_path, render_markdown(blocks))
    write_text_atomic(html_path, render_html(blocks, title))
    return ReportResult(md_path, html_path, figures, problems,
                        [c for _, c in _claims_of(sections)])
