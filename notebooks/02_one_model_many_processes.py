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
# # 02 · One model, many processes: how DDP keeps the replicas identical
#
# <!-- opening:start -->
# **You will be able to** say what DDP broadcasts, when, and what it never synchronises. **You need** [01 gradients: DP vs DDP](01_gradients_dp_vs_ddp.ipynb).
# <!-- opening:end -->
#
# **The question:** every DDP process, or rank, builds its *own* copy of the model. It uses its
# own random numbers and trains on its *own* data. Why are the copies still identical, before
# and after every optimizer step?
#
# The experiment: each of `world_size` processes builds a `Linear(5, 5)` with
# `torch.manual_seed(base_seed + rank)`. So the copies start **different**. Each wraps its copy
# in `DistributedDataParallel` and runs one forward pass on its own random data. Then comes an
# MSE loss against random labels, backward, and one SGD step with learning rate `lr`. The worker
# is written in this notebook's cells. We gather every rank's parameters back into the notebook
# after each stage. A code cell follows every statement marked *Claim* and asserts it.
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | the DDP workers defined here, run by `helpers.engine.launch` | `world_size` processes, backend `gloo`, model on CPU | the same: this toy runs on CPU with `gloo` everywhere (it is about *what* DDP synchronises, not speed) |
# | the single-process reference, tables and figures | this notebook's process, CPU | the same |
#
# **New here:** DDP **broadcasts** rank 0's parameters and buffers at construction. You see
# exactly when it broadcasts buffers again before a forward. You see what it does *not*
# synchronise: a plain tensor attribute. And you see why the replicas stay equal: all ranks
# start equal, and all apply the same all-reduced gradient. Each [rank](../docs/GLOSSARY.md#rank)
# holds its own [replica](../docs/GLOSSARY.md#replica).
# [Gradient synchronisation](../docs/GLOSSARY.md#gradient-synchronisation) is an
# [all-reduce](../docs/GLOSSARY.md#all-reduce) in the
# [process group](../docs/GLOSSARY.md#process-group). The [glossary](../docs/GLOSSARY.md) defines
# every term, with its Chinese name. Almost all of the run time is worker processes starting, in
# three launches. Four exercises close the notebook. The last one asks you to write DDP's
# construction-time broadcast yourself.

# %% tags=["parameters"]
# Parameters: none; no profile changes this lesson (docs/RUNNER.md)

# %%
from helpers.notebook import check_answer

# Constants of this lesson: no profile changes them
world_size = 3  # number of DDP ranks (processes), at least 2; the seed uses 3
base_seed = 0  # rank r seeds its model and data with base_seed + r
lr = 0.01  # SGD learning rate of the one step
batch_size = 4  # samples per rank in the one forward pass

# %%
import contextlib
import time
import warnings

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from helpers.engine import OversubscriptionWarning, launch

assert world_size >= 2, f"world_size = {world_size}: use at least 2 (one rank has nobody to disagree with)"
print(f"torch {torch.__version__}; world_size = {world_size}; base_seed = {base_seed}; lr = {lr}; "
      f"batch_size = {batch_size} per rank")

# %% [markdown]
# ## 1. The seed's experiment on `world_size` processes
#
# Every rank builds its model and data from its own seed. The model is `TaggedLinear`, a
# `Linear(5, 5)` subclass. It also carries two pieces of state filled with `100 + rank`: a
# **registered buffer** and a **plain tensor attribute**. Section 3 uses them. Rank 0 holds 100,
# not 0, so "rank 0's value" cannot be mistaken for "reset to zero". Calling
# `make_replica(r, ...)` in this notebook rebuilds exactly what rank `r` builds.

# %%
class TaggedLinear(nn.Linear):
    """Linear(in_features, out_features) plus rank_buffer (registered) and rank_attribute (plain), both (2,) = 100 + rank."""

    def __init__(self, in_features, out_features, rank):
        super().__init__(in_features, out_features)
        self.register_buffer("rank_buffer", torch.full((2,), 100.0 + rank))  # in state_dict, seen by DDP
        self.rank_attribute = torch.full((2,), 100.0 + rank)  # just a Python attribute: invisible to DDP


