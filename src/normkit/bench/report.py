"""Reports of a ``normkit bench`` document: the Markdown table and the JSON text.

The Markdown is what ``benchmarks/RESULTS.md`` holds: a title naming the device,
dtype and input, the exact command that produced it, the environment, one table row
per op, shape and pass, then the legend (what each column means), anything not
measured or failed, and the verdicts of issue #6's targets on the rows measured
(:mod:`normkit.bench.targets`).

Example:
    >>> from normkit.bench.runner import BenchConfig, run
    >>> doc = run(BenchConfig(ops=("rms_norm",), shapes="4x8", repeats=2, warmup=0,
    ...                       min_time=0.0, copy_mib=1), command="normkit bench rms_norm")
    >>> text = to_markdown(doc)
    >>> text.splitlines()[0]
    '# normkit bench: cpu, float32, input randn (well-conditioned)'
    >>> [line for line in text.splitlines() if line.startswith("| op")] == [
    ...     "| " + " | ".join(columns(doc)) + " |"]
    True
"""

from __future__ import annotations

import json
import math

from . import targets
from .runner import COMPILED, errors

__all__ = ["NOISY", "columns", "to_markdown", "to_json", "format_ms"]

_CONDITIONING = {"randn": "well-conditioned", "offset": "offset, ill-conditioned"}
#: A ratio whose interquartile range over rounds exceeds this fraction of it is marked noisy.
NOISY = 0.2


def format_ms(value: float | None) -> str:
    """Three significant digits, never in exponent form (``-`` for no value).

    Example:
        >>> format_ms(0.012345), format_ms(1.5), format_ms(1234.5), format_ms(None)
        ('0.0123', '1.50', '1234', '-')
    """
    if value is None or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def _measured(doc: dict) -> list[str]:
    """The implementations with an entry in any record, in column order."""
    names: list[str] = []
    for record in doc["results"]:
        for name in record["impls"]:
            if name not in names:
                names.append(name)
    order = list(doc["implementations"])
    return sorted(names, key=lambda n: order.index(n) if n in order else len(order))


def columns(doc: dict) -> list[str]:
    """The Markdown table's column names for this document.

    Always ``op, shape, layout, pass, torch ms, normkit ms, normkit x, normkit GB/s,
    % copy, torch MiB, normkit MiB``; ``threads`` first when several thread counts
    ran; ``<impl> ms, <impl> x`` for each other implementation measured, and
    ``<impl> 1st s`` (the first call: compilation) for the compiled ones.
    """
    names = [n for n in _measured(doc) if n not in ("torch", "normkit")]
    head = ["threads"] if len(doc["environment"]["threads"]) > 1 else []
    cols = [*head, "op", "shape", "layout", "pass", "torch ms", "normkit ms", "normkit x",
            "normkit GB/s", "% copy"]
    for name in names:
        cols += [f"{name} ms", f"{name} x"]
        if name in COMPILED:
            cols.append(f"{name} 1st s")
    return [*cols, "torch MiB", "normkit MiB"]


def _cells(record: dict, cols: list[str]) -> list[str]:
    impls = record["impls"]

    def entry(name: str) -> dict:
        return impls.get(name) or {}

    def ms(name: str) -> str:
        e = entry(name)
        return "error" if e.get("error") else format_ms(e.get("ms"))

    def ratio(name: str) -> str:
        value, iqr = entry(name).get("ratio"), entry(name).get("ratio_iqr")
        if value is None:
            return "-"
        noisy = iqr is not None and value > 0 and (iqr[1] - iqr[0]) / value > NOISY
        return f"{'~' if noisy else ''}{value:.2f}x"

    def mib(name: str) -> str:
        memory = entry(name).get("memory")
        if not memory or memory.get("peak_bytes") is None:
            return "-"
        return format_ms(memory["peak_bytes"] / 2**20)

    ours = entry("normkit")
    values = {
        "threads": str(record["threads"]),
        "op": record["op"],
        "shape": "x".join(map(str, record["shape"])),
        "layout": {"channels_last": "NHWC", "contiguous": "NCHW"}[record["layout"]]
        if len(record["shape"]) == 4 else "-",
        "pass": record["pass"],
        "normkit GB/s": "-" if ours.get("gbs") is None else f"{ours['gbs']:.1f}",
        "% copy": "-" if ours.get("pct_copy") is None else f"{ours['pct_copy']:.0f}%",
        "torch MiB": mib("torch"),
        "normkit MiB": mib("normkit"),
    }
    out = []
    for col in cols:
        if col in values:
            out.append(values[col])
        elif col.endswith(" 1st s"):
            first = entry(col[:-6]).get("compile_s")
            out.append("-" if first is None else f"{first:.1f}")
        elif col.endswith(" ms"):
            out.append(ms(col[:-3]))
        elif col.endswith(" x"):
            out.append(ratio(col[:-2]))
        else:
            raise KeyError(col)
    return out


