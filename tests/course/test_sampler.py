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


@pytest.mark.parametrize("n, ranks, drop_last, lists, seen", [
    (8, 4, False, [[r, r + 4] for r in range(4)], [1] * 8),  # the seed's case
    (10, 3, False, [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]], [2, 2] + [1] * 8),  # padded
    (10, 3, True, [[0, 3, 6], [1, 4, 7], [2, 5, 8]], [1] * 9 + [0]),  # the tail dropped
])
def test_assignment_lists_and_times_seen(n, ranks, drop_last, lists, seen):
    df = sampler_assignment(n, ranks, shuffle=False, drop_last=drop_last)
    assert list(df.columns) == ["rank", "position", "index"]
    assert all(str(t) == "int64" for t in df.dtypes)
    assert assignment_lists(df) == lists
    assert times_seen(df, n).tolist() == seen


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
