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
# # 09 · A cluster on the laptop: DDP, the sampler and FSDP2 at 64 ranks
#
# <!-- opening:start -->
# **You will be able to** run unchanged DDP, the sampler and FSDP2 on 64 or 256 simulated ranks in one process; count the bytes each rank sends, size the global batch and schedule, and say what a simulation cannot show. **You need** [00b DDP cell by cell](00b_ddp_cell_by_cell.ipynb), [03 the distributed sampler](03_distributed_sampler.ipynb), [05b communication and cost model](05b_communication_and_cost_model.ipynb), [08a ZeRO-1 and FSDP2](08a_zero_and_fsdp2.ipynb).
# <!-- opening:end -->
#
# **The question:** what changes when the job has 64 ranks instead of 2, and what stays the same?
#
# A laptop has a few cores, so the other lessons run 2 to 4 real ranks. Here
# `simulate(fn, world_size)` runs `fn(rank, world_size)` on threads of this process. Each thread has
# its own default process group on torch's threaded backend, the one torch's own tests use. The
# values are real: `all_reduce`, DDP and FSDP2 run unchanged. The time is not: the ranks share one
# process and take turns. Each claim (in bold, "Claim:") is asserted in the code cell after it.
#
# 0. the collectives at 64 ranks · 1. DDP on many ranks · 2. bytes per rank and the cost model ·
# 3. the sampler at 64 and 256 replicas · 4. global batch and schedule · 5. FSDP2 shards ·
# 6. what a simulation cannot show · 7. the general checks at 64 ranks
#
# Terms (see the [glossary](../docs/GLOSSARY.md)): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [bucket](../docs/GLOSSARY.md#bucket), [DDP](../docs/GLOSSARY.md#ddp),
# [DistributedSampler](../docs/GLOSSARY.md#distributedsampler),
# [global batch size](../docs/GLOSSARY.md#global-batch-size).

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 64  # simulated ranks of sections 1, 4 and 5

# %%
from helpers.notebook import check_answer, check_parameters, check_value

# Constants of this lesson: no profile changes them
batch_per_rank = 32  # samples per rank per step
bandwidth_GBps = 12.5  # the modelled network: link bandwidth in GB/s (100 Gb/s Ethernet)
alpha_us = 10.0  # the modelled network: latency per ring step in microseconds
compute_ms = 5.0  # the modelled step: one rank's forward, backward and optimizer step without communication (ms)

check_parameters(world_size=(world_size, int))
check_value("world_size", world_size, 16 <= world_size <= 1024, "16 to 1,024 (a cluster-sized world; simulate's limit)")

# %%
import math
import warnings

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, DistributedSampler

from helpers.at_scale import MLP_PARAMS, ddp_steps, mlp, rank_batch
from helpers.costmodel import predict_data_parallel, ring_allreduce_seconds
from helpers.engine import launch, simulate

N_TRAIN, N_TEST = 60_000, 10_000  # MNIST's sizes

# %% [markdown]
# ## 0. The collectives at 64 ranks: predict, then check
#
# Lesson 00a ran each collective on 2 ranks. Here they run on `world_size` ranks, 64 by default.
# Rank r starts with the number `r + 1`. Write down your prediction for rank 5 and for the last
# rank before you run the next cell:
#
# - `all_reduce` with the default sum, on `r + 1`;
# - `broadcast` from rank 0, of `100 + r`;
# - `all_gather_into_tensor` of `[r]` into a tensor of `world_size` numbers;
# - `reduce_scatter_tensor` with the sum, of `[0, 1, ..., world_size - 1]` times `r + 1`.
#
# torch 2.14 also calls the last two `all_gather_single` and `reduce_scatter_single`. The old
# names still work and print a `FutureWarning`, which the cell hides.

