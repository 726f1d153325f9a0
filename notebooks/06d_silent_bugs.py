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
# # 06d · Silent DDP bugs
#
# <!-- opening:start -->
# **You will be able to** find DDP mistakes that raise no error, with a value check or the three general checks. **You need** [00a processes and collectives](00a_processes_and_collectives.ipynb), [00b DDP cell by cell](00b_ddp_cell_by_cell.ipynb), [06a training-loop pitfalls](06a_training_loop_pitfalls.ipynb).
# <!-- opening:end -->
#
# **The question:** my DDP run finished without an error: is it training the model I think it is?
#
# One section per mistake. Each runs a tiny model on 2 real ranks with `launch`, backend `gloo`,
# on CPU. The inputs make every number easy to work by hand: `x = 1` on rank 0, `x = 3` on rank 1.
# Weights start at 1 and the learning rate is 1/8, so every weight is exact in float32.
#
# Each section shows the wrong value, the right value, the fix and what catches it. The folded
# cell after each bold "Claim:" asserts it.
#
# 1. bypassing the wrapper · 2. changing the model after wrapping · 3. all-reduce and autograd ·
# 4. per-rank random splits · 5. clipping during accumulation · 6. fewer items than ranks ·
# 7. three invariants, three checks
#
# Terms, see the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [all-reduce](../docs/GLOSSARY.md#all-reduce), [DDP](../docs/GLOSSARY.md#ddp).

# %% tags=["parameters"]
# Parameters: none; no profile changes this lesson (docs/RUNNER.md)

# %%
from helpers.notebook import check_answer

# Constants of this lesson: no profile changes them
later_steps = 3  # wrapper steps after the bypassed step in section 1
n_items = 10  # items of section 4's data set (2 of them for validation)

# %%
import contextlib
import time
import warnings

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close
from torch.utils.data import DistributedSampler, random_split

from helpers.engine import launch
from helpers.tiny import checked, one, x_of

t_notebook = time.perf_counter()
WORLD = 2  # every section's numbers are worked by hand for 2 ranks
LR = 0.125  # SGD learning rate: 1/8, so the weights below are exact in float32
caught = {}  # section -> at which step assert_in_sync raised, or why it could not
print(f"torch {torch.__version__}")

# %% [markdown]
# ## 0. Tools every section uses
#
# `one()` is `Linear(1, 1, bias=False)` with weight 1. Its output is `w x`. With the output itself
# as the loss, the gradient is `x`: 1 on rank 0 and 3 on rank 1. So DDP's averaged gradient is
# `(1 + 3) / 2 = 2`.
#
# `checked(model)` returns the replica checker's message instead of raising it (`helpers.tiny`).
# In your own loop, call `assert_in_sync(ddp)` on every rank and let it raise.

# %%
def train(ddp, steps, params):
    """Run steps (callables returning the loss); check after each. (weights per step, first failing check)."""
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    weights, first = [], None
    for step, loss_of in enumerate(steps, start=1):
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        opt.step()
        weights.append([round(p.item(), 6) for p in params])
        message = checked(ddp)
        if message != "ok" and first is None:
            first = (step, message)
    return weights, first

# %% [markdown]
# ## 1. Bypassing the wrapper
#
# <a id="case-module-bypass"></a>
# **Symptom:** the replicas drift apart when I call ddp.module(x).
#
# DDP all-reduces gradients only after a forward through `ddp(...)`, which prepares the reducer.
# `ddp.module(x)` or `ddp.module.score(x)` skips it: each rank keeps its own gradient.
#
# `Scorer` has a `score` method, `score = 2 w x`. The fix routes it through `forward`:
# `ddp(x, score=True)`.

# %%
class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = one()

    def forward(self, x, score=False):
        return self.score(x) if score else self.lin(x)

    def score(self, x):
        return 2 * self.lin(x)


def loss_of(ddp, call, x):
    """A step's loss, through the wrapper or around it."""
    return {"ddp": lambda: ddp(x).sum(), "module": lambda: ddp.module(x).sum(),
            "score": lambda: ddp.module.score(x).sum(), "ddp_score": lambda: ddp(x, score=True).sum()}[call]


def bypass_worker(rank, world_size, later_steps, plans=None):
    x = x_of(rank)
    out = {}
    plans = plans or {"wrapper": ["ddp"], "ddp.module(x)": ["module"], "ddp.module.score(x)": ["score"],
                      "fix: ddp(x, score=True)": ["ddp_score"],
                      "mixed": ["ddp", "module"] + ["ddp"] * later_steps,
                      "wrapper, every step": ["ddp"] * (2 + later_steps)}
    for name, plan in plans.items():
        ddp = DDP(Scorer())
        weights, first = train(ddp, [loss_of(ddp, c, x) for c in plan], [ddp.module.lin.weight])
        out[name] = {"weights": [w[0] for w in weights], "first": first}
    return out


