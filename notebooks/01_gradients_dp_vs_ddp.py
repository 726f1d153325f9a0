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
# # 01 · Gradients under DataParallel and DistributedDataParallel
#
# <!-- opening:start -->
# **You will be able to** explain why a DDP gradient is the mean over ranks, and write that average by hand. **You need** [00a processes and collectives](00a_processes_and_collectives.ipynb), [00b DDP cell by cell](00b_ddp_cell_by_cell.ipynb).
# <!-- opening:end -->
#
# **The question:** one batch is spread over several devices. Which gradient does the model end
# up with under `nn.DataParallel` (DP)? And under `DistributedDataParallel` (DDP)?
#
# The toy is small enough to check by hand: `Linear(2, world_size + 1)`, loss `(model(x) *
# labels).sum()`, one sample per process, labelled one-hot on its index. A code cell after every
# *Claim* asserts it.
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | single-device reference | CPU | CPU |
# | DDP workers defined in this notebook, run by `helpers.engine.launch` | `world_size` processes, backend `gloo` | backend `nccl` when there are at least `world_size` GPUs, else `gloo` on CPU |
# | real `nn.DataParallel` (sections 3b and 4) | **skipped, and says so**: DP has `device_ids == []` and just calls the module (3a) | real DP over all visible GPUs |
# | DP **emulation** written in section 3c | runs (clearly labelled emulation) | runs too, for comparison |
#
# **New here:** the launcher `launch(fn, world_size, ...)`. It runs a function defined in a cell
# on `world_size` new processes and returns each rank's result. You also meet
# [DP](../docs/GLOSSARY.md#dp)'s scatter, replicate and gather, and
# [DDP](../docs/GLOSSARY.md#ddp)'s [all-reduce](../docs/GLOSSARY.md#all-reduce) of gradients
# over the [world size](../docs/GLOSSARY.md#world-size) [ranks](../docs/GLOSSARY.md#rank). The
# [glossary](../docs/GLOSSARY.md) defines every term, with its Chinese name.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 2  # number of DDP ranks (processes); 1, 2 or 4 (section 4 splits 4 samples evenly)

# %%
from helpers.notebook import check_answer, check_parameters, check_value

seed = 0  # seeds the Linear toy's weights and its inputs

check_parameters(world_size=(world_size, int))
check_value("world_size", world_size, world_size in (1, 2, 4), "1, 2 or 4 (section 4 splits 4 samples evenly)")

# %%
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
from IPython.display import Markdown, display
from torch import nn
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from helpers.dataparallel import scatter_chunk_sizes  # items per replica call of nn.DataParallel
from helpers.engine import launch, worker_device

n_gpus = torch.cuda.device_count()
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; world_size = {world_size}; seed = {seed}")
print("DP branch that will run:",
      f"REAL nn.DataParallel on {n_gpus} GPU(s) (sections 3b, 4) plus the CPU emulation (3c)" if n_gpus >= 1
      else "no GPU: real nn.DataParallel is SKIPPED (3b, 4); the CPU EMULATION of DP runs (3c)")

# %% [markdown]
# ## 1. The toy and its single-device gradient
#
# The global batch has `world_size` samples `x[r]` of 2 small-integer features, so the numbers
# read exactly. Under DDP, rank `r` sees sample `r`. The last output unit matches no label: a
# control row. The same seed gives the same model in every process.

# %%
def make_toy_model(world_size, seed):
    """Linear(2, world_size + 1), float32, identical for the same seed in any process."""
    torch.manual_seed(seed)
    return nn.Linear(2, world_size + 1)


def make_toy_batch(world_size, seed):
    """x: (world_size, 2) float32 integers in [-4, 4], no all-zero row; labels: (world_size, world_size + 1) one-hot on r."""
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randint(-4, 5, (world_size, 2), generator=gen).float()
    x[x.abs().sum(dim=1) == 0, 0] = 1.0  # an all-zero sample would look like the control row
    return x, torch.eye(world_size, world_size + 1)


def toy_loss(output, labels):
    return (output * labels).sum()  # a sum over samples


def grads_of(model, x, labels):
    """{name: gradient of toy_loss(model(x), labels)} as CPU tensors; leaves model.grad as it was."""
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(toy_loss(model(x), labels), list(params.values()))
    return {name: g.detach().cpu() + 0.0 for name, g in zip(params, grads)}  # + 0.0: no -0.0 in prints


x, labels = make_toy_batch(world_size, seed)
model = make_toy_model(world_size, seed)
print(model)
print("x      =", x.tolist())
print("labels =", labels.tolist())

# %% [markdown]
# With loss $L = \sum_i \sum_j \text{out}_{ij}\,\text{labels}_{ij} = \sum_r (W x_r + b)_r$,
# sample `r` touches only row `r`. So $\partial L/\partial W_{r\cdot} = x_r$ and
# $\partial L/\partial b_r = 1$.
#
# **Claim:** on one device, the gradient over the whole batch is the **sum** of the per-sample
# gradients. Weight row `r` equals `x[r]` and the last row is zero. The bias gradient is 1 for
# the first `world_size` entries and 0 for the last.

# %%
full = grads_of(model, x, labels)  # the reference: one device, whole batch
per_sample = [grads_of(model, x[r : r + 1], labels[r : r + 1]) for r in range(world_size)]

expected_w = torch.zeros(world_size + 1, 2)
expected_w[:world_size] = x  # row r = x[r], last row 0 (the hand computation above)
expected_b = torch.zeros(world_size + 1)
expected_b[:world_size] = 1.0
assert_close(full["weight"], expected_w, msg="single-device weight gradient: row r should equal x[r], last row 0")
assert_close(full["bias"], expected_b, msg="single-device bias gradient should be [1, ..., 1, 0]")
assert_close(full["weight"], sum(g["weight"] for g in per_sample),
             msg="full-batch gradient should be the sum of the per-sample gradients")
print("single-device weight gradient:\n", full["weight"])
print("single-device bias gradient:", full["bias"].tolist())

