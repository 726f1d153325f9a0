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
# # 03 · `DistributedSampler`: which rank sees which item
#
# <!-- opening:start -->
# **You will be able to** predict which rank gets which item, and evaluate without padding errors. **You need** [01 gradients: DP vs DDP](01_gradients_dp_vs_ddp.ipynb). **Run time** (measured): under 1 min as you run it (the `smoke` profile), under 1 min in the larger `full` profile. **Reading time** (estimate: about 2,300 words at 200 words/min): about 12 min.
# <!-- opening:end -->
#
# **The question:** under DDP every rank runs its own `DataLoader`. How does
# `torch.utils.data.DistributedSampler` decide which dataset items each rank gets, and when
# does that split mislead you (duplicated items, dropped items, the same order every epoch,
# different data behind the same index)?
#
# The seed: a dataset of 8 items on 4 processes with `DistributedSampler(shuffle=False)` and
# `batch_size=1`: process `r` receives items `r` and `r + 4`. Every claim below (in bold) is
# followed by the code cell that checks it (`assert` / `torch.testing.assert_close`), so a
# wrong claim stops the notebook.
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | sections 1–3: asking the real `DistributedSampler` (tables and pictures from `helpers.sampler`), the fixed cases | this notebook's process, CPU; no process group needed (the sampler takes `num_replicas` and `rank` explicitly) | the same |
# | section 4: the sampler loop, evaluation and gathering inside real ranks: functions written in this notebook's cells, run with `helpers.engine.launch` | `world_size` processes (2 for the gathering case), backend `gloo` | the same: indices and counts are tiny, so this runs on CPU with `gloo` everywhere |
#
# **New here:** how `DistributedSampler` shards indices (padding, `drop_last`, `set_epoch`),
# why every rank must hold the *same* dataset, and a correct distributed evaluation
# (unpadded shards + all-reduced correct/total counts). Sections 1–3 use the fixed
# sizes whatever `world_size` is; section 4 uses `world_size`. Terms:
# [DistributedSampler](../docs/GLOSSARY.md#distributedsampler), [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [global batch size](../docs/GLOSSARY.md#global-batch-size); every term is defined (with its
# Chinese name) in the [glossary](../docs/GLOSSARY.md). Most of the run time is worker
# processes starting (five launches). The notebook ends with four exercises, each checked by a
# cell; the last one asks you to write distributed code.

# %% tags=["parameters"]
# Parameters: what you run by default, top to bottom in JupyterLab (the smoke profile); the full profile overrides some (docs/RUNNER.md)
world_size = 4  # number of DDP ranks for section 4's live workers, at least 2; the seed uses 4
base_seed = 0  # section 4: the shared dataset uses base_seed, rank r's own dataset base_seed + r
epochs = 2  # section 4: epochs of the set_epoch demonstration, at least 2

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int), base_seed=(base_seed, int), epochs=(epochs, int))
check_value("world_size and epochs", (world_size, epochs), world_size >= 2 and epochs >= 2, "both at least 2 (section 4 compares ranks and epochs)")

# %%
import math
import time
from fractions import Fraction

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
from matplotlib.patches import Rectangle
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers.engine import launch
from helpers.sampler import (  # tables and pictures of what the real sampler hands out
    accuracy_through,
    assignment_lists,
    epoch_assignment,
    plot_assignment,
    sampler_assignment,
    sampler_indices,  # for the exercises
    times_seen,
)

print(f"torch {torch.__version__}; world_size = {world_size} (section 4); base_seed = {base_seed}; epochs = {epochs}")

# %% [markdown]
# ## 1. Asking the real sampler
#
# `DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)` only needs
# `len(dataset)`; given `num_replicas` and `rank` explicitly it needs no process group, so we
# can ask it, in this one process, what every rank would receive.
# `helpers.sampler.sampler_assignment(N, num_replicas, ...)` does exactly that and returns a
# table with one row per `(rank, position, index)`: `position` is the batch number with
# `batch_size=1`.
#
# What the sampler does (`torch/utils/data/distributed.py`): take `range(N)` (shuffled with
# seed `seed + epoch` if `shuffle=True`), **pad** it up to a multiple of `num_replicas` by
# repeating the list from its start (its first items when only a few are missing; the whole
# list again, as often as needed, when more are missing than it holds), or, with
# `drop_last=True`, cut it down to a multiple; then rank `r` takes every `num_replicas`-th
# index starting at `r`.
#
# **Claim (the seed):** 8 items, 4 ranks, `shuffle=False`: rank `r` gets `[r, r + 4]`.

# %%
case_a = sampler_assignment(8, 4, shuffle=False)
lists_a = assignment_lists(case_a)
for r in range(4):
    assert lists_a[r] == [r, r + 4], f"8 items, 4 ranks: rank {r} should get [{r}, {r + 4}], got {lists_a[r]}"
assert (times_seen(case_a, 8) == 1).all(), "8 items over 4 ranks: every item exactly once"
print("8 items, 4 ranks:", lists_a)
case_a.pivot(index="rank", columns="position", values="index")

