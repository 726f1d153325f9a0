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
# # 04 · MNIST: one process, DataParallel and DistributedDataParallel
#
# <!-- opening:start -->
# **You will be able to** train MNIST with DDP that follows the single-process loss curve. **You need** [01 gradients: DP vs DDP](01_gradients_dp_vs_ddp.ipynb), [02 one model, many processes](02_one_model_many_processes.ipynb), [03 the distributed sampler](03_distributed_sampler.ipynb).
# <!-- opening:end -->
#
# **The question:** do `nn.DataParallel` (DP) and `DistributedDataParallel` (DDP) learn the
# same model as a single process? All three get the same recipe. What does each cost in speed
# and memory?
#
# The recipe is the seed's. A `Linear(784, 10)` model learns from the 60,000 MNIST training
# images. It uses plain SGD with `lr = 0.01`, the mean cross-entropy and a global batch of 64.
# Every mode starts from the same weights and sees the data in the same order. The 10,000 test
# images give the accuracy.
#
# Sections 3 to 5 hold the three training loops, in this notebook's cells. `helpers/` provides
# only the launcher and the MNIST tensors. The code cell after each bold claim checks it.
#
# **What runs where**
#
# | mode | CPU only | with GPUs |
# |---|---|---|
# | single process | the notebook kernel, CPU | the kernel, `cuda:0` |
# | DP | the kernel; `device_ids == []`, so DP **just calls the module** | the kernel, one thread per visible GPU |
# | DDP, `launch(ddp_train, world_size, ...)` | `world_size` processes, backend `gloo` | backend `nccl`, one GPU per rank, when there are at least `world_size` GPUs; else `gloo` on CPU |
#
# **New here:** notebook 01 trained a toy; this one trains on a real dataset. A
# [`DistributedSampler`](../docs/GLOSSARY.md#distributedsampler) hands each
# [rank](../docs/GLOSSARY.md#rank) its share of every [global
# batch](../docs/GLOSSARY.md#global-batch-size). Metrics are reduced across ranks with an
# [all-reduce](../docs/GLOSSARY.md#all-reduce). The [glossary](../docs/GLOSSARY.md) defines
# every term and gives its Chinese name.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 2  # DDP processes (ranks); must divide global_batch_size
max_steps = 200  # optimizer steps per mode; 0 means all epochs in full (938 steps per epoch at batch 64)
equivalence_steps = 20  # steps over which DDP must follow the single-process loss curve (and weights); 0 means all
min_accuracy = 0.85  # test accuracy every mode must reach
timed_steps = 20  # section 8: optimizer steps in one timed repeat
repeats = 5  # section 8: timed repeats per mode, after one untimed warm-up repeat

# %%
from helpers.notebook import check_answer, check_parameters, check_value

# Constants of this lesson: no profile changes them
epochs = 1  # passes over the 60,000 training images
model = "linear"  # the seed's Linear(784, 10); or "cnn", a small CNN (learns slower: max_steps 0)
global_batch_size = 64  # samples per optimizer step, all ranks together
lr = 0.01  # SGD learning rate
seed = 0  # seeds the initial weights and the data order

check_parameters(world_size=(world_size, int), max_steps=(max_steps, int),
                 equivalence_steps=(equivalence_steps, int), min_accuracy=(min_accuracy, float),
                 timed_steps=(timed_steps, int), repeats=(repeats, int))
check_value("world_size", world_size, world_size >= 1 and global_batch_size % world_size == 0,
            f"at least 1 and a divisor of global_batch_size = {global_batch_size}")

# %%
import math
import statistics
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close
from torch.utils.data import DistributedSampler, TensorDataset

from helpers.data import MNIST_MEAN, MNIST_STD, load_mnist
from helpers.dataparallel import scatter_chunk_sizes  # items per replica call of nn.DataParallel
from helpers.engine import launch, resolve_backend, worker_device
from helpers.mnist_train import peak_rss_mib  # this process's peak resident memory, MiB

n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
# DP and DDP against one process (sections 4 and 6): bounds on float32 rounding, rtol 0. Basis: the largest
# gaps measured on CPU with 1, 2 and 4 ranks, seeds 0-2, over 20 and all 938 steps of the linear model were
# 4.8e-7 nats (loss) and 7.5e-8 (weights); the bounds leave about 10 times that for other machines.
LOSS_ATOL, WEIGHT_ATOL = 5e-6, 1e-6
device = torch.device("cuda:0" if n_gpus else "cpu")  # single process and DP
backend = resolve_backend(None, world_size)
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; kernel threads: {torch.get_num_threads()}")
print(f"DDP: world_size = {world_size}, backend = {backend!r}; model = {model!r}")
print("DP branch that will run:",
      f"REAL nn.DataParallel over {n_gpus} GPU(s)" if n_gpus >= 1
      else "no GPU: nn.DataParallel has device_ids == [] and simply calls the module (no parallelism)")

# %% [markdown]
# ## 0. The data, and what one copy of it weighs
#
# `helpers.data.load_mnist` returns a whole split as tensors. Images are
# `(N, 1, 28, 28) float32`, normalised with MNIST's mean and standard deviation. Labels are
# `(N,) int64`. Every process that trains loads its own copy: the kernel here, each DDP rank
# later.

# %%
train_images, train_labels = load_mnist(train=True)
test_images, test_labels = load_mnist(train=False)
print(f"train: images {tuple(train_images.shape)} {train_images.dtype}, labels {tuple(train_labels.shape)} {train_labels.dtype}; "
      f"test: images {tuple(test_images.shape)}; normalised with mean {MNIST_MEAN}, std {MNIST_STD}: "
      f"train pixels now have mean {train_images.mean():.4f}, std {train_images.std():.4f}")

