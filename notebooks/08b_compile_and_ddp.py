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
# # 08b · torch.compile with DDP
#
# <!-- opening:start -->
# **You will be able to** count what `torch.compile` captures under DDP and where buckets split the graph. **You need** [00b DDP cell by cell](00b_ddp_cell_by_cell.ipynb), [05b communication and cost model](05b_communication_and_cost_model.ipynb).
# <!-- opening:end -->
#
# **The question:** I put `torch.compile` and DDP together. What got compiled? Is my checkpoint
# still a checkpoint of my model?
#
# Everything runs on 2 real ranks: `launch`, backend `gloo`, CPU. No C++ compiler is needed. The
# compiler backend here is a small function that records each graph `torch.compile` hands it. It
# then runs the graph as it is. Counting those graphs shows what was compiled. Each claim, in
# bold, is asserted in the folded code cell right after it.
#
# 1. what gets compiled, in each wrapping order · 2. graphs cut at the compiler's buckets · 3. checkpoint keys
#
# Terms (see the [glossary](../docs/GLOSSARY.md)): [rank](../docs/GLOSSARY.md#rank),
# [world size](../docs/GLOSSARY.md#world-size), [backend](../docs/GLOSSARY.md#backend),
# [DDP](../docs/GLOSSARY.md#ddp).

# %% tags=["parameters"]
# Parameters: what you run by default, top to bottom in JupyterLab (the smoke profile); the full profile overrides some (docs/RUNNER.md)
n_layers = 4  # Linear(512, 512) layers of the model (each weight is exactly 1 MiB of float32)

# %%
from helpers.notebook import check_answer, check_parameters, check_value

check_parameters(n_layers=(n_layers, int))
check_value("n_layers", n_layers, 2 <= n_layers <= 8, "2 to 8")

# %%
import io
import re
import time

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.engine import launch

t_notebook = time.perf_counter()
WORLD = 2
WIDTH = 512  # 512 x 512 float32 = 1 MiB per weight
print(f"torch {torch.__version__}")

# %% [markdown]
# ## 0. A backend that counts graphs
#
# `torch.compile(model, backend=fn)` uses TorchDynamo to trace Python code into FX graphs. It calls
# `fn(gm, example_inputs)` once per graph, and runs whatever `fn` returns in place of that code.
# `counting_backend()` keeps each `GraphModule` and returns `gm.forward`, so the model runs
# exactly as before. `layers_in(gm)` reads which layers a graph holds. It uses the names Dynamo
# gives the weights a graph takes as inputs: `..._modules_2_parameters_weight_` is layer 2.
#
# `Net` is a stack of `Linear(512, 512)` layers in a class of our own. Section 1 also tries the
# same layers in an `nn.Sequential`.

# %%
def counting_backend():
    """(backend, graphs): a torch.compile backend that appends each FX GraphModule to graphs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward  # run the captured graph as it is: no C++ compiler needed

    return backend, graphs


def layers_in(gm):
    """Indices of the layers whose weight is an input of the FX graph gm."""
    names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    return [int(m.group(1)) for n in names if (m := re.search(r"modules_(\d+)_parameters_weight", n))]


class Net(nn.Module):
    def __init__(self, n_layers):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(n_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def make(n_layers, kind="Net"):
    torch.manual_seed(0)  # the same weights on every rank and in every build
    return Net(n_layers) if kind == "Net" else nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n_layers)])


def step(model, rank):
    """One forward and backward; x = rank + 1 everywhere, so the ranks' gradients differ."""
    model(torch.full((2, WIDTH), rank + 1.0)).sum().backward()

# %% [markdown]
# ## 1. What gets compiled, in each wrapping order
#
# There are two ways to combine them. Compile the wrapper, `torch.compile(DDP(model))`, or wrap
# the compiled model, `DDP(torch.compile(model))`. DDP's `forward` is torch's own code, and
# Dynamo does not trace into its bookkeeping. In torch/nn/parallel/distributed.py,
# `DistributedDataParallel._inside_ddp_forward` is marked with `torch._disable_dynamo`. So
# tracing breaks there and starts afresh at the inner model's `forward`.
#
# Each run below does two training steps and counts the graphs. It also compares the gradients
# with plain eager DDP. The ranks print a harmless warning, "Profiler record function ... will
# be ignored". DDP's `forward` opens a `record_function` region, and Dynamo leaves it out.

