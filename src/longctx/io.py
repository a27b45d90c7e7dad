"""Atomic outputs: a killed or failed stage never leaves something that looks complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temp directory beside `final`; on success it replaces `final` whole.

    On any exception the temp directory is removed and `final` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON through a temp file and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Read a JSON file another stage wrote; a missing or corrupt file is a DataError."""
    from .errors import DataError

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: {what} not found (run the stage that writes it first)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: {what} is corrupt: {e}") from e
