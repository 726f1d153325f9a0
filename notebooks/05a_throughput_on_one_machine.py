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
# # 05a · Throughput on one machine: input pipeline, ranks and threads, memory
#
# <!-- opening:start -->
# **You will be able to** measure samples/s, the input pipeline, threads and memory per rank. **You need** [04 MNIST: single, DP, DDP](04_mnist_single_dp_ddp.ipynb).
# <!-- opening:end -->
#
# **The question:** learners come to DDP for speed. On this machine, how many MNIST samples per
# second does training really reach? Where does a step's time go before any communication is
# tuned: the input pipeline, the arithmetic, the threads, the other ranks?
#
# `helpers.bench` **measures** everything; it is the code of `python -m helpers.bench`, shown
# above each run. The load average and the spread are printed. **No cell asserts a timing.**
# Each claim, in bold, is asserted in the folded cell after it, on structure: equal accuracy,
# thread counts, bytes held.
#
# 1. the input pipeline · 2. scaling by world size and threads · 3. memory per rank
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | 1. input pipeline: seed recipe against in-memory tensors | 1 rank (plain module, and DDP) and 2 ranks (DDP), `gloo` | `nccl`, data on the GPU |
# | 2. scaling: single process, DP, DDP by `world_size` and threads | DDP on `gloo` (1, 2, 4 processes); `nn.DataParallel` has no devices and **cannot run in parallel** (it calls the module) | `nccl`, one GPU per rank; real DP over all GPUs |
# | 3. memory per rank | measured (RSS, USS, PSS) | same, host memory |
#
# **New here:** samples/s, speed-up and scaling efficiency of [DDP](../docs/GLOSSARY.md#ddp),
# and why [DP](../docs/GLOSSARY.md#dp) cannot help on CPU. Threads per
# [rank](../docs/GLOSSARY.md#rank), and oversubscription as the
# [world size](../docs/GLOSSARY.md#world-size) grows. RSS, USS and PSS. Every term is in the
# [glossary](../docs/GLOSSARY.md).
#
# The default `profile = "smoke"` runs small sizes and skips the measured memory comparison.
# `profile = "full"` runs everything and takes several times longer. Two exercises close the
# lesson, each checked by a cell.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
profile = "smoke"  # benchmark sizes from helpers.bench.PROFILES: "smoke" (small, the default) or "full"

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

seed = 0  # seeds initial weights and data order

check_parameters(profile=(profile, str))
check_value("profile", profile, profile in ("smoke", "full"), '"smoke" or "full" (helpers.bench.PROFILES)')

# %%
import inspect
import os
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Code, Markdown, display

from helpers import bench

T_START = time.perf_counter()
cfg = bench.profile_config(profile)  # a copy: edit cfg["scaling"]["configs"] etc. to explore
info = bench.machine_info()
CPUS = info["logical_cpus"]
N_GPUS = len(info["gpus"])
pd.set_option("display.float_format", "{:,.4g}".format)
pd.set_option("display.width", 160)
pd.set_option("display.max_colwidth", 120)

print(f"{info['cpu_model']}, {CPUS} logical CPUs, GPUs: {info['gpus'] or 'none'}; torch {info['torch']}")
print(f"profile = {profile!r}")
print(bench.load_line("start"))

# %% [markdown]
# ## 1. The input pipeline: the seed recipe against tensors in memory
#
# The seed recipe reads MNIST through `torchvision.datasets.MNIST` with
# `transforms.Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])`. So **every item** becomes a
# PIL image, then a tensor, then a normalised tensor. The `DataLoader` collates 64 of them, with
# `num_workers=0` and a `DistributedSampler`. That is Python work per image.
#
# The project's path, `helpers.data.load_mnist`, decodes the files once into one
# `(60000, 1, 28, 28) float32` tensor, normalised once. A batch is **one** `index_select` with the
# same sampler's indices.
#
# `bench.bench_pipeline` runs both in the same worker processes. Both train the same
# `Linear(784, 10)` from the same seed, with SGD at lr 0.01 and batch 64 per rank. Both make one
# pass over the same data in the **same order**, from the same `DistributedSampler`. The timer
# covers the epoch loop with its data loading, which is what differs. Then each measures the test
# accuracy.
#
# Several ranks wrap the model in DDP. **One** rank runs each pipeline twice. Once on the plain
# module, with nothing to all-reduce. Once in DDP with `world_size` 1, which still sends every
# gradient through the backend. The fast path feels that cost; the seed recipe hides it.
#
# Each mode is warmed up with an untimed pass over 1,024 images. The timed epochs then alternate:
# seed, memory, seed, memory. So a change in the machine's load falls on both. Samples/s is the
# median over the repeats, with its min–max. The smoke profile measures 1,024 images on 1 rank.
# `full` measures the whole epoch on 1 and 2 ranks, 3 repeats, and takes longer.
#
# **Claim:** the fast path learns the same model. Data, order and initial weights are the same;
# only the float rounding of the normalisation differs. The two test accuracies differ by at most
# 2 test images. Its speed is measured, not asserted.

# %%
display(Code(inspect.getsource(bench._pipeline_epoch), language="python"))  # each rank's timed epoch
c = cfg["pipeline"]
pipe = pd.DataFrame(bench.bench_pipeline(c["world_sizes"], c["n_train"] or None, c["n_test"] or None,
                                         threads=c["threads"], repeats=c["repeats"], seed=seed))
