"""bench/fox_tuning.py on the CPU (the kernels in Triton's interpreter, one configuration each):
two processes in turn, every length timed twice, the table and the JSON."""

from __future__ import annotations

import json
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import fox_tuning  # noqa: E402


def test_two_processes_time_every_length_and_write_the_result(tmp_path, capsys):
    result = fox_tuning.main(["--forward", "64", "200", "--backward", "128", "--heads", "2", "--kv-heads", "1",
                              "--dim", "16", "--doc", "64", "--out", str(tmp_path)])
    assert list(result["runs"]) == ["cold", "warm"]
    for rows in result["runs"].values():
        assert [(r["tokens"], r["backward"], r["size_class"]) for r in rows] == [(64, False, 7), (200, False, 8),
                                                                                 (128, True, 8)]
        assert all(r["first_s"] > 0 and r["second_s"] > 0 for r in rows)
        assert all(abs(r["tuning_s"] - (r["first_s"] - r["second_s"])) < 2e-3 for r in rows)
    written = json.loads(next(tmp_path.glob("fox_tuning-cpu-*.json")).read_text())
    assert written["runs"] == result["runs"] and written["shape"]["kv_heads"] == 1
    assert "warm   total tuning and compilation:" in capsys.readouterr().out