# %%
def orders_worker(rank, world_size, n_layers):
    eager = DDP(make(n_layers))
    step(eager, rank)
    builds = {
        "torch.compile(model), no DDP": lambda b: torch.compile(make(n_layers), backend=b),
        "torch.compile(DDP(model))": lambda b: torch.compile(DDP(make(n_layers)), backend=b),
        "DDP(torch.compile(model))": lambda b: DDP(torch.compile(make(n_layers), backend=b)),
        "torch.compile(DDP(Sequential))": lambda b: torch.compile(DDP(make(n_layers, "Sequential")), backend=b),
        "DDP(torch.compile(Sequential))": lambda b: DDP(torch.compile(make(n_layers, "Sequential"), backend=b)),
    }
    out = {}
    for name, build in builds.items():
        torch._dynamo.reset()  # forget earlier compilations: each build counts its own graphs
        backend, graphs = counting_backend()
        model = build(backend)
        counts = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step(model, rank)
            counts.append(len(graphs))
        grads = [p.grad for p in model.parameters()]
        same = all(torch.equal(g, e.grad) for g, e in zip(grads, eager.parameters()))
        out[name] = {"graphs": len(graphs), "after step 1": counts[0], "layers": [layers_in(g) for g in graphs], "grads as eager DDP": same}
    return out


ORD = launch(orders_worker, WORLD, n_layers, backend="gloo", timeout=300)
pd.DataFrame(ORD[0]).T

# %% [markdown]
# **Claim:** the graphs of each build are those of the table. Two steps give no more graphs than
# one: nothing is recompiled. Every build with DDP has the gradients of eager DDP on both ranks.
# Without DDP each rank keeps its own gradients.
#
# | build | graphs |
# |---|---|
# | `torch.compile(model)`, no DDP | 1: the whole model |
# | `torch.compile(DDP(Net))` | 2: layers `0 … n_layers − 2`, then the last layer |
# | `DDP(torch.compile(Net))` | the same 2 |
# | `torch.compile(DDP(Sequential))` | **0**: the model runs eagerly |
# | `DDP(torch.compile(Sequential))` | the same 2 as `Net` |
#
# Section 2 says why DDP makes 2 graphs.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: the graphs of each build, and the gradients
expected_layers = {"torch.compile(model), no DDP": [list(range(n_layers))],
                   "torch.compile(DDP(model))": [list(range(n_layers - 1)), [n_layers - 1]],
                   "DDP(torch.compile(model))": [list(range(n_layers - 1)), [n_layers - 1]],
                   "torch.compile(DDP(Sequential))": [],
                   "DDP(torch.compile(Sequential))": [list(range(n_layers - 1)), [n_layers - 1]]}
for r in range(WORLD):
    for name, layers in expected_layers.items():
        assert ORD[r][name]["layers"] == layers and ORD[r][name]["graphs"] == len(layers), (r, name, ORD[r][name])
        assert ORD[r][name]["after step 1"] == len(layers), (r, name, ORD[r][name])  # step 2 compiled nothing new
        assert ORD[r][name]["grads as eager DDP"] == (not name.endswith("no DDP")), (r, name)  # no DDP: rank-local gradients

# %% [markdown]
# Why does the `nn.Sequential` compile to nothing in the first order? In `torch.compile(DDP(...))`,
# the frame Dynamo meets after the break is the inner model's `forward`. For `Net` that is our
# code, and Dynamo traces it. `nn.Sequential.forward` is in torch/nn. Dynamo's rules trace files
# under torch/nn only when code already being traced calls them: that is `MOD_INLINELIST`. A
# frame that *starts* there matches `MOD_SKIPLIST` and runs eagerly. The rules are `check_file`
# in torch/_dynamo/trace_rules.py.
#
# `DDP(torch.compile(...))` compiles the inner model directly: the `OptimizedModule` is the
# module DDP calls. As the table shows, that traces the `nn.Sequential` too. Counting graphs is
# the quick way to know; Dynamo's own report is `TORCH_LOGS="graph_breaks"`. Whichever order you
# choose, count.