print(bench.load_line("after the pipeline benchmark"))
pipe[["pipeline", "wrapper", "world_size", "repeat", "threads_per_rank", "samples", "seconds", "samples_per_s",
      "speedup_vs_seed", "test_accuracy", "launch_seconds"]]

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the same test accuracy from both pipelines
for (ws, wrapper, rep), g in pipe.groupby(["world_size", "wrapper", "repeat"], sort=False):
    by = g.set_index("pipeline")
    gap = abs(by.loc["memory", "test_accuracy"] - by.loc["seed", "test_accuracy"]) * 100
    print(f"world_size {ws}, {'plain module' if wrapper == 'none' else 'DDP'}, repeat {rep}: test accuracy "
          f"{by.loc['seed', 'test_accuracy']:.4f} (seed) vs {by.loc['memory', 'test_accuracy']:.4f} (in-memory), "
          f"{gap:.2f} points apart")
    # the bound: 0 images apart in every run measured (smoke, and full epochs on 1 and 2 ranks with
    # seeds 0 to 3); 2 leaves room for the rounding to flip an image or two on another machine
    n_test = c["n_test"] or 10_000  # the test images each accuracy counts
    images_apart = round(gap / 100 * n_test)
    assert images_apart <= 2, f"world_size {ws}: accuracies differ by {images_apart} test images (> 2)"
for (ws, wrapper), g in pipe.groupby(["world_size", "wrapper"], sort=False):
    order = " ".join(g.sort_values("timed_position")["pipeline"])
    per_mode = g.groupby("pipeline")["samples_per_s"].agg(["median", "min", "max", "count"])
    sd, mem = per_mode.loc["seed"], per_mode.loc["memory"]
    apart = mem["min"] > sd["max"] or sd["min"] > mem["max"]
    print(f"world_size {ws}, {'plain module' if wrapper == 'none' else 'DDP'} (timed in the order: {order}): "
          f"seed median {sd['median']:,.0f} samples/s (min {sd['min']:,.0f}, max {sd['max']:,.0f}), in-memory "
          f"median {mem['median']:,.0f} (min {mem['min']:,.0f}, max {mem['max']:,.0f}) over {int(sd['count'])} "
          f"repeat(s): " + ("the ranges do not overlap in this run" if apart and sd["count"] > 1 else
                            "a single repeat has no spread: this run does not separate them" if sd["count"] < 2
                            else "the ranges overlap: the difference is within this run's spread"))

