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
# # 07b · Communication hooks and what comes after DDP
#
# <!-- opening:start -->
# **You will be able to** write a communication hook, count compressed bytes, size ZeRO and FSDP. **You need** [04 MNIST: single, DP, DDP](04_mnist_single_dp_ddp.ipynb), [07a torchrun and many nodes](07a_torchrun_and_many_nodes.ipynb).
# <!-- opening:end -->
#
# **The question:** every DDP step all-reduces every gradient. How can DDP send fewer bytes?
# Communication hooks can, so what do they cost? And what comes after DDP, when the model no
# longer fits one device?
#
# Everything here reuses notebook 04's MNIST recipe: `Linear(784, 10)`, SGD, `lr = 0.01` and
# global batch 64. Its worker is `helpers.mnist_train.ddp_train_worker`, the packaged form of
# notebook 04's `ddp_train`.
# This lesson's cells write the communication hooks and the DDP training that measures them.
# `helpers/comm_hooks.py` keeps only the byte-count formulas they are checked against. Each
# claim, in bold, is asserted by the check cell after the code that runs it.
#
# 1. communication hooks · 2. the GPU path · 3. what comes after DDP
#
# Terms from the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank), [world size](../docs/GLOSSARY.md#world-size),
# [backend](../docs/GLOSSARY.md#backend), [process group](../docs/GLOSSARY.md#process-group), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [bucket](../docs/GLOSSARY.md#bucket), [DDP](../docs/GLOSSARY.md#ddp), [replica](../docs/GLOSSARY.md#replica),
# [global batch size](../docs/GLOSSARY.md#global-batch-size).
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | 1. communication hooks | gloo: hooks written in the cells (averaging, three broken ones), then the built-in fp32, fp16, bf16, PowerSGD rank 1 and 4 | the same hooks on nccl |
# | 2. GPU path, 3. after DDP | this part prints whether this run had a GPU | prose and arithmetic |
#
# The lesson ends with three exercises, each checked by a cell. The last one asks for a
# communication hook and runs it on 2 real ranks.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
hooks_steps = 100  # training steps of the launch() run and per communication hook; 0 means one full epoch
min_accuracy = 0.80  # every hook must reach this test accuracy (100 steps: ~0.86; full epoch: ~0.91)
max_accuracy_drop = 0.01  # PowerSGD may cost at most this much test accuracy against fp32 (100 steps: up to ~0.005; full epoch: ~0.0001, bound 0.002)

# %%
import math

from helpers.mnist_steps import MNIST_TRAIN_IMAGES, total_steps
from helpers.notebook import check_answer, check_parameters, check_value

# Constants of this lesson: no profile changes them
world_size = 2  # processes of the launch() run and the hooks comparison
powersgd_ranks = [1, 4]  # PowerSGD matrix_approximation_rank values to compare
powersgd_start_iter = 10  # PowerSGD runs the plain all-reduce for this many steps first (at least 2)
max_16bit_drop = 0.001  # fp16 / bf16 may cost at most this much test accuracy against fp32 (10 of 10,000 images)
backend = "auto"  # "auto": nccl with one GPU per rank, else gloo; or "gloo" / "nccl"
global_batch_size = 64  # samples per optimizer step, all ranks together
lr = 0.01  # SGD learning rate
seed = 0  # seeds the initial weights and the data order
job_timeout_s = 300  # a launch() still running after this many seconds is stopped (and the cell fails)

check_parameters(hooks_steps=(hooks_steps, int), min_accuracy=(min_accuracy, float),
                 max_accuracy_drop=(max_accuracy_drop, float))

hook_steps = total_steps(MNIST_TRAIN_IMAGES, global_batch_size, world_size, max_steps=hooks_steps)  # TrainConfig's
check_value("hooks_steps", hooks_steps, powersgd_start_iter < hook_steps,
            f"0 (one epoch) or above powersgd_start_iter = {powersgd_start_iter}: PowerSGD needs later steps")

# %%
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch
from torch.testing import assert_close

from helpers.comm_hooks import HookSpec, expected_bytes_per_step, powersgd_compresses
from helpers.engine import launch, resolve_backend
from helpers.mnist_train import TrainConfig, build_model, ddp_train_worker

n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
backend = resolve_backend(None if backend == "auto" else backend, world_size)
print(f"torch {torch.__version__}; CUDA GPUs: {n_gpus}; world_size = {world_size}, backend = {backend!r}")

# %% [markdown]
# ## 1. Communication hooks: sending fewer bytes
#
# Every DDP step all-reduces every gradient. For our model that is `P = 7,850` float32 numbers,
# or 31,400 bytes per rank per step. A **communication hook** replaces that all-reduce:
# `ddp_model.register_comm_hook(state, hook)`, as the [torch docs](https://pytorch.org/docs/stable/ddp_comm_hooks.html) describe. We compare
# the built-in hooks:
#
# * `allreduce_hook` is the plain all-reduce. It is documented to behave exactly like no hook,
#   so it is our baseline, "no compression".
# * `fp16_compress_hook` and `bf16_compress_hook` cast each gradient bucket to 16 bits,
#   all-reduce it and cast it back. They send half the bytes.
# * `powerSGD_hook` comes from Vogels, Karimireddy and Jaggi, *PowerSGD: Practical Low-Rank
#   Gradient Compression for Distributed Optimization*, NeurIPS 2019. It approximates each
#   gradient matrix `M`, of shape `n x m`, as `P Q^T` with rank `r`. The ranks all-reduce `P`,
#   which is `n x r`, and `Q`, which is `m x r`. That is `(n + m) * r` numbers instead of `n * m`.
# * PowerSGD sends a matrix uncompressed when compression saves less than
#   `min_compression_rate = 2` times. It sends every 1-D tensor, such as a bias, uncompressed
#   too. The first `start_powerSGD_iter` steps use the plain all-reduce. Error feedback adds what
#   compression dropped to the next step's gradient.
#
# The next cell works out, for each of our gradients, what PowerSGD sends at each rank `r`.

