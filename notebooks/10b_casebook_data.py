# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10b · Casebook: the data
#
# <!-- opening:start -->
# **You need** [03 the distributed sampler](03_distributed_sampler.ipynb), [06c seeds and debugging](06c_seeds_and_debugging.ipynb).
# <!-- opening:end -->
#
# **What this page is.** A casebook page, not a lesson. Each section is one mistake that people
# report, found by its symptom. A case quotes the symptom and names the thread it comes from.
# Then come the shortest program that shows it, the wrong and the right value, the fix, and the
# check that catches it. The page computes and asserts both values.
#
# Cases on this page:
#
# * [my IterableDataset gives twice the samples](#case-iterable-dataset)
# * [every rank trains on the same batches](#case-shuffle-without-sampler)
# * [my dataset's epoch never changes](#case-epoch-on-dataset-persistent-workers)
# * [every rank draws the same augmentation and dropout](#case-same-seed-every-rank)
# * [DataLoader workers die in Docker](#case-docker-shm)
#
# Every program runs on 2 real ranks with `launch` and backend `gloo`, on the CPU. The data
# loaders run their worker processes inside the ranks. Each claim is in bold, "Claim:", and the
# code cell right after it asserts it.
#
# Terms, from the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size),
# [DistributedSampler](../docs/GLOSSARY.md#distributedsampler),
# [global batch size](../docs/GLOSSARY.md#global-batch-size).

# %% tags=["parameters"]
# Parameters: what you run by default, top to bottom in JupyterLab (the smoke profile); the full profile overrides some (docs/RUNNER.md)
n_items = 10  # items of the data sets in this page
num_workers = 2  # DataLoader worker processes per rank
epochs = 3  # epochs of the persistent-workers case

# %%
from helpers.notebook import check_parameters, check_value

check_parameters(n_items=(n_items, int), num_workers=(num_workers, int), epochs=(epochs, int))
check_value("n_items", n_items, 4 <= n_items <= 200 and n_items % 2 == 0, "an even number from 4 to 200 (2 ranks share it without padding)")
check_value("num_workers", num_workers, 2 <= num_workers <= 4, "2 to 4 (the cases need several workers)")
check_value("epochs", epochs, 2 <= epochs <= 6, "2 to 6")

# %%
import mmap
import shutil
import signal
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

from helpers.engine import launch

t_notebook = time.perf_counter()
WORLD = 2
print(f"torch {torch.__version__}")


