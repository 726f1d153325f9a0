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
# # 01 · Gradients under DataParallel and DistributedDataParallel
#
# **The question:** when one batch is spread over several devices, which gradient does the
# model end up with under `nn.DataParallel` (DP) and under `DistributedDataParallel` (DDP)?
#
# We use a toy small enough to check by hand: a `Linear(2, world_size + 1)`, the loss
# `(model(x) * labels).sum()`, one sample per process, labels one-hot on the process index.
# Every claim below is followed by the code cell that checks it (`torch.testing.assert_close`),
# so a wrong claim fails CI.
#
# **What runs where**
#
# | part | CPU only (CI) | with GPUs |
# |---|---|---|
# | single-device reference | CPU | CPU |
# | DDP, through `helpers.launch.launch` | `world_size` processes, backend `gloo` | backend `nccl` when there are at least `world_size` GPUs, else `gloo` on CPU |
# | real `nn.DataParallel` (section 3b) | **skipped, and says so**: DP has `device_ids == []` and just calls the module | real DP over all visible GPUs |
# | DP emulation `helpers.gradients.EmulatedDataParallel` (3c) | runs (clearly labelled emulation) | runs too, for comparison |
#
# **New here:** the launcher (`launch(fn, world_size, ...)` returns each rank's result to the
# cell), [DP](../docs/GLOSSARY.md#dp)'s scatter / replicate / gather,
# [DDP](../docs/GLOSSARY.md#ddp)'s [all-reduce](../docs/GLOSSARY.md#all-reduce) of gradients
# over the [world size](../docs/GLOSSARY.md#world-size) [ranks](../docs/GLOSSARY.md#rank), and
# sum versus mean losses. Every term is defined (with its Chinese name) in the
# [glossary](../docs/GLOSSARY.md). Run time: about 12–22 s on 2 CPU cores, half of it
# the worker processes starting. The notebook ends with three exercises, each checked by a
# cell.

# %% tags=["parameters"]
# Parameters (papermill overrides them; these defaults are smoke-sized and also what a learner runs)
world_size = 2  # number of DDP ranks (processes); 1, 2 or 4 (section 4 splits 4 samples evenly)
seed = 0  # seeds the Linear toy's weights and its inputs

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int), seed=(seed, int))
check_value("world_size", world_size, world_size in (1, 2, 4),
            "1, 2 or 4: section 4 splits its 4 samples evenly over the ranks")

# %%
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display
from torch import nn
from torch.testing import assert_close

from helpers.gradients import (
    SCALAR_X,
    EmulatedDataParallel,
    ddp_notebook01_worker,
    linear_toy_batch,
    linear_toy_loss,
    linear_toy_model,
    scalar_sgd_step,
    single_device_grads,
)
from helpers.launch import launch

LR = 1e-3  # SGD learning rate of section 4 (the numbers 0.94, 0.97, 0.985 assume it)
assert len(SCALAR_X) % world_size == 0, f"world_size={world_size} must divide the {len(SCALAR_X)} samples of section 4"

n_gpus = torch.cuda.device_count()
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; world_size = {world_size}; seed = {seed}")
print("DP branch that will run:",
      f"REAL nn.DataParallel on {n_gpus} GPU(s) (section 3b) plus the CPU emulation (3c)" if n_gpus >= 1
      else "no GPU: real nn.DataParallel is SKIPPED (3b); the CPU EMULATION of DP runs (3c)")

# %% [markdown]
# ## 1. The toy and its single-device gradient
#
# The global batch has `world_size` samples `x[r]` (2 features each); sample `r` is the one
# rank `r` will see under DDP, and its label is one-hot on index `r`. The model is
# `Linear(2, world_size + 1)` (for `world_size = 2`: the issue's `Linear(2, 3)`); the last
# output unit matches no label, a control row.
#
# With loss $L = \sum_i \sum_j \text{out}_{ij}\,\text{labels}_{ij} = \sum_r (W x_r + b)_r$,
# sample `r` touches only row `r`: $\partial L/\partial W_{r\cdot} = x_r$ and
# $\partial L/\partial b_r = 1$.
#
# **Claim:** on one device, the gradient over the whole batch is the **sum** of the
# per-sample gradients: weight row `r` equals `x[r]`, the last row is zero, and the bias
# gradient is 1 for the first `world_size` entries and 0 for the last.

