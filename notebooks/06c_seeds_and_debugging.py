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
# # 06c · DDP seeds and debugging
#
# <!-- opening:start -->
# **You will be able to** seed ranks, catch collective mismatches, read a rank's traceback and hang. **You need** [03 the distributed sampler](03_distributed_sampler.ipynb), [06a training-loop pitfalls](06a_training_loop_pitfalls.ipynb).
# <!-- opening:end -->
#
# **The question:** a DDP run gives a different number than yesterday's, or stops. Is it the
# seeds, the order of float additions, or a rank that does something else? And how do we find
# out which, with proof?
#
# Two sections in 06a's shape. The experiment runs on real ranks with `launch`. We see the
# symptom, then the fix. Each bold "Claim:" is asserted by the folded code cell right after
# it, tagged `check`.
#
# 1. seeds and determinism · 2. debugging
#
# **What runs where:** each experiment is one short launch of `world_size` processes. The backend
# is `gloo` on CPU, with or without GPUs. It is pinned: the debug demonstrations need gloo's
# catchable timeout and its debug wrapper.
#
# Terms, see the [glossary](../docs/GLOSSARY.md): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [process group](../docs/GLOSSARY.md#process-group), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [DDP](../docs/GLOSSARY.md#ddp).
#
# **New here:** per-rank seeds, the order of float32 additions across ranks,
# `TORCH_DISTRIBUTED_DEBUG=DETAIL`, each rank's stack on a hang, torch elastic's `@record`, init
# timeouts. Every claim was checked against torch 2.14.1. Where torch differs from folklore, the
# lesson says what really happens. The end of section 2 prints the seconds of each launch.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
world_size = 2  # DDP ranks (processes) of every launch; 2 or more
seed_steps = 30  # SGD steps of the seeds experiment in section 1
collective_timeout_s = 2.0  # seconds a rank waits in a hung collective before gloo raises
hang_timeout_s = 4.0  # seconds the mismatched-collective launch of section 2 may run before LaunchTimeout

# %%
from helpers.notebook import check_answer, check_parameters, check_value

seed = 0  # seeds every model and data set

check_parameters(world_size=(world_size, int), seed_steps=(seed_steps, int),
                 collective_timeout_s=(collective_timeout_s, float),
                 hang_timeout_s=(hang_timeout_s, float))
check_value("hang_timeout_s", hang_timeout_s, hang_timeout_s > 0, "greater than 0 seconds")
check_value("world_size", world_size, world_size >= 2 and 64 % world_size == 0, "2, 4 or 8 (64 samples split evenly)")

# %%
import datetime
import linecache
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from helpers.captured import captured_output, show_folded
from helpers.engine import LaunchTimeout, WorkerError, free_port, launch, worker_device

t_notebook = time.perf_counter()
T = collective_timeout_s
n_gpus = torch.cuda.device_count()
mse = nn.functional.mse_loss
launch_s = {}  # seconds of every launch, by section (printed at the end)
lr = 0.1  # the SGD learning rate of every model here
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; world_size = {world_size}")

# %% [markdown]
# ## 0. Tools every section uses
#
# Each experiment is a function `fn(rank, world_size, ...)` run with `launch`, as in
# [06a](06a_training_loop_pitfalls.ipynb). Its small tools are those of 06a's section 0, imported
# from `helpers/ddp_tools.py`. A section that shows a hang uses a gloo process group whose
# collectives time out after `collective_timeout_s` seconds. 06a says why.

# %%
from helpers.ddp_tools import error_text, params, short_timeout_group, wrap

# %% [markdown]
# ## 1. Seeds and determinism
#
# `seeded_training` trains `Linear(16, 1)` for `seed_steps` SGD steps on a fixed global batch of
# 64 samples. The batch is split into contiguous blocks: rank `r` takes the rows from
# `r 64 / world_size` on. Every rank initialises the model from `torch.manual_seed(seed)`.
#
# With `augment=True` each rank adds Gaussian noise to its inputs. The noise comes from the
# rank's own generator, seeded with `seed + 1000 + rank`: per-rank augmentation seeds. With
# `world_size == 1` it trains the plain model in this kernel, the single-process run to compare
# with.

# %%
seed_batch, seed_features, aug_std = 64, 16, 0.5


def seeds_data():
    """The fixed global batch: x (64, 16) float32, y (64, 1)."""
    x = torch.randn(seed_batch, seed_features, generator=torch.Generator().manual_seed(seed + 2024))
    return x, x @ torch.linspace(-1.0, 1.0, seed_features).reshape(-1, 1) + 0.5


def seed_model(s):
    torch.manual_seed(s)
    return nn.Linear(seed_features, 1)