B = launch(bypass_worker, WORLD, later_steps, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** after one step the weights on ranks 0 and 1 are:
#
# | call | gradient | weights |
# | --- | --- | --- |
# | `ddp(x)` | the mean, 2 | 0.75, 0.75 |
# | `ddp.module(x)` | own `x` | 0.875, 0.625 |
# | `ddp.module.score(x)` | own `2x` | 0.75, 0.25 |
# | fix: `ddp(x, score=True)` | the mean, 4 | 0.5, 0.5 |
#
# **Claim:** the checker, called after each step, raises at step 1 in both bypass runs. It names
# the parameter `lin.weight`, the rank that differs and both values. It passes in the two others.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the weights after one step, and where the checker raises
def weights_by_rank(results, name, step=-1):
    return [r[name]["weights"][step] for r in results]


assert weights_by_rank(B, "wrapper") == [0.75, 0.75], weights_by_rank(B, "wrapper")
assert weights_by_rank(B, "ddp.module(x)") == [0.875, 0.625], weights_by_rank(B, "ddp.module(x)")
assert weights_by_rank(B, "ddp.module.score(x)") == [0.75, 0.25], weights_by_rank(B, "ddp.module.score(x)")
assert weights_by_rank(B, "fix: ddp(x, score=True)") == [0.5, 0.5], weights_by_rank(B, "fix: ddp(x, score=True)")
for name in ("wrapper", "fix: ddp(x, score=True)"):
    assert B[0][name]["first"] is None, B[0][name]["first"]
for name in ("ddp.module(x)", "ddp.module.score(x)"):
    step, message = B[0][name]["first"]
    assert step == 1 and B[1][name]["first"] == (step, message), (name, step)
    assert "parameter 'lin.weight' (1, 1)" in message and "rank 1 differs from rank 0" in message, message
message = B[0]["ddp.module(x)"]["first"][1]
assert "rank 0 sum=0.875" in message and "rank 1 sum=0.625" in message, message
caught["1 bypass"] = "step 1"
print(message)

# %% [markdown]
# DDP broadcasts parameters only in its constructor. Afterwards it only averages gradients, and
# equal updates keep any difference.
#
# **Claim:** take one synced step, to 0.75 on both ranks, then one `ddp.module(x)` step, to 0.625
# and 0.375. `later_steps` more steps through the wrapper do not bring the ranks back together.
# Each moves both weights by the same averaged `0.25`, so the gap stays exactly `0.25`. The
# checker raises at step 2, the bypassed one.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the gap after a bypassed step never closes
mixed = [B[r]["mixed"]["weights"] for r in range(WORLD)]
assert mixed[0][:2] == [0.75, 0.625] and mixed[1][:2] == [0.75, 0.375], mixed
expected_gap = [0.0] + [0.25] * (1 + later_steps)
assert [a - b for a, b in zip(*mixed)] == expected_gap, mixed
assert B[0]["mixed"]["first"][0] == 2, B[0]["mixed"]["first"]
caught["1 mixed"] = "step 2 (the bypassed one)"
pd.DataFrame({"step": range(1, len(mixed[0]) + 1), "call": ["ddp(x)", "ddp.module(x)"] + ["ddp(x)"] * later_steps,
              "weight, rank 0": mixed[0], "weight, rank 1": mixed[1]}).set_index("step")

# %% [markdown]
# The same run beside the fix, every step through `ddp(x)`: the weights split at the bypassed
# step and never meet again.

# %%
fixed = [B[r]["wrapper, every step"]["weights"] for r in range(WORLD)]
assert fixed[0] == fixed[1] and mixed[0] != mixed[1], (fixed, mixed)  # what the figure shows
fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.2), sharey=True, layout="constrained")
for ax, (title, runs) in zip(axes, [("bug: step 2 through ddp.module(x)", mixed),
                                    ("fix: every step through ddp(x)", fixed)]):
    for r, (marker, size) in enumerate([("o", 9), ("x", 7)]):
        ax.plot(range(1, len(runs[r]) + 1), runs[r], marker=marker, markersize=size, label=f"rank {r}")
    ax.set(title=title, xlabel="optimizer step", ylabel="weight w (no unit)")
    ax.legend(loc="upper right")
plt.show()

# %% [markdown]
# Buffers differ: DDP broadcasts rank 0's buffers before some forwards. `WithBuffer` is `one()`
# plus a buffer `b`, set to the rank before each of five forwards. Rank 1's `b` after the forward
# is 0 if DDP broadcast rank 0's.

# %%
class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = one()
        self.register_buffer("b", torch.zeros(1))

    def forward(self, x):
        return self.lin(x)


BUFFER_FORWARDS = [  # (forward, gradients on, inside no_sync())
    ("1. the first forward, without gradients", False, False),
    ("2. after a forward without gradients", True, False),
    ("3. after a forward with gradients", True, False),
    ("4. inside no_sync(), after a forward with gradients", True, True),
    ("5. after a forward inside no_sync()", True, False),
]


def buffer_worker(rank, world_size):
    ddp = DDP(WithBuffer())
    seen = []
    for _name, grad_on, in_no_sync in BUFFER_FORWARDS:
        ddp.module.b.fill_(rank)  # the ranks' buffers differ before every forward
        with torch.set_grad_enabled(grad_on), ddp.no_sync() if in_no_sync else contextlib.nullcontext():
            out = ddp(x_of(rank)).sum()
            if grad_on:
                out.backward()
        seen.append(ddp.module.b.item())
    return seen


