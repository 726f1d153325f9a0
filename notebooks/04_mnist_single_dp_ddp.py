# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · MNIST: one process, DataParallel and DistributedDataParallel
#
# **The question:** trained with the same recipe (same initial weights, same data order, same
# global batch of 64, same learning rate), do `nn.DataParallel` (DP) and
# `DistributedDataParallel` (DDP) learn the same model as a single process, and what does each
# cost in speed and memory?
#
# The recipe is the seed's: `Linear(784, 10)` on the 60,000 MNIST training images, plain SGD
# with `lr = 0.01`, mean cross-entropy, batch 64, evaluated on the 10,000 test images. All the
# code lives in `helpers/mnist_train.py` (`TrainConfig`, `train_single`, `train_dp`,
# `ddp_train_worker`); this notebook calls it and checks every claim in the cell after it.
#
# **What runs where**
#
# | mode | CPU only (CI) | with GPUs |
# |---|---|---|
# | single process | the notebook kernel, CPU | the kernel, `cuda:0` |
# | DP, `train_dp` | the kernel; `device_ids == []`, so DP **just calls the module**: same run as single, no parallelism (checked below) | the kernel, one thread per visible GPU: scatter, replicate, gather |
# | DDP, `launch(ddp_train_worker, world_size, config)` | `world_size` processes, backend `gloo`, one CPU thread each | backend `nccl`, one GPU per rank, when there are at least `world_size` GPUs; else `gloo` on CPU |
#
# **New here** (after notebook 01's gradients on a toy): a real dataset and training loop, a
# [`DistributedSampler`](../docs/GLOSSARY.md#distributedsampler) that hands each
# [rank](../docs/GLOSSARY.md#rank) its share of every
# [global batch](../docs/GLOSSARY.md#global-batch-size), metrics reduced across ranks with an
# [all-reduce](../docs/GLOSSARY.md#all-reduce), and measured throughput and memory. Every term
# is defined (with its Chinese name) in the [glossary](../docs/GLOSSARY.md). Run time on 2 CPU
# cores: about 13–45 s with either profile (measured; the smoke defaults stop after 200 steps,
# the full profile trains one whole epoch per mode, only a few seconds more for this small
# model; most of the time goes to starting processes and loading data, and it varies with
# what else the machine runs). The notebook ends with three exercises, each checked by a cell.

# %% tags=["parameters"]
# Parameters (papermill overrides them; these defaults are smoke-sized and also what a learner runs)
world_size = 2  # DDP processes (ranks); must divide global_batch_size
epochs = 1  # passes over the 60,000 training images
max_steps = 200  # optimizer steps per mode; 0 means all epochs in full (938 steps per epoch at batch 64)
equivalence_steps = 20  # steps over which DDP must follow the single-process loss curve (and weights); 0 means all
min_accuracy = 0.85  # test accuracy every mode must reach (200 steps: ~0.88; full 1-epoch profile: 0.90)
model = "linear"  # "linear": the seed's Linear(784, 10); "cnn": a small two-layer CNN
global_batch_size = 64  # samples per optimizer step, all ranks together
lr = 0.01  # SGD learning rate
seed = 0  # seeds the initial weights and the data order

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int), epochs=(epochs, int), max_steps=(max_steps, int),
                 equivalence_steps=(equivalence_steps, int), min_accuracy=(min_accuracy, float),
                 model=(model, str), global_batch_size=(global_batch_size, int), lr=(lr, float),
                 seed=(seed, int))
check_value("world_size", world_size, world_size >= 1, "at least 1")
check_value("epochs", epochs, epochs >= 1, "at least 1")
check_value("max_steps", max_steps, max_steps >= 0, "0 (all epochs in full) or a positive number of steps")
check_value("equivalence_steps", equivalence_steps, equivalence_steps >= 0, "0 (every step) or a positive number of steps")
check_value("min_accuracy", min_accuracy, 0 <= min_accuracy <= 1, "a fraction between 0 and 1")
check_value("model", model, model in ("linear", "cnn"), '"linear" or "cnn"')
check_value("lr", lr, lr > 0, "greater than 0")
check_value("global_batch_size", global_batch_size, global_batch_size >= 1 and global_batch_size % world_size == 0,
            f"a positive multiple of world_size = {world_size}: every rank takes the same share of a global batch")

# %%
import math
import time
from dataclasses import replace

