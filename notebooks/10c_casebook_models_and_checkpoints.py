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
# # 10c · Casebook: models, checkpoints and FSDP2
#
# <!-- opening:start -->
# **You need** [06b state across ranks](06b_state_across_ranks.ipynb), [08a ZeRO-1 and FSDP2](08a_zero_and_fsdp2.ipynb).
# <!-- opening:end -->
#
# **What this page is.** A casebook page, not a lesson. Each section is one mistake that people
# report, found by its symptom. A case quotes the symptom and names the thread it comes from.
# Then come the shortest program that shows it, the wrong and the right value, the fix, and the
# check that catches it. The page computes and asserts both values.
#
# Cases on this page:
#
# * [my EMA model differs from rank to rank](#case-ema-before-ddp)
# * [my saved DDP model will not load](#case-torch-save-whole-ddp)
# * [saving the ZeRO optimizer fails on rank 0](#case-zero-checkpoint)
# * [my FSDP2 model does not train](#case-fsdp2-optimizer-order)
# * [FSDP2 with context parallel learns too slowly](#case-fsdp2-divide-factor)
#
# Every program runs on 2 real ranks with `launch` and backend `gloo`, on the CPU. Each claim is
# in bold, "Claim:", and the code cell right after it asserts it.
#
# Terms, from the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [replica](../docs/GLOSSARY.md#replica),
# [DDP](../docs/GLOSSARY.md#ddp), [process group](../docs/GLOSSARY.md#process-group).

# %% tags=["parameters"]
# Parameters: what you run by default, top to bottom in JupyterLab (the smoke profile); the full profile overrides some (docs/RUNNER.md)
fsdp_steps = 2  # optimizer steps in the FSDP2 optimizer case
zero_steps = 1  # optimizer steps before the ZeRO checkpoint

# %%
from helpers.notebook import check_parameters, check_value

check_parameters(fsdp_steps=(fsdp_steps, int), zero_steps=(zero_steps, int))
check_value("fsdp_steps", fsdp_steps, 1 <= fsdp_steps <= 20, "1 to 20")
check_value("zero_steps", zero_steps, 1 <= zero_steps <= 20, "1 to 20")

# %%
import copy
import pickle
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.engine import launch
from helpers.notebook import record_checks
from helpers.tiny import checked, one

t_notebook = time.perf_counter()
WORLD = 2
LR = 0.125
work = Path(tempfile.mkdtemp(prefix="casebook_10c_"))  # where the checkpoint cases write
print(f"torch {torch.__version__}")

# %% [markdown]
# <a id="case-ema-before-ddp"></a>
# ## Case: my EMA model differs from rank to rank
#
# **Symptom.** "The EMA or teacher copy of my model evaluates differently on each rank." From
# [m2lines/Samudra#326](https://github.com/m2lines/Samudra/pull/326), "Fix initial ema creation in
# distributed mode", and [lucidrains/ema-pytorch#9](https://github.com/lucidrains/ema-pytorch/issues/9).
# The case extends [06c](06c_seeds_and_debugging.ipynb), where an unseeded model differs from
# rank to rank.
#
# **Why.** `DDP(model)` copies rank 0's weights to every rank. A copy made before the wrap keeps
# this rank's own initial weights. Each rank's EMA then averages toward the same model from a
# different start.

# %%
def ema_case(rank, world_size, after_wrap):
    model = nn.Linear(2, 1)  # unseeded: each rank starts from its own weights, as under torchrun
    ema = None if after_wrap else copy.deepcopy(model)  # the mistake: a copy before DDP(...)
    ddp = DDP(model)  # copies rank 0's weights to every rank
    if after_wrap:
        ema = copy.deepcopy(ddp.module)  # the fix: copy the wrapped model
    return {"ema": checked(ema), "model": checked(ddp)}


EMA = {after: launch(ema_case, WORLD, after, backend="gloo", timeout=120)[0] for after in (False, True)}

# %% [markdown]
# **Claim:** with the copy made before `DDP(...)`, the replica checker passes on the DDP model
# and raises on the EMA copy, naming `weight` and `bias`. Made from `ddp.module` after the wrap,
# the EMA copy passes.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the replica checker on the DDP model and on each EMA copy
assert EMA[False]["model"] == "ok" and "parameter 'weight'" in EMA[False]["ema"] and "parameter 'bias'" in EMA[False]["ema"]
assert EMA[True] == {"ema": "ok", "model": "ok"}, EMA[True]
record_checks("10c_casebook_models_and_checkpoints",  # for docs/CHECKS.md (python3 -m ci.checks_table)
              {"my EMA model differs from rank to rank": {"assert_in_sync": "caught: before step 1, on the copy"}})