# %%
shapes = [tuple(p.shape) for p in build_model("linear").parameters()]
P = sum(torch.Size(s).numel() for s in shapes)
rows = []
for s in shapes:
    n, m = s[0], (torch.Size(s).numel() // s[0])
    row = {"gradient": f"{tuple(s)} viewed as {n} x {m}", "n * m (uncompressed numbers)": n * m}
    for r in powersgd_ranks:
        rr = min(n, m, r)
        row[f"(n + m) * r, r = {r}"] = (n + m) * rr
        row[f"compressed at r = {r}?"] = powersgd_compresses(s, r)
    rows.append(row)
print(f"P = {P} gradient elements: fp32 all-reduce = {4 * P} bytes per rank per step")
pd.DataFrame(rows).set_index("gradient")

# %% [markdown]
# ### A hook replaces DDP's averaging: it must do all of it
#
# DDP hands the hook a `GradBucket`, whose `bucket.buffer()` holds the bucket's gradients,
# flattened. DDP uses whatever tensor the returned future holds as the bucket's new gradients.
# Nothing else happens. If the hook does not all-reduce, nobody does. If it sums without
# dividing by the world size, the gradients are summed.

# %% [markdown]
# The averaging divides **first** and then sums. DDP's reducer divides each gradient by the
# world size while copying it into its bucket. Then it all-reduces the bucket with `SUM`. Its
# source, `torch/csrc/distributed/c10d/reducer.cpp`, says: "Divides while copying into the bucket
# view". The built-in `allreduce_hook` does the same. Its `_allreduce_fut`, in
# `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`, says: "Apply the division first
# to avoid overflow, especially for FP16". On paper the order does not matter. In floating point
# the two orders can round differently, and near the top of the number range only the sum
# overflows.
#
# A hook is three lines. The next cell writes the built-in averaging hook's logic and three
# broken hooks. The workers receive them by value.

# %%
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def average_hook(state, bucket):  # what DDP does by default: divide by world size, then sum over ranks
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def sum_then_divide_hook(state, bucket):  # BROKEN near float32's top: sums first, so the sum can overflow
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda fut: fut.value()[0].div_(dist.get_world_size()))


def sum_hook(state, bucket):  # BROKEN: all-reduces but forgets to divide
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def local_hook(state, bucket):  # BROKEN: communicates nothing, returns this rank's own gradients
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


HOOKS_UNDER_TEST = {"no hook (DDP's default)": None, "average_hook": average_hook, "sum_hook": sum_hook,
                    "sum_then_divide_hook": sum_then_divide_hook, "local_hook": local_hook, "fp16_compress_hook": default_hooks.fp16_compress_hook,
                    "bf16_compress_hook": default_hooks.bf16_compress_hook}


def gradient_through_hook(rank, world_size, hook, local_grads):
    """One weight w; rank r's loss is w * local_grads[r], so its local gradient is local_grads[r].
    Returns the gradient DDP leaves after backward (with `hook` registered; None: DDP's default),
    and w after one SGD step (lr 1) from w = 0."""
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    ddp(torch.tensor([[float(local_grads[rank])]])).sum().backward()
    grad = model.weight.grad.item()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {"grad": grad, "weight after a step": model.weight.item()}


def second_hook_raises(rank, world_size):
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    ddp.register_comm_hook(None, average_hook)
    try:
        ddp.register_comm_hook(None, average_hook)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def hook_cases(rank, world_size, cases):
    return [gradient_through_hook(rank, world_size, HOOKS_UNDER_TEST[name], grads) for name, grads in cases] + [
        second_hook_raises(rank, world_size)]


# %% [markdown]
# Two gloo ranks hold local gradients and run one backward through each hook. `local_hook`
# leaves each rank its own gradient, so after one step the two replicas hold different weights.
# They diverge, and nothing reports it. The fp16 hook rounds to float16 before it communicates,
# and float16's largest value is 65504. The bf16 hook keeps float32's range but has only 8 bits
# of precision. `F32_MAX` is float32's largest value, `torch.finfo(torch.float32).max`, about
# 3.4e38.
#
# | hook | local gradients on rank 0 and rank 1 | gradient after the hook, on both ranks |
# |---|---|---|
# | DDP's default, `average_hook` | 1 and 3 | 2.0 |
# | `sum_hook` | 1 and 3 | 4.0 |
# | `local_hook` | 1 and 3 | 1.0 on rank 0, 3.0 on rank 1: after one step the weights differ |
# | DDP's default | 1.003 and 1.0 | 1.0015 |
# | `fp16_compress_hook` | 1.003 and 1.0 | 1.001953125 |
# | `bf16_compress_hook` | 1.003 and 1.0 | 1.0 |
# | DDP's default | 70000 and 0 | 35000 |
# | `fp16_compress_hook` | 70000 and 0 | `inf` |
# | `bf16_compress_hook` | 70000 and 0 | 35072 |
# | DDP's default, `average_hook` | `F32_MAX` and `F32_MAX` | `F32_MAX` |
# | `sum_then_divide_hook` | `F32_MAX` and `F32_MAX` | `inf` |
#
# **Claim:** on two ranks, every hook gives the gradients its row of the table states. So DDP
# divides before it sums: `sum_then_divide_hook` overflows where DDP's default does not.
# Registering a second hook on the same DDP model raises `RuntimeError`.
#
# The next cell starts 2 gloo processes once for all the cases.