BUF = launch(buffer_worker, WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** DDP does not broadcast buffers at every forward. It broadcasts them only before the
# first forward, and before a forward whose previous forward ran with gradients outside
# `no_sync()`. Rank 1 keeps its own `b` in forwards 2 and 5. Lesson
# [02](02_one_model_many_processes.ipynb) shows every case.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: which forwards broadcast rank 0's buffer
broadcast = [True, False, True, True, False]  # what the previous forward leaves for the next one
assert BUF[0] == [0.0] * len(BUFFER_FORWARDS), BUF[0]
assert BUF[1] == [0.0 if b else 1.0 for b in broadcast], f"rank 1's buffer after each forward: {BUF[1]}"
pd.DataFrame({"rank 1's b after it": BUF[1], "broadcast?": broadcast},
             index=[name for name, *_ in BUFFER_FORWARDS])

# %% [markdown]
# ## 2. Changing the model after wrapping
#
# `DDP(model)` hooks, once, each parameter that requires a gradient, in buckets. A bucket is
# all-reduced when all its gradients have come.
#
# Two changes after the wrap break that silently for one step. A parameter frozen with
# `requires_grad_(False)` never sends its gradient, so its bucket never fills. A new
# `nn.Parameter` has no hook. The model is `Sequential(one(), one())`: each gradient starts as `x`.

# %%
def changed_worker(rank, world_size, change):
    x = x_of(rank)
    model = nn.Sequential(one(), one())
    if change == "fix: freeze, then wrap":
        model[0].weight.requires_grad_(False)
    ddp = DDP(model)
    if change == "freeze after the wrap":
        model[0].weight.requires_grad_(False)
    elif change == "new nn.Parameter after the wrap":
        model[1].weight = nn.Parameter(torch.ones(1, 1))
    elif change == "fix: copy_ into the parameter":
        with torch.no_grad():
            model[1].weight.copy_(torch.ones(1, 1))
    out = {"before step 1": checked(ddp)}
    try:
        out["weights"], out["first"] = train(ddp, [lambda: ddp(x).sum()] * 2, list(model.parameters()))
    except RuntimeError as e:
        out["error"] = str(e)  # raised by step 2's forward; the weights are step 1's
        out["weights_step1"] = [round(p.item(), 6) for p in model.parameters()]
    return out


changes = ["freeze after the wrap", "new nn.Parameter after the wrap", "fix: freeze, then wrap",
           "fix: copy_ into the parameter"]
C = {c: launch(changed_worker, WORLD, c, backend="gloo", timeout=120) for c in changes}

# %% [markdown]
# **Claim:** frozen after the wrap, `0.weight` stays 1. `1.weight` takes a rank-local step 1, to
# 0.875 on rank 0 and 0.625 on rank 1; synced it would be 0.75. Step 2's forward raises on every
# rank: "Expected to have finished reduction in the prior iteration". It names parameter
# **index** 0, not its name.
#
# **Claim:** a new `nn.Parameter` after the wrap leaves **both** weights unsynced in step 1: the
# tiny model's one bucket never fills. Step 2 raises, naming index 1.
#
# **Claim:** `assert_in_sync` raises already before step 1, from the wrap's record: "'0.weight':
# requires_grad set False after the wrap", or "'1.weight' was added or replaced after the wrap".
#
# **Claim:** the fixes train both steps in sync: freeze before wrapping, or `copy_` new values
# into the existing parameter.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: rank-local step 1, the error of step 2, the checker's record, and the fixes
frozen, replaced = C["freeze after the wrap"], C["new nn.Parameter after the wrap"]
assert [r["weights_step1"] for r in frozen] == [[1.0, 0.875], [1.0, 0.625]], [r.get("weights_step1") for r in frozen]
assert [r["weights_step1"] for r in replaced] == [[0.875, 0.875], [0.625, 0.625]], [r.get("weights_step1") for r in replaced]
for result, index, note in ((frozen, 0, "'0.weight': requires_grad set False after the wrap"),
                            (replaced, 1, "'1.weight' was added or replaced after the wrap")):
    for r, rank_result in enumerate(result):
        error = rank_result["error"]
        assert "Expected to have finished reduction in the prior iteration" in error, error
        assert f"did not receive grad for rank {r}: {index}" in error, error
        assert note in rank_result["before step 1"], rank_result["before step 1"]
        assert "first" not in rank_result, "step 2 should have raised"
print(frozen[0]["before step 1"])
print("step 2:", frozen[0]["error"].splitlines()[0], "...", frozen[0]["error"].splitlines()[-2].strip())
assert [r["weights"][-1] for r in C["fix: freeze, then wrap"]] == [[1.0, 0.5]] * 2
assert [r["weights"][-1] for r in C["fix: copy_ into the parameter"]] == [[0.5625, 0.5625]] * 2
for fix in ("fix: freeze, then wrap", "fix: copy_ into the parameter"):
    assert all(r["before step 1"] == "ok" and r["first"] is None for r in C[fix]), fix

# %% [markdown]
# **Claim:** the same frozen model, trained one step and checked: `assert_in_sync` raises at step
# 1. It names the weight that differs, `1.weight`: 0.875 on rank 0, 0.625 on rank 1. It also names
# the change since the wrap.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the checker at step 1 names 1.weight and the change
def freeze_checked_worker(rank, world_size):
    model = nn.Sequential(one(), one())
    ddp = DDP(model)
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ddp(x_of(rank)).sum().backward()
    opt.step()
    return checked(ddp)


F = launch(freeze_checked_worker, WORLD, backend="gloo", timeout=120)
assert F[0] == F[1], F
assert "parameter '1.weight' (1, 1): rank 0 sum=0.875 sumsq=0.765625; rank 1 sum=0.625" in F[0], F[0]
assert "requires_grad set False after the wrap" in F[0] and "(ranks 0, 1)" in F[0], F[0]
caught["2 frozen / replaced"] = "before step 1, and at step 1"
print(F[0])

# %% [markdown]
# ## 3. All-reduce and autograd
#
# `dist.all_reduce(t)` overwrites `t` in place, unseen by autograd. The **value** becomes the sum
# over ranks; the **gradient** stays each rank's own. Three forms of it:
#
# * a global objective built with `dist.all_reduce` on a tensor in the graph:
#   `S = w x₀ + w x₁ = 4w`, value 4 at `w = 1`, gradient `dS/dw = 4`;
# * the "averaged loss" reduced in place and divided by the world size **before** `backward()`;
# * a metric counter reduced through `.float()`: `.float()` makes a copy, and the copy is reduced.
#
# Fixes: `torch.distributed.nn.functional.all_reduce`, whose backward all-reduces too; for the
# log, reduce a detached copy.

# %%
def reduce_worker(rank, world_size):
    x = x_of(rank)
    out = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ddp = DDP(one())
        s = ddp(x).sum()
        dist.all_reduce(s)  # value: the sum over ranks; gradient: this rank's own
        s.backward()
        out["global: dist.all_reduce"] = (s.item(), ddp.module.weight.grad.item())
        out["checker"] = [checked(ddp, grads=True)]
        ddp = DDP(one())
        s = dist_autograd.all_reduce(ddp(x).sum())  # FutureWarning in torch 2.14: still the public API
        s.backward()
        out["global: autograd all_reduce"] = (s.item(), ddp.module.weight.grad.item())
        out["checker"].append(checked(ddp, grads=True))
        plain = one()  # no DDP: this rank's own gradient of the global objective
        dist_autograd.all_reduce(plain(x).sum()).backward()
        out["autograd all_reduce, this rank's gradient"] = plain.weight.grad.item()

        ddp = DDP(one())
        loss = ddp(x).sum()
        dist.all_reduce(loss)
        loss /= world_size  # the mean over ranks: right for the log ...
        loss.backward()  # ... and the gradient is divided by world_size
        out["mean loss: in place"] = (loss.item(), ddp.module.weight.grad.item())
        out["checker"].append(checked(ddp, grads=True))
        ddp = DDP(one())
        loss = ddp(x).sum()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        loss.backward()
        out["mean loss: detached copy"] = ((logged / world_size).item(), ddp.module.weight.grad.item())
        out["checker"].append(checked(ddp, grads=True))
    out["warnings"] = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]

    correct = torch.tensor(3 if rank == 0 else 5)  # int64 count of right answers on this rank
    dist.all_reduce(correct.float())  # reduces a float copy
    out["count: .float()"] = correct.item()
    total = correct.clone()
    dist.all_reduce(total)  # int64 directly (or: c = correct.float(); dist.all_reduce(c))
    out["count: int64"] = total.item()
    every = [None] * world_size
    dist.all_gather_object(every, out["count: .float()"])  # the check: a reduced metric is the same everywhere
    out["count on every rank"] = every
    return out


