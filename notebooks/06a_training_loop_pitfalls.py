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
# # 06 · DDP in practice: the pitfalls lab
#
# <!-- run-time:start -->
# **Run time** (measured): 92 s in the `full` profile on Linux x86_64, 2 CPU cores, no GPU (2026-12-03). **Reading time** (estimate: about 4,800 words of prose at 200 words/min): about 24 min.
# <!-- run-time:end -->
#
# **The question:** once `DistributedDataParallel` (DDP) runs at all, which mistakes make it
# hang, crash or — worse — silently train the wrong thing, and how do we *prove* each fix?
#
# Nine pitfalls, each in the same shape: the code of the experiment, written in this notebook's
# cells and run on real ranks with `launch` (the functions are sent to the worker processes by
# value); the symptom as a learner meets it (reproduced on CPU with the gloo backend; where it
# would hang, a short timeout ends it and the error is caught and shown); then the fix, each
# claim (in bold, "Claim:") asserted (`torch.testing.assert_close` or `assert` with a message)
# in the code cell right after it.
#
# 1. gradient accumulation with `no_sync()` · 2. uneven inputs and `Join` · 3. unused
# parameters · 4. unequal per-rank batch sizes · 5. BatchNorm · 6. checkpoints ·
# 7. evaluation and logging · 8. seeds and determinism · 9. debugging
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | sections 1-9 | one short launch of `world_size` processes per experiment, backend `gloo` (pinned: the hang demonstrations need gloo's catchable timeout) | the same, on CPU |
# | section 5, real `SyncBatchNorm` | **skipped, and says so** (it raises on CPU: shown); the all-reduced-sums reference runs | runs with `nccl` when there are at least `world_size` GPUs, compared with the reference |
# | section 5, DataParallel's BatchNorm | real `nn.DataParallel` on CPU (no devices: it just calls the module) + a labelled CPU **emulation** of DP on several devices | real DP on the visible GPUs, compared with the emulation |
#
# Terms (see the [glossary](../docs/GLOSSARY.md)): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [process group](../docs/GLOSSARY.md#process-group), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [bucket](../docs/GLOSSARY.md#bucket), [DDP](../docs/GLOSSARY.md#ddp), [DP](../docs/GLOSSARY.md#dp),
# [replica](../docs/GLOSSARY.md#replica).
#
# **New here:** DDP communication hooks (to count all-reduces), `Join`,
# `find_unused_parameters` / `static_graph`, `broadcast_buffers`, `SyncBatchNorm`,
# checkpointing under DDP, distributed evaluation, `TORCH_DISTRIBUTED_DEBUG`. Every claim was
# checked against torch 2.14.1; where it differs from folklore, the notebook says what really
# happens. The whole notebook prints its run time and the seconds of each launch at the end of
# section 9; most of it is the deliberate timeouts and worker start-up (each launch starts
# fresh processes and builds a process group; the times printed grow with the machine's load).

# %% tags=["parameters"]
# Parameters: what you run by default, top to bottom in JupyterLab (the smoke profile); the full profile overrides some (docs/RUNNER.md)
world_size = 2  # DDP ranks (processes) of every launch; 2 or more
seed = 0  # seeds every model and data set
accum_steps = 4  # k, micro-batches per optimizer step in section 1
seed_steps = 30  # SGD steps of the seeds experiment in section 8
collective_timeout_s = 3.0  # seconds a rank waits in a hung collective before gloo raises
hang_timeout_s = 5.0  # launch timeout of section 2's hang, which the launcher itself ends

# %%
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int), seed=(seed, int), accum_steps=(accum_steps, int), seed_steps=(seed_steps, int),
                 collective_timeout_s=(collective_timeout_s, float), hang_timeout_s=(hang_timeout_s, float))
check_value("world_size", world_size, world_size >= 2 and 64 % world_size == 0, "2, 4 or 8 (64 samples split evenly)")
check_value("accum_steps", accum_steps, accum_steps >= 2, "at least 2 (no_sync needs a micro-batch to skip)")

# %%
import contextlib
import copy
import datetime
import io
import linecache
import os
import re
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from unittest import mock

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import psutil
import torch
import torch.distributed as dist
from IPython.display import Markdown, display
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from helpers.engine import LaunchTimeout, WorkerError, free_port, launch, worker_device

t_notebook = time.perf_counter()
T = collective_timeout_s
n_gpus = torch.cuda.device_count()
mse = nn.functional.mse_loss
launch_s = {}  # seconds of every launch, by section (printed at the end)
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; world_size = {world_size}")

# %% [markdown]
# ## 0. Tools every section uses
#
# Every experiment below is a function `fn(rank, world_size, ...)` defined in a cell and run
# with `launch(fn, world_size, ..., backend="gloo")`, which starts `world_size` new processes,
# initialises the default process group in each, and returns `[result of rank 0, result of
# rank 1, ...]` to the cell. Worker prints appear under the cell prefixed `[rank r]`.
#
# **How a hang is shown without hanging the notebook.** A section that demonstrates a hang
# builds its DDP model on a fresh process group, `dist.new_group(timeout=...)` with
# `collective_timeout_s` seconds: the rank left waiting in a collective gets gloo's timeout
# error after those seconds (in a real job: after gloo's default 30 minutes), catches it and
# returns it as text. With NCCL a timed-out collective is handled by a watchdog that tears the
# process down instead of raising (the `timeout` argument of
# [`init_process_group`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group)),
# so this notebook pins `backend="gloo"`.

# %%
def wrap(model, **ddp_kwargs):
    """DDP(model) on this rank's device (cuda:<local_rank> under nccl, else cpu)."""
    device = worker_device()
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)


def short_timeout_group(seconds):
    """A new process group of all ranks whose collectives raise after `seconds` (gloo)."""
    dist.barrier()  # a rank still finishing a previous timed-out demonstration catches up first
    return dist.new_group(timeout=datetime.timedelta(seconds=seconds))


def is_timeout_error(text):
    """gloo words its timeout "Timed out waiting 3000ms for recv operation" or "Application timeout caused pair closure"."""
    return text is not None and ("timed out" in text.lower() or "timeout" in text.lower())


def cpu(t):
    return t.detach().cpu().clone()


def params(module):
    return {n: cpu(p) for n, p in module.named_parameters()}


def grads(module):
    return {n: None if p.grad is None else cpu(p.grad) for n, p in module.named_parameters()}


def error_text(e):
    return f"{type(e).__name__}: {e}"

# %% [markdown]
# ## 1. Gradient accumulation with `no_sync()`
#
# Accumulating `k` micro-batches before one optimizer step is the usual way to get a large
# global batch on little memory. Under DDP every backward all-reduces the gradients — unless
# it runs under `ddp.no_sync()`, which defers the all-reduce to the first synchronised
# backward, which then all-reduces the **accumulated** gradients.
#
# The toy: `Linear(4, 1)` in `float64`, MSE loss, `k = accum_steps` micro-batches of 2 samples
# per rank (rank `r` takes the contiguous rows `r k 2 ... (r + 1) k 2 - 1` of the global
# batch), each micro-batch loss divided by `k` (so the `k` gradients add up to the mean over
# the `k * 2` samples). Six loops, each a function below, each run on a fresh model for one
# optimizer step.
#
# **How communication is measured:** a DDP communication hook (`counting_allreduce_hook`,
# registered with `ddp.register_comm_hook(state, hook)`; [docs](https://pytorch.org/docs/stable/ddp_comm_hooks.html))
# is called by DDP once per **bucket** ready to be all-reduced. It counts the call and the
# bucket's bytes (`bucket.buffer().numel() * element_size()`), then calls torch's default
# `allreduce_hook` (divide each gradient by `world_size`, then all-reduce with SUM), so the gradients are unchanged.

# %%
features, micro_batch, lr = 4, 2, 0.1


def accumulation_batch(world_size, k):
    """One optimizer step's global batch: x (world_size*k*micro_batch, features) float64, y (same, 1)."""
    g = torch.Generator().manual_seed(seed + 11)
    n = world_size * k * micro_batch
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    w = torch.randn(features, 1, generator=g, dtype=torch.float64)
    return x, x @ w + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)


def counting_allreduce_hook(state, bucket):  # state: {"calls": int, "bytes": int}
    buf = bucket.buffer()  # this bucket's gradients, flattened
    state["calls"] += 1
    state["bytes"] += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)  # what DDP does without a hook


def accumulation_worker(rank, world_size, k, loops):
    """Run each loop of `loops` ({name: fn(ddp, micro)}) for one SGD step on a fresh DDP(Linear)."""
    x, y = accumulation_batch(world_size, k)
    rows = slice(rank * k * micro_batch, (rank + 1) * k * micro_batch)
    micro = list(zip(x[rows].split(micro_batch), y[rows].split(micro_batch)))
    out = {}
    for name, loop in loops.items():
        torch.manual_seed(seed)
        model = nn.Linear(features, 1, dtype=torch.float64)
        ddp = wrap(model)
        counter = {"calls": 0, "bytes": 0}
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        loop(ddp, micro)
        grad = torch.cat([cpu(model.weight.grad).flatten(), cpu(model.bias.grad)])
        opt.step()
        out[name] = {"grad": grad, "calls": counter["calls"], "bytes": counter["bytes"], "weight_after": cpu(model.weight)}
    return out

# %% [markdown]
# The six loops. Only the placement of `no_sync()` differs.

# %%
def no_sync_all_but_last(ddp, micro):  # the correct recipe
    k = len(micro)
    for x, y in micro[:-1]:
        with ddp.no_sync():  # forward AND backward inside
            (mse(ddp(x), y) / k).backward()
    x, y = micro[-1]
    (mse(ddp(x), y) / k).backward()  # synchronised: all-reduces the accumulated gradients


def one_big_batch(ddp, micro):  # no accumulation: all k micro-batches at once
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    mse(ddp(x), y).backward()


def sync_every_micro_batch(ddp, micro):  # no no_sync() at all
    for x, y in micro:
        (mse(ddp(x), y) / len(micro)).backward()


def off_by_one(ddp, micro):  # the bug: synchronise the FIRST micro-batch, no_sync() on the others
    k = len(micro)
    (mse(ddp(micro[0][0]), micro[0][1]) / k).backward()
    for x, y in micro[1:]:
        with ddp.no_sync():
            (mse(ddp(x), y) / k).backward()


def forward_outside(ddp, micro):  # micro-batches 0..k-2: forward outside no_sync(), backward inside
    k = len(micro)
    for x, y in micro[:-1]:
        out = ddp(x)
        with ddp.no_sync():
            (mse(out, y) / k).backward()
    (mse(ddp(micro[-1][0]), micro[-1][1]) / k).backward()


def backward_outside(ddp, micro):  # micro-batches 0..k-2: forward inside no_sync(), backward outside
    k = len(micro)
    for x, y in micro[:-1]:
        with ddp.no_sync():
            out = ddp(x)
        (mse(out, y) / k).backward()
    (mse(ddp(micro[-1][0]), micro[-1][1]) / k).backward()