def make_replica(rank, base_seed, batch_size):
    """Rank `rank`'s (model, x (batch_size, 5), y (batch_size, 5)), float32, from seed base_seed + rank."""
    torch.manual_seed(base_seed + rank)
    return TaggedLinear(5, 5, rank), torch.randn(batch_size, 5), torch.randn(batch_size, 5)


def snapshot(model):
    return {name: t.detach().clone() for name, t in
            [("weight", model.weight), ("bias", model.bias),
             ("rank_buffer", model.rank_buffer), ("rank_attribute", model.rank_attribute)]}


def max_cross_rank_diff(tensors):
    """max over r of max |tensors[r] - tensors[0]|; 0.0 means bitwise identical on every rank."""
    return max(float((t - tensors[0]).abs().max()) for t in tensors)


# %% [markdown]
# The worker each rank runs: record, wrap in `DDP`, record, one training step, record. At each
# stage it also **all-gathers** every rank's flattened parameters with `dist.all_gather`. It
# computes the largest cross-rank difference itself. That is the number printed on each
# `[rank r]` line.

# %%
STAGES = ("before DDP", "after DDP(...)", "after one SGD step")


def all_gather_max_diff(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)  # every rank receives every rank's parameters
    return max_cross_rank_diff(gathered)


def replicas_worker(rank, world_size, base_seed, lr, batch_size):
    model, x, y = make_replica(rank, base_seed, batch_size)
    stages, diffs = {}, {}

    def record(stage):
        stages[stage], diffs[stage] = snapshot(model), all_gather_max_diff(model)
        print(f"{stage:>20}: weight[0, 0] = {model.weight[0, 0].item():+.4f}  max cross-rank diff = {diffs[stage]:.4g}")

    record(STAGES[0])
    ddp_model = DDP(model)  # CPU module, gloo: no device_ids
    record(STAGES[1])
    opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    loss = nn.functional.mse_loss(ddp_model(x), y)
    loss.backward()  # DDP divides the gradients by world_size, then all-reduces (sums) them
    grad = {"weight": model.weight.grad.clone(), "bias": model.bias.grad.clone()}
    opt.step()
    record(STAGES[2])
    return {"rank": rank, "stages": stages, "all_gather_max_diff": diffs, "x": x, "y": y,
            "loss": loss.item(), "grad": grad}


# %% [markdown]
# The launch: `launch(replicas_worker, world_size, ..., backend="gloo")` starts `world_size`
# processes. Each initialises the default process group with backend `gloo`, since the models
# are on CPU. Without `backend`, `launch` picks `nccl` when there is one GPU per rank. The
# launcher sends the worker, and the class and functions it uses, from this notebook. It returns
# each rank's result in rank order.
#
# The launcher may warn `OversubscriptionWarning` once, when ranks share cores. The results are
# exact and no time is measured, so later launches do not repeat it. The first `launch` in a
# kernel is the slowest. It also starts the process that imports torch once for every later
# launch, as lesson [00a](00a_processes_and_collectives.ipynb) shows in section 2.

# %%
t0 = time.perf_counter()
results = launch(replicas_worker, world_size, base_seed, lr, batch_size, backend="gloo")
print(f"launch of {world_size} ranks took {time.perf_counter() - t0:.1f} s (mostly process start-up)")
warnings.filterwarnings("ignore", category=OversubscriptionWarning)  # said once, above: no need to repeat it

# params[stage][r] = rank r's (weight (5, 5), bias (5,)) at that stage
params = {s: [(res["stages"][s]["weight"], res["stages"][s]["bias"]) for res in results] for s in STAGES}
assert [res["rank"] for res in results] == list(range(world_size)), "results must come back in rank order"


def stage_diff(stage):
    # largest |rank r's value - rank 0's value| over all ranks and every weight and bias entry
    return max(max_cross_rank_diff([w for w, _ in params[stage]]), max_cross_rank_diff([b for _, b in params[stage]]))


table = pd.DataFrame([
    {"rank": r, "stage": s, "weight[0, 0]": params[s][r][0][0, 0].item(), "bias[0]": params[s][r][1][0].item(),
     "max |param - rank 0's|": max(float((params[s][r][0] - params[s][0][0]).abs().max()),
                                   float((params[s][r][1] - params[s][0][1]).abs().max()))}
    for s in STAGES for r in range(world_size)
]).set_index(["stage", "rank"])
table

