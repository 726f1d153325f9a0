"""helpers.replicas (notebook 02): the toy, the reference step, and the DDP worker in real processes;
notebook 02 itself is executed by tests/test_notebooks.py and checked by tests/test_notebook_hygiene.py."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.testing import assert_close

from helpers.launch import launch
from helpers.replicas import (
    STAGES,
    TaggedLinear,
    all_gather_max_diff,
    local_gradient,
    make_replica,
    max_cross_rank_diff,
    replicas_worker,
    snapshot,
)


def test_make_replica_is_reproducible_and_rank_specific():
    m0, x0, y0 = make_replica(0, base_seed=7, batch_size=3)
    again, xa, ya = make_replica(0, base_seed=7, batch_size=3)
    m1, x1, _ = make_replica(1, base_seed=7, batch_size=3)
    assert isinstance(m0, TaggedLinear) and isinstance(m0, nn.Linear)
    assert m0.weight.shape == (5, 5) and m0.bias.shape == (5,)
    assert x0.shape == (3, 5) and y0.shape == (3, 5) and x0.dtype == torch.float32
    assert torch.equal(m0.weight, again.weight) and torch.equal(x0, xa) and torch.equal(y0, ya)
    assert not torch.equal(m0.weight, m1.weight) and not torch.equal(x0, x1)
    # base_seed + rank: rank 1 of seed 7 is rank 0 of seed 8
    m8, x8, _ = make_replica(0, base_seed=8, batch_size=3)
    assert torch.equal(m1.weight, m8.weight) and torch.equal(x1, x8)


def test_buffer_is_registered_and_attribute_is_not():
    m, _, _ = make_replica(2)
    assert "rank_buffer" in dict(m.named_buffers())
    assert "rank_attribute" not in m.state_dict()
    assert torch.equal(m.rank_buffer, torch.full((2,), 102.0))
    assert torch.equal(m.rank_attribute, torch.full((2,), 102.0))
    snap = snapshot(m)
    assert set(snap) == {"weight", "bias", "rank_buffer", "rank_attribute"}
    snap["weight"].add_(1.0)
    assert not torch.equal(snap["weight"], m.weight), "snapshot must copy"


@pytest.mark.parametrize("bad", [dict(rank=-1), dict(rank=0, batch_size=0)])
def test_make_replica_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        make_replica(**bad)


def test_local_gradient_matches_autograd_on_nn_linear():
    m, x, y = make_replica(0, batch_size=6)
    nn.functional.mse_loss(m(x), y).backward()
    g = local_gradient(m.weight, m.bias, x, y)
    assert_close(g["weight"], m.weight.grad)
    assert_close(g["bias"], m.bias.grad)


def test_max_cross_rank_diff():
    a = torch.zeros(2, 2)
    assert max_cross_rank_diff([a, a.clone()]) == 0.0
    assert max_cross_rank_diff([a, a + 0.5, a - 2.0]) == 2.0
    with pytest.raises(ValueError):
        max_cross_rank_diff([])
    m, _, _ = make_replica(0)
    assert all_gather_max_diff(m) == 0.0  # no process group: a single process agrees with itself


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("no_leftover_processes")
def test_replicas_worker_two_ranks_identical_and_equal_to_reference():
    world_size, base_seed, lr, batch_size = 2, 3, 0.01, 4
    results = launch(replicas_worker, world_size, base_seed, lr, batch_size, timeout=200)
    assert [r["rank"] for r in results] == [0, 1]
    rebuilt = [make_replica(r, base_seed, batch_size) for r in range(world_size)]

    def stage(s):
        return [res["stages"][s] for res in results]

    # before: each rank its own seed, so they differ
    for r, (m, x, y) in enumerate(rebuilt):
        assert torch.equal(stage(STAGES[0])[r]["weight"], m.weight.detach())
        assert torch.equal(results[r]["x"], x) and torch.equal(results[r]["y"], y)
    before = max_cross_rank_diff([s["weight"] for s in stage(STAGES[0])])
    assert before > 0
    # after DDP(...): bitwise rank 0's pre-wrap values, buffer broadcast, attribute untouched
    w0, b0 = rebuilt[0][0].weight.detach(), rebuilt[0][0].bias.detach()
    for r, s in enumerate(stage(STAGES[1])):
        assert torch.equal(s["weight"], w0) and torch.equal(s["bias"], b0)
        assert torch.equal(s["rank_buffer"], torch.full((2,), 100.0))
        assert torch.equal(s["rank_attribute"], torch.full((2,), 100.0 + r))
    # after the step: identical, and w0 - lr * mean of local gradients
    local = [local_gradient(w0, b0, x, y) for _, x, y in rebuilt]
    mean_gw = (local[0]["weight"] + local[1]["weight"]) / 2
    mean_gb = (local[0]["bias"] + local[1]["bias"]) / 2
    after = stage(STAGES[2])
    assert max_cross_rank_diff([s["weight"] for s in after]) == 0.0
    assert max_cross_rank_diff([s["bias"] for s in after]) == 0.0
    for r, s in enumerate(after):
        assert_close(results[r]["grad"]["weight"], mean_gw)
        assert_close(s["weight"], w0 - lr * mean_gw)
        assert_close(s["bias"], b0 - lr * mean_gb)
        assert torch.equal(s["rank_attribute"], torch.full((2,), 100.0 + r))
    # the workers' own all_gather agrees
    for res in results:
        assert res["all_gather_max_diff"][STAGES[0]] == pytest.approx(
            max(before, max_cross_rank_diff([s["bias"] for s in stage(STAGES[0])])))
        assert res["all_gather_max_diff"][STAGES[1]] == 0.0 == res["all_gather_max_diff"][STAGES[2]]
    assert results[0]["loss"] != results[1]["loss"], "different data per rank, different losses"