def gathered(value):
    """Every rank's value, in rank order (a collective: every rank calls it)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every

# %% [markdown]
# <a id="case-iterable-dataset"></a>
# ## Case: my IterableDataset gives twice the samples
#
# **Symptom.** "With DDP my streaming dataset returns duplicated data." From
# [huggingface/datasets#5360](https://github.com/huggingface/datasets/issues/5360),
# "IterableDataset returns duplicated data using PyTorch DDP", and
# [Lightning-AI/pytorch-lightning#15734](https://github.com/Lightning-AI/pytorch-lightning/issues/15734).
# The case extends [03](03_distributed_sampler.ipynb), which shards a map-style data set.
#
# **Why.** An `IterableDataset` has no length and no index, so `DistributedSampler` cannot
# shard it. Each rank, and each worker inside a rank, runs the whole `__iter__`. The data set
# must shard itself, by rank and by worker. Sharding by `rank × workers + worker` deals the items
# round robin to all the readers, so the ranks can end with different counts. Then the rank with
# fewer batches finishes first, and the other waits in its extra all-reduce: 06a's uneven inputs.
#
# The program: `Items` streams `0 .. n_items − 1`, and `shard` picks how it splits them.

# %%
class Items(IterableDataset):
    def __init__(self, n, shard=None, rank=0, world_size=1):
        self.n, self.shard, self.rank, self.world_size = n, shard, rank, world_size

    def __iter__(self):
        info = get_worker_info()  # None in the main process
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        items = range(self.n)
        if self.shard == "reader":  # one shard per (rank, worker): round robin over all readers
            items = items[self.rank * workers + worker::self.world_size * workers]
        elif self.shard == "rank first":  # equal items per rank, then split among workers
            items = items[: self.n - self.n % self.world_size][self.rank::self.world_size][worker::workers]
        return iter(items)


class WorkerRank(IterableDataset):
    def __iter__(self):  # runs in a DataLoader worker
        try:
            yield dist.get_rank()
        except ValueError as e:  # this process has no default process group
            yield str(e)


def iterable_case(rank, world_size, n, workers):
    def read(shard, w):
        return [int(i) for i in DataLoader(Items(n, shard, rank, world_size), batch_size=None, num_workers=w)]
    out = {"no sharding": read(None, 0), "no sharding, workers": read(None, workers),
           "rank + worker": read("reader", workers), "rank first": read("rank first", workers)}
    try:
        DistributedSampler(Items(n))
    except TypeError as e:
        out["DistributedSampler"] = str(e)
    out["a worker's get_rank()"] = next(iter(DataLoader(WorkerRank(), batch_size=None, num_workers=1)))
    out["start method"] = torch.multiprocessing.get_start_method()
    return gathered(out)


IT = launch(iterable_case, WORLD, n_items, num_workers, backend="gloo", timeout=120)[0]

# %% [markdown]
# **Claim:** the table gives the items each rank reads. Without sharding every rank reads all
# `n_items`, once per worker. `DistributedSampler(iterable)` raises `TypeError`: no `len()`.
# Sharding by rank and worker reads each item once, but the counts differ when `n_items` is not a
# multiple of `2 × num_workers`. Sharding by rank first gives equal counts and reads no item
# twice.
#
# | sharding | items read, rank 0 | items read, rank 1 |
# | --- | --- | --- |
# | none | `n_items` | `n_items` |
# | none, with workers | `num_workers × n_items` | `num_workers × n_items` |
# | rank, then worker, round robin | 6 for 10 items and 2 workers | 4 for 10 items and 2 workers |
# | rank first, then worker | `n_items // 2` | `n_items // 2` |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: items each rank reads under each sharding
counts = {k: [len(IT[r][k]) for r in range(WORLD)] for k in ("no sharding", "no sharding, workers", "rank + worker", "rank first")}
assert counts["no sharding"] == [n_items] * WORLD
assert counts["no sharding, workers"] == [num_workers * n_items] * WORLD
assert "has no len()" in IT[0]["DistributedSampler"], IT[0]
reader = IT[0]["rank + worker"] + IT[1]["rank + worker"]
assert sorted(reader) == list(range(n_items))  # each item once
readers = WORLD * num_workers
expected = [sum(len(range(n_items)[r * num_workers + w::readers]) for w in range(num_workers)) for r in range(WORLD)]
assert counts["rank + worker"] == expected, counts
if n_items == 10 and num_workers == 2:
    assert counts["rank + worker"] == [6, 4]
first = IT[0]["rank first"] + IT[1]["rank first"]
assert counts["rank first"] == [n_items // WORLD] * WORLD and len(set(first)) == len(first)
pd.DataFrame(counts, index=[f"items read, rank {r}" for r in range(WORLD)]).T

# %% [markdown]
# **Fix.** Shard inside `__iter__` by rank first, then by worker with `get_worker_info()`. Give
# every rank the same number of items: drop the remainder, or pad it. Pass the rank to the data
# set's constructor rather than calling `dist.get_rank()` inside `__iter__`. A worker started by
# fork inherits the process group; one started by spawn has none. Spawn is the default on macOS
# and Windows. Under `mp.spawn` it is the ranks' default on Linux too: Python's
# `multiprocessing/spawn.py` sets a spawned child's start method to spawn. Uneven streams that
# cannot be trimmed need `Join`, from section 2 of [06a](06a_training_loop_pitfalls.ipynb).
#
# **Claim:** a DataLoader worker's `dist.get_rank()` returns its rank when the rank starts
# processes by fork, as this page's ranks do on Linux. By spawn, the call raises `ValueError`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: dist.get_rank() in a DataLoader worker of each rank, by the rank's start method
for r in range(WORLD):
    got, method = IT[r]["a worker's get_rank()"], IT[r]["start method"]
    assert got == r if method == "fork" else "Default process group has not been initialized" in got, (r, method, got)
    assert method == "fork" or not sys.platform.startswith("linux"), method  # our ranks, on Linux
print({f"rank {r}": (IT[r]["start method"], IT[r]["a worker's get_rank()"]) for r in range(WORLD)})

# %% [markdown]
# **Caught by** a metric that must be equal on every rank: the number of items each rank read.

# %% [markdown]
# <a id="case-shuffle-without-sampler"></a>
# ## Case: every rank trains on the same batches
#
# **Symptom.** "DDP on 2 GPUs learns no faster than one; each epoch takes as long." The loader
# is `DataLoader(data, shuffle=True)` with no `DistributedSampler`. The script seeds torch the
# same on every rank. The case extends [03](03_distributed_sampler.ipynb) and section 2 of
# [04](04_mnist_single_dp_ddp.ipynb), where every rank takes its slice of the same global batch.
#
# **Why.** `shuffle=True` draws the order from the process's generator. Seeded alike, every rank
# draws the same order: the global batch holds each item twice.

# %%
def shuffle_case(rank, world_size, n, seed=0):
    torch.manual_seed(seed)  # the same seed on every rank
    plain = [int(i) for i in DataLoader(range(n), batch_size=None, shuffle=True)]
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sharded = [int(i) for i in DataLoader(range(n), batch_size=None, sampler=sampler)]
    return gathered({"shuffle=True": plain, "DistributedSampler": sharded})


SH = launch(shuffle_case, WORLD, n_items, backend="gloo", timeout=120)[0]

# %% [markdown]
# **Claim:** with `shuffle=True` both ranks read all `n_items` items in the identical order. With
# `DistributedSampler` the ranks' items are disjoint and together cover the data once.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: shuffle=True repeats the order; the sampler splits the data
assert SH[0]["shuffle=True"] == SH[1]["shuffle=True"] and sorted(SH[0]["shuffle=True"]) == list(range(n_items))
assert not set(SH[0]["DistributedSampler"]) & set(SH[1]["DistributedSampler"])
assert sorted(SH[0]["DistributedSampler"] + SH[1]["DistributedSampler"]) == list(range(n_items))
pd.DataFrame({f"rank {r}": {k: str(v) for k, v in SH[r].items()} for r in range(WORLD)})

# %% [markdown]
# **Fix.** `DataLoader(data, sampler=DistributedSampler(data, shuffle=True))`, without
# `shuffle=True` on the loader. Call `sampler.set_epoch(epoch)` before each epoch.
#
# **Caught by** the rank's items gathered: they must be disjoint.

# %% [markdown]
# <a id="case-epoch-on-dataset-persistent-workers"></a>
# ## Case: my dataset's epoch never changes
#
# **Symptom.** "I set `dataset.epoch` every epoch, but with `persistent_workers=True` the workers
# keep the first value." From [pytorch/pytorch#97326](https://github.com/pytorch/pytorch/issues/97326),
# "Change worker process's attribute while set persistent_worker = True", and
# [huggingface/datasets#6673](https://github.com/huggingface/datasets/issues/6673). Lesson
# [04](04_mnist_single_dp_ddp.ipynb)'s training uses persistent workers.
#
# **Why.** Each worker holds its own copy of the data set, made when the worker starts. A
# persistent worker starts once, so later changes in the main process never reach it. The
# sampler lives in the main process: `sampler.set_epoch` works with persistent workers.

# %%
class EpochTagged(Dataset):
    def __init__(self, n):
        self.n, self.epoch = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.epoch  # what the worker believes the epoch is


def epoch_case(rank, world_size, n, workers, epochs, persistent):
    data = EpochTagged(n)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=None, sampler=sampler, num_workers=workers, persistent_workers=persistent)
    seen, orders = [], []
    for epoch in range(epochs):
        data.epoch = epoch  # the mistake when workers persist: this copy is not the workers'
        sampler.set_epoch(epoch)  # safe: the sampler runs in this process
        seen.append(sorted({int(e) for e in loader}))
        orders.append(list(sampler))
    return {"epochs seen": seen, "new order each epoch": len({tuple(o) for o in orders}) == epochs}


EP = {persistent: launch(epoch_case, WORLD, n_items, num_workers, epochs, persistent, backend="gloo", timeout=120)
      for persistent in (True, False)}

# %% [markdown]
# **Claim:** with `persistent_workers=True` the workers report epoch 0 in every epoch. Without
# persistent workers they report 0, 1, 2, ... With both, `set_epoch` gives the sampler a new
# order every epoch.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the epoch the workers see, persistent or not
for r in range(WORLD):
    assert EP[True][r]["epochs seen"] == [[0]] * epochs, EP[True][r]
    assert EP[False][r]["epochs seen"] == [[e] for e in range(epochs)], EP[False][r]
    assert EP[True][r]["new order each epoch"] and EP[False][r]["new order each epoch"]
pd.DataFrame({f"persistent_workers={p}": [e[0] for e in EP[p][0]["epochs seen"]] for p in EP},
             index=pd.Index(range(epochs), name="epoch of the loop"))

# %% [markdown]
# **Fix.** Keep epoch state in the sampler, with `set_epoch`. Or derive it in `__getitem__` from
# what the sampler passes, such as an index that encodes the epoch. If the data set must know the
# epoch, share it with the workers through a `multiprocessing.Value`. Or do not use persistent
# workers.
#
# **Caught by** a value checked in the workers' output: here, the epoch each item carries.

# %% [markdown]
# <a id="case-same-seed-every-rank"></a>
# ## Case: every rank draws the same augmentation and dropout
#
# **Symptom.** "I seed everything with the same seed for reproducibility; do my ranks augment
# differently?" They do not. The case extends section 1 of [06c](06c_seeds_and_debugging.ipynb),
# which shows it for explicit generators.
#
# **Why.** A DataLoader's workers take their seeds from the main process's generator, and Dropout
# draws from it. Seeded alike, every rank draws the same random crops and the same dropout masks.
# Model weights must be equal on every rank, but DDP already copies rank 0's at the wrap. The
# data's randomness should differ per rank.

# %%
class Noisy(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.rand(1).item()  # a random augmentation


def seed_case(rank, world_size, workers, seed=0, per_rank=False):
    torch.manual_seed(seed)  # before the model: every rank builds the same weights
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    if per_rank:
        torch.manual_seed(seed + rank)  # the fix: data and dropout differ per rank
    augment = [round(float(v), 6) for v in DataLoader(Noisy(), batch_size=None, num_workers=workers)]
    mask = (model(torch.ones(1, 4)) != 0).int().tolist()
    return gathered({"augmentation": augment, "dropout mask": mask})


SEED = {per_rank: launch(seed_case, WORLD, num_workers, 0, per_rank, backend="gloo", timeout=120)[0]
        for per_rank in (False, True)}

# %% [markdown]
# **Claim:** with the same seed on every rank, the workers' random augmentations and the dropout
# masks are identical on both ranks. Seeded with `seed + rank` after the model is built, both
# differ between the ranks.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: augmentations and dropout masks, one seed against seed + rank
same, fixed = SEED[False], SEED[True]
assert same[0] == same[1], same
assert fixed[0]["augmentation"] != fixed[1]["augmentation"], fixed
assert fixed[0]["dropout mask"] != fixed[1]["dropout mask"], fixed
pd.DataFrame({f"{'seed + rank' if k else 'same seed'}, rank {r}": {n: str(v) for n, v in SEED[k][r].items()}
              for k in SEED for r in range(WORLD)}).T

# %% [markdown]
# **Fix.** Seed once with `seed` to build the model, or rely on DDP's broadcast. Then seed with
# `seed + rank` for the data and the dropout. When only the data should differ, give each
# DataLoader its own generator: `DataLoader(..., generator=torch.Generator().manual_seed(seed + rank))`.
#
# **Caught by** values gathered from the ranks that must differ: a batch's augmentation.

# %% [markdown]
# <a id="case-docker-shm"></a>
# ## Case: DataLoader workers die in Docker
#
# **Symptom.** "RuntimeError: DataLoader worker (pid ...) is killed by signal: Bus error." From
# [pytorch/pytorch#5040](https://github.com/pytorch/pytorch/issues/5040), "Give a better error
# when we run out of shared memory", and many threads after it. This case is an explanation:
# this page cannot shrink its own machine's shared memory.
#
# **Why.** A worker hands each batch to the main process through shared memory. On Linux that is
# files in `/dev/shm`; torch.multiprocessing's documentation describes its sharing strategies. A
# Docker container gets a 64 MB `/dev/shm` unless `docker run --shm-size` says otherwise, as
# Docker's `docker run` reference states. A worker that writes past it is killed by `SIGBUS`, and
# torch raises the error above. It adds: "It is possible that dataloader's workers are out of
# shared memory. Please try to raise your shared memory limit." Several workers, each with
# `prefetch_factor` batches in flight, fill it sooner.

# %%
def in_torch_library(text, name):
    """True when one of torch's compiled libraries named like ``name`` (``libtorch_python.so``
    on Linux, ``.dylib`` on macOS, ``torch_python.dll`` on Windows) holds the message text."""
    for path in (Path(torch.__file__).parent / "lib").glob(f"*{name}.*"):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(text.encode()) >= 0:
                return True
    return False


SYMPTOM = "DataLoader worker (pid ...) is killed by signal: Bus error."  # the symptom's words above
HINT = "It is possible that dataloader's workers are out of shared memory. Please try to raise your shared memory limit."
batch_bytes = 256 * 3 * 224 * 224 * 4  # one batch of 256 RGB images, 224 x 224, float32
docker_default = 64 * 2**20
shm = Path("/dev/shm")
if shm.is_dir():
    print(f"this machine's /dev/shm: {shutil.disk_usage(shm).total / 2**20:,.0f} MB")

# %% [markdown]
# **Claim:** the symptom's words and the hint are torch's. `libtorch_python`, its compiled Python
# bindings, holds the hint and the symptom's text on either side of the pid. The C library names
# `SIGBUS` "Bus error". One batch of 256 RGB images of 224 × 224 pixels in float32 weighs more
# than Docker's default 64 MB: a single prefetched batch overflows it.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the prose's messages are in torch; one batch against 64 MB
before_pid, after_pid = SYMPTOM.split("...")  # "DataLoader worker (pid ", ") is killed by signal: Bus error."
signal_name = signal.strsignal(signal.SIGBUS) if hasattr(signal, "SIGBUS") else "Bus error"  # Windows has none
assert after_pid.endswith(f": {signal_name}."), (after_pid, signal_name)
assert in_torch_library(before_pid, "torch_python") and in_torch_library(after_pid.removesuffix(f"{signal_name}."), "torch_python")
assert in_torch_library(HINT, "torch_python")
assert batch_bytes > docker_default
print(f"one batch: {batch_bytes / 2**20:.0f} MB against Docker's default {docker_default / 2**20:.0f} MB")

# %% [markdown]
# **Fix.** `docker run --shm-size=8g ...`, or `--ipc=host`. In Kubernetes, mount a memory-backed
# `emptyDir` at `/dev/shm`. Fewer workers or a smaller `prefetch_factor` only postpone it.
#
# **Caught by** a check before training: `df -h /dev/shm` where the workers run.

# %% [markdown]
# ## The general check of the data: `data_coverage`
#
# Each case above gathered its own values to catch its mistake. `data_coverage(fn, world_size)`
# is the general check for the data. It runs your unchanged worker on simulated ranks. It records
# what each rank's loader reads, and raises `CoverageError` when a pass reads an item twice or
# never. Lesson [06d](06d_silent_bugs.ipynb) section 7 introduces it. Here it runs on the first
# two cases, with their fixes.

# %%
from helpers.checks import data_coverage, verdict
from helpers.notebook import record_checks


def iterable_worker(rank, world_size, shard=None):
    """The first case: the stream unsharded, or sharded by rank first."""
    return [int(i) for i in DataLoader(Items(n_items, shard, rank, world_size), batch_size=None)]


def shuffle_worker(rank, world_size, fix=False):
    """The second case: shuffle=True with one seed on every rank, or a DistributedSampler."""
    torch.manual_seed(0)
    sampler = DistributedSampler(range(n_items), num_replicas=world_size, rank=rank, seed=0) if fix else None
    return [int(i) for i in DataLoader(range(n_items), batch_size=None, shuffle=not fix, sampler=sampler)]


coverage = {"IterableDataset, no sharding": verdict(data_coverage, iterable_worker, WORLD),
            "IterableDataset, rank first": verdict(data_coverage, iterable_worker, WORLD, shard="rank first"),
            "shuffle=True, one seed": verdict(data_coverage, shuffle_worker, WORLD),
            "DistributedSampler": verdict(data_coverage, shuffle_worker, WORLD, fix=True)}
pd.Series({k: v.splitlines()[0] for k, v in coverage.items()}, name="data_coverage").to_frame()

# %% [markdown]
# **Claim:** `data_coverage` raises `CoverageError` on the unsharded stream: every sample is yielded
# by both ranks. It raises on `shuffle=True` with one seed: every item is read twice. It passes
# both fixes.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: data_coverage on the first two cases and their fixes
stream, shuffled = coverage["IterableDataset, no sharding"], coverage["shuffle=True, one seed"]
assert stream.startswith("CoverageError") and f"{n_items} of {n_items} distinct samples" in stream, stream
assert shuffled.startswith("CoverageError") and "Ranks reading the same items: ranks 0 and 1" in shuffled, shuffled
assert coverage["IterableDataset, rank first"] == coverage["DistributedSampler"] == "passes", coverage
print(stream, shuffled, sep="\n\n")

# %% [markdown]
# The next two cases slip past every general check. With persistent workers each epoch still
# reads each item once: the stale epoch is inside the item. One seed on every rank keeps the
# replicas equal, and no N-rank run draws the one process's random numbers, bug or fix.

# %%
from helpers.checks import against_one_process

X_AUG = torch.arange(8.0)[:, None]  # one global batch of 8 items


def augment_worker(rank, world_size, per_rank=False):
    """One SGD step on this rank's share, each item shifted by a random augmentation."""
    torch.manual_seed(0)  # the same weights on every rank
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
    if per_rank:
        torch.manual_seed(1 + rank)  # the fix: augmentations differ per rank
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = X_AUG[rank::world_size]
    ddp(x + torch.rand_like(x)).pow(2).mean().backward()
    opt.step()


