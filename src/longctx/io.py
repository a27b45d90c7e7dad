"""Atomic outputs: a killed or failed stage never leaves something that looks complete."""

from __future__ import annotations

import contextlib
import errno
import fcntl
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


PIPELINE_LOCK = Path(".dvc") / "tmp" / "longctx-pipeline.lock"
"""Held (flock) by the main command's flow for its whole run, with who holds it written inside."""
PIPELINE_ENV = "LONGCTX_PIPELINE"
"""Set by the flow for the stages it runs: they run under the lock, not beside it."""


@contextlib.contextmanager
def pipeline_lock(workspace: Path, holder: str) -> Iterator[None]:
    """The workspace's pipeline lock for the body, `holder` written in it; another holder is a
    WorkspaceBusy naming it."""
    from .errors import WorkspaceBusy

    path = workspace / PIPELINE_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise WorkspaceBusy(f"{workspace}: another longctx pipeline run holds this workspace "
                                f"({fh.read().strip() or 'unknown run'}); wait for it or use another clone") from None
        fh.seek(0)
        fh.truncate()
        fh.write(holder + "\n")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pipeline_holder(workspace: Path) -> str | None:
    """Who holds the workspace's pipeline lock, for a process that is not one of its stages (a
    `dvc repro` started by hand beside the main command); None when nobody does."""
    path = workspace / PIPELINE_LOCK
    if os.environ.get(PIPELINE_ENV) or not path.is_file():
        return None
    with path.open() as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return fh.read().strip() or "unknown run"
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread)."""
    with contextlib.suppress(OSError):
        if m := re.search(r"^Umask:\s+([0-7]+)", Path("/proc/self/status").read_text(), re.M):
            return int(m.group(1), 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


REPLACED: list[Path] = []
"""What this process has replaced through atomic_dir and write_json, in order: a stage that fails
afterwards says these changed, not that its earlier outputs are intact."""


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
    REPLACED.append(final)
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


def write_json(path: str | os.PathLike, obj: Any, sort_keys: bool = True) -> None:
    """Write JSON through a temp file and rename, so readers never see half a file; keys sorted
    unless the order is the reader's (`dvc exp show` makes its columns in the file's order)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{_owner()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")
    except OSError as e:  # (a write's error names no file: a full disk would be said of none)
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) if e.filename is None else e from None
    os.replace(tmp, path)
    if not any(".tmp-" in part for part in path.parts[:-1]):  # (inside an atomic_dir: replaced with it)
        REPLACED.append(path)


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