# %%
fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
groups = list(dict.fromkeys(zip(pipe["world_size"], pipe["wrapper"])))
width = 0.38
for k, (p, label) in enumerate([("seed", "seed recipe (ToTensor + Normalize per item)"),
                                 ("memory", "in-memory tensors (load_mnist)")]):
    per = [pipe[(pipe.pipeline == p) & (pipe.world_size == ws) & (pipe.wrapper == w)]["samples_per_s"]
           for ws, w in groups]
    vals = np.array([v.median() for v in per])
    spread = [vals - np.array([v.min() for v in per]), np.array([v.max() for v in per]) - vals]
    xs = [i + (k - 0.5) * width for i in range(len(groups))]
    ax.bar(xs, vals, width, label=label, yerr=spread, capsize=3, error_kw={"ecolor": "black", "lw": 1})
    for xi, v, top in zip(xs, vals, vals + spread[1]):  # the median's label above the error bar
        ax.annotate(f"{v:,.0f}", (xi, top), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
ax.set_xticks(range(len(groups)), [f"{ws} rank{'s' if ws > 1 else ''}, "
                                   f"{'plain module' if w == 'none' else 'DDP'}" for ws, w in groups])
ax.set_xlabel("world size and model wrapper (threads per rank: %d)" % cfg["pipeline"]["threads"])
ax.set_ylabel("training throughput (samples/s)")
ax.set_title(f"Input pipeline, one epoch of {int(pipe.samples.iloc[0]):,} images, Linear(784, 10)\n"
             f"bars: median of {pipe['repeat'].nunique()} repeat(s); error bars: min–max")
ax.margins(y=0.15)  # room for the bar labels
fig.legend(loc="outside lower center", ncol=2, fontsize=8)
plt.show()

# %% [markdown]
# ## 2. Scaling: samples/s by world size and threads per rank
#
# The **global batch** is the number of samples per optimizer step. For a fixed global batch, DDP
# with `n` ranks gives each rank `global_batch / n` samples. Two definitions hold everywhere
# below:
#
# * **speed-up** `S(n)` = samples/s with `n` ranks / samples/s with **1 rank and 1 thread**, for
#   the same model and global batch;
# * **scaling efficiency** = `S(n) / n`, where 1 is perfect. It is quoted for 1 thread per rank
#   only: a rank with more threads uses more cores, as the figure below shows.
#
# **Threads per rank.** PyTorch runs CPU operators on `torch.get_num_threads()` threads. You set
# them with `torch.set_num_threads` or `OMP_NUM_THREADS`; the next cell measures the default.
# Each rank is a separate process with its own thread pool, so `n` ranks × `t` threads want
# `n * t` cores. **Oversubscription** means more threads than cores. It is the classic trap:
# threads wait for each other at every parallel operator.
#
# How many threads a rank gets depends on **who started it**:
#
# * `torchrun` sets `OMP_NUM_THREADS=1` in every worker when the variable is unset and it starts
#   more than one process per node. It prints a warning saying so. So each rank runs 1 thread,
#   whatever the core count. The code is in torch/distributed/run.py;
# * `torch.multiprocessing.spawn` and torch's `elastic_launch` set nothing. `elastic_launch` is
#   the engine behind torchrun, called from Python. Every rank takes torch's default, so `n` ranks
#   run `n` times that many threads;
# * our `helpers.engine.launch` calls `torch.set_num_threads(cpu_count // world_size)` in every
#   rank, at least 1, unless `OMP_NUM_THREADS` is set. The ranks together then use every core
#   once. They neither oversubscribe, as spawn's default does, nor leave cores idle, as
#   torchrun's 1 does with fewer ranks than cores.
#
# Every launcher runs real processes here. The code below is a benchmark helper in a module,
# because `mp.spawn` and `torchrun` need importable code. The next cell starts five sets of fresh
# processes, so it takes a while, longer on a busy machine.
#
# **Claim:** say `OMP_NUM_THREADS` is unset and each launcher starts 2 ranks. Each rank then sees:
#
# | launcher | `OMP_NUM_THREADS` | torch threads |
# |---|---|---|
# | `torchrun --nproc-per-node 2` | `1`, and torchrun prints a warning | 1 |
# | `mp.spawn`, `elastic_launch` | unset | as many as a plain Python process |
# | `helpers.engine.launch` | unset | `cpu_count // 2` |

# %%
display(Code(inspect.getsource(bench.bench_threads_by_launcher), language="python"))
env_before = dict(os.environ)
th = bench.bench_threads_by_launcher(2)
threads_df = pd.DataFrame(th["rows"])
threads_df.assign(total_threads_of_the_2_ranks=threads_df.groupby("launcher")["torch_threads"].transform("sum"))

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: threads per rank under each launcher
# elastic_launch writes TORCHELASTIC_SIGNALS_TO_HANDLE into the caller's os.environ; the benchmark puts it back
assert dict(os.environ) == env_before, "bench_threads_by_launcher changed this kernel's environment"
default_threads = threads_df.loc[threads_df["launcher"] == "plain python", "torch_threads"].iloc[0]
by = {name: g for name, g in threads_df.groupby("launcher")}
assert list(by["torchrun"]["OMP_NUM_THREADS"]) == ["1", "1"] and list(by["torchrun"]["torch_threads"]) == [1, 1]
assert "OMP_NUM_THREADS environment variable for each process to be 1" in th["torchrun_stderr"], th["torchrun_stderr"]
for name in ("torch.multiprocessing.spawn", "elastic_launch"):
    assert by[name]["OMP_NUM_THREADS"].isna().all(), by[name]
    assert list(by[name]["torch_threads"]) == [default_threads] * 2, by[name]
assert by["helpers.engine.launch"]["OMP_NUM_THREADS"].isna().all()
assert list(by["helpers.engine.launch"]["torch_threads"]) == [max(1, th["cpu_count"] // 2)] * 2, by["helpers.engine.launch"]
print("torchrun printed:", next(line for line in th["torchrun_stderr"].splitlines() if "OMP_NUM_THREADS" in line)[:110])
print(f"a plain process here runs {default_threads} torch threads on {th['cpu_count']} logical CPUs; "
      f"2 ranks under mp.spawn or elastic_launch: {2 * default_threads} threads "
      f"({'OVERSUBSCRIBED' if 2 * default_threads > th['cpu_count'] else 'fits'})")

# %% [markdown]
# **Measured, side by side.** Every mode runs in **one** launch of as many ranks as the largest
# configuration. DDP with `n` ranks runs on ranks `0..n-1`, a process subgroup from
# `dist.new_group`; the others wait at a barrier. The single process and DP run on rank 0 alone.
#
# After a warm-up the modes are timed **in alternation**. Each round runs one block of `steps`
# steps of every mode in turn: A B C A B C, never all of A then all of B. So a change in the
# machine's load falls on every mode. `step_ms` is the slowest rank's **median** step, robust to
# bursts of other work. Its spread is `step_ms_min`–`step_ms_max`. Samples/s is global batch /
# `step_ms`. `bench.scaling_worker` sets `threads_per_rank` for each block, so every row says
# what it used.
#
# **Where the time goes.** Each DDP configuration is timed three ways:
#
# * normal steps;
# * the same steps inside `ddp.no_sync()` on all ranks, with no gradient all-reduce:
#   `nosync_step_ms`;
# * one rank's share on rank 0 **alone**, while the others wait: `solo_step_ms`.
#
# Then
#
# * `solo_step_ms` against the 1-rank step / `world_size`: what splitting the batch does to the
#   arithmetic itself. Smaller batches use caches differently;
# * `interference_ms = nosync - solo`: what the ranks cost each other by sharing cores, caches
#   and memory bandwidth;
# * `comm_exposed_ms = step - nosync`: the all-reduce, and the wait for the slowest rank, that
#   backward did not hide.
#
# Each term is a difference of two medians from alternating blocks. It means something only when
# it is not negative. A negative term says the timings moved more than the effect, so that row's
# split **failed**. The table, the printout and the figure flag such rows; nothing is clipped.
#
# **DP.** `nn.DataParallel` is one process that splits each batch over GPUs. Without GPUs it has
# no devices, `device_ids == []`, and its `forward` just calls the module. The code is in
# torch/nn/parallel/data_parallel.py. So on CPU it **cannot run anything in parallel**. Its rows
# do the single process's computation, as checked below. Their times are separate measurements,
# not expected to be equal.
#
# With the smoke profile the next cell trains the CNN at global batch 256 on 1 and 2 ranks. `full`
# adds the linear model, three batch sizes and up to 4 ranks, and takes much longer.

# %%
display(Code(inspect.getsource(bench.scaling_worker), language="python"))  # what every rank runs
c = cfg["scaling"]
scal = pd.DataFrame(bench.bench_scaling(c["configs"], c["models"], c["global_batch_sizes"], c["steps"],
                                        c["warmup"], c["rounds"], c["local"], seed))
print(bench.load_line("after the scaling benchmark"))
order = scal["timed_order"].iloc[0]
n_modes = len(order) // c["rounds"]
print(f"{c['rounds']} rounds of {n_modes} timed blocks ({c['steps']} steps each, after {c['warmup']} warm-up steps "
      f"per mode); round 0 ran: {', '.join(order[:n_modes])}")
assert order == order[:n_modes] * c["rounds"], "the timed blocks did not alternate between the modes"
for r in scal.sort_values(["model", "global_batch_size", "mode", "world_size", "threads_per_rank"]).itertuples():
    print(f"  {r.model}, batch {r.global_batch_size}, {r.label:9s}: median {r.samples_per_s:9,.0f} samples/s "
          f"(min {r.samples_per_s_min:,.0f}, max {r.samples_per_s_max:,.0f}); step median {r.step_ms:.1f} ms "
          f"(min {r.step_ms_min:.1f}, max {r.step_ms_max:.1f})")
parts = scal[["interference_ms", "comm_exposed_ms"]].astype(float)
scal["decomposition"] = np.where(parts.isna().all(axis=1), "", np.where((parts < 0).any(axis=1), "FAILED (negative term)", "ok"))
for r in scal[scal["decomposition"] != "ok"].itertuples():
    if r.decomposition:
        print(f"DECOMPOSITION FAILED: {r.model}, batch {r.global_batch_size}, {r.world_size} x {r.threads_per_rank}: "
              f"interference {r.interference_ms:+.2f} ms, all-reduce + waiting {r.comm_exposed_ms:+.2f} ms "
              f"(step spread {r.step_ms_min:.1f}-{r.step_ms_max:.1f} ms)")
cols = ["mode", "model", "global_batch_size", "world_size", "threads_per_rank", "oversubscribed", "step_ms",
        "step_ms_min", "step_ms_max", "solo_step_ms", "nosync_step_ms", "interference_ms", "comm_exposed_ms",
        "decomposition", "samples_per_s", "speedup", "efficiency"]
scal.sort_values(["model", "global_batch_size", "mode", "world_size", "threads_per_rank"])[cols]

# %% [markdown]
# **Claim (CPU):** on a CPU-only machine `nn.DataParallel` has `device_ids == []`. It computes
# exactly what the plain module computes: the same outputs and the same gradients, bit for bit.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: DP on CPU computes what the plain module computes
from helpers.notebook import cpu_claim

dp_rows = scal[scal["mode"] == "dp"]
if cpu_claim("on a CPU-only machine nn.DataParallel computes what the plain module computes"):
    assert all(ids == [] for ids in dp_rows["dp_device_ids"]), "DP on CPU should have no devices"
    plain_m = bench.build_bench_model("cnn", seed)
    dp_m = torch.nn.DataParallel(bench.build_bench_model("cnn", seed))
    xb, yb = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    for m in (plain_m, dp_m):
        torch.nn.functional.cross_entropy(m(xb), yb).backward()
    assert dp_m.device_ids == [] and torch.equal(dp_m(xb), plain_m(xb))
    for a, b in zip(plain_m.parameters(), dp_m.module.parameters()):
        assert torch.equal(a.grad, b.grad)
    print("DP on this CPU-only machine: device_ids == [], same outputs and gradients as the plain module. "
          "It CANNOT run in parallel here. Its measured times (table above) are separate measurements:")
    for r in scal[scal["mode"].isin(["single", "dp"])].sort_values(["model", "global_batch_size", "threads_per_rank"]).itertuples():
        print(f"  {r.mode:6s} {r.model}, batch {r.global_batch_size}, {r.threads_per_rank} thread(s): median "
              f"{r.step_ms:.1f} ms per step (min {r.step_ms_min:.1f}, max {r.step_ms_max:.1f})")
    for (model, gb, t), g in scal[scal["mode"].isin(["single", "dp"])].groupby(["model", "global_batch_size", "threads_per_rank"]):
        one, dp = g.set_index("mode").loc["single"], g.set_index("mode").loc["dp"]
        overlap = one.step_ms_min <= dp.step_ms_max and dp.step_ms_min <= one.step_ms_max
        print(f"  {model}, batch {gb}, {t} thread(s): DP median {dp.step_ms / one.step_ms:.2f}x the single process's "
              "step; " + ("the step ranges overlap: the difference is within this run's spread" if overlap
                          else "the step ranges do not overlap in this run"))


def speedup_range(model, gb, ws, threads=1):
    """Speed-up of DDP with ws ranks over 1 rank x 1 thread: (median, low, high) from the step spreads."""
    d = scal[(scal["mode"] == "ddp") & (scal["model"] == model) & (scal["global_batch_size"] == gb)]
    one = d[(d["world_size"] == 1) & (d["threads_per_rank"] == 1)]
    many = d[(d["world_size"] == ws) & (d["threads_per_rank"] == threads)]
    if one.empty or many.empty:
        return None
    one, many = one.iloc[0], many.iloc[0]
    return (one.step_ms / many.step_ms, one.step_ms_min / many.step_ms_max, one.step_ms_max / many.step_ms_min)


def verdict(lo, hi):
    return ("faster than 1 rank in every measured step" if lo > 1 else "slower than 1 rank in every measured step"
            if hi < 1 else "the step ranges overlap: the difference is within this run's spread")


for (model, gb), _ in scal[scal["mode"] == "ddp"].groupby(["model", "global_batch_size"]):
    for ws in sorted(scal["world_size"].unique()):
        got = speedup_range(model, gb, ws) if ws > 1 else None
        if got:
            print(f"{model}, global batch {gb}, {ws} ranks x 1 thread: speed-up {got[0]:.2f}x (medians; "
                  f"from the step spreads {got[1]:.2f}x to {got[2]:.2f}x): {verdict(got[1], got[2])}")

# %% [markdown]
# **Why the efficiency is quoted for 1 thread per rank only.** `S(n) / n` counts ranks, not
# cores. 2 ranks × 2 threads use 4 threads. Dividing their speed-up by 2 can give an "efficiency"
# above 1 that only means more cores, or more threads than cores. An efficiency above 1 with
# 1 thread per rank would mean each rank does better per sample than the whole 1-rank process.
# That is possible when a smaller per-rank batch fits the caches better. More often it is noise.
# The next cell says, for every such row, whether the step ranges put it above 1.
#
# **Claim:** every speed-up is against a baseline timed in the same launch and the same rounds.
# The 1-rank × 1-thread blocks ran in every round, in turn with the blocks of every other
# configuration. `efficiency` is reported only where the speed-up is over that baseline.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the baseline ran in every round
for (model, gb), g in scal.groupby(["model", "global_batch_size"]):
    order = g["timed_order"].iloc[0]
    rounds = [order[i * n_modes:(i + 1) * n_modes] for i in range(c["rounds"])]
    assert all("ddp 1x1" in r for r in rounds), f"{model}, batch {gb}: the baseline is missing from a round"
    for other in g["label"]:
        assert all(other in r for r in rounds), f"{model}, batch {gb}: {other} is missing from a round"
    assert g.loc[g["label"] == "ddp 1x1", "speedup"].iloc[0] == 1.0
print(f"the 1-rank x 1-thread baseline ran in each of the {c['rounds']} rounds, beside every configuration")
one_thread = scal[(scal["mode"] == "ddp") & (scal["threads_per_rank"] == 1) & (scal["world_size"] > 1)]
above = [(r, speedup_range(r.model, r.global_batch_size, r.world_size)) for r in one_thread.itertuples()
         if r.efficiency > 1]
for r, (_med, lo, hi) in above:
    print(f"{r.model}, batch {r.global_batch_size}, {r.world_size} ranks x 1 thread: efficiency {r.efficiency:.2f} "
          f"(from the step spreads {lo / r.world_size:.2f} to {hi / r.world_size:.2f}): "
          + ("above 1 in every step pair of this run" if lo > r.world_size else
             "within this run's spread of 1: noise, not a super-linear speed-up"))
if not above:
    print("no configuration with 1 thread per rank reached an efficiency above 1 in this run")

# %% [markdown]
# **Two views, two panels per model.** Left: the **speed-up** of DDP with 1 thread per rank over
# 1 rank × 1 thread. The dashed line is the ideal, `S(n) = n`. The dotted line marks the cores of
# this machine; past it, ranks share cores. Right: the throughput of every configuration at one
# global batch, the single process and DP included, as bars from zero. No efficiency is plotted:
# the speed-up against the ideal line shows the same ratio.

# %%
models = list(dict.fromkeys(scal["model"]))
gbs_all = sorted(scal["global_batch_size"].unique())
ws_all = sorted(scal["world_size"].unique())
mode_colors = {"ddp": "C0", "single": "C2", "dp": "C7"}
fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False, layout="constrained")
for row, model in enumerate(models):
    ax_s, ax_t = axes[row]
    d = scal[scal["model"] == model]
    for j, gb in enumerate(gbs_all):
        dd = d[(d["mode"] == "ddp") & (d["threads_per_rank"] == 1) & (d["global_batch_size"] == gb)]
        got = [(ws, speedup_range(model, gb, ws)) for ws in sorted(dd["world_size"])]
        got = [(ws, r) for ws, r in got if r]
        if not got:
            continue
        xs = np.array([ws for ws, _ in got])
        med, lo, hi = (np.array([r[k] for _, r in got]) for k in range(3))
        lo, hi = np.where(xs == 1, med, lo), np.where(xs == 1, med, hi)  # the baseline is 1 by definition
        xs = xs + 0.04 * (j - (len(gbs_all) - 1) / 2)  # side by side, so the error bars do not hide each other
        ax_s.errorbar(xs, med, yerr=[med - lo, hi - med], fmt="-o", color=f"C{j}", capsize=3,
                      label=f"global batch {gb}" if row == 0 else None)
    ax_s.plot(ws_all, ws_all, "--", color="gray", label="ideal: speed-up = world size" if row == 0 else None)
    ax_s.axvline(CPUS, color="black", ls=":", lw=1, label=f"{CPUS} cores on this machine" if row == 0 else None)
    ax_s.set_xticks(ws_all)
    ax_s.set_ylim(bottom=0)
    ax_s.set_xlabel("world size (DDP ranks, 1 thread each)")
    ax_s.set_ylabel("speed-up over 1 rank x 1 thread\n(ratio of samples/s)")
    ax_s.set_title(f"{model}: DDP speed-up (points: medians; bars: from the step spreads)", fontsize=10)
    gb = min(gbs_all, key=lambda g: abs(g - 256))
    dt = d[d["global_batch_size"] == gb].sort_values(["mode", "world_size", "threads_per_rank"])
    names = [(f"DDP, {r.world_size} rank{'s' if r.world_size > 1 else ''} x {r.threads_per_rank} thread"
              f"{'s' if r.threads_per_rank > 1 else ''}" if r.mode == "ddp" else
              f"{'single process' if r.mode == 'single' else 'DP (CPU: no parallelism)' if N_GPUS == 0 else 'DP'}, "
              f"{r.threads_per_rank} thread{'s' if r.threads_per_rank > 1 else ''}")
             + (" (oversubscribed)" if r.oversubscribed else "") for r in dt.itertuples()]
    y = np.arange(len(dt))
    ax_t.barh(y, dt["samples_per_s"], color=[mode_colors[m] for m in dt["mode"]],
              hatch=["//" if o else "" for o in dt["oversubscribed"]],
              xerr=[dt["samples_per_s"] - dt["samples_per_s_min"], dt["samples_per_s_max"] - dt["samples_per_s"]],
              capsize=3, error_kw={"ecolor": "black", "lw": 1})
    ax_t.set_yticks(y, names, fontsize=8)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("training throughput (samples/s, all ranks)")
    ax_t.set_ylabel("configuration")
    ax_t.set_title(f"{model}, global batch {gb}: every configuration\n(bars: median; error bars: min–max of the steps;"
                   " hatched: more threads than cores)", fontsize=10)
fig.legend(loc="outside lower center", ncol=5, fontsize=8)
plt.show()

# %% [markdown]
# ### Where the time goes in one step
#
# For each model at one global batch, the figure stacks the slowest rank's median step:
#
# * **one rank's share alone**, `solo_step_ms`: forward, backward, optimizer and batch indexing,
#   with the machine to itself;
# * **interference**: the same work with all ranks running at once, minus alone;
# * **all-reduce + waiting**: the synced step minus the `no_sync` step.
#
# The black tick is the ideal: the 1-rank step divided by the world size. A negative term is
# drawn hatched, below the level it starts from. Its bar is labelled "split failed": that row's
# decomposition did not hold in this run. The grey error bar on top is the synced step's spread,
# min to max.

# %%
ddp = scal[scal["mode"] == "ddp"].copy()
terms = {"C0": "one rank's share, alone", "C1": "interference: all ranks at once",
         "C2": "all-reduce + waiting for the slowest rank"}
fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False, layout="constrained")
for ax, model in zip(axes[0], models):
    d = ddp[ddp["model"] == model]
    gbs = sorted(d["global_batch_size"].unique())
    gb = min(gbs, key=lambda g: abs(g - 256))
    d = d[d["global_batch_size"] == gb].sort_values(["world_size", "threads_per_rank"])
    labels = [f"{w} x {t}" + (" (over)" if o else "") for w, t, o in
              zip(d["world_size"], d["threads_per_rank"], d["oversubscribed"])]
    # signed terms, never clipped: solo + interference + comm == step exactly
    step = d["step_ms"].to_numpy(dtype=float)
    solo = d["solo_step_ms"].fillna(d["nosync_step_ms"]).to_numpy(dtype=float)
    interference = d["nosync_step_ms"].to_numpy(dtype=float) - solo
    comm = step - solo - interference
    x = np.arange(len(d))
    for bottom, height, color in [(np.zeros_like(solo), solo, "C0"), (solo, interference, "C1"),
                                  (solo + interference, comm, "C2")]:
        neg = height < 0
        ax.bar(x[~neg], height[~neg], bottom=bottom[~neg], color=color)
        ax.bar(x[neg], height[neg], bottom=bottom[neg], color="white", edgecolor=color, hatch="//",
               label=None)
    ax.errorbar(x, step, yerr=[step - d["step_ms_min"].to_numpy(dtype=float), d["step_ms_max"].to_numpy(dtype=float) - step],
                fmt="none", ecolor="gray", capsize=3)
    tops = np.fmax(d["step_ms_max"].to_numpy(dtype=float), np.fmax(solo, solo + interference))
    for xi, top, failed in zip(x, tops, d["decomposition"] == "FAILED (negative term)"):
        if failed:
            ax.annotate("split failed:\nnegative term", (xi, top), xytext=(0, 4), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8, color="red")
    ax.margins(y=0.2)  # room for the labels
    base = d[(d["world_size"] == 1) & (d["threads_per_rank"] == 1)]["step_ms"]
    if len(base):
        ax.scatter(x, base.iloc[0] / d["world_size"].to_numpy(), marker="_", s=500, color="black",
                   label="ideal: 1-rank step / world size" if ax is axes[0][0] else None, zorder=3)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlabel("ranks x threads per rank")
    ax.set_ylabel("time per step (ms)")
    ax.set_title(f"{model}, global batch {gb}")
# legend patches drawn from the colours, not taken from the bars: a term negative in every column
# leaves an empty bar container, whose legend patch comes out in the wrong colour
fig.legend(loc="outside lower center", ncol=4, fontsize=7,
           handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in terms] + axes[0][0].get_legend_handles_labels()[0]
           + [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="gray", hatch="//")],
           labels=list(terms.values()) + axes[0][0].get_legend_handles_labels()[1] + ["negative term: the split failed"])