silent = {"epoch on the data set": verdict(data_coverage, epoch_case, WORLD, n_items, num_workers, epochs, True,
                                           simulated=False),
          "one seed": verdict(against_one_process, augment_worker, WORLD),
          "seed + rank": verdict(against_one_process, augment_worker, WORLD, per_rank=True)}
pd.Series({k: v.splitlines()[0] for k, v in silent.items()}, name="general check").to_frame()

# %% [markdown]
# **Claim:** `data_coverage` passes the persistent workers' run. `against_one_process` raises on
# one seed and on `seed + rank` alike, so it cannot tell the bug from its fix.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the general checks on the epoch and seed cases
assert silent["epoch on the data set"] == "passes", silent
assert all(silent[k].startswith("DivergedFromOneProcess") for k in ("one seed", "seed + rank")), silent
record_checks("10b_casebook_data", {
    "my IterableDataset gives twice the samples": {"data_coverage": "caught: every sample on both ranks"},
    "every rank trains on the same batches": {"data_coverage": "caught: every item read twice"},
    "my dataset's epoch never changes": {"data_coverage": "not caught: each item read once; the epoch is inside it"},
    "every rank draws the same augmentation": {
        "against_one_process": "not caught: raises on the fix, seed + rank, too"}})

# %%
print(f"casebook 10b ran in {time.perf_counter() - t_notebook:.0f} s")

