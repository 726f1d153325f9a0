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
# # 00b · DDP cell by cell: construction, backward, step, and what goes wrong
#
# <!-- opening:start -->
# **You will be able to** step through DDP cell by cell and predict every rank's weights and gradients. **You need** [00a processes and collectives](00a_processes_and_collectives.ipynb).
# <!-- opening:end -->
#
# **The question:** what happens on every [rank](../docs/GLOSSARY.md#rank) when you build, wrap,
# run and step a [DDP](../docs/GLOSSARY.md#ddp) model, one cell at a time?
#
# As in 00a, a cell that starts with `%%px` runs on **every** warm rank. Its output is labelled
# `[stdout:0]`, `[stdout:1]`. The names it defines are still there in the next `%%px` cell.
# Cells without `%%px` run in this notebook's own process, the *kernel*. There we check the
# ranks' values. A bold "Claim:" is asserted by the code after it, in a folded cell tagged
# `check`. Click a folded cell to read its code.
#
# **Names on every rank:** `rank`, [`world_size`](../docs/GLOSSARY.md#world-size), `device`,
# `torch`, and `dist` for `torch.distributed`.
#
# 1. DDP one cell at a time · 2. `all_gather` cuts autograd · 3. initialising twice · 4. a
# collective only one rank calls
#
# **What runs where:** `world_size` ipyparallel engines, backend `gloo`, tensors on CPU. It is the
# same with or without GPUs: this lesson is about *what* DDP does, not speed.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 2  # number of warm ranks (processes): 2, 3 or 4; every asserted value is worked out from it
hang_timeout = 3.0  # seconds section 4's deliberate hang waits before RanksTimeout ends it

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import assert_close_once, check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int), hang_timeout=(hang_timeout, float))
check_value("world_size", world_size, world_size in (2, 3, 4),
            "2, 3 or 4 (one rank has nobody to average with; more ranks than a laptop's cores only slow every cell)")
check_value("hang_timeout", hang_timeout, hang_timeout > 0, "greater than 0 seconds")

# %%
import os

import pandas as pd
import torch
from IPython.display import display
from torch.testing import assert_close

print(f"torch {torch.__version__}; this kernel's pid is {os.getpid()}; world_size = {world_size}")

# %% [markdown]
# Start the warm ranks, as in 00a, section 1. They are `world_size` fresh Python processes with
# the default process group initialised, and `%%px` points at them. The cell is slow the first
# time: the engines start and import torch. Section 4 compares the ranks' pids with these.

# %%
# After a kernel restart: run the parameters cell (world_size, hang_timeout), then this cell.
# Every %%px cell needs it (without it: "Cell magic `%%px` not found").
from helpers.engine import start_ranks

timeout = 60.0  # seconds a %%px cell or ranks.run may take before the ranks are ended and restarted
ranks = start_ranks(world_size=world_size, backend=None, timeout=timeout)


def pid_of(rank, world_size):
    import os
    return os.getpid()


pids = ranks.run(pid_of)  # each rank's process id, in rank order
print(f"warm ranks' pids: {pids}")

# %% [markdown]
# ## 1. DDP, one cell at a time
#
# Lesson [02](02_one_model_many_processes.ipynb) runs this story in one go. Every rank builds its
# own `Linear(5, 5)` from its **own** seed and wraps it in `DistributedDataParallel`. It runs a
# forward pass on its own data, backward, and one SGD step. Here each stage is its own `%%px`
# cell. After each, we fetch every rank's tensors into this kernel. We check them against a
# computation done here, in one process, without DDP.
#
# Each `%%px` cell keeps a copy of what we want to see in a name, such as `weight` or `grad`.
# `ranks.view` is ipyparallel's `DirectView` over the ranks, in rank order.
# `ranks.view.pull("weight", block=True)` returns every rank's `weight`.
#
# First the model, built on every rank with `torch.manual_seed(rank)`.

