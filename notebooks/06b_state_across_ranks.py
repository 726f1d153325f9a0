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
# # 06b · DDP state across ranks: BatchNorm, checkpoints, evaluation
#
# <!-- opening:start -->
# **You will be able to** handle BatchNorm statistics, bit-identical resume, evaluation on every rank. **You need** [02 one model, many processes](02_one_model_many_processes.ipynb), [06a training-loop pitfalls](06a_training_loop_pitfalls.ipynb).
# <!-- opening:end -->
#
# **The question:** DDP keeps the parameters equal on every rank. What about everything else a
# rank holds: buffers, checkpoint files, evaluation numbers? And how do we *prove* each rule?
#
# The three sections have 06a's shape. First comes the experiment's code, run on real ranks
# with `launch`. Then the symptom, then the fix. Each claim is in bold, and the folded `check`
# cell right after it asserts it.
#
# 1. BatchNorm · 2. checkpoints · 3. evaluation and logging
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | sections 1-3 | one short launch of `world_size` processes per experiment, backend `gloo` (pinned: the hang demonstrations need gloo's catchable timeout) | the same, on CPU |
# | section 1, real `SyncBatchNorm` | **skipped, and says so** (it raises on CPU: shown); the all-reduced-sums reference runs | runs with `nccl` when there are at least `world_size` GPUs, compared with the reference |
# | section 1, DataParallel's BatchNorm | real `nn.DataParallel` on CPU (no devices: it just calls the module) + a labelled CPU **emulation** of DP on several devices | real DP on the visible GPUs, compared with the emulation |
#
# Terms (see the [glossary](../docs/GLOSSARY.md)): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [process group](../docs/GLOSSARY.md#process-group), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [DDP](../docs/GLOSSARY.md#ddp), [DP](../docs/GLOSSARY.md#dp),
# [replica](../docs/GLOSSARY.md#replica).
#
# **New here:** `broadcast_buffers` and `forward_sync_buffers`, `SyncBatchNorm`, checkpointing
# under DDP, distributed evaluation. Every claim was checked against torch 2.14.1. The lesson
# prints the seconds of each launch at the end of section 3.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 2  # DDP ranks (processes) of every launch; 2 or more
collective_timeout_s = 3.0  # seconds a rank waits in a hung collective before gloo raises

# %%
from helpers.notebook import check_answer, check_parameters, check_value

seed = 0  # seeds every model and data set

check_parameters(world_size=(world_size, int), collective_timeout_s=(collective_timeout_s, float))
check_value("world_size", world_size, world_size >= 2, "2 or more (one rank has nobody to disagree with)")

# %%
import copy
import os
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from IPython.display import Markdown, display
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.testing import assert_close

from helpers.captured import captured_output, show_folded
from helpers.engine import launch, worker_device

t_notebook = time.perf_counter()
T = collective_timeout_s
n_gpus = torch.cuda.device_count()
mse = nn.functional.mse_loss
launch_s = {}  # seconds of every launch, by section (printed at the end)
features, lr = 4, 0.1  # the input width and SGD learning rate of every model here
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; world_size = {world_size}")

# %% [markdown]
# ## 0. Tools every section uses
#
# Every experiment below is a function `fn(rank, world_size, ...)` run with `launch`, as in
# [06a](06a_training_loop_pitfalls.ipynb). Its small tools are those of 06a's section 0, imported
# from `helpers/ddp_tools.py`. A section that shows a hang builds its DDP model on a process
# group whose collectives time out after `collective_timeout_s` seconds, on gloo (06a says why).

# %%
from helpers.ddp_tools import cpu, error_text, is_timeout_error, params, short_timeout_group, wrap

# %% [markdown]
# ## 1. BatchNorm
#
# <a id="case-syncbn-gpu"></a>
# **Symptom:** SyncBatchNorm layers only work with GPU modules.
#
# BatchNorm has **buffers**: `running_mean`, `running_var` and `num_batches_tracked`. Every
# training forward updates them from the local batch, and DDP does not all-reduce buffers. In
# `bn_batches`, rank `r`'s data have a mean of about `3 r`, so per-rank statistics visibly
# differ.
#
# `broadcast_buffers`, `True` by default, makes DDP broadcast **rank 0's** buffers to every
# rank at the start of a forward. It does so at the first forward, and when the previous
# forward ran with gradients. Then each rank updates them with its own batch. torch 2.14.1
# deprecates the name. The launch output, folded under one line, holds a `FutureWarning` that
# recommends `forward_sync_buffers`. The two differ at construction, as the end of this section
# checks.
#
# The worker trains a fresh `float64` `BatchNorm1d(3)` for `bn_steps` steps in three ways:
# alone, `DDP(bn)` and `DDP(bn, broadcast_buffers=False)`. Then it wraps a BatchNorm whose
# buffers already differ per rank with each of the two flags. It tries `SyncBatchNorm` on CPU.
# Last, `sync_batchnorm_reference` computes what `SyncBatchNorm` would from all-reduced sums.

# %%
bn_channels, bn_batch, bn_steps = 3, 8, 3


def bn_batches(rank):
    """Rank `rank`'s bn_steps batches, each (bn_batch, bn_channels) float64, mean about 3 rank, std about 1 + rank."""
    g = torch.Generator().manual_seed(seed * 1000 + 37 * rank + 5)
    return [torch.randn(bn_batch, bn_channels, generator=g, dtype=torch.float64) * (1 + rank) + 3 * rank
            for _ in range(bn_steps)]


def buffers(module):
    return {n: cpu(b) for n, b in module.named_buffers()}


def sync_batchnorm_reference(x, bn):
    """What SyncBatchNorm computes in training, from all-reduced [sum(x), sum(x^2), count] per channel.

    x: this rank's (local_batch, C) rows. Normalises them with the GLOBAL mean and biased variance and
    updates bn's running statistics with the global mean and UNBIASED variance, as nn.SyncBatchNorm does
    (https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html). Collective: every rank calls it.
    """
    stats = torch.stack([x.sum(0), (x * x).sum(0), torch.full_like(x[0], x.shape[0])]).detach()
    dist.all_reduce(stats)
    n = stats[2]
    mean, var = stats[0] / n, stats[1] / n - (stats[0] / n) ** 2
    with torch.no_grad():
        bn.running_mean.mul_(1 - bn.momentum).add_(bn.momentum * mean)
        bn.running_var.mul_(1 - bn.momentum).add_(bn.momentum * var * n / (n - 1))
        bn.num_batches_tracked.add_(1)
    return (x - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias


# %%
def batchnorm_worker(rank, world_size):
    device = worker_device()
    batches = [b.to(device) for b in bn_batches(rank)]
    weights = torch.arange(1.0, bn_channels + 1, dtype=torch.float64, device=device)  # a loss that uses every channel
    out = {}
    for case, ddp_kwargs in (("local", None), ("broadcast_buffers_true", {}),
                             ("broadcast_buffers_false", {"broadcast_buffers": False})):
        bn = nn.BatchNorm1d(bn_channels, dtype=torch.float64).to(device)
        model = bn if ddp_kwargs is None else wrap(bn, **ddp_kwargs)
        for x in batches:
            (model(x) * weights).sum().backward()
        out[case] = buffers(bn)
    for case, ddp_kwargs in (("wrap_broadcast_buffers_false", {"broadcast_buffers": False}),
                             ("wrap_forward_sync_buffers_false", {"forward_sync_buffers": False})):
        bn = nn.BatchNorm1d(bn_channels, dtype=torch.float64).to(device)
        bn(batches[0])  # one local update: the buffers now differ per rank
        before = buffers(bn)
        wrap(bn, **ddp_kwargs)
        out[case] = {"before": before, "after": buffers(bn)}
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(bn_channels, dtype=torch.float64))).to(device)
    try:
        sync(batches[0])
        out["syncbn_error"] = None
    except ValueError as e:
        out["syncbn_error"] = error_text(e)
    ref_bn = nn.BatchNorm1d(bn_channels, dtype=torch.float64).to(device)
    out["syncbn_reference"] = {"out": cpu(sync_batchnorm_reference(batches[0], ref_bn)), **buffers(ref_bn)}
    return out