# %%
def collectives(rank, world_size):
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # sum over the ranks, in place
    sent = torch.tensor([100.0 + rank])
    dist.broadcast(sent, src=0)  # rank 0's value everywhere
    gathered = torch.empty(world_size)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))  # one number from each rank
    shard = torch.empty(1)
    dist.reduce_scatter_tensor(shard, torch.arange(world_size, dtype=torch.float32) * (rank + 1))
    return {"all_reduce": total.item(), "broadcast": sent.item(),
            "all_gather_into_tensor": gathered.tolist(), "reduce_scatter_tensor": shard.item()}


with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "`torch.distributed.*` is deprecated", FutureWarning)
    coll = simulate(collectives, world_size)
pd.DataFrame(coll).loc[[0, 5, world_size - 1]].assign(
    all_gather_into_tensor=lambda d: d["all_gather_into_tensor"].map(lambda v: f"{v[:3]} ... {v[-1]}"))

# %% [markdown]
# **Claim:** with N = `world_size` ranks, every rank holds these values:
#
# | collective | value on rank r |
# |---|---|
# | `all_reduce` | `1 + 2 + ... + N = N(N + 1) / 2` on every rank |
# | `broadcast` | 100, rank 0's value, on every rank |
# | `all_gather_into_tensor` | `[0, 1, ..., N - 1]` on every rank |
# | `reduce_scatter_tensor` | `r × N(N + 1) / 2`: element r of the summed inputs |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank's value of the four collectives
n = world_size
assert len(coll) == n
for r, got in enumerate(coll):
    assert got["all_reduce"] == n * (n + 1) / 2, (r, got["all_reduce"])
    assert got["broadcast"] == 100.0, (r, got["broadcast"])
    assert got["all_gather_into_tensor"] == [float(i) for i in range(n)], r
    assert got["reduce_scatter_tensor"] == r * n * (n + 1) / 2, (r, got["reduce_scatter_tensor"])
print(f"{n} ranks: all_reduce {n * (n + 1) // 2} everywhere; rank 5's reduce_scatter_tensor "
      f"{coll[5]['reduce_scatter_tensor']:g}")

# %% [markdown]
# ## 1. DDP on many ranks: the gradient is the mean
#
# The worker is the one a real job runs. `ddp_steps` builds a small MNIST-sized MLP
# (784 → 64 → 10), wraps it in DDP and trains on this rank's batch. Each rank's batch comes
# from a generator seeded with its rank, so a one-process reference can rebuild every batch.

# %%
print(f"the MLP has {MLP_PARAMS:,} parameters")
results = simulate(ddp_steps, world_size, 1, batch_per_rank)

reference = mlp()
local = []
for rank in range(world_size):
    reference.zero_grad()
    x, y = rank_batch(rank, batch_per_rank)
    F.cross_entropy(reference(x), y).backward()
    local.append([p.grad.clone() for p in reference.parameters()])
mean = [torch.stack(gs).mean(0) for gs in zip(*local)]

# %% [markdown]
# **Claim:** after the backward, every one of the ranks holds the same gradient, the mean of the
# local gradients computed one by one in this process; no rank's local gradient equals it.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank's gradient is the mean of the local gradients
for out in results:
    for g, m in zip(out["grads"], mean):
        torch.testing.assert_close(g, m, rtol=1e-5, atol=1e-7)
assert not any(all(torch.equal(a, b) for a, b in zip(loc, mean)) for loc in local)
print(f"{world_size} ranks, one gradient: the mean of {world_size} local gradients")