def seeded_training(rank, world_size, augment):
    """{"init", "final": {name: tensor}, "loss": [clean full-batch MSE before each step and after the last]}."""
    device = worker_device()
    x, y = (t.to(device) for t in seeds_data())
    per = seed_batch // world_size
    xr, yr = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    model = seed_model(seed).to(device)
    init = params(model)
    net = wrap(model) if world_size > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    losses = []
    for _ in range(seed_steps):
        with torch.no_grad():
            losses.append(float(mse(model(x), y)))
        inp = xr + aug_std * torch.randn(xr.shape, generator=gen).to(device) if augment else xr
        opt.zero_grad(set_to_none=True)
        mse(net(inp), yr).backward()
        opt.step()
    with torch.no_grad():
        losses.append(float(mse(model(x), y)))
    return {"init": init, "final": params(model), "loss": losses}


# %%
def seeds_worker(rank, world_size):
    out = {"init_unseeded": params(nn.Linear(seed_features, 1))}  # before any seed in this rank
    out["init_same_seed"] = params(seed_model(seed))
    model = seed_model(seed + rank)
    out["init_rank_seed"] = params(model)
    wrap(model)  # DDP's constructor broadcasts rank 0's parameters and buffers
    out["init_rank_seed_after_ddp"] = params(model)
    shape = (2, seed_features)
    out["noise_rank_seed"] = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1000 + rank))
    out["noise_same_seed"] = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1000))
    out["plain"] = seeded_training(rank, world_size, augment=False)
    out["augmented"] = seeded_training(rank, world_size, augment=True)
    return out

# %% [markdown]
# One launch, then the same training in this kernel with `world_size = 1`.

# %%
t0 = time.perf_counter()
S = launch(seeds_worker, world_size, backend="gloo", timeout=120)
launch_s["1 seeds"] = time.perf_counter() - t0
one = {aug: seeded_training(0, 1, augment=aug) for aug in (False, True)}  # world size 1, in this kernel
pnames = list(one[False]["init"])

# %% [markdown]
# Each process that `torchrun` starts has its own random state. So has each rank here.
#
# **Claim:** without a seed, the model's initial weights differ from rank to rank. From the
# **same** seed they are bit-identical on every rank and in the kernel's world-size-1 run.
#
# **Claim:** for DDP's parameters the seed does not even matter. Initialised from `seed + rank`,
# they differ before wrapping. `DDP(model)` broadcasts rank 0's parameters and buffers at
# construction, so afterwards every rank holds rank 0's.
#
# **Claim:** data augmentation is the opposite. With the same generator seed, every rank draws
# the **same** noise: identical "random" perturbations. Seed it with `seed + rank`.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: initial weights and noise with the same seed, per-rank seeds, no seed
for r, s in enumerate(S):
    for n in pnames:
        assert torch.equal(s["init_same_seed"][n], one[False]["init"][n]), f"rank {r}: same seed should give the same {n}"
        assert torch.equal(s["init_rank_seed_after_ddp"][n], S[0]["init_rank_seed"][n]), f"rank {r}: after DDP {n} should be rank 0's"
    assert torch.equal(s["noise_same_seed"], S[0]["noise_same_seed"]), f"rank {r}: same-seed noise should be identical"
    if r > 0:
        assert not torch.equal(s["init_unseeded"]["weight"], S[0]["init_unseeded"]["weight"]), "no seed: own init per rank"
        assert not torch.equal(s["init_rank_seed"]["weight"], S[0]["init_rank_seed"]["weight"]), "per-rank seeds: different init"
        assert not torch.equal(s["noise_rank_seed"], S[0]["noise_rank_seed"]), "per-rank seeds: different noise"
print(f"no seed: {world_size} different inits; same seed: identical init on {world_size} ranks and in this kernel; "
      "after DDP(seed + rank init) every rank holds rank 0's")

# %% [markdown]
# Float32 addition is not associative: the same numbers summed in another order can differ.
# Float32 has a 24-bit significand, so `1e8 + 1` rounds back to `1e8`. Over 2 ranks, each rank
# sums its part, then the all-reduce adds the parts. `DistributedSampler` deals **strided**
# parts, `indices[rank::num_replicas]` in `torch/utils/data/distributed.py`. This section splits
# its batch into **contiguous** halves.
#
# **Claim:** `[1e8, 1, -1e8, 1]` sums to a different float32 value in each order:
#
# | order | sum |
# | --- | --- |
# | left to right, one process | 1 |
# | strided over 2 ranks, items `r, r + 2` | `0 + 2 = 2` |
# | contiguous halves, items 0-1 and 2-3 | `1e8 + (-1e8) = 0` |
#
# The check compares torch's float32 sums with numpy's, one addition at a time.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the three float32 sums, against numpy one addition at a time
v = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.float32)
orders = {"left to right (one process)": float(v[0] + v[1] + v[2] + v[3]),
          "strided pairs (items r, r+2)": float(v[0::2].sum() + v[1::2].sum()),
          "contiguous halves (items 0-1, 2-3)": float(v[:2].sum() + v[2:].sum())}
