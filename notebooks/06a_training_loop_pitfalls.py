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
# # 06a · DDP training-loop pitfalls: accumulation, uneven inputs, unused parameters, batch sizes
#
# <!-- opening:start -->
# **You will be able to** fix accumulation (`no_sync`), uneven inputs (`Join`), unused parameters. **You need** [04 MNIST: single, DP, DDP](04_mnist_single_dp_ddp.ipynb).
# <!-- opening:end -->
#
# **The question:** once `DistributedDataParallel` (DDP) runs at all, which mistakes in the
# training loop make it hang, crash or, worse, silently train the wrong thing? And how do we
# *prove* each fix?
#
# Four pitfalls, each in the same shape. The experiment runs on real ranks with `launch`. We see
# the symptom as a learner meets it; a short timeout ends any hang. Then comes the fix. Each bold
# "Claim:" is asserted by the folded code cell after it, tagged `check`.
#
# 1. gradient accumulation with `no_sync()` · 2. uneven inputs and `Join` · 3. unused
# parameters · 4. unequal per-rank batch sizes
#
# **What runs where:** each experiment is one short launch of `world_size` processes. The backend
# is `gloo` on CPU, with or without GPUs. It is pinned: the hang demonstrations need gloo's
# catchable timeout.
#
# Terms, see the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [process group](../docs/GLOSSARY.md#process-group), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [bucket](../docs/GLOSSARY.md#bucket), [DDP](../docs/GLOSSARY.md#ddp).
#
# **New here:** DDP communication hooks to count all-reduces, `Join`, `find_unused_parameters`
# and `static_graph`, `TORCH_DISTRIBUTED_DEBUG=INFO`. Every claim was checked against torch
# 2.14.1. Where torch differs from folklore, the lesson says what really happens.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 2  # DDP ranks (processes) of every launch; 2 or more
accum_steps = 4  # k, micro-batches per optimizer step in section 1
collective_timeout_s = 2.0  # seconds a rank waits in a hung collective before gloo raises
hang_timeout_s = 2.0  # launch timeout of section 2's hang, which the launcher itself ends

# %%
from helpers.notebook import check_answer, check_parameters, check_value

seed = 0  # seeds every model and data set

check_parameters(world_size=(world_size, int), accum_steps=(accum_steps, int),
                 collective_timeout_s=(collective_timeout_s, float),
                 hang_timeout_s=(hang_timeout_s, float))
check_value("world_size", world_size, world_size >= 2, "2 or more (one rank has nobody to disagree with)")
check_value("accum_steps", accum_steps, accum_steps >= 2, "at least 2 (no_sync needs a micro-batch to skip)")

# %%
import contextlib
import re
import time
from fractions import Fraction

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.testing import assert_close

from helpers.captured import captured_output, show_folded
from helpers.engine import LaunchTimeout, launch, leftover_children, worker_device

t_notebook = time.perf_counter()
T = collective_timeout_s
n_gpus = torch.cuda.device_count()
mse = nn.functional.mse_loss
launch_s = {}  # seconds of every launch, by section (printed at the end)
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; world_size = {world_size}")

# %% [markdown]
# ## 0. Tools every section uses
#
# Each experiment is a function `fn(rank, world_size, ...)` defined in a cell.
# `launch(fn, world_size, ..., backend="gloo")` starts `world_size` new processes and
# initialises the default process group in each. It returns the ranks' results as a list, rank 0
# first. Worker prints appear under the cell, prefixed `[rank r]`.
#
# **How a hang is shown without hanging the notebook.** A section that shows a hang builds its
# DDP model on a fresh process group, made by `dist.new_group(timeout=...)`. A rank left waiting
# in one of its collectives gets gloo's timeout error after `collective_timeout_s` seconds. It
# catches the error and returns it as text. A real job would wait for gloo's default, 30 minutes.
#
# With NCCL a timed-out collective does not raise: a watchdog tears the process down. The
# `timeout` argument of
# [`init_process_group`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group)
# says so. That is why this lesson pins `backend="gloo"`. The next cell shows the small tools
# every section uses.

# %%
# The tools live in helpers/ddp_tools.py, so that lessons 06b and 06c import these same ones.
import inspect

import helpers.ddp_tools
from helpers.ddp_tools import bytes_written, cpu, error_text, grads, is_timeout_error, short_timeout_group, wrap

print(inspect.getsource(helpers.ddp_tools).split("\n\n\n", 1)[1])  # the functions, less the imports