LOOPS = {f.__name__: f for f in (no_sync_all_but_last, one_big_batch, sync_every_micro_batch, off_by_one,
                                 forward_outside, backward_outside)}

# %% [markdown]
# One launch runs the six loops on `world_size` ranks (mostly worker start-up). The reference
# is one process on the whole global batch, no DDP.

# %%
t0 = time.perf_counter()
acc = launch(accumulation_worker, world_size, accum_steps, LOOPS, backend="gloo", timeout=120)
launch_s["1 accumulation"] = time.perf_counter() - t0

x_all, y_all = accumulation_batch(world_size, accum_steps)
torch.manual_seed(seed)
single = nn.Linear(features, 1, dtype=torch.float64)
mse(single(x_all), y_all).backward()  # one process, the whole global batch: the reference gradient
ref_grad = torch.cat([single.weight.grad.flatten(), single.bias.grad])
print(f"one launch of {world_size} ranks: {launch_s['1 accumulation']:.1f} s")

# %% [markdown]
# **Claim:** `no_sync()` on micro-batches `0 .. k-2` and a synchronised last one gives the
# same gradient as one batch `k` times larger, and as one process on the whole global batch,
# with **1** all-reduce per optimizer step instead of `k`: `k` times fewer bytes on the wire.
# This model fits in one bucket: 5 `float64` parameters = 40 bytes per all-reduce.
#
# **Claim:** synchronising every micro-batch gives the same gradient too (averaging
# already-averaged values changes nothing), at `k` times the communication.
#
# **Claim:** **off by one** — synchronising the *first* micro-batch and `no_sync()` on the
# rest — leaves each rank with `average(micro-batch 0) + its own local micro-batches 1..k-1`:
# the ranks' gradients differ, and after one SGD step the replicas' parameters **diverge**.
# Nothing raises.
#
# **Claim:** what decides is the **forward**: DDP decides at the end of the forward whether
# the next backward will all-reduce (the [`no_sync` docs](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync):
# "The forward pass should be included inside the context manager, or else gradients will
# still be synchronized"). Forward outside, backward inside: `k` all-reduces (no saving,
# still correct). Forward inside, backward outside: 1 all-reduce, correct. The readable rule —
# put forward *and* backward inside — is the safe one.

# %%
k = accum_steps
bytes_per_allreduce = (features + 1) * 8  # one bucket of float64 parameters: 4 weights + 1 bias
expected_calls = {"no_sync_all_but_last": 1, "one_big_batch": 1, "sync_every_micro_batch": k,
                  "off_by_one": 1, "forward_outside": k, "backward_outside": 1}
rows = []
for name in LOOPS:
    per_rank = [a[name] for a in acc]
    calls, nbytes = per_rank[0]["calls"], per_rank[0]["bytes"]
    divergence = max(float((p["weight_after"] - per_rank[0]["weight_after"]).abs().max()) for p in per_rank)
    equal_ref = all(torch.allclose(p["grad"], ref_grad) for p in per_rank)
    assert all((p["calls"], p["bytes"]) == (calls, nbytes) for p in per_rank), f"{name}: ranks disagree on the count"
    assert calls == expected_calls[name], f"{name}: {calls} all-reduces per step, expected {expected_calls[name]}"
    assert nbytes == calls * bytes_per_allreduce, f"{name}: {nbytes} bytes, expected {calls} x {bytes_per_allreduce}"
    if name == "off_by_one":
        assert not equal_ref, "off by one: the gradient should NOT equal the reference on every rank"
        assert divergence > 1e-6, f"off by one: the replicas should diverge after the step (max diff {divergence:g})"
    else:
        for r, p in enumerate(per_rank):
            assert_close(p["grad"], ref_grad, msg=f"{name}, rank {r}: gradient != one process")
            assert torch.equal(p["weight_after"], per_rank[0]["weight_after"]), f"{name}: replicas differ after the step"
    rows.append({"loop": name, "all-reduces per step": calls, "bytes all-reduced (per rank)": nbytes,
                 "gradient = one process?": equal_ref, "max |Δ weight| across ranks after the step": divergence})
saving = acc[0]["sync_every_micro_batch"]["bytes"] / acc[0]["no_sync_all_but_last"]["bytes"]
assert saving == k, f"no_sync should all-reduce {k} times fewer bytes, got a factor {saving:g}"
table1 = pd.DataFrame(rows).set_index("loop")
print(f"accumulating k = {k} micro-batches with no_sync: {saving:g}x fewer bytes all-reduced; off by one: replicas "
      f"differ by up to {table1.loc['off_by_one', 'max |Δ weight| across ranks after the step']:.3g} after ONE step")
table1

# %%
fig, (ax_b, ax_d) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
names = list(table1.index)
bars = ax_b.barh(names, table1["bytes all-reduced (per rank)"], color="tab:blue")
ax_b.bar_label(bars, fmt="%d B", fontsize=8, padding=3)
ax_b.set_xlim(0, table1["bytes all-reduced (per rank)"].max() * 1.2)
ax_b.set_xlabel("bytes all-reduced per optimizer step, per rank (bytes)")
ax_b.set_title(f"Communication per optimizer step (k = {k})")
ax_b.set_ylabel("accumulation variant")
ax_b.invert_yaxis()
bars = ax_d.barh(names, table1["max |Δ weight| across ranks after the step"], color="tab:red")
ax_d.bar_label(bars, fmt="%.3g", fontsize=8, padding=3)  # off the tick marks: "0", not "-0"
ax_d.set_xlim(0, table1["max |Δ weight| across ranks after the step"].max() * 1.3)
ax_d.set_xlabel("max |weight(rank r) - weight(rank 0)| after one SGD step (weight units)")
ax_d.set_title("Do the replicas stay identical?")
ax_d.set_yticks(range(len(names)), [""] * len(names))
ax_d.tick_params(axis="y", length=0)
ax_d.invert_yaxis()
plt.show()

# %% [markdown]
# ## 2. Uneven inputs: the extra step hangs; `Join` completes it
#
# Rank `r` gets `2 + r` batches of one number each, `10 r + i + 1` (rank 0 sees 1, 2; rank 1
# sees 11, 12, 13; ...). The model is `y = w x` with `w = 1` and loss `y.sum()`, so a rank's
# local gradient **is** its input, and the all-reduced gradient shows which ranks contributed.
# Three runs of the same loop: without `Join` on a short-timeout group, and inside
# [`Join([ddp], divide_by_initial_world_size=...)`](https://pytorch.org/docs/stable/distributed.algorithms.join.html)
# with `True` (the default) and `False` (`ddp.join()` is the same context manager).

# %%
base_batches = 2  # rank r has base_batches + r batches


def join_inputs(rank):
    return [float(10 * rank + i + 1) for i in range(base_batches + rank)]


def scalar_model():  # y = w x, w = 1
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64, device=worker_device())
    nn.init.ones_(model.weight)
    return model


def join_loop(ddp, model, inputs, use_join, divide):
    """Train on `inputs`, one scalar per step; return the gradient after each step, and the error if any."""
    got, t0 = [], time.perf_counter()
    try:
        with Join([ddp], enable=use_join, divide_by_initial_world_size=divide):
            for x in inputs:
                model.zero_grad(set_to_none=True)
                ddp(torch.tensor([[x]], dtype=torch.float64, device=worker_device())).sum().backward()
                got.append(model.weight.grad.item())
        error = None
    except RuntimeError as e:  # the gradient all-reduce timed out: this rank waited for a rank that had left
        error = error_text(e)
    return {"grads": got, "error": error, "seconds": time.perf_counter() - t0}


def join_worker(rank, world_size, timeout_s):
    out, inputs = {}, join_inputs(rank)
    model = scalar_model()
    out["no_join"] = join_loop(wrap(model, process_group=short_timeout_group(timeout_s)), model, inputs, False, True)
    for case, divide in (("join_divide_initial", True), ("join_divide_active", False)):
        model = scalar_model()
        out[case] = join_loop(wrap(model), model, inputs, True, divide)
    return out

# %% [markdown]
# The launch takes worker start-up plus `collective_timeout_s` (the ranks with an extra batch
# wait that long for rank 0).

# %%
t0 = time.perf_counter()
J = launch(join_worker, world_size, T, backend="gloo", timeout=120)
launch_s["2 join"] = time.perf_counter() - t0
inputs = [join_inputs(r) for r in range(world_size)]
print(f"{launch_s['2 join']:.1f} s")

# %% [markdown]
# **Claim:** without `Join`, the first two steps all-reduce normally: the gradient at step `i`
# is the mean over ranks of `10 r + i + 1`, i.e. `5 (world_size - 1) + i + 1` (for 2 ranks:
# `(1 + 11) / 2 = 6`, then `7`). At step 2 rank 0 has left its loop; every other rank waits
# in the gradient all-reduce for a rank that never comes. On this demo's short-timeout group
# gloo raises after `collective_timeout_s` seconds ("Timed out waiting ... for recv/send
# operation to complete", or "Application timeout caused pair closure": `is_timeout_error`
# accepts both); rank 0 finished without any error.

# %%
for r, res in enumerate(J):
    nj = res["no_join"]
    closed_form = [5 * (world_size - 1) + i + 1 for i in range(base_batches)]  # mean over r of 10 r, plus i + 1
    assert nj["grads"] == closed_form, f"rank {r}: the first {base_batches} steps: {nj['grads']} != {closed_form}"
    if r == 0:
        assert nj["error"] is None, f"rank 0 ran out of batches first and should finish cleanly: {nj['error']}"
    else:
        assert is_timeout_error(nj["error"]), f"rank {r} should time out: {nj['error']}"
    print(f"rank {r}: batches {inputs[r]}, gradients {nj['grads']}, "
          + (f"then after {nj['seconds']:.1f} s: {nj['error']}" if nj["error"] else "finished"))

# %% [markdown]
# **Claim:** the same loop inside `Join` completes on every rank. A rank that has run out of
# batches *joins*: it shadows the others' all-reduces with zeros. So at step `i`, with `A_i`
# the ranks that still have a batch, the gradient is `sum(x) over A_i` divided by
#
# * `world_size` with `divide_by_initial_world_size=True` (the default): the joined ranks
#   count as zero gradients;
# * `len(A_i)` with `False`: the average over the ranks still training.
#
# At the last rank's last step (`i = world_size`) only that rank is left, with the input
# `10 (world_size - 1) + world_size + 1`: for 2 ranks `13 / 2 = 6.5` (default) and `13`
# (`False`). The default makes the update shrink as ranks run out of data.

# %%
def join_expected(divide_by_initial_world_size):
    """Per rank, the gradient after each of its steps: sum over the active ranks / (world_size or their number)."""
    out = []
    for r in range(world_size):
        row = []
        for i in range(len(inputs[r])):
            active = [s for s in range(world_size) if len(inputs[s]) > i]
            row.append(sum(inputs[s][i] for s in active) / (world_size if divide_by_initial_world_size else len(active)))
        out.append(row)
    return out