R = launch(reduce_worker, WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** the value and gradient each form gives:
#
# | form | value | gradient |
# | --- | --- | --- |
# | global objective, `dist.all_reduce` | 4 | `(1 + 3) / 2 = 2`, half of `dS/dw` |
# | global objective, autograd all-reduce | 4 | `(2 + 6) / 2 = 4`: each rank's is `2 xᵣ` |
# | mean loss reduced in place | 2 | `2 / 2 = 1` |
# | mean loss, detached copy reduced | 2 | 2 |
#
# **Claim:** the replicas stay identical in all four: `assert_in_sync(ddp, grads=True)` passes.
# The one sign at run time is torch's UserWarning "c10d::allreduce_: an autograd kernel was not
# registered". What catches it is the gradient of the same objective in one process,
# `S = w (1 + 3)`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: values and gradients, the checker, the warning, the one-process gradient
for r in range(WORLD):
    assert R[r]["global: dist.all_reduce"] == (4.0, 2.0), R[r]
    assert R[r]["global: autograd all_reduce"] == (4.0, 4.0), R[r]
    assert R[r]["mean loss: in place"] == (2.0, 1.0), R[r]
    assert R[r]["mean loss: detached copy"] == (2.0, 2.0), R[r]
    assert R[r]["checker"] == ["ok"] * 4, R[r]["checker"]
    assert R[r]["autograd all_reduce, this rank's gradient"] == 2 * x_of(r).item(), R[r]
    assert any("c10d::allreduce_: an autograd kernel was not registered" in w for w in R[r]["warnings"]), R[r]["warnings"]
w = torch.ones(1, requires_grad=True)
(w * (1.0 + 3.0)).sum().backward()  # the global objective in one process
reference = w.grad.item()
assert reference == 4.0 and R[0]["global: dist.all_reduce"][1] != reference
assert R[0]["global: autograd all_reduce"][1] == reference
pd.DataFrame({k: R[0][k] for k in R[0] if k.startswith(("global", "mean"))}, index=["value", "gradient"]).T

# %% [markdown]
# **Claim:** the counters 3 on rank 0 and 5 on rank 1, reduced through `.float()`, stay 3 and 5.
# The int64 reduce gives 8 on both. What catches it: a reduced metric must be equal on every
# rank, and `all_gather_object` shows `[3, 5]`.
#
# **Claim:** counting in float32 is wrong anyway past 2²⁴. Float32 has a 24-bit significand, so
# 16,777,217 becomes 16,777,216.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the counters, and float32 past 2**24
assert [R[r]["count: .float()"] for r in range(WORLD)] == [3, 5]
assert [R[r]["count: int64"] for r in range(WORLD)] == [8, 8]
assert R[0]["count on every rank"] == [3, 5] and len(set(R[0]["count on every rank"])) > 1
assert int(torch.tensor(2**24 + 1).float().item()) == 2**24
caught["3 all-reduce"] = "not caught: the replicas stay identical"
print("counts after .float() reduce:", R[0]["count on every rank"], "| int64 reduce:", R[0]["count: int64"])

# %% [markdown]
# ## 4. Per-rank random splits
#
# `random_split(data, [train, val], generator=...)` draws `torch.randperm(n, generator=...)`; see
# torch/utils/data/dataset.py. Seeded with `seed + rank`, each rank splits the data differently.
# Its training shard, `train[rank::world_size]`, overlaps another rank's. Items one rank
# validates on are trained on by the other. The fix: the same seed on every rank, then a
# `DistributedSampler` over the training part.

# %%
def split_worker(rank, world_size, n_items, seed=0):
    data = range(n_items)
    sizes = [n_items - 2, 2]
    out = {}
    train, val = random_split(data, sizes, generator=torch.Generator().manual_seed(seed + rank))
    out["per-rank seeds"] = {"train": list(train)[rank::world_size], "val": list(val)}
    perm = torch.randperm(n_items, generator=torch.Generator().manual_seed(seed + rank)).tolist()
    out["randperm is the split"] = perm == list(train) + list(val)
    train, val = random_split(data, sizes, generator=torch.Generator().manual_seed(seed))
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    out["same seed + DistributedSampler"] = {"train": [train[i] for i in sampler], "val": list(val)}
    ddp = DDP(one())  # one step on this rank's first (per-rank seeded) item: the replicas still agree
    ddp(torch.tensor([[float(out["per-rank seeds"]["train"][0])]])).sum().backward()
    torch.optim.SGD(ddp.parameters(), lr=LR).step()
    out["checker"] = checked(ddp, grads=True)
    every = [None] * world_size
    dist.all_gather_object(every, out)  # the check: gather every rank's shard
    return every


def split_report(every, key):
    """Items trained by 2+ ranks, items some rank validates on and some rank trains on, items nobody trains."""
    shards = [set(e[key]["train"]) for e in every]
    trained, vals = set().union(*shards), set().union(*(e[key]["val"] for e in every))
    twice = {i for i in trained if sum(i in s for s in shards) > 1}
    return {"trained by 2 ranks": len(twice), "validated and trained": len(vals & trained),
            "never trained": len(set(range(n_items)) - trained)}


S = launch(split_worker, WORLD, n_items, backend="gloo", timeout=120)[0]

# %% [markdown]
# **Claim:** with per-rank seeds 0 and 1 and `n_items = 10`, one item is trained by both ranks.
# 4 items are validated on by one rank and trained on by the other. 3 are never trained on.
#
# **Claim:** with the same seed and `DistributedSampler` the shards are disjoint. No validation
# item is trained on; only the 2 validation items are never trained on.
#
# **Claim:** the replica checker cannot see this. DDP keeps the replicas identical whatever data
# each rank reads, so it passes after a step on the per-rank shards. What catches it is the
# gathered shards, `split_report`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: shared, leaked and unused items, with and without the fix
wrong, right = split_report(S, "per-rank seeds"), split_report(S, "same seed + DistributedSampler")
assert all(e["randperm is the split"] and e["checker"] == "ok" for e in S)
assert wrong["trained by 2 ranks"] + wrong["validated and trained"] > 0, wrong
if n_items == 10:
    assert list(wrong.values()) == [1, 4, 3], wrong
assert right == {"trained by 2 ranks": 0, "validated and trained": 0, "never trained": 2}, right
caught["4 random splits"] = "not caught: the replicas stay identical"
pd.DataFrame({"per-rank seeds": wrong, "same seed + DistributedSampler": right})

# %% [markdown]
# ## 5. Clipping during accumulation
#
# With `no_sync()` (lesson 06a) each rank accumulates locally; the last backward all-reduces the
# sum. Clip once, after it. Clipping **each** micro-batch clips a rank-local partial gradient,
# and logs that rank's own norm.
#
# Rank 0's micro-batches are `x = 1, 1`, rank 1's `x = 7, 1`, and `max_norm = 4`. The true
# accumulated gradient is `((1 + 1) + (7 + 1)) / 2 = 5`.

# %%
def clip_worker(rank, world_size, clip_each):
    xs = [1.0, 1.0] if rank == 0 else [7.0, 1.0]
    ddp = DDP(one())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    logged = []
    for i, x in enumerate(xs):
        last = i == len(xs) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            ddp(torch.tensor([[x]])).sum().backward()
        if clip_each or last:
            logged.append(float(nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=4.0)))
    grad = ddp.module.weight.grad.item()
    opt.step()
    return {"logged norms": logged, "grad": grad, "weight": ddp.module.weight.item(),
            "checker": checked(ddp, grads=True)}


