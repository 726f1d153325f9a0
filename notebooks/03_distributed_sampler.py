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
# **The question:** under DDP every rank runs its own `DataLoader`. How does
# `torch.utils.data.DistributedSampler` decide which dataset items each rank gets, and when
# does that split mislead you (duplicated items, dropped items, the same order every epoch,
# different data behind the same index)?
#
# The seed: a dataset of 8 items on 4 processes with `DistributedSampler(shuffle=False)` and
# `batch_size=1`: process `r` receives items `r` and `r + 4`. Every claim below is followed by
# the code cell that checks it (`assert` / `torch.testing.assert_close`), so a wrong claim
# fails CI.
#
# **What runs where**
#
# | part | CPU only (CI) | with GPUs |
# |---|---|---|
# | sections 1–3: asking the real `DistributedSampler` (`helpers.sampler`), the fixed cases | this notebook's process, CPU; no process group needed (the sampler takes `num_replicas` and `rank` explicitly) | the same |
# | section 4: the sampler inside real DDP workers, `helpers.sampler.sampler_worker` via `helpers.launch.launch` | `world_size` processes, backend `gloo` | the same: data indices and counts are tiny, so this runs on CPU with `gloo` everywhere |
#
# **New here:** how `DistributedSampler` shards indices (padding, `drop_last`, `set_epoch`),
# why every rank must hold the *same* dataset, and a correct distributed evaluation
# (unpadded shards + all-reduced correct/total counts). Sections 1–3 use the fixed
# sizes whatever `world_size` is; section 4 uses `world_size`. Terms:
# [DistributedSampler](../docs/GLOSSARY.md#distributedsampler), [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [global batch size](../docs/GLOSSARY.md#global-batch-size); every term is defined (with its
# Chinese name) in the [glossary](../docs/GLOSSARY.md). Run time: about 12–27 s on
# 2 CPU cores, mostly the worker processes starting. The notebook ends with three exercises,
# each checked by a cell.

# %% tags=["parameters"]
# Parameters (papermill overrides them; these defaults are smoke-sized and also what a learner runs)
world_size = 4  # number of DDP ranks for section 4's live workers, at least 2; the seed uses 4
base_seed = 0  # section 4: the shared dataset uses base_seed, rank r's own dataset base_seed + r
epochs = 2  # section 4: epochs of the set_epoch demonstration, at least 2

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int), base_seed=(base_seed, int), epochs=(epochs, int))
check_value("world_size", world_size, world_size >= 2, "at least 2 (section 4 compares ranks)")
check_value("epochs", epochs, epochs >= 2, "at least 2 (section 4 compares two epochs)")

# %%
import math
import time
from fractions import Fraction

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.patches import Rectangle
from torch.testing import assert_close