# %% [markdown]
# Is the simulation itself right? Run the same worker on 2 real ranks: 2 processes and gloo.
#
# **Claim:** the simulation at 2 ranks gives the values 2 real gloo ranks give, for every
# parameter's gradient and weight.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: 2 simulated ranks give what 2 real gloo ranks give
real = launch(ddp_steps, 2, 2, batch_per_rank)
simulated = simulate(ddp_steps, 2, 2, batch_per_rank)
for r in range(2):
    for key in ("grads", "weights"):
        for a, b in zip(real[r][key], simulated[r][key]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
print("2 simulated ranks = 2 real gloo ranks")

# %% [markdown]
# ## 2. Bytes per rank, and what the network would cost
#
# DDP packs gradients into buckets and all-reduces each bucket. A communication hook sees every
# bucket. A ring all-reduce makes each rank send `2(N-1)/N` times the bucket's bytes.

# %%
def bucket_bytes(rank, world_size):
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    for step in range(2):  # DDP rebuilds its buckets after the first step
        ddp.zero_grad()
        x, y = rank_batch(rank, batch_per_rank, step)
        F.cross_entropy(ddp(x), y).backward()
    return seen[-1:] if len(seen) == 2 else seen


buckets = simulate(bucket_bytes, world_size)
grad_bytes = 4 * MLP_PARAMS
print(f"bucket bytes on rank 0: {buckets[0]}; all float32 gradients: {grad_bytes:,} bytes")

# %% [markdown]
# **Claim:** every rank sees the same buckets, and they hold all the gradient bytes: 4 bytes per
# parameter.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the same buckets on every rank, holding every gradient byte
assert all(b == buckets[0] for b in buckets)
assert sum(buckets[0]) == grad_bytes

# %%
def ring_bytes(rank, world_size):
    """DDP's gradients with a ring all-reduce written as a comm hook, and the bytes this rank sent."""
    n, sent = world_size, [0]

    def ring(state, bucket):
        chunks = bucket.buffer().tensor_split(n)  # n views of the bucket

        def step(send, recv):  # send one chunk to rank + 1, receive one from rank - 1
            out, ins = [0] * n, [0] * n
            out[(rank - 1) % n], ins[(rank + 1) % n] = recv.numel(), send.numel()
            got = torch.empty_like(recv)
            dist.all_to_all_single(got, send.contiguous(), out, ins)
            sent[0] += send.numel() * send.element_size()
            return got

        for s in range(n - 1):  # reduce-scatter: add the neighbour's partial sums
            chunks[(rank - s - 1) % n].add_(step(chunks[(rank - s) % n], chunks[(rank - s - 1) % n]))
        for s in range(n - 1):  # all-gather: pass the finished sums on
            chunks[(rank - s) % n].copy_(step(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n]))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer().div_(n))
        return fut

    ddp = nn.parallel.DistributedDataParallel(mlp())
    ddp.register_comm_hook(None, ring)
    F.cross_entropy(ddp(rank_batch(rank, batch_per_rank)[0]), rank_batch(rank, batch_per_rank)[1]).backward()
    return sent[0], [p.grad for p in ddp.parameters()]


measured = {n: simulate(ring_bytes, n) for n in (2, 3, 4, 8, 16)}  # a ring, run on simulated ranks
sizes = [2, 4, 8, 16, 32, 64, 128, 256]
sent = [2 * (n - 1) / n * grad_bytes for n in sizes]
bandwidth = bandwidth_GBps * 1e9
model_rows = predict_data_parallel(sizes, MLP_PARAMS, compute_ms / 1e3, alpha_us * 1e-6,
                                   bandwidth, bucket_bytes=max(buckets[0]))
table = pd.DataFrame({"ranks": sizes, "bytes sent per rank": sent,
                      "all-reduce (ms)": [r["comm_ms"] for r in model_rows],
                      "step, no overlap (ms)": [r["step_ms_no_overlap"] for r in model_rows]})
table

# %% [markdown]
# **Claim:** a ring all-reduce as a comm hook, on 2, 3, 4, 8 and 16 simulated ranks, sends
# `2(N-1)/N` times the gradient bytes from each rank, to within a float per step. It gives DDP's
# mean gradient. So the bytes grow towards twice the gradient bytes, never past them. The cost
# model's all-reduce time is the ring formula's, per bucket.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: bytes each rank sent in the ring against 2(N-1)/N; the cost model's ring formula
for n, outs in measured.items():
    formula = 2 * (n - 1) / n * grad_bytes
    assert math.isclose(sum(b for b, _ in outs) / n, formula), (n, [b for b, _ in outs])
    assert all(abs(b - formula) <= 4 * 2 * (n - 1) for b, _ in outs), (n, formula, [b for b, _ in outs])
