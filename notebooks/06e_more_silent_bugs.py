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
# # 06e · More silent DDP bugs
#
# <!-- opening:start -->
# **You will be able to** predict what checkpointing, `static_graph`, `GradScaler` clipping and a slow rank do. **You need** [06d silent DDP bugs](06d_silent_bugs.ipynb), [06a training-loop pitfalls](06a_training_loop_pitfalls.ipynb).
# <!-- opening:end -->
#
# **The question:** some runs finish and are wrong, or die for a reason far from the bug. Which
# are they, and what finds them?
#
# As in 06d, each section runs a tiny model on 2 real ranks with `launch`, backend `gloo`, on CPU.
# `x = 1` on rank 0 and `x = 3` on rank 1; weights start at 1; the learning rate is 1/8.
#
# Each section shows the wrong value, the right value and the fix. It says whether
# `assert_in_sync`, called after every step, catches the mistake at the first wrong step. Each
# bold "Claim:" is asserted by the folded code cell right after it, tagged `check`.
#
# 1. checkpointing a layer used twice · 2. `static_graph=True` and a changing graph ·
# 3. `GradScaler` and clipping · 4. a slow rank-0-only block · 5. the general checks
#
# Terms, see the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [all-reduce](../docs/GLOSSARY.md#all-reduce), [DDP](../docs/GLOSSARY.md#ddp).

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
collective_timeout_s = 1.5  # seconds a rank waits in a collective of section 4's short-timeout group
batch_s = 0.5  # seconds one evaluation batch takes in section 4 (a time.sleep)

# %%
from helpers.notebook import check_answer, check_parameters, check_value

eval_batches = 6  # evaluation batches of section 4 (an even number: 2 ranks share them)

check_parameters(collective_timeout_s=(collective_timeout_s, float), batch_s=(batch_s, float))
check_value("collective_timeout_s", collective_timeout_s, 1.0 <= collective_timeout_s <= 30.0, "1 to 30 seconds")
check_value("batch_s", batch_s, eval_batches * batch_s >= collective_timeout_s + 1.0,
            "so that rank 0 alone evaluates at least 1 s longer than collective_timeout_s")

# %%
import datetime
import time
import warnings

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

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
# The same as 06d's, from `helpers.tiny`, imported above. `one()` is `Linear(1, 1, bias=False)`
# with weight 1. `x_of(rank)` is the rank's input. `checked(model)` returns the replica checker's
# message, or "ok". `steps(...)` trains a few steps and checks after each. It stops at the first
# error and returns it as text.

# %%
def steps(ddp, loss_of, n):
    """n SGD steps; loss_of(step) gives the loss. {"weights": per step, "checker": per step, "error": (step, text)}."""
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    out = {"weights": [], "checker": [], "error": None}
    for step in range(1, n + 1):
        opt.zero_grad(set_to_none=True)
        try:
            loss_of(step).backward()
        except RuntimeError as e:
            out["error"] = (step, str(e))
            break
        opt.step()
        out["weights"].append([round(p.item(), 6) for p in ddp.module.parameters()])
        out["checker"].append(checked(ddp))
    return out


def first_wrong(result):
    """The first step at which the checker raised (None: never)."""
    return next((s for s, c in enumerate(result["checker"], start=1) if c != "ok"), None)

# %% [markdown]
# ## 1. Checkpointing a layer used twice
#
# Activation checkpointing, `torch.utils.checkpoint.checkpoint`, keeps no activations in the
# forward. It recomputes them in the backward. With `use_reentrant=True` each checkpointed call
# runs its own small backward inside the big one. A layer checkpointed twice then has its
# gradient accumulated twice: DDP's hook on that parameter fires twice in one backward.
#
# The model applies `inp`, not checkpointed, then `lin` twice, each under `checkpoint`. Its output
# is `w_lin² w_inp x`. By hand, `lin`'s gradient is `2 w_lin w_inp x = 2x`, averaged 4. `inp`'s is
# `w_lin² x = x`, averaged 2. So after one step `lin = 1 − 4/8 = 0.5` and `inp = 1 − 2/8 = 0.75`.