def _commit_text(env: dict) -> str:
    """`` at <commit>`` for runs that recorded normkit's git commit, else nothing."""
    commit = env.get("normkit_commit")
    return f" at {commit}" if commit else ""


def _copy_text(env: dict) -> str:
    bands = env["copy_bandwidth_gbs"]
    return ", ".join(f"{float(gbs):.1f} GB/s at {threads} thread(s)"
                     for threads, gbs in bands.items()) or "not measured"


def _allocator_lines(env: dict) -> list[str]:
    """The allocator line of the header (runs saved before it was recorded have none)."""
    alloc = env.get("allocator")
    if alloc is None or env["device"] != "cpu":
        return []
    variables = ", ".join(f"{k}={v}" for k, v in alloc["variables"].items()) or "none set"
    order = alloc.get("page_reporting_order")  # (recorded since 2026-12-02)
    reporting = ""
    if order is not None:
        huge = ": freed huge pages are backed afresh by the host" if order <= 9 else ""
        reporting = (f"; free page reporting to the hypervisor from "
                     f"{(4096 << order) >> 10} KiB blocks (order {order}{huge})")
    return [f"- allocator: transparent huge pages `{alloc['transparent_hugepage']}`; normkit "
            f"huge-page outputs {'on' if alloc['normkit_huge_pages'] else 'off'}; "
            f"allocator variables: {variables}{reporting}"]


def _cache_line(flush_mib: int) -> str:
    if not flush_mib:
        return "- cache: warm (inputs that fit in the cache stay there between calls)"
    return (f"- cache: cold ({flush_mib} MiB written before every call, outside its time: "
            "inputs come from memory)")



def _dtypes(env: dict) -> str:
    """``bfloat16`` or, with parameters of another dtype, ``bfloat16 (float32 parameters)``
    (documents written before ``param_dtype`` existed have the one dtype)."""
    params = env.get("param_dtype", env["dtype"])
    return env["dtype"] if params == env["dtype"] else f"{env['dtype']} ({params} parameters)"