expected_join = {"join_divide_initial": join_expected(True), "join_divide_active": join_expected(False)}
rows = []
for r, res in enumerate(J):
    for case, expected in expected_join.items():
        assert res[case]["error"] is None, f"rank {r}, {case}: Join should complete: {res[case]['error']}"
        assert_close(res[case]["grads"], expected[r], msg=f"rank {r}, {case}: gradients per step")
    for i, x in enumerate(inputs[r]):
        nj = res["no_join"]["grads"]
        rows.append({"rank": r, "step": i, "x (local gradient)": x,
                     "ranks with a batch": str([s for s in range(world_size) if len(inputs[s]) > i]),
                     "no Join": nj[i] if i < len(nj) else "timed out",
                     "Join, divide_by_initial_world_size=True": res["join_divide_initial"]["grads"][i],
                     "Join, divide_by_initial_world_size=False": res["join_divide_active"]["grads"][i]})
last_x = 10 * (world_size - 1) + world_size + 1  # the last rank's last input: it is alone at that step
assert J[-1]["join_divide_initial"]["grads"][-1] == last_x / world_size, J[-1]["join_divide_initial"]["grads"]
assert J[-1]["join_divide_active"]["grads"][-1] == last_x, J[-1]["join_divide_active"]["grads"]
table2 = pd.DataFrame(rows).set_index(["rank", "step"])
table2

# %%
last = world_size - 1  # the rank with the most batches sees every step
steps = range(len(inputs[last]))
fig, ax = plt.subplots(figsize=(7.5, 3.8), layout="constrained")
width = 0.38
for j, (case, label) in enumerate((("join_divide_initial", "divide_by_initial_world_size=True (default)"),
                                   ("join_divide_active", "divide_by_initial_world_size=False"))):
    bars = ax.bar([i + (j - 0.5) * width for i in steps], J[last][case]["grads"], width, label=label)
    ax.bar_label(bars, fmt="%g", fontsize=8)
ax.set_xticks(list(steps), [f"step {i}\n{sum(len(inp) > i for inp in inputs)} rank(s) active" for i in steps])
ax.set_ylim(0, 1.35 * max(max(J[last][c]["grads"]) for c in expected_join))
ax.set_xlabel("step of the longest rank")
ax.set_ylabel("gradient dL/dw on that rank (loss units per unit w)")
ax.set_title(f"Join with uneven inputs ({world_size} ranks, rank r has {base_batches} + r batches)")
ax.legend(fontsize=8, loc="upper left")
plt.show()

# %% [markdown]
# **What the launcher sees.** The same loop without `Join`, this time on a process group
# without a short timeout: nothing raises inside the workers any more; the cell simply waits,
# as a real job would, until `launch` gives up after `hang_timeout_s`, ends every worker and
# raises `LaunchTimeout` naming the ranks that never finished. (Worker start-up counts against
# the limit too, so on a very slow machine rank 0 may also be listed; the ranks with the extra
# batch always are.) The cell takes `hang_timeout_s`, on any machine.
#
# **Claim:** `launch` raises `LaunchTimeout` (its `timeout` is `hang_timeout_s`), listing every rank with an
# extra batch, and leaves no worker process behind.

# %%
def uneven_hang_worker(rank, world_size):
    group = dist.new_group()  # keeps the waiting all-reduce apart from the launcher's final barrier
    model = scalar_model()
    ddp = wrap(model, process_group=group)
    for i, x in enumerate(join_inputs(rank)):
        if i >= base_batches:
            print(f"step {i}: rank 0 has no batch {i}; entering backward (its all-reduce waits for rank 0) ...")
        model.zero_grad(set_to_none=True)
        ddp(torch.tensor([[x]], dtype=torch.float64, device=worker_device())).sum().backward()
    print("finished its batches")


t0 = time.perf_counter()
hang = None
try:
    launch(uneven_hang_worker, world_size, backend="gloo", timeout=hang_timeout_s)
except LaunchTimeout as e:
    hang = e
waited = launch_s["2 hang (LaunchTimeout)"] = time.perf_counter() - t0
assert hang is not None, "the launch without Join should have hung and timed out"
print(f"LaunchTimeout after {waited:.1f} s: ranks_not_finished = {hang.ranks_not_finished}\n{hang}")
assert set(range(1, world_size)) <= set(hang.ranks_not_finished), (
    f"ranks 1..{world_size - 1} (one batch more than rank 0) should be listed: {hang.ranks_not_finished}")


# children of this kernel, less the two that live as long as it does: multiprocessing's resource
# tracker and launch's fork server, a direct child (the ranks forked from it do count)
def leftover_children():
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd, direct = " ".join(p.cmdline()), p.ppid() == os.getpid()
        except psutil.Error:  # ended meanwhile
            continue
        if "resource_tracker" not in cmd and not (direct and "multiprocessing.forkserver" in cmd):
            found.append(p)
    return found


assert not leftover_children(), f"processes left behind: {leftover_children()}"
print("no worker process left behind")

# %% [markdown]
# ## 3. Unused parameters
#
# `TwoHeads` has two `Linear(2, 2)` heads; `forward` returns both outputs, the loss uses only
# `head_a`'s. Iteration `it` feeds `x = [rank + 1 + it] * 2`, so `head_a.weight`'s local
# gradient is `rank + 1 + it` in every entry and its all-reduced gradient is the mean over
# ranks, `(world_size + 1) / 2 + it`. DDP numbers parameters in `model.parameters()` order:
# 0 `head_a.weight`, 1 `head_a.bias`, 2 `head_b.weight`, 3 `head_b.bias`. Five cases, each a
# fresh DDP model and three iterations (or until the first error):
# [`find_unused_parameters` and `static_graph`](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html),
# and the debug level INFO, set with `dist.set_debug_level` just for one DDP construction (the
# same as starting the process with `TORCH_DISTRIBUTED_DEBUG=INFO`).

# %%
class TwoHeads(nn.Module):
    """forward(x: (batch, 2) float32) -> (head_a(x), head_b(x)), or head_a(x) alone if return_b=False."""

    def __init__(self, return_b=True):
        super().__init__()
        self.head_a, self.head_b, self.return_b = nn.Linear(2, 2), nn.Linear(2, 2), return_b

    def forward(self, x):
        a, b = self.head_a(x), self.head_b(x)  # head_b is computed either way
        return (a, b) if self.return_b else a


UNUSED_CASES = {  # case: (DDP keyword arguments, forward returns head_b's output?, debug level)
    "default": ({}, True, "OFF"),
    "default_debug_info": ({}, True, "INFO"),
    "find_unused_parameters": ({"find_unused_parameters": True}, True, "OFF"),
    "static_graph_output_returned": ({"static_graph": True}, True, "OFF"),
    "static_graph_output_dropped": ({"static_graph": True}, False, "OFF"),
}


def unused_parameters_worker(rank, world_size, iterations=3):
    out = {}
    for case, (ddp_kwargs, return_b, level) in UNUSED_CASES.items():
        torch.manual_seed(seed)
        model = TwoHeads(return_b)
        previous = dist.get_debug_level()
        dist.set_debug_level(getattr(dist.DebugLevel, level))
        try:
            ddp = wrap(model, **ddp_kwargs)
        finally:
            dist.set_debug_level(previous)
        rec = {"grads": [], "error": None, "error_iteration": None, "param_names": [n for n, _ in model.named_parameters()]}
        for it in range(iterations):
            try:
                model.zero_grad(set_to_none=True)
                res = ddp(torch.full((1, 2), float(rank + 1 + it), device=worker_device()))
                (res[0] if isinstance(res, tuple) else res).sum().backward()  # the loss ignores head_b
            except RuntimeError as e:
                rec["error"], rec["error_iteration"] = str(e), it
                break
            rec["grads"].append(grads(model))
        out[case] = rec
    return out

# %% [markdown]
# One launch. The launch output shows DDP's warning
# "find_unused_parameters=True was specified ... but did not find any unused parameters": its
# search starts from the returned outputs and reaches `head_b` through the output the loss
# ignores; the gradients below show the run is nonetheless right.

# %%
t0 = time.perf_counter()
U = launch(unused_parameters_worker, world_size, backend="gloo", timeout=120)
launch_s["3 unused parameters"] = time.perf_counter() - t0

# %% [markdown]
# **Claim:** with the default DDP the **first** iteration completes without any error — and
# its gradients were **not** averaged: rank `r` keeps its local `head_a` gradient `r + 1`.
# (DDP all-reduces a bucket when all its parameters have gradients; `head_b`'s never arrive.)
# The error comes at the start of the **next** forward, on every rank:
# `RuntimeError: Expected to have finished reduction in the prior iteration before starting a
# new one. ...`, ending with `Parameter indices which did not receive grad for rank r: 2 3`.
# With the debug level INFO (or DETAIL), the message also names them:
# `Parameters which did not receive grad for rank r: head_b.bias, head_b.weight`.

# %%
def parse_unused_parameter_error(message):
    """{"rank", "indices"} from DDP's "did not receive grad" error; "names" only with debug level INFO/DETAIL."""
    m = re.search(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)", message)
    n = re.search(r"Parameters which did not receive grad for rank \d+: ([^\n]+)", message)
    return {"rank": int(m.group(1)) if m else None, "indices": [int(i) for i in m.group(2).split()] if m else [],
            "names": [s.strip() for s in n.group(1).split(",")] if n else None}


names = U[0]["default"]["param_names"]
assert names == ["head_a.weight", "head_a.bias", "head_b.weight", "head_b.bias"], names
for r, u in enumerate(U):
    for case, want_names in (("default", None), ("default_debug_info", ["head_b.bias", "head_b.weight"])):
        rec = u[case]
        assert rec["error_iteration"] == 1, f"rank {r}, {case}: the error should come at iteration 1, got {rec['error_iteration']}"
        assert rec["error"].startswith("Expected to have finished reduction in the prior iteration before starting a new one"), rec["error"][:200]
        parsed = parse_unused_parameter_error(rec["error"])
        assert parsed["rank"] == r and parsed["indices"] == [2, 3], f"rank {r}, {case}: {parsed}"
        assert [names[i] for i in parsed["indices"]] == ["head_b.weight", "head_b.bias"]
        assert parsed["names"] == want_names, f"rank {r}, {case}: names in the message {parsed['names']}"
        g0 = rec["grads"][0]  # the iteration that "worked"
        assert_close(g0["head_a.weight"], torch.full((2, 2), float(r + 1)),
                     msg=f"rank {r}: iteration 0's head_a gradient should be the LOCAL one, {r + 1}, never averaged")
        assert g0["head_b.weight"] is None and g0["head_b.bias"] is None
