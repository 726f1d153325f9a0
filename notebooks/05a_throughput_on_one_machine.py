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
# # 05 · Where the time goes
#
# <!-- run-time:start -->
# **Run time** (measured): 5 min in the `full` profile on Linux x86_64, 2 CPU cores, no GPU (2026-12-03). **Reading time** (estimate: about 4,500 words of prose at 200 words/min): about 22 min.
# <!-- run-time:end -->
#
# **The question:** learners come to DDP for speed. On this machine, how many MNIST samples
# per second does training really reach, where does each step's time go (input pipeline,
# compute, threads, gradient all-reduce, process start-up), and what does the same arithmetic
# predict for a cluster?
#
# Everything here is **measured** in this notebook, by `helpers.bench` (the same code as the
# command line `python -m helpers.bench`), and explained with a model: the alpha-beta cost
# of a ring all-reduce. Timings depend on the machine and on whatever else runs on it, so the
# notebook prints the load average next to them, and **no cell asserts a timing**; the
# assertions check structure (bucket layouts, bytes on the wire, thread counts, equal
# accuracy). Times are printed with their spread, and the prose draws no conclusion from them.
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | 1. input pipeline: seed recipe against in-memory tensors | 1 rank (plain module, and DDP) and 2 ranks (DDP), `gloo` | `nccl`, data on the GPU |
# | 2. scaling: single process, DP, DDP by `world_size` and threads | DDP on `gloo` (1, 2, 4 processes); `nn.DataParallel` has no devices and **cannot run in parallel** (it calls the module) | `nccl`, one GPU per rank; real DP over all GPUs |
# | 3. memory per rank | measured (RSS, USS, PSS) | same, host memory |
# | 4. all-reduce bandwidth | `gloo` over loopback, against memory copy | `nccl` |
# | 5. DDP buckets, profiler timeline | `gloo` threads | `nccl` kernels |
# | 6. cost model, cluster prediction | arithmetic | arithmetic |
# | 7. launch overhead | `helpers.engine.launch` against `torch.multiprocessing.spawn` | same |
#
# **New here:** samples/s, speed-up and scaling efficiency of [DDP](../docs/GLOSSARY.md#ddp)
# (and why [DP](../docs/GLOSSARY.md#dp) cannot help on CPU); threads per
# [rank](../docs/GLOSSARY.md#rank) and oversubscription as the
# [world size](../docs/GLOSSARY.md#world-size) grows; the cost of an
# [all-reduce](../docs/GLOSSARY.md#all-reduce) and its two bandwidths
# [`algbw` and `busbw`](../docs/GLOSSARY.md#algbw-busbw); `bucket_cap_mb` (DDP's gradient
# [buckets](../docs/GLOSSARY.md#bucket)), `gradient_as_bucket_view` and DDP communication
# hooks; `torch.profiler`; the alpha-beta model. Every term is defined (with its Chinese name)
# in the [glossary](../docs/GLOSSARY.md). The default `profile = "smoke"` runs small sizes and
# skips the measured memory comparison and the launcher timings; `profile = "full"` runs them
# and takes several times longer. Each benchmark's worker code (it stays in the `helpers/bench/` package,
# the same code as `python -m helpers.bench`) is shown above its run. The notebook ends with four exercises, each checked by a cell; the last one asks for a
# communication hook, run on real ranks.

# %% tags=["parameters"]
# Parameters: what you run by default, top to bottom in JupyterLab (the smoke profile); the full profile overrides some (docs/RUNNER.md)
profile = "smoke"  # benchmark sizes from helpers.bench.PROFILES: "smoke" (small, the default) or "full"
seed = 0  # seeds initial weights and data order
cluster_params_million = 25.6  # model of the cluster prediction (ResNet-50 has 25.6 M parameters)
cluster_link_gbit_s = 100.0  # network bandwidth per GPU in Gb/s (100 Gb/s is 12.5 GB/s)
cluster_alpha_us = 10.0  # ASSUMED latency per ring step in microseconds
cluster_compute_ms = 100.0  # ASSUMED forward+backward+optimizer time of one step on one GPU in ms

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(profile=(profile, str), seed=(seed, int), cluster_params_million=(cluster_params_million, float),
                 cluster_link_gbit_s=(cluster_link_gbit_s, float), cluster_alpha_us=(cluster_alpha_us, float),
                 cluster_compute_ms=(cluster_compute_ms, float))
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

from helpers import bench, costmodel

T_START = time.perf_counter()
cfg = bench.profile_config(profile)  # a copy: edit cfg["scaling"]["configs"] etc. to explore
info = bench.machine_info()
CPUS = info["logical_cpus"]
N_GPUS = len(info["gpus"])
pd.set_option("display.float_format", "{:,.4g}".format)
pd.set_option("display.width", 160)
pd.set_option("display.max_colwidth", 120)

def load_line(when):
    l1, l5, _ = os.getloadavg()
    busy = "  <-- BUSY: other processes compete for the cores, timings are distorted" if l1 > 0.75 * CPUS else ""
    return f"load average ({when}): {l1:.2f} (1 min), {l5:.2f} (5 min) on {CPUS} cores{busy}"

print(f"{info['cpu_model']}, {CPUS} logical CPUs, GPUs: {info['gpus'] or 'none'}; torch {info['torch']}")
print(f"profile = {profile!r}")
print(load_line("start"))

# %% [markdown]
# ## 1. The input pipeline: the seed recipe against tensors in memory
#
# The seed recipe reads MNIST through `torchvision.datasets.MNIST` with
# `transforms.Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])`: **every item** becomes a
# PIL image, then a tensor, then a normalised tensor, and the `DataLoader` (batch 64,
# `num_workers=0`, a `DistributedSampler`) collates 64 of them. That is Python work per image.
#
# The project's path (`helpers.data.load_mnist`) decodes the files once into one
# `(60000, 1, 28, 28) float32` tensor, normalised once; a batch is **one** `index_select`
# with the same sampler's indices.
#
# `bench.bench_pipeline` runs both, one after the other, in the same worker processes: the
# same `Linear(784, 10)` from the same seed, SGD with lr 0.01, batch 64 per rank, one pass over
# the same data in the **same order** (the same `DistributedSampler`), timing the epoch loop
# (data loading included: that is what differs), then measuring test accuracy. With several
# ranks the model is wrapped in DDP. With **one** rank both pipelines run twice: on the plain
# module (what a single process trains; there is nothing to all-reduce) and wrapped in DDP with
# `world_size` 1, which still sends every gradient through the backend and back (a cost the
# fast path feels and the seed recipe hides).
#
# Each mode (wrapper and pipeline) is warmed up first with an untimed pass over its first 1,024
# images; then the timed epochs alternate between the pipelines, repeat after repeat (seed,
# memory, seed, memory, ...), so a change in the machine's load during the run falls on both.
# Each mode's samples/s is reported as the median over the repeats with its min–max.
#
# **Claim:** the fast path learns the same model: test accuracies agree within 0.5 points
# (same data, order and initial weights; only float rounding of the normalisation differs).
# Its speed is measured, not asserted. The smoke profile measures 2,048 images on 1 rank;
# `full` the whole epoch on 1 and 2 ranks, 3 repeats (longer).

# %%
display(Code(inspect.getsource(bench._pipeline_epoch), language="python"))  # each rank's timed epoch
c = cfg["pipeline"]
pipe = pd.DataFrame(bench.bench_pipeline(c["world_sizes"], c["n_train"] or None, c["n_test"] or None,
                                         threads=c["threads"], repeats=c["repeats"], seed=seed))