# %% [markdown]
# ## 2. Three claims about the parameters
#
# **Claim 1, before wrapping:** each rank's parameters are exactly what `Linear(5, 5)` gives after
# `torch.manual_seed(base_seed + rank)`. So they **differ** across ranks: the largest cross-rank
# difference is above 0. The workers' `all_gather` number equals the one computed here.
#
# The cell rebuilds every rank's model in this one process, with `make_replica`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank's model and data come from its own seed
rebuilt = [make_replica(r, base_seed, batch_size) for r in range(world_size)]  # (model, x, y) per rank
for r, (model_r, x_r, y_r) in enumerate(rebuilt):
    w, b = params["before DDP"][r]
    assert_close(w, model_r.weight.detach(), rtol=0, atol=0, msg=f"rank {r}'s weight is not Linear(5, 5) from seed {base_seed + r}")
    assert_close(b, model_r.bias.detach(), rtol=0, atol=0, msg=f"rank {r}'s bias is not Linear(5, 5) from seed {base_seed + r}")
    assert_close(results[r]["x"], x_r, rtol=0, atol=0, msg=f"rank {r}'s data should come from seed {base_seed + r}")
    assert_close(results[r]["y"], y_r, rtol=0, atol=0, msg=f"rank {r}'s labels should come from seed {base_seed + r}")
diffs = {s: stage_diff(s) for s in STAGES}
assert diffs["before DDP"] > 0, f"before wrapping, the ranks' parameters should differ, max difference {diffs['before DDP']}"
for r, res in enumerate(results):
    for s in STAGES:
        assert res["all_gather_max_diff"][s] == diffs[s], (
            f"rank {r}'s all_gather difference at '{s}' ({res['all_gather_max_diff'][s]}) != ours ({diffs[s]})")
print(f"before DDP: max cross-rank difference {diffs['before DDP']:.4f} (> 0: every rank built its own model)")

# %% [markdown]
# **Claim 2, after `DDP(model)`:** the constructor **broadcasts** rank 0's parameters and buffers
# to every rank. The largest difference across ranks is exactly `0.0`, bitwise equal. Every rank
# now holds rank 0's **pre-wrap** values. The other ranks' initialisations are simply
# overwritten.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: after DDP(...), every rank holds rank 0's pre-wrap values
w0_before, b0_before = params["before DDP"][0]
assert diffs["after DDP(...)"] == 0.0, f"after DDP(...) the ranks should be bitwise equal, max difference {diffs['after DDP(...)']}"
for r, (w, b) in enumerate(params["after DDP(...)"]):
    assert_close(w, w0_before, rtol=0, atol=0, msg=f"rank {r}'s weight after DDP(...) should be rank 0's pre-wrap weight")
    assert_close(b, b0_before, rtol=0, atol=0, msg=f"rank {r}'s bias after DDP(...) should be rank 0's pre-wrap bias")
print(f"after DDP(...): max cross-rank difference {diffs['after DDP(...)']} -- every rank holds rank 0's initial values")

# %% [markdown]
# **Claim 3, after one step:** each rank computed its loss on **different** data, so the losses
# differ. Yet after `backward()` every rank holds the same gradient: the **mean over ranks** of
# the local gradients. The parameters stay bitwise identical and equal a single-process step:
#
# $$w_\text{after} = w_\text{rank 0} - \text{lr}\cdot\frac{1}{\text{world\_size}}\sum_{r} \nabla_w \text{MSE}(x_r, y_r;\, w_\text{rank 0})$$
#
# DDP divides each gradient by `world_size`, then all-reduces the quotients. Notebook 01, section
# 2b, shows that order. Every rank then applies the same SGD step to the same parameters. Every
# rank has the same `batch_size`, and `MSELoss` takes a mean. So this is also one process taking
# one step on the **global batch**, all ranks' data together, with the same mean loss.

# %%
def local_gradient(weight, bias, x, y):
    # MSE-loss gradient at the given parameters, in this process, without nn.Linear or DDP
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    return dict(zip(("weight", "bias"), torch.autograd.grad(nn.functional.mse_loss(x @ w.T + b, y), (w, b))))