# %% [markdown]
# ## 1. Gradient accumulation with `no_sync()`
#
# Accumulating `k` micro-batches before one optimizer step is the usual way to get a large
# global batch on little memory. Under DDP every backward all-reduces the gradients. Inside
# `ddp.no_sync()` it does not. The next synchronised backward then all-reduces the
# **accumulated** gradients.
#
# The toy model is `Linear(4, 1)` in `float64` with an MSE loss. Each rank takes
# `k = accum_steps` micro-batches of 2 samples: rank `r` takes the contiguous rows `r k 2` to
# `(r + 1) k 2 - 1` of the global batch. Each micro-batch loss is divided by `k`. So the `k`
# gradients add up to the mean over the rank's `k * 2` samples.

# %%
features, micro_batch, lr = 4, 2, 0.1


def accumulation_batch(world_size, k):
    """One optimizer step's global batch: x (world_size*k*micro_batch, features) float64, y (same, 1)."""
    g = torch.Generator().manual_seed(seed + 11)
    n = world_size * k * micro_batch
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    w = torch.randn(features, 1, generator=g, dtype=torch.float64)
    return x, x @ w + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)

# %% [markdown]
# **How communication is measured.** DDP calls a communication hook once per **bucket** ready to
# be all-reduced; see the [docs](https://pytorch.org/docs/stable/ddp_comm_hooks.html). Ours,
# `counting_allreduce_hook`, counts the calls and the bucket's bytes. Then it calls torch's
# default `allreduce_hook`, so the gradients do not change. The worker also counts the bytes each
# rank really sends: `bytes_written()` from section 0 reads the kernel's count of the process's
# writes, gloo's socket sends included. Each of six loops runs on a fresh model for one optimizer
# step.

# %%
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
        before = bytes_written()
        loop(ddp, micro)
        after = bytes_written()  # both None where /proc/self/io is missing
        grad = torch.cat([cpu(model.weight.grad).flatten(), cpu(model.bias.grad)])
        opt.step()
        out[name] = {"grad": grad, "calls": counter["calls"], "bytes": counter["bytes"], "weight_after": cpu(model.weight),
                     "sent": None if before is None else after - before}
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
# One launch runs the six loops on `world_size` ranks. Most of its time is worker start-up. The
# reference is one process on the whole global batch, without DDP.

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
# This model fits in one bucket: 5 `float64` parameters, 40 bytes per all-reduce.
#
# **Claim:** `no_sync()` on micro-batches `0 .. k-2` and a synchronised last one gives the
# gradient of one batch `k` times larger, and of one process on the whole global batch. It takes
# **1** all-reduce per optimizer step instead of `k`. So each rank sends about `k` times fewer
# bytes over its sockets.
#
# **Claim:** synchronising every micro-batch gives the same gradient too, at `k` times the
# communication. Averaging already-averaged values changes nothing.
#
# **Claim:** **off by one**, a synchronised *first* micro-batch and `no_sync()` on the rest,
# raises nothing. Each rank holds `average(micro-batch 0) + its own micro-batches 1..k-1`, which
# the check computes in one process. The ranks' gradients differ, so after one SGD step the
# replicas **diverge**.
#
# The [`no_sync` docs](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync)
# warn: "The forward pass should be included inside the context manager, or else gradients will
# still be synchronized".
#
# **Claim:** the **forward** decides whether the next backward all-reduces. Forward outside,
# backward inside: `k` all-reduces, no saving, still correct. Forward inside, backward outside:
# 1 all-reduce, correct. The readable rule is the safe one: forward *and* backward inside.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: gradients, all-reduce counts, bytes sent and the off-by-one value of the six loops
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


def micro_grad(r, j):  # one process: the gradient of rank r's micro-batch j (loss / k) at the initial weights
    torch.manual_seed(seed)
    m = nn.Linear(features, 1, dtype=torch.float64)
    rows_r = slice(r * k * micro_batch, (r + 1) * k * micro_batch)
    (mse(m(x_all[rows_r].split(micro_batch)[j]), y_all[rows_r].split(micro_batch)[j]) / k).backward()
    return torch.cat([m.weight.grad.flatten(), m.bias.grad])


first_avg = sum(micro_grad(s, 0) for s in range(world_size)) / world_size
for r, a in enumerate(acc):
    off_by_one_value = first_avg + sum(micro_grad(r, j) for j in range(1, k))
    assert_close(a["off_by_one"]["grad"], off_by_one_value, msg=f"off by one, rank {r}: average(micro-batch 0) + own 1..k-1")