print(load_line("after the pipeline benchmark"))
pipe[["pipeline", "wrapper", "world_size", "repeat", "threads_per_rank", "samples", "seconds", "samples_per_s",
      "speedup_vs_seed", "test_accuracy", "launch_seconds"]]

# %%
for (ws, wrapper, rep), g in pipe.groupby(["world_size", "wrapper", "repeat"], sort=False):
    by = g.set_index("pipeline")
    gap = abs(by.loc["memory", "test_accuracy"] - by.loc["seed", "test_accuracy"]) * 100
    print(f"world_size {ws}, {'plain module' if wrapper == 'none' else 'DDP'}, repeat {rep}: test accuracy "
          f"{by.loc['seed', 'test_accuracy']:.4f} (seed) vs {by.loc['memory', 'test_accuracy']:.4f} (in-memory), "
          f"{gap:.2f} points apart")
    assert gap <= 0.5, f"world_size {ws}: accuracies differ by {gap:.2f} points (> 0.5)"
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
# For a fixed **global batch** (samples per optimizer step), DDP with `n` ranks gives each rank
# `global_batch / n` samples. Definitions used everywhere below:
#
# * **speed-up** `S(n)` = samples/s with `n` ranks / samples/s with **1 rank and 1 thread**
#   (same model, same global batch);
# * **scaling efficiency** = `S(n) / n` (1 is perfect), quoted for 1 thread per rank only (a
#   rank with more threads uses more cores; see the figure below).
#
# **Threads per rank.** PyTorch runs CPU operators on `torch.get_num_threads()` threads (set by
# `torch.set_num_threads` or `OMP_NUM_THREADS`; the default is measured in the next cell). Each
# rank is a separate process with its own thread pool, so `n` ranks × `t` threads want `n * t`
# cores. **Oversubscription** (more threads than cores, the classic trap) makes threads wait for
# each other at every parallel operator. How many threads a rank gets depends on **who started
# it**:
#
# * `torchrun` (its command line, `torch/distributed/run.py`) sets `OMP_NUM_THREADS=1` in every
#   worker when it starts more than one process per node and the variable is unset, and prints
#   a warning saying so: 1 thread per rank, whatever the core count;
# * `torch.multiprocessing.spawn` and torch's `elastic_launch` (the engine behind torchrun,
#   called from Python) set nothing: every rank takes torch's default, so `n` ranks run `n`
#   times that many threads;
# * our `helpers.engine.launch` calls `torch.set_num_threads(cpu_count // world_size)` in every rank
#   (at least 1) unless `OMP_NUM_THREADS` is set. Why: the ranks together then use every core
#   once, neither oversubscribed (spawn's default) nor leaving cores idle when there are fewer
#   ranks than cores (torchrun's 1).
#
# **Claim:** with `OMP_NUM_THREADS` unset, 2 ranks started by `torchrun --nproc-per-node 2`
# see `OMP_NUM_THREADS=1` and run 1 torch thread each (and torchrun prints the warning); under
# `mp.spawn` and `elastic_launch` they see no `OMP_NUM_THREADS` and run as many threads as a
# plain Python process; under `helpers.engine.launch` they run `cpu_count // 2` threads each. Every
# launcher runs real processes here; this is the code (a benchmark helper, in a module because
# `mp.spawn` and `torchrun` need importable code). The next cell starts five sets of fresh
# processes, so it takes a while (longer on a busy machine).

# %%
display(Code(inspect.getsource(bench.bench_threads_by_launcher), language="python"))
env_before = dict(os.environ)
th = bench.bench_threads_by_launcher(2)
# elastic_launch writes TORCHELASTIC_SIGNALS_TO_HANDLE into the caller's os.environ; the benchmark puts it back
assert dict(os.environ) == env_before, "bench_threads_by_launcher changed this kernel's environment"
threads_df = pd.DataFrame(th["rows"])
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
threads_df.assign(total_threads_of_the_2_ranks=threads_df.groupby("launcher")["torch_threads"].transform("sum"))

# %% [markdown]
# **Measured, side by side.** Every mode runs in **one** launch of as many ranks as the largest
# configuration: DDP with `n` ranks runs on ranks `0..n-1` (a process subgroup,
# `dist.new_group`) while the others wait at a barrier; the single process and DP run on rank 0
# alone. Each mode is warmed up first; then the modes are timed **in alternation**: round 0
# runs one block of `steps` steps of every mode in turn, round 1 the same, and so on (A B C A B
# C ..., never all of A then all of B), so a change in the machine's load during the run falls
# on every mode instead of on whichever ran last. Every step is timed; `step_ms` is the slowest
# rank's **median** step (robust to bursts of other work on the machine), with its spread
# (`step_ms_min`–`step_ms_max`, the fastest and slowest step), and samples/s = global batch /
# `step_ms` (min–max from the step spread). `bench.scaling_worker` sets `threads_per_rank`
# explicitly for each block, so every row says what it used.
#
# **Where the time goes.** Each DDP configuration is timed three ways: normal steps; the same
# steps inside `ddp.no_sync()` on all ranks at once (forward and backward without the gradient
# all-reduce: `nosync_step_ms`); and one rank's share of the work on rank 0 **alone** while the
# others wait (`solo_step_ms`). Then
#
# * `solo_step_ms` against the 1-rank step / `world_size`: what splitting the batch does to
#   the arithmetic itself (smaller batches use caches differently);
# * `interference_ms = nosync - solo`: what the ranks cost each other by running at the same
#   time on shared cores, caches and memory bandwidth;
# * `comm_exposed_ms = step - nosync`: the all-reduce, and waiting for the slowest rank, that
#   backward did not hide.
#
# Each term is a difference of two medians measured in alternating blocks. The decomposition
# only means something when every term is non-negative: a negative term says the timings moved
# more between measurements than the effect being measured, so that row's split **failed**. The
# table, the printout and the figure flag such rows; nothing is clipped to zero.
#
# **DP.** `nn.DataParallel` is one process that splits each batch over GPUs. Without GPUs it has
# no devices (`device_ids == []`) and just calls the module (`torch/nn/parallel/data_parallel.py`,
# `forward`): on CPU it **cannot run anything in parallel**. Its rows do the same computation as
# the single process (checked below); their times are separate measurements (alternating
# blocks on a shared machine), and are not expected to be equal.
#
# With the smoke profile the next cell trains the CNN at global batch 256 on 1 and 2 ranks;
# `full` adds the linear model, three batch sizes and up to 4 ranks, and takes much longer.

# %%
display(Code(inspect.getsource(bench.scaling_worker), language="python"))  # what every rank runs
c = cfg["scaling"]
scal = pd.DataFrame(bench.bench_scaling(c["configs"], c["models"], c["global_batch_sizes"], c["steps"],
                                        c["warmup"], c["rounds"], c["local"], seed))
print(load_line("after the scaling benchmark"))
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
# **Claim:** on a CPU-only machine `nn.DataParallel` has `device_ids == []` and computes exactly
# what the plain module computes: the same outputs and the same gradients, bit for bit.