# the independent single-process computation, from rank 0's pre-wrap parameters and each rank's own data
local = [local_gradient(w0_before, b0_before, x_r, y_r) for _, x_r, y_r in rebuilt]
mean_gw = torch.stack([g["weight"] for g in local]).mean(0)
mean_gb = torch.stack([g["bias"] for g in local]).mean(0)
w_ref, b_ref = w0_before - lr * mean_gw, b0_before - lr * mean_gb

# the same step on the global batch, one process
x_all = torch.cat([x_r for _, x_r, _ in rebuilt])
y_all = torch.cat([y_r for _, _, y_r in rebuilt])
g_all = local_gradient(w0_before, b0_before, x_all, y_all)

losses = [res["loss"] for res in results]
assert len(set(losses)) == world_size, f"each rank's loss is on its own data, so they should differ: {losses}"
assert diffs["after one SGD step"] == 0.0, (
    f"after the step the ranks should still be bitwise equal, max difference {diffs['after one SGD step']}")
for r, res in enumerate(results):
    assert_close(res["grad"]["weight"], mean_gw, msg=f"rank {r}: DDP's weight gradient should be the mean of the ranks' local gradients")
    assert_close(res["grad"]["bias"], mean_gb, msg=f"rank {r}: DDP's bias gradient should be the mean of the ranks' local gradients")
    w, b = params["after one SGD step"][r]
    assert_close(w, w_ref, msg=f"rank {r}: weight after the step != w_rank0 - lr * mean of local gradients")
    assert_close(b, b_ref, msg=f"rank {r}: bias after the step != b_rank0 - lr * mean of local gradients")
assert_close(g_all["weight"], mean_gw, msg="equal shards + mean loss: global-batch gradient should equal the mean of the ranks'")
assert_close(g_all["bias"], mean_gb, msg="equal shards + mean loss: global-batch bias gradient should equal the mean of the ranks'")
assert not torch.equal(local[0]["weight"], mean_gw), "rank 0's own gradient should differ from the averaged one"
print("losses on each rank's own data:", [round(v, 4) for v in losses])
print(f"after one SGD step: max cross-rank difference {diffs['after one SGD step']}; "
      f"max |w - w_ref| = {float((params['after one SGD step'][0][0] - w_ref).abs().max()):.2e}")
grad_rows = [(f"rank {r}'s own data (local)", g["weight"]) for r, g in enumerate(local)]
grad_rows += [("mean over ranks (reference)", mean_gw)]
grad_rows += [(f"DDP's .grad on rank {r}", res["grad"]["weight"]) for r, res in enumerate(results)]
grad_rows += [("global batch, one process", g_all["weight"])]
pd.DataFrame([{"weight gradient from": name, **{f"dW[0, {j}]": g[0, j].item() for j in range(3)}}
              for name, g in grad_rows]).set_index("weight gradient from")


# %% [markdown]
# ## 3. What DDP synchronises, and what it does not
#
# DDP synchronises what it can see in the module. **Registered parameters** are broadcast at
# construction. Afterwards, averaging their gradients keeps them equal. **Registered buffers**
# come from `register_buffer`, like BatchNorm's running statistics. A **plain tensor attribute**,
# `self.t = torch.tensor(...)`, is neither: DDP never touches it.
#
# **Claim:** after `DDP(...)` and after section 1's step, `rank_buffer` is `[100, 100]` on every
# rank: rank 0's value. Meanwhile `rank_attribute` is still `[100 + r, 100 + r]` on rank `r`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the buffer is rank 0's, the plain attribute stays per-rank
sync_rows = []
for s in STAGES:
    for r, res in enumerate(results):
        buf, attr = res["stages"][s]["rank_buffer"], res["stages"][s]["rank_attribute"]
        expected_buf = 100.0 + (r if s == "before DDP" else 0)  # after wrapping: rank 0's
        assert_close(buf, torch.full((2,), expected_buf), rtol=0, atol=0,
                     msg=f"rank {r}, {s}: the registered buffer should be {expected_buf} (rank 0's after wrapping)")
        assert_close(attr, torch.full((2,), 100.0 + r), rtol=0, atol=0,
                     msg=f"rank {r}, {s}: the plain attribute should keep its own value {100 + r}")
        sync_rows.append({"rank": r, "stage": s, "rank_buffer (buffer)": buf[0].item(),
                          "rank_attribute (plain)": attr[0].item()})