# %% [markdown]
# ## 2. Graphs cut at the compiler's buckets, not always DDP's
#
# DDP all-reduces gradients bucket by bucket while backward still runs, as lesson 05b showed. A
# single compiled graph would make every gradient ready at once, at the end of its backward. That
# would kill the overlap. So when Dynamo compiles code under a DDP forward, `DDPOptimizer` splits
# the graph. It is in torch/_dynamo/backends/distributed.py, "Note [DDPOptimizer]".
#
# `DDPOptimizer` redoes DDP's bucket arithmetic on its own. It walks the graph backwards, adds up
# parameter bytes, and starts a new graph when a bucket is full. Then it hands each piece to your
# backend. Its first piece is always capped at `torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`,
# 1 MiB. The others are capped at DDP's `bucket_cap_mb`, 25 by default. The switch is
# `torch._dynamo.config.optimize_ddp`, on by default.
#
# DDP's own first bucket differs. It is capped at 1 MiB only when `bucket_cap_mb` is left at its
# default. Pass any cap and DDP applies it to the first bucket too, as lesson 05b showed.
# torch/_dynamo/convert_frame.py builds `DDPOptimizer` without DDP's first cap. So the graphs
# follow DDP's buckets at the default cap, and may not at other caps.
#
# Each of our layers holds 1 MiB of weight plus 2 KiB of bias. Backwards, the last layer alone
# fills the 1 MiB first bucket. The other `n_layers − 1` fit in one 25 MiB bucket: 2 graphs, as
# in section 1. With `bucket_cap_mb=1` every layer is its own bucket. The worker also reads eager
# DDP's buckets with a communication hook, after DDP rebuilt them in its first step.

# %%
def buckets_worker(rank, world_size, n_layers):
    """torch.compile(DDP(Net)) for each (layers, bucket_cap_mb, optimize_ddp); the last run wraps the other way."""
    runs = {"bucket_cap_mb=25 (default)": (n_layers, 25, True),
            "bucket_cap_mb=1": (n_layers, 1, True),
            "bucket_cap_mb=2": (n_layers, 2, True),
            "bucket_cap_mb=1, optimize_ddp=False": (n_layers, 1, False),
            "bucket_cap_mb=0.5": (n_layers, 0.5, True),
            "bucket_cap_mb=0.5, optimize_ddp=False": (n_layers, 0.5, False),
            "exercise: 6 layers, bucket_cap_mb=2": (6, 2, True),
            "DDP(torch.compile(model)), bucket_cap_mb=0.5": (n_layers, 0.5, True)}
    out = {}
    for name, (layers, cap, optimize_ddp) in runs.items():
        torch._dynamo.reset()
        backend, graphs = counting_backend()
        if name.startswith("DDP(torch.compile"):
            model = DDP(torch.compile(make(layers), backend=backend), bucket_cap_mb=cap)
        else:
            model = torch.compile(DDP(make(layers), bucket_cap_mb=cap), backend=backend)
        try:
            with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
                step(model, rank)
            out[name] = {"graphs": len(graphs), "layers": [layers_in(g) for g in graphs]}
        except Exception as e:  # noqa: BLE001 -- the error is what this run shows
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    eager = DDP(make(n_layers), bucket_cap_mb=0.5)  # the same cap without compile
    step(eager, rank)
    out["eager DDP, bucket_cap_mb=0.5"] = {"bucket_bytes_cap": eager.bucket_bytes_cap}
    for cap in (None, 1, 2):  # eager DDP's own buckets: None leaves bucket_cap_mb at its default
        out[f"eager DDP buckets, bucket_cap_mb={cap or '25 (default)'}"] = {"layers": ddp_buckets(n_layers, rank, cap)}
    return out


def ddp_buckets(n_layers, rank, cap):
    """The layers of each bucket eager DDP all-reduces in its second step, in forward order."""
    net = make(n_layers)
    ddp = DDP(net) if cap is None else DDP(net, bucket_cap_mb=cap)
    layer_of = {id(p): i for i, layer in enumerate(net.layers) for p in layer.parameters()}
    seen = []

    def hook(state, bucket):  # a communication hook: read the bucket, then all-reduce it as DDP does
        seen.append(sorted({layer_of[id(p)] for p in bucket.parameters()}))
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # DDP rebuilds its buckets after the first step
        seen.clear()
        ddp.zero_grad()
        step(ddp, rank)
    return sorted(seen)