# %%
x, labels = linear_toy_batch(world_size, seed)  # (world_size, 2) float32, (world_size, world_size + 1)
model = linear_toy_model(world_size, seed)
print(model)
print("x      =", x.tolist())
print("labels =", labels.tolist())

full = single_device_grads(model, x, labels)  # the reference: one device, whole batch
per_sample = [single_device_grads(model, x[r : r + 1], labels[r : r + 1]) for r in range(world_size)]

expected_w = torch.zeros(world_size + 1, 2)
expected_w[:world_size] = x  # row r = x[r], last row 0
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
# `launch(fn, world_size, ...)` starts `world_size` processes with the default process group
# initialised and returns each rank's result, in rank order. The worker
# `helpers.gradients.ddp_linear_worker` builds the same model on every rank, takes sample
# `rank`, computes its gradient **without** DDP (the *local* gradient), then wraps a fresh copy
# in `DistributedDataParallel` and runs backward again: DDP's backward **all-reduces** (sums)
# the gradients across ranks and divides by `world_size`.
#
# Starting processes costs a few seconds of `import torch` each, so this one launch
# (`ddp_notebook01_worker`) runs every DDP experiment of the notebook, section 4's included
# (about 4–12 s on a 2-core laptop). Worker prints appear below prefixed `[rank r]`.

# %%
t0 = time.perf_counter()
results = launch(ddp_notebook01_worker, world_size, x, labels, seed=seed, scalar_x=SCALAR_X, lr=LR)
print(f"launch of {world_size} rank(s) took {time.perf_counter() - t0:.1f} s (mostly process start-up)")
lin = [res["linear"] for res in results]  # per rank: local and DDP gradients of the Linear toy

# %% [markdown]
# **Claim:** rank `r`'s local gradient has only row `r` non-zero, equal to `x[r]` (bias:
# one-hot on `r`). After DDP's backward, **every** rank holds the same gradient: row `r` equals
# `x[r] / world_size`, the last row is zero, and the bias gradient is `1 / world_size` for the
# first `world_size` entries, 0 for the last. For the issue's `world_size = 2`: row `r` is
# `x[r] / 2`, row 2 is zero, bias gradient `[0.5, 0.5, 0]`. So here DDP's gradient is the
# single-device gradient divided by `world_size`.

# %%
rows = []
for r, res in enumerate(lin):
    assert_close(res["x"], x[r], msg=f"rank {r} should have taken sample x[{r}]")
    local_expected = torch.zeros(world_size + 1, 2)
    local_expected[r] = x[r]
    assert_close(res["local_weight_grad"], local_expected,
                 msg=f"rank {r}: the local gradient should have only row {r} = x[{r}]")
    assert_close(res["local_bias_grad"], torch.eye(world_size + 1)[r], msg=f"rank {r}: local bias gradient")
    assert_close(res["ddp_weight_grad"], expected_w / world_size,
                 msg=f"rank {r}: after all-reduce, row s should be x[s] / world_size, last row 0")
    assert_close(res["ddp_bias_grad"], expected_b / world_size, msg=f"rank {r}: DDP bias gradient")
    assert_close(res["ddp_weight_grad"], full["weight"] / world_size,
                 msg="DDP gradient should be the single-device gradient / world_size for this summed loss")
    rows.append({"rank": r, "its sample x[r]": res["x"].tolist(),
                 "local grad, row r": res["local_weight_grad"][r].tolist(),
                 "local grad, other rows": "all 0" if world_size > 1 else "-",
                 "DDP grad, row r": res["ddp_weight_grad"][r].tolist(),
                 "x[r] / world_size": (res["x"] / world_size).tolist(),
                 "DDP bias grad": res["ddp_bias_grad"].tolist()})