plt.show()

# %% [markdown]
# ## 3. Memory: every rank holds its own dataset
#
# Every DDP rank is a separate process, and each one above loaded MNIST for itself. There are
# three measures of a process's memory:
#
# * **RSS**, the resident set size, counts the pages of the process that are **resident** in RAM,
#   shared or not. Pages it mapped but never touched do not count, nor pages swapped out. Its
#   high-water mark `VmHWM` is the **peak RSS**;
# * **USS** counts only the resident pages no other process maps: what this rank costs on its own;
# * **PSS** divides shared pages among the processes that map them. Summed over the ranks, it is
#   the real total.
#
# **Claim:** RSS counts resident pages, not mapped ones. Mapping 64 MiB of anonymous memory grows
# this process's mapped size, `vms`, by at least 64 MiB, and its RSS by less than 8 MiB. Writing
# one byte in every page of it then grows the RSS by at least 56 MiB.

# %%
import mmap

import psutil

me = psutil.Process()
size = 64 * 2**20
before = me.memory_info()
region = mmap.mmap(-1, size)  # anonymous, private, not yet touched
mapped = me.memory_info()
pages = np.frombuffer(region, dtype=np.uint8)
pages[:: mmap.PAGESIZE] = 1  # one byte per page: every page becomes resident
touched = me.memory_info()
del pages
region.close()
vms_mapped, rss_mapped = (mapped.vms - before.vms) / 2**20, (mapped.rss - before.rss) / 2**20
rss_touched = (touched.rss - mapped.rss) / 2**20

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: RSS counts resident pages, not mapped ones
print(f"mapping 64 MiB: vms +{vms_mapped:.1f} MiB, rss +{rss_mapped:.1f} MiB; "
      f"touching every page: rss +{rss_touched:.1f} MiB")
