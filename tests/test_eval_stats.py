"""A score's interval and the paired verdict between two checkpoints, against known values."""

from __future__ import annotations

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
