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
# # 06 · DDP in practice: the pitfalls lab
#
# **The question:** once `DistributedDataParallel` (DDP) runs at all, which mistakes make it
# hang, crash or — worse — silently train the wrong thing, and how do we *prove* each fix?
#
# Nine pitfalls, each in the same shape: the symptom as a learner meets it (reproduced on CPU
# with the gloo backend; where it would hang, a short timeout ends it and the error is caught
# and shown), then the fix, with the values asserted (`torch.testing.assert_close` or `assert`
# with a message) in the cell right after the prose that states them.
#
# 1. gradient accumulation with `no_sync()` · 2. uneven inputs and `Join` · 3. unused
# parameters · 4. unequal per-rank batch sizes · 5. BatchNorm · 6. checkpoints ·
# 7. evaluation and logging · 8. seeds and determinism · 9. debugging
#
# **What runs where**
#
# | part | CPU only (CI) | with GPUs |
# |---|---|---|
# | sections 1-9, worker side | **one** launch of `world_size` processes, backend `gloo` (pinned: the hang demonstrations need gloo's catchable timeout) | the same, on CPU |
# | section 2, the launcher's view of a hang | one launch, ended by `LaunchTimeout` after `hang_timeout_s` | same |
# | section 5, real `SyncBatchNorm` | **skipped, and says so** (it raises on CPU: shown); the all-reduced-sums reference runs | runs with `nccl` when there are at least `world_size` GPUs, compared with the reference |
# | section 5, DataParallel's BatchNorm | real `nn.DataParallel` on CPU (no devices: it just calls the module) + a labelled CPU **emulation** of DP on several devices | real DP on the visible GPUs, compared with the emulation |
# | section 9, debugging | two short launches (a rank killed by a signal; a worker traceback) | same |
#
# Terms (see the [glossary](../docs/GLOSSARY.md)): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [process group](../docs/GLOSSARY.md#process-group), [all-reduce](../docs/GLOSSARY.md#all-reduce),
# [bucket](../docs/GLOSSARY.md#bucket), [DDP](../docs/GLOSSARY.md#ddp), [DP](../docs/GLOSSARY.md#dp),
# [replica](../docs/GLOSSARY.md#replica).
#
# **New here:** DDP communication hooks (to count all-reduces), `Join`,
# `find_unused_parameters` / `static_graph`, `broadcast_buffers`, `SyncBatchNorm`,
# checkpointing under DDP, distributed evaluation, `TORCH_DISTRIBUTED_DEBUG`. Everything was
# checked against torch 2.14.1; where it differs from folklore, the notebook says what really
# happens. Run time: about 1-1.5 minutes on 2 CPU cores with the defaults (four launches;
# most of it is worker start-up and the deliberate timeouts), about 2 minutes with
# `world_size = 4`.

# %% tags=["parameters"]
# Parameters (papermill overrides them; these defaults are smoke-sized and also what a learner runs)
world_size = 2  # DDP ranks (processes) of the main launch; 2 or more
seed = 0  # seeds every model and data set
accum_steps = 4  # k, micro-batches per optimizer step in section 1
seed_steps = 30  # SGD steps of the seeds experiment in section 8
collective_timeout_s = 3.0  # seconds a rank waits in a hung collective before gloo raises
hang_timeout_s = 20.0  # launch timeout of section 2's hang, which the launcher itself ends

# %%
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(world_size=(world_size, int), seed=(seed, int), accum_steps=(accum_steps, int),
                 seed_steps=(seed_steps, int), collective_timeout_s=(collective_timeout_s, float),
                 hang_timeout_s=(hang_timeout_s, float))
check_value("world_size", world_size, world_size >= 2, "at least 2 (the pitfalls are between ranks)")
check_value("world_size", world_size, 64 % world_size == 0,
            "a divisor of 64 (sections 7 and 8 split 64 samples evenly): 2, 4 or 8")
check_value("accum_steps", accum_steps, accum_steps >= 1, "at least 1")
check_value("seed_steps", seed_steps, seed_steps >= 1, "at least 1")
check_value("collective_timeout_s", collective_timeout_s, collective_timeout_s >= 1.0,
            "at least 1 second (gloo's smallest useful timeout here)")
check_value("hang_timeout_s", hang_timeout_s, hang_timeout_s >= 5.0,
            "at least 5 seconds (worker start-up counts against it)")

# %%
import contextlib
import io
import linecache
import os
import re
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import psutil
import torch
from IPython.display import Markdown, display
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.testing import assert_close

from helpers.launch import LaunchTimeout, WorkerError, launch
from helpers.pitfalls import (
    ACCUMULATION_VARIANTS,
    EVAL_HANG_CASES,
    SECTIONS,
    PitfallsConfig,
    accumulation_reference,
    bn_batches,
    classification_data,
    classifier_model,
    config_dict,
    detail_ddp_worker,
    emulated_dp_batchnorm,
    env_var,
    evaluate,
    float32_sum_orders,
    init_alone_worker,
    is_timeout_error,
    join_expected_grads,
    join_inputs,
    parse_unused_parameter_error,
    pitfalls_worker,
    seeded_training,
    simulate_bn_buffers,
    syncbn_gpu_worker,
    unequal_batch_data,
    unequal_batch_reference,
    uneven_hang_worker,
)

t_notebook = time.perf_counter()
n_gpus = torch.cuda.device_count()
ckpt_tmp = tempfile.TemporaryDirectory(prefix="ddp-lab-nb06-")  # section 6 writes its checkpoint here
config = PitfallsConfig(seed=seed, accum_steps=accum_steps, seed_steps=seed_steps,
                        collective_timeout_s=collective_timeout_s, ckpt_dir=ckpt_tmp.name)
config.check(world_size)  # raises ValueError naming the setting that does not fit world_size
T = config.collective_timeout_s
print(f"torch {torch.__version__}; CUDA GPUs visible: {n_gpus}; world_size = {world_size}")
pd.DataFrame({"value": config_dict(config)}).drop(index="ckpt_dir")

# %% [markdown]
# ## 0. One launch for the worker side of every section
#
# Starting processes costs seconds (`import torch` in every worker), so
# `helpers.pitfalls.pitfalls_worker` runs the worker side of sections 1-9 in **one** launch
# and returns one dict per section; the cells below read them from `R[section][rank]`.
# Worker prints and warnings appear below prefixed `[rank r]` (some are part of the lessons:
# DDP's `find_unused_parameters` warning in section 3, the `broadcast_buffers` deprecation
# warning in section 5, rank 0's `saved` line in section 6, the rank-0-only validation line in
# section 7).
#
# **How a hang is shown without hanging the notebook.** A section that demonstrates a hang
# builds its DDP model on a fresh process group,
# `dist.new_group(timeout=collective_timeout_s)`: the rank left waiting in a collective gets
# gloo's timeout error after `collective_timeout_s` seconds (in a real job: after gloo's
# default 30 minutes), catches it, records it, and the next section carries on with the
# default group. With NCCL a timed-out collective is handled by a watchdog that tears the
# process down instead of raising, so this notebook pins `backend="gloo"`.
#
# The next cell takes about 20 s with 2 ranks on a 2-core machine (40 s with 4 ranks): worker
# start-up, and three deliberate `collective_timeout_s` waits.

# %%
t0 = time.perf_counter()
results = launch(pitfalls_worker, world_size, config, backend="gloo", timeout=300)
main_launch_s = time.perf_counter() - t0
ckpt_path = Path(ckpt_tmp.name)
ckpt_tmp.cleanup()  # section 6 is done with it; nothing may be left behind
assert not ckpt_path.exists(), f"the temporary checkpoint directory {ckpt_path} should be gone"
R = {name: [res[name] for res in results] for name in SECTIONS}
print(f"one launch of {world_size} ranks ran sections 1-9 in {main_launch_s:.1f} s "
      f"(of which the deliberate timeouts: 3 x {T:g} s); seconds per section and rank:")
pd.DataFrame([res["seconds"] for res in results], index=[f"rank {r}" for r in range(world_size)]).round(2)