import matplotlib.pyplot as plt
import pandas as pd
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DistributedSampler, TensorDataset

from helpers.data import MNIST_MEAN, MNIST_STD, load_mnist
from helpers.launch import launch, resolve_backend
from helpers.mnist_train import (
    TrainConfig,
    build_model,
    ddp_train_worker,
    epoch_permutation,
    summarize_ddp,
    train_dp,
    train_single,
)

n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
backend = resolve_backend(None, world_size)
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; kernel threads: {torch.get_num_threads()}")
print(f"DDP: world_size = {world_size}, backend = {backend!r}; model = {model!r}")
print("DP branch that will run:",
      f"REAL nn.DataParallel over {n_gpus} GPU(s)" if n_gpus >= 1
      else "no GPU: nn.DataParallel has device_ids == [] and simply calls the module (no parallelism)")

train_images, train_labels = load_mnist(train=True)  # the fast path: whole split as tensors
test_images, test_labels = load_mnist(train=False)
print(f"train: images {tuple(train_images.shape)} {train_images.dtype}, labels {tuple(train_labels.shape)} {train_labels.dtype}")
print(f"test:  images {tuple(test_images.shape)} {test_images.dtype}; normalised with mean {MNIST_MEAN}, std {MNIST_STD}: "
      f"train pixels now have mean {train_images.mean():.4f}, std {train_images.std():.4f}")
assert train_images.shape == (60_000, 1, 28, 28) and test_images.shape == (10_000, 1, 28, 28)
assert train_labels.dtype == torch.int64 and set(train_labels.unique().tolist()) == set(range(10))
assert abs(train_images.mean()) < 1e-3 and abs(train_images.std() - 1) < 1e-3

# %% [markdown]
# ## 1. One configuration, global batch fixed
#
# `TrainConfig` holds the recipe; every mode gets the same object. The **global batch** (samples
# per optimizer step, all ranks together) is what we fix; DDP derives
# `batch_per_rank = global_batch_size // world_size`. A global batch that does not split evenly
# is refused with a message, because ranks with different batch sizes would weight their mean
# losses unequally and DDP would no longer follow the single process.
#
# **Claim:** with `world_size` ranks each rank processes `global_batch_size / world_size`
# images per step, the number of optimizer steps is the same in every mode, and a
# non-divisible split raises `ValueError` naming both numbers.

# %%
config = TrainConfig(
    global_batch_size=global_batch_size, lr=lr, epochs=epochs, max_steps=max_steps,
    model=model, seed=seed,
)
batch_per_rank = config.batch_per_rank(world_size)
steps = config.total_steps(len(train_labels), world_size)
assert steps == config.total_steps(len(train_labels), 1), "single process and DDP should take the same number of steps"
n_check = equivalence_steps or steps  # 0 means: every step of the run
assert 1 <= n_check <= steps, f"equivalence_steps={equivalence_steps} must be 0 (all) or in [1, steps={steps}]"
config = replace(config, snapshot_step=n_check)  # the histories will hold the weights after n_check steps
print(config)
print(f"global batch {global_batch_size} = {world_size} ranks x {batch_per_rank} images; "
      f"{steps} optimizer steps per mode")

try:
    TrainConfig(global_batch_size=64).batch_per_rank(3)
except ValueError as e:
    print("refused, as it should be:", e)
else:
    raise AssertionError("a global batch of 64 over 3 ranks should be refused")

# %% [markdown]
# ## 2. The data order: every rank gets its slice of the same global batch
#
# Single process and DP cut `epoch_permutation(60000, seed, epoch)` into global batches of 64.
# DDP uses `DistributedSampler(shuffle=True, seed=seed)` over a `TensorDataset`, with
# `sampler.set_epoch(epoch)`: it draws the **same** permutation (a generator seeded with
# `seed + epoch`) and hands rank `r` every `world_size`-th index, starting at `r`. Cut into
# batches of `batch_per_rank`, rank `r`'s batch at step `s` is the strided slice
# `global_batch_s[r::world_size]`.
#
# **Claim:** for every full global batch of the epoch, the ranks' batches are exactly the
# strided slices of the single-process batch, so together they are that batch, each image
# once.

# %%
dataset = TensorDataset(train_images, train_labels)
perm = epoch_permutation(len(dataset), seed, epoch=0)
rank_indices = []
for r in range(world_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True, seed=seed)
    sampler.set_epoch(0)
    rank_indices.append(torch.tensor(list(sampler)))