if world_size == 2:  # the exact case
    for res in lin:
        assert_close(res["ddp_bias_grad"], torch.tensor([0.5, 0.5, 0.0]), msg="issue: bias gradient [0.5, 0.5, 0]")
        assert_close(res["ddp_weight_grad"][2], torch.zeros(2), msg="issue: row 2 is zero")
        for r in range(2):
            assert_close(res["ddp_weight_grad"][r], x[r] / 2, msg=f"issue: row {r} = x[{r}] / 2")
    print("the issue's world_size = 2 case holds exactly: rows x[r] / 2, row 2 zero, bias [0.5, 0.5, 0]")
else:
    print(f"world_size = {world_size}: checked the general formula row r = x[r] / {world_size}; "
          "the issue's literal world_size = 2 numbers apply to world_size = 2 only")
pd.DataFrame(rows).set_index("rank")

# %% [markdown]
# ## 3. DP: one process, replicas, gradients summed into the original model
#
# `nn.DataParallel` is one process driving several GPUs. On every forward it **scatters** the
# batch over `device_ids` (chunks along dim 0), **replicates** the module onto them, runs the
# replicas **in parallel** (one thread per GPU) and **gathers** the outputs on `device_ids[0]`.
# The loss is computed on the gathered output, i.e. over the whole batch, and backward **sums**
# the replicas' gradients into the original parameters.
#
# **Claim:** the DP gradient equals the single-device gradient of the whole batch: row `r` is
# `x[r]`, not `x[r] / world_size`.
#
# ### 3a. `nn.DataParallel` on this machine
#
# **Claim (CPU only):** without GPUs, `nn.DataParallel(model).device_ids == []` and its forward
# simply calls the module, once, on the whole batch: no scatter, no replicas, no speed-up.
# (`torch/nn/parallel/data_parallel.py`: `if not self.device_ids: return self.module(*inputs, **kwargs)`.)

# %%
if n_gpus == 0:
    cpu_model = linear_toy_model(world_size, seed)
    dp_cpu = nn.DataParallel(cpu_model)
    calls = []  # batch size of every forward call of the wrapped module
    hook = cpu_model.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    linear_toy_loss(dp_cpu(x), labels).backward()
    hook.remove()
    print(f"nn.DataParallel on CPU: device_ids = {dp_cpu.device_ids}, "
          f"module called {len(calls)} time(s) with batch size(s) {calls}")
    assert dp_cpu.device_ids == [], f"expected no devices on a CPU-only machine, got {dp_cpu.device_ids}"
    assert calls == [world_size], f"expected one call on the whole batch ({world_size}), got {calls}"
    assert_close(cpu_model.weight.grad, full["weight"], msg="DP on CPU is the plain module: same gradient")
else:
    print(f"{n_gpus} GPU(s) visible: nn.DataParallel(model).device_ids would be {list(range(n_gpus))}; "
          "the CPU-only behaviour (device_ids == []) is not shown on this machine. Real DP runs in 3b.")

# %% [markdown]
# ### 3b. Real `nn.DataParallel` on GPUs (runs only when `torch.cuda.device_count() >= 1`)
#
# **Claim:** real DP's gradient equals the single-device gradient of the whole batch, and one
# SGD step of section 4's scalar toy under DP matches the single process. With one GPU, DP
# scatters into one chunk and calls the module directly; with several, the forward hook below
# fires once per replica with one chunk each. On a CPU-only machine this cell prints that it
# skipped, and why.

# %%
dp_real = None  # filled only when real DP runs
if n_gpus >= 1:
    gpu_model = linear_toy_model(world_size, seed).cuda()
    dp = nn.DataParallel(gpu_model)  # device_ids = every visible GPU
    calls = []
    hook = gpu_model.register_forward_hook(lambda mod, inp, out: calls.append((str(inp[0].device), inp[0].shape[0])))
    linear_toy_loss(dp(x.cuda()), labels.cuda()).backward()
    hook.remove()
    dp_real = {"weight": gpu_model.weight.grad.cpu(), "bias": gpu_model.bias.grad.cpu()}
    print(f"RAN real nn.DataParallel: device_ids = {dp.device_ids}; forward calls (device, chunk size): {calls}")
    assert_close(dp_real["weight"], full["weight"], msg="real DP weight gradient != single-device gradient")
    assert_close(dp_real["bias"], full["bias"], msg="real DP bias gradient != single-device gradient")
    dp_real_scalar = {red: scalar_sgd_step(SCALAR_X, red, LR, wrap=nn.DataParallel, device="cuda")
                      for red in ("sum", "mean")}
    print("real DP, scalar toy:", dp_real_scalar)