# %%
# %%px
torch.manual_seed(rank)  # a different seed on every rank, on purpose
model = torch.nn.Linear(5, 5)
weight = model.weight.detach().clone()  # a copy, for this kernel to pull
print(f"[rank {rank}] weight[0] = {[round(v, 4) for v in weight[0].tolist()]}")


# %% [markdown]
# **Claim:** the ranks' weights differ, and each is exactly what `Linear(5, 5)` gives after
# `torch.manual_seed(rank)`, rebuilt here.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each rank's weights come from its own seed
def rebuilt(r):
    torch.manual_seed(r)
    return torch.nn.Linear(5, 5)


weights_before = ranks.view.pull("weight", block=True)  # [rank 0's weight, rank 1's, ...]
for r in range(world_size):
    assert_close(weights_before[r], rebuilt(r).weight.detach(), rtol=0, atol=0)
distinct = {tuple(w.flatten().tolist()) for w in weights_before}
assert len(distinct) == world_size, "the ranks should start different"
for r in range(1, world_size):
    print(f"max |rank {r} - rank 0| before DDP:", (weights_before[r] - weights_before[0]).abs().max().item())

# %% [markdown]
# Now wrap it. `DistributedDataParallel(model)` is itself a collective. At construction it
# broadcasts rank 0's parameters and buffers to every rank, in place, into `model`. The next
# cell is slower the first time: the ranks import DDP's modules.

# %%
# %%px
from torch.nn.parallel import DistributedDataParallel as DDP

ddp_model = DDP(model)
weight = model.weight.detach().clone()
print(f"[rank {rank}] weight[0] = {[round(v, 4) for v in weight[0].tolist()]}")

# %% [markdown]
# **Claim:** after wrapping, every rank holds rank 0's original weights, bit for bit.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank holds rank 0's weights
weights_wrapped = ranks.view.pull("weight", block=True)
for r in range(world_size):
    assert_close(weights_wrapped[r], rebuilt(0).weight.detach(), rtol=0, atol=0)
print("every rank now holds rank 0's weights")

# %% [markdown]
# Forward and backward, each rank on its **own** data, seeded with `100 + rank`. The loss is
# the mean squared error. `loss.backward()` computes the local gradient. During backward, DDP
# all-reduces the gradients and averages them. So every rank ends with the same `.grad`.

# %%
# %%px
torch.manual_seed(100 + rank)
x, y = torch.randn(4, 5), torch.randn(4, 5)  # 4 samples of this rank
loss = torch.nn.functional.mse_loss(ddp_model(x), y)
loss.backward()
grad = model.weight.grad.clone()
print(f"[rank {rank}] loss {loss.item():.4f}; weight.grad[0, :3] = {[round(v, 4) for v in grad[0, :3].tolist()]}")

# %% [markdown]
# Here, in the kernel, we compute each rank's gradient with a plain `Linear(5, 5)`. It has rank
# 0's weights and rank `r`'s data, with no DDP and no process group. Then we average them.
#
# **Claim:** the gradients are equal on every rank, and equal to the **mean of the local
# gradients**.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the gradient is the mean of the local gradients
grads = ranks.view.pull("grad", block=True)
local_grads = []
for r in range(world_size):
    plain = rebuilt(0)  # the weights every rank holds after the broadcast
    torch.manual_seed(100 + r)
    x_r, y_r = torch.randn(4, 5), torch.randn(4, 5)
    torch.nn.functional.mse_loss(plain(x_r), y_r).backward()
    local_grads.append(plain.weight.grad)
mean_grad = sum(local_grads) / world_size
assert all(torch.equal(g, grads[0]) for g in grads), "DDP leaves the same gradient on every rank"
assert_close_once(grads[0], mean_grad, what="rank 0's weight.grad",
                  rerun_from="the first %%px cell of section 1 (`model = torch.nn.Linear(5, 5)`)")