full_steps = len(dataset) // global_batch_size
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

# train_single / train_dp / the workers load their own copies of the data; dropping the
# notebook's copies keeps the kernel's peak memory (measured below) comparable to a worker's.
del dataset, train_images, train_labels, test_images, test_labels

# %% [markdown]
# ## 3. Single process: the reference
#
# `train_single(config)` trains in the kernel on one device, with a `tqdm` progress bar, and
# returns a history: the loss of every step (mean cross-entropy over the global batch, in
# nats), test accuracy, samples per second of the training loop, and the process's peak
# resident memory. The next cell takes about 1–10 s on a 2-core laptop, with either profile.
#
# **Claim:** the loss falls, and the model reaches `min_accuracy` on the 10,000 test images.

# %%
single = train_single(config)
first, last = single["losses"][:20], single["losses"][-20:]
print(f"single process: {single['steps']} steps on {single['device']}, loss {sum(first) / len(first):.3f} "
      f"-> {sum(last) / len(last):.3f} (means of the first and last 20 steps); test accuracy "
      f"{single['test_accuracy']:.4f}; {single['samples_per_s']:,.0f} samples/s")
assert sum(last) / len(last) < 0.5 * sum(first) / len(first), "the loss should at least halve"
assert single["test_accuracy"] >= min_accuracy, f"accuracy {single['test_accuracy']:.4f} < {min_accuracy}"

# %% [markdown]
# ## 4. DataParallel
#
# `nn.DataParallel(model)` stays in **one process**. With GPUs, every forward scatters the batch
# over `device_ids`, copies (replicates) the module onto each GPU, runs the copies in threads,
# gathers the outputs on GPU 0, where the loss is computed over the whole batch, and backward
# sums the copies' gradients into the original module.
#
# **Claim (CPU only):** without GPUs, `device_ids == []` and `DataParallel.forward` simply calls
# the module once on the whole batch (`torch/nn/parallel/data_parallel.py`:
# `if not self.device_ids: return self.module(*inputs, **kwargs)`). So `train_dp` runs, and
# its run is the single-process run **bit for bit** (same losses, same accuracy), with no
# parallelism at all.
#
# **Claim (with GPUs):** DP's loss on the gathered batch is the whole-batch mean, so it
# follows the single-process curve up to float rounding.
#
# The next cell trains once more: about 0.2–6 s on a 2-core laptop, with either profile.

# %%
probe = nn.DataParallel(build_model(model, seed).to("cuda:0" if n_gpus else "cpu"))
calls = []  # batch size of every call of the wrapped module
hook = probe.module.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
x = torch.zeros(global_batch_size, 1, 28, 28, device="cuda:0" if n_gpus else "cpu")
probe(x)
hook.remove()
print(f"nn.DataParallel here: device_ids = {probe.device_ids}; one forward of {global_batch_size} images "
      f"called the module {len(calls)} time(s) with batch size(s) {calls}")

dp = train_dp(config)
print(f"DP: test accuracy {dp['test_accuracy']:.4f}; {dp['samples_per_s']:,.0f} samples/s")
if n_gpus == 0:
    assert probe.device_ids == [] and dp["dp_device_ids"] == [], "CPU-only: DP should have no devices"
    assert calls == [global_batch_size], f"expected one call on the whole batch, got {calls}"
    assert dp["losses"] == single["losses"], "DP on CPU should repeat the single-process run exactly"
    assert dp["test_accuracy"] == single["test_accuracy"]
    print("CPU: DP ran, and equals the single process bit for bit; it cannot run anything in parallel. "
          "SKIPPED real multi-GPU DP (scatter / replicate / gather): no GPU here.")
else:
    assert probe.device_ids == list(range(n_gpus)), probe.device_ids
    assert len(calls) == min(n_gpus, global_batch_size), f"one call per replica expected, got {calls}"
    assert_close(torch.tensor(dp["losses"][:n_check]), torch.tensor(single["losses"][:n_check]), rtol=1e-4, atol=1e-5)
    print(f"RAN real nn.DataParallel over {n_gpus} GPU(s): per-GPU peak memory (MiB) "
          f"{[round(m) for m in dp['peak_cuda_mib']]} (GPU 0 holds the gathered outputs and the master weights)")
