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
# # 07a · torchrun and many nodes
#
# <!-- opening:start -->
# **You will be able to** run the same worker under `torchrun` on one or two nodes; say what a failed node does. **You need** [04 MNIST: single, DP, DDP](04_mnist_single_dp_ddp.ipynb), [06a training-loop pitfalls](06a_training_loop_pitfalls.ipynb), [06b state across ranks](06b_state_across_ranks.ipynb), [06c seeds and debugging](06c_seeds_and_debugging.ipynb).
# <!-- opening:end -->
#
# **The question:** notebook 04 started DDP training from a notebook cell. How do we run the
# *same code* with `torchrun`, on one machine, on several machines and under SLURM? What does a
# multi-node job look like from the inside? And what happens when one node fails?
#
# Everything here reuses notebook 04's MNIST recipe: `Linear(784, 10)`, SGD, `lr = 0.01` and
# global batch 64. It also reuses notebook 04's worker, `helpers.mnist_train.ddp_train_worker`.
# The new module is `helpers/mnist_torchrun.py`, which torchrun runs in every process.
# `helpers.engine.cluster` starts torchrun agents from a cell.
#
# Terms from the [glossary](../docs/GLOSSARY.md): [torchrun](../docs/GLOSSARY.md#torchrun), [node](../docs/GLOSSARY.md#node), [rank](../docs/GLOSSARY.md#rank),
# [local rank](../docs/GLOSSARY.md#local-rank), [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [process group](../docs/GLOSSARY.md#process-group), [all-reduce](../docs/GLOSSARY.md#all-reduce), [DDP](../docs/GLOSSARY.md#ddp),
# [replica](../docs/GLOSSARY.md#replica), [global batch size](../docs/GLOSSARY.md#global-batch-size).
#
# **What runs where**
#
# | part | CPU only | with GPUs |
# |---|---|---|
# | 1. torchrun, one node vs `launch` | `torchrun --standalone`, `world_size` processes, gloo | nccl, one GPU per rank, when there are `world_size` GPUs |
# | 2. two "nodes" on one host | two torchrun agents, `--nnodes=2`, c10d rendezvous on `127.0.0.1`, gloo | the same (a rehearsal of the control plane: each "node" would need its own GPU for nccl) |
# | 3. two nodes in two network namespaces | when `ip netns` is permitted (root / CAP_NET_ADMIN); else skipped visibly | the same |
# | 4. a node fails; `--max-restarts` | two agents on loopback, gloo | the same |
#
# Every torchrun agent is a subprocess with a timeout. When a cell ends, whatever happens, it
# removes every agent, worker and namespace it started; the checks assert it. Most of the run
# time goes into starting Python and PyTorch in every process. Each claim, in bold, is asserted
# by the check cell after the code that runs it. The lesson ends with two exercises, each
# checked by a cell.

# %% tags=["parameters"]
# Parameters: what a profile changes (docs/RUNNER.md); these values are what you run (smoke)
max_steps = 30  # training steps of every torchrun / launch run; 0 means one full epoch (938 steps)

# %%
from helpers.mnist_steps import MNIST_TRAIN_IMAGES, total_steps
from helpers.notebook import check_answer, check_parameters, check_value

# Constants of this lesson: no profile changes them
world_size = 2  # processes of the one-node torchrun run and the launch() run
fail_at_step = 5  # the training step in which rank 1 raises in part 4
netns = "auto"  # "auto": rehearse in two network namespaces if this machine permits it; "off": skip
backend = "auto"  # "auto": nccl with one GPU per rank, else gloo; or "gloo" / "nccl"
global_batch_size = 64  # samples per optimizer step, all ranks together
lr = 0.01  # SGD learning rate
seed = 0  # seeds the initial weights and the data order
job_timeout_s = 300  # a torchrun job still running after this many seconds is killed (and the cell fails)

check_parameters(max_steps=(max_steps, int))

steps = total_steps(MNIST_TRAIN_IMAGES, global_batch_size, world_size, max_steps=max_steps)  # TrainConfig's count
check_value("max_steps", max_steps, fail_at_step <= steps,
            f"0 (one epoch) or at least {fail_at_step}: part 4's rank 1 raises in step {fail_at_step}")