# %%
cases = [(name, [1.0, 3.0]) for name in ("no hook (DDP's default)", "average_hook", "sum_hook", "local_hook")]
cases += [(name, grads) for name in ("no hook (DDP's default)", "fp16_compress_hook", "bf16_compress_hook")
          for grads in ([1.003, 1.0], [70000.0, 0.0])]
F32_MAX = torch.finfo(torch.float32).max
cases += [(name, [F32_MAX, F32_MAX]) for name in ("no hook (DDP's default)", "average_hook", "sum_then_divide_hook")]
got = launch(hook_cases, 2, cases, backend="gloo", timeout=job_timeout_s)
hook_table = pd.DataFrame([{"hook": name, "local gradients (rank 0, rank 1)": grads,
                            "gradient after the hook, rank 0": got[0][i]["grad"],
                            "rank 1": got[1][i]["grad"],
                            "weight after one step, rank 0": got[0][i]["weight after a step"],
                            "rank 1 ": got[1][i]["weight after a step"]} for i, (name, grads) in enumerate(cases)])
grads_of = {(name, tuple(grads)): (got[0][i]["grad"], got[1][i]["grad"]) for i, (name, grads) in enumerate(cases)}
weights_of = {(name, tuple(grads)): (got[0][i]["weight after a step"], got[1][i]["weight after a step"])
              for i, (name, grads) in enumerate(cases)}

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each hook's gradients on two ranks, and a second hook raises
assert grads_of[("no hook (DDP's default)", (1.0, 3.0))] == (2.0, 2.0)
assert grads_of[("average_hook", (1.0, 3.0))] == (2.0, 2.0)
assert grads_of[("sum_hook", (1.0, 3.0))] == (4.0, 4.0)
assert grads_of[("local_hook", (1.0, 3.0))] == (1.0, 3.0)
assert weights_of[("local_hook", (1.0, 3.0))] == (-1.0, -3.0), "the replicas diverged after one step"
assert grads_of[("fp16_compress_hook", (1.003, 1.0))] == (1.001953125, 1.001953125)
assert_close(torch.tensor(grads_of[("no hook (DDP's default)", (1.003, 1.0))]), torch.tensor([1.0015, 1.0015]))
assert all(map(math.isinf, grads_of[("fp16_compress_hook", (70000.0, 0.0))]))
assert grads_of[("no hook (DDP's default)", (70000.0, 0.0))] == (35000.0, 35000.0)
assert grads_of[("bf16_compress_hook", (1.003, 1.0))] == (1.0, 1.0)
assert grads_of[("bf16_compress_hook", (70000.0, 0.0))] == (35072.0, 35072.0)
# divide first, then sum: F32_MAX / 2 + F32_MAX / 2 is F32_MAX; summing first overflows
assert grads_of[("no hook (DDP's default)", (F32_MAX, F32_MAX))] == (F32_MAX, F32_MAX), "DDP should divide first"
assert grads_of[("average_hook", (F32_MAX, F32_MAX))] == (F32_MAX, F32_MAX)
assert all(map(math.isinf, grads_of[("sum_then_divide_hook", (F32_MAX, F32_MAX))]))
# the same roundings by hand, in this kernel: cast, divide by 2, sum, cast back (what the hooks do)
for dtype, grads, expect in [(torch.float16, (1.003, 1.0), 1.001953125), (torch.bfloat16, (70000.0, 0.0), 35072.0)]:
    halves = [torch.tensor(g).to(dtype) / 2 for g in grads]
    assert float((halves[0] + halves[1]).float()) == expect
assert got[0][-1] is not None and got[1][-1] is not None, "registering a second hook should raise"
print("second register_comm_hook:", got[0][-1])
hook_table

# %% [markdown]
# ### The built-in hooks, measured
#
# The training run below registers one built-in hook on a fresh DDP model. It trains notebook
# 04's recipe, with the same `DistributedSampler` order and seed as `ddp_train_worker`. In each
# step it counts the bytes every rank hands to `torch.distributed.all_reduce`. While the counter
# is active, that name points at a wrapper that adds `numel * element_size` of each tensor.
# PowerSGD calls it from another thread too, hence the lock.

# %% [markdown]
# DDP without a hook all-reduces in C++, where the counter cannot see it. That is why the
# baseline is `allreduce_hook`, documented to behave like no hook. Apart from training, the
# worker also times one plain all-reduce of all the gradients, `4P` bytes. That shows what the
# communication of a step costs on this machine. The next two cells define the counter and the
# worker.

# %%
import statistics
import threading

import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.utils.data import DistributedSampler, TensorDataset

from helpers.data import load_mnist
from helpers.engine import worker_device
from helpers.mnist_train import distributed_accuracy


class AllReduceCounter:
    """While active, count bytes and calls handed to torch.distributed.all_reduce (thread-safe)."""

    def __enter__(self):
        self.bytes, self.calls, self._lock, self._original = 0, 0, threading.Lock(), dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            with self._lock:
                self.bytes += tensor.numel() * tensor.element_size()
                self.calls += 1
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def register_hook(ddp, spec):
    """Register spec's built-in hook (torch.distributed.algorithms.ddp_comm_hooks) on ddp."""
    if spec.name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=spec.rank, start_powerSGD_iter=spec.start_iter,
            min_compression_rate=spec.min_compression_rate, use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[spec.name]
        ddp.register_comm_hook(None, hook)