# %% [markdown]
# ## 1. Gradient accumulation with `no_sync()`
#
# Accumulating `k` micro-batches before one optimizer step is the usual way to get a large
# global batch on little memory. Under DDP every backward all-reduces the gradients — unless
# it runs under `ddp.no_sync()`, which defers the all-reduce to the first synchronised
# backward, which then all-reduces the **accumulated** gradients.
#
# The toy: `Linear(4, 1)` in `float64`, MSE loss, `k = accum_steps` micro-batches of 2 samples
# per rank, each micro-batch loss divided by `k` (so the `k` gradients add up to the mean over
# the `k * 2` samples). Six variants of the loop
# (`helpers.pitfalls.ACCUMULATION_VARIANTS`), each a fresh model, one optimizer step.
#
# **How communication is measured:** a DDP communication hook
# (`helpers.pitfalls.counting_allreduce_hook`, registered with `ddp.register_comm_hook`)
# counts every **bucket** DDP hands to the all-reduce and its bytes
# (`bucket.buffer().numel() * element_size()`), then calls torch's default all-reduce hook,
# so the gradients are unchanged. This model fits in one bucket: 5 `float64` parameters = 40
# bytes per all-reduce.
#
# **Claims:**
#
# * `no_sync()` on micro-batches `0 .. k-2` and a synchronised last one gives the same
#   gradient as one batch `k` times larger, and as one process on the whole global batch
#   (`accumulation_reference`), with **1** all-reduce per optimizer step instead of `k`:
#   `k` times fewer bytes on the wire.
# * Synchronising every micro-batch gives the same gradient too (averaging already-averaged
#   values changes nothing), at `k` times the communication.
# * **Off by one** — synchronising the *first* micro-batch and `no_sync()` on the rest — leaves
#   each rank with `average(micro-batch 0) + its own local micro-batches 1..k-1`: the ranks'
#   gradients differ, and after one SGD step the replicas' parameters **diverge**. Nothing
#   raises.
# * What decides is the **forward**: DDP decides at the end of the forward whether the next
#   backward will all-reduce (the `no_sync` docs: "The forward pass should be included inside
#   the context manager, or else gradients will still be synchronized"). Forward outside,
#   backward inside: `k` all-reduces (no saving, still correct). Forward inside, backward
#   outside: 1 all-reduce, correct. The readable rule — put forward *and* backward inside —
#   is the safe one.

# %%
ref = accumulation_reference(world_size, config)  # one process, whole global batch, float64
acc = R["accumulation"]
k = config.accum_steps
bytes_per_allreduce = (config.features + 1) * 8  # one bucket of float64 parameters
expected_calls = {"no_sync_all_but_last": 1, "one_big_batch": 1, "sync_every_micro_batch": k,
                  "off_by_one": 1, "forward_outside": k, "backward_outside": 1}
rows = []
for variant, description in ACCUMULATION_VARIANTS.items():
    per_rank = [a[variant] for a in acc]
    calls, nbytes = per_rank[0]["allreduce_calls"], per_rank[0]["allreduce_bytes"]
    divergence = max(float((p["weight_after"] - per_rank[0]["weight_after"]).abs().max()) for p in per_rank)
    equal_ref = all(torch.allclose(p["grad_weight"], ref["weight"]) and torch.allclose(p["grad_bias"], ref["bias"])
                    for p in per_rank)
    for r, p in enumerate(per_rank):
        assert (p["allreduce_calls"], p["allreduce_bytes"]) == (calls, nbytes), f"{variant}: ranks disagree on the count"
    assert calls == expected_calls[variant], f"{variant}: {calls} all-reduces per step, expected {expected_calls[variant]}"
    assert nbytes == calls * bytes_per_allreduce, f"{variant}: {nbytes} bytes, expected {calls} x {bytes_per_allreduce}"
    if variant == "off_by_one":
        assert not equal_ref, "off by one: the gradient should NOT equal the reference on every rank"
        assert divergence > 1e-6, f"off by one: the replicas should diverge after the step (max diff {divergence:g})"
    else:
        for r, p in enumerate(per_rank):
            assert_close(p["grad_weight"], ref["weight"], msg=f"{variant}, rank {r}: weight gradient != one process")
            assert_close(p["grad_bias"], ref["bias"], msg=f"{variant}, rank {r}: bias gradient != one process")
            assert torch.equal(p["weight_after"], per_rank[0]["weight_after"]), f"{variant}: replicas differ after the step"
    rows.append({"variant": variant, "what the loop does": description, "all-reduces per step": calls,
                 "bytes all-reduced (per rank)": nbytes, "gradient = one process?": equal_ref,
                 "max |Δ weight| across ranks after the step": divergence})
saving = acc[0]["sync_every_micro_batch"]["allreduce_bytes"] / acc[0]["no_sync_all_but_last"]["allreduce_bytes"]
assert saving == k, f"no_sync should all-reduce {k} times fewer bytes, got a factor {saving:g}"
table1 = pd.DataFrame(rows).set_index("variant")
print(f"accumulating k = {k} micro-batches with no_sync: {saving:g}x fewer bytes all-reduced "
      f"({1 - 1 / k:.0%} of the communication saved); off by one: replicas differ by up to "
      f"{table1.loc['off_by_one', 'max |Δ weight| across ranks after the step']:.3g} after ONE step")
table1

# %%
fig, (ax_b, ax_d) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
names = list(table1.index)
bars = ax_b.barh(names, table1["bytes all-reduced (per rank)"], color="tab:blue")
ax_b.bar_label(bars, fmt="%d B", fontsize=8)
ax_b.set_xlabel("bytes all-reduced per optimizer step, per rank (bytes)")
ax_b.set_title(f"Communication per optimizer step (k = {k})")
ax_b.invert_yaxis()
bars = ax_d.barh(names, table1["max |Δ weight| across ranks after the step"], color="tab:red")
ax_d.bar_label(bars, fmt="%.3g", fontsize=8)
ax_d.set_xlabel("max |weight(rank r) - weight(rank 0)| after one SGD step (weight units)")
ax_d.set_title("Do the replicas stay identical?")
ax_d.set_yticks(range(len(names)), [""] * len(names))
ax_d.invert_yaxis()
plt.show()

# %% [markdown]
# ## 2. Uneven inputs: the extra step hangs; `Join` completes it
#
# Rank `r` gets `2 + r` batches (`join_inputs`: one number each, `10 r + i + 1`: rank 0 sees
# 1, 2; rank 1 sees 11, 12, 13; ...). The model is `y = w x` with `w = 1` and loss `y.sum()`,
# so a rank's local gradient **is** its input, and the all-reduced gradient shows which ranks
# contributed.
#
# **Claim (without `Join`):** the first two steps all-reduce normally (for 2 ranks:
# `(1 + 11) / 2 = 6`, then `7`). At step 2 rank 0 has left its loop; every other rank waits
# in the gradient all-reduce for a rank that never comes. On this demo's short-timeout group
# gloo raises after `collective_timeout_s` seconds ("Timed out waiting ... for recv/send
# operation to complete"; gloo sometimes words the same event "Application timeout caused
# pair closure": `is_timeout_error` accepts both); rank 0 finished without any error.

# %%
J = R["join"]
base = config.join_base_batches
inputs = [join_inputs(r, base) for r in range(world_size)]
expected_initial = join_expected_grads(world_size, base, divide_by_initial_world_size=True)
expected_active = join_expected_grads(world_size, base, divide_by_initial_world_size=False)
for r, res in enumerate(J):
    nj = res["no_join"]
    assert nj["grads"] == expected_initial[r][:base], f"rank {r}: the first {base} steps should all-reduce normally"
    if r == 0:
        assert nj["error"] is None, f"rank 0 ran out of batches first and should finish cleanly: {nj['error']}"
    else:
        assert is_timeout_error(nj["error"]), f"rank {r} should time out: {nj['error']}"
        assert nj["seconds"] >= 0.9 * T, f"rank {r} waited {nj['seconds']:.1f} s, expected about {T:g} s"
    print(f"rank {r}: batches {inputs[r]}, gradients {nj['grads']}, "
          + (f"then after {nj['seconds']:.1f} s: {nj['error']}" if nj["error"] else "finished"))
if world_size == 2:
    assert J[0]["no_join"]["grads"] == [6.0, 7.0], "2 ranks: the first two gradients should be 6 and 7"

# %% [markdown]
# **Claim (with `Join`):** the same loop inside
# `Join([ddp], divide_by_initial_world_size=...)`
# (`torch.distributed.algorithms.join.Join`; `ddp.join()` is the same context manager)
# completes on every rank. A rank that has run out of batches *joins*: it shadows the others'
# all-reduces with zeros. So at step `i`, with `A_i` the ranks that still have a batch, the
# gradient is `sum(x) over A_i` divided by
#
# * `world_size` with `divide_by_initial_world_size=True` (the default): the joined ranks
#   count as zero gradients; for 2 ranks rank 1's third gradient is `13 / 2 = 6.5`;
# * `len(A_i)` with `False`: the average over the ranks still training; `13 / 1 = 13`.
#
# The default treats a joined rank as contributing a zero gradient, so the update shrinks as
# ranks run out of data; `False` averages over the ranks still training.

