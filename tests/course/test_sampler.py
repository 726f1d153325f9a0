"""helpers.sampler (notebook 03's tables and pictures), fast: the padded case, torch's sampler behind
the epochs, the errors, the picture. Notebook 03's check cells assert its other cases
(tests/course/test_notebooks.py runs it)."""

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


def test_padded_case_table_skew_and_epochs():
    """10 items, 3 ranks: the other cases (8 over 4, drop_last, 5/9) and the set_epoch claim are
    asserted by notebook 03's own check cells (tests/course/test_notebooks.py runs it)."""
    df = sampler_assignment(10, 3, shuffle=False)
    assert list(df.columns) == ["rank", "position", "index"]
    assert all(str(t) == "int64" for t in df.dtypes)
    assert assignment_lists(df) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert times_seen(df, 10).tolist() == [2, 2] + [1] * 8
    assert accuracy_through(df, RIGHT_0_TO_4) == Fraction(7, 12)
    # epoch_assignment: one sampler per rank reused, set_epoch called: a fresh sampler at that epoch
    df = epoch_assignment(8, 2, 2, call_set_epoch=True, seed=0)
    assert assignment_lists(df[df["epoch"] == 1])[0] == sampler_indices(8, 2, 0, shuffle=True, seed=0, epoch=1)


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
