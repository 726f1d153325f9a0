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
# # 05b · Communication and a cost model: all-reduce, buckets, a cluster
#
# <!-- opening:start -->
# **You will be able to** measure all-reduce bandwidth and buckets, and predict a cluster with a cost model. **You need** [05a throughput on one machine](05a_throughput_on_one_machine.ipynb).
# <!-- opening:end -->
#
# **The question:** what does DDP's gradient all-reduce cost on this machine? How does DDP hide
# it behind backward? What does the same arithmetic predict for a cluster?
#
# As in 05a, `helpers.bench` measures everything and shows its code above each run. The load
# average is printed. **No timing is asserted.** Each claim, in bold, is asserted in the folded
# cell after it, on structure: bytes sent, bucket layouts, profiler events, a known fit.
#
# 1. all-reduce bandwidth · 2. gradient buckets and overlap · 3. a cost model and the bridge to
# a cluster · 4. launch overhead
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | 1. all-reduce bandwidth | `gloo` over loopback, against memory copy | `nccl` |
# | 2. DDP buckets, profiler timeline | `gloo` threads | `nccl` kernels |
# | 3. cost model, cluster prediction | arithmetic, and a short DDP run on `gloo` | arithmetic, `nccl` |
# | 4. launch overhead | `helpers.engine.launch` against `torch.multiprocessing.spawn` | same |
#
# **New here:** the cost of an [all-reduce](../docs/GLOSSARY.md#all-reduce) and its two
# bandwidths, [`algbw` and `busbw`](../docs/GLOSSARY.md#algbw-busbw). [DDP](../docs/GLOSSARY.md#ddp)'s
# gradient [buckets](../docs/GLOSSARY.md#bucket) and `bucket_cap_mb`; `gradient_as_bucket_view`;
# DDP communication hooks; `torch.profiler`; the alpha-beta model. Every term is in the
# [glossary](../docs/GLOSSARY.md).
#
# The default `profile = "smoke"` runs small sizes and skips the launcher timings.
# `profile = "full"` runs them and takes several times longer. Three exercises close the lesson,
# each checked by a cell. The last asks for a communication hook, run on real ranks.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
profile = "smoke"  # benchmark sizes from helpers.bench.PROFILES: "smoke" (small, the default) or "full"

# %%
# Check the parameters first: a wrong type or value stops here, with a message saying what to pass
from helpers.notebook import check_answer, check_parameters, check_value

# Constants of this lesson: no profile changes them
seed = 0  # seeds the initial weights and data of section 3's short DDP run
cluster_params_million = 25.6  # model of the cluster prediction (ResNet-50 has 25.6 M parameters)
cluster_link_gbit_s = 100.0  # network bandwidth per GPU in Gb/s (100 Gb/s is 12.5 GB/s)
cluster_alpha_us = 10.0  # ASSUMED latency per ring step in microseconds
cluster_compute_ms = 100.0  # ASSUMED forward+backward+optimizer time of one step on one GPU in ms

check_parameters(profile=(profile, str))
check_value("profile", profile, profile in ("smoke", "full"), '"smoke" or "full" (helpers.bench.PROFILES)')

# %%
import inspect
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
pd.set_option("display.float_format", "{:,.4g}".format)
pd.set_option("display.width", 160)
pd.set_option("display.max_colwidth", 120)

print(f"{info['cpu_model']}, {CPUS} logical CPUs, GPUs: {info['gpus'] or 'none'}; torch {info['torch']}")
print(f"profile = {profile!r}")
print(bench.load_line("start"))