# %%
class Twice(nn.Module):
    def __init__(self, reentrant=None):
        super().__init__()
        self.inp, self.lin, self.reentrant = one(), one(), reentrant

    def forward(self, x):
        y = self.inp(x)
        if self.reentrant is None:  # no checkpointing: the reference
            return self.lin(self.lin(y))
        y = checkpoint(self.lin, y, use_reentrant=self.reentrant)
        return checkpoint(self.lin, y, use_reentrant=self.reentrant)


def checkpoint_worker(rank, world_size):
    x = x_of(rank)
    setups = {"no checkpointing": (None, {}), "reentrant, default DDP": (True, {}),
              "reentrant, find_unused_parameters=True": (True, {"find_unused_parameters": True}),
              "reentrant, static_graph=True": (True, {"static_graph": True}),
              "use_reentrant=False": (False, {})}
    out = {}
    for name, (reentrant, ddp_kwargs) in setups.items():
        ddp = DDP(Twice(reentrant), **ddp_kwargs)
        out[name] = steps(ddp, lambda step, ddp=ddp: ddp(x).sum(), 2)
    return out


P = launch(checkpoint_worker, WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** with default DDP settings the first backward raises on every rank: "Expected to mark
# a variable ready only once". The message names the cause, "Reused parameters in multiple
# reentrant backward passes". `find_unused_parameters=True` raises the same.
#
# **Claim:** `static_graph=True` and `use_reentrant=False` train right: `[inp, lin] = [0.75, 0.5]`
# after step 1. Both steps equal the run without checkpointing, and the checker passes. So none
# of the four is silent.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the errors at step 1, and the two set-ups that train right
for r in range(WORLD):
    reference = P[r]["no checkpointing"]
    assert reference["weights"][0] == [0.75, 0.5] and reference["error"] is None, reference
    for name in ("reentrant, default DDP", "reentrant, find_unused_parameters=True"):
        step, error = P[r][name]["error"]
        assert step == 1 and "Expected to mark a variable ready only once" in error, (name, error)
        assert "Reused parameters in multiple reentrant backward passes" in error, error
    for name in ("reentrant, static_graph=True", "use_reentrant=False"):
        assert P[r][name]["error"] is None and P[r][name]["weights"] == reference["weights"], (name, P[r][name])
        assert first_wrong(P[r][name]) is None, P[r][name]["checker"]
caught["1 checkpointing"] = "nothing silent: raises at step 1, or right"
print(P[0]["reentrant, default DDP"]["error"][1].split(". ")[0])
pd.DataFrame({name: [str(r["weights"]) if r["error"] is None else "raises at step %d" % r["error"][0]]
              for name, r in P[0].items()}, index=["[inp, lin] after steps 1, 2 (rank 0)"]).T

# %% [markdown]
# ## 2. `static_graph=True` and a graph that changes
#
# `static_graph=True` tells DDP the graph is the same every iteration. DDP records in iteration 1
# which parameters get a gradient, then waits for exactly those. Two ways break that promise
# without a word. The model `Two` returns two outputs, `a(x)` and `b(x)`. Both are `one()` layers,
# so each weight's gradient is `x`, averaged 2:
#
# * **an output the loss ignores**: the loss is `a(x)` only, every step; `b` is in the output
#   but never gets a gradient;
# * **a branch that switches off**: step 1's loss is `a(x) + b(x)`; from step 2 on the forward
#   skips `b`.
#
# Each runs 3 steps with four settings: the defaults, `static_graph=True`, both `static_graph=True`
# and `find_unused_parameters=True`, and `find_unused_parameters=True` alone.

# %%
class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = one(), one()

    def forward(self, x, use_b=True):
        return self.a(x), (self.b(x) if use_b else None)


def static_worker(rank, world_size):
    x = x_of(rank)
    settings = {"default": {}, "static_graph": {"static_graph": True},
                "static_graph + find_unused": {"static_graph": True, "find_unused_parameters": True},
                "find_unused_parameters": {"find_unused_parameters": True}}

    def ignored(ddp):
        return lambda step: ddp(x)[0].sum()

    def switch(ddp):
        def loss_of(step):
            a, b = ddp(x, use_b=step == 1)
            return a.sum() + b.sum() if step == 1 else a.sum()
        return loss_of

    out = {}
    for case, make_loss in (("ignored output", ignored), ("branch off from step 2", switch)):
        for name, ddp_kwargs in settings.items():
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                ddp = DDP(Two(), **ddp_kwargs)
            out[case, name, "warnings"] = [str(w.message) for w in seen]
            out[case, name] = steps(ddp, make_loss(ddp), 4 if name == "static_graph" else 3)
    return out


G = launch(static_worker, WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** with an ignored output, default DDP leaves step 1 unsynced: `a` is 0.875 on rank 0
# and 0.625 on rank 1. Step 2 raises "Expected to have finished reduction in the prior
# iteration". Default settings also leave the switched-off branch's step 2 unsynced, as 06a's
# unused parameter did.
#
# **Claim:** in both cases `static_graph=True` gets step 1 right, 0.75 on both: iteration 1 is the
# one it watches. Step 2 is unsynced, 0.625 and 0.375: each rank stepped with its own `x`. Step 3
# raises "your training graph has changed in this iteration".
#
# **Claim:** adding `find_unused_parameters=True` to `static_graph=True` changes nothing. A static
# graph is checked once, in iteration 1. DDP even warns at the wrap: "`_set_static_graph` will
# detect unused parameters automatically".
#
# **Claim:** `find_unused_parameters=True` alone trains both cases right: `a` is 0.75, 0.5, 0.25.
# The checker raises at the first unsynced step. Under `static_graph=True` that is step 2, naming
# `a.weight`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: weights, errors, warnings and the checker for every setting
def a_weights(case, name):
    return [[w[0] for w in G[r][case, name]["weights"]] for r in range(WORLD)]


for case in ("ignored output", "branch off from step 2"):
    for name in ("static_graph", "static_graph + find_unused"):
        assert a_weights(case, name) == [[0.75, 0.625], [0.75, 0.375]], (case, name, a_weights(case, name))
        for r in range(WORLD):
            step, error = G[r][case, name]["error"]
            assert step == 3 and "your training graph has changed in this iteration" in error, (case, name, error)
        assert first_wrong(G[0][case, name]) == 2, G[0][case, name]["checker"]
        assert "parameter 'a.weight'" in G[0][case, name]["checker"][1], G[0][case, name]["checker"][1]
    assert any("will detect unused parameters automatically" in w
               for w in G[0][case, "static_graph + find_unused", "warnings"]), G[0][case, "static_graph + find_unused", "warnings"]
    assert not G[0][case, "static_graph", "warnings"]
    assert a_weights(case, "find_unused_parameters") == [[0.75, 0.5, 0.25]] * 2, a_weights(case, "find_unused_parameters")
    assert G[0][case, "find_unused_parameters"]["error"] is None
    assert first_wrong(G[0][case, "find_unused_parameters"]) is None
assert a_weights("ignored output", "default") == [[0.875], [0.625]], a_weights("ignored output", "default")
step, error = G[0]["ignored output", "default"]["error"]
assert step == 2 and "Expected to have finished reduction in the prior iteration" in error, error
assert first_wrong(G[0]["ignored output", "default"]) == 1
assert a_weights("branch off from step 2", "default") == [[0.75, 0.625], [0.75, 0.375]]
assert first_wrong(G[0]["branch off from step 2", "default"]) == 2
caught["2 static_graph"] = "step 2 (step 1 with default settings)"
print(G[0]["ignored output", "static_graph"]["checker"][1])
runs = [key for key in G[0] if len(key) == 2]
pd.DataFrame([[str(a_weights(*key)[0]), str(a_weights(*key)[1]), first_wrong(G[0][key]) or "never",
               G[0][key]["error"][0] if G[0][key]["error"] else "never"] for key in runs],
             index=pd.MultiIndex.from_tuples(runs, names=["case", "DDP settings"]),
             columns=["a, rank 0", "a, rank 1", "checker raises at", "DDP raises at"])

# %% [markdown]
# The fix, when the set of parameters that get a gradient can change:
# `find_unused_parameters=True` without `static_graph=True`. Or a loss that uses every output the
# forward returns.
#
# ## 3. `GradScaler` and clipping
#
# Mixed precision with float16 scales the loss by `S` before `backward()`, so small gradients do
# not underflow. `scaler.unscale_(opt)` divides the gradients by `S` again. Clipping before
# `unscale_` clips the **scaled** gradient. The norm it returns, what a logger prints, is `S`
# times the real one.
#
# In torch 2.14 the CPU has both `torch.amp.GradScaler("cpu")` and
# `torch.autocast("cpu", dtype=torch.float16)`. So this section uses float16, the dtype a scaler
# exists for; bfloat16 has float32's range and needs none. `S = 4` through `init_scale=4.0`: a
# power of two, so exact. The default is 65536. With `max_norm = 1`, the averaged gradient is 2
# and the scaled one 8.

# %%
def scaler_worker(rank, world_size, init_scale=4.0):
    x = x_of(rank)
    out = {}
    for order in ("clip, then unscale_", "unscale_, then clip", "no clipping"):
        ddp = DDP(one())
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        with torch.autocast("cpu", dtype=torch.float16):
            y = ddp(x)
        scaler.scale(y.float().sum()).backward()
        norm = None
        if order == "clip, then unscale_":
            norm = float(nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0))
            scaler.unscale_(opt)
        elif order == "unscale_, then clip":
            scaler.unscale_(opt)
            norm = float(nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0))
        scaler.step(opt)
        scaler.update()
        out[order] = {"dtype": str(y.dtype), "logged norm": norm, "weight": ddp.module.weight.item(),
                      "checker": checked(ddp, grads=True)}
    return out