# %% [markdown]
# **Claim (padding):** 10 items, 3 ranks, `shuffle=False`: the ranks get `[0, 3, 6, 9]`,
# `[1, 4, 7, 0]`, `[2, 5, 8, 1]`. Ten items do not split evenly over three ranks, so the
# sampler pads the index list to 12 with its first two items: items 0 and 1 are seen
# **twice** in one epoch. The point of the padding: every rank gets the same number of
# batches (4), so every rank makes the same number of DDP backward passes (each one an
# all-reduce) and none is left waiting forever for a collective its peers never start.

# %%
case_b = sampler_assignment(10, 3, shuffle=False)
lists_b = assignment_lists(case_b)
assert lists_b == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]], f"10 items, 3 ranks, padded: got {lists_b}"
seen_b = times_seen(case_b, 10)
assert seen_b[seen_b > 1].index.tolist() == [0, 1] and (seen_b[[0, 1]] == 2).all(), (
    f"items 0 and 1 (and only they) should be seen twice: {seen_b.to_dict()}")
assert {len(idx) for idx in lists_b} == {4}, f"every rank should get 4 batches: {[len(idx) for idx in lists_b]}"
print("10 items, 3 ranks, padded:", lists_b)
case_b.pivot(index="rank", columns="position", values="index")

# %% [markdown]
# **Claim (padding, fewer items than ranks):** 3 items on 7 ranks, `shuffle=False`: four
# indices are missing and the list holds only three, so the sampler repeats the **whole** list
# (`[0, 1, 2, 0, 1, 2, 0]`, not only its first items): ranks 0 to 6 get `[0]`, `[1]`, `[2]`,
# `[0]`, `[1]`, `[2]`, `[0]`; item 0 is seen three times, items 1 and 2 twice.

# %%
case_d = sampler_assignment(3, 7, shuffle=False)
lists_d = assignment_lists(case_d)
assert lists_d == [[0], [1], [2], [0], [1], [2], [0]], f"3 items, 7 ranks, padded: got {lists_d}"
assert times_seen(case_d, 3).tolist() == [3, 2, 2], times_seen(case_d, 3).to_dict()
print("3 items, 7 ranks, padded:", lists_d)

# %% [markdown]
# **Claim (`drop_last=True`):** the same 10 items and 3 ranks give `[0, 3, 6]`, `[1, 4, 7]`,
# `[2, 5, 8]`: the list is cut to 9, and item 9 is **never** seen.

# %%
case_c = sampler_assignment(10, 3, shuffle=False, drop_last=True)
lists_c = assignment_lists(case_c)
assert lists_c == [[0, 3, 6], [1, 4, 7], [2, 5, 8]], f"10 items, 3 ranks, drop_last: got {lists_c}"
seen_c = times_seen(case_c, 10)
assert seen_c[seen_c == 0].index.tolist() == [9], f"only item 9 should never be seen: {seen_c.to_dict()}"
assert (seen_c[:9] == 1).all(), "items 0-8 should be seen exactly once"
print("10 items, 3 ranks, drop_last:", lists_c)
case_c.pivot(index="rank", columns="position", values="index")

# %% [markdown]
# The three cases as pictures: ranks as rows, dataset indices as columns; a filled cell is an
# item the rank receives, labelled with its position (`p0` = first batch). Items handed out
# twice are orange with a red edge; items never handed out have a grey hatched column.

# %%
cases = [(case_a, 8, "8 items, 4 ranks, shuffle=False"),
         (case_b, 10, "10 items, 3 ranks: padded (default)"),
         (case_c, 10, "10 items, 3 ranks, drop_last=True")]
fig, axes = plt.subplots(len(cases), 1, figsize=(8.5, 6.8), layout="constrained")
for ax, (df, n, title) in zip(axes, cases):
    plot_assignment(df, n, ax=ax, title=title)
fig.suptitle("DistributedSampler: which rank receives which dataset index")
plt.show()

# %% [markdown]
# ## 2. Padding skews evaluation
#
# Padding is harmless for training (two extra samples per epoch) but wrong for **measuring**.
# Take the 10 items and a real (tiny) classifier that predicts class 1 for every input, with
# labels 1 on items 0–4 and 0 on items 5–9: it is right on exactly items 0–4.
#
# **Claim:** its true accuracy, from one forward pass over all 10 items in this process
# (no sampler), is **0.5**. Evaluated through the padded sampler (every rank counts what it
# is handed, the counts are summed over ranks) it scores **7/12**: items 0 and 1, both right,
# are counted twice. With `drop_last=True` it scores **5/9**: item 9, wrong, is never
# counted. A correct distributed evaluation gives the true accuracy: each rank evaluates an
# **unpadded** shard (`range(rank, N, world_size)`: the sampler's split without its padding),
# and the ranks sum their `correct` and `total` counts (an all-reduce in section 4.2; here we
# add the three shards' counts by hand). The sampler-based scores are checked against
# `accuracy_through`, which counts over the table of indices the real sampler hands out.

# %%
EVAL_N, N_RIGHT = 10, 5
eval_feats = torch.arange(EVAL_N, dtype=torch.float32).unsqueeze(1)  # (10, 1): item i's feature is i
eval_labels = (torch.arange(EVAL_N) < N_RIGHT).long()  # (10,): 1 on items 0-4, 0 on items 5-9


def always_class_one() -> nn.Linear:
    """Linear(1, 2) with zero weight and bias [0, 1]: logits (batch, 2), argmax 1 for every input."""
    model = nn.Linear(1, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([0.0, 1.0]))
    return model


