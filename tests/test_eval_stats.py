"""A score's interval and the paired verdict between two checkpoints, against known values."""

from __future__ import annotations

import json

import pytest

from longctx.eval import report, stats


def test_wilson_interval_matches_known_values():
    assert stats.wilson(25, 50) == pytest.approx((0.3664, 0.6336), abs=1e-4)
    assert stats.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert stats.wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert stats.interval([1.0] * 25 + [0.0] * 25) == stats.wilson(25, 50)  # 0/1 scores: Wilson


def test_graded_scores_get_a_bootstrap_interval_around_their_mean():
    scores = [0.2, 0.4, 0.6, 0.8, 0.5] * 10
    lo, hi = stats.interval(scores)
    assert lo < 0.5 < hi and hi - lo < 0.15
    assert stats.interval(scores) == (lo, hi)  # seeded: a rerun writes the same bytes


def test_a_planted_difference_is_better_and_identical_checkpoints_are_not():
    # 45 of 50 right against 25 of 50 on the same prompts: 20 won, none lost
    new, old = [1.0] * 45 + [0.0] * 5, [1.0] * 25 + [0.0] * 25
    assert stats.paired(new, old) == {"n": 50, "wins": 20, "losses": 0, "p": pytest.approx(2 * 0.5**20),
                                      "verdict": "better"}
    assert stats.paired(old, new)["verdict"] == "worse"
    assert stats.paired(old, old)["verdict"] == "no difference"
    assert stats.sign_test(5, 0) == pytest.approx(0.0625) and stats.paired([1.0] * 5, [0.0] * 5)["verdict"] == (
        "no difference")  # five prompts cannot show a difference at 95%
    with pytest.raises(ValueError, match="same prompts"):
        stats.paired([1.0], [1.0, 0.0])


def test_verdicts_pair_each_checkpoint_with_the_base_and_the_one_before():
    def rows(ckpt, passkey):
        return [{"checkpoint": ckpt, "task": "passkey", "length": 512, "score": s} for s in passkey]

    all_rows = rows("base", [0.0] * 20) + rows("stage1", [1.0] * 18 + [0.0] * 2) + rows("sft", [1.0] * 18 + [0.0] * 2)
    v = report.verdicts(all_rows, ["base", "stage1", "sft"])
    assert v["stage1"]["base"]["passkey"][512]["verdict"] == "better" and "previous" not in v["stage1"]
    assert v["sft"]["previous"]["vs"] == "stage1" and v["sft"]["previous"]["all"][512]["verdict"] == "no difference"
    best = report.best(all_rows, ["base", "stage1", "sft"])[512]
    assert best["checkpoint"] == "stage1" and not best["supported"]  # sft answered alike: no single best


def test_a_mean_over_tasks_has_an_interval_that_holds_it_even_where_every_task_is_certain():
    # every prompt of one task right, every prompt of the other wrong: a resampling of prompts would
    # say 0.50 exactly; Wilson over the 20 prompts
    assert stats.mean_interval([[1.0] * 10, [0.0] * 10]) == stats.wilson(10, 20)
    assert stats.mean_interval([[1.0] * 5 + [0.0] * 5]) == stats.wilson(5, 10)  # one task: its own interval
    lo, hi = stats.mean_interval([[0.0] * 4] * 11)  # nothing right: the interval starts at the score
    assert lo == 0.0 and 0.05 < hi < 0.1
    g_lo, g_hi = stats.mean_interval([[0.2, 0.4, 0.6] * 10, [1.0] * 30])  # graded and 0/1 together
    assert g_lo < 0.7 < g_hi and g_hi - g_lo < 0.2
    # graded beside certain-looking cells (every prompt alike): the certain ones still add their spread
    c_lo, c_hi = stats.mean_interval([[0.5] * 16, [1.0] * 16, [0.0] * 16])
    assert c_lo < 0.47 and c_hi > 0.53
    u_lo, u_hi = stats.mean_interval([[1.0] * 30, [1.0] * 5 + [0.0] * 5])  # unequal counts: the mean over tasks
    assert u_lo < 0.75 < u_hi
    cells = report.length_cells([{"task": t, "length": 512, "score": s}
                                 for t, scores in (("a", [1.0] * 10), ("b", [0.0] * 10)) for s in scores])
    assert cells[512] == {"mean": 0.5, "n": 20, "lo": round(stats.wilson(10, 20)[0], 4),
                          "hi": round(stats.wilson(10, 20)[1], 4)}


def test_two_runs_pair_on_the_prompts_both_asked():
    """A run with more prompts a cell asks the other's first: only those are paired."""
    from longctx.eval import compare

    def rows(ckpt, scores, length=512):
        return [{"checkpoint": ckpt, "task": "passkey", "length": length, "score": s} for s in scores]

    old = rows("sft", [0.0] * 10) + rows("base", [1.0] * 10)
    new = rows("sft", [1.0] * 8 + [0.0] * 2 + [0.0] * 40) + rows("stage1", [1.0] * 10)  # 50 prompts, 10 shared
    paired = compare.paired_runs(new, old)
    assert list(paired) == ["sft"]  # checkpoints in one run only are left out
    assert paired["sft"]["all"][512] == {"n": 10, "wins": 8, "losses": 0, "p": pytest.approx(2 * 0.5**8),
                                         "verdict": "better"}
    assert "| sft | better (8-0) |" in compare.table(paired, "exp-a", "HEAD")


def test_two_workspaces_prompts_files_pair_without_git_or_dvc(tmp_path, capsys):
    """scripts/gpu/recipe.sh's route: each variant's reports/eval/prompts.jsonl named as it is."""
    from longctx.eval import compare

    def write(name, scores):
        path = tmp_path / name / "prompts.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps({"checkpoint": "pretrain_stage2", "task": "passkey", "length": 65536,
                                            "score": s}) + "\n" for s in scores))
        return str(path)

    new, old = write("long", [1.0] * 9 + [0.0]), write("control", [0.0] * 10)
    compare.main([new, old])
    assert "| pretrain_stage2 | better (9-0) |" in capsys.readouterr().out
    bad = tmp_path / "control" / "prompts.jsonl"
    bad.write_text('{"checkpoint": "sft"}\n')
    with pytest.raises(SystemExit) as e:
        compare.main([new, str(bad)])
    assert e.value.code == 2
    assert f"{bad}: not the eval's scored prompts" in capsys.readouterr().err