assert vms_mapped >= 64 and rss_mapped < 8 and rss_touched >= 56, (vms_mapped, rss_mapped, rss_touched)

# %% [markdown]
# **Claim:** the `float32` training images alone are `60000 x 784 x 4` bytes = 179.4 MiB per rank.
# Each scaling rank held at least that much. In every rank, the storages of its training tensors,
# images plus `int64` labels, hold at least 179.4 MiB. Its RSS grew by at least 179.4 MiB while it
# loaded them; the parsed `uint8` file comes on top.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank held its own training tensors
mem_from_scaling = (ddp.groupby("world_size")[["peak_rss_mib_per_rank", "dataset_mib_per_rank"]].max()
                    .join(ddp.groupby("world_size")[["dataset_storage_mib_per_rank",
                                                     "dataset_rss_growth_mib_per_rank"]].min())
                    .assign(dataset_copies_mib=lambda d: d.index * d["dataset_mib_per_rank"],
                            sharing_would_save_mib=lambda d: (d.index - 1) * d["dataset_mib_per_rank"]))
display(Markdown("**From the scaling runs** (every rank loaded the training set; MiB):"))
display(mem_from_scaling)
images_mib = 60000 * 784 * 4 / 2**20
assert round(images_mib, 1) == 179.4
assert np.isclose(images_mib, ddp["dataset_mib_per_rank"].iloc[0] - 60000 * 8 / 2**20)  # the shapes loaded
held = mem_from_scaling[["dataset_storage_mib_per_rank", "dataset_rss_growth_mib_per_rank"]]
assert (held >= images_mib).all().all(), mem_from_scaling
print(f"every rank: training tensors' storages {held.iloc[:, 0].min():.1f} MiB, RSS grew by at least "
      f"{held.iloc[:, 1].min():.1f} MiB while loading them (the images alone: {images_mib:.1f} MiB)")

