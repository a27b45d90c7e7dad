"""Figures a person reads at a glance: the NIAH grid writes every cell's score and has a colour
scale, overlapping score lines stay visible and say when they coincide, the factor plot says
when the searched factors are a baseline's, and the loss curve shows its trend over the steps'
noise with the legend off the data."""

from __future__ import annotations

import numpy as np
import pytest

from longctx.eval.plots import family_figure, niah_figure, niah_heatmap, position_figure, score_figure
from longctx.plotting import SMOOTHING, loss_curve
from longctx.ropesearch.compare import SEARCHED, factors_figure
from longctx.ropesearch.space import Space


def test_niah_grid_has_values_and_a_colour_scale(tmp_path):
    rows = [{"task": "niah_single_noise", "checkpoint": c, "length": n, "depth": d, "score": s}
            for c, s0 in (("base", 0.0), ("pretrain", 0.5)) for n in (512, 2048) for d, s in ((0.1, s0), (0.9, 1.0))]
    rows += [{"task": "niah_single_noise", "checkpoint": "base", "length": 4096, "depth": 0.1, "score": s}
             for s in (0.0, 0.5)]  # two prompts of one cell: their mean
    fig = niah_figure(rows)
    panels, bar = fig.axes[:2], fig.axes[2:]
    assert len(bar) == 1 and bar[0].get_ylabel() == "score"
    texts = [t.get_text() for t in panels[0].texts]
    assert sorted(texts) == sorted(["0.00", "0.00", "0.25", "1.00", "1.00", "-"])  # 4096 x depth 0.9 never ran
    assert sorted(t.get_text() for t in panels[1].texts) == ["-", "-", "0.50", "0.50", "1.00", "1.00"]
    niah_heatmap(rows, tmp_path / "niah.png")
    assert (tmp_path / "niah.png").stat().st_size > 5000


def test_coinciding_score_lines_stay_visible_and_say_so():
    same = {"task_a": {512: 0.0, 2048: 0.0}}
    fig = score_figure({"base": same, "pretrain": same, "sft": {"task_a": {512: 1.0, 2048: 0.5}}})
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["base", "pretrain (same as base)", "sft"]
    assert len({ln.get_marker() for ln in lines}) == 3
    assert lines[0].get_xdata()[0] != lines[1].get_xdata()[0]  # offset sideways, both visible
    assert abs(lines[0].get_xdata()[0] / 512 - 1) < 0.05


def test_scores_beyond_a_window_are_marked():
    rows = [{"task": "niah_single_noise", "checkpoint": c, "length": n, "depth": 0.5, "score": 1.0}
            for c in ("base", "pretrain") for n in (512, 2048)]
    fig = niah_figure(rows, {"base": 512, "pretrain": 2048})
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["1.00", "1.00*"]  # base at 2048: beyond 512
    assert sorted(t.get_text() for t in fig.axes[1].texts) == ["1.00", "1.00"]
    assert "beyond" in fig.axes[0].get_title() and "beyond" not in fig.axes[1].get_title()
    scores = {"base": {"task_a": {512: 1.0, 2048: 0.0}}, "pretrain": {"task_a": {512: 1.0, 2048: 1.0}}}
    lines = score_figure(scores, {"base": 512, "pretrain": 2048}).axes[0].get_lines()
    hollow = [ln for ln in lines if ln.get_markerfacecolor() == "white" and len(ln.get_xdata())]
    assert len(hollow) == 1 and hollow[0].get_ydata()[0] == 0.0  # base's 2048 point only
    assert lines[-1].get_label() == "hollow: beyond the checkpoint's window"
    assert all("hollow" not in ln.get_label() for ln in score_figure(scores).axes[0].get_lines())


def test_factor_plot_says_when_the_search_equals_a_baseline():
    space = Space(16, 10000.0, 256, 1024)
    ntk = [1.0 + i for i in range(8)]
    fig = factors_figure({"pi": [4.0] * 8, "ntk": ntk, SEARCHED: list(np.array(ntk) * (1 + 1e-9))}, space)
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert f"{SEARCHED} (= ntk: the search found nothing better)" in labels
    other = factors_figure({"pi": [4.0] * 8, SEARCHED: ntk}, space)
    assert SEARCHED in [ln.get_label() for ln in other.axes[0].get_lines()]
    # NTK's factors with LongRoPE2's attention factor: another setting, and the legend says how
    twin = factors_figure({"ntk": ntk, SEARCHED: ntk}, space, {"ntk": 1.0, SEARCHED: 1.1157})
    assert f"{SEARCHED} (ntk's factors, attention factor 1.116 vs 1)" in [ln.get_label()
                                                                          for ln in twin.axes[0].get_lines()]


