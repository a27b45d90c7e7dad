"""Faults: what a killed run leaves behind is cleared by the next one, and never another live
run's work."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from longctx.io import atomic_dir, clear_stale


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_killed_runs_temporaries_go_and_a_live_runs_stay(tmp_path):
    host, dead = socket.gethostname(), _dead_pid()
    stale = tmp_path / f".packed.tmp-{host}-{dead}-k3j2"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 1024)
    old = tmp_path / f".packed.old-{host}-{dead}"
    old.mkdir()
    kept = [tmp_path / f".packed.tmp-{host}-{os.getpid()}-live",  # a run still writing
            tmp_path / f".packed.tmp-otherhost-{dead}-x9",  # another host's, on a shared disk
            tmp_path / f".tokens.tmp-{host}-{dead}-a1",  # another output's
            tmp_path / "packed-notes"]
    for path in kept:
        path.mkdir()
    with atomic_dir(tmp_path / "packed") as tmp:
        (tmp / "index.json").write_text("{}")
    assert not stale.exists() and not old.exists()
    assert all(path.exists() for path in kept)
    assert (tmp_path / "packed/index.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(p.name for p in kept), "packed"])
    # without a name, every output's stale temporaries go (a checkpoint folder at a run's start)
    assert clear_stale(tmp_path) == [tmp_path / f".tokens.tmp-{host}-{dead}-a1"]