# bytes really sent: the same for each all-reduce, so about k times more without no_sync. Measured ratios
# were 1.01 k to 1.11 k (2 and 4 ranks, k = 4 and 8): gloo adds a few small writes per backward.
sent = [(a["sync_every_micro_batch"]["sent"], a["no_sync_all_but_last"]["sent"]) for a in acc]
if sent[0][0] is None:
    print("bytes sent: not measured here (no /proc/self/io: Linux only)")
else:
    for r, (many, once) in enumerate(sent):
        assert 0.9 * k <= many / once <= 1.25 * k, f"rank {r}: {many} bytes sent syncing every micro-batch, {once} with no_sync"
    print(f"bytes sent per optimizer step, rank 0: {sent[0][0]} syncing every micro-batch, {sent[0][1]} with no_sync: "
          f"{sent[0][0] / sent[0][1]:.2f}x")
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
# <a id="case-uneven-inputs-hang"></a>
# **Symptom:** it hangs when ranks have different numbers of batches.
#
# Rank `r` gets `2 + r` batches of one number each, `10 r + i + 1`. Rank 0 sees 1 and 2, rank 1
# sees 11, 12 and 13, and so on. The model is `y = w x` with `w = 1` and the loss `y.sum()`. So a
# rank's local gradient **is** its input, and the all-reduced gradient shows which ranks
# contributed.
#
# The same loop runs three times. The first run has no `Join` and uses a short-timeout group. The
# other two run inside
# [`Join([ddp], divide_by_initial_world_size=...)`](https://pytorch.org/docs/stable/distributed.algorithms.join.html),
# with `True`, the default, and with `False`. `ddp.join()` is the same context manager.

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
# The launch takes worker start-up plus `collective_timeout_s`: the ranks with an extra batch
# wait that long for rank 0.

# %%
t0 = time.perf_counter()
J = launch(join_worker, world_size, T, backend="gloo", timeout=120)
launch_s["2 join"] = time.perf_counter() - t0
inputs = [join_inputs(r) for r in range(world_size)]
print(f"{launch_s['2 join']:.1f} s")

# %% [markdown]
# Gloo's timeout error reads "Timed out waiting ... for recv/send operation to complete" or
# "Application timeout caused pair closure". The tool `is_timeout_error` accepts both.
#
# **Claim:** without `Join`, the first two steps all-reduce normally. The gradient at step `i` is
# the mean over ranks of `10 r + i + 1`, that is `5 (world_size - 1) + i + 1`: for 2 ranks 6,
# then 7. At step 2 rank 0 has left its loop and finished without error. Every other rank waits
# in the all-reduce and gets gloo's timeout error after `collective_timeout_s` seconds.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the first steps' gradients, then a timeout on every rank but rank 0
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
# A rank that has run out of batches *joins*: it shadows the others' all-reduces with zeros. Let
# `A_i` be the ranks that still have a batch at step `i`.
#
# **Claim:** the same loop inside `Join` completes on every rank. At step `i` the gradient is
# `sum(x) over A_i` divided by:
#
# | `divide_by_initial_world_size` | divided by | last rank's last step, 2 ranks |
# | --- | --- | --- |
# | `True`, the default | `world_size`: joined ranks count as zeros | `13 / 2 = 6.5` |
# | `False` | `len(A_i)`: the ranks still training | `13` |
#
# At its last step the last rank is alone, with the input `10 (world_size - 1) + world_size + 1`.
# So the default makes the update shrink as ranks run out of data.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank's gradient per step under Join, with both divisors
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
# **What the launcher sees.** The same loop without `Join` runs again, now on a group without a
# short timeout. Nothing raises inside the workers. The cell simply waits, as a real job would.
# After `hang_timeout_s` seconds `launch` gives up, ends every worker and raises `LaunchTimeout`.
# It names the ranks that never finished. Rank 0 may be among them if it was still busy: the
# timeout counts from when every rank runs the function.
#
# **Claim:** `launch` raises `LaunchTimeout`, listing every rank with an extra batch. It leaves no
# worker process behind.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: LaunchTimeout names the waiting ranks; no process is left
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
# tracker and launch's fork server (the ranks forked from it do count)
assert not leftover_children(), f"processes left behind: {leftover_children()}"
print("no worker process left behind")