def test_same_as_names_the_baseline_the_search_kept():
    from longctx.ropesearch.compare import same_as

    assert same_as({"ntk": [1.0, 2.0], "yarn": [1.0, 3.0], SEARCHED: [1.0, 2.0]}) == "ntk"
    assert same_as({"ntk": [1.0, 2.0], SEARCHED: [1.0, 2.5]}) is None
    # the whole setting: equal factors with another attention factor are not the same method
    factors = {"ntk": [1.0, 2.0], "yarn": [1.0, 2.0], SEARCHED: [1.0, 2.0]}
    assert same_as(factors, {"ntk": 1.0, "yarn": 1.2, SEARCHED: 1.2}) == "yarn"
    assert same_as(factors, {"ntk": 1.0, "yarn": 1.0, SEARCHED: 1.2}) is None and same_as(factors) == "ntk, yarn"


def test_loss_by_position_marks_the_training_length():
    rows = [{"checkpoint": c, "position": p, "loss": 4.0 + p / 1000} for c in ("RoPE", "SeqPE") for p in (16, 48, 80)]
    lines = position_figure(rows, train_len=64).axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["RoPE", "SeqPE", "training length (64)"]
    assert list(lines[-1].get_xdata()) == [64, 64] and lines[-1].get_linestyle() == "--"
    assert len(position_figure(rows).axes[0].get_lines()) == 2


def test_the_comparison_figure_has_a_panel_per_task_family():
    scores = {"base": {"json_kv": {"512": 0.25, "2048": 0.0}, "niah_single_noise": {"512": 0.5, "2048": 0.0},
                       "passkey": {"512": 1.0, "2048": 0.0}},
              "sft": {"passkey": {"512": 1.0, "2048": 1.0}, "niah_single_noise": {"512": 1.0, "2048": 0.5},
                      "json_kv": {"512": 0.0, "2048": 0.0}}}
    fig = family_figure(scores, {"base": 512})
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["retrieval (passkey, NIAH)", "JSON KV (HELMET)"]  # RULER's order
    retrieval = {ln.get_label(): list(ln.get_ydata()) for ln in panels[0].get_lines() if ln.get_label() in scores}
    assert retrieval == {"base": [0.75, 0.0], "sft": [1.0, 0.75]}  # the family's mean at 512 and 2048
    assert "Scores by task family" in fig.get_suptitle()


def test_the_niah_grid_names_its_task_and_wraps_many_checkpoints():
    rows = [{"task": "niah_single_noise", "checkpoint": c, "length": 512, "depth": 0.5, "score": 1.0}
            for c in ("base", "stage1", "stage2", "sft")]
    fig = niah_figure(rows)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 4 and "niah_single_noise" in fig.get_suptitle()
    assert len({round(ax.get_position().y0, 2) for ax in panels}) == 2  # two rows of two, not one long strip


def test_score_points_carry_their_intervals_as_bars():
    scores = {"base": {"task_a": {"512": 0.5, "2048": 0.25}}, "sft": {"task_a": {"512": 1.0, "2048": 0.75}}}
    spread = {"base": {"512": {"lo": 0.3, "hi": 0.7}, "2048": {"lo": 0.1, "hi": 0.5}}}
    ax = score_figure(scores, spread=spread).axes[0]
    bars = [c for c in ax.collections if len(c.get_segments()) == 2]
    assert len(bars) == 1  # base's two points; sft has no interval to draw
    (_, lo, _, hi), (_, lo2, _, hi2) = (np.ravel(seg) for seg in bars[0].get_segments())
    assert (lo, hi, lo2, hi2) == pytest.approx((0.3, 0.7, 0.1, 0.5))
    assert "95% intervals" in ax.get_title()


def test_the_loss_curve_draws_its_mean_over_the_steps_and_keeps_the_legend_off_the_axes():
    """Each step's loss swings 0.1-4.5 on the tiny run: the running mean first and on top, the steps
    faint beneath, the legend outside the axes (inside, it covered the curve)."""
    noisy = [0.1, 4.5] * 30
    fig = loss_curve([{"step": i + 1, "loss": v} for i, v in enumerate(noisy)], "pretrain_stage1", 2.0,
                     {40: "then stage2"})
    ax = fig.axes[0]
    mean, steps = ax.get_lines()[:2]
    assert mean.get_label() == f"train loss ({SMOOTHING}-step mean)" and steps.get_label() == "train loss (each step)"
    assert mean.get_zorder() > steps.get_zorder() and mean.get_linewidth() > 2 * steps.get_linewidth()
    assert steps.get_alpha() <= 0.3
    assert mean.get_ydata()[0] == 0.1 and mean.get_ydata()[-1] == pytest.approx(2.3)  # from step 1: fewer steps
    assert ax.get_legend() is None and len(fig.legends) == 1
    fig.canvas.draw()
    legend, axes = fig.legends[0].get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1  # beside the axes, covering none of the curve
    assert [t.get_text() for t in fig.legends[0].get_texts()][:2] == [mean.get_label(), steps.get_label()]
