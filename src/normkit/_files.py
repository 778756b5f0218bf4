"""Files the command line writes: checked before a long run, replaced atomically.

A benchmark or a lab run can take minutes to hours; an output path that cannot be
written must fail before it starts, not after, and a file the user already has is
either replaced whole or left as it was, never cut short.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["unwritable_folder_reason", "unwritable_reason", "write_text_atomic"]


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be written as a file, or None when it can.

    Example:
        >>> unwritable_reason("/nonexistent-folder/out.json")
        "its folder '/nonexistent-folder' does not exist"
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     unwritable_reason(d), unwritable_reason(d + "/out.json")
        ('it is a folder', None)
    """
    path = Path(path)
    if path.is_dir():
        return "it is a folder"
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return f"its folder '{folder}' does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder '{folder}' is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is not writable"
    return None


def unwritable_folder_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be used (or created) as an output folder, or None when it can.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     open(d + "/file", "w").close()
        ...     unwritable_folder_reason(d + "/file"), unwritable_folder_reason(d + "/new/sub")
        ('it is a file, not a folder', None)
    """
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        return "it is a file, not a folder"
    existing = path
    while not existing.exists():  # the folder that creating it would write into
        existing = existing.parent
    if not existing.is_dir():
        return f"'{existing}' is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable"
    return None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then rename.

    A reader (or an interruption) sees the old file or the new one, never half of it.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_text_atomic(d + "/a.txt", "new")
        ...     open(d + "/a.txt").read()
        'new'
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; give it a normal file's mode
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