K = launch(buckets_worker, WORLD, n_layers, backend="gloo", timeout=300)
pd.DataFrame([{"build": name, "graphs": v.get("graphs", ""), "layers of each graph, or what happened":
               v.get("layers", v.get("error", f"bucket_bytes_cap {v.get('bucket_bytes_cap')}"))[:60]}
              for name, v in K[0].items() if not name.startswith("exercise")]).set_index("build")  # ex1: not shown

# %% [markdown]
# **Claim:** the default cap gives 2 graphs: layers `0 … n_layers − 2`, then the last one.
# `bucket_cap_mb=1` gives `n_layers` graphs, one layer each. In both cases the graphs hold the
# layers of DDP's buckets. `optimize_ddp=False` gives one graph, at a cap of 1 and of 0.5 alike.
#
# **Claim:** at other caps the graphs need not follow DDP's buckets. With `bucket_cap_mb=2`,
# DDP's buckets hold 2 layers each, counted back from the last layer. Compile's first graph holds
# the last layer alone, and the graphs before it hold 2 layers each.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: graphs per cap, against eager DDP's buckets
for r in range(WORLD):
    assert K[r]["bucket_cap_mb=25 (default)"]["layers"] == [list(range(n_layers - 1)), [n_layers - 1]], K[r]
    assert K[r]["bucket_cap_mb=1"]["layers"] == [[i] for i in range(n_layers)], K[r]
    assert K[r]["bucket_cap_mb=1"]["graphs"] == n_layers, K[r]
    assert K[r]["bucket_cap_mb=1, optimize_ddp=False"]["layers"] == [list(range(n_layers))], K[r]
    assert K[r]["bucket_cap_mb=0.5, optimize_ddp=False"]["layers"] == [list(range(n_layers))], K[r]
    for cap in ("25 (default)", 1):  # where the graphs and DDP's buckets agree
        assert K[r][f"bucket_cap_mb={cap}"]["layers"] == K[r][f"eager DDP buckets, bucket_cap_mb={cap}"]["layers"], K[r]
assert torch._dynamo.config.optimize_ddp is True  # the default, in this process too
assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20 == WIDTH * WIDTH * 4


def pairs_from_the_end(layers):
    """[[0, 1], [2, 3]] for [0, 1, 2, 3]; [[0], [1, 2]] for [0, 1, 2]: 2 layers a bucket, counted back."""
    return [layers[max(0, i - 2):i] for i in range(len(layers), 0, -2)][::-1]


for r in range(WORLD):
    ddp_layers = K[r]["eager DDP buckets, bucket_cap_mb=2"]["layers"]
    graphs = K[r]["bucket_cap_mb=2"]["layers"]
    assert ddp_layers == pairs_from_the_end(list(range(n_layers))), ddp_layers
    assert graphs == pairs_from_the_end(list(range(n_layers - 1))) + [[n_layers - 1]], graphs
    assert graphs != ddp_layers
print(f"bucket_cap_mb=2: DDP's buckets {ddp_layers}; compiled graphs {graphs}")

# %% [markdown]
# ### The `bucket_cap_mb` constraint under compile
#
# `DDPOptimizer.__init__` refuses a cap below its first piece's 1 MiB. It raises an
# `AssertionError`, not a clear `ValueError`, and only at the first compiled forward. Eager DDP
# takes the same cap without complaint.
#
# **Claim:** `torch.compile(DDP(model, bucket_cap_mb=0.5))` fails at its first forward, on every
# rank, with "First bucket should be smaller/equal to other buckets to get comms warmed up
# ASAP". So does `DDP(torch.compile(model), bucket_cap_mb=0.5)`. Eager
# `DDP(model, bucket_cap_mb=0.5)` trains with a 524,288-byte cap.
#
# Under compile, keep `bucket_cap_mb >= 1`. Or switch `optimize_ddp` off: one graph, no overlap.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: bucket_cap_mb=0.5 fails under compile, not in eager DDP
for r in range(WORLD):
    for name in ("bucket_cap_mb=0.5", "DDP(torch.compile(model)), bucket_cap_mb=0.5"):
        error = K[r][name].get("error", "")
        assert error == ("AssertionError: First bucket should be smaller/equal to other buckets "
                         "to get comms warmed up ASAP"), (name, error)
    assert K[r]["eager DDP, bucket_cap_mb=0.5"]["bucket_bytes_cap"] == 2**19, K[r]