assert dp["test_accuracy"] >= min_accuracy, f"DP accuracy {dp['test_accuracy']:.4f} < {min_accuracy}"

# %% [markdown]
# ## 5. DistributedDataParallel
#
# `launch(ddp_train_worker, world_size, config)` starts `world_size` processes with the
# default process group initialised. Each rank loads the data, builds the model from the same
# seed (DDP also broadcasts rank 0's weights at construction), wraps it in DDP and trains on
# its `batch_per_rank` images per step. In `loss.backward()`, DDP all-reduces the gradients
# and divides by `world_size`, so every rank applies the same averaged gradient.
#
# Metrics are reduced, not read off one rank: the per-step loss of each rank is all-reduced
# once after training (one collective, not one per step) into the global loss, and test
# accuracy comes from `distributed_accuracy(ddp.module, ...)`: rank `r` scores its own
# unpadded shard (items `r, r + world_size, ...`: `helpers.sampler.distributed_eval_counts`
# from notebook 03) through the plain module (not the DDP wrapper), and the correct/total
# counts are all-reduced. Worker output appears prefixed `[rank r]`; only rank 0
# shows a progress bar. The next cell takes about 5–20 s on a 2-core laptop, with either
# profile; starting the processes and loading the data take most of it.
#
# **Claim:** every rank reports the same global loss curve and the same test accuracy, which
# reaches `min_accuracy`; the ranks' own losses differ, since they saw different images.

# %%
t0 = time.perf_counter()
ddp_ranks = launch(ddp_train_worker, world_size, config, timeout=1800.0)
launch_s = time.perf_counter() - t0
ddp = summarize_ddp(ddp_ranks)  # asserts that all ranks agree on the loss curve and accuracy
assert [h["rank"] for h in ddp_ranks] == list(range(world_size))
if world_size > 1:
    assert ddp_ranks[0]["local_losses"] != ddp_ranks[1]["local_losses"], "ranks should see different images"
assert ddp["test_accuracy"] >= min_accuracy, f"DDP accuracy {ddp['test_accuracy']:.4f} < {min_accuracy}"
print(f"DDP ({world_size} ranks, {ddp['backend']}): launch took {launch_s:.1f} s in all "
      f"(process start-up, data loading, training {ddp['seconds']:.1f} s, evaluation); "
      f"test accuracy {ddp['test_accuracy']:.4f}; {ddp['samples_per_s']:,.0f} samples/s")
pd.DataFrame([{k: h[k] for k in ("rank", "device", "num_threads", "batch_per_rank", "steps", "seconds",
                                 "samples_per_s", "test_accuracy", "peak_rss_mib")}
              for h in ddp_ranks]).set_index("rank").round(3)

# %% [markdown]
# ## 6. DDP follows the single process, step by step
#
# Same initial weights, same global batches (section 2), a **mean** loss on each rank and
# DDP's **average** of the gradients: the average of the ranks' mean-loss gradients over equal
# shards is the gradient of the mean loss over the whole global batch. So DDP takes the same
# SGD steps as the single process.
#
# **Claim:** for the first `equivalence_steps` steps (0: all of them), the global DDP loss
# (the mean of the ranks' losses) equals the single-process loss, and after that many steps
# the weights are equal, within float32 rounding: `assert_close(..., rtol=1e-4, atol=1e-5)`.
#
# Why not exactly equal? The two runs add the same numbers in a different order (a 64-image
# batch versus two 32-image halves averaged by all-reduce, 2 kernel threads versus 1 per
# rank), and float32 addition is not associative. Each step's difference is of the order of
# float32's resolution (about 1e-7 relative). For the linear model (a convex problem) SGD does
# not amplify it: over a whole epoch the gap stays near 1e-7 nats, about 40 times below the
# tolerance. With `model = "cnn"` it grows slowly (a ReLU or max-pool decision can flip), to
# about 1e-4 after an epoch, so keep `equivalence_steps` small there. A real bug (a summed
# loss, a wrong shard, a missing `set_epoch`, unsynchronised initial weights) moves the loss
# by 1e-2 or more within the first steps.

# %%
n = n_check
ddp_curve, single_curve = torch.tensor(ddp["losses"]), torch.tensor(single["losses"])
assert_close(ddp_curve[:n], single_curve[:n], rtol=1e-4, atol=1e-5,
             msg=lambda m: f"DDP loss curve left the single-process curve in the first {n} steps:\n{m}")
