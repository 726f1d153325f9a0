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
# # 00a · Processes and collectives
#
# <!-- opening:start -->
# **You will be able to** say which processes a DDP job is; predict what each collective returns on live ranks (`%%px`). **You need** PyTorch basics.
# <!-- opening:end -->
#
# **The question:** what *is* a DDP job, line by line? Which processes exist? What does each
# collective leave in each process's tensors? The collectives are `all_reduce`, `broadcast`,
# `reduce`, `all_gather` and `reduce_scatter`.
#
# No helper hides the distributed code here: **every line of it is in the cells**. We start
# `world_size` *warm ranks*. They are persistent Python processes, ipyparallel engines. Each has
# the default [process group](../docs/GLOSSARY.md#process-group) already initialised. Its
# [backend](../docs/GLOSSARY.md#backend) is `gloo` on CPU.
#
# A cell that starts with `%%px` runs on **every** [rank](../docs/GLOSSARY.md#rank). Each rank's
# output appears labelled `[stdout:0]`, `[stdout:1]`. The names a `%%px` cell defines are still
# there in the next `%%px` cell. Cells without `%%px` run here, in this notebook's own process:
# the *kernel*. That is where we check the ranks' values. A bold "Claim:" is asserted by the code
# after it, in a folded cell tagged `check`. Click a folded cell to read its code.
#
# **Names on every rank**, defined by `start_ranks`: `rank`, from 0 to `world_size - 1`;
# [`world_size`](../docs/GLOSSARY.md#world-size); `device`; `torch`; `dist`, that is
# `torch.distributed`. The [glossary](../docs/GLOSSARY.md) defines every term, with its Chinese
# name.
#
# **What runs where:** `world_size` ipyparallel engines, backend `gloo`, tensors on CPU, with or
# without GPUs: this lesson is about *what* the collectives do.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 2  # number of warm ranks (processes): 2, 3 or 4; every asserted value is worked out from it

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int))
check_value("world_size", world_size, world_size in (2, 3, 4),
            "2, 3 or 4 (one rank has nobody to exchange with; more ranks than a laptop's cores only slow every cell)")

# %%
import os
import pickle
import subprocess
import sys

import cloudpickle
import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
from IPython.display import display

from helpers.engine import launch

print(f"torch {torch.__version__}; this kernel's pid is {os.getpid()}; world_size = {world_size}")

# %% [markdown]
# ## 1. Processes and ranks
#
# `start_ranks` starts `world_size` ipyparallel engines. They are Python processes, not copies of
# this kernel. It gives each its `rank` and initialises the default process group on all of them.
# It also makes `%%px` send cells to them. The next cell is slow the first time: a server process
# starts and imports torch. After that, a `%%px` cell costs milliseconds.

# %%
# After a kernel restart: run the parameters cell (world_size), then this cell.
# Every %%px cell needs it (without it: "Cell magic `%%px` not found").
from helpers.engine import start_ranks

timeout = 60.0  # seconds a %%px cell, ranks.run or helpers.mp.spawn may take before the ranks are ended
ranks = start_ranks(world_size=world_size, backend=None, timeout=timeout)

# %% [markdown]
# Each rank says who it is. `dist.get_rank()` and `dist.get_world_size()` ask the process group,
# so they are the group's view, not the names `start_ranks` defined.

# %%
# %%px
import os

print(f"[rank {rank}/{world_size}] pid {os.getpid()}, "
      f"device {device}, backend {dist.get_backend()}, group rank {dist.get_rank()} of {dist.get_world_size()}")

# %% [markdown]
# `ranks.run(fn)` calls `fn(rank, world_size)` on every rank. It returns the results in rank
# order. Here each rank returns its pid and its group's view of itself.
#
# **Claim:** the ranks are `world_size` separate processes, none of them this notebook's
# kernel: each has its own pid. The process group agrees with the names: on every rank
# `dist.get_rank() == rank` and `dist.get_world_size() == world_size`.
#
# **Claim (CPU):** without GPUs the backend is `gloo`.

# %%
def who_am_i(rank, world_size):
    import os

    import torch.distributed as dist
    return {"rank": rank, "pid": os.getpid(), "group rank": dist.get_rank(),
            "group size": dist.get_world_size(), "backend": dist.get_backend()}


who = pd.DataFrame(ranks.run(who_am_i)).set_index("rank")
display(who)
pids = list(who["pid"])

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: one process per rank, the group's view of it, gloo on CPU
assert len(set(pids)) == world_size and os.getpid() not in pids, f"pids {pids}, kernel {os.getpid()}"
assert list(who["group rank"]) == list(range(world_size)) and set(who["group size"]) == {world_size}, (
    f"group ranks {list(who['group rank'])}, group sizes {list(who['group size'])}: re-run from the cell "
    "`ranks = start_ranks(...)`, then the cells after it")
