"""helpers.mnist_train (the packaged form of notebook 04's loop): config checks, the evaluation,
and short real runs: 2 gloo ranks follow 1 step by step, as DDP with a mean loss must."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from helpers.engine import launch
from helpers.mnist_train import TrainConfig, build_model, ddp_train_worker, distributed_accuracy, peak_rss_mib
from launch_workers import accuracy_odd

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("kwargs, words", [
    (dict(global_batch_size=0), "global_batch_size"), (dict(lr=0.0), "lr"), (dict(lr=-0.1), "lr"),
    (dict(global_batch_size=64.0), "global_batch_size"), (dict(epochs=0), "epochs"),
    (dict(max_steps=-1), "max_steps"), (dict(model="mlp"), "model"),
    (dict(eval_batch_size=0), "eval_batch_size"),
])
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


def test_max_steps_zero_means_full_epochs_and_the_count_needs_no_torch():
    """07a's and 07b's parameter checks count steps before torch is imported: helpers.mnist_steps,
    which TrainConfig.total_steps calls."""
    assert TrainConfig(max_steps=0).max_steps is None
    assert TrainConfig().total_steps(60_000, 1) == 938  # 937 full batches of 64 + one of 32
    assert TrainConfig().total_steps(60_000, 2) == 938
    assert TrainConfig(epochs=2).total_steps(60_000, 4) == 2 * 938
    assert TrainConfig(max_steps=200).total_steps(60_000, 2) == 200
    code = ("import sys; from helpers.mnist_steps import total_steps; "
            "assert 'torch' not in sys.modules, 'helpers.mnist_steps imported torch'; print(total_steps(60000, 64, 2))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "938", done.stderr


def test_models_have_the_seed_shapes_and_seeded_weights():
    x = torch.randn(5, 1, 28, 28)
    for name in ("linear", "cnn"):
        a, b = build_model(name, seed=3), build_model(name, seed=3)
        assert a(x).shape == (5, 10)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), f"{name}: same seed should give identical weights"


# ------------------------------------------------------------------------------ evaluation


def test_distributed_accuracy_single_process_and_errors_and_peak_rss():
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
    assert 10 < peak_rss_mib() < 1e6  # MiB, for the lessons' memory claims


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::helpers.engine.OversubscriptionWarning")
@pytest.mark.usefixtures("no_leftover_processes")
def test_distributed_accuracy_counts_each_item_once_on_three_ranks():
    """11 items on 3 real ranks, item i right when odd: 5 of 11 on every rank. The sampler's padded
    shards would count 12 items, item 0 twice: 5 of 12."""
    assert launch(accuracy_odd, 3, 11, timeout=200) == [5 / 11] * 3


# ------------------------------------------------------------------------------ real runs


@pytest.mark.slow(5)
@pytest.mark.usefixtures("no_leftover_processes")
def test_ddp_two_ranks_follow_one():
    config = TrainConfig(max_steps=40, progress=False)
    (one,) = launch(ddp_train_worker, 1, config, timeout=240)
    first, last = sum(one["losses"][:5]) / 5, sum(one["losses"][-5:]) / 5
    assert last < 0.7 * first, f"loss should fall: {first:.3f} -> {last:.3f}"
    assert one["test_accuracy"] > 0.6, "40 steps of SGD already get most digits right"
    r0, r1 = launch(ddp_train_worker, 2, config, timeout=240)
    assert (r0["rank"], r1["rank"], r0["batch_per_rank"], r0["steps"], r0["samples"]) == (0, 1, 32, 40, 40 * 64)
    assert r0["local_losses"] != r1["local_losses"], "ranks must see different images"
    assert (r0["losses"], r0["test_accuracy"]) == (r1["losses"], r1["test_accuracy"]), "all-reduced: equal"
    assert_close(torch.tensor(r0["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5)
    assert abs(r0["test_accuracy"] - one["test_accuracy"]) <= 2e-4  # at most 2 of 10,000 images