for name, w in single["snapshot"].items():
    assert_close(ddp["snapshot"][name], w, rtol=1e-4, atol=1e-5,
                 msg=lambda m: f"{name} after {n} steps differs between DDP and single process:\n{m}")
gap = (ddp_curve - single_curve).abs()
w_gap = max((ddp["snapshot"][k] - w).abs().max().item() for k, w in single["snapshot"].items())
print(f"first {n} steps: max |DDP loss - single loss| = {gap[:n].max():.2e} nats; "
      f"max |weight difference| after step {n} = {w_gap:.2e}")
if n < len(gap):
    print(f"all {len(gap)} steps: max |DDP loss - single loss| = {gap.max():.2e} nats (not asserted)")

# %% [markdown]
# ## 7. Pictures
#
# Left: the loss of every step in each mode, on top of each other (they coincide). Right: how
# far DP and DDP are from the single process at each step, on a symmetric-log scale (zero
# is drawn at the bottom).

# %%
modes = {"single process": single, "DP" + (" (CPU: = single)" if n_gpus == 0 else f" ({n_gpus} GPUs)"): dp,
         f"DDP ({world_size} ranks)": ddp}
fig, (ax, ax_gap) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
for (label, h), style in zip(modes.items(), [dict(lw=2.5, alpha=0.5), dict(ls="--", lw=1.2), dict(ls=":", lw=1.2)]):
    ax.plot(range(1, len(h["losses"]) + 1), h["losses"], label=label, **style)
ax.set_xlabel("optimizer step")
ax.set_ylabel("training loss (mean cross-entropy, nats)")
ax.set_title(f"Loss per step, global batch {global_batch_size}, lr {lr}")
ax.legend()
for (label, h), color in zip(list(modes.items())[1:], ["C1", "C2"]):
    diff = (torch.tensor(h["losses"]) - single_curve).abs()
    ax_gap.plot(range(1, len(diff) + 1), diff, color=color, lw=0.8, label=f"|{label} - single|")
ax_gap.set_yscale("symlog", linthresh=1e-8)
ax_gap.axhline(1e-5, color="k", ls="--", lw=0.8, label="atol of the check (1e-5)")
ax_gap.set_xlabel("optimizer step")
ax_gap.set_ylabel("|loss difference| (nats, symlog)")
ax_gap.set_title("Distance from the single-process loss")
ax_gap.legend(loc="center right")
plt.show()

# %%
names = list(modes)
fig, (ax_acc, ax_tp) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
bars = ax_acc.bar(names, [h["test_accuracy"] for h in modes.values()], color=["C0", "C1", "C2"])
ax_acc.bar_label(bars, fmt="%.4f")
ax_acc.axhline(min_accuracy, color="k", ls="--", lw=0.8, label=f"min_accuracy = {min_accuracy}")
ax_acc.set_ylim(min(0.8, min_accuracy - 0.05), 1.0)
ax_acc.set_ylabel("test accuracy (fraction of 10,000 images)")
ax_acc.set_xlabel("mode")
ax_acc.set_title(f"Test accuracy after {steps} steps")
ax_acc.legend(loc="lower right")
bars = ax_tp.bar(names, [h["samples_per_s"] for h in modes.values()], color=["C0", "C1", "C2"])
ax_tp.bar_label(bars, fmt="%.0f")
ax_tp.set_ylabel("training throughput (samples/s)")
ax_tp.set_xlabel("mode")
ax_tp.set_title("Samples per second of the training loop (this machine, this run)")
plt.show()

# %% [markdown]
# ## 8. The comparison
#
# The seed's qualitative comparison, with this run's measurements next to it. Peak memory is
# the peak resident set size (`ru_maxrss`) of each process: the notebook kernel for single and
# DP, each worker for DDP. Every process carries its own PyTorch runtime (about 0.5 GiB with
# CUDA libraries), its own copy of the data (0.23 GiB) and its own model, so DDP's total is
# about `world_size` times one process; the kernel's figure also holds Jupyter, pandas,
# matplotlib and whatever the notebook did before.
#
# Samples per second are this run's measurement on this machine (the first, warm-up step is
# not counted), not a law. On a CPU they are noisy and depend on load: single and DP run in
# the kernel with `torch.get_num_threads()` intra-op threads, and every small operation waits
# for all of them, which is slow when other processes compete for the cores; each DDP rank
# runs one thread per core it was given by the launcher.

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
rows = []
for (label, h), kind in zip(modes.items(), qualitative):
    rows.append({"mode": label, **qualitative[kind],
                 "processes": h["world_size"],
                 "samples/s (measured)": round(h["samples_per_s"]),
                 "test accuracy (measured)": round(h["test_accuracy"], 4),
                 "peak RSS per process, MiB (measured)": round(h["peak_rss_mib"]),
                 "peak RSS, all processes, MiB (measured)": round(sum(h.get("peak_rss_mib_per_rank", [h["peak_rss_mib"]])))})