# %%
def train_with_hook(rank, world_size, config, spec, data, device):
    xtr, ytr, xte, yte = data
    ddp = torch.nn.parallel.DistributedDataParallel(
        build_model(config.model, config.seed).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    row = {"label": spec.label, "backend": dist.get_backend(), "error": None}
    try:
        register_hook(ddp, spec)
    except Exception as e:  # e.g. a hook this backend does not support
        return {**row, "error": f"{type(e).__name__}: {e}"}
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr)
    sampler = DistributedSampler(TensorDataset(xtr, ytr), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=config.seed)
    total = config.total_steps(xtr.shape[0], world_size)
    losses, sent, calls, step_ms = [], [], [], []
    with AllReduceCounter() as counter:
        for epoch in range(config.epochs):
            sampler.set_epoch(epoch)
            for batch in torch.tensor(list(sampler)).split(config.batch_per_rank(world_size)):
                if len(losses) == total:
                    break
                bytes0, calls0, t0 = counter.bytes, counter.calls, time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(xtr[batch.to(device)]), ytr[batch.to(device)])
                loss.backward()  # DDP calls the hook here, once per bucket
                optimizer.step()
                step_ms.append(1e3 * (time.perf_counter() - t0))
                sent.append(counter.bytes - bytes0)
                calls.append(counter.calls - calls0)
                losses.append(loss.detach())
    curve = torch.stack(losses).float()
    dist.all_reduce(curve)  # the global mean loss per step, the same on every rank
    return {**row, "losses": (curve / world_size).cpu().tolist(), "bytes_per_step": sent,
            "calls_per_step": calls, "median_step_ms": statistics.median(step_ms[1:] or step_ms),
            "test_accuracy": distributed_accuracy(ddp.module, xte, yte, rank, world_size, config.eval_batch_size)}


def hooks_worker(rank, world_size, config, specs, timing_calls=50):
    device = worker_device()
    data = [t.to(device) for t in (*load_mnist(train=True), *load_mnist(train=False))]
    rows = [train_with_hook(rank, world_size, config, spec, data, device) for spec in specs]
    grads = torch.zeros(sum(p.numel() for p in build_model(config.model).parameters()), device=device)
    times = []
    for i in range(5 + timing_calls):  # 5 warm-up calls, then the timed ones
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(grads)
        if i >= 5:
            times.append(1e3 * (time.perf_counter() - t0))
    return {"hooks": rows, "allreduce_ms": times, "allreduce_bytes": grads.numel() * grads.element_size()}


# %% [markdown]
# The next cell launches `world_size` processes once and trains `hooks_steps` steps with each
# hook in turn. At the default `hooks_steps`, start-up dominates. The same cell also runs notebook
# 04's `launch(ddp_train_worker, ...)` with the same parameters. The check after it compares
# every rank's count, in every step, with these formulas:
#
# | hook | bytes per rank per step |
# |---|---|
# | fp32, `allreduce_hook` | `4P` |
# | fp16, bf16 | `2P`, half of fp32 |
# | PowerSGD, the first `start_powerSGD_iter` steps | `4P` |
# | PowerSGD after that | `4 * (n + m) * r` per compressed matrix, plus `4 * numel` per uncompressed tensor |
#
# **Claims:** every count equals its formula. The fp32 hook reproduces the loss history of
# notebook 04's `launch` run. Every hook reaches `min_accuracy`. fp16 and bf16 stay within
# `max_16bit_drop` of fp32's test accuracy, and PowerSGD within `max_accuracy_drop`.

# %%
specs = [HookSpec("allreduce"), HookSpec("fp16"), HookSpec("bf16")] + [
    HookSpec("powersgd", rank=r, start_iter=powersgd_start_iter) for r in powersgd_ranks]
hooks_config = TrainConfig(global_batch_size=global_batch_size, lr=lr, max_steps=hooks_steps, seed=seed, progress=False)
t0 = time.perf_counter()
hooks_out = launch(hooks_worker, world_size, hooks_config, specs, backend=backend, timeout=job_timeout_s)
launched = launch(ddp_train_worker, world_size, hooks_config, backend=backend, timeout=job_timeout_s)  # notebook 04's run
launch_curve = torch.tensor(launched[0]["losses"])
per_rank = [out["hooks"] for out in hooks_out]
print(f"{len(specs)} hooks x {hook_steps} steps on {world_size} ranks ({per_rank[0][0]['backend']}): "
      f"{time.perf_counter() - t0:.1f} s including start-up")
results = {row["label"]: row for row in per_rank[0]}
unavailable = {label: row["error"] for label, row in results.items() if row["error"]}
for label, why in unavailable.items():
    print(f"NOT AVAILABLE on {backend}: {label}: {why}")
assert not unavailable, "on gloo and nccl every one of these hooks should run"
for rows_r in per_rank[1:]:  # the loss curves and accuracies are reduced: the same on every rank
    for a, b in zip(per_rank[0], rows_r):
        assert a["losses"] == b["losses"] and a["test_accuracy"] == b["test_accuracy"], a["label"]

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: bytes counted = formulas; fp32 = launch(); accuracy bounds
fp32 = results[specs[0].label]
for spec in specs:
    res = results[spec.label]
    for rank_rows in per_rank:  # every rank counted the formula, in every step
        counted = next(r for r in rank_rows if r["label"] == spec.label)["bytes_per_step"]
        assert counted == [expected_bytes_per_step(shapes, spec, s) for s in range(1, hook_steps + 1)], spec.label