# %% [markdown]
# One launch. Then `simulate_bn_buffers` replays the broadcast rule in this kernel, in one
# process. With `broadcast_buffers`, it copies rank 0's buffers to every rank before each
# step. Then each rank updates them with its batch.

# %%
t0 = time.perf_counter()
with captured_output() as bn_output:  # the workers' relayed FutureWarning
    B = launch(batchnorm_worker, world_size, backend="gloo", timeout=120)
launch_s["1 batchnorm"] = time.perf_counter() - t0
DEPRECATED = "FutureWarning: `broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead."
bn_warned = [r for r in range(world_size) if any(line.startswith(f"[rank {r}]") and DEPRECATED in line
                                                 for line in bn_output.getvalue().splitlines())]
show_folded(f"expected: torch's \"{DEPRECATED}\" on ranks {bn_warned}", bn_output.getvalue())


def simulate_bn_buffers(batches, broadcast_buffers):
    """batches[r][t]: rank r's batch at step t. Returns each rank's buffers after training."""
    mods = [nn.BatchNorm1d(bn_channels, dtype=torch.float64) for _ in batches]
    for t in range(bn_steps):
        if broadcast_buffers:
            for m in mods[1:]:
                m.load_state_dict(mods[0].state_dict())
        for m, rank_batches in zip(mods, batches):
            m(rank_batches[t])
    return [buffers(m) for m in mods]

# %% [markdown]
# **Claim:** after `bn_steps` training steps under DDP, each rank's running statistics are:
#
# | flag | rank 0 | rank `r > 0` |
# |---|---|---|
# | `broadcast_buffers=False` | its data alone | its data alone: the ranks disagree |
# | `broadcast_buffers=True` | **rank 0's data alone** | rank 0's before the last step, updated with *its own* last batch |
#
# `simulate_bn_buffers` predicts every case. None is the global batch's statistic, which
# `SyncBatchNorm` tracks: the table's last row.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank's buffers against the simulation and the claim's words
batches = [bn_batches(r) for r in range(world_size)]
predicted = {"broadcast_buffers_true": simulate_bn_buffers(batches, True),
             "broadcast_buffers_false": simulate_bn_buffers(batches, False)}
bn_global = nn.BatchNorm1d(bn_channels, dtype=torch.float64)  # the global batch at every step: what SyncBatchNorm tracks
for t in range(bn_steps):
    bn_global(torch.cat([batches[r][t] for r in range(world_size)]))
