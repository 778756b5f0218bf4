"""``python -m normkit.bench``: the benchmark's command line (see :mod:`normkit.bench.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m normkit.bench"))