# %% [markdown]
# ## 1. All-reduce bandwidth
#
# `bench.bench_allreduce` sums a `float32` tensor of `S` bytes over the ranks, call after call.
# It takes the slowest rank's mean time `t` per call. Two bandwidths follow, as
# [nccl-tests](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md) defines them:
#
# * **algbw** `= S / t`: how fast the tensor is "done";
# * **busbw** `= algbw * 2(n-1)/n`. A ring all-reduce makes every rank send and receive
#   `2(n-1)/n * S` bytes. So busbw is the rate each link really carried. It compares across `n`
#   and with the hardware's peak.
#
# On one machine the peak is memory itself. Every byte `gloo` moves between processes is copied
# through memory at least once, in socket buffers on loopback. The dashed line is the
# **memory-copy bandwidth**: `S / t_copy` of `dst.copy_(src)` on 1 thread, for the same sizes.
# Fixed costs, the latency, dominate small messages. Bandwidth dominates large ones. The cost
# model of section 3 captures that shape.
#
# Is busbw, a formula, really "the rate each link carries"? gloo sends through `write`-family
# system calls on TCP sockets. The kernel counts the bytes written in `wchar`, in
# `/proc/self/io`. During the timed calls each rank read that count: the bytes it really
# **sent**.
#
# **Claim (CPU):** with gloo on CPU, every rank sends at least `2(n-1)/n × S` bytes per
# all-reduce. From 64 KiB up it sends at most 2% more. So busbw from the sent bytes, `sent / t`,
# agrees with `algbw × 2(n-1)/n` within 2%.
#
# **Claim (CPU):** the extra bytes are message headers: the same count per call on every rank.
# More ranks make more ring steps and more header bytes.
#
# The second claim needs several world sizes: `full` adds 4 ranks and larger messages. Smoke
# measures 2 ranks and 4 sizes. The headers are printed for each world size and message size.

# %%
display(Code(inspect.getsource(bench.allreduce_worker), language="python"))  # what every rank runs
c = cfg["allreduce"]
ar_out = bench.bench_allreduce(c["world_sizes"], c["sizes_kib"], threads=c["threads"])
ar = pd.DataFrame(ar_out["allreduce"])
copy = pd.DataFrame(ar_out["memcpy"])
print(bench.load_line("after the all-reduce benchmark"))

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: bytes each rank sent, against the ring's 2(n-1)/n x S
from helpers.notebook import cpu_claim

# on GPUs the benchmark runs NCCL, which does not send through system calls
on_cpu = cpu_claim("with gloo on CPU every rank sends at least 2(n-1)/n x S bytes per all-reduce")
if on_cpu and ar["sent_bytes_per_call"].isna().any():
    print("SKIPPED the bytes-on-the-wire check: no /proc/self/io here.")
elif on_cpu:
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
# ## 2. DDP's gradient buckets, and all-reduce overlapping backward
#
# DDP does not wait for the whole backward pass. It groups parameters into **buckets**, in the
# reverse order of the forward pass. As soon as every gradient in a bucket is ready, it launches
# an asynchronous all-reduce of that bucket. Meanwhile autograd computes the gradients of earlier
# layers.
#
# A bucket is filled tensor by tensor. It closes once it holds **at least** `bucket_cap_mb` MiB,
# so it can exceed the cap by up to one tensor. A tensor larger than the cap gets **no** bucket of
# its own. It joins the open bucket, next to the smaller tensors already in it, and closes it. The
# source is `compute_bucket_assignment_by_size` in torch's `reducer.cpp`.
#
# The first bucket has its own cap. In torch 2.14.1 it is 1 MiB, `dist._DEFAULT_FIRST_BUCKET_BYTES`,
# **only when `bucket_cap_mb` is left at its default** of 25. Pass any `bucket_cap_mb`, even 25,
# and that cap applies to the first bucket too. The line is in torch/nn/parallel/distributed.py:
# `first_bucket_bytes_cap = _DEFAULT_FIRST_BUCKET_BYTES if is_using_default else bucket_bytes_cap`.
#
# These caps do **not** apply to the first step. DDP cannot know yet in which order backward
# will produce the gradients. With `find_unused_parameters=False`, the default, it starts with no
# cap at all: "disable initial bucketing", in `compute_bucket_size_limits`. So the first step
# all-reduces **one** bucket of every gradient, after backward. DDP then rebuilds the buckets
# with the caps above, in the order the gradients arrived. Every later step uses that layout.
#
# Small buckets start communicating earlier but pay the fixed cost `alpha` more often. One huge
# bucket cannot start until backward ends. `gradient_as_bucket_view=True` makes each `.grad` a
# view into its bucket's buffer: no copy, one gradient-sized buffer less.
#
# The model is a deep MLP: 784 → twelve 512-wide layers → 10. It has 3.3 M parameters, 13.2 MB
# of `float32` gradients. Each hidden layer holds 1.05 MB, just over 1 MiB. A **communication
# hook**, `ddp.register_comm_hook`, reads the layout. It records each bucket's size and its
# tensors' sizes, from `bucket.parameters()`, in the first and second steps. Then it does exactly
# DDP's default all-reduce.
#
# The smoke profile runs 2 ranks with caps of 1 and 25 MiB, the default, and the profiled steps.
# `full` runs 7 caps.