A = launch(scaler_worker, WORLD, backend="gloo", timeout=120)
A8 = launch(scaler_worker, WORLD, 8.0, backend="gloo", timeout=120)  # for exercise 1

# %% [markdown]
# The right order is `scale(loss).backward()`, `unscale_`, clip, `step`, `update`.
#
# **Claim:** the forward runs in float16 on the CPU. Clipped before `unscale_`, the logged norm is
# 8, that is `S × 2`. The scaled gradient is clipped to 1 and unscaled to `1/4`. So the weight
# moves by `0.25 / 8` to 0.96875, an update 4 times too small.
#
# **Claim:** in the right order the norm is 2, the gradient is clipped to 1 and the weight becomes
# `1 − 1/8 = 0.875`. Unclipped it is 0.75.
#
# **Claim:** the replicas agree in all three: the checker passes. What catches it is a
# one-process reference, the norm of the averaged unscaled gradient, 2.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: logged norms and weights in each order, against one process
near = {"atol": 1e-5, "rtol": 0}
for r in range(WORLD):
    wrong, right = A[r]["clip, then unscale_"], A[r]["unscale_, then clip"]
    assert all(v["dtype"] == "torch.float16" for v in A[r].values()), A[r]
    assert_close(wrong["logged norm"], 8.0, **near)
    assert_close(wrong["weight"], 1 - 0.25 * LR, **near)
    assert_close(right["logged norm"], 2.0, **near)
    assert_close(right["weight"], 0.875, **near)
    assert A[r]["no clipping"]["weight"] == 0.75
    assert all(v["checker"] == "ok" for v in A[r].values())