# %%
import inspect
import os
import re
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Code, display
from torch.testing import assert_close

import helpers.engine.cluster as cluster
import helpers.mnist_torchrun as entry
from helpers.engine import launch, loopback_interface, resolve_backend
from helpers.engine.cluster import TwoNodeNetwork, failure_report, netns_available
from helpers.mnist_torchrun import cluster_commands, run_job
from helpers.mnist_train import TrainConfig, build_model, ddp_train_worker

n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
backend = resolve_backend(None if backend == "auto" else backend, world_size)
print(f"torch {torch.__version__}; CUDA GPUs: {n_gpus}")
print(f"one-node runs: world_size = {world_size}, backend = {backend!r}; two-node rehearsals: gloo")
print(f"every torchrun / launch run trains {steps} steps of global batch {global_batch_size}")

# %% [markdown]
# ## 1. The entry point: notebook 04's training under torchrun
#
# `torchrun ... -m helpers.mnist_torchrun` runs our module in every process that torchrun starts.
# The module reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` from the environment,
# through `helpers.engine.main_from_env`. It initialises the process group and calls
# `ddp_train_worker`, the packaged form of notebook 04's `ddp_train`. Notebook 04 checks that
# both train the same losses. The training does not change;
# only who starts the processes does.
#
# The next cell prints the commands for one node, for several nodes and for SLURM. `HOST0` is
# the first node's address. The module's docstring and `docs/CLUSTER.md` state the same commands.
# Below them the cell shows the module's code.

# %%
commands = cluster_commands()
for title, text in commands.items():
    print(f"--- {title} ---\n{text}\n")
doc_lines = {line.strip() for line in entry.__doc__.splitlines()}
missing = [line for text in commands.values() for line in text.splitlines() if line.strip() not in doc_lines]
assert not missing, f"the module docstring lacks these command lines: {missing}"
assert all(f"-m {entry.MODULE} " in text for text in commands.values()), "torchrun runs the entry by its own name"
# the entry point stays a module (torchrun runs `-m helpers.mnist_torchrun` in every process): its code
display(Code(inspect.getsource(entry.main) + "\n\n" + inspect.getsource(entry.cluster_train_worker),
             language="python"))

# %% [markdown]
# From a cell we start torchrun as a subprocess: `python -m helpers.engine.cluster.torchrun`
# is `torchrun` with this kernel's interpreter. Its source, `helpers/engine/cluster/torchrun.py`,
# keeps torchrun's stores on the addresses we name, off other network interfaces.
# `run_job` adds `--output`, so each rank writes its history and what torchrun told it to
# `rank<R>.json`. It also adds a timeout, and it kills anything left
# when it returns.
#
# **Claim:** for the same seed and configuration, torchrun on one node and notebook 04's
# `launch(ddp_train_worker, world_size, config)` give the same per-step loss history. Their test
# accuracies differ by at most 2 of the 10,000 test images.
#
# The next cell runs both, one after the other. Most of its time is starting Python and PyTorch
# in every process.

# %%
config = TrainConfig(global_batch_size=global_batch_size, lr=lr, max_steps=max_steps, seed=seed, progress=False)
train_args = ["--max-steps", max_steps, "--global-batch-size", global_batch_size, "--lr", lr, "--seed", seed,
              "--no-progress"]

t0 = time.perf_counter()
single = run_job(train_args + ["--backend", backend], nodes=1, nproc_per_node=world_size, timeout=job_timeout_s)
single_s = time.perf_counter() - t0
print("ran:", single.commands[0].replace(str(cluster.REPO_ROOT), "."), "\n")
assert single.ok, f"torchrun failed:\n{single.agents[0].tail(40)}"
print("\n".join(line for line in single.agents[0].stdout.splitlines() if line.startswith("[rank")))