# %%
dp_rows = scal[scal["mode"] == "dp"]
if N_GPUS == 0:
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
else:
    print(f"DP ran for real over GPUs {dp_rows['dp_device_ids'].iloc[0]}: the CPU equivalence check is skipped.")


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
# **Two views, two panels per model.** Left: the **speed-up** of DDP with 1 thread per rank over
# 1 rank × 1 thread, against the ideal (`S(n) = n`, the dashed line); the dotted line marks the
# cores of this machine, past which ranks share cores. Right: the throughput of every
# configuration at one global batch, the single process and DP included, as bars from zero.
# No efficiency is plotted: the speed-up against the ideal line shows the same ratio.
#
# **Why the efficiency is quoted for 1 thread per rank only.** `S(n) / n` counts ranks, not
# cores: 2 ranks × 2 threads use 4 threads, and dividing their speed-up by 2 can give an
# "efficiency" above 1 that only means more cores (or more threads than cores). An efficiency
# above 1 with 1 thread per rank would mean each rank does better than the whole 1-rank
# process, per sample (possible when a smaller per-rank batch fits the caches better; more
# often noise); the next cell says, for every such row, whether the step ranges put it above 1.
#
# **Claim:** every speed-up is against a baseline timed in the same launch and the same
# rounds: the 1-rank × 1-thread blocks ran in every round, alternating with the blocks of every
# other configuration (so the baseline was not measured under different conditions), and
# `efficiency` is reported only where the speed-up is over that baseline.

# %%
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
# For each model at one global batch, the slowest rank's median step, stacked: **one rank's
# share alone** (`solo_step_ms`: forward, backward, optimizer, batch indexing, with the
# machine to itself), **interference** (the same work with all ranks running at once, minus
# alone) and **all-reduce + waiting** (the synced step minus the `no_sync` step). The black
# tick is the ideal: the 1-rank step divided by the world size. A negative term is drawn below
# the level it starts from, hatched, and the bar is labelled "split failed": that row's
# decomposition did not hold in this run. The grey error bar on the top is the synced step's
# spread (min–max).

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
# Every DDP rank is a separate process, and each one above loaded MNIST for itself. Three
# measures of a process's memory: **RSS** (resident set size; its high-water mark `VmHWM` is
# the **peak RSS**) counts the pages of the process that are **resident** in RAM, shared or
# not; pages it has mapped but never touched (or that were swapped out) do not count;
# **USS** counts only the resident pages no other process maps (what this rank costs on its
# own); **PSS** divides shared pages among the processes that map them (summed over ranks it
# is the real total).
#
# **Claim:** RSS counts resident pages, not mapped ones: mapping 64 MiB of anonymous memory
# grows this process's mapped size (`vms`) by at least 64 MiB and its RSS by less than 8 MiB;
# writing one byte in every page of it then grows the RSS by at least 56 MiB.

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
print(f"mapping 64 MiB: vms +{vms_mapped:.1f} MiB, rss +{rss_mapped:.1f} MiB; "
      f"touching every page: rss +{rss_touched:.1f} MiB")
assert vms_mapped >= 64 and rss_mapped < 8 and rss_touched >= 56, (vms_mapped, rss_mapped, rss_touched)

# %% [markdown]
# **Claim:** the `float32` training images alone are `60000 x 784 x 4` bytes = 179.4 MiB per
# rank, and each scaling rank held at least that much: measured in every rank, the storages
# of its training tensors (images plus the `int64` labels) hold at least 179.4 MiB, and its
# resident memory (RSS) grew by at least 179.4 MiB while it loaded them (the parsed `uint8`
# file comes on top).
#
# Sharing one copy would save `(world_size - 1)` copies. `bench.bench_memory` measures it: the
# `private` variant is the project's path; the `mmap` variant maps the raw `uint8` IDX file
# read-only (`numpy.memmap`, copy-on-write) so all ranks use the same page-cache pages and
# convert each batch to normalised `float32` when they use it. The smoke profile skips the
# measured comparison; `full` launches 1, 2 and 4 ranks for each variant.

# %%
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
# ## 4. All-reduce bandwidth
#
# `bench.bench_allreduce` all-reduces (sums) a `float32` tensor of `S` bytes, back to back,
# and takes the slowest rank's mean time `t` per call. Two bandwidths, as defined by
# [nccl-tests](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
#
# * **algbw** `= S / t`: how fast the tensor is "done";
# * **busbw** `= algbw * 2(n-1)/n`: a ring all-reduce makes every rank send and receive
#   `2(n-1)/n * S` bytes, so busbw is the rate each link really carried, comparable across `n`
#   and with the hardware's peak.
#
# On one machine the peak is memory itself: every byte `gloo` moves between processes is
# copied through memory (socket buffers on loopback), at least once. The dashed line is the
# **memory-copy bandwidth** `S / t_copy` of `dst.copy_(src)` for the same sizes in this
# process (1 thread). Small messages are dominated by fixed costs (latency), large ones by
# bandwidth: the shape the cost model of section 6 captures.
#
# busbw is defined by a formula; is it really "the rate each link carries"? An independent
# measurement: during the timed calls each rank also read the kernel's count of the bytes it
# wrote (`wchar` in `/proc/self/io`: gloo sends through `write`-family system calls on TCP
# sockets), so we know the bytes each rank really **sent** per all-reduce.
#
# **Claim:** with gloo on CPU, every rank sends at least `2(n-1)/n × S` bytes per all-reduce,
# and for messages of 64 KiB and more at most 2% above it; so busbw computed from the measured
# bytes (`sent / t`) agrees with `algbw × 2(n-1)/n` within 2%. The rest are message headers,
# the same number of bytes per call on every rank; the cell prints them for each world size and
# message size of this run. They are not a fixed amount per call: more ranks make more ring
# steps and more headers (asserted when the profile measures several world sizes; `full` adds
# 4 ranks and larger messages; the smoke profile measures 2 ranks and 4 sizes).

# %%
display(Code(inspect.getsource(bench.allreduce_worker), language="python"))  # what every rank runs
c = cfg["allreduce"]
ar_out = bench.bench_allreduce(c["world_sizes"], c["sizes_kib"], threads=c["threads"])
ar = pd.DataFrame(ar_out["allreduce"])
copy = pd.DataFrame(ar_out["memcpy"])
print(load_line("after the all-reduce benchmark"))
if ar["sent_bytes_per_call"].isna().any():
    print("SKIPPED the bytes-on-the-wire check: no /proc/self/io here, or NCCL (GPU), which does not send through "
          "system calls.")
else:
    ar["sent_over_S"] = ar["sent_bytes_per_call"].map(max) / ar["bytes"]
    ar["ring_factor"] = 2 * (ar["world_size"] - 1) / ar["world_size"]  # 2(n-1)/n
    ar["busbw_from_sent_GBps"] = ar["sent_bytes_per_call"].map(min) / ar["seconds"] / 1e9
    for r in ar.itertuples():
        assert min(r.sent_bytes_per_call) >= r.ring_factor * r.bytes, r
        if r.bytes >= 64 * 1024:
            assert r.sent_over_S <= 1.02 * r.ring_factor, r
            assert np.isclose(r.busbw_from_sent_GBps, r.busbw_GBps, rtol=0.02), r
    # the headers: bytes sent beyond the ring's 2(n-1)/n x S, per call, on each rank
    ar["header_bytes_per_call"] = [[round(x - r.ring_factor * r.bytes) for x in r.sent_bytes_per_call]
                                   for r in ar.itertuples()]
    for r in ar.itertuples():
        assert len(set(r.header_bytes_per_call)) == 1, f"every rank should send the same headers: {r}"
    headers = ar.assign(h=ar["header_bytes_per_call"].map(max)).pivot(index="bytes", columns="world_size", values="h")
    for small, large in zip(headers.columns, headers.columns[1:]):  # more ranks, more ring steps, more headers
        assert (headers[large] > headers[small]).all(), headers
    for ws in headers.columns:
        print(f"{ws} ranks: header bytes per call beyond 2(n-1)/n x S, by message size: "
              + ", ".join(f"{b // 1024} KiB: {int(h):,}" for b, h in headers[ws].items()))