table = pd.DataFrame(rows).set_index("mode")
with pd.option_context("display.max_colwidth", None):
    display(table.T)

# %% [markdown]
# ## What we saw
#
# * With the global batch fixed, the same seed and the same data order, **all three modes
#   learned the same model**: DP on CPU is literally the single-process run
#   (`device_ids == []`, the module is just called), and DDP with a mean loss followed the
#   single-process loss curve and weights to float32 rounding (about 1e-7), because the
#   average of the ranks' mean-loss gradients over equal shards is the whole batch's gradient.
# * `DistributedSampler` with `set_epoch` draws the same permutation as the single process and
#   gives rank `r` the strided slice `global_batch[r::world_size]` of every global batch.
# * One epoch of the seed's recipe reaches about 0.91 test accuracy in every mode (the full
#   profile checks >= 0.90; the smoke profile's 200 steps reach about 0.88).
# * Metrics need reducing: each rank's own loss differs; the global loss and the accuracy
#   (correct/total counts from unpadded shards, evaluated on `ddp.module`) are all-reduced.
# * The costs differ: DDP pays a process, a PyTorch runtime and a copy of the data per rank
#   (the memory rows), and an all-reduce of the gradients every step. Which mode is fastest on
#   a CPU depends on the machine and its load (the samples/s rows measure this run only); DDP's
#   design pays off when each step's compute dominates its all-reduce, as on GPUs with real
#   models.
#
# ## Exercises
#
# Predict each answer by hand first, write it into `answer_N` (replacing `None`) and run the
# check cell below it: it prints "correct" or "not yet" with a hint. The solution is in the
# collapsed cell after the check (click the "…" or the bar on its left to open it). CI runs
# every solution, so they are known to be right. None of them trains or starts processes.

# %% [markdown]
# ### Exercise 1: scaling out at a fixed global batch
#
# You move this recipe to 4 GPUs and keep the global batch at 128 images per optimizer
# step. How many images does each rank process per step? Answer with a whole number.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% tags=["check"]
# expected: the notebook's own TrainConfig, which DDP's workers use to size their batches
expected_1 = TrainConfig(global_batch_size=128).batch_per_rank(4)
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

# %% tags=["check"]
# expected: the notebook's own TrainConfig (DistributedSampler's padding included)
expected_2 = TrainConfig(global_batch_size=128, epochs=1).total_steps(60_000, 4)
check_answer("ex2", answer_2, expected_2, hint="divide the epoch by the global batch, then round up")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# One step consumes one global batch of 128 images, whatever the number of ranks:
# 60,000 / 128 = 468.75, so 468 full steps and a partial one: 469.
solution_2 = math.ceil(60_000 / 128)
assert solution_2 == TrainConfig(global_batch_size=128).total_steps(60_000, 1)  # same on 1 rank
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: what DDP sends per step
#
# With `Linear(784, 10)` in `float32`, how many **bytes** of gradients does DDP all-reduce
# in every step (one gradient entry per parameter entry)? Answer with a whole number.

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% tags=["check"]
# expected: the parameters of the notebook's own model, counted in bytes
expected_3 = sum(p.numel() * p.element_size() for p in build_model("linear", seed).parameters())
check_answer("ex3", answer_3, expected_3, hint="count the weight and the bias, 4 bytes per float32")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# weight 784 x 10 = 7,840 entries, bias 10: 7,850 gradient entries x 4 bytes = 31,400 bytes
# (about 31 kB per step: tiny next to the 64 x 784 x 4 = 200 kB of images of one global batch).
solution_3 = (784 * 10 + 10) * 4
check_answer("ex3", solution_3, expected_3, strict=True)