f = np.float32
by_hand = {"left to right (one process)": ((f(1e8) + f(1)) + f(-1e8)) + f(1),
           "strided pairs (items r, r+2)": (f(1e8) + f(-1e8)) + (f(1) + f(1)),
           "contiguous halves (items 0-1, 2-3)": (f(1e8) + f(1)) + (f(-1e8) + f(1))}
assert orders == {k: float(x) for k, x in by_hand.items()}, (orders, by_hand)
assert list(orders.values()) == [1.0, 2.0, 0.0], orders
pd.Series(orders, name="float32 sum of [1e8, 1, -1e8, 1]").to_frame()

# %% [markdown]
# **Claim:** without augmentation, training on `world_size` ranks ends bit-identical **across
# ranks**: they all apply the same all-reduced gradient. It equals one process **up to float32
# rounding**. Bit-identical across world sizes is not guaranteed: the order of additions
# differs, as above.
#
# **Claim:** with per-rank augmentation seeds, a sample's noise depends on which rank holds it.
# So the DDP run and the one-process run follow different trajectories, far beyond rounding.
# They are only **statistically** equivalent. Both fall below a tenth of the starting loss, and
# their final losses differ by less than 4% of it.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: bit-identical ranks; world sizes equal up to rounding, or only statistically
rows = []
for key, aug in (("plain", False), ("augmented", True)):
    for r, s in enumerate(S):
        for n in pnames:
            assert torch.equal(s[key]["final"][n], S[0][key]["final"][n]), f"{key}: rank {r} not bit-identical to rank 0 ({n})"
    diff = max(float((S[0][key]["final"][n] - one[aug]["final"][n]).abs().max()) for n in pnames)
    n_diff = sum(int((S[0][key]["final"][n] != one[aug]["final"][n]).sum()) for n in pnames)
    n_all = sum(one[aug]["final"][n].numel() for n in pnames)
    l0, l_ddp, l_one = one[aug]["loss"][0], S[0][key]["loss"][-1], one[aug]["loss"][-1]
    if not aug:
        for n in pnames:
            assert_close(S[0][key]["final"][n], one[aug]["final"][n], msg=f"no augmentation: {n} should equal one process up to rounding")
    else:
        assert diff > 1e-3, f"per-rank augmentation: trajectories should differ beyond rounding (max diff {diff:g})"
        # measured with seeds 0 to 5, 2 and 4 ranks, 30 and 100 steps: final losses 1.7% to 7.1% of the
        # starting loss, apart by at most 2.5% of it (the final losses' ratio ranged from 0.81 to 1.77)
        assert l_ddp < 0.1 * l0 and l_one < 0.1 * l0, f"both runs should learn: {l0:.3g} -> {l_ddp:.3g} / {l_one:.3g}"
        assert abs(l_ddp - l_one) < 0.04 * l0, f"final losses should be close: {l_ddp:.3g} vs {l_one:.3g} (start {l0:.3g})"
    rows.append({"augmentation": key, "ranks bit-identical": True,
                 f"max |Δparam| world_size {world_size} vs 1": diff, "elements that differ": f"{n_diff} of {n_all}",
                 "loss at start": l0, f"final loss, world_size {world_size}": l_ddp, "final loss, world_size 1": l_one})
pd.DataFrame(rows).set_index("augmentation")

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
for key, aug, color in (("plain", False, "tab:blue"), ("augmented", True, "tab:orange")):
    ax.plot(S[0][key]["loss"], color=color, label=f"{key}, world_size {world_size} (DDP)")
    ax.plot(one[aug]["loss"], color=color, linestyle="--", label=f"{key}, world_size 1")
ax.set_yscale("log")
ax.set_xlabel("SGD step")
ax.set_ylabel("MSE on the clean global batch\n(squared target units, log scale)")
ax.set_title("Same seeds, different world sizes: equal up to rounding without augmentation,\n"
             "only statistically equivalent with per-rank augmentation", fontsize=10)
fig.legend(loc="outside lower center", ncol=2, fontsize=8)  # below the axes: the curves fill the upper right
plt.show()