assert not any(torch.allclose(g, local_grads[0]) for g in local_grads[1:]), "the local gradients differ (different data)"
print("max |DDP grad - mean of local grads|:", (grads[0] - mean_grad).abs().max().item())

# %% [markdown]
# One SGD step with learning rate 0.1 on every rank.

# %%
# %%px
opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
opt.step()
weight = model.weight.detach().clone()
print(f"[rank {rank}] weight[0] after the step = {[round(v, 4) for v in weight[0].tolist()]}")

# %% [markdown]
# **Claim:** the weights are still equal on every rank: same start, same gradient, same step.
# They equal rank 0's initial weights minus 0.1 times the mean gradient.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the replicas are equal after one SGD step
weights_after = ranks.view.pull("weight", block=True)
replicas_equal = all(torch.equal(w, weights_after[0]) for w in weights_after)
assert replicas_equal, "the replicas differ after the step: re-run from the cell `model = torch.nn.Linear(5, 5)`"
assert_close(weights_after[0], rebuilt(0).weight.detach() - 0.1 * mean_grad)
print("replicas equal after the step:", replicas_equal)

# %% [markdown]
# ## 2. `all_gather` cuts autograd
#
# The parameter `w` is 1, and rank `r` holds `x = 2 r + 1`: 1, 3, 5, and so on. Every rank
# gathers all the `w * x` and takes `loss = sum`. In one process, with all the x's,
# `loss = w * 1 + w * 3 + …` and d loss / d w is the sum of the x's. The first `world_size` odd
# numbers sum to `world_size²`: 4 with two ranks. In DDP each rank computes the *same* loss.
# Then the gradients are averaged, as DDP's backward does. So the averaged gradient should be
# `world_size²` too.
#
# `dist.all_gather` returns no graph. We put the rank's own slot back into the list, so at
# least the local term has a gradient. `torch.distributed.nn.functional.all_gather` is
# autograd-aware. Its backward sums each slot's gradient over the ranks and returns it to the
# rank that owns the slot: a reduce_scatter.
#
# | gather | rank `r`'s gradient | averaged over the ranks |
# |---|---|---|
# | `dist.all_gather`, own slot put back | `x` | `world_size`: the one-process gradient divided by `world_size` |
# | `torch.distributed.nn.functional.all_gather` | `world_size · x` | `world_size²`: the one-process gradient |
#
# **Claim:** each gather gives the gradients of the table above. So `dist.all_gather` gives half
# the right answer with two ranks.

# %%
# %%px
import warnings

import torch.distributed.nn.functional as distnn

x = torch.tensor(1.0 + 2 * rank)  # 1 on rank 0, 3 on rank 1, 5 on rank 2, ...

w = torch.tensor(1.0, requires_grad=True)
slots = [torch.zeros(()) for _ in range(world_size)]
dist.all_gather(slots, (w * x).detach())
slots[rank] = w * x  # put the local term, with its graph, back
torch.stack(slots).sum().backward()
grad_plain = w.grad.clone()

