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
# # 10a · Casebook: the training loop
#
# <!-- opening:start -->
# **You need** [06a training-loop pitfalls](06a_training_loop_pitfalls.ipynb), [06d silent DDP bugs](06d_silent_bugs.ipynb).
# <!-- opening:end -->
#
# **What this page is.** A casebook page, not a lesson. Each section is one mistake that people
# report, found by its symptom. A case quotes the symptom and names the thread it comes from.
# Then come the shortest program that shows it, the wrong and the right value, the fix, and the
# check that catches it. The page computes and asserts both values. Read only the case you came
# for.
#
# Cases on this page:
#
# * [my GAN's replicas drift apart](#case-two-forwards-two-backwards)
# * [the replicas split at the end of every epoch](#case-epoch-ends-inside-accumulation)
# * [validation on rank 0 broke training](#case-rank0-validate-leaves-eval)
# * [my token-averaged loss differs from one GPU's](#case-token-weighted-loss)
# * [the gradients I logged are all the same](#case-bucket-view-kept-grad)
#
# Every program runs on 2 real ranks with `launch` and backend `gloo`, on the CPU. It uses 06d's
# model: one weight `w = 1`, input `x = 1` on rank 0 and `x = 3` on rank 1, learning rate 1/8.
# Each claim is in bold, "Claim:", and the code cell right after it asserts it.
#
# Terms, from the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [DDP](../docs/GLOSSARY.md#ddp), [bucket](../docs/GLOSSARY.md#bucket),
# [gradient synchronisation](../docs/GLOSSARY.md#gradient-synchronisation).

# %% tags=["parameters"]
# Parameters: what you run by default, top to bottom in JupyterLab (the smoke profile); the full profile overrides some (docs/RUNNER.md)
epoch_micro_batches = 3  # micro-batches in one epoch of the accumulation case
accum_steps = 2  # micro-batches per optimizer step in the accumulation case
steps_after_validate = 2  # training steps after the rank-0-only validate()

# %%
from helpers.notebook import check_parameters, check_value

check_parameters(epoch_micro_batches=(epoch_micro_batches, int), accum_steps=(accum_steps, int),
                 steps_after_validate=(steps_after_validate, int))
check_value("accum_steps", accum_steps, 2 <= accum_steps <= 8, "2 to 8")
check_value("epoch_micro_batches", epoch_micro_batches,
            accum_steps < epoch_micro_batches <= 40 and epoch_micro_batches % accum_steps != 0,
            "more than accum_steps, at most 40, and not a multiple of accum_steps (the case needs a leftover)")
check_value("steps_after_validate", steps_after_validate, 1 <= steps_after_validate <= 10, "1 to 10")

# %%
import contextlib
import time

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.engine import launch
from helpers.replicas import ReplicasDiverged, assert_in_sync
from helpers.tiny import checked, one, x_of

t_notebook = time.perf_counter()
WORLD = 2  # every value below is worked out for 2 ranks
LR = 0.125  # SGD learning rate: 1/8, so the weights are exact in float32
print(f"torch {torch.__version__}")

# %% [markdown]
# <a id="case-two-forwards-two-backwards"></a>
# ## Case: my GAN's replicas drift apart
#
# **Symptom.** "The discriminator sees real and fake images in two forward passes, then I call
# backward twice. The ranks' weights drift apart." From
# [pytorch/pytorch#47260](https://github.com/pytorch/pytorch/issues/47260).
#
# **Why.** A DDP forward prepares the reducer for one backward. Here two forwards come before two
# backwards. The first backward's hooks all-reduce the gradient. The second backward's hooks are
# not armed, so it adds a rank-local gradient. The case extends
# [06a](06a_training_loop_pitfalls.ipynb) on what a DDP step does, and
# [06d](06d_silent_bugs.ipynb) on bypassing the wrapper.
#
# The program: the discriminator is `one()`, and the real input is `x`, 1 or 3. The fake input
# is 2 on rank 0 and 4 on rank 1.