print("registered buffer: rank 0's on every rank after wrapping; plain tensor attribute: per-rank")
pd.DataFrame(sync_rows).set_index(["stage", "rank"])

# %% [markdown]
# ### When exactly are buffers broadcast again?
#
# Buffers change during training. BatchNorm updates its running statistics in every training
# forward, from the local batch. So DDP can also broadcast buffers again. In torch 2.14.1 the rule
# is in `torch/nn/parallel/distributed.py`:
#
# * Before a forward, `_pre_forward` broadcasts rank 0's buffers when `will_sync_module_buffers()`
#   is true.
# * That needs `forward_sync_buffers` on, the default. The deprecated `broadcast_buffers` sets it.
# * It also needs `require_forward_param_sync` to be true. That flag starts true.
# * After every forward, `_post_forward` sets the flag. It is true when the forward ran with
#   gradients enabled and outside `no_sync()`, false otherwise.
# * `model.train()` and `model.eval()` play no part.
#
# Lesson [06b](06b_state_across_ranks.ipynb), section 1, shows what this does to BatchNorm
# statistics.
#
# The experiment: after wrapping, each rank overwrites its buffer with `value + rank`. That is a
# rank-local change, as a BatchNorm forward makes. Each rank runs one forward in a given
# situation, with backward when gradients are on. It reports the buffer it holds afterwards. The
# linear layer does not read the buffer, so the forward itself leaves it alone. `value` on every
# rank means DDP broadcast rank 0's buffer before that forward. `value + rank` means it did not.

# %%
SITUATIONS = [  # (name, forward_sync_buffers, grad enabled, train mode, inside no_sync)
    ("1. first forward, train(), grad on", True, True, True, False),
    ("2. forward under torch.no_grad()", True, False, True, False),
    ("3. next forward, grad on", True, True, True, False),
    ("4. forward in eval(), grad on", True, True, False, False),
    ("5. forward inside no_sync()", True, True, True, True),
    ("6. next forward, after no_sync()", True, True, True, False),
    ("7. new DDP(..., forward_sync_buffers=False), first forward", False, True, True, False),
    ("8. same wrapper, next forward", False, True, True, False),
]


def buffer_rule_worker(rank, world_size, base_seed):
    model, x, _ = make_replica(rank, base_seed, 1)
    ddp_model = DDP(model)
    seen = {}
    for k, (name, forward_sync, grad_on, train, in_no_sync) in enumerate(SITUATIONS):
        if not forward_sync and ddp_model.forward_sync_buffers:  # situation 7: a fresh wrapper
            model, x, _ = make_replica(rank, base_seed, 1)
            ddp_model = DDP(model, forward_sync_buffers=False)  # construction still broadcasts
            seen["construction with forward_sync_buffers=False"] = model.rank_buffer[0].item()
        value = 100.0 * (k + 2)
        model.rank_buffer.fill_(value + rank)  # a rank-local change
        model.train(train)
        with torch.set_grad_enabled(grad_on), (ddp_model.no_sync() if in_no_sync else contextlib.nullcontext()):
            out = ddp_model(x)
            if grad_on:
                out.sum().backward()
        seen[name] = model.rank_buffer[0].item()
    return seen


t0 = time.perf_counter()
buffer_runs = launch(buffer_rule_worker, world_size, base_seed, backend="gloo")
print(f"launch took {time.perf_counter() - t0:.1f} s")
pd.DataFrame(buffer_runs).T.rename(columns=lambda r: f"rank {r}")

# %% [markdown]
# **Claim:** the rule above, applied to the eight situations in order, predicts every value each
# rank reported.
#
# | situation | broadcast before the forward? | why |
# |---|---|---|
# | 1, 2 | yes | 2 runs under `no_grad()`, but the forward before it had gradients |
# | 3 | no | the forward before ran without gradients |
# | 4, 5 | yes | 4 runs in `eval()` mode, which plays no part |
# | 6 | no | the forward before ran inside `no_sync()` |
# | 7, 8 | no | `forward_sync_buffers=False` |
#
# That last wrapper's construction still broadcast rank 0's buffer, `100` on every rank.