from helpers.notebook import cpu_claim

if cpu_claim("without GPUs the backend is gloo"):
    assert set(who["backend"]) == {"gloo"}, f"backends {list(who['backend'])}, expected gloo on CPU"

# %% [markdown]
# ## 2. Why spawn (or a fork server), never fork
#
# A process can start another in three ways. **fork** copies the running process, memory and
# all. So the child has everything the parent had, including the notebook's functions. **spawn**
# starts a fresh Python interpreter that *imports* what it needs. **forkserver** starts one fresh
# interpreter, a *server*, the first time. Then it forks each new process from that server, not
# from the notebook. The warm ranks are forked from such a server, a fresh interpreter that
# imported torch once. They are not forked from this kernel.
#
# **Claim:** the ranks are not copies of this kernel. A name defined in this kernel does not
# exist in a rank's `__main__`. Every rank has the same parent process, which is not this kernel.

# %%
kernel_only = "defined in the kernel"


def inherited(rank, world_size):
    import os
    import sys
    return {"rank": rank, "has kernel_only": "kernel_only" in vars(sys.modules["__main__"]),
            "parent pid": os.getppid()}


fresh = pd.DataFrame(ranks.run(inherited)).set_index("rank")
display(fresh)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the ranks lack the kernel's names and share one parent
assert not fresh["has kernel_only"].any(), f"a rank has the kernel's `kernel_only`:\n{fresh}\nre-run the cell above, then this one"
parents = set(fresh["parent pid"])
assert len(parents) == 1 and os.getpid() not in parents, f"parents {parents}, kernel {os.getpid()}"

# %% [markdown]
# So a `%%px` cell cannot read a kernel variable. `ranks.push({"name": value})` sends a value to
# every rank under that name. `ranks.pull("name")` returns each rank's value, in rank order.
#
# **Claim:** a `%%px` line that reads `kernel_only` raises a `NameError`. Its message says the
# name is the kernel's and shows `ranks.push`. After the push, every rank holds the kernel's
# string.

# %%
from helpers.engine import WorkerError

try:
    ranks.execute("print(kernel_only)")  # what a %%px cell with this line runs
    missing = None
except WorkerError as e:
    missing = e
print(missing.message if missing else "no error")
ranks.push({"kernel_only": kernel_only})

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the NameError names the kernel and ranks.push; the push arrives
assert missing is not None, "the line should have raised on the ranks: re-run the cell above, then this one"
assert missing.exc_type == "NameError" and "kernel" in missing.message and "ranks.push" in missing.message, missing.message
assert ranks.pull("kernel_only") == [kernel_only] * world_size, f"the ranks hold {ranks.pull('kernel_only')}"

# %% [markdown]
# Such a process cannot import this notebook. Plain `pickle` sends a function **by reference**, as
# a module and a name. The receiver looks the name up in *its* `__main__`, where a cell's function
# does not exist: `AttributeError: Can't get attribute 'square' on <module '__main__'>`.
# `cloudpickle` sends it **by value**, as its code. The warm ranks and `launch` use it.
#
# **Claim:** a fresh Python process, exactly what spawn starts, fails to load a plain-pickled
# cell function with `AttributeError`. It runs the same function sent with `cloudpickle`.

# %%
def square(x):
    return x * x


def in_a_fresh_process(payload: bytes) -> subprocess.CompletedProcess:
    # a new interpreter that unpickles a function from stdin and calls it with 7
    code = "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(f(7))"
    # PYTHON_COLORS=0: plain-text tracebacks (the kernel sets FORCE_COLOR=1, which Python 3.13+ obeys)
    return subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=60,
                          env={**os.environ, "PYTHON_COLORS": "0"})


by_reference = in_a_fresh_process(pickle.dumps(square))
by_value = in_a_fresh_process(cloudpickle.dumps(square))
print("plain pickle:", by_reference.stderr.decode().strip().splitlines()[-1])
print("cloudpickle: ", by_value.stdout.decode().strip())

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: plain pickle fails by reference; cloudpickle runs by value
assert by_reference.returncode != 0 and "AttributeError: Can't get attribute 'square'" in by_reference.stderr.decode(), (
    by_reference.stderr.decode()[-500:])
assert by_value.returncode == 0 and by_value.stdout.decode().strip() == str(square(7)), by_value