print(EMA[False]["ema"].splitlines()[0])

# %% [markdown]
# **Fix.** Make the EMA or teacher copy after `DDP(...)`, from `ddp.module`. Or seed every rank
# alike before building the model.
#
# **Caught by** `assert_in_sync(ema)`: the checker takes any module, not only a DDP one.

# %% [markdown]
# <a id="case-torch-save-whole-ddp"></a>
# ## Case: my saved DDP model will not load
#
# **Symptom.** "I saved the model with `torch.save(model)`; loading it fails." The file holds the
# whole DDP object: its class and the weights. Torch leaves the process group out when it saves
# DDP. The case extends
# section 2 of [06b](06b_state_across_ranks.ipynb), whose recipe saves `ddp.module.state_dict()`.
#
# **Why.** Since torch 2.6, `torch.load` defaults to `weights_only=True`: it reads only tensors
# and plain containers. A pickled `DistributedDataParallel` is refused. With `weights_only=False`
# the unpickler calls DDP's `__setstate__`, which asks for the default process group. A process
# without one, such as an evaluation script, fails.

# %%
def save_case(rank, world_size, folder):
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(2, 1))
    if rank == 0:
        torch.save(ddp, folder / "whole.pt")  # the mistake: the whole wrapper
        torch.save(ddp.module.state_dict(), folder / "weights.pt")  # 06b's recipe
    dist.barrier()
    return {k: v.tolist() for k, v in ddp.module.state_dict().items()}


def load_case(rank, world_size, folder):  # processes with a default process group
    ddp = torch.load(folder / "whole.pt", weights_only=False)
    return {k: v.tolist() for k, v in ddp.module.state_dict().items()}, ddp.process_group is dist.group.WORLD


trained = launch(save_case, WORLD, work, backend="gloo", timeout=120)[0]
loaded = launch(load_case, WORLD, work, backend="gloo", timeout=120)
with zipfile.ZipFile(work / "whole.pt") as z:  # torch.save writes a zip; the pickle is data.pkl
    pickled = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
errors = {}
for how, kwargs in (("torch.load", {}), ("weights_only=False", {"weights_only": False})):
    try:
        torch.load(work / "whole.pt", **kwargs)  # here: one process, no process group
    except (pickle.UnpicklingError, ValueError) as e:
        errors[how] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
bare = nn.Linear(2, 1)
_ = bare.load_state_dict(torch.load(work / "weights.pt"))  # 06b's recipe loads anywhere

# %% [markdown]
# **Claim:** this notebook's process has no process group. Here the default `torch.load` of the
# whole object raises `UnpicklingError`, "Weights only load failed". With `weights_only=False` it
# raises `ValueError`, "Default process group has not been initialized". The state dict of
# `ddp.module` loads into a bare `Linear` with the weights rank 0 saved.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: loading the whole object fails twice; the state dict loads
assert errors["torch.load"].startswith("UnpicklingError: Weights only load failed"), errors
assert errors["weights_only=False"].startswith("ValueError: Default process group has not been initialized"), errors
assert {k: v.tolist() for k, v in bare.state_dict().items()} == trained
pd.Series(errors, name="error").to_frame()

# %% [markdown]
# **Claim:** the whole-object file holds the weights and no process group. DDP's `__getstate__`
# drops it. Loaded with `weights_only=False` on 2 ranks that have a default group, it gives back
# rank 0's weights, and the group is the loader's own.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the pickle names no process group; loading gives the weights back
assert b"ProcessGroup" not in pickled and b"process_group" not in pickled
assert loaded == [(trained, True)] * WORLD, loaded

# %% [markdown]
# **Fix.** Follow 06b's recipe. Rank 0 saves `{"model": ddp.module.state_dict(), "optimizer":
# opt.state_dict(), "step": step}`. Any process loads it into a bare model with a plain
# `torch.load`.
#
# **Caught by** loading the checkpoint in a fresh process, the way an evaluation script will.