else:
    print("SKIPPED real nn.DataParallel: torch.cuda.device_count() == 0, so DataParallel has no devices "
          "to scatter to (device_ids == []; see 3a). Section 3c shows what it does with a labelled CPU emulation.")
display(Markdown(f"**DP branch that ran:** real `nn.DataParallel` on {n_gpus} GPU(s), checked against one device."
                 if dp_real is not None else
                 "**DP branch that ran:** none on GPU: real `nn.DataParallel` was **skipped** "
                 "(`torch.cuda.device_count() == 0`); the CPU **emulation** in 3c stands in for it."))

# %% [markdown]
# ### 3c. What DP does, emulated on CPU (an **emulation**, not torch's DP)
#
# `helpers.gradients.EmulatedDataParallel(model, num_replicas)` follows
# `DataParallel.forward` step by step, on CPU: **scatter** with `x.chunk(num_replicas)` (DP's
# chunking), **replicate** as differentiable copies of the parameters (`p.clone()`, as DP's
# `Broadcast` autograd function makes them), apply each replica to its chunk (sequentially:
# no speed-up), **gather** with `torch.cat`. In backward, autograd accumulates every replica's
# gradient into the original parameter: a sum, like DP's `ReduceAddCoalesced`.
# (`torch.nn.parallel.replicate` itself refuses CPU devices.)
#
# **Claim:** with `world_size` replicas, replica `r` gets chunk `r` (sample `x[r]`), its
# gradient is that sample's gradient (only row `r`), and the replicas' gradients **sum** to the
# original model's gradient, which equals the single-device gradient: `world_size` times
# DDP's.

# %%
emu_model = linear_toy_model(world_size, seed)
emu = EmulatedDataParallel(emu_model, num_replicas=world_size)
linear_toy_loss(emu(x), labels).backward()
replica_grads = [params["weight"].grad + 0.0 for params in emu.last_replica_params]
print("EMULATED DP: chunk sizes", [c.shape[0] for c in emu.last_chunks])
for r, g in enumerate(replica_grads):
    print(f"  replica {r} weight gradient rows: {g.tolist()}")
    assert_close(emu.last_chunks[r], x[r : r + 1], msg=f"replica {r} should get chunk x[{r}:{r + 1}]")
    assert_close(g, per_sample[r]["weight"], msg=f"replica {r}'s gradient should be sample {r}'s gradient")
assert_close(sum(replica_grads), emu_model.weight.grad, msg="replica gradients should sum into the original")
assert_close(emu_model.weight.grad, full["weight"], msg="emulated DP gradient != single-device gradient")
assert_close(emu_model.bias.grad, full["bias"], msg="emulated DP bias gradient != single-device gradient")
assert_close(emu_model.weight.grad, lin[0]["ddp_weight_grad"] * world_size,
             msg="DP gradient should be world_size x the DDP gradient here")
dp_grad_for_plot = dp_real["weight"] if dp_real is not None else emu_model.weight.grad
dp_label = "real nn.DataParallel (GPU)" if dp_real is not None else "DP, EMULATED on CPU"
print("DP gradient shown in the figure:", dp_label)

# %% [markdown]
# ### The same numbers as pictures
#
# One heatmap per gradient of the weight matrix (rows: output units, columns: input
# features), on one colour scale: each rank's local gradient fills only its own row; DDP's
# all-reduced gradient is their average (every rank holds it); DP's gradient, like the
# single-device one, is their sum. The last row, matching no label, stays zero everywhere.

