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
# # 08a · After DDP: ZeRO-1 and FSDP2, run for real
#
# <!-- opening:start -->
# **You will be able to** shard optimizer state (ZeRO-1) and the model (FSDP2); save a plain checkpoint. **You need** [00b DDP cell by cell](00b_ddp_cell_by_cell.ipynb), [07b hooks and after DDP](07b_hooks_and_after_ddp.ipynb).
# <!-- opening:end -->
#
# **The question:** when I shard the model across ranks, what does each rank hold? And what
# changes in my training loop?
#
# Everything runs on real ranks, with `launch`, backend `gloo`, on CPU. FSDP2 needs a device
# mesh, here `init_device_mesh("cpu", (world_size,))`. The model is a small MLP,
# `8 → hidden → hidden → 10 → 3`, trained with Adam on random regression data. Each bold claim
# is asserted in the code cell right after it, tagged `check`.
#
# 1. the shards each rank holds · 2. memory per rank · 3. the same loss curve as DDP ·
# 4. clipping sharded gradients · 5. a checkpoint for a plain model
#
# Terms, all in the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [all-reduce](../docs/GLOSSARY.md#all-reduce), [DDP](../docs/GLOSSARY.md#ddp).

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
hidden = 16  # width of the MLP's two hidden layers
steps = 4  # training steps of section 3's loss curves
batch_size = 4  # samples per rank per step

# %%
from helpers.notebook import check_answer, check_parameters, check_value

world_sizes = [2, 4]  # section 2's table; the largest runs sections 1 and 4, the smallest 3 and 5

check_parameters(hidden=(hidden, int), steps=(steps, int), batch_size=(batch_size, int))
check_value("hidden", hidden, 4 <= hidden <= 1024, "4 to 1024")
check_value("steps", steps, 1 <= steps <= 200, "1 to 200")
check_value("batch_size", batch_size, 1 <= batch_size <= 256, "1 to 256")

# %%
import time
import warnings

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.engine import OversubscriptionWarning, launch

warnings.simplefilter("ignore", OversubscriptionWarning)  # more ranks than cores: bytes and values do not change
t_notebook = time.perf_counter()
LR = 0.01  # Adam's learning rate
KINDS = ["DDP", "ZeRO-1", "FSDP2"]
print(f"torch {torch.__version__}")

# %% [markdown]
# ## 0. The model and the three ways to wrap it
#
# `build(kind, ...)` returns the model and its optimizer, as you would write them in your own
# script. There are three kinds:
#
# * **DDP** with Adam.
# * **ZeRO-1**: DDP with `ZeroRedundancyOptimizer`. It keeps Adam's state only for the
#   parameters assigned to this rank. After `step()` it broadcasts each updated parameter from
#   its owner.
# * **FSDP2**: `fully_shard` is applied to each `Linear`, then to the whole model. A plain Adam
#   updates the local shards.
#
# `local(t)` is the part of a tensor this rank stores, `DTensor.to_local()`. `nbytes(t)` is its
# bytes.

# %%
def mlp(hidden, seed=0):
    """8 -> hidden -> hidden -> 10 -> 3, the same weights on every rank for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10), nn.ReLU(), nn.Linear(10, 3))


def shard(model, mesh):
    """FSDP2: one shard group per Linear, then the root."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build(kind, hidden, mesh):
    """(model, optimizer) for kind in KINDS."""
    if kind == "FSDP2":
        model = shard(mlp(hidden), mesh)
        return model, torch.optim.Adam(model.parameters(), lr=LR)
    model = DDP(mlp(hidden))
    if kind == "ZeRO-1":
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def adam_state(opt):
    """This rank's Adam state: {parameter: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}}."""
    return (opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt).state


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t):
    t = local(t)
    return t.numel() * t.element_size()