# %%
rows = []
for r, res in enumerate(J):
    for case, expected in (("join_divide_initial", expected_initial[r]), ("join_divide_active", expected_active[r])):
        assert res[case]["error"] is None, f"rank {r}, {case}: Join should complete: {res[case]['error']}"
        assert_close(res[case]["grads"], expected, msg=f"rank {r}, {case}: gradients per step")
    for i, x in enumerate(inputs[r]):
        active = [s for s in range(world_size) if len(inputs[s]) > i]
        rows.append({"rank": r, "step": i, "x (local gradient)": x, "ranks with a batch": str(active),
                     "no Join": J[r]["no_join"]["grads"][i] if i < len(J[r]["no_join"]["grads"]) else "timed out" if r else "-",
                     "Join, divide_by_initial_world_size=True": J[r]["join_divide_initial"]["grads"][i],
                     "Join, divide_by_initial_world_size=False": J[r]["join_divide_active"]["grads"][i]})
if world_size == 2:
    assert J[1]["join_divide_initial"]["grads"][2] == 6.5 and J[1]["join_divide_active"]["grads"][2] == 13.0, \
        "2 ranks: rank 1's third gradient should be 13 / 2 = 6.5 (default) and 13 (divide by active ranks)"
table2 = pd.DataFrame(rows).set_index(["rank", "step"])
table2

# %%
last = world_size - 1  # the rank with the most batches sees every step
steps = range(len(inputs[last]))
fig, ax = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
width = 0.38
for j, (case, label) in enumerate((("join_divide_initial", "divide_by_initial_world_size=True (default)"),
                                   ("join_divide_active", "divide_by_initial_world_size=False"))):
    bars = ax.bar([i + (j - 0.5) * width for i in steps], J[last][case]["grads"], width, label=label)
    ax.bar_label(bars, fmt="%g", fontsize=8)