K = {each: launch(clip_worker, WORLD, each, backend="gloo", timeout=120) for each in (True, False)}

# %% [markdown]
# `clip_grad_norm_` scales by `max_norm / (norm + 1e-6)`, hence the check's tolerance.
#
# **Claim:** clipped once after the synced backward, the norm is 5 on both ranks. The gradient is
# clipped to 4 and the weight becomes `1 − 4/8 = 0.5`.
#
# **Claim:** clipped after each micro-batch, rank 1's first gradient 7 is clipped to 4. The
# synced gradient is then `((1 + 1) + (4 + 1)) / 2 = 3.5`, below 4, and the weight
# `1 − 3.5/8 = 0.5625`. A logger at the first micro-batch prints 1 on rank 0 and 7 on rank 1.
#
# **Claim:** the replicas agree after both: the checker passes. What catches it is the
# one-process reference, the mean of the ranks' accumulated gradients clipped once.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: norms, gradients and weights of both clippings, against one process
each, once = K[True], K[False]
near = {"atol": 1e-5, "rtol": 0}
for r in range(WORLD):
    assert_close(once[r]["logged norms"], [5.0], **near)
    assert_close(once[r]["grad"], 4.0, **near)
    assert_close(once[r]["weight"], 0.5, **near)
    assert_close(each[r]["grad"], 3.5, **near)
    assert_close(each[r]["weight"], 0.5625, **near)
    assert each[r]["checker"] == once[r]["checker"] == "ok"