# %% [markdown]
# ## What we saw
#
# | symptom | mistake | fix | caught by |
# | --- | --- | --- | --- |
# | [twice the samples](#case-iterable-dataset) | an `IterableDataset` not sharded | shard by rank, then worker; equal counts | items per rank, gathered |
# | [same batches on every rank](#case-shuffle-without-sampler) | `shuffle=True`, no sampler | `DistributedSampler` + `set_epoch` | items gathered: disjoint? |
# | [the epoch never changes](#case-epoch-on-dataset-persistent-workers) | epoch on the data set, persistent workers | `sampler.set_epoch` | the epoch the workers report |
# | [same augmentation everywhere](#case-same-seed-every-rank) | one seed for everything | `seed + rank` after the model | values gathered: different? |
# | [workers die in Docker](#case-docker-shm) | 64 MB `/dev/shm` | `--shm-size`, `--ipc=host` | `df -h /dev/shm` |
#
# None of these moves the replicas apart: DDP keeps the weights equal whatever each rank reads.
# The checks look at the data itself: what each rank read, gathered and compared.

# %% [markdown]
# <!-- next:start -->
# **Next:** [10c casebook: models, checkpoints and FSDP2](10c_casebook_models_and_checkpoints.ipynb): an EMA copy made before DDP, torch.save of the whole DDP object, saving ZeRO's optimizer, FSDP2's optimizer built in the wrong place, who divides by what in FSDP2.
# <!-- next:end -->