# %% [markdown]
# **Claim:** under every cap the first step all-reduces one bucket of all 13.2 MB. The layouts
# below are the second step's, the rebuilt ones. A larger cap never gives more buckets. The
# buckets always add up to all the gradients.
#
# **Claim:** every bucket but the last holds at least its cap, and less without its last tensor.
# No bucket is larger than its cap plus the largest gradient tensor. Under a cap smaller than the
# model, buckets larger than the cap occur.
#
# **Claim:** the first layer's weight, 1.6 MB, is larger than a 1 MiB cap. It shares its bucket
# with the tensor before it.
#
# **Claim:** with `bucket_cap_mb` left at its default, the first bucket holds from 1 MiB to 1 MiB
# plus one tensor: two buckets for this model. With `bucket_cap_mb=25` passed, all 13.2 MB go in
# one bucket.

# %%
display(Code(inspect.getsource(bench._counting_hook) + "\n\n" + inspect.getsource(bench._bucket_layout_steps),
             language="python"))  # how each rank reads the bucket layout
c = cfg["buckets"]
bk_out = bench.bench_buckets(c["world_size"], c["bucket_caps_mb"], c["as_view"], steps=c["steps"],
                             warmup=c["warmup"], profile_cap_mb=c["profile_cap_mb"], rounds=c["rounds"])
bk = pd.DataFrame(bk_out["rows"])
print(bench.load_line("after the bucket benchmark"))

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: bucket layouts under every cap
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
# Rank 0 ran two training steps under `torch.profiler`, with the bucket cap of
# `cfg["buckets"]["profile_cap_mb"]`. It ran them **twice, on the same model, buckets and
# batch**. The first run is DDP's own: each bucket's all-reduce is launched from inside backward,
# as soon as its gradients are ready. The second run takes the overlap away. It runs backward
# inside `ddp.no_sync()`, then all-reduces the same buckets one after another. That is
# `bench._allreduce_after_backward_step`.
#
# Each bar is a recorded event: the forward pass, every backward operator on the main thread, and
# the optimizer step. A tick marks the moment each all-reduce is **launched**, `c10d::allreduce_`.
# The all-reduce then runs on the backend's own threads, `gloo:all_reduce`; on GPUs these are
# NCCL kernels. A running all-reduce includes any wait for the other rank.
#
# Autograd writes each parameter's gradient in an `AccumulateGrad` operator. DDP's hook on it
# launches the all-reduce once a bucket's last gradient is written. So the `AccumulateGrad`
# operators that start after a launch are the gradients still to compute.
#
# **Claim:** in every step, after DDP launches bucket k, backward still writes every gradient of
# the later buckets: they belong to earlier layers. That lets communication overlap backward. The
# comparison run launches after backward's last gradient, so its all-reduce runs entirely after
# backward.
#
# What the overlap buys is a timing, printed, not asserted. It is the difference of the two runs'
# step times, and of the all-reduce time left after backward. On a CPU the gloo threads and
# backward compete for the same cores. The comparison also flattens and copies back each bucket,
# a little work DDP's flat buckets do not need.

# %%
display(Code(inspect.getsource(bench._allreduce_after_backward_step), language="python"))  # the comparison
n_prof = len(bk_out["profile_bucket_mb"])
runs = {"DDP: all-reduce during backward": bk_out["timeline"],
        "same buckets, all-reduce after backward": bk_out["timeline_after_backward"]}