assert fp32["bytes_per_step"] == [4 * P] * hook_steps
for name in ("fp16", "bf16"):
    half = results[HookSpec(name).label]["bytes_per_step"]
    assert all(2 * h == f for h, f in zip(half, fp32["bytes_per_step"])), f"{name} should count exactly half of fp32"
for spec in specs[3:]:
    after = results[spec.label]["bytes_per_step"][powersgd_start_iter:]
    if powersgd_compresses((10, 784), spec.rank):  # P (10 x r) and Q (784 x r) of the weight, the bias as is
        assert set(after) == {4 * ((10 + 784) * spec.rank + 10)}, (spec.label, set(after))
    else:  # compression would not save 2x: everything is all-reduced uncompressed
        assert set(after) == {4 * P}, (spec.label, set(after))
    assert results[spec.label]["bytes_per_step"][:powersgd_start_iter] == [4 * P] * powersgd_start_iter

# the fp32 hook is DDP's own all-reduce: the same curve as notebook 04's launch() run of the same steps
assert len(launch_curve) == len(fp32["losses"]) == hook_steps
assert_close(torch.tensor(fp32["losses"]), launch_curve)

table = pd.DataFrame([{
    "hook": label,
    "bytes / rank / step (after start)": res["bytes_per_step"][-1],
    "vs fp32": res["bytes_per_step"][-1] / fp32["bytes_per_step"][-1],
    "all_reduce calls / step": res["calls_per_step"][-1],
    "median step time (ms, this machine)": round(res["median_step_ms"], 2),
    "final loss": round(res["losses"][-1], 4),
    "max |loss - fp32 loss| (nats)": max(abs(a - b) for a, b in zip(res["losses"], fp32["losses"])),
    "test accuracy": res["test_accuracy"],
    "accuracy - fp32": round(res["test_accuracy"] - fp32["test_accuracy"], 4),
} for label, res in results.items()]).set_index("hook")
assert (table["test accuracy"] >= min_accuracy).all(), table["test accuracy"]
drop = fp32["test_accuracy"] - table["test accuracy"]  # what compression cost, per hook
sixteen_bit = [HookSpec(name).label for name in ("fp16", "bf16")]
assert (drop[sixteen_bit] <= max_16bit_drop).all(), (
    f"fp16 / bf16 lost more than max_16bit_drop = {max_16bit_drop} test accuracy against fp32:\n{drop[sixteen_bit]}")
assert (drop <= max_accuracy_drop).all(), (
    f"a hook lost more than max_accuracy_drop = {max_accuracy_drop} test accuracy against fp32:\n{drop}")
# The bound's basis: PowerSGD's error feedback returns what compression left out, so its loss
# curve rejoins fp32's. After 100 steps rank 1 still lags by tens of test images (0.01 allows
# 100). After one epoch it lags by about 1, so the full profile allows 20 (0.002), not 100.
# Each run prints its drop in images.
print("PowerSGD's drop against fp32, in test images of 10,000:",
      {spec.label: round(drop[spec.label] * 10_000) for spec in specs[3:]}, f"(bound {max_accuracy_drop * 10_000:.0f})")
table

# %%
labels = list(results)
colors = [f"C{i}" for i in range(len(labels))]
fig, (ax_b, ax_acc, ax_t) = plt.subplots(1, 3, figsize=(16, 4.5), layout="constrained")
bars = ax_b.bar(range(len(labels)), table["bytes / rank / step (after start)"], color=colors)
ax_b.bar_label(bars, fmt="%d")
ax_b.set_ylim(0, 1.15 * table["bytes / rank / step (after start)"].max())  # linear, from 0: heights compare
ax_b.set_ylabel("bytes handed to all_reduce per rank per step")
ax_b.set_title("Gradient bytes per step (counted = formula)")
ax_acc.scatter(range(len(labels)), table["test accuracy"], c=colors, s=60, zorder=3)  # points: the axis is not at 0
for i, a in enumerate(table["test accuracy"]):
    ax_acc.annotate(f"{a:.4f}", (i, a), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=8)
ax_acc.axhline(min_accuracy, color="k", ls="--", lw=0.8, label=f"min_accuracy = {min_accuracy}")
ax_acc.set_ylim(min(0.75, min_accuracy - 0.05), 1.0)
ax_acc.set_ylabel("test accuracy (fraction of 10,000 images)")
ax_acc.set_title(f"Test accuracy after {hook_steps} steps (points)")
ax_acc.legend(loc="lower right")
bars = ax_t.bar(range(len(labels)), table["median step time (ms, this machine)"], color=colors)
ax_t.bar_label(bars, fmt="%.1f")
ax_t.set_ylabel("median time per training step (ms)")
ax_t.set_title(f"Step time on this machine ({per_rank[0][0]['backend']}; not a law)")
for ax in (ax_b, ax_acc, ax_t):
    ax.set_xticks(range(len(labels)), [hook.replace(" (no compression)", "").replace(" compression", "") for hook in labels],
                  rotation=20)
    ax.set_xlabel("communication hook")
plt.show()