clf = always_class_one()
with torch.no_grad():
    right = (clf(eval_feats).argmax(dim=1) == eval_labels).tolist()  # right[i]: the model is right on item i
true_acc = Fraction(sum(right), EVAL_N)  # one forward over all 10 items, no sampler, no shards


def counts_through_sampler(drop_last: bool, num_replicas: int = 3) -> tuple[int, int]:
    """Naive evaluation: each rank counts what its DistributedSampler hands it; the counts are summed."""
    correct = total = 0
    for rank in range(num_replicas):
        for i in DistributedSampler(range(EVAL_N), num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=drop_last):
            correct, total = correct + right[i], total + 1
    return correct, total


shards = [list(range(rank, EVAL_N, 3)) for rank in range(3)]  # unpadded: the sampler's split without padding
evals = {
    "true accuracy (one forward, all 10 items)": (sum(right), EVAL_N),
    "padded sampler (default)": counts_through_sampler(drop_last=False),
    "sampler with drop_last=True": counts_through_sampler(drop_last=True),
    "unpadded shards + summed counts": (sum(right[i] for s in shards for i in s), sum(len(s) for s in shards)),
}
assert right == [True] * 5 + [False] * 5 and true_acc == Fraction(1, 2), f"the model should be right on items 0-4 only: {right}"
assert sorted(i for s in shards for i in s) == list(range(EVAL_N)), f"unpadded shards must partition the items: {shards}"
assert Fraction(*evals["padded sampler (default)"]) == accuracy_through(case_b, right) == Fraction(7, 12), (
    f"padded: expected 7/12, got {evals['padded sampler (default)']}")
assert Fraction(*evals["sampler with drop_last=True"]) == accuracy_through(case_c, right) == Fraction(5, 9), (
    f"drop_last: expected 5/9, got {evals['sampler with drop_last=True']}")
assert evals["unpadded shards + summed counts"] == evals["true accuracy (one forward, all 10 items)"], (
    "the correct distributed evaluation should count exactly what one forward over all items counts")
eval_table = pd.DataFrame([{"evaluation": k, "right": c, "counted": t, "accuracy": c / t,
                            "error vs true": c / t - float(true_acc)} for k, (c, t) in evals.items()])
eval_table.set_index("evaluation")

# %%
fig, ax = plt.subplots(figsize=(9, 3.4), layout="constrained")
names = list(evals)
accs = [c / t for c, t in evals.values()]
ax.scatter(accs, names, s=80, color=["#555555", "#f28e2b", "#bbbbbb", "#4c72b0"], edgecolor="k", zorder=3)
for acc, name, (c, t) in zip(accs, names, evals.values()):
    ax.annotate(f"{c}/{t} = {c / t:.4f}", (acc, name), xytext=(10, 0), textcoords="offset points", va="center")
ax.axvline(float(true_acc), color="k", linestyle="--", linewidth=1, label=f"true accuracy {float(true_acc)}")
ax.set_xlim(0, 1)
ax.invert_yaxis()
ax.margins(y=0.25)
ax.set_xlabel("accuracy (fraction of counted items that are right)")
ax.set_ylabel("how it was measured")
ax.set_title("A model right on items 0-4 of 10, evaluated over 3 ranks")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
plt.show()

# %% [markdown]
# ## 3. `set_epoch`: a new shuffle every epoch, only if you ask
#
# With `shuffle=True` the sampler permutes the indices with a generator seeded
# `seed + epoch`, where `epoch` is whatever `set_epoch` last set: **0 if you never call it**
# (`torch/utils/data/distributed.py`, `__iter__` and `set_epoch`).
# A training loop reuses one sampler across epochs, so:
#
# **Claim:** 8 items, 2 ranks, `shuffle=True`, `seed=0`. Without `set_epoch`, each rank's
# order in epoch 1 **equals** its order in epoch 0. With `sampler.set_epoch(epoch)` at the
# start of each epoch, the orders **differ**. In every epoch, with or without, the two ranks
# together cover all 8 items exactly once (the permutation is the same on both ranks, so the
# shards never overlap).

# %%
without = epoch_assignment(8, 2, 2, call_set_epoch=False, seed=0)
with_set = epoch_assignment(8, 2, 2, call_set_epoch=True, seed=0)


def orders(df, epoch):
    return assignment_lists(df[df["epoch"] == epoch])


for name, df in (("without set_epoch", without), ("with set_epoch", with_set)):
    for e in (0, 1):
        both = sorted(i for rank_order in orders(df, e) for i in rank_order)
        assert both == list(range(8)), f"{name}, epoch {e}: the 2 ranks should cover items 0-7 exactly once, got {both}"
for r in range(2):
    assert orders(without, 1)[r] == orders(without, 0)[r], f"without set_epoch, rank {r}'s epoch 1 should repeat epoch 0"
    assert orders(with_set, 1)[r] != orders(with_set, 0)[r], f"with set_epoch, rank {r}'s epoch 1 should differ from epoch 0"
epoch_table = pd.DataFrame([{"set_epoch called": name, "epoch": e, "rank": r, "order": o}
                            for name, df in (("no", without), ("yes", with_set))
                            for e in (0, 1) for r, o in enumerate(orders(df, e))])