# %% [markdown]
# <a id="case-zero-checkpoint"></a>
# ## Case: saving the ZeRO optimizer fails on rank 0
#
# **Symptom.** "RuntimeError: Optimizer state has not been consolidated on this rank." From
# [zhijian-liu/torchpack#18](https://github.com/zhijian-liu/torchpack/issues/18), "Warning messages
# while trying to use ZeroRedundancyOptimizer". It extends [08a](08a_zero_and_fsdp2.ipynb),
# whose summary names the call: `consolidate_state_dict(to=0)` on every rank before saving.
#
# **Why.** `ZeroRedundancyOptimizer` keeps each parameter's state on one rank.
# `consolidate_state_dict(to=0)` gathers the shards on rank 0. It is a collective, so every rank
# calls it. Only then does rank 0's `state_dict()` hold the whole state. 06b's pattern,
# `if rank == 0: torch.save(opt.state_dict())`, calls it on rank 0 alone.

# %%
def zero_case(rank, world_size, steps):
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    for _ in range(steps):
        ddp(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    out = {"local states": len(opt.optim.state)}
    if rank == 0:
        try:
            opt.state_dict()  # the mistake: no consolidation first
        except RuntimeError as e:
            out["rank 0 alone"] = str(e)
    opt.consolidate_state_dict(to=0)  # the fix: every rank calls it
    if rank == 0:
        out["saved states"] = len(opt.state_dict()["state"])
    return out


ZERO = launch(zero_case, WORLD, zero_steps, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** rank 0's `state_dict()` without consolidation raises "Optimizer state has not been
# consolidated on this rank". Each rank holds the Adam state of 2 of the 4 parameters. After
# `consolidate_state_dict(to=0)` on every rank, rank 0's state dict holds all 4.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: rank 0 alone raises; consolidation gathers all 4 states
assert "has not been consolidated on this rank" in ZERO[0]["rank 0 alone"], ZERO[0]
assert [z["local states"] for z in ZERO] == [2, 2], ZERO
assert ZERO[0]["saved states"] == len(list(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).parameters())) == 4
print(ZERO[0]["rank 0 alone"])

# %% [markdown]
# **Fix.** On every rank, `opt.consolidate_state_dict(to=0)`; then
# `if rank == 0: torch.save(opt.state_dict(), path)`. Loading needs no consolidation. Every rank
# calls `opt.load_state_dict(...)` with the whole state and keeps its own shard.
#
# **Caught by** the error itself, on rank 0. A checkpoint's state should also be counted: one
# state per parameter.

# %% [markdown]
# <a id="case-fsdp2-optimizer-order"></a>
# ## Case: my FSDP2 model does not train
#
# **Symptom.** "With FSDP2 the loss does not move; the parameters never update." From
# [pytorch/pytorch#149205](https://github.com/pytorch/pytorch/issues/149205), "Parameter not
# updating when FSDP2 model is used before optimizer creation". The case extends section 0 of
# [08a](08a_zero_and_fsdp2.ipynb), where `fully_shard` comes before the optimizer.
#
# **Why.** `fully_shard` replaces each parameter with a sharded one, a `DTensor`. An optimizer
# built before it holds the old tensors, which the model no longer uses. After a forward, the
# root module's parameters are the unsharded ones until the next backward. An optimizer built
# then holds those: copies the next forward discards.

# %%
X_FS = torch.tensor([[1.0, 1.0], [2.0, 2.0]])  # one global batch of 2 items


def fsdp_case(rank, world_size, when, steps):
    torch.manual_seed(0)
    model = nn.Linear(2, 2, bias=False)
    if when == "before fully_shard":
        opt = torch.optim.SGD(model.parameters(), lr=0.5)  # the mistake
    fully_shard(model)
    if when == "after a forward":
        model(torch.ones(1, 2))  # e.g. a sanity check of the output shape
    if when != "before fully_shard":
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    w = model.weight  # a DTensor once sharded; the unsharded Parameter right after a forward
    start = (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()
    for _ in range(steps):
        model(X_FS[rank::world_size]).mean().backward()  # this rank's share of one global batch
        opt.step()
        opt.zero_grad()
    moved = (model.weight.full_tensor() - start).abs().max().item()
    return {"moved": moved, "optimizer holds": sorted({type(p).__name__ for g in opt.param_groups for p in g["params"]})}


WHEN = ("before fully_shard", "after a forward", "after fully_shard, before any forward")
FS = launch(lambda rank, world_size: {w: fsdp_case(rank, world_size, w, fsdp_steps) for w in WHEN},
            WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** an optimizer built before `fully_shard`, or after a forward, holds plain
# `Parameter`s and the weights do not move at all. Built after `fully_shard` and before any
# forward, it holds `DTensor`s and the weights move.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: what each optimizer holds, and whether the weights move
for r in range(WORLD):
    for w in WHEN[:2]:
        assert FS[r][w] == {"moved": 0.0, "optimizer holds": ["Parameter"]}, (w, FS[r][w])
    assert FS[r][WHEN[2]]["moved"] > 0 and FS[r][WHEN[2]]["optimizer holds"] == ["DTensor"], FS[r][WHEN[2]]
pd.DataFrame(FS[0]).T

# %% [markdown]
# **Fix.** The order: build the model, `fully_shard` each block and then the root, build the
# optimizer from `model.parameters()`, and only then run a forward.
#
# **Caught by** a value check: the optimizer's parameters are `DTensor`s, and the weights move
# after a step.

# %% [markdown]
# <a id="case-fsdp2-divide-factor"></a>
# ## Case: FSDP2 with context parallel learns too slowly
#
# **Symptom.** "I split each sequence across 2 ranks and shard the model over both; the loss
# falls half as fast." A question of 2025-2026 threads on long-context training. torchtitan
# switched the averaging off for this reason:
# [pytorch/torchtitan#2206](https://github.com/pytorch/torchtitan/pull/2206). The case extends
# section 3 of [08a](08a_zero_and_fsdp2.ipynb), the same loss curve as DDP.
#
# **Why.** FSDP2 reduce-scatters the gradients and divides by the size of its mesh, as DDP
# divides by the world size. That average is right when every rank holds different samples.
# Here both ranks hold halves of one sequence: their losses are parts of one loss, to be summed.
# Dividing by 2 halves the gradient, which is a silent halving of the learning rate.
#
# The program: one sequence of 4 tokens, each token's loss `w x`. Rank 0 holds `[1, 3]`, rank 1
# `[5, 7]`. Each rank's loss is its tokens' sum over the sequence's 4 tokens.

# %%
def context_parallel_case(rank, world_size, scale, mesh_shape=None):
    tokens = torch.tensor([[1.0], [3.0], [5.0], [7.0]])[2 * rank: 2 * rank + 2]  # this rank's half
    model = one()
    mesh = mesh_shape and init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "cp"))
    fully_shard(model, mesh=mesh)  # the mesh: both ranks, 1-D by default
    loss = model(tokens).sum() / 4  # this rank's part of the sequence's mean loss
    (loss * scale).backward()  # scale = mesh size / data-parallel size undoes the average
    return model.weight.grad.full_tensor().item()


def divide_factor_raises(rank, world_size):
    model = one()
    fully_shard(model)
    model.set_gradient_divide_factor(1.0)  # "sum, do not average": needs PREMUL_SUM
    try:
        model(torch.ones(1, 1)).sum().backward()
    except RuntimeError as e:
        return str(e)


CP = launch(lambda rank, world_size: {"default": context_parallel_case(rank, world_size, 1),
                                      "loss × 2": context_parallel_case(rank, world_size, 2),
                                      "1 × 2 mesh (dp, cp)": context_parallel_case(rank, world_size, 1, (1, 2)),
                                      "set_gradient_divide_factor(1.0)": divide_factor_raises(rank, world_size)},
            WORLD, backend="gloo", timeout=120)

# %% [markdown]
# **Claim:** the one-process reference, the mean of `w x` over the 4 tokens, has gradient
# `16 / 4 = 4`. FSDP2 gives 2 on both ranks, on a 1-D mesh and on a 2-D mesh of 1
# data-parallel × 2 context-parallel ranks. Scaling each rank's loss by 2, the mesh size over the
# data-parallel size, gives 4. `set_gradient_divide_factor(1.0)` raises on gloo: "Cannot use
# ReduceOp.PREMUL_SUM with Gloo".

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: FSDP2's gradient, scaled and not, against one process
w = torch.ones(1, requires_grad=True)
(w * torch.tensor([1.0, 3.0, 5.0, 7.0])).mean().backward()  # one process, the whole sequence
reference = w.grad.item()
assert reference == 4.0
for r in range(WORLD):
    assert CP[r]["default"] == CP[r]["1 × 2 mesh (dp, cp)"] == reference / 2 and CP[r]["loss × 2"] == reference, CP[r]
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in CP[r]["set_gradient_divide_factor(1.0)"], CP[r]
pd.Series({k: v for k, v in CP[0].items() if k != "set_gradient_divide_factor(1.0)"}, name="gradient").to_frame().assign(reference=reference)

# %% [markdown]
# **Fix.** Decide who divides by what. The loss divides by the tokens of the whole global batch,
# and the gradient reduction only sums. With NCCL, `model.set_gradient_divide_factor(1.0)` makes
# FSDP2 sum. With gloo, scale the loss by the mesh size over the number of data-parallel
# replicas. A 2-D mesh does not do it for you: FSDP2 divides by all the ranks of its mesh.
#
# **Caught by** the one-process reference: the gradient of the whole sequence's loss.

# %% [markdown]
# ## The general checks on these cases
#
# The EMA case ran `assert_in_sync` above. Loading the whole DDP object and saving ZeRO's
# optimizer raise errors, and no general check reads a checkpoint. The two FSDP2 cases train
# wrong silently: `against_one_process` runs both. `cp_step` is the context-parallel case with
# an SGD step; its fix scales the loss by `world_size`.

# %%
from helpers.checks import against_one_process, verdict


def cp_step(rank, world_size, fix=False):
    """The context-parallel case: this rank's part of one sequence, then one SGD step."""
    model = one()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.125)
    tokens = torch.tensor([[1.0], [3.0], [5.0], [7.0]]).chunk(world_size)[rank]
    (model(tokens).sum() / 4 * (world_size if fix else 1)).backward()
    opt.step()


