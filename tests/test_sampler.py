"""helpers.sampler (notebook 03) against the issue's cases, and the live worker in real processes
(notebook 03 itself is executed by tests/test_notebooks.py and checked by tests/test_notebook_hygiene.py)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from helpers.launch import launch
from helpers.sampler import (
    accuracy_through,
    all_reduce_counts,
    always_class_one_model,
    assignment_lists,
    dataset_fingerprint,
    distributed_eval_counts,
    epoch_assignment,
    plot_assignment,
    same_on_all_ranks,
    sampler_assignment,
    sampler_indices,
    sampler_worker,
    times_seen,
    unpadded_shard_indices,
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
    shards = [unpadded_shard_indices(10, r, 3) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(i for s in shards for i in s) == list(range(10))


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


def test_unpadded_shards_partition_and_errors():
    for n in (0, 1, 7, 10, 13):
        for w in (1, 2, 3, 4):
            shards = [unpadded_shard_indices(n, r, w) for r in range(w)]
            assert sorted(i for s in shards for i in s) == list(range(n))
    with pytest.raises(ValueError):
        unpadded_shard_indices(10, 3, 3)
    with pytest.raises(ValueError):
        unpadded_shard_indices(10, 0, 0)
    with pytest.raises(ValueError):
        unpadded_shard_indices(-1, 0, 1)


def test_counts_without_process_group():
    assert all_reduce_counts(3, 7) == (3, 7)
    assert distributed_eval_counts(lambda idx: sum(i < 5 for i in idx), 10, 0, 1) == (5, 10)
    with pytest.raises(ValueError):
        distributed_eval_counts(lambda idx: len(idx) + 1, 10, 0, 1)


def test_fingerprint_and_model():
    a = torch.arange(5.0)
    assert torch.equal(dataset_fingerprint(a), dataset_fingerprint(a.clone()))
    assert not torch.equal(dataset_fingerprint(a), dataset_fingerprint(a.flip(0)))
    assert same_on_all_ranks(a) is True  # no process group
    logits = always_class_one_model()(torch.arange(10.0).unsqueeze(1))
    assert logits.shape == (10, 2) and (logits.argmax(1) == 1).all()


def test_plot_assignment_draws_every_cell():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plot_assignment(sampler_assignment(10, 3), 10, title="t")
    assert ax.get_title() == "t" and ax.get_xlabel() == "dataset index" and ax.get_ylabel() == "rank"
    assert len(ax.texts) == 12
    assert ax.get_legend() is not None
    plt.close(ax.figure)


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::helpers.launch.OversubscriptionWarning")
@pytest.mark.usefixtures("no_leftover_processes")
def test_sampler_worker_three_ranks_live():
    results = launch(sampler_worker, 3, 0, n_items=8, eval_items=10, n_right=5, epochs=2, timeout=200)
    expected = assignment_lists(sampler_assignment(8, 3))
    for r, res in enumerate(results):
        assert [i for i, _ in res["shared_seen"]] == expected[r]
        assert [i for i, _ in res["own_seen"]] == expected[r]
        assert res["shared_same"] is True and res["own_same"] is False
        assert res["eval"]["unpadded"] == (5, 10)
        assert res["eval"]["padded"] == (7, 12)
        assert res["eval"]["drop_last"] == (5, 9)
        assert res["eval_seen"]["padded"] == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]][r]
        assert res["eval_seen"]["unpadded"] == unpadded_shard_indices(10, r, 3)
        o = res["orders"]
        assert o["without set_epoch"][0] == o["without set_epoch"][1]
        assert o["with set_epoch"][1] == sampler_indices(8, 3, r, shuffle=True, seed=0, epoch=1)