def to_markdown(doc: dict) -> str:
    """The document as Markdown: title, command, environment, table, legend, omissions.

    Example:
        >>> from normkit.bench.runner import BenchConfig, run
        >>> doc = run(BenchConfig(ops=("rms_norm",), shapes="4x8", repeats=1, warmup=0,
        ...                       min_time=0, copy_mib=1))
        >>> to_markdown(doc).splitlines()[0]
        '# normkit bench: cpu, float32, input randn (well-conditioned)'
    """
    env, settings = doc["environment"], doc["settings"]
    conditioning = _CONDITIONING.get(env["input"], env["input"])
    load = env["load_average"]
    load_text = (f"; load average {load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end"
                 if load.get("start") and load.get("end") else "")
    lines = [
        f"# normkit bench: {env['device']}, {_dtypes(env)}, input {env['input']} "
        f"({conditioning})",
        "",
        "Produced by:",
        "",
        "```sh",
        doc.get("command") or "normkit bench",
        "```",
        "",
        f"- machine: {env['device_name']} ({env['cpu_count']} CPUs), {env['platform']}"
        f"{load_text}",
        f"- software: torch {env['torch']}, normkit {env['normkit']}"
        f"{_commit_text(env)}, Python {env['python']}; "
        f"{env['date']}",
        f"- threads: {', '.join(map(str, env['threads']))}; copy bandwidth: {_copy_text(env)}",
        f"- input: {env['input']}, {env['input_doc']}",
        *_allocator_lines(env),
        f"- timing: median of {settings['repeats']} interleaved rounds (every implementation "
        f"once per round, round-robin, same process) after a first call and "
        f"{settings['warmup']} warm-up calls; each "
        f"measurement repeats the call to last >= {settings['min_time_s'] * 1e3:g} ms",
        _cache_line(settings.get("flush_mib", 0)),
        *([("- CUDA graphs: every call was captured once in a CUDA graph and its replays "
            "timed: the kernels' time without the host's (Python, dispatch, launches), "
            "for every implementation alike; eager calls also pay the host")]
          if settings.get("cuda_graphs") else []),
        *([f"- normkit backend: {settings['backend']!r} (every normkit module set to it; "
           "the default is 'auto')"] if settings.get("backend", "auto") != "auto" else []),
        "",
    ]
    if doc.get("interrupted"):
        lines += [f"**Interrupted {doc['interrupted']}**: the rows below are the passes "
                  "measured before the run was stopped.", ""]
    cols = columns(doc)
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" if c in ("op", "shape", "layout", "pass") else "---:"
                                for c in cols) + "|")
    for record in doc["results"]:
        lines.append("| " + " | ".join(_cells(record, cols)) + " |")
    lines += [
        "",
        "- **x**: median over rounds of (torch eager time / that implementation's time); "
        "> 1 means faster than torch eager. **~**: noisy, the interquartile range of the "
        f"per-round ratios exceeds {NOISY:.0%} of the median (rerun on a quieter machine).",
        "- **GB/s**: ideal bytes / normkit's median time. Ideal bytes: every activation-sized "
        "tensor read or written once, X = input bytes, P = parameter bytes: forward 2X + P, "
        "forward+backward 5X + 3P (add_* ops: 4X + P and 8X + 3P). **% copy**: of the copy "
        "bandwidth above (median `dst.copy_(src)`, 2 x buffer bytes moved)"
        + ("." if settings.get("flush_mib") else "; shapes that fit in cache can pass 100%."),
        "- **MiB**: peak memory of one forward+backward. "
        + ("CUDA: torch.cuda.max_memory_allocated above the memory allocated before the step."
           if env["device"] == "cuda" else
           "CPU: the distinct storages autograd saves for backward plus the outputs "
           "(deterministic; transient workspace not counted)."),
    ]
    ops = {entry["op"]: entry for entry in doc["ops"]}
    measured_ops = list(dict.fromkeys(record["op"] for record in doc["results"]))
    if measured_ops:
        lines.append("- **torch baseline**: " + "; ".join(
            f"{name}: {ops[name]['baseline']}" for name in measured_ops if name in ops) + ".")
    missing = [f"{name}: {status['reason']}" for name, status in doc["implementations"].items()
               if not status["used"]]
    if missing:
        lines.append("- **not compared**: " + "; ".join(missing) + ".")
    if doc["skipped"]:
        lines.append("- **not measured**: " + "; ".join(
            f"{item['op']} ({item['reason']})" for item in doc["skipped"]) + ".")
    failures = errors(doc)
    if failures:
        lines += ["", "Errors:", ""] + [f"- {failure}" for failure in failures]
    verdicts = targets.markdown_lines([doc])
    if verdicts:
        lines += [""] + verdicts
    return "\n".join(lines) + "\n"


def to_json(doc: dict) -> str:
    """The document as indented JSON text.

    Example:
        >>> to_json({"schema": "normkit-bench/1"})
        '{\\n  "schema": "normkit-bench/1"\\n}'
    """
    return json.dumps(doc, indent=2)