# %% [markdown]
# **Claim:** the four tensors hold 60,000 × 784 × 4 + 60,000 × 8 + 10,000 × 784 × 4 +
# 10,000 × 8 = 220,080,000 bytes. That is about **0.205 GiB**, or 209.9 MiB, per process.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: shapes, dtypes, and the bytes of one copy
assert train_images.shape == (60_000, 1, 28, 28) and test_images.shape == (10_000, 1, 28, 28)
assert train_labels.dtype == torch.int64 and set(train_labels.unique().tolist()) == set(range(10))
assert abs(train_images.mean()) < 1e-3 and abs(train_images.std() - 1) < 1e-3
data_bytes = sum(t.nbytes for t in (train_images, train_labels, test_images, test_labels))
assert data_bytes == 60_000 * 784 * 4 + 60_000 * 8 + 10_000 * 784 * 4 + 10_000 * 8 == 220_080_000, data_bytes
print(f"one copy of the data: {data_bytes:,} bytes = {data_bytes / 2**30:.3f} GiB = {data_bytes / 2**20:.1f} MiB")

# %% [markdown]
# Tutorials read the same files with torchvision. `load_mnist` has put them in the repository's
# `data/` folder, `helpers.data.DEFAULT_ROOT`. So this call needs no download:
# `torchvision.datasets.MNIST(root=DEFAULT_ROOT, train=True, download=True)`.

# %%
import torchvision

from helpers.data import DEFAULT_ROOT


def raw_files():
    return sorted((p.name, p.stat().st_mtime_ns) for p in (DEFAULT_ROOT / "MNIST" / "raw").iterdir())


files_before = raw_files()
tv_train = torchvision.datasets.MNIST(root=DEFAULT_ROOT, train=True, download=True)

# %% [markdown]
# **Claim:** that call reads the same 60,000 training labels and downloads nothing. The files
# in `data/MNIST/raw` are unchanged.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the same labels, and no file written
assert len(tv_train) == 60_000 and torch.equal(tv_train.targets.long(), train_labels)
assert raw_files() == files_before, "torchvision downloaded or rewrote files"
print(f"torchvision.datasets.MNIST(root=DEFAULT_ROOT, download=True): {len(tv_train):,} items, nothing downloaded")

# %% [markdown]
# ## 1. One recipe, global batch fixed
#
# We fix the **global batch**: the samples per optimizer step, all ranks together. DDP derives
# `batch_per_rank = global_batch_size // world_size`. A global batch that does not split evenly
# is refused: unequal batches would weight the ranks' mean losses unequally. Exercise 4 shows
# the fix.

# %%
assert global_batch_size % world_size == 0, (
    f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}: every rank must take "
    f"the same share; choose a multiple of {world_size}")
batch_per_rank = global_batch_size // world_size
steps_per_epoch = math.ceil(len(train_labels) / global_batch_size)
steps = epochs * steps_per_epoch if max_steps == 0 else min(max_steps, epochs * steps_per_epoch)
n_check = equivalence_steps or steps  # 0 means: every step of the run
assert 1 <= n_check <= steps, f"equivalence_steps={equivalence_steps} must be 0 (all) or in [1, steps={steps}]"
print(f"global batch {global_batch_size} = {world_size} ranks x {batch_per_rank} images; {steps_per_epoch} steps "
      f"per epoch; {steps} optimizer steps per mode; equivalence checked over {n_check}")

# %% [markdown]
# **Claim:** the single process takes `ceil(60000 / global_batch_size)` steps per epoch. Each
# DDP rank cuts its `DistributedSampler` share into batches of `batch_per_rank`. It takes the
# same number of steps, so every mode runs the same `steps`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each rank's steps per epoch, from the real sampler
rank_shares = [len(DistributedSampler(range(len(train_labels)), num_replicas=world_size, rank=r))  # the real sampler
               for r in range(world_size)]
assert [math.ceil(n / batch_per_rank) for n in rank_shares] == [steps_per_epoch] * world_size, (
    f"every rank's steps per epoch should equal the single process's {steps_per_epoch}: shares {rank_shares}")
print(f"rank shares {rank_shares}: {steps_per_epoch} steps per epoch on every rank")

# %% [markdown]
# ## 2. The data order: every rank gets its slice of the same global batch
#
# The single process visits the images in `epoch_order(60000, seed, epoch)`. That is a
# permutation from a generator seeded `seed + epoch`, cut into global batches of 64. DDP uses
# `DistributedSampler(shuffle=True, seed=seed)` and calls `sampler.set_epoch(epoch)`. Its
# source, `torch/utils/data/distributed.py`, draws the permutation the same way. It hands rank
# `r` every `world_size`-th index, starting at `r`.

# %%
def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """(n,) int64: the order of the training images in this epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


perm = epoch_order(len(train_labels), seed, epoch=0)
rank_indices = []
for r in range(world_size):
    sampler = DistributedSampler(range(len(train_labels)), num_replicas=world_size, rank=r, shuffle=True, seed=seed)
    sampler.set_epoch(0)
    rank_indices.append(torch.tensor(list(sampler)))

# %% [markdown]
# **Claim:** in every full global batch of the epoch, rank `r`'s batch is exactly the strided
# slice `global_batch[r::world_size]` of the single-process batch. Together the ranks' batches
# are that batch, each image once.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every full global batch, sliced by rank
full_steps = len(train_labels) // global_batch_size
for s in range(full_steps):
    global_batch = perm[s * global_batch_size : (s + 1) * global_batch_size]
    shards = [idx[s * batch_per_rank : (s + 1) * batch_per_rank] for idx in rank_indices]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, global_batch[r::world_size]), f"step {s}, rank {r}: not the strided slice"
    assert torch.equal(torch.cat(shards).sort().values, global_batch.sort().values), f"step {s}: union != global batch"
print(f"checked all {full_steps} full global batches of epoch 0: rank r holds global_batch[r::{world_size}]")
print("step 0, global batch (first 8 indices):", perm[:8].tolist())
for r in range(world_size):
    print(f"step 0, rank {r} (first {min(4, batch_per_rank)}):", rank_indices[r][: min(4, batch_per_rank)].tolist())

# %% [markdown]
# ## 3. Single process: the reference
#
# `build_model` makes the model, and `train` is the seed's loop. For each global batch it runs
# a forward, the mean cross-entropy in nats, `backward` and an SGD step. `count_correct`
# evaluates a plain module on given test indices.

# %%
def build_model(name: str, seed: int) -> nn.Module:
    """Input (batch, 1, 28, 28) float32, output logits (batch, 10); identical weights for a given seed."""
    torch.manual_seed(seed)
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))  # the seed: 7,850 parameters
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 7 * 7, 10))


def snapshot(module: nn.Module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def train(net, plain, images, labels, n_steps, snapshot_at):
    """Single process or DP. net: what the forward goes through; plain: the module (for the snapshot)."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses, snap, step = [], None, 0
    for epoch in range(epochs):
        for idx in epoch_order(len(labels), seed, epoch).split(global_batch_size):
            if step == n_steps:
                break
            loss = F.cross_entropy(net(images[idx].to(device)), labels[idx].to(device))  # mean over the batch
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            step += 1
            if step == snapshot_at:
                snap = snapshot(plain)
    return torch.stack(losses).cpu(), snap