rows = []
for r, b in enumerate(B):
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(b["broadcast_buffers_false"][key], b["local"][key], msg=f"rank {r}: broadcast_buffers=False keeps local {key}")
        for case, pred in predicted.items():
            assert_close(b[case][key], pred[r][key], msg=f"rank {r}, {case}: {key} != simulate_bn_buffers")
        assert_close(B[0]["broadcast_buffers_true"][key], B[0]["local"][key], msg=f"rank 0's {key} should be its data alone")
    for case in predicted:
        assert not torch.allclose(b[case]["running_mean"], bn_global.running_mean), f"rank {r}, {case}: the global batch's"
    if r > 0:  # the claim's words, with torch's BatchNorm: rank 0's buffers before the last step, then rank r's last batch
        own_last = nn.BatchNorm1d(bn_channels, dtype=torch.float64)
        for t in range(bn_steps - 1):
            own_last(batches[0][t])
        own_last(batches[r][bn_steps - 1])
        for key, value in buffers(own_last).items():
            assert_close(b["broadcast_buffers_true"][key], value, msg=f"rank {r}: broadcast_buffers=True {key}")
        assert not torch.allclose(b["broadcast_buffers_true"]["running_mean"], B[0]["broadcast_buffers_true"]["running_mean"]), \
            f"rank {r}: with broadcast_buffers=True its running_mean still differs from rank 0's after training"
        assert not torch.allclose(b["broadcast_buffers_false"]["running_mean"], B[0]["broadcast_buffers_false"]["running_mean"])
    for case in ("local", "broadcast_buffers_true", "broadcast_buffers_false"):
        rows.append({"case": case, "rank": r, **{f"running_mean[{c}]": float(b[case]["running_mean"][c]) for c in range(bn_channels)},
                     **{f"running_var[{c}]": float(b[case]["running_var"][c]) for c in range(bn_channels)}})
assert not torch.allclose(B[0]["broadcast_buffers_true"]["running_mean"], bn_global.running_mean), \
    "rank 0's running_mean should differ from the global batch's"
rows.append({"case": "global batch (what SyncBatchNorm tracks)", "rank": "all",
             **{f"running_mean[{c}]": float(bn_global.running_mean[c]) for c in range(bn_channels)},
             **{f"running_var[{c}]": float(bn_global.running_var[c]) for c in range(bn_channels)}})
pd.DataFrame(rows).set_index(["case", "rank"]).round(4)

# %% [markdown]
# ### SyncBatchNorm
#
# `nn.SyncBatchNorm.convert_sync_batchnorm(model)` replaces every BatchNorm by a
# `SyncBatchNorm`. It normalises with the statistics of the **global** batch.
#
# **Claim:** on CPU, in training mode with a process group initialised, its forward raises
# `ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone`.
# That is torch 2.14.1's message. Without a process group, as in this notebook's kernel, it
# silently computes plain BatchNorm instead.
#
# **Claim:** `sync_batchnorm_reference` uses all-reduced sums. On each rank it gives that
# rank's rows of one `BatchNorm1d` applied to the concatenated global batch. Its running
# statistics are that BatchNorm's: a momentum update with the *unbiased* global variance.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the CPU error, and the reference against one global BatchNorm
for r, b in enumerate(B):
    assert b["syncbn_error"] is not None and b["syncbn_error"].startswith(
        "ValueError: SyncBatchNorm expected input tensor to be on GPU"), f"rank {r}: {b['syncbn_error']}"
print(f"SyncBatchNorm on CPU, every rank: {B[0]['syncbn_error']}")
assert not dist.is_initialized(), "this kernel has no process group"
sbn, plain_bn = nn.SyncBatchNorm(bn_channels, dtype=torch.float64), nn.BatchNorm1d(bn_channels, dtype=torch.float64)
assert_close(sbn(batches[0][0]), plain_bn(batches[0][0]), msg="no process group: SyncBatchNorm = plain BatchNorm")
print("in this kernel (no process group) SyncBatchNorm ran on CPU and equalled plain BatchNorm")
x_global = torch.cat([batches[r][0] for r in range(world_size)])  # step 0 of every rank: the global batch
bn_one = nn.BatchNorm1d(bn_channels, dtype=torch.float64)
out_global = bn_one(x_global)
for r, b in enumerate(B):
    ref_r = b["syncbn_reference"]
    assert_close(ref_r["out"], out_global[r * bn_batch:(r + 1) * bn_batch].detach(), msg=f"rank {r}: output != global BatchNorm rows")
    assert_close(ref_r["running_mean"], bn_one.running_mean, msg=f"rank {r}: running_mean != global BatchNorm")
    assert_close(ref_r["running_var"], bn_one.running_var, msg=f"rank {r}: running_var != global BatchNorm")
print("all-reduced sums reproduce BatchNorm on the global batch: outputs and running statistics match")

# %% [markdown]
# **On a GPU machine**, with one GPU per rank, the check below launches real `SyncBatchNorm`
# with `backend="nccl"`. It runs `syncbn_gpu_worker` and compares it with the reference above.
# On a machine with fewer GPUs it launches nothing and says that it skipped.

# %%
def syncbn_gpu_worker(rank, world_size):
    device = worker_device()
    assert device.type == "cuda", "syncbn_gpu_worker needs backend='nccl' with one GPU per rank"
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(bn_channels, dtype=torch.float64))).to(device)
    return {"out": cpu(sync(bn_batches(rank)[0].to(device))), **buffers(sync[0])}

# %% [markdown]
# **Claim (GPU):** where it runs, real `SyncBatchNorm` equals `sync_batchnorm_reference` on every
# rank, in its outputs and its running statistics.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: real SyncBatchNorm on GPUs against the reference
from helpers.notebook import cpu_claim, gpu_claim

if gpu_claim("real SyncBatchNorm equals sync_batchnorm_reference on every rank", gpus=world_size):
    gpu = launch(syncbn_gpu_worker, world_size, backend="nccl", timeout=300)
    for r, g in enumerate(gpu):
        for key in ("out", "running_mean", "running_var"):
            assert_close(g[key], B[r]["syncbn_reference"][key], rtol=1e-5, atol=1e-6,
                         msg=f"rank {r}: real SyncBatchNorm {key} != all-reduced-sums reference")
    display(Markdown(f"**GPU branch RAN:** real `SyncBatchNorm` on {world_size} GPUs (nccl) matched the reference."))