reference = float(nn.utils.get_total_norm([torch.tensor([(1.0 + 3.0) / 2])]))  # one process: the mean gradient's norm
assert reference == 2.0 and abs(A[0]["clip, then unscale_"]["logged norm"] - reference) > 1
caught["3 GradScaler"] = "not caught: the replicas stay identical"
pd.DataFrame({k: [v["logged norm"], round(v["weight"], 6)] for k, v in A[0].items()},
             index=["logged norm", "weight after the step"])

# %% [markdown]
# ## 4. A slow rank-0-only block
#
# A loop may evaluate or save on rank 0 only: `if rank == 0: evaluate()`. That block has no
# collective, so rank 1 runs ahead into the next collective and waits there. When the wait is
# longer than the group's timeout, the rank that fails is the one **not** doing the slow work.
# Its message is about a send or receive, not about the evaluation.
#
# Here the evaluation is `eval_batches` batches of `batch_s` seconds each, a `time.sleep`. Each
# batch's "loss" is its index. The next collective is an all-reduce on a group made with
# `dist.new_group(timeout=...)`, as in 06a. Its timeout is `collective_timeout_s`; in a real job
# gloo's default is 30 minutes.
#
# There are two fixes. Shard the evaluation, so every rank works on half the batches, and
# all-reduce the result. Or let rank 1 wait in a barrier of a separate group with a long timeout,
# then carry on in the short one.

# %%
def evaluate(batches):
    """Sum of the batches' losses (a batch's loss is its index); batch_s seconds per batch."""
    total = 0.0
    for i in batches:
        time.sleep(batch_s)
        total += i
    return total


