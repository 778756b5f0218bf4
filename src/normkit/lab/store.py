"""Results on disk: one JSON line per finished run, and a manifest of what was planned.

* ``results.jsonl``: one record per finished run, appended and flushed to disk as soon
  as the run finishes, so an interruption loses no finished run. A line cut short by
  an interruption is skipped when reading (and reported); the next append starts on a
  new line. In a multi-process run, ranks other than 0 append to
  ``results.rank<R>.jsonl`` until rank 0 merges everything into ``results.jsonl``.
* ``manifest.json``: per experiment, the profile, base seed, settings and the run ids
  the report is made of (records of other runs stay in the file but are not used).

Records are JSON objects with ``run_id``, ``experiment``, ``key``, ``seed``,
``config``, ``result`` and ``timing`` (wall-clock values, the only part that differs
between two runs of the same seed). Non-finite floats are stored as ``null``.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     store = ResultStore(d)
    ...     store.append({"run_id": "a", "result": {"x": float("nan")}})
    ...     store.load()["a"]["result"]
    {'x': None}
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._files import write_text_atomic

__all__ = ["RESULTS", "MANIFEST", "ResultStore", "sanitize", "read_manifest",
           "update_manifest", "deterministic_view"]

RESULTS = "results.jsonl"
MANIFEST = "manifest.json"


def sanitize(value: Any) -> Any:
    """A JSON-safe copy: non-finite floats become ``None``, tuples become lists.

    Example:
        >>> sanitize({"a": (1.0, float("inf")), "b": 2})
        {'a': [1.0, None], 'b': 2}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return sanitize(value.item())
    raise TypeError(f"cannot store a {type(value).__name__} in a lab record: {value!r}")


def deterministic_view(record: dict) -> dict:
    """A record without its wall-clock ``timing``: equal for equal seeds and configs.

    Example:
        >>> deterministic_view({"run_id": "a", "result": {}, "timing": {"wall_s": 1.0}})
        {'run_id': 'a', 'result': {}}
    """
    return {k: v for k, v in record.items() if k != "timing"}


class ResultStore:
    """The JSON-lines results of an output folder.

    Args:
        out_dir: the folder (created if missing).
        rank: this process's rank; ranks > 0 append to ``results.rank<R>.jsonl``.
    """

    def __init__(self, out_dir: str | os.PathLike, rank: int = 0) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = self.dir / (RESULTS if rank == 0 else f"results.rank{rank}.jsonl")
        self.skipped_lines = 0

    def files(self) -> list[Path]:
        """The main results file and every rank's part file that exists."""
        parts = sorted(self.dir.glob("results.rank*.jsonl"))
        main = self.dir / RESULTS
        return ([main] if main.exists() else []) + parts

    def load(self) -> dict[str, dict]:
        """Every readable record by run id (a later line replaces an earlier one)."""
        records: dict[str, dict] = {}
        self.skipped_lines = 0
        for path in self.files():
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        record = json.loads(line)
                        run_id = record["run_id"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        self.skipped_lines += 1
                        warnings.warn(f"{path}:{number}: skipped a line that is not a complete "
                                      "lab record (cut short by an interruption?)",
                                      stacklevel=2)
                        continue
                    records[run_id] = record
        return records

    def append(self, record: dict) -> None:
        """Append one record and flush it to disk (``fsync``)."""
        line = json.dumps(sanitize(record), sort_keys=True, allow_nan=False)
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as handle:
                handle.seek(-1, os.SEEK_END)
                needs_newline = handle.read(1) != b"\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(("\n" if needs_newline else "") + line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def rewrite(self, records: Iterable[dict]) -> None:
        """Replace ``results.jsonl`` by ``records`` (atomically) and drop the rank parts."""
        text = "".join(json.dumps(sanitize(r), sort_keys=True, allow_nan=False) + "\n"
                       for r in records)
        write_text_atomic(self.dir / RESULTS, text)
        for part in self.dir.glob("results.rank*.jsonl"):
            part.unlink()


def read_manifest(out_dir: str | os.PathLike) -> dict:
    """The manifest of an output folder (``{}`` when there is none).

    Example:
        >>> read_manifest("/nonexistent-normkit-lab-dir")
        {}
    """
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def update_manifest(out_dir: str | os.PathLike, entries: dict[str, dict]) -> dict:
    """Set the manifest entries of some experiments (others are kept); returns it all."""
    manifest = read_manifest(out_dir)
    experiments = manifest.setdefault("experiments", {})
    experiments.update(sanitize(entries))
    write_text_atomic(Path(out_dir) / MANIFEST,
                  json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