print("rank 0's error, default debug level:\n" + U[0]["default"]["error"])
print("\n... and its last lines with the debug level INFO:\n" + "\n".join(U[0]["default_debug_info"]["error"].splitlines()[-3:]))

# %% [markdown]
# **Claim:** `find_unused_parameters=True` fixes it: three iterations complete; on every rank
# `head_b`'s gradients stay `None` and `head_a`'s are the average, `(world_size + 1) / 2 + it`.
#
# **Claim:** `static_graph=True` **works only if the unused head's output is not returned**
# (`TwoHeads(return_b=False)`): then it gives the same gradients. If `forward` returns an
# output the loss ignores (the model above), torch 2.14.1 averages iteration 0, leaves
# iteration 1's `head_a` gradients **un-averaged** (each rank keeps its own: `r + 2`), and
# raises at iteration 2 ("... this is not compatible with static_graph set to True").
# This is [pytorch/pytorch issue #97030](https://github.com/pytorch/pytorch/issues/97030):
# `static_graph` is not a drop-in replacement for `find_unused_parameters`.

# %%
rows = []
mean_rank = sum(r + 1 for r in range(world_size)) / world_size  # the average of the local values r + 1
for r, u in enumerate(U):
    for case in ("find_unused_parameters", "static_graph_output_dropped"):
        rec = u[case]
        assert rec["error"] is None and len(rec["grads"]) == 3, f"rank {r}, {case}: {rec['error']}"
        for it, g in enumerate(rec["grads"]):
            assert_close(g["head_a.weight"], torch.full((2, 2), mean_rank + it),
                         msg=f"rank {r}, {case}, iteration {it}: head_a gradient should be averaged")
            assert_close(g["head_a.bias"], torch.ones(2), msg=f"rank {r}, {case}: head_a.bias gradient")
            assert g["head_b.weight"] is None and g["head_b.bias"] is None, f"rank {r}, {case}: head_b grads should stay None"
    rec = u["static_graph_output_returned"]
    assert rec["error_iteration"] == 2 and "static_graph" in rec["error"], f"rank {r}: {rec['error_iteration']} {rec['error']}"
    assert_close(rec["grads"][0]["head_a.weight"], torch.full((2, 2), mean_rank), msg="static_graph: iteration 0 averaged")
    assert_close(rec["grads"][1]["head_a.weight"], torch.full((2, 2), float(r + 2)),
                 msg=f"static_graph with the unused output returned: iteration 1 should be rank {r}'s LOCAL gradient")
    for case, rec in u.items():
        for it in range(3):
            g = rec["grads"][it]["head_a.weight"][0, 0].item() if it < len(rec["grads"]) else "raised" if it == rec["error_iteration"] else "-"
            rows.append({"case": case, "rank": r, "iteration": it, "head_a.weight grad": g})
table3 = pd.DataFrame(rows).pivot(index=["case", "rank"], columns="iteration", values="head_a.weight grad")
table3.columns = [f"iteration {c}" for c in table3.columns]
print(f"averaged value would be {mean_rank:g} + iteration; rank r's local value is r + 1 + iteration")
table3

# %% [markdown]
# ## 4. Unequal per-rank batch sizes
#
# DDP averages the ranks' gradients with equal weight `1 / world_size`, whatever each rank's
# batch size. With per-rank **mean** losses, a sample on a small rank then weighs more than a
# sample on a large one.
#
# Rank `r` holds `r + 1` samples of the global batch `1, 2, ..., N` with
# `N = world_size (world_size + 1) / 2` (2 ranks: `[1]` and `[2, 3]`); model `y = w x` at
# `w = 1`, per-sample loss `y^2`, per-sample gradient `2 x^2`. **The fix:** all-reduce the
# sample count `N` first and use `loss = local sum * world_size / N`: DDP's `1 / world_size`
# cancels the `world_size` and leaves `global sum / N`, the global mean. The worker takes each
# loss as a function `loss_fn(per_sample, n_total, world_size)` and runs both.

# %%
def unequal_shards(world_size):
    """Rank r's samples: (r + 1,) float64, consecutive values of 1, 2, ..., N."""
    x = torch.arange(1, world_size * (world_size + 1) // 2 + 1, dtype=torch.float64)
    return list(x.split([r + 1 for r in range(world_size)]))


def mean_loss(per_sample, n_total, world_size):  # the naive loss: this rank's mean
    return per_sample.mean()


def weighted_loss(per_sample, n_total, world_size):  # the fix
    return per_sample.sum() * world_size / n_total


def unequal_batch_worker(rank, world_size, losses):
    """{name: the gradient of w after one backward with loss_fn(per_sample (n_local,), n_total, world_size)}."""
    x = unequal_shards(world_size)[rank].to(worker_device()).reshape(-1, 1)
    n_total = torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device)
    dist.all_reduce(n_total)  # the global number of samples
    out = {"n_local": x.shape[0], "n_total": int(n_total.item())}
    for name, loss_fn in losses.items():
        model = scalar_model()
        ddp = wrap(model)
        loss_fn(ddp(x).pow(2).flatten(), n_total, world_size).backward()
        out[name] = model.weight.grad.item()
    return out

# %% [markdown]
# One launch.

# %%
t0 = time.perf_counter()
Q = launch(unequal_batch_worker, world_size, {"naive": mean_loss, "weighted": weighted_loss}, backend="gloo", timeout=120)
launch_s["4 unequal batches"] = time.perf_counter() - t0

# %% [markdown]
# **Claim:** with per-rank mean losses DDP gives the **mean of the ranks' means**,
# `(1 / world_size) sum_r 2 mean(x_r^2)` (2 ranks: `(2 + 13) / 2 = 7.5`), not the global mean
# `2 sum(x^2) / N` (2 ranks: `2 (1 + 4 + 9) / 3 = 28 / 3 = 9.33`); the weighted loss gives the
# global mean on every rank. The expected values are computed below with exact fractions and
# the closed form `1^2 + ... + N^2 = N (N + 1) (2N + 1) / 6`.

# %%
N = world_size * (world_size + 1) // 2
first = [r * (r + 1) // 2 + 1 for r in range(world_size)]  # rank r holds first[r], ..., first[r] + r
rank_means = [Fraction(2 * sum(v * v for v in range(first[r], first[r] + r + 1)), r + 1) for r in range(world_size)]
mean_of_rank_means = sum(rank_means) / world_size
global_mean = Fraction(2 * N * (N + 1) * (2 * N + 1), 6 * N)
for r, q in enumerate(Q):
    assert (q["n_local"], q["n_total"]) == (r + 1, N), f"rank {r}: sample counts {q}"
    assert_close(q["naive"], float(mean_of_rank_means), msg=f"rank {r}: per-rank mean losses give the mean of rank means")
    assert_close(q["weighted"], float(global_mean), msg=f"rank {r}: the weighted loss should give the global mean")
assert mean_of_rank_means != global_mean, "the two should differ with unequal batch sizes"
print(f"{world_size} ranks: DDP with mean losses {mean_of_rank_means} = {float(mean_of_rank_means):.4f}; "
      f"global mean {global_mean} = {float(global_mean):.4f}")
pd.DataFrame([{"rank": r, "samples": unequal_shards(world_size)[r].tolist(), "local mean gradient": float(rank_means[r]),
               "DDP gradient, per-rank mean loss": q["naive"], "DDP gradient, sum x world_size / N": q["weighted"],
               "single process, global mean": float(global_mean)} for r, q in enumerate(Q)]).set_index("rank")

# %% [markdown]
# ## 5. BatchNorm
#
# BatchNorm has **buffers** (`running_mean`, `running_var`, `num_batches_tracked`), updated in
# every training forward from the local batch, and DDP does not all-reduce buffers. Rank `r`'s
# data have mean about `3 r` (`bn_batches`), so per-rank statistics visibly differ.
# `broadcast_buffers` (default `True`) makes DDP broadcast **rank 0's** buffers to every rank
# at the start of a forward (when the previous forward ran with gradients, and at the first);
# then each rank updates them with its own batch. torch 2.14.1 deprecates the name (the launch
# output shows a `FutureWarning` recommending `forward_sync_buffers`; the difference is at
# construction, checked at the end of this section).
#
# The worker trains a fresh `BatchNorm1d(3)` (`float64`) for `bn_steps` steps in three ways —
# alone, `DDP(bn)`, `DDP(bn, broadcast_buffers=False)` — then wraps a BatchNorm whose buffers
# already differ per rank with each of the two flags, tries `SyncBatchNorm` on CPU, and computes
# what `SyncBatchNorm` would compute from all-reduced sums (`sync_batchnorm_reference`).

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
# One launch. The single-process model of the buffers,
# `simulate_bn_buffers`, replays the broadcast rule in this kernel: before each step, rank 0's
# buffers are copied to every rank (if `broadcast_buffers`), then each rank updates with its batch.

# %%
t0 = time.perf_counter()
B = launch(batchnorm_worker, world_size, backend="gloo", timeout=120)
launch_s["5 batchnorm"] = time.perf_counter() - t0


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
# **Claim:** after `bn_steps` training steps under DDP,
#
# * `broadcast_buffers=False`: every rank's running statistics are exactly those of that rank
#   training alone; the ranks disagree.
# * `broadcast_buffers=True`: rank 0's running statistics are those of **rank 0's data
#   alone** (what it received was always its own); every other rank holds rank 0's
#   statistics from before the last step updated with *its own* last batch
#   (`simulate_bn_buffers` predicts both). Neither is the statistic of the global batch,
#   which is what `SyncBatchNorm` tracks (last row of the table).

# %%
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
    if r > 0:
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
# `SyncBatchNorm`, which normalises with the statistics of the **global** batch.
#
# **Claim:** on CPU, in training mode with a process group initialised, its forward raises
# `ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone`
# (torch 2.14.1). Without a process group — as in this notebook's kernel — it silently
# computes plain BatchNorm instead.
#
# **Claim:** `sync_batchnorm_reference` (all-reduced sums) gives on each rank its rows of one
# `BatchNorm1d` applied to the concatenated global batch, and that BatchNorm's running
# statistics (momentum update with the *unbiased* global variance).

# %%
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
# **On a GPU machine** (one GPU per rank, at least `world_size` GPUs): the next cell launches
# real `SyncBatchNorm` with `backend="nccl"` and compares it with the reference
# above. On a machine with fewer GPUs it launches nothing and says that it skipped.
#
# **Claim:** where it runs, real `SyncBatchNorm` equals `sync_batchnorm_reference` (outputs and
# running statistics) on every rank.

# %%
def syncbn_gpu_worker(rank, world_size):
    device = worker_device()
    assert device.type == "cuda", "syncbn_gpu_worker needs backend='nccl' with one GPU per rank"
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(bn_channels, dtype=torch.float64))).to(device)
    return {"out": cpu(sync(bn_batches(rank)[0].to(device))), **buffers(sync[0])}