assert_close([each[0]["logged norms"][0], each[1]["logged norms"][0]], [1.0, 7.0], **near)
reference = min(((1 + 1) + (7 + 1)) / 2, 4.0)  # one process: mean of the accumulated gradients, clipped once
assert abs(once[0]["grad"] - reference) < 1e-5 and abs(each[0]["grad"] - reference) > 0.4
caught["5 clipping"] = "not caught: the replicas stay identical"
pd.DataFrame({"clip each micro-batch": [each[0]["logged norms"], each[1]["logged norms"], each[0]["grad"], each[0]["weight"]],
              "clip once, after the sync": [once[0]["logged norms"], once[1]["logged norms"], round(once[0]["grad"], 5), once[0]["weight"]]},
             index=["norms logged, rank 0", "norms logged, rank 1", "gradient", "weight after the step"])

# %% [markdown]
# ## 6. Fewer items than ranks
#
# `DistributedSampler` gives every rank `ceil(n / world_size)` items: it pads the index list from
# its start, then deals `indices[rank::world_size]` (torch/utils/data/distributed.py). It needs
# no process group. `small_data_warning` is a check to run before training.

# %%
def small_data_warning(n, world_size, drop_last=False):
    """A warning text when world_size replicas cannot each get distinct items, else None."""
    if n >= world_size:
        return None
    if drop_last:
        return f"{n} items on {world_size} replicas with drop_last=True: every rank gets 0 items (no training)"
    return f"{n} items on {world_size} replicas: {world_size - n} of the {world_size} ranks get a repeated item"


dealt = [list(DistributedSampler(range(3), num_replicas=7, rank=r, shuffle=False)) for r in range(7)]
dropped = [list(DistributedSampler(range(3), num_replicas=7, rank=r, shuffle=False, drop_last=True)) for r in range(7)]

# %% [markdown]
# **Claim:** ranks 0 to 6 get items `0, 1, 2, 0, 1, 2, 0`. Item 0 is trained on three times per
# epoch, items 1 and 2 twice. With `drop_last=True` every rank gets nothing. A loop over the
# loader then runs zero steps, without an error.
#
# **Claim:** with no more ranks than items, each rank gets one distinct item: 3 items on 3 ranks.
# For a tiny validation set, let every rank evaluate all of it. A warning before training,
# `small_data_warning`, finds the problem.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the dealt items, drop_last, and the warning
assert dealt == [[0], [1], [2], [0], [1], [2], [0]], dealt
assert [sum(d.count(i) for d in dealt) for i in range(3)] == [3, 2, 2]
assert dropped == [[]] * 7, dropped
assert small_data_warning(3, 7) == "3 items on 7 replicas: 4 of the 7 ranks get a repeated item"
assert "every rank gets 0 items" in small_data_warning(3, 7, drop_last=True)
assert [list(DistributedSampler(range(3), num_replicas=3, rank=r, shuffle=False)) for r in range(3)] == [[0], [1], [2]]
assert small_data_warning(3, 3) is None and small_data_warning(8, 2) is None
caught["6 few items"] = "not caught: the replicas stay identical"
print(small_data_warning(3, 7))

# %% [markdown]
# ## 7. Three invariants, three checks
#
# Each section above needed someone to describe the mistake first. Almost every silent DDP bug
# breaks one of three invariants instead:
#
# 1. N ranks train what one process trains on the same global batch.
# 2. Each epoch reads each item once, across all ranks.
# 3. Every rank holds the same model.
#
# One general check tests each on your unchanged worker `fn(rank, world_size, ...)`.
# `against_one_process` runs it at `world_size` ranks and at one rank and compares every
# parameter after every step. `data_coverage` records the items each rank's loader reads.
# `assert_in_sync(ddp)` compares the replicas. The first two use simulated ranks by default.
#
# The convention: one global batch. Each rank trains on global batch / `world_size` items, one
# process on all of them. Three bugs no section has shown, one per check:

# %%
from torch.utils.data import DataLoader, TensorDataset

from helpers.checks import against_one_process, data_coverage, verdict
from helpers.engine import simulate
from helpers.notebook import record_checks
from helpers.replicas import assert_in_sync

X7 = torch.arange(8.0)[:, None]  # one global batch of 8 items; the target is y = 2x + 1
Y7 = 2 * X7 + 1


def standardise_worker(rank, world_size, fix=False, steps=3):
    """Linear regression on this rank's share of the global batch, inputs centred by a mean."""
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(1, 1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = X7[rank::world_size], Y7[rank::world_size]
    mean = X7.mean() if fix else x.mean()  # the bug: the mean of this rank's share only
    for _ in range(steps):
        opt.zero_grad()
        ((ddp(x - mean) - y) ** 2).mean().backward()
        opt.step()
    assert_in_sync(ddp)  # raises if the replicas differ
    return ddp.module.weight.item()


def sampler_worker(rank, world_size, fix=False):
    """One epoch over 10 items, shuffled by a DistributedSampler."""
    data = TensorDataset(torch.arange(10.0))
    seed = 0 if fix else rank  # the bug: a seed that differs by rank
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=seed)
    return [batch.tolist() for (batch,) in DataLoader(data, batch_size=5, sampler=sampler)]


def dropout_worker(rank, world_size, fix=False):
    """A model whose dropout rate comes from a config file that only rank 0 read."""
    torch.manual_seed(0)
    p = 0.1 if rank == 0 or fix else 0.0  # the bug: the other ranks keep the default, 0.0
    ddp = DDP(nn.Sequential(nn.Linear(2, 2), nn.Dropout(p)))
    ddp(torch.ones(4, 2)).sum().backward()
    return checked(ddp)