t0 = time.perf_counter()
launched = launch(ddp_train_worker, world_size, config, backend=backend, timeout=job_timeout_s)
launch_s = time.perf_counter() - t0
torchrun_curve, launch_curve = torch.tensor(single.ranks[0]["losses"]), torch.tensor(launched[0]["losses"])

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: torchrun and launch() give the same loss history and accuracy
assert not single.leftovers(), "no agent or worker may outlive its job"
assert [h["rank"] for h in single.ranks] == list(range(world_size))
assert len(torchrun_curve) == len(launch_curve) == steps
assert_close(torchrun_curve, launch_curve,
             msg=lambda m: f"torchrun and launch() loss histories differ:\n{m}")
assert abs(single.ranks[0]["test_accuracy"] - launched[0]["test_accuracy"]) <= 2e-4  # at most 2 of 10,000 images
pd.DataFrame([
    {"started by": "torchrun --standalone", "processes": len(single.ranks), "backend": single.ranks[0]["backend"],
     "steps": single.ranks[0]["steps"], "final loss": single.ranks[0]["losses"][-1],
     "test accuracy": single.ranks[0]["test_accuracy"], "wall time incl. start-up (s)": round(single_s, 1)},
    {"started by": "launch() from this cell", "processes": len(launched), "backend": launched[0]["backend"],
     "steps": launched[0]["steps"], "final loss": launched[0]["losses"][-1],
     "test accuracy": launched[0]["test_accuracy"], "wall time incl. start-up (s)": round(launch_s, 1)},
]).set_index("started by").assign(**{"loss curves bit-identical": bool(torch.equal(torchrun_curve, launch_curve))})

# %% [markdown]
# ## 2. Two "nodes" on one host: a multi-node rehearsal
#
# On a cluster, every machine runs one torchrun agent. All agents get the same `--nnodes`,
# `--rdzv-backend=c10d`, `--rdzv-endpoint=HOST0:PORT` and `--rdzv-id`. The agents meet at the
# rendezvous, a key-value store that one of them hosts. There they agree on the node ranks,
# `GROUP_RANK`. Each worker then gets its global rank:
# `RANK = GROUP_RANK * nproc_per_node + LOCAL_RANK`.

# %% [markdown]
# We rehearse that on this machine with two agents, `--nnodes=2 --nproc-per-node=1`. The store
# listens on `127.0.0.1` at a free port. Agent 0 hosts it: `--rdzv-conf is_host=1`. Both agents
# pass `--local-addr=127.0.0.1`. `GLOO_SOCKET_IFNAME` tells gloo to use the loopback interface:
# `lo` on Linux, `lo0` on macOS. No other address is used.
#
# **Claim:** the job has `WORLD_SIZE == 2`. Rank 0 and rank 1 run on different node ranks,
# `GROUP_RANK` 0 and 1, each as `LOCAL_RANK` 0 of its node. The result is the one of the
# single-node run with 2 processes: the same loss history, and the same accuracy to within 2 of
# 10,000 images.
#
# The next cell runs one torchrun job with two agents.

# %%
two_node_args = train_args + ["--backend", "gloo"]
two_node = run_job(two_node_args, nodes=2, nproc_per_node=1, timeout=job_timeout_s)
for i, cmd in enumerate(two_node.commands):
    print(f"node {i}:", cmd.replace(str(cluster.REPO_ROOT), "."))
assert two_node.ok, "\n".join(f"node {a.node} exit {a.returncode}:\n{a.tail(30)}" for a in two_node.agents)
nodes_df = pd.DataFrame(two_node.node_table()).set_index("RANK")
two_node_curve = torch.tensor(two_node.ranks[0]["losses"])

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: two agents on loopback: node ranks, world size, same results
assert not two_node.leftovers()
assert list(nodes_df.index) == [0, 1] and set(nodes_df["WORLD_SIZE"]) == {2}
assert list(nodes_df["GROUP_RANK (node)"]) == [0, 1], "rank r should run on node r"
assert set(nodes_df["LOCAL_RANK"]) == {0} and set(nodes_df["LOCAL_WORLD_SIZE"]) == {1}
assert set(nodes_df["MASTER_ADDR"]) == {"127.0.0.1"}
assert set(nodes_df["GLOO_SOCKET_IFNAME"]) == {loopback_interface()}, nodes_df["GLOO_SOCKET_IFNAME"]
assert all("--rdzv-endpoint=127.0.0.1:" in c for c in two_node.commands), two_node.commands

