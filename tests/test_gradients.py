"""Tests for helpers.gradients (notebook 01's helpers), without running the notebook.

* the CPU emulation of DataParallel gives the single-device gradient (several shapes, uneven
  and short batches), chunks like DP's scatter, and sums replica gradients into the original;
* the scalar toy's hand-computed numbers (60 / 0.94, 15 / 0.985);
* the DDP workers through the real launcher: row r of the weight gradient is x[r] / world_size,
  and the sum-versus-mean numbers of the issue.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from helpers.gradients import (
    SCALAR_X,
    EmulatedDataParallel,
    ddp_linear_worker,
    ddp_notebook01_worker,
    ddp_scalar_worker,
    linear_toy_batch,
    linear_toy_loss,
    linear_toy_model,
    scalar_sgd_step,
    single_device_grads,
)
from helpers.launch import OversubscriptionWarning, launch


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# EmulatedDataParallel
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "in_f, hidden, out_f, batch, replicas",
    [
        (2, None, 3, 2, 2),  # the notebook's toy
        (5, 7, 3, 8, 2),  # even split, MLP
        (4, 6, 2, 5, 2),  # uneven: chunks 3 + 2
        (3, 4, 1, 7, 3),  # uneven: chunks 3 + 3 + 1
        (3, None, 2, 2, 4),  # more replicas than samples: DP uses only 2
        (6, 5, 4, 9, 1),  # one device: DP calls the module directly
    ],
)
def test_emulated_dp_equals_single_device_gradient(in_f, hidden, out_f, batch, replicas):
    torch.manual_seed(in_f * 100 + batch)
    if hidden is None:
        model = nn.Linear(in_f, out_f, dtype=torch.float64)
    else:
        model = nn.Sequential(nn.Linear(in_f, hidden), nn.Tanh(), nn.Linear(hidden, out_f)).double()
    x = torch.randn(batch, in_f, dtype=torch.float64)
    target = torch.randn(batch, out_f, dtype=torch.float64)

    reference = nn.functional.mse_loss(model(x), target)
    reference.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    dp = EmulatedDataParallel(model, num_replicas=replicas)
    out = dp(x)
    assert out.shape == (batch, out_f)
    assert_close(out, model(x))
    nn.functional.mse_loss(out, target).backward()
    got = _grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        assert_close(got[name], expected[name], msg=f"{name}: emulated DP gradient != single-device gradient")

    # DP's chunking (tensor.chunk), and the replicas' gradients sum into the original parameters
    assert [c.shape[0] for c in dp.last_chunks] == [c.shape[0] for c in x.chunk(replicas)]
    assert len(dp.last_replica_params) == len(dp.last_chunks)
    for name in expected:
        total = sum(params[name].grad for params in dp.last_replica_params)
        assert_close(total, got[name])


def test_emulated_dp_chunk_sizes_follow_dataparallel():
    model = nn.Linear(1, 1)
    for batch, replicas, sizes in [(5, 2, [3, 2]), (2, 4, [1, 1]), (6, 3, [2, 2, 2]), (7, 3, [3, 3, 1])]:
        dp = EmulatedDataParallel(model, replicas)
        dp(torch.zeros(batch, 1))
        assert [c.shape[0] for c in dp.last_chunks] == sizes, (batch, replicas)


def test_emulated_dp_replica_gradient_is_its_chunks_gradient():
    n = 3
    x, labels = linear_toy_batch(n, seed=1)
    model = linear_toy_model(n, seed=1)
    dp = EmulatedDataParallel(model, n)
    linear_toy_loss(dp(x), labels).backward()
    for r, params in enumerate(dp.last_replica_params):
        expected = torch.zeros(n + 1, 2)
        expected[r] = x[r]
        assert_close(params["weight"].grad + 0.0, expected)


def test_emulated_dp_errors():
    with pytest.raises(ValueError, match="num_replicas"):
        EmulatedDataParallel(nn.Linear(1, 1), 0)
    dp = EmulatedDataParallel(nn.Linear(1, 1), 2)
    with pytest.raises(ValueError, match="non-empty batch"):
        dp(torch.zeros(0, 1))
    with pytest.raises(ValueError, match="non-empty batch"):
        dp(torch.tensor(1.0))


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the CPU-only behaviour of nn.DataParallel")
def test_dataparallel_on_cpu_has_no_devices_and_calls_module_once():
    model = nn.Linear(2, 3)
    dp = nn.DataParallel(model)
    assert dp.device_ids == []
    calls = []
    model.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape[0]))
    x = torch.randn(4, 2)
    assert_close(dp(x), model(x))
    assert calls == [4, 4]  # one call each: dp(x) and model(x); no splitting


# ---------------------------------------------------------------------------------------------
# The toys
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5])
def test_linear_toy_single_device_gradient(n):
    x, labels = linear_toy_batch(n, seed=3)
    assert x.shape == (n, 2) and x.dtype == torch.float32
    assert labels.shape == (n, n + 1) and torch.equal(labels.argmax(dim=1), torch.arange(n))
    assert (x.abs().sum(dim=1) > 0).all()
    model = linear_toy_model(n, seed=3)
    assert (model.in_features, model.out_features) == (2, n + 1)
    assert model.weight.grad is None
    g = single_device_grads(model, x, labels)
    assert model.weight.grad is None, "single_device_grads must leave the model's .grad untouched"
    expected = torch.zeros(n + 1, 2)
    expected[:n] = x
    assert_close(g["weight"], expected)
    assert_close(g["bias"], torch.cat([torch.ones(n), torch.zeros(1)]))


def test_toy_constructors_reject_bad_world_size():
    with pytest.raises(ValueError):
        linear_toy_model(0)
    with pytest.raises(ValueError):
        linear_toy_batch(0)


def test_scalar_sgd_step_numbers():
    for wrap in (None, lambda m: EmulatedDataParallel(m, 2), nn.DataParallel if not torch.cuda.is_available() else None):
        s = scalar_sgd_step(SCALAR_X, "sum", 1e-3, wrap=wrap)
        m = scalar_sgd_step(SCALAR_X, "mean", 1e-3, wrap=wrap)
        assert_close((s["grad"], s["w"], s["loss"]), (60.0, 0.94, 30.0))
        assert_close((m["grad"], m["w"], m["loss"]), (15.0, 0.985, 7.5))
    with pytest.raises(ValueError, match="reduction"):
        scalar_sgd_step(SCALAR_X, "max")


def test_workers_check_their_inputs_before_any_collective():
    with pytest.raises(ValueError, match="not divisible"):
        ddp_scalar_worker(0, 3, SCALAR_X)
    x, labels = linear_toy_batch(2)
    with pytest.raises(ValueError, match="one sample per rank"):
        ddp_linear_worker(0, 3, x, labels)


# ---------------------------------------------------------------------------------------------
# DDP workers through the launcher
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_ddp_notebook01_worker_world_size_2(no_leftover_processes):
    x, labels = linear_toy_batch(2, seed=0)
    results = launch(ddp_notebook01_worker, 2, x, labels, seed=0, scalar_x=SCALAR_X, lr=1e-3, timeout=150)
    assert len(results) == 2
    for r, res in enumerate(results):
        lin = res["linear"]
        local = torch.zeros(3, 2)
        local[r] = x[r]
        assert_close(lin["local_weight_grad"], local)
        assert_close(lin["ddp_weight_grad"][r], x[r] / 2)
        assert_close(lin["ddp_weight_grad"][2], torch.zeros(2))
        assert_close(lin["ddp_bias_grad"], torch.tensor([0.5, 0.5, 0.0]))
        sc = res["scalar"]
        expected = {"sum": (30.0, 0.97), "mean": (15.0, 0.985), "sum_x_world": (60.0, 0.94), "mean_x_world": (30.0, 0.97)}
        for case, (grad, w) in expected.items():
            assert_close((sc[case]["grad"], sc[case]["w"]), (grad, w), msg=f"rank {r}, {case}")


@pytest.mark.timeout(180)
def test_ddp_linear_worker_row_r_is_x_r_over_n(no_leftover_processes):
    n = 3
    x, labels = linear_toy_batch(n, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversubscriptionWarning)  # 3 ranks may exceed the cores
        results = launch(ddp_linear_worker, n, x, labels, seed=5, timeout=150)
    for r, res in enumerate(results):
        assert_close(res["x"], x[r])
        for s in range(n):
            assert_close(res["ddp_weight_grad"][s], x[s] / n, msg=f"rank {r}: row {s} should be x[{s}] / {n}")
        assert_close(res["ddp_weight_grad"][n], torch.zeros(2))
        assert_close(res["ddp_bias_grad"], torch.cat([torch.full((n,), 1 / n), torch.zeros(1)]))
        assert_close(res["weight"], results[0]["weight"], msg="every rank starts from the same parameters")