general = {}  # (bug, "bug" or "fix") -> what the general check said
for fix in (False, True):
    tag = "fix" if fix else "bug"
    general[("mean of each rank's share", tag)] = verdict(against_one_process, standardise_worker, WORLD, fix=fix)
    general[("DistributedSampler seed=rank", tag)] = verdict(data_coverage, sampler_worker, WORLD, fix=fix)
    said = simulate(dropout_worker, WORLD, fix=fix)[0]
    general[("Dropout p read on rank 0 only", tag)] = "passes" if said == "ok" else f"ReplicasDiverged: {said}"
replica_weights = simulate(standardise_worker, WORLD)  # the bug, with assert_in_sync in the loop
pd.Series({k: v.splitlines()[0] for k, v in general.items()}, name="general check").to_frame()

# %% [markdown]
# **Claim:** with the mean of each rank's share, 2 ranks leave the one-process run at step 1.
# `against_one_process` raises `DivergedFromOneProcess` and names `weight`. `assert_in_sync`
# passes in that run: both replicas hold the same wrong weight. With the global batch's mean, the
# check passes.
#
# **Claim:** with `seed=rank`, each rank shuffles its own permutation. `data_coverage` raises
# `CoverageError`: items never read, items read twice, and "seed differs by rank". With one seed
# every item is read once.
#
# **Claim:** `assert_in_sync` raises on `Dropout(0.1)` on rank 0 and `Dropout(0.0)` on rank 1. It
# names `p` on both ranks and no tensor: the weights agree. With the same `p` it passes.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each general check catches its bug and passes the fix
diverged = general[("mean of each rank's share", "bug")]
assert diverged.startswith("DivergedFromOneProcess") and "step 1" in diverged and "`weight`" in diverged, diverged
assert replica_weights[0] == replica_weights[1], replica_weights
coverage = general[("DistributedSampler seed=rank", "bug")]
assert coverage.startswith("CoverageError") and "Never read" in coverage, coverage
assert "Read more than once" in coverage and "seed differs by rank" in coverage, coverage
config = general[("Dropout p read on rank 0 only", "bug")]
assert "module '1' (Dropout): p=0.1 on rank 0, p=0.0 on rank 1" in config and "tensors" not in config, config
for (bug, tag), said in general.items():
    assert (tag == "fix") == (said == "passes"), (bug, tag, said)
rows = {case: {"assert_in_sync": said if said.startswith("not") else f"caught: {said}"} for case, said in caught.items()}
rows["7 mean of each rank's share"] = {"against_one_process": "caught: step 1",
                                       "assert_in_sync": "not caught: the replicas agree"}
rows["7 DistributedSampler seed=rank"] = {"data_coverage": "caught: items never read, items read twice"}
rows["7 Dropout p read on rank 0 only"] = {"assert_in_sync": "caught: before step 1, naming p"}
record_checks("06d_silent_bugs", rows)  # for docs/CHECKS.md (python3 -m ci.checks_table)
print(diverged, coverage, config, sep="\n\n")

# %% [markdown]
# The same checks find four mistakes above without their sections' special code. Each worker is
# the section's mistake in the one-global-batch convention:
#
# * section 3, the mean loss reduced in place before `backward()`: `against_one_process`;
# * section 5, clipping each micro-batch: `against_one_process`;
# * section 4, `random_split` seeded by rank: `data_coverage`;
# * section 6, 3 items on 7 replicas: `data_coverage`.

# %%
from torch.utils.data import Subset

X3 = torch.tensor([[1.0], [3.0]])  # section 3's inputs as one global batch
X5 = torch.tensor([[1.0], [7.0], [1.0], [1.0]])  # section 5's: micro-batch i is rows 2i, 2i + 1


def mean_loss_worker(rank, world_size, fix=False):
    """Section 3: the mean loss reduced in place, then backward."""
    ddp = DDP(one())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    loss = ddp(X3[rank::world_size]).mean()
    if not fix:
        dist.all_reduce(loss)
        loss /= world_size  # the right value for the log, a gradient divided by world_size
    loss.backward()
    opt.step()


def clip_global_worker(rank, world_size, fix=False):
    """Section 5: two micro-batches of the global batch, clipped after each (or once, the fix)."""
    ddp = DDP(one())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for i, micro in enumerate((X5[:2], X5[2:])):
        with contextlib.nullcontext() if i == 1 else ddp.no_sync():
            ddp(micro[rank::world_size]).mean().backward()
        if i == 1 or not fix:
            nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=4.0)
    opt.step()


def split_loader_worker(rank, world_size, fix=False):
    """Section 4: random_split seeded by rank, then this rank's share of its training part."""
    seed = 0 if fix else rank
    train, _ = random_split(range(n_items), [n_items - 2, 2], generator=torch.Generator().manual_seed(seed))
    if fix:
        sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, seed=0)
        return [b.tolist() for b in DataLoader(train, batch_size=2, sampler=sampler)]
    return [b.tolist() for b in DataLoader(Subset(train, range(rank, len(train), world_size)), batch_size=2)]


def few_items_worker(rank, world_size):
    """Section 6: 3 items dealt to world_size replicas."""
    sampler = DistributedSampler(range(3), num_replicas=world_size, rank=rank, shuffle=False)
    return [b.tolist() for b in DataLoader(range(3), sampler=sampler)]


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # section 3's "autograd kernel was not registered"
    earlier = {"3 mean loss in place": verdict(against_one_process, mean_loss_worker, WORLD),
               "3 fix: detached copy": verdict(against_one_process, mean_loss_worker, WORLD, fix=True),
               "5 clip each micro-batch": verdict(against_one_process, clip_global_worker, WORLD),
               "5 fix: clip once": verdict(against_one_process, clip_global_worker, WORLD, fix=True)}