fig, (ax, ax_gap) = plt.subplots(1, 2, figsize=(14, 4.2), layout="constrained")
fp32_curve = torch.tensor(fp32["losses"])
for (label, res), c in zip(results.items(), colors):
    curve = torch.tensor(res["losses"])
    ax.plot(range(1, len(curve) + 1), curve, color=c, lw=1, label=label)
    if res is not fp32:
        ax_gap.plot(range(1, len(curve) + 1), (curve - fp32_curve).abs(), color=c, lw=0.8, label=label)
for a in (ax, ax_gap):
    a.axvline(powersgd_start_iter + 0.5, color="k", ls=":", lw=0.8, label="PowerSGD starts compressing")
    a.set_xlabel("optimizer step")
ax.set_ylabel("training loss (mean cross-entropy, nats)")
ax.set_title("Loss per step with each communication hook")
ax_gap.set_yscale("log")
ax_gap.set_ylabel("|loss - fp32 loss| (nats, log scale)")
ax_gap.set_title("Distance from the uncompressed run")
fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=len(results) + 1, fontsize=8)  # off the data
plt.show()

# %% [markdown]
# **Reading the numbers.** The byte ratios are exact: the check above asserts them. What
# compression cost in loss and accuracy is this run's measurement, printed next. Whether fewer
# bytes make a step faster depends on two costs. One is the communication of a step. The other
# is the hook's extra work: casting, and for PowerSGD two matrix products, an orthogonalisation
# and more all-reduce calls. The worker timed one plain all-reduce of all `4P` gradient bytes on
# this machine. The next cell prints it next to the median step. Compression pays off when the
# network is the bottleneck: large models, many nodes, slow links.

# %%
ar_ms = torch.tensor(hooks_out[0]["allreduce_ms"])
print(f"one all-reduce of {hooks_out[0]['allreduce_bytes']:,} bytes on {world_size} ranks ({backend}), "
      f"{len(ar_ms)} calls on rank 0: median {ar_ms.median():.3f} ms (min {ar_ms.min():.3f}, max {ar_ms.max():.3f}); "
      f"median fp32 training step {fp32['median_step_ms']:.2f} ms")
for label, row in table.iterrows():
    if label != specs[0].label:
        print(f"{label}: {row['vs fp32']:.3f} of fp32's bytes; test accuracy {row['accuracy - fp32']:+.4f} against fp32; "
              f"largest loss gap {row['max |loss - fp32 loss| (nats)']:.2e} nats; median step "
              f"{row['median step time (ms, this machine)']:.2f} ms vs {fp32['median_step_ms']:.2f} ms")

# %% [markdown]
# **Which hook runs on which backend.** Every hook above ran on this run's backend: gloo on a
# CPU machine, nccl with one GPU per rank. The launch cell stops if one cannot run. The
# [docs](https://pytorch.org/docs/stable/ddp_comm_hooks.html) say the rest. `bf16_compress_hook` needs NCCL later than 2.9.6 and a GPU with
# bfloat16. `fp16_compress_hook` and PowerSGD work with any backend that all-reduces float16 and
# float32. DDP without a hook runs its all-reduce in C++. That is why we register
# `allreduce_hook` for the baseline: only Python-level calls can be counted.
#
# | hook | gloo (CPU): measured where this lesson was tested | nccl (GPU): from the docs, not run here |
# |---|---|---|
# | `allreduce_hook` | runs | runs |
# | `fp16_compress_hook` | runs | runs |
# | `bf16_compress_hook` | runs | needs NCCL > 2.9.6 and a GPU with bfloat16 |
# | `powerSGD_hook` rank 1, 4 | runs | runs (the docs suggest `start_powerSGD_iter` of about 10% of the steps) |

# %% [markdown]
# ## 2. The GPU path
#
# What changes with GPUs is chosen in code, not by editing the notebooks. `backend="auto"` picks
# nccl when there is one GPU per rank. Workers use `cuda:<LOCAL_RANK>`, and torchrun's entry
# point does the same on every node. [docs/CLUSTER.md](../docs/CLUSTER.md) says how to run the
# lessons on a GPU machine. The next cell prints whether this run had a GPU. Its table says what
# each part of lessons 07a and 07b becomes with GPUs.

# %%
gpu_plan = pd.DataFrame([
    {"part": "07a §1. torchrun vs launch", "here": f"{backend}, {world_size} CPU processes",
     "1 GPU (-p world_size 1)": "nccl, 1 rank on cuda:0", "N >= 2 GPUs": "nccl, one rank per GPU"},
    {"part": "07a §2-4. two nodes, failures", "here": "gloo on loopback / namespaces",
     "1 GPU (-p world_size 1)": "gloo (two 'nodes' cannot share one GPU under nccl)",
     "N >= 2 GPUs": "gloo here; on a real cluster nccl between machines"},
    {"part": "07b §1. hooks", "here": f"{per_rank[0][0]['backend']}",
     "1 GPU (-p world_size 1)": "nccl, 1 rank (bytes counted, nothing crosses a wire)",
     "N >= 2 GPUs": "nccl over NVLink / PCIe"},
]).set_index("part")
print(f"GPUs visible to this kernel: {n_gpus}. "
      + ("GPU rows NOT RUN here: no GPU." if n_gpus == 0 else f"this run used backend {backend!r}."))
gpu_plan


# %% [markdown]
# ## 3. What comes after DDP: when the model no longer fits one device
#
# DDP keeps a **full replica** on every device: parameters, gradients and optimizer state. The
# ZeRO paper counts these bytes for mixed-precision training with Adam and `Psi` parameters. It
# is Rajbhandari, Rasley, Ruwase and He, *ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models*, SC 2020. fp16 parameters and gradients take 2 bytes each. The optimizer
# state takes `K = 12` bytes: fp32 master parameters, momentum and variance. That makes
# **16 `Psi` bytes per device**, before activations.

