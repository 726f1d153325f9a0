"""Tests for helpers.pitfalls (notebook 06's helpers), without running the notebook.

In-process (fast): the hand formulas (Join, unequal batch sizes), the BatchNorm simulations and
references, the DataParallel BatchNorm emulation, the error parser, float32 summation orders,
the configuration checks, ``env_var``.

Through the real launcher (two launches, about 30-60 s on a loaded 2-core machine):

* one ``pitfalls_worker`` launch with small sizes runs sections 1-5 and 7-9 and checks their
  key values (the same values the notebook asserts);
* ``init_alone_worker`` relays a ``DistStoreError`` with a traceback.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from helpers.launch import WorkerError, launch
from helpers.pitfalls import (
    ACCUMULATION_VARIANTS,
    EVAL_HANG_CASES,
    PitfallsConfig,
    accumulation_batch,
    accumulation_model,
    accumulation_reference,
    bn_batches,
    checkpoint_worker,
    emulated_dp_batchnorm,
    env_var,
    float32_sum_orders,
    init_alone_worker,
    is_timeout_error,
    join_expected_grads,
    join_inputs,
    parse_unused_parameter_error,
    pitfalls_worker,
    seeded_training,
    simulate_bn_buffers,
    unequal_batch_data,
    unequal_batch_reference,
)


# ---------------------------------------------------------------------------------------------
# in-process
# ---------------------------------------------------------------------------------------------
def test_join_inputs_and_expected_grads_by_hand():
    assert join_inputs(0, 2) == [1.0, 2.0]
    assert join_inputs(1, 2) == [11.0, 12.0, 13.0]
    assert join_expected_grads(2, 2, True) == [[6.0, 7.0], [6.0, 7.0, 6.5]]
    assert join_expected_grads(2, 2, False) == [[6.0, 7.0], [6.0, 7.0, 13.0]]
    # 3 ranks: step 3 only rank 2 (x = 24); step 2 ranks 1 and 2 (13 + 23)
    initial = join_expected_grads(3, 2, True)
    active = join_expected_grads(3, 2, False)
    assert initial[2] == [pytest.approx((1 + 11 + 21) / 3), pytest.approx((2 + 12 + 22) / 3), 12.0, 8.0]
    assert active[2][2:] == [18.0, 24.0]


def test_unequal_batch_reference_by_hand():
    assert [s.tolist() for s in unequal_batch_data(2)] == [[1.0], [2.0, 3.0]]
    ref = unequal_batch_reference(2)
    assert ref["mean_of_rank_means"] == pytest.approx(7.5)
    assert ref["global_mean"] == pytest.approx(28 / 3)
    assert [len(s) for s in unequal_batch_data(4)] == [1, 2, 3, 4]


def test_accumulation_reference_equals_mean_of_micro_batch_gradients():
    config = PitfallsConfig(accum_steps=3, micro_batch=2)
    x, y = accumulation_batch(2, config)
    assert x.shape == (2 * 3 * 2, config.features) and x.dtype == torch.float64
    ref = accumulation_reference(2, config)
    model = accumulation_model(config.features, config.seed)
    for xb, yb in zip(x.split(2), y.split(2)):  # 6 micro-batches, each loss / 6
        (nn.functional.mse_loss(model(xb), yb) / 6).backward()
    assert_close(model.weight.grad, ref["weight"])
    assert_close(model.bias.grad, ref["bias"])


def test_simulate_bn_buffers_rank0_alone_and_no_broadcast_is_local():
    config = PitfallsConfig(bn_steps=3)
    batches = [bn_batches(r, config) for r in range(3)]
    with_bc = simulate_bn_buffers(batches, True)
    without = simulate_bn_buffers(batches, False)
    for r in range(3):
        local = nn.BatchNorm1d(config.bn_channels, dtype=torch.float64)
        for b in batches[r]:
            local(b)
        assert_close(without[r]["running_mean"], local.running_mean)
    assert_close(with_bc[0]["running_mean"], without[0]["running_mean"])  # rank 0: its data alone
    # rank 1 = rank 0's buffers after 2 steps, updated with rank 1's last batch
    base = nn.BatchNorm1d(config.bn_channels, dtype=torch.float64)
    for b in batches[0][:2]:
        base(b)
    base(batches[1][2])
    assert_close(with_bc[1]["running_mean"], base.running_mean)
    assert_close(with_bc[1]["running_var"], base.running_var)


def test_emulated_dp_batchnorm_per_chunk_statistics_and_chunk0_buffers():
    torch.manual_seed(0)
    x = torch.randn(10, 3, dtype=torch.float64) * 2 + 1
    bn = nn.BatchNorm1d(3, dtype=torch.float64)
    out = emulated_dp_batchnorm(bn, x, 3)  # chunks of 4, 4, 2
    chunks = x.chunk(3)
    expected = torch.cat([(c - c.mean(0)) / torch.sqrt(c.var(0, unbiased=False) + bn.eps) for c in chunks])
    assert_close(out.detach(), expected)
    assert_close(bn.running_mean, 0.1 * chunks[0].mean(0))
    assert_close(bn.running_var, 0.9 + 0.1 * chunks[0].var(0))
    assert int(bn.num_batches_tracked) == 1
    # one replica: the module on the whole batch
    bn1, bn2 = nn.BatchNorm1d(3, dtype=torch.float64), nn.BatchNorm1d(3, dtype=torch.float64)
    assert_close(emulated_dp_batchnorm(bn1, x, 1), bn2(x))


def test_parse_unused_parameter_error():
    msg = ("Expected to have finished reduction ...\nParameters which did not receive grad for rank 1: "
           "head_b.bias, head_b.weight\nParameter indices which did not receive grad for rank 1: 2 3\n")
    assert parse_unused_parameter_error(msg) == {"rank": 1, "indices": [2, 3], "names": ["head_b.bias", "head_b.weight"]}
    assert parse_unused_parameter_error("Parameter indices which did not receive grad for rank 0: 5") == {
        "rank": 0, "indices": [5], "names": None}
    assert parse_unused_parameter_error("something else") == {"rank": None, "indices": [], "names": None}


def test_is_timeout_error():
    assert is_timeout_error("RuntimeError: [x/unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to complete")
    assert is_timeout_error("RuntimeError: Application timeout caused pair closure")
    assert not is_timeout_error("RuntimeError: Connection closed by peer") and not is_timeout_error(None)


def test_float32_sum_orders_differ():
    assert float32_sum_orders() == {"left_to_right": 1.0, "pairs": 2.0}


def test_config_check_names_the_setting():
    PitfallsConfig().check(2)
    PitfallsConfig().check(4)
    with pytest.raises(ValueError, match="world_size >= 2"):
        PitfallsConfig().check(1)
    with pytest.raises(ValueError, match="eval_samples=64 is not divisible by world_size=3"):
        PitfallsConfig().check(3)
    with pytest.raises(ValueError, match="accum_steps"):
        PitfallsConfig(accum_steps=0).check(2)


def test_seeded_training_single_process_learns():
    config = PitfallsConfig(seed_steps=20)
    plain = seeded_training(0, 1, config, augment=False)
    assert len(plain["loss"]) == 21 and plain["loss"][-1] < 0.1 * plain["loss"][0]
    again = seeded_training(0, 1, config, augment=False)
    for n in plain["final"]:  # deterministic on CPU
        assert torch.equal(plain["final"][n], again["final"][n])


def test_env_var_restores():
    name = "DDP_LAB_TEST_PITFALLS_VAR"
    assert name not in os.environ
    with env_var(name, "DETAIL"):
        assert os.environ[name] == "DETAIL"
    assert name not in os.environ
    os.environ[name] = "old"
    try:
        with env_var(name, "new"):
            assert os.environ[name] == "new"
        assert os.environ[name] == "old"
    finally:
        del os.environ[name]


def test_checkpoint_worker_needs_a_directory():
    with pytest.raises(ValueError, match="ckpt_dir"):
        checkpoint_worker(0, 2, PitfallsConfig(ckpt_dir=None))


# ---------------------------------------------------------------------------------------------
# through the launcher
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_pitfalls_worker_key_values(no_leftover_processes):
    config = PitfallsConfig(accum_steps=3, seed_steps=10, collective_timeout_s=2.0)
    with tempfile.TemporaryDirectory() as d:
        config = dataclasses.replace(config, ckpt_dir=d)
        res = launch(pitfalls_worker, 2, config, backend="gloo", timeout=200)
    k = config.accum_steps

    acc = [r["accumulation"] for r in res]
    assert set(acc[0]) == set(ACCUMULATION_VARIANTS)
    ref = accumulation_reference(2, config)
    calls = {v: acc[0][v]["allreduce_calls"] for v in ACCUMULATION_VARIANTS}
    assert calls == {"no_sync_all_but_last": 1, "one_big_batch": 1, "sync_every_micro_batch": k,
                     "off_by_one": 1, "forward_outside": k, "backward_outside": 1}
    for a in acc:
        assert_close(a["no_sync_all_but_last"]["grad_weight"], ref["weight"])
        assert_close(a["backward_outside"]["grad_weight"], ref["weight"])
    assert (acc[0]["off_by_one"]["weight_after"] - acc[1]["off_by_one"]["weight_after"]).abs().max() > 1e-6

    join = [r["join"] for r in res]
    assert join[0]["no_join"]["error"] is None and is_timeout_error(join[1]["no_join"]["error"])
    assert join[1]["join_divide_initial"]["grads"] == [6.0, 7.0, 6.5]
    assert join[1]["join_divide_active"]["grads"] == [6.0, 7.0, 13.0]

    for r, u in enumerate(res_r["unused"] for res_r in res):
        assert u["default"]["error_iteration"] == 1
        assert parse_unused_parameter_error(u["default"]["error"])["indices"] == [2, 3]
        assert parse_unused_parameter_error(u["default_debug_info"]["error"])["names"] == ["head_b.bias", "head_b.weight"]
        assert_close(u["default"]["grads"][0]["head_a.weight"], torch.full((2, 2), float(r + 1)))  # never averaged
        assert u["find_unused_parameters"]["error"] is None
        assert_close(u["find_unused_parameters"]["grads"][2]["head_a.weight"], torch.full((2, 2), 3.5))
        assert u["static_graph_output_returned"]["error_iteration"] == 2
        assert u["static_graph_output_dropped"]["error"] is None

    assert [r["unequal"]["naive"] for r in res] == [pytest.approx(7.5)] * 2
    assert [r["unequal"]["weighted"] for r in res] == [pytest.approx(28 / 3)] * 2

    bn = [r["batchnorm"] for r in res]
    assert bn[0]["syncbn_error"].startswith("ValueError: SyncBatchNorm expected input tensor to be on GPU")
    assert_close(bn[0]["broadcast_buffers_true"]["running_mean"], bn[0]["local"]["running_mean"])
    assert not torch.allclose(bn[1]["broadcast_buffers_true"]["running_mean"], bn[1]["local"]["running_mean"])
    assert_close(bn[1]["wrap_forward_sync_buffers_false"]["after"]["running_mean"],
                 bn[0]["wrap_forward_sync_buffers_false"]["before"]["running_mean"])
    assert_close(bn[1]["wrap_broadcast_buffers_false"]["after"]["running_mean"],
                 bn[1]["wrap_broadcast_buffers_false"]["before"]["running_mean"])

    for c in (res_r["checkpoint"] for res_r in res):
        assert c["wrapper_keys"] == ["module.weight", "module.bias"] and c["files"] == ["checkpoint.pt"]
        assert (len(c["missing_keys"]), len(c["unexpected_keys"])) == (2, 2)
        assert all(torch.equal(c["resumed"][n], c["uninterrupted"][n]) for n in c["resumed"])

    ev = res[0]["evaluation"]
    assert set(ev["hang_cases"]) == set(EVAL_HANG_CASES)
    assert is_timeout_error(ev["hang_cases"]["bn_wrapper_eval_no_grad"]["result"])
    assert is_timeout_error(ev["hang_cases"]["linear_wrapper_grad_after_1_step"]["result"])
    for case in ("bn_module_eval_no_grad", "linear_wrapper_no_grad", "linear_wrapper_grad_after_2_steps"):
        assert ev["hang_cases"][case]["result"] == "returned", case
    assert res[1]["evaluation"]["global"] == ev["global"]

    seeds = [r["seeds"] for r in res]
    assert torch.equal(seeds[1]["init_rank_seed_after_ddp"]["weight"], seeds[0]["init_rank_seed"]["weight"])
    assert torch.equal(seeds[1]["noise_same_seed"], seeds[0]["noise_same_seed"])
    assert not torch.equal(seeds[1]["noise_rank_seed"], seeds[0]["noise_rank_seed"])
    one = seeded_training(0, 1, config, augment=False)
    assert_close(seeds[0]["plain"]["final"]["weight"], one["final"]["weight"])

    for r in res:
        assert "Detected mismatch between collectives on ranks" in r["debug"]["detail"]
        assert "Detected mismatch" not in r["debug"]["off"]


@pytest.mark.timeout(120)
def test_init_alone_worker_relays_a_store_timeout(no_leftover_processes):
    with pytest.raises(WorkerError) as info:
        launch(init_alone_worker, 1, 1.0, backend="gloo", timeout=90)
    e = info.value
    assert (e.rank, e.exc_type) == (0, "DistStoreError")
    assert "1/2 clients joined" in e.message
    assert "in init_alone_worker" in e.traceback and "TCPStore" in e.traceback