# %% [markdown]
# Sharing one copy would save `world_size - 1` copies. `bench.bench_memory` measures it. The
# `private` variant is the project's path. The `mmap` variant maps the raw `uint8` IDX file
# read-only, with `numpy.memmap` in copy-on-write mode. So all ranks use the same page-cache
# pages, and convert each batch to normalised `float32` when they use it. The smoke profile skips
# the measured comparison; `full` launches 1, 2 and 4 ranks for each variant.

# %%
c = cfg["memory"]
if c["world_sizes"]:
    mem = pd.DataFrame(bench.bench_memory(c["world_sizes"], c["variants"], c["steps"]))
    summary = mem.groupby(["world_size", "variant"]).agg(
        ranks=("rank", "count"), peak_rss_mib_per_rank=("peak_rss_mib", "max"),
        uss_mib_per_rank=("uss_mib", "max"), sum_uss_mib=("uss_mib", "sum"), sum_pss_mib=("pss_mib", "sum"),
        dataset_mib_per_rank=("dataset_mib", "max"))
    display(Markdown("**Measured, private copies against one shared map** (MiB):"))
    display(summary)
    for ws in sorted(mem["world_size"].unique()):
        s = summary.loc[ws]
        if {"private", "mmap"} <= set(s.index):
            print(f"world_size {ws}: sharing saved {s.loc['private', 'sum_pss_mib'] - s.loc['mmap', 'sum_pss_mib']:,.0f} MiB "
                  f"in total (sum of PSS), {s.loc['private', 'uss_mib_per_rank'] - s.loc['mmap', 'uss_mib_per_rank']:,.0f} MiB "
                  "of private memory per rank")