# %% [markdown]
# Sharding across the `N_d` data-parallel ranks removes the redundancy stage by stage. ZeRO-1
# shards the optimizer states, ZeRO-2 the gradients too, and ZeRO-3 the parameters themselves.
# ZeRO-3 all-gathers the parameters just in time for each layer's forward and backward. PyTorch's
# implementation is **FSDP**: Zhao et al., *PyTorch FSDP: Experiences on Scaling Fully Sharded
# Data Parallel*, VLDB 2023. `FULL_SHARD` is ZeRO-3 and `SHARD_GRAD_OP` is ZeRO-2. The current
# API is `torch.distributed.fsdp.fully_shard`.
#
# **Claim:** take the paper's example, `Psi = 7.5` billion parameters on `N_d = 64` ranks. The
# per-device model-state memory is 120 GB with DDP, 31.4 GB with ZeRO-1, 16.6 GB with ZeRO-2 and
# 1.9 GB with ZeRO-3. These are the numbers of the paper's Figure 1, with GB = 10^9 bytes.

# %%
def model_state_bytes(psi, n_d, k=12):
    # bytes per device: (fp16 params, fp16 grads, optimizer states) for DDP and ZeRO stages 1-3
    return {"DDP (full replica)": 2 * psi + 2 * psi + k * psi,
            "ZeRO-1: shard optimizer states": 2 * psi + 2 * psi + k * psi / n_d,
            "ZeRO-2: + shard gradients": 2 * psi + (2 + k) * psi / n_d,
            "ZeRO-3 / FSDP FULL_SHARD: + shard parameters": (2 + 2 + k) * psi / n_d}

psi, n_d = 7.5e9, 64
paper = model_state_bytes(psi, n_d)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the ZeRO paper's per-device memory
assert [round(b / 1e9, 1) for b in paper.values()] == [120.0, 31.4, 16.6, 1.9], paper
mnist = model_state_bytes(P, world_size)
memory = pd.DataFrame({"7.5B parameters, 64 ranks (GB per device)": {k: round(v / 1e9, 2) for k, v in paper.items()},
                       f"our Linear(784, 10), {world_size} ranks (KB per device)": {k: round(v / 1e3, 1) for k, v in mnist.items()}})
print("Activations, temporary buffers and fragmentation come on top. ZeRO-3 all-gathers the parameters in "
      "forward and backward: about 1.5x DDP's communication volume (the paper's analysis).")
memory

# %% [markdown]
# ## What we saw
#
# * A communication hook replaces DDP's averaging entirely. A hook that forgets to divide sums
#   the gradients. One that does not communicate lets the replicas diverge silently. One that
#   sums before it divides overflows near the top of the number range. The 16-bit hooks round,
#   and fp16 can overflow to `inf`. Only one hook can be registered.
# * The built-in hooks cut the bytes per step exactly as their formulas say. fp16 and bf16 send
#   half; PowerSGD rank 1 sends about 1/10 for this model. Section 1 printed what that cost in
#   loss and accuracy in this run, and what one all-reduce and one step took on this machine.
# * The GPU path is chosen in code: `backend="auto"` and `cuda:<LOCAL_RANK>`.
# * Beyond DDP, sharding with ZeRO or FSDP divides the 16 bytes per parameter of model state
#   across the ranks. It is the next step when the model no longer fits one device.
#
# ## Going further
#
# * After exercise 1, set `powersgd_ranks = [1, 2, 4]` in the parameters cell and run the lesson
#   again. The exercise's check cell then also compares its expected value with the bytes
#   counted in the real run.

# %% [markdown]
# ## Exercises
#
# Predict each answer by hand first. Write it into `answer_N`, replacing `None`, and run the
# check cell below it. The check prints "correct" or "not yet" with a hint. In the full lesson, a
# collapsed solution follows each check: click the "…" or the bar on its left to open it. Student
# copies leave the solutions out. Every solution runs when the full lesson runs, so each is known
# to pass its check. Exercises 1 and 2 start no process. Exercise 3 asks for a communication hook
# and runs it on 2 real ranks.

# %% [markdown]
# ### Exercise 1: bytes per step with fp16 and PowerSGD rank 2
#
# Our model is `Linear(784, 10)`: a `10 x 784` weight and a bias of 10. How many bytes does each
# rank hand to `all_reduce` per training step with `fp16_compress_hook`? And how many with
# `powerSGD_hook` at `matrix_approximation_rank = 2`, once it has started compressing? Use
# section 1's rules: a matrix is compressed only if that saves at least 2 times, and biases never
# are. Answer with a list of two ints, `[fp16 bytes, PowerSGD rank-2 bytes]`.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, against the bytes counted in the real run
# expected: the helper's byte formula, which section 1 checked against the bytes counted in every
# step of the real run (and against the run itself when it measured rank 2)
fp16_bytes = expected_bytes_per_step(shapes, HookSpec("fp16"), hook_steps)
rank2 = HookSpec("powersgd", rank=2, start_iter=powersgd_start_iter)
expected_1 = [fp16_bytes, expected_bytes_per_step(shapes, rank2, powersgd_start_iter + 1)]
assert fp16_bytes == results[HookSpec("fp16").label]["bytes_per_step"][-1]
if rank2.label in results:  # this run measured PowerSGD rank 2 (-p "powersgd_ranks=[1, 2, 4]")
    assert expected_1[1] == results[rank2.label]["bytes_per_step"][-1]