epoch_table.set_index(["set_epoch called", "epoch", "rank"])

# %%
fig, axes = plt.subplots(2, 2, figsize=(11, 3.6), layout="constrained")
for row, (name, df) in enumerate((("without set_epoch", without), ("with set_epoch(epoch)", with_set))):
    for e in (0, 1):
        plot_assignment(df[df["epoch"] == e], 8, ax=axes[row, e], title=f"{name}: epoch {e}", legend=(e == 1))
fig.suptitle("8 items, 2 ranks, shuffle=True, seed=0: labels p0..p3 give each rank's order")
plt.show()

# %% [markdown]
# ## 4. The sampler inside real DDP workers
#
# Now the same sampler inside real ranks. Each function below is written in this notebook and
# run with `launch(fn, world_size, ..., backend="gloo")`: it starts `world_size` processes
# with a `gloo` process group (CPU tensors, on any machine), sends them the function, and
# returns each rank's result to this cell, in rank order. Inside a rank, `DistributedSampler(dataset)` takes `num_replicas` and `rank`
# **from the process group**, as in any DDP script. Worker prints appear below prefixed
# `[rank r]`. With more ranks than cores the launcher warns `OversubscriptionWarning`: the
# results are still exact; we measure no time here.
#
# ### 4.1 The seed's loop, and different data behind the same index
#
# Each rank builds the seed's 8-item dataset twice: once **per rank**
# (`torch.manual_seed(base_seed + rank)`, as the seed does: index `i` then means different
# data on each rank) and once **shared** (seed `base_seed` on every rank), and iterates each
# with `DataLoader(batch_size=1, sampler=DistributedSampler(...))`. `same_on_all_ranks`
# compares a fingerprint of the data across ranks with an `all_gather`. Most of the launch's
# time is starting the processes.

# %%
def fingerprint(data: torch.Tensor) -> torch.Tensor:
    """(3,) float64: [numel, sum, position-weighted sum]; equal data -> equal fingerprints."""
    flat = data.reshape(-1).to(torch.float64)
    return torch.stack([torch.tensor(float(flat.numel()), dtype=torch.float64), flat.sum(),
                        (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()])


def same_on_all_ranks(data: torch.Tensor) -> bool:
    """A collective: every rank gathers every rank's fingerprint and compares."""
    fp = fingerprint(data)
    gathered = [torch.empty_like(fp) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, fp)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def seed_worker(rank, world_size, base_seed, n_items):
    torch.manual_seed(base_seed + rank)
    out = {"own_data": torch.randn(n_items)}  # the seed's bug: a different dataset on each rank
    out["shared_data"] = torch.randn(n_items, generator=torch.Generator().manual_seed(base_seed))
    for name in ("own", "shared"):
        ds = TensorDataset(torch.arange(n_items), out[f"{name}_data"])
        sampler = DistributedSampler(ds, shuffle=False)  # num_replicas, rank: from the process group
        out[f"{name}_seen"] = [(int(i), float(v)) for i, v in DataLoader(ds, batch_size=1, sampler=sampler)]
        out[f"{name}_same"] = same_on_all_ranks(out[f"{name}_data"])
        print(f"{name:>6} data: (index, value) {[(i, round(v, 3)) for i, v in out[name + '_seen']]}", flush=True)
    return out


LIVE_N = 8  # the seed's dataset size
t0 = time.perf_counter()
results = launch(seed_worker, world_size, base_seed, LIVE_N, backend="gloo")
print(f"launch of {world_size} ranks took {time.perf_counter() - t0:.1f} s (mostly process start-up)")
live = sampler_assignment(LIVE_N, world_size, shuffle=False)  # what the real sampler predicts, asked here
expected = assignment_lists(live)
pd.DataFrame([{"rank": r, "batch": b, "index": i, "value (shared dataset)": v,
               "index (own dataset)": res["own_seen"][b][0], "value (rank's own dataset)": res["own_seen"][b][1]}
              for r, res in enumerate(results) for b, (i, v) in enumerate(res["shared_seen"])]).set_index(["rank", "batch"])

# %% [markdown]
# **Claim (the seed, live):** inside the workers each rank receives exactly the indices the
# sampler predicted in this process for `world_size` ranks (for `world_size = 4`: rank `r`
# gets items `r` and `r + 4`, as the seed prints), with either dataset; the sampler splits
# **indices**, it never looks at the data. With the shared dataset every rank holds the same
# data (`same_on_all_ranks` is True), the values each rank receives are the shared dataset's
# items at those indices, and over all ranks every item is seen (padded duplicates only if
# `world_size` does not divide 8).

# %%
shared = results[0]["shared_data"]
seen_all = []
for r, res in enumerate(results):
    shared_idx = [i for i, _ in res["shared_seen"]]
    assert shared_idx == expected[r], f"rank {r}: got indices {shared_idx}, the sampler predicted {expected[r]}"
    assert [i for i, _ in res["own_seen"]] == expected[r], f"rank {r}: the own-dataset indices should be the same"
    if world_size == 4:
        assert shared_idx == [r, r + 4], f"the seed: rank {r} should receive items [{r}, {r + 4}]"
    assert_close(res["shared_data"], shared, rtol=0, atol=0, msg=f"rank {r}'s shared dataset differs from rank 0's")
    assert_close(torch.tensor([v for _, v in res["shared_seen"]]), shared[shared_idx], rtol=0, atol=0,
                 msg=f"rank {r}: the values received should be the shared dataset's items {shared_idx}")
    assert res["shared_same"] is True, f"rank {r}: same_on_all_ranks should be True for the shared dataset"
    seen_all += shared_idx
assert set(seen_all) == set(range(LIVE_N)), f"every item should be seen at least once: {sorted(seen_all)}"
assert len(seen_all) - LIVE_N == math.ceil(LIVE_N / world_size) * world_size - LIVE_N, "duplicates should be exactly the padding"
print(f"shared dataset: indices per rank {expected}; every item seen; {len(seen_all) - LIVE_N} padded duplicate(s)")

# %% [markdown]
# **Claim (different data behind the same index):** with the seed's per-rank datasets, index
# `i` holds a **different** value on every rank, and `same_on_all_ranks` says False on every
# rank. The sampler still hands out the same indices, so the epoch trains on the items of
# `world_size` **different** datasets: of rank 0's dataset (seed `base_seed`, which is also
# the shared one), only the items rank 0 itself receives are ever used; every value another
# rank trains on belongs to no other rank's dataset. Nothing fails or warns: the split is
# simply not a split of *one* dataset any more. (With a random train/validation split made
# per rank, the same bug puts one rank's validation items into another rank's training data.)
# That is why every rank must build the same dataset (same files, or the same seed for
# anything random).

# %%
own = torch.stack([res["own_data"] for res in results])  # (world_size, 8): row r = rank r's own dataset
assert_close(own[0], shared, rtol=0, atol=0, msg="rank 0's own dataset (seed base_seed) should equal the shared one")
for r in range(1, world_size):
    assert bool((own[r] != own[0]).all()), f"rank {r}'s own dataset should differ from rank 0's at every index"
assert all(res["own_same"] is False for res in results), "same_on_all_ranks should be False on every rank for per-rank data"
rank0_values = set(own[0].tolist())
used_of_rank0 = {v for res in results for _, v in res["own_seen"] if v in rank0_values}
assert len(used_of_rank0) == len(expected[0]), (
    f"only rank 0's own {len(expected[0])} items of its dataset should be used, got {len(used_of_rank0)}")
for r in range(1, world_size):
    for i, v in results[r]["own_seen"]:
        assert v == own[r, i].item(), f"rank {r} should receive its own dataset's item {i}"
        assert all(v not in set(own[d].tolist()) for d in range(world_size) if d != r), (
            f"rank {r}'s item {i} should belong to no other rank's dataset")
print(f"per-rank datasets: {len(used_of_rank0)} of rank 0's {LIVE_N} items used; the epoch mixed "
      f"{world_size} different datasets; same_on_all_ranks = {[res['own_same'] for res in results]}")
pd.DataFrame(own.numpy(), index=[f"rank {r}" for r in range(world_size)],
             columns=[f"index {i}" for i in range(LIVE_N)]).round(3)

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 0.55 * world_size + 2.2), layout="constrained")
panels = (("each rank builds its own random dataset (the seed)", own),
          ("every rank builds the same dataset", torch.stack([res["shared_data"] for res in results])))