for g, m in zip(measured[2][0][1], [torch.stack(gs).mean(0) for gs in zip(*local[:2])]):
    torch.testing.assert_close(g, m, rtol=1e-5, atol=1e-7)  # the ring gives the mean of ranks 0 and 1
assert all(a < b for a, b in zip(sent, sent[1:])) and sent[-1] < 2 * grad_bytes
for n, row in zip(sizes, model_rows):
    ring = len(buckets[0]) * 2 * (n - 1) * alpha_us * 1e-6 + ring_allreduce_seconds(grad_bytes, n, 0.0, bandwidth)
    assert math.isclose(row["comm_ms"], ring * 1e3, rel_tol=1e-9)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(sizes, [s / 1e3 for s in sent], marker="o")
ax1.set(xscale="log", xlabel="ranks N", ylabel="bytes sent per rank per step (kB)",
        title="Ring all-reduce: 2(N-1)/N × gradient bytes")
ax2.plot(sizes, table["step, no overlap (ms)"], marker="o")
ax2.set(xscale="log", xlabel="ranks N", ylabel="modelled step time (ms)",
        title=f"Cost model: {bandwidth_GBps:g} GB/s, {alpha_us:g} µs per ring step")
fig.tight_layout()

# %% [markdown]
# The step time here is the model's, for the network you named in the parameters. The
# simulation's own wall time says nothing about a cluster: its ranks take turns on this machine.
#
# ## 3. The sampler at 64 and 256 replicas
#
# `DistributedSampler` gives every rank the same number of items. When the dataset does not divide
# evenly it pads by repeating items from the start, or with `drop_last=True` it drops the tail.

# %%
def sampler_sizes(rank, world_size):
    train = DistributedSampler(range(N_TRAIN), shuffle=True, seed=0)
    dropped = DistributedSampler(range(N_TRAIN), shuffle=True, seed=0, drop_last=True)
    test = DistributedSampler(range(N_TEST), shuffle=False)
    return {"train": len(train), "drop_last": len(dropped), "test": list(test)}


sampler = {n: simulate(sampler_sizes, n) for n in (64, 256)}
rows = []
for n, outs in sampler.items():
    rows.append({"replicas": n, "train per rank": outs[0]["train"], "train padding": n * outs[0]["train"] - N_TRAIN,
                 "drop_last per rank": outs[0]["drop_last"], "dropped": N_TRAIN - n * outs[0]["drop_last"],
                 "test per rank": len(outs[0]["test"]), "test items seen twice": n * len(outs[0]["test"]) - N_TEST})
pd.DataFrame(rows)

# %% [markdown]
# **Claim:** at 64 replicas each rank gets 938 training items, 32 of them padding; `drop_last`
# gives 937 and drops 32. At 256 replicas: 235 and 160 of padding. The test set at 64 replicas
# has 48 items seen twice, at 256 replicas 240.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the sampler's padding and drops at 64 and 256 replicas
by = {r["replicas"]: r for r in rows}
assert (by[64]["train per rank"], by[64]["train padding"]) == (938, 32)
assert (by[64]["drop_last per rank"], by[64]["dropped"]) == (937, 32)
assert (by[256]["train per rank"], by[256]["train padding"]) == (235, 160)
assert by[64]["test items seen twice"] == 48 and by[256]["test items seen twice"] == 240
for outs in sampler.values():
    seen = [i for o in outs for i in o["test"]]
    assert sorted(set(seen)) == list(range(N_TEST))  # every item at least once