# %% [markdown]
# ## 2. DDP: each rank's own gradient, then all-reduce and average
#
# `launch(ddp_gradients, world_size, ...)` runs the worker below on `world_size` processes, each
# with the default process group. The results come back in rank order.
#
# On each rank the worker takes sample `rank`. It first computes the gradient **without** DDP:
# the *local* gradient. Then it wraps a fresh copy in `DistributedDataParallel` and runs
# backward again. DDP's backward divides each gradient by `world_size`. It then
# **all-reduces** the quotients across ranks, which sums them. Every rank is left with the mean.
# Section 2b writes this by hand and shows the order.

# %%
def ddp_gradients(rank, world_size, x, labels, seed):
    device = worker_device()  # cuda:<local_rank> under nccl, else cpu
    x_r, labels_r = x[rank : rank + 1].to(device), labels[rank : rank + 1].to(device)  # this rank's shard

    local = grads_of(make_toy_model(world_size, seed).to(device), x_r, labels_r)  # no DDP

    model = make_toy_model(world_size, seed).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    toy_loss(ddp_model(x_r), labels_r).backward()  # backward all-reduces the gradients
    synced = {name: p.grad.detach().cpu() + 0.0 for name, p in model.named_parameters()}
    print(f"x_r = {x_r[0].tolist()}, local grad row {rank} = {local['weight'][rank].tolist()}, "
          f"after DDP's backward = {synced['weight'][rank].tolist()}")
    return {"x": x_r[0].cpu(), "local": local, "ddp": synced}


# %% [markdown]
# Worker prints appear below, prefixed `[rank r]`.

# %%
t0 = time.perf_counter()
lin = launch(ddp_gradients, world_size, x, labels, seed)
print(f"launch of {world_size} rank(s) took {time.perf_counter() - t0:.1f} s (mostly process start-up)")

# %% [markdown]
# **Claim:** rank `r`'s local gradient is zero except row `r`, which equals `x[r]`. Its bias
# gradient is one-hot on `r`. After DDP's backward, **every** rank holds the same gradient: the
# single-device gradient divided by `world_size`.
#
# | `world_size` | row `r` | last row | bias gradient |
# |---|---|---|---|
# | any | `x[r] / world_size` | zero | `1 / world_size`, then 0 |
# | 2 | `x[r] / 2` | zero | `[0.5, 0.5, 0]` |
#
# Exercise 1 asks for 4 ranks.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank's local and DDP gradients, against the hand computation
rows = []
for r, res in enumerate(lin):
    assert_close(res["x"], x[r], msg=f"rank {r} should have taken sample x[{r}]")
    local_expected = torch.zeros(world_size + 1, 2)
    local_expected[r] = x[r]
    assert_close(res["local"]["weight"], local_expected, msg=f"rank {r}: the local gradient should have only row {r} = x[{r}]")
    assert_close(res["local"]["bias"], torch.eye(world_size + 1)[r], msg=f"rank {r}: local bias gradient")
    assert_close(res["ddp"]["weight"], expected_w / world_size,
                 msg=f"rank {r}: after all-reduce, row s should be x[s] / world_size, last row 0")
    assert_close(res["ddp"]["bias"], expected_b / world_size, msg=f"rank {r}: DDP bias gradient")
    assert_close(res["ddp"]["weight"], full["weight"] / world_size,
                 msg="DDP gradient should be the single-device gradient / world_size for this summed loss")
    rows.append({"rank": r, "its sample x[r]": res["x"].tolist(),
                 "local grad, row r": res["local"]["weight"][r].tolist(),
                 "local grad, other rows": "all 0" if world_size > 1 else "-",
                 "DDP grad, row r": res["ddp"]["weight"][r].tolist(),
                 "x[r] / world_size": (res["x"] / world_size).tolist(),
                 "DDP bias grad": res["ddp"]["bias"].tolist()})
literal = {2: [0.5, 0.5, 0.0]}  # the numbers typed in the claim (4 ranks: exercise 1)
if world_size in literal:
    for res in lin:
        assert_close(res["ddp"]["bias"], torch.tensor(literal[world_size]), msg=f"bias gradient {literal[world_size]}")
        assert_close(res["ddp"]["weight"][world_size], torch.zeros(2), msg=f"row {world_size} is zero")
    print(f"the typed numbers for world_size = {world_size} hold: bias gradient {literal[world_size]}")
else:
    print(f"world_size = {world_size}: the typed numbers are for 2; checked the general formula")
pd.DataFrame(rows).set_index("rank")

# %% [markdown]
# ## 2b. The same averaging, written by hand
#
# `dist.all_reduce(grad)` leaves the element-wise **sum** over ranks on every rank. DDP groups
# gradients into buckets, as [05b](05b_communication_and_cost_model.ipynb) shows.
#
# DDP divides **first**. Its reducer multiplies each gradient by `1 / world_size` while copying
# it into its bucket. Then it all-reduces the bucket with `SUM`. The sum of the quotients is the
# mean. The source says so in `torch/csrc/distributed/c10d/reducer.cpp`: "Divides while copying
# into the bucket view". The built-in hook does the same. See `_allreduce_fut` in
# `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`: "Apply the division first to
# avoid overflow, especially for FP16".
#
# The worker below does that on a plain model, and runs DDP on a copy to compare. Then it sets
# every rank's gradient to float32's largest value and averages it three ways: by DDP, by
# `average_gradients`, and sum then divide.

# %%
def average_gradients(model, world_size):
    for p in model.parameters():
        p.grad /= world_size  # divide first, as DDP does
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # every rank now holds the sum of the quotients: the mean


def largest_gradient_averaged(order, device, world_size):
    """Every rank's gradient is float32's largest value; the gradient after averaging it in `order`."""
    model = nn.Linear(1, 1, bias=False).to(device)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if order == "DDP" else model
    net(torch.tensor([[torch.finfo(torch.float32).max]], device=device)).sum().backward()  # d loss / d w = x
    if order == "divide, then sum":
        average_gradients(model, world_size)
    elif order == "sum, then divide":
        dist.all_reduce(model.weight.grad, op=dist.ReduceOp.SUM)
        model.weight.grad /= world_size
    return model.weight.grad.item()