vmax = float(max(p.abs().max() for _, p in panels))
for ax, (title, values) in zip(axes, panels):
    im = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto")
    for r in range(world_size):
        for pos, i in enumerate(expected[r]):
            ax.add_patch(Rectangle((i - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="k", linewidth=2.5))
            ax.text(i, r, f"p{pos}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(LIVE_N))
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_xlabel("dataset index")
    ax.set_ylabel("rank")
    ax.set_title(title, fontsize=10)
fig.colorbar(im, ax=axes, label="item value held at that index")
fig.suptitle("Value behind each index on each rank; black boxes: what the sampler hands that rank (p = batch)")
plt.show()

# %% [markdown]
# ### 4.2 Evaluation with all-reduced counts
#
# Section 2's classifier and 10 items, evaluated on real ranks three ways. Each rank counts
# `correct` and `total` over the indices it evaluates, then **one all-reduce** (`SUM`) of the
# two counts gives every rank the global numbers. The model is evaluated as a plain module
# (in a DDP script: `ddp_model.module`, never the wrapper).

# %%
def eval_worker(rank, world_size, feats, labels):
    model = always_class_one()  # in a DDP script: ddp_model.module
    n = len(labels)
    shards = {"padded": list(DistributedSampler(range(n), shuffle=False)),
              "drop_last": list(DistributedSampler(range(n), shuffle=False, drop_last=True)),
              "unpadded": list(range(rank, n, world_size))}  # every item exactly once over the ranks
    out = {"seen": shards, "counts": {}}
    for name, idx in shards.items():
        with torch.no_grad():
            correct = int((model(feats[idx]).argmax(dim=1) == labels[idx]).sum()) if idx else 0
        counts = torch.tensor([correct, len(idx)], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # same global counts on every rank
        out["counts"][name] = tuple(counts.tolist())
        print(f"{name:>9}: my indices {idx}, all ranks: {out['counts'][name][0]}/{out['counts'][name][1]} correct", flush=True)
    return out


eval_results = launch(eval_worker, world_size, eval_feats, eval_labels, backend="gloo")

# %% [markdown]
# **Claim (evaluation, live):** with counts all-reduced over `world_size` ranks, the unpadded
# shards count every item once and give exactly what one forward over all 10 items gives in
# this process (5 right of 10), on every rank, whatever `world_size` is. Evaluating through the
# sampler gives whatever the padding or dropping predicts for `world_size` ranks (counted over
# the indices the real sampler hands out, asked in this process): for `world_size = 3`
# exactly section 2's 7/12 and 5/9 (the runner's `full` profile runs 3 ranks).

# %%
with torch.no_grad():
    one_forward = (int((clf(eval_feats).argmax(dim=1) == eval_labels).sum()), EVAL_N)  # no ranks, no shards
predicted = {"padded": sampler_assignment(EVAL_N, world_size), "drop_last": sampler_assignment(EVAL_N, world_size, drop_last=True)}
for r, res in enumerate(eval_results):
    assert res["counts"]["unpadded"] == one_forward, (
        f"rank {r}: unpadded + all-reduce counted {res['counts']['unpadded']}, one forward counts {one_forward}")
    assert res["seen"]["unpadded"] == list(range(EVAL_N))[r::world_size], f"rank {r}: wrong unpadded shard"
    for name, df in predicted.items():
        c, t = res["counts"][name]
        assert Fraction(c, t) == accuracy_through(df, right) and t == len(df), (
            f"rank {r}, {name}: {c}/{t} differs from the sampler's prediction {accuracy_through(df, right)} of {len(df)}")
        assert res["seen"][name] == assignment_lists(df)[r], f"rank {r}, {name}: evaluated the wrong indices"
if world_size == 3:
    assert Fraction(*eval_results[0]["counts"]["padded"]) == Fraction(7, 12), "3 ranks, padded: 7/12"
    assert Fraction(*eval_results[0]["counts"]["drop_last"]) == Fraction(5, 9), "3 ranks, drop_last: 5/9"
    print("world_size = 3: section 2's 7/12 and 5/9 reproduced on real ranks")
else:
    print(f"world_size = {world_size}: the 7/12 and 5/9 of 3 ranks are checked in the full profile (world_size = 3)")
pd.DataFrame([{"evaluation (live, all-reduced)": name, "correct": c, "counted": t, "accuracy": c / t,
               "rank 0's items": eval_results[0]["seen"][name]}
              for name, (c, t) in eval_results[0]["counts"].items()]).set_index("evaluation (live, all-reduced)")

# %% [markdown]
# ### 4.3 Gathered predictions come back in the sampler's order
#
# To keep every prediction (not just counts), ranks `all_gather` their outputs. Gathering
# needs equal-sized tensors on every rank, which the padded sampler provides, but the result
# is in the **sampler's** order: rank 0's items, then rank 1's, and so on. The fixed case: 5
# items, 2 ranks, `shuffle=False`; each item's "prediction" is a real forward of
# `Linear(1, 1)` (weight 10, bias 0.5) on the item's feature, so that values differ by item.

# %%
def gather_worker(rank, world_size, feats):
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(10.0)
        model.bias.fill_(0.5)
        idx = torch.tensor(list(DistributedSampler(range(len(feats)), shuffle=False)))  # padded: equal length
        preds = model(feats[idx]).squeeze(1)
    gathered_idx = [torch.empty_like(idx) for _ in range(world_size)]
    gathered_pred = [torch.empty_like(preds) for _ in range(world_size)]
    dist.all_gather(gathered_idx, idx)
    dist.all_gather(gathered_pred, preds)
    n = len(feats)
    return {"mine": idx.tolist(),
            "concatenated": torch.cat(gathered_idx)[:n].tolist(),  # wrong: the sampler's order
            "interleaved": torch.stack(gathered_idx, dim=1).reshape(-1)[:n].tolist(),  # rank r had items r, r+W, ...
            "interleaved_pred": torch.stack(gathered_pred, dim=1).reshape(-1)[:n]}


GATHER_N = 5
gather_feats = torch.arange(GATHER_N, dtype=torch.float32).unsqueeze(1)
gathered = launch(gather_worker, 2, gather_feats, backend="gloo")
pd.DataFrame([{"rank": r, "its items (padded)": g["mine"], "cat of gathered, first 5": g["concatenated"],
               "interleaved, padding dropped": g["interleaved"]} for r, g in enumerate(gathered)]).set_index("rank")

# %% [markdown]
# **Claim (gathering order):** rank 0 holds items `[0, 2, 4]` and rank 1 `[1, 3, 0]` (its last
# item is padding). Concatenating the gathered tensors and keeping the first 5 gives items
# `[0, 2, 4, 1, 3]`, not the dataset's order; interleaving (`torch.stack(gathered, dim=1)`
# then flatten: rank `r` held items `r, r + 2, ...`) and then dropping the padding gives
# `[0, 1, 2, 3, 4]`, and the interleaved predictions equal one forward of the same model over
# the 5 items in this process. (With `shuffle=True`, gather the indices too and sort by them.)

# %%
assert [g["mine"] for g in gathered] == [[0, 2, 4], [1, 3, 0]], [g["mine"] for g in gathered]
for r, g in enumerate(gathered):
    assert g["concatenated"] == [0, 2, 4, 1, 3], f"rank {r}: concatenation gave {g['concatenated']}"
    assert g["interleaved"] == list(range(GATHER_N)), f"rank {r}: interleaving gave {g['interleaved']}"
    reference = gather_feats.squeeze(1) * 10.0 + 0.5  # the same Linear(1, 1), written out, over items 0..4 in order
    assert_close(g["interleaved_pred"], reference, rtol=0, atol=0,
                 msg=f"rank {r}: the interleaved predictions should be items 0..4 in order")
print("concatenated:", gathered[0]["concatenated"], " interleaved:", gathered[0]["interleaved"])

# %% [markdown]
# ### 4.4 `set_epoch` on real ranks
#
# One `DistributedSampler(shuffle=True, seed=0)` per rank reused over `epochs` epochs, as a
# training loop does: once without `set_epoch`, once with `sampler.set_epoch(epoch)` at the
# start of each epoch.

# %%
def epoch_worker(rank, world_size, n_items, epochs):
    orders = {}
    for name, call_set_epoch in (("without set_epoch", False), ("with set_epoch", True)):
        sampler = DistributedSampler(range(n_items), shuffle=True, seed=0)
        orders[name] = []
        for epoch in range(epochs):
            if call_set_epoch:
                sampler.set_epoch(epoch)
            orders[name].append(list(sampler))
        print(f"{name:>17}: " + "  ".join(f"epoch {e}: {o}" for e, o in enumerate(orders[name])), flush=True)
    return orders


epoch_results = launch(epoch_worker, world_size, LIVE_N, epochs, backend="gloo")

# %% [markdown]
# **Claim (`set_epoch`, live):** each rank's shuffled orders in the workers are exactly what
# the real sampler predicts here for `world_size` ranks. Without `set_epoch`, every epoch
# repeats epoch 0 on every rank; with it, the global order changes from epoch to epoch; and
# when `world_size` divides 8, the ranks together cover all 8 items exactly once per epoch.

# %%
pred = {"without set_epoch": epoch_assignment(LIVE_N, world_size, epochs, call_set_epoch=False, seed=0),
        "with set_epoch": epoch_assignment(LIVE_N, world_size, epochs, call_set_epoch=True, seed=0)}
for name, df in pred.items():
    for e in range(epochs):
        want = orders(df, e)
        got = [res[name][e] for res in epoch_results]
        assert got == want, f"{name}, epoch {e}: workers got {got}, the sampler predicts {want}"
        if LIVE_N % world_size == 0:
            assert sorted(i for o in got for i in o) == list(range(LIVE_N)), f"{name}, epoch {e}: not exactly once"
for r, res in enumerate(epoch_results):
    assert all(o == res["without set_epoch"][0] for o in res["without set_epoch"]), (
        f"rank {r}: without set_epoch every epoch should repeat epoch 0")
with_orders = [[res["with set_epoch"][e] for res in epoch_results] for e in range(epochs)]
assert all(with_orders[e] != with_orders[0] for e in range(1, epochs)), "with set_epoch the order should change every epoch"
pd.DataFrame([{"set_epoch": name, "epoch": e, **{f"rank {r}": res[name][e] for r, res in enumerate(epoch_results)}}
              for name in pred for e in range(epochs)]).set_index(["set_epoch", "epoch"])

# %% [markdown]
# ## What we saw
#
# * `DistributedSampler` splits **indices**: rank `r` takes every `num_replicas`-th index
#   starting at `r` (8 items, 4 ranks: `[r, r + 4]`), after an optional shuffle that is the
#   same on every rank.
# * When `num_replicas` does not divide the dataset it **pads** with repeated items (10 items,
#   3 ranks: items 0 and 1 twice) so that every rank has the same number of batches and the
#   collectives stay in step; `drop_last=True` instead **drops** the tail (item 9 never seen).
# * Both skew evaluation: a model that is right on half the items scored 7/12 (padded) or 5/9
#   (`drop_last`). Unpadded shards plus one all-reduce of the correct and total counts gave
#   what a single forward over all items gives, on real ranks, for any `world_size`.
# * Gathered outputs come back in the sampler's order: interleave, then drop the padding.
# * Without `set_epoch` every epoch repeats the same order; with `set_epoch(epoch)` it changes,
#   and the ranks still cover every item exactly once per epoch.
# * The sampler assumes every rank holds the **same** dataset. Built per rank from different
#   seeds (the seed's bug), the same index means different data: the epoch silently mixes
#   `world_size` datasets and nothing warns you; comparing a fingerprint across ranks (an
#   `all_gather`) catches it.
#
# The casebook's [data page](10b_casebook_data.ipynb) runs what people report next: an
# `IterableDataset` under DDP, `shuffle=True` without the sampler, epoch state with persistent workers.
#
# ## Exercises
#
# Predict each answer by hand first, write it into `answer_N` (replacing `None`) and run the
# check cell below it: it prints "correct" or "not yet" with a hint. In the full notebook a solution follows each check, collapsed (click the "…" or the bar on its
# left to open it); student copies leave the solutions out. Every solution runs when the full
# notebook runs, so each is known to pass its check. Exercises 1–3 start no processes;
# exercise 4 runs your function on 3 real ranks.

# %% [markdown]
# ### Exercise 1: 11 items on 4 ranks
#
# A dataset of 11 items on 4 ranks, `DistributedSampler(shuffle=False)` with the default
# `drop_last=False`. How many items does the epoch hand out **twice**? Answer with a whole
# number.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% tags=["check"]
# expected: asked of the real sampler, in this process
seen_11 = times_seen(sampler_assignment(11, 4), 11)
expected_1 = int((seen_11 > 1).sum())
check_answer("ex1", answer_1, expected_1, hint="every rank must get the same number of items")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# Every rank gets ceil(11 / 4) = 3 items, 12 in all: the sampler pads 11 up to 12 by repeating
# its first item (index 0, which rank 3 gets as its last item). One item is seen twice.
solution_1 = math.ceil(11 / 4) * 4 - 11
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: the same with drop_last=True
#
# The same 11 items and 4 ranks with `drop_last=True`: how many items are **never** handed
# out in an epoch? Answer with a whole number.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% tags=["check"]
# expected: asked of the real sampler, in this process
seen_11_drop = times_seen(sampler_assignment(11, 4, drop_last=True), 11)
expected_2 = int((seen_11_drop == 0).sum())
check_answer("ex2", answer_2, expected_2, hint="the list is cut down to a multiple of 4")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# drop_last cuts the index list to the largest multiple of 4 that fits: 8 items, 2 per rank.
# Items 8, 9 and 10 are never seen.
solution_2 = 11 - (11 // 4) * 4
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: a different seed on every rank
#
# `DistributedSampler(shuffle=True)` uses `seed=0` on every rank unless told otherwise, so all
# ranks draw the same permutation. Suppose each rank passed `seed=rank` instead: 8 items,
# 2 ranks, epoch 0. How many of the 8 items are **never** seen in that epoch? Find out with
# `sampler_indices(8, 2, r, shuffle=True, seed=r)` for `r = 0, 1` (imported above), and
# answer with a whole number. Why can it not happen with a common seed?

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% tags=["check"]
# expected: asked of the real sampler, in this process
own_seed = [sampler_indices(8, 2, r, shuffle=True, seed=r) for r in range(2)]
expected_3 = 8 - len(set(own_seed[0]) | set(own_seed[1]))
check_answer("ex3", answer_3, expected_3, hint="look for an index that both ranks receive")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# From scratch, without the sampler: rank r shuffles with a generator seeded seed + epoch
# (here r + 0) and takes every 2nd index starting at r. Two different permutations: the
# two strided halves can overlap (an item seen twice) and leave items out (never seen).
halves = [torch.randperm(8, generator=torch.Generator().manual_seed(r)).tolist()[r::2] for r in range(2)]
print("rank 0:", halves[0], " rank 1:", halves[1])
solution_3 = len(set(range(8)) - set(halves[0]) - set(halves[1]))
# With one common seed both ranks slice the same permutation, and the strided slices of
# one permutation are disjoint and cover everything.
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# ### Exercise 4: count every item once while iterating the padded sampler
#
# Sometimes you cannot change the evaluation loop: it iterates a padded
# `DistributedSampler(shuffle=False)`. This function counts the padding too (10 items, 3
# ranks, the section 2 model: 7/12 instead of 5/10):
#
# ```python
# def padded_counts(rank, world_size, right):
#     correct = total = 0
#     for i in DistributedSampler(range(len(right)), shuffle=False):
#         correct, total = correct + int(right[i]), total + 1
#     counts = torch.tensor([correct, total])
#     dist.all_reduce(counts)
#     return counts.tolist()
# ```
#
# Write a fixed version that still iterates the sampler but skips the padded positions (hint:
# the `p`-th item rank `r` receives sits at position `p * world_size + r` of the padded list;
# which positions are padding?), and set `answer_4 = your_function` (the function itself,
# not a call). The check cell runs it on 3 real ranks with section 2's `right` and compares
# every rank's `[correct, total]` with one count over all items in this process (once you
# have answered).

# %% tags=["exercise"]
answer_4 = None  # your answer here

# %% tags=["check"]
# expected: every rank holds the count over all 10 items, once each (no sampler, no ranks)
expected_4 = [[sum(right), len(right)]] * 3
check_answer("ex4", answer_4, expected_4, run=lambda fn: launch(fn, 3, right, backend="gloo"),
             hint="position p * world_size + rank is padding when it is >= len(right)")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 4 (try the exercise first)
# The sampler pads the list to ceil(n / W) * W; the p-th index rank r receives sits at position
# p * W + r of that list, and the positions from n on are the padding: skip them.
def solution_4(rank, world_size, right):
    correct = total = 0
    for p, i in enumerate(DistributedSampler(range(len(right)), shuffle=False)):
        if p * world_size + rank < len(right):  # a real item, not padding
            correct, total = correct + int(right[i]), total + 1
    counts = torch.tensor([correct, total])
    dist.all_reduce(counts)
    return counts.tolist()


check_answer("ex4", solution_4, expected_4, run=lambda fn: launch(fn, 3, right, backend="gloo"), strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [04 MNIST: single, DP, DDP](04_mnist_single_dp_ddp.ipynb): train MNIST with DDP that follows the single-process loss curve.
# <!-- next:end -->