# identical to the single-node run when that run also had 2 gloo ranks; else within float32 rounding
same_shape = world_size == 2 and single.ranks[0]["backend"] == "gloo"
tol = {} if same_shape else dict(rtol=1e-4, atol=1e-5)
assert_close(two_node_curve, torchrun_curve, **tol,
             msg=lambda m: f"two-node and single-node loss histories differ:\n{m}")
assert abs(two_node.ranks[0]["test_accuracy"] - single.ranks[0]["test_accuracy"]) <= 2e-4
print(f"two nodes vs one node: loss curves bit-identical: {torch.equal(two_node_curve, torchrun_curve)}; "
      f"test accuracy {two_node.ranks[0]['test_accuracy']:.4f} vs {single.ranks[0]['test_accuracy']:.4f}")
nodes_df.drop(columns=["GLOO_SOCKET_IFNAME"])

# %% [markdown]
# ## 3. Two nodes that really talk over a network interface
#
# On loopback, the "network" is a shortcut inside the kernel. A Linux network namespace gives a
# "node" its own network stack: its own interfaces, addresses, ports and routing table.
# `TwoNodeNetwork` creates two namespaces and joins them with a virtual Ethernet cable, a veth
# pair. Node 0 gets `10.213.7.1/30` and node 1 gets `10.213.7.2/30`. Nothing is added to the
# host's own network.

# %% [markdown]
# `TwoNodeNetwork` runs agent `i` inside namespace `i`, with `ip netns exec`. The rendezvous
# store sits at node 0's address, and `GLOO_SOCKET_IFNAME` names the veth. On exit it kills
# whatever still runs inside and deletes both namespaces, also after an error. Creating
# namespaces needs root: CAP_SYS_ADMIN and CAP_NET_ADMIN. Without it, this part says so and is
# skipped.

# %% [markdown]
# How many bytes must cross the veth? To sum two `P`-element gradients, each node must receive
# at least `P` numbers per step from the other. So each node receives at least `steps * 4 * P`
# bytes, with `P = 7,850` float32 gradients. The excess is TCP/IP headers, the rendezvous, the
# initial weight broadcast and the evaluation.
#
# **Claim:** the ranks run in two different network namespaces, neither of them the kernel's.
# The workers' `MASTER_ADDR` is node 0's veth address. The kernel's counters show at least
# `steps * 4 * P` bytes crossing the veth in each direction. The results are those of part 2.
#
# When namespaces are permitted, the next cell runs one torchrun job. When they are not, it
# returns at once.

# %%
netns_ok, netns_why = netns_available() if netns == "auto" else (False, f"netns = {netns!r} (parameter)")
if not netns_ok:
    print(f"SKIPPED part 3 (two network namespaces): {netns_why}. Parts 2 and 4 use loopback instead.")
    ns_job = None