check_answer("ex1", answer_1, expected_1,
             hint="fp16: 2 bytes per gradient element; PowerSGD: P (10 x r) and Q (784 x r) in float32, plus the bias")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# fp16: 784 * 10 + 10 = 7,850 gradient elements of 2 bytes.
# PowerSGD rank 2: the weight is compressed, since (10 + 784) * 2 = 1,588 numbers is less than
# half of 7,840; it sends P (10 x 2) and Q (784 x 2) and the 10 bias values, all float32.
n, m, r = 10, 784, 2
assert (n + m) * r * 2 < n * m
solution_1 = [2 * (n * m + n), 4 * ((n + m) * r + n)]  # [15700, 6392]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: ZeRO for a 70-billion-parameter model
#
# Redo section 3's arithmetic for a model of `Psi = 70` billion parameters on GPUs of 80 GB. Keep
# mixed precision with Adam, `K = 12`, and GB = 10^9 bytes. What is the smallest number of GPUs
# `N_d` with which ZeRO-3 holds its model state, before activations? Answer with a whole number.
# Then explain why ZeRO-1 and ZeRO-2 never fit, however many GPUs.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, with section 3's model_state_bytes
# expected: section 3's own model_state_bytes, searched for the smallest N_d that fits
stages = list(model_state_bytes(70e9, 1))  # DDP, ZeRO-1, ZeRO-2, ZeRO-3 (in this order)
expected_2 = next(n_d for n_d in range(1, 100_000) if model_state_bytes(70e9, n_d)[stages[3]] <= 80e9)
huge = model_state_bytes(70e9, 10**9)  # as many GPUs as you like
assert huge[stages[1]] > 80e9 and huge[stages[2]] > 80e9, "ZeRO-1 and ZeRO-2 never fit"
check_answer("ex2", answer_2, expected_2, hint="ZeRO-3 divides all 16 bytes per parameter by N_d")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# ZeRO-3 shards all 2 + 2 + 12 = 16 bytes per parameter: 16 * 70e9 = 1,120 GB over N_d GPUs,
# so N_d >= 1,120 / 80 = 14. ZeRO-1 keeps the fp16 parameters and gradients whole on every GPU
# (4 * Psi = 280 GB) and ZeRO-2 the fp16 parameters (2 * Psi = 140 GB): both above 80 GB for any N_d.
psi = 70e9
print(f"floors: ZeRO-1 {4 * psi / 1e9:.0f} GB, ZeRO-2 {2 * psi / 1e9:.0f} GB per GPU, whatever N_d")
solution_2 = math.ceil(16 * psi / 80e9)
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: an fp16 hook that does not overflow
#
# Section 1 showed `fp16_compress_hook` turning local gradients 70000 and 0 into `inf`. It casts
# each rank's gradients to float16 *before* dividing by the world size, and float16's largest
# value is 65504. Write a hook `fp16_prescaled_hook(state, bucket)` that divides by the world
# size **first**, in float32. It then casts to float16, all-reduces the float16 tensor, and
# writes the result back into the float32 `bucket.buffer()`. The future must hold that buffer.
# Set `answer_3 = fp16_prescaled_hook`. The check cell registers it on 2 real ranks with section
# 1's `gradient_through_hook`. It starts 2 processes and tries local gradients 70000 and 0, then
# 1 and 3.

# %% tags=["exercise"]
answer_3 = None  # your hook here (define it in this cell, then answer_3 = fp16_prescaled_hook)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 3: your hook on 2 real ranks
# expected: the roundings done by hand in this kernel: halve in float32, cast each rank's half to float16, sum
def prescaled(grads):
    halves = [torch.tensor(g / 2, dtype=torch.float32).to(torch.float16) for g in grads]
    return float((halves[0] + halves[1]).float())


def through_hook(rank, world_size, hook):  # section 1's worker, for local gradients (70000, 0) then (1, 3)
    return [gradient_through_hook(rank, world_size, hook, grads)["grad"] for grads in ([70000.0, 0.0], [1.0, 3.0])]


expected_3 = [[prescaled([70000.0, 0.0]), prescaled([1.0, 3.0])]] * 2  # rank 0's and rank 1's gradients
# your hook, registered on 2 real ranks: their gradients are your answer
check_answer("ex3", answer_3, expected_3, run=lambda hook: launch(through_hook, 2, hook, backend="gloo", timeout=job_timeout_s),
             hint="buf = bucket.buffer(); half = buf.div(world_size).half(); all-reduce half; then buf.copy_(result)")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# Divide while still in float32: 70000 / 2 = 35000 fits float16 (it rounds to 35008, a multiple of 32).
def fp16_prescaled_hook(state, bucket):
    buf = bucket.buffer()
    half = buf.div(dist.get_world_size()).to(torch.float16)
    return dist.all_reduce(half, async_op=True).get_future().then(lambda fut: buf.copy_(fut.value()[0]))


solution_3 = launch(through_hook, 2, fp16_prescaled_hook, backend="gloo", timeout=job_timeout_s)
assert solution_3[0][0] == 35008.0 and solution_3[1] == solution_3[0], solution_3
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [08a ZeRO-1 and FSDP2](08a_zero_and_fsdp2.ipynb): shard optimizer state (ZeRO-1) and the model (FSDP2); save a plain checkpoint.
# <!-- next:end -->
