"""helpers.sampler (notebook 03's tables and pictures) against the issue's cases (notebook 03 itself,
whose worker code lives in its cells, is executed by tests/course/test_notebooks.py)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from helpers.sampler import (
    accuracy_through,
    assignment_lists,
    epoch_assignment,
    plot_assignment,
    sampler_assignment,
    sampler_indices,
    times_seen,
)

RIGHT_0_TO_4 = [i < 5 for i in range(10)]


def test_seed_case_8_items_4_ranks():
    df = sampler_assignment(8, 4, shuffle=False)
    assert list(df.columns) == ["rank", "position", "index"]
    assert all(str(t) == "int64" for t in df.dtypes)
    assert assignment_lists(df) == [[r, r + 4] for r in range(4)]
    assert (times_seen(df, 8) == 1).all()


def test_padded_10_items_3_ranks():
    df = sampler_assignment(10, 3, shuffle=False)
    assert assignment_lists(df) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    seen = times_seen(df, 10)
    assert seen.tolist() == [2, 2] + [1] * 8


def test_drop_last_10_items_3_ranks():
    df = sampler_assignment(10, 3, shuffle=False, drop_last=True)
    assert assignment_lists(df) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert times_seen(df, 10).tolist() == [1] * 9 + [0]


def test_evaluation_skew_values():
    assert accuracy_through(sampler_assignment(10, 3), RIGHT_0_TO_4) == Fraction(7, 12)
    assert accuracy_through(sampler_assignment(10, 3, drop_last=True), RIGHT_0_TO_4) == Fraction(5, 9)


def test_set_epoch_case_8_items_2_ranks_seed_0():
    without = epoch_assignment(8, 2, 2, call_set_epoch=False, seed=0)
    with_set = epoch_assignment(8, 2, 2, call_set_epoch=True, seed=0)
    per = {name: [assignment_lists(df[df["epoch"] == e]) for e in (0, 1)]
           for name, df in (("no", without), ("yes", with_set))}
    assert per["no"][0] == per["no"][1]
    for r in range(2):
        assert per["yes"][0][r] != per["yes"][1][r]
    for name in per:
        for e in (0, 1):
            assert sorted(per[name][e][0] + per[name][e][1]) == list(range(8))
    # the helper really asks torch's sampler: same as a fresh sampler with set_epoch(1)
    assert per["yes"][1][0] == sampler_indices(8, 2, 0, shuffle=True, seed=0, epoch=1)


def test_sampler_indices_errors():
    with pytest.raises(ValueError):
        sampler_indices(8, 2, 2)  # the sampler's own check: rank outside [0, num_replicas)
    with pytest.raises(ValueError):
        sampler_indices(0, 2, 0)
    with pytest.raises(ValueError):
        sampler_assignment(8, 0)
    with pytest.raises(ValueError):
        epoch_assignment(8, 2, 0, call_set_epoch=True)


def test_plot_assignment_draws_every_cell():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plot_assignment(sampler_assignment(10, 3), 10, title="t")
    assert ax.get_title() == "t" and ax.get_xlabel() == "dataset index" and ax.get_ylabel() == "rank"
    assert len(ax.texts) == 12
    assert ax.get_legend() is not None
    plt.close(ax.figure)