# %%
def predicted_broadcasts(situations):
    """The rule, written out: which forwards start with a broadcast of rank 0's buffers."""
    out, require_sync = [], True  # require_forward_param_sync starts true in a new wrapper
    for k, (_name, forward_sync, grad_on, _train, in_no_sync) in enumerate(situations):
        if k > 0 and forward_sync != situations[k - 1][1]:
            require_sync = True  # a new DDP wrapper
        out.append(forward_sync and require_sync)
        require_sync = grad_on and not in_no_sync  # what _post_forward leaves for the next forward
    return out


predicted = predicted_broadcasts(SITUATIONS)
assert predicted == [True, True, False, True, True, False, False, False], predicted
for r, seen in enumerate(buffer_runs):
    assert seen["construction with forward_sync_buffers=False"] == 100.0, f"rank {r}: construction should broadcast rank 0's 100"
    for k, ((name, *_), synced) in enumerate(zip(SITUATIONS, predicted)):
        value = 100.0 * (k + 2)
        expected = value if synced else value + r
        assert seen[name] == expected, f"rank {r}, {name}: buffer {seen[name]}, the rule predicts {expected}"
print("broadcast before the forward:", {name.split(".")[0]: synced for (name, *_), synced in zip(SITUATIONS, predicted)})

# %% [markdown]
# ## 4. The same story as pictures
#
# One heatmap per rank and stage, all on one colour scale. Rows are ranks; the first three
# columns are stages. Each shows the `5 x 5` weight, with the bias as a sixth column. Before
# wrapping, every rank's picture differs. After `DDP(...)`, every rank shows rank 0's picture.
# After the step, all ranks again show the same picture.
#
# A small `lr` moves each entry too little to see on that scale. The cell prints the largest
# change next to the largest value. So the last column shows the change the step made, on its
# own scale: after the step minus after `DDP(...)`. It is the same on every rank.

# %%
mats = {s: [torch.cat([w, b.unsqueeze(1)], dim=1) for w, b in params[s]] for s in STAGES}  # (5, 6) per rank
steps = [a - b for a, b in zip(mats["after one SGD step"], mats["after DDP(...)"])]  # the step's change
vmax = max(float(m.abs().max()) for s in STAGES for m in mats[s])
vstep = max(float(d.abs().max()) for d in steps) or 1.0
panels = [(s, mats[s], vmax) for s in STAGES] + [("change made by the step", steps, vstep)]
fig, axes = plt.subplots(world_size, len(panels), figsize=(3.1 * len(panels), 2.5 * world_size),
                         squeeze=False, layout="constrained")
for c, (name, per_rank, v) in enumerate(panels):
    for r in range(world_size):
        ax = axes[r, c]
        im = ax.imshow(per_rank[r].numpy(), cmap="RdBu_r" if c < len(STAGES) else "PuOr_r", vmin=-v, vmax=v)
        ax.set_title(f"rank {r} · {name}", fontsize=9)
        ax.set_xticks(range(6), [str(j) for j in range(5)] + ["bias"], fontsize=7)
        ax.set_yticks(range(5))
        ax.set_xlabel("input feature (weight column) / bias", fontsize=7)
        ax.set_ylabel("output unit", fontsize=7)
    if c == len(STAGES) - 1:
        fig.colorbar(im, ax=axes[:, : len(STAGES)], shrink=0.6, label="parameter value")
fig.colorbar(im, ax=axes[:, -1], shrink=0.6, label="after step - after DDP(...)")
fig.suptitle(f"Linear(5, 5) parameters on each of {world_size} ranks: before DDP, after DDP(...), "
             f"after one SGD step (lr = {lr})")
plt.show()
print(f"largest |parameter| {vmax:.3f}; largest change made by the step {vstep:.2e}")
assert max_cross_rank_diff(steps) == 0.0, "the step's change should be identical on every rank"

# %% [markdown]
# The bar chart shows the largest absolute difference between any rank's parameters and rank
# 0's, at each stage. It is large before wrapping, and exactly 0 afterwards.

# %%
fig, ax = plt.subplots(figsize=(6.5, 4.0), layout="constrained")
values = [diffs[s] for s in STAGES]
bars = ax.bar(STAGES, values, color=["#c44e52", "#4c72b0", "#55a868"], label="computed in this notebook")
ax.bar_label(bars, labels=[f"{v:.4g}" for v in values], padding=10)
ax.plot(STAGES, [results[0]["all_gather_max_diff"][s] for s in STAGES], "ko", markerfacecolor="none",
        markersize=8, label="all_gather inside the workers (rank 0)")