ax.set_xticks(list(steps), [f"step {i}\n{sum(len(inp) > i for inp in inputs)} rank(s) active" for i in steps])
ax.set_xlabel("step of the longest rank")
ax.set_ylabel("gradient dL/dw on that rank")
ax.set_title(f"Join with uneven inputs ({world_size} ranks, rank r has {base} + r batches)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **What the launcher sees.** The same loop without `Join`, this time on a process group with
# the launch's own timeout (`hang_timeout_s`): nothing raises inside the workers any more; the
# cell simply waits, as a real job would, until `launch` gives up, ends every worker and
# raises `LaunchTimeout` naming the ranks that never finished. (Worker start-up counts
# against the limit too, so on a very slow machine rank 0 may also be listed; the ranks with
# the extra batch always are.) The cell takes `hang_timeout_s`: about 20 s with the default,
# on a 2-core machine or any other.

# %%
t0 = time.perf_counter()
hang = None
try:
    launch(uneven_hang_worker, world_size, base, backend="gloo", timeout=hang_timeout_s)
except LaunchTimeout as e:
    hang = e
waited = time.perf_counter() - t0
assert hang is not None, "the launch without Join should have hung and timed out"
print(f"LaunchTimeout after {waited:.1f} s: ranks_not_finished = {hang.ranks_not_finished}\n{hang}")
assert set(range(1, world_size)) <= set(hang.ranks_not_finished), (
    f"ranks 1..{world_size - 1} (one batch more than rank 0) should be listed: {hang.ranks_not_finished}")
assert waited >= hang_timeout_s, f"the launch returned after {waited:.1f} s, before its {hang_timeout_s:g} s timeout"

def leftover_processes():  # children of this kernel, except multiprocessing's resource tracker
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                left.append(p)
        except psutil.Error:
            pass
    return left

assert not leftover_processes(), f"processes left behind: {leftover_processes()}"
print("no worker process left behind")

# %% [markdown]
# ## 3. Unused parameters
#
# `helpers.pitfalls.TwoHeads` has two `Linear(2, 2)` heads; `forward` returns both outputs,
# the loss uses only `head_a`'s. Iteration `it` feeds `x = [rank + 1 + it] * 2`, so
# `head_a.weight`'s local gradient is `rank + 1 + it` in every entry and its all-reduced
# gradient is the mean over ranks, `(world_size + 1) / 2 + it` (1.5, 2.5, 3.5 for 2 ranks).
# DDP numbers parameters in `model.parameters()` order: 0 `head_a.weight`, 1 `head_a.bias`,
# 2 `head_b.weight`, 3 `head_b.bias`.
#
# **Claim (default DDP):** the **first** iteration completes without any error — and its
# gradients were **not** averaged: rank `r` keeps its local `head_a` gradient `r + 1`. (DDP
# all-reduces a bucket when all its parameters have gradients; `head_b`'s never arrive.) The
# error comes at the start of the **next** forward, on every rank:
# `RuntimeError: Expected to have finished reduction in the prior iteration before starting a
# new one. ...`, ending with `Parameter indices which did not receive grad for rank r: 2 3`.
# With the debug level INFO (or DETAIL), the message also names them:
# `Parameters which did not receive grad for rank r: head_b.bias, head_b.weight`.

# %%
U = R["unused"]
names = U[0]["default"]["param_names"]
assert names == ["head_a.weight", "head_a.bias", "head_b.weight", "head_b.bias"], names
for r, u in enumerate(U):
    for case, want_names in (("default", None), ("default_debug_info", ["head_b.bias", "head_b.weight"])):
        rec = u[case]
        assert rec["error_iteration"] == 1, f"rank {r}, {case}: the error should come at iteration 1, got {rec['error_iteration']}"
        assert rec["error"].startswith("Expected to have finished reduction in the prior iteration before starting a new one"), rec["error"][:200]
        parsed = parse_unused_parameter_error(rec["error"])
        assert parsed["rank"] == r and parsed["indices"] == [2, 3], f"rank {r}, {case}: {parsed}"
        assert [names[i] for i in parsed["indices"]] == ["head_b.weight", "head_b.bias"]
        assert parsed["names"] == want_names, f"rank {r}, {case}: names in the message {parsed['names']}"
        g0 = rec["grads"][0]  # the iteration that "worked"
        assert_close(g0["head_a.weight"], torch.full((2, 2), float(r + 1)),
                     msg=f"rank {r}: iteration 0's head_a gradient should be the LOCAL one, {r + 1}, never averaged")
        assert g0["head_b.weight"] is None and g0["head_b.bias"] is None
print("rank 0's error, default debug level:\n" + U[0]["default"]["error"])
print("\n... and its last lines with the debug level INFO:\n" + "\n".join(U[0]["default_debug_info"]["error"].splitlines()[-3:]))

# %% [markdown]
# **Claims (the fixes):**
#
# * `find_unused_parameters=True`: three iterations complete; on every rank `head_b`'s
#   gradients stay `None` and `head_a`'s are the average, `(world_size + 1) / 2 + it`. (The
#   launch output above shows DDP's warning "find_unused_parameters=True was specified ... but
#   did not find any unused parameters in the forward pass": its search starts from the
#   returned outputs and reaches `head_b` through the output the loss ignores. The gradients
#   show the run is nonetheless right.)
# * `static_graph=True` **works only if the unused head's output is not returned**
#   (`TwoHeads(return_b=False)`): then it gives the same gradients. If `forward` returns an
#   output the loss ignores (the model above), torch 2.14.1 averages iteration 0, leaves
#   iteration 1's `head_a` gradients **un-averaged** (each rank keeps its own: `r + 2`), and
#   raises at iteration 2 ("... this is not compatible with static_graph set to True").
#   This is pytorch/pytorch issue #97030: `static_graph` is not a drop-in replacement for
#   `find_unused_parameters`.

# %%
rows = []
mean_rank = (world_size + 1) / 2
for r, u in enumerate(U):
    for case in ("find_unused_parameters", "static_graph_output_dropped"):
        rec = u[case]
        assert rec["error"] is None and len(rec["grads"]) == 3, f"rank {r}, {case}: {rec['error']}"
        for it, g in enumerate(rec["grads"]):
            assert_close(g["head_a.weight"], torch.full((2, 2), mean_rank + it),
                         msg=f"rank {r}, {case}, iteration {it}: head_a gradient should be averaged")
            assert_close(g["head_a.bias"], torch.ones(2), msg=f"rank {r}, {case}: head_a.bias gradient")
            assert g["head_b.weight"] is None and g["head_b.bias"] is None, f"rank {r}, {case}: head_b grads should stay None"
    rec = u["static_graph_output_returned"]
    assert rec["error_iteration"] == 2 and "static_graph" in rec["error"], f"rank {r}: {rec['error_iteration']} {rec['error']}"
    assert_close(rec["grads"][0]["head_a.weight"], torch.full((2, 2), mean_rank), msg="static_graph: iteration 0 averaged")
    assert_close(rec["grads"][1]["head_a.weight"], torch.full((2, 2), float(r + 2)),
                 msg=f"static_graph with the unused output returned: iteration 1 should be rank {r}'s LOCAL gradient")
    for case, rec in u.items():
        for it in range(3):
            g = rec["grads"][it]["head_a.weight"][0, 0].item() if it < len(rec["grads"]) else "raised" if it == rec["error_iteration"] else "-"
            rows.append({"case": case, "rank": r, "iteration": it, "head_a.weight grad": g})
table3 = pd.DataFrame(rows).pivot(index=["case", "rank"], columns="iteration", values="head_a.weight grad")
table3.columns = [f"iteration {c}" for c in table3.columns]
print(f"averaged value would be {mean_rank:g} + iteration; rank r's local value is r + 1 + iteration")
table3

# %% [markdown]
# ## 4. Unequal per-rank batch sizes
#
# DDP averages the ranks' gradients with equal weight `1 / world_size`, whatever each rank's
# batch size. With per-rank **mean** losses, a sample on a small rank then weighs more than a
# sample on a large one.
#
# Rank `r` holds `r + 1` samples of the global batch `1, 2, ..., N` (2 ranks: `[1]` and
# `[2, 3]`); model `y = w x` at `w = 1`, per-sample loss `y^2`, per-sample gradient `2 x^2`.
#
# **Claim:** for 2 ranks the per-rank mean gradients are `2` and `(8 + 18) / 2 = 13`, so DDP
# gives `(2 + 13) / 2 = 7.5`, while the global mean is `2 (1 + 4 + 9) / 3 = 28 / 3 = 9.33`.
# **Fix:** all-reduce the sample count `N` first and use
# `loss = local sum * world_size / N`: DDP's `1 / world_size` cancels the `world_size` and
# leaves `global sum / N`, the global mean (9.33), on every rank.

# %%
Q = R["unequal"]
hand = unequal_batch_reference(world_size)
shards = unequal_batch_data(world_size)
for r, q in enumerate(Q):
    assert q["n_local"] == r + 1 and q["n_total"] == sum(len(s) for s in shards), f"rank {r}: sample counts {q}"
    assert_close(q["naive"], hand["mean_of_rank_means"], msg=f"rank {r}: per-rank mean losses give the mean of rank means")
    assert_close(q["weighted"], hand["global_mean"], msg=f"rank {r}: the weighted loss should give the global mean")
assert abs(hand["mean_of_rank_means"] - hand["global_mean"]) > 1e-6, "the two should differ with unequal batch sizes"
if world_size == 2:
    assert_close(Q[0]["naive"], 7.5, msg="2 ranks: (2 + 13) / 2 = 7.5")
    assert_close(Q[0]["weighted"], 28 / 3, msg="2 ranks: global mean 28 / 3")
pd.DataFrame([{"rank": r, "samples": shards[r].tolist(), "local mean gradient": float(2 * (shards[r] ** 2).mean()),
               "DDP gradient, per-rank mean loss": q["naive"], "DDP gradient, sum x world_size / N": q["weighted"],
               "single process, global mean": hand["global_mean"]} for r, q in enumerate(Q)]).set_index("rank")

# %% [markdown]
# ## 5. BatchNorm
#
# BatchNorm has **buffers** (`running_mean`, `running_var`, `num_batches_tracked`), updated in
# every training forward from the local batch, and DDP does not all-reduce buffers. Rank `r`'s
# data have mean about `3 r` (`bn_batches`), so per-rank statistics visibly differ.
# `broadcast_buffers` (default `True`) makes DDP broadcast **rank 0's** buffers to every rank
# at the start of a forward (when the previous forward ran with gradients, and at the first);
# then each rank updates them with its own batch. (torch 2.14.1 deprecates the name: the
# launch output shows a `FutureWarning` recommending `forward_sync_buffers`; the difference
# is at construction, checked at the end of this section.)
#
# **Claims**, after `bn_steps` training steps of `BatchNorm1d(3)` under DDP:
#
# * `broadcast_buffers=False`: every rank's running statistics are exactly those of that rank
#   training alone; the ranks disagree.
# * `broadcast_buffers=True`: rank 0's running statistics are those of **rank 0's data
#   alone** (what it received was always its own); every other rank holds rank 0's
#   statistics from before the last step updated with *its own* last batch
#   (`simulate_bn_buffers` predicts both). Neither is the statistic of the global batch,
#   which is what `SyncBatchNorm` tracks (last row of the table).

# %%
B = R["batchnorm"]
C = config.bn_channels
batches = [bn_batches(r, config) for r in range(world_size)]
predicted = {"broadcast_buffers_true": simulate_bn_buffers(batches, True),
             "broadcast_buffers_false": simulate_bn_buffers(batches, False)}
bn_global = nn.BatchNorm1d(C, dtype=torch.float64)  # the global batch at every step: what SyncBatchNorm tracks
for t in range(config.bn_steps):
    bn_global(torch.cat([batches[r][t] for r in range(world_size)]))
rows = []
for r, b in enumerate(B):
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(b["broadcast_buffers_false"][key], b["local"][key], msg=f"rank {r}: broadcast_buffers=False keeps local {key}")
        for case, pred in predicted.items():
            assert_close(b[case][key], pred[r][key], msg=f"rank {r}, {case}: {key} != simulate_bn_buffers")
        assert_close(B[0]["broadcast_buffers_true"][key], B[0]["local"][key], msg=f"rank 0's {key} should be its data alone")
    if r > 0:
        assert not torch.allclose(b["broadcast_buffers_true"]["running_mean"], B[0]["broadcast_buffers_true"]["running_mean"]), \
            f"rank {r}: with broadcast_buffers=True its running_mean still differs from rank 0's after training"
        assert not torch.allclose(b["broadcast_buffers_false"]["running_mean"], B[0]["broadcast_buffers_false"]["running_mean"])
    for case in ("local", "broadcast_buffers_true", "broadcast_buffers_false"):
        rows.append({"case": case, "rank": r, **{f"running_mean[{c}]": float(b[case]["running_mean"][c]) for c in range(C)},
                     **{f"running_var[{c}]": float(b[case]["running_var"][c]) for c in range(C)}})
assert not torch.allclose(B[0]["broadcast_buffers_true"]["running_mean"], bn_global.running_mean), \
    "rank 0's running_mean should differ from the global batch's"
rows.append({"case": "global batch (what SyncBatchNorm tracks)", "rank": "all",
             **{f"running_mean[{c}]": float(bn_global.running_mean[c]) for c in range(C)},
             **{f"running_var[{c}]": float(bn_global.running_var[c]) for c in range(C)}})
pd.DataFrame(rows).set_index(["case", "rank"]).round(4)

# %% [markdown]
# ### SyncBatchNorm
#
# `nn.SyncBatchNorm.convert_sync_batchnorm(model)` replaces every BatchNorm by a
# `SyncBatchNorm`, which normalises with the statistics of the **global** batch.
#
# **Claim (CPU):** in training mode with a process group initialised, its forward on a CPU
# tensor raises `ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or
# privateuseone` (torch 2.14.1). Without a process group — as in this notebook's kernel — it
# silently computes plain BatchNorm instead.
#
# **Claim (what it would give):** `helpers.pitfalls.sync_batchnorm_reference` all-reduces
# `[sum(x), sum(x^2), count]` per channel and normalises each rank's rows with the global
# mean and variance. Each rank's output equals its rows of one `BatchNorm1d` applied to the
# concatenated global batch, and the running statistics equal that BatchNorm's (momentum
# update with the *unbiased* global variance). Real `SyncBatchNorm` runs below only with at
# least `world_size` GPUs (a launch of about 10 s; on a 2-core CPU-only machine the cell takes
# about 0.1 s, as it launches nothing).

# %%
for r, b in enumerate(B):
    assert b["syncbn_error"] is not None and b["syncbn_error"].startswith(
        "ValueError: SyncBatchNorm expected input tensor to be on GPU"), f"rank {r}: {b['syncbn_error']}"
print(f"SyncBatchNorm on CPU, every rank: {B[0]['syncbn_error']}")
assert not torch.distributed.is_initialized(), "this kernel has no process group"
sbn, plain_bn = nn.SyncBatchNorm(C, dtype=torch.float64), nn.BatchNorm1d(C, dtype=torch.float64)
assert_close(sbn(batches[0][0]), plain_bn(batches[0][0]), msg="no process group: SyncBatchNorm = plain BatchNorm")
print("in this kernel (no process group) SyncBatchNorm ran on CPU and equalled plain BatchNorm")
x_global = torch.cat([batches[r][0] for r in range(world_size)])  # step 0 of every rank: the global batch
bn_one = nn.BatchNorm1d(C, dtype=torch.float64)
out_global = bn_one(x_global)
nb = config.bn_batch
for r, b in enumerate(B):
    ref_r = b["syncbn_reference"]
    assert_close(ref_r["out"], out_global[r * nb:(r + 1) * nb].detach(), msg=f"rank {r}: all-reduced-sums output != global BatchNorm rows")
    assert_close(ref_r["running_mean"], bn_one.running_mean, msg=f"rank {r}: running_mean != global BatchNorm")
    assert_close(ref_r["running_var"], bn_one.running_var, msg=f"rank {r}: running_var != global BatchNorm")
print("all-reduced sums reproduce BatchNorm on the global batch: outputs and running statistics match")

if n_gpus >= world_size:
    gpu = launch(syncbn_gpu_worker, world_size, config, backend="nccl", timeout=300)
    for r, g in enumerate(gpu):
        for key in ("out", "running_mean", "running_var"):
            assert_close(g[key], B[r]["syncbn_reference"][key], rtol=1e-5, atol=1e-6,
                         msg=f"rank {r}: real SyncBatchNorm {key} != all-reduced-sums reference")
    display(Markdown(f"**Real `SyncBatchNorm` RAN** on {world_size} GPUs (nccl) and matched the reference."))
else:
    display(Markdown(f"**Real `SyncBatchNorm` SKIPPED:** it needs one GPU per rank (`world_size = {world_size}`, "
                     f"GPUs visible: {n_gpus}). The CPU error above and the all-reduced-sums reference ran instead."))


# %% [markdown]
# ### DataParallel's BatchNorm is different again
#
# `nn.DataParallel` (one process) replicates the module onto every device at each forward and
# runs each replica on its chunk of the batch, so each replica normalises with **its chunk's**
# statistics. The buffers reach the replicas through `comm.broadcast_coalesced`, whose
# outputs for `device_ids[0]` are the original tensors: only replica 0's running-statistics
# update lands in the module; the others update copies that are discarded
# (`torch/nn/parallel/replicate.py`).
#
# **Claims:** on a CPU-only machine `nn.DataParallel(bn)` has `device_ids == []` and simply
# calls the module: BatchNorm over the whole batch. `emulated_dp_batchnorm` (a CPU
# **emulation** of DP on `world_size` devices, not torch's DP) normalises each chunk with its
# own statistics and updates the running statistics from chunk 0 only. With GPUs, real DP is
# compared with the emulation below; otherwise that comparison is skipped and says so.

# %%
def chunk_bn(c):  # what a fresh BatchNorm1d (weight 1, bias 0) outputs in training on chunk c
    return (c - c.mean(0)) / torch.sqrt(c.var(0, unbiased=False) + 1e-5)

chunks = x_global.chunk(world_size)
bn_emu = nn.BatchNorm1d(C, dtype=torch.float64)
out_emu = emulated_dp_batchnorm(bn_emu, x_global, world_size).detach()
assert_close(out_emu, torch.cat([chunk_bn(c) for c in chunks]), msg="emulated DP: each chunk normalised with its own statistics")
assert_close(bn_emu.running_mean, 0.1 * chunks[0].mean(0), msg="emulated DP: running_mean from chunk 0 only")
assert_close(bn_emu.running_var, 0.9 + 0.1 * chunks[0].var(0, unbiased=True), msg="emulated DP: running_var from chunk 0 only")
assert not torch.allclose(bn_emu.running_mean, bn_one.running_mean), "DP's running_mean should differ from the global batch's"
print(f"EMULATED DP on {world_size} devices: running_mean {bn_emu.running_mean.numpy().round(4)} "
      f"(chunk 0 only) vs global batch {bn_one.running_mean.numpy().round(4)}")

if n_gpus == 0:
    bn_cpu = nn.BatchNorm1d(C, dtype=torch.float64)
    dp = nn.DataParallel(bn_cpu)
    out_dp = dp(x_global).detach()
    assert dp.device_ids == [], f"no GPU: DataParallel should have no devices, got {dp.device_ids}"
    assert_close(out_dp, out_global.detach(), msg="DP on CPU is the plain module: whole-batch BatchNorm")
    assert_close(bn_cpu.running_mean, bn_one.running_mean, msg="DP on CPU: whole-batch running statistics")
    display(Markdown("**Real DataParallel on GPUs SKIPPED** (no GPU): on CPU `nn.DataParallel` has no devices and "
                     "called the module once on the whole batch (checked above); the multi-device behaviour is the "
                     "labelled **emulation**."))
else:
    bn_gpu = nn.BatchNorm1d(C, dtype=torch.float64).cuda()
    out_dp = nn.DataParallel(bn_gpu)(x_global.cuda()).detach().cpu()
    bn_check = nn.BatchNorm1d(C, dtype=torch.float64)
    out_check = emulated_dp_batchnorm(bn_check, x_global, min(n_gpus, x_global.shape[0])).detach()
    assert_close(out_dp, out_check, rtol=1e-5, atol=1e-6, msg="real DP output != emulation")
    assert_close(bn_gpu.running_mean.cpu(), bn_check.running_mean, rtol=1e-5, atol=1e-6, msg="real DP running_mean != emulation")
    display(Markdown(f"**Real DataParallel RAN** on {n_gpus} GPU(s) and matched the emulation with {n_gpus} replica(s)."))

# %% [markdown]
# ### `broadcast_buffers=False` versus `forward_sync_buffers=False` (torch 2.14.1)
#
# Both stop the per-forward broadcast. They differ at **construction**, where DDP normally
# broadcasts rank 0's parameters and buffers: `broadcast_buffers=False` (deprecated) skips
# the buffers there too, `forward_sync_buffers=False` does not (the text of the
# `FutureWarning`).
#
# **Claim:** a BatchNorm whose buffers already differ per rank (one local forward) keeps its
# **own** buffers when wrapped with `broadcast_buffers=False`, and holds **rank 0's** after
# `DDP(..., forward_sync_buffers=False)`.

# %%
for r, b in enumerate(B):
    own, fsync = b["wrap_broadcast_buffers_false"], b["wrap_forward_sync_buffers_false"]
    for key in ("running_mean", "running_var"):
        assert_close(own["after"][key], own["before"][key], msg=f"rank {r}: broadcast_buffers=False keeps its own {key}")
        assert_close(fsync["after"][key], B[0]["wrap_forward_sync_buffers_false"]["before"][key],
                     msg=f"rank {r}: forward_sync_buffers=False still broadcasts rank 0's {key} at construction")
    if r > 0:
        assert not torch.allclose(own["after"]["running_mean"], B[0]["wrap_broadcast_buffers_false"]["after"]["running_mean"])
pd.DataFrame([{"rank": r, "running_mean[0] before wrapping": float(b["wrap_broadcast_buffers_false"]["before"]["running_mean"][0]),
               "after DDP(broadcast_buffers=False)": float(b["wrap_broadcast_buffers_false"]["after"]["running_mean"][0]),
               "after DDP(forward_sync_buffers=False)": float(b["wrap_forward_sync_buffers_false"]["after"]["running_mean"][0])}
              for r, b in enumerate(B)]).set_index("rank").round(4)

# %% [markdown]
# ## 6. Checkpoints
#
# **Claims:**
#
# * The wrapper's `state_dict()` keys carry the `module.` prefix (`module.weight`,
#   `module.bias`); a strict `load_state_dict` of it into a bare `Linear` fails with
#   **2 missing** (`weight`, `bias`) and **2 unexpected** (`module.weight`, `module.bias`)
#   keys. `consume_prefix_in_state_dict_if_present(sd, "module.")` repairs such a file; better,
#   save `ddp.module.state_dict()` in the first place.
# * Only rank 0 saves (its `saved checkpoint.pt` line appears once in the launch output), then
#   `dist.barrier()`, then every rank loads with `map_location=<its device>` into a bare model
#   and wraps it again. Model **and optimizer** state (SGD with momentum) are saved, so `n`
#   more steps from the checkpoint give parameters **bit-identical** to the uninterrupted run,
#   on every rank. The directory was a `tempfile.TemporaryDirectory`, removed after the
#   launch.

# %%
CK = R["checkpoint"]
c0 = CK[0]
assert c0["wrapper_keys"] == ["module.weight", "module.bias"], c0["wrapper_keys"]
assert c0["bare_keys"] == ["weight", "bias"], c0["bare_keys"]
assert 'Missing key(s) in state_dict: "weight", "bias"' in c0["strict_error"], c0["strict_error"]
assert 'Unexpected key(s) in state_dict: "module.weight", "module.bias"' in c0["strict_error"], c0["strict_error"]
assert (len(c0["missing_keys"]), len(c0["unexpected_keys"])) == (2, 2), (c0["missing_keys"], c0["unexpected_keys"])
print("strict load of the wrapper's state_dict into a bare Linear:\n" + c0["strict_error"])

sd = dict(c0["wrapper_state_dict"])
consume_prefix_in_state_dict_if_present(sd, "module.")
bare = nn.Linear(config.features, 2)
bare.load_state_dict(sd)  # strict, and it works now
assert_close(bare.weight.detach(), c0["wrapper_state_dict"]["module.weight"], msg="prefix removed: same weights")

rows = []
for r, c in enumerate(CK):
    assert c["files"] == ["checkpoint.pt"], f"rank {r} should see exactly one file after the barrier: {c['files']}"
    assert c["loaded_step"] == config.ckpt_steps, f"rank {r} loaded step {c['loaded_step']}"
    for n in c["resumed"]:
        assert torch.equal(c["resumed"][n], c["uninterrupted"][n]), f"rank {r}, {n}: resumed != uninterrupted (bit-wise)"
        assert torch.equal(c["resumed"][n], CK[0]["resumed"][n]), f"rank {r}, {n}: differs from rank 0 (bit-wise)"
    rows.append({"rank": r, "files seen after the barrier": c["files"], "step loaded": c["loaded_step"],
                 "resumed == uninterrupted (bit-wise)": True, "== rank 0 (bit-wise)": True,
                 "weight[0, :3] after resuming": c["resumed"]["weight"][0, :3].tolist()})
assert not ckpt_path.exists(), "the temporary directory should have been removed"
pd.DataFrame(rows).set_index("rank")

# %% [markdown]
# ## 7. Evaluation and logging
#
# **Right way:** evaluate `ddp.module` (the bare model) on each rank's shard, all-reduce the
# **sums** `[loss_sum, correct, count]`, divide once, print on rank 0 only (the
# `[rank 0] validation: ...` line in the launch output). Because ranks' BatchNorm running
# statistics differ after training (section 5), the worker first broadcasts rank 0's buffers.
#
# **Claim:** the all-reduced loss and accuracy equal one process evaluating the whole
# validation set with rank 0's weights, and every rank holds the same numbers.

# %%
E = R["evaluation"]
model_ref = classifier_model(config.features, config.seed)
model_ref.load_state_dict(E[0]["state_dict"])
x_val, y_val = classification_data(config.eval_samples, config, offset=999)
single = evaluate(model_ref, x_val, y_val)
for r, e in enumerate(E):
    assert_close(e["global"]["loss"], single["loss_sum"] / single["count"], msg=f"rank {r}: all-reduced loss != one process")
    assert_close(e["global"]["accuracy"], single["correct"] / single["count"], msg=f"rank {r}: all-reduced accuracy != one process")
assert_close(sum(e["local"]["loss_sum"] for e in E), single["loss_sum"], rtol=1e-5, atol=1e-5, msg="shard sums add up")
assert sum(e["local"]["count"] for e in E) == config.eval_samples
pd.DataFrame([{"who": f"rank {r} (its shard)", "samples": e["local"]["count"], "mean loss": e["local"]["loss_sum"] / e["local"]["count"],
               "accuracy": e["local"]["correct"] / e["local"]["count"]} for r, e in enumerate(E)]
             + [{"who": "all ranks, all-reduced", "samples": config.eval_samples,
                 "mean loss": E[0]["global"]["loss"], "accuracy": E[0]["global"]["accuracy"]},
                {"who": "one process, whole set", "samples": config.eval_samples,
                 "mean loss": single["loss_sum"] / single["count"], "accuracy": single["correct"] / single["count"]}]
             ).set_index("who").round(4)

# %% [markdown]
# **A forward through the wrapper on rank 0 alone.** Folklore says it hangs. In torch 2.14.1
# it hangs **when that forward starts a collective**, and for a plain training setup that
# happens in two cases (others exist, e.g. inside a `Join` context):
#
# * the model has **buffers** (BatchNorm), `forward_sync_buffers` / `broadcast_buffers` is
#   `True` (the default), and the previous forward ran with gradients enabled (training): DDP's forward begins by
#   broadcasting rank 0's buffers (`_pre_forward` -> `_sync_buffers`). `ddp.eval()` and
#   `torch.no_grad()` do **not** prevent it. Rank 0 is the broadcast's source and waits
#   for receivers ("... for send operation to complete", or "Application timeout caused pair
#   closure");
# * gradients are enabled and this is the first forward after the **first** backward: DDP
#   rebuilds its buckets once, and rank 0 broadcasts the new bucket order
#   (`Reducer::rebuild_buckets` -> `sync_bucket_indices`). After the second step it has
#   already happened and the same call returns.
#
# A `Linear` (no buffers) under `no_grad`, or `ddp.module` in any case, involves no
# collective and returns at once. Each case below ran on its own short-timeout group; only
# rank 0 called forward.

# %%
HANGS = {"bn_wrapper_eval_no_grad", "linear_wrapper_grad_after_1_step"}
rows = []
for case, (kind, steps, call) in EVAL_HANG_CASES.items():
    res = E[0]["hang_cases"][case]
    if case in HANGS:
        assert is_timeout_error(res["result"]), f"{case}: rank 0 should have waited in a collective: {res['result']}"
        assert res["seconds"] >= 0.9 * T, f"{case}: rank 0 waited {res['seconds']:.2f} s, expected about {T:g} s"
    else:
        assert res["result"] == "returned", f"{case}: rank 0's forward should return: {res['result']}"
        assert res["seconds"] < 0.5 * T, f"{case}: took {res['seconds']:.2f} s"
    for r in range(1, world_size):
        assert E[r]["hang_cases"][case]["result"] == "did not call"
    rows.append({"model": kind, "training steps first": steps, "rank 0 alone calls": call,
                 "hangs?": "HANGS" if case in HANGS else "no", "seconds": round(res["seconds"], 2),
                 "result on rank 0": res["result"].split("] ")[-1]})
pd.DataFrame(rows)

# %% [markdown]
# ## 8. Seeds and determinism
#
# **Claims:**
#
# * Model initialisation from the **same** seed is bit-identical on every rank and at every
#   world size (the kernel's world-size-1 run included).
# * It does not even matter for DDP's parameters: initialised from `seed + rank` they differ
#   before wrapping, and `DDP(model)` broadcasts rank 0's parameters (and buffers) at
#   construction, so afterwards every rank holds rank 0's.
# * Data augmentation is the opposite: with the same generator seed on every rank, every rank
#   draws the **same** noise (ranks apply identical "random" perturbations); seed it with
#   `seed + rank`.
# * Without augmentation, training on the fixed global batch split over `world_size` ranks
#   ends bit-identical **across ranks** and equal to one process **up to float32 rounding**;
#   bit-identical across world sizes is not guaranteed, because each rank sums its half first
#   and the all-reduce adds the halves (float32 addition is not associative: the numbers
#   `[1e8, 1, -1e8, 1]` sum to 1 left to right and to 2 in pairs).
# * With per-rank augmentation seeds the noise a sample gets depends on which rank holds it,
#   so the run at `world_size` ranks and the run in one process follow different trajectories
#   (parameters differ far beyond rounding): they are only **statistically** equivalent — both
#   reach a similarly low loss.

# %%
S = R["seeds"]
one = {aug: seeded_training(0, 1, config, augment=aug) for aug in (False, True)}  # world size 1, in this kernel
pnames = list(one[False]["init"])
for r, s in enumerate(S):
    for n in pnames:
        assert torch.equal(s["init_same_seed"][n], one[False]["init"][n]), f"rank {r}: same seed should give the same {n}"
        assert torch.equal(s["init_rank_seed_after_ddp"][n], S[0]["init_rank_seed"][n]), f"rank {r}: after DDP {n} should be rank 0's"
    assert torch.equal(s["noise_same_seed"], S[0]["noise_same_seed"]), f"rank {r}: same-seed noise should be identical"
    if r > 0:
        assert not torch.equal(s["init_rank_seed"]["weight"], S[0]["init_rank_seed"]["weight"]), "per-rank seeds: different init"
        assert not torch.equal(s["noise_rank_seed"], S[0]["noise_rank_seed"]), "per-rank seeds: different noise"
sums = float32_sum_orders()
assert (sums["left_to_right"], sums["pairs"]) == (1.0, 2.0), sums

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
        assert l_ddp < 0.2 * l0 and l_one < 0.2 * l0, f"both runs should learn: {l0:.3g} -> {l_ddp:.3g} / {l_one:.3g}"
        assert 0.5 < l_ddp / l_one < 2.0, f"final losses should be comparable: {l_ddp:.3g} vs {l_one:.3g}"
    rows.append({"augmentation": key, "ranks bit-identical": True,
                 f"max |Δparam| world_size {world_size} vs 1": diff, "elements that differ": f"{n_diff} of {n_all}",
                 "loss at start": l0, f"final loss, world_size {world_size}": l_ddp, "final loss, world_size 1": l_one})
pd.DataFrame(rows).set_index("augmentation")

# %%
fig, ax = plt.subplots(figsize=(7.5, 4), layout="constrained")
for key, aug, color in (("plain", False, "tab:blue"), ("augmented", True, "tab:orange")):
    ax.plot(S[0][key]["loss"], color=color, label=f"{key}, world_size {world_size} (DDP)")
    ax.plot(one[aug]["loss"], color=color, linestyle="--", label=f"{key}, world_size 1")
ax.set_yscale("log")
ax.set_xlabel("SGD step")
ax.set_ylabel("MSE on the clean global batch (squared target units, log scale)")
ax.set_title("Same seeds, different world sizes: equal up to rounding without augmentation,\n"
             "only statistically equivalent with per-rank augmentation")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 9. Debugging
#
# ### Collective mismatches and `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# Rank `r` all-reduces a tensor of `2 + r` elements (ranks disagree about a length: a classic
# desynchronisation). `TORCH_DISTRIBUTED_DEBUG=DETAIL` (read when `torch.distributed` is
# imported, so it must be set before the processes start) wraps every process group in a
# checker that compares the collectives' "fingerprints" (operation, shapes, dtypes) across
# ranks before running them. Inside the main launch the same checker was switched on for one
# group with `dist.set_debug_level(DebugLevel.DETAIL)` before `dist.new_group()`.
#
# **Claims:** with the checker every rank raises `Detected mismatch between collectives on
# ranks`, naming both shapes. Without it nothing diagnoses the problem: gloo does not compare
# shapes, so rank 0 (2 elements) may return a result while another rank waits for elements
# that never come and times out.

# %%
D = R["debug"]
for r, d in enumerate(D):
    assert "Detected mismatch between collectives on ranks" in d["detail"], f"rank {r}: {d['detail'][:200]}"
    assert f"TensorShape=[{2 + r}]" in d["detail"], f"rank {r}: its own shape should be named: {d['detail'][:300]}"
    assert "Detected mismatch" not in d["off"], f"rank {r}: without DETAIL nothing should diagnose the mismatch"
print("with DETAIL, rank 0 says:\n" + D[0]["detail"].replace("TensorDeviceTypes", "\n  TensorDeviceTypes")[:600] + " ...")
pd.DataFrame([{"rank": r, "tensor elements": 2 + r, "without DETAIL": d["off"].split("] ")[-1],
               "with DETAIL": d["detail"].split("Collectives differ in the following aspects:")[-1].strip()}
              for r, d in enumerate(D)]).set_index("rank")

# %% [markdown]
# **Claim (a surprise):** in torch 2.14.1 with the gloo backend, `TORCH_DISTRIBUTED_DEBUG=DETAIL`
# makes **DDP's constructor crash** the process with SIGSEGV, in the line of
# `DistributedDataParallel._ddp_init_helper` that calls
# `self.logger.set_construction_data_and_log(...)` (checked below from the relayed stack).
# Deeper, outside this notebook: a native debugger (`gdb`) puts the crash in
# `c10d::Logger::set_env_variables`, which in the torch source reads gloo's thread count by
# casting the group's gloo backend to `ProcessGroupGloo` — under DETAIL that backend is the
# debug wrapper instead. So on CPU use DETAIL for collective checks (as above) and
# `TORCH_DISTRIBUTED_DEBUG=INFO` (section 3) for DDP's unused-parameter names.
#
# A rank killed by a signal leaves no Python traceback: `WorkerError.traceback` is empty and
# `exc_type` says `killed by SIGSEGV`. Python's fault handler still prints the Python stack of
# the crash to the worker's stderr, which the launcher relays below with the `[rank r]`
# prefix ("Fatal Python error: Segmentation fault ... in _ddp_init_helper"). The launch takes
# about 5-10 s on a 2-core machine.

# %%
before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
detail_error, detail_result = None, None
relayed = io.StringIO()  # the launcher relays worker stderr to ours: keep a copy to read it
with env_var("TORCH_DISTRIBUTED_DEBUG", "DETAIL"), contextlib.redirect_stderr(relayed):
    try:  # workers inherit this kernel's environment
        detail_result = launch(detail_ddp_worker, world_size, backend="gloo", timeout=120)
    except WorkerError as e:
        detail_error = e
print(relayed.getvalue())
assert os.environ.get("TORCH_DISTRIBUTED_DEBUG") == before, "the environment variable should be restored"
if torch.__version__.split("+")[0] == "2.14.1":
    assert detail_error is not None, f"torch 2.14.1 + gloo + DETAIL: DDP's constructor should crash, got {detail_result}"
    assert detail_error.exc_type == "killed by SIGSEGV", detail_error.exc_type
    assert detail_error.traceback == "", "a rank killed by a signal has no Python traceback"
    print(f"WorkerError: rank {detail_error.rank}, exc_type {detail_error.exc_type!r}, message {detail_error.message!r}, "
          f"traceback {detail_error.traceback!r}")
    frames = re.findall(r'File "([^"]+distributed\.py)", line (\d+) in _ddp_init_helper', relayed.getvalue())
    assert "Segmentation fault" in relayed.getvalue() and frames, "the fault handler's stack should be relayed"
    path, line = frames[0][0], int(frames[0][1])
    source = "".join(linecache.getline(path, n) for n in range(line - 1, line + 2))
    assert "set_construction_data_and_log" in source, source
    print(f"the crashing line, {os.path.basename(path)}:{line}: {linecache.getline(path, line).strip()}")
else:  # another torch version: report what happened instead of asserting 2.14.1's behaviour
    print(f"torch {torch.__version__}: DETAIL + DDP gave {detail_error or detail_result!r}")

# %% [markdown]
# ### Init timeouts, and reading a worker traceback
#
# `init_process_group` blocks until `world_size` processes have joined the rendezvous. A job
# whose `WORLD_SIZE` counts one process more than were started (a typo, a node that never
# came up) waits there, by default for 30 minutes (gloo). `helpers.pitfalls.init_alone_worker`
# is that process: it asks for `world_size = 2` with `timeout=collective_timeout_s` and is
# started alone.
#
# **Claims:** the launcher relays the worker's exception as `WorkerError` with `rank = 0`,
# `exc_type = "DistStoreError"` and a message saying `1/2 clients joined`; the relayed
# traceback shows where: our call to `init_process_group` in `init_alone_worker`, then torch's
# rendezvous (`_tcp_rendezvous_handler` -> `TCPStore`). Read a relayed traceback from the
# bottom (the exception) up to the **last frame in your own code**. (The store's message
# reports one second more than `timeout`: "Timed out after 4 seconds" for 3.)
# `helpers.faults` has more deliberate faults to practise on ("Going further", at the end).
# The launch takes about 7 s on a 2-core machine (one worker's start-up plus the timeout).

# %%
t0 = time.perf_counter()
init_error = None
try:
    launch(init_alone_worker, 1, T, backend="gloo", timeout=120)
except WorkerError as e:
    init_error = e
init_s = time.perf_counter() - t0
assert init_error is not None, "init_process_group with a missing rank should have failed"
assert (init_error.rank, init_error.exc_type) == (0, "DistStoreError"), (init_error.rank, init_error.exc_type)
assert "waiting for clients" in init_error.message and "1/2 clients joined" in init_error.message, init_error.message
reported_s = int(init_error.message.split("Timed out after ")[1].split(" seconds")[0])
assert reported_s == round(T) + 1, f"the store reports {reported_s} s for a {T:g} s timeout"
tb = init_error.traceback
assert "in init_alone_worker" in tb and "dist.init_process_group(" in tb and "TCPStore" in tb, tb[-1500:]
ours = [line.strip() for line in tb.splitlines() if "helpers/pitfalls.py" in line.replace(os.sep, "/")]
print(f"launch -> WorkerError after {init_s:.1f} s (timeout {T:g} s): rank {init_error.rank}, {init_error.exc_type}: "
      f"{init_error.message}")
print("last line of the relayed traceback:", tb.strip().splitlines()[-1])
print("last frame in our code:", ours[-1].split(", in ")[-1], "->", tb.split("in init_alone_worker")[1].splitlines()[1].strip())

total_s = time.perf_counter() - t_notebook
print(f"\nnotebook 06 ran in {total_s:.0f} s (main launch {main_launch_s:.0f} s, launcher hang {waited:.0f} s, "
      f"init timeout {init_s:.0f} s)")

# %% [markdown]
# ## What we saw
#
# * **Accumulation:** `no_sync()` on all micro-batches but the last gives exactly the
#   large-batch gradient with `k` times fewer all-reduced bytes (counted with a comm hook). The
#   forward decides whether a backward all-reduces. Syncing the wrong micro-batch raises
#   nothing and makes the replicas diverge after one step.
# * **Uneven inputs:** the rank with an extra batch waits forever in its all-reduce (here:
#   until a short timeout, or until `LaunchTimeout`); `Join` completes it, and
#   `divide_by_initial_world_size` decides whether the joined ranks count as zeros
#   (`13 / 2`) or not (`13`).
# * **Unused parameters:** the first iteration "works" with un-averaged gradients; the error
#   comes one iteration later and names parameter indices (names with
#   `TORCH_DISTRIBUTED_DEBUG=INFO`). `find_unused_parameters=True` fixes it; `static_graph=True`
#   only if the unused output is not returned (pytorch #97030).
# * **Unequal batch sizes:** DDP averages ranks, not samples; `sum * world_size / N` restores
#   the global mean.
# * **BatchNorm:** `broadcast_buffers=True` leaves rank 0's running statistics computed from
#   rank 0's data alone (torch 2.14.1 renames it `forward_sync_buffers`, which unlike
#   `broadcast_buffers=False` still broadcasts at construction); `SyncBatchNorm` (GPU only;
#   its CPU error shown) equals BatchNorm on the global batch; DataParallel normalises per
#   chunk and keeps chunk 0's statistics.
# * **Checkpoints:** save `ddp.module.state_dict()` (no `module.` prefix) and the optimizer on
#   rank 0, barrier, load with `map_location`: resuming is bit-identical on every rank.
# * **Evaluation:** evaluate `ddp.module`, all-reduce sums, print on rank 0. A forward through
#   the wrapper on one rank hangs only when it starts a collective (buffer broadcast, bucket
#   rebuild): a BatchNorm model after training hangs even under `eval()` and `no_grad()`.
# * **Seeds:** same-seed init is bit-identical everywhere (and DDP broadcasts rank 0's anyway);
#   augmentation needs per-rank seeds; results are bit-identical across ranks, equal up to
#   rounding across world sizes, and only statistically equivalent once per-rank randomness
#   enters.
# * **Debugging:** DETAIL catches collective mismatches — and, with gloo in torch 2.14.1,
#   crashes DDP's constructor; short `timeout`s turn hangs into errors you can read; read a
#   relayed traceback from the bottom up to your own code.
#
# ## Going further
#
# Launch `helpers.faults.fail_at` with `moment="during"` and `helpers.faults.skip_collective`
# (with a short `timeout`); for each, read `WorkerError.rank`, `.exc_type` and the last frame of
# `.traceback` in your own code, or `LaunchTimeout.ranks_not_finished`, and say which rank was
# the root cause.
#
# ## Exercises
#
# Predict each answer by hand first, write it into `answer_N` (replacing `None`) and run the
# check cell below it: it prints "correct" or "not yet" with a hint. The solution is in the
# collapsed cell after the check (click the "…" or the bar on its left to open it). CI runs
# every solution, so they are known to be right. None of them starts new processes.

# %% [markdown]
# ### Exercise 1: Join on 4 ranks
#
# Section 2 with `world_size = 4`: rank `r` has `2 + r` batches (rank 3: 31, 32, 33, 34,
# 35) and the loop runs inside `Join([ddp], divide_by_initial_world_size=False)`. What
# gradient does rank 3 hold after each of its 5 steps? Answer with a list of 5 numbers.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% tags=["check"]
# expected: the helper's formula (sum over the ranks that still have a batch / their number)
expected_1 = join_expected_grads(4, config.join_base_batches, divide_by_initial_world_size=False)[3]
if world_size == 4:  # this run launched 4 real ranks: DDP under Join must agree
    assert_close(J[3]["join_divide_active"]["grads"], expected_1, msg="rank 3 under Join, 4 ranks")
check_answer("ex1", answer_1, expected_1,
             hint="at step i, which ranks still have a batch, and what does divide_by_initial_world_size=False divide by?")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# Rank r's batch i is 10 r + i + 1. Steps 0 and 1: all 4 ranks; step 2: ranks 1-3 (rank 0 has
# joined); step 3: ranks 2-3; step 4: rank 3 alone. Divide by the ranks still training.
solution_1 = [(1 + 11 + 21 + 31) / 4, (2 + 12 + 22 + 32) / 4, (13 + 23 + 33) / 3, (24 + 34) / 2, 35 / 1]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: unequal batch sizes on 4 ranks
#
# Section 4 with `world_size = 4`: rank `r` holds `r + 1` of the samples `1, 2, ..., 10`
# (`[1]`, `[2, 3]`, `[4, 5, 6]`, `[7, 8, 9, 10]`), each rank uses the **mean** of the
# per-sample losses `(w x)^2` at `w = 1`. What gradient does DDP give every rank? Answer
# with a number (4 significant digits are enough) or a fraction as text, such as `"7/12"`.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% tags=["check"]
# expected: the helper's average of the four ranks' mean-loss gradients
expected_2 = unequal_batch_reference(4)["mean_of_rank_means"]
if world_size == 4:  # this run launched 4 real ranks
    assert_close(Q[0]["naive"], expected_2, msg="DDP's gradient with per-rank mean losses, 4 ranks")
check_answer("ex2", answer_2, expected_2, rel_tol=1e-3,
             hint="each rank's mean-loss gradient is 2 * mean(x^2) over its own samples; DDP averages the 4")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
from fractions import Fraction

shards4 = [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]]
rank_grads = [Fraction(2 * sum(v * v for v in sh), len(sh)) for sh in shards4]  # 2, 13, 154/3, 147
solution_2 = sum(rank_grads) / 4  # 160/3, about 53.33
global_mean = Fraction(2 * sum(v * v for sh in shards4 for v in sh), 10)  # 77: what one process gets
print(f"DDP: {solution_2} = {float(solution_2):.4f}; global mean: {global_mean}")
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# ### Exercise 3: bytes all-reduced with k = 8
#
# Section 1's model (`Linear(4, 1)` in `float64`, one bucket) with `accum_steps = 8`: how
# many bytes does each rank all-reduce per optimizer step when it synchronises every
# micro-batch, and with `no_sync()` on all micro-batches but the last? Answer with a list
# of two ints.

# %% tags=["exercise"]
answer_3 = None  # your answer here

# %% tags=["check"]
# expected: the bytes of ONE all-reduce measured by the counting hook in this run, times the
# number of all-reduces each variant makes with k = 8
one_allreduce = acc[0]["no_sync_all_but_last"]["allreduce_bytes"]  # exactly one all-reduce
expected_3 = [8 * one_allreduce, 1 * one_allreduce]
if k == 8:  # this run used accum_steps = 8: the measured values must agree
    assert expected_3 == [acc[0]["sync_every_micro_batch"]["allreduce_bytes"], one_allreduce]
check_answer("ex3", answer_3, expected_3,
             hint="count the parameters, their bytes, and how many backward passes all-reduce")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 3 (try the exercise first)
# Linear(4, 1) has 4 weights + 1 bias = 5 parameters of 8 bytes (float64): 40 bytes per
# all-reduce. Synchronising every micro-batch: 8 all-reduces; no_sync on 7 of them: 1.
solution_3 = [8 * 5 * 8, 1 * 5 * 8]
check_answer("ex3", solution_3, expected_3, strict=True)