# %% [markdown]
# ## 2. Debugging
#
# ### Collective mismatches and `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# Rank `r` all-reduces a tensor of `2 + r` elements. The ranks disagree about a length: a classic
# desynchronisation.
#
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` wraps every process group in a checker. Before each collective
# it compares the ranks' "fingerprints": operation, shapes, dtypes. torch reads the variable when
# `torch.distributed` is imported, so set it before the processes start; see the
# [docs](https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications).
#
# The worker switches the same checker on for one group: `dist.set_debug_level(DebugLevel.DETAIL)`
# before `dist.new_group()`. It runs the mismatch on that group and on a plain short-timeout
# group. One launch: worker start-up plus up to `collective_timeout_s`.

# %%
def debug_worker(rank, world_size, timeout_s):
    plain = short_timeout_group(timeout_s)
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        checked = dist.new_group()  # created under DETAIL: wrapped in the fingerprint checker
    finally:
        dist.set_debug_level(previous)
    out = {}
    for case, group in (("detail", checked), ("off", plain)):
        t = torch.ones(2 + rank, device=worker_device())
        try:
            dist.all_reduce(t, group=group)
            out[case] = f"no error; result {t.tolist()}"
        except RuntimeError as e:
            out[case] = error_text(e)
    return out


t0 = time.perf_counter()
D = launch(debug_worker, world_size, T, backend="gloo", timeout=120)
launch_s["2 mismatch"] = time.perf_counter() - t0

# %% [markdown]
# **Claim:** with the checker every rank raises `Detected mismatch between collectives on
# ranks`, naming its own shape. Without it nothing diagnoses the problem. Gloo does not compare
# shapes. Rank 0, with 2 elements, may return a result while another rank waits for elements
# that never come, and times out.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: DETAIL names each rank's shape; without it nothing does
for r, d in enumerate(D):
    assert "Detected mismatch between collectives on ranks" in d["detail"], f"rank {r}: {d['detail'][:200]}"
    assert f"TensorShape=[{2 + r}]" in d["detail"], f"rank {r}: its own shape should be named: {d['detail'][:300]}"
    assert "Detected mismatch" not in d["off"], f"rank {r}: without DETAIL nothing should diagnose the mismatch"
print("with DETAIL, rank 0 says:\n" + D[0]["detail"].replace("TensorDeviceTypes", "\n  TensorDeviceTypes")[:600] + " ...")
pd.DataFrame([{"rank": r, "tensor elements": 2 + r, "without DETAIL": d["off"].split("] ")[-1],
               "with DETAIL": d["detail"].split("Collectives differ in the following aspects:")[-1].strip()}
              for r, d in enumerate(D)]).set_index("rank")

# %% [markdown]
# ### A surprise: DETAIL breaks DDP's constructor (gloo, torch 2.14.1)
#
# DDP's constructor logs its set-up: `DistributedDataParallel._ddp_init_helper` calls
# `self.logger.set_construction_data_and_log(...)`. For gloo, `c10d::Logger::set_env_variables`
# reads gloo's thread count. It `static_cast`s the group's gloo backend to `ProcessGroupGloo`;
# see `torch/csrc/distributed/c10d/logger.cpp` in the torch source.
#
# Under `TORCH_DISTRIBUTED_DEBUG=DETAIL`, the default group's gloo backend is the debug wrapper
# instead, `_ProcessGroupWrapper`. So the cast is wrong: **undefined behaviour**. What happens
# then depends on the process's memory layout, not on your code. We have seen the rank killed by
# SIGSEGV: in a Python script, and in this notebook with earlier versions of our launcher. We
# have also seen DDP built with a nonsense thread count in its log, in this notebook since then.
#
# **Claim:** without DETAIL, every rank's gloo backend is a `ProcessGroupGloo`. DDP logs gloo's
# real thread count, `ddp._get_ddp_logging_data()["gloo_num_threads"]`.
#
# **Claim:** with DETAIL, every rank's backend is a `_ProcessGroupWrapper`. DDP's constructor
# then either kills the rank with SIGSEGV or logs a thread count that is not the real one.
#
# A SIGSEGV shows as a `WorkerError` with `exc_type` `killed by SIGSEGV` and an empty Python
# traceback. Python's fault handler's stack, relayed with the `[rank r]` prefix, names the line
# that calls `set_construction_data_and_log`. The cell folds that output under one line.
#
# Either way the DETAIL run is broken. So on CPU use DETAIL for collective checks, as above. For
# DDP's unused-parameter names use `TORCH_DISTRIBUTED_DEBUG=INFO`, as in
# [06a](06a_training_loop_pitfalls.ipynb) section 3. Two launches.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: DETAIL's wrapper backend, then a SIGSEGV or a wrong thread count in DDP's log
def detail_ddp_worker(rank, world_size):
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    print(f"debug level: {dist.get_debug_level()}; the group's gloo backend: {type(backend).__name__}")
    ddp = wrap(nn.Linear(2, 2))
    return {"backend": type(backend).__name__, "gloo_num_threads": ddp._get_ddp_logging_data().get("gloo_num_threads")}


