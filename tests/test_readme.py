"""Every Python example in README.md runs, in order, as a new user would paste it."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)  # examples may write files (model.pt)
    os.environ.setdefault("KERAS_BACKEND", "torch")
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        except Exception as error:  # name the block in the failure
            raise AssertionError(
                f"README python block {number} failed: {error!r}\n{block}") from error