else:
    print("SKIPPED the measured comparison: cfg['memory']['world_sizes'] is empty in this profile.")

# %% [markdown]
# ## Summary of this run

# %%
summary = []
for (ws, w), g in pipe.groupby(["world_size", "wrapper"], sort=False):
    m = g[g.pipeline == "memory"]
    summary.append({"measure": f"input pipeline, {ws} rank(s), {'plain module' if w == 'none' else 'DDP'}: "
                               "in-memory / seed samples/s (median, min–max over repeats)",
                    "value": f"{m['speedup_vs_seed'].median():.1f}x ({m['speedup_vs_seed'].min():.1f}x to "
                             f"{m['speedup_vs_seed'].max():.1f}x; {g[g.pipeline == 'seed']['samples_per_s'].median():,.0f}"
                             f" -> {m['samples_per_s'].median():,.0f} samples/s)"})
key = ddp[(ddp["threads_per_rank"] == 1) & (ddp["world_size"] > 1) & (ddp["global_batch_size"] == 256)]
for r in key.itertuples():
    got = speedup_range(r.model, r.global_batch_size, r.world_size)
    if got:
        summary.append({"measure": f"{r.model}, global batch {r.global_batch_size}, {r.world_size} ranks x 1 thread: "
                                   "speed-up over 1 rank x 1 thread (medians; from the spreads)",
                        "value": f"{got[0]:.2f}x ({got[1]:.2f}x to {got[2]:.2f}x): {verdict(got[1], got[2])}"})