w = torch.tensor(1.0, requires_grad=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 suggests a private successor
    gathered = distnn.all_gather(w * x)
torch.stack(list(gathered)).sum().backward()
grad_autograd = w.grad.clone()

averaged = torch.stack([grad_plain, grad_autograd])
dist.all_reduce(averaged, op=dist.ReduceOp.AVG)  # what DDP's backward does to gradients
print(f"[rank {rank}] dist.all_gather: grad {grad_plain.item()} (averaged {averaged[0].item()}); "
      f"nn.functional.all_gather: grad {grad_autograd.item()} (averaged {averaged[1].item()})")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: dist.all_gather loses terms; the autograd one keeps them
again = "re-run the %%px cell above (it builds `w` again), then this one"
assert grad_plain.item() == x.item() and grad_autograd.item() == world_size * x.item(), (
    f"rank {rank}: grad_plain {grad_plain.item()}, grad_autograd {grad_autograd.item()}, x {x.item()}; {again}")
one_process = float(world_size**2)  # 1 + 3 + ... + (2 world_size - 1)
assert averaged.tolist() == [one_process / world_size, one_process], (
    f"rank {rank}: averaged is {averaged.tolist()}, expected {[one_process / world_size, one_process]}; {again}")

# %% [markdown]
# Now the one-process gradient, here in the kernel, with every rank's x in one tensor.
#
# **Claim:** the one-process gradient is `world_size²`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the one-process gradient is world_size²
w = torch.tensor(1.0, requires_grad=True)
every_x = torch.tensor([1.0 + 2 * r for r in range(world_size)])
(w * every_x).sum().backward()
print(f"x = {every_x.tolist()}: one-process gradient {w.grad.item()}")
assert w.grad.item() == world_size**2, f"w.grad is {w.grad.item()}, not {world_size**2}: run this cell once (it builds w itself)"

# %% [markdown]
# ## 3. Initialising the process group twice
#
# <a id="case-init-twice"></a>
# **Symptom:** init_process_group fails when I run the cell again.
#
# Re-running the cell that calls `init_process_group` is the most common notebook accident.
# The function below runs on the warm ranks, whose default group is already initialised. It
# tries a second init. Then it destroys the group, initialises a new one and destroys twice.
# Each new group meets on a fresh port. `free_port()` asks the operating system for one: it binds
# port 0 and reads the port it got.
#
# The function leaves a working group behind for the rest of the lesson. On torch 2.14.1:
#
# | step | result |
# |---|---|
# | second `init_process_group` | `ValueError`: "trying to initialize the default process group twice!" |
# | `is_initialized()` after `destroy_process_group()` | `False` |
# | init again, `all_reduce` of ones | works, gives `world_size` |
# | destroy with no group | `AssertionError`: "Process group cannot be None" |
#
# **Claim:** each step gives the result in its row of the table.

# %%
from helpers.engine import free_port  # a port nobody listens on now: bind port 0, read the port the OS gave


def init_twice(rank, world_size, port, port_after, timeout_s):
    import datetime

    import torch
    import torch.distributed as dist
    seen = {"rank": rank}
    url = f"tcp://127.0.0.1:{port}"
    try:
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
        seen["second init"] = "no error"
    except ValueError as e:
        seen["second init"] = f"ValueError: {e}"
    dist.destroy_process_group()
    seen["initialized after destroy"] = dist.is_initialized()
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    t = torch.ones(1)
    dist.all_reduce(t)
    seen["all_reduce after re-init"] = t.item()
    dist.destroy_process_group()
    try:
        dist.destroy_process_group()
        seen["second destroy"] = "no error"
    except Exception as e:  # noqa: BLE001 - we record whatever it raises
        seen["second destroy"] = f"{type(e).__name__}: {e}"
    # leave a working default group for the rest of the lesson, on another fresh port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_after}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return seen


twice = pd.DataFrame(ranks.run(init_twice, free_port(), free_port(), timeout)).set_index("rank")
display(twice)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: init twice, destroy, init again, destroy twice
assert all(s.startswith("ValueError: trying to initialize the default process group twice") for s in twice["second init"]), (
    f"second init: {list(twice['second init'])}; re-run the cell above, then this one")
assert not twice["initialized after destroy"].any(), f"initialized after destroy: {list(twice['initialized after destroy'])}"
assert set(twice["all_reduce after re-init"]) == {float(world_size)}, f"all_reduce gave {list(twice['all_reduce after re-init'])}"
assert all(s == "AssertionError: Process group cannot be None" for s in twice["second destroy"]), twice["second destroy"]

# %% [markdown]
# ## 4. A collective that only one rank calls: a hang, ended by the timeout
#
# <a id="case-one-rank-stops-early"></a>
# **Symptom:** it hangs when one rank stops early.
#
# "My DDP job hangs" is usually this: one rank calls a collective and the others never do. Here
# it is an `all_reduce`. In DDP it can be a backward on one rank only, or a `barrier` inside
# `if rank == 0`. The rank waits for ever: gloo's default timeout is 30 minutes.
#
# The warm ranks watch every call. Past its `timeout` they raise `RanksTimeout`, naming the ranks
# that had not finished. They end **all** ranks: a group with a rank stuck in a collective cannot
# be trusted. They start fresh ones by themselves before the next call. We give this call a limit
# of `hang_timeout` seconds, a parameter. So the next cell waits that long before it raises.
#
# **Claim:** the call raises `RanksTimeout` naming rank 0 as not finished. Every other rank
# skipped the collective and returned at once.

# %%
from helpers.engine import RanksTimeout


def only_rank_0_reduces(rank, world_size):
    import torch
    import torch.distributed as dist
    if rank == 0:  # the bug: the other ranks never join this all_reduce
        t = torch.ones(1)
        dist.all_reduce(t)
    return rank


try:
    ranks.run(only_rank_0_reduces, timeout=hang_timeout)
    hang = None
except RanksTimeout as e:
    hang = e
print(f"{type(hang).__name__}: {hang}")

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: RanksTimeout names rank 0
assert isinstance(hang, RanksTimeout) and hang.ranks_not_finished == [0], (
    f"{hang!r}: re-run the cell above (`only_rank_0_reduces`), then this one")

# %% [markdown]
# The next cell is slow again: fresh engines start and import torch. After a restart, run your
# set-up cells again.
#
# **Claim:** the next call runs on fresh ranks. They are new processes, with new pids, and a
# working process group. None of the names earlier `%%px` cells defined is left: `model` and
# `weight` are gone.

# %%
def after_restart(rank, world_size):
    import os

    import torch
    import torch.distributed as dist

    import __main__
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"rank": rank, "pid": os.getpid(), "all_reduce": t.item(), "has model": hasattr(__main__, "model"),
            "has weight": hasattr(__main__, "weight")}