# %%
def gan_step(rank, world_size, one_backward, ddp_kwargs):
    real = x_of(rank)  # 1 on rank 0, 3 on rank 1
    fake = torch.tensor([[2.0 if rank == 0 else 4.0]])
    ddp = DDP(one(), **ddp_kwargs)  # the discriminator, weight 1
    d_real, d_fake = ddp(real), ddp(fake)  # two forwards through one wrapper
    if one_backward:
        (d_real.sum() + d_fake.sum()).backward()  # the fix: one backward of the sum
    else:
        d_real.sum().backward()
        d_fake.sum().backward()  # adds a gradient no all-reduce sees
    grad = ddp.module.weight.grad.item()
    torch.optim.SGD(ddp.parameters(), lr=LR).step()
    return grad, checked(ddp)


GAN_SETUPS = {"two backwards, default": (False, {}),
              "two backwards, find_unused_parameters": (False, {"find_unused_parameters": True}),
              "two backwards, static_graph": (False, {"static_graph": True}),
              "one backward of the sum": (True, {})}
GAN = launch(lambda rank, world_size: {name: gan_step(rank, world_size, *setup) for name, setup in GAN_SETUPS.items()},
             WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** the true gradient is the mean over ranks of `real + fake`:
# `((1 + 2) + (3 + 4)) / 2 = 5`. One process gives it from the summed loss. One backward of the
# sum gives 5 on both ranks. With two backwards, each rank gets the all-reduced real part 2 plus
# its own fake input, whatever the DDP option. The replica checker then raises after the first
# step.
#
# | run | rank 0 | rank 1 | replica checker |
# | --- | --- | --- | --- |
# | two backwards: default, `find_unused_parameters`, `static_graph` | 2 + 2 = 4 | 2 + 4 = 6 | raises |
# | one backward of the sum | 5 | 5 | passes |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: two backwards split the ranks; one backward matches one process
w = torch.ones(1, requires_grad=True)
(w * (1.0 + 2.0) + w * (3.0 + 4.0)).sum().div(WORLD).backward()  # one process: the mean loss over the ranks
reference = w.grad.item()
assert reference == 5.0
for name in GAN_SETUPS:
    grads = [GAN[r][name][0] for r in range(WORLD)]
    if name == "one backward of the sum":
        assert grads == [reference, reference] and GAN[0][name][1] == "ok", (name, GAN[0][name])
    else:
        assert grads == [2.0 + 2.0, 2.0 + 4.0], (name, grads)
        assert "parameter 'weight'" in GAN[0][name][1], GAN[0][name][1]
pd.DataFrame({name: [GAN[0][name][0], GAN[1][name][0], "ok" if GAN[0][name][1] == "ok" else "raises"]
              for name in GAN_SETUPS}, index=["gradient, rank 0", "gradient, rank 1", "assert_in_sync"]).T

# %% [markdown]
# **Fix.** Sum the two losses and call `backward()` once. Or give each forward its own backward
# before the next forward: `d_real` forward and backward, then `d_fake`. A GAN's generator and
# discriminator are best two DDP wrappers, each with its own optimizer.
#
# **Caught by** `assert_in_sync(ddp)` after the step, and by the one-process reference.

# %% [markdown]
# <a id="case-epoch-ends-inside-accumulation"></a>
# ## Case: the replicas split at the end of every epoch
#
# **Symptom.** "With gradient accumulation my ranks agree during the epoch and disagree after
# it."
#
# **Why.** The epoch's length is not a multiple of the accumulation steps. The leftover
# micro-batches ran under `no_sync()`, and the loop steps them anyway. accelerate syncs the
# dataloader's last batch for this reason:
# [huggingface/accelerate#2134](https://github.com/huggingface/accelerate/pull/2134). The case
# extends section 1 of [06a](06a_training_loop_pitfalls.ipynb), accumulation with `no_sync()`.
#
# The program runs `epoch_micro_batches` micro-batches and steps every `accum_steps`. `leftover`
# says what happens to the rest. `"step"` is the bug, `"sync"` lets the last micro-batch sync,
# and `"drop"` throws the rest away.

# %%
def accumulate(rank, world_size, micro_batches, accum, leftover):
    ddp = DDP(one())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for i in range(micro_batches):
        sync = (i + 1) % accum == 0 or (leftover == "sync" and i == micro_batches - 1)
        with contextlib.nullcontext() if sync else ddp.no_sync():
            ddp(x_of(rank)).sum().backward()
        if sync:
            opt.step()
            opt.zero_grad()
    if leftover == "step":  # the bug: the leftover gradients were never all-reduced
        opt.step()
    opt.zero_grad()  # "drop": the leftover is thrown away
    return ddp.module.weight.item(), checked(ddp)


ACC = launch(lambda rank, world_size: {how: accumulate(rank, world_size, epoch_micro_batches, accum_steps, how)
                                       for how in ("step", "sync", "drop")}, WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** each full window moves the weight by `accum_steps × 2 × LR` on both ranks. Here 2 is
# one micro-batch's averaged gradient. Let `k = epoch_micro_batches mod accum_steps`. The table
# gives each rank's further move for each leftover policy. Only stepping the leftover splits the
# replicas, and the checker names `weight`.
#
# | leftover | rank 0 moves by | rank 1 moves by | replica checker |
# | --- | --- | --- | --- |
# | `"step"` | `k × 1 × LR` | `k × 3 × LR` | names `weight` |
# | `"sync"` | `k × 2 × LR` | `k × 2 × LR` | passes |
# | `"drop"` | 0 | 0 | passes |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each leftover policy's weights against the worked-out values
windows, k = divmod(epoch_micro_batches, accum_steps)
after_windows = 1 - windows * accum_steps * 2 * LR
step = [ACC[r]["step"][0] for r in range(WORLD)]
assert step == [after_windows - k * 1 * LR, after_windows - k * 3 * LR], step
assert "parameter 'weight'" in ACC[0]["step"][1], ACC[0]["step"][1]
assert [ACC[r]["sync"][0] for r in range(WORLD)] == [after_windows - k * 2 * LR] * WORLD
assert [ACC[r]["drop"][0] for r in range(WORLD)] == [after_windows] * WORLD
assert all(ACC[r][how][1] == "ok" for r in range(WORLD) for how in ("sync", "drop"))
pd.DataFrame({how: [ACC[0][how][0], ACC[1][how][0], "ok" if ACC[0][how][1] == "ok" else "raises"]
              for how in ACC[0]}, index=["weight, rank 0", "weight, rank 1", "assert_in_sync"]).T

# %% [markdown]
# **Fix.** Let the last micro-batch of the epoch sync:
# `sync = (i + 1) % accum == 0 or i == last`. Or drop the leftover with `zero_grad()`. Never
# call `step()` on gradients that ran only under `no_sync()`.
#
# **Caught by** `assert_in_sync(ddp)` after the epoch's last step.

# %% [markdown]
# <a id="case-rank0-validate-leaves-eval"></a>
# ## Case: validation on rank 0 broke training
#
# **Symptom.** "After the first validation my loss curve changed; the ranks still agree." The
# loop validates on rank 0 only. `validate()` calls `model.eval()` and never restores the mode,
# so rank 0 trains in `eval()` from then on. Rank-0-only evaluation is a common pattern: "only
# test on rank 0", from [zifuwan/Sigma#41](https://github.com/zifuwan/Sigma/issues/41). The case
# extends section 4 of [06e](06e_more_silent_bugs.ipynb), its rank-0-only block, and section 3
# of [06b](06b_state_across_ranks.ipynb), its `evaluate()`.
#
# **Why.** A model in `eval()` uses BatchNorm's running statistics instead of the batch's. The
# all-reduce averages rank 0's eval-mode gradient with rank 1's train-mode gradient. Both ranks
# hold the same numbers, from a mix of two models. Every forward in this loop runs with gradients,
# outside `no_sync()`. So DDP broadcasts rank 0's buffers before the next forward, and rank 0's
# frozen running mean overwrites rank 1's. DDP's `forward` in `torch/nn/parallel/distributed.py`
# makes that choice.
#
# The program: `BatchNorm1d(1, affine=False)` then `Linear(1, 1)`. Rank 0's batch is `[1, 3]`,
# rank 1's `[2, 6]`. In train mode the normalised batch sums to 0, so the `Linear` weight's
# gradient is 0.

# %%
def validate_case(rank, world_size, steps_after, restore):
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(1, affine=False), nn.Linear(1, 1, bias=False))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    x = torch.tensor([[1.0], [3.0]]) * (rank + 1)
    out = []
    for step in range(1 + steps_after):
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        modes = [None] * world_size
        dist.all_gather_object(modes, ddp.training)  # the check: every rank in the same mode?
        try:
            assert_in_sync(ddp)  # the replica checker, every step
            checker = None
        except ReplicasDiverged as e:
            checker = str(e)
        out.append({"modes": modes, "grad": model[1].weight.grad.item(),
                    "running_mean": model[0].running_mean.item(), "checker": checker})
        if step == 0 and rank == 0:  # validate() on rank 0 only
            was_training = ddp.training
            ddp.eval()
            with torch.no_grad():
                ddp.module(x)
            if restore:
                ddp.train(was_training)  # the fix
    return out


VAL = {restore: launch(validate_case, WORLD, steps_after_validate, restore, backend="gloo", timeout=120)
       for restore in (False, True)}

# %% [markdown]
# **Claim:** the table gives the gathered modes, the gradient and rank 0's running mean, step by
# step. Without the restore, both ranks hold the same gradient after `validate()`, and it is not
# 0. Rank 0's running mean stays at its value before validation. The one-process reference, the
# model in train mode on rank 0's batch, gives 0.
#
# | | step 1 | later steps, mode not restored | later steps, mode restored |
# | --- | --- | --- | --- |
# | modes gathered | `[True, True]` | `[False, True]` | `[True, True]` |
# | gradient, both ranks | 0 | equal, not 0 | 0 |
# | rank 0's running mean | its value before validation | frozen at that value | keeps moving |
# | `assert_in_sync(ddp)` | passes | raises, naming `eval()` on rank 0 | passes |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: modes, gradients and running means, with and without the restore
reference_model = nn.Sequential(nn.BatchNorm1d(1, affine=False), nn.Linear(1, 1, bias=False))
reference_model(torch.tensor([[1.0], [3.0]])).sum().backward()  # one process, train mode
reference = reference_model[1].weight.grad.item()
assert abs(reference) < 1e-6, reference
wrong, right = VAL[False], VAL[True]
for r in range(WORLD):
    assert wrong[r][0]["modes"] == [True, True] and abs(wrong[r][0]["grad"]) < 1e-6, wrong[r][0]
    for later in wrong[r][1:]:
        assert later["modes"] == [False, True], later
        assert abs(later["grad"]) > 0.5 and later["grad"] == wrong[1 - r][wrong[r].index(later)]["grad"], later
    assert all(s["modes"] == [True, True] and abs(s["grad"] - reference) < 1e-6 for s in right[r]), right[r]
    assert wrong[r][0]["checker"] is None and all(s["checker"] is None for s in right[r]), "healthy steps pass"
    assert all("eval() on rank 0" in s["checker"] for s in wrong[r][1:]), wrong[r][1]["checker"]
frozen = [s["running_mean"] for s in wrong[0]]
assert len(set(frozen)) == 1, frozen
assert len({s["running_mean"] for s in right[0]}) == len(right[0]), right[0]
print("assert_in_sync at step 2, mode not restored:", wrong[0][1]["checker"].splitlines()[0])
pd.DataFrame({"modes, no restore": [s["modes"] for s in wrong[0]], "gradient, no restore": [s["grad"] for s in wrong[0]],
              "running mean rank 0, no restore": frozen, "gradient, restored": [s["grad"] for s in right[0]]},
             index=pd.Index(range(1, 2 + steps_after_validate), name="step"))

# %% [markdown]
# **Fix.** Restore the mode in `validate()`: `was = model.training; model.eval(); ...;
# model.train(was)`. Or call `ddp.train()` at the top of every training step. Better still,
# validate on every rank with a sharded loader, as [06e](06e_more_silent_bugs.ipynb) shows.
#
# **Caught by** the replica checker: `assert_in_sync(ddp)` compares every module's mode across
# ranks and names the rank in `eval()`, from the first step after `validate()`. A value that must
# be equal on every rank, the gathered `model.training` flags, shows it too. The one-process
# reference catches the gradient. The parameters and gradients stay identical, so a check of
# those alone does not see it.

# %% [markdown]
# <a id="case-token-weighted-loss"></a>
# ## Case: my token-averaged loss differs from one GPU's
#
# **Symptom.** "Sequences have different lengths. On one GPU the loss is the mean over all
# tokens; with DDP and accumulation it comes out different." Trainers fixed this in 2024-2026:
# [meta-pytorch/torchtune#1875](https://github.com/meta-pytorch/torchtune/pull/1875),
# [pytorch/torchtitan#2206](https://github.com/pytorch/torchtitan/pull/2206). The case extends
# [06a](06a_training_loop_pitfalls.ipynb) on accumulation, and section 3 of
# [06d](06d_silent_bugs.ipynb) on what DDP averages.
#
# **Why.** DDP divides each rank's gradient by the world size, then sums. A per-micro-batch mean weights each
# micro-batch the same, whatever its token count. A per-rank token mean does the same for each
# rank. The mean over all tokens needs the token count of the whole window, over every rank.
#
# **Claim:** DDP divides first, as [01](01_gradients_dp_vs_ddp.ipynb) shows. Each rank's
# gradient below is float32's largest value. DDP gives that value back. Summing first overflows
# to `inf`.

# %%
def largest_gradient(rank, world_size):
    ddp = DDP(one())
    ddp(torch.full((1, 1), torch.finfo(torch.float32).max)).sum().backward()  # gradient: x
    return ddp.module.weight.grad.item()


ORDER = launch(largest_gradient, WORLD, backend="gloo", timeout=120)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: DDP's gradient is float32's largest value; summing first overflows
f32_max = torch.finfo(torch.float32).max
assert ORDER == [f32_max] * WORLD, ORDER
assert torch.tensor([f32_max] * WORLD).sum().isinf(), "sum, then divide overflows"

# %% [markdown]
# The program: each token's loss is `w x`. Rank 0's micro-batches hold tokens `[1]` and
# `[2, 3, 4]`, rank 1's `[5, 6]` and `[7]`.

# %%
TOKENS = {0: [[1.0], [2.0, 3.0, 4.0]], 1: [[5.0, 6.0], [7.0]]}


def token_loss(rank, world_size, weighting):
    micro_batches = TOKENS[rank]
    ddp = DDP(one())
    tokens = torch.tensor([float(sum(len(mb) for mb in micro_batches))])
    if weighting == "global token mean":
        dist.all_reduce(tokens)  # the fix: tokens of the whole window, on every rank
    for i, mb in enumerate(micro_batches):
        per_token = ddp(torch.tensor(mb).unsqueeze(1))  # each token's loss: w x
        if weighting == "mean per micro-batch":
            loss = per_token.mean() / len(micro_batches)
        else:  # divide by the token count; DDP's average divides by world_size again
            loss = per_token.sum() / tokens * (world_size if weighting == "global token mean" else 1)
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
            loss.backward()
    return ddp.module.weight.grad.item()


WEIGHTINGS = ("mean per micro-batch", "per-rank token mean", "global token mean")
TOK = launch(lambda rank, world_size: {how: token_loss(rank, world_size, how) for how in WEIGHTINGS},
             WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** the one-process reference, the mean of `w x` over all 7 tokens, has gradient
# `28 / 7 = 4`. The table gives each weighting's gradient. Each is the same on both ranks, so
# only the reference catches the two wrong ones.
#
# | weighting | gradient, both ranks |
# | --- | --- |
# | mean per micro-batch | `((1 + 3) / 2 + (5.5 + 7) / 2) / 2 = 4.125` |
# | mean of per-rank token means | `(10/4 + 18/3) / 2 = 4.25` |
# | all-reduced token count | 4 |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each weighting's gradient against the mean over all tokens
w = torch.ones(1, requires_grad=True)
all_tokens = torch.tensor([t for r in range(WORLD) for mb in TOKENS[r] for t in mb])
(w * all_tokens).mean().backward()  # one process: the mean over every token
reference = w.grad.item()
assert abs(reference - 4.0) < 1e-6, reference
for r in range(WORLD):
    assert abs(TOK[r]["mean per micro-batch"] - 4.125) < 1e-6, TOK[r]
    assert abs(TOK[r]["per-rank token mean"] - 4.25) < 1e-6, TOK[r]
    assert abs(TOK[r]["global token mean"] - reference) < 1e-6, TOK[r]
pd.Series(TOK[0], name="gradient (both ranks)").to_frame().assign(reference=reference)

# %% [markdown]
# **Fix.** Before the window's first backward, all-reduce the token count of the window. Make
# each micro-batch's loss `sum of token losses / global tokens × world_size`. The
# `× world_size` undoes DDP's division by the world size. Log the same quantity: sum the loss
# and the token count, all-reduce both, divide once.
#
# **Caught by** the one-process reference: the gradient of the mean over all tokens.

# %% [markdown]
# <a id="case-bucket-view-kept-grad"></a>
# ## Case: the gradients I logged are all the same
#
# **Symptom.** "I keep each step's `.grad` for a plot. With `gradient_as_bucket_view=True` the
# kept values change after the fact." The views came with
# [pytorch/pytorch#41954](https://github.com/pytorch/pytorch/pull/41954), "Make grad point to
# bucket buffer in DDP to save memory usage". The case extends
# [07b](07b_hooks_and_after_ddp.ipynb) on DDP's buckets and hooks.
#
# **Why.** With `gradient_as_bucket_view=True`, each `.grad` is a view into DDP's bucket, the
# memory that the all-reduce fills. A tensor kept from an earlier step is the same memory, and
# the next backward overwrites it.
#
# The program runs three steps with inputs `k x`, for `k` = 1, 2 and 3. The averaged gradients
# are 2, 4 and 6. The loop keeps `weight.grad` of every step.

# %%
def kept_grads(rank, world_size, bucket_view, clone):
    ddp = DDP(one(), gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    kept = []
    for k in (1, 2, 3):
        opt.zero_grad()
        ddp(k * x_of(rank)).sum().backward()
        grad = ddp.module.weight.grad
        kept.append(grad.detach().clone() if clone else grad)  # the fix: a copy
        opt.step()
    return [g.item() for g in kept]


BUCKET = launch(lambda rank, world_size: {(view, clone): kept_grads(rank, world_size, view, clone)
                                          for view in (False, True) for clone in (False, True)},
                WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** without bucket views the kept gradients are `[2, 4, 6]`. With
# `gradient_as_bucket_view=True` they are `[2, 6, 6]`: step 2's tensor is step 3's bucket memory.
# A copy, `grad.detach().clone()`, keeps `[2, 4, 6]` in both settings.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: kept gradients with and without bucket views and copies
reference = [2.0 * k for k in (1, 2, 3)]  # one process: (1 + 3) / 2 × k
for r in range(WORLD):
    assert BUCKET[r][False, False] == reference, BUCKET[r]
    assert BUCKET[r][True, False] == [2.0, 6.0, 6.0], BUCKET[r]
    assert BUCKET[r][True, True] == BUCKET[r][False, True] == reference, BUCKET[r]
pd.DataFrame({f"bucket view={view}, copy={clone}": v for (view, clone), v in BUCKET[0].items()},
             index=["step 1", "step 2", "step 3"]).T

# %% [markdown]
# **Fix.** Keep a copy, never the `.grad` tensor itself: `.detach().clone()`, or `.item()` for a
# number. The same holds for any tensor that may be a view into memory torch reuses.
#
# **Caught by** the one-process reference, the gradient each step should have. The replicas agree
# throughout.

# %% [markdown]
# ## The general check of the loss: `against_one_process`
#
# The token case needed a reference worked by hand. `against_one_process(fn, world_size)` is the
# general check: it runs your unchanged worker at `world_size` simulated ranks and in one process.
# It compares every parameter after every optimizer step. Lesson [06d](06d_silent_bugs.ipynb)
# section 7 introduces it. Its convention: one global batch, here one window of sequences, each
# rank taking its share.

# %%
from helpers.checks import against_one_process, verdict
from helpers.notebook import record_checks

SEQUENCES = [[1.0], [5.0, 6.0], [2.0, 3.0, 4.0], [7.0]]  # one window; rank r takes r::world_size


def token_window(rank, world_size, weighting):
    """The token case as one window of sequences, one micro-batch each, then one SGD step."""
    mine = SEQUENCES[rank::world_size]
    ddp = DDP(one())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    tokens = torch.tensor([float(sum(len(seq) for seq in mine))])
    if weighting == "global token mean":
        dist.all_reduce(tokens)
    for i, seq in enumerate(mine):
        per_token = ddp(torch.tensor(seq).unsqueeze(1))
        if weighting == "mean per micro-batch":
            loss = per_token.mean() / len(mine)
        else:
            loss = per_token.sum() / tokens * (world_size if weighting == "global token mean" else 1)
        with contextlib.nullcontext() if i == len(mine) - 1 else ddp.no_sync():
            loss.backward()
    opt.step()


versus_one = {how: verdict(against_one_process, token_window, WORLD, how) for how in WEIGHTINGS}
versus_one["kept .grad, bucket view"] = verdict(against_one_process, kept_grads, WORLD, True, False)
pd.Series({k: v.splitlines()[0] for k, v in versus_one.items()}, name="against_one_process").to_frame()

# %% [markdown]
# **Claim:** `against_one_process` raises on the per-rank token mean and passes the all-reduced
# token count. It passes the mean per micro-batch too: one process weights each sequence alike,
# the same mistake. Only the hand-worked reference above catches that one. It passes the kept
# bucket view: the parameters are right, only the kept tensor is wrong.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the general check on the three weightings
assert versus_one["per-rank token mean"].startswith("DivergedFromOneProcess"), versus_one
assert versus_one["global token mean"] == versus_one["mean per micro-batch"] == "passes", versus_one
assert versus_one["kept .grad, bucket view"] == "passes", versus_one
rows = {"token loss: per-rank token mean": {"against_one_process": "caught: step 1"},
        "token loss: mean per micro-batch": {"against_one_process": "not caught: the same mistake in one process"},
        "kept .grad under gradient_as_bucket_view": {
            "against_one_process": "not caught: the parameters are right, the kept tensor is not"}}
print(versus_one["per-rank token mean"])

# %%
print(f"casebook 10a ran in {time.perf_counter() - t_notebook:.0f} s")

# %% [markdown]
# ## What we saw
#
# | symptom | mistake | fix | caught by |
# | --- | --- | --- | --- |
# | [GAN replicas drift](#case-two-forwards-two-backwards) | two forwards, then two backwards, one wrapper | one backward of the sum | `assert_in_sync`; one-process gradient |
# | [split at the epoch's end](#case-epoch-ends-inside-accumulation) | stepping an unsynced leftover | sync or drop the leftover | `assert_in_sync` |
# | [rank-0 validation broke training](#case-rank0-validate-leaves-eval) | `eval()` never undone on rank 0 | restore the mode | the modes gathered; one-process gradient |
# | [token mean differs](#case-token-weighted-loss) | mean of means | all-reduce the token count | one-process gradient |
# | [logged gradients all the same](#case-bucket-view-kept-grad) | a kept `.grad` bucket view | keep a copy | one-process values |
#
# **Claim:** `assert_in_sync` in the loop catches three of these five at the first wrong step.
# Two move the replicas apart, and one leaves rank 0 in `eval()`. The other two keep the ranks'
# gradients equal and wrong: only a check of the value itself finds them.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: which cases the replica checker caught, from the runs above
caught = {"GAN": GAN[0]["two backwards, default"][1] != "ok", "epoch's end": ACC[0]["step"][1] != "ok",
          "rank-0 validate": VAL[False][0][1]["checker"] is not None}
assert sum(caught.values()) == 3, caught
assert TOK[0] == TOK[1] and BUCKET[0] == BUCKET[1], "token mean and bucket view: equal on both ranks"
assert TOK[0]["mean per micro-batch"] != 4.0 and BUCKET[0][True, False] != [2.0, 4.0, 6.0]
record_checks("10a_casebook_training_loop", {  # for docs/CHECKS.md (python3 -m ci.checks_table)
    "GAN: two forwards, two backwards": {"assert_in_sync": "caught: step 1"},
    "epoch ends inside an accumulation window": {"assert_in_sync": "caught: the epoch's last step"},
    "rank-0 validate() left in eval()": {"assert_in_sync": "caught: first step after validate(), naming eval()"},
    **rows})

# %% [markdown]
# <!-- next:start -->
# **Next:** [10b casebook: the data](10b_casebook_data.ipynb): an IterableDataset under DDP, shuffle=True without DistributedSampler, epoch state on the Dataset with persistent workers, the same seed on every rank, Docker's /dev/shm.
# <!-- next:end -->