else:
    display(Markdown(f"**GPU branch SKIPPED:** real `SyncBatchNorm` needs one GPU per rank (`world_size = {world_size}`, "
                     f"GPUs visible: {n_gpus}). The CPU error and the all-reduced-sums reference above ran instead."))

# %% [markdown]
# ### DataParallel's BatchNorm is different again
#
# `nn.DataParallel` runs in one process. At each forward it replicates the module onto every
# device and runs each replica on its chunk of the batch. So each replica normalises with
# **its chunk's** statistics. The buffers reach the replicas through
# `comm.broadcast_coalesced`, whose outputs for `device_ids[0]` are the original tensors. So
# only replica 0's running-statistics update lands in the module. The others update copies
# that are discarded, as `torch/nn/parallel/replicate.py` shows.
#
# `emulated_dp_batchnorm` below is a CPU **emulation** of that, not torch's DP. Replica 0 is
# the module itself, and the others are deep copies.

# %%
def emulated_dp_batchnorm(bn, x, num_replicas):
    """EMULATION of nn.DataParallel(bn) in training on num_replicas devices: x (batch, C) -> (batch, C)."""
    chunks = x.chunk(num_replicas)  # DP's scatter
    return torch.cat([bn(chunks[0])] + [copy.deepcopy(bn)(c) for c in chunks[1:]])  # replicas; DP's gather


def chunk_bn(c):  # what a fresh BatchNorm1d (weight 1, bias 0) outputs in training on chunk c
    return (c - c.mean(0)) / torch.sqrt(c.var(0, unbiased=False) + 1e-5)

# %% [markdown]
# **Claim:** the emulation normalises each chunk with its own statistics. It updates the
# running statistics from chunk 0 only.
#
# **Claim (CPU):** on a CPU-only machine, the real `nn.DataParallel(bn)` has
# `device_ids == []` and simply calls the module: BatchNorm over the whole batch.
#
# **Claim (GPU):** with GPUs, real DP equals the emulation.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the emulation, then real DP on this machine's devices
chunks = x_global.chunk(world_size)
bn_emu = nn.BatchNorm1d(bn_channels, dtype=torch.float64)
out_emu = emulated_dp_batchnorm(bn_emu, x_global, world_size).detach()
assert_close(out_emu, torch.cat([chunk_bn(c) for c in chunks]), msg="emulated DP: each chunk normalised with its own statistics")
assert_close(bn_emu.running_mean, 0.1 * chunks[0].mean(0), msg="emulated DP: running_mean from chunk 0 only")
assert_close(bn_emu.running_var, 0.9 + 0.1 * chunks[0].var(0, unbiased=True), msg="emulated DP: running_var from chunk 0 only")
assert not torch.allclose(bn_emu.running_mean, bn_one.running_mean), "DP's running_mean should differ from the global batch's"
print(f"EMULATED DP on {world_size} devices: running_mean {bn_emu.running_mean.numpy().round(4)} "
      f"(chunk 0 only) vs global batch {bn_one.running_mean.numpy().round(4)}")
if cpu_claim("on a CPU-only machine nn.DataParallel(bn) is BatchNorm over the whole batch"):
    bn_cpu = nn.BatchNorm1d(bn_channels, dtype=torch.float64)
    dp = nn.DataParallel(bn_cpu)
    assert dp.device_ids == [], f"no GPU: DataParallel should have no devices, got {dp.device_ids}"
    assert_close(dp(x_global).detach(), out_global.detach(), msg="DP on CPU is the plain module: whole-batch BatchNorm")
    assert_close(bn_cpu.running_mean, bn_one.running_mean, msg="DP on CPU: whole-batch running statistics")
    display(Markdown("**GPU branch SKIPPED** (no GPU): real DataParallel on several devices; on CPU `nn.DataParallel` "
                     "has no devices and called the module once on the whole batch (checked above)."))
if gpu_claim("with GPUs, real nn.DataParallel(bn) equals the emulation"):
    bn_gpu = nn.BatchNorm1d(bn_channels, dtype=torch.float64).cuda()
    out_dp = nn.DataParallel(bn_gpu)(x_global.cuda()).detach().cpu()
    bn_check = nn.BatchNorm1d(bn_channels, dtype=torch.float64)
    out_check = emulated_dp_batchnorm(bn_check, x_global, n_gpus).detach()  # x.chunk(n_gpus), as DP's scatter
    assert_close(out_dp, out_check, rtol=1e-5, atol=1e-6, msg="real DP output != emulation")
    assert_close(bn_gpu.running_mean.cpu(), bn_check.running_mean, rtol=1e-5, atol=1e-6, msg="real DP running_mean != emulation")
    display(Markdown(f"**GPU branch RAN:** real DataParallel on {n_gpus} GPU(s) matched the emulation with {len(x_global.chunk(n_gpus))} replica(s)."))