fresh_ranks = pd.DataFrame(ranks.run(after_restart)).set_index("rank")
display(fresh_ranks)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: fresh processes, a working group, no old names
assert not set(fresh_ranks["pid"]) & set(pids), "fresh ranks are new processes"
assert set(fresh_ranks["all_reduce"]) == {float(world_size)} and not fresh_ranks["has model"].any(), (
    f"fresh ranks:\n{fresh_ranks}\nre-run from the cell with `only_rank_0_reduces`, then this one")
assert not fresh_ranks["has weight"].any(), "the names of earlier %%px cells are gone"

# %% [markdown]
# ## What we saw
#
# - DDP's construction is a collective: it broadcasts rank 0's parameters and buffers. So ranks
#   that started from different seeds hold rank 0's weights, bit for bit.
# - Its backward all-reduces the gradients and averages them. Every rank ends with the same
#   `.grad`, the mean of the local gradients. One optimizer step then keeps the replicas
#   identical. Running the backward cell again adds to `.grad`: gradients accumulate. Re-run from
#   the cell that builds the model.
# - `dist.all_gather` returns tensors without a graph. Gradients through it miss the other
#   ranks' terms: here the gradient is divided by `world_size`.
#   `torch.distributed.nn.functional.all_gather` keeps them.
# - Initialising the default group twice raises `ValueError`. Destroy it first.
# - A collective only one rank calls hangs. The warm ranks' timeout ends it and names the ranks
#   that had not finished. The next call runs on fresh ranks, with none of the old names.
#
# ## Exercises
#
# Write the answer in the cell after each task and run it. Then run the check cell below it. In
# the full lesson a collapsed solution follows each check. Student copies leave the solutions
# out.