if n_gpus >= world_size:
    gpu = launch(syncbn_gpu_worker, world_size, backend="nccl", timeout=300)
    for r, g in enumerate(gpu):
        for key in ("out", "running_mean", "running_var"):
            assert_close(g[key], B[r]["syncbn_reference"][key], rtol=1e-5, atol=1e-6,
                         msg=f"rank {r}: real SyncBatchNorm {key} != all-reduced-sums reference")
    display(Markdown(f"**GPU branch RAN:** real `SyncBatchNorm` on {world_size} GPUs (nccl) matched the reference."))
else:
    display(Markdown(f"**GPU branch SKIPPED:** real `SyncBatchNorm` needs one GPU per rank (`world_size = {world_size}`, "
                     f"GPUs visible: {n_gpus}). The CPU error and the all-reduced-sums reference above ran instead."))
    print(f"SKIPPED on CPU: real SyncBatchNorm (needs {world_size} GPUs, found {n_gpus})")

# %% [markdown]
# ### DataParallel's BatchNorm is different again
#
# `nn.DataParallel` (one process) replicates the module onto every device at each forward and
# runs each replica on its chunk of the batch, so each replica normalises with **its chunk's**
# statistics. The buffers reach the replicas through `comm.broadcast_coalesced`, whose
# outputs for `device_ids[0]` are the original tensors: only replica 0's running-statistics
# update lands in the module; the others update copies that are discarded
# (`torch/nn/parallel/replicate.py`). `emulated_dp_batchnorm` below is a CPU **emulation** of
# that (not torch's DP): replica 0 is the module itself, the others are deep copies.
#
# **Claim:** the emulation normalises each chunk with its own statistics and updates the running
# statistics from chunk 0 only; on a CPU-only machine the real `nn.DataParallel(bn)` has
# `device_ids == []` and simply calls the module: BatchNorm over the whole batch. With GPUs,
# real DP is compared with the emulation instead (the cell says which ran).

# %%
def emulated_dp_batchnorm(bn, x, num_replicas):
    """EMULATION of nn.DataParallel(bn) in training on num_replicas devices: x (batch, C) -> (batch, C)."""
    chunks = x.chunk(num_replicas)  # DP's scatter
    return torch.cat([bn(chunks[0])] + [copy.deepcopy(bn)(c) for c in chunks[1:]])  # replicas; DP's gather


def chunk_bn(c):  # what a fresh BatchNorm1d (weight 1, bias 0) outputs in training on chunk c
    return (c - c.mean(0)) / torch.sqrt(c.var(0, unbiased=False) + 1e-5)


chunks = x_global.chunk(world_size)
bn_emu = nn.BatchNorm1d(bn_channels, dtype=torch.float64)
out_emu = emulated_dp_batchnorm(bn_emu, x_global, world_size).detach()
assert_close(out_emu, torch.cat([chunk_bn(c) for c in chunks]), msg="emulated DP: each chunk normalised with its own statistics")
assert_close(bn_emu.running_mean, 0.1 * chunks[0].mean(0), msg="emulated DP: running_mean from chunk 0 only")
assert_close(bn_emu.running_var, 0.9 + 0.1 * chunks[0].var(0, unbiased=True), msg="emulated DP: running_var from chunk 0 only")
assert not torch.allclose(bn_emu.running_mean, bn_one.running_mean), "DP's running_mean should differ from the global batch's"
print(f"EMULATED DP on {world_size} devices: running_mean {bn_emu.running_mean.numpy().round(4)} "
      f"(chunk 0 only) vs global batch {bn_one.running_mean.numpy().round(4)}")
if n_gpus == 0:
    bn_cpu = nn.BatchNorm1d(bn_channels, dtype=torch.float64)
    dp = nn.DataParallel(bn_cpu)
    assert dp.device_ids == [], f"no GPU: DataParallel should have no devices, got {dp.device_ids}"
    assert_close(dp(x_global).detach(), out_global.detach(), msg="DP on CPU is the plain module: whole-batch BatchNorm")
    assert_close(bn_cpu.running_mean, bn_one.running_mean, msg="DP on CPU: whole-batch running statistics")
    display(Markdown("**GPU branch SKIPPED** (no GPU): real DataParallel on several devices; on CPU `nn.DataParallel` "
                     "has no devices and called the module once on the whole batch (checked above)."))
else:
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
# broadcasts rank 0's parameters and buffers: `broadcast_buffers=False` (deprecated) skips
# the buffers there too, `forward_sync_buffers=False` does not (the text of the
# `FutureWarning`).
#
# **Claim:** a BatchNorm whose buffers already differ per rank (one local forward) keeps its
# **own** buffers when wrapped with `broadcast_buffers=False`, and holds **rank 0's** after
# `DDP(..., forward_sync_buffers=False)` (the worker above did both).

# %%
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
# ## 6. Checkpoints
#
# The worker: `DDP(Linear(4, 2))`, SGD with momentum 0.9. It first tries a strict
# `load_state_dict` of the **wrapper's** state dict into a bare `Linear`. Then the recipe of
# the [DDP tutorial](https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints):
# train `ckpt_steps` steps; **rank 0 alone** saves `ddp.module.state_dict()` and the optimizer
# state; `dist.barrier()` (nobody reads before the file is complete); every rank loads with
# `map_location=<its device>` into a fresh bare model, wraps it again and restores the
# optimizer. Both the original and the resumed run then take `ckpt_steps` more steps on the
# same data. The directory is a `tempfile.TemporaryDirectory`, removed after the launch.

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
with tempfile.TemporaryDirectory(prefix="ddp-lab-nb06-") as ckpt_dir:
    CK = launch(checkpoint_worker, world_size, ckpt_dir, backend="gloo", timeout=120)
launch_s["6 checkpoints"] = time.perf_counter() - t0
assert not Path(ckpt_dir).exists(), f"the temporary checkpoint directory {ckpt_dir} should be gone"

# %% [markdown]
# **Claim:** the wrapper's `state_dict()` keys carry the `module.` prefix (`module.weight`,
# `module.bias`); a strict `load_state_dict` of it into a bare `Linear` fails with **2
# missing** (`weight`, `bias`) and **2 unexpected** (`module.weight`, `module.bias`) keys.
# `consume_prefix_in_state_dict_if_present(sd, "module.")` repairs such a file; better, save
# `ddp.module.state_dict()` in the first place.
#
# **Claim:** every rank saw exactly one file, `checkpoint.pt`, after the barrier (only rank 0
# wrote it: its `saved checkpoint.pt` line is the one in the launch output), every rank loaded
# step `ckpt_steps`, and since model **and optimizer** state (momentum) were saved, the resumed
# run's parameters are **bit-identical** to the uninterrupted run's, on every rank.