# %% [markdown]
# ## 3. Unused parameters
#
# <a id="case-unused-parameters"></a>
# **Symptom:** Expected to have finished reduction in the prior iteration.
#
# `TwoHeads` has two `Linear(2, 2)` heads. `forward` returns both outputs, but the loss uses only
# `head_a`'s. Iteration `it` feeds `x = [rank + 1 + it] * 2`. So `head_a.weight`'s local gradient
# is `rank + 1 + it` in every entry. Its all-reduced gradient is the mean over ranks,
# `(world_size + 1) / 2 + it`.
#
# DDP numbers parameters in `model.parameters()` order: 0 `head_a.weight`, 1 `head_a.bias`,
# 2 `head_b.weight`, 3 `head_b.bias`. Five cases each train a fresh DDP model for three
# iterations, or until the first error. They try
# [`find_unused_parameters` and `static_graph`](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html).
# One also sets the debug level INFO with `dist.set_debug_level`, just for one DDP construction.
# That is the same as starting the process with `TORCH_DISTRIBUTED_DEBUG=INFO`.

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
# One launch. Its output, folded under one line, holds DDP's warning
# "find_unused_parameters=True was specified ... but did not find any unused parameters". Its
# search starts from the returned outputs and reaches `head_b` through the output the loss
# ignores. The gradients below show the run is right all the same.

# %%
t0 = time.perf_counter()
with captured_output() as unused_output:  # the workers' relayed warnings
    U = launch(unused_parameters_worker, world_size, backend="gloo", timeout=120)
launch_s["3 unused parameters"] = time.perf_counter() - t0
FALSE_ALARM = "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"
warned = [r for r in range(world_size) if any(line.startswith(f"[rank {r}]") and FALSE_ALARM in line
                                              for line in unused_output.getvalue().splitlines())]
show_folded(f"expected: DDP's warning \"{FALSE_ALARM} ...\" on ranks {warned}", unused_output.getvalue())

# %% [markdown]
# DDP all-reduces a bucket when all its parameters have gradients; `head_b`'s never arrive.
#
# **Claim:** with the default DDP the **first** iteration completes without any error. Its
# gradients were **not** averaged: rank `r` keeps its local `head_a` gradient `r + 1`. The
# **next** forward raises on every rank: `Expected to have finished reduction in the prior
# iteration ...`. It ends with `Parameter indices which did not receive grad for rank r: 2 3`.
#
# **Claim:** with the debug level INFO or DETAIL, the message also names them:
# `Parameters which did not receive grad for rank r: head_b.bias, head_b.weight`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: iteration 0 un-averaged, iteration 1 raises, with indices or names
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
# **Claim:** `find_unused_parameters=True` fixes it: three iterations complete. On every rank
# `head_b`'s gradients stay `None` and `head_a`'s are the average, `(world_size + 1) / 2 + it`.
#
# **Claim:** `static_graph=True` **works only if the unused head's output is not returned**, as
# with `TwoHeads(return_b=False)`. Then it gives the same gradients. With the model above, torch
# 2.14.1 averages iteration 0. It leaves iteration 1's `head_a` gradients **un-averaged**: rank
# `r` keeps its own, `r + 2`. Iteration 2 raises "... not compatible with static_graph set to
# True".
#
# This is [pytorch/pytorch issue #97030](https://github.com/pytorch/pytorch/issues/97030):
# `static_graph` is not a drop-in replacement for `find_unused_parameters`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: find_unused_parameters averages; static_graph only without the returned output
assert warned == list(range(world_size)), f"every rank should print DDP's false alarm once: ranks {warned}"
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
# Rank `r` holds `r + 1` samples of the global batch `1, 2, ..., N`, with
# `N = world_size (world_size + 1) / 2`. On 2 ranks that is `[1]` and `[2, 3]`. The model is
# `y = w x` at `w = 1`; the per-sample loss `y^2` has the gradient `2 x^2`.
#
# **The fix:** all-reduce the sample count `N` first, then use `loss = local sum * world_size / N`.
# DDP's `1 / world_size` cancels the `world_size` and leaves `global sum / N`, the global mean.
# The worker takes each loss as a function `loss_fn(per_sample, n_total, world_size)` and runs
# both.

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
# `(1 / world_size) sum_r 2 mean(x_r^2)`. That is not the global mean `2 sum(x^2) / N`. On 2
# ranks: `(2 + 13) / 2 = 7.5` against `28 / 3 = 9.33`. The weighted loss gives the global mean on
# every rank.
#
# The check computes both with exact fractions and the closed form
# `1^2 + ... + N^2 = N (N + 1) (2N + 1) / 6`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the mean of rank means against the global mean, exactly
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

