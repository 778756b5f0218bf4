"""``python -m normkit``: the ``normkit`` command line (see :mod:`normkit.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