@torch.no_grad()
def count_correct(net, images, labels, indices) -> int:
    """How many of the test images at `indices` the plain module `net` classifies right."""
    dev = next(net.parameters()).device
    return sum(int((net(images[i].to(dev)).argmax(dim=1) == labels[i].to(dev)).sum()) for i in indices.split(1000))


single_model = build_model(model, seed).to(device)
single_losses, single_snap = train(single_model, single_model, train_images, train_labels, steps, n_check)
single_acc = count_correct(single_model, test_images, test_labels, torch.arange(len(test_labels))) / len(test_labels)
first, last = single_losses[:20].mean().item(), single_losses[-20:].mean().item()
print(f"single process: {steps} steps on {device}, loss {first:.3f} -> {last:.3f} (means of the first and last 20 "
      f"steps); test accuracy {single_acc:.4f}")

# %% [markdown]
# **Claim:** the loss falls: the last 20 steps average less than half the first 20. The model
# reaches `min_accuracy` on the 10,000 test images.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the loss halves, and the accuracy
assert last < 0.5 * first, "the loss should at least halve"
assert single_acc >= min_accuracy, f"accuracy {single_acc:.4f} < {min_accuracy} after {len(single_losses)} steps of {model!r} (train longer: max_steps=0 runs all epochs; or lower min_accuracy)"

# %% [markdown]
# ## 4. DataParallel
#
# `nn.DataParallel(model)` stays in **one process**. With GPUs it scatters each batch, runs a
# replica per GPU in threads and gathers the outputs on GPU 0, as lesson 01 section 3 showed.
# The next cell trains once more, through DP.

# %%
dp_plain = build_model(model, seed).to(device)
dp_model = nn.DataParallel(dp_plain)  # all visible GPUs; none here on a CPU machine
calls = []  # batch size of every call of the wrapped module
hook = dp_plain.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
with torch.no_grad():
    dp_model(train_images[:global_batch_size].to(device))
hook.remove()
print(f"nn.DataParallel here: device_ids = {dp_model.device_ids}; one forward of {global_batch_size} images "
      f"called the module {len(calls)} time(s) with batch size(s) {calls}")
dp_losses, _ = train(dp_model, dp_plain, train_images, train_labels, steps, None)
dp_acc = count_correct(dp_plain, test_images, test_labels, torch.arange(len(test_labels))) / len(test_labels)
print(f"DP: test accuracy {dp_acc:.4f}")

# %% [markdown]
# **Claim (CPU):** without GPUs, `device_ids == []` and `DataParallel.forward` calls the module
# once on the whole batch. Its source, `torch/nn/parallel/data_parallel.py`, says
# `if not self.device_ids: return self.module(*inputs, **kwargs)`. So DP is the single-process
# run **bit for bit**: same losses, same accuracy, no parallelism.
#
# **Claim (GPU):** DP's loss on the gathered batch is the whole-batch mean. So it follows the
# single-process curve within float32 rounding, `LOSS_ATOL`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: DP against the single process, on this machine's devices
from helpers.notebook import cpu_claim, gpu_claim

if cpu_claim("without GPUs the loop through DP is the single-process run bit for bit"):
    assert dp_model.device_ids == [] and calls == [global_batch_size], f"CPU: one call on the whole batch, got {calls}"
    assert torch.equal(dp_losses, single_losses), "DP on CPU should repeat the single-process run exactly"
    assert dp_acc == single_acc
    print("CPU: DP ran, and equals the single process bit for bit; it cannot run anything in parallel.")
if gpu_claim("DP's loss on the gathered batch follows the single-process curve"):
    assert dp_model.device_ids == list(range(n_gpus)), dp_model.device_ids
    # one call per chunk of scatter's tensor.chunk(n_gpus): fewer than n_gpus when the batch is small
    expected = scatter_chunk_sizes(global_batch_size, n_gpus)
    assert sorted(calls, reverse=True) == expected, f"replica calls {calls}, expected chunk sizes {expected}"
    assert_close(dp_losses[:n_check], single_losses[:n_check], rtol=0, atol=LOSS_ATOL)
    print(f"RAN real nn.DataParallel over {n_gpus} GPU(s)")
assert dp_acc >= min_accuracy, f"DP accuracy {dp_acc:.4f} < {min_accuracy}"

# %% [markdown]
# ## 5. DistributedDataParallel
#
# `ddp_train` below is the whole DDP program of one rank. `launch(ddp_train, world_size, cfg)`
# runs it on `world_size` processes and returns each rank's dictionary. Each rank loads the data
# and builds the model from the same seed. DDP also broadcasts rank 0's weights when it wraps
# the model, as the [DDP notes](https://pytorch.org/docs/stable/notes/ddp.html) say. Each rank
# takes `batch_per_rank` images per step from the `DistributedSampler` and calls `set_epoch`
# each epoch.
#
# In `loss.backward()`, DDP divides the gradients by `world_size`, then sums them with an
# all-reduce, as notebook 01 section 2b showed. So every rank applies the same averaged
# gradient; section 6 checks the consequence. Rank 0 alone prints its progress. `ddp_train`
# trains, then evaluates; copy it with `build_model` and `count_correct` from the cells above.