ax.set_ylabel("max |param(rank r) - param(rank 0)|\n(parameter units, over ranks and entries)")
ax.set_xlabel("stage")
ax.set_title(f"Cross-rank parameter difference, world_size = {world_size}")
ax.set_ylim(0, 1.25 * max(values))
fig.legend(loc="outside lower center", ncol=2, fontsize=8)  # below the axes, never over a bar
plt.show()
assert values[1] == values[2] == 0.0 < values[0], f"the chart should show > 0, then 0, then 0: {values}"


# %% [markdown]
# ## What we saw
#
# * Every rank built a **different** `Linear(5, 5)` from its own seed.
#   `DistributedDataParallel(model)` **broadcast** rank 0's parameters and buffers. Afterwards
#   all ranks were bitwise equal to rank 0's initial values.
# * Each rank then computed its loss and gradient on its **own** data. DDP's backward divided the
#   gradients by `world_size` and **all-reduced** them. So every rank applied the same averaged
#   gradient, and the parameters stayed bitwise identical. They equal
#   `w_rank0 - lr * mean_r(grad_r)`. With equal shards and a mean loss, they also equal one
#   process stepping on the global batch.
# * DDP only synchronises what is registered: parameters and buffers. It broadcasts buffers from
#   rank 0 at construction. With `forward_sync_buffers` on, it broadcasts them again before the
#   first forward. It also does so before a forward whose previous forward ran with gradients,
#   outside `no_sync()`. That is not "before every forward", and train or eval mode does not
#   matter.
# * A plain tensor attribute kept each rank's own value. Counters, masks and caches kept outside
#   parameters and buffers are your job to keep consistent.
#
# ## Exercises
#
# Predict each answer by hand first; exercise 4 asks for code. Put it into `answer_N` in place of
# `None`. Then run the check cell below it. It prints "correct", or "not yet" with a hint. In the
# full notebook, a collapsed solution follows each check. Click the "…" or the bar on its left
# to open it. Student copies leave the solutions out. Every solution runs when the full notebook
# runs, so each is known to pass its check. Only exercise 4 starts processes.