# %% [markdown]
# The duplicates skew an accuracy computed over what the ranks saw. The padding repeats the
# first items. Say the model is wrong on the first 1,000 test items and right on the rest.
#
# **Claim:** at 256 replicas the true accuracy is 90%. Over the padded test set it is
# `9,000 / 10,240`, 2.1 points lower: the 240 repeated items are all wrong ones.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the accuracy over the padded test set, 2.1 points under the true one
seen = [i for o in sampler[256] for i in o["test"]]
right = [i >= 1_000 for i in seen]
true_acc = sum(i >= 1_000 for i in range(N_TEST)) / N_TEST
padded_acc = sum(right) / len(seen)
repeats = len(seen) - N_TEST
assert true_acc == 0.9 and padded_acc == 9_000 / 10_240, (true_acc, padded_acc)
assert 2.0 < 100 * (true_acc - padded_acc) < 2.2, 100 * (true_acc - padded_acc)  # in percentage points
print(f"true accuracy {true_acc:.4%}, over the padded set {padded_acc:.4%} ({repeats} repeats)")

# %% [markdown]
# ## 4. Global batch and the learning-rate schedule
#
# With 64 ranks each taking `batch_per_rank` items, one step consumes 64 times as many. An epoch
# has 64 times fewer steps. Goyal et al. (2017, "Accurate, Large Minibatch SGD") scale the
# learning rate with the global batch and warm it up; whatever the rule, the schedule must count
# the steps each rank really takes.

# %%
def steps_per_epoch(rank, world_size, batch):
    sharded = DataLoader(range(N_TRAIN), batch_size=batch, sampler=DistributedSampler(range(N_TRAIN)))
    unsharded = DataLoader(range(N_TRAIN), batch_size=batch)
    return len(sharded), len(unsharded)


sharded_steps, unsharded_steps = simulate(steps_per_epoch, world_size, batch_per_rank)[0]
global_batch = world_size * batch_per_rank
print(f"global batch {global_batch}; steps per epoch: {sharded_steps} sharded, {unsharded_steps} unsharded")

# %% [markdown]
# **Claim:** each rank takes `ceil(ceil(60,000 / N) / batch)` steps per epoch. A linear decay
# counted on the unsharded loader's length has barely moved when the epoch ends: the learning rate
# is still above 90% of its peak, where it should be 0.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: steps per epoch, and the schedule counted on the wrong loader
assert sharded_steps == math.ceil(math.ceil(N_TRAIN / world_size) / batch_per_rank)
assert unsharded_steps == math.ceil(N_TRAIN / batch_per_rank)
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
wrong = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / unsharded_steps)
for _ in range(sharded_steps):
    opt.step()
    wrong.step()
lr_left = opt.param_groups[0]["lr"]
assert lr_left > 0.9
print(f"after one epoch of {sharded_steps} steps the wrong schedule is at {lr_left:.1%} of its peak")

# %% [markdown]
# ## 5. FSDP2: each rank holds one chunk
#
# `fully_shard` splits every parameter along its first dimension into `world_size` chunks. Rank r
# keeps chunk r. At 64 ranks the first layer's 64 rows give each rank one row. The last layer's
# weight has 10 rows, so ranks 10 and up keep none of it.