ovs = {name: bench.timeline_overlap(t) for name, t in runs.items()}
ov, ov_after = ovs.values()

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: launches during backward, gradients still to compute
print(f"profiled model: {n_prof} buckets of", ", ".join(f"{b:.2f}" for b in bk_out["profile_bucket_mb"]), "MB")
assert ov["launches"] == ov["steps"] * n_prof and ov_after["launches"] == ov_after["steps"] * n_prof, (ov, ov_after)
assert ov["launched_early_per_step"] == [n_prof - 1] * ov["steps"], ov  # in every step, not only in total
assert ov_after["launched_early_per_step"] == [0] * ov_after["steps"] and ov_after["busy_in_backward_ms"] == 0, ov_after
# how many gradient tensors each profiled bucket holds, from the model's tensors in arrival order
arrival = [p.numel() * 4 for p in reversed(list(bench.build_bench_model("mlp").parameters()))]
per_bucket, i = [], 0
for mb in bk_out["profile_bucket_mb"]:
    j = i
    while sum(arrival[i:j]) < round(mb * 1e6):
        j += 1
    assert sum(arrival[i:j]) == round(mb * 1e6), (mb, arrival[i:j])
    per_bucket.append(j - i)
    i = j
assert i == len(arrival)


def grads_after_each_launch(timeline):
    """Per step, per all-reduce launch: how many gradients (AccumulateGrad operators) start after it."""
    out = []
    for s in (e for e in timeline if e["kind"] == "step"):
        inside = [e for e in timeline if s["start_ms"] <= e["start_ms"] < s["start_ms"] + s["dur_ms"]]
        grads = [e["start_ms"] for e in inside if e["kind"] == "backward" and e["name"].endswith("AccumulateGrad")]
        launches = sorted(e["start_ms"] for e in inside if e["kind"] == "allreduce launched")
        out.append([sum(g > t for g in grads) for t in launches])
    return out


still_to_compute = [sum(per_bucket[k + 1:]) for k in range(n_prof)]  # the later buckets' gradients
during, after = (grads_after_each_launch(t) for t in runs.values())
assert during == [still_to_compute] * ov["steps"], (during, still_to_compute)
assert after == [[0] * n_prof] * ov_after["steps"], after
print(f"gradients still to compute after each launch, per step: {during} (DDP), {after} (after backward)")
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
# ## 3. A cost model: from this laptop to a cluster
#
# The standard model of a ring all-reduce of `S` bytes over `n` processes is below. A ring runs a
# reduce-scatter, then an all-gather: `2(n-1)` steps, each moving `S/n` bytes per process.
#
# $$t(S, n) = 2(n-1)\,\alpha + \frac{2(n-1)}{n}\,\frac{S}{B}$$
#
# Here `alpha` is the latency of one step and `B` the link bandwidth. The alpha-beta analysis of
# all-reduce is from Thakur, Rabenseifner and Gropp, *Optimization of Collective Communication
# Operations in MPICH*, IJHPCA 19(1), 2005. Patarasuk and Yuan show that the ring's
# `2(n-1)/n * S` bytes per process is the lower bound: *Bandwidth optimal all-reduce algorithms
# for clusters of workstations*, JPDC 69(2), 2009. The same factor turns algbw into busbw, as in
# section 1.
#
# The model is linear in `alpha` and `1/B`. So `costmodel.fit_alpha_beta` fits it by least
# squares on relative errors.
#
# **Claim:** the fitting code recovers known `alpha` and `B` from points generated by the formula.
#
# The next cell then fits the points of section 1 where every rank has a core of its own, as the
# model assumes. Its errors on all points are shown, not asserted. With more ranks than cores, a
# rank waits for a core at every ring step, and the model does not know that.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the fit recovers known alpha and B
true_alpha, true_bw = 25e-6, 1.5e9
S_syn = np.array([4096 * 4**k for k in range(8)] * 2, dtype=float)
n_syn = np.array([2] * 8 + [4] * 8)
syn = costmodel.fit_alpha_beta(S_syn, n_syn, costmodel.ring_allreduce_seconds(S_syn, n_syn, true_alpha, true_bw))
assert np.isclose(syn.alpha_s, true_alpha, rtol=1e-6) and np.isclose(syn.bandwidth_Bps, true_bw, rtol=1e-6), syn
print(f"synthetic check: alpha {syn.alpha_s * 1e6:.3f} us (true 25), B {syn.bandwidth_Bps / 1e9:.4f} GB/s (true 1.5)")

# %%
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
# Say compute split perfectly over the ranks and communication did not overlap backward. Then a
# DDP step with `n` ranks would take `step(1 rank) / n + t(gradient bytes, n)`. The next cell
# measures DDP steps with 1 thread per rank at global batch 256, as lesson 05a does with fewer
# configurations. It compares them with that prediction.
#
# The model leaves two things out. Every synchronised step also waits for the slowest rank, and
# on a small shared machine the ranks' compute jitters from step to step. Ranks that share cores
# also slow each other down: `interference_ms`. The table prints both, and their ratio.