earlier["4 random splits"] = verdict(data_coverage, split_loader_worker, WORLD)
earlier["4 fix: same seed + sampler"] = verdict(data_coverage, split_loader_worker, WORLD, fix=True)
earlier["6 few items, 7 replicas"] = verdict(data_coverage, few_items_worker, 7)
pd.Series({k: v.splitlines()[0] for k, v in earlier.items()}, name="general check").to_frame()

# %% [markdown]
# **Claim:** `against_one_process` raises on section 3's in-place mean at step 1 and passes its
# fix, and on section 5's clipping of each micro-batch: one process clips `(1 + 7) / 2`, not 7.
# `data_coverage` raises on section 4's per-rank seeds, naming an item read twice. It passes the
# fix. It raises on 3 items at 7 replicas: item 0 is read three times.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the general checks on sections 3, 4, 5 and 6
assert earlier["3 mean loss in place"].startswith("DivergedFromOneProcess") and "step 1" in earlier["3 mean loss in place"]
assert earlier["5 clip each micro-batch"].startswith("DivergedFromOneProcess") and "step 1" in earlier["5 clip each micro-batch"]
assert all(earlier[k] == "passes" for k in earlier if "fix" in k), earlier
assert earlier["4 random splits"].startswith("CoverageError") and "Read more than once" in earlier["4 random splits"]
assert earlier["6 few items, 7 replicas"].startswith("CoverageError") and "0 (3x)" in earlier["6 few items, 7 replicas"]
rows["3 all-reduce"]["against_one_process"] = "caught: step 1 (mean loss in place)"
rows["4 random splits"]["data_coverage"] = "caught: items read twice"
rows["5 clipping"]["against_one_process"] = "caught: step 1 (clip each micro-batch)"
rows["6 few items"]["data_coverage"] = "caught: item 0 read three times"
record_checks("06d_silent_bugs", rows)  # section 7's rows and these, for docs/CHECKS.md
print(*(v.splitlines()[0] for v in earlier.values()), sep="\n")

# %%
print(f"lesson 06d ran in {time.perf_counter() - t_notebook:.0f} s")
pd.Series(caught, name="assert_in_sync").to_frame()

# %% [markdown]
# ## What we saw
#
# | mistake | wrong | right | found by |
# | --- | --- | --- | --- |
# | `ddp.module(x)`, `ddp.module.score(x)` | rank-local steps | `ddp(x)`, `ddp(x, score=True)` | `assert_in_sync`, step 1 |
# | a bypass at step 2, then the wrapper | a gap that never closes | every call through `ddp(...)` | `assert_in_sync`, step 2 |
# | freeze / new `nn.Parameter` after `DDP(...)` | step 1 unsynced, step 2 raises | change, then wrap; `copy_` | `assert_in_sync`, before step 1 and at step 1 |
# | `dist.all_reduce` in the graph, in-place mean loss | value reduced, gradient local | autograd all-reduce; reduce a detached copy | `against_one_process` |
# | counter reduced via `.float()` | 3 and 5 | 8 | equal on every rank? |
# | per-rank split seeds | shared and leaked items | same seed + `DistributedSampler` | `data_coverage` |
# | clipping each micro-batch | 3.5, local norms | 4, norm 5 | `against_one_process` |
# | 3 items, 7 ranks | repeats, or nothing | more items or fewer ranks | a warning, `data_coverage` |
#
# `assert_in_sync` finds drifting replicas at the first wrong step. Replicas that agree on a wrong
# value need `against_one_process`, `data_coverage` or an equal-on-every-rank metric. Run them in a
# short first run of your training.
#
# ## Exercises
#
# Predict each value by hand, set `answer_N` and run the check cell below it: "correct" or "not
# yet" with a hint. A folded solution follows each check.

# %% [markdown]
# ### Exercise 1: a bypass at the first step
#
# Section 1's `Scorer` trains three steps with `LR = 1/8`. Step 1 goes through
# `ddp.module.score(x)`, steps 2 and 3 through `ddp(x)`. What are the two ranks' weights after step 3? Answer with a
# list `[rank 0, rank 1]`.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1
# expected: the weights section 1's worker returns for this plan, launched here
plan = {"exercise": ["score", "ddp", "ddp"]}
expected_1 = weights_by_rank(launch(bypass_worker, WORLD, 0, plan, backend="gloo", timeout=120), "exercise")
check_answer("ex1", answer_1, expected_1, hint="step 1 is rank-local (gradient 2x); steps 2 and 3 use the mean, 2")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# step 1: 1 - 2/8 = 0.75 and 1 - 6/8 = 0.25; steps 2 and 3 subtract 2/8 each from both.
solution_1 = [1 - 2 / 8 - 2 * 2 / 8, 1 - 6 / 8 - 2 * 2 / 8]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: 5 items on 3 replicas
#
# `DistributedSampler(range(5), num_replicas=3, rank=2, shuffle=False)`: which items does rank
# 2 get? Answer with a list.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2
# expected: the real sampler
expected_2 = list(DistributedSampler(range(5), num_replicas=3, rank=2, shuffle=False))
check_answer("ex2", answer_2, expected_2, hint="pad to 6 by repeating from the start, then deal every third index")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# 3 ranks x ceil(5 / 3) = 6 indices: [0, 1, 2, 3, 4] + [0]; rank 2 takes positions 2 and 5.
padded = [0, 1, 2, 3, 4, 0]
solution_2 = padded[2::3]
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [06e more silent DDP bugs](06e_more_silent_bugs.ipynb): predict what checkpointing, `static_graph`, `GradScaler` clipping and a slow rank do.
# <!-- next:end -->
