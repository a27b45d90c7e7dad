"""bench/kernel_resources.py: the FoX kernels compile for Hopper (sm_90) on a machine without a
GPU (Triton's interpreter, which the other kernel tests use here, skips that lowering), with
plausible register, spill and shared-memory figures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/kernel_resources.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper(tmp_path):
    done = tool("--first", "--dims", "64", "--groups", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("kernel_resources-sm90-*.json")
    result = json.loads(path.read_text())
    rows = {r["kernel"]: r for r in result["rows"]}
    assert set(rows) == {"fwd", "dq", "dkdv", "bounds", "prepare", "dlogf", "bwd_prep"} and result["arch"] == 90
    for name in ("fwd", "dq", "dkdv"):
        r = rows[name]
        assert r["D"] == 64 and r["groups"] == 2
        assert 32 < r["registers"] <= 255 and r["spill_stores"] >= 0 and r["spill_loads"] >= 0
        # the key (fwd, dq) or query (dk/dv) tiles are staged in shared memory: at least one stage of two
        staged = r["BN"] if name != "dkdv" else r["BM"]
        assert r["fits"] and 2 * staged * 64 * 2 <= r["shared_bytes"] <= 232448
    assert 0 < rows["bounds"]["registers"] < 64  # scalar code
    assert "spill st" in done.stdout  # the table
    assert not any(r["wide"] for r in result["rows"])


def test_the_64_bit_offsets_variants_compile_for_hopper(tmp_path):
    done = tool("--first", "--wide", "--dims", "128", "--kernels", "fwd", "bwd_prep", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("kernel_resources-wide-sm90-*.json")
    result = json.loads(path.read_text())
    assert result["wide"] and [(r["kernel"], r["wide"], r["D"]) for r in result["rows"]] == \
        [("fwd", True, 128), ("bwd_prep", True, 128)]
    assert all(r["registers"] <= 255 and r["fits"] for r in result["rows"])


def test_refuses_a_head_dim_the_kernels_never_see(tmp_path):
    done = tool("--dims", "40", "--out", str(tmp_path))
    assert done.returncode != 0 and "--dims: 40" in done.stderr
    assert not list(tmp_path.iterdir())