print(K[0]["bucket_cap_mb=0.5"]["error"])

# %% [markdown]
# ## 3. Checkpoint keys
#
# Both wrappers are modules that hold the model as a submodule. DDP calls it `module`;
# `torch.compile`'s `OptimizedModule` calls it `_orig_mod`. Their `state_dict()` keys carry that
# path, so a checkpoint saved from the wrapper does not load into a plain model. The worker trains
# one step in each order. Rank 0 saves into memory and loads into a fresh plain `Net`.

# %%
def plain_state(model):
    """The state_dict of the model inside DDP / torch.compile wrappers, in any order (a copy)."""
    state = dict(model.state_dict())
    for prefix in ("_orig_mod.", "module.", "_orig_mod."):  # covers both wrapping orders
        consume_prefix_in_state_dict_if_present(state, prefix)
    return state


def keys_worker(rank, world_size, n_layers):
    out = {}
    for name, wrap in {"torch.compile(DDP(net))": lambda net: torch.compile(DDP(net), backend="eager"),
                       "DDP(torch.compile(net))": lambda net: DDP(torch.compile(net, backend="eager"))}.items():
        torch._dynamo.reset()
        net = make(n_layers)
        model = wrap(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step(model, rank)
        opt.step()
        keys = list(model.state_dict())
        fresh = make(n_layers)
        try:
            fresh.load_state_dict(model.state_dict())
            wrong = "loaded"
        except RuntimeError as e:
            wrong = str(e)  # "Error(s) in loading state_dict for Net: Missing key(s) ..."
        restored = True
        if rank == 0:  # one rank saves, as in a real run
            buffer = io.BytesIO()  # a file in a real run
            torch.save(plain_state(model), buffer)
            buffer.seek(0)
            fresh.load_state_dict(torch.load(buffer))  # strict: every key must match
            restored = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), net.state_dict().values()))
        prefix = keys[0][:keys[0].index("layers.")]
        out[name] = {"first key": keys[0], "all keys prefixed": all(k.startswith(prefix) for k in keys),
                     "load the wrapper's state": wrong.splitlines()[0],
                     "keys missing": "Missing key(s) in state_dict" in wrong,
                     "net holds the trained values": all(torch.equal(a, b) for a, b in zip(
                         net.state_dict().values(), model.state_dict().values())) and not torch.equal(
                         net.layers[0].weight, make(n_layers).layers[0].weight),
                     "restored from the saved plain state": restored,
                     "plain keys": list(plain_state(model)), "net keys": list(net.state_dict())}
    out["plain Net keys"] = list(make(n_layers).state_dict())
    return out


S = launch(keys_worker, WORLD, n_layers, backend="gloo", timeout=300)
pd.DataFrame({name: {k: v for k, v in S[0][name].items() if "keys" not in k} for name in list(S[0])[:2]}).T

# %% [markdown]
# Two ways give the plain model's keys. One is the `state_dict()` of `net`, the object you
# wrapped: the wrappers share its parameters, so it holds the trained values. The other is the
# wrapper's state with the prefixes stripped by torch's `consume_prefix_in_state_dict_if_present`,
# as `plain_state` above does.
#
# **Claim:** every key carries the wrappers' prefix: `_orig_mod.module.layers.0.weight` under
# `torch.compile(DDP(net))`, `module._orig_mod.layers.0.weight` under `DDP(torch.compile(net))`.
# Loading either into a plain `Net` raises "Error(s) in loading state_dict for Net": keys are
# missing. `net.state_dict()` holds the trained values. The stripped state loads strictly into a
# fresh `Net` and gives back the trained weights.

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: checkpoint keys in both orders, and the restored weights
prefixes = {"torch.compile(DDP(net))": "_orig_mod.module.", "DDP(torch.compile(net))": "module._orig_mod."}
for r in range(WORLD):
    for name, prefix in prefixes.items():
        result = S[r][name]
        assert result["first key"] == prefix + "layers.0.weight" and result["all keys prefixed"], result
        assert result["load the wrapper's state"].startswith("Error(s) in loading state_dict for Net"), result
        assert result["keys missing"], result
        assert result["plain keys"] == result["net keys"] == S[r]["plain Net keys"], result
        assert result["net holds the trained values"] and result["restored from the saved plain state"], (r, name)