t0 = time.perf_counter()
before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
detail_error, detail_result = None, None
with mock.patch.dict(os.environ, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}), captured_output() as relayed:
    try:  # workers inherit this kernel's environment; the launcher relays their output: keep it to read it
        detail_result = launch(detail_ddp_worker, world_size, backend="gloo", timeout=120)
    except WorkerError as e:
        detail_error = e
# DETAIL off: the real values. Run second: the first launch after a change of os.environ pays a fresh
# start-up, better here than inside the next cell's short launch timeout
reference = launch(detail_ddp_worker, world_size, backend="gloo", timeout=120)
launch_s["2 DETAIL"] = time.perf_counter() - t0
show_folded(f"the DETAIL launch: {f'rank {detail_error.rank} {detail_error.exc_type}' if detail_error else 'DDP was built'}; "
            f"'Segmentation fault' in its output: {'Segmentation fault' in relayed.getvalue()}", relayed.getvalue())
print(f"without DETAIL: {reference}")
assert os.environ.get("TORCH_DISTRIBUTED_DEBUG") == before, "the environment variable should be restored"
if torch.__version__.split("+")[0] == "2.14.1":
    real = reference[0]["gloo_num_threads"]
    assert all(r == {"backend": "ProcessGroupGloo", "gloo_num_threads": real} for r in reference), reference
    assert relayed.getvalue().count("the group's gloo backend: _ProcessGroupWrapper") == world_size, relayed.getvalue()
    if detail_error is not None:
        assert detail_error.exc_type == "killed by SIGSEGV", detail_error.exc_type
        assert detail_error.traceback == "", "a rank killed by a signal has no Python traceback"
        print(f"WorkerError: rank {detail_error.rank}, exc_type {detail_error.exc_type!r}, "
              f"traceback {detail_error.traceback!r}")
        frames = re.findall(r'File "([^"]+distributed\.py)", line (\d+) in _ddp_init_helper', relayed.getvalue())
        assert "Segmentation fault" in relayed.getvalue() and frames, "the fault handler's stack should be relayed"
        path, line = frames[0][0], int(frames[0][1])
        source = "".join(linecache.getline(path, n) for n in range(line - 1, line + 2))
        assert "set_construction_data_and_log" in source, source
        print(f"this run: the rank crashed in {os.path.basename(path)}:{line}: {linecache.getline(path, line).strip()}")
    else:
        assert all(r["backend"] == "_ProcessGroupWrapper" for r in detail_result), detail_result
        logged = [r["gloo_num_threads"] for r in detail_result]
        assert any(n != real for n in logged), (logged, real)
        print(f"this run: DDP was built, logging gloo_num_threads {logged} per rank; gloo really runs {real}")
else:  # another torch version: report what happened instead of asserting 2.14.1's behaviour
    print(f"torch {torch.__version__}: DETAIL + DDP gave {detail_error or detail_result!r}")

# %% [markdown]
# ### Where is each rank stuck?
#
# Without DETAIL a mismatch of collectives just hangs. `hang_worker` is the classic one: rank 0
# all-reduces while every other rank waits in a barrier. Neither call ever completes.
#
# The launch gets `timeout=hang_timeout_s`. The worker waits on a group whose collective timeout
# is ten times that, so the launch's timeout comes first. A short group timeout would end the
# wait with gloo's error, as above, and leave no hang to diagnose. One launch: worker start-up
# plus the wait.

# %%
def hang_worker(rank, world_size, group_timeout_s):
    group = dist.new_group(timeout=datetime.timedelta(seconds=group_timeout_s))
    t = torch.tensor([rank + 1.0])
    if rank == 0:
        dist.all_reduce(t, group=group)  # waits for the others' all_reduce
    else:
        dist.barrier(group=group)  # waits for rank 0's barrier
    return t.item()


t0 = time.perf_counter()
hang = None
try:
    launch(hang_worker, world_size, 10 * hang_timeout_s, backend="gloo", timeout=hang_timeout_s)
except LaunchTimeout as e:
    hang = e
launch_s["2 where stuck"] = time.perf_counter() - t0