from helpers.launch import launch
from helpers.sampler import (
    accuracy_through,
    assignment_lists,
    epoch_assignment,
    plot_assignment,
    sampler_assignment,
    sampler_indices,  # for the exercises
    sampler_worker,
    times_seen,
    unpadded_shard_indices,
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
# seed `seed + epoch` if `shuffle=True`), **pad** it with its own first items up to a multiple
# of `num_replicas` (or, with `drop_last=True`, cut it down to one), then rank `r` takes every
# `num_replicas`-th index starting at `r`.
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
assert {len(l) for l in lists_b} == {4}, f"every rank should get 4 batches: {[len(l) for l in lists_b]}"
print("10 items, 3 ranks, padded:", lists_b)
case_b.pivot(index="rank", columns="position", values="index")

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
# Take the 10 items and a model that is right on exactly items 0–4 (wrong on 5–9): its true
# accuracy is 5/10 = **0.5**.
#
# **Claim:** evaluated through the padded sampler (every rank counts what it is handed, the
# counts are summed over ranks) it scores **7/12**: items 0 and 1, both right, are counted
# twice. With `drop_last=True` it scores **5/9**: item 9, wrong, is never counted. A correct
# distributed evaluation gives **0.5**: each rank evaluates an **unpadded** shard
# (`helpers.sampler.unpadded_shard_indices`: `rank, rank + world_size, ...`), and the ranks
# all-reduce their `correct` and `total` counts (`helpers.sampler.distributed_eval_counts`,
# run for real in section 4). Here we add the counts of the three shards by hand.

# %%
EVAL_N, N_RIGHT = 10, 5
right = [i < N_RIGHT for i in range(EVAL_N)]  # the model is right on items 0-4 only
true_acc = Fraction(sum(right), EVAL_N)
shards = [unpadded_shard_indices(EVAL_N, r, 3) for r in range(3)]
assert sorted(i for s in shards for i in s) == list(range(EVAL_N)), f"unpadded shards must partition the items: {shards}"
def counts(indices):  # (number right, number counted) when exactly these indices are evaluated
    indices = list(indices)
    return sum(right[i] for i in indices), len(indices)


evals = {
    "true accuracy (all 10 items once)": counts(range(EVAL_N)),
    "padded sampler (default)": counts(case_b["index"]),
    "sampler with drop_last=True": counts(case_c["index"]),
    "unpadded shards + summed counts": counts(i for s in shards for i in s),
}
assert true_acc == Fraction(*evals["true accuracy (all 10 items once)"]) == Fraction(1, 2), "true accuracy should be 0.5"
assert Fraction(*evals["padded sampler (default)"]) == accuracy_through(case_b, right) == Fraction(7, 12), (
    f"padded: expected 7/12, got {evals['padded sampler (default)']}")
assert Fraction(*evals["sampler with drop_last=True"]) == accuracy_through(case_c, right) == Fraction(5, 9), (
    f"drop_last: expected 5/9, got {evals['sampler with drop_last=True']}")
assert Fraction(*evals["unpadded shards + summed counts"]) == Fraction(1, 2), "the correct distributed evaluation should give 0.5"
eval_table = pd.DataFrame([{"evaluation": k, "right": c, "counted": t, "accuracy": c / t,
                            "error vs true": c / t - float(true_acc)} for k, (c, t) in evals.items()])
eval_table.set_index("evaluation")

# %%
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
names = list(evals)
accs = [c / t for c, t in evals.values()]
bars = ax.barh(names, accs, color=["#555555", "#f28e2b", "#bbbbbb", "#4c72b0"])
ax.bar_label(bars, labels=[f"{c}/{t} = {c / t:.4f}" for c, t in evals.values()], padding=3)
ax.axvline(0.5, color="k", linestyle="--", linewidth=1, label="true accuracy 0.5")
ax.set_xlim(0, 0.75)
ax.invert_yaxis()
ax.set_xlabel("accuracy (fraction of counted items that are right)")
ax.set_ylabel("how it was measured")
ax.set_title("A model right on items 0-4 of 10, evaluated over 3 ranks")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
plt.show()

# %% [markdown]
# ## 3. `set_epoch`: a new shuffle every epoch, only if you ask
#
# With `shuffle=True` the sampler permutes the indices with a generator seeded
# `seed + epoch`, where `epoch` is whatever `set_epoch` last set: **0 if you never call it**.
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
# Now the same sampler inside a training-like script: `launch(sampler_worker, world_size, ...)`
# starts `world_size` processes with a `gloo` process group, and there
# `DistributedSampler(dataset, shuffle=False)` takes `num_replicas` and `rank` **from the
# process group**, as in any DDP script. Each rank (code in `helpers/sampler.py`):
#
# 1. builds the seed's 8-item dataset twice: once **per rank** (`torch.manual_seed(base_seed
#    + rank)`, as the seed does: index `i` then means different data on each rank), once
#    **shared** (seed `base_seed` on every rank), and iterates each with
#    `DataLoader(batch_size=1, sampler=DistributedSampler(...))`, printing every batch;
# 2. evaluates section 2's model and 10 items three ways, all with all-reduced counts: through
#    the padded sampler, through `drop_last=True`, and with `distributed_eval_counts`
#    (unpadded shards);
# 3. iterates one `DistributedSampler(shuffle=True, seed=0)` over `epochs` epochs without
#    `set_epoch`, and another one with it.
#
# Worker prints appear below prefixed `[rank r]`. With `world_size = 4` on a 2-core machine the
# launcher warns `OversubscriptionWarning` (four processes share two cores): the results are
# still exact; only timings would be meaningless, and we measure none. The next cell takes
# about 5–15 s on a 2-core laptop, mostly starting the processes.

# %%
LIVE_N = 8  # the seed's dataset size
t0 = time.perf_counter()
results = launch(sampler_worker, world_size, base_seed, n_items=LIVE_N, eval_items=EVAL_N, n_right=N_RIGHT,
                 epochs=epochs, shuffle_seed=0)
print(f"launch of {world_size} ranks took {time.perf_counter() - t0:.1f} s (mostly process start-up)")
assert [res["rank"] for res in results] == list(range(world_size)), "results must come back in rank order"
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
# data (`same_on_all_ranks`, an `all_gather` of a fingerprint, is True), the values each rank
# receives are the shared dataset's items at those indices, and over all ranks every item is
# seen (padded duplicates only if `world_size` does not divide 8).

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
assert len(seen_all) - LIVE_N == (-LIVE_N) % world_size, "duplicates should be exactly the padding"
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
# **Claim (evaluation, live):** in the workers, with counts all-reduced over `world_size`
# ranks, `distributed_eval_counts` (unpadded shards) gives 5 correct of 10 = **0.5** on every
# rank, whatever `world_size` is. Evaluating through the sampler gives whatever the padding or
# dropping predicts for `world_size` ranks (asked of the real sampler in this process): for
# `world_size = 3` exactly section 2's 7/12 and 5/9.

# %%
predicted = {"padded": sampler_assignment(EVAL_N, world_size), "drop_last": sampler_assignment(EVAL_N, world_size, drop_last=True)}
live_rows = []
for r, res in enumerate(results):
    c, t = res["eval"]["unpadded"]
    assert (c, t) == (N_RIGHT, EVAL_N) and Fraction(c, t) == Fraction(1, 2), (
        f"rank {r}: the correct distributed evaluation should count 5 of 10 (0.5), got {c}/{t}")
    assert res["eval_seen"]["unpadded"] == unpadded_shard_indices(EVAL_N, r, world_size), f"rank {r}: wrong unpadded shard"
    for name, df in predicted.items():
        c, t = res["eval"][name]
        assert Fraction(c, t) == accuracy_through(df, right) and t == len(df), (
            f"rank {r}, {name}: {c}/{t} differs from the sampler's prediction {accuracy_through(df, right)} of {len(df)}")
        assert res["eval_seen"][name] == assignment_lists(df)[r], f"rank {r}, {name}: evaluated the wrong indices"
if world_size == 3:
    assert Fraction(*results[0]["eval"]["padded"]) == Fraction(7, 12), "3 ranks, padded: 7/12"
    assert Fraction(*results[0]["eval"]["drop_last"]) == Fraction(5, 9), "3 ranks, drop_last: 5/9"
for name, (c, t) in results[0]["eval"].items():
    live_rows.append({"evaluation (live, all-reduced)": name, "correct": c, "counted": t, "accuracy": c / t,
                      "rank 0's items": results[0]["eval_seen"][name]})
pd.DataFrame(live_rows).set_index("evaluation (live, all-reduced)")

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
        got = [res["orders"][name][e] for res in results]
        assert got == want, f"{name}, epoch {e}: workers got {got}, the sampler predicts {want}"
        if LIVE_N % world_size == 0:
            assert sorted(i for o in got for i in o) == list(range(LIVE_N)), f"{name}, epoch {e}: not exactly once"
for res in results:
    assert all(o == res["orders"]["without set_epoch"][0] for o in res["orders"]["without set_epoch"]), (
        f"rank {res['rank']}: without set_epoch every epoch should repeat epoch 0")
with_orders = [[res["orders"]["with set_epoch"][e] for res in results] for e in range(epochs)]
assert all(with_orders[e] != with_orders[0] for e in range(1, epochs)), "with set_epoch the order should change every epoch"
pd.DataFrame([{"set_epoch": name, "epoch": e, **{f"rank {r}": res["orders"][name][e] for r, res in enumerate(results)}}
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
#   (`drop_last`). Unpadded shards plus an all-reduce of the correct and total counts
#   (`helpers.sampler.distributed_eval_counts`) gave the true 0.5, in real workers, for any
#   `world_size`.
# * Without `set_epoch` every epoch repeats the same order; with `set_epoch(epoch)` it changes,
#   and the ranks still cover every item exactly once per epoch.
# * The sampler assumes every rank holds the **same** dataset. Built per rank from different
#   seeds (the seed's bug), the same index means different data: the epoch silently mixes
#   `world_size` datasets and nothing warns you; `same_on_all_ranks` (an `all_gather` of a
#   fingerprint) catches it.
#
# ## Exercises
#
# Predict each answer by hand first, write it into `answer_N` (replacing `None`) and run the
# check cell below it: it prints "correct" or "not yet" with a hint. The solution is in the
# collapsed cell after the check (click the "…" or the bar on its left to open it). CI runs
# every solution, so they are known to be right. None of them starts new processes.

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