general = {"optimizer before fully_shard": verdict(against_one_process, fsdp_case, WORLD, WHEN[0], fsdp_steps),
           "context parallel, averaged": verdict(against_one_process, cp_step, WORLD),
           "fix: loss × world_size": verdict(against_one_process, cp_step, WORLD, fix=True)}
pd.Series({k: v.splitlines()[0] for k, v in general.items()}, name="against_one_process").to_frame()

# %% [markdown]
# **Claim:** `against_one_process` passes the optimizer built before `fully_shard`: one process
# makes the same mistake, and no weight moves in either. It raises on the averaged context
# parallel step at step 1, and passes the scaled loss.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: against_one_process on the two FSDP2 cases
assert general["optimizer before fully_shard"] == general["fix: loss × world_size"] == "passes", general
averaged = general["context parallel, averaged"]
assert averaged.startswith("DivergedFromOneProcess") and "step 1" in averaged, averaged
record_checks("10c_casebook_models_and_checkpoints", {  # for docs/CHECKS.md (python3 -m ci.checks_table)
    "my EMA model differs from rank to rank": {"assert_in_sync": "caught: before step 1, on the copy"},
    "my saved DDP model will not load": {"against_one_process": "none applies: an error at load"},
    "saving the ZeRO optimizer fails on rank 0": {"against_one_process": "none applies: an error on rank 0"},
    "FSDP2 optimizer built before fully_shard": {"against_one_process": "not caught: the same mistake in one process"},
    "FSDP2 with context parallel learns too slowly": {"against_one_process": "caught: step 1"}})