# %% [markdown]
# ### `broadcast_buffers=False` versus `forward_sync_buffers=False` (torch 2.14.1)
#
# Both stop the per-forward broadcast. They differ at **construction**, where DDP normally
# broadcasts rank 0's parameters and buffers. The deprecated `broadcast_buffers=False` skips
# the buffers there too. `forward_sync_buffers=False` does not. The `FutureWarning` says so,
# and the check asserts its text.
#
# **Claim:** take a BatchNorm whose buffers already differ per rank after one local forward.
# Wrapped with `broadcast_buffers=False`, it keeps its **own** buffers. After
# `DDP(..., forward_sync_buffers=False)`, it holds **rank 0's**. The worker above did both.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the warning's text, and the buffers after each wrap
assert bn_warned == list(range(world_size)), f"every rank should print the FutureWarning: ranks {bn_warned}"
assert "`forward_sync_buffers=False` still syncs buffers at init" in bn_output.getvalue(), bn_output.getvalue()[-800:]
for r, b in enumerate(B):
    own, fsync = b["wrap_broadcast_buffers_false"], b["wrap_forward_sync_buffers_false"]
    for key in ("running_mean", "running_var"):
        assert_close(own["after"][key], own["before"][key], msg=f"rank {r}: broadcast_buffers=False keeps its own {key}")
        assert_close(fsync["after"][key], B[0]["wrap_forward_sync_buffers_false"]["before"][key],
                     msg=f"rank {r}: forward_sync_buffers=False still broadcasts rank 0's {key} at construction")
    if r > 0:
        assert not torch.allclose(own["after"]["running_mean"], B[0]["wrap_broadcast_buffers_false"]["after"]["running_mean"])
pd.DataFrame([{"rank": r, "running_mean[0] before wrapping": float(b["wrap_broadcast_buffers_false"]["before"]["running_mean"][0]),
               "after DDP(broadcast_buffers=False)": float(b["wrap_broadcast_buffers_false"]["after"]["running_mean"][0]),
               "after DDP(forward_sync_buffers=False)": float(b["wrap_forward_sync_buffers_false"]["after"]["running_mean"][0])}
              for r, b in enumerate(B)]).set_index("rank").round(4)

# %% [markdown]
# ## 2. Checkpoints
#
# The worker trains `DDP(Linear(4, 2))` with SGD and momentum 0.9. It first tries a strict
# `load_state_dict` of the **wrapper's** state dict into a bare `Linear`. Then it follows the
# recipe of the [DDP tutorial](https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints):
#
# 1. train `ckpt_steps` steps;
# 2. **rank 0 alone** saves `ddp.module.state_dict()` and the optimizer state;
# 3. `dist.barrier()`, so nobody reads before the file is complete;
# 4. every rank loads with `map_location=<its device>` into a fresh bare model, wraps it again
#    and restores the optimizer.
#
# Both the original and the resumed run then take `ckpt_steps` more steps on the same data.

# %%
ckpt_steps = 3


def regression_step(ddp, opt, rank, step):
    g = torch.Generator().manual_seed(seed * 7919 + 101 * rank + step)  # this rank's batch of this step
    x = torch.randn(8, features, generator=g)
    y = torch.stack([x.sum(1), x[:, 0] - x[:, -1]], dim=1)
    opt.zero_grad(set_to_none=True)
    mse(ddp(x.to(worker_device())), y.to(worker_device())).backward()
    opt.step()


def checkpoint_worker(rank, world_size, ckpt_dir):
    path, device = os.path.join(ckpt_dir, "checkpoint.pt"), worker_device()
    torch.manual_seed(seed)
    ddp = wrap(nn.Linear(features, 2))
    out = {"wrapper_state_dict": {k: cpu(v) for k, v in ddp.state_dict().items()}, "strict_error": None}
    bare = nn.Linear(features, 2)
    try:
        bare.load_state_dict(ddp.state_dict())  # the wrapper's keys carry "module."
    except RuntimeError as e:
        out["strict_error"] = str(e)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    for step in range(ckpt_steps):
        regression_step(ddp, opt, rank, step)
    if rank == 0:
        torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "step": ckpt_steps}, path)
        print(f"saved {os.path.basename(path)} after step {ckpt_steps}")
    dist.barrier()  # nobody loads before rank 0 has finished writing
    out["files"] = sorted(os.listdir(ckpt_dir))
    ckpt = torch.load(path, map_location=device, weights_only=True)
    fresh = nn.Linear(features, 2).to(device)
    fresh.load_state_dict(ckpt["model"])  # strict: the keys have no "module." prefix
    resumed = wrap(fresh)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=lr, momentum=0.9)
    opt2.load_state_dict(ckpt["optimizer"])
    out["loaded_step"] = ckpt["step"]
    for step in range(ckpt_steps, 2 * ckpt_steps):
        regression_step(ddp, opt, rank, step)
        regression_step(resumed, opt2, rank, step)
    out["uninterrupted"], out["resumed"] = params(ddp.module), params(resumed.module)
    dist.barrier()  # nobody returns (and lets the caller delete the directory) while others still read
    return out

# %% [markdown]
# One launch.

# %%
t0 = time.perf_counter()
with tempfile.TemporaryDirectory(prefix="ddp-lab-nb06b-") as ckpt_dir:
    CK = launch(checkpoint_worker, world_size, ckpt_dir, backend="gloo", timeout=120)
launch_s["2 checkpoints"] = time.perf_counter() - t0
assert not Path(ckpt_dir).exists(), f"the temporary checkpoint directory {ckpt_dir} should be gone"