# %%
panels = [(f"rank {r}: local gradient\n(no DDP)", res["local_weight_grad"]) for r, res in enumerate(lin)]
panels += [
    ("DDP: all-reduced average\n(identical on every rank)", lin[0]["ddp_weight_grad"]),
    (f"{dp_label}\n(sum over replicas)", dp_grad_for_plot),
    ("single device, whole batch\n(reference)", full["weight"]),
]
vmax = max(float(g.abs().max()) for _, g in panels) or 1.0
fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 3.4), constrained_layout=True)
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
fig.colorbar(im, ax=axes, shrink=0.8, label="dL/dW[i, j]")
fig.suptitle(f"Weight gradients of Linear(2, {world_size + 1}), world_size = {world_size}")
plt.show()

# %% [markdown]
# ## 4. Sum versus mean
#
# A scalar model `y = w * x` with `w = 1`, target 0, the global batch
# `x = [-1, 2, -3, 4]`, learning rate `1e-3`, one real SGD step each.
#
# * Summed loss $L = \sum_i (w x_i)^2$: $dL/dw = 2w\sum_i x_i^2 = 2 \cdot 30 = 60$, and
#   $w \leftarrow 1 - 10^{-3}\cdot 60 = 0.94$.
# * Mean loss $L = \frac14\sum_i (w x_i)^2$: gradient 15, $w = 0.985$.
# * DDP with 2 ranks of 2 samples and the **summed** loss: rank 0 (`[-1, 2]`) has local
#   gradient 10, rank 1 (`[-3, 4]`) 50; DDP averages them: **30**, $w = 0.97$, half the
#   single-process gradient. In general $60 / \text{world\_size}$.
# * DDP with the **mean** loss: local gradients 5 and 25, average **15**, $w = 0.985$:
#   the same as one process (for any `world_size` that splits the batch evenly).
# * DP computes the loss on the gathered whole batch, so it matches the single process for
#   both reductions.
#
# **Claim:** these numbers, from real SGD steps (DDP ran in the launch of section 2).

# %%
single = {red: scalar_sgd_step(SCALAR_X, red, LR) for red in ("sum", "mean")}
dp_emulated = {red: scalar_sgd_step(SCALAR_X, red, LR, wrap=lambda m: EmulatedDataParallel(m, world_size))
               for red in ("sum", "mean")}
ddp = results[0]["scalar"]
for r, res in enumerate(results):
    for case, v in res["scalar"].items():  # local_loss differs per rank; grad and w must not
        assert_close((v["grad"], v["w"]), (ddp[case]["grad"], ddp[case]["w"]),
                     msg=f"rank {r}, {case}: should hold the same gradient and weight as rank 0")

def check(measured, grad, what):
    # every number: the gradient, and w after one SGD step from w = 1
    assert_close(measured["grad"], grad, msg=f"{what}: gradient {measured['grad']} != {grad}")
    assert_close(measured["w"], 1.0 - LR * grad, msg=f"{what}: w after the step {measured['w']} != {1.0 - LR * grad}")

check(single["sum"], 60.0, "single process, sum")
check(single["mean"], 15.0, "single process, mean")
assert_close(single["sum"]["w"], 0.94, msg="issue: single process, sum: w = 0.94")
assert_close(single["mean"]["w"], 0.985, msg="issue: single process, mean: w = 0.985")
for red in ("sum", "mean"):
    check(dp_emulated[red], single[red]["grad"], f"emulated DP, {red}")
    if dp_real is not None:
        check(dp_real_scalar[red], single[red]["grad"], f"real DP, {red}")
check(ddp["sum"], 60.0 / world_size, "DDP, sum")
check(ddp["mean"], 15.0, "DDP, mean")
if world_size == 2:  # the literal numbers
    assert_close(ddp["sum"]["grad"], 30.0, msg="issue: DDP (2 ranks), sum: grad 30")
    assert_close(ddp["sum"]["w"], 0.97, msg="issue: DDP (2 ranks), sum: w = 0.97")
    assert_close(ddp["mean"]["w"], 0.985, msg="issue: DDP (2 ranks), mean: w = 0.985")
print(f"single: {single}\nDP (emulated): {dp_emulated}\nDDP (rank 0): {ddp}")