# %%
def ddp_train(rank, world_size, cfg):
    dev = worker_device()  # cuda:<local_rank> under nccl, else cpu
    xtr, ytr = load_mnist(train=True)
    xte, yte = load_mnist(train=False)
    net = build_model(cfg["model"], cfg["seed"]).to(dev)
    ddp_model = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
    sampler = DistributedSampler(TensorDataset(xtr, ytr), shuffle=True, seed=cfg["seed"])
    opt = torch.optim.SGD(ddp_model.parameters(), lr=cfg["lr"])
    losses = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        for idx in torch.tensor(list(sampler)).split(cfg["global_batch_size"] // world_size):
            if len(losses) == cfg["steps"]:
                break
            loss = F.cross_entropy(ddp_model(xtr[idx].to(dev)), ytr[idx].to(dev))
            opt.zero_grad()
            loss.backward()  # DDP: gradients divided by world_size, then all-reduced (summed)
            opt.step()
            losses.append(loss.detach())
            if rank == 0 and len(losses) % max(1, cfg["steps"] // 4) == 0:
                print(f"step {len(losses)}/{cfg['steps']}: rank 0's loss {loss:.3f}", flush=True)
    local = torch.stack(losses)
    global_losses = local.clone()
    dist.all_reduce(global_losses)  # one collective for the whole curve: the sum of rank means
    global_losses /= world_size  # equal shards: the mean of the rank means is the global mean
    shard = torch.arange(rank, len(yte), world_size)  # unpadded: each test image on one rank
    correct = count_correct(ddp_model.module, xte, yte, shard)  # the plain module, not DDP
    counts = torch.tensor([correct, len(shard)], device=dev)
    dist.all_reduce(counts)
    return {"rank": rank, "backend": dist.get_backend(), "local_losses": local.cpu(),
            "losses": global_losses.cpu(), "correct": int(counts[0]), "total": int(counts[1]),
            "test_shard": shard}


# %% [markdown]
# Later sections need more than the training returns. `measured_ddp_train` below runs
# `ddp_train` unchanged and records it from outside. It uses torch's
# `register_optimizer_step_post_hook`, which runs after every optimizer step of the process.
# It keeps the weights after `snapshot_at` steps for section 6. After the first step it reads
# the private memory for section 9. It also returns the threads and the peak memory.

# %%
def measured_ddp_train(rank, world_size, cfg):
    import psutil
    from torch.optim.optimizer import register_optimizer_step_post_hook

    me = psutil.Process()
    names = [k for k, _ in build_model(cfg["model"], cfg["seed"]).named_parameters()]
    seen = {"steps": 0, "uss_before": me.memory_full_info().uss}  # uss: memory only it holds

    def after_step(opt, args, kwargs):
        seen["steps"] += 1
        if seen["steps"] == 1:  # the data is loaded and the model built
            seen["private_growth"] = me.memory_full_info().uss - seen["uss_before"]
        if seen["steps"] == cfg["snapshot_at"]:
            params = [p.detach().cpu().clone() for g in opt.param_groups for p in g["params"]]
            seen["snapshot"] = dict(zip(names, params))

    handle = register_optimizer_step_post_hook(after_step)
    try:
        out = ddp_train(rank, world_size, cfg)
    finally:
        handle.remove()
    return {**out, **seen, "threads": torch.get_num_threads(), "peak_rss_mib": peak_rss_mib()}


cfg = dict(model=model, seed=seed, lr=lr, global_batch_size=global_batch_size, epochs=epochs,
           steps=steps, snapshot_at=n_check)
t0 = time.perf_counter()
ddp_ranks = launch(measured_ddp_train, world_size, cfg, timeout=1800.0)
print(f"DDP ({world_size} ranks, {ddp_ranks[0]['backend']}): launch took "
      f"{time.perf_counter() - t0:.1f} s in all (start-up, data loading, training, evaluation)")
pd.DataFrame([{k: h[k] for k in ("rank", "backend", "threads", "correct", "total", "peak_rss_mib")}
              for h in ddp_ranks]).set_index("rank").round(1)

# %% [markdown]
# Metrics are reduced, not read off one rank. After training, one all-reduce turns the
# per-step losses into the global loss. The test accuracy comes from `ddp_model.module`, the
# plain module, not the wrapper. Each rank scores an **unpadded** shard of the test set,
# `range(rank, 10000, world_size)`, so every image counts once, as in notebook 03. The correct
# and total counts are all-reduced.
#
# **Claim:** every rank reports the same global loss curve and the same test counts. The counts
# cover each of the 10,000 test images exactly once, and the accuracy reaches `min_accuracy`.
# The ranks' own losses differ, since they saw different images.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: equal global results on every rank, each test image once
assert [h["rank"] for h in ddp_ranks] == list(range(world_size)), "results come back in rank order"
for h in ddp_ranks[1:]:
    assert_close(h["losses"], ddp_ranks[0]["losses"], rtol=0, atol=0, msg=f"rank {h['rank']}: global loss differs")
    assert (h["correct"], h["total"]) == (ddp_ranks[0]["correct"], ddp_ranks[0]["total"]), f"rank {h['rank']}: counts differ"
    assert not torch.equal(h["local_losses"], ddp_ranks[0]["local_losses"]), "ranks should see different images"
assert ddp_ranks[0]["total"] == len(test_labels), f"counted {ddp_ranks[0]['total']} test images, there are {len(test_labels)}"
counted = torch.cat([h["test_shard"] for h in ddp_ranks]).sort().values  # every rank's test indices, together
assert torch.equal(counted, torch.arange(len(test_labels))), "the ranks' test shards should hold each image exactly once"
ddp_losses, ddp_acc = ddp_ranks[0]["losses"], ddp_ranks[0]["correct"] / ddp_ranks[0]["total"]
assert ddp_acc >= min_accuracy, f"DDP accuracy {ddp_acc:.4f} < {min_accuracy}"
print(f"DDP: test accuracy {ddp_acc:.4f} ({ddp_ranks[0]['correct']} of {ddp_ranks[0]['total']}); "
      f"rank 0's own loss at step 1: {ddp_ranks[0]['local_losses'][0]:.4f}, global: {ddp_losses[0]:.4f}")

# %% [markdown]
# Lessons 07a and 07b reuse this loop in a packaged form: `ddp_train_worker` in
# `helpers/mnist_train.py`. It adds a progress bar, timings and a history, and trains the same way.
#
# **Claim:** with the same recipe, `ddp_train_worker` gives the same global loss as `ddp_train`
# at every step checked, bit for bit.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the packaged worker that 07a and 07b reuse trains what ddp_train trains
from helpers.mnist_train import TrainConfig, ddp_train_worker

recipe = TrainConfig(global_batch_size=global_batch_size, lr=lr, epochs=epochs, max_steps=n_check, model=model,
                     seed=seed, progress=False)
packaged = launch(ddp_train_worker, world_size, recipe, timeout=1800.0)
packaged_losses = torch.as_tensor(packaged[0]["losses"], dtype=ddp_losses.dtype)
assert torch.equal(packaged_losses, ddp_losses[:n_check]), (
    "ddp_train_worker's global losses differ from ddp_train's: "
    f"first at step {int((packaged_losses != ddp_losses[:n_check]).nonzero()[0]) + 1}")
print(f"ddp_train_worker = ddp_train over {n_check} steps, bit for bit")

# %% [markdown]
# ### Your own `Dataset`, read by `DataLoader` workers
#
# Code you bring usually wraps its data in a `Dataset` class, read by `DataLoader(...,
# num_workers=2)` worker processes. That works inside `launch`'s ranks as under `torchrun`. The
# class below, defined in this notebook, travels to the ranks by value. Each rank starts its
# workers with a fresh Python's start method: `fork` on Linux before Python 3.14, so the workers
# get the class without importing it. Copy this cell and put your own class in place of
# `Digits`.

# %%
from torch.utils.data import DataLoader, Dataset


class Digits(Dataset):
    """Item i: (i, image (1, 28, 28) float32, label int64)."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return i, self.images[i], self.labels[i]


def loader_epochs(rank, world_size, images, labels, epochs=2):
    import multiprocessing

    ds = Digits(images, labels)
    sampler = DistributedSampler(ds, shuffle=True, seed=seed)  # rank, world_size: from the group
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seen.append([int(i) for indices, x, y in loader for i in indices])
    return {"start_method": multiprocessing.get_start_method(), "seen": seen}


loader_ranks = launch(loader_epochs, world_size, train_images[:512], train_labels[:512])

# %% [markdown]
# **Claim:** each rank has a `DistributedSampler`, `num_workers=2` and
# `persistent_workers=True`. Together the ranks see every index of the dataset exactly once
# per epoch, in both epochs. Each rank has a fresh interpreter's start method.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the start method, and every index once per epoch
import subprocess
import sys

fresh = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                       capture_output=True, text=True, check=True).stdout.strip()
if sys.platform.startswith("linux") and sys.version_info < (3, 14):
    assert fresh == "fork", fresh
for r, h in enumerate(loader_ranks):
    assert h["start_method"] == fresh, f"rank {r}: start method {h['start_method']!r}, a fresh interpreter's: {fresh!r}"
    for epoch, seen in enumerate(h["seen"]):
        assert len(seen) == 512 // world_size, f"rank {r}, epoch {epoch}: {len(seen)} items"
for epoch in range(2):
    union = sorted(i for h in loader_ranks for i in h["seen"][epoch])
    assert union == list(range(512)), f"epoch {epoch}: the ranks did not see each of the 512 indices exactly once"
print(f"start method in every rank: {fresh!r}; each epoch, the {world_size} ranks saw all 512 indices once")

# %% [markdown]
# ## 6. DDP follows the single process, step by step
#
# Both runs start from the same weights and see the same global batches (section 2). Each rank
# takes a **mean** loss, and DDP **averages** the gradients. Over equal shards, the average of
# the ranks' mean-loss gradients is the gradient of the whole batch's mean loss. So DDP takes
# the same SGD steps as the single process.
#
# Yet the two runs add the numbers in a different order. Float32 addition is not associative, so
# the results can differ by float32's resolution, about 1e-7 relative. The bounds below are
# about ten times the largest gaps measured with 1, 2 and 4 ranks over several seeds. The cell
# prints this run's gaps. With `model = "cnn"` a ReLU or max-pool decision can flip, so keep
# `equivalence_steps` small there. A real bug moves the loss far more within the first steps: a
# summed loss, a wrong shard, a missing `set_epoch`, unsynchronised initial weights.
#
# **Claim:** for the first `equivalence_steps` steps, or all of them when it is 0, the global
# DDP loss is within `LOSS_ATOL = 5e-6` nats of the single-process loss. After that many steps,
# every weight is within `WEIGHT_ATOL = 1e-6` of the single process's.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: DDP's losses and weights against the single process
n = n_check
assert (LOSS_ATOL, WEIGHT_ATOL) == (5e-6, 1e-6), "the claim's words"
assert_close(ddp_losses[:n], single_losses[:n], rtol=0, atol=LOSS_ATOL,
             msg=lambda m: f"DDP loss curve left the single-process curve in the first {n} steps:\n{m}")
for name, w in single_snap.items():
    assert_close(ddp_ranks[0]["snapshot"][name], w, rtol=0, atol=WEIGHT_ATOL,
                 msg=lambda m, name=name: f"{name} after {n} steps differs between DDP and single process:\n{m}")
gap = (ddp_losses - single_losses).abs()
w_gap = max((ddp_ranks[0]["snapshot"][k] - w).abs().max().item() for k, w in single_snap.items())
print(f"first {n} steps: max |DDP loss - single loss| = {gap[:n].max():.2e} nats; "
      f"max |weight difference| after step {n} = {w_gap:.2e}")
if n < len(gap):
    print(f"all {len(gap)} steps: max |DDP loss - single loss| = {gap.max():.2e} nats (not asserted)")

# %% [markdown]
# ## 7. Pictures
#
# Left: the loss of every step in each mode, on top of each other. Right: how far DP and DDP
# are from the single process at each step. Its symmetric-log scale draws zero at the bottom.
# Below them, the test accuracy of each mode, as points.

# %%
dp_label = "DP" + (" (CPU: = single)" if n_gpus == 0 else f" ({n_gpus} GPUs)")
modes = {"single process": (single_losses, single_acc), dp_label: (dp_losses, dp_acc),
         f"DDP ({world_size} ranks)": (ddp_losses, ddp_acc)}
fig, axs = plt.subplot_mosaic([["loss", "gap"], ["acc", "acc"]], figsize=(12, 7.5), height_ratios=[3, 2],
                              layout="constrained")
for (label, (losses, _)), style in zip(modes.items(), [dict(lw=2.5, alpha=0.5), dict(ls="--", lw=1.2), dict(ls=":", lw=1.2)]):
    axs["loss"].plot(range(1, len(losses) + 1), losses, label=label, **style)
axs["loss"].set(xlabel="optimizer step", ylabel="training loss (mean cross-entropy, nats)",
                title=f"Loss per step, global batch {global_batch_size}, lr {lr}")
axs["loss"].legend(loc="upper right")
for (label, (losses, _)), color in zip(list(modes.items())[1:], ["C1", "C2"]):
    axs["gap"].plot(range(1, len(losses) + 1), (losses - single_losses).abs(), color=color, lw=0.8, label=f"|{label} - single|")
axs["gap"].set_yscale("symlog", linthresh=1e-8)
axs["gap"].axhline(LOSS_ATOL, color="k", ls="--", lw=0.8, label=f"bound of the check ({LOSS_ATOL:g})")
axs["gap"].set(xlabel="optimizer step", ylabel="|loss difference| (nats, symlog)", title="Distance from the single-process loss")
axs["gap"].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
for k, (_label, (_, acc)) in enumerate(modes.items()):
    axs["acc"].plot([acc], [k], "o", ms=9, color=f"C{k}")
    axs["acc"].annotate(f"{acc:.4f}", (acc, k), xytext=(8, 0), textcoords="offset points", va="center")
axs["acc"].axvline(min_accuracy, color="k", ls="--", lw=0.8, label=f"min_accuracy = {min_accuracy}")
axs["acc"].set_yticks(range(len(modes)), list(modes))
axs["acc"].set_ylim(len(modes) - 0.5, -0.5)
axs["acc"].set_xlim(min(0.8, min_accuracy - 0.05), 1.0)
axs["acc"].set(xlabel="test accuracy (fraction of 10,000 images)", title=f"Test accuracy after {steps} steps")
axs["acc"].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
plt.show()

# %% [markdown]
# ## 8. Throughput, measured fairly
#
# Samples per second depend on the machine and its load, so this section measures and asserts
# nothing about time. Each mode runs one untimed warm-up, then `repeats` timed repeats of
# `timed_steps` steps. Single and DP **alternate**, so that neither always runs first.
#
# Like with like: on a CPU, a process's speed depends on its intra-op threads, the threads one
# matrix product uses. The kernel times single and DP with each DDP rank's count, set by
# `torch.set_num_threads`. Only the number of processes differs.

# %%
def time_repeat(net, n_steps, batches) -> float:
    """Seconds for n_steps SGD steps of net on the given (images, labels) batches."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in batches[:n_steps]:
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


order = epoch_order(len(train_labels), seed, 0)[: timed_steps * global_batch_size].split(global_batch_size)
batches = [(train_images[i].to(device), train_labels[i].to(device)) for i in order]
nets = {"single process": build_model(model, seed).to(device), dp_label: nn.DataParallel(build_model(model, seed).to(device))}
samples_per_s = {name: [] for name in nets}
kernel_threads = torch.get_num_threads()
rank_threads = ddp_ranks[0]["threads"]  # what each DDP rank ran with (section 6's launch)
threads_used = {}
torch.set_num_threads(rank_threads)  # the kernel times single and DP with a rank's threads
try:
    for net in nets.values():
        time_repeat(net, timed_steps, batches)  # warm-up, not counted
    for k in range(repeats):
        for name in (list(nets) if k % 2 == 0 else list(nets)[::-1]):  # alternate which mode goes first
            samples_per_s[name].append(timed_steps * global_batch_size / time_repeat(nets[name], timed_steps, batches))
            threads_used[name] = torch.get_num_threads()
finally:
    torch.set_num_threads(kernel_threads)  # the kernel's own count again

# %% [markdown]
# DDP is timed in its own workers, with the same warm-up and repeats. The slowest rank's time
# counts, since every step ends with an all-reduce. Starting the processes and loading the
# data take most of this cell's time.

# %%
def ddp_throughput(rank, world_size, cfg):
    dev = worker_device()
    xtr, ytr = load_mnist(train=True)
    net = build_model(cfg["model"], cfg["seed"]).to(dev)
    ddp_model = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=cfg["lr"])
    sampler = DistributedSampler(TensorDataset(xtr, ytr), shuffle=True, seed=cfg["seed"])
    b = cfg["global_batch_size"] // world_size
    idx = torch.tensor(list(sampler)).split(b)[: cfg["timed_steps"]]
    batches = [(xtr[i].to(dev), ytr[i].to(dev)) for i in idx]
    seconds = []
    for _ in range(cfg["repeats"] + 1):  # the first: warm-up, not counted
        dist.barrier()  # all ranks start together
        t0 = time.perf_counter()
        for x, y in batches:
            loss = F.cross_entropy(ddp_model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds.append(time.perf_counter() - t0)
    slowest = torch.tensor(seconds[1:])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
    return {"samples_per_s": (len(batches) * cfg["global_batch_size"] / slowest).tolist(),
            "threads": torch.get_num_threads()}


ddp_label = f"DDP ({world_size} ranks)"
timed_ranks = launch(ddp_throughput, world_size, dict(cfg, timed_steps=timed_steps, repeats=repeats))
samples_per_s[ddp_label] = timed_ranks[0]["samples_per_s"]
threads_used[ddp_label] = sorted({r["threads"] for r in timed_ranks})
tp = pd.DataFrame([{"mode": name, "median samples/s": statistics.median(v), "min": min(v), "max": max(v),
                    "repeats": len(v)} for name, v in samples_per_s.items()]).set_index("mode").round(0)
tp

# %% [markdown]
# **Claim:** every mode was timed with the same intra-op threads per process: the count each
# DDP rank reported.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the same threads in every mode
print(f"intra-op threads per process while timed: {threads_used}")
assert threads_used == {"single process": rank_threads, dp_label: rank_threads, ddp_label: [rank_threads]}, threads_used
assert torch.get_num_threads() == kernel_threads, "the kernel's own thread count is restored"

# %% [markdown]
# The figure shows every repeat as a point, the median as a diamond and the min–max range as a
# line. Its axis starts at zero. The printed verdict compares the min–max ranges. Where they
# overlap, this run cannot tell the two modes apart.

# %%
fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
for k, v in enumerate(samples_per_s.values()):
    ax.plot([k] * len(v), v, "o", alpha=0.5, color=f"C{k}", label="one repeat" if k == 0 else None)
    ax.vlines(k + 0.12, min(v), max(v), color=f"C{k}", lw=2, label="min–max" if k == 0 else None)
    ax.plot([k + 0.12], [statistics.median(v)], "D", ms=8, color="k", label="median" if k == 0 else None)
ax.set_xticks(range(len(samples_per_s)), list(samples_per_s))
ax.set_xlim(-0.5, len(samples_per_s) - 0.5)
ax.set_ylim(0, 1.15 * max(max(v) for v in samples_per_s.values()))
ax.set_xlabel("mode")
ax.set_ylabel("training throughput (samples/s)")
ax.set_title(f"{repeats} timed repeats of {timed_steps} steps per mode, after a warm-up (this machine, this run)")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
plt.show()
names = list(samples_per_s)
print(f"threads per process while timed: {rank_threads} in every mode ({world_size} processes for DDP, 1 for "
      f"single and DP); DDP was timed in its own launch, not interleaved with the kernel's repeats")
for a, b in [(names[0], names[1]), (names[0], names[2])]:
    va, vb = samples_per_s[a], samples_per_s[b]
    overlap = min(max(va), max(vb)) >= max(min(va), min(vb))
    print(f"{b} vs {a}: median {statistics.median(vb):,.0f} vs {statistics.median(va):,.0f} samples/s "
          f"(ratio {statistics.median(vb) / statistics.median(va):.2f}); ranges "
          + ("overlap: this run cannot tell them apart" if overlap else "do not overlap in this run"))

# %% [markdown]
# With the threads equal, DDP runs `world_size` processes at once and adds one all-reduce per
# step. So its gain is at most about `world_size` times, and only when each rank has cores of
# its own. On a laptop the ranks share a few cores, and this small model's all-reduce weighs as
# much as its compute. So the printed ratio is often below 1. It says nothing about GPUs.

# %% [markdown]
# ## 9. Memory, and the comparison
#
# Every process carries its own PyTorch runtime, its own copy of the data and its own model.
# Each DDP rank measured its private memory before `ddp_train` and after its first step, when
# the data is loaded. Private memory, psutil's `uss`, is the memory that no other process
# shares. A copy that ranks shared, in shared memory or one mapped file, would not count there.
#
# **Claim:** every DDP rank holds its own full copy of the data. By its first step, each rank's
# private memory grew by at least the 220,080,000 bytes of section 0.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each rank's private memory grew by one copy of the data
growth = [h["private_growth"] for h in ddp_ranks]
assert min(growth) >= data_bytes, f"private memory grew by {growth} bytes, not {data_bytes:,}"
print(f"private memory each rank gained before its first step: {[round(g / 2**20) for g in growth]}"
      f" MiB; one copy of the data is {data_bytes / 2**20:.1f} MiB")

# %% [markdown]
# Peak memory is each process's peak resident set size: the kernel for single and DP, each
# worker for DDP. The kernel's figure also holds Jupyter, pandas and matplotlib.

# %%
kernel_rss = peak_rss_mib()
print(f"each of the {world_size} ranks held {data_bytes / 2**20:.1f} MiB of data; peak RSS: kernel "
      f"{kernel_rss:,.0f} MiB, ranks {[round(h['peak_rss_mib']) for h in ddp_ranks]} MiB "
      f"(all ranks together {sum(h['peak_rss_mib'] for h in ddp_ranks):,.0f} MiB)")

# %% [markdown]
# The seed's qualitative comparison (from the
# [DataParallel](https://pytorch.org/docs/stable/generated/torch.nn.DataParallel.html) and
# [DDP](https://pytorch.org/docs/stable/notes/ddp.html) documentation), with this run's
# measurements next to it.

# %%
qualitative = {
    "single process": dict(
        process_model="1 process, 1 device",
        communication="none",
        memory_balance="n/a (one device)",
        code_complexity="baseline",
        when_to_use="model and batch fit one device and it is fast enough"),
    "DP": dict(
        process_model="1 process, 1 Python thread per GPU (one GIL)",
        communication="every step: scatter inputs, replicate the module from GPU 0, gather outputs "
                      "on GPU 0, sum gradients on GPU 0",
        memory_balance="unbalanced: GPU 0 holds the gathered outputs, the loss and the master weights",
        code_complexity="one line: nn.DataParallel(model)",
        when_to_use="quick experiments on one machine with a few GPUs; PyTorch recommends DDP instead"),
    "DDP": dict(
        process_model="1 process per device (world_size processes)",
        communication="every step: all-reduce of gradient buckets, overlapped with backward; "
                      "weights broadcast once at start",
        memory_balance="balanced: every rank holds a full replica and its own shard",
        code_complexity="process group, DistributedSampler + set_epoch, DDP wrapper, launcher or "
                        "torchrun, reduced metrics, rank-0 printing",
        when_to_use="any multi-GPU or multi-node training: the default"),
}
rss = {"single process": [kernel_rss], dp_label: [kernel_rss], ddp_label: [h["peak_rss_mib"] for h in ddp_ranks]}
rows = []
for (label, (_, acc)), kind in zip(modes.items(), qualitative):
    v = samples_per_s[label]
    rows.append({"mode": label, **qualitative[kind], "processes": len(rss[label]),
                 "samples/s, median (min–max), this run": f"{statistics.median(v):,.0f} ({min(v):,.0f}–{max(v):,.0f})",
                 "test accuracy (measured)": round(acc, 4),
                 "peak RSS per process, MiB (measured)": round(max(rss[label])),
                 "peak RSS, all processes, MiB (measured)": round(sum(rss[label]))})
with pd.option_context("display.max_colwidth", None):
    display(pd.DataFrame(rows).set_index("mode").T)

# %% [markdown]
# ## What we saw
#
# * With the global batch fixed, the same seed and the same data order, **all three modes
#   learned the same model**. DP on CPU is the single-process run: `device_ids == []`, so the
#   module is just called. DDP with a mean loss followed the single-process loss curve and
#   weights within float32 rounding. Over equal shards, the average of the ranks' mean-loss
#   gradients is the whole batch's gradient.
# * `DistributedSampler` with `set_epoch` draws the same permutation as the single process. It
#   gives rank `r` the strided slice `global_batch[r::world_size]` of every global batch.
# * Every mode reached `min_accuracy`; the accuracies are printed above.
# * Metrics need reducing, because each rank's own loss differs. The global loss is
#   all-reduced. So are the correct and total counts, from unpadded shards scored on
#   `ddp_model.module`.
# * The costs differ. Each DDP rank holds its own process, runtime and copy of the data, and
#   all-reduces the gradients every step. Section 8 measured which mode is fastest here. DDP
#   pays off when each step's compute dominates its all-reduce, as on GPUs with real models.
#
# ## Exercises
#
# Predict each answer by hand first and write it into `answer_N`, replacing `None`. Then run
# the check cell below it. It prints "correct" or "not yet" with a hint. In the full notebook
# a collapsed solution follows each check; click the "…" or the bar on its left to open it.
# Student copies leave the solutions out. Every solution runs when the full notebook runs, so
# each is known to pass its check. Exercises 1–3 start no processes. Exercise 4 runs your code
# on 3 real ranks.

# %% [markdown]
# ### Exercise 1: scaling out at a fixed global batch
#
# You move this recipe to 4 GPUs and keep the global batch at 128 images per optimizer
# step. How many images does each rank process per step? Answer with a whole number.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, asked of the real sampler
# expected: what the real DistributedSampler gives rank 0 when 4 ranks split one global batch of 128
expected_1 = len(DistributedSampler(range(128), num_replicas=4, rank=0))
check_answer("ex1", answer_1, expected_1, hint="the global batch counts the images of all ranks together")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# global batch = batch per rank x world size, so each rank takes 128 / 4 = 32 images
# (it must divide evenly: see section 1).
assert 128 % 4 == 0
solution_1 = 128 // 4
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: steps per epoch
#
# With that setup (global batch 128, 4 ranks), how many optimizer steps is one epoch of
# the 60,000 training images? The last, partial global batch counts as a step. Answer with
# a whole number. Does it depend on the number of ranks?

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, asked of the real sampler
# expected: rank 0's share from the real DistributedSampler (padding included), cut into batches of 32
expected_2 = math.ceil(len(DistributedSampler(range(60_000), num_replicas=4, rank=0)) / 32)
check_answer("ex2", answer_2, expected_2, hint="divide the epoch by the global batch, then round up")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# One step consumes one global batch of 128 images, whatever the number of ranks:
# 60,000 / 128 = 468.75, so 468 full steps and a partial one: 469.
solution_2 = math.ceil(60_000 / 128)
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: what DDP sends per step
#
# With `Linear(784, 10)` in `float32`, how many **bytes** of gradients does DDP all-reduce
# in every step (one gradient entry per parameter entry)? Answer with a whole number.

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 3, from the model's own parameters
# expected: the parameters of the notebook's own model, counted in bytes
expected_3 = sum(p.numel() * p.element_size() for p in build_model("linear", seed).parameters())
check_answer("ex3", answer_3, expected_3, hint="count the weight and the bias, 4 bytes per float32")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# weight 784 x 10 = 7,840 entries, bias 10: 7,850 gradient entries x 4 bytes = 31,400 bytes
# (about 31 kB per step: tiny next to the 64 x 784 x 4 = 200 kB of images of one global batch).
solution_3 = (784 * 10 + 10) * 4
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# ### Exercise 4: weight the loss so that unequal shards give the global mean
#
# A global batch of 10 examples on 3 ranks splits 4 + 3 + 3. Rank `r` takes examples
# `r, r + 3, ...`. With the usual per-rank **mean** loss, DDP averages three gradients of means
# over different numbers of examples. Rank 0's examples weigh 1/12 each, the others' 1/9. So
# the step is not the single process's step on the 10 examples.
#
# Write `local_loss(logits, labels, global_batch_size)`. It returns the loss each rank should
# backpropagate so that DDP's averaged gradient equals the gradient of the **mean**
# cross-entropy over all 10 examples. Hint: DDP divides each rank's gradient by
# `dist.get_world_size()`, then sums them over the ranks. Set `answer_4 = local_loss`, the
# function itself. Once you have answered, the check cell runs it in DDP on 3 real ranks. It
# compares rank 0's gradient with the single-process gradient of the mean loss.

# %% tags=["exercise"]
answer_4 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 4, your loss on 3 real ranks
# expected: one process, one Linear(4, 3), the mean cross-entropy over all 10 examples
ex4_x = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))
ex4_y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2])
torch.manual_seed(0)
ex4_ref = nn.Linear(4, 3)
F.cross_entropy(ex4_ref(ex4_x), ex4_y).backward()
expected_4 = torch.cat([ex4_ref.weight.grad.flatten(), ex4_ref.bias.grad]).tolist()