# %%
def fsdp_shards(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for layer in (model[1], model[3]):
        fully_shard(layer)
    fully_shard(model)
    return [p.to_local().detach().clone() for p in model.parameters()]


shards = simulate(fsdp_shards, world_size)
full = [p.detach() for p in mlp().parameters()]
shard_bytes = [sum(s.numel() * s.element_size() for s in ranks) for ranks in shards]
ddp_bytes = 4 * MLP_PARAMS
memory = pd.DataFrame({"rank": [0, 9, 10, world_size - 1],
                       "FSDP2 parameter bytes": [shard_bytes[r] for r in (0, 9, 10, world_size - 1)],
                       "DDP parameter bytes": ddp_bytes})
memory

# %% [markdown]
# **Claim:** rank r's shard of every parameter is chunk r of the full parameter (empty where
# there is no chunk r). Together the shards hold every byte once; DDP holds all of them on every
# rank.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: rank r's FSDP2 shard is chunk r
for rank, ranks in enumerate(shards):
    for shard, p in zip(ranks, full):
        chunks = p.chunk(world_size)
        expected = chunks[rank] if rank < len(chunks) else p[:0]
        assert torch.equal(shard, expected), rank
assert sum(shard_bytes) == ddp_bytes
assert max(shard_bytes) < ddp_bytes / 10

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.plot(range(world_size), [b / 1e3 for b in shard_bytes], "o", markersize=3, label="FSDP2: this rank's shards")
ax.axhline(ddp_bytes / 1e3, color="tab:red", label="DDP: the whole model on every rank")
ax.set(yscale="log", xlabel="rank", ylabel="parameter bytes on the rank (kB)",
       title=f"Parameters held per rank at {world_size} ranks")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, off the data
fig.tight_layout()

# %% [markdown]
# ## 6. What a simulation cannot show
#
# The simulation gets values right. It cannot show three things. Time: the ranks take turns on
# this machine's cores. The network: bytes move by memory copies, so section 2 uses a model.
# Parallel compute: one process has one GIL.
#
# torch also has a `fake` backend. Its collectives return at once and do nothing. It shows shapes,
# never values. The check runs DDP with a hook that does what DDP's default hook does: divide the
# bucket by `world_size`, then `dist.all_reduce` it.
#
# **Claim:** under the `fake` backend, `all_reduce` leaves a tensor as it was. So DDP's gradient
# on rank 0 is its local gradient divided by `world_size`, not the mean of section 1.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: what the fake backend's all-reduce does, alone and under DDP
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
try:
    one_value = torch.tensor([3.0])
    dist.all_reduce(one_value)  # a sum over world_size ranks on a real backend

    def all_reduce_then_bucket(state, bucket):  # allreduce_hook's steps; its future is the bucket
        dist.all_reduce(bucket.buffer().div_(world_size))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, all_reduce_then_bucket)
    x, y = rank_batch(0, batch_per_rank)
    F.cross_entropy(ddp(x), y).backward()
    fake = [p.grad.clone() for p in model.parameters()]
finally:
    dist.destroy_process_group()
assert one_value.item() == 3.0, one_value
for a, b in zip(fake, local[0]):
    torch.testing.assert_close(a, b / world_size)
assert not all(torch.allclose(a, b) for a, b in zip(fake, mean))
print("fake backend: the all-reduce did nothing; rank 0 kept its local gradient / world_size")

# %% [markdown]
# ## 7. The general checks at 64 ranks: a bug that 8 ranks hide
#
# Lesson 06d section 7 showed three general checks. `against_one_process(fn, world_size)` runs
# your unchanged worker at `world_size` simulated ranks and in one process. It compares every
# parameter after every optimizer step. The convention: one global batch, each rank training on
# its share.
#
# Here is a worker that splits a global batch of 1000 items into equal contiguous shares of
# `1000 // world_size` items. At 8 ranks that is 125 items each, every item trained on.
# At 64 ranks it is 15 items each, 960 items in all.

# %%
from helpers.checks import against_one_process
from helpers.notebook import record_checks

GLOBAL_BATCH = 1000  # items per optimizer step, across all ranks


def split_steps(rank, world_size, steps=2, fix=False, lr=0.1):
    """DDP on the MLP; each step's global batch split into one share per rank."""
    model = nn.parallel.DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    per_rank = GLOBAL_BATCH // world_size  # the bug: the remainder is never trained on
    for step in range(steps):
        x, y = rank_batch(0, GLOBAL_BATCH, step)
        opt.zero_grad()
        if fix:  # every item; summed, then scaled, so that DDP's mean is the global batch's mean
            share = slice(rank, None, world_size)
            loss = F.cross_entropy(model(x[share]), y[share], reduction="sum") * world_size / GLOBAL_BATCH
        else:
            share = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = F.cross_entropy(model(x[share]), y[share])
        loss.backward()
        opt.step()