# %% [markdown]
# That is the crash of the PyTorch DDP tutorial's `mp.spawn(demo_basic, ...)` pasted into a
# notebook: every process it starts dies with this `AttributeError`. The fix is one line,
# `import helpers.mp as mp`. Its `mp.spawn` takes torch's arguments and calls `fn(i, *args)` in
# process `i`. But it sends `fn` by value, and returns each process's result in order.
# docs/OWN_CODE.md lists the tutorial's other edits for a CPU.
#
# **Claim:** `helpers.mp.spawn` runs the cell-defined `square` in `world_size` fresh processes,
# as `square(i)` in process `i`. It returns the squares of 0 to `world_size - 1`, in order.

# %%
import helpers.mp as mp  # instead of: import torch.multiprocessing as mp

spawned = mp.spawn(square, nprocs=world_size, timeout=timeout)
print("helpers.mp.spawn(square):", spawned)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: helpers.mp.spawn returns the squares, in order
assert spawned == [i * i for i in range(world_size)], f"helpers.mp.spawn returned {spawned}"

# %% [markdown]
# So why not fork this kernel, which would simply copy `square`? Because of what else it copies.
#
# **On a GPU**, stated here, not run: showing it would mean forking this kernel, the very thing
# to avoid. Once a process has touched CUDA, a forked child cannot use CUDA. One `torch.cuda`
# call is enough, and a notebook usually has made one. The child fails with
# `RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use the 'spawn' start method`.
# Source: the PyTorch docs,
# ["CUDA in multiprocessing"](https://pytorch.org/docs/stable/notes/multiprocessing.html#cuda-in-multiprocessing),
# and `_lazy_init` in `torch/cuda/__init__.py`, which raises it.
#
# The CPU part we can run here. Forking copies a process's memory but only the thread that
# called `fork`. A lock another thread held stays locked in the child, for ever. Python's docs on
# [`os.fork`](https://docs.python.org/3/library/os.html#os.fork) warn against forking a
# multi-threaded process. A Jupyter kernel always runs several threads. And on Linux, before
# Python 3.14, fork is what `multiprocessing.Process` and `multiprocessing.Pool` use unless told
# otherwise. `torch.multiprocessing.spawn` does use spawn.
#
# **Claim:** this kernel runs more than one thread, so a fork would copy a multi-threaded
# process. On Linux with Python < 3.14 the default start method is `fork`. So never forking this
# kernel has to be a choice.

# %%
import multiprocessing
import threading

print(f"threads in this kernel: {threading.active_count()} ({', '.join(t.name for t in threading.enumerate())})")
print(f"multiprocessing's default start method here: {multiprocessing.get_start_method()} "
      f"(Python {sys.version_info.major}.{sys.version_info.minor}, {sys.platform})")

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: several threads here; fork is the default start method
assert threading.active_count() > 1, f"{threading.active_count()} thread in this kernel"
if sys.platform == "linux" and sys.version_info < (3, 14):
    assert multiprocessing.get_start_method() == "fork", f"the default start method is {multiprocessing.get_start_method()}"

# %% [markdown]
# The third way is the one `launch` uses, and lesson [02](02_one_model_many_processes.ipynb) runs
# DDP with it: ranks forked from a fork server that imported torch once.
# [docs/ARCHITECTURE.md](../docs/ARCHITECTURE.md#the-fork-server-what-it-buys-and-what-it-costs)
# shows how.
#
# **Claim:** a function defined in this cell runs on every rank through `launch`. The results
# come back in rank order. The ranks are new processes, not the warm ranks. Like the warm ranks,
# they do not have the kernel's names.

# %%
def rank_report(rank, world_size):
    import os
    import sys

    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "pid": os.getpid(), "all_reduce": t.item(),
            "has kernel_only": "kernel_only" in vars(sys.modules["__main__"])}


launched = launch(rank_report, world_size, timeout=timeout)
display(pd.DataFrame(launched).set_index("rank"))

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: launch's ranks: rank order, the sum, new processes
assert [r["rank"] for r in launched] == list(range(world_size)), f"ranks {[r['rank'] for r in launched]}"
assert all(r["all_reduce"] == sum(range(1, world_size + 1)) and not r["has kernel_only"] for r in launched), launched
assert not set(r["pid"] for r in launched) & set(pids), "launch starts new processes, not the warm ranks"