# %% [markdown]
# Before it ends the ranks, the launcher asks each for its Python stack, with the standard
# library's `faulthandler`. The cell prints the error as the notebook shows it uncaught, through
# IPython's `_render_traceback_` hook.
#
# **Claim:** the launch raises `LaunchTimeout` with every rank unfinished. Its message shows, per
# rank, the torch call the rank is in and the line of **our cell** that called it. Rank 0 is in
# `torch.distributed.all_reduce`, every other rank in `torch.distributed.barrier`. No library
# frames are shown. `.stacks` keeps each rank's full dump, torch's frames included.
#
# Fix such a hang on the line it names. To have torch name the mismatch at once instead, run with
# `TORCH_DISTRIBUTED_DEBUG=DETAIL`, as in "Collective mismatches" above.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: every rank's stuck line in our cell, and no library frames
assert isinstance(hang, LaunchTimeout), "the mismatched launch should have timed out"
shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(hang._render_traceback_()))  # without colour codes
print(shown)
assert hang.ranks_not_finished == list(range(world_size)), hang.ranks_not_finished
assert set(hang.stacks) == set(range(world_size)), f"a dump per rank: {sorted(hang.stacks)}"
assert all("distributed_c10d.py" in dump for dump in hang.stacks.values()), "full dumps keep torch's frames"
cell_lines = linecache.getlines(hang_worker.__code__.co_filename)  # the cell that defines hang_worker
where = {int(m[1]): m[2] for m in re.finditer(r"^  rank (\d+)(.*?)(?=^  rank |\Z)", shown, re.M | re.S)}
assert sorted(where) == list(range(world_size)), shown
for r, part in where.items():
    call, source = ("all_reduce", "dist.all_reduce(t, group=group)") if r == 0 else ("barrier", "dist.barrier(group=group)")
    line = 1 + next(i for i, text in enumerate(cell_lines) if text.strip().startswith(source))
    assert part.startswith(f" in torch.distributed.{call}, called from:"), f"rank {r}: {part}"
    assert re.search(rf"Cell In\[\d+\], line {line}, in hang_worker\n +{re.escape(source)}", part), f"rank {r}: {part}"
assert "distributed_c10d.py" not in shown and "rank_main.py" not in shown, "library frames hidden"

# %% [markdown]
# #### A script under `torchrun`: the error file
#
# `torchrun`, that is `python -m torch.distributed.run`, starts a script's ranks. When one fails,
# it ends the others. Its failure summary names the first rank that failed: the **root cause**.
#
# Decorate the script's entry function with `@record` from
# `torch.distributed.elastic.multiprocessing.errors`; see the
# [docs](https://pytorch.org/docs/stable/elastic/errors.html). A rank that raises then writes its
# traceback as JSON to the file named by `TORCHELASTIC_ERROR_FILE`, and the summary shows it.
#
# The cell writes a two-rank script whose rank 1 raises, with and without `@record`. It runs each
# under `torchrun --standalone --nproc-per-node=2`, as new Python processes.
#
# **Claim:** both runs fail with exit code 1 and name rank 1 as the root cause. With `@record` the
# summary names rank 1's error file and shows its traceback down to the `ValueError`. Without it
# the error file is `<N/A>` and the summary has no traceback. Rank 1's traceback is then only in
# the ranks' output printed before the summary.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: torchrun's root cause, with and without @record
script = """import os
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    rank = int(os.environ["RANK"])  # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE
    if rank == 1:
        raise ValueError(f"rank {rank}: a corrupt batch")
    print(f"rank {rank}: done")


if __name__ == "__main__":
    main()
"""
without_record = script.replace("from torch.distributed.elastic.multiprocessing.errors import record\n", "").replace("@record\n", "")
folder, runs = tempfile.mkdtemp(), {}
t0 = time.perf_counter()
try:
    for name, text in (("with @record", script), ("without @record", without_record)):
        path = os.path.join(folder, f"train_{len(runs)}.py")
        with open(path, "w") as f:
            f.write(text)
        runs[name] = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                     f"--log-dir={os.path.join(folder, 'logs')}", path],  # its error files go there too
                                    capture_output=True, text=True, timeout=180)
finally:
    shutil.rmtree(folder)
launch_s["2 torchrun x2"] = time.perf_counter() - t0
summaries = {}
for name, run in runs.items():
    assert run.returncode == 1, f"{name}: exit code {run.returncode}\n{run.stderr[-2000:]}"
    summaries[name] = run.stderr[run.stderr.index("Root Cause (first observed failure)"):]
    assert re.search(r"rank +: 1 \(local_rank: 1\)", summaries[name]), f"{name}: {summaries[name]}"
assert re.search(r"error_file: \S+error\.json", summaries["with @record"]), summaries["with @record"]
assert re.search(r"traceback : Traceback.*\n +ValueError: rank 1: a corrupt batch", summaries["with @record"], re.S)
assert "error_file: <N/A>" in summaries["without @record"], summaries["without @record"]
assert "Traceback" not in summaries["without @record"] and "ValueError" not in summaries["without @record"]
assert "ValueError: rank 1: a corrupt batch" in runs["without @record"].stderr.split("Root Cause")[0]
for name, text in summaries.items():
    print(f"torchrun's summary, {name}:\n" + text.strip().rstrip("=").strip() + "\n")