# %% [markdown]
# ## 5. A common mistake: multiplying the loss by `world_size`
#
# "DDP divides by `world_size`, so multiply the loss by `world_size` to undo it." With a
# **summed** loss that gives back the single process: $60/\text{world\_size}\cdot\text{world\_size} = 60$.
# With a **mean** loss, which DDP already got right, it gives $15 \cdot \text{world\_size}$:
# **30** for 2 ranks, which is neither the sum (60) nor the mean (15) of one process: it
# silently multiplies the learning rate by `world_size`.
#
# **Claim:** loss × `world_size` under DDP gives 60 with the summed loss and
# `15 * world_size` (30 for 2 ranks), not 15, with the mean loss.

# %%
check(ddp["sum_x_world"], 60.0, "DDP, sum x world_size")
check(ddp["mean_x_world"], 15.0 * world_size, "DDP, mean x world_size")
if world_size == 2:
    assert_close(ddp["mean_x_world"]["grad"], 30.0, msg="issue: DDP, mean loss x world_size: grad 30")
if world_size > 1:  # the mean loss the learner asked for is no longer what is optimised
    assert ddp["mean_x_world"]["grad"] != single["mean"]["grad"], \
        "mean loss x world_size should differ from the single-process mean-loss gradient"
print(f"DDP, mean loss x {world_size}: grad {ddp['mean_x_world']['grad']:g}, w {ddp['mean_x_world']['w']:g} "
      f"(single process: {single['mean']['grad']:g} / {single['mean']['w']:g})")

# %% [markdown]
# ### Summary table and chart
#
# Gradient before the step and `w` after one SGD step, for each mode and loss reduction.
# "same as single process?" compares with the single process using the same reduction.

# %%
dp_mode = "DP (real, GPU)" if dp_real is not None else "DP (EMULATED, CPU)"
modes = {"single process": single, dp_mode: dp_real_scalar if dp_real is not None else dp_emulated,
         f"DDP ({world_size} ranks)": {"sum": ddp["sum"], "mean": ddp["mean"]},
         f"DDP, loss x world_size": {"sum": ddp["sum_x_world"], "mean": ddp["mean_x_world"]}}
if dp_real is not None:
    modes["DP (EMULATED, CPU)"] = dp_emulated
table = pd.DataFrame([
    {"mode": mode, "loss reduction": red, "grad": v[red]["grad"], "w after step": v[red]["w"],
     "same as single process?": abs(v[red]["grad"] - single[red]["grad"]) < 1e-9}
    for mode, v in modes.items() for red in ("sum", "mean")
]).set_index(["mode", "loss reduction"])
table

# %%
fig, (ax_g, ax_w) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
names = list(modes)
width = 0.38
for k, red in enumerate(("sum", "mean")):
    pos = [i + (k - 0.5) * width for i in range(len(names))]
    bars = ax_g.bar(pos, [modes[m][red]["grad"] for m in names], width, label=f"{red} loss")
    ax_g.bar_label(bars, fmt="%g", fontsize=8)
    bars = ax_w.bar(pos, [modes[m][red]["w"] for m in names], width, label=f"{red} loss")
    ax_w.bar_label(bars, fmt="%g", fontsize=8)
for ax in (ax_g, ax_w):
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    ax.set_xlabel("mode")
fig.legend(*ax_g.get_legend_handles_labels(), loc="outside upper center", ncol=2)
ax_g.set_ylabel("dL/dw before the step")
ax_g.set_title("Gradient of the scalar toy")
ax_w.set_ylabel("w after one SGD step (lr = 1e-3)")
ax_w.set_ylim(0.9, 1.0)
ax_w.set_title("Weight after one step (from w = 1)")
plt.show()