def slow_rank0_worker(rank, world_size, plan, timeout_s):
    short = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    long_wait = dist.new_group(timeout=datetime.timedelta(seconds=60))
    step = torch.ones(1)
    dist.all_reduce(step, group=short)  # a training step's all-reduce: the ranks start together
    out = {"error": None, "eval": None}
    try:
        if plan == "sharded":
            total = torch.tensor([evaluate(range(eval_batches)[rank::world_size])])
            dist.all_reduce(total, group=short)
            out["eval"] = total.item()
        elif rank == 0:
            out["eval"] = evaluate(range(eval_batches))
            out["eval done"] = time.time()
        if plan == "long-timeout barrier":
            dist.barrier(group=long_wait)
        dist.all_reduce(step, group=short)  # the next training step's all-reduce
    except RuntimeError as e:
        out["error"], out["failed"] = str(e), time.time()
    return out


L = {plan: launch(slow_rank0_worker, WORLD, plan, collective_timeout_s, backend="gloo", timeout=120)
     for plan in ("rank 0 alone", "sharded", "long-timeout barrier")}

# %% [markdown]
# **Claim:** with rank 0 evaluating alone, rank 1 fails first, while rank 0 is still evaluating.
# Its message is "Timed out waiting 1500ms for send operation", or recv; the milliseconds are
# `collective_timeout_s`. Rank 0 then reaches the all-reduce and fails at once: "Connection
# closed by peer ... typically caused by a remote worker crashing". Neither names the evaluation.
#
# **Claim:** sharded, both ranks evaluate half the batches and get the full sum
# `0 + 1 + ... + (eval_batches − 1)`, without an error. With the long-timeout barrier rank 0
# evaluates alone and both ranks carry on without an error.
#
# The replica checker has nothing to check here: no parameter differs.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: who fails first and with which message; both fixes complete
alone = L["rank 0 alone"]
assert f"Timed out waiting {round(collective_timeout_s * 1000)}ms" in alone[1]["error"], alone[1]["error"]
assert alone[1]["failed"] < alone[0]["eval done"], "rank 1 fails while rank 0 still evaluates"
assert "Connection closed by peer" in alone[0]["error"], alone[0]["error"]
assert alone[0]["failed"] >= alone[0]["eval done"]
full_sum = float(sum(range(eval_batches)))
assert [r["eval"] for r in L["sharded"]] == [full_sum, full_sum] and all(r["error"] is None for r in L["sharded"])
assert L["long-timeout barrier"][0]["eval"] == full_sum and all(r["error"] is None for r in L["long-timeout barrier"])
caught["4 slow rank 0"] = "not caught: a timeout on rank 1, not a divergence"
for r in range(WORLD):
    print(f"rank {r}:", alone[r]["error"].split("] ")[-1][:90])

# %% [markdown]
# ## 5. The general checks on these cases
#
# Lesson 06d section 7 showed three general checks, one per invariant. Which of them find this
# page's mistakes?
#
# * Section 2's `static_graph` run drifts apart, and `assert_in_sync` finds it, as shown above.
# * Section 1 raises at step 1, and section 4 times out: neither is silent.
# * Section 3's clipping before `unscale_` is the same mistake in one process.
#   `against_one_process` compares with one process that makes it too.

# %%
from helpers.checks import against_one_process
from helpers.engine import simulate
from helpers.notebook import record_checks

X5 = torch.tensor([[1.0], [3.0]])  # section 3's inputs as one global batch


def scaler_global_worker(rank, world_size, fix=False):
    """Section 3 in the one-global-batch convention: clip before unscale_, or after it."""
    ddp = DDP(one())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with torch.autocast("cpu", dtype=torch.float16):
        y = ddp(X5[rank::world_size])
    scaler.scale(y.float().mean()).backward()
    if fix:
        scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
    scaler.step(opt)
    scaler.update()
    return ddp.module.weight.item()


versus_one = {fix: repr(against_one_process(scaler_global_worker, WORLD, fix=fix)) for fix in (False, True)}
scaled_weights = {fix: simulate(scaler_global_worker, WORLD, fix=fix) for fix in (False, True)}
pd.DataFrame({"clip, then unscale_": [versus_one[False], scaled_weights[False]],
              "unscale_, then clip": [versus_one[True], scaled_weights[True]]},
             index=["against_one_process", "weight on each rank"])