# %% [markdown]
# ### Exercise 1: what rank 1 holds
#
# After the SGD step, what are `rank_buffer[0]` and `rank_attribute[0]` on **rank 1**?
# Answer with a list of two numbers, `[buffer, attribute]`.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, what rank 1 reported
# expected: what rank 1 itself reported from the launch of section 1
after = results[1]["stages"]["after one SGD step"]
expected_1 = [after["rank_buffer"][0].item(), after["rank_attribute"][0].item()]
check_answer("ex1", answer_1, expected_1, hint="which of the two does DDP broadcast from rank 0?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# Both start as 100 + rank = 101 on rank 1. The buffer is registered, so DDP(...) overwrote it
# with rank 0's value, 100 (the first forward broadcast rank 0's 100 again); the plain
# attribute is invisible to DDP and keeps rank 1's own 101.
solution_1 = [100.0, 100.0 + 1]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: a rank with its own learning rate
#
# Suppose rank 1 had built its optimizer with `2 * lr`, while every other rank used `lr`.
# Everything else is unchanged. After the one step, what is the largest
# `|parameter on rank 1 - parameter on rank 0|` over all weight and bias entries? Answer with a
# number. It is small, so give 3 significant digits. What does that say about where identical
# replicas come from: DDP, or every rank doing the same thing?

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, two SGD steps with lr and 2 lr
# expected: two real SGD optimizers (lr and 2 lr) stepping from rank 0's pre-wrap parameters
# with the gradient DDP gave every rank (rank 0's .grad from the launch)
stepped = []
for step_lr in (lr, 2 * lr):
    p = [w0_before.clone().requires_grad_(), b0_before.clone().requires_grad_()]
    p[0].grad, p[1].grad = results[0]["grad"]["weight"].clone(), results[0]["grad"]["bias"].clone()
    torch.optim.SGD(p, lr=step_lr).step()
    stepped.append([t.detach() for t in p])
expected_2 = max(float((a - b).abs().max()) for a, b in zip(stepped[1], stepped[0]))
check_answer("ex2", answer_2, expected_2, rel_tol=5e-3,
             hint="both ranks start equal and get the same gradient g; what differs is lr * g")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# Both ranks start from rank 0's parameters and DDP gives both the same averaged gradient g,
# so rank 1 ends at p - 2 lr g and rank 0 at p - lr g: they differ by lr * |g|, largest where
# |g| is largest. DDP keeps the gradients equal; equal replicas also need every rank to apply
# the same update (same optimizer, same lr, same clipping ...).
solution_2 = lr * max(mean_gw.abs().max().item(), mean_gb.abs().max().item())  # section 2's mean gradient
check_answer("ex2", solution_2, expected_2, rel_tol=1e-3, strict=True)

# %% [markdown]
# ### Exercise 3: how much DDP all-reduces
#
# How many numbers does DDP all-reduce in each backward pass of this `Linear(5, 5)`? Buffers are
# broadcast, not all-reduced. Answer with a whole number.

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 3, the entries DDP all-reduces
# expected: DDP all-reduces one gradient entry per trainable parameter entry
model_0, _, _ = make_replica(0, base_seed, batch_size)
expected_3 = sum(p.numel() for p in model_0.parameters() if p.requires_grad)
check_answer("ex3", answer_3, expected_3, hint="count the entries of the weight and of the bias")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# The weight is 5 x 5 = 25 entries and the bias 5: one gradient entry each, 30 in all
# (120 bytes in float32). rank_buffer is broadcast; rank_attribute is not touched at all.
solution_3 = 5 * 5 + 5
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# ### Exercise 4: DDP's construction-time broadcast, by hand
#
# Write `sync_from_rank0(model)`. Called on every rank, it must leave every rank holding rank 0's
# parameters **and** registered buffers. That is what `DDP(model)` does at construction, as claim
# 2 showed. Use `torch.distributed` collectives. `dist.broadcast(tensor, src=0)` overwrites
# `tensor` in place with rank 0's values, on every rank except rank 0.
#
# Replace the `None` line below with your `def sync_from_rank0(model): ...`. Follow it with
# `answer_4 = sync_from_rank0`. The check builds each rank's own `make_replica(rank, ...)` on
# `world_size` real ranks and calls your function. It compares what every rank then holds with
# rank 0's model rebuilt here.

# %% tags=["exercise"]
answer_4 = None  # your function (def sync_from_rank0(model): ...; answer_4 = sync_from_rank0)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 4, your broadcast on world_size real ranks
def run_sync_with(sync_fn):
    def run_sync(rank, world_size, base_seed):  # the worker: each rank's own model, then sync_fn
        model, _, _ = make_replica(rank, base_seed, 1)
        sync_fn(model)
        state = snapshot(model)
        return [state["weight"].tolist(), state["bias"].tolist(), state["rank_buffer"].tolist(),
                state["rank_attribute"].tolist()]
    return run_sync


# expected on rank r: rank 0's weight, bias and buffer (rebuilt here), and rank r's own plain attribute
model_0, _, _ = make_replica(0, base_seed, 1)
expected_4 = [[model_0.weight.tolist(), model_0.bias.tolist(), model_0.rank_buffer.tolist(), [100.0 + r] * 2]
              for r in range(world_size)]
check_answer("ex4", answer_4, expected_4, run=lambda fn: launch(run_sync_with(fn), world_size, base_seed, backend="gloo"),
             labels=("rank {}'s", ("weight", "bias", "rank_buffer", "rank_attribute")),
             hint="broadcast every parameter and every buffer from rank 0 (model.parameters(), model.buffers())")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 4 (try the exercise first)
# One broadcast per tensor, from rank 0, over parameters and buffers. (DDP coalesces them into
# fewer, larger messages: _sync_module_states in torch/distributed/utils.py.) The plain
# attribute is not in parameters() or buffers(), so it keeps each rank's own value, as under DDP.
def sync_from_rank0_solution(model):
    with torch.no_grad():  # a copy of values, not part of any computation to differentiate
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)  # in place: rank 0's values on every rank


solution_4 = launch(run_sync_with(sync_from_rank0_solution), world_size, base_seed, backend="gloo")
check_answer("ex4", solution_4, expected_4, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [03 the distributed sampler](03_distributed_sampler.ipynb): predict which rank gets which item, and evaluate without padding errors.
# <!-- next:end -->