def outcome(check, *args, **kwargs):
    """The check's error, as 'Type: message', or its report."""
    try:
        return repr(check(*args, **kwargs))
    except AssertionError as e:
        return f"{type(e).__name__}: {e}"


split = {(n, fix): outcome(against_one_process, split_steps, n, fix=fix)
         for n, fix in ((8, False), (world_size, False), (world_size, True))}
untrained = GLOBAL_BATCH % world_size
pd.Series({f"{n} ranks, {'fix' if fix else 'bug'}": said.splitlines()[0] for (n, fix), said in split.items()},
          name="against_one_process").to_frame()

# %% [markdown]
# **Claim:** at 8 ranks `against_one_process` passes. At `world_size` ranks, 64 by default, it
# raises `DivergedFromOneProcess` at optimizer step 1, on every rank. There 40 items of each step
# are never trained on. With every item, each share's loss summed then scaled, the check passes
# at 64 ranks.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the split passes at 8 ranks, diverges at world_size ranks, and its fix passes
assert split[(8, False)].startswith("<8 ranks = one process"), split[(8, False)]
assert split[(world_size, True)].startswith(f"<{world_size} ranks = one process"), split[(world_size, True)]
bug = split[(world_size, False)]
assert (untrained > 0) == bug.startswith("DivergedFromOneProcess"), bug
if world_size == 64:
    assert untrained == 40 and "after optimizer step 1" in bug and "(of 64)" in bug, bug
record_checks("09_cluster_on_a_laptop", {
    "integer split of the global batch, 8 ranks": {"against_one_process": "not caught: no remainder at 8 ranks"},
    f"integer split of the global batch, {world_size} ranks": {
        "against_one_process": "caught: step 1" if untrained else "not caught: no remainder"}})
print(bug)

# %% [markdown]
# ## What we saw
#
# - The four collectives gave every one of 64 ranks the value you could predict by hand.
# - `simulate` ran DDP unchanged at 64 ranks. Every rank's gradient was the mean, as at 2 real ranks.
# - Each rank sends `2(N-1)/N` times the gradient bytes per step: under twice the gradient, at any N.
# - The sampler pads at 64 and 256 replicas, and repeated test items move an accuracy.
# - A schedule must count the sharded loader's steps, not the dataset's.
# - FSDP2 rank r keeps chunk r of every parameter; some ranks keep nothing of a small layer.
# - Values, yes; time, network and parallel compute, no.
# - `against_one_process` at 64 ranks caught a batch split that 8 ranks hide.
#
# ## Exercises
#
# Type your answer in the `answer_N` cell and run the check below it. A solution follows each
# check, collapsed; student copies leave the solutions out.

# %% [markdown]
# ### Exercise 1: padding at 128 replicas
#
# How many test items does `DistributedSampler` repeat when 10,000 items are split over 128
# replicas? Answer with a number.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 1
expected_1 = 128 * len(DistributedSampler(range(N_TEST), num_replicas=128, rank=0, shuffle=False)) - N_TEST
check_answer("ex1", answer_1, expected_1, hint="each rank gets ceil(10,000 / 128) items")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
solution_1 = 128 * math.ceil(10_000 / 128) - 10_000
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: bytes per rank at 100 ranks
#
# How many bytes does each rank send per step in the ring all-reduce of this MLP's float32
# gradients at 100 ranks? The table of section 2 stops at powers of two. Answer with a number.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 2
expected_2 = 2 * (100 - 1) / 100 * grad_bytes  # grad_bytes: 4 bytes per parameter, section 2
check_answer("ex2", answer_2, expected_2, hint="2(N-1)/N times 4 bytes per parameter")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
solution_2 = 2 * 99 / 100 * sum(b for b in buckets[0])  # the buckets hold every gradient byte
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** this is the last lesson of the path. When you meet a symptom, the casebook starts at [10a casebook: the training loop](10a_casebook_training_loop.ipynb).
# <!-- next:end -->