def batch(rank, step, batch_size):
    """Each rank's own (x, y) for a step: the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 3, generator=g)

# %% [markdown]
# ## 1. The shards each rank holds
#
# `ZeroRedundancyOptimizer` partitions whole parameters. Each one's Adam state lives on exactly
# one rank. The ranks are chosen greedily, so they hold about the same number of elements.
#
# `fully_shard` splits every parameter along dimension 0, the way `torch.chunk` does. The chunks
# have `ceil(rows / world_size)` rows, so the last ranks may hold fewer rows, or none. Each
# parameter becomes a `DTensor` with placement `Shard(0)`. Its `.shape` is still the full shape;
# its `to_local()` is the rank's rows.

# %%
def shards_worker(rank, world_size, hidden, batch_size):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    model, opt = build("ZeRO-1", hidden, mesh)
    x, y = batch(rank, 0, batch_size)
    F.mse_loss(model(x), y).backward()
    opt.step()
    state = adam_state(opt)
    out["zero_owned"] = [name for name, p in model.module.named_parameters() if p in state]
    model = shard(mlp(hidden), mesh)
    out["fsdp"] = {name: {"type": type(p).__name__, "placements": p.placements, "shape": tuple(p.shape),
                          "local": tuple(local(p).shape)} for name, p in model.named_parameters()}
    return out


N = max(world_sizes)
S = launch(shards_worker, N, hidden, batch_size, backend="gloo", timeout=180)
names = list(S[0]["fsdp"])
pd.DataFrame({name: {"full shape": S[0]["fsdp"][name]["shape"],
                     **{f"rank {r} rows": S[r]["fsdp"][name]["local"][0] for r in range(N)},
                     "ZeRO-1 state on rank": [r for r in range(N) if name in S[r]["zero_owned"]]}
              for name in names}).T

# %% [markdown]
# **Claim:** with ZeRO-1, every parameter's Adam state is on exactly one rank. With FSDP2, every
# parameter is a `DTensor` placed `Shard(0)`, with the plain model's full shape. Rank `r` holds
# the rows of `torch.chunk(rows, world_size)[r]`. On 4 ranks:
#
# | parameter | rows | rows on ranks 0, 1, 2, 3 |
# |---|---|---|
# | `6.bias`, `6.weight` | 3 | 1, 1, 1, **0**: rank 3 holds an empty shard |
# | `4.weight` | 10 | 3, 3, 3, 1 |

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: ZeRO-1 owners and FSDP2 shards on every rank
def chunk_rows(rows, world_size, rank):
    chunks = torch.chunk(torch.arange(rows), world_size)
    return len(chunks[rank]) if rank < len(chunks) else 0


plain = dict(mlp(hidden).named_parameters())
for name in names:
    owners = [r for r in range(N) if name in S[r]["zero_owned"]]
    assert len(owners) == 1, (name, owners)
    for r in range(N):
        info = S[r]["fsdp"][name]
        assert info["type"] == "DTensor" and info["placements"] == (Shard(0),), info
        assert info["shape"] == tuple(plain[name].shape), (name, info)
        rows = plain[name].shape[0]
        assert info["local"] == (chunk_rows(rows, N, r), *plain[name].shape[1:]), (name, r, info)
if N == 4:
    assert [S[r]["fsdp"]["6.bias"]["local"] for r in range(4)] == [(1,), (1,), (1,), (0,)]
    assert [S[r]["fsdp"]["4.weight"]["local"][0] for r in range(4)] == [3, 3, 3, 1]
print("rank", N - 1, "holds 6.bias with shape", S[N - 1]["fsdp"]["6.bias"]["local"])

# %% [markdown]
# ## 2. Memory per rank: DDP, ZeRO-1 and FSDP2
#
# After one training step, each rank counts the bytes it stores:
#
# * its parameters, the local shards for FSDP2;
# * its gradients, `p.grad`. FSDP2's are sharded `DTensor`s too, reduce-scattered in
#   `backward()`;
# * Adam's two states per parameter, `exp_avg` and `exp_avg_sq`. The scalar `step` counters are
#   left out.
#
# Everything is float32. Take `P` parameters, with 4 bytes each for parameters and gradients,
# and `K = 8` for Adam. Section 3 of [07b](07b_hooks_and_after_ddp.ipynb) gives the ZeRO formula.
# Per rank on `N` ranks it gives DDP `4P + 4P + 8P = 16P`, ZeRO-1 `4P + 4P + 8P / N`, and FSDP2
# `16P / N`. Activations and communication buffers come on top and are not counted here. Those
# are DDP's gradient buckets, and the layer FSDP2 gathers for its forward.

# %%
def memory_worker(rank, world_size, hidden, batch_size):
    mesh = init_device_mesh("cpu", (world_size,))
    x, y = batch(rank, 0, batch_size)
    out = {}
    for kind in KINDS:
        model, opt = build(kind, hidden, mesh)
        F.mse_loss(model(x), y).backward()
        opt.step()
        states = adam_state(opt).values()
        out[kind] = {"parameters": sum(nbytes(p) for p in model.parameters()),
                     "gradients": sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None),
                     "optimizer state": sum(nbytes(s[k]) for s in states for k in ("exp_avg", "exp_avg_sq"))}
        if kind == "FSDP2":  # storage of the local shards: padded to ceil(rows / N) rows
            out["FSDP2 padded"] = sum(local(p).untyped_storage().nbytes() for p in model.parameters())
    return out


M = {n: launch(memory_worker, n, hidden, batch_size, backend="gloo", timeout=180) for n in world_sizes}
P = sum(p.numel() for p in mlp(hidden).parameters())


def formula(kind, n, p=P):
    """Bytes per rank for p fp32 parameters with Adam's 2 states on n ranks."""
    return {"DDP": 16 * p, "ZeRO-1": 8 * p + 8 * p / n, "FSDP2": 16 * p / n}[kind]