def by_hand_vs_ddp(rank, world_size, x, labels, seed):
    device = worker_device()
    x_r, labels_r = x[rank : rank + 1].to(device), labels[rank : rank + 1].to(device)
    plain = make_toy_model(world_size, seed).to(device)
    toy_loss(plain(x_r), labels_r).backward()  # local gradient only: no DDP here
    average_gradients(plain, world_size)
    wrapped = make_toy_model(world_size, seed).to(device)
    ddp_model = DDP(wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    toy_loss(ddp_model(x_r), labels_r).backward()
    return {"by hand": {n: p.grad.cpu() + 0.0 for n, p in plain.named_parameters()},
            "ddp": {n: p.grad.cpu() + 0.0 for n, p in wrapped.named_parameters()},
            "largest": {order: largest_gradient_averaged(order, device, world_size)
                        for order in ("DDP", "divide, then sum", "sum, then divide")}}


t0 = time.perf_counter()
by_hand = launch(by_hand_vs_ddp, world_size, x, labels, seed)
print(f"launch took {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# **Claim:** on every rank, the hand-written divide-and-all-reduce gives DDP's gradient, for the
# weight and the bias. Both equal the mean of section 1's per-sample gradients, computed here
# without collectives.
#
# **Claim:** take 2 or more ranks whose gradients are all float32's largest value. DDP and
# `average_gradients` give that value back. Summing first overflows to `inf`. So DDP divides
# before it sums. With 1 rank there is nothing to sum, and all three give the value back.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: by hand equals DDP; dividing first does not overflow
mean_of_samples = {n: sum(g[n] for g in per_sample) / world_size for n in ("weight", "bias")}
for r, res in enumerate(by_hand):
    for n in ("weight", "bias"):
        assert_close(res["by hand"][n], res["ddp"][n], msg=f"rank {r}, {n}: all_reduce by hand != DDP")
        assert_close(res["by hand"][n], mean_of_samples[n], msg=f"rank {r}, {n}: != mean of the per-sample gradients")
    f32_max = torch.finfo(torch.float32).max
    got = res["largest"]
    assert got["DDP"] == f32_max and got["divide, then sum"] == f32_max, f"rank {r}: {got}"
    if world_size > 1:
        assert got["sum, then divide"] == float("inf"), f"rank {r}: summing first should overflow: {got}"
    else:
        assert got["sum, then divide"] == f32_max, got
print(f"every rank's gradient {torch.finfo(torch.float32).max:.4g}, averaged over {world_size} rank(s) (rank 0):",
      by_hand[0]["largest"])
print("rank 0, weight gradient by hand:\n", by_hand[0]["by hand"]["weight"])

# %% [markdown]
# ## 3. DP: one process, replicas, gradients summed into the original model
#
# `nn.DataParallel` is one process driving several GPUs. On every forward it does four things.
# It **scatters** the batch over `device_ids`, in chunks along dim 0. It **replicates** the
# module onto them. It runs the replicas **in parallel**, one thread per GPU. It **gathers** the
# outputs on `device_ids[0]`.
#
# The loss is computed on the gathered output, so over the whole batch. Backward **sums** the
# replicas' gradients into the original parameters. Sources: `DataParallel.forward` in
# `torch/nn/parallel/data_parallel.py`, and the
# [DataParallel docs](https://pytorch.org/docs/stable/generated/torch.nn.DataParallel.html).
# So DP's gradient should be the single-device gradient of the whole batch. Row `r` is `x[r]`,
# not `x[r] / world_size`. Sections 3b and 3c check that.
#
# ### 3a. `nn.DataParallel` on this machine
#
# **Claim (CPU):** without GPUs, `nn.DataParallel(model).device_ids == []`. Its forward just
# calls the module once, on the whole batch. There is no scatter, no replica and no speed-up.
# The source is `data_parallel.py`: `if not self.device_ids: return self.module(*inputs, **kwargs)`.

# %%
from helpers.notebook import cpu_claim, gpu_claim

if cpu_claim("without GPUs nn.DataParallel has device_ids == [] and calls the module once"):
    cpu_model = make_toy_model(world_size, seed)
    dp_cpu = nn.DataParallel(cpu_model)
    calls = []  # batch size of every forward call of the wrapped module
    hook = cpu_model.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    toy_loss(dp_cpu(x), labels).backward()
    hook.remove()
    print(f"nn.DataParallel on CPU: device_ids = {dp_cpu.device_ids}, "
          f"module called {len(calls)} time(s) with batch size(s) {calls}")
    assert dp_cpu.device_ids == [], f"expected no devices on a CPU-only machine, got {dp_cpu.device_ids}"
    assert calls == [world_size], f"expected one call on the whole batch ({world_size}), got {calls}"
    assert_close(cpu_model.weight.grad, full["weight"], msg="DP on CPU is the plain module: same gradient")

# %% [markdown]
# ### 3b. Real `nn.DataParallel` on GPUs
#
# This section runs only when `torch.cuda.device_count() >= 1`. On a CPU-only machine the cell
# prints that it skipped, and why.
#
# **Claim (GPU):** real DP's gradient equals the single-device gradient of the whole batch. With
# one GPU, DP calls the module directly on the whole batch. With several, the forward hook below
# fires once per chunk of `x.chunk(n_gpus)`, each chunk on its own GPU. DP's scatter splits a
# batch that way, in `torch/csrc/cuda/comm.cpp`.

# %%
dp_real = None  # filled only when real DP runs
if gpu_claim("real DP's gradient equals the single-device gradient of the whole batch"):
    gpu_model = make_toy_model(world_size, seed).cuda()
    dp = nn.DataParallel(gpu_model)  # device_ids = every visible GPU
    calls = []
    hook = gpu_model.register_forward_hook(lambda mod, inp, out: calls.append((str(inp[0].device), inp[0].shape[0])))
    toy_loss(dp(x.cuda()), labels.cuda()).backward()
    hook.remove()
    dp_real = {"weight": gpu_model.weight.grad.cpu(), "bias": gpu_model.bias.grad.cpu()}
    print(f"RAN real nn.DataParallel: device_ids = {dp.device_ids}; forward calls (device, chunk size): {calls}")
    # one replica call per chunk of tensor.chunk(n_gpus), on cuda:0, cuda:1, ... (the threads finish in any order)
    expected = [(f"cuda:{i}", n) for i, n in enumerate(scatter_chunk_sizes(len(x), n_gpus))]
    assert sorted(calls, key=lambda c: int(c[0].split(":")[1])) == expected, f"calls {calls}, expected {expected}"
    assert_close(dp_real["weight"], full["weight"], msg="real DP weight gradient != single-device gradient")
    assert_close(dp_real["bias"], full["bias"], msg="real DP bias gradient != single-device gradient")
display(Markdown(f"**DP branch that ran:** real `nn.DataParallel` on {n_gpus} GPU(s), checked against one device."
                 if dp_real is not None else
                 "**DP branch that ran:** none on GPU: real `nn.DataParallel` was **skipped** "
                 "(`torch.cuda.device_count() == 0`); the CPU **emulation** in 3c stands in for it."))

# %% [markdown]
# How many GPUs does a batch use? `chunk` cuts `n` rows into pieces of `ceil(n / k)` rows each,
# so fewer than `k` pieces can come out. Each piece goes to one GPU.
#
# **Claim:** a batch smaller than the GPU count runs on fewer replicas than GPUs. A batch that
# does not divide may still use every GPU. The pieces, from `torch.chunk`:
#
# | rows | GPUs | pieces | GPUs used |
# |---|---|---|---|
# | 1 | 2 | `[1]` | 1 |
# | 3 | 2 | `[2, 1]` | 2 |
# | 7 | 4 | `[2, 2, 2, 1]` | 4 |
# | 5 | 4 | `[2, 2, 1]` | 3 |
# | 6 | 4 | `[2, 2, 2]` | 3 |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the pieces DP's scatter makes, with torch.chunk on CPU
dp_pieces = {(1, 2): [1], (3, 2): [2, 1], (7, 4): [2, 2, 2, 1], (5, 4): [2, 2, 1], (6, 4): [2, 2, 2]}
for (batch, devices), sizes in dp_pieces.items():
    got = [len(c) for c in torch.arange(batch).chunk(devices)]
    assert got == sizes, f"{batch} rows over {devices} GPUs: torch.chunk gives {got}, the table says {sizes}"
    assert scatter_chunk_sizes(batch, devices) == got, f"scatter_chunk_sizes({batch}, {devices}) != torch.chunk"
    print(f"{batch} rows over {devices} GPUs: pieces {got}, {len(got)} GPU(s) used")
assert len(torch.arange(1).chunk(2)) < 2, "a batch smaller than the GPU count uses fewer GPUs"
for batch, devices in ((3, 2), (7, 4)):  # they do not divide, yet every GPU gets a piece
    assert batch % devices and len(torch.arange(batch).chunk(devices)) == devices, (batch, devices)

# %% [markdown]
# ### 3c. What DP does, emulated on CPU
#
# This is an **emulation**, not torch's DP. The function below follows `DataParallel.forward`
# step by step, on CPU:
#
# 1. **scatter**: `x.chunk(num_replicas)` along dim 0, as DP's `scatter` chunks a tensor;
# 2. **replicate**: differentiable copies of the parameters, `p.clone()`, as DP's `Broadcast`
#    autograd function makes them on each GPU. `torch.nn.parallel.replicate` itself refuses CPU
#    devices, which the cell checks;
# 3. **apply** each replica to its chunk, here one after the other, with no speed-up;
# 4. **gather**: `torch.cat` of the outputs.
#
# In backward, autograd accumulates every replica's gradient into the original parameter. That
# is a sum, as DP's `Broadcast.backward` does across GPUs with `ReduceAddCoalesced`.

# %%
def emulated_data_parallel(module, x, num_replicas):
    """EMULATION of nn.DataParallel's forward on CPU. Returns (output, chunks, replica parameters)."""
    chunks = x.chunk(num_replicas)  # 1. scatter
    replicas = []
    for _ in chunks:  # 2. replicate: one differentiable copy of every parameter per chunk
        params = {name: p.clone() for name, p in module.named_parameters()}
        for copy in params.values():
            copy.retain_grad()  # keep each replica's own gradient, to look at it below
        replicas.append(params)
    outputs = [functional_call(module, params, (chunk,)) for params, chunk in zip(replicas, chunks)]  # 3. apply
    return torch.cat(outputs), chunks, replicas  # 4. gather


emu_model = make_toy_model(world_size, seed)
try:  # torch's own replicate on CPU: refused, hence the clones above
    torch.nn.parallel.replicate(emu_model, [torch.device("cpu")])
    refusal = None
except ValueError as e:
    refusal = str(e)
assert refusal is not None and "cpu" in refusal, f"torch.nn.parallel.replicate should refuse CPU devices: {refusal}"
print(f"torch.nn.parallel.replicate on CPU: ValueError({refusal!r})")

out, chunks, replicas = emulated_data_parallel(emu_model, x, num_replicas=world_size)
toy_loss(out, labels).backward()  # the loss on the gathered, whole-batch output
replica_grads = [params["weight"].grad + 0.0 for params in replicas]
print("EMULATED DP: chunk sizes", [c.shape[0] for c in chunks])
for r, g in enumerate(replica_grads):
    print(f"  replica {r} weight gradient rows: {g.tolist()}")

# %% [markdown]
# **Claim:** with `world_size` replicas, replica `r` gets chunk `r`, which is sample `x[r]`. Its
# gradient is that sample's gradient, with only row `r` non-zero. The replicas' gradients
# **sum** to the original model's gradient. That equals the single-device gradient, which is
# `world_size` times DDP's.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the emulated replicas' gradients sum to the single-device one
for r, g in enumerate(replica_grads):
    assert_close(chunks[r], x[r : r + 1], msg=f"replica {r} should get chunk x[{r}:{r + 1}]")
    assert_close(g, per_sample[r]["weight"], msg=f"replica {r}'s gradient should be sample {r}'s gradient")
assert_close(sum(replica_grads), emu_model.weight.grad, msg="replica gradients should sum into the original")
assert_close(emu_model.weight.grad, full["weight"], msg="emulated DP gradient != single-device gradient")
assert_close(emu_model.bias.grad, full["bias"], msg="emulated DP bias gradient != single-device gradient")
assert_close(emu_model.weight.grad, lin[0]["ddp"]["weight"] * world_size,
             msg="DP gradient should be world_size x the DDP gradient here")
if dp_real is not None:
    assert_close(dp_real["weight"], emu_model.weight.grad, msg="real DP and the emulation should agree")
dp_grad_for_plot = dp_real["weight"] if dp_real is not None else emu_model.weight.grad
dp_label = "real nn.DataParallel (GPU)" if dp_real is not None else "DP, EMULATED on CPU"
print("DP gradient shown in the figure:", dp_label)

# %% [markdown]
# ### The same numbers as pictures
#
# One heatmap per weight gradient, on one colour scale: rows are output units, columns input
# features. Each rank's local gradient fills its own row. DDP's gradient is their average, DP's
# their sum. The last row stays zero.

# %%
panels = [(f"rank {r}: local gradient\n(no DDP)", res["local"]["weight"]) for r, res in enumerate(lin)]
panels += [
    ("DDP: all-reduced average\n(identical on every rank)", lin[0]["ddp"]["weight"]),
    (f"{dp_label}\n(sum over replicas)", dp_grad_for_plot),
    ("single device, whole batch\n(reference)", full["weight"]),
]
vmax = max(float(g.abs().max()) for _, g in panels) or 1.0
fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 3.6), constrained_layout=True)
for ax, (title, g) in zip(axes, panels):
    im = ax.imshow(g.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax)
    for (i, j), v in pd.DataFrame(g.numpy()).stack().items():
        ax.text(j, i, f"{v:g}", ha="center", va="center", fontsize=9,
                color="white" if abs(v) > 0.6 * vmax else "black")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("input feature j")
    ax.set_xticks(range(g.shape[1]))
    ax.set_yticks(range(g.shape[0]))