print(averaged)

# %%
shutil.rmtree(work, ignore_errors=True)
print(f"casebook 10c ran in {time.perf_counter() - t_notebook:.0f} s")

# %% [markdown]
# ## What we saw
#
# | symptom | mistake | fix | caught by |
# | --- | --- | --- | --- |
# | [EMA differs by rank](#case-ema-before-ddp) | copy made before `DDP(...)` | copy `ddp.module` after | `assert_in_sync(ema)` |
# | [saved model will not load](#case-torch-save-whole-ddp) | `torch.save(ddp)` | save `ddp.module.state_dict()` | a load in a fresh process |
# | [ZeRO save fails](#case-zero-checkpoint) | `state_dict()` on rank 0 alone | `consolidate_state_dict(to=0)` on every rank | the error; states counted |
# | [FSDP2 does not train](#case-fsdp2-optimizer-order) | optimizer before `fully_shard` or after a forward | optimizer after `fully_shard`, before a forward | `DTensor`s in the optimizer |
# | [context parallel learns slowly](#case-fsdp2-divide-factor) | FSDP2 averages over ranks that share a sample | sum, or scale the loss | one-process gradient |
#
# Most of these raise nothing in the training loop itself. Check a checkpoint where it will be
# used, and check that a step moves the weights you think it moves.

# %% [markdown]
# <!-- next:start -->
# **Next:** [10d casebook: launch and platform](10d_casebook_launch_and_platform.ipynb): --local-rank against --local_rank and LOCAL_RANK, the destroy_process_group() exit warning, gloo and MPS tensors, the *_single collective names, Windows' use_libuv error.
# <!-- next:end -->