# %% [markdown]
# ### Init timeouts, and reading a worker traceback
#
# `init_process_group` blocks until `world_size` processes have joined the rendezvous. Say a
# job's `WORLD_SIZE` counts one process more than were started: a typo, or a node that never
# came up. It waits there, by default for 30 minutes with gloo. `init_alone_worker` is that
# process. Started alone, it asks for a world of 2 with `timeout=collective_timeout_s`.
#
# Read a relayed traceback from the bottom, the exception, up to the **last frame in your own
# code**. A function defined in a cell travels to the worker with its cell's file name and
# source lines. Shown in a cell, the `WorkerError` lists only your own frames; `.traceback`
# keeps every frame. The launch takes one worker's start-up plus the timeout.
#
# **Claim:** the launcher relays a `WorkerError` with `rank = 0`, `exc_type = "DistStoreError"`
# and `1/2 clients joined`. The store reports one second more than `timeout`. The traceback
# shows a frame of `init_alone_worker`, then torch's `TCPStore`. That frame names this kernel's
# cell file and our call to `init_process_group`, the line this kernel's `linecache` holds.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the relayed DistStoreError, and our own line in its traceback
def init_alone_worker(rank, world_size, timeout_s):
    dist.destroy_process_group()  # the launcher's group; now a job of world_size + 1 processes
    port = free_port()
    print(f"init_process_group(world_size={world_size + 1}, rank={rank}, timeout={timeout_s} s) at port {port} ...")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size + 1, timeout=datetime.timedelta(seconds=timeout_s))


t0 = time.perf_counter()
init_error = None
try:
    launch(init_alone_worker, 1, T, backend="gloo", timeout=120)
except WorkerError as e:
    init_error = e
launch_s["2 init timeout"] = time.perf_counter() - t0
assert init_error is not None, "init_process_group with a missing rank should have failed"
assert (init_error.rank, init_error.exc_type) == (0, "DistStoreError"), (init_error.rank, init_error.exc_type)
assert "waiting for clients" in init_error.message and "1/2 clients joined" in init_error.message, init_error.message
reported_s = int(init_error.message.split("Timed out after ")[1].split(" seconds")[0])
assert reported_s == round(T) + 1, f"the store reports {reported_s} s for a {T:g} s timeout"
tb = init_error.traceback
cell_file = init_alone_worker.__code__.co_filename
# the worker names this kernel's cell file, and shows the cell's line from the source sent with it
ours = re.findall(rf'File "{re.escape(cell_file)}", line (\d+), in init_alone_worker', tb)
assert ours and "TCPStore" in tb.split("in init_alone_worker")[-1], tb[-1500:]
relayed_next = tb.split(f'line {ours[-1]}, in init_alone_worker\n')[1].splitlines()[0].strip()
assert relayed_next.startswith("dist.init_process_group("), f"the worker's line for the cell's frame: {relayed_next}"
our_line = linecache.getline(cell_file, int(ours[-1])).strip()  # this kernel has the cell's source
assert our_line == relayed_next, (our_line, relayed_next)
print(f"launch -> WorkerError after {launch_s['2 init timeout']:.1f} s (timeout {T:g} s): rank {init_error.rank}, "
      f"{init_error.exc_type}: {init_error.message}")
print("last line of the relayed traceback:", tb.strip().splitlines()[-1])
print(f"last frame in our code, as relayed: line {ours[-1]}, in init_alone_worker; next line: {relayed_next}")
print(f"line {ours[-1]} of that cell, from this kernel's linecache: {our_line}")

# %%
total_s = time.perf_counter() - t_notebook
print(f"lesson 06c ran in {total_s:.0f} s; seconds per launch (start-up included; the hang demonstrations include "
      f"their deliberate timeouts, collective_timeout_s = {T:g} s, hang_timeout_s = {hang_timeout_s:g} s):")
pd.Series(launch_s, name="seconds").round(1).to_frame()

# %% [markdown]
# ## What we saw
#
# * **Seeds:** same-seed init is bit-identical everywhere, and DDP broadcasts rank 0's anyway.
#   Augmentation needs per-rank seeds. Results are bit-identical across ranks. Across world
#   sizes they are equal up to rounding, since the order of float32 additions depends on the
#   split. Once per-rank randomness enters, they are only statistically equivalent.
# * **Debugging:** DETAIL catches collective mismatches. With gloo in torch 2.14.1 it also breaks
#   DDP's constructor: a crash or a wrong log. Short `timeout`s turn hangs into errors you can
#   read. A launch that times out shows each rank's stuck line in your code; `.stacks` has the
#   full stacks. Under torchrun, `@record` puts the failing rank's traceback into the failure
#   summary. Read a relayed traceback from the bottom up to your own code.
#
# ## Going further
#
# Launch `helpers.engine.faults.fail_at` with `moment="during"`, then
# `helpers.engine.faults.skip_collective` with a short `timeout`. For each, read
# `WorkerError.rank`, `.exc_type` and the last frame of `.traceback` in your own code, or
# `LaunchTimeout.ranks_not_finished`. Say which rank was the root cause.
#
# ## Exercises
#
# Each asks for a value: predict it by hand first. Then set `answer_N` in place of `None` and run
# the check cell below it. It prints "correct" or "not yet" with a hint. In the full lesson a
# collapsed solution follows each check; click the "…" or the bar on its left to open it.
# Student copies leave the solutions out. Every solution runs when the full lesson runs, so each
# is known to pass its check.

