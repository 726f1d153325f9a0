"""helpers.checks on small workers, each a mistake or its fix written as a learner writes it: the
cases of issue #49 point 5, the course's silent cases (06d, 06a's accumulation) and the healthy
loops of 04, 06a and 09. Simulated ranks mostly; the slow ones run real gloo ranks, MNIST or 64 ranks.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset, random_split

import _support
from helpers.checks import CoverageError, DivergedFromOneProcess, RandomnessDiffers, against_one_process, data_coverage

pytestmark = pytest.mark.timeout(300)


def batch(rank, world_size, step, size=8):
    """Step ``step``'s global batch (``size`` rows of 4 features, a target), rank ``rank``'s share."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(size, 4, generator=g), torch.randn(size, 1, generator=g)
    return x[rank::world_size], y[rank::world_size]


def model(seed=0, norm=None, p=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), norm or nn.Identity(), nn.ReLU(), nn.Dropout(p), nn.Linear(8, 1))


def ddp_loop(rank, world_size, mistake=None, steps=3):
    """A DDP loop on one global batch per step; ``mistake`` names the silent bug it makes."""
    norm = {"batchnorm": nn.BatchNorm1d(8), "layernorm": nn.LayerNorm(8)}.get(mistake)
    ddp = DDP(model(norm=norm, p=0.5 if mistake == "dropout" else 0.0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(rank, world_size, step)
        opt.zero_grad()
        out = ddp.module(x) if mistake == "bypass" else ddp(x)  # 06d: ddp.module(x) skips the all-reduce
        loss = F.mse_loss(out, y)
        if mistake == "scaled":
            loss = loss * world_size  # "DDP averages, so multiply back"
        if mistake == "inplace_mean":  # 06d: the mean loss reduced in place before backward()
            dist.all_reduce(loss)
            loss /= world_size
        loss.backward()
        opt.step()


def manual_loop(rank, world_size, seed_by_rank=False, steps=2):
    """No DDP: gradients averaged by hand; the init seeded per rank is the bug (nothing broadcasts it)."""
    m = model(seed=rank if seed_by_rank else 0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(rank, world_size, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()


def accumulation_loop(rank, world_size, off_by_one=False, k=2, steps=2):
    """06a: k micro-batches per step under no_sync() but the last; off_by_one syncs the first instead."""
    ddp = DDP(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(rank, world_size, step, size=8 * k)
        opt.zero_grad()
        for j in range(k):
            sync = j == 0 if off_by_one else j == k - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                (F.mse_loss(ddp(x[j::k]), y[j::k]) / k).backward()
        opt.step()


def sharded_loop(rank, world_size, how):
    """ZeRO-1 (SGD inside) or FSDP2 on the global batch; both must equal one process."""
    m = model()
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (m[0], m[4]):
            fully_shard(layer)
        opt = torch.optim.SGD(fully_shard(m).parameters(), lr=0.1)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        m = DDP(m)
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    for step in range(2):
        x, y = batch(rank, world_size, step)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def penalty_loop(rank, world_size, static_graph=False, steps=2):
    """Issue #49: a gradient penalty through torch.autograd.grad (of the input, as WGAN-GP). Under
    DDP(static_graph=True) each rank keeps its own gradient (measured: 16.0 and 144.0 at step 1)."""
    lin = nn.Linear(1, 1, bias=False)
    nn.init.ones_(lin.weight)
    ddp = DDP(lin, static_graph=static_graph)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(steps):
        x = torch.tensor([[1.0], [3.0]])[rank::world_size].requires_grad_(True)
        (g,) = torch.autograd.grad((ddp(x) ** 2).sum(), x, create_graph=True)
        opt.zero_grad()
        (g ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("fn, args", [(ddp_loop, ()), (ddp_loop, ("layernorm",)), (manual_loop, ()),
                                      (accumulation_loop, ()), (sharded_loop, ("zero",)), (sharded_loop, ("fsdp",)),
                                      (penalty_loop, ())])
def test_one_process_check_is_silent_on_healthy_loops_and_fixes(fn, args):
    report = against_one_process(fn, 4 if fn is not penalty_loop else 2, *args)
    assert report.steps >= 2 and report.parameters >= 1 and report.largest < 1e-5
    assert "= one process" in repr(report)


@pytest.mark.parametrize("fn, args, step, name", [
    (ddp_loop, ("scaled",), 1, "0.weight"), (ddp_loop, ("bypass",), 1, "0.weight"),
    (ddp_loop, ("inplace_mean",), 1, "0.weight"), (ddp_loop, ("batchnorm",), 1, "0.weight"),
    (manual_loop, (True,), 0, "0.weight"), (accumulation_loop, (True,), 1, "0.weight"),
    (penalty_loop, (True,), 1, "weight")])
def test_one_process_check_names_the_silent_mistakes(fn, args, step, name):
    with pytest.raises(DivergedFromOneProcess) as caught:
        against_one_process(fn, 4 if fn is not penalty_loop else 2, *args)
    text = str(caught.value)
    where = "before the first optimizer step" if step == 0 else f"after optimizer step {step}"
    assert f"{where}: parameter `{name}`" in text, text
    assert "one process: " in text and "Tolerance: |a - b| <= 1e-06 + 0.0001 * |b|" in text
    assert "global batch / N items" in text
    assert ("Usual causes: a loss scaled by world_size" in text) == (step > 0), text


def extra_step(rank, world_size):
    """A step with no gradient (no change) that only the ranks take: the step counts differ."""
    ddp_loop(rank, world_size, steps=2)
    if world_size > 1:
        torch.optim.SGD(model().parameters(), lr=0.1).step()


def no_loader(rank, world_size):
    return rank


def test_step_counts_loops_without_optimizer_and_randomness():
    with pytest.raises(DivergedFromOneProcess, match="2 ranks took 3 optimizer steps, one process took 2"):
        against_one_process(extra_step, 2)
    with pytest.raises(RuntimeError, match="no optimizer step"):
        against_one_process(given_loop, 2)
    with pytest.raises(RuntimeError, match="read no DataLoader pass"):  # not "each item read once"
        data_coverage(no_loader, 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        against_one_process(ddp_loop, 1)
    # steps= is the check's: the first step compared, and "1 optimizer step" in the singular
    assert ": 1 optimizer step, " in repr(against_one_process(ddp_loop, 2, steps=1))
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks  # nothing left installed
    assert (DataLoader.__iter__.__module__, DistributedSampler.__iter__.__module__) == (
        "torch.utils.data.dataloader", "torch.utils.data.distributed")
    with pytest.raises(RandomnessDiffers, match="dropout"):  # its own error, not a false divergence
        against_one_process(ddp_loop, 2, "dropout")


@pytest.mark.slow
def test_lesson_09_mlp_at_64_ranks_is_silent_and_the_tolerance_is_not_idle():
    """At 64 ranks reduction order moves the weights: a zero tolerance raises, the default does not."""
    from helpers.at_scale import global_batch_steps

    report = against_one_process(global_batch_steps, 64, 3, 64)
    assert report.steps == 3 and 0 < report.largest < 1e-6, report
    with pytest.raises(DivergedFromOneProcess, match="rtol|0 \\* \\|b\\|"):
        against_one_process(global_batch_steps, 64, 3, 64, rtol=0.0, atol=0.0)


@pytest.mark.slow
def test_lesson_04_mnist_worker_passes_both_checks():
    from helpers.mnist_train import TrainConfig, ddp_train_worker

    config = TrainConfig(max_steps=2, progress=False)
    assert against_one_process(ddp_train_worker, 2, config).steps == 2
    report = data_coverage(ddp_train_worker, 2, config)
    assert report.passes == [(0, 0, {0: 30000, 1: 30000}, 60000)]


@pytest.mark.slow
def test_real_gloo_ranks(no_leftover_processes):
    assert against_one_process(ddp_loop, 2, simulated=False).steps == 3
    with pytest.raises(DivergedFromOneProcess, match="after optimizer step 1"):
        against_one_process(ddp_loop, 2, "scaled", simulated=False)
    with pytest.raises(CoverageError, match="Never read"):
        data_coverage(loader_loop, 2, 10, "seed_by_rank", simulated=False)


# ---- data_coverage --------------------------------------------------------------------------------

def shard_of(n):
    """This rank's rows ``rank::world_size``, decided now: before the process group exists, every row."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return torch.arange(rank, n, world_size)


class Shards(IterableDataset):
    def __init__(self, n, by_worker=True):
        self.rows, self.by_worker = shard_of(n), by_worker

    def __iter__(self):
        info = torch.utils.data.get_worker_info()  # 10b: each worker runs the whole __iter__
        return iter(self.rows[info.id::info.num_workers] if info and self.by_worker else self.rows)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        self.rows = shard_of(n)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def loader_loop(rank, world_size, n=10, mistake=None, epochs=2):
    data = TensorDataset(torch.arange(n))
    if mistake == "split_seed_by_rank":  # 06d: random_split seeded with seed + rank
        data, _ = random_split(data, [n - 2, 2], generator=torch.Generator().manual_seed(rank))
    sampler = DistributedSampler(data, rank=0 if mistake == "wrong_rank" else None,
                                 seed=rank if mistake == "seed_by_rank" else 0,
                                 drop_last=mistake == "drop_last_twice")
    if mistake == "no_sampler":
        sampler = None
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        loader = DataLoader(data, batch_size=2, sampler=sampler, drop_last=mistake == "drop_last_twice")
        for i, _ in enumerate(loader):
            if mistake == "resume" and epoch == 0 and i == 0:
                break  # a checkpoint, a crash: the run resumes at epoch 0 and restarts its sampler
        if mistake == "resume" and epoch == 0:
            for _ in DataLoader(data, batch_size=2, sampler=sampler):
                pass


def given_loop(rank, world_size, data=None, workers=0, by_worker=True):
    """A loader over ``data``, by default a ``Shards`` built inside the rank (the group exists)."""
    for _ in DataLoader(data or Shards(10, by_worker), batch_size=2, num_workers=workers):
        pass


@pytest.mark.parametrize("n, ranks", [(10, 2), (16, 4)])
def test_coverage_is_silent_on_a_sharded_loader(n, ranks):
    report = data_coverage(loader_loop, ranks, n)
    assert [p[:2] for p in report.passes] == [(0, 0), (0, 1)]
    assert sum(report.passes[0][2].values()) == n and not report.notes
    assert data_coverage(given_loop, 2).passes == [(0, 0, {0: 5, 1: 5}, None)]


def test_coverage_explains_distributed_sampler_padding_and_strict_raises_on_it():
    report = data_coverage(loader_loop, 4, 10)  # 10 items at 4 ranks: padded to 12
    assert "the 2 item(s) read twice are its padding" in report.notes[0], report.notes
    with pytest.raises(CoverageError, match="Read more than once: 2 item"):
        data_coverage(loader_loop, 4, 10, strict=True)


@pytest.mark.parametrize("mistake, reads, expected", [
    ("seed_by_rank", "10 reads of 10 items", "seed differs by rank"),
    ("wrong_rank", "Never read: 5 item(s)", "same rank (0, 0): pass rank=rank"),
    ("resume", "12 reads of 8 items", "resume mid-epoch restarts the epoch"),
    ("no_sampler", "20 reads of 10 items", "Ranks reading the same items: ranks 0 and 1 (10 item(s))"),
    ("drop_last_twice", "Never read: 2 item(s)", "DataLoader(drop_last=True)"),
    ("split_seed_by_rank", "reads of 10 items", "different Subsets")])
def test_coverage_names_the_data_mistakes(mistake, reads, expected):
    n = 8 if mistake == "resume" else 10
    with pytest.raises(CoverageError) as caught:
        data_coverage(loader_loop, 2, n, mistake)
    text = str(caught.value)
    assert reads in text and expected in text, text
    assert text.startswith("Dataset 0 (in the order each rank first reads it), pass 0:")


def test_coverage_of_datasets_sharded_before_the_group():
    """Issue #49: sharding decided when the dataset is built, here in the caller: no group yet."""
    with pytest.raises(CoverageError, match="10 of 10 distinct samples were yielded more than once(.|\n)*ranks 0, 1"):
        data_coverage(given_loop, 2, Shards(10))
    with pytest.raises(CoverageError, match="20 reads of 10 items(.|\n)*Read more than once: 10 item"):
        data_coverage(given_loop, 2, Rows(10))


def persistent_loop(rank, world_size, n=20, epochs=3):
    """One loader with persistent workers: one iterator serves every epoch (lesson 04's setting)."""
    data = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=2, persistent_workers=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for _ in loader:
            pass


@pytest.mark.slow
def test_coverage_with_dataloader_workers():
    """10b: a stream sharded by rank but not by DataLoader worker: each worker yields the rank's shard.
    Persistent workers (one iterator for every epoch): each pass counted apart."""
    with pytest.raises(CoverageError, match="twice within rank\\(s\\) 0, 1(.|\n)*get_worker_info"):
        data_coverage(given_loop, 2, None, 2, False, simulated=False)
    assert data_coverage(given_loop, 2, None, 2, simulated=False).passes == [(0, 0, {0: 5, 1: 5}, None)]
    report = data_coverage(persistent_loop, 2, simulated=False)  # persistent workers: a record per pass
    assert [p[:3] for p in report.passes] == [(0, e, {0: 10, 1: 10}) for e in range(3)] and not report.notes


@pytest.mark.slow
def test_check_errors_in_a_kernel_are_the_cell_and_the_message():
    """In a real IPython kernel the checks' own errors show the cell and the message, no frame of
    helpers/; a worker keyword the check takes as its own is refused before anything runs."""
    import re
    import uuid

    k = _support.Kernel(uuid.uuid4().hex)
    try:
        k.cell("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
               "from helpers.checks import against_one_process, data_coverage\n"
               "def read_all(rank, world_size, steps=1):\n"
               "    for _ in DataLoader(TensorDataset(torch.arange(4)), batch_size=2): pass\n"
               "def stepper(rank, world_size, steps): pass\n")
        for call, ename, says in [
                ("data_coverage(read_all, 2)", "CoverageError", "Read more than once: 4 item(s)"),
                ("against_one_process(read_all, 1)", "ValueError", "world_size must be an int >= 2"),
                ("against_one_process(stepper, 2, steps=3)", "ValueError", "steps= is against_one_"
                 "process's own keyword: pass fn's steps positionally")]:
            reply, _ = k.cell(call)
            text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", "\n".join(reply["traceback"]))
            assert reply["ename"] == ename and says in text and call in text, text
            assert "helpers/" not in text and len(text.splitlines()) <= 12, text
    finally:
        k.close()