# %%
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
# ## 7. Evaluation and logging
#
# **Right way:** evaluate `ddp.module` (the bare model) on each rank's shard, all-reduce the
# **sums** `[loss_sum, correct, count]`, divide once, print on rank 0 only (the
# `[rank 0] validation: ...` line in the launch output). Because ranks' BatchNorm running
# statistics differ after training (section 5), the worker first broadcasts rank 0's buffers.
#
# **A forward through the wrapper on rank 0 alone.** Folklore says it hangs. In torch 2.14.1
# it hangs **when that forward starts a collective**, and for a plain training setup that
# happens in two cases (others exist, e.g. inside a `Join` context):
#
# * the model has **buffers** (BatchNorm), `forward_sync_buffers` / `broadcast_buffers` is
#   `True` (the default), and the previous forward ran with gradients enabled (training): DDP's
#   forward begins by broadcasting rank 0's buffers (`_pre_forward` -> `_sync_buffers` in
#   `torch/nn/parallel/distributed.py`). `ddp.eval()` and `torch.no_grad()` do **not** prevent
#   it. Rank 0 is the broadcast's source and waits for receivers;
# * gradients are enabled and this is the first forward after the **first** backward: DDP
#   rebuilds its buckets once, and rank 0 broadcasts the new bucket order
#   (`Reducer::rebuild_buckets` -> `sync_bucket_indices`). After the second step it has
#   already happened and the same call returns.
#
# The worker tries five cases, each on its own short-timeout group; only rank 0 calls forward.

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
    """Sums, so ranks can all-reduce them and divide once: {"loss_sum", "correct", "count"} (floats)."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
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
    totals = torch.tensor([local["loss_sum"], local["correct"], local["count"]], dtype=torch.float64)
    dist.all_reduce(totals)  # sums, then divide once
    loss, acc = float(totals[0] / totals[2]), float(totals[1] / totals[2])
    if rank == 0:
        print(f"validation: loss {loss:.4f}, accuracy {acc:.3f} over {int(totals[2])} samples (all ranks)")
    return {"state_dict": {k: cpu(v) for k, v in model.state_dict().items()}, "local": local,
            "global": {"loss": loss, "accuracy": acc},
            "hang_cases": {case: eval_hang_case(rank, case, timeout_s) for case in EVAL_HANG_CASES}}

# %% [markdown]
# One launch: worker start-up plus two `collective_timeout_s` waits.

# %%
t0 = time.perf_counter()
E = launch(evaluation_worker, world_size, T, backend="gloo", timeout=120)
launch_s["7 evaluation"] = time.perf_counter() - t0

# %% [markdown]
# **Claim:** the all-reduced loss and accuracy equal one process evaluating the whole
# validation set with rank 0's weights, and every rank holds the same numbers.

# %%
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
# **Claim:** a forward through the wrapper on rank 0 alone waits until the group's timeout
# (`collective_timeout_s`; the seconds it waited are in the table) for
# the BatchNorm model (even under `eval()` and `no_grad()`) and for the `Linear` with gradients
# enabled after one step; `ddp.module` of the BatchNorm model, the `Linear` under `no_grad`, and
# the `Linear` with gradients after two steps return (no collective involved).

# %%
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

# %% [markdown]
# ## 8. Seeds and determinism
#
# `seeded_training` trains `Linear(16, 1)` for `seed_steps` SGD steps on a fixed global batch
# of 64 samples split into contiguous blocks over the ranks (rank `r` takes rows
# `r 64 / world_size ...`), initialised from `torch.manual_seed(seed)` on every rank. With
# `augment=True` each rank adds Gaussian noise to its inputs, drawn from its own generator
# seeded with `seed + 1000 + rank` (per-rank augmentation seeds). With `world_size == 1` it
# trains the plain model in this kernel: the single-process run to compare with.

# %%
seed_batch, seed_features, aug_std = 64, 16, 0.5


def seeds_data():
    """The fixed global batch: x (64, 16) float32, y (64, 1)."""
    x = torch.randn(seed_batch, seed_features, generator=torch.Generator().manual_seed(seed + 2024))
    return x, x @ torch.linspace(-1.0, 1.0, seed_features).reshape(-1, 1) + 0.5


def seed_model(s):
    torch.manual_seed(s)
    return nn.Linear(seed_features, 1)


def seeded_training(rank, world_size, augment):
    """{"init", "final": {name: tensor}, "loss": [clean full-batch MSE before each step and after the last]}."""
    device = worker_device()
    x, y = (t.to(device) for t in seeds_data())
    per = seed_batch // world_size
    xr, yr = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    model = seed_model(seed).to(device)
    init = params(model)
    net = wrap(model) if world_size > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    losses = []
    for _ in range(seed_steps):
        with torch.no_grad():
            losses.append(float(mse(model(x), y)))
        inp = xr + aug_std * torch.randn(xr.shape, generator=gen).to(device) if augment else xr
        opt.zero_grad(set_to_none=True)
        mse(net(inp), yr).backward()
        opt.step()
    with torch.no_grad():
        losses.append(float(mse(model(x), y)))
    return {"init": init, "final": params(model), "loss": losses}


# %%
def seeds_worker(rank, world_size):
    out = {"init_same_seed": params(seed_model(seed))}
    model = seed_model(seed + rank)
    out["init_rank_seed"] = params(model)
    wrap(model)  # DDP's constructor broadcasts rank 0's parameters and buffers
    out["init_rank_seed_after_ddp"] = params(model)
    shape = (2, seed_features)
    out["noise_rank_seed"] = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1000 + rank))
    out["noise_same_seed"] = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1000))
    out["plain"] = seeded_training(rank, world_size, augment=False)
    out["augmented"] = seeded_training(rank, world_size, augment=True)
    return out

# %% [markdown]
# One launch; then the same training in this kernel with
# `world_size = 1`.

# %%
t0 = time.perf_counter()
S = launch(seeds_worker, world_size, backend="gloo", timeout=120)
launch_s["8 seeds"] = time.perf_counter() - t0
one = {aug: seeded_training(0, 1, augment=aug) for aug in (False, True)}  # world size 1, in this kernel
pnames = list(one[False]["init"])

# %% [markdown]
# **Claim:** model initialisation from the **same** seed is bit-identical on every rank and at
# every world size (the kernel's world-size-1 run included). It does not even matter for DDP's
# parameters: initialised from `seed + rank` they differ before wrapping, and `DDP(model)`
# broadcasts rank 0's parameters (and buffers) at construction, so afterwards every rank holds
# rank 0's. Data augmentation is the opposite: with the same generator seed on every rank,
# every rank draws the **same** noise (ranks apply identical "random" perturbations); seed it
# with `seed + rank`.

# %%
for r, s in enumerate(S):
    for n in pnames:
        assert torch.equal(s["init_same_seed"][n], one[False]["init"][n]), f"rank {r}: same seed should give the same {n}"
        assert torch.equal(s["init_rank_seed_after_ddp"][n], S[0]["init_rank_seed"][n]), f"rank {r}: after DDP {n} should be rank 0's"
    assert torch.equal(s["noise_same_seed"], S[0]["noise_same_seed"]), f"rank {r}: same-seed noise should be identical"
    if r > 0:
        assert not torch.equal(s["init_rank_seed"]["weight"], S[0]["init_rank_seed"]["weight"]), "per-rank seeds: different init"
        assert not torch.equal(s["noise_rank_seed"], S[0]["noise_rank_seed"]), "per-rank seeds: different noise"
print(f"same seed: identical init on {world_size} ranks and in this kernel; after DDP(seed + rank init) every rank holds rank 0's")

# %% [markdown]
# **Claim:** float32 addition is not associative, so the same numbers summed in a different
# order can differ. `[1e8, 1, -1e8, 1]` (float32 has a 24-bit significand: `1e8 + 1` rounds
# back to `1e8`) sums to **1** left to right. Split over 2 ranks, each
# summing its part before the all-reduce adds the parts, the result depends on the split:
# **strided** parts (rank `r` takes items `r, r + 2`, as `DistributedSampler` deals them:
# `indices[rank::num_replicas]` in `torch/utils/data/distributed.py`) give
# `0 + 2 = 2`; **contiguous** halves (rank 0 items 0-1, rank 1 items 2-3, as this section
# splits its batch) give `1e8 + (-1e8) = 0`. The cell checks torch's float32 sums against
# numpy's float32 arithmetic, one addition at a time.

# %%
v = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.float32)
orders = {"left to right (one process)": float(v[0] + v[1] + v[2] + v[3]),
          "strided pairs (items r, r+2)": float(v[0::2].sum() + v[1::2].sum()),
          "contiguous halves (items 0-1, 2-3)": float(v[:2].sum() + v[2:].sum())}
f = np.float32
by_hand = {"left to right (one process)": ((f(1e8) + f(1)) + f(-1e8)) + f(1),
           "strided pairs (items r, r+2)": (f(1e8) + f(-1e8)) + (f(1) + f(1)),
           "contiguous halves (items 0-1, 2-3)": (f(1e8) + f(1)) + (f(-1e8) + f(1))}
assert orders == {k: float(x) for k, x in by_hand.items()}, (orders, by_hand)
assert list(orders.values()) == [1.0, 2.0, 0.0], orders
pd.Series(orders, name="float32 sum of [1e8, 1, -1e8, 1]").to_frame()

# %% [markdown]
# **Claim:** without augmentation, training on the fixed global batch split over `world_size`
# ranks ends bit-identical **across ranks** (they all apply the same all-reduced gradient) and
# equal to one process **up to float32 rounding**; bit-identical across world sizes is not
# guaranteed, because each rank sums its part first and the all-reduce adds the parts (above).
# With per-rank augmentation seeds the noise a sample gets depends on which rank holds it, so
# the run at `world_size` ranks and the run in one process follow different trajectories
# (parameters differ far beyond rounding): they are only **statistically** equivalent — both
# reach a similarly low loss.

# %%
rows = []
for key, aug in (("plain", False), ("augmented", True)):
    for r, s in enumerate(S):
        for n in pnames:
            assert torch.equal(s[key]["final"][n], S[0][key]["final"][n]), f"{key}: rank {r} not bit-identical to rank 0 ({n})"
    diff = max(float((S[0][key]["final"][n] - one[aug]["final"][n]).abs().max()) for n in pnames)
    n_diff = sum(int((S[0][key]["final"][n] != one[aug]["final"][n]).sum()) for n in pnames)
    n_all = sum(one[aug]["final"][n].numel() for n in pnames)
    l0, l_ddp, l_one = one[aug]["loss"][0], S[0][key]["loss"][-1], one[aug]["loss"][-1]
    if not aug:
        for n in pnames:
            assert_close(S[0][key]["final"][n], one[aug]["final"][n], msg=f"no augmentation: {n} should equal one process up to rounding")
    else:
        assert diff > 1e-3, f"per-rank augmentation: trajectories should differ beyond rounding (max diff {diff:g})"
        assert l_ddp < 0.2 * l0 and l_one < 0.2 * l0, f"both runs should learn: {l0:.3g} -> {l_ddp:.3g} / {l_one:.3g}"
        assert 0.5 < l_ddp / l_one < 2.0, f"final losses should be comparable: {l_ddp:.3g} vs {l_one:.3g}"
    rows.append({"augmentation": key, "ranks bit-identical": True,
                 f"max |Δparam| world_size {world_size} vs 1": diff, "elements that differ": f"{n_diff} of {n_all}",
                 "loss at start": l0, f"final loss, world_size {world_size}": l_ddp, "final loss, world_size 1": l_one})
pd.DataFrame(rows).set_index("augmentation")

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
for key, aug, color in (("plain", False, "tab:blue"), ("augmented", True, "tab:orange")):
    ax.plot(S[0][key]["loss"], color=color, label=f"{key}, world_size {world_size} (DDP)")
    ax.plot(one[aug]["loss"], color=color, linestyle="--", label=f"{key}, world_size 1")
ax.set_yscale("log")
ax.set_xlabel("SGD step")
ax.set_ylabel("MSE on the clean global batch\n(squared target units, log scale)")
ax.set_title("Same seeds, different world sizes: equal up to rounding without augmentation,\n"
             "only statistically equivalent with per-rank augmentation", fontsize=10)
fig.legend(loc="outside lower center", ncol=2, fontsize=8)  # below the axes: the curves fill the upper right
plt.show()

# %% [markdown]
# ## 9. Debugging
#
# ### Collective mismatches and `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# Rank `r` all-reduces a tensor of `2 + r` elements (ranks disagree about a length: a classic
# desynchronisation). `TORCH_DISTRIBUTED_DEBUG=DETAIL` (read when `torch.distributed` is
# imported, so it must be set before the processes start;
# [docs](https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications))
# wraps every process group in a checker that compares the collectives' "fingerprints"
# (operation, shapes, dtypes) across ranks before running them. The worker switches the same
# checker on for one group with `dist.set_debug_level(DebugLevel.DETAIL)` before
# `dist.new_group()`, and runs the mismatch on it and on a plain short-timeout group. One
# launch: worker start-up plus up to `collective_timeout_s`.

# %%
def debug_worker(rank, world_size, timeout_s):
    plain = short_timeout_group(timeout_s)
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        checked = dist.new_group()  # created under DETAIL: wrapped in the fingerprint checker
    finally:
        dist.set_debug_level(previous)
    out = {}
    for case, group in (("detail", checked), ("off", plain)):
        t = torch.ones(2 + rank, device=worker_device())
        try:
            dist.all_reduce(t, group=group)
            out[case] = f"no error; result {t.tolist()}"
        except RuntimeError as e:
            out[case] = error_text(e)
    return out


t0 = time.perf_counter()
D = launch(debug_worker, world_size, T, backend="gloo", timeout=120)
launch_s["9 mismatch"] = time.perf_counter() - t0

# %% [markdown]
# **Claim:** with the checker every rank raises `Detected mismatch between collectives on
# ranks`, naming its own shape. Without it nothing diagnoses the problem: gloo does not compare
# shapes, so rank 0 (2 elements) may return a result while another rank waits for elements
# that never come and times out.

# %%
for r, d in enumerate(D):
    assert "Detected mismatch between collectives on ranks" in d["detail"], f"rank {r}: {d['detail'][:200]}"
    assert f"TensorShape=[{2 + r}]" in d["detail"], f"rank {r}: its own shape should be named: {d['detail'][:300]}"
    assert "Detected mismatch" not in d["off"], f"rank {r}: without DETAIL nothing should diagnose the mismatch"
print("with DETAIL, rank 0 says:\n" + D[0]["detail"].replace("TensorDeviceTypes", "\n  TensorDeviceTypes")[:600] + " ...")
pd.DataFrame([{"rank": r, "tensor elements": 2 + r, "without DETAIL": d["off"].split("] ")[-1],
               "with DETAIL": d["detail"].split("Collectives differ in the following aspects:")[-1].strip()}
              for r, d in enumerate(D)]).set_index("rank")

# %% [markdown]
# ### A surprise: DETAIL breaks DDP's constructor (gloo, torch 2.14.1)
#
# DDP's constructor logs its set-up: `DistributedDataParallel._ddp_init_helper` calls
# `self.logger.set_construction_data_and_log(...)`. For gloo, `c10d::Logger::set_env_variables`
# (`torch/csrc/distributed/c10d/logger.cpp` in the torch source) reads gloo's thread count by
# `static_cast`-ing the group's gloo backend to `ProcessGroupGloo`. Started with
# `TORCH_DISTRIBUTED_DEBUG=DETAIL`, the default group's gloo backend is the debug wrapper
# instead (`_ProcessGroupWrapper`, which checks every collective), so the cast is wrong:
# **undefined behaviour**. What happens then depends on the process's memory layout, not on
# anything in your code: we have seen the rank killed by SIGSEGV (the same worker run from a
# Python script, and in this notebook with earlier versions of our launcher), and DDP built with
# a nonsense thread count in its log (in this notebook's kernel since then).
#
# **Claim:** without DETAIL, every rank's gloo backend is a `ProcessGroupGloo` and DDP logs
# gloo's real thread count (`ddp._get_ddp_logging_data()["gloo_num_threads"]`). With DETAIL,
# every rank's backend is a `_ProcessGroupWrapper`, and DDP's constructor either kills the rank
# with SIGSEGV (a `WorkerError` with `exc_type` `killed by SIGSEGV`, an empty Python traceback,
# and Python's fault handler's stack, relayed with the `[rank r]` prefix, in the line that calls
# `set_construction_data_and_log`) or logs a thread count that is not the real one. Either way
# the DETAIL run is broken, so on CPU use DETAIL for collective checks (as above) and
# `TORCH_DISTRIBUTED_DEBUG=INFO` (section 3) for DDP's unused-parameter names. Two launches.

# %%
def detail_ddp_worker(rank, world_size):
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    print(f"debug level: {dist.get_debug_level()}; the group's gloo backend: {type(backend).__name__}")
    ddp = wrap(nn.Linear(2, 2))
    return {"backend": type(backend).__name__, "gloo_num_threads": ddp._get_ddp_logging_data().get("gloo_num_threads")}


t0 = time.perf_counter()
reference = launch(detail_ddp_worker, world_size, backend="gloo", timeout=120)  # DETAIL off: the real values
before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
detail_error, detail_result = None, None
relayed = io.StringIO()  # the launcher relays worker stderr to ours: keep a copy to read it
with mock.patch.dict(os.environ, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}), contextlib.redirect_stderr(relayed), \
        contextlib.redirect_stdout(relayed):
    try:  # workers inherit this kernel's environment
        detail_result = launch(detail_ddp_worker, world_size, backend="gloo", timeout=120)
    except WorkerError as e:
        detail_error = e
launch_s["9 DETAIL"] = time.perf_counter() - t0
print(relayed.getvalue())
print(f"without DETAIL: {reference}")
assert os.environ.get("TORCH_DISTRIBUTED_DEBUG") == before, "the environment variable should be restored"
if torch.__version__.split("+")[0] == "2.14.1":
    real = reference[0]["gloo_num_threads"]
    assert all(r == {"backend": "ProcessGroupGloo", "gloo_num_threads": real} for r in reference), reference
    assert relayed.getvalue().count("the group's gloo backend: _ProcessGroupWrapper") == world_size, relayed.getvalue()
    if detail_error is not None:
        assert detail_error.exc_type == "killed by SIGSEGV", detail_error.exc_type
        assert detail_error.traceback == "", "a rank killed by a signal has no Python traceback"
        print(f"WorkerError: rank {detail_error.rank}, exc_type {detail_error.exc_type!r}, "
              f"traceback {detail_error.traceback!r}")
        frames = re.findall(r'File "([^"]+distributed\.py)", line (\d+) in _ddp_init_helper', relayed.getvalue())
        assert "Segmentation fault" in relayed.getvalue() and frames, "the fault handler's stack should be relayed"
        path, line = frames[0][0], int(frames[0][1])
        source = "".join(linecache.getline(path, n) for n in range(line - 1, line + 2))
        assert "set_construction_data_and_log" in source, source
        print(f"this run: the rank crashed in {os.path.basename(path)}:{line}: {linecache.getline(path, line).strip()}")
    else:
        assert all(r["backend"] == "_ProcessGroupWrapper" for r in detail_result), detail_result
        logged = [r["gloo_num_threads"] for r in detail_result]
        assert any(n != real for n in logged), (logged, real)
        print(f"this run: DDP was built, logging gloo_num_threads {logged} per rank; gloo really runs {real}")
else:  # another torch version: report what happened instead of asserting 2.14.1's behaviour
    print(f"torch {torch.__version__}: DETAIL + DDP gave {detail_error or detail_result!r}")

# %% [markdown]
# ### Init timeouts, and reading a worker traceback
#
# `init_process_group` blocks until `world_size` processes have joined the rendezvous. A job
# whose `WORLD_SIZE` counts one process more than were started (a typo, a node that never
# came up) waits there, by default for 30 minutes (gloo). `init_alone_worker` is that process:
# started alone, it asks for a world of 2 with `timeout=collective_timeout_s`.
#
# **Claim:** the launcher relays the worker's exception as `WorkerError` with `rank = 0`,
# `exc_type = "DistStoreError"` and a message saying `1/2 clients joined` (the store reports one
# second more than `timeout`: "Timed out after 4 seconds" for 3). The relayed traceback shows
# where: a frame of `init_alone_worker`, then torch's rendezvous (`TCPStore`). Read a relayed
# traceback from the bottom (the exception) up to the **last frame in your own code**. A
# function defined in a cell travels to the worker with its cell's file name and source lines,
# so that frame names this kernel's cell file and shows our call to `init_process_group`, the
# same line this kernel's `linecache` holds. (Shown in a cell, the `WorkerError` lists only
# such frames of your own; `.traceback` keeps every frame.) The launch takes one worker's
# start-up plus the timeout.

# %%
def init_alone_worker(rank, world_size, timeout_s):
    dist.destroy_process_group()  # the launcher's group; now a job of world_size + 1 processes
    port = free_port()
    print(f"init_process_group(world_size={world_size + 1}, rank={rank}, timeout={timeout_s} s) at port {port} ...")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size + 1, timeout=datetime.timedelta(seconds=timeout_s))


t0 = time.perf_counter()
init_error = None
try:
    launch(init_alone_worker, 1, T, backend="gloo", timeout=120)
except WorkerError as e:
    init_error = e
launch_s["9 init timeout"] = time.perf_counter() - t0
assert init_error is not None, "init_process_group with a missing rank should have failed"
assert (init_error.rank, init_error.exc_type) == (0, "DistStoreError"), (init_error.rank, init_error.exc_type)
assert "waiting for clients" in init_error.message and "1/2 clients joined" in init_error.message, init_error.message
reported_s = int(init_error.message.split("Timed out after ")[1].split(" seconds")[0])
assert reported_s == round(T) + 1, f"the store reports {reported_s} s for a {T:g} s timeout"
tb = init_error.traceback
cell_file = init_alone_worker.__code__.co_filename
# the worker names this kernel's cell file, and shows the cell's line from the source sent with it
ours = re.findall(rf'File "{re.escape(cell_file)}", line (\d+), in init_alone_worker', tb)
assert ours and "TCPStore" in tb.split("in init_alone_worker")[-1], tb[-1500:]
relayed_next = tb.split(f'line {ours[-1]}, in init_alone_worker\n')[1].splitlines()[0].strip()
assert relayed_next.startswith("dist.init_process_group("), f"the worker's line for the cell's frame: {relayed_next}"
our_line = linecache.getline(cell_file, int(ours[-1])).strip()  # this kernel has the cell's source
assert our_line == relayed_next, (our_line, relayed_next)
print(f"launch -> WorkerError after {launch_s['9 init timeout']:.1f} s (timeout {T:g} s): rank {init_error.rank}, "
      f"{init_error.exc_type}: {init_error.message}")
print("last line of the relayed traceback:", tb.strip().splitlines()[-1])
print(f"last frame in our code, as relayed: line {ours[-1]}, in init_alone_worker; next line: {relayed_next}")
print(f"line {ours[-1]} of that cell, from this kernel's linecache: {our_line}")

# %%
total_s = time.perf_counter() - t_notebook
print(f"notebook 06 ran in {total_s:.0f} s; seconds per launch (start-up included; the hang demonstrations include "
      f"their deliberate timeouts, collective_timeout_s = {T:g} s, hang_timeout_s = {hang_timeout_s:g} s):")
pd.Series(launch_s, name="seconds").round(1).to_frame()

# %% [markdown]
# ## What we saw
#
# * **Accumulation:** `no_sync()` on all micro-batches but the last gives exactly the
#   large-batch gradient with `k` times fewer all-reduced bytes (counted with a comm hook). The
#   forward decides whether a backward all-reduces. Syncing the wrong micro-batch raises
#   nothing and makes the replicas diverge after one step.
# * **Uneven inputs:** the rank with an extra batch waits forever in its all-reduce (here:
#   until a short timeout, or until `LaunchTimeout`); `Join` completes it, and
#   `divide_by_initial_world_size` decides whether the joined ranks count as zeros (divide by
#   `world_size`) or not (divide by the ranks still training).
# * **Unused parameters:** the first iteration "works" with un-averaged gradients; the error
#   comes one iteration later and names parameter indices (names with
#   `TORCH_DISTRIBUTED_DEBUG=INFO`). `find_unused_parameters=True` fixes it; `static_graph=True`
#   only if the unused output is not returned (pytorch #97030).
# * **Unequal batch sizes:** DDP averages ranks, not samples; `sum * world_size / N` restores
#   the global mean.
# * **BatchNorm:** `broadcast_buffers=True` leaves rank 0's running statistics computed from
#   rank 0's data alone (torch 2.14.1 renames it `forward_sync_buffers`, which unlike
#   `broadcast_buffers=False` still broadcasts at construction); `SyncBatchNorm` (GPU only;
#   its CPU error shown) equals BatchNorm on the global batch; DataParallel normalises per
#   chunk and keeps chunk 0's statistics.
# * **Checkpoints:** save `ddp.module.state_dict()` (no `module.` prefix) and the optimizer on
#   rank 0, barrier, load with `map_location`: resuming is bit-identical on every rank.
# * **Evaluation:** evaluate `ddp.module`, all-reduce sums, print on rank 0. A forward through
#   the wrapper on one rank hangs only when it starts a collective (buffer broadcast, bucket
#   rebuild): a BatchNorm model after training hangs even under `eval()` and `no_grad()`.
# * **Seeds:** same-seed init is bit-identical everywhere (and DDP broadcasts rank 0's anyway);
#   augmentation needs per-rank seeds; results are bit-identical across ranks, equal up to
#   rounding across world sizes (the order of float32 additions depends on how the batch is
#   split), and only statistically equivalent once per-rank randomness enters.
# * **Debugging:** DETAIL catches collective mismatches — and, with gloo in torch 2.14.1,
#   breaks DDP's constructor (undefined behaviour: a crash or a wrong log); short `timeout`s turn hangs into errors you can read; read a
#   relayed traceback from the bottom up to your own code.
#
# ## Going further
#
# Launch `helpers.engine.faults.fail_at` with `moment="during"` and `helpers.engine.faults.skip_collective`
# (with a short `timeout`); for each, read `WorkerError.rank`, `.exc_type` and the last frame of
# `.traceback` in your own code, or `LaunchTimeout.ranks_not_finished`, and say which rank was
# the root cause.
#
# ## Exercises
#
# Exercises 1 and 2 ask for code: define your function in the answer cell, set `answer_N` to it
# (replacing `None`) and run the check cell below it, which runs your function on `world_size`
# real ranks (`check_answer(..., run=...)`). Exercises 3-5
# ask for a value: predict it by hand first. Each check cell prints "correct" or "not yet" with a
# hint. In the full notebook a solution follows each check, collapsed (click the "…" or the bar on its
# left to open it); student copies leave the solutions out. Every solution runs when the full
# notebook runs, so each is known to pass its check.

# %% [markdown]
# ### Exercise 1: fix the accumulation loop
#
# This loop is meant to accumulate `k` micro-batches with `no_sync()` on all but the last, as
# `no_sync_all_but_last` in section 1 does; it has an off-by-one bug:
#
# ```python
# def my_accumulate(ddp, micro):
#     k = len(micro)
#     for j, (x, y) in enumerate(micro):
#         with ddp.no_sync() if j < k else contextlib.nullcontext():
#             (mse(ddp(x), y) / k).backward()
# ```
#
# Copy it into the answer cell, fix it, and set `answer_1 = my_accumulate`. The check cell runs
# your loop with section 1's `accumulation_worker` on `world_size` ranks and compares the
# all-reduces per optimizer step and every rank's gradient with one
# process on the whole global batch.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% tags=["check"]
# expected: 1 all-reduce per optimizer step, and on every rank the gradient of ONE process on the whole global batch
expected_1 = {"all-reduces per step": 1, "gradient == one process, on every rank": True}


def accumulation_summary(results, name):  # what loop `name` did on the ranks, in expected_1's terms
    return {"all-reduces per step": results[0][name]["calls"],
            "gradient == one process, on every rank": all(torch.allclose(res[name]["grad"], ref_grad) for res in results)}


def run_1(loop):  # your loop, on world_size real ranks
    summary = accumulation_summary(launch(accumulation_worker, world_size, accum_steps, {"yours": loop},
                                          backend="gloo", timeout=120), "yours")
    print(f"your loop: {summary}")
    return summary


check_answer("ex1", answer_1, expected_1, run=run_1,
             hint="for which j is `j < k` False? The LAST micro-batch must run outside no_sync().")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# `j < k` holds for every j in 0..k-1: no backward ever synchronises, so each rank keeps its own local
# gradient (0 all-reduces) and the replicas diverge at the first step. `j < k - 1` leaves the last one out.
def buggy_accumulate(ddp, micro):
    k = len(micro)
    for j, (x, y) in enumerate(micro):
        with ddp.no_sync() if j < k else contextlib.nullcontext():
            (mse(ddp(x), y) / k).backward()


def fixed_accumulate(ddp, micro):
    k = len(micro)
    for j, (x, y) in enumerate(micro):
        with ddp.no_sync() if j < k - 1 else contextlib.nullcontext():
            (mse(ddp(x), y) / k).backward()


both = launch(accumulation_worker, world_size, accum_steps, {"buggy": buggy_accumulate, "fixed": fixed_accumulate},
              backend="gloo", timeout=120)
assert both[0]["buggy"]["calls"] == 0, "the buggy loop never synchronises"
assert not any(torch.allclose(b["buggy"]["grad"], ref_grad) for b in both), "so no rank holds the global gradient"
solution_1 = accumulation_summary(both, "fixed")
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: a loss that gives the global mean
#
# Rank `r` holds `r + 1` samples, as in section 4. Write `my_loss(per_sample, world_size)`:
# `per_sample` is this rank's `(n_local,)` float64 tensor of per-sample losses (on the rank's
# device), and nobody hands you the global sample count. Return a scalar such that, after DDP
# averages the gradients over the ranks, every rank holds the gradient of the **global mean**
# over all samples. (Hint: a collective in the loss is fine, as long as every rank calls it.)
# Set `answer_2 = my_loss`. The check cell runs it on `world_size` ranks; `per_sample.mean()`,
# the naive loss, gives section 4's mean of rank means.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% tags=["check"]
def exercise2_worker(rank, world_size, losses):
    """{name: the gradient of w on this rank after one backward of loss_fn(per_sample, world_size)}."""
    x = unequal_shards(world_size)[rank].to(worker_device()).reshape(-1, 1)
    out = {}
    for name, loss_fn in losses.items():
        model = scalar_model()
        ddp = wrap(model)
        loss_fn(ddp(x).pow(2).flatten(), world_size).backward()
        out[name] = model.weight.grad.item()
    return out


# expected: every rank holds section 4's exact global mean 2 sum(x^2) / N
expected_2 = [float(global_mean)] * world_size


def run_2(loss_fn):  # your loss, on world_size real ranks: the gradient each rank holds
    got = [g["yours"] for g in launch(exercise2_worker, world_size, {"yours": loss_fn}, backend="gloo", timeout=120)]
    print(f"gradient on each rank with your loss: {got}")
    return got


check_answer("ex2", answer_2, expected_2, run=run_2,
             hint="all-reduce the local sample count to get N, then return sum * world_size / N")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# DDP divides each rank's gradient by world_size, then sums them, so the loss is the local SUM times world_size / N, with N
# the global count from an all-reduce (every rank calls it, so it cannot hang).
def global_mean_loss(per_sample, world_size):
    n_total = torch.tensor(float(per_sample.numel()), dtype=per_sample.dtype, device=per_sample.device)
    dist.all_reduce(n_total)
    return per_sample.sum() * world_size / n_total


both = launch(exercise2_worker, world_size, {"naive": lambda per_sample, ws: per_sample.mean(), "fixed": global_mean_loss},
              backend="gloo", timeout=120)
assert_close([g["naive"] for g in both], [float(mean_of_rank_means)] * world_size, msg="the naive loss: the mean of rank means")
solution_2 = [g["fixed"] for g in both]
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: Join on 4 ranks
#
# Section 2 with `world_size = 4`: rank `r` has `2 + r` batches (rank 3: 31, 32, 33, 34,
# 35) and the loop runs inside `Join([ddp], divide_by_initial_world_size=False)`. What
# gradient does rank 3 hold after each of its 5 steps? Answer with a list of 5 numbers.

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% tags=["check"]
# expected: section 2's rule (sum over the ranks that still have a batch / their number), for 4 ranks
inputs4 = [[float(10 * r + i + 1) for i in range(base_batches + r)] for r in range(4)]
expected_3 = [sum(inp[i] for inp in inputs4 if len(inp) > i) / sum(len(inp) > i for inp in inputs4) for i in range(5)]
if world_size == 4:  # this run launched 4 real ranks: DDP under Join must agree
    assert_close(J[3]["join_divide_active"]["grads"], expected_3, msg="rank 3 under Join, 4 ranks")
check_answer("ex3", answer_3, expected_3,
             hint="at step i, which ranks still have a batch, and what does divide_by_initial_world_size=False divide by?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# Rank r's batch i is 10 r + i + 1. Steps 0 and 1: all 4 ranks; step 2: ranks 1-3 (rank 0 has
# joined); step 3: ranks 2-3; step 4: rank 3 alone. Divide by the ranks still training.
solution_3 = [(1 + 11 + 21 + 31) / 4, (2 + 12 + 22 + 32) / 4, (13 + 23 + 33) / 3, (24 + 34) / 2, 35 / 1]
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# ### Exercise 4: unequal batch sizes on 4 ranks
#
# Section 4 with `world_size = 4`: rank `r` holds `r + 1` of the samples `1, 2, ..., 10`
# (`[1]`, `[2, 3]`, `[4, 5, 6]`, `[7, 8, 9, 10]`), each rank uses the **mean** of the
# per-sample losses `(w x)^2` at `w = 1`. What gradient does DDP give every rank? Answer
# with a number (4 significant digits are enough) or a fraction as text, such as `"7/12"`.

# %% tags=["exercise"]
answer_4 = None  # your answer here

# %% tags=["check"]
# expected: the average of the four ranks' mean-loss gradients 2 mean(x^2), from section 4's shards
expected_4 = float(sum(2 * (s**2).mean() for s in unequal_shards(4)) / 4)
if world_size == 4:  # this run launched 4 real ranks
    assert_close(Q[0]["naive"], expected_4, msg="DDP's gradient with per-rank mean losses, 4 ranks")
check_answer("ex4", answer_4, expected_4, rel_tol=1e-3,
             hint="each rank's mean-loss gradient is 2 * mean(x^2) over its own samples; DDP averages the 4")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 4 (try the exercise first)
shards4 = [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]]
rank_grads = [Fraction(2 * sum(v * v for v in sh), len(sh)) for sh in shards4]  # 2, 13, 154/3, 147
solution_4 = sum(rank_grads) / 4  # 160/3, about 53.33
print(f"DDP: {solution_4} = {float(solution_4):.4f}; global mean: {Fraction(2 * sum(v * v for sh in shards4 for v in sh), 10)}")
check_answer("ex4", solution_4, expected_4, strict=True)

# %% [markdown]
# ### Exercise 5: bytes all-reduced with k = 8
#
# Section 1's model (`Linear(4, 1)` in `float64`, one bucket) with `accum_steps = 8`: how
# many bytes does each rank all-reduce per optimizer step when it synchronises every
# micro-batch, and with `no_sync()` on all micro-batches but the last? Answer with a list
# of two ints.

# %% tags=["exercise"]
answer_5 = None  # your answer here

# %% tags=["check"]
# expected: the bytes of ONE all-reduce measured by the counting hook in this run, times the
# number of all-reduces each loop makes with k = 8
one_allreduce = acc[0]["no_sync_all_but_last"]["bytes"]  # exactly one all-reduce
expected_5 = [8 * one_allreduce, 1 * one_allreduce]
if k == 8:  # this run used accum_steps = 8: the measured values must agree
    assert expected_5 == [acc[0]["sync_every_micro_batch"]["bytes"], one_allreduce]
check_answer("ex5", answer_5, expected_5,
             hint="count the parameters, their bytes, and how many backward passes all-reduce")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 5 (try the exercise first)
# Linear(4, 1) has 4 weights + 1 bias = 5 parameters of 8 bytes (float64): 40 bytes per
# all-reduce. Synchronising every micro-batch: 8 all-reduces; no_sync on 7 of them: 1.
solution_5 = [8 * 5 * 8, 1 * 5 * 8]
check_answer("ex5", solution_5, expected_5, strict=True)