else:
    with TwoNodeNetwork() as net:
        before = [net.counters(i) for i in range(2)]
        ns_job = run_job(two_node_args, nodes=2, nproc_per_node=1, network=net, timeout=job_timeout_s)
        after = None
        for _ in range(50):  # read until two reads agree: TCP's last ACKs may still be in flight
            now = [net.counters(i) for i in range(2)]
            if now == after:
                break
            after = now
            time.sleep(0.1)
        print(f"namespaces {net.names}, veth {net.interface!r}, addresses {list(net.addresses)}")
    assert ns_job.ok, "\n".join(f"node {a.node} exit {a.returncode}:\n{a.tail(30)}" for a in ns_job.agents)

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: two network namespaces: traffic crossed the veth, same results
if ns_job is not None:
    assert not net.exists(), f"namespaces left behind: {net.exists()}"
    assert not ns_job.leftovers()
    ns_df = pd.DataFrame(ns_job.node_table()).set_index("RANK")
    kernel_ns = os.readlink("/proc/self/ns/net")
    assert list(ns_df["GROUP_RANK (node)"]) == [0, 1] and set(ns_df["WORLD_SIZE"]) == {2}
    assert ns_df["network namespace"].nunique() == 2 and kernel_ns not in set(ns_df["network namespace"])
    assert set(ns_df["MASTER_ADDR"]) == {net.addresses[0]}
    assert_close(torch.tensor(ns_job.ranks[0]["losses"]), two_node_curve, rtol=0, atol=0)
    grad_elements = sum(p.numel() for p in build_model("linear").parameters())
    floor = steps * 4 * grad_elements
    traffic = pd.DataFrame([{"node": i, **{k: after[i][k] - before[i][k] for k in after[i]},
                             "lower bound for rx_bytes": floor} for i in range(2)]).set_index("node")
    assert (traffic["rx_bytes"] >= floor).all() and (traffic["tx_bytes"] >= floor).all(), traffic
    assert traffic.loc[0, "tx_bytes"] == traffic.loc[1, "rx_bytes"], "a veth delivers what it sends"
    print(f"kernel's own network namespace: {kernel_ns}; loss curves identical to part 2")
    display(ns_df[["GROUP_RANK (node)", "WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "network namespace"]])
    display(traffic)

# %% [markdown]
# The next cell draws the four runs so far on top of each other. They are notebook 04's `launch`
# from this kernel, torchrun on one node, two nodes on loopback, and two nodes in two namespaces
# if that part ran. The right panel shows how far each curve is from the `launch` curve; zero
# sits at the bottom of its symlog scale. The cell only draws what the runs above returned.

# %%
runs = {"launch() from the notebook": launch_curve, "torchrun, 1 node": torchrun_curve,
        "torchrun, 2 nodes (loopback)": two_node_curve}
if ns_job is not None:
    runs["torchrun, 2 nodes (namespaces, veth)"] = torch.tensor(ns_job.ranks[0]["losses"])
fig, (ax, ax_gap) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
for (label, curve), style in zip(runs.items(), [dict(lw=3, alpha=0.4), dict(ls="--"), dict(ls=":"), dict(ls="-.")]):
    ax.plot(range(1, len(curve) + 1), curve, label=label, **style)
    ax_gap.plot(range(1, len(curve) + 1), (curve - launch_curve).abs(), label=label, **style)
ax.set_xlabel("optimizer step")
ax.set_ylabel("training loss (mean cross-entropy, nats)")
ax.set_title(f"Same worker, four ways to start it ({steps} steps)")
ax_gap.set_yscale("symlog", linthresh=1e-8)
ax_gap.set_ylim(0, 1e-4)
ax_gap.set_xlabel("optimizer step")
ax_gap.set_ylabel("|loss - launch() loss| (nats, symlog)")
ax_gap.set_title("Distance from the launch() run")
fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=len(runs), fontsize=8)  # off the data
if max(float((c - launch_curve).abs().max()) for c in runs.values()) == 0.0:
    ax_gap.text(0.5, 0.5, "every difference is exactly 0:\nthe curves are bit-identical", transform=ax_gap.transAxes,
                ha="center", va="center")
plt.show()

# %% [markdown]
# ## 4. When a node fails
#
# We inject a failure. Rank 1, on node 1, raises `InjectedFailure` in the forward pass of
# training step `fail_at_step`. The flags are `--fail-rank 1 --fail-at-step N`, and
# `helpers/mnist_torchrun.py` raises from a global forward pre-hook. Rank 0 is then waiting in
# that step's gradient all-reduce. Gloo sees the peer's socket close and raises a lost-connection
# error: "Connection closed by peer" or "reset by peer".

# %% [markdown]
# Each agent sees its worker exit with code 1. It prints a failure report and exits non-zero.
# The report's root cause holds the worker's traceback. `@record` on the entry point writes it to
# torchrun's error file. Without `--max-restarts`, nothing is retried.
#
# **Claim:** both agents exit non-zero by themselves; the job's timeout kills neither. Node 1's
# report names rank 1 as its root cause, with rank 1's `InjectedFailure`. Node 0's report names
# rank 0, with gloo's lost connection and no `InjectedFailure`. No rank writes a result.
#
# The next cell runs a job that fails in step `fail_at_step`. The check after it reads each
# agent's own report. It prints the seconds between the two exits, which depend on the machine.

# %%
fail_args = two_node_args + ["--fail-rank", 1, "--fail-at-step", fail_at_step]
failed = run_job(fail_args, nodes=2, nproc_per_node=1, timeout=job_timeout_s)
reports = {a.node: failure_report(a) for a in failed.agents}  # node -> the root cause its agent printed
print("What torchrun printed on node 1:\n")
print(reports[1]["text"].replace(str(cluster.REPO_ROOT), ".") if reports[1] else failed.agents[1].tail(30))

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: each agent exits non-zero and reports its own worker's error
# each agent's exit, and the report that agent printed (not a report found on the other node)
LOST_CONNECTION = re.compile(r"connection (closed|reset) by peer", re.I)
assert not failed.leftovers()
assert sorted(reports) == [0, 1], reports
rows = []
for a in failed.agents:
    r = reports[a.node]
    assert not a.timed_out, f"node {a.node} hung until the timeout:\n{a.tail(30)}"
    assert a.returncode not in (0, None), f"node {a.node} should exit non-zero, got {a.returncode}"
    assert r is not None, f"node {a.node} printed no failure report:\n{a.tail(30)}"
    assert r["rank"] == a.node, f"node {a.node}'s report names rank {r['rank']}, not its own worker"
    assert r["exitcode"] not in (0, None), r
    rows.append({"node": a.node, "agent exit code": a.returncode, "agent exited after (s)": round(a.seconds, 1),
                 "root-cause rank": r["rank"], "worker exit code": r["exitcode"], "error": r["error"][:160]})
assert "InjectedFailure" in reports[1]["error"] and "rank 1" in reports[1]["error"], reports[1]["error"]
assert "InjectedFailure" not in reports[0]["error"], "rank 0 did not fail by itself: it lost its peer"
assert LOST_CONNECTION.search(reports[0]["text"]), f"node 0 should report a lost connection:\n{reports[0]['text']}"
assert failed.ranks == [], "a failed job writes no results"
gap = abs(failed.agents[0].seconds - failed.agents[1].seconds)
print(f"both agents exited non-zero by themselves, {gap:.1f} s apart; node 0's root cause: "
      f"{LOST_CONNECTION.search(reports[0]['text']).group(0)!r}")
pd.DataFrame(rows).set_index("node")

# %% [markdown]
# ### `--max-restarts`: torchrun restarts the worker group
#
# With `--max-restarts=1`, an agent whose worker fails does not exit. It stops its workers and
# joins the rendezvous again. The other agent sees a node waiting, or its own worker fail, and
# restarts too. All workers start from scratch. This entry point keeps no checkpoint, so training
# begins again at step 0 and gives the clean run's result. Here rank 1 fails only in the first
# attempt: `--fail-attempts 1` is compared with `TORCHELASTIC_RESTART_COUNT`.

# %% [markdown]
# Two things real jobs run into, seen while building this lesson with torch 2.14:
#
# * `TORCHELASTIC_RESTART_COUNT` counts **this agent's** failure restarts. The node that failed
#   restarts with count 1. Which count the other node gets depends on timing. If its own worker
#   failed, its count is 1. If it saw a node waiting at the rendezvous, that is a "membership
#   change", which does not count, so its count stays 0
#   ([pytorch#108158](https://github.com/pytorch/pytorch/issues/108158)).
# * By default, the workers share the agents' rendezvous store. The store still holds the failed
#   attempt's keys, so a restarted rank can read its peer's *old* address and fail to connect.
#   We saw "Gloo connectFullMesh failed ... Connection refused" and a hang
#   ([pytorch#135712](https://github.com/pytorch/pytorch/issues/135712)). Setting
#   `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives every attempt a fresh store. We set it here.
#
# **Claim:** with `--max-restarts=1` the job succeeds, and both agents exit 0. Rank 1 reports
# restart count 1, and the loss history is the clean run's.
#
# The next cell pays two start-ups: the failed attempt and the restart.

# %%
restarted = run_job(fail_args + ["--fail-attempts", 1], nodes=2, nproc_per_node=1, max_restarts=1,
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}, timeout=job_timeout_s)
assert restarted.ok, "\n".join(f"node {a.node} exit {a.returncode}:\n{a.tail(30)}" for a in restarted.agents)
for a in restarted.agents:  # what each agent decided, from its own log
    for line in a.output.splitlines():
        if "will restart worker group" in line or ("InjectedFailure:" in line and "[rank" in line):
            print(f"node {a.node}: {line.split('] ', 1)[-1][:150]}")
restart_df = pd.DataFrame(restarted.node_table()).set_index("RANK")

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: --max-restarts=1: the job succeeds with restart count 1
assert not restarted.leftovers()
assert all(a.returncode == 0 for a in restarted.agents), [a.returncode for a in restarted.agents]
assert restart_df.loc[1, "restart count"] == 1, "rank 1 failed once, so its agent restarted once"
assert restart_df.loc[0, "restart count"] in (0, 1)
print(f"node 0 restarted because {'its own worker failed' if restart_df.loc[0, 'restart count'] else 'node 1 was waiting at the rendezvous (a membership change)'}")
assert_close(torch.tensor(restarted.ranks[0]["losses"]), two_node_curve, rtol=0, atol=0)
restart_df[["GROUP_RANK (node)", "restart count", "steps", "test accuracy"]]

# %% [markdown]
# The next cell shows how long each agent ran, job by job, from the job's start to the agent's
# exit. The colour is the exit code. The failed job ends early on both nodes. The restarted job
# pays a second start-up.

# %%
jobs = {"1 node": single, "2 nodes, loopback": two_node, "2 nodes, namespaces": ns_job,
        "2 nodes, rank 1 fails": failed, "2 nodes, fails once, --max-restarts=1": restarted}
jobs = {name: job for name, job in jobs.items() if job is not None}  # part 3 may have been skipped
fig, ax = plt.subplots(figsize=(10, 3.8), layout="constrained")
labels = []
for name, job in jobs.items():
    for a in job.agents:
        y = len(labels)
        labels.append(f"{name}: node {a.node}")
        ax.barh(y, a.seconds, color="C2" if a.returncode == 0 else "C3")
        ax.text(a.seconds, y, f" exit {a.returncode}", va="center")
ax.set_yticks(range(len(labels)), labels)
ax.set_ylabel("job and node (one torchrun agent each)")
ax.invert_yaxis()
ax.set_xlabel("seconds from the job's start until the agent exited (this machine)")
ax.set_title("torchrun agents: lifetime and exit code (green: 0, red: non-zero)")
ax.set_xlim(0, 1.25 * max(a.seconds for job in jobs.values() for a in job.agents))
plt.show()

# %% [markdown]
# ## What we saw
#
# * The same worker runs from a notebook cell with `launch`, and under `torchrun` with
#   `-m helpers.mnist_torchrun`. For the same seed and configuration, both give the same loss
#   history and accuracy. Only who starts the processes changed.
# * The commands for one node, several nodes and SLURM are in the docstring of
#   `helpers/mnist_torchrun.py` and in `docs/CLUSTER.md`.
# * Two torchrun agents on one host make a real two-node job. It has `WORLD_SIZE` 2 and one rank
#   per node, `GROUP_RANK` 0 and 1, each `LOCAL_RANK` 0. Its results equal one node with two
#   processes.
# * In two network namespaces, when permitted, the traffic visibly crossed a veth interface: at
#   least `4P` bytes per step in each direction.
# * When one node's worker fails, both agents exit non-zero by themselves. Each report names its
#   own worker as the root cause: the injected error on node 1, the lost connection on node 0.
# * `--max-restarts` restarts the whole worker group from scratch. Restart counts are per agent.
#   On this torch version, restarts need `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`.
#
# Casebook: [`--local-rank` against `--local_rank` and `LOCAL_RANK`](10d_casebook_launch_and_platform.ipynb#case-local-rank-argument).
#
# ## Going further
#
# * Set `fail_at_step = 1` in the parameters cell and run the lesson again. First predict: is
#   rank 0 then waiting in the gradient all-reduce, or somewhere earlier? What does node 0's
#   report say?

# %% [markdown]
# ## Exercises
#
# Predict each answer by hand first. Write it into `answer_N`, replacing `None`, and run the
# check cell below it. The check prints "correct" or "not yet" with a hint. In the full lesson, a
# collapsed solution follows each check: click the "…" or the bar on its left to open it. Student
# copies leave the solutions out. Every solution runs when the full lesson runs, so each is known
# to pass its check. Neither exercise starts a process.

# %% [markdown]
# ### Exercise 1: ranks on three nodes
#
# A job starts `torchrun --nnodes=3 --nproc-per-node=4 ...` on each of three machines. What is
# its `WORLD_SIZE`? Which global `RANK` does torchrun give the worker with `GROUP_RANK` 2 and
# `LOCAL_RANK` 1? `GROUP_RANK` 2 is the third node. Answer with a list of two ints,
# `[WORLD_SIZE, RANK]`.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 1, against the rank rule every job reported
# expected: the job's shape as the helper writes the multi-node command, and the rank rule that
# every worker of this notebook's torchrun jobs reported (checked on their node tables)
command = cluster_commands(nproc_per_node=4, nnodes=3)["multi-node (run on every node)"]
nnodes = int(re.search(r"--nnodes=(\d+)", command).group(1))
nproc = int(re.search(r"--nproc-per-node=(\d+)", command).group(1))
for job in (single, two_node, restarted, ns_job):
    for row in (job.node_table() if job is not None else []):
        assert row["RANK"] == row["GROUP_RANK (node)"] * row["LOCAL_WORLD_SIZE"] + row["LOCAL_RANK"], row
        assert row["WORLD_SIZE"] == len(job.ranks), row
expected_1 = [nnodes * nproc, 2 * nproc + 1]
check_answer("ex1", answer_1, expected_1,
             hint="every node starts --nproc-per-node workers; nodes are numbered first, then workers within a node")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# List every worker as torchrun numbers them: node by node, and within a node by local rank.
workers = [(node, local) for node in range(3) for local in range(4)]  # (GROUP_RANK, LOCAL_RANK)
solution_1 = [len(workers), workers.index((2, 1))]  # 3 x 4 = 12 workers; node 2 starts at 8, so 9
check_answer("ex1", solution_1, expected_1, strict=True)


# %% [markdown]
# ### Exercise 2: how often a restarted worker starts
#
# Look at part 4's restart job. It ran with `--max-restarts=1`, and rank 1 raised in the first
# attempt only. How many times did torchrun start rank 1's worker process? Which restart count,
# `TORCHELASTIC_RESTART_COUNT`, did rank 1 report from the attempt that finished? Answer with a
# list of two ints, `[starts, restart count]`.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: exercise 2, against what rank 1 reported
# expected: what rank 1 reported in part 4's restart job; each restart of its agent starts the worker once more
rank1_restarts = int(restart_df.loc[1, "restart count"])
assert restarted.ok and rank1_restarts <= 1, "part 4 allowed one restart and the job succeeded"
expected_2 = [1 + rank1_restarts, rank1_restarts]
check_answer("ex2", answer_2, expected_2,
             hint="the failed attempt is one start; every restart starts the whole worker group again and counts one")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
# Attempt 0 starts rank 1's worker, which raises; the agent restarts the worker group once
# (attempt 1, TORCHELASTIC_RESTART_COUNT = 1), which trains to the end: 2 starts, count 1.
solution_2 = [2, 1]
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [07b hooks and after DDP](07b_hooks_and_after_ddp.ipynb): write a communication hook, count compressed bytes, size ZeRO and FSDP.
# <!-- next:end -->