print(S[0]["torch.compile(DDP(net))"]["load the wrapper's state"])

# %%
print(f"lesson 08b ran in {time.perf_counter() - t_notebook:.0f} s")

# %% [markdown]
# ## What we saw
#
# | question | `torch.compile(DDP(model))` | `DDP(torch.compile(model))` |
# | --- | --- | --- |
# | own model class | compiled, one graph per `DDPOptimizer` bucket | the same |
# | `nn.Sequential` of layers | nothing compiled | compiled |
# | graphs, default cap | 2: first bucket 1 MiB, then ≤ 25 MiB | 2 |
# | graphs, other caps | first graph 1 MiB, then `bucket_cap_mb`: may differ from DDP's buckets | the same |
# | `bucket_cap_mb < 1` | `AssertionError` at the first forward | the same |
# | checkpoint keys | `_orig_mod.module.…` | `module._orig_mod.…` |
#
# Compiling a DDP model is not all-or-nothing, and nothing tells you when nothing was compiled.
# Count the graphs with a recording backend, or read `TORCH_LOGS="graph_breaks"`. Under DDP the
# compiler splits the graph by its own bucket arithmetic. At the default cap its pieces are DDP's
# buckets; at other caps its first piece stays at 1 MiB. So `bucket_cap_mb` decides how many
# graphs you get, and it must be at least 1 MiB. For checkpoints, save the object you wrapped,
# `net.state_dict()`. Or strip the prefixes with `consume_prefix_in_state_dict_if_present`.
#
# ## Exercises
#
# Each asks for a value. Predict it by hand first. Then set `answer_N` in place of `None` and run
# the check cell below it. It prints "correct" or "not yet" with a hint. In the full lesson a
# solution follows each check, collapsed; student copies leave the solutions out. Every solution
# runs when the full lesson runs, so each is known to pass its check.

# %% [markdown]
# ### Exercise 1: how many graphs?
#
# `torch.compile(DDP(Net(6), bucket_cap_mb=2))`: which layers does each graph hold? Answer with
# a list of lists in forward order, like section 2's table: `[[0, 1], [2]]`.

# %% tags=["exercise"]
answer_1 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 1
# expected: what section 2's worker recorded for this build
expected_1 = K[0]["exercise: 6 layers, bucket_cap_mb=2"]["layers"]
check_answer("ex1", answer_1, expected_1, hint="walk backwards: first bucket 1 MiB, then 2 MiB each; a layer is 1 MiB + 2 KiB")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 1 (try the exercise first)
# backwards: layer 5 fills the 1 MiB first bucket; layers 4, 3 pass 2 MiB; layers 2, 1 too; layer 0 is left.
solution_1 = [[0], [1, 2], [3, 4], [5]]
check_answer("ex1", solution_1, expected_1, strict=True)

# %% [markdown]
# ### Exercise 2: the key of a bias
#
# You trained `DDP(torch.compile(net))` with `net = Net(n_layers)`. What is the key of layer 1's
# bias in the wrapper's `state_dict()`? What is it after `plain_state`? Answer with a tuple of
# two strings.

# %% tags=["exercise"]
answer_2 = None  # your answer here

# %% jupyter={"source_hidden": true} tags=["check"]
# Check: your answer to exercise 2
# expected: from section 3's worker
keys_2 = [k for k in S[0]["DDP(torch.compile(net))"]["plain keys"] if k.startswith("layers.1.bias")]
expected_2 = ("module._orig_mod." + keys_2[0], keys_2[0])
check_answer("ex2", answer_2, expected_2, hint="DDP is the outer wrapper: its prefix comes first")

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution of exercise 2 (try the exercise first)
solution_2 = ("module._orig_mod.layers.1.bias", "layers.1.bias")
check_answer("ex2", solution_2, expected_2, strict=True)

# %% [markdown]
# <!-- next:start -->
# **Next:** [09 a cluster on the laptop](09_cluster_on_a_laptop.ipynb): run unchanged DDP, the sampler and FSDP2 on 64 or 256 simulated ranks in one process; count the bytes each rank sends, size the global batch and schedule, and say what a simulation cannot show.
# <!-- next:end -->