# %%
c = cfg["scaling"]
scal = pd.DataFrame(bench.bench_scaling([ws_t for ws_t in c["configs"] if ws_t[1] == 1], c["models"], [256],
                                        c["steps"], c["warmup"], c["rounds"], local=False, seed=seed))
print(bench.load_line("after the short DDP run"))
ddp = scal[scal["mode"] == "ddp"].copy()
ddp["decomposition"] = np.where((ddp[["interference_ms", "comm_exposed_ms"]].astype(float) < 0).any(axis=1),
                                "FAILED (negative term)", "ok")
models = list(dict.fromkeys(ddp["model"]))
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
# The same formula with a cluster's numbers. These are the assumptions; change them in the
# parameters cell:
#
# * a model of `cluster_params_million` parameters with `float32` gradients; ResNet-50 has 25.6 M;
# * `cluster_link_gbit_s` per GPU: 100 Gb/s is 12.5 GB/s;
# * an **assumed** latency `cluster_alpha_us` per ring step;
# * an **assumed** `cluster_compute_ms` of compute per step on one GPU. This is weak scaling: the
#   per-GPU batch stays fixed;
# * DDP's default 25 MiB buckets, each paying the latency term.
#
# Two bounds follow: **no overlap**, `compute + comm`, and **perfect overlap**,
# `max(compute, comm)`. A flat ring is assumed. Real libraries such as NCCL switch to trees and
# hierarchical rings at scale. They do so because the latency term `2(n-1)·alpha` grows with `n`.

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
# ## 4. Launch overhead
#
# Every launch needs processes that have imported torch and met at a rendezvous before `fn`
# runs. `bench.bench_launch_overhead` times a trivial worker that returns its rank. It counts
# from the call to the results, for each way to launch:
#
# * `helpers.engine.launch`, which forks ranks from a server process that imported torch once.
#   It is timed with that server already running, and after stopping it: what a kernel's first
#   launch pays;
# * `torch.multiprocessing.spawn` with the tutorials' setup. Every rank is a fresh interpreter
#   that imports torch;
# * one `python -c "import torch"`: the floor of any launcher that starts fresh interpreters;
# * with 2 ranks, warm ranks from `helpers.engine.start_ranks`.
#
# Smoke measures only the `import torch` floor; full makes 18 launches.

# %%
c = cfg["launch"]
lo = pd.DataFrame(bench.bench_launch_overhead(c["world_sizes"], c["repeats"]))
print(bench.load_line("after the launch benchmark"))
if not c["world_sizes"]:
    print(f"SKIPPED the launches in the {profile!r} profile (cfg['launch']['world_sizes'] is empty): "
          "only the `import torch` floor was measured. The full profile times both launchers.")
lo.groupby(["method", "world_size"])["seconds"].agg(["median", "min", "max", "count"]).reset_index()

# %% [markdown]
# ## Summary of this run

# %%
summary = []
big = ar.loc[ar.groupby("world_size")["bytes"].idxmax()]
for r in big.itertuples():
    summary.append({"measure": f"all-reduce {r.bytes // 1024} KiB, {r.world_size} ranks: busbw / memory copy",
                    "value": f"{r.busbw_GBps:.2f} / {r.copy_GBps:.2f} GB/s"})
summary.append({"measure": "ring model fit", "value": f"alpha {fit.alpha_s * 1e6:.0f} us, B {fit.bandwidth_Bps / 1e9:.2f} GB/s"})
for (m, ws), g in lo.groupby(["method", "world_size"]):
    summary.append({"measure": f"launch overhead: {m}, {ws} process(es)", "value": f"{g['seconds'].median():.1f} s"})
summary.append({"measure": "load average at the end", "value": bench.load_line("end").split(": ", 1)[1]})
summary.append({"measure": "this lesson's run time", "value": f"{time.perf_counter() - T_START:.0f} s"})
pd.DataFrame(summary).set_index("measure")

