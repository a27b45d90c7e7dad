"""bench/cudnn_routing.py's parts that run on a CPU: its cases are whole documents of each length
at each real head shape, the crossover is the length from which cuDNN wins for good, and bad
arguments or a machine without cuDNN are refused by name before anything is written."""

import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import cudnn_routing  # noqa: E402


def test_cases_are_whole_documents_of_each_length():
    cases = cudnn_routing.cases(cudnn_routing.SHAPES, cudnn_routing.LENGTHS, 40000)
    assert {(c["shape"], c["heads"], c["kv_heads"], c["dim"]) for c in cases} == {
        ("12/12/64", 12, 12, 64), ("16/4/128", 16, 4, 128), ("32/8/128", 32, 8, 128)}
    for c in cases:
        lengths = {b - a for a, b in zip(c["bounds"][:-1], c["bounds"][1:], strict=True)}
        assert lengths == {c["length"]} and c["documents"] == 40000 // c["length"] == len(c["bounds"]) - 1
    assert max(c["length"] for c in cases) == 32768  # (65,536 does not fit 40,000 tokens)


@pytest.mark.parametrize("shape", ["12/5/64", "16/4", "a/b/c", "0/0/64"])
def test_impossible_shapes_are_refused_by_name(shape):
    with pytest.raises(SystemExit, match=f"--shapes '{shape}'"):
        cudnn_routing.parse_shape(shape)


def test_crossover_is_where_cudnn_wins_for_good():
    def rows(*ratios):
        return [{"length": 1024 << i, "cudnn_vs_varlen": r} for i, r in enumerate(ratios)]
    assert cudnn_routing.crossover(rows(1.9, 1.1, 0.8, 0.7)) == 4096
    assert cudnn_routing.crossover(rows(0.9, 1.1, 0.8, 0.7)) == 4096  # (a win below a loss does not count)
    assert cudnn_routing.crossover(rows(0.9, 0.8)) == 1024
    assert cudnn_routing.crossover(rows(1.2, 1.01)) is None


@pytest.mark.parametrize(("extra", "message"), [(["--lengths", "100"], "at least 128"),
                                                (["--tokens", "100"], "--tokens 100"),
                                                (["--shapes", "8/3/64"], "--shapes '8/3/64'"),
                                                ([], "needs a CUDA GPU")])
def test_refused_by_name_and_nothing_written(tmp_path, extra, message):
    done = subprocess.run([sys.executable, "bench/cudnn_routing.py", "--out", str(tmp_path / "out"), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr
    assert not (tmp_path / "out").exists()