# %% [markdown]
# ## 3. The collectives by hand
#
# A *collective* is a call that **every** rank of the group makes. It returns when its part of
# the exchange is done. It writes the result **in place** into the tensors passed in. Rank `r`
# starts with `torch.tensor([r + 1.])`: rank 0 holds 1, rank 1 holds 2, and so on up to
# `world_size`.
#
# Predict each result before you run a cell. Each `%%px` cell below runs the collective on every
# rank and prints what each rank holds. The check after it asserts the result on every rank. An
# `AssertionError` on any rank fails the cell. A formula gives the expected values from the
# inputs, without calling the collective.
#
# **Claim:** `all_reduce` with `SUM` leaves the sum of all ranks' values on every rank:
# 1 + 2 + … + `world_size`, that is `world_size (world_size + 1) / 2`. With `AVG` it leaves the
# mean, `(world_size + 1) / 2`.

# %%
# %%px
t = torch.tensor([rank + 1.0])
dist.all_reduce(t, op=dist.ReduceOp.SUM)
print(f"[rank {rank}] all_reduce SUM -> {t.tolist()}")
t_avg = torch.tensor([rank + 1.0])
dist.all_reduce(t_avg, op=dist.ReduceOp.AVG)
print(f"[rank {rank}] all_reduce AVG -> {t_avg.tolist()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: SUM and AVG on every rank
assert t.tolist() == [world_size * (world_size + 1) / 2], (
    f"rank {rank}: t is {t.tolist()}, not the SUM: a later cell changed t; re-run the %%px cell above "
    "(`dist.all_reduce(t, ...)`), then this one")
assert t_avg.tolist() == [(world_size + 1) / 2], (
    f"rank {rank}: t_avg is {t_avg.tolist()}; re-run the %%px cell above (`dist.all_reduce(t, ...)`), then this one")

# %% [markdown]
# **Claim:** `broadcast(t, src=1)` copies rank 1's tensor into every rank's `t`: all hold 2,
# whatever `world_size` is.

# %%
# %%px
t = torch.tensor([rank + 1.0])
dist.broadcast(t, src=1)
print(f"[rank {rank}] broadcast from rank 1 -> {t.tolist()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: every rank holds rank 1's value
assert t.tolist() == [2.0], (f"rank {rank}: t is {t.tolist()}, not rank 1's 2.0: another cell changed t; "
                             "re-run the %%px cell above (`dist.broadcast(t, src=1)`), then this one")

# %% [markdown]
# **Claim:** `reduce(t, dst=0)` leaves the sum on the destination, rank 0: the same
# `world_size (world_size + 1) / 2` as `all_reduce`. What it leaves on the *other* ranks is not
# the sum; section 4 shows what.

# %%
# %%px
t = torch.tensor([rank + 1.0])
dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
print(f"[rank {rank}] reduce SUM to rank 0 -> {t.tolist()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: the sum on rank 0 only
again = "re-run the %%px cell above (`dist.reduce(t, dst=0, ...)`), then this one"
if rank == 0:
    assert t.tolist() == [world_size * (world_size + 1) / 2], f"rank 0: t is {t.tolist()}, not the sum; {again}"
else:  # not the sum on the other ranks
    assert t.tolist() != [world_size * (world_size + 1) / 2], f"rank {rank}: t is {t.tolist()}; {again}"

# %% [markdown]
# `all_gather(out, t)` takes a list `out` of one tensor per rank, each the size of `t`.
#
# **Claim:** `all_gather(out, t)` fills `out` with every rank's `t`, in rank order, on every
# rank: `[[1.], [2.], …, [world_size]]`.

# %%
# %%px
t = torch.tensor([rank + 1.0])
gathered = [torch.zeros(1) for _ in range(world_size)]
dist.all_gather(gathered, t)
print(f"[rank {rank}] all_gather -> {[g.tolist() for g in gathered]}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: every rank's value, in rank order, on every rank
assert [g.tolist() for g in gathered] == [[float(n)] for n in range(1, world_size + 1)], (
    f"rank {rank}: gathered is {[g.tolist() for g in gathered]}; re-run the %%px cell above "
    "(`dist.all_gather(gathered, t)`), then this one")

# %% [markdown]
# `reduce_scatter(out, inputs)` is a reduce followed by a scatter. Every rank passes a list of
# `world_size` tensors. Slot `i` of all ranks is summed and lands on rank `i`. DDP does not use
# it, but ZeRO and FSDP are built on it: lesson 07b shows them. Rank `r` passes
# `[10 r + 0, 10 r + 1, …, 10 r + world_size - 1]`: slot `i` holds `10 r + i`.
#
# **Claim:** rank `i` receives everyone's slot `i`: the sum over `r` of `10 r + i`. That is
# `10 (0 + 1 + … + world_size - 1) + world_size · i`. With two ranks, rank 0 receives
# 0 + 10 = 10 and rank 1 receives 1 + 11 = 12.

# %%
# %%px
inputs = [torch.tensor([10.0 * rank + i]) for i in range(world_size)]
out = torch.zeros(1)
dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM)
print(f"[rank {rank}] reduce_scatter of {[x.item() for x in inputs]} -> {out.tolist()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: rank i holds the sum of everyone's slot i
assert out.tolist() == [10.0 * world_size * (world_size - 1) / 2 + world_size * rank], (
    f"rank {rank}: out is {out.tolist()}; re-run the %%px cell above (`dist.reduce_scatter(out, inputs)`), then this one")

# %% [markdown]
# The in-place calls again, as a picture: each rank's value before and after each.

# %%
def before_and_after(rank, world_size):
    """{collective: (before, after)} of this rank's one-value tensor, each from rank + 1."""
    import torch
    import torch.distributed as dist
    calls = {"all_reduce SUM": lambda t: dist.all_reduce(t),
             "all_reduce AVG": lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG),
             "broadcast from rank 1": lambda t: dist.broadcast(t, src=1),
             "reduce SUM to rank 0": lambda t: dist.reduce(t, dst=0)}
    out = {}
    for name, call in calls.items():
        t = torch.tensor([rank + 1.0])
        call(t)
        out[name] = (rank + 1.0, t.item())
    return out


held = ranks.run(before_and_after)
total = world_size * (world_size + 1) / 2
assert [h["all_reduce SUM"][1] for h in held] == [total] * world_size and held[0]["reduce SUM to rank 0"][1] == total
fig, axes = plt.subplots(1, len(held[0]), figsize=(11, 3), sharey=True, layout="constrained")
for ax, name in zip(axes, held[0]):
    ax.plot(range(world_size), [h[name][0] for h in held], "o", markersize=10, label="before")
    ax.plot(range(world_size), [h[name][1] for h in held], "x", markersize=10, mew=2, label="after")
    ax.set(title=name, xlabel="rank", ylabel="the tensor's value (no unit)", xticks=range(world_size))
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper")
plt.show()

# %% [markdown]
# ## 4. Behaviours people report, reproduced
#
# Each was reported as a bug or a surprise, and is measured on torch 2.14.1, `gloo`, 2 to 4
# ranks. Each cell asserts it for your `world_size`: a future torch that changes it fails here.
#
# ### 4.1 `all_gather` with tensors of different sizes
#
# <a id="case-all-gather-sizes"></a>
# **Symptom:** all_gather fails with tensors of different sizes.
#
# Rank `r` holds `r + 1` values, from `r + 1` up: rank 0 holds `[1.]`, rank 1 `[2., 3.]`,
# rank 2 `[3., 4., 5.]`, and so on. `all_gather` needs every rank's tensor to have the same size.
#
# Each rank compares the sizes locally, before sending anything. Source:
# `ProcessGroupGloo::allgather` in `torch/csrc/distributed/c10d/ProcessGroupGloo.cpp`.
#
# **Claim:** size the output tensors per rank: `[zeros(1), zeros(2), …]`. Then gloo raises a
# `RuntimeError` containing "invalid tensor size" **on every rank**. The group is still usable:
# an `all_reduce` right after it works.

# %%
# %%px
mine = torch.arange(rank + 1.0) + rank + 1  # rank + 1 values, from rank + 1 up
try:
    dist.all_gather([torch.zeros(r + 1) for r in range(world_size)], mine)
    error = None
except RuntimeError as e:
    error = str(e)
print(f"[rank {rank}] RuntimeError: {error}")
check = torch.ones(1)
dist.all_reduce(check)  # the group still works?

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: "invalid tensor size" on every rank; the group still works
assert error is not None and "invalid tensor size" in error, (
    f"rank {rank}: error is {error!r}; re-run the %%px cell above (the all_gather of `mine`), then this one")
assert check.item() == world_size, f"rank {rank}: check is {check.item()}, expected {world_size}: the group still works"

# %% [markdown]
# Two ways work:
#
# - **Pad:** all-gather the sizes, pad every tensor to the largest, all-gather, then trim each
#   slot back to its size.
# - **`all_gather_object`:** it pickles any Python object. It is slower. It pickles, all-gathers
#   the sizes, pads and trims the bytes: the first way, done for you. Source:
#   `all_gather_object` in `torch/distributed/distributed_c10d.py`.
#
# **Claim:** both give every rank's values, in rank order, on every rank:
# `[[1.], [2., 3.], …]`.

# %%
# %%px
size = torch.tensor([mine.numel()])
sizes = [torch.zeros_like(size) for _ in range(world_size)]
dist.all_gather(sizes, size)
longest = max(int(s) for s in sizes)
padded = torch.cat([mine, torch.zeros(longest - mine.numel())])
slots = [torch.zeros(longest) for _ in range(world_size)]
dist.all_gather(slots, padded)
trimmed = [slot[: int(s)].tolist() for slot, s in zip(slots, sizes)]
objects = [None] * world_size
dist.all_gather_object(objects, mine)
print(f"[rank {rank}] padded then trimmed: {trimmed}; all_gather_object: {[o.tolist() for o in objects]}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: padding and all_gather_object give every rank's values
again = "re-run from the %%px cell with `mine = ...` (section 4.1), then the cells after it"
everyone = [[float(r + 1 + i) for i in range(r + 1)] for r in range(world_size)]  # rank r: r + 1, r + 2, ...
assert trimmed == everyone, f"rank {rank}: trimmed is {trimmed}, expected {everyone}; {again}"
assert [o.tolist() for o in objects] == everyone, f"rank {rank}: objects hold {[o.tolist() for o in objects]}; {again}"

# %% [markdown]
# ### 4.2 `ReduceOp.AVG` on gloo
#
# <a id="case-avg-int-on-gloo"></a>
# **Symptom:** all_reduce with AVG raises on integer tensors, and the tensor has changed.
#
# Rank `r` holds `2 r + 1`: 1, 3, 5, and so on. The sum of the first `world_size` odd numbers
# is `world_size²`, so their mean is `world_size`.
#
# **Claim:** for these values as floats, `all_reduce(AVG)` gives the mean, `world_size`. As
# int64 it raises `RuntimeError`: "result type Float can't be cast to the desired output type
# Long". But it raises only **after** it wrote the sum into the tensor. Every rank is left
# holding `world_size²`, not its own value.
#
# The values fit gloo computing AVG as a SUM, then a division by `world_size` on each rank. The
# division of an int64 tensor is what fails.

# %%
# %%px
f = torch.tensor([1.0 + 2 * rank])  # 1.0 on rank 0, 3.0 on rank 1, 5.0 on rank 2, ...
dist.all_reduce(f, op=dist.ReduceOp.AVG)
i = torch.tensor([1 + 2 * rank])  # the same values as int64
try:
    dist.all_reduce(i, op=dist.ReduceOp.AVG)
    error = None
except RuntimeError as e:
    error = str(e)
print(f"[rank {rank}] float AVG -> {f.item()}; int64 AVG -> RuntimeError: {error}; the int tensor now holds {i.item()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: float AVG is the mean; int64 AVG fails after writing the sum
again = "re-run the %%px cell above (`f = torch.tensor([1.0 + 2 * rank])`), then this one"
assert f.item() == world_size, f"rank {rank}: f is {f.item()}, not the mean {world_size}; {again}"
assert error is not None and "result type Float can't be cast to the desired output type Long" in error, (
    f"rank {rank}: error is {error!r}; {again}")
assert i.item() == world_size**2, f"rank {rank}: the int tensor i holds {i.item()}, not the sum {world_size**2}; {again}"

# %% [markdown]
# **Claim:** `reduce(AVG, dst=0)` gives the destination the mean, `world_size`. Every rank `r`
# is left with the sum of the values of ranks `r` to `world_size - 1`, divided by `world_size`.
# That sum is `world_size² - r²`. With two ranks, rank 1 holds its own 3.0 / 2 = 1.5: not 3.0,
# not 2.0.
#
# The values fit gloo passing the sum along a chain, from the last rank to rank 0. Then it
# divides on every rank, where only the destination had the whole sum.

# %%
# %%px
f = torch.tensor([1.0 + 2 * rank])
dist.reduce(f, dst=0, op=dist.ReduceOp.AVG)
print(f"[rank {rank}] reduce AVG to rank 0 -> {f.item()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: reduce AVG leaves partial sums divided by world_size
left = (world_size**2 - rank**2) / world_size  # (2 rank + 1) + ... + (2 world_size - 1), divided
assert abs(f.item() - left) < 1e-6, (
    f"rank {rank}: f is {f.item()}, expected {left}; re-run the %%px cell above (`dist.reduce(f, dst=0, ...)`), then this one")

# %% [markdown]
# ### 4.3 `reduce` changes the other ranks' buffers too
#
# <a id="case-reduce-changes-others"></a>
# **Symptom:** dist.reduce changed the tensors on the other ranks too.
#
# The docs of [`torch.distributed.reduce`](https://pytorch.org/docs/stable/distributed.html)
# say "Only the process with rank `dst` is going to receive the final result". They do not
# promise the other ranks' tensors are left alone. Rank `r` holds `[[1, 2], [3, 4]] + 3 r`:
# rank 0 `[[1, 2], [3, 4]]`, rank 1 `[[4, 5], [6, 7]]`, and so on.
#
# **Claim:** after `reduce(SUM, dst=0)` rank 0 holds the sum. Every other rank's `m` has changed
# too. Each of its entries is now a sum over some of the ranks, its own included. On rank 1 the
# second row is the sum's second row.
#
# So clone the input of `reduce` first if you need it on the other ranks.

# %%
# %%px
m = torch.tensor([[1, 2], [3, 4]]) + 3 * rank
dist.reduce(m, dst=0, op=dist.ReduceOp.SUM)
print(f"[rank {rank}] after reduce to rank 0: {m.tolist()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: reduce changes the other ranks' m
from itertools import combinations

again = "re-run the %%px cell above (`dist.reduce(m, dst=0, ...)`), then this one"
before = [torch.tensor([[1, 2], [3, 4]]) + 3 * r for r in range(world_size)]  # every rank's m, before
total = sum(before)
others = [r for r in range(world_size) if r != rank]
partial = [before[rank] + sum(before[r] for r in group) for n in range(world_size) for group in combinations(others, n)]
if rank == 0:
    assert m.tolist() == total.tolist(), f"rank 0: m is {m.tolist()}, not the sum {total.tolist()}; {again}"
else:
    assert not torch.equal(m, before[rank]), f"rank {rank}: m is unchanged, {m.tolist()}; {again}"
    is_partial = torch.stack([m == p for p in partial]).any(dim=0)  # each entry: a sum over ranks with its own?
    assert is_partial.all(), f"rank {rank}: m is {m.tolist()}, an entry is no sum over ranks; {again}"
    if rank == 1:
        assert m[1].tolist() == total[1].tolist(), (
            f"rank 1: m's second row is {m[1].tolist()}, not the sum's {total[1].tolist()}; {again}")


# %% [markdown]
# ### 4.4 A non-contiguous view in a collective is silently wrong
#
# <a id="case-non-contiguous-view"></a>
# **Symptom:** all_reduce on a column gives wrong values and no error.
#
# A column of a 2-D tensor is a *view* with a stride: its elements are not next to each other in
# memory. Rank `r`'s column holds `[10^r, 2 · 10^r]`: rank 0 `[1, 2]`, rank 1 `[10, 20]`, and
# so on. Call the sum of the first elements `S = 1 + 10 + … + 10^(world_size - 1)`: 11 with two
# ranks, 111 with three.
#
# **Claim:** `all_reduce(SUM)` on the column view reduces only the first element: rank `r` gets
# `[S, 2 · 10^r]`, not `[S, 2 S]`. The call raises no error and no warning. Reducing a
# contiguous copy and copying it back gives `[S, 2 S]` on every rank.
#

# %%
# %%px
import warnings

scale = 10.0 ** rank  # 1 on rank 0, 10 on rank 1, 100 on rank 2, ...
m = torch.tensor([[1.0, 0.0], [2.0, 0.0]]) * scale
column = m[:, 0]  # a view, stride 2: not contiguous
with warnings.catch_warnings(record=True) as caught:  # every warning the call raises, kept in a list
    warnings.simplefilter("always")  # none hidden by a filter or by "only once"
    dist.all_reduce(column)
warned = [f"{w.category.__name__}: {w.message}" for w in caught]
wrong = m[:, 0].tolist()
m = torch.tensor([[1.0, 0.0], [2.0, 0.0]]) * scale
fixed = m[:, 0].contiguous()
dist.all_reduce(fixed)
m[:, 0].copy_(fixed)
print(f"[rank {rank}] contiguous? {column.is_contiguous()}; view reduced -> {wrong}, warnings {warned}; "
      f"copy reduced and copied back -> {m[:, 0].tolist()}")

# %% jupyter={"source_hidden": true} tags=["check"]
# %%px
# Check: the view reduces one element, with no warning; the copy works
again = "re-run the %%px cell above (`column = m[:, 0]`), then this one"
S = sum(10.0**r for r in range(world_size))  # 1 + 10 + ... + 10^(world_size - 1)
assert wrong == [S, 2 * 10.0**rank], f"rank {rank}: wrong is {wrong}, expected {[S, 2 * 10.0**rank]}; {again}"
assert warned == [], f"rank {rank}: the all_reduce of the view warned: {warned}; {again}"
assert m[:, 0].tolist() == [S, 2 * S], f"rank {rank}: m[:, 0] is {m[:, 0].tolist()}, expected {[S, 2 * S]}; {again}"

# %% [markdown]
# ## What we saw
#
# - A DDP job is `world_size` separate processes. Each knows its `rank` and the group's size.
#   They talk only through collectives on the process group.
# - Notebooks never fork the kernel: the ranks are forks of a fork server, so cell code is sent
#   by value, with `cloudpickle`. A fork of the kernel would copy a CUDA context it cannot use.
# - The five collectives write their results in place: `all_reduce` with SUM or AVG,
#   `broadcast`, `reduce`, `all_gather`, `reduce_scatter`. `reduce` leaves the sum only on the
#   destination.
# - Four reported behaviours, reproduced. `all_gather` refuses unequal sizes: pad, or use
#   `all_gather_object`. AVG on integers fails after writing the sum. `reduce` clobbers the other
#   ranks' buffers. A non-contiguous view is reduced wrong, silently.
#
# ## Exercises
#
# Write the answer in the cell after each task and run it. Then run the check cell below it. In
# the full lesson a collapsed solution follows each check. Student copies leave the solutions
# out.

# %% [markdown]
# ### Exercise 1: average a tensor across the ranks
#
# Write a function `fn(rank, world_size)` that makes `torch.tensor([(rank + 1.0) ** 2])`. It
# returns, as a list, the tensor's **average over all ranks**. Compute it with `dist.all_reduce`,
# with any op you like. Set `answer_1 = fn`, the function itself. The check cell runs it on the
# warm ranks with `ranks.run(answer_1)`. It compares every rank's result with the expected one.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, your function run on the warm ranks
ranks = start_ranks(world_size=world_size, backend=None, timeout=timeout)  # the running ranks, or fresh ones
expected_1 = [[sum((r + 1.0) ** 2 for r in range(world_size)) / world_size]] * world_size
# your function runs on every warm rank (ranks.run); its results are your answer
check_answer("ex1", answer_1, expected_1, run=ranks.run, labels=("rank {}'s result",),
             hint="sum with dist.all_reduce, then divide by world_size")


# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
def average_across_ranks(rank, world_size):
    import torch
    import torch.distributed as dist
    t = torch.tensor([(rank + 1.0) ** 2])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / world_size).tolist()


solution_1 = ranks.run(average_across_ranks)
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: all-gather tensors of different lengths
#
# Rank `r` holds `torch.arange(r + 1.0)`: rank 0 `[0.]`, rank 1 `[0., 1.]`, and so on. Write a
# function `fn(rank, world_size)` that returns, on every rank, the list of every rank's values in
# rank order: `[[0.0], [0.0, 1.0], …]`. Use `dist.all_gather` on tensors, not
# `all_gather_object`. `all_gather` needs one size on every rank: gather the lengths first, pad
# to the longest, then trim.
# Set `answer_2 = fn`. The check cell runs it on the warm ranks.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, your function run on the warm ranks
ranks = start_ranks(world_size=world_size, backend=None, timeout=timeout)  # the running ranks, or fresh ones
expected_2 = [[[float(i) for i in range(r + 1)] for r in range(world_size)]] * world_size
# your function runs on every warm rank (ranks.run); its results are your answer
check_answer("ex2", answer_2, expected_2, run=ranks.run, labels=("rank {}'s result",),
             hint="all-gather the lengths first, pad to the longest, trim")


# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
def gather_uneven(rank, world_size):
    import torch
    import torch.distributed as dist
    mine = torch.arange(rank + 1.0)
    length = torch.tensor([mine.numel()])
    lengths = [torch.zeros_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length)
    longest = int(max(lengths))
    slots = [torch.zeros(longest) for _ in range(world_size)]
    dist.all_gather(slots, torch.cat([mine, torch.zeros(longest - mine.numel())]))
    return [slot[: int(n)].tolist() for slot, n in zip(slots, lengths)]


solution_2 = ranks.run(gather_uneven)
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# Done: stop the warm ranks. Their processes end. `ranks.stop()` may be called again safely. An
# exercise's check cell run after this starts fresh ranks by itself.

# %%
ranks.stop()

# %% [markdown]
# <!-- next:start -->
# **Next:** [00b DDP cell by cell](00b_ddp_cell_by_cell.ipynb): step through DDP cell by cell and predict every rank's weights and gradients.
# <!-- next:end -->