cols = ["world_size", "KiB", "iters", "us", "algbw_GBps", "busbw_GBps", "copy_GBps", "busbw_over_copy", "backend"]
cols[6:6] = [c for c in ("ring_factor", "sent_over_S", "busbw_from_sent_GBps", "header_bytes_per_call") if c in ar]
ar.assign(KiB=ar["bytes"] // 1024, us=ar["seconds"] * 1e6)[cols]

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
for j, (ws, g) in enumerate(ar.groupby("world_size")):
    ax.plot(g["bytes"], g["busbw_GBps"], "-o", color=f"C{j}", label=f"all-reduce busbw, {ws} ranks ({g.backend.iloc[0]})")
ax.plot(copy["bytes"], copy["copy_GBps"], "--", color="black", label="memory copy, same size (1 thread)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ticks = sorted(ar["bytes"].unique())
ax.set_xticks(ticks, [f"{b // 1024} KiB" if b < 2**20 else f"{b // 2**20} MiB" for b in ticks], rotation=30)
ax.set_xlabel("message size S (bytes per rank)")
ax.set_ylabel("bandwidth (GB/s)")
ax.set_title("All-reduce bus bandwidth against message size")
fig.legend(loc="outside lower center", ncol=2, fontsize=8)
plt.show()

# %% [markdown]
# ## 5. DDP's gradient buckets, and all-reduce overlapping backward
#
# DDP does not wait for the whole backward pass. It groups parameters into **buckets**, in the
# reverse order of the forward pass, and launches an asynchronous all-reduce as soon as every
# gradient in a bucket is ready, while autograd keeps computing the gradients of earlier layers.
# A bucket is filled tensor by tensor and closed once it holds **at least** `bucket_cap_mb`
# MiB (`compute_bucket_assignment_by_size` in torch's `reducer.cpp`): a bucket can exceed the cap
# by up to one tensor, the one that filled it. A tensor larger than the cap does **not** get a
# bucket of its own: it joins the open bucket, next to the smaller tensors already in it, and
# closes it. The first bucket has its own cap: in torch 2.14.1 it is 1 MiB
# (`dist._DEFAULT_FIRST_BUCKET_BYTES`) **only when `bucket_cap_mb` is left at its default**
# (25); passing any `bucket_cap_mb`, even 25, applies that cap to the first bucket too
# (`torch/nn/parallel/distributed.py`: `first_bucket_bytes_cap = _DEFAULT_FIRST_BUCKET_BYTES if
# is_using_default else bucket_bytes_cap`).
#
# These caps do **not** apply to the first step. DDP cannot know yet in which order backward
# will produce the gradients, so with `find_unused_parameters=False` (the default) it starts
# with no cap at all (`compute_bucket_size_limits` in `torch/nn/parallel/distributed.py`:
# `bucket_size_limits = [sys.maxsize]`, "disable initial bucketing"): the first step
# all-reduces **one** bucket holding every gradient, after backward has finished. After that
# step DDP rebuilds the buckets, with the caps above, in the order the gradients actually
# arrived, and every later step uses the rebuilt layout. Small buckets start communicating
# earlier but pay the fixed cost `alpha` more often; one huge bucket cannot start until
# backward ends. `gradient_as_bucket_view=True` makes each `.grad` a
# view into its bucket's buffer: no copy between them, and one gradient-sized buffer less.
#
# The model here is a deep MLP (784 → twelve 512-wide layers → 10, 3.3 M parameters,
# 13.2 MB of `float32` gradients; each hidden layer holds 1.05 MB, just over 1 MiB), deep
# enough for the bucket size to matter. The bucket layout is read
# with a **communication hook** (`ddp.register_comm_hook`, public API) that records each
# bucket's size and the size of every tensor in it (`bucket.parameters()`, in bucket order),
# in the first step and in the second, and then does exactly DDP's default all-reduce.
#
# **Claim:** under every cap the first step all-reduces one bucket of all 13.2 MB; the
# layouts below are the second step's, the rebuilt ones. A larger cap never gives more buckets,
# and the buckets always add up to all the gradients. Every bucket but the last holds at least
# its cap, and holds less without its last tensor (it closed on the tensor that reached the
# cap); no bucket is larger than its cap plus the largest gradient tensor, and under a cap
# smaller than the model, buckets larger than the cap occur. Under the 1 MiB cap, the first
# layer's weight (1.6 MB, larger than the cap) shares its bucket with the tensor before it. With
# `bucket_cap_mb` left at its default the first bucket is between 1 MiB and 1 MiB + one tensor
# (two buckets for this model); with `bucket_cap_mb=25` passed explicitly all 13.2 MB go in one
# bucket. The smoke profile runs 2 ranks with caps 1 and 25 MiB, the default, and the
# profiled steps; `full` runs 7 caps.

# %%
display(Code(inspect.getsource(bench._counting_hook) + "\n\n" + inspect.getsource(bench._bucket_layout_steps),
             language="python"))  # how each rank reads the bucket layout
c = cfg["buckets"]
bk_out = bench.bench_buckets(c["world_size"], c["bucket_caps_mb"], c["as_view"], steps=c["steps"],
                             warmup=c["warmup"], profile_cap_mb=c["profile_cap_mb"], rounds=c["rounds"])
bk = pd.DataFrame(bk_out["rows"])
print(load_line("after the bucket benchmark"))
grad_mb = bench.MLP_PARAMS * 4 / 1e6
tensor_bytes = [p.numel() * 4 for p in bench.build_bench_model("mlp").parameters()]  # from the model itself
largest = max(tensor_bytes)
for _view, g in bk.groupby("gradient_as_bucket_view"):
    g = g.sort_values("bucket_cap_mb")
    assert list(g["n_buckets"]) == sorted(g["n_buckets"], reverse=True), g[["bucket_cap_mb", "n_buckets"]]
for r in bk.itertuples():
    cap = r.bucket_cap_mb * 2**20
    assert len(r.first_step_bucket_mb) == 1 and np.isclose(r.first_step_bucket_mb[0], grad_mb), (
        f"cap {r.bucket_cap_mb}: the first step should all-reduce one bucket of everything, got {r.first_step_bucket_mb}")
    assert np.isclose(sum(r.bucket_mb), grad_mb), (r.bucket_cap_mb, sum(r.bucket_mb), grad_mb)
    tensors = r.bucket_tensor_bytes  # bytes of each tensor in each bucket, in bucket order
    assert [sum(b) for b in tensors] == [round(mb * 1e6) for mb in r.bucket_mb], (r.bucket_cap_mb, tensors)
    for i, b in enumerate(tensors):
        assert sum(b[:-1]) < cap, f"cap {r.bucket_cap_mb}: bucket {i} should still be open before its last tensor"
        assert i == len(tensors) - 1 or sum(b) >= cap, f"cap {r.bucket_cap_mb}: bucket {i} closed below the cap"
    assert all(b * 1e6 < cap + largest for b in r.bucket_mb), (r.bucket_cap_mb, r.bucket_mb)
    if cap < sum(tensor_bytes):
        assert max(r.bucket_mb) * 1e6 > cap, (r.bucket_cap_mb, r.bucket_mb)
default_mb = bk_out["default_cap_bucket_mb"]
assert 2**20 <= default_mb[0] * 1e6 < 2**20 + largest and len(default_mb) == 2, default_mb
one_mib = bk[bk["bucket_cap_mb"] == 1.0].iloc[0]
with_big = [b for b in one_mib["bucket_tensor_bytes"] if max(b) > 2**20]  # a tensor larger than the 1 MiB cap
assert [max(b) for b in with_big] == [largest] and len(with_big[0]) > 1, with_big
labels = [f"{cap:g}/{bool(view)}" for cap in c["bucket_caps_mb"] for view in c["as_view"]]
assert bk["timed_order"].iloc[0] == labels * c["rounds"], "the caps were not timed in alternation"
explicit_25 = bk[bk["bucket_cap_mb"] == 25.0]
assert len(explicit_25) and (explicit_25["n_buckets"] == 1).all(), explicit_25
print(f"largest gradient tensor: {largest / 1e6:.3f} MB; caps in MiB = {2**20 / 1e6:.6f} MB each")
print("first step, every cap: " + "; ".join(sorted({f"{len(m)} bucket of {m[0]:.3f} MB" for m in bk["first_step_bucket_mb"]})))
print(f"cap 1 MiB: the {largest / 1e6:.3f} MB tensor closes a bucket of {len(with_big[0])} tensors ("
      + " + ".join(f"{t:,}" for t in with_big[0]) + " bytes)")
print(f"bucket_cap_mb left at its default: {len(default_mb)} buckets, "
      + ", ".join(f"{b:.3f}" for b in default_mb) + " MB (the first closed just past 1 MiB)")
print("bucket_cap_mb=25 passed explicitly: one bucket of "
      f"{explicit_25['bucket_mb'].iloc[0][0]:.3f} MB (the first bucket is not capped at 1 MiB)")
bk.assign(bucket_mb=bk["bucket_mb"].map(lambda b: ", ".join(f"{x:.2f}" for x in b)),
          cap_MB=bk["bucket_cap_mb"] * 2**20 / 1e6,
          largest_bucket_over_cap=bk["bucket_mb"].map(max) / (bk["bucket_cap_mb"] * 2**20 / 1e6))[
    ["bucket_cap_mb", "cap_MB", "gradient_as_bucket_view", "n_buckets", "bucket_mb", "largest_bucket_over_cap",
     "step_ms", "step_ms_min", "step_ms_max"]]

# %%
fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
for view, g in bk.groupby("gradient_as_bucket_view"):
    g = g.sort_values("bucket_cap_mb")
    ax.errorbar(g["bucket_cap_mb"], g["step_ms"], yerr=[g["step_ms"] - g["step_ms_min"], g["step_ms_max"] - g["step_ms"]],
                fmt="-o", capsize=3, label=f"gradient_as_bucket_view={view}")
    if not view:
        for r in g.itertuples():
            ax.annotate(f"{r.n_buckets} bucket{'s' if r.n_buckets > 1 else ''}", (r.bucket_cap_mb, r.step_ms),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
ax.set_xscale("log")
ax.set_xlabel("bucket_cap_mb (MiB)")
ax.set_ylabel("step time (ms): median, slowest rank; bars min–max")
ax.set_title(f"DDP bucket size, MLP {bench.MLP_PARAMS / 1e6:.1f} M parameters, {c['world_size']} ranks")
ax.margins(y=0.2)  # room for the annotations
fig.legend(loc="outside lower center", ncol=2, fontsize=8)
plt.show()

# %% [markdown]
# ### A profiler timeline: all-reduce during backward, against all-reduce after it
#
# Rank 0 ran two training steps under `torch.profiler` (bucket cap as in
# `cfg["buckets"]["profile_cap_mb"]`), **twice, on the same model, buckets and batch**: once as
# DDP runs them (each bucket's all-reduce launched from inside backward as soon as its
# gradients are ready), and once with the overlap taken away (`bench._allreduce_after_backward_step`:
# backward inside `ddp.no_sync()`, then the same buckets all-reduced one after another). Each
# bar is a recorded event: the forward pass, every backward operator on the main thread, the
# optimizer step, the moment each all-reduce is **launched** (`c10d::allreduce_`), and the
# all-reduce running on the backend's own threads (`gloo:all_reduce`; on GPUs the NCCL
# kernels). A running all-reduce includes any wait for the other rank.
#
# **Claim:** in every step DDP launches all buckets but the last while backward still has
# gradients of earlier layers to compute, which is what lets communication overlap it; the
# comparison run launches none of them before backward's last operator, so its all-reduce
# runs entirely after backward. What the overlap buys is the difference of the two runs' step
# times and of the all-reduce time left after backward, over the same window: a timing,
# printed, not asserted (on a CPU the gloo threads and backward compete for the same cores;
# the comparison also flattens and copies back each bucket itself, a little work DDP's flat
# buckets do not need).

# %%
display(Code(inspect.getsource(bench._allreduce_after_backward_step), language="python"))  # the comparison
n_prof = len(bk_out["profile_bucket_mb"])
runs = {"DDP: all-reduce during backward": bk_out["timeline"],
        "same buckets, all-reduce after backward": bk_out["timeline_after_backward"]}
ovs = {name: bench.timeline_overlap(t) for name, t in runs.items()}
ov, ov_after = ovs.values()
print(f"profiled model: {n_prof} buckets of", ", ".join(f"{b:.2f}" for b in bk_out["profile_bucket_mb"]), "MB")
assert ov["launches"] == ov["steps"] * n_prof and ov_after["launches"] == ov_after["steps"] * n_prof, (ov, ov_after)
assert ov["launched_early"] == ov["steps"] * (n_prof - 1), ov
assert ov_after["launched_early"] == 0 and ov_after["busy_in_backward_ms"] == 0, ov_after
for name, o in ovs.items():
    print(f"{name}: steps {', '.join(f'{t:.1f}' for t in o['step_ms'])} ms; all-reduce running "
          f"{o['busy_ms'] / o['steps']:.1f} ms per step, of which {o['busy_in_backward_ms'] / o['steps']:.1f} ms "
          f"during backward and {o['busy_after_backward_ms'] / o['steps']:.1f} ms after it")
saved = np.median(ov_after["step_ms"]) - np.median(ov["step_ms"])
print(f"median step: {np.median(ov['step_ms']):.1f} ms with overlap, {np.median(ov_after['step_ms']):.1f} ms "
      f"without: the overlap {'saved' if saved > 0 else 'did not save'} {abs(saved):.1f} ms per step in these "
      f"{ov['steps']} profiled steps (one short run: within its noise, not a conclusion)")

# %%
comm_threads = sorted({e["thread"] for t in runs.values() for e in t if e["kind"] == "allreduce"})
lanes = [("forward", "forward (main thread)", "C0"), ("backward", "backward ops (main thread)", "C1"),
         ("optimizer", "optimizer step (main thread)", "C2"),
         ("allreduce launched", "all-reduce launched", "C3")]
lanes += [(("allreduce", t), f"all-reduce running (thread {t})", "C4") for t in comm_threads]
span = max(e["start_ms"] + e["dur_ms"] for t in runs.values() for e in t)
fig, axes = plt.subplots(2, 1, figsize=(11, 1.1 * len(lanes) + 2.6), sharex=True, layout="constrained")
for ax, (name, t), o in zip(axes, runs.items(), ovs.values()):
    tl = pd.DataFrame(t)
    for y, (key, _lane_label, color) in enumerate(lanes):
        ev = tl[(tl["kind"] == key[0]) & (tl["thread"] == key[1])] if isinstance(key, tuple) else tl[tl["kind"] == key]
        if key == "allreduce launched":  # the moment of each launch, drawn as a tick
            ax.broken_barh([(s, span / 300) for s in ev["start_ms"]], (y - 0.35, 0.7), facecolors=color)
        else:
            ax.broken_barh(list(zip(ev["start_ms"], ev["dur_ms"])), (y - 0.35, 0.7), facecolors=color)
    for s in tl[tl["kind"] == "step"].itertuples():
        ax.axvline(s.start_ms, color="gray", ls=":", lw=0.8)
    ax.set_yticks(range(len(lanes)), [lane_label for _, lane_label, _ in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_ylabel("rank 0 (thread)")
    ax.tick_params(labelbottom=True)  # both panels keep their time axis
    ax.set_xlabel("time since the run's first recorded event (ms); dotted lines: step starts")
    ax.set_title(f"{name}: median step {np.median(o['step_ms']):.1f} ms; all-reduce still running after "
                 f"backward: {o['busy_after_backward_ms'] / o['steps']:.1f} ms per step", fontsize=10)
fig.suptitle(f"Rank 0, two steps each, same {n_prof} buckets (cap {c['profile_cap_mb']} MiB), same model and batch")
plt.show()

# %% [markdown]
# ## 6. A cost model: from this laptop to a cluster
#
# The standard model of a ring all-reduce of `S` bytes over `n` processes (a reduce-scatter then
# an all-gather, `2(n-1)` steps, each moving `S/n` bytes per process):
#
# $$t(S, n) = 2(n-1)\,\alpha + \frac{2(n-1)}{n}\,\frac{S}{B}$$
#
# with `alpha` the latency of one step and `B` the link bandwidth. Sources: Thakur,
# Rabenseifner & Gropp, *Optimization of Collective Communication Operations in MPICH*
# (IJHPCA 19(1), 2005), for the alpha-beta cost analysis of all-reduce algorithms; Patarasuk &
# Yuan, *Bandwidth optimal all-reduce algorithms for clusters of workstations* (JPDC 69(2),
# 2009), for the ring's `2(n-1)/n * S` bytes per process being the lower bound. The same factor
# turns algbw into busbw (section 4).
#
# The model is linear in `(alpha, 1/B)`, so `costmodel.fit_alpha_beta` fits it by least squares
# on relative errors. **Claim:** the fitting code recovers known `alpha` and `B` from points
# generated by the formula. Then it is fitted to the points measured in section 4 where every
# rank has a core of its own (the model's assumption), and its errors on all points are shown
# (a measurement, not asserted): oversubscribed points (more ranks than cores) wait for a core
# at every ring step, which the model does not know about.

# %%
true_alpha, true_bw = 25e-6, 1.5e9
S_syn = np.array([4096 * 4**k for k in range(8)] * 2, dtype=float)
n_syn = np.array([2] * 8 + [4] * 8)
syn = costmodel.fit_alpha_beta(S_syn, n_syn, costmodel.ring_allreduce_seconds(S_syn, n_syn, true_alpha, true_bw))
assert np.isclose(syn.alpha_s, true_alpha, rtol=1e-6) and np.isclose(syn.bandwidth_Bps, true_bw, rtol=1e-6), syn
print(f"synthetic check: alpha {syn.alpha_s * 1e6:.3f} us (true 25), B {syn.bandwidth_Bps / 1e9:.4f} GB/s (true 1.5)")

# the model assumes every rank has its own core (and link): fit on those points only
in_fit = ar["world_size"] <= CPUS if (ar["world_size"] <= CPUS).sum() >= 2 else ar["world_size"] > 0
fit = costmodel.fit_alpha_beta(ar.loc[in_fit, "bytes"], ar.loc[in_fit, "world_size"], ar.loc[in_fit, "seconds"])
print(f"fitted to {fit.n_points} measured points (world size <= {CPUS} cores): alpha = {fit.alpha_s * 1e6:.1f} us "
      f"per ring step, B = {fit.bandwidth_Bps / 1e9:.3f} GB/s; largest relative error on them {fit.max_relative_error:.0%}")
ar_fit = ar.assign(KiB=ar["bytes"] // 1024, measured_us=ar["seconds"] * 1e6,
                   model_us=fit.predict(ar["bytes"].to_numpy(), ar["world_size"].to_numpy()) * 1e6,
                   in_fit=in_fit)
ar_fit["relative_error"] = ar_fit["model_us"] / ar_fit["measured_us"] - 1
ar_fit[["world_size", "KiB", "in_fit", "measured_us", "model_us", "relative_error"]]

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
grid = np.geomspace(ar["bytes"].min(), ar["bytes"].max(), 100)
for j, (ws, g) in enumerate(ar.groupby("world_size")):
    fitted = "" if ws <= CPUS else " (not fitted: more ranks than cores)"
    ax.plot(g["bytes"], g["seconds"] * 1e3, "o", color=f"C{j}", label=f"measured, {ws} ranks{fitted}")
    ax.plot(grid, fit.predict(grid, ws) * 1e3, "-", color=f"C{j}", label=f"model, {ws} ranks")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("message size S (bytes)")
ax.set_ylabel("time per all-reduce (ms)")
ax.set_title(f"Ring model fitted: alpha = {fit.alpha_s * 1e6:.0f} us, B = {fit.bandwidth_Bps / 1e9:.2f} GB/s")
fig.legend(loc="outside right center", fontsize=8)
plt.show()

# %% [markdown]
# ### Predicting this machine's step time and efficiency
#
# If compute split perfectly over the ranks and communication did not overlap backward, a DDP
# step with `n` ranks would take `step(1 rank) / n + t(gradient bytes, n)`. Comparing that
# prediction with the measured steps of section 2 shows what the model leaves out: every
# synchronised step also waits for the slowest rank (on a small shared machine the ranks'
# compute jitters from step to step), and ranks that share cores slow each other down
# (`interference_ms`). The table prints both, and their ratio, for this run.

# %%
n_params = {m: sum(p.numel() for p in bench.build_bench_model(m).parameters()) for m in models}
pred_rows = []
for (model, gb), g in ddp[ddp["threads_per_rank"] == 1].groupby(["model", "global_batch_size"]):
    base = g[g["world_size"] == 1]
    if base.empty:
        continue
    t1 = base["step_ms"].iloc[0] / 1e3
    for r in g[g["world_size"] > 1].itertuples():
        comm = fit.predict(n_params[model] * 4, r.world_size)
        step = t1 / r.world_size + comm
        pred_rows.append({"model": model, "global_batch_size": gb, "world_size": r.world_size,
                          "oversubscribed": r.oversubscribed, "gradient_KB": n_params[model] * 4 / 1e3,
                          "predicted_allreduce_ms": comm * 1e3,
                          "measured_allreduce_and_wait_ms": r.comm_exposed_ms,
                          "measured_interference_ms": r.interference_ms,
                          "predicted_step_ms": step * 1e3, "measured_step_ms": r.step_ms,
                          "predicted_efficiency": t1 / step / r.world_size, "measured_efficiency": r.efficiency,
                          "decomposition": r.decomposition})
pred = pd.DataFrame(pred_rows)
if len(pred):
    pred["measured_over_predicted_allreduce"] = pred["measured_allreduce_and_wait_ms"] / pred["predicted_allreduce_ms"]
pred

# %% [markdown]
# ### The bridge to a cluster
#
# The same formula with a cluster's numbers. Stated assumptions (change them in the parameters
# cell): a model of `cluster_params_million` parameters (ResNet-50: 25.6 M) with `float32`
# gradients, `cluster_link_gbit_s` per GPU (100 Gb/s = 12.5 GB/s), an **assumed** latency
# `cluster_alpha_us` per ring step, an **assumed** `cluster_compute_ms` of compute per step on
# one GPU (weak scaling: the per-GPU batch stays fixed), DDP's default 25 MiB buckets, each
# paying the latency term. Two bounds: **no overlap** (`compute + comm`) and **perfect overlap**
# (`max(compute, comm)`). A flat ring is assumed; real libraries (NCCL) switch to trees and
# hierarchical rings at scale precisely because the latency term `2(n-1)·alpha` grows with `n`.

# %%
cluster_n = [8, 16, 32, 64, 128, 256, 512, 1024]
cl = pd.DataFrame(costmodel.predict_data_parallel(
    cluster_n, cluster_params_million * 1e6, cluster_compute_ms / 1e3, cluster_alpha_us * 1e-6,
    cluster_link_gbit_s * 1e9 / 8))
display(Markdown(f"**{cluster_params_million} M parameters ({cl.gradient_MB.iloc[0]:.1f} MB of gradients, "
                 f"{cl.n_buckets.iloc[0]} buckets), {cluster_link_gbit_s:g} Gb/s, alpha = {cluster_alpha_us:g} us, "
                 f"compute {cluster_compute_ms:g} ms per step:**"))
cl

# %%
fig, (ax_e, ax_c) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
ax_e.plot(cl["n_gpus"], cl["efficiency_overlap"], "-o", label="perfect overlap: max(compute, comm)")
ax_e.plot(cl["n_gpus"], cl["efficiency_no_overlap"], "-s", label="no overlap: compute + comm")
ax_e.set_ylim(0, 1.05)
ax_e.set_ylabel("scaling efficiency")
ax_e.set_title(f"Predicted: {cluster_params_million:g} M params on {cluster_link_gbit_s:g} Gb/s")
ax_c.plot(cl["n_gpus"], cl["bandwidth_ms"], "-o", label="bandwidth term 2(n-1)/n S/B")
ax_c.plot(cl["n_gpus"], cl["latency_ms"], "-s", label="latency term buckets x 2(n-1) alpha")
ax_c.axhline(cluster_compute_ms, color="gray", ls=":", label=f"compute per step ({cluster_compute_ms:g} ms, assumed)")
ax_c.set_yscale("log")
ax_c.set_ylabel("time per step (ms)")
ax_c.set_title("Where the all-reduce time goes")
for ax in (ax_e, ax_c):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of GPUs (one rank each)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18))
plt.show()

# %% [markdown]
# ## 7. Launch overhead
#
# Every launch needs processes that have imported torch and met at a rendezvous before `fn`
# runs. `bench.bench_launch_overhead` times a trivial worker (it returns its rank) from the
# call to the results: through `helpers.engine.launch` (torch's elastic agent, output relay,
# error handling; ranks forked from a server process that imported torch once, notebook 00
# section 2), once with the
# server already running and once after stopping it (what the first launch in a kernel pays:
# the server imports torch); through `torch.multiprocessing.spawn` with the hand-written setup
# the tutorials use (every rank a fresh interpreter that imports torch); and, as the floor of
# any launcher that starts fresh interpreters, one `python -c "import torch"`. With 2 ranks it
# also times warm ranks (`helpers.engine.start_ranks`). The smoke profile measures only the `import torch`
# floor; the full profile makes 18 launches.

# %%
c = cfg["launch"]
lo = pd.DataFrame(bench.bench_launch_overhead(c["world_sizes"], c["repeats"]))
print(load_line("after the launch benchmark"))
if not c["world_sizes"]:
    print(f"SKIPPED the launches in the {profile!r} profile (cfg['launch']['world_sizes'] is empty): "
          "only the `import torch` floor was measured. The full profile times both launchers.")
lo.groupby(["method", "world_size"])["seconds"].agg(["median", "min", "max", "count"]).reset_index()

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
big = ar.loc[ar.groupby("world_size")["bytes"].idxmax()]
for r in big.itertuples():
    summary.append({"measure": f"all-reduce {r.bytes // 1024} KiB, {r.world_size} ranks: busbw / memory copy",
                    "value": f"{r.busbw_GBps:.2f} / {r.copy_GBps:.2f} GB/s"})
summary.append({"measure": "ring model fit", "value": f"alpha {fit.alpha_s * 1e6:.0f} us, B {fit.bandwidth_Bps / 1e9:.2f} GB/s"})
for (m, ws), g in lo.groupby(["method", "world_size"]):
    summary.append({"measure": f"launch overhead: {m}, {ws} process(es)", "value": f"{g['seconds'].median():.1f} s"})
summary.append({"measure": "load average at the end", "value": load_line("end").split(": ", 1)[1]})
summary.append({"measure": "this notebook's run time", "value": f"{time.perf_counter() - T_START:.0f} s"})
pd.DataFrame(summary).set_index("measure")

# %% [markdown]
# ## What we saw
#
# * **The input pipeline can dominate.** The seed recipe turns every image into a PIL image
#   and back; the same training on tensors already in memory does none of that per-item work,
#   and reached the same test accuracy (asserted); the measured ratio of the two throughputs is
#   printed in section 1 and in the summary. Before adding processes, make one process fast.
# * **Processes are not free cores.** Each rank needs its own cores, and how many threads a
#   rank runs depends on the launcher: torchrun sets `OMP_NUM_THREADS=1`, `mp.spawn` and
#   `elastic_launch` leave torch's default (so ranks × threads can exceed the cores), and our
#   `launch` divides the cores among the ranks. What 2 ranks bought over 1 in this run, and
#   whether the step spreads separate them, is printed in section 2 and in the summary above;
#   where the step time went (alone, interference, all-reduce and waiting for the slowest rank)
#   is in the figure, with any row whose split failed flagged.
# * **On CPU, DP does nothing in parallel**: `device_ids == []`, it calls the module, and
#   computes exactly what the plain module computes.
# * **All-reduce has a latency and a bandwidth regime.** In the ring model small messages cost
#   a fixed time per ring step and large ones a bandwidth term; two numbers, `alpha` and `B`,
#   describe it (section 6 prints how well they fit this run). On one machine every byte is
#   copied through memory; section 4's figure puts the measured busbw next to memory copy.
# * **DDP hides communication behind backward** by all-reducing buckets as soon as they are
#   ready: the profiler showed launches inside backward, and the same buckets all-reduced
#   only after backward, profiled over the same steps, show what the overlap takes off the step
#   (both step times are printed; a short run, not a conclusion); the bucket size trades latency
#   (many buckets) against overlap (one bucket starts only after backward). A bucket closes
#   once it reaches the cap, so it can exceed it by one tensor, and a tensor larger than the
#   cap closes the bucket it joins; the 1 MiB first bucket exists only when `bucket_cap_mb` is
#   left at its default; and the very first step runs on one bucket of everything, before DDP
#   rebuilds the layout.
# * **busbw is what each rank really sends per second**: the kernel's count of bytes written
#   matched `2(n-1)/n × S` per all-reduce.
# * **The model travels.** With a cluster's `alpha` and `B`, the same formula predicts where
#   a flat ring stops scaling: the bandwidth term levels off at `2S/B`, the latency term grows
#   with `n`.
# * Each rank holds its own dataset; one shared read-only map saves `world_size - 1` copies.
#
# ## Exercises
#
# Three short calculations with this notebook's formulas and results, and one worker to write
# (a communication hook, run on real ranks). Write your answer in the `answer_N = None` cell and
# run the cell below it: it says whether the answer is right (it never stops the notebook). In the
# full notebook the solution, collapsed, is the cell after; student copies leave the solutions out.

# %% [markdown]
# ### Exercise 1: busbw on 8 ranks
#
# An all-reduce over **8** ranks reaches `algbw = 10` GB/s. What is its `busbw`, in GB/s
# (the rate each link of the ring really carries)? Answer with a number.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% tags=["check"]
# expected: the notebook's own cost model (the formula section 4 checked on every measured row)
expected_1 = costmodel.busbw(10e9, 8) / 1e9
check_answer("ex1", answer_1, expected_1, rel_tol=1e-3, hint="busbw = algbw x 2(n-1)/n")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# A ring all-reduce makes every rank send (and receive) 2(n-1)/n of the data:
# 2 x 7 / 8 = 1.75, so busbw = 10 x 1.75 = 17.5 GB/s.
solution_1 = 10 * 2 * (8 - 1) / 8
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: the ring model on a cluster
#
# Take the cluster of section 6 (the parameters cell: `cluster_params_million` million
# `float32` gradients, `cluster_link_gbit_s` Gb/s per GPU, latency `cluster_alpha_us` per
# ring step; defaults 25.6 M, 100 Gb/s, 10 us). How many **milliseconds** does the ring
# model predict for **one** all-reduce of all the gradients (a single bucket) over **8**
# GPUs? Answer with a number, to 0.1 ms.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% tags=["check"]
# expected: the notebook's own ring model, helpers.costmodel.ring_allreduce_seconds
expected_2 = costmodel.ring_allreduce_seconds(cluster_params_million * 1e6 * 4, 8, cluster_alpha_us * 1e-6,
                                              cluster_link_gbit_s * 1e9 / 8) * 1e3
check_answer("ex2", answer_2, expected_2, rel_tol=0.01,
             hint="t = 2(n-1) alpha + 2(n-1)/n x S / B, with S in bytes and B in bytes/s")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# By hand, with the defaults: S = 25.6e6 x 4 bytes = 102.4 MB, B = 100 Gb/s / 8 = 12.5 GB/s.
# latency term 2 x 7 x 10 us = 0.14 ms; bandwidth term 1.75 x 102.4 MB / 12.5 GB/s = 14.336 ms;
# total 14.476 ms (the bandwidth term dominates). Here with the notebook's parameters:
S, B, alpha, n = cluster_params_million * 1e6 * 4, cluster_link_gbit_s / 8 * 1e9, cluster_alpha_us * 1e-6, 8
latency_ms = 2 * (n - 1) * alpha * 1e3
bandwidth_ms = cl.loc[cl["n_gpus"] == n, "bandwidth_ms"].iloc[0]  # section 6's table has the same term
assert abs(bandwidth_ms - 2 * (n - 1) / n * S / B * 1e3) < 1e-9
solution_2 = latency_ms + bandwidth_ms
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: scaling efficiency from two throughputs
#
# In section 2's table, find the two DDP rows of the CNN at global batch 256 with
# **1 thread per rank**: 1 rank and 2 ranks. From their `samples_per_s` alone, what is the
# scaling efficiency of 2 ranks (speed-up / number of ranks)? Answer with a fraction such as
# `0.8` (your numbers are this run's; 1% either way counts as right).

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% tags=["check"]
# expected: the efficiency helpers.bench computed for that row in this run
rows = scal[(scal["mode"] == "ddp") & (scal["model"] == "cnn") & (scal["global_batch_size"] == 256)
            & (scal["threads_per_rank"] == 1)].set_index("world_size")
expected_3 = float(rows.loc[2, "efficiency"])
print(f"this run: 1 rank {rows.loc[1, 'samples_per_s']:,.1f} samples/s, 2 ranks {rows.loc[2, 'samples_per_s']:,.1f} samples/s")
check_answer("ex3", answer_3, expected_3, rel_tol=0.01,
             hint="speed-up = samples/s with 2 ranks / samples/s with 1 rank; then divide by 2")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# samples/s = global batch / step time, so the speed-up is the ratio of the step times
# (1-rank step / 2-rank step), and the efficiency is that over 2.
d = scal[(scal["mode"] == "ddp") & (scal["model"] == "cnn") & (scal["global_batch_size"] == 256)
         & (scal["threads_per_rank"] == 1)].set_index("world_size")["step_ms"]
solution_3 = d.loc[1] / d.loc[2] / 2
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# ### Exercise 4: write a communication hook that reads DDP's buckets
#
# Section 5 read the bucket layout with a communication hook. Write it yourself: a worker
# `bucket_sizes(rank, world_size, cap_mb)` that wraps `bench.build_bench_model("mlp")` in
# `DistributedDataParallel(..., bucket_cap_mb=cap_mb)`, registers a hook
# `hook(state, bucket)` that appends the size in bytes of `bucket.buffer()` to `state` (a list)
# and then averages the bucket as DDP would (divide by the world size, all-reduce, return the
# future's tensor), runs forward and backward on a random batch twice (DDP rebuilds its buckets
# after the first step; record only the second), and returns the list. Then set
# `answer_4 = bucket_sizes`. The check cell runs your worker on 2 real ranks with a 1 MiB cap
# and compares it with section 5's table (it starts 2 processes).

# %% tags=["exercise"]
answer_4 = None  # your worker function here (define it in this cell, then answer_4 = bucket_sizes)

# %% tags=["check"]
# expected: the layout section 5 measured for a 1 MiB cap (bench.bucket_worker's hook), in bytes
from helpers.engine import launch

expected_4 = [round(b * 1e6) for b in bk[(bk["bucket_cap_mb"] == 1.0) & ~bk["gradient_as_bucket_view"]]["bucket_mb"].iloc[0]]
if callable(answer_4):  # your worker, run on 2 real ranks: what rank 0 returned is your answer
    answer_4 = launch(answer_4, 2, 1.0, backend="gloo")[0]
check_answer("ex4", answer_4, expected_4,
             hint="record bucket.buffer().numel() * element_size() in the second step only; the hook must still "
                  "divide and all-reduce, or DDP's gradients are wrong")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 4 (try the exercise first)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def record_and_average(state, bucket):
    buf = bucket.buffer()
    state.append(buf.numel() * buf.element_size())
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def bucket_sizes(rank, world_size, cap_mb):
    ddp = DDP(bench.build_bench_model("mlp"), bucket_cap_mb=cap_mb)
    sizes = []
    ddp.register_comm_hook(sizes, record_and_average)
    x = torch.randn(8, 1, 28, 28)
    for _ in range(2):  # the first step runs on the initial layout; DDP then rebuilds it
        sizes.clear()
        ddp(x).sum().backward()
    return sizes


solution_4 = launch(bucket_sizes, 2, 1.0, backend="gloo")[0]
check_answer("ex4", solution_4, expected_4, strict=True)