# %% [markdown]
# **Claim:** the wrapper's `state_dict()` keys carry the `module.` prefix: `module.weight`,
# `module.bias`. A strict `load_state_dict` of it into a bare `Linear` fails. It reports **2
# missing** keys, `weight` and `bias`, and **2 unexpected** ones, `module.weight` and
# `module.bias`. `consume_prefix_in_state_dict_if_present(sd, "module.")` repairs such a file.
# Better, save `ddp.module.state_dict()` in the first place.
#
# **Claim:** after the barrier, every rank saw exactly one file, `checkpoint.pt`. Rank 0 wrote
# it and printed the `saved checkpoint.pt` line above. Every rank loaded step `ckpt_steps`.
# Model **and optimizer** state were saved, momentum included. So the resumed run's parameters
# are **bit-identical** to the uninterrupted run's, on every rank.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the prefix, the strict load's error, one file, bit-identical resume
c0 = CK[0]
wrapper_sd = c0["wrapper_state_dict"]
assert list(wrapper_sd) == ["module.weight", "module.bias"], list(wrapper_sd)
assert list(nn.Linear(features, 2).state_dict()) == ["weight", "bias"]
assert 'Missing key(s) in state_dict: "weight", "bias"' in c0["strict_error"], c0["strict_error"]
assert 'Unexpected key(s) in state_dict: "module.weight", "module.bias"' in c0["strict_error"], c0["strict_error"]
result = nn.Linear(features, 2).load_state_dict(wrapper_sd, strict=False)
assert (len(result.missing_keys), len(result.unexpected_keys)) == (2, 2), result
print("strict load of the wrapper's state_dict into a bare Linear:\n" + c0["strict_error"])

sd = dict(wrapper_sd)
consume_prefix_in_state_dict_if_present(sd, "module.")
bare = nn.Linear(features, 2)
bare.load_state_dict(sd)  # strict, and it works now
assert_close(bare.weight.detach(), wrapper_sd["module.weight"], msg="prefix removed: same weights")

rows = []
for r, c in enumerate(CK):
    assert c["files"] == ["checkpoint.pt"], f"rank {r} should see exactly one file after the barrier: {c['files']}"
    assert c["loaded_step"] == ckpt_steps, f"rank {r} loaded step {c['loaded_step']}"
    for n in c["resumed"]:
        assert torch.equal(c["resumed"][n], c["uninterrupted"][n]), f"rank {r}, {n}: resumed != uninterrupted (bit-wise)"
        assert torch.equal(c["resumed"][n], CK[0]["resumed"][n]), f"rank {r}, {n}: differs from rank 0 (bit-wise)"
    rows.append({"rank": r, "files seen after the barrier": c["files"], "step loaded": c["loaded_step"],
                 "resumed == uninterrupted (bit-wise)": True, "== rank 0 (bit-wise)": True,
                 "weight[0, :3] after resuming": c["resumed"]["weight"][0, :3].tolist()})
pd.DataFrame(rows).set_index("rank")

# %% [markdown]
# ## 3. Evaluation and logging
#
# **Right way:** evaluate `ddp.module`, the bare model, on each rank's shard. All-reduce the
# **sums** `[loss_sum, correct, count]` and divide once. Print on rank 0 only: the
# `[rank 0] validation: ...` line in the launch output. Ranks' BatchNorm running statistics
# differ after training, as section 1 showed. So the worker first broadcasts rank 0's buffers.
#
# **A forward through the wrapper on rank 0 alone.** Folklore says it hangs. In torch 2.14.1
# it hangs **when that forward starts a collective**. In a plain training setup that happens
# in two cases; others exist, such as inside a `Join` context.
#
# * The model has **buffers**, like BatchNorm. `forward_sync_buffers` or `broadcast_buffers`
#   is `True`, the default. The previous forward ran with gradients enabled, in training.
#   Then DDP's forward begins by broadcasting rank 0's buffers: `_pre_forward` calls
#   `_sync_buffers` in `torch/nn/parallel/distributed.py`. `ddp.eval()` and `torch.no_grad()`
#   do **not** prevent it. Rank 0 is the broadcast's source and waits for receivers.
# * Gradients are enabled, and this is the first forward after the **first** backward. DDP
#   rebuilds its buckets once, and rank 0 broadcasts the new bucket order:
#   `Reducer::rebuild_buckets` calls `sync_bucket_indices`. After the second step that has
#   already happened, and the same call returns.
#
# The worker tries five cases, each on its own short-timeout group. Only rank 0 calls forward.

# %%
eval_samples = 64


def classifier_model():  # it has buffers (BatchNorm)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def classification_data(n, offset=0):
    """x (n, features) float32, labels (n,) int64 = x[:, 0] + x[:, 1] > 0."""
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed * 31 + 17 + offset))
    return x, (x[:, 0] + x[:, 1] > 0).long()


