"""Atomic outputs: a killed or failed stage never leaves something that looks complete."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _owner() -> str:
    """Who writes a temporary: this host and process, in its name (see clear_stale)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clear_stale(folder: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove the temporaries in `folder` (of output `name` only, if given) that a process of
    this host left and that no longer runs: a killed stage's half-written output. Another live
    run's temporaries, and other hosts' on a shared disk, are left alone. Returns what went."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stem = re.escape(name) if name else r".+?"
    pattern = re.compile(rf"^\.{stem}\.(?:tmp|old)-{re.escape(socket.gethostname())}-(\d+)(?:-.*)?$")
    removed = []
    for path in folder.iterdir():
        if (m := pattern.match(path.name)) and not _running(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread)."""
    with contextlib.suppress(OSError):
        if m := re.search(r"^Umask:\s+([0-7]+)", Path("/proc/self/status").read_text(), re.M):
            return int(m.group(1), 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temp directory beside `final`; on success it replaces `final` whole.

    On any exception the temp directory is removed and `final` is left as it was; what a killed
    run left beside `final` is removed first.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clear_stale(final.parent, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{_owner()}-", dir=final.parent))
    tmp.chmod(0o777 & ~umask())  # (mkdtemp's 0700 kept other users and containers out of every output)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{_owner()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
"""Write failures that are the disk's or the folder's, not the program's: a stage reports them in
one line (see stages/_run.py)."""


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_room(folder: str | os.PathLike, need: int, what: str) -> None:
    """Before long work: `folder` (or, while it does not exist, the folder it will be made in)
    takes writes and has `need` bytes free for `what`, so a read-only or full disk stops the
    stage at its start, not after hours of it."""
    from .errors import DataError

    folder = Path(folder)
    existing = next(p for p in (folder, *folder.parents) if p.is_dir())
    try:
        fd, probe = tempfile.mkstemp(prefix=f".probe.tmp-{_owner()}-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DataError(f"{folder}: cannot write {what} there ({e.strerror})") from None
    free = shutil.disk_usage(existing).free
    if free < need:
        raise DataError(f"{folder}: {_size(free)} free, about {_size(need)} needed for {what}: free space or move "
                        "the project to a larger disk")


def safetensors_file(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with its I/O failures (a full disk) raised as the OSError they are,
    and the file's mode the umask's (save_file's own temporary left it 0600)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))  # "... No space left on device (os error 28)"
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e
    os.chmod(path, 0o666 & ~umask())


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON through a temp file and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{_owner()}")
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


def sampled_digest(path: str | os.PathLike, blocks: int = 64, block_bytes: int = 4096) -> str:
    """A checksum of a file's size and `blocks` evenly spaced blocks (the first and last among
    them): cheap at any size (256 KiB read), it tells a file rewritten with other contents (zeros,
    another run's data) from the one recorded; a change that misses every block passes."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        for i in range(blocks):
            fh.seek(max(0, (size - block_bytes) * i // max(blocks - 1, 1)))
            h.update(fh.read(block_bytes))
    return h.hexdigest()[:32]