# %%
total_s = time.perf_counter() - t_notebook
print(f"lesson 06a ran in {total_s:.0f} s; seconds per launch (start-up included; the hang demonstrations include "
      f"their deliberate timeouts, collective_timeout_s = {T:g} s, hang_timeout_s = {hang_timeout_s:g} s):")
pd.Series(launch_s, name="seconds").round(1).to_frame()

# %% [markdown]
# ## What we saw
#
# * **Accumulation:** `no_sync()` on all micro-batches but the last gives the large-batch
#   gradient. It all-reduces `k` times fewer bytes, and each rank sends about `k` times fewer.
#   The forward decides whether a backward all-reduces. Syncing the wrong micro-batch raises
#   nothing, and the replicas diverge after one step.
# * **Uneven inputs:** the rank with an extra batch waits forever in its all-reduce. Here a short
#   timeout or `LaunchTimeout` ends the wait. `Join` completes it. `divide_by_initial_world_size`
#   decides whether the joined ranks count as zeros.
# * **Unused parameters:** the first iteration "works" with un-averaged gradients. The error comes
#   one iteration later and names parameter indices; `TORCH_DISTRIBUTED_DEBUG=INFO` adds names.
#   `find_unused_parameters=True` fixes it. `static_graph=True` fixes it only if the unused
#   output is not returned.
# * **Unequal batch sizes:** DDP averages ranks, not samples. `sum * world_size / N` restores the
#   global mean.
#
# Casebook: [an epoch that ends inside an accumulation window](10a_casebook_training_loop.ipynb#case-epoch-ends-inside-accumulation).
#
# ## Exercises
#
# Exercises 1 and 2 ask for code: set `answer_N` to your function and run the check cell. It runs
# your code on `world_size` real ranks. Exercises 3 to 5 ask for a value: predict it by hand
# first. Each check prints "correct" or "not yet" with a hint. A collapsed solution follows it;
# student copies leave it out.

# %% [markdown]
# ### Exercise 1: fix the accumulation loop
#
# This loop should accumulate `k` micro-batches with `no_sync()` on all but the last, as
# `no_sync_all_but_last` in section 1 does. It has an off-by-one bug:
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
# your loop with section 1's `accumulation_worker` on `world_size` ranks. It compares the
# all-reduces per optimizer step, and every rank's gradient, with one process on the whole
# global batch.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, your loop on real ranks
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
# Rank `r` holds `r + 1` samples, as in section 4. Write `my_loss(per_sample, world_size)`.
# `per_sample` is this rank's `(n_local,)` float64 tensor of per-sample losses, on the rank's
# device. Nobody hands you the global sample count. Return a scalar such that every rank holds
# the gradient of the **global mean** after DDP averages over the ranks. Hint: a collective in
# the loss is fine, as long as every rank calls it.
#
# Set `answer_2 = my_loss`. The check cell runs it on `world_size` ranks. The naive loss,
# `per_sample.mean()`, gives section 4's mean of rank means.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, your loss on real ranks
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
# Take section 2 with `world_size = 4`. Rank `r` has `2 + r` batches; rank 3 has 31, 32, 33, 34
# and 35. The loop runs inside `Join([ddp], divide_by_initial_world_size=False)`. What gradient
# does rank 3 hold after each of its 5 steps? Answer with a list of 5 numbers.

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 3
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
# Take section 4 with `world_size = 4`. Rank `r` holds `r + 1` of the samples `1, 2, ..., 10`:
# `[1]`, `[2, 3]`, `[4, 5, 6]` and `[7, 8, 9, 10]`. Each rank uses the **mean** of the per-sample
# losses `(w x)^2` at `w = 1`. What gradient does DDP give every rank? Answer with a number, 4
# significant digits being enough, or a fraction as text, such as `"7/12"`.

# %% tags=["exercise"]
answer_4 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 4
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
# Take section 1's model, `Linear(4, 1)` in `float64` in one bucket, with `accum_steps = 8`. How
# many bytes does each rank all-reduce per optimizer step when it synchronises every
# micro-batch? And with `no_sync()` on all micro-batches but the last? Answer with a list of two
# ints.

# %% tags=["exercise"]
answer_5 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 5
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

# %% [markdown]
# <!-- next:start -->
# **Next:** [06b state across ranks](06b_state_across_ranks.ipynb): handle BatchNorm statistics, bit-identical resume, evaluation on every rank.
# <!-- next:end -->