def evaluate(model, x, labels):
    """Sums, so ranks can all-reduce them and divide once: {"loss_sum", "correct", "count"} (floats).

    Leaves every submodule in the train()/eval() mode it found, so a training loop can call it.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    with torch.no_grad():
        logits = model(x)
    for m, training in modes:
        m.training = training  # as it was: train() again in a training loop
    return {"loss_sum": float(nn.functional.cross_entropy(logits, labels, reduction="sum")),
            "correct": float((logits.argmax(1) == labels).sum()), "count": float(labels.numel())}


EVAL_HANG_CASES = {  # case: (model, training steps first, what rank 0 alone calls)
    "bn_wrapper_eval_no_grad": ("classifier (BatchNorm buffers)", 1, "ddp.eval(); with no_grad: ddp(x)"),
    "bn_module_eval_no_grad": ("classifier (BatchNorm buffers)", 1, "ddp.module.eval(); with no_grad: ddp.module(x)"),
    "linear_wrapper_no_grad": ("Linear (no buffers)", 1, "with no_grad: ddp(x)"),
    "linear_wrapper_grad_after_1_step": ("Linear (no buffers)", 1, "ddp(x), gradients enabled"),
    "linear_wrapper_grad_after_2_steps": ("Linear (no buffers)", 2, "ddp(x), gradients enabled"),
}

# %%
def eval_hang_case(rank, case, timeout_s):
    kind, steps, _ = EVAL_HANG_CASES[case]
    group = short_timeout_group(timeout_s)
    model = classifier_model() if kind.startswith("classifier") else nn.Linear(features, 2)
    ddp = wrap(model, process_group=group)
    x, labels = classification_data(16, offset=rank)
    for _ in range(steps):
        nn.functional.cross_entropy(ddp(x), labels).backward()
    if rank != 0:
        return {"result": "did not call", "seconds": 0.0}
    t0 = time.perf_counter()
    try:
        if case == "bn_wrapper_eval_no_grad":
            ddp.eval()
            with torch.no_grad():
                ddp(x)
        elif case == "bn_module_eval_no_grad":
            ddp.module.eval()
            with torch.no_grad():
                ddp.module(x)
        elif case == "linear_wrapper_no_grad":
            with torch.no_grad():
                ddp(x)
        else:
            ddp(x)
        result = "returned"
    except RuntimeError as e:
        result = error_text(e)
    return {"result": result, "seconds": time.perf_counter() - t0}


# %%
def evaluation_worker(rank, world_size, timeout_s):
    model = classifier_model()
    ddp = wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for step in range(2):
        x, labels = classification_data(32, offset=100 + 10 * step + rank)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), labels).backward()
        opt.step()
    for b in model.buffers():  # make the running statistics identical on every rank first
        dist.broadcast(b, src=0)
    x_val, y_val = classification_data(eval_samples, offset=999)
    shard = slice(rank * eval_samples // world_size, (rank + 1) * eval_samples // world_size)
    local = evaluate(ddp.module, x_val[shard], y_val[shard])  # the bare model: no collective
    modes_after = [m.training for m in model.modules()]
    totals = torch.tensor([local["loss_sum"], local["correct"], local["count"]], dtype=torch.float64)
    dist.all_reduce(totals)  # sums, then divide once
    loss, acc = float(totals[0] / totals[2]), float(totals[1] / totals[2])
    if rank == 0:
        print(f"validation: loss {loss:.4f}, accuracy {acc:.3f} over {int(totals[2])} samples (all ranks)")
    return {"state_dict": {k: cpu(v) for k, v in model.state_dict().items()}, "local": local,
            "global": {"loss": loss, "accuracy": acc}, "modes_after": modes_after,
            "hang_cases": {case: eval_hang_case(rank, case, timeout_s) for case in EVAL_HANG_CASES}}

# %% [markdown]
# One launch: worker start-up plus two `collective_timeout_s` waits.

# %%
t0 = time.perf_counter()
E = launch(evaluation_worker, world_size, T, backend="gloo", timeout=120)
launch_s["3 evaluation"] = time.perf_counter() - t0

# %% [markdown]
# **Claim:** the all-reduced loss and accuracy equal one process evaluating the whole
# validation set with rank 0's weights. Every rank holds the same numbers.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the all-reduced metrics against one process
model_ref = classifier_model()
model_ref.load_state_dict(E[0]["state_dict"])
x_val, y_val = classification_data(eval_samples, offset=999)
one_process = evaluate(model_ref, x_val, y_val)
for r, e in enumerate(E):
    assert_close(e["global"]["loss"], one_process["loss_sum"] / one_process["count"], msg=f"rank {r}: all-reduced loss != one process")
    assert_close(e["global"]["accuracy"], one_process["correct"] / one_process["count"], msg=f"rank {r}: accuracy != one process")
assert_close(sum(e["local"]["loss_sum"] for e in E), one_process["loss_sum"], rtol=1e-5, atol=1e-5, msg="shard sums add up")
assert sum(e["local"]["count"] for e in E) == eval_samples
pd.DataFrame([{"who": f"rank {r} (its shard)", "samples": e["local"]["count"], "mean loss": e["local"]["loss_sum"] / e["local"]["count"],
               "accuracy": e["local"]["correct"] / e["local"]["count"]} for r, e in enumerate(E)]
             + [{"who": "all ranks, all-reduced", "samples": eval_samples,
                 "mean loss": E[0]["global"]["loss"], "accuracy": E[0]["global"]["accuracy"]},
                {"who": "one process, whole set", "samples": eval_samples,
                 "mean loss": one_process["loss_sum"] / one_process["count"],
                 "accuracy": one_process["correct"] / one_process["count"]}]).set_index("who").round(4)

# %% [markdown]
# **Claim:** `evaluate()` leaves the model in the mode it found. On every rank the model is
# back in `train()` after it, every submodule included. A model in `eval()` stays in `eval()`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the modes after evaluate(), on the ranks and here
for r, e in enumerate(E):
    assert all(e["modes_after"]), f"rank {r}: evaluate() left a module in eval(): {e['modes_after']}"
model_ref.eval()
evaluate(model_ref, x_val, y_val)
assert not any(m.training for m in model_ref.modules()), "evaluate() changed an eval() model to train()"
model_ref.train()
evaluate(model_ref, x_val, y_val)
assert all(m.training for m in model_ref.modules()), "evaluate() left a train() model in eval()"
print(f"after evaluate(): train() on ranks {[r for r, e in enumerate(E) if all(e['modes_after'])]}; "
      "an eval() model stays in eval()")

# %% [markdown]
# **Claim:** a forward through the wrapper on rank 0 alone waits until the group's timeout,
# `collective_timeout_s`, in two cases:
#
# | model | rank 0 alone calls | result |
# |---|---|---|
# | BatchNorm | `ddp(x)`, even under `eval()` and `no_grad()` | waits, times out |
# | `Linear` | `ddp(x)` with gradients, after one step | waits, times out |
# | BatchNorm | `ddp.module(x)` | returns |
# | `Linear` | `ddp(x)` under `no_grad` | returns |
# | `Linear` | `ddp(x)` with gradients, after two steps | returns |
#
# The table below gives the seconds each call took.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: which of rank 0's lone forwards time out
HANGS = {"bn_wrapper_eval_no_grad", "linear_wrapper_grad_after_1_step"}
rows = []
for case, (kind, steps, call) in EVAL_HANG_CASES.items():
    res = E[0]["hang_cases"][case]
    if case in HANGS:
        assert is_timeout_error(res["result"]), f"{case}: rank 0 should have waited in a collective: {res['result']}"
    else:
        assert res["result"] == "returned", f"{case}: rank 0's forward should return: {res['result']}"
    assert all(E[r]["hang_cases"][case]["result"] == "did not call" for r in range(1, world_size))
    rows.append({"model": kind, "training steps first": steps, "rank 0 alone calls": call,
                 "hangs?": "HANGS" if case in HANGS else "no", "seconds": round(res["seconds"], 2),
                 "result on rank 0": res["result"].split("] ")[-1]})
pd.DataFrame(rows)

# %%
total_s = time.perf_counter() - t_notebook
print(f"lesson 06b ran in {total_s:.0f} s; seconds per launch (start-up included; the hang demonstrations include "
      f"their deliberate timeouts, collective_timeout_s = {T:g} s):")
pd.Series(launch_s, name="seconds").round(1).to_frame()

# %% [markdown]
# ## What we saw
#
# * **BatchNorm:** DDP never all-reduces buffers. With `broadcast_buffers=True`, rank 0's
#   running statistics come from rank 0's data alone. The others' come from rank 0's plus
#   their own last batch. torch 2.14.1 renames the flag `forward_sync_buffers`. Unlike
#   `broadcast_buffers=False`, `forward_sync_buffers=False` still broadcasts at construction.
#   `SyncBatchNorm` equals BatchNorm on the global batch; it needs GPUs, and its CPU error was
#   shown. DataParallel normalises per chunk and keeps chunk 0's statistics.
# * **Checkpoints:** save `ddp.module.state_dict()`, without the `module.` prefix, and the
#   optimizer on rank 0. Then a barrier, then load with `map_location`. Resuming is
#   bit-identical on every rank.
# * **Evaluation:** evaluate `ddp.module`, all-reduce sums, divide once, print on rank 0. A
#   forward through the wrapper on one rank hangs only when it starts a collective: a buffer
#   broadcast or a bucket rebuild. A BatchNorm model after training hangs even under `eval()`
#   and `no_grad()`. An `evaluate()` that restores the mode it found is safe in a training loop.
#
# Casebook: [a rank-0-only `validate()` that leaves rank 0 in `eval()`](10a_casebook_training_loop.ipynb#case-rank0-validate-leaves-eval),
# and [`torch.save` of the whole DDP object](10c_casebook_models_and_checkpoints.ipynb#case-torch-save-whole-ddp).
#
# ## Exercises
#
# Both ask for a value. Predict it by hand first, then set `answer_N`, replacing `None`. Run the
# check cell below it; it prints "correct" or "not yet" with a hint. In the full lesson a
# collapsed solution follows each check; click the "…" or the bar on its left to open it.
# Student copies leave the solutions out. Every solution runs when the full lesson runs, so
# each is known to pass its check.

# %% [markdown]
# ### Exercise 1: whose BatchNorm statistics are a rank's own?
#
# In section 1's run, some ranks end with exactly the running statistics of training alone,
# the `"local"` case. Which ranks, under `DDP(bn)` with the default `broadcast_buffers=True`?
# And which under `DDP(bn, broadcast_buffers=False)`? Answer with a dict of two lists of ranks
# for this run's `world_size`: `{"broadcast_buffers=True": [...], "broadcast_buffers=False": [...]}`.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, read from section 1's launch
# expected: the ranks whose buffers equal their own training alone, read from section 1's launch
expected_1 = {f"broadcast_buffers={flag}": [r for r, b in enumerate(B)
                                            if all(torch.allclose(b[case][k], b["local"][k]) for k in ("running_mean", "running_var"))]
              for flag, case in ((True, "broadcast_buffers_true"), (False, "broadcast_buffers_false"))}
check_answer("ex1", answer_1, expected_1,
             hint="with broadcasting, whose buffers does each rank start every step from? Rank 0 receives its own.")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# broadcast_buffers=True: before every step each rank receives rank 0's buffers, so only rank 0
# keeps statistics of its own data alone. False: no rank ever receives anything: all keep their own.
solution_1 = {"broadcast_buffers=True": [0], "broadcast_buffers=False": list(range(world_size))}
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: the validation loss of unequal shards
#
# Two ranks evaluate shards of different sizes. Rank 0 has 40 samples with a mean loss of 0.5.
# Rank 1 has 24 samples with a mean loss of 0.9. Section 3's recipe all-reduces
# `[loss_sum, correct, count]` and divides once. What validation loss does it print? Answer
# with a number.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, section 3's recipe on these shards
# expected: section 3's recipe on these shards: the summed [loss_sum, count] of the two ranks, divided once
shard_totals = torch.tensor([[40 * 0.5, 40.0], [24 * 0.9, 24.0]], dtype=torch.float64).sum(0)  # what all_reduce returns
expected_2 = float(shard_totals[0] / shard_totals[1])
check_answer("ex2", answer_2, expected_2, rel_tol=1e-3,
             hint="not the mean of the two means (0.7): the sum of the losses over all 64 samples, divided by 64")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# loss sums 40 * 0.5 = 20 and 24 * 0.9 = 21.6; together 41.6 over 64 samples
solution_2 = (20 + 21.6) / 64  # 0.65
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [06c seeds and debugging](06c_seeds_and_debugging.ipynb): seed ranks, catch collective mismatches, read a rank's traceback and hang.
# <!-- next:end -->