# %% [markdown]
# ## What we saw
#
# * **All-reduce has a latency and a bandwidth regime.** A time `alpha` per ring step and a
#   bandwidth `B` describe it; section 3 fitted them. On one machine every byte is copied through
#   memory.
# * **busbw is what each rank really sends per second.** The kernel's count of bytes written
#   matched `2(n-1)/n × S`, plus headers that grow with the ranks.
# * **DDP hides communication behind backward.** After each bucket but the last is launched,
#   backward still computes the gradients of earlier layers.
# * **Buckets close at the cap.** A tensor larger than the cap closes the bucket it joins. The
#   1 MiB first bucket exists only when `bucket_cap_mb` is left at its default. The first step
#   runs on one bucket of everything.
# * **The model travels.** On a cluster the bandwidth term levels off at `2S/B`, and the latency
#   term grows with `n`.
#
# ## Exercises
#
# Two short calculations with this lesson's formulas, and one worker to write: a communication
# hook, run on real ranks. Write your answer in the `answer_N = None` cell and run the cell below
# it. It says whether the answer is right and never stops the lesson. In the full lesson the
# solution, collapsed, is the cell after; student copies leave the solutions out.

# %% [markdown]
# ### Exercise 1: busbw on 8 ranks
#
# An all-reduce over **8** ranks reaches `algbw = 10` GB/s. What is its `busbw` in GB/s, the rate
# each link of the ring really carries? Answer with a number.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 1
# expected: the notebook's own cost model (the formula section 1 checked on every measured row)
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
# Take the cluster of section 3, from the parameters cell. It has `cluster_params_million`
# million `float32` gradients, `cluster_link_gbit_s` Gb/s per GPU and a latency of
# `cluster_alpha_us` per ring step. The defaults are 25.6 M, 100 Gb/s and 10 us. How many
# **milliseconds** does the ring model predict for **one** all-reduce of all the gradients, as a
# single bucket, over **8** GPUs? Answer with a number, to 0.1 ms.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 2
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
bandwidth_ms = cl.loc[cl["n_gpus"] == n, "bandwidth_ms"].iloc[0]  # section 3's table has the same term
assert abs(bandwidth_ms - 2 * (n - 1) / n * S / B * 1e3) < 1e-9
solution_2 = latency_ms + bandwidth_ms
check_answer("ex2", solution_2, expected_2, strict=True)


# %% [markdown]
# ### Exercise 3: write a communication hook that reads DDP's buckets
#
# Section 2 read the bucket layout with a communication hook. Write it yourself, as a worker
# `bucket_sizes(rank, world_size, cap_mb)` that:
#
# 1. wraps `bench.build_bench_model("mlp")` in `DistributedDataParallel(..., bucket_cap_mb=cap_mb)`;
# 2. registers a hook `hook(state, bucket)`. The hook appends the size in bytes of
#    `bucket.buffer()` to `state`, a list. Then it averages the bucket as DDP would: divide by the
#    world size, all-reduce, return the future's tensor;
# 3. runs forward and backward on a random batch twice. DDP rebuilds its buckets after the first
#    step, so record only the second;
# 4. returns the list.
#
# Then set `answer_3 = bucket_sizes`. The check cell starts 2 real ranks and runs your worker
# with a 1 MiB cap. It compares the result with section 2's table.

# %% tags=["exercise"]
answer_3 = None  # your worker function here (define it in this cell, then answer_3 = bucket_sizes)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 3
# expected: the layout section 2 measured for a 1 MiB cap (bench.bucket_worker's hook), in bytes
from helpers.engine import launch

expected_3 = [round(b * 1e6) for b in bk[(bk["bucket_cap_mb"] == 1.0) & ~bk["gradient_as_bucket_view"]]["bucket_mb"].iloc[0]]
# your worker runs on 2 real ranks; what rank 0 returned is your answer
check_answer("ex3", answer_3, expected_3, run=lambda fn: launch(fn, 2, 1.0, backend="gloo")[0],
             hint="record bucket.buffer().numel() * element_size() in the second step only; the hook must still "
                  "divide and all-reduce, or DDP's gradients are wrong")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
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


solution_3 = launch(bucket_sizes, 2, 1.0, backend="gloo")[0]
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [06a training-loop pitfalls](06a_training_loop_pitfalls.ipynb): fix accumulation (`no_sync`), uneven inputs (`Join`), unused parameters.
# <!-- next:end -->
