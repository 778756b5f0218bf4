"""``python -m normkit.lab``: the ``normkit lab`` command (see :mod:`normkit.lab.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
