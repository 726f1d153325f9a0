"""helpers.mnist_train (notebook 04): config checks, the data order, and short real runs.

The DDP test starts 2 real gloo workers through helpers.engine.launch and checks that DDP with a mean
loss follows the single-process loss curve and weights step by step.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import DistributedSampler, TensorDataset

from helpers.engine import launch
from helpers.mnist_steps import total_steps
from helpers.mnist_train import (
    TrainConfig,
    build_model,
    ddp_train_worker,
    distributed_accuracy,
    epoch_permutation,
    peak_rss_mib,
    summarize_ddp,
    train_dp,
    train_single,
)

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(global_batch_size=0), "global_batch_size"),
        (dict(global_batch_size=64.0), "global_batch_size"),
        (dict(lr=0.0), "lr"),
        (dict(lr=-0.1), "lr"),
        (dict(epochs=0), "epochs"),
        (dict(max_steps=-1), "max_steps"),
        (dict(model="mlp"), "model"),
        (dict(snapshot_step=-2), "snapshot_step"),
        (dict(eval_batch_size=0), "eval_batch_size"),
    ],
)
def test_config_rejects_bad_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**kwargs)


def test_batch_per_rank_and_divisibility_message():
    config = TrainConfig(global_batch_size=64)
    assert [config.batch_per_rank(w) for w in (1, 2, 4, 8)] == [64, 32, 16, 8]
    with pytest.raises(ValueError, match=r"global_batch_size=64 is not divisible by world_size=3") as info:
        config.batch_per_rank(3)
    assert "63" in str(info.value) and "66" in str(info.value), "the message should suggest divisible sizes"
    with pytest.raises(ValueError, match="world_size"):
        config.batch_per_rank(0)


def test_max_steps_zero_means_full_epochs_and_total_steps():
    assert TrainConfig(max_steps=0).max_steps is None
    assert TrainConfig().total_steps(60_000, 1) == 938  # 937 full batches of 64 + one of 32
    assert TrainConfig().total_steps(60_000, 2) == 938
    assert TrainConfig(epochs=2).total_steps(60_000, 4) == 2 * 938
    assert TrainConfig(max_steps=200).total_steps(60_000, 2) == 200


def test_the_step_count_has_one_home_without_torch():
    """07a's and 07b's parameter checks count steps before torch is imported: helpers.mnist_steps,
    which TrainConfig.total_steps calls."""
    code = ("import sys; from helpers.mnist_steps import total_steps; "
            "assert 'torch' not in sys.modules, 'helpers.mnist_steps imported torch'; print(total_steps(60000, 64, 2))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "938", done.stderr
    for world_size, batch, epochs, cap in [(1, 64, 1, None), (2, 64, 2, 0), (3, 96, 1, 5), (4, 64, 3, 10_000),
                                           (8, 8, 1, None), (6, 60, 2, 123)]:
        config = TrainConfig(global_batch_size=batch, epochs=epochs, max_steps=cap)
        assert config.total_steps(60_000, world_size) == total_steps(60_000, batch, world_size, epochs=epochs,
                                                                     max_steps=cap)


def test_models_have_the_seed_shapes_and_seeded_weights():
    x = torch.randn(5, 1, 28, 28)
    for name in ("linear", "cnn"):
        a, b = build_model(name, seed=3), build_model(name, seed=3)
        assert a(x).shape == (5, 10)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), f"{name}: same seed should give identical weights"
    assert sum(p.numel() for p in build_model("linear").parameters()) == 7850


# ------------------------------------------------------------------------------ data order


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_distributed_sampler_gives_strided_slices_of_each_global_batch(world_size):
    n, batch, seed, epoch = 1000, 64, 7, 3
    dataset = TensorDataset(torch.arange(n))
    perm = epoch_permutation(n, seed, epoch)
    b = batch // world_size
    per_rank = []
    for r in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        per_rank.append(torch.tensor(list(sampler)))
    for s in range(n // batch):
        global_batch = perm[s * batch : (s + 1) * batch]
        for r in range(world_size):
            assert torch.equal(per_rank[r][s * b : (s + 1) * b], global_batch[r::world_size])


# ------------------------------------------------------------------------------ evaluation


def test_distributed_accuracy_single_process_and_errors():
    model = build_model("linear", seed=0)
    images, labels = torch.randn(250, 1, 28, 28), torch.randint(0, 10, (250,))
    with torch.no_grad():
        expected = (model(images).argmax(1) == labels).float().mean().item()
    assert distributed_accuracy(model, images, labels, 0, 1, batch_size=64) == pytest.approx(expected)
    assert model.training, "evaluation should restore training mode"
    with pytest.raises(ValueError, match="labels"):
        distributed_accuracy(model, images, labels[:10], 0, 1)
    with pytest.raises(ValueError, match="rank"):
        distributed_accuracy(model, images, labels, 1, 1)
    with pytest.raises(RuntimeError, match="process group"):
        distributed_accuracy(model, images, labels, 0, 2)


def test_peak_rss_is_positive_mib():
    assert 10 < peak_rss_mib() < 1e6


# ------------------------------------------------------------------------------ real runs


@pytest.fixture(scope="module")
def single_short():
    return train_single(TrainConfig(max_steps=40, progress=False, snapshot_step=8))


@pytest.mark.slow(6)
def test_single_process_short_run_learns(single_short):
    h = single_short
    assert h["mode"] == "single" and h["steps"] == 40 and len(h["losses"]) == 40
    assert h["samples"] == 40 * 64 and h["samples_per_s"] > 0 and h["seconds"] > 0
    first, last = sum(h["losses"][:5]) / 5, sum(h["losses"][-5:]) / 5
    assert last < 0.7 * first, f"loss should fall: {first:.3f} -> {last:.3f}"
    assert h["test_accuracy"] > 0.6, "40 steps of SGD already get most digits right"
    assert h["peak_rss_mib"] > 0 and set(h["snapshot"]) == {"1.weight", "1.bias"}


def test_snapshot_beyond_the_run_is_an_error():
    with pytest.raises(ValueError, match="snapshot_step"):
        train_single(TrainConfig(max_steps=2, snapshot_step=5, progress=False))


@pytest.mark.slow(2)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU pass-through is what is checked here")
def test_dp_on_cpu_is_the_single_process_run(single_short):
    dp = train_dp(TrainConfig(max_steps=40, progress=False, snapshot_step=8))
    assert dp["dp_device_ids"] == []
    assert dp["losses"] == single_short["losses"], "DP on CPU just calls the module: bit-identical run"
    assert dp["test_accuracy"] == single_short["test_accuracy"]


@pytest.mark.slow(3)
@pytest.mark.usefixtures("no_leftover_processes")
def test_ddp_two_ranks_follows_single_process(single_short):
    histories = launch(ddp_train_worker, 2, TrainConfig(max_steps=40, progress=False, snapshot_step=8), timeout=240)
    assert [h["rank"] for h in histories] == [0, 1]
    assert all(h["batch_per_rank"] == 32 and h["steps"] == 40 for h in histories)
    assert histories[0]["local_losses"] != histories[1]["local_losses"], "ranks must see different images"
    ddp = summarize_ddp(histories)  # all ranks agree on the global curve and the accuracy
    assert_close(torch.tensor(ddp["losses"]), torch.tensor(single_short["losses"]), rtol=1e-4, atol=1e-5)
    for name, w in single_short["snapshot"].items():
        assert_close(ddp["snapshot"][name], w, rtol=1e-4, atol=1e-5)
    assert abs(ddp["test_accuracy"] - single_short["test_accuracy"]) <= 2e-4  # at most 2 of 10,000 images
    assert len(ddp["peak_rss_mib_per_rank"]) == 2 and ddp["samples"] == 40 * 64