rows = []
for n in world_sizes:
    for kind in KINDS:
        per_rank = [sum(M[n][r][kind].values()) for r in range(n)]
        rows.append({"world size": n, "wrapper": kind, "formula (bytes/rank)": round(formula(kind, n)),
                     "measured, min over ranks": min(per_rank), "measured, max over ranks": max(per_rank),
                     **{f"{part}, max": max(M[n][r][kind][part] for r in range(n))
                        for part in ("parameters", "gradients", "optimizer state")}})
table = pd.DataFrame(rows).set_index(["world size", "wrapper"])
print(f"P = {P:,} parameters; formula: DDP 16P, ZeRO-1 8P + 8P/N, FSDP2 16P/N bytes per rank")
table

# %% [markdown]
# **Claim:** the bytes each rank holds, against the formula.
#
# | wrapper | each rank | over all ranks |
# |---|---|---|
# | DDP | exactly `16P` | |
# | ZeRO-1 | exactly `8P` of parameters and gradients; its state within one largest parameter's state of `8P / N` | optimizer states add up to exactly `8P` |
# | FSDP2 | rank 0: exactly 4 × the padded parameter storage; no rank more; the last rank less when shards are uneven | exactly `16P` |
#
# The ZeRO-1 share is uneven because whole parameters are assigned. FSDP2's local parameter
# storage is padded to `4 × Σ ceil(rows / N) × columns` on every rank. Rank 0 holds full chunks
# of parameters, gradients and both states: 4 times that. So `16P / N` plus the padding is the
# most a rank holds.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the bytes on every rank against the formula
largest = max(p.numel() for p in mlp(hidden).parameters())
for n in world_sizes:
    padded = 4 * sum(-(-p.shape[0] // n) * (p.numel() // p.shape[0]) for p in mlp(hidden).parameters())
    for r in range(n):
        m = M[n][r]
        assert sum(m["DDP"].values()) == formula("DDP", n), (n, r, m["DDP"])
        assert m["ZeRO-1"]["parameters"] + m["ZeRO-1"]["gradients"] == 8 * P, (n, r, m["ZeRO-1"])
        assert abs(m["ZeRO-1"]["optimizer state"] - 8 * P / n) < 8 * largest, (n, r, m["ZeRO-1"])
        assert m["FSDP2 padded"] == padded, (n, r, m["FSDP2 padded"], padded)
        assert sum(m["FSDP2"].values()) <= 4 * padded, (n, r, m["FSDP2"], padded)
    assert sum(M[n][0]["FSDP2"].values()) == 4 * padded, (n, M[n][0]["FSDP2"], padded)
    if n * padded > 4 * P:  # uneven shards: the last rank holds the short chunk of every parameter
        assert sum(M[n][n - 1]["FSDP2"].values()) < 4 * padded, (n, M[n][n - 1]["FSDP2"], padded)
    assert sum(M[n][r]["ZeRO-1"]["optimizer state"] for r in range(n)) == 8 * P
    assert sum(sum(M[n][r]["FSDP2"].values()) for r in range(n)) == 16 * P
print(f"every rank matches its formula; FSDP2 at N = {world_sizes[-1]}: {4 * padded - formula('FSDP2', world_sizes[-1]):.0f} "
      "bytes of padding on rank 0")

# %%
fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
labels, bottoms = [f"{kind}\nN = {n}" for n in world_sizes for kind in KINDS], None
for part, color in zip(("parameters", "gradients", "optimizer state"), ("tab:blue", "tab:orange", "tab:green")):
    values = [table.loc[(n, kind), f"{part}, max"] / 1e3 for n in world_sizes for kind in KINDS]
    ax.bar(labels, values, bottom=bottoms, color=color, label=part + " (max over ranks)")
    bottoms = values if bottoms is None else [b + v for b, v in zip(bottoms, values)]
ax.scatter(labels, [formula(kind, n) / 1e3 for n in world_sizes for kind in KINDS], marker="_", s=600,
           color="black", zorder=3, label="formula")
ax.set_title(f"Model-state memory per rank, {P:,} float32 parameters, Adam")
ax.set_ylabel("kilobytes per rank (10^3 bytes)")
ax.set_xlabel("wrapper and world size N")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %% [markdown]
# ## 3. The same loss curve as DDP
#
# Sharding changes where the state lives, not the arithmetic. DDP all-reduces and averages the
# gradients. FSDP2 reduce-scatters and averages them. Adam's update is elementwise, so each
# shard's update is the slice of the full one. All three runs start from the same weights, seed
# 0. They see the same data on each rank. Each step logs the loss averaged over the ranks.

# %%
def curve_worker(rank, world_size, hidden, steps, batch_size):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for kind in KINDS:
        model, opt = build(kind, hidden, mesh)
        losses = []
        for step in range(steps):
            x, y = batch(rank, step, batch_size)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            losses.append(logged.item() / world_size)
        out[kind] = losses
        out[kind + " weights"] = {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
                                  for name, p in model.named_parameters()}
    return out


W = min(world_sizes)
L = launch(curve_worker, W, hidden, steps, batch_size, backend="gloo", timeout=180)
curves = pd.DataFrame({kind: L[0][kind] for kind in KINDS}, index=pd.RangeIndex(1, steps + 1, name="step"))
curves

# %% [markdown]
# **Claim:** on `W` ranks, the ZeRO-1 and FSDP2 loss curves equal DDP's at every step. Their
# final weights equal DDP's too; FSDP2's are gathered with `full_tensor()`. Both hold to float32
# rounding, a relative tolerance of `1e-5`. ZeRO-1's broadcast after `step()` leaves every rank
# with the same weights.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: ZeRO-1 and FSDP2 losses and weights equal DDP's
for kind in ("ZeRO-1", "FSDP2"):
    torch.testing.assert_close(torch.tensor(L[0][kind]), torch.tensor(L[0]["DDP"]), rtol=1e-5, atol=1e-7)
    ddp_weights = L[0]["DDP weights"]
    for name, w in L[0][kind + " weights"].items():
        torch.testing.assert_close(w, ddp_weights["module." + name if kind == "FSDP2" else name],
                                   rtol=1e-5, atol=1e-6)
for r in range(1, W):
    for name, w in L[r]["ZeRO-1 weights"].items():
        assert torch.equal(w, L[0]["ZeRO-1 weights"][name]), (r, name)
print("largest loss difference to DDP:",
      {kind: max(abs(a - b) for a, b in zip(L[0][kind], L[0]["DDP"])) for kind in ("ZeRO-1", "FSDP2")})

# %% [markdown]
# ## 4. Clipping sharded gradients
#
# `clip_grad_norm_` scales every gradient by `max_norm / total_norm` when the norm of **all**
# gradients together is above `max_norm`. Under FSDP2 each rank holds only its shard of each
# gradient. So the norm of the local tensors is a partial one, and it differs per rank. Clipping
# with it would scale each rank's shards by a different factor.
#
# The global norm is `sqrt(Σ over ranks of local_norm²)`: one all-reduce of the squared local
# norm. `torch.nn.utils.clip_grad_norm_` on the `DTensor` gradients does exactly that. It returns
# a `DTensor`, and `.full_tensor()` gives the number. A DDP model on the same data is the
# reference.

# %%
def clip_worker(rank, world_size, hidden, batch_size):
    mesh = init_device_mesh("cpu", (world_size,))
    x, y = batch(rank, 0, batch_size)
    ref = DDP(mlp(hidden))
    F.mse_loss(ref(x), y).backward()
    ref_norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()
    max_norm = ref_norm.item() / 2  # so that clipping acts
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    model = shard(mlp(hidden), mesh)
    F.mse_loss(model(x), y).backward()
    local_norm = torch.cat([local(p.grad).flatten() for p in model.parameters()]).norm()  # wrong: this rank only
    squared = local_norm.square()
    dist.all_reduce(squared)  # right: sum of squares over the ranks
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # right: a DTensor
    clipped_diff = max((p.grad.full_tensor() - q.grad).abs().max().item()
                       for p, q in zip(model.parameters(), ref.parameters()))
    return {"reference": ref_norm.item(), "local": local_norm.item(), "all-reduced": squared.sqrt().item(),
            "clip_grad_norm_": total.full_tensor().item(), "type": type(total).__name__,
            "max_norm": max_norm, "clipped grads vs DDP": clipped_diff}


C = launch(clip_worker, N, hidden, batch_size, backend="gloo", timeout=180)
pd.DataFrame(C).rename_axis("rank")[["local", "all-reduced", "clip_grad_norm_", "reference", "type"]]

# %% [markdown]
# **Claim:** on `N` ranks, each rank's local norm is below the global one, and they differ across
# ranks. Their squares add up to the global norm squared. The all-reduced norm and
# `clip_grad_norm_`, a `DTensor`, both equal the DDP model's gradient norm. The clipped sharded
# gradients, gathered, equal DDP's clipped ones.
#
# **Claim:** clipping by the local norm would scale rank `r` by `max_norm / local_r`, a
# different factor on each rank.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: local, all-reduced and clipped norms against DDP
ref_norm = C[0]["reference"]
local_norms = [c["local"] for c in C]
assert all(n < ref_norm for n in local_norms) and len(set(local_norms)) > 1, local_norms
assert abs(sum(n * n for n in local_norms) - ref_norm**2) <= 1e-5 * ref_norm**2, (local_norms, ref_norm)
for c in C:
    assert c["type"] == "DTensor", c
    for key in ("all-reduced", "clip_grad_norm_"):
        assert abs(c[key] - ref_norm) <= 1e-5 * ref_norm, (key, c)
    assert c["clipped grads vs DDP"] < 1e-6, c
factors = {"global": C[0]["max_norm"] / ref_norm, **{f"local, rank {r}": min(1.0, C[r]["max_norm"] / n)
                                                    for r, n in enumerate(local_norms)}}
assert len({round(f, 6) for f in factors.values()}) > 2, factors
print("clip factors:", {k: round(v, 4) for k, v in factors.items()})

# %% [markdown]
# On a 2-D mesh, HSDP, the replicas hold the same shards. There the sum over all ranks counts
# each shard once per replica. Sum the squares over the mesh's shard dimension only.
#
# **Claim:** on a mesh of 2 replicas × `N // 2` shards, the sum of squares over all ranks gives
# `√2` times DDP's norm. Over the shard dimension, and with `clip_grad_norm_`, it gives DDP's.

# %%
def hsdp_worker(rank, world_size, hidden, batch_size):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    x, y = batch(rank, 0, batch_size)
    ref = DDP(mlp(hidden))
    F.mse_loss(ref(x), y).backward()
    model = shard(mlp(hidden), mesh)  # a 2-D mesh: HSDP
    F.mse_loss(model(x), y).backward()
    all_ranks = torch.cat([local(p.grad).flatten() for p in model.parameters()]).norm().square()
    shard_dim = all_ranks.clone()
    dist.all_reduce(all_ranks)  # wrong here: each shard counted once per replica
    dist.all_reduce(shard_dim, group=mesh["shard"].get_group())  # right: the shard dimension only
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # measures, does not clip
    return {"reference": torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item(),
            "all ranks": all_ranks.sqrt().item(), "shard dimension": shard_dim.sqrt().item(),
            "clip_grad_norm_": total.full_tensor().item()}


H = launch(hsdp_worker, 2 * (N // 2), hidden, batch_size, backend="gloo", timeout=180)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: on an HSDP mesh, the norm over all ranks against the shard dimension's
for h in H:
    assert abs(h["all ranks"] - 2**0.5 * h["reference"]) <= 1e-5 * h["reference"], h
    for key in ("shard dimension", "clip_grad_norm_"):
        assert abs(h[key] - h["reference"]) <= 1e-5 * h["reference"], (key, h)
pd.DataFrame(H).rename_axis("rank")

# %% [markdown]
# ## 5. A checkpoint that loads into a plain model
#
# An FSDP2 model's `state_dict()` holds `DTensor`s: each rank's entries carry only its shard. A
# plain `nn.Module` may need to load the checkpoint: an evaluation script, a single-device
# export. Then gather the full tensors. There are two ways:
#
# * `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))`
#   from `torch.distributed.checkpoint.state_dict`. It is a collective, so every rank calls it.
#   Rank 0 receives the full tensors on the CPU; the other ranks get an empty dict.
# * `{k: v.full_tensor() ...}` on every rank.
#
# A sharded checkpoint restores into the sharded model and its optimizer. For that,
# `torch.distributed.checkpoint.save` and `load` are the tools; they are not run here. The model
# is trained one step first. So its weights differ from a fresh `mlp`, built with another seed.

# %%
def checkpoint_worker(rank, world_size, hidden, batch_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model, opt = build("FSDP2", hidden, mesh)
    x, y = batch(rank, 0, batch_size)
    F.mse_loss(model(x), y).backward()
    opt.step()
    probe = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))  # the same on every rank
    with torch.no_grad():
        expected = model(probe)
    out = {}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["keys on this rank"] = len(full)
    if rank == 0:
        plain = mlp(hidden, seed=1)
        plain.load_state_dict(full)
        out["get_model_state_dict"] = (plain(probe) - expected).abs().max().item()
    gathered = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective: every rank
    plain = mlp(hidden, seed=1)
    plain.load_state_dict(gathered)
    out["full_tensor"] = (plain(probe) - expected).abs().max().item()
    sharded = model.state_dict()  # the mistake: DTensors
    out["saved types"] = sorted({type(v).__name__ for v in sharded.values()})
    for name, sd in (("state_dict()", sharded), ("to_local()", {k: local(v) for k, v in sharded.items()})):
        try:
            mlp(hidden, seed=1).load_state_dict(sd)
            out[name] = "loaded"
        except RuntimeError as e:
            out[name] = str(e)
    return out


K = launch(checkpoint_worker, W, hidden, batch_size, backend="gloo", timeout=180)
for name in ("state_dict()", "to_local()"):  # the two expected errors, their first two lines
    print(f"expected error, loading the sharded model's {name} into a plain model:")
    print("  " + "\n  ".join(K[0][name].splitlines()[:2]))

# %% [markdown]
# **Claim:** with `get_model_state_dict(..., full_state_dict=True, cpu_offload=True)`, rank 0
# gets all 8 entries and the other ranks none. Loaded into a plain model, it gives exactly the
# sharded model's outputs. So does the `full_tensor()` dictionary, on every rank.
#
# **Claim:** loading the sharded `model.state_dict()` into a plain model raises a
# `RuntimeError`. The shapes match, since a `DTensor` reports the full shape. But copying a
# `DTensor` into a plain tensor fails with "got mixed torch.Tensor and DTensor". Converting with
# `to_local()` first fails too, with "size mismatch": each rank saved only its rows.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the gathered checkpoint loads; the sharded one fails
n_keys = len(mlp(hidden).state_dict())
assert n_keys == 8, n_keys  # the claim's "all 8 entries": 4 Linear layers, weight and bias
assert [k["keys on this rank"] for k in K] == [n_keys] + [0] * (W - 1), [k["keys on this rank"] for k in K]
assert K[0]["get_model_state_dict"] == 0.0, K[0]
assert all(k["full_tensor"] == 0.0 for k in K), K
assert K[0]["saved types"] == ["DTensor"], K[0]["saved types"]
for k in K:
    assert "mixed torch.Tensor and DTensor" in k["state_dict()"], k["state_dict()"]
    assert "size mismatch for 0.weight" in k["to_local()"], k["to_local()"]
print("plain model from get_model_state_dict: outputs equal; the DTensor state_dict: RuntimeError")

# %%
print(f"lesson 08a ran in {time.perf_counter() - t_notebook:.0f} s")

# %% [markdown]
# ## What we saw
#
# | | each rank holds | bytes per rank (fp32, Adam) | in the loop |
# | --- | --- | --- | --- |
# | DDP | everything | `16P` | nothing changes |
# | ZeRO-1 | all parameters and gradients, Adam's state for its share of the parameters | `8P + 8P / N` | swap the optimizer; `consolidate_state_dict(to=0)` on every rank before saving |
# | FSDP2 | `torch.chunk` rows of every parameter, gradient and state | `16P / N` plus padding | global clip norm, gathered checkpoint |
#
# Sharding leaves the loss curve where DDP puts it. It changes what "the gradient" and "the state
# dict" mean on one rank. Each rank holds a shard, and anything computed from it alone is
# partial: a norm, a checkpoint. Use the `DTensor`-aware tools. Clip with `clip_grad_norm_` on
# the sharded gradients. Save with `get_model_state_dict` and `full_state_dict=True`, or with
# `full_tensor()`, for a checkpoint that a plain model loads.
#
# Casebook: [ZeRO-1's checkpoint needs `consolidate_state_dict(to=0)` on every rank](10c_casebook_models_and_checkpoints.ipynb#case-zero-checkpoint),
# and [FSDP2's optimizer comes after `fully_shard`, before any forward](10c_casebook_models_and_checkpoints.ipynb#case-fsdp2-optimizer-order).
#
# ## Exercises
#
# Both ask for a value. Predict it by hand first. Then set `answer_N` in place of `None` and run
# the check cell below it. It prints "correct", or "not yet" with a hint. In the full lesson, a
# collapsed solution follows each check. Student copies leave the solutions out. Every solution
# runs when the full lesson runs, so each is known to pass its check.

# %% [markdown]
# ### Exercise 1: bytes per rank for a billion parameters
#
# A model of `10^9` float32 parameters is trained with Adam on 8 ranks. How many bytes of model
# state does each rank hold with DDP, with ZeRO-1 and with FSDP2, without padding? Answer with a
# list of three numbers, `[DDP, ZeRO-1, FSDP2]`.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, section 2's formula
# expected: section 2's formula, which the measurement there matched
expected_1 = [formula(kind, 8, 10**9) for kind in KINDS]
check_answer("ex1", answer_1, expected_1, hint="4 bytes each for parameters and gradients, 8 for Adam; divide what is sharded by 8")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# DDP 16 GB; ZeRO-1 8 GB + 8 GB / 8 = 9 GB; FSDP2 16 GB / 8 = 2 GB.
solution_1 = [16e9, 9e9, 2e9]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: the rows of a 7-row weight on 3 ranks
#
# `fully_shard` on a mesh of 3 ranks shards a `Linear(5, 7)` weight, of shape `(7, 5)`. How many
# rows does each rank hold? Answer with a list, `[rank 0, rank 1, rank 2]`.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, the torch.chunk rule
# expected: torch.chunk, the rule section 1 checked against the real shards
expected_2 = [chunk_rows(7, 3, r) for r in range(3)]
check_answer("ex2", answer_2, expected_2, hint="chunks of ceil(7 / 3) rows; the last rank takes what is left")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# ceil(7 / 3) = 3 rows per chunk: 3, 3, and the remaining 1.
solution_2 = [3, 3, 7 - 3 - 3]
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [08b torch.compile with DDP](08b_compile_and_ddp.ipynb): count what `torch.compile` captures under DDP and where buckets split the graph.
# <!-- next:end -->