axes[0].set_ylabel("output unit i (weight row)")
fig.colorbar(im, ax=axes, shrink=0.8, label="dL/dW[i, j] (loss units per weight unit)")
fig.suptitle(f"Weight gradients of Linear(2, {world_size + 1}), world_size = {world_size}")
plt.show()

# %% [markdown]
# ## 4. Sum versus mean
#
# A scalar model `y = w * x` starts at `w = 1`, with target 0. The fixed **global batch** is
# `x = [-1, 2, -3, 4]`: 4 samples per optimizer step. They are split evenly, `4 / world_size`
# per rank. The learning rate is `1e-3`, and each run takes one real SGD step. By hand:
#
# * Summed loss $L = \sum_i (w x_i)^2$: $dL/dw = 2w\sum_i x_i^2 = 2 \cdot 30 = 60$, and
#   $w \leftarrow 1 - 10^{-3}\cdot 60 = 0.94$.
# * Mean loss $L = \frac14\sum_i (w x_i)^2$: gradient 15, $w = 0.985$.
# * DDP, 2 ranks of 2 samples, **summed** loss: rank 0 holds `[-1, 2]`, local gradient 10. Rank
#   1 holds `[-3, 4]`, local gradient 50. DDP averages them to **30**, so $w = 0.97$. That is
#   half the single-process gradient. In general it is $60 / \text{world\_size}$.
# * DDP, **mean** loss: local gradients 5 and 25, average **15**, $w = 0.985$. That matches one
#   process, for any `world_size` that splits the batch evenly.
# * DP computes the loss on the gathered whole batch. So it should match the single process for
#   both reductions.
#
# The step, the single-process run and the DDP worker:

# %%
SCALAR_X = [-1.0, 2.0, -3.0, 4.0]  # the global batch
LR = 1e-3
global_batch_size = len(SCALAR_X)
assert global_batch_size % world_size == 0, (
    f"world_size = {world_size} must divide the global batch of {global_batch_size} samples: use 1, 2 or 4")
batch_per_rank = global_batch_size // world_size


def scalar_model(device="cpu"):
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64, device=device)  # y = w x; float64: 0.94 prints as 0.94
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def as_column(values, device="cpu"):
    return torch.tensor(values, dtype=torch.float64, device=device).reshape(-1, 1)  # (batch, 1)


def one_step(model, forward, x, reduction, lr, loss_scale=1.0):
    """One real SGD step; forward is the model or a wrapper of it. Returns dL/dw before and w after."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = forward(x)
    loss = ((out**2).sum() if reduction == "sum" else (out**2).mean()) * loss_scale  # target 0
    loss.backward()
    grad = model.weight.grad.item()
    opt.step()
    return {"grad": grad, "w": model.weight.item()}


def ddp_scalar_steps(rank, world_size, global_x, lr, loss_scale=1.0):
    device = worker_device()
    per_rank = len(global_x) // world_size
    shard = as_column(global_x[rank * per_rank : (rank + 1) * per_rank], device)  # contiguous shard
    result = {}
    for reduction in ("sum", "mean"):
        model = scalar_model(device)
        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        result[reduction] = one_step(model, ddp_model, shard, reduction, lr, loss_scale)
    print(f"shard {shard.flatten().tolist()}, loss x {loss_scale:g}: "
          + ", ".join(f"{k} grad {v['grad']:g}" for k, v in result.items()))
    return result


single, dp_emulated, dp_real_scalar = {}, {}, None
for red in ("sum", "mean"):
    m = scalar_model()
    single[red] = one_step(m, m, as_column(SCALAR_X), red, LR)
    m = scalar_model()
    dp_emulated[red] = one_step(m, lambda xb, m=m: emulated_data_parallel(m, xb, world_size)[0], as_column(SCALAR_X), red, LR)
if n_gpus >= 1:
    dp_real_scalar = {}
    for red in ("sum", "mean"):
        m = scalar_model("cuda")
        dp_real_scalar[red] = one_step(m, nn.DataParallel(m), as_column(SCALAR_X, "cuda"), red, LR)
    print("RAN real nn.DataParallel on the scalar toy:", dp_real_scalar)
else:
    print("SKIPPED real nn.DataParallel on the scalar toy: no GPU (torch.cuda.device_count() == 0); "
          "the CPU emulation of section 3c stands in for it")
print(f"single process: {single}\nDP (emulated): {dp_emulated}")

# %% [markdown]
# **Claim:** real SGD steps give these numbers. DDP's are identical on every rank.
#
# | run | summed loss: grad / `w` | mean loss: grad / `w` |
# |---|---|---|
# | one process | 60 / 0.94 | 15 / 0.985 |
# | DP, emulated | 60 / 0.94 | 15 / 0.985 |
# | DDP, 2 ranks | 30 / 0.97 | 15 / 0.985 |
# | DDP, 4 ranks | 15 / 0.985 | 15 / 0.985 |
# | DDP, any `world_size` | `60 / world_size` | 15 / 0.985 |
#
# **Claim (GPU):** real DP on GPUs gives the one-process numbers too.

# %%
def check(measured, grad, what):
    # the gradient, and w after one SGD step from w = 1, recomputed from the gradient
    assert_close(measured["grad"], grad, msg=f"{what}: gradient {measured['grad']} != {grad}")
    assert_close(measured["w"], 1.0 - LR * grad, msg=f"{what}: w after the step {measured['w']} != {1.0 - LR * grad}")


t0 = time.perf_counter()
scalar = launch(ddp_scalar_steps, world_size, SCALAR_X, LR)
print(f"launch took {time.perf_counter() - t0:.1f} s")
ddp = scalar[0]
for r, res in enumerate(scalar):
    assert res == ddp, f"rank {r} should hold the same gradient and weight as rank 0: {res} != {ddp}"
hand_sum = 2 * sum(v**2 for v in SCALAR_X)  # 2 w sum(x^2) at w = 1, by hand
check(single["sum"], hand_sum, "single process, sum")
check(single["mean"], hand_sum / global_batch_size, "single process, mean")
assert_close(single["sum"]["w"], 0.94, msg="single process, sum: w = 0.94")
assert_close(single["mean"]["w"], 0.985, msg="single process, mean: w = 0.985")
for red in ("sum", "mean"):
    check(dp_emulated[red], single[red]["grad"], f"emulated DP, {red}")
if gpu_claim("real DP on the scalar toy gives the one-process numbers"):
    for red in ("sum", "mean"):
        check(dp_real_scalar[red], single[red]["grad"], f"real DP, {red}")
# DDP: each rank's local gradient of its own shard, by hand, then the average over ranks
shards = [SCALAR_X[r * batch_per_rank : (r + 1) * batch_per_rank] for r in range(world_size)]
check(ddp["sum"], sum(2 * sum(v**2 for v in s) for s in shards) / world_size, "DDP, sum")
check(ddp["mean"], sum(2 * sum(v**2 for v in s) / len(s) for s in shards) / world_size, "DDP, mean")
assert_close(ddp["mean"]["w"], 0.985, msg="DDP, mean: w = 0.985")
typed = {2: (30.0, 0.97), 4: (15.0, 0.985)}  # the numbers typed in the claim
if world_size in typed:
    assert_close((ddp["sum"]["grad"], ddp["sum"]["w"]), typed[world_size], msg=f"DDP ({world_size} ranks), sum")
print(f"DDP (rank 0): {ddp}")

# %% [markdown]
# ## 5. A common mistake: multiplying the loss by `world_size`
#
# <a id="case-loss-times-world-size"></a>
# **Symptom:** I multiplied the loss by world_size and the steps got too large.
#
# A common thought: "DDP divides by `world_size`, so multiply the loss by `world_size` to undo
# it." With a **mean** loss DDP was already right: the scaling silently multiplies the learning
# rate by `world_size`.
#
# **Claim:** under DDP, loss × `world_size` gives 60 with the summed loss. With the mean loss it
# gives `15 * world_size`, not 15: 30 for 2 ranks, 60 for 4. The cell reruns section 4's worker
# with `loss_scale = world_size`.

# %%
t0 = time.perf_counter()
scaled = launch(ddp_scalar_steps, world_size, SCALAR_X, LR, loss_scale=float(world_size))
print(f"launch took {time.perf_counter() - t0:.1f} s")
assert all(res == scaled[0] for res in scaled), "every rank should hold the same result"
ddp_x_world = scaled[0]
check(ddp_x_world["sum"], single["sum"]["grad"], "DDP, sum x world_size")
check(ddp_x_world["mean"], single["mean"]["grad"] * world_size, "DDP, mean x world_size")
typed = {2: 30.0, 4: 60.0}
if world_size in typed:
    assert_close(ddp_x_world["mean"]["grad"], typed[world_size], msg=f"DDP ({world_size} ranks), mean x world_size")
if world_size > 1:  # the mean loss the learner asked for is no longer what is optimised
    assert ddp_x_world["mean"]["grad"] != single["mean"]["grad"], "mean loss x world_size should differ from 15"
print(f"DDP, mean loss x {world_size}: grad {ddp_x_world['mean']['grad']:g}, w {ddp_x_world['mean']['w']:g} "
      f"(single process: {single['mean']['grad']:g} / {single['mean']['w']:g})")

# %% [markdown]
# ### Summary table and chart
#
# One row per mode and loss reduction: the gradient, and `w` after one SGD step. "same as single
# process?" compares with one process and the same reduction.

# %%
dp_mode = "DP (real, GPU)" if dp_real_scalar is not None else "DP (EMULATED, CPU)"
modes = {"single process": single, dp_mode: dp_real_scalar if dp_real_scalar is not None else dp_emulated,
         f"DDP ({world_size} ranks)": ddp, "DDP, loss x world_size": ddp_x_world}
if dp_real_scalar is not None:
    modes["DP (EMULATED, CPU)"] = dp_emulated
table = pd.DataFrame([
    {"mode": mode, "loss reduction": red, "grad": v[red]["grad"], "w after step": v[red]["w"],
     "same as single process?": abs(v[red]["grad"] - single[red]["grad"]) < 1e-9}
    for mode, v in modes.items() for red in ("sum", "mean")
]).set_index(["mode", "loss reduction"])
table

# %% [markdown]
# The weights differ only in the second decimal, so they are points on a zoomed axis.

# %%
fig, (ax_g, ax_w) = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
names = list(modes)
width = 0.38
for k, (red, marker) in enumerate((("sum", "o"), ("mean", "s"))):
    pos = [i + (k - 0.5) * width for i in range(len(names))]
    bars = ax_g.bar(pos, [modes[m][red]["grad"] for m in names], width, label=f"{red} loss")
    ax_g.bar_label(bars, fmt="%g", fontsize=8)
    ws_ = [modes[m][red]["w"] for m in names]
    ax_w.plot(pos, ws_, marker, markersize=8, linestyle="none", color=bars.patches[0].get_facecolor())
    for p_, w_ in zip(pos, ws_):
        ax_w.annotate(f"{w_:g}", (p_, w_), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
for ax in (ax_g, ax_w):
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    ax.set_xlabel("mode")
ax_g.set_ylim(0, 1.15 * max(modes[m][r]["grad"] for m in names for r in ("sum", "mean")))
fig.legend(*ax_g.get_legend_handles_labels(), loc="outside upper center", ncol=2)
ax_g.set_ylabel("dL/dw before the step (loss units per unit of w)")
ax_g.set_title("Gradient of the scalar toy (bars from 0)")
ax_w.set_ylabel("w after one SGD step (lr = 1e-3, dimensionless)")
ax_w.set_ylim(0.9, 1.0)
ax_w.grid(axis="y", alpha=0.3)
ax_w.set_title("Weight after one step from w = 1 (points, zoomed axis)")
plt.show()

# %% [markdown]
# ## What we saw
#
# * **DP** is one process driving many GPUs. It computes the loss on the gathered whole batch. It
#   sums the replicas' gradients into one model. So its gradient **is** the single-device
#   gradient. Without GPUs, `nn.DataParallel` has no devices and just calls the module. Section
#   3c's emulation showed the data flow, and its gradient matched the single device.
# * **DDP** runs one process per rank. Each rank computes the gradient of its own shard. Its
#   backward divides each gradient by `world_size` and **all-reduces** the quotients. Every rank
#   ends with the same gradient, the mean of the local ones. In the toy, row `r` is
#   `x[r] / world_size`.
# * A division and `dist.all_reduce`, in that order, give the same numbers. Summing first
#   overflows where dividing first does not.
# * With a **mean** loss and an evenly split global batch, DDP gives exactly the single-process
#   gradient: 15, `w = 0.985`. With a **summed** loss it gives `1 / world_size` of it.
# * Multiplying a mean loss by `world_size` "to undo the averaging" is a mistake. It gives
#   `15 * world_size` instead of 15.
#
# ## Exercises
#
# Predict each answer by hand first; exercise 4 asks for code. Put it into `answer_N` in place of
# `None`. Then run the check cell below it. It prints "correct", or "not yet" with a hint. In the
# full notebook, a collapsed solution follows each check. Click the "…" or the bar on its left
# to open it. Student copies leave the solutions out. Every solution runs when the full notebook
# runs, so each is known to pass its check. Only exercise 4 starts processes.

# %% [markdown]
# ### Exercise 1: the Linear toy on 4 ranks
#
# Run section 2 in your head for `world_size = 4`. The toy is then `Linear(2, 5)` with 4
# samples, one per rank. Labels are one-hot on the rank. After DDP's backward, what **bias
# gradient** does every rank hold? Answer with a list of 5 numbers.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, the bias gradient DDP gives on 4 ranks
# expected: each rank's local gradient of its own sample (this notebook's functions, no processes),
# averaged as DDP's all-reduce and division by the world size do
x4, labels4 = make_toy_batch(4, seed)
model4 = make_toy_model(4, seed)
local4 = [grads_of(model4, x4[r : r + 1], labels4[r : r + 1])["bias"] for r in range(4)]
expected_1 = (sum(local4) / 4).tolist()
if world_size == 4:  # this run launched 4 real ranks (the full profile): DDP must agree
    assert_close(lin[0]["ddp"]["bias"], torch.tensor(expected_1), msg="DDP's bias gradient, 4 ranks")
    print("checked against the 4-rank DDP run of section 2")
check_answer("ex1", answer_1, expected_1,
             hint="which bias entries does sample r touch, and what does DDP divide by?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# Sample r has its label one-hot on unit r, so d loss / d bias is 1 at entry r and 0 elsewhere:
# only rank r has a 1 in entry r. DDP divides each rank's gradient by 4 and sums them, so
# entries 0..3 become 1/4; entry 4 (the control unit, no label) stays 0 everywhere.
solution_1 = [1 / 4, 1 / 4, 1 / 4, 1 / 4, 0.0]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: the summed loss on 4 ranks
#
# Take section 4's scalar toy: `w = 1`, `x = [-1, 2, -3, 4]`, summed loss `sum((w x)^2)`. Run it
# on `world_size = 4`, so each rank holds one sample. What gradient `dL/dw` does every rank hold
# after DDP's backward? Answer with a number.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, the summed-loss gradient on 4 ranks
# expected: one real SGD step on each rank's one-sample shard, in this process, averaged as DDP does
expected_2 = 0.0
for v in SCALAR_X:
    m = scalar_model()
    expected_2 += one_step(m, m, as_column([v]), "sum", LR)["grad"] / 4
if world_size == 4:  # this run launched 4 real ranks (the full profile)
    assert_close(ddp["sum"]["grad"], expected_2, msg="DDP's summed-loss gradient, 4 ranks")
    print("checked against the 4-rank DDP run of section 4")
check_answer("ex2", answer_2, expected_2, hint="one process gets 60; what does DDP do with 4 ranks' gradients?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# One process: dL/dw = 2 w sum(x^2) = 2 * (1 + 4 + 9 + 16) = 60. Each rank sums over its own
# sample only (2, 8, 18, 32); DDP averages them: 60 / 4 = 15 (w after the step: 0.985).
solution_2 = 2 * sum(v**2 for v in (-1, 2, -3, 4)) / 4
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: uneven shards
#
# The global batch `[-1, 2, -3, 4, 5]` has 5 samples. `x.chunk(2)` splits it 3 + 2 over two
# ranks: `[-1, 2, -3]` and `[4, 5]`. Each rank uses the **mean** loss `mean((w x)^2)` at `w = 1`.
# What gradient does DDP give every rank? Answer with a number, 4 significant digits being
# enough, or a fraction as text, such as `"7/12"`.
#
# Then compare with one process's mean-loss gradient over the 5 samples. Why do they differ?
# What loss on each rank would make DDP match?

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 3, the mean-loss gradient of uneven shards
# expected: the real mean-loss gradient of each rank's shard (torch's chunk(2): 3 + 2), averaged
batch5 = torch.tensor([-1.0, 2.0, -3.0, 4.0, 5.0])
expected_3 = 0.0
for shard5 in batch5.chunk(2):
    m = scalar_model()
    expected_3 += one_step(m, m, as_column(shard5.tolist()), "mean", LR)["grad"] / 2
check_answer("ex3", answer_3, expected_3, rel_tol=1e-3,
             hint="each rank's mean-loss gradient is 2 * mean(x^2) over its own samples")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
from fractions import Fraction

# Each rank's mean-loss gradient is 2 * mean(x^2) over its own shard:
rank0, rank1 = [-1, 2, -3], [4, 5]
g0 = Fraction(2 * sum(v**2 for v in rank0), len(rank0))  # 28/3
g1 = Fraction(2 * sum(v**2 for v in rank1), len(rank1))  # 41
solution_3 = (g0 + g1) / 2  # DDP's average: 151/6, about 25.17
one_process = Fraction(2 * sum(v**2 for v in rank0 + rank1), 5)  # 22
print(f"DDP: {solution_3} = {float(solution_3):.4f}; one process, mean over 5 samples: {one_process}")
# They differ because averaging two means weighs each of rank 1's 2 samples 1/4 and each of
# rank 0's 3 samples 1/6, instead of 1/5 each. The fix: on every rank, loss = sum over its
# samples * world_size / global batch size (here 2 / 5); DDP's average then gives 22.
fixed = (Fraction(2, 5) * 2 * sum(v**2 for v in rank0) + Fraction(2, 5) * 2 * sum(v**2 for v in rank1)) / 2
assert fixed == one_process == 22, (fixed, one_process)
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# ### Exercise 4: fix a DDP worker
#
# A colleague wrote this worker. It uses the mean loss and section 5's habit of "undoing" DDP's
# averaging:
#
# ```python
# def colleague_worker(rank, world_size, global_x, lr):
#     device = worker_device()
#     per_rank = len(global_x) // world_size
#     shard = as_column(global_x[rank * per_rank : (rank + 1) * per_rank], device)
#     model = scalar_model(device)
#     ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
#     return one_step(model, ddp_model, shard, "mean", lr, loss_scale=world_size)
# ```
#
# Write a fixed worker with the same signature. You may use `scalar_model`, `as_column` and
# `one_step` from section 4. Take any `world_size` that divides the global batch. Every rank
# must end with the single process's mean-loss gradient and weight, `single["mean"]`.
#
# Replace the `None` line below with your `def my_worker(rank, world_size, global_x, lr): ...`.
# Follow it with `answer_4 = my_worker`. The check runs your worker on `world_size` real ranks. It
# compares every rank's `[grad, w]`.

# %% tags=["exercise"]
answer_4 = None  # your fixed worker function (def my_worker ...; answer_4 = my_worker)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 4, your worker on world_size real ranks
# expected on every rank: one process's mean-loss step on the whole global batch (section 4)
expected_4 = [[single["mean"]["grad"], single["mean"]["w"]]] * world_size
# runs your worker on world_size real ranks; a crash is reported as one, with the rank's error
check_answer("ex4", answer_4, expected_4,
             run=lambda fn: [[res["grad"], res["w"]] for res in launch(fn, world_size, SCALAR_X, LR)],
             hint="the mean loss on equal shards is already right after DDP's average: what undoes it?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 4 (try the exercise first)
# With equal shards, the mean over a rank's shard averaged over ranks is the mean over the whole
# global batch: DDP's averaging is exactly what the mean loss needs. Drop the loss scaling.
def fixed_worker(rank, world_size, global_x, lr):
    device = worker_device()
    per_rank = len(global_x) // world_size
    shard = as_column(global_x[rank * per_rank : (rank + 1) * per_rank], device)
    model = scalar_model(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return one_step(model, ddp_model, shard, "mean", lr)  # no loss_scale


solution_4 = [[res["grad"], res["w"]] for res in launch(fixed_worker, world_size, SCALAR_X, LR)]
check_answer("ex4", solution_4, expected_4, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [02 one model, many processes](02_one_model_many_processes.ipynb): say what DDP broadcasts, when, and what it never synchronises.
# <!-- next:end -->