# %% [markdown]
# **Claim:** `against_one_process` passes on clipping before `unscale_`, with the weight 0.96875
# on both ranks, as in section 3. It passes the right order too, at 0.875. No general check
# catches a mistake that one process makes the same way. Section 3's hand-worked reference does.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the general check passes both orders; the weights are section 3's
assert all(v.startswith(f"<{WORLD} ranks = one process") for v in versus_one.values()), versus_one
assert scaled_weights[False] == [1 - 0.25 * LR] * WORLD, scaled_weights
assert_close(scaled_weights[True], [0.875] * WORLD, atol=1e-5, rtol=0)
rows = {case: {"assert_in_sync": said if said.startswith(("not", "nothing")) else f"caught: {said}"}
        for case, said in caught.items()}
rows["3 GradScaler"]["against_one_process"] = "not caught: the same mistake in one process"
record_checks("06e_more_silent_bugs", rows)  # for docs/CHECKS.md (python3 -m ci.checks_table)
print(versus_one[False])

# %%
print(f"lesson 06e ran in {time.perf_counter() - t_notebook:.0f} s")
pd.Series(caught, name="assert_in_sync").to_frame()

# %% [markdown]
# ## What we saw
#
# | mistake | wrong | right | found by |
# | --- | --- | --- | --- |
# | reentrant checkpoint, layer used twice | raises at step 1 (default, `find_unused_parameters`) | `static_graph=True` or `use_reentrant=False` | the error |
# | `static_graph=True`, ignored output or branch off | step 2 unsynced, step 3 raises | `find_unused_parameters=True` alone | `assert_in_sync`, step 2 |
# | clip before `unscale_` | norm `S ×` too large, update `S ×` too small | `unscale_`, then clip | one-process norm |
# | slow rank-0-only block | rank 1 times out, rank 0 "connection closed" | shard it; long-timeout barrier | the timeout text |
#
# A set-up DDP cannot follow either raises, as checkpointing did, or leaves replicas apart for a
# step before it raises, as `static_graph` did. `assert_in_sync` in the loop finds the second at
# the first wrong step. A scaler in the wrong order keeps the replicas identical and wrong:
# compare the logged norm with a reference. A timeout on the rank that did nothing wrong means:
# look at what the **other** rank was doing without a collective.
#
# ## Exercises
#
# Both ask for a value: predict it by hand first. Then set `answer_N` in place of `None` and run
# the check cell below it. It prints "correct" or "not yet" with a hint. In the full lesson a
# collapsed solution follows each check; student copies leave the solutions out. Every solution
# runs when the full lesson runs, so each is known to pass its check.

# %% [markdown]
# ### Exercise 1: a larger scale
#
# Section 3 with `init_scale=8.0`, clipping to `max_norm = 1` **before** `unscale_`: what is
# the weight after the step?

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1
# expected: the weight section 3's second launch returned
expected_1 = A8[0]["clip, then unscale_"]["weight"]
check_answer("ex1", answer_1, expected_1, hint="the scaled gradient is 16; clipped to 1, then divided by 8")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# scaled gradient 8 x 2 = 16, clipped to 1, unscaled to 1/8; the step is LR x 1/8 = 1/64.
solution_1 = 1 - LR / 8
check_answer("ex1", solution_1, expected_1, strict=True, abs_tol=1e-6)

# %% [markdown]
# ### Exercise 2: when does it raise?
#
# Section 2's branch that switches off runs for 4 steps with `static_graph=True`. At which step
# does DDP raise? At which step does `assert_in_sync` raise first? Answer with a list
# `[DDP raises, checker raises]`.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2
# expected: the run section 2's launch returned
run = G[0]["branch off from step 2", "static_graph"]
expected_2 = [run["error"][0], first_wrong(run)]
check_answer("ex2", answer_2, expected_2, hint="iteration 1 is watched; step 2's bucket never fills; step 3's forward finds it")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# step 2 is unsynced (the checker raises after it); step 3's forward sees the unfinished reduction.
solution_2 = [3, 2]
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [07a torchrun and many nodes](07a_torchrun_and_many_nodes.ipynb): run the same worker under `torchrun` on one or two nodes; say what a failed node does.
# <!-- next:end -->