summary.append({"measure": "training tensors held by each rank (smallest over the ranks)",
                "value": f"{held.iloc[:, 0].min():.1f} MiB"})
summary.append({"measure": "load average at the end", "value": bench.load_line("end").split(": ", 1)[1]})
summary.append({"measure": "this lesson's run time", "value": f"{time.perf_counter() - T_START:.0f} s"})
pd.DataFrame(summary).set_index("measure")

# %% [markdown]
# ## What we saw
#
# * **The input pipeline can dominate.** The seed recipe turns every image into a PIL image and
#   back. Tensors already in memory skip that per-item work. They reach the same test accuracy,
#   within 2 test images. Make one process fast before adding processes.
# * **Processes are not free cores.** torchrun sets `OMP_NUM_THREADS=1`. `mp.spawn` and
#   `elastic_launch` leave torch's default, so ranks × threads can exceed the cores. Our `launch`
#   divides the cores among the ranks.
# * **What 2 ranks bought over 1 is measured.** The printout gives it with its spread, and where
#   the step went: alone, interference, all-reduce and waiting.
# * **On CPU, DP does nothing in parallel.** It has `device_ids == []` and calls the module.
# * **Each rank holds its own dataset.** RSS counts resident pages. One shared read-only map saves
#   `world_size - 1` copies.
#
# ## Exercises
#
# Two short calculations with this lesson's results. Write your answer in the `answer_N = None`
# cell and run the cell below it. It says whether the answer is right and never stops the lesson.
# In the full lesson the solution, collapsed, is the cell after; student copies leave the
# solutions out.

# %% [markdown]
# ### Exercise 1: scaling efficiency from two throughputs
#
# In section 2's table, find the two DDP rows of the CNN at global batch 256 with
# **1 thread per rank**: 1 rank and 2 ranks. From their `samples_per_s` alone, what is the scaling
# efficiency of 2 ranks? It is the speed-up over the number of ranks. Answer with a fraction such
# as `0.8`. Your numbers are this run's; 1% either way counts as right.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 1
# expected: the efficiency helpers.bench computed for that row in this run
rows = scal[(scal["mode"] == "ddp") & (scal["model"] == "cnn") & (scal["global_batch_size"] == 256)
            & (scal["threads_per_rank"] == 1)].set_index("world_size")
expected_1 = float(rows.loc[2, "efficiency"])
print(f"this run: 1 rank {rows.loc[1, 'samples_per_s']:,.1f} samples/s, 2 ranks {rows.loc[2, 'samples_per_s']:,.1f} samples/s")
check_answer("ex1", answer_1, expected_1, rel_tol=0.01,
             hint="speed-up = samples/s with 2 ranks / samples/s with 1 rank; then divide by 2")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# samples/s = global batch / step time, so the speed-up is the ratio of the step times
# (1-rank step / 2-rank step), and the efficiency is that over 2.
d = scal[(scal["mode"] == "ddp") & (scal["model"] == "cnn") & (scal["global_batch_size"] == 256)
         & (scal["threads_per_rank"] == 1)].set_index("world_size")["step_ms"]
solution_1 = d.loc[1] / d.loc[2] / 2
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: what one shared copy would save
#
# Section 3 showed that every rank holds its own `float32` training images, `60000 x 784 x 4`
# bytes. Take **4** ranks on one machine. How many MiB of 2**20 bytes would one shared read-only
# copy save, against every rank holding its own? Answer with a number.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 2
# expected: section 3's size of the images, times the copies sharing saves
expected_2 = (4 - 1) * images_mib
check_answer("ex2", answer_2, expected_2, rel_tol=1e-3,
             hint="4 ranks hold 4 copies, a shared map holds 1: sharing saves world_size - 1 copies")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# One copy is 60000 x 784 x 4 bytes = 179.4 MiB; 4 ranks hold 4 copies, one shared map 1:
# 3 copies saved, 538.2 MiB.
solution_2 = (4 - 1) * 60000 * 784 * 4 / 2**20
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [05b communication and cost model](05b_communication_and_cost_model.ipynb): measure all-reduce bandwidth and buckets, and predict a cluster with a cost model.
# <!-- next:end -->