# %% [markdown]
# ### Exercise 1: predict a DDP gradient
#
# Every rank builds `torch.nn.Linear(1, 1, bias=False)` with its weight set to 1 and wraps it in
# DDP. It runs `loss = (ddp_model(x) ** 2).sum()` on `x = torch.tensor([[rank + 1.0]])`, then
# `loss.backward()`. What is `weight.grad` on rank 0 afterwards? Answer with a number, worked
# out by hand: d/dw of `(w x)²` is `2 w x²`. The check cell runs exactly this on the warm ranks.

# %% tags=["exercise"]
answer_1 = None  # your answer here


# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, DDP's gradient on rank 0
def ddp_grad(rank, world_size):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp_model = DDP(model)
    (ddp_model(torch.tensor([[rank + 1.0]])) ** 2).sum().backward()
    return model.weight.grad.item()


ranks = start_ranks(world_size=world_size, backend=None, timeout=timeout)  # the running ranks, or fresh ones
expected_1 = ranks.run(ddp_grad)[0]
check_answer("ex1", answer_1, expected_1, hint="DDP averages the ranks' local gradients")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
local = [2 * 1.0 * (r + 1.0) ** 2 for r in range(world_size)]  # 2 w x^2 on each rank: 2, 8, 18, ...
solution_1 = sum(local) / world_size  # DDP averages them: 5 with two ranks
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: a squared loss through `all_gather`
#
# Section 2 again, with a squared loss. `w = 1` and rank `r` holds `x = r + 1`: 1, 2, and so on.
# Every rank gathers all the `w * x` and takes `loss = sum of their squares`. Then the gradients
# are averaged over the ranks. What averaged `w.grad` do you get with your `world_size` ranks?
#
# - `a`: with `dist.all_gather` and the rank's own slot put back;
# - `b`: with `torch.distributed.nn.functional.all_gather`.
#
# Work it out by hand: d/dw of `(w x)²` is `2 w x²`. The one-process gradient is
# `2 · (1² + 2² + … + world_size²)`, 10 with two ranks. Answer with a list of two numbers,
# `[a, b]`. The check cell runs both on the warm ranks.

# %% tags=["exercise"]
answer_2 = None  # your answer here


# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, both averaged gradients
def squared_through_gather(rank, world_size):
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as distnn
    x = torch.tensor(rank + 1.0)
    w = torch.tensor(1.0, requires_grad=True)
    slots = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(slots, (w * x).detach())
    slots[rank] = w * x
    (torch.stack(slots) ** 2).sum().backward()
    plain = w.grad.clone()
    w = torch.tensor(1.0, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        gathered = distnn.all_gather(w * x)
    (torch.stack(list(gathered)) ** 2).sum().backward()
    grads = torch.stack([plain, w.grad])
    dist.all_reduce(grads, op=dist.ReduceOp.AVG)
    return grads.tolist()


ranks = start_ranks(world_size=world_size, backend=None, timeout=timeout)  # the running ranks, or fresh ones
expected_2 = ranks.run(squared_through_gather)[0]
check_answer("ex2", answer_2, expected_2,
             hint="(a) each rank's gradient has only its own term, 2 x²; (b) every term reaches its owner")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
own = [2 * 1.0 * (r + 1.0) ** 2 for r in range(world_size)]  # (a) rank r keeps only 2 w x_r^2: 2, 8, 18, ...
autograd = [world_size * g for g in own]  # (b) the backward sums slot r's gradient over the ranks
solution_2 = [sum(own) / world_size, sum(autograd) / world_size]  # averaged: the one-process gradient / world_size, and it
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# Done: stop the warm ranks. Their processes end. `ranks.stop()` may be called again safely. An
# exercise's check cell run after this starts fresh ranks by itself.

# %%
ranks.stop()

# %% [markdown]
# <!-- next:start -->
# **Next:** [01 gradients: DP vs DDP](01_gradients_dp_vs_ddp.ipynb): explain why a DDP gradient is the mean over ranks, and write that average by hand.
# <!-- next:end -->