# %% [markdown]
# ### Exercise 1: another order of float32 additions
#
# Take section 1's sum with the items in another order, `[1, 1e8, 1, -1e8]` in float32. What does
# each of the three orders give? They are left to right in one process, strided over 2 ranks,
# and contiguous halves over 2 ranks. Strided means rank `r` takes items `r, r + 2`. Answer with
# a list of three numbers.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1
# expected: torch's float32 sums in the three orders of section 1
v1 = torch.tensor([1.0, 1e8, 1.0, -1e8], dtype=torch.float32)
expected_1 = [float(v1[0] + v1[1] + v1[2] + v1[3]), float(v1[0::2].sum() + v1[1::2].sum()), float(v1[:2].sum() + v1[2:].sum())]
check_answer("ex1", answer_1, expected_1,
             hint="1e8 + 1 rounds back to 1e8 in float32; which pairs meet first in each order?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# left to right: 1 + 1e8 = 1e8 (rounded), + 1 = 1e8 again, - 1e8 = 0. Strided: (1 + 1) + (1e8 - 1e8) = 2.
# Contiguous: (1 + 1e8) + (1 - 1e8) = 1e8 - 1e8 = 0.
f = np.float32
solution_1 = [float(((f(1) + f(1e8)) + f(1)) + f(-1e8)), float((f(1) + f(1)) + (f(1e8) + f(-1e8))),
              float((f(1) + f(1e8)) + (f(1) + f(-1e8)))]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: which rank is the root cause?
#
# In `corrupt_batch_worker` below, the last rank raises before the all-reduce that every other
# rank waits in. `launch` raises one `WorkerError` and lists the other ranks' fates under it.
# Which rank does the `WorkerError` name, and with which `exc_type`? Answer with a list
# `[rank, exc_type]` for this run's `world_size`. The check cell runs it on real ranks.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, on real ranks
def corrupt_batch_worker(rank, world_size):
    t = torch.ones(1)
    if rank == world_size - 1:
        raise ValueError(f"rank {rank}: a corrupt batch")
    dist.all_reduce(t)  # the other ranks wait here for the last rank
    return t.item()


# expected: what launch reports, read from a real launch
try:
    launch(corrupt_batch_worker, world_size, backend="gloo", timeout=120)
    root_cause = None
except WorkerError as e:
    root_cause = e
    print(f"{e}"[:600])
expected_2 = [root_cause.rank, root_cause.exc_type]
check_answer("ex2", answer_2, expected_2,
             hint="the ranks that waited fail too (their peer closed the connection): which one raised first, and what?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# Only the last rank reaches the `raise`; the others fail afterwards, in the all-reduce whose peer went away.
solution_2 = [world_size - 1, "ValueError"]
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: fix the hang
#
# `fixed_worker` below is section 2's `hang_worker`, fixed on the line the `LaunchTimeout` named.
# Every rank makes the same call, `dist.all_reduce(t, group=group)`, on its `t = [rank + 1]`.
# What does each rank return? Answer with a list of `world_size` numbers. The check cell runs it
# on real ranks, under the same `timeout` the hang ran past.

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 3, on real ranks
def fixed_worker(rank, world_size, group_timeout_s):
    group = dist.new_group(timeout=datetime.timedelta(seconds=group_timeout_s))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=group)  # the fix: the same collective on every rank
    return t.item()


# expected: what the fixed worker returns on real ranks (it completes within hang_timeout_s)
expected_3 = launch(fixed_worker, world_size, 10 * hang_timeout_s, backend="gloo", timeout=hang_timeout_s)
check_answer("ex3", answer_3, expected_3, hint="all_reduce sums t over the ranks, and rank r holds r + 1")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# all_reduce leaves the sum 1 + 2 + ... + world_size on every rank.
solution_3 = [world_size * (world_size + 1) / 2] * world_size
check_answer("ex3", solution_3, expected_3, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [06d silent DDP bugs](06d_silent_bugs.ipynb): find DDP mistakes that raise no error, with a value check or the three general checks.
# <!-- next:end -->