def uneven_ddp_gradient(loss_fn):
    """Runs loss_fn in DDP on 3 real ranks with shards of 4, 3 and 3 examples; rank 0's gradient."""
    def worker(rank, world_size):
        torch.manual_seed(0)
        net = nn.Linear(4, 3)
        ddp_net = DDP(net)
        idx = list(range(rank, len(ex4_y), world_size))  # 4, 3, 3 examples
        loss_fn(ddp_net(ex4_x[idx]), ex4_y[idx], len(ex4_y)).backward()  # DDP averages the gradients here
        return torch.cat([net.weight.grad.flatten(), net.bias.grad]).tolist()
    return launch(worker, 3, backend="gloo")[0]  # CPU tensors: gloo on any machine


check_answer("ex4", answer_4, expected_4, run=uneven_ddp_gradient, abs_tol=1e-6,
             hint="sum the losses of this rank's examples, then scale so that the average over ranks is the global mean")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 4 (try the exercise first)
# DDP's gradient = sum over ranks of (grad(local loss) / W). For the global mean we need
# sum over ranks of grad(sum of this rank's losses) / N, so each rank returns its summed loss
# times W / N.
def solution_4(logits, labels, global_batch_size):
    return F.cross_entropy(logits, labels, reduction="sum") * dist.get_world_size() / global_batch_size


check_answer("ex4", solution_4, expected_4, run=uneven_ddp_gradient, abs_tol=1e-6, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [05a throughput on one machine](05a_throughput_on_one_machine.ipynb): measure samples/s, the input pipeline, threads and memory per rank.
# <!-- next:end -->