# %% [markdown]
# ## What we saw
#
# * **DP** (one process, many GPUs) computes the loss on the gathered whole batch and sums the
#   replicas' gradients into one model: its gradient **is** the single-device gradient. On a
#   CPU-only machine `nn.DataParallel` has no devices and just calls the module; the emulation
#   showed the data flow, and its gradient matched the single device exactly.
# * **DDP** (one process per rank) computes each rank's gradient on its own shard, then its
#   backward **all-reduces** and **averages**: every rank ends with the same gradient, the
#   mean of the local ones (row `r` = `x[r] / world_size` in the toy).
# * With a **mean** loss and an evenly split global batch, DDP's averaging gives exactly the
#   single-process gradient (15, `w = 0.985`). With a **summed** loss it gives
#   `1 / world_size` of it (30, `w = 0.97`). Multiplying a mean loss by `world_size` "to undo
#   the averaging" is a mistake (30 instead of 15).
#
# ## Exercises
#
# Predict each answer by hand first, write it into `answer_N` (replacing `None`) and run the
# check cell below it: it prints "correct" or "not yet" with a hint. The solution is in the
# collapsed cell after the check (click the "…" or the bar on its left to open it). CI runs
# every solution, so they are known to be right. None of them starts new processes.

# %% [markdown]
# ### Exercise 1: the Linear toy on 4 ranks
#
# Run in your head what section 2 ran for `world_size = 4`: the toy is then `Linear(2, 5)`,
# 4 samples, one per rank, labels one-hot on the rank. After DDP's backward, what is the
# **bias gradient** every rank holds? Answer with a list of 5 numbers.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% tags=["check"]
# expected: each rank's local gradient of its own sample (this notebook's helpers, no processes),
# averaged as DDP's all-reduce and division by the world size do
x4, labels4 = linear_toy_batch(4, seed)
model4 = linear_toy_model(4, seed)
local4 = [single_device_grads(model4, x4[r : r + 1], labels4[r : r + 1])["bias"] for r in range(4)]
expected_1 = (sum(local4) / 4).tolist()
if world_size == 4:  # this run launched 4 real ranks: DDP must agree
    assert_close(lin[0]["ddp_bias_grad"], torch.tensor(expected_1), msg="DDP's bias gradient, 4 ranks")
check_answer("ex1", answer_1, expected_1,
             hint="which bias entries does sample r touch, and what does DDP divide by?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# Sample r has its label one-hot on unit r, so d loss / d bias is 1 at entry r and 0 elsewhere:
# only rank r has a 1 in entry r. DDP sums the 4 ranks' gradients and divides by 4, so
# entries 0..3 become 1/4; entry 4 (the control unit, no label) stays 0 everywhere.
solution_1 = [1 / 4, 1 / 4, 1 / 4, 1 / 4, 0.0]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: the summed loss on 4 ranks
#
# Section 4's scalar toy (`w = 1`, `x = [-1, 2, -3, 4]`, summed loss `sum((w x)^2)`) on
# `world_size = 4`: each rank holds one sample. What gradient `dL/dw` does every rank hold
# after DDP's backward? Answer with a number.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% tags=["check"]
# expected: one real SGD step of each rank's contiguous shard (as ddp_scalar_worker splits the
# batch), in this process, and DDP's average of the ranks' gradients
shards4 = torch.tensor(SCALAR_X).chunk(4)
expected_2 = sum(scalar_sgd_step(s, "sum", LR)["grad"] for s in shards4) / 4
if world_size == 4:  # this run launched 4 real ranks
    assert_close(ddp["sum"]["grad"], expected_2, msg="DDP's summed-loss gradient, 4 ranks")
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
# The global batch `[-1, 2, -3, 4, 5]` (5 samples) is split 3 + 2 over two ranks
# (`[-1, 2, -3]` and `[4, 5]`, as `x.chunk(2)` splits it), each rank uses the **mean** loss
# `mean((w x)^2)` at `w = 1`. What gradient does DDP give every rank? Answer with a number
# (4 significant digits are enough) or a fraction as text, such as `"7/12"`. Then compare
# with one process's mean-loss gradient over the 5 samples: why do they differ, and what
# loss on each rank would make DDP match?

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% tags=["check"]
# expected: the real mean-loss gradient of each rank's shard (torch's chunk(2): 3 + 2), averaged
batch5 = torch.tensor([-1.0, 2.0, -3.0, 4.0, 5.0])
expected_3 = sum(scalar_sgd_step(s, "mean", LR)["grad"] for s in batch5.chunk(2)) / 2
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
